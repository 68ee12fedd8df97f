"""``inspect`` / ``verify`` / ``inspect --strict`` plug-in for the ``interop/`` group.

Implements the contract of :mod:`bevcompile.store.plugins`: :func:`check_interop` (structural
invariants, recomputed — attributes are not trusted; the BEVPoolv2 arrays are also compared
with a rebuild from the stored config and their ``build_options`` when the frustum has at most
:data:`GEOMETRY_CHECK_MAX_POINTS` points), :func:`verify_interop` (BEVPoolv2 sum
pooling against a straightforward scatter-add of the frustum; the Fast-BEV LUT against
nearest ``grid_sample`` on ``grid/norm``) and :func:`rebuild_interop` (bit-exact rebuild
from ``attrs["build_options"]``). Pure: no zarr, no printing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import numpy as np

from ..errors import StoreError
from ..grid.reference import grid_sample
from ..rig.config import RigConfig
from ..rig.presets import plain_data
from ..store.plugins import REBUILT_ATTRS, Check, CheckContext, VerifyRow, compare
from .bevpoolv2 import (
    BEVPOOL_ARRAYS,
    BEVPOOL_PREFIX,
    BevPoolOptions,
    bev_pool_v2,
    feat_rank_from_depth_rank,
    frustum_shape,
    intervals_of,
    reference_frustum_pool,
    voxel_grid,
)
from .export import INTEROP_TARGETS, build_target, interop_dimension_names, interop_group_attrs, target_arrays
from .fastbev import (
    FASTBEV_LUT_ARRAY,
    FastBevOptions,
    build_fastbev_lut,
    choose_camera,
    fastbev_gather,
    fastbev_level_arrays,
    fastbev_lut_from_grid,
    level_of_array,
    nearest_pixel,
    region_kept_cells,
)
from .petr import (
    PETR_ARRAYS,
    PETR_COORDS_ARRAY,
    PETR_MASK_ARRAY,
    PetrOptions,
    build_petr_coords,
    coords_mask_of,
    padding_mask,
    petr_depths,
    petr_depths_float32,
    petr_input_px,
)

GROUP = "interop"
FASTBEV_N_VIEWS = "fastbev_n_views"
VERIFY_MAX_ABS = 1e-5
_TIE_MARGIN_PX = 1e-4  # float32 grid coords: a pixel choice this close to a .5 tie may differ
# plain inspect rebuilds the BEVPoolv2 arrays (n_cam * D * H_f * W_f frustum points) up to this
# size: nuScenes (249 k points) adds ~15-20 ms; the dense rig (88 M) ~7 s / 1.6 GB, left to --strict / verify
GEOMETRY_CHECK_MAX_POINTS = 20_000_000
GEOMETRY_CHECK = "bevpoolv2_matches_rebuild"
"""The stored BEVPoolv2 arrays equal a rebuild from the stored config and ``build_options``."""


def _build_options(attrs: Mapping[str, Any]) -> dict[str, Any]:
    recorded = attrs.get("build_options")
    return plain_data(recorded) if isinstance(recorded, Mapping) else {}


def _targets(arrays: Mapping[str, np.ndarray], attrs: Mapping[str, Any]) -> list[str]:
    """Targets the group claims (build_options) or visibly holds (arrays)."""
    options = _build_options(attrs)
    found = set(options)
    if any(name.startswith(BEVPOOL_PREFIX) for name in arrays):
        found.add("bevpoolv2")
    if FASTBEV_LUT_ARRAY in arrays:
        found.add("fastbev-lut")
    if PETR_COORDS_ARRAY in arrays:
        found.add("petr-coords3d")
    return [t for t in INTEROP_TARGETS if t in found] + sorted(found - set(INTEROP_TARGETS))


def dimension_names_interop(name: str, ndim: int, attrs: Mapping[str, Any]) -> tuple[str, ...] | None:
    """The ``dimension_names`` the writer gives ``interop/<name>`` (None: no array of that name): a
    Fast-BEV level recorded with ``own_grid`` has its own axes."""
    lut_attrs = attrs.get("fastbev-lut")
    levels = lut_attrs.get("levels") if isinstance(lut_attrs, Mapping) else None
    own = {
        entry["level"] for entry in (levels if isinstance(levels, list) else [])
        if isinstance(entry, Mapping) and entry.get("own_grid") is True and isinstance(entry.get("level"), int)
    }
    try:
        return interop_dimension_names(name, own)
    except StoreError:
        return None


def check_interop(ctx: CheckContext, arrays: Mapping[str, np.ndarray], attrs: Mapping[str, Any]) -> list[Check]:
    checks: list[Check] = []
    options = _build_options(attrs)
    targets = _targets(arrays, attrs)
    if not targets:
        return [Check("interop_targets", f"{GROUP}/", False, "group holds no BEVPoolv2 arrays, no Fast-BEV LUT and no PETR coordinates")]
    for target in targets:
        if target not in INTEROP_TARGETS:
            checks.append(Check("known_target", f"{GROUP}/", False, f"unknown interop target {target!r} in build_options"))
        elif target not in options:
            checks.append(Check("build_options", f"{GROUP}/", False, f"no build_options recorded for {target}"))
        elif target == "bevpoolv2":
            checks.extend(_check_bevpool(ctx, arrays, options[target]))
        elif target == "petr-coords3d":
            checks.extend(_check_petr(ctx, arrays, options[target]))
        else:
            checks.extend(_check_fastbev(ctx, arrays, options[target]))
    # arrays of a target the group holds without build_options are reported above
    wanted = {name for t in targets if t in INTEROP_TARGETS for name in target_arrays(t, ctx.rig, options.get(t))}
    extra = sorted(set(arrays) - wanted)
    if extra:
        checks.append(Check("contract", f"{GROUP}/", False, f"arrays not produced by these build_options: {', '.join(extra)}"))
    return checks


def _check_bevpool(ctx: CheckContext, arrays: Mapping[str, np.ndarray], build_options: Any) -> list[Check]:
    name = {k: BEVPOOL_PREFIX + k for k in BEVPOOL_ARRAYS}
    out: list[Check] = []
    try:
        options = BevPoolOptions.from_dict(build_options)
    except Exception as exc:
        return [Check("build_options", f"{GROUP}/", False, f"bevpoolv2 build_options invalid: {exc}")]
    missing = [n for n in name.values() if n not in arrays]
    for n in missing:
        out.append(Check("present", f"{GROUP}/{n}", False, "array missing or unreadable"))
    if missing:
        return out
    a = {k: np.asarray(arrays[v]) for k, v in name.items()}
    bad_dtype = [k for k, v in a.items() if v.dtype != np.int32 or v.ndim != 1]
    if bad_dtype:
        for k in bad_dtype:
            out.append(Check("dtype_shape", f"{GROUP}/{name[k]}", False, f"expected 1-D int32, got {a[k].dtype} {a[k].shape}"))
        return out
    n_kept = a["ranks_bev"].size
    lengths_ok = a["ranks_depth"].size == n_kept and a["ranks_feat"].size == n_kept
    out.append(Check("equal_lengths", f"{GROUP}/{name['ranks_bev']}", lengths_ok,
                     f"ranks_bev/depth/feat lengths {n_kept}/{a['ranks_depth'].size}/{a['ranks_feat'].size}"))
    if not lengths_ok:
        return out
    depth_shape = frustum_shape(ctx.rig)
    batch = options.batch
    n_points = batch * int(np.prod(depth_shape))
    grid = voxel_grid(ctx.rig, options.z_bins)
    n_cam, _d, h_f, w_f = depth_shape
    limits = (("ranks_depth", n_points), ("ranks_feat", batch * n_cam * h_f * w_f), ("ranks_bev", batch * grid.n_voxels))
    for key, limit in limits:
        v = a[key]
        ok = bool(v.size == 0 or (v.min() >= 0 and v.max() < limit))
        lo_hi = f"[{v.min()}, {v.max()}]" if v.size else "empty"
        out.append(Check("index_range", f"{GROUP}/{name[key]}", ok, f"values {lo_hi} within [0, {limit})"))
    feat_ok = bool(np.array_equal(feat_rank_from_depth_rank(a["ranks_depth"], depth_shape), a["ranks_feat"]))
    out.append(Check("ranks_feat_matches_depth", f"{GROUP}/{name['ranks_feat']}", feat_ok,
                     ("ranks_feat = cam*H_f*W_f + ranks_depth mod H_f*W_f on every point" if feat_ok
                      else "ranks_feat differs from cam*H_f*W_f + ranks_depth mod H_f*W_f")))
    rb = a["ranks_bev"].astype(np.int64)
    rd = a["ranks_depth"].astype(np.int64)
    unsorted = int(np.count_nonzero(rb[1:] < rb[:-1]))
    out.append(Check("sorted_by_ranks_bev", f"{GROUP}/{name['ranks_bev']}", unsorted == 0,
                     f"points sorted by ranks_bev: {unsorted} descending step(s)"))
    same = rb[1:] == rb[:-1]
    unstable = int(np.count_nonzero(same & (rd[1:] <= rd[:-1])))
    if options.order == "stable":
        out.append(Check("stable_within_voxel", f"{GROUP}/{name['ranks_depth']}", unstable == 0,
                         f"stable sort (ranks_depth ascending within a voxel): {unstable} out-of-order pair(s) within voxels"))
    else:  # torch's argsort: any order inside a voxel; the rebuild (same torch and device) compares it
        repeated = int(np.count_nonzero(same & (rd[1:] == rd[:-1])))
        out.append(Check("stable_within_voxel", f"{GROUP}/{name['ranks_depth']}", repeated == 0,
                         f"order torch: {unstable} pair(s) within voxels out of ranks_depth order (allowed), {repeated} repeated point(s)"))
    starts, lengths = intervals_of(a["ranks_bev"])
    ok = bool(np.array_equal(starts, a["interval_starts"]) and np.array_equal(lengths, a["interval_lengths"]))
    out.append(Check("intervals_are_runs", f"{GROUP}/{name['interval_starts']}", ok,
                     f"intervals = runs of ranks_bev: {a['interval_starts'].size} intervals, lengths sum {int(a['interval_lengths'].astype(np.int64).sum())} "
                     f"of {n_kept} points" + ("" if ok else f"; expected {starts.size} intervals")))
    out.append(_check_bevpool_geometry(ctx, a, options))
    return out


def _check_bevpool_geometry(ctx: CheckContext, stored: Mapping[str, np.ndarray], options: BevPoolOptions) -> Check:
    """The stored arrays against the arrays the stored config + ``build_options`` give (the
    rebuild of ``inspect --strict``): catches an edited ``build_options`` (rounding, frustum
    mapping, z_bins, batch) and points or intervals moved consistently, which the structural
    checks cannot see. Skipped (passing, with a note) above :data:`GEOMETRY_CHECK_MAX_POINTS`."""
    n_cam, n_d, h_f, w_f = frustum_shape(ctx.rig)
    n_frustum = n_cam * n_d * h_f * w_f
    if n_frustum > GEOMETRY_CHECK_MAX_POINTS:
        return Check(GEOMETRY_CHECK, f"{GROUP}/", True,
                     f"not compared: the frustum has {n_frustum:,} points (> {GEOMETRY_CHECK_MAX_POINTS:,}); "
                     "the geometry comparison runs under --strict and verify")
    recorded = ", ".join(f"{k}={v}" for k, v in options.to_dict().items())
    try:
        rebuilt, _ = build_target(ctx.rig, "bevpoolv2", options.to_dict())
    except Exception as exc:
        return Check(GEOMETRY_CHECK, f"{GROUP}/", False, f"cannot rebuild from build_options ({recorded}): {exc}")
    for key in BEVPOOL_ARRAYS:
        got = np.asarray(stored[key])
        want = np.asarray(rebuilt[BEVPOOL_PREFIX + key])
        common = min(got.size, want.size)
        ne = np.flatnonzero(got[:common] != want[:common])
        if ne.size == 0 and got.size == want.size:
            continue
        first = int(ne[0]) if ne.size else common
        if got.size == want.size:
            what = f"{ne.size:,} of {got.size:,} element(s) differ from the rebuild (first at index {first:,})"
        else:
            more = got.size - want.size
            what = (f"{got.size:,} element(s) stored, {want.size:,} in the rebuild ({abs(more):,} "
                    f"{'more' if more > 0 else 'fewer'}; first difference at index {first:,})")
        return Check(GEOMETRY_CHECK, f"{GROUP}/{BEVPOOL_PREFIX}{key}", False,
                     f"{what}: the arrays contradict the stored config or build_options ({recorded})")
    return Check(GEOMETRY_CHECK, f"{GROUP}/", True,
                 f"all {len(BEVPOOL_ARRAYS)} arrays equal the rebuild ({recorded}; {n_frustum:,} frustum points)")


FASTBEV_REBUILD_CHECK = "fastbev_matches_rebuild"
"""Every Fast-BEV LUT array (levels, Fast-BEV voxel order, float32 arithmetic) equals a rebuild."""


def _check_fastbev(ctx: CheckContext, arrays: Mapping[str, np.ndarray], build_options: Any) -> list[Check]:
    try:
        options = FastBevOptions.from_dict(build_options)
    except Exception as exc:
        return [Check("build_options", f"{GROUP}/", False, f"fastbev-lut build_options invalid: {exc}")]
    out = _check_fastbev_level0(ctx, arrays, options) if options.precision == "float64" else _check_lut_range(ctx, arrays)
    if ctx.rig.bev.region is not None:
        out.extend(_check_fastbev_region(ctx, arrays, options))
    if options.precision != "float64" or options.xyz_layout or ctx.rig.n_levels > 1:
        out.append(_check_fastbev_rebuild(ctx, arrays, options))
    return out


FASTBEV_REGION_OUTSIDE_CHECK = "fastbev_region_outside_invalid"
"""``bev.region``: every voxel of a fine cell outside the region is -1 in the LUT and 0 in ``n_views``."""
FASTBEV_REGION_INSIDE_CHECK = "fastbev_region_inside_equals_full_grid"
"""``bev.region``: every voxel of a fine cell inside the region equals the full grid's LUT (and ``n_views``)."""


