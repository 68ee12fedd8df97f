"""The Fast-BEV look-up table. Pure numpy: config dataclasses in, arrays out (the ``interop/``
group is written by :mod:`bevcompile.interop.export`).

Fast-BEV look-up table (``--to fastbev-lut``)
---------------------------------------------
``lut[ih, iy, ix]`` int32 = ``(cam * H_f + v) * W_f + u`` of the nearest feature pixel
(``u = floor(u_f + 0.5)``, ``v = floor(v_f + 0.5)``, the VALID RULE's pixel) of the cell centre
at height ``heights[ih]`` in the camera chosen by the overlap policy, ``-1`` where no camera sees
the cell. Overlap policies (deterministic; Fast-BEV's own CUDA build is a write race):
``first`` (lowest camera index), ``last`` (highest camera index: Fast-BEV's sequential
PyTorch loop, where later cameras overwrite), ``nearest-centre`` (the camera whose sampling
point is closest, in feature pixels, to its feature map's centre ``((W_f-1)/2, (H_f-1)/2)``;
ties to the lower camera index).

BEV region (``bev.region``): the voxel grid stays the full grid's dense ``(n_heights, ny, nx)``
(Fast-BEV's ``(X, Y, Z)`` volume, so the model code is unchanged); every voxel of a fine BEV cell
outside the region is ``-1`` (reads nothing, the LUT's own invalid encoding) with ``n_views`` 0,
and every other voxel equals the full grid's LUT bit for bit. Fast-BEV has no notion of
super-cells: inside a ring (``bev.region.rings``) the LUT stays at fine resolution, each fine voxel
reading its own pixel (the rings only coarsen ``matrix/``, ``grid/``, ``gather/`` and ``delta/``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from ..conventions import FLIP_CONVENTIONS
from ..errors import UsageError
from ..grid.ipm import SamplingGrid, compute_sampling_grid
from ..matrix.lift32 import pinhole_for_float32
from ..rig.config import INTEROP_CHOICES, AxisSpec, RigConfig
from ..rig.geometry import cam_from_bev_matrix
from ..rig.region import region_table
from .bevpoolv2 import INT32_MAX

OVERLAP_POLICIES = INTEROP_CHOICES["fastbev-lut"]["overlap"]
PRECISIONS = INTEROP_CHOICES["fastbev-lut"]["precision"]
FLOAT32_POINTS = ("get_points", "cell_centres")
"""``FastBevOptions.points``: the float32 voxel points of Fast-BEV's ``get_points``, or (stores built
before it was restated) the float32 of the float64 cell centres."""


FASTBEV_LUT_ARRAY = "fastbev_lut"
FASTBEV_N_VIEWS_ARRAY = "fastbev_n_views"
FASTBEV_LUT_XYZ_ARRAY = "fastbev_lut_xyz"
FASTBEV_REGION_RULE = (
    "bev.region: the voxel grid stays dense (n_heights, ny, nx); every voxel of a fine cell outside the region is -1 "
    "(n_views 0), every other voxel equals the full grid's LUT; no super-cells: inside a ring each fine voxel reads its own pixel"
)


# --------------------------------------------------------------------------------------
# Fast-BEV LUT
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FastBevOptions:
    """``overlap``: which camera a cell seen by several takes (see module docstring).
    ``precision``: ``float64`` (default: the nearest pixel of the float64 grid, the VALID RULE,
    ties rounded half up) or ``float32`` (Fast-BEV's own op sequence in float32, see
    :func:`fastbev_lut_float32`). ``xyz_layout``: also write the LUT in Fast-BEV's voxel order
    ``(X, Y, Z)`` (``fastbev_lut_xyz``). ``points`` (float32 only): how the float32 voxel points
    are made: ``get_points`` (Fast-BEV's own float32 arithmetic, :func:`fastbev_points_float32`;
    every float32 build records it) or ``cell_centres`` (the float32 of the float64 cell centres:
    what float32 stores built before ``get_points`` was restated hold, which record no ``points``;
    the two differ only where the step or the points are not exact in float32, e.g. 1 of 16,384
    cells on the 0.8 m nuScenes grid, and the 2/3 m grid of Fast-BEV R50 v4's level 1)."""

    overlap: str = "first"
    precision: str = "float64"
    xyz_layout: bool = False
    points: str = "get_points"

    def validate(self) -> None:
        if self.overlap not in OVERLAP_POLICIES:
            raise UsageError(f"--overlap must be one of {', '.join(OVERLAP_POLICIES)}, got {self.overlap!r}")
        if self.precision not in PRECISIONS:
            raise UsageError(f"--precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if not isinstance(self.xyz_layout, bool):
            raise UsageError(f"fastbev-lut xyz_layout must be a boolean, got {self.xyz_layout!r}")
        if self.points not in FLOAT32_POINTS:
            raise UsageError(f"fastbev-lut points must be one of {', '.join(FLOAT32_POINTS)}, got {self.points!r}")

    def to_dict(self) -> dict[str, Any]:
        """The recorded build options; the defaults of later options are left out, so stores
        written before they existed keep their bytes (``points`` is recorded with float32 only)."""
        out: dict[str, Any] = {"overlap": self.overlap}
        if self.precision != "float64":
            out["precision"] = self.precision
            out["points"] = self.points
        if self.xyz_layout:
            out["xyz_layout"] = True
        return out

    @classmethod
    def from_dict(cls, data: Any) -> FastBevOptions:
        if not isinstance(data, dict):
            raise UsageError(f"fastbev-lut build_options must be a mapping, got {type(data).__name__}")
        unknown = set(data) - {"overlap", "precision", "xyz_layout", "points"}
        if unknown:
            raise UsageError(f"unknown fastbev-lut build option(s): {', '.join(sorted(unknown))}")
        precision = str(data.get("precision", "float64"))
        options = cls(
            overlap=str(data.get("overlap", "first")),
            precision=precision,
            xyz_layout=data.get("xyz_layout", False),
            # a float32 store that records no points was built with the cell centres' float32
            points=str(data.get("points", "cell_centres" if precision == "float32" else "get_points")),
        )
        options.validate()
        return options


@dataclass(frozen=True)
class FastBevLut:
    """Convention: ``lut`` int32 ``(n_heights, ny, nx)``, value ``(cam * H_f + v) * W_f + u``
    or -1; ``n_views`` uint8 ``(n_heights, ny, nx)`` is how many cameras see each cell (both -1 / 0
    on the ``n_outside`` voxels of cells outside a ``bev.region``)."""

    lut: npt.NDArray[np.int32]
    n_views: npt.NDArray[np.uint8]
    feature_size: tuple[int, int]
    options: FastBevOptions
    n_outside: int = 0

    @property
    def n_seen(self) -> int:
        return int(np.count_nonzero(self.lut >= 0))

    @property
    def n_overlap(self) -> int:
        return int(np.count_nonzero(self.n_views > 1))


def nearest_pixel(uv_feature_px: np.ndarray) -> npt.NDArray[np.int64]:
    """Nearest feature pixel ``floor(uv + 0.5)`` (the VALID RULE's pixel; round half up).

    Convention: ``(..., 2)`` float ``(u, v)`` -> int64 ``(..., 2)`` ``(u, v)``.
    """
    uv = np.asarray(uv_feature_px, dtype=np.float64)
    return np.floor(np.where(np.isfinite(uv), uv, -2.0) + 0.5).astype(np.int64)


def choose_camera(
    coords_feature_px: np.ndarray, valid: np.ndarray, feature_size: tuple[int, int], overlap: str
) -> npt.NDArray[np.int64]:
    """Camera index each cell takes under an overlap policy, -1 where no camera sees it.

    Convention:
        coords_feature_px ``(n_cam, ...,  2)`` float ``(u, v)``; valid bool ``(n_cam, ...)``.
        returns int64 ``(...)``.
    """
    n_cam = valid.shape[0]
    seen = valid.any(axis=0)
    if overlap == "first":
        cam = np.argmax(valid, axis=0)
    elif overlap == "last":
        cam = n_cam - 1 - np.argmax(valid[::-1], axis=0)
    elif overlap == "nearest-centre":
        w_f, h_f = feature_size
        centre = np.array([(w_f - 1) / 2.0, (h_f - 1) / 2.0])
        uv = np.asarray(coords_feature_px, dtype=np.float64)
        dist2 = np.sum((uv - centre) ** 2, axis=-1)
        dist2 = np.where(valid, dist2, np.inf)
        cam = np.argmin(dist2, axis=0)  # first minimum: ties go to the lower camera index
    else:
        raise UsageError(f"--overlap must be one of {', '.join(OVERLAP_POLICIES)}, got {overlap!r}")
    return np.where(seen, cam, -1).astype(np.int64)


def fastbev_lut_from_grid(grid: SamplingGrid, options: FastBevOptions | None = None) -> FastBevLut:
    """The Fast-BEV LUT from an IPM sampling grid (float64 coords and the VALID RULE)."""
    options = options or FastBevOptions()
    options.validate()
    w_f, h_f = grid.feature_size
    n_cam = grid.valid.shape[0]
    if n_cam * h_f * w_f > INT32_MAX:
        raise UsageError(f"{n_cam} x {h_f} x {w_f} feature pixels do not fit an int32 LUT")
    cam = choose_camera(grid.coords_feature_px, grid.valid, grid.feature_size, options.overlap)
    pick = np.clip(cam, 0, n_cam - 1)
    uv = np.take_along_axis(grid.coords_feature_px, pick[None, ..., None], axis=0)[0]
    iuv = nearest_pixel(uv)
    lut = np.where(cam >= 0, (cam * h_f + iuv[..., 1]) * w_f + iuv[..., 0], -1).astype(np.int32)
    n_views = grid.valid.sum(axis=0).astype(np.uint8)
    return FastBevLut(lut, n_views, grid.feature_size, options)


def fastbev_projection_float32(rig: RigConfig, cam_index: int) -> npt.NDArray[np.float32]:
    """Fast-BEV's float32 ``projection`` (3 x 4) of one camera, restated (``rts2proj`` +
    ``_compute_projection``): ``viewpad = post_rot @ K`` with ``post_rot = float32(resize)`` (a torch
    tensor), ``viewpad[:, 2] += post_tran = -crop``, ``lidar2img = float32(viewpad @ cam_from_bev)``
    in float64, then ``diag(1/s, 1/s, 1) @ lidar2img[:3]`` in float32 (``intrinsic[:2] /= stride``).
    ``image_aug.flip`` (``img_transform``'s flip, the second pass of ``TestTimeAugImageMultiViewImage``):
    ``post_rot = diag(-resize, resize)``, ``post_tran = (float32(crop_left + W_crop), -crop_top)``
    (Sense-GVT/Fast-BEV mmdet3d/datasets/pipelines/transforms_3d.py @feacd87)."""
    camera = pinhole_for_float32(rig, cam_index, "Fast-BEV's pinhole projection", flip=True)
    aug = camera.image_aug
    resize = float(np.float32(aug.resize))
    k = np.array(camera.intrinsic, dtype=np.float64)
    viewpad = np.eye(4)
    if aug.flip:  # img_transform: post_rot = [[-1, 0], [0, 1]] @ post_rot, post_tran = [[-1, 0], [0, 1]] @ post_tran + [W_crop, 0]
        viewpad[:3, :3] = np.diag([-resize, resize, 1.0]) @ k
        viewpad[0, 2] += float(np.float32(aug.crop_left) + np.float32(aug.crop_width))
    else:
        viewpad[:3, :3] = np.diag([resize, resize, 1.0]) @ k
        viewpad[0, 2] += -float(np.float32(aug.crop_left))
    viewpad[1, 2] += -float(np.float32(aug.crop_top))
    lidar2img = (viewpad @ cam_from_bev_matrix(rig, camera)).astype(np.float32)
    scale = np.float32(1.0) / np.float32(rig.feature.stride)
    projection = lidar2img[:3].copy()
    projection[:2] = projection[:2] * scale
    return projection


def fastbev_points_float32(axis: AxisSpec) -> npt.NDArray[np.float32]:
    """Fast-BEV's ``get_points`` along one BEV axis in float32 (Sense-GVT/Fast-BEV
    mmdet3d/models/detectors/fastbev.py @b060323): ``new_origin = origin - n / 2 * voxel_size`` and
    ``points = arange(n) * voxel_size + new_origin``, every operation a float32 tensor op (one
    rounding each), with ``voxel_size = float32(step)`` and ``origin = float32(min + step / 2 + n step / 2)``,
    the centre of the voxel points' range (the cell centres are Fast-BEV's voxel points:
    ``KittiSetOrigin``'s ``point_cloud_range`` centre for a preset's grid). For a step and points that
    float32 holds exactly (0.5 m, 1 m) this is the float32 of the cell centres; for 2/3 m it is not
    (``float32(2/3) i`` rounds)."""
    f32 = np.float32
    size = f32(axis.step)
    origin = f32(axis.min + axis.step / 2.0 + axis.n * axis.step / 2.0)
    new_origin = origin - f32(axis.n) / f32(2.0) * size
    out: npt.NDArray[np.float32] = np.arange(axis.n).astype(f32) * size + new_origin
    return out


def fastbev_lut_float32(rig: RigConfig, options: FastBevOptions | None = None) -> FastBevLut:
    """The LUT Fast-BEV's own code computes, in its float32 arithmetic (``backproject_inplace``):
    the voxel points in float32 (:func:`fastbev_points_float32`; the heights ``float32(bev.heights)``),
    ``p = projection @ (x, y, z, 1)`` (:func:`fastbev_projection_float32`;
    products summed in order), ``u = round(p0 / p2)``, ``v = round(p1 / p2)`` rounded half to even
    (``torch.round``), valid iff ``0 <= u < W_f``, ``0 <= v < H_f`` and ``p2 > 0``; then the overlap
    policy (``last`` = Fast-BEV's loop, later cameras overwriting). Pinhole cameras only."""
    options = options or FastBevOptions(precision="float32")
    options.validate()
    bev = rig.bev
    w_f, h_f = rig.feature_size
    n_h = len(bev.heights)
    if options.points == "get_points":
        xs, ys = fastbev_points_float32(bev.x), fastbev_points_float32(bev.y)
    else:
        xs = (bev.x.min + (np.arange(bev.nx, dtype=np.float64) + 0.5) * bev.x.step).astype(np.float32)
        ys = (bev.y.min + (np.arange(bev.ny, dtype=np.float64) + 0.5) * bev.y.step).astype(np.float32)
    hs = np.asarray(bev.heights, dtype=np.float64).astype(np.float32)
    z, y, x = np.meshgrid(hs, ys, xs, indexing="ij")  # (n_h, ny, nx)
    coords = np.full((rig.n_cam, n_h, bev.ny, bev.nx, 2), -2.0, dtype=np.float64)
    valid = np.zeros((rig.n_cam, n_h, bev.ny, bev.nx), dtype=bool)
    pixel = np.zeros((rig.n_cam, n_h, bev.ny, bev.nx), dtype=np.int64)
    for cam_index in range(rig.n_cam):
        m = fastbev_projection_float32(rig, cam_index)
        p = [((m[i, 0] * x + m[i, 1] * y) + m[i, 2] * z) + m[i, 3] for i in range(3)]
        with np.errstate(divide="ignore", invalid="ignore"):
            u_f, v_f = p[0] / p[2], p[1] / p[2]
        u, v = np.rint(u_f), np.rint(v_f)  # half to even, as torch.round
        ok = (u >= 0) & (v >= 0) & (u < w_f) & (v < h_f) & (p[2] > 0)
        valid[cam_index] = ok
        coords[cam_index] = np.where(ok[..., None], np.stack([u_f, v_f], axis=-1).astype(np.float64), -2.0)
        pixel[cam_index] = np.where(ok, (cam_index * h_f + np.where(ok, v, 0).astype(np.int64)) * w_f + np.where(ok, u, 0).astype(np.int64), -1)
    cam = choose_camera(coords, valid, (w_f, h_f), options.overlap)
    pick = np.clip(cam, 0, rig.n_cam - 1)
    chosen = np.take_along_axis(pixel, pick[None], axis=0)[0]
    lut = np.where(cam >= 0, chosen, -1).astype(np.int32)
    return FastBevLut(lut, valid.sum(axis=0).astype(np.uint8), (w_f, h_f), options)


def build_fastbev_lut(rig: RigConfig, options: FastBevOptions | None = None) -> FastBevLut:
    """The Fast-BEV LUT of ``rig`` (a single feature level; recomputes the grid; deterministic),
    restricted to ``bev.region`` when the rig has one (:func:`restrict_to_region`)."""
    options = options or FastBevOptions()
    options.validate()
    if options.precision == "float32":
        full = fastbev_lut_float32(rig, options)
    else:
        full = fastbev_lut_from_grid(compute_sampling_grid(rig), options)
    kept = region_kept_cells(rig)
    return full if kept is None else restrict_to_region(full, kept)


def region_kept_cells(rig: RigConfig) -> npt.NDArray[np.bool_] | None:
    """``(ny, nx)`` bool: the fine BEV cells inside ``bev.region`` (``expand < n_kept``, super-cells'
    fine cells included); None without a region."""
    if rig.bev.region is None:
        return None
    return region_table(rig.bev).fine_kept().reshape(rig.bev.ny, rig.bev.nx)


def restrict_to_region(full: FastBevLut, kept: npt.NDArray[np.bool_]) -> FastBevLut:
    """The full grid's LUT with every voxel of a cell outside the region invalid: ``lut`` -1 and
    ``n_views`` 0 there, unchanged elsewhere; the shape stays ``(n_heights, ny, nx)``.

    Convention: kept bool ``(ny, nx)`` (:func:`region_kept_cells`), broadcast over the heights.
    """
    inside = np.broadcast_to(np.asarray(kept, dtype=bool)[None], full.lut.shape)
    lut = np.where(inside, full.lut, np.int32(-1)).astype(np.int32)
    n_views = np.where(inside, full.n_views, np.uint8(0)).astype(np.uint8)
    return FastBevLut(lut, n_views, full.feature_size, full.options, int(np.count_nonzero(~inside)))


def fastbev_level_arrays(rig: RigConfig, options: FastBevOptions) -> tuple[dict[str, np.ndarray], list[FastBevLut]]:
    """Every feature level's LUT (``feature.levels``: Fast-BEV's multi-stride volumes):
    ``fastbev_lut``/``fastbev_n_views`` for level 0, ``fastbev_lut_l<l>``/``fastbev_n_views_l<l>``
    for level ``l``, and with ``xyz_layout`` each LUT also as ``fastbev_lut_xyz[_l<l>]``."""
    arrays: dict[str, np.ndarray] = {}
    luts: list[FastBevLut] = []
    for level in range(rig.n_levels):
        result = build_fastbev_lut(rig.level(level), options)
        suffix = "" if level == 0 else f"_l{level}"
        arrays[f"{FASTBEV_LUT_ARRAY}{suffix}"] = result.lut
        arrays[f"{FASTBEV_N_VIEWS_ARRAY}{suffix}"] = result.n_views
        if options.xyz_layout:
            arrays[f"{FASTBEV_LUT_XYZ_ARRAY}{suffix}"] = xyz_layout(result.lut)
        luts.append(result)
    return arrays, luts


def xyz_layout(lut: np.ndarray) -> npt.NDArray[np.int32]:
    """The LUT in Fast-BEV's voxel order: ``(n_heights, ny, nx)`` -> ``(nx, ny, n_heights)``, so
    ``lut_xyz.reshape(-1)[(ix * ny + iy) * nz + iz]`` is the voxel ``backproject_inplace``
    enumerates there (``points.view(3, -1)`` of ``meshgrid(arange(X), arange(Y), arange(Z))``)."""
    return np.ascontiguousarray(np.transpose(np.asarray(lut), (2, 1, 0)), dtype=np.int32)


def level_of_array(name: str) -> int:
    """The feature level of a LUT array name (``fastbev_lut_l2`` -> 2; 0 without a suffix)."""
    base, _, tail = name.rpartition("_l")
    return int(tail) if base and tail.isdigit() else 0


def fastbev_gather(lut: np.ndarray, features: np.ndarray) -> npt.NDArray[np.float64]:
    """Apply a Fast-BEV LUT: ``out[c, cell] = features.flat_rows[lut[cell], c]``, 0 where -1.

    Convention: lut int ``(...)``; features ``(n_cam, C, H_f, W_f)``; returns float64 ``(C, ...)``.
    """
    n_cam, c, h_f, w_f = features.shape
    rows = np.moveaxis(np.asarray(features, dtype=np.float64), 1, 0).reshape(c, n_cam * h_f * w_f)
    index = np.asarray(lut, dtype=np.int64)
    return np.where(index >= 0, rows[:, np.clip(index, 0, None)], 0.0)


def fastbev_attrs(luts: list[FastBevLut], rig: RigConfig) -> dict[str, Any]:
    """The ``interop/`` attributes of the Fast-BEV LUT(s): formulas and measured figures (level 0
    at the top level, every level under ``levels`` when ``feature.levels`` lists several)."""
    result = luts[0]
    options = result.options
    w_f, h_f = result.feature_size
    attrs: dict[str, Any] = {
        "shape_order": "(n_heights, ny, nx)",
        "heights": list(rig.bev.heights),
        "feature_size": [w_f, h_f],
        "value": "(cam * H_f + v) * W_f + u of the nearest feature pixel, -1 where no camera sees the cell",
        "nearest_pixel": (
            "u = floor(u_f + 0.5), v = floor(v_f + 0.5) of grid coords (the VALID RULE's pixel)"
            if options.precision == "float64"
            else "Fast-BEV's float32 backproject_inplace: u = round_half_even(p0 / p2), v = round_half_even(p1 / p2) of "
            "p = projection @ (x, y, z, 1) in float32; valid iff 0 <= u < W_f, 0 <= v < H_f, p2 > 0"
        ),
        "overlap": options.overlap,
        "overlap_rule": {
            "first": "lowest camera index that sees the cell",
            "last": "highest camera index that sees the cell (Fast-BEV's sequential loop: later cameras overwrite)",
            "nearest-centre": "camera whose sampling point is closest (feature px) to ((W_f-1)/2, (H_f-1)/2); ties to the lower index",
        }[options.overlap],
        "n_cells": int(result.lut.size),
        "n_seen": result.n_seen,
        "n_overlap": result.n_overlap,
    }
    if options.precision != "float64":
        attrs["precision"] = options.precision
        if options.points == "get_points":  # a store built before (cell centres) has no such attribute: its rebuild neither
            attrs["points"] = "Fast-BEV's get_points in float32: arange(n) * float32(step) + (origin - n / 2 * float32(step)), origin the centre of the points' range"
    if any(camera.image_aug.flip for camera in rig.cameras):
        attrs["flip"] = FLIP_CONVENTIONS["image_flip"]
    if rig.bev.region is not None:
        attrs["region"] = {
            "rule": FASTBEV_REGION_RULE,
            "n_cells_outside": result.n_outside,
            "n_fine_cells_inside": int(region_table(rig.bev).n_fine_kept),
        }
    if options.xyz_layout:
        attrs["xyz_layout"] = (
            "fastbev_lut_xyz[ix, iy, ih] = fastbev_lut[ih, iy, ix]: Fast-BEV's voxel order (X, Y, Z); "
            "volume (C, X, Y, Z) = feats_rows[:, lut_xyz] (0 where -1), then (Z*C, X, Y) = volume.permute(3, 0, 1, 2).reshape(Z*C, X, Y)"
        )
    if len(luts) > 1:
        attrs["levels"] = [
            {"level": i, "arrays": [f"fastbev_lut{'' if i == 0 else f'_l{i}'}"], "feature_size": list(lut.feature_size),
             "n_seen": lut.n_seen, "n_overlap": lut.n_overlap}
            | ({"shape": list(lut.lut.shape), "heights": list(rig.level(i).bev.heights), "own_grid": rig.feature.levels[i].bev is not None}
               if rig.has_level_grids else {})
            for i, lut in enumerate(luts)
        ]
    return attrs
