"""ONNX export: static graphs without forbidden ops that onnxruntime runs to 1e-5 of the references."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper

from bevcompile import onnx_export
from bevcompile.config import RigConfig
from bevcompile.errors import CheckFailed, DependencyError, StoreError, UsageError
from bevcompile.loader import load, matrix_layout
from bevcompile.matrix import MatrixOptions
from bevcompile.onnx_export import EXPECTED_OPS, FORBIDDEN_OPS, ExportOptions, export_onnx, make_inputs, scan_graph

from .test_torch_modules import (
    INT8_CASES,
    add_matrix_group,
    build_grid_store,
    dequantised_int8_lift,
    numpy_lut_gather,
    torch_grid_sample_reference,
)

ALLOWED = set(EXPECTED_OPS)


@pytest.fixture(scope="module")
def gather_store(tmp_path_factory: pytest.TempPathFactory, small_distorted_multi: RigConfig) -> Path:
    return build_grid_store(small_distorted_multi, tmp_path_factory.mktemp("onnx_gather"), npu=True, align=32)


@pytest.fixture(scope="module", params=["frustum", "grid"])
def matrix_store(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, small_distorted_multi: RigConfig) -> Path:
    store = build_grid_store(small_distorted_multi, tmp_path_factory.mktemp("onnx_matrix"))
    add_matrix_group(store, small_distorted_multi, MatrixOptions(mode=request.param, topk=8, align=8, tile_rows=64, compact_rows=True))
    return store


def _ort(path: Path, inputs: dict[str, np.ndarray]) -> np.ndarray:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == list(inputs)
    return session.run(None, inputs)[0]


def _assert_clean(result: onnx_export.ExportResult) -> onnx.ModelProto:
    model = onnx.load(str(result.path))
    ops = {n.op_type for n in model.graph.node}
    assert ops <= ALLOWED, ops - ALLOWED
    assert not ops & set(FORBIDDEN_OPS)
    assert "Gather" in ops
    assert result.scan.forbidden == [] and result.scan.dynamic == []
    for value in list(model.graph.input) + list(model.graph.output):
        assert all(d.HasField("dim_value") and d.dim_value > 0 for d in value.type.tensor_type.shape.dim)
    meta = {p.key: p.value for p in model.metadata_props}
    assert meta["bevcompile.product"] == result.product
    return model


@pytest.mark.parametrize("reduce", ["sum", "mean"])
def test_export_gather_matches_torch_grid_sample(gather_store: Path, tmp_path: Path, reduce: str) -> None:
    result = export_onnx(gather_store, tmp_path / "gather.onnx", ExportOptions(product="gather", channels=6, batch=2, reduce=reduce))
    assert result.path == tmp_path / "gather.onnx" and result.passed
    assert result.max_abs <= 1e-5
    _assert_clean(result)
    # independent check: run the file ourselves against torch's own grid_sample
    inputs = make_inputs(load(gather_store), 6, 2, seed=42, with_depth=False)
    got = _ort(result.path, inputs)
    ref = torch_grid_sample_reference(gather_store, torch.from_numpy(inputs["features"])).sum(dim=1)
    if reduce == "mean":
        count = torch.from_numpy(np.array(load(gather_store)["grid"]["valid"])).sum(dim=0)
        ref = torch.where(count > 0, ref / count.clamp(min=1), torch.zeros_like(ref))
    assert got.shape == (2, 6, 3, 40, 40)
    assert np.max(np.abs(got - ref.numpy())) <= 1e-5


@pytest.mark.parametrize("product", ["ell", "tiles"])
def test_export_matrix_products(matrix_store: Path, tmp_path: Path, product: str) -> None:
    result = export_onnx(matrix_store, tmp_path / f"{product}.onnx", ExportOptions(product=product, channels=4))
    model = _assert_clean(result)
    assert result.max_abs <= 1e-5
    frustum = load(matrix_store)["matrix"].attrs["build_options"]["mode"] == "frustum"
    assert [i.name for i in model.graph.input] == (["features", "depth"] if frustum else ["features"])
    if product == "tiles":
        assert "MatMul" in {n.op_type for n in model.graph.node}


def test_export_is_deterministic(gather_store: Path, tmp_path: Path) -> None:
    a = export_onnx(gather_store, tmp_path / "a.onnx", ExportOptions(product="gather", channels=2))
    b = export_onnx(gather_store, tmp_path / "b.onnx", ExportOptions(product="gather", channels=2))
    assert a.path.read_bytes() == b.path.read_bytes()


def test_dynamo_exporter_is_clean_too(gather_store: Path, tmp_path: Path) -> None:
    result = export_onnx(gather_store, tmp_path / "dyn.onnx", ExportOptions(product="gather", channels=3, exporter="dynamo"))
    assert result.exporter == "dynamo"
    _assert_clean(result)
    assert result.max_abs <= 1e-5


def test_export_nuscenes_gather_done_when(tmp_path: Path, nuscenes: RigConfig) -> None:
    """The issue's "done when": the default nuScenes store exports a clean, correct gather graph."""
    store = build_grid_store(nuscenes, tmp_path, npu=True)
    result = export_onnx(store, tmp_path / "gather.onnx", ExportOptions(product="gather", channels=8))
    _assert_clean(result)
    assert result.inputs == {"features": [1, 6, 8, 16, 44]}
    assert result.output == [1, 8, 1, 128, 128]
    assert result.max_abs <= 1e-5


