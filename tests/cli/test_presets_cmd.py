"""``bevcompile presets``: the list, one preset with the source of every value, --json, errors."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from bevcompile.cli import app
from bevcompile.rig.presets import PRESETS

runner = CliRunner()


def test_presets_lists_every_preset() -> None:
    result = runner.invoke(app, ["presets"])
    assert result.exit_code == 0, result.output
    rows = [line.split("│") for line in result.stdout.splitlines() if line.startswith("│")]
    first = [row[1].strip() for row in rows if row[1].strip()]
    assert first == list(PRESETS)  # table cells may wrap (the console width), names do not
    words = set(result.stdout.replace("│", " ").split())
    assert {"LIDAR_TOP", "ego", "corner", "linspace", "normalized", "ceil", "s4,8,16", "200x200"} <= words


def test_presets_name_shows_every_value_its_source_and_proof() -> None:
    result = runner.invoke(app, ["presets", "FastBEV-M0"])
    assert result.exit_code == 0, result.output
    out = result.stdout
    cells = " ".join(out.replace("│", " ").split())  # the settings table may wrap its cells
    assert "fastbev-m0: Fast-BEV M0 (R18)" in out and "'overlap': 'last'" in cells and "CENTRED crop" in cells
    assert "Sense-GVT/Fast-BEV mmdet3d/models/detectors/fastbev.py @b0603230c89f" in out
    assert "proof: tests/rig/test_presets.py::test_fastbev_presets_equal_fastbev_backproject_inplace" in out


def test_presets_json() -> None:
    listed = json.loads(runner.invoke(app, ["presets", "--json"]).stdout)
    assert [p["name"] for p in listed] == list(PRESETS)
    one = json.loads(runner.invoke(app, ["presets", "bevdet-r50", "--json"]).stdout)
    assert one["fields"]["camera_order"][0] == "CAM_FRONT_LEFT"
    assert {s["repo"] for s in one["sources"]} == {"byounghun24/BEVDet"} and all(len(s["commit"]) == 40 for s in one["sources"])


def test_unknown_preset_is_a_usage_error() -> None:
    result = runner.invoke(app, ["presets", "bevfusion"])
    assert result.exit_code == 2
    assert "error: unknown preset 'bevfusion': expected one of bevdet-r50, bevdepth-r50" in result.stderr
