"""Coordinate arrays: what every group's named axes mean, stored beside its arrays so that
xarray (and any reader of zarr v3 ``dimension_names``) can select by it.

Convention: in every group, an axis named

* ``camera`` has a coordinate array ``camera``: the camera names, in the rig's camera order
  (zarr ``string`` data type, UTF-8);
* ``x`` / ``y``: the BEV cell centres in metres of the BEV frame (``bev.frame``),
  ``min + (i + 0.5) * step``, float64;
* ``height``: the sampling heights ``bev.heights`` in metres (BEV frame z), float64;
* ``depth``: the depth bin values ``depth.bins`` in metres along the optical axis, float64;
* ``kept_cell`` (stores with a ``bev.region``): the flat fine-cell index ``iy * nx + ix`` of each
  kept (super-)cell's first fine cell, int64 (the cell table's order, increasing);
* ``x_l<l>`` / ``y_l<l>`` / ``height_l<l>`` (a feature level ``l`` with its own BEV grid,
  ``feature.levels[l].bev``): that level's cell centres and heights, for the ``interop/`` arrays
  of that level (one group holds every level's LUT);

and a level group (``grid_l<l>/``, ``gather_l<l>/``, ``delta_l<l>/``) takes its ``x``, ``y`` and
``height`` from its level's grid (:func:`group_rig`); when the axis has that length (an axis of the same name and another length means something else
and gets none). A coordinate array is 1-D and named after its axis; it is not a product array
(the product plug-ins never see it: :meth:`bevcompile.store.zarr_io.StoreReader.arrays` leaves it
out), and ``inspect`` checks its values against the stored config (``coordinates``).

Pure numpy; no zarr here (:mod:`.zarr_io` writes and reads them).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import numpy as np

from ..rig.config import RigConfig
from ..rig.region import region_table
from .plugins import LEVEL_GROUPS, split_level_group

COORDINATE_NAMES = ("camera", "height", "y", "x", "depth", "kept_cell")
"""The axis names that get a coordinate array (in this order in a group)."""
_LEVEL_COORDINATE = re.compile(r"(height|y|x)_l[1-9][0-9]?")
"""A level's own grid axis (``x_l1``): the coordinates of a feature level with its own BEV grid."""


def level_axis_names(level: int) -> tuple[str, str, str]:
    """``(height, y, x)`` axis names of level ``level``'s own BEV grid in a group that holds
    several levels (``interop/``): ``height_l<l>``, ``y_l<l>``, ``x_l<l>``."""
    return (f"height_l{level}", f"y_l{level}", f"x_l{level}")


def group_rig(rig: RigConfig, group: str | None) -> RigConfig:
    """The rig whose coordinates a group holds: ``rig.level(l)`` for a level group
    (``grid_l<l>/``: its own feature map, and its own BEV grid when it has one), else ``rig``."""
    if group is None:
        return rig
    base, level = split_level_group(group)
    return rig.level(level) if base in LEVEL_GROUPS and 0 < level < rig.n_levels else rig


def coordinate_values(rig: RigConfig) -> dict[str, np.ndarray]:
    """Every coordinate of ``rig`` by axis name (see the module docstring)."""
    bev = rig.bev
    out: dict[str, np.ndarray] = {
        "camera": np.array(rig.camera_names, dtype=object),
        "height": np.asarray(bev.heights, dtype=np.float64),
        "y": np.asarray(bev.y.centres(), dtype=np.float64),
        "x": np.asarray(bev.x.centres(), dtype=np.float64),
        "depth": np.asarray(rig.depth.values(), dtype=np.float64),
    }
    if bev.region is not None:
        cells = region_table(bev).cells
        out["kept_cell"] = cells[:, 0].astype(np.int64) * bev.nx + cells[:, 1].astype(np.int64)
    for index, level in enumerate(rig.feature.levels):
        if level.bev is not None:
            names = level_axis_names(index)
            out[names[0]] = np.asarray(level.bev.heights, dtype=np.float64)
            out[names[1]] = np.asarray(level.bev.y.centres(), dtype=np.float64)
            out[names[2]] = np.asarray(level.bev.x.centres(), dtype=np.float64)
    return out


def coordinate_arrays(rig: RigConfig, axis_lengths: Mapping[str, int], group: str | None = None) -> dict[str, np.ndarray]:
    """The coordinate arrays of a group whose axes have ``axis_lengths`` (name -> length); ``group``
    (its name) picks a level group's own level (:func:`group_rig`)."""
    values = coordinate_values(group_rig(rig, group))
    names = [*COORDINATE_NAMES, *(name for name in values if name not in COORDINATE_NAMES)]
    return {name: values[name] for name in names if name in values and axis_lengths.get(name) == len(values[name])}


def is_coordinate(name: str, dims: tuple[str, ...] | None) -> bool:
    """Whether a stored array is a coordinate array: named after its one axis, a known name."""
    return (name in COORDINATE_NAMES or _LEVEL_COORDINATE.fullmatch(name) is not None) and dims == (name,)


def same_coordinate(stored: np.ndarray, expected: np.ndarray) -> bool:
    """Stored coordinate values equal the expected ones (strings by text, numbers exactly)."""
    if expected.dtype == object:
        return stored.shape == expected.shape and [str(v) for v in stored.tolist()] == [str(v) for v in expected.tolist()]
    return stored.shape == expected.shape and stored.dtype == expected.dtype and bool(np.array_equal(stored, expected))
