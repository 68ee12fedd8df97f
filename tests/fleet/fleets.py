"""Small fleets for the fleet tests: the 4-camera test rig with fixed-seed per-vehicle pose
perturbations, planted outliers, a model template, and single-command references."""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from typer.testing import CliRunner

from bevcompile.cli import app

from ..rigs import small_rig_data, tree_digest

PRODUCTS: dict[str, Any] = {"grid": {"format": ["uq12"]}, "matrix": {"topk": 8, "align": 16}}
GRID_ARGS = ["grid", "--format", "uq12"]
MATRIX_ARGS = ["matrix", "--topk", "8", "--align", "16"]
OUTLIER_YAW_DEG = 4.0
"""A planted outlier: one camera yawed this much (the normal spread is +-0.3 degrees)."""
SHIFT_GATE_PX = 0.3
"""Between the normal spread's largest shift (0.134 feature px on the 12x8 map over seeds 1..59)
and a planted outlier's (0.747 px)."""


def _yaw(matrix: list[list[float]], degrees: float, shift_m: Sequence[float] = (0.0, 0.0, 0.0)) -> list[list[float]]:
    """``sensor2ego`` rotated about the ego z axis and moved (ego frame)."""
    m = np.array(matrix, dtype=float)
    c, s = math.cos(math.radians(degrees)), math.sin(math.radians(degrees))
    m[:3, :3] = np.array([[c, -s, 0.0], [s, c, 0.0], [0.0, 0.0, 1.0]]) @ m[:3, :3]
    m[:3, 3] += np.asarray(shift_m, dtype=float)
    return m.tolist()


def perturbed_cameras(seed: int, *, outlier: bool = False) -> list[dict[str, Any]]:
    """The test rig's cameras, each moved by up to +-2 cm per axis and yawed by up to +-0.3 degrees
    (``numpy.random.default_rng(seed)``); an ``outlier`` has camera 1 (LEFT) yawed 4 degrees more."""
    rng = np.random.default_rng(seed)
    cameras = copy.deepcopy(small_rig_data()["cameras"])
    for i, cam in enumerate(cameras):
        yaw = rng.uniform(-0.3, 0.3) + (OUTLIER_YAW_DEG if outlier and i == 1 else 0.0)
        cam["sensor2ego"] = _yaw(cam["sensor2ego"], yaw, rng.uniform(-0.02, 0.02, 3))
    return cameras


def template() -> dict[str, Any]:
    data = small_rig_data()
    return {k: v for k, v in data.items() if k not in ("name", "cameras")}


def write_fleet(
    folder: Path,
    n: int,
    *,
    outliers: Iterable[int] = (),
    bad: Iterable[int] = (),
    products: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
) -> Path:
    """``folder/fleet.yaml``: vehicle 0 the nominal rig (complete rig file, the reference), the
    others perturbed cameras files with the template; ``bad`` vehicles have a broken quaternion."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "calib").mkdir(exist_ok=True)
    (folder / "model.yaml").write_text(yaml.safe_dump(template(), sort_keys=False))
    nominal = small_rig_data()
    nominal["name"] = "nominal"
    (folder / "calib" / "nominal.yaml").write_text(yaml.safe_dump(nominal, sort_keys=False))
    outliers, bad = set(outliers), set(bad)
    vehicles: list[dict[str, Any]] = [{"id": "car-0000", "rig": "calib/nominal.yaml"}]
    for i in range(1, n):
        cameras = perturbed_cameras(i, outlier=i in outliers)
        if i in bad:
            cameras[2].pop("sensor2ego")
            cameras[2]["rotation_wxyz"] = [1.0, 0.5, 0.0, 0.0]
            cameras[2]["translation"] = [0.0, 0.0, 1.5]
        (folder / "calib" / f"car-{i:04d}.yaml").write_text(yaml.safe_dump({"cameras": cameras}, sort_keys=False))
        vehicles.append({"id": f"car-{i:04d}", "cameras": f"calib/car-{i:04d}.yaml"})
    manifest = {"products": products if products is not None else PRODUCTS, "template": "model.yaml", "vehicles": vehicles, **(extra or {})}
    path = folder / "fleet.yaml"
    path.write_text(yaml.safe_dump(manifest, sort_keys=False))
    return path


def single_command_store(rig_file: Path, out: Path, commands: Sequence[Sequence[str]] = (GRID_ARGS, MATRIX_ARGS)) -> Path:
    """Build a store the way a user would with the single commands, in order (CliRunner)."""
    runner = CliRunner()
    name = yaml.safe_load(rig_file.read_text())["name"]
    store = out / f"{name}.zarr"
    for command in commands:
        args = [command[0], str(store) if command[0] == "export-interop" else str(rig_file), *command[1:]]
        if command[0] != "export-interop":
            args += ["--out", str(out)]
        result = runner.invoke(app, [*args, "--quiet"])
        assert result.exit_code == 0, result.output
    return store


def assert_same_bytes_as_single_commands(fleet_out: Path, ids: Iterable[str], reference_out: Path, commands: Sequence[Sequence[str]] = (GRID_ARGS, MATRIX_ARGS)) -> None:
    """Every listed vehicle's fleet store equals, file for file, the single commands run on its resolved rig."""
    for vehicle in ids:
        single = single_command_store(fleet_out / "rigs" / f"{vehicle}.yaml", reference_out, commands)
        fleet_digest, single_digest = tree_digest(fleet_out / f"{vehicle}.zarr"), tree_digest(single)
        differing = sorted(k for k in fleet_digest.keys() | single_digest.keys() if fleet_digest.get(k) != single_digest.get(k))
        assert not differing, f"{vehicle}: {len(differing)} file(s) differ, e.g. {differing[:3]}"
