"""``bevcompile export-onnx``: a static ONNX graph of a store's view transform, proven.

:func:`export_onnx` builds :class:`bevcompile.torch.GridGather` (``product="gather"``) or
:class:`bevcompile.torch.MatrixLift` (``"ell"`` / ``"tiles"``) from a store, exports it with
static shapes (batch ``N`` and channels ``C`` fixed at export), then

1. scans the graph — every node, including subgraphs of control-flow attributes and local
   functions — for the forbidden ops :data:`FORBIDDEN_OPS` and, after ONNX shape inference,
   for any tensor whose shape is not fully static (a symbolic or unknown dimension);
2. runs the file with onnxruntime (CPU) on seeded random inputs and compares it with the
   numpy reference (``max |ort - ref| <= 1e-5`` in float32): for ``gather`` the numpy
   ``grid_sample`` (:func:`bevcompile.reference.grid_sample`, PyTorch semantics) on
   ``grid/norm`` per camera, summed/averaged over valid cameras — independent of the gather
   tables; for ``ell``/``tiles`` the ``matrix/`` group's COO form, ``W @ X``, in float64.

Quantised weights (``weights="lut"`` for ``gather``, ``"int8"`` for ``ell``/``tiles``): the
graph carries the small constants (uint8 LUT codes + the float32 LUT; int8 matrix values +
float32 row scales) and dequantises them itself (:mod:`bevcompile.torch`). The exporter then
runs with constant folding OFF (legacy: ``do_constant_folding=False``; dynamo:
``optimize=False``) — folding would evaluate the dequantisation at export time and store the
float32 weights again. The pass/fail check compares onnxruntime with a numpy reference that
uses the SAME dequantised weights (:func:`reference_gather_lut`, :func:`reference_matrix_lift_int8`;
``max abs <= 1e-5``); the distance to the float reference above is measured and reported
(max abs, mean abs, PSNR with peak = the float reference's range), never a failure; and the
float32 graph is exported too (to a temporary file) so the result can report both files'
initializer bytes.

``weights="int8-qdq"`` (``ell``/``tiles``): the same int8 values and row scales in the standard
QDQ form that NPU/GPU toolchains recognise: every weight matrix is an int8 initializer feeding
``DequantizeLinear(x, x_scale, x_zero_point=0, axis)`` with a per-row float32 scale (opset >= 13).
The float graph of ``MatrixLift(weights="float32")`` is exported with the exporter's folding ON,
but with the weight buffers replaced by their dequantised values ``float32(q) * scale[:, None]``
(what DequantizeLinear computes); :func:`attach_dequantize_linear` then finds those float
constants by value and replaces each by the int8 + scale + zero-point initializers and a
DequantizeLinear node whose output keeps the constant's name. Checks as for ``int8``, with one
session setting: onnxruntime (1.32, CPU) fuses ``DequantizeLinear -> MatMul`` (the ``tiles``
blocks) into ``com.microsoft.MatMulNBits`` and by default computes it with int8-quantised
ACTIVATIONS (accuracy level 4), which is not what the graph says. The pass/fail check runs with
:data:`ORT_QDQ_ACCURACY_KEY` = :data:`ORT_QDQ_CHECK_ACCURACY` (float activations); a second run
with default session options is reported (:class:`DefaultSessionReport`), never a failure.

Any failure raises :class:`~bevcompile.errors.CheckFailed`; the rejected graph is kept next
to the requested path as ``<stem>.rejected.onnx`` for debugging and nothing is written at
``out``. Missing torch/onnx/onnxruntime raises :class:`~bevcompile.errors.DependencyError`
naming the ``[onnx]`` extra.
"""

from __future__ import annotations

import os
import time
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from ._version import __version__
from .errors import CheckFailed, DependencyError, StoreError, UsageError
from .loader import LoadedStore, MatrixLayout, load, matrix_layout
from .reference import random_depth_probs

FORBIDDEN_OPS = ("GridSample", "ScatterND", "ScatterElements", "OneHot", "NonZero", "Loop", "If")
EXPECTED_OPS = (
    "Gather",
    "Mul",
    "Add",
    "ReduceSum",
    "MatMul",
    "Reshape",
    "Transpose",
    "Expand",
    "Unsqueeze",
    "Squeeze",
    "Concat",
    "Constant",
    "Identity",
    "Cast",
    "DequantizeLinear",
)
"""Ops the bevcompile modules are written to produce (others are reported, not refused)."""
PRODUCTS = ("gather", "ell", "tiles")
WEIGHTS = ("float32", "lut", "int8", "int8-qdq")
"""``--weights``: the float32 tables, the gather LUT codes (``gather`` only) or the int8 matrix
(``ell``/``tiles``), dequantised with Cast + Mul (``int8``) or by QDQ ``DequantizeLinear`` (``int8-qdq``)."""
PRODUCT_WEIGHTS = {
    "gather": ("float32", "lut"),
    "ell": ("float32", "int8", "int8-qdq"),
    "tiles": ("float32", "int8", "int8-qdq"),
}
QDQ_MIN_OPSET = 13
"""First opset whose DequantizeLinear takes a per-axis (per-row) scale."""
ORT_QDQ_ACCURACY_KEY = "session.qdq_matmulnbits_accuracy_level"
"""onnxruntime session config: compute accuracy of the ``com.microsoft.MatMulNBits`` its
optimiser fuses ``DequantizeLinear -> MatMul`` into (default 4: int8-quantised activations)."""
ORT_QDQ_CHECK_ACCURACY = "1"
"""Accuracy level of the ``int8-qdq`` check session: 1 = float32 activations, the graph's
own semantics (the default session's figures are reported separately)."""
EXPORTERS = ("legacy", "dynamo")
DEFAULT_OPSET = 17
MAX_ABS_TOLERANCE = 1e-5
EXTRA_HINT = "pip install 'bevcompile[onnx]' (torch==2.13.0, onnx, onnxruntime, onnxscript)"


def _require_onnx() -> tuple[Any, Any]:
    try:
        import onnx
        import onnxruntime
    except ImportError as exc:
        raise DependencyError(f"export-onnx needs onnx and onnxruntime ({exc.name} is missing): {EXTRA_HINT}") from None
    return onnx, onnxruntime


def _require_torch() -> Any:
    try:
        import torch
    except ImportError:
        raise DependencyError(f"export-onnx needs PyTorch: {EXTRA_HINT}") from None
    return torch


# --------------------------------------------------------------------------------------
# graph scan
# --------------------------------------------------------------------------------------


