"""The ``mode="ray"`` matrix as a streamed :class:`~bevcompile.matrix.topk.EntryStream`. Pure numpy.

A ray-mode entry is a frustum-mode ray folded over its depth bins with a fixed prior
(:mod:`bevcompile.matrix.prior`): column ``(cam * H_f + v) * W_f + u`` (grid mode's), weight
``sum_d p[cam, d, v, u] * s_d`` where ``s_d`` is the frustum splat weight of the point at depth bin
``d`` in the row's cell (the frustum's points, range rule, ``--splat`` and ``--rounding``,
:mod:`bevcompile.matrix.entries`), summed sequentially in increasing ``d``; tie-break distance
the smallest frustum ``dist2`` of the depth bins that contribute (weight > 0).

The stream's **blocks** are ``(camera, rays [r0, r1))`` of the camera's culled ray plan
(:func:`bevcompile.matrix.entries.plan_camera`, rays by decreasing last live depth bin), about
``CHUNK_POINTS`` points each: all the depth bins of a pixel are in one block, so a block's merged
entries are complete and final. Fixed by the rig, never by ``--jobs``. A ray's points in range are
one run of depth bins (:func:`ray_intervals`, found once per camera), so a block computes its
rays' ``(ray, depth bin)`` rectangle by broadcasting, with
:func:`bevcompile.matrix.entries.block_coordinates`' own float64 operations, and keeps the points
in range (98 % of it on the dense rig).

With K > 0 the two passes are:

* pass 1 (:meth:`RayStream.count`) counts, in the Top-K histogram (:class:`RayBins`), the merged
  entries of the rays at plan positions that are multiples of ``PASS1_STRIDE`` (nearest: a few
  consecutive blocks of a camera at a time, :meth:`RayStream.count_blocks`, so that each call
  handles about a block's entries; the keys are counted in the calling thread). The entries of a
  subset of the rays are entries of the matrix with their exact weights (a ray's entries come from
  its own points only), so the K-th best of a row among them is no better than its K-th best
  overall: the threshold bins they give keep every entry of the Top-K;
* pass 2 (:meth:`RayStream.collect`) computes every ray's merged entries and the block's row
  masses, and keeps the entries whose bin is ``<=`` their row's threshold (a float bound first,
  then the exact bin). In the calling thread, in block order (:meth:`RayStream.fold_collected`),
  the row masses are summed (the same bits for every ``--jobs``) and the candidates of the rays
  pass 1 did not count are counted into its histogram: each row's threshold tightens to the bin of
  its K-th best counted entry, the candidates past it are dropped, and once pass 2 is over the
  candidate buffer keeps only those within the final thresholds
  (:meth:`RayStream.refine_candidates`). The Top-K that the buffer's exact sort then selects is
  the straightforward build's, bit for bit, whatever the sample.

With K = 0 pass 1 counts every entry of every row (the exact row nnz, checked before pass 2) and
pass 2 returns them all, by row then plan ray.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import numpy.typing as npt

from ..memory import release_free_memory
from ..parallel import ordered_map
from ..progress import ProgressFn
from ..rig.config import RigConfig
from .entries import (
    PREFILTER_MARGIN,
    BevBox,
    CameraPlan,
    FrustumResult,
    PaddedFrame,
    RegionRows,
    bilinear_split,
    camera_rays,
    cell_coordinate,
    coordinate_in_range,
    corner_dist2,
    nearest_split,
    own_plan,
    plan_camera,
    plan_jobs,
    run_point_stream,
)
from .prior import NormalisedPrior
from .scatter import scatter_add
from .topk import Entries, Histogram, counts_before, local_rows, thresholds

__all__ = ["RayBins", "RayStream", "chain_roots", "merge_ray_runs", "ray_entries"]

I64 = npt.NDArray[np.int64]
F64 = npt.NDArray[np.float64]

CHUNK_POINTS = 1 << 17
"""Frustum points per block, frustum mode's own (:data:`bevcompile.matrix.entries.CHUNK_POINTS`):
every temporary of a block stays small, and the numpy calls stay large. Each call hands the GIL
over between the ``--jobs`` threads, so their number sets how well a build scales (dense rig,
2 cores: ``benchmarks/ray_vs_frustum.py``, docs/matrix.md "Ray mode")."""
PASS1_STRIDE = 3
"""Pass 1 (K > 0) counts the entries of the rays at plan positions that are multiples of
``PASS1_STRIDE`` (module docstring; 2 to 8 give the same build times within 10 % on the dense
rig, 3 the least)."""
ADMIT_BLOCKS = 8
"""Pass 2 admits the candidates of this many consecutive blocks at once (:meth:`RayStream.fold_collected`)."""
LINEAR_BINS = 120
TOP_BINS = 8
"""Weight bins (:class:`RayBins`, ``linear``): ``LINEAR_BINS`` over ``(0, w_ref]`` (``w_ref`` the
prior's largest weight, the largest weight one point can give), ``TOP_BINS`` more above it for
entries that merge several depth bins: 128 int32 counters per cell (frustum mode: 64 int64)."""
DIST2_OCTAVES = 10
DIST2_STEP_BITS = 3
"""The exact weight classes of :class:`RayBins` split ``dist2 / h2`` in ``2^DIST2_STEP_BITS`` steps
per octave over ``DIST2_OCTAVES`` octaves below 1 (82 sub-bins, one below and one above)."""
MAX_TIE_VALUES = 2
"""``classes`` bins are used when the prior's distinct single-bin weights are at most this many
(uniform: one; ``8 + 83 = 91`` bins per cell, two: 174); ``ranked`` past it."""
RANKED_LOW_BINS = 32
"""``ranked`` bins: weights below a row's reference weight, linear in ``w / t_row`` over ``[0, 1)``."""

RayBlock = tuple[CameraPlan, int, int, int, int]
"""``(plan, r0, r1, d_end, units)``: rays ``[r0, r1)`` of the plan at depth bins ``[0, d_end)``;
``units`` its progress units (``(r1 - r0) * D``, the camera's last block also counts the pixels
without a block, so that a pass is ``n_cam * D * H_f * W_f`` units as in frustum mode)."""

_CORNERS = ((0, 0), (1, 0), (0, 1), (1, 1))  # (ox, oy): cell (i0_y + oy, i0_x + ox); entry e = point * 4 + corner


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


def ray_intervals(plan: CameraPlan, box: BevBox, trunc: bool, depths: F64) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int32]]:
    """``(first, end)``: per plan ray, the depth bins ``[first, end)`` at which its point is in range.

    The test is :func:`bevcompile.matrix.entries.block_coordinates`' own, point by point: each cell
    coordinate ``f = (t + d * ray - min) / step`` is monotone in ``d`` (every float64 step is), so
    a ray's points in range are one run of depth bins. It lies below the plan's culling bound
    ``j_hi`` (the enlarged box): ``end`` is found walking down from ``j_hi``, ``first`` walking up
    from 0 (a camera inside the box: no step), testing the exact predicate at each step."""
    n_rays = int(plan.pixel_index.size)
    j_hi = np.zeros(n_rays, dtype=np.int64)
    for j, alive in enumerate(plan.n_alive):  # rays [0, n_alive[j]) can be in range at bin j
        j_hi[: int(alive)] = j + 1

    def inside(rays: I64, bins: I64) -> npt.NDArray[np.bool_]:
        ok = np.ones(rays.size, dtype=bool)
        for axis, n in ((0, box.nx), (1, box.ny), (2, box.nz)):
            ok &= coordinate_in_range(cell_coordinate(box, plan, axis, depths[bins], plan.ray_bev[axis, rays]), n, trunc)
        return ok

    end = j_hi.copy()
    todo = np.flatnonzero(end > 0)
    while todo.size:  # the last bin in range: walk down while out of range
        out = ~inside(todo, end[todo] - 1)
        todo = todo[out]
        end[todo] -= 1
        todo = todo[end[todo] > 0]
    first = np.zeros(n_rays, dtype=np.int64)
    todo = np.flatnonzero(first < end)
    while todo.size:  # the first bin in range: walk up while out of range
        out = ~inside(todo, first[todo])
        todo = todo[out]
        first[todo] += 1
        todo = todo[first[todo] < end[todo]]
    return first.astype(np.int32), end.astype(np.int32)


