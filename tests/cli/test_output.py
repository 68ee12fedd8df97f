"""Helpers of ``bevcompile.cli._output`` (tables, sizes, progress bars)."""

from __future__ import annotations

import io
import re
import time

import pytest
from rich.console import Console

from bevcompile.cli._output import human_bytes, progress_bar
from bevcompile.progress import start_phase


@pytest.mark.parametrize(
    ("nbytes", "text"),
    [(0, "0 B"), (1023, "1023 B"), (1024, "1.0 KiB"), (3 * 2**20, "3.0 MiB"), (1.5 * 2**30, "1.5 GiB"), (13183.6 * 2**30, "12.9 TiB"), (2**50, "1024.0 TiB")],
)
def test_human_bytes_units(nbytes: float, text: str) -> None:
    """A dense 40,000 x 88M matrix is reported in TiB, not as 13183.6 GiB."""
    assert human_bytes(nbytes) == text


def _bar_text(console: Console) -> str:
    return console.export_text()


def test_progress_bar_counts_with_separators_rate_eta_and_phases() -> None:
    """The bar of a long build: count with thousands separators and the unit, a rate, an ETA; a new
    phase replaces the previous one with its own label and count (no bar stuck at 100 %)."""
    console = Console(file=io.StringIO(), force_terminal=True, width=160, record=True)
    with progress_bar("pass 1/2: histogram", 2_000_000, unit="points", console=console) as bar:
        progress = bar._progress
        assert progress is not None
        bar(1_234_567)
        time.sleep(0.05)
        bar(1)
        progress.refresh()
        first = _bar_text(console)
        assert "pass 1/2: histogram" in first and "1,234,568 / 2,000,000 points" in first
        assert re.search(r"\d+\.\d ([kMG] )?points/s", first), first
        assert re.search(r"-:--:--|\d+:\d\d", first)  # remaining time
        start_phase(bar, "writing nuscenes.zarr")
        progress.refresh()
        assert [t.description for t in progress.tasks] == ["writing nuscenes.zarr"]


def test_progress_bar_is_silent_off_a_terminal_and_phases_are_optional() -> None:
    console = Console(file=io.StringIO(), force_terminal=False)
    with progress_bar("work", 10, console=console) as bar:
        bar(5)
        start_phase(bar, "next", 3, "cells")
    assert console.file.getvalue() == ""  # type: ignore[attr-defined]
    calls: list[int] = []
    start_phase(calls.append, "a plain callable has no phases")  # no error, nothing recorded
    assert calls == []


def test_control_characters_reach_no_terminal_and_failure_lines_keep_the_cap(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """issue 31: an ESC in a folder name was printed raw in "wrote ...", the inspect table and its
    failure lines; two failure lines were 1,050 and 1,092 characters (the store path came after
    the 1,000 cap)."""
    import json

    from typer.testing import CliRunner

    from bevcompile.cli import app

    from ..rigs import small_rig_data, write_yaml

    runner = CliRunner()
    out = tmp_path / "esc\x1b[31mred"
    out.mkdir()
    config = write_yaml(tmp_path / "small.yaml", small_rig_data())
    result = runner.invoke(app, ["grid", str(config), "--out", str(out)])
    assert result.exit_code == 0 and "\x1b" not in result.stdout
    assert "esc\\x1b[31mred/small.zarr" in " ".join(result.stdout.split())
    meta = json.loads((out / "small.zarr" / "zarr.json").read_text())
    meta["attributes"]["format"] = "f" * 3000
    (out / "small.zarr" / "zarr.json").write_text(json.dumps(meta))
    result = runner.invoke(app, ["inspect", str(out)])
    assert result.exit_code == 1 and "\x1b" not in result.stdout + result.stderr
    assert "\\x1b[31" in result.stdout  # the table's store cell (folded where the log is narrow)
    lines = result.stderr.splitlines()
    assert lines[0].startswith(f"{tmp_path}/esc\\x1b[31mred/small.zarr: /: format: ") and all(len(line) <= 1000 for line in lines)
    assert lines[0].endswith("more characters)")


def test_a_python_warning_is_one_line_without_a_source_line(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """issue 31: `matrix` printed numpy's "RuntimeWarning: overflow encountered in divide" and the
    source line; any warning that reaches the terminal is one line."""
    import numpy as np
    from typer.testing import CliRunner

    import bevcompile.cli.grid_cmd as grid_cmd
    from bevcompile.cli import app

    from ..rigs import small_rig_data, write_yaml

    real = grid_cmd.run_grid

    def noisy(*args, **kwargs):  # type: ignore[no-untyped-def]
        np.array([1e308]) / np.array([1e-308])  # overflow encountered in divide
        return real(*args, **kwargs)

    monkeypatch.setattr(grid_cmd, "run_grid", noisy)
    config = write_yaml(tmp_path / "small.yaml", small_rig_data())
    result = CliRunner().invoke(app, ["grid", str(config), "--out", str(tmp_path), "--quiet"])
    assert result.exit_code == 0, result.output
    assert result.stderr == "warning: overflow encountered in divide (RuntimeWarning)\n"
