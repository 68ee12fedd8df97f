"""The streamed, bounded Top-K selection (``bevcompile.matrix.topk``): the exact rule with ties
(including keys that round together), the shared histogram, the candidate buffer's bound, and the
two-pass driver on a toy mode that plugs in through the ``EntryStream`` contract."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import bevcompile.matrix.topk as topk_mod
from bevcompile.matrix.topk import (
    CandidateBuffer,
    Entries,
    Histogram,
    counts_before,
    local_rows,
    select_topk,
    stream_topk,
    thresholds,
)
from bevcompile.parallel import ordered_map

I64 = np.ndarray


def _brute_force(e: Entries, k: int) -> list[tuple[int, int]]:
    """Per row, sorted() by the documented rule (larger weight, smaller dist2, smaller column)."""
    rows: dict[int, list[tuple[float, float, int]]] = {}
    for r, c, w, d in zip(e.row.tolist(), e.col.tolist(), e.weight.tolist(), e.dist2.tolist(), strict=True):
        rows.setdefault(r, []).append((-w, d, c))
    kept = []
    for r, items in rows.items():
        kept += [(r, c) for _w, _d, c in sorted(items)[: k or None]]
    return sorted(kept)


def _random_entries(seed: int, n: int, n_rows: int, weight_levels: int, dist_levels: int, row_base: int = 0) -> Entries:
    rng = np.random.default_rng(seed)
    row = rng.integers(0, n_rows, n) + row_base
    col = rng.permutation(50 * n)[:n]  # distinct columns: (row, col) unique
    weight = rng.integers(1, weight_levels + 1, n) / weight_levels
    dist2 = rng.integers(0, dist_levels, n) / max(1, dist_levels)
    return Entries(row.astype(np.int64), col.astype(np.int64), weight, dist2)


def _pairs(e: Entries) -> list[tuple[int, int]]:
    return list(zip(e.row.tolist(), e.col.tolist(), strict=True))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(1, 400),
    k=st.integers(0, 9),
    weight_levels=st.integers(1, 4),
    dist_levels=st.integers(1, 3),
    seed=st.integers(0, 10_000),
    jobs=st.sampled_from([1, 3]),
)
def test_select_topk_is_the_rule_with_exact_ties_for_any_jobs(n: int, k: int, weight_levels: int, dist_levels: int, seed: int, jobs: int) -> None:
    """Few distinct weights and distances: most entries tie, so the column decides (the fast path
    of exact ties); rows split over threads give the same entries."""
    e = _random_entries(seed, n, 12, weight_levels, dist_levels)
    old = topk_mod.SELECT_SPLIT_MIN
    topk_mod.SELECT_SPLIT_MIN = 1
    try:
        out = select_topk(e, k, jobs)
    finally:
        topk_mod.SELECT_SPLIT_MIN = old
    assert _pairs(out) == _brute_force(e, k)


@pytest.mark.parametrize("gap", [0.0625, 1e-13])  # 1e-13: distances that round together in the second key too
def test_weight_ties_are_ordered_by_distance_then_column(gap: float) -> None:
    """Nearest splats with a non-uniform depth prior: each row holds many entries of exactly the same
    weight with distinct distances (the weight key cannot order them, the distance must): the
    Top-K is the rule's, and ``_order_runs`` is ``lexsort`` on ``(run, dist2, col)``."""
    rng = np.random.default_rng(4)
    n = 4000
    row = rng.integers(0, 30, n).astype(np.int64)
    weight = rng.integers(1, 4, n) / 64.0  # three exact weights
    dist2 = 0.25 + rng.integers(0, 5, n) * gap
    col = rng.permutation(10 * n)[:n].astype(np.int64)
    e = Entries(row, col, weight, dist2)
    for k in (1, 5, 24, 200):
        assert _pairs(select_topk(e, k)) == _brute_force(e, k)
    run = np.sort(rng.integers(0, 600, n)).astype(np.int64) + 12345
    assert np.array_equal(topk_mod._order_runs(run, dist2, col, 10 * n), np.lexsort((col, dist2, run)))


