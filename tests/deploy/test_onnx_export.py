"""ONNX export: static graphs without forbidden ops that onnxruntime runs to 1e-5 of the references."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, numpy_helper

from bevcompile.deploy import onnx_export
from bevcompile.deploy.onnx_export import (
    ORT_QDQ_ACCURACY_KEY,
    ORT_QDQ_CHECK_ACCURACY,
    ExportOptions,
    export_onnx,
    make_inputs,
)
from bevcompile.deploy.onnx_graph import EXPECTED_OPS, FORBIDDEN_OPS
from bevcompile.errors import CheckFailed, DependencyError, StoreError, UsageError
from bevcompile.matrix.build import MatrixOptions
from bevcompile.rig.config import RigConfig
from bevcompile.store.loader import load, matrix_layout

from ..deploy.test_torch import (
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


def _ort_all(path: Path, inputs: dict[str, np.ndarray], *, float_activations: bool = False) -> list[np.ndarray]:
    """Run ``path``; ``float_activations``: keep onnxruntime's DequantizeLinear+MatMul fusion in
    float32 (its default quantises the activations, see ``ORT_QDQ_ACCURACY_KEY``)."""
    options = ort.SessionOptions()
    if float_activations:
        options.add_session_config_entry(ORT_QDQ_ACCURACY_KEY, ORT_QDQ_CHECK_ACCURACY)
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == list(inputs)
    return list(session.run(None, inputs))


def _ort(path: Path, inputs: dict[str, np.ndarray], *, float_activations: bool = False) -> np.ndarray:
    return _ort_all(path, inputs, float_activations=float_activations)[0]


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


def test_export_gather_tolerance_covers_the_float32_norm_of_a_large_feature_map(tmp_path: Path) -> None:
    """The dense rig (640 x 360 feature map): the float32 ``grid/norm`` the reference samples is
    itself ~1.3e-5 from the float64 projection the gather weights come from. The check allows
    ``k 2^-25 (W_f + H_f)`` there (k = most cameras at a cell) and the correct graph passes;
    measured against the float64 projection directly, the graph is within 1e-6."""
    from bevcompile.grid.ipm import compute_sampling_grid
    from bevcompile.grid.reference import bilinear_sample_px
    from bevcompile.rig.config import load_config

    rig = load_config(Path(__file__).parents[2] / "configs" / "dense-6cam.yaml")
    store = build_grid_store(rig, tmp_path, npu=True)
    result = export_onnx(store, tmp_path / "gather.onnx", ExportOptions(product="gather", channels=2))
    _assert_clean(result)
    overlap = int(load(store)["grid"]["valid"].sum(axis=0).max())
    assert result.tolerance == pytest.approx(overlap * 2.0**-25 * (640 + 360)) and result.tolerance > 1e-5
    assert 1e-5 < result.max_abs <= result.tolerance
    inputs = make_inputs(load(store), 2, 1, 0, with_depth=False)
    (got,) = _ort_all(result.path, inputs)
    truth = compute_sampling_grid(rig)
    exact = sum(
        np.where(truth.valid[cam], bilinear_sample_px(inputs["features"][0, cam], truth.coords_feature_px[cam]), 0.0) for cam in range(rig.n_cam)
    )
    assert float(np.abs(got[0] - exact).max()) <= 1e-6


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
    with pytest.raises(UsageError, match=r"--weights lut applies to --product gather only, got --product ell \(use --weights float32, int8, int8-qdq, fp16 or mixed\)"):
        export_onnx(matrix_store, out, ExportOptions(product="ell", weights="lut"))
    with pytest.raises(UsageError, match=r"--weights int8 applies to --product ell or tiles only, got --product gather \(use --weights float32 or lut\)"):
        export_onnx(gather_store, out, ExportOptions(product="gather", weights="int8"))
    with pytest.raises(UsageError, match=r"--weights int8-qdq applies to --product ell or tiles only, got --product gather"):
        export_onnx(gather_store, out, ExportOptions(product="gather", weights="int8-qdq"))
    with pytest.raises(UsageError, match=r"--weights int8-qdq needs --opset 13 or higher \(DequantizeLinear with a per-row scale\), got --opset 12"):
        export_onnx(matrix_store, out, ExportOptions(product="tiles", weights="int8-qdq", opset=12))
    with pytest.raises(UsageError, match=r"--weights fp16 applies to --product ell or tiles only, got --product gather \(use --weights float32 or lut\)"):
        export_onnx(gather_store, out, ExportOptions(weights="fp16"))
    with pytest.raises(UsageError, match=r"--weights must be one of float32, float16, fp16, mixed, lut, int8, int8-qdq, got 'int4'"):
        export_onnx(gather_store, out, ExportOptions(weights="int4"))
    for weights in ("int8", "int8-qdq"):  # matrix_store has no int8
        with pytest.raises(StoreError, match=r"`bevcompile matrix --quantize int8"):
            export_onnx(matrix_store, out, ExportOptions(product="tiles", weights=weights))
    assert not out.exists()


# --------------------------------------------------------------------------------------
# --weights int8-qdq: int8 initializers + DequantizeLinear (QDQ)
# --------------------------------------------------------------------------------------


def _float_constants(model: onnx.ModelProto) -> list[np.ndarray]:
    """Every float32 constant of the main graph: initializers and Constant-node values."""
    tensors = list(model.graph.initializer)
    tensors += [a.t for n in model.graph.node if n.op_type == "Constant" for a in n.attribute if a.HasField("t")]
    return [numpy_helper.to_array(t) for t in tensors if t.data_type == TensorProto.FLOAT]


def _assert_qdq(model: onnx.ModelProto, product: str, store: Path) -> list[onnx.NodeProto]:
    """DequantizeLinear nodes reading int8 initializers with per-row float32 scales and int8 zero
    points of shape (rows,) — the store's int8 values and scales, bit for bit — and no float32
    constant holding a dequantised weight matrix left anywhere in the graph."""
    inits = {i.name: i for i in model.graph.initializer}
    dq = [n for n in model.graph.node if n.op_type == "DequantizeLinear"]
    group = load(store)["matrix"]
    r = matrix_layout(load(store)).tile_rows
    expected = 1 if product == "ell" else len(np.asarray(group["tile_col_offsets"])) - 1
    assert len(dq) == expected
    row_axis = 0 if product == "ell" else 1  # tiles: the MatMul's (n_cols, R) right operand, rows along axis 1
    rows_q: list[np.ndarray] = []
    scales: list[np.ndarray] = []
    for node in dq:
        axis = next(a.i for a in node.attribute if a.name == "axis")
        assert axis == row_axis
        q, scale, zero = (inits[name] for name in node.input)
        assert q.data_type == TensorProto.INT8 and scale.data_type == TensorProto.FLOAT and zero.data_type == TensorProto.INT8
        assert list(scale.dims) == list(zero.dims) == [q.dims[axis]]
        assert not numpy_helper.to_array(zero).any()
        values = numpy_helper.to_array(q)
        rows_q.append(values if axis == 0 else values.T)
        scales.append(numpy_helper.to_array(scale))
    if product == "ell":
        assert np.array_equal(rows_q[0], np.asarray(group["ell_weight_int8"]))
        assert np.array_equal(scales[0], np.asarray(group["row_scale"]))
    else:
        assert all(block.shape[0] == r for block in rows_q)
        assert np.array_equal(np.concatenate([b.ravel() for b in rows_q]), np.asarray(group["tile_weight_int8"]))
        assert np.array_equal(np.concatenate(scales), np.asarray(group["tile_row_scale"]))
    # the float weights are not ALSO in the file, in any layout (compared as sorted values)
    dequantised = [np.sort((q.astype(np.float32) * scale[:, None]).ravel()) for q, scale in zip(rows_q, scales, strict=True)]
    for constant in _float_constants(model):
        values = np.sort(constant.ravel())
        assert not any(d.size == values.size and np.array_equal(d, values) for d in dequantised), constant.shape
    return dq


@pytest.mark.parametrize("product", ["ell", "tiles"])
def test_export_matrix_int8_qdq(int8_store: Path, tmp_path: Path, product: str) -> None:
    result = export_onnx(int8_store, tmp_path / "qdq.onnx", ExportOptions(product=product, channels=4, weights="int8-qdq"))
    model = _assert_clean(result)
    assert result.passed and result.max_abs <= 1e-5 and result.weights == "int8-qdq"
    assert result.scan.unexpected == [] and result.scan.op_histogram["DequantizeLinear"] >= 1
    assert "Cast" not in result.scan.op_histogram  # the legacy float graph has none; QDQ adds none
    dq = _assert_qdq(model, product, int8_store)
    assert result.qdq is not None and result.qdq.missing == [] and len(result.qdq.nodes) == len(dq)
    assert {p.key: p.value for p in model.metadata_props}["bevcompile.weights"] == "int8-qdq"
    # onnxruntime (float activations) vs the same-weights reference, and vs the --weights int8 graph
    frustum = matrix_layout(load(int8_store)).mode == "frustum"
    inputs = make_inputs(load(int8_store), 4, 1, seed=5, with_depth=frustum)
    got = _ort(result.path, inputs, float_activations=True)
    assert np.max(np.abs(got - dequantised_int8_lift(int8_store, product, inputs))) <= 1e-5
    int8 = export_onnx(int8_store, tmp_path / "int8.onnx", ExportOptions(product=product, channels=4, weights="int8"))
    assert np.max(np.abs(got - _ort(int8.path, inputs))) <= 1e-6
    # same distance to the float reference as --weights int8; smaller than float32, about as small as int8
    assert result.float_reference is not None and int8.float_reference is not None
    assert result.float_reference.max_abs == pytest.approx(int8.float_reference.max_abs, abs=1e-6)
    assert result.float32_export is not None and result.file_bytes < result.float32_export.file_bytes
    ratio = result.constant_ratio_vs_float32
    assert ratio is not None and 0 < ratio < 1
    assert result.scan.constant_bytes <= int8.scan.constant_bytes * 1.05 + 1024
    assert result.ort_default is not None  # a default session is measured too (reported only)
    data = result.to_json()
    assert data["qdq"]["n_dequantize_linear"] == len(dq) and data["qdq"]["missing"] == []
    assert data["onnxruntime_default"]["max_abs_vs_reference"] is not None


@pytest.mark.parametrize("int8_store", ["grid"], indirect=True)
def test_dynamo_exporter_int8_qdq(int8_store: Path, tmp_path: Path) -> None:
    """dynamo: its folded weight initializer (here ``view_1``, the flattened ``ell_weight``) becomes QDQ the same way."""
    result = export_onnx(int8_store, tmp_path / "dyn.onnx", ExportOptions(product="ell", channels=3, weights="int8-qdq", exporter="dynamo"))
    assert result.exporter == "dynamo" and result.passed and result.max_abs <= 1e-5
    _assert_qdq(_assert_clean(result), "ell", int8_store)
    assert result.qdq is not None and len(result.qdq.nodes) == 1 and result.qdq.missing == []


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


def test_opset_limits_are_usage_errors_and_the_written_opset_is_checked(gather_store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Below opset 9 the graph cannot be static; torch's dynamo exporter cannot write below 17; a
    graph whose opset differs from the request fails the export (never a silent opset 18)."""
    with pytest.raises(UsageError, match=r"--opset must be in \[9, 23\], got 8 \(below 9"):
        export_onnx(gather_store, tmp_path / "x.onnx", ExportOptions(opset=8))
    with pytest.raises(UsageError, match=r"--exporter dynamo writes opset 17 or higher .* use --exporter legacy"):
        export_onnx(gather_store, tmp_path / "x.onnx", ExportOptions(opset=13, exporter="dynamo"))
    result = export_onnx(gather_store, tmp_path / "o9.onnx", ExportOptions(opset=9, channels=2))
    assert result.scan.opset == 9 and onnx.load(str(result.path)).opset_import[0].version == 9
    real_export = onnx_export._torch_export

    def export_then_bump(module, args, path, options, names):  # type: ignore[no-untyped-def]
        used = real_export(module, args, path, options, names)
        model = onnx.load(str(path))
        model.opset_import[0].version = 18
        onnx.save(model, str(path))
        return used

    monkeypatch.setattr(onnx_export, "_torch_export", export_then_bump)
    with pytest.raises(CheckFailed, match="the legacy exporter wrote opset 18, not the requested --opset 17"):
        export_onnx(gather_store, tmp_path / "bumped.onnx", ExportOptions(channels=2))
    monkeypatch.setitem(sys.modules, "onnxscript", None)
    with pytest.raises(DependencyError, match=r"--exporter dynamo needs onnxscript: .*bevcompile\[onnx\]"):
        export_onnx(gather_store, tmp_path / "x.onnx", ExportOptions(exporter="dynamo"))


