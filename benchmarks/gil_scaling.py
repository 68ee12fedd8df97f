"""What two worker threads gain on numpy work of the streamed builds' shapes (docs/matrix.md "Ray mode").

The streamed builds run their blocks on ``--jobs`` threads (:func:`bevcompile.parallel.ordered_map`);
numpy releases the GIL inside an operation's loop, so a thread pays a GIL hand-over per call. This
script measures, on this machine, the speedup of two threads over one for:

* a chain of 100 elementwise multiplications per work item, on float64 arrays of 65,536 (a ray-mode
  block's points), 32,768 and 16,384 elements (the same total work);
* ``np.add.at`` of 65,536 keys into an int32 table of 40,000 x 91 counters (ray mode's nearest
  histogram on the dense rig) and of 65,536 float64 values into 40,000 row masses, and the same
  with :func:`bevcompile.matrix.scatter.scatter_add` (the same sums, without the GIL);
* the slowdown of a thread running the 65,536-element chain while another thread scatters
  without pause (``np.add.at`` holds the GIL for a whole call, ``scatter_add`` does not).

Usage::

    .venv/bin/python benchmarks/gil_scaling.py        # ~15 s
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np

from bevcompile.matrix.scatter import scatter_add
from bevcompile.parallel import ordered_map

TOTAL = 1 << 16 << 9  # elements per chain step over all work items


def chain(size: int) -> Callable[[int], float]:
    a = np.random.default_rng(0).random(size)

    def run(_: int) -> float:
        x = a
        for _step in range(100):
            x = x * 1.0000001
        return float(x[0])

    return run


_LOCAL = threading.local()  # one table per thread, allocated once (the scatter alone is timed)
_RNG = np.random.default_rng(1)
KEYS = _RNG.integers(0, 40_000 * 91, 1 << 16)
ROWS, WEIGHTS = _RNG.integers(0, 40_000, 1 << 16), _RNG.random(1 << 16)


def scatter_counts(_: int) -> float:
    if not hasattr(_LOCAL, "table"):
        _LOCAL.table = np.zeros(40_000 * 91, np.int32)
    np.add.at(_LOCAL.table, KEYS, np.int32(1))
    return 0.0


def scatter_masses(_: int) -> float:
    if not hasattr(_LOCAL, "mass"):
        _LOCAL.mass = np.zeros(40_000)
    np.add.at(_LOCAL.mass, ROWS, WEIGHTS)
    return 0.0


def scatter_counts_nogil(_: int) -> float:
    if not hasattr(_LOCAL, "table"):
        _LOCAL.table = np.zeros(40_000 * 91, np.int32)
    scatter_add(_LOCAL.table, KEYS)
    return 0.0


def scatter_masses_nogil(_: int) -> float:
    if not hasattr(_LOCAL, "mass"):
        _LOCAL.mass = np.zeros(40_000)
    scatter_add(_LOCAL.mass, ROWS, WEIGHTS)
    return 0.0


def _scatter_until(scatter: Callable[[int], float], stop: threading.Event) -> None:
    while not stop.is_set():
        scatter(0)


def slowdown(scatter: Callable[[int], float]) -> float:
    """The 65,536-element chain's time (200 items) while another thread scatters, over its time alone."""
    work = chain(1 << 16)
    times = []
    for busy in (False, True):
        stop = threading.Event()
        other = threading.Thread(target=_scatter_until, args=(scatter, stop))
        if busy:
            other.start()
        t0 = time.perf_counter()
        for i in range(200):
            work(i)
        times.append(time.perf_counter() - t0)
        stop.set()
        if busy:
            other.join()
    return times[1] / times[0]


def speedup(fn: Callable[[int], float], items: int) -> tuple[float, float, float]:
    """(one thread s, two threads s, speedup), each the fastest of 3."""
    seconds = []
    for jobs in (1, 2):
        best = np.inf
        for _ in range(3):
            t0 = time.perf_counter()
            list(ordered_map(fn, range(items), jobs))
            best = min(best, time.perf_counter() - t0)
        seconds.append(best)
    return seconds[0], seconds[1], seconds[0] / seconds[1]


def main() -> None:
    print("| work item | items | 1 thread | 2 threads | speedup |")
    print("|---|---:|---:|---:|---:|")
    for size in (1 << 16, 1 << 15, 1 << 14):
        items = TOTAL // size
        one, two, gain = speedup(chain(size), items)
        print(f"| 100 multiplications of {size:,} float64 | {items} | {one:.3f} s | {two:.3f} s | {gain:.2f} |")
    scatters = (
        ("np.add.at, 65,536 int32 counts into 40,000 x 91", scatter_counts),
        ("scatter_add, 65,536 int32 counts into 40,000 x 91", scatter_counts_nogil),
        ("np.add.at, 65,536 float64 into 40,000 row masses", scatter_masses),
        ("scatter_add, 65,536 float64 into 40,000 row masses", scatter_masses_nogil),
    )
    for name, fn in scatters:
        one, two, gain = speedup(fn, 512)
        print(f"| {name} | 512 | {one:.3f} s | {two:.3f} s | {gain:.2f} |")
    print()
    print("| the other thread scatters with | chain time / alone |")
    print("|---|---:|")
    for name, fn in (("np.add.at (float64 row masses)", scatter_masses), ("scatter_add (float64 row masses)", scatter_masses_nogil)):
        print(f"| {name} | {slowdown(fn):.2f} |")


if __name__ == "__main__":
    main()
