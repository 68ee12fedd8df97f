"""``bevcompile matrix --mode ray`` (:mod:`bevcompile.matrix.ray`): the depth-folded matrix.

The proof of the issue: with ``--topk 0`` the ray matrix applied to image features equals the
FRUSTUM matrix (built and proven independently, tests/matrix/test_build.py) applied to the
outer product ``prior x features``, in float64 to 1e-12 relative, for both splats, a uniform and
a non-uniform per-pixel prior. The streamed Top-K build equals the straightforward reference
(:func:`bevcompile.matrix.reference.reference_ray_entries`) bit for bit, for any block size and
``--jobs``.
"""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
import scipy.sparse as sp

import bevcompile.matrix.build as matrix_mod
import bevcompile.matrix.ray as ray_mod
import bevcompile.matrix.topk as topk_mod
from bevcompile.errors import UsageError
from bevcompile.matrix.build import MatrixOptions, build_matrix
from bevcompile.matrix.entries import frustum_entries
from bevcompile.matrix.prior import DepthPrior
from bevcompile.matrix.ray import ray_entries
from bevcompile.matrix.reference import bev_pool, reference_matrix
from bevcompile.rig.config import RigConfig

from ..rigs import nuscenes_rig, ring_rig, small_rig

NUSCENES = nuscenes_rig()
MULTI = small_rig(distortion=True, heights=(-0.5, 0.0, 1.0), bev_half_m=20.0)
RING = ring_rig()


def per_pixel_prior(rig: RigConfig, seed: int = 0) -> np.ndarray:
    """A non-uniform per-pixel prior with exact zeros (some bins, and some whole pixels)."""
    w_f, h_f = rig.feature_size
    rng = np.random.default_rng(seed)
    raw = rng.random((rig.n_cam, rig.depth.n_bins, h_f, w_f)) ** 3
    raw[rng.random(raw.shape) < 0.3] = 0.0
    raw[:, :, 0, :3] = 0.0  # pixels with no depth weight at all contribute nothing
    return raw


def _sparse(rig: RigConfig, e: topk_mod.Entries, n_cols: int) -> sp.csr_matrix:
    return sp.csr_matrix((e.weight, (e.row, e.col)), shape=(rig.bev.nx * rig.bev.ny, n_cols))


@pytest.mark.parametrize("splat", ["bilinear", "nearest"])
@pytest.mark.parametrize("kind", ["uniform", "per-pixel"])
def test_ray_matrix_equals_frustum_matrix_on_prior_times_features(splat: str, kind: str) -> None:
    """W_ray @ F == W_frustum @ (p x F) (float64, 1e-12 relative) on the real nuScenes rig, K = 0."""
    rig = NUSCENES
    w_f, h_f = rig.feature_size
    plane, n_bins = w_f * h_f, rig.depth.n_bins
    prior = DepthPrior() if kind == "uniform" else DepthPrior(per_pixel_prior(rig))
    norm = prior.normalised(rig)
    ray = ray_entries(rig, splat=splat, rounding="floor", topk=0, prior=norm).kept
    fr = frustum_entries(rig, splat=splat, rounding="floor", topk=0).kept
    p = norm.dense(rig).reshape(rig.n_cam, n_bins, plane)
    if kind == "uniform":
        assert np.all(p == 1.0 / n_bins)
    else:
        assert np.allclose(p.sum(axis=1)[:, 3:], 1.0) and np.all(p[:, :, :3] == 0.0)
    feats = np.random.default_rng(1).standard_normal((rig.n_cam, 5, plane))
    x_ray = feats.transpose(0, 2, 1).reshape(-1, 5)  # rows (cam, v, u)
    x_fr = (p[:, :, None, :] * feats[:, None]).transpose(0, 1, 3, 2).reshape(-1, 5)  # rows (cam, d, v, u)
    got = _sparse(rig, ray, rig.n_cam * plane) @ x_ray
    want = _sparse(rig, fr, rig.n_cam * n_bins * plane) @ x_fr
    assert np.abs(want).max() > 0.1  # a non-trivial product
    assert np.abs(got - want).max() <= 1e-12 * np.abs(want).max()
    assert np.all(ray.weight > 0) and ray.col.max() < rig.n_cam * plane


@pytest.mark.parametrize("splat", ["bilinear", "nearest"])
def test_ray_k0_equals_bevdet_pooling_of_the_prior(splat: str) -> None:
    """K = 0 against BEVDet-style voxel pooling with the prior as depth (an independent code path)."""
    rig = MULTI
    w_f, h_f = rig.feature_size
    prior = DepthPrior(per_pixel_prior(rig, 3))
    products = build_matrix(rig, MatrixOptions(mode="ray", splat=splat, depth_prior=prior.token), depth_prior=prior)
    feats = np.random.default_rng(2).standard_normal((rig.n_cam, 3, h_f, w_f))
    pooled = bev_pool(rig, feats, prior.normalised(rig).dense(rig), splat=splat).sum(axis=0).reshape(3, -1).T
    got = products.dense().astype(np.float64) @ feats.transpose(0, 2, 3, 1).reshape(-1, 3)
    assert np.abs(got - pooled).max() <= 1e-6 * np.abs(pooled).max()


RAY_CASES = list(itertools.product(("bilinear", "nearest"), ("floor", "trunc"), (0, 3, 8), ("uniform", "per-camera", "per-pixel")))


