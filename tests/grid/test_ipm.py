"""IPM grids: conventions, the valid rule, and equivalence with torch grid_sample at the true
projections computed independently with OpenCV."""

from __future__ import annotations

import math
from typing import Any

import cv2
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bevcompile import memory
from bevcompile.grid.ipm import (
    INVALID_PX,
    bev_cell_centres,
    build_grid_products,
    compute_sampling_grid,
    decode_norm_int16,
    encode_norm_int16,
    feature_px_to_norm,
    inside_feature_map,
    norm_to_feature_px,
)
from bevcompile.rig.config import Camera, RigConfig, parse_config
from bevcompile.rig.geometry import (
    distort_normalized,
    ego_from_cam_matrix,
    feature_px_to_image_px,
    intersect_feature_rays_with_plane,
    undistort_normalized,
    unproject_image_to_cam,
)

from .. import rigs
from ..rig.test_geometry import _cv2_project, cv2_jacobian_det
from ..rigs import distorted_rig, nuscenes_data, nuscenes_rig, small_rig

RIGS = {
    "nuscenes": nuscenes_rig(),
    "distorted": distorted_rig(),
    "small-multi": small_rig(distortion=True, heights=(-0.5, 0.0, 1.0), bev_half_m=20.0),
    "small-linspace": small_rig(pixel_mapping="linspace"),
}


def _true_feature_px(rig: RigConfig) -> tuple[np.ndarray, np.ndarray]:
    """Independent reference: OpenCV projection of the cell centres, then the pixel chain
    written out from the README conventions (resize, crop, stride or linspace)."""
    xs = rig.bev.x.min + (np.arange(rig.bev.nx) + 0.5) * rig.bev.x.step
    ys = rig.bev.y.min + (np.arange(rig.bev.ny) + 0.5) * rig.bev.y.step
    hh, yy, xx = np.meshgrid(np.array(rig.bev.heights), ys, xs, indexing="ij")
    points_ego = np.stack([xx, yy, hh], axis=-1)
    w_f, h_f = rig.feature_size
    uvs, fronts = [], []
    for camera in rig.cameras:
        image = _cv2_project(camera, points_ego)
        ego_from_cam = ego_from_cam_matrix(camera)
        depth = (points_ego - ego_from_cam[:3, 3]) @ ego_from_cam[:3, 2]
        aug = camera.image_aug
        u_in = image[..., 0] * aug.resize - aug.crop_left
        v_in = image[..., 1] * aug.resize - aug.crop_top
        s = rig.feature.stride
        if rig.feature.pixel_mapping == "stride":
            uv = np.stack([(u_in - (s - 1) / 2) / s, (v_in - (s - 1) / 2) / s], -1)
        else:
            uv = np.stack([u_in * (w_f - 1) / (aug.input_width - 1), v_in * (h_f - 1) / (aug.input_height - 1)], -1)
        # angle off the optical axis vs. the lens's fold-back angle (dense scan, written here)
        points_cam = (points_ego - ego_from_cam[:3, 3]) @ ego_from_cam[:3, :3]
        radius = np.hypot(points_cam[..., 0], points_cam[..., 1]) / np.where(depth > 0, depth, 1.0)
        uvs.append(uv)
        fronts.append((depth > 0) & (radius < _fold_radius(camera)))
    return np.stack(uvs), np.stack(fronts)


def _fold_radius(camera: Camera) -> float:
    """First tan(angle) where the distorted radius stops increasing (inf for pinhole)."""
    k = camera.distortion.coeffs
    r = np.linspace(0.0, 50.0, 2_000_001)
    if camera.distortion.model == "opencv":
        r2 = r * r
        rd = r * (1 + k[0] * r2 + k[1] * r2**2 + k[4] * r2**3) / (1 + k[5] * r2 + k[6] * r2**2 + k[7] * r2**3)
    elif camera.distortion.model == "fisheye":
        t = np.arctan(r)
        rd = t * (1 + k[0] * t**2 + k[1] * t**4 + k[2] * t**6 + k[3] * t**8)
    else:
        return float("inf")
    falling = np.flatnonzero(np.diff(rd) <= 0)
    return float(r[falling[0]]) if falling.size else float("inf")


