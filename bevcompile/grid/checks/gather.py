"""Plug-in of ``inspect`` / ``verify`` / ``--strict`` for ``gather/`` (static gather tables).

Pure: arrays and dataclasses in, :class:`~bevcompile.store.plugins.Check` /
:class:`~bevcompile.store.plugins.VerifyRow` / arrays out. Every figure is recomputed from the
arrays and the float64 projection of the stored config; attributes are only compared with the
recomputation. The verify bounds are stated in :mod:`bevcompile.grid.checks._common`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ...rig.config import RigConfig
from ...store.plugins import REBUILT_ATTRS, Check, CheckContext, VerifyRow, same_recorded
from ..build import group_dimension_names
from ..gather import (
    band_switches,
    bilinear_corners,
    build_gather_tables,
    camera_base_offsets,
    check_align,
    check_lut_frac_bits,
    check_order,
    gather_sample,
    layout_name,
    layout_tables,
    lut_table,
    lut_weights,
    mean_index_jump,
    worst_case_sample_error,
)
from ..ipm import compute_product_grid, grid_region
from ..reference import bilinear_sample_px
from ._common import (
    BOUND_SLACK,
    FEATURE_PEAK,
    GATHER_THRESHOLD,
    _agrees,
    _Bad,
    _cells,
    _expect,
    _guard,
    _options,
    _row,
    region_plugin,
    region_rebuild,
)

# --------------------------------------------------------------------------------------
# gather/
# --------------------------------------------------------------------------------------


def _gather_options(attrs: Mapping[str, Any]) -> tuple[int, int, str]:
    options = _options(attrs, "gather")
    try:
        frac_bits = check_lut_frac_bits(options.get("frac_bits"))  # type: ignore[arg-type]
        align = check_align(options.get("align"))  # type: ignore[arg-type]
        order = check_order(options.get("order"))  # type: ignore[arg-type]
    except ValueError as exc:
        raise _Bad(f"gather/ build_options invalid: {exc}") from None
    return frac_bits, align, order


def _gather_rows(rig: RigConfig, arrays: Mapping[str, np.ndarray], attrs: Mapping[str, Any]) -> dict[str, Any]:
    """Contract of the stored tables; returns them in logical (row-major cell) order."""
    frac_bits, align, order = _gather_options(attrs)
    cells = _cells(rig)
    n_cells = int(np.prod(cells))
    layout = layout_name(align, order)
    if attrs.get("layout") != layout:
        raise _Bad(f"gather/ attrs layout {attrs.get('layout')!r}, build_options imply {layout!r}")
    n_pad = -(-n_cells // align) * align
    if attrs.get("n_cells") != n_cells or attrs.get("n_cells_padded") != (n_cells if layout == "bev" else n_pad):
        raise _Bad(f"gather/ attrs n_cells {attrs.get('n_cells')!r} / n_cells_padded {attrs.get('n_cells_padded')!r}, config implies {n_cells} / {n_pad}")
    recorded_shape = list(cells) if grid_region(rig.bev) is None else [*cells[:2], cells[3]]  # a region's (n_cam, n_h, n_kept)
    if attrs.get("logical_shape") != recorded_shape:
        raise _Bad(f"gather/ attrs logical_shape {attrs.get('logical_shape')!r}, config implies {recorded_shape}")
    shape = (*cells, 4) if layout == "bev" else (n_pad, 4)
    index = _expect(arrays, "gather", "index", shape, ("int32",)).reshape(-1, 4)
    weight = _expect(arrays, "gather", "weight", shape, ("float32",)).reshape(-1, 4)
    codes = _expect(arrays, "gather", "weight_u8", shape, ("uint8",)).reshape(-1, 4)
    lut = _expect(arrays, "gather", "lut", (1 << frac_bits,), ("float32",))
    lut_value = attrs.get("lut")
    lut_attrs: Mapping[str, Any] = lut_value if isinstance(lut_value, Mapping) else {}
    for key, got, want in (("align", attrs.get("align"), align), ("order", attrs.get("order"), order), ("lut.frac_bits", lut_attrs.get("frac_bits"), frac_bits)):
        if got != want:
            raise _Bad(f"gather/ attrs {key} {got!r}, build_options say {want!r}")
    wanted = {"index", "weight", "weight_u8", "lut"} | ({"cell_valid"} if layout != "bev" else set()) | ({"perm", "perm_inverse"} if order != "row" else set())
    extra = sorted(set(arrays) - wanted)
    if extra:
        raise _Bad(f"arrays not produced by these build_options: {', '.join(extra)}")
    out: dict[str, Any] = {"layout": layout, "n_cells": n_cells, "n_pad": n_pad, "frac_bits": frac_bits, "lut": lut, "stored_index": index}
    rows = np.arange(n_cells)
    if layout != "bev":
        cell_valid = _expect(arrays, "gather", "cell_valid", (n_pad,), ("bool",))
        out["cell_valid"] = cell_valid
        out["padding"] = (index[n_cells:], weight[n_cells:], codes[n_cells:], cell_valid[n_cells:])
    if order != "row":
        perm = _expect(arrays, "gather", "perm", (n_pad,), ("int32",)).astype(np.int64)
        inverse = _expect(arrays, "gather", "perm_inverse", (n_cells,), ("int32",)).astype(np.int64)
        head = perm[:n_cells]
        if head.size and (head.min() < 0 or head.max() >= n_cells or np.unique(head).size != n_cells):
            raise _Bad("gather/perm: the first n_cells entries are not a permutation of the cells")
        if inverse.size and (inverse.min() < 0 or inverse.max() >= n_pad or not np.array_equal(head[inverse], np.arange(n_cells))):
            raise _Bad("gather/perm_inverse is not the inverse of gather/perm")
        if np.any(perm[n_cells:] != 0):
            raise _Bad("gather/perm: padding entries are not 0")
        rows = inverse
    out["index"] = index[rows]
    out["weight"] = weight[rows]
    out["codes"] = codes[rows]
    if layout != "bev":
        out["cell_valid_logical"] = out["cell_valid"][rows]
    return out


def logical_gather_tables(rig: RigConfig, arrays: Mapping[str, np.ndarray], attrs: Mapping[str, Any]) -> dict[str, Any]:
    """The stored ``gather/`` tables in logical (row-major cell) order, contract-checked: keys
    ``index`` int32, ``weight`` float32, ``codes`` uint8 (all ``(n_cam * n_h * ny * nx, 4)``) and
    ``lut`` float32 ``(L,)``. ValueError (one line) for a table that breaks the contract."""
    return _gather_rows(rig, arrays, attrs)


GATHER_ARRAYS = ("index", "weight", "weight_u8", "lut", "cell_valid", "perm", "perm_inverse")
"""Every array a gather/ build may write (which ones, its build_options decide)."""


def dimension_names_gather(name: str, ndim: int, attrs: Mapping[str, Any]) -> tuple[str, ...] | None:
    """The ``dimension_names`` the writer gives ``gather/<name>`` (None for an array no build writes)."""
    return group_dimension_names("gather", name, ndim, region="region" in attrs) if name in GATHER_ARRAYS else None


@region_plugin("gather")
def check_gather(ctx: CheckContext, arrays: Mapping[str, np.ndarray], attrs: Mapping[str, Any]) -> list[Check]:
    """Contract, index range, padding/invalid zeros, in-map mass, exact corners, LUT error."""
    checks: list[Check] = []
    state: dict[str, Any] = {}

    def contract() -> list[Check]:
        state.update(_gather_rows(ctx.rig, arrays, attrs))
        return [Check("contract", "gather/", True, f"layout {state['layout']}, {state['n_cells']} cells, {len(state['index'])} logical rows; shapes and dtypes as the config and build_options imply")]

    _guard(checks, "contract", "gather/", contract)
    if "index" not in state:
        return checks
    _guard(checks, "tables", "gather/index", lambda: _check_gather_tables(ctx, attrs, state))
    _guard(checks, "order_figures", "gather/", lambda: _check_order_figures(ctx, attrs, state))
    return checks


def _check_order_figures(ctx: CheckContext, attrs: Mapping[str, Any], state: Mapping[str, Any]) -> list[Check]:
    """The recorded locality figures (mean index jump, 8-row band switches) recomputed from the
    tables, in row order and in the stored (gather) order."""
    valid = ctx.grid_arrays.get("valid")
    valid_rows = (np.asarray(valid, dtype=bool) if valid is not None else ctx.sampling_grid().valid).reshape(-1)
    index_row = np.asarray(state["index"], dtype=np.int64)
    if "cell_valid" in state:
        index_gather, valid_gather = np.asarray(state["stored_index"], dtype=np.int64), np.asarray(state["cell_valid"], dtype=bool)
    else:
        index_gather, valid_gather = index_row, valid_rows
    feature_size = ctx.rig.feature_size
    want = {
        "mean_index_jump_row_order": mean_index_jump(index_row, valid_rows),
        "mean_index_jump_gather_order": mean_index_jump(index_gather, valid_gather),
        "band_switches_row_order": band_switches(index_row, valid_rows, feature_size),
        "band_switches_gather_order": band_switches(index_gather, valid_gather, feature_size),
    }
    bad = [f"{k} {attrs.get(k)!r} vs recomputed {v!r}" for k, v in want.items() if not same_recorded(attrs.get(k), v)]
    return [Check("order_figures", "gather/", not bad, "; ".join(bad) if bad else "mean index jump and band switches (row and gather order) equal the recomputation")]


def _check_gather_tables(ctx: CheckContext, attrs: Mapping[str, Any], state: Mapping[str, Any]) -> list[Check]:
    rig = ctx.rig
    w_f, h_f = rig.feature_size
    n_cam = rig.n_cam
    stacked = n_cam * h_f * w_f
    checks: list[Check] = []
    index = state["index"].astype(np.int64)
    weight = state["weight"].astype(np.float64)
    codes = state["codes"]
    in_range = bool(np.all((index >= 0) & (index < stacked)))
    checks.append(Check("index_in_range", "gather/index", in_range, f"indices in [{int(index.min()) if index.size else 0}, {int(index.max()) if index.size else 0}], stacked features hold {stacked}"))
    finite = bool(np.all(np.isfinite(weight)) and np.all((weight >= 0) & (weight <= 1)))
    checks.append(Check("weight_finite_unit", "gather/weight", finite, "every weight finite and in [0, 1]" if finite else "non-finite or out-of-[0, 1] weights"))

    truth = ctx.sampling_grid()
    valid = truth.valid.reshape(-1)
    pixel_index, weight64, _, _ = bilinear_corners(truth.coords_feature_px, truth.valid, truth.feature_size)
    base = camera_base_offsets(n_cam, truth.feature_size).reshape(n_cam, 1, 1, 1, 1)
    want_index = (pixel_index + base).reshape(-1, 4)
    weight64 = weight64.reshape(-1, 4)
    cam_base = np.repeat(camera_base_offsets(n_cam, truth.feature_size), valid.size // max(n_cam, 1))

    inv_w = float(np.abs(weight[~valid]).max()) if (~valid).any() else 0.0
    inv_i = bool(np.all(index[~valid] == cam_base[~valid][:, None]))
    checks.append(Check("invalid_cells_zero", "gather/weight", inv_w == 0.0 and inv_i, f"invalid cells: max |weight| {inv_w:.3g}, index = camera base: {inv_i}"))
    if "padding" in state:
        p_index, p_weight, p_codes, p_valid = state["padding"]
        ok = bool(np.all(p_index == 0) and np.all(p_weight == 0) and np.all(p_codes == 0) and not np.any(p_valid))
        checks.append(Check("padding_rows_zero", "gather/", ok, f"{len(p_index)} padding row(s): index 0, weight 0, codes 0, cell_valid False: {ok}"))
        grid_valid = np.asarray(ctx.grid_arrays["valid"]).reshape(-1) if "valid" in ctx.grid_arrays and np.asarray(ctx.grid_arrays["valid"]).size == valid.size else valid
        same = bool(np.array_equal(state["cell_valid_logical"], grid_valid))
        checks.append(Check("cell_valid_matches_grid", "gather/cell_valid", same, "cell_valid equals grid/valid in gather order" if same else "cell_valid differs from grid/valid"))
    mass_got = weight[valid].sum(axis=-1)
    mass_want = weight64[valid].sum(axis=-1)
    mass_err = float(np.abs(mass_got - mass_want).max()) if mass_got.size else 0.0
    checks.append(Check("valid_mass_is_in_map_mass", "gather/weight", mass_err <= 1e-6, f"max |sum(weight) - in-map bilinear mass| over valid cells {mass_err:.3g} (<= 1e-6)"))
    corners_ok = bool(np.array_equal(index[valid], want_index[valid]))
    w_err = float(np.abs(weight - weight64).max()) if weight.size else 0.0
    checks.append(
        Check(
            "corners_match_projection",
            "gather/index",
            corners_ok and w_err <= 2.0**-24,
            f"corner indices equal floor() of the float64 projection: {corners_ok}; max |weight - float64 weight| {w_err:.3g} (<= 2^-24)",
        )
    )
    rec_w32 = attrs.get("weight_float32_max_error")
    checks.append(Check("weight_error_attr", "gather/weight", isinstance(rec_w32, int | float) and _agrees(float(rec_w32), w_err), f"recorded weight_float32_max_error {rec_w32!r}, recomputed {w_err:.6g}"))

    lut = np.asarray(state["lut"])
    levels = 1 << state["frac_bits"]
    lut_ok = bool(np.array_equal(lut, lut_table(state["frac_bits"])))
    codes_ok = bool(np.all(codes.astype(np.int64) < levels))
    checks.append(Check("lut_table", "gather/lut", lut_ok and codes_ok, f"lut == c / {levels - 1} (float32): {lut_ok}; codes < {levels}: {codes_ok}"))
    if lut_ok and codes_ok:
        lut_w = lut_weights(codes, lut)
        lw_err = float(np.abs(lut_w - weight64).max()) if lut_w.size else 0.0
        ls_err = worst_case_sample_error(lut_w, weight64)
        rec_lw = attrs.get("lut_max_weight_error")
        rec_ls = attrs.get("lut_max_sample_error_unit_features")
        step = 1.0 / (levels - 1)
        ok = (
            isinstance(rec_lw, int | float)
            and isinstance(rec_ls, int | float)
            and _agrees(float(rec_lw), lw_err)
            and _agrees(float(rec_ls), ls_err)
            and lw_err <= step + 1e-7
            and float(np.abs(lut_w[~valid]).max() if (~valid).any() else 0.0) == 0.0
        )
        checks.append(
            Check(
                "lut_reconstruction",
                "gather/weight_u8",
                ok,
                f"max |lut weight - float64 weight| {lw_err:.4g} (recorded {rec_lw!r}, bound 1/(L-1) = {step:.4g}); worst-case sample error {ls_err:.4g} (recorded {rec_ls!r}); invalid cells reconstruct to 0",
            )
        )
    return checks


@region_plugin("gather")
def verify_gather(ctx: CheckContext, arrays: Mapping[str, np.ndarray], attrs: Mapping[str, Any]) -> list[VerifyRow]:
    """Gather tables (float weights and LUT weights) against bilinear sampling at the float64
    projection (0 on invalid cells), per camera."""
    if ctx.features is None:
        raise ValueError("verify_gather needs ctx.features")
    rig = ctx.rig
    try:
        state = _gather_rows(rig, arrays, attrs)
        lut_bound = float(attrs["lut_max_sample_error_unit_features"])
    except (_Bad, KeyError, TypeError, ValueError) as exc:
        return [VerifyRow("gather", "all", float("inf"), float("inf"), 0.0, "contract", False, str(exc))]
    truth = ctx.sampling_grid()
    cells = _cells(rig)
    features = ctx.features
    index = state["index"]
    got = gather_sample(features, index, state["weight"]).reshape(-1, *cells)
    got_lut = gather_sample(features, index, lut_weights(state["codes"], state["lut"])).reshape(-1, *cells)
    rows = []
    for cam_index, camera in enumerate(rig.cameras):
        ref = np.where(truth.valid[cam_index][None], bilinear_sample_px(features[cam_index], truth.coords_feature_px[cam_index]), 0.0)
        rows.append(_row("gather/index+weight", camera.name, got[:, cam_index], ref, GATHER_THRESHOLD, "one Gather on the camera-stacked features + weighted sum"))
        rows.append(
            _row("gather/weight_u8+lut", camera.name, got_lut[:, cam_index], ref, lut_bound * FEATURE_PEAK + BOUND_SLACK, f"LUT weights ({len(state['lut'])} levels/axis); bound = recorded worst-case sample error")
        )
    return rows


@region_rebuild
def rebuild_gather(rig: RigConfig, attrs: Mapping[str, Any]) -> dict[str, Any]:
    """Recompute ``gather/`` from ``build_options`` (frac_bits, align, order)."""
    frac_bits, align, order = _gather_options(attrs)
    sampling = compute_product_grid(rig)
    tables = build_gather_tables(sampling, frac_bits)
    layout = layout_tables(tables, sampling.coords_feature_px, align=align, order=order)
    from ..build import gather_group

    group = gather_group(tables, layout, rig, grid_region(rig.bev))
    return {**group.arrays, REBUILT_ATTRS: group.attrs}


