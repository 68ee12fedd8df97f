"""Interop arrays: BEVDet BEVPoolv2 inputs and the Fast-BEV LUT.

BEVPoolv2 is proven three ways: bit equality with a transcription of BEVDet's own torch code
(``create_frustum`` / ``get_lidar_coor`` / ``voxel_pooling_prepare_v2`` of
HuangJunJie2017/BEVDet, written here from the algorithm), sum pooling equal to the
``matrix/`` frustum product (``--topk 0 --splat nearest --normalize sum``, same rounding),
and sum pooling equal to a scatter-add reference. The Fast-BEV LUT is checked against a
per-cell loop and against ``torch.nn.functional.grid_sample(mode="nearest")``.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st

from bevcompile.errors import ConfigError, UsageError
from bevcompile.grid.build import run_grid
from bevcompile.grid.ipm import compute_sampling_grid
from bevcompile.interop.bevpoolv2 import (
    BevPoolOptions,
    bev_pool_v2,
    build_bevpoolv2,
    feat_rank_from_depth_rank,
    frustum_shape,
    intervals_of,
    reference_frustum_pool,
    voxel_coords,
    voxel_grid,
)
from bevcompile.interop.checks import check_interop, rebuild_interop, verify_interop
from bevcompile.interop.export import interop_command_targets, npy_names, run_export_interop
from bevcompile.interop.fastbev import FastBevOptions, build_fastbev_lut, choose_camera, fastbev_gather
from bevcompile.matrix.build import MatrixOptions, build_matrix
from bevcompile.rig.config import RigConfig, parse_config
from bevcompile.rig.geometry import bev_from_cam_matrix
from bevcompile.store.inspection import json_attrs
from bevcompile.store.loader import load
from bevcompile.store.plugins import REBUILT_ATTRS, Check, CheckContext

from .. import rigs

# --------------------------------------------------------------------------------------
# BEVDet transcription (independent reference)
# --------------------------------------------------------------------------------------


def bevdet_voxel_pooling_prepare_v2(
    rig: RigConfig, dtype: torch.dtype = torch.float64, z_bins: int | None = None, batch: int = 1, sensor2ego: np.ndarray | None = None,
    stable: bool = True,
) -> list[np.ndarray]:
    """BEVDet for batch ``batch`` (the same rig in every item), transcribed from ``create_frustum`` /
    ``get_lidar_coor`` / ``voxel_pooling_prepare_v2`` of mmdet3d/models/necks/view_transformer.py
    (dev3.0; read in the fork byounghun24/BEVDet, commit 15e21d410747b8a53319e2df7b12da4121bf5d09):
    frustum from ``torch.linspace`` in input pixels, undo ``post_rots``/``post_trans``,
    ``sensor2ego[:3, :3] @ inv(cam2imgs)``, ``+ sensor2ego[:3, 3]``, then
    ``((coor - lower) / interval).long()``, keep, ranks, (stable) argsort, intervals. ``sensor2ego``
    is the camera's pose in the rig's BEV frame (``bev_from_cam``); with ``dtype=torch.float32``
    every tensor is float32, as BEVDet runs (its inputs are ``torch.Tensor``s). ``sensor2ego``
    ``(n_cam, 4, 4)``, when given, replaces the rig's poses (e.g. BEVDet's per-sample
    ``sensor2keyegos``, computed from the raw records). ``stable=False``: BEVDet's own
    ``ranks_bev.argsort()`` (the default sorts stably, bevcompile's order)."""
    w_in, h_in = rig.input_size
    s = rig.feature.stride
    H, W = h_in // s, w_in // s
    ds = torch.arange(rig.depth.start, rig.depth.stop, rig.depth.step, dtype=dtype).view(-1, 1, 1).expand(-1, H, W)
    D = ds.shape[0]
    xs = torch.linspace(0, w_in - 1, W, dtype=dtype).view(1, 1, W).expand(D, H, W)
    ys = torch.linspace(0, h_in - 1, H, dtype=dtype).view(1, H, 1).expand(D, H, W)
    frustum = torch.stack((xs, ys, ds), -1)
    B, N = batch, rig.n_cam
    poses = np.stack([bev_from_cam_matrix(rig, c) for c in rig.cameras]) if sensor2ego is None else np.asarray(sensor2ego)
    sensor2ego = torch.tensor(poses, dtype=dtype).view(1, N, 4, 4).expand(B, N, 4, 4)
    intrins = torch.tensor([c.intrinsic for c in rig.cameras], dtype=dtype).view(1, N, 3, 3).expand(B, N, 3, 3)
    post_rots = torch.zeros(B, N, 3, 3, dtype=dtype)
    post_trans = torch.zeros(B, N, 3, dtype=dtype)
    for i, cam in enumerate(rig.cameras):
        a = cam.image_aug
        post_rots[:, i] = torch.tensor([[a.resize, 0, 0], [0, a.resize, 0], [0, 0, 1]], dtype=dtype)
        post_trans[:, i] = torch.tensor([-a.crop_left, -a.crop_top, 0], dtype=dtype)
    points = frustum - post_trans.view(B, N, 1, 1, 1, 3)
    points = torch.inverse(post_rots).view(B, N, 1, 1, 1, 3, 3).matmul(points.unsqueeze(-1))
    points = torch.cat((points[..., :2, :] * points[..., 2:3, :], points[..., 2:3, :]), 5)
    combine = sensor2ego[:, :, :3, :3].matmul(torch.inverse(intrins))
    points = combine.view(B, N, 1, 1, 1, 3, 3).matmul(points).squeeze(-1)
    coor = points + sensor2ego[:, :, :3, 3].view(B, N, 1, 1, 1, 3)
    bev = rig.bev
    nz = bev.z.n if z_bins is None else z_bins
    z_step = bev.z.step if z_bins is None else (bev.z.max - bev.z.min) / z_bins
    lower = torch.tensor([bev.x.min, bev.y.min, bev.z.min], dtype=dtype)
    interval = torch.tensor([bev.x.step, bev.y.step, z_step], dtype=dtype)
    grid_size = torch.tensor([bev.x.n, bev.y.n, nz])
    num_points = B * N * D * H * W
    ranks_depth = torch.arange(0, num_points, dtype=torch.int)
    ranks_feat = torch.arange(0, num_points // D, dtype=torch.int).reshape(B, N, 1, H, W).expand(B, N, D, H, W).flatten()
    coor = ((coor - lower) / interval).long().view(num_points, 3)
    batch_idx = torch.arange(0, B).reshape(B, 1).expand(B, num_points // B).reshape(num_points, 1).to(coor)
    coor = torch.cat((coor, batch_idx), 1)
    kept = (
        (coor[:, 0] >= 0) & (coor[:, 0] < grid_size[0]) & (coor[:, 1] >= 0) & (coor[:, 1] < grid_size[1])
        & (coor[:, 2] >= 0) & (coor[:, 2] < grid_size[2])
    )
    coor, ranks_depth, ranks_feat = coor[kept], ranks_depth[kept], ranks_feat[kept]
    ranks_bev = coor[:, 3] * (grid_size[2] * grid_size[1] * grid_size[0])
    ranks_bev += coor[:, 2] * (grid_size[1] * grid_size[0])
    ranks_bev += coor[:, 1] * grid_size[0] + coor[:, 0]
    order = ranks_bev.argsort(stable=True) if stable else ranks_bev.argsort()  # BEVDet's own: .argsort(), not stable
    ranks_bev, ranks_depth, ranks_feat = ranks_bev[order], ranks_depth[order], ranks_feat[order]
    kept = torch.ones(ranks_bev.shape[0], dtype=torch.bool)
    kept[1:] = ranks_bev[1:] != ranks_bev[:-1]
    interval_starts = torch.where(kept)[0].int()
    interval_lengths = torch.zeros_like(interval_starts)
    interval_lengths[:-1] = interval_starts[1:] - interval_starts[:-1]
    interval_lengths[-1] = ranks_bev.shape[0] - interval_starts[-1]
    return [t.int().numpy() for t in (ranks_bev, ranks_depth, ranks_feat, interval_starts, interval_lengths)]


def bevdet_bev_pool_v2(depth: np.ndarray, feat_nhwc: np.ndarray, arrays: list[np.ndarray], grid_size: tuple[int, int, int]) -> np.ndarray:
    """BEVDet's bev_pool_v2 kernel semantics, one loop per interval (float64)."""
    ranks_bev, ranks_depth, ranks_feat, starts, lengths = arrays
    x, y, z = grid_size
    batch = feat_nhwc.shape[0] if feat_nhwc.ndim == 5 else 1
    out = np.zeros((batch * z * y * x, feat_nhwc.shape[-1]))
    d_flat = depth.reshape(-1).astype(np.float64)
    f_rows = feat_nhwc.reshape(-1, feat_nhwc.shape[-1]).astype(np.float64)
    for s, n in zip(starts, lengths, strict=True):
        acc = np.zeros(feat_nhwc.shape[-1])
        for i in range(s, s + n):
            acc += d_flat[ranks_depth[i]] * f_rows[ranks_feat[i]]
        out[ranks_bev[s]] = acc
    return out.reshape(batch, z, y, x, -1) if feat_nhwc.ndim == 5 else out.reshape(z, y, x, -1)


NAMES = ("ranks_bev", "ranks_depth", "ranks_feat", "interval_starts", "interval_lengths")


def test_bevpoolv2_equals_bevdet_transcription_on_nuscenes(nuscenes: RigConfig) -> None:
    """BEVDet-R50 settings (704x256, stride 16, depth [1, 60, 1], +-51.2 m at 0.8 m, z [-5, 3]
    one bin): bit-identical arrays; 249,216 frustum points, 179,806 kept, 11,708 intervals."""
    ours = build_bevpoolv2(nuscenes)  # defaults: linspace frustum, trunc (BEVDet)
    ref = bevdet_voxel_pooling_prepare_v2(nuscenes)
    for name, got, want in zip(NAMES, ours.arrays().values(), ref, strict=True):
        assert got.dtype == np.int32, name
        assert np.array_equal(got, want), name
    assert ours.n_points == 6 * 59 * 16 * 44 == 249_216
    assert (ours.n_kept, ours.n_intervals) == (179_806, 11_708)


def test_bevpoolv2_float32_equals_bevdet_float32_run_bit_for_bit(nuscenes: RigConfig) -> None:
    """BEVDet runs in float32. ``precision float32`` evaluates its op sequence in float32
    (bevdet_points_float32) and equals the float32 torch transcription bit for bit on nuScenes
    (CPU). The float64 default differs from that run in exactly 4 of 249,216 points (within
    float32 rounding of a voxel boundary): 204 / 4,718 / 4,716 / 204 / 8 entries of ranks_bev /
    ranks_depth / ranks_feat / interval_starts / interval_lengths differ."""
    ref32 = bevdet_voxel_pooling_prepare_v2(nuscenes, dtype=torch.float32)
    ours32 = build_bevpoolv2(nuscenes, BevPoolOptions(precision="float32"))
    for name, got, want in zip(NAMES, ours32.arrays().values(), ref32, strict=True):
        assert np.array_equal(got, want), name
    ours64 = build_bevpoolv2(nuscenes)
    a = dict(zip(ours64.ranks_depth.tolist(), ours64.ranks_bev.tolist(), strict=True))
    b = dict(zip(ref32[1].tolist(), ref32[0].tolist(), strict=True))
    assert len({k for k in a.keys() | b.keys() if a.get(k) != b.get(k)}) == 4
    differing = [int(np.count_nonzero(getattr(ours64, n) != w)) for n, w in zip(NAMES, ref32, strict=True)]
    assert differing == [204, 4718, 4716, 204, 8]


@pytest.mark.parametrize("batch", [2, 3])
def test_bevpoolv2_float32_batch_equals_bevdet_float32_transcription(batch: int) -> None:
    """The float32 build laid out for ``batch`` items is BEVDet's own float32 run for ``B`` items,
    bit for bit (the batch copies are the float64 build's)."""
    rig = rigs.small_rig(pixel_mapping="linspace", bev_half_m=20.0)
    ours = build_bevpoolv2(rig, BevPoolOptions(batch=batch, precision="float32"))
    ref = bevdet_voxel_pooling_prepare_v2(rig, dtype=torch.float32, batch=batch)
    one = build_bevpoolv2(rig, BevPoolOptions(precision="float32"))
    assert (ours.n_kept, ours.n_intervals) == (batch * one.n_kept, batch * one.n_intervals) and one.n_kept > 100
    for name, got, want in zip(NAMES, ours.arrays().values(), ref, strict=True):
        assert got.dtype == np.int32, name
        assert np.array_equal(got, want), name


@settings(max_examples=40, deadline=None)
@given(st.floats(-50.0, 50.0, width=32), st.floats(1.0, 4000.0, width=32), st.integers(2, 400))
@example(-2.664597055882926e-40, 1.0, 14)  # float64 sum exactly halfway between two float32: the exact sum decides
def test_torch_linspace_float32_restatement_equals_torch(start: float, span: float, steps: int) -> None:
    from bevcompile.matrix.lift32 import torch_linspace_float32

    want = torch.linspace(start, start + span, steps, dtype=torch.float32).numpy()
    assert np.array_equal(torch_linspace_float32(start, start + span, steps), want)


def test_bevpoolv2_float32_needs_the_linspace_frustum_and_pinhole_cameras(small_distorted_multi: RigConfig) -> None:
    with pytest.raises(UsageError, match=r"--precision float32 restates BEVDet's own frustum \(linspace\); --frustum-mapping stride"):
        BevPoolOptions(frustum_mapping="stride", precision="float32").validate()
    with pytest.raises(UsageError, match=r"restates BEVDet's pinhole lift; camera FRONT has a opencv lens"):
        build_bevpoolv2(small_distorted_multi, BevPoolOptions(precision="float32"))
    assert BevPoolOptions().to_dict() == {"frustum_mapping": "linspace", "rounding": "trunc", "z_bins": None, "batch": 1}
    assert BevPoolOptions.from_dict(BevPoolOptions(precision="float32").to_dict()).precision == "float32"


def test_bevpoolv2_and_lut_in_the_lidar_frame_equal_hand_made_cam_to_lidar_poses() -> None:
    """``bev.frame: LIDAR_TOP`` on nuScenes: the BEVPoolv2 arrays and the Fast-BEV LUT are those
    of the rig whose cameras were handed their cam -> lidar matrices (numpy product) in the ego
    frame, and BEVDet's transcription fed those matrices as ``sensor2ego`` agrees too."""
    data = rigs.nuscenes_data()
    framed = parse_config(rigs.in_lidar_frame(data))
    handmade = parse_config(rigs.lidar_poses_as_ego(data))
    a, b = build_bevpoolv2(framed), build_bevpoolv2(handmade)
    assert a.n_kept > 100_000
    for name in NAMES:
        assert np.array_equal(getattr(a, name), getattr(b, name)), name
    ref = bevdet_voxel_pooling_prepare_v2(handmade)
    for name, want in zip(NAMES, ref, strict=True):
        assert np.array_equal(getattr(a, name), want), name
    for overlap in ("first", "last"):
        lut_a = build_fastbev_lut(framed, FastBevOptions(overlap)).lut
        assert np.array_equal(lut_a, build_fastbev_lut(handmade, FastBevOptions(overlap)).lut)
    assert not np.array_equal(build_bevpoolv2(parse_config(data)).ranks_bev, a.ranks_bev)


@pytest.mark.parametrize("z_bins", [None, 4])
@pytest.mark.parametrize("mapping", ["stride", "linspace"])
def test_bevpoolv2_equals_bevdet_transcription_on_small_rigs(mapping: str, z_bins: int | None) -> None:
    rig = rigs.small_rig(pixel_mapping=mapping, bev_half_m=20.0)
    ours = build_bevpoolv2(rig, BevPoolOptions("linspace", "trunc", z_bins))
    ref = bevdet_voxel_pooling_prepare_v2(rig, z_bins=z_bins)
    assert ours.n_kept > 100
    for name, got, want in zip(NAMES, ours.arrays().values(), ref, strict=True):
        assert np.array_equal(got, want), name


@pytest.mark.parametrize("batch", [2, 3])
def test_bevpoolv2_batch_equals_bevdet_transcription(batch: int) -> None:
    """A TensorRT engine is built for one batch size: with ``batch=B`` the arrays are BEVDet's
    own for ``B`` items (batch index as the most significant digit of every rank)."""
    rig = rigs.small_rig(pixel_mapping="linspace", bev_half_m=20.0)
    ours = build_bevpoolv2(rig, BevPoolOptions(batch=batch))
    ref = bevdet_voxel_pooling_prepare_v2(rig, batch=batch)
    one = build_bevpoolv2(rig)
    assert ours.batch == batch and ours.n_points == batch * one.n_points
    assert (ours.n_kept, ours.n_intervals) == (batch * one.n_kept, batch * one.n_intervals)
    for name, got, want in zip(NAMES, ours.arrays().values(), ref, strict=True):
        assert got.dtype == np.int32, name
        assert np.array_equal(got, want), name


@pytest.mark.parametrize("options", [BevPoolOptions(), BevPoolOptions("stride", "floor", 3, batch=2)], ids=["bevdet", "floor-z3-batch2"])
def test_bevpoolv2_is_the_same_for_every_jobs_count_and_block_size(monkeypatch: pytest.MonkeyPatch, options: BevPoolOptions) -> None:
    """The counting sort places each block's points by the voxel counts of the blocks before it:
    many tiny blocks computed by 1 to 4 threads give BEVDet's arrays bit for bit (tie-heavy ring:
    a pixel column's points share their voxel at every depth)."""
    import bevcompile.matrix.entries as entries_mod

    rig = rigs.ring_rig()
    ref = bevdet_voxel_pooling_prepare_v2(rig, z_bins=options.z_bins, batch=options.batch) if options.frustum_mapping == "linspace" else None
    want = build_bevpoolv2(rig, options, jobs=1).arrays()
    monkeypatch.setattr(entries_mod, "CHUNK_POINTS", 700)
    monkeypatch.setattr(entries_mod, "PIECE_POINTS", 150)  # a depth bin in ray ranges
    for jobs in (1, 2, 4):
        got = build_bevpoolv2(rig, options, jobs=jobs).arrays()
        for name in NAMES:
            assert got[name].dtype == np.int32 and np.array_equal(got[name], want[name]), (name, jobs)
    if ref is not None:
        for name, array in zip(NAMES, ref, strict=True):
            assert np.array_equal(want[name], array), name
    assert want["ranks_bev"].size > 1000 and int(want["interval_lengths"].max()) > 16


def test_bevpoolv2_batch_pools_each_item_independently(small_distorted_multi: RigConfig) -> None:
    rig = small_distorted_multi
    arrays = build_bevpoolv2(rig, BevPoolOptions(batch=2))
    (depth0, feats0), (depth1, feats1) = _random_inputs(rig, 3, seed=5), _random_inputs(rig, 3, seed=6)
    depth, feats = np.stack([depth0, depth1]), np.stack([feats0, feats1])
    got = bev_pool_v2(depth, feats, arrays, arrays.grid.size)  # (B, C, Z, Y, X)
    assert got.shape == (2, 3, *arrays.grid.size[::-1])
    for b, (d, f) in enumerate([(depth0, feats0), (depth1, feats1)]):
        want = reference_frustum_pool(rig, BevPoolOptions(), d, f)
        np.testing.assert_allclose(got[b], want, rtol=0, atol=1e-12)
    # the BEVDet kernel loop on channels-last rows (B, n_cam, H_f, W_f, C) gives the same
    kernel = bevdet_bev_pool_v2(depth, np.moveaxis(feats, 2, -1), list(arrays.arrays().values()), arrays.grid.size)
    np.testing.assert_allclose(np.moveaxis(kernel, -1, 1), got, rtol=0, atol=1e-12)


def _matrix_product(rig: RigConfig, rounding: str, depth: np.ndarray, feats: np.ndarray) -> np.ndarray:
    m = build_matrix(rig, MatrixOptions(mode="frustum", topk=0, splat="nearest", normalize="sum", rounding=rounding, align=1))
    w = sp.csr_matrix((m.coo_val.astype(np.float64), (m.coo_row, m.coo_col)), shape=(m.n_rows, m.n_cols))
    x = (depth[:, :, None].astype(np.float64) * feats[:, None].astype(np.float64))  # (cam, D, C, H, W)
    x = np.moveaxis(x, 2, -1).reshape(-1, feats.shape[1])
    return np.asarray(w @ x).T.reshape(feats.shape[1], rig.bev.ny, rig.bev.nx)


def _random_inputs(rig: RigConfig, channels: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    w_f, h_f = rig.feature_size
    feats = rng.random((rig.n_cam, channels, h_f, w_f), dtype=np.float32)
    logits = rng.standard_normal((rig.n_cam, rig.depth.n_bins, h_f, w_f))
    e = np.exp(logits - logits.max(axis=1, keepdims=True))
    return (e / e.sum(axis=1, keepdims=True)).astype(np.float32), feats


@pytest.mark.parametrize("rounding", ["floor", "trunc"])
@pytest.mark.parametrize("which", ["small_distorted_multi", "nuscenes"])
def test_bevpoolv2_sum_pooling_equals_matrix_frustum_product(request: pytest.FixtureRequest, which: str, rounding: str) -> None:
    """Sum pooling with the arrays == W @ (depth x feat) of matrix/ (--topk 0 --splat nearest
    --normalize sum, same rounding, the rig's pixel mapping) == a scatter-add reference."""
    rig = request.getfixturevalue(which)
    options = BevPoolOptions("rig", rounding)
    arrays = build_bevpoolv2(rig, options)
    depth, feats = _random_inputs(rig, channels=4, seed=11)
    pooled = bev_pool_v2(depth, feats, arrays, arrays.grid.size)  # (C, Z, Y, X)
    matrix = _matrix_product(rig, rounding, depth, feats)
    assert np.abs(matrix).max() > 0.1
    assert np.max(np.abs(pooled.sum(axis=1) - matrix)) < 1e-9
    scatter = reference_frustum_pool(rig, options, depth, feats)
    assert np.max(np.abs(pooled - scatter)) < 1e-9


def test_bevpoolv2_pooling_equals_bevdet_kernel_loop(small_distorted_multi: RigConfig) -> None:
    arrays = build_bevpoolv2(small_distorted_multi, BevPoolOptions("stride", "floor", 2))
    depth, feats = _random_inputs(small_distorted_multi, channels=3, seed=2)
    ours = bev_pool_v2(depth, feats, arrays, arrays.grid.size)  # (C, Z, Y, X)
    kernel = bevdet_bev_pool_v2(depth, np.moveaxis(feats, 1, -1), list(arrays.arrays().values()), arrays.grid.size)
    assert np.max(np.abs(np.moveaxis(ours, 0, -1) - kernel)) < 1e-12


def test_bevpoolv2_is_stable_and_deterministic(small_distorted_multi: RigConfig) -> None:
    a = build_bevpoolv2(small_distorted_multi)
    b = build_bevpoolv2(small_distorted_multi)
    for name in NAMES:
        assert np.array_equal(getattr(a, name), getattr(b, name))
    same = a.ranks_bev[1:] == a.ranks_bev[:-1]
    assert same.any()
    assert np.all(a.ranks_depth[1:][same] > a.ranks_depth[:-1][same])  # stable: depth rank ascending in a voxel
    assert np.all(np.diff(a.ranks_bev) >= 0)


def test_convention_bevpoolv2_rank_formulas(small: RigConfig) -> None:
    """ranks_depth = ((cam*D + d)*H + v)*W + u; ranks_feat = (cam*H + v)*W + u; ranks_bev =
    z*(Y*X) + y*X + x of the point's voxel (checked by recomputing a few points)."""
    from bevcompile.interop.bevpoolv2 import frustum_points_bev, frustum_rig

    arrays = build_bevpoolv2(small, BevPoolOptions("linspace", "floor", 2))
    n_cam, n_d, h_f, w_f = arrays.depth_shape
    x_size, y_size, _ = arrays.grid.size
    for i in np.linspace(0, arrays.n_kept - 1, 25).astype(int):
        cam, d, v, u = np.unravel_index(arrays.ranks_depth[i], (n_cam, n_d, h_f, w_f))
        assert arrays.ranks_feat[i] == (cam * h_f + v) * w_f + u
        points, _ = frustum_points_bev(frustum_rig(small, "linspace"), int(cam))
        p = points[d, v, u]
        ix = int(np.floor((p[0] - small.bev.x.min) / small.bev.x.step))
        iy = int(np.floor((p[1] - small.bev.y.min) / small.bev.y.step))
        iz = int(np.floor((p[2] - small.bev.z.min) / ((small.bev.z.max - small.bev.z.min) / 2)))
        assert arrays.ranks_bev[i] == (iz * y_size + iy) * x_size + ix


def test_convention_trunc_keeps_points_up_to_one_voxel_below_the_lower_bound(small: RigConfig) -> None:
    """BEVDet's .long() truncates toward zero: -0.5 voxel -> voxel 0 (kept); floor drops it."""
    grid = voxel_grid(small, None)
    x_min, _y_min, z_min = grid.lower
    points = np.array([[x_min - 0.5 * grid.step[0], 0.1, 0.0], [x_min - 1.5 * grid.step[0], 0.1, 0.0], [x_min + 0.2, 0.1, z_min - 0.1]])
    _, kept_trunc = voxel_coords(points, grid, "trunc")
    _, kept_floor = voxel_coords(points, grid, "floor")
    assert kept_trunc.tolist() == [True, False, True]
    assert kept_floor.tolist() == [False, False, False]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 50), min_size=0, max_size=200))
def test_intervals_round_trip(values: list[int]) -> None:
    ranks = np.sort(np.asarray(values, dtype=np.int32))
    starts, lengths = intervals_of(ranks)
    assert starts.dtype == lengths.dtype == np.int32
    assert np.array_equal(np.repeat(ranks[starts], lengths), ranks)
    assert len(set(ranks[starts].tolist())) == starts.size == len(set(values))


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.integers(1, 9), st.integers(1, 7), st.integers(1, 11), st.data())
def test_feat_rank_decodes_depth_rank(n_cam: int, n_d: int, h: int, w: int, data: st.DataObject) -> None:
    flat = data.draw(st.lists(st.integers(0, n_cam * n_d * h * w - 1), max_size=50))
    cam, _d, v, u = np.unravel_index(np.asarray(flat, dtype=np.int64), (n_cam, n_d, h, w))
    assert np.array_equal(feat_rank_from_depth_rank(np.asarray(flat), (n_cam, n_d, h, w)), (cam * h + v) * w + u)


