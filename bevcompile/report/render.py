"""``bevcompile render``: a coverage picture of a store (matplotlib, the optional ``[plot]`` extra).

Left panel — the BEV plane seen from above in the automotive orientation: ego **x forward
points UP**, ego **y left points LEFT** (so the picture is what a driver sees on a map that
turns with the car), axes in metres, cell ``(iy, ix)`` drawn as the square centred on
``(x_min + (ix + 0.5) dx, y_min + (iy + 0.5) dy)``. Each camera's coverage (``grid/valid``, by
default at ANY sampling height; ``height=`` picks one; a store without ``grid/`` -- matrix
only -- uses the VALID RULE on the stored config's float64 projection instead, and the panel
title says so) is painted in the camera's colour;
a cell seen by several cameras is striped with their colours (overlaps are visibly mixed)
and each camera's footprint is outlined in its colour. Cells no camera sees are light grey.
The cameras are drawn at their ego position with an arrow along the ground projection of
their optical axis; the ego box is the cameras' footprint grown by 0.5 m (the config has no
vehicle dimensions; it is labelled "nominal").

A BEV grid in a sensor's frame (``bev.frame``, e.g. nuScenes ``LIDAR_TOP``: x right, y forward)
is drawn in that frame, turned so that the vehicle still drives UP: the BEV axis closest to
ego forward is drawn upwards and the other one with ego left on the left (``LIDAR_TOP``: y UP,
x RIGHT); axes are labelled with the frame's name, cameras are drawn at their pose in it.

Right panel — ``matrix/camera_mass`` summed over cameras when the store has a matrix group
(else the matrix's per-cell nnz from ``coo_row``), or, without a matrix group, the number of
cameras that see each cell. A store with LEARNED matrix values (``bevcompile absorb``) gets one
small map per camera instead: its learned-minus-init mass per cell (``camera_mass`` minus the same
sum over ``init_ell_weight``), on one symmetric diverging colour scale (red: the camera gained
weight there, blue: lost).

The figure has a fixed size and dpi (:data:`FIGSIZE_IN` x :data:`DPI` = 1500 x 750 px) and
no timestamp in its metadata: same store, same bytes.
"""

from __future__ import annotations

import math
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from ..errors import BevcompileError, DependencyError, StoreError, UsageError
from ..files import FileRefused, replace_file
from ..grid.ipm import compute_sampling_grid
from ..rig.config import RigConfig, parse_config
from ..rig.geometry import bev_from_cam_matrix, bev_from_ego_matrix
from ..rig.region import region_table
from ..store.plugins import level_group
from ..store.zarr_io import STDIO, StoreReader, open_store, output_file, the_one_store

FIGSIZE_IN = (15.0, 7.5)
DPI = 100
UNSEEN_RGB = (0.92, 0.92, 0.92)
EGO_MARGIN_M = 0.5
ARROW_FRACTION = 0.07
"""Optical-axis arrows are this fraction of the larger BEV extent long (main panel)."""
INSET_HALF_M = 6.0
COVERAGE_AXES_RECT = (0.04, 0.08, 0.40, 0.84)
INSET_AXES_RECT = (0.465, 0.07, 0.15, 0.33)
PANEL2_AXES_RECT = (0.655, 0.08, 0.27, 0.84)
COLORBAR_AXES_RECT = (0.94, 0.2, 0.012, 0.6)
_PALETTE = (  # matplotlib tab10, fixed here so the picture does not depend on rcParams
    (0.12156862745098039, 0.4666666666666667, 0.7058823529411765),
    (1.0, 0.4980392156862745, 0.054901960784313725),
    (0.17254901960784313, 0.6274509803921569, 0.17254901960784313),
    (0.8392156862745098, 0.15294117647058825, 0.1568627450980392),
    (0.5803921568627451, 0.403921568627451, 0.7411764705882353),
    (0.5490196078431373, 0.33725490196078434, 0.29411764705882354),
    (0.8901960784313725, 0.4666666666666667, 0.7607843137254902),
    (0.4980392156862745, 0.4980392156862745, 0.4980392156862745),
    (0.7372549019607844, 0.7411764705882353, 0.13333333333333333),
    (0.09019607843137255, 0.7450980392156863, 0.8117647058823529),
)


def camera_colours(n_cam: int) -> list[tuple[float, float, float]]:
    """RGB in [0, 1] per camera: tab10, then evenly spaced hues for more than 10 cameras."""
    if n_cam <= len(_PALETTE):
        return list(_PALETTE[:n_cam])
    import colorsys

    return [colorsys.hsv_to_rgb(i / n_cam, 0.75, 0.85) for i in range(n_cam)]


