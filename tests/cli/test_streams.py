"""The CLI at the edges of its streams and signals (issue 21): closed stdout, a pipe whose
reader left, a full device, an encoding that cannot carry a camera name, a late signal, ``-``
as a path, output files that cannot be written. Each runs the real console script in a shell."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ..rigs import small_rig_data, write_yaml

BIN = Path(sys.executable).parent / "bevcompile"


def _sh(command: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "-c", command], cwd=cwd, capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "PATH": f"{BIN.parent}:{os.environ['PATH']}", **(env or {})},
    )


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    here = tmp_path_factory.mktemp("streams")
    data = small_rig_data()
    data["cameras"][0]["name"] = "CAM_前"
    write_yaml(here / "small.yaml", data)
    result = _sh("bevcompile grid small.yaml --out out --quiet", here)
    assert result.returncode == 0, result.stderr
    return here


def test_closed_stdout_runs_the_command_with_its_output_discarded(folder: Path) -> None:
    result = _sh("bevcompile grid small.yaml --out closed >&- && bevcompile inspect closed --quiet >&-", folder)
    assert (result.returncode, result.stderr) == (0, "")
    assert (folder / "closed" / "small.zarr" / "zarr.json").is_file()


def test_a_pipe_whose_reader_left_ends_quietly_with_141(folder: Path) -> None:
    """The reader (``true``) is gone long before the command, which imports numpy and zarr first,
    writes a byte. (``| head -c 100`` raced: the whole table fits the 64 KiB pipe buffer, so a
    write that landed before ``head`` exited ended with 0 under load.)"""
    result = _sh("set -o pipefail; bevcompile inspect out | true", folder)
    assert (result.returncode, result.stderr) == (141, "")


def test_a_full_stdout_is_one_line_saying_the_store_was_written(folder: Path) -> None:
    result = _sh("bevcompile grid small.yaml --out out --json > /dev/full", folder)
    assert result.returncode == 2
    assert result.stderr == (
        "error: cannot write to standard output (No space left on device); "
        "out/small.zarr was already written completely (its old copy is removed by the next write)\n"
    )


def test_an_ascii_only_stdout_shows_a_non_ascii_camera_name_escaped(folder: Path) -> None:
    result = _sh("bevcompile grid small.yaml --out out", folder, env={"PYTHONIOENCODING": "ascii"})
    assert result.returncode == 0, result.stderr
    assert "CAM_\\u524d" in result.stdout


def test_a_late_sigterm_after_the_write_says_the_store_is_written(folder: Path) -> None:
    """A SIGTERM that arrives after the command returned (here: right after it, while Typer
    unwinds) is no silent kill: one line, exit 143, naming the store already written."""
    code = (
        "import os, signal, time, bevcompile.cli as cli\n"
        "run = cli._run\n"
        "def late(*a):\n    code = run(*a)\n    os.kill(os.getpid(), signal.SIGTERM)\n    time.sleep(5)\n    return code\n"
        "cli._run = late\n"
        "cli.main(['grid', 'small.yaml', '--out', 'late', '--quiet'], console=True)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=folder, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 143, result.stderr
    assert result.stderr == "error: terminated (SIGTERM); late/small.zarr was already written completely (its old copy is removed by the next write)\n"


def test_output_files_that_cannot_be_written_are_exit_2_naming_the_path(folder: Path) -> None:
    pytest.importorskip("onnx")
    result = _sh("bevcompile export-onnx out/small.zarr --out /proc/x.onnx", folder)
    assert (result.returncode, result.stderr) == (2, "error: --out /proc/x.onnx: cannot write (No such file or directory)\n")
    result = _sh("bevcompile export-onnx out/small.zarr --out nowhere/x.onnx", folder)
    assert (result.returncode, result.stderr) == (2, "error: --out nowhere/x.onnx: its folder nowhere does not exist (no folder is created for a file)\n")
    assert not (folder / "nowhere").exists()


def test_dash_is_stdout_or_stdin_where_it_makes_sense_and_refused_elsewhere(folder: Path) -> None:
    pytest.importorskip("onnx")
    result = _sh("bevcompile export-onnx out/small.zarr --out - > graph.onnx", folder)
    assert result.returncode == 0, result.stderr
    assert (folder / "graph.onnx").read_bytes()[:2] == b"\x08\x08" or (folder / "graph.onnx").stat().st_size > 1000
    assert not (folder / "-").exists()
    result = _sh("bevcompile grid - --out stdin --quiet < small.yaml", folder)
    assert result.returncode == 0, result.stderr
    assert (folder / "stdin" / "small.zarr").is_dir()
    result = _sh("bevcompile grid small.yaml --out -", folder)
    assert (result.returncode, result.stderr) == (2, "error: --out -: a store is a folder of files and cannot be written to standard output; give a folder\n")
    result = _sh("bevcompile inspect -", folder)
    assert (result.returncode, result.stderr) == (2, "error: -: inspect reads stores, which are folders; standard input cannot hold one\n")


def test_verify_and_render_take_a_folder_holding_exactly_one_store(folder: Path) -> None:
    pytest.importorskip("matplotlib")
    result = _sh("bevcompile verify out --quiet && bevcompile render out --out cover.png --quiet", folder)
    assert result.returncode == 0, result.stderr
    assert (folder / "cover.png").stat().st_size > 1000
    (folder / "two").mkdir(exist_ok=True)
    for name in ("a.zarr", "b.zarr"):
        _sh(f"cp -r out/small.zarr two/{name}", folder)
    result = _sh("bevcompile verify two", folder)
    assert (result.returncode, result.stderr) == (2, "error: two: holds 2 stores (a.zarr, b.zarr); verify one of them\n")
    result = _sh("bevcompile render .", folder)
    assert result.returncode == 2 and result.stderr.startswith("error: .: not a store, and holds no <name>.zarr store")
