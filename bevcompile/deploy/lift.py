"""Every deployable product of a store as ONE sparse description: :class:`LiftMatrix` (numpy only).

The graph builder (:mod:`bevcompile.deploy.graph`) never reads the store: it reads a
:class:`LiftMatrix`, whatever product it came from —

* ``gather`` (``gather/`` tables, or the bilinear tables of ``grid/norm``): one row per output
  cell ``(height, iy, ix)`` (a ``bev.region`` store: per kept cell), the four bilinear corners of
  every camera as entries, ``reduce="mean"`` folded into the values (``1 / count``);
* ``ell`` (``matrix/ell_index`` + ``ell_weight``, or ``ell_weight_int8`` + ``row_scale``);
* ``tiles`` (``matrix/tile_cols`` + the dense ``tile_weight`` blocks, or their int8 values).

Entries whose value is exactly 0 (ELL padding, corners outside the map, zeros of a tile block)
are dropped: they add nothing to any output. The description is exact: the graph computes
``sum_j value[j] * X[col[j]]`` for each row, and ``F_out[pos] = row[row_of_out[pos]]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import StoreError, UsageError
from ..grid.gather import bilinear_corners, lut_weights
from ..grid.ipm import norm_to_feature_px
from ..matrix.layout import tile_blocks, tile_entries
from ..store.loader import LoadedStore, MatrixLayout, matrix_layout

PRECISIONS = ("float32", "float16", "int8", "mixed")
"""Values of a :class:`LiftMatrix`: the stored float32 values, the same rounded to float16, or the
store's int8 values (``matrix --quantize int8``) with their per-row float32 scales."""


