"""The straightforward references themselves, against things written independently of them:
PyTorch grid_sample, per-row Python sorting, the geometry module's unprojection, and each
other (entries vs pooling)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from bevcompile.grid.ipm import compute_sampling_grid, feature_px_to_norm
from bevcompile.matrix.build import MatrixOptions
from bevcompile.matrix.reference import (
    bev_pool,
    frustum_points_bev,
    grid_pool,
    reference_frustum_entries,
    reference_grid_entries,
    reference_matrix,
)
from bevcompile.rig.geometry import unproject_feature_to_bev

from ..rigs import nuscenes_rig, small_rig

MULTI = small_rig(distortion=True, heights=(-0.5, 0.0, 1.0), bev_half_m=20.0)


def _inputs(rig, channels: int = 3, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:  # type: ignore[no-untyped-def]
    w_f, h_f = rig.feature_size
    rng = np.random.default_rng(seed)
    feats = rng.random((rig.n_cam, channels, h_f, w_f))
    depth = rng.random((rig.n_cam, rig.depth.n_bins, h_f, w_f))
    return feats, depth / depth.sum(axis=1, keepdims=True)


def test_frustum_points_equal_the_geometry_lift() -> None:
    rig = MULTI
    depths = np.asarray(rig.depth.values())
    w_f, h_f = rig.feature_size
    v, u = np.meshgrid(np.arange(h_f), np.arange(w_f), indexing="ij")
    uv = np.broadcast_to(np.stack([u, v], -1).astype(float)[None], (depths.size, h_f, w_f, 2))
    for c, camera in enumerate(rig.cameras):
        points, ok = frustum_points_bev(rig, c)
        want, ok_want = unproject_feature_to_bev(rig, camera, uv, depths[:, None, None])
        assert points.shape == (depths.size, h_f, w_f, 3) and np.array_equal(ok, ok_want[0])
        np.testing.assert_allclose(points[:, ok], want[:, ok], rtol=0, atol=1e-9)


@pytest.mark.parametrize("splat", ["bilinear", "nearest"])
def test_grid_pool_equals_torch_grid_sample(splat: str) -> None:
    rig = MULTI
    feats, _ = _inputs(rig, channels=2)
    got = grid_pool(rig, feats, splat=splat)
    norm = feature_px_to_norm(compute_sampling_grid(rig).coords_feature_px, rig.feature_size, align_corners=False)
    for cam in range(rig.n_cam):
        want = sum(
            F.grid_sample(torch.from_numpy(feats[cam][None]), torch.from_numpy(norm[cam, h][None]), mode=splat, padding_mode="zeros", align_corners=False)[0].numpy()
            for h in range(norm.shape[1])
        )
        np.testing.assert_allclose(got[cam], want, rtol=0, atol=1e-12)
    mean = grid_pool(rig, feats, splat=splat, normalize="mean").sum(axis=0)
    total = got.sum(axis=0)
    ones = grid_pool(rig, np.ones_like(feats), splat=splat).sum(axis=0)[0]
    np.testing.assert_allclose(mean * np.where(ones > 0, ones, 1.0), total, atol=1e-12)


def test_reference_topk_equals_per_row_python_sort() -> None:
    """reference_matrix's lexsort + rank selection vs sorting each row's entries in Python."""
    rig = small_rig()
    for splat in ("bilinear", "nearest"):
        entries = reference_frustum_entries(rig, splat, "floor")
        for k in (1, 3, 7):
            ref = reference_matrix(rig, MatrixOptions(splat=splat, topk=k))
            want = set()
            rows: dict[int, list[tuple[float, float, int]]] = {}
            for r, c, w, d in zip(entries.row.tolist(), entries.col.tolist(), entries.weight.tolist(), entries.dist2.tolist(), strict=True):
                rows.setdefault(r, []).append((-w, d, c))
            for r, items in rows.items():
                want |= {(r, c) for _w, _d, c in sorted(items)[:k]}
            assert set(zip(ref.row.tolist(), ref.col.tolist(), strict=True)) == want


def test_entries_and_pooling_references_agree() -> None:
    """Two reference paths: entries (canonical point formula) applied to the lifted features
    equal bev_pool (geometry's unprojection + np.add.at) on nuScenes, both splats."""
    rig = nuscenes_rig()
    feats, depth = _inputs(rig, channels=2, seed=5)
    w_f, h_f = rig.feature_size
    for splat in ("nearest", "bilinear"):
        e = reference_frustum_entries(rig, splat, "floor")
        plane = w_f * h_f
        cam, rem = e.col // (rig.depth.n_bins * plane), e.col % (rig.depth.n_bins * plane)
        d, pix = rem // plane, rem % plane
        lifted = depth.reshape(rig.n_cam, -1, plane)[cam, d, pix][:, None] * feats.reshape(rig.n_cam, 2, plane)[cam, :, pix]
        got = np.stack([np.bincount(e.row, weights=e.weight * lifted[:, c], minlength=rig.bev.nx * rig.bev.ny) for c in range(2)])
        want = bev_pool(rig, feats, depth, splat=splat).sum(axis=0).reshape(2, -1)
        assert np.abs(got - want).max() <= 1e-9 * np.abs(want).max()


def test_bev_pool_mean_is_sum_over_count_and_cameras_add_up() -> None:
    rig = MULTI
    feats, depth = _inputs(rig, seed=2)
    total = bev_pool(rig, feats, depth, splat="nearest")
    mean = bev_pool(rig, feats, depth, splat="nearest", normalize="mean")
    ones = bev_pool(rig, np.ones_like(feats), np.ones_like(depth), splat="nearest").sum(axis=0)[0]  # point count per cell
    counts = np.bincount(reference_frustum_entries(rig, "nearest", "floor").row, minlength=ones.size).reshape(ones.shape)
    assert np.array_equal(ones, counts)
    np.testing.assert_allclose(mean.sum(axis=0) * np.where(counts > 0, counts, 1), total.sum(axis=0), atol=1e-12)
    # a camera whose features are zero contributes nothing
    feats[1] = 0
    assert not bev_pool(rig, feats, depth, splat="bilinear")[1].any()


def test_grid_entries_sum_heights_and_cover_valid_cells_only() -> None:
    rig = MULTI
    entries = reference_grid_entries(rig, "bilinear")
    sampling = compute_sampling_grid(rig)
    valid_any = sampling.valid.any(axis=(0, 1)).ravel()
    assert set(np.unique(entries.row).tolist()) <= set(np.flatnonzero(valid_any).tolist())
    # per row, the total weight is the number of valid (cam, height) samples minus border losses
    mass = np.bincount(entries.row, weights=entries.weight, minlength=valid_any.size)
    n_samples = sampling.valid.sum(axis=(0, 1)).ravel()
    assert np.all(mass <= n_samples + 1e-12) and np.all(mass[n_samples > 0] > 0)
