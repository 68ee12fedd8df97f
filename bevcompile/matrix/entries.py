"""Entries of the sparse aggregation matrix: frustum rays, the frustum mode as a streamed
:class:`~bevcompile.matrix.topk.EntryStream`, and grid-mode entries. Pure numpy; used by
:mod:`bevcompile.matrix.build` (which states the conventions and re-exports the public names).

The frustum mode streams over **blocks** ``(camera, depth bins [d0, d1))`` of about
``CHUNK_POINTS`` live points (:func:`plan_blocks`; fixed by the rig, never by ``--jobs``):

* per camera, once (:class:`CameraPlan`): the feature-pixel rays in the BEV frame, reordered so that the
  rays that can still be in the BEV box at depth bin ``j`` are a prefix (conservative slab culling),
  and the camera's **tie groups** (:func:`_tie_groups`): rays whose ego x and y components are
  bitwise equal (a level camera's pixel columns, identical cameras) put their points on the same
  BEV x/y at every depth, so their entries tie exactly on weight and distance and only the K of
  smallest column can ever be kept;
* pass 1 (:meth:`FrustumStream.count`): every point in range, every entry counted into the Top-K
  histogram in a grid padded by two cells (the four bilinear corners need no bounds test), the row
  masses summed per block (folded in block order: the same bits for every ``--jobs``);
* pass 2 (:meth:`FrustumStream.collect`): per corner, a float bound of the row's threshold (one
  table look-up per entry) drops most entries, the exact bin test decides the rest, and of each tie
  group's candidates at a depth bin only the K of smallest column are kept.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from ..errors import UsageError
from ..grid.gather import bilinear_corners
from ..grid.ipm import compute_sampling_grid
from ..memory import release_free_memory
from ..parallel import ordered_map
from ..progress import ProgressFn
from ..rig.config import RigConfig
from ..rig.geometry import bev_from_cam_matrix, feature_px_to_image_px, unproject_image_to_cam
from .lift16 import FLOAT16_CULL_MARGIN_M, bevdepth_points_float16
from .lift32 import FLOAT32_CULL_MARGIN_M, RESTATES, bevdet_points_float32, scaled_float32
from .region import RegionStream
from .scatter import scatter_add
from .topk import Entries, Histogram, hist_bins, local_rows, select_topk, stream_topk

__all__ = ["CameraRays", "Entries", "FrustumResult", "FrustumStream", "camera_rays", "frustum_entries", "grid_entries", "select_topk"]

I64 = npt.NDArray[np.int64]
I32 = npt.NDArray[np.int32]
F64 = npt.NDArray[np.float64]

HIST_BINS_MAX = 64
HIST_MAX_ENTRIES = 1 << 23
"""Target of ``n_cells * hist bins`` (int64 counters, 64 MiB) for the bin count; the floor of 8
bins wins above 2^20 cells, so the histogram is 64 B per (padded) cell there and grows with the
grid (``bevcompile.matrix.build.check_frustum_memory`` refuses a grid this machine cannot hold)."""
CHUNK_POINTS = 1 << 17  # frustum points per streamed block (bounded buffers; fixes the row-mass sums)
PIECE_POINTS = 1 << 17  # at most this many points are computed at once (a block of one depth bin is cut)
MAX_INDEX = np.iinfo(np.int32).max
PREFILTER_MARGIN = 1e-9
"""Slack of the pass-2 point pre-filter's weight bound (far above its float error, ~1e-15)."""


# --------------------------------------------------------------------------------------
# geometry of the frustum columns
# --------------------------------------------------------------------------------------



def bilinear_split(fx: F64, fy: F64, *, in_place: bool = False) -> tuple[F64, F64, F64, F64, F64, F64]:
    """``(g_x, g_y, i0_x, i0_y, a_x, a_y)`` of points at continuous cell coordinates ``f_x, f_y``
    (cell ``i`` spans ``[i, i + 1)``, its centre at ``i + 0.5``): ``g = f - 0.5``, the lower
    bilinear corner ``i0 = floor(g)`` and the fraction ``a = g - i0`` in ``[0, 1)`` per axis,
    float64 (the splat rule of every streamed mode). ``in_place``: ``g`` is computed in ``f_x,
    f_y`` themselves (the same values, two temporaries fewer; the caller's arrays are consumed)."""
    if in_place:
        fx -= 0.5
        fy -= 0.5
        gx, gy = fx, fy
    else:
        gx = fx - 0.5
        gy = fy - 0.5
    ix0 = np.floor(gx)
    iy0 = np.floor(gy)
    return gx, gy, ix0, iy0, gx - ix0, gy - iy0

@dataclass(frozen=True)
class CameraRays:
    """Viewing rays of one camera's feature-pixel centres, in the BEV frame (``bev.frame``).

    Convention:
        origin_bev: ``(3,)`` float64 metres, camera centre ``t`` in the BEV frame.
        ray_bev: ``(3, P)`` float64 ``R @ (x_n, y_n, 1)`` (a point at depth d along the optical
        axis is ``origin_bev + d * ray_bev``), for the P feature pixels that have a preimage.
        pixel_index: ``(P,)`` int64 flat feature pixel ``v * W_f + u`` of each ray.
    """

    origin_bev: F64
    ray_bev: F64
    pixel_index: I64


def camera_rays(rig: RigConfig, cam_index: int) -> CameraRays:
    """The rays of every feature-pixel centre of camera ``cam_index``.

    Convention: see :class:`CameraRays`; ``ray_bev[i] = R[i, 0] * x_n + R[i, 1] * y_n + R[i, 2]``
    evaluated elementwise (``bev_from_cam = [R | t]``, the camera pose in the BEV frame; ``(x_n, y_n, 1)`` from
    :func:`bevcompile.rig.geometry.unproject_image_to_cam` at depth 1); pixels without a lens
    preimage are left out.
    """
    camera = rig.cameras[cam_index]
    w_f, h_f = rig.feature_size
    v, u = np.meshgrid(np.arange(h_f, dtype=np.float64), np.arange(w_f, dtype=np.float64), indexing="ij")
    uv_feature_px = np.stack([u.ravel(), v.ravel()], axis=-1)
    del u, v
    points_cam_unit, ok = unproject_image_to_cam(camera, feature_px_to_image_px(rig, camera, uv_feature_px), 1.0)
    del uv_feature_px
    bev_from_cam = bev_from_cam_matrix(rig, camera)
    pixel_index = np.flatnonzero(ok).astype(np.int64)
    x_n = points_cam_unit[pixel_index, 0]
    y_n = points_cam_unit[pixel_index, 1]
    del points_cam_unit
    ray = np.empty((3, pixel_index.size), dtype=np.float64)
    for i in range(3):
        ray[i] = bev_from_cam[i, 0] * x_n + bev_from_cam[i, 1] * y_n + bev_from_cam[i, 2]
    return CameraRays(bev_from_cam[:3, 3].copy(), ray, pixel_index)


