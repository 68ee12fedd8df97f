"""``bevcompile diff`` on a recalibration, bundled rig and dense rig: the cost table of ``docs/diff.md``.

Usage::

    .venv/bin/python benchmarks/diff_costs.py     # ~1-2 min; machine-dependent (says the load it ran under)

The recalibration is the one ``docs/diff.md`` walks through: CAM_FRONT moved +2 cm along ego y and
yawed +0.2 deg about the ego z axis (``q_new = q_z(0.2 deg) * q_old``). For each rig both stores are
built with the CLI (``grid``, then ``matrix --topk 24 --align 16``) and ``bevcompile diff NOMINAL
RECAL --json`` runs in a fresh process (its wall time, CPU time and peak RSS). The dense rig is
``configs/dense-6cam.yaml`` with four sampling heights.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml
from _common import CONFIGS, bevcompile, machine, markdown_table

from bevcompile.rig.config import config_to_dict, load_config

YAW_DEG = 0.2
MOVE_Y_M = 0.02


def recalibrated(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` (a config as plain data) with camera 0 yawed by YAW_DEG about ego z and moved MOVE_Y_M along ego y."""
    out = json.loads(json.dumps(data))
    camera = out["cameras"][0]
    w, x, y, z = camera["rotation_wxyz"]
    c, s = math.cos(math.radians(YAW_DEG) / 2), math.sin(math.radians(YAW_DEG) / 2)
    camera["rotation_wxyz"] = [c * w - s * z, c * x - s * y, c * y + s * x, c * z + s * w]  # q_z(yaw) * q
    camera["translation"][1] += MOVE_Y_M
    return out


def _write(data: dict[str, Any], path: Path) -> str:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return str(path)


def measure(label: str, data: dict[str, Any], tmp: Path) -> list[str]:
    configs = {"nominal": _write(data, tmp / f"{label}-nominal.yaml"), "recal": _write(recalibrated(data), tmp / f"{label}-recal.yaml")}
    for side, config in configs.items():
        out = str(tmp / label / side)
        bevcompile("grid", config, "--out", out, "--quiet")
        bevcompile("matrix", config, "--out", out, "--topk", "24", "--align", "16", "--quiet")
    name = data["name"]
    stores = [str(tmp / label / side / f"{name}.zarr") for side in ("nominal", "recal")]
    cost = bevcompile("diff", *stores, "--json")
    report = json.loads(cost.stdout)
    front = report["cameras"][0]
    w_f = report["feature_size"][0]
    others = max(c["shift_max_px"] or 0.0 for c in report["cameras"][1:])
    matrix = report["matrix"]
    return [
        label,
        f"{w_f}x{report['feature_size'][1]}, {len(report['heights'])} height(s)",
        f"{matrix['nnz_old']:,}",
        f"{front['shift_max_px']:.4g} / {front['shift_mean_px']:.3g} px",
        f"{front['nearest_pixel_changed']:,} of {front['cells_both']:,} ({100 * front['nearest_pixel_changed_fraction']:.1f} %)",
        f"{others:g}",
        f"{cost.wall_s:.1f} s",
        f"{cost.cpu_s:.1f} s",
        f"{cost.peak_rss_bytes / 1e6:.0f} MB",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.parse_args(argv)
    load_at_start = machine()
    nuscenes = config_to_dict(load_config(CONFIGS / "nuscenes.yaml"))
    dense = config_to_dict(load_config(CONFIGS / "dense-6cam.yaml"))
    dense["bev"]["heights"] = [-1.0, 0.0, 1.0, 2.0]
    with tempfile.TemporaryDirectory() as tmp:
        rows = [measure("`nuscenes.yaml`", nuscenes, Path(tmp)), measure("`dense-6cam.yaml`, 4 heights", dense, Path(tmp))]
    print(f"<!-- diff costs (measured on {load_at_start}) -->")
    print(
        markdown_table(
            ["rig", "feature map", "matrix nnz", "CAM_FRONT shift max / mean", "nearest pixel changed", "other cameras", "wall", "CPU", "peak RSS"],
            rows,
            right=(2, 3, 4, 5, 6, 7, 8),
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