def _torch_sample(features: np.ndarray, norm: np.ndarray, align_corners: bool) -> np.ndarray:
    """grid_sample per camera and height: features (n_cam, C, H, W), norm (n_cam, n_h, ny, nx, 2)."""
    n_cam, n_h, ny, nx, _ = norm.shape
    grid = torch.from_numpy(np.ascontiguousarray(norm.reshape(n_cam, n_h * ny, nx, 2))).double()
    out = torch.nn.functional.grid_sample(
        torch.from_numpy(features).double(), grid, mode="bilinear", padding_mode="zeros", align_corners=align_corners
    )
    return out.numpy().reshape(n_cam, -1, n_h, ny, nx)


@pytest.mark.parametrize("rig_name", list(RIGS))
@pytest.mark.parametrize("align_corners", [False, True])
def test_grid_samples_what_grid_sample_samples_at_the_true_projections(rig_name: str, align_corners: bool) -> None:
    """The Done-when criterion of the foundation issue, with OpenCV as the independent geometry."""
    rig = RIGS[rig_name]
    products = build_grid_products(compute_sampling_grid(rig), align_corners)
    true_uv, in_front = _true_feature_px(rig)
    w_f, h_f = rig.feature_size
    rng = np.random.default_rng(7)
    features = rng.uniform(0.0, 1.0, size=(rig.n_cam, 3, h_f, w_f))
    stored = _torch_sample(features, products.norm.astype(np.float64), align_corners)
    # reference: torch grid_sample at the true projection, normalised with the formula written here
    size = np.array([w_f, h_f], dtype=np.float64)
    true_norm = true_uv * 2 / (size - 1) - 1 if align_corners else (2 * true_uv + 1) / size - 1
    reference = _torch_sample(features, np.where(np.isfinite(true_norm), true_norm, -5.0), align_corners)
    valid = products.valid
    # valid cells: identical up to float32 storage of norm (|d norm| <= 6e-8 -> < 1e-5 in value)
    diff = np.abs(stored - reference).transpose(1, 0, 2, 3, 4)[:, valid]
    assert diff.max() < 1e-5
    # invalid cells sample exactly 0
    assert np.all(stored.transpose(1, 0, 2, 3, 4)[:, ~valid] == 0.0)
    # the valid rule, recomputed from the independent projection
    expected_valid = (
        in_front
        & (true_uv[..., 0] >= -0.5) & (true_uv[..., 0] < w_f - 0.5)
        & (true_uv[..., 1] >= -0.5) & (true_uv[..., 1] < h_f - 0.5)
    )
    assert np.array_equal(valid, expected_valid)
    assert valid.any() and (~valid).any()


def _camera_frame_cells(rig: RigConfig) -> np.ndarray:
    """Cell centres in every camera frame, ``(n_cam, n_heights, ny, nx, 3)`` (numpy matmul,
    independent of the code's elementwise transform)."""
    centres = bev_cell_centres(rig.bev)
    out = []
    for camera in rig.cameras:
        ego_from_cam = ego_from_cam_matrix(camera)
        out.append((centres - ego_from_cam[:3, 3]) @ ego_from_cam[:3, :3])
    return np.stack(out)


def _cv2_inside(rig: RigConfig, true_uv: np.ndarray) -> np.ndarray:
    w_f, h_f = rig.feature_size
    u, v = true_uv[..., 0], true_uv[..., 1]
    return (u >= -0.5) & (u < w_f - 0.5) & (v >= -0.5) & (v < h_f - 0.5)


