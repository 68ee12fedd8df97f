"""The streamed, bounded Top-K selection every streamed matrix mode plugs into. Pure numpy.

How a streamed build works (``docs/matrix.md`` "How the build streams" says the same for users):

1. A mode is an :class:`EntryStream`: a fixed list of **blocks** (work items that depend only on
   the rig and the options, never on ``--jobs``) and two functions per block that produce that
   block's entries (``row`` BEV cell, ``col``, raw ``weight``, tie-break ``dist2``) from scratch.
   ``count`` (pass 1) hands every entry's histogram key ``frame_row * n_bins + score_bin`` to a
   shared :class:`Histogram` and returns the block's share of whatever the mode sums (the row
   masses); ``collect`` (pass 2) returns the entries that can still be in the Top-K. The mode may
   count in its own row *frame* (e.g. a grid padded so that the four bilinear corners of a point
   need no bounds test) and maps it to BEV cells with ``cells_of_frame``.
2. :func:`stream_topk` runs pass 1 over every block with :func:`bevcompile.parallel.ordered_map`
   (``jobs`` threads compute blocks, the caller folds them **in block order**, so float sums get
   the same bits for every ``jobs``), then derives per row the threshold bin ``b[r]`` holding its
   K-th best entry (:func:`thresholds`): any entry in a later bin is strictly worse than K others.
3. Pass 2 recomputes every block and keeps the entries with ``bin <= b[row]``; they go, in block
   order, into a :class:`CandidateBuffer`, the bounded selection: when it holds more than
   ``budget = max(CANDIDATE_BUDGET_PER_SLOT * rows * K, CANDIDATE_BUDGET_MIN)`` entries it is
   compacted to the exact Top-K of what it holds, and from then on an entry enters only if it
   beats its row's current K-th best (the exact order key, ties included). So the candidates that
   reach one exact sort never exceed the budget plus one block, whatever the weight distribution.
4. The final exact sort (:func:`select_topk`) splits the rows into ``jobs`` contiguous ranges.

The Top-K rule (larger raw weight, then smaller ``dist2``, then smaller column) is a total order
on a row's entries, so every filter above only removes entries that K others beat: the result is
exactly the straightforward build's (:mod:`bevcompile.matrix.reference`), for any block size,
order of arrival, budget and ``jobs``.
"""

from __future__ import annotations

import functools
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from ..memory import release_free_memory
from ..parallel import ordered_map
from ..progress import ProgressFn, start_phase
from .scatter import scatter_add

I64 = npt.NDArray[np.int64]
F64 = npt.NDArray[np.float64]

MAX_INDEX = np.iinfo(np.int32).max
CANDIDATE_BUDGET_PER_SLOT = 3
CANDIDATE_BUDGET_MIN = 1 << 20
"""The candidate buffer is compacted above ``max(3 * rows * K, 2^20)`` entries (24 MiB at 2^20)."""
SELECT_SPLIT_MIN = 1 << 18
"""Below this many entries :func:`select_topk` does not split the rows over threads."""


# --------------------------------------------------------------------------------------
# entries and the Top-K rule
# --------------------------------------------------------------------------------------


@dataclass
class Entries:
    """Matrix entries before normalisation.

    Convention: ``row`` int64 BEV cell ``iy * nx + ix``; ``col`` int64 column; ``weight``
    float64 raw weight (> 0); ``dist2`` float64 tie-break distance (``bevcompile.matrix.build``
    module docstring).
    """

    row: I64
    col: I64
    weight: F64
    dist2: F64

    @classmethod
    def empty(cls) -> Entries:
        return cls(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0), np.zeros(0))

    @classmethod
    def concat(cls, parts: list[Entries]) -> Entries:
        if not parts:
            return cls.empty()
        if len(parts) == 1:
            return parts[0]
        return cls(
            np.concatenate([p.row for p in parts]),
            np.concatenate([p.col for p in parts]),
            np.concatenate([p.weight for p in parts]),
            np.concatenate([p.dist2 for p in parts]),
        )

    def take(self, index: npt.NDArray[np.integer[Any]] | npt.NDArray[np.bool_]) -> Entries:
        return Entries(self.row[index], self.col[index], self.weight[index], self.dist2[index])

    def __len__(self) -> int:
        return int(self.row.size)


