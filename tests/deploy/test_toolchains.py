"""The exports on the REAL toolchains (RKNN-Toolkit2 for rk3588, OpenVINO), each in its own venv
(``make npu-envs``): built, run, compared; every limit / CPU-fallback line of the build is a failure.

``make test`` sets ``BEVCOMPILE_REQUIRE_TOOLCHAINS=rknn,openvino``: a missing venv then FAILS these
tests instead of skipping them (CI proves the rk3588 and OpenVINO rows on every run).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from bevcompile.cli import app
from bevcompile.deploy.toolchains.harness import BOUNDS, check_target, toolchain_available

from ..rigs import ROOT

REQUIRED = {name for name in os.environ.get("BEVCOMPILE_REQUIRE_TOOLCHAINS", "").split(",") if name}


def _need(toolchain: str) -> None:
    if toolchain_available(toolchain):
        return
    if toolchain in REQUIRED:
        pytest.fail(f"the {toolchain} toolchain venv is missing (make npu-envs); BEVCOMPILE_REQUIRE_TOOLCHAINS requires it")
    pytest.skip(f"the {toolchain} toolchain is not installed (make npu-envs)")


@pytest.fixture(scope="module")
def nuscenes_ray(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bundled nuScenes rig: grid/ and a ray-mode Top-24 matrix (align 16, int8, 256-row tiles)."""
    out = tmp_path_factory.mktemp("toolchains")
    config = str(ROOT / "configs" / "nuscenes.yaml")
    for args in (["grid", config], ["matrix", config, "--mode", "ray", "--topk", "24", "--align", "16", "--quantize", "int8", "--tile-rows", "256"]):
        result = CliRunner().invoke(app, [*args, "--out", str(out), "--quiet"])
        assert result.exit_code == 0, result.output
    return out / "nuscenes.zarr"


@pytest.mark.parametrize("product", ["gather", "ell"])
def test_rk3588_builds_and_the_simulator_equals_the_reference(nuscenes_ray: Path, tmp_path: Path, product: str) -> None:
    """rk3588, fp16: zero REGTASK/limit lines, zero CPU-fallback lines, every layer but the input/output
    operators on the NPU, the .rknn within 3x the graph's constants, the simulator within 2e-3."""
    _need("rknn")
    row = check_target(nuscenes_ray, product, "rk3588", "float16", tmp_path, channels=16)
    assert row.status == "pass", row.failures
    assert row.form == "windows"
    assert row.limit_lines == 0 and row.fallback_lines == 0 and row.cpu_layers == []
    assert row.compiled_ratio is not None and row.compiled_ratio <= 3
    assert row.max_abs_same is not None and row.max_abs_same <= BOUNDS[("rknn", "float")].max_abs  # type: ignore[operator]
    assert not any(key.startswith("Gather") for key in row.layer_dtypes)


@pytest.mark.parametrize(("product", "weights"), [("gather", "float32"), ("ell", "float32"), ("tiles", "float32"), ("ell", "int8-qdq")])
def test_openvino_runs_every_product_with_the_f32_hint(nuscenes_ray: Path, tmp_path: Path, product: str, weights: str) -> None:
    """OpenVINO (CPU plugin, INFERENCE_PRECISION_HINT f32): float graphs within 1e-5 of the reference;
    the fully quantised graph runs its Gather/Reduce/eltwise layers in int8 and stays >= 40 dB."""
    _need("openvino")
    row = check_target(nuscenes_ray, product, "openvino", weights, tmp_path, channels=16)
    assert row.status == "pass", row.failures
    if weights == "int8-qdq":
        assert any(key.endswith(":i8") for key in row.layer_dtypes), row.layer_dtypes
        assert row.psnr_db is not None and row.psnr_db >= 40
    else:
        assert row.max_abs_same is not None and row.max_abs_same <= 1e-5


def test_a_frustum_matrix_is_refused_for_rk3588_before_any_build(tmp_path: Path) -> None:
    config = str(ROOT / "configs" / "nuscenes.yaml")
    result = CliRunner().invoke(app, ["matrix", config, "--topk", "24", "--align", "16", "--out", str(tmp_path), "--quiet"])
    assert result.exit_code == 0, result.output
    row = check_target(tmp_path / "nuscenes.zarr", "ell", "rk3588", "float16", tmp_path / "work", channels=16)
    assert row.status == "refused" and "--mode ray" in row.refusal
