"""Progress from library code to whoever shows it, without a dependency on rich.

A long-running library function takes ``progress: ProgressFn | None``. It calls ``progress(n)``
each time it completes ``n`` units of the current phase, and :func:`start_phase` when a new,
separately counted phase begins (``"pass 2/2: Top-K select"``, ``"writing store"``). A plain
callable (a counter in a test, a lambda) ignores phases; the CLI's bars
(:func:`bevcompile.cli._output.progress_bar`) show each phase with its label, count, rate and ETA.
"""

from __future__ import annotations

from collections.abc import Callable

ProgressFn = Callable[[int], None]


def start_phase(progress: ProgressFn | None, label: str, total: int | None = None, unit: str = "") -> None:
    """Begin a new phase on ``progress``: ``total`` units (None: unknown, a pulsing bar) of ``unit``
    (plural noun, e.g. ``"points"``). A no-op for a progress callable that has no ``phase``."""
    phase = getattr(progress, "phase", None)
    if callable(phase):
        phase(label, total, unit)
