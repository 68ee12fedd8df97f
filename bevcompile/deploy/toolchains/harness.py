"""Prove an export on a real toolchain: export for a target, compile and run it there, compare.

:func:`check_target` exports one product of a store for one target
(:func:`bevcompile.deploy.onnx_export.export_onnx`), hands the file to the target's toolchain
worker in its own virtual environment (``.venv-npu/<toolchain>``, or ``$BEVCOMPILE_NPU_ENVS``),
and turns what came back into a :class:`CheckRow`: the compiled size against the graph's constant
bytes, the layers placed on the CPU, every limit / fallback line of the build COUNTED AS A FAILURE
(RKNN's x86 simulator computes right even where the chip would not run), and the toolchain's
output against the numpy references (max abs, PSNR). :data:`BOUNDS` are the pass bounds per
toolchain and precision.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import UsageError
from ...store.loader import load
from ...store.plugins import psnr_db

WORKERS = {"rknn": "rknn_worker.py", "openvino": "openvino_worker.py", "litert": "litert_worker.py"}
ENVS_VARIABLE = "BEVCOMPILE_NPU_ENVS"
DEFAULT_ENVS = Path(__file__).resolve().parents[3] / ".venv-npu"
WORKER_TIMEOUT_S = 1800
CPU_OK_LAYERS = ("InputOperator", "OutputOperator")
"""RKNN layers that always run on the CPU (they hand the tensors in and out)."""


@dataclass(frozen=True)
class Bound:
    """A pass bound of a toolchain's output: ``max_abs`` against the same-weights reference and/or
    ``min_psnr_db`` against the float reference, plus the build's time and memory."""

    max_abs: float | None = None
    min_psnr_db: float | None = None
    max_build_seconds: float | None = None
    max_peak_rss_bytes: int | None = None
    source: str = ""


BOUNDS: dict[tuple[str, str], Bound] = {
    ("rknn", "float"): Bound(max_abs=2e-3, max_build_seconds=300, max_peak_rss_bytes=4 << 30, source="bevcompile's RKNN bound: fp16 <= 2e-3 max abs, build <= 5 min and <= 4 GB"),
    ("rknn", "int8"): Bound(min_psnr_db=40.0, max_build_seconds=300, max_peak_rss_bytes=4 << 30, source="bevcompile's RKNN bound: int8 >= 40 dB PSNR, build <= 5 min and <= 4 GB"),
    ("openvino", "float"): Bound(max_abs=1e-5, source="bevcompile's OpenVINO bound: f32 <= 1e-5 max abs"),
    ("openvino", "int8"): Bound(min_psnr_db=40.0, source="the fully quantised graph's own bound (INT8_MIN_PSNR_DB)"),
    ("litert", "float"): Bound(max_abs=1e-5, source="float32 TFLite runs the graph as written"),
    ("litert", "int8"): Bound(min_psnr_db=40.0, source="bevcompile's LiteRT bound: full-int8 >= 40 dB PSNR"),
}


@dataclass
class CheckRow:
    """One target x product x precision, as the harness measured it (``status``: ``pass``,
    ``fail``, ``refused`` — the export refused it with the limit it breaks — or ``skipped``)."""

    store: str
    target: str
    product: str
    mode: str
    weights: str
    status: str = "fail"
    form: str = ""
    failures: list[str] = field(default_factory=list)
    refusal: str = ""
    constant_bytes: int = 0
    compiled_bytes: int | None = None
    build_seconds: float | None = None
    peak_rss_bytes: int | None = None
    cpu_layers: list[str] = field(default_factory=list)
    limit_lines: int = 0
    fallback_lines: int = 0
    layer_dtypes: dict[str, int] = field(default_factory=dict)
    max_abs_same: float | None = None
    max_abs_float: float | None = None
    psnr_db: float | None = None
    nodes: int = 0
    toolchain: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def compiled_ratio(self) -> float | None:
        if self.compiled_bytes is None or not self.constant_bytes:
            return None
        return self.compiled_bytes / self.constant_bytes

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["compiled_ratio"] = self.compiled_ratio
        for key, value in out.items():
            if isinstance(value, float) and not np.isfinite(value):
                out[key] = None
        return out


def toolchain_python(toolchain: str, envs: Path | None = None) -> Path:
    """The Python of a toolchain's venv (``<envs>/<toolchain>/bin/python``)."""
    root = envs or Path(os.environ.get(ENVS_VARIABLE, str(DEFAULT_ENVS)))
    return root / toolchain / "bin" / "python"


def toolchain_available(toolchain: str, envs: Path | None = None) -> bool:
    return toolchain_python(toolchain, envs).is_file()


