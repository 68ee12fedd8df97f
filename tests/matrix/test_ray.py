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
from hypothesis import given, settings
from hypothesis import strategies as st

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


def test_ranked_bins_give_the_same_bytes_and_candidates_for_every_jobs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nearest with a many-valued ``(D,)`` prior: the ``ranked`` bins' reference weights (a maximum
    over the pass-1 sample, folded from the threads) and so the matrix and the candidates sorted are
    the same for every ``--jobs``; the Top-K is the straightforward build's."""
    monkeypatch.setattr(ray_mod, "CHUNK_POINTS", 700)
    rig = MULTI
    prior = DepthPrior(np.linspace(2.0, 0.5, rig.depth.n_bins))
    options = MatrixOptions(mode="ray", topk=4, splat="nearest", align=1, depth_prior=prior.token)
    stream = ray_mod.RayStream(rig, splat="nearest", rounding="floor", k=4, prior=prior.normalised(rig), jobs=1)
    assert stream.bins.kind == "ranked" and stream.bins.ref is not None
    assert np.unique(stream.bins.ref).size > 3  # the rows' reference weights differ
    first = build_matrix(rig, options, jobs=1, depth_prior=prior)
    for jobs in (2, 3):
        again = build_matrix(rig, options, jobs=jobs, depth_prior=prior)
        assert _store_bytes(again, rig) == _store_bytes(first, rig)
        assert again.figures.n_candidates == first.figures.n_candidates
    ref = reference_matrix(rig, options, prior=prior.normalised(rig).dense(rig))
    assert np.array_equal(first.coo_row, ref.row) and np.array_equal(first.coo_col, ref.col)


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


# ---- the sort-free merge of a pixel's depth bins (ray.merge_ray_runs) ----------------------------