def test_distorted_example_has_cells_that_opencv_would_wrap_into_the_image() -> None:
    """CAM_FRONT's illustrative lens folds back at 66.1 deg off-axis, CAM_BACK_RIGHT's at
    65.4 deg. Ground cells in front of those cameras but past the fold, at 70-72 deg, land
    inside the feature map under cv2.projectPoints: 91 in CAM_FRONT and 129 in CAM_BACK_RIGHT,
    220 in all. They must be invalid, not sampled. (Cells behind a camera, which
    cv2.projectPoints mirrors into the image too, are not counted: z_cam > 0 excludes them.)"""
    rig = RIGS["distorted"]
    grid = compute_sampling_grid(rig)
    true_uv, _ = _true_feature_px(rig)
    cv2_inside = _cv2_inside(rig, true_uv)
    points_cam = _camera_frame_cells(rig)
    depth = points_cam[..., 2]
    radius = np.hypot(points_cam[..., 0], points_cam[..., 1]) / np.where(depth > 0, depth, 1.0)
    angle_deg = np.degrees(np.arctan(radius))
    wrapped = []
    for cam_index, camera in enumerate(rig.cameras):
        past_fold = (depth[cam_index] > 0) & (radius[cam_index] >= _fold_radius(camera))
        cells = cv2_inside[cam_index] & past_fold
        assert not (cells & grid.valid[cam_index]).any()
        if cells.any():
            assert angle_deg[cam_index][cells].min() > 70.0
            assert angle_deg[cam_index][cells].max() < 72.0
        wrapped.append(int(cells.sum()))
    assert [camera.name for camera in rig.cameras] == [
        "CAM_FRONT", "CAM_FRONT_RIGHT", "CAM_FRONT_LEFT", "CAM_BACK", "CAM_BACK_LEFT", "CAM_BACK_RIGHT",
    ]
    assert wrapped == [91, 0, 0, 0, 0, 129]
    assert math.degrees(math.atan(_fold_radius(rig.cameras[0]))) == pytest.approx(66.1, abs=0.05)
    assert math.degrees(math.atan(_fold_radius(rig.cameras[5]))) == pytest.approx(65.4, abs=0.05)


def _nuscenes_with_lens(distortion: dict[str, Any], focal_px: float, heights: tuple[float, ...] = (0.0,)) -> RigConfig:
    """The nuScenes rig with one lens on every camera (fx = fy = focal_px)."""
    data = nuscenes_data()
    for camera in data["cameras"]:
        camera["distortion"] = distortion
        camera["intrinsic"][0][0] = camera["intrinsic"][1][1] = focal_px
    data["bev"]["heights"] = list(heights)
    return parse_config(data)


