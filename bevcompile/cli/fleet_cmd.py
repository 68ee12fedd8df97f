"""``bevcompile fleet MANIFEST --out DIR``: every vehicle's stores in one command (Dask), and
``bevcompile fleet-report DIR``: the summary and the flagged vehicles of a fleet index."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape

from ..errors import CheckFailed
from ._app import Terminated, cli_command, fail
from ._options import JsonOption, QuietOption
from ._output import human_bytes, new_table, print_json, print_table, stderr_console, stderr_lines, stdout_console

MaxShiftOption = Annotated[
    float | None,
    typer.Option("--max-shift-px", help="Flag a vehicle when a camera's max sampling shift against the reference exceeds X feature pixels (as bevcompile diff).", show_default=False),
]
MaxCoverageOption = Annotated[
    float | None,
    typer.Option("--max-coverage-change", help="Flag a vehicle when a camera loses or gains more than this fraction of its BEV cells against the reference.", show_default=False),
]
LISTED = 20
"""Failed and flagged vehicles listed in the summary (all of them are in fleet.json / --json)."""


@contextmanager
def _vehicle_progress(enabled: bool) -> Iterator[Any]:
    """A rich bar over vehicles: done / total, failed, rate (vehicles per minute), elapsed and ETA."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    class Bar:
        def __init__(self, progress: Any) -> None:
            self.progress, self.task, self.failed, self.flagged = progress, None, 0, 0

        def start(self, total: int) -> None:
            if self.progress is not None:
                self.task = self.progress.add_task("vehicles", total=total, failed="", rate="")

        def advance(self, result: Any) -> None:
            self.failed += result.status == "failed"
            self.flagged += bool(result.flags)
            if self.progress is None or self.task is None:
                return
            self.progress.advance(self.task, 1)
            task = self.progress.tasks[0]
            rate = f"{60 * task.completed / task.elapsed:.1f} vehicles/min" if task.elapsed else ""
            note = f"[red]{self.failed} failed[/red]" if self.failed else "0 failed"
            if self.flagged:
                note += f", [yellow]{self.flagged} flagged[/yellow]"
            self.progress.update(self.task, failed=note, rate=rate)

    if not enabled or not stderr_console.is_terminal:
        yield Bar(None)
        return
    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[failed]}"),
        TextColumn("{task.fields[rate]}"),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        console=stderr_console,
        transient=True,
    ) as progress:
        yield Bar(progress)


