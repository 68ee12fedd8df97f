"""`bevcompile inspect` from the command line: exit codes and one-line messages (the stores of
``conftest.py``)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from typer.testing import CliRunner

from bevcompile._version import __version__
from bevcompile.cli import app

from .. import damage, rigs
from ..store.test_inspection import DAMAGES
from . import flat

runner = CliRunner()


# --------------------------------------------------------------------------------------
# inspect
# --------------------------------------------------------------------------------------


def test_inspect_prints_one_row_per_store_and_a_total(small_store: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Plain inspect is compact: a table row per store (groups, arrays, bytes, checks), one
    total line; nothing per check unless it fails."""
    from bevcompile.cli import _output

    monkeypatch.setattr(_output.stdout_console, "width", 160)  # the test's long tmp path on one line
    result = runner.invoke(app, ["inspect", str(small_store)])
    assert result.exit_code == 0, result.output
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    assert len(lines) <= 8, result.stdout
    row = flat(next(line for line in lines if "small.zarr" in line))
    n = int(lines[-1].split()[0])
    assert "small.zarr │ grid gather delta │" in row and f"{n} / {n} │ pass" in row
    assert lines[-1] == f"{n} of {n} checks passed in 1 store(s)"
    assert "norm_matches_coords" not in result.stdout and result.stderr == ""


def test_inspect_names_no_unknown_as_none(tmp_path: Path) -> None:
    empty = tmp_path / "x.zarr"
    empty.mkdir()
    result = runner.invoke(app, ["inspect", str(empty), "--verbose"])
    assert result.exit_code == 1
    assert "None" not in result.stdout and "rig ?" in flat(result.stdout)


def test_inspect_verbose_reports_arrays_attributes_and_every_check(small_store: Path) -> None:
    result = runner.invoke(app, ["inspect", str(small_store), "--verbose"])
    assert result.exit_code == 0, result.output
    out = flat(result.stdout)
    assert "rig small" in out and "config_sha256" in out and f"bevcompile {__version__}" in out and "format bevcompile/1" in out
    assert "grid/coords" in out and "4x1x24x24x2" in out and "float32" in out
    assert "align_corners" in out and "norm_int16.max_error_px" in out
    assert "norm_matches_coords" in out and "pass" in out
    assert "checks passed in 1 store(s)" in out
    assert result.stderr == ""


def test_inspect_default_path_is_artifacts(small_copy: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(small_copy.parent.parent)
    result = runner.invoke(app, ["inspect", "--quiet"])
    assert result.exit_code == 0, result.output
    assert result.stdout == ""
    monkeypatch.chdir(small_copy.parent)
    result = runner.invoke(app, ["inspect"])
    assert result.exit_code == 2
    assert result.stderr == "error: artifacts: no such store or folder\n"


@pytest.mark.parametrize(("label", "corrupt", "array", "check", "reason"), DAMAGES, ids=[d[0] for d in DAMAGES])
def test_inspect_damaged_store_exit_1_one_line_per_failure(
    small_copy: Path, label: str, corrupt: Callable[[Path], object], array: str, check: str, reason: str
) -> None:
    corrupt(small_copy)
    result = runner.invoke(app, ["inspect", str(small_copy.parent)])  # the folder, as CI runs it
    assert result.exit_code == 1, result.output
    lines = result.stderr.splitlines()
    assert lines[-1].startswith("error: ") and "checks failed in 1 of 1 store(s)" in lines[-1]
    prefix = f"{small_copy}: {array}: {check}: "
    matching = [line for line in lines if line.startswith(prefix)]
    assert matching, f"{label}: no line starting {prefix!r} in {lines}"
    assert reason in matching[0]
    assert all(line.startswith((f"{small_copy}: ", "error: ")) for line in lines)
    assert "Traceback" not in result.output


def test_inspect_json_is_the_whole_report(small_copy: Path, small_store: Path) -> None:
    damage.delete_chunk(small_copy, "grid/norm")
    result = runner.invoke(app, ["inspect", str(small_store), str(small_copy), "--json"])
    assert result.exit_code == 1
    report = json.loads(result.stdout)
    assert report["passed"] is False and report["n_stores"] == 2
    assert [s["passed"] for s in report["stores"]] == [True, False]
    failed = [c for c in report["stores"][1]["checks"] if not c["passed"]]
    assert {(c["array"], c["name"]) for c in failed} == {("grid/norm", "read"), ("grid/norm", "contract")}
    assert f"{small_copy}: grid/norm: read: grid/norm: 1 of 4 chunk(s) missing" in result.stderr


def test_inspect_strict_passes_on_fresh_store(small_store: Path) -> None:
    result = runner.invoke(app, ["inspect", str(small_store), "--strict", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    strict = [c for c in report["stores"][0]["checks"] if c["name"] == "strict"]
    assert report["strict"] is True and len(strict) >= 4 and all(c["passed"] for c in strict)
    assert {c["array"] for c in strict} >= {"grid/coords", "grid/valid", "grid/norm", "grid/norm_int16", "gather/index"}


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: p / "missing", "no such store or folder"),
        (lambda p: (p / "file.zarr").write_text("x") and p / "file.zarr", "not a store or a folder of stores (it is a file)"),
        (lambda p: (p / "empty").mkdir() or p / "empty", "not a store, and holds no <name>.zarr store"),
    ],
)
def test_inspect_not_a_store_exit_2(tmp_path: Path, make: Callable[[Path], Path], message: str) -> None:
    path = make(tmp_path)
    result = runner.invoke(app, ["inspect", str(path)])
    assert result.exit_code == 2
    assert result.stderr == f"error: {path}: {message}\n"


