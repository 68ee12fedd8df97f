"""The Fast-BEV look-up table. Pure numpy: config dataclasses in, arrays out (the ``interop/``
group is written by :mod:`bevcompile.interop.export`).

Fast-BEV look-up table (``--to fastbev-lut``)
---------------------------------------------
``lut[ih, iy, ix]`` int32 = ``(cam * H_f + v) * W_f + u`` of the nearest feature pixel
(``u = floor(u_f + 0.5)``, ``v = floor(v_f + 0.5)``, the VALID RULE's pixel) of the cell centre
at height ``heights[ih]`` in the camera chosen by the overlap policy, ``-1`` where no camera sees
the cell. Overlap policies (deterministic; Fast-BEV's own CUDA build is a write race):
``first`` (lowest camera index), ``last`` (highest camera index: Fast-BEV's sequential
PyTorch loop, where later cameras overwrite), ``nearest-centre`` (the camera whose sampling
point is closest, in feature pixels, to its feature map's centre ``((W_f-1)/2, (H_f-1)/2)``;
ties to the lower camera index).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from ..errors import UsageError
from ..grid.ipm import SamplingGrid, compute_sampling_grid
from ..rig.config import RigConfig
from .bevpoolv2 import INT32_MAX

OVERLAP_POLICIES = ("first", "last", "nearest-centre")


FASTBEV_LUT_ARRAY = "fastbev_lut"


# --------------------------------------------------------------------------------------
# Fast-BEV LUT
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FastBevOptions:
    """``overlap``: which camera a cell seen by several takes (see module docstring)."""

    overlap: str = "first"

    def validate(self) -> None:
        if self.overlap not in OVERLAP_POLICIES:
            raise UsageError(f"--overlap must be one of {', '.join(OVERLAP_POLICIES)}, got {self.overlap!r}")

    def to_dict(self) -> dict[str, Any]:
        return {"overlap": self.overlap}

    @classmethod
    def from_dict(cls, data: Any) -> FastBevOptions:
        if not isinstance(data, dict):
            raise UsageError(f"fastbev-lut build_options must be a mapping, got {type(data).__name__}")
        unknown = set(data) - {"overlap"}
        if unknown:
            raise UsageError(f"unknown fastbev-lut build option(s): {', '.join(sorted(unknown))}")
        options = cls(overlap=str(data.get("overlap", "first")))
        options.validate()
        return options


@dataclass(frozen=True)
class FastBevLut:
    """Convention: ``lut`` int32 ``(n_heights, ny, nx)``, value ``(cam * H_f + v) * W_f + u``
    or -1; ``n_views`` uint8 ``(n_heights, ny, nx)`` is how many cameras see each cell."""

    lut: npt.NDArray[np.int32]
    n_views: npt.NDArray[np.uint8]
    feature_size: tuple[int, int]
    options: FastBevOptions

    @property
    def n_seen(self) -> int:
        return int(np.count_nonzero(self.lut >= 0))

    @property
    def n_overlap(self) -> int:
        return int(np.count_nonzero(self.n_views > 1))


def nearest_pixel(uv_feature_px: np.ndarray) -> npt.NDArray[np.int64]:
    """Nearest feature pixel ``floor(uv + 0.5)`` (the VALID RULE's pixel; round half up).

    Convention: ``(..., 2)`` float ``(u, v)`` -> int64 ``(..., 2)`` ``(u, v)``.
    """
    uv = np.asarray(uv_feature_px, dtype=np.float64)
    return np.floor(np.where(np.isfinite(uv), uv, -2.0) + 0.5).astype(np.int64)


def choose_camera(
    coords_feature_px: np.ndarray, valid: np.ndarray, feature_size: tuple[int, int], overlap: str
) -> npt.NDArray[np.int64]:
    """Camera index each cell takes under an overlap policy, -1 where no camera sees it.

    Convention:
        coords_feature_px ``(n_cam, ...,  2)`` float ``(u, v)``; valid bool ``(n_cam, ...)``.
        returns int64 ``(...)``.
    """
    n_cam = valid.shape[0]
    seen = valid.any(axis=0)
    if overlap == "first":
        cam = np.argmax(valid, axis=0)
    elif overlap == "last":
        cam = n_cam - 1 - np.argmax(valid[::-1], axis=0)
    elif overlap == "nearest-centre":
        w_f, h_f = feature_size
        centre = np.array([(w_f - 1) / 2.0, (h_f - 1) / 2.0])
        uv = np.asarray(coords_feature_px, dtype=np.float64)
        dist2 = np.sum((uv - centre) ** 2, axis=-1)
        dist2 = np.where(valid, dist2, np.inf)
        cam = np.argmin(dist2, axis=0)  # first minimum: ties go to the lower camera index
    else:
        raise UsageError(f"--overlap must be one of {', '.join(OVERLAP_POLICIES)}, got {overlap!r}")
    return np.where(seen, cam, -1).astype(np.int64)


def fastbev_lut_from_grid(grid: SamplingGrid, options: FastBevOptions | None = None) -> FastBevLut:
    """The Fast-BEV LUT from an IPM sampling grid (float64 coords and the VALID RULE)."""
    options = options or FastBevOptions()
    options.validate()
    w_f, h_f = grid.feature_size
    n_cam = grid.valid.shape[0]
    if n_cam * h_f * w_f > INT32_MAX:
        raise UsageError(f"{n_cam} x {h_f} x {w_f} feature pixels do not fit an int32 LUT")
    cam = choose_camera(grid.coords_feature_px, grid.valid, grid.feature_size, options.overlap)
    pick = np.clip(cam, 0, n_cam - 1)
    uv = np.take_along_axis(grid.coords_feature_px, pick[None, ..., None], axis=0)[0]
    iuv = nearest_pixel(uv)
    lut = np.where(cam >= 0, (cam * h_f + iuv[..., 1]) * w_f + iuv[..., 0], -1).astype(np.int32)
    n_views = grid.valid.sum(axis=0).astype(np.uint8)
    return FastBevLut(lut, n_views, grid.feature_size, options)


def build_fastbev_lut(rig: RigConfig, options: FastBevOptions | None = None) -> FastBevLut:
    """The Fast-BEV LUT of ``rig`` (recomputes the float64 grid; deterministic)."""
    return fastbev_lut_from_grid(compute_sampling_grid(rig), options)


def fastbev_gather(lut: np.ndarray, features: np.ndarray) -> npt.NDArray[np.float64]:
    """Apply a Fast-BEV LUT: ``out[c, cell] = features.flat_rows[lut[cell], c]``, 0 where -1.

    Convention: lut int ``(...)``; features ``(n_cam, C, H_f, W_f)``; returns float64 ``(C, ...)``.
    """
    n_cam, c, h_f, w_f = features.shape
    rows = np.moveaxis(np.asarray(features, dtype=np.float64), 1, 0).reshape(c, n_cam * h_f * w_f)
    index = np.asarray(lut, dtype=np.int64)
    return np.where(index >= 0, rows[:, np.clip(index, 0, None)], 0.0)


def fastbev_attrs(result: FastBevLut, rig: RigConfig) -> dict[str, Any]:
    w_f, h_f = result.feature_size
    return {
        "shape_order": "(n_heights, ny, nx)",
        "heights": list(rig.bev.heights),
        "feature_size": [w_f, h_f],
        "value": "(cam * H_f + v) * W_f + u of the nearest feature pixel, -1 where no camera sees the cell",
        "nearest_pixel": "u = floor(u_f + 0.5), v = floor(v_f + 0.5) of grid coords (the VALID RULE's pixel)",
        "overlap": result.options.overlap,
        "overlap_rule": {
            "first": "lowest camera index that sees the cell",
            "last": "highest camera index that sees the cell (Fast-BEV's sequential loop: later cameras overwrite)",
            "nearest-centre": "camera whose sampling point is closest (feature px) to ((W_f-1)/2, (H_f-1)/2); ties to the lower index",
        }[result.options.overlap],
        "n_cells": int(result.lut.size),
        "n_seen": result.n_seen,
        "n_overlap": result.n_overlap,
    }


