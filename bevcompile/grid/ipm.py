"""Inverse-perspective (IPM) sampling grids: where every BEV cell lands in every camera.

Pure numpy. The float grid in feature pixels is the reference every NPU product (gather
tables, fixed-point formats, delta-LUT, matrices) is measured against.

Conventions (README "Conventions"; stored in the ``grid`` group attributes):

* BEV cell ``(iy, ix)`` has its centre at ``(x_min + (ix + 0.5) dx, y_min + (iy + 0.5) dy)``
  in the BEV frame (``bev.frame``: ego or a sensor's frame) and height ``heights[ih]``;
  arrays are ``[..., ny, nx]``.
* ``coords`` are ``(u, v)`` feature-map pixels, integer = pixel centre.
* VALID RULE: a cell is valid in a camera iff its centre is in front of the camera, inside
  the lens's monotonic field of view, and its *nearest feature pixel exists*:
  ``-0.5 <= u < W_f - 0.5`` and ``-0.5 <= v < H_f - 0.5`` (``floor(u + 0.5)`` in
  ``[0, W_f)``). The bilinear footprint may then reach one pixel past the border; those
  corners read zeros (``padding_mode="zeros"``), exactly as ``grid_sample`` does.
* INVALID cells hold ``coords = (INVALID_PX, INVALID_PX) = (-2, -2)``: two pixels outside
  the map, so that every bilinear corner is out of range and ``grid_sample`` with zeros
  padding returns exactly 0 there. ``norm`` is ``feature_px_to_norm(coords)`` everywhere.
* ``norm`` follows ``torch.nn.functional.grid_sample``: align_corners=False
  ``norm = (2 u + 1) / W_f - 1``; align_corners=True ``norm = 2 u / (W_f - 1) - 1``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from ..progress import ProgressFn
from ..rig.config import BevSpec, RigConfig
from ..rig.geometry import project_bev_to_feature
from ..rig.region import RegionTable, region_table

INVALID_PX = -2.0
NORM_INT16_SCALE = 32767
ROWS_PER_CHUNK = 64  # BEV rows projected per step: bounds peak memory for huge grids
CELLS_PER_ROW_CHUNK = 2048  # the cells of a row of a short lattice projected per step, times ROWS_PER_CHUNK / rows



def bev_cell_centres(bev: BevSpec) -> npt.NDArray[np.float64]:
    """BEV-frame coordinates of every BEV cell centre at every sampling height.

    Convention:
        returns ``(n_heights, ny, nx, 3)`` float64 metres ``(x, y, z)`` in the BEV frame
        (``bev.frame``: ego, or the named sensor's frame);
        ``[ih, iy, ix] = (x_min + (ix + 0.5) dx, y_min + (iy + 0.5) dy, heights[ih])``.
    """
    xs = bev.x.min + (np.arange(bev.x.n, dtype=np.float64) + 0.5) * bev.x.step
    ys = bev.y.min + (np.arange(bev.y.n, dtype=np.float64) + 0.5) * bev.y.step
    hs = np.asarray(bev.heights, dtype=np.float64)
    out = np.empty((hs.size, ys.size, xs.size, 3), dtype=np.float64)
    out[..., 0] = xs[None, None, :]
    out[..., 1] = ys[None, :, None]
    out[..., 2] = hs[:, None, None]
    return out


def inside_feature_map(uv_feature_px: npt.NDArray[np.floating], feature_size: tuple[int, int]) -> npt.NDArray[np.bool_]:
    """The VALID RULE's bounds test: the nearest feature pixel exists.

    Convention:
        uv_feature_px: ``(..., 2)`` ``(u, v)`` feature pixels; feature_size ``(W_f, H_f)``.
        returns bool ``(...)``: ``-0.5 <= u < W_f - 0.5`` and ``-0.5 <= v < H_f - 0.5``
        (False for NaN).
    """
    w_f, h_f = feature_size
    u = uv_feature_px[..., 0]
    v = uv_feature_px[..., 1]
    with np.errstate(invalid="ignore"):
        return (u >= -0.5) & (u < w_f - 0.5) & (v >= -0.5) & (v < h_f - 0.5)


@dataclass(frozen=True)
class SamplingGrid:
    """Float64 IPM grid of a rig.

    Convention:
        coords_feature_px: ``(n_cam, n_heights, ny, nx, 2)`` float64 ``(u, v)`` feature pixels;
        invalid cells hold ``(INVALID_PX, INVALID_PX)``.
        valid: ``(n_cam, n_heights, ny, nx)`` bool (VALID RULE).
    """

    coords_feature_px: npt.NDArray[np.float64]
    valid: npt.NDArray[np.bool_]
    feature_size: tuple[int, int]


def compute_sampling_grid(rig: RigConfig, progress: ProgressFn | None = None) -> SamplingGrid:
    """Project every BEV cell centre at every height into every camera's feature map.

    Streams over blocks of ``ROWS_PER_CHUNK`` BEV rows so peak memory stays bounded.
    ``progress(n)`` (optional) is called with the number of cells finished in each step;
    the total is ``n_cam * n_heights * ny * nx``. Always the full fine grid, whatever
    ``bev.region`` says (the matrix modes and interop pool fine cells); the grid products of a
    region are :func:`compute_product_grid`'s.
    """
    return _project_centres(rig, bev_cell_centres(rig.bev), progress)


def grid_region(bev: BevSpec) -> RegionTable | None:
    """The region table the grid products of ``bev`` sample (None without ``bev.region``)."""
    return region_table(bev) if bev.region is not None else None


def region_cell_centres(bev: BevSpec, table: RegionTable) -> npt.NDArray[np.float64]:
    """BEV-frame coordinates of every kept (super-)cell's centre at every sampling height.

    Convention:
        returns ``(n_heights, 1, n_kept, 3)`` float64 metres ``(x, y, z)`` in the BEV frame;
        ``[ih, 0, k] = (x_min + (ix + size / 2) dx, y_min + (iy + size / 2) dy, heights[ih])``
        with ``(iy, ix, size) = table.cells[k]`` (the cell table's order). The singleton axis is
        the one-row LATTICE the grid products are computed on (:func:`compute_product_grid`).
    """
    xy = table.centres(bev.x.min, bev.x.step, bev.y.min, bev.y.step)  # (n_kept, 2)
    hs = np.asarray(bev.heights, dtype=np.float64)
    out = np.empty((hs.size, 1, table.n_kept, 3), dtype=np.float64)
    out[..., 0] = xy[None, None, :, 0]
    out[..., 1] = xy[None, None, :, 1]
    out[..., 2] = hs[:, None, None]
    return out


def product_lattice_shape(bev: BevSpec) -> tuple[int, int]:
    """The cell axes of the grid products' lattice: ``(ny, nx)``, or ``(1, n_kept)`` with a
    ``bev.region`` (stored squeezed to one ``cell`` axis, see :func:`compute_product_grid`)."""
    table = grid_region(bev)
    return (bev.ny, bev.nx) if table is None else (1, table.n_kept)


def compute_product_grid(rig: RigConfig, progress: ProgressFn | None = None) -> SamplingGrid:
    """The float64 grid ``bevcompile grid`` encodes: :func:`compute_sampling_grid` without a
    ``bev.region``; with one, the projection of each kept (super-)cell's centre
    (:func:`region_cell_centres`) on the one-row lattice ``(n_cam, n_heights, 1, n_kept[, 2])``
    (cells in the cell table's order). ``progress`` totals ``n_cam * n_heights * n_kept`` then.
    """
    table = grid_region(rig.bev)
    if table is None:
        return compute_sampling_grid(rig, progress)
    return _project_centres(rig, region_cell_centres(rig.bev, table), progress)


def _project_centres(rig: RigConfig, centres: npt.NDArray[np.float64], progress: ProgressFn | None) -> SamplingGrid:
    """Project ``centres`` ``(n_h, ny, nx, 3)`` (BEV-frame metres) into every camera, by blocks of
    :data:`ROWS_PER_CHUNK` rows."""
    n_h, ny, nx = centres.shape[:3]
    coords = np.empty((rig.n_cam, n_h, ny, nx, 2), dtype=np.float64)
    valid = np.empty((rig.n_cam, n_h, ny, nx), dtype=np.bool_)
    # a step projects at most ROWS_PER_CHUNK rows, and at most ROWS_PER_CHUNK * CELLS_PER_ROW_CHUNK
    # cells of a long row (the one-row lattice of a region): elementwise, so the chunking never
    # changes a value
    cols = max(1, (ROWS_PER_CHUNK * CELLS_PER_ROW_CHUNK) // max(1, min(ny, ROWS_PER_CHUNK))) if ny < ROWS_PER_CHUNK else nx
    for cam_index, camera in enumerate(rig.cameras):
        for row0 in range(0, ny, ROWS_PER_CHUNK):
            row1 = min(ny, row0 + ROWS_PER_CHUNK)
            for col0 in range(0, nx, cols):
                col1 = min(nx, col0 + cols)
                points_bev = centres[:, row0:row1, col0:col1]
                uv, ok = project_bev_to_feature(rig, camera, points_bev)
                ok &= inside_feature_map(uv, rig.feature_size)
                coords[cam_index, :, row0:row1, col0:col1] = np.where(ok[..., None], uv, INVALID_PX)
                valid[cam_index, :, row0:row1, col0:col1] = ok
                if progress is not None:
                    progress(n_h * (row1 - row0) * (col1 - col0))
    return SamplingGrid(coords, valid, rig.feature_size)


def feature_px_to_norm(
    uv_feature_px: npt.NDArray[np.floating], feature_size: tuple[int, int], align_corners: bool
) -> npt.NDArray[np.float64]:
    """Feature pixels -> ``grid_sample`` normalised coordinates (PyTorch semantics).

    Convention:
        uv_feature_px ``(..., 2)`` ``(u, v)``; feature_size ``(W_f, H_f)``.
        returns ``(..., 2)`` float64 ``(x_norm, y_norm)``: -1 = left/top edge of the map
        (align_corners=False) or centre of the first pixel (align_corners=True).
    """
    uv = np.asarray(uv_feature_px, dtype=np.float64)
    size = np.array(feature_size, dtype=np.float64)
    if align_corners:
        return uv * (2.0 / (size - 1.0)) - 1.0
    return (2.0 * uv + 1.0) / size - 1.0


def norm_to_feature_px(
    norm: npt.NDArray[np.floating], feature_size: tuple[int, int], align_corners: bool
) -> npt.NDArray[np.float64]:
    """Inverse of :func:`feature_px_to_norm` (PyTorch's ``grid_sampler_unnormalize``)."""
    norm = np.asarray(norm, dtype=np.float64)
    size = np.array(feature_size, dtype=np.float64)
    if align_corners:
        return (norm + 1.0) / 2.0 * (size - 1.0)
    return ((norm + 1.0) * size - 1.0) / 2.0


def encode_norm_int16(norm: npt.NDArray[np.floating]) -> npt.NDArray[np.int16]:
    """``round(norm * 32767)`` (round half to even), saturated to ``[-32767, 32767]``.

    Convention: ``(..., 2)`` float normalised ``(x, y)`` -> int16 same shape. Decode with
    :func:`decode_norm_int16`. Invalid cells saturate to -1.0, which is *in range*: consumers
    of ``norm_int16`` must mask with ``grid/valid``.
    """
    scaled = np.rint(np.asarray(norm, dtype=np.float64) * NORM_INT16_SCALE)
    return np.clip(scaled, -NORM_INT16_SCALE, NORM_INT16_SCALE).astype(np.int16)


def decode_norm_int16(encoded: npt.NDArray[np.integer]) -> npt.NDArray[np.float64]:
    """``norm = q / 32767`` (float64)."""
    return np.asarray(encoded, dtype=np.float64) / NORM_INT16_SCALE


@dataclass(frozen=True)
class GridProducts:
    """The arrays of the ``grid/`` group and the measured figures for its attributes."""

    coords: npt.NDArray[np.float32]
    valid: npt.NDArray[np.bool_]
    norm: npt.NDArray[np.float32]
    norm_int16: npt.NDArray[np.int16]
    norm_int16_max_error_px: float
    align_corners: bool
    feature_size: tuple[int, int]
    norm_int16_saturated_valid_cells: int = 0


def build_grid_products(grid: SamplingGrid, align_corners: bool) -> GridProducts:
    """float32 coords/norm and int16 norm from a float64 :class:`SamplingGrid`.

    ``norm`` is computed from the float64 coords (not from the rounded float32 coords).
    ``norm_int16_max_error_px`` is the measured max ``|decode(norm_int16) - coords|`` in
    feature pixels over valid cells (0 when no cell is valid). ``norm_int16_saturated_valid_cells``
    counts valid cells whose code the clip changes (``|norm * 32767| > 32767.5`` on an axis, the
    rule of :mod:`bevcompile.grid.formats`): under align_corners=True the valid rule
    reaches half a pixel past the outer pixel centres, which ``[-1, 1]`` cannot represent, so
    those cells are clamped by up to 0.5 px (included in the measured error).
    """
    norm64 = feature_px_to_norm(grid.coords_feature_px, grid.feature_size, align_corners)
    norm_int16 = encode_norm_int16(norm64)
    decoded_px = norm_to_feature_px(decode_norm_int16(norm_int16), grid.feature_size, align_corners)
    err = np.abs(decoded_px - grid.coords_feature_px)[grid.valid]
    # the same rule as every fixed-point format: the clip changes the code
    saturated = int(np.count_nonzero(np.any(np.abs(norm64 * NORM_INT16_SCALE) > NORM_INT16_SCALE + 0.5, axis=-1) & grid.valid))
    return GridProducts(
        coords=grid.coords_feature_px.astype(np.float32),
        valid=grid.valid.copy(),
        norm=norm64.astype(np.float32),
        norm_int16=norm_int16,
        norm_int16_max_error_px=float(err.max()) if err.size else 0.0,
        align_corners=align_corners,
        feature_size=grid.feature_size,
        norm_int16_saturated_valid_cells=saturated,
    )


def coverage_fraction(valid: npt.NDArray[np.bool_]) -> npt.NDArray[np.float64]:
    """Fraction of BEV cells valid, ``(n_cam, n_heights)`` float64 from ``(n_cam, n_h, ny, nx)``."""
    return valid.reshape(valid.shape[0], valid.shape[1], -1).mean(axis=-1)
