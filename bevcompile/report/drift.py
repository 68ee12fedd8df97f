"""The drift report of learned matrix values: ``bevcompile diff --against-init LEARNED`` (or
``bevcompile diff INIT LEARNED``).

The field advice: export each camera's weight distribution; a camera whose weight concentrates
abnormally points at a bad calibration or skewed training data. On the fixed topology of a
learned ``matrix/`` (``bevcompile absorb``), per camera:

* mass share before / after: the camera's sum of matrix values over the sum of all values;
* mean (and max) ``|w - w_init| / w_init`` over the camera's entries;
* the BEV cells whose camera share moved most: the share of cell ``(iy, ix)`` is the camera's
  mass in the cell over the cell's mass of all cameras (cells with positive mass of both);
* mass outside the camera's geometric footprint: the cells the camera does not see by the VALID
  RULE at any sampling height (the ``grid/`` geometry, recomputed from the stored config), before
  and after. A grid-mode matrix has no entry there (0 by construction); a frustum matrix has some
  (points above the ground plane, bilinear splat), so the change is the signal.

A ``bev.region`` store (``matrix/expand``): every figure is computed over its compact rows, the
kept (super-)cells (the zero row holds nothing): a cell above is a row ``(iy, ix, size)`` of
``matrix/cells`` (listed with its size and its centre), and a row is inside a camera's footprint
iff the camera sees at least one of its fine cells.

"Before" is the learned store's ``init_ell_weight`` (``--against-init``) or the values of the
first store (geometric or learned; same config, same topology). Stores are read through
:func:`bevcompile.load` (hashes verified). Pure: nothing here prints.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from ..errors import UsageError
from ..grid.ipm import compute_sampling_grid
from ..rig.config import RigConfig
from ..rig.region import region_table
from ..store.loader import LoadedStore, load, matrix_layout

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]
INIT_ARRAY = "init_ell_weight"
DEFAULT_TOP_CELLS = 3
SHARE_MOVE_MIN = 1e-6
"""Cells whose camera share moved less than this are not listed (float32 rounding of rescaled values)."""
SHARE_RULE = "camera share of a cell = camera mass in the cell / mass of all cameras in the cell (cells with positive mass before and after)"


def _ell_slots(coo_row: I64) -> I64:
    if not coo_row.size:
        return np.zeros(0, np.int64)
    starts = np.flatnonzero(np.r_[True, coo_row[1:] != coo_row[:-1]])
    return np.arange(coo_row.size) - np.repeat(starts, np.diff(np.r_[starts, coo_row.size]))


def is_learned_store(store: LoadedStore) -> bool:
    return store.has_group("matrix") and store["matrix"].attrs.get("values") == "learned"


@dataclass(frozen=True)
class MatrixValues:
    """COO entries of a ``matrix/`` with their BEV cell and camera. Convention: ``cells``,
    ``cams``, ``cols`` int64 ``(nnz,)``; ``values`` / ``init`` float64 ``(nnz,)`` (``init`` the
    ``init_ell_weight`` real slots of a learned store, else None)."""

    cells: I64
    cams: I64
    cols: I64
    values: F64
    init: F64 | None


def matrix_values(store: LoadedStore) -> MatrixValues:
    group = store["matrix"]
    layout = matrix_layout(store)
    row = np.asarray(group["coo_row"], np.int64)
    col = np.asarray(group["coo_col"], np.int64)
    init = None
    if INIT_ARRAY in group:
        init = np.asarray(group[INIT_ARRAY])[row, _ell_slots(row)].astype(np.float64)
    per_cam = layout.n_cols // store.rig.n_cam
    return MatrixValues(layout.row_cells[row], col // per_cam, col, np.asarray(group["coo_val"], np.float64), init)


def camera_mass(cells: I64, cams: I64, values: F64, n_cam: int, n_cells: int) -> F64:
    """``(n_cam, n_cells)`` float64: the sum of ``values`` per camera and BEV cell."""
    summed = np.bincount(cams * n_cells + cells, weights=values, minlength=n_cam * n_cells)
    return np.asarray(summed, dtype=np.float64).reshape(n_cam, n_cells)


@dataclass(frozen=True)
class CellMove:
    """A cell whose camera share moved: ``(iy, ix)``, its centre in ego metres, the share before/after."""

    iy: int
    ix: int
    x_m: float
    y_m: float
    share_before: float
    share_after: float
    size: int = 1  # a bev.region store: the side of the (super-)cell in fine cells

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"iy": self.iy, "ix": self.ix, "x_m": self.x_m, "y_m": self.y_m, "share_before": self.share_before, "share_after": self.share_after}
        if self.size != 1:
            out["size"] = self.size
        return out


@dataclass(frozen=True)
class CameraDrift:
    camera: str
    entries: int
    share_before: float
    share_after: float
    mean_rel_change: float
    max_rel_change: float
    outside_before: float  # mass in cells outside the footprint, as a fraction of the camera's mass
    outside_after: float
    top_cells: tuple[CellMove, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "camera": self.camera, "entries": self.entries, "share_before": self.share_before, "share_after": self.share_after,
            "mean_rel_change": self.mean_rel_change, "max_rel_change": self.max_rel_change,
            "outside_footprint_before": self.outside_before, "outside_footprint_after": self.outside_after,
            "top_cells": [c.to_json() for c in self.top_cells],
        }


@dataclass
class DriftReport:
    before: str  # "init_ell_weight of <store>" or the first store's path
    after: str
    mode: str
    cameras: list[CameraDrift]
    mass_before: float
    mass_after: float
    entries: int
    changed: int
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "before": self.before, "after": self.after, "mode": self.mode, "entries": self.entries, "changed": self.changed,
            "mass_before": self.mass_before, "mass_after": self.mass_after, "share_rule": SHARE_RULE,
            "footprint_rule": "cells the camera does not see by the VALID RULE at any sampling height; fractions of the camera's mass",
            "rel_change_rule": "|w - w_before| / |w_before| over the camera's entries",
            "cameras": [c.to_json() for c in self.cameras], "notes": list(self.notes),
        }


def footprint(rig: RigConfig) -> npt.NDArray[np.bool_]:
    """``(n_cam, ny * nx)`` bool: cells each camera sees (VALID RULE at any sampling height)."""
    return np.asarray(compute_sampling_grid(rig).valid.any(axis=1)).reshape(rig.n_cam, -1)


@dataclass(frozen=True)
class RowCells:
    """What the rows of a ``matrix/`` are on the BEV grid. Convention: ``iy``, ``ix``, ``size``
    int64 ``(n_rows,)`` (a row's first fine cell and its side in fine cells); ``x_m``, ``y_m``
    float64 ``(n_rows,)`` its centre, metres in the BEV frame; ``seen`` bool ``(n_cam, n_rows)``
    (the camera sees at least one of the row's fine cells)."""

    iy: I64
    ix: I64
    size: I64
    x_m: F64
    y_m: F64
    seen: npt.NDArray[np.bool_]


def row_cells(rig: RigConfig) -> RowCells:
    """The BEV cells (full grid) or, with ``bev.region``, the kept (super-)cells then the zero
    row (size 0, never seen) that the drift figures are computed over."""
    bev = rig.bev
    seen = footprint(rig)
    if bev.region is None:
        k = np.arange(bev.ny * bev.nx, dtype=np.int64)
        iy, ix, size = k // bev.nx, k % bev.nx, np.ones(k.size, np.int64)
    else:
        table = region_table(bev)
        iy, ix, size = (np.r_[table.cells[:, i].astype(np.int64), 0] for i in range(3))
        row = table.row_of_cell()
        inside = row >= 0
        hits = np.stack([np.bincount(row[inside], weights=seen[c][inside], minlength=table.n_kept + 1) for c in range(rig.n_cam)])
        seen = hits > 0
    return RowCells(iy, ix, size, bev.x.min + (ix + size / 2) * bev.x.step, bev.y.min + (iy + size / 2) * bev.y.step, seen)


def drift(rig: RigConfig, mode: str, entries: MatrixValues, before: F64, after: F64, labels: tuple[str, str], top: int = DEFAULT_TOP_CELLS) -> DriftReport:
    """The per-camera drift of ``after`` against ``before`` (values of the same COO entries;
    ``entries.cells`` the matrix rows' index into :func:`row_cells`)."""
    geometry = row_cells(rig)
    n_cam, n_cells = rig.n_cam, int(geometry.iy.size)
    m0 = camera_mass(entries.cells, entries.cams, before, n_cam, n_cells)
    m1 = camera_mass(entries.cells, entries.cams, after, n_cam, n_cells)
    t0, t1 = m0.sum(axis=0), m1.sum(axis=0)
    both = (t0 > 0) & (t1 > 0)
    share0 = np.where(both, m0 / np.where(both, t0, 1.0), 0.0)
    share1 = np.where(both, m1 / np.where(both, t1, 1.0), 0.0)
    seen = geometry.seen
    rel = np.abs(after - before) / np.where(before != 0, np.abs(before), 1.0)
    total0, total1 = float(m0.sum()), float(m1.sum())
    cameras = []
    for c, name in enumerate(rig.camera_names):
        mine = entries.cams == c
        moved = np.abs(share1[c] - share0[c])
        order = np.argsort(-moved, kind="stable")[:top]
        cells = tuple(
            CellMove(int(geometry.iy[k]), int(geometry.ix[k]), float(geometry.x_m[k]), float(geometry.y_m[k]),
                     float(share0[c, k]), float(share1[c, k]), int(geometry.size[k]))
            for k in order if moved[k] > SHARE_MOVE_MIN
        )
        mass0, mass1 = float(m0[c].sum()), float(m1[c].sum())
        out0, out1 = float(m0[c][~seen[c]].sum()), float(m1[c][~seen[c]].sum())
        cameras.append(CameraDrift(
            name, int(mine.sum()), mass0 / total0 if total0 else 0.0, mass1 / total1 if total1 else 0.0,
            float(rel[mine].mean()) if mine.any() else 0.0, float(rel[mine].max()) if mine.any() else 0.0,
            out0 / mass0 if mass0 else 0.0, out1 / mass1 if mass1 else 0.0, cells,
        ))
    notes = [] if rig.bev.region is None else [
        f"bev.region store: figures over its {n_cells - 1:,} compact rows (kept (super-)cells; a cell is listed with its size), "
        "a row inside a camera's footprint iff the camera sees one of its fine cells"
    ]
    return DriftReport(labels[0], labels[1], mode, cameras, total0, total1, int(before.size), int(np.count_nonzero(after != before)), notes)


def _topology(store: LoadedStore) -> tuple[Any, ...]:
    group = store["matrix"]
    return tuple(np.asarray(group[n]).tobytes() for n in ("coo_row", "coo_col", "row_ids") if n in group)


def _options_without_products(store: LoadedStore) -> Mapping[str, Any]:
    options = dict(store["matrix"].attrs.get("build_options") or {})
    return {k: v for k, v in options.items() if k not in ("tile_rows", "quantize", "fp16_rows")}


def drift_stores(first: str | Path | LoadedStore, second: str | Path | LoadedStore | None = None, *, top: int = DEFAULT_TOP_CELLS) -> DriftReport:
    """``second is None``: the learned store ``first`` against its own ``init_ell_weight``; else the
    learned store ``second`` against the values of ``first`` (same config and topology).

    Raises :class:`UsageError` (exit 2) for a store that is not learned, or two stores that do not
    share the config and the topology; :class:`~bevcompile.errors.StoreError` for a store without
    ``matrix/`` or a damaged one."""
    if isinstance(top, bool) or not isinstance(top, int) or top < 0:
        raise UsageError(f"--top must be an integer >= 0, got {top!r}")
    a = load(first)
    if second is None:
        if not is_learned_store(a):
            a["matrix"]  # a missing matrix/ names the command that writes it
            raise UsageError(f"{a.path}: matrix/ holds geometric values (no init_ell_weight): --against-init needs a store written by `bevcompile absorb`")
        entries = matrix_values(a)
        assert entries.init is not None
        return drift(a.rig, matrix_layout(a).mode, entries, entries.init, entries.values, (f"{a.path} init_ell_weight", f"{a.path} learned"), top)
    b = load(second)
    if not is_learned_store(b):
        b["matrix"]
        raise UsageError(f"{b.path}: matrix/ holds geometric values; the drift report compares a LEARNED store (bevcompile absorb) with its init")
    a["matrix"]
    if a.config_sha256 != b.config_sha256:
        raise UsageError(f"cannot compare learned values: {a.path} and {b.path} were built from different configs (the drift report needs one topology)")
    if _options_without_products(a) != _options_without_products(b) or _topology(a) != _topology(b):
        raise UsageError(f"cannot compare learned values: {a.path} and {b.path} have different matrix topologies (build options or entries)")
    before, after = matrix_values(a), matrix_values(b)
    return drift(b.rig, matrix_layout(b).mode, after, before.values, after.values, (str(a.path), str(b.path)), top)
