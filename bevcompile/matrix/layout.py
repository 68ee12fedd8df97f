"""Layouts of the sparse aggregation matrix: dense, ELL, row tiles, per-row int8. Pure numpy;
re-exported by :mod:`bevcompile.matrix.build` (the README's matrix/ contract describes every array).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import numpy.typing as npt

from ..errors import UsageError

INT8_MAX = 127
MAX_PRODUCT_SLOTS = 1 << 28
"""Largest padded product (ELL ``rows_pad * k_pad``, tile blocks ``R * sum(widths)``) a build
allocates: 2^28 slots = 1 GiB per float32 array. Larger requests are a :class:`UsageError`
raised before any allocation (they come from a mistyped ``--topk``/``--align``/``--tile-rows``)."""


def round_up(value: int, multiple: int) -> int:
    return -(-int(value) // int(multiple)) * int(multiple)


def check_product_slots(what: str, n_slots: int, hint: str) -> None:
    """Raise :class:`UsageError` if a padded product of ``n_slots`` would exceed :data:`MAX_PRODUCT_SLOTS`."""
    if n_slots > MAX_PRODUCT_SLOTS:
        raise UsageError(
            f"{what} would hold {n_slots:,} slots ({n_slots * 4 / 2**30:,.1f} GiB per float32 array), "
            f"over the {MAX_PRODUCT_SLOTS:,}-slot limit of one product; {hint}"
        )


def coo_to_dense(
    row: npt.NDArray[np.integer[Any]], col: npt.NDArray[np.integer[Any]], val: npt.NDArray[np.floating[Any]], shape: tuple[int, int]
) -> npt.NDArray[np.float32]:
    """Dense ``W``. Convention: COO ``(nnz,)`` arrays and ``shape = (n_rows, n_cols)`` ->
    ``(n_rows, n_cols)`` float32 (duplicates added)."""
    out = np.zeros(shape, dtype=np.float32)
    np.add.at(out, (np.asarray(row, np.int64), np.asarray(col, np.int64)), np.asarray(val, np.float32))
    return out


def ell_layout(
    row: npt.NDArray[np.integer[Any]], col: npt.NDArray[np.integer[Any]], val: npt.NDArray[np.float32], rows_pad: int, k_pad: int
) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.float32]]:
    """ELL form of COO entries sorted by ``(row, col)``.

    Convention: ``row``/``col`` int ``(nnz,)``, ``val`` float32 ``(nnz,)`` -> ``ell_index`` int32
    and ``ell_weight`` float32, both ``(rows_pad, k_pad)``: slot ``j`` of row ``r`` holds its j-th
    entry by column; padding slots have weight 0 and index = the row's first column (0 for
    empty rows).
    """
    row = np.asarray(row, np.int64)
    index = np.zeros((rows_pad, k_pad), dtype=np.int32)
    weight = np.zeros((rows_pad, k_pad), dtype=np.float32)
    if row.size:
        starts = np.flatnonzero(np.r_[True, row[1:] != row[:-1]])
        counts = np.diff(np.r_[starts, row.size])
        slot = np.arange(row.size) - np.repeat(starts, counts)
        first_col = np.zeros(rows_pad, dtype=np.int32)
        first_col[row[starts]] = np.asarray(col, np.int32)[starts]
        index[:] = first_col[:, None]
        index[row, slot] = col
        weight[row, slot] = val
    return index, weight


def tile_layout(
    row: npt.NDArray[np.integer[Any]],
    col: npt.NDArray[np.integer[Any]],
    val: npt.NDArray[np.float32],
    n_rows: int,
    n_cols: int,
    tile_rows: int,
    align: int,
) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int64], npt.NDArray[np.float32]]:
    """Block-dense row tiles.

    Convention: COO ``(nnz,)`` arrays sorted by (row, col) -> ``tile_cols`` int32 ``(T,)``,
    ``tile_col_offsets`` int64 ``(n_tiles + 1,)`` (``o``), ``tile_weight`` float32 ``(R * T,)``.
    Tile ``t`` covers rows ``[t R, t R + R)``; ``tile_cols[o[t]:o[t+1]]`` are the sorted distinct
    columns its rows use, padded to a multiple of ``align`` (at least ``align``) by repeating the
    last column (0 for an empty tile); its dense block is
    ``tile_weight[R o[t] : R o[t+1]].reshape(R, o[t+1] - o[t])`` (row-major, local row i = row
    ``t R + i``; rows past ``n_rows`` and padding columns are 0).
    """
    n_tiles = max(1, -(-n_rows // tile_rows)) if n_rows else 0
    row = np.asarray(row, np.int64)
    col = np.asarray(col, np.int64)
    tile = row // tile_rows
    key = tile * n_cols + col
    unique, inverse = np.unique(key, return_inverse=True)
    unique_tile = unique // n_cols
    unique_col = unique % n_cols
    counts = np.bincount(unique_tile, minlength=n_tiles)
    padded = np.array([round_up(max(int(c), 1), align) for c in counts], dtype=np.int64)
    offsets = np.zeros(n_tiles + 1, dtype=np.int64)
    np.cumsum(padded, out=offsets[1:])
    first_unique = np.zeros(n_tiles + 1, dtype=np.int64)
    np.cumsum(counts, out=first_unique[1:])
    check_product_slots(
        f"the tiles ({n_tiles:,} tiles of --tile-rows {tile_rows:,} rows, {int(offsets[-1]):,} columns in all)",
        tile_rows * int(offsets[-1]),
        "use fewer --tile-rows or a smaller --align",
    )
    tile_cols = np.zeros(int(offsets[-1]), dtype=np.int32)
    for t in range(n_tiles):
        used = unique_col[first_unique[t] : first_unique[t + 1]]
        block = tile_cols[offsets[t] : offsets[t + 1]]
        block[: used.size] = used
        block[used.size :] = used[-1] if used.size else 0
    pos = np.arange(unique.size) - first_unique[unique_tile]  # slot of each unique (tile, col)
    slot = pos[inverse]
    width = padded[tile]
    flat = tile_rows * offsets[tile] + (row - tile * tile_rows) * width + slot
    tile_weight = np.zeros(tile_rows * int(offsets[-1]), dtype=np.float32)
    tile_weight[flat] = val
    return tile_cols, offsets, tile_weight


INT8_BLOCK_SLOTS = 1 << 20
"""Slots (rows x columns) quantised or measured at a time: the float64 temporaries of
:func:`quantize_rows_int8` and :func:`int8_errors` stay a few tens of MiB whatever the product
size (every row is independent, so the result is bit-identical to a whole-array pass)."""


def _row_blocks(n_rows: int, n_cols: int) -> Iterator[slice]:
    """Row slices of at most ``INT8_BLOCK_SLOTS`` slots (at least one row each)."""
    step = max(1, INT8_BLOCK_SLOTS // max(1, n_cols))
    for a in range(0, n_rows, step):
        yield slice(a, min(n_rows, a + step))


def quantize_rows_int8(
    weight: npt.NDArray[np.float32], rows_axis_scale: npt.NDArray[np.float32] | None = None
) -> tuple[npt.NDArray[np.int8], npt.NDArray[np.float32]]:
    """Symmetric per-row int8: ``row_scale = float32(max|w_row| / 127)`` (stepped up by float32
    ulps in the rare case that this would be 0 or clip the peak: rows whose peak is subnormal-range),
    ``q = clip(round_half_even(w / row_scale), -127, 127)`` (0 for all-zero rows);
    dequantise ``w ~ float32(q) * row_scale``.

    Convention: ``weight`` ``(rows, n)`` float32 -> ``(q int8 (rows, n), row_scale float32 (rows,))``.
    ``rows_axis_scale`` reuses given scales (tiles use the ELL rows' scales). Works in row blocks
    of ``INT8_BLOCK_SLOTS`` slots (bounded float64 temporaries).
    """
    weight = np.asarray(weight)
    n_rows, n_cols = weight.shape
    if rows_axis_scale is None:
        peak = np.zeros(n_rows)
        if n_cols:
            for rows in _row_blocks(n_rows, n_cols):  # |w| and max are exact in float32
                peak[rows] = np.abs(weight[rows]).max(axis=1)
        scale = (peak / INT8_MAX).astype(np.float32)
        # Tiny rows (peak below ~127 * 2^-126): float32 rounding of the scale is coarse there and
        # may reach 0 or round down so far that the peak would clip. Step the scale up until the
        # peak quantises within [-127.5, 127.5] (never happens for normal-range weights).
        for _ in range(4):
            short = (peak > 0) & ((scale == 0) | (peak > 127.5 * scale.astype(np.float64)))
            if not short.any():
                break
            scale[short] = np.nextafter(scale[short], np.float32(np.inf))
    else:
        scale = np.asarray(rows_axis_scale, dtype=np.float32)
    q = np.zeros((n_rows, n_cols), dtype=np.int8)
    for rows in _row_blocks(n_rows, n_cols):
        s64 = scale[rows].astype(np.float64)[:, None]
        safe = np.where(s64 > 0, s64, 1.0)
        qb = np.where(s64 > 0, np.rint(np.asarray(weight[rows], np.float64) / safe), 0.0)
        q[rows] = np.clip(qb, -INT8_MAX, INT8_MAX)
    return q, scale


def dequantize_rows_int8(q: npt.NDArray[np.int8], row_scale: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    """Convention: ``q`` int8 ``(rows, n)``, ``row_scale`` float32 ``(rows,)`` -> float32
    ``(rows, n)`` = ``float32(q) * row_scale[:, None]``."""
    return (q.astype(np.float32) * np.asarray(row_scale, np.float32)[:, None]).astype(np.float32)


def int8_errors(weight: npt.NDArray[np.float32], q: npt.NDArray[np.int8], row_scale: npt.NDArray[np.float32]) -> tuple[float, float]:
    """(max relative error w.r.t. the row's max |w|, max absolute error) of the dequantised rows.

    Convention: ``weight`` float32 ``(rows, n)``, ``q`` int8 ``(rows, n)``, ``row_scale`` float32
    ``(rows,)``; rows whose max |w| is 0 count as relative error 0. Works in row blocks of
    ``INT8_BLOCK_SLOTS`` slots (bounded temporaries; max is exact, so block order does not matter)."""
    weight, q, row_scale = np.asarray(weight), np.asarray(q), np.asarray(row_scale, np.float32)
    if weight.size == 0:
        return 0.0, 0.0
    rel = absolute = 0.0
    for rows in _row_blocks(*weight.shape):
        w64 = np.asarray(weight[rows], np.float64)
        err = np.abs(dequantize_rows_int8(q[rows], row_scale[rows]).astype(np.float64) - w64)
        peak = np.abs(w64).max(axis=1)
        r = np.where(peak[:, None] > 0, err / np.where(peak[:, None] > 0, peak[:, None], 1.0), 0.0)
        rel, absolute = float(np.max([rel, r.max()])), float(np.max([absolute, err.max()]))  # NaN propagates as before
    return rel, absolute


def tile_blocks(
    tile_weight: npt.NDArray[Any], tile_col_offsets: npt.NDArray[np.integer[Any]], tile_rows: int
) -> Iterator[npt.NDArray[Any]]:
    """The dense ``(R, n_cols_tile_pad)`` block of every tile (views into ``tile_weight``).

    Convention: ``tile_weight`` ``(R * T,)`` any dtype, ``tile_col_offsets`` ``(n_tiles + 1,)``;
    block ``t`` = ``tile_weight[R o[t] : R o[t+1]].reshape(R, o[t+1] - o[t])``."""
    for t in range(tile_col_offsets.size - 1):
        a, b = int(tile_col_offsets[t]), int(tile_col_offsets[t + 1])
        yield tile_weight[tile_rows * a : tile_rows * b].reshape(tile_rows, b - a)


def tile_entries(
    blocks: Iterable[npt.NDArray[Any]], tile_cols: npt.NDArray[np.integer[Any]], tile_col_offsets: npt.NDArray[np.integer[Any]], tile_rows: int
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[Any]]:
    """The non-zero entries of the tile ``blocks`` (:func:`tile_blocks`, or values derived from
    them block by block) as COO, tile by tile.

    Convention: returns ``(rows, cols, values)`` ``(nnz,)``: row ``t * R + i`` and column
    ``tile_cols[tile_col_offsets[t] + j]`` of the non-zero ``blocks[t][i, j]``, row-major within a
    tile (empty: int64, int64, float32)."""
    rows, cols, values = [], [], []
    for t, block in enumerate(blocks):
        i, j = np.nonzero(block)
        rows.append(t * tile_rows + i)
        cols.append(tile_cols[tile_col_offsets[t] + j])
        values.append(block[i, j])
    if not rows:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.float32)
    return np.concatenate(rows), np.concatenate(cols), np.concatenate(values)


def tile_scales_and_int8(
    tile_weight: npt.NDArray[np.float32],
    tile_col_offsets: npt.NDArray[np.int64],
    tile_rows: int,
    row_scale: npt.NDArray[np.float32],
) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.int8]]:
    """int8 tiles with the per-row scales of the ELL rows: ``tile_row_scale[t R + i]`` is the
    scale of row ``t R + i`` (0 past the padded rows)."""
    n_tiles = tile_col_offsets.size - 1
    tile_row_scale = np.zeros(n_tiles * tile_rows, dtype=np.float32)
    n = min(tile_row_scale.size, row_scale.size)
    tile_row_scale[:n] = row_scale[:n]
    out = np.zeros(tile_weight.size, dtype=np.int8)
    for t, block in enumerate(tile_blocks(tile_weight, tile_col_offsets, tile_rows)):
        q, _ = quantize_rows_int8(block, tile_row_scale[t * tile_rows : (t + 1) * tile_rows])
        a = int(tile_col_offsets[t]) * tile_rows
        out[a : a + q.size] = q.ravel()
    return tile_row_scale, out


def tile_int8_errors(
    tile_weight: npt.NDArray[np.float32],
    tile_int8: npt.NDArray[np.int8],
    tile_row_scale: npt.NDArray[np.float32],
    tile_col_offsets: npt.NDArray[np.int64],
    tile_rows: int,
) -> tuple[float, float]:
    rel = absolute = 0.0
    qblocks = tile_blocks(tile_int8, tile_col_offsets, tile_rows)
    for t, (block, qblock) in enumerate(zip(tile_blocks(tile_weight, tile_col_offsets, tile_rows), qblocks, strict=True)):
        r, a = int8_errors(block, qblock, tile_row_scale[t * tile_rows : (t + 1) * tile_rows])
        rel, absolute = max(rel, r), max(absolute, a)
    return rel, absolute
