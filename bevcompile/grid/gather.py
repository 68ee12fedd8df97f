"""Static gather tables: bilinear ``grid_sample`` as one Gather and a weighted sum.

Pure numpy. Everything derives from the float64 :class:`~bevcompile.grid.SamplingGrid`.

Conventions (README "Store contract: gather/"; stored in the ``gather`` group attributes):

* CORNERS: the last axis of ``index`` / ``weight`` holds the four bilinear corners in the order
  ``(v0, u0), (v0, u1), (v1, u0), (v1, u1)`` with ``u0 = floor(u)``, ``u1 = u0 + 1``,
  ``v0 = floor(v)``, ``v1 = v0 + 1`` (``(u, v)`` feature pixels, integer = pixel centre).
* INDEX: a FLAT index into the camera-stacked feature tensor ``(n_cam * H_f * W_f)``:
  ``cam * H_f * W_f + v * W_f + u``, so one Gather on ``features.reshape(C, -1)`` serves all
  cameras. Always in range: a corner outside the map gets weight exactly 0 and its ``u``/``v``
  clamped into the map; every corner of an INVALID cell gets weight 0 and index
  ``cam * H_f * W_f`` (the camera's first pixel).
* WEIGHT: float32 bilinear weights ``(1 - a_u)(1 - a_v), a_u (1 - a_v), (1 - a_u) a_v, a_u a_v``
  with ``a_u = u - u0``, ``a_v = v - v0`` computed in float64, out-of-map corners 0. Then
  ``sum(weight * feats[:, index], -1)`` equals ``grid_sample(bilinear, zeros, align_corners)``
  on ``grid/norm`` (either align_corners: the pixel coordinates are the same).
* LUT (``weight_u8`` + ``lut``, ``F`` = ``frac_bits``, ``L = 2**F`` levels): per axis, the
  fractional offset is quantised to ``q = round_half_even(a * (L - 1))`` in ``[0, L - 1]``;
  ``weight_u8[..., :] = (cu0, cu1, cv0, cv1)`` are per-axis, per-side codes into the per-axis
  table ``lut[c] = c / (L - 1)`` (float32, ``(L,)``): ``cu1 = q_u``, ``cu0 = L - 1 - q_u``
  (same for v), and the code of an out-of-map side (and every code of an invalid cell) is 0.
  Reconstructed weights: ``w(vj, ui) = lut[cv_j] * lut[cu_i]``. Codes 0 and L - 1 give the
  exact weights 0 and 1, so pixel-centred samples and masked corners are exact.
* LAYOUT: ``"bev"`` (``--align 1``, row order): tables shaped ``(n_cam, n_h, ny, nx, 4)``.
  ``"flat"`` (``--align N > 1``): ``(n_cells_padded, 4)``, cells in row-major
  ``(cam, ih, iy, ix)`` order, ``flat = ((cam * n_h + ih) * ny + iy) * nx + ix``, padded with
  weight-0 / index-0 / code-0 rows to a multiple of N. ``"flat_cache"`` / ``"flat_feature"``
  (``--order cache`` / ``--order feature``, see :func:`order_permutation`):
  the flat rows permuted by ``perm`` (row k holds cell ``perm[k]``), padded the same way
  (``perm`` = 0 on padding rows); ``perm_inverse[cell]`` = the row of ``cell``.
  ``cell_valid[k]`` = the row holds a real cell that is valid (False on padding rows).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from ..errors import UsageError, check_int_option
from .ipm import SamplingGrid

CORNER_ORDER = ("v0u0", "v0u1", "v1u0", "v1u1")
CORNER_OFFSETS_UV = ((0, 0), (1, 0), (0, 1), (1, 1))
"""``(du, dv)`` of each corner, in :data:`CORNER_ORDER`."""
LUT_CODE_ORDER = ("u0", "u1", "v0", "v1")
DEFAULT_LUT_FRAC_BITS = 8
MAX_LUT_FRAC_BITS = 8  # codes are uint8
MIN_LUT_FRAC_BITS = 1
CACHE_ROW_GROUP = 8
"""``--order cache`` groups cells by ``floor(v) // 8`` (8 feature rows), then by ``u``."""
ORDERS = ("row", "cache", "feature")
"""Gather row orders: ``row`` (BEV row-major), ``cache`` (8-row feature bands swept column by
column), ``feature`` (ascending first-corner feature address: monotone reads)."""
REDUCTIONS = ("sum", "mean")
"""How ``GridGather`` / ``export-onnx --product gather --reduce`` combine the cameras that see a cell
(here, free of torch, so the CLI can check ``--reduce`` without importing it)."""
ORDER_KEYS = {
    "cache": "valid cells first, then cam, v0 // 8, u0, v0 (ascending in even u0 columns, descending "
    "in odd ones), flat cell (stable), with (u0, v0) = the first corner (clip(floor(u), 0, W_f - 1), "
    "clip(floor(v), 0, H_f - 1)); invalid cells last in row-major order",
    "feature": "valid cells first, then cam, v0, u0 (the first corner's feature address, ascending), "
    "flat cell (stable), with (u0, v0) = the first corner (clip(floor(u), 0, W_f - 1), "
    "clip(floor(v), 0, H_f - 1)); invalid cells last in row-major order",
}
"""The sort key of each permuted order, as stored in ``gather/`` attributes (``order_key``)."""
MAX_ALIGN = 1 << 20
GATHER_CHUNK_ELEMENTS = 1 << 22  # float64 elements gathered per step by gather_sample


