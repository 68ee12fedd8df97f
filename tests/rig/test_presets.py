"""Model presets: what ``preset:`` fills, how explicit fields override it, and one proof per
preset: the shipped nuScenes calibration plus one ``preset:`` line gives what the model's own
code path computes, restated from its source (tests/upstream.py, tests/interop/test_interop.py).
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml
from typer.testing import CliRunner

from bevcompile.cli import app
from bevcompile.errors import ConfigError
from bevcompile.grid.ipm import compute_sampling_grid
from bevcompile.interop.bevpoolv2 import BevPoolOptions, build_bevpoolv2
from bevcompile.interop.fastbev import FastBevOptions, build_fastbev_lut, fastbev_level_arrays, xyz_layout
from bevcompile.rig.config import config_sha256, config_to_dict, load_config, parse_config
from bevcompile.rig.presets import BEVDET_ORDER, NUSCENES_ORDER, PRESETS
from bevcompile.store.loader import load

from .. import upstream
from ..rigs import ROOT, write_yaml

CALIBRATION = ROOT / "configs" / "nuscenes_calibration.yaml"
runner = CliRunner()


def calibration_with(preset: str, **fields: Any) -> dict[str, Any]:
    """The shipped nuScenes calibration plus one ``preset:`` line (and optional explicit fields)."""
    data = yaml.safe_load(CALIBRATION.read_text())
    data["preset"] = preset
    data.update(fields)
    return data


# -- the shipped calibration and the preset mechanics ------------------------------------------


def test_the_shipped_calibration_is_the_nuscenes_config_without_network_settings() -> None:
    calibration = yaml.safe_load(CALIBRATION.read_text())
    shipped = yaml.safe_load((ROOT / "configs" / "nuscenes.yaml").read_text())
    assert calibration["cameras"] == shipped["cameras"] and calibration["sensors"] == shipped["sensors"]
    assert set(calibration) == {"description", "cameras", "sensors"}
    with pytest.raises(ConfigError, match=r"nuscenes_calibration.yaml: name: missing required field \(or add a preset: line"):
        load_config(CALIBRATION)


def test_a_preset_fills_every_setting_and_explicit_fields_override(tmp_path: Path) -> None:
    rig = parse_config(calibration_with("fastbev-m0"))
    assert rig.name == "fastbev-m0" and rig.preset == "fastbev-m0"
    assert rig.camera_names == NUSCENES_ORDER and rig.bev.frame == "LIDAR_TOP"
    aug = rig.cameras[0].image_aug
    assert (aug.resize, aug.crop_left, aug.crop_top, aug.input_width, aug.input_height) == (0.44, 0.0, 70.0, 704, 256)
    assert (rig.feature.stride, rig.feature.pixel_mapping, rig.feature_size) == (4, "corner", (176, 64))
    assert rig.bev.heights == (-4.0, -2.5, -1.0, 0.5) and (rig.bev.nx, rig.bev.ny) == (200, 200)
    assert rig.interop_options("fastbev-lut") == {"overlap": "last", "precision": "float32", "xyz_layout": True}
    # explicit fields override field by field (bev.heights only; the preset keeps x, y, frame)
    edited = parse_config(calibration_with("fastbev-m0", name="mine", bev={"heights": [0.0]}, interop={"fastbev-lut": {"overlap": "first"}}))
    assert edited.name == "mine" and edited.bev.heights == (0.0,) and edited.bev.frame == "LIDAR_TOP" and edited.bev.nx == 200
    assert edited.interop_options("fastbev-lut")["overlap"] == "first" and edited.interop_options("fastbev-lut")["precision"] == "float32"
    stride = parse_config(calibration_with("bevformer-base", feature={"stride": 16}))
    assert stride.n_levels == 1 and stride.feature.pixel_mapping == "normalized" and stride.feature.size_rule == "ceil"
    order = parse_config(calibration_with("bevdet-r50", camera_order=list(NUSCENES_ORDER)))
    assert order.camera_names == NUSCENES_ORDER
    # the resolved config re-parses to the same config and hash (the preset re-applied under it)
    for name in PRESETS:
        rig = parse_config(calibration_with(name))
        resolved = config_to_dict(rig)
        assert resolved["preset"] == name
        again = parse_config(resolved)
        assert config_to_dict(again) == resolved and config_sha256(again) == config_sha256(rig), name
        assert load_config(write_yaml(tmp_path / f"{name}.yaml", calibration_with(name))).name == name


PRESET_ERRORS = [
    ("unknown", {"preset": "bevfusion"}, "preset", "unknown preset 'bevfusion': expected one of bevdet-r50, bevdepth-r50"),
    ("no-lidar", {"sensors": []}, "sensors", "preset bevformer-base puts the BEV grid in the LIDAR_TOP frame: list LIDAR_TOP under sensors:"),
    ("order-missing", {"camera_order": ["CAM_FRONT"]}, "camera_order", "lists 1 of the 6 cameras; missing CAM_FRONT_RIGHT"),
    ("order-unknown", {"camera_order": ["CAM_X"]}, "camera_order[0]", "no camera named 'CAM_X'"),
    ("interop-value", {"interop": {"fastbev-lut": {"overlap": "middle"}}}, "interop.fastbev-lut.overlap", "expected one of first, last, nearest-centre"),
    ("interop-target", {"interop": {"lss": {}}}, "interop.lss", "unknown field"),
    ("petr-depth-start", {"interop": {"petr-coords3d": {"depth_start": 0}}}, "interop.petr-coords3d.depth_start", "must be > 0, got 0"),
    ("petr-range", {"interop": {"petr-coords3d": {"position_range": [0, 0, 0, 0, 1, 1]}}}, "interop.petr-coords3d.position_range",
     "min must be < max on every axis, got 0 >= 0 (axis x)"),
    ("petr-depth-num", {"interop": {"petr-coords3d": {"depth_num": 2048}}}, "interop.petr-coords3d.depth_num", "must be in [1, 1024], got 2048"),
]


@pytest.mark.parametrize(("case", "edit", "field", "phrase"), PRESET_ERRORS, ids=[c[0] for c in PRESET_ERRORS])
def test_bad_preset_fields_are_named(tmp_path: Path, case: str, edit: dict[str, Any], field: str, phrase: str) -> None:
    data = calibration_with("bevformer-base")
    data.update(copy.deepcopy(edit))
    config = write_yaml(tmp_path / "rig.yaml", data)
    with pytest.raises(ConfigError) as info:
        load_config(config)
    assert info.value.field == field and phrase in info.value.message, str(info.value)


def test_every_preset_names_the_source_of_its_settings_and_a_proof() -> None:
    for preset in PRESETS.values():
        settings = {s.setting.split(".")[0] for s in preset.sources}
        assert {"camera_order", "image_aug", "feature", "bev"} <= settings, preset.name
        assert all(len(s.commit) == 40 and s.repo.count("/") == 1 for s in preset.sources), preset.name
        path, _, test = preset.proof.partition("::")
        assert (ROOT / path).exists() and f"def {test}(" in (ROOT / path).read_text(), preset.proof


# -- proofs: one per preset --------------------------------------------------------------------


def test_bevdet_r50_preset_equals_bevdet_dev3_code_path(tmp_path: Path) -> None:
    """calibration + ``preset: bevdet-r50`` -> ``bevcompile grid`` -> ``bevcompile export-interop``
    (no options: the preset's interop settings) gives BEVDet dev3.0's own BEVPoolv2 arrays, bit for
    bit: ``data_config['cams']`` order, ``PrepareImageInputs`` test augmentation (resize 704/1600,
    crop top int(396) - 256 = 140; configs/bevdet/bevdet-r50.py and
    mmdet3d/datasets/pipelines/loading.py of the dev3.0 fork byounghun24/BEVDet @d5132c4 / @15e21d4),
    and ``get_lidar_coor`` + ``voxel_pooling_prepare_v2`` in float32 (the transcription of
    tests/interop/test_interop.py). Measured: with the calibration's own (nuScenes) camera order
    instead, 148,658 of BEVDet's 179,806 (voxel, depth, feature) triples are missing."""
    from ..interop.test_interop import NAMES, bevdet_voxel_pooling_prepare_v2

    config = write_yaml(tmp_path / "bevdet.yaml", calibration_with("bevdet-r50"))
    assert runner.invoke(app, ["grid", str(config), "--out", str(tmp_path), "--quiet"]).exit_code == 0
    store = tmp_path / "bevdet-r50.zarr"
    result = runner.invoke(app, ["export-interop", str(store), "--quiet"])
    assert result.exit_code == 0, result.output
    rig = load(store).rig
    assert rig.camera_names == BEVDET_ORDER
    w, h = 1600, 900
    resize = 704 / w + 0.0  # sample_augmentation (test)
    assert all((c.image_aug.resize, c.image_aug.crop_top) == (resize, int((1 - 0.0) * int(h * resize)) - 256) for c in rig.cameras)
    ref = bevdet_voxel_pooling_prepare_v2(rig, dtype=torch.float32)
    interop = load(store)["interop"]
    for name, want in zip(NAMES, ref, strict=True):
        assert np.array_equal(interop[f"bevpoolv2_{name}"], want), name
    assert dict(interop.attrs["build_options"]["bevpoolv2"]) == {"frustum_mapping": "linspace", "rounding": "trunc", "z_bins": None, "batch": 1, "precision": "float32"}
    # the camera order matters: nuScenes' order (the calibration's) loses 148,658 of BEVDet's
    # 179,806 (voxel, depth, feature) triples
    nuscenes_order = build_bevpoolv2(parse_config(calibration_with("bevdet-r50", camera_order=list(NUSCENES_ORDER))), BevPoolOptions(precision="float32"))
    theirs = set(zip(*(a.tolist() for a in ref[:3]), strict=True))
    ours = set(zip(nuscenes_order.ranks_bev.tolist(), nuscenes_order.ranks_depth.tolist(), nuscenes_order.ranks_feat.tolist(), strict=True))
    assert len(theirs - ours) == 148_658
    assert runner.invoke(app, ["inspect", str(store), "--quiet"]).exit_code == 0


def bevdepth_geometry(rig: Any, dtype: torch.dtype = torch.float64, sensor2ego: list[np.ndarray] | None = None) -> list[np.ndarray]:
    """BEVDepth's ``create_frustum`` + ``get_geometry`` + voxel index in float64 (or ``dtype``)
    (Megvii-BaseDetection/BEVDepth bevdepth/layers/backbones/base_lss_fpn.py @056cf66): 4x4
    ``ida_mat`` (resize, crop) inverted, ``(x d, y d, d, 1)``, ``sensor2ego @ inverse(intrin)``,
    ``((geom - (voxel_coord - voxel_size / 2)) / voxel_size).int()`` (toward zero), kept iff
    ``0 <= index < voxel_num`` (``voxel_coord = x_bound[0] + x_bound[2] / 2`` per axis, a tensor
    of ``dtype`` as its buffers are). ``sensor2ego`` (per camera, 4x4), when given, replaces the
    rig's poses (e.g. BEVDepth's own per-sample ``sensor2ego_mats``). Returns the voxel of every
    frustum point, -1 where dropped."""
    ogf_h, ogf_w = 256, 704
    fh, fw = ogf_h // 16, ogf_w // 16
    d = torch.arange(2.0, 58.0, 0.5, dtype=dtype).view(-1, 1, 1).expand(-1, fh, fw)
    xs = torch.linspace(0, ogf_w - 1, fw, dtype=dtype).view(1, 1, fw).expand(d.shape[0], fh, fw)
    ys = torch.linspace(0, ogf_h - 1, fh, dtype=dtype).view(1, fh, 1).expand(d.shape[0], fh, fw)
    frustum = torch.stack((xs, ys, d, torch.ones_like(d)), -1)
    size = torch.tensor([0.8, 0.8, 8.0], dtype=dtype)  # voxel_size, voxel_coord: buffers of x/y/z_bound
    lower = torch.tensor([-51.2 + 0.8 / 2.0, -51.2 + 0.8 / 2.0, -5.0 + 8.0 / 2.0], dtype=dtype) - size / 2.0
    out = []
    for index, cam in enumerate(rig.cameras):
        a = cam.image_aug
        ida = torch.eye(4, dtype=dtype)
        ida[0, 0] = ida[1, 1] = a.resize
        ida[0, 3], ida[1, 3] = -a.crop_left, -a.crop_top
        intrin = torch.eye(4, dtype=dtype)
        intrin[:3, :3] = torch.tensor(cam.intrinsic, dtype=dtype)
        sensor2ego_ = torch.tensor(cam.ego_from_cam if sensor2ego is None else sensor2ego[index], dtype=dtype)
        points = ida.inverse().matmul(frustum.unsqueeze(-1))
        points = torch.cat((points[..., :2, :] * points[..., 2:3, :], points[..., 2:, :]), -2)
        geom = (sensor2ego_.matmul(torch.inverse(intrin)) @ points).squeeze(-1)[..., :3]
        index = ((geom - lower) / size).int()
        kept = (index[..., 0] >= 0) & (index[..., 0] < 128) & (index[..., 1] >= 0) & (index[..., 1] < 128) & (index[..., 2] >= 0) & (index[..., 2] < 1)
        flat = (index[..., 2] * 128 + index[..., 1]) * 128 + index[..., 0]
        out.append(torch.where(kept, flat, -1).numpy())
    return out


def test_bevdepth_r50_preset_equals_bevdepth_get_geometry() -> None:
    """``preset: bevdepth-r50``: depth bins [2, 58, 0.5] (112), BEVDet's camera order, resize
    max(256/900, 704/1600) = 0.44, crop top 140 (bevdepth/exps/nuscenes/base_exp.py @03a4caa):
    the BEVPoolv2 arrays hold exactly BEVDepth's point -> voxel assignment of its get_geometry
    (every kept point and its voxel): the preset's float32 arrays that of BEVDepth's float32 run,
    the float64 arrays that of the same code in float64. Measured on nuScenes: the two runs
    differ in 6 of the 473,088 frustum points (float32 rounding at a voxel boundary)."""
    rig = parse_config(calibration_with("bevdepth-r50"))
    assert rig.depth.n_bins == 112 and rig.camera_names == BEVDET_ORDER
    assert rig.interop_options("bevpoolv2")["precision"] == "float32"
    runs = {}
    for precision, dtype in (("float32", torch.float32), ("float64", torch.float64)):
        arrays = build_bevpoolv2(rig, BevPoolOptions(**(rig.interop_options("bevpoolv2") | {"precision": precision})))
        voxels = np.concatenate([v.reshape(-1) for v in bevdepth_geometry(rig, dtype)])
        kept = np.flatnonzero(voxels >= 0)
        assert kept.size > 300_000
        order = np.argsort(arrays.ranks_depth)
        assert np.array_equal(arrays.ranks_depth[order], kept), precision
        assert np.array_equal(arrays.ranks_bev[order], voxels[kept]), precision
        runs[precision] = voxels
    assert runs["float32"].size == 473_088 and int(np.count_nonzero(runs["float32"] != runs["float64"])) == 6


def _sensor2lidar(data: dict[str, Any], name: str, ego_poses: dict[str, Any] | None) -> tuple[np.ndarray, np.ndarray]:
    """mmdet3d's ``sensor2lidar`` of camera ``name``: one static pose, or (``ego_poses``: a sample's
    ego_pose records) through the lidar sample's and the camera sample's ego poses."""
    by_name = {c["name"]: c for c in data["cameras"]}
    if ego_poses is None:
        return upstream.mmdet3d_sensor2lidar(by_name[name], data["sensors"][0])
    lidar_pose, cam_pose = _record_matrix(ego_poses["LIDAR_TOP"]), _record_matrix(ego_poses[name])
    return upstream.mmdet3d_sensor2lidar(by_name[name], data["sensors"][0], lidar_pose[:3, :3], lidar_pose[:3, 3], cam_pose[:3, :3], cam_pose[:3, 3])


def bevformer_point_sampling(rig: Any, bev_hw: tuple[int, int], ego_poses: dict[str, Any] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """BEVFormer's ``get_reference_points`` + ``point_sampling`` in float32 (fundamentalvision/BEVFormer
    projects/mmdet3d_plugin/bevformer/modules/encoder.py @001242c), with ``lidar2img`` built as its
    dataset builds it (nuscenes_dataset.py @0551733, mmdet3d's sensor2lidar of one static pose;
    RandomScaleImageMultiViewImage multiplies it by the scale) and ``img_shape`` the padded input.
    Returns ``reference_points_cam`` ``(n_cam, D, H*W, 2)`` in [0, 1] and ``bev_mask`` ``(n_cam, D, H*W)``."""
    data = yaml.safe_load(CALIBRATION.read_text())
    by_name = {c["name"]: c for c in data["cameras"]}
    h, w = bev_hw
    z, d = 8, 4
    zs = torch.linspace(0.5, z - 0.5, d, dtype=torch.float32).view(-1, 1, 1).expand(d, h, w) / z
    xs = torch.linspace(0.5, w - 0.5, w, dtype=torch.float32).view(1, 1, w).expand(d, h, w) / w
    ys = torch.linspace(0.5, h - 0.5, h, dtype=torch.float32).view(1, h, 1).expand(d, h, w) / h
    ref = torch.stack((xs, ys, zs), -1).permute(0, 3, 1, 2).flatten(2).permute(0, 2, 1)  # (D, H*W, 3)
    pc = [-51.2, -51.2, -5.0, 51.2, 51.2, 3.0]
    ref = ref.clone()
    ref[..., 0:1] = ref[..., 0:1] * (pc[3] - pc[0]) + pc[0]
    ref[..., 1:2] = ref[..., 1:2] * (pc[4] - pc[1]) + pc[1]
    ref[..., 2:3] = ref[..., 2:3] * (pc[5] - pc[2]) + pc[2]
    ref = torch.cat((ref, torch.ones_like(ref[..., :1])), -1)  # (D, Q, 4)
    scale = rig.cameras[0].image_aug.resize
    w_in, h_in = rig.input_size
    cams, masks = [], []
    for name in rig.camera_names:
        rot, tran = _sensor2lidar(data, name, ego_poses)
        lidar2img = np.diag([scale, scale, 1.0, 1.0]) @ upstream.mmdet3d_lidar2img(rot, tran, by_name[name]["intrinsic"])
        p = torch.matmul(ref.new_tensor(lidar2img).to(torch.float32), ref.unsqueeze(-1)).squeeze(-1)  # (D, Q, 4)
        eps = 1e-5
        mask = p[..., 2:3] > eps
        uv = p[..., 0:2] / torch.maximum(p[..., 2:3], torch.ones_like(p[..., 2:3]) * eps)
        uv[..., 0] /= w_in
        uv[..., 1] /= h_in
        mask = mask & (uv[..., 1:2] > 0.0) & (uv[..., 1:2] < 1.0) & (uv[..., 0:1] < 1.0) & (uv[..., 0:1] > 0.0)
        cams.append(uv.numpy())
        masks.append(torch.nan_to_num(mask).squeeze(-1).numpy())
    return np.stack(cams), np.stack(masks)


@pytest.mark.parametrize("name", ["bevformer-base", "bevformer-tiny"])
def test_bevformer_presets_equal_bevformer_point_sampling(name: str) -> None:
    """calibration + ``preset: bevformer-base | bevformer-tiny``: the grid's valid cells are
    BEVFormer's ``bev_mask`` and its normalised grid (``grid/norm``, align_corners False) is
    ``2 * reference_points_cam - 1`` (what MSDeformAttn hands grid_sample) at every level.
    Measured on nuScenes: base (4 heights x 200 x 200 x 6 cameras = 960,000 entries, 178,033
    seen) and tiny (60,000, 11,140 seen): 0 mask entries differ at every level (the normalised
    mapping gives every level the same mask); the sampling points agree to 2.7e-6 (base) and
    1.5e-6 (tiny) in grid_sample units, the float32 rounding of BEVFormer's own arithmetic. The
    same cells in the ego frame: 353,521 (base) and 22,154 (tiny) mask entries differ."""
    rig = parse_config(calibration_with(name))
    bev_hw = (rig.bev.ny, rig.bev.nx)
    ref_cam, mask = bevformer_point_sampling(rig, bev_hw)
    for level in range(rig.n_levels):
        grid = compute_sampling_grid(rig.level(level))
        valid = grid.valid.reshape(rig.n_cam, len(rig.bev.heights), -1)
        assert int(np.count_nonzero(valid != mask)) == 0, (name, level)
        w_f, h_f = rig.level(level).feature_size
        norm = np.stack([(2 * grid.coords_feature_px[..., 0] + 1) / w_f - 1, (2 * grid.coords_feature_px[..., 1] + 1) / h_f - 1], -1)
        norm = norm.reshape(rig.n_cam, len(rig.bev.heights), -1, 2)
        assert np.max(np.abs(norm[valid] - (2 * ref_cam[valid] - 1))) < 1e-5, (name, level)
    # the frame matters: the same cells in the ego frame give another mask in most of the cells seen
    ego = parse_config(calibration_with(name, bev={"frame": "ego"}))
    assert int(np.count_nonzero(compute_sampling_grid(ego).valid.reshape(mask.shape) != mask)) > 10_000


def test_fastbev_presets_equal_fastbev_backproject_inplace(tmp_path: Path) -> None:
    """calibration + ``preset: fastbev-m0`` -> grid -> export-interop (the preset: overlap last,
    float32, Fast-BEV voxel order) gives Fast-BEV's own torch float32 LUT cell for cell
    (tests/upstream.py fastbev_lut_torch: rts2proj, _compute_projection, get_points at the voxel
    corners, backproject_inplace); ``fastbev-r50-ms`` holds one such LUT per stride (4, 8, 16)."""
    from ..interop.test_fastbev import FASTBEV_M0, fastbev_upstream_lut

    data = yaml.safe_load(CALIBRATION.read_text())
    by_name = {c["name"]: c for c in data["cameras"]}
    config = write_yaml(tmp_path / "fastbev.yaml", calibration_with("fastbev-m0"))
    assert runner.invoke(app, ["grid", str(config), "--out", str(tmp_path), "--quiet"]).exit_code == 0
    store = tmp_path / "fastbev-m0.zarr"
    result = runner.invoke(app, ["export-interop", str(store), "--quiet"])
    assert result.exit_code == 0, result.output
    interop = load(store)["interop"]
    assert np.array_equal(interop["fastbev_lut_xyz"], fastbev_upstream_lut(4, 70))
    assert np.array_equal(xyz_layout(interop["fastbev_lut"]), fastbev_upstream_lut(4, 70))
    multi = parse_config(calibration_with("fastbev-r50-ms"))
    assert [multi.level(i).feature_size for i in range(3)] == [(176, 64), (88, 32), (44, 16)]
    arrays, _ = fastbev_level_arrays(multi, FastBevOptions(**multi.interop_options("fastbev-lut")))
    assert np.array_equal(arrays["fastbev_lut_xyz"], interop["fastbev_lut_xyz"])
    for level, stride in ((1, 8), (2, 16)):
        cameras = [dict(by_name[n], resize=0.44, crop=[0, 70]) for n in multi.camera_names]
        theirs = upstream.fastbev_lut_torch(cameras, data["sensors"][0], stride, multi.level(level).feature_size, **FASTBEV_M0)
        assert np.array_equal(arrays[f"fastbev_lut_xyz_l{level}"], theirs), stride


def test_fastbev_r50_v4_preset_equals_fastbev_per_level_and_flipped(tmp_path: Path) -> None:
    """calibration + ``preset: fastbev-r50-v4`` -> grid -> export-interop gives, at each of the
    three levels, on that level's OWN voxel grid (``feature.levels[l].bev``: 200x200x6 @0.5 m,
    150x150x6 @2/3 m, 100x100x6 @1 m), Fast-BEV's own torch float32 LUT (tests/upstream.py
    fastbev_lut_torch: rts2proj, img_transform, _compute_projection, get_points, backproject_inplace;
    the grids of configs/fastbev/exp/paper/fastbev_r50_v4_ms_20cbgs_s256x704_v200x200x6_c256_d6_f4.py
    @d16b76f): 0 of 240,000 / 135,000 / 60,000 voxels differ. The second test-time pass
    (``image_aug: {flip: true}``, TestTimeAugImageMultiViewImage's flip) gives Fast-BEV's flipped run:
    0 differ at every level. Measured alternatives: the exact mirror ``W - 1 - u`` instead of
    Fast-BEV's ``W - u`` changes 57,415 / 16,284 / 3,564 voxels of the flipped pass; level 1's points
    made as the float32 of the cell centres instead of get_points' float32 arithmetic 1 (flipped pass);
    the float64 LUT (nearest pixel, ties half up) 1 / 1 / 1 (unflipped) and 0 / 1 / 0 (flipped); the
    flipped pass differs from the unflipped in 229,283 / 127,905 / 55,884."""
    from ..interop.test_fastbev import fastbev_v4_upstream_lut

    config = write_yaml(tmp_path / "fastbev.yaml", calibration_with("fastbev-r50-v4"))
    assert runner.invoke(app, ["grid", str(config), "--out", str(tmp_path), "--quiet"]).exit_code == 0
    result = runner.invoke(app, ["export-interop", str(tmp_path / "fastbev-r50-v4.zarr"), "--quiet"])
    assert result.exit_code == 0, result.output
    interop = load(tmp_path / "fastbev-r50-v4.zarr")["interop"]
    flipped = parse_config(calibration_with("fastbev-r50-v4", name="fastbev-r50-v4-flip", image_aug={"flip": True}))
    assert all(c.image_aug.flip and (c.image_aug.resize, c.image_aug.crop_top) == (0.44, 70.0) for c in flipped.cameras)
    options = FastBevOptions(**flipped.interop_options("fastbev-lut"))
    flipped_arrays, _ = fastbev_level_arrays(flipped, options)
    plain = parse_config(calibration_with("fastbev-r50-v4"))
    f64 = {flip: fastbev_level_arrays(rig, FastBevOptions("last", "float64", True))[0] for flip, rig in ((False, plain), (True, flipped))}
    measured: dict[str, list[int]] = {key: [] for key in ("mirror", "f64", "f64_flip", "flip_vs_plain")}
    for level, n_voxels in enumerate((240_000, 135_000, 60_000)):
        name = "fastbev_lut_xyz" + ("" if level == 0 else f"_l{level}")
        theirs, theirs_flipped = fastbev_v4_upstream_lut(level, False), fastbev_v4_upstream_lut(level, True)
        ours = np.asarray(interop[name])
        assert ours.shape == theirs.shape == flipped_arrays[name].shape and ours.size == n_voxels
        assert int(np.count_nonzero(ours != theirs)) == 0, level
        assert int(np.count_nonzero(flipped_arrays[name] != theirs_flipped)) == 0, level
        measured["mirror"].append(int(np.count_nonzero(fastbev_v4_upstream_lut(level, True, 703) != theirs_flipped)))
        measured["f64"].append(int(np.count_nonzero(f64[False][name] != theirs)))
        measured["f64_flip"].append(int(np.count_nonzero(f64[True][name] != theirs_flipped)))
        measured["flip_vs_plain"].append(int(np.count_nonzero(theirs_flipped != theirs)))
    assert measured == {"mirror": [57_415, 16_284, 3_564], "f64": [1, 1, 1], "f64_flip": [0, 1, 0], "flip_vs_plain": [229_283, 127_905, 55_884]}
    centres, _ = fastbev_level_arrays(flipped, FastBevOptions(**(flipped.interop_options("fastbev-lut") | {"points": "cell_centres"})))
    assert int(np.count_nonzero(centres["fastbev_lut_xyz_l1"] != fastbev_v4_upstream_lut(1, True))) == 1
    # bevcompile presets NAME shows every value with its upstream repository, file and commit
    shown = runner.invoke(app, ["presets", "fastbev-r50-v4"])
    assert shown.exit_code == 0, shown.output
    text = " ".join(shown.output.split())
    for source in PRESETS["fastbev-r50-v4"].sources:
        assert f"{source.repo} {source.path} @{source.commit[:12]}" in text, source
    assert "image_aug.flip: TestTimeAugImageMultiViewImage" in text and "fastbev_r50_v4_ms_20cbgs_s256x704_v200x200x6_c256_d6_f4.py @d16b76fc6571" in text


def petr_lidar2img(data: dict[str, Any], names: tuple[str, ...], resize: float, crop: tuple[int, int], ego_poses: dict[str, Any] | None = None) -> list[np.ndarray]:
    """PETR's ``lidar2img`` per camera from the calibration as nuScenes stores it: mmdet3d's
    sensor2lidar (one static pose), PETR's dataset ``viewpad @ lidar2cam_rt.T`` and its
    ``ResizeCropFlipImage`` intrinsics update (tests/upstream.py)."""
    by_name = {c["name"]: c for c in data["cameras"]}
    out = []
    for name in names:
        rot, tran = _sensor2lidar(data, name, ego_poses)
        viewpad = upstream.petr_resize_crop_intrinsics(by_name[name]["intrinsic"], resize, crop)
        out.append(viewpad @ upstream.mmdet3d_lidar2img(rot, tran, np.eye(3)))
    return out


def test_petr_preset_equals_petr_position_embeding(tmp_path: Path) -> None:
    """calibration + ``preset: petr-vov-p4-800x320`` -> grid -> export-interop (no options: the
    preset's petr-coords3d, float32) gives the tensor PETR's ``position_embeding`` hands
    ``inverse_sigmoid`` and its ``coords_mask``, bit for bit (tests/upstream.py
    petr_position_coords_torch; megvii-research/PETR petr_head.py @0677620, the 800x320 VoVNet
    config @587a957: test resize max(320/900, 800/1600) = 0.5, crop top int(450) - 320 = 130,
    stride 16 -> 50 x 20, 64 LID depths, position range +-61.2 x +-61.2 x +-10 m, lidar frame).
    Measured on nuScenes: 0 of 1,152,000 coordinates differ; no pixel is masked."""
    data = yaml.safe_load(CALIBRATION.read_text())
    config = write_yaml(tmp_path / "petr.yaml", calibration_with("petr-vov-p4-800x320"))
    assert runner.invoke(app, ["grid", str(config), "--out", str(tmp_path), "--quiet"]).exit_code == 0
    store = tmp_path / "petr-vov-p4-800x320.zarr"
    result = runner.invoke(app, ["export-interop", str(store), "--quiet"])
    assert result.exit_code == 0, result.output
    rig = load(store).rig
    assert all((c.image_aug.resize, c.image_aug.crop_top, c.image_aug.crop_left) == (0.5, 130.0, 0.0) for c in rig.cameras)
    assert rig.feature_size == (50, 20) and rig.bev.frame == "LIDAR_TOP"
    coords, mask = upstream.petr_position_coords_torch(petr_lidar2img(data, rig.camera_names, 0.5, (0, 130)), (320, 800), (20, 50))
    interop = load(store)["interop"]
    assert coords.shape == (6, 192, 20, 50)
    assert np.array_equal(interop["petr_coords3d"], coords)
    assert np.array_equal(interop["petr_coords_mask"], mask)
    assert runner.invoke(app, ["inspect", str(store), "--quiet"]).exit_code == 0


# -- per-sample ego motion (docs/models.md "Per-sample ego motion") ---------------------------------

EGO_POSES = ROOT / "tests" / "data" / "calib" / "nuscenes_ego_poses.yaml"


def _record_matrix(record: dict[str, Any]) -> np.ndarray:
    """A nuScenes record's ``rotation_wxyz`` + ``translation`` as a 4x4 (pyquaternion's matrix)."""
    matrix = np.eye(4)
    matrix[:3, :3] = upstream.quaternion_matrix(record["rotation_wxyz"])
    matrix[:3, 3] = record["translation"]
    return matrix


def with_sample_poses(data: dict[str, Any], preset: str) -> dict[str, Any]:
    """``data`` with every camera's pose replaced by the one docs/models.md tells a user to write
    for ``preset``: ``PRESETS[preset].sample_poses.sensor2ego`` of the camera's calibrated pose and
    the sample's ego_pose records (the key sensor's, rounding as the model does)."""
    poses = yaml.safe_load(EGO_POSES.read_text())["ego_poses"]
    ego2global = {name: _record_matrix(record) for name, record in poses.items()}
    out = copy.deepcopy(data)
    for camera in out["cameras"]:
        matrix = PRESETS[preset].sample_poses.sensor2ego(camera["name"], _record_matrix(camera), ego2global)
        del camera["rotation_wxyz"], camera["translation"]
        camera["sensor2ego"] = matrix.tolist()
    return out


def _f32_record(record: dict[str, Any]) -> torch.Tensor:
    """A record as BEVDet's / BEVDepth's loaders make it: ``torch.Tensor`` (float32) of the
    pyquaternion rotation matrix and of the translation, in a 4x4."""
    matrix = torch.zeros(4, 4)
    matrix[3, 3] = 1
    matrix[:3, :3] = torch.Tensor(upstream.quaternion_matrix(record["rotation_wxyz"]))
    matrix[:3, 3] = torch.Tensor(record["translation"])
    return matrix


def _moved_voxels(a: list[np.ndarray], b: list[np.ndarray]) -> int:
    """Frustum points whose (ranks_depth -> ranks_bev) differ between two BEVPoolv2 array sets
    (in or out of the grid included)."""
    x = dict(zip(a[1].tolist(), a[0].tolist(), strict=True))
    y = dict(zip(b[1].tolist(), b[0].tolist(), strict=True))
    return len({k for k in x.keys() | y.keys() if x.get(k) != y.get(k)})


def test_per_sample_ego_motion_bevdet_sensor2keyegos() -> None:
    """BEVDet dev3.0 folds the ego motion between exposures into each sample's poses:
    ``get_sensor_transforms`` makes float32 tensors of ``sensor2ego`` and ``ego2global``
    (mmdet3d/datasets/pipelines/loading.py), ``prepare_inputs`` composes ``sensor2keyegos =
    (inverse(keyego2global.double()) @ ego2globals.double() @ sensor2egos.double()).float()``,
    key = camera 0 = CAM_FRONT_LEFT (mmdet3d/models/detectors/bevdet.py; byounghun24/BEVDet
    @15e21d4), and ``get_bev_pool_input`` (its TensorRT export) bakes one sample's into the
    arrays. The docs' recipe for ``bevdet-r50`` (the records rounded to float32, then composed)
    gives BEVDet's float32 run with them, bit for bit. Measured on the bundled sample (its
    ego_pose records): the car moved up to 0.374 m between exposures (CAM_FRONT_LEFT to
    CAM_BACK_LEFT, 42.6 ms later); 40,420 of the 249,216 frustum points land in another voxel
    (or in / out of the grid) than with the static calibration, and composing the float64
    records instead (the recipe before the rounding) leaves 21 points in another voxel."""
    from ..interop.test_interop import NAMES, bevdet_voxel_pooling_prepare_v2

    poses = yaml.safe_load(EGO_POSES.read_text())["ego_poses"]
    data = yaml.safe_load(CALIBRATION.read_text())
    by_name = {c["name"]: c for c in data["cameras"]}
    key = _f32_record(poses[BEVDET_ORDER[0]]).double()
    sensor2keyegos = torch.stack([torch.inverse(key) @ _f32_record(poses[n]).double() @ _f32_record(by_name[n]).double() for n in BEVDET_ORDER]).float()
    moved = [float(torch.linalg.norm((torch.inverse(key) @ _f32_record(poses[n]).double())[:3, 3])) for n in BEVDET_ORDER]
    assert max(moved) == pytest.approx(0.374, abs=5e-4) and int(np.argmax(moved)) == BEVDET_ORDER.index("CAM_BACK_LEFT")
    assert PRESETS["bevdet-r50"].sample_poses.key == BEVDET_ORDER[0]
    rig = parse_config(with_sample_poses(calibration_with("bevdet-r50"), "bevdet-r50"))
    theirs = bevdet_voxel_pooling_prepare_v2(rig, dtype=torch.float32, sensor2ego=sensor2keyegos.numpy())
    ours = build_bevpoolv2(rig, BevPoolOptions(**rig.interop_options("bevpoolv2"))).arrays()
    for name, got, want in zip(NAMES, ours.values(), theirs, strict=True):
        assert np.array_equal(got, want), name
    assert ours["ranks_bev"].size == 179_832
    static = bevdet_voxel_pooling_prepare_v2(parse_config(calibration_with("bevdet-r50")), dtype=torch.float32)
    assert _moved_voxels(static, theirs) == 40_420
    # the records composed in float64 (no float32 rounding first): 21 points in another voxel
    float64_poses = dataclasses.replace(PRESETS["bevdet-r50"].sample_poses, float32_records=False)
    data64 = calibration_with("bevdet-r50")
    ego2global = {n: _record_matrix(r) for n, r in poses.items()}
    for camera in data64["cameras"]:
        camera["sensor2ego"] = float64_poses.sensor2ego(camera["name"], _record_matrix(camera), ego2global).tolist()
        del camera["rotation_wxyz"], camera["translation"]
    rig64 = parse_config(data64)
    assert _moved_voxels(list(build_bevpoolv2(rig64, BevPoolOptions(**rig64.interop_options("bevpoolv2"))).arrays().values()), theirs) == 21


def test_per_sample_ego_motion_bevdepth_keys_every_camera_to_its_own_ego_pose() -> None:
    """BEVDepth keys each camera to the ego pose of its OWN exposure (``get_image``:
    ``keyego2global`` from ``key_info[cam]['ego_pose']``, ``sweepsensor2keyego = global2keyego @
    sweepego2global @ sweepsensor2sweepego`` in float32 tensors; Megvii-BaseDetection/BEVDepth
    bevdepth/datasets/nusc_det_dataset.py @61d4e0c): for the key frame the static calibration up to
    the float32 rounding of ``inv(E) @ E`` with E's ~1,700 m translation (up to 9.2e-5 m here).
    Restated in torch float32 from the bundled sample's ego_pose records and fed to BEVDepth's
    float32 ``get_geometry``; the docs' recipe for ``bevdepth-r50`` (the same torch composition,
    ``sample_poses.compose = torch-float32``) gives every one of the 473,088 points the same voxel.
    Measured: the static calibration's float64 poses put 12 points elsewhere; keying every camera
    to CAM_FRONT_LEFT (BEVDet's rule, which the docs said before) 78,921."""
    poses = yaml.safe_load(EGO_POSES.read_text())["ego_poses"]
    data = yaml.safe_load(CALIBRATION.read_text())
    by_name = {c["name"]: c for c in data["cameras"]}
    rig = parse_config(with_sample_poses(calibration_with("bevdepth-r50"), "bevdepth-r50"))
    static = parse_config(calibration_with("bevdepth-r50"))
    sensor2keyego = []
    for name in BEVDET_ORDER:
        ego = _f32_record(poses[name])  # key_info[cam] and cam_info[cam] are the same record in the key frame
        sensor2keyego.append((ego.inverse() @ ego @ _f32_record(by_name[name])).numpy())
    theirs = np.concatenate([v.reshape(-1) for v in bevdepth_geometry(static, torch.float32, sensor2ego=sensor2keyego)])
    assert theirs.size == 473_088
    arrays = build_bevpoolv2(rig, BevPoolOptions(**rig.interop_options("bevpoolv2")))
    ours = np.full(theirs.size, -1)
    ours[arrays.ranks_depth] = arrays.ranks_bev
    assert int(np.count_nonzero(ours != theirs)) == 0
    # BEVDet's key (CAM_FRONT_LEFT for every camera), in BEVDepth's float32 composition
    key = _f32_record(poses[BEVDET_ORDER[0]])
    keyed = [(key.inverse() @ _f32_record(poses[n]) @ _f32_record(by_name[n])).numpy() for n in BEVDET_ORDER]
    other = np.concatenate([v.reshape(-1) for v in bevdepth_geometry(static, torch.float32, sensor2ego=keyed)])
    assert int(np.count_nonzero(other != theirs)) == 78_921
    # the static calibration itself (float64 poses, not torch's float32 inv(E) @ E @ S): 12 points elsewhere
    plain = build_bevpoolv2(static, BevPoolOptions(**static.interop_options("bevpoolv2")))
    static_voxels = np.full(theirs.size, -1)
    static_voxels[plain.ranks_depth] = plain.ranks_bev
    assert int(np.count_nonzero(static_voxels != theirs)) == 12


def test_per_sample_ego_motion_mmdet3d_sensor2lidar_fastbev() -> None:
    """mmdet3d's info files (Fast-BEV, BEVFormer, PETR) fold it in through ``obtain_sensor2top``
    (the camera sample's and the lidar sample's ego poses; tests/upstream.py). Cameras written
    with ``sensor2ego = inv(ego2global[LIDAR_TOP]) @ ego2global[camera] @ camera2ego`` and
    ``bev.frame: LIDAR_TOP``: the pose is that ``sensor2lidar`` to 4 ulps of the global translation
    (~1,700 m: 9.1e-13), and ``preset: fastbev-m0`` gives Fast-BEV's own float32 LUT of that sample cell
    for cell. Measured: 69,930 of its 160,000 cells differ from the static calibration's LUT."""
    from bevcompile.rig.geometry import bev_from_cam_matrix

    from ..interop.test_fastbev import FASTBEV_M0, fastbev_upstream_lut

    poses = yaml.safe_load(EGO_POSES.read_text())["ego_poses"]
    data = yaml.safe_load(CALIBRATION.read_text())
    rig = parse_config(with_sample_poses(calibration_with("fastbev-m0"), "fastbev-m0"))

    def ego2global(name: str) -> tuple[np.ndarray, np.ndarray]:
        matrix = _record_matrix(poses[name])
        return matrix[:3, :3], matrix[:3, 3]

    lidar = dict(data["sensors"][0], ego2global=ego2global("LIDAR_TOP"))
    cameras = [dict(c, resize=0.44, crop=[0, 70], ego2global=ego2global(c["name"])) for c in data["cameras"]]
    for i, camera in enumerate(rig.cameras):
        rotation, translation = upstream.mmdet3d_sensor2lidar(data["cameras"][i], lidar, *lidar["ego2global"], *cameras[i]["ego2global"])
        # 4 float64 ulps of the ~1,700 m global translation both sides subtract (measured 2.1e-13: the BLAS's rounding)
        atol = 4 * np.spacing(max(np.abs(lidar["ego2global"][1]).max(), np.abs(cameras[i]["ego2global"][1]).max()))
        np.testing.assert_allclose(bev_from_cam_matrix(rig, camera)[:3], np.column_stack([rotation, translation]), rtol=0, atol=atol)
    theirs = upstream.fastbev_lut_torch(cameras, lidar, 4, rig.feature_size, **FASTBEV_M0)
    ours = build_fastbev_lut(rig, FastBevOptions(**rig.interop_options("fastbev-lut"))).lut
    assert np.array_equal(xyz_layout(ours), theirs)
    assert int(np.count_nonzero(theirs != fastbev_upstream_lut(4, 70))) == 69_930


def test_per_sample_ego_motion_bevformer_and_petr() -> None:
    """The docs' recipe for the other mmdet3d presets (key LIDAR_TOP, float64): BEVFormer-tiny's
    ``bev_mask`` of the bundled sample (its lidar2img through mmdet3d's per-sample sensor2lidar)
    equals ``grid/valid`` in all 60,000 entries (sampling points within 1.5e-6); PETR's
    ``position_embeding`` coords3d and mask of the sample equal the store's bit for bit
    (1,152,000 coordinates). Measured: the sample's mask differs from the static one in 119 of the 60,000
    entries."""
    from bevcompile.interop.petr import PetrOptions, build_petr_coords

    poses = yaml.safe_load(EGO_POSES.read_text())["ego_poses"]
    data = yaml.safe_load(CALIBRATION.read_text())
    rig = parse_config(with_sample_poses(calibration_with("bevformer-tiny"), "bevformer-tiny"))
    ref_cam, mask = bevformer_point_sampling(rig, (rig.bev.ny, rig.bev.nx), poses)
    grid = compute_sampling_grid(rig)
    valid = grid.valid.reshape(mask.shape)
    assert int(np.count_nonzero(valid != mask)) == 0
    w_f, h_f = rig.feature_size
    norm = np.stack([(2 * grid.coords_feature_px[..., 0] + 1) / w_f - 1, (2 * grid.coords_feature_px[..., 1] + 1) / h_f - 1], -1).reshape(*mask.shape, 2)
    assert np.max(np.abs(norm[valid] - (2 * ref_cam[valid] - 1))) < 1.5e-6
    assert int(np.count_nonzero(bevformer_point_sampling(rig, (rig.bev.ny, rig.bev.nx))[1] != mask)) == 119
    petr = parse_config(with_sample_poses(calibration_with("petr-vov-p4-800x320"), "petr-vov-p4-800x320"))
    coords, coords_mask = upstream.petr_position_coords_torch(petr_lidar2img(data, petr.camera_names, 0.5, (0, 130), poses), (320, 800), (20, 50))
    ours = build_petr_coords(petr, PetrOptions(**petr.interop_options("petr-coords3d")))
    assert np.array_equal(ours.coords3d, coords) and np.array_equal(ours.coords_mask, coords_mask)
