"""Sparse aggregation matrix: conventions, exactness of the streamed build against the
straightforward reference, Top-K properties, layouts (ELL, tiles, int8, compact rows) and the
equivalences the issue asks for (BEVDet voxel pooling, torch grid_sample)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import bevcompile.matrix.build as matrix_mod
import bevcompile.matrix.entries as entries_mod
import bevcompile.matrix.topk as topk_mod
from bevcompile import memory
from bevcompile.errors import UsageError
from bevcompile.grid.build import run_grid
from bevcompile.matrix.build import (
    Entries,
    MatrixOptions,
    build_matrix,
    camera_rays,
    coo_to_dense,
    dequantize_rows_int8,
    quantize_rows_int8,
    select_topk,
    tile_blocks,
)
from bevcompile.matrix.checks import apply_entries, lifted_columns
from bevcompile.matrix.reference import bev_pool, reference_frustum_entries, reference_matrix
from bevcompile.rig.config import RigConfig, parse_config
from bevcompile.rig.geometry import ego_from_cam_matrix, unproject_feature_to_bev
from bevcompile.store.zarr_io import open_store

from .. import rigs
from ..rigs import ROOT, nuscenes_rig, ring_rig, small_rig, small_rig_data

SMALL = small_rig()
MULTI = small_rig(distortion=True, heights=(-0.5, 0.0, 1.0), bev_half_m=20.0)
LINSPACE = small_rig(pixel_mapping="linspace", bev_half_m=8.0, bev_step_m=0.5)
NUSCENES = nuscenes_rig()
RING = ring_rig()  # level identical cameras: every entry ties exactly with its pixel column's


def _features(rig: RigConfig, channels: int = 3, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    w_f, h_f = rig.feature_size
    rng = np.random.default_rng(seed)
    feats = rng.random((rig.n_cam, channels, h_f, w_f), dtype=np.float32)
    logits = rng.standard_normal((rig.n_cam, rig.depth.n_bins, h_f, w_f))
    depth = np.exp(logits - logits.max(axis=1, keepdims=True))
    return feats, (depth / depth.sum(axis=1, keepdims=True)).astype(np.float32)


def _apply(rig: RigConfig, products: matrix_mod.MatrixProducts, feats: np.ndarray, depth: np.ndarray | None) -> np.ndarray:
    """``W @ X`` (float64) from the COO product, as ``(C, ny, nx)`` on the BEV grid."""
    lifted = lifted_columns(rig, products.options.mode, products.coo_col, feats, depth)
    rows = apply_entries(products.coo_row, products.coo_val, lifted, products.n_rows)
    cells = products.row_ids if products.row_ids is not None else np.arange(products.n_cells)
    out = np.zeros((products.n_cells, feats.shape[1]))
    out[np.asarray(cells, np.int64)] = rows
    return out.T.reshape(feats.shape[1], rig.bev.ny, rig.bev.nx)


def _decode_frustum_col(rig: RigConfig, col: np.ndarray) -> tuple[np.ndarray, ...]:
    """Column -> (cam, d, v, u) by the documented formula col = ((cam*D + d)*H_f + v)*W_f + u."""
    w_f, h_f = rig.feature_size
    u = col % w_f
    v = (col // w_f) % h_f
    d = (col // (w_f * h_f)) % rig.depth.n_bins
    cam = col // (w_f * h_f * rig.depth.n_bins)
    return cam, d, v, u


# --------------------------------------------------------------------------------------
# conventions
# --------------------------------------------------------------------------------------


def test_convention_rows_and_frustum_columns_nearest_floor() -> None:
    """Each nearest-splat entry: decode its column with the documented formula, lift the pixel
    with geometry.unproject_feature_to_bev, and find its cell row-major from the BEV convention."""
    rig = MULTI
    p = build_matrix(rig, MatrixOptions(splat="nearest", align=1))
    cam, d, v, u = _decode_frustum_col(rig, p.coo_col.astype(np.int64))
    depths = np.asarray(rig.depth.values())
    rows = []
    for c in range(rig.n_cam):
        m = cam == c
        uv = np.stack([u[m], v[m]], axis=-1).astype(np.float64)
        pts, ok = unproject_feature_to_bev(rig, rig.cameras[c], uv, depths[d[m]])
        assert ok.all()
        ix = np.floor((pts[:, 0] - rig.bev.x.min) / rig.bev.x.step)
        iy = np.floor((pts[:, 1] - rig.bev.y.min) / rig.bev.y.step)
        rows.append((iy * rig.bev.nx + ix).astype(np.int64))
        z = pts[:, 2]
        assert np.all((z >= rig.bev.z.min) & (z < rig.bev.z.max))
    got = np.concatenate(rows)
    order = np.argsort(np.argsort(cam, kind="stable"), kind="stable")
    assert np.array_equal(got[order], p.coo_row.astype(np.int64))
    assert np.all(p.coo_val == 1.0)


def test_convention_bilinear_weights_are_relative_to_cell_centres() -> None:
    """Bilinear: the point's weight in cell (iy, ix) is (1 - |x - cx| / dx)(1 - |y - cy| / dy)
    with cx = x_min + (ix + 0.5) dx (the BEV cell-centre convention)."""
    rig = SMALL
    p = build_matrix(rig, MatrixOptions(splat="bilinear", align=1))
    col = p.coo_col.astype(np.int64)
    cam, d, v, u = _decode_frustum_col(rig, col)
    depths = np.asarray(rig.depth.values())
    pts = np.zeros((col.size, 3))
    for c in range(rig.n_cam):
        m = cam == c
        pts[m], _ = unproject_feature_to_bev(rig, rig.cameras[c], np.stack([u[m], v[m]], -1).astype(float), depths[d[m]])
    iy, ix = np.divmod(p.coo_row.astype(np.int64), rig.bev.nx)
    cx = rig.bev.x.min + (ix + 0.5) * rig.bev.x.step
    cy = rig.bev.y.min + (iy + 0.5) * rig.bev.y.step
    want = (1 - np.abs(pts[:, 0] - cx) / rig.bev.x.step) * (1 - np.abs(pts[:, 1] - cy) / rig.bev.y.step)
    np.testing.assert_allclose(p.coo_val, want, rtol=0, atol=1e-6)
    # interior points split their whole unit weight: per column the weights sum to <= 1 (== 1 inside)
    per_col = np.bincount(np.unique(col, return_inverse=True)[1], weights=p.coo_val.astype(np.float64))
    assert per_col.max() <= 1 + 1e-6 and np.median(per_col) == pytest.approx(1.0, abs=1e-6)


def test_convention_trunc_rounding_adds_the_minus_one_band_to_cell_zero() -> None:
    """trunc (BEVDet .long()) keeps exactly the floor entries plus points whose cell coordinate
    is in (-1, 0) on some axis (x, y or the z band), mapped to index 0 on that axis."""
    rig = SMALL
    floor = build_matrix(rig, MatrixOptions(splat="nearest", rounding="floor", align=1))
    trunc = build_matrix(rig, MatrixOptions(splat="nearest", rounding="trunc", align=1))
    key_f = set(zip(floor.coo_row.tolist(), floor.coo_col.tolist(), strict=True))
    key_t = set(zip(trunc.coo_row.tolist(), trunc.coo_col.tolist(), strict=True))
    assert key_f < key_t
    extra = np.array(sorted(key_t - key_f))
    cam, d, v, u = _decode_frustum_col(rig, extra[:, 1])
    depths = np.asarray(rig.depth.values())
    bev = rig.bev
    for (row, _col), c, di, vi, ui in zip(extra, cam, d, v, u, strict=True):
        pt, _ = unproject_feature_to_bev(rig, rig.cameras[c], np.array([ui, vi], float), depths[di])
        f = (pt - np.array([bev.x.min, bev.y.min, bev.z.min])) / np.array([bev.x.step, bev.y.step, bev.z.step])
        assert np.any((f > -1) & (f < 0))
        assert np.all(f > -1)
        iy, ix = divmod(int(row), bev.nx)
        assert (ix, iy) == (int(np.trunc(f[0])), int(np.trunc(f[1])))


def test_convention_grid_columns_and_weights_match_torch_grid_sample_on_stored_norm(tmp_path: Path) -> None:
    """--mode grid --topk 0 --normalize sum: W @ feats == sum over cameras and heights of torch
    grid_sample on the stored grid/norm (float32, so ~1e-6), and on float64 norm (1e-6 -> 1e-7)."""
    rig = MULTI
    store = run_grid(rig, tmp_path).store
    norm32 = open_store(store).read("grid", "norm")
    feats, _ = _features(rig, channels=4)
    for splat in ("bilinear", "nearest"):
        p = build_matrix(rig, MatrixOptions(mode="grid", splat=splat, align=1))
        got = _apply(rig, p, feats, None)
        mode = "bilinear" if splat == "bilinear" else "nearest"
        want = np.zeros_like(got)
        for cam in range(rig.n_cam):
            for h in range(len(rig.bev.heights)):
                grid = torch.from_numpy(norm32[cam, h][None].astype(np.float64))
                want += F.grid_sample(torch.from_numpy(feats[cam][None]).double(), grid, mode=mode, padding_mode="zeros", align_corners=False)[0].numpy()
        assert np.abs(got - want).max() < 2e-5, splat
    # float64 geometry: only float32 weight rounding remains
    from bevcompile.grid.ipm import compute_sampling_grid, feature_px_to_norm

    norm64 = feature_px_to_norm(compute_sampling_grid(rig).coords_feature_px, rig.feature_size, align_corners=False)
    p = build_matrix(rig, MatrixOptions(mode="grid", align=1))
    got = _apply(rig, p, feats, None)
    want = sum(
        F.grid_sample(torch.from_numpy(feats[c][None]).double(), torch.from_numpy(norm64[c, h][None]), align_corners=False)[0].numpy()
        for c in range(rig.n_cam)
        for h in range(len(rig.bev.heights))
    )
    assert np.abs(got - want).max() < 1e-6


def test_convention_frustum_points_equal_geometry_unprojection() -> None:
    """The canonical elementwise point formula t + d * (R @ ray) is the geometry module's lift."""
    for rig in (NUSCENES, MULTI, LINSPACE):
        depths = np.asarray(rig.depth.values())
        w_f, h_f = rig.feature_size
        v, u = np.meshgrid(np.arange(h_f), np.arange(w_f), indexing="ij")
        uv = np.stack([u.ravel(), v.ravel()], -1).astype(float)
        for c, camera in enumerate(rig.cameras):
            rays = camera_rays(rig, c)
            pts = rays.origin_bev[:, None, None] + depths[None, :, None] * rays.ray_bev[:, None, :]  # (3, D, P)
            uv_all = np.broadcast_to(uv[rays.pixel_index][None], (depths.size, rays.pixel_index.size, 2))
            want, ok = unproject_feature_to_bev(rig, camera, uv_all, depths[:, None])
            assert ok.all()
            np.testing.assert_allclose(np.moveaxis(pts, 0, -1), want, rtol=0, atol=1e-9)
            assert np.allclose(rays.origin_bev, ego_from_cam_matrix(camera)[:3, 3])


