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


def fastbev_lut_torch(
    cameras: list[dict[str, Any]],
    lidar: dict[str, Any],
    stride: int,
    feature_size: tuple[int, int],
    n_voxels: Sequence[int],
    voxel_size: Sequence[float],
    point_cloud_range: Sequence[float],
    matmul: str = "ordered",
) -> np.ndarray:
    """Fast-BEV's own float32 code path in torch, restated from Sense-GVT/Fast-BEV:
    ``RandomAugImageMultiViewImage.rts2proj`` / ``img_transform`` (mmdet3d/datasets/pipelines/
    transforms_3d.py, commit feacd875022cf2733fc1cf953f97fd735966a221), ``KittiSetOrigin``
    (mmdet3d/datasets/pipelines/multi_view.py, same commit), ``get_points``,
    ``_compute_projection`` and ``backproject_inplace`` (mmdet3d/models/detectors/fastbev.py,
    commit b0603230c89f7ef4d422672cb6fda476727aa78b).

    ``cameras``: per camera ``rotation_wxyz``, ``translation``, ``intrinsic``, ``resize``, ``crop``
    (the test-time augmentation) and optionally ``flip`` (True: the second pass of
    ``TestTimeAugImageMultiViewImage``, the image mirrored by ``img_transform``; needs ``input_size``
    ``(fW, fH)``, the crop window); the camera -> lidar pose is mmdet3d's ``sensor2lidar``
    (:func:`mmdet3d_sensor2lidar`) of one static pose, or of one sample's ego poses when the
    camera and ``lidar`` dicts hold ``ego2global`` = ``(rotation matrix, translation)`` (the ego
    pose when that sensor fired). Returns the LUT in Fast-BEV's volume order
    ``(X, Y, Z)``: ``(cam * H_f + y) * W_f + x`` of the feature pixel the voxel takes (later cameras
    overwrite earlier ones, as ``volume[:, valid[i]] = ...`` does), -1 where none sees it.

    ``matmul``: how ``torch.bmm(projection, points)`` is evaluated. ``"ordered"`` (the proof
    tests): each ``p_i = ((m_i0 x + m_i1 y) + m_i2 z) + m_i3``, float32 products and sums in index
    order, each rounded (torch elementwise ops: the same bits on every CPU), the result of a
    reference GEMM without FMA, and what MKL's own sgemm gives in its reproducible mode
    (``MKL_CBWR=COMPATIBLE``). ``"bmm"``: ``torch.bmm`` itself, as Fast-BEV writes it; its float32
    rounding is the BLAS kernel's that the CPU dispatches (FMA, blocking), so it moves the odd
    voxel that sits on a rounding edge from machine to machine
    (:func:`fastbev_projected_torch`, ``test_fastbev_bmm_moves_only_voxels_on_a_rounding_edge``)."""
    projected = fastbev_projected_torch(cameras, lidar, stride, n_voxels, voxel_size, point_cloud_range, matmul)
    return fastbev_lut_of_projected(projected, n_voxels, feature_size)


def fastbev_lut_of_projected(projected: list[tuple[np.ndarray, np.ndarray, np.ndarray]], n_voxels: Sequence[int], feature_size: tuple[int, int]) -> np.ndarray:
    """The LUT of :func:`fastbev_lut_torch` from its cameras' :func:`fastbev_projected_torch`
    (``backproject_inplace``'s rounding, bounds and overwrite order)."""
    lut = np.full(int(np.prod(list(n_voxels))), -1, dtype=np.int64)
    w_f, h_f = feature_size
    for cam_index, (u_f, v_f, depth) in enumerate(projected):
        x, y = np.rint(u_f).astype(np.int64), np.rint(v_f).astype(np.int64)  # torch.round: half to even, as np.rint
        valid = (x >= 0) & (y >= 0) & (x < w_f) & (y < h_f) & (depth > 0)
        lut[valid] = (cam_index * h_f + y[valid]) * w_f + x[valid]
    return lut.reshape(*n_voxels)