def merge_ray_runs(starts: I64, base: I64, width: int, size: int) -> tuple[I64, I64]:
    """The groups of equal ``(ray, cell)`` among splat entries, found without sorting.

    Convention: ``n`` points in ray-major order, each ray's points by increasing depth bin;
    ``starts`` int64 the index of each ray's first point (any order, repeats and ``n`` allowed:
    rays without points); ``base`` ``(n,)`` int64 the point's base cell as the row
    ``i_y * width + i_x`` (plus any constant), its ``i_x`` spanning at most ``width - size``
    (the bilinear counting frame: ``i0_x`` in ``[-2, n_x - 1]``, width ``n_x + 3``; nearest: the
    cell index, width ``n_x``); its ``size x size`` splat cells are ``(i_x + ox, i_y + oy)``,
    ``ox, oy`` in ``[0, size)``, entry ``e = i * size**2 + ox + size * oy`` (``size`` 1: nearest,
    2: bilinear). Returns ``(child, root)``: every entry that is not the first of its group (int64
    entry indices, increasing) and that first entry. Adding ``w[child]`` to ``w[root]`` with
    ``np.add.at`` in this order sums each group's weights in increasing depth bin.

    Exact when the base cell is monotone along each ray on both axes (a straight ray: a cell's
    depth bins are then consecutive points of the ray, whatever points are left out): an entry
    continues the group of the previous point's entry with the same cell, if any. The step
    ``(dx, dy)`` from the previous point is read off ``d = base[i] - base[i - 1] = dy * width + dx``:
    two points share a splat cell iff ``|dx|, |dy| < size``, and a ``d`` of such a step has no
    other decomposition with ``|dx|`` within the span (another differs by a multiple of
    ``width`` in ``dx``), so a table of the ``(2 size - 1)^2`` near steps, indexed by ``d``,
    decides it in one gather."""
    n = int(base.size)
    step = base[1:] - base[:-1]  # d of point i + 1
    cut = starts[(starts > 0) & (starts < n)] - 1  # a ray's first point continues no group
    if size == 1:
        near = step == 0
        near[cut] = False
        points = np.flatnonzero(near) + 1
        return points, chain_roots(points, points - 1, n)
    step += width + 2  # index into the step table (0 and its last slot: not near)
    code = np.take(_step_codes(width), step, mode="clip")  # int8: 0 not near, k: _STEPS[k - 1]
    del step
    code[cut] = 0
    points = np.flatnonzero(code > 0) + 1  # points sharing a splat cell with the previous point of their ray (numpy's nonzero is far faster on bool than on int8)
    code = code[points - 1]
    pair = np.flatnonzero(_STEP_CORNERS[code])  # (point, corner) point-major, increasing: the corners whose cell the previous point's splat has
    at = pair >> 2
    child = points[at] * 4
    child += pair & 3
    del pair
    root = _STEP_ROOT[code[at]]  # corner (ox, oy) is the previous point's (ox + dx, oy + dy): entry e - 4 + dx + 2 dy
    root += child
    return child, chain_roots(child, root, 4 * n)


_STEPS = tuple((dx, dy) for dy in (-1, 0, 1) for dx in (-1, 0, 1))
"""The steps ``(dx, dy)`` of a bilinear base cell between consecutive points that share a splat
cell (:func:`merge_ray_runs`), codes 1 to 9 (0: not near)."""
_STEP_CORNERS = np.array(
    [[False] * 4] + [[0 <= ox + dx <= 1 and 0 <= oy + dy <= 1 for ox, oy in _CORNERS] for dx, dy in _STEPS], dtype=bool
)
"""Per step code, the corners ``(ox, oy)`` (:data:`_CORNERS` order) whose cell is in the previous point's splat."""
_STEP_ROOT = np.array([0] + [dx + 2 * dy - 4 for dx, dy in _STEPS], dtype=np.int64)
"""Per step code, the offset from a corner's entry to the previous point's entry of the same cell."""


@functools.cache
def _step_codes(width: int) -> npt.NDArray[np.int8]:
    """The step table of :func:`merge_ray_runs` for frame rows of ``width``: at ``d + width + 2``
    the code of the near step ``d = dy * width + dx`` (1 to 9, :data:`_STEPS`), 0 elsewhere (both
    ends too, where ``np.take(mode="clip")`` puts every farther step). Built once per width,
    read-only (the ``--jobs`` threads share it)."""
    lut = np.zeros(2 * width + 5, dtype=np.int8)
    for k, (dx, dy) in enumerate(_STEPS, start=1):
        lut[dy * width + dx + width + 2] = k
    lut.flags.writeable = False
    return lut


def chain_roots(child: I64, parent: I64, n_entries: int) -> I64:
    """Each ``child``'s first ancestor that is not a child itself: ``child`` increasing entry
    indices in ``[0, n_entries)``, each with an earlier ``parent`` (a chain: a cell in the splat
    of three or more consecutive points of a ray). Pointer jumping over the chains' links,
    ``log2`` of the longest chain rounds."""
    if not child.size:
        return parent
    is_child = np.zeros(n_entries, dtype=bool)
    is_child[child] = True
    up = is_child[parent]
    del is_child
    if not up.any():
        return parent
    position = np.zeros(n_entries, dtype=np.int64)
    position[child] = np.arange(child.size)
    link = np.arange(child.size)
    link[up] = position[parent[up]]  # the parent's own position among the children
    del position
    while True:
        nxt = link[link]
        if np.array_equal(nxt, link):
            return parent[link]
        link = nxt