@dataclass
class GraphScan:
    """What :func:`scan_graph` found.

    ``op_histogram``: op type -> node count over the main graph, subgraphs and functions
    (sorted by count, then name); ``forbidden``: ``"Op at <where>"`` entries; ``dynamic``:
    tensors whose inferred shape is not fully static; ``unexpected``: op types outside
    :data:`EXPECTED_OPS`.
    """

    op_histogram: dict[str, int]
    forbidden: list[str]
    dynamic: list[str]
    unexpected: list[str]
    n_nodes: int
    n_initializers: int
    initializer_bytes: int
    opset: int
    n_subgraphs: int
    constant_node_bytes: int = 0

    @property
    def passed(self) -> bool:
        return not self.forbidden and not self.dynamic

    @property
    def constant_bytes(self) -> int:
        """Bytes of every constant tensor of the main graph: initializers + Constant-node values
        (the legacy exporter stores the per-tile blocks of ``tiles`` as Constant nodes)."""
        return self.initializer_bytes + self.constant_node_bytes

    def to_json(self) -> dict[str, Any]:
        return {
            "op_histogram": self.op_histogram,
            "forbidden": self.forbidden,
            "dynamic": self.dynamic,
            "unexpected": self.unexpected,
            "n_nodes": self.n_nodes,
            "n_initializers": self.n_initializers,
            "initializer_bytes": self.initializer_bytes,
            "constant_node_bytes": self.constant_node_bytes,
            "constant_bytes": self.constant_bytes,
            "opset": self.opset,
            "n_subgraphs": self.n_subgraphs,
        }


def _walk_nodes(graph: Any, where: str, out: list[tuple[Any, str]], subgraphs: list[Any]) -> None:
    """Every node of ``graph`` and of graphs nested in node attributes (If/Loop/Scan bodies)."""
    for node in graph.node:
        out.append((node, where))
        for attr in node.attribute:
            nested = []
            if attr.HasField("g"):
                nested.append(attr.g)
            nested.extend(attr.graphs)
            for sub in nested:
                subgraphs.append(sub)
                _walk_nodes(sub, f"{where}/{node.op_type}:{node.name or '?'}.{attr.name}", out, subgraphs)


def _dims(value_info: Any) -> list[Any] | None:
    """Dims of a tensor value (int, or the symbolic name / '?' for non-static); None if no shape."""
    t = value_info.type
    if not t.HasField("tensor_type") or not t.tensor_type.HasField("shape"):
        return None
    dims: list[Any] = []
    for d in t.tensor_type.shape.dim:
        if d.HasField("dim_value") and d.dim_value > 0:
            dims.append(int(d.dim_value))
        elif d.HasField("dim_value") and d.dim_value == 0:
            dims.append(0)
        else:
            dims.append(d.dim_param or "?")
    return dims


