"""Entries of the sparse aggregation matrix: frustum rays, the streamed two-pass Top-K build,
grid-mode entries and the Top-K rule. Pure numpy; used by :mod:`bevcompile.matrix.build` (which states
the conventions and re-exports the public names).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from ..grid.gather import bilinear_corners
from ..grid.ipm import compute_sampling_grid
from ..rig.config import RigConfig
from ..rig.geometry import bev_from_cam_matrix, feature_px_to_image_px, unproject_image_to_cam

ProgressFn = Callable[[int], None]
I64 = npt.NDArray[np.int64]
F64 = npt.NDArray[np.float64]

HIST_BINS_MAX = 64
HIST_MAX_ENTRIES = 1 << 23
"""Target of ``n_cells * hist bins`` (int64 counters, 64 MiB) for the bin count; the floor of 8
bins wins above 2^20 cells, so the histogram is 64 B per (padded) cell there and grows with the
grid (``bevcompile.matrix.build.check_frustum_memory`` refuses a grid this machine cannot hold)."""
CHUNK_POINTS = 1 << 17  # frustum points per streamed block (bounded buffers)
HIST_FLUSH = 1 << 22  # histogram indices buffered between bincounts
MAX_INDEX = np.iinfo(np.int32).max


# --------------------------------------------------------------------------------------
# geometry of the frustum columns
# --------------------------------------------------------------------------------------


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
    points_cam_unit, ok = unproject_image_to_cam(camera, feature_px_to_image_px(rig, camera, uv_feature_px), 1.0)
    bev_from_cam = bev_from_cam_matrix(rig, camera)
    pixel_index = np.flatnonzero(ok).astype(np.int64)
    x_n = points_cam_unit[pixel_index, 0]
    y_n = points_cam_unit[pixel_index, 1]
    ray = np.empty((3, pixel_index.size), dtype=np.float64)
    for i in range(3):
        ray[i] = bev_from_cam[i, 0] * x_n + bev_from_cam[i, 1] * y_n + bev_from_cam[i, 2]
    return CameraRays(bev_from_cam[:3, 3].copy(), ray, pixel_index)


@dataclass(frozen=True)
class _Bev:
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
    def of(cls, rig: RigConfig) -> _Bev:
        b = rig.bev
        return cls(b.x.min, b.x.step, b.x.n, b.y.min, b.y.step, b.y.n, b.z.min, b.z.step, b.z.n)

    @property
    def n_cells(self) -> int:
        return self.nx * self.ny


@dataclass
class _Block:
    """The in-range points of one streamed block: columns and cell coordinates ``f_x, f_y``."""

    col: I64
    fx: F64
    fy: F64


CULL_MARGIN_M = 1e-6
"""The per-ray depth culling tests a box this much larger than the BEV box (far more than any
float error of a point), so it never drops a point the exact in-range test would keep."""


@dataclass(frozen=True)
class _CameraPlan:
    """One camera's rays reordered by decreasing ``j_hi`` (the first depth bin past which the ray
    has certainly left the BEV box), so the rays that can still be in range at depth bin ``j`` are
    the prefix ``[:n_alive[j]]``."""

    cam_index: int
    origin_bev: F64
    ray_bev: F64  # (3, P), reordered
    pixel_index: I64  # (P,), reordered
    n_alive: I64  # (D,)


def _plan_camera(bev: _Bev, trunc: bool, cam_index: int, rays: CameraRays, depths: F64) -> _CameraPlan:
    """Conservative per-ray culling: the depth where ``origin + d * ray`` leaves the BEV box
    enlarged by ``CULL_MARGIN_M`` (slab intersection), as a depth-bin index."""
    lo_pad = 1.0 if trunc else 0.0  # trunc keeps f in (-1, 0): one more cell below each axis
    d_max = np.full(rays.pixel_index.size, np.inf)
    for axis, (lo, step, n) in enumerate(
        ((bev.x_min, bev.dx, bev.nx), (bev.y_min, bev.dy, bev.ny), (bev.z_min, bev.dz, bev.nz))
    ):
        low = lo - lo_pad * step - CULL_MARGIN_M
        high = lo + n * step + CULL_MARGIN_M
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
    return _CameraPlan(
        cam_index, rays.origin_bev, np.ascontiguousarray(rays.ray_bev[:, order]), rays.pixel_index[order], n_alive
    )


def _iter_blocks(rig: RigConfig, plans: list[_CameraPlan]) -> Iterator[tuple[_CameraPlan, int, int]]:
    """(camera plan, first depth bin, end depth bin) per streamed block: cameras in order, depth
    bins in order, about ``CHUNK_POINTS`` live points (at least one depth bin) per block."""
    n_bins = rig.depth.n_bins
    for plan in plans:
        d0 = 0
        while d0 < n_bins:
            alive = int(plan.n_alive[d0])
            d1 = min(n_bins, d0 + max(1, CHUNK_POINTS // max(1, alive)))
            yield plan, d0, d1
            d0 = d1


def _block_in_range(rig: RigConfig, bev: _Bev, trunc: bool, plan: _CameraPlan, d0: int, d1: int, depths: F64) -> _Block:
    """The in-range points of depth bins ``[d0, d1)`` x the rays alive at ``d0``.

    Points are ``t_a + d * ray_a`` per axis (the canonical formula), tested exactly (floor:
    ``0 <= f < n``; trunc: ``-1 < f < n``); culled rays are provably out of range."""
    alive = int(plan.n_alive[d0])
    d = depths[d0:d1, None]
    origin, ray = plan.origin_bev, plan.ray_bev[:, :alive]
    fz = (origin[2] + d * ray[2] - bev.z_min) / bev.dz
    fx = (origin[0] + d * ray[0] - bev.x_min) / bev.dx
    fy = (origin[1] + d * ray[1] - bev.y_min) / bev.dy
    if trunc:
        inside = (fz > -1.0) & (fz < bev.nz) & (fx > -1.0) & (fx < bev.nx) & (fy > -1.0) & (fy < bev.ny)
    else:
        inside = (fz >= 0.0) & (fz < bev.nz) & (fx >= 0.0) & (fx < bev.nx) & (fy >= 0.0) & (fy < bev.ny)
    sel = np.flatnonzero(inside)
    w_f, h_f = rig.feature_size
    d_local = sel // max(1, alive)
    pix = plan.pixel_index[sel - d_local * alive]
    col = (plan.cam_index * rig.depth.n_bins + d0 + d_local) * (h_f * w_f) + pix
    return _Block(col, fx.ravel()[sel], fy.ravel()[sel])


# --------------------------------------------------------------------------------------
# entries and Top-K
# --------------------------------------------------------------------------------------


@dataclass
class Entries:
    """Matrix entries before normalisation.

    Convention: ``row`` int64 BEV cell ``iy * nx + ix``; ``col`` int64 column; ``weight``
    float64 raw weight (> 0); ``dist2`` float64 tie-break distance (see module docstring).
    """

    row: I64
    col: I64
    weight: F64
    dist2: F64

    @classmethod
    def empty(cls) -> Entries:
        return cls(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0), np.zeros(0))

    @classmethod
    def concat(cls, parts: list[Entries]) -> Entries:
        if not parts:
            return cls.empty()
        return cls(
            np.concatenate([p.row for p in parts]),
            np.concatenate([p.col for p in parts]),
            np.concatenate([p.weight for p in parts]),
            np.concatenate([p.dist2 for p in parts]),
        )

    def take(self, index: npt.NDArray[np.integer[Any]] | npt.NDArray[np.bool_]) -> Entries:
        return Entries(self.row[index], self.col[index], self.weight[index], self.dist2[index])

    def __len__(self) -> int:
        return int(self.row.size)


def select_topk(entries: Entries, k: int) -> Entries:
    """The Top-K rule on distinct ``(row, col)`` entries; returns the kept entries sorted by
    ``(row, col)``. ``k = 0`` keeps everything.

    Convention: :class:`Entries` in (any order) -> :class:`Entries` out, sorted by (row, col).

    Order within a row: larger weight, then smaller ``dist2``, then smaller column. One stable
    argsort of a float key ``row * span + (primary - min)`` (exactly separating rows, monotone in
    the primary key: ``-weight``, or ``dist2`` when every weight is equal) orders the entries;
    runs of equal keys (equal primaries, or primaries that rounded together) are then re-sorted
    exactly by (primary, dist2, col).
    """
    if k > 0 and len(entries):
        equal_weights = bool(np.all(entries.weight == entries.weight[0]))
        primary = entries.dist2 if equal_weights else -entries.weight
        low = float(primary.min())
        span = float(math.floor(float(primary.max()) - low) + 2)
        if entries.row.max() * span >= 2.0**52:  # pragma: no cover - beyond any BEV grid
            order = np.lexsort((entries.col, entries.dist2, primary, entries.row))
        else:
            key = entries.row * span + (primary - low)
            order = np.argsort(key, kind="stable")
            key_sorted = key[order]
            tie = key_sorted[1:] == key_sorted[:-1]
            if tie.any():
                in_run = np.zeros(order.size, dtype=bool)
                in_run[1:] |= tie
                in_run[:-1] |= tie
                pos = np.flatnonzero(in_run)
                run_id = np.cumsum(np.r_[True, ~tie])[pos]
                sub = order[pos]
                order[pos] = sub[np.lexsort((entries.col[sub], entries.dist2[sub], primary[sub], run_id))]
        row_sorted = entries.row[order]
        starts = np.flatnonzero(np.r_[True, row_sorted[1:] != row_sorted[:-1]])
        counts = np.diff(np.r_[starts, row_sorted.size])
        rank = np.arange(row_sorted.size) - np.repeat(starts, counts)
        entries = entries.take(order[rank < k])
    if len(entries) and int(entries.row.max()) < MAX_INDEX and int(entries.col.max()) < MAX_INDEX:
        order = np.argsort(entries.row * (int(entries.col.max()) + 1) + entries.col)
    else:
        order = np.lexsort((entries.col, entries.row))
    return entries.take(order)


def _hist_bins(n_cells: int) -> int:
    return int(max(8, min(HIST_BINS_MAX, HIST_MAX_ENTRIES // max(1, n_cells))))


def _score_bin(score: F64, scale: float, n_bins: int, clip: bool = True) -> I64:
    """Histogram bin of a Top-K order score (smaller = better): ``min(floor(score * scale), n - 1)``.
    Monotone non-decreasing in ``score``: a smaller bin means a strictly better entry.
    ``clip=False`` when ``score * scale < n_bins`` is guaranteed."""
    out = (score * scale).astype(np.int64)
    if clip:
        np.minimum(out, n_bins - 1, out=out)
    return out


class _Counter:
    """``bincount`` accumulator that buffers indices, so that the (large) histogram is added to
    once per ~``HIST_FLUSH`` indices instead of once per block."""

    def __init__(self, size: int) -> None:
        self.total: I64 = np.zeros(size, dtype=np.int64)
        self._index: list[I64] = []
        self._pending = 0

    def add(self, index: I64) -> None:
        self._index.append(index)
        self._pending += index.size
        if self._pending >= HIST_FLUSH:
            self.flush()

    def flush(self) -> I64:
        if self._index:
            self.total += np.bincount(np.concatenate(self._index), minlength=self.total.size)
        self._index, self._pending = [], 0
        return self.total


def _thresholds(hist: I64, k: int, n_bins: int) -> I64:
    """Per row the bin holding its k-th best counted entry (every entry in a later bin is strictly
    worse than k entries); ``n_bins - 1`` (keep all) for rows with fewer than k entries.

    Convention: hist ``(n_rows, n_bins)`` int64 counts -> ``(n_rows,)`` int64 bins."""
    cum = np.cumsum(hist, axis=1)
    enough = cum >= k
    out = np.argmax(enough, axis=1).astype(np.int64)
    out[~enough[:, -1]] = n_bins - 1
    return out


@dataclass
class FrustumResult:
    kept: Entries
    total_mass: F64  # (n_cells,) raw weight of every entry of each row, before Top-K
    n_points: int
    n_points_valid: int
    n_points_in_range: int
    n_candidates: int
    phase_seconds: dict[str, float]


def frustum_entries(
    rig: RigConfig,
    *,
    splat: str,
    rounding: str,
    topk: int,
    progress: ProgressFn | None = None,
    check_row_nnz: Callable[[I64], None] | None = None,
) -> FrustumResult:
    """Frustum-mode entries that survive the Top-K rule, streamed in two passes.

    K = 0 keeps every entry, so pass 1 only counts the entries of each row (no histogram) and
    hands the counts (``(ny * nx,)`` int64, exactly the final row nnz) to ``check_row_nnz``,
    which may refuse (raise) before pass 2 collects and sorts them all.

    Pass 1 (only when K > 0) counts every entry of every row into a histogram of its order score
    (bilinear: ``1 - w``; nearest: ``dist2``) and sums the row mass. The per-row threshold bin
    ``b[r]`` is the bin of its K-th best entry: an entry in a later bin is strictly worse than K
    others and can never be kept. Pass 2 recomputes the points block by block and keeps only
    entries with ``bin <= b[row]``; one exact sort of those candidates applies the rule. The
    bins are a pure function of the float64 weights, so the result is exactly the reference's.
    """
    bev = _Bev.of(rig)
    trunc = rounding == "trunc"
    bilinear = splat == "bilinear"
    k = topk
    n_cells = bev.n_cells
    nx = bev.nx
    w_f, h_f = rig.feature_size
    clock = time.perf_counter()
    phases: dict[str, float] = {}

    def phase(name: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        phases[name] = now - clock
        clock = now

    def report(n: int) -> None:
        if progress is not None:
            progress(n)

    depths_all = np.asarray(rig.depth.values(), dtype=np.float64)
    rays_all = [camera_rays(rig, c) for c in range(rig.n_cam)]
    plans = [_plan_camera(bev, trunc, c, rays, depths_all) for c, rays in enumerate(rays_all)]
    phase("rays")
    n_bins = _hist_bins(n_cells)
    # score scale: bilinear score = 1 - w in [0, 1] (bins never exceed n_bins - 1, no clip);
    # nearest score = dist2 in [0, h2] for floor rounding (clipped: trunc can exceed h2)
    h2 = (0.5 * bev.dx) ** 2 + (0.5 * bev.dy) ** 2
    scale = n_bins * (1.0 - 2.0**-20) if bilinear else n_bins / h2
    n_points = rig.n_cam * rig.depth.n_bins * w_f * h_f
    n_valid = sum(r.pixel_index.size for r in rays_all) * rig.depth.n_bins
    # bilinear works on a padded grid: padded cell (iy + 2, ix + 2) for iy in [-2, ny], so the
    # four corners of a point need no bounds test (padding rows never keep anything).
    pad_h, pad_w = bev.ny + 3, bev.nx + 3
    n_pad = pad_h * pad_w
    offsets = ((0, 0, 0), (1, 0, 1), (0, 1, pad_w), (1, 1, pad_w + 1))  # (ox, oy, padded offset)
    interior = (slice(2, bev.ny + 2), slice(2, bev.nx + 2))

    def corner_frame(blk: _Block) -> tuple[F64, F64, F64, F64, F64, F64, F64, F64, I64]:
        gx = blk.fx - 0.5
        gy = blk.fy - 0.5
        ix0 = np.floor(gx)
        iy0 = np.floor(gy)
        ax = gx - ix0
        ay = gy - iy0
        bidx = ((iy0 + 2.0) * pad_w + (ix0 + 2.0)).astype(np.int64)
        return gx, gy, ix0, iy0, ax, ay, 1.0 - ax, 1.0 - ay, bidx

    def nearest_frame(blk: _Block) -> tuple[I64, F64]:
        ix = np.trunc(blk.fx) if trunc else np.floor(blk.fx)
        iy = np.trunc(blk.fy) if trunc else np.floor(blk.fy)
        ex = (blk.fx - 0.5 - ix) * bev.dx
        ey = (blk.fy - 0.5 - iy) * bev.dy
        return (iy * nx + ix).astype(np.int64), ex * ex + ey * ey

    in_range = [0, 0]
    total_mass = np.zeros(n_cells)
    threshold = np.full(n_cells, n_bins, dtype=np.int64)  # K = 0: every bin passes
    if k > 0:
        hist_counter = _Counter((n_pad if bilinear else n_cells) * n_bins)
        mass_by_corner = [np.zeros(n_pad) for _ in offsets]
        for plan, d0, d1 in _iter_blocks(rig, plans):
            blk = _block_in_range(rig, bev, trunc, plan, d0, d1, depths_all)
            in_range[0] += blk.col.size
            if bilinear:
                _gx, _gy, _ix0, _iy0, ax, ay, bx, by, bidx = corner_frame(blk)
                base = bidx * n_bins
                for (ox, oy, off), mass in zip(offsets, mass_by_corner, strict=True):
                    wgt = (ax if ox else bx) * (ay if oy else by)
                    key = ((1.0 - wgt) * scale).astype(np.int64)
                    key += base + off * n_bins
                    hist_counter.add(key)
                    mass += np.bincount(bidx, weights=wgt, minlength=n_pad)
            else:
                row, dist2 = nearest_frame(blk)
                hist_counter.add(row * n_bins + _score_bin(dist2, scale, n_bins))
            report((d1 - d0) * w_f * h_f)
        hist = hist_counter.flush()
        if bilinear:
            mass_pad = np.zeros(n_pad)
            for (_ox, _oy, off), mass in zip(offsets, mass_by_corner, strict=True):
                mass_pad[off:] += mass[: n_pad - off]
            total_mass = mass_pad.reshape(pad_h, pad_w)[interior].ravel()
            hist2 = hist.reshape(pad_h, pad_w, n_bins)[interior].reshape(n_cells, n_bins)
        else:
            hist2 = hist.reshape(n_cells, n_bins)
            total_mass = hist2.sum(axis=1).astype(np.float64)
        threshold = _thresholds(hist2, k, n_bins)
        del hist, hist2, hist_counter
        phase("pass1_histogram")
    else:  # K = 0: count the entries of every row (every one is kept), for a refusal before pass 2
        row_counter = _Counter(n_pad if bilinear else n_cells)
        for plan, d0, d1 in _iter_blocks(rig, plans):
            blk = _block_in_range(rig, bev, trunc, plan, d0, d1, depths_all)
            in_range[0] += blk.col.size
            if bilinear:
                _gx, _gy, _ix0, _iy0, ax, ay, bx, by, bidx = corner_frame(blk)
                for ox, oy, off in offsets:
                    wgt = (ax if ox else bx) * (ay if oy else by)
                    row_counter.add(bidx[wgt > 0.0] + off)
            else:
                row_counter.add(nearest_frame(blk)[0])
            report((d1 - d0) * w_f * h_f)
        row_nnz = row_counter.flush()
        if bilinear:  # padding cells never keep anything
            row_nnz = row_nnz.reshape(pad_h, pad_w)[interior].ravel()
        del row_counter
        phase("pass1_row_counts")
        if check_row_nnz is not None:
            check_row_nnz(row_nnz)
        del row_nnz
    threshold_pad = np.full((pad_h, pad_w), -1, dtype=np.int64)
    threshold_pad[interior] = threshold.reshape(bev.ny, bev.nx)
    threshold_pad_flat = threshold_pad.ravel()

    # pass 2 (or the only pass when K = 0): collect every entry that can still be in the Top-K
    parts: list[Entries] = []
    for plan, d0, d1 in _iter_blocks(rig, plans):
        blk = _block_in_range(rig, bev, trunc, plan, d0, d1, depths_all)
        in_range[1] += blk.col.size
        if bilinear:
            gx, gy, ix0, iy0, ax, ay, bx, by, bidx = corner_frame(blk)
            for ox, oy, off in offsets:
                wgt = (ax if ox else bx) * (ay if oy else by)
                score_bin = ((1.0 - wgt) * scale).astype(np.int64)
                hit = np.flatnonzero(score_bin <= threshold_pad_flat[bidx + off])
                hit = hit[wgt[hit] > 0.0]
                ixf = ix0[hit] + ox
                iyf = iy0[hit] + oy
                ex = (gx[hit] - ixf) * bev.dx
                ey = (gy[hit] - iyf) * bev.dy
                parts.append(
                    Entries(
                        (iyf * nx + ixf).astype(np.int64),
                        blk.col[hit],
                        wgt[hit],
                        ex * ex + ey * ey,
                    )
                )
        else:
            row, dist2 = nearest_frame(blk)
            hit = np.flatnonzero(_score_bin(dist2, scale, n_bins) <= threshold[row])
            parts.append(Entries(row[hit], blk.col[hit], np.ones(hit.size), dist2[hit]))
        report((d1 - d0) * w_f * h_f)
    candidates = Entries.concat(parts)
    del parts
    phase("pass2_candidates")
    if in_range[0] != in_range[1]:  # pragma: no cover - the passes see the same points
        raise RuntimeError("matrix build: the two passes disagree on the points in range")
    if k == 0:
        total_mass = np.bincount(candidates.row, weights=candidates.weight, minlength=n_cells).astype(np.float64)
    n_candidates = len(candidates)
    kept = select_topk(candidates, k)
    phase("topk_select")
    return FrustumResult(kept, total_mass, n_points, n_valid, in_range[1], n_candidates, phases)


def grid_entries(rig: RigConfig, *, splat: str, progress: ProgressFn | None = None) -> tuple[Entries, F64, int]:
    """Grid-mode entries (duplicates over heights merged), before Top-K.

    Convention: returns (:class:`Entries` with BEV-cell rows and ``col = (cam * H_f + v) * W_f + u``,
    total raw weight per cell ``(ny * nx,)`` float64, number of valid samples).
    """
    sampling = compute_sampling_grid(rig, progress=progress)
    w_f, h_f = rig.feature_size
    ny, nx = rig.bev.ny, rig.bev.nx
    n_cells = ny * nx
    n_cols = rig.n_cam * h_f * w_f
    cells = np.arange(n_cells, dtype=np.int64)
    parts: list[Entries] = []
    for cam_index in range(rig.n_cam):
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
        parts.append(_merge_heights(per_height, n_cols))
    entries = Entries.concat(parts)
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
