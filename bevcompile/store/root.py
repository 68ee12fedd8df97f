"""The root attributes every store carries: format, tool version, name, the config it was built
from (and its sha256), and the conventions. No timestamps: the same config gives the same bytes.
"""

from __future__ import annotations

from typing import Any

from .._version import __version__
from ..conventions import CONVENTIONS, REGION_CONVENTIONS
from ..rig.config import RigConfig, config_sha256, config_to_dict
from .zarr_io import STORE_FORMAT


def root_attributes(rig: RigConfig) -> dict[str, Any]:
    """Root attributes of a store built from ``rig`` (no timestamps: output is deterministic)."""
    return {
        "format": STORE_FORMAT,
        "tool_version": __version__,
        "name": rig.name,
        "config": config_to_dict(rig),
        "config_sha256": config_sha256(rig),
        "conventions": dict(CONVENTIONS) | (dict(REGION_CONVENTIONS) if rig.bev.region is not None else {}),
    }
