"""``bevcompile matrix --precision float16``: BEVDepth's ``get_geometry`` as its float16 training
computes it (:mod:`bevcompile.matrix.lift16`, a numpy emulation of float16 per op), proven against
BEVDepth's code path restated in torch float16 on the CPU (tests/upstream.py
``bevdepth_geometry_float16``), not against bevcompile's own float32 or float64 products."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from bevcompile.cli import app
from bevcompile.errors import UsageError
from bevcompile.matrix.build import MatrixOptions, build_matrix
from bevcompile.matrix.lift16 import FLOAT16_CULL_MARGIN_M, bevdepth_points_float16, matmul_float16, to_float16
from bevcompile.matrix.lift32 import bevdet_points_float32
from bevcompile.rig.config import RigConfig, parse_config
from bevcompile.store.inspection import inspect_store
from bevcompile.store.loader import load
from bevcompile.store.verify import verify_store

from .. import upstream
from ..rig.test_presets import calibration_with
from ..rigs import write_yaml
from .test_lift32 import SUM_POOLING, _voxel_of_column

runner = CliRunner()


@functools.lru_cache(maxsize=1)
def _bevdepth() -> tuple[RigConfig, np.ndarray, np.ndarray]:
    """The ``bevdepth-r50`` rig, and BEVDepth's float16 run on it: every frustum point's voxel
    (473,088, camera by camera, -1 where dropped) and its float16 point ``(n, 3)``."""
    rig = parse_config(calibration_with("bevdepth-r50"))
    cameras = [
        {"intrinsic": cam.intrinsic, "sensor2ego": cam.ego_from_cam, "resize": cam.image_aug.resize, "crop": [cam.image_aug.crop_left, cam.image_aug.crop_top]}
        for cam in rig.cameras
    ]
    voxels, points = upstream.bevdepth_geometry_float16(cameras)
    return rig, np.concatenate([v.reshape(-1) for v in voxels]), np.concatenate([p.reshape(-1, 3) for p in points])


def test_convention_float16_matmul_is_torchs_cpu_half_matmul() -> None:
    """A float16 ``matmul`` is the float16 inputs' products summed in float32 in index order and
    rounded once to float16 (half to even, overflow to inf): ``torch.matmul`` of float16 tensors
    on this CPU, bit for bit, on 100,000 random 4-vectors up to 4,000 (and with inf)."""
    rng = np.random.default_rng(3)
    matrix = rng.normal(size=(4, 4)).astype(np.float16).astype(np.float32)
    vectors = to_float16(rng.normal(size=(4, 100_000)) * 4000.0)
    vectors[1, :10] = np.inf
    ours = np.stack(matmul_float16(matrix, list(vectors)))
    theirs = torch.from_numpy(matrix).half().matmul(torch.from_numpy(vectors).half()).float().numpy()
    assert np.array_equal(ours, theirs, equal_nan=True)
    assert np.isnan(ours[:, :10]).any() or np.isinf(ours[:, :10]).all()
    assert float(to_float16(65519.0)) == 65504.0 and np.isinf(to_float16(65520.0))


def test_bevdepth_float16_points_equal_bevdepths_float16_run_bit_for_bit() -> None:
    """The emulated float16 points of every camera are BEVDepth's float16 run's, bit for bit, inf
    and NaN included (473,088 points x 3). 24,096 points overflow (``pixel x depth`` beyond 65,504:
    image column x / 0.44 times a depth of 41.5 m and more); the finite ones lie within 0.084 m of
    the float32 lift's, far inside the float16 culling margin."""
    rig, _voxels, theirs = _bevdepth()
    ours = np.concatenate([bevdepth_points_float16(rig, cam).reshape(-1, 3) for cam in range(rig.n_cam)])
    assert ours.shape == theirs.shape == (473_088, 3)
    assert np.array_equal(ours, theirs, equal_nan=True)
    finite = np.isfinite(ours).all(axis=1)
    assert int(np.count_nonzero(~finite)) == 24_096
    depths = np.tile(np.repeat(np.asarray(rig.depth.values()), 16 * 44), rig.n_cam)
    assert float(depths[~finite].min()) == 41.5
    p32 = np.concatenate([bevdet_points_float32(rig, cam).reshape(-1, 3) for cam in range(rig.n_cam)])
    deviation = float(np.abs(ours[finite] - p32[finite]).max())
    assert deviation == pytest.approx(0.0838, abs=5e-4) and deviation < FLOAT16_CULL_MARGIN_M / 5


