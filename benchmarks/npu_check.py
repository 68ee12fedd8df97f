"""Every NPU target x product x precision, built and run on the real toolchains (``make npu-check``).

Usage::

    .venv/bin/python benchmarks/npu_check.py                      # everything (about an hour on 2 cores)
    .venv/bin/python benchmarks/npu_check.py --targets rk3588 --stores nuscenes-ray
    .venv/bin/python benchmarks/npu_check.py --table              # print docs/deploy.md's table from the result file

Stores (built with the CLI in a temporary folder; matrices ``--topk 24 --align 16 --tile-rows 256
--quantize int8``): ``nuscenes-ray``, ``nuscenes-grid``, ``nuscenes-frustum`` (configs/nuscenes.yaml,
``--mode ray|grid|frustum``; ``gather`` is exported from the ray store's grid/), ``dense-6cam``
(configs/dense-6cam.yaml, ray mode) and ``dense-6cam-region`` (configs/dense-6cam-region.yaml, ray,
rows dense and compact). Each row: ``bevcompile.deploy.toolchains.harness.check_target`` (C = 64,
seed 0) — the export, the toolchain's build and run in its own venv (``make npu-envs-all``), every
limit / fallback line counted as a failure, the output against the numpy references. Results in
``benchmarks/results/npu_check.json`` (written after every row).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import CONFIGS, ROOT, bevcompile, machine, markdown_table

RESULTS = ROOT / "benchmarks" / "results" / "npu_check.json"
MATRIX = ["--topk", "24", "--align", "16", "--tile-rows", "256", "--quantize", "int8", "--quiet"]
CALIBRATION_SAMPLES = {"dense-6cam": 2, "dense-6cam-region": 2}
"""Seeded calibration samples of the int8 rows (8 by default): a dense-6cam sample is 354 MB of features,
and onnx2tf's quantiser holds several copies (8 samples: 14 GB)."""
STORES = {  # name -> (config, matrix mode, products, rows)
    "nuscenes-ray": ("nuscenes.yaml", "ray", ("gather", "ell", "tiles"), ("dense",)),
    "nuscenes-grid": ("nuscenes.yaml", "grid", ("ell", "tiles"), ("dense",)),
    "nuscenes-frustum": ("nuscenes.yaml", "frustum", ("ell", "tiles"), ("dense",)),
    "dense-6cam": ("dense-6cam.yaml", "ray", ("gather", "ell"), ("dense",)),
    "dense-6cam-region": ("dense-6cam-region.yaml", "ray", ("ell",), ("dense", "compact")),
}
TARGETS = {  # name -> (float weights, int8 weights)
    "rk3588": ("float16", "int8"),
    "rk3568": ("float16", "int8"),
    "rv1106": (None, "int8"),
    "openvino": ("float32", "int8-qdq"),
    "litert": ("float32", "int8"),
}


def build_store(name: str, folder: Path) -> Path:
    config, mode, _, _ = STORES[name]
    out = folder / name
    bevcompile("grid", str(CONFIGS / config), "--out", str(out), "--quiet").check(f"grid {name}")
    bevcompile("matrix", str(CONFIGS / config), "--out", str(out), "--mode", mode, *MATRIX).check(f"matrix {name}")
    return next(out.glob("*.zarr"))


def run(args: argparse.Namespace) -> None:
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    from bevcompile.deploy.toolchains.harness import check_target

    jobs = []
    for store in args.stores:
        _, _, products, rows_options = STORES[store]
        for target in args.targets:
            for weights in TARGETS[target]:
                if weights is None or (args.precision and ("int8" in weights) != (args.precision == "int8")):
                    continue
                for product in products:
                    if args.products and product not in args.products:
                        continue
                    if product == "gather" and weights.startswith("int8"):
                        continue
                    for rows in rows_options:
                        jobs.append((store, target, product, weights, rows))
    previous = json.loads(RESULTS.read_text()) if RESULTS.is_file() and args.merge else {"rows": []}
    done = {(r["store"], r["target"], r["product"], r["weights"], r.get("rows", "dense")): r for r in previous["rows"]}
    with tempfile.TemporaryDirectory(prefix="npu-check-") as tmp:
        folder = Path(tmp)
        stores = {name: build_store(name, folder) for name in args.stores}
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("rows"), TimeElapsedColumn(), TimeRemainingColumn())
        with Progress(*columns, transient=False) as progress:
            task = progress.add_task("npu-check", total=len(jobs))
            for store, target, product, weights, rows in jobs:
                progress.update(task, description=f"{target} {store} {product} {weights} {rows}")
                started = time.perf_counter()
                row = check_target(stores[store], product, target, weights, folder / "work" / f"{store}-{target}-{product}-{weights}-{rows}", rows=rows, label=store,
                                   calibration_samples=CALIBRATION_SAMPLES.get(store, 8))
                entry = row.to_json()
                entry["rows"] = rows
                entry["seconds"] = round(time.perf_counter() - started, 1)
                done[(store, target, product, weights, rows)] = entry
                RESULTS.parent.mkdir(parents=True, exist_ok=True)
                RESULTS.write_text(json.dumps({"machine": machine(), "rows": list(done.values())}, indent=1) + "\n")
                progress.console.print(f"{entry['status']:8s} {target:8s} {store:18s} {product:6s} {weights:9s} {rows:8s} {entry['form'] or '-':8s} "
                                       + ("; ".join(entry["failures"])[:200] or entry["refusal"][:200]))
                progress.advance(task)


def _num(value: Any, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def table(path: Path = RESULTS) -> str:
    """docs/deploy.md's table from the result file."""
    data = json.loads(path.read_text())
    header = ["target", "store", "product", "weights", "rows", "form", "status", "build s / RSS GiB", "compiled / constants", "CPU layers, limit lines", "max abs", "PSNR dB"]
    out = []
    for r in data["rows"]:
        build = "-" if r.get("build_seconds") is None else f"{r['build_seconds']:.0f} / {(r.get('peak_rss_bytes') or 0) / 2**30:.2f}"
        ratio = "-" if r.get("compiled_ratio") is None else f"{r['compiled_bytes'] / 2**20:.1f} MiB / {r['constant_bytes'] / 2**20:.1f} MiB"
        status = r["status"] if r["status"] != "refused" else "refused (exit 2)"
        out.append([
            r["target"], r["store"], r["product"], r["weights"], r.get("rows", "dense"), r.get("form") or "-", status, build, ratio,
            f"{len(r.get('cpu_layers', []))}, {r.get('limit_lines', 0)}", _num(r.get("max_abs_same"), ".2g"), _num(r.get("psnr_db"), ".1f"),
        ])
    return f"Measured on {data['machine']}.\n\n" + markdown_table(header, out, right=(7, 8, 9, 10, 11))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", nargs="+", default=list(TARGETS), choices=list(TARGETS))
    parser.add_argument("--stores", nargs="+", default=list(STORES), choices=list(STORES))
    parser.add_argument("--precision", choices=["float", "int8"], default=None, help="only the float or only the int8 rows")
    parser.add_argument("--products", nargs="+", default=None, choices=["gather", "ell", "tiles"], help="only these products")
    parser.add_argument("--merge", action="store_true", help="keep the rows of the result file that this run does not redo")
    parser.add_argument("--table", action="store_true", help="print the markdown table of the result file and exit")
    args = parser.parse_args(argv)
    if args.table:
        print(table())
        return 0
    run(args)
    print(table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
