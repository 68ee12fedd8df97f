"""`bevcompile verify` from the command line: exit codes and one-line messages."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from bevcompile.cli import app

from .. import damage, rigs
from . import flat

runner = CliRunner()


def test_verify_prints_one_row_per_product_and_verbose_one_per_camera(small_store: Path) -> None:
    result = runner.invoke(app, ["verify", str(small_store), "--seed", "3", "--channels", "2"])
    assert result.exit_code == 0, result.output
    out = flat(result.stdout)
    for text in ("grid/coords", "grid/norm", "grid/norm_int16", "torch grid_sample(grid/norm)", "PSNR dB", "max abs", "rows passed"):
        assert text in out, text
    assert "seed 3" in out and "channels 2" in out
    assert "FRONT" not in out  # cameras only with --verbose
    row = next(line for line in result.stdout.splitlines() if line.startswith("│grid/norm "))
    assert flat(row).endswith("│ <= 1e-05 │ pass │"), row
    verbose = runner.invoke(app, ["verify", str(small_store), "--seed", "3", "--channels", "2", "--verbose"])
    assert verbose.exit_code == 0 and "FRONT" in verbose.stdout and "RIGHT" in verbose.stdout
    assert verbose.stdout.splitlines()[-1] == result.stdout.splitlines()[-1]  # the same total


def test_verify_config_json_and_staleness(small_store: Path, tmp_path: Path) -> None:
    config = rigs.write_yaml(tmp_path / "rig.yaml", rigs.small_rig_data())
    result = runner.invoke(app, ["verify", str(config), "--out", str(small_store.parent), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["passed"] is True and report["store"] == str(small_store)
    assert {row["product"] for row in report["rows"]} >= {"grid/norm", "torch grid_sample(grid/norm)"}
    data = rigs.small_rig_data()
    data["cameras"][1]["intrinsic"][0][2] = 96.0
    stale = rigs.write_yaml(tmp_path / "stale.yaml", data)
    result = runner.invoke(app, ["verify", str(stale), "--out", str(small_store.parent)])
    assert result.exit_code == 1
    assert result.stderr.startswith(f"error: {small_store}: stale: built from config_sha256 ")
    assert "rebuild with `bevcompile grid` / `bevcompile matrix` (--force)" in result.stderr
    assert len(result.stderr.splitlines()) == 1


def test_verify_missing_store_and_bad_options(tmp_path: Path, small_store: Path) -> None:
    result = runner.invoke(app, ["verify", "--out", str(tmp_path)])
    assert result.exit_code == 2
    assert result.stderr == (
        f"error: {tmp_path / 'nuscenes.zarr'}: no store for rig 'nuscenes' in {tmp_path}; "
        "build it with `bevcompile grid` (and `bevcompile matrix`)\n"
    )
    result = runner.invoke(app, ["verify", str(small_store), "--channels", "0"])
    assert result.exit_code == 2
    assert result.stderr == "error: --channels must be in [1, 512], got 0\n"


def test_verify_damaged_store_exit_1(small_copy: Path) -> None:
    damage.truncate_chunk(small_copy, "grid/coords")
    result = runner.invoke(app, ["verify", str(small_copy)])
    assert result.exit_code == 1
    lines = result.stderr.splitlines()
    assert any(line.startswith(f"{small_copy}: integrity: grid/coords: ") and "chunk data unreadable" in line for line in lines)
    assert lines[-1].startswith(f"error: {small_copy}: verify failed: ")


def test_verify_of_a_group_folder_exit_2(small_store: Path) -> None:
    command = "verify"
    args = [command, str(small_store / "grid")]
    result = runner.invoke(app, args)
    assert result.exit_code == 2
    assert result.stderr == f"error: {small_store / 'grid'}: is the grid/ group of the store {small_store.resolve()}; {command} the store\n"


def test_verify_without_torch_says_why_in_the_table(small_store: Path) -> None:
    """Without PyTorch the grid_sample reference is not run: the compact table says so in the
    row itself (threshold column: the skip reason; result: skipped), not as 'nan ... informational'.
    (A fresh process with ``import torch`` failing: this one may hold torch already.)"""
    import os
    import subprocess
    import sys

    code = "import sys; sys.modules['torch'] = None; from bevcompile._entry import main; sys.argv[0] = 'bevcompile'; sys.exit(main())"
    result = subprocess.run(
        [sys.executable, "-c", code, "verify", str(small_store)], capture_output=True, text=True, timeout=300,
        env={**os.environ, "COLUMNS": "160", "NO_COLOR": "1"},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    line = next(row for row in result.stdout.splitlines() if "torch grid_sample" in row)
    cells = [c.strip() for c in line.split("│")]
    assert cells[2:6] == ["-", "-", "skipped: PyTorch not installed (ModuleNotFoundError)", "skipped"], cells