def run_worker(toolchain: str, spec: dict[str, Any], workdir: Path, envs: Path | None = None, timeout: float = WORKER_TIMEOUT_S) -> dict[str, Any]:
    """Run a toolchain worker on ``spec`` (written to ``workdir/spec.json``); its result dict."""
    python = toolchain_python(toolchain, envs)
    if not python.is_file():
        raise UsageError(f"the {toolchain} toolchain is not installed at {python.parent.parent} (run `make npu-envs`)")
    spec_path = workdir / "spec.json"
    spec_path.write_text(json.dumps(spec, indent=1))
    worker = Path(__file__).with_name(WORKERS[toolchain])
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    started = time.perf_counter()
    try:
        proc = subprocess.run([str(python), str(worker), str(spec_path)], cwd=workdir, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"{toolchain} worker timed out after {timeout:.0f} s", "seconds": time.perf_counter() - started}
    result_path = Path(spec["out_dir"]) / "result.json"
    if not result_path.is_file():
        tail = (proc.stderr or proc.stdout or "").strip().splitlines()[-3:]
        return {"error": f"{toolchain} worker exited {proc.returncode} without a result ({' | '.join(tail)[:400]})", "seconds": time.perf_counter() - started}
    result: dict[str, Any] = json.loads(result_path.read_text())
    if proc.returncode not in (0,) and "error" not in result:
        result["error"] = f"{toolchain} worker exited {proc.returncode}"
    return result


def _compare(row: CheckRow, out: np.ndarray, same: np.ndarray, float_ref: np.ndarray) -> None:
    out64 = np.asarray(out, np.float64).reshape(same.shape)
    if not np.isfinite(out64).all():
        row.failures.append("the toolchain's output holds NaN/Inf")
        return
    row.max_abs_same = float(np.abs(out64 - same).max()) if same.size else 0.0
    row.max_abs_float = float(np.abs(out64 - float_ref).max()) if same.size else 0.0
    peak = float(float_ref.max() - float_ref.min()) if float_ref.size else 1.0
    mse = float(np.mean((out64 - float_ref) ** 2)) if float_ref.size else 0.0
    row.psnr_db = psnr_db(mse, peak if peak > 0 else 1.0)


