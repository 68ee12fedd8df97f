"""Latency of every exported lift against the GridSample it replaces, in the same process.

Usage::

    .venv/bin/python benchmarks/deploy_latency.py                 # nuScenes and dense-6cam, C = 64 and 256
    .venv/bin/python benchmarks/deploy_latency.py --rigs nuscenes --channels 64 --repeat 30
    .venv/bin/python benchmarks/deploy_latency.py --table          # docs/deploy.md's tables from the result file

Stores (built with the CLI in a temporary folder): ``configs/nuscenes.yaml`` and
``configs/dense-6cam.yaml``, ``grid`` + ``matrix --mode ray --topk 24 --align 16 --tile-rows 256``.

Every graph takes the same seeded features ``(1, n_cam, C, H_f, W_f)``:

* ``GridSample`` — the baseline: ``torch.nn.functional.grid_sample`` (bilinear, zeros, the store's
  ``align_corners``) of every camera on ``grid/norm``, summed, exported with ``torch.onnx.export``
  (legacy) exactly as the products are;
* ``generic``: today's graphs (``export-onnx --target generic``: the torch modules traced);
* ``onnxruntime``: the graph builder's forms for ``--target onnxruntime`` (gather: channel-last
  buckets; tiles: batched 8-row tiles) and, for comparison, the channel-first gather and the
  ``windows`` form of the RKNN targets;
* for the matrix: a dense ``MatMul`` with ``W`` (nuScenes only: dense-6cam's ``W`` is 221 GB) and
  scipy's CSR ``W @ X`` (same process, same features).

Each is the median of ``--repeat`` runs after 5 warm-ups, the graphs of one rig and C timed
INTERLEAVED (one run of each per round, so a machine whose load changes weighs on all alike), in
onnxruntime with 1 thread and with all threads, and in OpenVINO (CPU plugin, ``INFERENCE_PRECISION_HINT`` f32; the openvino venv of
``make npu-envs``). Ratios are to the GridSample graph of the same rig, C and runtime, measured in the
same process. Results: ``benchmarks/results/deploy_latency.json``.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from _common import CONFIGS, ROOT, bevcompile, machine, markdown_table

RESULTS = ROOT / "benchmarks" / "results" / "deploy_latency.json"
RIGS = {"nuscenes": "nuscenes.yaml", "dense-6cam": "dense-6cam.yaml"}
BIG_INPUT = 100_000_000
"""Feature values (pixels x C) above which only the baseline and the channel-last forms are timed: the
sessions are held at once, and today's torch-traced gather of dense-6cam at C = 256 alone gathers 983 MB
per run."""


def build(rig: str, folder: Path) -> Path:
    out = folder / rig
    bevcompile("grid", str(CONFIGS / RIGS[rig]), "--out", str(out), "--quiet").check("grid")
    bevcompile("matrix", str(CONFIGS / RIGS[rig]), "--out", str(out), "--mode", "ray", "--topk", "24", "--align", "16", "--tile-rows", "256", "--quiet").check("matrix")
    return next(out.glob("*.zarr"))


def grid_sample_model(store: Any, features: np.ndarray) -> bytes:
    import torch

    norm = torch.from_numpy(np.asarray(store["grid"]["norm"], np.float32))  # (n_cam, n_h, ny, nx, 2)
    align = bool(store["grid"].attrs.get("align_corners", False))
    n_cam, n_h, ny, nx, _ = norm.shape

    class GridSampleSum(torch.nn.Module):
        def forward(self, f: torch.Tensor) -> torch.Tensor:
            out = 0
            for c in range(n_cam):
                grid = norm[c].reshape(1, n_h * ny, nx, 2)
                out = out + torch.nn.functional.grid_sample(f[:, c], grid, mode="bilinear", padding_mode="zeros", align_corners=align)
            return out

    buf = io.BytesIO()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(GridSampleSum(), (torch.from_numpy(features),), buf, dynamo=False, opset_version=17, input_names=["features"], output_names=["bev"])
    return buf.getvalue()


def dense_matmul_model(store: Any, channels: int) -> bytes | None:
    """``W`` dense ``(rows, P)`` @ features ``(P, C)`` (None when W does not fit in 2 GiB)."""
    import onnx
    from onnx import helper, numpy_helper

    from bevcompile.deploy.lift import product_lift

    lift = product_lift(store, "ell")
    if lift.n_rows * lift.n_pixels * 4 > 2 << 30:
        return None
    w = np.zeros((lift.n_rows, lift.n_pixels), np.float32)
    np.add.at(w, (lift.row, lift.pixel), lift.value)
    w_f, h_f = lift.feature_size
    nodes = [
        helper.make_node("Transpose", ["features"], ["t"], perm=[0, 1, 3, 4, 2]),
        helper.make_node("Reshape", ["t", "shape_in"], ["x"]),
        helper.make_node("MatMul", ["w", "x"], ["y"]),
        helper.make_node("Transpose", ["y"], ["bev"], perm=[1, 0]),
    ]
    graph = helper.make_graph(
        nodes, "dense", [helper.make_tensor_value_info("features", onnx.TensorProto.FLOAT, [1, lift.n_cam, channels, h_f, w_f])],
        [helper.make_tensor_value_info("bev", onnx.TensorProto.FLOAT, [channels, lift.n_rows])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.array([lift.n_pixels, channels], np.int64), "shape_in")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return model.SerializeToString()


def ort_latencies(models: list[bytes], feeds: dict[str, np.ndarray], threads: int, repeat: int) -> list[float]:
    """Median ms of every model, timed INTERLEAVED (one run of each per round): a machine whose load
    changes during the run weighs on every graph alike, so the ratios hold."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    sessions = [ort.InferenceSession(model, options, providers=["CPUExecutionProvider"]) for model in models]
    for _ in range(5):
        for session in sessions:
            session.run(None, feeds)
    times: list[list[float]] = [[] for _ in sessions]
    for _ in range(repeat):
        for i, session in enumerate(sessions):
            t = time.perf_counter()
            session.run(None, feeds)
            times[i].append(time.perf_counter() - t)
    return [float(np.median(t) * 1e3) for t in times]


