"""Assemble products into store groups: the library functions behind ``bevcompile grid``.

This module glues the pure core (config dataclasses -> arrays) to the store writer. It
computes, measures and describes; it never prints.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ._version import __version__
from .config import RigConfig, config_sha256, config_to_dict
from .conventions import CONVENTIONS
from .grid import (
    INVALID_PX,
    NORM_INT16_SCALE,
    GridProducts,
    build_grid_products,
    compute_sampling_grid,
    coverage_fraction,
)
from .store import STORE_FORMAT, GroupData, WriteReport, store_path, write_groups

ProgressFn = Callable[[int], None]
GRID_COMMAND_GROUPS = ("grid",)
"""Groups owned (rewritten or removed) by ``bevcompile grid``."""


def root_attributes(rig: RigConfig) -> dict[str, Any]:
    """Root attributes of a store built from ``rig`` (no timestamps: output is deterministic)."""
    return {
        "format": STORE_FORMAT,
        "tool_version": __version__,
        "name": rig.name,
        "config": config_to_dict(rig),
        "config_sha256": config_sha256(rig),
        "conventions": dict(CONVENTIONS),
    }


def grid_group(products: GridProducts, rig: RigConfig) -> GroupData:
    """The ``grid/`` group: coords, valid, norm, norm_int16 and their attributes."""
    w_f, h_f = products.feature_size
    per_cam_chunks = (1, len(rig.bev.heights), rig.bev.ny, rig.bev.nx)
    attrs: dict[str, Any] = {
        "build_options": {"align_corners": products.align_corners},
        "align_corners": products.align_corners,
        "feature_size": [w_f, h_f],
        "feature_size_order": "[W_f, H_f]",
        "cameras": list(rig.camera_names),
        "heights": list(rig.bev.heights),
        "shape_order": "(n_cam, n_heights, ny, nx[, 2])",
        "component_order": "(u, v) for coords; (x, y) for norm and its encodings",
        "coords_unit": "feature-map pixels, integer = pixel centre",
        "valid_rule": CONVENTIONS["valid_rule"],
        "invalid_coords_px": [INVALID_PX, INVALID_PX],
        "norm_formula": (
            "norm = 2 u / (W_f - 1) - 1" if products.align_corners else "norm = (2 u + 1) / W_f - 1"
        ),
        "norm_int16": {
            "encode": "q = clip(round_half_even(norm * 32767), -32767, 32767)",
            "decode": "norm = q / 32767",
            "scale": 1.0 / NORM_INT16_SCALE,
            "offset": 0.0,
            "invalid_in_band": False,
            "invalid_note": "invalid cells saturate to -1.0, which samples in range: mask with grid/valid",
            "max_error_px": products.norm_int16_max_error_px,
        },
        "coverage": coverage_fraction(products.valid).round(6).tolist(),
    }
    return GroupData(
        arrays={
            "coords": products.coords,
            "valid": products.valid,
            "norm": products.norm,
            "norm_int16": products.norm_int16,
        },
        attrs=attrs,
        chunks={
            "coords": (*per_cam_chunks, 2),
            "valid": per_cam_chunks,
            "norm": (*per_cam_chunks, 2),
            "norm_int16": (*per_cam_chunks, 2),
        },
    )


@dataclass
class CameraSummary:
    name: str
    coverage: list[float]  # per height, fraction of BEV cells valid
    u_range: tuple[float, float] | None
    v_range: tuple[float, float] | None


@dataclass
class GridRunResult:
    rig: RigConfig
    store: Path
    products: GridProducts
    cameras: list[CameraSummary]
    write: WriteReport
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "store": str(self.store),
            "name": self.rig.name,
            "config_sha256": config_sha256(self.rig),
            "align_corners": self.products.align_corners,
            "feature_size": list(self.products.feature_size),
            "bev_shape": [len(self.rig.bev.heights), self.rig.bev.ny, self.rig.bev.nx],
            "heights": list(self.rig.bev.heights),
            "norm_int16_max_error_px": self.products.norm_int16_max_error_px,
            "cameras": [
                {
                    "name": c.name,
                    "coverage": c.coverage,
                    "u_range": list(c.u_range) if c.u_range else None,
                    "v_range": list(c.v_range) if c.v_range else None,
                }
                for c in self.cameras
            ],
            "bytes_written": self.write.bytes_per_array,
            "bytes_total": self.write.total_bytes,
            **self.extra,
        }


def summarise_cameras(rig: RigConfig, products: GridProducts) -> list[CameraSummary]:
    out = []
    coverage = coverage_fraction(products.valid)
    for cam_index, camera in enumerate(rig.cameras):
        valid = products.valid[cam_index]
        coords = products.coords[cam_index][valid]
        u_range: tuple[float, float] | None = None
        v_range: tuple[float, float] | None = None
        if coords.size:
            u_range = (float(coords[:, 0].min()), float(coords[:, 0].max()))
            v_range = (float(coords[:, 1].min()), float(coords[:, 1].max()))
        out.append(CameraSummary(camera.name, [float(c) for c in coverage[cam_index]], u_range, v_range))
    return out


def run_grid(
    rig: RigConfig,
    out_dir: str | Path,
    *,
    align_corners: bool = False,
    force: bool = False,
    progress: ProgressFn | None = None,
) -> GridRunResult:
    """Compute the IPM grid of ``rig`` and write the ``grid/`` group into
    ``<out_dir>/<name>.zarr`` (atomically; see :func:`bevcompile.store.write_groups`)."""
    sampling = compute_sampling_grid(rig, progress=progress)
    products = build_grid_products(sampling, align_corners)
    path = store_path(out_dir, rig.name)
    report = write_groups(
        path,
        root_attrs=root_attributes(rig),
        groups={"grid": grid_group(products, rig)},
        force=force,
        replace_groups=GRID_COMMAND_GROUPS,
    )
    return GridRunResult(rig, path, products, summarise_cameras(rig, products), report)


def total_grid_cells(rig: RigConfig) -> int:
    return rig.n_cam * len(rig.bev.heights) * rig.bev.ny * rig.bev.nx


def as_float_list(values: np.ndarray) -> list[float]:
    return [float(v) for v in np.asarray(values).ravel()]
