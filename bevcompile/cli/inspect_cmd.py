"""``bevcompile inspect``: integrity checks of stores (the CI gate)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape

from ..errors import CheckFailed
from ..store.inspection import InspectReport, StoreReport, count_arrays, inspect_store, resolve_store_paths
from ..store.plugins import GROUP_PLUGINS
from ._app import cli_command
from ._options import DEFAULT_OUT, JsonOption, QuietOption
from ._output import (
    compact_json,
    human_bytes,
    known,
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
        # readable=False: a store this user cannot read is a damaged store (exit 1, root_metadata), not a usage error
        typer.Argument(help="Stores or folders of stores (default: artifacts/).", show_default=False, metavar="PATH", readable=False),
    ] = None,
    strict: Annotated[
        bool,
        typer.Option("--strict", help="Also rebuild every product from the stored config and require bit equality."),
    ] = False,
    verbose: Annotated[
        bool,
        typer.Option("--verbose", "-v", help="Also print every store's arrays, key attributes and every check (passed ones too)."),
    ] = False,
    json_output: JsonOption = False,
    quiet: QuietOption = False,
) -> None:
    """Check stores: metadata, config hash, conventions, content hashes and every product invariant.

    Prints one row per store and a one-line total; every failed check is one line on stderr
    (<store>: <array>: <check>: <reason>). Exit 0 when every check passes, 1 when any fails,
    2 when a path is not a store or a folder of stores.
    """
    stores = resolve_store_paths(paths or [DEFAULT_OUT])
    with progress_bar("inspecting arrays", count_arrays(stores), enabled=not (quiet or json_output), unit="arrays") as advance:
        report = InspectReport([inspect_store(p, strict=strict, progress=advance) for p in stores], strict=strict)
    if json_output:
        print_json(report.to_json())
    elif not quiet:
        if verbose:
            for store in report.stores:
                _print_store(store)
            stdout_console.print()
        _print_stores_table(report)
        style = "green" if report.passed else "red"
        stdout_console.print(
            f"[{style}]{report.n_checks - report.n_failed} of {report.n_checks} checks passed"
            f" in {len(report.stores)} store(s){' (strict)' if strict else ''}[/{style}]"
        )
    stderr_lines(report.failure_lines())
    if not report.passed:
        failed_stores = sum(1 for s in report.stores if not s.passed)
        raise CheckFailed(f"{report.n_failed} of {report.n_checks} checks failed in {failed_stores} of {len(report.stores)} store(s)")


def _in_product_order(names: Iterable[str]) -> list[str]:
    """Group names as the products come (grid gather delta matrix interop), others after, sorted."""
    order = list(GROUP_PLUGINS)
    return sorted(names, key=lambda name: (order.index(name) if name in order else len(order), name))


def _print_stores_table(report: InspectReport) -> None:
    """One row per store: what it holds and how its checks went (its rig is the store's name;
    ``--verbose`` prints the recorded identity)."""
    table = new_table(
        "", "store", "groups", "arrays", "on disk", "checks", "result", right=("arrays", "on disk", "checks"), no_wrap=("groups", "checks")
    )
    for store in report.stores:
        n_arrays = sum(len(g.arrays) for g in store.groups)
        on_disk = sum(a.bytes_on_disk for g in store.groups for a in g.arrays)
        passed = len(store.checks) - len(store.failures)
        result = "[green]pass[/green]" if store.passed else f"[bold red]FAIL ({len(store.failures)})[/bold red]"
        table.add_row(
            escape(store.path),
            escape(" ".join(_in_product_order(g.name for g in store.groups)) or "-"),
            str(n_arrays),
            human_bytes(on_disk),
            f"{passed} / {len(store.checks)}",
            result,
        )
    print_table(table)


def _print_store(store: StoreReport) -> None:
    sha = f"{store.config_sha256[:16]}…" if store.config_sha256 else "?"
    stdout_console.print(
        f"\n[bold]{escape(store.path)}[/bold]  rig [bold]{escape(known(store.name))}[/bold]  config_sha256 {escape(sha)}"
        f"  bevcompile {escape(known(store.tool_version))}  format {escape(known(store.format))}"
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