def _merge_runs(ray: np.ndarray, ix: np.ndarray, iy: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """``merge_ray_runs`` of points given by ray and cell: the ray starts, and the base rows of the
    narrowest frame it allows (``i_x`` spanning ``width - size``: a step across a whole row then
    lands next to a near step's ``d``)."""
    width = int(ix.max() - ix.min()) + size
    base = (iy - iy.min()) * width + (ix - ix.min())
    starts = np.flatnonzero(np.diff(ray, prepend=ray[0] - 1) != 0)
    return ray_mod.merge_ray_runs(starts, base.astype(np.int64), width, size)


def _merge(ray: np.ndarray, ix: np.ndarray, iy: np.ndarray, w: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """``(first entries, their merged weights)`` as ``RayStream.entries`` sums them."""
    child, root = _merge_runs(ray, ix, iy, size)
    assert np.all(np.diff(child) > 0) and np.all(root < child)
    merged = w.ravel().copy()
    np.add.at(merged, root, w.ravel()[child])
    head = np.setdiff1d(np.arange(merged.size), child)
    return head, merged[head]


def _dict_sums(ray: np.ndarray, ix: np.ndarray, iy: np.ndarray, w: np.ndarray, size: int) -> dict[tuple[int, int, int], tuple[int, float]]:
    """The straightforward rule: per (ray, cell) the sequential sum over the points in order (and
    the first entry), a Python dict over every (point, corner)."""
    out: dict[tuple[int, int, int], tuple[int, float]] = {}
    for i in range(ray.size):
        for c in range(size * size):
            key = (int(ray[i]), int(ix[i]) + c % size, int(iy[i]) + c // size)
            first, total = out.get(key, (i * size * size + c, 0.0))
            out[key] = (first, total + float(w[i, c]))
    return out


def _check_against_dict(ray: np.ndarray, ix: np.ndarray, iy: np.ndarray, w: np.ndarray, size: int) -> None:
    head, sums = _merge(ray, ix, iy, w, size)
    want = _dict_sums(ray, ix, iy, w, size)
    assert sorted(f for f, _ in want.values()) == head.tolist()  # one group per (ray, cell), at its first entry
    got = dict(zip(head.tolist(), sums.tolist(), strict=True))
    for first, total in want.values():
        assert got[first] == total  # bit for bit: the same sequential sum


def test_merge_joins_a_cell_reached_through_different_corners_non_consecutively() -> None:
    """Bilinear entries are ``(point, corner)`` point-major: cell (1, 1) is corner (1, 1) of point
    0, corner (0, 1) of point 1 and corner (0, 0) of point 2 (entries 3, 6, 8, other cells between
    them); and a point left out (prior 0) between two points that share a cell still joins them."""
    ray = np.array([0, 0, 0, 0, 1, 1])
    ix = np.array([0, 1, 1, 3, 5, 6])  # ray 1: (5, 0) then (6, 1), its point in between left out
    iy = np.array([0, 0, 1, 1, 0, 1])
    w = np.random.default_rng(0).random((6, 4))
    w[2, 1] = 0.0  # a zero-weight member stays in its group (it adds 0)
    child, root = _merge_runs(ray, ix, iy, 2)
    assert dict(zip(child.tolist(), root.tolist(), strict=True)) == {4: 1, 6: 3, 8: 3, 9: 7, 20: 19}
    head, sums = _merge(ray, ix, iy, w, 2)
    assert sums[head.tolist().index(3)] == (w[0, 3] + w[1, 2]) + w[2, 0]
    _check_against_dict(ray, ix, iy, w, 2)


@settings(max_examples=60, deadline=None)
@given(
    rays=st.lists(
        st.tuples(st.integers(-3, 3), st.integers(-3, 3), st.sampled_from([-1, 1]), st.sampled_from([-1, 1]),
                  st.lists(st.tuples(st.integers(0, 3), st.integers(0, 3)), min_size=1, max_size=12)),
        min_size=1, max_size=5,
    ),
    size=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**16),
)
def test_merge_equals_a_dict_sum_on_monotone_rays(rays: list, size: int, seed: int) -> None:
    """Any rays whose base cells are monotone per axis (steps of 0 to 3 cells: runs, corner
    overlaps and jumps), weights with exact zeros: the same groups and the same bits as a dict."""
    ray_l, ix_l, iy_l = [], [], []
    for r, (x0, y0, sx, sy, steps) in enumerate(rays):
        x, y = x0, y0
        for stx, sty in steps:
            x, y = x + sx * stx, y + sy * sty
            ray_l.append(r)
            ix_l.append(x)
            iy_l.append(y)
    ray, ix, iy = (np.array(a, dtype=np.int64) for a in (ray_l, ix_l, iy_l))
    rng = np.random.default_rng(seed)
    w = rng.random((ray.size, size * size)) ** 4
    w[rng.random(w.shape) < 0.2] = 0.0
    _check_against_dict(ray, ix, iy, w, size)


# ---- the Top-K score bins (ray.RayBins) ----------------------------------------------------------


def _bins_cases() -> list[tuple[str, ray_mod.RayBins, np.ndarray, np.ndarray, np.ndarray]]:
    """Each kind of bins with entries as a ray build makes them: single-bin weights (exactly a prior
    value), merged runs (sums of them), bilinear splats (prior times corner weights), exact zeros;
    and each entry's counting-frame row (``ranked``: four rows whose reference weights are the
    prior's largest, a middle value, its smallest, and a weight no entry has)."""
    rig = MULTI
    box = ray_mod.BevBox.of(rig)
    rng = np.random.default_rng(11)
    d = rig.depth.n_bins
    out = []
    for name, raw, bilinear in (
        ("uniform nearest", None, False),
        ("two values nearest", np.where(np.arange(d) % 2 == 0, 1.0, 3.0), False),
        ("per-depth nearest", np.linspace(2.0, 0.5, d), False),
        ("uniform bilinear", None, True),
        ("per-camera bilinear", rng.random((rig.n_cam, d)), True),
    ):
        prior = DepthPrior(raw).normalised(rig)
        bins = ray_mod.RayBins.for_stream(prior, rig.n_cam, bilinear, box)
        table = np.concatenate([prior.table(c) for c in range(rig.n_cam)])
        single = rng.choice(table, 4000)
        weight = single * (rng.random(4000) * rng.random(4000) if bilinear else 1.0)
        runs = np.array([sum(rng.choice(table, m)) for m in rng.integers(2, 5, 600)])
        weight = np.concatenate([weight, runs, [0.0, 0.0], single[:50]])  # exact ties on weight too
        h2 = (0.5 * box.dx) ** 2 + (0.5 * box.dy) ** 2
        dist2 = rng.random(weight.size) ** 3 * 2.5 * h2
        dist2[-50:] = dist2[:50]  # exact ties on (weight, dist2)
        frame = rng.integers(0, 4, weight.size)
        if bins.kind == "ranked":
            values = np.unique(table)
            bins = bins.with_reference(np.array([values[-1], values[values.size // 2], values[0], 0.5 * (values[0] + values[1])]))
        out.append((name, bins, weight, dist2, frame))
    return out


BINS_CASES = _bins_cases()


@pytest.mark.parametrize(("name", "bins", "weight", "dist2", "frame"), BINS_CASES, ids=[c[0] for c in BINS_CASES])
def test_convention_ray_score_bins_follow_the_topk_order(name: str, bins: ray_mod.RayBins, weight: np.ndarray, dist2: np.ndarray, frame: np.ndarray) -> None:
    """A row's entries sorted by the Top-K order (larger weight, then smaller dist2) have
    non-decreasing bins in ``[0, n_bins)``, weight 0 in the last bin; so a row's K-th best bin
    bounds its Top-K (``ranked``: in every row, whatever its reference weight)."""
    for row in range(4):
        mine = np.flatnonzero(frame == row)
        order = mine[np.lexsort((dist2[mine], -weight[mine]))]
        b = bins.of(weight[order], dist2[order], frame[order])
        assert b.min() >= 0 and b.max() <= bins.n_bins - 1
        assert np.all(np.diff(b) >= 0), (name, row)
        assert np.all(bins.of(np.zeros(3), np.ones(3), np.full(3, row)) == bins.n_bins - 1)
        assert np.unique(b).size > 8  # the bins separate entries (not one bin for all)
    tie = bins.ties[0] if bins.kind == "classes" else None
    if bins.kind == "ranked":  # row 0's reference is the prior's largest weight
        assert bins.ref is not None
        tie = float(bins.ref[0])
    if tie is not None:  # one depth bin's weight: only dist2 orders the ties, in many bins
        single = weight == tie
        assert np.unique(bins.of(weight[single], dist2[single], np.zeros(int(single.sum()), np.int64))).size >= 20


@pytest.mark.parametrize(("name", "bins", "weight", "dist2", "frame"), BINS_CASES, ids=[c[0] for c in BINS_CASES])
def test_ray_prefilter_bounds_never_drop_an_entry_the_threshold_keeps(name: str, bins: ray_mod.RayBins, weight: np.ndarray, dist2: np.ndarray, frame: np.ndarray) -> None:
    """For every threshold bin t: an entry with bin <= t has weight >= lowest_weight(t) (``ranked``:
    times its row's reference weight, as the stream applies it), and (one tie value) an entry of
    weight t_0 with bin <= t has dist2 < dist2_cut(t), while one at or past the cut has a bin > t
    (the pass-2 float pre-filters are supersets of the exact test)."""
    b = bins.of(weight, dist2, frame)
    scale = bins.ref[frame] if bins.ref is not None else np.ones(weight.size)
    for t in range(bins.n_bins):
        passing = b <= t
        low = bins.lowest_weight(np.array([t]))[0] * scale
        assert np.all(weight[passing] >= low[passing]), (name, t)
        if bins.kind == "classes" and len(bins.ties) == 1:
            cut = bins.dist2_cut(np.array([t]))[0]
            tied = weight == bins.ties[0]
            assert np.all(dist2[tied & passing] < cut), (name, t)
            near_cut = tied & (dist2 >= cut)
            assert not np.any(passing & near_cut), (name, t)


def test_ray_bins_kind_follows_the_prior() -> None:
    """Nearest with few distinct single-bin weights splits exact ties by dist2 (``classes``), with
    many by dist2 around each row's reference weight (``ranked``); a bilinear splat or a per-pixel
    prior use weight bins (``linear``)."""
    kinds = {c[0]: c[1].kind for c in BINS_CASES}
    assert kinds == {"uniform nearest": "classes", "two values nearest": "classes", "per-depth nearest": "ranked", "uniform bilinear": "linear", "per-camera bilinear": "linear"}
    per_pixel = DepthPrior(per_pixel_prior(MULTI)).normalised(MULTI)
    assert ray_mod.RayBins.for_stream(per_pixel, MULTI.n_cam, False, ray_mod.BevBox.of(MULTI)).kind == "linear"


@pytest.mark.parametrize("stride", [1, 3, 7])
@pytest.mark.parametrize(("splat", "kind"), [("bilinear", "uniform"), ("nearest", "uniform"), ("nearest", "holes"), ("nearest", "per-camera"), ("bilinear", "per-pixel")])
def test_any_pass1_sample_gives_the_same_matrix(monkeypatch: pytest.MonkeyPatch, stride: int, splat: str, kind: str) -> None:
    """Pass 1 counts the rays at plan positions that are multiples of ``stride`` (nearest: several
    blocks per call) and pass 2 tightens its thresholds as it admits candidates: whatever the
    sample, the Top-K is the straightforward build's, bit for bit (only the candidate count
    changes), with blocks of one ray to many."""
    monkeypatch.setattr(ray_mod, "PASS1_STRIDE", stride)
    monkeypatch.setattr(ray_mod, "CHUNK_POINTS", 97)
    rig = RING
    holes = np.ones(rig.depth.n_bins)
    holes[::3] = 0.0  # one positive value, and bins with none: the blocks of one tie value with zeros left out
    raw = {"uniform": None, "holes": holes, "per-camera": np.random.default_rng(4).random((rig.n_cam, rig.depth.n_bins)), "per-pixel": per_pixel_prior(rig, 2)}[kind]
    prior = DepthPrior(raw)
    options = MatrixOptions(mode="ray", splat=splat, topk=4, align=1, depth_prior=prior.token)
    p = build_matrix(rig, options, depth_prior=prior)
    ref = reference_matrix(rig, options, prior=prior.normalised(rig).dense(rig))
    assert np.array_equal(p.coo_row, ref.row) and np.array_equal(p.coo_col, ref.col)
    assert np.array_equal(p.coo_val, ref.value.astype(np.float32))
    assert p.figures.n_candidates >= p.figures.nnz


def test_chain_roots_follow_chains_of_any_length() -> None:
    """A cell in the splat of many consecutive points: every member's root is the chain's first entry."""
    child = np.array([2, 3, 5, 7, 8, 9, 12])
    parent = np.array([1, 2, 3, 5, 4, 8, 11])  # 1 <- 2 <- 3 <- 5 <- 7; 4 <- 8 <- 9; 11 <- 12
    got = ray_mod.chain_roots(child, parent.copy(), 13)
    assert got.tolist() == [1, 1, 1, 1, 4, 4, 11]
    assert ray_mod.chain_roots(np.zeros(0, np.int64), np.zeros(0, np.int64), 5).size == 0
