"""``bevcompile targets``: the NPU target profiles ``export-onnx --target`` builds for, with the source of every limit."""

from __future__ import annotations

from typing import Annotated

import typer

from ._app import cli_command
from ._options import JsonOption
from ._output import new_table, print_json, print_table, stdout_console


def _value(limit: object) -> str:
    from ..deploy.targets import Limit

    assert isinstance(limit, Limit)
    if limit.unit == "bytes":
        return f"{limit.value / 2**20:g} MiB" if limit.value >= 2**20 else f"{int(limit.value):,} B"
    return f"{int(limit.value):,}" if float(limit.value).is_integer() else f"{limit.value:g}"


@cli_command("targets", writes="nothing", short_help="NPU target profiles of export-onnx --target, every limit with its source.")
def targets(
    name: Annotated[
        str | None, typer.Argument(help="Show one profile (a bundled name or a .toml file): every limit, rewrite and runtime setting with its source.", show_default=False, metavar="[NAME]")
    ] = None,
    json_output: JsonOption = False,
) -> None:
    """List the target profiles (bevcompile export-onnx --target NAME builds the lift within a
    target's limits), or show one: its limits, what its converter rewrites, the runtime settings a
    user must make, and where each comes from (a document, or a measured build)."""
    from ..deploy.targets import load_profile, load_profiles

    if name is not None:
        profile = load_profile(name)
        if json_output:
            print_json(profile.to_json())
            return
        stdout_console.print(f"[bold]{profile.name}[/bold]: {profile.description}", highlight=False)
        stdout_console.print(
            f"toolchain {profile.toolchain}{' (' + profile.platform + ')' if profile.platform else ''}; computes in {', '.join(profile.compute)}; "
            f"forms {', '.join(profile.forms)} (first that fits); layout {profile.layout}; inputs rank {profile.input_rank}",
            highlight=False,
        )
        stdout_console.print(f"int8: {profile.int8}{'' if profile.int8_per_axis else ' (per-tensor scales only)'}: {profile.int8_source}", highlight=False, markup=False)
        if profile.limits:
            table = new_table("limits", "limit", "value", "source", right=("value",))
            for limit in profile.limits.values():
                table.add_row(limit.key, _value(limit), limit.source)
            print_table(table)
        for title, notes in (("converter rewrites", profile.rewrites), ("runtime settings", profile.runtime)):
            if notes:
                table = new_table(title, "pattern", "what happens / what to set", "source")
                for note in notes:
                    table.add_row(note.pattern, note.what, note.source)
                print_table(table)
        return
    profiles = load_profiles()
    if json_output:
        print_json([p.to_json() for p in profiles])
        return
    table = new_table("target profiles (bevcompile targets NAME: every limit and its source)", "target", "toolchain", "computes", "forms", "int8", "limits")
    table.columns[0].no_wrap = True
    for p in profiles:
        table.add_row(p.name, p.toolchain, ", ".join(p.compute), ", ".join(p.forms), p.int8, str(len(p.limits)))
    print_table(table)
