"""PETR's 3D position coordinates. Pure numpy: config dataclasses in, arrays out (the
``interop/`` group is written by :mod:`bevcompile.interop.export`).

PETR position coordinates (``--to petr-coords3d``)
--------------------------------------------------
PETR (and PETRv2) give every feature pixel of every camera a 3D position embedding computed
from the calibration alone (``PETRHead.position_embeding``): the pixel's ray sampled at
``depth_num`` depths along the camera z axis, each point in the BEV frame (``bev.frame``; PETR's
lidar frame) and normalised by ``position_range``. For a fixed rig that tensor is a constant:
this target stores it, so the deployed network starts at ``inverse_sigmoid`` +
``position_encoder`` (or takes the embedding the same way once more offline).

* feature pixel ``(i, j)`` of level 0 (PETR's ``position_level``) sits at input pixel
  ``u_in = j * W_in / W_f``, ``v_in = i * H_in / H_f`` (PETR's ``arange(W) * pad_w / W``, whatever
  ``feature.pixel_mapping`` says; ``W_in, H_in`` the padded network input);
* depth ``k``: ``depth_start + b k (k + 1)``, ``b = (position_range[3] - depth_start) / (D (1 + D))``
  with ``lid`` (linear-increasing bins), else ``depth_start + k (position_range[3] - depth_start) / D``;
* ``coords3d[cam, 3 k + a, i, j] = (p_a - range_min_a) / (range_max_a - range_min_a)``, ``p`` the
  point in the BEV frame, ``a`` = x, y, z;
* ``coords_mask[cam, i, j]``: PETR's mask, True where more than ``D / 2`` of the ``3 D`` normalised
  coordinates fall outside [0, 1], or where the pixel lies in the image padding (PETR's ``masks``:
  the nearest-interpolated padding of the input), or where the lens gives the pixel no ray.
  Informational: ``PETRHead.forward`` discards the mask ``position_embeding`` returns
  (``coords_position_embeding, _ = ...``, petr_head.py @0677620); only the padding masks reach
  its transformer (docs/interop.md).

``precision``: ``float64`` (default: each point from the rig's lens model in float64, rounded
once to float32) or ``float32`` (PETR's own op sequence in float32: ``img2lidar =
float32(inv(lidar2img))``, ``(u d, v d, d, 1)``, the 4x4 products summed in order; pinhole
cameras only), which equals a PETR float32 CPU run bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from ..errors import UsageError
from ..matrix.lift32 import pinhole_for_float32
from ..rig.config import INTEROP_CHOICES, INTEROP_INT_OPTIONS, RigConfig
from ..rig.geometry import (
    bev_from_cam_matrix,
    cam_from_bev_matrix,
    input_px_to_image_px,
    transform_points,
    unproject_image_to_cam,
)

PETR_COORDS_ARRAY = "petr_coords3d"
PETR_MASK_ARRAY = "petr_coords_mask"
PETR_ARRAYS = (PETR_COORDS_ARRAY, PETR_MASK_ARRAY)
PRECISIONS = INTEROP_CHOICES["petr-coords3d"]["precision"]
DEPTH_NUM_RANGE = INTEROP_INT_OPTIONS["petr-coords3d"]["depth_num"]
PETR_POSITION_RANGE = (-61.2, -61.2, -10.0, 61.2, 61.2, 10.0)
"""``position_range`` of PETR's released nuScenes configs (the default here)."""
_EPS = 1e-5  # PETR clamps the depth to eps before multiplying (u, v) by it


