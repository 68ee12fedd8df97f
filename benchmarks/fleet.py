"""Benchmark of ``bevcompile fleet`` against a shell loop of the single commands (the README's fleet table).

A fleet made from the bundled nuScenes car (the reference, vehicle 0) and N-1 copies with
fixed-seed per-vehicle perturbations: every camera moved by a uniform +-2 cm per ego axis and
rotated by a uniform +-0.3 degrees about each ego axis (``numpy.random.default_rng(SEED + i)``);
every 100th vehicle is a planted outlier (CAM_FRONT yawed 2.5 degrees more: about 1.5 feature
pixels, against at most 0.51 px for the normal spread over the first 84 vehicles). Products ``grid`` +
``matrix --topk 24 --align 16``. Measured, on this machine:

* a shell loop of the single commands (``bevcompile grid``, then ``bevcompile matrix``, one
  process each, per vehicle) over the first ``--shell-sample`` vehicles, extrapolated to N;
* ``bevcompile fleet`` (LocalCluster) with 1 and 2 workers over the first ``--scaling-sample``
  vehicles (throughput against workers), and with ``--workers`` workers over the whole fleet
  (each store also checked by ``inspect``, which the shell loop does not do);
* ``--no-inspect`` with 2 workers on the same sample;
* per-vehicle overhead (wall time x workers / vehicles minus the vehicle's own compute), the
  flagged vehicles against the planted outliers (``--max-shift-px 0.8``), and a projection for
  a 100-node cluster.

It prints a markdown table and writes ``benchmarks/results/fleet-<N>.json``. The machine's load
average is printed with it: on a shared machine the figures are noisy (ratios measured in the same
run are the ones to compare).

Usage::

    .venv/bin/python benchmarks/fleet.py                          # 1,000 vehicles (about an hour on 2 cores)
    .venv/bin/python benchmarks/fleet.py --vehicles 40 --shell-sample 4 --scaling-sample 12   # quick
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
BIN = Path(sys.executable).parent
SEED = 20260
TRANSLATION_M = 0.02
ROTATION_DEG = 0.3
OUTLIER_EVERY = 100
OUTLIER_YAW_DEG = 2.5
MAX_SHIFT_PX = 0.8
PRODUCTS = {"grid": {}, "matrix": {"topk": 24, "align": 16}}
SHELL_COMMANDS = ("grid {rig} --out {out} --quiet", "matrix {rig} --out {out} --topk 24 --align 16 --quiet")
NODES = 100


def _quat_multiply(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Hamilton product ``a (x) b`` of (w, x, y, z) quaternions."""
    aw, ax, ay, az = a
    bw, bx, by, bz = b
    return np.array([
        aw * bw - ax * bx - ay * by - az * bz,
        aw * bx + ax * bw + ay * bz - az * by,
        aw * by - ax * bz + ay * bw + az * bx,
        aw * bz + ax * by - ay * bx + az * bw,
    ])


def _axis_quat(axis: int, degrees: float) -> np.ndarray:
    half = math.radians(degrees) / 2
    q = np.zeros(4)
    q[0], q[1 + axis] = math.cos(half), math.sin(half)
    return q


def perturbed_cameras(cameras: list[dict[str, Any]], index: int) -> list[dict[str, Any]]:
    """Vehicle ``index``'s cameras: +-2 cm per ego axis, +-0.3 degrees about each ego axis (ego-frame
    rotations applied before the camera->ego rotation: q = q_z q_y q_x q_cam), and the planted outlier."""
    rng = np.random.default_rng(SEED + index)
    out = copy.deepcopy(cameras)
    for cam in out:
        q = np.array(cam["rotation_wxyz"], dtype=float)
        for axis in range(3):
            q = _quat_multiply(_axis_quat(axis, rng.uniform(-ROTATION_DEG, ROTATION_DEG)), q)
        if index % OUTLIER_EVERY == OUTLIER_EVERY // 2 and cam["name"] == "CAM_FRONT":
            q = _quat_multiply(_axis_quat(2, OUTLIER_YAW_DEG), q)
        q /= np.linalg.norm(q)
        cam["rotation_wxyz"] = q.tolist()
        cam["translation"] = (np.array(cam["translation"], dtype=float) + rng.uniform(-TRANSLATION_M, TRANSLATION_M, 3)).tolist()
    return out


