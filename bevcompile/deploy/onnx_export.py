"""``bevcompile export-onnx``: a static ONNX graph of a store's view transform, proven.

:func:`export_onnx` builds :class:`bevcompile.deploy.torch.GridGather` (``product="gather"``) or
:class:`bevcompile.deploy.torch.MatrixLift` (``"ell"`` / ``"tiles"``) from a store, exports it with
static shapes (batch ``N`` and channels ``C`` fixed at export), then

1. scans the graph (:func:`bevcompile.deploy.onnx_graph.scan_graph`) — every node, including
   subgraphs of control-flow attributes and local functions — for the forbidden ops
   :data:`bevcompile.deploy.onnx_graph.FORBIDDEN_OPS` and, after ONNX shape inference,
   for any tensor whose shape is not fully static (a symbolic or unknown dimension);
2. runs the file with onnxruntime (CPU) on seeded random inputs and compares it with the
   numpy reference (``max |ort - ref| <= 1e-5`` in float32): for ``gather`` the numpy
   ``grid_sample`` (:func:`bevcompile.grid.reference.grid_sample`, PyTorch semantics) on
   ``grid/norm`` per camera, summed/averaged over valid cameras — independent of the gather
   tables; for ``ell``/``tiles`` the ``matrix/`` group's COO form, ``W @ X``, in float64.

Quantised weights (``weights="lut"`` for ``gather``, ``"int8"`` for ``ell``/``tiles``): the
graph carries the small constants (uint8 LUT codes + the float32 LUT; int8 matrix values +
float32 row scales) and dequantises them itself (:mod:`bevcompile.deploy.torch`). The exporter then
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
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from .._version import __version__
from ..errors import CheckFailed, DependencyError, StoreError, UsageError
from ..grid.gather import REDUCTIONS
from ..store.loader import LoadedStore, MatrixLayout, load, matrix_layout
from ..store.verify import random_depth_probs
from ..store.zarr_io import output_file
from .onnx_graph import (
    EXTRA_HINT,
    GraphScan,
    QdqReport,
    QdqWeight,
    _require_onnx,
    attach_dequantize_linear,
    fold_constants_keep_quantised,
    scan_graph,
)
from .targets import FORMS, LAYOUTS

PRODUCTS = ("gather", "ell", "tiles")
WEIGHTS = ("float32", "float16", "fp16", "mixed", "lut", "int8", "int8-qdq")
"""``--weights``: the float32 tables, the gather LUT codes (``gather`` only) or the int8 matrix
(``ell``/``tiles``), dequantised with Cast + Mul (``int8``) or by QDQ ``DequantizeLinear`` (``int8-qdq``)."""
PRODUCT_WEIGHTS = {
    "gather": ("float32", "lut"),
    "ell": ("float32", "int8", "int8-qdq", "fp16", "mixed"),
    "tiles": ("float32", "int8", "int8-qdq", "fp16", "mixed"),
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
CALIBRATION_SAMPLES = 8
"""Seeded feature samples the activation scales of a fully quantised graph (and a toolchain's
calibration set) are computed on, unless ``--calibration`` gives the user's own."""
DIRECT_WEIGHTS = {
    "gather": ("float32", "float16"),
    "ell": ("float32", "float16", "fp16", "mixed", "int8", "int8-qdq"),
    "tiles": ("float32", "float16", "fp16", "mixed", "int8", "int8-qdq"),
}
"""``--weights`` of the graph builder's forms: ``int8-qdq`` is the FULLY quantised graph (activations
too) where the target reads QDQ, else the float graph + calibration set its toolchain quantises."""
INT8_MIN_PSNR_DB = 40.0
"""Pass bound of a fully quantised (activation QDQ) graph: PSNR against the float reference."""
ROWS = ("dense", "compact")
"""``--rows`` (``ell``/``tiles``; ``MatrixLift(rows=...)``, :data:`bevcompile.deploy.torch.MATRIX_ROWS`):
``dense`` the ``(N, C, ny, nx)`` map (a ``bev.region`` store: one Gather of ``matrix/expand``),
``compact`` a ``bev.region`` store's ``(N, C, n_kept)`` rows in ``matrix/cells`` order (no expand Gather)."""
DEFAULT_OPSET = 17
MIN_OPSET = 9
"""Lowest opset whose graphs are static: below 9 the legacy exporter leaves the Reshape targets
as Shape/Gather/Concat chains (no constant folding), which strict shape inference cannot resolve."""
MAX_OPSET = 23
DYNAMO_MIN_OPSET = 17
"""torch 2.13's dynamo exporter writes opset 18 for a lower request (it cannot convert down)."""
MAX_ABS_TOLERANCE = 1e-5
LIFT_CHUNK_COLUMNS = 1 << 18
"""Frustum columns lifted at once by the float64 reference (``chunk x C`` float64)."""


ALLOCATION_FAILURE_MARKERS = ("can't allocate memory", "out of memory", "failed to allocate memory", "bad_alloc")
"""Texts of an allocator failure that is not a ``MemoryError``: torch's CPU allocator
(``RuntimeError: ... DefaultCPUAllocator: can't allocate memory``), CUDA, onnxruntime."""


def is_allocation_failure(exc: BaseException) -> bool:
    """True for a ``MemoryError`` or an exception whose text says an allocation failed."""
    if isinstance(exc, MemoryError):
        return True
    text = str(exc).lower()
    return any(marker in text for marker in ALLOCATION_FAILURE_MARKERS)


def _require_torch() -> Any:
    try:
        import torch
    except ImportError:
        raise DependencyError(f"export-onnx needs PyTorch: {EXTRA_HINT}") from None
    return torch


