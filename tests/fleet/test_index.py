"""The fleet index: fleet.json and fleet.csv written atomically, read back, re-gated; bad files are one-line errors."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from bevcompile.errors import UsageError
from bevcompile.fleet.index import CSV_COLUMNS, FleetIndex, distribution, read_index
from bevcompile.fleet.task import VehicleResult


def _shifted(vehicle_id: str, shift_px: float, lost: int = 0) -> VehicleResult:
    camera = {
        "n_cells": 576, "cells_both": 100, "cells_only_old": lost, "cells_only_new": 0, "lost_fraction": lost / 576, "gained_fraction": 0.0,
        "shift_max_px": shift_px, "shift_mean_px": shift_px / 2, "shift_p99_px": shift_px, "nearest_pixel_changed": 3,
        "max_shift_cell": [0, 1, 2], "max_shift_cell_ego_m": [1.5, 2.5, 0.0], "rotation_deg": 0.1, "translation_mm": 5.0,
    }
    return VehicleResult(
        id=vehicle_id, status="built", store=f"/out/{vehicle_id}.zarr", config_sha256="ab" * 32, tool_version="0.2.0", bytes=4096, seconds=1.5,
        coverage={"FRONT": [0.25], "BACK": [0.2]}, kept_weight={"total": 0.9, "worst_row": 0.5}, nnz=100, delta_ratio=0.4,
        shift={"reference": "ref", "comparable": True, "max_px": shift_px, "max_px_camera": "FRONT", "coverage_change_max": lost / 576,
               "coverage_change_camera": "FRONT", "cameras": {"FRONT": camera}},
    )


def _index() -> FleetIndex:
    vehicles = [
        VehicleResult(id="ref", status="built", shift={"reference": "ref", "is_reference": True}, coverage={"FRONT": [0.25]}),
        _shifted("a", 0.1),
        _shifted("b", 0.8, lost=40),
        VehicleResult(id="c", status="failed", error="calib/c.yaml: cameras[0].intrinsic[0][0]: fx must be > 0, got -1"),
        VehicleResult(id="d", status="cancelled", error="not started: the fleet was interrupted"),
    ]
    return FleetIndex({"tool_version": "0.2.0", "reference": "ref", "gates": {"max_shift_px": None, "max_coverage_change": None}}, vehicles)


def test_index_round_trips_through_fleet_json_and_writes_a_csv(tmp_path: Path) -> None:
    index = _index()
    path = index.write(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fleet.csv", "fleet.json"]  # no temporaries
    data = json.loads(path.read_text())
    assert data["format"] == "bevcompile-fleet/1"
    assert data["counts"] == {"total": 5, "built": 3, "resumed": 0, "failed": 1, "cancelled": 1, "pending": 0, "flagged": 0}
    again = read_index(tmp_path)
    assert again.vehicles == index.vehicles and again.run == index.run
    rows = list(csv.DictReader((tmp_path / "fleet.csv").open()))
    assert list(rows[0]) == list(CSV_COLUMNS) and [r["id"] for r in rows] == ["ref", "a", "b", "c", "d"]
    assert rows[2]["shift_max_px"] == "0.8" and rows[2]["coverage_min"] == "0.2" and rows[2]["coverage_mean"] == "0.225"
    assert rows[3]["status"] == "failed" and rows[3]["error"].startswith("calib/c.yaml: cameras[0]")


def test_regating_flags_the_outliers_by_the_diff_gate_rules() -> None:
    index = _index().regated(0.5, 0.05)
    assert [v.id for v in index.flagged] == ["b"]
    assert index.flagged[0].flags == [
        "FRONT: max shift 0.8 px > --max-shift-px 0.5",
        "FRONT: lost 40 of 576 BEV cells (0.06944) > --max-coverage-change 0.05",
    ]
    assert index.run["gates"] == {"max_shift_px": 0.5, "max_coverage_change": 0.05, "regated_by": "fleet-report"}
    assert _index().regated(None, None).flagged == []


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "no fleet index here"),
        ("{not json", "not a readable fleet index (JSONDecodeError"),
        ('{"format": "bevcompile/1"}', "not a fleet index (format 'bevcompile/1', expected 'bevcompile-fleet/1')"),
        ('{"format": "bevcompile-fleet/1", "vehicles": [{"status": "built"}]}', "vehicles: expected a list of vehicle records with an id"),
    ],
)
def test_bad_index_files_are_one_line_errors(tmp_path: Path, content: str | None, message: str) -> None:
    if content is not None:
        (tmp_path / "fleet.json").write_text(content)
    with pytest.raises(UsageError) as info:
        read_index(tmp_path)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_distribution_skips_missing_and_non_finite_values() -> None:
    assert distribution([3.0, None, 1.0, float("inf"), 2.0, 4.0]) == (1.0, 2.5, 4.0)
    assert distribution([None]) is None


def test_a_fleet_index_that_is_a_fifo_or_nested_too_deep_is_one_line(tmp_path: Path) -> None:
    """issue 31: every user-named file is read only when regular, and JSON without recursion."""
    import os

    os.mkfifo(tmp_path / "fleet.json")
    with pytest.raises(UsageError, match=r"fleet\.json: is a FIFO, not a regular file \(a fleet index is a file\)$"):
        read_index(tmp_path)
    (tmp_path / "fleet.json").unlink()
    (tmp_path / "fleet.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(UsageError, match=r"not a readable fleet index \(ValueError: nested 100,000 levels deep, more than 64\)$"):
        read_index(tmp_path)
