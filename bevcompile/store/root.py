"""The root attributes every store carries: format, tool version, name, the config it was built
from (and its sha256), and the conventions. No timestamps: the same config gives the same bytes.
"""

from __future__ import annotations

from typing import Any

from .._version import __version__
from ..conventions import CONVENTIONS, FLIP_CONVENTIONS, LEVEL_GRID_CONVENTIONS, REGION_CONVENTIONS
from ..rig.config import RigConfig, config_sha256, config_to_dict
from .zarr_io import STORE_FORMAT


def rig_conventions(rig: RigConfig) -> dict[str, str]:
    """The convention sentences a store of ``rig`` records: :data:`~bevcompile.conventions.CONVENTIONS`,
    plus those of the features it uses (a ``bev.region``, per-level BEV grids, a flipped image)."""
    out = dict(CONVENTIONS)
    if rig.bev.region is not None:
        out |= REGION_CONVENTIONS
    if rig.has_level_grids:
        out |= LEVEL_GRID_CONVENTIONS
    if any(camera.image_aug.flip for camera in rig.cameras):
        out |= FLIP_CONVENTIONS
    return out


def root_attributes(rig: RigConfig) -> dict[str, Any]:
    """Root attributes of a store built from ``rig`` (no timestamps: output is deterministic)."""
    return {
        "format": STORE_FORMAT,
        "tool_version": __version__,
        "name": rig.name,
        "config": config_to_dict(rig),
        "config_sha256": config_sha256(rig),
        "conventions": rig_conventions(rig),
    }
