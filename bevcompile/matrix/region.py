"""Matrix rows of a BEV region (``bev.region``): the one mode-independent step between a mode's
fine-cell entries and the Top-K.

A mode produces entries whose rows are fine BEV cells ``iy * nx + ix``. With a region, each
entry's row becomes the compact row of the (super-)cell holding its cell
(:meth:`bevcompile.rig.region.RegionTable.row_of_cell`; entries of cells outside the region are
dropped), and entries that then share ``(row, col)`` are merged: raw weights SUMMED in increasing
fine-cell order,
tie-break ``dist2`` the smallest of them (:func:`merge_region_rows`). This happens BEFORE Top-K, so
a super-cell's row is the merge of its fine cells' complete rows, then Top-K and normalisation apply
to it like to any row:

* ``--normalize sum``: a super-cell's row (``--topk 0``) is the SUM of its fine cells' rows
  (sum pooling over the super-cell's area: the bigger voxel of a coarser grid);
* ``--normalize mean``: that sum divided by its own raw weight sum, i.e. the MEAN over every point
  that falls into the super-cell: the fine cells' mean rows weighted by their raw row mass
  ``sum_i m_i W_i / sum_i m_i`` (mean pooling over the super-cell's area).

``tests/matrix/test_region.py`` proves both against the dense full-grid matrix. Fine cells (size 1)
keep exactly their full-grid rows (same entries, same order of summation, bit-identical values).

Streamed modes plug in through :class:`RegionStream`, a wrapper around the mode's
:class:`~bevcompile.matrix.topk.EntryStream` built with ``k = 0``: each block's entries (all of
them) are mapped and merged in the block, then counted and filtered on the region rows. Exact,
because every column's entries come from one block (a column is one frustum point or ray sample).

Pass 2 of a mode with the hook ``begin_region_collect`` (frustum): a fine (size-1) cell's row
holds exactly its cell's entries, in the region's score bins, so the mode applies that row's
pass-1 threshold to them itself, with its cheap pre-filter, before it builds any entry (as a
full-grid build does); only the entries of super-cells (merged, then filtered) and the survivors
reach the merge. The same entries pass as without it (the pre-filter only drops entries whose bin
exceeds the threshold), so the build's bytes, its candidate count included, do not change.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from .topk import Entries, EntryStream, Histogram, local_rows

I64 = npt.NDArray[np.int64]
F64 = npt.NDArray[np.float64]


def merge_region_rows(entries: Entries, row_of_cell: I64, n_cols: int, coarse_row: npt.NDArray[np.bool_] | None = None) -> Entries:
    """``entries`` (fine-cell rows) on the region's compact rows: rows mapped through
    ``row_of_cell`` (``(ny * nx,)`` int64, -1 outside the region: dropped), duplicate
    ``(row, col)`` merged (weights summed in increasing fine-cell order with ``np.add.reduceat``,
    smallest ``dist2``), in the order of each key's first entry (so entries without a duplicate
    keep their order). ``coarse_row`` (``(n_rows,)`` bool, optional): the rows of super-cells, the
    only rows that can hold duplicates (the others are passed through unsorted)."""
    rows = row_of_cell[entries.row]
    inside = rows >= 0
    if not inside.all():
        entries = entries.take(inside)
        rows = rows[inside]
    if not len(entries):
        return Entries.empty()
    if coarse_row is None:
        candidates = np.arange(rows.size)
    else:
        candidates = np.flatnonzero(coarse_row[rows])
        if not candidates.size:
            return Entries(rows, entries.col, entries.weight, entries.dist2)
    keys = rows[candidates] * n_cols + entries.col[candidates]
    order = candidates[np.lexsort((entries.row[candidates], keys))]  # by (row, col), then fine cell: the order of summation
    sorted_keys = rows[order] * n_cols + entries.col[order]
    starts = np.flatnonzero(np.r_[True, sorted_keys[1:] != sorted_keys[:-1]])
    if starts.size == candidates.size:
        return Entries(rows, entries.col, entries.weight, entries.dist2)
    weight = np.add.reduceat(entries.weight[order], starts)
    dist2 = np.minimum.reduceat(entries.dist2[order], starts)
    first = np.minimum.reduceat(order, starts)
    # every entry of a fine row, and each merged key at its first entry, in entry order
    passed = np.ones(rows.size, dtype=bool)
    passed[candidates] = False
    position = np.concatenate([np.flatnonzero(passed), first])
    again = np.argsort(position, kind="stable")
    pick = position[again]
    out_weight = np.concatenate([entries.weight[passed], weight])[again]
    out_dist2 = np.concatenate([entries.dist2[passed], dist2])[again]
    return Entries(rows[pick], entries.col[pick], out_weight, out_dist2)


class RegionStream:
    """An :class:`~bevcompile.matrix.topk.EntryStream` whose rows are a region's compact rows,
    around a mode's stream ``inner`` built with ``k = 0`` (every entry; see the module docstring).

    Order scores (for the pass-1 histogram, any score non-decreasing along the Top-K order works):
    ``score="weight"``: ``1 - w`` (clipped to ``[0, 1)``; bilinear weights of one point sum to 1);
    ``score="dist2"``: ``dist2 / h2`` (nearest: every weight is 1)."""

    def __init__(
        self, inner: EntryStream, row_of_cell: I64, n_rows: int, n_cols: int, *, n_bins: int, score: str, h2: float, coarse_row: npt.NDArray[np.bool_] | None = None
    ) -> None:
        self.inner = inner
        self.row_of_cell = row_of_cell
        self.coarse_row = coarse_row
        self.n_cols = n_cols
        self.n_cells = self.n_frame = n_rows
        self.n_bins = n_bins
        self.by_weight = score == "weight"
        self.scale = n_bins * (1.0 - 2.0**-20) if self.by_weight else n_bins / h2
        self.in_range = 0
        self._mass = np.zeros(n_rows)
        self._thr: I64 = np.zeros(0, np.int64)
        # every entry of a cell inside the region passes (a mode may drop the others early: threshold -1)
        inner.begin_collect(np.where(row_of_cell >= 0, 0, -1).astype(np.int64), 1, 0)

    def blocks(self) -> Sequence[Any]:
        return self.inner.blocks()

    def work_units(self, block: Any) -> int:
        return self.inner.work_units(block)

    def _entries(self, block: Any) -> tuple[Entries, int]:
        collected = self.inner.collect(block)  # the inner stream is built with k = 0: (entries, points in range)
        entries, n_in = collected[0], collected[1]
        return merge_region_rows(entries, self.row_of_cell, self.n_cols, self.coarse_row), n_in

    def _bins(self, e: Entries) -> I64:
        score = (1.0 - e.weight) if self.by_weight else e.dist2
        out = np.floor(score * self.scale)
        np.clip(out, 0, self.n_bins - 1, out=out)
        return out.astype(np.int64)

    def count(self, block: Any, hist: Histogram, n_bins: int, k: int) -> tuple[int, I64, F64]:
        e, n_in = self._entries(block)
        rows, local = local_rows(e.row, self.n_cells) if len(e) else (np.zeros(0, np.int64), np.zeros(0, np.int64))
        keys = local * n_bins + self._bins(e) if k > 0 else local
        hist.add_local(rows, keys)
        sums = np.asarray(np.bincount(local, weights=e.weight, minlength=rows.size) if len(e) else np.zeros(0), dtype=np.float64)
        return n_in, rows, sums

    def fold(self, partial: tuple[int, I64, F64]) -> None:
        n_in, rows, sums = partial
        self.in_range += n_in
        if rows.size:
            self._mass[rows] += sums

    def cells_of_frame(self, per_frame: npt.NDArray[Any]) -> npt.NDArray[Any]:
        return per_frame

    def total_mass(self, hist_cells: I64) -> F64:
        return self._mass

    def begin_collect(self, threshold: I64, n_bins: int, k: int) -> None:
        self._thr = threshold if k > 0 else np.zeros(0, np.int64)
        hook = getattr(self.inner, "begin_region_collect", None)
        if k > 0 and hook is not None:
            # fine cells: their row's threshold, applied by the mode itself before it builds the
            # entries (a fine row's entries are its cell's, in the same bins); cells of super-cells:
            # every entry (their row is a merge: filtered after it, in collect); outside: none
            row = self.row_of_cell
            coarse = np.zeros(row.size, dtype=bool) if self.coarse_row is None else self.coarse_row[np.maximum(row, 0)]
            cell_thr = np.where(row < 0, -1, np.where(coarse, n_bins, threshold[np.maximum(row, 0)]))
            hook(cell_thr.astype(np.int64), self.n_bins, self.scale, k)

    def collect(self, block: Any) -> tuple[Entries, int]:
        e, n_in = self._entries(block)
        if self._thr.size and len(e):
            e = e.take(self._bins(e) <= self._thr[e.row])
        return e, n_in

    def end_collect(self) -> None:
        self.inner.end_collect()