@dataclass(frozen=True)
class GatherTables:
    """Gather tables in the logical BEV layout.

    Convention:
        index: ``(n_cam, n_h, ny, nx, 4)`` int32 flat indices into ``(n_cam * H_f * W_f)``.
        weight: same shape, float32 bilinear weights (corners in :data:`CORNER_ORDER`).
        weight_u8: same shape, uint8 per-axis LUT codes ``(cu0, cu1, cv0, cv1)``.
        lut: ``(2**frac_bits,)`` float32, ``lut[c] = c / (2**frac_bits - 1)``.
        valid: ``(n_cam, n_h, ny, nx)`` bool (the grid's VALID RULE).
        figures: errors MEASURED against the exact float64 weights (see :func:`build_gather_tables`).
    """

    index: npt.NDArray[np.int32]
    weight: npt.NDArray[np.float32]
    weight_u8: npt.NDArray[np.uint8]
    lut: npt.NDArray[np.float32]
    valid: npt.NDArray[np.bool_]
    feature_size: tuple[int, int]
    frac_bits: int
    figures: dict[str, float] = field(default_factory=dict)


def check_lut_frac_bits(frac_bits: int) -> int:
    """Validate ``--frac-bits`` for the uint8 weight LUT (``[1, 8]``); returns it."""
    if isinstance(frac_bits, bool) or not isinstance(frac_bits, int | np.integer):
        raise UsageError(f"--frac-bits must be an integer, got {frac_bits!r}")
    if not MIN_LUT_FRAC_BITS <= int(frac_bits) <= MAX_LUT_FRAC_BITS:
        raise UsageError(
            f"--frac-bits must be in [{MIN_LUT_FRAC_BITS}, {MAX_LUT_FRAC_BITS}] (uint8 weight LUT codes, "
            f"2**F levels per axis), got {frac_bits}"
        )
    return int(frac_bits)


def bilinear_corners(
    uv_feature_px: npt.NDArray[np.floating], valid: npt.NDArray[np.bool_], feature_size: tuple[int, int]
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float64], npt.NDArray[np.float64], npt.NDArray[np.bool_]]:
    """Per-cell bilinear corners in one camera's map.

    Convention:
        uv_feature_px: ``(..., 2)`` float ``(u, v)`` feature pixels; valid ``(...)`` bool.
        returns ``(pixel_index, weight, frac_uv, inside)``: ``pixel_index`` ``(..., 4)`` int64
        ``v * W_f + u`` within one camera (clamped into the map); ``weight`` ``(..., 4)`` float64
        (0 outside the map and on invalid cells); ``frac_uv`` ``(..., 2)`` float64
        ``(a_u, a_v)`` in ``[0, 1)`` (0 on invalid cells); ``inside`` ``(..., 4)`` bool: corner in
        the map and cell valid. Corner order :data:`CORNER_ORDER`.
    """
    w_f, h_f = feature_size
    uv = np.asarray(uv_feature_px, dtype=np.float64)
    ok = np.asarray(valid, dtype=bool) & np.isfinite(uv).all(axis=-1)
    # invalid cells: park at the origin so that nothing below overflows; masked later
    u = np.where(ok, uv[..., 0], 0.0)
    v = np.where(ok, uv[..., 1], 0.0)
    u0f = np.floor(u)
    v0f = np.floor(v)
    a_u = u - u0f
    a_v = v - v0f
    # clip before the integer cast so that huge coordinates cannot overflow int64
    u0 = np.clip(u0f, -2, w_f + 1).astype(np.int64)
    v0 = np.clip(v0f, -2, h_f + 1).astype(np.int64)
    shape = (*u.shape, 4)
    pixel_index = np.empty(shape, dtype=np.int64)
    weight = np.empty(shape, dtype=np.float64)
    inside = np.empty(shape, dtype=bool)
    for k, (du, dv) in enumerate(CORNER_OFFSETS_UV):
        cu = u0 + du
        cv = v0 + dv
        ins = ok & (cu >= 0) & (cu < w_f) & (cv >= 0) & (cv < h_f)
        wu = a_u if du else 1.0 - a_u
        wv = a_v if dv else 1.0 - a_v
        weight[..., k] = np.where(ins, wu * wv, 0.0)
        pixel_index[..., k] = np.where(ok, np.clip(cv, 0, h_f - 1) * w_f + np.clip(cu, 0, w_f - 1), 0)
        inside[..., k] = ins
    frac_uv = np.stack([np.where(ok, a_u, 0.0), np.where(ok, a_v, 0.0)], axis=-1)
    return pixel_index, weight, frac_uv, inside


