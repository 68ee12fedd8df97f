"""The CLI at the edges of its streams and signals (issue 21): closed stdout, a pipe whose
reader left, a full device, an encoding that cannot carry a camera name, a late signal, ``-``
as a path, output files that cannot be written. Each runs the real console script in a shell."""

from __future__ import annotations

import os
import shutil
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


# --------------------------------------------------------------------------------------
# issue 31: help and version on full or closed pipes, stderr that cannot be written, a working
# folder that was deleted or is too deep, empty values, an unreadable store
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("args", ["--help", "--version", "grid --help", "import kalibr --help"])
def test_help_and_version_on_a_full_stdout_are_one_line_exit_2(folder: Path, args: str) -> None:
    """They raised OSError with a traceback (exit 1); docs/errors.md: a full stdout is exit 2."""
    result = _sh(f"bevcompile {args} > /dev/full", folder)
    assert (result.returncode, result.stderr) == (2, "error: cannot write to standard output (No space left on device); nothing was written\n")


@pytest.mark.parametrize("args", ["--help", "--version", "grid --help"])
def test_help_and_version_into_a_pipe_whose_reader_left_end_with_141(folder: Path, args: str) -> None:
    """`bevcompile --help | head -1` exited 1 (Typer's sys.exit on EPIPE); any tool the pipe stopped is 141."""
    result = _sh(f"set -o pipefail; bevcompile {args} | true", folder)
    assert (result.returncode, result.stderr) == (141, "")


def test_a_stderr_that_cannot_be_written_keeps_the_exit_code(folder: Path) -> None:
    """The error line is lost, the exit code is not (was 1: the print raised; 120 on the interpreter's last flush)."""
    assert _sh("bevcompile grid nope.yaml 2> /dev/full", folder).returncode == 2
    assert _sh("bevcompile inspect out --quiet > /dev/null 2> /dev/full", folder).returncode == 0
    assert _sh("bevcompile matrix small.yaml --out out --topk 0 --align 0 2> /dev/full", folder).returncode == 2


def test_a_deleted_working_folder_is_one_line(folder: Path) -> None:
    """It raised FileNotFoundError in the --out check (os.getcwd() fails)."""
    result = _sh("mkdir -p gone && cd gone && rmdir ../gone && bevcompile grid ../small.yaml --out . --quiet", folder)
    assert (result.returncode, result.stderr) == (2, "error: --out '.': the current folder no longer exists; cd into an existing folder\n")


def test_a_working_folder_deeper_than_path_max_names_its_length(folder: Path) -> None:
    """It said "(1 characters)": the length of '.', not of the path the store would have."""
    deep = "/".join(["d" * 200] * 21)  # 4,220 bytes below the folder (made one level at a time: mkdir -p refuses it)
    result = _sh(f"for i in $(seq 21); do mkdir -p {'d' * 200} && cd {'d' * 200}; done && bevcompile grid --out . --quiet", folder)
    assert result.returncode == 2
    length = len(os.fsencode(str(folder / deep)))
    assert result.stderr == (
        f"error: --out '.': path too long for the file system ({length:,} bytes as an absolute path, at most 3,999 with room for the store's name)\n"
    )


@pytest.mark.parametrize("args", ["grid small.yaml --out ''", "matrix small.yaml --out=", "inspect ''"])
def test_an_empty_value_is_refused_not_read_as_the_current_folder(folder: Path, args: str) -> None:
    """`--out ''` (an unset variable) silently wrote into the current folder."""
    result = _sh(f"bevcompile {args}", folder)
    assert result.returncode == 2 and result.stderr.startswith("error: bevcompile: ") and "empty" in result.stderr
    assert not (folder / "small.zarr").exists()


def test_a_store_this_user_cannot_read_is_a_failed_inspect_not_a_usage_error(folder: Path) -> None:
    """It was exit 2 (Typer's "path is not readable"): a store that cannot be read is damaged, exit 1."""
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root and setpriv to drop the capability that reads any folder")
    _sh("rm -rf locked && mkdir locked && cp -r out/small.zarr locked/ && chmod 000 locked/small.zarr", folder)
    try:
        drop = "setpriv --inh-caps=-dac_override,-dac_read_search --bounding-set=-dac_override,-dac_read_search"
        result = _sh(f"{drop} {BIN} inspect locked/small.zarr --quiet", folder)
    finally:
        os.chmod(folder / "locked" / "small.zarr", 0o755)
    assert result.returncode == 1, result.stderr
    assert result.stderr.startswith("locked/small.zarr: /: root_metadata: store root unreadable") and "Permission denied" in result.stderr