def test_convention_ell_padding_kpad_and_mean_rows() -> None:
    p = build_matrix(SMALL, MatrixOptions(topk=5, align=4, normalize="mean"))
    assert (p.k_pad, p.rows_pad % 4, p.cols_pad % 4) == (8, 0, 0)
    nnz = np.bincount(p.coo_row, minlength=p.rows_pad)
    for r in range(p.rows_pad):
        n = nnz[r]
        pad_index = p.ell_index[r, n:]
        assert np.all(p.ell_weight[r, n:] == 0)
        assert np.all(pad_index == (p.ell_index[r, 0] if n else 0))
    sums = np.bincount(p.coo_row, weights=p.coo_val.astype(float), minlength=p.n_rows)[nnz[: p.n_rows] > 0]
    assert np.abs(sums - 1).max() < 1e-6
    # K = 0: k_pad from the widest row
    p0 = build_matrix(SMALL, MatrixOptions(topk=0, align=16))
    assert p0.k_pad == -(-p0.figures.row_nnz_max // 16) * 16


def test_convention_camera_mass_is_the_per_camera_row_sum() -> None:
    p = build_matrix(MULTI, MatrixOptions(topk=6, align=8, normalize="mean", compact_rows=True))
    dense = coo_to_dense(p.coo_row, p.coo_col, p.coo_val, (p.n_rows, p.n_cols)).astype(np.float64)
    per_cam = dense.reshape(p.n_rows, MULTI.n_cam, -1).sum(axis=2)  # (rows, cam)
    full = np.zeros((MULTI.n_cam, p.n_cells))
    full[:, p.row_ids] = per_cam.T
    np.testing.assert_allclose(p.camera_mass.reshape(MULTI.n_cam, -1), full, atol=1e-6)
    # mean normalisation: cameras share each non-empty cell's unit mass
    total = p.camera_mass.sum(axis=0).ravel()
    assert np.allclose(total[p.row_ids], 1.0, atol=1e-5) and np.all(np.delete(total, p.row_ids) == 0)


# --------------------------------------------------------------------------------------
# exactness of the streamed build
# --------------------------------------------------------------------------------------

EXACT_CASES = [
    (rig_name, mode, splat, rounding, k)
    for rig_name, mode, splat, rounding, k in itertools.product(
        ("small", "multi", "linspace"), ("frustum", "grid"), ("bilinear", "nearest"), ("floor", "trunc"), (0, 1, 3, 8)
    )
    if not (mode == "grid" and rounding == "trunc")
]
RIG_BY_NAME = {"small": SMALL, "multi": MULTI, "linspace": LINSPACE}


@pytest.mark.parametrize(("rig_name", "mode", "splat", "rounding", "k"), EXACT_CASES)
def test_streamed_build_equals_straightforward_reference(rig_name: str, mode: str, splat: str, rounding: str, k: int) -> None:
    rig = RIG_BY_NAME[rig_name]
    options = MatrixOptions(mode=mode, splat=splat, rounding=rounding, topk=k, normalize="mean" if k % 2 else "sum", align=1)
    p = build_matrix(rig, options)
    ref = reference_matrix(rig, options)
    assert np.array_equal(p.coo_row, ref.row)
    assert np.array_equal(p.coo_col, ref.col)
    assert np.array_equal(p.coo_val, ref.value.astype(np.float32))
    has = ref.total_mass > 0
    kept = np.bincount(ref.row, weights=ref.weight, minlength=has.size)
    assert p.figures.kept_weight_fraction_total == pytest.approx(kept[has].sum() / ref.total_mass[has].sum(), rel=1e-9)
    assert p.figures.kept_weight_fraction_worst_row == pytest.approx((kept[has] / ref.total_mass[has]).min(), rel=1e-9)


def test_streamed_build_equals_reference_on_nuscenes_with_tiny_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Real calibration; many blocks, each counted into its own local histogram (streaming machinery exercised)."""
    monkeypatch.setattr(entries_mod, "CHUNK_POINTS", 997)
    for splat in ("bilinear", "nearest"):
        options = MatrixOptions(topk=7, splat=splat, rounding="trunc", align=1)
        p = build_matrix(NUSCENES, options)
        ref = reference_matrix(NUSCENES, options)
        assert np.array_equal(p.coo_row, ref.row) and np.array_equal(p.coo_col, ref.col)
        assert np.array_equal(p.coo_val, ref.value.astype(np.float32))
        # the histogram pass leaves few candidates besides the kept entries (measured: 1.12x and 1.10x)
        assert p.figures.nnz <= p.figures.n_candidates <= 1.25 * p.figures.nnz < ref.n_entries


def test_culling_keeps_every_in_range_point_for_a_tight_box() -> None:
    """BEV box much smaller than what the cameras see: most rays leave it early and are culled;
    the in-range point count and every entry still equal the reference (which never culls)."""
    data = small_rig_data(distortion=True, bev_half_m=3.0, bev_step_m=0.25, depth_bins=(0.5, 12.0, 0.25))
    data["bev"]["z"] = [-0.3, 0.2]
    rig = parse_config(data)
    for splat, rounding in itertools.product(("bilinear", "nearest"), ("floor", "trunc")):
        options = MatrixOptions(topk=4, splat=splat, rounding=rounding, align=1)
        p = build_matrix(rig, options)
        ref = reference_matrix(rig, options)
        assert np.array_equal(p.coo_col, ref.col) and np.array_equal(p.coo_row, ref.row)
        in_range = reference_frustum_entries(rig, "nearest", rounding).row.size
        assert p.figures.n_points_in_range == in_range > 0
        assert in_range < 0.2 * p.figures.n_points


def test_build_is_deterministic_bytes() -> None:
    options = MatrixOptions(topk=6, align=8, tile_rows=32, quantize="int8", compact_rows=True)
    a = build_matrix(MULTI, options).arrays()
    b = build_matrix(MULTI, options).arrays()
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].tobytes() == b[name].tobytes(), name


def _assert_equal_to_reference(rig: RigConfig, options: MatrixOptions, p: matrix_mod.MatrixProducts) -> None:
    ref = reference_matrix(rig, options)
    assert np.array_equal(p.coo_row, ref.row) and np.array_equal(p.coo_col, ref.col)
    assert np.array_equal(p.coo_val, ref.value.astype(np.float32))


@pytest.mark.parametrize(("splat", "rounding"), [("bilinear", "floor"), ("bilinear", "trunc"), ("nearest", "floor"), ("nearest", "trunc")])
@pytest.mark.parametrize("k", [1, 3, 8, 24])
def test_streamed_build_equals_reference_on_a_tie_heavy_ring(splat: str, rounding: str, k: int) -> None:
    """Identical level cameras on a ring: all of the rig's entries tie exactly in groups of up to
    16 (a pixel column at one depth), so the rule's last key, the column, decides every cut."""
    options = MatrixOptions(topk=k, splat=splat, rounding=rounding, align=1, normalize="mean" if k % 2 else "sum")
    _assert_equal_to_reference(RING, options, build_matrix(RING, options))


def test_the_ring_is_tie_heavy_and_tie_groups_only_drop_entries_k_others_beat(monkeypatch: pytest.MonkeyPatch) -> None:
    e = reference_frustum_entries(RING, "bilinear", "floor")
    _, counts = np.unique(np.stack([e.row.astype(np.float64), e.weight, e.dist2], axis=1), axis=0, return_counts=True)
    assert counts[counts > 1].sum() == e.row.size and counts.max() == 16  # every entry in an exact tie
    options = MatrixOptions(topk=3, align=1)
    with_groups = build_matrix(RING, options)
    monkeypatch.setattr(entries_mod, "_tie_groups", lambda *args: None)
    without = build_matrix(RING, options)
    for p in (with_groups, without):
        _assert_equal_to_reference(RING, options, p)
    # measured: 1,812 vs 8,070 candidates (nnz 1,722): the 64-bin histogram cannot split exact ties
    assert with_groups.figures.n_candidates <= 1.1 * with_groups.figures.nnz < 0.3 * without.figures.n_candidates


@pytest.mark.parametrize("rig_name", ["ring", "nuscenes"])
def test_compactions_keep_the_build_exact_and_each_sort_bounded(monkeypatch: pytest.MonkeyPatch, rig_name: str) -> None:
    """A candidate budget far below what the histogram filter passes: the buffer compacts to its
    exact Top-K many times; the result is still the reference's and no exact sort sees more than
    the budget (or twice rows x K) plus one block."""
    rig = {"ring": RING, "nuscenes": NUSCENES}[rig_name]
    monkeypatch.setattr(topk_mod, "CANDIDATE_BUDGET_PER_SLOT", 0)
    monkeypatch.setattr(topk_mod, "CANDIDATE_BUDGET_MIN", 500)
    monkeypatch.setattr(entries_mod, "CHUNK_POINTS", 2000)
    for splat in ("bilinear", "nearest"):
        options = MatrixOptions(topk=4, splat=splat, align=1)
        p = build_matrix(rig, options)
        _assert_equal_to_reference(rig, options, p)
        selection = p.extra["selection"]
        n_cells = rig.bev.nx * rig.bev.ny
        assert selection["compactions"] >= 2
        assert selection["largest_sort"] <= max(500, 2 * n_cells * 4) + 4 * 2 * 2000  # 4 corners of a block's points (2 depth bins at most)


def _store_bytes(p: matrix_mod.MatrixProducts, rig: RigConfig) -> tuple[dict[str, bytes], str]:
    import json

    attrs = json.dumps(matrix_mod.matrix_attributes(p, rig), sort_keys=True, allow_nan=False)
    return {name: a.tobytes() for name, a in p.arrays().items()}, attrs


@pytest.mark.parametrize(
    "options",
    [
        MatrixOptions(topk=5, align=8, tile_rows=16, quantize="int8"),
        MatrixOptions(topk=3, splat="nearest", rounding="trunc", compact_rows=True, normalize="mean"),
        MatrixOptions(topk=0, align=4),
        MatrixOptions(topk=0, splat="nearest"),
        MatrixOptions(mode="grid", topk=4, splat="bilinear"),
    ],
    ids=["bilinear-k5-int8", "nearest-trunc-k3", "bilinear-k0", "nearest-k0", "grid-k4"],
)
def test_every_jobs_count_writes_the_same_bytes(monkeypatch: pytest.MonkeyPatch, options: MatrixOptions) -> None:
    """Arrays and attributes (kept-weight fractions and candidate counts included) for jobs 1 to
    5, with many blocks, the final sort split over threads and compactions forced."""
    monkeypatch.setattr(entries_mod, "CHUNK_POINTS", 1500)
    monkeypatch.setattr(topk_mod, "SELECT_SPLIT_MIN", 1)
    monkeypatch.setattr(topk_mod, "CANDIDATE_BUDGET_MIN", 3000)
    for rig in (MULTI, RING):
        want = _store_bytes(build_matrix(rig, options, jobs=1), rig)
        for jobs in (2, 3, 5):
            assert _store_bytes(build_matrix(rig, options, jobs=jobs), rig) == want, (rig.name, jobs)


@pytest.mark.parametrize("options", [MatrixOptions(topk=24), MatrixOptions(topk=0, splat="nearest"), MatrixOptions(topk=0)], ids=["k24", "nearest-k0", "k0"])
def test_cutting_blocks_into_pieces_changes_no_bit(monkeypatch: pytest.MonkeyPatch, options: MatrixOptions) -> None:
    """A depth bin with more live rays than PIECE_POINTS is computed in ray ranges; the row masses
    continue in point order across pieces (np.add.at), so every array and attribute (the
    kept-weight fractions are sums of them) is the same as with whole blocks."""
    monkeypatch.setattr(entries_mod, "CHUNK_POINTS", 300)  # blocks of one depth bin (704 live rays)
    want = _store_bytes(build_matrix(NUSCENES, options, jobs=1), NUSCENES)
    monkeypatch.setattr(entries_mod, "PIECE_POINTS", 97)
    assert len(entries_mod.block_pieces(entries_mod.plan_blocks(NUSCENES.depth.n_bins, entries_mod.FrustumStream(
        NUSCENES, splat="bilinear", rounding="floor", k=1).plans)[0])) > 3
    assert _store_bytes(build_matrix(NUSCENES, options, jobs=2), NUSCENES) == want


def test_shipped_ring_config_is_the_regular_rig_of_the_benchmark() -> None:
    """configs/ring-6cam.yaml: six identical level pinholes on a 1 m ring, dense-6cam's network;
    each camera's 640 pixel columns are tie groups of 360 rays."""
    from bevcompile.rig.config import load_config

    rig = load_config(ROOT / "configs" / "ring-6cam.yaml")
    dense = load_config(ROOT / "configs" / "dense-6cam.yaml")
    assert rig.n_cam == 6 and len({(c.intrinsic, c.image_width, c.image_height, c.distortion) for c in rig.cameras}) == 1
    assert (rig.feature_size, rig.depth.values(), rig.bev) == (dense.feature_size, dense.depth.values(), dense.bev)
    bev = entries_mod.BevBox.of(rig)
    depths = np.asarray(rig.depth.values())
    plan = entries_mod.plan_camera(bev, False, 1, camera_rays(rig, 1), depths)
    ties = entries_mod._tie_groups(plan, 24, rig.depth.n_bins)
    assert ties is not None and (ties.n_groups, ties.max_size) == rig.feature_size


# --------------------------------------------------------------------------------------
# Top-K properties
# --------------------------------------------------------------------------------------


def _brute_force_topk(entries: Entries, k: int) -> set[tuple[int, int]]:
    rows: dict[int, list[tuple[float, float, int]]] = {}
    for r, c, w, d in zip(entries.row.tolist(), entries.col.tolist(), entries.weight.tolist(), entries.dist2.tolist(), strict=True):
        rows.setdefault(r, []).append((-w, d, c))
    kept = set()
    for r, items in rows.items():
        for _w, _d, c in sorted(items)[: k if k > 0 else None]:
            kept.add((r, c))
    return kept


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(0, 200),
    k=st.integers(0, 6),
    weight_levels=st.integers(1, 4),
    dist_levels=st.integers(1, 3),
    seed=st.integers(0, 2**31 - 1),
)
def test_select_topk_matches_brute_force_with_ties(n: int, k: int, weight_levels: int, dist_levels: int, seed: int) -> None:
    """Few distinct weights and distances force ties; the rule is weight desc, dist2 asc, col asc."""
    rng = np.random.default_rng(seed)
    rows = rng.integers(0, 5, n)
    cols = rng.permutation(n * 3)[:n]  # distinct columns: (row, col) distinct
    weights = rng.integers(1, weight_levels + 1, n) / weight_levels
    dists = rng.integers(0, dist_levels, n).astype(float)
    entries = Entries(rows.astype(np.int64), cols.astype(np.int64), weights, dists)
    kept = select_topk(entries, k)
    assert set(zip(kept.row.tolist(), kept.col.tolist(), strict=True)) == _brute_force_topk(entries, k)
    assert np.all(np.diff(kept.row * (3 * n + 1) + kept.col) > 0)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(k=st.integers(1, 30), splat=st.sampled_from(["bilinear", "nearest"]), mode=st.sampled_from(["frustum", "grid"]))
