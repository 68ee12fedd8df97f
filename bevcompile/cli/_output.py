"""Rich output helpers: progress bars on stderr, tables and JSON on stdout."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

LOG_WIDTH = 120
"""Table width when the output is not a terminal (CI logs, pipes); rich's default there is 80,
which folds the store tables. ``COLUMNS`` overrides it."""


def _console(stderr: bool) -> Console:
    stream = sys.stderr if stderr else sys.stdout
    width = None if stream.isatty() or os.environ.get("COLUMNS") else LOG_WIDTH
    return Console(stderr=stderr, soft_wrap=True, width=width)


stdout_console = _console(stderr=False)
stderr_console = _console(stderr=True)


@contextmanager
def progress_bar(label: str, total: int | None, enabled: bool = True) -> Iterator[Callable[[int], None]]:
    """Yield an ``advance(n)`` callback drawing a transient rich bar on stderr (``total=None``:
    a pulsing bar with the elapsed time, for work whose size is not known up front)."""
    if not enabled or not stderr_console.is_terminal:
        yield lambda n: None
        return
    counter = (MofNCompleteColumn(),) if total is not None else ()  # no "0/?" on a pulsing bar
    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        *counter,
        TimeElapsedColumn(),
        console=stderr_console,
        transient=True,
    ) as progress:
        task = progress.add_task(label, total=total)
        yield lambda n: progress.advance(task, n)


def print_json(data: Any) -> None:
    """Strict JSON on stdout: NaN and infinities (a PSNR of identical arrays, a tampered
    attribute echoed in a report) are written as ``null``."""
    sys.stdout.write(json.dumps(_finite(data), indent=2, allow_nan=False, default=_default) + "\n")
    sys.stdout.flush()


def _finite(value: Any) -> Any:
    import math

    import numpy as np

    if isinstance(value, float | np.floating):
        return float(value) if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    if isinstance(value, np.ndarray):
        return _finite(value.tolist())
    if hasattr(value, "items") and not isinstance(value, str | bytes):  # read-only mappings (zarr attrs)
        return {k: _finite(v) for k, v in value.items()}
    return value


def _default(value: Any) -> Any:
    import numpy as np

    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return str(value)


def human_bytes(n: int | float) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def new_table(title: str, *columns: str, right: tuple[str, ...] = ()) -> Table:
    table = Table(title=title, title_justify="left", header_style="bold", pad_edge=False)
    for column in columns:
        table.add_column(column, justify="right" if column in right else "left", overflow="fold")
    return table


def print_table(table: Table) -> None:
    stdout_console.print(table)


def stderr_lines(lines: Iterable[str]) -> None:
    """One plain line per failure on stderr (no rich wrapping: CI greps these)."""
    for line in lines:
        print(" ".join(line.split()), file=sys.stderr)
    sys.stderr.flush()


def compact_json(value: Any, width: int) -> str:
    """``value`` as one line of JSON, cut to ``width`` characters with an ellipsis."""
    text = json.dumps(value, separators=(", ", ": "), default=str)
    return text if len(text) <= width else text[: width - 1] + "…"
