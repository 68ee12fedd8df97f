"""``inspect`` / ``verify`` / ``inspect --strict`` plug-in of the ``matrix/`` group.

Contract: see :mod:`bevcompile.store.plugins`. Everything is recomputed from the arrays, the
stored config and ``build_options``; other attributes are only compared with the
recomputation. Pure: no zarr, no printing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import numpy as np
import numpy.typing as npt

from ..errors import UsageError
from ..rig.config import RigConfig
from ..rig.region import RegionTable, expand_of_cells, region_table
from ..store.plugins import REBUILT_ATTRS, Check, CheckContext, VerifyRow, compare, same_recorded
from ..store.zarr_io import array_sha256
from .build import (
    DEPTH_MODES,
    INT8_MAX,
    INT8_PRODUCTS,
    VALUES_ATTR,
    VALUES_LEARNED,
    MatrixOptions,
    build_matrix,
    dequantize_rows_int8,
    int8_errors,
    is_learned,
    matrix_dimension_names,
    n_columns,
    quantize_rows_int8,
    round_up,
    tile_blocks,
)
from .layout import tile_entries
from .learned import INIT_ARRAY, INIT_SOURCE, LearnedRecord, coo_slots, learned_products, value_change
from .precision import (
    decode_fp16,
    decoded_errors,
    fp16_row_tile_offsets,
    fp16_row_tile_weight,
    int8_row_snr_db,
    mixed_ell_values,
    mixed_tile_values,
    row_distances_m,
    select_fp16_rows,
    tile_row_span,
)
from .prior import ARRAY as PRIOR_ARRAY
from .prior import UNIFORM, DepthPrior, prior_of_store
from .reference import bev_pool, grid_pool, reference_matrix, region_reference_matrix

GROUP = "matrix"
FLOAT_REL_TOL = 1e-5
"""float32 products vs the float64 reference: max_abs <= FLOAT_REL_TOL * max|reference|."""
INT8_MIN_PSNR_DB = 40.0
VERIFY_FULL_POINTS = 20_000_000
"""Above this many frustum points verify compares sampled rows only (the reference holds a
camera's points at once)."""
VERIFY_FULL_GRID_SAMPLES = 1_000_000
"""Above this many grid samples (cameras x heights x cells) verify compares sampled rows only
(the grid reference is a plain Python loop)."""
VERIFY_SAMPLED_ROWS = 256
SUM_TOL = 1e-5

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]

BASE_ARRAYS = {
    "coo_row": np.int32,
    "coo_col": np.int32,
    "coo_val": np.float32,
    "ell_index": np.int32,
    "ell_weight": np.float32,
    "camera_mass": np.float32,
}
TILE_ARRAYS = {"tile_cols": np.int32, "tile_col_offsets": np.int64, "tile_weight": np.float32}
INT8_ARRAYS = {"ell_weight_int8": np.int8, "row_scale": np.float32}
TILE_INT8_ARRAYS = {"tile_weight_int8": np.int8, "tile_row_scale": np.float32}
FP16_ARRAYS = {"ell_weight_fp16": np.float16}
TILE_FP16_ARRAYS = {"tile_weight_fp16": np.float16}
MIXED_ARRAYS = {"fp16_rows": np.int32, "fp16_row_weight": np.float16}
TILE_MIXED_ARRAYS = {"fp16_row_tile_weight": np.float16}
FP16_MIN_PSNR_DB = 60.0
"""verify: fp16 products pass at PSNR >= 60 dB (peak = the reference's range; measured ~80 dB on nuScenes)."""


REGION_ARRAYS = {"cells": np.int32, "expand": np.int32}


def expected_arrays(options: MatrixOptions, learned: bool = False, region: bool = False) -> dict[str, Any]:
    """Array name -> dtype of the group built with ``options`` (``learned``: absorbed values, so
    also ``init_ell_weight``; ``region``: a config with ``bev.region``, so ``cells`` + ``expand``)."""
    out: dict[str, Any] = dict(BASE_ARRAYS)
    if region:
        out.update(REGION_ARRAYS)
    if learned:
        out[INIT_ARRAY] = np.float32
    if options.mode == "ray" and options.depth_prior != UNIFORM:
        out[PRIOR_ARRAY] = np.float64
    if options.compact_rows:
        out["row_ids"] = np.int32
    if options.tile_rows is not None:
        out.update(TILE_ARRAYS)
    if options.quantize in INT8_PRODUCTS:
        out.update(INT8_ARRAYS)
        if options.tile_rows is not None:
            out.update(TILE_INT8_ARRAYS)
    if options.quantize == "fp16":
        out.update(FP16_ARRAYS)
        if options.tile_rows is not None:
            out.update(TILE_FP16_ARRAYS)
    if options.quantize == "mixed":
        out.update(MIXED_ARRAYS)
        if options.tile_rows is not None:
            out.update(TILE_MIXED_ARRAYS)
    return out


class _Checks:
    def __init__(self) -> None:
        self.items: list[Check] = []

    def add(self, name: str, array: str, passed: bool, reason: str) -> bool:
        self.items.append(Check(name, f"{GROUP}/{array}", bool(passed), " ".join(reason.split())))
        return bool(passed)


def _options(attrs: Mapping[str, Any]) -> MatrixOptions:
    data = attrs.get("build_options")
    if not isinstance(data, Mapping):
        raise ValueError("build_options missing or not a mapping")
    return MatrixOptions.from_dict(data)


# --------------------------------------------------------------------------------------
# check
# --------------------------------------------------------------------------------------


def dimension_names_matrix(name: str, ndim: int, attrs: Mapping[str, Any]) -> tuple[str, ...] | None:
    """The ``dimension_names`` the writer gives ``matrix/<name>`` (a learned store's
    ``init_ell_weight`` those of ``ell_weight``; None: no such array, the contract check says so)."""
    try:
        return matrix_dimension_names(name, ndim, {INIT_ARRAY: INIT_SOURCE})
    except KeyError:
        return None