def test_bevpool_options_validation() -> None:
    with pytest.raises(UsageError, match="rounding"):
        BevPoolOptions(rounding="round").validate()
    with pytest.raises(UsageError, match="--frustum-mapping"):
        BevPoolOptions(frustum_mapping="corner").validate()
    with pytest.raises(UsageError, match="z-bins"):
        BevPoolOptions(z_bins=0).validate()
    with pytest.raises(UsageError, match="unknown bevpoolv2 build option"):
        BevPoolOptions.from_dict({"rounding": "trunc", "extra": 1})
    with pytest.raises(UsageError, match=r"--batch must be an integer in \[1, 256\], got 0"):
        BevPoolOptions(batch=0).validate()
    with pytest.raises(UsageError, match="batch must be an integer, got '2'"):
        BevPoolOptions.from_dict({"batch": "2"})
    # options recorded before --batch existed read as batch 1
    assert BevPoolOptions.from_dict({"frustum_mapping": "linspace", "rounding": "trunc", "z_bins": None}).batch == 1


# --------------------------------------------------------------------------------------
# Fast-BEV LUT
# --------------------------------------------------------------------------------------


def loop_reference_lut(rig: RigConfig, overlap: str) -> np.ndarray:
    """Per-cell loop over cameras, written separately from the vectorised code."""
    grid = compute_sampling_grid(rig)
    w_f, h_f = rig.feature_size
    n_cam, n_h, ny, nx = grid.valid.shape
    lut = np.full((n_h, ny, nx), -1, dtype=np.int64)
    for ih in range(n_h):
        for iy in range(ny):
            for ix in range(nx):
                best, best_key = -1, None
                for cam in range(n_cam):
                    if not grid.valid[cam, ih, iy, ix]:
                        continue
                    u, v = grid.coords_feature_px[cam, ih, iy, ix]
                    key = {
                        "first": cam,
                        "last": -cam,
                        "nearest-centre": (u - (w_f - 1) / 2) ** 2 + (v - (h_f - 1) / 2) ** 2,
                    }[overlap]
                    if best_key is None or key < best_key:
                        best, best_key = cam, key
                if best >= 0:
                    u, v = grid.coords_feature_px[best, ih, iy, ix]
                    lut[ih, iy, ix] = (best * h_f + int(np.floor(v + 0.5))) * w_f + int(np.floor(u + 0.5))
    return lut


