"""``--jobs``: its one-line errors, the default, and the ordered thread map every parallel build
folds its results with (in item order, bounded look-ahead, errors at their item)."""

from __future__ import annotations

import threading
import time

import pytest

from bevcompile.errors import UsageError
from bevcompile.parallel import MAX_JOBS, WINDOW_PER_JOB, default_jobs, ordered_map, resolve_jobs


def test_default_jobs_are_the_cores_this_process_may_use() -> None:
    import os

    want = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert default_jobs() == want >= 1
    assert resolve_jobs(None) == want
    assert resolve_jobs(1) == 1 and resolve_jobs(MAX_JOBS) == MAX_JOBS


@pytest.mark.parametrize("bad", [0, -3, MAX_JOBS + 1, True, 2.0, "2"])
def test_bad_jobs_are_a_one_line_usage_error(bad: object) -> None:
    with pytest.raises(UsageError) as info:
        resolve_jobs(bad)  # type: ignore[arg-type]
    assert str(info.value) == f"--jobs must be an integer in [1, {MAX_JOBS}], got {bad!r}"


@pytest.mark.parametrize("jobs", [1, 2, 3, 8])
def test_results_come_in_item_order_whatever_order_the_threads_finish(jobs: int) -> None:
    def slow_for_early_items(i: int) -> tuple[int, str]:
        time.sleep(0.002 * ((7 * i) % 5))
        return i * i, threading.current_thread().name

    results = list(ordered_map(slow_for_early_items, range(40), jobs))
    assert [r[0] for r in results] == [i * i for i in range(40)]
    names = {r[1] for r in results}
    if jobs == 1:
        assert names == {threading.current_thread().name}  # no pool: the caller's thread
    else:
        assert all(name.startswith("bevcompile") for name in names) and len(names) <= jobs


def test_look_ahead_is_bounded_by_the_window() -> None:
    jobs = 2
    started: list[int] = []
    lock = threading.Lock()

    def record(i: int) -> int:
        with lock:
            started.append(i)
        return i

    seen = []
    for value in ordered_map(record, range(100), jobs):
        time.sleep(0.001)
        with lock:
            assert max(started) <= value + WINDOW_PER_JOB * jobs  # never more than the window ahead
        seen.append(value)
    assert seen == list(range(100)) and sorted(started) == list(range(100))


@pytest.mark.parametrize("jobs", [1, 3])
def test_an_error_surfaces_at_its_item_and_later_items_are_not_started(jobs: int) -> None:
    calls: list[int] = []
    lock = threading.Lock()

    def fail_at_5(i: int) -> int:
        with lock:
            calls.append(i)
        if i == 5:
            raise ValueError("item 5")
        return i

    got = []
    with pytest.raises(ValueError, match="item 5"):
        for value in ordered_map(fail_at_5, range(1000), jobs):
            got.append(value)
    assert got == [0, 1, 2, 3, 4]
    assert max(calls) < 5 + WINDOW_PER_JOB * jobs + 1  # the pending items were cancelled, not run


def test_closing_early_cancels_the_rest() -> None:
    calls: list[int] = []

    def record(i: int) -> int:
        calls.append(i)
        return i

    iterator = ordered_map(record, range(1000), 2)
    assert next(iterator) == 0
    iterator.close()  # type: ignore[attr-defined]
    assert len(calls) <= 1 + WINDOW_PER_JOB * 2
