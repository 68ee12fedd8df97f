"""The console entry point: usage errors are one line and exit 2, like every other bad input."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from bevcompile import memory
from bevcompile._version import __version__
from bevcompile.cli import app, main


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["matrix", "--topk", "abc"], r"error: bevcompile matrix: Invalid value for '--topk'"),
        # click's wording moved between versions (typer 0.16 with click 8.3: "No such option '--x'.")
        (["grid", "--no-such-option"], r"error: bevcompile grid: No such option:? '?--no-such-option"),
        (["no-such-command"], r"error: bevcompile: No such command 'no-such-command'"),
    ],
)
def test_usage_errors_are_one_line_exit_2(capsys: pytest.CaptureFixture[str], argv: list[str], expected: str) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert re.match(expected, err), err
    assert err.count("\n") == 1


def test_library_errors_keep_their_exit_code(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as info:
        main(["grid", str(tmp_path / "missing.yaml"), "--out", str(tmp_path)])
    assert info.value.code == 2
    assert capsys.readouterr().err == f"error: {tmp_path / 'missing.yaml'}: file not found\n"


def test_success_exits_0(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as info:
        main(["grid", "--out", str(tmp_path), "--quiet"])
    assert info.value.code == 0
    assert (tmp_path / "nuscenes.zarr").is_dir()


def test_bare_command_prints_help_in_workflow_order_and_no_error_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main([])
    assert info.value.code == 2  # click's convention for a missing command
    captured = capsys.readouterr()
    assert captured.err == ""
    commands = ["grid", "matrix", "inspect", "verify", "render", "export-onnx", "export-interop"]
    positions = [captured.out.find(f"│ {name} ") for name in commands]
    assert all(p >= 0 for p in positions) and positions == sorted(positions), positions


def test_tables_are_120_columns_wide_in_logs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not a terminal (CI log, pipe): 120 columns, so store tables do not fold; COLUMNS overrides."""
    from bevcompile.cli._output import LOG_WIDTH, _console

    monkeypatch.delenv("COLUMNS", raising=False)
    assert _console(stderr=False).width == LOG_WIDTH == 120
    monkeypatch.setenv("COLUMNS", "100")
    assert _console(stderr=False).width == 100


def test_out_of_memory_is_one_line_exit_2_and_writes_nothing(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A config under the 10^8-cell limit can still exceed the machine's memory: one line, not a traceback."""
    import bevcompile.grid.build as build_module

    def too_big(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise MemoryError("Unable to allocate 2.24 GiB for an array with shape (6, 1, 5000, 5000, 2) and data type float64")

    monkeypatch.setattr(build_module, "build_grid_command", too_big)
    with pytest.raises(SystemExit) as info:
        main(["grid", "--out", str(tmp_path), "--quiet"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err == (
        "error: out of memory (Unable to allocate 2.24 GiB for an array with shape (6, 1, 5000, 5000, 2) and data type float64); "
        "no store was left half-written (writes are atomic). The problem is too large for this machine: "
        "reduce the BEV cells, heights, cameras or depth bins, or --channels / --batch\n"
    )
    assert list(tmp_path.iterdir()) == []


def test_a_grid_larger_than_the_machine_is_refused_before_any_work(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Within the config's 10^8-cell limit but beyond this machine's memory: one line, exit 2,
    before the build (the kernel's OOM killer would leave no message and no cleanup)."""

    monkeypatch.setattr(memory, "memory_limit", lambda: memory.MemoryLimit(64 * 2**20, "available memory"))  # a 64 MiB machine
    with pytest.raises(SystemExit) as info:
        main(["grid", "--out", str(tmp_path), "--quiet"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1
    assert "bevcompile grid of 6 cameras x 1 heights x 128 x 128 cells (padded to 130 x 130 by --block 10) = 101,400 samples needs about 128 MiB, more than the 64 MiB available memory allows" in err
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(SystemExit) as info:
        main(["matrix", "--mode", "grid", "--out", str(tmp_path), "--quiet"])
    assert info.value.code == 2 and "bevcompile matrix --mode grid of 6 cameras" in capsys.readouterr().err


def test_interrupt_of_a_read_only_command_says_nothing_was_written(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """inspect writes nothing: its Ctrl-C line must not talk about half-written stores."""
    import bevcompile.cli.inspect_cmd as inspect_cmd

    with pytest.raises(SystemExit):
        main(["grid", "--out", str(tmp_path), "--quiet"])

    def interrupted(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise KeyboardInterrupt

    import logging

    monkeypatch.setattr(inspect_cmd, "inspect_store", interrupted)
    monkeypatch.setattr(logging.getLogger("asyncio"), "level", logging.NOTSET)  # restored after the test
    with pytest.raises(SystemExit) as info:
        main(["inspect", str(tmp_path), "--quiet"])
    assert info.value.code == 130
    assert capsys.readouterr().err == "error: interrupted; nothing was written\n"
    # zarr's abandoned event-loop tasks must not add "Task was destroyed but it is pending!" lines at exit
    assert not logging.getLogger("asyncio").isEnabledFor(logging.CRITICAL)


def test_interrupt_while_typer_parses_the_arguments_is_one_line(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Typer turns a Ctrl-C during parsing into a silent exit 130; the entry point says so in one line."""
    import typer.core

    def interrupted(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise KeyboardInterrupt

    monkeypatch.setattr(typer.core.TyperGroup, "make_context", interrupted)
    with pytest.raises(SystemExit) as info:
        main(["inspect", "--quiet"])
    assert info.value.code == 130
    assert capsys.readouterr().err == "error: interrupted; nothing was written\n"


@pytest.mark.parametrize("args", [["-h"], ["grid", "-h"], ["inspect", "-h"]])
def test_dash_h_is_help(args: list[str]) -> None:
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0 and "Usage: bevcompile" in result.stdout and "--help" in result.stdout


def test_version_names_the_stack_without_importing_torch() -> None:
    code = "import sys; from bevcompile.cli import main\ntry:\n    main(['--version'])\nexcept SystemExit as e:\n    assert e.code == 0\nassert 'torch' not in sys.modules\n"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == f"bevcompile {__version__}"
    assert re.fullmatch(r"python 3\.\d+\.\d+, numpy \S+, scipy \S+, zarr 3\.\S+, typer \S+, rich \S+, pyyaml \S+", lines[1]), lines[1]
    assert lines[2].startswith("extras: torch ") and "onnx" in lines[2]
