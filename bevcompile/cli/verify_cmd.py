"""``bevcompile verify``: every NPU form against the float reference on seeded random features."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape

from ..errors import CheckFailed
from ..report.precision import DEFAULT_BANDS_M
from ..store.verify import DEFAULT_CHANNELS, VerifyReport, format_psnr, resolve_target, verify_store
from ._app import cli_command
from ._options import DEFAULT_OUT, FeatureChannelsOption, FeatureSeedOption, JsonOption, QuietOption
from ._output import (
    known,
    new_table,
    print_json,
    print_table,
    progress_bar,
    stderr_lines,
    stdout_console,
)


@cli_command("verify", writes="nothing", short_help='Compare every NPU form with the float reference on seeded random features.')
def verify(
    target: Annotated[
        Path | None,
        typer.Argument(
            help="A store, or a rig config YAML whose store <out>/<name>.zarr is verified (default: the bundled rig).",
            show_default=False,
            metavar="CONFIG|STORE",
        ),
    ] = None,
    seed: FeatureSeedOption = 0,
    channels: FeatureChannelsOption = DEFAULT_CHANNELS,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="One table per product with a row per camera.")] = False,
    out: Annotated[
        Path, typer.Option("--out", "-o", help="Where to look for <out>/<name>.zarr when a config (or nothing) is given.")
    ] = DEFAULT_OUT,
    precision: Annotated[
        bool,
        typer.Option(
            "--map",
            help="The precision map instead: per BEV cell, the error (SNR dB) of every deployed form (gather float/LUT, "
            "ELL/tiles float/int8/fp16/mixed) against its float64 reference, summarised per distance band and camera; "
            "informational (exit 0). `bevcompile render STORE --precision` draws it.",
        ),
    ] = False,
    bands: Annotated[
        str,
        typer.Option("--bands", metavar="E1,E2,...", help="--map: distance band edges in metres (bands 0-E1, E1-E2, ..., beyond the last)."),
    ] = ",".join(f"{e:g}" for e in DEFAULT_BANDS_M),
    targets: Annotated[
        list[str] | None,
        typer.Option("--target", metavar="NAME", help="--map: also map the ELL graph export-onnx --target NAME writes (repeatable; bevcompile targets).", show_default=False),
    ] = None,
    json_output: JsonOption = False,
    quiet: QuietOption = False,
) -> None:
    """Compare every NPU form in the store with the float reference on seeded random features.

    Exit 0 when every product is within its threshold, 1 otherwise (or when the store is stale
    for the given config), 2 when the store is missing or unreadable. With --map: the per-cell
    precision map of every deployed form (exit 0; 2 for a bad store or --bands).
    """
    store, rig = resolve_target(target, out)
    if targets and not precision:
        from ..errors import UsageError

        raise UsageError("--target adds a target's graph to the precision map: use it with --map")
    if precision:
        from ._target_forms import target_forms

        extra = target_forms(targets) if targets else []
        _precision_map(store, rig, seed=seed, channels=channels, bands=bands, json_output=json_output, quiet=quiet, extra_forms=extra)
        return
    with progress_bar(f"verifying {store.name}", None, enabled=not (quiet or json_output)) as advance:
        report = verify_store(store, seed=seed, channels=channels, expected_rig=rig, progress=advance)
    if json_output:
        print_json(report.to_json())
    elif not quiet:
        _print_verify(report, verbose=verbose)
    stderr_lines(report.failure_lines())
    if not report.passed:
        why = f"{len(report.failures)} of {report.n_judged} judged rows failed" if report.rows else "nothing could be verified"
        raise CheckFailed(f"{store}: verify failed: {why}")


def _precision_map(store: Path, rig: Any, *, seed: int, channels: int, bands: str, json_output: bool, quiet: bool, extra_forms: list[Any]) -> None:
    """``verify --map``: the precision map's band and camera tables (or its JSON)."""
    from ..report.precision import parse_bands, precision_map, summaries_table
    from ..store.loader import load
    from ..store.verify import check_feature_options, check_not_stale

    edges = parse_bands(bands)
    check_feature_options(seed, channels)
    if rig is not None:
        check_not_stale(store, rig, load(store).root_attrs.get("config_sha256"))
    with progress_bar(f"mapping the precision of {store.name}", None, enabled=not (quiet or json_output)) as advance:
        pmap = precision_map(store, seed=seed, channels=channels, bands=edges, extra_forms=extra_forms, progress=advance)
    if json_output:
        print_json(pmap.to_json())
        return
    if quiet:
        return
    stdout_console.print(
        f"[bold]{escape(pmap.store)}[/bold]  rig [bold]{escape(pmap.name)}[/bold]  seed {pmap.seed}  channels {pmap.channels}  "
        "per-cell SNR = 10 log10(sum ref^2 / sum err^2) over the channels"
    )
    if pmap.forms:
        for kind, title in (("bands", "SNR dB by distance (5th percentile of the cells)"), ("cameras", "SNR dB over the cells each camera feeds")):
            header, rows = summaries_table(pmap, kind)
            table = new_table(title, *header, right=tuple(header[1:]), no_wrap=(header[0],))
            for row in rows:
                table.add_row(*(escape(cell) for cell in row))
            print_table(table)
    for note in pmap.notes:
        stdout_console.print(f"note: {escape(note)}")