def test_an_empty_matrix_lifts_to_zeros_and_is_not_exported(tmp_path: Path) -> None:
    """No camera reaches the BEV box: MatrixLift (tiles, compacted rows) gives zeros; export-onnx
    refuses with one line instead of exporting an empty graph."""
    from bevcompile.matrix.build import run_matrix
    from bevcompile.rig.config import parse_config
    from bevcompile.torch import MatrixLift

    from ..rigs import small_rig_data

    data = small_rig_data()
    data["bev"]["x"] = [400.0, 410.0, 1.0]
    data["bev"]["y"] = [400.0, 410.0, 1.0]
    rig = parse_config(data)
    store = run_matrix(rig, tmp_path, MatrixOptions(topk=4, align=4, tile_rows=8, compact_rows=True)).store
    inputs = make_inputs(load(store), 2, 1, 0, with_depth=True)
    for form in ("tiles", "ell"):
        out = MatrixLift(store, form=form)(*(torch.from_numpy(v) for v in inputs.values()))
        assert tuple(out.shape) == (1, 2, 10, 10) and float(out.abs().max()) == 0.0
        with pytest.raises(UsageError, match=r"matrix/ is empty \(no entries"):
            export_onnx(store, tmp_path / f"{form}.onnx", ExportOptions(product=form, channels=2))