def test_topk_properties_row_nnz_kept_ge_dropped_deterministic(k: int, splat: str, mode: str) -> None:
    rig = MULTI
    options = MatrixOptions(mode=mode, splat=splat, topk=k, align=1)
    p = build_matrix(rig, options)
    nnz = np.bincount(p.coo_row, minlength=p.n_rows)
    assert nnz.max() <= k
    # kept raw weights >= every dropped raw weight of the same row (raw = normalize sum)
    everything = reference_matrix(rig, MatrixOptions(mode=mode, splat=splat, topk=0, align=1))
    kept_keys = p.coo_row.astype(np.int64) * p.n_cols + p.coo_col
    all_keys = everything.row * p.n_cols + everything.col
    dropped = ~np.isin(all_keys, kept_keys)
    min_kept = np.full(p.n_rows, np.inf)
    np.minimum.at(min_kept, p.coo_row.astype(np.int64), p.coo_val.astype(np.float64))
    max_dropped = np.full(p.n_rows, -np.inf)
    np.maximum.at(max_dropped, everything.row[dropped], everything.value[dropped])
    assert np.all(min_kept >= max_dropped.astype(np.float32))
    # rows with fewer than K entries keep all of them
    total = np.bincount(everything.row, minlength=p.n_rows)
    assert np.array_equal(nnz, np.minimum(total, k))
    again = build_matrix(rig, options)
    assert np.array_equal(again.coo_col, p.coo_col) and np.array_equal(again.coo_val, p.coo_val)