def _rank_order(e: Entries) -> I64:
    """The permutation sorting ``e`` by (row, -weight, dist2, col), exactly.

    One argsort of a float key ``row * span + (primary - min)`` (``primary = -weight``, or
    ``dist2`` when every weight is equal; any key monotone in the primary within a row would do)
    separates the rows exactly; runs of equal keys (equal primaries, or primaries that rounded
    together) are then put in the exact order: runs whose entries share primary and dist2 by
    column (one int64 argsort), the others by (primary, dist2, col) (``lexsort``). About 40 bytes
    of temporaries per entry.
    """
    equal_weights = bool(np.all(e.weight == e.weight[0]))
    sign = 1.0 if equal_weights else -1.0
    values = e.dist2 if equal_weights else e.weight
    low = float(values.min()) if equal_weights else -float(values.max())
    span = float(math.floor(float(values.max()) - float(values.min())) + 2)
    if int(e.row.max()) * span >= 2.0**52:  # pragma: no cover - beyond any BEV grid
        return np.lexsort((e.col, e.dist2, sign * values, e.row))
    key = e.row * span
    key -= low
    if equal_weights:
        key += values
    else:
        key -= values
    order, runs = _tie_runs(key)  # not stable: every run of equal keys is re-sorted exactly below
    del key
    if runs is None:
        return order
    pos, run_id, starts, lengths = runs
    sub = order[pos]
    primary = sign * values[sub]
    dist2 = e.dist2[sub]
    one_primary = _run_constant(primary, starts, lengths)
    uniform = one_primary & _run_constant(dist2, starts, lengths)
    cols = e.col[sub]
    n_cols = int(e.col.max()) + 1
    rest = np.arange(sub.size)
    if int(run_id[-1]) * n_cols < 2**62:  # runs of exact ties: by column alone
        fast = np.flatnonzero(uniform)
        sub[fast] = sub[fast][np.argsort(run_id[fast] * n_cols + cols[fast])]
        rest = np.flatnonzero(~uniform)
        # runs of one primary (exact weight ties) whose dist2 differ: by (dist2, col), _order_runs
        tied = np.flatnonzero(one_primary & ~uniform)
        if tied.size:
            sub[tied] = sub[tied][_order_runs(run_id[tied], dist2[tied], cols[tied], n_cols)]
            rest = np.flatnonzero(~one_primary)
    if rest.size:  # runs of primaries that rounded together: the full exact order
        sub[rest] = sub[rest][np.lexsort((cols[rest], dist2[rest], primary[rest], run_id[rest]))]
    order[pos] = sub
    return order


def _tie_runs(key: npt.NDArray[np.floating[Any]]) -> tuple[I64, tuple[I64, I64, I64, I64] | None]:
    """``(order, runs)``: ``argsort(key)`` (not stable), and of the sorted entries that share their
    key with a neighbour (runs of equal keys, in sorted order) ``(pos, run_id, starts, lengths)``:
    their positions in ``order``, each one's run number (non-decreasing), and the runs' first
    index into ``pos`` and length; ``runs`` None when every key is distinct. The caller drops
    ``key`` after it (its sorted copy is freed here)."""
    order = np.argsort(key)
    key = key[order]
    tie = key[1:] == key[:-1]
    del key
    if not tie.any():
        return order, None
    in_run = np.zeros(order.size, dtype=bool)
    in_run[1:] |= tie
    in_run[:-1] |= tie
    pos = np.flatnonzero(in_run)
    del in_run
    run_id = np.cumsum(np.r_[True, ~tie])[pos]
    del tie
    starts = np.flatnonzero(np.r_[True, run_id[1:] != run_id[:-1]])
    lengths = np.diff(np.r_[starts, pos.size])
    return order, (pos, run_id, starts, lengths)


