"""Sparse aggregation matrices: the camera-to-BEV lift as one product ``F_bev = W @ F_img``.

Pure numpy (no zarr, no printing). :func:`build_matrix` returns :class:`MatrixProducts`
(COO, ELL, tiles, int8, camera mass and the measured figures); :func:`run_matrix` builds
and writes the ``matrix/`` group (the store I/O lives in :mod:`bevcompile.store.zarr_io`).

Conventions (README "Sparse aggregation matrices"; stored in the ``matrix/`` group attributes):

* Rows: BEV cells, row-major ``row = iy * nx + ix`` (``--compact-rows``: only non-empty
  rows, ``row_ids[r]`` is the BEV cell of row ``r``).
* ``mode="frustum"`` columns: ``col = ((cam * D + d) * H_f + v) * W_f + u`` — the flattening
  of BEVDet's ``(N, D, H, W)`` depth x feature outer product. The point of column
  ``(cam, d, v, u)`` is the feature-pixel centre ``(u, v)`` lifted to depth ``bins[d]`` along
  the optical axis, in BEV-frame metres (``bev.frame``), evaluated exactly as
  ``ray_bev = R[:, 0] * x_n + R[:, 1] * y_n + R[:, 2]`` (``(x_n, y_n, 1)`` = the undistorted
  normalised ray of :func:`bevcompile.rig.geometry.unproject_image_to_cam`) and
  ``p_bev = t + d * ray_bev`` (``bev_from_cam = [R | t]``, the pose in the BEV frame) — the same point as
  :func:`bevcompile.rig.geometry.unproject_feature_to_bev` (to ~1e-13 m), written elementwise so
  that every build (streamed, reference, any chunking) gets identical bits.
* Cell coordinates ``f_x = (x - x_min) / dx``, ``f_y = (y - y_min) / dy``,
  ``f_z = (z - z_min) / dz``; a point is in range iff its cell index ``i = floor(f)``
  (``rounding="floor"``: the cell containing it) or ``i = trunc(f)`` (``rounding="trunc"``:
  BEVDet's ``.long()``, which also puts ``f`` in ``(-1, 0)`` into cell 0) satisfies
  ``0 <= i < n`` on all three axes (z: ``bev.z``; every z bin collapses into the BEV cell).
* ``splat="nearest"``: weight 1 to cell ``(i_y, i_x)``. ``splat="bilinear"``: with
  ``g = f - 0.5`` (cell-centre coordinates), ``i0 = floor(g)``, ``a = g - i0``, the point gives
  ``(1 - a_x)(1 - a_y)``, ``a_x (1 - a_y)``, ``(1 - a_x) a_y``, ``a_x a_y`` to the four cells
  ``(i0_y + {0,1}, i0_x + {0,1})``; cells outside the grid get nothing (zeros padding).
* ``mode="ray"`` columns: ``col = (cam * H_f + v) * W_f + u`` (grid mode's); the weight of
  pixel ``(u, v)`` in a row is ``sum_d p[cam, d, v, u] * w_frustum(row, (cam, d, v, u))`` (the
  frustum's points, range rule, splat and rounding; ``p`` the depth prior renormalised per pixel,
  :mod:`bevcompile.matrix.prior`), summed in increasing ``d``; tie-break distance the smallest
  frustum distance of the contributing depth bins. Equivalently ``W_ray @ F = W_frustum @ (p x F)``.
* ``mode="grid"`` columns: ``col = (cam * H_f + v) * W_f + u``; row weights are the
  ``grid_sample`` weights (bilinear, zeros padding; or nearest = round half to even) of the
  cell's float64 sampling position in every camera at every height (the ``grid/`` geometry),
  summed over heights in height order. Invalid cells contribute nothing.
* Entries of weight exactly 0 are not stored. Top-K (``topk > 0``) keeps per row the K entries
  of largest raw weight; ties by smaller squared distance of the source point to the cell
  centre (frustum: ``((g_x - i_x) dx)^2 + ((g_y - i_y) dy)^2`` metres^2; grid: squared
  feature-pixel distance between the pixel centre and the sampling position, minimum over
  heights), then by smaller column. ``normalize="mean"`` divides each kept row by its kept
  raw weight sum; ``"sum"`` keeps raw weights.

Modules: :mod:`bevcompile.matrix.entries` (rays, streamed Top-K build, grid entries) and
:mod:`bevcompile.matrix.layout` (ELL, tiles, int8); their public names are re-exported here.

Speed: the frustum build streams over ``(camera, depth-bin chunk)`` blocks in two passes
(a per-row histogram of the Top-K order key, then the candidates that can still be in the
Top-K, gathered in a bounded buffer), computed by ``jobs`` threads and folded in block order
(:mod:`bevcompile.matrix.topk`), so it never materialises all points or sorts them all; the result
is bit-identical to the straightforward build in :mod:`bevcompile.matrix.reference`, for every
``jobs``.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from ..choices import canonical_choice
from ..errors import StoreConflictError, StoreError, UsageError, check_int_option
from ..grid.build import check_grid_memory
from ..memory import peak_rss_bytes, refuse_beyond_memory
from ..parallel import resolve_jobs
from ..progress import ProgressFn, start_phase
from ..rig.config import RigConfig, config_sha256
from ..rig.region import RegionTable, region_table
from ..store.root import root_attributes
from ..store.zarr_io import GroupData, WriteReport, check_replaceable, is_store, open_store, store_path, write_groups
from .entries import CameraRays, Entries, _hist_bins, camera_rays, frustum_entries, grid_entries, select_topk
from .layout import (
    INT8_MAX,
    MAX_PRODUCT_SLOTS,
    check_product_slots,
    coo_to_dense,
    dequantize_rows_int8,
    ell_layout,
    int8_errors,
    quantize_rows_int8,
    round_up,
    tile_blocks,
    tile_int8_errors,
    tile_layout,
    tile_scales_and_int8,
)
from .lift32 import PRECISIONS, RESTATES
from .precision import (
    Fp16Rule,
    decoded_errors,
    encode_fp16,
    fp16_row_tile_offsets,
    fp16_row_tile_weight,
    int8_row_snr_db,
    row_distances_m,
    select_fp16_rows,
    tile_row_span,
)
from .prior import ARRAY as PRIOR_ARRAY
from .prior import PRIOR_DIMS, UNIFORM, DepthPrior, check_token
from .ray import ray_entries
from .region import merge_region_rows

__all__ = [
    "INT8_MAX",
    "MAX_PRODUCT_SLOTS",
    "CameraRays",
    "Entries",
    "MatrixFigures",
    "MatrixOptions",
    "MatrixProducts",
    "MatrixRunResult",
    "assemble_products",
    "build_matrix",
    "camera_rays",
    "coo_to_dense",
    "dequantize_rows_int8",
    "ell_layout",
    "int8_errors",
    "matrix_attributes",
    "matrix_group",
    "matrix_pass_units",
    "matrix_work_units",
    "n_columns",
    "quantize_rows_int8",
    "round_up",
    "run_matrix",
    "select_topk",
    "tile_blocks",
    "tile_int8_errors",
    "tile_layout",
    "tile_scales_and_int8",
]

I64 = npt.NDArray[np.int64]
F64 = npt.NDArray[np.float64]

MODES = ("frustum", "grid", "ray")
DEPTH_MODES = ("frustum", "ray")
"""Modes whose entries are the frustum's points (depth bins, ``--rounding``)."""
SPLATS = ("nearest", "bilinear")
NORMALIZES = ("sum", "mean")
ROUNDINGS = ("floor", "trunc")
QUANTIZE = (None, "int8", "fp16", "mixed")
INT8_PRODUCTS = ("int8", "mixed")
"""``--quantize`` values whose store holds the per-row int8 product (mixed: int8 + the fp16 rows)."""
MAX_INDEX = np.iinfo(np.int32).max
MAX_MATRIX_ALIGN = 65536

TOPK_RULE = (
    "per row keep the K entries of largest raw weight; ties: smaller squared distance of the source point "
    "to the cell centre, then smaller column index; K = 0 keeps every entry"
)
K_PAD_RULE = "k_pad = round_up(K, align) when K > 0 (shape independent of the calibration); round_up(max(max row nnz, 1), align) when K = 0"


# --------------------------------------------------------------------------------------
# options
# --------------------------------------------------------------------------------------


TARGET_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
"""A target profile name as ``build_options.target`` records it."""


