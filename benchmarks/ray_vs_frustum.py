"""The ray-mode matrix build against the frustum build of the same rig and options.

The target: ``bevcompile matrix --mode ray`` streams like frustum mode, and on the dense rig it must stay
within the frustum build's time and memory. This script builds ``configs/dense-6cam.yaml``
(88.5 M frustum points) with ``--topk 24 --align 16`` in frustum and in ray mode (uniform prior),
``--splat nearest`` and ``bilinear``, ``--jobs 1`` and ``2``, each build in a fresh process with
one BLAS thread (``build_matrix``, no store written), and reports per build its wall time, CPU
time, peak resident memory (``VmHWM`` of the build's own process, ``/proc/self/status``: the
child is started by a small parent, but VmHWM is the child's own high-water mark whatever its
parent), the candidates sorted and the phase times; then per (splat, jobs) the ray / frustum
ratios. The builds of each configuration alternate (frustum, ray, frustum, ray, ...) so that a
ratio compares builds taken under the same load; a row is the fastest of ``--repeat`` builds,
its peak memory the largest. Each build's COO must hash the same for both job counts.

Usage::

    .venv/bin/python benchmarks/ray_vs_frustum.py                  # 8 configurations x 2 builds (~5 min on 2 cores)
    .venv/bin/python benchmarks/ray_vs_frustum.py --repeat 3
    .venv/bin/python benchmarks/ray_vs_frustum.py --table benchmarks/results/ray_vs_frustum.json   # re-print
    .venv/bin/python benchmarks/ray_vs_frustum.py --splats bilinear --ray-chunk-points 65536 --out /tmp/c16.json

``--ray-chunk-points`` and ``--ray-pass1-stride`` build the ray matrix with another block size
(``bevcompile.matrix.ray.CHUNK_POINTS``) or pass-1 sample (``PASS1_STRIDE``): the experiments
behind their values (the matrix is the same; the frustum builds are unchanged).

Prints the markdown tables (``docs/matrix.md`` "Ray mode" shows them) and writes
``benchmarks/results/ray_vs_frustum.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
CONFIG = ROOT / "configs" / "dense-6cam.yaml"
MODES = ("frustum", "ray")
SPLATS = ("nearest", "bilinear")


def vm_hwm_bytes() -> int:
    """This process's peak resident memory: ``VmHWM`` of ``/proc/self/status`` (its own, never a parent's)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise SystemExit("error: /proc/self/status has no VmHWM (Linux only)")


def child(spec: dict[str, Any]) -> None:
    """One build, in this fresh process: ``spec`` = config, mode, splat, jobs, result_file."""
    import hashlib

    import numpy as np

    from bevcompile.matrix.build import MatrixOptions, build_matrix
    from bevcompile.rig.config import load_config

    if spec["mode"] == "ray":
        from bevcompile.matrix import ray

        ray.CHUNK_POINTS = spec.get("ray_chunk_points") or ray.CHUNK_POINTS
        ray.PASS1_STRIDE = spec.get("ray_pass1_stride") or ray.PASS1_STRIDE
    rig = load_config(spec["config"])
    cpu0 = time.process_time()
    t0 = time.perf_counter()
    p = build_matrix(rig, MatrixOptions(mode=spec["mode"], topk=24, align=16, splat=spec["splat"]), jobs=spec["jobs"])
    seconds = time.perf_counter() - t0
    digest = hashlib.sha256()
    for a in (p.coo_row, p.coo_col, p.coo_val):
        digest.update(np.ascontiguousarray(a).data)
    out = {
        "seconds": seconds,
        "cpu_seconds": time.process_time() - cpu0,
        "peak_rss_bytes": vm_hwm_bytes(),
        "sha256": digest.hexdigest(),
        "nnz": p.figures.nnz,
        "candidates": p.figures.n_candidates,
        "in_range": p.figures.n_points_in_range,
        "phase_seconds": {k: round(v, 3) for k, v in p.extra["phase_seconds"].items()},
    }
    Path(spec["result_file"]).write_text(json.dumps(out))


