"""``bevcompile grid``: IPM sampling grids (and their NPU forms) into the rig's store."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.markup import escape

from ..grid.build import grid_command_options, run_grid
from ..grid.delta import DEFAULT_BLOCK, DEFAULT_MAX_ERROR_PX
from ..grid.formats import FORMATS
from ..grid.gather import ORDERS
from ..rig.config import load_config
from ._app import cli_command
from ._options import DEFAULT_OUT, ConfigArg, ForceOption, JsonOption, OutOption, QuietOption
from ._output import (
    human_bytes,
    new_table,
    note_dropped_groups,
    print_json,
    print_table,
    progress_bar,
    stderr_console,
    stdout_console,
)


@cli_command("grid", short_help='IPM sampling grids, gather tables, fixed-point formats and delta-LUT -> grid/ gather/ delta/.')
def grid(
    config: ConfigArg = None,
    out: OutOption = DEFAULT_OUT,
    align_corners: Annotated[
        bool,
        typer.Option(
            "--align-corners/--no-align-corners",
            help="grid_sample align_corners the model uses (PyTorch default: no).",
        ),
    ] = False,
    formats: Annotated[
        list[str] | None,
        typer.Option(
            "--format",
            help=f"Also write this fixed-point grid format into grid/ (repeatable): {', '.join(FORMATS)}.",
            show_default=False,
            metavar="NAME",
        ),
    ] = None,
    frac_bits: Annotated[
        int | None,
        typer.Option(
            "--frac-bits",
            help="Fractional bits of the quantised sub-pixel position: gather weight LUT levels 2**F "
            "(default 8) and pixel_q (default: J5 rule clamp(15 - ceil(log2(max(H_f, W_f, ny, nx) + 1)), 0, 8)).",
            show_default=False,
        ),
    ] = None,
    align: Annotated[
        int,
        typer.Option("--align", help="Pad the flattened gather rows to a multiple of N (N > 1 flattens gather/ tables)."),
    ] = 1,
    order: Annotated[
        str,
        typer.Option(
            "--order",
            metavar="|".join(ORDERS),
            help=f"Gather row order: {', '.join(ORDERS)} (cache: 8-row feature bands swept by floor(u); "
            "feature: ascending feature address). Writes gather/perm.",
        ),
    ] = "row",
    block: Annotated[int, typer.Option("--block", help="delta/ block size B (B x B BEV cells per block), 1 to 256.")] = DEFAULT_BLOCK,
    max_error_px: Annotated[
        float,
        typer.Option("--max-error-px", help="delta/ max decode error over valid cells, in feature pixels, in (0, 1]."),
    ] = DEFAULT_MAX_ERROR_PX,
    force: ForceOption = False,
    quiet: QuietOption = False,
    json_output: JsonOption = False,
) -> None:
    """Compute every BEV cell's sampling position in every camera and write <out>/<name>.zarr:
    grid/ (float grid + fixed-point formats), gather/ (static gather tables), delta/ (delta-LUT)."""
    rig = load_config(config)
    options = grid_command_options(
        align_corners=align_corners, formats=formats or (), frac_bits=frac_bits, align=align, order=order,
        block=block, max_error_px=max_error_px,
    )
    # the total comes with run_grid's first phase, after its memory guard (a bev.region's cell table costs time)
    with progress_bar("checking the rig", None, enabled=not (quiet or json_output)) as advance:
        result = run_grid(rig, out, force=force, progress=advance, **options.run_kwargs())
    saturated = result.products.norm_int16_saturated_valid_cells
    if saturated:  # on stderr, also under --quiet/--json: a CI log must show it
        stderr_console.print(
            f"[yellow]warning:[/yellow] with --align-corners, norm_int16 clamps {saturated} valid border cell(s) "
            "by up to 0.5 px (the valid rule reaches past the outer pixel centres; uq12, if written, likewise); "
            "use --format norm_q16, which has headroom"
        )
    for cam in result.cameras:  # on stderr, also under --quiet/--json: most often a pose given ego->camera
        if not any(cam.coverage):
            stderr_console.print(f"[yellow]warning:[/yellow] camera {escape(cam.name)} sees no BEV cell (is the pose camera->ego?)")
    note_dropped_groups(result.store, result.write.dropped_groups)
    if json_output:
        print_json(result.to_json())
        return
    if quiet:
        return
    heights = rig.bev.heights
    w_f, h_f = result.products.feature_size
    table = new_table(
        f"{rig.name}: {rig.n_cam} cameras, feature map {w_f}x{h_f}, BEV {rig.bev.nx}x{rig.bev.ny}"
        f" x {len(heights)} height(s), align_corners={align_corners}",
        "camera",
        *(f"coverage z={h:g} m" for h in heights),
        "u range \\[px]",
        "v range \\[px]",
        right=tuple(f"coverage z={h:g} m" for h in heights),
    )
    for cam in result.cameras:
        u = f"{cam.u_range[0]:.2f} .. {cam.u_range[1]:.2f}" if cam.u_range else "-"
        v = f"{cam.v_range[0]:.2f} .. {cam.v_range[1]:.2f}" if cam.v_range else "-"
        table.add_row(cam.name, *(_percent(c) for c in cam.coverage), u, v)
    print_table(table)
    levels: list[dict[str, Any]] = result.extra.get("levels") or []
    if levels:  # feature.levels: one set of groups per level
        level_table = new_table(
            f"{len(levels)} feature levels (each level's tables index its own features (n_cam, H_l, W_l))",
            "level", "groups", "stride", "pixel_mapping", "feature map", "coverage", right=("stride", "coverage"),
        )
        for level in levels:
            w_l, h_l = level["feature_size"]
            level_table.add_row(
                str(level["level"]), " ".join(f"{g}/" for g in level["groups"]), str(level["stride"]),
                level["pixel_mapping"], f"{w_l}x{h_l}", _percent(level["coverage"]),
            )
        print_table(level_table)
    sizes = new_table("bytes written", "array", "shape", "dtype", "on disk", right=("on disk",))
    arrays: dict[str, Any] = result.extra.get("arrays", {})
    for key, nbytes in result.write.bytes_per_array.items():
        info = arrays.get(key, {})
        shape = "x".join(str(s) for s in info.get("shape", ())) if info else ""
        sizes.add_row(key, shape, str(info.get("dtype", "")), human_bytes(nbytes))
    print_table(sizes)
    _print_npu_summary(result.extra)
    stdout_console.print(
        f"norm_int16 max dequantisation error: {result.products.norm_int16_max_error_px:.2e} feature px"
    )
    stdout_console.print(f"wrote [bold]{result.store}[/bold] ({human_bytes(result.write.total_bytes)} on disk)")


def _print_npu_summary(extra: dict[str, Any]) -> None:
    formats = extra.get("formats") or []
    if formats:
        table = new_table(
            "fixed-point formats (error measured after encoding, valid cells, vs float64 grid)",
            "format",
            "arrays in grid/",
            "invalid cells",
            "max error \\[px]",
            "saturated valid",
            right=("max error \\[px]", "saturated valid"),
        )
        for row in formats:
            name = row["name"] + (f" (f={row['frac_bits']})" if "frac_bits" in row else "")
            table.add_row(
                name,
                " ".join(a.removeprefix("grid/") for a in row["arrays"]),
                "in-band" if row["invalid_in_band"] else "grid/valid",
                f"{row['max_error_px']:.3g}",
                str(row.get("saturated_valid_cells", "-")),
            )
        print_table(table)
    gather = extra.get("gather")
    if gather:
        table = new_table("gather/ tables", "figure", "value", right=("value",))
        rows = f"{gather['n_cells']}" + (f" padded to {gather['n_cells_padded']}" if gather["n_cells_padded"] != gather["n_cells"] else "")
        table.add_row("layout", f"{gather['layout']} (align {gather['align']}, order {gather['order']})")
        table.add_row("cells (rows)", rows)
        table.add_row("float32 weight max error", f"{gather['weight_float32_max_error']:.2e}")
        table.add_row(f"LUT ({gather['lut_levels']} levels/axis) max weight error", f"{gather['lut_max_weight_error']:.2e}")
        table.add_row("LUT worst-case sample error (unit features)", f"{gather['lut_max_sample_error_unit_features']:.2e}")
        jump = f"{gather['mean_index_jump_row_order']:.1f}"
        bands = f"{gather['band_switches_row_order']}"
        if gather["order"] != "row":
            jump += f" -> {gather['mean_index_jump_gather_order']:.1f} ({gather['order']} order)"
            bands += f" -> {gather['band_switches_gather_order']} ({gather['order']} order)"
        table.add_row("mean index jump between valid rows", jump)
        table.add_row("8-row feature band switches", bands)
        print_table(table)
    delta = extra.get("delta")
    if delta:
        table = new_table("delta/ LUT", "figure", "value", right=("value",))
        table.add_row("block", f"{delta['block']} x {delta['block']}")
        table.add_row(
            "blocks (active / total)",
            f"{delta['n_active_blocks']} / {delta['n_blocks']} (predictor-only {delta['n_predictor_only']}, "
            f"residual {delta['n_residual']}, escape {delta['n_escape']})",
        )
        table.add_row("max error (bound)", f"{delta['max_error_px']:.4f} px ({delta['max_error_bound_px']:.4g} px)")
        table.add_row(
            "on-device size vs norm_int16",
            f"{human_bytes(delta['on_device_bytes_total'])} vs {human_bytes(delta['norm_int16_bytes'])}"
            f" = {100 * delta['ratio_vs_norm_int16']:.1f} %",
        )
        print_table(table)


def _percent(fraction: float) -> str:
    """``12.3 %``; a small non-zero share keeps two significant digits (never shown as 0.0 %)."""
    if 0 < fraction < 1e-3:
        return f"{100 * fraction:.2g} %"
    return f"{100 * fraction:.1f} %"