def coverage_rgb(coverage: npt.NDArray[np.bool_], colours: list[tuple[float, float, float]], supersample: int = 1) -> npt.NDArray[np.float64]:
    """The coverage image: every camera seeing a cell shows in its own colour, unmixed.

    Convention:
        coverage: ``(n_cam, ny, nx)`` bool; colours: one RGB per camera.
        returns ``(ny * S, nx * S, 3)`` float64 RGB with ``S = supersample``: a cell one camera sees
        is that camera's colour; a cell ``c >= 2`` cameras see is striped along the diagonals
        (stripes ``max(1, S // 2)`` pixels wide) with the colours of those cameras in camera order
        (pixel ``(a, b)`` of the image shows the ``k``-th of them, ``k = ((a + b) // width) % c``;
        with ``S = 1`` the cells alternate in a checkerboard); :data:`UNSEEN_RGB` where none does.
    """
    palette = np.asarray([*colours, UNSEEN_RGB], dtype=np.float64)  # (n_cam + 1, 3); last: unseen
    n_cam, ny, nx = coverage.shape
    count = coverage.sum(axis=0)  # (ny, nx)
    # seeing cameras first, in camera order: order[k, iy, ix] = the k-th camera seeing the cell
    order = np.argsort(~coverage, axis=0, kind="stable")
    s = int(supersample)
    width = max(1, s // 2)
    a = np.arange(ny * s)[:, None]
    b = np.arange(nx * s)[None, :]
    cell_count = np.repeat(np.repeat(count, s, axis=0), s, axis=1)  # (ny*S, nx*S)
    k = ((a + b) // width) % np.maximum(cell_count, 1)
    cam = np.take_along_axis(np.repeat(np.repeat(order, s, axis=1), s, axis=2), k[None], axis=0)[0]
    cam = np.where(cell_count > 0, cam, n_cam)
    return palette[cam]


def coverage_supersample(ny: int, nx: int) -> int:
    """Pixels per cell side of the coverage image: up to 4 (room for the stripes), the image at
    most ~1024 pixels on a side."""
    return max(1, min(4, 1024 // max(ny, nx, 1)))


@dataclass(frozen=True)
class RenderResult:
    """What was drawn, and where: ``bev_to_display`` maps ego ``(y, x)`` metres of the coverage
    panel to display pixels (origin bottom-left), as matplotlib laid the figure out."""

    path: Path
    width_px: int
    height_px: int
    coverage: npt.NDArray[np.bool_]  # (n_cam, ny, nx) drawn coverage
    colours: tuple[tuple[float, float, float], ...]
    height_label: str
    second_panel: str
    bev_to_display: npt.NDArray[np.float64]  # 3x3 affine
    coverage_source: str = "grid/valid"  # or "stored config's projection, no grid/" (a matrix-only store)
    up_axis: int = 0  # the BEV axis drawn upwards: 0 = x (ego), 1 = y (e.g. LIDAR_TOP)

    def pixel_of(self, x_m: float, y_m: float) -> tuple[int, int]:
        """``(column, row)`` of the PNG pixel showing BEV-frame point ``(x_m, y_m)`` (row 0 = top)."""
        data = [y_m, x_m] if self.up_axis == 0 else [x_m, y_m]
        disp = self.bev_to_display @ np.array([*data, 1.0])
        return math.floor(float(disp[0])), math.floor(self.height_px - float(disp[1]))

    def to_json(self) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "width_px": self.width_px,
            "height_px": self.height_px,
            "coverage_heights": self.height_label,
            "coverage_source": self.coverage_source,
            "second_panel": self.second_panel,
            "coverage_fraction": [float(c.mean()) for c in self.coverage],
        }


def default_output(store: Path, name: str) -> Path:
    """``<store parent>/<name>_coverage.png``."""
    return store.parent / f"{name}_coverage.png"


def _matplotlib() -> tuple[Any, Any]:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise DependencyError(
            f"bevcompile render needs matplotlib ({exc.__class__.__name__}: {exc}); install the extra: pip install 'bevcompile[plot]'"
        ) from None
    return Figure, FigureCanvasAgg


def _read_rig(reader: StoreReader) -> RigConfig:
    config = reader.root_attrs.get("config")
    if config is None:
        raise StoreError(f"{reader.path}: no stored config (run bevcompile inspect)")
    try:
        return parse_config(config, source=f"{reader.path} stored config")
    except BevcompileError as exc:
        raise StoreError(f"{reader.path}: stored config unusable ({exc}); run bevcompile inspect") from None


def _select_coverage(rig: RigConfig, valid: np.ndarray, height: float | None) -> tuple[np.ndarray, str]:
    heights = list(rig.bev.heights)
    if height is None:
        label = f"any of z = {', '.join(f'{h:g}' for h in heights)} m" if len(heights) > 1 else f"z = {heights[0]:g} m"
        return np.asarray(valid.any(axis=1)), label
    matches = [i for i, h in enumerate(heights) if abs(h - height) <= 1e-9]
    if not matches:
        raise UsageError(f"--height {height:g} is not a sampling height of this store ({', '.join(f'{h:g}' for h in heights)})")
    return np.asarray(valid[:, matches[0]]), f"z = {heights[matches[0]]:g} m"


def _matrix_panel(reader: StoreReader, rig: RigConfig) -> tuple[np.ndarray, str, str] | None:
    """``(per-cell values (ny, nx), title, colour-bar label)`` from the matrix group, if any."""
    if not reader.has_group("matrix"):
        return None
    ny, nx = rig.bev.ny, rig.bev.nx
    names = reader.child_dirs("matrix")  # folder names: no group listing that parses every array's metadata
    if "camera_mass" in names:
        mass = reader.read("matrix", "camera_mass")
        if not np.all(np.isfinite(mass)):
            raise StoreError(f"{reader.path}: matrix/camera_mass holds non-finite values; run bevcompile inspect")
        if mass.ndim == 3 and mass.shape == (rig.n_cam, ny, nx):
            return mass.astype(np.float64).sum(axis=0), "matrix/camera_mass, summed over cameras", "total weight per cell"
    if "coo_row" in names:
        rows = reader.read("matrix", "coo_row").astype(np.int64).ravel()
        if "row_ids" in names:
            row_ids = reader.read("matrix", "row_ids").astype(np.int64).ravel()
            if rows.size and (rows.min() < 0 or rows.max() >= row_ids.size):
                raise StoreError(f"{reader.path}: matrix/coo_row indexes past matrix/row_ids; run bevcompile inspect")
            rows = row_ids[rows]
        if rows.size and (rows.min() < 0 or rows.max() >= ny * nx):
            raise StoreError(f"{reader.path}: matrix/coo_row holds a cell index outside the BEV grid; run bevcompile inspect")
        nnz = np.bincount(rows, minlength=ny * nx).reshape(ny, nx).astype(np.float64)
        return nnz, "matrix non-zeros per BEV cell (from coo_row)", "nnz per cell"
    return None


def _learned_panel(reader: StoreReader, rig: RigConfig) -> np.ndarray | None:
    """``(n_cam, ny, nx)`` float64 learned-minus-init camera mass of a learned ``matrix/`` (None otherwise)."""
    if not reader.has_group("matrix") or reader.group_attrs("matrix").get("values") != "learned":
        return None
    from .drift import _ell_slots, camera_mass

    row = reader.read("matrix", "coo_row").astype(np.int64)
    col = reader.read("matrix", "coo_col").astype(np.int64)
    init = reader.read("matrix", "init_ell_weight")
    mass = reader.read("matrix", "camera_mass").astype(np.float64)
    ny, nx = rig.bev.ny, rig.bev.nx
    names = reader.child_dirs("matrix")
    cells = reader.read("matrix", "row_ids").astype(np.int64)[row] if "row_ids" in names else row
    if init.ndim != 2 or (row.size and (row.max() >= init.shape[0] or cells.max() >= ny * nx)) or mass.shape != (rig.n_cam, ny, nx):
        raise StoreError(f"{reader.path}: matrix/ arrays are inconsistent; run bevcompile inspect")
    per_cam = max(1, int(reader.group_attrs("matrix").get("columns_per_camera") or 1))
    init_values = init[row, _ell_slots(row)].astype(np.float32).astype(np.float64)
    if "expand" in names:  # bev.region: rows are the kept (super-)cells; each fine cell reads its row's mass
        expand = reader.read("matrix", "expand").astype(np.int64).ravel()
        n_rows = int(expand.max(initial=0)) + 1
        if expand.size != ny * nx or (row.size and row.max() >= n_rows):
            raise StoreError(f"{reader.path}: matrix/ arrays are inconsistent; run bevcompile inspect")
        before = camera_mass(row, col // per_cam, init_values, rig.n_cam, n_rows)[:, expand].reshape(rig.n_cam, ny, nx)
    else:
        before = camera_mass(cells, col // per_cam, init_values, rig.n_cam, ny * nx).reshape(rig.n_cam, ny, nx)
    return mass - before


def render_store(
    path: str | Path, out: str | Path | None = None, *, height: float | None = None, level: int = 0
) -> RenderResult:
    """Draw the coverage picture of the store at ``path`` into ``out`` (PNG, written atomically):
    the coverage of feature level ``level`` (``grid/`` for 0, ``grid_l<l>/`` for ``feature.levels``).

    Raises :class:`StoreError` for a store that cannot be drawn (not a store, ``grid/valid``
    unreadable), :class:`UsageError` for a bad ``out``/``height``, :class:`DependencyError`
    without matplotlib.
    """
    Figure, FigureCanvasAgg = _matplotlib()
    store, reader, rig = _open_render_store(path)
    if isinstance(level, bool) or not isinstance(level, int) or not 0 <= level < rig.n_levels:
        raise UsageError(f"--level {level} is not a feature level of this store (0 to {rig.n_levels - 1})")
    own_grid = rig.level(level).bev != rig.bev  # feature.levels[l].bev: the level's own cells (no matrix/ of them)
    if own_grid:
        rig = rig.level(level)
    grid_name = level_group("grid", level)
    out_path = _png_output(out, default_output(store, rig.name if level == 0 else f"{rig.name}_l{level}"))
    if reader.has_group(grid_name):
        valid = reader.read(grid_name, "valid")
        expected = (rig.n_cam, len(rig.bev.heights), rig.bev.ny, rig.bev.nx)
        if rig.bev.region is not None:  # the kept (super-)cells, drawn on the fine cells they cover
            valid = _region_valid_on_grid(store, reader, grid_name, valid, expected)
        if valid.dtype != np.bool_ or valid.shape != expected:
            raise StoreError(f"{store}: {grid_name}/valid is {valid.dtype}{list(valid.shape)}, expected bool{list(expected)}; run bevcompile inspect")
        source = f"{grid_name}/valid" + (" of the kept cells" if rig.bev.region is not None else "")
    else:
        # a matrix-only store: the coverage of the stored config's projection (the VALID RULE on
        # the float64 sampling grid: exactly what `bevcompile grid` would store as grid/valid)
        valid = compute_sampling_grid(rig if own_grid else rig.level(level)).valid
        source = f"stored config's projection, no {grid_name}/"
    coverage, height_label = _select_coverage(rig, valid, height)
    matrix = None if own_grid else _matrix_panel(reader, rig)

    colours = camera_colours(rig.n_cam)
    fig = Figure(figsize=FIGSIZE_IN, dpi=DPI)
    FigureCanvasAgg(fig)
    ax = fig.add_axes(COVERAGE_AXES_RECT)
    _draw_coverage(ax, rig, coverage, colours)
    ax.set_title(f"camera coverage at {height_label} ({source})", fontsize=10)
    handles = _legend_handles(rig, coverage, colours)
    fig.legend(handles=handles, loc="upper left", bbox_to_anchor=(0.445, 0.92), fontsize=8, frameon=False, title="cameras", title_fontsize=9)
    inset = fig.add_axes(INSET_AXES_RECT)
    _draw_coverage(inset, rig, coverage, colours, half_m=INSET_HALF_M)
    view = bev_view(rig)
    inset.set_title(f"ego area, +-{INSET_HALF_M:g} m", fontsize=8)
    inset.tick_params(labelsize=7)
    inset.set_xlabel(view.label(view.across, short=True), fontsize=7)
    inset.set_ylabel(view.label(view.up, short=True), fontsize=7)

    cax = fig.add_axes(COLORBAR_AXES_RECT)
    learned = None if own_grid else _learned_panel(reader, rig)
    if learned is not None:
        second = "learned - init camera mass, per camera"
        _draw_learned(fig, cax, rig, learned, colours)
    elif matrix is not None:
        values, title, cbar_label = matrix
        second = title
    else:
        values = coverage.sum(axis=0).astype(np.float64)
        title = f"cameras per cell ({height_label}) -- no matrix/ group"
        cbar_label = "number of cameras"
        second = "cameras per cell"
    if learned is None:
        _draw_values(
            fig, fig.add_axes(PANEL2_AXES_RECT), cax, rig, values, title, cbar_label,
            integer=matrix is None, seen=np.asarray(np.any(valid, axis=(0, 1))),
        )
    fig.suptitle(
        f"{rig.name}: {rig.n_cam} cameras, BEV {rig.bev.nx} x {rig.bev.ny} cells of {rig.bev.x.step:g} x {rig.bev.y.step:g} m"
        + (
            "  —  seen from above, x forward UP, y left LEFT"
            if view.frame == "ego"
            else f"  —  {view.frame} frame seen from above, ego forward UP ({view.frame} "
            f"{'+' if view.up_sign > 0 else '-'}{'xy'[view.up]} UP, {'+' if view.right_sign > 0 else '-'}{'xy'[view.across]} RIGHT)"
        ),
        fontsize=12,
    )
    fig.canvas.draw()
    bev_to_display = np.array(ax.transData.get_affine().get_matrix(), dtype=np.float64)
    width_px, height_px = (round(float(v)) for v in fig.canvas.get_width_height())

    _save_png(fig, out_path)
    return RenderResult(out_path, width_px, height_px, coverage, tuple(colours), height_label, second, bev_to_display, source, view.up)


def _open_render_store(path: str | Path) -> tuple[Path, StoreReader, RigConfig]:
    """``(store path, reader, stored rig)`` of the store ``render`` draws (one-line errors for a
    path that is not exactly one store or whose config cannot be used)."""
    store = the_one_store(path, "render")
    reader = open_store(store)
    if "format" not in reader.root_attrs:
        from ..store.inspection import not_a_store_root

        not_a_store_root(store, "render")
    return store, reader, _read_rig(reader)


def _png_output(out: str | Path | None, default: Path) -> Path:
    """The PNG path of ``--out`` (``default`` when None), checked: a ``.png`` file name (or ``-``),
    its folder exists and is writable (none is created), ``-`` not a terminal."""
    out_path = Path(out) if out is not None else default
    if str(out_path) != STDIO:
        if out_path.is_dir():
            raise UsageError(f"--out {out_path}: is a directory, give a .png file name")
        if out_path.suffix.lower() != ".png":
            raise UsageError(f"--out {out_path}: the picture is a PNG, give a .png file name")
    output_file(out_path)
    return out_path


def _save_png(fig: Any, out_path: Path) -> None:
    """Write ``fig`` as a PNG without a timestamp (same figure, same bytes): atomically into
    ``out_path``, or to standard output for ``-``."""
    if str(out_path) == STDIO:  # --out -: the PNG to standard output
        import io
        import sys

        buffer = io.BytesIO()
        fig.savefig(buffer, format="png", dpi=DPI, metadata={"Software": None})
        sys.stdout.buffer.write(buffer.getvalue())
        sys.stdout.buffer.flush()
        return
    tmp = out_path.parent / f".{out_path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        fig.savefig(tmp, format="png", dpi=DPI, metadata={"Software": None})
        replace_file(tmp, out_path)
    except FileRefused as exc:
        raise UsageError(f"--out {out_path}: {exc.reason}") from None
    except OSError as exc:
        raise UsageError(f"--out {out_path}: cannot write ({exc.strerror or exc})") from None
    finally:
        if tmp.exists():
            tmp.unlink()


# --------------------------------------------------------------------------------------
# render --precision
# --------------------------------------------------------------------------------------

PRECISION_PANEL_IN = (4.6, 4.6)
"""Inches per panel of the precision picture (at :data:`DPI`)."""
PRECISION_MAX_COLUMNS = 4
PRECISION_STEP_DB = 5.0
PRECISION_MAX_STEPS = 12
"""The precision picture's colour scale: one colour per 5 dB, at most 12 of them (60 dB) from the
lowest form up; cells above the top edge take the top colour (float forms: ~140 dB; read it as
'at least')."""
NO_SIGNAL_RGB = (0.85, 0.85, 0.85)


@dataclass(frozen=True)
class PrecisionRenderResult:
    """What ``render --precision`` drew: one panel per form, the shared dB scale, the map."""

    path: Path
    width_px: int
    height_px: int
    forms: tuple[str, ...]
    scale_db: tuple[float, float]
    precision: Any  # bevcompile.report.precision.PrecisionMap

    def to_json(self) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "width_px": self.width_px,
            "height_px": self.height_px,
            "forms": list(self.forms),
            "scale_db": list(self.scale_db),
            "precision": self.precision.to_json(),
        }


def precision_scale_db(snr_maps: list[np.ndarray]) -> tuple[float, float]:
    """The shared colour range: from the 1st percentile of the lowest form down to a multiple of
    :data:`PRECISION_STEP_DB`, to the 99th percentile of the highest up to one, at most
    :data:`PRECISION_MAX_STEPS` steps (finite cell SNRs; higher and ``+inf`` cells are drawn in
    the top colour)."""
    finite = [m[np.isfinite(m)] for m in snr_maps]
    finite = [v for v in finite if v.size]
    if not finite:
        return 0.0, PRECISION_STEP_DB
    low = min(float(np.percentile(v, 1.0)) for v in finite)
    high = max(float(np.percentile(v, 99.0)) for v in finite)
    lo = PRECISION_STEP_DB * math.floor(low / PRECISION_STEP_DB)
    hi = PRECISION_STEP_DB * math.ceil(high / PRECISION_STEP_DB)
    return lo, min(max(hi, lo + PRECISION_STEP_DB), lo + PRECISION_MAX_STEPS * PRECISION_STEP_DB)


def render_precision(
    path: str | Path,
    out: str | Path | None = None,
    *,
    seed: int = 0,
    channels: int = 8,
    bands: str | list[float] | tuple[float, ...] | None = None,
) -> PrecisionRenderResult:
    """Draw the precision map (:func:`bevcompile.report.precision.precision_map`) of the store at
    ``path`` into ``out`` (default ``<store parent>/<name>_precision.png``): one panel per deployed
    form, the per-cell SNR on one shared scale in 10 dB steps (light grey: no signal), the BEV seen
    from above as ``render`` draws it, the distance bands as dashed rings; each panel's title gives
    its SNR over all cells and per band."""
    from .precision import band_labels, format_db, precision_map

    Figure, FigureCanvasAgg = _matplotlib()
    store, _reader, rig = _open_render_store(path)
    out_path = _png_output(out, store.parent / f"{rig.name}_precision.png")
    pmap = precision_map(store, seed=seed, channels=channels, bands=bands)
    if not pmap.forms:
        raise StoreError(f"{store}: no deployed form to draw (the store has neither matrix/ nor gather/); build them with `bevcompile grid` / `bevcompile matrix`")
    from matplotlib.colors import BoundaryNorm, ListedColormap
    from matplotlib.patches import Circle

    lo, hi = precision_scale_db([f.snr_db for f in pmap.forms])
    boundaries = np.arange(lo, hi + PRECISION_STEP_DB / 2, PRECISION_STEP_DB)
    from matplotlib import colormaps

    cmap = ListedColormap(colormaps["viridis"](np.linspace(0.0, 1.0, boundaries.size - 1)))
    norm = BoundaryNorm(boundaries, cmap.N)
    n = len(pmap.forms)
    cols = min(PRECISION_MAX_COLUMNS, n)
    rows = -(-n // cols)
    width_in = PRECISION_PANEL_IN[0] * cols + 1.3
    height_in = PRECISION_PANEL_IN[1] * rows + 1.0
    fig = Figure(figsize=(width_in, height_in), dpi=DPI)
    FigureCanvasAgg(fig)
    view = bev_view(rig)
    labels = band_labels(pmap.bands_m)
    image = None
    for i, form in enumerate(pmap.forms):
        r, c = divmod(i, cols)
        left = (0.35 + c * PRECISION_PANEL_IN[0]) / width_in
        bottom = (0.45 + (rows - 1 - r) * PRECISION_PANEL_IN[1]) / height_in
        ax = fig.add_axes((left, bottom, (PRECISION_PANEL_IN[0] - 0.75) / width_in, (PRECISION_PANEL_IN[1] - 1.15) / height_in))
        ax.imshow(np.broadcast_to(np.asarray(NO_SIGNAL_RGB), (2, 2, 3)), origin="lower", extent=_extent(rig, view), aspect="equal")
        shown = np.ma.masked_invalid(np.clip(form.snr_db, lo, hi - PRECISION_STEP_DB / 2))  # +inf: the top colour
        image = ax.imshow(_image(view, shown), origin="lower", extent=_extent(rig, view), interpolation="nearest", aspect="equal", cmap=cmap, norm=norm)
        for edge in pmap.bands_m:
            ax.add_patch(Circle((0.0, 0.0), edge, fill=False, edgecolor="white", linewidth=0.9, linestyle="--"))
        ax.set_xlim(*_limits(_axis_spec(rig, view.across), view.right_sign))
        ax.set_ylim(*_limits(_axis_spec(rig, view.up), view.up_sign))
        ax.tick_params(labelsize=7)
        per_band = " / ".join(format_db(b.snr_db) for b in form.bands)
        ax.set_title(f"{form.name}: {format_db(form.overall.snr_db)} dB\nbands {per_band} dB", fontsize=8)
    if image is not None:
        cax = fig.add_axes(((width_in - 0.85) / width_in, 0.2, 0.15 / width_in, 0.6))
        colorbar = fig.colorbar(image, cax=cax, ticks=boundaries)
        colorbar.set_label(f"SNR per cell [dB] (10 log10 of reference / error energy; top colour: >= {hi - PRECISION_STEP_DB:g} dB)")
    fig.suptitle(
        f"{rig.name}: where each deployed form loses precision (seed {pmap.seed}, {pmap.channels} channels; "
        f"bands {', '.join(labels)} as dashed rings; grey: no signal)",
        fontsize=10,
    )
    fig.canvas.draw()
    width_px, height_px = (round(float(v)) for v in fig.canvas.get_width_height())
    _save_png(fig, out_path)
    return PrecisionRenderResult(out_path, width_px, height_px, tuple(f.name for f in pmap.forms), (lo, hi), pmap)


@dataclass(frozen=True)
class _View:
    """How the BEV plane is laid on the picture: ``up`` is the BEV axis (0 = x, 1 = y) drawn
    upwards, increasing upwards iff ``up_sign > 0``; the other axis increases to the right iff
    ``right_sign > 0``. Ego frame: x up, y increasing to the LEFT."""

    up: int
    up_sign: float
    right_sign: float
    frame: str

    @property
    def across(self) -> int:
        return 1 - self.up

    def label(self, axis: int, short: bool = False) -> str:
        name = "xy"[axis]
        if short:
            return f"{name} [m]"
        if self.frame == "ego":  # the automotive wording of ego pictures
            return "ego y [m]  (left is +y, drawn to the LEFT)" if axis == 1 else "ego x [m]  (forward is +x, drawn UP)"
        side = ("UP" if self.up_sign > 0 else "DOWN") if axis == self.up else ("RIGHT" if self.right_sign > 0 else "LEFT")
        return f"{self.frame} {name} [m]  (+{name} drawn {side})"

    def hv(self, point: npt.ArrayLike) -> tuple[float, float]:
        """(horizontal, vertical) data coordinates of a BEV-frame point ``(x, y[, z])``."""
        p = np.asarray(point, dtype=np.float64)
        return float(p[self.across]), float(p[self.up])


def bev_view(rig: RigConfig) -> _View:
    """The picture's orientation: ego forward UP and ego left LEFT, in the BEV frame."""
    sensor = rig.bev_frame_sensor
    if sensor is None:
        return _View(0, 1.0, -1.0, "ego")
    rotation = np.array(sensor.ego_from_sensor, dtype=np.float64)[:3, :3]
    forward_bev, left_bev = rotation[0, :2], rotation[1, :2]  # ego x and y axes in the BEV frame
    up = int(np.argmax(np.abs(forward_bev)))
    across = 1 - up
    return _View(up, float(np.sign(forward_bev[up]) or 1.0), float(-np.sign(left_bev[across]) or 1.0), rig.bev.frame)


def _axis_spec(rig: RigConfig, axis: int) -> Any:
    return rig.bev.x if axis == 0 else rig.bev.y


def _limits(spec: Any, sign: float) -> tuple[float, float]:
    return (spec.min, spec.max) if sign > 0 else (spec.max, spec.min)


def _image(view: _View, values: np.ndarray) -> np.ndarray:
    """``(ny, nx, ...)`` -> rows along the up axis, columns along the other (origin lower)."""
    return np.swapaxes(values, 0, 1) if view.up == 0 else values


def _extent(rig: RigConfig, view: _View) -> tuple[float, float, float, float]:
    h, v = _axis_spec(rig, view.across), _axis_spec(rig, view.up)
    return (h.min, h.max, v.min, v.max)


def _draw_coverage(
    ax: Any, rig: RigConfig, coverage: np.ndarray, colours: list[tuple[float, float, float]], half_m: float | None = None
) -> None:
    """Coverage image, footprint outlines, ego box and cameras (coloured dot, black arrow along
    the optical axis projected on the ground); ``half_m`` zooms on the ego."""
    view = bev_view(rig)
    rgb = coverage_rgb(coverage, colours, coverage_supersample(rig.bev.ny, rig.bev.nx))  # (ny*S, nx*S, 3)
    # displayed image rows follow the up axis (upwards with origin="lower"), columns the other;
    # the limits then flip an axis where needed (ego: +y, left, is on the left).
    ax.imshow(_image(view, rgb), origin="lower", extent=_extent(rig, view), interpolation="nearest", aspect="equal")
    h_centres = np.asarray(_axis_spec(rig, view.across).centres())
    v_centres = np.asarray(_axis_spec(rig, view.up).centres())
    for cam_index, colour in enumerate(colours):
        mask = coverage[cam_index]
        if mask.any() and not mask.all():
            ax.contour(h_centres, v_centres, _image(view, mask).astype(np.float64), levels=[0.5], colors=[colour], linewidths=1.0)
    if rig.bev.region is not None:
        _draw_region(ax, rig, h_centres, v_centres)
    h_spec, v_spec = _axis_spec(rig, view.across), _axis_spec(rig, view.up)
    if half_m is None:
        ax.set_xlim(*_limits(h_spec, view.right_sign))
        ax.set_ylim(*_limits(v_spec, view.up_sign))
        ax.set_xlabel(view.label(view.across))
        ax.set_ylabel(view.label(view.up))
        arrow_m = ARROW_FRACTION * max(rig.bev.x.max - rig.bev.x.min, rig.bev.y.max - rig.bev.y.min)
    else:
        centre = bev_from_ego_matrix(rig)[:3, 3]  # the ego origin in the BEV frame
        h0, v0 = view.hv(centre)
        ax.set_xlim(h0 - view.right_sign * half_m, h0 + view.right_sign * half_m)
        ax.set_ylim(v0 - view.up_sign * half_m, v0 + view.up_sign * half_m)
        arrow_m = 0.3 * half_m

    from matplotlib.patches import Rectangle

    if half_m is None:  # where the inset zooms in (the ego is small at the BEV's scale)
        h_ego, v_ego = view.hv(bev_from_ego_matrix(rig)[:3, 3])  # the ego origin in the BEV frame
        ax.add_patch(
            Rectangle(
                (h_ego - INSET_HALF_M, v_ego - INSET_HALF_M), 2 * INSET_HALF_M, 2 * INSET_HALF_M,
                facecolor="none", edgecolor="black", linewidth=1.0, linestyle="--", zorder=5,
            )
        )

    poses = [bev_from_cam_matrix(rig, cam) for cam in rig.cameras]
    positions = np.array([pose[:3, 3] for pose in poses], dtype=np.float64)
    hv = np.array([view.hv(p) for p in positions])
    lo = hv.min(axis=0) - EGO_MARGIN_M
    hi = hv.max(axis=0) + EGO_MARGIN_M
    ax.add_patch(
        Rectangle((lo[0], lo[1]), hi[0] - lo[0], hi[1] - lo[1], facecolor="white", edgecolor="black", linewidth=1.2, zorder=3)
    )
    for pose, colour, (h0, v0) in zip(poses, colours, hv, strict=True):
        axis_h, axis_v = view.hv(pose[:3, 2])
        norm = float(np.hypot(axis_h, axis_v))
        ax.plot([h0], [v0], marker="o", markersize=5, color=colour, markeredgecolor="black", zorder=7)
        if norm > 1e-9:
            dh, dv = axis_h / norm * arrow_m, axis_v / norm * arrow_m
            ax.annotate(
                "",
                xy=(h0 + dh, v0 + dv),
                xytext=(h0, v0),
                arrowprops={"arrowstyle": "-|>", "color": "black", "linewidth": 1.3, "shrinkA": 0, "shrinkB": 0},
                zorder=6,
            )


def _region_valid_on_grid(store: Any, reader: Any, grid_name: str, valid: np.ndarray, expected: tuple[int, int, int, int]) -> np.ndarray:
    """A region store's ``grid/valid`` ``(n_cam, n_h, n_kept)`` on the fine grid ``expected``
    through ``grid/expand``: each fine cell shows its (super-)cell's flag (sampled at the
    super-cell's centre), cells outside the region are not covered."""
    expand = reader.read(grid_name, "expand")
    n_kept = valid.shape[-1] if valid.ndim == 3 else -1
    if valid.dtype != np.bool_ or valid.shape[:2] != expected[:2] or expand.shape != (expected[2] * expected[3],) or (expand.size and (int(expand.min()) < 0 or int(expand.max()) > n_kept)):
        raise StoreError(f"{store}: {grid_name}/valid {valid.dtype}{list(valid.shape)} and {grid_name}/expand {list(expand.shape)} are not a region's kept cells; run bevcompile inspect")
    padded = np.concatenate([valid, np.zeros((*valid.shape[:2], 1), dtype=bool)], axis=-1)
    return padded[:, :, np.asarray(expand, dtype=np.int64)].reshape(expected)


def _draw_region(ax: Any, rig: RigConfig, h_centres: np.ndarray, v_centres: np.ndarray) -> None:
    """``bev.region``: the kept region's outline (black, solid) and the boundaries of the rings'
    super-cells inside it (black, dash-dot: where the cell side grows to 2, 4, ... fine cells), both
    from the region's cell table (:func:`bevcompile.rig.region.region_table`), i.e. as built."""
    view = bev_view(rig)
    table = region_table(rig.bev)
    sizes = np.r_[table.cells[:, 2], 0][table.expand.astype(np.int64)].reshape(rig.bev.ny, rig.bev.nx).astype(np.float64)
    kept = sizes > 0
    if kept.any() and not kept.all():
        ax.contour(h_centres, v_centres, _image(view, kept.astype(np.float64)), levels=[0.5], colors=["black"], linewidths=1.6, linestyles="solid", zorder=4)
    levels = [s - 0.5 for s in sorted({int(v) for v in np.unique(sizes)} - {0, 1})]
    if levels:
        ax.contour(h_centres, v_centres, _image(view, np.where(kept, sizes, 1.0)), levels=levels, colors=["black"], linewidths=1.2, linestyles="dashdot", zorder=4)


def _legend_handles(rig: RigConfig, coverage: np.ndarray, colours: list[tuple[float, float, float]]) -> list[Any]:
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles: list[Any] = [
        Patch(facecolor=colour, edgecolor="black", label=f"{cam.name} ({100 * float(coverage[i].mean()):.1f} %)")
        for i, (cam, colour) in enumerate(zip(rig.cameras, colours, strict=True))
    ]
    handles.append(Patch(facecolor=UNSEEN_RGB, edgecolor="black", label="seen by no camera"))
    if len(colours) >= 2:
        handles.append(Patch(facecolor=colours[0], edgecolor=colours[1], hatch="////", label="overlap: stripes of the cameras' colours"))
    handles.append(Patch(facecolor="white", edgecolor="black", label=f"ego (nominal: cameras + {EGO_MARGIN_M:g} m)"))
    handles.append(Patch(facecolor="none", edgecolor="black", linestyle="--", label=f"inset: the ego area, +-{INSET_HALF_M:g} m"))
    handles.append(
        Line2D([], [], color="black", marker="o", markerfacecolor="white", markersize=5, linewidth=1.3, label="camera + optical axis (on ground)")
    )
    return handles


def _draw_learned(fig: Any, cax: Any, rig: RigConfig, delta: np.ndarray, colours: list[tuple[float, float, float]]) -> None:
    """One map per camera of ``delta`` ``(n_cam, ny, nx)`` in the right panel, shared symmetric scale."""
    view = bev_view(rig)
    left, bottom, width, height = PANEL2_AXES_RECT
    cols = 1 if rig.n_cam <= 2 else 2
    rows = -(-rig.n_cam // cols)
    limit = float(np.abs(delta).max()) if delta.size and np.abs(delta).max() > 0 else 1.0
    image = None
    for cam, name in enumerate(rig.camera_names):
        r, c = divmod(cam, cols)
        ax = fig.add_axes((left + c * width / cols, bottom + (rows - 1 - r) * height / rows, width / cols * 0.92, height / rows * 0.82))
        image = ax.imshow(_image(view, delta[cam]), origin="lower", extent=_extent(rig, view), interpolation="nearest",
                          aspect="equal", cmap="RdBu_r", vmin=-limit, vmax=limit)
        ax.set_xlim(*_limits(_axis_spec(rig, view.across), view.right_sign))
        ax.set_ylim(*_limits(_axis_spec(rig, view.up), view.up_sign))
        ax.set_title(name, fontsize=8, color=colours[cam])
        ax.tick_params(labelsize=6)
    if image is not None:
        colorbar = fig.colorbar(image, cax=cax)
        colorbar.set_label("learned - init mass per cell")


def _draw_values(
    fig: Any, ax: Any, cax: Any, rig: RigConfig, values: np.ndarray, title: str, label: str, *, integer: bool, seen: np.ndarray
) -> None:
    """``values`` ``(ny, nx)`` in viridis; a cell with no value is white where a camera sees it
    (``seen``, ``(ny, nx)`` bool: in view, but no weight lands there) and :data:`UNSEEN_RGB` where none does."""
    view = bev_view(rig)
    background = np.where(_image(view, seen)[..., None], np.ones(3), np.asarray(UNSEEN_RGB))  # image rows x columns x 3
    ax.imshow(background, origin="lower", extent=_extent(rig, view), interpolation="nearest", aspect="equal")
    image_values = _image(view, values)
    shown = np.ma.masked_where(image_values <= 0, image_values)
    vmax = float(values.max()) if values.size and values.max() > 0 else 1.0
    image = ax.imshow(
        shown,
        origin="lower",
        extent=_extent(rig, view),
        interpolation="nearest",
        aspect="equal",
        cmap="viridis",
        vmin=0.0,
        vmax=vmax,
    )
    ax.set_xlim(*_limits(_axis_spec(rig, view.across), view.right_sign))
    ax.set_ylim(*_limits(_axis_spec(rig, view.up), view.up_sign))
    ax.set_xlabel(view.label(view.across))
    ax.set_ylabel("ego x [m]  (forward UP)" if view.frame == "ego" else view.label(view.up))
    ax.set_title(title, fontsize=10)
    colorbar = fig.colorbar(image, cax=cax)
    colorbar.set_label(label)
    from matplotlib.patches import Patch

    ax.legend(
        handles=[
            Patch(facecolor="white", edgecolor="black", label="in view, no weight"),
            Patch(facecolor=UNSEEN_RGB, edgecolor="black", label="seen by no camera"),
        ],
        loc="upper center", bbox_to_anchor=(0.5, -0.09), ncol=2, fontsize=8, frameon=False,
    )
    if integer:
        colorbar.set_ticks(list(range(int(vmax) + 1)))