@dataclass(frozen=True)
class LiftMatrix:
    """A product of a store as sparse entries (see the module docstring).

    Convention:
        ``kind`` ``"gather"``, ``"ell"`` or ``"tiles"``; ``mode`` ``"grid"``, ``"ray"`` or
        ``"frustum"`` (``gather`` is ``"grid"``: features alone).
        ``row`` int64 ``(nnz,)`` compute row of each entry, sorted, in ``[0, n_rows)``.
        ``pixel`` int64 ``(nnz,)`` feature pixel ``cam * H_f * W_f + v * W_f + u`` of the entry.
        ``depth`` int64 ``(nnz,)`` frustum mode only: the depth-probability index
        ``((cam * D + d) * H_f + v) * W_f + u`` whose value multiplies the feature (else None).
        ``value`` float32 ``(nnz,)``: what the product computes with (``float16``: the float16
        values; ``int8``: ``float32(q) * row_scale[row]``).
        ``q`` int8 ``(nnz,)`` and ``row_scale`` float32 ``(n_rows,)``: ``int8`` only.
        ``out_shape`` the spatial output of the graph: ``(n_heights, ny, nx)`` for ``gather``,
        ``(ny, nx)`` for the matrix, ``(n_heights, n_kept)`` / ``(n_kept,)`` for ``rows="compact"``.
        ``row_of_out`` int64 ``(prod(out_shape),)``: the row each output position reads, ``-1``
        for a position no row feeds (0); ``None`` when output position == row (``n_rows`` equal).
    """

    kind: str
    mode: str
    n_cam: int
    feature_size: tuple[int, int]
    n_depth: int
    row: np.ndarray
    pixel: np.ndarray
    depth: np.ndarray | None
    value: np.ndarray
    n_rows: int
    out_shape: tuple[int, ...]
    row_of_out: np.ndarray | None
    precision: str = "float32"
    q: np.ndarray | None = None
    row_scale: np.ndarray | None = None
    row_fp16: np.ndarray | None = None
    """``mixed`` only: bool ``(n_rows,)``, the rows kept in float16 (``matrix/fp16_rows``); the
    other rows are int8 (``q`` * ``row_scale``)."""

    @property
    def nnz(self) -> int:
        return int(self.row.size)

    @property
    def n_pixels(self) -> int:
        w_f, h_f = self.feature_size
        return self.n_cam * h_f * w_f

    @property
    def n_out(self) -> int:
        return int(np.prod(self.out_shape))

    @property
    def frustum(self) -> bool:
        return self.depth is not None

    def row_counts(self) -> np.ndarray:
        """int64 ``(n_rows,)``: entries per row."""
        return np.bincount(self.row, minlength=self.n_rows).astype(np.int64)

    def out_rows(self) -> np.ndarray:
        """int64 ``(n_out,)`` the row of every output position (``-1``: none)."""
        if self.row_of_out is None:
            return np.arange(self.n_out, dtype=np.int64)
        return self.row_of_out

    def by_output(self) -> LiftMatrix:
        """The same lift with one row per OUTPUT position (a row read by several positions, as
        a ``bev.region`` super-cell, is copied to each): ``row_of_out`` None. The forms that
        assemble the output from BEV patches (``windows``) read this."""
        if self.row_of_out is None:
            return self
        out_rows = self.row_of_out
        starts = np.searchsorted(self.row, np.arange(self.n_rows + 1))
        counts = np.diff(starts)
        feeds = out_rows >= 0
        positions = np.flatnonzero(feeds)
        per = counts[out_rows[positions]]
        take = np.repeat(starts[out_rows[positions]], per) + _ranks(per)
        new_row = np.repeat(positions, per)
        scale = fp16 = None
        if self.row_scale is not None:
            scale = np.zeros(self.n_out, np.float32)
            scale[positions] = self.row_scale[out_rows[positions]]
        if self.row_fp16 is not None:
            fp16 = np.zeros(self.n_out, bool)
            fp16[positions] = self.row_fp16[out_rows[positions]]
        return LiftMatrix(
            kind=self.kind, mode=self.mode, n_cam=self.n_cam, feature_size=self.feature_size, n_depth=self.n_depth,
            row=new_row, pixel=self.pixel[take], depth=None if self.depth is None else self.depth[take],
            value=self.value[take], n_rows=self.n_out, out_shape=self.out_shape, row_of_out=None,
            precision=self.precision, q=None if self.q is None else self.q[take], row_scale=scale, row_fp16=fp16,
        )

    def dense_product(self, x: np.ndarray, depth: np.ndarray | None = None) -> np.ndarray:
        """float64 ``(N, C, *out_shape)`` = this description applied to ``x`` (``(N, n_cam, C, H_f,
        W_f)``) and, in frustum mode, ``depth`` (``(N, n_cam, D, H_f, W_f)``): what every graph form
        must compute. Used by the tests and the cost figures, not as the export's reference (that is
        the store's own COO / grid_sample, independent of this module)."""
        n, _, c = x.shape[:3]
        feats = np.moveaxis(np.asarray(x, np.float64), 2, -1).reshape(n, -1, c)  # (N, P, C)
        coeff = np.broadcast_to(self.value.astype(np.float64), (n, self.nnz))
        if self.depth is not None:
            assert depth is not None
            coeff = coeff * np.asarray(depth, np.float64).reshape(n, -1)[:, self.depth]
        rows = np.zeros((n, self.n_rows + 1, c))
        for b in range(n):
            np.add.at(rows[b], self.row, feats[b, self.pixel] * coeff[b, :, None])
        out = rows[:, self.out_rows()]  # -1 reads the zero row appended at the end
        return np.moveaxis(out, 1, -1).reshape(n, c, *self.out_shape)


def _ranks(counts: np.ndarray) -> np.ndarray:
    """``[0..counts[0]), [0..counts[1]), ...`` concatenated (int64)."""
    total = int(counts.sum())
    if total == 0:
        return np.zeros(0, np.int64)
    starts = np.repeat(np.cumsum(counts) - counts, counts)
    return np.arange(total, dtype=np.int64) - starts


