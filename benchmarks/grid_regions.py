"""BEV regions on dense-6cam, the grid products: what a corridor crop and far-field rings save in
``grid/``, ``gather/`` and ``delta/``, and what they cost.

The four rigs of ``benchmarks/regions.py`` (``full``, ``corridor``, ``rings``, ``both`` =
``configs/dense-6cam-region.yaml``), each built as ``bevcompile grid`` does (the pure build,
:func:`bevcompile.grid.build.build_grid_command`, default options: no extra format, gather layout
``bev``, delta block 10, 1/16 px) in this process. Reported per rig: the sampled cells (camera x height
x kept cell), the bytes of every group (all arrays, uncompressed), the on-device bytes a model
loads for each product (``grid/norm_int16`` + ``grid/valid``; ``gather/index`` + ``weight``;
``gather/index`` + ``weight_u8`` + ``lut``; the delta-LUT's decoder arrays incl. ``cell_pos``), and
the build time (median of 3, and as a ratio to the full grid's, measured in the same run).

Then the cost: seeded features uniform [0, 1) (8 channels), sampled with each store's gather tables
(numpy, float64: ``sum_k weight * features[index]``, summed over cameras), the region's kept cells
expanded to the dense map (``concat(cells, 0)[expand]``) and compared with the full grid's output:
EXACTLY equal on the region's fine cells (asserted) and, on its super-cells' fine cells, the PSNR
(peak = the full output's range there) for white-noise features and for the same features low-passed
(Gaussian, sigma 4 feature px) -- a super-cell samples once, at its centre.

Usage::

    .venv/bin/python benchmarks/grid_regions.py        # ~1 min on a quiet 2-core machine

Prints the markdown table (docs/grid.md "BEV regions") and writes ``benchmarks/results/grid_regions.json``.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results"
REPEATS = 3

from benchmarks._common import markdown_table  # noqa: E402
from benchmarks.regions import CHANNELS, VARIANTS, rig_of, smooth  # noqa: E402


def group_bytes(group: Any, names: tuple[str, ...] | None = None) -> int:
    return sum(int(a.nbytes) for n, a in group.arrays.items() if names is None or n in names)


def sampled(built: Any, features: np.ndarray) -> np.ndarray:
    """``(C, cells)`` float64: the gather tables applied to ``features`` ``(n_cam, C, H_f, W_f)``, summed over cameras."""
    from bevcompile.grid.gather import gather_sample

    tables = built.gather
    n_cam = tables.index.shape[0]
    index = tables.index.reshape(n_cam, -1, 4)
    weight = tables.weight.reshape(n_cam, -1, 4).astype(np.float64)
    return sum(gather_sample(features, index[cam], weight[cam]) for cam in range(n_cam))  # type: ignore[return-value]


def psnr(got: np.ndarray, ref: np.ndarray) -> float:
    peak = float(ref.max() - ref.min()) or 1.0
    mse = float(np.mean((got - ref) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(peak * peak / mse)


def main() -> int:
    from bevcompile.grid.build import GridBuildOptions, build_grid_command
    from bevcompile.rig.region import region_table

    rows: list[dict[str, Any]] = []
    outputs: dict[str, dict[str, np.ndarray]] = {}
    features = None
    for label, region in VARIANTS.items():
        rig = rig_of(region)
        if features is None:
            w_f, h_f = rig.feature_size
            features = np.random.default_rng(0).random((rig.n_cam, CHANNELS, h_f, w_f), dtype=np.float32)
            low = smooth(features)
        times = []
        for _ in range(REPEATS):
            start = time.perf_counter()
            built = build_grid_command(rig, GridBuildOptions(npu=True))
            times.append(time.perf_counter() - start)
        groups = built.groups
        cells = int(np.prod(built.products.valid.shape))
        delta_attrs = groups["delta"].attrs
        row = {
            "variant": label,
            "samples": cells,
            "grid_bytes": group_bytes(groups["grid"]),
            "gather_bytes": group_bytes(groups["gather"]),
            "delta_bytes": group_bytes(groups["delta"]),
            "norm_int16_valid_bytes": group_bytes(groups["grid"], ("norm_int16", "valid")),
            "gather_float32_bytes": group_bytes(groups["gather"], ("index", "weight")),
            "gather_lut_bytes": group_bytes(groups["gather"], ("index", "weight_u8", "lut")),
            "delta_on_device_bytes": int(delta_attrs["on_device_bytes_total"]),
            "delta_escape_blocks": int(delta_attrs["n_escape"]),
            "delta_max_error_px": float(delta_attrs["max_error_px"]),
            "build_s": statistics.median(times),
        }
        table = region_table(rig.bev) if region is not None else None
        dense = {}
        for name, feats in (("white", features), ("smooth", low)):
            out = sampled(built, feats)  # (C, n_h * cells)
            if table is not None:
                out = np.concatenate([out, np.zeros((out.shape[0], 1))], axis=1)[:, table.expand]
            dense[name] = out
        outputs[label] = dense
        if table is not None:
            size = np.r_[table.cells[:, 2], 0][table.expand]
            row["n_kept"] = table.n_kept
            row["fine"], row["coarse"] = size == 1, size > 1
        rows.append(row)
    full = rows[0]
    table_rows = []
    for row in rows:
        label = row["variant"]
        exact = psnr_white = psnr_smooth = "-"
        if label != "full":
            fine, coarse = row.pop("fine"), row.pop("coarse")
            for name in ("white", "smooth"):
                assert np.array_equal(outputs[label][name][:, fine], outputs["full"][name][:, fine]), (label, name)
            exact = "exact"
            if coarse.any():
                psnr_white = f"{psnr(outputs[label]['white'][:, coarse], outputs['full']['white'][:, coarse]):.1f}"
                psnr_smooth = f"{psnr(outputs[label]['smooth'][:, coarse], outputs['full']['smooth'][:, coarse]):.1f}"
            row["psnr_coarse_white_db"], row["psnr_coarse_smooth_db"] = psnr_white, psnr_smooth
        table_rows.append([
            label,
            f"{row['samples']:,}",
            f"{row['norm_int16_valid_bytes'] / 1024:.1f}",
            f"{row['gather_float32_bytes'] / 1024:.1f}",
            f"{row['gather_lut_bytes'] / 1024:.1f}",
            f"{row['delta_on_device_bytes'] / 1024:.1f}",
            f"{(row['grid_bytes'] + row['gather_bytes'] + row['delta_bytes']) / 1024:.1f}",
            f"{row['build_s']:.2f} ({row['build_s'] / full['build_s']:.2f})",
            exact,
            psnr_white,
            psnr_smooth,
        ])
    header = [
        "rig", "samples", "norm_int16+valid KiB", "gather f32 KiB", "gather LUT KiB", "delta KiB",
        "all 3 groups KiB", "build s (vs full)", "fine cells", "PSNR coarse, white", "PSNR coarse, smooth",
    ]
    print(markdown_table(header, table_rows, right=tuple(range(1, 8))))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "grid_regions.json").write_text(json.dumps(rows, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