def fastbev_projected_torch(
    cameras: list[dict[str, Any]],
    lidar: dict[str, Any],
    stride: int,
    n_voxels: Sequence[int],
    voxel_size: Sequence[float],
    point_cloud_range: Sequence[float],
    matmul: str = "ordered",
) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Per camera, ``(p0 / p2, p1 / p2, p2)`` of every voxel (float32, Fast-BEV's voxel order
    flattened) of :func:`fastbev_lut_torch` (same arguments, same sources), before the rounding."""
    import torch

    pc_range = np.array(point_cloud_range, dtype=np.float32)
    origin = (pc_range[:3] + pc_range[3:]) / 2.0  # KittiSetOrigin
    n_vox = torch.tensor(list(n_voxels))
    size = torch.tensor(list(voxel_size))
    points = torch.stack(torch.meshgrid([torch.arange(n_voxels[0]), torch.arange(n_voxels[1]), torch.arange(n_voxels[2])], indexing="ij"))
    new_origin = torch.tensor(origin) - n_vox / 2.0 * size
    points = points * size.view(3, 1, 1, 1) + new_origin.view(3, 1, 1, 1)  # get_points: float32 (3, X, Y, Z)
    flat = torch.cat([points.view(3, -1), torch.ones(1, points[0].numel())], dim=0)  # (4, P)
    out = []
    for cam in cameras:
        rot, tran = mmdet3d_sensor2lidar(cam, lidar, *lidar.get("ego2global", (None, (0.0, 0.0, 0.0))), *cam.get("ego2global", (None, (0.0, 0.0, 0.0))))
        post_rot = torch.eye(2) * cam["resize"]  # img_transform: float32 tensors
        post_tran = torch.zeros(2) - torch.Tensor(cam["crop"])
        f_w, f_h = cam["input_size"] if cam.get("flip", False) else cam.get("input_size", (0, 0))  # crop = (left, top, left + fW, top + fH)
        if cam.get("flip", False):
            a = torch.Tensor([[-1, 0], [0, 1]])
            b = torch.Tensor([f_w, 0])  # crop[2] - crop[0]
            post_rot = a.matmul(post_rot)
            post_tran = a.matmul(post_tran) + b
        a = torch.Tensor([[np.cos(0.0), np.sin(0.0)], [-np.sin(0.0), np.cos(0.0)]])  # get_rot(test_rotate = 0)
        b = torch.Tensor([f_w, f_h]) / 2
        b = a.matmul(-b) + b
        post_rot = a.matmul(post_rot)
        post_tran = a.matmul(post_tran) + b
        post_tran[0] = post_tran[0] + 0  # pad (0, 0, 0, 0): left
        post_tran[1] = post_tran[1] + 0  # top
        ret_rot, ret_tran = np.eye(3), np.zeros(3)
        ret_rot[:2, :2] = post_rot.numpy()
        ret_tran[:2] = post_tran.numpy()
        lidar2cam_r = np.linalg.inv(rot)  # rts2proj
        lidar2cam_t = tran @ lidar2cam_r.T
        lidar2cam_rt = np.eye(4)
        lidar2cam_rt[:3, :3] = lidar2cam_r.T
        lidar2cam_rt[3, :3] = -lidar2cam_t
        intrinsic = np.asarray(cam["intrinsic"], dtype=np.float64)
        viewpad = np.eye(4)
        viewpad[:3, :3] = ret_rot @ intrinsic
        viewpad[:3, 2] += ret_tran
        lidar2img = np.array(viewpad @ lidar2cam_rt.T, dtype=np.float32)
        k = torch.tensor(np.eye(4, dtype=np.float32)[:3, :3])  # _compute_projection
        k[:2] /= stride
        projection = k @ torch.tensor(lidar2img)[:3]
        if matmul == "bmm":
            p = torch.bmm(projection[None], flat[None])[0]  # backproject_inplace
        elif matmul == "ordered":
            p = ((projection[:, 0:1] * flat[0] + projection[:, 1:2] * flat[1]) + projection[:, 2:3] * flat[2]) + projection[:, 3:4] * flat[3]
        else:
            raise ValueError(matmul)
        out.append(((p[0] / p[2]).numpy(), (p[1] / p[2]).numpy(), p[2].numpy()))
    return out


def petr_resize_crop_intrinsics(intrinsic: Any, resize: float, crop: tuple[int, int]) -> np.ndarray:
    """PETR's ``ResizeCropFlipImage`` at test time (megvii-research/PETR,
    projects/mmdet3d_plugin/datasets/pipelines/transform_3d.py, commit
    0677620645e3a4746c5ac6840f6b39432f098a80): ``post_rot = torch.eye(2) * resize`` and
    ``post_tran = -crop[:2]`` (float32 tensors), then ``intrinsics[:2, :3] = post_rot @ intrinsics[:2, :3]``
    and ``intrinsics[:2, 2] += post_tran`` on the float64 ``viewpad`` (numpy promotes). Returns the 4x4."""
    import torch

    viewpad = np.eye(4)
    k = np.asarray(intrinsic, dtype=np.float64)
    viewpad[:3, :3] = k
    post_rot = (torch.eye(2) * resize).numpy()
    post_tran = (torch.zeros(2) - torch.tensor([float(crop[0]), float(crop[1])])).numpy()
    viewpad[:2, :3] = post_rot @ viewpad[:2, :3]
    viewpad[:2, 2] = post_tran + viewpad[:2, 2]
    return viewpad


def petr_position_coords_torch(
    lidar2img: list[np.ndarray],
    pad_hw: tuple[int, int],
    feature_hw: tuple[int, int],
    depth_num: int = 64,
    depth_start: float = 1.0,
    lid: bool = True,
    position_range: Sequence[float] = (-61.2, -61.2, -10.0, 61.2, 61.2, 10.0),
) -> tuple[np.ndarray, np.ndarray]:
    """PETR's ``PETRHead.position_embeding`` up to the ``inverse_sigmoid`` (megvii-research/PETR,
    projects/mmdet3d_plugin/models/dense_heads/petr_head.py, commit
    0677620645e3a4746c5ac6840f6b39432f098a80), in torch float32 on the CPU: ``coords_h = arange(H) *
    pad_h / H``, LID depths ``depth_start + bin_size * i * (i + 1)`` with ``bin_size = (range[3] -
    depth_start) / (D (1 + D))`` (else ``depth_start + bin_size * i``), ``(u d, v d, d, 1)`` (``d``
    clamped to eps 1e-5), ``img2lidar = float32(np.linalg.inv(lidar2img))``, ``torch.matmul``, the
    position range normalisation, ``coords_mask = count(out of [0, 1]) over (D, 3) > D / 2``.

    Returns ``coords3d`` float32 ``(n_cam, D * 3, H, W)`` (channel ``3 d + axis``, the tensor
    ``inverse_sigmoid`` receives) and ``coords_mask`` bool ``(n_cam, H, W)`` (image padding not
    included: the caller's inputs have none)."""
    import torch

    eps = 1e-5
    pad_h, pad_w = pad_hw
    h, w = feature_hw
    coords_h = torch.arange(h).float() * pad_h / h
    coords_w = torch.arange(w).float() * pad_w / w
    index = torch.arange(start=0, end=depth_num, step=1).float()
    if lid:
        index_1 = index + 1
        bin_size = (position_range[3] - depth_start) / (depth_num * (1 + depth_num))
        coords_d = depth_start + bin_size * index * index_1
    else:
        bin_size = (position_range[3] - depth_start) / depth_num
        coords_d = depth_start + bin_size * index
    d = coords_d.shape[0]
    coords = torch.stack(torch.meshgrid([coords_w, coords_h, coords_d], indexing="ij")).permute(1, 2, 3, 0)  # W, H, D, 3
    coords = torch.cat((coords, torch.ones_like(coords[..., :1])), -1)
    coords[..., :2] = coords[..., :2] * torch.maximum(coords[..., 2:3], torch.ones_like(coords[..., 2:3]) * eps)
    img2lidars = coords.new_tensor(np.asarray([np.linalg.inv(m) for m in lidar2img]))  # (N, 4, 4)
    n = img2lidars.shape[0]
    coords = coords.view(1, w, h, d, 4, 1).repeat(n, 1, 1, 1, 1, 1)
    img2lidars = img2lidars.view(n, 1, 1, 1, 4, 4).repeat(1, w, h, d, 1, 1)
    coords3d = torch.matmul(img2lidars, coords).squeeze(-1)[..., :3]
    r = position_range
    coords3d[..., 0:1] = (coords3d[..., 0:1] - r[0]) / (r[3] - r[0])
    coords3d[..., 1:2] = (coords3d[..., 1:2] - r[1]) / (r[4] - r[1])
    coords3d[..., 2:3] = (coords3d[..., 2:3] - r[2]) / (r[5] - r[2])
    coords_mask = (coords3d > 1.0) | (coords3d < 0.0)
    coords_mask = coords_mask.flatten(-2).sum(-1) > (d * 0.5)  # (N, W, H)
    coords_mask = coords_mask.permute(0, 2, 1)
    coords3d = coords3d.permute(0, 3, 4, 2, 1).contiguous().view(n, -1, h, w)
    return coords3d.numpy(), coords_mask.numpy()


def bevdepth_geometry_float16(
    cameras: list[dict[str, Any]],
    final_dim: tuple[int, int] = (256, 704),
    downsample_factor: int = 16,
    d_bound: Sequence[float] = (2.0, 58.0, 0.5),
    bounds: Sequence[Sequence[float]] = ((-51.2, 51.2, 0.8), (-51.2, 51.2, 0.8), (-5.0, 3.0, 8.0)),
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """BEVDepth's ``create_frustum`` + ``get_geometry`` + voxel index as its float16 training runs
    them (Megvii-BaseDetection/BEVDepth bevdepth/layers/backbones/base_lss_fpn.py @
    d78c7b58b10b9ada940462ba83ab24d99cae5833; PyTorch Lightning ``precision=16``, bevdepth/exps/base_cli.py:
    CUDA autocast), in torch on the CPU, autocast's casts written out: every ``matmul`` takes its
    inputs in float16 and returns float16 (``ida_mat.inverse()``, ``torch.inverse(intrin_mat)`` stay
    float32: ``inverse`` is on neither autocast list); ``points[..., :2] * points[..., 2:3]`` multiplies
    the float16 tensors; ``bda_mat`` (the identity at test time: no BEV augmentation) @ points in
    float16; ``((geom - (voxel_coord - voxel_size / 2)) / voxel_size).int()`` with the float32 buffers
    (float16 ``geom`` promoted to float32), kept iff ``0 <= index < voxel_num``.

    ``cameras``: per camera ``intrinsic`` (3x3), ``sensor2ego`` (4x4, camera -> ego; made float32),
    ``resize`` and ``crop`` (BEVDepth's test-time ``ida_mat``). Returns per camera the voxel index
    ``(z * ny + y) * nx + x`` of every frustum point ``(D, fH, fW)`` (-1 where dropped: out of range,
    and the overflowed points, whose inf / NaN ``.int()`` gives ``INT_MIN`` on x86) and the float16
    points ``(D, fH, fW, 3)`` as float32."""
    import torch

    ogf_h, ogf_w = final_dim
    fh, fw = ogf_h // downsample_factor, ogf_w // downsample_factor
    d = torch.arange(*d_bound, dtype=torch.float).view(-1, 1, 1).expand(-1, fh, fw)
    xs = torch.linspace(0, ogf_w - 1, fw, dtype=torch.float).view(1, 1, fw).expand(d.shape[0], fh, fw)
    ys = torch.linspace(0, ogf_h - 1, fh, dtype=torch.float).view(1, fh, 1).expand(d.shape[0], fh, fw)
    frustum = torch.stack((xs, ys, d, torch.ones_like(d)), -1)  # D x H x W x 4 (float32 buffer)
    voxel_size = torch.Tensor([row[2] for row in bounds])
    voxel_coord = torch.Tensor([row[0] + row[2] / 2.0 for row in bounds])
    voxel_num = [int((row[1] - row[0]) / row[2]) for row in bounds]
    bda_mat = torch.eye(4)
    voxels, points_out = [], []
    for cam in cameras:
        ida_mat = torch.eye(4)
        ida_mat[:2, :2] = torch.eye(2) * cam["resize"]
        ida_mat[:2, 3] = torch.zeros(2) - torch.Tensor(cam["crop"])
        intrin_mat = torch.eye(4)
        intrin_mat[:3, :3] = torch.Tensor(np.asarray(cam["intrinsic"], dtype=np.float64))
        sensor2ego_mat = torch.Tensor(np.asarray(cam["sensor2ego"], dtype=np.float64))
        points = ida_mat.inverse().half().matmul(frustum.unsqueeze(-1).half())  # autocast: matmul in float16
        points = torch.cat((points[..., :2, :] * points[..., 2:3, :], points[..., 2:, :]), -2)
        combine = sensor2ego_mat.half().matmul(torch.inverse(intrin_mat).half())
        points = combine.matmul(points)
        geom = (bda_mat.half() @ points).squeeze(-1)[..., :3]
        index = ((geom - (voxel_coord - voxel_size / 2.0)) / voxel_size).int()
        kept = torch.ones(index.shape[:-1], dtype=torch.bool)
        for axis in range(3):
            kept &= (index[..., axis] >= 0) & (index[..., axis] < voxel_num[axis])
        flat = (index[..., 2] * voxel_num[1] + index[..., 1]) * voxel_num[0] + index[..., 0]
        voxels.append(torch.where(kept, flat, -1).numpy())
        points_out.append(geom.float().numpy())
    return voxels, points_out
