"""``bevcompile import kalibr|nuscenes|opencv``: a rig config YAML from a calibration tool's or a dataset's files."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape

from ._app import app, cli_command
from ._options import JsonOption, QuietOption
from ._output import print_json, stdout_console

import_app = typer.Typer(
    name="import",
    help="Write a rig config YAML from a calibration tool's or a dataset's files (Kalibr, nuScenes, OpenCV).",
    no_args_is_help=True,
)
app.add_typer(import_app, name="import", short_help="Rig config YAML from Kalibr camchain.yaml, nuScenes tables or an OpenCV calibration file.")

OutFileOption = Annotated[
    Path | None,
    typer.Option("--out", "-o", help="The rig config YAML to write (atomically). Default: print it on stdout.", show_default=False, metavar="FILE"),
]
TemplateOption = Annotated[
    Path | None,
    typer.Option(
        "--template",
        help="Model settings (a rig config without cameras: image_aug, feature, bev, depth). Default: the bundled nuScenes rig's (BEVDet-R50).",
        show_default=False,
        metavar="YAML",
    ),
]
NameOption = Annotated[str | None, typer.Option("--name", help="The rig name (the store is <out>/<name>.zarr).", show_default=False)]


def _emit(data: dict[str, Any], source: str, out: Path | None, header: list[str], quiet: bool, json_output: bool) -> None:
    """Validate the imported config (parse_config), then write it (or print it)."""
    from ..rig.config import config_sha256, dump_config_yaml, parse_config, write_config_yaml

    rig = parse_config(data, source=f"{source} (imported)")
    summary: dict[str, Any] = {
        "name": rig.name,
        "cameras": list(rig.camera_names),
        "sensors": [s.name for s in rig.sensors],
        "config_sha256": config_sha256(rig),
        "out": str(out) if out is not None else None,
    }
    if out is None:
        if json_output:
            print_json({**summary, "config": data})
            return
        typer.echo(dump_config_yaml(data, header), nl=False)
        return
    write_config_yaml(out, data, header)
    if json_output:
        print_json(summary)
    elif not quiet:
        sensors = f", sensors {', '.join(summary['sensors'])}" if summary["sensors"] else ""
        stdout_console.print(
            f"wrote [bold]{escape(str(out))}[/bold]: rig {escape(rig.name)}, {rig.n_cam} camera(s) {escape(', '.join(rig.camera_names))}"
            f"{escape(sensors)}; config_sha256 {summary['config_sha256'][:16]}…"
        )


def _template(path: Path | None) -> dict[str, Any]:
    from ..rig.importers._common import template_data

    return template_data(path)


@cli_command("kalibr", parent=import_app, writes="file", short_help="Kalibr multi-camera calibration (camchain.yaml: cam0..camN).")
def import_kalibr_command(
    camchain: Annotated[Path, typer.Argument(help="Kalibr camchain.yaml (kalibr_calibrate_cameras / kalibr_calibrate_imu_camera).", show_default=False, metavar="CAMCHAIN")],
    body: Annotated[
        str,
        typer.Option("--body", help="The body frame: imu (via each camera's T_cam_imu), camK (via the T_cn_cnm1 chain), or auto (imu when every camera has T_cam_imu, else cam0)."),
    ] = "auto",
    ego_from_body: Annotated[
        str | None,
        typer.Option(
            "--ego-from-body",
            help="4x4 placing the body frame in the ego frame (x forward, y left, z up): 16 numbers row by row (commas), or a YAML file holding the 4x4. Default: identity (required for a camera body).",
            show_default=False,
            metavar="M",
        ),
    ] = None,
    names: Annotated[str | None, typer.Option("--names", help="Rig camera names in chain order, comma-separated (default: cam0, cam1, ...).", show_default=False)] = None,
    template: TemplateOption = None,
    name: NameOption = None,
    out: OutFileOption = None,
    quiet: QuietOption = False,
    json_output: JsonOption = False,
) -> None:
    """Import Kalibr's camchain.yaml: pinhole cameras with radtan / equidistant / no distortion, numbers
    copied exactly; poses composed in float64 (sensor2ego = ego_from_body @ body_from_cam)."""
    from ..rig.config import read_config_data
    from ..rig.importers.kalibr import KalibrOptions, import_kalibr, parse_ego_from_body, split_names

    matrix = None
    if ego_from_body is not None:
        text = ego_from_body.strip()
        if Path(text).is_file():
            matrix = parse_ego_from_body(read_config_data(text, what="a 4x4 matrix"), text, "")
        else:
            try:
                numbers = [float(v) for v in text.replace(";", ",").split(",") if v.strip()]
            except ValueError:
                from ..errors import UsageError

                raise UsageError(f"--ego-from-body: expected 16 numbers (commas) or a YAML file, got {ego_from_body!r}") from None
            matrix = parse_ego_from_body(numbers, "--ego-from-body", "")
    options = KalibrOptions(body=body, ego_from_body=matrix, names=split_names(names))
    data = import_kalibr(camchain, template=_template(template), name=name or camchain.stem.replace(" ", "_"), options=options)
    header = [f"imported by bevcompile import kalibr from {camchain}", f"body frame {body}" + ("" if matrix is None else f", ego_from_body {ego_from_body}")]
    _emit(data, str(camchain), out, header, quiet, json_output)


@cli_command("nuscenes", parent=import_app, writes="file", short_help="One scene's cameras and LIDAR_TOP from the nuScenes devkit tables.")
def import_nuscenes_command(
    dataroot: Annotated[Path, typer.Option("--dataroot", help="The nuScenes folder (holds <version>/scene.json, ...).", show_default=False)],
    version: Annotated[str, typer.Option("--version", help="The table folder, e.g. v1.0-mini, v1.0-trainval.", show_default=False)],
    scene: Annotated[str, typer.Option("--scene", help="The scene name, e.g. scene-0103.", show_default=False)],
    cameras: Annotated[
        str | None,
        typer.Option("--cameras", help="Camera channels in rig order, comma-separated (default: CAM_FRONT, CAM_FRONT_RIGHT, CAM_FRONT_LEFT, CAM_BACK, CAM_BACK_LEFT, CAM_BACK_RIGHT).", show_default=False),
    ] = None,
    template: TemplateOption = None,
    name: NameOption = None,
    out: OutFileOption = None,
    quiet: QuietOption = False,
    json_output: JsonOption = False,
) -> None:
    """Import the calibration of one nuScenes scene's vehicle: the cameras (calibrated_sensor records
    verbatim, undistorted images) and LIDAR_TOP as a sensor, from the devkit's JSON tables."""
    from ..rig.importers.nuscenes import nuscenes_rig, split_cameras

    data = nuscenes_rig(dataroot, version, scene, template=_template(template), cameras=split_cameras(cameras), name=name)
    header = [f"imported by bevcompile import nuscenes --dataroot {dataroot} --version {version} --scene {scene}"]
    _emit(data, str(Path(dataroot) / version), out, header, quiet, json_output)