def fastbev_backproject_lut(rig: RigConfig, heights: tuple[float, ...]) -> np.ndarray:
    """Fast-BEV's own recipe, transcribed (``_compute_projection`` + ``backproject_inplace``):
    projection = (intrinsic with the image augmentation, rows 0-1 divided by the stride) @
    extrinsic (ego -> camera); ``x = round(p0 / p2)``, ``y = round(p1 / p2)`` (torch.round: half
    to even); valid iff ``0 <= x < W_f``, ``0 <= y < H_f``, ``z > 0``; cameras in order, later
    ones overwriting earlier ones. Returns the LUT ``(n_h, ny, nx)``, -1 where unseen."""
    bev = rig.bev
    w_f, h_f = rig.feature_size
    xs = bev.x.min + (np.arange(bev.nx) + 0.5) * bev.x.step
    ys = bev.y.min + (np.arange(bev.ny) + 0.5) * bev.y.step
    zz, yy, xx = np.meshgrid(np.asarray(heights), ys, xs, indexing="ij")
    points = torch.from_numpy(np.stack([xx.ravel(), yy.ravel(), zz.ravel(), np.ones(xx.size)]))  # (4, P)
    lut = torch.full((points.shape[1],), -1, dtype=torch.long)
    for cam_index, camera in enumerate(rig.cameras):
        a = camera.image_aug
        aug = torch.tensor([[a.resize, 0, -a.crop_left], [0, a.resize, -a.crop_top], [0, 0, 1]], dtype=torch.float64)
        intrinsic = aug @ torch.tensor(camera.intrinsic, dtype=torch.float64)
        intrinsic[:2] /= rig.feature.stride
        extrinsic = torch.linalg.inv(torch.tensor(camera.ego_from_cam, dtype=torch.float64))  # ego -> camera
        p = (intrinsic @ extrinsic[:3]) @ points
        x = (p[0] / p[2]).round().long()
        y = (p[1] / p[2]).round().long()
        valid = (x >= 0) & (y >= 0) & (x < w_f) & (y < h_f) & (p[2] > 0)
        lut[valid] = (cam_index * h_f + y[valid]) * w_f + x[valid]
    return lut.reshape(len(heights), bev.ny, bev.nx).numpy()


