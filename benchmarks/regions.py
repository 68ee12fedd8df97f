"""BEV regions on dense-6cam: what a drivable-area crop and far-field rings save, and what they cost.

Four rigs, all ``configs/dense-6cam.yaml`` (the real nuScenes cameras, 200 x 200 cells of 0.5 m,
88.5 M frustum points) with a different ``bev.region``:

* ``full``: no region (every cell at 0.5 m);
* ``corridor``: keep the highway corridor lateral +-12 m, -30 to +80 m (clipped to the grid: -30 to +50 m);
* ``rings``: full resolution within 30 m (Chebyshev), 2 x 2 super-cells to 45 m, 4 x 4 beyond;
* ``both``: corridor and rings = ``configs/dense-6cam-region.yaml``.

For each it builds ``bevcompile matrix --topk 24 --align 16 --tile-rows 64 --quantize int8`` (frustum,
bilinear, ``--normalize mean``; ``--jobs`` threads) and reports the matrix rows, nnz, the bytes of
every product (COO, ELL, tiles, the int8 forms, camera_mass, cells + expand) and the build time
(also as a ratio to the full grid's, measured in the same run: ``--rounds`` interleaved rounds of the
four timed builds, before anything else is built, the fastest of each shown). Then the cost: on the same seeded
features (and depth probabilities), the region output expanded back to the dense map
(``concat(rows, 0)[expand]``) against the full grid's output: on the fine cells of the region it
must be EXACTLY equal (the rows are the full grid's rows; asserted), on the coarse cells the PSNR
(peak = the full output's range over those cells), for white-noise features and for the same
features low-passed over the feature map (Gaussian, sigma 4 feature pixels: spatially correlated, like
a backbone's). The same comparison with ``--topk 0`` uses
``--mode grid`` (the K = 0 frustum matrix of dense-6cam holds ~130 M entries: not built here).

Usage::

    .venv/bin/python benchmarks/regions.py             # ~3 min on a quiet 2-core machine
    .venv/bin/python benchmarks/regions.py --jobs 1

Prints the markdown table (docs/matrix.md "BEV regions") and writes ``benchmarks/results/regions.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results"
CORRIDOR = [[[-30.0, -12.0], [80.0, -12.0], [80.0, 12.0], [-30.0, 12.0]]]
RINGS = [{"beyond_m": 30.0, "factor": 2}, {"beyond_m": 45.0, "factor": 4}]
VARIANTS: dict[str, dict[str, Any] | None] = {
    "full": None,
    "corridor": {"keep": CORRIDOR},
    "rings": {"rings": RINGS},
    "both": {"keep": CORRIDOR, "rings": RINGS},
}
CHANNELS = 8


def rig_of(region: dict[str, Any] | None) -> Any:
    from bevcompile.rig.config import config_to_dict, load_config, parse_config

    data = config_to_dict(load_config(ROOT / "configs" / "dense-6cam.yaml"))
    if region is not None:
        data["bev"]["region"] = region
    return parse_config(data, source="dense-6cam" + ("" if region is None else " + region"))


def inputs(rig: Any, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Seeded features ``(n_cam, C, H_f, W_f)`` uniform [0, 1) and depth ``(n_cam, D, H_f, W_f)`` softmax."""
    w_f, h_f = rig.feature_size
    rng = np.random.default_rng(seed)
    features = rng.random((rig.n_cam, CHANNELS, h_f, w_f), dtype=np.float32)
    logits = rng.standard_normal((rig.n_cam, rig.depth.n_bins, h_f, w_f)).astype(np.float32)
    depth = np.exp(logits - logits.max(axis=1, keepdims=True))
    return features, depth / depth.sum(axis=1, keepdims=True)


def smooth(features: np.ndarray, sigma_px: float = 4.0) -> np.ndarray:
    """The features low-passed over the feature map (Gaussian, ``sigma_px`` feature pixels), rescaled
    to [0, 1): spatially correlated like a backbone's, unlike white noise."""
    from scipy.ndimage import gaussian_filter

    out = gaussian_filter(features.astype(np.float64), sigma=(0, 0, sigma_px, sigma_px))
    low, high = out.min(axis=(2, 3), keepdims=True), out.max(axis=(2, 3), keepdims=True)
    return ((out - low) / np.maximum(high - low, 1e-12)).astype(np.float32)


def rows_output(products: Any, rig: Any, features: np.ndarray, depth: np.ndarray) -> np.ndarray:
    """``(n_rows, C)`` float64: ``W @ X`` of the COO entries (summed per row in entry order)."""
    w_f, h_f = rig.feature_size
    plane = w_f * h_f
    col = products.coo_col.astype(np.int64)
    if products.options.mode == "frustum":
        n_d = rig.depth.n_bins
        cam, rest = col // (n_d * plane), col % (n_d * plane)
        pix = rest % plane
        coeff = products.coo_val.astype(np.float64) * depth.reshape(rig.n_cam, n_d * plane)[cam, rest]
    else:
        cam, pix = col // plane, col % plane
        coeff = products.coo_val.astype(np.float64)
    feats = features.reshape(rig.n_cam, CHANNELS, plane)
    out = np.zeros((products.n_rows, CHANNELS))
    for c in range(CHANNELS):
        out[:, c] = np.bincount(products.coo_row, weights=coeff * feats[cam, c, pix], minlength=products.n_rows)
    return out