# --------------------------------------------------------------------------------------
# the Top-K score bins
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RayBins:
    """The Top-K score bins of ray-mode entries: a bin is a function of an entry's merged weight
    ``w`` (and, for ``classes``, its ``dist2``) that never decreases along the Top-K order (larger
    weight, then smaller ``dist2``), so an entry in a later bin than K others is beaten by them.

    * ``linear`` (bilinear splats; nearest with a per-pixel prior): ``bin = clip(trunc(a - w b), 0, n - 1)``
      with ``b = LINEAR_BINS / w_ref``, ``a = n (1 - 2^-20)``, ``n = LINEAR_BINS + TOP_BINS``: linear in ``w`` over
      ``(0, w_ref]`` (``w_ref`` the prior's largest weight, a point's largest splat weight), then
      ``TOP_BINS`` for merged entries up to ``(1 + TOP_BINS / LINEAR_BINS) w_ref``; weight 0 in the
      last bin.
    * ``classes`` (nearest, a prior with at most ``MAX_TIE_VALUES`` distinct positive single-bin
      weights ``t_0 > t_1 > ...``, e.g. uniform): a nearest entry of one depth bin weighs exactly
      one ``t_i``, so whole rows tie on weight and only ``dist2`` orders them. Weight classes: ``0``
      above ``t_0`` (merged runs; ``TOP_BINS`` bins by ``w / t_0``), ``2i + 1`` exactly ``t_i``
      (``dist2_bins()`` bins by ``dist2``: eighth-octaves of ``dist2 / h2`` from ``2^-10`` to 1, ``h2``
      the squared half-diagonal of a cell, one bin below and one above), ``2i + 2`` strictly between
      ``t_(i+1)`` and ``t_i`` (below ``t_(m-1)`` for the last; one bin each).
    * ``ranked`` (nearest, a ``(D,)`` or ``(n_cam, D)`` prior of more than ``MAX_TIE_VALUES``
      distinct values): whole rows still tie on weight, but on a different value per row, so each
      row has its own reference weight ``t_row`` (``ref``, per counting-frame row: the largest
      single-bin weight among the row's entries of the pass-1 sample, :meth:`RayStream.__init__`;
      the prior's largest where the sample has none). The classes of one tie value, relative to it:
      ``TOP_BINS`` bins above ``t_row`` by ``w / t_row``, ``dist2_bins()`` bins of weight exactly
      ``t_row`` by ``dist2``, ``RANKED_LOW_BINS`` below it linear in ``w / t_row``, weight 0 last.
      A wrong reference costs candidates, never an entry: the bins follow the Top-K order in every
      row whatever ``t_row``.
    """

    kind: str
    n_bins: int
    a: float = 0.0
    b: float = 0.0
    ties: tuple[float, ...] = ()
    inv_h2: float = 0.0
    d2_base: int = 0
    ref: F64 | None = field(default=None, compare=False, repr=False)

    @classmethod
    def for_stream(cls, prior: NormalisedPrior, n_cam: int, bilinear: bool, bev: BevBox) -> RayBins:
        if not bilinear and not prior.per_pixel:
            values = np.unique(np.concatenate([prior.table(c) for c in range(n_cam)]))
            ties = values[values > 0.0][::-1]
            h2 = (0.5 * bev.dx) ** 2 + (0.5 * bev.dy) ** 2
            base = int(np.array([2.0**-DIST2_OCTAVES]).view(np.int64)[0] >> (52 - DIST2_STEP_BITS)) - 1
            if 0 < ties.size <= MAX_TIE_VALUES:
                n_bins = TOP_BINS + ties.size * (dist2_bins() + 1)
                return cls("classes", n_bins, ties=tuple(float(t) for t in ties), inv_h2=1.0 / h2, d2_base=base)
            if ties.size:  # the reference weights come later (with_reference)
                n_bins = TOP_BINS + dist2_bins() + RANKED_LOW_BINS + 1
                return cls("ranked", n_bins, ties=(float(ties[0]),), inv_h2=1.0 / h2, d2_base=base)
        w_ref = prior.max_weight()
        n_bins = LINEAR_BINS + TOP_BINS
        return cls("linear", n_bins, a=n_bins * (1.0 - 2.0**-20), b=LINEAR_BINS / w_ref if w_ref > 0 else 0.0)

    def with_reference(self, ref: F64) -> RayBins:
        """``ranked``: these bins with the reference weight of every counting-frame row (``ref``
        ``(n_frame,)`` float64; ``<= 0`` where there is none: the prior's largest weight ``ties[0]``)."""
        return replace(self, ref=np.where(ref > 0.0, ref, self.ties[0]))

    @property
    def class_start(self) -> I64:
        """``classes``: the first bin of each weight class ``0 .. 2m``."""
        q = dist2_bins()
        sizes = [TOP_BINS] + [q if c % 2 else 1 for c in range(1, 2 * len(self.ties) + 1)]
        return np.cumsum([0, *sizes[:-1]]).astype(np.int64)

    def of(self, weight: F64, dist2: F64 | None = None, frame: I64 | None = None) -> I64:
        """The bins of entries of merged weight ``weight`` (``dist2`` their tie-break distance:
        needed by ``classes`` and ``ranked``; ``frame`` their counting-frame rows: needed by
        ``ranked``). Any shape."""
        if self.kind == "ranked":
            assert dist2 is not None and frame is not None and self.ref is not None
            t_row = self.ref[frame]
            ratio = weight / t_row
            out = self._dist2_sub(dist2)
            out += TOP_BINS
            above = weight > t_row
            if above.any():  # by w / t: (1, 2) the last of the TOP_BINS, 2 or more earlier
                out[above] = TOP_BINS - np.clip(ratio[above].astype(np.int64), 1, TOP_BINS)
            below = weight < t_row
            if below.any():  # linear in 1 - w / t
                low = ((1.0 - ratio[below]) * RANKED_LOW_BINS).astype(np.int64)
                out[below] = TOP_BINS + dist2_bins() + np.clip(low, 0, RANKED_LOW_BINS - 1)
            out[weight <= 0.0] = self.n_bins - 1
            return out
        if self.kind == "linear":  # a < n_bins and w >= 0: only weights above a / b need a bound (at 0)
            x = weight * -self.b
            x += self.a
            np.maximum(x, 0.0, out=x)
            return x.astype(np.int64)
        assert dist2 is not None
        sub = self._dist2_sub(dist2)
        if len(self.ties) == 1 and bool(np.all(weight == self.ties[0])):  # every entry one depth bin (uniform)
            sub += TOP_BINS
            return sub
        cls_ = np.zeros(weight.shape, dtype=np.int64)
        for t in self.ties:
            cls_ += weight <= t
            cls_ += weight < t
        out = self.class_start[cls_]
        exact = (cls_ & 1) == 1
        out[exact] += sub[exact]
        top = cls_ == 0
        if top.any():  # merged runs above t_0: by w / t_0
            above = TOP_BINS - (weight[top] * (1.0 / self.ties[0])).astype(np.int64)
            out[top] += np.clip(above, 0, TOP_BINS - 1)
        return out

    def _dist2_sub(self, dist2: F64) -> I64:
        """Sub-bin of ``dist2 / h2``: the exponent and first ``DIST2_STEP_BITS`` mantissa bits of the
        float64 (monotone in the value), ``0`` below ``2^-DIST2_OCTAVES``, the last from 1 on."""
        x = dist2 * self.inv_h2
        out = x.view(np.int64) >> (52 - DIST2_STEP_BITS)
        out -= self.d2_base
        np.clip(out, 0, dist2_bins() - 1, out=out)
        return out

    def dist2_cut(self, threshold: I64) -> F64:
        """``classes`` with one tie value ``t_0``: per row, a ``dist2`` below which an entry of weight
        exactly ``t_0`` (class 1) may pass ``threshold[row]`` and at or above which it cannot
        (plus a margin): ``inf`` past class 1, ``-1`` before it; in class 1 the upper edge of the
        threshold's sub-bin (:meth:`_dist2_sub`: ``sub <= s`` iff the float64 bits of ``dist2 / h2``
        are below ``(s + base + 1) << (52 - DIST2_STEP_BITS)``)."""
        start = int(self.class_start[1])
        q = dist2_bins()
        sub = threshold - start
        shift = 52 - DIST2_STEP_BITS
        edge = ((np.clip(sub, 0, q - 2) + self.d2_base + 1) << shift).view(np.float64) / self.inv_h2 * (1.0 + PREFILTER_MARGIN)
        return np.where(sub >= q - 1, np.inf, np.where(sub < 0, -1.0, edge))

    def lowest_weight(self, threshold: I64) -> F64:
        """Per row, a weight below which no entry's bin can be ``<= threshold[row]`` (less a
        margin; 0 where the threshold keeps everything): ``linear``, ``trunc(a - w b) <= t`` needs
        ``w > (a - t - 1) / b``; ``classes``, a bin of class ``2i + 1`` needs ``w >= t_i``, of class
        ``2i`` ``w > t_i`` (``t_m = 0``)."""
        if self.kind == "ranked":  # relative to the row's reference weight (RayStream multiplies)
            return self.ranked_floor(threshold)
        if self.kind == "linear":
            if self.b <= 0.0:
                return np.zeros(threshold.size)
            low = (self.a - threshold - 1.0) / self.b * (1.0 - PREFILTER_MARGIN)
            low[threshold >= self.n_bins - 1] = 0.0
            return np.maximum(low, 0.0)
        cls_ = np.searchsorted(self.class_start, threshold, side="right") - 1
        ties = np.array((*self.ties, 0.0))
        low = ties[np.minimum(cls_ // 2, len(self.ties))] * (1.0 - PREFILTER_MARGIN)
        low[threshold >= self.n_bins - 1] = 0.0
        return np.asarray(low, dtype=np.float64)

    def ranked_floor(self, threshold: I64) -> F64:
        """``ranked``: per threshold bin, the least ``w / t_row`` of an entry that may pass it (less a
        margin; 0 where it keeps everything): a bin above ``t_row`` of index ``b`` needs
        ``w / t_row >= TOP_BINS - b`` (``> 1`` for the last), one of weight ``t_row`` ``w >= t_row``,
        a low bin ``j`` ``w / t_row > 1 - (j + 1) / RANKED_LOW_BINS``."""
        q = dist2_bins()
        thr = threshold.astype(np.float64)
        above = TOP_BINS - thr
        low = 1.0 - (thr - TOP_BINS - q + 1.0) / RANKED_LOW_BINS
        floor = np.where(thr < TOP_BINS, above, np.where(thr < TOP_BINS + q, 1.0, low))
        floor = np.maximum(floor, 0.0) * (1.0 - PREFILTER_MARGIN)
        floor[threshold >= self.n_bins - 1] = 0.0
        return floor


def dist2_bins() -> int:
    """Distance sub-bins of an exact weight class: ``2^DIST2_STEP_BITS`` per octave over ``DIST2_OCTAVES``
    octaves, one below, one above."""
    return (DIST2_OCTAVES << DIST2_STEP_BITS) + 2


# --------------------------------------------------------------------------------------
# the stream
# --------------------------------------------------------------------------------------


@dataclass
class _Points:
    """A block's (or its sample's) points in range, ray-major, depth bins increasing per ray.

    Convention: ``starts`` ``(n_rays + 1,)`` int64 non-decreasing, local ray ``j``'s points are
    ``[starts[j], starts[j + 1])`` (``starts[-1] = n``; local ray ``j`` is plan position
    ``r0 + j * stride``, ``r0`` the block's first plan position that is a multiple of ``stride``;
    :meth:`ray_of`); ``fx, fy`` ``(n,)`` float64 cell coordinates (consumed by
    :meth:`RayStream._merged`); ``prior`` ``(n,)`` float64 ``p`` of each point, or a float (every
    point's, e.g. uniform); ``n_in`` the points in range (before dropping ``p = 0``)."""

    starts: I64
    fx: F64
    fy: F64
    prior: F64 | float
    n_in: int

    def ray_of(self, point: I64) -> I64:
        """The local rays of points ``point`` (int64 indices): a gather from every point's ray
        (faster than a binary search of ``starts`` for a block's candidates)."""
        counts = self.starts[1:] - self.starts[:-1]
        return np.repeat(np.arange(counts.size, dtype=np.int32), counts)[point].astype(np.int64)


@dataclass
class _Merged:
    """A block's splat entries, merged over depth bins.

    Convention: ``weight`` ``(n_corners, n)`` float64 corner-major (entry ``(c, i)``: corner ``c`` of
    point ``i``), the merged weight at each group's first entry, 0 at the others; ``child``,
    ``root`` int64 flat corner-major indices of the merged entries and of their group's first;
    ``contrib`` ``(child.size,)`` the children's own weights (before the merge); ``root_own`` the
    roots' own weights; bilinear: ``ix, iy`` ``(n,)`` float64 base cell, ``gx, gy`` ``(n,)`` float64 ``f - 0.5`` (nearest: None);
    ``base`` ``(n,)`` int64 counting-frame index of the base cell; ``dist2`` ``(n,)`` (nearest:
    the point's, merged to its group's minimum at the root)."""

    weight: F64
    child: I64
    root: I64
    contrib: F64
    root_own: F64
    ix: F64 | None
    iy: F64 | None
    gx: F64 | None
    gy: F64 | None
    base: I64
    dist2: F64 | None


class RayStream:
    """The ``mode="ray"`` entries (module docstring). Counting frame: bilinear, the BEV grid padded
    by two cells below and one above on each axis (as frustum mode: the four corners of a point need
    no bounds test, padding rows keep nothing); nearest, the BEV cells. Score bins: :class:`RayBins`."""

    def __init__(self, rig: RigConfig, *, splat: str, rounding: str, k: int, prior: NormalisedPrior, jobs: int = 1) -> None:
        self.rig = rig
        self.bev = bev = BevBox.of(rig)
        self.trunc = rounding == "trunc"
        self.bilinear = splat == "bilinear"
        self.k = k
        self.prior = prior
        self.n_cells = bev.n_cells
        self.depths = np.asarray(rig.depth.values(), dtype=np.float64)
        w_f, h_f = rig.feature_size
        self.plane = w_f * h_f
        self.bins = RayBins.for_stream(prior, rig.n_cam, self.bilinear, bev)
        self.n_bins = self.bins.n_bins
        self.stride = PASS1_STRIDE if k > 0 else 1
        self.collect_folds = k > 0  # pass 2 sums the row masses and counts the points in range
        self.frame = PaddedFrame(bev.nx, bev.ny)
        self.n_frame = self.frame.size if self.bilinear else self.n_cells
        self.offsets = np.array(self.frame.offsets if self.bilinear else (0,), dtype=np.int64)
        self.in_range = 0
        self.n_valid = 0
        self._mass = np.zeros(self.n_frame)
        self._thr: I64 = np.zeros(0, np.int64)
        self._wlow: F64 = np.zeros(0)
        self._d2cut: F64 | None = None
        self._running: I64 = np.zeros(0, dtype=np.int64)
        self._below: I64 = np.zeros(0, np.int64)
        self._pending: list[tuple[Entries, I64, I64, npt.NDArray[np.bool_]]] = []
        self._n_folded = 0
        self._hist: Histogram | None = None  # pass 1 (K > 0): the histogram fold counts into
        self._low_of_bin: F64 = np.zeros(0)
        self._cut_of_bin: F64 = np.zeros(0)
        self._tables = None if prior.per_pixel else [prior.table(c) for c in range(rig.n_cam)]
        # a camera whose prior is one positive value at every depth bin (uniform): that value
        self._constant = [float(t[0]) if bool(np.all(t == t[0])) and t[0] > 0.0 else None for t in self._tables or []]

        def plan(cam: int) -> tuple[CameraPlan, tuple[npt.NDArray[np.int32], npt.NDArray[np.int32]]]:
            p = plan_camera(bev, self.trunc, cam, camera_rays(rig, cam), self.depths)
            return p, ray_intervals(p, bev, self.trunc, self.depths)

        plans: list[CameraPlan] = []
        self._intervals: dict[int, tuple[npt.NDArray[np.int32], npt.NDArray[np.int32]]] = {}
        for p, (first, end) in ordered_map(plan, range(rig.n_cam), plan_jobs(rig, jobs)):
            plans.append(own_plan(p) if jobs > 1 else p)  # copies made by this thread (see own_plan)
            self._intervals[p.cam_index] = (first.copy(), end.copy()) if jobs > 1 else (first, end)
        release_free_memory()
        self.n_valid = sum(p.pixel_index.size for p in plans) * rig.depth.n_bins
        self._blocks = plan_ray_blocks(plans, self.plane)
        if self.bins.kind == "ranked" and k > 0:
            self.bins = self.bins.with_reference(self._reference_weights(jobs))
        # fewer than 2^31 entries in all (4 per point at most): no histogram counter can overflow int32
        self.hist_dtype = np.int32 if 4 * self.n_valid < np.iinfo(np.int32).max else np.int64

    def blocks(self) -> list[RayBlock]:
        return self._blocks

    def _reference_weights(self, jobs: int) -> F64:
        """``ranked`` bins (nearest): per BEV cell, the largest single-bin weight (prior value) of
        the pass-1 sample's points in it, 0 where none (:class:`RayBins`). A maximum: the same for
        every ``--jobs``; the sample is pass 1's, so this costs about one more pass 1."""
        ref = np.zeros(self.n_cells)

        def cells(block: RayBlock) -> tuple[I64, F64]:
            pts = self._points(block, self.stride)
            cell, _d2 = nearest_split(self.bev, self.trunc, pts.fx, pts.fy, in_place=True)
            prior = pts.prior if isinstance(pts.prior, np.ndarray) else np.full(cell.size, pts.prior)
            return cell, prior

        for cell, prior in ordered_map(cells, self.count_blocks(), jobs):
            np.maximum.at(ref, cell, prior)
        return ref

    def count_blocks(self) -> list[RayBlock]:
        """Pass 1's work items: runs of ``PASS1_STRIDE // n_corners`` consecutive blocks of a camera
        (nearest: 3, whose sampled rays give about one block's entries, so that pass 1's numpy
        calls are as large as pass 2's; bilinear, 4 entries a point, and K = 0: the blocks)."""
        group = max(1, self.stride // self.offsets.size)  # a sample's entries per block: about CHUNK_POINTS * n_corners / stride
        if group == 1:
            return self._blocks
        out: list[RayBlock] = []
        size = 0  # blocks in out[-1]
        for block in self._blocks:
            if out and out[-1][0] is block[0] and size < group:
                plan, r0, _r1, d_end, units = out[-1]
                out[-1] = (plan, r0, block[2], max(d_end, block[3]), units + block[4])
                size += 1
            else:
                out.append(block)
                size = 1
        return out

    def work_units(self, block: RayBlock) -> int:
        return block[4]

    # ---- geometry shared by both passes ------------------------------------------------

    def _points(self, block: RayBlock, stride: int) -> _Points:
        """The points in range of the rays of ``block`` at plan positions that are multiples of
        ``stride`` (all of them for 1) with a positive prior, ray by ray (each ray's run of depth
        bins in range, :func:`ray_intervals`), with the coordinates of
        :func:`bevcompile.matrix.entries.block_coordinates` (the same float64 operations).

        Computed on the rays' ``(ray, depth bin)`` rectangle over the union of their runs (a plan
        block's runs nearly fill it: 98 % on the dense rig), then the points in range picked out."""
        plan, r0, r1, _d_end, _units = block
        r0 += -r0 % stride  # the plan rays at positions that are multiples of stride: the same sample whatever the block bounds
        first, end = (a[r0:r1:stride] for a in self._intervals[plan.cam_index])
        count = end.astype(np.int64)
        count -= first
        np.maximum(count, 0, out=count)  # points in range per ray
        starts = np.zeros(count.size + 1, dtype=np.int64)
        np.cumsum(count, out=starts[1:])
        if not starts[-1]:
            return _Points(starts, np.zeros(0), np.zeros(0), 0.0, 0)
        has_run = count > 0
        d_lo = int(first[has_run].min())
        width = int(end.max()) - d_lo
        depth = self.depths[None, d_lo : d_lo + width]
        fx, fy = (cell_coordinate(self.bev, plan, axis, depth, plan.ray_bev[axis, r0:r1:stride, None]).reshape(-1) for axis in (0, 1))
        del depth
        inside: npt.NDArray[np.bool_] | None = None  # every point of the rectangle
        if not (bool(np.all(first == d_lo)) and bool(np.all(end == d_lo + width))):
            j = np.arange(d_lo, d_lo + width, dtype=np.int32)
            inside = j[None, :] >= first[:, None]
            inside &= j[None, :] < end[:, None]
            inside = inside.reshape(-1)
            fx = fx[inside]
            fy = fy[inside]
        n_in = int(fx.size)
        prior: F64
        constant = self._constant[plan.cam_index] if self._tables is not None else None
        if constant is not None:
            return _Points(starts, fx, fy, constant, n_in)
        q = np.arange(n_in, dtype=np.int64) if inside is None else np.flatnonzero(inside)  # flat positions in the rectangle
        ray = q // width
        depth_bin = q - ray * width
        depth_bin += d_lo
        del q
        if self._tables is not None:
            prior = self._tables[plan.cam_index][depth_bin]
        else:
            prior = self.prior.weights(plan.cam_index, depth_bin, plan.pixel_index[r0 + ray * stride].astype(np.int64))
        del depth_bin
        live = prior > 0.0
        if not live.all():
            fx, fy, prior = fx[live], fy[live], prior[live]
            np.cumsum(np.bincount(ray[live], minlength=count.size), out=starts[1:])
        return _Points(starts, fx, fy, prior, n_in)

    def _merged(self, pts: _Points) -> _Merged:
        """The points' splat entries merged over depth bins (:func:`merge_ray_runs`): each group's
        weights added in increasing depth bin at its first entry (:func:`~bevcompile.matrix.scatter.scatter_add`,
        ``np.add.at``'s sum, in entry order).
        Consumes ``pts.fx, pts.fy``: the corner fractions and distances are computed in place in
        them (no temporaries of their size)."""
        n = pts.fx.size
        dist2: F64 | None = None
        gx: F64 | None = None
        gy: F64 | None = None
        ix0: F64 | None = None
        iy0: F64 | None = None
        if self.bilinear:
            gx, gy, ix0, iy0, ax, ay = bilinear_split(pts.fx, pts.fy, in_place=True)  # consumes the coordinates
            bx = 1.0 - ax
            by = 1.0 - ay
            weight = np.empty((4, n))
            for c, (ox, oy) in enumerate(_CORNERS):
                np.multiply(ax if ox else bx, ay if oy else by, out=weight[c])
            weight *= pts.prior  # every corner times its point's prior (a float or (n,): broadcast), one call
            del ax, ay, bx, by
            base = self.frame.of_corner(ix0, iy0)
            child, root = merge_ray_runs(pts.starts, base, self.frame.width, 2)
            child = (child & 3) * n + (child >> 2)  # point-major entry e = i * 4 + c -> corner-major c * n + i (order kept)
            root = (root & 3) * n + (root >> 2)
        else:
            base, d2 = nearest_split(self.bev, self.trunc, pts.fx, pts.fy, in_place=True)  # consumes the coordinates
            weight = np.empty((1, n))
            weight[0] = pts.prior
            child, root = merge_ray_runs(pts.starts, base, self.bev.nx, 1)  # a group: a run of equal cells along a ray
            if child.size:
                np.minimum.at(d2, root, d2[child])
            dist2 = d2
        flat = weight.reshape(-1)
        contrib = flat[child]
        root_own = flat[root]
        if child.size:
            scatter_add(flat, root, contrib)  # in increasing depth bin: the sum of the module docstring
            flat[child] = 0.0
        return _Merged(weight, child, root, contrib, root_own, ix0, iy0, gx, gy, base, dist2)

    def _dist2(self, m: _Merged, point: I64, ox: int | I64, oy: int | I64) -> F64:
        """The frustum ``dist2`` of corner ``(ox, oy)`` (one for all, or one per point) of points ``point``."""
        assert m.gx is not None and m.gy is not None and m.ix is not None and m.iy is not None  # bilinear
        return corner_dist2(self.bev, m.gx[point], m.gy[point], m.ix[point] + ox, m.iy[point] + oy)

    # ---- pass 1 -----------------------------------------------------------------------

    def count(self, block: RayBlock, hist: Histogram, n_bins: int, k: int) -> tuple[int, I64, F64, I64]:
        """Pass 1 of one block: K > 0, the histogram keys of every entry of the rays at plan
        positions that are multiples of ``stride`` (entries of weight 0 in the last bin: it keeps
        everything, so a count there changes no threshold), counted by :meth:`fold` in the calling
        thread (no worker waits for the histogram's lock; counting them in the workers measured the
        same); K = 0, every entry of weight > 0 counted at its frame row."""
        pts = self._points(block, self.stride)
        m = self._merged(pts)
        if k > 0:  # key (base + offset[c]) * n_bins + bin: the bins, plus the base's key, plus the corner's
            ranked = self.bins.kind == "ranked"  # (nearest) its bins read the frame row
            keys = self.bins.of(m.weight, None if m.dist2 is None else m.dist2[None, :], m.base[None, :] if ranked else None)
            keys += m.base * n_bins
            if self.offsets.size > 1:
                keys += (self.offsets * n_bins)[:, None]
            self._hist = hist
            return 0, np.zeros(0, np.int64), np.zeros(0), keys.reshape(-1)
        frame = m.base[None, :] + self.offsets[:, None]
        hist.add_scattered(frame[m.weight > 0.0])
        return pts.n_in, np.zeros(0, np.int64), np.zeros(0), np.zeros(0, np.int64)

    def fold(self, partial: tuple[int, I64, F64, I64]) -> None:
        """Add one block's points in range (pass 1 with K = 0, pass 2 with K > 0), its row masses
        (pass 2: ``rows`` frame rows and their ``sums``, or ``rows`` empty and ``sums`` the whole
        frame) and its histogram keys (pass 1, K > 0: :meth:`count`), in block order."""
        n_in, rows, sums, keys = partial
        self.in_range += n_in
        if keys.size:
            assert self._hist is not None
            self._hist.add_scattered(keys)
        if rows.size:
            scatter_add(self._mass, rows, sums)  # rows repeat across corners
        elif sums.size:
            self._mass += sums

    def adopt_histogram(self, counts: I64) -> None:
        """Before pass 2 (K > 0): pass 1's ``(n_frame, n_bins)`` counts, kept as the running
        histogram of :meth:`fold_collected` (the sampled rays' entries are in it already)."""
        self._running = counts.reshape(-1)
        self._hist = None

    def fold_collected(self, entries: Entries, partial: tuple[int, I64, F64, tuple[I64, I64, npt.NDArray[np.bool_]]]) -> Entries:
        """Pass 2 (K > 0), in block order in the calling thread: :meth:`fold` the block's partial,
        then admit its candidates against the running thresholds.

        Pass 1 counted the entries of a sample of the rays; pass 2 keeps counting, in the same
        histogram, the candidates of the other rays it admits, and a row's running threshold is
        the bin of its K-th best counted entry (real, distinct entries: any entry in a later bin
        is beaten by K of them). A candidate is admitted if its bin is ``<=`` its row's running
        threshold after the candidates of its batch (``ADMIT_BLOCKS`` consecutive blocks, fixed by
        the block list) are counted. Thresholds only tighten, so the workers may pre-filter with
        whatever value they read (never tighter than the one the batch is admitted with): the
        admitted set, and so the candidate count, is the same for every ``--jobs``."""
        n_in, rows, sums, (frame, bins, sampled) = partial
        self.fold((n_in, rows, sums, np.zeros(0, np.int64)))
        if len(entries):
            self._pending.append((entries, frame, bins, sampled))
        self._n_folded += 1
        if self._n_folded % ADMIT_BLOCKS and self._n_folded < len(self._blocks):
            return Entries.empty()
        if not self._pending:
            return Entries.empty()
        pending, self._pending = self._pending, []
        frame, bins, sampled = (np.concatenate([p[i] for p in pending]) for i in (1, 2, 3))
        n_bins, k = self.n_bins, self.k
        thr = self._thr[frame]
        new = bins <= thr  # counted: the candidates still admitted, not of a sampled ray (counted in pass 1)
        new &= ~sampled
        scatter_add(self._running, frame[new] * n_bins + bins[new])
        new &= bins < thr
        lower = frame[new]
        scatter_add(self._below, lower)  # per frame row: counted entries in bins before its threshold
        full = lower[self._below[lower] >= k]
        if full.size:  # rows with K counted entries before the threshold: it moves to the bin of the K-th
            mark = np.zeros(self.n_frame, dtype=bool)
            mark[full] = True
            full = np.flatnonzero(mark)  # distinct, increasing (np.unique without the sort)
            del mark
            table = self._running.reshape(self.n_frame, n_bins)
            new_thr = thresholds(table[full], k, n_bins)  # each has K counted entries: the bin of the K-th
            self._below[full] = counts_before(table, full, new_thr)
            self._tighten(full, new_thr)
            thr = self._thr[frame]
        keep = np.flatnonzero(bins <= thr)
        # one copy, made by this thread (the candidate buffer keeps it without copying again)
        return Entries(*(np.concatenate([getattr(p[0], name) for p in pending])[keep] for name in ("row", "col", "weight", "dist2")))

    def refine_candidates(self, entries: Entries) -> Entries:
        """After pass 2 (K > 0): the candidates whose bin is ``<=`` their row's final running
        threshold (:meth:`fold_collected`; the others are beaten by K counted entries)."""
        if not len(entries):
            return entries
        frame = self.frame.of_cell(entries.row) if self.bilinear else entries.row
        keep = self.bins.of(entries.weight, entries.dist2, frame) <= self._thr[frame]
        return entries if keep.all() else entries.take(keep)

    def _tighten(self, frame: I64, threshold: I64) -> None:
        """Set the thresholds of frame rows ``frame`` (tighter than before) and the bounds derived
        from them; the workers read these tables while this runs: every value they can see is
        valid for the block they filter (each table only tightens)."""
        self._thr[frame] = threshold
        self._wlow[frame] = self._weight_floor(threshold, frame)  # one write of the final value: the workers read this table
        if self._d2cut is not None:
            self._d2cut[frame] = self._cut_of_bin[threshold]

    def _weight_floor(self, threshold: I64, frame: I64 | npt.NDArray[np.bool_]) -> F64:
        """The least weight an entry of frame rows ``frame`` (indices or a mask) may have to pass
        their thresholds ``threshold``: :meth:`RayBins.lowest_weight`, per bin, times the rows'
        reference weights for ``ranked`` bins (whose floors are relative to them)."""
        low = self._low_of_bin[threshold]
        if self.bins.ref is not None:
            low *= self.bins.ref[frame]
        return low

    def cells_of_frame(self, per_frame: npt.NDArray[Any]) -> npt.NDArray[Any]:
        return self.frame.cells(per_frame) if self.bilinear else per_frame

    def total_mass(self, hist_cells: I64) -> F64:
        """``(n_cells,)`` raw weight of each row (K > 0: after pass 2, which sums it)."""
        return np.asarray(self.cells_of_frame(self._mass), dtype=np.float64).ravel()

    # ---- pass 2 -----------------------------------------------------------------------

    def begin_collect(self, threshold: I64, n_bins: int, k: int) -> None:
        """The per-frame thresholds (padding rows: -1, nothing passes), the least weight that can
        pass each (:meth:`RayBins.lowest_weight`, read at each corner's row ``base + offset``),
        the dist2 cut of one tie value (:meth:`RayBins.dist2_cut`), and the running histogram."""
        self._thr = self.frame.spread(threshold, -1) if self.bilinear else threshold
        if k > 0:
            self._thr = self._thr.copy()  # tightened in place by fold_collected
            every_bin = np.arange(self.n_bins, dtype=np.int64)
            self._low_of_bin = self.bins.lowest_weight(every_bin)
            inside = self._thr >= 0
            self._wlow = np.full(self._thr.size, np.inf)  # padding rows: nothing passes
            self._wlow[inside] = self._weight_floor(self._thr[inside], inside)
            if self.bins.kind == "classes" and len(self.bins.ties) == 1:
                self._cut_of_bin = self.bins.dist2_cut(every_bin)
                self._d2cut = self._cut_of_bin[np.maximum(self._thr, 0)]
            # the running histogram of fold_collected (pass 1's counts, adopted) and, per frame row,
            # its counted entries in bins before the threshold
            if self._running.size != self.n_frame * n_bins:
                self._running = np.zeros(self.n_frame * n_bins, dtype=self.hist_dtype)
            table = self._running.reshape(self.n_frame, n_bins)
            self._below = np.zeros(self.n_frame, dtype=np.int64)
            rows = np.flatnonzero(self._thr > 0)
            if rows.size:
                self._below[rows] = counts_before(table, rows, self._thr[rows])

    def collect(self, block: RayBlock) -> tuple[Entries, int, tuple[int, I64, F64, tuple[I64, I64, npt.NDArray[np.bool_]]]] | tuple[Entries, int]:
        """K > 0: the block's entries whose bin is ``<= threshold[row]`` (the tables as this thread
        reads them: only ever tighter than pass 1's), its points in range and the partial of
        :meth:`fold_collected` (row masses; the entries' frame rows, bins, and whether pass 1
        counted their ray). K = 0: every entry of weight > 0, by row then plan ray (the row masses
        are summed in that order by the caller).

        Every corner at once: entry ``e = c * n + i`` (corner ``c`` of point ``i``, corner-major,
        as ``_Merged.weight``), so the entries come corner after corner, each in point order."""
        plan, r0, r1, _d_end, _units = block
        pts = self._points(block, 1)
        m = self._merged(pts)
        n = pts.fx.size
        flat_w = m.weight.reshape(-1)
        if self.k > 0:
            one_weight = (  # nearest, one tie value, every entry of the block one depth bin of that weight
                m.dist2 is not None and self._d2cut is not None and m.child.size == 0
                and bool(np.all(pts.prior == self.bins.ties[0]))
            )
            if one_weight:
                assert m.dist2 is not None and self._d2cut is not None
                hit = np.flatnonzero(m.dist2 < self._d2cut[m.base])  # every entry weighs t_0: class 1, by dist2
                frame = m.base[hit]
            else:  # a float bound of the row's threshold first, corner by corner (corner c's row: base + offset[c])
                passing = np.empty(m.weight.shape, dtype=bool)
                low = np.empty(n)
                for c, off in enumerate(self.offsets):
                    np.take(self._wlow[off:], m.base, out=low, mode="clip")  # wlow[base + off]: every corner is a frame row
                    np.greater_equal(m.weight[c], low, out=passing[c])
                del low
                hit = np.flatnonzero(passing)  # corner-major, as the weights
                del passing
                corner, at = np.divmod(hit, max(1, n))
                frame = m.base[at]
                frame += self.offsets[corner]
                del corner, at
            wh = flat_w[hit]
            bins = self.bins.of(wh, None if m.dist2 is None else m.dist2[hit], frame)  # nearest: one corner, hit is the point
            exact = bins <= self._thr[frame]
            exact &= wh > 0.0
            hit, frame, bins = hit[exact], frame[exact], bins[exact]
        else:
            hit = np.flatnonzero(flat_w > 0.0)
        ox: I64 | int = 0
        oy: I64 | int = 0
        point = hit
        if self.bilinear:
            assert m.ix is not None and m.iy is not None
            corner, point = np.divmod(hit, max(1, n))
            cx, cy = corner & 1, corner >> 1
            del corner
            ixh = m.ix[point] + cx
            iyh = m.iy[point] + cy
            if self.k == 0:  # corners outside the grid are not entries (K > 0: padding rows pass nothing)
                ok = (ixh >= 0) & (ixh < self.bev.nx) & (iyh >= 0) & (iyh < self.bev.ny)
                if not ok.all():
                    hit, point, cx, cy, ixh, iyh = hit[ok], point[ok], cx[ok], cy[ok], ixh[ok], iyh[ok]
            ox, oy = cx, cy
            iyh *= self.bev.nx
            iyh += ixh
            row = iyh.astype(np.int64)
        else:
            row = m.base[point]  # the cell index
        ray_h = pts.ray_of(point)
        col = plan.cam_index * self.plane + plan.pixel_index[r0 + ray_h].astype(np.int64)
        dist2 = m.dist2[point] if m.dist2 is not None else self._dist2(m, point, ox, oy)
        entries = Entries(row, col, flat_w[hit], dist2)
        if self.bilinear and m.child.size and len(entries):  # a merged entry's dist2: the least of its contributing members'
            is_hit = np.zeros(flat_w.size, dtype=bool)
            is_hit[hit] = True
            found = np.flatnonzero(is_hit[m.root])  # the merged children whose group is an entry
            del is_hit
            if found.size:
                group = np.searchsorted(hit, m.root[found])  # hit: corner-major flat indices, increasing
                own = m.root_own[found] > 0.0
                entries.dist2[group[~own]] = np.inf  # the first member itself added nothing
                child = m.child[found]
                c_corner, c_point = np.divmod(child, n)
                d2 = np.where(m.contrib[found] > 0.0, self._dist2(m, c_point, c_corner & 1, c_corner >> 1), np.inf)
                np.minimum.at(entries.dist2, group, d2)
        if self.k == 0:  # every entry, by row, then plan ray
            order = np.argsort(entries.row * (r1 - r0) + ray_h)
            return entries.take(order), pts.n_in
        rows, sums = self._row_masses(m.base, m.weight)
        return entries, pts.n_in, (pts.n_in, rows, sums, (frame, bins, (ray_h + r0) % self.stride == 0))

    def _row_masses(self, base: I64, weight: F64) -> tuple[I64, F64]:
        """A block's row masses in the counting frame: each corner's weights summed at its row
        (``base + offset``), corner after corner, in point order; over the whole frame when it is
        small against the block (``rows`` empty), else over the rows touched."""
        n = base.size
        if not n:
            return np.zeros(0, np.int64), np.zeros(0)
        if self.n_frame <= 8 * n:
            sums = np.zeros(self.n_frame)
            for off, w in zip(self.offsets, weight, strict=True):
                scatter_add(sums[off:], base, w)
            return np.zeros(0, np.int64), sums
        touched, local = local_rows(base, self.n_frame)
        n_touched = touched.size
        keys = np.concatenate([local + c * n_touched for c in range(self.offsets.size)])  # corner-major, as weight
        touched_sums: F64 = np.bincount(keys, weights=weight.reshape(-1), minlength=n_touched * self.offsets.size).astype(np.float64, copy=False)
        return np.concatenate([touched + off for off in self.offsets]), touched_sums

    def end_collect(self) -> None:
        self._blocks = []
        self._thr = np.zeros(0, np.int64)
        self._wlow = np.zeros(0)
        self._d2cut = None
        self._running = np.zeros(0, dtype=np.int64)
        self._below = np.zeros(0, np.int64)


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