# --------------------------------------------------------------------------------------
# modules, inputs and references
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ExportOptions:
    """Options of :func:`export_onnx`. ``reduce`` applies to ``gather`` only; ``weights`` is
    ``float32``, ``lut`` (``gather`` only), ``int8`` or ``int8-qdq`` (``ell``/``tiles`` only;
    ``int8-qdq`` needs ``opset >= 13``); ``rows`` (:data:`ROWS`) ``compact`` applies to
    ``ell``/``tiles`` of a ``bev.region`` store only."""

    product: str = "gather"
    opset: int = DEFAULT_OPSET
    channels: int = 64
    batch: int = 1
    reduce: str = "sum"
    seed: int = 0
    exporter: str = "legacy"
    tolerance: float = MAX_ABS_TOLERANCE
    weights: str = "float32"
    rows: str = "dense"
    target: str = "generic"
    form: str | None = None
    layout: str | None = None
    tile_rows: int | None = None
    calibration: tuple[str, ...] = ()
    calibration_samples: int = CALIBRATION_SAMPLES
    guard: bool = False
    classes: int = 0

    @property
    def quantised(self) -> bool:
        return self.weights != "float32"

    @property
    def direct(self) -> bool:
        """Whether the graph builder (:mod:`bevcompile.deploy.graph`) writes the graph: every target
        but ``generic`` (today's torch-traced graphs), or ``generic`` with a ``--form``."""
        return self.target != "generic" or self.form not in (None, "torch")

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
        if self.form is not None and self.form not in FORMS:
            raise UsageError(f"--form must be one of {', '.join(FORMS)}, got {self.form!r}")
        if self.layout is not None and self.layout not in LAYOUTS:
            raise UsageError(f"--layout must be one of {', '.join(LAYOUTS)}, got {self.layout!r}")
        if self.tile_rows is not None and not 1 <= self.tile_rows <= 4096:
            raise UsageError(f"--tile-rows must be in [1, 4096], got {self.tile_rows}")
        if not 1 <= self.calibration_samples <= 1024:
            raise UsageError(f"--calibration-samples must be in [1, 1024], got {self.calibration_samples}")
        if not 0 <= self.classes <= 4096:
            raise UsageError(f"--classes must be in [1, 4096], got {self.classes}")
        if self.classes and self.product == "gather":
            raise UsageError("--classes lifts an integer class map with the matrix: --product ell or tiles, got --product gather")
        if self.classes and self.direct:
            raise UsageError(f"--classes (the class lift) is exported from the torch module ClassLift: --target generic, got --target {self.target}")
        if self.classes and self.weights in ("int8-qdq", "lut"):
            raise UsageError(f"--classes takes --weights float32, int8, fp16 or mixed, got --weights {self.weights}")
        if self.direct:
            allowed = DIRECT_WEIGHTS[self.product]
            if self.weights not in allowed:
                raise UsageError(
                    f"--weights {self.weights} with --target {self.target}: --product {self.product} takes {', '.join(allowed)}"
                    + (" (the LUT codes are a --target generic form: the graph builder stores the decoded weights)" if self.weights == "lut" else "")
                )
        elif self.weights == "float16":
            raise UsageError("--weights float16 is a form of the graph builder: give a --target (e.g. onnxruntime, rk3588) or --form")
        if self.direct and self.weights == "mixed" and self.form not in (None, "gather"):
            raise UsageError(f"--weights mixed is built in the gather form (two row groups: int8 and fp16), got --form {self.form}")
        if not self.direct and self.weights not in PRODUCT_WEIGHTS[self.product]:
            *first, last = PRODUCT_WEIGHTS[self.product]
            needs = "gather" if self.weights == "lut" else "ell or tiles"
            raise UsageError(
                f"--weights {self.weights} applies to --product {needs} only, got --product {self.product} "
                f"(use --weights {', '.join(first)} or {last})"
            )
        if not MIN_OPSET <= self.opset <= MAX_OPSET:
            raise UsageError(
                f"--opset must be in [{MIN_OPSET}, {MAX_OPSET}], got {self.opset}"
                + (" (below 9 the exporter cannot fold the Reshape targets into constants: the shapes would not be static)" if self.opset < MIN_OPSET else "")
            )
        if self.exporter == "dynamo" and self.opset < DYNAMO_MIN_OPSET:
            raise UsageError(
                f"--exporter dynamo writes opset {DYNAMO_MIN_OPSET} or higher (torch's dynamo exporter cannot convert down to "
                f"--opset {self.opset}); use --exporter legacy for it"
            )
        if self.weights == "int8-qdq" and self.opset < QDQ_MIN_OPSET:
            raise UsageError(
                f"--weights int8-qdq needs --opset {QDQ_MIN_OPSET} or higher (DequantizeLinear with a per-row scale), "
                f"got --opset {self.opset}"
            )
        if not 1 <= self.channels <= 4096:
            raise UsageError(f"--channels must be in [1, 4096], got {self.channels}")
        if not 1 <= self.batch <= 64:
            raise UsageError(f"--batch must be in [1, 64], got {self.batch}")
        if self.reduce not in REDUCTIONS:
            raise UsageError(f"--reduce must be sum or mean, got {self.reduce!r}")
        if self.rows not in ROWS:
            raise UsageError(f"--rows must be one of {', '.join(ROWS)}, got {self.rows!r}")
        if self.rows == "compact" and self.product == "gather":
            raise UsageError("--rows compact applies to --product ell or tiles (the matrix rows of a bev.region store), got --product gather")
        if self.exporter not in EXPORTERS:
            raise UsageError(f"--exporter must be one of {', '.join(EXPORTERS)}, got {self.exporter!r}")


# --------------------------------------------------------------------------------------
# memory: refuse, before any work, what cannot fit
# --------------------------------------------------------------------------------------

