"""``bevcompile export-onnx`` and ``bevcompile export-interop`` on the command line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from typer.testing import CliRunner

from bevcompile.cli import app
from bevcompile.config import RigConfig
from bevcompile.loader import load

from .test_torch_modules import build_grid_store

runner = CliRunner()


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory, small_distorted_multi: RigConfig) -> Path:
    return build_grid_store(small_distorted_multi, tmp_path_factory.mktemp("cli"), npu=True)


def test_export_onnx_prints_histogram_and_writes_the_file(store: Path, tmp_path: Path) -> None:
    out = tmp_path / "gather.onnx"
    result = runner.invoke(app, ["export-onnx", str(store), "--product", "gather", "--out", str(out), "--channels", "4"])
    assert result.exit_code == 0, result.output
    assert "Gather" in result.stdout and "ReduceSum" in result.stdout
    assert "forbidden ops" in result.stdout and "pass" in result.stdout
    assert f"wrote {out}" in " ".join(result.stdout.split())
    assert {n.op_type for n in onnx.load(str(out)).graph.node} >= {"Gather", "Mul", "ReduceSum"}


def test_export_onnx_json(store: Path, tmp_path: Path) -> None:
    out = tmp_path / "g.onnx"
    result = runner.invoke(app, ["export-onnx", str(store), "--out", str(out), "--channels", "2", "--batch", "2", "--reduce", "mean", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["passed"] is True and data["failures"] == []
    assert data["graph"]["forbidden"] == [] and data["graph"]["dynamic"] == []
    assert data["inputs"] == {"features": [2, 4, 2, 8, 12]}
    assert data["output"] == [2, 2, 3, 40, 40]
    assert data["max_abs_vs_reference"] <= 1e-5
    assert data["graph"]["op_histogram"]["Gather"] == 1


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--product", "dense"], "error: --product must be one of gather, ell, tiles, got 'dense'"),
        (["--product", "ell"], "no group matrix/ in this store"),
        (["--channels", "0"], "error: --channels must be in [1, 4096], got 0"),
        (["--exporter", "tvm"], "error: --exporter must be one of legacy, dynamo"),
    ],
)
def test_export_onnx_usage_errors(store: Path, tmp_path: Path, args: list[str], message: str) -> None:
    result = runner.invoke(app, ["export-onnx", str(store), "--out", str(tmp_path / "m.onnx"), *args])
    assert result.exit_code == 2
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "m.onnx").exists()


def test_export_onnx_missing_store(tmp_path: Path) -> None:
    result = runner.invoke(app, ["export-onnx", str(tmp_path / "nope.zarr"), "--out", str(tmp_path / "m.onnx")])
    assert result.exit_code == 2
    assert "no such store" in result.stderr


def test_export_onnx_failed_check_exits_1(store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from bevcompile import onnx_export

    original = onnx_export.ExportOptions

    def tight(**kwargs: object) -> onnx_export.ExportOptions:
        return original(**kwargs, tolerance=1e-30)  # type: ignore[arg-type]

    monkeypatch.setattr(onnx_export, "ExportOptions", tight)
    result = runner.invoke(app, ["export-onnx", str(store), "--out", str(tmp_path / "m.onnx"), "--channels", "3"])
    assert result.exit_code == 1
    assert "onnxruntime output differs from the numpy reference by" in result.stderr
    assert "FAIL" in result.stdout  # the table is still printed
    assert not (tmp_path / "m.onnx").exists() and (tmp_path / "m.rejected.onnx").exists()


def test_export_interop_both_targets_with_npy(store: Path, tmp_path: Path, small_distorted_multi: RigConfig) -> None:
    npy = tmp_path / "npy"
    result = runner.invoke(
        app,
        ["export-interop", str(store), "--to", "bevpoolv2", "--to", "fastbev-lut", "--npy", str(npy),
         "--rounding", "floor", "--frustum-mapping", "rig", "--z-bins", "2", "--overlap", "nearest-centre"],
    )
    assert result.exit_code == 0, result.output
    out = " ".join(result.stdout.split())
    assert "frustum points" in out and "4 x 8 x 8 x 12 = 3,072" in out
    assert "kept points" in out and "intervals (occupied voxels)" in out
    assert "Fast-BEV LUT (overlap nearest-centre)" in out
    for name in ("ranks_bev", "ranks_depth", "ranks_feat", "interval_starts", "interval_lengths", "fastbev_lut"):
        arr = np.load(npy / f"{name}.npy")
        assert arr.dtype == np.int32
        assert np.array_equal(arr, load(store)["interop"][("bevpoolv2_" + name) if name != "fastbev_lut" else name])
    attrs = load(store)["interop"].attrs
    assert attrs["build_options"]["bevpoolv2"] == {"frustum_mapping": "rig", "rounding": "floor", "z_bins": 2}
    assert attrs["bevpoolv2"]["grid_size"] == (40, 40, 2)


def test_export_interop_json(store: Path) -> None:
    result = runner.invoke(app, ["export-interop", str(store), "--to", "bevpoolv2", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["targets"] == ["bevpoolv2"]
    assert data["build_options"]["bevpoolv2"] == {"frustum_mapping": "linspace", "rounding": "trunc", "z_bins": None}
    assert data["bevpoolv2"]["n_points"] == 4 * 8 * 8 * 12
    assert 0 < data["bevpoolv2"]["n_kept"] < data["bevpoolv2"]["n_points"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--to", "lss"], "error: --to must be one of bevpoolv2, fastbev-lut, got 'lss'"),
        (["--to", "fastbev-lut", "--overlap", "random"], "error: --overlap must be one of first, last, nearest-centre"),
        (["--to", "bevpoolv2", "--rounding", "round"], "error: --rounding must be one of trunc, floor"),
        (["--to", "bevpoolv2", "--z-bins", "0"], "error: --z-bins must be in [1, 4096], got 0"),
    ],
)
def test_export_interop_usage_errors(store: Path, args: list[str], message: str) -> None:
    result = runner.invoke(app, ["export-interop", str(store), *args])
    assert result.exit_code == 2
    assert message in result.stderr


def test_export_interop_requires_to(store: Path) -> None:
    result = runner.invoke(app, ["export-interop", str(store)])
    assert result.exit_code == 2
    assert "--to" in result.output
