"""BEVDepth's lift in float16, as its float16 training computes it (``--precision float16`` of
``bevcompile matrix``).

BEVDepth trains with PyTorch Lightning ``precision=16`` (Megvii-BaseDetection/BEVDepth
``bevdepth/exps/base_cli.py``): its forward runs under CUDA autocast, which casts the inputs of
every ``matmul`` to float16 and returns float16, runs ``inverse`` in its input dtype (float32) and
elementwise ops in their inputs' dtype. ``get_geometry`` (``bevdepth/layers/backbones/base_lss_fpn.py``
@d78c7b58b10b9ada940462ba83ab24d99cae5833) therefore computes, per camera:

1. ``points = float16(inverse(ida_mat)) @ float16(frustum)`` (the 4x4 inverse in float32),
2. ``(x d, y d)`` = ``points[:2] * points[2:3]`` in float16 (beyond ``|x d| >= 65520`` it is inf:
   ``pixel x depth`` overflows float16 for image pixels ``x / resize`` past ~41 m),
3. ``combine = float16(sensor2ego) @ float16(inverse(intrin))`` (the inverse in float32),
4. ``geom = combine @ points`` and ``bda_mat @ geom`` (the identity at test time) in float16,
5. ``((geom - (voxel_coord - voxel_size / 2)) / voxel_size).int()`` in float32 (float16 ``geom``
   promoted by the float32 buffers), kept iff ``0 <= index < voxel_num``.

Each float16 ``matmul`` is emulated as PyTorch's CPU kernel computes it (measured against
``torch.matmul`` on float16 tensors: the same bits): the float16 inputs' products (exact in
float32) summed in float32 in index order, the sum rounded once to float16 (round half to even,
overflow to inf). A GPU's cuBLAS kernel may sum the four products in another order: the float32
sums can then differ in the last bit, which moves a float16 result only at a float16 rounding tie
(not run here: no GPU). Pure numpy.

Points whose float16 geometry is not finite (the overflow beyond ~41 m, and the NaN that
``0 * inf`` and ``inf - inf`` make of them in the later matmuls) are DROPPED: their voxel index
comparisons are false. That is what BEVDepth's code does on the CPU (x86 converts inf and NaN to
the integer ``INT_MIN``, which the range test drops), reproducibly; on a GPU, ``.int()`` converts
NaN to 0 and saturates inf (PTX ``cvt.rzi.s32.f32``), so a CUDA run may put some of these points
into voxel index 0 of an axis instead; that is not reproduced (and not run here).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from ..rig.config import RigConfig
from ..rig.geometry import bev_from_cam_matrix
from .lift32 import frustum_float32, pinhole_for_float32

F32 = npt.NDArray[np.float32]
FLOAT16_CULL_MARGIN_M = 0.5
"""Per-ray depth culling margin of a float16 build: BEVDepth's finite float16 points lie within
0.084 m of the float32 ones on the nuScenes car (``tests/matrix/test_lift16.py``), far inside it, so
culling by the float64 rays never drops a point the float16 in-range test keeps."""


def to_float16(values: Any) -> F32:
    """Round float32 values to float16 (half to even, overflow to inf) and return them as float32
    (exact): the float16 tensor a torch op returns."""
    with np.errstate(over="ignore", invalid="ignore"):
        return np.asarray(values, dtype=np.float32).astype(np.float16).astype(np.float32)


def matmul_float16(matrix: npt.NDArray[np.floating[Any]], vector: list[F32]) -> list[F32]:
    """``float16(matrix) @ vector`` of a float16 ``torch.matmul`` (CPU kernel): per output row the
    products ``m[i, j] * v[j]`` (float16 x float16, exact in float32) summed in float32 in index
    order, the sum rounded to float16.

    Convention: ``matrix`` ``(rows, len(vector))`` (rounded to float16 here), ``vector`` the
    components as float32 arrays holding float16 values (broadcast together); returns ``rows``
    float32 arrays holding float16 values (inf / NaN where they overflow)."""
    m16 = to_float16(matrix)
    out: list[F32] = []
    with np.errstate(over="ignore", invalid="ignore"):
        for i in range(m16.shape[0]):
            acc = m16[i, 0] * vector[0]
            for j in range(1, len(vector)):
                acc = acc + m16[i, j] * vector[j]
            out.append(to_float16(acc))
    return out


def ida_inverse_float32(resize: float, crop_left: float, crop_top: float) -> npt.NDArray[np.float32]:
    """``ida_mat.inverse()`` in float32 of BEVDepth's test-time ``ida_mat`` ``[[r, 0, 0, -l], [0, r,
    0, -t], [0, 0, 1, 0], [0, 0, 0, 1]]`` (float32 ``r``; upper triangular, so LAPACK's ``getri``
    is the triangular inverse): ``1 / r`` on the diagonal, ``-((-l) (1 / r))`` in the last column."""
    f32 = np.float32
    inv_r = f32(1.0) / f32(resize)
    out = np.eye(4, dtype=np.float32)
    out[0, 0] = out[1, 1] = inv_r
    out[0, 3] = -(f32(-crop_left) * inv_r)
    out[1, 3] = -(f32(-crop_top) * inv_r)
    return out


def intrin_inverse_float32(intrinsic: Any) -> npt.NDArray[np.float32]:
    """``torch.inverse(intrin_mat)`` in float32 of BEVDepth's 4x4 ``intrin_mat`` (``K`` padded by the
    identity): ``1 / f`` on the diagonal, ``-(c (1 / f))`` in the third column (as LAPACK gives)."""
    k = np.asarray(intrinsic, dtype=np.float32)
    f32 = np.float32
    out = np.eye(4, dtype=np.float32)
    inv_fx, inv_fy = f32(1.0) / k[0, 0], f32(1.0) / k[1, 1]
    out[0, 0], out[1, 1] = inv_fx, inv_fy
    out[0, 2] = -(k[0, 2] * inv_fx)
    out[1, 2] = -(k[1, 2] * inv_fy)
    return out


def bevdepth_points_float16(
    rig: RigConfig, cam_index: int, depth_slice: slice | None = None, pixels: npt.NDArray[np.integer[Any]] | None = None
) -> npt.NDArray[np.float32]:
    """BEVDepth's ``create_frustum`` + ``get_geometry`` under float16 autocast, for one camera (see
    the module docstring): the float32 frustum (``linspace`` pixels, ``arange`` depths), then the
    float16 op sequence, the test-time ``bda_mat`` (the identity) included.

    Convention: returns float32 ``(D', H_f, W_f, 3)`` points (x, y, z) in the BEV frame holding
    float16 values, inf or NaN where float16 overflowed; ``depth_slice`` / ``pixels`` as
    :func:`bevcompile.matrix.lift32.bevdet_points_float32` takes them (the same elementwise
    operations on fewer points: the same bits)."""
    camera = pinhole_for_float32(rig, cam_index, "BEVDepth's pinhole get_geometry", precision="float16")
    xs, ys, d, shape = frustum_float32(rig, depth_slice, pixels)
    frustum = [np.broadcast_to(to_float16(c), shape) for c in (xs, ys, d, np.ones(1, dtype=np.float32))]
    aug = camera.image_aug
    p0, p1, p2, p3 = matmul_float16(ida_inverse_float32(aug.resize, aug.crop_left, aug.crop_top), frustum)
    with np.errstate(over="ignore", invalid="ignore"):
        lifted = [to_float16(p0 * p2), to_float16(p1 * p2), p2, p3]
    sensor2ego = bev_from_cam_matrix(rig, camera).astype(np.float32)
    inv_intrin = to_float16(intrin_inverse_float32(camera.intrinsic))
    combine = np.empty((4, 4), dtype=np.float32)
    for j in range(4):  # column j of float16(sensor2ego) @ float16(inverse(intrin))
        column = matmul_float16(sensor2ego, [inv_intrin[k, j:j + 1] for k in range(4)])
        combine[:, j] = np.concatenate(column)
    geom = matmul_float16(combine, lifted)
    geom = matmul_float16(np.eye(4, dtype=np.float32), geom)  # bda_mat: the identity at test time (0 * inf = NaN as in torch)
    out = np.empty((*shape, 3), dtype=np.float32)
    for i in range(3):
        out[..., i] = geom[i]
    return out