@cli_command("opencv", parent=import_app, writes="file", short_help="One camera's OpenCV FileStorage calibration, merged into a rig.")
def import_opencv_command(
    file: Annotated[Path, typer.Argument(help="OpenCV FileStorage YAML (camera_matrix, distortion_coefficients, image_width/height, R/T or a 4x4).", show_default=False, metavar="FILE")],
    camera: Annotated[str, typer.Option("--camera", help="The rig camera the file calibrates (replaced, or added when the rig has none of that name).", show_default=False)],
    rig: Annotated[Path | None, typer.Option("--rig", help="The rig config to merge into (default: the bundled nuScenes rig).", show_default=False, metavar="CONFIG")] = None,
    extrinsics: Annotated[
        str, typer.Option("--extrinsics", help="Direction of R/T: ego-to-cam (OpenCV's, p_cam = R p_ego + T) or cam-to-ego.", metavar="ego-to-cam|cam-to-ego")
    ] = "ego-to-cam",
    lens: Annotated[
        str, typer.Option("--lens", help="auto (the file's distortion_model, else OpenCV radial-tangential), opencv or fisheye.", metavar="auto|opencv|fisheye")
    ] = "auto",
    name: NameOption = None,
    out: OutFileOption = None,
    quiet: QuietOption = False,
    json_output: JsonOption = False,
) -> None:
    """Merge one camera's OpenCV calibration into a rig config: the fields the file holds replace the
    camera's (intrinsics, distortion, image size, pose), numbers copied exactly."""
    from ..choices import canonical_choice
    from ..rig.importers.opencv import EXTRINSICS, LENSES, import_opencv

    data = import_opencv(
        file, rig=rig, camera=camera, name=name, extrinsics=canonical_choice(extrinsics, EXTRINSICS), lens=canonical_choice(lens, LENSES)
    )
    header = [f"imported by bevcompile import opencv: camera {camera} from {file} merged into {rig or 'the bundled nuScenes rig'}"]
    _emit(data, str(file), out, header, quiet, json_output)