# --------------------------------------------------------------------------------------
# memory: estimated before any work
# --------------------------------------------------------------------------------------


def test_export_memory_estimate_and_refusal(gather_store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The estimate follows the README formulas (gather: the gathered N·C·entries floats, twice);
    an export above the physical memory is a UsageError before any module is built."""
    loaded = load(gather_store)
    entries = int(np.prod(loaded.array_info("gather", "index").shape))
    small_est = onnx_export.estimate_export_memory(loaded, ExportOptions(channels=4, batch=1))
    big_est = onnx_export.estimate_export_memory(loaded, ExportOptions(channels=4096, batch=64))
    assert small_est.forward >= 2 * 4 * entries * 4
    assert big_est.forward >= 2 * 64 * 4096 * entries * 4 and big_est.total > big_est.forward
    monkeypatch.setattr(onnx_export, "_memory_limit", lambda: (small_est.total - 1, "available memory"))
    monkeypatch.setattr(onnx_export, "build_module", lambda *a: pytest.fail("built a module past the memory check"))
    with pytest.raises(UsageError, match=r"export-onnx --product gather --channels 4 --batch 1 needs about .* more than the .* available memory allows; reduce --channels or --batch"):
        export_onnx(gather_store, tmp_path / "g.onnx", ExportOptions(channels=4))
    assert not (tmp_path / "g.onnx").exists()


@pytest.mark.parametrize(("mode", "product"), [("frustum", "ell"), ("grid", "tiles")])
def test_region_export_adds_exactly_one_gather_and_matches_the_torch_module(tmp_path: Path, mode: str, product: str) -> None:
    """A bev.region store exports the same graph as its full-grid twin plus ONE Gather (matrix/expand
    back to (C, ny, nx)); no forbidden op; onnxruntime equals MatrixLift; rows='compact' is the
    compact rows the Gather reads."""
    from collections import Counter

    from typer.testing import CliRunner

    from bevcompile.cli import app
    from bevcompile.torch import MatrixLift

    from ..matrix.test_region import REGION
    from ..rigs import small_rig_data, write_yaml

    stores = {}
    for label, region in (("full", None), ("region", REGION)):
        data = small_rig_data()
        if region is not None:
            data["bev"]["region"] = region
        config = write_yaml(tmp_path / f"{label}.yaml", data)
        built = CliRunner().invoke(app, ["matrix", str(config), "--mode", mode, "--topk", "8", "--tile-rows", "32", "--out", str(tmp_path / label), "--quiet"])
        assert built.exit_code == 0, built.output
        stores[label] = tmp_path / label / "small.zarr"
    results = {label: export_onnx(path, tmp_path / f"{label}.onnx", ExportOptions(product=product, channels=4)) for label, path in stores.items()}
    ops = {label: Counter(n.op_type for n in onnx.load(str(r.path)).graph.node) for label, r in results.items()}
    if product == "ell":
        assert ops["region"] - ops["full"] == Counter({"Gather": 1}) and not ops["full"] - ops["region"], ops
    else:  # one Gather + one MatMul (+ its Constant) per row tile; the region has fewer tiles, and ONE Gather more
        tiles = {label: int(load(path)["matrix"].attrs["tiles"]["n_tiles"]) for label, path in stores.items()}
        assert tiles["region"] < tiles["full"]
        for label in stores:
            assert ops[label]["MatMul"] == tiles[label], ops
        assert set(ops["region"]) == set(ops["full"]), ops
    # exactly one Gather reads matrix/expand (the full-grid graph has none)
    expand = np.asarray(load(stores["region"])["matrix"]["expand"])
    for label, want in (("region", 1), ("full", 0)):
        graph = onnx.load(str(results[label].path)).graph
        consts = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
        consts |= {n.output[0]: numpy_helper.to_array(n.attribute[0].t) for n in graph.node if n.op_type == "Constant" and n.attribute and n.attribute[0].type == onnx.AttributeProto.TENSOR}
        reads = [n for n in graph.node if n.op_type == "Gather" and n.input[1] in consts and np.array_equal(consts[n.input[1]].ravel(), expand)]
        assert len(reads) == want, (label, len(reads))
    model = _assert_clean(results["region"])
    assert not {n.op_type for n in model.graph.node} & {"ScatterND", "ScatterElements", "Tile", "Expand"}
    assert results["region"].max_abs <= 1e-5
    region = load(stores["region"])
    inputs = make_inputs(region, 4, 1, seed=7, with_depth=mode == "frustum")
    got = _ort(results["region"].path, inputs)
    lift = MatrixLift(stores["region"], form=product)
    args = [torch.from_numpy(inputs["features"])] + ([torch.from_numpy(inputs["depth"])] if mode == "frustum" else [])
    with torch.no_grad():
        want = lift(*args).numpy()
        compact = MatrixLift(stores["region"], form=product, rows="compact")(*args).numpy()
    assert got.shape == (1, 4, 24, 24)
    assert np.max(np.abs(got - want)) <= 1e-6
    expand = np.asarray(region["matrix"]["expand"])
    assert compact.shape == (1, 4, int(expand.max()))
    dense = np.concatenate([compact, np.zeros((1, 4, 1), np.float32)], axis=2)[:, :, expand].reshape(1, 4, 24, 24)
    assert np.array_equal(dense, want)


def test_region_grid_export_adds_exactly_one_gather_and_onnxruntime_equals_torch(tmp_path: Path) -> None:
    """--product gather of a region grid store: the full-grid twin's graph plus ONE Gather, which
    reads grid/expand; no forbidden op; onnxruntime equals GridGather (and the numpy reference)."""
    from collections import Counter

    from bevcompile.torch import GridGather

    from ..deploy.test_torch import region_grid_stores

    stores = dict(zip(("full", "region"), region_grid_stores(tmp_path, npu=True), strict=True))
    results = {label: export_onnx(path, tmp_path / f"{label}.onnx", ExportOptions(channels=4)) for label, path in stores.items()}
    ops = {label: Counter(n.op_type for n in onnx.load(str(r.path)).graph.node) for label, r in results.items()}
    assert ops["region"] - ops["full"] == Counter({"Gather": 1}) and not ops["full"] - ops["region"], ops
    graph = onnx.load(str(results["region"].path)).graph
    consts = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    expand = np.asarray(load(stores["region"])["grid"]["expand"])
    reads = [n for n in graph.node if n.op_type == "Gather" and n.input[1] in consts and np.array_equal(consts[n.input[1]].ravel(), expand)]
    assert len(reads) == 1  # one height: the (height, cell) index is grid/expand itself
    _assert_clean(results["region"])
    assert results["region"].max_abs <= 1e-5
    region = load(stores["region"])
    inputs = make_inputs(region, 4, 1, seed=5, with_depth=False)
    got = _ort(results["region"].path, inputs)
    with torch.no_grad():
        want = GridGather(stores["region"])(torch.from_numpy(inputs["features"])).numpy()
    assert got.shape == (1, 4, 1, 24, 24)
    assert np.max(np.abs(got - want)) <= 1e-6
