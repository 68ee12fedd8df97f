"""Every ``bevcompile export-onnx`` product on the bundled rig: the tables of ``docs/deploy.md``.

Usage::

    .venv/bin/python benchmarks/onnx_exports.py            # ~25 exports, 5-15 min on 2 cores
    .venv/bin/python benchmarks/onnx_exports.py --quick    # float32 + legacy only (a smoke run)

The stores are built with the CLI in a temporary folder from ``configs/nuscenes.yaml``:

* ``bev`` — ``grid`` (the default gather layout ``bev``) + ``matrix --topk 24 --align 16 --quantize
  int8 --tile-rows 256`` (frustum mode; ``--tile-rows`` so that ``tiles`` exists);
* ``flat`` — ``grid --align 32`` (the gather layout ``flat`` of the README's typical session);
* ``gridmode`` — ``grid`` + the same matrix with ``--mode grid``.

Each export is ``bevcompile export-onnx STORE --product P --weights W --exporter E --json`` (C = 64,
N = 1, seed 0, opset 17) in a fresh process: the figures are the command's own JSON report (graph,
checks, sizes) and the process's wall time, CPU time and peak RSS. The ``int8-qdq`` graphs are also
run against the ``int8`` graphs on one seeded input, in a default onnxruntime session (reported,
see ``docs/deploy.md`` (d)) and with every graph optimisation disabled.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from _common import CONFIGS, ProcessCost, bevcompile, machine, markdown_table

CONFIG = str(CONFIGS / "nuscenes.yaml")
MATRIX = ["--topk", "24", "--align", "16", "--quantize", "int8", "--tile-rows", "256"]
PRODUCTS = [  # (label, store, product)
    ("gather (layout `bev`: `grid`)", "bev", "gather"),
    ("gather (layout `flat`: `grid --align 32`)", "flat", "gather"),
    ("ell (frustum)", "bev", "ell"),
    ("tiles (frustum)", "bev", "tiles"),
    ("ell (grid)", "gridmode", "ell"),
    ("tiles (grid)", "gridmode", "tiles"),
]
QUANTISED = [  # (label, store, product, weights)
    ("gather", "bev", "gather", "lut"),
    ("ell (frustum)", "bev", "ell", "int8"),
    ("tiles (frustum)", "bev", "tiles", "int8"),
    ("ell (grid)", "gridmode", "ell", "int8"),
    ("tiles (grid)", "gridmode", "tiles", "int8"),
    ("ell (frustum)", "bev", "ell", "int8-qdq"),
    ("tiles (frustum)", "bev", "tiles", "int8-qdq"),
    ("ell (grid)", "gridmode", "ell", "int8-qdq"),
    ("tiles (grid)", "gridmode", "tiles", "int8-qdq"),
]


def build_stores(tmp: Path) -> dict[str, str]:
    stores = {}
    for name, grid_args, matrix_args in (
        ("bev", [], MATRIX),
        ("flat", ["--align", "32"], None),
        ("gridmode", [], ["--mode", "grid", *MATRIX]),
    ):
        out = str(tmp / name)
        bevcompile("grid", CONFIG, "--out", out, *grid_args, "--quiet")
        if matrix_args is not None:
            bevcompile("matrix", CONFIG, "--out", out, *matrix_args, "--quiet")
        stores[name] = str(tmp / name / "nuscenes.zarr")
    return stores


def export(store: str, product: str, weights: str, exporter: str, out: Path) -> tuple[dict[str, Any], ProcessCost]:
    cost = bevcompile("export-onnx", store, "--product", product, "--weights", weights, "--exporter", exporter, "--out", str(out), "--json")
    return json.loads(cost.stdout), cost


def _ops(histogram: dict[str, int]) -> str:
    ordered = sorted(histogram.items(), key=lambda kv: (kv[0] == "Constant", -kv[1], kv[0]))
    return ", ".join(f"{op} {n}" for op, n in ordered)


def _ops_added(histogram: dict[str, int], float_histogram: dict[str, int]) -> str:
    added = {op: n - float_histogram.get(op, 0) for op, n in histogram.items() if op != "Constant" and n > float_histogram.get(op, 0)}
    text = ", ".join(f"{op} {n}" for op, n in sorted(added.items()))
    return ("+ " + text) if text else "none"


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB" if n < 100 * 2**20 else f"{n / 2**20:.1f} MiB"


def _cost(cost: ProcessCost) -> str:
    return f"{cost.wall_s:.1f} s / {cost.cpu_s:.1f} s / {cost.peak_rss_bytes / 1e9:.2f} GB"


def _inputs(report: dict[str, Any]) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    feeds = {"features": rng.random(report["inputs"]["features"], dtype=np.float32)}
    if "depth" in report["inputs"]:
        logits = rng.standard_normal(report["inputs"]["depth"]).astype(np.float32)
        e = np.exp(logits - logits.max(axis=2, keepdims=True))
        feeds["depth"] = (e / e.sum(axis=2, keepdims=True)).astype(np.float32)
    return feeds


def _run(path: Path, feeds: dict[str, np.ndarray], config: dict[str, str] | None = None, disable_all: bool = False) -> np.ndarray:
    import onnxruntime as ort

    options = ort.SessionOptions()
    for key, value in (config or {}).items():
        options.add_session_config_entry(key, value)
    if disable_all:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return np.asarray(session.run(None, feeds)[0], dtype=np.float64)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="float32 exports with the legacy exporter only")
    args = parser.parse_args(argv)
    load_at_start = machine()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        stores = build_stores(tmp)
        float_rows, float_reports = [], {}
        for label, store, product in PRODUCTS:
            report, cost = export(stores[store], product, "float32", "legacy", tmp / "f.onnx")
            float_reports[(store, product)] = report
            dynamo = "" if args.quick else f"{export(stores[store], product, 'float32', 'dynamo', tmp / 'd.onnx')[0]['export_seconds']:.1f} s"
            g = report["graph"]
            float_rows.append([
                label,
                str(g["n_nodes"]),
                _ops(g["op_histogram"]),
                _mib(report["file_bytes"]),
                f"{report['max_abs_vs_reference']:.2g}",
                f"{report['export_seconds']:.1f} s / {dynamo}",
                _cost(cost),
            ])
        print(f"<!-- float32 exports (measured on {load_at_start}) -->")
        print(markdown_table(
            ["product (mode)", "nodes", "ops (legacy exporter)", "file", "max abs vs reference", "export: legacy / dynamo", "whole command: wall / CPU / peak RSS"],
            float_rows,
            right=(1, 3, 4, 5, 6),
        ))
        print()
        if args.quick:
            return 0

        quant_rows, default_rows, qdq_rows, cost_rows = [], [], [], []
        files: dict[tuple[str, str, str], Path] = {}
        reports: dict[tuple[str, str, str], dict[str, Any]] = {}
        for label, store, product, weights in QUANTISED:
            path = tmp / f"{store}-{product}-{weights}.onnx"
            report, cost = export(stores[store], product, weights, "legacy", path)
            files[(store, product, weights)] = path
            reports[(store, product, weights)] = report
            g, ref, f32 = report["graph"], report["float_reference"], report["float32_export"]
            float_histogram = float_reports[(store, product)]["graph"]["op_histogram"]
            quant_rows.append([
                label,
                f"`{weights}`",
                str(g["n_nodes"]),
                _ops_added(g["op_histogram"], float_histogram),
                f"{report['max_abs_vs_reference']:.2g}",
                f"{ref['max_abs']:.2g} / {ref['mean_abs']:.2g}",
                f"{ref['psnr_db']:.1f} dB",
                f"{_mib(f32['file_bytes'])} → {_mib(report['file_bytes'])}",
                f"{100 * report['constant_bytes_vs_float32']:.1f} %",
            ])
            cost_rows.append([f"`--product {product} --weights {weights}`" + (" (grid mode)" if store == "gridmode" else ""), "legacy", _cost(cost)])
            if weights == "int8-qdq":
                d = report["onnxruntime_default"]
                default_rows.append([
                    label,
                    f"{ref['psnr_db']:.1f} dB",
                    f"{d['max_abs_vs_reference']:.2g}",
                    f"{d['float_reference']['max_abs']:.2g} / {d['float_reference']['mean_abs']:.2g}",
                    f"{d['float_reference']['psnr_db']:.1f} dB",
                ])
                feeds = _inputs(report)
                check = {"session.qdq_matmulnbits_accuracy_level": "1"}
                qdq = _run(path, feeds, check)
                int8 = _run(files[(store, product, "int8")], feeds)
                bitwise = np.array_equal(qdq, _run(path, feeds, check, disable_all=True))
                qdq_rows.append([label, f"{np.abs(qdq - int8).max():.2g}", "yes" if bitwise else "no", _mib(reports[(store, product, "int8")]["file_bytes"]), _mib(report["file_bytes"])])
        for store, product, weights in (("bev", "ell", "int8-qdq"), ("bev", "tiles", "int8-qdq")):
            report, cost = export(stores[store], product, weights, "dynamo", tmp / "d.onnx")
            cost_rows.append([f"`--product {product} --weights {weights}`", f"dynamo ({_mib(report['file_bytes'])} file)", _cost(cost)])

        print(f"<!-- quantised exports (measured on {load_at_start}) -->")
        print(markdown_table(
            ["product (mode)", "`--weights`", "nodes", "ops added to the float graph (Constant nodes aside)", "vs same-weights ref. (max abs)",
             "vs float reference: max abs / mean abs", "PSNR", "file (float32 → quantised)", "constants vs float32"],
            quant_rows,
            right=(2, 4, 5, 6, 7, 8),
        ))
        print()
        print("<!-- int8-qdq against int8 (one seeded input) -->")
        print(markdown_table(
            ["product (mode)", "max abs, int8-qdq vs int8 graph", "check session = no graph optimisation, bit for bit", "int8 file", "int8-qdq file"],
            qdq_rows,
            right=(1, 3, 4),
        ))
        print()
        print("<!-- int8-qdq in a default onnxruntime session -->")
        print(markdown_table(
            ["product (mode)", "check session PSNR", "default session: vs same-weights ref.", "vs float reference: max abs / mean abs", "PSNR"],
            default_rows,
            right=(1, 2, 3, 4),
        ))
        print()
        print(f"<!-- export costs (measured on {load_at_start}) -->")
        print(markdown_table(["command (bundled rig, C = 64)", "exporter", "wall / CPU / peak RSS"], cost_rows, right=(2,)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
