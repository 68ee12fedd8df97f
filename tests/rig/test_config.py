"""Rig config: the shipped configs, the canonical form and hash, and every bad input."""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st
from scipy.spatial.transform import Rotation

from bevcompile.errors import ConfigError
from bevcompile.rig.config import (
    config_sha256,
    config_to_dict,
    default_config_path,
    dump_config_yaml,
    load_config,
    parse_config,
    read_config_data,
    read_opencv_yaml,
    rotation_from_quaternion_wxyz,
    write_config_yaml,
)

from ..rigs import DISTORTED_YAML, NUSCENES_YAML, ROOT, nuscenes_data, small_rig_data, write_yaml

CALIB = Path(__file__).parents[1] / "data" / "calib"


# -- the shipped configs -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("config_path", "calib_name"),
    [(NUSCENES_YAML, "nuscenes.yaml"), (DISTORTED_YAML, "nuscenes_scene0061.yaml")],
)
def test_shipped_configs_use_the_real_calibration_verbatim(config_path: Path, calib_name: str) -> None:
    """Same numbers as the nuScenes calibrated_sensor records (tests/data/calib), no rounding: the
    six cameras and the car's LIDAR_TOP."""
    calib = yaml.safe_load((CALIB / calib_name).read_text())
    ours = yaml.safe_load(config_path.read_text())
    assert [c["name"] for c in ours["cameras"]] == [c["name"] for c in calib["cameras"]]
    for mine, real in zip(ours["cameras"], calib["cameras"], strict=True):
        for key in ("image_size", "intrinsic", "rotation_wxyz", "translation"):
            assert mine[key] == real[key], (mine["name"], key)
        assert real["calibrated_sensor_token"] in mine["description"]
    assert [s["name"] for s in ours["sensors"]] == [s["name"] for s in calib["sensors"]] == ["LIDAR_TOP"]
    for key in ("rotation_wxyz", "translation"):
        assert ours["sensors"][0][key] == calib["sensors"][0][key], key
    assert "../shared" not in config_path.read_text()


SYNTHETIC_CONFIGS = {"ring-6cam.yaml": "a synthetic benchmark rig (six identical level cameras on a ring): no car, no lidar"}


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_nuscenes_config_lists_the_lidar_and_keeps_the_ego_frame(path: Path) -> None:
    data = yaml.safe_load(path.read_text())
    if path.name in SYNTHETIC_CONFIGS:
        pytest.skip(SYNTHETIC_CONFIGS[path.name])
    if "feature" not in data:  # the calibration alone: a preset line makes it a rig
        data["preset"] = "bevdet-r50"
    rig = parse_config(data, source=str(path))
    lidar = rig.sensor("LIDAR_TOP")
    assert rig.bev.frame == "ego" and rig.bev_frame_sensor is None
    # nuScenes LIDAR_TOP: ~0.94-0.99 m ahead of the rear axle, 1.84 m up, x right / y forward (yaw ~ -90 deg)
    t = [row[3] for row in lidar.ego_from_sensor[:3]]
    assert 0.9 < t[0] < 1.0 and t[1] == 0.0 and abs(t[2] - 1.84) < 1e-3
    x_axis_in_ego = [row[0] for row in lidar.ego_from_sensor[:3]]
    assert x_axis_in_ego[1] < -0.99  # lidar x points to the ego's right (-y)


def test_bundled_default_is_the_nuscenes_config() -> None:
    assert default_config_path().read_bytes() == NUSCENES_YAML.read_bytes()
    assert config_sha256(load_config(None)) == config_sha256(load_config(NUSCENES_YAML))


def test_nuscenes_settings_are_bevdet_r50(nuscenes: Any) -> None:
    assert nuscenes.n_cam == 6
    assert nuscenes.input_size == (704, 256)
    assert nuscenes.feature_size == (44, 16)
    assert (nuscenes.bev.nx, nuscenes.bev.ny) == (128, 128)
    assert nuscenes.depth.n_bins == 59
    assert nuscenes.depth.values()[0] == 1.0 and nuscenes.depth.values()[-1] == 59.0


def test_distorted_config_says_its_coefficients_are_illustrative(distorted: Any) -> None:
    text = DISTORTED_YAML.read_text()
    assert "ILLUSTRATIVE" in text
    models = {c.distortion.model for c in distorted.cameras}
    assert models == {"opencv", "fisheye"}
    assert {c.distortion.n_coeffs_given for c in distorted.cameras if c.distortion.model == "opencv"} == {4, 5, 8}


def test_quaternion_matches_scipy() -> None:
    rng = np.random.default_rng(0)
    for _ in range(20):
        q = rng.normal(size=4)
        q /= np.linalg.norm(q)
        ours = np.array(rotation_from_quaternion_wxyz(q))
        ref = Rotation.from_quat([q[1], q[2], q[3], q[0]]).as_matrix()  # scipy: scalar-last
        np.testing.assert_allclose(ours, ref, atol=1e-12)


# -- canonical form ---------------------------------------------------------------------------


@pytest.mark.parametrize("path", [NUSCENES_YAML, DISTORTED_YAML])
def test_resolved_config_reparses_to_the_same_config_and_hash(path: Path) -> None:
    rig = load_config(path)
    again = parse_config(config_to_dict(rig), source="<resolved>")
    assert config_to_dict(again) == config_to_dict(rig)
    assert config_sha256(again) == config_sha256(rig)


def test_hash_ignores_descriptions_but_not_numbers() -> None:
    data = small_rig_data()
    base = config_sha256(parse_config(data))
    described = copy.deepcopy(data)
    described["description"] = "a comment"
    described["cameras"][0]["description"] = "another"
    assert config_sha256(parse_config(described)) == base
    moved = copy.deepcopy(data)
    moved["cameras"][0]["sensor2ego"][0][3] += 1e-9
    assert config_sha256(parse_config(moved)) != base