EXPORT_BYTES_BASE = 256 * 2**20
"""Interpreter, torch, onnx and onnxruntime themselves, plus the module's tables (margin)."""
TABLE_COPIES = 6
"""Copies of the product's tables alive at the peak: the loaded store's cache, the module's
buffers, the traced graph, the ONNX proto, its serialised bytes, the onnxruntime session
(the tiles export of nuScenes: 136 MiB of blocks, 1.39 GB peak RSS)."""
PRODUCT_TABLES = {
    "gather": ("index", "weight", "weight_u8", "lut", "perm_inverse"),
    "ell": ("ell_index", "ell_weight", "ell_weight_int8", "row_scale"),
    "tiles": ("tile_cols", "tile_weight", "tile_weight_int8", "tile_row_scale"),
}
GATHER_REFERENCE_TEMPORARIES = 6
"""The numpy ``grid_sample`` reference holds about this many float64 ``(N, cells, C)`` arrays at
once per camera (the four corner gathers, their weighted sum, the accumulated output)."""


@dataclass(frozen=True)
class MemoryEstimate:
    """Peak memory of :func:`export_onnx` (bytes), from the shapes alone (nothing is read but
    metadata and ``tile_col_offsets``).

    Convention: ``forward`` = the module's largest temporaries (twice the gathered tensor: it and
    its product with the weights; the README formulas: gather ``N·C·n_cam·cells·4`` floats,
    ELL ``N·C·rows_pad·k_pad``, tiles ``N·C·max_t n_cols_t``); ``reference`` = the float64
    numpy reference's temporaries; ``fixed`` = base + :data:`TABLE_COPIES` x the product's
    tables + inputs + the outputs kept side by side (float32 module and onnxruntime outputs,
    float64 references). The stages run one after the
    other, so ``total = fixed + max(forward, reference)``.
    """

    forward: int
    reference: int
    fixed: int
    gathered: str

    @property
    def total(self) -> int:
        return self.fixed + max(self.forward, self.reference)


def estimate_export_memory(store: LoadedStore, options: ExportOptions) -> MemoryEstimate:
    """The :class:`MemoryEstimate` of exporting ``options.product`` from ``store``."""
    n, c = options.batch, options.channels
    rig = store.rig
    w_f, h_f = store.feature_size
    n_h, ny, nx = store.bev_shape
    pixels = rig.n_cam * h_f * w_f
    f32, f64 = 4, 8
    depth_values = 0
    if options.product == "gather":
        if store.has_group("gather"):
            entries = int(np.prod(store.array_info("gather", "index").shape))
        else:
            entries = rig.n_cam * n_h * ny * nx * 4
        gathered = n * c * entries
        what = f"the gathered tensor N·C·{entries:,} entries"
        out_cells = n_h * ny * nx
        reference = (GATHER_REFERENCE_TEMPORARIES * n * c * n_h * ny * nx + n * c * h_f * w_f) * f64
    else:
        layout = matrix_layout(store)
        frustum = layout.mode == "frustum"
        if frustum:
            depth_values = n * rig.n_cam * rig.depth.n_bins * h_f * w_f
        if options.product == "ell":
            gathered = n * c * layout.rows_pad * layout.k_pad
            what = f"the gathered ELL tensor N·C·rows_pad·k_pad = N·C·{layout.rows_pad:,}·{layout.k_pad}"
        else:
            offsets = np.asarray(store["matrix"]["tile_col_offsets"], dtype=np.int64) if "tile_col_offsets" in store["matrix"] else np.zeros(1, np.int64)
            widest = int(np.diff(offsets).max()) if offsets.size > 1 else 0
            gathered = n * c * widest + n * c * layout.rows_pad  # the widest tile's columns + the concatenated rows
            what = f"the widest tile N·C·{widest:,} columns"
        out_cells = ny * nx
        lifted = min(layout.n_cols, LIFT_CHUNK_COLUMNS) if frustum else 0
        reference = (pixels * c + 2 * lifted * c + 2 * layout.n_rows * c) * f64
    group = "gather" if options.product == "gather" and store.has_group("gather") else ("grid" if options.product == "gather" else "matrix")
    names = PRODUCT_TABLES[options.product] if group != "grid" else ("norm",)
    tables = sum(store.array_info(group, name).nbytes for name in names if name in store[group])
    forward = 2 * gathered * f32 + n * c * pixels * f32  # gathered + its weighted product, the transposed features
    inputs = (n * c * pixels + depth_values) * f32
    outputs = n * c * out_cells * (2 * f32 + 2 * f64)
    return MemoryEstimate(forward=forward, reference=reference, fixed=EXPORT_BYTES_BASE + TABLE_COPIES * tables + inputs + outputs, gathered=what)


def _memory_limit() -> tuple[int, str] | None:
    """What this process may use (:func:`bevcompile.memory.memory_limit`) and what bounds it."""
    from ..memory import memory_limit

    limit = memory_limit()
    return None if limit is None else (limit.bytes, limit.what)


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:,.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:,.0f} MiB"


def check_export_memory(store: LoadedStore, options: ExportOptions) -> MemoryEstimate:
    """Refuse (:class:`UsageError`, exit 2) an export whose estimated peak exceeds this machine's
    physical memory; the allocator would fail mid-export (or the kernel kill the process)."""
    estimate = estimate_export_memory(store, options)
    limit = _memory_limit()
    if limit is not None and estimate.total > limit[0]:
        have, what = limit
        raise UsageError(
            f"{store.path}: export-onnx --product {options.product} --channels {options.channels} --batch {options.batch} "
            f"needs about {_gib(estimate.total)} (the tables and inputs, then the larger of {estimate.gathered} in float32, twice, and the float64 reference), "
            f"more than the {_gib(have)} {what} allows; reduce --channels or --batch"
        )
    return estimate


def make_inputs(store: LoadedStore, channels: int, batch: int, seed: int, with_depth: bool, classes: int = 0) -> dict[str, np.ndarray]:
    """Seeded random model inputs.

    Convention:
        ``features`` float32 ``(N, n_cam, C, H_f, W_f)`` uniform in ``[0, 1)`` — or, with
        ``classes``, ``labels`` int64 ``(N, n_cam, H_f, W_f)`` uniform in ``[0, classes]`` (the value
        ``classes`` is an ignore label outside the classes); ``depth`` (frustum mode) float32
        ``(N, n_cam, D, H_f, W_f)``, softmax over ``D``.
    """
    w_f, h_f = store.feature_size
    rng = np.random.default_rng(seed)
    inputs: dict[str, np.ndarray]
    if classes:
        inputs = {"labels": rng.integers(0, classes + 1, (batch, store.rig.n_cam, h_f, w_f)).astype(np.int64)}
    else:
        inputs = {"features": rng.random((batch, store.rig.n_cam, channels, h_f, w_f), dtype=np.float32)}
    if with_depth:
        inputs["depth"] = random_depth_probs(rng, (batch, store.rig.n_cam, store.rig.depth.n_bins, h_f, w_f), axis=2)
    return inputs