@cli_command("fleet", short_help="Compile the stores of every vehicle of a fleet manifest (Dask: local processes or a cluster).")
def fleet(
    manifest: Annotated[Path, typer.Argument(help="Fleet manifest YAML (products, template, vehicles; docs/fleet.md).", show_default=False, metavar="MANIFEST")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Output folder: <out>/<id>.zarr per vehicle, rigs/<id>.yaml, fleet.json, fleet.csv.")],
    workers: Annotated[
        int | None, typer.Option("--workers", help="Worker processes of the embedded LocalCluster (default: the cores).", show_default=False)
    ] = None,
    scheduler: Annotated[
        str | None,
        typer.Option("--scheduler", help="Run on an existing Dask cluster (tcp://HOST:PORT); --out must be shared storage every worker mounts at the same path.", show_default=False, metavar="ADDRESS"),
    ] = None,
    resume: Annotated[
        bool, typer.Option("--resume", help="Keep stores that already hold the same config, build options and tool version and pass inspect.")
    ] = False,
    no_inspect: Annotated[
        bool,
        typer.Option("--no-inspect", help="Do not run inspect on each new store before it is put in place (faster; run bevcompile inspect OUT after). --resume still inspects the stores it keeps."),
    ] = False,
    max_shift_px: MaxShiftOption = None,
    max_coverage_change: MaxCoverageOption = None,
    quiet: QuietOption = False,
    json_output: JsonOption = False,
) -> None:
    """Compile every vehicle of MANIFEST into <out>/<id>.zarr, byte-identical to the single commands
    on its resolved config (<out>/rigs/<id>.yaml), each store checked by inspect and put in place
    atomically. A failing vehicle is recorded and the fleet goes on. Exit 0 when every vehicle is
    built (or resumed) and none is flagged, 1 otherwise (the counts, and one line per failed or
    flagged vehicle, on stderr), 2 for a bad manifest or engine setup."""
    from ..fleet.engine import check_engine_options, run_fleet
    from ..fleet.manifest import load_manifest

    check_engine_options(workers, scheduler)
    spec = load_manifest(manifest)
    try:
        with _vehicle_progress(not (quiet or json_output)) as bar:
            run = run_fleet(
                spec, out, workers=workers, scheduler=scheduler, resume=resume, inspect=not no_inspect, max_shift_px=max_shift_px,
                max_coverage_change=max_coverage_change, on_start=bar.start, on_result=bar.advance,
            )
    except (KeyboardInterrupt, Terminated) as exc:
        raise _interrupted(exc, out) from None
    index = run.index
    if json_output:
        print_json(index.to_json())
    elif not quiet:
        print_summary(index)
        stdout_console.print(f"wrote [bold]{escape(str(run.path))}[/bold] and fleet.csv ({run.seconds:.1f} s)")
    _fail_on(index, str(run.path))


def _interrupted(exc: BaseException, out: Path) -> typer.Exit:
    """One line for a stopped fleet: what was built, what was cancelled, that every store is whole."""
    from ..fleet.engine import INDEX_ATTR
    from ..fleet.index import INDEX_JSON

    what = "terminated (SIGTERM)" if isinstance(exc, Terminated) else "interrupted"
    index = getattr(exc, INDEX_ATTR, None)
    if index is None:
        return fail(f"{what} before any vehicle was started; nothing was written", 143 if isinstance(exc, Terminated) else 130)
    counts = index.counts
    done = counts["built"] + counts["resumed"]
    return fail(
        f"{what}; {done} of {counts['total']} vehicles done ({counts['built']} built), {counts['failed']} failed, "
        f"{counts['cancelled'] + counts['pending']} cancelled; every store is whole (old or new, never half); index {out / INDEX_JSON}",
        143 if isinstance(exc, Terminated) else 130,
    )


def _fail_on(index: Any, where: str) -> None:
    """One stderr line per failed / flagged / unfinished vehicle, then exit 1 with the counts."""
    lines = [f"{v.id}: {v.error}" for v in index.failed]
    lines += [f"{v.id}: flagged: {'; '.join(v.flags)}" for v in index.flagged]
    lines += [f"{v.id}: {v.status}: {v.error}" for v in index.incomplete]
    stderr_lines(lines)
    counts = index.counts
    if lines:
        parts = [f"{counts['failed']} failed"] if counts["failed"] else []
        parts += [f"{counts['flagged']} flagged"] if counts["flagged"] else []
        unfinished = counts["cancelled"] + counts["pending"]
        parts += [f"{unfinished} not built"] if unfinished else []
        raise CheckFailed(f"fleet: {', '.join(parts)} of {counts['total']} vehicles (see {where})")


def _fraction(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.2f} %"


def _row(label: str, values: Any, fmt: Any) -> list[str]:
    from ..fleet.index import distribution

    spread = distribution(values)
    if spread is None:
        return [label, "–", "–", "–"]
    return [label, *(fmt(v) for v in spread)]


def print_summary(index: Any) -> None:
    """The compact tables of a fleet: counts, the figures over the fleet, failed and flagged vehicles."""
    from ..fleet.index import camera_coverage

    counts = index.counts
    run = index.run
    engine = run.get("engine") or {}
    where = engine.get("scheduler", "?")
    engine_text = f"LocalCluster, {engine.get('workers')} workers" if where == "local" else f"{where}, {engine.get('workers')} workers"
    table = new_table(
        f"fleet {escape(Path(str(run.get('manifest', '?'))).name)}: {counts['total']} vehicles, reference {escape(str(run.get('reference')))}, {escape(engine_text)}",
        "built", "resumed", "failed", "cancelled", "flagged", "wall time", "vehicles/min",
        right=("built", "resumed", "failed", "cancelled", "flagged", "wall time", "vehicles/min"),
    )
    seconds = float(run.get("seconds") or 0.0)
    done = counts["built"] + counts["resumed"]
    rate = f"{60 * done / seconds:.1f}" if seconds > 0 and done else "–"
    table.add_row(
        str(counts["built"]), str(counts["resumed"]), str(counts["failed"]), str(counts["cancelled"] + counts["pending"]),
        str(counts["flagged"]), f"{seconds:.1f} s", rate,
    )
    print_table(table)
    ok = [v for v in index.vehicles if v.ok]
    if ok:
        figures = new_table("figures over the built vehicles", "figure", "min", "median", "max", right=("min", "median", "max"))
        figures.add_row(*_row("coverage, worst camera", [min(camera_coverage(v).values(), default=None) for v in ok], _fraction))
        figures.add_row(*_row("Top-K kept weight", [(v.kept_weight or {}).get("total") for v in ok], _fraction))
        figures.add_row(*_row("delta-LUT / norm_int16 bytes", [v.delta_ratio for v in ok], _fraction))
        figures.add_row(*_row("shift vs reference, max \\[px]", [(v.shift or {}).get("max_px") for v in ok if not (v.shift or {}).get("is_reference")], lambda x: f"{x:.4g}"))
        figures.add_row(*_row("coverage change vs reference", [(v.shift or {}).get("coverage_change_max") for v in ok if not (v.shift or {}).get("is_reference")], _fraction))
        figures.add_row(*_row("store size", [v.bytes for v in ok], human_bytes))
        figures.add_row(*_row("seconds per vehicle", [v.seconds for v in index.vehicles if v.status == "built"], lambda x: f"{x:.2f}"))
        print_table(figures)
    gates = run.get("gates") or {}
    if index.flagged:
        gate_text = ", ".join(f"--{k.replace('_', '-')} {v:g}" for k, v in gates.items() if isinstance(v, int | float) and not isinstance(v, bool))
        flagged = new_table(f"flagged vehicles ({gate_text})", "vehicle", "flags")
        for v in index.flagged[:LISTED]:
            flagged.add_row(escape(v.id), escape("; ".join(v.flags)))
        print_table(flagged)
        if len(index.flagged) > LISTED:
            stdout_console.print(f"... and {len(index.flagged) - LISTED} more flagged vehicles (fleet.json)")
    if index.failed:
        failed = new_table("failed vehicles", "vehicle", "error")
        for v in index.failed[:LISTED]:
            failed.add_row(escape(v.id), escape(v.error or ""))
        print_table(failed)
        if len(index.failed) > LISTED:
            stdout_console.print(f"... and {len(index.failed) - LISTED} more failed vehicles (fleet.json)")


@cli_command("fleet-report", writes="nothing", short_help="Summary and flagged vehicles of a fleet index (<out>/fleet.json).")
def fleet_report(
    folder: Annotated[Path, typer.Argument(help="The fleet's --out folder (or its fleet.json).", show_default=False, metavar="DIR")],
    max_shift_px: MaxShiftOption = None,
    max_coverage_change: MaxCoverageOption = None,
    quiet: QuietOption = False,
    json_output: JsonOption = False,
) -> None:
    """Print the summary of a fleet index and its flagged vehicles. --max-shift-px / --max-coverage-change
    flag again with other thresholds (from the recorded per-camera figures). Exit 0 when every vehicle
    is built and none is flagged, 1 otherwise (one stderr line per vehicle), 2 when DIR holds no index."""
    from ..fleet.index import read_index
    from ..report.diff import _check_gates

    index = read_index(folder)
    if max_shift_px is not None or max_coverage_change is not None:
        _check_gates(max_shift_px, max_coverage_change)
        index = index.regated(max_shift_px, max_coverage_change)
    if json_output:
        print_json(index.to_json())
    elif not quiet:
        print_summary(index)
    _fail_on(index, str(folder))
