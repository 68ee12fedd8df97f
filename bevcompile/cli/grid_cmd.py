"""``bevcompile grid``: IPM sampling grids (and their NPU forms) into the rig's store."""

from __future__ import annotations

from typing import Annotated

import typer

from ..build import run_grid, total_grid_cells
from ..config import load_config
from ._app import cli_command
from ._options import DEFAULT_OUT, ConfigArg, ForceOption, JsonOption, OutOption, QuietOption
from ._output import human_bytes, new_table, print_json, print_table, progress_bar, stdout_console


@cli_command("grid")
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
    force: ForceOption = False,
    quiet: QuietOption = False,
    json_output: JsonOption = False,
) -> None:
    """Compute every BEV cell's sampling position in every camera and write <out>/<name>.zarr."""
    rig = load_config(config)
    with progress_bar("projecting BEV cells", total_grid_cells(rig), enabled=not (quiet or json_output)) as advance:
        result = run_grid(rig, out, align_corners=align_corners, force=force, progress=advance)
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
        "u range [px]",
        "v range [px]",
        right=tuple(f"coverage z={h:g} m" for h in heights),
    )
    for cam in result.cameras:
        u = f"{cam.u_range[0]:.2f} .. {cam.u_range[1]:.2f}" if cam.u_range else "-"
        v = f"{cam.v_range[0]:.2f} .. {cam.v_range[1]:.2f}" if cam.v_range else "-"
        table.add_row(cam.name, *(f"{100 * c:.1f} %" for c in cam.coverage), u, v)
    print_table(table)
    sizes = new_table("bytes written", "array", "shape", "dtype", "on disk", right=("on disk",))
    arrays = {
        "grid/coords": result.products.coords,
        "grid/valid": result.products.valid,
        "grid/norm": result.products.norm,
        "grid/norm_int16": result.products.norm_int16,
    }
    for key, nbytes in result.write.bytes_per_array.items():
        arr = arrays.get(key)
        shape = "x".join(str(s) for s in arr.shape) if arr is not None else ""
        dtype = str(arr.dtype) if arr is not None else ""
        sizes.add_row(key, shape, dtype, human_bytes(nbytes))
    print_table(sizes)
    stdout_console.print(
        f"norm_int16 max dequantisation error: {result.products.norm_int16_max_error_px:.2e} feature px"
    )
    stdout_console.print(f"wrote [bold]{result.store}[/bold] ({human_bytes(result.write.total_bytes)} on disk)")