def export_tolerance(store: LoadedStore, options: ExportOptions) -> float:
    """Max abs error allowed between the onnxruntime output and its reference.

    ``options.tolerance`` (1e-5), except for ``--product gather`` with float32 weights: its
    reference samples the float32 ``grid/norm``, which is itself up to ``2^-25 (W_f + H_f)``
    (feature range 1) away from the float64 projection the gather weights come from
    (``checks_grid.float32_grid_bound``); with ``reduce="sum"`` that adds up over the cameras
    that see a cell. So: ``max(1e-5, k 2^-25 (W_f + H_f))``, ``k`` = the most cameras valid at
    one cell (1 for ``mean``). The nuScenes rig keeps 1e-5; the dense rig's 640 x 360 map needs more.
    """
    if options.product != "gather" or options.weights != "float32":
        return options.tolerance
    w_f, h_f = store.feature_size
    valid = np.asarray(store["grid"]["valid"], dtype=bool)
    overlap = int(valid.sum(axis=0).max()) if options.reduce == "sum" and valid.size else 1
    return max(options.tolerance, max(overlap, 1) * 2.0**-25 * (w_f + h_f))


def reference_grid_gather(store: LoadedStore, features: np.ndarray, reduce: str) -> np.ndarray:
    """numpy ``grid_sample`` (PyTorch semantics) on ``grid/norm`` per camera, summed or
    averaged over the cameras valid at each cell (``grid/valid``).

    Convention: features ``(N, n_cam, C, H_f, W_f)``; returns float64 ``(N, C, n_heights, ny, nx)``.
    """
    from ..grid.reference import grid_sample

    grid = store["grid"]
    norm = np.asarray(grid["norm"], dtype=np.float64)
    valid = np.asarray(grid["valid"], dtype=bool)
    align = bool(grid.attrs.get("align_corners", False))
    n, n_cam, c = features.shape[:3]
    region = "expand" in grid and norm.ndim == 4  # bev.region: (n_cam, n_h, n_kept, 2), the one-row lattice
    if region:
        norm = norm[:, :, None]
        valid = valid[:, :, None]
    _, n_h, ny, nx, _ = norm.shape
    out = np.zeros((n, c, n_h, ny, nx), dtype=np.float64)
    for cam in range(n_cam):
        g = np.broadcast_to(norm[cam].reshape(1, n_h * ny, nx, 2), (n, n_h * ny, nx, 2))
        sampled = grid_sample(features[:, cam], g, mode="bilinear", padding_mode="zeros", align_corners=align)
        out += sampled.reshape(n, c, n_h, ny, nx)
    if reduce == "mean":
        count = valid.sum(axis=0)
        out = np.where(count > 0, out / np.maximum(count, 1), 0.0)
    return _expand_region(store, out[:, :, :, 0]) if region else out


def _expand_region(store: LoadedStore, compact: np.ndarray) -> np.ndarray:
    """``(N, C, n_heights, n_kept)`` values of a region store's kept cells on the dense map
    ``(N, C, n_heights, ny, nx)``: ``concat(values, 0)[..., grid/expand]`` (numpy fancy index)."""
    n_h, ny, nx = store.bev_shape
    expand = np.asarray(store["grid"]["expand"], dtype=np.int64)
    padded = np.concatenate([compact, np.zeros((*compact.shape[:-1], 1), dtype=compact.dtype)], axis=-1)
    return padded[..., expand].reshape(*compact.shape[:2], n_h, ny, nx)


def reference_gather_lut(store: LoadedStore, features: np.ndarray, reduce: str, weights: str = "lut") -> np.ndarray:
    """The gather tables with the LUT weights, in float64: the reference of ``--weights lut``
    (``weights="float16"``: the stored float32 weights rounded to float16, the reference of the
    graph builder's ``--weights float16``).

    Weights ``w(v_j, u_i) = lut[cv_j] * lut[cu_i]`` from ``gather/weight_u8`` + ``gather/lut``
    (:func:`bevcompile.grid.gather.lut_weights`), ``out[c, row] = sum_k w[row, k] * stacked[c, index[row, k]]``
    (:func:`bevcompile.grid.gather.gather_sample`), rows brought to cell order with
    ``gather/perm_inverse`` (or the first ``n_cells`` rows), summed over the cameras, and for
    ``reduce="mean"`` divided by the number of valid cameras (``grid/valid``).

    Convention: features ``(N, n_cam, C, H_f, W_f)``; returns float64 ``(N, C, n_heights, ny, nx)``.
    """
    from ..grid.gather import gather_sample, lut_weights

    if weights == "float16" and not store.has_group("gather"):  # the bilinear tables of grid/norm
        from .lift import bilinear_tables_from_norm

        grid = store["grid"]
        index, weight = bilinear_tables_from_norm(np.asarray(grid["norm"]), store.feature_size, bool(grid.attrs.get("align_corners", False)))
        index, weight = index.reshape(-1, 4), weight.reshape(-1, 4).astype(np.float16).astype(np.float64)
        perm_inverse = None
    else:
        group = store["gather"]
        perm_inverse = np.asarray(group["perm_inverse"], dtype=np.int64) if "perm_inverse" in group else None
        index = np.asarray(group["index"]).reshape(-1, 4)
        if weights == "float16":
            weight = np.asarray(group["weight"]).reshape(-1, 4).astype(np.float16).astype(np.float64)
        else:
            weight = lut_weights(np.asarray(group["weight_u8"]), np.asarray(group["lut"])).reshape(-1, 4)
    n, n_cam, c = features.shape[:3]
    n_h, ny, nx = store.bev_shape
    region = "expand" in store["grid"]
    if region:  # bev.region: the kept cells (grid/cells order), expanded at the end
        ny, nx = 1, int(np.asarray(store["grid"]["cells"]).shape[0])
    cells = n_h * ny * nx
    row_of_cell = perm_inverse if perm_inverse is not None else np.arange(n_cam * cells, dtype=np.int64)
    out = np.zeros((n, c, n_h, ny, nx), dtype=np.float64)
    for b in range(n):
        per_row = gather_sample(features[b], index, weight)  # (C, rows)
        out[b] = per_row[:, row_of_cell].reshape(c, n_cam, n_h, ny, nx).sum(axis=1)
    if reduce == "mean":
        count = np.asarray(store["grid"]["valid"], dtype=bool).sum(axis=0).reshape(n_h, ny, nx)
        out = np.where(count > 0, out / np.maximum(count, 1), 0.0)
    return _expand_region(store, out[:, :, :, 0]) if region else out