def test_per_camera_image_aug_override_merges_over_the_shared_one() -> None:
    data = small_rig_data()
    data["cameras"][1]["image_aug"] = {"resize": 0.6, "crop": [4, 2]}
    rig = parse_config(data)
    assert (rig.cameras[0].image_aug.resize, rig.cameras[0].image_aug.crop_left) == (0.5, 0.0)
    aug = rig.cameras[1].image_aug
    assert (aug.resize, aug.crop_left, aug.crop_top, aug.input_width) == (0.6, 4.0, 2.0, 96)


LIDAR_TOP = {
    "name": "LIDAR_TOP",
    "rotation_wxyz": [0.706749235646644, -0.015300993788500868, 0.01739745181256607, -0.7070846669051719],
    "translation": [0.985793, 0.0, 1.84019],
}


def _with_lidar_frame(data: dict[str, Any], frame: str = "LIDAR_TOP") -> dict[str, Any]:
    data = copy.deepcopy(data)
    data["sensors"] = [copy.deepcopy(LIDAR_TOP)]
    data["bev"]["frame"] = frame
    return data


def test_sensors_and_bev_frame_round_trip_and_enter_the_hash() -> None:
    bare = nuscenes_data()
    del bare["sensors"]
    plain = parse_config(bare)
    with_sensor = parse_config(nuscenes_data())  # the shipped config lists LIDAR_TOP, frame ego
    framed = parse_config(_with_lidar_frame(nuscenes_data()))
    assert (plain.sensors, plain.bev.frame) == ((), "ego")
    assert with_sensor.bev.frame == "ego" and with_sensor.bev_frame_sensor is None
    assert framed.bev_frame_sensor is framed.sensors[0] and framed.bev.frame == "LIDAR_TOP"
    # ego-frame configs without sensors resolve exactly as before (no new keys: their hash is kept)
    assert "sensors" not in config_to_dict(plain) and "frame" not in config_to_dict(plain)["bev"]
    resolved = config_to_dict(framed)
    assert [{k: v for k, v in sensor.items() if k != "description"} for sensor in resolved["sensors"]] == [LIDAR_TOP]
    assert resolved["bev"]["frame"] == "LIDAR_TOP"
    again = parse_config(resolved)
    assert (again.sensors, again.bev) == (framed.sensors, framed.bev)
    assert config_to_dict(again) == resolved
    hashes = {config_sha256(r) for r in (plain, with_sensor, framed)}
    assert len(hashes) == 3
    # the sensor's pose, given as a matrix, round-trips as a matrix and agrees with the quaternion
    as_matrix = copy.deepcopy(resolved)
    del as_matrix["sensors"][0]["rotation_wxyz"], as_matrix["sensors"][0]["translation"]
    as_matrix["sensors"][0]["sensor2ego"] = [list(r) for r in framed.sensors[0].ego_from_sensor]
    matrix_rig = parse_config(as_matrix)
    assert matrix_rig.sensors[0].ego_from_sensor == framed.sensors[0].ego_from_sensor
    assert config_to_dict(matrix_rig)["sensors"][0]["sensor2ego"] == as_matrix["sensors"][0]["sensor2ego"]
    described = copy.deepcopy(resolved)
    described["sensors"][0]["description"] = "other free text"
    assert config_sha256(parse_config(described)) == config_sha256(framed)


SENSOR_CASES: list[tuple[str, Any, str, str]] = [
    # id, edit of the framed config, field, phrase
    ("unknown-frame", ("bev", "frame", "LIDAR"), "bev.frame", "unknown frame 'LIDAR': expected 'ego' or one of the sensors: LIDAR_TOP"),
    ("frame-without-sensors", ("sensors", None, None), "bev.frame", "expected 'ego' or a sensor listed under sensors: (there is none)"),
    ("frame-not-a-string", ("bev", "frame", 3), "bev.frame", "expected a string, got int"),
    ("sensor-named-ego", ("name", "ego", None), "sensors[0].name", "'ego' is the ego frame itself"),
    ("sensor-named-like-a-camera", ("name", "CAM_BACK", None), "sensors[0].name", "also the name of cameras[3]"),
    ("sensor-unknown-key", ("intrinsic", [[1.0]], None), "sensors[0].intrinsic", "unknown field (allowed here: description, name, rotation_wxyz, sensor2ego, translation)"),
    ("sensor-without-pose", ("translation", _DELETE_MARK := "delete", None), "sensors[0].translation", "missing required field (or give sensor2ego: a 4x4 sensor -> ego matrix)"),
    ("sensor-bad-quaternion", ("rotation_wxyz", [1.0, 0.1, 0.0, 0.0], None), "sensors[0].rotation_wxyz", "quaternion must be unit length"),
    ("sensors-not-a-list", ("sensors", {"name": "LIDAR_TOP"}, None), "sensors", "expected a list, got mapping"),
]


@pytest.mark.parametrize(("case", "edit", "field", "phrase"), SENSOR_CASES, ids=[c[0] for c in SENSOR_CASES])
def test_bad_sensor_or_frame_is_named(tmp_path: Path, case: str, edit: Any, field: str, phrase: str) -> None:
    data = _with_lidar_frame(nuscenes_data())
    key, value, third = edit
    if key == "bev":
        data["bev"]["frame"] = third
    elif key == "sensors":
        if value is None:
            del data["sensors"]
        else:
            data["sensors"] = value
    elif value == "delete":
        del data["sensors"][0][key]
    else:
        data["sensors"][0][key] = value
    config = write_yaml(tmp_path / "rig.yaml", data)
    with pytest.raises(ConfigError) as info:
        load_config(config)
    assert str(info.value) == f"{config}: {field}: {info.value.message}"
    assert info.value.field == field and phrase in info.value.message, str(info.value)


