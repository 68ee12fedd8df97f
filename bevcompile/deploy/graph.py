"""The graph builder: a :class:`~bevcompile.deploy.lift.LiftMatrix` -> a static ONNX graph, op by op.

No tracing: every node is chosen here, by a :class:`Plan` that a target profile
(:mod:`bevcompile.deploy.targets`) and the options made (:func:`plan_graph`). Forms:

``gather`` (layout ``channel-last``)
    features -> ``(N, P, C)`` (one Transpose), per bucket of rows with the same entry count
    ``K_b``: one ``Gather`` of whole ``C``-vectors (``axis=1``), ``Mul`` by the ``(R_b * K_b, 1)``
    weights, ``ReduceSum`` over ``K_b``; the buckets concatenated, one ``Gather`` of rows back to
    output order (only when needed), one Transpose to ``(N, C, ...)``. Nothing is gathered for the
    padding of a global ``K`` (buckets), and no ``(C, rows * K)`` tensor is written more than once.
``gather`` (layout ``channel-first``)
    the same along the last axis of ``(N, C, P)`` (today's order of operations).
``windows``
    no Gather at all: the output is assembled from BEV patches of ``ph x pw`` cells; for each patch
    and camera that feeds it, ``Slice`` of the contiguous feature window ``[v0, v1) x [u0, u1)`` the
    patch's entries read, ``Reshape`` to ``(1, C, win)``, ``MatMul`` with the dense ``(win, ph*pw)``
    block, ``Add`` over the cameras; patches ``Concat``-ed into ``(1, C, ny, nx)``. The form of NPUs
    whose compiler turns constant-index Gathers into one-hot convolutions or per-index register
    commands. Features alone (grid / ray mode, the ``gather`` product).
``tiles``
    rows in tiles of ``R``: one ``Gather`` of the tile's distinct columns, one ``MatMul`` with the
    dense ``(R, n_cols_t)`` block; tiles concatenated.

Weights (:data:`WEIGHTS`): ``float32``; ``float16`` (float16 initializers + one ``Cast`` each);
``int8`` (int8 initializers + ``Cast``, the per-row scale applied after the sum by one ``Mul``);
``int8-qdq`` (int8 initializers through ``DequantizeLinear``, per-axis (per output row) scales or,
where the profile says the converter mangles per-axis scales, a per-tensor DequantizeLinear of the
integers and one ``Mul`` by the row scales; with :attr:`Plan.qdq_activations` the activations are
quantised too (``QuantizeLinear -> DequantizeLinear``, symmetric int8, scales calibrated on seeded
or user features by :func:`calibrate_activation_scales`): the inputs (so every Gather moves int8),
every MatMul / Add output and every row sum; the gather form's per-entry products ``w * x`` are
summed before they are requantised (requantising each tiny product cost the frustum ELL 8 dB: 41.3
-> 49.1 dB on nuScenes).

Needs the ``[onnx]`` extra (onnx; onnxruntime for the calibration).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from ..errors import UsageError
from .lift import LiftMatrix

WEIGHTS = ("float32", "float16", "int8", "int8-qdq", "mixed")
MAX_BUCKETS = 4
"""Row buckets of the channel-last gather (rows grouped by entry count): more buckets gather less
padding but add a Gather/Mul/ReduceSum each."""
WINDOW_PATCHES = ((32, 32), (32, 16), (16, 16), (16, 8), (8, 8), (8, 4), (4, 4), (2, 2), (1, 1))
"""BEV patch sizes (rows x columns of cells) the windows form tries, largest first."""
LINE_PATCHES = (1024, 512, 256, 128, 64, 32, 16, 8, 4, 2, 1)
"""Patch lengths of a one-row output (the kept cells of ``--rows compact``)."""


# --------------------------------------------------------------------------------------
# the plan
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """How one lift becomes a graph (every choice the builder makes, stated).

    Convention: ``input_rank`` 5: inputs ``features (N, n_cam, C, H_f, W_f)`` and (frustum)
    ``depth (N, n_cam, D, H_f, W_f)``, output ``(N, C, *out_shape)``; 4: inputs ``(N * n_cam, C,
    H_f, W_f)`` / ``(N * n_cam, D, H_f, W_f)``, output ``(N, C, ny, nx)`` (``gather``: ``(N, C,
    n_heights * ny, nx)``, the heights stacked along y: a Reshape to ``(N, C, n_heights, ny, nx)``
    is free; compact: ``(N, C, 1, n_kept)``).
    """

    form: str
    layout: str
    input_rank: int
    batch: int
    channels: int
    opset: int
    weights: str = "float32"
    qdq_activations: bool = False
    per_axis: bool = True
    max_indices: int | None = None
    max_axis: int | None = None
    patch: tuple[int, int] | None = None
    tile_rows: int | None = None
    buckets: int = MAX_BUCKETS
    guard: bool = False
    notes: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {
            "form": self.form,
            "layout": self.layout,
            "input_rank": self.input_rank,
            "batch": self.batch,
            "channels": self.channels,
            "weights": self.weights,
            "qdq_activations": self.qdq_activations,
            "per_axis_scales": self.per_axis,
            "max_gather_indices": self.max_indices,
            "max_gather_axis": self.max_axis,
            "patch": None if self.patch is None else list(self.patch),
            "tile_rows": self.tile_rows,
            "guard": self.guard,
            "notes": list(self.notes),
        }


@dataclass(frozen=True)
class WindowStats:
    """What the windows form costs at one patch size (from the entries alone, nothing built)."""

    patch: tuple[int, int]
    matmuls: int
    block_values: int
    patches: int

    def nodes(self) -> int:
        """Node count estimate: Slice + Reshape + MatMul + Add per (patch, camera), a Reshape per patch,
        a Slice per camera, the Concats."""
        return 4 * self.matmuls + self.patches + 64


def window_stats(lift: LiftMatrix, patch: tuple[int, int]) -> WindowStats:
    """:class:`WindowStats` of ``lift`` (one row per output position) at ``patch``."""
    planes, h, w = _planes(lift.out_shape)
    ph, pw = min(patch[0], h), min(patch[1], w)
    w_f, h_f = lift.feature_size
    pos = lift.row
    plane, rem = np.divmod(pos, h * w)
    iy, ix = np.divmod(rem, w)
    cam, pix = np.divmod(lift.pixel, h_f * w_f)
    v, u = np.divmod(pix, w_f)
    py, px = iy // ph, ix // pw
    n_py, n_px = -(-h // ph), -(-w // pw)
    key = ((plane * n_py + py) * n_px + px) * lift.n_cam + cam
    n_keys = planes * n_py * n_px * lift.n_cam
    if key.size == 0:
        return WindowStats((ph, pw), 0, 0, planes * n_py * n_px)
    big = np.iinfo(np.int64).max
    v0 = np.full(n_keys, big, np.int64)
    u0 = np.full(n_keys, big, np.int64)
    v1 = np.full(n_keys, -1, np.int64)
    u1 = np.full(n_keys, -1, np.int64)
    np.minimum.at(v0, key, v)
    np.minimum.at(u0, key, u)
    np.maximum.at(v1, key, v)
    np.maximum.at(u1, key, u)
    used = v1 >= 0
    k = np.flatnonzero(used)
    rest = k // lift.n_cam
    p_x = rest % n_px
    p_y = (rest // n_px) % n_py
    rows = (np.minimum(ph, h - p_y * ph)) * (np.minimum(pw, w - p_x * pw))
    area = (v1[k] - v0[k] + 1) * (u1[k] - u0[k] + 1)
    return WindowStats((ph, pw), int(k.size), int((area * rows).sum()), planes * n_py * n_px)


def _planes(out_shape: tuple[int, ...]) -> tuple[int, int, int]:
    """``(planes, h, w)`` of an output shape: ``(n_h, ny, nx)``, ``(ny, nx)``, ``(n_h, n_kept)`` ->
    ``n_h`` planes of one row, ``(n_kept,)``."""
    if len(out_shape) == 3:
        return out_shape[0], out_shape[1], out_shape[2]
    if len(out_shape) == 2:
        return 1, out_shape[0], out_shape[1]
    return 1, 1, out_shape[0]


def window_patch_ladder(out_shape: tuple[int, ...]) -> list[tuple[int, int]]:
    """The patch sizes the windows form tries for an output of ``out_shape``, largest first, each
    clipped to the output and listed once (:data:`LINE_PATCHES` for a one-row output)."""
    _, h, w = _planes(out_shape)
    candidates = [(1, p) for p in LINE_PATCHES] if h == 1 else list(WINDOW_PATCHES)
    return list(dict.fromkeys((min(a, h), min(b, w)) for a, b in candidates))


def choose_window_patch(lift: LiftMatrix, weight_bytes: int | None, max_nodes: int | None, value_bytes: int) -> tuple[WindowStats | None, list[WindowStats]]:
    """The largest patch whose blocks fit ``weight_bytes`` and whose graph fits ``max_nodes``;
    ``(None, tried)`` when none does (else ``tried`` ends with the chosen one). ``value_bytes``: bytes
    per stored block value. ``lift``: one row per output position (:meth:`LiftMatrix.by_output`)."""
    tried: list[WindowStats] = []
    for patch in window_patch_ladder(lift.out_shape):
        stats = window_stats(lift, patch)
        tried.append(stats)
        fits_bytes = weight_bytes is None or stats.block_values * value_bytes <= weight_bytes
        fits_nodes = max_nodes is None or stats.nodes() <= max_nodes
        if fits_bytes and fits_nodes:
            return stats, tried
    return None, tried


# --------------------------------------------------------------------------------------
# the ONNX writer
# --------------------------------------------------------------------------------------


class Writer:
    """Appends nodes and initializers with readable, unique names.

    ``act(name)`` marks an activation: with ``scales`` (tensor name -> float) it inserts
    ``QuantizeLinear -> DequantizeLinear`` (int8, zero point 0) and returns the dequantised name;
    without, it records the name (the calibration run reads those tensors).
    """

    def __init__(self, opset: int, scales: dict[str, float] | None = None) -> None:
        import onnx

        self.onnx = onnx
        self.opset = opset
        self.nodes: list[Any] = []
        self.initializers: list[Any] = []
        self.counts: dict[str, int] = {}
        self.scales = scales
        self.activations: list[str] = []
        self._scalar_cache: dict[tuple[str, Any], str] = {}

    def _name(self, hint: str) -> str:
        n = self.counts.get(hint, 0)
        self.counts[hint] = n + 1
        return hint if n == 0 else f"{hint}_{n}"

    def const(self, hint: str, array: Any) -> str:
        from onnx import numpy_helper

        name = self._name(hint)
        self.initializers.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def ints(self, values: Any) -> str:
        """An int64 1-D constant (shapes, axes, starts), shared by equal values."""
        key = ("i64", tuple(int(v) for v in values))
        if key not in self._scalar_cache:
            self._scalar_cache[key] = self.const("shape_" + "x".join(str(v) for v in key[1]).replace("-", "m"), np.asarray(key[1], np.int64))
        return self._scalar_cache[key]

    def scalar(self, value: Any, dtype: Any) -> str:
        key = (np.dtype(dtype).name, float(value))
        if key not in self._scalar_cache:
            self._scalar_cache[key] = self.const(f"{np.dtype(dtype).name}_{len(self._scalar_cache)}", np.asarray(value, dtype))
        return self._scalar_cache[key]

    def node(self, op: str, inputs: list[str], hint: str | None = None, **attrs: Any) -> str:
        out = self._name(hint or op.lower())
        self.nodes.append(self.onnx.helper.make_node(op, inputs, [out], name=out, **attrs))
        return out

    def reshape(self, x: str, shape: tuple[int, ...] | list[int], hint: str | None = None) -> str:
        return self.node("Reshape", [x, self.ints(shape)], hint)

    def act(self, x: str) -> str:
        self.activations.append(x)
        if self.scales is None:
            return x
        scale = self.scalar(self.scales.get(x, 1.0), np.float32)
        zero = self.scalar(0, np.int8)
        q = self.node("QuantizeLinear", [x, scale, zero], f"{x}_q")
        return self.node("DequantizeLinear", [q, scale, zero], f"{x}_dq")

    def model(self, inputs: list[tuple[str, list[int]]], output: str, out_shape: list[int], metadata: dict[str, str] | None = None) -> Any:
        """The ModelProto; the tensor ``output`` becomes the graph output ``bev``."""
        onnx = self.onnx
        helper = onnx.helper
        producer = next((node for node in self.nodes if output in node.output), None)
        if producer is not None:
            producer.output[list(producer.output).index(output)] = "bev"
        else:  # the output is an input or a constant (a degenerate lift): pass it through
            self.nodes.append(helper.make_node("Identity", [output], ["bev"], name="bev"))
        graph = helper.make_graph(
            self.nodes,
            "bevcompile_lift",
            [helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, shape) for name, shape in inputs],
            [helper.make_tensor_value_info("bev", onnx.TensorProto.FLOAT, out_shape)],
            self.initializers,
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", self.opset)], producer_name="bevcompile")
        model.ir_version = min(model.ir_version, 8)  # readable by the toolchains' older onnx (1.16-1.18)
        for key, value in (metadata or {}).items():
            prop = model.metadata_props.add()
            prop.key, prop.value = key, value
        return model


# --------------------------------------------------------------------------------------
# weights
# --------------------------------------------------------------------------------------


def _weights(wr: Writer, plan: Plan, hint: str, values: np.ndarray, q: np.ndarray | None, axis_scale: np.ndarray | None, axis: int) -> tuple[str, bool]:
    """The constant ``values`` in the plan's weight dtype; returns ``(name, scaled)``: ``scaled``
    False when the caller must still multiply by the row scales (``int8`` Cast form, or
    ``int8-qdq`` without per-axis scales).

    Convention: ``values`` float32 (the dequantised values for int8); ``q`` int8 of the same shape;
    ``axis_scale`` float32, one scale per index of ``axis`` (the output rows)."""
    if plan.weights == "float32":
        return wr.const(hint, values.astype(np.float32)), True
    if plan.weights == "float16":
        return wr.node("Cast", [wr.const(f"{hint}_f16", values.astype(np.float16))], hint, to=wr.onnx.TensorProto.FLOAT), True
    assert q is not None and axis_scale is not None
    if plan.weights == "int8":
        return wr.node("Cast", [wr.const(f"{hint}_int8", q)], hint, to=wr.onnx.TensorProto.FLOAT), False
    if plan.per_axis:
        scale = np.where(axis_scale > 0, axis_scale, np.float32(1.0)).astype(np.float32)
        zero = np.zeros(scale.shape, np.int8)
        return wr.node("DequantizeLinear", [wr.const(f"{hint}_int8", q), wr.const(f"{hint}_scale", scale), wr.const(f"{hint}_zero", zero)], hint, axis=axis), True
    one, zero_point = wr.scalar(1.0, np.float32), wr.scalar(0, np.int8)
    return wr.node("DequantizeLinear", [wr.const(f"{hint}_int8", q), one, zero_point], hint), False


# --------------------------------------------------------------------------------------
# inputs
# --------------------------------------------------------------------------------------


def input_shapes(lift: LiftMatrix, plan: Plan) -> list[tuple[str, list[int]]]:
    """The graph inputs ``[(name, shape)]`` (see :class:`Plan`)."""
    w_f, h_f = lift.feature_size
    n, c = plan.batch, plan.channels
    if plan.input_rank == 5:
        shapes = [("features", [n, lift.n_cam, c, h_f, w_f])]
        if lift.frustum:
            shapes.append(("depth", [n, lift.n_cam, lift.n_depth, h_f, w_f]))
    else:
        shapes = [("features", [n * lift.n_cam, c, h_f, w_f])]
        if lift.frustum:
            shapes.append(("depth", [n * lift.n_cam, lift.n_depth, h_f, w_f]))
    return shapes


def output_shape(lift: LiftMatrix, plan: Plan) -> list[int]:
    n, c = plan.batch, plan.channels
    if plan.input_rank == 5:
        return [n, c, *lift.out_shape]
    planes, h, w = _planes(lift.out_shape)
    return [n, c, planes * h, w]


def _input(wr: Writer, name: str, plan: Plan) -> str:
    """A graph input, quantised (full QDQ) and, with ``plan.guard``, sanitised:
    ``Where(Equal(Sub(x, x), 0), x, 0)`` — finite values pass bit for bit, NaN and +-inf become 0
    (:func:`bevcompile.matrix.precision.sanitize`, the torch modules' ``guard=True``)."""
    x = wr.act(name)
    if not plan.guard:
        return x
    zero = wr.scalar(0.0, np.float32)
    finite = wr.node("Equal", [wr.node("Sub", [x, x], f"{name}_minus_itself"), zero], f"{name}_finite")
    return wr.node("Where", [finite, x, zero], f"{name}_guarded")


def _flat_features(wr: Writer, lift: LiftMatrix, plan: Plan) -> str:
    """``features`` as ``(N, P, C)`` (channel-last) or ``(N, C, P)`` (channel-first), P = n_cam*H*W."""
    w_f, h_f = lift.feature_size
    n, c, p = plan.batch, plan.channels, lift.n_pixels
    x = _input(wr, "features", plan)
    if plan.layout == "channel-last":
        perm = [0, 1, 3, 4, 2] if plan.input_rank == 5 else [0, 2, 3, 1]
        return wr.reshape(wr.node("Transpose", [x], "features_nhwc", perm=perm), [n, p, c], "features_flat")
    x = wr.reshape(x, [n, lift.n_cam, c, h_f * w_f])  # rank 4 and 5 alike
    return wr.reshape(wr.node("Transpose", [x], "features_cfirst", perm=[0, 2, 1, 3]), [n, c, p], "features_flat")


def _flat_depth(wr: Writer, lift: LiftMatrix, plan: Plan) -> str:
    w_f, h_f = lift.feature_size
    return wr.reshape(_input(wr, "depth", plan), [plan.batch, lift.n_cam * lift.n_depth * h_f * w_f], "depth_flat")


# --------------------------------------------------------------------------------------
# form: gather
# --------------------------------------------------------------------------------------


def row_buckets(counts: np.ndarray, max_buckets: int) -> list[int]:
    """Entry-count bounds of at most ``max_buckets`` buckets minimising the gathered slots
    ``sum_b K_b * rows_b`` (rows with ``count <= K_b`` and above the previous bound); rows with 0
    entries are in no bucket. Exact dynamic programme over the distinct counts."""
    values, rows = np.unique(counts[counts > 0], return_counts=True)
    if values.size == 0:
        return []
    m = values.size
    b = max(1, min(max_buckets, m))
    prefix = np.concatenate([[0], np.cumsum(rows)])
    inf = float("inf")
    # cost[j][k]: best cost covering the first j distinct values with k buckets
    cost = np.full((m + 1, b + 1), inf)
    arg = np.zeros((m + 1, b + 1), np.int64)
    cost[0, 0] = 0.0
    for j in range(1, m + 1):
        for k in range(1, b + 1):
            for i in range(k - 1, j):  # bucket holds values[i:j], bound values[j-1]
                c = cost[i, k - 1] + float(values[j - 1]) * float(prefix[j] - prefix[i])
                if c < cost[j, k]:
                    cost[j, k], arg[j, k] = c, i
    k = int(np.argmin(cost[m, 1:]) + 1)
    bounds = []
    j = m
    while k > 0:
        bounds.append(int(values[j - 1]))
        j, k = int(arg[j, k]), k - 1
    return sorted(bounds)


def _ell_bucket(lift: LiftMatrix, rows: np.ndarray, k: int, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray | None, np.ndarray, np.ndarray | None]:
    """``(pixel, depth, value, q)`` ``(len(rows), k)`` ELL of ``rows`` (padding: the row's first
    pixel, value 0)."""
    counts = starts[rows + 1] - starts[rows]
    slot = np.arange(k)[None, :]
    take = starts[rows][:, None] + np.minimum(slot, np.maximum(counts[:, None] - 1, 0))
    real = slot < counts[:, None]
    pixel = lift.pixel[take]
    value = np.where(real, lift.value[take], np.float32(0))
    depth = None if lift.depth is None else lift.depth[take]
    q = None if lift.q is None else np.where(real, lift.q[take], np.int8(0)).astype(np.int8)
    return pixel, depth, value, q


def _gather_rows(wr: Writer, rows: str, take: np.ndarray, axis: int, limit: int | None) -> str:
    """``rows`` in output order: one Gather of ``take`` along ``axis`` (chunks of at most ``limit``
    indices, concatenated, on a target with a Gather limit)."""
    if limit is None or take.size <= limit:
        return wr.node("Gather", [rows, wr.const("row_of_output", take.astype(np.int32))], "rows_in_output_order", axis=axis)
    parts = [
        wr.node("Gather", [rows, wr.const(f"row_of_output_{i}", take[a : a + limit].astype(np.int32))], f"rows_in_output_order_{i}", axis=axis)
        for i, a in enumerate(range(0, take.size, limit))
    ]
    return wr.node("Concat", parts, "rows_in_output_order", axis=axis)


def _gather_form(wr: Writer, lift: LiftMatrix, plan: Plan) -> str:
    n, c = plan.batch, plan.channels
    last = plan.layout == "channel-last"
    x = _flat_features(wr, lift, plan)
    d = _flat_depth(wr, lift, plan) if lift.frustum else None
    counts = lift.row_counts()
    starts = np.concatenate([[0], np.cumsum(counts)])
    limit = plan.max_indices
    parts: list[str] = []
    order: list[np.ndarray] = []
    # row groups: one for every weight dtype (mixed: the fp16 rows and the int8 rows), buckets in each
    if plan.weights == "mixed":
        if lift.row_fp16 is None:
            raise UsageError("--weights mixed needs the store's mixed product (bevcompile matrix --quantize mixed)")
        groups = [("fp16", replace(plan, weights="float16"), lift.row_fp16), ("int8", replace(plan, weights="int8"), ~lift.row_fp16)]
    else:
        groups = [("", plan, np.ones(lift.n_rows, bool))]
    jobs = []
    for group_tag, group_plan, member in groups:
        group_counts = np.where(member, counts, 0)
        lower = 0
        for bound in row_buckets(group_counts, plan.buckets):
            in_bucket = np.flatnonzero((group_counts > lower) & (group_counts <= bound))
            lower = bound
            if in_bucket.size:
                jobs.append((group_tag, group_plan, bound, in_bucket))
    for group_tag, group_plan, bound, in_bucket in jobs:
        k = bound
        chunk = in_bucket.size if limit is None else max(1, limit // k)
        for start in range(0, in_bucket.size, chunk):
            rows = in_bucket[start : start + chunk]
            pixel, depth, value, q = _ell_bucket(lift, rows, k, starts)
            r = rows.size
            tag = f"{group_tag}k{k}" + ("" if chunk >= in_bucket.size else f"_{start // chunk}")
            idx = wr.const(f"index_{tag}", pixel.reshape(-1).astype(np.int32))
            gathered = wr.node("Gather", [x, idx], f"gathered_{tag}", axis=1 if last else 2)
            scale_rows = None if lift.row_scale is None else lift.row_scale[rows].astype(np.float32)
            per_entry = None if scale_rows is None else np.repeat(scale_rows, k)
            # the weights as a constant of the gathered tensor's rank: (1, M, 1) channel-last, (1, 1, M)
            # channel-first (no Reshape of a constant: converters that re-lay tensors out keep it aligned)
            shape = (1, r * k, 1) if last else (1, 1, r * k)
            w, scaled = _weights(wr, group_plan, f"weight_{tag}", value.reshape(shape), None if q is None else q.reshape(shape), per_entry, 1 if last else 2)
            if d is not None and depth is not None:
                didx = wr.const(f"depth_index_{tag}", depth.reshape(-1).astype(np.int32))
                dval = wr.reshape(wr.node("Gather", [d, didx], f"depth_{tag}", axis=1), [n, r * k, 1] if last else [n, 1, r * k])
                coeff = wr.node("Mul", [dval, w], f"coeff_{tag}")
            else:
                coeff = w
            weighted = wr.node("Mul", [gathered, coeff], f"weighted_{tag}")  # summed in float: only the sums are requantised
            if last:
                summed = wr.node("ReduceSum", [wr.reshape(weighted, [n, r, k, c]), wr.ints([2])], f"rows_{tag}", keepdims=0)
            else:
                summed = wr.node("ReduceSum", [wr.reshape(weighted, [n, c, r, k]), wr.ints([3])], f"rows_{tag}", keepdims=0)
            if not scaled:
                assert scale_rows is not None
                summed = wr.node("Mul", [summed, wr.const(f"row_scale_{tag}", scale_rows.reshape(1, -1, 1) if last else scale_rows.reshape(1, 1, -1))], f"rows_scaled_{tag}")
            parts.append(wr.act(summed))
            order.append(rows)
    return _in_output_order(wr, lift, plan, parts, order, last)


def _in_output_order(wr: Writer, lift: LiftMatrix, plan: Plan, parts: list[str], order: list[np.ndarray], last: bool) -> str:
    """The computed row blocks ``parts`` (rows ``order[i]`` each; indices ``>= n_rows`` are a tile's
    padding rows) concatenated, one Gather of rows into output order when that order is not
    already theirs (a zero row appended for the positions no row feeds), then ``(N, C, ...)``."""
    n, c = plan.batch, plan.channels
    computed = np.concatenate(order) if order else np.zeros(0, np.int64)
    position = np.full(lift.n_rows + 1, computed.size, np.int64)  # rows with no entries -> the zero row
    real = computed < lift.n_rows
    position[computed[real]] = np.flatnonzero(real)
    out_rows = lift.out_rows()
    take = position[np.where(out_rows >= 0, out_rows, lift.n_rows)]
    needs_zero = bool((take == computed.size).any())
    if needs_zero or not parts:
        parts.append(wr.const("zero_row", np.zeros((n, 1, c) if last else (n, c, 1), np.float32)))
    rows_out = parts[0] if len(parts) == 1 else wr.node("Concat", parts, "rows", axis=1 if last else 2)
    identity = take.size == computed.size + needs_zero and np.array_equal(take, np.arange(take.size))
    if not identity:
        rows_out = _gather_rows(wr, rows_out, take, 1 if last else 2, plan.max_indices)
    if last:
        rows_out = wr.node("Transpose", [rows_out], "bev_cfirst", perm=[0, 2, 1])
    return wr.reshape(rows_out, output_shape(lift, plan), "bev_shaped")


# --------------------------------------------------------------------------------------
# form: tiles
# --------------------------------------------------------------------------------------


def _tiles_form(wr: Writer, lift: LiftMatrix, plan: Plan) -> str:
    if plan.weights == "mixed":
        raise UsageError("--weights mixed is built in the gather form (two row groups: int8 and fp16)")
    return _tiles_body(wr, lift, plan)


def _tiles_body(wr: Writer, lift: LiftMatrix, plan: Plan) -> str:
    """Rows in tiles of ``R``; tiles in buckets by their distinct-column count ``K_b``; per bucket ONE
    Gather of the tiles' columns (whole C-vectors) and ONE batched MatMul with the ``(T_b, R, K_b)``
    blocks (zero-padded); the per-row scales of int8 as one Mul after it."""
    if plan.layout != "channel-last":
        raise UsageError("the tiles form is built channel-last (batched MatMul of (T, R, K) blocks with (N, T, K, C) columns)")
    n, c = plan.batch, plan.channels
    r = plan.tile_rows or 8
    x = _flat_features(wr, lift, plan)
    d = _flat_depth(wr, lift, plan) if lift.frustum else None
    n_tiles = -(-lift.n_rows // r)
    # the sorted distinct columns of every tile (columns: the depth index in frustum mode, else the
    # pixel): cols[cols_start[t]:cols_start[t + 1]]; entry_cols: each entry's index into cols
    col_key = lift.depth if lift.depth is not None else lift.pixel
    tile = lift.row // r
    span = int(col_key.max()) + 1 if col_key.size else 1
    keys, entry_cols = np.unique(tile * span + col_key, return_inverse=True)
    cols = keys % span
    cols_start = np.searchsorted(keys // span, np.arange(n_tiles + 1))
    ncols = np.diff(cols_start)
    bounds = row_buckets(ncols, plan.buckets)
    parts: list[str] = []
    order: list[np.ndarray] = []
    lower = 0
    pixels = lift.feature_size[0] * lift.feature_size[1]
    for bound in bounds:
        tiles_b = np.flatnonzero((ncols > lower) & (ncols <= bound))
        lower = bound
        if tiles_b.size == 0:
            continue
        t_b, k = tiles_b.size, bound
        slot = np.arange(k)[None, :]
        take = cols_start[tiles_b][:, None] + np.minimum(slot, ncols[tiles_b][:, None] - 1)
        bcols = cols[take]  # (T_b, K): padding repeats the last column (its block column is 0)
        block = np.zeros((t_b, r, k), np.float32)
        qblock = np.zeros((t_b, r, k), np.int8) if lift.q is not None else None
        which = np.full(n_tiles, -1, np.int64)
        which[tiles_b] = np.arange(t_b)
        e = np.flatnonzero(which[tile] >= 0)
        tb = which[tile[e]]
        entry_col = entry_cols[e]
        pos = entry_col - cols_start[tile[e]]  # the entry's column within its tile's sorted columns
        np.add.at(block, (tb, lift.row[e] - tile[e] * r, pos), lift.value[e])
        if qblock is not None:
            assert lift.q is not None
            qblock[tb, lift.row[e] - tile[e] * r, pos] = lift.q[e]
        tag = f"k{k}"
        feat_cols = (bcols // (lift.n_depth * pixels)) * pixels + bcols % pixels if lift.depth is not None else bcols
        xt = wr.node("Gather", [x, wr.const(f"tile_cols_{tag}", feat_cols.reshape(-1).astype(np.int32))], f"tile_x_{tag}", axis=1)
        if d is not None:
            dt = wr.node("Gather", [d, wr.const(f"tile_depth_cols_{tag}", bcols.reshape(-1).astype(np.int32))], f"tile_depth_{tag}", axis=1)
            xt = wr.act(wr.node("Mul", [xt, wr.reshape(dt, [n, t_b * k, 1])], f"tile_x_depth_{tag}"))
        xt = wr.reshape(xt, [n, t_b, k, c])
        rows_scale = None
        if lift.row_scale is not None:
            padded = np.zeros(n_tiles * r, np.float32)
            padded[: lift.n_rows] = lift.row_scale
            rows_scale = padded.reshape(n_tiles, r)[tiles_b]
        plan_b = plan if plan.weights != "int8-qdq" else replace(plan, per_axis=False)  # one scale per (tile, row): no single DequantizeLinear axis
        w, scaled = _weights(wr, plan_b, f"tile_block_{tag}", block, qblock, None if rows_scale is None else rows_scale.reshape(-1), 0)
        y = wr.reshape(wr.node("MatMul", [w, xt], f"tile_rows_{tag}"), [n, t_b * r, c])
        if not scaled:
            assert rows_scale is not None
            y = wr.node("Mul", [y, wr.const(f"tile_row_scale_{tag}", rows_scale.reshape(1, -1, 1))], f"tile_rows_scaled_{tag}")
        parts.append(wr.act(y))
        order.append((tiles_b[:, None] * r + np.arange(r)[None, :]).reshape(-1))
    return _in_output_order(wr, lift, plan, parts, order, last=True)


# --------------------------------------------------------------------------------------
# form: windows
# --------------------------------------------------------------------------------------


def _windows_form(wr: Writer, lift: LiftMatrix, plan: Plan) -> str:
    if lift.frustum:
        raise UsageError("the windows form lifts features alone (grid or ray mode); a frustum-mode matrix needs the depth input")
    if plan.batch != 1:
        raise UsageError(f"the windows form is built for batch 1, got --batch {plan.batch}")
    if plan.weights == "mixed":
        raise UsageError("--weights mixed is built in the gather form (two row groups: int8 and fp16)")
    assert plan.patch is not None
    lift = lift.by_output()
    c = plan.channels
    w_f, h_f = lift.feature_size
    planes, h, w = _planes(lift.out_shape)
    ph, pw = min(plan.patch[0], h), min(plan.patch[1], w)
    x = _input(wr, "features", plan)
    if plan.input_rank == 5:
        x = wr.reshape(x, [lift.n_cam, c, h_f, w_f], "features_cams")
    cams: dict[int, str] = {}

    def camera(k: int) -> str:
        if k not in cams:
            cams[k] = wr.node("Slice", [x, wr.ints([k]), wr.ints([k + 1]), wr.ints([0])], f"cam{k}")
        return cams[k]

    pos = lift.row
    plane_of, rem = np.divmod(pos, h * w)
    iy, ix = np.divmod(rem, w)
    cam, pix = np.divmod(lift.pixel, h_f * w_f)
    v, u = np.divmod(pix, w_f)
    n_py, n_px = -(-h // ph), -(-w // pw)
    patch_key = (plane_of * n_py + iy // ph) * n_px + ix // pw
    order = np.lexsort((cam, patch_key))
    bounds = np.searchsorted(patch_key[order], np.arange(planes * n_py * n_px + 1))
    plane_parts = []
    for p_plane in range(planes):
        bands = []
        for py in range(n_py):
            patches = []
            rows_p = min(ph, h - py * ph)
            for px in range(n_px):
                cols_p = min(pw, w - px * pw)
                key = (p_plane * n_py + py) * n_px + px
                sel = order[bounds[key] : bounds[key + 1]]
                tag = f"p{p_plane}_{py}_{px}"
                acc: str | None = None
                unscaled = False
                scale_rows = None
                if lift.row_scale is not None:
                    grid_pos = (p_plane * h + py * ph + np.arange(rows_p)[:, None]) * w + px * pw + np.arange(cols_p)[None, :]
                    scale_rows = lift.row_scale[grid_pos.reshape(-1)].astype(np.float32)
                for k in np.unique(cam[sel]):
                    e = sel[cam[sel] == k]
                    v0, v1, u0, u1 = int(v[e].min()), int(v[e].max()) + 1, int(u[e].min()), int(u[e].max()) + 1
                    win = wr.node("Slice", [camera(int(k)), wr.ints([v0, u0]), wr.ints([v1, u1]), wr.ints([2, 3])], f"window_{tag}_cam{k}")
                    area = (v1 - v0) * (u1 - u0)
                    flat = wr.reshape(win, [1, c, area])
                    local = (iy[e] - py * ph) * cols_p + (ix[e] - px * pw)
                    wpix = (v[e] - v0) * (u1 - u0) + (u[e] - u0)
                    block = np.zeros((area, rows_p * cols_p), np.float32)
                    np.add.at(block, (wpix, local), lift.value[e])
                    qblock = None
                    if lift.q is not None:
                        qblock = np.zeros((area, rows_p * cols_p), np.int8)
                        qblock[wpix, local] = lift.q[e]
                    wname, scaled = _weights(wr, plan, f"block_{tag}_cam{k}", block, qblock, scale_rows, 1)
                    unscaled = unscaled or not scaled
                    y = wr.act(wr.node("MatMul", [flat, wname], f"lift_{tag}_cam{k}"))
                    acc = y if acc is None else wr.act(wr.node("Add", [acc, y], f"sum_{tag}_cam{k}"))
                if acc is None:
                    patches.append(wr.const(f"zero_{tag}", np.zeros((1, c, rows_p, cols_p), np.float32)))
                    continue
                if unscaled:
                    assert scale_rows is not None
                    acc = wr.act(wr.node("Mul", [acc, wr.const(f"row_scale_{tag}", scale_rows.reshape(1, 1, -1))], f"scaled_{tag}"))
                patches.append(wr.reshape(acc, [1, c, rows_p, cols_p], f"patch_{tag}"))
            bands.append(patches[0] if len(patches) == 1 else wr.node("Concat", patches, f"band_{p_plane}_{py}", axis=3))
        plane_parts.append(bands[0] if len(bands) == 1 else wr.node("Concat", bands, f"plane_{p_plane}", axis=2))
    out = plane_parts[0] if len(plane_parts) == 1 else wr.node("Concat", plane_parts, "planes", axis=2)
    target = output_shape(lift, plan)
    return out if target == [1, c, planes * h, w] else wr.reshape(out, target, "bev_shaped")


FORM_BUILDERS: dict[str, Callable[[Writer, LiftMatrix, Plan], str]] = {
    "gather": _gather_form,
    "tiles": _tiles_form,
    "windows": _windows_form,
}


def build_graph(lift: LiftMatrix, plan: Plan, scales: dict[str, float] | None = None, metadata: dict[str, str] | None = None) -> tuple[Any, list[str]]:
    """``(ModelProto, activation names)`` of ``lift`` in ``plan``'s form; ``scales``: the
    activation scales of a fully quantised graph (``plan.qdq_activations``)."""
    if plan.form not in FORM_BUILDERS:
        raise UsageError(f"the graph builder has no form {plan.form!r} (forms: {', '.join(FORM_BUILDERS)})")
    wr = Writer(plan.opset, scales if plan.qdq_activations else None)
    out = FORM_BUILDERS[plan.form](wr, lift, plan)
    return wr.model(input_shapes(lift, plan), out, output_shape(lift, plan), metadata), list(dict.fromkeys(wr.activations))


# --------------------------------------------------------------------------------------
# calibration (full int8)
# --------------------------------------------------------------------------------------

QDQ_SESSION_LEVEL = "ORT_ENABLE_BASIC"
"""onnxruntime graph optimisation level of QDQ checks: EXTENDED fuses DequantizeLinear -> MatMul with
per-column scales into a kernel that gives wrong numbers (measured, onnxruntime 1.32)."""


def calibrate_activation_scales(model: Any, names: list[str], samples: list[dict[str, np.ndarray]]) -> dict[str, float]:
    """Symmetric int8 scale ``max |t| / 127`` of every activation ``name`` over the ``samples``
    (the float graph run by onnxruntime with those tensors exposed as outputs)."""
    import onnx
    import onnxruntime as ort

    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    existing = {o.name for o in probe.graph.output}
    for name in names:
        if name not in existing:
            probe.graph.output.append(onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None))
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(probe.SerializeToString(), options, providers=["CPUExecutionProvider"])
    peak = dict.fromkeys(names, 0.0)
    for feeds in samples:
        values = session.run(names, feeds)
        for name, value in zip(names, values, strict=True):
            peak[name] = max(peak[name], float(np.abs(value).max()) if value.size else 0.0)
    return {name: (p if p > 0 else 1.0) / 127.0 for name, p in peak.items()}


@dataclass
class GraphCost:
    """What a graph costs per inference (printed by ``export-onnx`` before any compiler sees it).

    ``constant_bytes`` initializers; ``gathered_bytes`` bytes every Gather writes (float32, or the
    graph's dtype); ``macs`` multiply-accumulates of MatMul plus the elementwise Mul/ReduceSum work;
    ``gathers`` / ``max_gather_indices`` / ``max_gather_axis`` what a Gather-limited target checks.
    """

    nodes: int
    constant_bytes: int
    gathered_bytes: int
    macs: int
    gathers: int
    max_gather_indices: int
    max_gather_axis: int
    index_runs: int
    op_histogram: dict[str, int] = field(default_factory=dict)
    transposes_3d: list[tuple[int, int]] = field(default_factory=list)
    """The last two input dims of every rank-3 Transpose, in node order (what
    ``transpose.max_product`` limits); not in :meth:`to_json`."""

    def to_json(self) -> dict[str, Any]:
        return {
            "nodes": self.nodes,
            "constant_bytes": self.constant_bytes,
            "gathered_bytes": self.gathered_bytes,
            "macs": self.macs,
            "gathers": self.gathers,
            "max_gather_indices": self.max_gather_indices,
            "max_gather_axis": self.max_gather_axis,
            "gather_index_runs": self.index_runs,
            "op_histogram": self.op_histogram,
        }


def graph_cost(model: Any) -> GraphCost:
    """:class:`GraphCost` of a static model (shapes from ONNX shape inference)."""
    import onnx
    from onnx import numpy_helper

    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    shapes: dict[str, list[int]] = {}
    for vi in list(inferred.graph.input) + list(inferred.graph.value_info) + list(inferred.graph.output):
        t = vi.type.tensor_type
        shapes[vi.name] = [int(d.dim_value) for d in t.shape.dim]
    inits = {i.name: i for i in inferred.graph.initializer}
    for name, init in inits.items():
        shapes[name] = list(init.dims)
    from .onnx_graph import _initializer_nbytes

    constant_bytes = sum(_initializer_nbytes(i) for i in inits.values())
    gathered = macs = gathers = runs = 0
    max_idx = max_axis = 0
    histogram: dict[str, int] = {}
    transposes: list[tuple[int, int]] = []
    for node in inferred.graph.node:
        histogram[node.op_type] = histogram.get(node.op_type, 0) + 1
        out = shapes.get(node.output[0], [])
        size = int(np.prod(out)) if out else 0
        if node.op_type == "Gather":
            gathers += 1
            gathered += 4 * size
            axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
            data = shapes.get(node.input[0], [])
            if data:
                max_axis = max(max_axis, int(data[axis % len(data)]))
            idx = shapes.get(node.input[1], [])
            n_idx = int(np.prod(idx)) if idx else 0
            max_idx = max(max_idx, n_idx)
            if node.input[1] in inits:
                values = numpy_helper.to_array(inits[node.input[1]]).reshape(-1).astype(np.int64)
                runs += int(1 + np.count_nonzero(np.diff(values) != 1)) if values.size else 0
        elif node.op_type == "MatMul":
            a, b = shapes.get(node.input[0], []), shapes.get(node.input[1], [])
            if a and b:
                macs += size * int(a[-1])
        elif node.op_type in ("Mul", "ReduceSum", "Add"):
            macs += size if node.op_type != "ReduceSum" else int(np.prod(shapes.get(node.input[0], [0])))
        elif node.op_type == "Transpose" and len(shapes.get(node.input[0], [])) == 3:
            transposes.append((shapes[node.input[0]][1], shapes[node.input[0]][2]))
    return GraphCost(
        nodes=len(inferred.graph.node), constant_bytes=constant_bytes, gathered_bytes=gathered, macs=macs, gathers=gathers,
        max_gather_indices=max_idx, max_gather_axis=max_axis, index_runs=runs, op_histogram=dict(sorted(histogram.items())),
        transposes_3d=transposes,
    )


__all__ = [
    "FORM_BUILDERS",
    "MAX_BUCKETS",
    "WEIGHTS",
    "GraphCost",
    "Plan",
    "WindowStats",
    "Writer",
    "build_graph",
    "calibrate_activation_scales",
    "choose_window_patch",
    "graph_cost",
    "input_shapes",
    "output_shape",
    "row_buckets",
    "window_stats",
]