def reference_matrix_lift(store: LoadedStore, features: np.ndarray, depth: np.ndarray | None, rows: str = "dense", weights: str = "float32") -> np.ndarray:
    """``W @ X`` with the ``matrix/`` group's COO form, in float64 (scipy.sparse); ``weights="float16"``:
    the COO values rounded to float16 first (the reference of ``--weights float16``).

    Convention: features ``(N, n_cam, C, H_f, W_f)``; depth ``(N, n_cam, D, H_f, W_f)`` in
    frustum mode; returns float64 ``(N, C, ny, nx)`` (rows scattered to their BEV cells via
    ``row_ids`` when rows are compacted; cells without a row are 0; a ``bev.region`` store's rows
    are expanded with ``matrix/expand``, applied here as a numpy fancy index); ``rows="compact"``
    (a ``bev.region`` store): float64 ``(N, C, n_kept)``, the rows in ``matrix/cells`` order.
    """
    import scipy.sparse as sp

    layout = matrix_layout(store)
    group = store["matrix"]
    coo_row = np.asarray(group["coo_row"], dtype=np.int64)
    cols = np.asarray(group["coo_col"], dtype=np.int64)
    vals = np.asarray(group["coo_val"], dtype=np.float16 if weights == "float16" else np.float32).astype(np.float64)
    w_mat = sp.csr_matrix((vals, (coo_row, cols)), shape=(layout.n_rows, layout.n_cols))
    return _apply_matrix(store, layout, w_mat, features, depth, rows)


def reference_matrix_lift_int8(store: LoadedStore, features: np.ndarray, depth: np.ndarray | None, form: str, out_rows: str = "dense") -> np.ndarray:
    """``W_dequant @ X`` in float64: the reference of ``--weights int8``.

    ``W_dequant`` is the stored decode ``float32(q) * row_scale[r]``
    (:func:`bevcompile.matrix.layout.dequantize_rows_int8`) of ``ell_weight_int8``/``row_scale``
    (``form="ell"``) or of ``tile_weight_int8``/``tile_row_scale`` (``form="tiles"``), rows
    ``>= n_rows`` dropped. Convention as :func:`reference_matrix_lift`.
    """
    import scipy.sparse as sp

    from ..matrix.layout import dequantize_rows_int8, tile_blocks, tile_entries

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
        blocks = tile_blocks(np.asarray(group["tile_weight_int8"]), offsets, r)
        rows, cols, vals = tile_entries((dequantize_rows_int8(b, scale[t * r : (t + 1) * r]) for t, b in enumerate(blocks)), tile_cols, offsets, r)
    keep = rows < layout.n_rows
    w_mat = sp.csr_matrix(
        (vals[keep].astype(np.float64), (rows[keep], cols[keep])), shape=(layout.n_rows, layout.n_cols)
    )
    return _apply_matrix(store, layout, w_mat, features, depth, out_rows)


def _mixed_matrix(store: LoadedStore, form: str) -> Any:
    """The stored mixed (int8 + fp16 rows) product as a float64 CSR ``(n_rows, n_cols)``
    (:func:`bevcompile.matrix.precision.mixed_ell_values` / ``mixed_tile_values``)."""
    import scipy.sparse as sp

    from ..matrix.layout import tile_blocks, tile_entries
    from ..matrix.precision import mixed_ell_values, mixed_tile_values

    layout = matrix_layout(store)
    group = store["matrix"]
    for name in ("ell_weight_int8", "row_scale", "fp16_rows", "fp16_row_weight"):
        if name not in group:
            raise StoreError(f"{store.path}: --weights mixed needs matrix/{name}; rebuild it with `bevcompile matrix --quantize mixed`")
    rows_fp16 = np.asarray(group["fp16_rows"])
    if form == "ell":
        index = np.asarray(group["ell_index"], dtype=np.int64)
        values = mixed_ell_values(np.asarray(group["ell_weight_int8"]), np.asarray(group["row_scale"]), rows_fp16, np.asarray(group["fp16_row_weight"]))
        rows = np.repeat(np.arange(index.shape[0], dtype=np.int64), index.shape[1])
        cols, vals = index.ravel(), values.ravel()
    else:
        r = layout.tile_rows
        if r is None or "fp16_row_tile_weight" not in group:
            raise StoreError(f"{store.path}: --weights mixed --product tiles needs the mixed tiles; rebuild it with `bevcompile matrix --quantize mixed --tile-rows R`")
        offsets = np.asarray(group["tile_col_offsets"], dtype=np.int64)
        flat = mixed_tile_values(np.asarray(group["tile_weight_int8"]), np.asarray(group["tile_row_scale"]), offsets, r, rows_fp16, np.asarray(group["fp16_row_tile_weight"]))
        tile_cols = np.asarray(group["tile_cols"], dtype=np.int64)
        rows, cols, vals = tile_entries(tile_blocks(flat, offsets, r), tile_cols, offsets, r)
    keep = rows < layout.n_rows
    return sp.csr_matrix((vals[keep].astype(np.float64), (rows[keep], cols[keep])), shape=(layout.n_rows, layout.n_cols))


