"""Benchmark of the BEVPoolv2 interop arrays (``bevcompile export-interop --to bevpoolv2``).

Compares the streamed build (:func:`bevcompile.interop.build_bevpoolv2`: a counting sort in two
passes over the culled frustum blocks, writing the int32 ranks straight into their final slots;
``--jobs`` threads, default 1) with the straightforward baseline written
the way BEVDet's ``voxel_pooling_prepare_v2`` is: every frustum point of every camera at once
(float64 ego coordinates, int64 voxel coordinates, int64 ranks), then the keep mask, then one
argsort of all kept ranks. Same arithmetic (the frustum points come from
:func:`bevcompile.interop.frustum_points_bev`), so the five arrays must be bit-identical; the
script checks their hash. Each build runs in its own fresh process (``ru_maxrss`` = that build's
peak), one BLAS thread.

Usage::

    .venv/bin/python benchmarks/bevpoolv2.py                 # configs/dense-6cam.yaml (88.5 M points)
    .venv/bin/python benchmarks/bevpoolv2.py --config configs/nuscenes.yaml

Results: a table on stdout and ``benchmarks/results/bevpoolv2-<rig>.json``.
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

from run import _digest, _machine  # the matrix benchmark's result hash and machine record (same folder)

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = ROOT / "configs" / "dense-6cam.yaml"
RESULTS = ROOT / "benchmarks" / "results"


def baseline_bevpoolv2(rig: Any) -> dict[str, Any]:
    """BEVDet's ``voxel_pooling_prepare_v2`` as written there: all points at once, int64 ranks,
    one argsort (stable here, so the result is comparable), intervals from the sorted ranks."""
    import numpy as np

    from bevcompile.interop.bevpoolv2 import (
        BevPoolOptions,
        frustum_points_bev,
        frustum_rig,
        frustum_shape,
        intervals_of,
        voxel_grid,
    )

    options = BevPoolOptions()
    frig = frustum_rig(rig, options.frustum_mapping)
    grid = voxel_grid(rig, options.z_bins)
    n_cam, n_d, h_f, w_f = frustum_shape(rig)
    points = np.stack([frustum_points_bev(frig, cam)[0] for cam in range(n_cam)])  # (N, D, H, W, 3) float64
    num_points = points.size // 3
    ranks_depth = np.arange(num_points, dtype=np.int64)
    ranks_feat = np.broadcast_to(np.arange(num_points // n_d, dtype=np.int64).reshape(n_cam, 1, h_f, w_f), (n_cam, n_d, h_f, w_f)).reshape(-1)
    scaled = (points.reshape(num_points, 3) - np.asarray(grid.lower)) / np.asarray(grid.step)
    del points
    x_size, y_size, _ = grid.size
    kept = np.ones(num_points, dtype=bool)
    for axis, n in enumerate(grid.size):
        kept &= (scaled[:, axis] > -1.0) & (scaled[:, axis] < n)  # trunc(.) in [0, n); NaN fails
    coor = np.trunc(np.nan_to_num(scaled, nan=-2.0)).astype(np.int64)  # BEVDet's .long()
    del scaled
    coor, ranks_depth, ranks_feat = coor[kept], ranks_depth[kept], ranks_feat[kept]
    ranks_bev = (coor[:, 2] * y_size + coor[:, 1]) * x_size + coor[:, 0]
    order = np.argsort(ranks_bev, kind="stable")
    ranks_bev, ranks_depth, ranks_feat = ranks_bev[order], ranks_depth[order], ranks_feat[order]
    starts, lengths = intervals_of(ranks_bev)
    return {
        "ranks_bev": ranks_bev.astype(np.int32),
        "ranks_depth": ranks_depth.astype(np.int32),
        "ranks_feat": ranks_feat.astype(np.int32),
        "interval_starts": starts,
        "interval_lengths": lengths,
    }


def child(kind: str, config: str, result_file: str, jobs: int = 1) -> None:
    from bevcompile.interop.bevpoolv2 import build_bevpoolv2
    from bevcompile.rig.config import load_config

    rig = load_config(config)
    t0 = time.perf_counter()
    arrays = build_bevpoolv2(rig, jobs=jobs).arrays() if kind == "streamed" else baseline_bevpoolv2(rig)
    seconds = time.perf_counter() - t0
    w_f, h_f = rig.feature_size
    Path(result_file).write_text(json.dumps({
        "build": kind,
        "seconds": seconds,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "points": rig.n_cam * rig.depth.n_bins * w_f * h_f,
        "kept": int(arrays["ranks_bev"].size),
        "intervals": int(arrays["interval_starts"].size),
        "sha256": _digest(*(arrays[name] for name in sorted(arrays))),
    }))


def _spawn(kind: str, config: str, jobs: int = 1) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        result_file = Path(tmp) / "result.json"
        env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        cmd = [sys.executable, __file__, "--child", kind, "--config", config, "--result-file", str(result_file), "--jobs", str(jobs)]
        subprocess.run(cmd, check=True, env=env)
        return dict(json.loads(result_file.read_text()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--config", default=str(DEFAULT_CONFIG))
    parser.add_argument("--repeat", type=int, default=2, help="streamed builds (the fastest is reported)")
    parser.add_argument("--jobs", type=int, default=1, help="threads of the streamed build (the baseline has one)")
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--child", choices=("streamed", "baseline"), help=argparse.SUPPRESS)
    parser.add_argument("--result-file", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child, args.config, args.result_file, args.jobs)
        return 0
    runs = [_spawn("streamed", args.config, args.jobs) for _ in range(max(1, args.repeat))]
    best = min(runs, key=lambda r: r["seconds"])
    base = _spawn("baseline", args.config)
    equal = base["sha256"] == best["sha256"] and len({r["sha256"] for r in runs}) == 1
    streamed_peak = max(r["peak_rss_bytes"] for r in runs)
    summary = {
        "config": args.config,
        "points": best["points"],
        "kept": best["kept"],
        "intervals": best["intervals"],
        "streamed": {"seconds_best": best["seconds"], "seconds_all": [r["seconds"] for r in runs],
                     "peak_rss_bytes": streamed_peak, "sha256": best["sha256"]},
        "baseline": {"seconds": base["seconds"], "peak_rss_bytes": base["peak_rss_bytes"], "sha256": base["sha256"]},
        "speedup": base["seconds"] / best["seconds"],
        "memory_ratio": base["peak_rss_bytes"] / max(1, streamed_peak),
        "equal_to_baseline": equal,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "threads": args.jobs,
        "machine": _machine(),
    }
    print(f"{best['points']:,} frustum points, {best['kept']:,} kept, {best['intervals']:,} intervals")
    print(f"{'build':<10} {'seconds':>9} {'peak RSS':>11}")
    print(f"{'streamed':<10} {best['seconds']:>9.2f} {summary['streamed']['peak_rss_bytes'] / 2**20:>7.0f} MiB")
    print(f"{'baseline':<10} {base['seconds']:>9.2f} {base['peak_rss_bytes'] / 2**20:>7.0f} MiB")
    print(f"speed-up {summary['speedup']:.2f}x, memory {summary['memory_ratio']:.1f}x less, arrays equal: {equal}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from bevcompile.rig.config import load_config

    path = out / f"bevpoolv2-{load_config(args.config).name}.json"
    path.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"wrote {path}")
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
