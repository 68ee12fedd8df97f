"""`bevcompile grid` from the command line: outputs, summary, JSON, and one-line errors (exit 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from bevcompile.cli import app
from bevcompile.store.zarr_io import open_store

from ..rigs import nuscenes_data, small_rig_data, write_yaml

runner = CliRunner()


def test_bare_grid_uses_the_bundled_rig(tmp_path: Path) -> None:
    result = runner.invoke(app, ["grid", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "CAM_FRONT" in result.stdout and "coverage" in result.stdout
    assert f"wrote {tmp_path / 'nuscenes.zarr'}" in " ".join(result.stdout.split())
    reader = open_store(tmp_path / "nuscenes.zarr")
    assert reader.array_info("grid", "coords").shape == (6, 1, 128, 128, 2)


def test_json_summary(tmp_path: Path) -> None:
    config = write_yaml(tmp_path / "rig.yaml", small_rig_data(heights=(0.0, 1.0)))
    result = runner.invoke(app, ["grid", str(config), "--out", str(tmp_path), "--json", "--align-corners"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["name"] == "small"
    assert summary["align_corners"] is True
    assert summary["feature_size"] == [12, 8]
    assert [c["name"] for c in summary["cameras"]] == ["FRONT", "LEFT", "BACK", "RIGHT"]
    assert all(len(c["coverage"]) == 2 for c in summary["cameras"])
    assert summary["bytes_total"] > 0


def test_feature_levels_are_listed_in_the_table_and_the_json(tmp_path: Path) -> None:
    data = small_rig_data()
    data["feature"] = {"levels": [{"stride": 8}, {"stride": 16}]}
    config = write_yaml(tmp_path / "rig.yaml", data)
    result = runner.invoke(app, ["grid", str(config), "--out", str(tmp_path)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    text = " ".join(result.stdout.split())
    assert "2 feature levels" in text and all(g in text for g in ("grid_l1/", "gather_l1/", "delta_l1/")) and "6x4" in text
    summary = json.loads(runner.invoke(app, ["grid", str(config), "--out", str(tmp_path), "--json"]).stdout)
    assert [(lv["level"], lv["stride"], lv["feature_size"]) for lv in summary["levels"]] == [(0, 8, [12, 8]), (1, 16, [6, 4])]
    assert "grid_l1/coords" in summary["arrays"] and summary["feature_size"] == [12, 8]


def test_quiet_prints_nothing(tmp_path: Path) -> None:
    config = write_yaml(tmp_path / "rig.yaml", small_rig_data())
    result = runner.invoke(app, ["grid", str(config), "--out", str(tmp_path), "--quiet"])
    assert result.exit_code == 0
    assert result.stdout == ""
    assert (tmp_path / "small.zarr").is_dir()


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (lambda d: d["cameras"][2].update(rotation_wxyz=[0.5, 0.5, 0.5, 0.6]), "cameras[2].rotation_wxyz: quaternion must be unit length"),
        (lambda d: d["cameras"][0].update(extra_key=1), "cameras[0].extra_key: unknown field"),
        (lambda d: d["feature"].update(stride=48), "image_aug.input_size: input width 704 is not divisible by feature.stride 48"),
        (lambda d: d["bev"].update(x=[-51.2, 51.2, -0.8]), "bev.x[2]: step must be > 0"),
    ],
)
def test_config_errors_are_one_line_exit_2_and_write_nothing(tmp_path: Path, edit, expected: str) -> None:  # type: ignore[no-untyped-def]
    data = nuscenes_data()
    edit(data)
    config = write_yaml(tmp_path / "bad.yaml", data)
    out = tmp_path / "out"
    result = runner.invoke(app, ["grid", str(config), "--out", str(out)])
    assert result.exit_code == 2
    assert result.stderr == f"error: {config}: {expected}" + result.stderr.split(expected, 1)[1]
    assert expected in result.stderr and result.stderr.count("\n") == 1
    assert "Traceback" not in result.output
    assert not out.exists()


def test_missing_config_file(tmp_path: Path) -> None:
    result = runner.invoke(app, ["grid", str(tmp_path / "nope.yaml"), "--out", str(tmp_path)])
    assert result.exit_code == 2
    assert result.stderr.strip() == f"error: {tmp_path / 'nope.yaml'}: file not found"


def test_conflicting_store_needs_force(tmp_path: Path) -> None:
    first = write_yaml(tmp_path / "a.yaml", small_rig_data())
    second = write_yaml(tmp_path / "b.yaml", small_rig_data(bev_step_m=2.0))
    assert runner.invoke(app, ["grid", str(first), "--out", str(tmp_path), "-q"]).exit_code == 0
    result = runner.invoke(app, ["grid", str(second), "--out", str(tmp_path), "-q"])
    assert result.exit_code == 2
    assert "was built from a different config" in result.stderr and "--force" in result.stderr
    assert runner.invoke(app, ["grid", str(second), "--out", str(tmp_path), "-q", "--force"]).exit_code == 0


def test_version_and_help() -> None:
    assert runner.invoke(app, ["--version"]).stdout.startswith("bevcompile ")
    result = runner.invoke(app, ["grid", "--help"])
    assert result.exit_code == 0 and "--align-corners" in result.stdout


@pytest.mark.parametrize("command", ["grid", "matrix", "inspect", "verify", "render", "diff", "export-onnx", "export-interop"])
def test_help_shows_no_value_type_for_flags(command: str) -> None:
    """Flags take no value: a `<bool>` type column would read as `--force true` (then `true` is the CONFIG path)."""
    result = runner.invoke(app, [command, "--help"], env={"COLUMNS": "160"})
    assert result.exit_code == 0
    assert "<bool>" not in result.stdout and "--json" in result.stdout


@pytest.mark.parametrize(
    ("command", "usage"),
    [
        ("grid", "[CONFIG]"),
        ("matrix", "[CONFIG]"),
        ("inspect", "[PATH]..."),
        ("verify", "[CONFIG|STORE]"),
        ("render", "STORE"),
        ("diff", "OLD"),
        ("export-onnx", "STORE"),
        ("export-interop", "STORE"),
    ],
)
def test_help_names_arguments_as_the_readme_does(command: str, usage: str) -> None:
    """Arguments carry an upper-case name in the usage line and no internal type (`<list[Path]>`)."""
    result = runner.invoke(app, [command, "--help"], env={"COLUMNS": "160"})
    assert result.exit_code == 0
    # typer 0.16 (the declared floor) writes an optional argument without brackets and a variadic
    # one without the dots: CONFIG, PATH
    bare = usage.replace("[", "").replace("]", "").replace("...", "")
    assert (usage in result.stdout or f" {bare}" in result.stdout) and "list[" not in result.stdout


def test_align_corners_clamp_warning_is_on_stderr_even_when_quiet(tmp_path: Path) -> None:
    result = runner.invoke(app, ["grid", "--out", str(tmp_path), "--align-corners", "--quiet"])
    assert result.exit_code == 0 and result.stdout == ""
    assert " ".join(result.stderr.split()).startswith("warning: with --align-corners, norm_int16 clamps 362 valid border cell(s) by up to 0.5 px")


def test_summary_never_rounds_a_seen_camera_to_zero_coverage() -> None:
    from bevcompile.cli.grid_cmd import _percent

    assert [_percent(f) for f in (0.0, 0.000123, 0.00099, 0.148, 1.0)] == ["0.0 %", "0.012 %", "0.099 %", "14.8 %", "100.0 %"]


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        ("name: nuscenes", "name: 2024-13-45", "invalid YAML: line 5, column 7: month must be in 1..12"),
        ("stride: 16", "stride: !!int 16px", "invalid YAML: line 58, column 11: invalid literal for int() with base 10: '16px'"),
        ("name: nuscenes", "name: " + "[" * 1000 + "]" * 1000, "invalid YAML: line 5, column 38: nested more than 32 levels deep"),
        ("stride: 16", "stride: 1:30", "invalid YAML: line 58, column 11: integer '1:30' is a YAML 1.1-only spelling (read as 90); write it in plain decimal"),
    ],
    ids=["bad-date", "int-tag", "deep-nesting", "sexagesimal"],
)
def test_yaml_that_pyyaml_cannot_construct_is_one_line_exit_2(tmp_path: Path, old: str, new: str, message: str) -> None:
    from ..rigs import NUSCENES_YAML

    config = tmp_path / "bad.yaml"
    config.write_text(NUSCENES_YAML.read_text().replace(old, new, 1))
    out = tmp_path / "out"
    result = runner.invoke(app, ["grid", str(config), "--out", str(out)])
    assert result.exit_code == 2, result.output
    assert result.stderr == f"error: {config}: {message}\n"
    assert not out.exists()


def test_a_config_that_is_not_a_regular_file_is_one_line_exit_2(tmp_path: Path) -> None:
    result = runner.invoke(app, ["grid", "/dev/zero", "--out", str(tmp_path / "out")])
    assert result.exit_code == 2
    assert result.stderr == "error: /dev/zero: is not a regular file (a device, pipe or socket), expected a YAML file\n"


@pytest.mark.parametrize("inner", ["small.zarr", "small.zarr/sub", "fresh.zarr"])
def test_out_that_is_a_store_is_refused(tmp_path: Path, inner: str) -> None:
    from ..rigs import tree_digest

    config = write_yaml(tmp_path / "rig.yaml", small_rig_data())
    out = tmp_path / "out"
    assert runner.invoke(app, ["grid", str(config), "--out", str(out), "-q"]).exit_code == 0
    before = tree_digest(out / "small.zarr")
    result = runner.invoke(app, ["grid", str(config), "--out", str(out / inner), "-q"])
    assert result.exit_code == 2
    what = f"is inside the zarr store {out / 'small.zarr'}" if inner == "small.zarr/sub" else "is a zarr store"
    assert result.stderr == f"error: --out {out / inner} {what}; --out takes the folder that holds stores\n"
    assert tree_digest(out / "small.zarr") == before
    assert sorted(p.name for p in out.iterdir()) == ["small.zarr"]


def test_an_unwritable_out_folder_is_one_line_exit_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A read-only or full file system (chmod cannot stand in for it under root): exit 2, one line."""
    import errno

    import zarr

    def read_only(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(zarr, "open_group", read_only)
    config = write_yaml(tmp_path / "rig.yaml", small_rig_data())
    result = runner.invoke(app, ["grid", str(config), "--out", str(tmp_path / "out"), "-q"])
    assert result.exit_code == 2, result.output
    assert result.stderr == f"error: {tmp_path / 'out'}: cannot write store (Read-only file system)\n"
    assert list((tmp_path / "out").iterdir()) == []


def test_a_camera_that_sees_no_bev_cell_is_warned_about_even_when_quiet(tmp_path: Path) -> None:
    """The usual cause is a pose given ego->camera: the build succeeds but says which camera is blind."""
    data = small_rig_data()
    data["cameras"][1]["sensor2ego"] = [[1, 0, 0, 0.5], [0, 1, 0, 0.8], [0, 0, 1, 1.5], [0, 0, 0, 1]]  # looks at the sky
    config = write_yaml(tmp_path / "rig.yaml", data)
    for flag in ("--quiet", "--json"):
        result = runner.invoke(app, ["grid", str(config), "--out", str(tmp_path), flag])
        assert result.exit_code == 0, result.output
        assert result.stderr == "warning: camera LEFT sees no BEV cell (is the pose camera->ego?)\n"
    result = runner.invoke(app, ["grid", str(config), "--out", str(tmp_path / "ok"), "--quiet"])
    assert result.exit_code == 0 and result.stderr == "warning: camera LEFT sees no BEV cell (is the pose camera->ego?)\n"
    clean = write_yaml(tmp_path / "clean.yaml", small_rig_data())
    result = runner.invoke(app, ["grid", str(clean), "--out", str(tmp_path / "clean"), "--quiet"])
    assert result.exit_code == 0 and result.stderr == ""
