"""The graph builder (bevcompile.deploy.lift / graph / plan): every form, op by op, against the
store's own references (the COO product, numpy grid_sample), and the planner against target limits."""

from __future__ import annotations

import itertools
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import numpy_helper

from bevcompile.deploy.graph import Plan, build_graph, graph_cost, row_buckets, window_stats
from bevcompile.deploy.lift import product_lift
from bevcompile.deploy.onnx_export import (
    make_inputs,
    reference_gather_lut,
    reference_grid_gather,
    reference_matrix_lift,
    reference_matrix_lift_int8,
)
from bevcompile.deploy.plan import plan_for_target
from bevcompile.deploy.targets import TargetError, load_profile, load_profiles, parse_profile, profile_names
from bevcompile.errors import UsageError
from bevcompile.matrix.build import MatrixOptions
from bevcompile.rig.config import RigConfig
from bevcompile.store.loader import load

from .test_torch import add_matrix_group, build_grid_store

FORM_OPS = {
    "gather": {"Transpose", "Reshape", "Gather", "Mul", "ReduceSum", "Concat", "Cast", "DequantizeLinear", "QuantizeLinear"},
    "tiles": {"Transpose", "Reshape", "Gather", "Mul", "MatMul", "Concat", "Cast", "DequantizeLinear", "QuantizeLinear"},
    "windows": {"Slice", "Reshape", "MatMul", "Add", "Mul", "Concat", "Cast", "DequantizeLinear", "QuantizeLinear"},
}


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory, small_distorted_multi: RigConfig) -> dict[str, Path]:
    """gather/ in the flat cache layout (grid --align 32 --order cache) and one matrix store per mode
    (Top-8, compacted rows, 64-row tiles, int8)."""
    out = {"gather": build_grid_store(small_distorted_multi, tmp_path_factory.mktemp("g_gather"), npu=True, align=32, order="cache")}
    for mode in ("frustum", "grid", "ray"):
        store = build_grid_store(small_distorted_multi, tmp_path_factory.mktemp(f"g_{mode}"))
        add_matrix_group(store, small_distorted_multi, MatrixOptions(mode=mode, topk=8, align=8, tile_rows=64, compact_rows=True, quantize="int8"))
        out[mode] = store
    return out


def _reference(store: Path, product: str, inputs: dict[str, np.ndarray], precision: str = "float32", reduce: str = "sum") -> np.ndarray:
    loaded = load(store)
    if product == "gather":
        if precision == "float16":
            return reference_gather_lut(loaded, inputs["features"], reduce, weights="float16")
        return reference_grid_gather(loaded, inputs["features"], reduce)
    if precision == "int8":
        return reference_matrix_lift_int8(loaded, inputs["features"], inputs.get("depth"), product)
    return reference_matrix_lift(loaded, inputs["features"], inputs.get("depth"), weights=precision)


def _run(model: onnx.ModelProto, inputs: dict[str, np.ndarray], rank: int, qdq: bool = False) -> np.ndarray:
    feeds = inputs if rank == 5 else {k: v.reshape(-1, *v.shape[2:]) for k, v in inputs.items()}
    options = ort.SessionOptions()
    if qdq:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"]).run(None, feeds)[0]


CASES = [("gather", "gather"), *((mode, product) for mode in ("frustum", "grid", "ray") for product in ("ell", "tiles"))]


@pytest.mark.parametrize(("store_key", "product"), CASES)
@pytest.mark.parametrize("precision", ["float32", "float16", "int8"])
def test_lift_matrix_equals_the_store_references(stores: dict[str, Path], store_key: str, product: str, precision: str) -> None:
    """The one sparse description every form is built from reproduces the store's own references:
    the COO product (exactly, float64), numpy grid_sample on grid/norm (float32 grid: 1e-6), the
    int8 reference from the stored int8 arrays, the float16-rounded weights."""
    if product == "gather" and precision == "int8":
        pytest.skip("the gather product has no int8 tables")
    loaded = load(stores[store_key])
    lift = product_lift(loaded, product, precision=precision)
    inputs = make_inputs(loaded, 3, 2, 5, lift.frustum)
    got = lift.dense_product(inputs["features"], inputs.get("depth"))
    want = _reference(stores[store_key], product, inputs, precision)
    assert got.shape == want.shape
    assert np.max(np.abs(got - want)) <= (2e-6 if product == "gather" and precision == "float32" else 1e-9)
    assert np.all(lift.value != 0)  # padding and zeros dropped
    assert np.all(np.diff(lift.row) >= 0)


GRAPH_CASES = [("gather", "channel-last", 5), ("gather", "channel-first", 4), ("tiles", "channel-last", 4), ("windows", "channel-first", 4)]


