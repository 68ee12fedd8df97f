"""Upstream model code paths, restated from their sources for the proof tests (no upstream code
is imported or copied: each function is written here from the cited file, in numpy or torch).

Each function names the repository, file and commit it restates. They take plain numbers (the
calibration as nuScenes stores it), never bevcompile's own geometry, so a test that compares
them with a store compares two independent computations.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

F64 = Any  # numpy float64 arrays


def quaternion_matrix(wxyz: Sequence[float]) -> np.ndarray:
    """pyquaternion's ``Quaternion(w, x, y, z).rotation_matrix`` (the library mmdet3d's converter
    uses), written out: Hamilton convention, normalised first."""
    w, x, y, z = (float(v) for v in wxyz)
    n = np.sqrt(w * w + x * x + y * y + z * z)
    w, x, y, z = w / n, x / n, y / n, z / n
    return np.array(
        [
            [1 - 2 * (y * y + z * z), 2 * (x * y - w * z), 2 * (x * z + w * y)],
            [2 * (x * y + w * z), 1 - 2 * (x * x + z * z), 2 * (y * z - w * x)],
            [2 * (x * z - w * y), 2 * (y * z + w * x), 1 - 2 * (x * x + y * y)],
        ]
    )


def mmdet3d_sensor2lidar(
    cam: dict[str, Any],
    lidar: dict[str, Any],
    e2g_r: np.ndarray | None = None,
    e2g_t: Sequence[float] = (0.0, 0.0, 0.0),
    e2g_r_s: np.ndarray | None = None,
    e2g_t_s: Sequence[float] = (0.0, 0.0, 0.0),
) -> tuple[np.ndarray, np.ndarray]:
    """``obtain_sensor2top`` of open-mmlab/mmdetection3d, tools/data_converter/nuscenes_converter.py
    (commit 010cd4ba8dc6b2ce749216ada9c0e25ab764bb3e): ``(sensor2lidar_rotation, sensor2lidar_translation)``
    of a camera, ``points_lidar = points_cam @ R.T + T``.

    ``cam`` / ``lidar`` hold ``rotation_wxyz`` / ``translation`` (calibrated_sensor, sensor -> ego);
    ``e2g_*`` the lidar sample's ego pose, ``e2g_*_s`` the camera sample's (default: the identity
    for both, one static pose; pass different ones for the per-sample ego motion)."""
    l2e_r_mat = quaternion_matrix(lidar["rotation_wxyz"])
    l2e_t = np.asarray(lidar["translation"], dtype=np.float64)
    l2e_r_s_mat = quaternion_matrix(cam["rotation_wxyz"])
    l2e_t_s = np.asarray(cam["translation"], dtype=np.float64)
    e2g_r_mat = np.eye(3) if e2g_r is None else np.asarray(e2g_r, dtype=np.float64)
    e2g_r_s_mat = np.eye(3) if e2g_r_s is None else np.asarray(e2g_r_s, dtype=np.float64)
    e2g_t_arr = np.asarray(e2g_t, dtype=np.float64)
    e2g_t_s_arr = np.asarray(e2g_t_s, dtype=np.float64)
    r = (l2e_r_s_mat.T @ e2g_r_s_mat.T) @ (np.linalg.inv(e2g_r_mat).T @ np.linalg.inv(l2e_r_mat).T)
    t = (l2e_t_s @ e2g_r_s_mat.T + e2g_t_s_arr) @ (np.linalg.inv(e2g_r_mat).T @ np.linalg.inv(l2e_r_mat).T)
    t -= e2g_t_arr @ (np.linalg.inv(e2g_r_mat).T @ np.linalg.inv(l2e_r_mat).T) + l2e_t @ np.linalg.inv(l2e_r_mat).T
    return r.T, t


def mmdet3d_lidar2img(sensor2lidar_rotation: np.ndarray, sensor2lidar_translation: np.ndarray, intrinsic: Any) -> np.ndarray:
    """The ``lidar2img`` of a camera as mmdet3d-style datasets build it in ``get_data_info``
    (BEVFormer: fundamentalvision/BEVFormer, projects/mmdet3d_plugin/datasets/nuscenes_dataset.py,
    commit 055173321f30b195b5fb43d45c5959ad0890dc45; Fast-BEV's ``rts2proj`` is the same product with
    the augmentation folded into ``viewpad``): ``viewpad @ lidar2cam_rt.T`` in float64."""
    lidar2cam_r = np.linalg.inv(sensor2lidar_rotation)
    lidar2cam_t = sensor2lidar_translation @ lidar2cam_r.T
    lidar2cam_rt = np.eye(4)
    lidar2cam_rt[:3, :3] = lidar2cam_r.T
    lidar2cam_rt[3, :3] = -lidar2cam_t
    k = np.asarray(intrinsic, dtype=np.float64)
    viewpad = np.eye(4)
    viewpad[: k.shape[0], : k.shape[1]] = k
    return viewpad @ lidar2cam_rt.T
