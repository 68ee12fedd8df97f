"""``bevcompile presets``: the model presets a rig config can name (``preset: <name>``)."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from ..errors import UsageError
from ._app import cli_command
from ._options import JsonOption
from ._output import new_table, print_json, print_table, stdout_console


def _summary(fields: dict[str, Any]) -> dict[str, str]:
    feature = fields.get("feature", {})
    levels = feature.get("levels") or [{"stride": feature.get("stride")}]
    strides = ",".join(str(level["stride"]) for level in levels)
    size_rule = feature.get("size_rule", "exact")
    bev = fields.get("bev", {})
    x, y = bev.get("x", []), bev.get("y", [])
    n_x = round((x[1] - x[0]) / x[2]) if len(x) == 3 else "?"
    n_y = round((y[1] - y[0]) / y[2]) if len(y) == 3 else "?"
    heights = bev.get("heights", [0.0])
    grids = []
    for level in levels:  # feature.levels[l].bev: a level's own grid
        own = level.get("bev") or {}
        lx, ly = own.get("x", x), own.get("y", y)
        if own and len(lx) == 3 and len(ly) == 3:
            grids.append(f"{round((lx[1] - lx[0]) / lx[2])}x{round((ly[1] - ly[0]) / ly[2])} @ {lx[2]:.3g} m")
    return {
        "frame": str(bev.get("frame", "ego")),
        "feature": f"s{strides} {feature.get('pixel_mapping', 'stride')}" + ("" if size_rule == "exact" else f" {size_rule}"),
        "bev": (f"{n_x}x{n_y} x {len(heights)} @ {x[2]:g} m" if len(x) == 3 else "-") + "".join(f", {g}" for g in grids),
    }


@cli_command("presets", writes="nothing", short_help="Model presets a config can name (preset: <name>), with their sources.")
def presets(
    name: Annotated[str | None, typer.Argument(help="Show one preset: every value and the file and commit it came from.", show_default=False, metavar="[NAME]")] = None,
    json_output: JsonOption = False,
) -> None:
    """List the model presets (preset: <name> in a rig config fills every setting the model
    fixes; explicit fields override), or show one with the source of every value."""
    from ..rig.presets import PRESETS

    if name is not None:
        key = name.strip().lower()
        if key not in PRESETS:
            raise UsageError(f"unknown preset {name!r}: expected one of {', '.join(PRESETS)}")
        chosen = PRESETS[key]
        if json_output:
            print_json(chosen.to_json())
            return
        table = new_table(f"{chosen.name}: {chosen.title}", "setting", "value", right=())
        for setting, value in chosen.fields.items():
            table.add_row(setting, str(value))
        table.add_row("image_aug", chosen.image_aug_rule)
        print_table(table)
        stdout_console.print("sources (the setting, then the upstream value, repository, file and commit):")
        for source in chosen.sources:
            stdout_console.print(f"  {source.setting}: {source.value}", markup=False, highlight=False)
            stdout_console.print(f"      {source.repo} {source.path} @{source.commit[:12]}", markup=False, highlight=False)
        poses = chosen.sample_poses
        stdout_console.print(
            f"per-sample poses (docs/models.md): key {poses.key}, records {'float32' if poses.float32_records else 'float64'}: {poses.rule}",
            markup=False, highlight=False,
        )
        stdout_console.print(f"      {poses.source.repo} {poses.source.path} @{poses.source.commit[:12]}", markup=False, highlight=False)
        for note in chosen.notes:
            stdout_console.print(f"note: {note}", markup=False, highlight=False)
        stdout_console.print(f"proof: {chosen.proof}", markup=False, highlight=False)
        return
    if json_output:
        print_json([p.to_json() for p in PRESETS.values()])
        return
    table = new_table("model presets (preset: <name>; bevcompile presets NAME: every value and its source)", "preset", "model", "frame", "feature maps", "BEV")
    table.columns[0].no_wrap = True  # a preset name is what a config copies: never split it
    for chosen in PRESETS.values():
        row = _summary(dict(chosen.fields))
        table.add_row(chosen.name, chosen.title, row["frame"], row["feature"], row["bev"])
    print_table(table)
