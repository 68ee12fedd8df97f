"""The measured tables of ``docs/grid.md``, printed in markdown exactly as the page shows them.

Usage::

    .venv/bin/python benchmarks/grid_figures.py                 # the machine-independent tables (~10 s)
    .venv/bin/python benchmarks/grid_figures.py --costs         # plus build time and memory (machine-dependent)
    .venv/bin/python benchmarks/grid_figures.py --costs --stress  # plus a 6 x 4 x 512 x 512 grid (~1.5 GiB)

Every figure comes from the library as ``bevcompile grid`` computes it (``build_grid_command``) on
the shipped configs; the gather-vs-PyTorch figures compare with ``torch.nn.functional.grid_sample``
(the independent reference), on the features ``tests/grid/test_gather.py`` uses.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import tracemalloc
from typing import Any

import numpy as np
from _common import CONFIGS, bevcompile, machine, markdown_table, mib

from bevcompile.grid.build import GridBuildOptions, build_grid_command
from bevcompile.grid.delta import encode_delta
from bevcompile.grid.gather import gather_sample
from bevcompile.grid.ipm import compute_sampling_grid, feature_px_to_norm
from bevcompile.rig.config import RigConfig, config_to_dict, load_config, parse_config

RIGS = ("nuscenes.yaml", "nuscenes_scene0061_distorted.yaml", "nuscenes_200x200.yaml")
FORMATS = ("uq12", "opencv", "pixel_q", "norm_q16")


def _rig(name: str) -> RigConfig:
    return load_config(CONFIGS / name)


def _shape(rig: RigConfig) -> str:
    w_f, h_f = rig.feature_size
    heights = f" x {len(rig.bev.heights)} heights" if len(rig.bev.heights) > 1 else ""
    return f"{rig.n_cam} x {rig.bev.ny} x {rig.bev.nx}{heights} @ {rig.bev.x.step:g} m, {w_f}x{h_f} map"


def delta_table() -> str:
    rows = []
    for name in RIGS:
        rig = _rig(name)
        s = compute_sampling_grid(rig)
        enc = encode_delta(s.coords_feature_px, s.valid, s.feature_size)
        rows.append([
            f"`configs/{name}` ({_shape(rig)})",
            f"{enc.on_device_total:,} B",
            f"{enc.norm_int16_bytes:,} B",
            f"{100 * enc.ratio:.2f} %",
            f"{enc.max_error_px:.4f}",
            f"{enc.n_predictor_only} / {enc.n_residual} / {enc.n_escape} ({enc.n_active} of {enc.n_blocks} blocks active)",
        ])
    return markdown_table(
        ["rig", "delta on-device", "norm_int16", "ratio", "max error [px]", "rows: predictor-only / residual / escape"], rows, right=(1, 2, 3, 4)
    )


def block_table() -> str:
    rig = _rig("nuscenes.yaml")
    s = compute_sampling_grid(rig)
    rows = []
    for block in (8, 10, 16):
        enc = encode_delta(s.coords_feature_px, s.valid, s.feature_size, block=block)
        b = enc.on_device_bytes
        rows.append([
            f"{block}" + (" (default)" if block == 10 else ""),
            f"{enc.on_device_total:,} B",
            f"{100 * enc.ratio:.2f} %",
            f"{enc.max_error_px:.4f}",
            f"{b['res8']:,}",
            f"{b['coef']:,}",
            f"{b['basis']:,}",
            f"{b['block_slot']:,}",
            f"{b['scale']:,}",
            f"{b['res8_slot'] + b['res16_slot']:,}",
            f"{b['res16']:,}",
        ])
    return markdown_table(
        ["`--block`", "on-device", "vs norm_int16", "max error [px]", "res8", "coef", "basis", "block_slot", "scale", "slots", "res16"],
        rows,
        right=tuple(range(1, 11)),
    )


def order_table() -> str:
    rows = []
    for name, label in (("nuscenes.yaml", "nuScenes 128x128 (`--align 32`)"), ("nuscenes_200x200.yaml", "200x200 @ 0.5 m (`--align 32`)")):
        rig = _rig(name)
        s = compute_sampling_grid(rig)
        cells = []
        for order in ("row", "cache", "feature"):
            attrs = build_grid_command(rig, GridBuildOptions(align=32, order=order), sampling=s).groups["gather"].attrs
            cells.append(f"{attrs['mean_index_jump_gather_order']:.2f} / {attrs['band_switches_gather_order']}")
        rows.append([label, *cells])
    return markdown_table(["config", "`--order row`", "`--order cache`", "`--order feature`"], rows, right=(1, 2, 3))


def _format_errors(rig: RigConfig, align_corners: bool, sampling: Any) -> dict[str, tuple[float, int, dict[str, Any]]]:
    build = build_grid_command(rig, GridBuildOptions(align_corners=align_corners, formats=FORMATS, npu=False), sampling=sampling)
    out = {row["name"]: (row["max_error_px"], row["saturated_valid_cells"], {}) for row in build.summary["formats"]}
    for fmt in build.formats:
        out[fmt.name] = (fmt.max_error_px, int(fmt.attrs["saturated_valid_cells"]), dict(fmt.attrs))
    return out


def formats_table() -> str:
    columns: list[tuple[str, dict[str, tuple[float, int, dict[str, Any]]]]] = []
    for name, align_corners in (("nuscenes.yaml", False), ("nuscenes.yaml", True), ("nuscenes_scene0061_distorted.yaml", False), ("nuscenes_200x200.yaml", False)):
        rig = _rig(name)
        columns.append((f"`{name}` align_corners {align_corners}", _format_errors(rig, align_corners, compute_sampling_grid(rig))))
    rows = []
    for fmt in ("norm_int16", *FORMATS):
        label = fmt
        if fmt == "pixel_q":
            label = f"pixel_q (f = {columns[0][1]['pixel_q'][2]['frac_bits']}, J5 default)"
        cells = []
        for _, errors in columns:
            error, saturated, _ = errors[fmt]
            cells.append(f"{error:.3g}" + (f" ({saturated:,} saturated)" if saturated else ""))
        rows.append([label, *cells])
    rows.append([
        "opencv: cells encoded differently from float64",
        *(str(errors["opencv"][2]["cells_differing_from_float64_encoding"]) for _, errors in columns),
    ])
    return markdown_table(["format", *(c for c, _ in columns)], rows, right=(1, 2, 3, 4))


def gather_table() -> str:
    import torch
    import torch.nn.functional as F

    rig = _rig("nuscenes.yaml")
    s = compute_sampling_grid(rig)
    w_f, h_f = rig.feature_size
    features = np.random.default_rng(3).random((rig.n_cam, 5, h_f, w_f), dtype=np.float32)  # as tests/grid/test_gather.py

    def torch_sample(norm: np.ndarray, align_corners: bool, dtype: torch.dtype) -> np.ndarray:
        n_cam, n_h, ny, nx, _ = norm.shape
        out = F.grid_sample(
            torch.from_numpy(features).to(dtype),
            torch.from_numpy(np.ascontiguousarray(norm.reshape(n_cam, n_h * ny, nx, 2))).to(dtype),
            mode="bilinear", padding_mode="zeros", align_corners=align_corners,
        ).numpy().astype(np.float64)  # (n_cam, C, n_h*ny, nx)
        return out.reshape(n_cam, -1, n_h, ny, nx).transpose(1, 0, 2, 3, 4)  # (C, n_cam, n_h, ny, nx)

    rows = []
    for align_corners in (False, True):
        build = build_grid_command(rig, GridBuildOptions(align_corners=align_corners), sampling=s)
        tables = build.gather
        assert tables is not None
        got = gather_sample(features, tables.index, tables.weight)
        exact = feature_px_to_norm(s.coords_feature_px, s.feature_size, align_corners)
        stored = build.products.norm  # grid/norm, float32
        attrs = build.groups["gather"].attrs
        rows.append([
            str(align_corners),
            f"{attrs['weight_float32_max_error']:.3g}",
            f"{np.abs(got - torch_sample(exact, align_corners, torch.float64)).max():.2g}",
            f"{np.abs(got - torch_sample(stored, align_corners, torch.float32)).max():.2g}",
            f"{np.abs(got - torch_sample(stored, align_corners, torch.float64)).max():.2g}",
            f"{attrs['lut_max_weight_error']:.3g} / {attrs['lut_max_sample_error_unit_features']:.3g}",
        ])
    return markdown_table(
        [
            "align_corners",
            "float32 weights vs float64",
            "vs torch float64, exact norm",
            "vs torch float32, stored `grid/norm`",
            "vs torch float64, stored `grid/norm`",
            "LUT weight / worst-case sample error",
        ],
        rows,
        right=(1, 2, 3, 4, 5),
    )


def _stress_rig() -> RigConfig:
    data = config_to_dict(_rig("nuscenes.yaml"))
    data["name"] = "nuscenes-stress"
    data["bev"]["x"] = [-51.2, 51.2, 0.2]
    data["bev"]["y"] = [-51.2, 51.2, 0.2]
    data["bev"]["heights"] = [-1.0, 0.0, 1.0, 2.0]
    return parse_config(data, source="nuscenes.yaml, BEV 512 x 512 x 4 heights")


def costs_table(stress: bool) -> str:
    options = GridBuildOptions(formats=FORMATS, align=32, order="cache")
    rigs = [("`configs/nuscenes.yaml`", _rig("nuscenes.yaml")), ("`configs/nuscenes_200x200.yaml`", _rig("nuscenes_200x200.yaml"))]
    if stress:
        rigs.append(("stress: nuScenes cameras, 512 x 512 BEV x 4 heights", _stress_rig()))
    rows = []
    for label, rig in rigs:
        build_grid_command(rig, options)  # warm-up (imports, first-touch)
        wall, cpu = time.perf_counter(), time.process_time()
        build = build_grid_command(rig, options)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        tracemalloc.start()  # a second build: tracing slows allocations down, so it is not timed
        build = build_grid_command(rig, options)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        n_bytes = sum(a.nbytes for g in build.groups.values() for a in g.arrays.values())
        cells = rig.n_cam * len(rig.bev.heights) * rig.bev.ny * rig.bev.nx
        ratio = build.summary["delta"]["ratio_vs_norm_int16"]
        rows.append([label, f"{cells:,}", f"{cpu:.2f} s", f"{wall:.2f} s", mib(peak), mib(n_bytes), f"{100 * ratio:.1f} %"])
    with tempfile.TemporaryDirectory() as tmp:
        args = ["grid", str(CONFIGS / "nuscenes.yaml"), *(a for f in FORMATS for a in ("--format", f)), "--align", "32", "--order", "cache"]
        cost = bevcompile(*args, "--out", tmp, "--quiet")
    table = markdown_table(
        ["build (all formats, `--align 32 --order cache`)", "cells", "CPU", "wall", "peak (tracemalloc)", "arrays", "delta vs norm_int16"],
        rows,
        right=(1, 2, 3, 4, 5, 6),
    )
    process = (
        f"The whole `bevcompile grid configs/nuscenes.yaml` process with the same options (start-up, imports, build, "
        f"zarr write): {cost.wall_s:.1f} s wall, {cost.cpu_s:.1f} s CPU, {cost.peak_rss_bytes / 1e6:.0f} MB peak RSS."
    )
    return table + "\n\n" + process


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--costs", action="store_true", help="also time the builds (machine-dependent)")
    parser.add_argument("--stress", action="store_true", help="with --costs: add the 512 x 512 x 4-height grid")
    args = parser.parse_args(argv)
    sections = [
        ("delta-LUT size on the shipped configs (default `--block 10 --max-error-px 0.0625`)", delta_table),
        ("delta-LUT block size on nuScenes (bytes of each array the decoder reads)", block_table),
        ("gather row order: mean index jump between valid rows / 8-row band switches", order_table),
        ("fixed-point formats: max error over valid cells [feature px] vs the float64 grid", formats_table),
        ("gather tables vs torch.nn.functional.grid_sample (nuScenes, 5 channels uniform [0, 1))", gather_table),
    ]
    if args.costs:
        sections.append((f"build cost ({machine()})", lambda: costs_table(args.stress)))
    for title, make in sections:
        print(f"<!-- {title} -->")
        print(make())
        print()
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