def _not_run(row: Any) -> bool:
    """An informational row that measured nothing (e.g. the torch reference without PyTorch)."""
    return bool(row.informational) and math.isnan(row.max_abs)


def _short_threshold(row: Any) -> str:
    """``<= 1e-05`` for ``max_abs <= 1e-05`` (the compact table's column says what is bounded); a
    row that was not run says why (its note: ``skipped: PyTorch not installed ...``)."""
    if _not_run(row):
        return str(row.note or "not run")
    if row.informational:
        return "informational"
    return str(row.threshold).removeprefix("max_abs ")


def _result_cell(rows: list[Any]) -> str:
    if all(_not_run(row) for row in rows):
        return "[cyan]skipped[/cyan]"
    if all(row.informational for row in rows):
        return "[cyan]info[/cyan]"
    failed = sum(1 for row in rows if not row.passed and not row.informational)
    return "[green]pass[/green]" if not failed else f"[bold red]FAIL ({failed})[/bold red]"


def _print_verify(report: VerifyReport, *, verbose: bool = False) -> None:
    stdout_console.print(
        f"[bold]{escape(report.store)}[/bold]  rig [bold]{escape(known(report.name))}[/bold]  seed {report.seed}"
        f"  channels {report.channels}  features uniform [0, 1) (PSNR peak 1)"
    )
    products: dict[str, list[Any]] = {}
    for row in report.rows:
        products.setdefault(row.product, []).append(row)
    if not verbose:  # one row per product: its worst camera
        table = new_table("", "product", "max abs", "PSNR dB", "threshold", "result", right=("max abs", "PSNR dB"), no_wrap=("product",))
        for product, rows in products.items():
            bounds = sorted({_short_threshold(row) for row in rows})
            skipped = all(_not_run(row) for row in rows)
            table.add_row(
                escape(product),
                "-" if skipped else f"{max(row.max_abs for row in rows):.3g}",
                "-" if skipped else format_psnr(min(row.psnr_db for row in rows)),
                escape(bounds[0] if len(bounds) == 1 else "per camera"),
                _result_cell(rows),
            )
        print_table(table)
    for product, rows in products.items() if verbose else ():
        thresholds = {row.threshold for row in rows}
        notes = {row.note for row in rows}
        shared_threshold = len(thresholds) == 1
        shared_note = len(notes) == 1
        title = escape(product)
        if shared_threshold:
            title += f"  ({escape(rows[0].threshold)})"
        if shared_note and rows[0].note:
            title += f"  {escape(rows[0].note)}"
        columns = ["camera", "max abs", "mean abs", "PSNR dB"]
        if not shared_threshold:
            columns.append("threshold")
        columns.append("result")
        if not shared_note:
            columns.append("note")
        table = new_table(title, *columns, right=("max abs", "mean abs", "PSNR dB"))
        for row in rows:
            cells = [escape(row.camera), f"{row.max_abs:.3g}", f"{row.mean_abs:.3g}", format_psnr(row.psnr_db)]
            if not shared_threshold:
                cells.append(escape(row.threshold))
            cells.append("[cyan]info[/cyan]" if row.informational else "[green]pass[/green]" if row.passed else "[bold red]FAIL[/bold red]")
            if not shared_note:
                cells.append(escape(row.note))
            table.add_row(*cells)
        print_table(table)
    for note in report.notes:
        stdout_console.print(f"note: {escape(note)}")
    style = "green" if report.passed else "red"
    n_info = len(report.rows) - report.n_judged
    info = f" ({n_info} informational row{'s' if n_info != 1 else ''} not judged)" if n_info else ""
    stdout_console.print(f"[{style}]{report.n_judged - len(report.failures)} of {report.n_judged} rows passed{info}[/{style}]")