@pytest.mark.parametrize(("splat", "rounding", "k", "kind"), RAY_CASES)
def test_streamed_ray_build_equals_straightforward_reference(monkeypatch: pytest.MonkeyPatch, splat: str, rounding: str, k: int, kind: str) -> None:
    monkeypatch.setattr(ray_mod, "CHUNK_POINTS", 211)  # many blocks, of one or several depth bins
    rig = MULTI
    raw = {"uniform": None, "per-camera": np.random.default_rng(5).random((rig.n_cam, rig.depth.n_bins)), "per-pixel": per_pixel_prior(rig, 7)}[kind]
    prior = DepthPrior(raw)
    options = MatrixOptions(mode="ray", splat=splat, rounding=rounding, topk=k, normalize="mean" if k == 3 else "sum", align=1, depth_prior=prior.token)
    p = build_matrix(rig, options, depth_prior=prior)
    ref = reference_matrix(rig, options, prior=prior.normalised(rig).dense(rig))
    assert ref.row.size > 0
    assert np.array_equal(p.coo_row, ref.row) and np.array_equal(p.coo_col, ref.col)
    assert np.array_equal(p.coo_val, ref.value.astype(np.float32))
    has = ref.total_mass > 0
    kept = np.bincount(ref.row, weights=ref.weight, minlength=has.size)
    assert p.figures.kept_weight_fraction_total == pytest.approx(kept[has].sum() / ref.total_mass[has].sum(), rel=1e-9)


def test_prior_shapes_broadcast_to_the_same_matrix() -> None:
    """(D,) and (n_cam, D) priors give the bytes of the same prior broadcast to (n_cam, D, H_f, W_f)."""
    rig = MULTI
    w_f, h_f = rig.feature_size
    vec = np.linspace(1.0, 3.0, rig.depth.n_bins)
    per_cam = np.stack([vec * (c + 1) for c in range(rig.n_cam)])  # the same after renormalisation
    full = np.broadcast_to(vec[None, :, None, None], (rig.n_cam, rig.depth.n_bins, h_f, w_f)).copy()
    built = []
    for raw in (vec, per_cam, full):
        prior = DepthPrior(raw)
        built.append(build_matrix(rig, MatrixOptions(mode="ray", topk=5, depth_prior=prior.token), depth_prior=prior))
    for other in built[1:]:
        for name in ("coo_row", "coo_col", "coo_val", "ell_weight"):
            assert np.array_equal(other.arrays()[name], built[0].arrays()[name]), name
    uniform = build_matrix(rig, MatrixOptions(mode="ray", topk=5))
    assert not np.array_equal(uniform.coo_val, built[0].coo_val)  # the prior changes the weights


def _store_bytes(p: matrix_mod.MatrixProducts, rig: RigConfig) -> tuple[dict[str, bytes], str]:
    attrs = json.dumps(matrix_mod.matrix_attributes(p, rig), sort_keys=True, allow_nan=False)
    return {name: a.tobytes() for name, a in p.arrays().items()}, attrs


@pytest.mark.parametrize(
    "options",
    [MatrixOptions(mode="ray", topk=5, align=8, tile_rows=16, quantize="int8"), MatrixOptions(mode="ray", topk=3, splat="nearest", rounding="trunc", compact_rows=True), MatrixOptions(mode="ray", topk=0)],
    ids=["bilinear-k5-int8", "nearest-trunc-k3", "k0"],
)
def test_every_jobs_count_writes_the_same_ray_bytes(monkeypatch: pytest.MonkeyPatch, options: MatrixOptions) -> None:
    monkeypatch.setattr(ray_mod, "CHUNK_POINTS", 700)
    monkeypatch.setattr(topk_mod, "SELECT_SPLIT_MIN", 1)
    monkeypatch.setattr(topk_mod, "CANDIDATE_BUDGET_MIN", 2000)
    for rig in (MULTI, RING):
        want = _store_bytes(build_matrix(rig, options, jobs=1), rig)
        for jobs in (2, 3):
            assert _store_bytes(build_matrix(rig, options, jobs=jobs), rig) == want, (rig.name, jobs)


def test_ray_attributes_and_prior_record() -> None:
    prior = DepthPrior(per_pixel_prior(MULTI), "prior.npy", "ab" * 32)
    p = build_matrix(MULTI, MatrixOptions(mode="ray", topk=4, depth_prior=prior.token), depth_prior=prior)
    attrs = matrix_mod.matrix_attributes(p, MULTI)
    assert attrs["build_options"]["depth_prior"] == prior.token
    assert attrs["column_layout"] == "(cam, v, u)" and attrs["rounding"] == "floor"
    assert attrs["depth_prior"]["shape"] == list(prior.raw.shape) and attrs["depth_prior"]["source"] == "prior.npy"
    assert p.arrays()["depth_prior"].dtype == np.float64 and np.array_equal(p.arrays()["depth_prior"], prior.raw)
    n_cols = MULTI.n_cam * MULTI.feature_size[0] * MULTI.feature_size[1]
    assert p.n_cols == n_cols and attrs["logical_shape"][1] == n_cols
    # the other modes' build_options are unchanged (no depth_prior key: shipped stores keep their bytes)
    assert "depth_prior" not in MatrixOptions(topk=4).to_dict()
    uniform = build_matrix(MULTI, MatrixOptions(mode="ray", topk=4))
    assert "depth_prior" not in uniform.arrays() and matrix_mod.matrix_attributes(uniform, MULTI)["depth_prior"]["kind"] == "uniform"


def test_options_refuse_a_prior_they_do_not_name() -> None:
    prior = DepthPrior(per_pixel_prior(MULTI))
    with pytest.raises(UsageError, match="does not name the given prior"):
        build_matrix(MULTI, MatrixOptions(mode="ray", topk=4), depth_prior=prior)
    with pytest.raises(UsageError, match="--depth-prior applies to --mode ray only"):
        MatrixOptions(mode="frustum", depth_prior=prior.token).validate()
    with pytest.raises(UsageError, match="depth_prior must be"):
        MatrixOptions(mode="ray", depth_prior="sha256:xyz").validate()
