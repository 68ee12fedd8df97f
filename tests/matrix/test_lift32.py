"""``bevcompile matrix --precision float32``: the frustum points of BEVDet's own float32 lift
(:mod:`bevcompile.matrix.lift32`), proven against the float32 torch transcription of BEVDet's
``get_lidar_coor`` / ``voxel_pooling_prepare_v2`` (tests/interop/test_interop.py), not against
bevcompile's own BEVPoolv2 arrays."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp
import torch
from typer.testing import CliRunner

from bevcompile.cli import app
from bevcompile.errors import UsageError
from bevcompile.matrix.build import MatrixOptions, build_matrix
from bevcompile.rig.config import RigConfig, parse_config
from bevcompile.store.inspection import inspect_store

from ..interop.test_interop import _random_inputs, bevdet_bev_pool_v2, bevdet_voxel_pooling_prepare_v2
from ..rig.test_presets import calibration_with
from ..rigs import write_yaml

runner = CliRunner()
SUM_POOLING = {"mode": "frustum", "topk": 0, "splat": "nearest", "normalize": "sum", "rounding": "trunc", "align": 1}


def _voxel_of_column(m: object) -> dict[int, int]:
    return dict(zip(m.coo_col.tolist(), m.coo_row.tolist(), strict=True))  # type: ignore[attr-defined]


def test_bevdet_r50_float32_matrix_equals_bevdet_float32_voxel_assignment_of_every_point() -> None:
    """calibration + ``preset: bevdet-r50``, the sum-pooling matrix (``--topk 0 --splat nearest
    --normalize sum --rounding trunc``): with ``--precision float32`` every one of the 249,216
    frustum points is in the matrix iff BEVDet's float32 run keeps it, in the same BEV cell (one
    z bin: the cell is ``ranks_bev``), so ``W @ X`` equals BEVDet's ``bev_pool_v2`` up to the
    summation order. Measured with the float64 default: 4 points in another cell (each taken
    from one cell and added to another): W @ X differs from the kernel in those 4 + 4 cells by
    more than 1e-4 (max 0.0192 on these random inputs in [0, 1); the float32 matrix: 0.0)."""
    rig = parse_config(calibration_with("bevdet-r50"))
    ref = bevdet_voxel_pooling_prepare_v2(rig, dtype=torch.float32)
    theirs = dict(zip(ref[1].tolist(), ref[0].tolist(), strict=True))
    m32 = build_matrix(rig, MatrixOptions(**SUM_POOLING, precision="float32"))
    assert np.all(m32.coo_val == 1.0) and m32.options.to_dict()["precision"] == "float32"
    assert _voxel_of_column(m32) == theirs and len(theirs) == 179_806
    m64 = build_matrix(rig, MatrixOptions(**SUM_POOLING))
    ours64 = _voxel_of_column(m64)
    only = set(ours64) ^ set(theirs)
    moved = {c for c in set(ours64) & set(theirs) if ours64[c] != theirs[c]}
    assert (len(only), len(moved)) == (0, 4)
    # W @ X against BEVDet's kernel on the float32 arrays
    depth, feats = _random_inputs(rig, channels=4, seed=11)
    kernel = bevdet_bev_pool_v2(depth, np.moveaxis(feats, 1, -1), ref, (rig.bev.nx, rig.bev.ny, 1))[0]  # (Y, X, C)
    x = np.moveaxis(depth[:, :, None].astype(np.float64) * feats[:, None].astype(np.float64), 2, -1).reshape(-1, feats.shape[1])
    for m, cells, worst in ((m32, 0, 0.0), (m64, 8, 0.0192)):
        w = sp.csr_matrix((m.coo_val.astype(np.float64), (m.coo_row, m.coo_col)), shape=(m.n_rows, m.n_cols))
        diff = np.abs(np.asarray(w @ x).reshape(rig.bev.ny, rig.bev.nx, -1) - kernel).max(axis=-1)
        assert int(np.count_nonzero(diff > 1e-4)) == cells
        assert diff.max() == pytest.approx(worst, abs=1e-4)


def test_matrix_precision_is_recorded_rebuilt_by_strict_and_checked(tmp_path: Path) -> None:
    """``--precision float32`` is in ``build_options`` (float64, the default, is not recorded: older
    stores keep their bytes), ``inspect --strict`` rebuilds it bit for bit and the plain checks'
    pooling reference uses the same float32 points (it would differ in 8 cells otherwise)."""
    config = write_yaml(tmp_path / "bevdet.yaml", calibration_with("bevdet-r50"))
    args = ["matrix", str(config), "--out", str(tmp_path), "--topk", "0", "--splat", "nearest", "--rounding", "trunc", "--quiet"]
    result = runner.invoke(app, [*args, "--precision", "FLOAT32"])
    assert result.exit_code == 0, result.output
    store = tmp_path / "bevdet-r50.zarr"
    report = inspect_store(store, strict=True)
    assert report.passed and any("strict" in c.name or "rebuil" in c.reason for c in report.checks), report.failure_lines()
    from bevcompile.store.loader import load

    assert load(store)["matrix"].attrs["build_options"]["precision"] == "float32"
    assert runner.invoke(app, [*args, "--force"]).exit_code == 0
    assert "precision" not in load(store)["matrix"].attrs["build_options"]


@pytest.mark.parametrize(
    ("args", "phrase"),
    [
        (["--mode", "grid"], "--precision float32 restates BEVDet's float32 lift: --mode frustum only (--mode grid)"),
        (["--precision", "bfloat16"], "--precision must be one of float64, float32, float16, got 'bfloat16'"),
    ],
)
def test_bad_matrix_precision_is_a_usage_error(tmp_path: Path, args: list[str], phrase: str) -> None:
    config = write_yaml(tmp_path / "bevdet.yaml", calibration_with("bevdet-r50"))
    base = ["matrix", str(config), "--out", str(tmp_path), "--quiet"]
    result = runner.invoke(app, [*base, "--precision", "float32", *args])
    assert result.exit_code == 2 and phrase in " ".join(result.output.split()), result.output
    assert not (tmp_path / "bevdet-r50.zarr").exists()


def test_float32_needs_the_linspace_frustum(small: RigConfig) -> None:
    with pytest.raises(UsageError, match=r"BEVDet.s float32 lift, whose frustum is linspace; the rig.s feature\.pixel_mapping is"):
        build_matrix(small, MatrixOptions(mode="frustum", precision="float32"))
