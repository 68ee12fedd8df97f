"""LiteRT worker (runs in the litert toolchain venv; imports numpy, onnx2tf and ai_edge_litert only).

``python litert_worker.py SPEC.json`` — SPEC: ``onnx``, ``inputs`` (.npz), ``input_names``,
``out_dir``, ``quantize`` (bool), ``calibration`` (input name -> stacked samples .npy of the
calibration set). Converts with onnx2tf (input shapes kept as in the ONNX file), float32 or full
integer quantisation with the calibration samples (``*_integer_quant.tflite``: int8 inside, float
in/out), runs it with the LiteRT interpreter, and writes ``out_dir/result.json`` (every op with its
output dtype, the .tflite size, times, peak RSS) and ``out_dir/output.npy``.
"""

import os
import time

import numpy as np
from _worker_io import captured, finish, read_spec


def main() -> None:
    spec = read_spec()
    out_dir = spec["out_dir"]
    result: dict = {"stage": "start", "quantize": bool(spec.get("quantize"))}
    t0 = time.time()
    with captured(os.path.join(out_dir, "onnx2tf.log")):
        _convert_and_run(spec, out_dir, result, t0)
    finish(result, out_dir, t0)


def _convert_and_run(spec: dict, out_dir: str, result: dict, t0: float) -> None:
    try:
        import onnx2tf

        stem = os.path.splitext(os.path.basename(spec["onnx"]))[0]
        tf_dir = os.path.join(out_dir, "tflite")
        kwargs = {"keep_shape_absolutely_input_names": list(spec["input_names"]), "non_verbose": True}
        if spec.get("quantize"):
            calib = []
            for name in spec["input_names"]:
                stacked = np.load(spec["calibration"][name])
                path = os.path.join(out_dir, f"calib_{name}.npy")
                np.save(path, stacked.reshape(-1, *stacked.shape[2:]).astype(np.float32))
                calib.append([name, path, np.zeros(1, np.float32), np.ones(1, np.float32)])
            kwargs.update(output_integer_quantized_tflite=True, custom_input_op_name_np_data_path=calib)
        onnx2tf.convert(input_onnx_file_path=spec["onnx"], output_folder_path=tf_dir, **kwargs)
        result["convert_seconds"] = time.time() - t0
        model = os.path.join(tf_dir, f"{stem}_integer_quant.tflite" if spec.get("quantize") else f"{stem}_float32.tflite")
        result["tflite"] = os.path.basename(model)
        result["tflite_bytes"] = os.path.getsize(model)
        from ai_edge_litert.interpreter import Interpreter

        interpreter = Interpreter(model_path=model)
        interpreter.allocate_tensors()
        feeds = np.load(spec["inputs"])
        details = interpreter.get_input_details()
        for detail in details:
            name = next(n for n in spec["input_names"] if n in detail["name"])
            value = feeds[name]
            if detail["dtype"] == np.int8:
                scale, zero = detail["quantization"]
                value = np.clip(np.round(value / scale + zero), -128, 127).astype(np.int8)
            interpreter.set_tensor(detail["index"], value)
        t1 = time.time()
        interpreter.invoke()
        result["infer_seconds"] = time.time() - t1
        out = interpreter.get_output_details()[0]
        y = interpreter.get_tensor(out["index"])
        if out["dtype"] == np.int8:
            scale, zero = out["quantization"]
            y = (y.astype(np.float32) - zero) * scale
        np.save(os.path.join(out_dir, "output.npy"), np.asarray(y, np.float32))
        tensors = {t["index"]: t for t in interpreter.get_tensor_details()}
        result["layers"] = [
            {"op": op["op_name"], "dtype": np.dtype(tensors[op["outputs"][0]]["dtype"]).name if len(op["outputs"]) else "?"}
            for op in interpreter._get_ops_details()
        ]
        result["stage"] = "done"
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"


if __name__ == "__main__":
    main()