def write_fleet(folder: Path, n: int) -> tuple[Path, list[str]]:
    """``folder/fleet.yaml`` (template + cameras files) and the complete rig of each vehicle in
    ``folder/rigs/`` (what the shell loop runs). Returns the manifest and the planted outlier ids."""
    from bevcompile.rig.config import default_config_path

    nominal = yaml.safe_load(default_config_path().read_text())
    template = {k: v for k, v in nominal.items() if k not in ("name", "cameras", "sensors", "description")}
    (folder / "calib").mkdir(parents=True)
    (folder / "rigs").mkdir()
    (folder / "model.yaml").write_text(yaml.safe_dump(template, sort_keys=False))
    vehicles, outliers = [], []
    for i in range(n):
        vehicle_id = f"car-{i:04d}"
        cameras = nominal["cameras"] if i == 0 else perturbed_cameras(nominal["cameras"], i)
        if i and i % OUTLIER_EVERY == OUTLIER_EVERY // 2:
            outliers.append(vehicle_id)
        calib = {"cameras": cameras, "sensors": nominal.get("sensors", [])}
        (folder / "calib" / f"{vehicle_id}.yaml").write_text(yaml.safe_dump(calib, sort_keys=False))
        (folder / "rigs" / f"{vehicle_id}.yaml").write_text(yaml.safe_dump({"name": vehicle_id, **calib, **template}, sort_keys=False))
        vehicles.append({"id": vehicle_id, "cameras": f"calib/{vehicle_id}.yaml"})
    manifest = folder / "fleet.yaml"
    manifest.write_text(yaml.safe_dump({"products": PRODUCTS, "template": "model.yaml", "vehicles": vehicles}, sort_keys=False))
    return manifest, outliers


def sub_manifest(manifest: Path, n: int) -> Path:
    data = yaml.safe_load(manifest.read_text())
    data["vehicles"] = data["vehicles"][:n]
    path = manifest.with_name(f"fleet-{n}.yaml")
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def shell_loop(folder: Path, n: int) -> dict[str, Any]:
    """The single commands in a bash loop over vehicles 1..n (fresh processes, as a user's script)."""
    rigs = [folder / "rigs" / f"car-{i:04d}.yaml" for i in range(1, n + 1)]
    out = folder / "shell-out"
    lines = [f"{BIN / 'bevcompile'} {c.format(rig=rig, out=out)}" for rig in rigs for c in SHELL_COMMANDS]
    script = "set -e\n" + "\n".join(lines) + "\n"
    t0 = time.perf_counter()
    subprocess.run(["bash", "-c", script], check=True)
    seconds = time.perf_counter() - t0
    return {"vehicles": n, "seconds": seconds, "per_vehicle_s": seconds / n, "vehicles_per_min": 60 * n / seconds}


def fleet_run(manifest: Path, out: Path, workers: int, *extra: str) -> dict[str, Any]:
    t0 = time.perf_counter()
    result = subprocess.run(
        [str(BIN / "bevcompile"), "fleet", str(manifest), "--out", str(out), "--workers", str(workers), "--max-shift-px", str(MAX_SHIFT_PX), "--json", *extra],
        capture_output=True, text=True,
    )
    seconds = time.perf_counter() - t0
    if result.returncode not in (0, 1):
        raise SystemExit(f"fleet failed (exit {result.returncode}): {result.stderr.strip()}")
    index = json.loads(result.stdout)
    built = [v for v in index["vehicles"] if v["status"] == "built"]
    n = index["counts"]["total"]
    phases: dict[str, float] = {}
    for v in built:
        for k, s in v["phases"].items():
            phases[k] = phases.get(k, 0.0) + s
    task_s = sum(v["seconds"] for v in built) / max(1, len(built))
    return {
        "workers": workers,
        "inspect": "--no-inspect" not in extra,
        "vehicles": n,
        "counts": index["counts"],
        "seconds": seconds,
        "engine_seconds": index["seconds"],
        "vehicles_per_min": 60 * n / seconds,
        "wall_per_vehicle_x_workers_s": seconds * workers / n,
        "task_seconds_mean": task_s,
        "phase_seconds_mean": {k: s / max(1, len(built)) for k, s in phases.items()},
        "flagged": [v["id"] for v in index["vehicles"] if v["flags"]],
        "store_bytes_mean": sum(v["bytes"] or 0 for v in built) / max(1, len(built)),
        "shift_max_px": sorted((v["shift"] or {}).get("max_px") or 0.0 for v in built),
    }


