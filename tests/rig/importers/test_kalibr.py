"""Kalibr camchain.yaml -> rig config: the format written as Kalibr writes it, numbers copied
exactly, poses composed as Kalibr defines them, Kalibr's projection restated, one-line errors.

Facts restated from ethz-asl/kalibr (read with the search tools, never copied):

* ``aslam_offline_calibration/kalibr/python/kalibr_common/ConfigReader.py`` (commit
  0b8b9e8ea4c2282e6adacae6e779de45bb402669): ``CameraChainParameters`` holds ``cam0`` .. ``camN``,
  each with ``camera_model``, ``intrinsics`` (pinhole ``[fu, fv, pu, pv]``), ``distortion_model``
  (``radtan`` 4, ``equidistant`` 4, ``fov`` 1, ``none`` 0 coefficients), ``distortion_coeffs``,
  ``resolution`` ``[w, h]``, ``T_cn_cnm1`` (``setExtrinsicsLastCamToHere``: last camera -> this one,
  not for cam0) and ``T_cam_imu`` (``setExtrinsicsImuToCam``: IMU -> camera), 4x4 lists; the file
  is written with ``yaml.dump(self.data)``.
* ``aslam_cv/aslam_cameras/include/aslam/cameras/implementation/PinholeProjection.hpp`` (commit
  16518e7fb560244b275bac5beee4778dc5e3baf2) ``euclideanToKeypoint``: ``(x/z, y/z)``, distort, then
  ``u = fu * x_d + cu``, ``v = fv * y_d + cv``.
* ``.../RadialTangentialDistortion.hpp`` and ``.../EquidistantDistortion.hpp`` (commit
  ea2791f0786b152d1b71e18eac68cb329c3e4dc3) ``distort``: radtan ``rad = k1 r^2 + k2 r^4``,
  ``x += x rad + 2 p1 x y + p2 (r^2 + 2 x^2)``, ``y += y rad + 2 p2 x y + p1 (r^2 + 2 y^2)``;
  equidistant ``theta = atan(r)``, ``theta_d = theta (1 + k1 theta^2 + k2 theta^4 + k3 theta^6 + k4 theta^8)``,
  ``(x, y) *= theta_d / r`` (1 for r <= 1e-8).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.spatial.transform import Rotation

from bevcompile.errors import ConfigError
from bevcompile.rig.config import parse_config
from bevcompile.rig.geometry import cam_from_ego_matrix, ego_from_cam_matrix, project_cam_to_image
from bevcompile.rig.importers._common import template_data
from bevcompile.rig.importers.kalibr import KalibrOptions, import_kalibr, kalibr_rig

SIZE = (752, 480)


def _template() -> dict[str, Any]:
    data = template_data(None)
    data["image_aug"] = {"resize": 1.0, "crop": [0, 0], "input_size": [752, 480]}
    return data


def _rigid(rotvec: Any, translation: Any) -> list[list[float]]:
    matrix = np.eye(4)
    matrix[:3, :3] = Rotation.from_rotvec(rotvec).as_matrix()
    matrix[:3, 3] = translation
    return matrix.tolist()


def camchain(n: int = 3, *, seed: int = 0, models: tuple[str, ...] = ("radtan", "equidistant", "none")) -> dict[str, Any]:
    """A Kalibr camchain as kalibr_calibrate_imu_camera writes it (T_cam_imu and T_cn_cnm1 consistent)."""
    rng = np.random.default_rng(seed)
    cam_from_imu = [np.array(_rigid(rng.normal(0, 1.0, 3), rng.normal(0, 0.3, 3))) for _ in range(n)]
    data: dict[str, Any] = {}
    for i in range(n):
        model = models[i % len(models)]
        coeffs = {"radtan": rng.normal(0, 0.05, 4).tolist(), "equidistant": rng.normal(0, 0.02, 4).tolist(), "none": []}[model]
        cam: dict[str, Any] = {
            "T_cam_imu": cam_from_imu[i].tolist(),
            "cam_overlaps": [j for j in range(n) if j != i],
            "camera_model": "pinhole",
            "distortion_coeffs": coeffs,
            "distortion_model": model,
            "intrinsics": [float(v) for v in (rng.uniform(400, 500), rng.uniform(400, 500), rng.uniform(360, 390), rng.uniform(230, 250))],
            "resolution": list(SIZE),
            "rostopic": f"/cam{i}/image_raw",
            "timeshift_cam_imu": float(rng.normal(0, 1e-3)),
        }
        if i:
            cam["T_cn_cnm1"] = (cam_from_imu[i] @ np.linalg.inv(cam_from_imu[i - 1])).tolist()
        data[f"cam{i}"] = cam
    return data


def write_kalibr(path: Path, data: dict[str, Any]) -> Path:
    path.write_text(yaml.dump(data))  # Kalibr: outfile.write(yaml.dump(self.data))
    return path


def kalibr_project(cam: dict[str, Any], points_cam: np.ndarray) -> np.ndarray:
    """Kalibr's pinhole projection with its distortion, restated (see the module docstring)."""
    fu, fv, cu, cv = cam["intrinsics"]
    x, y = points_cam[:, 0] / points_cam[:, 2], points_cam[:, 1] / points_cam[:, 2]
    c = cam["distortion_coeffs"]
    if cam["distortion_model"] == "radtan":
        k1, k2, p1, p2 = c
        mx2, my2, mxy = x * x, y * y, x * y
        rho2 = mx2 + my2
        rad = k1 * rho2 + k2 * rho2 * rho2
        x, y = x + x * rad + 2.0 * p1 * mxy + p2 * (rho2 + 2.0 * mx2), y + y * rad + 2.0 * p2 * mxy + p1 * (rho2 + 2.0 * my2)
    elif cam["distortion_model"] == "equidistant":
        k1, k2, k3, k4 = c
        r = np.sqrt(x * x + y * y)
        theta = np.arctan(r)
        t2 = theta * theta
        thetad = theta * (1 + k1 * t2 + k2 * t2**2 + k3 * t2**3 + k4 * t2**4)
        scale = np.where(r > 1e-8, thetad / np.where(r > 1e-8, r, 1.0), 1.0)
        x, y = x * scale, y * scale
    return np.stack([fu * x + cu, fv * y + cv], axis=-1)