def test_fastbev_lut_equals_fastbev_recipe_with_corner_mapping(nuscenes: RigConfig) -> None:
    """With ``pixel_mapping: corner`` (Fast-BEV projects with the intrinsics divided by the
    stride) and ``--overlap last`` (its sequential loop), the LUT is Fast-BEV's, cell for cell."""
    import dataclasses

    heights = (-1.0, 0.0, 1.0)
    rig = dataclasses.replace(
        nuscenes,
        feature=dataclasses.replace(nuscenes.feature, pixel_mapping="corner"),
        bev=dataclasses.replace(nuscenes.bev, heights=heights),
    )
    ours = build_fastbev_lut(rig, FastBevOptions("last")).lut
    theirs = fastbev_backproject_lut(rig, heights)
    assert np.count_nonzero(theirs >= 0) > 40_000
    assert np.array_equal(ours, theirs)
    # the default stride mapping picks a different pixel in a fraction of the cells
    stride_rig = dataclasses.replace(rig, feature=nuscenes.feature)
    differs = np.count_nonzero(build_fastbev_lut(stride_rig, FastBevOptions("last")).lut != theirs)
    assert 0 < differs < ours.size


@pytest.mark.parametrize("overlap", ["first", "last", "nearest-centre"])
def test_fastbev_lut_equals_per_cell_loop(small_distorted_multi: RigConfig, overlap: str) -> None:
    result = build_fastbev_lut(small_distorted_multi, FastBevOptions(overlap))
    assert result.lut.dtype == np.int32 and result.lut.shape == (3, 40, 40)
    assert np.array_equal(result.lut, loop_reference_lut(small_distorted_multi, overlap))
    assert 0 < result.n_overlap < result.n_seen < result.lut.size  # overlaps AND unseen cells exist