def _check_fastbev_region(ctx: CheckContext, arrays: Mapping[str, np.ndarray], options: FastBevOptions) -> list[Check]:
    """Every level's LUT and ``n_views`` of a ``bev.region`` store against the full grid's (the
    stored config without its region; level 0 in float64 reuses the context's projection): -1 / 0
    on every voxel outside the region, bit for bit the full grid's inside."""
    rig = ctx.rig
    kept = region_kept_cells(rig)
    assert kept is not None
    full_rig = replace(rig, bev=replace(rig.bev, region=None))
    shape = (len(rig.bev.heights), rig.bev.ny, rig.bev.nx)
    inside = np.broadcast_to(kept[None], shape)
    n_out = int(np.count_nonzero(~inside))
    bad_out: list[str] = []
    bad_in: list[str] = []
    for level in range(rig.n_levels):
        suffix = "" if level == 0 else f"_l{level}"
        names = (FASTBEV_LUT_ARRAY + suffix, FASTBEV_N_VIEWS + suffix)
        stored = [arrays.get(name) for name in names]
        if any(a is None or np.shape(a) != shape for a in stored):
            return [Check(FASTBEV_REGION_OUTSIDE_CHECK, f"{GROUP}/{names[0]}", False,
                          f"{names[0]} / {names[1]} missing or not of shape {shape}")]
        if level == 0 and options.precision == "float64":
            full = fastbev_lut_from_grid(ctx.sampling_grid(), options)
        else:
            full = build_fastbev_lut(full_rig.level(level), options)
        wants: tuple[np.ndarray, np.ndarray] = (full.lut, full.n_views)
        for name, stored_array, want, invalid in zip(names, stored, wants, (-1, 0), strict=True):
            got = np.asarray(stored_array)
            ne_out = int(np.count_nonzero(got[~inside] != invalid))
            ne_in = int(np.count_nonzero(got[inside] != want[inside]))
            if ne_out:
                bad_out.append(f"{name}: {ne_out:,} voxel(s) outside the region are not {invalid}")
            if ne_in:
                bad_in.append(f"{name}: {ne_in:,} voxel(s) inside the region differ from the full grid's")
    where = f"{GROUP}/{FASTBEV_LUT_ARRAY}"
    return [
        Check(FASTBEV_REGION_OUTSIDE_CHECK, where, not bad_out,
              "; ".join(bad_out) if bad_out else f"all {n_out:,} voxels of cells outside the bev.region are -1 (n_views 0), every level"),
        Check(FASTBEV_REGION_INSIDE_CHECK, where, not bad_in,
              "; ".join(bad_in) if bad_in else
              f"all {inside.size - n_out:,} voxels inside the bev.region equal the full grid's LUT and n_views bit for bit, every level"),
    ]