def test_camchain_imports_exactly_and_projects_as_kalibr_does(tmp_path: Path) -> None:
    data = camchain(3)
    rig_data = import_kalibr(write_kalibr(tmp_path / "camchain.yaml", data), template=_template(), name="car")
    rig = parse_config(rig_data)
    assert rig.camera_names == ("cam0", "cam1", "cam2")
    rng = np.random.default_rng(1)
    points_cam = np.concatenate([rng.uniform(-3, 3, (400, 2)), rng.uniform(2, 20, (400, 1))], axis=1)  # in front of each camera
    for i, camera in enumerate(rig.cameras):
        cam = data[f"cam{i}"]
        fu, fv, pu, pv = cam["intrinsics"]
        assert camera.intrinsic == ((fu, 0.0, pu), (0.0, fv, pv), (0.0, 0.0, 1.0))  # copied exactly
        assert (camera.image_width, camera.image_height) == SIZE
        want = {"radtan": "opencv", "equidistant": "fisheye", "none": "none"}[cam["distortion_model"]]
        assert camera.distortion.model == want
        assert list(camera.distortion.coeffs[: camera.distortion.n_coeffs_given]) == cam["distortion_coeffs"]
        # body imu with ego_from_body identity: ego = imu, so cam_from_ego must be T_cam_imu
        np.testing.assert_allclose(cam_from_ego_matrix(camera), np.array(cam["T_cam_imu"]), rtol=0, atol=1e-14)
        # a point in the IMU frame lands where Kalibr's own projection puts it
        imu_from_cam = np.linalg.inv(np.array(cam["T_cam_imu"]))
        points_imu = points_cam @ imu_from_cam[:3, :3].T + imu_from_cam[:3, 3]
        ours_cam = points_imu @ cam_from_ego_matrix(camera)[:3, :3].T + cam_from_ego_matrix(camera)[:3, 3]
        ours, ok = project_cam_to_image(camera, ours_cam)
        theirs = kalibr_project(cam, points_cam)
        assert ok.sum() > 300
        np.testing.assert_allclose(ours[ok], theirs[ok], rtol=0, atol=1e-9)