def camera_base_offsets(n_cam: int, feature_size: tuple[int, int]) -> npt.NDArray[np.int64]:
    """``cam * H_f * W_f`` for every camera, ``(n_cam,)`` int64."""
    w_f, h_f = feature_size
    return np.arange(n_cam, dtype=np.int64) * (w_f * h_f)


def lut_table(frac_bits: int) -> npt.NDArray[np.float32]:
    """The per-axis weight table ``lut[c] = c / (2**F - 1)``, ``(2**F,)`` float32."""
    frac_bits = check_lut_frac_bits(frac_bits)
    levels = 1 << frac_bits
    return (np.arange(levels, dtype=np.float64) / (levels - 1)).astype(np.float32)


def quantise_lut_codes(
    frac_uv: npt.NDArray[np.floating], inside: npt.NDArray[np.bool_], frac_bits: int
) -> npt.NDArray[np.uint8]:
    """Per-axis LUT codes ``(cu0, cu1, cv0, cv1)`` from fractional offsets.

    Convention:
        frac_uv ``(..., 2)`` ``(a_u, a_v)`` in ``[0, 1)``; inside ``(..., 4)`` bool per corner
        (:data:`CORNER_ORDER`). returns ``(..., 4)`` uint8: ``cu1 = round_half_even(a_u (L-1))``,
        ``cu0 = L - 1 - cu1`` (same for v); a side whose two corners are both outside the map
        gets code 0 (so both its reconstructed weights are 0).
    """
    frac_bits = check_lut_frac_bits(frac_bits)
    top = (1 << frac_bits) - 1
    q = np.clip(np.rint(np.asarray(frac_uv, dtype=np.float64) * top), 0, top).astype(np.int64)
    # side u0 is used by corners 0 (v0u0) and 2 (v1u0); it is in the map iff either is
    side_u0 = inside[..., 0] | inside[..., 2]
    side_u1 = inside[..., 1] | inside[..., 3]
    side_v0 = inside[..., 0] | inside[..., 1]
    side_v1 = inside[..., 2] | inside[..., 3]
    codes = np.stack(
        [
            np.where(side_u0, top - q[..., 0], 0),
            np.where(side_u1, q[..., 0], 0),
            np.where(side_v0, top - q[..., 1], 0),
            np.where(side_v1, q[..., 1], 0),
        ],
        axis=-1,
    )
    return codes.astype(np.uint8)


def lut_weights(weight_u8: npt.NDArray[np.integer], lut: npt.NDArray[np.floating]) -> npt.NDArray[np.float64]:
    """Reconstruct bilinear weights from LUT codes: ``w(vj, ui) = lut[cv_j] * lut[cu_i]``.

    Convention: weight_u8 ``(..., 4)`` codes ``(cu0, cu1, cv0, cv1)``; lut ``(L,)``.
    returns ``(..., 4)`` float64 weights in :data:`CORNER_ORDER`.
    """
    table = np.asarray(lut, dtype=np.float64)
    codes = np.asarray(weight_u8).astype(np.int64)
    wu0, wu1, wv0, wv1 = (table[codes[..., k]] for k in range(4))
    return np.stack([wv0 * wu0, wv0 * wu1, wv1 * wu0, wv1 * wu1], axis=-1)