def spawn(mode: str, splat: str, jobs: int, ray_settings: dict[str, int | None]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        result_file = Path(tmp) / "result.json"
        spec = {"config": str(CONFIG), "mode": mode, "splat": splat, "jobs": jobs, "result_file": str(result_file), **ray_settings}
        cmd = [sys.executable, __file__, "--child", json.dumps(spec)]
        env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        subprocess.run(cmd, check=True, env=env)
        return dict(json.loads(result_file.read_text()))


def best(runs: list[dict[str, Any]], what: str) -> dict[str, Any]:
    """The fastest of ``runs``, with the largest peak memory of them; all must hash the same."""
    if len({r["sha256"] for r in runs}) != 1:
        raise SystemExit(f"error: {what}: the builds differ between runs")
    out = dict(min(runs, key=lambda r: r["seconds"]))
    out["peak_rss_bytes"] = max(r["peak_rss_bytes"] for r in runs)
    out["seconds_all"] = [round(r["seconds"], 3) for r in runs]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--splats", nargs="+", default=list(SPLATS), choices=list(SPLATS))
    parser.add_argument("--jobs", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--repeat", type=int, default=2, help="builds per row (the fastest is reported)")
    parser.add_argument("--out", default=str(RESULTS / "ray_vs_frustum.json"))
    parser.add_argument("--ray-chunk-points", type=int, help="ray mode's block size (default: bevcompile.matrix.ray.CHUNK_POINTS)")
    parser.add_argument("--ray-pass1-stride", type=int, help="ray mode's pass-1 sample, every Nth ray (default: PASS1_STRIDE)")
    parser.add_argument("--table", metavar="JSON", help="print the tables of an earlier result file and exit")
    parser.add_argument("--child", metavar="JSON", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(json.loads(args.child))
    elif args.table:
        saved = json.loads(Path(args.table).read_text())
        print(markdown(saved["builds"], saved["machine"], saved.get("ray_settings") or {}))
    else:
        return measure(args)
    return 0


def measure(args: argparse.Namespace) -> int:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from run import _machine  # the matrix benchmark's machine record (same folder)

    machine = _machine()
    ray_settings = {"ray_chunk_points": args.ray_chunk_points, "ray_pass1_stride": args.ray_pass1_stride}
    print(f"machine: {machine['cpu']}, {machine['cpus']} cores, load average {machine['load_average_at_start']}", flush=True)
    rows: list[dict[str, Any]] = []
    for splat in args.splats:
        digests: dict[str, set[str]] = {m: set() for m in MODES}
        for jobs in args.jobs:
            runs: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
            for _ in range(args.repeat):  # alternate the modes: each ratio compares builds under the same load
                for mode in MODES:
                    runs[mode].append(spawn(mode, splat, jobs, ray_settings))
            for mode in MODES:
                b = best(runs[mode], f"{mode} {splat} --jobs {jobs}")
                digests[mode].add(b["sha256"])
                rows.append({"mode": mode, "splat": splat, "jobs": jobs, **b})
                print(f"  {mode:<8} {splat:<8} --jobs {jobs}: {b['seconds']:6.2f} s (cpu {b['cpu_seconds']:.2f} s), "
                      f"{b['peak_rss_bytes'] / 2**20:4.0f} MiB, {b['candidates']:,} candidates", flush=True)
        for mode, seen in digests.items():
            if len(seen) != 1:
                print(f"error: {mode} {splat}: the matrix differs between --jobs {args.jobs}", file=sys.stderr)
                return 1
    machine["load_average_at_end"] = list(os.getloadavg())
    print()
    print(markdown(rows, machine, ray_settings))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {"machine": machine, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"), "ray_settings": ray_settings, "builds": rows}
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


def ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (splat, jobs): ray / frustum time and peak memory."""
    out = []
    for r in rows:
        if r["mode"] != "ray":
            continue
        f = next(x for x in rows if x["mode"] == "frustum" and x["splat"] == r["splat"] and x["jobs"] == r["jobs"])
        out.append({"splat": r["splat"], "jobs": r["jobs"], "time": r["seconds"] / f["seconds"], "memory": r["peak_rss_bytes"] / f["peak_rss_bytes"]})
    return out


def markdown(rows: list[dict[str, Any]], machine: dict[str, Any], ray_settings: dict[str, int | None]) -> str:
    load = ", ".join(f"{x:.1f}" for x in machine.get("load_average_at_start") or [])
    flags = "".join(f" --{k.replace('_', '-')} {v}" for k, v in ray_settings.items() if v)
    lines = [
        f"`build_matrix` of configs/dense-6cam.yaml (88.5 M frustum points), `--topk 24 --align 16`, uniform prior, "
        f"`benchmarks/ray_vs_frustum.py{flags}`; {machine['cpus']}-core {machine['cpu']}, load average {load} at the start; "
        "peak RSS = VmHWM of the build's own process.",
        "",
        "| mode | --splat | --jobs | build | CPU | peak RSS | candidates sorted | pass 1 | pass 2 | Top-K select |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ph = r["phase_seconds"]
        lines.append(
            f"| {r['mode']} | {r['splat']} | {r['jobs']} | {r['seconds']:.2f} s | {r['cpu_seconds']:.2f} s | {r['peak_rss_bytes'] / 2**20:.0f} MiB | "
            f"{r['candidates'] / 1e6:.2f} M | {ph.get('pass1_histogram', 0):.2f} s | {ph.get('pass2_candidates', 0):.2f} s | {ph.get('topk_select', 0):.2f} s |"
        )
    lines += ["", "| --splat | --jobs | ray / frustum time | ray / frustum peak RSS |", "|---|---:|---:|---:|"]
    for q in ratios(rows):
        lines.append(f"| {q['splat']} | {q['jobs']} | {q['time']:.2f} | {q['memory']:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
