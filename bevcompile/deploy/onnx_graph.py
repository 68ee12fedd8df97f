"""Graph-level work on an exported ONNX model (pure functions on ``onnx.ModelProto``).

* :func:`scan_graph` — op histogram over the main graph, control-flow subgraphs and local
  functions; the forbidden ops :data:`FORBIDDEN_OPS`; after shape inference, every tensor whose
  shape is not fully static.
* :func:`fold_constants_keep_quantised` — fold every node whose inputs are all constants, except
  the ones that would turn int8/uint8 constants back into float32 (the dequantisation stays in
  the graph).
* :func:`attach_dequantize_linear` — the QDQ surgery of ``export-onnx --weights int8-qdq``:
  float weight constants found by value and replaced by int8 + scale + zero point and a
  ``DequantizeLinear`` whose output keeps the constant's name.

Used by :mod:`bevcompile.deploy.onnx_export`; needs the ``[onnx]`` extra.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._version import TORCH_REQUIREMENT
from ..errors import DependencyError

EXTRA_HINT = f"pip install 'bevcompile[onnx]' ({TORCH_REQUIREMENT}, onnx, onnxruntime, onnxscript)"

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
    "QuantizeLinear",
    "Slice",
    "Equal",
    "Sub",
    "Where",
)
"""Ops the bevcompile modules are written to produce (others are reported, not refused)."""

def _require_onnx() -> tuple[Any, Any]:
    try:
        import onnx
        import onnxruntime
    except ImportError as exc:
        raise DependencyError(f"export-onnx needs onnx and onnxruntime ({exc.name} is missing): {EXTRA_HINT}") from None
    return onnx, onnxruntime



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
    quantised = {TensorProto.INT8, TensorProto.UINT8, TensorProto.FLOAT16}
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
            if values[name].dtype in (np.int8, np.uint8, np.float16):
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
        from ..matrix.layout import dequantize_rows_int8

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