def check_target(
    store_path: str | Path,
    product: str,
    target: str,
    weights: str,
    workdir: Path,
    *,
    channels: int = 64,
    rows: str = "dense",
    envs: Path | None = None,
    label: str = "",
    calibration_samples: int = 8,
) -> CheckRow:
    """Export, build on the toolchain, run, compare (see the module docstring)."""
    from ...errors import BevcompileError
    from ..direct import _feeds, _references
    from ..onnx_export import ExportOptions, export_onnx, make_inputs
    from ..targets import load_profile

    profile = load_profile(target)
    store = load(store_path)
    mode = str(store["matrix"].attrs.get("mode", "")) if product != "gather" and store.has_group("matrix") else "grid"
    row = CheckRow(store=label or store.name, target=target, product=product, mode=mode, weights=weights, toolchain=profile.toolchain)
    workdir.mkdir(parents=True, exist_ok=True)
    onnx_path = workdir / "model.onnx"
    options = ExportOptions(product=product, target=target, weights=weights, channels=channels, rows=rows, calibration_samples=calibration_samples)
    try:
        result = export_onnx(store, onnx_path, options)
    except UsageError as exc:
        row.status, row.refusal = "refused", str(exc)
        return row
    except BevcompileError as exc:
        row.failures.append(f"export: {exc}")
        return row
    row.form = result.form
    row.constant_bytes = int(result.scan.initializer_bytes)
    row.nodes = int(result.scan.n_nodes)
    if not toolchain_available(profile.toolchain, envs):
        row.status = "skipped"
        row.notes.append(f"{profile.toolchain} toolchain not installed (make npu-envs)")
        return row
    int8 = weights in ("int8", "int8-qdq")
    inputs = make_inputs(store, channels, 1, 0, mode == "frustum")  # the export's own inputs (seed 0)
    plan_rank = int(result.plan["input_rank"]) if result.plan else 5
    feeds = _feeds(inputs, plan_rank)
    np.savez(str(workdir / "inputs.npz"), **feeds)  # type: ignore[arg-type]
    same, float_ref = _references(store, options, inputs)
    out_dir = workdir / "out"
    spec: dict[str, Any] = {"onnx": str(onnx_path), "inputs": str(workdir / "inputs.npz"), "input_names": list(feeds), "out_dir": str(out_dir)}
    if profile.toolchain == "rknn":
        spec.update(platform=profile.platform, quantize=int8, simulate=True)
        if int8:
            assert result.calibration_dir is not None
            spec["dataset"] = str(result.calibration_dir / "dataset.txt")
    elif profile.toolchain == "openvino":
        spec["config"] = {"INFERENCE_PRECISION_HINT": "f32"}
    elif profile.toolchain == "litert":
        spec["quantize"] = int8
        if int8 and result.calibration_dir is not None:
            spec["calibration"] = {name: str(result.calibration_dir / f"{name}.npy") for name in feeds}
    worker = run_worker(profile.toolchain, spec, workdir, envs)
    row.build_seconds = worker.get("build_seconds", worker.get("compile_seconds", worker.get("convert_seconds")))
    row.peak_rss_bytes = worker.get("peak_rss_bytes")
    row.compiled_bytes = worker.get("rknn_bytes", worker.get("tflite_bytes"))
    if "error" in worker:
        row.failures.append(str(worker["error"])[:500])
    layers = worker.get("layers", [])
    row.limit_lines = int(worker.get("n_limit_lines", 0))
    row.fallback_lines = int(worker.get("n_fallback_lines", 0))
    if row.limit_lines:
        row.failures.append(f"{row.limit_lines} limit lines in the build log, e.g. {worker.get('limit_lines', [''])[0][:160]}")
    if row.fallback_lines:
        row.failures.append(f"{row.fallback_lines} CPU-fallback lines in the build log")
    for layer in layers:
        key = f"{layer.get('op')}:{layer.get('dtype', layer.get('precision', '?'))}"
        row.layer_dtypes[key] = row.layer_dtypes.get(key, 0) + 1
        if layer.get("target") == "CPU" and layer.get("op") not in CPU_OK_LAYERS:
            row.cpu_layers.append(str(layer.get("op")))
    if row.cpu_layers:
        row.failures.append(f"{len(row.cpu_layers)} layers on the CPU: {', '.join(sorted(set(row.cpu_layers)))}")
    if profile.toolchain == "rknn" and int8:
        compute = [layer for layer in layers if layer.get("op") in ("Conv", "ConvAdd", "MatMul", "Gather", "Mul", "Add", "exMatMul")]
        floating = [layer for layer in compute if layer.get("dtype") != "INT8"]
        if floating:
            row.failures.append(f"{len(floating)} of {len(compute)} compute layers not INT8")
    if profile.toolchain == "litert" and int8:
        compute = [layer for layer in layers if layer.get("op") in ("GATHER", "MUL", "SUM", "BATCH_MATMUL", "FULLY_CONNECTED", "ADD")]
        floating = [layer for layer in compute if layer.get("dtype") != "int8"]
        if floating or not compute:
            row.failures.append(f"{len(floating)} of {len(compute)} LiteRT compute ops not int8")
    if profile.toolchain == "openvino" and int8:
        compute = [layer for layer in layers if layer.get("op") in ("Gather", "Reduce", "Subgraph", "MatMul", "FullyConnected", "Eltwise")]
        if not any(str(layer.get("precision")) in ("i8", "u8") for layer in compute):
            row.failures.append("no compute layer ran in int8 (OpenVINO kept the QDQ graph in float)")
    output = out_dir / "output.npy"
    if output.is_file():
        _compare(row, np.load(output), same, float_ref)
    elif "error" not in worker:
        row.failures.append("the toolchain wrote no output")
    bound = BOUNDS.get((profile.toolchain, "int8" if int8 else "float"))
    if bound is not None and row.max_abs_same is not None:
        # the export's own tolerance where it is larger: a gather reference samples the float32 grid/norm,
        # up to 2^-25 (W_f + H_f) per camera from the float64 projection (export_tolerance)
        allowed = None if bound.max_abs is None else max(bound.max_abs, result.tolerance)
        if allowed is not None and row.max_abs_same > allowed:
            row.failures.append(f"max abs {row.max_abs_same:.3g} > {allowed:.3g} ({bound.source})")
        if bound.min_psnr_db is not None and (row.psnr_db or 0.0) < bound.min_psnr_db:
            row.failures.append(f"PSNR {row.psnr_db:.1f} dB < {bound.min_psnr_db:g} dB ({bound.source})")
        if bound.max_build_seconds is not None and (row.build_seconds or 0.0) > bound.max_build_seconds:
            row.failures.append(f"build {row.build_seconds:.0f} s > {bound.max_build_seconds:g} s")
        if bound.max_peak_rss_bytes is not None and (row.peak_rss_bytes or 0) > bound.max_peak_rss_bytes:
            row.failures.append(f"build peak RSS {(row.peak_rss_bytes or 0) / 2**30:.1f} GiB > {bound.max_peak_rss_bytes / 2**30:g} GiB")
    ratio = profile.limit("compiled.max_ratio")
    if ratio is not None and row.compiled_ratio is not None and row.compiled_ratio > ratio:
        row.failures.append(f"compiled {row.compiled_bytes:,} B = {row.compiled_ratio:.1f}x the graph's constants > {ratio:g}x")
    row.status = "fail" if row.failures else "pass"
    return row


__all__ = ["BOUNDS", "Bound", "CheckRow", "check_target", "run_worker", "toolchain_available", "toolchain_python"]
