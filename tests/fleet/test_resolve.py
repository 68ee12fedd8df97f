"""A vehicle's resolved config: the same config whichever way its calibration is given, importer
sources equal the import commands, overlays change what they say, errors name the file they are in."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from bevcompile.errors import ConfigError
from bevcompile.fleet.manifest import load_manifest
from bevcompile.fleet.resolve import resolve_vehicle
from bevcompile.rig.config import config_to_dict, parse_config
from bevcompile.rig.importers.kalibr import KalibrOptions, import_kalibr
from bevcompile.rig.importers.nuscenes import nuscenes_rig
from bevcompile.rig.importers.opencv import import_opencv

from ..rig.importers.test_kalibr import camchain, write_kalibr
from ..rig.importers.test_nuscenes import SCENE, write_tables
from ..rig.importers.test_opencv import K, write_opencv
from ..rigs import NUSCENES_YAML, small_rig_data
from .fleets import template


def _manifest(folder: Path, vehicles: list[dict[str, Any]], model: dict[str, Any] | None = None) -> Any:
    (folder / "model.yaml").write_text(yaml.safe_dump(model if model is not None else template()))
    path = folder / "fleet.yaml"
    path.write_text(yaml.safe_dump({"products": {"grid": {}}, "template": "model.yaml", "vehicles": vehicles}))
    return load_manifest(path)


def _resolve(m: Any, index: int) -> Any:
    return resolve_vehicle(m.vehicles[index], m.template, m.path)


def test_a_rig_file_cameras_file_and_inline_cameras_resolve_to_the_same_config(tmp_path: Path) -> None:
    rig = small_rig_data()
    (tmp_path / "rig.yaml").write_text(yaml.safe_dump(rig))
    (tmp_path / "cams.yaml").write_text(yaml.safe_dump({"cameras": rig["cameras"]}))
    (tmp_path / "cams-list.yaml").write_text(yaml.safe_dump(rig["cameras"]))
    m = _manifest(tmp_path, [
        {"id": "v", "rig": "rig.yaml"}, {"id": "v2", "cameras": "cams.yaml"}, {"id": "v3", "cameras": rig["cameras"]}, {"id": "v4", "cameras": "cams-list.yaml"},
    ])
    resolved = [config_to_dict(_resolve(m, i)) for i in range(4)]
    assert [r.pop("name") for r in resolved] == ["v", "v2", "v3", "v4"]  # the vehicle id names the store
    assert resolved[0] == resolved[1] == resolved[2] == resolved[3]
    assert config_to_dict(_resolve(m, 0)) == config_to_dict(parse_config({**rig, "name": "v"}))


def test_importer_sources_equal_the_import_commands(tmp_path: Path) -> None:
    write_kalibr(tmp_path / "camchain.yaml", camchain(2))
    write_tables(tmp_path / "nuscenes")
    write_opencv(tmp_path / "front.yml", camera_matrix=K)
    kalibr_model = {**template(), "image_aug": {"resize": 1.0, "crop": [0, 0], "input_size": [752, 480]}, "feature": {"stride": 16}}
    nuscenes_model = {k: v for k, v in yaml.safe_load(NUSCENES_YAML.read_text()).items() if k not in ("name", "cameras", "sensors", "description")}
    m = _manifest(tmp_path, [
        {"id": "n", "import": {"nuscenes": "nuscenes", "version": "v1.0-mini", "scene": SCENE}},
        {"id": "o", "rig": str(NUSCENES_YAML), "import": {"opencv": "front.yml", "camera": "CAM_FRONT"}},
    ], model=nuscenes_model)
    (tmp_path / "k").mkdir()
    kalibr_manifest = _manifest(tmp_path / "k", [{"id": "k", "import": {"kalibr": "../camchain.yaml", "body": "imu", "names": ["F", "B"]}}], model=kalibr_model)
    want_k = import_kalibr(tmp_path / "camchain.yaml", template=kalibr_model, name="k", options=KalibrOptions(body="imu", names=("F", "B")))
    assert config_to_dict(_resolve(kalibr_manifest, 0)) == config_to_dict(parse_config(want_k))
    want_n = nuscenes_rig(tmp_path / "nuscenes", "v1.0-mini", SCENE, template=nuscenes_model, name="n")
    assert config_to_dict(_resolve(m, 0)) == config_to_dict(parse_config(want_n))
    assert [s.name for s in _resolve(m, 0).sensors] == ["LIDAR_TOP"]
    want_o = import_opencv(tmp_path / "front.yml", rig=NUSCENES_YAML, camera="CAM_FRONT", name="o")
    assert config_to_dict(_resolve(m, 1)) == config_to_dict(parse_config(want_o))


def test_an_overlay_changes_what_it_says_and_nothing_else(tmp_path: Path) -> None:
    (tmp_path / "nominal.yaml").write_text(NUSCENES_YAML.read_text())
    m = _manifest(tmp_path, [
        {"id": "v", "rig": "nominal.yaml"},
        {"id": "w", "rig": "nominal.yaml", "overlay": {"CAM_BACK": {"translation": [0.06, 0.01, 1.57]}, "CAM_FRONT": {"intrinsic": [[1250.0, 0, 826.0], [0, 1250.0, 470.0], [0, 0, 1]]}}},
    ])
    v, w = config_to_dict(_resolve(m, 0)), config_to_dict(_resolve(m, 1))
    assert w["cameras"][3]["translation"] == [0.06, 0.01, 1.57] and w["cameras"][3]["rotation_wxyz"] == v["cameras"][3]["rotation_wxyz"]
    assert w["cameras"][0]["intrinsic"][0][0] == 1250.0
    assert [w["cameras"][i] for i in (1, 2, 4, 5)] == [v["cameras"][i] for i in (1, 2, 4, 5)]
    assert {k: w[k] for k in w if k not in ("name", "cameras")} == {k: v[k] for k in v if k not in ("name", "cameras")}


@pytest.mark.parametrize(
    ("vehicle", "files", "source", "field", "message"),
    [
        ({"cameras": "cams.yaml"}, {"cams.yaml": {"cameras": "bad-rotation"}}, "cams.yaml", "cameras[1].rotation_wxyz", "quaternion must be unit length"),
        ({"cameras": [{"name": "X"}]}, {}, "fleet.yaml", "vehicles[0].cameras[0].image_size", "missing required field"),
        ({"rig": "rig.yaml", "overlay": {"FRONT": {"translation": [1.5, 0.0]}}}, {"rig.yaml": "rig"}, "fleet.yaml", "vehicles[0].overlay.FRONT.translation", "the camera's pose is a sensor2ego matrix"),
        ({"rig": "rig.yaml", "overlay": {"FRONT": {"rotation_wxyz": [1, 0, 0, 0], "translation": [1.5, 0.0]}}}, {"rig.yaml": "rig"}, "fleet.yaml", "vehicles[0].overlay.FRONT.translation", "expected 3 values, got 2"),
        ({"rig": "rig.yaml", "overlay": {"SIDE": {"translation": [0, 0, 1]}}}, {"rig.yaml": "rig"}, "fleet.yaml", "vehicles[0].overlay.SIDE", "no camera 'SIDE'"),
        ({"cameras": "cams.yaml"}, {"cams.yaml": {"cameras": "ok"}, "model.yaml": "bad-bev"}, "model.yaml", "bev.x[2]", "step must be > 0"),
        ({"cameras": "cams.yaml"}, {"cams.yaml": {"cameras": "ok", "image_aug": {}}}, "cams.yaml", "image_aug", "not part of a camera list"),
        ({"rig": "missing.yaml"}, {}, "missing.yaml", "", "file not found"),
    ],
)
def test_errors_name_the_file_and_field_the_wrong_value_is_in(tmp_path: Path, vehicle: dict[str, Any], files: dict[str, Any], source: str, field: str, message: str) -> None:
    rig = small_rig_data()
    model = template()
    for name, content in files.items():
        if content == "rig":
            content = rig
        elif content == "bad-bev":
            model = {**model, "bev": {**model["bev"], "x": [-12.0, 12.0, -1.0]}}
            continue
        elif isinstance(content, dict) and content.get("cameras") in ("ok", "bad-rotation"):
            cameras = [dict(c) for c in rig["cameras"]]
            if content["cameras"] == "bad-rotation":
                cameras[1].pop("sensor2ego")
                cameras[1].update(rotation_wxyz=[1.0, 0.5, 0.0, 0.0], translation=[0.0, 0.0, 1.0])
            content = {**content, "cameras": cameras}
        (tmp_path / name).write_text(yaml.safe_dump(content))
    m = _manifest(tmp_path, [{"id": "v", **vehicle}], model=model)
    with pytest.raises(ConfigError) as info:
        _resolve(m, 0)
    assert info.value.source == str(tmp_path / source) and info.value.field == field
    assert message in info.value.message and "\n" not in str(info.value)