def _check_lut_range(ctx: CheckContext, arrays: Mapping[str, np.ndarray]) -> list[Check]:
    """dtype, shape and index range of ``fastbev_lut`` (what holds whatever the arithmetic)."""
    where = f"{GROUP}/{FASTBEV_LUT_ARRAY}"
    if FASTBEV_LUT_ARRAY not in arrays:
        return [Check("present", where, False, "array missing or unreadable")]
    lut = np.asarray(arrays[FASTBEV_LUT_ARRAY])
    rig = ctx.rig
    w_f, h_f = rig.feature_size
    shape = (len(rig.bev.heights), rig.bev.ny, rig.bev.nx)
    if lut.dtype != np.int32 or lut.shape != shape:
        return [Check("dtype_shape", where, False, f"expected int32 {shape}, got {lut.dtype} {lut.shape}")]
    n_flat = rig.n_cam * h_f * w_f
    ok = bool(lut.min() >= -1 and lut.max() < n_flat) if lut.size else True
    return [Check("index_range", where, ok, f"values [{lut.min()}, {lut.max()}] within [-1, {n_flat})")]


def _check_fastbev_rebuild(ctx: CheckContext, arrays: Mapping[str, np.ndarray], options: FastBevOptions) -> Check:
    """Every LUT array against a rebuild from the stored config and ``build_options``: the other
    feature levels, Fast-BEV's voxel order and the float32 arithmetic have no grid/ to compare with."""
    recorded = ", ".join(f"{k}={v}" for k, v in options.to_dict().items())
    try:
        rebuilt, _luts = fastbev_level_arrays(ctx.rig, options)
    except Exception as exc:
        return Check(FASTBEV_REBUILD_CHECK, f"{GROUP}/", False, f"cannot rebuild from build_options ({recorded}): {exc}")
    for name, want in rebuilt.items():
        got = arrays.get(name)
        if got is None:
            return Check(FASTBEV_REBUILD_CHECK, f"{GROUP}/{name}", False, "array missing or unreadable")
        got = np.asarray(got)
        if got.dtype != want.dtype or got.shape != want.shape:
            return Check(FASTBEV_REBUILD_CHECK, f"{GROUP}/{name}", False, f"{got.dtype} {got.shape}, the rebuild is {want.dtype} {want.shape}")
        ne = int(np.count_nonzero(got != want))
        if ne:
            return Check(FASTBEV_REBUILD_CHECK, f"{GROUP}/{name}", False,
                         f"{ne:,} of {got.size:,} element(s) differ from the rebuild ({recorded})")
    return Check(FASTBEV_REBUILD_CHECK, f"{GROUP}/", True, f"all {len(rebuilt)} LUT arrays equal the rebuild ({recorded})")