def test_duplicate_sensor_names(tmp_path: Path) -> None:
    data = _with_lidar_frame(nuscenes_data())
    data["sensors"].append(copy.deepcopy(LIDAR_TOP))
    with pytest.raises(ConfigError, match=r"rig.yaml: sensors\[1\]\.name: duplicate sensor name 'LIDAR_TOP' \(also sensors\[0\]\)$"):
        load_config(write_yaml(tmp_path / "rig.yaml", data))


def test_sensor2ego_and_quaternion_forms_agree() -> None:
    data = nuscenes_data()
    rig = parse_config(data)
    as_matrix = copy.deepcopy(data)
    for cam, parsed in zip(as_matrix["cameras"], rig.cameras, strict=True):
        del cam["rotation_wxyz"], cam["translation"]
        cam["sensor2ego"] = [list(row) for row in parsed.ego_from_cam]
    rig2 = parse_config(as_matrix)
    for a, b in zip(rig.cameras, rig2.cameras, strict=True):
        assert a.ego_from_cam == b.ego_from_cam


# -- bad input: one line naming the file, the field path and the problem -----------------------


def _set(data: dict[str, Any], path: list[Any], value: Any) -> None:
    node: Any = data
    for key in path[:-1]:
        node = node[key]
    if value is _DELETE:
        del node[path[-1]]
    else:
        node[path[-1]] = value


_DELETE = object()

BAD_CASES: list[tuple[str, list[Any], Any, str, str]] = [
    # id, path, new value, expected field path, expected phrase
    ("missing-name", ["name"], _DELETE, "name", "missing required field"),
    ("unknown-top", ["camras"], [], "camras", "unknown field"),
    ("unknown-camera-key", ["cameras", 0, "intrinsics"], [[1]], "cameras[0].intrinsics", "unknown field"),
    ("missing-intrinsic", ["cameras", 2, "intrinsic"], _DELETE, "cameras[2].intrinsic", "missing required field"),
    ("wrong-type", ["cameras", 1, "image_size"], "1600x900", "cameras[1].image_size", "expected a list"),
    ("wrong-length", ["cameras", 2, "rotation_wxyz"], [1.0, 0.0, 0.0], "cameras[2].rotation_wxyz", "expected 4 values"),
    ("nan", ["cameras", 0, "translation", 1], float("nan"), "cameras[0].translation[1]", "must be finite"),
    ("inf", ["bev", "x", 1], float("inf"), "bev.x[1]", "must be finite"),
    ("bool-number", ["feature", "stride"], True, "feature.stride", "expected an integer"),
    ("non-unit-quat", ["cameras", 2, "rotation_wxyz"], [0.7, 0.7, 0.1, 0.2], "cameras[2].rotation_wxyz", "its norm is 1.01488916"),
    ("fx", ["cameras", 3, "intrinsic", 0, 0], 0.0, "cameras[3].intrinsic[0][0]", "fx must be > 0"),
    ("fy", ["cameras", 3, "intrinsic", 1, 1], -5.0, "cameras[3].intrinsic[1][1]", "fy must be > 0"),
    ("bottom-row", ["cameras", 0, "intrinsic", 2], [0.0, 0.1, 1.0], "cameras[0].intrinsic[2]", "bottom row must be [0, 0, 1]"),
    ("image-size", ["cameras", 4, "image_size", 1], 0, "cameras[4].image_size[1]", "must be in [1, 32768] pixels"),
    ("crop", ["image_aug", "crop"], [0, 141], "image_aug.crop", "outside the resized image"),
    ("crop-negative", ["image_aug", "crop"], [-1, 0], "image_aug.crop", "outside the resized image"),
    ("pad-negative", ["image_aug", "pad"], [0, -4], "image_aug.pad[1]", "must be >= 0, got -4"),
    ("pad-length", ["image_aug", "pad"], [4], "image_aug.pad", "expected 2 values"),
    ("pad-whole-input", ["image_aug", "pad"], [0, 256], "image_aug.pad", "must be smaller than input_size 704x256"),
    ("pad-window-outside", ["cameras", 1, "image_aug"], {"crop": [0, 300], "pad": [0, 32]}, "cameras[1].image_aug.crop",
     "input_size 704x256 - pad [0, 32] = 704x224 lies outside the resized image"),
    ("stride", ["feature", "stride"], 24, "image_aug.input_size", "not divisible by feature.stride 24"),
    ("step", ["bev", "y", 2], 0.0, "bev.y[2]", "step must be > 0"),
    ("min-max", ["bev", "x"], [10.0, -10.0, 0.5], "bev.x", "min must be < max"),
    ("too-many-cells", ["bev", "x"], [-5000.0, 5000.0, 0.01], "bev", "exceeds the limit of 100,000,000"),
    ("not-whole-steps", ["bev", "x"], [-51.2, 51.2, 0.7], "bev.x", "not a whole number of 0.7 m steps"),
    ("distortion-model", ["cameras", 0, "distortion"], {"model": "kb8"}, "cameras[0].distortion.model", "unknown model"),
    ("distortion-len", ["cameras", 0, "distortion"], {"model": "opencv", "coeffs": [0.1, 0.0, 0.0]}, "cameras[0].distortion.coeffs", "expected 4 or 5 or 8 values"),
    ("fisheye-len", ["cameras", 0, "distortion"], {"model": "fisheye", "coeffs": [0.1]}, "cameras[0].distortion.coeffs", "expected 4 values"),
    ("depth-step", ["depth", "bins"], [1.0, 60.0, -1.0], "depth.bins[2]", "step must be > 0"),
    ("heights-empty", ["bev", "heights"], [], "bev.heights", "at least one height"),
    ("name-unsafe", ["name"], "../evil", "name", "file-name-safe"),
    ("huge-integer", ["cameras", 0, "intrinsic", 0, 0], 10**400, "cameras[0].intrinsic[0][0]", "number too large (401 digits)"),
    ("huge-image-size", ["cameras", 1, "image_size", 0], 10**400, "cameras[1].image_size[0]", "integer too large (401 digits; at most 2,147,483,647)"),
    ("huge-input-size", ["image_aug", "input_size", 1], 10**20, "image_aug.input_size[1]", "integer too large (21 digits"),
    ("range-overflows", ["bev", "x"], [-1e308, 1e308, 1e300], "bev.x[0]", "must be within +-10000 m, got -1e+308"),
    ("tiny-step", ["bev", "y"], [-1.0, 1.0, 1e-300], "bev.y", "2e+300 steps of 1e-300 m from -1 to 1 m exceeds the limit of 100,000,000 cells"),
    ("depth-bins-overflow", ["depth", "bins"], [1.0, 1e308, 1e-300], "depth.bins[1]", "must be at most 10000 m, got 1e+308"),
    ("depth-bins-many", ["depth", "bins"], [1.0, 5000.0, 1.0], "depth.bins", "4999 depth bins is more than the limit of 4096"),
]


