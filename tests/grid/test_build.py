"""The grid command's memory estimate is measured, not assumed: on a few sizes the estimate of
:func:`bevcompile.grid.build.check_grid_memory` is at least the peak (``ru_maxrss``) of a real
``bevcompile grid`` process."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from bevcompile.grid.build import GRID_BYTES_BASE, GRID_BYTES_PER_SAMPLE, total_grid_cells
from bevcompile.rig.config import load_config

from ..rigs import NUSCENES_YAML

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
