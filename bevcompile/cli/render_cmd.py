"""``bevcompile render``: the coverage picture of a store."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from ._app import cli_command
from ._options import JsonOption, QuietOption
from ._output import (
    print_json,
    stdout_console,
)


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