PETR_REBUILD_CHECK = "petr_matches_rebuild"
"""The stored PETR coordinates and mask equal a rebuild from the stored config and ``build_options``."""
PETR_REPROJECTION_MAX_PX = 0.05
"""``verify``: every stored PETR point, projected back through the rig, lands within this many
input pixels of the pixel it was lifted from (float32 storage of the normalised coordinates
moves a point by up to ~1e-5 m)."""


def _check_petr(ctx: CheckContext, arrays: Mapping[str, np.ndarray], build_options: Any) -> list[Check]:
    try:
        options = PetrOptions.from_dict(build_options)
    except Exception as exc:
        return [Check("build_options", f"{GROUP}/", False, f"petr-coords3d build_options invalid: {exc}")]
    missing = [name for name in PETR_ARRAYS if name not in arrays]
    if missing:
        return [Check("present", f"{GROUP}/{name}", False, "array missing or unreadable") for name in missing]
    coords, mask = np.asarray(arrays[PETR_COORDS_ARRAY]), np.asarray(arrays[PETR_MASK_ARRAY])
    rig = ctx.rig.level(0)  # PETR's position_level
    w_f, h_f = rig.feature_size
    shape = (rig.n_cam, 3 * options.depth_num, h_f, w_f)
    out: list[Check] = []
    if coords.dtype != np.float32 or coords.shape != shape:
        return [Check("dtype_shape", f"{GROUP}/{PETR_COORDS_ARRAY}", False, f"expected float32 {shape}, got {coords.dtype} {coords.shape}")]
    if mask.dtype != np.bool_ or mask.shape != (rig.n_cam, h_f, w_f):
        return [Check("dtype_shape", f"{GROUP}/{PETR_MASK_ARRAY}", False, f"expected bool {(rig.n_cam, h_f, w_f)}, got {mask.dtype} {mask.shape}")]
    finite = bool(np.isfinite(coords).all())
    out.append(Check("finite", f"{GROUP}/{PETR_COORDS_ARRAY}", finite, "every coordinate finite" if finite else f"{int(np.count_nonzero(~np.isfinite(coords)))} non-finite coordinate(s)"))
    no_ray = ~coords.any(axis=1)
    rule = coords_mask_of(coords) | padding_mask(rig) | no_ray
    bad = int(np.count_nonzero(rule != mask))
    out.append(Check("mask_rule", f"{GROUP}/{PETR_MASK_ARRAY}", bad == 0,
                     f"mask = more than D/2 coordinates outside [0, 1], image padding or no ray: {bad} pixel(s) disagree ({int(mask.sum())} masked)"))
    recorded = ", ".join(f"{k}={v}" for k, v in options.to_dict().items())
    if coords.size > GEOMETRY_CHECK_MAX_POINTS:
        out.append(Check(PETR_REBUILD_CHECK, f"{GROUP}/", True, f"not compared: {coords.size:,} coordinates (> {GEOMETRY_CHECK_MAX_POINTS:,})"))
        return out
    try:
        rebuilt = build_petr_coords(ctx.rig, options)
    except Exception as exc:
        out.append(Check(PETR_REBUILD_CHECK, f"{GROUP}/", False, f"cannot rebuild from build_options ({recorded}): {exc}"))
        return out
    for name, want in rebuilt.arrays().items():
        ne = int(np.count_nonzero(np.asarray(arrays[name]) != want))
        if ne:
            out.append(Check(PETR_REBUILD_CHECK, f"{GROUP}/{name}", False, f"{ne:,} of {want.size:,} element(s) differ from the rebuild ({recorded})"))
            return out
    out.append(Check(PETR_REBUILD_CHECK, f"{GROUP}/", True, f"coordinates and mask equal the rebuild ({recorded})"))
    return out


