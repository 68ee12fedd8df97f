"""The ``mode="ray"`` matrix as a streamed :class:`~bevcompile.matrix.topk.EntryStream`. Pure numpy.

A ray-mode entry is a frustum-mode ray folded over its depth bins with a fixed prior
(:mod:`bevcompile.matrix.prior`): column ``(cam * H_f + v) * W_f + u`` (grid mode's), weight
``sum_d p[cam, d, v, u] * s_d`` where ``s_d`` is the frustum splat weight of the point at depth bin
``d`` in the row's cell (the frustum's points, range rule, ``--splat`` and ``--rounding``,
:mod:`bevcompile.matrix.entries`), summed sequentially in increasing ``d``; tie-break distance
the smallest frustum ``dist2`` of the depth bins that contribute (weight > 0).

The stream's **blocks** are ``(camera, rays [r0, r1))`` of the camera's culled ray plan
(:func:`bevcompile.matrix.entries.plan_camera`, rays by decreasing last live depth bin) with every
depth bin at which one of them can be in range, about ``CHUNK_POINTS`` points each: all the depth
bins of a pixel are in one block, so a block's merged entries are complete and final (pass 1
counts their Top-K score ``1 - w`` in the BEV cells' histogram, pass 2 recomputes them and keeps
those in a bin ``<= threshold[row]``). Fixed by the rig, never by ``--jobs``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from ..memory import release_free_memory
from ..parallel import ordered_map
from ..progress import ProgressFn
from ..rig.config import RigConfig
from .entries import (
    HIST_MAX_ENTRIES,
    PREFILTER_MARGIN,
    BevBox,
    CameraPlan,
    FrustumResult,
    RegionRows,
    bilinear_split,
    block_coordinates,
    camera_rays,
    own_plan,
    plan_camera,
    plan_jobs,
    run_point_stream,
)
from .prior import NormalisedPrior
from .topk import Entries, Histogram, hist_bins, local_rows

__all__ = ["RayStream", "merge_ray_runs", "ray_entries"]

I64 = npt.NDArray[np.int64]
F64 = npt.NDArray[np.float64]

HIST_BINS_MAX = 128
OCTAVES = 16
"""Score bins: up to 128 per row, ``128 / 16 = 8`` per octave of weight (9 % steps) over 16 octaves
(the weights of a ray-mode row are sums of small prior-weighted splats: a linear scale of
``1 - w`` puts nearly all of them in its last bins)."""
CHUNK_POINTS = 1 << 15
"""Frustum points per block (every temporary of a block, ~4 corner entries per point, stays in cache)."""

RayBlock = tuple[CameraPlan, int, int, int, int]
"""``(plan, r0, r1, d_end, units)``: rays ``[r0, r1)`` of the plan at depth bins ``[0, d_end)``;
``units`` its progress units (``(r1 - r0) * D``, the camera's last block also counts the pixels
without a block, so that a pass is ``n_cam * D * H_f * W_f`` units as in frustum mode)."""


def plan_ray_blocks(plans: list[CameraPlan], plane: int) -> list[RayBlock]:
    """Per camera, consecutive ray ranges of about ``CHUNK_POINTS`` points over the depth bins
    where their first ray is still alive (later rays leave the box no later: the plan order);
    rays never in range are left out."""
    out: list[RayBlock] = []
    for plan in plans:
        n_rays = int(plan.pixel_index.size)
        n_bins = int(plan.n_alive.size)
        r0 = 0
        first = len(out)
        while r0 < n_rays:
            d_end = int(np.count_nonzero(plan.n_alive > r0))
            if d_end == 0:
                break
            r1 = min(n_rays, r0 + max(1, CHUNK_POINTS // d_end))
            out.append((plan, r0, r1, d_end, (r1 - r0) * n_bins))
            r0 = r1
        rest = (plane - r0) * n_bins
        if rest and len(out) > first:
            p, a, b, d, units = out[-1]
            out[-1] = (p, a, b, d, units + rest)
    return out


def merge_ray_runs(ray: I64, ix: I64, iy: I64, size: int) -> tuple[I64, I64]:
    """The groups of equal ``(ray, cell)`` among splat entries, found without sorting.

    Convention: points in ray-major order, each ray's points by increasing depth bin: ``ray``
    ``(n,)`` int64, ``ix, iy`` ``(n,)`` int64 the point's base cell; its ``size x size`` splat cells
    are ``(ix + ox, iy + oy)``, ``ox, oy`` in ``[0, size)``, entry ``e = i * size**2 + ox + size * oy``
    (``size`` 1: nearest, 2: bilinear). Returns ``(child, root)``: every entry that is not the
    first of its group (int64 entry indices, increasing) and that first entry. Adding
    ``w[child]`` to ``w[root]`` with ``np.add.at`` in this order sums each group's weights in
    increasing depth bin.

    Exact when the base cell is monotone along each ray on both axes (a straight ray: a cell's
    depth bins are then consecutive points of the ray, whatever points are left out): an entry
    continues the group of the previous point's entry with the same cell, if any."""
    n_corners = size * size
    dx = ix[1:] - ix[:-1]
    dy = iy[1:] - iy[:-1]
    near = np.abs(dx) < size
    near &= np.abs(dy) < size
    near &= ray[1:] == ray[:-1]
    points = np.flatnonzero(near) + 1  # points sharing a splat cell with the previous point
    dx, dy = dx[points - 1], dy[points - 1]
    del near
    ox = np.array([c % size for c in range(n_corners)], dtype=np.int64)
    oy = np.array([c // size for c in range(n_corners)], dtype=np.int64)
    tx = dx[:, None] + ox  # the same cell is the previous point's corner (ox + dx, oy + dy)
    ty = dy[:, None] + oy
    ok = (tx >= 0) & (tx < size) & (ty >= 0) & (ty < size)
    entry = points[:, None] * n_corners
    child = (entry + np.arange(n_corners))[ok]  # row-major: increasing
    root = (entry - n_corners + tx + size * ty)[ok]
    del tx, ty, ok, entry
    while child.size:  # pointer jumping to each chain's first entry (log2 of the longest chain)
        j = np.minimum(np.searchsorted(child, root), child.size - 1)
        up = child[j] == root
        if not up.any():
            break
        root[up] = root[j[up]]
    return child, root


class RayStream:
    """The ``mode="ray"`` entries (module docstring). Counting frame: the BEV cells; order score
    bins logarithmic in ``w`` (:meth:`_bin`; ``w <= 1``: the prior sums to 1 over a pixel's bins,
    each splat weight is <= 1)."""

    def __init__(self, rig: RigConfig, *, splat: str, rounding: str, k: int, prior: NormalisedPrior, jobs: int = 1) -> None:
        self.rig = rig
        self.bev = bev = BevBox.of(rig)
        self.trunc = rounding == "trunc"
        self.bilinear = splat == "bilinear"
        self.k = k
        self.prior = prior
        self.n_cells = self.n_frame = bev.n_cells
        self.depths = np.asarray(rig.depth.values(), dtype=np.float64)
        w_f, h_f = rig.feature_size
        self.plane = w_f * h_f
        self.n_bins = hist_bins(self.n_cells, HIST_BINS_MAX, HIST_MAX_ENTRIES)
        self.per_octave = max(1, self.n_bins // OCTAVES)
        self.in_range = 0
        self.n_valid = 0
        self._mass = np.zeros(self.n_cells)
        self._thr: I64 = np.zeros(0, np.int64)
        self._wlow: F64 = np.zeros(0)

        def plan(cam: int) -> CameraPlan:
            return plan_camera(bev, self.trunc, cam, camera_rays(rig, cam), self.depths)

        plans = [own_plan(p) if jobs > 1 else p for p in ordered_map(plan, range(rig.n_cam), plan_jobs(rig, jobs))]
        release_free_memory()
        self.n_valid = sum(p.pixel_index.size for p in plans) * rig.depth.n_bins
        self._blocks = plan_ray_blocks(plans, self.plane)

    def blocks(self) -> list[RayBlock]:
        return self._blocks

    def work_units(self, block: RayBlock) -> int:
        return block[4]

    def entries(self, block: RayBlock, threshold: I64 | None = None, *, counting: bool = False) -> tuple[Entries, int]:
        """The block's merged entries (one per (row, col), weight > 0), and its points in range.
        Order: by plan ray, then first depth bin (a row's entries in plan-ray order, so its mass
        sums as in (row, ray) order); with K = 0 (every entry kept, in order) by row, then plan
        ray. With ``threshold`` (pass 2, K > 0) only the entries whose score bin is
        ``<= threshold[row]``. ``counting`` (pass 1): rows and weights only (``col``, ``dist2``
        empty).

        The merge over depth bins needs no sort: a ray is a straight line, its points' cell
        coordinates are monotone along depth (in float too), so the depth bins at which a cell is
        one of a point's splat cells are consecutive points of the ray (:func:`merge_ray_runs`)."""
        plan, r0, r1, d_end, _units = block
        fx, fy, _fz, sel = block_coordinates(self.bev, self.trunc, self.depths, (plan, 0, d_end, r0, r1), ray_major=True)
        if sel is None:
            q = np.arange(fx.size, dtype=np.int64)
        else:
            q = sel
            fx, fy = fx[sel], fy[sel]
        n_in = int(q.size)
        ray = q // d_end  # local ray in [0, r1 - r0); points ray-major, depth bins increasing
        depth_bin = q - ray * d_end
        del q
        pixel = plan.pixel_index[r0 + ray].astype(np.int64) if self.prior.per_pixel else None
        prior = self.prior.weights(plan.cam_index, depth_bin, pixel)
        del pixel
        del depth_bin
        live = prior > 0.0
        if not live.all():
            fx, fy, prior, ray = fx[live], fy[live], prior[live], ray[live]
        del live
        bev = self.bev
        if self.bilinear:
            gx, gy, ix0, iy0, ax, ay = bilinear_split(fx, fy)
            del fx, fy
            bx = 1.0 - ax
            by = 1.0 - ay
            # a corner cell (i0 + o) outside [0, n) on an axis gets axis weight 0 (dropped as weight 0)
            for lower, upper, i0, n in ((bx, ax, ix0, bev.nx), (by, ay, iy0, bev.ny)):
                lower[(i0 < 0) | (i0 >= n)] = 0.0
                upper[(i0 < -1) | (i0 >= n - 1)] = 0.0
            weight_pc = np.empty((prior.size, 4))
            for c, (ox, oy) in enumerate(((0, 0), (1, 0), (0, 1), (1, 1))):
                w = weight_pc[:, c]
                np.multiply(ax if ox else bx, ay if oy else by, out=w)
                w *= prior
            del ax, ay, bx, by
            size = 2
        else:
            ix0 = np.trunc(fx) if self.trunc else np.floor(fx)
            iy0 = np.trunc(fy) if self.trunc else np.floor(fy)
            gx = fx - 0.5
            gy = fy - 0.5
            del fx, fy
            weight_pc = prior.reshape(-1, 1)
            size = 1
        del prior
        ixi = ix0.astype(np.int64)
        iyi = iy0.astype(np.int64)
        child, root = merge_ray_runs(ray, ixi, iyi, size)
        flat_w = weight_pc.ravel()
        merged = flat_w
        if child.size:
            merged = flat_w.copy()
            np.add.at(merged, root, flat_w[child])  # in increasing depth bin: the sum of the module docstring
            merged[child] = 0.0
        kept = np.flatnonzero(merged > 0.0)  # the first entry of every group with weight > 0, in entry order
        n_corners = size * size
        base = iyi
        base *= bev.nx
        base += ixi
        del ixi, iyi
        if n_corners > 1:
            point: I64 = kept >> 2
            corner: I64 = kept & 3
            row = base[point]
            row += np.array([0, 1, bev.nx, bev.nx + 1], dtype=np.int64)[corner]
        else:
            point, corner = kept, np.zeros(kept.size, np.int64)
            row = base[point]
        del base
        weight: F64 = merged[kept]
        if threshold is not None:
            maybe = np.flatnonzero(weight >= self._wlow[row])  # a float bound first: most fail it
            exact = maybe[self._bin(weight[maybe]) <= threshold[row[maybe]]]
            kept, point, corner, row, weight = kept[exact], point[exact], corner[exact], row[exact], weight[exact]
            del maybe, exact
        if counting:  # pass 1: the rows and weights are all it needs
            return Entries(row, np.zeros(0, np.int64), weight, np.zeros(0)), n_in
        ray_kept = ray[point]
        col = plan.cam_index * self.plane + plan.pixel_index[r0 + ray_kept].astype(np.int64)
        dist2 = self._dist2(gx, gy, ix0, iy0, point, corner, size, flat_w[kept] > 0.0)
        if child.size:  # the kept groups' other entries, by position in kept
            at = np.minimum(np.searchsorted(kept, root), max(0, kept.size - 1))
            found = kept[at] == root if kept.size else np.zeros(root.size, dtype=bool)
            child, group = child[found], at[found]
            del at, found
        if child.size:
            c_point: I64 = child // n_corners if n_corners > 1 else child
            c_corner = child - c_point * n_corners
            np.minimum.at(dist2, group, self._dist2(gx, gy, ix0, iy0, c_point, c_corner, size, flat_w[child] > 0.0))
        if self.k == 0:  # every entry kept, in order: by row, then plan ray
            order = np.argsort(row * (r1 - r0) + ray_kept)
            return Entries(row[order], col[order], weight[order], dist2[order]), n_in
        return Entries(row, col, weight, dist2), n_in

    def _dist2(self, gx: F64, gy: F64, ix0: F64, iy0: F64, point: I64, corner: I64, size: int, positive: npt.NDArray[np.bool_]) -> F64:
        """The frustum ``dist2`` of splat entries ``(point, corner)`` (``inf`` where the entry's
        weight is 0: it does not contribute)."""
        bev = self.bev
        oy = corner // size if size > 1 else 0
        ex = gx[point] - (ix0[point] + (corner - oy * size))
        ex *= bev.dx
        ey = gy[point] - (iy0[point] + oy)
        ey *= bev.dy
        ex *= ex
        ey *= ey
        ex += ey
        ex[~positive] = np.inf
        return ex

    def _bin(self, weight: F64) -> I64:
        """The Top-K score bin of merged weights ``w`` (in ``(0, 1]``), non-decreasing as ``w``
        decreases: ``S`` bins per octave (``w = m 2^e``, ``frexp``), ``(1 - e) S + floor(2 (1 - m) S)``,
        the last bin holding everything below ``2^-(n_bins / S)``. With ``S = 2^s`` read off the
        float64 bits (biased exponent ``B = e + 1022``, mantissa bits ``M``: ``2 (1 - m) S =
        (2^52 - M) / 2^(52 - s)``, exact), else with ``frexp``: the same bins."""
        per = self.per_octave
        if per & (per - 1) == 0:
            shift = per.bit_length() - 1
            bits = weight.view(np.int64)
            out = 1023 - (bits >> 52)
            out <<= shift
            sub = bits & ((1 << 52) - 1)
            np.subtract(1 << 52, sub, out=sub)
            sub >>= 52 - shift
            np.minimum(sub, per - 1, out=sub)
            out += sub
            np.clip(out, 0, self.n_bins - 1, out=out)
            return out
        return self._bin_frexp(weight)

    def _bin_frexp(self, weight: F64) -> I64:
        """:meth:`_bin` by its formula, with ``frexp`` (any ``S``)."""
        mantissa, exponent = np.frexp(weight)
        out = (1 - exponent.astype(np.int64)) * self.per_octave
        sub = (1.0 - mantissa) * (2.0 * self.per_octave)
        np.minimum(sub, self.per_octave - 1, out=sub)
        out += sub.astype(np.int64)
        np.clip(out, 0, self.n_bins - 1, out=out)
        return out

    # ---- pass 1 -----------------------------------------------------------------------

    def count(self, block: RayBlock, hist: Histogram, n_bins: int, k: int) -> tuple[int, I64, F64]:
        e, n_in = self.entries(block, counting=True)
        if k > 0:
            keys = e.row * n_bins
            keys += self._bin(e.weight)
        else:
            keys = e.row
        hist.add_scattered(keys)  # a block of rays fans out over many rows, a few entries per counter
        del keys
        rows, local = local_rows(e.row, self.n_cells)
        return n_in, rows, np.bincount(local, weights=e.weight, minlength=rows.size).astype(np.float64, copy=False)

    def fold(self, partial: tuple[int, I64, F64]) -> None:
        n_in, rows, mass = partial
        self.in_range += n_in
        self._mass[rows] += mass

    def cells_of_frame(self, per_frame: npt.NDArray[Any]) -> npt.NDArray[Any]:
        return per_frame

    def total_mass(self, hist_cells: I64) -> F64:
        return self._mass

    # ---- pass 2 -----------------------------------------------------------------------

    def begin_collect(self, threshold: I64, n_bins: int, k: int) -> None:
        """The thresholds, and per row the least weight its threshold bin can hold, less a margin
        (a necessary bound of :meth:`_bin`: bin ``t = a S + b`` needs ``w > 2^(1 - a) (1 - (b + 1) / 2S)``;
        the last bin holds every weight)."""
        self._thr = threshold
        a, b = np.divmod(threshold, self.per_octave)
        low = np.ldexp(1.0 - (b + 1) / (2.0 * self.per_octave), (1 - a).astype(np.int32)) * (1.0 - PREFILTER_MARGIN)
        low[threshold >= self.n_bins - 1] = 0.0
        self._wlow = low

    def collect(self, block: RayBlock) -> tuple[Entries, int]:
        return self.entries(block, self._thr if self.k > 0 else None)

    def end_collect(self) -> None:
        self._blocks = []
        self._thr = np.zeros(0, np.int64)
        self._wlow = np.zeros(0)


def ray_entries(
    rig: RigConfig,
    *,
    splat: str,
    rounding: str,
    topk: int,
    prior: NormalisedPrior,
    progress: ProgressFn | None = None,
    check_row_nnz: Callable[[I64], None] | None = None,
    jobs: int = 1,
    region: RegionRows | None = None,
) -> FrustumResult:
    """Ray-mode entries that survive the Top-K rule, streamed in two passes by ``jobs`` threads
    (:func:`bevcompile.matrix.topk.stream_topk` over :class:`RayStream`; the same bytes for every
    ``jobs``). ``n_points*`` count frustum points, as in frustum mode. ``region``: the rows are a
    ``bev.region``'s (:func:`bevcompile.matrix.entries.run_point_stream`; a ray's depth bins are in
    one block, so its entries merge there)."""
    t0 = time.perf_counter()
    stream = RayStream(rig, splat=splat, rounding=rounding, k=0 if region is not None else topk, prior=prior, jobs=jobs)
    return run_point_stream(
        rig, stream, time.perf_counter() - t0, topk=topk, progress=progress, check_row_nnz=check_row_nnz, jobs=jobs, region=region, splat=splat
    )