def test_ci_flow_bundled_rig_grid_then_inspect(tmp_path: Path) -> None:
    """What `make test` runs: the CLI `grid` (which also writes the NPU groups) then `inspect`."""
    built = runner.invoke(app, ["grid", "--out", str(tmp_path), "--quiet"])
    assert built.exit_code == 0, built.output
    result = runner.invoke(app, ["inspect", str(tmp_path), "--strict"])
    assert result.exit_code == 0, result.stderr


def test_ci_flow_small_rig_with_formats(tmp_path: Path) -> None:
    config = rigs.write_yaml(tmp_path / "rig.yaml", rigs.small_rig_data(distortion=True, heights=(0.0, 1.0)))
    from bevcompile.grid.formats import FORMATS

    args = ["grid", str(config), "--out", str(tmp_path / "out"), "--quiet"]
    for name in FORMATS:
        if name != "norm_int16":
            args += ["--format", name]
    built = runner.invoke(app, args)
    assert built.exit_code == 0, built.output
    result = runner.invoke(app, ["inspect", str(tmp_path / "out"), "--strict"])
    assert result.exit_code == 0, result.stderr


def test_inspect_json_survives_a_nan_attribute(small_copy: Path) -> None:
    """A tampered attribute may hold NaN (zarr reads it): the report is still strict JSON (NaN -> null)."""
    damage.edit_attr(small_copy, "delta", ["max_error_px"], float("nan"))
    result = runner.invoke(app, ["inspect", str(small_copy), "--json"])
    assert result.exit_code == 1, result.output
    def no_constant(token: str) -> None:
        raise AssertionError(f"{token} in the JSON report")

    report = json.loads(result.stdout, parse_constant=no_constant)  # strict parse: no NaN token (a reason may say "NaN")
    assert "Traceback" not in result.output
    assert report["passed"] is False
    assert any(c["name"] == "metadata_json" and "attributes.max_error_px is not a finite number" in c["reason"] for c in report["stores"][0]["checks"])


def test_inspect_a_group_folder_exit_2(small_store: Path) -> None:
    result = runner.invoke(app, ["inspect", str(small_store / "grid")])
    assert result.exit_code == 2
    assert result.stderr.startswith(f"error: {small_store / 'grid'}: is the grid/ group of the store ")
    assert result.stderr.rstrip().endswith("; inspect the store")


def test_load_of_a_group_folder_names_the_store(small_store: Path) -> None:
    from bevcompile import load
    from bevcompile.errors import UsageError

    with pytest.raises(UsageError, match=r"grid: is the grid/ group of the store .*; load the store$"):
        load(small_store / "grid")
