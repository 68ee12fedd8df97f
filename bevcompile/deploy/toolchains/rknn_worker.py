"""RKNN-Toolkit2 worker (runs in the rknn toolchain venv; imports numpy and rknn only).

``python rknn_worker.py SPEC.json`` — SPEC: ``onnx``, ``platform`` (rk3588 ...), ``quantize`` (bool),
``dataset`` (RKNN dataset.txt, quantize only), ``inputs`` (.npz), ``input_names``, ``out_dir``,
``simulate`` (bool). Writes ``out_dir/result.json``: every stage's return code, the build log's
counts (limit errors, CPU fallbacks), the Network Layer Information Table (op, dtype, NPU/CPU),
the .rknn size, the build's peak RSS, and ``out_dir/output.npy`` (the x86 simulator's output).
"""

import os
import re
import time

import numpy as np
from _worker_io import captured, finish, read_spec

LIMIT_PATTERNS = (r"exceed", r"> limitations", r"too large", r"limit")
"""A limit line: any REGTASK line, or an error/warning line (E or W level) naming a limit. Debug lines
that say the compiler TILED a step to stay within a limit ('Transpose will add tile step ...') are not."""
FALLBACK_PATTERNS = (r"fallback", r"fall back")
LEVEL = re.compile(r"^(\x1b\[[0-9;]*m)?([EW])\b")


def is_limit_line(line: str) -> bool:
    if "REGTASK" in line:
        return True
    return bool(LEVEL.match(line)) and any(re.search(p, line, re.I) for p in LIMIT_PATTERNS)


LAYER = re.compile(r"RKNN: \[[\d:.]+\] (\d+)\s+(\w+)\s+(\w+)\s+(CPU|NPU)\s+(\S+)\s+(\S+)")


def main() -> None:
    spec = read_spec()
    out_dir = spec["out_dir"]
    log_path = os.path.join(out_dir, "rknn.log")
    result: dict = {"stage": "start", "platform": spec["platform"], "quantize": bool(spec.get("quantize"))}
    t0 = time.time()
    with captured(log_path):
        _build(spec, out_dir, result, t0)
    with open(log_path, errors="replace") as fh:
        _report(result, fh.read(), out_dir, t0)


def _build(spec: dict, out_dir: str, result: dict, t0: float) -> None:
    try:
        from rknn.api import RKNN

        rknn = RKNN(verbose=True)
        rknn.config(target_platform=spec["platform"], **spec.get("config", {}))
        result["load"] = rknn.load_onnx(spec["onnx"])
        if result["load"] != 0:
            raise RuntimeError("load_onnx failed")
        cwd = os.getcwd()
        if spec.get("dataset"):
            os.chdir(os.path.dirname(os.path.abspath(spec["dataset"])))  # dataset.txt paths are relative to it
        try:
            result["build"] = rknn.build(do_quantization=bool(spec.get("quantize")), dataset=spec.get("dataset") if spec.get("quantize") else None)
        finally:
            os.chdir(cwd)
        result["build_seconds"] = time.time() - t0
        if result["build"] != 0:
            raise RuntimeError("build failed")
        path = os.path.join(out_dir, "model.rknn")
        result["export"] = rknn.export_rknn(path)
        result["rknn_bytes"] = os.path.getsize(path) if os.path.exists(path) else None
        if spec.get("simulate", True):
            result["init_runtime"] = rknn.init_runtime()
            feeds = np.load(spec["inputs"])
            t1 = time.time()
            outputs = rknn.inference(inputs=[feeds[name] for name in spec["input_names"]], data_format="nchw")
            result["simulate_seconds"] = time.time() - t1
            np.save(os.path.join(out_dir, "output.npy"), np.asarray(outputs[0], np.float32))
        rknn.release()
        if spec.get("keep_rknn") is not True and os.path.exists(path):
            os.unlink(path)
        result["stage"] = "done"
    except Exception as exc:  # the harness reports it as the row's failure
        result["error"] = f"{type(exc).__name__}: {exc}"


def _report(result: dict, text: str, out_dir: str, t0: float) -> None:
    lines = text.splitlines()
    limit_lines = [line for line in lines if is_limit_line(line)]
    result["limit_lines"] = [line[:300] for line in limit_lines[:20]]
    result["n_limit_lines"] = len(limit_lines)
    result["n_fallback_lines"] = sum(1 for line in lines if any(re.search(p, line, re.I) for p in FALLBACK_PATTERNS))
    result["error_lines"] = [line[:300] for line in lines if re.match(r"^(\x1b\[[0-9;]*m)?E\b", line)][:20]
    result["layers"] = [
        {"id": int(m[1]), "op": m[2], "dtype": m[3], "target": m[4], "inputs": m[5], "outputs": m[6]}
        for m in (LAYER.search(line) for line in lines)
        if m
    ]
    finish(result, out_dir, t0)


if __name__ == "__main__":
    main()