def scan_graph(model: Any) -> GraphScan:
    """Forbidden ops (main graph, nested graphs, local functions) and non-static shapes.

    Shapes come from ``onnx.shape_inference.infer_shapes(strict_mode=True, data_prop=True)``:
    every graph input/output and every intermediate value of the main graph must have a fully
    static shape (all dims known integers); a value inference cannot shape counts as dynamic.
    """
    onnx, _ = _require_onnx()
    nodes: list[tuple[Any, str]] = []
    subgraphs: list[Any] = []
    _walk_nodes(model.graph, "graph", nodes, subgraphs)
    for function in model.functions:
        _walk_nodes(function, f"function {function.domain}:{function.name}", nodes, subgraphs)
    counts = Counter(node.op_type for node, _ in nodes)
    histogram = dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))
    forbidden = [f"{node.op_type} at {where} (node {node.name or '?'})" for node, where in nodes if node.op_type in FORBIDDEN_OPS]
    unexpected = sorted(op for op in counts if op not in EXPECTED_OPS and op not in FORBIDDEN_OPS)
    dynamic: list[str] = []
    try:
        inferred = onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True, data_prop=True)
    except Exception as exc:
        dynamic.append(f"shape inference failed: {str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__}")
        inferred = model
    graph = inferred.graph
    shaped: dict[str, list[Any] | None] = {}
    for vi in list(graph.input) + list(graph.value_info) + list(graph.output):
        shaped[vi.name] = _dims(vi)
    initializers = {init.name for init in graph.initializer}
    produced = [out for node in graph.node for out in node.output if out]
    names = [vi.name for vi in graph.input if vi.name not in initializers] + produced + [vi.name for vi in graph.output]
    for name in dict.fromkeys(names):
        dims = shaped.get(name)
        if dims is None:
            if name in initializers:
                continue
            dynamic.append(f"{name}: no inferred shape")
        elif any(not isinstance(d, int) for d in dims):
            dynamic.append(f"{name}: shape {dims}")
    opset = next((int(o.version) for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    init_bytes = sum(_initializer_nbytes(init) for init in model.graph.initializer)
    constant_node_bytes = sum(
        _initializer_nbytes(attr.t) for node in model.graph.node if node.op_type == "Constant" for attr in node.attribute if attr.HasField("t")
    )
    return GraphScan(
        op_histogram=histogram,
        forbidden=forbidden,
        dynamic=dynamic,
        unexpected=unexpected,
        n_nodes=len(nodes),
        n_initializers=len(model.graph.initializer),
        initializer_bytes=init_bytes,
        opset=opset,
        n_subgraphs=len(subgraphs),
        constant_node_bytes=constant_node_bytes,
    )


LAYOUT_OPS = ("Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten", "Identity")
"""Ops that only move data: folding them keeps a quantised constant quantised."""
FOLD_GROWTH_LIMIT = 1024
"""Bytes a folded result may exceed its inputs by (shape arithmetic); larger growth stays a node."""


def fold_constants_keep_quantised(model: Any) -> int:
    """Constant folding of the main graph that leaves quantised weights quantised (in place).

    Used for ``--weights lut|int8``, exported with the exporter's own folding off (that would
    evaluate the in-graph dequantisation and store float32 weights again). A node is folded
    (evaluated with :mod:`onnx.reference` under the model's opsets and replaced by an
    initializer) when every input is a constant (an initializer or a folded value) and either
    none is TAINTED or the node only moves data (:data:`LAYOUT_OPS`: its result keeps the
    int8/uint8 dtype and byte count). The int8/uint8 constants are tainted, and so is every
    output of a node that reads a tainted value. A fold that would GROW the constants (a result
    larger than its inputs and than :data:`FOLD_GROWTH_LIMIT` bytes, e.g. the dynamo exporter's
    Cast of int32 indices to int64) is not done either. So shape arithmetic, reshapes of the
    index tables and transposes of int8 blocks fold away, while the Cast/Gather/Mul
    dequantisation stays in the graph. Constant nodes become initializers; unused initializers
    are dropped; a table that only went through layout ops keeps its buffer's name (e.g.
    ``weight_u8``, ``ell_index``). Returns the number of non-Constant nodes folded.
    """
    from onnx import TensorProto, helper, numpy_helper
    from onnx.reference import ReferenceEvaluator

    graph = model.graph
    quantised = {TensorProto.INT8, TensorProto.UINT8}
    originals = {init.name: init for init in graph.initializer}
    values: dict[str, np.ndarray] = {init.name: numpy_helper.to_array(init) for init in graph.initializer}
    tainted = {init.name for init in graph.initializer if init.data_type in quantised}
    uses = Counter(name for node in graph.node for name in node.input if name)
    origin: dict[str, str] = {}  # folded value -> the single-use initializer it is a re-layout of
    kept: list[Any] = []
    n_folded = 0
    for node in graph.node:
        names = list(node.input)
        reads_tainted = any(name in tainted for name in names)
        foldable = node.domain in ("", "ai.onnx") and all(name and name in values for name in names)
        if not foldable or (reads_tainted and node.op_type not in LAYOUT_OPS):
            if reads_tainted:
                tainted.update(node.output)
            kept.append(node)
            continue
        try:
            function = helper.make_function("bevcompile.fold", "node", names, list(node.output), [node], list(model.opset_import))
            results = ReferenceEvaluator(function).run(None, {name: values[name] for name in names}, attributes={})
        except Exception:  # an op the reference runtime cannot evaluate: leave it in the graph
            kept.append(node)
            continue
        grown = sum(np.asarray(r).nbytes for r in results)
        if node.op_type != "Constant" and grown > FOLD_GROWTH_LIMIT and grown > sum(values[name].nbytes for name in names):
            kept.append(node)
            continue
        for name, result in zip(node.output, results, strict=True):
            values[name] = np.asarray(result)
            if values[name].dtype in (np.int8, np.uint8):
                tainted.add(name)
        source = names[0] if names else ""
        if node.op_type in LAYOUT_OPS and len(node.output) == 1 and uses[source] == 1 and (source in originals or source in origin):
            origin[node.output[0]] = origin.get(source, source)
        n_folded += node.op_type != "Constant"
    needed = dict.fromkeys(name for node in kept for name in node.input if name)
    needed.update(dict.fromkeys(out.name for out in graph.output))
    initializers = []
    rename: dict[str, str] = {}
    for name in needed:
        if name in originals:
            initializers.append(originals[name])
        elif name in values:
            label = origin.get(name, name)
            if label != name and (label in needed or label in rename.values()):
                label = name
            rename[name] = label
            initializers.append(numpy_helper.from_array(values[name], label))
    for node in kept:
        for i, name in enumerate(node.input):
            if rename.get(name, name) != name:
                node.input[i] = rename[name]
    del graph.initializer[:]
    graph.initializer.extend(initializers)
    del graph.node[:]
    graph.node.extend(kept)
    # value_info of folded/renamed values is stale (an initializer carries its own shape)
    present = {out for node in kept for out in node.output}
    stale = [vi for vi in graph.value_info if vi.name not in present]
    for vi in stale:
        graph.value_info.remove(vi)
    return n_folded


@dataclass(frozen=True)
class QdqWeight:
    """One weight matrix of an ``int8-qdq`` export.

    Convention:
        ``name``: the :class:`~bevcompile.torch.MatrixLift` buffer it stands for (``ell_weight``,
        ``tile{t}_block``; it names the new initializers); ``q`` int8 ``(rows, n)``; ``scale``
        float32 ``(rows,)``, one per matrix row. :attr:`dequantised` is
        ``float32(q) * scale[:, None]`` float32 ``(rows, n)``, one float32 rounding per entry:
        bit for bit what ``DequantizeLinear(q, scale, 0)`` computes along the row axis.
    """

    name: str
    q: np.ndarray
    scale: np.ndarray

    @property
    def dequantised(self) -> np.ndarray:
        from .matrix_layout import dequantize_rows_int8

        return dequantize_rows_int8(self.q, self.scale)


@dataclass(frozen=True)
class QdqNode:
    """One DequantizeLinear :func:`attach_dequantize_linear` put in the graph.

    ``replaced``: the float32 constant (initializer or Constant-node output) it replaces; its
    name is kept as the output of the DequantizeLinear (``reshaped`` False) or of a Reshape after
    it (``reshaped`` True: the exporter had flattened the matrix). ``axis``: 0 when the graph
    reads the matrix row-major (``ell``: int8 ``(rows, k)``), 1 when it reads it transposed
    (``tiles``: the MatMul's ``(n_cols, R)`` right operand, the output rows along axis 1 — the
    per-channel axis ONNX Runtime's quantiser uses for a MatMul weight). Either way the scale
    has one entry per matrix row.
    """

    weight: str
    replaced: str
    quantized: str
    shape: tuple[int, ...]
    axis: int
    reshaped: bool

    def to_json(self) -> dict[str, Any]:
        return {
            "weight": self.weight,
            "replaced": self.replaced,
            "quantized": self.quantized,
            "shape": list(self.shape),
            "axis": self.axis,
            "reshaped": self.reshaped,
        }


@dataclass
class QdqReport:
    """What :func:`attach_dequantize_linear` did: the nodes added, the weights it could not find."""

    nodes: list[QdqNode]
    missing: list[str]

    @property
    def axes(self) -> dict[int, int]:
        """axis -> number of DequantizeLinear nodes with it."""
        return dict(sorted(Counter(node.axis for node in self.nodes).items()))

    def to_json(self) -> dict[str, Any]:
        return {
            "n_dequantize_linear": len(self.nodes),
            "axes": {str(axis): count for axis, count in self.axes.items()},
            "n_reshaped": sum(node.reshaped for node in self.nodes),
            "missing": self.missing,
            "nodes": [node.to_json() for node in self.nodes],
        }


def attach_dequantize_linear(model: Any, weights: list[QdqWeight]) -> QdqReport:
    """Turn a float graph's weight constants into int8 QDQ form (in place).

    ``model`` is the float graph of a module whose weight buffers hold ``w.dequantised`` for
    every ``w`` in ``weights``. Every float32 constant of the main graph — initializer or
    Constant node, as either exporter left it after folding — whose values equal a weight's
    (row-major in any shape: ``ell``'s ``(1, rows*k)``; or transposed: ``tiles``'
    ``(n_cols, R)`` MatMul operand) is replaced by

    * ``<w.name>_quantized`` int8 (the matrix as the graph reads it: ``(rows, n)`` or ``(n, rows)``),
    * ``<w.name>_scale`` float32 ``(rows,)`` and ``<w.name>_zero_point`` int8 zeros ``(rows,)``,
    * ``DequantizeLinear(axis=0 or 1, the row axis)`` whose output takes the constant's name
      (through a ``Reshape`` to the constant's shape when it was flattened), inserted where the
      constant was (Constant node) or before its first reader (initializer),

    so the rest of the graph is untouched and the float values are not left in the file.
    Values, not names, identify the weights, so this works for the legacy exporter (folded
    initializers such as ``onnx::Mul_82``, Constant nodes for the tile blocks) and for dynamo
    (``ell_weight``, ``transpose_1``). A weight found nowhere is listed in ``missing``.
    """
    import hashlib

    from onnx import TensorProto, helper, numpy_helper

    graph = model.graph

    def digest(array: np.ndarray) -> bytes:
        return hashlib.blake2b(np.ascontiguousarray(array).tobytes(), digest_size=16).digest()

    dequantised = [w.dequantised for w in weights]
    by_rows: dict[bytes, list[int]] = {}
    by_cols: dict[bytes, list[int]] = {}
    for i, deq in enumerate(dequantised):
        by_rows.setdefault(digest(deq), []).append(i)
        by_cols.setdefault(digest(deq.T), []).append(i)

    def match(array: np.ndarray) -> tuple[int, int] | None:
        """(weight index, row axis) of a float32 constant equal to a dequantised weight."""
        if array.dtype != np.float32 or array.size == 0:
            return None
        key = digest(array)
        for axis, table in ((0, by_rows), (1, by_cols)):
            for i in table.get(key, []):
                deq = dequantised[i] if axis == 0 else dequantised[i].T
                if deq.size == array.size and np.array_equal(deq.ravel(), array.ravel()):
                    return i, axis
        return None

    used = {init.name for init in graph.initializer} | {vi.name for vi in graph.input} | {vi.name for vi in graph.output}
    used |= {name for node in graph.node for name in list(node.input) + list(node.output) + [node.name]}

    def unique(base: str) -> str:
        name, k = base, 0
        while name in used:
            k += 1
            name = f"{base}_{k}"
        used.add(name)
        return name

    new_initializers: list[Any] = []
    quantized_of: dict[tuple[int, int], str] = {}
    scale_of: dict[int, tuple[str, str]] = {}
    nodes: list[QdqNode] = []
    found: set[int] = set()

    def replacement(name: str, array: np.ndarray, i: int, axis: int) -> list[Any]:
        """Initializers (into ``new_initializers``) and nodes that produce ``name`` from int8."""
        w = weights[i]
        found.add(i)
        if (i, axis) not in quantized_of:
            q = w.q if axis == 0 else w.q.T
            quantized_of[i, axis] = unique(f"{w.name}_quantized")
            new_initializers.append(numpy_helper.from_array(np.ascontiguousarray(q, dtype=np.int8), quantized_of[i, axis]))
        if i not in scale_of:
            scale_of[i] = (unique(f"{w.name}_scale"), unique(f"{w.name}_zero_point"))
            new_initializers.append(numpy_helper.from_array(np.asarray(w.scale, dtype=np.float32), scale_of[i][0]))
            new_initializers.append(numpy_helper.from_array(np.zeros(w.scale.shape, dtype=np.int8), scale_of[i][1]))
        q_shape = w.q.shape if axis == 0 else w.q.T.shape
        reshaped = tuple(array.shape) != tuple(q_shape)
        out = unique(f"{w.name}_dequantized") if reshaped else name
        made = [
            helper.make_node(
                "DequantizeLinear", [quantized_of[i, axis], *scale_of[i]], [out], name=unique(f"{w.name}_DequantizeLinear"), axis=axis
            )
        ]
        if reshaped:
            shape_name = unique(f"{w.name}_shape")
            new_initializers.append(numpy_helper.from_array(np.asarray(array.shape, dtype=np.int64), shape_name))
            made.append(helper.make_node("Reshape", [out, shape_name], [name], name=unique(f"{w.name}_Reshape")))
        nodes.append(QdqNode(w.name, name, quantized_of[i, axis], tuple(int(d) for d in q_shape), axis, reshaped))
        return made

    # initializers
    pending: dict[str, list[Any]] = {}
    kept_initializers = []
    for init in graph.initializer:
        array = numpy_helper.to_array(init) if init.data_type == TensorProto.FLOAT else None
        hit = None if array is None else match(array)
        if array is None or hit is None:
            kept_initializers.append(init)
        else:
            pending[init.name] = replacement(init.name, array, *hit)
    # Constant nodes, in graph order; DequantizeLinear of an initializer goes before its first reader
    new_nodes: list[Any] = []
    for node in graph.node:
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx") and len(node.output) == 1:
            value = next((attr.t for attr in node.attribute if attr.name == "value" and attr.HasField("t")), None)
            array = numpy_helper.to_array(value) if value is not None and value.data_type == TensorProto.FLOAT else None
            hit = None if array is None else match(array)
            if array is not None and hit is not None:
                new_nodes.extend(replacement(node.output[0], array, *hit))
                continue
        for name in node.input:
            if name in pending:
                new_nodes.extend(pending.pop(name))
        new_nodes.append(node)
    leftover = [node for made in pending.values() for node in made]  # read only by a graph output or a subgraph
    replaced = {node.replaced for node in nodes}
    inputs = [vi for vi in graph.input if vi.name not in replaced]
    del graph.input[:]
    graph.input.extend(inputs)
    del graph.initializer[:]
    graph.initializer.extend(kept_initializers + new_initializers)
    del graph.node[:]
    graph.node.extend(leftover + new_nodes)
    missing = [f"{w.name} {'x'.join(map(str, w.q.shape))}" for i, w in enumerate(weights) if i not in found]
    return QdqReport(nodes=nodes, missing=missing)


def _initializer_nbytes(init: Any) -> int:
    from onnx import numpy_helper

    try:
        return int(numpy_helper.to_array(init).nbytes)
    except Exception:
        return len(init.raw_data)


# --------------------------------------------------------------------------------------
# modules, inputs and references
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ExportOptions:
    """Options of :func:`export_onnx`. ``reduce`` applies to ``gather`` only; ``weights`` is
    ``float32``, ``lut`` (``gather`` only), ``int8`` or ``int8-qdq`` (``ell``/``tiles`` only;
    ``int8-qdq`` needs ``opset >= 13``)."""

    product: str = "gather"
    opset: int = DEFAULT_OPSET
    channels: int = 64
    batch: int = 1
    reduce: str = "sum"
    seed: int = 0
    exporter: str = "legacy"
    tolerance: float = MAX_ABS_TOLERANCE
    weights: str = "float32"

    @property
    def quantised(self) -> bool:
        return self.weights != "float32"

    @property
    def exporter_folding(self) -> bool:
        """Whether the exporter's own constant folding runs: yes for float32 and ``int8-qdq``
        (a float graph, made QDQ afterwards), no for ``lut``/``int8`` (it would evaluate the
        in-graph Cast dequantisation and store float32 weights again)."""
        return self.weights in ("float32", "int8-qdq")

    def validate(self) -> None:
        if self.product not in PRODUCTS:
            raise UsageError(f"--product must be one of {', '.join(PRODUCTS)}, got {self.product!r}")
        if self.weights not in WEIGHTS:
            raise UsageError(f"--weights must be one of {', '.join(WEIGHTS)}, got {self.weights!r}")
        if self.weights not in PRODUCT_WEIGHTS[self.product]:
            *first, last = PRODUCT_WEIGHTS[self.product]
            needs = "gather" if self.weights == "lut" else "ell or tiles"
            raise UsageError(
                f"--weights {self.weights} applies to --product {needs} only, got --product {self.product} "
                f"(use --weights {', '.join(first)} or {last})"
            )
        if not 7 <= self.opset <= 23:
            raise UsageError(f"--opset must be in [7, 23], got {self.opset}")
        if self.weights == "int8-qdq" and self.opset < QDQ_MIN_OPSET:
            raise UsageError(
                f"--weights int8-qdq needs --opset {QDQ_MIN_OPSET} or higher (DequantizeLinear with a per-row scale), "
                f"got --opset {self.opset}"
            )
        if not 1 <= self.channels <= 4096:
            raise UsageError(f"--channels must be in [1, 4096], got {self.channels}")
        if not 1 <= self.batch <= 64:
            raise UsageError(f"--batch must be in [1, 64], got {self.batch}")
        if self.reduce not in ("sum", "mean"):
            raise UsageError(f"--reduce must be sum or mean, got {self.reduce!r}")
        if self.exporter not in EXPORTERS:
            raise UsageError(f"--exporter must be one of {', '.join(EXPORTERS)}, got {self.exporter!r}")


def make_inputs(store: LoadedStore, channels: int, batch: int, seed: int, with_depth: bool) -> dict[str, np.ndarray]:
    """Seeded random model inputs.

    Convention:
        ``features`` float32 ``(N, n_cam, C, H_f, W_f)`` uniform in ``[0, 1)``; ``depth``
        (frustum mode) float32 ``(N, n_cam, D, H_f, W_f)``, softmax over ``D``.
    """
    w_f, h_f = store.feature_size
    rng = np.random.default_rng(seed)
    inputs = {"features": rng.random((batch, store.rig.n_cam, channels, h_f, w_f), dtype=np.float32)}
    if with_depth:
        inputs["depth"] = random_depth_probs(rng, (batch, store.rig.n_cam, store.rig.depth.n_bins, h_f, w_f), axis=2)
    return inputs


def reference_grid_gather(store: LoadedStore, features: np.ndarray, reduce: str) -> np.ndarray:
    """numpy ``grid_sample`` (PyTorch semantics) on ``grid/norm`` per camera, summed or
    averaged over the cameras valid at each cell (``grid/valid``).

    Convention: features ``(N, n_cam, C, H_f, W_f)``; returns float64 ``(N, C, n_heights, ny, nx)``.
    """
    from .reference import grid_sample

    grid = store["grid"]
    norm = np.asarray(grid["norm"], dtype=np.float64)
    valid = np.asarray(grid["valid"], dtype=bool)
    align = bool(grid.attrs.get("align_corners", False))
    n, n_cam, c = features.shape[:3]
    _, n_h, ny, nx, _ = norm.shape
    out = np.zeros((n, c, n_h, ny, nx), dtype=np.float64)
    for cam in range(n_cam):
        g = np.broadcast_to(norm[cam].reshape(1, n_h * ny, nx, 2), (n, n_h * ny, nx, 2))
        sampled = grid_sample(features[:, cam], g, mode="bilinear", padding_mode="zeros", align_corners=align)
        out += sampled.reshape(n, c, n_h, ny, nx)
    if reduce == "mean":
        count = valid.sum(axis=0)
        out = np.where(count > 0, out / np.maximum(count, 1), 0.0)
    return out


def reference_gather_lut(store: LoadedStore, features: np.ndarray, reduce: str) -> np.ndarray:
    """The gather tables with the LUT weights, in float64: the reference of ``--weights lut``.

    Weights ``w(v_j, u_i) = lut[cv_j] * lut[cu_i]`` from ``gather/weight_u8`` + ``gather/lut``
    (:func:`bevcompile.gather.lut_weights`), ``out[c, row] = sum_k w[row, k] * stacked[c, index[row, k]]``
    (:func:`bevcompile.gather.gather_sample`), rows brought to cell order with
    ``gather/perm_inverse`` (or the first ``n_cells`` rows), summed over the cameras, and for
    ``reduce="mean"`` divided by the number of valid cameras (``grid/valid``).

    Convention: features ``(N, n_cam, C, H_f, W_f)``; returns float64 ``(N, C, n_heights, ny, nx)``.
    """
    from .gather import gather_sample, lut_weights

    group = store["gather"]
    index = np.asarray(group["index"]).reshape(-1, 4)
    weight = lut_weights(np.asarray(group["weight_u8"]), np.asarray(group["lut"])).reshape(-1, 4)
    n, n_cam, c = features.shape[:3]
    n_h, ny, nx = store.bev_shape
    cells = n_h * ny * nx
    if "perm_inverse" in group:
        row_of_cell = np.asarray(group["perm_inverse"], dtype=np.int64)
    else:
        row_of_cell = np.arange(n_cam * cells, dtype=np.int64)
    out = np.zeros((n, c, n_h, ny, nx), dtype=np.float64)
    for b in range(n):
        per_row = gather_sample(features[b], index, weight)  # (C, rows)
        out[b] = per_row[:, row_of_cell].reshape(c, n_cam, n_h, ny, nx).sum(axis=1)
    if reduce == "mean":
        count = np.asarray(store["grid"]["valid"], dtype=bool).sum(axis=0)
        out = np.where(count > 0, out / np.maximum(count, 1), 0.0)
    return out


def reference_matrix_lift(store: LoadedStore, features: np.ndarray, depth: np.ndarray | None) -> np.ndarray:
    """``W @ X`` with the ``matrix/`` group's COO form, in float64 (scipy.sparse).

    Convention: features ``(N, n_cam, C, H_f, W_f)``; depth ``(N, n_cam, D, H_f, W_f)`` in
    frustum mode; returns float64 ``(N, C, ny, nx)`` (rows scattered to their BEV cells via
    ``row_ids`` when rows are compacted; cells without a row are 0).
    """
    import scipy.sparse as sp

    layout = matrix_layout(store)
    group = store["matrix"]
    rows = np.asarray(group["coo_row"], dtype=np.int64)
    cols = np.asarray(group["coo_col"], dtype=np.int64)
    vals = np.asarray(group["coo_val"], dtype=np.float64)
    w_mat = sp.csr_matrix((vals, (rows, cols)), shape=(layout.n_rows, layout.n_cols))
    return _apply_matrix(store, layout, w_mat, features, depth)


def reference_matrix_lift_int8(store: LoadedStore, features: np.ndarray, depth: np.ndarray | None, form: str) -> np.ndarray:
    """``W_dequant @ X`` in float64: the reference of ``--weights int8``.

    ``W_dequant`` is the stored decode ``float32(q) * row_scale[r]``
    (:func:`bevcompile.matrix_layout.dequantize_rows_int8`) of ``ell_weight_int8``/``row_scale``
    (``form="ell"``) or of ``tile_weight_int8``/``tile_row_scale`` (``form="tiles"``), rows
    ``>= n_rows`` dropped. Convention as :func:`reference_matrix_lift`.
    """
    import scipy.sparse as sp

    from .matrix_layout import dequantize_rows_int8, tile_blocks

    layout = matrix_layout(store)
    group = store["matrix"]
    if form == "ell":
        index = np.asarray(group["ell_index"], dtype=np.int64)
        values = dequantize_rows_int8(np.asarray(group["ell_weight_int8"]), np.asarray(group["row_scale"]))
        rows = np.repeat(np.arange(index.shape[0], dtype=np.int64), index.shape[1])
        cols, vals = index.ravel(), values.ravel()
    else:
        r = layout.tile_rows
        if r is None:
            raise StoreError(f"{store.path}: matrix/ has no tiles; rebuild it with `bevcompile matrix --tile-rows R`")
        offsets = np.asarray(group["tile_col_offsets"], dtype=np.int64)
        tile_cols = np.asarray(group["tile_cols"], dtype=np.int64)
        scale = np.asarray(group["tile_row_scale"])
        parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        for t, block in enumerate(tile_blocks(np.asarray(group["tile_weight_int8"]), offsets, r)):
            deq = dequantize_rows_int8(block, scale[t * r : (t + 1) * r])
            i, j = np.nonzero(deq)
            parts.append((t * r + i, tile_cols[offsets[t] + j], deq[i, j]))
        rows = np.concatenate([p[0] for p in parts]) if parts else np.zeros(0, np.int64)
        cols = np.concatenate([p[1] for p in parts]) if parts else np.zeros(0, np.int64)
        vals = np.concatenate([p[2] for p in parts]) if parts else np.zeros(0, np.float32)
    keep = rows < layout.n_rows
    w_mat = sp.csr_matrix(
        (vals[keep].astype(np.float64), (rows[keep], cols[keep])), shape=(layout.n_rows, layout.n_cols)
    )
    return _apply_matrix(store, layout, w_mat, features, depth)


def _apply_matrix(store: LoadedStore, layout: MatrixLayout, w_mat: Any, features: np.ndarray, depth: np.ndarray | None) -> np.ndarray:
    """``w_mat @ X`` per batch item, rows scattered to their BEV cells (float64 ``(N, C, ny, nx)``)."""
    n, _n_cam, c, _h_f, _w_f = features.shape
    _, ny, nx = store.bev_shape
    out = np.zeros((n, c, ny * nx), dtype=np.float64)
    for b in range(n):
        feats = np.asarray(features[b], dtype=np.float64)  # (n_cam, C, H, W)
        if layout.mode == "frustum":
            if depth is None:
                raise UsageError("frustum-mode matrix needs depth probabilities")
            d = np.asarray(depth[b], dtype=np.float64)  # (n_cam, D, H, W)
            x = d[:, :, None] * feats[:, None]  # (n_cam, D, C, H, W)
            x = np.moveaxis(x, 2, -1).reshape(-1, c)  # rows (cam, d, v, u)
        else:
            x = np.moveaxis(feats, 1, -1).reshape(-1, c)  # rows (cam, v, u)
        y = np.asarray(w_mat @ x)  # (n_rows, C)
        out[b][:, layout.row_cells] = y.T
    return out.reshape(n, c, ny, nx)


# --------------------------------------------------------------------------------------
# export
# --------------------------------------------------------------------------------------


@dataclass
class ExportResult:
    """Everything :func:`export_onnx` measured (``--json`` prints :meth:`to_json`)."""

    path: Path
    product: str
    exporter: str
    inputs: dict[str, list[int]]
    output: list[int]
    scan: GraphScan
    max_abs: float
    mean_abs: float
    torch_max_abs: float
    tolerance: float
    file_bytes: int
    export_seconds: float
    ort_seconds: float
    module: str
    notes: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    weights: str = "float32"
    float_reference: QuantisationReport | None = None
    float32_export: Float32Export | None = None
    qdq: QdqReport | None = None
    ort_default: DefaultSessionReport | None = None

    @property
    def passed(self) -> bool:
        return not self.failures

    @property
    def constant_ratio_vs_float32(self) -> float | None:
        """Constant bytes (initializers + Constant nodes) of this graph / of the float32 export."""
        if self.float32_export is None or self.float32_export.constant_bytes <= 0:
            return None
        return self.scan.constant_bytes / self.float32_export.constant_bytes

    @property
    def file_ratio_vs_float32(self) -> float | None:
        """File bytes of this graph / of the float32 export (quantised weights only)."""
        if self.float32_export is None or self.float32_export.file_bytes <= 0:
            return None
        return self.file_bytes / self.float32_export.file_bytes

    def to_json(self) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "product": self.product,
            "exporter": self.exporter,
            "module": self.module,
            "inputs": self.inputs,
            "output": self.output,
            "graph": self.scan.to_json(),
            "max_abs_vs_reference": self.max_abs,
            "mean_abs_vs_reference": self.mean_abs,
            "torch_max_abs_vs_reference": self.torch_max_abs,
            "tolerance": self.tolerance,
            "file_bytes": self.file_bytes,
            "export_seconds": round(self.export_seconds, 3),
            "onnxruntime_seconds": round(self.ort_seconds, 3),
            "passed": self.passed,
            "failures": self.failures,
            "notes": self.notes,
            "weights": self.weights,
            "float_reference": None if self.float_reference is None else self.float_reference.to_json(),
            "float32_export": None if self.float32_export is None else self.float32_export.to_json(),
            "constant_bytes_vs_float32": _finite(self.constant_ratio_vs_float32),
            "file_bytes_vs_float32": _finite(self.file_ratio_vs_float32),
            "qdq": None if self.qdq is None else self.qdq.to_json(),
            "onnxruntime_default": None if self.ort_default is None else self.ort_default.to_json(),
        }


@dataclass(frozen=True)
class QuantisationReport:
    """What quantised weights cost: onnxruntime output vs the FLOAT reference (reported, never a failure).

    ``peak`` is the float reference's value range ``max - min`` (PSNR ``10 log10(peak^2 / MSE)``).
    """

    reference: str
    max_abs: float
    mean_abs: float
    psnr_db: float
    peak: float

    def to_json(self) -> dict[str, Any]:
        return {
            "reference": self.reference,
            "max_abs": _finite(self.max_abs),
            "mean_abs": _finite(self.mean_abs),
            "psnr_db": _finite(self.psnr_db),
            "peak": _finite(self.peak),
        }


@dataclass(frozen=True)
class DefaultSessionReport:
    """``int8-qdq`` run by onnxruntime with DEFAULT session options (reported, never a failure).

    The check session keeps float activations (:data:`ORT_QDQ_ACCURACY_KEY`); a default session
    lets onnxruntime's ``DequantizeLinear -> MatMul`` fusion quantise the activations too. These
    are the figures a deployment engineer gets from ``ort.InferenceSession(path)`` as is.
    """

    max_abs_vs_reference: float
    float_reference: QuantisationReport

    def to_json(self) -> dict[str, Any]:
        return {
            "max_abs_vs_reference": _finite(self.max_abs_vs_reference),
            "float_reference": self.float_reference.to_json(),
        }


@dataclass(frozen=True)
class Float32Export:
    """Size of the same product exported with float32 weights (the baseline of the size comparison)."""

    file_bytes: int
    initializer_bytes: int
    constant_node_bytes: int
    n_initializers: int

    @property
    def constant_bytes(self) -> int:
        return self.initializer_bytes + self.constant_node_bytes

    def to_json(self) -> dict[str, Any]:
        return {
            "file_bytes": self.file_bytes,
            "initializer_bytes": self.initializer_bytes,
            "constant_node_bytes": self.constant_node_bytes,
            "constant_bytes": self.constant_bytes,
            "n_initializers": self.n_initializers,
        }


def _finite(value: float | None) -> float | None:
    """JSON-safe number: None for None, inf and nan (``--json`` refuses non-finite floats)."""
    return None if value is None or not np.isfinite(value) else float(value)


def export_stages(options: ExportOptions) -> int:
    """Number of ``progress(1)`` calls :func:`export_onnx` makes (4; 5 with quantised weights)."""
    return 5 if options.quantised else 4


def build_module(store: LoadedStore, options: ExportOptions) -> tuple[Any, bool]:
    """``(module, needs_depth)`` for a product and its ``weights``.

    ``int8-qdq``: the FLOAT ``MatrixLift`` with its weight buffers overwritten by the dequantised
    int8 weights (:func:`qdq_module`); the module carries them as ``qdq_weights``.
    """
    from . import torch as bt

    if options.weights == "int8-qdq":
        module = qdq_module(store, options.product)
        return module, module.mode == "frustum"
    if options.product == "gather":
        if options.weights == "float32":
            return bt.GridGather(store, reduce=options.reduce), False
        return bt.GridGather(store, reduce=options.reduce, weights=options.weights), False
    if options.weights == "float32":
        module = bt.MatrixLift(store, form=options.product)
    else:
        module = bt.MatrixLift(store, form=options.product, weights=options.weights)
    return module, module.mode == "frustum"


def qdq_weights(module: Any) -> list[QdqWeight]:
    """The int8 weight matrices of a ``MatrixLift(weights="int8")`` with their row scales.

    Convention: ``ell``: one ``ell_weight`` ``(rows_pad, k_pad)`` with ``row_scale``; ``tiles``:
    ``tile{t}_block`` ``(R, n_cols_t)`` per tile with ``tile_row_scale[t*R:(t+1)*R]``. The names
    are the float module's buffers the values replace.
    """
    if module.form == "ell":
        return [QdqWeight("ell_weight", module.ell_weight_int8.numpy().copy(), module.row_scale.numpy().copy())]
    r = module.tile_rows
    scale = module.tile_row_scale.numpy()
    return [
        QdqWeight(f"tile{t}_block", getattr(module, f"tile{t}_block").numpy().copy(), scale[t * r : (t + 1) * r].copy())
        for t in range(len(module.tiles))
    ]


def qdq_module(store: LoadedStore, form: str) -> Any:
    """``MatrixLift(form=form)`` (float32) whose weights are the store's dequantised int8 weights.

    The int8 values and row scales are read (and checked) through ``MatrixLift(weights="int8")``;
    every float weight buffer (``ell_weight``, or each ``tile{t}_block`` view of ``tile_weight``)
    is overwritten with ``float32(q) * scale[:, None]``. Its forward is then the float graph with
    exactly the values ``DequantizeLinear`` produces; ``module.qdq_weights`` lists them
    (:class:`QdqWeight`) for :func:`attach_dequantize_linear`.
    """
    from . import torch as bt

    torch = _require_torch()
    weights = qdq_weights(bt.MatrixLift(store, form=form, weights="int8"))
    module: Any = bt.MatrixLift(store, form=form)  # Any: it gains the plain attribute qdq_weights
    with torch.no_grad():
        for w in weights:
            buffer = getattr(module, w.name)
            if tuple(buffer.shape) != w.q.shape:
                raise StoreError(
                    f"{store.path}: matrix/ float weights {w.name} {tuple(buffer.shape)} and the int8 values {w.q.shape} differ in shape"
                )
            buffer.copy_(torch.from_numpy(w.dequantised))
    module.qdq_weights = weights
    return module


def _torch_export(module: Any, args: tuple[Any, ...], path: Path, options: ExportOptions, names: list[str]) -> str:
    """Export with the chosen exporter; returns the exporter actually used.

    Constant folding is on for float32 weights (and ``int8-qdq``: a float graph made QDQ
    afterwards) and OFF for ``lut``/``int8``: folding would evaluate the in-graph dequantisation
    (it depends on constants only) and store float32 weights again.
    """
    torch = _require_torch()
    exporter = options.exporter
    fold = options.exporter_folding
    common: dict[str, Any] = {"input_names": names, "output_names": ["bev"], "opset_version": options.opset}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if exporter == "legacy":
            try:
                torch.onnx.export(module, args, str(path), dynamo=False, do_constant_folding=fold, **common)
                return "legacy"
            except (TypeError, AttributeError, RuntimeError, NotImplementedError) as exc:
                if "dynamo" not in str(exc).lower() and "legacy" not in str(exc).lower() and "deprecat" not in str(exc).lower():
                    raise
                exporter = "dynamo"  # the TorchScript exporter is gone in this torch: fall back
        import contextlib
        import io
        import logging

        quiet_loggers = [logging.getLogger(name) for name in ("torch", "torch.onnx", "torch.export", "onnxscript")]
        levels = [logger.level for logger in quiet_loggers]
        for logger in quiet_loggers:
            logger.setLevel(logging.ERROR)
        try:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                torch.onnx.export(module, args, str(path), dynamo=True, external_data=False, optimize=fold, **common)
        finally:
            for logger, level in zip(quiet_loggers, levels, strict=True):
                logger.setLevel(level)
    return exporter


def export_onnx(
    store_path: str | Path | LoadedStore,
    out: str | Path,
    options: ExportOptions | None = None,
    *,
    progress: Callable[[int], None] | None = None,
) -> ExportResult:
    """Export, scan and check a store's view transform as ONNX (see the module docstring).

    Returns the :class:`ExportResult` when every check passes (the file is at ``out``);
    raises :class:`CheckFailed` naming every failed check otherwise (its ``result`` attribute
    holds the :class:`ExportResult` when the graph was exported). ``progress(1)`` is called
    after each of the 4 stages (module, export, scan, onnxruntime) and, with quantised
    weights, after a 5th (the float32 export the sizes are compared with;
    :func:`export_stages`).
    """
    step = progress or (lambda n: None)
    options = options or ExportOptions()
    options.validate()
    torch = _require_torch()
    onnx, ort = _require_onnx()
    store = load(store_path)
    out = Path(out)
    if out.exists() and out.is_dir():
        raise UsageError(f"--out {out} is a directory; give a file name such as {out / 'model.onnx'}")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"--out {out}: cannot create its folder ({exc.strerror or exc})") from None

    module, needs_depth = build_module(store, options)
    module.eval()
    inputs = make_inputs(store, options.channels, options.batch, options.seed, needs_depth)
    names = list(inputs)
    args = tuple(torch.from_numpy(inputs[name]) for name in names)
    with torch.no_grad():
        torch_out = module(*args).numpy()
    if options.product == "gather":
        float_reference = reference_grid_gather(store, inputs["features"], options.reduce)
    else:
        float_reference = reference_matrix_lift(store, inputs["features"], inputs.get("depth"))
    if options.weights == "lut":
        reference = reference_gather_lut(store, inputs["features"], options.reduce)
    elif options.weights in ("int8", "int8-qdq"):
        reference = reference_matrix_lift_int8(store, inputs["features"], inputs.get("depth"), options.product)
    else:
        reference = float_reference
    step(1)

    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    t0 = time.perf_counter()
    try:
        used = _torch_export(module, args, tmp, options, names)
    except Exception as exc:
        tmp.unlink(missing_ok=True)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckFailed(f"torch.onnx.export failed for product {options.product}: {type(exc).__name__}: {first}") from None
    export_seconds = time.perf_counter() - t0
    model = onnx.load(str(tmp))
    qdq: QdqReport | None = None
    if options.weights == "int8-qdq":
        qdq = attach_dequantize_linear(model, list(getattr(module, "qdq_weights", None) or []))
    elif options.quantised:
        fold_constants_keep_quantised(model)
    _add_metadata(model, store, options, used)
    onnx.save(model, str(tmp))
    step(1)
    scan = scan_graph(model)
    step(1)

    failures: list[str] = []
    if qdq is not None and (qdq.missing or not qdq.nodes):
        missing = ", ".join(qdq.missing[:3]) + (f" and {len(qdq.missing) - 3} more" if len(qdq.missing) > 3 else "")
        failures.append(
            f"int8-qdq: weight matrices not found among the exported graph's float32 constants ({missing or 'none given'}); "
            "no DequantizeLinear attached for them"
        )
    failures += [f"forbidden op {f}" for f in scan.forbidden]
    failures += [f"non-static shape {d}" for d in scan.dynamic[:10]]
    if len(scan.dynamic) > 10:
        failures.append(f"... and {len(scan.dynamic) - 10} more non-static shapes")
    t0 = time.perf_counter()
    try:
        session_options = ort.SessionOptions()
        if options.weights == "int8-qdq":
            session_options.add_session_config_entry(ORT_QDQ_ACCURACY_KEY, ORT_QDQ_CHECK_ACCURACY)
        session = ort.InferenceSession(str(tmp), session_options, providers=["CPUExecutionProvider"])
        (ort_out,) = session.run(["bev"], {name: inputs[name] for name in names})
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        failures.append(f"onnxruntime cannot run the graph: {first}")
        ort_out = np.full(torch_out.shape, np.nan, dtype=np.float32)
    ort_seconds = time.perf_counter() - t0
    step(1)
    if ort_out.shape != reference.shape:
        failures.append(f"output shape {list(ort_out.shape)} != the reference's {list(reference.shape)}")
        max_abs = mean_abs = float("inf")
    else:
        diff = np.abs(ort_out.astype(np.float64) - reference)
        max_abs = float(np.nanmax(diff)) if np.isfinite(diff).all() else float("inf")
        mean_abs = float(diff.mean()) if np.isfinite(diff).all() else float("inf")
        if not max_abs <= options.tolerance:
            same = f" ({options.weights}: same dequantised weights)" if options.quantised else ""
            failures.append(f"onnxruntime output differs from the numpy reference{same} by {max_abs:.3g} > {options.tolerance:g}")
    torch_max_abs = (
        float(np.abs(torch_out.astype(np.float64) - reference).max())
        if torch_out.shape == reference.shape and torch_out.size
        else float("inf")
    )
    quantisation: QuantisationReport | None = None
    float32_export: Float32Export | None = None
    ort_default: DefaultSessionReport | None = None
    if options.quantised:
        quantisation = _quantisation_report(ort_out, float_reference, options.product)
        if options.weights == "int8-qdq" and np.isfinite(ort_out).all():
            ort_default = _default_session_report(ort, tmp, {name: inputs[name] for name in names}, reference, float_reference, options.product)
        float32_export = _float32_export(store, args, names, out, options)
        step(1)

    result = ExportResult(
        path=out,
        product=options.product,
        exporter=used,
        inputs={name: list(inputs[name].shape) for name in names},
        output=list(torch_out.shape),
        scan=scan,
        max_abs=max_abs,
        mean_abs=mean_abs,
        torch_max_abs=torch_max_abs,
        tolerance=options.tolerance,
        file_bytes=tmp.stat().st_size,
        export_seconds=export_seconds,
        ort_seconds=ort_seconds,
        module=repr(module).splitlines()[0],
        failures=failures,
        weights=options.weights,
        float_reference=quantisation,
        float32_export=float32_export,
        qdq=qdq,
        ort_default=ort_default,
    )
    if used != options.exporter:
        result.notes.append(f"exporter {options.exporter} unavailable in this torch; used {used}")
    if scan.unexpected:
        result.notes.append(f"ops outside the expected set: {', '.join(scan.unexpected)}")
    if options.quantised and float32_export is None:
        result.notes.append("the float32 export the sizes are compared with failed; no size comparison")
    if failures:
        rejected = out.with_name(f"{out.stem}.rejected.onnx")
        os.replace(tmp, rejected)
        result.path = rejected
        error = CheckFailed(f"{out}: " + "; ".join(failures) + f" (rejected graph kept at {rejected})")
        error.result = result  # type: ignore[attr-defined]
        raise error
    os.replace(tmp, out)
    return result


