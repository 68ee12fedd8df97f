"""`bevcompile render` from the command line: exit codes and one-line messages."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from bevcompile.cli import app

from . import flat

runner = CliRunner()


def test_render_cli(small_store: Path, tmp_path: Path) -> None:
    out = tmp_path / "pics" / "cov.png"
    result = runner.invoke(app, ["render", str(small_store), "--out", str(out)])
    assert (result.exit_code, result.stderr) == (2, f"error: --out {out}: its folder {out.parent} does not exist (no folder is created for a file)\n")
    out.parent.mkdir()
    result = runner.invoke(app, ["render", str(small_store), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert f"wrote {out} (1500x750 px" in flat(result.stdout)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    result = runner.invoke(app, ["render", str(small_store), "--out", str(out), "--json"])
    assert json.loads(result.stdout)["width_px"] == 1500


def test_render_cli_errors(small_store: Path, tmp_path: Path) -> None:
    result = runner.invoke(app, ["render", str(small_store), "--out", str(tmp_path / "x.svg")])
    assert result.exit_code == 2
    assert result.stderr == f"error: --out {tmp_path / 'x.svg'}: the picture is a PNG, give a .png file name\n"
    result = runner.invoke(app, ["render", str(tmp_path)])
    assert result.exit_code == 2
    assert result.stderr == f"error: {tmp_path}: not a store, and holds no <name>.zarr store\n"


def test_render_of_a_group_folder_exit_2(small_store: Path, tmp_path: Path) -> None:
    command = "render"
    args = [command, str(small_store / "grid"), "--out", str(tmp_path / "x.png")]
    result = runner.invoke(app, args)
    assert result.exit_code == 2
    assert result.stderr == f"error: {small_store / 'grid'}: is the grid/ group of the store {small_store.resolve()}; {command} the store\n"