@pytest.mark.parametrize(("store_key", "product"), CASES)
@pytest.mark.parametrize(("form", "layout", "rank"), GRAPH_CASES)
def test_every_form_equals_the_reference_op_by_op(stores: dict[str, Path], store_key: str, product: str, form: str, layout: str, rank: int) -> None:
    """Each form x layout x input rank: onnxruntime within 1e-5 of the store's reference, only the
    form's own ops (the windows form has no Gather at all), every shape static."""
    loaded = load(stores[store_key])
    lift = product_lift(loaded, product)
    if form == "windows" and lift.frustum:
        with pytest.raises(UsageError, match="depth input"):
            build_graph(lift, Plan(form=form, layout=layout, input_rank=rank, batch=1, channels=3, opset=17, patch=(4, 4)))
        return
    batch = 1 if form == "windows" else 2
    plan = Plan(form=form, layout=layout, input_rank=rank, batch=batch, channels=3, opset=17, patch=(4, 4), tile_rows=8)
    model, _ = build_graph(lift, plan)
    onnx.checker.check_model(model, full_check=True)
    ops = Counter(n.op_type for n in model.graph.node)
    assert set(ops) <= FORM_OPS[form], set(ops) - FORM_OPS[form]
    if form == "windows":
        assert "Gather" not in ops
    inputs = make_inputs(loaded, 3, batch, 11, lift.frustum)
    got = _run(model, inputs, rank)
    want = _reference(stores[store_key], product, inputs)
    assert got.size == want.size
    tol = 2e-6 if product == "gather" else 1e-6
    assert np.max(np.abs(got.reshape(want.shape) - want)) <= tol


@pytest.mark.parametrize("weights", ["float16", "int8", "int8-qdq"])
@pytest.mark.parametrize("form", ["gather", "tiles", "windows"])
def test_quantised_weights_equal_their_same_weights_reference(stores: dict[str, Path], weights: str, form: str) -> None:
    """float16 initializers (+ Cast), int8 initializers (+ Cast, row scale after the sum) and
    weight-only QDQ compute exactly the reference with the same rounded / dequantised values."""
    loaded = load(stores["ray"])
    precision = "float16" if weights == "float16" else "int8"
    lift = product_lift(loaded, "ell", precision=precision)
    plan = Plan(form=form, layout="channel-first" if form == "windows" else "channel-last", input_rank=5, batch=1, channels=3, opset=17,
                weights=weights, patch=(4, 4), tile_rows=8)
    model, _ = build_graph(lift, plan)
    dtypes = {numpy_helper.to_array(i).dtype for i in model.graph.initializer}
    assert (np.dtype(np.float16) if weights == "float16" else np.dtype(np.int8)) in dtypes
    inputs = make_inputs(loaded, 3, 1, 2, False)
    got = _run(model, inputs, 5, qdq=weights == "int8-qdq")
    want = _reference(stores["ray"], "ell", inputs, precision)
    assert np.max(np.abs(got.reshape(want.shape) - want)) <= 1e-6


def test_constants_are_written_at_the_rank_of_what_they_multiply(stores: dict[str, Path]) -> None:
    """No Reshape of a constant feeds a Mul: onnx2tf 1.29 lays a reshaped (M,) -> (M, 1) weight out
    wrong (a channel-last ELL converted to 27.4 dB in float32; litert profile), so the builder writes
    every weight and row scale at the rank of the tensor it multiplies."""
    loaded = load(stores["ray"])
    for weights, precision in (("float32", "float32"), ("int8", "int8")):
        lift = product_lift(loaded, "ell", precision=precision)
        for form in ("gather", "tiles"):
            model, _ = build_graph(lift, Plan(form=form, layout="channel-last", input_rank=5, batch=1, channels=3, opset=17, weights=weights, tile_rows=8))
            consts = {i.name for i in model.graph.initializer}
            reshaped_consts = {n.output[0] for n in model.graph.node if n.op_type == "Reshape" and n.input[0] in consts}
            mul_inputs = {i for n in model.graph.node if n.op_type == "Mul" for i in n.input}
            assert not reshaped_consts & mul_inputs
            for n in model.graph.node:
                if n.op_type == "Mul":
                    ranks = {len(numpy_helper.to_array(i).shape) for i in model.graph.initializer if i.name in n.input}
                    assert ranks <= {3}, (n.name, ranks)


