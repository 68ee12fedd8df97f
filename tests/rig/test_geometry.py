"""Camera geometry against OpenCV, hand-placed points with known answers, and round trips."""

from __future__ import annotations

import math
import warnings
from typing import Any

import cv2
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from bevcompile.grid.ipm import inside_feature_map
from bevcompile.rig.config import Camera, Distortion, RigConfig, parse_config
from bevcompile.rig.geometry import (
    bev_from_cam_matrix,
    bev_from_ego_matrix,
    cam_from_bev_matrix,
    cam_from_ego_matrix,
    distort_normalized,
    ego_from_cam_matrix,
    feature_px_to_image_px,
    image_px_to_feature_px,
    image_px_to_input_px,
    intersect_feature_rays_with_plane,
    lens_limits,
    opencv_jacobian_det,
    project_bev_to_feature,
    project_cam_to_image,
    transform_points,
    undistort_normalized,
    unproject_feature_to_bev,
    unproject_image_to_cam,
)

from .. import rigs, upstream
from ..rigs import distorted_rig, nuscenes_rig, small_rig, small_rig_data

RIGS = {
    "nuscenes": nuscenes_rig(),
    "distorted": distorted_rig(),
    "small-distorted": small_rig(distortion=True),
    "small-linspace": small_rig(pixel_mapping="linspace"),
}
CAMERAS = [(name, i) for name, rig in RIGS.items() for i in range(rig.n_cam)]


def _cv2_project(camera: Camera, points_ego: np.ndarray) -> np.ndarray:
    """Independent projection: ego -> camera via cv2.Rodrigues rvec/tvec, then cv2's lens model."""
    ego_from_cam = ego_from_cam_matrix(camera)
    rotation_cam_from_ego = ego_from_cam[:3, :3].T
    tvec = -rotation_cam_from_ego @ ego_from_cam[:3, 3]
    rvec, _ = cv2.Rodrigues(rotation_cam_from_ego)
    intrinsic = np.array(camera.intrinsic)
    objects = points_ego.reshape(-1, 1, 3).astype(np.float64)
    if camera.distortion.model == "fisheye":
        image, _ = cv2.fisheye.projectPoints(objects, rvec, tvec, intrinsic, np.array(camera.distortion.coeffs))
    else:
        coeffs = (
            np.array(camera.distortion.coeffs[: camera.distortion.n_coeffs_given])
            if camera.distortion.model == "opencv"
            else np.zeros(0)
        )
        image, _ = cv2.projectPoints(objects, rvec, tvec, intrinsic, coeffs)
    return image.reshape(*points_ego.shape[:-1], 2)


@pytest.mark.parametrize(("rig_name", "cam_index"), CAMERAS, ids=[f"{r}-{i}" for r, i in CAMERAS])
def test_projection_matches_opencv(rig_name: str, cam_index: int) -> None:
    rig = RIGS[rig_name]
    camera = rig.cameras[cam_index]
    rng = np.random.default_rng(cam_index)
    # points spread over the camera's view: random pixels (inside the image) at random depths
    uv = rng.uniform([0, 0], [camera.image_width - 1, camera.image_height - 1], size=(500, 2))
    depth = rng.uniform(0.5, 80.0, size=500)
    points_cam, ok = unproject_image_to_cam(camera, uv, depth)
    assert ok.all()
    points_ego = points_cam @ ego_from_cam_matrix(camera)[:3, :3].T + ego_from_cam_matrix(camera)[:3, 3]
    ours, ok = project_cam_to_image(camera, points_cam)
    assert ok.all()
    reference = _cv2_project(camera, points_ego)
    assert np.abs(ours - reference).max() < 1e-6
    assert np.abs(ours - uv).max() < 1e-6  # and the lift is the exact inverse


def test_optical_axis_lands_on_the_principal_point_after_aug_and_stride(nuscenes: RigConfig) -> None:
    """Hand-placed point: 10 m along CAM_FRONT's optical axis -> (cx, cy) -> resize, crop, stride."""
    camera = nuscenes.cameras[0]
    ego_from_cam = ego_from_cam_matrix(camera)
    point_ego = ego_from_cam[:3, 3] + 10.0 * ego_from_cam[:3, 2]
    uv_f, ok = project_bev_to_feature(nuscenes, camera, point_ego)
    assert ok
    # written out by hand: u_in = cx * 0.44 - 0, v_in = cy * 0.44 - 140, feature = (in - 7.5) / 16
    expected_u = (826.588114781398 * 0.44 - 0.0 - 7.5) / 16.0
    expected_v = (469.9846626224581 * 0.44 - 140.0 - 7.5) / 16.0
    assert uv_f[0] == pytest.approx(expected_u, abs=1e-9)
    assert uv_f[1] == pytest.approx(expected_v, abs=1e-9)


def test_nuscenes_camera_headings_are_what_their_names_say(nuscenes: RigConfig) -> None:
    """Known answer: the optical axes point where the channel names say (ego x fwd, y left)."""
    expected_yaw_deg = {
        "CAM_FRONT": 0, "CAM_FRONT_LEFT": 55, "CAM_FRONT_RIGHT": -55,
        "CAM_BACK": 180, "CAM_BACK_LEFT": 110, "CAM_BACK_RIGHT": -110,
    }
    for camera in nuscenes.cameras:
        axis = ego_from_cam_matrix(camera)[:3, 2]
        yaw = math.degrees(math.atan2(axis[1], axis[0]))
        diff = (yaw - expected_yaw_deg[camera.name] + 180) % 360 - 180
        assert abs(diff) < 5, (camera.name, yaw)
        assert abs(axis[2]) < 0.05  # roughly horizontal