# --------------------------------------------------------------------------------------
# equivalences: BEVDet voxel pooling
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("rig_name", ["nuscenes", "multi"])
@pytest.mark.parametrize(("splat", "rounding", "normalize"), [("nearest", "floor", "sum"), ("nearest", "trunc", "sum"), ("bilinear", "floor", "sum"), ("nearest", "floor", "mean")])
def test_topk0_matrix_equals_bevdet_voxel_pooling(rig_name: str, splat: str, rounding: str, normalize: str) -> None:
    """--topk 0: W @ (depth x feat) == BEVDet-style voxel pooling (points from
    geometry.unproject_feature_to_bev, np.add.at scatter) up to float rounding."""
    rig = NUSCENES if rig_name == "nuscenes" else MULTI
    feats, depth = _features(rig, channels=3, seed=1)
    p = build_matrix(rig, MatrixOptions(splat=splat, rounding=rounding, normalize=normalize, align=1))
    got = _apply(rig, p, feats, depth)
    want = bev_pool(rig, feats, depth, splat=splat, rounding=rounding, normalize=normalize).sum(axis=0)
    scale = np.abs(want).max()
    assert scale > 0
    tol = 1e-12 if (splat, normalize) == ("nearest", "sum") else 1e-6  # nearest+sum: weights are exactly 1.0
    assert np.abs(got - want).max() <= tol * scale


