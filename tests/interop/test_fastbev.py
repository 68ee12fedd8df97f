"""The Fast-BEV LUT in upstream's own float32 arithmetic, in Fast-BEV's voxel order, and per
feature level (Fast-BEV's multi-stride volumes)."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from bevcompile.errors import UsageError
from bevcompile.grid.build import run_grid
from bevcompile.interop.export import run_export_interop
from bevcompile.interop.fastbev import (
    FastBevOptions,
    build_fastbev_lut,
    fastbev_gather,
    fastbev_level_arrays,
    xyz_layout,
)
from bevcompile.rig.config import RigConfig, parse_config
from bevcompile.store.inspection import inspect_store
from bevcompile.store.loader import load
from bevcompile.store.verify import verify_store

from .. import damage, rigs, upstream

FASTBEV_M0 = {"n_voxels": [200, 200, 4], "voxel_size": [0.5, 0.5, 1.5], "point_cloud_range": [-50, -50, -5, 50, 50, 3]}
"""Fast-BEV M0's voxel grid (configs/fastbev/exp/paper/fastbev_m0_r18_s256x704_v200x200x4_c192_d2_f4.py)."""


def fastbev_m0_data() -> dict[str, Any]:
    """nuScenes written out by hand with Fast-BEV M0's test settings: lidar frame, 704x256 input
    (resize 0.44, CENTRED crop top 70), stride 4 with the intrinsics divided by the stride
    (corner), the voxel corners -50 + 0.5 i as cell centres, heights -4, -2.5, -1, 0.5 m."""
    data = rigs.in_lidar_frame(rigs.nuscenes_data())
    data["name"] = "fastbev-by-hand"
    data["image_aug"] = {"resize": 0.44, "crop": [0, 70], "input_size": [704, 256]}
    data["feature"] = {"stride": 4, "pixel_mapping": "corner"}
    data["bev"].update(x=[-50.25, 49.75, 0.5], y=[-50.25, 49.75, 0.5], z=[-4.75, 1.25, 1.5], heights=[-4.0, -2.5, -1.0, 0.5])
    return data


@functools.lru_cache(maxsize=4)
def fastbev_upstream_lut(stride: int = 4, crop_top: int = 70) -> np.ndarray:
    """Fast-BEV's torch code path on the nuScenes car (tests/upstream.py, its ``bmm`` in index
    order: :func:`test_fastbev_bmm_moves_only_voxels_on_a_rounding_edge`), its (X, Y, Z) LUT."""
    data = rigs.nuscenes_data()
    rig = parse_config(fastbev_m0_data() | {"feature": {"stride": stride, "pixel_mapping": "corner"}})
    cameras = [dict(c, resize=0.44, crop=[0, crop_top]) for c in data["cameras"]]
    return upstream.fastbev_lut_torch(cameras, data["sensors"][0], stride, rig.feature_size, **FASTBEV_M0)


FASTBEV_R50_V4 = [
    {"n_voxels": [200, 200, 6], "voxel_size": [0.5, 0.5, 1.0], "point_cloud_range": [-50, -50, -5, 50, 50, 3]},
    {"n_voxels": [150, 150, 6], "voxel_size": [2 / 3, 2 / 3, 1.0], "point_cloud_range": [-50, -50, -5, 50, 50, 3]},
    {"n_voxels": [100, 100, 6], "voxel_size": [1.0, 1.0, 1.0], "point_cloud_range": [-50, -50, -5, 50, 50, 3]},
]
"""Fast-BEV R50 v4's voxel grid per FPN level (strides 4, 8, 16): ``n_voxels`` / ``voxel_size`` of
configs/fastbev/exp/paper/fastbev_r50_v4_ms_20cbgs_s256x704_v200x200x6_c256_d6_f4.py (Sense-GVT/Fast-BEV
@d16b76fc6571ef06ff97dc0a4aac4d710438bbe1), one per level (``extract_feat`` style v4)."""