def test_ground_point_ahead_lands_below_the_horizon(nuscenes: RigConfig) -> None:
    """A ground point 10 m ahead of CAM_FRONT is below the principal point (larger v) and near cx."""
    camera = nuscenes.cameras[0]
    uv, ok = project_bev_to_feature(nuscenes, camera, np.array([11.7, 0.0, 0.0]))
    centre, _ = project_bev_to_feature(nuscenes, camera, ego_from_cam_matrix(camera)[:3, 3] + [10.0, 0, 0])
    assert ok and uv[1] > centre[1] + 3  # ~1.5 m below eye height at 10 m: ~8 deg -> ~11 feature rows? at least 3
    assert abs(uv[0] - centre[0]) < 1.0


def test_feature_mapping_conventions() -> None:
    stride = small_rig()
    camera = stride.cameras[0]
    # stride 8, resize 0.5, crop 0: feature pixel j's centre is input 8 j + 3.5 -> image (8 j + 3.5) / 0.5
    image = feature_px_to_image_px(stride, camera, np.array([[0.0, 0.0], [11.0, 7.0]]))
    np.testing.assert_allclose(image, [[7.0, 7.0], [183.0, 119.0]])
    linspace = small_rig(pixel_mapping="linspace")
    # BEVDet frustum: feature j at input j * (W_in - 1) / (W_f - 1): last feature pixel -> last input pixel
    image = feature_px_to_image_px(linspace, linspace.cameras[0], np.array([[0.0, 0.0], [11.0, 7.0]]))
    np.testing.assert_allclose(image, [[0.0, 0.0], [95.0 / 0.5, 63.0 / 0.5]])
    back = image_px_to_feature_px(linspace, linspace.cameras[0], image)
    np.testing.assert_allclose(back, [[0.0, 0.0], [11.0, 7.0]], atol=1e-12)


@pytest.mark.parametrize(
    ("mapping", "input_of_feature_11_7"),
    [
        ("stride", (8 * 11 + 3.5, 8 * 7 + 3.5)),  # centre of its 8 input pixels
        ("linspace", (95.0, 63.0)),  # j * (W_in - 1) / (W_f - 1)
        ("corner", (8 * 11, 8 * 7)),  # j * s: intrinsics divided by the stride (Fast-BEV)
        ("normalized", (8 * 11 + 4, 8 * 7 + 4)),  # j * s + s / 2 (BEVFormer's normalisation)
    ],
)
def test_convention_feature_pixel_mappings(mapping: str, input_of_feature_11_7: tuple[float, float]) -> None:
    """Where feature pixel (11, 7) of the 12x8 map sits on the 96x64 input (resize 0.5, no crop),
    written out by hand for every ``feature.pixel_mapping``; and the inverse."""
    rig = small_rig(pixel_mapping=mapping)
    camera = rig.cameras[0]
    image = feature_px_to_image_px(rig, camera, np.array([11.0, 7.0]))
    np.testing.assert_allclose(image * 0.5, input_of_feature_11_7, rtol=0, atol=1e-12)
    np.testing.assert_allclose(image_px_to_feature_px(rig, camera, image), [11.0, 7.0], rtol=0, atol=1e-12)


@pytest.mark.parametrize("pad_right", [0, 8])
def test_convention_image_flip_is_fastbevs_img_transform(pad_right: int) -> None:
    """``image_aug.flip``: input pixel ``u_in`` of the unflipped crop becomes ``W_crop - u_in``
    (``W_crop = input width - pad right``), ``v_in`` unchanged: what Fast-BEV's ``img_transform``
    computes (restated here in torch float32 from Sense-GVT/Fast-BEV
    mmdet3d/datasets/pipelines/transforms_3d.py @feacd875022cf2733fc1cf953f97fd735966a221:
    ``post_rot = [[-1, 0], [0, 1]] @ (resize I)``, ``post_tran = [[-1, 0], [0, 1]] @ (0 - crop) +
    [crop[2] - crop[0], 0]``). The image itself is mirrored by ``Image.FLIP_LEFT_RIGHT`` (``np.fliplr``):
    column ``c`` goes to ``W_crop - 1 - c``, so the flipped geometry puts a point ONE input pixel
    right of where the mirrored image shows it; bevcompile follows the model, not the exact mirror."""
    data = small_rig_data(pixel_mapping="corner")
    data["image_aug"] = {"resize": 0.5, "crop": [0, 0], "input_size": [96 + pad_right, 64], "pad": [pad_right, 0]}
    rig = parse_config(data)
    data["image_aug"]["flip"] = True
    flipped = parse_config(data)
    camera, camera_f = rig.cameras[1], flipped.cameras[1]
    uv_image = np.array([[0.0, 0.0], [17.25, 40.5], [95.5, 63.5], [191.0, 127.0]])
    u_in, v_in = image_px_to_input_px(camera, uv_image)
    u_f, v_f = image_px_to_input_px(camera_f, uv_image)
    np.testing.assert_array_equal(u_f, 96.0 - u_in)
    np.testing.assert_array_equal(v_f, v_in)
    resize, crop, w_crop = 0.5, (0.0, 0.0), 96  # Fast-BEV's crop = (0, 0, 0 + fW, 0 + fH)
    a = torch.Tensor([[-1, 0], [0, 1]])
    post_rot = a.matmul(torch.eye(2) * resize)
    post_tran = a.matmul(torch.zeros(2) - torch.Tensor(crop)) + torch.Tensor([w_crop, 0])
    theirs = (torch.tensor(uv_image, dtype=torch.float32) @ post_rot.T + post_tran).numpy()
    np.testing.assert_allclose(np.stack([u_f, v_f], axis=-1), theirs, rtol=0, atol=1e-5)
    # the mirrored crop (PIL FLIP_LEFT_RIGHT) holds input column c at W_crop - 1 - c
    crop_image = np.zeros((64, 96))
    crop_image[30, 17] = 1.0
    (row, col), = np.argwhere(np.fliplr(crop_image) == 1.0)
    point = image_px_to_input_px(camera_f, np.array([17.0 / resize, 30.0 / resize]))
    assert (col, row) == (96 - 1 - 17, 30) and (float(point[0]), float(point[1])) == (col + 1.0, 30.0)
    # corner mapping: feature u_f = u_in / s of the flipped input; the inverse undoes the flip
    feature = image_px_to_feature_px(flipped, camera_f, uv_image)
    np.testing.assert_array_equal(feature[:, 0], (96.0 - u_in) / 8.0)
    np.testing.assert_allclose(feature_px_to_image_px(flipped, camera_f, feature), uv_image, rtol=0, atol=1e-12)