def check_matrix(ctx: CheckContext, arrays: Mapping[str, np.ndarray], attrs: Mapping[str, Any]) -> list[Check]:
    """Invariants of ``matrix/`` (see README "What inspect, verify and inspect --strict do with matrix/")."""
    out = _Checks()
    rig = ctx.rig
    try:
        options = _options(attrs)
    except Exception as exc:
        out.add("build_options", "", False, f"build_options unusable: {exc}")
        return out.items
    out.add("build_options", "", True, f"build_options parse: {options.to_dict()}")
    ny, nx = rig.bev.ny, rig.bev.nx
    n_cells = ny * nx
    n_cols = n_columns(rig, options.mode)
    learned = is_learned(attrs)
    values_attr = attrs.get(VALUES_ATTR)
    if values_attr is not None and not learned:
        out.add("values", "", False, f"attribute values is {values_attr!r}: absent (geometric values) or {VALUES_LEARNED!r} (absorbed) expected")
    # contract: presence, dtype, dimensionality
    table = region_table(rig.bev) if rig.bev.region is not None else None
    wanted = expected_arrays(options, learned, table is not None)
    ok_arrays: dict[str, np.ndarray] = {}
    for name, dtype in wanted.items():
        arr = arrays.get(name)
        if arr is None:
            out.add("contract", name, False, "array missing or unreadable (see the store's read and metadata checks)")
            continue
        ndim = 2 if name.startswith("ell_") or name in (INIT_ARRAY, "cells", "fp16_row_weight") else 3 if name == "camera_mass" else 1
        if name == PRIOR_ARRAY:  # (D,), (n_cam, D) or (n_cam, D, H_f, W_f); its values: the depth_prior check
            ndim = arr.ndim if arr.ndim in (1, 2, 4) else 1
        if arr.dtype != np.dtype(dtype) or arr.ndim != ndim:
            out.add("contract", name, False, f"dtype {arr.dtype} ndim {arr.ndim}; expected {np.dtype(dtype)} ndim {ndim}")
            continue
        ok_arrays[name] = arr
        out.add("contract", name, True, f"present, {arr.dtype} {arr.shape}")
    extra = sorted(set(arrays) - set(wanted))
    if extra:
        out.add("contract", "", False, f"arrays not produced by these build_options: {', '.join(extra)}")
    if any(n not in ok_arrays for n in ("coo_row", "coo_col", "coo_val")):
        return out.items
    row = ok_arrays["coo_row"].astype(np.int64)
    col = ok_arrays["coo_col"].astype(np.int64)
    val = ok_arrays["coo_val"]
    if not (row.size == col.size == val.size):
        out.add("coo_shape", "coo_row", False, f"coo lengths differ: row {row.size}, col {col.size}, val {val.size}")
        return out.items
    # rows
    if options.compact_rows:
        if "row_ids" not in ok_arrays:
            return out.items
        row_ids = ok_arrays["row_ids"].astype(np.int64)
        n_rows = int(row_ids.size)
        good = bool(row_ids.size == 0 or (row_ids.min() >= 0 and row_ids.max() < n_cells and np.all(np.diff(row_ids) > 0)))
        out.add("row_ids", "row_ids", good, f"{n_rows} row ids strictly increasing in [0, {n_cells})" if good else f"row_ids not strictly increasing within [0, {n_cells})")
        row_cells: I64 | None = row_ids if good else None
    elif table is not None:
        n_rows = table.n_kept + 1  # the kept (super-)cells, then the zero row
        row_cells = None
        _check_region(out, ok_arrays, table, row)
    else:
        n_rows = n_cells
        row_cells = np.arange(n_cells, dtype=np.int64)
    # COO
    in_range = bool(row.size == 0 or (row.min() >= 0 and row.max() < n_rows and col.min() >= 0 and col.max() < n_cols))
    out.add("coo_in_range", "coo_row", in_range, f"{row.size} entries, rows in [0, {n_rows}), cols in [0, {n_cols})" + ("" if in_range else ": out of range"))
    if not in_range:
        return out.items
    key = row * n_cols + col
    sorted_unique = bool(np.all(np.diff(key) > 0))
    n_bad = int(np.count_nonzero(np.diff(key) <= 0))
    out.add("coo_sorted_unique", "coo_row", sorted_unique, "sorted by (row, col), no duplicates" if sorted_unique else f"{n_bad} adjacent pair(s) not strictly increasing in (row, col)")
    if learned:  # trained values: any sign, an entry that became 0 stays (the topology is fixed)
        finite = bool(np.all(np.isfinite(val)))
        signs = f"{int(np.count_nonzero(val == 0))} zero, {int(np.count_nonzero(val < 0))} negative"
        out.add("coo_values", "coo_val", finite, f"every learned value finite ({signs})" if finite else f"{int(np.count_nonzero(~np.isfinite(val)))} learned value(s) not finite")
    else:
        finite_pos = bool(np.all(np.isfinite(val)) and np.all(val > 0))
        out.add("coo_values", "coo_val", finite_pos, "every stored value finite and > 0" if finite_pos else f"{int(np.count_nonzero(~(np.isfinite(val) & (val > 0))))} value(s) not finite or <= 0")
    nnz_row = np.bincount(row, minlength=n_rows)
    init_val: np.ndarray | None = None  # learned: the geometric values of the COO entries
    if learned:
        init_val = _check_init(out, ok_arrays.get(INIT_ARRAY), ok_arrays.get("ell_weight"), row, nnz_row)
    max_nnz = int(nnz_row.max()) if nnz_row.size else 0
    if options.topk > 0:
        out.add("row_nnz_le_k", "coo_row", max_nnz <= options.topk, f"max row nnz {max_nnz} vs K = {options.topk}")
    if options.compact_rows:
        empty = int(np.count_nonzero(nnz_row == 0))
        out.add("compact_rows_nonempty", "row_ids", empty == 0, f"{empty} compacted row(s) without entries")
    if options.normalize == "mean" and not (learned and init_val is None):
        # learned: the init rows sum to 1 (the rule describes init_ell_weight; trained rows need not)
        summed, where = (init_val, INIT_ARRAY) if init_val is not None else (val, "coo_val")
        sums = np.bincount(row, weights=summed.astype(np.float64), minlength=n_rows)[nnz_row > 0]
        worst = float(np.abs(sums - 1.0).max()) if sums.size else 0.0
        out.add("mean_rows_sum_to_1", where, worst <= SUM_TOL, f"max |row sum - 1| = {worst:.3g} (tolerance {SUM_TOL:g})")
    # provenance: a few rows re-derived from the stored config (a matrix of another rig never matches)
    checked = init_val if learned else val
    if checked is not None:
        _check_values_match_config(out, rig, options, arrays, row, col, checked, nnz_row, row_cells, table, learned)
    # attributes vs recomputation
    rows_pad = round_up(max(n_rows, 1), options.align)
    cols_pad = round_up(n_cols, options.align)
    k_pad = round_up(options.topk, options.align) if options.topk > 0 else round_up(max(max_nnz, 1), options.align)
    non_empty = nnz_row[nnz_row > 0]
    frustum = options.mode in DEPTH_MODES
    want_attrs: dict[str, Any] = {
        "logical_shape": [n_rows, n_cols],
        "padded_shape": [rows_pad, cols_pad],
        "nnz": int(row.size),
        # what a consumer reads without parsing build_options: must agree with it and the arrays
        "mode": options.mode,
        "splat": options.splat,
        "normalize": options.normalize,
        "rounding": options.rounding if frustum else None,
        "topk": options.topk,
        "align": options.align,
        "n_cells": n_cells,
        "bev_shape": [ny, nx],
        "cameras": list(rig.camera_names),
        "feature_size": list(rig.feature_size),
        "cols_pad": cols_pad,
        "columns_per_camera": n_cols // rig.n_cam,
        "coo.shape": [n_rows, n_cols],
        "ell.shape": [rows_pad, k_pad],
        "ell.rows_pad": rows_pad,
        "ell.k_pad": k_pad,
        "row_nnz.min": int(non_empty.min()) if non_empty.size else 0,
        "row_nnz.median": float(np.median(non_empty)) if non_empty.size else 0.0,
        "row_nnz.max": int(non_empty.max()) if non_empty.size else 0,
        "row_nnz.empty_rows": int(n_cells - non_empty.size) if table is None else int(n_rows - 1 - non_empty.size),
        "camera_mass.shape": [rig.n_cam, ny, nx],
    }
    if options.mode == "ray":
        try:
            prior = prior_of_store(options.depth_prior, arrays.get(PRIOR_ARRAY), rig, "matrix/")
            out.add("depth_prior", PRIOR_ARRAY if not prior.uniform else "", True, f"depth prior {options.depth_prior[:19]}: checked (shape, finite, >= 0) and its hash matches build_options")
            want_attrs["depth_prior.kind"] = prior.record()["kind"]
            if prior.raw is not None:
                want_attrs["depth_prior.sha256"] = prior.record()["sha256"]
                want_attrs["depth_prior.shape"] = list(prior.raw.shape)
        except ValueError as exc:
            out.add("depth_prior", PRIOR_ARRAY, False, str(exc))
    if frustum:
        want_attrs["depth_bins"] = list(rig.depth.values())
        want_attrs["n_depth_bins"] = rig.depth.n_bins
    else:
        want_attrs["heights"] = list(rig.bev.heights)
    if options.tile_rows is not None:
        want_attrs["tiles.tile_rows"] = options.tile_rows
    if options.compact_rows:
        want_attrs["row_ids.shape"] = [n_rows]
    for name, want in want_attrs.items():
        got = _attr(attrs, name)
        out.add("attrs", "", same_recorded(got, want), f"{name} {got!r} vs recomputed {want!r}")
    # ELL
    if "ell_index" in ok_arrays and "ell_weight" in ok_arrays:
        _check_ell(out, ok_arrays["ell_index"], ok_arrays["ell_weight"], row, col, val, nnz_row, (rows_pad, k_pad), n_cols)
    # tiles
    tiles_ok: bool | None = None  # None: no tiles, or tile arrays missing (the contract check says so)
    if options.tile_rows is not None and all(n in ok_arrays for n in TILE_ARRAYS):
        tiles_ok = _check_tiles(out, ok_arrays, options, row, col, val, n_rows, n_cols, attrs)
    # int8, fp16, mixed
    if options.quantize in INT8_PRODUCTS:
        _check_int8(out, ok_arrays, options, attrs, tiles_ok)
    if options.quantize == "fp16":
        _check_fp16(out, ok_arrays, options, attrs, tiles_ok)
    if options.quantize == "mixed":
        _check_mixed(out, ok_arrays, options, attrs, tiles_ok, rig, n_rows, nnz_row, None if table is None else table.cells)
    if learned:
        _check_learned_attrs(out, attrs, ok_arrays, init_val, val)
    # camera mass
    if "camera_mass" in ok_arrays:
        mass = ok_arrays["camera_mass"]
        want_shape = (rig.n_cam, ny, nx)
        if mass.shape != want_shape:
            out.add("camera_mass", "camera_mass", False, f"shape {mass.shape} vs {want_shape}")
        elif row_cells is None and table is None:
            out.add("camera_mass", "camera_mass", False, "not checked: row_ids is invalid, so rows cannot be mapped to BEV cells")
        else:
            cam = col // (n_cols // rig.n_cam)
            if table is not None:  # per row, then every fine cell reads its row (the zero row outside the region)
                per_row = np.bincount(cam * n_rows + row, weights=val.astype(np.float64), minlength=rig.n_cam * n_rows).reshape(rig.n_cam, n_rows)
                recomputed = per_row[:, table.expand].reshape(want_shape).astype(np.float32)
            else:
                assert row_cells is not None
                cells = row_cells[row]
                recomputed = (
                    np.bincount(cam * n_cells + cells, weights=val.astype(np.float64), minlength=rig.n_cam * n_cells)
                    .reshape(want_shape)
                    .astype(np.float32)
                )
            diff = float(np.abs(recomputed.astype(np.float64) - mass.astype(np.float64)).max()) if mass.size else 0.0
            out.add("camera_mass", "camera_mass", diff == 0.0, f"max |camera_mass - recomputed from COO| = {diff:.3g}")
    return out.items


SPOT_ROWS = 32
"""Rows ``values_match_config`` re-derives (evenly spread over the rows that hold entries)."""
SPOT_POINTS = 1 << 18
"""At most this many frustum points (entries x depth bins in ray mode) in the spot check."""
SPOT_REL_TOL = 1e-5
"""|stored - recomputed| <= SPOT_REL_TOL x the row's largest value: float32 storage rounds at
6e-8 relative; a recalibration moves a bilinear weight, or the cell a point lands in, far more."""


def _spot_rows(row: I64, nnz_row: I64, cost_per_entry: int) -> I64:
    """Up to :data:`SPOT_ROWS` rows holding entries, evenly spread, within :data:`SPOT_POINTS`."""
    nonempty = np.flatnonzero(nnz_row > 0)
    if not nonempty.size:
        return nonempty
    picks = np.unique(nonempty[np.linspace(0, nonempty.size - 1, min(SPOT_ROWS, nonempty.size)).round().astype(np.int64)])
    budget = np.cumsum(nnz_row[picks] * cost_per_entry)
    return picks[: max(1, int(np.searchsorted(budget, SPOT_POINTS, side="right")))]