def test_stride_error_names_the_top_level_input_size_when_a_camera_overrides_other_fields(tmp_path: Path) -> None:
    data = nuscenes_data()
    data["image_aug"]["input_size"] = [700, 256]
    data["cameras"][0]["image_aug"] = {"crop": [0, 100]}
    config = write_yaml(tmp_path / "rig.yaml", data)
    with pytest.raises(ConfigError, match=r"rig.yaml: image_aug.input_size: input width 700 is not divisible by feature.stride 16$"):
        load_config(config)
    data["cameras"][0]["image_aug"] = {"input_size": [700, 256]}
    data["image_aug"]["input_size"] = [704, 256]
    with pytest.raises(ConfigError, match=r"rig.yaml: cameras\[0\].image_aug.input_size: input width 700 is not divisible"):
        load_config(write_yaml(tmp_path / "rig.yaml", data))


@pytest.mark.parametrize(("case", "path", "value", "field", "phrase"), BAD_CASES, ids=[c[0] for c in BAD_CASES])
def test_bad_field_is_named(tmp_path: Path, case: str, path: list[Any], value: Any, field: str, phrase: str) -> None:
    data = nuscenes_data()
    _set(data, path, value)
    config = write_yaml(tmp_path / "rig.yaml", data)
    with pytest.raises(ConfigError) as info:
        load_config(config)
    message = str(info.value)
    assert message.startswith(f"{config}: {field}: "), message
    assert phrase in message, message
    assert "\n" not in message


def test_convention_image_pad(tmp_path: Path) -> None:
    """BEVFormer-style: the 1600x900 image, no resize, padded at the bottom to 1600x928 (a multiple of 32).
    The crop window is input_size - pad; coordinates are unchanged by the padding; the feature map
    covers the padded input; the stored config carries ``pad`` only when it is not zero (so configs
    without padding keep their hash)."""
    data = nuscenes_data()
    data["image_aug"] = {"resize": 1.0, "crop": [0, 0], "input_size": [1600, 928], "pad": [0, 28]}
    data["feature"] = {"stride": 32, "pixel_mapping": "normalized"}
    rig = load_config(write_yaml(tmp_path / "rig.yaml", data))
    aug = rig.cameras[0].image_aug
    assert (aug.input_width, aug.input_height, aug.pad_right, aug.pad_bottom) == (1600, 928, 0, 28)
    assert rig.feature_size == (50, 29)
    assert config_to_dict(rig)["cameras"][0]["image_aug"]["pad"] == [0, 28]
    again = parse_config(config_to_dict(rig))
    assert config_sha256(again) == config_sha256(rig)
    assert [c.image_aug for c in again.cameras] == [c.image_aug for c in rig.cameras]
    # same augmentation without the padding field: no "pad" key, the hash of the unpadded form
    plain = load_config(NUSCENES_YAML)
    assert "pad" not in config_to_dict(plain)["cameras"][0]["image_aug"]
    data["image_aug"]["pad"] = [0, 0]
    data["image_aug"]["input_size"] = [1600, 896]
    unpadded = load_config(write_yaml(tmp_path / "unpadded.yaml", data))
    assert "pad" not in config_to_dict(unpadded)["cameras"][0]["image_aug"]
    # the crop window (not the padded input) must lie inside the image: 900 rows fit, 901 do not
    data["image_aug"] = {"input_size": [1600, 928], "pad": [0, 27]}
    with pytest.raises(ConfigError, match="input_size 1600x928 - pad \\[0, 27\\] = 1600x901 lies outside"):
        load_config(write_yaml(tmp_path / "bad.yaml", data))


def test_duplicate_camera_names(tmp_path: Path) -> None:
    data = nuscenes_data()
    data["cameras"][3]["name"] = "CAM_FRONT"
    with pytest.raises(ConfigError, match=r"cameras\[3\]\.name: duplicate camera name 'CAM_FRONT' \(also cameras\[0\]\)"):
        load_config(write_yaml(tmp_path / "rig.yaml", data))


def _matrix_rig(tmp_path: Path, rotation: list[list[float]]) -> Path:
    data = small_rig_data()
    data["cameras"][1]["sensor2ego"] = [[*rotation[i], 0.0] for i in range(3)] + [[0.0, 0.0, 0.0, 1.0]]
    return write_yaml(tmp_path / "rig.yaml", data)