def test_topk0_nearest_trunc_equals_bevdet_bev_pool_written_in_torch() -> None:
    """Independent BEVDet get_lidar_coor + bev_pool (voxel = ((p - (bx - dx/2)) / dx).long(),
    scatter of depth * feat), in torch float64, on the real nuScenes calibration."""
    rig = NUSCENES
    feats, depth = _features(rig, channels=2, seed=3)
    w_f, h_f = rig.feature_size
    s = rig.feature.stride
    depths = torch.tensor(rig.depth.values(), dtype=torch.float64)
    # frustum in input pixels (stride mapping: feature pixel j at input j*s + (s-1)/2)
    u_in = torch.arange(w_f, dtype=torch.float64) * s + (s - 1) / 2
    v_in = torch.arange(h_f, dtype=torch.float64) * s + (s - 1) / 2
    dd, vv, uu = torch.meshgrid(depths, v_in, u_in, indexing="ij")
    frustum = torch.stack([uu, vv, dd], -1)  # (D, H, W, 3)
    bev = rig.bev
    dx = torch.tensor([bev.x.step, bev.y.step, bev.z.step], dtype=torch.float64)
    bx = torch.tensor([bev.x.min, bev.y.min, bev.z.min], dtype=torch.float64) + dx / 2
    nx = torch.tensor([bev.x.n, bev.y.n, bev.z.n])
    out = torch.zeros(2, bev.ny * bev.nx, dtype=torch.float64)
    for c, camera in enumerate(rig.cameras):
        aug = camera.image_aug
        post_rot = torch.diag(torch.tensor([aug.resize, aug.resize, 1.0], dtype=torch.float64))
        post_tran = torch.tensor([-aug.crop_left, -aug.crop_top, 0.0], dtype=torch.float64)
        points = torch.linalg.inv(post_rot).matmul((frustum - post_tran).unsqueeze(-1))
        points = torch.cat([points[..., :2, :] * points[..., 2:3, :], points[..., 2:3, :]], -2)
        ego_from_cam = torch.tensor(camera.ego_from_cam, dtype=torch.float64)
        intrins = torch.tensor(camera.intrinsic, dtype=torch.float64)
        combine = ego_from_cam[:3, :3].matmul(torch.linalg.inv(intrins))
        points = combine.matmul(points).squeeze(-1) + ego_from_cam[:3, 3]
        voxel = ((points - (bx - dx / 2.0)) / dx).long()
        kept = (voxel >= 0).all(-1) & (voxel < nx).all(-1)
        lifted = torch.from_numpy(depth[c]).double().unsqueeze(0) * torch.from_numpy(feats[c]).double().unsqueeze(1)  # (C, D, H, W)
        cell = voxel[..., 1] * bev.nx + voxel[..., 0]
        out.index_add_(1, cell[kept], lifted[:, kept])
    p = build_matrix(rig, MatrixOptions(splat="nearest", rounding="trunc", align=1))
    got = _apply(rig, p, feats, depth).reshape(2, -1)
    want = out.numpy()
    assert np.abs(got - want).max() <= 1e-12 * np.abs(want).max()