def _check_values_match_config(
    out: _Checks,
    rig: RigConfig,
    options: MatrixOptions,
    arrays: Mapping[str, np.ndarray],
    row: I64,
    col: I64,
    values: np.ndarray,
    nnz_row: I64,
    row_cells: I64 | None,
    table: RegionTable | None,
    learned: bool,
) -> None:
    """``values_match_config``: the entries of a few rows, re-derived from the stored config alone
    (the frustum points, or grid samples, of their columns splatted to their rows), equal the
    stored values (``init_ell_weight`` of a learned store): a ``matrix/`` copied from another car
    fails here even when its ``config_sha256`` was removed or set to the root's. Cheap: the
    points of the checked entries only, not a rebuild."""
    where = INIT_ARRAY if learned else "coo_val"
    frustum = options.mode in DEPTH_MODES
    cost = rig.depth.n_bins if options.mode == "ray" else 1
    if options.compact_rows and row_cells is None:
        return  # row_ids is invalid: its own check failed
    picks = _spot_rows(row, nnz_row, cost)
    if not picks.size:
        out.add("values_match_config", where, True, "no entries to re-derive (an empty matrix)")
        return
    starts, ends = np.searchsorted(row, picks), np.searchsorted(row, picks, side="right")
    take = np.concatenate([np.arange(a, b) for a, b in zip(starts, ends, strict=True)])
    e_row, e_col, stored = row[take], col[take], values[take].astype(np.float64)
    try:
        if frustum:
            raw = _frustum_raw(rig, options, arrays, e_row, e_col, row_cells, table)
        else:
            raw = _grid_raw(rig, options, e_row, e_col, row_cells, table)
    except ValueError as exc:  # the depth prior is unusable: the depth_prior check says why
        out.add("values_match_config", where, False, f"cannot re-derive the values: {exc}")
        return
    if options.normalize == "mean":
        sums = np.zeros(picks.size)
        slot = np.searchsorted(picks, e_row)
        np.add.at(sums, slot, raw)
        want = raw / np.where(sums[slot] > 0, sums[slot], 1.0)
    else:
        want = raw
    scale = np.zeros(picks.size)
    np.maximum.at(scale, np.searchsorted(picks, e_row), np.abs(want))
    diff = np.abs(stored - want)
    unreached = int(np.count_nonzero(raw == 0))
    bad = diff > SPOT_REL_TOL * scale[np.searchsorted(picks, e_row)]
    n_bad = int(np.count_nonzero(bad))
    worst = float((diff / np.maximum(scale[np.searchsorted(picks, e_row)], 1e-300)).max()) if diff.size else 0.0
    what = f"{picks.size} row(s), {take.size} entries re-derived from the stored config ({options.mode}, {options.splat})"
    if n_bad:
        out.add(
            "values_match_config", where, False,
            f"{what}: {n_bad} differ ({unreached} of them from columns whose points never reach their row), max |stored - "
            f"recomputed| = {worst:.3g} x the row's largest value: built from another rig's geometry (copied from another "
            "car's store?); rebuild it",
        )
    else:
        out.add("values_match_config", where, True, f"{what}: max |stored - recomputed| = {worst:.2g} x the row's largest value (tolerance {SPOT_REL_TOL:g})")


def _rows_of_cells(cells: I64, row_cells: I64 | None, table: RegionTable | None, n_cells: int) -> I64:
    """The matrix row of each fine BEV cell (-1: no row), for plain, compacted and region rows."""
    if table is not None:
        out = np.where(cells >= 0, table.row_of_cell()[np.clip(cells, 0, None)], -1)
    elif row_cells is not None and row_cells.size != n_cells:  # compacted: row_ids maps row -> cell
        pos = np.clip(np.searchsorted(row_cells, cells), 0, max(row_cells.size - 1, 0))
        out = np.where((cells >= 0) & (row_cells.size > 0) & (row_cells[pos] == cells), pos, -1) if row_cells.size else np.full(cells.shape, -1)
    else:
        out = cells
    return np.asarray(out, dtype=np.int64)


def _frustum_raw(
    rig: RigConfig, options: MatrixOptions, arrays: Mapping[str, np.ndarray], e_row: I64, e_col: I64, row_cells: I64 | None,
    table: RegionTable | None,
) -> npt.NDArray[np.float64]:
    """The raw weight of each entry ``(e_row, e_col)``: frustum mode, the splat weight of the column's
    point into the row; ray mode, the prior-weighted sum of its depth bins' (in increasing ``d``)."""
    from .reference import frustum_cell_coordinates_of, splat_cell_corners

    w_f, h_f = rig.feature_size
    plane = w_f * h_f
    n_bins = rig.depth.n_bins
    n_cells = rig.bev.ny * rig.bev.nx
    prior = None
    if options.mode == "ray":
        prior = prior_of_store(options.depth_prior, arrays.get(PRIOR_ARRAY), rig, "matrix/").normalised(rig)
        cam, pix = np.divmod(e_col, plane)
        d = np.tile(np.arange(n_bins), e_col.size)
        cam, pix, rows = np.repeat(cam, n_bins), np.repeat(pix, n_bins), np.repeat(e_row, n_bins)
    else:
        cam, rest = np.divmod(e_col, n_bins * plane)
        d, pix = np.divmod(rest, plane)
        rows = e_row
    weight = np.zeros(cam.size)
    for c in np.unique(cam):
        at = np.flatnonzero(cam == c)
        v, u = np.divmod(pix[at], w_f)
        fx, fy, fz, ok = frustum_cell_coordinates_of(rig, int(c), u, v, d[at], options.precision)
        cells, corner_w = splat_cell_corners(rig, fx, fy, fz, ok, options.splat, options.rounding)
        hits = _rows_of_cells(cells, row_cells, table, n_cells) == rows[at, None]
        weight[at] = np.where(hits, corner_w, 0.0).sum(axis=1)
        if prior is not None:
            weight[at] *= prior.weights(int(c), d[at], pix[at])
    if prior is None:
        return weight
    return weight.reshape(e_col.size, n_bins).sum(axis=1)