def dense_output(products: Any, rig: Any, features: np.ndarray, depth: np.ndarray) -> np.ndarray:
    """``(ny * nx, C)``: the rows, expanded to the dense map when the rig has a region."""
    y = rows_output(products, rig, features, depth)
    if products.expand is None:
        return y
    return y[products.expand.astype(np.int64)]  # the zero row is row n_kept (no entries: 0)


def cost(full: Any, region: Any, rig: Any, features: np.ndarray, depth: np.ndarray) -> dict[str, Any]:
    """Fine cells: exact equality (asserted); coarse cells: PSNR against the full grid."""
    ref = dense_output(full, rig, features, depth)
    got = dense_output(region, rig, features, depth)
    n_kept = region.region_cells.shape[0]
    sizes = np.r_[region.region_cells[:, 2], 0][region.expand.astype(np.int64)]
    fine, coarse = sizes == 1, sizes > 1
    assert np.array_equal(got[fine], ref[fine]), "fine cells must equal the full grid exactly"
    out: dict[str, Any] = {"fine_cells": int(fine.sum()), "coarse_cells": int(coarse.sum()), "outside_cells": int((sizes == 0).sum()), "fine_equal": True, "n_kept": int(n_kept)}
    if coarse.any():
        peak = float(ref[coarse].max() - ref[coarse].min()) or 1.0
        mse = float(np.mean((got[coarse] - ref[coarse]) ** 2))
        out["coarse_psnr_db"] = 10 * np.log10(peak**2 / mse) if mse > 0 else float("inf")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2, help="timed builds of every variant, interleaved; the table shows the fastest")
    args = parser.parse_args()
    from bevcompile.matrix.build import MatrixOptions, build_matrix

    options = MatrixOptions(mode="frustum", topk=24, align=16, tile_rows=64, quantize="int8", normalize="mean")
    grid0 = MatrixOptions(mode="grid", topk=0, align=16, normalize="mean")
    rigs = {name: rig_of(region) for name, region in VARIANTS.items()}
    features, depth = inputs(rigs["full"])
    results: dict[str, Any] = {}
    built: dict[str, Any] = {}
    built0: dict[str, Any] = {}
    seconds: dict[str, list[float]] = {name: [] for name in rigs}
    for _round in range(args.rounds):  # the timed builds first (nothing else held), each variant once per round
        for name, rig in rigs.items():
            built.pop(name, None)
            t0 = time.perf_counter()
            built[name] = build_matrix(rig, options, jobs=args.jobs)
            seconds[name].append(time.perf_counter() - t0)
            print(f"built {name}: {built[name].n_rows:,} rows, {built[name].figures.nnz:,} nnz, {seconds[name][-1]:.1f} s", file=sys.stderr, flush=True)
    for name, rig in rigs.items():
        products = built[name]
        built0[name] = build_matrix(rig, grid0, jobs=args.jobs)
        f = products.figures
        results[name] = {
            "rows": products.n_rows,
            "nnz": f.nnz,
            "product_bytes": dict(f.product_bytes),
            "build_seconds": min(seconds[name]),
            "build_seconds_rounds": seconds[name],
            "peak_rss_bytes": f.peak_rss_bytes,
        }
    for name in rigs:
        if name == "full":
            continue
        results[name]["cost_topk24"] = cost(built["full"], built[name], rigs[name], features, depth)
        results[name]["cost_topk24_smooth"] = cost(built["full"], built[name], rigs[name], smooth(features), depth)
        results[name]["cost_grid_topk0"] = cost(built0["full"], built0[name], rigs[name], features, depth)
        results[name]["cost_grid_topk0_smooth"] = cost(built0["full"], built0[name], rigs[name], smooth(features), depth)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "regions.json").write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    print_table(results)


def _kib(n: int) -> str:
    return f"{n / 1024:,.0f} KiB" if n < 10 * 2**20 else f"{n / 2**20:,.1f} MiB"


def print_table(results: dict[str, Any]) -> None:
    full = results["full"]
    products = ["coo", "ell", "tiles", "ell_int8", "tiles_int8", "camera_mass"]
    head = [
        "region", "rows", "nnz", *products, "cells + expand", "build s (x full)", "fine cells = full",
        "coarse PSNR, K=24 (noise / smooth)", "coarse PSNR, grid K=0 (noise / smooth)",
    ]
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---" if i == 0 else "---:" for i in range(len(head))) + "|")
    for name, r in results.items():
        b = r["product_bytes"]
        region_bytes = b.get("cells", 0) + b.get("expand", 0)
        cells = [
            name,
            f"{r['rows']:,} ({r['rows'] / full['rows']:.0%})",
            f"{r['nnz']:,}",
            *[f"{_kib(b[p])}" + ("" if name == "full" else f" ({b[p] / full['product_bytes'][p]:.0%})") for p in products],
            _kib(region_bytes) if region_bytes else "-",
            f"{r['build_seconds']:.1f} ({r['build_seconds'] / full['build_seconds']:.2f})",
        ]
        if name == "full":
            cells += ["-", "-", "-"]
        else:
            c24 = r["cost_topk24"]

            def psnr(a: dict[str, Any], b: dict[str, Any]) -> str:
                return f"{a['coarse_psnr_db']:.1f} / {b['coarse_psnr_db']:.1f} dB" if "coarse_psnr_db" in a else "no coarse cell"

            cells += [
                f"exact ({c24['fine_cells']:,} cells)",
                psnr(c24, r["cost_topk24_smooth"]),
                psnr(r["cost_grid_topk0"], r["cost_grid_topk0_smooth"]),
            ]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    if "--table" in sys.argv:
        print_table(json.loads((RESULTS / "regions.json").read_text()))
    else:
        main()