def reference_matrix_lift_mixed(store: LoadedStore, features: np.ndarray, depth: np.ndarray | None, form: str, out_rows: str = "dense") -> np.ndarray:
    """``W_mixed @ X`` in float64 (the int8 rows dequantised, the fp16 rows decoded): the
    reference of ``--weights mixed``. Convention as :func:`reference_matrix_lift`."""
    return _apply_matrix(store, matrix_layout(store), _mixed_matrix(store, form), features, depth, out_rows)


def reference_class_lift(
    store: LoadedStore, labels: np.ndarray, classes: int, depth: np.ndarray | None, rows: str = "dense", weights: str = "float32", form: str = "ell"
) -> np.ndarray:
    """``lift(one_hot(labels))`` in float64 with the matrix of ``weights`` (float32 COO, the int8 /
    fp16 / mixed values): :func:`reference_matrix_lift` on the explicit one-hot features.

    Convention: labels int ``(N, n_cam, H_f, W_f)``; returns float64 ``(N, classes, ny, nx)``."""
    lab = np.asarray(labels, np.int64)
    onehot = (lab[:, :, None] == np.arange(classes)[None, None, :, None, None]).astype(np.float64)  # (N, n_cam, classes, H, W)
    if weights in ("int8", "int8-qdq"):
        return reference_matrix_lift_int8(store, onehot, depth, form, rows)
    if weights == "mixed":
        return reference_matrix_lift_mixed(store, onehot, depth, form, rows)
    return reference_matrix_lift(store, onehot, depth, rows, weights="float16" if weights == "fp16" else "float32")


