"""nuScenes devkit tables -> rig config: written in the devkit's schema from the REAL records of
scene-0103 (tests/data/calib/nuscenes.yaml), the import equals the shipped rig number for number.

Schema restated from nutonomy/nuscenes-devkit ``docs/schema_nuscenes.md`` (commit
3fb15aa3b17180a059ef15b3d143b5a5c7d21160): ``scene`` (token, name, description, log_token,
nbr_samples, first_sample_token, last_sample_token), ``sample`` (token, timestamp, scene_token,
next, prev), ``sample_data`` (token, sample_token, ego_pose_token, calibrated_sensor_token,
filename, fileformat, width, height, timestamp, is_key_frame, next, prev), ``calibrated_sensor``
(token, sensor_token, translation [3], rotation [4] w x y z, camera_intrinsic [3, 3], empty for
other sensors), ``sensor`` (token, channel, modality camera/lidar/radar), ``log`` (token, logfile,
vehicle, date_captured, location); each table is a JSON list of records in ``<dataroot>/<version>/``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

import bevcompile.rig.importers.nuscenes as nuscenes_mod
from bevcompile.errors import ConfigError
from bevcompile.grid.build import run_grid
from bevcompile.rig.config import load_config, parse_config
from bevcompile.rig.importers.nuscenes import iter_json_array, nuscenes_rig
from bevcompile.store.zarr_io import open_store

from ...rigs import NUSCENES_YAML, ROOT

CALIB = ROOT / "tests" / "data" / "calib" / "nuscenes.yaml"
SCENE = "scene-0103"
FIRST_SAMPLE = "e93e98b63d3b40209056d129dc53ceee"
LIDAR_TOKEN = "dc8b396651c05aedbb9cdaae573bb567"


def _token(text: str) -> str:
    import hashlib

    return hashlib.md5(text.encode()).hexdigest()


def write_tables(dataroot: Path, version: str = "v1.0-mini") -> Path:
    """The six tables of a tiny nuScenes: scene-0103 with the real calibrated_sensor records of its
    six cameras and LIDAR_TOP (plus a radar, a non-key-frame sweep, and a second scene of another log)."""
    calib = yaml.safe_load(CALIB.read_text())
    folder = dataroot / version
    folder.mkdir(parents=True)
    log, other_log = _token("log"), _token("other-log")
    second_sample, other_sample = _token("sample-2"), _token("other-sample")
    tables: dict[str, list[dict[str, Any]]] = {t: [] for t in ("scene", "sample", "sample_data", "calibrated_sensor", "sensor", "log")}
    tables["log"] = [
        {"token": other_log, "logfile": "n015-2018-07-24-11-22-45+0800", "vehicle": "n015", "date_captured": "2018-07-24", "location": "singapore-onenorth"},
        {"token": log, "logfile": "n008-2018-08-01-15-16-36-0400", "vehicle": "n008", "date_captured": "2018-08-01", "location": "boston-seaport"},
    ]
    tables["scene"] = [
        {"token": _token("other-scene"), "name": "scene-0061", "description": "other", "log_token": other_log, "nbr_samples": 1,
         "first_sample_token": other_sample, "last_sample_token": other_sample},
        {"token": _token("scene"), "name": SCENE, "description": "Night, peds", "log_token": log, "nbr_samples": 2,
         "first_sample_token": FIRST_SAMPLE, "last_sample_token": second_sample},
    ]
    tables["sample"] = [
        {"token": other_sample, "timestamp": 1, "scene_token": _token("other-scene"), "prev": "", "next": ""},
        {"token": FIRST_SAMPLE, "timestamp": 1533151603512404, "scene_token": _token("scene"), "prev": "", "next": second_sample},
        {"token": second_sample, "timestamp": 1533151604012404, "scene_token": _token("scene"), "prev": FIRST_SAMPLE, "next": ""},
    ]
    records = [(c["name"], "camera", c["calibrated_sensor_token"], c["sensor_token"], c) for c in calib["cameras"]]
    lidar = calib["sensors"][0]
    records.append(("LIDAR_TOP", "lidar", _token("lidar-calib"), LIDAR_TOKEN, {**lidar, "intrinsic": []}))
    records.append(("RADAR_FRONT", "radar", _token("radar-calib"), _token("radar"), {"rotation_wxyz": [1.0, 0.0, 0.0, 0.0], "translation": [3.4, 0.0, 0.5], "intrinsic": []}))
    for channel, modality, calib_token, sensor_token, record in records:
        tables["sensor"].append({"token": sensor_token, "channel": channel, "modality": modality})
        tables["calibrated_sensor"].append({
            "token": calib_token, "sensor_token": sensor_token, "translation": record["translation"],
            "rotation": record["rotation_wxyz"], "camera_intrinsic": record["intrinsic"],
        })
        width, height = record.get("image_size", [0, 0])
        for sample, key in ((FIRST_SAMPLE, True), (FIRST_SAMPLE, False), (second_sample, True)):
            tables["sample_data"].append({
                "token": _token(f"{channel}{sample}{key}"), "sample_token": sample, "ego_pose_token": _token("pose"),
                "calibrated_sensor_token": calib_token, "timestamp": 0, "fileformat": "jpg" if modality == "camera" else "pcd",
                "is_key_frame": key, "height": height, "width": width,
                "filename": record.get("image_file", f"samples/{channel}/x.bin"), "prev": "", "next": "",
            })
    for name, rows in tables.items():
        (folder / f"{name}.json").write_text(json.dumps(rows, indent=0))
    return dataroot


def test_scene_imports_the_shipped_rig_number_for_number(tmp_path: Path) -> None:
    dataroot = write_tables(tmp_path / "nuscenes")
    data = nuscenes_rig(dataroot, "v1.0-mini", SCENE)
    rig, shipped = parse_config(data), load_config(NUSCENES_YAML)
    assert rig.name == SCENE and rig.camera_names == shipped.camera_names
    for ours, theirs in zip(rig.cameras, shipped.cameras, strict=True):
        assert ours.intrinsic == theirs.intrinsic and ours.rotation_wxyz == theirs.rotation_wxyz
        assert ours.translation == theirs.translation and (ours.image_width, ours.image_height) == (theirs.image_width, theirs.image_height)
        assert ours.distortion == theirs.distortion and ours.image_aug == theirs.image_aug
    assert [s.name for s in rig.sensors] == ["LIDAR_TOP"]
    assert rig.sensors[0].rotation_wxyz == shipped.sensor("LIDAR_TOP").rotation_wxyz
    assert rig.sensors[0].translation == shipped.sensor("LIDAR_TOP").translation
    assert "n008-2018-08-01-15-16-36-0400" in str(rig.description) and "boston-seaport" in str(rig.description)
    assert (rig.feature, rig.bev, rig.depth) == (shipped.feature, shipped.bev, shipped.depth)  # the bundled model settings
    # the tables built from the imported rig are the shipped rig's, array for array
    ours_store = run_grid(rig, tmp_path / "ours").store
    theirs_store = run_grid(shipped, tmp_path / "theirs").store
    for group in ("grid", "gather", "delta"):
        a, b = open_store(ours_store), open_store(theirs_store)
        assert {n: a.array_info(group, n).attrs["sha256"] for n in a.arrays(group)} == {n: b.array_info(group, n).attrs["sha256"] for n in b.arrays(group)}


def test_camera_choice_order_and_name(tmp_path: Path) -> None:
    dataroot = write_tables(tmp_path / "nuscenes")
    rig = parse_config(nuscenes_rig(dataroot, "v1.0-mini", SCENE, cameras=("CAM_BACK", "CAM_FRONT"), name="car-n008", lidar=False))
    assert rig.camera_names == ("CAM_BACK", "CAM_FRONT") and rig.name == "car-n008" and rig.sensors == ()


@pytest.mark.parametrize(
    ("call", "source", "field", "message"),
    [
        (lambda d: nuscenes_rig(d, "v1.0-mini", "scene-9999"), "scene.json", "", "no record with name 'scene-9999' (--scene)"),
        (lambda d: nuscenes_rig(d, "v1.0-mini", SCENE, cameras=("CAM_SIDE",)), "sample_data.json", "--cameras", "scene-0103 has no camera 'CAM_SIDE'"),
        (lambda d: nuscenes_rig(d, "v1.0-trainval", SCENE), "v1.0-trainval", "", "no such folder"),
        (lambda d: nuscenes_rig(d, "v1.0-mini", SCENE, name="car 1"), "scene.json", "--name", "must be a file-name-safe identifier"),
    ],
)
def test_bad_requests_name_the_table_and_the_field(tmp_path: Path, call, source: str, field: str, message: str) -> None:  # type: ignore[no-untyped-def]
    dataroot = write_tables(tmp_path / "nuscenes")
    with pytest.raises(ConfigError) as info:
        call(dataroot)
    assert info.value.source.endswith(source) and info.value.field == field and message in info.value.message


def test_bad_records_name_the_table_record_and_field(tmp_path: Path) -> None:
    dataroot = write_tables(tmp_path / "nuscenes")
    path = dataroot / "v1.0-mini" / "calibrated_sensor.json"
    rows = json.loads(path.read_text())
    rows[2]["camera_intrinsic"] = [[1.0, 0.0], [0.0, 1.0]]
    path.write_text(json.dumps(rows))
    with pytest.raises(ConfigError) as info:
        nuscenes_rig(dataroot, "v1.0-mini", SCENE)
    assert info.value.source == str(path) and info.value.field == "[2].camera_intrinsic" and "expected 3 values, got 2" in info.value.message
    (dataroot / "v1.0-mini" / "log.json").write_text('[{"token": "x"}, ')
    with pytest.raises(ConfigError, match=r"log\.json: \[1\]: file ends inside the array"):
        nuscenes_rig(dataroot, "v1.0-mini", SCENE)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.dictionaries(st.text(max_size=5), st.one_of(st.integers(), st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=20), st.booleans()), max_size=4), max_size=12),
    st.integers(1, 9),
)
def test_streamed_tables_equal_json_load_for_any_chunking(records: list[dict[str, Any]], chunk: int) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "table.json"
        path.write_text(json.dumps(records, indent=1))
        original = nuscenes_mod.READ_CHUNK
        nuscenes_mod.READ_CHUNK = chunk
        try:
            assert [r for _, r in iter_json_array(path)] == json.loads(path.read_text())
        finally:
            nuscenes_mod.READ_CHUNK = original


@pytest.mark.parametrize(
    ("text", "field", "message"),
    [('{"a": 1}', "", "not a JSON array"), ("[1 2]", "[1]", "expected ',' between records"), ("[1, {", "[1]", "invalid JSON"), ("", "", "not a JSON array")],
)
def test_a_table_that_is_not_a_json_array_is_a_one_line_error(tmp_path: Path, text: str, field: str, message: str) -> None:
    path = tmp_path / "t.json"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        list(iter_json_array(path))
    assert info.value.field == field and message in info.value.message