def _run_constant(values: npt.NDArray[Any], starts: I64, lengths: I64) -> npt.NDArray[np.bool_]:
    """Per entry of :func:`_tie_runs`' runs, whether ``values`` is the same over its whole run."""
    return np.repeat(np.logical_and.reduceat(values == np.repeat(values[starts], lengths), starts), lengths)


def _order_runs(run_id: I64, dist2: F64, col: I64, n_cols: int) -> I64:
    """The permutation ordering entries by ``(run_id, dist2, col)`` exactly: ``run_id`` int64 non-decreasing,
    ``dist2`` float64 >= 0, ``col`` int64 in ``[0, n_cols)`` with ``run_id * n_cols`` below 2^62.

    The scheme of :func:`_rank_order` one level down: one argsort of the float key
    ``(run - first run) * span + (dist2 - min)`` (``span`` above the dist2 range: a run's keys stay
    below the next run's), then each run of equal keys by column when its dist2 are equal, by
    ``(dist2, col)`` (``lexsort``) when they only rounded together. Replaces a ``lexsort`` of every
    weight-tied entry (nearest splats with a non-uniform depth prior: millions of them)."""
    low, high = float(dist2.min()), float(dist2.max())
    if not math.isfinite(high) or (int(run_id[-1] - run_id[0]) + 1) * (high - low + 2.0) >= 2.0**52 or dist2.size * n_cols >= 2**62:
        return np.lexsort((col, dist2, run_id))  # pragma: no cover - beyond any candidate buffer
    span = float(math.floor(high - low) + 2)
    key = (run_id - run_id[0]).astype(np.float64)
    key *= span
    key -= low
    key += dist2
    order, runs = _tie_runs(key)
    del key
    if runs is None:
        return order
    pos, run2, starts, lengths = runs
    sub = order[pos]
    d2 = dist2[sub]
    uniform = _run_constant(d2, starts, lengths)
    cols = col[sub]
    exact = np.flatnonzero(uniform)  # equal dist2: by column (run2 * n_cols < dist2.size * n_cols < 2^62)
    sub[exact] = sub[exact][np.argsort(run2[exact] * n_cols + cols[exact])]
    rounded = np.flatnonzero(~uniform)
    if rounded.size:
        sub[rounded] = sub[rounded][np.lexsort((cols[rounded], d2[rounded], run2[rounded]))]
    order[pos] = sub
    return order


def _topk_ranked(e: Entries, k: int) -> tuple[I64, I64]:
    """``(index, rank)``: the entries of ``e`` kept by the Top-K rule, row by row best first, and
    their rank in their row (0 = best)."""
    order = _rank_order(e)
    counts = np.bincount(e.row)
    first = np.cumsum(counts) - counts  # the first sorted position of each row
    del counts
    rank = first[e.row[order]]
    del first
    np.subtract(np.arange(order.size), rank, out=rank)
    keep = np.flatnonzero(rank < k)
    return order[keep], rank[keep]


def _split_rows(e: Entries, parts: int) -> list[Entries]:
    """``e`` split into ``parts`` groups of contiguous row ranges with about equal entry counts."""
    counts = np.cumsum(np.bincount(e.row))
    bounds = np.searchsorted(counts, counts[-1] * np.arange(1, parts) / parts, side="right")
    part_of = np.searchsorted(bounds, e.row, side="right").astype(np.uint16)
    order = np.argsort(part_of, kind="stable")
    edges = np.searchsorted(part_of[order], np.arange(parts + 1))
    return [e.take(order[edges[i] : edges[i + 1]]) for i in range(parts)]