# --------------------------------------------------------------------------------------
# quantised weights: --weights lut (gather) / int8 (ell, tiles)
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=sorted(INT8_CASES))
def int8_store(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, small_distorted_multi: RigConfig) -> Path:
    store = build_grid_store(small_distorted_multi, tmp_path_factory.mktemp("onnx_int8"))
    add_matrix_group(store, small_distorted_multi, INT8_CASES[request.param])
    return store


def _assert_quantised(result: onnx_export.ExportResult, model: onnx.ModelProto, dtype: int, float_file: Path) -> None:
    """The graph carries the quantised table (int8/uint8 initializer, dequantised by a Cast),
    no float32 table of its size, and is smaller than the float32 export at ``float_file``."""
    assert result.weights == ("lut" if dtype == TensorProto.UINT8 else "int8")
    quantised = sum(int(np.prod(i.dims)) for i in model.graph.initializer if i.data_type == dtype)
    largest_float = max((int(np.prod(i.dims)) for i in model.graph.initializer if i.data_type == TensorProto.FLOAT), default=0)
    assert quantised > 0
    assert largest_float < quantised  # the lut / row scales / masks, never a float32 weight table
    assert "Cast" in {n.op_type for n in model.graph.node}
    assert {p.key: p.value for p in model.metadata_props}["bevcompile.weights"] == result.weights
    assert result.path.stat().st_size < float_file.stat().st_size
    assert result.float32_export is not None and result.float32_export.file_bytes == float_file.stat().st_size
    assert result.scan.constant_bytes < result.float32_export.constant_bytes
    ratio = result.constant_ratio_vs_float32
    assert ratio is not None and 0 < ratio < 1


def test_export_gather_lut(gather_store: Path, tmp_path: Path) -> None:
    options = ExportOptions(product="gather", channels=4, weights="lut")
    result = export_onnx(gather_store, tmp_path / "lut.onnx", options)
    model = _assert_clean(result)
    assert result.passed and result.max_abs <= 1e-5
    float_result = export_onnx(gather_store, tmp_path / "float.onnx", ExportOptions(product="gather", channels=4))
    _assert_quantised(result, model, TensorProto.UINT8, float_result.path)
    # run the file ourselves against the independent numpy decode of weight_u8/lut
    inputs = make_inputs(load(gather_store), 4, 1, seed=7, with_depth=False)
    got = _ort(result.path, inputs)
    assert np.max(np.abs(got - numpy_lut_gather(gather_store, inputs["features"]))) <= 1e-5
    # the reported distance to the float reference: per camera within the LUT bound, so
    # at most n_cam bounds for a sum over cameras; PSNR well above 40 dB
    report = result.float_reference
    assert report is not None
    bound = float(load(gather_store)["gather"].attrs["lut_max_sample_error_unit_features"])
    assert 1e-5 < report.max_abs <= 4 * bound + 1e-5
    assert report.psnr_db >= 40.0 and report.peak > 0
    # deterministic, and the temporary float32 export is gone
    again = export_onnx(gather_store, tmp_path / "again.onnx", options)
    assert again.path.read_bytes() == result.path.read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again.onnx", "float.onnx", "lut.onnx"]


@pytest.mark.parametrize("product", ["ell", "tiles"])
def test_export_matrix_int8(int8_store: Path, tmp_path: Path, product: str) -> None:
    result = export_onnx(int8_store, tmp_path / f"{product}.onnx", ExportOptions(product=product, channels=4, weights="int8"))
    model = _assert_clean(result)
    assert result.passed and result.max_abs <= 1e-5
    float_result = export_onnx(int8_store, tmp_path / "float.onnx", ExportOptions(product=product, channels=4))
    _assert_quantised(result, model, TensorProto.INT8, float_result.path)
    frustum = matrix_layout(load(int8_store)).mode == "frustum"
    inputs = make_inputs(load(int8_store), 4, 1, seed=0, with_depth=frustum)
    got = _ort(result.path, inputs)
    assert np.max(np.abs(got - dequantised_int8_lift(int8_store, product, inputs))) <= 1e-5
    report = result.float_reference
    assert report is not None and report.max_abs > 1e-5 and report.psnr_db >= 40.0
    assert result.to_json()["float_reference"]["psnr_db"] == pytest.approx(report.psnr_db)


def test_dynamo_exporter_keeps_the_quantised_weights(gather_store: Path, tmp_path: Path) -> None:
    result = export_onnx(gather_store, tmp_path / "dyn.onnx", ExportOptions(product="gather", channels=3, weights="lut", exporter="dynamo"))
    assert result.exporter == "dynamo" and result.passed and result.max_abs <= 1e-5
    model = _assert_clean(result)
    assert TensorProto.UINT8 in {init.data_type for init in model.graph.initializer}
    assert result.float32_export is not None and result.file_bytes < result.float32_export.file_bytes