def bilinear_tables_from_norm(norm: np.ndarray, feature_size: tuple[int, int], align_corners: bool) -> tuple[np.ndarray, np.ndarray]:
    """Bilinear gather tables from a ``grid_sample`` grid (used when a store has no ``gather/``).

    Convention:
        norm: ``(n_cam, n_heights, ny, nx, 2)`` normalised ``(x, y)`` per camera.
        returns ``index`` int32 and ``weight`` float32 ``(n_cam, n_heights, ny, nx, 4)``: corners
        ``(v0,u0) (v0,u1) (v1,u0) (v1,u1)`` as flat indices ``cam*H_f*W_f + v*W_f + u`` into the
        camera-stacked features; corners outside the map have weight 0 and an in-range index
        (the clamped pixel), exactly as ``grid_sample(padding_mode="zeros")`` reads 0 there.
    """
    w_f, h_f = feature_size
    uv_feature_px = norm_to_feature_px(np.asarray(norm, dtype=np.float64), feature_size, align_corners)
    pixel_index, weight, _frac, _inside = bilinear_corners(uv_feature_px, np.ones(uv_feature_px.shape[:-1], dtype=bool), feature_size)
    n_cam = norm.shape[0]
    cam_base = (np.arange(n_cam, dtype=np.int64) * (h_f * w_f)).reshape((n_cam,) + (1,) * (norm.ndim - 1))
    return (cam_base + pixel_index).astype(np.int32), weight.astype(np.float32)


