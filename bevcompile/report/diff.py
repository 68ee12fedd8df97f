"""``bevcompile diff``: what a calibration change does to the tables of a store.

Compares two stores of the SAME layout (same cameras in the same order, feature map, BEV
x/y grid, sampling heights and ``grid`` ``align_corners``) — typically the nominal store the
model was validated with and the store of one car's (re)calibration — and measures how far the
tables moved:

* config changes by field path (``cameras[2].translation``, ``image_aug.crop``, ...) and, per
  camera, the pose change (rotation angle of ``R_old^T R_new`` in degrees, translation change in
  millimetres);
* ``grid/``: per camera and height, cells valid in both / only old / only new; over cells
  valid in both, the sampling-position shift in feature pixels (from the stored float32
  ``grid/coords``) and the fraction of cells whose nearest feature pixel changes;
* the output change of ``grid_sample`` (numpy reference) on seeded random features;
* ``matrix/`` (when both stores have one with the same build options): nnz, changed rows and
  the output change of the COO product on the same seeded features. ``bev.region`` stores: with
  the same region (equal ``matrix/cells``) row by row over the kept (super-)cells; with different
  regions, or a region against the full grid, on the dense ``(ny, nx)`` map the head sees (each
  fine cell reads its row through ``matrix/expand``, 0 outside the region), and changed rows are
  not counted (the rows are not the same cells); a note says which.

Stores are read only through :func:`bevcompile.load` (content hashes verified). Pure: nothing
here prints. Memory is bounded per camera (and per chunk of matrix entries), so a 200x200 BEV,
6 cameras, 4 heights and 640x360 feature maps fit comfortably.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from ..errors import StoreError, UsageError
from ..grid.reference import grid_sample
from ..rig.config import RigConfig, config_to_dict
from ..rig.geometry import bev_from_cam_matrix
from ..rig.presets import plain_data
from ..store.loader import LoadedStore, load, matrix_layout
from ..store.plugins import psnr_db
from ..store.verify import DEFAULT_CHANNELS, check_feature_options, random_depth_probs

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]

SHIFT_SOURCE = "grid/coords (float32), Euclidean (u, v) distance in feature pixels over cells valid in both stores"
NEAREST_PIXEL_RULE = "nearest feature pixel (floor(u + 0.5), floor(v + 0.5)) of grid/coords differs"
SHIFT_PERCENTILE = 99.0
FEATURE_PEAK = 1.0
MATRIX_CHUNK_ENTRIES = 1 << 18
"""Matrix entries lifted at once (bounds the ``(chunk, C)`` float64 working set)."""
AUG_FIELDS = ("resize", "crop", "input_size", "pad")


# --------------------------------------------------------------------------------------
# report dataclasses
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ConfigChange:
    """One changed config field: ``field`` is a path like config error paths
    (``cameras[2].translation``; ``image_aug.crop`` when every camera changed the same way);
    ``old``/``new`` are the resolved values (``None`` = absent on that side)."""

    field: str
    old: Any
    new: Any

    def to_json(self) -> dict[str, Any]:
        return {"field": self.field, "old": self.old, "new": self.new}


@dataclass(frozen=True)
class ShiftStats:
    """Sampling-position change of one camera at one height (or over all its heights).

    Convention:
        cells are BEV cells ``(ih, iy, ix)``; ``n_cells`` = cells of the BEV grid considered
        (``ny * nx`` per height). ``cells_both`` / ``cells_only_old`` / ``cells_only_new`` count
        ``grid/valid`` in both / only the old / only the new store. ``shift_*_px`` are over
        cells valid in both: ``hypot(u_new - u_old, v_new - v_old)`` in feature pixels from the
        float32 ``grid/coords`` (None when no cell is valid in both); ``shift_p99_px`` is the
        99th percentile (numpy linear interpolation). ``nearest_pixel_changed`` counts cells
        valid in both whose nearest feature pixel ``(floor(u + 0.5), floor(v + 0.5))`` differs.
        ``max_shift_cell`` = ``(ih, iy, ix)`` of the largest shift (the first in row-major order
        on ties) and ``max_shift_cell_ego_m`` its centre ``(x, y, z)`` in ego metres (None when
        no cell valid in both moved). A non-finite ``grid/coords`` value at a cell valid in both
        makes the shift figures non-finite (NaN is never dropped): ``shift_max_px`` is then NaN
        (or inf) and ``max_shift_cell`` the first such cell.
    """

    n_cells: int
    cells_both: int
    cells_only_old: int
    cells_only_new: int
    shift_max_px: float | None
    shift_mean_px: float | None
    shift_p99_px: float | None
    nearest_pixel_changed: int
    max_shift_cell: tuple[int, int, int] | None
    max_shift_cell_ego_m: tuple[float, float, float] | None

    @property
    def lost_fraction(self) -> float:
        """Cells only the old store sees, as a fraction of the BEV cells (coverage lost)."""
        return self.cells_only_old / self.n_cells if self.n_cells else 0.0

    @property
    def gained_fraction(self) -> float:
        """Cells only the new store sees, as a fraction of the BEV cells (coverage gained)."""
        return self.cells_only_new / self.n_cells if self.n_cells else 0.0

    @property
    def nearest_pixel_changed_fraction(self) -> float | None:
        return self.nearest_pixel_changed / self.cells_both if self.cells_both else None

    def to_json(self) -> dict[str, Any]:
        return {
            "n_cells": self.n_cells,
            "cells_both": self.cells_both,
            "cells_only_old": self.cells_only_old,
            "cells_only_new": self.cells_only_new,
            "lost_fraction": self.lost_fraction,
            "gained_fraction": self.gained_fraction,
            "shift_max_px": self.shift_max_px,
            "shift_mean_px": self.shift_mean_px,
            "shift_p99_px": self.shift_p99_px,
            "nearest_pixel_changed": self.nearest_pixel_changed,
            "nearest_pixel_changed_fraction": self.nearest_pixel_changed_fraction,
            "max_shift_cell": list(self.max_shift_cell) if self.max_shift_cell is not None else None,
            "max_shift_cell_ego_m": list(self.max_shift_cell_ego_m) if self.max_shift_cell_ego_m is not None else None,
        }


@dataclass(frozen=True)
class CameraDiff:
    """One camera: pose change, grid change over all heights (``total``) and per height.

    Convention:
        ``rotation_deg``: angle of ``R_old^T R_new`` (camera -> BEV frame rotations, ``bev_from_cam``;
        camera -> ego with ``bev.frame: ego``), degrees.
        ``translation_mm``: ``|t_new - t_old|``; ``translation_delta_mm``: ``t_new - t_old``
        in the BEV frame (ego: x forward, y left, z up), millimetres. ``heights`` pairs each
        sampling height (m) with its :class:`ShiftStats`. ``failures``: gate figures this
        camera exceeds (empty = passed or no gate).
    """

    camera: str
    rotation_deg: float
    translation_mm: float
    translation_delta_mm: tuple[float, float, float]
    total: ShiftStats
    heights: tuple[tuple[float, ShiftStats], ...]
    failures: tuple[str, ...] = ()

    @property
    def passed(self) -> bool:
        return not self.failures

    def to_json(self) -> dict[str, Any]:
        return {
            "camera": self.camera,
            "rotation_deg": self.rotation_deg,
            "translation_mm": self.translation_mm,
            "translation_delta_mm": list(self.translation_delta_mm),
            **self.total.to_json(),
            "per_height": [{"height_m": h, **stats.to_json()} for h, stats in self.heights],
            "passed": self.passed,
            "failures": list(self.failures),
        }


@dataclass(frozen=True)
class OutputChange:
    """New vs old output on the same seeded features.

    Convention: ``max_abs``/``mean_abs`` over every BEV cell and channel; ``psnr_db`` =
    ``10 log10(peak^2 / MSE)`` (``inf`` for identical outputs; JSON ``null``); ``label`` names
    the height (``z=0 m``) or the product. Grid rows also split off the cells whose set of
    seeing cameras changed (a camera gained or lost the cell: its sample goes from 0 to a value):
    ``cells_coverage_changed`` counts them and ``max_abs_same_coverage`` is the max over the
    other cells (the interpolation change alone; None for the matrix or when no cell is left).
    """

    label: str
    max_abs: float
    mean_abs: float
    psnr_db: float
    peak: float
    cells_coverage_changed: int | None = None
    max_abs_same_coverage: float | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "label": self.label,
            "max_abs": self.max_abs,
            "mean_abs": self.mean_abs,
            "psnr_db": self.psnr_db if math.isfinite(self.psnr_db) else None,
            "psnr_peak": self.peak,
        }
        if self.cells_coverage_changed is not None:
            out["cells_coverage_changed"] = self.cells_coverage_changed
            out["max_abs_same_coverage"] = self.max_abs_same_coverage
        return out


@dataclass(frozen=True)
class MatrixDiff:
    """``matrix/`` of both stores (same build options).

    Convention: rows are BEV cells (``row_ids`` resolved). ``rows_entry_set_changed``: cells
    whose set of columns differs; ``rows_changed``: cells whose entries or weights differ.
    ``output``: the COO product of each store on the same seeded features (frustum mode:
    ``X[col, c] = depth_probs[cam, d, v, u] * features[cam, c, v, u]``), float64; PSNR peak =
    the range (max - min) of the old output, as in ``bevcompile verify``.
    ``compared`` (:data:`MATRIX_COMPARED`): ``cells`` (full grids: the rows are the BEV cells),
    ``region rows`` (the same ``bev.region``: the ``n_rows`` rows are its kept (super-)cells and
    the zero row) or ``dense map`` (different regions, or a region vs the full grid: the output on
    the ``ny * nx`` fine cells through ``matrix/expand``; the row counts are None); ``n_rows`` the
    rows counted (BEV cells, the region's ``n_kept`` (super-)cells, or the ``ny * nx`` cells).
    """

    mode: str
    build_options: dict[str, Any]
    nnz_old: int
    nnz_new: int
    n_rows: int
    rows_entry_set_changed: int | None  # None: not counted (keys would overflow int64)
    rows_changed: int | None
    output: OutputChange
    compared: str = "cells"

    def to_json(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "compared": self.compared,
            "build_options": self.build_options,
            "nnz_old": self.nnz_old,
            "nnz_new": self.nnz_new,
            "n_rows": self.n_rows,
            "rows_entry_set_changed": self.rows_entry_set_changed,
            "rows_changed": self.rows_changed,
            "output": self.output.to_json(),
        }


@dataclass
class StoreDiff:
    """Everything :func:`diff_stores` measured (``to_json()`` for scripts)."""

    old: str
    new: str
    old_name: str
    new_name: str
    old_config_sha256: str
    new_config_sha256: str
    seed: int
    channels: int
    align_corners: bool
    feature_size: tuple[int, int]
    heights: tuple[float, ...]
    config_changes: list[ConfigChange]
    cameras: list[CameraDiff]
    output: list[OutputChange]
    matrix: MatrixDiff | None
    max_shift_px: float | None = None
    max_coverage_change: float | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def gated(self) -> bool:
        return self.max_shift_px is not None or self.max_coverage_change is not None

    @property
    def passed(self) -> bool:
        """False when any camera exceeds a gate (always True without a gate)."""
        return all(c.passed for c in self.cameras)

    @property
    def failing_cameras(self) -> list[CameraDiff]:
        return [c for c in self.cameras if not c.passed]

    def failure_lines(self) -> list[str]:
        """One line per failing camera: ``<new store>: <camera>: <figure> > <gate>[; ...] (vs <old store>)``."""
        return [f"{self.new}: {c.camera}: {'; '.join(c.failures)} (vs {self.old})" for c in self.failing_cameras]

    def to_json(self) -> dict[str, Any]:
        return {
            "old": self.old,
            "new": self.new,
            "old_name": self.old_name,
            "new_name": self.new_name,
            "old_config_sha256": self.old_config_sha256,
            "new_config_sha256": self.new_config_sha256,
            "same_config": self.old_config_sha256 == self.new_config_sha256,
            "seed": self.seed,
            "channels": self.channels,
            "feature_peak": FEATURE_PEAK,
            "align_corners": self.align_corners,
            "feature_size": list(self.feature_size),
            "heights": list(self.heights),
            "shift_source": SHIFT_SOURCE,
            "nearest_pixel_rule": NEAREST_PIXEL_RULE,
            "coverage_fraction_of": "BEV cells of the camera (n_heights * ny * nx)",
            "config_changes": [c.to_json() for c in self.config_changes],
            "cameras": [c.to_json() for c in self.cameras],
            "output": [o.to_json() for o in self.output],
            "output_rule": (
                "sum over cameras of the numpy reference grid_sample (bilinear, zeros padding, the stores' "
                "align_corners) on each store's grid/norm, per height; features uniform [0, 1), PSNR peak 1"
            ),
            "matrix": self.matrix.to_json() if self.matrix is not None else None,
            "gate": {"max_shift_px": self.max_shift_px, "max_coverage_change": self.max_coverage_change},
            "passed": self.passed,
            "failures": self.failure_lines(),
            "notes": list(self.notes),
        }


# --------------------------------------------------------------------------------------
# config and pose
# --------------------------------------------------------------------------------------


def _leaf_changes(old: Any, new: Any, path: str) -> Iterator[ConfigChange]:
    """Recurse into mappings and into lists of mappings (cameras); anything else is a leaf."""
    if isinstance(old, Mapping) and isinstance(new, Mapping):
        for key in list(old) + [k for k in new if k not in old]:
            sub = f"{path}.{key}" if path else str(key)
            if key not in new:
                yield ConfigChange(sub, old[key], None)
            elif key not in old:
                yield ConfigChange(sub, None, new[key])
            else:
                yield from _leaf_changes(old[key], new[key], sub)
        return
    if (
        isinstance(old, list)
        and isinstance(new, list)
        and len(old) == len(new)
        and old
        and all(isinstance(v, Mapping) for v in old + new)
    ):
        for i, (a, b) in enumerate(zip(old, new, strict=True)):
            yield from _leaf_changes(a, b, f"{path}[{i}]")
        return
    if old != new:
        yield ConfigChange(path, old, new)


def config_changes(old: RigConfig, new: RigConfig) -> list[ConfigChange]:
    """Changed fields of the resolved configs (descriptions ignored, as in ``config_sha256``).

    Convention: paths as in config errors (``cameras[2].translation``, ``cameras[0].intrinsic``,
    ``bev.z``); a per-camera ``image_aug`` field that changed identically for every camera is
    reported once as ``image_aug.<field>``. Values are the resolved config values.
    """
    changes = list(_leaf_changes(config_to_dict(old, descriptions=False), config_to_dict(new, descriptions=False), ""))
    if old.n_cam != new.n_cam or old.n_cam < 2:
        return changes
    drop: set[int] = set()
    shared: list[ConfigChange] = []
    for aug in AUG_FIELDS:
        pattern = re.compile(rf"^cameras\[\d+\]\.image_aug\.{aug}$")
        hits = [i for i, c in enumerate(changes) if pattern.match(c.field)]
        first = changes[hits[0]] if hits else None
        if first is not None and len(hits) == old.n_cam and all((changes[i].old, changes[i].new) == (first.old, first.new) for i in hits):
            shared.append(ConfigChange(f"image_aug.{aug}", first.old, first.new))
            drop.update(hits)
    kept = [c for i, c in enumerate(changes) if i not in drop]
    # where the YAML has it: after the cameras, before feature/bev/depth
    at = max((i + 1 for i, c in enumerate(kept) if c.field.startswith(("name", "cameras["))), default=0)
    return kept[:at] + shared + kept[at:]


def rotation_angle_deg(rotation_old: npt.ArrayLike, rotation_new: npt.ArrayLike) -> float:
    """Angle of ``R_old^T R_new`` in degrees, ``atan2(|axis|, trace - 1)`` (accurate for small angles).

    Convention: both ``(3, 3)`` rotations (camera -> ego); result in ``[0, 180]``.
    """
    r = np.asarray(rotation_old, dtype=np.float64).T @ np.asarray(rotation_new, dtype=np.float64)
    axis = np.array([r[2, 1] - r[1, 2], r[0, 2] - r[2, 0], r[1, 0] - r[0, 1]])
    return math.degrees(math.atan2(float(np.linalg.norm(axis)), float(np.trace(r)) - 1.0))


def pose_change(old: RigConfig, new: RigConfig, index: int) -> tuple[float, float, tuple[float, float, float]]:
    """``(rotation_deg, translation_mm, translation_delta_mm)`` of camera ``index`` (see :class:`CameraDiff`),
    of its pose in the BEV frame (``bev_from_cam``: with ``bev.frame`` a sensor, a recalibrated
    sensor moves every camera's pose, as it moves the tables)."""
    a = bev_from_cam_matrix(old, old.cameras[index])
    b = bev_from_cam_matrix(new, new.cameras[index])
    delta_mm = (b[:3, 3] - a[:3, 3]) * 1000.0
    return (
        rotation_angle_deg(a[:3, :3], b[:3, :3]),
        float(np.linalg.norm(delta_mm)),
        (float(delta_mm[0]), float(delta_mm[1]), float(delta_mm[2])),
    )


# --------------------------------------------------------------------------------------
# comparability
# --------------------------------------------------------------------------------------


def _axis(spec: Any) -> list[float]:
    return [spec.min, spec.max, spec.step]


def grid_align_corners(store: LoadedStore) -> bool:
    """The ``align_corners`` recorded in ``grid/`` (StoreError if absent)."""
    attrs = store["grid"].attrs
    options = attrs.get("build_options")
    value = options.get("align_corners") if isinstance(options, Mapping) else None
    if value is None:
        value = attrs.get("align_corners")
    if not isinstance(value, bool):
        raise StoreError(f"{store.path}: grid/ records no align_corners (build_options.align_corners)")
    return value


def check_comparable(old: LoadedStore, new: LoadedStore) -> None:
    """Raise :class:`UsageError` ``cannot compare: <first difference>`` unless both stores
    have the same cameras (names, order), feature map, BEV frame, BEV x/y grid, heights and grid
    ``align_corners``."""
    a, b = old.rig, new.rig
    names_a, names_b = a.camera_names, b.camera_names
    for i in range(min(len(names_a), len(names_b))):
        if names_a[i] != names_b[i]:
            raise UsageError(f"cannot compare: cameras[{i}] is {names_a[i]} vs {names_b[i]} (same cameras in the same order needed)")
    if len(names_a) != len(names_b):
        i = min(len(names_a), len(names_b))
        side, name = ("OLD", names_a[i]) if len(names_a) > i else ("NEW", names_b[i])
        raise UsageError(f"cannot compare: {len(names_a)} cameras vs {len(names_b)} cameras (cameras[{i}] {name} only in {side})")
    (wa, ha), (wb, hb) = a.feature_size, b.feature_size
    if (wa, ha) != (wb, hb):
        raise UsageError(f"cannot compare: feature map {wa}x{ha} vs {wb}x{hb}")
    if a.bev.frame != b.bev.frame:
        raise UsageError(f"cannot compare: BEV frame {a.bev.frame} vs {b.bev.frame} (the cells are not the same places)")
    for axis in ("x", "y"):
        spec_a, spec_b = getattr(a.bev, axis), getattr(b.bev, axis)
        if _axis(spec_a) != _axis(spec_b):
            raise UsageError(f"cannot compare: BEV {axis} grid {_axis(spec_a)} vs {_axis(spec_b)}")
    if list(a.bev.heights) != list(b.bev.heights):
        raise UsageError(f"cannot compare: BEV heights {list(a.bev.heights)} vs {list(b.bev.heights)}")
    ac_a, ac_b = grid_align_corners(old), grid_align_corners(new)
    if ac_a != ac_b:
        raise UsageError(f"cannot compare: grid align_corners {ac_a} vs {ac_b}")


GridArrays = tuple[npt.NDArray[np.float32], npt.NDArray[np.bool_], npt.NDArray[np.float32]]

REGION_COMPARED = (
    "bev.region: compared the (super-)cells both stores sample at the same place, i.e. equal (iy, ix, size) "
    "(a store without a region samples every fine cell, size 1)"
)


def _region_cells(store: LoadedStore) -> npt.NDArray[np.int64] | None:
    """``grid/cells`` ``(n_kept, 3)`` of a ``bev.region`` store (StoreError if malformed); None without a region."""
    group = store["grid"]
    if store.rig.bev.region is None:
        return None
    if "cells" not in group:
        raise StoreError(f"{store.path}: grid/ of a bev.region store has no cells; rebuild it with `bevcompile grid`")
    cells = np.asarray(group["cells"], dtype=np.int64)
    if cells.ndim != 2 or cells.shape[1] != 3:
        raise StoreError(f"{store.path}: grid/cells has shape {cells.shape}; expected (n_kept, 3)")
    return cells


def compared_grid_arrays(old: LoadedStore, new: LoadedStore, notes: list[str] | None = None) -> tuple[GridArrays, GridArrays, npt.NDArray[np.int64] | None]:
    """``(coords, valid, norm)`` of both stores on the cells they both sample.

    Two stores without a region: the stored ``(n_cam, n_h, ny, nx[, 2])`` arrays as they are. With
    a ``bev.region`` on either side (:data:`REGION_COMPARED`): the cells with equal ``(iy, ix, size)``
    in both (a full store's cell ``(iy, ix)`` is ``(iy, ix, 1)``), in increasing ``iy * nx + ix``, as
    ``(n_cam, n_h, 1, n_common[, 2])``, and their ``(iy, ix, size)`` ``(n_common, 3)`` (None without a
    region); ``notes`` gets a line with the counts."""
    cells_old, cells_new = _region_cells(old), _region_cells(new)
    if cells_old is None and cells_new is None:
        return _grid_arrays(old), _grid_arrays(new), None
    ny, nx = old.rig.bev.ny, old.rig.bev.nx

    def table(cells: npt.NDArray[np.int64] | None) -> npt.NDArray[np.int64]:
        if cells is not None:
            return cells
        iy, ix = np.divmod(np.arange(ny * nx, dtype=np.int64), nx)
        return np.stack([iy, ix, np.ones_like(iy)], axis=1)

    t_old, t_new = table(cells_old), table(cells_new)
    key_old = (t_old[:, 0] * nx + t_old[:, 1]) * (max(ny, nx) + 1) + t_old[:, 2]
    key_new = (t_new[:, 0] * nx + t_new[:, 1]) * (max(ny, nx) + 1) + t_new[:, 2]
    _, pick_old, pick_new = np.intersect1d(key_old, key_new, assume_unique=True, return_indices=True)
    out: list[GridArrays] = []
    for store, cells, pick in ((old, cells_old, pick_old), (new, cells_new, pick_new)):
        coords, valid, norm = _grid_arrays(store, None if cells is None else int(cells.shape[0]))

        def common(a: np.ndarray, cells: npt.NDArray[np.int64] | None = cells, pick: npt.NDArray[np.intp] = pick) -> np.ndarray:
            flat = a.reshape(*a.shape[:2], -1, *a.shape[4 if cells is None else 3 :])
            return flat[:, :, pick][:, :, None]

        out.append((common(coords), common(valid), common(norm)))
    if notes is not None:
        notes.append(f"{REGION_COMPARED}: {pick_old.size} cells in both (OLD samples {t_old.shape[0]}, NEW {t_new.shape[0]})")
    return out[0], out[1], t_old[pick_old]


def _grid_arrays(store: LoadedStore, n_kept: int | None = None) -> GridArrays:
    """``grid/coords``, ``grid/valid``, ``grid/norm`` with the shapes the rig implies (StoreError otherwise);
    ``n_kept``: a region store's kept cells, ``(n_cam, n_h, n_kept[, 2])``."""
    group = store["grid"]
    rig = store.rig
    shape: tuple[int, ...] = (rig.n_cam, len(rig.bev.heights), rig.bev.ny, rig.bev.nx) if n_kept is None else (rig.n_cam, len(rig.bev.heights), n_kept)
    coords, valid, norm = group["coords"], group["valid"], group["norm"]
    for name, array, want in (("coords", coords, (*shape, 2)), ("valid", valid, shape), ("norm", norm, (*shape, 2))):
        if array.shape != want:
            raise StoreError(f"{store.path}: grid/{name} has shape {array.shape}; the stored config implies {want}")
    return coords, valid.astype(bool, copy=False), norm


# --------------------------------------------------------------------------------------
# grid shift
# --------------------------------------------------------------------------------------


def sampling_shift_px(
    coords_old: npt.ArrayLike, valid_old: npt.ArrayLike, coords_new: npt.ArrayLike, valid_new: npt.ArrayLike
) -> F64:
    """Per-cell sampling-position shift.

    Convention:
        coords ``(..., 2)`` ``(u, v)`` feature pixels (the stored float32 ``grid/coords``),
        valid ``(...)`` bool. returns float64 ``(...)``: ``hypot(u_new - u_old, v_new - v_old)``
        computed in float64 from the given values; NaN where the cell is not valid in both.
    """
    old = np.asarray(coords_old, dtype=np.float64)
    new = np.asarray(coords_new, dtype=np.float64)
    both = np.asarray(valid_old, dtype=bool) & np.asarray(valid_new, dtype=bool)
    shift = np.hypot(new[..., 0] - old[..., 0], new[..., 1] - old[..., 1])
    return np.where(both, shift, np.nan)


def _nearest_changed(coords_old: F64, coords_new: F64) -> npt.NDArray[np.bool_]:
    """``(n, 2)`` float64 pairs -> bool ``(n,)``: nearest feature pixel differs."""
    return np.any(np.floor(coords_old + 0.5) != np.floor(coords_new + 0.5), axis=-1)


def _shift_stats(
    rig: RigConfig,
    coords_old: npt.NDArray[np.float32],
    valid_old: npt.NDArray[np.bool_],
    coords_new: npt.NDArray[np.float32],
    valid_new: npt.NDArray[np.bool_],
    height_indices: Sequence[int],
    cells: npt.NDArray[np.int64] | None = None,
) -> ShiftStats:
    """Stats of one camera over ``height_indices`` (``coords_*`` ``(n_h, ny, nx, 2)``, ``valid_*`` ``(n_h, ny, nx)``;
    with ``cells`` (bev.region, :func:`compared_grid_arrays`) ``(n_h, 1, n_common)`` whose cell ``k`` is
    ``cells[k] = (iy, ix, size)``: the max-shift cell is then its first fine cell and its centre the (super-)cell's)."""
    idx = np.asarray(height_indices, dtype=np.int64)
    vo, vn = valid_old[idx], valid_new[idx]
    both = vo & vn
    n_both = int(np.count_nonzero(both))
    only_old = int(np.count_nonzero(vo & ~vn))
    only_new = int(np.count_nonzero(vn & ~vo))
    n_cells = int(vo.size)
    if n_both == 0:
        return ShiftStats(n_cells, 0, only_old, only_new, None, None, None, 0, None, None)
    where = np.nonzero(both)
    co = np.asarray(coords_old[idx][where], dtype=np.float64)
    cn = np.asarray(coords_new[idx][where], dtype=np.float64)
    shift = np.hypot(cn[:, 0] - co[:, 0], cn[:, 1] - co[:, 1])
    k = int(np.argmax(shift))  # the first NaN when there is one (numpy's max propagates NaN)
    cell: tuple[int, int, int] | None = None
    centre: tuple[float, float, float] | None = None
    if not shift[k] <= 0:  # moved, or not finite
        ih, iy, ix = int(idx[where[0][k]]), int(where[1][k]), int(where[2][k])
        bev = rig.bev
        half = 0.5
        if cells is not None:
            iy, ix, size = (int(v) for v in cells[ix])
            half = size / 2
        cell = (ih, iy, ix)
        centre = (bev.x.min + (ix + half) * bev.x.step, bev.y.min + (iy + half) * bev.y.step, float(bev.heights[ih]))
    return ShiftStats(
        n_cells=n_cells,
        cells_both=n_both,
        cells_only_old=only_old,
        cells_only_new=only_new,
        shift_max_px=float(shift[k]),
        shift_mean_px=float(shift.mean()),
        shift_p99_px=float(np.percentile(shift, SHIFT_PERCENTILE)),
        nearest_pixel_changed=int(np.count_nonzero(_nearest_changed(co, cn))),
        max_shift_cell=cell,
        max_shift_cell_ego_m=centre,
    )


# --------------------------------------------------------------------------------------
# seeded inputs
# --------------------------------------------------------------------------------------


class SeededInputs:
    """The seeded inputs of ``bevcompile verify`` (:func:`bevcompile.store.verify.make_features`), drawn lazily.

    Convention:
        ``features`` ``(n_cam, C, H_f, W_f)`` float32 uniform ``[0, 1)`` from
        ``numpy.random.default_rng(seed)``, drawn first; :meth:`depth_probs` yields each camera's
        ``(D, H_f, W_f)`` float32 softmax over ``D`` of standard-normal logits
        (:func:`bevcompile.store.verify.random_depth_probs`) drawn next from the same generator,
        camera by camera — the same bytes as ``make_features``' ``depth_probs[cam]`` (the
        generator fills in C order), without holding every camera's depth at once.
    """

    def __init__(self, rig: RigConfig, channels: int, seed: int) -> None:
        check_feature_options(seed, channels)
        self.rig = rig
        w_f, h_f = rig.feature_size
        self._rng = np.random.default_rng(seed)
        self.features: npt.NDArray[np.float32] = self._rng.random((rig.n_cam, channels, h_f, w_f), dtype=np.float32)
        self._depth_drawn = False

    def depth_probs(self) -> Iterator[npt.NDArray[np.float32]]:
        """Each camera's depth probabilities in camera order (may be iterated once)."""
        if self._depth_drawn:
            raise RuntimeError("depth probabilities were already drawn")
        self._depth_drawn = True
        w_f, h_f = self.rig.feature_size
        for _ in range(self.rig.n_cam):
            # one camera's block of make_features' draw (the generator fills in C order)
            yield random_depth_probs(self._rng, (1, self.rig.depth.n_bins, h_f, w_f), axis=1)[0]


# --------------------------------------------------------------------------------------
# output change
# --------------------------------------------------------------------------------------


class _Accumulator:
    """Running max |d|, sum |d|, sum d^2 and count of a difference.

    A NaN anywhere makes every figure NaN (Python's ``max(0.0, nan)`` is 0.0: not used here).
    """

    def __init__(self) -> None:
        self.max_abs = 0.0
        self.sum_abs = 0.0
        self.sum_sq = 0.0
        self.count = 0

    def add(self, diff: F64) -> None:
        if diff.size == 0:
            return
        a = np.abs(diff)
        self.max_abs = float(np.maximum(self.max_abs, a.max()))  # np.maximum propagates NaN
        self.sum_abs += float(a.sum())
        self.sum_sq += float(np.square(diff).sum())
        self.count += int(diff.size)

    def result(self, label: str, peak: float) -> OutputChange:
        mean_abs = self.sum_abs / self.count if self.count else 0.0
        mse = self.sum_sq / self.count if self.count else 0.0
        with np.errstate(divide="ignore", invalid="ignore"):  # inf or NaN MSE: -inf or NaN dB, no warning
            return OutputChange(label, self.max_abs, mean_abs, psnr_db(mse, peak), peak)


def grid_output_change(
    features: npt.NDArray[np.floating[Any]],
    norm_old: npt.NDArray[np.floating[Any]],
    norm_new: npt.NDArray[np.floating[Any]],
    heights: Sequence[float],
    align_corners: bool,
    valid_old: npt.NDArray[np.bool_] | None = None,
    valid_new: npt.NDArray[np.bool_] | None = None,
) -> list[OutputChange]:
    """Per height, new vs old of ``sum_cam grid_sample(features[cam], norm[cam, h])``.

    Convention:
        features ``(n_cam, C, H_f, W_f)`` (uniform ``[0, 1)``: PSNR peak 1); norm_* the stored
        ``grid/norm`` ``(n_cam, n_h, ny, nx, 2)``; numpy reference ``grid_sample`` (bilinear,
        zeros padding, ``align_corners`` as recorded), float64. valid_* ``grid/valid``
        ``(n_cam, n_h, ny, nx)`` (optional) split off the cells whose camera set changed.
        One :class:`OutputChange` per height. A cell where any camera's ``norm`` (either store)
        is not finite gets a NaN output change (PyTorch's ``grid_sample`` propagates NaN; the
        numpy reference would sample 0 and hide it), so the figures of that height are NaN.
    """
    n_cam = features.shape[0]
    out: list[OutputChange] = []
    feats64 = [np.asarray(features[cam], dtype=np.float64)[None] for cam in range(n_cam)]
    for ih, height in enumerate(heights):
        total: F64 | None = None
        for cam in range(n_cam):
            for sign, norm in ((-1.0, norm_old), (1.0, norm_new)):
                sampled = grid_sample(feats64[cam], norm[cam, ih][None], align_corners=align_corners)[0]
                total = sign * sampled if total is None else total + sign * sampled
        if total is not None:
            broken = np.zeros(total.shape[1:], dtype=bool)  # (ny, nx)
            for norm in (norm_old, norm_new):
                broken |= ~np.all(np.isfinite(norm[:, ih]), axis=(0, -1))
            total[:, broken] = np.nan
        acc = _Accumulator()
        if total is not None:
            acc.add(total)
        result = acc.result(f"z={height:g} m", FEATURE_PEAK)
        if total is not None and valid_old is not None and valid_new is not None:
            changed = np.any(valid_old[:, ih] != valid_new[:, ih], axis=0)  # (ny, nx)
            rest = np.abs(total[:, ~changed])
            result = replace(
                result,
                cells_coverage_changed=int(np.count_nonzero(changed)),
                max_abs_same_coverage=float(rest.max()) if rest.size else None,
            )
        out.append(result)
    return out


# --------------------------------------------------------------------------------------
# matrix
# --------------------------------------------------------------------------------------


MATRIX_COMPARED = ("cells", "region rows", "dense map")
"""What :func:`matrix_diff` compares (:class:`MatrixDiff` ``compared``)."""


@dataclass(frozen=True)
class _Coo:
    cells: I64  # BEV cell of every entry (a bev.region store: its compact row)
    cols: I64
    values: npt.NDArray[np.float32]
    n_rows: int  # rows of cells (ny * nx, or a region's n_kept + 1)
    expand: I64 | None = None  # bev.region: (ny * nx,) row of every fine cell (n_kept: the zero row)
    region_cells: npt.NDArray[Any] | None = None  # bev.region: matrix/cells (n_kept, 3)


def _read_coo(store: LoadedStore) -> _Coo:
    """The COO entries with their BEV cells; :class:`StoreError` (one line naming the store and
    the array) unless they are 1-D of one length, in range, and strictly increasing in
    ``(row, col)`` (sorted, no duplicates), and ``row_ids`` (if any) strictly increasing."""
    group = store["matrix"]
    layout = matrix_layout(store)
    row = np.asarray(group["coo_row"], dtype=np.int64)
    col = np.asarray(group["coo_col"], dtype=np.int64)
    val = np.asarray(group["coo_val"])
    if not (row.ndim == col.ndim == val.ndim == 1 and row.size == col.size == val.size):
        raise StoreError(
            f"{store.path}: matrix/coo_row, coo_col, coo_val are inconsistent: shapes {row.shape}, {col.shape}, {val.shape} "
            "(one 1-D length needed)"
        )
    if row.size and (row.min() < 0 or row.max() >= layout.n_rows):
        raise StoreError(f"{store.path}: matrix/coo_row out of range [0, {layout.n_rows}) (min {row.min()}, max {row.max()})")
    if col.size and (col.min() < 0 or col.max() >= layout.n_cols):
        raise StoreError(f"{store.path}: matrix/coo_col out of range [0, {layout.n_cols}) (min {col.min()}, max {col.max()})")
    d_row, d_col = np.diff(row), np.diff(col)
    duplicate = (d_row == 0) & (d_col == 0)
    out_of_order = (d_row < 0) | ((d_row == 0) & (d_col < 0))
    if duplicate.any() or out_of_order.any():
        first = int(np.argmax(duplicate | out_of_order)) + 1
        raise StoreError(
            f"{store.path}: matrix/coo_row, coo_col: entries not sorted by (row, col) without duplicates: "
            f"{int(np.count_nonzero(duplicate))} duplicate(s), {int(np.count_nonzero(out_of_order))} out of order "
            f"(first between entries {first - 1} and {first})"
        )
    if layout.row_cells.size > 1 and not np.all(np.diff(layout.row_cells) > 0):
        raise StoreError(f"{store.path}: matrix/row_ids not strictly increasing")
    if layout.expand is not None:  # bev.region: the compact rows, and the way back to the dense map
        return _Coo(row, col, val, layout.n_rows, np.asarray(layout.expand, np.int64), np.asarray(group["cells"]))
    return _Coo(layout.row_cells[row], col, val, layout.n_cells)


def _region_comparison(old: _Coo, new: _Coo, n_cells: int, notes: list[str]) -> str:
    """What two ``matrix/`` are compared on (:data:`MATRIX_COMPARED`), with a note for regions."""
    if old.expand is None and new.expand is None:
        return "cells"
    a, b = old.region_cells, new.region_cells
    if a is not None and b is not None and a.shape == b.shape and np.array_equal(a, b):
        n_kept = old.n_rows - 1
        notes.append(f"matrix/: both stores have the same bev.region: compared row by row over its {n_kept:,} kept (super-)cells")
        return "region rows"

    def what(coo: _Coo) -> str:
        return "the full grid" if coo.expand is None else f"a bev.region of {coo.n_rows - 1:,} rows"

    notes.append(
        f"matrix/: OLD has {what(old)}, NEW {'a different bev.region' if old.expand is not None and new.expand is not None else what(new)}: "
        f"the output is compared on the dense {n_cells:,}-cell map the head sees (region rows read through matrix/expand, 0 outside "
        "the region); changed rows are not counted (the rows are not the same cells)"
    )
    return "dense map"


def _dense_output(coo: _Coo, per_row: F64) -> F64:
    """``(n_rows, C)`` row outputs on the dense map ``(ny * nx, C)`` (a full-grid store's rows already are)."""
    return per_row if coo.expand is None else per_row[coo.expand]


def _changed_rows(old: _Coo, new: _Coo, n_cols: int) -> tuple[int, int]:
    """``(cells whose column set differs, cells whose entries or weights differ)``."""
    key_old = old.cells * n_cols + old.cols
    key_new = new.cells * n_cols + new.cols
    only = np.setxor1d(key_old, key_new, assume_unique=True)
    set_changed = np.unique(only // n_cols)
    _, i_old, i_new = np.intersect1d(key_old, key_new, assume_unique=True, return_indices=True)
    a, b = old.values[i_old], new.values[i_new]
    differs = (a != b) & ~(np.isnan(a) & np.isnan(b))  # the same NaN is no change (the note reports it)
    value_changed = np.unique(old.cells[i_old[differs]])
    return int(set_changed.size), int(np.union1d(set_changed, value_changed).size)


def _apply_camera(
    coo: _Coo, entries: I64, features_cam: F64, depth_cam: npt.NDArray[np.float32] | None, plane: int, per_cam: int, out: F64
) -> None:
    """``out[cell, c] += value * X[col, c]`` over ``entries`` of one camera, in chunks."""
    n_cells = out.shape[0]
    for start in range(0, entries.size, MATRIX_CHUNK_ENTRIES):
        chunk = entries[start : start + MATRIX_CHUNK_ENTRIES]
        rem = coo.cols[chunk] % per_cam
        pix = rem % plane
        lifted = features_cam[:, pix]  # (C, n)
        weight = coo.values[chunk].astype(np.float64)
        if depth_cam is not None:
            weight = weight * depth_cam.reshape(-1)[rem].astype(np.float64)  # rem = d * plane + pix
        cells = coo.cells[chunk]
        for c in range(out.shape[1]):
            out[:, c] += np.bincount(cells, weights=weight * lifted[c], minlength=n_cells)


def matrix_diff(old: LoadedStore, new: LoadedStore, inputs: SeededInputs, notes: list[str]) -> MatrixDiff | None:
    """The ``matrix/`` comparison, or None with a note saying why it was skipped."""
    has_old, has_new = old.has_group("matrix"), new.has_group("matrix")
    if not (has_old and has_new):
        which = "neither store has" if not (has_old or has_new) else ("only OLD has" if has_old else "only NEW has")
        notes.append(f"matrix/: skipped: {which} a matrix/ group (`bevcompile matrix` writes it)")
        return None
    opts_old = plain_data(old["matrix"].attrs.get("build_options"))
    opts_new = plain_data(new["matrix"].attrs.get("build_options"))
    if opts_old != opts_new:
        keys = sorted(set(opts_old) | set(opts_new)) if isinstance(opts_old, dict) and isinstance(opts_new, dict) else []
        differing = [f"{k} {opts_old.get(k)!r} vs {opts_new.get(k)!r}" for k in keys if opts_old.get(k) != opts_new.get(k)]
        notes.append(f"matrix/: skipped: build options differ ({', '.join(differing) or 'unreadable'})")
        return None
    layout_old, layout_new = matrix_layout(old), matrix_layout(new)
    mode = layout_old.mode
    if layout_old.n_cols != layout_new.n_cols:
        notes.append(
            f"matrix/: skipped: {layout_old.n_cols:,} vs {layout_new.n_cols:,} columns "
            f"(depth bins {old.rig.depth.n_bins} vs {new.rig.depth.n_bins}): the columns are different points"
        )
        return None
    coo_old, coo_new = _read_coo(old), _read_coo(new)
    for side, store, coo in (("OLD", old, coo_old), ("NEW", new, coo_new)):
        _note_non_finite(notes, side, store, "matrix/coo_val", coo.values, "the COO output figures")
    n_cols = layout_old.n_cols
    compared = _region_comparison(coo_old, coo_new, layout_old.n_cells, notes)
    n_cells = coo_old.n_rows if compared == "region rows" else layout_old.n_cells
    set_changed: int | None = None
    changed: int | None = None
    if compared == "dense map":
        pass  # the rows are different (super-)cells: the note says so
    elif n_cells * n_cols >= 2**62:
        notes.append("matrix/: changed rows not counted (cell x column keys would overflow int64)")
    else:
        set_changed, changed = _changed_rows(coo_old, coo_new, n_cols)
    rig = old.rig
    w_f, h_f = rig.feature_size
    plane = w_f * h_f
    per_cam = n_cols // rig.n_cam
    channels = inputs.features.shape[1]
    outputs = [np.zeros((coo.n_rows, channels)) for coo in (coo_old, coo_new)]
    order = [np.argsort(coo.cols // per_cam, kind="stable") for coo in (coo_old, coo_new)]
    bounds = [np.searchsorted((coo.cols // per_cam)[o], np.arange(rig.n_cam + 1)) for coo, o in zip((coo_old, coo_new), order, strict=True)]
    depth_iter: Iterator[npt.NDArray[np.float32] | None] = (
        inputs.depth_probs() if mode == "frustum" else iter([None] * rig.n_cam)
    )
    for cam, depth_cam in enumerate(depth_iter):
        features_cam = np.asarray(inputs.features[cam], dtype=np.float64).reshape(channels, plane)
        for k, coo in enumerate((coo_old, coo_new)):
            entries = order[k][bounds[k][cam] : bounds[k][cam + 1]]
            _apply_camera(coo, entries, features_cam, depth_cam, plane, per_cam, outputs[k])
    if compared == "dense map":
        outputs = [_dense_output(coo, out) for coo, out in zip((coo_old, coo_new), outputs, strict=True)]
    peak = float(outputs[0].max() - outputs[0].min()) if outputs[0].size else 0.0  # NaN stays NaN below
    acc = _Accumulator()
    acc.add(outputs[1] - outputs[0])
    return MatrixDiff(
        mode=mode,
        build_options=dict(opts_old) if isinstance(opts_old, dict) else {},
        nnz_old=int(coo_old.cols.size),
        nnz_new=int(coo_new.cols.size),
        n_rows=n_cells - 1 if compared == "region rows" else n_cells,  # a region's zero row is not a cell
        rows_entry_set_changed=set_changed,
        rows_changed=changed,
        output=acc.result("matrix COO", 1.0 if peak <= 0 else peak),
        compared=compared,
    )


# --------------------------------------------------------------------------------------
# the whole diff
# --------------------------------------------------------------------------------------


def _check_gates(max_shift_px: float | None, max_coverage_change: float | None) -> None:
    if max_shift_px is not None and not (math.isfinite(max_shift_px) and max_shift_px >= 0):
        raise UsageError(f"--max-shift-px must be a finite number >= 0, got {max_shift_px}")
    if max_coverage_change is not None and not (math.isfinite(max_coverage_change) and 0 <= max_coverage_change <= 1):
        raise UsageError(f"--max-coverage-change must be a fraction in [0, 1], got {max_coverage_change}")


def gate_failures(stats: ShiftStats, max_shift_px: float | None, max_coverage_change: float | None) -> tuple[str, ...]:
    """The gate figures ``stats`` (one camera, all heights) exceeds, as stderr phrases (empty = passed).

    A non-finite figure (a NaN or inf shift from non-finite ``grid/coords``) fails its gate.
    """
    out = []
    shift = stats.shift_max_px
    if max_shift_px is not None and shift is not None and not math.isfinite(shift):
        out.append(f"max shift not finite ({shift} px; non-finite grid/coords): --max-shift-px {max_shift_px:g} fails")
    elif max_shift_px is not None and shift is not None and shift > max_shift_px:
        out.append(f"max shift {shift:.4g} px > --max-shift-px {max_shift_px:g}")
    elif max_shift_px is not None and stats.cells_both == 0 and (stats.cells_only_old or stats.cells_only_new):
        out.append(f"no cell valid in both stores (lost {stats.cells_only_old}, gained {stats.cells_only_new}): shift unmeasurable, --max-shift-px {max_shift_px:g} fails")
    if max_coverage_change is not None:
        for verb, fraction, cells in (("lost", stats.lost_fraction, stats.cells_only_old), ("gained", stats.gained_fraction, stats.cells_only_new)):
            if not math.isfinite(fraction):
                out.append(f"{verb} fraction not finite ({fraction}): --max-coverage-change {max_coverage_change:g} fails")
            elif fraction > max_coverage_change:
                out.append(f"{verb} {cells} of {stats.n_cells} BEV cells ({fraction:.4g}) > --max-coverage-change {max_coverage_change:g}")
    return tuple(out)


def _note_non_finite(notes: list[str], side: str, store: LoadedStore, array: str, values: npt.NDArray[Any], used_by: str) -> None:
    """Append a note when ``values`` (one stored array) holds NaN or inf: a built store never does."""
    bad = int(np.count_nonzero(~np.isfinite(values)))
    if bad:
        notes.append(
            f"{side} {store.path}: {array} has {bad:,} non-finite value(s) (NaN/inf; a built store has none, "
            f"`bevcompile inspect` checks it): {used_by} that use them are not finite"
        )


def diff_stores(
    old: str | Path | LoadedStore,
    new: str | Path | LoadedStore,
    *,
    seed: int = 0,
    channels: int = DEFAULT_CHANNELS,
    max_shift_px: float | None = None,
    max_coverage_change: float | None = None,
) -> StoreDiff:
    """Compare two stores of the same layout (see the module docstring).

    Args:
        old, new: store paths (or loaded stores); read through :func:`bevcompile.load` with
            content hashes verified.
        seed, channels: the seeded features (as ``bevcompile verify``).
        max_shift_px: gate: a camera fails if its max shift over cells valid in both exceeds it
            or is not finite (non-finite ``grid/coords``), or if it has cells in one store but none
            valid in both.
        max_coverage_change: gate: a camera fails if it loses or gains more than this fraction
            of its BEV cells (``n_heights * ny * nx``).

    Non-finite values in ``grid/coords``, ``grid/norm`` or ``matrix/coo_val`` (a built store has
    none) are not errors: the figures they reach are NaN/inf (never dropped) and a note names
    the store, the array and the count.

    Raises:
        StoreError: not a store, missing ``grid/``, damaged arrays (wrong shapes; COO entries out
            of range, unsorted or duplicated) (exit 2).
        UsageError: incomparable stores (``cannot compare: ...``) or bad options (exit 2).
    """
    check_feature_options(seed, channels)
    _check_gates(max_shift_px, max_coverage_change)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):  # non-finite inputs: NaN/inf figures and a note
        return _diff_stores(old, new, seed, channels, max_shift_px, max_coverage_change)


def _camera_diffs(
    rig_old: RigConfig,
    rig_new: RigConfig,
    grid_old: tuple[npt.NDArray[np.float32], npt.NDArray[np.bool_]],
    grid_new: tuple[npt.NDArray[np.float32], npt.NDArray[np.bool_]],
    max_shift_px: float | None,
    max_coverage_change: float | None,
    cells: npt.NDArray[np.int64] | None = None,
) -> list[CameraDiff]:
    """Per camera: pose change, sampling shift over all heights (and per height) and gate failures,
    from the ``(grid/coords, grid/valid)`` of each store (``cells``: the compared region cells)."""
    (coords_old, valid_old), (coords_new, valid_new) = grid_old, grid_new
    heights = tuple(float(h) for h in rig_old.bev.heights)
    all_heights = list(range(len(heights)))
    cameras: list[CameraDiff] = []
    for cam, name in enumerate(rig_old.camera_names):
        args = (rig_old, coords_old[cam], valid_old[cam], coords_new[cam], valid_new[cam])
        total = _shift_stats(*args, all_heights, cells)
        per_height = tuple((heights[ih], _shift_stats(*args, [ih], cells)) for ih in all_heights) if len(heights) > 1 else ((heights[0], total),)
        rotation_deg, translation_mm, delta_mm = pose_change(rig_old, rig_new, cam)
        cameras.append(
            CameraDiff(name, rotation_deg, translation_mm, delta_mm, total, per_height, gate_failures(total, max_shift_px, max_coverage_change))
        )
    return cameras


def camera_diffs(
    old: LoadedStore,
    new: LoadedStore,
    *,
    max_shift_px: float | None = None,
    max_coverage_change: float | None = None,
) -> list[CameraDiff]:
    """The per-camera part of :func:`diff_stores` alone (pose change, ``grid/`` sampling shift and
    coverage change, gate failures), without the output and matrix figures: what ``bevcompile
    fleet`` records for every vehicle against the fleet's reference. Same rules and errors as
    :func:`diff_stores` (``UsageError`` ``cannot compare: ...``; ``StoreError``)."""
    _check_gates(max_shift_px, max_coverage_change)
    old.group("grid")
    new.group("grid")
    check_comparable(old, new)
    (coords_old, valid_old, _), (coords_new, valid_new, _), cells = compared_grid_arrays(old, new)
    with np.errstate(invalid="ignore", over="ignore"):
        return _camera_diffs(old.rig, new.rig, (coords_old, valid_old), (coords_new, valid_new), max_shift_px, max_coverage_change, cells)


def _diff_stores(
    old: str | Path | LoadedStore,
    new: str | Path | LoadedStore,
    seed: int,
    channels: int,
    max_shift_px: float | None,
    max_coverage_change: float | None,
) -> StoreDiff:
    store_old, store_new = load(old), load(new)
    store_old.group("grid")
    store_new.group("grid")
    check_comparable(store_old, store_new)
    rig_old, rig_new = store_old.rig, store_new.rig
    notes: list[str] = []
    (coords_old, valid_old, norm_old), (coords_new, valid_new, norm_new), cells = compared_grid_arrays(store_old, store_new, notes)
    for side, store, coords, norm in (("OLD", store_old, coords_old, norm_old), ("NEW", store_new, coords_new, norm_new)):
        _note_non_finite(notes, side, store, "grid/coords", coords, "the shift figures")
        _note_non_finite(notes, side, store, "grid/norm", norm, "the output-change figures")
    heights = tuple(float(h) for h in rig_old.bev.heights)
    cameras = _camera_diffs(rig_old, rig_new, (coords_old, valid_old), (coords_new, valid_new), max_shift_px, max_coverage_change, cells)
    inputs = SeededInputs(rig_old, channels, seed)
    align_corners = grid_align_corners(store_old)
    output = grid_output_change(inputs.features, norm_old, norm_new, heights, align_corners, valid_old, valid_new)
    matrix = matrix_diff(store_old, store_new, inputs, notes)
    return StoreDiff(
        old=str(old if not isinstance(old, LoadedStore) else old.path),
        new=str(new if not isinstance(new, LoadedStore) else new.path),
        old_name=rig_old.name,
        new_name=rig_new.name,
        old_config_sha256=store_old.config_sha256,
        new_config_sha256=store_new.config_sha256,
        seed=seed,
        channels=channels,
        align_corners=align_corners,
        feature_size=rig_old.feature_size,
        heights=heights,
        config_changes=config_changes(rig_old, rig_new),
        cameras=cameras,
        output=output,
        matrix=matrix,
        max_shift_px=max_shift_px,
        max_coverage_change=max_coverage_change,
        notes=notes,
    )
