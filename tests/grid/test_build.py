"""The library behind ``bevcompile grid``: the options the CLI and a fleet manifest both give
(:func:`grid_command_options`), and the ``build_options`` a build records (what ``fleet --resume``
compares), pinned against real builds; and the grid command's memory estimate, measured, not
assumed: on a few sizes the estimate of :func:`bevcompile.grid.build.check_grid_memory` is at least
the peak (``ru_maxrss``) of a real ``bevcompile grid`` process."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from bevcompile.errors import UsageError
from bevcompile.grid.build import (
    GRID_BYTES_BASE,
    GRID_BYTES_PER_SAMPLE,
    GridBuildOptions,
    grid_command_options,
    run_grid,
    total_grid_cells,
)
from bevcompile.rig.config import load_config
from bevcompile.store.zarr_io import open_store

from ..rigs import NUSCENES_YAML, small_rig


@pytest.mark.parametrize(
    "given",
    [
        {},
        {"align_corners": True, "formats": ("UQ12", "opencv", "norm_int16"), "align": 32, "order": "Cache"},
        {"formats": ("pixel_q",), "frac_bits": 6, "block": 4, "max_error_px": 0.5},
        {"formats": ("pixel_q", "norm_q16"), "order": "feature", "block": 16, "max_error_px": 1},
    ],
)
def test_recorded_build_options_equal_what_a_build_records(tmp_path: Path, given: dict) -> None:  # type: ignore[type-arg]
    rig = small_rig()
    options = grid_command_options(**given).validated()
    run_grid(rig, tmp_path, **options.run_kwargs())
    reader = open_store(tmp_path / "small.zarr")
    recorded = {group: reader.group_attrs(group)["build_options"] for group in reader.groups()}
    assert options.recorded_build_options(rig) == recorded


def test_command_options_take_enumerated_values_in_any_case_and_the_cli_defaults() -> None:
    options = grid_command_options(formats=("OpenCV", "UQ12"), order="CACHE")
    assert options.formats == ("opencv", "uq12") and options.order == "cache" and options.npu is True
    assert options.validated().formats == ("uq12", "opencv")  # canonical order (FORMATS), as the store records it
    assert grid_command_options() == GridBuildOptions(npu=True)
    with pytest.raises(UsageError, match="unknown --format 'nope'"):
        grid_command_options(formats=("nope",)).validated()
    with pytest.raises(UsageError, match="--order must be one of row, cache, feature, got 'diagonal'"):
        grid_command_options(order="diagonal").validated()


MEASURE = (
    "import resource, subprocess, sys\n"
    "subprocess.run([sys.argv[1], 'grid', sys.argv[2], '--out', sys.argv[3], '--quiet'], check=True)\n"
    "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)\n"
)


@pytest.mark.parametrize("cells_per_side", [128, 400])
def test_the_grid_memory_estimate_is_not_under_the_measured_peak(tmp_path: Path, cells_per_side: int) -> None:
    step = 102.4 / cells_per_side
    text = re.sub(r"x: \[[^\]]*\]", f"x: [-51.2, 51.2, {step!r}]", NUSCENES_YAML.read_text(), count=1)
    text = re.sub(r"y: \[[^\]]*\]", f"y: [-51.2, 51.2, {step!r}]", text, count=1)
    config = tmp_path / "rig.yaml"
    config.write_text(text)
    rig = load_config(config)
    estimate = GRID_BYTES_BASE + GRID_BYTES_PER_SAMPLE * total_grid_cells(rig)
    bevcompile = Path(sys.executable).parent / "bevcompile"
    result = subprocess.run([sys.executable, "-c", MEASURE, str(bevcompile), str(config), str(tmp_path / "out")],
                            capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr
    peak = int(result.stdout)
    assert peak <= estimate, f"{cells_per_side}^2: peak {peak / 2**20:.0f} MiB > estimate {estimate / 2**20:.0f} MiB"
