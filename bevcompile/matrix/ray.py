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

__all__ = ["RayStream", "ray_entries"]

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

    def entries(self, block: RayBlock, threshold: I64 | None = None) -> tuple[Entries, int]:
        """The block's merged entries (one per (row, col), weight > 0, in a fixed order: by row,
        then plan ray), and its points in range. With ``threshold`` (pass 2, K > 0) only the
        entries whose score bin is ``<= threshold[row]``; their ``dist2`` is computed only then
        (pass 1 leaves it 0: it only counts weights)."""
        plan, r0, r1, d_end, _units = block
        fx, fy, _fz, sel = block_coordinates(self.bev, self.trunc, self.depths, (plan, 0, d_end, r0, r1))
        width = r1 - r0
        q = np.arange(fx.size, dtype=np.int64) if sel is None else sel
        if sel is not None:
            fx, fy = fx[sel], fy[sel]
        n_in = int(q.size)
        depth_bin = q // width
        ray = q - depth_bin * width  # local ray in [0, width)
        del q
        prior = self.prior.weights(plan.cam_index, depth_bin, plan.pixel_index[r0 + ray].astype(np.int64))
        point, slot, cell, wgt = self._splat(fx, fy, prior)
        # merge (row, ray) over depth bins: one sort of unique int64 keys (pair, slot) where the
        # slot point * corners + corner grows with d (points are d-major), so each run is in increasing d
        rows, row_local = local_rows(cell, self.n_cells)
        n_slots = n_in * (4 if self.bilinear else 1)
        key = row_local * width
        del row_local
        key += ray[point]
        if (int(rows.size) * width + 1) * max(1, n_slots) >= 2**62:  # pragma: no cover - far beyond any block
            raise RuntimeError("ray-mode block too large for its merge key")
        key *= n_slots
        key += slot
        key.sort()
        pair_all = key // n_slots
        key -= pair_all * n_slots  # now the slot of each sorted element
        element = np.empty(n_slots, dtype=np.int64)
        element[slot] = np.arange(slot.size)
        order = element[key]
        del key, element, slot
        new = np.empty(pair_all.size, dtype=bool)
        new[:1] = True
        np.not_equal(pair_all[1:], pair_all[:-1], out=new[1:])
        starts = np.flatnonzero(new)
        group = np.cumsum(new) - 1
        del new
        key = pair_all
        weight: F64 = np.bincount(group, weights=wgt[order], minlength=starts.size).astype(np.float64, copy=False)
        pair = key[starts]
        del key, pair_all
        row = rows[pair // width]
        if threshold is not None:
            passing = self._bin(weight) <= threshold[row]
            keep_elem = passing[group]
            order, group = order[keep_elem], group[keep_elem]
            starts = np.flatnonzero(np.r_[True, group[1:] != group[:-1]]) if group.size else np.zeros(0, np.int64)
            pair, row, weight = pair[passing], row[passing], weight[passing]
        col = plan.cam_index * self.plane + plan.pixel_index[r0 + pair % width].astype(np.int64)
        if threshold is None and self.k > 0:  # pass 1: the weights are all it needs
            return Entries(row, col, weight, np.zeros(weight.size)), n_in
        bev = self.bev
        p = point[order]
        c = cell[order]
        cy = c // bev.nx
        ex = fx[p] - 0.5
        ex -= c - cy * bev.nx
        ex *= bev.dx
        ey = fy[p] - 0.5
        ey -= cy
        ey *= bev.dy
        ex *= ex
        ey *= ey
        ex += ey
        dist2 = np.minimum.reduceat(ex, starts) if starts.size else np.zeros(0)
        return Entries(row, col, weight, dist2), n_in

    def _splat(self, fx: F64, fy: F64, prior: F64) -> tuple[I64, I64, I64, F64]:
        """``(point, slot, cell, prior * splat weight)`` of every (point, splat cell) in the grid
        with a weight > 0 (the frustum's rule: ``bevcompile.matrix.build`` module docstring);
        ``slot = point * 4 + corner`` (bilinear) or ``point`` (nearest)."""
        bev = self.bev
        if not self.bilinear:
            ix = np.trunc(fx) if self.trunc else np.floor(fx)
            iy = np.trunc(fy) if self.trunc else np.floor(fy)
            iy *= bev.nx
            iy += ix
            point = np.flatnonzero(prior > 0.0)
            return point, point, iy.astype(np.int64)[point], prior[point]
        gx, gy, ix0, iy0, ax, ay = bilinear_split(fx, fy)
        del gx, gy  # bounded temporaries: only the corners and fractions are used
        bx = 1.0 - ax
        by = 1.0 - ay
        points, slots, cells, weights = [], [], [], []
        for corner, (ox, oy) in enumerate(((0, 0), (1, 0), (0, 1), (1, 1))):
            w = (ax if ox else bx) * (ay if oy else by)
            w *= prior
            ok = w > 0.0
            ok &= ix0 >= -ox  # the corner cell (i0 + o) in [0, n) on both axes
            ok &= ix0 < bev.nx - ox
            ok &= iy0 >= -oy
            ok &= iy0 < bev.ny - oy
            point = np.flatnonzero(ok)
            cell = iy0[point]
            cell += oy
            cell *= bev.nx
            cell += ix0[point]
            cell += ox
            points.append(point)
            slots.append(point * 4 + corner)
            cells.append(cell.astype(np.int64))
            weights.append(w[point])
        return np.concatenate(points), np.concatenate(slots), np.concatenate(cells), np.concatenate(weights)

    def _bin(self, weight: F64) -> I64:
        """The Top-K score bin of merged weights ``w`` (in ``(0, 1]``), non-decreasing as ``w``
        decreases: ``S`` bins per octave (``w = m 2^e``, ``frexp``), ``(1 - e) S + floor(2 (1 - m) S)``,
        the last bin holding everything below ``2^-(n_bins / S)``."""
        mantissa, exponent = np.frexp(weight)
        out = (1 - exponent.astype(np.int64)) * self.per_octave
        sub = (1.0 - mantissa) * (2.0 * self.per_octave)
        np.minimum(sub, self.per_octave - 1, out=sub)
        out += sub.astype(np.int64)
        np.clip(out, 0, self.n_bins - 1, out=out)
        return out

    # ---- pass 1 -----------------------------------------------------------------------

    def count(self, block: RayBlock, hist: Histogram, n_bins: int, k: int) -> tuple[int, I64, F64]:
        e, n_in = self.entries(block)
        rows, local = local_rows(e.row, self.n_cells)
        if k > 0:
            keys = local * n_bins
            keys += self._bin(e.weight)
        else:
            keys = local
        hist.add_local(rows, keys)
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
        self._thr = threshold

    def collect(self, block: RayBlock) -> tuple[Entries, int]:
        return self.entries(block, self._thr if self.k > 0 else None)

    def end_collect(self) -> None:
        self._blocks = []
        self._thr = np.zeros(0, np.int64)


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