@functools.lru_cache(maxsize=8)
def fastbev_v4_upstream_lut(level: int, flip: bool, crop_width: int = 704) -> np.ndarray:
    """Fast-BEV's torch code path (tests/upstream.py) for R50 v4's level ``level`` on the nuScenes
    car: 704x256 input, resize 0.44, centred crop top 70, stride 4 / 8 / 16 (feature maps 176x64,
    88x32, 44x16), that level's voxel grid; ``flip``: the second pass of ``TestTimeAugImageMultiViewImage``
    (``img_transform`` mirrors with ``b = crop[2] - crop[0] = crop_width``; 703 gives the exact
    mirror ``W - 1 - u`` instead, for comparison). Its (X, Y, Z) LUT."""
    data = rigs.nuscenes_data()
    stride = (4, 8, 16)[level]
    cameras = [dict(c, resize=0.44, crop=[0, 70], flip=flip, input_size=(crop_width, 256)) for c in data["cameras"]]
    return upstream.fastbev_lut_torch(cameras, data["sensors"][0], stride, (704 // stride, 256 // stride), **FASTBEV_R50_V4[level])


def test_fastbev_bmm_moves_only_voxels_on_a_rounding_edge() -> None:
    """The proof tests evaluate Fast-BEV's ``torch.bmm(projection, points)`` in index order
    (tests/upstream.py, ``matmul="ordered"``: the same bits on every CPU). ``torch.bmm`` itself
    rounds as the BLAS kernel the CPU dispatches: its pixels differ from the ordered ones by up to
    0.03 px on near voxels, and a LUT voxel changes only where that reaches a rounding edge
    (``k + 0.5``) of some camera. Measured: 1 voxel of 160,000 with MKL's AVX-512 kernels (Sapphire
    Rapids; u = 66.5 exactly in the ordered run), 2 with ``MKL_CBWR=AVX2``, 0 with
    ``MKL_CBWR=COMPATIBLE`` and on the earlier CI machines."""
    data = rigs.nuscenes_data()
    rig = parse_config(fastbev_m0_data())
    cameras = [dict(c, resize=0.44, crop=[0, 70]) for c in data["cameras"]]
    args = (cameras, data["sensors"][0], 4)
    ordered = upstream.fastbev_projected_torch(*args, **FASTBEV_M0)
    bmm = upstream.fastbev_projected_torch(*args, **FASTBEV_M0, matmul="bmm")
    moved = np.flatnonzero(upstream.fastbev_lut_of_projected(bmm, FASTBEV_M0["n_voxels"], rig.feature_size).reshape(-1) != fastbev_upstream_lut().reshape(-1))
    assert moved.size <= 16  # 0.01 % of the voxels
    on_edge = np.zeros(moved.size, dtype=bool)
    for (u, v, _), (ub, vb, _) in zip(ordered, bmm, strict=True):
        for a, b in ((u[moved], ub[moved]), (v[moved], vb[moved])):
            to_edge = np.abs((a - 0.5) - np.rint(a - 0.5))  # distance to the nearest rounding edge k + 0.5
            on_edge |= to_edge <= np.abs(a - b)
    assert on_edge.all(), moved[~on_edge]


def test_float32_lut_equals_fastbev_float32_code_path_bit_for_bit() -> None:
    """``precision float32`` + overlap ``last``: the LUT is Fast-BEV's own torch float32 run
    (rts2proj, _compute_projection, get_points, backproject_inplace, restated in tests/upstream.py),
    cell for cell, in its (X, Y, Z) voxel order. Measured on nuScenes (160,000 voxels, 153,085
    seen): 0 cells differ; the float64 LUT (nearest pixel of the exact geometry, ties half up)
    differs in 2 cells, overlap ``first`` in 20,365 (its own float32 arithmetic otherwise), crop top 140
    instead of Fast-BEV's centred 70 in 157,204, and ``point_cloud_range`` written as ``bev.x``/``y``
    (cell centres instead of Fast-BEV's voxel corners) in 110,507."""
    rig = parse_config(fastbev_m0_data())
    theirs = fastbev_upstream_lut()
    assert theirs.shape == (200, 200, 4) and int(np.count_nonzero(theirs >= 0)) == 153_085
    f32 = build_fastbev_lut(rig, FastBevOptions("last", precision="float32")).lut
    assert np.array_equal(xyz_layout(f32), theirs)
    f64 = build_fastbev_lut(rig, FastBevOptions("last")).lut
    assert int(np.count_nonzero(xyz_layout(f64) != theirs)) == 2
    first = build_fastbev_lut(rig, FastBevOptions("first", precision="float32")).lut
    assert int(np.count_nonzero(xyz_layout(first) != theirs)) == 20_365
    crop140 = parse_config(fastbev_m0_data() | {"image_aug": {"resize": 0.44, "crop": [0, 140], "input_size": [704, 256]}})
    assert int(np.count_nonzero(xyz_layout(build_fastbev_lut(crop140, FastBevOptions("last", precision="float32")).lut) != theirs)) == 157_204
    centres = parse_config(fastbev_m0_data() | {"bev": fastbev_m0_data()["bev"] | {"x": [-50.0, 50.0, 0.5], "y": [-50.0, 50.0, 0.5]}})
    assert int(np.count_nonzero(xyz_layout(build_fastbev_lut(centres, FastBevOptions("last", precision="float32")).lut) != theirs)) == 110_507


def test_convention_fastbev_xyz_layout_is_the_volume_order() -> None:
    """``fastbev_lut_xyz[ix, iy, ih] = fastbev_lut[ih, iy, ix]``: gathering the channels-last
    feature rows with it gives Fast-BEV's volume ``(C, X, Y, Z)``; its ``(Z*C, X, Y)`` reshape
    (what M2BevNeck consumes) is ``permute(3, 0, 1, 2)``."""
    rig = rigs.small_rig(heights=(-0.5, 0.0, 1.0), bev_half_m=16.0)
    lut = build_fastbev_lut(rig, FastBevOptions("last")).lut  # (Z, Y, X)
    xyz = xyz_layout(lut)
    n_h, ny, nx = lut.shape
    assert xyz.shape == (nx, ny, n_h) and xyz.dtype == np.int32 and xyz.flags.c_contiguous
    for ih, iy, ix in [(0, 3, 5), (2, ny - 1, 0), (1, 10, nx - 2)]:
        assert xyz[ix, iy, ih] == lut[ih, iy, ix]
        assert xyz.reshape(-1)[(ix * ny + iy) * n_h + ih] == lut[ih, iy, ix]
    feats = np.random.default_rng(0).random((rig.n_cam, 3, *rig.feature_size[::-1]))
    volume = fastbev_gather(xyz, feats)  # (C, X, Y, Z)
    assert volume.shape == (3, nx, ny, n_h)
    flat = torch.from_numpy(volume).permute(3, 0, 1, 2).reshape(n_h * 3, nx, ny).numpy()
    np.testing.assert_array_equal(flat[1 * 3 + 2], fastbev_gather(lut, feats)[2, 1].T)  # z = 1, c = 2


def test_float32_needs_pinhole_cameras() -> None:
    rig = rigs.small_rig(distortion=True)
    with pytest.raises(UsageError, match=r"--precision float32 restates Fast-BEV's pinhole projection; camera FRONT has a opencv lens"):
        build_fastbev_lut(rig, FastBevOptions(precision="float32"))


def test_options_round_trip_and_keep_old_build_options() -> None:
    assert FastBevOptions().to_dict() == {"overlap": "first"}  # stores of before keep their bytes
    full = FastBevOptions("last", "float32", True)
    assert full.to_dict() == {"overlap": "last", "precision": "float32", "points": "get_points", "xyz_layout": True}
    assert FastBevOptions.from_dict(full.to_dict()) == full
    assert FastBevOptions.from_dict({"overlap": "last"}) == FastBevOptions("last")
    # a float32 store built before get_points was restated records no points: it rebuilds with the cell centres
    assert FastBevOptions.from_dict({"overlap": "last", "precision": "float32"}).points == "cell_centres"
    with pytest.raises(UsageError, match=r"fastbev-lut points must be one of get_points, cell_centres, got 'corners'"):
        FastBevOptions.from_dict({"overlap": "last", "precision": "float32", "points": "corners"})
    with pytest.raises(UsageError, match=r"--precision must be one of float64, float32, got 'float16'"):
        FastBevOptions(precision="float16").validate()


def _multi_stride_rig() -> RigConfig:
    data = rigs.small_rig_data(heights=(0.0, 1.0), bev_half_m=16.0, pixel_mapping="corner")
    data["feature"] = {"levels": [{"stride": 8}, {"stride": 16}], "pixel_mapping": "corner"}
    return parse_config(data)


def test_every_feature_level_has_its_lut(tmp_path: Path) -> None:
    """Fast-BEV's multi-stride variant samples one volume per level: ``fastbev_lut_l<l>`` is the
    single-level LUT of that level (its own feature map); the group passes inspect, --strict
    (the LUT rebuild covers every level and the voxel order) and verify; a damaged level-1 LUT
    fails plain inspect."""
    rig = _multi_stride_rig()
    arrays, luts = fastbev_level_arrays(rig, FastBevOptions("last", xyz_layout=True))
    assert sorted(arrays) == ["fastbev_lut", "fastbev_lut_l1", "fastbev_lut_xyz", "fastbev_lut_xyz_l1", "fastbev_n_views", "fastbev_n_views_l1"]
    for level in (0, 1):
        single = build_fastbev_lut(rig.level(level), FastBevOptions("last")).lut
        assert np.array_equal(arrays["fastbev_lut" + ("_l1" if level else "")], single)
    assert luts[1].feature_size == (6, 4) and arrays["fastbev_lut_l1"].max() < rig.n_cam * 6 * 4
    store = run_grid(rig, tmp_path).store
    run_export_interop(store, {"fastbev-lut": FastBevOptions("last", xyz_layout=True).to_dict()})
    assert inspect_store(store).passed and inspect_store(store, strict=True).passed
    report = verify_store(store)
    assert report.passed and any(r.product == "interop/fastbev_lut_l1" for r in report.rows)
    lut = np.asarray(load(store)["interop"]["fastbev_lut_l1"]).copy()
    lut[0, 5, 5] = lut[0, 5, 5] + 1 if lut[0, 5, 5] >= 0 else 0
    damage.rewrite_array(store, "interop/fastbev_lut_l1", lut)
    failed = [(c.name, c.array) for c in inspect_store(store).failures]
    assert ("fastbev_matches_rebuild", "interop/fastbev_lut_l1") in failed


def test_a_float32_lut_store_passes_inspect_and_reports_its_measured_difference(tmp_path: Path) -> None:
    rig = rigs.small_rig(heights=(0.0, 1.0), bev_half_m=16.0, pixel_mapping="corner")
    store = run_grid(rig, tmp_path).store
    run_export_interop(store, {"fastbev-lut": FastBevOptions("last", precision="float32").to_dict()})
    assert inspect_store(store, strict=True).passed
    rows = [r for r in verify_store(store).rows if r.product == "interop/fastbev_lut"]
    assert len(rows) == 1 and rows[0].informational and "float32 upstream arithmetic" in rows[0].note


def _region_pair(data: dict[str, Any], region: dict[str, Any]) -> tuple[RigConfig, RigConfig]:
    """The same rig without and with ``bev.region``."""
    full = parse_config(data)
    return full, parse_config({**data, "bev": {**data["bev"], "region": region}})


@pytest.mark.parametrize(("overlap", "precision"), [("first", "float64"), ("last", "float64"), ("nearest-centre", "float64"), ("last", "float32"), ("first", "float32")])
def test_region_lut_equals_the_full_lut_inside_and_is_invalid_outside(overlap: str, precision: str) -> None:
    """``bev.region`` (a corridor with rings of factors 2 and 4): the LUT keeps the dense
    ``(n_heights, ny, nx)`` grid, is the full grid's LUT bit for bit on every voxel of a cell inside
    the region (super-cells included: each fine voxel reads its own pixel), -1 with ``n_views`` 0
    on every voxel outside; the Fast-BEV voxel order follows."""
    from bevcompile.rig.region import region_table

    from ..matrix.test_region import REGION

    full_rig, rig = _region_pair(rigs.small_rig_data(heights=(0.0, 1.0), pixel_mapping="corner"), REGION)
    options = FastBevOptions(overlap, precision=precision)
    full = build_fastbev_lut(full_rig, options)
    region = build_fastbev_lut(rig, options)
    table = region_table(rig.bev)
    inside = np.broadcast_to(table.fine_kept().reshape(rig.bev.ny, rig.bev.nx)[None], full.lut.shape)
    assert region.lut.shape == full.lut.shape and region.lut.dtype == np.int32 and region.n_views.dtype == np.uint8
    assert 0 < np.count_nonzero(inside) < inside.size and region.n_outside == np.count_nonzero(~inside)
    assert np.array_equal(region.lut[inside], full.lut[inside]) and np.array_equal(region.n_views[inside], full.n_views[inside])
    assert (region.lut[~inside] == -1).all() and (region.n_views[~inside] == 0).all()
    assert 0 < region.n_seen < full.n_seen
    # super-cells stay fine: inside a kept 4 x 4 super-cell the voxels read more than one pixel
    iy, ix, size = next(c for c in table.cells.tolist() if c[2] == 4)
    block = region.lut[:, iy:iy + size, ix:ix + size]
    assert (block >= 0).any() and np.unique(block[block >= 0]).size > 1
    assert np.array_equal(xyz_layout(region.lut), np.where(np.transpose(inside, (2, 1, 0)), xyz_layout(full.lut), -1))


FASTBEV_M0_REGION = {
    "keep": [[[-30.0, -12.0], [40.0, -12.0], [40.0, 12.0], [-30.0, 12.0]]],
    "rings": [{"beyond_m": 20, "factor": 2}, {"beyond_m": 30, "factor": 4}],
}
"""A highway corridor in Fast-BEV M0's lidar frame (-30 to +40 m, lateral +-12 m), coarser beyond 20 and 30 m."""


def test_float32_region_lut_is_fastbev_code_path_masked_by_the_region() -> None:
    """``precision float32`` + overlap ``last`` with ``bev.region``: the LUT in Fast-BEV's voxel
    order is Fast-BEV's own torch float32 run (tests/upstream.py, the same restatement as
    :func:`test_float32_lut_equals_fastbev_float32_code_path_bit_for_bit`) with every voxel of a
    cell outside the region set to -1. Measured: 0 of 160,000 voxels differ; 6,720 of the 40,000
    fine cells are inside the corridor (3,936 fine cells, 504 2x2 and 48 4x4 super-cells for
    ``matrix/``), 33,280 x 4 heights = 133,120 voxels are -1 for being outside it."""
    from bevcompile.rig.region import region_table

    _full, rig = _region_pair(fastbev_m0_data(), FASTBEV_M0_REGION)
    kept = region_table(rig.bev).fine_kept().reshape(rig.bev.ny, rig.bev.nx)  # (Y, X)
    theirs = fastbev_upstream_lut()  # (X, Y, Z)
    masked = np.where(kept.T[:, :, None], theirs, -1)
    region = build_fastbev_lut(rig, FastBevOptions("last", precision="float32"))
    assert int(np.count_nonzero(xyz_layout(region.lut) != masked)) == 0
    assert int(np.count_nonzero(kept)) == 6_720 and region.n_outside == int(np.count_nonzero(~kept)) * 4 == 133_120
    assert region_table(rig.bev).cells[:, 2].tolist().count(4) == 48
    assert int(np.count_nonzero(masked >= 0)) == region.n_seen


def test_region_store_inspect_catches_an_edited_voxel_outside_the_region(tmp_path: Path) -> None:
    """A ``bev.region`` store's LUT passes inspect, ``--strict`` and verify; the group records the
    region (the rule and the fine-cell counts); a voxel outside the region edited to the pixel the
    full grid reads there (a valid pixel, consistent with the projection) fails plain inspect, and so
    does an edited ``n_views`` outside; in the float32 arithmetic too (no structural pixel check)."""
    from bevcompile.conventions import REGION_CONVENTIONS
    from bevcompile.rig.region import region_table

    from ..matrix.test_region import REGION

    full_rig, rig = _region_pair(rigs.small_rig_data(heights=(0.0, 1.0), pixel_mapping="corner"), REGION)
    table = region_table(rig.bev)
    for precision in ("float64", "float32"):
        store = run_grid(rig, tmp_path / precision).store
        options = FastBevOptions("last", precision=precision)
        run_export_interop(store, {"fastbev-lut": options.to_dict()})
        assert inspect_store(store).passed and inspect_store(store, strict=True).passed and verify_store(store).passed
        attrs = load(store)["interop"].attrs
        assert attrs["region"]["rule"] == REGION_CONVENTIONS["region_interop"]
        assert attrs["region"]["n_fine_cells_inside"] == table.n_fine_kept < rig.bev.ny * rig.bev.nx
        assert attrs["fastbev-lut"]["region"]["n_cells_outside"] == 2 * (rig.bev.ny * rig.bev.nx - table.n_fine_kept)
        full = build_fastbev_lut(full_rig, options)
        lut = np.asarray(load(store)["interop"]["fastbev_lut"]).copy()
        outside = (table.expand.reshape(rig.bev.ny, rig.bev.nx) == table.n_kept)[None] & (full.lut >= 0)
        ih, iy, ix = (int(i[0]) for i in np.nonzero(outside))
        lut[ih, iy, ix] = full.lut[ih, iy, ix]
        damage.rewrite_array(store, "interop/fastbev_lut", lut)
        failed = {(c.name, c.array) for c in inspect_store(store).failures}
        assert ("fastbev_region_outside_invalid", "interop/fastbev_lut") in failed, failed
        message = next(c.reason for c in inspect_store(store).failures if c.name == "fastbev_region_outside_invalid")
        assert message == "fastbev_lut: 1 voxel(s) outside the region are not -1"
        lut[ih, iy, ix] = -1
        damage.rewrite_array(store, "interop/fastbev_lut", lut)
        n_views = np.asarray(load(store)["interop"]["fastbev_n_views"]).copy()
        n_views[ih, iy, ix] = 1
        damage.rewrite_array(store, "interop/fastbev_n_views", n_views)
        message = next(c.reason for c in inspect_store(store).failures if c.name == "fastbev_region_outside_invalid")
        assert message == "fastbev_n_views: 1 voxel(s) outside the region are not 0"


def test_convention_region_interop_keeps_the_dense_grid_and_leaves_petr_alone() -> None:
    """The ``region_interop`` sentence as code, target by target, on the same region rig: the
    Fast-BEV LUT and BEVPoolv2's voxel grid keep the full grid's dense shape (the LUT -1 outside,
    BEVPoolv2 no point there), PETR's per-pixel coordinates and mask are the full rig's bit for bit."""
    from bevcompile.conventions import REGION_CONVENTIONS
    from bevcompile.interop.bevpoolv2 import build_bevpoolv2
    from bevcompile.interop.petr import build_petr_coords
    from bevcompile.rig.region import region_table

    from ..matrix.test_region import REGION

    sentence = REGION_CONVENTIONS["region_interop"]
    assert "dense fine voxel grid (nx, ny, nz)" in sentence and "-1 (n_views 0)" in sentence and "PETR" in sentence
    full_rig, rig = _region_pair(rigs.small_rig_data(), REGION)
    inside = region_table(rig.bev).fine_kept()
    lut = build_fastbev_lut(rig).lut
    assert lut.shape == (1, rig.bev.ny, rig.bev.nx) and (lut.reshape(-1)[~inside] == -1).all()
    bev = build_bevpoolv2(rig)
    assert bev.grid.size == build_bevpoolv2(full_rig).grid.size
    assert inside[bev.ranks_bev.astype(np.int64) % inside.size].all()
    petr, petr_full = build_petr_coords(rig), build_petr_coords(full_rig)
    assert np.array_equal(petr.coords3d, petr_full.coords3d) and np.array_equal(petr.coords_mask, petr_full.coords_mask)


def test_a_flipped_image_is_restated_in_float32_by_fastbev_only() -> None:
    """``image_aug.flip`` in the float32 restatements: Fast-BEV's states it (its ``img_transform``);
    BEVDet's lift (BEVPoolv2) and PETR's position embedding do not, and refuse it in one line
    naming the camera and the way out; their float64 products follow the flip."""
    from bevcompile.interop.bevpoolv2 import BevPoolOptions, build_bevpoolv2
    from bevcompile.interop.petr import PetrOptions, build_petr_coords

    data = rigs.small_rig_data(heights=(0.0,), bev_half_m=16.0, pixel_mapping="corner")
    data["image_aug"]["flip"] = True
    rig = parse_config(data)
    assert build_fastbev_lut(rig, FastBevOptions("last", precision="float32")).n_seen > 0
    assert build_bevpoolv2(rig, BevPoolOptions()).n_kept > 0 and build_petr_coords(rig, PetrOptions()).coords3d.size > 0
    refusal = r"--precision float32 restates {} without a flipped image; camera FRONT has image_aug.flip \(use --precision float64, which follows the flip\)"
    with pytest.raises(UsageError, match=refusal.format("BEVDet's pinhole lift")):
        build_bevpoolv2(rig, BevPoolOptions(precision="float32"))
    with pytest.raises(UsageError, match=refusal.format("PETR's pinhole position embedding")):
        build_petr_coords(rig, PetrOptions(precision="float32"))


def test_float32_points_restate_get_points_and_older_float32_stores_still_pass(tmp_path: Path) -> None:
    """The float32 voxel points are ``get_points``' own float32 arithmetic: on the 0.8 m nuScenes
    grid (not exact in float32) 78 of the 128 x (and y) points differ by one ulp from the float32 of
    the cell centres, which moves 1 of the 16,384 LUT cells. A float32 store built before (its
    build_options record no ``points``, its LUT the cell centres') still passes inspect and
    ``--strict``: it is rebuilt with the arithmetic it was built with."""
    from bevcompile.interop.fastbev import fastbev_points_float32

    rig = rigs.nuscenes_rig()
    centres = (rig.bev.x.min + (np.arange(rig.bev.nx) + 0.5) * rig.bev.x.step).astype(np.float32)
    assert int(np.count_nonzero(fastbev_points_float32(rig.bev.x) != centres)) == 78
    new = build_fastbev_lut(rig, FastBevOptions("last", "float32")).lut
    old = build_fastbev_lut(rig, FastBevOptions("last", "float32", points="cell_centres")).lut
    assert int(np.count_nonzero(new != old)) == 1
    store = run_grid(rig, tmp_path).store
    run_export_interop(store, {"fastbev-lut": FastBevOptions("last", "float32").to_dict()})
    damage.rewrite_array(store, "interop/fastbev_lut", old)
    meta_path = store / "interop" / "zarr.json"  # the group as the earlier tool wrote it: no points option, no points attribute
    meta = json.loads(meta_path.read_text())
    meta["attributes"]["build_options"]["fastbev-lut"] = {"overlap": "last", "precision": "float32"}
    del meta["attributes"]["fastbev-lut"]["points"]
    meta_path.write_text(json.dumps(meta, indent=2))
    damage.reconsolidate(store)
    assert inspect_store(store).passed and inspect_store(store, strict=True).passed
    damage.rewrite_array(store, "interop/fastbev_lut", new)  # the get_points LUT under the old options: caught
    assert ("fastbev_matches_rebuild", "interop/fastbev_lut") in [(c.name, c.array) for c in inspect_store(store).failures]
