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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ._version import __version__
from .errors import CheckFailed, DependencyError, UsageError
from .loader import LoadedStore, load, matrix_layout
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
)
"""Ops the bevcompile modules are written to produce (others are reported, not refused)."""
PRODUCTS = ("gather", "ell", "tiles")
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

    @property
    def passed(self) -> bool:
        return not self.forbidden and not self.dynamic

    def to_json(self) -> dict[str, Any]:
        return {
            "op_histogram": self.op_histogram,
            "forbidden": self.forbidden,
            "dynamic": self.dynamic,
            "unexpected": self.unexpected,
            "n_nodes": self.n_nodes,
            "n_initializers": self.n_initializers,
            "initializer_bytes": self.initializer_bytes,
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
    )


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
    """Options of :func:`export_onnx`. ``reduce`` applies to ``gather`` only."""

    product: str = "gather"
    opset: int = DEFAULT_OPSET
    channels: int = 64
    batch: int = 1
    reduce: str = "sum"
    seed: int = 0
    exporter: str = "legacy"
    tolerance: float = MAX_ABS_TOLERANCE

    def validate(self) -> None:
        if self.product not in PRODUCTS:
            raise UsageError(f"--product must be one of {', '.join(PRODUCTS)}, got {self.product!r}")
        if not 7 <= self.opset <= 23:
            raise UsageError(f"--opset must be in [7, 23], got {self.opset}")
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

    @property
    def passed(self) -> bool:
        return not self.failures

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
        }


def build_module(store: LoadedStore, options: ExportOptions) -> tuple[Any, bool]:
    """``(module, needs_depth)`` for a product."""
    from . import torch as bt

    if options.product == "gather":
        return bt.GridGather(store, reduce=options.reduce), False
    module = bt.MatrixLift(store, form=options.product)
    return module, module.mode == "frustum"


def _torch_export(module: Any, args: tuple[Any, ...], path: Path, options: ExportOptions, names: list[str]) -> str:
    """Export with the chosen exporter; returns the exporter actually used."""
    torch = _require_torch()
    exporter = options.exporter
    common: dict[str, Any] = {"input_names": names, "output_names": ["bev"], "opset_version": options.opset}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if exporter == "legacy":
            try:
                torch.onnx.export(module, args, str(path), dynamo=False, do_constant_folding=True, **common)
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
                torch.onnx.export(module, args, str(path), dynamo=True, external_data=False, optimize=True, **common)
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
    after each of the 4 stages (module, export, scan, onnxruntime).
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
        reference = reference_grid_gather(store, inputs["features"], options.reduce)
    else:
        reference = reference_matrix_lift(store, inputs["features"], inputs.get("depth"))
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
    _add_metadata(model, store, options, used)
    onnx.save(model, str(tmp))
    step(1)
    scan = scan_graph(model)
    step(1)

    failures: list[str] = []
    failures += [f"forbidden op {f}" for f in scan.forbidden]
    failures += [f"non-static shape {d}" for d in scan.dynamic[:10]]
    if len(scan.dynamic) > 10:
        failures.append(f"... and {len(scan.dynamic) - 10} more non-static shapes")
    t0 = time.perf_counter()
    try:
        session = ort.InferenceSession(str(tmp), providers=["CPUExecutionProvider"])
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
            failures.append(f"onnxruntime output differs from the numpy reference by {max_abs:.3g} > {options.tolerance:g}")
    torch_max_abs = (
        float(np.abs(torch_out.astype(np.float64) - reference).max())
        if torch_out.shape == reference.shape and torch_out.size
        else float("inf")
    )

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
    )
    if used != options.exporter:
        result.notes.append(f"exporter {options.exporter} unavailable in this torch; used {used}")
    if scan.unexpected:
        result.notes.append(f"ops outside the expected set: {', '.join(scan.unexpected)}")
    if failures:
        rejected = out.with_name(f"{out.stem}.rejected.onnx")
        os.replace(tmp, rejected)
        result.path = rejected
        error = CheckFailed(f"{out}: " + "; ".join(failures) + f" (rejected graph kept at {rejected})")
        error.result = result  # type: ignore[attr-defined]
        raise error
    os.replace(tmp, out)
    return result


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
