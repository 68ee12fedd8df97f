"""`bevcompile import kalibr|nuscenes|opencv`: the rig YAML written (or printed), what it says,
and one-line errors with exit 2 (the importers themselves: tests/rig/importers/)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from bevcompile.cli import app
from bevcompile.rig.config import load_config

from ..rig.importers.test_kalibr import _template, camchain, write_kalibr
from ..rig.importers.test_nuscenes import CALIB, SCENE, write_tables
from ..rig.importers.test_opencv import DIST, K, _pose, write_opencv
from ..rigs import NUSCENES_YAML

runner = CliRunner()


def test_cli_writes_the_rig_yaml_and_it_builds(tmp_path: Path) -> None:
    path = write_kalibr(tmp_path / "camchain.yaml", camchain(2))
    template = tmp_path / "model.yaml"
    template.write_text(yaml.safe_dump(_template()))
    out = tmp_path / "rigs" / "car.yaml"
    result = runner.invoke(app, ["import", "kalibr", str(path), "--template", str(template), "--names", "FRONT,BACK", "--name", "car", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert f"wrote {out}: rig car, 2 camera(s) FRONT, BACK" in " ".join(result.stdout.split())
    rig = load_config(out)
    assert rig.camera_names == ("FRONT", "BACK") and rig.name == "car"
    printed = runner.invoke(app, ["import", "kalibr", str(path), "--template", str(template), "--names", "FRONT,BACK", "--name", "car"])
    assert printed.exit_code == 0 and yaml.safe_load(printed.stdout) == yaml.safe_load(out.read_text())
    body = runner.invoke(app, ["import", "kalibr", str(path), "--template", str(template), "--body", "cam1", "--ego-from-body", "1,0,0,0, 0,1,0,0, 0,0,1,0, 0,0,0,1"])
    assert body.exit_code == 0, body.output
    moved = yaml.safe_load(body.stdout)["cameras"][1]["sensor2ego"]
    assert np.allclose(moved, np.eye(4), atol=1e-14)  # the body camera is the ego frame


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--body", "cam0"], "{path}: --ego-from-body: required with --body cam0"),
        (["--ego-from-body", "1,2,3"], "--ego-from-body: expected 16 numbers (the 4x4 row by row) or a 4x4 list, got 3 number(s)"),
        (["--body", "lidar"], "{path}: --body: must be imu, camK (cam0, cam1, ...) or auto, got 'lidar'"),
    ],
)
def test_cli_errors_are_one_line_exit_2(tmp_path: Path, args: list[str], expected: str) -> None:
    data = camchain(2)
    data["cam1"].pop("T_cam_imu")  # so --body defaults to cam0
    path = write_kalibr(tmp_path / "camchain.yaml", data)
    result = runner.invoke(app, ["import", "kalibr", str(path), *args])
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("error: " + expected.format(path=path)) and result.stderr.count("\n") == 1


def test_cli_template_that_does_not_fit_the_image_says_so(tmp_path: Path) -> None:
    """The bundled template (1600x900 images resized 0.44) does not fit a 752x480 camera: the
    import's validation names the field and the camera, exit 2, nothing written."""
    path = write_kalibr(tmp_path / "camchain.yaml", camchain(1))
    out = tmp_path / "car.yaml"
    result = runner.invoke(app, ["import", "kalibr", str(path), "--out", str(out)])
    assert result.exit_code == 2
    assert result.stderr.startswith(f"error: {path} (imported): image_aug.crop: crop window") and "camera 'cam0'" in result.stderr
    assert not out.exists()


def test_cli_import_nuscenes_writes_cameras_and_lidar(tmp_path: Path) -> None:
    dataroot = write_tables(tmp_path / "nuscenes")
    out = tmp_path / "scene-0103.yaml"
    result = runner.invoke(app, ["import", "nuscenes", "--dataroot", str(dataroot), "--version", "v1.0-mini", "--scene", SCENE, "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "6 camera(s) CAM_FRONT, CAM_FRONT_RIGHT" in " ".join(result.stdout.split()) and "sensors LIDAR_TOP" in result.stdout
    data = yaml.safe_load(out.read_text())
    assert [s["name"] for s in data["sensors"]] == ["LIDAR_TOP"]
    assert np.array_equal(data["cameras"][0]["intrinsic"], yaml.safe_load(CALIB.read_text())["cameras"][0]["intrinsic"])
    missing = runner.invoke(app, ["import", "nuscenes", "--dataroot", str(dataroot), "--version", "v1.0-mini", "--scene", "scene-1"])
    assert missing.exit_code == 2
    assert missing.stderr == f"error: {dataroot / 'v1.0-mini' / 'scene.json'}: no record with name 'scene-1' (--scene)\n"


def test_cli_import_opencv(tmp_path: Path) -> None:
    rvec, tvec = _pose()
    path = write_opencv(tmp_path / "front.yml", image_width=1600, image_height=900, camera_matrix=K, distortion_coefficients=DIST, rvec=rvec, tvec=tvec)
    out = tmp_path / "car.yaml"
    result = runner.invoke(app, ["import", "opencv", str(path), "--camera", "CAM_FRONT", "--rig", str(NUSCENES_YAML), "--name", "car", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert load_config(out).cameras[0].intrinsic == tuple(tuple(r) for r in K.tolist())
    bad = runner.invoke(app, ["import", "opencv", str(path), "--camera", "CAM_FRONT", "--lens", "catadioptric"])
    assert bad.exit_code == 2 and bad.stderr == f"error: {path}: --lens: must be one of auto, opencv, fisheye, got 'catadioptric'\n"