def test_non_orthonormal_rotation_matrix(tmp_path: Path) -> None:
    config = _matrix_rig(tmp_path, [[1.0, 0.01, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    with pytest.raises(ConfigError, match=r"cameras\[1\]\.sensor2ego: rotation part is not orthonormal"):
        load_config(config)


def test_reflecting_rotation_matrix(tmp_path: Path) -> None:
    config = _matrix_rig(tmp_path, [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, -1.0]])
    with pytest.raises(ConfigError, match=r"cameras\[1\]\.sensor2ego: rotation part is a reflection \(det = -1\)"):
        load_config(config)


def test_pose_given_twice(tmp_path: Path) -> None:
    data = small_rig_data()
    data["cameras"][0]["translation"] = [0.0, 0.0, 1.0]
    with pytest.raises(ConfigError, match=r"cameras\[0\]\.sensor2ego: give either sensor2ego or rotation_wxyz"):
        load_config(write_yaml(tmp_path / "rig.yaml", data))


def test_cameras_must_share_the_input_size(tmp_path: Path) -> None:
    data = small_rig_data()
    data["cameras"][2]["image_aug"] = {"input_size": [88, 64]}
    with pytest.raises(ConfigError, match=r"cameras\[2\]\.image_aug\.input_size: 88x64 differs from cameras\[0\]"):
        load_config(write_yaml(tmp_path / "rig.yaml", data))


@pytest.mark.parametrize(
    ("text", "phrase"),
    [
        ("", "file is empty"),
        ("# only a comment\n", "file is empty"),
        ("name: [unclosed\n", "invalid YAML: line 2"),
        ("name: a\nname: b\n", "duplicate key 'name'"),
        ("- just\n- a list\n", "expected a mapping, got list"),
    ],
)
def test_unreadable_or_empty_yaml(tmp_path: Path, text: str, phrase: str) -> None:
    config = tmp_path / "rig.yaml"
    config.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(config)
    assert str(info.value).startswith(str(config)) and phrase in str(info.value)
    assert "\n" not in str(info.value)


def test_missing_file_and_directory(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="file not found"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="is a directory"):
        load_config(tmp_path)


def test_numbers_written_without_a_dot_are_accepted(tmp_path: Path) -> None:
    """PyYAML reads `1e-3` as a string; a deployment engineer means a number."""
    text = NUSCENES_YAML.read_text().replace("bins: [1.0, 60.0, 1.0]", "bins: [1e0, 6e1, 1e0]")
    config = tmp_path / "rig.yaml"
    config.write_text(text)
    assert load_config(config).depth.n_bins == 59


def test_depth_bin_count_matches_torch_arange() -> None:
    import torch

    for bins in ([1.0, 60.0, 1.0], [2.0, 58.0, 0.5], [1.0, 65.0, 1.0], [4.0, 45.0, 1.0], [1.0, 60.0, 0.7]):
        data = small_rig_data(depth_bins=tuple(bins))  # type: ignore[arg-type]
        assert parse_config(data).depth.n_bins == len(torch.arange(*bins)), bins


def test_every_field_of_the_example_is_documented() -> None:
    readme = (ROOT / "docs" / "config.md").read_text()
    for key in (
        "name", "description", "cameras", "image_size", "intrinsic", "distortion", "rotation_wxyz", "translation",
        "sensor2ego", "image_aug", "resize", "crop", "input_size", "feature", "stride", "pixel_mapping", "bev",
        "heights", "depth", "bins",
    ):
        assert f"`{key}`" in readme, key
    assert math.isfinite(1.0)


NUSCENES_TEXT = NUSCENES_YAML.read_text()


@pytest.mark.parametrize(
    ("old", "new", "phrase"),
    [
        ("name: nuscenes", "name: 2024-13-45", "invalid YAML: line 5, column 7: month must be in 1..12"),
        ("stride: 16", "stride: !!int 16px", "invalid YAML: line 58, column 11: invalid literal for int() with base 10: '16px'"),
        ("resize: 0.44", "resize: !!float 0.44x", "could not convert string to float: '0.44x'"),
        ("stride: 16", "stride: " + "1" * 5000, "invalid YAML: line 58, column 11: Exceeds the limit (4300 digits)"),
        ("name: nuscenes", "name: " + "[" * 1000 + "]" * 1000, "invalid YAML: line 5, column 38: nested more than 32 levels deep"),
        ("name: nuscenes", "name: nuscenes\n? [1, 2]\n: x", "invalid YAML: line 6, column 3: found unhashable key"),
    ],
    ids=["bad-date", "int-tag", "float-tag", "int-4300-digits", "deep-nesting", "list-key"],
)
def test_yaml_constructor_failures_are_one_line_config_errors(tmp_path: Path, old: str, new: str, phrase: str) -> None:
    """PyYAML's constructors raise ValueError / RecursionError / TypeError, not YAMLError: still one line."""
    assert old in NUSCENES_TEXT
    config = tmp_path / "rig.yaml"
    config.write_text(NUSCENES_TEXT.replace(old, new, 1))
    with pytest.raises(ConfigError) as info:
        load_config(config)
    message = str(info.value)
    assert message.startswith(f"{config}: invalid YAML: ") and phrase in message, message
    assert "\n" not in message


def test_yaml_merge_keys_share_fields_and_explicit_keys_override(tmp_path: Path) -> None:
    text = NUSCENES_TEXT.replace("  - name: CAM_FRONT\n", "  - &front\n    name: CAM_FRONT\n", 1)
    assert text != NUSCENES_TEXT
    text = text.replace("\nimage_aug:", "\n  - <<: *front\n    name: CAM_FRONT_COPY\n    translation: [0.0, 0.0, 2.0]\nimage_aug:", 1)
    config = tmp_path / "rig.yaml"
    config.write_text(text)
    rig = load_config(config)
    assert rig.camera_names[-1] == "CAM_FRONT_COPY" and rig.n_cam == 7
    front, copy_ = rig.cameras[0], rig.cameras[-1]
    assert copy_.intrinsic == front.intrinsic and copy_.rotation_wxyz == front.rotation_wxyz
    assert copy_.translation == (0.0, 0.0, 2.0) != front.translation
    # a key given twice explicitly is still a duplicate, merge key or not
    config.write_text(text.replace("    name: CAM_FRONT_COPY\n", "    name: CAM_FRONT_COPY\n    name: CAM_X\n"))
    with pytest.raises(ConfigError, match=r"invalid YAML: line \d+, column 5: duplicate key 'name'$"):
        load_config(config)


def test_config_must_be_a_regular_file_of_at_most_1_mib(tmp_path: Path) -> None:
    import os

    fifo = tmp_path / "rig.fifo"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match=r"rig\.fifo: is not a regular file \(a device, pipe or socket\), expected a YAML file$"):
        load_config(fifo)  # without the check this blocks forever, waiting for a writer
    with pytest.raises(ConfigError, match=r"^/dev/zero: is not a regular file"):
        load_config("/dev/zero")
    big = tmp_path / "big.yaml"
    with open(big, "wb") as fh:
        fh.truncate(2**20 + 1)
    with pytest.raises(ConfigError, match=r"big\.yaml: is 1,048,577 bytes, larger than 1 MiB: not a rig config$"):
        load_config(big)


def test_bev_axis_must_be_a_whole_number_of_steps_on_fine_grids_too() -> None:
    data = small_rig_data()
    data["bev"]["y"] = [0.0, 1.0, 1.0]
    data["bev"]["x"] = [0.0, 500.0003, 0.001]
    with pytest.raises(ConfigError, match=r"bev\.x: range 500\.0003 m is not a whole number of 0\.001 m steps \(500000\.3\)$"):
        parse_config(data)
    for x, n in (([0.0, 500.0, 0.001], 500000), ([-51.23, 51.27, 0.001], 102500), ([-51.2, 51.2, 0.8], 128)):
        data["bev"]["x"] = x
        assert parse_config(data).bev.nx == n


@pytest.mark.parametrize(
    ("spelling", "read_as"),
    [("1:30", "90"), ("0b10000", "16"), ("020", "16"), ("16_000", "16000"), ("1:30.5", "90.5"), ("1_6.0", "16.0")],
)
def test_yaml_1_1_only_number_spellings_are_refused(tmp_path: Path, spelling: str, read_as: str) -> None:
    """PyYAML reads `stride: 1:30` as 90 (sexagesimal) and `0b10000` as 16: refused, with where and why."""
    config = tmp_path / "rig.yaml"
    config.write_text(NUSCENES_TEXT.replace("stride: 16", f"stride: {spelling}", 1))
    with pytest.raises(ConfigError) as info:
        load_config(config)
    assert str(info.value) == (
        f"{config}: invalid YAML: line 58, column 11: {'integer' if '.' not in spelling else 'number'} {spelling!r} "
        f"is a YAML 1.1-only spelling (read as {read_as}); write it in plain decimal"
    )
    config.write_text(NUSCENES_TEXT.replace("stride: 16", f"stride: '{spelling}'", 1))
    with pytest.raises(ConfigError, match=r"feature\.stride: expected an integer, got str"):
        load_config(config)  # quoted: a string, as before
    config.write_text(NUSCENES_TEXT.replace("stride: 16", "stride: 0x10", 1))
    assert load_config(config).feature.stride == 16  # hex reads the same in YAML 1.2: still accepted


# -- YAML writing and the OpenCV FileStorage reader ---------------------------------------


@given(st.lists(st.floats(allow_nan=False, allow_infinity=False), min_size=1, max_size=8), st.integers(-(2**31), 2**31))
def test_dumped_yaml_reads_back_exactly_the_same_numbers(values: list[float], integer: int) -> None:
    data = {"name": "x", "values": values, "nested": {"integer": integer, "row": [values[0], 0.0, -0.0]}}
    text = dump_config_yaml(data, ["a header line", ""])
    back = yaml.load(text, Loader=yaml.SafeLoader)
    assert back == data and [math.copysign(1.0, v) for v in back["values"]] == [math.copysign(1.0, v) for v in values]
    assert text.startswith("# a header line\n#\nname: x\n")


def test_written_config_is_atomic_and_reparses_to_the_same_config(tmp_path: Path) -> None:
    rig = load_config(NUSCENES_YAML)
    path = write_config_yaml(tmp_path / "sub" / "rig.yaml", config_to_dict(rig), ["resolved"])
    assert sorted(p.name for p in path.parent.iterdir()) == ["rig.yaml"]  # no temporary left
    again = load_config(path)
    assert config_to_dict(again) == config_to_dict(rig) and config_sha256(again) == config_sha256(rig)
    with pytest.raises(ConfigError, match=r"rig\.yaml/nested\.yaml: cannot write file"):
        write_config_yaml(path / "nested.yaml", {"name": "x"})  # its folder is a file


def test_opencv_filestorage_written_by_opencv_reads_exactly(tmp_path: Path) -> None:
    """Files written by OpenCV's own ``cv2.FileStorage`` (OpenCV 5 writes ``%YAML 1.2``, 17 significant
    digits, ``!!opencv-matrix`` / ``!!opencv-nd-matrix``) read back to the same float64 numbers."""
    cv2 = pytest.importorskip("cv2")
    path = tmp_path / "cam.yml"
    k = np.array([[1252.8131021185304, 0.0, 826.588114781398], [0.0, 1252.8131021185304, 469.9846626224581], [0.0, 0.0, 1.0]])
    d = np.array([[-0.1, 0.01, 1e-4, -2e-5, 0.003]]).T
    fs = cv2.FileStorage(str(path), cv2.FILE_STORAGE_WRITE)
    fs.write("image_width", 1600)
    fs.write("camera_matrix", k)
    fs.write("distortion_coefficients", d)
    fs.write("rvec", np.array([0.1, 0.2, 0.3]))
    fs.release()
    data = read_opencv_yaml(path)
    assert data["image_width"] == 1600
    assert data["camera_matrix"]["rows"] == 3 and data["camera_matrix"]["data"] == k.ravel().tolist()
    assert data["distortion_coefficients"]["data"] == d.ravel().tolist()
    assert data["rvec"]["sizes"] == [3] and data["rvec"]["data"] == [0.1, 0.2, 0.3]
    old_style = tmp_path / "old.yml"  # OpenCV 3/4 spell the directive %YAML:1.0
    old_style.write_text("%YAML:1.0\n---\nimage_width: 752\nbad: [1, 2\n")
    with pytest.raises(ConfigError, match=r"old\.yml: invalid YAML: line 5, column 1"):
        read_opencv_yaml(old_style)
    with pytest.raises(ConfigError, match=r"cam\.yml: invalid YAML: .*could not determine a constructor for the tag"):
        read_config_data(path)  # a plain YAML reader does not know OpenCV's tags


# -- feature levels and the feature-map size rule ---------------------------------------------


def _bevformer_input(data: dict[str, Any]) -> dict[str, Any]:
    """1600x900 images padded to 1600x928 (BEVFormer-base's input)."""
    data["image_aug"] = {"resize": 1.0, "crop": [0, 0], "input_size": [1600, 928], "pad": [0, 28]}
    return data


def test_feature_levels_and_ceil_size_rule_round_trip() -> None:
    """Four FPN levels of a 1600x928 input: stride 64 has ceil(928 / 64) = 15 rows, as the
    network's padded strided convolutions give (exact division is refused, naming the rule)."""
    data = _bevformer_input(nuscenes_data())
    data["feature"] = {"levels": [{"stride": s} for s in (8, 16, 32, 64)], "pixel_mapping": "normalized", "size_rule": "ceil"}
    rig = parse_config(data)
    assert rig.n_levels == 4 and rig.feature.stride == 8
    assert [rig.level(i).feature_size for i in range(4)] == [(200, 116), (100, 58), (50, 29), (25, 15)]
    assert all(rig.level(i).n_levels == 1 and rig.level(i).feature.pixel_mapping == "normalized" for i in range(4))
    resolved = config_to_dict(rig)
    assert resolved["feature"] == {
        "levels": [{"stride": s, "pixel_mapping": "normalized"} for s in (8, 16, 32, 64)],
        "size_rule": "ceil",
    }
    assert config_to_dict(parse_config(resolved)) == resolved
    assert config_sha256(parse_config(resolved)) == config_sha256(rig)
    # a single-level config keeps its resolved form (and hash): no levels, no size_rule key
    assert config_to_dict(parse_config(nuscenes_data()))["feature"] == {"stride": 16, "pixel_mapping": "stride"}
    single_ceil = copy.deepcopy(data)
    single_ceil["feature"] = {"stride": 64, "pixel_mapping": "normalized", "size_rule": "ceil"}
    assert parse_config(single_ceil).feature_size == (25, 15)
    exact = copy.deepcopy(data)
    del exact["feature"]["size_rule"]
    with pytest.raises(ConfigError, match=r"image_aug.input_size: input height 928 is not divisible by feature.levels\[3\].stride 64 \(or set feature.size_rule: ceil\)$"):
        parse_config(exact)


FEATURE_CASES: list[tuple[str, Any, str, str]] = [
    ("both", {"stride": 16, "levels": [{"stride": 16}]}, "feature.stride", "give either stride (one feature map) or levels (several), not both"),
    ("neither", {"pixel_mapping": "stride"}, "feature.stride", "missing required field (or give levels"),
    ("dup-stride", {"levels": [{"stride": 16}, {"stride": 16}]}, "feature.levels[1].stride", "duplicate stride 16 (also feature.levels[0])"),
    ("bad-mapping", {"levels": [{"stride": 16, "pixel_mapping": "centre"}]}, "feature.levels[0].pixel_mapping", "expected one of"),
    ("bad-rule", {"stride": 16, "size_rule": "floor"}, "feature.size_rule", "expected one of exact, ceil, got 'floor'"),
    ("too-small", {"levels": [{"stride": 16}, {"stride": 256}]}, "feature.levels[1].stride", "feature map 3x1 is smaller than 2x2"),
    ("empty", {"levels": []}, "feature.levels", "must list 1 to 8 levels, got 0"),
    ("level-key", {"levels": [{"stride": 16, "size": 3}]}, "feature.levels[0].size", "unknown field"),
]


@pytest.mark.parametrize(("case", "feature", "field", "phrase"), FEATURE_CASES, ids=[c[0] for c in FEATURE_CASES])
def test_bad_feature_levels_are_named(tmp_path: Path, case: str, feature: Any, field: str, phrase: str) -> None:
    data = nuscenes_data()
    data["feature"] = feature
    if case == "too-small":
        data["feature"]["size_rule"] = "ceil"
    config = write_yaml(tmp_path / "rig.yaml", data)
    with pytest.raises(ConfigError) as info:
        load_config(config)
    assert info.value.field == field and phrase in info.value.message, str(info.value)


# -- per-level BEV grids (feature.levels[l].bev) and the image flip (image_aug.flip) ------------


def _level_grid_data() -> dict[str, Any]:
    """nuScenes with two feature levels, level 1 on its own coarser grid (1.6 m, two heights)."""
    data = nuscenes_data()
    data["feature"] = {"levels": [{"stride": 8}, {"stride": 16, "bev": {"x": [-48.0, 48.0, 1.6], "y": [-32.0, 32.0, 1.6], "heights": [0.0, 1.0]}}]}
    return data


def test_level_grids_round_trip_and_leave_other_configs_alone() -> None:
    """``feature.levels[l].bev`` gives level ``l`` its own cells and heights (``bev:``'s fields
    overridden key by key, ``bev.frame`` kept): ``rig.level(l)`` samples them, the resolved config
    writes the level's full grid and re-parses to the same hash; a config without level grids keeps
    its resolved form (no ``bev`` key under a level)."""
    rig = parse_config(_level_grid_data())
    assert rig.has_level_grids and rig.bev.nx == 128 and rig.level(0).bev == rig.bev
    level = rig.level(1)
    assert (level.bev.nx, level.bev.ny, level.bev.heights, level.bev.frame) == (60, 40, (0.0, 1.0), "ego")
    assert level.bev.z == rig.bev.z and level.feature_size == (44, 16) and level.n_levels == 1
    resolved = config_to_dict(rig)
    assert resolved["feature"]["levels"][1]["bev"] == {"x": [-48.0, 48.0, 1.6], "y": [-32.0, 32.0, 1.6], "z": [-5.0, 3.0, 8.0], "heights": [0.0, 1.0]}
    assert "bev" not in resolved["feature"]["levels"][0]
    again = parse_config(resolved)
    assert config_to_dict(again) == resolved and config_sha256(again) == config_sha256(rig) and again.level(1).bev == level.bev
    plain = _level_grid_data()
    del plain["feature"]["levels"][1]["bev"]
    plain_rig = parse_config(plain)
    assert not plain_rig.has_level_grids and plain_rig.level(1).bev == plain_rig.bev
    assert all("bev" not in lv for lv in config_to_dict(plain_rig)["feature"]["levels"])


LEVEL_GRID_CASES: list[tuple[str, Any, str, str]] = [
    ("level-0", {0: {"x": [-10, 10, 1]}}, "feature.levels[0].bev", "level 0 samples bev: (give a level its own grid from feature.levels[1] on)"),
    ("frame", {1: {"frame": "LIDAR_TOP"}}, "feature.levels[1].bev.frame", "unknown field (allowed here: heights, x, y, z)"),
    ("empty", {1: {}}, "feature.levels[1].bev", "empty: give the level's own x, y, z, heights"),
    ("not-a-mapping", {1: [1, 2]}, "feature.levels[1].bev", "expected a mapping, got list"),
    ("bad-axis", {1: {"x": [-10, 10, 3]}}, "feature.levels[1].bev.x", "range 20 m is not a whole number of 3 m steps"),
    ("bad-step", {1: {"y": [-10, 10, -1]}}, "feature.levels[1].bev.y[2]", "step must be > 0, got -1"),
    ("heights", {1: {"heights": [0.0, 0.0]}}, "feature.levels[1].bev.heights", "heights must be distinct"),
    ("no-heights", {1: {"heights": []}}, "feature.levels[1].bev.heights", "must hold at least one height"),
    ("too-big", {1: {"x": [0, 10000, 0.01], "y": [0, 1000, 0.01]}}, "feature.levels[1].bev", "exceeds the limit of 100,000,000"),
]


@pytest.mark.parametrize(("case", "grids", "field", "phrase"), LEVEL_GRID_CASES, ids=[c[0] for c in LEVEL_GRID_CASES])
def test_bad_level_grids_are_named(tmp_path: Path, case: str, grids: dict[int, Any], field: str, phrase: str) -> None:
    data = _level_grid_data()
    for index, grid in grids.items():
        data["feature"]["levels"][index]["bev"] = grid
    with pytest.raises(ConfigError) as info:
        load_config(write_yaml(tmp_path / "rig.yaml", data))
    assert info.value.field == field and phrase in info.value.message, str(info.value)


def test_level_grids_and_a_bev_region_are_refused_together(tmp_path: Path) -> None:
    data = _level_grid_data()
    data["bev"]["region"] = {"rings": [{"beyond_m": 20, "factor": 2}]}
    with pytest.raises(ConfigError) as info:
        load_config(write_yaml(tmp_path / "rig.yaml", data))
    assert info.value.field == "feature.levels[1].bev"
    assert info.value.message == "a level's own BEV grid cannot be combined with bev.region (the region is a set of bev:'s cells)"


def test_image_flip_round_trips_and_is_recorded_only_when_set(tmp_path: Path) -> None:
    """``image_aug.flip`` (top level or per camera, default false): the resolved config carries
    ``flip: true`` only where it is set, so configs without a flip keep their hash."""
    plain = parse_config(nuscenes_data())
    assert not any(c.image_aug.flip for c in plain.cameras)
    assert all("flip" not in c["image_aug"] for c in config_to_dict(plain)["cameras"])
    data = nuscenes_data()
    data["image_aug"]["flip"] = True
    data["cameras"][2]["image_aug"] = {"flip": False}
    rig = load_config(write_yaml(tmp_path / "rig.yaml", data))
    assert [c.image_aug.flip for c in rig.cameras] == [True, True, False, True, True, True]
    assert rig.cameras[0].image_aug.crop_width == 704
    resolved = config_to_dict(rig)
    assert [c["image_aug"].get("flip") for c in resolved["cameras"]] == [True, True, None, True, True, True]
    again = parse_config(resolved)
    assert config_sha256(again) == config_sha256(rig) != config_sha256(plain)
    assert [c.image_aug for c in again.cameras] == [c.image_aug for c in rig.cameras]
    data["image_aug"]["flip"] = "yes"
    with pytest.raises(ConfigError) as info:
        load_config(write_yaml(tmp_path / "bad.yaml", data))
    assert info.value.field == "image_aug.flip" and info.value.message == "expected true or false, got str"
