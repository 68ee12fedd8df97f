"""Rich output helpers: progress bars on stderr, tables and JSON on stdout."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from rich.console import Console, ConsoleOptions, ConsoleRenderable, RenderHook
from rich.progress import (
    BarColumn,
    Progress,
    ProgressColumn,
    Task,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.segment import Segment
from rich.table import Table
from rich.text import Text

from ..errors import printable

LOG_WIDTH = 120
"""Table width when the output is not a terminal (CI logs, pipes); rich's default there is 80,
which folds the store tables. ``COLUMNS`` overrides it."""


def escape_controls(text: str) -> str:
    """``text`` with every control or format character but the line break shown escaped
    (``\\x1b``), as error lines show them: a folder named with an ESC must not drive the terminal."""
    if text.isprintable() or all(ch.isprintable() or ch == "\n" for ch in text):
        return text
    return "\n".join(printable(part, max(len(part) * 6, 1)) for part in text.split("\n"))


class _Escaped:
    """A renderable drawn as ``renderable`` with its text's control characters escaped."""

    def __init__(self, renderable: Any) -> None:
        self.renderable = renderable

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> Iterator[Segment]:
        for segment in console.render(self.renderable, options):
            yield segment if segment.control else Segment(escape_controls(segment.text), segment.style)


class _EscapeControls(RenderHook):
    """Every renderable printed on a console of this module goes through :class:`_Escaped`: the
    one place where a path, a camera or a config value reaches the terminal."""

    def process_renderables(self, renderables: list[ConsoleRenderable]) -> list[ConsoleRenderable]:
        return [_Escaped(r) for r in renderables]


def _console(stderr: bool) -> Console:
    stream = sys.stderr if stderr else sys.stdout
    width = None if stream.isatty() or os.environ.get("COLUMNS") else LOG_WIDTH
    console = Console(stderr=stderr, soft_wrap=True, width=width)
    console.push_render_hook(_EscapeControls())
    return console


stdout_console = _console(stderr=False)
stderr_console = _console(stderr=True)


class _CountColumn(ProgressColumn):
    """``1,234,567 / 2,000,000 points`` (thousands separators; the phase's unit)."""

    def render(self, task: Task) -> Text:
        unit = task.fields.get("unit", "")
        if task.total is None:  # a pulsing phase: a count only once there is one
            return Text(f"{int(task.completed):,} {unit}".rstrip() if task.completed else "", style="progress.download")
        return Text(f"{int(task.completed):,} / {int(task.total):,} {unit}".rstrip(), style="progress.download")


class _RateColumn(ProgressColumn):
    """``12.3 M points/s`` (SI prefix; blank until rich has a speed estimate)."""

    def render(self, task: Task) -> Text:
        speed = task.finished_speed or task.speed
        if speed is None or task.total is None:
            return Text("")
        unit = task.fields.get("unit", "") or "units"
        for factor, prefix in ((1e9, "G "), (1e6, "M "), (1e3, "k "), (1.0, "")):
            if speed >= factor or factor == 1.0:
                return Text(f"{speed / factor:.1f} {prefix}{unit}/s", style="progress.data.speed")
        return Text("")  # pragma: no cover


class ProgressBar:
    """The callable a CLI command hands to the library: ``bar(n)`` advances the current phase;
    ``bar.phase(label, total, unit)`` (see :func:`bevcompile.progress.start_phase`) ends it and
    starts the next, labelled and counted on its own."""

    def __init__(self, progress: Progress | None, label: str, total: int | None, unit: str) -> None:
        self._progress = progress
        self._task: TaskID | None = None
        if progress is not None:
            self.phase(label, total, unit)

    def __call__(self, n: int) -> None:
        if self._progress is not None and self._task is not None:
            self._progress.advance(self._task, n)

    def phase(self, label: str, total: int | None, unit: str = "") -> None:
        if self._progress is None:
            return
        if self._task is not None:
            self._progress.remove_task(self._task)
        self._task = self._progress.add_task(label, total=total, unit=unit)


def _columns() -> tuple[ProgressColumn, ...]:
    return (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        _CountColumn(),
        _RateColumn(),
        TimeRemainingColumn(compact=True, elapsed_when_finished=True),
        TextColumn("elapsed"),
        TimeElapsedColumn(),
    )


@contextmanager
def progress_bar(label: str, total: int | None, enabled: bool = True, unit: str = "", console: Console | None = None) -> Iterator[ProgressBar]:
    """Yield a :class:`ProgressBar` drawing a transient rich bar on stderr: label, bar, count with
    thousands separators and ``unit``, rate, ETA and elapsed time (``total=None``: a pulsing bar
    with the count and the elapsed time, for work whose size is not known up front). Nothing is
    drawn when ``enabled`` is false or stderr is not a terminal."""
    console = console or stderr_console
    if not enabled or not console.is_terminal:
        yield ProgressBar(None, label, total, unit)
        return
    with Progress(*_columns(), console=console, transient=True) as progress:
        yield ProgressBar(progress, label, total, unit)


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


def known(value: Any) -> str:
    """A store's recorded identity field for a header: ``?`` where the store does not say."""
    return "?" if value is None else str(value)


def human_bytes(n: int | float) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def new_table(title: str, *columns: str, right: tuple[str, ...] = (), no_wrap: tuple[str, ...] = ()) -> Table:
    """A result table: ``right`` columns right-aligned, ``no_wrap`` columns never folded (names that
    must stay one piece; the other columns fold long cells)."""
    table = _Table(title=escape_controls(title), title_justify="left", header_style="bold", pad_edge=False)
    for column in columns:
        table.add_column(column, justify="right" if column in right else "left", overflow="fold", no_wrap=column in no_wrap)
    return table


class _Table(Table):
    """A table whose text cells are escaped before layout (so an escaped ESC keeps the columns aligned)."""

    def add_row(self, *renderables: Any, **kwargs: Any) -> None:
        super().add_row(*(escape_controls(r) if isinstance(r, str) else r for r in renderables), **kwargs)


def print_table(table: Table) -> None:
    stdout_console.print(table)


def note_dropped_groups(store: Any, dropped: Iterable[str]) -> None:
    """On stderr (also under --quiet/--json: a CI log must show lost tables): the groups a
    ``--force`` replacement of another config's store did not keep."""
    names = [f"{name}/" for name in dropped]
    if names:
        print(
            f"note: --force replaced {store} (built from another config) and dropped its group(s) {', '.join(names)}; "
            "this command does not rebuild them",
            file=sys.stderr,
            flush=True,
        )


def stderr_lines(lines: Iterable[str]) -> None:
    """One plain line per failure on stderr (no rich wrapping: CI greps these), each as every
    error line: control characters escaped, at most 1,000 characters with the store path."""
    for line in lines:
        print(printable(line), file=sys.stderr)
    sys.stderr.flush()


def compact_json(value: Any, width: int) -> str:
    """``value`` as one line of JSON, cut to ``width`` characters with an ellipsis."""
    text = json.dumps(value, separators=(", ", ": "), default=str)
    return text if len(text) <= width else text[: width - 1] + "…"