def _quantisation_report(ort_out: np.ndarray, float_reference: np.ndarray, product: str) -> QuantisationReport:
    """onnxruntime output of the quantised graph vs the float reference (max abs, PSNR)."""
    from .checks_api import psnr_db

    name = "numpy grid_sample on grid/norm" if product == "gather" else "W @ X from the float32 COO"
    if ort_out.shape != float_reference.shape or not np.isfinite(ort_out).all():
        return QuantisationReport(name, float("inf"), float("inf"), float("-inf"), 0.0)
    diff = np.abs(ort_out.astype(np.float64) - float_reference)
    peak = float(float_reference.max() - float_reference.min()) if float_reference.size else 0.0
    peak = peak if peak > 0 else 1.0
    mse = float(np.mean(diff * diff)) if diff.size else 0.0
    return QuantisationReport(name, float(diff.max()) if diff.size else 0.0, float(diff.mean()) if diff.size else 0.0, psnr_db(mse, peak), peak)


def _default_session_report(
    ort: Any, path: Path, feeds: dict[str, np.ndarray], reference: np.ndarray, float_reference: np.ndarray, product: str
) -> DefaultSessionReport | None:
    """Run ``path`` with default onnxruntime session options; None if that fails."""
    try:
        (out,) = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(["bev"], feeds)
    except Exception:
        return None
    if out.shape != reference.shape:
        return None
    max_abs = float(np.abs(out.astype(np.float64) - reference).max()) if out.size else 0.0
    return DefaultSessionReport(max_abs, _quantisation_report(out, float_reference, product))