# --------------------------------------------------------------------------------------
# layouts: ELL, tiles, int8, compact rows
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [
        MatrixOptions(topk=5, align=8, tile_rows=16, quantize="int8"),
        MatrixOptions(mode="grid", topk=0, align=4, tile_rows=7, quantize="int8", compact_rows=True),
        MatrixOptions(topk=0, splat="nearest", align=1, tile_rows=100, compact_rows=True, normalize="mean"),
    ],
)
def test_ell_tiles_coo_reconstruct_the_same_dense_matrix(options: MatrixOptions) -> None:
    rig = MULTI
    p = build_matrix(rig, options)
    dense = p.dense()
    # ELL (padding included)
    ell = np.zeros((p.rows_pad, p.n_cols), dtype=np.float32)
    np.add.at(ell, (np.repeat(np.arange(p.rows_pad), p.k_pad), p.ell_index.ravel()), p.ell_weight.ravel())
    assert np.array_equal(ell[: p.n_rows], dense) and not ell[p.n_rows :].any()
    assert p.ell_index.min() >= 0 and p.ell_index.max() < p.n_cols
    assert p.rows_pad % options.align == 0 and p.cols_pad % options.align == 0 and p.k_pad % options.align == 0
    # tiles
    assert p.tile_cols is not None and p.tile_col_offsets is not None and p.tile_weight is not None
    r = options.tile_rows or 1
    tiles = np.zeros((p.n_tiles * r, p.n_cols), dtype=np.float32)
    for t, block in enumerate(tile_blocks(p.tile_weight, p.tile_col_offsets, r)):
        cols = p.tile_cols[p.tile_col_offsets[t] : p.tile_col_offsets[t + 1]]
        assert np.all(np.diff(cols) >= 0) and cols.size % options.align == 0 and cols.size >= options.align
        np.add.at(tiles[t * r : (t + 1) * r], (slice(None), cols), block)
    assert np.array_equal(tiles[: p.n_rows], dense) and not tiles[p.n_rows :].any()
    assert p.tile_cols.min() >= 0 and p.tile_cols.max() < p.n_cols
    assert p.figures.tile_bytes == p.tile_weight.nbytes + p.tile_cols.nbytes + p.tile_col_offsets.nbytes
    # compact rows
    if options.compact_rows:
        assert p.row_ids is not None and np.all(np.diff(p.row_ids) > 0)
        assert np.all(np.bincount(p.coo_row, minlength=p.n_rows) > 0)
        full = build_matrix(rig, MatrixOptions(**{**options.to_dict(), "compact_rows": False}))
        assert np.array_equal(p.row_ids[p.coo_row], full.coo_row) and np.array_equal(p.coo_val, full.coo_val)


def test_int8_dequantises_within_its_recorded_bound() -> None:
    p = build_matrix(NUSCENES, MatrixOptions(topk=24, align=16, tile_rows=512, quantize="int8"))
    assert p.ell_weight_int8 is not None and p.row_scale is not None
    deq = dequantize_rows_int8(p.ell_weight_int8, p.row_scale).astype(np.float64)
    peak = np.abs(p.ell_weight).max(axis=1).astype(np.float64)
    rel = np.abs(deq - p.ell_weight) / np.where(peak > 0, peak, 1)[:, None]
    assert p.figures.int8_max_rel_error is not None
    assert rel.max() <= p.figures.int8_max_rel_error <= 0.5 / 127 * 1.001
    assert np.abs(p.ell_weight_int8).max() == 127
    assert p.tile_row_scale is not None and np.array_equal(p.tile_row_scale[: p.rows_pad], p.row_scale)
    # tiles hold the same int8 values as the ELL rows
    assert p.tile_weight_int8 is not None and p.tile_col_offsets is not None and p.tile_cols is not None
    n = 0
    for t, block in enumerate(tile_blocks(p.tile_weight_int8, p.tile_col_offsets, 512)):
        n += int(np.count_nonzero(block))
        assert block.shape[0] == 512 and t < p.n_tiles
    assert n == int(np.count_nonzero(p.ell_weight_int8))


@settings(max_examples=50, deadline=None)
@given(
    st.lists(st.floats(0, 2.0**-100, allow_nan=False, allow_subnormal=True, width=32), min_size=1, max_size=40),
    st.integers(1, 5),
)
def test_int8_tiny_rows_never_vanish(values: list[float], n_rows: int) -> None:
    """Subnormal-range rows: the float32 scale cannot be 0 for a non-zero row, the peak never clips,
    and every value decodes within half a step (absolute)."""
    w = np.resize(np.asarray(values, dtype=np.float32), (n_rows, len(values)))
    q, scale = quantize_rows_int8(w)
    deq = dequantize_rows_int8(q, scale).astype(np.float64)
    nonzero = np.abs(w).max(axis=1) > 0
    assert np.all(scale[nonzero] > 0)
    assert np.all(np.abs(deq - w) <= scale.astype(np.float64)[:, None] / 2 * (1 + 1e-6) + 1e-300)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(2.0**-100, 1e3, allow_nan=False, width=32) | st.just(0.0), min_size=1, max_size=40), st.integers(1, 5))
def test_int8_round_trip_property(values: list[float], n_rows: int) -> None:
    w = np.resize(np.asarray(values, dtype=np.float32), (n_rows, len(values)))
    w[0] = 0.0  # an all-zero row quantises to 0 with scale 0
    q, scale = quantize_rows_int8(w)
    deq = dequantize_rows_int8(q, scale)
    peak = np.abs(w).max(axis=1)
    assert scale[0] == 0 and not q[0].any()
    err = np.abs(deq.astype(np.float64) - w) / np.where(peak > 0, peak, 1)[:, None]
    assert err.max() <= 0.5 / 127 * 1.001


# --------------------------------------------------------------------------------------
# options
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"mode": "voxel"}, "--mode must be one of frustum, grid"),
        ({"topk": -1}, "--topk must be an integer >= 0"),
        ({"align": 0}, r"--align must be an integer in \[1, 65536\]"),
        ({"splat": "cubic"}, "--splat must be one of nearest, bilinear"),
        ({"normalize": "max"}, "--normalize must be one of sum, mean"),
        ({"tile_rows": 0}, "--tile-rows must be an integer >= 1"),
        ({"quantize": "int4"}, "--quantize must be one of none, int8"),
        ({"rounding": "round"}, "--rounding must be one of floor, trunc"),
    ],
)
def test_invalid_options_raise_one_line_usage_error(changes: dict[str, object], message: str) -> None:
    with pytest.raises(UsageError, match=message):
        build_matrix(SMALL, MatrixOptions(**changes))  # type: ignore[arg-type]