def test_full_qdq_graph_quantises_every_activation_and_stays_within_40_db(stores: dict[str, Path], tmp_path: Path) -> None:
    """export-onnx --target onnxruntime --weights int8-qdq: the int8 weights AND the activations (the
    input, every sum) through QuantizeLinear -> DequantizeLinear (scales from seeded samples); PSNR >= 40 dB vs the float
    reference; the BASIC session equals the unoptimised one (EXTENDED fuses wrong, see the profile)."""
    from bevcompile.deploy.onnx_export import ExportOptions, export_onnx

    for form in ("gather", "tiles"):
        result = export_onnx(stores["ray"], tmp_path / f"{form}.onnx", ExportOptions(product="ell", target="onnxruntime", weights="int8-qdq", channels=4, form=form))
        model = onnx.load(str(result.path))
        ops = Counter(n.op_type for n in model.graph.node)
        assert ops["QuantizeLinear"] >= 2 and ops["DequantizeLinear"] > ops["QuantizeLinear"]
        producers = {o: n for n in model.graph.node for o in n.output}
        inits = {i.name for i in model.graph.initializer}
        for n in model.graph.node:
            if n.op_type in ("MatMul", "ReduceSum", "Gather"):
                data = n.input[0]
                assert data in inits or producers[data].op_type in ("DequantizeLinear", "Reshape", "Transpose", "Mul", "Gather", "Concat"), (n.name, producers[data].op_type)
        assert result.float_reference is not None and result.float_reference.psnr_db >= 40.0
        loaded = load(stores["ray"])
        inputs = make_inputs(loaded, 4, 1, 0, False)
        basic = _run(model, inputs, 5, qdq=True)
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        plain = ort.InferenceSession(str(result.path), options, providers=["CPUExecutionProvider"]).run(None, inputs)[0]
        assert np.array_equal(basic, plain)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 12), min_size=1, max_size=60), st.integers(1, 4))
def test_row_buckets_minimise_the_gathered_slots(counts: list[int], max_buckets: int) -> None:
    """The bucket bounds are the cheapest of every choice of at most max_buckets bounds (brute force)."""
    array = np.asarray(counts)
    bounds = row_buckets(array, max_buckets)
    positive = array[array > 0]

    def cost(bs: list[int]) -> float:
        if positive.size and (not bs or max(bs) < positive.max()):
            return float("inf")
        total, lower = 0, 0
        for b in sorted(bs):
            total += b * int(((positive > lower) & (positive <= b)).sum())
            lower = b
        return total

    if positive.size == 0:
        assert bounds == []
        return
    assert len(bounds) <= max_buckets and max(bounds) == positive.max()
    values = sorted(set(positive.tolist()))
    best = min(cost(list(c)) for k in range(1, max_buckets + 1) for c in itertools.combinations(values, k))
    assert cost(bounds) == best


def test_gather_chunks_never_exceed_the_target_index_limit(stores: dict[str, Path]) -> None:
    """With gather.max_indices, every Gather (entries and the output-order Gather) holds at most that
    many indices and the graph still computes the reference."""
    loaded = load(stores["ray"])
    lift = product_lift(loaded, "ell")
    for layout in ("channel-last", "channel-first"):
        model, _ = build_graph(lift, Plan(form="gather", layout=layout, input_rank=4, batch=1, channels=3, opset=17, max_indices=50))
        cost = graph_cost(model)
        assert 0 < cost.max_gather_indices <= 50 and cost.gathers > 10
        inputs = make_inputs(loaded, 3, 1, 1, False)
        want = _reference(stores["ray"], "ell", inputs)
        assert np.max(np.abs(_run(model, inputs, 4).reshape(want.shape) - want)) <= 1e-6


def test_window_stats_count_the_block_values_the_graph_stores(stores: dict[str, Path]) -> None:
    """The cost the planner reads before building equals the blocks the windows graph holds."""
    lift = product_lift(load(stores["ray"]), "ell")
    stats = window_stats(lift.by_output(), (4, 4))
    model, _ = build_graph(lift, Plan(form="windows", layout="channel-first", input_rank=4, batch=1, channels=3, opset=17, patch=(4, 4)))
    blocks = [numpy_helper.to_array(i) for i in model.graph.initializer if i.name.startswith("block_")]
    assert sum(b.size for b in blocks) == stats.block_values
    assert sum(1 for n in model.graph.node if n.op_type == "MatMul") == stats.matmuls


# --------------------------------------------------------------------------------------
# target profiles and the planner
# --------------------------------------------------------------------------------------