def table(results: dict[str, Any]) -> str:
    shell = results["shell"]
    rows = [
        "| run | vehicles | wall time | vehicles/min | wall s x workers / vehicle | vs shell loop |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
        f"| shell loop: `bevcompile grid` + `bevcompile matrix` per vehicle (measured on {shell['vehicles']}) | {shell['vehicles']} "
        f"| {shell['seconds']:.1f} s | {shell['vehicles_per_min']:.1f} | {shell['per_vehicle_s']:.2f} | 1.00x |",
    ]
    for key in ("scaling_1", "scaling_2", "scaling_2_no_inspect", "full"):
        run = results.get(key)
        if run is None:
            continue
        what = "inspect per store" if run["inspect"] else "--no-inspect"
        rows.append(
            f"| `bevcompile fleet --workers {run['workers']}` (LocalCluster, {what}) | {run['vehicles']} | {run['seconds']:.1f} s "
            f"| {run['vehicles_per_min']:.1f} | {run['wall_per_vehicle_x_workers_s']:.2f} | {run['vehicles_per_min'] / shell['vehicles_per_min']:.2f}x |"
        )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vehicles", type=int, default=1000)
    parser.add_argument("--shell-sample", type=int, default=20)
    parser.add_argument("--scaling-sample", type=int, default=100, help="vehicles of the 1- and 2-worker runs (0: skip)")
    parser.add_argument("--workers", type=int, default=2, help="workers of the full-fleet run")
    parser.add_argument("--folder", type=Path, default=None, help="work folder (default: a temporary one, removed)")
    args = parser.parse_args()
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bevcompile-fleet-bench-") as tmp:
        folder = args.folder or Path(tmp)
        manifest, outliers = write_fleet(folder / "fleet", args.vehicles)
        print(f"fleet of {args.vehicles} vehicles in {folder / 'fleet'}; planted outliers {outliers}", file=sys.stderr, flush=True)
        results: dict[str, Any] = {"shell": shell_loop(folder / "fleet", args.shell_sample)}
        print(f"shell loop: {results['shell']['vehicles_per_min']:.1f} vehicles/min", file=sys.stderr, flush=True)
        if args.scaling_sample:
            sample = sub_manifest(manifest, min(args.scaling_sample, args.vehicles))
            for key, w, extra in (("scaling_1", 1, ()), ("scaling_2", 2, ()), ("scaling_2_no_inspect", 2, ("--no-inspect",))):
                results[key] = fleet_run(sample, folder / f"out-{key}", w, *extra)
                print(f"{key} on {args.scaling_sample}: {results[key]['vehicles_per_min']:.1f} vehicles/min", file=sys.stderr, flush=True)
        results["full"] = fleet_run(manifest, folder / "out", args.workers)
    load_end = os.getloadavg()
    full, shell = results["full"], results["shell"]
    compute = full["task_seconds_mean"]
    results.update(
        vehicles=args.vehicles, planted_outliers=outliers, machine=platform.platform(), cores=os.cpu_count(),
        load_average_start=load_start, load_average_end=load_end,
    )
    print(table(results))
    print()
    print(f"- shell loop extrapolated to {args.vehicles} vehicles: {args.vehicles * shell['per_vehicle_s'] / 60:.1f} min; "
          f"`fleet --workers {full['workers']}`: {full['seconds'] / 60:.1f} min ({full['vehicles_per_min'] / shell['vehicles_per_min']:.2f}x the shell loop's throughput)")
    phases = ", ".join(f"{k} {v:.2f} s" for k, v in full["phase_seconds_mean"].items() if v >= 0.005)
    print(f"- per vehicle in the fleet: task {compute:.2f} s ({phases}); overhead (wall x workers / vehicles - task) "
          f"{full['wall_per_vehicle_x_workers_s'] - compute:.2f} s; the shell loop pays {shell['per_vehicle_s']:.2f} s per vehicle "
          f"for the same two products without inspect (two interpreter start-ups and imports)")
    if "scaling_1" in results and "scaling_2" in results:
        ratio = results["scaling_2"]["vehicles_per_min"] / results["scaling_1"]["vehicles_per_min"]
        print(f"- throughput 2 workers / 1 worker: {ratio:.2f} (on {results['scaling_1']['vehicles']} vehicles; 2.00 = linear)")
    flagged = full["flagged"]
    print(f"- flagged with --max-shift-px {MAX_SHIFT_PX:g}: {len(flagged)} vehicle(s) {flagged}; planted outliers {outliers}: "
          + ("exactly those" if flagged == outliers else "DIFFERENT"))
    shifts = [s for s in full["shift_max_px"] if s]
    if shifts:
        print(f"- max sampling shift vs the reference over the built vehicles: median {np.median(shifts):.3f} px, largest {max(shifts):.3f} px")
    per_node = full["vehicles_per_min"] * (2 / full["workers"])
    store_mb = full["store_bytes_mean"] / 2**20
    print(
        f"- projection, {NODES}-node cluster of machines like this one (2 workers each, the output on shared storage): "
        f"{NODES * per_node:,.0f} vehicles/min, 10,000 vehicles in {10_000 / (NODES * per_node):.1f} min, if the storage takes "
        f"{NODES * per_node * store_mb / 60:.1f} MB/s of {store_mb:.1f} MB stores and the scheduler its "
        f"{NODES * per_node / 60:.0f} tasks/s (Dask's scheduler handles thousands per second)"
    )
    print(f"- load average (1, 5, 15 min) at start {tuple(round(x, 1) for x in load_start)}, at end {tuple(round(x, 1) for x in load_end)} on {os.cpu_count()} cores")
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"fleet-{args.vehicles}.json"
    path.write_text(json.dumps(results, indent=1) + "\n")
    print(f"- results: {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
