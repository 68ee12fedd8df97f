"""Scaling of the streamed matrix build and the BEVPoolv2 export with points and ``--jobs``.

For each rig (``configs/dense-6cam.yaml``: the real nuScenes cameras; ``configs/ring-6cam.yaml``:
six identical level cameras, the tie-heavy regular rig) at 22 M, 88 M, 177 M and 354 M frustum
points (the same feature map with 16, 64, 128 and 256 depth bins over [1, 65) m; plus dense-6cam
at stride 1 = 354 M points from 4x the rays), it builds ``bevcompile matrix --topk 24 --align 16``
(bilinear) with ``--jobs 1`` and ``--jobs 2``, each build in a fresh process (so ``ru_maxrss`` is
that build's peak) with one BLAS thread, and reports: build time (best of ``--repeat``), peak RSS,
candidates sorted, points / s / core, and the ratio to **the floor**: one streaming numpy pass
over the same points on one core (per camera and chunk of depth bins: float32 ``t + d * ray``,
the x/y cell and the z band, the in-range test and one ``bincount`` of the cells), measured in
the build's own process right after it, so the ratio holds on a loaded machine too (each row
is the build with the best ratio of ``--repeat``).
Then the BEVPoolv2 export (``build_bevpoolv2``, BEVDet's defaults) of the 88 M rigs, against the
bytes of its own output arrays. Every build's COO (or BEVPoolv2 arrays) must hash the same for
both job counts.

Usage::

    .venv/bin/python benchmarks/scaling.py                 # the full table (~5 min on a quiet 2-core machine)
    .venv/bin/python benchmarks/scaling.py --quick         # 22 M and 88 M points only
    .venv/bin/python benchmarks/scaling.py --jobs 1 2 4 --repeat 3
    .venv/bin/python benchmarks/scaling.py --table benchmarks/results/scaling.json   # re-print, no builds

Prints the markdown tables (the README's and ``docs/matrix.md``'s) and writes
``benchmarks/results/scaling.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
RIGS = {"dense-6cam": ROOT / "configs" / "dense-6cam.yaml", "ring-6cam": ROOT / "configs" / "ring-6cam.yaml"}
DEPTH_BINS = {22: 16, 88: 64, 177: 128, 354: 256}  # million points -> depth bins over [1, 65) m
FLOOR_REPEAT = 2  # floor passes after each build (the fastest counts)
TARGET_SECONDS, TARGET_MIB, TARGET_RSS_ALL_MIB, TARGET_RING_RATIO, TARGET_FLOOR, AIM_FLOOR = 2.0, 500, 600, 1.3, 5.0, 3.0


def load_variant(config: str, depth_bins: int, stride: int | None) -> Any:
    """The rig of ``config`` with ``depth_bins`` bins over its depth range (and another stride)."""
    from bevcompile.rig.config import config_to_dict, load_config, parse_config

    rig = load_config(config)
    data = config_to_dict(rig)
    start, stop = rig.depth.values()[0], rig.depth.values()[-1] + rig.depth.values()[1] - rig.depth.values()[0]
    data["depth"]["bins"] = [start, stop, (stop - start) / depth_bins]
    if stride is not None:
        data["feature"]["stride"] = stride
    out = parse_config(data, source=f"{config} ({depth_bins} depth bins, stride {stride or rig.feature.stride})")
    assert out.depth.n_bins == depth_bins
    return out


def floor_pass(rig: Any) -> float:
    """Seconds of one streaming numpy pass over every frustum point of ``rig`` (one core): float32
    ``t + d * ray`` per axis, the x/y cell and z band, the in-range test, one bincount of the cells
    per chunk of ~131 k points. The rays are computed before the clock starts."""
    import numpy as np

    from bevcompile.matrix.entries import CHUNK_POINTS, camera_rays

    bev = rig.bev
    depths = np.asarray(rig.depth.values(), dtype=np.float32)
    rays = [camera_rays(rig, cam) for cam in range(rig.n_cam)]
    lows = [np.float32(v) for v in (bev.x.min, bev.y.min, bev.z.min)]
    inverse = [np.float32(1.0 / s) for s in (bev.x.step, bev.y.step, bev.z.step)]
    sizes = (bev.x.n, bev.y.n, bev.z.n)
    n_cells = bev.nx * bev.ny
    total = np.zeros(n_cells + 1, dtype=np.int64)
    t0 = time.perf_counter()
    for r in rays:
        ray = r.ray_ego.astype(np.float32)
        origin = r.origin_ego.astype(np.float32)
        step = max(1, CHUNK_POINTS // ray.shape[1])
        for d0 in range(0, depths.size, step):
            d = depths[d0 : d0 + step, None]
            index = []
            for axis in range(3):
                f = d * ray[axis]
                f += origin[axis]
                f -= lows[axis]
                f *= inverse[axis]
                index.append(np.floor(f).astype(np.int32))
            ix, iy, iz = index
            ok = (ix >= 0) & (ix < sizes[0]) & (iy >= 0) & (iy < sizes[1]) & (iz >= 0) & (iz < sizes[2])
            cell = iy * sizes[0] + ix
            cell[~ok] = n_cells
            total += np.bincount(cell.ravel(), minlength=n_cells + 1)
    return time.perf_counter() - t0


def child(args: argparse.Namespace) -> None:
    import hashlib

    import numpy as np

    rig = load_variant(args.config, args.depth_bins, args.stride)
    w_f, h_f = rig.feature_size
    out: dict[str, Any] = {"points": rig.n_cam * rig.depth.n_bins * w_f * h_f, "rss_before_bytes": _rss()}
    cpu0 = time.process_time()
    if args.child == "matrix":
        from bevcompile.matrix.build import MatrixOptions, build_matrix

        t0 = time.perf_counter()
        p = build_matrix(rig, MatrixOptions(topk=24, align=16), jobs=args.jobs)
        out["seconds"] = time.perf_counter() - t0
        digest = hashlib.sha256()
        for a in (p.coo_row, p.coo_col, p.coo_val):
            digest.update(np.ascontiguousarray(a).data)
        out.update(
            sha256=digest.hexdigest(),
            nnz=p.figures.nnz,
            candidates=p.figures.n_candidates,
            in_range=p.figures.n_points_in_range,
            selection=p.extra["selection"],
            phase_seconds={k: round(v, 3) for k, v in p.extra["phase_seconds"].items()},
        )
    else:
        from bevcompile.interop.bevpoolv2 import build_bevpoolv2

        t0 = time.perf_counter()
        arrays = build_bevpoolv2(rig, jobs=args.jobs)
        out["seconds"] = time.perf_counter() - t0
        digest = hashlib.sha256()
        for a in arrays.arrays().values():
            digest.update(np.ascontiguousarray(a).data)
        out.update(sha256=digest.hexdigest(), kept=arrays.n_kept, output_bytes=sum(a.nbytes for a in arrays.arrays().values()))
    out["cpu_seconds"] = time.process_time() - cpu0
    out["peak_rss_bytes"] = _rss()  # before the floor pass, which is far smaller anyway
    out["floor_seconds"] = min(floor_pass(rig) for _ in range(FLOOR_REPEAT))  # right after, same process
    Path(args.result_file).write_text(json.dumps(out))


def _rss() -> int:
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def spawn(kind: str, config: Path, depth_bins: int, stride: int | None, jobs: int, repeat: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        result_file = Path(tmp) / "result.json"
        cmd = [sys.executable, __file__, "--child", kind, "--result-file", str(result_file), "--config", str(config),
               "--depth-bins", str(depth_bins), "--jobs", str(jobs), "--repeat", str(repeat)]
        if stride is not None:
            cmd += ["--stride", str(stride)]
        env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        subprocess.run(cmd, check=True, env=env)
        return dict(json.loads(result_file.read_text()))


def best_of(kind: str, config: Path, depth_bins: int, stride: int | None, jobs: int, repeat: int) -> dict[str, Any]:
    """The best of ``repeat`` fresh-process builds by their ratio to the floor measured in the same
    process right after the build; peak RSS is the largest of them."""
    runs = [spawn(kind, config, depth_bins, stride, jobs, 1) for _ in range(repeat)]
    best = dict(min(runs, key=lambda r: r["seconds"] / r["floor_seconds"]))
    best["peak_rss_bytes"] = max(r["peak_rss_bytes"] for r in runs)
    best["seconds_all"] = [r["seconds"] for r in runs]
    if len({r["sha256"] for r in runs}) != 1:
        raise SystemExit(f"error: {kind} {config.name} {depth_bins} bins --jobs {jobs}: builds differ between runs")
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--rigs", nargs="+", default=list(RIGS), choices=list(RIGS))
    parser.add_argument("--points", nargs="+", type=int, default=list(DEPTH_BINS), choices=list(DEPTH_BINS), help="million points")
    parser.add_argument("--jobs", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--repeat", type=int, default=2, help="builds per row (the fastest is reported)")
    parser.add_argument("--quick", action="store_true", help="22 M and 88 M points only, no stride-1 row")
    parser.add_argument("--skip-bevpoolv2", action="store_true")
    parser.add_argument("--out", default=str(RESULTS / "scaling.json"))
    parser.add_argument("--table", metavar="JSON", help="print the tables of an earlier result file and exit")
    parser.add_argument("--child", choices=("matrix", "bevpoolv2"), help=argparse.SUPPRESS)
    parser.add_argument("--result-file", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--depth-bins", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--stride", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        args.jobs = args.jobs[0]
        child(args)
        return 0
    if args.table:
        saved = json.loads(Path(args.table).read_text())
        print(markdown(saved["matrix"], saved["bevpoolv2"], saved["machine"]))
        return 0
    from run import _machine  # the matrix benchmark's machine record (same folder)

    sizes = [p for p in args.points if not args.quick or p in (22, 88)]
    plan: list[tuple[str, int, int | None]] = [(name, p, None) for name in args.rigs for p in sizes]
    if not args.quick and "dense-6cam" in args.rigs and 354 in sizes:
        plan.append(("dense-6cam", 354, 1))  # 354 M points from 4x the rays (stride 1, 64 bins)
    machine = _machine()
    print(f"machine: {machine['cpu']}, {machine['cpus']} cores, load average {machine['load_average_at_start']}", flush=True)
    rows: list[dict[str, Any]] = []
    for name, millions, stride in plan:
        config = RIGS[name]
        depth_bins = 64 if stride == 1 else DEPTH_BINS[millions]
        builds = {jobs: best_of("matrix", config, depth_bins, stride, jobs, args.repeat) for jobs in args.jobs}
        if len({b["sha256"] for b in builds.values()}) != 1:
            print(f"error: {name} {millions} M: the matrix differs between --jobs {args.jobs}", file=sys.stderr)
            return 1
        for jobs, b in builds.items():
            row = {"rig": name + (" (stride 1)" if stride == 1 else ""), "millions": millions, "depth_bins": depth_bins, "jobs": jobs,
                   "points": b["points"], "floor_seconds": b["floor_seconds"], "seconds": b["seconds"], "seconds_all": b["seconds_all"],
                   "cpu_seconds": b["cpu_seconds"], "ratio_to_floor": b["seconds"] / b["floor_seconds"], "peak_rss_bytes": b["peak_rss_bytes"],
                   "candidates": b["candidates"], "selection": b["selection"], "nnz": b["nnz"], "in_range": b["in_range"],
                   "points_per_second_per_core": b["points"] / (b["seconds"] * jobs), "phase_seconds": b["phase_seconds"], "sha256": b["sha256"]}
            rows.append(row)
            print(f"  {row['rig']:<22} {b['points'] / 1e6:6.1f} M --jobs {jobs}: {b['seconds']:6.2f} s "
                  f"({row['ratio_to_floor']:.2f}x the {b['floor_seconds']:.2f} s floor; cpu {b['cpu_seconds']:.2f} s), {b['peak_rss_bytes'] / 2**20:5.0f} MiB, "
                  f"{b['candidates']:,} candidates", flush=True)
    pool: list[dict[str, Any]] = []
    if not args.skip_bevpoolv2:
        for name in args.rigs:
            config = RIGS[name]
            builds = {jobs: best_of("bevpoolv2", config, 64, None, jobs, args.repeat) for jobs in args.jobs}
            if len({b["sha256"] for b in builds.values()}) != 1:
                print(f"error: {name}: the BEVPoolv2 arrays differ between --jobs {args.jobs}", file=sys.stderr)
                return 1
            for jobs, b in builds.items():
                pool.append({"rig": name, "jobs": jobs, "points": b["points"], "floor_seconds": b["floor_seconds"], "seconds": b["seconds"],
                             "cpu_seconds": b["cpu_seconds"], "ratio_to_floor": b["seconds"] / b["floor_seconds"], "peak_rss_bytes": b["peak_rss_bytes"],
                             "output_bytes": b["output_bytes"], "kept": b["kept"], "sha256": b["sha256"]})
                print(f"  BEVPoolv2 {name} --jobs {jobs}: {b['seconds']:.2f} s, {b['peak_rss_bytes'] / 2**20:.0f} MiB "
                      f"for {b['output_bytes'] / 2**20:.0f} MiB of arrays", flush=True)
    print()
    print(markdown(rows, pool, machine))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"), "matrix": rows, "bevpoolv2": pool}, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


def markdown(rows: list[dict[str, Any]], pool: list[dict[str, Any]], machine: dict[str, Any]) -> str:
    """The tables and the target checks, as the README and docs/matrix.md show them."""
    lines = [
        f"`bevcompile matrix --topk 24 --align 16` (bilinear), `benchmarks/scaling.py`; {machine['cpus']}-core {machine['cpu']}, "
        f"load average {', '.join(f'{x:.1f}' for x in machine['load_average_at_start'] or [])} at the start; "
        "floor = one float32 numpy pass over the same points on one core (cell + z band + bincount), in the build's process right after it; CPU = the build's process time (all threads).",
        "",
        "| rig | points | depth bins | --jobs | build | CPU | floor | x floor | peak RSS | candidates sorted | points / s / core |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['rig']} | {r['points'] / 1e6:.1f} M | {r['depth_bins']} | {r['jobs']} | {r['seconds']:.2f} s | {r['cpu_seconds']:.2f} s | {r['floor_seconds']:.2f} s | {r['ratio_to_floor']:.1f} | "
            f"{r['peak_rss_bytes'] / 2**20:.0f} MiB | {r['candidates'] / 1e6:.2f} M | {r['points_per_second_per_core'] / 1e6:.0f} M |"
        )
    if pool:
        lines += ["", "BEVPoolv2 export (`build_bevpoolv2`, BEVDet's defaults), 88.5 M points:", "",
                  "| rig | --jobs | build | floor | x floor | peak RSS | output arrays | peak / arrays |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for r in pool:
            lines.append(f"| {r['rig']} | {r['jobs']} | {r['seconds']:.2f} s | {r['floor_seconds']:.2f} s | {r['ratio_to_floor']:.1f} | {r['peak_rss_bytes'] / 2**20:.0f} MiB | "
                         f"{r['output_bytes'] / 2**20:.0f} MiB | {r['peak_rss_bytes'] / r['output_bytes']:.2f} |")
    lines += ["", *targets(rows, pool)]
    return "\n".join(lines)


def targets(rows: list[dict[str, Any]], pool: list[dict[str, Any]]) -> list[str]:
    """One line per performance target of the streamed build: met or the measured distance."""
    def find(rig: str, millions: int, jobs: int) -> dict[str, Any] | None:
        return next((r for r in rows if r["rig"] == rig and r["millions"] == millions and r["jobs"] == jobs), None)

    out = []
    dense, ring = find("dense-6cam", 88, 2), find("ring-6cam", 88, 2)
    if dense:
        s, mib, x = dense["seconds"], dense["peak_rss_bytes"] / 2**20, dense["ratio_to_floor"]
        out.append(f"- dense-6cam 88 M, 2 jobs: {s:.2f} s (target <= {TARGET_SECONDS} s: {'met' if s <= TARGET_SECONDS else 'missed'}), "
                   f"{mib:.0f} MiB (<= {TARGET_MIB}: {'met' if mib <= TARGET_MIB else 'missed'}), "
                   f"{x:.1f}x the floor (<= {TARGET_FLOOR}: {'met' if x <= TARGET_FLOOR else 'missed'}; aim {AIM_FLOOR})")
    if dense and ring:
        t, m = ring["seconds"] / dense["seconds"], ring["peak_rss_bytes"] / dense["peak_rss_bytes"]
        out.append(f"- ring-6cam / dense-6cam, 88 M, 2 jobs: time {t:.2f}x, memory {m:.2f}x (target <= {TARGET_RING_RATIO}: "
                   f"{'met' if max(t, m) <= TARGET_RING_RATIO else 'missed'})")
    if rows:
        worst = max(rows, key=lambda r: r["peak_rss_bytes"])
        mib = worst["peak_rss_bytes"] / 2**20
        out.append(f"- largest peak RSS: {mib:.0f} MiB ({worst['rig']}, {worst['points'] / 1e6:.0f} M, {worst['jobs']} jobs; "
                   f"target <= {TARGET_RSS_ALL_MIB}: {'met' if mib <= TARGET_RSS_ALL_MIB else 'missed'})")
    for r in pool:
        ratio = r["peak_rss_bytes"] / r["output_bytes"]
        out.append(f"- BEVPoolv2 {r['rig']}, {r['jobs']} jobs: peak {ratio:.2f}x its arrays (target <= 1.5: {'met' if ratio <= 1.5 else 'missed'})")
    return out


if __name__ == "__main__":
    sys.exit(main())
