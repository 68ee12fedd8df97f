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

when the axis has that length (an axis of the same name and another length means something else
and gets none). A coordinate array is 1-D and named after its axis; it is not a product array
(the product plug-ins never see it: :meth:`bevcompile.store.zarr_io.StoreReader.arrays` leaves it
out), and ``inspect`` checks its values against the stored config (``coordinates``).

Pure numpy; no zarr here (:mod:`.zarr_io` writes and reads them).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from ..rig.config import RigConfig
from ..rig.region import region_table

COORDINATE_NAMES = ("camera", "height", "y", "x", "depth", "kept_cell")
"""The axis names that get a coordinate array (in this order in a group)."""


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
    return out


def coordinate_arrays(rig: RigConfig, axis_lengths: Mapping[str, int]) -> dict[str, np.ndarray]:
    """The coordinate arrays of a group whose axes have ``axis_lengths`` (name -> length)."""
    values = coordinate_values(rig)
    return {name: values[name] for name in COORDINATE_NAMES if name in values and axis_lengths.get(name) == len(values[name])}


def is_coordinate(name: str, dims: tuple[str, ...] | None) -> bool:
    """Whether a stored array is a coordinate array: named after its one axis, a known name."""
    return name in COORDINATE_NAMES and dims == (name,)


def same_coordinate(stored: np.ndarray, expected: np.ndarray) -> bool:
    """Stored coordinate values equal the expected ones (strings by text, numbers exactly)."""
    if expected.dtype == object:
        return stored.shape == expected.shape and [str(v) for v in stored.tolist()] == [str(v) for v in expected.tolist()]
    return stored.shape == expected.shape and stored.dtype == expected.dtype and bool(np.array_equal(stored, expected))