@dataclass(frozen=True)
class PetrOptions:
    """``depth_num`` depths from ``depth_start`` (metres, camera z) with linear-increasing bins
    (``lid``) or uniform ones, normalised by ``position_range`` (min x, y, z, max x, y, z; metres
    in the BEV frame); ``precision`` as the module docstring says. Defaults: PETR's released
    configs (64 LID depths from 1 m, range +-61.2 m x +-61.2 m x +-10 m)."""

    depth_num: int = 64
    depth_start: float = 1.0
    lid: bool = True
    position_range: tuple[float, ...] = field(default=PETR_POSITION_RANGE)
    precision: str = "float64"

    def validate(self) -> None:
        lo, hi = DEPTH_NUM_RANGE
        if isinstance(self.depth_num, bool) or not isinstance(self.depth_num, int) or not lo <= self.depth_num <= hi:
            raise UsageError(f"petr-coords3d depth_num must be an integer in [{lo}, {hi}], got {self.depth_num!r}")
        if not isinstance(self.lid, bool):
            raise UsageError(f"petr-coords3d lid must be a boolean, got {self.lid!r}")
        if not np.isfinite(self.depth_start) or not self.depth_start > 0:
            raise UsageError(f"petr-coords3d depth_start must be > 0, got {self.depth_start!r}")
        r = self.position_range
        if len(r) != 6 or not all(np.isfinite(v) for v in r) or not all(r[a] < r[a + 3] for a in range(3)):
            raise UsageError(f"petr-coords3d position_range must be six numbers with min < max per axis, got {list(r)!r}")
        if not r[3] > self.depth_start:
            raise UsageError(f"petr-coords3d position_range max x ({r[3]:g}) must exceed depth_start ({self.depth_start:g}): PETR's last depth bin ends there")
        if self.precision not in PRECISIONS:
            raise UsageError(f"--precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "depth_num": self.depth_num,
            "depth_start": self.depth_start,
            "lid": self.lid,
            "position_range": list(self.position_range),
            "precision": self.precision,
        }

    @classmethod
    def from_dict(cls, data: Any) -> PetrOptions:
        if not isinstance(data, dict):
            raise UsageError(f"petr-coords3d build_options must be a mapping, got {type(data).__name__}")
        unknown = set(data) - {"depth_num", "depth_start", "lid", "position_range", "precision"}
        if unknown:
            raise UsageError(f"unknown petr-coords3d build option(s): {', '.join(sorted(unknown))}")
        try:
            position_range = tuple(float(v) for v in data.get("position_range", PETR_POSITION_RANGE))
            depth_start = float(data.get("depth_start", 1.0))
        except (TypeError, ValueError) as exc:
            raise UsageError(f"petr-coords3d build_options: {exc}") from None
        options = cls(
            depth_num=data.get("depth_num", 64),
            depth_start=depth_start,
            lid=data.get("lid", True),
            position_range=position_range,
            precision=str(data.get("precision", "float64")),
        )
        options.validate()
        return options


@dataclass(frozen=True)
class PetrCoords:
    """Convention: ``coords3d`` float32 ``(n_cam, 3 * depth_num, H_f, W_f)``, channel ``3 k + a``
    (depth ``k``, axis ``a`` = x, y, z of the BEV frame), unitless in [0, 1] inside
    ``position_range`` (0 where the lens gives the pixel no ray); ``coords_mask`` bool
    ``(n_cam, H_f, W_f)``, True = PETR masks the pixel; ``depths`` float64 ``(depth_num,)`` metres
    (camera z) as the build evaluated them."""

    coords3d: npt.NDArray[np.float32]
    coords_mask: npt.NDArray[np.bool_]
    depths: npt.NDArray[np.float64]
    feature_size: tuple[int, int]
    options: PetrOptions

    def arrays(self) -> dict[str, np.ndarray]:
        return {PETR_COORDS_ARRAY: self.coords3d, PETR_MASK_ARRAY: self.coords_mask}


def petr_depths(options: PetrOptions) -> npt.NDArray[np.float64]:
    """The ``depth_num`` sample depths (metres along camera z), in float64."""
    k = np.arange(options.depth_num, dtype=np.float64)
    if options.lid:
        bin_size = (options.position_range[3] - options.depth_start) / (options.depth_num * (1 + options.depth_num))
        return options.depth_start + bin_size * k * (k + 1)
    return options.depth_start + (options.position_range[3] - options.depth_start) / options.depth_num * k


def petr_depths_float32(options: PetrOptions) -> npt.NDArray[np.float32]:
    """The depths as PETR's float32 tensors give them: ``depth_start + (bin_size * k) * (k + 1)``
    (``bin_size`` a Python float, rounded to float32 by the tensor product)."""
    f32 = np.float32
    k = np.arange(options.depth_num, dtype=f32)
    if options.lid:
        bin_size = (options.position_range[3] - options.depth_start) / (options.depth_num * (1 + options.depth_num))
        return f32(options.depth_start) + (f32(bin_size) * k) * (k + f32(1.0))
    bin_size = (options.position_range[3] - options.depth_start) / options.depth_num
    return f32(options.depth_start) + f32(bin_size) * k