@dataclass(frozen=True)
class BevBox:
    x_min: float
    dx: float
    nx: int
    y_min: float
    dy: float
    ny: int
    z_min: float
    dz: float
    nz: int

    @classmethod
    def of(cls, rig: RigConfig) -> BevBox:
        b = rig.bev
        return cls(b.x.min, b.x.step, b.x.n, b.y.min, b.y.step, b.y.n, b.z.min, b.z.step, b.z.n)

    @property
    def n_cells(self) -> int:
        return self.nx * self.ny


CULL_MARGIN_M = 1e-6
"""The per-ray depth culling tests a box this much larger than the BEV box (far more than any
float error of a point), so it never drops a point the exact in-range test would keep."""


@dataclass(frozen=True)
class TieGroups:
    """One camera's rays that share their ego x and y components bitwise, in groups larger than K.

    Their points at one depth bin have the same BEV x/y (``t + d * ray`` per axis), so each of
    their entries ties exactly (weight and distance) with the same entry of every other member in
    range: of a group's members in range at a depth, only the K of smallest column (smallest pixel
    index) can be kept. Convention (arrays over plan positions ``p`` of the camera's rays):
    ``group[p]`` int32 group (-1: not in a large group), ``rank[p]`` int32 rank of the ray's pixel
    index in its group; ``members`` int32 plan positions grouped, pixel index ascending, group
    ``g`` at ``members[start[g]:start[g] + size[g]]``.
    """

    group: I32
    rank: I32
    members: I32
    start: I64
    n_groups: int
    max_size: int


@dataclass(frozen=True)
class CameraPlan:
    """One camera's rays reordered by decreasing ``j_hi`` (the first depth bin past which the ray
    has certainly left the BEV box), so the rays that can still be in range at depth bin ``j`` are
    the prefix ``[:n_alive[j]]``; and its tie groups (K > 0)."""

    cam_index: int
    origin_bev: F64
    ray_bev: F64  # (3, P), reordered
    pixel_index: I32  # (P,), reordered
    n_alive: I64  # (D,)
    ties: TieGroups | None = None


def plan_camera(bev: BevBox, trunc: bool, cam_index: int, rays: CameraRays, depths: F64, margin: float = CULL_MARGIN_M) -> CameraPlan:
    """Conservative per-ray culling: the depth where ``origin + d * ray`` leaves the BEV box
    enlarged by ``margin`` (slab intersection; default ``CULL_MARGIN_M``), as a depth-bin index."""
    lo_pad = 1.0 if trunc else 0.0  # trunc keeps f in (-1, 0): one more cell below each axis
    d_max = np.full(rays.pixel_index.size, np.inf)
    for axis, (lo, step, n) in enumerate(
        ((bev.x_min, bev.dx, bev.nx), (bev.y_min, bev.dy, bev.ny), (bev.z_min, bev.dz, bev.nz))
    ):
        low = lo - lo_pad * step - margin
        high = lo + n * step + margin
        origin = float(rays.origin_bev[axis])
        ray = rays.ray_bev[axis]
        moving = ray != 0.0
        safe = np.where(moving, ray, 1.0)
        leave = np.maximum((low - origin) / safe, (high - origin) / safe)
        inside = low <= origin <= high
        np.minimum(d_max, np.where(moving, leave, np.inf if inside else -np.inf), out=d_max)
    j_hi = np.searchsorted(depths, d_max, side="right").astype(np.int64)
    order = np.argsort(-j_hi, kind="stable")
    n_alive = np.array([int(np.count_nonzero(j_hi > j)) for j in range(depths.size)], dtype=np.int64)
    return CameraPlan(
        cam_index, rays.origin_bev, np.ascontiguousarray(rays.ray_bev[:, order]), rays.pixel_index[order].astype(np.int32), n_alive
    )


def _tie_groups(plan: CameraPlan, k: int, n_depths: int) -> TieGroups | None:
    """The camera's groups of more than ``k`` rays with bitwise-equal ego x and y (None if none)."""
    rx, ry = plan.ray_bev[0], plan.ray_bev[1]
    n = rx.size
    if k <= 0 or n <= k:
        return None
    sorted_x = np.sort(rx)
    if not np.any(sorted_x[1:] == sorted_x[:-1]):  # every x distinct: no two rays share x and y
        return None
    del sorted_x
    _, x_rank = np.unique(rx, return_inverse=True)
    y_values, y_rank = np.unique(ry, return_inverse=True)
    pair = x_rank.astype(np.int64) * y_values.size + y_rank
    pixel = plan.pixel_index.astype(np.int64)
    span = int(pixel.max()) + 1
    # (pixel columns of a feature map far beyond any camera's would overflow the int64 key)
    order = np.argsort(pair * span + pixel) if int(pair.max()) * span < 2**62 else np.lexsort((pixel, pair))
    pair_sorted = pair[order]
    new = np.r_[True, pair_sorted[1:] != pair_sorted[:-1]]
    starts = np.flatnonzero(new)
    sizes = np.diff(np.r_[starts, n])
    big = sizes > k
    if not big.any():
        return None
    group_of_sorted = np.cumsum(new) - 1
    in_big = big[group_of_sorted]
    members = order[in_big].astype(np.int32)
    big_index = np.cumsum(big) - 1
    member_group = big_index[group_of_sorted[in_big]]
    big_sizes = sizes[big]
    start = np.r_[0, np.cumsum(big_sizes)[:-1]].astype(np.int64)
    group = np.full(n, -1, dtype=np.int32)
    rank = np.zeros(n, dtype=np.int32)
    group[members] = member_group
    rank[members] = np.arange(members.size) - start[member_group]
    n_groups, max_size = int(big.sum()), int(big_sizes.max())
    if n_depths * n_groups * max_size >= 2**62:  # pragma: no cover - the sort key would overflow
        return None
    return TieGroups(group, rank, members, start, n_groups, max_size)