def openvino_latencies(paths: list[Path], feeds_path: Path, names: list[str], repeat: int, work: Path) -> list[float | None]:
    from bevcompile.deploy.toolchains.harness import run_worker, toolchain_available

    if not toolchain_available("openvino"):
        return [None] * len(paths)
    spec = {"models": [str(p) for p in paths], "inputs": str(feeds_path), "input_names": names, "out_dir": str(work / "ov"),
            "config": {"INFERENCE_PRECISION_HINT": "f32"}, "repeat": repeat}
    result = run_worker("openvino", spec, work)
    values = result.get("latency_ms")
    if not values:
        print(f"openvino: {result.get('error')}", file=sys.stderr)
        return [None] * len(paths)
    return [float(v) for v in values]


def scipy_rows(store: Any, rig: str, channels: int, features: np.ndarray, repeat: int) -> dict[str, Any]:
    """scipy's CSR ``W @ X`` and the GridSample graph (onnxruntime, 1 thread) timed interleaved in this
    process: the scipy row with its ratio (``--scipy-only`` adds it to rows measured before)."""
    import onnxruntime as ort
    import scipy.sparse as sp

    from bevcompile.deploy.lift import product_lift

    lift = product_lift(store, "ell")
    w = sp.csr_matrix((lift.value, (lift.row, lift.pixel)), shape=(lift.n_rows, lift.n_pixels))
    x = np.ascontiguousarray(np.moveaxis(features[0], 1, -1).reshape(lift.n_pixels, -1))
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(grid_sample_model(store, features), options, providers=["CPUExecutionProvider"])
    feeds = {"features": features}
    for _ in range(3):
        session.run(None, feeds)
        w @ x
    base, spmm = [], []
    for _ in range(repeat):
        t = time.perf_counter()
        session.run(None, feeds)
        base.append(time.perf_counter() - t)
        t = time.perf_counter()
        w @ x
        spmm.append(time.perf_counter() - t)
    ms = float(np.median(spmm) * 1e3)
    return {"rig": rig, "channels": channels, "product": "ell", "graph": "scipy CSR W @ X (1 thread, in-process)", "ort_1": ms, "ort_all": None,
            "openvino": None, "ort_1_ratio": ms / float(np.median(base) * 1e3), "ort_all_ratio": None, "openvino_ratio": None, "timing": "interleaved"}