def test_tangential_fold_cells_are_invalid_and_round_trip() -> None:
    """Audit repro: with ``coeffs [-0.3, 0.1, 0.001, -0.001, -0.02]``, fx = fy = 400, 33 cells
    just inside the radial fold (55.6 deg) lie where the 2-D distortion map has folded
    (det J <= 0); the radial rule alone kept them. The valid mask equals the independent rule
    (cv2 projection, radial fold by a dense scan, det J by finite differences of cv2), and every
    valid cell's ray is what its pixel unprojects to."""
    rig = _nuscenes_with_lens({"model": "opencv", "coeffs": [-0.3, 0.1, 0.001, -0.001, -0.02]}, 400.0)
    distortion = rig.cameras[0].distortion
    grid = compute_sampling_grid(rig)
    true_uv, in_front_radial = _true_feature_px(rig)
    points_cam = _camera_frame_cells(rig)
    depth = points_cam[..., 2]
    xy = points_cam[..., :2] / np.where(depth > 0, depth, 1.0)[..., None]
    candidates = in_front_radial & _cv2_inside(rig, true_uv)  # the old rule
    det = np.full(depth.shape, np.nan)
    det[candidates] = cv2_jacobian_det(distortion.coeffs, xy[candidates])
    assert np.abs(det[candidates]).min() > 1e-8  # no cell too close to det = 0 for finite differences
    assert np.array_equal(grid.valid, candidates & (det > 0))
    assert int((candidates & (det <= 0)).sum()) == 33
    assert (cv2_jacobian_det(distortion.coeffs, xy[grid.valid]) > 0).all()
    xy_valid = xy[grid.valid][::8]  # every 8th valid cell: the round trip is the same per point
    xy_d, ok = distort_normalized(distortion, xy_valid)
    back, ok_back = undistort_normalized(distortion, xy_d)
    assert ok.all() and ok_back.all()
    assert np.abs(back - xy_valid).max() < 1e-9
    # the lift (frustum products): a feature pixel whose ray would be folded gives no point
    w_f, h_f = rig.feature_size
    v, u = np.meshgrid(np.arange(h_f, dtype=np.float64), np.arange(w_f, dtype=np.float64), indexing="ij")
    uv_feature = np.stack([u.ravel(), v.ravel()], axis=-1)
    for camera in rig.cameras:
        uv_image = feature_px_to_image_px(rig, camera, uv_feature)
        points, ok = unproject_image_to_cam(camera, uv_image, 1.0)
        assert 0 < ok.sum() < ok.size
        assert (cv2_jacobian_det(distortion.coeffs, points[ok][:, :2]) > 0).all()
        assert np.abs(_cv2_project_cam(camera, points[ok]) - uv_image[ok]).max() < 1e-6


def _cv2_project_cam(camera: Camera, points_cam: np.ndarray) -> np.ndarray:
    image, _ = cv2.projectPoints(
        points_cam.reshape(-1, 1, 3), np.zeros(3), np.zeros(3), np.array(camera.intrinsic),
        np.array(camera.distortion.coeffs[: camera.distortion.n_coeffs_given]),
    )
    return image.reshape(-1, 2)


def test_fisheye_cells_up_to_90_degrees_are_valid() -> None:
    """Audit repro: a fisheye monotonic up to 90 deg (``[0.05, -0.01, 0.002, -0.0002]``,
    fx = fy = 300) used to stop at 89.94 deg (the r = tan(angle) search cap); the cells
    between 89.94 and 90 deg that cv2.fisheye.projectPoints puts in the map are valid now
    (33 of them, was 1), and the whole mask equals the independent rule."""
    rig = _nuscenes_with_lens({"model": "fisheye", "coeffs": [0.05, -0.01, 0.002, -0.0002]}, 300.0)
    grid = compute_sampling_grid(rig)
    true_uv, in_front = _true_feature_px(rig)  # no fold: in front of the camera
    expected = in_front & _cv2_inside(rig, true_uv)
    assert np.array_equal(grid.valid, expected)
    points_cam = _camera_frame_cells(rig)
    angle_deg = np.degrees(np.arctan2(np.hypot(points_cam[..., 0], points_cam[..., 1]), points_cam[..., 2]))
    band = grid.valid & (angle_deg > 89.94) & (angle_deg < 90.0)
    assert int(band.sum()) == 33
    assert int((band & (angle_deg > math.degrees(math.atan(1e3)))).sum()) == 32  # past the old cap
    assert np.abs(grid.coords_feature_px[band] - true_uv[band]).max() < 1e-6


@pytest.mark.parametrize("rig_name", list(RIGS))
def test_grid_coordinates_round_trip_to_the_sampling_plane(rig_name: str) -> None:
    """Grid (u, v) of every valid cell, lifted back along its ray to z = height, hits the cell centre."""
    rig = RIGS[rig_name]
    grid = compute_sampling_grid(rig)
    centres = bev_cell_centres(rig.bev)
    for cam_index, camera in enumerate(rig.cameras):
        for ih, height in enumerate(rig.bev.heights):
            valid = grid.valid[cam_index, ih]
            back, ok = intersect_feature_rays_with_plane(rig, camera, grid.coords_feature_px[cam_index, ih][valid], height)
            assert ok.all()
            assert np.abs(back - centres[ih][valid]).max() < 1e-4


