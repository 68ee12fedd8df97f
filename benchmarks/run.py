"""Benchmark of the sparse aggregation matrix build (``make bench``).

Compares the streamed build (:func:`bevcompile.matrix.build.build_matrix`) with the straightforward
baseline (:func:`bevcompile.matrix.reference.reference_matrix`: every point at once, every entry
at once, one full lexsort) on ``configs/dense-6cam.yaml`` (88.5 M frustum points) with
``--topk 24 --align 16``. Each build runs in its own fresh process (so ``ru_maxrss`` is that
build's peak resident memory) with one BLAS thread; both results are hashed and must be equal.

Usage::

    .venv/bin/python benchmarks/run.py                    # dense rig, streamed x3 + baseline once
    .venv/bin/python benchmarks/run.py --small            # stride 8 variant (5.5 M points), quick
    .venv/bin/python benchmarks/run.py --skip-baseline    # streamed only (no 10 GB baseline)
    .venv/bin/python benchmarks/run.py --splat nearest --topk 16

Results: a table on stdout and ``benchmarks/results/<rig>[-small]-k<K>-a<align>-<splat>.json``.
The baseline needs about 10 GB of memory and about 3 minutes on the dense rig (185 s measured): run it sparingly.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = ROOT / "configs" / "dense-6cam.yaml"
RESULTS = ROOT / "benchmarks" / "results"
SMALL_STRIDE = 8


def _load_rig(config: str, small: bool) -> Any:
    from bevcompile.rig.config import config_to_dict, load_config, parse_config

    rig = load_config(config)
    if small:
        data = config_to_dict(rig)
        data["name"] = f"{rig.name}-small"
        data["feature"]["stride"] = SMALL_STRIDE
        rig = parse_config(data, source=f"{config} (stride {SMALL_STRIDE})")
    return rig


def _digest(*arrays: Any) -> str:
    import numpy as np

    h = hashlib.sha256()
    for a in arrays:
        a = np.ascontiguousarray(a)
        h.update(a.dtype.str.encode())
        h.update(json.dumps(list(a.shape)).encode())
        h.update(a.tobytes())
    return h.hexdigest()


def child(args: argparse.Namespace) -> None:
    """Run one build in this (fresh) process and write its figures to ``args.result_file``."""
    import numpy as np

    from bevcompile.matrix.build import MatrixOptions, build_matrix
    from bevcompile.matrix.reference import reference_matrix

    rig = _load_rig(args.config, args.small)
    options = MatrixOptions(topk=args.topk, align=args.align, splat=args.splat, rounding=args.rounding)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t0 = time.perf_counter()
    extra: dict[str, Any] = {}
    if args.child == "streamed":
        p = build_matrix(rig, options, jobs=args.jobs)
        seconds = time.perf_counter() - t0
        row, col, val = p.coo_row, p.coo_col, p.coo_val
        extra = {
            "phase_seconds": {k: round(v, 3) for k, v in p.extra["phase_seconds"].items()},
            "candidates_sorted": p.figures.n_candidates,
            "points_in_range": p.figures.n_points_in_range,
            "kept_weight_fraction_total": p.figures.kept_weight_fraction_total,
            "kept_weight_fraction_worst_row": p.figures.kept_weight_fraction_worst_row,
            "row_nnz": [p.figures.row_nnz_min, p.figures.row_nnz_median, p.figures.row_nnz_max],
            "ell_shape": [p.rows_pad, p.k_pad],
        }
    else:
        ref = reference_matrix(rig, options)
        seconds = time.perf_counter() - t0
        row, col, val = ref.row.astype(np.int32), ref.col.astype(np.int32), ref.value.astype(np.float32)
        extra = {"entries_before_topk": ref.n_entries}
    w_f, h_f = rig.feature_size
    result = {
        "build": args.child,
        "seconds": seconds,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "rss_before_build_bytes": rss_before,
        "points": rig.n_cam * rig.depth.n_bins * w_f * h_f,
        "nnz": int(row.size),
        "coo_sha256": _digest(row, col, val),
        **extra,
    }
    Path(args.result_file).write_text(json.dumps(result))


def _spawn(kind: str, args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        result_file = Path(tmp) / "result.json"
        cmd = [
            sys.executable, __file__, "--child", kind, "--result-file", str(result_file), "--config", str(args.config),
            "--topk", str(args.topk), "--align", str(args.align), "--splat", args.splat, "--rounding", args.rounding,
            "--jobs", str(args.jobs),
        ]
        if args.small:
            cmd.append("--small")
        env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        subprocess.run(cmd, check=True, env=env)
        return dict(json.loads(result_file.read_text()))


def _machine() -> dict[str, Any]:
    import numpy as np

    model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    mem = 0
    with contextlib.suppress(ValueError, OSError):
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {
        "cpu": model or platform.processor(),
        "cpus": os.cpu_count(),
        "memory_bytes": mem,
        "python": platform.python_version(),
        "numpy": np.__version__,
        "load_average_at_start": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="rig config (default: configs/dense-6cam.yaml)")
    parser.add_argument("--small", action="store_true", help=f"quick variant: feature stride {SMALL_STRIDE} (1/16 of the points)")
    parser.add_argument("--topk", type=int, default=24)
    parser.add_argument("--align", type=int, default=16)
    parser.add_argument("--splat", default="bilinear", choices=("bilinear", "nearest"))
    parser.add_argument("--rounding", default="floor", choices=("floor", "trunc"))
    parser.add_argument("--repeat", type=int, default=3, help="streamed builds (the fastest is reported)")
    parser.add_argument("--jobs", type=int, default=1, help="threads of the streamed build (the baseline has one)")
    parser.add_argument("--skip-baseline", action="store_true", help="do not run the straightforward baseline")
    parser.add_argument(
        "--reuse-baseline",
        action="store_true",
        help="take the baseline figures (time, memory, result hash) from the existing result file of the same "
        "rig and options instead of re-running it; the streamed result is still compared with its hash",
    )
    parser.add_argument("--out", default=str(RESULTS), help="folder of the result JSON")
    parser.add_argument("--child", choices=("streamed", "baseline"), help=argparse.SUPPRESS)
    parser.add_argument("--result-file", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args)
        return 0

    rig = _load_rig(args.config, args.small)
    w_f, h_f = rig.feature_size
    points = rig.n_cam * rig.depth.n_bins * w_f * h_f
    print(
        f"rig {rig.name}: {rig.n_cam} cameras x {rig.depth.n_bins} depth bins x {h_f} x {w_f} = {points:,} frustum points, "
        f"BEV {rig.bev.nx}x{rig.bev.ny}; --topk {args.topk} --align {args.align} --splat {args.splat} --rounding {args.rounding}",
        flush=True,
    )
    runs = []
    for i in range(max(1, args.repeat)):
        r = _spawn("streamed", args)
        runs.append(r)
        print(f"  streamed #{i + 1}: {r['seconds']:.2f} s, peak RSS {r['peak_rss_bytes'] / 2**20:.0f} MiB, phases {r['phase_seconds']}", flush=True)
    best = min(runs, key=lambda r: r["seconds"])
    if len({r["coo_sha256"] for r in runs}) != 1:
        print("error: streamed builds differ between runs (non-deterministic)", file=sys.stderr)
        return 1
    out = Path(args.out)
    name = f"{rig.name}-k{args.topk}-a{args.align}-{args.splat}" + ("" if args.rounding == "floor" else f"-{args.rounding}")
    path = out / f"{name}.json"
    baseline = None
    if args.reuse_baseline and path.exists():
        previous = json.loads(path.read_text())
        if previous.get("baseline") and previous.get("points") == points:
            baseline = {**previous["baseline"], "reused_from": str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)}
            baseline["measured_at"] = previous["baseline"].get("measured_at")
            print(f"  baseline (reused from {path.name}): {baseline['seconds']:.2f} s, peak RSS {baseline['peak_rss_bytes'] / 2**20:.0f} MiB", flush=True)
    if baseline is None and not args.skip_baseline:
        baseline = _spawn("baseline", args)
        baseline["measured_at"] = time.strftime("%Y-%m-%dT%H:%M:%S")
        print(f"  baseline: {baseline['seconds']:.2f} s, peak RSS {baseline['peak_rss_bytes'] / 2**20:.0f} MiB", flush=True)
    summary: dict[str, Any] = {
        "rig": rig.name,
        "config": str(Path(args.config).resolve().relative_to(ROOT)) if Path(args.config).resolve().is_relative_to(ROOT) else str(args.config),
        "small_variant": args.small,
        "options": {"topk": args.topk, "align": args.align, "splat": args.splat, "rounding": args.rounding},
        "points": points,
        "machine": _machine(),
        "streamed": {
            "seconds_best": best["seconds"],
            "seconds_all": [r["seconds"] for r in runs],
            "peak_rss_bytes": max(r["peak_rss_bytes"] for r in runs),
            "points_per_second_per_core": points / (best["seconds"] * args.jobs),
            "threads": args.jobs,
            **{k: best[k] for k in ("phase_seconds", "candidates_sorted", "points_in_range", "nnz", "kept_weight_fraction_total",
                                    "kept_weight_fraction_worst_row", "row_nnz", "ell_shape", "coo_sha256")},
        },
    }
    if baseline is not None:
        equal = baseline["coo_sha256"] == best["coo_sha256"]
        summary["baseline"] = {
            "seconds": baseline["seconds"],
            "peak_rss_bytes": baseline["peak_rss_bytes"],
            "points_per_second_per_core": points / baseline["seconds"],
            "entries_before_topk": baseline["entries_before_topk"],
            "nnz": baseline["nnz"],
            "coo_sha256": baseline["coo_sha256"],
            "measured_at": baseline.get("measured_at"),
            **({"reused_from": baseline["reused_from"]} if "reused_from" in baseline else {}),
        }
        summary["speedup"] = baseline["seconds"] / best["seconds"]
        summary["memory_ratio"] = baseline["peak_rss_bytes"] / max(1, summary["streamed"]["peak_rss_bytes"])
        summary["equal_to_baseline"] = equal
    print()
    print(f"{'build':<10} {'seconds':>9} {'peak RSS':>11} {'points/s/core':>15}")
    s = summary["streamed"]
    print(f"{'streamed':<10} {s['seconds_best']:>9.2f} {s['peak_rss_bytes'] / 2**20:>7.0f} MiB {s['points_per_second_per_core']:>15.3g}")
    if baseline is not None:
        b = summary["baseline"]
        print(f"{'baseline':<10} {b['seconds']:>9.2f} {b['peak_rss_bytes'] / 2**20:>7.0f} MiB {b['points_per_second_per_core']:>15.3g}")
        print(f"speed-up {summary['speedup']:.1f}x, memory {summary['memory_ratio']:.1f}x less, results equal: {summary['equal_to_baseline']}")
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"wrote {path}")
    if baseline is not None and not summary["equal_to_baseline"]:
        print("error: the streamed build differs from the baseline", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