def test_options_round_trip_and_unknown_keys() -> None:
    o = MatrixOptions(mode="frustum", topk=3, tile_rows=9, quantize="int8", compact_rows=True, rounding="trunc", splat="nearest")
    assert MatrixOptions.from_dict(o.to_dict()) == o
    with pytest.raises(UsageError, match="unknown matrix build option"):
        MatrixOptions.from_dict({**o.to_dict(), "workers": 2})


def test_progress_reports_every_work_unit() -> None:
    seen: list[int] = []
    for options in (MatrixOptions(topk=4), MatrixOptions(topk=0), MatrixOptions(mode="grid")):
        seen.clear()
        build_matrix(MULTI, options, progress=seen.append)
        assert sum(seen) == matrix_mod.matrix_work_units(MULTI, options) and len(seen) > 1


def test_progress_phases_name_each_pass_the_select_and_the_write(tmp_path: Path) -> None:
    """A progress with ``phase`` (the CLI's bar) sees pass 2, the Top-K select, the layout and the
    write as phases of their own, each pass counting exactly ``matrix_pass_units`` points."""
    events: list[tuple[str, int | None]] = []
    counted = [0]

    class Recorder:
        def __call__(self, n: int) -> None:
            counted[0] += n

        def phase(self, label: str, total: int | None, unit: str) -> None:
            events.append((label, total))
            assert counted[0] == (matrix_mod.matrix_pass_units(MULTI, options) if label.startswith("pass 2/2") else counted[0])
            counted[0] = 0

    options = MatrixOptions(topk=4)
    matrix_mod.run_matrix(MULTI, tmp_path, options, progress=Recorder())
    labels = [label for label, _total in events]
    assert labels[0] == "pass 2/2: collecting Top-K candidates" and events[0][1] == matrix_mod.matrix_pass_units(MULTI, options)
    assert labels[1].startswith("selecting the top 4 of ") and labels[1].endswith(" candidates")
    assert labels[2:] == ["laying out COO / ELL / tiles", f"writing {MULTI.name}.zarr"]


def test_rig_that_sees_nothing_gives_empty_but_valid_products(tmp_path: Path) -> None:
    data = small_rig_data()
    data["bev"]["x"] = [500.0, 510.0, 1.0]  # 500 m ahead: no frustum point reaches it
    rig = parse_config(data)
    for options in (MatrixOptions(topk=3, tile_rows=4, quantize="int8", compact_rows=True), MatrixOptions(splat="nearest", tile_rows=4)):
        p = build_matrix(rig, options)
        assert p.figures.nnz == 0 and p.figures.n_points_in_range == 0
        assert not p.ell_weight.any() and p.ell_index.shape == (p.rows_pad, p.k_pad) and p.k_pad == 16
        assert p.figures.kept_weight_fraction_total == 1.0 and p.figures.worst_row_cell == -1
        assert not p.camera_mass.any()
        result = matrix_mod.run_matrix(rig, tmp_path, options, force=True)
        assert open_store(result.store).read("matrix", "coo_val").size == 0


def test_written_group_is_deterministic(tmp_path: Path) -> None:
    """Same config and options -> same array bytes (sha256) and same attributes."""
    options = MatrixOptions(topk=4, tile_rows=16, quantize="int8", normalize="mean")
    stores = [matrix_mod.run_matrix(SMALL, tmp_path / str(i), options).store for i in range(2)]
    readers = [open_store(s) for s in stores]
    assert readers[0].group_attrs("matrix") == readers[1].group_attrs("matrix")
    for name in readers[0].arrays("matrix"):
        assert readers[0].array_info("matrix", name).attrs["sha256"] == readers[1].array_info("matrix", name).attrs["sha256"]
    attrs = readers[0].group_attrs("matrix")
    assert attrs["build_options"] == options.to_dict()
    assert attrs["ell"]["k_pad"] == 16 and attrs["int8"]["max_rel_error"] <= 0.5 / 127 * 1.001
    assert attrs["column_formula"] == "col = ((cam * D + d) * H_f + v) * W_f + u"
    assert attrs["depth_bins"] == list(SMALL.depth.values())
    assert "build_seconds" not in str(attrs) and "peak_rss" not in str(attrs)


# --------------------------------------------------------------------------------------
# bounded memory (audit "matrix" findings 1-3): block paths and up-front refusals
# --------------------------------------------------------------------------------------


def _whole_array_int8(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray, float, float]:
    """The int8 rule on the whole array at once (the pre-blocking formulas), for comparison."""
    w64 = weight.astype(np.float64)
    peak = np.abs(w64).max(axis=1)
    scale = (peak / 127).astype(np.float32)
    s64 = scale.astype(np.float64)[:, None]
    q = np.clip(np.where(s64 > 0, np.rint(w64 / np.where(s64 > 0, s64, 1.0)), 0.0), -127, 127).astype(np.int8)
    err = np.abs((q.astype(np.float32) * scale[:, None]).astype(np.float64) - w64)
    rel = np.where(peak[:, None] > 0, err / np.where(peak[:, None] > 0, peak[:, None], 1.0), 0.0)
    return q, scale, float(rel.max()), float(err.max())