def _verify_petr(ctx: CheckContext, arrays: Mapping[str, np.ndarray], options: PetrOptions) -> VerifyRow:
    """Every stored PETR point projected back through the rig (its pose and lens model): the
    input pixel it lands on against the pixel PETR lifted it from, and its camera depth against
    the depth bin (pixels with a ray only)."""
    from ..rig.geometry import cam_from_bev_matrix, image_px_to_input_px, project_cam_to_image, transform_points

    rig = ctx.rig.level(0)  # PETR's position_level
    coords = np.asarray(arrays[PETR_COORDS_ARRAY], dtype=np.float64)
    n_cam, _, h_f, w_f = coords.shape
    n_d = options.depth_num
    lo = np.asarray(options.position_range[:3])
    span = np.asarray(options.position_range[3:]) - lo
    points = np.moveaxis(coords.reshape(n_cam, n_d, 3, h_f, w_f), 2, -1) * span + lo  # (n_cam, D, H_f, W_f, 3)
    u_in, v_in = petr_input_px(rig)
    want = np.stack(np.broadcast_arrays(u_in[None, :], v_in[:, None]), axis=-1)
    depths = petr_depths(options) if options.precision == "float64" else petr_depths_float32(options).astype(np.float64)
    got_px, ref_px, got_d, ref_d = [], [], [], []
    for cam_index, camera in enumerate(rig.cameras):
        ray = coords[cam_index].any(axis=0)
        points_cam = transform_points(cam_from_bev_matrix(rig, camera), points[cam_index])
        uv, ok = project_cam_to_image(camera, points_cam)
        uv_in = np.stack(image_px_to_input_px(camera, uv), axis=-1)
        keep = ray[None] & ok
        got_px.append(uv_in[keep])
        ref_px.append(np.broadcast_to(want[None], uv_in.shape)[keep])
        got_d.append(points_cam[..., 2][keep])
        ref_d.append(np.broadcast_to(depths[:, None, None], keep.shape)[keep])
    got, ref = np.concatenate(got_px), np.concatenate(ref_px)
    max_abs, mean_abs, psnr = compare("interop/petr_coords3d", "all", got, ref, float(max(rig.input_size)))
    depth_err = float(np.max(np.abs(np.concatenate(got_d) - np.concatenate(ref_d)))) if got.size else 0.0
    return VerifyRow("interop/petr_coords3d", "all", max_abs, mean_abs, psnr, f"max_abs <= {PETR_REPROJECTION_MAX_PX:g} px",
                     bool(max_abs <= PETR_REPROJECTION_MAX_PX),
                     f"stored points reprojected through the rig vs the input pixels PETR lifts (input px); camera depth error {depth_err:.2e} m")