@settings(max_examples=15, deadline=None)
@given(st.integers(1, 5), st.integers(0, 2**31), st.sampled_from(["imu", "cam0", "cam1", "auto"]))
def test_round_trip_recovers_every_transform_of_the_chain(n: int, seed: int, body: str) -> None:
    """The imported poses reproduce the camchain's T_cam_imu (body imu) or T_cn_cnm1 chain (camera body)."""
    if body == "cam1" and n < 2:
        body = "cam0"
    data = camchain(n, seed=seed)
    ego_from_body = _rigid([0.1, -0.2, 0.3], [1.5, 0.0, 1.6])
    options = KalibrOptions(body=body, ego_from_body=tuple(tuple(r) for r in ego_from_body) if body != "auto" else None)
    rig = parse_config(kalibr_rig(data, source="camchain.yaml", template=_template(), name="car", options=options))
    ego_from = [ego_from_cam_matrix(c) for c in rig.cameras]
    for i in range(n):
        if body in ("imu", "auto"):
            base = np.array(ego_from_body) if body == "imu" else np.eye(4)
            np.testing.assert_allclose(np.linalg.inv(ego_from[i]) @ base, np.array(data[f"cam{i}"]["T_cam_imu"]), atol=1e-12)
        if i:
            t_cn_cnm1 = np.linalg.inv(ego_from[i]) @ ego_from[i - 1]
            np.testing.assert_allclose(t_cn_cnm1, np.array(data[f"cam{i}"]["T_cn_cnm1"]), atol=1e-12)
    if body.startswith("cam"):
        k = int(body[3:])
        np.testing.assert_allclose(ego_from[k], np.array(ego_from_body), atol=1e-14)  # the body camera sits at ego_from_body


@pytest.mark.parametrize(
    ("edit", "options", "field", "message"),
    [
        (lambda d: d["cam1"].update(camera_model="omni"), {}, "cam1.camera_model", "'omni' is not supported"),
        (lambda d: d["cam0"].update(distortion_model="fov", distortion_coeffs=[0.9]), {}, "cam0.distortion_model", "'fov' is not supported"),
        (lambda d: d["cam2"].update(intrinsics=[450.0, 450.0, 376.0]), {}, "cam2.intrinsics", "expected 4 values, got 3"),
        (lambda d: d["cam0"].update(distortion_coeffs=[0.1, 0.2, 0.3]), {}, "cam0.distortion_coeffs", "expected 4 values, got 3"),
        (lambda d: d["cam1"].pop("T_cam_imu"), {"body": "imu"}, "cam1.T_cam_imu", "missing (needed for --body imu)"),
        (lambda d: d.pop("cam1"), {}, "cam1", "the cameras must be numbered cam0 .. cam1 without a gap"),
        (lambda d: d.update(imu0={}), {}, "imu0", "unknown field (a Kalibr camchain holds cam0, cam1, ... camN)"),
        (lambda d: d["cam0"].update(color=True), {}, "cam0.color", "unknown field"),
        (lambda d: d["cam1"]["T_cn_cnm1"][0].__setitem__(0, 2.0), {"body": "cam0", "ego_from_body": "identity"}, "cam1.T_cn_cnm1", "not orthonormal"),
        (lambda d: None, {"body": "cam0"}, "--ego-from-body", "required with --body cam0"),
        (lambda d: None, {"body": "cam7", "ego_from_body": "identity"}, "--body", "cam7 is not a camera of the chain"),
        (lambda d: None, {"names": ("A", "B")}, "--names", "gives 2 name(s) for the 3 cameras"),
        (lambda d: d["cam0"].update(resolution=[752.5, 480]), {}, "cam0.resolution[0]", "expected an integer"),
    ],
)
def test_bad_camchains_are_one_line_errors_with_the_kalibr_field_path(edit, options, field: str, message: str) -> None:  # type: ignore[no-untyped-def]
    data = camchain(3)
    edit(data)
    if options.get("ego_from_body") == "identity":
        options = {**options, "ego_from_body": ((1.0, 0.0, 0.0, 0.0), (0.0, 1.0, 0.0, 0.0), (0.0, 0.0, 1.0, 0.0), (0.0, 0.0, 0.0, 1.0))}
    with pytest.raises(ConfigError) as info:
        kalibr_rig(data, source="calib/camchain.yaml", template=_template(), name="car", options=KalibrOptions(**options))
    assert info.value.source == "calib/camchain.yaml" and info.value.field == field
    assert message in info.value.message and "\n" not in str(info.value)