def test_int8_quantises_and_measures_in_bounded_row_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Finding 1: the float64 temporaries of the int8 path cover at most INT8_BLOCK_SLOTS slots
    at a time, and the blocked result is bit-identical to the whole-array formulas."""
    import bevcompile.matrix.layout as layout_mod

    monkeypatch.setattr(layout_mod, "INT8_BLOCK_SLOTS", 12)
    seen: list[tuple[int, int]] = []
    real_blocks = layout_mod._row_blocks

    def spy(n_rows: int, n_cols: int) -> Iterator[slice]:
        for rows in real_blocks(n_rows, n_cols):
            seen.append((rows.stop - rows.start, n_cols))
            yield rows

    monkeypatch.setattr(layout_mod, "_row_blocks", spy)
    rng = np.random.default_rng(3)
    weight = (rng.random((41, 5)) * rng.choice([0.0, 1e-3, 1.0, 7.0], size=(41, 1))).astype(np.float32)
    q, scale = quantize_rows_int8(weight)
    rel, absolute = layout_mod.int8_errors(weight, q, scale)
    want_q, want_scale, want_rel, want_abs = _whole_array_int8(weight)
    assert np.array_equal(q, want_q) and np.array_equal(scale, want_scale)
    assert (rel, absolute) == (want_rel, want_abs)
    assert len(seen) > 3 and all(r * c <= 12 for r, c in seen)


def test_int8_products_are_identical_with_tiny_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    options = MatrixOptions(topk=6, align=4, tile_rows=7, quantize="int8")
    default = build_matrix(MULTI, options)
    import bevcompile.matrix.layout as layout_mod

    monkeypatch.setattr(layout_mod, "INT8_BLOCK_SLOTS", 5)
    blocked = build_matrix(MULTI, options)
    for name, arr in default.arrays().items():
        assert arr.tobytes() == blocked.arrays()[name].tobytes(), name
    assert blocked.figures.int8_max_rel_error == default.figures.int8_max_rel_error
    assert blocked.figures.int8_max_abs_error == default.figures.int8_max_abs_error


@pytest.mark.parametrize("splat", ["nearest", "bilinear"])
@pytest.mark.parametrize("compact_rows", [False, True])
def test_topk0_oversize_ell_is_refused_before_the_entries_are_collected(
    monkeypatch: pytest.MonkeyPatch, splat: str, compact_rows: bool
) -> None:
    """Finding 2: with K = 0 the ELL row length is the max row nnz; a count-only pass finds it and
    the refusal (same message as the check after the build) comes before pass 2 collects entries."""
    import bevcompile.matrix.layout as layout_mod

    options = MatrixOptions(topk=0, align=1, splat=splat, compact_rows=compact_rows)
    full = build_matrix(SMALL, options)
    assert full.k_pad > 1
    monkeypatch.setattr(layout_mod, "MAX_PRODUCT_SLOTS", full.rows_pad * full.k_pad - 1)

    def no_pass_2(parts: list[Entries]) -> Entries:
        raise AssertionError("pass 2 collected the entries before the ELL was refused")

    monkeypatch.setattr(entries_mod.Entries, "concat", staticmethod(no_pass_2))
    want = (
        f"ELL ({full.rows_pad:,} rows_pad x {full.k_pad:,} k_pad) would hold {full.rows_pad * full.k_pad:,} slots"
    )
    with pytest.raises(UsageError, match="set --topk to bound the row length") as info:
        build_matrix(SMALL, options)
    assert str(info.value).startswith(want) and "\n" not in str(info.value)


def test_topk0_row_count_pass_allows_exactly_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    import bevcompile.matrix.layout as layout_mod

    options = MatrixOptions(topk=0, align=1, splat="bilinear")
    full = build_matrix(SMALL, options)
    monkeypatch.setattr(layout_mod, "MAX_PRODUCT_SLOTS", full.rows_pad * full.k_pad)
    again = build_matrix(SMALL, options)
    assert again.ell_weight.tobytes() == full.ell_weight.tobytes()


def test_frustum_build_too_big_for_this_machine_is_refused_up_front(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Finding 3: the per-cell arrays (Top-K histogram, row masses) scale with BEV cells, not
    points, even with --compact-rows: run_matrix refuses a grid this machine cannot hold, like
    check_grid_memory, before any work (one line)."""
    data = small_rig_data()
    data["bev"]["x"] = [-40.0, 40.0, 0.05]
    data["bev"]["y"] = [-40.0, 40.0, 0.05]
    rig = parse_config(data)
    options = MatrixOptions(topk=4, compact_rows=True)
    need = matrix_mod.FRUSTUM_BYTES_BASE + (1603 * 1603) * (24 * 8 + 8 * rig.n_cam + 40)  # 8 bins, padded grid
    monkeypatch.setattr(memory, "memory_limit", lambda: memory.MemoryLimit(need - 1, "available memory"))

    def no_build(*args: object, **kwargs: object) -> None:
        raise AssertionError("the build started")

    monkeypatch.setattr(matrix_mod, "build_matrix", no_build)
    with pytest.raises(UsageError, match=r"1600 x 1600 = 2,560,000 BEV cells needs about .* more than the .* available memory allows") as info:
        matrix_mod.run_matrix(rig, tmp_path, options)
    assert "\n" not in str(info.value) and not any(tmp_path.iterdir())
    monkeypatch.setattr(memory, "memory_limit", lambda: memory.MemoryLimit(need, "available memory"))
    matrix_mod.check_frustum_memory(rig, options)  # fits exactly
    matrix_mod.check_frustum_memory(rig, MatrixOptions(mode="grid"))  # grid mode: check_grid_memory's job


def test_options_from_the_command_values_any_case_and_none_quantize() -> None:
    """``MatrixOptions.from_command``: what ``bevcompile matrix`` and a fleet manifest's ``matrix:`` build with."""
    options = MatrixOptions.from_command(mode="FRUSTUM", topk=24, splat="Nearest", normalize="MEAN", quantize="None", rounding="Trunc")
    assert options == MatrixOptions(mode="frustum", topk=24, splat="nearest", normalize="mean", quantize=None, rounding="trunc")
    assert MatrixOptions.from_command(quantize="INT8").quantize == "int8"
    assert MatrixOptions.from_command() == MatrixOptions()
    with pytest.raises(UsageError, match="--quantize must be one of none, int8, fp16, mixed, got 'int4'"):
        MatrixOptions.from_command(quantize="int4")


@pytest.mark.parametrize("mode", ["frustum", "grid"])
def test_matrix_in_a_sensor_frame_equals_hand_made_cam_to_sensor_poses(mode: str) -> None:
    """``bev.frame: LIDAR_TOP`` (a yawed, raised sensor): the matrix is the one of the same rig
    with every camera given its cam -> sensor matrix by hand (numpy product) in the ego frame --
    same entries, weights to float32 rounding -- and differs from the ego-frame matrix."""
    data = rigs.small_rig_with_sensor_data(distortion=True, bev_half_m=20.0)
    options = MatrixOptions(mode=mode, topk=6, splat="bilinear", rounding="floor", align=1)
    framed = build_matrix(parse_config(rigs.in_lidar_frame(data)), options)
    handmade = build_matrix(parse_config(rigs.lidar_poses_as_ego(data)), options)
    assert framed.figures.nnz > 1000
    assert np.array_equal(framed.coo_row, handmade.coo_row) and np.array_equal(framed.coo_col, handmade.coo_col)
    np.testing.assert_allclose(framed.coo_val, handmade.coo_val, rtol=1e-6, atol=1e-7)
    ego = build_matrix(parse_config(data), options)
    assert ego.coo_row.size != framed.coo_row.size or not np.array_equal(ego.coo_col, framed.coo_col)