def select_topk(entries: Entries, k: int, jobs: int = 1) -> Entries:
    """The Top-K rule on distinct ``(row, col)`` entries; returns the kept entries sorted by
    ``(row, col)``. ``k = 0`` keeps everything.

    Convention: :class:`Entries` in (any order) -> :class:`Entries` out, sorted by (row, col).
    Order within a row: larger weight, then smaller ``dist2``, then smaller column (exact, see
    :func:`_rank_order`). With ``jobs > 1`` the rows are split into contiguous ranges selected by
    ``jobs`` threads; the result does not depend on ``jobs`` (nor on the input order).
    """
    if jobs > 1 and len(entries) >= SELECT_SPLIT_MIN:
        pieces = _split_rows(entries, jobs)
        del entries  # the caller may have handed over its only reference
        return Entries.concat(list(ordered_map(lambda p: select_topk(p, k), [p for p in pieces if len(p)], jobs)))
    index = _topk_ranked(entries, k)[0] if k > 0 and len(entries) else None
    row = entries.row if index is None else entries.row[index]
    col = entries.col if index is None else entries.col[index]
    if len(row) and int(row.max()) < MAX_INDEX and int(col.max()) < MAX_INDEX:
        key = row * (int(col.max()) + 1)
        key += col
        order = np.argsort(key)
        del key
    else:
        order = np.lexsort((col, row))
    del row, col
    return entries.take(order if index is None else index[order])


# --------------------------------------------------------------------------------------
# pass 1: the order-score histogram and the threshold bins
# --------------------------------------------------------------------------------------


class Histogram:
    """Integer counters ``(n_rows, n_bins)`` (int64; a stream that can bound its entries may ask for
    int32 with ``hist_dtype``) fed by several threads.

    A block touches only a narrow band of the grid's rows, so it is counted in a compact local
    histogram of just those rows (:meth:`add_local`: ``bincount``'s counts, by
    :func:`~bevcompile.matrix.scatter.scatter_add` without the GIL, into an array that stays in
    cache, instead of scattering into the whole table) and added row by row under a lock.
    Integer counts: the result does not depend on which thread counted what, nor in what order.
    """

    def __init__(self, n_rows: int, n_bins: int, dtype: type[np.signedinteger[Any]] = np.int64) -> None:
        self.n_rows, self.n_bins = n_rows, n_bins
        self.total: I64 = np.zeros((n_rows, n_bins), dtype=dtype)
        self._lock = threading.Lock()

    def add_local(self, rows: I64, local_keys: I64) -> None:
        """Count keys ``local_keys = i * n_bins + bin`` of the entries of rows ``rows[i]``
        (``rows`` distinct, ``i`` in ``[0, rows.size)``)."""
        if not local_keys.size:
            return
        counts = np.zeros(rows.size * self.n_bins, dtype=np.int64)
        scatter_add(counts, local_keys)  # bincount's counts, without the GIL
        with self._lock:
            self.total[rows] += counts.reshape(rows.size, self.n_bins)

    def add_scattered(self, keys: I64) -> None:
        """Count global keys ``row * n_bins + bin`` one by one (:func:`~bevcompile.matrix.scatter.scatter_add`,
        ``np.add.at``'s counts without the GIL): cheaper than
        :meth:`add_local` when a block's entries spread over many rows (a few per counter)."""
        if not keys.size:
            return
        with self._lock:
            scatter_add(self.total.reshape(-1), keys)

    def add(self, keys: I64) -> None:
        """Count global keys ``row * n_bins + bin`` (any rows; the array may be modified)."""
        if not keys.size:
            return
        rows, local_keys = _localise(keys, self.n_rows, self.n_bins)
        self.add_local(rows, local_keys)


def _localise(keys: I64, n_rows: int, n_bins: int) -> tuple[I64, I64]:
    """``(rows, local_keys)`` of global keys ``row * n_bins + bin`` (for :meth:`Histogram.add_local`)."""
    row = keys // n_bins
    rows, local = local_rows(row, n_rows)
    local *= n_bins
    local += keys - row * n_bins
    return rows, local


LOCAL_SCAN_RATIO = 8
""":func:`local_rows` scans a mark array when the frame is at most this many times the index count."""


def local_rows(index: I64, size: int) -> tuple[I64, I64]:
    """``(values, local)``: the distinct values of ``index`` (sorted) and each element's position
    among them, so that ``values[local] == index``.

    Convention: ``index`` int64 in ``[0, size)`` -> ``(values (m,) int64, local (n,) int64)``. A
    block touches a narrow band of a frame: with ``size <= LOCAL_SCAN_RATIO * n`` a mark-and-scan
    of ``size`` booleans (no sort), else ``np.unique``; both give the same arrays."""
    if size > LOCAL_SCAN_RATIO * max(1, index.size):
        values, local = np.unique(index, return_inverse=True)
        return values, local.astype(np.int64, copy=False).reshape(-1)
    mark = np.zeros(size, dtype=bool)
    mark[index] = True
    values = np.flatnonzero(mark)
    remap = np.zeros(size, dtype=np.int64)
    remap[values] = np.arange(values.size)
    return values, remap[index]