def _check_fastbev_level0(ctx: CheckContext, arrays: Mapping[str, np.ndarray], options: FastBevOptions) -> list[Check]:
    out = _check_lut_range(ctx, arrays)
    if not out[-1].passed or out[-1].name != "index_range":
        return out
    where = f"{GROUP}/{FASTBEV_LUT_ARRAY}"
    lut = np.asarray(arrays[FASTBEV_LUT_ARRAY])
    rig = ctx.rig
    w_f, h_f = rig.feature_size
    shape = lut.shape  # (n_heights, ny, nx), checked by _check_lut_range
    valid = ctx.grid_arrays.get("valid")
    coords = ctx.grid_arrays.get("coords")
    if valid is not None and np.shape(valid) != (rig.n_cam, *shape):  # a bev.region grid/: its kept cells, not the LUT's fine cells
        valid = coords = None
    if valid is None or coords is None:  # a store without grid/ (matrix + export-interop), or a region's: the projection itself
        truth = ctx.sampling_grid()
        valid, coords = truth.valid, truth.coords_feature_px
    valid = np.asarray(valid, dtype=bool)
    coords64 = np.asarray(coords, dtype=np.float64)
    kept = region_kept_cells(rig)
    if kept is not None:  # bev.region: no camera counts on the voxels of a cell outside it
        valid = valid & kept[None, None]
    seen = valid.any(axis=0)
    unseen_bad = int(np.count_nonzero((lut >= 0) != seen))
    out.append(Check("unseen_cells_minus_one", where, unseen_bad == 0,
                     f"-1 exactly where no camera sees the cell{' (or it is outside the bev.region)' if kept is not None else ''}: {unseen_bad} cell(s) disagree with grid/valid ({int(seen.sum())} seen of {seen.size})"))
    cam = np.where(lut >= 0, lut // (h_f * w_f), -1)
    expected_cam = choose_camera(coords64, valid, rig.feature_size, options.overlap)
    cam_bad = (cam != expected_cam) & (lut >= 0)
    if options.overlap == "nearest-centre" and cam_bad.any():
        # float32 coords: accept a camera whose distance ties the best within the margin
        centre = np.array([(w_f - 1) / 2.0, (h_f - 1) / 2.0])
        dist = np.sqrt(np.sum((coords64 - centre) ** 2, axis=-1))
        dist = np.where(valid, dist, np.inf)
        pick = np.clip(cam, 0, rig.n_cam - 1)
        chosen = np.take_along_axis(dist, pick[None], axis=0)[0]
        cam_bad &= chosen > dist.min(axis=0) + _TIE_MARGIN_PX
    n_cam_bad = int(np.count_nonzero(cam_bad))
    out.append(Check("overlap_policy", where, n_cam_bad == 0,
                     f"overlap policy {options.overlap}: {n_cam_bad} cell(s) take another camera than the policy gives"))
    pick = np.clip(cam, 0, rig.n_cam - 1)
    uv = np.take_along_axis(coords64, pick[None, ..., None], axis=0)[0]
    cam_valid = np.take_along_axis(valid, pick[None], axis=0)[0]
    # float32 coords near a .5 tie may round either way: accept exactly the pixels the
    # coordinate rounds to within the margin (at most the two tie candidates per axis), no other
    accepted = np.zeros(lut.shape, dtype=bool)
    for du in (-_TIE_MARGIN_PX, 0.0, _TIE_MARGIN_PX):
        for dv in (-_TIE_MARGIN_PX, 0.0, _TIE_MARGIN_PX):
            iuv = np.clip(nearest_pixel(uv + np.array([du, dv])), 0, [w_f - 1, h_f - 1])
            accepted |= (pick * h_f + iuv[..., 1]) * w_f + iuv[..., 0] == lut
    pix_bad = (lut >= 0) & (~accepted | ~cam_valid)
    n_pix_bad = int(np.count_nonzero(pix_bad))
    out.append(Check("nearest_feature_pixel", where, n_pix_bad == 0,
                     f"nearest feature pixel of grid/coords: {n_pix_bad} cell(s) point at another pixel (or at a camera that does not see them)"))
    n_views = arrays.get(FASTBEV_N_VIEWS)
    where_n = f"{GROUP}/{FASTBEV_N_VIEWS}"
    if n_views is None:
        out.append(Check("present", where_n, False, "array missing or unreadable"))
    elif np.asarray(n_views).dtype != np.uint8 or np.asarray(n_views).shape != shape:
        out.append(Check("dtype_shape", where_n, False, f"expected uint8 {shape}, got {np.asarray(n_views).dtype} {np.asarray(n_views).shape}"))
    else:
        ok = bool(np.array_equal(np.asarray(n_views, dtype=np.int64), valid.sum(axis=0)))
        out.append(Check("n_views_matches_valid", where_n, ok,
                         "n_views = number of cameras seeing the cell (grid/valid)" if ok
                         else "n_views differs from the number of cameras seeing the cell (grid/valid)"))
    return out


def _features(ctx: CheckContext) -> tuple[np.ndarray, np.ndarray]:
    """Context features and depth probabilities (seeded fallbacks of the right shapes)."""
    n_cam, n_d, h_f, w_f = frustum_shape(ctx.rig)
    rng = np.random.default_rng(ctx.seed)
    feats = ctx.features
    if feats is None or feats.shape[0] != n_cam or feats.shape[2:] != (h_f, w_f):
        feats = rng.random((n_cam, 8, h_f, w_f), dtype=np.float32)
    depth = ctx.depth_probs
    if depth is None or depth.shape != (n_cam, n_d, h_f, w_f):
        logits = rng.standard_normal((n_cam, n_d, h_f, w_f))
        e = np.exp(logits - logits.max(axis=1, keepdims=True))
        depth = (e / e.sum(axis=1, keepdims=True)).astype(np.float32)
    return np.asarray(feats), np.asarray(depth)


def verify_interop(ctx: CheckContext, arrays: Mapping[str, np.ndarray], attrs: Mapping[str, Any]) -> list[VerifyRow]:
    rows: list[VerifyRow] = []
    options = _build_options(attrs)
    feats, depth = _features(ctx)
    peak = float(feats.max() - feats.min()) or 1.0
    if "bevpoolv2" in options and all(BEVPOOL_PREFIX + k in arrays for k in BEVPOOL_ARRAYS):
        bev_options = BevPoolOptions.from_dict(options["bevpoolv2"])
        grid = voxel_grid(ctx.rig, bev_options.z_bins)
        # batch item b: the channels rolled by b and the depth scaled, so a rank offset
        # that points into the wrong batch item shows up
        feats_b = np.stack([np.roll(feats, b, axis=1) for b in range(bev_options.batch)])
        depth_b = np.stack([depth * (1.0 + 0.5 * b) for b in range(bev_options.batch)]).astype(np.float32)
        got = bev_pool_v2(depth_b, feats_b, {k: arrays[BEVPOOL_PREFIX + k] for k in BEVPOOL_ARRAYS}, grid.size)
        ref = np.stack([
            reference_frustum_pool(ctx.rig, bev_options, depth_b[b], feats_b[b]) for b in range(bev_options.batch)
        ])
        max_abs, mean_abs, psnr = compare("interop/bevpoolv2", "all", got, ref, peak)
        rows.append(VerifyRow("interop/bevpoolv2", "all", max_abs, mean_abs, psnr, f"max_abs <= {VERIFY_MAX_ABS:g}",
                              max_abs <= VERIFY_MAX_ABS, "sum pooling vs scatter-add of the recomputed frustum"))
    if "petr-coords3d" in options and all(name in arrays for name in PETR_ARRAYS):
        rows.append(_verify_petr(ctx, arrays, PetrOptions.from_dict(options["petr-coords3d"])))
    if "fastbev-lut" in options and FASTBEV_LUT_ARRAY in arrays:
        lut_options = FastBevOptions.from_dict(options["fastbev-lut"])
        for level in range(ctx.rig.n_levels):
            name = FASTBEV_LUT_ARRAY + ("" if level == 0 else f"_l{level}")
            if name not in arrays or level_of_array(name) != level:
                continue
            level_ctx = ctx if level == 0 else CheckContext(rig=ctx.rig.level(level), store_path=ctx.store_path, root_attrs=ctx.root_attrs, seed=ctx.seed)
            level_feats = feats if level == 0 else _features(level_ctx)[0]
            rows.append(_verify_fastbev(level_ctx, np.asarray(arrays[name]), lut_options, level_feats, peak, name))
    return rows


def _verify_fastbev(ctx: CheckContext, lut: np.ndarray, options: FastBevOptions, feats: np.ndarray, peak: float, name: str = FASTBEV_LUT_ARRAY) -> VerifyRow:
    """The LUT gather against the nearest feature pixel of the camera the overlap policy picks.

    The reference is independent of the LUT under test: the camera comes from the overlap policy
    applied to the float64 projection of the stored config (what the build applies), 0 where no
    camera sees the cell; the value is ``grid_sample(nearest)`` of that camera on ``grid/norm``
    (or, in a store without grid/, the nearest pixel of the float64 projection)."""
    truth = ctx.sampling_grid()
    n_cam, c, h_f, w_f = feats.shape
    cam = choose_camera(truth.coords_feature_px, truth.valid, truth.feature_size, options.overlap)
    kept = region_kept_cells(ctx.rig)
    seen = (cam >= 0) if kept is None else (cam >= 0) & kept[None]  # bev.region: 0 on cells outside it
    pick = np.clip(cam, 0, n_cam - 1)
    norm = ctx.grid_arrays.get("norm")
    if norm is not None and np.asarray(norm).shape == truth.coords_feature_px.shape:
        norm64 = np.asarray(norm, dtype=np.float64)  # (n_cam, n_h, ny, nx, 2)
        _, n_h, ny, nx, _ = norm64.shape
        align = bool(ctx.grid_attrs.get("align_corners", False))
        sampled = grid_sample(feats, norm64.reshape(n_cam, n_h * ny, nx, 2), mode="nearest", align_corners=align)
        sampled = sampled.reshape(n_cam, c, n_h, ny, nx)
        ref = np.take_along_axis(sampled, pick[None, None], axis=0)[0]
        how = "grid_sample(nearest) on grid/norm"
    else:
        uv = np.take_along_axis(truth.coords_feature_px, pick[None, ..., None], axis=0)[0]
        iuv = nearest_pixel(uv)
        flat = (pick * h_f + np.clip(iuv[..., 1], 0, h_f - 1)) * w_f + np.clip(iuv[..., 0], 0, w_f - 1)
        ref = fastbev_gather(flat, feats)
        how = "nearest pixel of the float64 projection (no grid/)"
    ref = np.where(seen, ref, 0.0)
    got = fastbev_gather(lut, feats)
    max_abs, mean_abs, psnr = compare(f"interop/{name}", "all", got, ref, peak)
    note = f"LUT gather vs {how} of the camera overlap policy {options.overlap} picks (0 where no camera sees the cell)"
    if options.precision != "float64":  # upstream's arithmetic: measured against the float64 geometry, not judged
        differ = int(np.count_nonzero(np.any(got != ref, axis=0)))
        return VerifyRow(f"interop/{name}", "all", max_abs, mean_abs, psnr, "measured", True,
                         f"{note}; {options.precision} upstream arithmetic: {differ} of {lut.size} cells differ "
                         "(ties and valid-rule edges; --strict rebuilds the arrays bit for bit)", informational=True)
    return VerifyRow(f"interop/{name}", "all", max_abs, mean_abs, psnr, f"max_abs <= {VERIFY_MAX_ABS:g}", bool(max_abs <= VERIFY_MAX_ABS), note)


def rebuild_interop(rig: RigConfig, attrs: Mapping[str, Any]) -> dict[str, Any]:
    """Every target's arrays from its recorded build options, and the group attributes
    ``export-interop`` writes (under :data:`~bevcompile.checks_api.REBUILT_ATTRS`)."""
    out: dict[str, Any] = {}
    options = _build_options(attrs)
    target_attrs: dict[str, Any] = {}
    for target, target_options in options.items():
        arrays, target_attrs[target] = build_target(rig, target, target_options)
        out.update(arrays)
    out[REBUILT_ATTRS] = interop_group_attrs(rig, options, target_attrs)
    return out