def test_keys_that_round_together_are_put_in_the_exact_order() -> None:
    """Rows near 2^24 make ``row * span + (primary - min)`` coarser than 1e-9: weights 1e-12 apart
    share a key (a run that is not an exact tie) and must still be ordered by weight, then dist2,
    then column; exact ties in the same rows are ordered by column."""
    rng = np.random.default_rng(3)
    n = 3000
    row = (1 << 24) + rng.integers(0, 4, n)
    weight = 0.5 + rng.integers(0, 6, n) * 1e-12
    weight[::7] = 0.5  # exact ties too
    dist2 = rng.integers(0, 2, n) * 0.25
    e = Entries(row.astype(np.int64), rng.permutation(10 * n)[:n].astype(np.int64), weight, dist2)
    key = e.row * 2.0 + (-e.weight + 0.5)
    assert np.unique(key).size < np.unique(np.stack([e.row, e.weight]), axis=1).shape[1]  # rounding merged some
    for k in (1, 5, 40):
        assert _pairs(select_topk(e, k)) == _brute_force(e, k)


@pytest.mark.parametrize("step", [1024, 7])  # 7: the rows in many steps of THRESHOLD_ROWS, the last one partial
@pytest.mark.parametrize("dtype", [np.int64, np.int32])
def test_thresholds_are_the_bin_of_the_kth_best(step: int, dtype: type, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(topk_mod, "THRESHOLD_ROWS", step)
    rng = np.random.default_rng(0)
    hist = rng.integers(0, 4, (500, 16)).astype(dtype)
    for k in (1, 3, 10, 100):
        t = thresholds(hist, k, 16)
        cum = np.cumsum(hist, axis=1)
        full = cum[:, -1] >= k
        assert np.all(t[~full] == 15)
        rows = np.flatnonzero(full)
        assert np.all(cum[rows, t[rows]] >= k)
        assert np.all((t[rows] == 0) | (cum[rows, np.maximum(t[rows] - 1, 0)] < k))


@pytest.mark.parametrize("step", [1024, 7])
def test_counts_before_sums_each_rows_bins_below_its_own(step: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(topk_mod, "THRESHOLD_ROWS", step)
    rng = np.random.default_rng(3)
    hist = rng.integers(0, 5, (300, 12)).astype(np.int32)
    rows = rng.permutation(300)[:200]
    bins = rng.integers(0, 13, 200)  # 0 (nothing before) to n_bins (the whole row)
    got = counts_before(hist, rows, bins)
    assert got.dtype == np.int64
    assert got.tolist() == [int(hist[r, :b].sum()) for r, b in zip(rows.tolist(), bins.tolist(), strict=True)]


@pytest.mark.parametrize("dtype", [np.int64, np.int32])
@pytest.mark.parametrize("jobs", [1, 4])
def test_histogram_counts_every_key_whoever_adds_it(jobs: int, dtype: type) -> None:
    rng = np.random.default_rng(1)
    n_rows, n_bins = 300, 8
    keys = rng.integers(0, n_rows * n_bins, 20_000)
    hist = Histogram(n_rows, n_bins, dtype)

    def add(chunk: I64) -> None:
        if chunk[0] % 3 == 0:
            hist.add(chunk.copy())
        elif chunk[0] % 3 == 1:
            hist.add_scattered(chunk)
        else:
            rows, local = local_rows(chunk // n_bins, n_rows)
            hist.add_local(rows, local * n_bins + chunk % n_bins)

    list(ordered_map(add, np.array_split(keys, 37), jobs))
    assert hist.total.dtype == dtype
    assert np.array_equal(hist.total.ravel(), np.bincount(keys, minlength=n_rows * n_bins))


def test_local_rows_scan_and_sort_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    index = np.random.default_rng(2).integers(0, 5000, 700)
    scan = local_rows(index, 5000)
    monkeypatch.setattr(topk_mod, "LOCAL_SCAN_RATIO", 1)
    sort = local_rows(index, 5000)
    for a, b in zip(scan, sort, strict=True):
        assert a.dtype == b.dtype == np.int64 and np.array_equal(a, b)
    assert np.array_equal(scan[0][scan[1]], index) and np.all(np.diff(scan[0]) > 0)


# --------------------------------------------------------------------------------------
# a toy mode through the EntryStream contract
# --------------------------------------------------------------------------------------


class ToyStream:
    """Explicit entries in blocks of ``chunk``, order score ``1 - weight`` (weights in (0, 1])."""

    def __init__(self, entries: Entries, n_cells: int, n_bins: int, chunk: int) -> None:
        self.e, self.n_cells, self.n_frame, self.n_bins = entries, n_cells, n_cells, n_bins
        self._blocks = [(i, min(i + chunk, len(entries))) for i in range(0, len(entries), chunk)]
        self.mass = np.zeros(n_cells)
        self.threshold = np.zeros(0, np.int64)
        self.k = 0

    def _bin(self, weight: np.ndarray) -> I64:
        return np.minimum(((1.0 - weight) * self.n_bins).astype(np.int64), self.n_bins - 1)

    def blocks(self) -> list[tuple[int, int]]:
        return self._blocks

    def work_units(self, block: tuple[int, int]) -> int:
        return block[1] - block[0]

    def count(self, block: tuple[int, int], hist: Histogram, n_bins: int, k: int) -> np.ndarray:
        e = self.e.take(slice(*block))
        rows, local = local_rows(e.row, self.n_cells)
        hist.add_local(rows, local * n_bins + self._bin(e.weight) if k else local)
        return np.bincount(e.row, weights=e.weight, minlength=self.n_cells)

    def fold(self, partial: np.ndarray) -> None:
        self.mass += partial

    def cells_of_frame(self, per_frame: Any) -> Any:
        return per_frame

    def total_mass(self, hist_cells: I64) -> np.ndarray:
        return self.mass

    def begin_collect(self, threshold: I64, n_bins: int, k: int) -> None:
        self.threshold, self.k = threshold, k

    def collect(self, block: tuple[int, int]) -> tuple[Entries, int]:
        e = self.e.take(slice(*block))
        return (e.take(self._bin(e.weight) <= self.threshold[e.row]) if self.k else e), len(e)

    def end_collect(self) -> None:
        pass


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(1, 1500),
    k=st.integers(0, 6),
    weight_levels=st.integers(1, 3),
    chunk=st.integers(7, 300),
    budget=st.integers(1, 60),
    jobs=st.sampled_from([1, 2, 5]),
    seed=st.integers(0, 10_000),
)
def test_stream_topk_is_exact_and_bounded_for_any_distribution(
    n: int, k: int, weight_levels: int, chunk: int, budget: int, jobs: int, seed: int
) -> None:
    """Heavy exact ties (1 to 3 weights, 2 distances), blocks in any order of goodness, a tiny
    buffer budget: the result is the rule's, whatever ``jobs``; no exact sort sees more than the
    budget (or twice rows x K, when that is more) plus one block; the row masses are summed in
    block order (K = 0: over the candidates, in block order)."""
    e = _random_entries(seed, n, 20, weight_levels, 2)
    if seed % 3 == 0:  # adversarial arrival: worst entries first
        e = e.take(np.lexsort((-e.col, -e.dist2, e.weight)))
    old = (topk_mod.CANDIDATE_BUDGET_MIN, topk_mod.CANDIDATE_BUDGET_PER_SLOT)
    topk_mod.CANDIDATE_BUDGET_MIN, topk_mod.CANDIDATE_BUDGET_PER_SLOT = budget, 0
    try:
        stream = ToyStream(e, 20, 4, chunk)
        result = stream_topk(stream, k=k, n_bins=4, jobs=jobs)
    finally:
        topk_mod.CANDIDATE_BUDGET_MIN, topk_mod.CANDIDATE_BUDGET_PER_SLOT = old
    assert _pairs(result.kept) == _brute_force(e, k)
    assert result.largest_sort <= (max(budget, 2 * 20 * k) + chunk if k else n)
    assert result.n_candidates >= len(result.kept)
    mass = np.zeros(20)  # K > 0: the mode's pass-1 block sums, folded in block order
    for lo, hi in stream.blocks():
        mass += np.bincount(e.row[lo:hi], weights=e.weight[lo:hi], minlength=20)
    if k == 0:  # every entry kept: one sum over the candidates in block order
        mass = np.bincount(e.row, weights=e.weight, minlength=20)
    assert np.array_equal(result.total_mass, mass)


class GroupedCountStream(ToyStream):
    """Pass 1 over its own work items (``count_blocks``): pairs of consecutive blocks."""

    def __init__(self, entries: Entries, n_cells: int, n_bins: int, chunk: int) -> None:
        super().__init__(entries, n_cells, n_bins, chunk)
        self.counted: list[tuple[int, int]] = []

    def count_blocks(self) -> list[tuple[int, int]]:
        b = self._blocks
        return [(b[i][0], b[min(i + 1, len(b) - 1)][1]) for i in range(0, len(b), 2)]

    def count(self, block: tuple[int, int], hist: Histogram, n_bins: int, k: int) -> np.ndarray:
        self.counted.append(block)
        return super().count(block, hist, n_bins, k)


@pytest.mark.parametrize(("k", "jobs"), [(0, 1), (3, 1), (3, 2)])
def test_pass1_runs_over_the_streams_own_count_blocks(k: int, jobs: int) -> None:
    """A stream with ``count_blocks`` is counted over those items (here pairs of its blocks) and
    collected over its blocks: the Top-K (and the K = 0 row counts) are the rule's."""
    e = _random_entries(11, 900, 20, 3, 2)
    stream = GroupedCountStream(e, 20, 4, 50)
    result = stream_topk(stream, k=k, n_bins=4, jobs=jobs)
    assert sorted(stream.counted) == stream.count_blocks() and len(stream.counted) < len(stream.blocks())
    assert _pairs(result.kept) == _brute_force(e, k)


def test_the_buffer_compacts_to_the_topk_and_then_admits_only_better_entries() -> None:
    e = _random_entries(5, 4000, 10, 2, 2)
    buffer = CandidateBuffer(3, 10, budget=100)
    for part in np.array_split(np.arange(len(e)), 80):
        buffer.add(e.take(part))
        assert buffer.size <= 100 + 50  # at most the budget plus one block
    assert buffer.compactions > 0 and buffer.accepted < len(e)
    assert _pairs(buffer.select()) == _brute_force(e, 3)


def test_refine_keeps_what_the_filter_keeps_and_uncounts_only_unsorted_drops() -> None:
    """``CandidateBuffer.refine``: the buffer holds the filter's output; entries dropped before any
    sort leave ``accepted``, those a compaction already sorted stay counted; the Top-K is unchanged
    when the filter only drops entries K others beat (here: every entry outside the Top-K)."""
    e = _random_entries(6, 3000, 10, 3, 3)
    top = select_topk(e, 3)
    want = _pairs(top)
    n_cols = int(e.col.max()) + 1
    in_top = set((top.row * n_cols + top.col).tolist())

    def keep(p: Entries) -> Entries:
        return p.take(np.isin(p.row * n_cols + p.col, list(in_top)))

    for budget in (10**6, 200):  # without, then with, compactions
        buffer = CandidateBuffer(3, 10, budget=budget)
        for part in np.array_split(np.arange(len(e)), 30):
            buffer.add(e.take(part))
        before, compacted = buffer.accepted, buffer.compactions
        unsorted = sum(len(p) for p in buffer.parts[1 if compacted else 0 :])
        unsorted_kept = sum(len(keep(p)) for p in buffer.parts[1 if compacted else 0 :])
        buffer.refine(keep)
        assert buffer.size == len(buffer.entries()) == len(top)
        assert buffer.accepted == before - (unsorted - unsorted_kept)
        assert (compacted > 0) == (budget == 200)
        assert _pairs(buffer.select()) == want