def build_gather_tables(grid: SamplingGrid, frac_bits: int = DEFAULT_LUT_FRAC_BITS) -> GatherTables:
    """Gather tables of every cell of ``grid`` in the logical ``(n_cam, n_h, ny, nx, 4)`` layout.

    Streams camera by camera (temporaries of one camera only). ``figures`` holds, measured
    against the exact float64 bilinear weights: ``weight_float32_max_error``,
    ``gather_max_sample_error_unit_features``, ``lut_max_weight_error`` and
    ``lut_max_sample_error_unit_features`` (worst cases over all features in ``[0, 1]``, see
    :func:`worst_case_sample_error`).
    """
    frac_bits = check_lut_frac_bits(frac_bits)
    coords = grid.coords_feature_px
    n_cam = coords.shape[0]
    w_f, h_f = grid.feature_size
    if n_cam * w_f * h_f > np.iinfo(np.int32).max + 1:
        raise UsageError("the stacked feature tensor has more than 2**31 elements; int32 gather indices cannot address it")
    shape = (*coords.shape[:-1], 4)
    index = np.empty(shape, dtype=np.int32)
    weight = np.empty(shape, dtype=np.float32)
    codes = np.empty(shape, dtype=np.uint8)
    lut = lut_table(frac_bits)
    figures = dict.fromkeys(
        ("weight_float32_max_error", "gather_max_sample_error_unit_features", "lut_max_weight_error", "lut_max_sample_error_unit_features"), 0.0
    )
    for cam, base in enumerate(camera_base_offsets(n_cam, grid.feature_size)):
        pixel_index, weight64, frac_uv, inside = bilinear_corners(coords[cam], grid.valid[cam], grid.feature_size)
        index[cam] = pixel_index + base
        weight[cam] = weight64
        codes[cam] = quantise_lut_codes(frac_uv, inside, frac_bits)
        w32 = weight[cam].astype(np.float64)
        recon = lut_weights(codes[cam], lut)
        if weight64.size:
            figures["weight_float32_max_error"] = max(figures["weight_float32_max_error"], float(np.abs(w32 - weight64).max()))
            figures["lut_max_weight_error"] = max(figures["lut_max_weight_error"], float(np.abs(recon - weight64).max()))
        figures["gather_max_sample_error_unit_features"] = max(figures["gather_max_sample_error_unit_features"], worst_case_sample_error(w32, weight64))
        figures["lut_max_sample_error_unit_features"] = max(figures["lut_max_sample_error_unit_features"], worst_case_sample_error(recon, weight64))
    return GatherTables(index, weight, codes, lut, grid.valid.copy(), grid.feature_size, frac_bits, figures)


