"""BEVDet's BEVPoolv2 arrays. Pure numpy: config dataclasses in, arrays out (the ``interop/``
group is written by :mod:`bevcompile.interop.export`).

BEVDet BEVPoolv2 (``--to bevpoolv2``)
-------------------------------------
The five int32 arrays BEVDet's ``voxel_pooling_prepare_v2`` computes and that ``bev_pool_v2``
(CUDA) and its TensorRT plug-in (``TRTBEVPoolv2``) take as inputs, for a fixed batch size
``B`` (``--batch``, default 1; a TensorRT engine is built for one batch size):

* ``ranks_depth[i] = (((b * n_cam + cam) * D + d) * H_f + v) * W_f + u`` — the kept frustum
  point's index into the depth probabilities ``(B, n_cam, D, H_f, W_f)``;
* ``ranks_feat[i] = ((b * n_cam + cam) * H_f + v) * W_f + u`` — its row in the channels-last
  features ``(B, n_cam, H_f, W_f, C)``;
* ``ranks_bev[i] = ((b * Z + z) * Y + y) * X + x`` — its voxel in the ``(B, Z, Y, X)`` output
  (with a ``bev.region``, points in BEV cells outside the region are dropped; the grid stays dense);
* ``interval_starts``, ``interval_lengths`` — the runs of equal ``ranks_bev``.

These are BEVDet's ``voxel_pooling_prepare_v2`` formulas (its batch index is the most
significant digit of every rank). Points are enumerated in ``ranks_depth`` order, the ones
outside the voxel grid dropped, and the rest sorted by ``ranks_bev`` with a STABLE sort, so
inside a voxel the points stay in increasing ``ranks_depth`` order: the arrays are
deterministic (BEVDet's ``argsort`` is not). The rig is the same for every batch item, so the
batch-``B`` arrays are the batch-1 arrays repeated ``B`` times with the rank offsets above
(and ``interval_starts`` offset by ``b * n_kept_1``).
Pooling: ``bev[ranks_bev[i], :] += depth.flat[ranks_depth[i]] * feat_rows[ranks_feat[i], :]``.

Frustum point of ``(cam, d, v, u)``: the feature pixel ``(u, v)`` mapped to the network input
(``linspace`` — BEVDet's ``torch.linspace(0, W_in - 1, W_f)`` — or the rig's ``stride``
mapping), through the image augmentation and the lens model, at depth ``d_k`` along the
optical axis, into the BEV frame (``bev.frame``; :func:`bevcompile.rig.geometry.unproject_feature_to_bev`).
Voxel coordinate: ``c = (p - lower) / step`` per axis (x, y, z; float64), then ``trunc``
(toward zero, BEVDet's ``.long()``: points up to one voxel *below* the lower bound land in
voxel 0) or ``floor``; kept iff ``0 <= c < n`` on every axis.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import numpy.typing as npt

from ..errors import UsageError
from ..matrix.entries import (
    BevBox,
    CameraPlan,
    CameraRays,
    block_columns,
    block_coordinates,
    block_pieces,
    camera_rays,
    own_plan,
    plan_blocks,
    plan_camera,
    plan_jobs,
)
from ..matrix.lift32 import bevdet_points_float32, scaled_float32
from ..matrix.topk import local_rows
from ..memory import release_free_memory
from ..parallel import ordered_map, resolve_jobs
from ..progress import ProgressFn
from ..rig.config import INTEROP_CHOICES, FeatureSpec, RigConfig
from ..rig.region import region_table

FRUSTUM_MAPPINGS = INTEROP_CHOICES["bevpoolv2"]["frustum_mapping"]
ROUNDINGS = INTEROP_CHOICES["bevpoolv2"]["rounding"]
PRECISIONS = INTEROP_CHOICES["bevpoolv2"]["precision"]
ORDERS = INTEROP_CHOICES["bevpoolv2"]["order"]
BEVPOOL_ARRAYS = ("ranks_bev", "ranks_depth", "ranks_feat", "interval_starts", "interval_lengths")
BEVPOOL_PREFIX = "bevpoolv2_"
INT32_MAX = np.iinfo(np.int32).max
MAX_BATCH = 256


# --------------------------------------------------------------------------------------
# BEVPoolv2
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BevPoolOptions:
    """How the BEVPoolv2 arrays are built (recorded as ``build_options``).

    ``frustum_mapping``: ``linspace`` (BEVDet's frustum), ``stride``, or ``rig`` (the rig's
    ``feature.pixel_mapping``, as ``matrix/`` uses). ``rounding``: ``trunc`` (BEVDet's
    ``.long()``) or ``floor``. ``z_bins``: voxels along z over the rig's ``bev.z`` range
    (``None``: the rig's own ``bev.z`` bins; BEVDet-R50 uses one). ``batch``: the batch size
    ``B`` the arrays are laid out for (1 to :data:`MAX_BATCH`). ``precision``: ``float64``
    (default: the exact geometry) or ``float32`` (BEVDet's own op sequence in float32,
    :func:`bevdet_points_float32`; linspace frustum, pinhole cameras). ``order``: the order of
    the points inside a voxel, ``stable`` (default: increasing ``ranks_depth``, deterministic) or
    ``torch`` (BEVDet's own ``ranks_bev.argsort()`` called on the installed torch, on CUDA when
    available, else the CPU: the order a run of BEVDet with that torch and device gives; the
    torch version and device are recorded in the group's ``bevpoolv2.sort`` attribute).
    """

    frustum_mapping: str = "linspace"
    rounding: str = "trunc"
    z_bins: int | None = None
    batch: int = 1
    precision: str = "float64"
    order: str = "stable"

    def validate(self) -> None:
        if self.frustum_mapping not in FRUSTUM_MAPPINGS:
            raise UsageError(f"--frustum-mapping must be one of {', '.join(FRUSTUM_MAPPINGS)}, got {self.frustum_mapping!r}")
        if self.rounding not in ROUNDINGS:
            raise UsageError(f"--rounding must be one of {', '.join(ROUNDINGS)}, got {self.rounding!r}")
        if self.z_bins is not None and not 1 <= self.z_bins <= 4096:
            raise UsageError(f"--z-bins must be in [1, 4096], got {self.z_bins}")
        if isinstance(self.batch, bool) or not isinstance(self.batch, int) or not 1 <= self.batch <= MAX_BATCH:
            raise UsageError(f"--batch must be an integer in [1, {MAX_BATCH}], got {self.batch!r}")
        if self.precision not in PRECISIONS:
            raise UsageError(f"--precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if self.order not in ORDERS:
            raise UsageError(f"interop.bevpoolv2.order must be one of {', '.join(ORDERS)}, got {self.order!r}")
        if self.precision == "float32" and self.frustum_mapping != "linspace":
            raise UsageError(
                f"--precision float32 restates BEVDet's own frustum (linspace); --frustum-mapping {self.frustum_mapping} "
                "has no upstream float32 code path (use --precision float64)"
            )

    def to_dict(self) -> dict[str, Any]:
        """The recorded build options; ``precision`` only when not the default (older stores keep their bytes)."""
        out: dict[str, Any] = {"frustum_mapping": self.frustum_mapping, "rounding": self.rounding, "z_bins": self.z_bins, "batch": self.batch}
        if self.precision != "float64":
            out["precision"] = self.precision
        if self.order != "stable":
            out["order"] = self.order
        return out

    @classmethod
    def from_dict(cls, data: Any) -> BevPoolOptions:
        if not isinstance(data, dict):
            raise UsageError(f"bevpoolv2 build_options must be a mapping, got {type(data).__name__}")
        unknown = set(data) - {"frustum_mapping", "rounding", "z_bins", "batch", "precision", "order"}
        if unknown:
            raise UsageError(f"unknown bevpoolv2 build option(s): {', '.join(sorted(unknown))}")
        z_bins = data.get("z_bins")
        batch = data.get("batch", 1)  # stores written before --batch existed are batch 1
        if isinstance(batch, bool) or not isinstance(batch, int):
            raise UsageError(f"bevpoolv2 build option batch must be an integer, got {batch!r}")
        options = cls(
            frustum_mapping=str(data.get("frustum_mapping", "linspace")),
            rounding=str(data.get("rounding", "trunc")),
            z_bins=None if z_bins is None else int(z_bins),
            batch=batch,
            precision=str(data.get("precision", "float64")),
            order=str(data.get("order", "stable")),
        )
        options.validate()
        return options


@dataclass(frozen=True)
class VoxelGrid:
    """The voxel grid of the pooling: lower bounds, steps and counts per axis ``(x, y, z)``."""

    lower: tuple[float, float, float]
    step: tuple[float, float, float]
    size: tuple[int, int, int]  # (X, Y, Z) = (nx, ny, nz)

    @property
    def n_voxels(self) -> int:
        return self.size[0] * self.size[1] * self.size[2]


def voxel_grid(rig: RigConfig, z_bins: int | None) -> VoxelGrid:
    """The rig's BEV x/y cells and its ``bev.z`` range split into ``z_bins`` voxels."""
    bev = rig.bev
    nz = bev.z.n if z_bins is None else z_bins
    z_step = bev.z.step if z_bins is None else (bev.z.max - bev.z.min) / z_bins
    return VoxelGrid((bev.x.min, bev.y.min, bev.z.min), (bev.x.step, bev.y.step, z_step), (bev.nx, bev.ny, nz))


def frustum_rig(rig: RigConfig, mapping: str) -> RigConfig:
    """``rig`` with its feature pixel mapping replaced (``rig`` keeps it)."""
    if mapping == "rig" or mapping == rig.feature.pixel_mapping:
        return rig
    return replace(rig, feature=FeatureSpec(rig.feature.stride, mapping, rig.feature.size_rule))


def frustum_shape(rig: RigConfig) -> tuple[int, int, int, int]:
    """``(n_cam, D, H_f, W_f)``: the shape of the depth probabilities (and of the frustum)."""
    w_f, h_f = rig.feature_size
    return rig.n_cam, rig.depth.n_bins, h_f, w_f


def frustum_points_bev(
    rig: RigConfig, cam_index: int, depth_slice: slice | None = None, rays: CameraRays | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """BEV-frame coordinates of one camera's LSS frustum points.

    Convention:
        returns ``points_bev`` float64 ``(D', H_f, W_f, 3)`` metres (x, y, z) in the BEV frame, for
        depth bins ``depth_slice`` (default all), pixel ``(u, v)`` = feature pixel centre under
        ``rig.feature.pixel_mapping``, depth along the optical axis; and ``ok`` bool
        ``(D', H_f, W_f)`` (False where the pixel has no preimage under the lens model; those
        points are NaN). The arithmetic is the ``matrix/`` builder's, term for term
        (``origin_bev + d * ray_bev`` with the rays of
        :func:`bevcompile.matrix.entries.camera_rays`), so a point on a voxel boundary falls on
        the same side in both products.
    """
    camera_rays_ = rays if rays is not None else camera_rays(rig, cam_index)
    w_f, h_f = rig.feature_size
    depths = np.asarray(rig.depth.values(), dtype=np.float64)
    if depth_slice is not None:
        depths = depths[depth_slice]
    points_bev = np.full((depths.size, h_f * w_f, 3), np.nan, dtype=np.float64)
    pixels = camera_rays_.pixel_index
    for axis in range(3):
        points_bev[:, pixels, axis] = camera_rays_.origin_bev[axis] + depths[:, None] * camera_rays_.ray_bev[axis][None, :]
    ok = np.zeros(h_f * w_f, dtype=bool)
    ok[pixels] = True
    shape = (depths.size, h_f, w_f)
    return points_bev.reshape(*shape, 3), np.broadcast_to(ok.reshape(h_f, w_f), shape)


def _voxel_scaled(points_bev: np.ndarray, grid: VoxelGrid, rounding: str, dtype: type[np.floating[Any]] = np.float64) -> tuple[np.ndarray, np.ndarray]:
    """``(f, kept)``: ``f = (p - lower) / step`` ``(..., 3)`` in ``dtype`` and the keep mask
    (``np.float32``: float32 ``lower``/``step``, BEVDet's tensors, each rounded once from float64).

    ``trunc(f) in [0, n)`` iff ``-1 < f < n``; ``floor(f) in [0, n)`` iff ``0 <= f < n``; NaN
    fails every comparison, so unprojectable points are never kept.
    """
    if dtype is np.float32:
        scaled: np.ndarray = scaled_float32(points_bev, grid.lower, grid.step)
    else:
        scaled = (np.asarray(points_bev, dtype=np.float64) - np.asarray(grid.lower)) / np.asarray(grid.step)
    kept = np.ones(scaled.shape[:-1], dtype=bool)
    for axis, n in enumerate(grid.size):
        f = scaled[..., axis]
        kept &= (f > -1.0) if rounding == "trunc" else (f >= 0.0)
        kept &= f < n
    return scaled, kept


def voxel_coords(points_bev: np.ndarray, grid: VoxelGrid, rounding: str) -> tuple[np.ndarray, np.ndarray]:
    """Voxel coordinates of points.

    Convention:
        points_bev ``(..., 3)`` float64 metres (x, y, z), BEV frame; returns int64 ``(..., 3)`` voxel
        ``(ix, iy, iz)`` = ``trunc`` or ``floor`` of ``(p - lower) / step`` and ``kept`` bool
        ``(...)``: finite and ``0 <= i < size`` on every axis (index 0 where not kept).
    """
    scaled, kept = _voxel_scaled(points_bev, grid, rounding)
    coords = np.zeros(scaled.shape, dtype=np.int64)
    # kept values are > -1 (trunc) or >= 0 (floor): a cast truncates toward zero = the rounding
    coords[kept] = scaled[kept].astype(np.int64)
    return coords, kept


@dataclass(frozen=True)
class BevPoolV2Arrays:
    """BEVDet BEVPoolv2 inputs (batch ``options.batch``) and the facts needed to use them.

    Convention:
        all arrays int32, 1-D. ``ranks_*`` have one entry per kept frustum point (of every batch
        item), sorted by ``ranks_bev`` (stable: ``ranks_depth`` ascending inside a voxel);
        ``interval_*`` one entry per occupied voxel. ``depth_shape = (n_cam, D, H_f, W_f)`` per
        batch item; ``grid_size = (X, Y, Z)``; output ``(B, Z, Y, X, C)`` (BEVDet's
        ``bev_feat_shape``).
    """

    ranks_bev: npt.NDArray[np.int32]
    ranks_depth: npt.NDArray[np.int32]
    ranks_feat: npt.NDArray[np.int32]
    interval_starts: npt.NDArray[np.int32]
    interval_lengths: npt.NDArray[np.int32]
    depth_shape: tuple[int, int, int, int]
    grid: VoxelGrid
    options: BevPoolOptions
    bev_frame: str = "ego"

    @property
    def batch(self) -> int:
        return self.options.batch

    @property
    def n_points(self) -> int:
        """Frustum points of all batch items."""
        n_cam, d, h, w = self.depth_shape
        return self.batch * n_cam * d * h * w

    @property
    def n_kept(self) -> int:
        return int(self.ranks_bev.size)

    @property
    def n_intervals(self) -> int:
        return int(self.interval_starts.size)

    @property
    def max_interval_length(self) -> int:
        return int(self.interval_lengths.max()) if self.interval_lengths.size else 0

    def arrays(self) -> dict[str, np.ndarray]:
        return {name: getattr(self, name) for name in BEVPOOL_ARRAYS}


def build_bevpoolv2(
    rig: RigConfig, options: BevPoolOptions | None = None, progress: ProgressFn | None = None, *, jobs: int | None = None
) -> BevPoolV2Arrays:
    """BEVDet ``voxel_pooling_prepare_v2`` for ``rig`` (batch ``options.batch``), with a stable sort,
    by ``jobs`` threads (default: the cores this process may use; the arrays do not depend on it).

    A counting sort in two streamed passes over the frustum blocks of the ``matrix/`` build
    (:func:`bevcompile.matrix.entries.plan_blocks`: per camera the rays culled to the voxel box,
    ~131 k live points or one depth bin per block, computed in pieces of at most ~131 k points):
    pass 1 counts the kept points of every voxel per block; the voxel counts give
    ``interval_starts`` / ``interval_lengths`` and, summed in block order, each block's first slot
    per voxel; pass 2 recomputes the points and writes each block's ``ranks_depth`` /
    ``ranks_feat`` straight into their final slots (stable: blocks are in ``ranks_depth`` order,
    and inside a block a voxel's points are placed by increasing ``ranks_depth``). So the only large arrays are the outputs. ``progress(n)`` is called with the
    frustum points of each block in each pass (total ``2 * n_cam * D * H_f * W_f``: the geometry is
    computed once and repeated for every batch item).
    """
    options = options or BevPoolOptions()
    options.validate()
    jobs = resolve_jobs(jobs)
    frig = frustum_rig(rig, options.frustum_mapping)
    grid = voxel_grid(rig, options.z_bins)
    n_cam, n_d, h_f, w_f = frustum_shape(rig)
    n_points = n_cam * n_d * h_f * w_f
    batch = options.batch
    if batch * n_points > INT32_MAX or batch * grid.n_voxels > INT32_MAX:
        raise UsageError(
            f"batch {batch} x {n_points:,} frustum points / {grid.n_voxels:,} voxels do not fit BEVPoolv2's int32 ranks"
        )
    if options.precision == "float32":  # BEVDet's own float32 op sequence: per camera, one sort
        ranks_bev, ranks_depth, ranks_feat, starts, lengths = _float32_ranks(frig, grid, options.rounding, batch, progress)
        n_kept = int(lengths.sum())
    else:
        voxels = _Voxelizer(frig, grid, options.rounding, jobs)
        blocks = voxels.blocks
        # pass 1: the kept points of every voxel, per block
        per_block: list[tuple[np.ndarray, np.ndarray]] = []
        total = np.zeros(grid.n_voxels, dtype=np.int64)
        for block, (touched, counts) in zip(blocks, ordered_map(voxels.count, blocks, jobs), strict=True):
            total[touched] += counts
            per_block.append((touched, counts))
            if progress is not None:
                progress(voxels.work_units(block))
        occupied = np.flatnonzero(total)
        lengths = total[occupied]
        del total
        n_kept = int(lengths.sum())
        starts = np.zeros(occupied.size, dtype=np.int64)
        np.cumsum(lengths[:-1], out=starts[1:])
        cursor = np.zeros(grid.n_voxels, dtype=np.int64)
        cursor[occupied] = starts
        first_slot = []
        for touched, counts in per_block:  # each block's first slot per voxel: the blocks before it, in order
            first_slot.append(cursor[touched])
            cursor[touched] += counts
        del per_block, cursor
        release_free_memory()
        # pass 2: every kept point into its slot (the batch copies follow)
        ranks_depth = np.empty(batch * n_kept, dtype=np.int32)
        ranks_feat = np.empty(batch * n_kept, dtype=np.int32)

        def place(i: int) -> int:
            voxels.place(blocks[i], first_slot[i], ranks_depth, ranks_feat)
            return voxels.work_units(blocks[i])

        for units in ordered_map(place, range(len(blocks)), jobs):
            if progress is not None:
                progress(units)
        ranks_bev = np.empty(batch * n_kept, dtype=np.int32)
        _fill_runs(ranks_bev[:n_kept], occupied, starts)
    interval_starts = _repeat_with_offset(starts, batch, n_kept)
    interval_lengths = np.tile(lengths.astype(np.int32), batch)
    for b in range(1, batch):  # batch b: b is the most significant digit of every rank; still sorted and stable
        segment = slice(b * n_kept, (b + 1) * n_kept)
        np.add(ranks_bev[:n_kept], b * grid.n_voxels, out=ranks_bev[segment])
        np.add(ranks_depth[:n_kept], b * n_points, out=ranks_depth[segment])
        np.add(ranks_feat[:n_kept], b * n_cam * h_f * w_f, out=ranks_feat[segment])
    if options.order == "torch":
        ranks_bev, ranks_depth, ranks_feat = torch_order(ranks_bev, ranks_depth, ranks_feat)
    return BevPoolV2Arrays(
        ranks_bev=ranks_bev,
        ranks_depth=ranks_depth,
        ranks_feat=ranks_feat,
        interval_starts=interval_starts,
        interval_lengths=interval_lengths,
        depth_shape=(n_cam, n_d, h_f, w_f),
        grid=grid,
        options=options,
        bev_frame=rig.bev.frame,
    )


def torch_device() -> str:
    """Where ``order: torch`` sorts: ``cuda`` when the installed torch has a GPU, else ``cpu``."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def torch_order(ranks_bev: np.ndarray, ranks_depth: np.ndarray, ranks_feat: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The arrays in BEVDet's own order: its kept points in ``ranks_depth`` order (as
    ``voxel_pooling_prepare_v2`` enumerates them), permuted by ``ranks_bev.argsort()`` (int64,
    not ``stable``) of the installed torch on :func:`torch_device`. The intervals do not change
    (the same runs of ``ranks_bev``). :class:`UsageError` without torch."""
    try:
        import torch
    except ImportError:
        raise UsageError("interop.bevpoolv2.order torch calls torch.argsort: install PyTorch (pip install 'bevcompile[torch]')") from None
    enumeration = np.argsort(ranks_depth, kind="stable")
    by_bev = torch.from_numpy(ranks_bev[enumeration].astype(np.int64)).to(torch_device()).argsort().cpu().numpy()
    perm = enumeration[by_bev]
    return ranks_bev[perm], ranks_depth[perm], ranks_feat[perm]


_POINTS_PER_STEP = 1 << 21  # float32 build: frustum points unprojected per step


def _float32_ranks(
    frig: RigConfig, grid: VoxelGrid, rounding: str, batch: int, progress: ProgressFn | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``ranks_bev, ranks_depth, ranks_feat, interval_starts, interval_lengths`` of batch item 0 of
    the float32 build (:func:`bevdet_points_float32`): the points chunk by chunk in ``ranks_depth``
    order, then one stable sort by voxel (the float32 path restates upstream for checking a
    deployment, on upstream-sized rigs; the float64 build streams in bounded memory). The three
    rank arrays have room for ``batch`` items (:func:`build_bevpoolv2` fills items 1 and on, as
    for the float64 build)."""
    n_cam, n_d, h_f, w_f = frustum_shape(frig)
    plane = h_f * w_f
    d_step = max(1, _POINTS_PER_STEP // plane)
    x_size, y_size, _ = grid.size
    bev_parts: list[np.ndarray] = []
    depth_parts: list[np.ndarray] = []
    for cam in range(n_cam):
        for d0 in range(0, n_d, d_step):
            d1 = min(n_d, d0 + d_step)
            scaled, kept = _voxel_scaled(bevdet_points_float32(frig, cam, slice(d0, d1)), grid, rounding, np.float32)
            flat_kept = np.flatnonzero(kept.reshape(-1))  # ascending = ranks_depth order
            c = scaled.reshape(-1, 3)[flat_kept].astype(np.int64)  # trunc toward zero = the rounding (kept)
            bev_parts.append(((c[:, 2] * y_size + c[:, 1]) * x_size + c[:, 0]).astype(np.int32))
            depth_parts.append((flat_kept + (cam * n_d + d0) * plane).astype(np.int32))
            if progress is not None:
                progress(2 * (d1 - d0) * plane)  # the float64 build's two passes
    ranks_bev = np.concatenate(bev_parts) if bev_parts else np.zeros(0, np.int32)
    ranks_depth = np.concatenate(depth_parts) if depth_parts else np.zeros(0, np.int32)
    order = np.argsort(ranks_bev, kind="stable")
    n_kept = int(order.size)
    out_bev, out_depth, out_feat = (np.empty(batch * n_kept, dtype=np.int32) for _ in range(3))
    out_bev[:n_kept] = ranks_bev[order]
    out_depth[:n_kept] = ranks_depth[order]
    del ranks_bev, ranks_depth
    out_feat[:n_kept] = feat_rank_from_depth_rank(out_depth[:n_kept], (n_cam, n_d, h_f, w_f))
    starts, lengths = intervals_of(out_bev[:n_kept])
    return out_bev, out_depth, out_feat, starts, lengths


def _fill_runs(out: npt.NDArray[np.int32], values: np.ndarray, starts: np.ndarray) -> None:
    """``out[starts[i]:starts[i + 1]] = values[i]`` (``values`` increasing, ``out`` ends the last run), in place."""
    out[:] = 0
    if values.size:
        out[starts] = np.diff(values, prepend=0).astype(np.int32)
        np.cumsum(out, out=out, dtype=np.int32)


class _Voxelizer:
    """The kept frustum points of a voxel grid, block by block (the ``matrix/`` build's blocks,
    computed piece by piece so that the geometry's temporaries stay bounded)."""

    def __init__(self, frig: RigConfig, grid: VoxelGrid, rounding: str, jobs: int) -> None:
        (x_lo, y_lo, z_lo), (dx, dy, dz), (nx, ny, nz) = grid.lower, grid.step, grid.size
        # bev.region: points of BEV cells outside the region are dropped (the voxel grid stays dense)
        self.cell_kept: np.ndarray | None = None
        if frig.bev.region is not None:
            self.cell_kept = region_table(frig.bev).fine_kept()
        self.box = BevBox(x_lo, dx, nx, y_lo, dy, ny, z_lo, dz, nz)
        self.trunc = rounding == "trunc"
        self.grid = grid
        self.depths = np.asarray(frig.depth.values(), dtype=np.float64)
        self.n_depth_bins = frig.depth.n_bins
        w_f, h_f = frig.feature_size
        self.plane = w_f * h_f

        def plan(cam: int) -> CameraPlan:
            return plan_camera(self.box, self.trunc, cam, camera_rays(frig, cam), self.depths)

        plans = [own_plan(p) if jobs > 1 else p for p in ordered_map(plan, range(frig.n_cam), plan_jobs(frig, jobs))]
        release_free_memory()
        self.blocks = plan_blocks(self.n_depth_bins, plans)

    def work_units(self, block: tuple[CameraPlan, int, int]) -> int:
        return (block[2] - block[1]) * self.plane

    def _kept(self, block: tuple[CameraPlan, int, int], ranks: bool) -> tuple[np.ndarray, np.ndarray | None]:
        """``(voxel, ranks_depth)``: the voxel rank ``(z * Y + y) * X + x`` of each kept point of
        the block (and its ``ranks_depth`` with ``ranks``), piece after piece."""
        x_size, y_size, _ = self.grid.size
        voxels, depth_ranks = [], []
        for piece in block_pieces(block):
            fx, fy, fz, sel = block_coordinates(self.box, self.trunc, self.depths, piece)
            if sel is not None:
                fx, fy, fz = fx[sel], fy[sel], fz[sel]
            voxel = fz.astype(np.int64)  # kept: f > -1 (trunc) or f >= 0 (floor), so the cast is the rounding
            voxel *= y_size
            voxel += fy.astype(np.int64)
            voxel *= x_size
            voxel += fx.astype(np.int64)
            points = np.arange(fx.size) if sel is None else sel
            if self.cell_kept is not None:
                inside = self.cell_kept[voxel % (x_size * y_size)]
                voxel, points = voxel[inside], points[inside]
            voxels.append(voxel)
            if ranks:
                depth_ranks.append(block_columns(piece, points, self.n_depth_bins, self.plane))
        voxel = voxels[0] if len(voxels) == 1 else np.concatenate(voxels)
        return voxel, (None if not ranks else depth_ranks[0] if len(depth_ranks) == 1 else np.concatenate(depth_ranks))

    def count(self, block: tuple[CameraPlan, int, int]) -> tuple[np.ndarray, np.ndarray]:
        """Pass 1: the voxels the block's kept points fall in and how many in each."""
        voxel, _ranks = self._kept(block, ranks=False)
        touched, local = local_rows(voxel, self.grid.n_voxels)
        return touched, np.bincount(local, minlength=touched.size)

    def place(self, block: tuple[CameraPlan, int, int], first: np.ndarray, ranks_depth: np.ndarray, ranks_feat: np.ndarray) -> None:
        """Pass 2: ``ranks_depth`` / ``ranks_feat`` of the block's kept points into their slots:
        voxel ``touched[i]``'s points from ``first[i]`` on, by increasing ``ranks_depth``."""
        voxel, depth_rank = self._kept(block, ranks=True)
        if not voxel.size or depth_rank is None:
            return
        _touched, local = local_rows(voxel, self.grid.n_voxels)
        del voxel
        base = int(depth_rank.min())
        bits = int(depth_rank.max() - base).bit_length()
        key = local << bits
        key |= depth_rank - base
        key.sort()
        local_sorted = key >> bits
        depth_sorted = (key & ((1 << bits) - 1)) + base
        run = np.flatnonzero(np.r_[True, local_sorted[1:] != local_sorted[:-1]])
        slot = first[local_sorted] + np.arange(key.size) - np.repeat(run, np.diff(np.r_[run, key.size]))
        ranks_depth[slot] = depth_sorted
        ranks_feat[slot] = (depth_sorted // (self.n_depth_bins * self.plane)) * self.plane + depth_sorted % self.plane


def _repeat_with_offset(values: np.ndarray, batch: int, stride: int) -> npt.NDArray[np.int32]:
    """``concat(values + b * stride for b in range(batch))`` as int32 (the caller checked the range)."""
    offsets = np.arange(batch, dtype=np.int64)[:, None] * stride
    return (np.asarray(values, dtype=np.int64)[None, :] + offsets).reshape(-1).astype(np.int32)


def feat_rank_from_depth_rank(ranks_depth: np.ndarray, depth_shape: tuple[int, int, int, int]) -> npt.NDArray[np.int32]:
    """``(cam, d, v, u)`` flat index -> ``(cam, v, u)`` flat index: ``cam*H*W + (r mod H*W)``
    (with a batch, ``cam`` stands for ``b * n_cam + cam`` on both sides)."""
    _n_cam, n_d, h_f, w_f = depth_shape
    plane = h_f * w_f
    r = np.asarray(ranks_depth, dtype=np.int64)
    return ((r // (n_d * plane)) * plane + r % plane).astype(np.int32)


def intervals_of(ranks_bev_sorted: np.ndarray) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int32]]:
    """Runs of equal values in a sorted array: ``(interval_starts, interval_lengths)`` int32."""
    r = np.asarray(ranks_bev_sorted)
    if r.size == 0:
        return np.zeros(0, np.int32), np.zeros(0, np.int32)
    change = np.ones(r.size, dtype=bool)
    change[1:] = r[1:] != r[:-1]
    starts = np.flatnonzero(change)
    lengths = np.diff(np.append(starts, r.size))
    return starts.astype(np.int32), lengths.astype(np.int32)


def bev_pool_v2(
    depth: np.ndarray,
    features: np.ndarray,
    arrays: BevPoolV2Arrays | dict[str, np.ndarray],
    grid_size: tuple[int, int, int],
) -> npt.NDArray[np.float64]:
    """Sum pooling with the BEVPoolv2 arrays (what BEVDet's ``bev_pool_v2`` kernel computes).

    Convention:
        depth: ``(n_cam, D, H_f, W_f)`` depth probabilities; features: ``(n_cam, C, H_f, W_f)``
        (channels-first, as everywhere in bevcompile; the kernel's channels-last rows are
        ``(cam * H_f + v) * W_f + u``); grid_size ``(X, Y, Z)``.
        returns float64 ``(C, Z, Y, X)``; voxels with no point are 0. With a leading batch
        axis on both inputs (``(B, n_cam, ...)``, arrays built with ``batch=B``) it returns
        ``(B, C, Z, Y, X)``.
    """
    if isinstance(arrays, BevPoolV2Arrays):
        arrays = arrays.arrays()
    features = np.asarray(features)
    batched = features.ndim == 5
    batch = features.shape[0] if batched else 1
    feats = features.reshape(-1, *features.shape[-3:])  # (B * n_cam, C, H_f, W_f)
    n_rows, c, h_f, w_f = feats.shape
    x_size, y_size, z_size = grid_size
    feat_rows = np.moveaxis(feats.astype(np.float64), 1, -1).reshape(n_rows * h_f * w_f, c)
    depth_flat = np.asarray(depth, dtype=np.float64).reshape(-1)
    out = np.zeros((batch * z_size * y_size * x_size, c), dtype=np.float64)
    starts = np.asarray(arrays["interval_starts"], dtype=np.int64)
    if starts.size:
        products = depth_flat[arrays["ranks_depth"]][:, None] * feat_rows[arrays["ranks_feat"]]
        sums = np.add.reduceat(products, starts, axis=0)
        out[np.asarray(arrays["ranks_bev"])[starts]] = sums
    pooled = np.moveaxis(out.reshape(batch, z_size, y_size, x_size, c), -1, 1)  # (B, C, Z, Y, X)
    return pooled if batched else pooled[0]


def reference_frustum_pool(
    rig: RigConfig, options: BevPoolOptions, depth: np.ndarray, features: np.ndarray
) -> npt.NDArray[np.float64]:
    """Straightforward LSS sum pooling (every point scattered with ``np.add.at``): the
    reference the BEVPoolv2 arrays are checked against. Same conventions as :func:`bev_pool_v2`.
    With a ``bev.region``, every voxel of a BEV cell outside the region is 0 (its points are dropped)."""
    frig = frustum_rig(rig, options.frustum_mapping)
    grid = voxel_grid(rig, options.z_bins)
    n_cam, c, _h_f, _w_f = features.shape
    x_size, y_size, z_size = grid.size
    out = np.zeros((c, z_size * y_size * x_size), dtype=np.float64)
    for cam in range(n_cam):
        if options.precision == "float32":
            scaled, kept = _voxel_scaled(bevdet_points_float32(frig, cam), grid, options.rounding, np.float32)
            coords = np.where(kept[..., None], scaled, 0).astype(np.int64)
        else:
            points, ok = frustum_points_bev(frig, cam)
            coords, kept = voxel_coords(points, grid, options.rounding)
            kept &= ok
        d_idx, v_idx, u_idx = np.nonzero(kept)
        cell = (coords[kept][:, 2] * y_size + coords[kept][:, 1]) * x_size + coords[kept][:, 0]
        values = depth[cam, d_idx, v_idx, u_idx].astype(np.float64)[None, :] * features[cam][:, v_idx, u_idx].astype(np.float64)
        for ch in range(c):
            np.add.at(out[ch], cell, values[ch])
    if rig.bev.region is not None:
        keep = region_table(rig.bev).fine_kept()  # (ny * nx,) fine cells inside
        out = out.reshape(c, z_size, y_size * x_size) * keep[None, None, :]
    return out.reshape(c, z_size, y_size, x_size)


def _sort_rule(order: str) -> str:
    if order == "stable":
        return "stable by ranks_bev (ranks_depth ascending inside a voxel)"
    import torch

    return f"torch.argsort(ranks_bev) (not stable) of torch {torch.__version__} on {torch_device()}, the kept points enumerated in ranks_depth order"


def bevpoolv2_attrs(result: BevPoolV2Arrays) -> dict[str, Any]:
    """The ``interop/`` attributes describing the BEVPoolv2 arrays (formulas and figures)."""
    n_cam, n_d, h_f, w_f = result.depth_shape
    x_size, y_size, z_size = result.grid.size
    return {
        "batch": result.batch,
        "depth_shape": [n_cam, n_d, h_f, w_f],
        "depth_shape_order": "(n_cam, D, H_f, W_f) per batch item; inputs (B, n_cam, D, H_f, W_f)",
        "feat_shape": [n_cam, h_f, w_f],
        "feat_shape_order": "(n_cam, H_f, W_f, C) channels-last rows per batch item; inputs (B, n_cam, H_f, W_f, C)",
        "grid_size": [x_size, y_size, z_size],
        "grid_size_order": "(X, Y, Z) = (nx, ny, nz)",
        "output_shape_order": "(B, Z, Y, X, C) (BEVDet bev_feat_shape)",
        "grid_lower": list(result.grid.lower),
        "grid_step": list(result.grid.step),
        "ranks_depth": "(((b * n_cam + cam) * D + d) * H_f + v) * W_f + u",
        "ranks_feat": "((b * n_cam + cam) * H_f + v) * W_f + u",
        "ranks_bev": "((b * Z + z) * Y + y) * X + x",
        "batch_layout": "the batch-1 arrays repeated B times with the rank offsets above; interval_starts offset by b * n_kept / B",
        "voxel_coordinate": (
            f"{result.options.rounding}((p - grid_lower) / grid_step) per axis (x, y, z), {result.options.precision}; "
            "kept iff 0 <= i < grid_size on every axis"
        ),
        "frustum": (
            "feature pixel (u, v) centre under pixel mapping "
            f"{result.options.frustum_mapping!r} -> input -> image (aug, lens) at depth d_k along the optical axis -> "
            + ("ego" if result.bev_frame == "ego" else f"the {result.bev_frame} frame (bev.frame)")
        ),
        **(
            {"precision": "float32: BEVDet's create_frustum + get_lidar_coor op sequence in float32 (torch.linspace, post_rots, "
                          "inverse(cam2img), 3x3 products summed in order), voxel coordinate in float32"}
            if result.options.precision == "float32" else {}
        ),
        "sort": _sort_rule(result.options.order),
        "pooling": "bev[ranks_bev[i], :] += depth.flat[ranks_depth[i]] * feat_rows[ranks_feat[i], :]",
        "n_points": result.n_points,
        "n_kept": result.n_kept,
        "n_intervals": result.n_intervals,
        "max_interval_length": result.max_interval_length,
    }


