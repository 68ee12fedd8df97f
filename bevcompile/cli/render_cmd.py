"""``bevcompile render``: the coverage picture of a store."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from ..errors import UsageError
from ..report.precision import DEFAULT_BANDS_M, format_db, parse_bands
from ..store.verify import DEFAULT_CHANNELS, check_feature_options
from ._app import cli_command
from ._options import FeatureChannelsOption, FeatureSeedOption, JsonOption, QuietOption
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
    precision: Annotated[
        bool,
        typer.Option(
            "--precision",
            help="Draw the precision map instead (default --out <store parent>/<name>_precision.png): one panel per deployed form, "
            "the per-cell SNR in dB against the float64 reference (as `verify --map`), distance bands as rings.",
        ),
    ] = False,
    seed: FeatureSeedOption = 0,
    channels: FeatureChannelsOption = DEFAULT_CHANNELS,
    bands: Annotated[
        str,
        typer.Option("--bands", metavar="E1,E2,...", help="--precision: distance band edges in metres."),
    ] = ",".join(f"{e:g}" for e in DEFAULT_BANDS_M),
    json_output: JsonOption = False,
    quiet: QuietOption = False,
) -> None:
    """Draw camera coverage on the BEV plane (x forward up) and the matrix's per-cell weight
    (--precision: the per-cell precision of every deployed form)."""
    from ..report.render import render_precision, render_store

    if precision:
        if height is not None or level != 0:
            raise UsageError("--height and --level draw the coverage picture; --precision draws every deployed form of the whole grid")
        check_feature_options(seed, channels)
        drawn = render_precision(store, out, seed=seed, channels=channels, bands=parse_bands(bands))
        if json_output:
            print_json(drawn.to_json())
        elif not quiet:
            far = {f.name: f.bands[-1].snr_db for f in drawn.precision.forms}
            stdout_console.print(
                f"wrote [bold]{escape(str(drawn.path))}[/bold] ({drawn.width_px}x{drawn.height_px} px; {len(drawn.forms)} forms; "
                f"scale {drawn.scale_db[0]:g} to {drawn.scale_db[1]:g} dB; beyond {drawn.precision.bands_m[-1]:g} m: "
                + ", ".join(f"{escape(name)} {format_db(v)} dB" for name, v in far.items())
                + ")"
            )
        return

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
