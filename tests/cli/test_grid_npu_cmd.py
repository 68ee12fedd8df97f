"""`bevcompile grid` NPU options: formats, gather/ and delta/ groups, summary, JSON and errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console
from typer.testing import CliRunner

from bevcompile.cli import _output as cli_output
from bevcompile.cli import app, grid_cmd
from bevcompile.store.zarr_io import open_store

from ..rigs import NUSCENES_YAML, small_rig_data, tree_digest, write_yaml
from . import table_words as _flat

runner = CliRunner()
DONE_WHEN = ["--format", "opencv", "--format", "pixel_q", "--format", "norm_q16", "--format", "uq12", "--align", "32"]


@pytest.fixture(autouse=True)
def wide_console(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tables 220 columns wide, whatever COLUMNS was when the console was created."""
    console = Console(width=220, soft_wrap=True)
    monkeypatch.setattr(cli_output, "stdout_console", console)
    monkeypatch.setattr(grid_cmd, "stdout_console", console)




def test_done_when_command_writes_everything_and_summarises(tmp_path: Path) -> None:
    result = runner.invoke(app, ["grid", str(NUSCENES_YAML), *DONE_WHEN, "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    out = _flat(result.stdout)
    assert "fixed-point formats" in out and "gather/ tables" in out and "delta/ LUT" in out
    for row in ("norm_int16 norm_int16 grid/valid", "uq12 uq12 grid/valid", "opencv opencv_map1 opencv_map2 in-band 0.0156", "pixel_q (f=7) pixel_q in-band 0.00391", "norm_q16 norm_q16 in-band"):
        assert row in out, row
    assert "on-device size vs norm_int16 35.6 KiB vs 384.0 KiB = 9.3 %" in out
    assert "max error (bound) 0.0603 px (0.0625 px)" in out

    reader = open_store(tmp_path / "nuscenes.zarr")
    assert reader.groups() == ["delta", "gather", "grid"]
    cells = (6, 1, 128, 128)
    grid_arrays = {n: (reader.array_info("grid", n).shape, reader.array_info("grid", n).dtype) for n in reader.arrays("grid")}
    assert grid_arrays["uq12"] == ((*cells, 2), "uint16")
    assert grid_arrays["opencv_map1"] == ((*cells, 2), "int16") and grid_arrays["opencv_map2"] == (cells, "uint16")
    assert grid_arrays["pixel_q"] == ((*cells, 2), "int16") and grid_arrays["norm_q16"] == ((*cells, 2), "int16")
    grid_attrs = reader.group_attrs("grid")
    assert grid_attrs["formats"] == ["norm_int16", "uq12", "opencv", "pixel_q", "norm_q16"]
    assert grid_attrs["build_options"] == {"align_corners": False, "formats": ["uq12", "opencv", "pixel_q", "norm_q16"], "pixel_q_frac_bits": 7}
    for name in ("uq12", "opencv", "pixel_q", "norm_q16"):
        meta = grid_attrs[name]
        assert {"encode", "decode", "scale", "offset", "axis_order", "invalid_in_band", "max_error_px"} <= set(meta), name

    gather = reader.group_attrs("gather")
    assert sorted(reader.arrays("gather")) == ["cell_valid", "index", "lut", "weight", "weight_u8"]
    assert gather["layout"] == "flat" and gather["n_cells"] == 98304 and gather["n_cells_padded"] % 32 == 0
    assert reader.array_info("gather", "index").shape == (gather["n_cells_padded"], 4)
    assert gather["build_options"] == {"frac_bits": 8, "align": 32, "order": "row"}

    delta = reader.group_attrs("delta")
    assert delta["build_options"] == {"block": 10, "max_error_px": 0.0625}
    assert delta["ratio_vs_norm_int16"] <= 0.20 and delta["max_error_px"] <= 0.0625
    assert delta["on_device_bytes_total"] == sum(reader.array_info("delta", n).nbytes for n in reader.arrays("delta"))
    assert np.all(np.isfinite(reader.read("gather", "weight")))


def test_json_summary_reports_every_product(tmp_path: Path) -> None:
    config = write_yaml(tmp_path / "rig.yaml", small_rig_data(distortion=True, heights=(0.0, 1.0), bev_half_m=20.0))
    args = ["grid", str(config), "--out", str(tmp_path), "--json", "--format", "pixel_q", "--format", "norm_q16", "--order", "cache", "--align", "7", "--frac-bits", "6"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert [f["name"] for f in summary["formats"]] == ["norm_int16", "pixel_q", "norm_q16"]
    pixel_q = summary["formats"][1]
    assert pixel_q["frac_bits"] == 6 and pixel_q["max_error_px"] <= 2**-7 and pixel_q["invalid_in_band"] is True
    gather = summary["gather"]
    assert gather["layout"] == "flat_cache" and gather["lut_levels"] == 64 and gather["n_cells_padded"] % 7 == 0
    assert gather["n_cells_padded"] > gather["n_cells"] == 4 * 2 * 40 * 40
    # a 12x8 map is one 8-row band per camera: the cache order reaches the minimum (cameras - 1)
    assert gather["band_switches_gather_order"] == 3 <= gather["band_switches_row_order"]
    assert gather["lut_max_weight_error"] <= 1 / 63
    delta = summary["delta"]
    assert delta["max_error_px"] <= delta["max_error_bound_px"] == 0.0625
    assert summary["arrays"]["gather/perm"] == {"shape": [gather["n_cells_padded"]], "dtype": "int32"}
    assert summary["arrays"]["gather/perm_inverse"] == {"shape": [gather["n_cells"]], "dtype": "int32"}


def test_cache_order_summary_shows_jump_figures(tmp_path: Path) -> None:
    config = write_yaml(tmp_path / "rig.yaml", small_rig_data(bev_half_m=20.0))
    result = runner.invoke(app, ["grid", str(config), "--out", str(tmp_path), "--order", "cache"])
    assert result.exit_code == 0, result.output
    out = _flat(result.stdout)
    assert "mean index jump between valid rows" in out and "(cache order)" in out
    assert "8-row feature band switches" in out and "layout flat_cache (align 1, order cache)" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--format", "int8"], "error: unknown --format 'int8'; known formats: norm_int16, uq12, opencv, pixel_q, norm_q16"),
        (["--frac-bits", "9"], "error: --frac-bits must be in [1, 8] (uint8 weight LUT codes, 2**F levels per axis), got 9"),
        (["--align", "0"], "error: --align must be an integer in [1, 1048576], got 0"),
        (["--order", "zigzag"], "error: --order must be one of row, cache, feature, got 'zigzag'"),
        (["--block", "0"], "error: --block must be an integer in [1, 256], got 0"),
        (["--max-error-px", "0"], "error: --max-error-px must be in (0, 1] feature pixels, got 0.0"),
        (["--max-error-px", "0.0001"], "error: --max-error-px 0.0001 is below the escape form's resolution 2**-12 px for a 12x8 feature map"),
    ],
)
def test_bad_options_are_one_line_exit_2_and_write_nothing(tmp_path: Path, args: list[str], message: str) -> None:
    config = write_yaml(tmp_path / "rig.yaml", small_rig_data())
    out = tmp_path / "out"
    result = runner.invoke(app, ["grid", str(config), "--out", str(out), *args])
    assert result.exit_code == 2
    assert result.stderr == message + "\n"
    assert "Traceback" not in result.output and not out.exists()


def test_frac_bits_that_cannot_hold_the_map_names_the_range(tmp_path: Path) -> None:
    data = small_rig_data()
    data["image_aug"] = {"resize": 1.0, "crop": [0, 0], "input_size": [192, 128]}
    data["feature"]["stride"] = 1
    config = write_yaml(tmp_path / "wide.yaml", data)
    result = runner.invoke(app, ["grid", str(config), "--out", str(tmp_path / "o"), "--format", "pixel_q", "--frac-bits", "8"])
    assert result.exit_code == 2
    assert result.stderr.startswith("error: --frac-bits 8 cannot hold the feature-map range [-2, 192] px of the 192x128 map in int16 pixel_q")
    assert result.stderr.count("\n") == 1 and not (tmp_path / "o").exists()
    # without pixel_q the LUT alone accepts 8 bits
    assert runner.invoke(app, ["grid", str(config), "--out", str(tmp_path / "o"), "--frac-bits", "8", "-q"]).exit_code == 0


def test_rerun_replaces_npu_groups_and_drops_unrequested_formats(tmp_path: Path) -> None:
    config = write_yaml(tmp_path / "rig.yaml", small_rig_data())
    assert runner.invoke(app, ["grid", str(config), "--out", str(tmp_path), "-q", "--format", "uq12", "--order", "cache"]).exit_code == 0
    reader = open_store(tmp_path / "small.zarr")
    assert "uq12" in reader.arrays("grid") and "perm" in reader.arrays("gather")
    assert runner.invoke(app, ["grid", str(config), "--out", str(tmp_path), "-q"]).exit_code == 0
    reader = open_store(tmp_path / "small.zarr")
    assert reader.arrays("grid") == ["coords", "norm", "norm_int16", "valid"]
    assert reader.arrays("gather") == ["index", "lut", "weight", "weight_u8"]
    assert reader.array_info("gather", "index").shape == (4, 1, 24, 24, 4)
    assert reader.group_attrs("grid")["build_options"] == {"align_corners": False}


def test_output_is_byte_identical_across_runs(tmp_path: Path) -> None:
    config = write_yaml(tmp_path / "rig.yaml", small_rig_data(distortion=True, heights=(0.0, 0.5)))
    args = ["--format", "opencv", "--format", "uq12", "--format", "pixel_q", "--format", "norm_q16", "--order", "cache", "--align", "64", "-q"]
    for sub in ("a", "b"):
        assert runner.invoke(app, ["grid", str(config), "--out", str(tmp_path / sub), *args]).exit_code == 0
    a = tree_digest(tmp_path / "a" / "small.zarr")
    assert a == tree_digest(tmp_path / "b" / "small.zarr") and len(a) > 40


def test_help_lists_the_npu_options() -> None:
    result = runner.invoke(app, ["grid", "--help"])
    assert result.exit_code == 0
    for option in ("--format", "--frac-bits", "--align", "--order", "--block", "--max-error-px"):
        assert option in result.stdout


def test_convention_option_values_in_any_case_write_the_same_bytes(tmp_path: Path) -> None:
    """`--format NORM_Q16 --order Cache` is `--format norm_q16 --order cache`: same store bytes,
    lower-case names in build_options (as every command with enumerated values)."""
    config = write_yaml(tmp_path / "rig.yaml", small_rig_data())
    spellings = {
        "lower": ["--format", "norm_q16", "--format", "pixel_q", "--order", "cache"],
        "mixed": ["--format", "NORM_Q16", "--format", "Pixel_Q", "--order", "Cache"],
    }
    for sub, args in spellings.items():
        result = runner.invoke(app, ["grid", str(config), "--out", str(tmp_path / sub), "-q", *args])
        assert result.exit_code == 0, result.output
    digest = tree_digest(tmp_path / "lower" / "small.zarr")
    assert digest == tree_digest(tmp_path / "mixed" / "small.zarr") and len(digest) > 10
    reader = open_store(tmp_path / "mixed" / "small.zarr")
    assert reader.group_attrs("grid")["build_options"]["formats"] == ["pixel_q", "norm_q16"]
    assert reader.group_attrs("gather")["build_options"]["order"] == "cache"
    unknown = runner.invoke(app, ["grid", str(config), "--out", str(tmp_path / "bad"), "--order", "ZigZag"])
    assert unknown.exit_code == 2
    assert "error: --order must be one of row, cache, feature, got 'ZigZag'" in unknown.stderr
