"""OpenCV FileStorage calibration -> one camera merged into a rig: files written by OpenCV itself
(``cv2.FileStorage``), the projection checked against ``cv2.projectPoints`` (the independent
reference: OpenCV's own model with the file's K, distortion, rvec and tvec), one-line errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bevcompile.errors import ConfigError
from bevcompile.rig.config import load_config, parse_config
from bevcompile.rig.geometry import cam_from_ego_matrix, ego_from_cam_matrix, project_cam_to_image
from bevcompile.rig.importers.opencv import import_opencv, rodrigues

from ...rigs import NUSCENES_YAML

cv2 = pytest.importorskip("cv2")
K = np.array([[1260.25, 0.0, 812.5], [0.0, 1259.75, 455.125], [0.0, 0.0, 1.0]])
DIST = np.array([-0.12, 0.031, 2.5e-4, -1.5e-4, -0.004])


def _pose() -> tuple[np.ndarray, np.ndarray]:
    """rvec, tvec (ego -> camera) of a forward camera 1.7 m ahead, 1.5 m up, yawed 1 degree."""
    ego_from_cam = np.eye(4)
    yaw = np.radians(1.0)
    base = np.array([[0.0, 0.0, 1.0], [-1.0, 0.0, 0.0], [0.0, -1.0, 0.0]])  # cam z -> ego x, cam x -> ego -y
    ego_from_cam[:3, :3] = np.array([[np.cos(yaw), -np.sin(yaw), 0], [np.sin(yaw), np.cos(yaw), 0], [0, 0, 1]]) @ base
    ego_from_cam[:3, 3] = [1.7, 0.02, 1.5]
    cam_from_ego = np.linalg.inv(ego_from_cam)
    rvec, _ = cv2.Rodrigues(cam_from_ego[:3, :3])
    return rvec.ravel(), cam_from_ego[:3, 3]


def write_opencv(path: Path, **items: Any) -> Path:
    fs = cv2.FileStorage(str(path), cv2.FILE_STORAGE_WRITE)
    for key, value in items.items():
        fs.write(key, value)
    fs.release()
    return path


def test_file_written_by_opencv_merges_and_projects_as_cv2_project_points(tmp_path: Path) -> None:
    rvec, tvec = _pose()
    rotation, _ = cv2.Rodrigues(rvec)
    path = write_opencv(
        tmp_path / "front.yml", image_width=1600, image_height=900, camera_matrix=K, distortion_coefficients=DIST.reshape(5, 1),
        R=rotation, T=tvec.reshape(3, 1),
    )
    data = import_opencv(path, rig=NUSCENES_YAML, camera="CAM_FRONT", name="car-7")
    rig, shipped = parse_config(data), load_config(NUSCENES_YAML)
    front = rig.cameras[0]
    assert rig.name == "car-7" and rig.camera_names == shipped.camera_names and rig.cameras[1:] == shipped.cameras[1:]
    assert front.intrinsic == tuple(tuple(row) for row in K.tolist())  # copied exactly
    assert front.distortion.model == "opencv" and list(front.distortion.coeffs[:5]) == DIST.tolist()
    np.testing.assert_allclose(cam_from_ego_matrix(front)[:3, :3], rotation, rtol=0, atol=1e-15)
    np.testing.assert_allclose(cam_from_ego_matrix(front)[:3, 3], tvec, rtol=0, atol=1e-15)
    rng = np.random.default_rng(0)
    points_ego = np.concatenate([rng.uniform(4, 40, (500, 1)), rng.uniform(-15, 15, (500, 1)), rng.uniform(-1, 2, (500, 1))], axis=1)
    cam = cam_from_ego_matrix(front)
    ours, ok = project_cam_to_image(front, points_ego @ cam[:3, :3].T + cam[:3, 3])
    theirs, _ = cv2.projectPoints(points_ego, rvec, tvec, K, DIST)
    assert ok.sum() > 400  # points far off-axis lie beyond the lens's monotonic field (the valid rule)
    np.testing.assert_allclose(ours[ok], theirs.reshape(-1, 2)[ok], rtol=0, atol=1e-7)


def test_rvec_tvec_and_the_4x4_forms_give_the_same_pose(tmp_path: Path) -> None:
    rvec, tvec = _pose()
    rotation, _ = cv2.Rodrigues(rvec)
    cam_from_ego = np.eye(4)
    cam_from_ego[:3, :3], cam_from_ego[:3, 3] = rotation, tvec
    poses = []
    for name, items in (
        ("rt", {"R": rotation, "T": tvec.reshape(3, 1)}),
        ("vec", {"rvec": rvec.reshape(3, 1), "tvec": tvec.reshape(3, 1)}),
        ("rvec_as_R", {"R": rvec, "T": tvec}),
        ("cam_from_ego", {"cam_from_ego": cam_from_ego}),
        ("ego_from_cam", {"ego_from_cam": np.linalg.inv(cam_from_ego)}),
    ):
        path = write_opencv(tmp_path / f"{name}.yml", camera_matrix=K, **items)
        poses.append(ego_from_cam_matrix(parse_config(import_opencv(path, rig=NUSCENES_YAML, camera="CAM_FRONT")).cameras[0]))
    for pose in poses[1:]:
        np.testing.assert_allclose(pose, poses[0], rtol=0, atol=1e-14)
    reverse = write_opencv(tmp_path / "reverse.yml", camera_matrix=K, R=np.linalg.inv(cam_from_ego)[:3, :3], T=np.linalg.inv(cam_from_ego)[:3, 3])
    pose = ego_from_cam_matrix(parse_config(import_opencv(reverse, rig=NUSCENES_YAML, camera="CAM_FRONT", extrinsics="cam-to-ego")).cameras[0])
    np.testing.assert_allclose(pose, poses[0], rtol=0, atol=1e-14)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(-3.0, 3.0), min_size=3, max_size=3))
def test_rodrigues_equals_cv2_rodrigues(rvec: list[float]) -> None:
    ours = np.array(rodrigues(rvec))
    theirs, _ = cv2.Rodrigues(np.array(rvec, dtype=np.float64))
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-15)


def test_an_intrinsics_only_file_keeps_the_pose_and_a_fisheye_is_read_as_such(tmp_path: Path) -> None:
    path = write_opencv(tmp_path / "k.yml", camera_matrix=K, distortion_model="equidistant", distortion_coefficients=np.array([0.05, -0.01, 0.002, -0.0004]))
    rig, shipped = parse_config(import_opencv(path, rig=NUSCENES_YAML, camera="CAM_BACK")), load_config(NUSCENES_YAML)
    back = rig.cameras[3]
    assert back.name == "CAM_BACK" and back.distortion.model == "fisheye" and back.ego_from_cam == shipped.cameras[3].ego_from_cam
    assert back.rotation_wxyz == shipped.cameras[3].rotation_wxyz  # the base's quaternion form is kept


def test_a_new_camera_needs_the_whole_calibration(tmp_path: Path) -> None:
    rvec, tvec = _pose()
    full = write_opencv(tmp_path / "full.yml", image_width=1600, image_height=900, camera_matrix=K, rvec=rvec, tvec=tvec)
    rig = parse_config(import_opencv(full, rig=NUSCENES_YAML, camera="CAM_EXTRA"))
    assert rig.camera_names[-1] == "CAM_EXTRA" and rig.cameras[-1].distortion.model == "none"
    partial = write_opencv(tmp_path / "partial.yml", camera_matrix=K)
    with pytest.raises(ConfigError, match=r"partial\.yml: image_width: missing: camera 'CAM_EXTRA' is not in"):
        import_opencv(partial, rig=NUSCENES_YAML, camera="CAM_EXTRA")


@pytest.mark.parametrize(
    ("items", "field", "message"),
    [
        ({"camera_matrix": np.eye(2)}, "camera_matrix", "expected a 3x3 matrix, got 2x2"),
        ({"distortion_coefficients": np.array([0.1, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1e-3, 0.0])}, "distortion_coefficients[12]", "thin-prism / tilt terms"),
        ({"distortion_coefficients": np.array([0.1, 0.2, 0.3])}, "distortion_coefficients", "expected 4, 5, 8, 12 or 14 coefficients"),
        ({"R": np.eye(3)}, "T", "missing: the extrinsics need a rotation (R or rvec) and a translation (T or tvec)"),
        ({"R": np.eye(3) * 2, "T": np.zeros(3)}, "R", "not orthonormal"),
        ({"image_width": 1600}, "image_height", "missing (the image size needs image_width and image_height)"),
        ({"distortion_model": "kannala", "distortion_coefficients": np.zeros(4)}, "distortion_model", "unknown model 'kannala'"),
        ({"calibration_time": "today"}, "", "holds no camera calibration"),
    ],
)
def test_bad_files_are_one_line_errors_with_the_key(tmp_path: Path, items: dict[str, Any], field: str, message: str) -> None:
    path = write_opencv(tmp_path / "bad.yml", **items)
    with pytest.raises(ConfigError) as info:
        import_opencv(path, rig=NUSCENES_YAML, camera="CAM_FRONT")
    assert info.value.source == str(path) and info.value.field == field and message in info.value.message