def _grid_raw(
    rig: RigConfig, options: MatrixOptions, e_row: I64, e_col: I64, row_cells: I64 | None, table: RegionTable | None
) -> npt.NDArray[np.float64]:
    """The raw weight of each grid-mode entry: the taps (bilinear, or the nearest pixel) of the
    row's cell centres at every height, projected afresh, that land on the column's pixel."""
    from ..grid.gather import bilinear_corners
    from ..grid.ipm import inside_feature_map
    from ..rig.geometry import project_bev_to_feature

    bev = rig.bev
    w_f, h_f = rig.feature_size
    picks = np.unique(e_row)
    fine_rows, fine_cells = [], []
    for r in picks:
        if table is not None:
            y0, x0, size = (int(v) for v in table.cells[r])
            block = (np.arange(y0, y0 + size)[:, None] * bev.nx + np.arange(x0, x0 + size)[None, :]).ravel()
        else:
            block = np.array([row_cells[r] if row_cells is not None else r], dtype=np.int64)
        fine_cells.append(block)
        fine_rows.append(np.full(block.size, r, dtype=np.int64))
    cells, owners = np.concatenate(fine_cells), np.concatenate(fine_rows)
    cell_y, cell_x = np.divmod(cells, bev.nx)
    heights = np.asarray(bev.heights, dtype=np.float64)
    centres = np.empty((heights.size, cells.size, 3))
    centres[..., 0] = (bev.x.min + (cell_x + 0.5) * bev.x.step)[None, :]
    centres[..., 1] = (bev.y.min + (cell_y + 0.5) * bev.y.step)[None, :]
    centres[..., 2] = heights[:, None]
    sums: dict[tuple[int, int], float] = {}
    for cam_index, camera in enumerate(rig.cameras):
        uv, valid = project_bev_to_feature(rig, camera, centres)
        valid &= inside_feature_map(uv, rig.feature_size)
        if options.splat == "nearest":
            u, v = np.rint(np.where(valid, uv[..., 0], -1.0)), np.rint(np.where(valid, uv[..., 1], -1.0))
            taps = [(u, v, np.ones(u.shape))]
        else:
            pixel, corner_w, _frac, _inside = bilinear_corners(uv, valid, (w_f, h_f))
            taps = [((pixel[..., k] % w_f).astype(np.float64), (pixel[..., k] // w_f).astype(np.float64), corner_w[..., k]) for k in range(4)]
        for pu, pv, wgt in taps:
            keep = valid & (pu >= 0) & (pu < w_f) & (pv >= 0) & (pv < h_f) & (wgt > 0)
            for h, k in zip(*np.nonzero(keep), strict=True):
                key = (int(owners[k]), (cam_index * h_f + int(pv[h, k])) * w_f + int(pu[h, k]))
                sums[key] = sums.get(key, 0.0) + float(wgt[h, k])
    return np.array([sums.get((int(r), int(c)), 0.0) for r, c in zip(e_row, e_col, strict=True)])


def _check_region(out: _Checks, arrays: Mapping[str, np.ndarray], table: RegionTable, row: I64) -> None:
    """``cells`` and ``expand`` of a ``bev.region`` store: equal to the ones the stored config gives
    (:func:`bevcompile.rig.region.region_table`), ``expand`` the index of ``cells``, and no entry
    in the zero row."""
    cells, expand = arrays.get("cells"), arrays.get("expand")
    if cells is not None:
        same = bool(cells.shape == table.cells.shape and np.array_equal(cells, table.cells))
        sizes = {int(s): int(c) for s, c in zip(*np.unique(table.cells[:, 2], return_counts=True), strict=True)}
        out.add("region_cells", "cells", same, f"{table.n_kept} kept (super-)cells by size {sizes}, as bev.region gives" if same else f"shape {cells.shape}: differs from the cell table of the stored bev.region ({table.cells.shape})")
    if expand is not None:
        same = bool(expand.shape == table.expand.shape and np.array_equal(expand, table.expand))
        out.add("region_expand", "expand", same, f"({expand.size},) index of {table.n_fine_kept} fine cells into {table.n_kept} rows + the zero row, as bev.region gives" if same else "differs from the expand index of the stored bev.region")
        if cells is not None and cells.ndim == 2 and cells.shape[1] == 3 and expand.ndim == 1:
            ny, nx = table.bev_shape
            bounds = bool(cells.size == 0 or (cells.min() >= 0 and (cells[:, 0] + cells[:, 2]).max() <= ny and (cells[:, 1] + cells[:, 2]).max() <= nx))
            ok = bounds and np.array_equal(expand_of_cells(cells, (ny, nx)), expand)
            out.add("region_expand_of_cells", "expand", ok, "each fine cell reads the row of the stored (super-)cell holding it, the zero row elsewhere" if ok else "expand is not the index of the stored cells")
    zero = int(np.count_nonzero(row == table.n_kept))
    out.add("region_zero_row", "coo_row", zero == 0, f"row {table.n_kept} (the zero row) holds {zero} entries")


def _check_init(out: _Checks, init: np.ndarray | None, ell_weight: np.ndarray | None, row: I64, nnz_row: I64) -> np.ndarray | None:
    """``init_ell_weight`` of a learned store: the ELL shape, padding 0, geometric values (finite,
    > 0) at the real slots. Returns the init value of every COO entry (None if unusable)."""
    if init is None:
        return None  # the contract check failed it
    if ell_weight is not None and init.shape != ell_weight.shape:
        out.add("init_shape", INIT_ARRAY, False, f"{init.shape} vs ell_weight {ell_weight.shape}: the init must have the ELL shape")
        return None
    rows_pad, k_pad = init.shape
    if row.size and (int(row.max()) >= rows_pad or int(nnz_row.max()) > k_pad):
        out.add("init_shape", INIT_ARRAY, False, f"{init.shape} cannot hold the COO rows (max row {int(row.max())}, max nnz {int(nnz_row.max())})")
        return None
    slots = coo_slots(row)
    used = np.zeros(init.shape, dtype=bool)
    used[row, slots] = True
    pad = init[~used]
    pad_ok = bool(np.all(pad == 0))
    out.add("init_padding_zero", INIT_ARRAY, pad_ok, f"{pad.size} padding slot(s), all 0" if pad_ok else f"{int(np.count_nonzero(pad))} padding slot(s) not 0")
    values = init[row, slots]
    good = bool(np.all(np.isfinite(values)) and np.all(values > 0))
    out.add("init_values", INIT_ARRAY, good, f"{values.size} geometric value(s), all finite and > 0" if good else f"{int(np.count_nonzero(~(np.isfinite(values) & (values > 0))))} init value(s) not finite or <= 0")
    return values if good else None


def _check_learned_attrs(out: _Checks, attrs: Mapping[str, Any], arrays: Mapping[str, np.ndarray], init_val: np.ndarray | None, val: np.ndarray) -> None:
    """The ``learned`` record: its hashes and change figures equal the recomputation from the arrays."""
    try:
        LearnedRecord.from_attrs(attrs)
    except ValueError as exc:
        out.add("learned_record", "", False, str(exc))
        return
    info = attrs["learned"]
    out.add("learned_record", "", True, f"absorbed from {info.get('checkpoint')} (sha256 {str(info.get('checkpoint_sha256'))[:12]}…, key {info.get('key')!r})")
    for name, recorded in ((("ell_weight", info.get("values_sha256"))), (INIT_ARRAY, info.get("init_sha256"))):
        if name not in arrays:
            continue
        actual = array_sha256(arrays[name])
        label = "values_sha256" if name == "ell_weight" else "init_sha256"
        out.add(f"learned_{label}", name, actual == recorded, f"learned.{label} {str(recorded)[:12]}… vs content {actual[:12]}…")
    if init_val is not None:
        want = value_change(init_val, val)
        got = info.get("change")
        ok = isinstance(got, Mapping) and all(same_recorded(got.get(k), v) for k, v in want.items())
        out.add("learned_change", "", ok, "learned.change equals the recomputation from init_ell_weight and coo_val" if ok else f"learned.change {got!r} vs recomputed {want!r}")


def _attr(attrs: Mapping[str, Any], dotted: str) -> Any:
    value: Any = attrs
    for key in dotted.split("."):
        if not isinstance(value, Mapping) or key not in value:
            return "<missing>"
        value = value[key]
    return value


def _check_ell(
    out: _Checks,
    index: np.ndarray,
    weight: np.ndarray,
    row: I64,
    col: I64,
    val: np.ndarray,
    nnz_row: I64,
    shape: tuple[int, int],
    n_cols: int,
) -> None:
    if index.shape != shape or weight.shape != shape:
        out.add("ell_shape", "ell_index", False, f"ell_index {index.shape}, ell_weight {weight.shape}; expected {shape} (rows_pad, k_pad)")
        return
    out.add("ell_shape", "ell_index", True, f"(rows_pad, k_pad) = {shape}")
    in_range = bool(index.size == 0 or (index.min() >= 0 and index.max() < n_cols))
    out.add("ell_index_in_range", "ell_index", in_range, f"every index (padding included) in [0, {n_cols})" if in_range else f"indices span [{index.min()}, {index.max()}], outside [0, {n_cols})")
    rows_pad, k_pad = shape
    if nnz_row.size and nnz_row.max() > k_pad:
        out.add("ell_reconstructs_coo", "ell_weight", False, f"a row has {int(nnz_row.max())} entries > k_pad {k_pad}")
        return
    counts = np.zeros(rows_pad, dtype=np.int64)
    counts[: nnz_row.size] = nnz_row
    slot = np.arange(k_pad)[None, :]
    used = slot < counts[:, None]
    pad_weight = weight[~used]
    pad_ok = bool(np.all(pad_weight == 0))
    out.add("ell_padding_zero", "ell_weight", pad_ok, f"{pad_weight.size} padding slot(s), all weight 0" if pad_ok else f"{int(np.count_nonzero(pad_weight))} padding slot(s) with non-zero weight")
    starts = np.flatnonzero(counts[: nnz_row.size] > 0)
    first_col = np.zeros(rows_pad, dtype=np.int64)
    first_col[starts] = col[np.cumsum(np.r_[0, nnz_row])[starts]] if col.size else 0
    pad_index = index[~used].astype(np.int64)
    want_pad = np.broadcast_to(first_col[:, None], index.shape)[~used]
    n_bad_pad = int(np.count_nonzero(pad_index != want_pad))
    out.add(
        "ell_padding_index",
        "ell_index",
        n_bad_pad == 0,
        "every padding slot indexes its row's first column (0 for empty rows)" if n_bad_pad == 0 else f"{n_bad_pad} padding slot(s) do not index their row's first column",
    )
    got_col = index[used].astype(np.int64)
    got_val = weight[used]
    same = bool(got_col.size == col.size and np.array_equal(got_col, col) and np.array_equal(got_val, val))
    out.add("ell_reconstructs_coo", "ell_weight", same, "ELL slots (row-major) equal the COO entries exactly" if same else "ELL entries differ from COO")


def _check_tiles(
    out: _Checks,
    arrays: Mapping[str, np.ndarray],
    options: MatrixOptions,
    row: I64,
    col: I64,
    val: np.ndarray,
    n_rows: int,
    n_cols: int,
    attrs: Mapping[str, Any],
) -> bool:
    r = int(options.tile_rows or 1)
    cols = arrays["tile_cols"].astype(np.int64)
    offsets = arrays["tile_col_offsets"]
    weight = arrays["tile_weight"]
    n_tiles = -(-n_rows // r) if n_rows else 0
    widths = np.diff(offsets)
    problems = []
    if offsets.size != n_tiles + 1:
        problems.append(f"{offsets.size} offsets, want n_tiles + 1 = {n_tiles + 1}")
    if offsets.size and offsets[0] != 0:
        problems.append(f"first offset {int(offsets[0])}, want 0")
    if offsets.size and offsets[-1] != cols.size:
        problems.append(f"last offset {int(offsets[-1])}, want len(tile_cols) = {cols.size}")
    bad_width = np.flatnonzero((widths < options.align) | (widths % options.align != 0))
    if bad_width.size:
        problems.append(f"{bad_width.size} tile width(s) not a positive multiple of align {options.align} (tile {int(bad_width[0])}: {int(widths[bad_width[0]])})")
    if weight.size != r * cols.size:
        problems.append(f"tile_weight holds {weight.size} values, want R x len(tile_cols) = {r * cols.size}")
    layout_ok = not problems
    out.add(
        "tiles_layout",
        "tile_col_offsets",
        layout_ok,
        f"{n_tiles} tiles of {r} rows, widths multiples of align {options.align}, tile_weight = R x sum(widths)" if layout_ok else "; ".join(problems),
    )
    if not layout_ok:
        return False
    in_range = bool(cols.size == 0 or (cols.min() >= 0 and cols.max() < n_cols))
    out.add("tiles_in_range", "tile_cols", in_range, f"every tile column in [0, {n_cols})")
    sorted_ok = all(np.all(np.diff(cols[offsets[t] : offsets[t + 1]]) >= 0) for t in range(n_tiles))
    out.add("tiles_sorted", "tile_cols", sorted_ok, "each tile's columns non-decreasing")
    t_row, t_col, t_val = tile_entries(tile_blocks(weight, offsets, r), cols, offsets, r)  # the COO the blocks hold
    order = np.lexsort((t_col, t_row))
    nz = val != 0  # a learned entry that became 0 is a 0 in its block, like padding
    row, col, val = row[nz], col[nz], val[nz]
    same = bool(
        t_row.size == row.size
        and np.array_equal(t_row[order], row)
        and np.array_equal(t_col[order], col)
        and np.array_equal(t_val[order], val)
    )
    out.add("tiles_reconstruct_coo", "tile_weight", same, "non-zero tile entries equal the COO entries exactly" if same else f"tiles hold {t_row.size} non-zero entries vs {row.size} in COO, or values/columns differ")
    recorded = attrs.get("tiles", {}).get("n_tiles") if isinstance(attrs.get("tiles"), Mapping) else None
    out.add("attrs", "", recorded == n_tiles, f"tiles.n_tiles {recorded} vs recomputed {n_tiles}")
    return True


def _check_int8(out: _Checks, arrays: Mapping[str, np.ndarray], options: MatrixOptions, attrs: Mapping[str, Any], tiles_ok: bool | None) -> None:
    info = attrs.get("int8") if isinstance(attrs.get("int8"), Mapping) else {}
    recorded = info.get("max_rel_error") if isinstance(info, Mapping) else None
    worst = 0.0
    worst_abs = 0.0
    pairs: list[tuple[str, str, str, int | None]] = [("ell_weight", "ell_weight_int8", "row_scale", None)]
    if options.tile_rows is not None:
        if tiles_ok or tiles_ok is None:
            pairs.append(("tile_weight", "tile_weight_int8", "tile_row_scale", options.tile_rows))
        else:
            out.add("int8_values", "tile_weight_int8", False, "not checked: the tile layout is invalid (see tiles_layout)")
    for wname, qname, sname, tile_rows in pairs:
        if not all(n in arrays for n in (wname, qname, sname)):
            continue
        weight, q, scale = arrays[wname], arrays[qname], arrays[sname]
        if tile_rows is None:
            if q.shape != weight.shape or scale.shape != (weight.shape[0],):
                out.add("int8_shape", qname, False, f"{qname} {q.shape}, {sname} {scale.shape} vs weights {weight.shape}")
                continue
            want_q, want_scale = quantize_rows_int8(weight)
            rel, abs_err = int8_errors(weight, q, scale)
        else:
            offsets = arrays.get("tile_col_offsets")
            if offsets is None or q.shape != weight.shape or scale.size != (offsets.size - 1) * tile_rows:
                out.add("int8_shape", qname, False, f"{qname} {q.shape}, {sname} {scale.shape} do not fit the tiles")
                continue
            ell_scale = arrays.get("row_scale")
            want_scale = np.zeros(scale.size, dtype=np.float32)
            if ell_scale is not None:
                n = min(scale.size, ell_scale.size)
                want_scale[:n] = ell_scale[:n]
            want_q = np.zeros_like(q)
            rel = abs_err = 0.0
            for t, (block, qblock) in enumerate(zip(tile_blocks(weight, offsets, tile_rows), tile_blocks(q, offsets, tile_rows), strict=True)):
                s = scale[t * tile_rows : (t + 1) * tile_rows]
                wq, _ = quantize_rows_int8(block, s)
                a = int(offsets[t]) * tile_rows
                want_q[a : a + wq.size] = wq.ravel()
                block_rel, block_abs = int8_errors(block, qblock, s)
                rel, abs_err = max(rel, block_rel), max(abs_err, block_abs)
        scale_ok = bool(np.array_equal(scale, want_scale))
        out.add("int8_scale", sname, scale_ok, f"{sname} = float32(max|w row| / {INT8_MAX}) (recomputed)" if scale_ok else f"{sname} differs from float32(max|w row| / {INT8_MAX})")
        q_ok = bool(np.array_equal(q, want_q))
        n_diff = int(np.count_nonzero(q != want_q)) if q.shape == want_q.shape else q.size
        out.add("int8_values", qname, q_ok, f"{qname} = clip(round(w / scale)) exactly" if q_ok else f"{n_diff} value(s) differ from clip(round(w / scale))")
        bound = 0.5 / INT8_MAX * (1 + 1e-3)
        out.add("int8_error_bound", qname, rel <= bound, f"max |decode - w| / max|w row| = {rel:.4g} (half a step is {0.5 / INT8_MAX:.4g})")
        worst = max(worst, rel)
        worst_abs = max(worst_abs, abs_err)
    recorded_abs = info.get("max_abs_error") if isinstance(info, Mapping) else None
    if isinstance(recorded_abs, int | float) and not isinstance(recorded_abs, bool):
        close = math.isclose(float(recorded_abs), worst_abs, rel_tol=1e-9, abs_tol=1e-15)
        out.add("int8_recorded_error", "", close, f"recorded int8.max_abs_error {float(recorded_abs):.6g} vs recomputed {worst_abs:.6g}")
    else:
        out.add("int8_recorded_error", "", False, f"int8.max_abs_error missing or not a number: {recorded_abs!r}")
    if isinstance(recorded, int | float):
        close = math.isclose(float(recorded), worst, rel_tol=1e-9, abs_tol=1e-15)
        out.add("int8_recorded_error", "", close, f"recorded int8.max_rel_error {float(recorded):.6g} vs recomputed {worst:.6g}")
    else:
        out.add("int8_recorded_error", "", False, f"int8.max_rel_error missing or not a number: {recorded!r}")


def _check_recorded(out: _Checks, attrs: Mapping[str, Any], block: str, key: str, want: float) -> None:
    """``attrs[block][key]`` equals the recomputed error figure ``want``."""
    info = attrs.get(block)
    got = info.get(key) if isinstance(info, Mapping) else None
    if isinstance(got, int | float) and not isinstance(got, bool):
        close = math.isclose(float(got), want, rel_tol=1e-9, abs_tol=1e-15)
        out.add(f"{block}_recorded_error", "", close, f"recorded {block}.{key} {float(got):.6g} vs recomputed {want:.6g}")
    else:
        out.add(f"{block}_recorded_error", "", False, f"{block}.{key} missing or not a number: {got!r}")


def _fp16_values(out: _Checks, check: str, name: str, stored: np.ndarray, weight: np.ndarray) -> bool:
    """``stored`` equals ``float16(weight)`` exactly and is finite."""
    if stored.shape != weight.shape:
        out.add(check, name, False, f"{name} {stored.shape} vs the float32 values {weight.shape}")
        return False
    finite = bool(np.all(np.isfinite(stored)))
    with np.errstate(over="ignore"):
        want = np.asarray(weight).astype(np.float16)
    same = finite and bool(np.array_equal(stored, want))
    n_diff = int(np.count_nonzero(stored != want))
    out.add(check, name, same, f"{name} = float16(w) exactly, all finite" if same else f"{n_diff} value(s) differ from float16(w) or are not finite")
    return same


def _check_fp16(out: _Checks, arrays: Mapping[str, np.ndarray], options: MatrixOptions, attrs: Mapping[str, Any], tiles_ok: bool | None) -> None:
    """``--quantize fp16``: the float16 values are ``float16`` of the float32 ones (ELL, tiles);
    the recorded errors equal the recomputation."""
    rel = absolute = 0.0
    if "ell_weight_fp16" in arrays and "ell_weight" in arrays and _fp16_values(out, "fp16_values", "ell_weight_fp16", arrays["ell_weight_fp16"], arrays["ell_weight"]):
        rel, absolute = decoded_errors(arrays["ell_weight"], arrays["ell_weight_fp16"])
    if options.tile_rows is not None and "tile_weight_fp16" in arrays and "tile_weight" in arrays:
        if tiles_ok is False:
            out.add("fp16_values", "tile_weight_fp16", False, "not checked: the tile layout is invalid (see tiles_layout)")
        else:
            weight, stored = arrays["tile_weight"], arrays["tile_weight_fp16"]
            if _fp16_values(out, "fp16_values", "tile_weight_fp16", stored, weight):
                offsets, r = arrays["tile_col_offsets"], options.tile_rows
                for block, block16 in zip(tile_blocks(weight, offsets, r), tile_blocks(stored, offsets, r), strict=True):
                    br, ba = decoded_errors(block, block16)
                    rel, absolute = max(rel, br), max(absolute, ba)
    _check_recorded(out, attrs, "fp16", "max_rel_error", rel)
    _check_recorded(out, attrs, "fp16", "max_abs_error", absolute)


def _check_mixed(
    out: _Checks,
    arrays: Mapping[str, np.ndarray],
    options: MatrixOptions,
    attrs: Mapping[str, Any],
    tiles_ok: bool | None,
    rig: RigConfig,
    n_rows: int,
    nnz_row: I64,
    region_cells: np.ndarray | None,
) -> None:
    """``--quantize mixed``: ``fp16_rows`` is the rule's selection recomputed from the float32
    ELL values and the int8 product (rows with entries only); the float16 rows are ``float16``
    of the float32 ones (ELL, tiles); the ``mixed`` attribute records the rule and figures."""
    rule = options.fp16_rule()
    needed = ("fp16_rows", "fp16_row_weight", "ell_weight", "ell_weight_int8", "row_scale")
    if rule is None or not all(n in arrays for n in needed):
        return  # the contract check names the missing array
    rows = arrays["fp16_rows"].astype(np.int64)
    weight = arrays["ell_weight"]
    q, scale = arrays["ell_weight_int8"], arrays["row_scale"]
    if q.shape != weight.shape or scale.shape != (weight.shape[0],) or weight.shape[0] < n_rows:
        out.add("mixed_rows", "fp16_rows", False, "not checked: the int8 product does not fit the ELL (see int8_shape)")
        return
    has = nnz_row[:n_rows] > 0
    row_ids = arrays.get("row_ids") if options.compact_rows else None
    distance = row_distances_m(rig, n_rows, row_ids, region_cells)
    want = select_fp16_rows(rule, int8_row_snr_db(weight[:n_rows], q[:n_rows], scale[:n_rows]), distance, has)
    same = bool(rows.shape == want.shape and np.array_equal(rows, want))
    out.add(
        "mixed_rows", "fp16_rows", same,
        f"{rows.size:,} fp16 rows = the rule {rule.token} recomputed ({int(np.count_nonzero(has)):,} rows with entries)"
        if same else f"{rows.size:,} stored rows vs {want.size:,} the rule {rule.token} selects (or they differ)",
    )
    if not same:
        return
    stored = arrays["fp16_row_weight"]
    rel = absolute = 0.0
    if _fp16_values(out, "mixed_values", "fp16_row_weight", stored, weight[rows]):
        rel, absolute = decoded_errors(weight[rows], stored)
    if options.tile_rows is not None and "fp16_row_tile_weight" in arrays and "tile_weight" in arrays:
        if tiles_ok is False:
            out.add("mixed_values", "fp16_row_tile_weight", False, "not checked: the tile layout is invalid (see tiles_layout)")
        else:
            offsets, r = arrays["tile_col_offsets"], options.tile_rows
            tiles16 = arrays["fp16_row_tile_weight"]
            try:
                want16: np.ndarray | None = fp16_row_tile_weight(arrays["tile_weight"], offsets, r, rows)
            except (UsageError, IndexError, ValueError):
                want16 = None
            same16 = want16 is not None and tiles16.shape == want16.shape and bool(np.array_equal(tiles16, want16))
            out.add("mixed_values", "fp16_row_tile_weight", same16, "each fp16 row's tile block row = float16 of the float32 block row" if same16 else "differs from float16 of the fp16 rows' tile block rows")
            if same16:
                bounds = fp16_row_tile_offsets(offsets, r, rows)
                for i, row in enumerate(rows):
                    span = tile_row_span(offsets, r, row)
                    br, ba = decoded_errors(arrays["tile_weight"][span][None], tiles16[bounds[i] : bounds[i + 1]][None])
                    rel, absolute = max(rel, br), max(absolute, ba)
    _check_recorded(out, attrs, "mixed", "max_rel_error", rel if rows.size else 0.0)
    _check_recorded(out, attrs, "mixed", "max_abs_error", absolute if rows.size else 0.0)
    info = attrs.get("mixed") if isinstance(attrs.get("mixed"), Mapping) else {}
    for key, value in (("rule", rule.token), ("n_fp16_rows", int(rows.size)), ("n_rows_with_entries", int(np.count_nonzero(has)))):
        got_value = info.get(key) if isinstance(info, Mapping) else None
        out.add("attrs", "", same_recorded(got_value, value), f"mixed.{key} {got_value!r} vs recomputed {value!r}")


# --------------------------------------------------------------------------------------
# verify
# --------------------------------------------------------------------------------------


def lifted_columns(rig: RigConfig, mode: str, cols: npt.NDArray[np.integer[Any]], features: np.ndarray, depth_probs: np.ndarray | None) -> F64:
    """``X[cols, :]`` without materialising ``X``.

    Convention: frustum ``X[col, c] = depth_probs[cam, d, v, u] * features[cam, c, v, u]``
    (``col = ((cam*D + d)*H_f + v)*W_f + u``); grid ``X[col, c] = features[cam, c, v, u]``
    (``col = (cam*H_f + v)*W_f + u``). returns ``(len(cols), C)`` float64.
    """
    w_f, h_f = rig.feature_size
    plane = w_f * h_f
    cols = np.asarray(cols, dtype=np.int64).ravel()
    feats = np.asarray(features).reshape(rig.n_cam, -1, plane)  # gathered first, then float64
    if mode != "frustum":  # grid and ray: columns (cam, v, u)
        cam, pix = cols // plane, cols % plane
        return np.asarray(feats[cam, :, pix], dtype=np.float64)
    if depth_probs is None:
        raise ValueError("frustum-mode verify needs depth probabilities")
    depth = np.asarray(depth_probs).reshape(rig.n_cam, rig.depth.n_bins, plane)
    per_cam = rig.depth.n_bins * plane
    cam, rem = cols // per_cam, cols % per_cam
    d, pix = rem // plane, rem % plane
    return np.asarray(depth[cam, d, pix], dtype=np.float64)[:, None] * np.asarray(feats[cam, :, pix], dtype=np.float64)


def apply_entries(row: npt.NDArray[np.integer[Any]], values: np.ndarray, lifted: F64, n_rows: int) -> F64:
    """``out[r, c] = sum over entries of row r of value * lifted[entry, c]``.

    Convention: ``row`` int ``(n,)``, ``values`` ``(n,)``, ``lifted`` float64 ``(n, C)`` (the
    :func:`lifted_columns` of the entries' columns) -> ``(n_rows, C)`` float64."""
    row = np.asarray(row, dtype=np.int64).ravel()
    w = np.asarray(values, dtype=np.float64).ravel()
    out = np.zeros((n_rows, lifted.shape[1]))
    for c in range(lifted.shape[1]):
        out[:, c] = np.bincount(row, weights=w * lifted[:, c], minlength=n_rows)
    return out


def _learned_values_at(arrays: Mapping[str, np.ndarray], row_cells: I64, n_cols: int, cells: np.ndarray, cols: np.ndarray) -> tuple[F64, int]:
    """The learned value of every ``(BEV cell, column)`` pair, read from the stored ELL real slots
    (``ell_index`` / ``ell_weight``, slots ``< nnz(row)`` of the COO rows); NaN (and counted) for
    a pair the store has no entry for."""
    row = arrays["coo_row"].astype(np.int64)
    index, weight = arrays["ell_index"], arrays["ell_weight"]
    slots = coo_slots(row)
    keys = row_cells[row] * n_cols + index[row, slots].astype(np.int64)
    order = np.argsort(keys, kind="stable")
    keys, values = keys[order], weight[row, slots].astype(np.float64)[order]
    want = np.asarray(cells, np.int64) * n_cols + np.asarray(cols, np.int64)
    at = np.minimum(np.searchsorted(keys, want), max(keys.size - 1, 0))
    found = keys[at] == want if keys.size else np.zeros(want.size, dtype=bool)
    out = np.where(found, values[at] if keys.size else 0.0, np.nan)
    return out, int(np.count_nonzero(~found))


def stored_prior(
    rig: RigConfig, options: MatrixOptions, arrays: Mapping[str, np.ndarray] | None, record: object = None
) -> DepthPrior | None:
    """The depth prior a ray store was built with (uniform, or its checked ``matrix/depth_prior``);
    None for the other modes. ValueError when the stored array is missing, bad or not the one
    ``build_options`` names."""
    if options.mode != "ray":
        return None
    return prior_of_store(options.depth_prior, None if arrays is None else arrays.get(PRIOR_ARRAY), rig, "matrix/", record)


def _camera_of(rig: RigConfig, mode: str, cols: np.ndarray) -> I64:
    return np.asarray(cols, dtype=np.int64) // (n_columns(rig, mode) // rig.n_cam)


def verify_matrix(ctx: CheckContext, arrays: Mapping[str, np.ndarray], attrs: Mapping[str, Any]) -> list[VerifyRow]:
    """Every stored form (COO, ELL, tiles, int8) vs the float64 reference pooling on
    ``ctx.features`` (and ``ctx.depth_probs`` in frustum mode).

    The reference is independent of the matrix builder: with K = 0, BEVDet-style voxel pooling
    (:func:`bevcompile.matrix.reference.bev_pool`) or grid_sample pooling (``grid_pool``); with
    K > 0, the straightforward reference build (``reference_matrix``) applied in float64 — on
    ``VERIFY_SAMPLED_ROWS`` seeded rows when the rig has more than ``VERIFY_FULL_POINTS``
    frustum points (``VERIFY_FULL_GRID_SAMPLES`` grid samples). Rows per camera for COO (the
    camera's contribution), ``all`` for every form.
    """
    rig = ctx.rig
    options = _options(attrs)
    if ctx.features is None:
        raise ValueError("verify needs ctx.features")
    mode = options.mode
    depth = ctx.depth_probs if mode == "frustum" else None
    prior = stored_prior(rig, options, arrays)
    prior_dense = prior.normalised(rig).dense(rig) if prior is not None else None
    n_cells = rig.bev.nx * rig.bev.ny
    row = arrays["coo_row"].astype(np.int64)
    row_cells = arrays["row_ids"].astype(np.int64) if options.compact_rows else np.arange(n_cells, dtype=np.int64)
    table = region_table(rig.bev) if rig.bev.region is not None else None
    if table is not None:  # bev.region: the compared "cells" are the region's rows (the zero row last)
        return _verify_region(ctx, arrays, attrs, options, table)
    n_rows = row_cells.size
    n_ch = ctx.features.shape[1]

    # reference per camera, (n_cam, n_cells_compared, C), and the compared cells
    w_f, h_f = rig.feature_size
    if mode in DEPTH_MODES:
        size = rig.n_cam * rig.depth.n_bins * w_f * h_f
        sampled = size > VERIFY_FULL_POINTS
    else:
        size = rig.n_cam * len(rig.bev.heights) * n_cells
        sampled = size > VERIFY_FULL_GRID_SAMPLES
    note = ""
    learned = is_learned(attrs)
    learned_note = ""
    init_ref: F64 | None = None  # learned: the reference product of the geometric (init) values, all cameras
    if options.topk == 0 and not sampled and not learned:
        if mode == "frustum":
            assert depth is not None
            pooled = bev_pool(rig, ctx.features, depth, splat=options.splat, rounding=options.rounding, normalize=options.normalize, precision=options.precision)
            note = f"reference: BEVDet-style voxel pooling ({options.splat}, {options.rounding}{f', {options.precision} points' if options.precision != 'float64' else ''})"
        elif mode == "ray":
            assert prior_dense is not None
            pooled = bev_pool(rig, ctx.features, prior_dense, splat=options.splat, rounding=options.rounding, normalize=options.normalize)
            note = f"reference: BEVDet-style voxel pooling of the features with the depth prior as depth ({options.splat}, {options.rounding})"
        else:
            pooled = grid_pool(rig, ctx.features, splat=options.splat, normalize=options.normalize)
            note = "reference: sum over cameras and heights of grid_sample (numpy, float64 grid)"
        cells = np.arange(n_cells)
        ref_cam = pooled.reshape(rig.n_cam, n_ch, n_cells).transpose(0, 2, 1)
    else:
        cells = np.arange(n_cells)
        if sampled:
            rng = np.random.default_rng(ctx.seed)
            candidates = row_cells[np.bincount(row, minlength=n_rows) > 0]
            take = min(VERIFY_SAMPLED_ROWS, candidates.size)
            cells = np.sort(rng.choice(candidates, size=take, replace=False)) if take else np.zeros(0, np.int64)
        ref = reference_matrix(rig, options, rows=cells if sampled else None, prior=prior_dense)
        lifted = lifted_columns(rig, mode, ref.col, ctx.features, depth)
        ref_values = np.asarray(ref.value, dtype=np.float64)
        if learned:
            ref_values, missing = _learned_values_at(arrays, row_cells, n_columns(rig, mode), ref.row, ref.col)
            init_ref = apply_entries(ref.row, ref.value, lifted, n_cells)[cells]
            learned_note = (
                "; the learned values (ell_weight real slots) on the reference's entries"
                + (f"; {missing} reference entr{'y' if missing == 1 else 'ies'} not in the store" if missing else "")
            )
        ref_cam_full = np.zeros((rig.n_cam, n_cells, n_ch))
        ref_camera = _camera_of(rig, mode, ref.col)
        for c in range(rig.n_cam):
            m = ref_camera == c
            ref_cam_full[c] = apply_entries(ref.row[m], ref_values[m], lifted[m], n_cells)
        ref_cam = ref_cam_full[:, cells]
        note = f"reference: straightforward build (all points, full lexsort, Top-{options.topk}) in float64{learned_note}"
        if sampled:
            note += f"; {cells.size} seeded sampled rows (rig has {size:,} {'points' if mode in DEPTH_MODES else 'grid samples'})"
    cell_to_row = np.full(n_cells, -1, dtype=np.int64)
    cell_to_row[row_cells] = np.arange(n_rows)
    compared_rows = cell_to_row[cells]
    return _verify_forms(ctx, arrays, attrs, options, ref_cam, cells, compared_rows, n_rows, note, init_ref, sampled, n_cells, None, prior_dense)


def _verify_region(ctx: CheckContext, arrays: Mapping[str, np.ndarray], attrs: Mapping[str, Any], options: MatrixOptions, table: RegionTable) -> list[VerifyRow]:
    """The reference of a ``bev.region`` matrix, per camera and region row: with K = 0 the fine
    cells' pooling references (BEVDet-style voxel pooling / grid_sample pooling, ``sum``) merged by
    the stated rule (a row sums its fine cells; ``mean`` divides by the summed raw weight of its
    fine cells, pooled from ones); with K > 0 :func:`region_reference_matrix` (every entry, merged,
    full lexsort Top-K), on seeded sampled rows for big rigs. A learned store: the reference's
    entries (any K) carrying the learned values of the stored ELL real slots, and the geometric
    reference as the informational ``learned_vs_init`` row, as for a full-grid store."""
    rig = ctx.rig
    assert ctx.features is not None
    mode = options.mode
    depth = ctx.depth_probs if mode == "frustum" else None
    n_rows = table.n_kept + 1
    n_ch = ctx.features.shape[1]
    row_of_cell = table.row_of_cell()
    w_f, h_f = rig.feature_size
    ny, nx = rig.bev.ny, rig.bev.nx
    prior = stored_prior(rig, options, arrays)
    prior_dense = prior.normalised(rig).dense(rig) if prior is not None else None
    size = rig.n_cam * (rig.depth.n_bins * w_f * h_f if mode in DEPTH_MODES else len(rig.bev.heights) * ny * nx)
    sampled = size > (VERIFY_FULL_POINTS if mode in DEPTH_MODES else VERIFY_FULL_GRID_SAMPLES)
    learned = is_learned(attrs)
    init_ref: F64 | None = None  # learned: the reference product of the geometric (init) values, all cameras
    rows = np.arange(n_rows)
    row = arrays["coo_row"].astype(np.int64)
    if sampled:
        rng = np.random.default_rng(ctx.seed)
        candidates = np.flatnonzero(np.bincount(row, minlength=n_rows) > 0)
        take = min(VERIFY_SAMPLED_ROWS, candidates.size)
        rows = np.sort(rng.choice(candidates, size=take, replace=False)) if take else np.zeros(0, np.int64)
    inside = row_of_cell >= 0

    def merge(per_cell: F64) -> F64:  # (n_cam, C, ny*nx) -> (n_cam, n_rows, C): each row sums its fine cells
        out = np.zeros((per_cell.shape[0], n_rows, per_cell.shape[1]))
        for c in range(per_cell.shape[0]):
            for ch in range(per_cell.shape[1]):
                out[c, :, ch] = np.bincount(row_of_cell[inside], weights=per_cell[c, ch][inside], minlength=n_rows)
        return out

    if options.topk == 0 and not sampled and not learned:
        if mode in DEPTH_MODES:  # frustum: the depth probabilities; ray: the depth prior as depth
            weights = depth if mode == "frustum" else prior_dense
            assert weights is not None
            pool = lambda f, d: bev_pool(rig, f, d, splat=options.splat, rounding=options.rounding, normalize="sum", precision=options.precision)  # noqa: E731
            pooled = pool(ctx.features, weights)
            # the raw weight of a frustum entry is its splat weight; of a ray entry, the prior-weighted one
            mass = pool(np.ones((rig.n_cam, 1, h_f, w_f)), np.ones_like(weights) if mode == "frustum" else weights)
            note = f"reference: BEVDet-style voxel pooling ({options.splat}, {options.rounding}) of the fine cells, merged per region row"
        else:
            pooled = grid_pool(rig, ctx.features, splat=options.splat, normalize="sum")
            mass = grid_pool(rig, np.ones((rig.n_cam, 1, h_f, w_f)), splat=options.splat, normalize="sum")
            note = "reference: grid_sample pooling of the fine cells, merged per region row"
        ref_cam = merge(pooled.reshape(rig.n_cam, n_ch, ny * nx))
        if options.normalize == "mean":
            row_mass = merge(mass.reshape(rig.n_cam, 1, ny * nx)).sum(axis=0)[:, 0]
            ref_cam = ref_cam / np.where(row_mass > 0, row_mass, 1.0)[None, :, None]
        ref_cam = ref_cam[:, rows]
    else:
        ref = region_reference_matrix(rig, options, row_of_cell, n_rows, rows=rows if sampled else None, prior=prior_dense)
        lifted = lifted_columns(rig, mode, ref.col, ctx.features, depth)
        camera = _camera_of(rig, mode, ref.col)
        ref_values = np.asarray(ref.value, dtype=np.float64)
        learned_note = ""
        if learned:  # the learned values on the reference's entries (the topology is the geometric build's)
            ref_values, missing = _learned_values_at(arrays, np.arange(n_rows, dtype=np.int64), n_columns(rig, mode), ref.row, ref.col)
            init_ref = apply_entries(ref.row, ref.value, lifted, n_rows)[rows]
            learned_note = (
                "; the learned values (ell_weight real slots) on the reference's entries"
                + (f"; {missing} reference entr{'y' if missing == 1 else 'ies'} not in the store" if missing else "")
            )
        ref_cam = np.stack([apply_entries(ref.row[camera == c], ref_values[camera == c], lifted[camera == c], n_rows) for c in range(rig.n_cam)])[:, rows]
        note = f"reference: straightforward region build (every entry merged per region row, full lexsort, Top-{options.topk}) in float64{learned_note}"
        if sampled:
            note += f"; {rows.size} seeded sampled rows"
    return _verify_forms(ctx, arrays, attrs, options, ref_cam, rows, rows, n_rows, note, init_ref, sampled, n_rows, table, prior_dense)


def _verify_forms(
    ctx: CheckContext,
    arrays: Mapping[str, np.ndarray],
    attrs: Mapping[str, Any],
    options: MatrixOptions,
    ref_cam: F64,
    cells: I64,
    compared_rows: I64,
    n_rows: int,
    note: str,
    init_ref: F64 | None,
    sampled: bool,
    n_cells: int,
    table: RegionTable | None = None,
    prior_dense: F64 | None = None,
) -> list[VerifyRow]:
    """Every stored form against ``ref_cam`` ``(n_cam, cells, C)`` (the reference of the compared
    ``cells``, read from the rows ``compared_rows``; -1: no row, 0)."""
    rig = ctx.rig
    mode = options.mode
    depth = ctx.depth_probs if mode == "frustum" else None
    assert ctx.features is not None
    cam_names = list(rig.camera_names)
    row = arrays["coo_row"].astype(np.int64)
    col = arrays["coo_col"].astype(np.int64)
    val = arrays["coo_val"]
    n_ch = ctx.features.shape[1]
    ref_all = ref_cam.sum(axis=0)
    peak = float(ref_all.max() - ref_all.min()) if ref_all.size else 1.0
    peak = peak if peak > 0 else 1.0
    scale_abs = float(np.abs(ref_all).max()) if ref_all.size else 0.0
    float_tol = FLOAT_REL_TOL * max(scale_abs, 1e-30)
    float_rule = f"max_abs <= {FLOAT_REL_TOL:g} * max|ref| = {float_tol:.3g}"
    rows_out: list[VerifyRow] = []

    def to_cells(per_row: F64) -> F64:
        got = np.zeros((cells.size, per_row.shape[1]))
        has = compared_rows >= 0
        got[has] = per_row[compared_rows[has]]
        return got

    def add(product: str, camera: str, got: F64, ref: F64, rule: str, passed_fn: Any, extra: str = "") -> None:
        max_abs, mean_abs, psnr = compare(product, camera, got, ref, peak)
        rows_out.append(VerifyRow(product, camera, max_abs, mean_abs, psnr, rule, bool(passed_fn(max_abs, psnr)), (extra + "; " + note).strip("; ")))

    float_ok = lambda max_abs, _psnr: max_abs <= float_tol  # noqa: E731
    int8_ok = lambda _max_abs, psnr: psnr >= INT8_MIN_PSNR_DB  # noqa: E731

    # COO per camera and all
    lifted_coo = lifted_columns(rig, mode, col, ctx.features, depth)
    coo_camera = _camera_of(rig, mode, col)
    coo_total = np.zeros((cells.size, n_ch))
    for c, name in enumerate(cam_names):
        m = coo_camera == c
        got = to_cells(apply_entries(row[m], val[m], lifted_coo[m], n_rows))
        coo_total += got
        add("matrix/coo", name, got, ref_cam[c], float_rule, float_ok)
    add("matrix/coo", "all", coo_total, ref_all, float_rule, float_ok)

    if init_ref is not None:
        # what training changed: the learned lift against the geometric one it started from
        peak_init = float(init_ref.max() - init_ref.min()) if init_ref.size else 0.0
        max_abs, mean_abs, psnr = compare("matrix/learned_vs_init", "all", ref_all, init_ref, peak_init if peak_init > 0 else 1.0)
        rows_out.append(VerifyRow(
            "matrix/learned_vs_init", "all", max_abs, mean_abs, psnr,
            "informational: the learned values vs the geometric init (init_ell_weight), same entries", True,
            "PSNR peak = the init output's range" + (f"; {note.split('; ', 1)[1]}" if sampled else ""),
            informational=True,
        ))
    elif options.topk > 0:
        # what the pruning costs: the stored Top-K product against the unpruned lift (K = 0,
        # same splat / rounding / normalize), measured on the same cells; reported, not judged
        if table is None:
            full = reference_matrix(rig, replace(options, topk=0), rows=cells if sampled else None, prior=prior_dense)
        else:
            full = region_reference_matrix(rig, replace(options, topk=0), table.row_of_cell(), n_rows, rows=cells if sampled else None, prior=prior_dense)
        lifted_full = lifted_columns(rig, mode, full.col, ctx.features, depth)
        full_all = apply_entries(full.row, full.value, lifted_full, n_cells)[cells]
        peak_full = float(full_all.max() - full_all.min()) if full_all.size else 0.0
        max_abs, mean_abs, psnr = compare("matrix/topk_vs_unpruned", "all", coo_total, full_all, peak_full if peak_full > 0 else 1.0)
        rows_out.append(VerifyRow(
            "matrix/topk_vs_unpruned", "all", max_abs, mean_abs, psnr,
            f"informational: Top-{options.topk} vs the unpruned lift (K = 0)", True,
            f"PSNR peak = unpruned range; kept weight {_kept_note(attrs)}" + (f"; {note.split('; ', 1)[1]}" if sampled else ""),
            informational=True,
        ))

    # ELL (padding included: weight 0 must contribute nothing)
    ell_index, ell_weight = arrays["ell_index"], arrays["ell_weight"]
    ell_rows = np.repeat(np.arange(ell_index.shape[0]), ell_index.shape[1])
    lifted_ell = lifted_columns(rig, mode, ell_index.ravel(), ctx.features, depth)
    ell_out = apply_entries(ell_rows, ell_weight.ravel(), lifted_ell, ell_index.shape[0])
    add("matrix/ell", "all", to_cells(ell_out[:n_rows]), ref_all, float_rule, float_ok, f"ELL {ell_index.shape[0]}x{ell_index.shape[1]}")
    int8_rule = f"PSNR >= {INT8_MIN_PSNR_DB:g} dB (peak = reference range)"
    fp16_rule = f"PSNR >= {FP16_MIN_PSNR_DB:g} dB (peak = reference range)"
    fp16_ok = lambda _max_abs, psnr: psnr >= FP16_MIN_PSNR_DB  # noqa: E731
    for product, values, rule, _weights in _reduced_ell_forms(options, arrays):
        out_q = apply_entries(ell_rows, values.ravel(), lifted_ell, ell_index.shape[0])
        add(product, "all", to_cells(out_q[:n_rows]), ref_all, int8_rule if rule == "int8" else fp16_rule, int8_ok if rule == "int8" else fp16_ok)
    if options.tile_rows is not None:
        r = options.tile_rows
        offsets = arrays["tile_col_offsets"]
        tcols = arrays["tile_cols"]
        forms: list[tuple[str, np.ndarray, str | None]] = [("matrix/tiles", arrays["tile_weight"], None)]
        forms.extend((name, values, rule) for name, values, rule, _ in _reduced_tile_forms(options, arrays))
        for product, weights, kind in forms:
            out_t = np.zeros(((offsets.size - 1) * r, n_ch))
            for t, block in enumerate(tile_blocks(weights, offsets, r)):
                x = lifted_columns(rig, mode, tcols[offsets[t] : offsets[t + 1]], ctx.features, depth)
                out_t[t * r : (t + 1) * r] = block.astype(np.float64) @ x
            rule, ok = (float_rule, float_ok) if kind is None else (int8_rule, int8_ok) if kind == "int8" else (fp16_rule, fp16_ok)
            add(product, "all", to_cells(out_t[:n_rows]), ref_all, rule, ok, f"{offsets.size - 1} tiles of {r} rows")
    return rows_out


def _reduced_ell_forms(options: MatrixOptions, arrays: Mapping[str, np.ndarray]) -> list[tuple[str, np.ndarray, str, str]]:
    """``(product, float32 (rows_pad, k_pad) decoded values, threshold kind "int8"|"fp16", weights)``
    of the store's int8 / fp16 / mixed ELL products (the values each computes with)."""
    out: list[tuple[str, np.ndarray, str, str]] = []
    if options.quantize in INT8_PRODUCTS:
        out.append(("matrix/ell_int8", dequantize_rows_int8(arrays["ell_weight_int8"], arrays["row_scale"]), "int8", "int8"))
    if options.quantize == "fp16":
        out.append(("matrix/ell_fp16", decode_fp16(arrays["ell_weight_fp16"]), "fp16", "fp16"))
    if options.quantize == "mixed":
        values = mixed_ell_values(arrays["ell_weight_int8"], arrays["row_scale"], arrays["fp16_rows"], arrays["fp16_row_weight"])
        out.append(("matrix/ell_mixed", values, "int8", "mixed"))
    return out


def _reduced_tile_forms(options: MatrixOptions, arrays: Mapping[str, np.ndarray]) -> list[tuple[str, np.ndarray, str, str]]:
    """Like :func:`_reduced_ell_forms` for the tiles: float32 ``(R * T,)`` decoded tile values."""
    r = options.tile_rows
    if r is None:
        return []
    offsets = arrays["tile_col_offsets"]
    out: list[tuple[str, np.ndarray, str, str]] = []
    if options.quantize in INT8_PRODUCTS:
        q, scale = arrays["tile_weight_int8"], arrays["tile_row_scale"]
        values = np.zeros(q.size, dtype=np.float32)
        for t, block in enumerate(tile_blocks(q, offsets, r)):
            a = int(offsets[t]) * r
            values[a : a + block.size] = dequantize_rows_int8(block, scale[t * r : (t + 1) * r]).ravel()
        out.append(("matrix/tiles_int8", values, "int8", "int8"))
    if options.quantize == "fp16":
        out.append(("matrix/tiles_fp16", decode_fp16(arrays["tile_weight_fp16"]), "fp16", "fp16"))
    if options.quantize == "mixed":
        values = mixed_tile_values(arrays["tile_weight_int8"], arrays["tile_row_scale"], offsets, r, arrays["fp16_rows"], arrays["fp16_row_tile_weight"])
        out.append(("matrix/tiles_mixed", values, "int8", "mixed"))
    return out


# --------------------------------------------------------------------------------------
# rebuild
# --------------------------------------------------------------------------------------


def _kept_note(attrs: Mapping[str, Any]) -> str:
    """The recorded kept-weight fractions as text (the attribute is not trusted for anything else)."""
    kept = attrs.get("kept_weight_fraction")
    try:
        return f"{100 * float(kept['total']):.1f} % total, {100 * float(kept['worst_row']):.1f} % worst row (recorded)"  # type: ignore[index]
    except (TypeError, KeyError, ValueError):
        return "not recorded"


def rebuild_matrix(rig: RigConfig, attrs: Mapping[str, Any], arrays: Mapping[str, np.ndarray] | None = None) -> dict[str, Any]:
    """Every ``matrix/`` array rebuilt from the stored config and ``build_options``, and the
    group attributes the build writes (under :data:`~bevcompile.store.plugins.REBUILT_ATTRS`).

    A learned store (``values: learned``): the topology and ``init_ell_weight`` are the geometric
    build's; every product derived from the values is re-derived from the learned values — the
    real slots of the stored ``ell_weight`` (``arrays``), which no config rebuilds — exactly as
    ``bevcompile absorb`` derived them (:func:`bevcompile.matrix.learned.learned_group`)."""
    from .build import matrix_attributes
    from .learned import learned_group

    options = _options(attrs)
    products = build_matrix(rig, options, depth_prior=stored_prior(rig, options, arrays, attrs.get("depth_prior")))
    if not is_learned(attrs):
        return {**products.arrays(), REBUILT_ATTRS: matrix_attributes(products, rig)}
    stored = None if arrays is None else arrays.get("ell_weight")
    if stored is None:
        raise ValueError("a learned matrix/ is rebuilt from its stored ell_weight (the learned values), which is unreadable")
    if stored.shape != (products.rows_pad, products.k_pad):
        raise ValueError(f"stored ell_weight {stored.shape} is not the rebuilt ELL shape {(products.rows_pad, products.k_pad)}")
    group = learned_group(rig, products, learned_products(rig, products, stored), LearnedRecord.from_attrs(attrs))
    return {**group.arrays, REBUILT_ATTRS: group.attrs}
