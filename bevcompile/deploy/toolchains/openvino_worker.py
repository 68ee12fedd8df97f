"""OpenVINO worker (runs in the openvino toolchain venv; imports numpy and openvino only).

``python openvino_worker.py SPEC.json`` — SPEC: ``onnx``, ``inputs`` (.npz), ``input_names``,
``out_dir``, ``config`` (compile properties, e.g. ``{"INFERENCE_PRECISION_HINT": "f32"}``).
Writes ``out_dir/result.json`` (the runtime precision of every executed layer, the compile and
inference times, the peak RSS) and ``out_dir/output.npy``. With ``models`` (ONNX files) instead of
``onnx``: their interleaved latency (:func:`latency`, ``repeat`` timed rounds after ``warmup``).
"""

import os
import time

import numpy as np
from _worker_io import finish, read_spec


def latency(spec: dict) -> None:
    """``spec["models"]``: ONNX files timed INTERLEAVED (one run of each per round, ``repeat`` rounds after
    ``warmup``), so a machine whose load changes during the run weighs on every model alike; writes
    ``latency_ms`` (the median per model) to ``out_dir/result.json``."""
    import openvino as ov

    out_dir = spec["out_dir"]
    t0 = time.time()
    result: dict = {"stage": "start"}
    try:
        core = ov.Core()
        feeds = np.load(spec["inputs"])
        inputs = {name: feeds[name] for name in spec["input_names"]}
        requests = [core.compile_model(core.read_model(path), "CPU", spec.get("config", {})).create_infer_request() for path in spec["models"]]
        for _ in range(int(spec.get("warmup", 5))):
            for request in requests:
                request.infer(inputs)
        times: list[list[float]] = [[] for _ in requests]
        for _ in range(int(spec["repeat"])):
            for i, request in enumerate(requests):
                t = time.perf_counter()
                request.infer(inputs)
                times[i].append(time.perf_counter() - t)
        result["latency_ms"] = [float(np.median(t) * 1e3) for t in times]
        result["stage"] = "done"
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
    finish(result, out_dir, t0)


def main() -> None:
    spec = read_spec()
    if "models" in spec:
        latency(spec)
        return
    out_dir = spec["out_dir"]
    result: dict = {"stage": "start"}
    t0 = time.time()
    try:
        import openvino as ov

        core = ov.Core()
        result["version"] = ov.get_version()
        model = core.read_model(spec["onnx"])
        compiled = core.compile_model(model, "CPU", spec.get("config", {}))
        result["compile_seconds"] = time.time() - t0
        result["inference_precision"] = str(compiled.get_property("INFERENCE_PRECISION_HINT"))
        feeds = np.load(spec["inputs"])
        request = compiled.create_infer_request()
        t1 = time.time()
        outputs = request.infer({name: feeds[name] for name in spec["input_names"]})
        result["infer_seconds"] = time.time() - t1
        out = next(iter(outputs.values()))
        np.save(os.path.join(out_dir, "output.npy"), np.asarray(out, np.float32))
        layers = []
        for op in compiled.get_runtime_model().get_ordered_ops():
            info = op.get_rt_info()
            kind = info["layerType"].astype(str) if "layerType" in info else op.get_type_name()
            precision = info["runtimePrecision"].astype(str) if "runtimePrecision" in info else "?"
            layers.append({"op": kind, "precision": precision})
        result["layers"] = layers
        result["stage"] = "done"
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
    finish(result, out_dir, t0)


if __name__ == "__main__":
    main()
