"""Ray-mode builds of the dense rig with non-uniform depth priors (docs/matrix.md "Ray mode").

Builds ``configs/dense-6cam.yaml`` in ray mode, ``--topk 24 --align 16``, ``--jobs 1``, for the
priors a user brings: uniform, a ``(D,)`` prior ``linspace(2, 0.5, D)`` (nearer bins likelier), an
``(n_cam, D)`` and an ``(n_cam, D, H_f, W_f)`` prior drawn uniform in ``[0.2, 1)`` (seed 0), with
``--splat nearest`` and, for the ``(D,)`` prior, ``bilinear``. Each build runs in a fresh process
with one BLAS thread; the table gives its wall time (the prior's normalisation included), the
candidates the exact sort saw and the phase times.

Usage::

    .venv/bin/python benchmarks/ray_priors.py              # ~30 s; writes benchmarks/results/ray_priors.json
    .venv/bin/python benchmarks/ray_priors.py --out /tmp/x.json   # e.g. another checkout on PYTHONPATH
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CASES = (("nearest", "uniform"), ("nearest", "depth"), ("nearest", "camera"), ("nearest", "pixel"), ("bilinear", "depth"))
NAMES = {"uniform": "uniform", "depth": "`(D,)`", "camera": "`(n_cam, D)`", "pixel": "per-pixel"}


def child(splat: str, kind: str, out: str) -> None:
    import time

    import numpy as np

    from bevcompile.matrix.build import MatrixOptions, build_matrix
    from bevcompile.matrix.prior import DepthPrior
    from bevcompile.rig.config import load_config

    rig = load_config(ROOT / "configs" / "dense-6cam.yaml")
    d = rig.depth.n_bins
    w_f, h_f = rig.feature_size
    shapes = {"camera": (rig.n_cam, d), "pixel": (rig.n_cam, d, h_f, w_f)}
    raw = None if kind == "uniform" else np.linspace(2.0, 0.5, d) if kind == "depth" else np.random.default_rng(0).uniform(0.2, 1.0, shapes[kind])
    prior = DepthPrior(raw=raw)
    t0 = time.perf_counter()
    p = build_matrix(rig, MatrixOptions(mode="ray", topk=24, align=16, splat=splat, depth_prior=prior.token), jobs=1, depth_prior=prior)
    seconds = time.perf_counter() - t0
    phases = {k: round(v, 3) for k, v in p.extra["phase_seconds"].items()}
    Path(out).write_text(json.dumps({"splat": splat, "prior": kind, "seconds": seconds, "candidates": p.figures.n_candidates, "nnz": p.figures.nnz, "phases": phases}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "ray_priors.json")
    parser.add_argument("--child", nargs=3, metavar=("SPLAT", "PRIOR", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for splat, kind in CASES:
            out = Path(tmp) / f"{splat}-{kind}.json"
            subprocess.run([sys.executable, __file__, "--child", splat, kind, str(out)], check=True, env=env)
            rows.append(json.loads(out.read_text()))
    print("| --splat | prior | build | candidates sorted | nnz |")
    print("|---|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['splat']} | {NAMES[r['prior']]} | {r['seconds']:.1f} s | {r['candidates'] / 1e6:.2f} M | {r['nnz']:,} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"load_average": os.getloadavg(), "builds": rows}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
