"""``bevcompile inspect`` (integrity checks), ``bevcompile verify`` (equivalence report) and
``bevcompile render`` (coverage picture)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape

from ..errors import CheckFailed
from ..store.inspection import InspectReport, StoreReport, count_arrays, inspect_store, resolve_store_paths
from ..store.verify import DEFAULT_CHANNELS, VerifyReport, format_psnr, resolve_target, verify_store
from ._app import cli_command
from ._options import DEFAULT_OUT, FeatureChannelsOption, FeatureSeedOption, JsonOption, QuietOption
from ._output import (
    compact_json,
    human_bytes,
    new_table,
    print_json,
    print_table,
    progress_bar,
    stderr_lines,
    stdout_console,
)

ATTR_VALUE_WIDTH = 90


def _compact(value: Any) -> str:
    return compact_json(value, ATTR_VALUE_WIDTH)


# --------------------------------------------------------------------------------------
# inspect
# --------------------------------------------------------------------------------------


@cli_command("inspect", writes="nothing", short_help='CI gate: check every invariant of every store (exit 1 on any failure).')
def inspect(
    paths: Annotated[
        list[Path] | None,
        typer.Argument(help="Stores or folders of stores (default: artifacts/).", show_default=False, metavar="PATH"),
    ] = None,
    strict: Annotated[
        bool,
        typer.Option("--strict", help="Also rebuild every product from the stored config and require bit equality."),
    ] = False,
    json_output: JsonOption = False,
    quiet: QuietOption = False,
) -> None:
    """Check stores: metadata, config hash, conventions, content hashes and every product invariant.

    Exit 0 when every check passes, 1 when any fails (one line per failure on stderr:
    <store>: <array>: <check>: <reason>), 2 when a path is not a store or a folder of stores.
    """
    stores = resolve_store_paths(paths or [DEFAULT_OUT])
    with progress_bar("inspecting arrays", count_arrays(stores), enabled=not (quiet or json_output)) as advance:
        report = InspectReport([inspect_store(p, strict=strict, progress=advance) for p in stores], strict=strict)
    if json_output:
        print_json(report.to_json())
    elif not quiet:
        for store in report.stores:
            _print_store(store)
        style = "green" if report.passed else "red"
        stdout_console.print(
            f"[{style}]{report.n_checks - report.n_failed} of {report.n_checks} checks passed"
            f" in {len(report.stores)} store(s){' (strict)' if strict else ''}[/{style}]"
        )
    stderr_lines(report.failure_lines())
    if not report.passed:
        failed_stores = sum(1 for s in report.stores if not s.passed)
        raise CheckFailed(f"{report.n_failed} of {report.n_checks} checks failed in {failed_stores} of {len(report.stores)} store(s)")


def _print_store(store: StoreReport) -> None:
    sha = f"{store.config_sha256[:16]}…" if store.config_sha256 else "?"
    stdout_console.print(
        f"\n[bold]{escape(store.path)}[/bold]  rig [bold]{escape(str(store.name))}[/bold]  config_sha256 {escape(sha)}"
        f"  bevcompile {escape(str(store.tool_version))}  format {escape(str(store.format))}"
    )
    if store.groups:
        arrays = new_table(
            "arrays", "array", "shape", "dtype", "chunks", "in memory", "on disk", "ratio", right=("in memory", "on disk", "ratio")
        )
        for group in store.groups:
            for a in group.arrays:
                ratio = f"{a.bytes_in_memory / a.bytes_on_disk:.1f}x" if a.bytes_on_disk else "-"
                arrays.add_row(
                    escape(a.name),
                    "x".join(str(s) for s in a.shape),
                    a.dtype,
                    "x".join(str(c) for c in a.chunks),
                    human_bytes(a.bytes_in_memory),
                    human_bytes(a.bytes_on_disk),
                    ratio,
                )
        print_table(arrays)
        attrs = new_table("key attributes", "group", "attribute", "value")
        for group in store.groups:
            for key, value in group.key_attrs.items():
                attrs.add_row(f"{escape(group.name)}/", escape(key), escape(_compact(value)))
        if attrs.row_count:
            print_table(attrs)
    checks = new_table("checks", "result", "array", "check", "reason")
    for check in store.checks:
        result = "[green]pass[/green]" if check.passed else "[bold red]FAIL[/bold red]"
        checks.add_row(result, escape(check.array), escape(check.name), escape(check.reason))
    print_table(checks)
    for note in store.notes:
        stdout_console.print(f"note: {escape(note)}")


# --------------------------------------------------------------------------------------
# verify
# --------------------------------------------------------------------------------------


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
    out: Annotated[
        Path, typer.Option("--out", "-o", help="Where to look for <out>/<name>.zarr when a config (or nothing) is given.")
    ] = DEFAULT_OUT,
    json_output: JsonOption = False,
    quiet: QuietOption = False,
) -> None:
    """Compare every NPU form in the store with the float reference on seeded random features.

    Exit 0 when every product is within its threshold, 1 otherwise (or when the store is stale
    for the given config), 2 when the store is missing or unreadable.
    """
    store, rig = resolve_target(target, out)
    with progress_bar(f"verifying {store.name}", None, enabled=not (quiet or json_output)) as advance:
        report = verify_store(store, seed=seed, channels=channels, expected_rig=rig, progress=advance)
    if json_output:
        print_json(report.to_json())
    elif not quiet:
        _print_verify(report)
    stderr_lines(report.failure_lines())
    if not report.passed:
        why = f"{len(report.failures)} of {report.n_judged} judged rows failed" if report.rows else "nothing could be verified"
        raise CheckFailed(f"{store}: verify failed: {why}")


def _print_verify(report: VerifyReport) -> None:
    stdout_console.print(
        f"[bold]{escape(report.store)}[/bold]  rig [bold]{escape(str(report.name))}[/bold]  seed {report.seed}"
        f"  channels {report.channels}  features uniform [0, 1) (PSNR peak 1)"
    )
    products: dict[str, list[Any]] = {}
    for row in report.rows:
        products.setdefault(row.product, []).append(row)
    for product, rows in products.items():
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


# --------------------------------------------------------------------------------------
# render
# --------------------------------------------------------------------------------------


@cli_command("render", writes="file", short_help="PNG of the camera coverage on the BEV plane (and the matrix's per-cell weight).")
def render(
    store: Annotated[Path, typer.Argument(help="The store to draw.", show_default=False, metavar="STORE")],
    out: Annotated[
        Path | None,
        typer.Option("--out", "-o", help="PNG file (default: <store parent>/<name>_coverage.png).", show_default=False),
    ] = None,
    height: Annotated[
        float | None,
        typer.Option("--height", help="Draw the coverage at this sampling height in metres (default: at any height).", show_default=False),
    ] = None,
    level: Annotated[
        int,
        typer.Option("--level", help="Feature level whose coverage to draw (feature.levels; level 0 is grid/).", min=0),
    ] = 0,
    json_output: JsonOption = False,
    quiet: QuietOption = False,
) -> None:
    """Draw camera coverage on the BEV plane (x forward up) and the matrix's per-cell weight."""
    from ..report.render import render_store

    result = render_store(store, out, height=height, level=level)
    if json_output:
        print_json(result.to_json())
        return
    if quiet:
        return
    stdout_console.print(
        f"wrote [bold]{escape(str(result.path))}[/bold] ({result.width_px}x{result.height_px} px; coverage at "
        f"{escape(result.height_label)}; right panel: {escape(result.second_panel)})"
    )
