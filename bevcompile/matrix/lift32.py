"""BEVDet's lift in its own float32 op sequence (``--precision float32`` of ``bevcompile matrix``
and of ``export-interop --to bevpoolv2``), and the float32 helpers the other upstream
restatements share.

Pure numpy. The float32 products restate an upstream model's op order and dtype (cited per
function); the float64 products (the default) are bevcompile's exact geometry.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from ..errors import UsageError
from ..rig.config import Camera, RigConfig
from ..rig.geometry import bev_from_cam_matrix

PRECISIONS = ("float64", "float32", "float16")
"""``--precision`` of ``bevcompile matrix`` (float64 first: the default): ``float32`` restates BEVDet's
(and BEVDepth's) float32 lift (:func:`bevdet_points_float32`), ``float16`` BEVDepth's ``get_geometry``
under its float16 training (:func:`bevcompile.matrix.lift16.bevdepth_points_float16`)."""
RESTATES = {"float32": "BEVDet's float32 lift", "float16": "BEVDepth's float16 get_geometry"}
"""What each reduced ``--precision`` of ``bevcompile matrix`` restates (for messages)."""

FLOAT32_CULL_MARGIN_M = 0.01
"""Per-ray depth culling margin of a float32 build: a float32 point of BEVDet's lift is within
~1e-4 m of the float64 point at 60 m (a few ulps of each term), far inside this margin, so culling
by the float64 rays never drops a point the float32 in-range test keeps."""


def pinhole_for_float32(rig: RigConfig, cam_index: int, restates: str, *, flip: bool = False, precision: str = "float32") -> Camera:
    """Camera ``cam_index``, which a ``--precision float32`` restatement of an upstream op
    sequence (``restates``: which one) needs without lens distortion (upstream is pinhole) and,
    unless the restatement states the model's flip (``flip``: Fast-BEV's), without ``image_aug.flip``.

    Raises:
        UsageError: the camera has a distortion model, or flips its image where ``flip`` is False.
    """
    camera = rig.cameras[cam_index]
    if camera.distortion.model != "none":
        raise UsageError(
            f"--precision {precision} restates {restates}; camera {camera.name} has a "
            f"{camera.distortion.model} lens (use --precision float64)"
        )
    if camera.image_aug.flip and not flip:
        raise UsageError(
            f"--precision {precision} restates {restates} without a flipped image; camera {camera.name} "
            "has image_aug.flip (use --precision float64, which follows the flip)"
        )
    return camera


def torch_linspace_float32(start: float, end: float, steps: int) -> npt.NDArray[np.float32]:
    """``torch.linspace(start, end, steps, dtype=torch.float)`` restated: the step in float32,
    ``start + step * i`` below the halfway index and ``end - step * (steps - 1 - i)`` from it,
    each rounded once to float32 (as torch's CPU kernel gives; checked against torch)."""
    f32 = np.float32
    step = float(f32(f32(end) - f32(start)) / f32(max(steps - 1, 1)))
    i = np.arange(steps, dtype=np.float64)
    low = _sum_rounded_once_float32(float(f32(start)), step * i)  # step * i: exact in float64
    high = _sum_rounded_once_float32(float(f32(end)), -(step * (steps - 1 - i)))
    return np.where(i < steps // 2, low, high)


def _sum_rounded_once_float32(a: float, b: npt.NDArray[np.float64]) -> npt.NDArray[np.float32]:
    """``float32(a + b)`` of the EXACT sum (one rounding, half to even), not of the float64 sum:
    where the float64 sum lands exactly halfway between two float32 values, its rounding error
    (TwoSum) decides the side, as a single float32 rounding of the exact sum does."""
    total = a + b
    b_virtual = total - a
    error = (a - (total - b_virtual)) + (b - b_virtual)  # total + error == a + b exactly
    out = total.astype(np.float32)
    nearest = out.astype(np.float64)
    other = np.nextafter(out, np.where(total > nearest, np.float32(np.inf), np.float32(-np.inf))).astype(np.float64)
    tie = (nearest != total) & ((nearest + other) / 2.0 == total) & (error != 0.0)
    toward_other = np.sign(error) == np.sign(other - nearest)
    return np.where(tie & toward_other, other.astype(np.float32), out)


def frustum_float32(
    rig: RigConfig, depth_slice: slice | None = None, pixels: npt.NDArray[np.integer[Any]] | None = None
) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32], npt.NDArray[np.float32], tuple[int, ...]]:
    """The float32 frustum of ``create_frustum`` (BEVDet, BEVDepth): ``torch.linspace`` input-pixel
    columns and rows, ``torch.arange`` depths (double, then cast).

    Convention: ``(xs, ys, d, shape)``, float32 arrays that broadcast to ``shape``: ``(D', H_f, W_f)``
    for the depth bins ``depth_slice`` (default all), or ``(D', P)`` for the flat feature pixels
    ``pixels`` (``v * W_f + u``); ``xs`` / ``ys`` in network-input pixels, ``d`` in metres."""
    w_in, h_in = rig.input_size
    w_f, h_f = rig.feature_size
    depths = np.asarray(rig.depth.values(), dtype=np.float64).astype(np.float32)  # torch.arange: double, then cast
    if depth_slice is not None:
        depths = depths[depth_slice]
    lin_x = torch_linspace_float32(0.0, w_in - 1, w_f)
    lin_y = torch_linspace_float32(0.0, h_in - 1, h_f)
    if pixels is None:
        xs, ys = lin_x[None, None, :], lin_y[None, :, None]
        d = depths[:, None, None]
        shape: tuple[int, ...] = (depths.size, h_f, w_f)
    else:
        xs, ys = lin_x[pixels % w_f][None, :], lin_y[pixels // w_f][None, :]
        d = depths[:, None]
        shape = (depths.size, int(np.size(pixels)))
    return xs, ys, d, shape


def bevdet_points_float32(
    rig: RigConfig, cam_index: int, depth_slice: slice | None = None, pixels: npt.NDArray[np.integer[Any]] | None = None
) -> npt.NDArray[np.float32]:
    """BEVDet's ``create_frustum`` + ``get_lidar_coor`` in its own float32 op sequence (dev3.0),
    for one camera: the linspace frustum and ``arange`` depths in float32, ``points - post_trans``,
    ``inverse(post_rots) @ points`` (``post_rots = float32(resize)``), ``(x d, y d, d)``,
    ``(sensor2ego[:3, :3] @ inverse(cam2img)) @ points + sensor2ego[:3, 3]`` (3x3 products summed
    in order, ``inverse(K)[0, 2] = -(cx * (1 / fx))`` as LAPACK gives), ``sensor2ego`` the float32
    camera pose in the BEV frame.

    Convention: returns float32 ``(D', H_f, W_f, 3)`` points (x, y, z) in the BEV frame, for depth
    bins ``depth_slice`` (default all); with ``pixels`` (flat feature pixels ``v * W_f + u``),
    ``(D', P, 3)`` of those pixels only (the same elementwise operations: the same bits)."""
    camera = pinhole_for_float32(rig, cam_index, "BEVDet's pinhole lift")
    f32 = np.float32
    xs, ys, d, shape = frustum_float32(rig, depth_slice, pixels)
    aug = camera.image_aug
    inv_r = f32(1.0) / f32(aug.resize)
    px = xs - (f32(0.0) - f32(aug.crop_left))  # post_tran = 0 - crop (float32)
    py = ys - (f32(0.0) - f32(aug.crop_top))
    qx, qy = inv_r * px, inv_r * py  # inverse(post_rots) @ points: the zero terms add exactly 0
    p0, p1, p2 = qx * d, qy * d, np.broadcast_to(d, shape).astype(np.float32)
    k = np.array(camera.intrinsic, dtype=np.float32)
    inv_fx, inv_fy = f32(1.0) / k[0, 0], f32(1.0) / k[1, 1]
    k_inv = np.array([[inv_fx, 0.0, -(k[0, 2] * inv_fx)], [0.0, inv_fy, -(k[1, 2] * inv_fy)], [0.0, 0.0, 1.0]], dtype=np.float32)
    pose = bev_from_cam_matrix(rig, camera).astype(np.float32)
    combine = np.empty((3, 3), dtype=np.float32)
    for i in range(3):
        for j in range(3):
            combine[i, j] = (pose[i, 0] * k_inv[0, j] + pose[i, 1] * k_inv[1, j]) + pose[i, 2] * k_inv[2, j]
    out = np.empty((*shape, 3), dtype=np.float32)
    for i in range(3):
        out[..., i] = ((combine[i, 0] * p0 + combine[i, 1] * p1) + combine[i, 2] * p2) + pose[i, 3]
    return out


def scaled_float32(points_bev: npt.NDArray[np.float32], lower: tuple[float, float, float], step: tuple[float, float, float]) -> npt.NDArray[np.float32]:
    """``(p - lower) / step`` per axis in float32 (``lower`` / ``step`` rounded once from float64,
    as BEVDet's float32 tensors are): the voxel coordinate of its ``voxel_pooling_prepare_v2``."""
    low = np.asarray(lower, dtype=np.float64).astype(np.float32)
    size = np.asarray(step, dtype=np.float64).astype(np.float32)
    out: npt.NDArray[np.float32] = (np.asarray(points_bev, dtype=np.float32) - low) / size
    return out