def graphs(store_path: Path, store: Any, channels: int, work: Path) -> list[tuple[str, str, bytes]]:
    """``(product, graph label, model bytes)`` of every exported form."""
    from bevcompile.deploy.graph import Plan, build_graph, choose_window_patch
    from bevcompile.deploy.lift import product_lift
    from bevcompile.deploy.onnx_export import ExportOptions, export_onnx

    out: list[tuple[str, str, bytes]] = []
    pixels = store.rig.n_cam * store.feature_size[0] * store.feature_size[1]
    big = pixels * channels > BIG_INPUT  # every session is held at once (interleaved timing): keep the channel-last forms only
    for product in ("gather", "ell", "tiles"):
        if not big and (product == "gather" or pixels < 100_000):
            path = work / f"generic-{product}.onnx"
            export_onnx(store_path, path, ExportOptions(product=product, channels=channels))
            out.append((product, "generic (today: torch-traced)", path.read_bytes()))
        lift = product_lift(store, product)
        forms = [("gather", "channel-last"), ("tiles", "channel-last")] if big else [("gather", "channel-last"), ("gather", "channel-first"), ("tiles", "channel-last")]
        for form, layout in forms:
            plan = Plan(form=form, layout=layout, input_rank=5, batch=1, channels=channels, opset=17, tile_rows=8)
            model, _ = build_graph(lift, plan)
            out.append((product, f"{form} {layout}", model.SerializeToString()))
        stats, _ = choose_window_patch(lift.by_output(), 256 << 20, 2000, 4)
        if stats is not None and not big:
            model, _ = build_graph(lift, Plan(form="windows", layout="channel-first", input_rank=5, batch=1, channels=channels, opset=17, patch=stats.patch))
            out.append((product, f"windows {stats.patch[0]}x{stats.patch[1]}", model.SerializeToString()))
    return out


def _save(rows: list[dict[str, Any]], repeat: int, merge: bool) -> dict[str, Any]:
    """Write the result file now (after every rig and C: a long run that dies keeps what it measured);
    ``merge``: the rows of the file this run does not redo are kept."""
    keep = []
    if merge and RESULTS.is_file():
        done = {(r["rig"], r["channels"]) for r in rows}
        keep = [r for r in json.loads(RESULTS.read_text())["rows"] if (r["rig"], r["channels"]) not in done]
    result = {"machine": machine(), "repeat": repeat, "rows": keep + rows}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")
    return result