def petr_input_px(rig: RigConfig) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
    """Input pixel of every feature column and row of level 0: ``(j * W_in / W_f, i * H_in / H_f)``
    (PETR's ``arange(W).float() * pad_w / W``, evaluated in float32 as PETR does; exact when the
    input is a multiple of the feature map)."""
    level = rig.level(0)
    w_in, h_in = level.input_size
    w_f, h_f = level.feature_size
    f32 = np.float32
    u = (np.arange(w_f, dtype=f32) * f32(w_in)) / f32(w_f)
    v = (np.arange(h_f, dtype=f32) * f32(h_in)) / f32(h_f)
    return u.astype(np.float64), v.astype(np.float64)


def padding_mask(rig: RigConfig) -> npt.NDArray[np.bool_]:
    """PETR's ``masks`` of one camera: True where the feature pixel's nearest input pixel
    (``F.interpolate(mode='nearest')``: ``floor(j * W_in / W_f)``) lies in the image padding.

    Convention: returns bool ``(n_cam, H_f, W_f)``."""
    level = rig.level(0)
    w_in, h_in = level.input_size
    w_f, h_f = level.feature_size
    f32 = np.float32
    out = np.zeros((rig.n_cam, h_f, w_f), dtype=bool)
    src_u = np.minimum(np.floor(np.arange(w_f, dtype=f32) * f32(w_in / w_f)), w_in - 1)
    src_v = np.minimum(np.floor(np.arange(h_f, dtype=f32) * f32(h_in / h_f)), h_in - 1)
    for cam_index, camera in enumerate(rig.cameras):
        aug = camera.image_aug
        out[cam_index] = (src_v[:, None] >= h_in - aug.pad_bottom) | (src_u[None, :] >= w_in - aug.pad_right)
    return out


def _normalise(points: np.ndarray, position_range: tuple[float, ...]) -> np.ndarray:
    lo = np.asarray(position_range[:3], dtype=points.dtype)
    span = np.asarray([position_range[a + 3] - position_range[a] for a in range(3)], dtype=points.dtype)
    return (points - lo) / span


