"""Straightforward references for the sparse aggregation matrix (tests, verify, benchmark).

Written separately from :mod:`bevcompile.matrix.build` and deliberately naive: every point at once,
every entry at once, one full ``lexsort``. Nothing here streams or prunes.

* :func:`reference_matrix` — the straightforward build of the same matrix (frustum or grid
  mode, every option that changes entries): all points of every camera, all entries, a full
  ``lexsort`` by (row, -weight, dist2, col), the first K of each row. The benchmark's
  baseline; the streamed build must equal it exactly.
* :func:`bev_pool` — BEVDet-style voxel pooling of ``depth x feature`` (sum, or mean) with
  points from :func:`bevcompile.rig.geometry.unproject_feature_to_bev` (the geometry module's own
  formula, not the matrix's elementwise one) and ``np.add.at`` scatter; nearest (BEVDet) or
  bilinear splat. ``W @ (depth x feat)`` with K = 0 must equal it up to float rounding.
* :func:`grid_pool` — sum over cameras and heights of ``grid_sample`` (numpy
  :func:`bevcompile.grid.reference.grid_sample`) at the float64 sampling grid.

Conventions are those of :mod:`bevcompile.matrix.build` (module docstring).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from ..grid.ipm import compute_sampling_grid, feature_px_to_norm
from ..grid.reference import grid_sample
from ..rig.config import RigConfig
from ..rig.geometry import bev_from_cam_matrix, feature_px_to_image_px, unproject_feature_to_bev, unproject_image_to_cam
from .lift16 import bevdepth_points_float16
from .lift32 import bevdet_points_float32, scaled_float32

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]


def _feature_pixel_centres(rig: RigConfig) -> F64:
    """``(H_f, W_f, 2)`` float64 ``(u, v)`` of every feature-pixel centre."""
    w_f, h_f = rig.feature_size
    uv = np.zeros((h_f, w_f, 2))
    uv[..., 0] = np.arange(w_f)[None, :]
    uv[..., 1] = np.arange(h_f)[:, None]
    return uv


def frustum_points_bev(rig: RigConfig, cam_index: int) -> tuple[F64, npt.NDArray[np.bool_]]:
    """Every frustum point of one camera, by the matrix's canonical formula.

    Convention:
        returns ``points_bev`` ``(D, H_f, W_f, 3)`` float64 metres (BEV frame) and ``ok``
        ``(H_f, W_f)`` bool (the pixel has a lens preimage). Point ``[d, v, u]`` is
        ``t + bins[d] * (R[:, 0] x_n + R[:, 1] y_n + R[:, 2])`` with ``(x_n, y_n, 1)`` the
        undistorted ray of feature pixel ``(u, v)``.
    """
    ray_bev, ok, translation = _rays_bev(rig, cam_index, _feature_pixel_centres(rig))
    depths = np.asarray(rig.depth.values(), dtype=np.float64)
    points = translation + depths[:, None, None, None] * ray_bev[None]
    return points, ok


def _rays_bev(rig: RigConfig, cam_index: int, uv_feature: F64) -> tuple[F64, npt.NDArray[np.bool_], F64]:
    """``(ray_bev (..., 3), ok (...), camera centre (3,))`` of feature pixels ``uv_feature``
    ``(..., 2)``: the canonical formula of :func:`frustum_points_bev`, elementwise."""
    camera = rig.cameras[cam_index]
    uv_image = feature_px_to_image_px(rig, camera, uv_feature)
    ray_cam, ok = unproject_image_to_cam(camera, uv_image, 1.0)
    matrix = bev_from_cam_matrix(rig, camera)
    rotation, translation = matrix[:3, :3], matrix[:3, 3]
    ray_bev = rotation[:, 0] * ray_cam[..., 0:1] + rotation[:, 1] * ray_cam[..., 1:2] + rotation[:, 2]
    return ray_bev, ok, translation


def frustum_points_of(rig: RigConfig, cam_index: int, u: I64, v: I64, depth_bin: I64) -> tuple[F64, npt.NDArray[np.bool_]]:
    """The frustum points of the feature pixels ``(u, v)`` at depth bins ``depth_bin`` of one camera
    (``(n,)`` int arrays), by :func:`frustum_points_bev`'s formula, elementwise (the same bits).

    Convention: returns ``points_bev`` ``(n, 3)`` float64 metres (BEV frame) and ``ok`` ``(n,)``."""
    uv = np.stack([np.asarray(u, dtype=np.float64), np.asarray(v, dtype=np.float64)], axis=-1)
    ray_bev, ok, translation = _rays_bev(rig, cam_index, uv)
    depths = np.asarray(rig.depth.values(), dtype=np.float64)[np.asarray(depth_bin, dtype=np.int64)]
    return translation + depths[:, None] * ray_bev, ok


def frustum_cell_coordinates_of(
    rig: RigConfig, cam_index: int, u: I64, v: I64, depth_bin: I64, precision: str = "float64"
) -> tuple[F64, F64, F64, npt.NDArray[np.bool_]]:
    """:func:`frustum_cell_coordinates` of the feature pixels ``(u, v)`` at depth bins ``depth_bin``
    of one camera only (``(n,)`` int arrays), elementwise: the same bits as the whole camera's.

    Convention: returns ``(f_x, f_y, f_z, ok)`` ``(n,)``, the cell coordinates ``(p - min) / step``
    (float64 values; float32 / float16 lifts as :func:`frustum_cell_coordinates` computes them)."""
    bev = rig.bev
    u, v, depth_bin = (np.asarray(a, dtype=np.int64) for a in (u, v, depth_bin))
    if precision in ("float32", "float16"):
        w_f = rig.feature_size[0]
        pixels, which = np.unique(v * w_f + u, return_inverse=True)
        lift = bevdepth_points_float16 if precision == "float16" else bevdet_points_float32
        lifted = lift(rig, cam_index, pixels=pixels)  # (D, P, 3)
        with np.errstate(invalid="ignore"):
            scaled = scaled_float32(lifted, (bev.x.min, bev.y.min, bev.z.min), (bev.x.step, bev.y.step, bev.z.step))
        picked = scaled[depth_bin, which.ravel()].astype(np.float64)
        return picked[:, 0], picked[:, 1], picked[:, 2], np.ones(u.size, dtype=bool)
    points, ok = frustum_points_of(rig, cam_index, u, v, depth_bin)
    return (points[:, 0] - bev.x.min) / bev.x.step, (points[:, 1] - bev.y.min) / bev.y.step, (points[:, 2] - bev.z.min) / bev.z.step, ok


def splat_corners(rig: RigConfig, points_bev: F64, ok: npt.NDArray[np.bool_], splat: str, rounding: str) -> tuple[I64, F64]:
    """The BEV cells points ``(n, 3)`` splat to and their weights, as
    :func:`reference_frustum_entries` decides them: ``(cells (n, c), weights (n, c))`` with
    ``c`` = 1 (nearest) or 4 (bilinear), cell ``iy * nx + ix`` or -1 (no cell: outside the BEV
    volume, no lens preimage, or weight 0)."""
    bev = rig.bev
    fx = (points_bev[:, 0] - bev.x.min) / bev.x.step
    fy = (points_bev[:, 1] - bev.y.min) / bev.y.step
    fz = (points_bev[:, 2] - bev.z.min) / bev.z.step
    return splat_cell_corners(rig, fx, fy, fz, ok, splat, rounding)


def splat_cell_corners(rig: RigConfig, fx: F64, fy: F64, fz: F64, ok: npt.NDArray[np.bool_], splat: str, rounding: str) -> tuple[I64, F64]:
    """:func:`splat_corners` of points given by their cell coordinates ``(p - min) / step`` ``(n,)``."""
    bev = rig.bev
    with np.errstate(invalid="ignore"):
        inside = ok & _in_range(fx, bev.x.n, rounding) & _in_range(fy, bev.y.n, rounding) & _in_range(fz, bev.z.n, rounding)
    fx, fy = np.where(inside, fx, 0.5), np.where(inside, fy, 0.5)  # parked: masked below
    if splat == "nearest":
        corners = [(_cell_index(fx, rounding), _cell_index(fy, rounding), np.ones(fx.size))]
    else:
        gx, gy = fx - 0.5, fy - 0.5
        ix0, iy0 = np.floor(gx), np.floor(gy)
        ax, ay = gx - ix0, gy - iy0
        corners = [
            (ix0 + ox, iy0 + oy, (ax if ox == 1 else 1.0 - ax) * (ay if oy == 1 else 1.0 - ay)) for ox in (0, 1) for oy in (0, 1)
        ]
    cells = np.full((fx.size, len(corners)), -1, dtype=np.int64)
    weights = np.zeros((fx.size, len(corners)))
    for k, (ix, iy, weight) in enumerate(corners):
        good = inside & (ix >= 0) & (ix < bev.x.n) & (iy >= 0) & (iy < bev.y.n) & (weight > 0)
        cells[good, k] = (iy[good] * bev.x.n + ix[good]).astype(np.int64)
        weights[good, k] = weight[good]
    return cells, weights


@dataclass
class ReferenceEntries:
    """All entries before Top-K: ``row`` (BEV cell), ``col``, raw ``weight``, ``dist2``."""

    row: I64
    col: I64
    weight: F64
    dist2: F64


def _cell_index(f: F64, rounding: str) -> F64:
    return np.floor(f) if rounding == "floor" else np.trunc(f)


def _in_range(f: F64, n: int, rounding: str) -> npt.NDArray[np.bool_]:
    index = _cell_index(f, rounding)
    return (index >= 0) & (index < n)


def frustum_cell_coordinates(rig: RigConfig, cam_index: int, precision: str = "float64") -> tuple[F64, F64, F64, npt.NDArray[np.bool_]]:
    """``(f_x, f_y, f_z, ok)`` ``(D, H_f, W_f)``: the cell coordinates ``(p - min) / step`` of one
    camera's frustum points (float64 values) and whether the pixel has a lens preimage. ``float32``:
    the points of BEVDet's float32 lift and the division in float32 (:mod:`bevcompile.matrix.lift32`);
    ``float16``: those of BEVDepth's float16 ``get_geometry`` (:mod:`bevcompile.matrix.lift16`; NaN
    or inf where float16 overflowed, which every range test drops)."""
    bev = rig.bev
    if precision in ("float32", "float16"):
        lifted = bevdepth_points_float16(rig, cam_index) if precision == "float16" else bevdet_points_float32(rig, cam_index)
        with np.errstate(invalid="ignore"):
            scaled = scaled_float32(lifted, (bev.x.min, bev.y.min, bev.z.min), (bev.x.step, bev.y.step, bev.z.step))
        ok = np.ones(scaled.shape[1:3], dtype=bool)
        return scaled[..., 0].astype(np.float64), scaled[..., 1].astype(np.float64), scaled[..., 2].astype(np.float64), ok
    points, ok2 = frustum_points_bev(rig, cam_index)
    fx = (points[..., 0] - bev.x.min) / bev.x.step
    fy = (points[..., 1] - bev.y.min) / bev.y.step
    fz = (points[..., 2] - bev.z.min) / bev.z.step
    return fx, fy, fz, ok2


def reference_frustum_entries(
    rig: RigConfig, splat: str, rounding: str, rows: npt.NDArray[np.integer[Any]] | None = None, precision: str = "float64"
) -> ReferenceEntries:
    """Every frustum entry (straightforward; ``rows`` keeps only those BEV cells; ``precision``:
    :func:`frustum_cell_coordinates`).

    Convention: returns :class:`ReferenceEntries` (``(n,)`` arrays, camera by camera): ``row``
    BEV cell ``iy * nx + ix``, ``col = ((cam * D + d) * H_f + v) * W_f + u``, raw ``weight``
    (> 0), ``dist2`` metres^2 ``((g_x - i_x) dx)^2 + ((g_y - i_y) dy)^2``.
    """
    bev = rig.bev
    w_f, h_f = rig.feature_size
    n_bins = rig.depth.n_bins
    keep_rows = None
    if rows is not None:
        keep_rows = np.zeros(bev.nx * bev.ny, dtype=bool)
        keep_rows[np.asarray(rows, dtype=np.int64)] = True
    out_row: list[I64] = []
    out_col: list[I64] = []
    out_w: list[F64] = []
    out_d: list[F64] = []
    for cam_index in range(rig.n_cam):
        fx, fy, fz, ok = frustum_cell_coordinates(rig, cam_index, precision)
        with np.errstate(invalid="ignore"):
            inside = (
                ok[None]
                & _in_range(fx, bev.x.n, rounding)
                & _in_range(fy, bev.y.n, rounding)
                & _in_range(fz, bev.z.n, rounding)
            )
        d_idx, v_idx, u_idx = np.nonzero(inside)
        col = ((cam_index * n_bins + d_idx) * h_f + v_idx) * w_f + u_idx
        fx_in, fy_in = fx[inside], fy[inside]
        gx, gy = fx_in - 0.5, fy_in - 0.5
        corners: list[tuple[F64, F64, F64]]
        if splat == "nearest":
            ix = _cell_index(fx_in, rounding)
            iy = _cell_index(fy_in, rounding)
            corners = [(ix, iy, np.ones(ix.size))]
        else:
            ix0, iy0 = np.floor(gx), np.floor(gy)
            ax, ay = gx - ix0, gy - iy0
            corners = []
            for ox in (0, 1):
                for oy in (0, 1):
                    weight = (ax if ox == 1 else 1.0 - ax) * (ay if oy == 1 else 1.0 - ay)
                    corners.append((ix0 + ox, iy0 + oy, weight))
        for ix, iy, weight in corners:
            good = (ix >= 0) & (ix < bev.x.n) & (iy >= 0) & (iy < bev.y.n) & (weight > 0)
            row = (iy * bev.x.n + ix).astype(np.int64)
            if keep_rows is not None:
                good &= keep_rows[np.where(good, row, 0)]
            ex = (gx - ix) * bev.x.step
            ey = (gy - iy) * bev.y.step
            out_row.append(row[good])
            out_col.append(col[good].astype(np.int64))
            out_w.append(weight[good])
            out_d.append((ex * ex + ey * ey)[good])
    return ReferenceEntries(
        np.concatenate(out_row), np.concatenate(out_col), np.concatenate(out_w), np.concatenate(out_d)
    )


def reference_grid_entries(
    rig: RigConfig, splat: str, rows: npt.NDArray[np.integer[Any]] | None = None
) -> ReferenceEntries:
    """Every grid-mode entry: grid_sample weights per (cell, camera, height), summed over the
    heights in height order with a plain dict; distance = min over heights.

    Convention: :class:`ReferenceEntries` sorted by (row, col); ``col = (cam * H_f + v) * W_f + u``;
    ``dist2`` in feature pixels^2 between the pixel centre and the sampling position.
    """
    sampling = compute_sampling_grid(rig)
    w_f, h_f = rig.feature_size
    wanted = None if rows is None else {int(r) for r in np.asarray(rows).ravel()}
    weight_of: dict[tuple[int, int], float] = {}
    dist_of: dict[tuple[int, int], float] = {}
    for cam in range(rig.n_cam):
        for h in range(len(rig.bev.heights)):
            coords = sampling.coords_feature_px[cam, h].reshape(-1, 2)
            valid = sampling.valid[cam, h].ravel()
            for cell in np.flatnonzero(valid):
                if wanted is not None and int(cell) not in wanted:
                    continue
                u, v = float(coords[cell, 0]), float(coords[cell, 1])
                if splat == "nearest":
                    taps = [(float(np.rint(u)), float(np.rint(v)), 1.0)]
                else:
                    u0, v0 = float(np.floor(u)), float(np.floor(v))
                    au, av = u - u0, v - v0
                    taps = [
                        (u0 + ou, v0 + ov, (au if ou else 1.0 - au) * (av if ov else 1.0 - av))
                        for ou in (0, 1)
                        for ov in (0, 1)
                    ]
                for pu, pv, tap_weight in taps:
                    if not (0 <= pu < w_f and 0 <= pv < h_f) or tap_weight <= 0:
                        continue
                    key = (int(cell), (cam * h_f + int(pv)) * w_f + int(pu))
                    weight_of[key] = weight_of.get(key, 0.0) + tap_weight
                    d2 = (pu - u) * (pu - u) + (pv - v) * (pv - v)
                    dist_of[key] = min(dist_of.get(key, np.inf), d2)
    keys = sorted(weight_of)
    row = np.array([k[0] for k in keys], dtype=np.int64)
    col = np.array([k[1] for k in keys], dtype=np.int64)
    weight = np.array([weight_of[k] for k in keys], dtype=np.float64)
    dist2 = np.array([dist_of[k] for k in keys], dtype=np.float64)
    return ReferenceEntries(row, col, weight, dist2)


@dataclass
class ReferenceMatrix:
    """The straightforward matrix: kept entries sorted by (row, col) with float64 values.

    ``row`` are BEV cells (``iy * nx + ix``, never compacted); ``value`` is normalised as
    asked; ``weight`` the raw kept weight; ``total_mass`` the raw weight of every entry of
    each cell before Top-K (``(ny * nx,)``); ``n_entries`` the entries before Top-K.
    """

    row: I64
    col: I64
    value: F64
    weight: F64
    total_mass: F64
    n_entries: int


def reference_ray_entries(
    rig: RigConfig, splat: str, rounding: str, prior: F64, rows: npt.NDArray[np.integer[Any]] | None = None
) -> ReferenceEntries:
    """Every ray-mode entry, straightforwardly: each frustum entry (:func:`reference_frustum_entries`)
    weighted by ``prior[cam, d, v, u]`` (``(n_cam, D, H_f, W_f)``, normalised per pixel), moved to
    column ``(cam * H_f + v) * W_f + u``; the entries of one ``(row, column)`` summed one by one in
    increasing depth bin, ``dist2`` their minimum (only contributions of weight > 0)."""
    w_f, h_f = rig.feature_size
    plane = w_f * h_f
    n_bins = rig.depth.n_bins
    fr = reference_frustum_entries(rig, splat, rounding, rows)
    cam, rest = np.divmod(fr.col, n_bins * plane)
    d, pixel = np.divmod(rest, plane)
    weight = fr.weight * np.asarray(prior, dtype=np.float64).reshape(rig.n_cam, n_bins, plane)[cam, d, pixel]
    good = weight > 0
    col = (cam * plane + pixel)[good]
    row, d, weight, dist2 = fr.row[good], d[good], weight[good], fr.dist2[good]
    order = np.lexsort((d, col, row))
    row, col, weight, dist2 = row[order], col[order], weight[order], dist2[order]
    first = np.r_[True, (row[1:] != row[:-1]) | (col[1:] != col[:-1])]
    group = np.cumsum(first) - 1
    total = np.zeros(int(first.sum()))
    np.add.at(total, group, weight)  # element by element, in increasing d (the stated summation order)
    best = np.full(total.size, np.inf)
    np.minimum.at(best, group, dist2)
    return ReferenceEntries(row[first], col[first], total, best)


def reference_matrix(
    rig: RigConfig, options: Any, rows: npt.NDArray[np.integer[Any]] | None = None, prior: F64 | None = None
) -> ReferenceMatrix:
    """The straightforward build (see module docstring). ``options`` is a
    :class:`bevcompile.matrix.build.MatrixOptions` (mode, splat, rounding, topk, normalize are used);
    ``rows`` restricts the build to those BEV cells (their rows are complete); ray mode needs
    ``prior`` (``(n_cam, D, H_f, W_f)`` float64, normalised per pixel)."""
    entries = _reference_entries(rig, options, rows, prior)
    return _topk_reference(entries.row, entries.col, entries.weight, entries.dist2, options, rig.bev.nx * rig.bev.ny)


def _reference_entries(rig: RigConfig, options: Any, rows: npt.NDArray[np.integer[Any]] | None, prior: F64 | None) -> ReferenceEntries:
    """Every entry of the mode of ``options`` (``rows``: only those BEV cells)."""
    if options.mode == "frustum":
        return reference_frustum_entries(rig, options.splat, options.rounding, rows, options.precision)
    if options.mode == "ray":
        if prior is None:
            raise ValueError("the ray-mode reference needs the normalised depth prior")
        return reference_ray_entries(rig, options.splat, options.rounding, prior, rows)
    return reference_grid_entries(rig, options.splat, rows)


def _topk_reference(row: I64, col: I64, weight: F64, dist2: F64, options: Any, n_rows: int) -> ReferenceMatrix:
    """Every entry ``(row, col, weight, dist2)`` -> the Top-K by one full ``lexsort`` by
    (row, -weight, dist2, col), sorted by (row, col), normalised as ``options`` asks."""
    total_mass = np.bincount(row, weights=weight, minlength=n_rows).astype(np.float64)
    order = np.lexsort((col, dist2, -weight, row))
    keep = order
    if options.topk > 0:
        row_sorted = row[order]
        first_of_row = np.searchsorted(row_sorted, row_sorted, side="left")
        rank = np.arange(order.size) - first_of_row
        keep = order[rank < options.topk]
    kept_row, kept_col, kept_weight = row[keep], col[keep], weight[keep]
    final = np.lexsort((kept_col, kept_row))
    kept_row, kept_col, kept_weight = kept_row[final], kept_col[final], kept_weight[final]
    kept_mass = np.bincount(kept_row, weights=kept_weight, minlength=n_rows)
    value = kept_weight / kept_mass[kept_row] if options.normalize == "mean" else kept_weight.copy()
    return ReferenceMatrix(np.asarray(kept_row, np.int64), np.asarray(kept_col, np.int64), value, kept_weight, total_mass, int(row.size))


def region_reference_matrix(
    rig: RigConfig,
    options: Any,
    row_of_cell: npt.NDArray[np.integer[Any]],
    n_rows: int,
    rows: npt.NDArray[np.integer[Any]] | None = None,
    prior: F64 | None = None,
) -> ReferenceMatrix:
    """The straightforward build of a ``bev.region`` matrix: every fine-cell entry, each moved to
    the row ``row_of_cell`` gives its cell (``(ny * nx,)``, -1: dropped), the entries of one
    ``(row, col)`` merged by a plain dictionary-free group-by (one ``lexsort``; weights summed,
    smallest ``dist2``), then the same full ``lexsort`` Top-K and normalisation as
    :func:`reference_matrix`. ``rows`` restricts the build to those region rows (complete)."""
    row_of_cell = np.asarray(row_of_cell, dtype=np.int64)
    fine = None if rows is None else np.flatnonzero(np.isin(row_of_cell, np.asarray(rows)))
    entries = _reference_entries(rig, options, fine, prior)
    region_row = row_of_cell[entries.row]
    inside = region_row >= 0
    r, c, w, d = region_row[inside], entries.col[inside], entries.weight[inside], entries.dist2[inside]
    group = np.lexsort((entries.row[inside], c, r))  # summed in increasing fine-cell order (the stated rule)
    r, c, w, d = r[group], c[group], w[group], d[group]
    starts = np.flatnonzero(np.r_[True, (r[1:] != r[:-1]) | (c[1:] != c[:-1])]) if r.size else np.zeros(0, np.int64)
    r, c = r[starts], c[starts]
    w = np.add.reduceat(w, starts) if starts.size else w[:0]
    d = np.minimum.reduceat(d, starts) if starts.size else d[:0]
    return _topk_reference(np.asarray(r, np.int64), np.asarray(c, np.int64), w, d, options, n_rows)


# --------------------------------------------------------------------------------------
# pooling references (what W @ x must reproduce)
# --------------------------------------------------------------------------------------


def bev_pool(
    rig: RigConfig,
    features: npt.NDArray[np.floating[Any]],
    depth_probs: npt.NDArray[np.floating[Any]],
    *,
    splat: str = "nearest",
    rounding: str = "floor",
    normalize: str = "sum",
    precision: str = "float64",
) -> F64:
    """BEVDet-style voxel pooling of the LSS outer product ``depth x feature``
    (``precision="float32"`` / ``"float16"``: the points of BEVDet's float32 lift / BEVDepth's float16
    ``get_geometry``, :func:`frustum_cell_coordinates`).

    Convention:
        features ``(n_cam, C, H_f, W_f)``, depth_probs ``(n_cam, D, H_f, W_f)``.
        returns ``(n_cam, C, ny, nx)`` float64: camera c's contribution to every BEV cell
        (their sum over cameras is the pooled BEV feature). Points from
        :func:`bevcompile.rig.geometry.unproject_feature_to_bev`; voxel index
        ``floor``/``trunc((p - min) / step)`` on x, y, z (BEVDet ``.long()`` is trunc);
        nearest splat adds to the voxel's cell, bilinear to the four nearest cell centres
        (outside cells dropped); ``mean`` divides by the pooled weight of the cell (all
        cameras).
    """
    bev = rig.bev
    feats = np.asarray(features, dtype=np.float64)
    depth = np.asarray(depth_probs, dtype=np.float64)
    n_cam, n_ch = feats.shape[:2]
    ny, nx = bev.ny, bev.nx
    out = np.zeros((n_cam, n_ch, ny * nx))
    mass = np.zeros(ny * nx)
    depths = np.asarray(rig.depth.values(), dtype=np.float64)
    uv = _feature_pixel_centres(rig)
    for cam_index, camera in enumerate(rig.cameras):
        if precision in ("float32", "float16"):
            cx, cy, cz, ok = frustum_cell_coordinates(rig, cam_index, precision)
        else:
            uv_all = np.broadcast_to(uv[None], (depths.size, *uv.shape))
            points, ok = unproject_feature_to_bev(rig, camera, uv_all, depths[:, None, None])
            cx = (points[..., 0] - bev.x.min) / bev.x.step
            cy = (points[..., 1] - bev.y.min) / bev.y.step
            cz = (points[..., 2] - bev.z.min) / bev.z.step
        with np.errstate(invalid="ignore"):
            kept = ok & _in_range(cx, nx, rounding) & _in_range(cy, ny, rounding) & _in_range(cz, bev.z.n, rounding)
        d_idx, v_idx, u_idx = np.nonzero(kept)
        lifted = depth[cam_index, d_idx, v_idx, u_idx][:, None] * feats[cam_index][:, v_idx, u_idx].T  # (n, C)
        if splat == "nearest":
            taps = [(_cell_index(cx[kept], rounding), _cell_index(cy[kept], rounding), np.ones(d_idx.size))]
        else:
            gx, gy = cx[kept] - 0.5, cy[kept] - 0.5
            x0, y0 = np.floor(gx), np.floor(gy)
            taps = [
                (x0 + ox, y0 + oy, (1 - abs(gx - x0 - ox)) * (1 - abs(gy - y0 - oy)))
                for ox in (0, 1)
                for oy in (0, 1)
            ]
        for ix, iy, weight in taps:
            inside = (ix >= 0) & (ix < nx) & (iy >= 0) & (iy < ny)
            cell = (iy[inside] * nx + ix[inside]).astype(np.int64)
            np.add.at(out[cam_index].T, cell, weight[inside][:, None] * lifted[inside])
            np.add.at(mass, cell, weight[inside])
    if normalize == "mean":
        out /= np.where(mass > 0, mass, 1.0)
    return out.reshape(n_cam, n_ch, ny, nx)


def grid_pool(
    rig: RigConfig, features: npt.NDArray[np.floating[Any]], *, splat: str = "bilinear", normalize: str = "sum"
) -> F64:
    """Per-camera sum over heights of ``grid_sample(features[cam], grid)`` (zeros padding) at
    the float64 sampling grid; ``mean`` divides by the pooled sampling weight of the cell.

    Convention: features ``(n_cam, C, H_f, W_f)`` -> ``(n_cam, C, ny, nx)`` float64.
    """
    sampling = compute_sampling_grid(rig)
    feats = np.asarray(features, dtype=np.float64)
    n_cam, n_ch = feats.shape[:2]
    norm = feature_px_to_norm(sampling.coords_feature_px, rig.feature_size, align_corners=False)
    out = np.zeros((n_cam, n_ch, rig.bev.ny, rig.bev.nx))
    mass = np.zeros((rig.bev.ny, rig.bev.nx))
    ones = np.ones((1, 1, *feats.shape[2:]))
    mode = "nearest" if splat == "nearest" else "bilinear"
    for cam in range(n_cam):
        for h in range(norm.shape[1]):
            grid = norm[cam, h][None]
            out[cam] += grid_sample(feats[cam][None], grid, mode=mode, align_corners=False)[0]
            mass += grid_sample(ones, grid, mode=mode, align_corners=False)[0, 0]
    if normalize == "mean":
        out /= np.where(mass > 0, mass, 1.0)
    return out
