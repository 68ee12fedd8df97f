"""``--jobs``: how many cores a build uses, and the one way work is spread over them.

Every parallel build in bevcompile (``matrix``, ``export-interop``) splits its work into a fixed,
deterministic list of items (camera / depth-bin blocks) that depends only on the input, never on
the job count, and runs them with :func:`ordered_map`: a pool of ``jobs`` threads computes the
items (numpy releases the GIL inside its array loops, so the threads run on separate cores) while
the calling thread receives the results **in item order** and folds them (sums in a fixed order,
appends in a fixed order). The output is therefore the same bytes for every ``jobs``; only the
wall time changes. ``jobs = 1`` runs the items in the calling thread, without a pool.

Threads rather than processes: the items share the rig's rays and the per-row tables read-only
(no copies, no pickling), and the peak memory grows by one item's temporaries per extra job,
not by one process image per job. See ``docs/matrix.md`` ("All cores") for the measured scaling.
"""

from __future__ import annotations

import itertools
import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

from .errors import UsageError

T = TypeVar("T")
R = TypeVar("R")

MAX_JOBS = 1024
WINDOW_PER_JOB = 2
"""Items submitted ahead of the one the caller waits for, per job (bounds the results held)."""


def default_jobs() -> int:
    """The cores this process may run on (its CPU affinity where the OS has one, else the CPU count)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # pragma: no cover - macOS / Windows
        return max(1, os.cpu_count() or 1)


def resolve_jobs(jobs: int | None) -> int:
    """``jobs`` checked (an integer in ``[1, MAX_JOBS]``), or :func:`default_jobs` for ``None``.

    Raises :class:`UsageError` (one line, ``--jobs`` as the CLI spells it) for anything else."""
    if jobs is None:
        return default_jobs()
    if isinstance(jobs, bool) or not isinstance(jobs, int) or not 1 <= jobs <= MAX_JOBS:
        raise UsageError(f"--jobs must be an integer in [1, {MAX_JOBS}], got {jobs!r}")
    return jobs


def ordered_map(fn: Callable[[T], R], items: Iterable[T], jobs: int) -> Iterator[R]:
    """``fn(item)`` for every item, yielded in item order, computed by ``jobs`` threads.

    At most ``WINDOW_PER_JOB * jobs`` items are submitted ahead of the one being yielded, so the
    results waiting for the caller stay bounded however many items there are. An exception in
    ``fn`` is raised here, at its item; closing the iterator early (or an exception in the
    caller) cancels the items not yet started and waits for the running ones.
    """
    if jobs <= 1:
        for item in items:
            yield fn(item)
        return
    source = iter(items)
    with ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="bevcompile") as pool:
        pending: deque[Future[R]] = deque(pool.submit(fn, item) for item in itertools.islice(source, WINDOW_PER_JOB * jobs))
        try:
            while pending:
                result = pending.popleft().result()
                for item in itertools.islice(source, 1):
                    pending.append(pool.submit(fn, item))
                yield result
        finally:
            for future in pending:
                future.cancel()