def _float32_export(store: LoadedStore, args: tuple[Any, ...], names: list[str], out: Path, options: ExportOptions) -> Float32Export | None:
    """Export the same product with float32 weights (the file ``--weights float32`` writes,
    metadata included) to a temporary file and measure it; None if that export fails (the
    size comparison is then missing, nothing else)."""
    onnx, _ = _require_onnx()
    float_options = replace(options, weights="float32")
    module, _ = build_module(store, float_options)
    module.eval()
    tmp = out.parent / f".{out.name}.float32-{os.getpid()}"
    try:
        used = _torch_export(module, args, tmp, float_options, names)
        model = onnx.load(str(tmp))
        _add_metadata(model, store, float_options, used)
        onnx.save(model, str(tmp))
        scan = scan_graph(model)
        return Float32Export(
            file_bytes=tmp.stat().st_size,
            initializer_bytes=scan.initializer_bytes,
            constant_node_bytes=scan.constant_node_bytes,
            n_initializers=scan.n_initializers,
        )
    except Exception:
        return None
    finally:
        tmp.unlink(missing_ok=True)


def _add_metadata(model: Any, store: LoadedStore, options: ExportOptions, exporter: str) -> None:
    """Record where the graph came from in the model's metadata_props."""
    w_f, h_f = store.feature_size
    n_h, ny, nx = store.bev_shape
    entries = {
        "bevcompile.version": __version__,
        "bevcompile.store_name": store.name,
        "bevcompile.config_sha256": store.config_sha256,
        "bevcompile.product": options.product,
        "bevcompile.reduce": options.reduce if options.product == "gather" else "",
        "bevcompile.weights": options.weights,
        "bevcompile.exporter": exporter,
        "bevcompile.feature_size": f"[{w_f}, {h_f}]",
        "bevcompile.bev_shape": f"[{n_h}, {ny}, {nx}]",
        "bevcompile.cameras": ",".join(store.rig.camera_names),
    }
    del model.metadata_props[:]
    for key, value in entries.items():
        prop = model.metadata_props.add()
        prop.key = key
        prop.value = value