def test_convention_bev_cell_centres() -> None:
    rig = small_rig()
    centres = bev_cell_centres(rig.bev)
    assert centres.shape == (1, 24, 24, 3)
    # cell (iy, ix) = (0, 0) is at (x_min + dx/2, y_min + dy/2); ix runs along x, iy along y
    np.testing.assert_allclose(centres[0, 0, 0], [-11.5, -11.5, 0.0])
    np.testing.assert_allclose(centres[0, 0, 1], [-10.5, -11.5, 0.0])
    np.testing.assert_allclose(centres[0, 1, 0], [-11.5, -10.5, 0.0])


def test_convention_valid_rule_bounds() -> None:
    uv = np.array([[-0.5, 0.0], [-0.5001, 0.0], [11.4999, 7.0], [11.5, 7.0], [0.0, -0.5], [0.0, 7.5], [np.nan, 1.0]])
    assert inside_feature_map(uv, (12, 8)).tolist() == [True, False, True, False, True, False, False]


def test_convention_invalid_cells_sample_exactly_zero_for_any_align_corners() -> None:
    rig = RIGS["small-multi"]
    grid = compute_sampling_grid(rig)
    assert np.all(grid.coords_feature_px[~grid.valid] == INVALID_PX)
    assert np.isfinite(grid.coords_feature_px).all()
    features = np.ones((rig.n_cam, 1, rig.feature_size[1], rig.feature_size[0]))
    for align_corners in (False, True):
        norm = build_grid_products(grid, align_corners).norm
        sampled = _torch_sample(features, norm.astype(np.float64), align_corners)[:, 0]
        assert np.all(sampled[~grid.valid] == 0.0)
        assert np.all(sampled[grid.valid] > 0.0)  # the nearest pixel is inside: never fully zero


def test_convention_norm_formula_matches_torch_unnormalize() -> None:
    """PyTorch: pixel = ((norm + 1) * size - 1) / 2 (align_corners False), (norm + 1) / 2 * (size - 1) (True)."""
    uv = np.array([[0.0, 0.0], [43.0, 15.0], [-0.5, -0.5], [21.5, 7.5]])
    np.testing.assert_allclose(feature_px_to_norm(uv, (44, 16), False)[2], [-1.0, -1.0])
    np.testing.assert_allclose(feature_px_to_norm(uv, (44, 16), False)[3], [0.0, 0.0])
    np.testing.assert_allclose(feature_px_to_norm(uv, (44, 16), True)[0], [-1.0, -1.0])
    np.testing.assert_allclose(feature_px_to_norm(uv, (44, 16), True)[1], [1.0, 1.0])
    for align_corners in (False, True):
        back = norm_to_feature_px(feature_px_to_norm(uv, (44, 16), align_corners), (44, 16), align_corners)
        np.testing.assert_allclose(back, uv, atol=1e-12)


def test_norm_int16_is_saturating_and_its_error_is_measured() -> None:
    assert encode_norm_int16(np.array([-3.0, -1.0, 0.0, 0.5, 1.0, 2.0])).tolist() == [-32767, -32767, 0, 16384, 32767, 32767]
    rig = nuscenes_rig()
    products = build_grid_products(compute_sampling_grid(rig), False)
    decoded = norm_to_feature_px(decode_norm_int16(products.norm_int16), rig.feature_size, False)
    coords = compute_sampling_grid(rig).coords_feature_px
    measured = np.abs(decoded - coords)[products.valid].max()
    assert products.norm_int16_max_error_px == measured
    assert measured <= 0.5 * 44 / 2 / 32767 + 1e-12  # half a quantum of 2/32767 norm, in pixels