def test_export_quantised_weight_errors(gather_store: Path, matrix_store: Path, tmp_path: Path) -> None:
    out = tmp_path / "x.onnx"
    with pytest.raises(UsageError, match=r"--weights lut applies to --product gather only, got --product ell"):
        export_onnx(matrix_store, out, ExportOptions(product="ell", weights="lut"))
    with pytest.raises(UsageError, match=r"--weights int8 applies to --product ell or tiles only, got --product gather"):
        export_onnx(gather_store, out, ExportOptions(product="gather", weights="int8"))
    with pytest.raises(UsageError, match=r"--weights must be one of float32, lut, int8, got 'fp16'"):
        export_onnx(gather_store, out, ExportOptions(weights="fp16"))
    with pytest.raises(StoreError, match=r"`bevcompile matrix --quantize int8`"):  # matrix_store has no int8
        export_onnx(matrix_store, out, ExportOptions(product="tiles", weights="int8"))
    assert not out.exists()


# --------------------------------------------------------------------------------------
# the graph scan
# --------------------------------------------------------------------------------------


class _GridSampleModule(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        grid = torch.zeros(1, 4, 4, 2)
        return F.grid_sample(x, grid, align_corners=False)


def test_scan_finds_grid_sample(tmp_path: Path) -> None:
    path = tmp_path / "gs.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(_GridSampleModule(), (torch.rand(1, 2, 5, 5),), str(path), dynamo=False, opset_version=17)
    scan = scan_graph(onnx.load(str(path)))
    assert any(f.startswith("GridSample at graph") for f in scan.forbidden)
    assert not scan.passed


def _nested_model() -> onnx.ModelProto:
    """An If whose then-branch holds a ScatterND; the graph input has a symbolic batch dim."""
    data = helper.make_tensor_value_info("data", TensorProto.FLOAT, [4])
    idx = helper.make_tensor("idx", TensorProto.INT64, [1, 1], [0])
    upd = helper.make_tensor("upd", TensorProto.FLOAT, [1], [1.0])
    out_then = helper.make_tensor_value_info("y_then", TensorProto.FLOAT, [4])
    then_graph = helper.make_graph(
        [helper.make_node("Constant", [], ["i"], value=idx), helper.make_node("Constant", [], ["u"], value=upd),
         helper.make_node("ScatterND", ["x", "i", "u"], ["y_then"])],
        "then", [], [out_then],
    )
    out_else = helper.make_tensor_value_info("y_else", TensorProto.FLOAT, [4])
    else_graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y_else"])], "else", [], [out_else])
    cond = helper.make_tensor_value_info("cond", TensorProto.BOOL, [])
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch"])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])
    graph = helper.make_graph(
        [helper.make_node("If", ["cond"], ["y"], then_branch=then_graph, else_branch=else_graph)], "g", [cond, x], [y]
    )
    del data
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_scan_recurses_into_subgraphs_and_flags_dynamic_dims() -> None:
    scan = scan_graph(_nested_model())
    assert any(f.startswith("If at graph") for f in scan.forbidden)
    assert any(f.startswith("ScatterND at graph/If:") for f in scan.forbidden)  # found inside the then-branch
    assert scan.n_subgraphs == 2
    assert any(d.startswith("x: shape ['batch']") for d in scan.dynamic)
    assert scan.op_histogram["ScatterND"] == 1


def test_export_refuses_a_graph_with_grid_sample(gather_store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    class Bad(torch.nn.Module):
        def forward(self, features: torch.Tensor) -> torch.Tensor:
            n, _n_cam, c, _h, _w = features.shape
            grid = torch.zeros(n, 3 * 40, 40, 2)
            return F.grid_sample(features[:, 0], grid, align_corners=False).reshape(n, c, 3, 40, 40)

    monkeypatch.setattr(onnx_export, "build_module", lambda store, options: (Bad(), False))
    out = tmp_path / "bad.onnx"
    with pytest.raises(CheckFailed, match=r"forbidden op GridSample at graph.*rejected graph kept at .*bad.rejected.onnx") as info:
        export_onnx(gather_store, out, ExportOptions(product="gather", channels=2))
    assert not out.exists()
    assert (tmp_path / "bad.rejected.onnx").exists()
    assert info.value.result.scan.op_histogram["GridSample"] == 1  # type: ignore[attr-defined]


def test_export_errors(gather_store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(UsageError, match="--product must be one of gather, ell, tiles"):
        export_onnx(gather_store, tmp_path / "x.onnx", ExportOptions(product="dense"))
    with pytest.raises(UsageError, match="is a directory"):
        export_onnx(gather_store, tmp_path, ExportOptions())
    with pytest.raises(StoreError, match=r"no group matrix/.*bevcompile matrix"):
        export_onnx(gather_store, tmp_path / "x.onnx", ExportOptions(product="ell"))
    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    with pytest.raises(DependencyError, match=r"bevcompile\[onnx\]"):
        export_onnx(gather_store, tmp_path / "x.onnx", ExportOptions())