def _points_float64(rig: RigConfig, cam_index: int, depths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(D, H_f, W_f, 3)`` BEV-frame points of one camera in float64 through its lens model, and
    ``(H_f, W_f)`` whether the lens gives each pixel a ray."""
    camera = rig.cameras[cam_index]
    u_in, v_in = petr_input_px(rig)
    uv_in = np.stack(np.broadcast_arrays(u_in[None, :], v_in[:, None]), axis=-1)  # (H_f, W_f, 2)
    uv_image = input_px_to_image_px(camera, uv_in[..., 0], uv_in[..., 1])
    ray_cam, ok = unproject_image_to_cam(camera, uv_image, 1.0)  # (x, y, 1): the point at depth d is d times it
    points_cam = ray_cam[None] * depths[:, None, None, None]
    points = transform_points(bev_from_cam_matrix(rig, camera), points_cam)
    return points, np.asarray(ok, dtype=bool)


def petr_lidar2img(rig: RigConfig, cam_index: int) -> npt.NDArray[np.float64]:
    """PETR's ``lidar2img`` (4x4, float64) of one camera: ``viewpad @ cam_from_bev`` with
    ``viewpad[:2, :3] = float32(resize) K[:2, :3]`` and ``viewpad[:2, 2] -= float32(crop)``
    (``ResizeCropFlipImage``'s float32 ``post_rot`` / ``post_tran`` applied to the float64 intrinsics)."""
    camera = rig.cameras[cam_index]
    aug = camera.image_aug
    viewpad = np.eye(4)
    viewpad[:3, :3] = np.array(camera.intrinsic, dtype=np.float64)
    resize = float(np.float32(aug.resize))
    viewpad[:2, :3] = np.diag([resize, resize]) @ viewpad[:2, :3]
    viewpad[:2, 2] = np.array([-float(np.float32(aug.crop_left)), -float(np.float32(aug.crop_top))]) + viewpad[:2, 2]
    return viewpad @ cam_from_bev_matrix(rig, camera)


def _points_float32(rig: RigConfig, cam_index: int, depths: np.ndarray) -> np.ndarray:
    """``(D, H_f, W_f, 3)`` float32 BEV-frame points of one camera in PETR's op sequence."""
    pinhole_for_float32(rig, cam_index, "PETR's pinhole position embedding")
    f32 = np.float32
    u_in, v_in = petr_input_px(rig)
    u = u_in.astype(f32)[None, None, :]
    v = v_in.astype(f32)[None, :, None]
    d = depths.astype(f32)[:, None, None]
    dd = np.maximum(d, f32(_EPS))
    shape = (d.shape[0], v.shape[1], u.shape[2])
    c = (np.broadcast_to(u * dd, shape), np.broadcast_to(v * dd, shape), np.broadcast_to(d, shape))
    m = np.linalg.inv(petr_lidar2img(rig, cam_index)).astype(f32)
    out = np.empty((*shape, 3), dtype=f32)
    for a in range(3):
        out[..., a] = ((m[a, 0] * c[0] + m[a, 1] * c[1]) + m[a, 2] * c[2]) + m[a, 3]
    return out


def build_petr_coords(rig: RigConfig, options: PetrOptions | None = None) -> PetrCoords:
    """PETR's position coordinates and mask for ``rig`` (level 0; deterministic)."""
    options = options or PetrOptions()
    options.validate()
    level = rig.level(0)
    w_f, h_f = level.feature_size
    n_d = options.depth_num
    coords = np.zeros((rig.n_cam, n_d, 3, h_f, w_f), dtype=np.float32)
    no_ray = np.zeros((rig.n_cam, h_f, w_f), dtype=bool)
    if options.precision == "float32":
        depths32 = petr_depths_float32(options)
        depths = depths32.astype(np.float64)
        for cam_index in range(rig.n_cam):
            points = _points_float32(level, cam_index, depths32)
            lo = np.asarray(options.position_range[:3], dtype=np.float64).astype(np.float32)
            span = np.asarray([options.position_range[a + 3] - options.position_range[a] for a in range(3)], dtype=np.float64).astype(np.float32)
            coords[cam_index] = np.moveaxis((points - lo) / span, -1, 1)
    else:
        depths = petr_depths(options)
        for cam_index in range(rig.n_cam):
            points, ok = _points_float64(level, cam_index, depths)
            normalised = np.where(ok[None, ..., None], _normalise(points, options.position_range), 0.0)
            coords[cam_index] = np.moveaxis(normalised, -1, 1).astype(np.float32)
            no_ray[cam_index] = ~ok
    mask = coords_mask_of(coords.reshape(rig.n_cam, n_d * 3, h_f, w_f)) | padding_mask(level) | no_ray
    return PetrCoords(coords.reshape(rig.n_cam, n_d * 3, h_f, w_f), mask, depths, (w_f, h_f), options)


def coords_mask_of(coords3d: np.ndarray) -> npt.NDArray[np.bool_]:
    """PETR's coordinate mask: more than ``D / 2`` of a pixel's ``3 D`` normalised coordinates
    outside [0, 1]. Convention: ``(n_cam, 3 D, H_f, W_f)`` -> bool ``(n_cam, H_f, W_f)``."""
    outside = (coords3d > 1.0) | (coords3d < 0.0)
    return np.asarray(outside.sum(axis=1) > (coords3d.shape[1] // 3) * 0.5)


def petr_attrs(result: PetrCoords, rig: RigConfig) -> dict[str, Any]:
    """The ``interop/`` attributes of the PETR target: formulas and measured figures."""
    options = result.options
    w_f, h_f = result.feature_size
    inside = (result.coords3d >= 0.0) & (result.coords3d <= 1.0)
    return {
        "shape_order": "(n_cam, 3 * depth_num, H_f, W_f), channel 3 k + a (depth k, axis a = x, y, z)",
        "frame": rig.bev.frame,
        "feature_size": [w_f, h_f],
        "pixel": "u_in = j * W_in / W_f, v_in = i * H_in / H_f (level 0)",
        "depths": [float(d) for d in result.depths],
        "depth_rule": ("depth_start + b k (k + 1), b = (position_range[3] - depth_start) / (D (1 + D))" if options.lid
                       else "depth_start + k (position_range[3] - depth_start) / D"),
        "value": "(p - range_min) / (range_max - range_min) of the BEV-frame point at depth k along camera z",
        "mask": "True where > D / 2 of the 3 D coordinates are outside [0, 1], in the image padding, or without a lens ray",
        "n_masked": int(np.count_nonzero(result.coords_mask)),
        "inside_fraction": float(np.count_nonzero(inside) / inside.size) if inside.size else 0.0,
        "precision": options.precision,
    }