def test_norm_int16_saturation_is_counted_only_under_align_corners() -> None:
    """align_corners=True cannot represent the valid rule's outer half pixel: those cells clamp."""
    rig = RIGS["small-multi"]
    grid = compute_sampling_grid(rig)
    assert build_grid_products(grid, False).norm_int16_saturated_valid_cells == 0
    products = build_grid_products(grid, True)
    w_f, h_f = rig.feature_size
    u, v = grid.coords_feature_px[..., 0], grid.coords_feature_px[..., 1]
    pre_u = (u * 2 / (w_f - 1) - 1) * 32767  # written out: the code before the clip
    pre_v = (v * 2 / (h_f - 1) - 1) * 32767
    expected = int(((np.abs(pre_u) > 32767.5) | (np.abs(pre_v) > 32767.5))[grid.valid].sum())
    assert products.norm_int16_saturated_valid_cells == expected > 0
    assert 0.49 < products.norm_int16_max_error_px <= 0.5


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-1.0, 1.0), min_size=1, max_size=20))
def test_norm_int16_round_trip_within_half_a_quantum(values: list[float]) -> None:
    norm = np.array(values)
    assert np.abs(decode_norm_int16(encode_norm_int16(norm)) - norm).max() <= 0.5 / 32767 + 1e-15


def test_grid_is_deterministic_and_streaming_does_not_change_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import bevcompile.grid.ipm as grid_module

    rig = RIGS["small-multi"]
    first = compute_sampling_grid(rig)
    monkeypatch.setattr(grid_module, "ROWS_PER_CHUNK", 3)
    second = compute_sampling_grid(rig)
    assert np.array_equal(first.coords_feature_px, second.coords_feature_px)
    assert np.array_equal(first.valid, second.valid)


def test_memory_guard_counts_the_delta_blocks_padding(monkeypatch: pytest.MonkeyPatch) -> None:
    """The delta-LUT pads ny, nx up to multiples of --block and its temporaries scale with the
    padded grid: 128 x 128 at --block 100 is planned as 200 x 200 (2.4x the samples)."""
    import bevcompile.grid.build as build_module
    from bevcompile.errors import UsageError

    rig = nuscenes_rig()
    monkeypatch.setattr(memory, "memory_limit", lambda: memory.MemoryLimit(150 * 2**20, "available memory"))  # 150 MiB to use
    build_module.check_grid_memory(rig)  # 98,304 samples: about 128 MiB, fits
    build_module.check_grid_memory(rig, block=16)  # 128 is a multiple of 16: no padding
    with pytest.raises(UsageError, match=r"128 x 128 cells \(padded to 200 x 200 by --block 100\) = 240,000 samples needs about 173 MiB, more than the 150 MiB available memory allows; use coarser bev steps or fewer heights or a smaller --block$"):
        build_module.check_grid_memory(rig, block=100)


def test_grid_in_the_lidar_frame_equals_hand_made_cam_to_lidar_poses() -> None:
    """``bev.frame: LIDAR_TOP`` gives the grid a user got before by handing every camera its
    cam -> lidar matrix (numpy ``inv(lidar2ego) @ cam2ego``) as ``sensor2ego``: same valid cells,
    coordinates equal to float rounding. The frame matters: the ego-frame grid of the same
    cells differs in most of them (the lidar is 0.99 m ahead, 1.84 m up and turned -90 deg)."""
    data = nuscenes_data()
    lidar = compute_sampling_grid(parse_config(rigs.in_lidar_frame(data)))
    handmade = compute_sampling_grid(parse_config(rigs.lidar_poses_as_ego(data)))
    assert np.array_equal(lidar.valid, handmade.valid)
    np.testing.assert_allclose(lidar.coords_feature_px, handmade.coords_feature_px, rtol=0, atol=1e-9)
    ego = compute_sampling_grid(parse_config(data))
    assert np.count_nonzero(lidar.valid != ego.valid) > 10_000
