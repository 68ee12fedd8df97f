"""PyTorch modules that run a store's tables (the ``[torch]`` extra).

Both modules register the store's arrays as ``persistent=True`` buffers (so they travel in
``state_dict`` and become initializers of an exported ONNX graph) and compute with Gather
(``index_select``), Mul, ReduceSum, MatMul and static-shape Reshape/Transpose only: no
GridSample, ScatterND/ScatterElements, OneHot, NonZero, Loop or If, and no data-dependent
shape. Shapes are fixed by the store; only the batch ``N`` and channels ``C`` come from the
input.

Both take a ``weights=`` choice: the float32 tables (default), or the store's quantised
constants kept small in the module and in an exported graph and dequantised in the graph
(``GridGather(weights="lut")``: ``gather/weight_u8`` uint8 codes + ``gather/lut``;
``MatrixLift(weights="int8")``: the ``matrix --quantize int8`` values + per-row float32 scales).

* :class:`GridGather` — ``(N, n_cam, C, H_f, W_f)`` camera features -> ``(N, C, n_heights, ny, nx)``
  BEV features, equal to ``grid_sample(bilinear, zeros, align_corners)`` on ``grid/norm``
  per camera, summed (``reduce="sum"``) or averaged (``reduce="mean"``) over the cameras that
  see the cell; cells no camera sees are 0.
* :class:`MatrixLift` — ``(N, n_cam, C, H_f, W_f)`` features (and, in frustum mode,
  ``(N, n_cam, D, H_f, W_f)`` depth probabilities) -> ``(N, C, ny, nx)`` = ``W @ (depth x feat)``
  with the ``matrix/`` group's ELL or tile form.

Quantised weights keep the graph static and within the same op set (they add Cast, and
Gather/Mul): the uint8 LUT codes are Cast to int32 because ONNX Gather takes int32/int64
indices; int8 matrix values are Cast to float32 (exact, ``|q| <= 127``).

Importing this module without PyTorch raises :class:`~bevcompile.errors.DependencyError`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from .._version import TORCH_REQUIREMENT
from ..errors import DependencyError, StoreError, UsageError
from ..grid.gather import CORNER_ORDER, LUT_CODE_ORDER, REDUCTIONS
from ..store.loader import LoadedStore, load
from ..store.plugins import level_group
from .lift import bilinear_tables_from_norm

try:
    import torch
    from torch import nn
except ImportError:  # pragma: no cover - exercised by a subprocess test without torch
    raise DependencyError(
        f"bevcompile.torch needs PyTorch: pip install 'bevcompile[torch]' ({TORCH_REQUIREMENT})"
    ) from None

StoreLike = str | Path | LoadedStore
GRID_SOURCES = ("auto", "gather", "grid")
MATRIX_FORMS = ("ell", "tiles")
MATRIX_ROWS = ("dense", "compact")
"""``MatrixLift(rows=...)`` of a ``bev.region`` store: ``dense`` ``(N, C, ny, nx)`` (one Gather of
``matrix/expand``: every fine cell reads its (super-)cell's row, the zero row outside the region),
or ``compact`` ``(N, C, n_kept)``, the kept (super-)cells in ``matrix/cells`` order."""
GRID_WEIGHTS = ("float32", "lut")
"""``GridGather(weights=...)``: the float32 ``gather/weight`` or the ``gather/weight_u8`` + ``gather/lut`` codes."""
MATRIX_WEIGHTS = ("float32", "int8", "fp16", "mixed")
"""``MatrixLift(weights=...)``: the float32 ELL/tile weights, the ``--quantize int8`` values + row
scales, the ``--quantize fp16`` float16 values, or a ``--quantize mixed`` store's two row groups."""
LUT_CORNER_U_CODE = tuple(LUT_CODE_ORDER.index(corner[2:]) for corner in CORNER_ORDER)
"""Column of ``weight_u8`` holding the u-side code of each corner in :data:`CORNER_ORDER`: ``(0, 1, 0, 1)``."""
LUT_CORNER_V_CODE = tuple(LUT_CODE_ORDER.index(corner[:2]) for corner in CORNER_ORDER)
"""Column of ``weight_u8`` holding the v-side code of each corner: ``(2, 2, 3, 3)``."""


def _feature_shape(features: torch.Tensor, n_cam: int, feature_size: tuple[int, int]) -> tuple[int, int, int, int, int]:
    """``(N, n_cam, C, H_f, W_f)`` of ``features``; a :class:`UsageError` naming the expected
    shape when it is not a 5-D tensor that fits the store."""
    w_f, h_f = feature_size
    shape = tuple(features.shape)
    if len(shape) != 5 or (shape[1], shape[3], shape[4]) != (n_cam, h_f, w_f):
        raise UsageError(f"features {shape} do not fit the store: expected (N, {n_cam}, C, {h_f}, {w_f})")
    n, cams, c, h, w = shape
    return n, cams, c, h, w


def _buffer(array: np.ndarray, dtype: Any = None) -> torch.Tensor:
    """A torch tensor that owns a writable copy of ``array`` (store arrays are read-only)."""
    return torch.from_numpy(np.array(array, dtype=dtype, copy=True, order="C"))


def sanitize(x: torch.Tensor) -> torch.Tensor:
    """The guard (``guard=True``): ``where(x - x == 0, x, 0)``. Finite values pass bit for bit,
    NaN and +-inf become 0 (``x - x`` is NaN exactly for them). Exported as Sub, Equal, Where
    (no IsNaN / IsInf: ops every NPU profile has). The numpy reference is
    :func:`bevcompile.matrix.precision.sanitize`."""
    return torch.where((x - x) == 0, x, torch.zeros((), dtype=x.dtype, device=x.device))


_WEIGHT_ARRAYS = {
    ("ell", "int8"): (("ell_weight_int8", "row_scale"), "--quantize int8"),
    ("tiles", "int8"): (("tile_weight_int8", "tile_row_scale"), "--quantize int8 --tile-rows R"),
    ("ell", "fp16"): (("ell_weight_fp16",), "--quantize fp16"),
    ("tiles", "fp16"): (("tile_weight_fp16",), "--quantize fp16 --tile-rows R"),
    ("ell", "mixed"): (("ell_weight_int8", "row_scale", "fp16_rows", "fp16_row_weight"), "--quantize mixed --fp16-rows RULE"),
    ("tiles", "mixed"): (("tile_weight_int8", "tile_row_scale", "fp16_rows", "fp16_row_tile_weight"), "--quantize mixed --fp16-rows RULE --tile-rows R"),
}


def _require_weight_arrays(path: Path, group: Any, form: str, weights: str) -> None:
    """A one-line :class:`StoreError` naming the arrays and the build command ``weights=`` needs."""
    if weights == "float32":
        return
    if weights == "int8" and ("ell_weight_int8" not in group or "row_scale" not in group):
        raise StoreError(f"{path}: weights='int8' needs matrix/ell_weight_int8 + row_scale; rebuild the matrix with `bevcompile matrix --quantize int8`")
    if form == "tiles" and "tile_weight" not in group:
        return  # the tiles check says it
    names, command = _WEIGHT_ARRAYS[(form, weights)]
    if any(name not in group for name in names):
        with_form = f" with form='{form}'" if form == "tiles" else ""
        raise StoreError(f"{path}: weights='{weights}'{with_form} needs matrix/{' + '.join(names)}; rebuild the matrix with `bevcompile matrix {command}`")


def _fp16_rows(path: Path, group: Any, n_rows: int) -> np.ndarray:
    """``matrix/fp16_rows`` as int64, checked: strictly increasing in ``[0, n_rows)``."""
    rows = np.asarray(group["fp16_rows"], dtype=np.int64)
    if rows.ndim != 1 or (rows.size and (rows.min() < 0 or rows.max() >= n_rows or np.any(np.diff(rows) <= 0))):
        raise StoreError(f"{path}: matrix/fp16_rows is not strictly increasing in [0, {n_rows})")
    return rows


def _group_order(n_rows: int, first: np.ndarray, second: np.ndarray) -> np.ndarray:
    """Row ``r``'s position in ``concat(rows first, rows second)``: int64 ``(n_rows,)``."""
    order = np.empty(n_rows, dtype=np.int64)
    order[first] = np.arange(first.size)
    order[second] = first.size + np.arange(second.size)
    return order


# --------------------------------------------------------------------------------------
# gather tables
# --------------------------------------------------------------------------------------


def _lut_tables(store: LoadedStore, table_shape: tuple[int, ...], level: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``(weight_u8, lut)`` of ``gather/``, checked against the index table's shape.

    Convention: ``weight_u8`` uint8 ``table_shape`` (last axis the codes ``(cu0, cu1, cv0, cv1)``),
    ``lut`` float32 ``(L,)`` with every code ``< L``.
    """
    group = store.level_group("gather", level)
    gname = group.name
    for name in ("weight_u8", "lut"):
        if name not in group:
            raise StoreError(f"{store.path}: {gname}/ has no {name}; rebuild it with `bevcompile grid`")
    codes = np.asarray(group["weight_u8"])
    lut = np.asarray(group["lut"])
    if codes.dtype != np.uint8 or codes.shape != table_shape:
        raise StoreError(f"{store.path}: {gname}/weight_u8 is {codes.dtype} {codes.shape}; expected uint8 {table_shape} like {gname}/index")
    if lut.ndim != 1 or lut.size == 0 or (codes.size and int(codes.max()) >= lut.size):
        raise StoreError(f"{store.path}: {gname}/lut has shape {lut.shape}; every weight_u8 code must index it")
    return codes, lut


def _gather_tables(store: LoadedStore, source: str, level: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, str, str]:
    """``(index, weight, row_of_cell, source used, layout)``.

    ``layout`` ``"bev"``: tables ``(n_cam, n_h, ny, nx, 4)``, ``row_of_cell`` None. ``"flat"`` /
    ``"flat_cache"`` / ``"flat_feature"`` (``grid --align N`` / ``--order cache|feature``): tables ``(n_cells_padded, 4)`` as
    stored, ``row_of_cell[cell]`` = the table row of flat cell ``((cam*n_h + ih)*ny + iy)*nx + ix``
    (``gather/perm_inverse``, or ``arange(n_cells)``).
    """
    n_h, ny, nx = store.level_bev_shape(level)
    gather_name, grid_name = level_group("gather", level), level_group("grid", level)
    region = grid_region_tables(store, level)
    logical = (store.rig.n_cam, n_h, ny, nx, 4) if region is None else (store.rig.n_cam, n_h, int(region[0].shape[0]), 4)
    n_cells = int(np.prod(logical[:-1]))
    if source == "gather" or (source == "auto" and store.has_group(gather_name)):
        group = store[gather_name]
        index = np.asarray(group["index"])
        weight = np.asarray(group["weight"])
        if index.shape != weight.shape:
            raise StoreError(f"{store.path}: {gather_name}/index {index.shape} and {gather_name}/weight {weight.shape} differ in shape")
        if index.shape == logical:
            return index, weight, None, "gather", "bev"
        layout = str(group.attrs.get("layout", "flat"))
        if index.ndim != 2 or index.shape[1] != 4 or index.shape[0] < n_cells:
            raise StoreError(
                f"{store.path}: {gather_name}/index has shape {index.shape}; expected {logical} or a padded ({n_cells}+, 4) layout"
            )
        if layout.startswith("flat_") or "perm_inverse" in group:
            row_of_cell = np.asarray(group["perm_inverse"], dtype=np.int64)
            if row_of_cell.shape != (n_cells,):
                raise StoreError(f"{store.path}: {gather_name}/perm_inverse has shape {row_of_cell.shape}; expected ({n_cells},)")
        else:
            row_of_cell = np.arange(n_cells, dtype=np.int64)
        return index, weight, row_of_cell, "gather", layout
    if source not in ("auto", "grid"):
        raise UsageError(f"source must be one of {', '.join(GRID_SOURCES)}, got {source!r}")
    grid = store[grid_name]
    align = bool(grid.attrs.get("align_corners", False))
    index, weight = bilinear_tables_from_norm(np.asarray(grid["norm"]), store.level_feature_size(level), align)
    return index, weight, None, "grid", "bev"


def grid_region_tables(store: LoadedStore, level: int = 0) -> tuple[np.ndarray, np.ndarray] | None:
    """``(cells, expand)`` of a ``bev.region`` store's ``grid/`` (``grid_l<l>/``), checked; None
    for a store without a region (or without ``grid/``)."""
    grid_name = level_group("grid", level)
    if store.rig.bev.region is None or not store.has_group(grid_name):
        return None
    group = store[grid_name]
    if "cells" not in group or "expand" not in group:
        raise StoreError(f"{store.path}: {grid_name}/ of a bev.region store has no cells/expand; rebuild it with `bevcompile grid`")
    cells = np.asarray(group["cells"])
    expand = np.asarray(group["expand"])
    _, ny, nx = store.bev_shape
    n_kept = int(cells.shape[0]) if cells.ndim == 2 else -1
    if n_kept < 0 or expand.shape != (ny * nx,) or (expand.size and (int(expand.min()) < 0 or int(expand.max()) > n_kept)):
        raise StoreError(f"{store.path}: {grid_name}/expand is not a ({ny * nx},) index into {grid_name}/cells rows + the zero row")
    return cells, expand


def _with_zero_cell(index: np.ndarray, weight: np.ndarray, codes: np.ndarray | None, row_of_cell: np.ndarray | None, n_cam: int, n_h: int, n_kept: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
    """The tables of a region store with one ZERO cell appended after the ``n_kept`` kept cells of
    every (camera, height): index 0 (in range), weight 0 (LUT codes 0: ``lut[0] = 0``), so the
    gathered output has ``n_kept + 1`` cells per height, the last exactly 0, and ``expand``
    (which reads ``n_kept`` outside the region) is ONE Gather of it. Bev layout: the cell axis
    grows by one; flat layouts: one zero row at the end that every zero cell's ``row_of_cell`` reads."""
    if row_of_cell is None:
        pad = [(0, 0), (0, 0), (0, 1), (0, 0)]
        return np.pad(index, pad), np.pad(weight, pad), None if codes is None else np.pad(codes, pad), None
    rows = index.shape[0]
    grown = np.pad(index, [(0, 1), (0, 0)]), np.pad(weight, [(0, 1), (0, 0)]), None if codes is None else np.pad(codes, [(0, 1), (0, 0)])
    per = np.full((n_cam * n_h, n_kept + 1), rows, dtype=np.int64)
    per[:, :n_kept] = np.asarray(row_of_cell, dtype=np.int64).reshape(n_cam * n_h, n_kept)
    return grown[0], grown[1], grown[2], per.reshape(-1)


class GridGather(nn.Module):
    """IPM grid sampling as Gather + Mul + ReduceSum with the store's static tables.

    ``forward(features)``:
        features ``(N, n_cam, C, H_f, W_f)`` float (cameras in the store's order) -- with
        ``level=l`` (``feature.levels``) the features of that level, ``(N, n_cam, C, H_l, W_l)``,
        sampled with that level's groups ``gather_l<l>/`` (or ``grid_l<l>/``): one module per
        level, as the model samples each level with its own map.
        returns ``(N, C, n_heights, ny, nx)`` (``collapse_heights=False``) or ``(N, C, ny, nx)``.

    ``out[n, c, h, iy, ix] = sum_cam sum_k weight[cam, h, iy, ix, k] * feats_flat[n, c, index[cam, h, iy, ix, k]]``
    with ``feats_flat = features.transpose(1, 2).reshape(N, C, n_cam * H_f * W_f)`` (flat index
    ``cam * H_f * W_f + v * W_f + u``): per camera this is
    ``grid_sample(features[:, cam], grid/norm[cam], bilinear, zeros, align_corners)``.

    ``reduce="sum"`` adds the cameras; ``reduce="mean"`` divides by the number of cameras
    that see the cell (``grid/valid``) at that height; with ``collapse_heights=True`` the
    heights are added too and ``mean`` divides by the number of valid (camera, height) pairs.
    Cells no camera sees are 0 either way.

    ``weights="lut"`` (needs the ``gather/`` group): instead of ``weight`` the buffers are
    ``weight_u8`` uint8 (as stored, same shape as ``index``; codes ``(cu0, cu1, cv0, cv1)``)
    and ``lut`` float32 ``(L,)``; the forward Casts the codes to int32 (ONNX Gather indices are
    int32/int64), Gathers ``lut`` once (per-side weights), Gathers those per corner with the
    constant columns :data:`LUT_CORNER_U_CODE` / :data:`LUT_CORNER_V_CODE` and multiplies:
    ``w(v_j, u_i) = lut[cv_j] * lut[cu_i]`` in corner order ``(v0,u0) (v0,u1) (v1,u0) (v1,u1)``;
    the weighted sum is then the same. Its distance to ``grid_sample`` on features in
    ``[0, 1]`` is bounded per camera by ``gather/``'s ``lut_max_sample_error_unit_features``.

    ``bev.region`` stores (``grid/cells``, ``grid/expand``): the tables hold the kept (super-)cells,
    each sampled at its centre; ``rows="dense"`` (default) computes them plus one zero cell (appended
    to the tables: index 0, weight 0) per height and applies ``grid/expand`` as ONE Gather
    (``index_select``; no scatter, no repeat; buffer ``expand`` int32 ``(n_heights * ny * nx,)``
    ``ih * (n_kept + 1) + grid/expand``, or ``grid/expand`` with ``collapse_heights``), so the output is still ``(N, C[, n_heights], ny, nx)``:
    every fine cell reads its (super-)cell, cells outside the region read 0. ``rows="compact"``
    returns the kept cells, ``(N, C, n_heights, n_kept)`` or ``(N, C, n_kept)`` (``collapse_heights``),
    in ``grid/cells`` order.

    ``guard=True``: the features are sanitised first (:func:`sanitize`: NaN and +-inf become 0;
    Sub, Equal, Where in a graph), so a non-finite value of one camera reaches no cell that camera
    does not sample (unguarded, a corner of weight 0 reading it gives ``0 * NaN = NaN``).

    Buffers (``persistent=True``): ``index`` int32 and ``weight`` float32 exactly as stored in
    ``gather/`` — ``(n_cam, n_heights, ny, nx, 4)`` (layout ``bev``) or ``(n_cells_padded, 4)``
    (layouts ``flat``/``flat_cache``/``flat_feature`` of ``grid --align N [--order cache|feature]``:
    the Gather keeps the aligned length and the permuted order, then ``row_of_cell`` int32 — ``gather/perm_inverse`` or
    ``arange(n_cells)`` — brings the rows back to cell order with one more Gather) — or derived
    from ``grid/norm`` by :func:`bilinear_tables_from_norm` when the store has no ``gather/``
    group or ``source="grid"``; and ``inv_count`` float32 (mean only): ``1 / count`` or 0.
    Peak extra memory: the gathered tensor, ``N * C * n_cam * n_heights * ny * nx * 4`` floats
    (``N * C * n_cells_padded * 4`` for the flat layouts).
    """

    index: torch.Tensor
    weight: torch.Tensor
    weight_u8: torch.Tensor
    lut: torch.Tensor
    corner_u_code: torch.Tensor
    corner_v_code: torch.Tensor
    row_of_cell: torch.Tensor
    inv_count: torch.Tensor
    expand: torch.Tensor

    def __init__(
        self,
        store: StoreLike,
        *,
        reduce: str = "sum",
        collapse_heights: bool = False,
        source: str = "auto",
        weights: str = "float32",
        level: int = 0,
        rows: str = "dense",
        guard: bool = False,
    ) -> None:
        super().__init__()
        if not isinstance(guard, bool):
            raise UsageError(f"guard must be True or False, got {guard!r}")
        self.guard = guard
        if rows not in MATRIX_ROWS:
            raise UsageError(f"rows must be one of {', '.join(MATRIX_ROWS)}, got {rows!r}")
        if reduce not in REDUCTIONS:
            raise UsageError(f"reduce must be one of {', '.join(REDUCTIONS)}, got {reduce!r}")
        if source not in GRID_SOURCES:
            raise UsageError(f"source must be one of {', '.join(GRID_SOURCES)}, got {source!r}")
        if weights not in GRID_WEIGHTS:
            raise UsageError(f"weights must be one of {', '.join(GRID_WEIGHTS)}, got {weights!r}")
        if weights == "lut" and source == "grid":
            raise UsageError("weights='lut' reads gather/weight_u8 and gather/lut; source='grid' has no LUT codes (use source='auto' or 'gather')")
        loaded = load(store)
        if isinstance(level, bool) or not isinstance(level, int) or not 0 <= level < loaded.n_levels:
            raise UsageError(f"level must be a feature level of the store, 0 to {loaded.n_levels - 1}, got {level!r}")
        gather_name = level_group("gather", level)
        if weights == "lut" and not loaded.has_group(gather_name):
            raise StoreError(
                f"{loaded.path}: weights='lut' needs the {gather_name}/ group (weight_u8 + lut) and this store has none; "
                "run `bevcompile grid` to write it"
            )
        self.weights = weights
        self.level = level
        self.n_cam = loaded.rig.n_cam
        self.feature_size = loaded.level_feature_size(level)
        self.bev_shape = loaded.level_bev_shape(level)
        self.reduce = reduce
        self.collapse_heights = collapse_heights
        index, weight, row_of_cell, used, layout = _gather_tables(loaded, source, level)
        self.source = used
        self.layout = layout
        region = grid_region_tables(loaded, level)
        if region is None and rows == "compact":
            raise UsageError(f"{loaded.path}: rows='compact' needs a store built with a bev.region (grid/cells, grid/expand); this one samples every BEV cell")
        codes = lut = None
        if weights == "lut":
            codes, lut = _lut_tables(loaded, tuple(index.shape), level)
        n_h = self.bev_shape[0]
        self.n_kept = 0 if region is None else int(region[0].shape[0])
        self.rows = "dense" if region is None else rows
        self.expands = region is not None and rows == "dense"
        self.cells_per_height = self.bev_shape[1] * self.bev_shape[2] if region is None else self.n_kept + (rows == "dense")
        if region is not None and rows == "dense":
            index, weight, codes, row_of_cell = _with_zero_cell(index, weight, codes, row_of_cell, self.n_cam, n_h, self.n_kept)
            # collapse_heights: grid/expand itself; else one index over the (height, cell) axis, so the
            # expansion is ONE Gather on the flat output and needs no extra Reshape
            per_height = np.asarray(region[1], dtype=np.int64)
            flat = per_height if collapse_heights else (np.arange(n_h, dtype=np.int64)[:, None] * (self.n_kept + 1) + per_height[None]).reshape(-1)
            self.register_buffer("expand", _buffer(flat, np.int32), persistent=True)
        self.register_buffer("index", _buffer(index, np.int32), persistent=True)
        if weights == "float32":
            self.register_buffer("weight", _buffer(weight, np.float32), persistent=True)
        else:
            assert codes is not None and lut is not None
            self.register_buffer("weight_u8", _buffer(codes, np.uint8), persistent=True)
            self.register_buffer("lut", _buffer(lut, np.float32), persistent=True)
            self.register_buffer("corner_u_code", torch.tensor(LUT_CORNER_U_CODE, dtype=torch.int32), persistent=False)
            self.register_buffer("corner_v_code", torch.tensor(LUT_CORNER_V_CODE, dtype=torch.int32), persistent=False)
        if row_of_cell is not None:
            self.register_buffer("row_of_cell", _buffer(row_of_cell, np.int32), persistent=True)
        if reduce == "mean":
            valid = np.asarray(loaded.level_group("grid", level)["valid"], dtype=bool)
            count = valid.sum(axis=(0, 1)) if collapse_heights else valid.sum(axis=0)
            if region is not None and rows == "dense":  # the zero cell: no camera sees it
                count = np.concatenate([count, np.zeros((*count.shape[:-1], 1), dtype=count.dtype)], axis=-1)
            with np.errstate(divide="ignore"):
                inv = np.where(count > 0, 1.0 / np.maximum(count, 1), 0.0)
            self.register_buffer("inv_count", _buffer(inv, np.float32), persistent=True)

    def extra_repr(self) -> str:
        n_h, ny, nx = self.bev_shape
        w_f, h_f = self.feature_size
        return (
            f"n_cam={self.n_cam}, feature={w_f}x{h_f}, bev={n_h}x{ny}x{nx}, reduce={self.reduce}, "
            f"collapse_heights={self.collapse_heights}, source={self.source}, layout={self.layout}"
            + ("" if self.weights == "float32" else f", weights={self.weights}")
            + ("" if self.level == 0 else f", level={self.level}")
            + ("" if not self.n_kept else f", region={self.n_kept} kept cells, rows={self.rows}")
            + (", guard" if self.guard else "")
        )

    def corner_weights(self) -> torch.Tensor:
        """The bilinear weights the forward uses, shaped like ``index`` (float32).

        ``weights="float32"``: the ``weight`` buffer itself. ``weights="lut"``: reconstructed
        in the graph, ``w(v_j, u_i) = lut[cv_j] * lut[cu_i]`` (Cast, Gather, Gather, Mul).
        """
        if self.weights == "float32":
            return self.weight
        codes = self.weight_u8.reshape(-1).to(torch.int32)  # Cast: ONNX Gather indices are int32/int64
        per_side = self.lut.index_select(0, codes).reshape(-1, 4)  # (rows, 4): lut[cu0], lut[cu1], lut[cv0], lut[cv1]
        weight = per_side.index_select(1, self.corner_u_code) * per_side.index_select(1, self.corner_v_code)
        return weight.reshape(self.weight_u8.shape)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        n, n_cam, c, h_f, w_f = _feature_shape(features, self.n_cam, self.feature_size)
        if self.guard:
            features = sanitize(features)
        n_h, ny, nx = self.bev_shape
        per_height = self.cells_per_height  # ny * nx; a region's n_kept (+ the zero cell for rows="dense")
        cells = n_h * per_height
        flat = features.transpose(1, 2).reshape(n, c, n_cam * h_f * w_f)
        weight = self.corner_weights()
        if self.layout == "bev":
            gathered = flat.index_select(2, self.index.reshape(-1)).reshape(n, c, n_cam, cells, 4)
            out = (gathered * weight.reshape(n_cam, cells, 4)).sum(dim=(2, 4))  # (N, C, cells)
        else:
            rows = self.index.shape[0]
            gathered = flat.index_select(2, self.index.reshape(-1)).reshape(n, c, rows, 4)
            per_row = (gathered * weight).sum(dim=3)  # (N, C, n_cells_padded), stored row order
            per_cell = per_row.index_select(2, self.row_of_cell)  # (N, C, n_cam * cells)
            out = per_cell.reshape(n, c, n_cam, cells).sum(dim=2)
        if self.collapse_heights:
            out = out.reshape(n, c, n_h, per_height).sum(dim=2)
            if self.reduce == "mean":
                out = out * self.inv_count.reshape(per_height)
            if self.rows == "compact":
                return out
            if self.expands:  # bev.region: ONE Gather to the dense map
                out = out.index_select(2, self.expand)
            return out.reshape(n, c, ny, nx)
        if self.reduce == "mean":
            out = out * self.inv_count.reshape(cells)
        if self.rows == "compact":
            return out.reshape(n, c, n_h, per_height)
        if self.expands:
            out = out.index_select(2, self.expand)  # (N, C, n_h * ny * nx)
        return out.reshape(n, c, n_h, ny, nx)


# --------------------------------------------------------------------------------------
# matrix lift
# --------------------------------------------------------------------------------------


class MatrixLift(nn.Module):
    """The lift ``F_bev = W @ X`` with the ``matrix/`` group's ELL or tile form.

    ``forward(features[, depth])``:
        features ``(N, n_cam, C, H_f, W_f)``; depth ``(N, n_cam, D, H_f, W_f)`` (frustum mode
        only: LSS depth probabilities). returns ``(N, C, ny, nx)``.

    ``X`` is, in grid and ray mode, the features with columns ``(cam*H_f + v)*W_f + u``; in frustum
    mode the outer product ``X[col, c] = depth[cam, d, v, u] * features[cam, c, v, u]`` with
    columns ``((cam*D + d)*H_f + v)*W_f + u`` (BEVDet's ``depth.unsqueeze(1) * feat.unsqueeze(2)``).
    Rows are BEV cells ``iy*nx + ix`` (``row_ids`` with ``--compact-rows``; cells without a row
    are 0). A ``bev.region`` store's rows are its kept (super-)cells then one zero row: the module
    applies ``matrix/expand`` as ONE Gather (``index_select``; no scatter, no repeat) so the
    output is still ``(N, C, ny, nx)``; ``rows="compact"`` returns ``(N, C, n_kept)`` instead.

    ``form="ell"`` (buffers ``ell_index`` int32 / ``ell_weight`` float32 ``(rows_pad, k_pad)``,
    as stored): one Gather of the K entries of every row, Mul by the weight, ReduceSum over K.
    In frustum mode the outer product is NEVER materialised: for each ELL entry the module
    gathers the feature column of its pixel (``feat_index = (col // (D*H_f*W_f))*H_f*W_f +
    col % (H_f*W_f)``, a derived int32 buffer) and the depth probability ``depth.flat[col]``,
    multiplies both by the weight and reduces over K. Peak extra memory:
    ``N * C * rows_pad * k_pad`` floats (the gathered features) instead of the
    ``N * C * n_cam * D * H_f * W_f`` of the outer product.

    ``form="tiles"`` (buffers ``tile_cols`` int32, ``tile_col_offsets`` int64, ``tile_weight``
    float32, as stored): per row tile ``t`` one Gather of the tile's columns (frustum: of the
    feature columns and depth probabilities of those columns, multiplied — the outer product
    restricted to the tile's columns), one MatMul with the dense ``(R, n_cols_t)`` block, then
    a Concat of the tiles. Peak extra memory: ``N * C * max_t n_cols_t`` floats per tile.

    ``weights="int8"`` (store built with ``bevcompile matrix --quantize int8``): the float32
    weight buffer is replaced by the int8 values as stored — ``ell_weight_int8`` int8
    ``(rows_pad, k_pad)`` + ``row_scale`` float32 ``(rows_pad,)``, or ``tile_weight_int8`` int8
    ``(R * T,)`` (persistent as its per-tile views ``tile{t}_block`` int8 ``(R, n_cols_t)``)
    + ``tile_row_scale`` float32 ``(n_tiles * R,)`` — and the graph dequantises:
    Cast int8 -> float32 of the values (exact, ``|q| <= 127``), the same Gather/Mul/ReduceSum
    (ELL) or MatMul + Concat (tiles), then ONE Mul by the row scale on the ``(N, C, rows)``
    result. This is exact, not an approximation: the stored decode is
    ``W[r, j] = float32(q[r, j]) * s[r]`` with one scale per row, so
    ``sum_j W[r, j] X[col_j] = s[r] * sum_j q[r, j] X[col_j]`` — the scale factors out of the
    K-reduction (ELL) and out of row ``r`` of the MatMul (tiles). In float32 it differs from
    per-entry dequantisation only in rounding order (one rounding of ``s * sum`` instead of one
    of ``q * s`` per entry), and it costs ``N * C * rows`` multiplies instead of
    ``N * C * rows * k_pad``.

    ``weights="fp16"`` (``--quantize fp16``): ``ell_weight_fp16`` float16 ``(rows_pad, k_pad)``, or
    the per-tile views ``tile{t}_block`` float16 of ``tile_weight_fp16`` (persistent, as for int8);
    the graph Casts them to float32 (exact) and computes as the float form.

    ``weights="mixed"`` (``--quantize mixed``): TWO row groups, no dynamic op. ELL: the int8 rows
    (``int8_index`` int32 / ``ell_weight_int8`` int8 ``(n8, k_pad)``, ``row_scale`` float32
    ``(n8,)``) and the fp16 rows of ``matrix/fp16_rows`` (``fp16_index`` int32 / ``fp16_row_weight``
    float16 ``(n16, k_pad)``), each Gather + Mul + ReduceSum (int8: then Mul by its scales), Concat;
    tiles: per tile the block of its int8 rows (``tile{t}_block`` int8) and of its fp16 rows
    (``tile{t}_block16`` float16), two MatMuls on the same gathered columns, Concat, then ONE Mul
    by ``tile_row_scale`` (the int8 rows' scales, 1 on the fp16 rows). The rows are put back in
    order by the row mapping's Gather (``row_of_cell``: the composition of the groups' order with
    the cell mapping, still one Gather). Numerically: :func:`bevcompile.matrix.precision.mixed_ell_values`
    / ``mixed_tile_values`` up to float32 rounding order.

    ``guard=True``: the inputs are sanitised first (:func:`sanitize`: NaN and +-inf become 0; Sub,
    Equal, Where in a graph), features and depth. A non-finite value of one camera then changes
    only the cells whose rows read that camera's columns with a non-zero weight; without the guard
    a NaN also reaches every row that reads it with weight 0 (``0 * NaN = NaN``): ELL padding
    slots (an empty row's padding reads column 0) and every row of a tile whose block has that
    column.
    """

    ell_index: torch.Tensor
    ell_weight: torch.Tensor
    ell_weight_int8: torch.Tensor
    row_scale: torch.Tensor
    feat_index: torch.Tensor
    tile_cols: torch.Tensor
    tile_col_offsets: torch.Tensor
    tile_weight: torch.Tensor
    tile_weight_int8: torch.Tensor
    tile_row_scale: torch.Tensor
    tile_feat_index: torch.Tensor
    row_of_cell: torch.Tensor
    cell_mask: torch.Tensor
    ell_weight_fp16: torch.Tensor
    tile_weight_fp16: torch.Tensor
    int8_index: torch.Tensor
    int8_feat_index: torch.Tensor
    fp16_index: torch.Tensor
    fp16_feat_index: torch.Tensor
    fp16_row_weight: torch.Tensor

    def __init__(self, store: StoreLike, *, form: str = "ell", weights: str = "float32", rows: str = "dense", guard: bool = False) -> None:
        super().__init__()
        from ..store.loader import matrix_layout

        if rows not in MATRIX_ROWS:
            raise UsageError(f"rows must be one of {', '.join(MATRIX_ROWS)}, got {rows!r}")

        if form not in MATRIX_FORMS:
            raise UsageError(f"form must be one of {', '.join(MATRIX_FORMS)}, got {form!r}")
        if weights not in MATRIX_WEIGHTS:
            raise UsageError(f"weights must be one of {', '.join(MATRIX_WEIGHTS)}, got {weights!r}")
        if not isinstance(guard, bool):
            raise UsageError(f"guard must be True or False, got {guard!r}")
        loaded = load(store)
        layout = matrix_layout(loaded)
        group = loaded["matrix"]
        rig = loaded.rig
        int8 = weights == "int8"
        _require_weight_arrays(loaded.path, group, form, weights)
        self.form = form
        self.weights = weights
        self.guard = guard
        self.mode = layout.mode
        self.n_cam = rig.n_cam
        self.n_depth = rig.depth.n_bins
        self.feature_size = loaded.feature_size
        _, self.ny, self.nx = loaded.bev_shape
        self.n_rows = layout.n_rows
        self.rows_pad = layout.rows_pad
        self.k_pad = layout.k_pad
        w_f, h_f = self.feature_size
        plane = h_f * w_f
        self.n_fp16_rows = 0
        order: np.ndarray | None = None  # mixed: row r of the lift is row order[r] of the concatenated groups

        def feat_of(cols: np.ndarray) -> np.ndarray:
            c = np.asarray(cols, dtype=np.int64)
            return ((c // (self.n_depth * plane)) * plane + c % plane).astype(np.int32)

        if form == "ell":
            index = np.asarray(group["ell_index"])
            if weights == "mixed":
                fp16_rows = _fp16_rows(loaded.path, group, index.shape[0])
                int8_rows = np.setdiff1d(np.arange(index.shape[0]), fp16_rows)
                values, scale = np.asarray(group["ell_weight_int8"]), np.asarray(group["row_scale"])
                weight16 = np.asarray(group["fp16_row_weight"])
                if values.shape != index.shape or scale.shape != (index.shape[0],) or weight16.shape != (fp16_rows.size, index.shape[1]) or weight16.dtype != np.float16:
                    raise StoreError(f"{loaded.path}: matrix/ell_weight_int8, row_scale and fp16_row_weight do not fit ell_index {index.shape} and fp16_rows")
                self.n_fp16_rows = int(fp16_rows.size)
                self.register_buffer("int8_index", _buffer(index[int8_rows], np.int32), persistent=True)
                self.register_buffer("ell_weight_int8", _buffer(values[int8_rows], np.int8), persistent=True)
                self.register_buffer("row_scale", _buffer(scale[int8_rows], np.float32), persistent=True)
                self.register_buffer("fp16_index", _buffer(index[fp16_rows], np.int32), persistent=True)
                self.register_buffer("fp16_row_weight", _buffer(weight16, np.float16), persistent=True)
                if self.mode == "frustum":
                    self.register_buffer("int8_feat_index", _buffer(feat_of(index[int8_rows])), persistent=True)
                    self.register_buffer("fp16_feat_index", _buffer(feat_of(index[fp16_rows])), persistent=True)
                order = _group_order(index.shape[0], int8_rows, fp16_rows)
            else:
                self.register_buffer("ell_index", _buffer(index, np.int32), persistent=True)
                if weights == "float32":
                    self.register_buffer("ell_weight", _buffer(group["ell_weight"], np.float32), persistent=True)
                elif weights == "fp16":
                    values16 = np.asarray(group["ell_weight_fp16"])
                    if values16.dtype != np.float16 or values16.shape != index.shape:
                        raise StoreError(f"{loaded.path}: matrix/ell_weight_fp16 {values16.dtype} {values16.shape} does not fit ell_index {index.shape}")
                    self.register_buffer("ell_weight_fp16", _buffer(values16, np.float16), persistent=True)
                else:
                    values, scale = np.asarray(group["ell_weight_int8"]), np.asarray(group["row_scale"])
                    if values.dtype != np.int8 or values.shape != index.shape or scale.shape != (index.shape[0],):
                        raise StoreError(
                            f"{loaded.path}: matrix/ell_weight_int8 {values.dtype} {values.shape} and row_scale {scale.shape} "
                            f"do not fit ell_index {index.shape}"
                        )
                    self.register_buffer("ell_weight_int8", _buffer(values, np.int8), persistent=True)
                    self.register_buffer("row_scale", _buffer(scale, np.float32), persistent=True)
                if self.mode == "frustum":
                    self.register_buffer("feat_index", _buffer(feat_of(index)), persistent=True)
            out_rows = self.rows_pad
            self.tiles: list[tuple[int, int]] = []
            self._tile_blocks_name: str | None = None
        else:
            if "tile_weight" not in group:
                raise StoreError(f"{loaded.path}: matrix/ has no tiles; rebuild it with `bevcompile matrix --tile-rows R`")
            if layout.tile_rows is None:
                raise StoreError(f"{loaded.path}: matrix/ build_options have no tile_rows")
            offsets = np.asarray(group["tile_col_offsets"], dtype=np.int64)
            cols = np.asarray(group["tile_cols"])
            self.tile_rows = layout.tile_rows
            r = self.tile_rows
            n_tiles = offsets.size - 1
            self.register_buffer("tile_cols", _buffer(cols, np.int32), persistent=True)
            self.register_buffer("tile_col_offsets", _buffer(offsets, np.int64), persistent=True)
            self.tiles = [(int(offsets[t]), int(offsets[t + 1])) for t in range(n_tiles)]
            if weights == "float32":
                self.register_buffer("tile_weight", _buffer(group["tile_weight"], np.float32), persistent=True)
            elif weights in ("int8", "fp16"):
                name = "tile_weight_int8" if int8 else "tile_weight_fp16"
                dtype = np.int8 if int8 else np.float16
                values = np.asarray(group[name])
                if values.dtype != dtype or values.shape != (r * int(offsets[-1]),):
                    raise StoreError(f"{loaded.path}: matrix/{name} {values.dtype} {values.shape} does not fit {n_tiles} tiles of {r} rows")
                if int8:
                    scale = np.asarray(group["tile_row_scale"])
                    if scale.shape != (n_tiles * r,):
                        raise StoreError(f"{loaded.path}: matrix/tile_row_scale {scale.shape} does not fit {n_tiles} tiles of {r} rows")
                    self.register_buffer("tile_row_scale", _buffer(scale, np.float32), persistent=True)
                # the flat array is not persistent: its per-tile views below are (no bytes twice in state_dict)
                self.register_buffer(name, _buffer(values, dtype), persistent=False)
            else:  # mixed: per tile, a block of its int8 rows and one of its fp16 rows (plain buffers, no views)
                fp16_rows = _fp16_rows(loaded.path, group, n_tiles * r)
                q, scale = np.asarray(group["tile_weight_int8"]), np.asarray(group["tile_row_scale"])
                from ..matrix.precision import fp16_row_tile_offsets

                bounds = fp16_row_tile_offsets(offsets, r, fp16_rows)
                weight16 = np.asarray(group["fp16_row_tile_weight"])
                if q.shape != (r * int(offsets[-1]),) or scale.shape != (n_tiles * r,) or weight16.shape != (int(bounds[-1]),) or weight16.dtype != np.float16:
                    raise StoreError(f"{loaded.path}: matrix/tile_weight_int8, tile_row_scale and fp16_row_tile_weight do not fit {n_tiles} tiles of {r} rows")
                self.n_fp16_rows = int(fp16_rows.size)
                is16 = np.zeros(n_tiles * r, dtype=bool)
                is16[fp16_rows] = True
                position = np.searchsorted(fp16_rows, np.arange(n_tiles * r))  # index of a fp16 row in fp16_rows
                concat_rows: list[np.ndarray] = []  # the tile rows in the order the parts are concatenated
                scales: list[np.ndarray] = []
                self.tile_parts: list[tuple[int, int, int]] = []  # (tile, int8 rows, fp16 rows)
                for t, (a, b) in enumerate(self.tiles):
                    local = np.arange(t * r, (t + 1) * r)
                    rows8, rows16 = local[~is16[local]], local[is16[local]]
                    block = q[r * a : r * b].reshape(r, b - a)
                    self.register_buffer(f"tile{t}_block", _buffer(block[rows8 - t * r], np.int8), persistent=True)
                    if rows16.size:
                        blocks16 = [weight16[bounds[i] : bounds[i + 1]] for i in position[rows16]]
                        self.register_buffer(f"tile{t}_block16", _buffer(np.stack(blocks16), np.float16), persistent=True)
                    self.tile_parts.append((t, int(rows8.size), int(rows16.size)))
                    concat_rows += [rows8, rows16]
                    scales += [scale[rows8], np.ones(rows16.size, dtype=np.float32)]
                # one Mul after the Concat: the int8 rows' scales, 1 on the fp16 rows (exact)
                self.register_buffer("tile_row_scale", _buffer(np.concatenate(scales), np.float32), persistent=True)
                order = np.argsort(np.concatenate(concat_rows), kind="stable")
            if self.mode == "frustum":
                self.register_buffer("tile_feat_index", _buffer(feat_of(cols)), persistent=True)
            # per-tile views of the stored buffers (shared memory, not in state_dict): each
            # becomes its own constant in an exported graph, so no Slice is left in it. The int8
            # (fp16) blocks are persistent instead: a non-persistent buffer is traced as a constant
            # and the exporter folds its Cast, storing float32 blocks again; a persistent one becomes
            # an int8 (float16) initializer. Mixed: the blocks are plain buffers (only cols are views).
            self._tile_blocks_name = {"float32": "tile_weight", "int8": "tile_weight_int8", "fp16": "tile_weight_fp16"}.get(weights)
            self._register_tile_views()
            out_rows = len(self.tiles) * self.tile_rows
        # rows -> BEV cells: reshape when the rows are the cells; else one Gather (+ Mul by a
        # 0/1 mask for cells that have no row)
        n_cells = self.ny * self.nx
        self.row_mapping = "identity"
        self.n_compact = 0
        row_index: np.ndarray | None = None
        if layout.expand is not None:  # bev.region: ONE Gather of the compact rows (the zero row included) to the dense map
            if layout.n_rows > out_rows:
                raise StoreError(f"{loaded.path}: {layout.n_rows} matrix rows but the {form} form holds {out_rows}")
            self.n_compact = layout.n_rows - 1
            row_index = np.asarray(layout.expand, dtype=np.int64)
            self.row_mapping = "compact" if rows == "compact" else "expand"
        elif rows == "compact":
            raise UsageError(f"{loaded.path}: rows='compact' needs a store built with a bev.region (matrix/expand); this one has BEV-cell rows")
        elif not (layout.row_cells.size == n_cells and np.array_equal(layout.row_cells, np.arange(n_cells)) and out_rows == n_cells):
            row_of_cell = np.zeros(n_cells, dtype=np.int64)
            has_row = np.zeros(n_cells, dtype=bool)
            row_of_cell[layout.row_cells] = np.arange(layout.row_cells.size)
            has_row[layout.row_cells] = True
            if layout.row_cells.size > out_rows:
                raise StoreError(f"{loaded.path}: {layout.row_cells.size} matrix rows but the {form} form holds {out_rows}")
            row_index = row_of_cell
            self.row_mapping = "gather"
            if not has_row.all():
                self.register_buffer("cell_mask", _buffer(has_row, np.float32), persistent=True)
                self.row_mapping = "gather+mask"
        if order is not None:  # mixed: the row-order Gather is composed with the row mapping (still ONE Gather)
            if self.row_mapping == "identity":
                row_index, self.row_mapping = np.arange(n_cells), "gather"
            elif self.row_mapping == "compact":
                row_index, self.row_mapping = np.arange(self.n_compact), "compact_gather"
            assert row_index is not None
            row_index = order[row_index]
        if row_index is not None:
            self.register_buffer("row_of_cell", _buffer(row_index, np.int32), persistent=True)

    def _register_tile_views(self) -> None:
        """(Re-)register the per-tile views of the flat tile buffers (shared memory)."""
        r = self.tile_rows
        name = self._tile_blocks_name
        blocks = getattr(self, name) if name is not None else None
        for t, (a, b) in enumerate(self.tiles):
            self.register_buffer(f"tile{t}_cols", self.tile_cols[a:b], persistent=False)
            if blocks is not None:
                self.register_buffer(f"tile{t}_block", blocks[r * a : r * b].view(r, b - a), persistent=name != "tile_weight")
            if self.mode == "frustum":
                self.register_buffer(f"tile{t}_feat", self.tile_feat_index[a:b], persistent=False)

    def _load_from_state_dict(self, state_dict: Any, prefix: str, *args: Any, **kwargs: Any) -> None:
        """After loading, the forward must read the loaded tables. ``load_state_dict(sd)`` copies
        into the existing tensors (the views see it), but ``assign=True`` (the usual way into a
        module built on the ``meta`` device) puts NEW tensors in place of the persistent buffers:
        the float ``tile_weight`` (its views would keep the old storage) or, for int8 / fp16, the
        persistent ``tile{t}_block`` (the flat ``tile_weight_int8`` would be stale for a later
        ``.to()``). So re-derive: int8 / fp16 rebuild the flat buffer from the loaded blocks; then
        every per-tile view is re-registered on the current flat buffers."""
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        if self.form == "tiles":
            name = self._tile_blocks_name
            if name in ("tile_weight_int8", "tile_weight_fp16"):
                blocks = [getattr(self, f"tile{t}_block").reshape(-1) for t in range(len(self.tiles))]
                if blocks:  # the loaded blocks are the truth: one new flat buffer holding them
                    setattr(self, name, torch.cat(blocks))
            self._register_tile_views()

    def _apply(self, fn: Any, recurse: bool = True) -> MatrixLift:
        """``.to()``/``.cuda()``/``.double()`` convert every buffer on its own, which would cut the
        per-tile views off the flat buffers (a later ``load_state_dict`` would then not reach
        the views the forward reads): re-register the views on the converted flat buffers."""
        super()._apply(fn, recurse)
        if self.form == "tiles":
            self._register_tile_views()
        return self

    def extra_repr(self) -> str:
        w_f, h_f = self.feature_size
        shape = f"ell={self.rows_pad}x{self.k_pad}" if self.form == "ell" else f"tiles={len(self.tiles)}x{self.tile_rows}"
        return (
            f"mode={self.mode}, form={self.form}, n_cam={self.n_cam}, feature={w_f}x{h_f}, "
            f"bev={self.ny}x{self.nx}, {shape}, rows={self.row_mapping}"
            + ("" if self.weights == "float32" else f", weights={self.weights}")
            + (f", fp16 rows={self.n_fp16_rows}" if self.weights == "mixed" else "")
            + (", guard" if self.guard else "")
        )

    def ell_values(self) -> torch.Tensor:
        """The float ELL values the forward multiplies with: the ``ell_weight`` buffer (a
        :class:`LearnableLift` returns its parameter, masked and constrained)."""
        return self.ell_weight

    def forward(self, features: torch.Tensor, depth: torch.Tensor | None = None) -> torch.Tensor:
        n, n_cam, c, h_f, w_f = _feature_shape(features, self.n_cam, self.feature_size)
        depth_flat = self._depth_flat(depth, n, n_cam, h_f, w_f)
        if self.guard:
            features = sanitize(features)
        flat = features.transpose(1, 2).reshape(n, c, n_cam * h_f * w_f)
        return self._lift(lambda index: flat.index_select(2, index), depth_flat, n, c, flat)

    def _depth_flat(self, depth: torch.Tensor | None, n: int, n_cam: int, h_f: int, w_f: int) -> torch.Tensor | None:
        """Frustum mode: ``depth`` ``(N, n_cam, D, H_f, W_f)`` flattened to ``(N, n_cam * D * H_f * W_f)``
        (sanitised with ``guard``); grid / ray mode: None (a depth is a usage error)."""
        if self.mode != "frustum":
            if depth is not None:
                raise UsageError(
                    f"this {type(self).__name__} is in {self.mode} mode (a `bevcompile matrix --mode {self.mode}` store): it lifts the inputs alone "
                    "and takes no depth; call it without depth"
                )
            return None
        if depth is None or tuple(depth.shape) != (n, n_cam, self.n_depth, h_f, w_f):
            got = None if depth is None else tuple(depth.shape)
            raise UsageError(f"frustum mode needs depth (N, {n_cam}, {self.n_depth}, {h_f}, {w_f}), got {got}")
        if self.guard:
            depth = sanitize(depth)
        return depth.reshape(n, n_cam * self.n_depth * h_f * w_f)

    def _lift(self, columns: Any, depth_flat: torch.Tensor | None, n: int, c: int, like: torch.Tensor) -> torch.Tensor:
        """``W @ X`` with ``columns(index)`` -> ``(N, C, len(index))`` the input columns of the
        pixels ``index`` (the features' ``X``; :class:`ClassLift`: class indicators), times the
        depth probability of each frustum column; then the row mapping. ``like``: dtype and device
        of an empty result."""
        if self.form == "ell":
            if self.weights == "mixed":
                groups = [(self.int8_index, self.int8_feat_index if depth_flat is not None else None, self.ell_weight_int8.to(self.row_scale.dtype))]
                if self.n_fp16_rows:
                    groups.append((self.fp16_index, self.fp16_feat_index if depth_flat is not None else None, self.fp16_row_weight.to(self.row_scale.dtype)))
                parts = [self._ell_rows(columns, depth_flat, n, c, index, feat, weight) for index, feat, weight in groups]
                parts[0] = parts[0] * self.row_scale  # the int8 rows' scale, after their K-sum
                out = torch.cat(parts, dim=2) if len(parts) > 1 else parts[0]
            else:
                int8 = self.weights == "int8"
                # int8: the integer values, exact in float32 (the module's float dtype: row_scale's); the row scale is applied after the K-sum
                # fp16: Cast float16 -> float32 (exact)
                weight = self.ell_weight_int8.to(self.row_scale.dtype) if int8 else self.ell_weight_fp16.float() if self.weights == "fp16" else self.ell_values()
                out = self._ell_rows(columns, depth_flat, n, c, self.ell_index, self.feat_index if depth_flat is not None else None, weight)
                if int8:
                    out = out * self.row_scale  # one Mul per row: s[r] * sum_j q[r, j] X[col_j]
        else:
            out = self._tile_rows(columns, depth_flat, n, c, like)
        return self._map_rows(out, n, c, like)

    def _ell_rows(
        self, columns: Any, depth_flat: torch.Tensor | None, n: int, c: int, index: torch.Tensor, feat_index: torch.Tensor | None, weight: torch.Tensor
    ) -> torch.Tensor:
        """One ELL row group: Gather of its K entries per row, Mul by the weights, ReduceSum over K
        -> ``(N, C, rows)``; frustum: the feature columns of ``feat_index`` times the depth of ``index``."""
        rows, k = index.shape
        entries = rows * k
        if depth_flat is None:
            gathered = columns(index.reshape(-1))  # (N, C, rows*K)
            coeff = weight.reshape(1, 1, entries)
        else:
            assert feat_index is not None
            gathered = columns(feat_index.reshape(-1))
            coeff = (depth_flat.index_select(1, index.reshape(-1)) * weight.reshape(1, entries)).reshape(n, 1, entries)
        return (gathered * coeff).reshape(n, c, rows, k).sum(dim=3)  # (N, C, rows)

    def _tile_rows(self, columns: Any, depth_flat: torch.Tensor | None, n: int, c: int, like: torch.Tensor) -> torch.Tensor:
        """Every tile: Gather of its columns, MatMul with its block(s), Concat -> ``(N, C, rows)``
        (mixed: the int8 and fp16 row blocks of each tile, in :attr:`tile_parts` order)."""
        parts = []
        for t, (a, b) in enumerate(self.tiles):
            cols = getattr(self, f"tile{t}_cols")
            if depth_flat is None:
                x = columns(cols)  # (N, C, n_cols_t)
            else:
                x = columns(getattr(self, f"tile{t}_feat")) * depth_flat.index_select(1, cols).reshape(n, 1, b - a)
            blocks = [getattr(self, f"tile{t}_block")]
            if self.weights == "mixed" and self.tile_parts[t][2]:
                blocks.append(getattr(self, f"tile{t}_block16"))
            for block in blocks:
                block_t = block.transpose(0, 1).to(self.tile_row_scale.dtype) if self.weights in ("int8", "mixed") else block.transpose(0, 1)
                if block_t.dtype != x.dtype:  # MatMul needs one dtype: promote as the ELL path's Mul does (float16: Cast up)
                    common = torch.promote_types(x.dtype, block_t.dtype)  # (a Python-level check: the
                    x, block_t = x.to(common), block_t.to(common)  # float32 export traces no Cast)
                parts.append(torch.matmul(x, block_t))  # (N, C, rows of the block)
        if not parts:  # an empty matrix stored with --compact-rows: no rows, no tiles
            parts.append(like.new_zeros((n, c, 0)))
        out = torch.cat(parts, dim=2) if len(parts) > 1 else parts[0]
        if self.weights in ("int8", "mixed"):
            out = out * self.tile_row_scale  # one Mul per row of every tile (mixed: 1 on the fp16 rows)
        return out

    def _map_rows(self, out: torch.Tensor, n: int, c: int, like: torch.Tensor) -> torch.Tensor:
        """Rows -> the ``(N, C, ny, nx)`` map (or a region's ``(N, C, n_kept)`` compact rows)."""
        if self.row_mapping == "identity":
            return out.reshape(n, c, self.ny, self.nx)
        if self.row_mapping == "compact":  # the kept (super-)cells, in matrix/cells order: (N, C, n_kept)
            return out[:, :, : self.n_compact]
        if self.row_mapping == "compact_gather":
            return out.index_select(2, self.row_of_cell)
        if out.shape[2] == 0:  # an empty compacted matrix: no row, every cell 0
            return like.new_zeros((n, c, self.ny, self.nx))
        out = out.index_select(2, self.row_of_cell)
        if self.row_mapping == "gather+mask":
            out = out * self.cell_mask
        return out.reshape(n, c, self.ny, self.nx)


class ClassLift(MatrixLift):
    """Per-class BEV scores from an integer class map per camera, with NO OneHot.

    ``ClassLift(store, n_classes, form="ell"|"tiles", weights=..., rows=..., guard=...)`` on a
    ``matrix/`` store of any mode; ``forward(labels[, depth])``:
        labels ``(N, n_cam, H_f, W_f)`` integer (int64 or int32: semantic classes of the feature
        pixels, map classes ...); depth ``(N, n_cam, D, H_f, W_f)`` in frustum mode only.
        returns ``(N, n_classes, ny, nx)`` (``rows="compact"``: ``(N, n_classes, n_kept)``).

    ``out[n, k, r] = sum_j W[r, col_j] * [labels[n, cam, v, u] == k] (* depth[n, col_j])``: exactly
    :class:`MatrixLift` on the features ``one_hot(labels)`` moved to the channel axis
    (``(N, n_cam, n_classes, H_f, W_f)``), the class-to-BEV mapping folded into the lift: per entry
    (ELL) or per tile column (tiles) the module gathers the LABEL of the column's pixel (Gather on
    the int64 map) and compares it with the class ids ``0 .. n_classes - 1`` (Equal, broadcast:
    ``(N, 1, n) == (1, n_classes, 1)``), Casts the indicator to float and continues as
    :class:`MatrixLift` does (Mul + ReduceSum over K, or MatMul with the tile block; the same row
    groups and row mapping for int8 / fp16 / mixed). Graph ops: Cast, Reshape, Gather, Equal, Mul,
    ReduceSum (ELL) / MatMul + Concat (tiles), Gather of the row mapping; never OneHot, ScatterND
    or GridSample. A label outside ``[0, n_classes)`` (an ignore label 255, -1) matches no class
    and contributes nothing — ``one_hot`` of it is taken as the zero vector. The float form equals
    ``MatrixLift(store)(one_hot(labels))`` bit for bit (the same products and sums: ``w * 1`` and
    ``w * 0``); peak extra memory ``N * n_classes * rows_pad * k_pad`` floats (ELL).
    """

    classes: torch.Tensor

    def __init__(
        self, store: StoreLike, n_classes: int, *, form: str = "ell", weights: str = "float32", rows: str = "dense", guard: bool = False
    ) -> None:
        if isinstance(n_classes, bool) or not isinstance(n_classes, int) or n_classes < 1:
            raise UsageError(f"n_classes must be an integer >= 1, got {n_classes!r}")
        super().__init__(store, form=form, weights=weights, rows=rows, guard=guard)
        self.n_classes = n_classes
        self.register_buffer("classes", torch.arange(n_classes, dtype=torch.int64).reshape(1, n_classes, 1), persistent=False)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, n_classes={self.n_classes}"

    def forward(self, labels: torch.Tensor, depth: torch.Tensor | None = None) -> torch.Tensor:
        w_f, h_f = self.feature_size
        shape = tuple(labels.shape)
        if len(shape) != 4 or (shape[1], shape[2], shape[3]) != (self.n_cam, h_f, w_f) or labels.dtype not in (torch.int64, torch.int32):
            raise UsageError(f"labels {labels.dtype} {shape} do not fit the store: expected integer (N, {self.n_cam}, {h_f}, {w_f})")
        n = shape[0]
        depth_flat = self._depth_flat(depth, n, self.n_cam, h_f, w_f)
        flat = labels.reshape(n, self.n_cam * h_f * w_f).long()
        dtype = self._float_dtype()

        def columns(index: torch.Tensor) -> torch.Tensor:  # (N, n_classes, len(index)) class indicators
            return (flat.index_select(1, index).unsqueeze(1) == self.classes).to(dtype)

        like = torch.zeros((), dtype=dtype, device=labels.device)
        return self._lift(columns, depth_flat, n, self.n_classes, like)

    def _float_dtype(self) -> torch.dtype:
        """The dtype the lift computes in: the float weights' (or the scales'), float32 for fp16."""
        for name in ("ell_weight", "tile_weight", "row_scale", "tile_row_scale"):
            buffer = getattr(self, name, None)
            if isinstance(buffer, torch.Tensor):
                return buffer.dtype
        return torch.float32


CONSTRAINTS = ("none", "nonnegative")
"""``LearnableLift(constraint=...)``: values of any sign, or projected onto ``w >= 0``."""


class LearnableLift(MatrixLift):
    """:class:`MatrixLift` whose ELL values are TRAINED on the store's fixed topology
    (DeployMatBEV: the sparsity pattern comes from the camera geometry, the values are learned,
    initialised from the geometric weights).

    ``LearnableLift(store, form="ell", constraint="none"|"nonnegative")`` on a ``matrix/`` store of
    any mode — grid or ray (columns ``(cam, v, u)``: ``lift(features)``) or frustum (``lift(features,
    depth)``): the forward is :class:`MatrixLift`'s, nothing here depends on the mode.

    * ``ell_weight`` is an ``nn.Parameter`` float32 ``(rows_pad, k_pad)`` initialised from the
      store's ``matrix/ell_weight`` (a store that already holds learned values starts from them).
      ``ell_index`` and the derived tables (``feat_index``, ``row_of_cell``, ``cell_mask``) stay
      buffers, and ``ell_mask`` bool ``(rows_pad, k_pad)`` (non-persistent) marks the real slots
      (``slot < nnz(row)`` of the stored COO).
    * Padding slots are exactly 0 in the forward AND get no gradient: the forward multiplies with
      ``where(ell_mask, w, 0)``, whose gradient is exactly 0 off the mask (also for a NaN upstream
      gradient), so with any optimiser (SGD, Adam, weight decay) they stay 0.
    * ``constraint="nonnegative"``: projected gradient descent onto ``w >= 0`` — the forward uses
      ``max(w, 0)`` (its gradient passes at ``w >= 0``), and a parameter an optimiser step left
      negative is clamped to 0 in place at the next forward (or :meth:`project_`), so an entry at
      0 can grow again.
    * :meth:`learned_values` returns the values the forward uses, as numpy float32 in the store's
      ELL layout, and ``state_dict()["ell_weight"]`` holds exactly them: the keys are
      :class:`MatrixLift`'s (``ell_index``, ``ell_weight``, ...), so ``bevcompile absorb STORE
      ckpt.pt`` and ``MatrixLift.load_state_dict`` take a checkpoint as it is.
    * ``form="ell"`` only: absorb re-derives the tiles (``--tile-rows``) and int8 from the values.
    * A ``bev.region`` store: the rows are its kept (super-)cells and the zero row (no real slot,
      so it stays 0); ``rows="dense"`` trains on the ``(N, C, ny, nx)`` map the head sees (the
      ``expand`` Gather passes each fine cell's gradient to its row), ``rows="compact"`` on the
      ``(N, C, n_kept)`` rows. The state dict is the same either way.
    """

    ell_mask: torch.Tensor

    def __init__(self, store: StoreLike, *, form: str = "ell", constraint: str = "none", rows: str = "dense") -> None:
        if form != "ell":
            raise UsageError(
                f"LearnableLift trains the ELL values (form='ell'), got form={form!r}; "
                "`bevcompile absorb --tile-rows R` lays the learned values out as tiles"
            )
        if constraint not in CONSTRAINTS:
            raise UsageError(f"constraint must be one of {', '.join(CONSTRAINTS)}, got {constraint!r}")
        from ..matrix.learned import real_slots

        loaded = load(store)
        super().__init__(loaded, form="ell", rows=rows)
        self.constraint = constraint
        mask = real_slots(np.asarray(loaded["matrix"]["coo_row"]), (self.rows_pad, self.k_pad))
        init = self._buffers.pop("ell_weight")
        assert init is not None
        self.ell_weight = nn.Parameter(init.clone())
        self.register_buffer("ell_mask", torch.from_numpy(mask), persistent=False)
        self.project_()

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, learnable, constraint={self.constraint}"

    @torch.no_grad()
    def project_(self) -> LearnableLift:
        """Put the parameter back on its constraints in place (padding 0; ``nonnegative``:
        ``max(w, 0)``), only where it left them (no write, so no autograd version bump, otherwise)."""
        w = self.ell_weight
        off = ~self.ell_mask & (w != 0)
        if self.constraint == "nonnegative":
            off = off | (w < 0)
        if bool(off.any()):
            w.masked_fill_(off, 0.0)
        return self

    def ell_values(self) -> torch.Tensor:
        """The values the forward uses: ``where(ell_mask, w, 0)`` (``nonnegative``: ``max(w, 0)`` first)."""
        w = self.ell_weight
        if self.constraint == "nonnegative":
            w = w.clamp(min=0.0)
        return torch.where(self.ell_mask, w, torch.zeros((), dtype=w.dtype, device=w.device))

    def forward(self, features: torch.Tensor, depth: torch.Tensor | None = None) -> torch.Tensor:
        self.project_()
        return super().forward(features, depth)

    def learned_values(self) -> np.ndarray:
        """The values the forward uses, float32 ``(rows_pad, k_pad)`` in the store's ELL layout
        (real slots as trained, padding 0): what ``bevcompile absorb`` writes into the store."""
        return np.array(self.ell_values().detach().to("cpu", torch.float32).numpy(), dtype=np.float32, copy=True)

    def _save_to_state_dict(self, destination: Any, prefix: str, keep_vars: bool) -> None:
        """``state_dict()["ell_weight"]`` holds :meth:`learned_values` (masked, constrained), so
        a checkpoint carries exactly what the forward computes with."""
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if not keep_vars:
            destination[prefix + "ell_weight"] = self.ell_values().detach()


__all__ = [
    "CONSTRAINTS",
    "GRID_SOURCES",
    "GRID_WEIGHTS",
    "MATRIX_FORMS",
    "MATRIX_WEIGHTS",
    "ClassLift",
    "GridGather",
    "LearnableLift",
    "MatrixLift",
    "bilinear_tables_from_norm",
    "sanitize",
]