def export_references(store: LoadedStore, options: ExportOptions, features: np.ndarray, depth: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """``(same-weights reference, float reference)`` of an export, float64, from the store's arrays:
    the float reference is numpy's grid_sample on ``grid/norm`` (gather) or ``W @ X`` of the float32
    COO; the same-weights one uses the weights the graph holds (``lut``, float16, int8, mixed), the
    float reference itself for float32. Every export path (torch modules, ``--target``) checks
    against these."""
    if options.product == "gather":
        float_ref = reference_grid_gather(store, features, options.reduce)
        if options.weights == "lut":
            return reference_gather_lut(store, features, options.reduce), float_ref
        if options.weights in ("float16", "fp16"):
            return reference_gather_lut(store, features, options.reduce, weights="float16"), float_ref
        return float_ref, float_ref
    float_ref = reference_matrix_lift(store, features, depth, options.rows)
    if options.weights in ("int8", "int8-qdq"):
        return reference_matrix_lift_int8(store, features, depth, options.product, options.rows), float_ref
    if options.weights == "mixed":
        return reference_matrix_lift_mixed(store, features, depth, options.product, options.rows), float_ref
    if options.weights in ("float16", "fp16"):
        return reference_matrix_lift(store, features, depth, options.rows, weights="float16"), float_ref
    return float_ref, float_ref


def _apply_matrix(
    store: LoadedStore, layout: MatrixLayout, w_mat: Any, features: np.ndarray, depth: np.ndarray | None, rows: str = "dense"
) -> np.ndarray:
    """``w_mat @ X`` per batch item, rows scattered to their BEV cells (float64 ``(N, C, ny, nx)``);
    ``rows="compact"``: a ``bev.region`` store's compact rows, float64 ``(N, C, n_kept)``."""
    n, _n_cam, c, h_f, w_f = features.shape
    _, ny, nx = store.bev_shape
    compact = rows == "compact"
    if compact and layout.expand is None:
        raise UsageError(no_region_message(store))
    out = np.zeros((n, c, layout.n_rows - 1 if compact else ny * nx), dtype=np.float64)
    if layout.mode == "frustum":
        if depth is None:
            raise UsageError("frustum-mode matrix needs depth probabilities")
        # only the columns the matrix uses, lifted a chunk at a time: the whole outer product
        # (n_cam x D x H x W x C float64) would not fit for a dense rig (42 GiB at C = 64)
        w_csc = w_mat.tocsc()
        used = np.flatnonzero(np.diff(w_csc.indptr))
        pixels = h_f * w_f
        per_cam = depth.shape[2] * pixels
    for b in range(n):
        feats = np.moveaxis(np.asarray(features[b], dtype=np.float64), 1, -1).reshape(-1, c)  # rows (cam, v, u)
        if layout.mode == "frustum" and depth is not None:
            d_flat = np.asarray(depth[b], dtype=np.float64).reshape(-1)  # (cam, d, v, u)
            y = np.zeros((layout.n_rows, c), dtype=np.float64)
            for start in range(0, used.size, LIFT_CHUNK_COLUMNS):
                cols = used[start : start + LIFT_CHUNK_COLUMNS]
                feat_rows = (cols // per_cam) * pixels + cols % pixels
                x = d_flat[cols, None] * feats[feat_rows]  # (chunk, C)
                y += np.asarray(w_csc[:, cols] @ x)
        else:
            y = np.asarray(w_mat @ feats)  # (n_rows, C)
        if compact:  # bev.region: the kept (super-)cells' rows, without the zero row
            out[b] = y[: layout.n_rows - 1].T
        elif layout.expand is not None:  # bev.region: each fine cell reads its (super-)cell's row, the zero row outside
            out[b] = y[np.asarray(layout.expand, dtype=np.int64)].T
        else:
            out[b][:, layout.row_cells] = y.T
    return out if compact else out.reshape(n, c, ny, nx)


def no_region_message(store: LoadedStore) -> str:
    """The one-line refusal of ``--rows compact`` on a store whose matrix rows are the BEV cells."""
    return (
        f"{store.path}: matrix/expand: --rows compact needs a store built with a bev.region (its rows are the kept "
        "(super-)cells); this matrix's rows are the BEV cells: drop --rows compact"
    )


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
    rows: str = "dense"
    float_reference: QuantisationReport | None = None
    float32_export: Float32Export | None = None
    qdq: QdqReport | None = None
    ort_default: DefaultSessionReport | None = None
    target: str = "generic"
    form: str = "torch"
    plan: dict[str, Any] | None = None
    cost: dict[str, Any] | None = None
    refused: list[tuple[str, list[str]]] = field(default_factory=list)
    calibration_dir: Path | None = None
    int8_route: str | None = None

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
            "rows": self.rows if self.product != "gather" else None,
            "float_reference": None if self.float_reference is None else self.float_reference.to_json(),
            "float32_export": None if self.float32_export is None else self.float32_export.to_json(),
            "constant_bytes_vs_float32": _finite(self.constant_ratio_vs_float32),
            "file_bytes_vs_float32": _finite(self.file_ratio_vs_float32),
            "qdq": None if self.qdq is None else self.qdq.to_json(),
            "onnxruntime_default": None if self.ort_default is None else self.ort_default.to_json(),
            "target": self.target,
            "form": self.form,
            "plan": self.plan,
            "cost": self.cost,
            "refused_forms": [{"form": form, "reasons": reasons} for form, reasons in self.refused],
            "calibration_dir": None if self.calibration_dir is None else str(self.calibration_dir),
            "int8_route": self.int8_route,
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
    if options.direct:
        return 4
    return 5 if options.quantised else 4


def build_module(store: LoadedStore, options: ExportOptions) -> tuple[Any, bool]:
    """``(module, needs_depth)`` for a product and its ``weights``.

    ``int8-qdq``: the FLOAT ``MatrixLift`` with its weight buffers overwritten by the dequantised
    int8 weights (:func:`qdq_module`); the module carries them as ``qdq_weights``.
    """
    from . import torch as bt

    if options.weights == "int8-qdq":
        module = qdq_module(store, options.product, options.rows)
        return module, module.mode == "frustum"
    guard = options.guard
    if options.product == "gather":
        return bt.GridGather(store, reduce=options.reduce, weights=options.weights, guard=guard), False
    if options.classes:
        module = bt.ClassLift(store, options.classes, form=options.product, weights=options.weights, rows=options.rows, guard=guard)
    else:
        module = bt.MatrixLift(store, form=options.product, weights=options.weights, rows=options.rows, guard=guard)
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


def qdq_module(store: LoadedStore, form: str, rows: str = "dense") -> Any:
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
    module: Any = bt.MatrixLift(store, form=form, rows=rows)  # Any: it gains the plain attribute qdq_weights
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
    if options.direct:
        from .direct import export_direct

        return export_direct(store_path, out, options, progress=step)
    torch = _require_torch()
    onnx, ort = _require_onnx()
    store = load(store_path)
    target = output_file(out)  # None: standard output
    out = Path(out) if target is not None else Path(tempfile.mkdtemp(prefix="bevcompile-onnx-")) / "model.onnx"

    if options.exporter == "dynamo":
        try:
            import onnxscript  # noqa: F401  (the dynamo exporter imports it; say which extra is missing)
        except ImportError:
            raise DependencyError(f"--exporter dynamo needs onnxscript: {EXTRA_HINT}") from None
    if options.product != "gather" and store.has_group("matrix") and int(store["matrix"].attrs.get("nnz", 1) or 0) == 0:
        raise UsageError(f"{store.path}: matrix/ is empty (no entries: no camera reaches the BEV range), nothing to export")
    if options.rows == "compact" and store.has_group("matrix") and "expand" not in store["matrix"]:
        raise UsageError(no_region_message(store))
    check_export_memory(store, options)
    module, needs_depth = build_module(store, options)
    module.eval()
    inputs = make_inputs(store, options.channels, options.batch, options.seed, needs_depth, options.classes)
    names = list(inputs)
    args = tuple(torch.from_numpy(inputs[name]) for name in names)
    with torch.no_grad():
        torch_out = module(*args).numpy()
    if options.classes:
        float_reference = reference_class_lift(store, inputs["labels"], options.classes, inputs.get("depth"), options.rows, "float32")
        reference = reference_class_lift(store, inputs["labels"], options.classes, inputs.get("depth"), options.rows, options.weights, options.product)
    else:
        reference, float_reference = export_references(store, options, inputs["features"], inputs.get("depth"))
    tolerance = export_tolerance(store, options)
    step(1)

    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    t0 = time.perf_counter()
    try:
        used = _torch_export(module, args, tmp, options, names)
    except Exception as exc:
        tmp.unlink(missing_ok=True)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if isinstance(exc, OSError):  # the file, not the graph: a write failure (exit 2) naming --out
            raise StoreError(f"--out {out}: cannot write ({exc.strerror or first})") from None
        if is_allocation_failure(exc):
            raise MemoryError(first) from None  # a machine limit (exit 2), not a failed check
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
    from .graph import graph_cost

    try:
        cost: dict[str, Any] | None = graph_cost(model).to_json()
    except Exception:  # the cost line is a report; a graph shape inference cannot follow has none
        cost = None
    step(1)

    failures: list[str] = []
    if qdq is not None and (qdq.missing or not qdq.nodes):
        missing = ", ".join(qdq.missing[:3]) + (f" and {len(qdq.missing) - 3} more" if len(qdq.missing) > 3 else "")
        failures.append(
            f"int8-qdq: weight matrices not found among the exported graph's float32 constants ({missing or 'none given'}); "
            "no DequantizeLinear attached for them"
        )
    if scan.opset != options.opset:
        failures.append(f"the {used} exporter wrote opset {scan.opset}, not the requested --opset {options.opset}")
    failures += [f"forbidden op {f}" for f in scan.forbidden]
    failures += [f"non-static shape {d}" for d in scan.dynamic[:10]]
    if len(scan.dynamic) > 10:
        failures.append(f"... and {len(scan.dynamic) - 10} more non-static shapes")
    t0 = time.perf_counter()
    session_options = ort.SessionOptions()
    if options.weights == "int8-qdq":
        session_options.add_session_config_entry(ORT_QDQ_ACCURACY_KEY, ORT_QDQ_CHECK_ACCURACY)
    ort_out = run_checked(ort, tmp, {name: inputs[name] for name in names}, session_options, torch_out.shape, failures)
    ort_seconds = time.perf_counter() - t0
    step(1)
    if ort_out.shape != reference.shape:
        failures.append(f"output shape {list(ort_out.shape)} != the reference's {list(reference.shape)}")
        max_abs = mean_abs = float("inf")
    else:
        diff = np.abs(ort_out.astype(np.float64) - reference)
        max_abs = float(np.nanmax(diff)) if np.isfinite(diff).all() else float("inf")
        mean_abs = float(diff.mean()) if np.isfinite(diff).all() else float("inf")
        if not max_abs <= tolerance:
            same = f" ({options.weights}: same dequantised weights)" if options.quantised else ""
            failures.append(f"onnxruntime output differs from the numpy reference{same} by {max_abs:.3g} > {tolerance:.3g}")
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
        tolerance=tolerance,
        file_bytes=tmp.stat().st_size,
        export_seconds=export_seconds,
        ort_seconds=ort_seconds,
        module=repr(module).splitlines()[0],
        failures=failures,
        weights=options.weights,
        rows=options.rows,
        float_reference=quantisation,
        float32_export=float32_export,
        qdq=qdq,
        ort_default=ort_default,
        cost=cost,
    )
    if used != options.exporter:
        result.notes.append(f"exporter {options.exporter} unavailable in this torch; used {used}")
    if scan.unexpected:
        result.notes.append(f"ops outside the expected set: {', '.join(scan.unexpected)}")
    if options.quantised and float32_export is None:
        result.notes.append("the float32 export the sizes are compared with failed; no size comparison")
    if failures:
        raise rejected_graph(out, tmp, result, failures)
    if target is None:  # --out -: the checked graph to standard output
        import shutil
        import sys

        with open(tmp, "rb") as fh:
            shutil.copyfileobj(fh, sys.stdout.buffer)
        sys.stdout.buffer.flush()
        shutil.rmtree(out.parent, ignore_errors=True)
        result.path = Path("-")
        return result
    os.replace(tmp, out)
    return result


def run_checked(ort: Any, path: Path, feeds: dict[str, np.ndarray], session_options: Any, shape: tuple[int, ...], failures: list[str]) -> np.ndarray:
    """onnxruntime's output of the graph at ``path`` (the check's run). A graph it cannot run adds a
    failure and gives NaN of ``shape``; an allocation failure removes the file and is a ``MemoryError``
    (a machine limit, exit 2)."""
    try:
        session = ort.InferenceSession(str(path), session_options, providers=["CPUExecutionProvider"])
        (out,) = session.run(["bev"], feeds)
        return np.asarray(out)
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if is_allocation_failure(exc):
            path.unlink(missing_ok=True)
            raise MemoryError(f"onnxruntime: {first}") from None
        failures.append(f"onnxruntime cannot run the graph: {first}")
        return np.full(shape, np.nan, dtype=np.float32)


def rejected_graph(out: Path, tmp: Path, result: ExportResult, failures: list[str]) -> CheckFailed:
    """Keep a graph that failed its checks as ``<stem>.rejected.onnx`` (nothing at ``out``) and the
    :class:`CheckFailed` naming every failure, with the result attached."""
    rejected = out.with_name(f"{out.stem}.rejected.onnx")
    os.replace(tmp, rejected)
    result.path = rejected
    error = CheckFailed(f"{out}: " + "; ".join(failures) + f" (rejected graph kept at {rejected})")
    error.result = result  # type: ignore[attr-defined]
    return error


def _quantisation_report(ort_out: np.ndarray, float_reference: np.ndarray, product: str) -> QuantisationReport:
    """onnxruntime output of the quantised graph vs the float reference (max abs, PSNR)."""
    from ..store.plugins import psnr_db

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


def metadata_entries(store: LoadedStore, options: ExportOptions, exporter: str, *, form: str = "torch", **extra: str) -> dict[str, str]:
    """The ``bevcompile.*`` metadata_props of an exported graph: where it came from (store, config
    hash, product, weights, shapes) and how it was built (``form``; ``extra`` keys added as
    ``bevcompile.<key>``)."""
    w_f, h_f = store.feature_size
    n_h, ny, nx = store.bev_shape
    return {
        "bevcompile.version": __version__,
        "bevcompile.store_name": store.name,
        "bevcompile.config_sha256": store.config_sha256,
        "bevcompile.product": options.product,
        "bevcompile.reduce": options.reduce if options.product == "gather" else "",
        "bevcompile.weights": options.weights,
        "bevcompile.rows": options.rows if options.product != "gather" else "",
        "bevcompile.exporter": exporter,
        "bevcompile.feature_size": f"[{w_f}, {h_f}]",
        "bevcompile.bev_shape": f"[{n_h}, {ny}, {nx}]",
        "bevcompile.cameras": ",".join(store.rig.camera_names),
        "bevcompile.target": options.target,
        "bevcompile.form": form,
        "bevcompile.guard": "true" if options.guard else "false",
        "bevcompile.classes": str(options.classes) if options.classes else "",
        **{f"bevcompile.{key}": value for key, value in extra.items()},
    }


def _add_metadata(model: Any, store: LoadedStore, options: ExportOptions, exporter: str) -> None:
    """Record where the graph came from in the model's metadata_props."""
    entries = metadata_entries(store, options, exporter)
    del model.metadata_props[:]
    for key, value in entries.items():
        prop = model.metadata_props.add()
        prop.key = key
        prop.value = value