@pytest.mark.parametrize(("pad_bottom", "size_rule"), [(0, "exact"), (8, "exact"), (4, "ceil")])
def test_convention_normalized_mapping_is_bevformer_sampling(pad_bottom: int, size_rule: str) -> None:
    """BEVFormer / DETR3D sample image features by projecting to input pixels (x, y), dividing by
    the (padded) input size and calling grid_sample(align_corners=False) on 2 * loc - 1. With
    ``pixel_mapping: normalized`` our grid/norm is that grid: same samples as torch on it; with
    ``image_aug.pad`` the padded rows are part of the map (BEVFormer pads 900 -> 928); with
    ``feature.size_rule: ceil`` the map has ceil(H_in / s) rows (68 / 8 -> 9, as BEVFormer's
    stride-64 level has ceil(928 / 64) = 15) and the same normalised grid samples it."""
    data = small_rig_data(distortion=True, heights=(-0.5, 0.0, 1.0), bev_half_m=20.0, pixel_mapping="normalized")
    data["image_aug"]["input_size"] = [96, 64 + pad_bottom]
    data["image_aug"]["pad"] = [0, pad_bottom]
    data["feature"]["size_rule"] = size_rule
    rig = parse_config(data)
    assert rig.feature_size == (12, -(-(64 + pad_bottom) // 8))
    in_pad = 0
    w_in, h_in = rig.input_size
    w_f, h_f = rig.feature_size
    rng = np.random.default_rng(7)
    points_ego = np.stack([rng.uniform(-15, 15, 200), rng.uniform(-15, 15, 200), rng.uniform(-0.5, 1.0, 200)], axis=-1)
    near_x, near_y = np.meshgrid(np.arange(-6.0, 6.01, 0.25), np.arange(-6.0, 6.01, 0.25))  # ground close to the rig:
    near = np.stack([near_x.ravel(), near_y.ravel(), np.zeros(near_x.size)], axis=-1)  # the bottom image rows
    points_ego = np.concatenate([points_ego, near])
    feats = torch.from_numpy(rng.random((1, 3, h_f, w_f)))
    for camera in rig.cameras:
        uv_f, ok = project_bev_to_feature(rig, camera, points_ego)
        # BEVFormer: lidar2img -> input pixels (OpenCV centres), / (W_in, H_in), * 2 - 1
        uv_img, ok_img = project_cam_to_image(camera, transform_points(cam_from_ego_matrix(camera), points_ego))
        aug = camera.image_aug
        x_in = uv_img[:, 0] * aug.resize - aug.crop_left
        y_in = uv_img[:, 1] * aug.resize - aug.crop_top
        grid_bevformer = np.stack([x_in / w_in, y_in / h_in], axis=-1) * 2 - 1
        grid_ours = np.stack([(2 * uv_f[:, 0] + 1) / w_f - 1, (2 * uv_f[:, 1] + 1) / h_f - 1], axis=-1)
        keep = ok & ok_img & inside_feature_map(uv_f, rig.feature_size)  # the VALID RULE
        assert keep.sum() > 20
        in_pad += int(np.count_nonzero(keep & (y_in >= 64.0)))  # in the padded rows (edge of the real input at 64)
        np.testing.assert_allclose(grid_ours[keep], grid_bevformer[keep], rtol=0, atol=1e-12)
        ours = F.grid_sample(feats, torch.from_numpy(grid_ours[keep][None, None]), align_corners=False)
        theirs = F.grid_sample(feats, torch.from_numpy(grid_bevformer[keep][None, None]), align_corners=False)
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-12)
    assert (in_pad > 0) == (pad_bottom > 0)  # points in the padding are valid, as BEVFormer samples them


def test_behind_the_camera_is_never_valid(nuscenes: RigConfig) -> None:
    camera = nuscenes.cameras[0]
    ego_from_cam = ego_from_cam_matrix(camera)
    # the mirror image of an on-axis point: would project onto (cx, cy) if z were not checked
    behind = ego_from_cam[:3, 3] - 10.0 * ego_from_cam[:3, 2]
    uv, ok = project_bev_to_feature(nuscenes, camera, behind)
    assert not ok and np.isnan(uv).all()


def test_points_past_the_lens_fov_do_not_wrap_into_the_image() -> None:
    """k1 = -0.3 folds back at r = 1/sqrt(0.9): a point at r = 1.6 would land inside the image."""
    distortion = Distortion("opencv", (-0.3, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0), 4)
    limits = lens_limits(distortion)
    assert limits.max_radius == pytest.approx(1 / math.sqrt(0.9), rel=1e-9)
    xy = np.array([[1.6, 0.0], [1.0, 0.0]])
    xy_d, ok = distort_normalized(distortion, xy)
    assert xy_d[0, 0] == pytest.approx(1.6 * (1 - 0.3 * 1.6**2))  # 0.371: well inside a 1.0-wide image
    assert ok.tolist() == [False, True]
    # and the inverse refuses distorted radii past the fold
    _, ok_inverse = undistort_normalized(distortion, np.array([[limits.max_distorted_radius * 1.01, 0.0]]))
    assert not ok_inverse.any()


def test_fisheye_limit_and_validity() -> None:
    distortion = Distortion("fisheye", (0.0, 0.0, 0.0, 0.0), 4)
    xy_d, ok = distort_normalized(distortion, np.array([[1.0, 0.0]]))
    assert ok.all() and xy_d[0, 0] == pytest.approx(math.pi / 4)  # equidistant: theta_d = theta
    folding = Distortion("fisheye", (-0.3, 0.0, 0.0, 0.0), 4)  # theta(1 - 0.3 theta^2) peaks at theta = 1.054
    assert lens_limits(folding).max_radius == pytest.approx(math.tan(1 / math.sqrt(0.9)), rel=1e-6)


# -- the valid field: 2-D folds of tangential lenses, fisheye up to 90 deg, no warnings --------

TANGENTIAL_FOLD = Distortion("opencv", (-0.3, 0.1, 0.001, -0.001, -0.02, 0.0, 0.0, 0.0), 5)
"""Radial fold at r = 1.4587 (55.6 deg); the tangential terms fold the 2-D map a little before."""


def _cv2_distort(coeffs: tuple[float, ...], xy: np.ndarray) -> np.ndarray:
    """Independent lens model: ``cv2.projectPoints`` of the rays ``(x, y, 1)`` with ``K = I``."""
    objects = np.concatenate([xy.reshape(-1, 2), np.ones((xy.size // 2, 1))], axis=-1).reshape(-1, 1, 3)
    image, _ = cv2.projectPoints(objects, np.zeros(3), np.zeros(3), np.eye(3), np.array(coeffs, dtype=np.float64))
    return image.reshape(xy.shape)


def cv2_jacobian_det(coeffs: tuple[float, ...], xy: np.ndarray, h: float = 1e-6) -> np.ndarray:
    """det of the Jacobian of OpenCV's normalised distortion map by central differences of
    :func:`_cv2_distort` (error ~1e-9)."""
    ex, ey = np.array([h, 0.0]), np.array([0.0, h])
    dx = (_cv2_distort(coeffs, xy + ex) - _cv2_distort(coeffs, xy - ex)) / (2 * h)
    dy = (_cv2_distort(coeffs, xy + ey) - _cv2_distort(coeffs, xy - ey)) / (2 * h)
    return dx[..., 0] * dy[..., 1] - dy[..., 0] * dx[..., 1]


def _near_radial_fold(limits_radius: float, n_r: int = 300, n_az: int = 720) -> np.ndarray:
    """Polar grid of normalised points with r in [0.9, 1) x the radial fold radius."""
    r = limits_radius * np.linspace(0.9, 1.0, n_r, endpoint=False)
    az = np.linspace(-math.pi, math.pi, n_az, endpoint=False)
    rr, aa = np.meshgrid(r, az, indexing="ij")
    return np.stack([rr * np.cos(aa), rr * np.sin(aa)], axis=-1).reshape(-1, 2)


def test_tangential_fold_is_outside_the_valid_field() -> None:
    """Audit finding: the radial rule alone kept points where the 2-D map has folded
    (det J <= 0); their pixel also belongs to another, valid ray (wrap-around)."""
    limits = lens_limits(TANGENTIAL_FOLD)
    assert limits.max_angle_deg == pytest.approx(55.57, abs=0.01)
    xy = _near_radial_fold(limits.max_radius)  # all inside the radial fold: the old rule kept them all
    det_cv2 = cv2_jacobian_det(TANGENTIAL_FOLD.coeffs, xy)
    np.testing.assert_allclose(opencv_jacobian_det(TANGENTIAL_FOLD, xy), det_cv2, rtol=0, atol=1e-7)
    xy_d, ok = distort_normalized(TANGENTIAL_FOLD, xy)
    np.testing.assert_allclose(xy_d, _cv2_distort(TANGENTIAL_FOLD.coeffs, xy), rtol=0, atol=1e-13)
    assert np.abs(det_cv2).min() > 1e-8  # no point too close to the fold for the finite differences
    assert np.array_equal(ok, det_cv2 > 0)
    assert 1_000 < (~ok).sum() < ok.sum()  # the fold cuts a crescent off the ring
    # every valid point is the ray its pixel unprojects to (every 8th of them: the round trip is
    # the same per point, and the 213 k of them took 10 s of the suite)
    valid = np.flatnonzero(ok)[::8]
    back, ok_back = undistort_normalized(TANGENTIAL_FOLD, xy_d[valid])
    assert ok_back.all()
    assert np.abs(back - xy[valid]).max() < 1e-9
    # a folded point's pixel: either no valid preimage, or the OTHER (valid) ray, never the folded one
    folded = ~ok
    back, ok_back = undistort_normalized(TANGENTIAL_FOLD, xy_d[folded])
    assert ok_back.sum() > 100
    assert (cv2_jacobian_det(TANGENTIAL_FOLD.coeffs, back[ok_back]) > 0).all()
    assert np.abs(_cv2_distort(TANGENTIAL_FOLD.coeffs, back[ok_back]) - xy_d[folded][ok_back]).max() < 1e-9
    assert np.isnan(back[~ok_back]).all()


BAND_LENS = Distortion("opencv", (-0.39, 0.077, -0.05, 0.0, 0.0, 0.0, 0.0, 0.0), 4)
"""A realistic radial-tangential lens (|p1| = 0.05) whose rays cross a band of det J <= 0 and
come out positive again before the radial fold (re-audit finding: 55.9 deg and 45.5 deg rays on
one pixel)."""


def test_convention_valid_field_ends_at_the_first_fold_along_each_ray() -> None:
    """VALID RULE: a point is valid only if det J > 0 all along the ray from the optical axis to
    it. Beyond a det <= 0 band the map is positive again, yet those points' pixels are the images
    of nearer, valid rays (checked with cv2): they must stay invalid, in grid/ and in the lift."""
    assert lens_limits(BAND_LENS).max_radius == math.inf  # radially monotonic for ever: only the 2-D map folds
    az = np.linspace(-np.pi, np.pi, 360, endpoint=False)
    r = np.linspace(0.01, 3.0, 300)  # up to 71.6 deg off-axis
    xy = np.stack([np.outer(np.cos(az), r), np.outer(np.sin(az), r)], axis=-1)  # (az, r, 2)
    det = cv2_jacobian_det(BAND_LENS.coeffs, xy.reshape(-1, 2)).reshape(len(az), len(r))
    first_fold = np.where((det <= 0).any(axis=1), np.argmax(det <= 0, axis=1), len(r))
    beyond_band = (np.arange(len(r))[None, :] > first_fold[:, None]) & (det > 0)  # positive again
    assert beyond_band.sum() > 100  # the lens has such points: the point-wise test would keep them
    _, ok = distort_normalized(BAND_LENS, xy.reshape(-1, 2))
    ok = ok.reshape(det.shape)
    assert not ok[beyond_band].any()
    before = np.arange(len(r))[None, :] < first_fold[:, None] - 1  # one sample of margin at the fold
    assert ok[before].all()
    # the pixel of a point beyond the band: cv2 finds a nearer preimage, and the lift returns that one
    pts = xy[beyond_band][::25]
    pixels = _cv2_distort(BAND_LENS.coeffs, pts)
    back, ok_back = undistort_normalized(BAND_LENS, pixels)
    assert ok_back.any()
    assert (np.hypot(back[ok_back, 0], back[ok_back, 1]) < np.hypot(pts[ok_back, 0], pts[ok_back, 1]) - 1e-6).all()
    assert np.abs(_cv2_distort(BAND_LENS.coeffs, back[ok_back]) - pixels[ok_back]).max() < 1e-9


def test_inverse_near_a_tangential_fold_is_exact_and_per_point() -> None:
    """Pixels past the RADIAL image of the fold (the tangential terms push them there) have
    valid preimages: the safeguarded solve finds them to 1e-9, and its result for a point
    does not depend on the other points of the batch (chunked builds stay identical)."""
    limits = lens_limits(TANGENTIAL_FOLD)
    xy = _near_radial_fold(limits.max_radius, n_r=40, n_az=90)
    xy_d, ok = distort_normalized(TANGENTIAL_FOLD, xy)
    past = ok & (np.hypot(xy_d[:, 0], xy_d[:, 1]) > limits.max_distorted_radius)
    assert past.sum() > 50
    batch, ok_batch = undistort_normalized(TANGENTIAL_FOLD, xy_d)
    assert ok_batch[ok].all()
    assert np.abs(batch[ok] - xy[ok]).max() < 1e-9
    for i in np.flatnonzero(past | ~ok)[::7]:
        single, ok_single = undistort_normalized(TANGENTIAL_FOLD, xy_d[i])
        assert bool(ok_single) == bool(ok_batch[i])
        assert np.array_equal(single, batch[i], equal_nan=True)


@settings(max_examples=100, deadline=None)
@given(
    coeffs=st.tuples(
        st.floats(-0.35, -0.2), st.floats(0.0, 0.1), st.floats(-0.01, 0.01), st.floats(-0.01, 0.01),
        st.floats(-0.03, -0.005),
    ),
    # within 1e-9 of the fold radius the sign of det J is below float64 resolution (a
    # fraction of 1 - 2e-16 gave det 4.3e-16 > 0 with the point past the computed fold)
    fraction=st.floats(0.8, 1.0 - 1e-9),
    azimuth=st.floats(-math.pi, math.pi),
)
def test_undistort_inverts_radtan_up_to_its_fold(
    coeffs: tuple[float, ...], fraction: float, azimuth: float
) -> None:
    """Up to the fold, any valid point is reproduced: its pixel to 1e-9, its ray to 1e-9
    wherever the map is not nearly singular (det J >= 1e-5; closer to the fold float64 cannot
    separate rays that close)."""
    distortion = Distortion("opencv", (*coeffs, 0.0, 0.0, 0.0), 5)
    r = fraction * lens_limits(distortion).max_radius
    xy = np.array([r * math.cos(azimuth), r * math.sin(azimuth)])
    xy_d, ok = distort_normalized(distortion, xy)
    det = float(opencv_jacobian_det(distortion, xy))
    assert bool(ok) == (det > 0)
    if not ok:
        return
    back, ok = undistort_normalized(distortion, xy_d)
    assert ok
    assert float(opencv_jacobian_det(distortion, back)) > 0
    assert np.abs(distort_normalized(distortion, back)[0] - xy_d).max() < 1e-9
    if det >= 1e-5:
        assert np.abs(back - xy).max() < 1e-9


def _cv2_fisheye_distort(coeffs: tuple[float, ...], xy: np.ndarray) -> np.ndarray:
    objects = np.concatenate([xy.reshape(-1, 2), np.ones((xy.size // 2, 1))], axis=-1).reshape(-1, 1, 3)
    image, _ = cv2.fisheye.projectPoints(objects, np.zeros(3), np.zeros(3), np.eye(3), np.array(coeffs, dtype=np.float64))
    return image.reshape(xy.shape)


def test_fisheye_field_reaches_90_degrees() -> None:
    """A fisheye monotonic up to 90 deg is valid up to 90 deg, not up to the r = tan(angle)
    search's 89.94 deg; cv2.fisheye.projectPoints agrees; the inverse goes there too."""
    wide = Distortion("fisheye", (0.05, -0.01, 0.002, -0.0002), 4)
    limits = lens_limits(wide)
    assert limits.max_radius == math.inf and limits.max_angle_deg == 90.0
    k1, k2, k3, k4 = wide.coeffs
    t = math.pi / 2
    assert limits.max_distorted_radius == pytest.approx(t * (1 + k1 * t**2 + k2 * t**4 + k3 * t**6 + k4 * t**8), rel=1e-12)
    angle = np.radians(np.array([89.0, 89.94, 89.943, 89.95, 89.99, 89.999, 89.99999]))
    azimuth = np.linspace(0.3, 5.9, angle.size)
    xy = np.tan(angle)[:, None] * np.stack([np.cos(azimuth), np.sin(azimuth)], axis=-1)
    xy_d, ok = distort_normalized(wide, xy)
    assert ok.all()
    np.testing.assert_allclose(xy_d, _cv2_fisheye_distort(wide.coeffs, xy), rtol=0, atol=1e-12)
    back, ok = undistort_normalized(wide, xy_d)
    assert ok.all()
    np.testing.assert_allclose(np.arctan(np.hypot(back[:, 0], back[:, 1])), angle, rtol=0, atol=1e-12)
    np.testing.assert_allclose(np.arctan2(back[:, 1], back[:, 0]), np.arctan2(xy[:, 1], xy[:, 0]), rtol=0, atol=1e-12)
    np.testing.assert_allclose(back[:-1], xy[:-1], rtol=1e-9)  # tan(angle) itself: ill-conditioned at 90 deg
    # a distorted radius at or past theta_d(90 deg) has no preimage
    _, ok = undistort_normalized(wide, np.array([[limits.max_distorted_radius, 0.0], [0.0, 1.01 * limits.max_distorted_radius]]))
    assert not ok.any()


def test_fisheye_fold_between_89_94_and_90_degrees_is_found() -> None:
    """theta_d = theta (1 + k1 theta^2) stops increasing at theta = 1 / sqrt(-3 k1): put that
    at 89.97 deg, past the r = tan(angle) search range."""
    fold = math.radians(89.97)
    folding = Distortion("fisheye", (-1.0 / (3.0 * fold**2), 0.0, 0.0, 0.0), 4)
    limits = lens_limits(folding)
    assert limits.max_angle_deg == pytest.approx(89.97, abs=1e-9)
    xy = np.array([[math.tan(math.radians(89.96)), 0.0], [math.tan(math.radians(89.98)), 0.0]])
    _, ok = distort_normalized(folding, xy)
    assert ok.tolist() == [True, False]


@settings(max_examples=100, deadline=None)
@given(
    coeffs=st.tuples(st.floats(-0.05, 0.05), st.floats(-0.02, 0.02), st.floats(-0.005, 0.005), st.floats(-0.001, 0.001)),
    angle=st.floats(1.3, math.pi / 2 - 1e-9),
    azimuth=st.floats(-math.pi, math.pi),
)
def test_undistort_inverts_fisheye_up_to_90_degrees(coeffs: tuple[float, ...], angle: float, azimuth: float) -> None:
    """Round trip in angle (r = tan(angle) itself is ill-conditioned at 90 deg)."""
    distortion = Distortion("fisheye", coeffs, 4)
    assume(math.radians(lens_limits(distortion).max_angle_deg) - angle > 1e-3)  # not AT a fold (ill-posed)
    xy, back = _fisheye_round_trip(distortion, angle, azimuth)
    assert abs(math.atan(math.hypot(back[0], back[1])) - angle) < 1e-12
    assert abs(math.remainder(math.atan2(back[1], back[0]) - math.atan2(xy[1], xy[0]), 2 * math.pi)) < 1e-12


def test_lens_scans_and_extreme_inputs_emit_no_warnings() -> None:
    """numpy RuntimeWarnings used to leak to stderr on valid configs (rational pole in the
    scan, overflow for huge translations or coefficients); values are unchanged, only quiet."""
    pole = Distortion("opencv", (0.0, 0.0, 0.0, 0.0, 0.0, -0.5, 0.0, 0.0), 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        limits = lens_limits.__wrapped__(pole)  # the scan itself, not a cached result
        assert limits.max_radius == pytest.approx(math.sqrt(2.0), rel=1e-9)  # 1 - 0.5 r^2 = 0
        for distortion in (pole, TANGENTIAL_FOLD, Distortion("opencv", (1e200, 1e200, 0.0, 0.0, 1e200, 0.0, 0.0, 0.0), 5),
                           Distortion("fisheye", (0.05, -0.01, 0.002, -0.0002), 4)):
            xy = np.array([[1e300, 1e300], [1e200, 0.0], [3.0, -2.0], [np.inf, 0.0], [np.nan, 0.0], [0.0, 0.0]])
            _, ok = distort_normalized(distortion, xy)
            assert not ok[:2].any()
            undistort_normalized(distortion, xy)
        points_cam = np.array([[1e300, 0.0, 1.0], [-1e300, 1e300, 1e-3], [0.0, 0.0, 1.0]])
        camera = small_rig(distortion=True).cameras[0]
        _, ok = project_cam_to_image(camera, points_cam)
        assert ok.tolist() == [False, False, True]


# -- round trips (hypothesis) ---------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(
    camera_key=st.sampled_from(CAMERAS),
    u=st.floats(0.0, 1.0),
    v=st.floats(0.0, 1.0),
    depth=st.floats(0.2, 200.0),
)
def test_project_unproject_round_trip(camera_key: tuple[str, int], u: float, v: float, depth: float) -> None:
    rig = RIGS[camera_key[0]]
    camera = rig.cameras[camera_key[1]]
    w_f, h_f = rig.feature_size
    uv = np.array([u * (w_f - 1), v * (h_f - 1)])  # anywhere across the feature map (and image)
    points_ego, ok = unproject_feature_to_bev(rig, camera, uv, depth)
    assert ok
    back, ok = project_bev_to_feature(rig, camera, points_ego)
    assert ok
    assert np.abs(back - uv).max() < 1e-8
    depth_cam = (cam_from_ego_matrix(camera)[:3, :3] @ points_ego + cam_from_ego_matrix(camera)[:3, 3])[2]
    assert depth_cam == pytest.approx(depth, rel=1e-12)


@settings(max_examples=100, deadline=None)
@given(
    coeffs=st.tuples(
        st.floats(-0.25, 0.25), st.floats(-0.05, 0.05), st.floats(-0.002, 0.002), st.floats(-0.002, 0.002),
        st.floats(-0.01, 0.01),
    ),
    x=st.floats(-0.8, 0.8),
    y=st.floats(-0.6, 0.6),
)
def test_undistort_inverts_opencv_radtan(coeffs: tuple[float, ...], x: float, y: float) -> None:
    distortion = Distortion("opencv", (*coeffs, 0.0, 0.0, 0.0), 5)
    xy = np.array([x, y])
    xy_d, ok = distort_normalized(distortion, xy)
    if not ok:
        return  # outside this model's monotonic FOV: nothing to invert
    back, ok = undistort_normalized(distortion, xy_d)
    assert ok
    assert np.abs(back - xy).max() < 1e-9


@settings(max_examples=100, deadline=None)
@given(
    coeffs=st.tuples(st.floats(-0.05, 0.05), st.floats(-0.02, 0.02), st.floats(-0.005, 0.005), st.floats(-0.001, 0.001)),
    angle=st.floats(0.0, 1.3),
    azimuth=st.floats(-math.pi, math.pi),
)
def test_undistort_inverts_fisheye(coeffs: tuple[float, ...], angle: float, azimuth: float) -> None:
    xy, back = _fisheye_round_trip(Distortion("fisheye", coeffs, 4), angle, azimuth)
    assert np.abs(back - xy).max() < 1e-9 * max(1.0, math.tan(angle))


def _fisheye_round_trip(distortion: Distortion, angle: float, azimuth: float) -> tuple[np.ndarray, np.ndarray]:
    """``(xy, undistort(distort(xy)))`` for the normalised point at ``angle`` off-axis, ``azimuth``;
    both steps must succeed."""
    r = math.tan(angle)
    xy = np.array([r * math.cos(azimuth), r * math.sin(azimuth)])
    xy_d, ok = distort_normalized(distortion, xy)
    assert ok
    back, ok = undistort_normalized(distortion, xy_d)
    assert ok
    return xy, back


def test_ray_plane_intersection_recovers_ground_points(nuscenes: RigConfig) -> None:
    camera = nuscenes.cameras[0]
    ground = np.array([[8.0, -2.0, 0.0], [25.0, 4.0, 0.0], [40.0, 0.5, 0.0]])
    uv, ok = project_bev_to_feature(nuscenes, camera, ground)
    assert ok.all()
    back, ok = intersect_feature_rays_with_plane(nuscenes, camera, uv, 0.0)
    assert ok.all()
    assert np.abs(back - ground).max() < 1e-9


def test_rotation_only_rig_matches_a_hand_built_camera() -> None:
    """Independent check of the pose convention: sensor2ego maps camera axes to ego axes."""
    data: dict[str, Any] = small_rig_data(n_cam=1)
    data["cameras"][0]["sensor2ego"] = [
        [0.0, 0.0, 1.0, 2.0], [-1.0, 0.0, 0.0, 0.0], [0.0, -1.0, 0.0, 1.0], [0.0, 0.0, 0.0, 1.0],
    ]  # level camera at (2, 0, 1) looking along ego +x
    rig = parse_config(data)
    camera = rig.cameras[0]
    # a point 10 m ahead, 1 m to the left (ego +y) and 1 m up: camera x = -1 (left), y = -1 (up), z = 10
    uv, ok = project_cam_to_image(camera, np.array([-1.0, -1.0, 10.0]))
    uv_ego, ok_ego = project_bev_to_feature(rig, camera, np.array([12.0, 1.0, 2.0]))
    assert ok and ok_ego
    assert uv[0] == pytest.approx(95.5 - 11.0) and uv[1] == pytest.approx(63.5 - 11.0)
    np.testing.assert_allclose(uv_ego, image_px_to_feature_px(rig, camera, uv), atol=1e-12)


def test_convention_rigid_transforms_are_elementwise_ieee(nuscenes: RigConfig) -> None:
    """``transform_points`` computes ``((m_i0 x + m_i1 y) + m_i2 z) + t_i`` with plain IEEE
    multiplies and adds (no BLAS kernel, whose FMA use depends on the CPU): every output equals
    the same expression evaluated in Python floats, bit for bit, so stores are the same bytes
    on every machine."""
    rng = np.random.default_rng(11)
    points = rng.uniform(-60.0, 60.0, size=(257, 3))
    for camera in nuscenes.cameras:
        for matrix in (ego_from_cam_matrix(camera), cam_from_ego_matrix(camera)):
            got = transform_points(matrix, points)
            m = matrix.tolist()
            want = [[m[i][0] * x + m[i][1] * y + m[i][2] * z + m[i][3] for i in range(3)] for x, y, z in points.tolist()]
            assert np.array_equal(got, np.array(want))
        rot = np.array(camera.ego_from_cam)[:3, :3].tolist()
        t = np.array(camera.ego_from_cam)[:3, 3].tolist()
        inv_t = [-(rot[0][i] * t[0] + rot[1][i] * t[1] + rot[2][i] * t[2]) for i in range(3)]
        assert cam_from_ego_matrix(camera)[:3, 3].tolist() == inv_t
        round_trip = transform_points(cam_from_ego_matrix(camera), transform_points(ego_from_cam_matrix(camera), points))
        np.testing.assert_allclose(round_trip, points, rtol=0, atol=1e-12)


# -- the BEV frame (bev.frame) ---------------------------------------------------------------


def test_convention_bev_frame_pose_is_mmdet3d_sensor2lidar() -> None:
    """With ``bev.frame: LIDAR_TOP`` a camera's pose is mmdet3d's ``sensor2lidar`` (the one every
    mmdet3d info file, BEVFormer, Fast-BEV, DETR3D and PETR project with): ``obtain_sensor2top`` of
    open-mmlab/mmdetection3d tools/data_converter/nuscenes_converter.py (commit 010cd4b),
    restated in tests/upstream.py, for one static pose (camera and lidar at the same ego pose,
    which makes the ego pose itself drop out). Measured: max |difference| 3.3e-16 on nuScenes."""
    data = rigs.in_lidar_frame(rigs.nuscenes_data())
    rig = parse_config(data)
    lidar = data["sensors"][0]
    worst = 0.0
    for i, camera in enumerate(rig.cameras):
        rotation, translation = upstream.mmdet3d_sensor2lidar(data["cameras"][i], lidar)
        ours = bev_from_cam_matrix(rig, camera)
        worst = max(worst, float(np.abs(ours[:3, :3] - rotation).max()), float(np.abs(ours[:3, 3] - translation).max()))
        np.testing.assert_array_equal(cam_from_bev_matrix(rig, camera)[3], [0.0, 0.0, 0.0, 1.0])
        np.testing.assert_allclose(cam_from_bev_matrix(rig, camera) @ ours, np.eye(4), rtol=0, atol=1e-14)
    assert worst < 1e-14
    # LIDAR_TOP sits 1.84 m above and 0.99 m ahead of the ego origin, pitched ~2.6 deg: in its
    # frame the ego origin is at (0.006, -0.900, -1.884) m
    ego_origin = bev_from_ego_matrix(rig)[:3, 3]
    assert -1.9 < ego_origin[2] < -1.75 and -1.1 < ego_origin[1] < -0.85 and abs(ego_origin[0]) < 0.01


def test_convention_bev_frame_ego_keeps_the_ego_pose_bytes(nuscenes: RigConfig) -> None:
    """``bev.frame: ego`` (the default): the pose every product uses IS ``ego_from_cam`` (same
    bytes), so the stores of ego-frame configs do not change."""
    assert nuscenes.bev.frame == "ego"
    assert np.array_equal(bev_from_ego_matrix(nuscenes), np.eye(4))
    for camera in nuscenes.cameras:
        assert np.array_equal(bev_from_cam_matrix(nuscenes, camera), ego_from_cam_matrix(camera))
        assert np.array_equal(cam_from_bev_matrix(nuscenes, camera), cam_from_ego_matrix(camera))


def test_projection_in_a_sensor_frame_equals_projecting_the_ego_point() -> None:
    """A point given in LIDAR_TOP coordinates projects where the same point in ego coordinates
    (``ego_from_sensor @ p``) projects with the ego-frame rig."""
    data = rigs.nuscenes_data()
    ego_rig = parse_config(data)
    lidar_rig = parse_config(rigs.in_lidar_frame(data))
    rng = np.random.default_rng(3)
    points_lidar = rng.uniform([-40, -40, -3], [40, 40, 3], size=(500, 3))
    ego_from_lidar = np.array(lidar_rig.sensors[0].ego_from_sensor)
    points_ego = points_lidar @ ego_from_lidar[:3, :3].T + ego_from_lidar[:3, 3]
    seen = 0
    for cam_ego, cam_lidar in zip(ego_rig.cameras, lidar_rig.cameras, strict=True):
        uv_a, ok_a = project_bev_to_feature(lidar_rig, cam_lidar, points_lidar)
        uv_b, ok_b = project_bev_to_feature(ego_rig, cam_ego, points_ego)
        assert np.array_equal(ok_a, ok_b)
        inside = ok_a & inside_feature_map(uv_a, lidar_rig.feature_size)
        np.testing.assert_allclose(uv_a[inside], uv_b[inside], rtol=0, atol=1e-9)
        seen += int(inside.sum())
    assert seen > 50
