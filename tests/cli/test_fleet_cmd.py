"""`bevcompile fleet` and `bevcompile fleet-report` from the command line: one-line errors with
exit 2 before any work, the report's tables, gates and exit codes (the engine itself: tests/fleet/)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

import bevcompile.fleet.engine as engine_mod
from bevcompile.cli import app
from bevcompile.fleet.index import FleetIndex
from bevcompile.fleet.task import VehicleResult

from ..fleet.fleets import write_fleet
from ..fleet.test_index import _index

runner = CliRunner()


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--workers", "0"], "error: --workers must be an integer >= 1, got 0"),
        (["--workers", "2", "--scheduler", "tcp://127.0.0.1:1"], "error: --workers and --scheduler exclude each other (the cluster's workers are what they are)"),
    ],
)
def test_engine_options_are_refused_before_any_work(tmp_path: Path, args: list[str], expected: str) -> None:
    manifest = write_fleet(tmp_path / "fleet", 2)
    result = runner.invoke(app, ["fleet", str(manifest), "--out", str(tmp_path / "out"), *args])
    assert result.exit_code == 2 and result.stderr == expected + "\n"
    assert not (tmp_path / "out").exists()


def test_a_bad_manifest_is_one_line_exit_2_and_writes_nothing(tmp_path: Path) -> None:
    manifest = write_fleet(tmp_path / "fleet", 2, extra={"reference": "car-9999"})
    result = runner.invoke(app, ["fleet", str(manifest), "--out", str(tmp_path / "out")])
    assert result.exit_code == 2
    assert result.stderr == f"error: {manifest}: reference: 'car-9999' is not the id of a vehicle of the manifest\n"
    assert not (tmp_path / "out").exists()


def test_an_unreachable_scheduler_is_one_line_exit_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_mod, "CONNECT_TIMEOUT_S", 1.0)
    manifest = write_fleet(tmp_path / "fleet", 2)
    result = runner.invoke(app, ["fleet", str(manifest), "--out", str(tmp_path / "out"), "--scheduler", "tcp://127.0.0.1:9"])
    assert result.exit_code == 2
    assert result.stderr.startswith("error: --scheduler tcp://127.0.0.1:9: cannot connect (") and result.stderr.count("\n") == 1


def test_without_dask_the_command_says_which_extra_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "distributed", None)
    manifest = write_fleet(tmp_path / "fleet", 2)
    result = runner.invoke(app, ["fleet", str(manifest), "--out", str(tmp_path / "out")])
    assert result.exit_code == 2
    assert result.stderr == "error: bevcompile fleet needs Dask: pip install 'bevcompile[fleet]' (dask[distributed])\n"
    assert not (tmp_path / "out").exists()


def test_fleet_report_prints_the_summary_and_exits_1_with_a_line_per_vehicle(tmp_path: Path) -> None:
    _index().write(tmp_path)
    result = runner.invoke(app, ["fleet-report", str(tmp_path)])
    assert result.exit_code == 1
    text = " ".join(result.stdout.split())
    assert "5 vehicles, reference ref" in text and "figures over the built vehicles" in text and "failed vehicles" in text
    assert result.stderr.splitlines() == [
        "c: calib/c.yaml: cameras[0].intrinsic[0][0]: fx must be > 0, got -1",
        "d: cancelled: not started: the fleet was interrupted",
        f"error: fleet: 1 failed, 1 not built of 5 vehicles (see {tmp_path})",
    ]


def test_fleet_report_gates_again_from_the_recorded_figures(tmp_path: Path) -> None:
    _index().write(tmp_path)
    result = runner.invoke(app, ["fleet-report", str(tmp_path), "--max-shift-px", "0.5", "--json"])
    assert result.exit_code == 1
    data = json.loads(result.stdout)
    assert [v["id"] for v in data["vehicles"] if v["flags"]] == ["b"] and data["counts"]["flagged"] == 1
    assert "b: flagged: FRONT: max shift 0.8 px > --max-shift-px 0.5" in result.stderr.splitlines()
    assert runner.invoke(app, ["fleet-report", str(tmp_path), "--max-shift-px", "-1"]).stderr == "error: --max-shift-px must be a finite number >= 0, got -1.0\n"


def test_fleet_report_of_a_clean_fleet_exits_0(tmp_path: Path) -> None:
    FleetIndex({"reference": "a"}, [VehicleResult(id="a", status="built"), VehicleResult(id="b", status="resumed")]).write(tmp_path)
    result = runner.invoke(app, ["fleet-report", str(tmp_path), "--quiet"])
    assert result.exit_code == 0 and result.stdout == "" and result.stderr == ""


def test_fleet_report_of_a_folder_without_index_is_exit_2(tmp_path: Path) -> None:
    result = runner.invoke(app, ["fleet-report", str(tmp_path)])
    assert result.exit_code == 2
    assert result.stderr == f"error: {tmp_path / 'fleet.json'}: no fleet index here (bevcompile fleet MANIFEST --out {tmp_path} writes it)\n"


def test_help_lists_the_fleet_and_import_commands() -> None:
    text = runner.invoke(app, ["--help"]).stdout
    assert "fleet " in text and "fleet-report" in text and "import " in text
    sub = runner.invoke(app, ["import", "--help"]).stdout
    assert "kalibr" in sub and "nuscenes" in sub and "opencv" in sub