@dataclass(frozen=True)
class MatrixOptions:
    """Every option of a matrix build (stored as ``matrix/`` ``attrs["build_options"]``)."""

    mode: str = "frustum"
    topk: int = 0
    align: int = 16
    splat: str = "bilinear"
    normalize: str = "sum"
    tile_rows: int | None = None
    quantize: str | None = None
    compact_rows: bool = False
    rounding: str = "floor"
    depth_prior: str = UNIFORM
    """``mode="ray"`` only: ``"uniform"`` or ``"sha256:<hex>"`` of the stored ``matrix/depth_prior``."""
    fp16_rows: str | None = None
    """``quantize="mixed"`` only: the :class:`~bevcompile.matrix.precision.Fp16Rule` token
    (``"beyond:35.0"``, ``"snr:60.0"``, ``"fraction:0.1"``) of the rows kept in float16."""
    precision: str = "float64"
    """``float64``: bevcompile's exact geometry; ``float32``: the frustum points in BEVDet's own float32
    op sequence (:func:`bevcompile.matrix.lift32.bevdet_points_float32`; ``mode="frustum"``, a
    ``linspace`` feature mapping, pinhole cameras), so the voxel of every point is BEVDet's float32 run's;
    ``float16``: BEVDepth's ``get_geometry`` as its float16 training computes it
    (:func:`bevcompile.matrix.lift16.bevdepth_points_float16`, same conditions; points whose float16
    geometry overflows are dropped, as BEVDepth's CPU run drops them)."""
    target: str | None = None
    """The NPU target profile the matrix is built for (``bevcompile targets``; ``matrix --target``):
    recorded only, the entries do not depend on it; ``export-onnx`` of ``ell`` / ``tiles`` builds for
    it when no ``--target`` is given."""

    def validate(self) -> MatrixOptions:
        """Raise :class:`UsageError` (one line) for any invalid option; return self."""
        checks: tuple[tuple[str, Any, tuple[Any, ...]], ...] = (
            ("mode", self.mode, MODES),
            ("splat", self.splat, SPLATS),
            ("normalize", self.normalize, NORMALIZES),
            ("rounding", self.rounding, ROUNDINGS),
            ("quantize", self.quantize, QUANTIZE),
            ("precision", self.precision, PRECISIONS),
        )
        for name, value, allowed in checks:
            if value not in allowed:
                shown = ", ".join("none" if a is None else str(a) for a in allowed)
                raise UsageError(f"--{name} must be one of {shown}, got {value!r}")
        check_int_option("topk", self.topk, 0)
        check_int_option("align", self.align, 1, MAX_MATRIX_ALIGN)
        if self.tile_rows is not None:
            check_int_option("tile-rows", self.tile_rows, 1)
        if self.mode == "grid" and self.rounding != "floor":
            raise UsageError(f"--rounding {self.rounding} applies to --mode frustum and ray only (grid-mode rows are BEV cells, nothing is rounded)")
        check_token(self.depth_prior)
        if self.mode != "ray" and self.depth_prior != UNIFORM:
            raise UsageError(f"--depth-prior applies to --mode ray only (--mode {self.mode})")
        if not isinstance(self.compact_rows, bool):
            raise UsageError(f"compact_rows must be a boolean, got {self.compact_rows!r}")
        if self.quantize == "mixed":
            if self.fp16_rows is None:
                raise UsageError("--quantize mixed needs --fp16-rows beyond:METRES, snr:DB or fraction:F (which rows keep float16 values)")
            Fp16Rule.parse(self.fp16_rows)
        elif self.fp16_rows is not None:
            raise UsageError(f"--fp16-rows applies to --quantize mixed only (--quantize {self.quantize or 'none'})")
        if self.target is not None and not (isinstance(self.target, str) and TARGET_NAME.fullmatch(self.target)):
            raise UsageError(f"target must be a target profile name (letters, digits, _ . -; bevcompile targets), got {self.target!r}")
        if self.precision in RESTATES and self.mode != "frustum":
            raise UsageError(f"--precision {self.precision} restates {RESTATES[self.precision]}: --mode frustum only (--mode {self.mode})")
        return self

    def fp16_rule(self) -> Fp16Rule | None:
        """The parsed ``fp16_rows`` rule (None unless ``quantize="mixed"``)."""
        return Fp16Rule.parse(self.fp16_rows) if self.quantize == "mixed" and self.fp16_rows is not None else None

    def to_dict(self) -> dict[str, Any]:
        """``build_options`` (``depth_prior`` only in ray mode, ``precision`` only when float32 or float16: the other builds' options are unchanged)."""
        out = asdict(self)
        if self.mode != "ray":
            del out["depth_prior"]
        if self.quantize != "mixed":  # the other products' options are unchanged (same store bytes)
            del out["fp16_rows"]
        if self.precision == "float64":  # the default is not recorded: stores built before --precision keep their bytes
            del out["precision"]
        if self.target is None:  # likewise
            del out["target"]
        return out

    @classmethod
    def from_command(
        cls,
        *,
        mode: str = "frustum",
        topk: int = 0,
        align: int = 16,
        splat: str = "bilinear",
        normalize: str = "sum",
        tile_rows: int | None = None,
        quantize: str | None = None,
        compact_rows: bool = False,
        rounding: str = "floor",
        depth_prior: str = UNIFORM,
        fp16_rows: str | None = None,
        precision: str = "float64",
        target: str | None = None,
    ) -> MatrixOptions:
        """Validated options from the values of ``bevcompile matrix`` as a user gives them
        (enumerated values in any case; ``quantize`` ``none`` = no int8; ``fp16_rows`` a rule as
        ``--fp16-rows`` takes it, stored as its canonical token): what the CLI and a fleet
        manifest's ``matrix:`` product both build with. :class:`UsageError` for a bad value."""
        quantize_value = canonical_choice(quantize, (*QUANTIZE, "none"))  # validate refuses the rest
        return cls(
            mode=canonical_choice(mode, MODES),
            topk=topk,
            align=align,
            splat=canonical_choice(splat, SPLATS),
            normalize=canonical_choice(normalize, NORMALIZES),
            tile_rows=tile_rows,
            quantize=None if quantize_value == "none" else quantize_value,
            compact_rows=compact_rows,
            rounding=canonical_choice(rounding, ROUNDINGS),
            depth_prior=depth_prior,
            fp16_rows=None if fp16_rows is None else Fp16Rule.parse(fp16_rows).token,
            precision=canonical_choice(precision, PRECISIONS),
            target=target,
        ).validate()

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MatrixOptions:
        """Options from ``build_options`` (unknown keys are an error: they would not rebuild)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise UsageError(f"unknown matrix build option(s): {', '.join(unknown)}")
        return cls(**dict(data)).validate()


# --------------------------------------------------------------------------------------
# products
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MatrixFigures:
    """Measured figures of one build (the deterministic ones go into the group attributes)."""

    n_points: int  # frustum: n_cam * D * H_f * W_f; grid: n_cam * n_heights * ny * nx
    n_points_valid: int  # frustum: points of pixels with a lens preimage; grid: valid samples
    n_points_in_range: int  # frustum: inside the BEV x/y/z range; grid: = valid samples
    n_candidates: int  # entries that reached the final Top-K sort
    nnz: int
    row_nnz_min: int  # over non-empty rows
    row_nnz_median: float
    row_nnz_max: int
    n_empty_rows: int  # BEV cells without any entry
    kept_weight_fraction_total: float
    kept_weight_fraction_worst_row: float
    worst_row_cell: int  # BEV cell of the worst row (-1 if none)
    int8_max_rel_error: float | None  # max |deq - w| / max|row| over ELL entries
    int8_max_abs_error: float | None
    tile_bytes: int | None
    dense_bytes: int
    product_bytes: dict[str, int]
    build_seconds: float = 0.0
    peak_rss_bytes: int = 0
    fp16_max_rel_error: float | None = None  # fp16 / mixed (its fp16 rows): max |decode - w| / max|row|
    fp16_max_abs_error: float | None = None
    n_fp16_rows: int | None = None  # mixed: rows kept in float16


@dataclass(frozen=True)
class MatrixProducts:
    """Arrays of the ``matrix/`` group and their figures (see the README's matrix/ contract for each array)."""

    options: MatrixOptions
    n_cells: int
    bev_shape: tuple[int, int]  # (ny, nx)
    n_cam: int
    n_rows: int
    n_cols: int
    rows_pad: int
    cols_pad: int
    k_pad: int
    cols_per_camera: int
    coo_row: npt.NDArray[np.int32]
    coo_col: npt.NDArray[np.int32]
    coo_val: npt.NDArray[np.float32]
    ell_index: npt.NDArray[np.int32]
    ell_weight: npt.NDArray[np.float32]
    camera_mass: npt.NDArray[np.float32]
    row_ids: npt.NDArray[np.int32] | None
    n_tiles: int
    tile_cols: npt.NDArray[np.int32] | None
    tile_col_offsets: npt.NDArray[np.int64] | None
    tile_weight: npt.NDArray[np.float32] | None
    row_scale: npt.NDArray[np.float32] | None
    ell_weight_int8: npt.NDArray[np.int8] | None
    tile_row_scale: npt.NDArray[np.float32] | None
    tile_weight_int8: npt.NDArray[np.int8] | None
    figures: MatrixFigures
    extra: dict[str, Any] = field(default_factory=dict)
    depth_prior: DepthPrior | None = None  # ray mode: the prior (its raw array is stored unless uniform)
    region_cells: npt.NDArray[np.int32] | None = None  # bev.region: (n_kept, 3) (iy, ix, size), stored as matrix/cells
    expand: npt.NDArray[np.int32] | None = None  # bev.region: (ny * nx,) compact row of each fine cell (n_kept: the zero row)
    ell_weight_fp16: npt.NDArray[np.float16] | None = None  # --quantize fp16: (rows_pad, k_pad)
    tile_weight_fp16: npt.NDArray[np.float16] | None = None  # --quantize fp16 with tiles: (R * T,)
    fp16_rows: npt.NDArray[np.int32] | None = None  # --quantize mixed: (n16,) rows kept in float16
    fp16_row_weight: npt.NDArray[np.float16] | None = None  # --quantize mixed: (n16, k_pad)
    fp16_row_tile_weight: npt.NDArray[np.float16] | None = None  # --quantize mixed with tiles

    def arrays(self) -> dict[str, np.ndarray]:
        """The group's arrays by name (optional products only when built)."""
        out: dict[str, np.ndarray] = {
            "coo_row": self.coo_row,
            "coo_col": self.coo_col,
            "coo_val": self.coo_val,
            "ell_index": self.ell_index,
            "ell_weight": self.ell_weight,
            "camera_mass": self.camera_mass,
        }
        optional = {
            "row_ids": self.row_ids,
            "tile_cols": self.tile_cols,
            "tile_col_offsets": self.tile_col_offsets,
            "tile_weight": self.tile_weight,
            "row_scale": self.row_scale,
            "ell_weight_int8": self.ell_weight_int8,
            "tile_row_scale": self.tile_row_scale,
            "tile_weight_int8": self.tile_weight_int8,
            "cells": self.region_cells,
            "expand": self.expand,
            "ell_weight_fp16": self.ell_weight_fp16,
            "tile_weight_fp16": self.tile_weight_fp16,
            "fp16_rows": self.fp16_rows,
            "fp16_row_weight": self.fp16_row_weight,
            "fp16_row_tile_weight": self.fp16_row_tile_weight,
        }
        out.update({name: arr for name, arr in optional.items() if arr is not None})
        if self.depth_prior is not None and self.depth_prior.raw is not None:
            out[PRIOR_ARRAY] = self.depth_prior.raw
        return out

    def dense(self) -> npt.NDArray[np.float32]:
        """The logical matrix as a dense ``(n_rows, n_cols)`` float32 array (small rigs only)."""
        return coo_to_dense(self.coo_row, self.coo_col, self.coo_val, (self.n_rows, self.n_cols))


def matrix_work_units(rig: RigConfig, options: MatrixOptions) -> int:
    """Total of the ``progress(n)`` calls of :func:`build_matrix` (points per pass, or grid cells)."""
    if options.mode == "grid":
        return matrix_pass_units(rig, options)
    return 2 * matrix_pass_units(rig, options)  # pass 1 (histogram, or row counts when K = 0) + pass 2


def matrix_pass_units(rig: RigConfig, options: MatrixOptions) -> int:
    """Units of the first counted phase of :func:`build_matrix` (what a progress bar's first
    phase counts; frustum mode's pass 2 starts a phase of as many, see
    :func:`bevcompile.progress.start_phase`): frustum points, or grid samples."""
    if options.mode == "grid":
        return rig.n_cam * len(rig.bev.heights) * rig.bev.ny * rig.bev.nx
    w_f, h_f = rig.feature_size
    return rig.n_cam * rig.depth.n_bins * w_f * h_f


def n_columns(rig: RigConfig, mode: str) -> int:
    w_f, h_f = rig.feature_size
    per_cam = (rig.depth.n_bins if mode == "frustum" else 1) * h_f * w_f  # ray and grid: (cam, v, u)
    return rig.n_cam * per_cam


def check_planned_sizes(options: MatrixOptions, n_cells: int) -> None:
    """Refuse, before any work, options whose padded products could not be allocated.

    Lower bounds only (the K = 0 ELL and the exact tile sizes are checked again once known):
    ELL ``round_up(rows, align) x round_up(K, align)``; tiles at least ``ceil(rows / R) R x align``.
    """
    a = options.align
    rows_low = 1 if options.compact_rows else n_cells
    rows_pad = round_up(rows_low, a)
    if options.topk > 0:
        k_pad = round_up(options.topk, a)
        check_product_slots(
            f"ELL ({rows_pad:,} rows_pad x {k_pad:,} k_pad, from --topk {options.topk:,} --align {a:,})",
            rows_pad * k_pad,
            "lower --topk or --align",
        )
    else:
        check_product_slots(f"ELL (at least {rows_pad:,} rows_pad x {a:,} k_pad, from --align {a:,})", rows_pad * a, "lower --align")
    if options.tile_rows is not None:
        r = options.tile_rows
        check_product_slots(
            f"the tiles (at least {-(-rows_low // r) * r:,} rows x {a:,} columns, from --tile-rows {r:,} --align {a:,})",
            -(-rows_low // r) * r * a,
            "use fewer --tile-rows or a smaller --align",
        )


def ell_shape(options: MatrixOptions, row_nnz_cells: npt.NDArray[np.integer[Any]]) -> tuple[int, int]:
    """``(rows_pad, k_pad)`` of the ELL for the per-cell entry counts ``row_nnz_cells``
    (``(ny * nx,)``), refused (:class:`UsageError`) over the slot limit: the K = 0 row length is
    the max row nnz, so this runs on pass 1's counts, before the entries are collected."""
    n_rows = int(np.count_nonzero(row_nnz_cells)) if options.compact_rows else int(row_nnz_cells.size)
    max_nnz = int(row_nnz_cells.max()) if row_nnz_cells.size else 0
    align = options.align
    rows_pad = round_up(max(n_rows, 1), align)
    k_pad = round_up(options.topk, align) if options.topk > 0 else round_up(max(max_nnz, 1), align)
    check_product_slots(f"ELL ({rows_pad:,} rows_pad x {k_pad:,} k_pad)", rows_pad * k_pad, "set --topk to bound the row length")
    return rows_pad, k_pad


FRUSTUM_BYTES_BASE = 64 * 2**20
FRUSTUM_BYTES_PER_CELL_BIN = 24
FRUSTUM_BYTES_PER_CELL_CAMERA = 8
FRUSTUM_BYTES_PER_CELL = 40
"""Per-BEV-cell memory of a frustum build (see :func:`check_frustum_memory`). Measured on the
nuScenes rig (6 cameras) at 0.05 and 0.025 m cells (4.2 M / 16.8 M cells): --topk 24 (8 bins)
~272 B per padded cell (estimate 280), --topk 0 nearest ~79 B (estimate 88)."""


def check_frustum_memory(rig: RigConfig, options: MatrixOptions) -> None:
    """Refuse, before any work, a frustum build whose per-BEV-cell arrays cannot fit in this
    machine's memory (the :func:`bevcompile.grid.build.check_grid_memory` of the matrix).

    The per-row arrays scale with the cells, not the points, even with ``--compact-rows``: the
    Top-K histogram (``n_cells x bins`` int64 counters, >= 8 bins), its bincount and threshold
    temporaries, the row masses and ``camera_mass``. Estimate: ``64 MiB + n_pad (24 bins + 8
    n_cam + 40) B`` with ``n_pad = (ny + 3)(nx + 3)`` (no bins when K = 0). Ray mode has the same per-cell arrays."""
    if options.mode not in DEPTH_MODES:
        return
    ny, nx = rig.bev.ny, rig.bev.nx
    n_pad = (ny + 3) * (nx + 3)
    bins = _hist_bins(ny * nx) if options.topk > 0 else 0
    per_cell = FRUSTUM_BYTES_PER_CELL_BIN * bins + FRUSTUM_BYTES_PER_CELL_CAMERA * rig.n_cam + FRUSTUM_BYTES_PER_CELL
    refuse_beyond_memory(
        FRUSTUM_BYTES_BASE + n_pad * per_cell,
        f"{rig.source}: bevcompile matrix --mode {options.mode} of {ny} x {nx} = {ny * nx:,} BEV cells",
        "use coarser bev steps (its per-cell arrays scale with the cells, also with --compact-rows)",
    )


def resolve_prior(options: MatrixOptions, depth_prior: DepthPrior | None) -> DepthPrior | None:
    """The prior a ray build uses: uniform, or ``depth_prior`` whose hash ``options`` names
    (:class:`UsageError` when they disagree); None for the other modes."""
    if options.mode != "ray":
        if depth_prior is not None and not depth_prior.uniform:
            raise UsageError(f"--depth-prior applies to --mode ray only (--mode {options.mode})")
        return None
    prior = depth_prior or DepthPrior()
    if prior.token != options.depth_prior:
        raise UsageError(
            f"build option depth_prior {options.depth_prior[:19]!r} does not name the given prior ({prior.token[:19]!r}): "
            "pass the prior array the options were made from"
        )
    return prior


def build_matrix(
    rig: RigConfig,
    options: MatrixOptions | None = None,
    progress: ProgressFn | None = None,
    *,
    jobs: int | None = None,
    depth_prior: DepthPrior | None = None,
) -> MatrixProducts:
    """Build every product of the sparse aggregation matrix of ``rig`` (see module docstring),
    with ``jobs`` threads (default: the cores this process may use; the bytes do not depend on it).
    Ray mode folds the depth bins with ``depth_prior`` (default uniform; a file prior must be the
    one ``options.depth_prior`` names).

    Convention:
        returns :class:`MatrixProducts`: COO ``coo_row``/``coo_col`` int32 and ``coo_val``
        float32 sorted by (row, col), logical shape ``(n_rows, n_cols)``; ELL ``(rows_pad,
        k_pad)``; optional tiles/int8/row_ids; ``camera_mass`` float32 ``(n_cam, ny, nx)``.
    """
    options = (options or MatrixOptions()).validate()
    jobs = resolve_jobs(jobs)
    t0 = time.perf_counter()
    ny, nx = rig.bev.ny, rig.bev.nx
    n_cells = ny * nx
    n_cols = n_columns(rig, options.mode)
    if n_cols > MAX_INDEX or n_cells > MAX_INDEX:
        raise UsageError(f"matrix of {n_cells:,} rows x {n_cols:,} columns does not fit int32 indices")
    table = region_table(rig.bev) if rig.bev.region is not None else None
    if table is not None and options.compact_rows:
        raise UsageError(
            "--compact-rows does not combine with a bev.region: the region's cell table already names the rows "
            "(drop --compact-rows, or remove cells no camera sees with the region's keep)"
        )
    region = (table.row_of_cell(), table.n_kept, table.cells[:, 2] > 1) if table is not None else None
    check_planned_sizes(options, n_cells if table is None else table.n_kept + 1)
    prior = resolve_prior(options, depth_prior)
    if options.mode in DEPTH_MODES:

        def check_ell(row_nnz: npt.NDArray[np.int64]) -> None:  # K = 0: refuse before pass 2
            ell_shape(options, row_nnz)

        if prior is not None:
            res = ray_entries(
                rig, splat=options.splat, rounding=options.rounding, topk=options.topk, prior=prior.normalised(rig),
                progress=progress, check_row_nnz=check_ell, jobs=jobs, region=region,
            )
        else:
            res = frustum_entries(
                rig, splat=options.splat, rounding=options.rounding, topk=options.topk, progress=progress,
                check_row_nnz=check_ell, jobs=jobs, region=region, precision=options.precision,
            )
        kept, total_mass = res.kept, res.total_mass
        counts = (res.n_points, res.n_points_valid, res.n_points_in_range, res.n_candidates)
        phases = res.phase_seconds
        selection = {"candidates": res.n_candidates, "largest_sort": res.largest_sort, "compactions": res.compactions}
    else:
        entries, total_mass, n_valid = grid_entries(rig, splat=options.splat, progress=progress, jobs=jobs)
        if region is not None:  # rows = the region's compact rows, merged before Top-K
            entries = merge_region_rows(entries, region[0], n_cols, region[2])
            total_mass = np.bincount(entries.row, weights=entries.weight, minlength=region[1]).astype(np.float64)
        kept = select_topk(entries, options.topk, jobs)
        n_samples = rig.n_cam * len(rig.bev.heights) * n_cells
        counts = (n_samples, n_valid, n_valid, len(entries))
        phases = {"grid_entries_topk": time.perf_counter() - t0}
        selection = {"candidates": len(entries), "largest_sort": len(entries), "compactions": 0}
    t1 = time.perf_counter()
    if table is not None:  # the zero row (row n_kept): no entry, no mass
        total_mass = np.r_[total_mass, 0.0]
    start_phase(progress, "laying out COO / ELL / tiles")
    products = assemble_products(rig, options, kept, total_mass, counts, t0, table)
    if prior is not None:
        products = replace(products, depth_prior=prior)
    products.extra["phase_seconds"] = {**phases, "assemble": time.perf_counter() - t1}
    products.extra["selection"] = selection
    products.extra["jobs"] = jobs
    return products


def assemble_products(
    rig: RigConfig,
    options: MatrixOptions,
    kept: Entries,
    total_mass: F64,
    counts: tuple[int, int, int, int],
    t0: float | None = None,
    table: RegionTable | None = None,
) -> MatrixProducts:
    """Normalise the kept entries and lay out every product.

    Convention: ``kept`` :class:`Entries` sorted by (row, col) with BEV-cell rows and raw
    weights; ``total_mass`` ``(ny * nx,)`` float64 raw weight of every entry before Top-K;
    ``counts`` = (points, valid points, points in range, candidates sorted).
    """
    t0 = time.perf_counter() if t0 is None else t0
    ny, nx = rig.bev.ny, rig.bev.nx
    n_grid_cells = ny * nx
    # the rows before compaction: BEV cells, or (bev.region) the kept (super-)cells + the zero row
    n_cells = n_grid_cells if table is None else table.n_kept + 1
    n_cols = n_columns(rig, options.mode)
    cols_per_camera = n_cols // rig.n_cam
    kept_mass = np.bincount(kept.row, weights=kept.weight, minlength=n_cells)
    if options.normalize == "mean":
        safe = np.where(kept_mass > 0, kept_mass, 1.0)
        values64 = kept.weight / safe[kept.row]
    else:
        values64 = kept.weight
    coo_val = values64.astype(np.float32)
    # kept fraction of the raw weight (rows with any weight)
    has = total_mass > 0
    frac_total = float(kept_mass[has].sum() / total_mass[has].sum()) if has.any() else 1.0
    frac_rows = np.where(has, kept_mass / np.where(has, total_mass, 1.0), np.inf)
    worst = int(np.argmin(frac_rows)) if has.any() else -1
    frac_worst = float(min(1.0, frac_rows[worst])) if worst >= 0 else 1.0
    frac_total = min(1.0, frac_total)
    # rows (optionally compacted)
    row_nnz_cells = np.bincount(kept.row, minlength=n_cells)
    if options.compact_rows:
        row_ids = np.flatnonzero(row_nnz_cells).astype(np.int32)
        remap = np.full(n_cells, -1, dtype=np.int64)
        remap[row_ids] = np.arange(row_ids.size)
        rows = remap[kept.row]
        n_rows = int(row_ids.size)
    else:
        row_ids = None
        rows = kept.row
        n_rows = n_cells
    nnz = len(kept)
    non_empty = row_nnz_cells[row_nnz_cells > 0]
    max_nnz = int(non_empty.max()) if non_empty.size else 0
    align = options.align
    cols_pad = round_up(n_cols, align)
    rows_pad, k_pad = ell_shape(options, row_nnz_cells)
    coo_row = rows.astype(np.int32)
    coo_col = kept.col.astype(np.int32)
    values = value_products(
        rig, options, coo_row, coo_col, coo_val, kept.row, n_rows, rows_pad, k_pad, expand=None if table is None else table.expand,
        row_distance=row_distances_m(rig, n_rows, row_ids, None if table is None else table.cells) if options.quantize == "mixed" else None,
    )
    if table is not None:
        values.product_bytes["cells"] = int(table.cells.nbytes)
        values.product_bytes["expand"] = int(table.expand.nbytes)
    if row_ids is not None:
        values.product_bytes["row_ids"] = int(row_ids.nbytes)
    figures = MatrixFigures(
        n_points=counts[0],
        n_points_valid=counts[1],
        n_points_in_range=counts[2],
        n_candidates=counts[3],
        nnz=nnz,
        row_nnz_min=int(non_empty.min()) if non_empty.size else 0,
        row_nnz_median=float(np.median(non_empty)) if non_empty.size else 0.0,
        row_nnz_max=max_nnz,
        n_empty_rows=int(n_cells - non_empty.size) - (0 if table is None else 1),  # region: the zero row is not counted
        kept_weight_fraction_total=frac_total,
        kept_weight_fraction_worst_row=frac_worst,
        worst_row_cell=worst,
        int8_max_rel_error=values.int8_max_rel_error,
        int8_max_abs_error=values.int8_max_abs_error,
        tile_bytes=values.product_bytes.get("tiles"),
        dense_bytes=int(n_rows) * int(n_cols) * 4,
        product_bytes=values.product_bytes,
        build_seconds=time.perf_counter() - t0,
        peak_rss_bytes=peak_rss_bytes(),
        fp16_max_rel_error=values.fp16_max_rel_error,
        fp16_max_abs_error=values.fp16_max_abs_error,
        n_fp16_rows=None if values.fp16_rows is None else int(values.fp16_rows.size),
    )
    return MatrixProducts(
        options=options,
        n_cells=n_grid_cells,
        bev_shape=(ny, nx),
        n_cam=rig.n_cam,
        n_rows=n_rows,
        n_cols=n_cols,
        rows_pad=rows_pad,
        cols_pad=cols_pad,
        k_pad=k_pad,
        cols_per_camera=cols_per_camera,
        coo_row=coo_row,
        coo_col=coo_col,
        coo_val=coo_val,
        row_ids=row_ids,
        figures=figures,
        region_cells=None if table is None else table.cells,
        expand=None if table is None else table.expand,
        **values.fields(),
    )


@dataclass
class ValueProducts:
    """Every product that depends on the matrix VALUES, laid out on a fixed topology (the part of
    :func:`assemble_products` that ``bevcompile absorb`` re-runs on learned values).

    Convention: the arrays as in :class:`MatrixProducts`; ``product_bytes`` as in
    :class:`MatrixFigures` (``row_ids`` added by the caller); int8 errors None without int8.
    """

    ell_index: npt.NDArray[np.int32]
    ell_weight: npt.NDArray[np.float32]
    camera_mass: npt.NDArray[np.float32]
    n_tiles: int
    tile_cols: npt.NDArray[np.int32] | None
    tile_col_offsets: npt.NDArray[np.int64] | None
    tile_weight: npt.NDArray[np.float32] | None
    row_scale: npt.NDArray[np.float32] | None
    ell_weight_int8: npt.NDArray[np.int8] | None
    tile_row_scale: npt.NDArray[np.float32] | None
    tile_weight_int8: npt.NDArray[np.int8] | None
    int8_max_rel_error: float | None
    int8_max_abs_error: float | None
    product_bytes: dict[str, int]
    ell_weight_fp16: npt.NDArray[np.float16] | None = None
    tile_weight_fp16: npt.NDArray[np.float16] | None = None
    fp16_rows: npt.NDArray[np.int32] | None = None
    fp16_row_weight: npt.NDArray[np.float16] | None = None
    fp16_row_tile_weight: npt.NDArray[np.float16] | None = None
    fp16_max_rel_error: float | None = None
    fp16_max_abs_error: float | None = None

    def fields(self) -> dict[str, Any]:
        """The :class:`MatrixProducts` fields these arrays fill."""
        names = (
            "ell_index", "ell_weight", "camera_mass", "n_tiles", "tile_cols", "tile_col_offsets", "tile_weight",
            "row_scale", "ell_weight_int8", "tile_row_scale", "tile_weight_int8",
            "ell_weight_fp16", "tile_weight_fp16", "fp16_rows", "fp16_row_weight", "fp16_row_tile_weight",
        )
        return {name: getattr(self, name) for name in names}


def camera_mass_of(
    rig: RigConfig,
    mode: str,
    cells: npt.NDArray[np.integer[Any]],
    cols: npt.NDArray[np.integer[Any]],
    values: npt.NDArray[np.float32],
    expand: npt.NDArray[np.int32] | None = None,
) -> npt.NDArray[np.float32]:
    """``camera_mass[cam, iy, ix]``: the float32 values of cell ``iy * nx + ix``'s row over camera
    ``cam``'s columns, summed in float64 in entry order (``bev.region``: of the row ``expand``
    gives the cell, 0 outside the region).

    Convention: ``cells``, ``cols``, ``values`` ``(nnz,)`` (BEV cell, or with ``expand`` the
    compact row, column, float32 value of each entry, sorted by (row, col)) -> float32 ``(n_cam, ny, nx)``."""
    ny, nx = rig.bev.ny, rig.bev.nx
    n_cells = ny * nx if expand is None else int(expand.max(initial=0)) + 1
    camera = np.asarray(cols, np.int64) // (n_columns(rig, mode) // rig.n_cam)
    mass = np.bincount(
        camera * n_cells + np.asarray(cells, np.int64), weights=np.asarray(values, np.float32).astype(np.float64), minlength=rig.n_cam * n_cells
    ).reshape(rig.n_cam, n_cells)
    if expand is not None:
        mass = mass[:, expand]
    return mass.reshape(rig.n_cam, ny, nx).astype(np.float32)


def value_products(
    rig: RigConfig,
    options: MatrixOptions,
    coo_row: npt.NDArray[np.int32],
    coo_col: npt.NDArray[np.int32],
    coo_val: npt.NDArray[np.float32],
    cells: npt.NDArray[np.integer[Any]],
    n_rows: int,
    rows_pad: int,
    k_pad: int,
    *,
    expand: npt.NDArray[np.int32] | None = None,
    row_distance: npt.NDArray[np.float64] | None = None,
) -> ValueProducts:
    """ELL, tiles, int8 / fp16 / mixed and ``camera_mass`` of the COO entries ``(coo_row, coo_col,
    coo_val)`` (sorted by (row, col); ``cells`` the BEV cell of each entry) in the layouts
    ``options`` ask for. ``row_distance`` ``(n_rows,)``: each row's distance
    (:func:`~bevcompile.matrix.precision.row_distances_m`), needed by ``quantize="mixed"``."""
    n_cols = n_columns(rig, options.mode)
    align = options.align
    ell_index, ell_weight = ell_layout(coo_row, coo_col, coo_val, rows_pad, k_pad)
    tile_cols = tile_col_offsets = tile_weight = None
    n_tiles = 0
    if options.tile_rows is not None:
        tile_cols, tile_col_offsets, tile_weight = tile_layout(
            coo_row, coo_col, coo_val, n_rows, n_cols, options.tile_rows, align
        )
        n_tiles = int(tile_col_offsets.size - 1)
    row_scale = ell_int8 = tile_row_scale = tile_int8 = None
    int8_rel = int8_abs = None
    if options.quantize in INT8_PRODUCTS:
        ell_int8, row_scale = quantize_rows_int8(ell_weight)
        int8_rel, int8_abs = int8_errors(ell_weight, ell_int8, row_scale)
        if tile_weight is not None and tile_col_offsets is not None and options.tile_rows is not None:
            tile_row_scale, tile_int8 = tile_scales_and_int8(
                tile_weight, tile_col_offsets, options.tile_rows, row_scale
            )
            rel_t, abs_t = tile_int8_errors(tile_weight, tile_int8, tile_row_scale, tile_col_offsets, options.tile_rows)
            int8_rel, int8_abs = max(int8_rel, rel_t), max(int8_abs, abs_t)
    bytes_per = {
        "coo": int(coo_row.nbytes + coo_col.nbytes + coo_val.nbytes),
        "ell": int(ell_index.nbytes + ell_weight.nbytes),
    }
    if tile_weight is not None and tile_cols is not None and tile_col_offsets is not None:
        bytes_per["tiles"] = int(tile_weight.nbytes + tile_cols.nbytes + tile_col_offsets.nbytes)
    if ell_int8 is not None and row_scale is not None:
        bytes_per["ell_int8"] = int(ell_index.nbytes + ell_int8.nbytes + row_scale.nbytes)
    if tile_int8 is not None and tile_row_scale is not None and tile_cols is not None and tile_col_offsets is not None:
        bytes_per["tiles_int8"] = int(tile_int8.nbytes + tile_row_scale.nbytes + tile_cols.nbytes + tile_col_offsets.nbytes)
    laid_out = {
        "ell_index": ell_index, "ell_weight": ell_weight, "ell_weight_int8": ell_int8, "row_scale": row_scale, "tile_cols": tile_cols,
        "tile_col_offsets": tile_col_offsets, "tile_weight": tile_weight, "tile_weight_int8": tile_int8, "tile_row_scale": tile_row_scale,
    }
    fp16, fp16_bytes = reduced_precision_products(options, coo_row, n_rows, laid_out, row_distance)
    bytes_per.update(fp16_bytes)
    camera_mass = camera_mass_of(rig, options.mode, cells, coo_col, coo_val, expand)
    bytes_per["camera_mass"] = int(camera_mass.nbytes)
    return ValueProducts(
        ell_index=ell_index,
        ell_weight=ell_weight,
        camera_mass=camera_mass,
        n_tiles=n_tiles,
        tile_cols=tile_cols,
        tile_col_offsets=tile_col_offsets,
        tile_weight=tile_weight,
        row_scale=row_scale,
        ell_weight_int8=ell_int8,
        tile_row_scale=tile_row_scale,
        tile_weight_int8=tile_int8,
        int8_max_rel_error=int8_rel,
        int8_max_abs_error=int8_abs,
        product_bytes=bytes_per,
        **fp16,
    )


def reduced_precision_products(
    options: MatrixOptions,
    coo_row: npt.NDArray[np.int32],
    n_rows: int,
    laid_out: Mapping[str, Any],
    row_distance: npt.NDArray[np.float64] | None,
) -> tuple[dict[str, Any], dict[str, int]]:
    """The :class:`ValueProducts` fields of ``--quantize fp16`` / ``mixed`` (empty otherwise) and
    their ``product_bytes`` (:func:`reduced_precision_bytes`), from the products already laid out
    (``laid_out``: ``ell_index``, ``ell_weight``, ``ell_weight_int8``, ``row_scale``, ``tile_cols``,
    ``tile_col_offsets``, ``tile_weight``, ``tile_weight_int8``, ``tile_row_scale``; None when not built).

    fp16: ``ell_weight_fp16 = float16(ell_weight)`` (and ``tile_weight_fp16``). mixed: the rows
    :func:`~bevcompile.matrix.precision.select_fp16_rows` picks by the options' rule among the
    logical rows with entries (``fp16_rows``), their float16 ELL rows (``fp16_row_weight``) and
    tile rows (``fp16_row_tile_weight``). Errors: max ``|decode - w|`` relative to the row's max
    ``|w|`` and absolute, over the float16 values stored (ELL and tiles)."""
    fields = _reduced_precision_fields(options, coo_row, n_rows, laid_out, row_distance)
    return fields, reduced_precision_bytes(options, laid_out, fields)


def _reduced_precision_fields(
    options: MatrixOptions, coo_row: npt.NDArray[np.int32], n_rows: int, laid_out: Mapping[str, Any], row_distance: npt.NDArray[np.float64] | None
) -> dict[str, Any]:
    ell_weight, ell_int8, row_scale = laid_out["ell_weight"], laid_out["ell_weight_int8"], laid_out["row_scale"]
    tile_weight, tile_col_offsets = laid_out["tile_weight"], laid_out["tile_col_offsets"]
    if options.quantize == "fp16":
        ell16 = encode_fp16(ell_weight, "ELL weights")
        rel, absolute = decoded_errors(ell_weight, ell16)
        tile16 = None
        if tile_weight is not None and tile_col_offsets is not None and options.tile_rows is not None:
            tile16 = encode_fp16(tile_weight, "tile weights")
            for block, block16 in zip(tile_blocks(tile_weight, tile_col_offsets, options.tile_rows), tile_blocks(tile16, tile_col_offsets, options.tile_rows), strict=True):
                r, a = decoded_errors(block, block16)
                rel, absolute = max(rel, r), max(absolute, a)
        return {"ell_weight_fp16": ell16, "tile_weight_fp16": tile16, "fp16_max_rel_error": rel, "fp16_max_abs_error": absolute}
    rule = options.fp16_rule()
    if rule is None:
        return {}
    assert ell_int8 is not None and row_scale is not None
    if row_distance is None:
        raise ValueError("--quantize mixed needs each row's distance (value_products(row_distance=...))")
    has = np.bincount(np.asarray(coo_row, np.int64), minlength=n_rows)[:n_rows] > 0
    snr = int8_row_snr_db(ell_weight[:n_rows], ell_int8[:n_rows], row_scale[:n_rows])
    rows = select_fp16_rows(rule, snr, row_distance[:n_rows], has)
    weight16 = encode_fp16(ell_weight[rows], "ELL weights of the fp16 rows")
    rel, absolute = decoded_errors(ell_weight[rows], weight16)
    out: dict[str, Any] = {"fp16_rows": rows, "fp16_row_weight": weight16}
    if tile_weight is not None and tile_col_offsets is not None and options.tile_rows is not None:
        out["fp16_row_tile_weight"] = tile16 = fp16_row_tile_weight(tile_weight, tile_col_offsets, options.tile_rows, rows)
        offsets = fp16_row_tile_offsets(tile_col_offsets, options.tile_rows, rows)
        for i, r in enumerate(rows):  # each fp16 tile row against its float32 block row
            span = tile_row_span(tile_col_offsets, options.tile_rows, r)
            rr, a = decoded_errors(tile_weight[span][None], tile16[offsets[i] : offsets[i + 1]][None])
            rel, absolute = max(rel, rr), max(absolute, a)
    return {**out, "fp16_max_rel_error": rel, "fp16_max_abs_error": absolute}


def reduced_precision_bytes(options: MatrixOptions, laid_out: Mapping[str, Any], fp16: Mapping[str, Any]) -> dict[str, int]:
    """``product_bytes`` of the fp16 / mixed products: what a deployed graph holds.

    ``ell_fp16`` / ``tiles_fp16``: the indices (tile columns and offsets) + the float16 values.
    ``ell_mixed``: ``ell_index`` (both row groups), the int8 values and float32 scales of the
    int8 rows, the float16 values of the fp16 rows, and the int32 ``(rows_pad,)`` row-order index
    of the Gather that puts the two groups back in order; ``tiles_mixed`` likewise over the tile
    rows (``n_tiles * R``)."""
    ell_index, row_scale, tile_cols = laid_out["ell_index"], laid_out["row_scale"], laid_out["tile_cols"]
    tile_col_offsets, tile_row_scale, tile_int8 = laid_out["tile_col_offsets"], laid_out["tile_row_scale"], laid_out["tile_weight_int8"]
    out: dict[str, int] = {}
    tile_index = int(tile_cols.nbytes + tile_col_offsets.nbytes) if tile_cols is not None and tile_col_offsets is not None else 0
    if fp16.get("ell_weight_fp16") is not None:
        out["ell_fp16"] = int(ell_index.nbytes + fp16["ell_weight_fp16"].nbytes)
        if fp16.get("tile_weight_fp16") is not None:
            out["tiles_fp16"] = tile_index + int(fp16["tile_weight_fp16"].nbytes)
    rows = fp16.get("fp16_rows")
    if rows is not None and row_scale is not None:
        rows_pad, k_pad = ell_index.shape
        n16 = int(rows.size)
        out["ell_mixed"] = int(ell_index.nbytes) + (rows_pad - n16) * (k_pad + 4) + int(fp16["fp16_row_weight"].nbytes) + rows_pad * 4
        if tile_int8 is not None and tile_row_scale is not None and tile_col_offsets is not None and options.tile_rows is not None:
            r = options.tile_rows
            widths = np.repeat(np.diff(tile_col_offsets), r)  # every tile row's width
            int8_rows = np.ones(widths.size, dtype=bool)
            int8_rows[rows] = False
            out["tiles_mixed"] = (
                tile_index + int(widths[int8_rows].sum()) + 4 * int(np.count_nonzero(int8_rows))
                + int(fp16["fp16_row_tile_weight"].nbytes) + 4 * int(widths.size)
            )
    return out


# --------------------------------------------------------------------------------------
# the matrix/ group and the command behind `bevcompile matrix`
# --------------------------------------------------------------------------------------

MATRIX_COMMAND_GROUPS = ("matrix",)
"""Groups owned (rewritten) by ``bevcompile matrix``."""
VALUES_ATTR = "values"
VALUES_LEARNED = "learned"
"""``matrix/`` ``attrs["values"]`` of a store whose values were absorbed from training
(:mod:`bevcompile.matrix.learned`); absent in a geometric build."""


def is_learned(attrs: Mapping[str, Any]) -> bool:
    """Whether ``matrix/`` attributes describe absorbed (learned) values."""
    return attrs.get(VALUES_ATTR) == VALUES_LEARNED


def check_not_learned(path: Path, force: bool) -> None:
    """Refuse (:class:`StoreConflictError`, exit 2) to rebuild the ``matrix/`` of a store that
    holds learned values unless ``force``: a geometric build would discard the trained values."""
    if force or not is_store(path):
        return
    try:
        attrs = open_store(path).group_attrs("matrix")
    except StoreError:
        return
    if is_learned(attrs):
        info = attrs.get("learned")
        source = f" (absorbed from {info.get('checkpoint')})" if isinstance(info, Mapping) else ""
        raise StoreConflictError(
            f"{path}: matrix/ holds learned values{source}; `bevcompile matrix` would replace them with the geometric ones: "
            "pass --force to do so, or keep them (`bevcompile absorb STORE CHECKPOINT` absorbs newer values and changes "
            "--quantize / --tile-rows)"
        )


def column_formula(mode: str) -> str:
    if mode == "frustum":
        return "col = ((cam * D + d) * H_f + v) * W_f + u"
    return "col = (cam * H_f + v) * W_f + u"


REGION_ROW_LAYOUT = (
    "row r < n_kept is the kept (super-)cell cells[r] = (iy, ix, size) of bev.region (sorted by iy * nx + ix); "
    "row n_kept is the zero row; fine cell iy * nx + ix reads row expand[iy * nx + ix]"
)
REGION_MERGE_RULE = (
    "before Top-K, a super-cell's row is the merge of its fine cells' rows: raw weights of equal columns summed "
    "(smallest tie-break distance); normalize sum keeps that sum, normalize mean divides it by its kept raw weight sum "
    "(the mean over every point of the super-cell)"
)


def region_attributes(products: MatrixProducts) -> dict[str, Any]:
    """The ``region`` attribute of a ``matrix/`` group built with a ``bev.region`` (None without)."""
    cells, expand = products.region_cells, products.expand
    if cells is None or expand is None:
        return {}
    n_kept = int(cells.shape[0])
    sizes, counts = np.unique(cells[:, 2], return_counts=True)
    return {
        "n_kept": n_kept,
        "n_fine_kept": int(np.count_nonzero(expand < n_kept)),
        "cells_by_size": {str(int(s)): int(c) for s, c in zip(sizes, counts, strict=True)},
        "zero_row": n_kept,
        "merge_rule": REGION_MERGE_RULE,
        "cells_layout": "(n_kept, 3) int32 (iy, ix, size): first fine cell and side in fine cells",
        "expand_layout": "(ny * nx,) int32: the row of fine cell iy * nx + ix, n_kept outside the region",
    }


def matrix_attributes(products: MatrixProducts, rig: RigConfig) -> dict[str, Any]:
    """Attributes of the ``matrix/`` group (deterministic: no timings, no paths)."""
    o = products.options
    f = products.figures
    w_f, h_f = rig.feature_size
    ny, nx = products.bev_shape
    frustum = o.mode == "frustum"
    points = o.mode in DEPTH_MODES
    attrs: dict[str, Any] = {
        "build_options": o.to_dict(),
        "mode": o.mode,
        "splat": o.splat,
        "normalize": o.normalize,
        "rounding": o.rounding if points else None,
        "topk": o.topk,
        "align": o.align,
        "logical_shape": [products.n_rows, products.n_cols],
        "padded_shape": [products.rows_pad, products.cols_pad],
        "n_cells": products.n_cells,
        "bev_shape": [ny, nx],
        "cameras": list(rig.camera_names),
        "feature_size": [w_f, h_f],
        "feature_size_order": "[W_f, H_f]",
        "row_layout": (
            REGION_ROW_LAYOUT
            if products.region_cells is not None
            else "row r is BEV cell row_ids[r] = iy * nx + ix (only cells with at least one entry)"
            if o.compact_rows
            else "row = iy * nx + ix (BEV cells, row-major)"
        ),
        "column_layout": "(cam, depth_bin, v, u)" if frustum else "(cam, v, u)",
        "column_formula": column_formula(o.mode),
        "columns_per_camera": products.cols_per_camera,
        "column_input": (
            "X[col, c] = depth_probs[cam, d, v, u] * features[cam, c, v, u] (BEVDet depth x feature outer product)"
            if frustum
            else "X[col, c] = features[cam, c, v, u] (the depth prior is folded into W)"
            if o.mode == "ray"
            else "X[col, c] = features[cam, c, v, u]"
        ),
        "product": "F_bev[row, c] = sum_col W[row, col] * X[col, c]",
        "weight_rule": _weight_rule(o),
        "zero_weights": "entries of weight exactly 0 are not stored",
        "topk_rule": TOPK_RULE,
        "normalize_rule": (
            "mean: each kept row divided by its kept raw weight sum (rows sum to 1)"
            if o.normalize == "mean"
            else "sum: raw weights"
        ),
        "kept_weight_fraction": {
            "total": f.kept_weight_fraction_total,
            "worst_row": f.kept_weight_fraction_worst_row,
            "worst_row_cell": f.worst_row_cell,
            "definition": "kept raw weight / raw weight of every entry before Top-K (rows with any weight)",
        },
        "nnz": f.nnz,
        "row_nnz": {
            "min": f.row_nnz_min,
            "median": f.row_nnz_median,
            "max": f.row_nnz_max,
            "empty_rows": f.n_empty_rows,
            "over": "rows with at least one entry; empty_rows counts BEV cells without any",
        },
        "points": {
            "total": f.n_points,
            "valid": f.n_points_valid,
            "in_range": f.n_points_in_range,
            "candidates_sorted": f.n_candidates,
        },
        "coo": {
            "arrays": "coo_row int32, coo_col int32, coo_val float32",
            "order": "sorted by (row, col), no duplicates",
            "shape": [products.n_rows, products.n_cols],
        },
        "ell": {
            "arrays": "ell_index int32, ell_weight float32 (rows_pad, k_pad)",
            "shape": [products.rows_pad, products.k_pad],
            "rows_pad": products.rows_pad,
            "k_pad": products.k_pad,
            "k_pad_rule": K_PAD_RULE,
            "slot_order": "slot j of row r holds the row's j-th entry by increasing column",
            "padding": "weight 0, index = the row's first column (0 for empty rows and rows >= n_rows)",
            "formula": "F_bev[r, c] = sum_j ell_weight[r, j] * X[ell_index[r, j], c]",
        },
        "cols_pad": products.cols_pad,
        "cols_pad_note": "round_up(n_cols, align): pad X with zero columns to cols_pad if the NPU needs it; indices are < n_cols",
        "camera_mass": {
            "shape": [products.n_cam, ny, nx],
            "definition": "camera_mass[cam, iy, ix] = sum of the matrix's (float32) values in row of cell (iy, ix) over columns of camera cam",
        },
        "dense_bytes": f.dense_bytes,
        "product_bytes": dict(f.product_bytes),
    }
    if o.tile_rows is not None:
        attrs["tiles"] = {
            "arrays": "tile_cols int32 (T,), tile_col_offsets int64 (n_tiles + 1,), tile_weight float32 (R * T,)",
            "tile_rows": o.tile_rows,
            "n_tiles": products.n_tiles,
            "total_columns": int(products.tile_cols.size) if products.tile_cols is not None else 0,
            "layout": (
                "tile t covers rows [t R, t R + R); its columns are tile_cols[o[t]:o[t+1]] (sorted, padded to a multiple "
                "of align, at least align, by repeating the last column; 0 for an empty tile); its dense block is "
                "tile_weight[R o[t] : R o[t+1]].reshape(R, o[t+1] - o[t]) (row-major; rows past n_rows and padding columns are 0)"
            ),
            "formula": "F_bev[t R + i, c] = sum_j block_t[i, j] * X[tile_cols[o[t] + j], c]",
            "bytes": f.tile_bytes,
            "dense_bytes": f.dense_bytes,
            "bytes_vs_dense": (f.tile_bytes / f.dense_bytes) if f.tile_bytes is not None and f.dense_bytes else None,
        }
    if o.quantize in INT8_PRODUCTS:
        attrs["int8"] = {
            "arrays": "ell_weight_int8 int8 + row_scale float32 (rows_pad,)"
            + ("; tile_weight_int8 int8 + tile_row_scale float32 (n_tiles * R,)" if o.tile_rows is not None else ""),
            "encode": "row_scale = float32(max_j |w[r, j]| / 127); q = clip(round_half_even(w / row_scale), -127, 127) (0 where row_scale = 0)",
            "decode": "w = float32(q) * row_scale[r]",
            "symmetric": True,
            "zero_point": 0,
            "tile_scales": "tile_row_scale[t R + i] = row_scale[t R + i] (the same per-row scale; 0 past rows_pad)",
            "max_rel_error": f.int8_max_rel_error,
            "max_rel_error_definition": "max over entries of |decode - w| / max_j |w[r, j]| (ELL and tiles)",
            "max_abs_error": f.int8_max_abs_error,
        }
    attrs.update(reduced_precision_attributes(products))
    if o.compact_rows:
        attrs["row_ids"] = {"dtype": "int32", "shape": [products.n_rows], "definition": "row_ids[r] = iy * nx + ix of row r"}
    if products.region_cells is not None:
        attrs["region"] = region_attributes(products)
    if products.depth_prior is not None:
        attrs["depth_prior"] = products.depth_prior.record()
    if points:
        attrs["depth_bins"] = list(rig.depth.values())
        attrs["n_depth_bins"] = rig.depth.n_bins
        pose = (
            "p_ego = t + bins[d] * (R[:, 0] x_n + R[:, 1] y_n + R[:, 2]) with ego_from_cam = [R | t]"
            if rig.bev_frame_sensor is None
            else f"p_bev = t + bins[d] * (R[:, 0] x_n + R[:, 1] y_n + R[:, 2]) with bev_from_cam = [R | t] (the pose in the {rig.bev.frame} frame)"
        )
        attrs["point_formula"] = (
            f"{pose} and (x_n, y_n, 1) the undistorted normalised ray of the feature-pixel centre (u, v) (geometry.unproject_image_to_cam)"
        )
        attrs["range_rule"] = (
            "f = (p - min) / step per axis (x, y and the z band); in range iff "
            + ("floor(f)" if o.rounding == "floor" else "trunc(f) (BEVDet .long(); f in (-1, 0) goes to cell 0)")
            + " is in [0, n) on all three axes"
        )
    else:
        attrs["heights"] = list(rig.bev.heights)
        attrs["sampling"] = "float64 grid of bevcompile.grid.compute_sampling_grid (the grid/ geometry), valid cells only"
    return attrs


FP16_ENCODE = "h = float16(w) (IEEE binary16, round to nearest even, subnormals kept); |w| >= 65520 (inf in float16) or non-finite is refused at build"
FP16_DECODE = "w = float32(h) (exact)"
ROW_SNR_RULE = (
    "predicted int8 SNR of row r = 10 log10(S(w) / S(e)), e = float32(q) * row_scale[r] - w (float64), "
    "S(v) = ||v||^2 / 12 + (sum v)^2 / 4 (i.i.d. inputs uniform on [0, 1)); +inf when e = 0"
)


def reduced_precision_attributes(products: MatrixProducts) -> dict[str, Any]:
    """The ``fp16`` or ``mixed`` attribute of a ``--quantize fp16 | mixed`` group (empty otherwise)."""
    o, f = products.options, products.figures
    tiles = o.tile_rows is not None
    if o.quantize == "fp16":
        return {"fp16": {
            "arrays": "ell_weight_fp16 float16 (rows_pad, k_pad)" + ("; tile_weight_fp16 float16 (R * T,), the tiles' layout" if tiles else ""),
            "encode": FP16_ENCODE,
            "decode": FP16_DECODE,
            "max_rel_error": f.fp16_max_rel_error,
            "max_rel_error_definition": "max over values of |decode - w| / max_j |w[r, j]| (ELL and tiles)",
            "max_abs_error": f.fp16_max_abs_error,
        }}
    rule = o.fp16_rule()
    if rule is None:
        return {}
    n16 = int(products.fp16_rows.size) if products.fp16_rows is not None else 0
    with_entries = int(np.count_nonzero(np.bincount(products.coo_row, minlength=products.n_rows)))
    return {"mixed": {
        "rule": rule.token,
        "rule_definition": rule.describe(),
        "row_snr_definition": ROW_SNR_RULE,
        "distance_definition": "hypot(x, y) of the row's (super-)cell centre in BEV-frame metres (the origin of bev.frame)",
        "n_fp16_rows": n16,
        "n_rows_with_entries": with_entries,
        "fp16_fraction_of_rows_with_entries": (n16 / with_entries) if with_entries else 0.0,
        "arrays": (
            "the int8 product of every row (ell_weight_int8, row_scale" + (", tile_weight_int8, tile_row_scale" if tiles else "")
            + ", exactly as --quantize int8); fp16_rows int32 (n16,) strictly increasing rows with entries; "
            "fp16_row_weight float16 (n16, k_pad) = float16(ell_weight[fp16_rows])"
            + ("; fp16_row_tile_weight float16: for each fp16 row r in order, row r - t R of tile t = r // R's block "
               "(width o[t+1] - o[t]), float16, concatenated" if tiles else "")
        ),
        "encode": FP16_ENCODE + " for the fp16 rows; the int8 rule of attribute int8 for every row",
        "decode": "row r in fp16_rows: float32(h); any other row: float32(q[r, j]) * row_scale[r]",
        "deploy": (
            "two row groups: the int8 rows (Gather, Mul, ReduceSum of the int8 values, then Mul by their row_scale) and the "
            "fp16 rows (the same with Cast float16 -> float32 values, no scale), Concat, then ONE Gather of the row order "
            "(row r reads its position in the concatenation); no scatter, static shapes"
        ),
        "max_rel_error": f.fp16_max_rel_error,
        "max_abs_error": f.fp16_max_abs_error,
        "max_error_definition": "over the fp16 rows' float16 values (ELL and tiles): |decode - w| relative to max_j |w[r, j]|, and absolute",
    }}


def _weight_rule(o: MatrixOptions) -> str:
    if o.mode == "ray":
        return (
            "ray: sum over depth bins d (increasing) of p[cam, d, v, u] * the frustum weight of point (u, v, d) in the row ("
            + _weight_rule(replace(o, mode="frustum", depth_prior=UNIFORM))
            + "); p = depth prior renormalised per pixel (attrs depth_prior)"
        )
    if o.mode == "grid":
        if o.splat == "nearest":
            return "grid_sample nearest (round half to even) at every camera and height: weight 1; summed over heights"
        return (
            "grid_sample bilinear at every camera and height, zeros padding: u0 = floor(u), a = u - u0, weights "
            "(1 - a_u)(1 - a_v), a_u (1 - a_v), (1 - a_u) a_v, a_u a_v at pixels (u0 + {0,1}, v0 + {0,1}); summed over heights"
        )
    if o.splat == "nearest":
        return "nearest: weight 1 to the cell of the point (the in-range cell index)"
    return (
        "bilinear: g = f - 0.5, i0 = floor(g), a = g - i0; weights (1 - a_x)(1 - a_y), a_x (1 - a_y), (1 - a_x) a_y, "
        "a_x a_y to cells (i0_y + {0,1}, i0_x + {0,1}); cells outside the grid get nothing"
    )


def matrix_group(products: MatrixProducts, rig: RigConfig) -> GroupData:
    """The ``matrix/`` group: arrays and attributes of :func:`build_matrix`."""
    arrays = products.arrays()
    return GroupData(arrays=arrays, attrs=matrix_attributes(products, rig), dims=matrix_dims(arrays))


def matrix_dims(arrays: Mapping[str, np.ndarray], aliases: Mapping[str, str] | None = None) -> dict[str, tuple[str, ...]]:
    """Dimension names of ``matrix/`` arrays (``aliases``: an array named like another, e.g. the
    learned store's ``init_ell_weight`` -> ``ell_weight``)."""
    return {name: matrix_dimension_names(name, arr.ndim, aliases) for name, arr in arrays.items()}


def matrix_dimension_names(name: str, ndim: int, aliases: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """Dimension names of the ``matrix/`` array ``name`` of rank ``ndim`` (KeyError: no such array)."""
    base = (aliases or {}).get(name, name)
    return PRIOR_DIMS[ndim] if base == PRIOR_ARRAY else MATRIX_DIMENSION_NAMES[base]


MATRIX_DIMENSION_NAMES: dict[str, tuple[str, ...]] = {
    "coo_row": ("nnz",),
    "coo_col": ("nnz",),
    "coo_val": ("nnz",),
    "ell_index": ("row_pad", "k_pad"),
    "ell_weight": ("row_pad", "k_pad"),
    "ell_weight_int8": ("row_pad", "k_pad"),
    "row_scale": ("row_pad",),
    "camera_mass": ("camera", "y", "x"),
    "row_ids": ("row",),
    "tile_cols": ("tile_col",),
    "tile_col_offsets": ("tile_edge",),
    "tile_weight": ("tile_value",),
    "tile_weight_int8": ("tile_value",),
    "tile_row_scale": ("tile_row",),
    "cells": ("kept_cell", "cell_field"),
    "expand": ("cell",),
    "ell_weight_fp16": ("row_pad", "k_pad"),
    "tile_weight_fp16": ("tile_value",),
    "fp16_rows": ("fp16_row",),
    "fp16_row_weight": ("fp16_row", "k_pad"),
    "fp16_row_tile_weight": ("fp16_tile_value",),
}
"""``matrix/`` axes: ``row_pad`` the padded rows of ELL (and of the tiles), ``row`` the logical
(compacted) rows ``row_ids`` maps, ``tile_edge`` the ``n_tiles + 1`` offsets into ``tile_col``."""


@dataclass
class MatrixRunResult:
    """What :func:`run_matrix` built and wrote (``to_json`` for ``--json``)."""

    rig: RigConfig
    store: Path
    products: MatrixProducts
    write: WriteReport
    build_seconds: float
    peak_rss_bytes: int

    def to_json(self) -> dict[str, Any]:
        p = self.products
        f = p.figures
        return {
            "store": str(self.store),
            "name": self.rig.name,
            "config_sha256": config_sha256(self.rig),
            "build_options": p.options.to_dict(),
            "logical_shape": [p.n_rows, p.n_cols],
            "padded_shape": [p.rows_pad, p.cols_pad],
            "ell_shape": [p.rows_pad, p.k_pad],
            "k_pad": p.k_pad,
            "n_tiles": p.n_tiles,
            "nnz": f.nnz,
            "row_nnz": {"min": f.row_nnz_min, "median": f.row_nnz_median, "max": f.row_nnz_max, "empty_rows": f.n_empty_rows},
            "kept_weight_fraction": {"total": f.kept_weight_fraction_total, "worst_row": f.kept_weight_fraction_worst_row},
            "points": {"total": f.n_points, "valid": f.n_points_valid, "in_range": f.n_points_in_range, "candidates_sorted": f.n_candidates},
            "int8_max_rel_error": f.int8_max_rel_error,
            "fp16_max_rel_error": f.fp16_max_rel_error,
            "n_fp16_rows": f.n_fp16_rows,
            "tile_bytes": f.tile_bytes,
            "dense_bytes": f.dense_bytes,
            "product_bytes": dict(f.product_bytes),
            "bytes_written": self.write.bytes_per_array,
            "bytes_total": self.write.total_bytes,
            "build_seconds": round(self.build_seconds, 3),
            "phase_seconds": {k: round(v, 3) for k, v in p.extra.get("phase_seconds", {}).items()},
            "selection": dict(p.extra.get("selection", {})),
            "jobs": p.extra.get("jobs"),
            "peak_rss_bytes": self.peak_rss_bytes,
        }


def run_matrix(
    rig: RigConfig,
    out_dir: str | Path,
    options: MatrixOptions | None = None,
    *,
    force: bool = False,
    progress: ProgressFn | None = None,
    jobs: int | None = None,
    depth_prior: DepthPrior | None = None,
) -> MatrixRunResult:
    """Build the matrix of ``rig`` with ``jobs`` threads (ray mode: with ``depth_prior``) and write the ``matrix/`` group into
    ``<out_dir>/<name>.zarr`` (atomically; creates the store if needed, keeps the other groups of
    a same-config store, refuses another config's store unless ``force``)."""
    options = (options or MatrixOptions()).validate()
    jobs = resolve_jobs(jobs)
    if options.mode == "grid":
        check_grid_memory(rig, "bevcompile matrix --mode grid")
    check_frustum_memory(rig, options)
    path = store_path(out_dir, rig.name)
    attrs = root_attributes(rig)
    check_replaceable(path, attrs["config_sha256"], force=force)  # refuse before the build, not after
    check_not_learned(path, force)
    t0 = time.perf_counter()
    products = build_matrix(rig, options, progress=progress, jobs=jobs, depth_prior=depth_prior)
    seconds = time.perf_counter() - t0
    start_phase(progress, f"writing {path.name}")
    report = write_groups(
        path,
        root_attrs=attrs,
        groups={"matrix": matrix_group(products, rig)},
        force=force,
        replace_groups=MATRIX_COMMAND_GROUPS,
    )
    return MatrixRunResult(rig, path, products, report, seconds, peak_rss_bytes())