def run(args: argparse.Namespace) -> dict[str, Any]:
    from bevcompile.store.loader import load

    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="latency-") as tmp:
        folder = Path(tmp)
        for rig in args.rigs:
            store_path = build(rig, folder)
            store = load(store_path)
            for channels in args.channels:
                rng = np.random.default_rng(0)
                w_f, h_f = store.feature_size
                features = rng.random((1, store.rig.n_cam, channels, h_f, w_f), dtype=np.float32)
                if args.scipy_only:
                    new = scipy_rows(store, rig, channels, features, args.repeat)
                    data = json.loads(RESULTS.read_text())
                    data["rows"] = [r for r in data["rows"] if not (r["rig"] == rig and r["channels"] == channels and "scipy" in r["graph"])] + [new]
                    RESULTS.write_text(json.dumps(data, indent=1) + "\n")
                    print(f"{rig} C={channels} scipy {new['ort_1']:.1f} ms ({new['ort_1_ratio']:.2f}x)", flush=True)
                    continue
                feeds = {"features": features}
                work = folder / f"{rig}-{channels}"
                work.mkdir()
                np.savez(str(work / "feeds.npz"), features=features)
                entries: list[tuple[str, str, bytes | None]] = [("baseline", "GridSample (torch grid_sample per camera, summed)", grid_sample_model(store, features))]
                entries += list(graphs(store_path, store, channels, work))
                entries.append(("ell", "dense MatMul (W dense)", dense_matmul_model(store, channels)))
                kept = [(product, label, model) for product, label, model in entries if model is not None]
                paths = []
                for i, (_, _, model) in enumerate(kept):
                    path = work / f"m{i}.onnx"
                    path.write_bytes(model)
                    paths.append(path)
                models = [model for _, _, model in kept]
                sequential = features.size > BIG_INPUT  # held at once they would not fit: one session at a time
                if sequential:
                    one = [ort_latencies([m], feeds, 1, args.repeat)[0] for m in models]
                    every = [ort_latencies([m], feeds, os.cpu_count() or 1, args.repeat)[0] for m in models]
                else:
                    one = ort_latencies(models, feeds, 1, args.repeat)
                    every = ort_latencies(models, feeds, os.cpu_count() or 1, args.repeat)
                if args.no_openvino:
                    ov: list[float | None] = [None] * len(kept)
                elif sequential:
                    ov = [openvino_latencies([path], work / "feeds.npz", ["features"], args.repeat, work)[0] for path in paths]
                else:
                    ov = openvino_latencies(paths, work / "feeds.npz", ["features"], args.repeat, work)
                base = {"ort_1": one[0], "ort_all": every[0], "openvino": ov[0]}
                for (product, label, _), t1, tn, to in zip(kept, one, every, ov, strict=True):
                    row: dict[str, Any] = {"rig": rig, "channels": channels, "product": product, "graph": label, "ort_1": t1, "ort_all": tn, "openvino": to,
                                           "timing": "sequential" if sequential else "interleaved"}
                    for key in ("ort_1", "ort_all", "openvino"):
                        row[f"{key}_ratio"] = row[key] / base[key] if row[key] is not None and base[key] else None
                    rows.append(row)
                    print(f"{rig:10s} C={channels:3d} {product:8s} {label:45s} ort1 {t1:8.2f} ms ({row['ort_1_ratio']:.2f}x)  ortN {tn:8.2f} ms"
                          + (f"  ov {to:8.2f} ms ({row['openvino_ratio']:.2f}x)" if to is not None else ""), flush=True)
                rows.append(scipy_rows(store, rig, channels, features, args.repeat))
                _save(rows, args.repeat, args.merge)
    return _save(rows, args.repeat, args.merge)


def table(path: Path = RESULTS) -> str:
    data = json.loads(path.read_text())
    header = ["rig", "C", "product", "graph", "onnxruntime 1 thread", "onnxruntime all threads", "OpenVINO f32"]

    def cell(r: dict[str, Any], key: str) -> str:
        if r.get(key) is None:
            return "-"
        ratio = r.get(f"{key}_ratio")
        return f"{r[key]:.1f} ms ({ratio:.2f}x)" if ratio is not None else f"{r[key]:.1f} ms"

    rig_order = {rig: i for i, rig in enumerate(RIGS)}
    rows = sorted(data["rows"], key=lambda r: (rig_order.get(r["rig"], len(rig_order)), r["channels"]))  # stable: measured order within
    out = [[r["rig"], r["channels"], r["product"], r["graph"] + (" *" if r.get("timing") == "sequential" and "scipy" not in r["graph"] else ""),
            cell(r, "ort_1"), cell(r, "ort_all"), cell(r, "openvino")] for r in rows]
    return (f"Median of {data['repeat']} runs; ratios to the GridSample graph of the same rig, C and runtime; the graphs of one rig and C timed "
            f"interleaved (* one after the other: held at once they would not fit in memory). Measured on {data['machine']}.\n\n"
            + markdown_table(header, out, right=(4, 5, 6)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rigs", nargs="+", default=list(RIGS), choices=list(RIGS))
    parser.add_argument("--channels", nargs="+", type=int, default=[64, 256])
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--no-openvino", action="store_true")
    parser.add_argument("--table", action="store_true")
    parser.add_argument("--merge", action="store_true", help="keep the result file's rows of the rigs and C this run does not redo")
    parser.add_argument("--scipy-only", action="store_true", help="only (re)measure the scipy CSR rows into the result file")
    args = parser.parse_args(argv)
    if args.table:
        print(table())
        return 0
    run(args)
    print(table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