def test_fastbev_overlap_policies_differ_where_cameras_overlap(small_distorted_multi: RigConfig) -> None:
    luts = {p: build_fastbev_lut(small_distorted_multi, FastBevOptions(p)) for p in ("first", "last", "nearest-centre")}
    single = luts["first"].n_views == 1
    for lut in luts.values():
        assert np.array_equal(lut.lut[single], luts["first"].lut[single])
    assert not np.array_equal(luts["first"].lut, luts["last"].lut)


def test_fastbev_lut_gather_equals_torch_nearest_grid_sample(tmp_path: Path, small_distorted_multi: RigConfig) -> None:
    """Gathering with the LUT == F.grid_sample(mode="nearest") on grid/norm of the chosen camera."""
    store = run_grid(small_distorted_multi, tmp_path).store
    loaded = load(store)
    norm = torch.from_numpy(np.array(loaded["grid"]["norm"], dtype=np.float64))
    lut = build_fastbev_lut(small_distorted_multi, FastBevOptions("nearest-centre")).lut
    w_f, h_f = small_distorted_multi.feature_size
    feats = np.random.default_rng(0).random((small_distorted_multi.n_cam, 3, h_f, w_f))
    got = fastbev_gather(lut, feats)  # (C, n_h, ny, nx)
    n_cam, n_h, ny, nx, _ = norm.shape
    sampled = torch.stack([
        F.grid_sample(torch.from_numpy(feats[c : c + 1]), norm[c].reshape(1, n_h * ny, nx, 2), mode="nearest", align_corners=False)
        .reshape(3, n_h, ny, nx) for c in range(n_cam)
    ]).numpy()
    cam = np.where(lut >= 0, lut // (h_f * w_f), 0)
    ref = np.where(lut >= 0, np.take_along_axis(sampled, cam[None, None], axis=0)[0], 0.0)
    assert np.max(np.abs(got - ref)) < 1e-12
    assert np.all(got[:, lut < 0] == 0)


@settings(max_examples=80, deadline=None)
@given(st.data())
def test_choose_camera_policies_property(data: st.DataObject) -> None:
    n_cam = data.draw(st.integers(1, 5))
    cells = data.draw(st.integers(1, 12))
    valid = np.array(data.draw(st.lists(st.booleans(), min_size=n_cam * cells, max_size=n_cam * cells))).reshape(n_cam, cells)
    coords = np.array(data.draw(st.lists(st.integers(-1, 12), min_size=n_cam * cells * 2, max_size=n_cam * cells * 2)), float)
    coords = coords.reshape(n_cam, cells, 2)
    for policy in ("first", "last", "nearest-centre"):
        cam = choose_camera(coords, valid, (12, 8), policy)
        for j in range(cells):
            seen = [c for c in range(n_cam) if valid[c, j]]
            if not seen:
                assert cam[j] == -1
                continue
            assert valid[cam[j], j]
            if policy == "first":
                assert cam[j] == seen[0]
            elif policy == "last":
                assert cam[j] == seen[-1]
            else:
                d = [((coords[c, j, 0] - 5.5) ** 2 + (coords[c, j, 1] - 3.5) ** 2, c) for c in seen]
                assert cam[j] == min(d)[1]  # smallest distance, ties to the lower camera index


def test_fastbev_options_validation() -> None:
    with pytest.raises(UsageError, match="--overlap"):
        FastBevOptions("random").validate()


def test_command_targets_from_the_command_values() -> None:
    """``interop_command_targets``: what ``bevcompile export-interop`` and a fleet manifest's
    ``export-interop:`` build with (defaults, any case, options of a target not requested refused)."""
    assert interop_command_targets(["BEVPoolv2", "fastbev-LUT"]) == {
        "bevpoolv2": BevPoolOptions().to_dict(),
        "fastbev-lut": FastBevOptions().to_dict(),
    }
    assert interop_command_targets(["bevpoolv2"], rounding="FLOOR", batch=2, z_bins=4)["bevpoolv2"] == BevPoolOptions("linspace", "floor", 4, 2).to_dict()
    assert interop_command_targets(["fastbev-lut"], overlap="Nearest-Centre") == {"fastbev-lut": {"overlap": "nearest-centre"}}
    with pytest.raises(UsageError, match=r"--overlap applies to --to fastbev-lut only, which is not requested \(--to bevpoolv2\)"):
        interop_command_targets(["bevpoolv2"], overlap="first")
    with pytest.raises(UsageError, match="--to must be one of bevpoolv2, fastbev-lut, petr-coords3d, got 'lss'"):
        interop_command_targets(["lss"])
    with pytest.raises(UsageError, match="--to is required"):
        interop_command_targets([])


# --------------------------------------------------------------------------------------
# interop/ group: writing, plug-in checks, rebuild
# --------------------------------------------------------------------------------------


@pytest.fixture()
def interop_store(tmp_path: Path, small_distorted_multi: RigConfig) -> Path:
    return run_grid(small_distorted_multi, tmp_path / "art").store


def _context(store: Path) -> tuple[CheckContext, dict[str, np.ndarray], dict]:
    loaded = load(store)
    ctx = CheckContext(
        rig=loaded.rig,
        store_path=str(store),
        root_attrs=dict(loaded.root_attrs),
        grid_arrays={k: np.asarray(loaded["grid"][k]) for k in ("valid", "coords", "norm")} if loaded.has_group("grid") else {},
        grid_attrs=dict(loaded["grid"].attrs) if loaded.has_group("grid") else {},
    )
    group = loaded["interop"]
    return ctx, {k: np.array(group[k]) for k in group}, json.loads(json.dumps(dict(group.attrs), default=lambda o: list(o) if isinstance(o, tuple) else dict(o)))


def test_run_export_interop_writes_both_targets_and_npy(interop_store: Path, tmp_path: Path, small_distorted_multi: RigConfig) -> None:
    run_export_interop(interop_store, {"bevpoolv2": BevPoolOptions().to_dict()})
    result = run_export_interop(interop_store, {"fastbev-lut": FastBevOptions("last").to_dict()}, npy_dir=tmp_path / "npy")
    assert result.kept_targets == ("bevpoolv2",)  # the earlier target is kept (rebuilt from its options)
    loaded = load(interop_store)
    group = loaded["interop"]
    assert set(group.attrs["targets"]) == {"bevpoolv2", "fastbev-lut"}
    assert group.attrs["build_options"]["fastbev-lut"]["overlap"] == "last"
    expected = build_bevpoolv2(small_distorted_multi)
    assert np.array_equal(group["bevpoolv2_ranks_bev"], expected.ranks_bev)
    lut = np.load(tmp_path / "npy" / "fastbev_lut.npy")
    assert np.array_equal(lut, group["fastbev_lut"])
    assert not (tmp_path / "npy" / "ranks_bev.npy").exists()  # only the requested target
    meta = json.loads((tmp_path / "npy" / "interop.json").read_text())
    assert meta["fastbev-lut"]["n_seen"] == int(np.count_nonzero(lut >= 0))
    assert set(loaded.group_names) >= {"grid", "interop"}  # grid/ carried over


def test_interop_arrays_are_deterministic_bytes(interop_store: Path, tmp_path: Path) -> None:
    a = run_export_interop(interop_store, {"bevpoolv2": {"frustum_mapping": "rig", "rounding": "floor", "z_bins": 2}}, npy_dir=tmp_path / "a")
    b = run_export_interop(interop_store, {"bevpoolv2": {"frustum_mapping": "rig", "rounding": "floor", "z_bins": 2}}, npy_dir=tmp_path / "b")
    for path in a.npy_files:
        assert path.read_bytes() == (tmp_path / "b" / path.name).read_bytes()
    assert a.attrs == b.attrs


@pytest.mark.parametrize("batch", [1, 2])
def test_interop_plugin_passes_on_fresh_group(interop_store: Path, small_distorted_multi: RigConfig, batch: int) -> None:
    run_export_interop(interop_store, {"bevpoolv2": BevPoolOptions(batch=batch).to_dict(), "fastbev-lut": FastBevOptions("nearest-centre").to_dict()})
    ctx, arrays, attrs = _context(interop_store)
    checks = check_interop(ctx, arrays, attrs)
    assert len(checks) >= 10
    assert all(c.passed for c in checks), [c for c in checks if not c.passed]
    rows = verify_interop(ctx, arrays, attrs)
    assert {r.product for r in rows} == {"interop/bevpoolv2", "interop/fastbev_lut"}
    assert all(r.passed and r.max_abs < 1e-9 for r in rows), rows
    rebuilt = rebuild_interop(small_distorted_multi, attrs)
    written_by_the_store = {"config_sha256"}  # the writer stamps every group with its config
    assert json_attrs(rebuilt.pop(REBUILT_ATTRS)) == json_attrs({k: v for k, v in attrs.items() if k not in written_by_the_store})
    assert set(rebuilt) == set(arrays)
    for name, value in arrays.items():
        assert rebuilt[name].dtype == value.dtype and np.array_equal(rebuilt[name], value), name


@pytest.mark.parametrize(
    ("array", "damage", "failed_check"),
    [
        ("bevpoolv2_ranks_bev", lambda a: a[::-1].copy(), "sorted_by_ranks_bev"),
        ("bevpoolv2_ranks_feat", lambda a: a + 1, "ranks_feat_matches_depth"),
        ("bevpoolv2_interval_lengths", lambda a: np.roll(a, 1), "intervals_are_runs"),
        ("bevpoolv2_ranks_depth", lambda a: np.where(np.arange(a.size) == 3, 10**8, a).astype(np.int32), "index_range"),
        ("fastbev_lut", lambda a: np.where(a >= 0, (a + 12 * 8) % (4 * 12 * 8), a).astype(np.int32), "overlap_policy"),
        ("fastbev_lut", lambda a: np.where(a < 0, 0, a).astype(np.int32), "unseen_cells_minus_one"),
    ],
)
def test_interop_plugin_catches_damage(interop_store: Path, array: str, damage, failed_check: str) -> None:  # type: ignore[no-untyped-def]
    run_export_interop(interop_store, {"bevpoolv2": BevPoolOptions().to_dict(), "fastbev-lut": FastBevOptions().to_dict()})
    ctx, arrays, attrs = _context(interop_store)
    arrays[array] = damage(arrays[array])
    failed = [c for c in check_interop(ctx, arrays, attrs) if not c.passed]
    assert any(c.name == failed_check for c in failed), failed


def test_interop_plugin_reports_missing_array_and_options(interop_store: Path) -> None:
    run_export_interop(interop_store, {"bevpoolv2": BevPoolOptions().to_dict()})
    ctx, arrays, attrs = _context(interop_store)
    del arrays["bevpoolv2_ranks_feat"]
    failed = [c for c in check_interop(ctx, arrays, attrs) if not c.passed]
    assert [(c.name, c.array) for c in failed] == [("present", "interop/bevpoolv2_ranks_feat")]
    failed = [c for c in check_interop(ctx, arrays, {}) if not c.passed]
    assert failed and "no build_options" in failed[0].reason


def test_interop_on_a_store_without_grid_passes_inspect(tmp_path: Path, small_distorted_multi: RigConfig) -> None:
    """matrix -> export-interop -> inspect: without grid/ the LUT is checked against the projection
    recomputed from the stored config, so a correct store passes and a damaged LUT still fails."""
    from bevcompile.matrix.build import run_matrix
    from bevcompile.store.inspection import inspect_store

    store = run_matrix(small_distorted_multi, tmp_path, MatrixOptions(topk=4, align=4)).store
    run_export_interop(store, {"fastbev-lut": FastBevOptions("nearest-centre").to_dict()})
    report = inspect_store(store)
    assert report.passed, report.failure_lines()
    assert any(c.name == "overlap_policy" and c.passed for c in report.checks)
    ctx, arrays, attrs = _context(store)
    arrays["fastbev_lut"] = np.where(arrays["fastbev_lut"] < 0, 0, arrays["fastbev_lut"]).astype(np.int32)
    assert any(c.name == "unseen_cells_minus_one" for c in check_interop(ctx, arrays, attrs) if not c.passed)


def test_npy_into_an_existing_file_is_a_usage_error(interop_store: Path, tmp_path: Path) -> None:
    target = tmp_path / "arrays.npy"
    target.write_bytes(b"keep")
    with pytest.raises(UsageError, match=r"--npy .*arrays.npy: is a file; give a folder for the .npy files"):
        run_export_interop(interop_store, {"fastbev-lut": FastBevOptions().to_dict()}, npy_dir=target)
    assert target.read_bytes() == b"keep"


def test_a_bad_npy_folder_leaves_the_store_unchanged(interop_store: Path, tmp_path: Path) -> None:
    from ..rigs import tree_digest

    before = tree_digest(interop_store)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(Exception, match=r"cannot write \.npy files"):
        run_export_interop(interop_store, {"fastbev-lut": FastBevOptions().to_dict()}, npy_dir=blocker / "sub")
    assert tree_digest(interop_store) == before


# --------------------------------------------------------------------------------------
# plain inspect: the BEVPoolv2 arrays against a rebuild from config + build_options
# --------------------------------------------------------------------------------------


def _geometry_check(checks: list[Check]) -> Check:
    from bevcompile.interop.checks import GEOMETRY_CHECK

    found = [c for c in checks if c.name == GEOMETRY_CHECK]
    assert len(found) == 1, checks
    return found[0]


def _edit_option(key: str, value: object) -> Callable[[dict[str, np.ndarray], dict], None]:
    def edit(arrays: dict[str, np.ndarray], attrs: dict) -> None:
        attrs["build_options"]["bevpoolv2"][key] = value

    return edit


def _move_point_to_another_pixel(arrays: dict[str, np.ndarray], attrs: dict) -> None:
    """A single-point voxel's point moved one pixel along u (same camera and depth bin, a pixel
    the group does not use yet); ranks_feat kept consistent, so every structural check passes."""
    rd, rb = arrays["bevpoolv2_ranks_depth"], arrays["bevpoolv2_ranks_bev"]
    _starts, lengths = intervals_of(rb)
    singles = np.flatnonzero(np.repeat(lengths, lengths) == 1)
    w_f = 12
    used = set(rd.tolist())
    for i in singles:
        r = int(rd[i])
        moved = r + 1 if r % w_f + 1 < w_f else r - 1
        if moved not in used:
            rd = rd.copy()
            rd[i] = moved
            arrays["bevpoolv2_ranks_depth"] = rd
            arrays["bevpoolv2_ranks_feat"] = feat_rank_from_depth_rank(rd, (4, 8, 8, 12))
            return
    raise AssertionError("no single-point voxel with a free neighbour pixel")


def _move_last_interval_to_next_voxel(arrays: dict[str, np.ndarray], attrs: dict) -> None:
    rb = arrays["bevpoolv2_ranks_bev"].copy()
    assert int(rb[-1]) + 1 < 40 * 40 * 1  # still inside the grid: the index range check passes
    rb[int(arrays["bevpoolv2_interval_starts"][-1]):] += 1
    arrays["bevpoolv2_ranks_bev"] = rb


@pytest.mark.parametrize(
    ("damage", "array"),
    [
        (_edit_option("rounding", "floor"), "bevpoolv2_ranks_bev"),
        (_edit_option("frustum_mapping", "stride"), "bevpoolv2_ranks_bev"),
        (_edit_option("frustum_mapping", "rig"), "bevpoolv2_ranks_bev"),
        (_edit_option("z_bins", 2), "bevpoolv2_ranks_bev"),
        (_edit_option("batch", 2), "bevpoolv2_ranks_bev"),
        (_move_point_to_another_pixel, "bevpoolv2_ranks_depth"),
        (_move_last_interval_to_next_voxel, "bevpoolv2_ranks_bev"),
    ],
    ids=["rounding", "frustum_mapping_stride", "frustum_mapping_rig", "z_bins", "batch", "point_moved", "last_interval_moved"],
)
def test_plain_check_rebuilds_bevpoolv2_and_catches_consistent_damage(
    interop_store: Path, small_distorted_multi: RigConfig, damage: Callable[[dict[str, np.ndarray], dict], None], array: str
) -> None:
    """Damage the structural checks cannot see (arrays still sorted, stable, in range and
    self-consistent) fails plain check_interop through the rebuild comparison alone, naming the
    first differing array and how many elements differ."""
    run_export_interop(interop_store, {"bevpoolv2": BevPoolOptions().to_dict(), "fastbev-lut": FastBevOptions().to_dict()})
    ctx, arrays, attrs = _context(interop_store)
    assert frustum_shape(ctx.rig) == (4, 8, 8, 12)  # the damage helpers use it
    damage(arrays, attrs)
    checks = check_interop(ctx, arrays, attrs)
    failed = [c for c in checks if not c.passed]
    geometry = _geometry_check(checks)
    assert failed == [geometry], failed  # every structural check still passes
    assert geometry.array == f"interop/{array}"
    assert re.search(r"(\d[\d,]* of \d[\d,]* element\(s\) differ|\d[\d,]* element\(s\) stored, \d[\d,]* in the rebuild)", geometry.reason)
    assert "contradict the stored config or build_options" in geometry.reason


def test_plain_check_counts_differing_elements(interop_store: Path) -> None:
    run_export_interop(interop_store, {"bevpoolv2": BevPoolOptions().to_dict()})
    ctx, arrays, attrs = _context(interop_store)
    _move_point_to_another_pixel(arrays, attrs)
    geometry = _geometry_check(check_interop(ctx, arrays, attrs))
    n = arrays["bevpoolv2_ranks_depth"].size
    assert f"1 of {n:,} element(s) differ from the rebuild (first at index" in geometry.reason
    _edit_option("batch", 2)(arrays, attrs)
    geometry = _geometry_check(check_interop(ctx, arrays, attrs))
    assert geometry.array == "interop/bevpoolv2_ranks_bev"
    assert f"{n:,} element(s) stored, {2 * n:,} in the rebuild ({n:,} fewer; first difference at index {n:,})" in geometry.reason


@pytest.mark.parametrize("options", [BevPoolOptions(), BevPoolOptions("rig", "floor", 2, 2), BevPoolOptions("stride", "trunc", None, 3)])
def test_plain_check_passes_a_fresh_bevpoolv2_group(interop_store: Path, options: BevPoolOptions) -> None:
    run_export_interop(interop_store, {"bevpoolv2": options.to_dict()})
    ctx, arrays, attrs = _context(interop_store)
    checks = check_interop(ctx, arrays, attrs)
    assert all(c.passed for c in checks), [c for c in checks if not c.passed]
    geometry = _geometry_check(checks)
    assert geometry.reason.startswith("all 5 arrays equal the rebuild (")


def test_plain_check_skips_the_rebuild_above_the_size_cap(interop_store: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Above GEOMETRY_CHECK_MAX_POINTS frustum points plain inspect does not rebuild: a passing
    check says the comparison runs under --strict and verify (and a lie goes through)."""
    import bevcompile.interop.checks as interop_checks

    run_export_interop(interop_store, {"bevpoolv2": BevPoolOptions().to_dict()})
    ctx, arrays, attrs = _context(interop_store)
    _edit_option("rounding", "floor")(arrays, attrs)
    monkeypatch.setattr(interop_checks, "GEOMETRY_CHECK_MAX_POINTS", 4 * 8 * 8 * 12 - 1)
    monkeypatch.setattr(interop_checks, "build_target", lambda *a, **k: pytest.fail("rebuilt above the cap"))
    checks = check_interop(ctx, arrays, attrs)
    assert all(c.passed for c in checks), [c for c in checks if not c.passed]
    geometry = _geometry_check(checks)
    assert geometry.array == "interop/"
    assert geometry.reason == "not compared: the frustum has 3,072 points (> 3,071); the geometry comparison runs under --strict and verify"
    monkeypatch.undo()
    monkeypatch.setattr(interop_checks, "GEOMETRY_CHECK_MAX_POINTS", 4 * 8 * 8 * 12)  # exactly at the cap: compared
    assert not _geometry_check(check_interop(ctx, arrays, attrs)).passed


def test_plain_inspect_catches_edited_bevpoolv2_build_options(interop_store: Path) -> None:
    """End to end: build_options.bevpoolv2.rounding edited in interop/zarr.json -> plain
    inspect fails with exactly the rebuild check (--strict names every differing array)."""
    from bevcompile.interop.checks import GEOMETRY_CHECK
    from bevcompile.store.inspection import inspect_store

    run_export_interop(interop_store, {"bevpoolv2": BevPoolOptions().to_dict()})
    assert inspect_store(interop_store).passed
    meta_path = interop_store / "interop" / "zarr.json"
    meta = json.loads(meta_path.read_text())
    meta["attributes"]["build_options"]["bevpoolv2"]["rounding"] = "floor"
    meta_path.write_text(json.dumps(meta))
    from .. import damage

    damage.reconsolidate(interop_store)  # an edit by a tool that re-consolidates (else consolidated_metadata fails too)
    report = inspect_store(interop_store)
    assert [(c.name, c.array) for c in report.failures] == [(GEOMETRY_CHECK, "interop/bevpoolv2_ranks_bev")]
    strict = inspect_store(interop_store, strict=True)
    assert {c.name for c in strict.failures} == {GEOMETRY_CHECK, "strict", "strict_attrs"}  # + the measured figures


def test_an_npy_name_taken_by_a_folder_leaves_the_store_unchanged(interop_store: Path, tmp_path: Path) -> None:
    from ..rigs import tree_digest

    before = tree_digest(interop_store)
    names = list(npy_names("fastbev-lut").values())
    (tmp_path / "npy" / names[0]).mkdir(parents=True)
    with pytest.raises(Exception, match=r"is a directory, cannot write the \.npy file there"):
        run_export_interop(interop_store, {"fastbev-lut": FastBevOptions().to_dict()}, npy_dir=tmp_path / "npy")
    assert tree_digest(interop_store) == before


# --------------------------------------------------------------------------------------
# audit fixes: fastbev_n_views required, unknown arrays, verify's reference camera
# --------------------------------------------------------------------------------------


def test_interop_fastbev_n_views_is_required_and_typed(interop_store: Path) -> None:
    run_export_interop(interop_store, {"fastbev-lut": FastBevOptions().to_dict()})
    ctx, arrays, attrs = _context(interop_store)
    assert all(c.passed for c in check_interop(ctx, arrays, attrs))
    missing = {k: v for k, v in arrays.items() if k != "fastbev_n_views"}
    failed = [(c.array, c.name) for c in check_interop(ctx, missing, attrs) if not c.passed]
    assert failed == [("interop/fastbev_n_views", "present")]
    wrong = {**arrays, "fastbev_n_views": arrays["fastbev_n_views"].astype(np.int32)}
    failed = [(c.array, c.name) for c in check_interop(ctx, wrong, attrs) if not c.passed]
    assert failed == [("interop/fastbev_n_views", "dtype_shape")]


def test_interop_unknown_extra_array_fails_the_contract(interop_store: Path) -> None:
    run_export_interop(interop_store, {"bevpoolv2": BevPoolOptions().to_dict()})
    ctx, arrays, attrs = _context(interop_store)
    arrays["zz_unknown"] = np.zeros(10, np.int32)
    failed = [(c.array, c.name, c.reason) for c in check_interop(ctx, arrays, attrs) if not c.passed]
    assert failed == [("interop/", "contract", "arrays not produced by these build_options: zz_unknown")]


def test_interop_check_names_are_snake_case(interop_store: Path) -> None:
    run_export_interop(interop_store, {"bevpoolv2": BevPoolOptions().to_dict(), "fastbev-lut": FastBevOptions("nearest-centre").to_dict()})
    ctx, arrays, attrs = _context(interop_store)
    names = {c.name for c in check_interop(ctx, arrays, attrs)}
    assert names and all(re.fullmatch(r"[a-z0-9_]+", n) for n in names), names


@pytest.mark.parametrize("damage", ["overlap", "unseen"])
def test_verify_fastbev_reference_camera_does_not_come_from_the_lut(interop_store: Path, damage: str) -> None:
    """A LUT that takes another (seeing) camera, or -1 on a seen cell, fails verify's row."""
    run_export_interop(interop_store, {"fastbev-lut": FastBevOptions("first").to_dict()})
    ctx, arrays, attrs = _context(interop_store)
    rows = verify_interop(ctx, arrays, attrs)
    assert [r.passed for r in rows if r.product == "interop/fastbev_lut"] == [True]
    lut = arrays["fastbev_lut"].copy()
    w_f, h_f = ctx.rig.feature_size
    if damage == "unseen":
        lut[np.unravel_index(int(np.flatnonzero(lut.ravel() >= 0)[0]), lut.shape)] = -1
    else:
        valid = np.asarray(ctx.grid_arrays["valid"])
        coords = np.asarray(ctx.grid_arrays["coords"], dtype=np.float64)
        two = np.argwhere(valid.sum(axis=0) >= 2)
        cell = tuple(two[0])
        cams = np.flatnonzero(valid[(slice(None), *cell)])
        other = int(cams[-1])
        u, v = (int(np.floor(x + 0.5)) for x in coords[(other, *cell)])
        lut[cell] = (other * h_f + v) * w_f + u
    rows = verify_interop(ctx, {**arrays, "fastbev_lut": lut}, attrs)
    assert [r.passed for r in rows if r.product == "interop/fastbev_lut"] == [False]


def test_fastbev_near_tie_cells_accept_only_the_two_candidate_pixels(interop_store: Path) -> None:
    """A cell whose coordinate lies within the float32 margin of a .5 tie may point at either
    candidate pixel, never at any other one."""
    run_export_interop(interop_store, {"fastbev-lut": FastBevOptions("first").to_dict()})
    ctx, arrays, attrs = _context(interop_store)
    lut = arrays["fastbev_lut"].copy()
    w_f, h_f = ctx.rig.feature_size
    cell = tuple(np.argwhere(lut >= 0)[0])
    cam = int(lut[cell]) // (h_f * w_f)
    coords = np.asarray(ctx.grid_arrays["coords"]).copy()
    coords[(cam, *cell)] = (10.5, 3.0)  # an exact tie in u: pixels (10, 3) and (11, 3) are both right
    grid_arrays = {**ctx.grid_arrays, "coords": coords}
    ctx = dataclasses.replace(ctx, grid_arrays=grid_arrays)

    def nearest_check(value: int) -> bool:
        lut[cell] = (cam * h_f + 3) * w_f + value
        return next(c for c in check_interop(ctx, {**arrays, "fastbev_lut": lut}, attrs) if c.name == "nearest_feature_pixel").passed

    assert nearest_check(10) and nearest_check(11)
    assert not nearest_check(12) and not nearest_check(30)


def test_bevpoolv2_drops_the_points_outside_the_bev_region() -> None:
    """With bev.region, the arrays are the full grid's minus every point of a cell outside the region
    (same order otherwise: the stable sort is unchanged), and the pooled output is 0 there."""
    from bevcompile.rig.config import parse_config
    from bevcompile.rig.region import region_table

    from ..matrix.test_region import REGION
    from ..rigs import small_rig_data

    data = small_rig_data()
    full = build_bevpoolv2(parse_config(data))
    data["bev"]["region"] = REGION
    rig = parse_config(data)
    region = build_bevpoolv2(rig, jobs=2)
    table = region_table(rig.bev)
    inside = table.expand < table.n_kept
    n_cells = rig.bev.ny * rig.bev.nx
    keep = inside[full.ranks_bev.astype(np.int64) % n_cells]
    assert 0 < region.n_kept < full.n_kept
    assert np.array_equal(region.ranks_bev, full.ranks_bev[keep])
    assert np.array_equal(region.ranks_depth, full.ranks_depth[keep])
    assert np.array_equal(region.ranks_feat, full.ranks_feat[keep])
    assert inside[region.ranks_bev.astype(np.int64) % n_cells].all()


def test_fastbev_checks_of_a_region_grid_store_use_the_fine_projection(tmp_path: Path) -> None:
    """A bev.region store's grid/ holds the kept cells (not the Fast-BEV LUT's fine cells): the
    interop checks then use the float64 projection of the fine cells, and inspect/verify pass."""
    from typer.testing import CliRunner

    from bevcompile.cli import app

    from ..matrix.test_region import REGION
    from ..rigs import small_rig_data, write_yaml

    data = small_rig_data()
    data["bev"]["region"] = REGION
    config = write_yaml(tmp_path / "small.yaml", data)
    runner = CliRunner()
    assert runner.invoke(app, ["grid", str(config), "--out", str(tmp_path), "--quiet"]).exit_code == 0
    store = tmp_path / "small.zarr"
    exported = runner.invoke(app, ["export-interop", str(store), "--to", "fastbev-lut"])
    assert exported.exit_code == 0, exported.output
    inspected = runner.invoke(app, ["inspect", str(store)])
    assert inspected.exit_code == 0 and "checks passed" in inspected.output, inspected.output
    verified = runner.invoke(app, ["verify", str(store)])
    assert verified.exit_code == 0 and "rows passed" in verified.output, verified.output


def test_torch_cpu_argsort_of_ranks_bev_is_the_stable_order(nuscenes: RigConfig) -> None:
    """BEVDet sorts with ``ranks_bev.argsort()`` (not ``stable=True``). On the CPU the installed
    torch returns the stable order for the nuScenes rig's 179,806 kept points (0 positions differ
    from bevcompile's stable sort), so the CPU run and the arrays agree in the order inside every
    voxel too; a CUDA run may not (docs/models.md, what "bit for bit" covers)."""
    arrays = build_bevpoolv2(nuscenes)
    in_depth_order = np.argsort(arrays.ranks_depth)
    ranks_bev = torch.from_numpy(arrays.ranks_bev[in_depth_order].astype(np.int64))
    unstable = ranks_bev.argsort().numpy()
    assert arrays.n_kept == 179_806
    assert np.array_equal(arrays.ranks_depth[in_depth_order][unstable], arrays.ranks_depth)


def test_order_torch_is_bevdets_own_argsort_recorded_with_the_torch_version(tmp_path: Path) -> None:
    """``interop: bevpoolv2: order: torch``: the points inside each voxel in the order of BEVDet's
    own ``ranks_bev.argsort()`` on the installed torch (here the CPU, where it is the stable
    order: 0 positions differ), its version and device in ``interop/`` ``bevpoolv2.sort``;
    ``inspect --strict`` rebuilds it with the same torch; the default stays ``stable``."""
    from bevcompile.store.inspection import inspect_store

    from ..rig.test_presets import calibration_with

    data = calibration_with("bevdet-r50", interop={"bevpoolv2": {"order": "torch"}})
    rig = parse_config(data)
    assert rig.interop_options("bevpoolv2")["order"] == "torch"
    store = tmp_path / "bevdet-r50.zarr"
    run_grid(rig, tmp_path)
    run_export_interop(store, interop_command_targets(None, rig=rig))
    theirs = bevdet_voxel_pooling_prepare_v2(rig, dtype=torch.float32, stable=False)
    interop = load(store)["interop"]
    for name, want in zip(NAMES, theirs, strict=True):
        assert np.array_equal(interop[f"bevpoolv2_{name}"], want), name
    assert interop.attrs["build_options"]["bevpoolv2"]["order"] == "torch"
    assert interop.attrs["bevpoolv2"]["sort"].startswith(f"torch.argsort(ranks_bev) (not stable) of torch {torch.__version__} on cpu")
    stable = bevdet_voxel_pooling_prepare_v2(rig, dtype=torch.float32)
    assert int(np.count_nonzero(stable[1] != theirs[1])) == 0  # the CPU's argsort is stable here
    report = inspect_store(store, strict=True)
    assert report.passed, report.failure_lines()
    with pytest.raises(ConfigError, match=r"interop\.bevpoolv2\.order: expected one of stable, torch"):
        parse_config(calibration_with("bevdet-r50", interop={"bevpoolv2": {"order": "random"}}))