def test_every_bundled_profile_parses_and_every_entry_has_a_source() -> None:
    names = profile_names()
    assert {"generic", "rk3588", "rk3568", "rv1106", "openvino", "litert", "onnxruntime"} <= set(names)
    for profile in load_profiles():
        for limit in profile.limits.values():
            assert limit.source.strip() and limit.value > 0, (profile.name, limit.key)
        for note in (*profile.rewrites, *profile.runtime):
            assert note.source.strip(), (profile.name, note.pattern)
        assert profile.int8_source.strip()
    rk = load_profile("rk3588")
    assert rk.int_limit("gather.max_indices") == 8191 and rk.int_limit("gather.max_axis") == 8191
    assert load_profile("rv1106").compute == ("int8",)
    assert any("f32" in note.what for note in load_profile("openvino").runtime)


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (lambda d: d.pop("forms"), "forms"),
        (lambda d: d.__setitem__("forms", ["spiral"]), "forms[0]"),
        (lambda d: d.__setitem__("input_rank", 3), "input_rank"),
        (lambda d: d["limits"].__setitem__("gather.max_wobble", {"value": 1, "source": "x"}), "limits.gather.max_wobble"),
        (lambda d: d["limits"]["gather.max_indices"].pop("source"), "limits.gather.max_indices.source"),
        (lambda d: d["limits"]["gather.max_indices"].__setitem__("value", -3), "limits.gather.max_indices.value"),
        (lambda d: d["int8"].__setitem__("route", "magic"), "route"),
    ],
)
def test_a_bad_profile_names_its_file_and_field(edit: object, field: str) -> None:
    import tomllib

    from bevcompile.deploy.targets import _profile_dir

    data = tomllib.loads(_profile_dir().joinpath("rk3588.toml").read_text())
    edit(data)  # type: ignore[operator]
    with pytest.raises(TargetError) as info:
        parse_profile(data, "my.toml")
    assert str(info.value).startswith(f"my.toml: {field}:")


def test_unknown_target_lists_the_profiles(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="rk3588"):
        load_profile("rk9999")
    broken = tmp_path / "broken.toml"
    broken.write_text("name = [")
    with pytest.raises(TargetError, match=r"broken\.toml: not a TOML file"):
        load_profile(str(broken))


def test_a_profile_file_drives_the_form_limits_are_data(stores: dict[str, Path]) -> None:
    """The same lift planned for profile FILES that differ only in their numbers: the windows form
    takes the largest patch within weights.max_bytes; over nodes.max, the gather form; with the
    compiled-size ratio broken too, one line naming the limits each form breaks."""
    import tomllib

    from bevcompile.deploy.targets import _profile_dir

    lift = product_lift(load(stores["ray"]), "ell")
    base = tomllib.loads(_profile_dir().joinpath("rk3588.toml").read_text())

    def profile(weights_budget: float, nodes: float, ratio: float = 3) -> object:
        data = dict(base, limits={**base["limits"]})
        for key, value in (("weights.max_bytes", weights_budget), ("nodes.max", nodes), ("compiled.max_ratio", ratio)):
            data["limits"][key] = {"value": value, "source": "test"}
        return parse_profile(data, "test.toml")

    kwargs = {"channels": 3, "batch": 1, "opset": 17, "weights": "float32", "product": "ell"}
    big, _ = plan_for_target(profile(1 << 30, 1e6), lift, **kwargs)  # type: ignore[arg-type]
    budget = 4 * window_stats(lift.by_output(), (8, 8)).block_values
    small, refused = plan_for_target(profile(budget, 1e6), lift, **kwargs)  # type: ignore[arg-type]
    assert big.plan is not None and small.plan is not None and refused == []
    assert big.plan.form == small.plan.form == "windows"
    assert big.plan.patch is not None and small.plan.patch is not None
    assert small.plan.patch[0] * small.plan.patch[1] < big.plan.patch[0] * big.plan.patch[1]
    assert 4 * window_stats(lift.by_output(), small.plan.patch).block_values <= budget
    fallback, refused = plan_for_target(profile(1 << 30, 40, ratio=1e9), lift, **kwargs)  # type: ignore[arg-type]
    assert fallback.plan is not None and fallback.plan.form == "gather" and refused[0][0] == "windows"
    assert "nodes.max" in refused[0][1][0]
    with pytest.raises(UsageError) as info:
        plan_for_target(profile(1 << 30, 40), lift, **kwargs)  # type: ignore[arg-type]
    message = str(info.value)
    assert "\n" not in message and "nodes.max" in message and "compiled.max_ratio" in message and "bev.region" in message


def test_frustum_on_rk3588_is_refused_with_the_ray_mode_alternative(stores: dict[str, Path]) -> None:
    lift = product_lift(load(stores["frustum"]), "ell")
    with pytest.raises(UsageError) as info:
        plan_for_target(load_profile("rk3588"), lift, channels=3, batch=1, opset=17, weights="float16", product="ell")
    message = str(info.value)
    assert "frustum" in message and "--mode ray" in message and "\n" not in message


def test_rk3588_batch_limit_and_channel_note(stores: dict[str, Path]) -> None:
    lift = product_lift(load(stores["ray"]), "ell")
    with pytest.raises(UsageError, match=r"batch\.max 1"):
        plan_for_target(load_profile("rk3588"), lift, channels=3, batch=2, opset=17, weights="float16")
    candidate, _ = plan_for_target(load_profile("rk3588"), lift, channels=3, batch=1, opset=17, weights="float16")
    assert candidate.plan is not None and any("blocks of 8" in note for note in candidate.plan.notes)
