"""What every importer shares: the model-settings template, rigid 4x4 transforms, the rig data."""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ...errors import ConfigError, shown
from ..config import (
    _NAME_RE,
    _check_rotation,
    _Ctx,
    _mapping,
    _matrix,
    default_config_path,
    read_config_data,
)

Matrix4 = list[list[float]]
TEMPLATE_KEYS = ("name", "description", "image_aug", "feature", "bev", "depth")
"""Top-level keys a model-settings template may hold: a rig config without ``cameras``."""
CALIBRATION_KEYS = ("cameras", "sensors")
"""What a template must not hold: the calibration of one vehicle."""


def template_data(path: str | Path | None, data: Any = None, *, source: str | None = None, field: str = "") -> dict[str, Any]:
    """The model settings (``image_aug``, ``feature``, ``bev``, ``depth``; optional ``name`` and
    ``description``) from a template: a YAML file (``path``), plain ``data`` (a manifest's inline
    template), or, with neither, the bundled nuScenes rig's settings (BEVDet-R50) without its cameras.

    A template is a rig config without ``cameras`` (and ``sensors``): the importer or the fleet
    vehicle gives them. ConfigError ``<source>: <field>.cameras: ...`` if it holds them."""
    if path is None and data is None:
        bundled = read_config_data(default_config_path())
        return {k: copy.deepcopy(v) for k, v in bundled.items() if k not in CALIBRATION_KEYS}
    if data is None:
        assert path is not None
        source = str(path)
        data = read_config_data(path, what="a rig template")
    ctx = _Ctx(source or "<template>")
    data = dict(_mapping(ctx, data, field))
    prefix = f"{field}." if field else ""
    for key in CALIBRATION_KEYS:
        if key in data:
            raise ctx.fail(
                f"{prefix}{key}",
                "a template holds the model settings only (image_aug, feature, bev, depth): the cameras "
                "(and other sensors) come from each vehicle's calibration; remove them from the template",
            )
    return copy.deepcopy(data)


def rig_data(
    template: Mapping[str, Any],
    *,
    name: str,
    cameras: Sequence[Mapping[str, Any]],
    sensors: Sequence[Mapping[str, Any]] = (),
    description: str | None = None,
) -> dict[str, Any]:
    """Rig config data: ``name``, ``description`` (given, else the template's), the cameras (and
    sensors), then the template's model settings, in the order a rig config is written."""
    out: dict[str, Any] = {"name": name}
    text = description if description is not None else template.get("description")
    if text is not None:
        out["description"] = text
    out["cameras"] = [dict(c) for c in cameras]
    if sensors:
        out["sensors"] = [dict(s) for s in sensors]
    for key, value in template.items():
        if key not in ("name", "description"):
            out[key] = copy.deepcopy(value)
    return out


def check_name(name: str, source: str, what: str = "--name") -> str:
    """A store name (file-name safe), as ``parse_config`` requires of ``name``."""
    if not _NAME_RE.fullmatch(name):
        raise ConfigError(source, what, f"must be a file-name-safe identifier (letters, digits, '.', '_', '-'), got {shown(name)}")
    return name


def rigid_matrix(ctx: _Ctx, value: Any, field: str) -> Matrix4:
    """A 4x4 rigid transform (rotation orthonormal within 1e-6, det +1, bottom row 0 0 0 1)."""
    matrix = _matrix(ctx, value, field, 4, 4)
    if matrix[3] != [0.0, 0.0, 0.0, 1.0]:
        raise ctx.fail(f"{field}[3]", f"bottom row must be [0, 0, 0, 1], got {matrix[3]}")
    _check_rotation(ctx, [row[:3] for row in matrix[:3]], field)
    return matrix


def compose(a: Matrix4, b: Matrix4) -> Matrix4:
    """``a @ b`` of two 4x4 rigid transforms, float64, bottom row exactly ``[0, 0, 0, 1]``."""
    out = [[math.fsum(a[i][k] * b[k][j] for k in range(4)) for j in range(4)] for i in range(3)]
    return [*out, [0.0, 0.0, 0.0, 1.0]]


def invert(t: Matrix4) -> Matrix4:
    """Inverse of a rigid transform ``[R | t]``: ``[R^T | -R^T t]`` (float64; exact transpose)."""
    rot = [[t[j][i] for j in range(3)] for i in range(3)]
    trans = [-math.fsum(rot[i][k] * t[k][3] for k in range(3)) for i in range(3)]
    return [[*rot[i], trans[i]] for i in range(3)] + [[0.0, 0.0, 0.0, 1.0]]


IDENTITY: Matrix4 = [[1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 1.0]]


def pose_fields(ego_from_sensor: Matrix4) -> dict[str, Any]:
    """The pose of a rig camera/sensor entry from a composed 4x4: ``sensor2ego``."""
    return {"sensor2ego": [list(row) for row in ego_from_sensor]}