def gather_sample(
    features: npt.NDArray[np.floating], index: npt.NDArray[np.integer], weight: npt.NDArray[np.floating]
) -> npt.NDArray[np.float64]:
    """``sum(weight * feats[:, index], -1)``: the Gather + weighted sum an NPU runs.

    Convention:
        features: ``(n_cam, C, H_f, W_f)``; index / weight ``(..., 4)`` (index into the
        camera-stacked ``(n_cam * H_f * W_f)`` axis). returns ``(C, ...)`` float64.
        Streams over rows so that the gathered block stays below ~32 MiB.
    """
    feats = np.asarray(features, dtype=np.float64)
    n_cam, channels, h_f, w_f = feats.shape
    stacked = feats.transpose(1, 0, 2, 3).reshape(channels, n_cam * h_f * w_f)
    index2 = np.asarray(index, dtype=np.int64).reshape(-1, 4)
    weight2 = np.asarray(weight, dtype=np.float64).reshape(-1, 4)
    out = np.empty((channels, index2.shape[0]), dtype=np.float64)
    step = max(1024, GATHER_CHUNK_ELEMENTS // max(1, 4 * channels))
    for start in range(0, index2.shape[0], step):
        stop = start + step
        gathered = stacked[:, index2[start:stop]]  # (C, rows, 4)
        out[:, start:stop] = np.einsum("crk,rk->cr", gathered, weight2[start:stop])
    return out.reshape(channels, *np.shape(index)[:-1])


def worst_case_sample_error(weight_got: npt.NDArray[np.floating], weight_ref: npt.NDArray[np.floating]) -> float:
    """Max over cells of ``max_f |sum_k (w_got - w_ref)_k f_k|`` for features ``f`` in ``[0, 1]``:
    ``max(sum of positive differences, -sum of negative differences)`` (exact worst case)."""
    diff = np.asarray(weight_got, dtype=np.float64) - np.asarray(weight_ref, dtype=np.float64)
    if diff.size == 0:
        return 0.0
    pos = np.where(diff > 0, diff, 0.0).sum(axis=-1)
    neg = -np.where(diff < 0, diff, 0.0).sum(axis=-1)
    return float(np.maximum(pos, neg).max())


# --------------------------------------------------------------------------------------
# layouts: flattening, padding, cache order
# --------------------------------------------------------------------------------------


def flat_cell_index(n_cam: int, n_h: int, ny: int, nx: int) -> npt.NDArray[np.int64]:
    """``flat = ((cam * n_h + ih) * ny + iy) * nx + ix`` as an ``(n_cam, n_h, ny, nx)`` array."""
    return np.arange(n_cam * n_h * ny * nx, dtype=np.int64).reshape(n_cam, n_h, ny, nx)


def order_permutation(
    uv_feature_px: npt.NDArray[np.floating],
    valid: npt.NDArray[np.bool_],
    feature_size: tuple[int, int],
    order: str,
) -> npt.NDArray[np.int64]:
    """The gather row order of ``--order cache|feature``: flat cells sorted so that consecutive
    gathers touch nearby feature memory.

    Convention:
        uv_feature_px ``(n_cam, n_h, ny, nx, 2)`` float feature pixels ``(u, v)``;
        valid ``(n_cam, n_h, ny, nx)`` bool; feature_size ``(W_f, H_f)``. Returns ``perm``
        ``(n_cells,)`` int64, ``perm[k]`` = flat cell at row k. Both orders sort valid cells
        first, then by camera, and end with the flat cell index (so the sort is total and
        deterministic); invalid cells keep row-major order at the end (they gather nothing).
        The keys use the first bilinear corner as stored in ``index[..., 0]``:
        ``u0 = clip(floor(u), 0, W_f - 1)``, ``v0 = clip(floor(v), 0, H_f - 1)``.

        * ``cache`` (:data:`CACHE_ROW_GROUP`-row bands): ``v0 // 8``, then ``u0``, then ``v0``
          ascending in even ``u0`` columns and descending in odd ones (a boustrophedon sweep
          of each 8-row band, column by column);
        * ``feature``: ``v0``, then ``u0`` — the first corner's flat feature address ascends,
          so the gather reads feature memory monotonically.
    """
    order = check_order(order)
    w_f, h_f = feature_size
    uv = np.asarray(uv_feature_px, dtype=np.float64).reshape(-1, 2)
    ok = np.asarray(valid, dtype=bool).reshape(-1)
    n_cam = valid.shape[0]
    cam = np.repeat(np.arange(n_cam, dtype=np.int64), ok.size // max(n_cam, 1))
    u0 = np.clip(np.floor(np.where(ok, uv[:, 0], 0.0)), 0, w_f - 1).astype(np.int64)
    v0 = np.clip(np.floor(np.where(ok, uv[:, 1], 0.0)), 0, h_f - 1).astype(np.int64)
    flat = np.arange(ok.size, dtype=np.int64)
    # np.lexsort: the LAST key is the primary one
    if order == "cache":
        band = v0 // CACHE_ROW_GROUP
        sweep = np.where(u0 % 2 == 0, v0, -v0)
        rows = np.lexsort((flat, sweep, u0, band, cam, ~ok))
    elif order == "feature":
        rows = np.lexsort((flat, u0, v0, cam, ~ok))
    else:
        rows = flat
    return rows.astype(np.int64)


def layout_name(align: int, order: str) -> str:
    """Stored layout of ``gather/`` for ``--align`` / ``--order``: ``bev`` (align 1, row order),
    ``flat`` (padded, row order) or ``flat_<order>`` (padded and permuted; writes ``perm``)."""
    if order == "row":
        return "bev" if align == 1 else "flat"
    return f"flat_{order}"



def mean_index_jump(index_rows: npt.NDArray[np.integer], valid_rows: npt.NDArray[np.bool_]) -> float:
    """Mean ``|index[k+1, 0] - index[k, 0]|`` between consecutive VALID rows in gather order
    (corner ``(v0, u0)``); 0 when fewer than two rows are valid.

    Convention: index_rows ``(n_rows, 4)``; valid_rows ``(n_rows,)``.
    """
    first = np.asarray(index_rows)[np.asarray(valid_rows, dtype=bool), 0].astype(np.int64)
    if first.size < 2:
        return 0.0
    return float(np.abs(np.diff(first)).mean())


def band_switches(
    index_rows: npt.NDArray[np.integer], valid_rows: npt.NDArray[np.bool_], feature_size: tuple[int, int]
) -> int:
    """How often consecutive VALID rows in gather order change their 8-row feature band
    ``(cam, floor(v0) // 8)`` (corner ``(v0, u0)``, clamped): what ``--order cache`` and
    ``--order feature`` minimise (the minimum is the number of bands touched minus one).

    Convention: index_rows ``(n_rows, 4)``; valid_rows ``(n_rows,)``; feature_size ``(W_f, H_f)``.
    """
    w_f, h_f = feature_size
    first = np.asarray(index_rows)[np.asarray(valid_rows, dtype=bool), 0].astype(np.int64)
    if first.size < 2:
        return 0
    cam, within = np.divmod(first, w_f * h_f)
    band = cam * (h_f // CACHE_ROW_GROUP + 1) + (within // w_f) // CACHE_ROW_GROUP
    return int(np.count_nonzero(np.diff(band)))


@dataclass(frozen=True)
class GatherLayout:
    """The tables as written to ``gather/`` (see the module docstring, LAYOUT)."""

    layout: str  # layout_name(align, order): "bev" | "flat" | "flat_cache" | "flat_feature"
    index: npt.NDArray[np.int32]
    weight: npt.NDArray[np.float32]
    weight_u8: npt.NDArray[np.uint8]
    cell_valid: npt.NDArray[np.bool_] | None
    perm: npt.NDArray[np.int32] | None
    perm_inverse: npt.NDArray[np.int32] | None
    n_cells: int
    n_cells_padded: int
    align: int
    order: str
    jump_row_order: float
    jump_gather_order: float
    band_switches_row_order: int
    band_switches_gather_order: int


def check_align(align: int) -> int:
    return check_int_option("align", align, 1, MAX_ALIGN)


def check_order(order: str) -> str:
    if order not in ORDERS:
        raise UsageError(f"--order must be one of {', '.join(ORDERS)}, got {order!r}")
    return order


def layout_tables(
    tables: GatherTables, uv_feature_px: npt.NDArray[np.floating], *, align: int = 1, order: str = "row"
) -> GatherLayout:
    """Arrange logical tables into the stored layout (``--align``, ``--order``).

    ``uv_feature_px`` ``(n_cam, n_h, ny, nx, 2)`` float64 is only used by the permuted orders.
    """
    align = check_align(align)
    order = check_order(order)
    index4 = tables.index.reshape(-1, 4)
    valid = tables.valid.reshape(-1)
    n_cells = int(valid.size)
    jump_row = mean_index_jump(index4, valid)
    bands_row = band_switches(index4, valid, tables.feature_size)
    if align == 1 and order == "row":
        return GatherLayout(
            "bev", tables.index, tables.weight, tables.weight_u8, None, None, None,
            n_cells, n_cells, align, order, jump_row, jump_row, bands_row, bands_row,
        )
    n_pad = -(-n_cells // align) * align if n_cells else 0
    if n_pad > np.iinfo(np.int32).max:
        raise UsageError(f"{n_pad} gather rows do not fit int32 row indices")
    rows = order_permutation(uv_feature_px, tables.valid, tables.feature_size, order)

    def pad(values: np.ndarray, dtype: npt.DTypeLike) -> np.ndarray:
        out = np.zeros((n_pad, *values.shape[1:]), dtype=dtype)
        out[:n_cells] = values[rows]
        return out

    index = pad(index4, np.int32)
    cell_valid = pad(valid, np.bool_)
    perm = perm_inverse = None
    if order != "row":
        perm = np.zeros(n_pad, dtype=np.int32)
        perm[:n_cells] = rows
        inverse = np.empty(n_cells, dtype=np.int64)
        inverse[rows] = np.arange(n_cells, dtype=np.int64)
        perm_inverse = inverse.astype(np.int32)
    return GatherLayout(
        layout_name(align, order),
        index,
        pad(tables.weight.reshape(-1, 4), np.float32),
        pad(tables.weight_u8.reshape(-1, 4), np.uint8),
        cell_valid,
        perm,
        perm_inverse,
        n_cells,
        n_pad,
        align,
        order,
        jump_row,
        mean_index_jump(index, cell_valid),
        bands_row,
        band_switches(index, cell_valid, tables.feature_size),
    )
