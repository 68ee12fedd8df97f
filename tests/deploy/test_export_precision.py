"""export-onnx with the precision products and options of the deployed lift: --weights fp16 / mixed
(torch path and graph builder), --guard (NaN-safe graphs), --classes (class lift without OneHot)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from bevcompile.deploy.onnx_export import ExportOptions, export_onnx, make_inputs, reference_matrix_lift
from bevcompile.matrix.build import MatrixOptions
from bevcompile.rig.config import RigConfig
from bevcompile.store.loader import load

from .test_torch import add_matrix_group, build_grid_store


@pytest.fixture(scope="module")
def mixed_store(tmp_path_factory: pytest.TempPathFactory, small_distorted_multi: RigConfig) -> Path:
    store = build_grid_store(small_distorted_multi, tmp_path_factory.mktemp("mixed"))
    add_matrix_group(store, small_distorted_multi, MatrixOptions(mode="ray", topk=8, align=8, tile_rows=64, quantize="mixed", fp16_rows="fraction:0.3"))
    return store


@pytest.fixture(scope="module")
def fp16_store(tmp_path_factory: pytest.TempPathFactory, small_distorted_multi: RigConfig) -> Path:
    store = build_grid_store(small_distorted_multi, tmp_path_factory.mktemp("fp16"))
    add_matrix_group(store, small_distorted_multi, MatrixOptions(mode="ray", topk=8, align=8, tile_rows=64, quantize="fp16"))
    return store


@pytest.mark.parametrize(("target", "product"), [("generic", "ell"), ("generic", "tiles"), ("onnxruntime", "ell")])
def test_mixed_weights_export_with_two_row_groups(mixed_store: Path, tmp_path: Path, target: str, product: str) -> None:
    """--weights mixed: the int8 rows as int8 initializers, the fp16 rows as float16 initializers, no
    dynamic op; onnxruntime equals the stored mixed product's reference (the same decoded values)."""
    result = export_onnx(mixed_store, tmp_path / "m.onnx", ExportOptions(product=product, weights="mixed", target=target, channels=3))
    assert result.passed and result.max_abs <= 1e-5
    model = onnx.load(str(result.path))
    dtypes = {onnx.numpy_helper.to_array(i).dtype for i in model.graph.initializer}
    assert np.dtype(np.int8) in dtypes and np.dtype(np.float16) in dtypes
    assert result.scan.dynamic == [] and result.scan.forbidden == []


def test_fp16_weights_of_the_store_and_of_the_builder_are_the_same_values(fp16_store: Path, tmp_path: Path) -> None:
    """The store's --quantize fp16 arrays (torch path, --weights fp16) and the graph builder's
    float16 rounding of the float32 weights are the same numbers: the two graphs agree to float32."""
    a = export_onnx(fp16_store, tmp_path / "a.onnx", ExportOptions(product="ell", weights="fp16", channels=3))
    b = export_onnx(fp16_store, tmp_path / "b.onnx", ExportOptions(product="ell", weights="fp16", target="onnxruntime", form="gather", channels=3))
    inputs = make_inputs(load(fp16_store), 3, 1, 4, False)
    out = [ort.InferenceSession(str(r.path), providers=["CPUExecutionProvider"]).run(None, inputs)[0] for r in (a, b)]
    assert np.max(np.abs(out[0] - out[1])) <= 1e-6
    stored = np.asarray(load(fp16_store)["matrix"]["ell_weight_fp16"])
    assert np.array_equal(stored, np.asarray(load(fp16_store)["matrix"]["ell_weight"]).astype(np.float16))


@pytest.mark.parametrize(("target", "product"), [("generic", "ell"), ("onnxruntime", "ell"), ("onnxruntime", "tiles"), ("onnxruntime", "gather")])
def test_guarded_graph_keeps_every_cell_a_bad_camera_does_not_feed(mixed_store: Path, tmp_path: Path, target: str, product: str) -> None:
    """--guard: NaN, +-inf and a huge value in camera 0's features change only the cells camera 0
    feeds; every other cell is bit-equal to the graph's output on clean features. Without the guard the
    NaN spreads further (the 0-weight slots and padding read it)."""
    loaded = load(mixed_store)
    clean = make_inputs(loaded, 3, 1, 9, False)
    dirty = {k: v.copy() for k, v in clean.items()}
    dirty["features"][0, 0, :, 0, 0] = np.nan
    dirty["features"][0, 0, :, 1, 1] = np.inf
    dirty["features"][0, 0, :, 2, 2] = -np.inf
    guarded = export_onnx(mixed_store, tmp_path / "g.onnx", ExportOptions(product=product, target=target, guard=True, channels=3))
    ops = {n.op_type for n in onnx.load(str(guarded.path)).graph.node}
    assert {"Sub", "Equal", "Where"} <= ops and not ops & {"IsNaN", "IsInf", "ScatterND", "OneHot"}
    session = ort.InferenceSession(str(guarded.path), providers=["CPUExecutionProvider"])
    feeds = (lambda x: x) if guarded.inputs["features"][0] == 1 and len(guarded.inputs["features"]) == 5 else (lambda x: x.reshape(-1, *x.shape[2:]))
    want = session.run(None, {"features": feeds(clean["features"])})[0]
    got = session.run(None, {"features": feeds(dirty["features"])})[0]
    # the cells camera 0 feeds: the lift of a features map that is 1 on camera 0 and 0 elsewhere
    probe = np.zeros_like(clean["features"])
    probe[0, 0] = 1.0
    fed = session.run(None, {"features": feeds(probe)})[0] != 0
    assert np.isfinite(got[~fed]).all()
    assert np.array_equal(got[~fed], want[~fed])
    assert (got[fed] != want[fed]).any()


def test_class_lift_export_has_no_one_hot_and_equals_lift_of_one_hot(mixed_store: Path, tmp_path: Path) -> None:
    """--classes N: labels (N, n_cam, H_f, W_f) int64 -> (N, N_classes, ny, nx), ops without OneHot,
    equal to reference_matrix_lift of the explicit one-hot (labels == N are ignored)."""
    result = export_onnx(mixed_store, tmp_path / "c.onnx", ExportOptions(product="ell", classes=4, channels=3))
    assert result.passed and result.max_abs <= 1e-5
    model = onnx.load(str(result.path))
    ops = {n.op_type for n in model.graph.node}
    assert "OneHot" not in ops and "Equal" in ops
    assert result.inputs == {"labels": [1, 4, 8, 12]}
    loaded = load(mixed_store)
    labels = make_inputs(loaded, 3, 1, 3, False, classes=4)["labels"]
    onehot = (labels[:, :, None] == np.arange(4)[None, None, :, None, None]).astype(np.float32)
    want = reference_matrix_lift(loaded, onehot, None)
    got = ort.InferenceSession(str(result.path), providers=["CPUExecutionProvider"]).run(None, {"labels": labels})[0]
    assert got.shape == want.shape and np.max(np.abs(got - want)) <= 1e-6
