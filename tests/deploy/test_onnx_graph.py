"""Graph-level ONNX work: the forbidden-op / static-shape scan and the QDQ surgery
(:mod:`bevcompile.deploy.onnx_graph`), on hand-built and exported graphs."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import onnx
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper, numpy_helper

from bevcompile.deploy.onnx_graph import QdqWeight, attach_dequantize_linear, scan_graph

from .test_onnx_export import _ort_all


def test_attach_dequantize_linear_finds_reshaped_and_transposed_weights(tmp_path: Path) -> None:
    """By value: a flattened initializer (DequantizeLinear axis 0 + Reshape), a transposed Constant
    node (axis 1), an unrelated float constant left alone, a weight absent from the graph reported."""
    rng = np.random.default_rng(0)
    weights = [
        QdqWeight(name, rng.integers(-127, 128, shape, dtype=np.int8), rng.random(shape[0], dtype=np.float32) + 0.5)
        for name, shape in (("ell_weight", (4, 3)), ("tile0_block", (4, 5)), ("absent", (2, 2)))
    ]
    flat = weights[0].dequantised.reshape(1, 12)
    block_t = weights[1].dequantised.T.copy()  # (5, 4)
    other = np.full((1, 12), 2.0, np.float32)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 12])
    z = helper.make_tensor_value_info("x5", TensorProto.FLOAT, [2, 5])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 12])
    w = helper.make_tensor_value_info("w", TensorProto.FLOAT, [2, 4])
    graph = helper.make_graph(
        [
            helper.make_node("Mul", ["x", "flat"], ["xw"]),
            helper.make_node("Add", ["xw", "other"], ["y"]),
            helper.make_node("Constant", [], ["block"], value=numpy_helper.from_array(block_t)),
            helper.make_node("MatMul", ["x5", "block"], ["w"]),
        ],
        "g", [x, z], [y, w],
        [numpy_helper.from_array(flat, "flat"), numpy_helper.from_array(other, "other")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    report = attach_dequantize_linear(model, weights)
    assert report.missing == ["absent 2x2"]
    assert [(n.weight, n.replaced, n.axis, n.reshaped) for n in report.nodes] == [("ell_weight", "flat", 0, True), ("tile0_block", "block", 1, False)]
    onnx.checker.check_model(model, full_check=True)
    assert {i.name for i in model.graph.initializer} == {
        "other", "ell_weight_quantized", "ell_weight_scale", "ell_weight_zero_point", "ell_weight_shape",
        "tile0_block_quantized", "tile0_block_scale", "tile0_block_zero_point",
    }
    assert [n.op_type for n in model.graph.node] == ["DequantizeLinear", "Reshape", "Mul", "Add", "DequantizeLinear", "MatMul"]
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    feeds = {"x": rng.random((1, 12), dtype=np.float32), "x5": rng.random((2, 5), dtype=np.float32)}
    y_out, w_float = _ort_all(path, feeds, float_activations=True)
    assert np.array_equal(y_out, feeds["x"] * flat + other)  # DequantizeLinear gives the dequantised values bit for bit
    assert np.allclose(w_float, feeds["x5"] @ block_t, rtol=1e-6, atol=1e-5)


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