def test_bevdepth_float16_matrix_equals_bevdepths_float16_voxel_assignment_of_every_point() -> None:
    """calibration + ``preset: bevdepth-r50``, the sum-pooling matrix (``--topk 0 --splat nearest
    --normalize sum --rounding trunc``) with ``--precision float16``: every one of the 473,088
    frustum points is in the matrix iff BEVDepth's float16 run keeps it, in the same BEV cell
    (one z bin). Overflowed points are dropped, as that CPU run drops them (their ``.int()`` is
    INT_MIN). Measured: the float16 run puts 12,752 points elsewhere than the float32 run (5,988
    of them are the overflowed points the float32 run keeps; the rest moved to another cell or out
    of the grid), and the float32 matrix differs from the float16 run in exactly those points."""
    rig, voxels, _points = _bevdepth()
    kept = np.flatnonzero(voxels >= 0)
    theirs = dict(zip(kept.tolist(), voxels[kept].tolist(), strict=True))
    m16 = build_matrix(rig, MatrixOptions(**SUM_POOLING, precision="float16"))
    assert np.all(m16.coo_val == 1.0) and m16.options.to_dict()["precision"] == "float16"
    assert _voxel_of_column(m16) == theirs and len(theirs) == 341_190
    m32 = build_matrix(rig, MatrixOptions(**SUM_POOLING, precision="float32"))
    ours32 = _voxel_of_column(m32)
    differ = {c for c in set(ours32) | set(theirs) if ours32.get(c, -1) != theirs.get(c, -1)}
    assert len(differ) == 12_752
    overflowed = set(np.flatnonzero(~np.isfinite(_points).all(axis=1)).tolist())
    assert len(overflowed & set(ours32)) == 5_988 and not overflowed & set(theirs)


def test_matrix_float16_is_recorded_rebuilt_by_strict_and_checked(tmp_path: Path) -> None:
    """``--precision float16`` is in ``build_options``; ``inspect --strict`` rebuilds it bit for bit,
    the plain checks' pooling reference uses the same float16 points, and verify passes."""
    config = write_yaml(tmp_path / "bevdepth.yaml", calibration_with("bevdepth-r50"))
    args = ["matrix", str(config), "--out", str(tmp_path), "--topk", "0", "--splat", "nearest", "--rounding", "trunc", "--quiet"]
    result = runner.invoke(app, [*args, "--precision", "Float16"])
    assert result.exit_code == 0, result.output
    store = tmp_path / "bevdepth-r50.zarr"
    assert load(store)["matrix"].attrs["build_options"]["precision"] == "float16"
    report = inspect_store(store, strict=True)
    assert report.passed, report.failure_lines()
    assert any("float16 points" in r.note for r in verify_store(store).rows)


@pytest.mark.parametrize(
    ("args", "phrase"),
    [
        (["--mode", "grid"], "--precision float16 restates BEVDepth's float16 get_geometry: --mode frustum only (--mode grid)"),
        (["--precision", "bfloat16"], "--precision must be one of float64, float32, float16, got 'bfloat16'"),
    ],
)
def test_bad_matrix_float16_is_a_usage_error(tmp_path: Path, args: list[str], phrase: str) -> None:
    config = write_yaml(tmp_path / "bevdepth.yaml", calibration_with("bevdepth-r50"))
    result = runner.invoke(app, ["matrix", str(config), "--out", str(tmp_path), "--quiet", "--precision", "float16", *args])
    assert result.exit_code == 2 and phrase in " ".join(result.output.split()), result.output
    assert not (tmp_path / "bevdepth-r50.zarr").exists()


def test_float16_needs_the_linspace_frustum_and_pinhole_cameras(small: RigConfig) -> None:
    with pytest.raises(UsageError, match=r"--precision float16 restates BEVDepth.s float16 get_geometry, whose frustum is linspace"):
        build_matrix(small, MatrixOptions(mode="frustum", precision="float16"))
    data: dict[str, Any] = calibration_with("bevdepth-r50")
    data["cameras"][0]["distortion"] = {"model": "opencv", "coeffs": [0.01, 0.0, 0.0, 0.0]}
    with pytest.raises(UsageError, match=r"--precision float16 restates BEVDepth.s pinhole get_geometry; camera CAM_FRONT has a opencv lens"):
        bevdepth_points_float16(parse_config(data), parse_config(data).camera_names.index("CAM_FRONT"))