PLAN_BYTES_PER_PIXEL = 200
PLAN_MEMORY = 128 << 20
"""Cameras are planned in parallel only while their temporaries (~200 B per feature pixel:
unprojection, culling, tie groups; measured) fit in 128 MiB together."""


def plan_jobs(rig: RigConfig, jobs: int) -> int:
    """How many cameras to plan at once with ``jobs`` threads (bounded by ``PLAN_MEMORY``)."""
    w_f, h_f = rig.feature_size
    return max(1, min(jobs, PLAN_MEMORY // max(1, PLAN_BYTES_PER_PIXEL * w_f * h_f)))


def own_plan(plan: CameraPlan) -> CameraPlan:
    """``plan`` with its arrays copied by the calling thread: a plan computed by a worker thread
    lives in that thread's malloc arena, where it would keep the worker's freed temporaries
    around it from being reused or returned (the process's peak memory)."""
    ties = plan.ties
    if ties is not None:
        ties = TieGroups(ties.group.copy(), ties.rank.copy(), ties.members.copy(), ties.start.copy(), ties.n_groups, ties.max_size)
    return CameraPlan(plan.cam_index, plan.origin_bev.copy(), plan.ray_bev.copy(), plan.pixel_index.copy(), plan.n_alive.copy(), ties)


def plan_blocks(n_bins: int, plans: list[CameraPlan]) -> list[tuple[CameraPlan, int, int]]:
    """(camera plan, first depth bin, end depth bin) per streamed block: cameras in order, depth
    bins in order, about ``CHUNK_POINTS`` live points (at least one depth bin) per block. Fixed by
    the rig (never by ``--jobs``): the per-block row-mass sums, folded in this order, give its bits."""
    out = []
    for plan in plans:
        d0 = 0
        while d0 < n_bins:
            alive = int(plan.n_alive[d0])
            d1 = min(n_bins, d0 + max(1, CHUNK_POINTS // max(1, alive)))
            out.append((plan, d0, d1))
            d0 = d1
    return out


Piece = tuple[CameraPlan, int, int, int, int]
"""``(plan, d0, d1, r0, r1)``: depth bins ``[d0, d1)`` x live rays ``[r0, r1)`` of a block."""


def block_pieces(block: tuple[CameraPlan, int, int]) -> list[Piece]:
    """A block cut into pieces of at most ``PIECE_POINTS`` points, in the block's point order
    (depth bin, then ray): a block is at least one depth bin, so with many rays per camera (a
    stride-1 feature map has ~1 M) one depth bin is cut into ray ranges. The pieces bound every
    temporary of the passes whatever the feature map; the block stays the unit of the row-mass sums."""
    plan, d0, d1 = block
    alive = int(plan.n_alive[d0])
    if d1 - d0 > 1 or alive <= PIECE_POINTS:
        return [(plan, d0, d1, 0, alive)]
    return [(plan, d0, d1, r0, min(alive, r0 + PIECE_POINTS)) for r0 in range(0, alive, PIECE_POINTS)]


@dataclass(frozen=True)
class PaddedFrame:
    """The bilinear counting frame of a ``ny x nx`` BEV grid: the grid padded by two cells below and
    one above on each axis, row-major, ``(ny + 3) x (nx + 3)`` rows. The four corners of any point
    in range (``i0 = floor(f - 0.5) >= -2``, ``i0 + 1 <= n``) are rows of it, with no bounds test;
    the padding rows are no BEV cell (their thresholds keep nothing).

    Convention: a base corner ``(i0_x, i0_y)`` is row ``(i0_y + 2) * width + i0_x + 2``; corner
    ``(ox, oy)`` of a point is its base row plus ``offsets[ox + 2 oy] = ox + oy * width``."""

    nx: int
    ny: int

    @property
    def width(self) -> int:
        return self.nx + 3

    @property
    def size(self) -> int:
        return (self.ny + 3) * self.width

    @property
    def offsets(self) -> tuple[int, int, int, int]:
        """The row offset of each bilinear corner ``(ox, oy)`` (:data:`_CORNERS` order) from the base row."""
        return (0, 1, self.width, self.width + 1)

    def of_corner(self, ix0: F64, iy0: F64) -> I64:
        """Rows of base corners ``i0_x, i0_y`` (float64 holding integers, as :func:`bilinear_split` gives them)."""
        frame = iy0 * self.width
        frame += ix0
        frame += 2.0 * self.width + 2.0  # integers in float64, exact: (i0_y + 2) * width + i0_x + 2
        return frame.astype(np.int64)

    def of_cell(self, cell: I64) -> I64:
        """Rows of BEV cells ``iy * nx + ix``."""
        iy, ix = np.divmod(cell, self.nx)
        iy += 2
        iy *= self.width
        iy += ix
        iy += 2
        return iy

    def spread(self, per_cell: I64, fill: int) -> I64:
        """``(n_cells,)`` values of the BEV cells on the frame's rows (a new array), ``fill`` on the padding."""
        out = np.full((self.ny + 3, self.width), fill, dtype=per_cell.dtype)
        out[2 : self.ny + 2, 2 : self.nx + 2] = per_cell.reshape(self.ny, self.nx)
        return out.ravel()

    def cells(self, per_frame: npt.NDArray[Any]) -> npt.NDArray[Any]:
        """``(size, ...)`` -> ``(n_cells, ...)``: the rows that are BEV cells, row-major."""
        inner = per_frame.reshape(self.ny + 3, self.width, -1)[2 : self.ny + 2, 2 : self.nx + 2]
        return inner.reshape(self.nx * self.ny, -1)


def cell_coordinate(box: BevBox, plan: CameraPlan, axis: int, depth: F64, ray: F64) -> F64:
    """Cell coordinate ``f = (t_a + d * ray_a - min_a) / step_a`` on ``axis`` (0 x, 1 y, 2 z) of
    the points at depths ``depth`` (m) along rays ``ray`` (rows of ``plan.ray_bev[axis]``, broadcast
    against ``depth``), float64: the canonical formula in this order of operations, so every
    streamed mode gets the same bits for the same point."""
    lo, step = ((box.x_min, box.dx), (box.y_min, box.dy), (box.z_min, box.dz))[axis]
    f = depth * ray
    f += plan.origin_bev[axis]
    f -= lo
    f /= step
    return f


def coordinate_in_range(f: F64, n: int, trunc: bool) -> npt.NDArray[np.bool_]:
    """Whether cell coordinates ``f`` on an axis of ``n`` cells are in range: floor ``0 <= f < n``,
    trunc ``-1 < f < n`` (the cell ``trunc(f)`` of ``-1 < f < 0`` is 0)."""
    ok = (f > -1.0) if trunc else (f >= 0.0)
    ok &= f < n
    return ok


def corner_dist2(box: BevBox, gx: F64, gy: F64, ix: F64, iy: F64) -> F64:
    """Squared distance ``((g_x - i_x) d_x)^2 + ((g_y - i_y) d_y)^2`` m^2 between points of
    :func:`bilinear_split` ``g`` and the corner cells ``(i_x, i_y)`` (float64 integers) of their
    bilinear splat (the tie-break distance of a bilinear entry)."""
    ex = gx - ix
    ex *= box.dx
    ey = gy - iy
    ey *= box.dy
    ex *= ex
    ey *= ey
    ex += ey
    return ex


def nearest_split(box: BevBox, trunc: bool, fx: F64, fy: F64, *, in_place: bool = False) -> tuple[I64, F64]:
    """``(cell, dist2)`` of points at continuous cell coordinates ``f_x, f_y`` in range: the cell
    ``i = floor(f)`` (``--rounding trunc``: ``trunc(f)``) per axis as the index ``i_y * n_x + i_x``
    (int64), and its squared distance to the point, ``((f_x - 0.5 - i_x) d_x)^2 + ((f_y - 0.5 -
    i_y) d_y)^2`` m^2 (float64; the nearest splat rule of every streamed mode). ``in_place``: the
    distances are computed in ``f_x, f_y`` themselves (the same values, no temporaries of their
    size; the caller's arrays are consumed, ``dist2`` is ``f_x``)."""
    ix = np.trunc(fx) if trunc else np.floor(fx)
    iy = np.trunc(fy) if trunc else np.floor(fy)
    ex, ey = (fx, fy) if in_place else (fx - 0.5, fy - 0.5)
    if in_place:
        ex -= 0.5
        ey -= 0.5
    ex -= ix
    ex *= box.dx
    ex *= ex
    ey -= iy
    ey *= box.dy
    ey *= ey
    ex += ey
    iy *= box.nx  # exact integers
    iy += ix
    return iy.astype(np.int64), ex


def block_coordinates(
    box: BevBox, trunc: bool, depths: F64, piece: Piece, *, ray_major: bool = False
) -> tuple[F64, F64, F64, I64 | None]:
    """``(f_x, f_y, f_z, in_range)`` of a piece's points: cell coordinates ``f = (p - min) / step``
    flat over its ``(depth bin, ray)`` grid (``ray_major``: its ``(ray, depth bin)`` grid, the same
    values transposed), and the grid positions in range (``None``: all).

    Points are ``t_a + d * ray_a`` per axis (the canonical formula), tested exactly (floor:
    ``0 <= f < n``; trunc: ``-1 < f < n``) on the three axes of ``box``; culled rays are provably
    out of range."""
    plan, d0, d1, r0, r1 = piece
    d = depths[None, d0:d1] if ray_major else depths[d0:d1, None]
    fx, fy, fz = (cell_coordinate(box, plan, axis, d, plan.ray_bev[axis, r0:r1, None] if ray_major else plan.ray_bev[axis, r0:r1]).ravel() for axis in range(3))
    inside = coordinate_in_range(fz, box.nz, trunc)
    inside &= coordinate_in_range(fx, box.nx, trunc)
    inside &= coordinate_in_range(fy, box.ny, trunc)
    return fx, fy, fz, (None if inside.all() else np.flatnonzero(inside))


def check_float32_lift(rig: RigConfig, precision: str = "float32") -> None:
    """Refuse a reduced-precision build of a rig that the restated lift (BEVDet's float32 lift,
    BEVDepth's float16 ``get_geometry``) does not describe (UsageError): a feature mapping other
    than ``linspace`` (a lens model is refused per camera when lifted)."""
    if rig.feature.pixel_mapping != "linspace":
        raise UsageError(
            f"--precision {precision} restates {RESTATES[precision]}, whose frustum is linspace; "
            f"the rig's feature.pixel_mapping is {rig.feature.pixel_mapping} (use --precision float64)"
        )


def reduced_precision_points(rig: RigConfig, cam_index: int, precision: str, depth_slice: slice | None = None,
                             pixels: npt.NDArray[np.integer[Any]] | None = None) -> npt.NDArray[np.float32]:
    """The float32 frustum points of a reduced-precision build: BEVDet's float32 lift
    (:func:`bevcompile.matrix.lift32.bevdet_points_float32`) or BEVDepth's float16 ``get_geometry``
    (:func:`bevcompile.matrix.lift16.bevdepth_points_float16`; inf / NaN where float16 overflowed)."""
    if precision == "float16":
        return bevdepth_points_float16(rig, cam_index, depth_slice, pixels)
    return bevdet_points_float32(rig, cam_index, depth_slice, pixels)


def block_coordinates_float32(rig: RigConfig, box: BevBox, trunc: bool, piece: Piece, precision: str = "float32") -> tuple[F64, F64, F64, I64 | None]:
    """:func:`block_coordinates` of a float32 (float16) build: the piece's points of BEVDet's float32
    lift (BEVDepth's float16 ``get_geometry``, :func:`reduced_precision_points`) and ``(p - min) / step``
    in float32, returned as float64 (exact), tested for range as :func:`block_coordinates` does (a
    non-finite float16 point is out of range on every axis: dropped)."""
    plan, d0, d1, r0, r1 = piece
    points = reduced_precision_points(rig, plan.cam_index, precision, slice(d0, d1), plan.pixel_index[r0:r1])
    with np.errstate(invalid="ignore"):  # float16: inf - inf
        scaled = scaled_float32(points, (box.x_min, box.y_min, box.z_min), (box.dx, box.dy, box.dz)).reshape(-1, 3)
    fx, fy, fz = (scaled[:, axis].astype(np.float64) for axis in range(3))
    with np.errstate(invalid="ignore"):  # NaN compares false: dropped
        inside = coordinate_in_range(fz, box.nz, trunc)
        inside &= coordinate_in_range(fx, box.nx, trunc)
        inside &= coordinate_in_range(fy, box.ny, trunc)
    return fx, fy, fz, (None if inside.all() else np.flatnonzero(inside))


def block_columns(piece: Piece, q: I64, n_depth_bins: int, plane: int) -> I64:
    """Frustum column of each grid position ``q`` of ``piece``: ``((cam * D + d) * H_f + v) * W_f + u``
    (``plane = H_f * W_f``; BEVPoolv2's ``ranks_depth`` of batch item 0)."""
    plan, d0, _d1, r0, r1 = piece
    width = max(1, r1 - r0)
    d_local = q // width
    return (plan.cam_index * n_depth_bins + d0 + d_local) * plane + plan.pixel_index[r0 + q - d_local * width]


def _first_k_per_run(keys: I64, run_size: int, k: int) -> I64:
    """Of sorted ``keys``, the first ``k`` of every run of equal ``keys // run_size``."""
    run = keys // run_size
    starts = np.flatnonzero(np.r_[True, run[1:] != run[:-1]])
    position = np.arange(keys.size) - np.repeat(starts, np.diff(np.r_[starts, keys.size]))
    return keys[position < k]


class _OrderedSums:
    """Per-row float sums of a block accumulated piece after piece, element by element in order:
    the same bits as one ``bincount`` over the whole block (:func:`~bevcompile.matrix.scatter.scatter_add`
    adds in order, as ``np.add.at``, without the GIL), over the rows the block touches so far (the
    row set grows piece by piece)."""

    def __init__(self, n: int) -> None:
        self.rows: I64 = np.zeros(0, np.int64)
        self.sums = np.zeros((n, 0))

    def add(self, rows: I64, local: I64, values: list[F64]) -> None:
        """Add ``values[c][i]`` to sum ``c`` of row ``rows[local[i]]``, in order of ``i``."""
        if not self.rows.size:
            self.rows = rows
            self.sums = np.zeros((len(values), rows.size))
            for c, v in enumerate(values):
                scatter_add(self.sums[c], local, v)
            return
        union = np.union1d(self.rows, rows)
        sums = np.zeros((len(values), union.size))
        sums[:, np.searchsorted(union, self.rows)] = self.sums
        where = np.searchsorted(union, rows)[local]
        for c, v in enumerate(values):
            scatter_add(sums[c], where, v)
        self.rows, self.sums = union, sums


# --------------------------------------------------------------------------------------
# the frustum mode as a stream of blocks
# --------------------------------------------------------------------------------------

Block = tuple[CameraPlan, int, int]
_CORNERS = ((0, 0), (1, 0), (0, 1), (1, 1))  # (ox, oy): cell (i0_y + oy, i0_x + ox)


class FrustumStream:
    """The ``mode="frustum"`` entries as an :class:`~bevcompile.matrix.topk.EntryStream`.

    Counting frame: bilinear, the BEV grid padded by two cells below and one above on each axis
    (padded cell ``(iy + 2, ix + 2)``, ``(ny + 3) x (nx + 3)``; padding rows never keep anything);
    nearest, the BEV cells. Order scores: bilinear ``1 - w``, nearest ``dist2``.
    """

    def __init__(self, rig: RigConfig, *, splat: str, rounding: str, k: int, jobs: int = 1, precision: str = "float64") -> None:
        self.rig = rig
        self.precision = precision
        self.float32 = precision != "float64"  # a restated upstream lift (float32 or float16 points)
        if self.float32:
            check_float32_lift(rig, precision)
        self.bev = bev = BevBox.of(rig)
        self.trunc = rounding == "trunc"
        self.bilinear = splat == "bilinear"
        self.k = k
        self.n_cells = bev.n_cells
        self.depths = np.asarray(rig.depth.values(), dtype=np.float64)
        w_f, h_f = rig.feature_size
        self.plane = w_f * h_f
        self.n_bins = hist_bins(self.n_cells, HIST_BINS_MAX, HIST_MAX_ENTRIES)
        # score scale: bilinear score = 1 - w in [0, 1] (bins never exceed n_bins - 1, no clip);
        # nearest score = dist2 in [0, h2] for floor rounding (clipped: trunc can exceed h2)
        h2 = (0.5 * bev.dx) ** 2 + (0.5 * bev.dy) ** 2
        self.scale = self.n_bins * (1.0 - 2.0**-20) if self.bilinear else self.n_bins / h2
        self.frame = PaddedFrame(bev.nx, bev.ny)
        self.n_pad = self.frame.size
        self.n_frame = self.n_pad if self.bilinear else self.n_cells
        self.offsets = self.frame.offsets
        self.in_range = 0
        self.n_valid = 0
        self._mass = [np.zeros(self.n_pad) for _ in _CORNERS] if self.bilinear else []

        def plan(cam: int) -> CameraPlan:
            margin = {"float32": FLOAT32_CULL_MARGIN_M, "float16": FLOAT16_CULL_MARGIN_M}.get(precision, CULL_MARGIN_M)
            p = plan_camera(bev, self.trunc, cam, camera_rays(rig, cam), self.depths, margin)
            # float32 points of rays that share their float64 x and y need not share theirs: no tie groups
            ties = None if self.float32 else _tie_groups(p, k, rig.depth.n_bins)
            return p if ties is None else CameraPlan(p.cam_index, p.origin_bev, p.ray_bev, p.pixel_index, p.n_alive, ties)

        self.plans = [own_plan(p) if jobs > 1 else p for p in ordered_map(plan, range(rig.n_cam), plan_jobs(rig, jobs))]
        release_free_memory()
        self.n_valid = sum(p.pixel_index.size for p in self.plans) * rig.depth.n_bins
        self._blocks = plan_blocks(rig.depth.n_bins, self.plans)
        self._thr: I64 = np.zeros(0, np.int64)
        self._wmin: list[F64] = []

    # ---- geometry shared by both passes ------------------------------------------------

    def blocks(self) -> list[Block]:
        return self._blocks

    def work_units(self, block: Block) -> int:
        return (block[2] - block[1]) * self.plane

    def _points(self, piece: Piece) -> tuple[F64, F64, I64 | None]:
        if self.float32:
            fx, fy, _fz, sel = block_coordinates_float32(self.rig, self.bev, self.trunc, piece, self.precision)
        else:
            fx, fy, _fz, sel = block_coordinates(self.bev, self.trunc, self.depths, piece)
        return fx, fy, sel

    def _cols(self, piece: Piece, q: I64) -> I64:
        return block_columns(piece, q, self.rig.depth.n_bins, self.plane)

    def _corner_frame(self, fx: F64, fy: F64) -> tuple[F64, F64, F64, F64, F64, F64, I64]:
        """``(g_x, g_y, i0_x, i0_y, a_x, a_y, padded frame index)`` of points ``f_x, f_y``."""
        gx, gy, ix0, iy0, ax, ay = bilinear_split(fx, fy)
        return gx, gy, ix0, iy0, ax, ay, self.frame.of_corner(ix0, iy0)

    def _nearest(self, fx: F64, fy: F64) -> tuple[I64, F64]:
        """BEV cell (the in-range cell index) and ``dist2`` of points ``f_x, f_y``."""
        return nearest_split(self.bev, self.trunc, fx, fy)

    def _score_bin(self, score: F64, clip: bool) -> I64:
        """Histogram bin of a Top-K order score (smaller = better): ``min(floor(score * scale), n - 1)``.
        Monotone non-decreasing in ``score``: a smaller bin means a strictly better entry."""
        out = (score * self.scale).astype(np.int64)
        if clip:
            np.minimum(out, self.n_bins - 1, out=out)
        return out

    # ---- pass 1 -----------------------------------------------------------------------

    def count(self, block: Block, hist: Histogram, n_bins: int, k: int) -> tuple[int, I64, F64]:
        """Pass 1 of one block: every entry counted at its frame row and score bin (K > 0) or
        row (K = 0), in a local histogram of the rows each piece touches; returns (points in
        range, the rows the block's points fall in, per corner the row masses of its points
        (``(4, rows)``, summed in point order))."""
        n_in = 0
        sums = _OrderedSums(len(_CORNERS))
        for piece in block_pieces(block):
            fx, fy, sel = self._points(piece)
            if sel is not None:
                fx, fy = fx[sel], fy[sel]
            n_in += fx.size
            if not self.bilinear:
                row, dist2 = self._nearest(fx, fy)
                rows, keys = local_rows(row, self.n_cells)
                if k > 0:
                    keys *= n_bins
                    keys += self._score_bin(dist2, clip=True)
                hist.add_local(rows, keys)
                continue
            _gx, _gy, _ix0, _iy0, ax, ay, frame = self._corner_frame(fx, fy)
            del fx, fy, _gx, _gy, _ix0, _iy0
            bx = 1.0 - ax
            by = 1.0 - ay
            rows, local = local_rows(frame, self.n_pad)  # the point's padded cell among the piece's; corner c's row is rows + off
            del frame
            base = local * n_bins if k > 0 else local
            weights: list[F64] = []
            for (ox, oy), off in zip(_CORNERS, self.offsets, strict=True):
                wgt = (ax if ox else bx) * (ay if oy else by)
                if k > 0:
                    score = 1.0 - wgt
                    score *= self.scale
                    keys = score.astype(np.int64)  # truncation: the score bin
                    del score
                    keys += base
                    hist.add_local(rows + off, keys)
                    weights.append(wgt)
                else:
                    hist.add_local(rows + off, base[wgt > 0.0])
            if weights:
                sums.add(rows, local, weights)
        return n_in, sums.rows, sums.sums

    def fold(self, partial: tuple[int, I64, F64]) -> None:
        n_in, rows, masses = partial
        self.in_range += n_in
        if rows.size:
            for acc, part in zip(self._mass, masses, strict=True):
                acc[rows] += part

    def cells_of_frame(self, per_frame: npt.NDArray[Any]) -> npt.NDArray[Any]:
        return self.frame.cells(per_frame) if self.bilinear else per_frame

    def total_mass(self, hist_cells: I64) -> F64:
        if not self.bilinear:  # nearest: every entry weighs 1
            return hist_cells.sum(axis=1).astype(np.float64)
        mass_pad = np.zeros(self.n_pad)
        for off, mass in zip(self.offsets, self._mass, strict=True):
            mass_pad[off:] += mass[: self.n_pad - off]
        self._mass = []
        return np.asarray(self.cells_of_frame(mass_pad), dtype=np.float64).ravel()

    # ---- pass 2 -----------------------------------------------------------------------

    def begin_collect(self, threshold: I64, n_bins: int, k: int) -> None:
        """The per-frame thresholds (padding rows: -1, nothing passes) and, for the bilinear
        pre-filter, per corner and padded cell the least weight that can pass its row's threshold."""
        if not self.bilinear:
            self._thr = threshold
            return
        self._thr = self.frame.spread(threshold, -1)
        if k > 0:
            # bin(w) = int((1 - w) * scale) <= t  =>  w > 1 - (t + 1) / scale (up to float error)
            need = np.where(self._thr >= 0, 1.0 - (self._thr + 1) / self.scale, 2.0) - PREFILTER_MARGIN
            need = np.r_[need, np.full(self.frame.width + 1, 2.0)]
            self._wmin = [need[off : off + self.n_pad] for off in self.offsets]

    def _tie_keys(self, piece: Piece, sel: I64 | None, hit: I64) -> I64 | None:
        """Per candidate point ``hit`` (indices among the piece's points in range ``sel``) its key
        ``(d_local * n_groups + group) * max_size + rank`` in its tie group, -1 if not tied
        (``None``: the camera has no tie groups)."""
        plan, _d0, _d1, r0, r1 = piece
        ties = plan.ties
        if ties is None:
            return None
        q = hit if sel is None else sel[hit]
        width = max(1, r1 - r0)
        d_local = q // width
        ray = q - d_local * width
        ray += r0
        group = ties.group[ray]
        key = d_local * ties.n_groups
        key += group
        key *= ties.max_size
        key += ties.rank[ray]
        key[group < 0] = -1
        return key

    def _dedup(self, piece: Piece, sel: I64 | None, hit: I64) -> tuple[I64, I64 | None]:
        """``hit`` (indices of candidate points among the piece's points in range ``sel``) without
        the tied points K others beat: of a tie group's candidates at one depth bin (in this
        piece), only the K of smallest pixel index stay; and their tie keys (:meth:`_tie_keys`).

        Exact: a group's points at a depth have the same BEV x/y, hence identical entries (weight,
        distance, row) and the same pass/fail of every threshold, so its candidates there are
        exactly its members in range, and each dropped entry ties with K kept ones of smaller
        column in the same row."""
        keys = self._tie_keys(piece, sel, hit)
        if keys is None or not hit.size:
            return hit, keys
        tied = keys >= 0
        if not tied.any():
            return hit, keys
        plan, _d0, _d1, r0, r1 = piece
        ties = plan.ties
        assert ties is not None
        kept = _first_k_per_run(np.sort(keys[tied]), ties.max_size, self.k)
        run = kept // ties.max_size
        d_kept = run // ties.n_groups
        member = ties.members[ties.start[run - d_kept * ties.n_groups] + (kept - run * ties.max_size)]
        q_kept = d_kept * max(1, r1 - r0) + (member - r0)
        index = q_kept if sel is None else np.searchsorted(sel, q_kept)
        return np.concatenate([hit[~tied], index]), np.concatenate([keys[~tied], kept])

    def collect(self, block: Block) -> tuple[Entries, int]:
        n_in = 0
        per_corner: list[list[Entries]] = [[] for _ in _CORNERS]
        tie_keys: list[list[I64]] = [[] for _ in _CORNERS]
        pieces = block_pieces(block)
        for piece in pieces:
            n_in += self._collect_piece(piece, per_corner, tie_keys)
        if len(pieces) > 1 and block[0].ties is not None:  # a tie group may straddle pieces: K per group and depth bin in the block
            for c in range(len(_CORNERS)):
                keys = np.concatenate(tie_keys[c]) if tie_keys[c] else np.zeros(0, np.int64)
                tied = keys >= 0
                if tied.any():
                    kept = _first_k_per_run(np.sort(keys[tied]), block[0].ties.max_size, self.k)
                    keep = ~tied
                    keep[tied] = np.isin(keys[tied], kept, assume_unique=True)
                    per_corner[c] = [Entries.concat(per_corner[c]).take(keep)]
        # corner by corner, piece after piece: with K = 0 the block's entries in point order per corner
        return Entries.concat([e for corner in per_corner for e in corner]), n_in

    def _collect_piece(self, piece: Piece, out: list[list[Entries]], tie_keys: list[list[I64]]) -> int:
        fx, fy, sel = self._points(piece)
        n_in = fx.size if sel is None else sel.size
        if sel is not None:
            fx, fy = fx[sel], fy[sel]
        k = self.k
        if not self.bilinear:
            row, dist2 = self._nearest(fx, fy)
            keys = None
            if k == 0:  # every entry, in point order
                hit = np.arange(n_in)
            else:
                hit, keys = self._dedup(piece, sel, np.flatnonzero(self._score_bin(dist2, clip=True) <= self._thr[row]))
            q = hit if sel is None else sel[hit]
            out[0].append(Entries(row[hit], self._cols(piece, q), np.ones(hit.size), dist2[hit]))
            if keys is not None:
                tie_keys[0].append(keys)
            return n_in
        gx, gy, ix0, iy0, ax, ay, frame = self._corner_frame(fx, fy)
        del fx, fy
        bx = 1.0 - ax
        by = 1.0 - ay
        bev = self.bev
        for c, ((ox, oy), off) in enumerate(zip(_CORNERS, self.offsets, strict=True)):
            wgt = (ax if ox else bx) * (ay if oy else by)
            keys = None
            if k > 0:  # a cheap float bound first, then the exact bin test on what passes it
                hit = np.flatnonzero(wgt >= self._wmin[c][frame])
                w = wgt[hit]
                exact = ((1.0 - w) * self.scale).astype(np.int64) <= self._thr[frame[hit] + off]
                exact &= w > 0.0
                hit, keys = self._dedup(piece, sel, hit[exact])
            else:  # every entry of a grid cell, in point order
                passing = self._thr[frame + off] >= 0
                passing &= wgt > 0.0
                hit = np.flatnonzero(passing)
            ixf = ix0[hit] + ox
            iyf = iy0[hit] + oy
            cols = self._cols(piece, hit if sel is None else sel[hit])
            out[c].append(Entries((iyf * bev.nx + ixf).astype(np.int64), cols, wgt[hit], corner_dist2(bev, gx[hit], gy[hit], ixf, iyf)))
            if keys is not None:
                tie_keys[c].append(keys)
        return n_in

    def end_collect(self) -> None:
        """Pass 2 is over: drop the rays and tables (before the final sort)."""
        self.plans, self._blocks = [], []
        self._thr, self._wmin = np.zeros(0, np.int64), []

    # ---- the bev.region hook (bevcompile.matrix.region.RegionStream, pass 2) -------------

    def begin_region_collect(self, threshold: I64, n_bins: int, scale: float, k: int) -> None:
        """Pass 2 under a :class:`~bevcompile.matrix.region.RegionStream` (this stream built with
        ``k = 0``: no tie groups): keep each cell's entries whose score bin in the REGION's bins
        (``n_bins``, ``scale``: the formulas of :meth:`_score_bin`) is ``<= threshold[cell]``
        (``(n_cells,)``; -1 none, ``n_bins`` all), with the K > 0 pre-filter of :meth:`collect`."""
        self.k, self.n_bins, self.scale = k, n_bins, scale
        self.begin_collect(threshold, n_bins, k)


@dataclass
class FrustumResult:
    kept: Entries
    total_mass: F64  # (n_cells,) raw weight of every entry of each row, before Top-K
    n_points: int
    n_points_valid: int
    n_points_in_range: int
    n_candidates: int
    phase_seconds: dict[str, float]
    largest_sort: int = 0
    compactions: int = 0


RegionRows = tuple[I64, int, npt.NDArray[np.bool_]]
"""A ``bev.region``'s rows for a streamed mode: ``(row_of_cell (ny * nx,) int64 (-1 outside),
n_kept, coarse_row (n_kept,) bool)`` (:mod:`bevcompile.matrix.region`)."""


def frustum_entries(
    rig: RigConfig,
    *,
    splat: str,
    rounding: str,
    topk: int,
    progress: ProgressFn | None = None,
    check_row_nnz: Callable[[I64], None] | None = None,
    jobs: int = 1,
    region: RegionRows | None = None,
    precision: str = "float64",
) -> FrustumResult:
    """Frustum-mode entries that survive the Top-K rule, streamed in two passes by ``jobs``
    threads (:func:`bevcompile.matrix.topk.stream_topk` over :class:`FrustumStream`).

    K = 0 keeps every entry, so pass 1 only counts the entries of each row (no histogram) and
    hands the counts (``(ny * nx,)`` int64, exactly the final row nnz) to ``check_row_nnz``,
    which may refuse (raise) before pass 2 collects them all. The result is exactly the
    straightforward build's (:func:`bevcompile.matrix.reference.reference_matrix`), the same
    bytes for every ``jobs``. ``region``: the rows are the region's (:func:`run_point_stream`).
    """
    t0 = time.perf_counter()
    stream = FrustumStream(rig, splat=splat, rounding=rounding, k=0 if region is not None else topk, jobs=jobs, precision=precision)
    return run_point_stream(
        rig, stream, time.perf_counter() - t0, topk=topk, progress=progress, check_row_nnz=check_row_nnz, jobs=jobs, region=region, splat=splat
    )


def run_point_stream(
    rig: RigConfig,
    stream: Any,
    rays_seconds: float,
    *,
    topk: int,
    progress: ProgressFn | None,
    check_row_nnz: Callable[[I64], None] | None,
    jobs: int,
    region: RegionRows | None = None,
    splat: str = "bilinear",
) -> FrustumResult:
    """:func:`stream_topk` over a mode whose entries are the frustum's points (frustum, ray:
    ``stream`` has ``n_bins``, ``in_range`` and ``n_valid``), as a :class:`FrustumResult`.

    ``region`` (a ``bev.region``; ``stream`` then built with ``k = 0``): the stream is wrapped in a
    :class:`~bevcompile.matrix.region.RegionStream`, so the rows are the region's compact rows,
    merged before Top-K (order score ``1 - w`` for bilinear splats, ``dist2`` for nearest)."""
    w_f, h_f = rig.feature_size
    counted: Any = stream
    if region is not None:
        row_of_cell, n_rows, coarse_row = region
        bev = BevBox.of(rig)
        counted = RegionStream(
            stream, row_of_cell, n_rows, n_columns_frustum(rig) if isinstance(stream, FrustumStream) else rig.n_cam * h_f * w_f,
            n_bins=hist_bins(n_rows, HIST_BINS_MAX, HIST_MAX_ENTRIES),
            score="weight" if splat == "bilinear" or not isinstance(stream, FrustumStream) else "dist2",
            h2=(0.5 * bev.dx) ** 2 + (0.5 * bev.dy) ** 2,
            coarse_row=coarse_row,
        )
    result = stream_topk(
        counted, k=topk, n_bins=counted.n_bins, jobs=jobs, progress=progress, check_row_nnz=check_row_nnz,
        points_in_range=lambda: counted.in_range,
    )
    return FrustumResult(
        result.kept, result.total_mass, rig.n_cam * rig.depth.n_bins * w_f * h_f, stream.n_valid, counted.in_range,
        result.n_candidates, {"rays": rays_seconds, **result.phase_seconds}, result.largest_sort, result.compactions,
    )


# --------------------------------------------------------------------------------------
# grid mode
# --------------------------------------------------------------------------------------


def n_columns_frustum(rig: RigConfig) -> int:
    """Columns of a frustum matrix: ``n_cam * D * H_f * W_f``."""
    w_f, h_f = rig.feature_size
    return rig.n_cam * rig.depth.n_bins * h_f * w_f


def grid_entries(
    rig: RigConfig, *, splat: str, progress: ProgressFn | None = None, jobs: int = 1
) -> tuple[Entries, F64, int]:
    """Grid-mode entries (duplicates over heights merged), before Top-K; the cameras are
    computed by ``jobs`` threads and concatenated in camera order (the same bytes for any ``jobs``).

    Convention: returns (:class:`Entries` with BEV-cell rows and ``col = (cam * H_f + v) * W_f + u``,
    total raw weight per cell ``(ny * nx,)`` float64, number of valid samples).
    """
    sampling = compute_sampling_grid(rig, progress=progress)
    w_f, h_f = rig.feature_size
    ny, nx = rig.bev.ny, rig.bev.nx
    n_cells = ny * nx
    n_cols = rig.n_cam * h_f * w_f
    cells = np.arange(n_cells, dtype=np.int64)

    def camera_entries(cam_index: int) -> Entries:
        per_height: list[Entries] = []
        for h in range(len(rig.bev.heights)):
            uv = sampling.coords_feature_px[cam_index, h].reshape(-1, 2)
            valid = sampling.valid[cam_index, h].ravel()
            u, v = uv[:, 0], uv[:, 1]
            corners: list[tuple[F64, F64, F64]] = []  # (pixel u, pixel v, weight)
            if splat == "nearest":
                corners.append((np.rint(u), np.rint(v), np.ones(u.size)))
            else:  # the gather tables' corner rule: weight 0 outside the map (zeros padding)
                pixel_index, corner_weight, _frac, _inside = bilinear_corners(uv, valid, (w_f, h_f))
                for k in range(4):
                    pixel = pixel_index[:, k]
                    corners.append(((pixel % w_f).astype(np.float64), (pixel // w_f).astype(np.float64), corner_weight[:, k]))
            for pu, pv, wgt in corners:
                keep = valid & (pu >= 0) & (pu < w_f) & (pv >= 0) & (pv < h_f) & (wgt > 0.0)
                col = (cam_index * h_f + pv[keep].astype(np.int64)) * w_f + pu[keep].astype(np.int64)
                du = pu[keep] - u[keep]
                dv = pv[keep] - v[keep]
                per_height.append(Entries(cells[keep], col, wgt[keep], du * du + dv * dv))
        return _merge_heights(per_height, n_cols)

    entries = Entries.concat(list(ordered_map(camera_entries, range(rig.n_cam), jobs)))
    total_mass = np.bincount(entries.row, weights=entries.weight, minlength=n_cells).astype(np.float64)
    return entries, total_mass, int(sampling.valid.sum())


def _merge_heights(per_height: list[Entries], n_cols: int) -> Entries:
    """Sum duplicate ``(row, col)`` entries sequentially in height order; min distance."""
    if not per_height:
        return Entries.empty()
    every = Entries.concat(per_height)
    keys = every.row * n_cols + every.col
    unique, inverse = np.unique(keys, return_inverse=True)
    weight = np.zeros(unique.size)
    dist2 = np.full(unique.size, np.inf)
    start = 0
    for part in per_height:  # each part (one corner of one height) has distinct keys
        idx = inverse[start : start + len(part)]
        weight[idx] += part.weight
        dist2[idx] = np.minimum(dist2[idx], part.dist2)
        start += len(part)
    return Entries(unique // n_cols, unique % n_cols, weight, dist2)


def _hist_bins(n_cells: int) -> int:
    """Bins per row of the frustum Top-K histogram (used by the memory estimate)."""
    return hist_bins(n_cells, HIST_BINS_MAX, HIST_MAX_ENTRIES)