def _finish(
    kind: str, mode: str, store: LoadedStore, row: np.ndarray, col: np.ndarray, value: np.ndarray, n_rows: int,
    out_shape: tuple[int, ...], row_of_out: np.ndarray | None, precision: str, q: np.ndarray | None = None,
    row_scale: np.ndarray | None = None, row_fp16: np.ndarray | None = None,
) -> LiftMatrix:
    """Drop zero entries, sort by (row, column), split frustum columns into pixel + depth index."""
    w_f, h_f = store.feature_size
    n_depth = store.rig.depth.n_bins if mode == "frustum" else 0
    keep = value != 0
    row, col, value = row[keep].astype(np.int64), col[keep].astype(np.int64), value[keep]
    q = None if q is None else q[keep]
    order = np.lexsort((col, row))
    row, col, value = row[order], col[order], value[order]
    q = None if q is None else q[order]
    depth = None
    pixel = col
    if mode == "frustum":
        depth = col
        pixels = h_f * w_f
        pixel = (col // (n_depth * pixels)) * pixels + col % pixels
    if precision == "float16":
        value = value.astype(np.float16).astype(np.float32)
    return LiftMatrix(
        kind=kind, mode=mode, n_cam=store.rig.n_cam, feature_size=(w_f, h_f), n_depth=n_depth, row=row, pixel=pixel,
        depth=depth, value=value.astype(np.float32), n_rows=n_rows, out_shape=out_shape, row_of_out=row_of_out,
        precision=precision, q=q, row_scale=row_scale, row_fp16=row_fp16,
    )


def gather_lift(store: LoadedStore, reduce: str = "sum", rows: str = "dense", precision: str = "float32", lut: bool = False) -> LiftMatrix:
    """The ``gather`` product (bilinear IPM, summed or averaged over the cameras that see a cell).

    Rows: ``(ih, iy, ix)`` cells (a ``bev.region`` store: ``(ih, kept cell)``); output
    ``(n_heights, ny, nx)`` (region, dense: through ``grid/expand``; ``rows="compact"``:
    ``(n_heights, n_kept)``). ``lut=True``: the weights decoded from ``gather/weight_u8`` + ``lut``.
    """
    if precision == "int8":
        raise UsageError("--product gather has no int8 tables (its quantised form is --weights lut)")
    n_cam = store.rig.n_cam
    n_h, ny, nx = store.bev_shape
    grid = store["grid"]
    region = "expand" in grid
    n_kept = int(np.asarray(grid["cells"]).shape[0]) if region else 0
    cells = n_kept if region else ny * nx
    if store.has_group("gather"):
        group = store["gather"]
        index = np.asarray(group["index"]).reshape(-1, 4)
        weight = lut_weights(np.asarray(group["weight_u8"]), np.asarray(group["lut"])).reshape(-1, 4) if lut else np.asarray(group["weight"]).reshape(-1, 4)
        if "perm_inverse" in group:
            table_row = np.asarray(group["perm_inverse"], dtype=np.int64)
        else:
            table_row = np.arange(n_cam * n_h * cells, dtype=np.int64)
        if table_row.size != n_cam * n_h * cells:
            raise StoreError(f"{store.path}: gather/ tables do not hold {n_cam} x {n_h} x {cells} cells")
        index, weight = index[table_row], weight[table_row]
    else:
        if lut:
            raise StoreError(f"{store.path}: --weights lut reads gather/weight_u8 and gather/lut; this store has no gather/ group (run `bevcompile grid`)")
        index, weight = bilinear_tables_from_norm(np.asarray(grid["norm"]), store.feature_size, bool(grid.attrs.get("align_corners", False)))
        index, weight = index.reshape(-1, 4), weight.reshape(-1, 4)
    # flat cell (cam, ih, cell) -> row (ih, cell)
    row = np.tile(np.repeat(np.arange(n_h * cells, dtype=np.int64), 4), n_cam)
    value = weight.reshape(-1).astype(np.float64)
    if reduce == "mean":
        count = np.asarray(grid["valid"], dtype=bool).sum(axis=0).reshape(-1)
        inv = np.where(count > 0, 1.0 / np.maximum(count, 1), 0.0)
        value = value * inv[row]
    value32 = value.astype(np.float32)
    out_shape: tuple[int, ...] = (n_h, ny, nx)
    row_of_out = None
    if region:
        if rows == "compact":
            out_shape = (n_h, n_kept)
        else:
            expand = np.asarray(grid["expand"], dtype=np.int64)
            per_h = np.where(expand[None, :] < n_kept, np.arange(n_h)[:, None] * n_kept + expand[None, :], -1)
            row_of_out = per_h.reshape(-1)
    return _finish("gather", "grid", store, row, index.reshape(-1), value32, n_h * cells, out_shape, row_of_out, precision)


def _matrix_rows(store: LoadedStore, rows: str) -> tuple[tuple[int, ...], np.ndarray | None, int]:
    """``(out_shape, row_of_out, n_rows)`` of the ``matrix/`` group."""
    layout = matrix_layout(store)
    _, ny, nx = store.bev_shape
    if layout.expand is not None:
        n_kept = layout.n_rows - 1
        if rows == "compact":
            return (n_kept,), None, n_kept
        expand = np.asarray(layout.expand, np.int64)
        return (ny, nx), np.where(expand < n_kept, expand, -1), layout.n_rows
    if rows == "compact":
        raise UsageError(
            f"{store.path}: matrix/expand: --rows compact needs a store built with a bev.region (its rows are the kept "
            "(super-)cells); this matrix's rows are the BEV cells: drop --rows compact"
        )
    n_cells = ny * nx
    if layout.row_cells.size == n_cells and np.array_equal(layout.row_cells, np.arange(n_cells)):
        return (ny, nx), None, n_cells
    row_of_out = np.full(n_cells, -1, np.int64)
    row_of_out[layout.row_cells] = np.arange(layout.row_cells.size)
    return (ny, nx), row_of_out, int(layout.row_cells.size)


def matrix_lift(store: LoadedStore, form: str, rows: str = "dense", precision: str = "float32") -> LiftMatrix:
    """The ``ell`` or ``tiles`` product of ``matrix/`` (``precision="int8"`` reads the
    ``--quantize int8`` values and scales)."""
    layout = matrix_layout(store)
    group = store["matrix"]
    out_shape, row_of_out, n_rows = _matrix_rows(store, rows)
    if precision == "mixed":
        return _mixed_lift(store, form, layout, out_shape, row_of_out, n_rows)
    int8 = precision == "int8"
    if int8 and ("ell_weight_int8" not in group or "row_scale" not in group):
        raise StoreError(f"{store.path}: --weights int8 needs the int8 matrix; rebuild it with `bevcompile matrix --quantize int8`")
    q = scale = None
    if form == "ell":
        index = np.asarray(group["ell_index"], np.int64)
        r_all = np.repeat(np.arange(index.shape[0], dtype=np.int64), index.shape[1])
        col = index.reshape(-1)
        if int8:
            q = np.asarray(group["ell_weight_int8"]).reshape(-1)
            scale = np.asarray(group["row_scale"], np.float32)
            value = q.astype(np.float32) * scale[r_all]
        else:
            value = np.asarray(group["ell_weight"], np.float32).reshape(-1)
    elif form == "tiles":
        r = layout.tile_rows
        if r is None or "tile_cols" not in group:
            raise StoreError(f"{store.path}: matrix/ has no tiles; rebuild it with `bevcompile matrix --tile-rows R`")
        offsets = np.asarray(group["tile_col_offsets"], np.int64)
        tile_cols = np.asarray(group["tile_cols"], np.int64)
        name = "tile_weight_int8" if int8 else "tile_weight"
        if int8 and name not in group:
            raise StoreError(f"{store.path}: --weights int8 needs the int8 tiles; rebuild it with `bevcompile matrix --quantize int8 --tile-rows R`")
        r_all, col, raw = tile_entries(tile_blocks(np.asarray(group[name]), offsets, r), tile_cols, offsets, r)
        if int8:
            q = raw.astype(np.int8)
            scale = np.asarray(group["tile_row_scale"], np.float32)
            value = q.astype(np.float32) * scale[r_all]
        else:
            value = raw.astype(np.float32)
    else:
        raise UsageError(f"form must be ell or tiles, got {form!r}")
    keep = r_all < n_rows
    scale_rows = None if scale is None else scale[:n_rows].astype(np.float32)
    return _finish(
        form, layout.mode, store, r_all[keep], col[keep], value[keep], n_rows, out_shape, row_of_out, precision,
        q=None if q is None else q[keep], row_scale=scale_rows,
    )


def _mixed_lift(store: LoadedStore, form: str, layout: MatrixLayout, out_shape: tuple[int, ...], row_of_out: np.ndarray | None, n_rows: int) -> LiftMatrix:
    """The ``--quantize mixed`` product (the store's int8 rows + its fp16 rows) of the ELL entries
    (its tiles hold the same values): ``q``/``row_scale`` for the int8 rows, ``row_fp16`` marks the others."""
    from ..matrix.precision import mixed_ell_values

    group = store["matrix"]
    for name in ("ell_weight_int8", "row_scale", "fp16_rows", "fp16_row_weight"):
        if name not in group:
            raise StoreError(f"{store.path}: --weights mixed needs matrix/{name}; rebuild it with `bevcompile matrix --quantize mixed`")
    index = np.asarray(group["ell_index"], np.int64)
    q_all = np.asarray(group["ell_weight_int8"])
    scale = np.asarray(group["row_scale"], np.float32)
    fp16_rows = np.asarray(group["fp16_rows"], np.int64)
    values = mixed_ell_values(q_all, scale, fp16_rows, np.asarray(group["fp16_row_weight"]))
    r_all = np.repeat(np.arange(index.shape[0], dtype=np.int64), index.shape[1])
    keep = r_all < n_rows
    row_fp16 = np.zeros(n_rows, bool)
    row_fp16[fp16_rows[fp16_rows < n_rows]] = True
    q = q_all.reshape(-1)  # every row's int8 values (the fp16 rows' are not used)
    return _finish(
        form, str(layout.mode), store, r_all[keep], index.reshape(-1)[keep], values.reshape(-1)[keep], n_rows, out_shape, row_of_out,
        "mixed", q=q[keep], row_scale=scale[:n_rows], row_fp16=row_fp16,
    )


def product_lift(store: LoadedStore, product: str, *, reduce: str = "sum", rows: str = "dense", precision: str = "float32") -> LiftMatrix:
    """:func:`gather_lift` or :func:`matrix_lift` by product name."""
    if precision not in PRECISIONS:
        raise UsageError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if product == "gather":
        return gather_lift(store, reduce=reduce, rows=rows, precision=precision)
    return matrix_lift(store, product, rows=rows, precision=precision)


__all__ = ["PRECISIONS", "LiftMatrix", "bilinear_tables_from_norm", "gather_lift", "matrix_lift", "product_lift"]
