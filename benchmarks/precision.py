"""Where the deployed lift loses precision: int8, fp16 and mixed products per distance band, their
bytes, and what the NaN guard costs in a graph.

For each rig (the bundled ``nuscenes`` rig and ``configs/dense-6cam.yaml``) it builds the frustum
matrix ``--topk 24 --align 16`` (bilinear, ``--normalize sum``) with ``--quantize fp16`` and with
``--quantize mixed`` under three ``--fp16-rows`` rules (``beyond:35``, ``snr:55``, ``fraction:0.25``),
then measures with ``bevcompile verify --map``'s code (:func:`bevcompile.report.precision.precision_map`:
seed 0, 8 channels, bands 0-20 / 20-35 / 35-50 / >= 50 m) the SNR (dB, energy over the band's cells)
of the ELL forms against the store's matrix in float64, and reports the bytes a deployed graph holds
(``product_bytes``: ``ell`` float32, ``ell_int8``, ``ell_fp16``, ``ell_mixed``).

Guard cost (nuScenes, ``--guard-repeat`` interleaved onnxruntime runs, CPU, one thread, batch 1,
64 channels): ``MatrixLift`` (ELL, frustum) and ``GridGather`` (sum over cameras and heights) exported
by torch's legacy exporter with and without ``guard=True``: node counts and the median run time.

Usage::

    .venv/bin/python benchmarks/precision.py                 # ~2 min on a quiet 2-core machine
    .venv/bin/python benchmarks/precision.py --rigs nuscenes

Prints the markdown tables of docs/matrix.md ("Reduced precision") and docs/deploy.md ("Guard") and
writes ``benchmarks/results/precision.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results"
RIGS = {"nuscenes": None, "dense-6cam": ROOT / "configs" / "dense-6cam.yaml"}
VARIANTS: list[tuple[str, str | None]] = [("fp16", None), ("mixed", "beyond:35"), ("mixed", "snr:55"), ("mixed", "fraction:0.25")]
FORMS = ("matrix/ell", "matrix/ell_int8", "matrix/ell_fp16", "matrix/ell_mixed")


def measure_rig(name: str, jobs: int) -> list[dict[str, Any]]:
    from bevcompile.matrix.build import MatrixOptions, run_matrix
    from bevcompile.report.precision import precision_map
    from bevcompile.rig.config import load_config

    rig = load_config(RIGS[name])
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for quantize, rule in VARIANTS:
            options = MatrixOptions.from_command(topk=24, align=16, quantize=quantize, fp16_rows=rule)
            result = run_matrix(rig, tmp, options, force=True, jobs=jobs)
            pmap = precision_map(result.store, forms=[f for f in FORMS])
            nbytes = result.products.figures.product_bytes
            with_entries = int(np.count_nonzero(np.bincount(result.products.coo_row, minlength=result.products.n_rows)))
            for form in pmap.forms:
                if quantize == "mixed" and form.name in ("matrix/ell",):
                    continue  # measured once, with the fp16 build
                if rule not in (None, "beyond:35") and form.name == "matrix/ell_int8":
                    continue  # the same int8 values in every mixed store
                product = form.name.removeprefix("matrix/")
                rows.append({
                    "rig": name,
                    "product": product,
                    "rule": rule if product == "ell_mixed" else None,
                    "fp16_rows": (result.products.figures.n_fp16_rows if product == "ell_mixed" else with_entries if product == "ell_fp16" else 0),
                    "rows_with_entries": with_entries,
                    "bytes": int(nbytes[product]),
                    "bands_m": list(pmap.bands_m),
                    "band_snr_db": [b.snr_db for b in form.bands],
                    "band_p05_db": [b.p05_db for b in form.bands],
                    "all_snr_db": form.overall.snr_db,
                })
    order = {"ell": 0, "ell_int8": 1, "ell_fp16": 2, "ell_mixed": 3}
    return sorted(rows, key=lambda r: (order[r["product"]], r["rule"] or ""))


def guard_cost(repeat: int) -> list[dict[str, Any]]:
    import onnx
    import onnxruntime as ort
    import torch

    from bevcompile.deploy.onnx_graph import scan_graph
    from bevcompile.grid.build import run_grid
    from bevcompile.matrix.build import MatrixOptions, run_matrix
    from bevcompile.rig.config import load_config
    from bevcompile.torch import GridGather, MatrixLift

    rig = load_config(None)
    w_f, h_f = rig.feature_size
    g = torch.Generator().manual_seed(0)
    features = torch.rand(1, rig.n_cam, 64, h_f, w_f, generator=g)
    depth = torch.softmax(torch.randn(1, rig.n_cam, rig.depth.n_bins, h_f, w_f, generator=g), dim=2)
    out: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        store = run_grid(rig, tmp, npu=True).store
        run_matrix(rig, tmp, MatrixOptions(topk=24, align=16))
        cases = {
            "MatrixLift (ELL, frustum)": (lambda guard: MatrixLift(store, guard=guard), (features, depth), ["features", "depth"]),
            "GridGather (sum)": (lambda guard: GridGather(store, guard=guard, collapse_heights=True), (features,), ["features"]),
        }
        for label, (make, args, names) in cases.items():
            sessions = {}
            for guard in (False, True):
                path = Path(tmp) / f"{label[:4]}-{guard}.onnx"
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    torch.onnx.export(make(guard), args, str(path), dynamo=False, opset_version=17, input_names=names, output_names=["bev"])
                options = ort.SessionOptions()
                options.intra_op_num_threads = 1
                options.inter_op_num_threads = 1
                sessions[guard] = (scan_graph(onnx.load(str(path))), ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"]))
            feeds = {n: a.numpy() for n, a in zip(names, args, strict=True)}
            times: dict[bool, list[float]] = {False: [], True: []}
            for _ in range(3):  # warm-up
                for guard in (False, True):
                    sessions[guard][1].run(None, feeds)
            for _ in range(repeat):
                for guard in (False, True):
                    t0 = time.perf_counter()
                    sessions[guard][1].run(None, feeds)
                    times[guard].append(time.perf_counter() - t0)
            plain, guarded = (statistics.median(times[k]) for k in (False, True))
            out.append({
                "module": label,
                "nodes": sessions[False][0].n_nodes,
                "nodes_guarded": sessions[True][0].n_nodes,
                "added_ops": {k: v - sessions[False][0].op_histogram.get(k, 0) for k, v in sessions[True][0].op_histogram.items() if v != sessions[False][0].op_histogram.get(k, 0)},
                "median_ms": 1e3 * plain,
                "median_ms_guarded": 1e3 * guarded,
                "ratio": guarded / plain,
            })
    return out


def _db(values: list[float]) -> str:
    return " / ".join(f"{v:.1f}" for v in values)


def _bytes(n: int) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:,.0f} KiB"


def tables(rows: list[dict[str, Any]], guard: list[dict[str, Any]]) -> str:
    """The markdown tables of docs/matrix.md and docs/deploy.md."""
    out = [
        "| rig | product | --fp16-rows | fp16 rows | bytes (x float32 ELL) | SNR dB 0-20 / 20-35 / 35-50 / >= 50 m | all cells |",
        "|---|---|---|---:|---:|---|---:|",
    ]
    for r in rows:
        ell = next(x["bytes"] for x in rows if x["rig"] == r["rig"] and x["product"] == "ell")
        share = f"{r['fp16_rows']:,} ({100 * r['fp16_rows'] / r['rows_with_entries']:.0f} %)" if r["fp16_rows"] else "0"
        out.append(f"| {r['rig']} | {r['product']} | {r['rule'] or '-'} | {share} | {_bytes(r['bytes'])} ({r['bytes'] / ell:.2f}) | {_db(r['band_snr_db'])} | {r['all_snr_db']:.1f} |")
    if guard:
        out += ["", "| module (nuScenes, 64 channels) | nodes | guarded | added ops | onnxruntime ms | guarded ms | ratio |", "|---|---:|---:|---|---:|---:|---:|"]
        for g in guard:
            added = ", ".join(f"{k} +{v}" for k, v in sorted(g["added_ops"].items()))
            out.append(f"| {g['module']} | {g['nodes']} | {g['nodes_guarded']} | {added} | {g['median_ms']:.2f} | {g['median_ms_guarded']:.2f} | {g['ratio']:.3f} |")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rigs", default="nuscenes,dense-6cam")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--guard-repeat", type=int, default=30)
    parser.add_argument("--print", action="store_true", help="only print the tables of benchmarks/results/precision.json")
    args = parser.parse_args()
    if args.print:
        data = json.loads((RESULTS / "precision.json").read_text())
        print(tables(data["products"], data["guard"]))
        return
    rows: list[dict[str, Any]] = []
    for name in args.rigs.split(","):
        rows += measure_rig(name.strip(), args.jobs)
    guard = guard_cost(args.guard_repeat) if "nuscenes" in args.rigs else []
    print(tables(rows, guard))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "precision.json").write_text(json.dumps({"products": rows, "guard": guard}, indent=1) + "\n")
    print(f"\nwrote {RESULTS / 'precision.json'}")


if __name__ == "__main__":
    main()