def hist_bins(n_cells: int, max_bins: int, max_entries: int) -> int:
    """Bins per row: ``max_bins``, fewer above ``max_entries // max_bins`` cells (at least 8)."""
    return int(max(8, min(max_bins, max_entries // max(1, n_cells))))


def thresholds(hist: I64, k: int, n_bins: int) -> I64:
    """Per row the bin holding its k-th best counted entry (every entry in a later bin is strictly
    worse than k entries); ``n_bins - 1`` (keep all) for rows with fewer than k entries.

    Convention: hist ``(n_rows, n_bins)`` integer counts -> ``(n_rows,)`` int64 bins. Computed
    ``THRESHOLD_ROWS`` rows at a time: the cumulative counts of a whole table (tens of MB on a dense
    grid) would be fresh pages, each faulted in, on every build."""
    out = np.empty(hist.shape[0], dtype=np.int64)
    for start in range(0, hist.shape[0], THRESHOLD_ROWS):
        cum = np.cumsum(hist[start : start + THRESHOLD_ROWS], axis=1, dtype=_cum_type(hist))
        enough = cum >= k
        part = out[start : start + THRESHOLD_ROWS]
        np.argmax(enough, axis=1, out=part)
        part[~enough[:, -1]] = n_bins - 1
    return out


THRESHOLD_ROWS = 1024
""":func:`thresholds` and :func:`counts_before` rows per step (about 1 MB of cumulative counts)."""


def _cum_type(hist: npt.NDArray[np.integer[Any]]) -> np.dtype[Any]:
    """The type a row's running total is summed in: int32 counters are used only where the stream
    bounds all its entries below 2^31 (:class:`Histogram` ``hist_dtype``), so a row's total fits
    them (half the memory traffic of int64); narrower or unsigned counters are widened."""
    return np.promote_types(hist.dtype, np.int32)


def counts_before(hist: I64, rows: I64, bins: I64) -> I64:
    """Per row ``rows[i]`` its counts in the bins before ``bins[i]`` (``sum(hist[rows[i], :bins[i]])``).

    Convention: hist ``(n_rows, n_bins)`` integer counts, ``rows`` ``(m,)`` int64, ``bins`` ``(m,)``
    int64 in ``[0, n_bins]`` -> ``(m,)`` int64; ``THRESHOLD_ROWS`` rows at a time, as :func:`thresholds`."""
    out = np.zeros(rows.size, dtype=np.int64)
    for start in range(0, rows.size, THRESHOLD_ROWS):
        stop = start + THRESHOLD_ROWS
        cum = np.cumsum(hist[rows[start:stop]], axis=1, dtype=_cum_type(hist))
        at = np.flatnonzero(bins[start:stop] > 0)
        out[start + at] = cum[at, bins[start + at] - 1]
    return out


# --------------------------------------------------------------------------------------
# pass 2: the bounded candidate buffer
# --------------------------------------------------------------------------------------


def candidate_budget(n_cells: int, k: int) -> int:
    """Entries the candidate buffer holds before it is compacted (``k > 0``)."""
    return max(CANDIDATE_BUDGET_PER_SLOT * n_cells * k, CANDIDATE_BUDGET_MIN)


class CandidateBuffer:
    """The entries that may still be in the Top-K, added block by block in block order.

    With ``k > 0`` it never holds much more than ``budget`` entries: past it (and past twice what
    the last compaction left, so that the sorting stays linear in the entries added), the buffer
    is replaced by its own exact Top-K (a compaction, at most rows x K entries), and each row that
    then has K entries records its K-th best ``(weight, dist2, col)``; a later entry of that row
    enters only if it is better (the exact rule, so a tie on weight and distance is decided by the
    column). One exact sort thus sees at most ``max(budget, 2 rows K)`` plus one block of entries.
    Deterministic: it depends only on the sequence of added blocks. With ``k = 0`` everything is
    kept, in order.
    """

    def __init__(self, k: int, n_cells: int, budget: int, jobs: int = 1) -> None:
        self.k, self.n_cells, self.budget, self.jobs = k, n_cells, budget, jobs
        self.parts: list[Entries] = []
        self.size = 0
        self.accepted = 0  # entries that entered the buffer (each reached an exact sort)
        self.largest = 0  # the most entries one exact sort saw
        self.compactions = 0
        self._kept = 0  # entries left by the last compaction (<= rows x K)
        self._tau: tuple[F64, F64, I64] | None = None  # K-th best (weight, dist2, col) per row

    def add(self, entries: Entries, owned: bool = False) -> None:
        """Add one block's candidates (copied when other threads made them, unless ``owned``: the
        calling thread allocated them; see :meth:`_own`)."""
        if self._tau is not None and len(entries):
            w_t, d_t, c_t = (a[entries.row] for a in self._tau)
            w, d = entries.weight, entries.dist2
            better = (w > w_t) | ((w == w_t) & ((d < d_t) | ((d == d_t) & (entries.col < c_t))))
            entries = entries.take(better)
        if not len(entries):
            return
        self.parts.append(self._own(entries) if self.jobs > 1 and not owned else entries)
        self.size += len(entries)
        self.accepted += len(entries)
        if self.k and self.size > max(self.budget, 2 * self._kept):  # at least half of it new: linear total work
            self._compact()

    @staticmethod
    def _own(entries: Entries) -> Entries:
        """A copy made by the calling thread: arrays a worker thread allocated live in its malloc
        arena, where a long-lived candidate would pin the worker's freed temporaries around it."""
        return Entries(entries.row.copy(), entries.col.copy(), entries.weight.copy(), entries.dist2.copy())

    def _compact(self) -> None:
        self.largest = max(self.largest, self.size)
        every = self._pop()
        pieces = _split_rows(every, self.jobs) if self.jobs > 1 and len(every) >= SELECT_SPLIT_MIN else [every]
        del every
        ranked = list(ordered_map(lambda p: (p, *_topk_ranked(p, self.k)), [p for p in pieces if len(p)], self.jobs))
        kept = Entries.concat([p.take(index) for p, index, _rank in ranked])
        rank = np.concatenate([r for _p, _i, r in ranked])
        if self._tau is None:
            self._tau = (np.full(self.n_cells, -np.inf), np.zeros(self.n_cells), np.zeros(self.n_cells, np.int64))
        last = np.flatnonzero(rank == self.k - 1)  # the K-th best of every full row
        rows = kept.row[last]
        self._tau[0][rows], self._tau[1][rows], self._tau[2][rows] = kept.weight[last], kept.dist2[last], kept.col[last]
        self.parts, self.size = [kept], len(kept)
        self._kept = len(kept)
        self.compactions += 1

    def refine(self, keep: Callable[[Entries], Entries]) -> None:
        """Replace what the buffer holds by ``keep`` of it (a filter that only drops entries K others
        beat); entries dropped before reaching any sort no longer count as accepted."""
        dropped = 0
        for i in range(len(self.parts)):  # each part replaced in place: one part's copy at a time, never the buffer's
            kept = keep(self.parts[i])
            if i > 0 or not self.compactions:  # the first part after a compaction was sorted by it
                dropped += len(self.parts[i]) - len(kept)
            self.parts[i] = kept
        self.size = sum(len(p) for p in self.parts)
        self.accepted -= dropped

    def entries(self) -> Entries:
        """Everything the buffer holds, in the order added (after the last compaction)."""
        return Entries.concat(self.parts)

    def select(self) -> Entries:
        """The Top-K of everything added, sorted by ``(row, col)`` (empties the buffer)."""
        self.largest = max(self.largest, self.size)
        return select_topk(self._pop(), self.k, self.jobs)

    def _pop(self) -> Entries:
        every = self.entries()
        self.parts, self.size = [], 0
        return every


# --------------------------------------------------------------------------------------
# the two-pass driver and the contract of a streamed mode
# --------------------------------------------------------------------------------------


class EntryStream(Protocol):
    """A streamed matrix mode, as :func:`stream_topk` drives it (see the module docstring).

    ``blocks()`` is called once; the other methods receive its items. ``count`` and ``collect``
    run in worker threads (they must only read shared state, or use the thread-safe
    :class:`Histogram`); ``fold`` runs in the calling thread, in block order. A stream may give
    pass 1 its own work items with an optional ``count_blocks()`` (e.g. a sampled pass 1 over
    several blocks at once: fewer, larger calls); their units must add up to a pass as well.
    """

    n_cells: int  # rows of the matrix: BEV cells, row-major
    n_frame: int  # rows of the counting frame (>= n_cells, e.g. a padded grid)

    def blocks(self) -> Sequence[Any]: ...

    def work_units(self, block: Any) -> int:
        """Progress units of one block in one pass."""
        ...

    def count(self, block: Any, hist: Histogram, n_bins: int, k: int) -> Any:
        """Pass 1: count every entry of ``block`` into ``hist`` (``(n_frame, n_bins)``) at its frame
        row and score bin (``k > 0``: in ``[0, n_bins)``, non-decreasing along the Top-K order;
        ``k = 0``: ``n_bins = 1``, bin 0). Returns a partial that ``fold`` receives."""
        ...

    def fold(self, partial: Any) -> None:
        """Add one block's partial (row masses, counts of points), in block order."""
        ...

    def cells_of_frame(self, per_frame: npt.NDArray[Any]) -> npt.NDArray[Any]:
        """``(n_frame, ...)`` -> ``(n_cells, ...)``: the frame rows that are BEV cells, row-major."""
        ...

    def total_mass(self, hist_cells: I64) -> F64:
        """``(n_cells,)`` raw weight of every entry of each row (``k > 0``, after pass 1)."""
        ...

    def begin_collect(self, threshold: I64, n_bins: int, k: int) -> None:
        """Before pass 2: the threshold bin of every BEV cell (``(n_cells,)``; ``n_bins`` = keep all)."""
        ...

    def collect(self, block: Any) -> tuple[Entries, int] | tuple[Entries, int, Any]:
        """Pass 2: the entries of ``block`` whose bin is ``<= threshold[row]`` (rows as BEV cells;
        it may also drop entries it can prove K others beat), and the block's points in range.
        With ``k = 0``: every entry, in a fixed order (the row masses are summed in it). A stream
        whose ``collect_folds`` is true (K > 0) adds a third item, a partial that the caller hands
        back, in block order, to its ``fold_collected(entries, partial) -> Entries`` (which adds the
        row masses and the points in range, and returns the entries that can still be in the
        Top-K), is asked ``total_mass`` after pass 2 and may drop candidates once pass 2 is over
        (``refine_candidates(entries) -> Entries``): its pass 1 may count a subset of the entries
        only (the K-th best of any subset is a valid, looser threshold)."""
        ...

    def end_collect(self) -> None:
        """Pass 2 is over: release what it needed (before the final sort)."""
        ...


def _count_block(stream: EntryStream, hist: Histogram, n_bins: int, k: int, block: Any) -> Any:
    return stream.count(block, hist, n_bins, k)


@dataclass
class StreamResult:
    kept: Entries  # the Top-K, sorted by (row, col)
    total_mass: F64  # (n_cells,) raw weight of every entry of each row, before Top-K
    n_candidates: int  # entries that entered the candidate buffer (each reached an exact sort)
    largest_sort: int  # the most entries one exact sort saw
    compactions: int
    phase_seconds: dict[str, float]


def stream_topk(
    stream: EntryStream,
    *,
    k: int,
    n_bins: int,
    jobs: int = 1,
    progress: ProgressFn | None = None,
    check_row_nnz: Callable[[I64], None] | None = None,
    points_in_range: Callable[[], int] | None = None,
) -> StreamResult:
    """The Top-K of ``stream``'s entries in two streamed passes (module docstring).

    K = 0 keeps every entry: pass 1 only counts each row's entries and hands the counts
    (``(n_cells,)`` int64, exactly the final row nnz) to ``check_row_nnz``, which may refuse
    (raise) before pass 2 collects them all. ``points_in_range`` (optional) returns the mode's
    pass-1 count of points in range, checked against pass 2's.
    """
    clock = time.perf_counter()
    phases: dict[str, float] = {}

    def phase(name: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        phases[name] = now - clock
        clock = now

    blocks = stream.blocks()
    bins = n_bins if k > 0 else 1
    folds = k > 0 and bool(getattr(stream, "collect_folds", False))  # row masses summed in pass 2
    hist = Histogram(stream.n_frame, bins, getattr(stream, "hist_dtype", np.int64))
    count = functools.partial(_count_block, stream, hist, bins, k)  # holds hist until the loop ends, not after
    counted = stream.count_blocks() if hasattr(stream, "count_blocks") else blocks  # pass 1's own work items, if the stream has them
    for block, partial in zip(counted, ordered_map(count, counted, jobs), strict=True):
        stream.fold(partial)
        if progress is not None:
            progress(stream.work_units(block))
    del count, counted
    counts = stream.cells_of_frame(hist.total)
    if folds:  # the stream may keep pass 1's counts (its running histogram of pass 2)
        stream.adopt_histogram(hist.total)  # type: ignore[attr-defined]
    del hist  # counts is a view of its table, freed with it below (unless adopted)
    release_free_memory()
    if k > 0:
        threshold = thresholds(counts, k, bins)
        total_mass = np.zeros(0) if folds else stream.total_mass(counts)
        phase("pass1_histogram")
    else:
        phase("pass1_row_counts")
        if check_row_nnz is not None:
            check_row_nnz(counts[:, 0])
        threshold = np.full(stream.n_cells, n_bins, dtype=np.int64)
    del counts
    start_phase(progress, "pass 2/2: collecting Top-K candidates" if k > 0 else "pass 2/2: collecting entries", sum(stream.work_units(b) for b in blocks), "points")
    stream.begin_collect(threshold, n_bins, k)
    buffer = CandidateBuffer(k, stream.n_cells, candidate_budget(stream.n_cells, k) if k else 0, jobs)
    in_range = 0
    for block, collected in zip(blocks, ordered_map(stream.collect, blocks, jobs), strict=True):
        entries, n_in_range = collected[0], collected[1]
        if folds:  # the stream admits the entries in the calling thread, into arrays it allocates there
            entries = stream.fold_collected(entries, collected[2])  # type: ignore[attr-defined, misc]
        buffer.add(entries, owned=folds)
        in_range += n_in_range
        if progress is not None:
            progress(stream.work_units(block))
        del block, entries, collected
    del blocks  # the blocks hold the mode's per-block state (its rays): not needed for the sort
    if folds:  # the stream's final thresholds (tighter than pass 1's), and its row masses, summed in pass 2
        buffer.refine(stream.refine_candidates)  # type: ignore[attr-defined]
        total_mass = stream.total_mass(np.zeros((0, 0), np.int64))
    stream.end_collect()
    release_free_memory()
    phase("pass2_candidates")
    if points_in_range is not None and points_in_range() != in_range:  # pragma: no cover - the passes see the same points
        raise RuntimeError("matrix build: the two passes disagree on the points in range")
    if k == 0:  # every entry was kept, in block order: the row masses are summed in that order
        every = buffer.entries()
        buffer.parts = [every]
        total_mass = np.bincount(every.row, weights=every.weight, minlength=stream.n_cells).astype(np.float64)
        del every
    n_candidates = buffer.accepted
    start_phase(progress, f"selecting the top {k} of {n_candidates:,} candidates" if k > 0 else "sorting the entries")
    kept = buffer.select()
    phase("topk_select")
    return StreamResult(kept, total_mass, n_candidates, buffer.largest, buffer.compactions, phases)
