"""`bevcompile diff` (bevcompile.diff and its command): identical stores, a moved camera measured
independently, the matrix product, incomparable stores, the gate, JSON and one-line errors."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

import bevcompile.cli.diff_cmd  # noqa: F401  (registers the command until cli/__init__ imports it)
from bevcompile import load
from bevcompile.cli import app
from bevcompile.errors import StoreError, UsageError
from bevcompile.grid.build import run_grid
from bevcompile.grid.ipm import compute_sampling_grid
from bevcompile.matrix.build import MatrixOptions, run_matrix
from bevcompile.matrix.checks import apply_entries, lifted_columns
from bevcompile.report.diff import (
    SeededInputs,
    ShiftStats,
    camera_diffs,
    config_changes,
    diff_stores,
    gate_failures,
    rotation_angle_deg,
    sampling_shift_px,
)
from bevcompile.rig.config import parse_config
from bevcompile.rig.geometry import project_bev_to_feature
from bevcompile.store.verify import make_features

from .. import damage, rigs
from ..cli import table_words as _flat

runner = CliRunner()
HEIGHTS = (0.0, 0.5)
MOVED = 1  # LEFT
MOVE_M = (0.03, -0.04, 0.0)  # 50 mm
YAW_DEG = 0.5
TOPK = 8


def _data(**kwargs: Any) -> dict[str, Any]:
    return rigs.small_rig_data(heights=HEIGHTS, **kwargs)


def _moved_data() -> dict[str, Any]:
    """LEFT camera translated by MOVE_M and yawed YAW_DEG about the ego z axis."""
    data = _data()
    matrix = np.array(data["cameras"][MOVED]["sensor2ego"], dtype=float)
    c, s = math.cos(math.radians(YAW_DEG)), math.sin(math.radians(YAW_DEG))
    matrix[:3, :3] = np.array([[c, -s, 0.0], [s, c, 0.0], [0.0, 0.0, 1.0]]) @ matrix[:3, :3]
    matrix[:3, 3] += MOVE_M
    data["cameras"][MOVED]["sensor2ego"] = matrix.tolist()
    return data


def _build(data: dict[str, Any], out: Path, *, matrix: MatrixOptions | None = None, **grid_kwargs: Any) -> Path:
    rig = parse_config(data, source="<test>")
    store = run_grid(rig, out, npu=False, **grid_kwargs).store
    if matrix is not None:
        run_matrix(rig, out, matrix)
    return store


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("diff")
    options = MatrixOptions(topk=TOPK)
    return {
        "old": _build(_data(), base / "old", matrix=options),
        "same": _build(_data(), base / "same", matrix=options),
        "moved": _build(_moved_data(), base / "moved", matrix=options),
        "moved_topk4": _build(_moved_data(), base / "moved_topk4", matrix=MatrixOptions(topk=4)),
        "grid_only": _build(_data(), base / "grid_only"),
    }


@pytest.fixture(scope="module")
def moved_report(stores: dict[str, Path]) -> Any:
    return diff_stores(stores["old"], stores["moved"], seed=3, channels=4)


# --------------------------------------------------------------------------------------
# library
# --------------------------------------------------------------------------------------


def test_identical_stores_report_no_change(stores: dict[str, Path]) -> None:
    report = diff_stores(stores["old"], stores["same"], max_shift_px=0.0, max_coverage_change=0.0)
    assert report.config_changes == [] and report.old_config_sha256 == report.new_config_sha256
    for cam in report.cameras:
        assert cam.rotation_deg == 0.0 and cam.translation_mm == 0.0
        for _, stats in (("all", cam.total), *cam.heights):
            assert stats.cells_only_old == 0 and stats.cells_only_new == 0 and stats.cells_both > 0
            assert stats.shift_max_px == 0.0 and stats.shift_mean_px == 0.0 and stats.shift_p99_px == 0.0
            assert stats.nearest_pixel_changed == 0 and stats.max_shift_cell is None
    assert [o.label for o in report.output] == ["z=0 m", "z=0.5 m"]
    assert all(o.max_abs == 0.0 and o.mean_abs == 0.0 and o.psnr_db == math.inf for o in report.output)
    assert all(o.cells_coverage_changed == 0 and o.max_abs_same_coverage == 0.0 for o in report.output)
    assert report.matrix is not None
    assert report.matrix.nnz_old == report.matrix.nnz_new > 0
    assert report.matrix.rows_entry_set_changed == 0 and report.matrix.rows_changed == 0
    assert report.matrix.output.max_abs == 0.0 and report.matrix.output.psnr_db == math.inf
    assert report.passed and report.failure_lines() == [] and report.notes == []


def test_camera_diffs_alone_equal_the_cameras_of_the_whole_diff(stores: dict[str, Path], moved_report: Any) -> None:
    """``camera_diffs`` (what ``bevcompile fleet`` records per vehicle) is the per-camera part of
    ``diff_stores``, figure for figure, gates included."""
    alone = camera_diffs(load(stores["old"]), load(stores["moved"]))
    assert alone == moved_report.cameras
    gated = camera_diffs(load(stores["old"]), load(stores["moved"]), max_shift_px=0.01, max_coverage_change=0.0)
    whole = diff_stores(stores["old"], stores["moved"], max_shift_px=0.01, max_coverage_change=0.0)
    assert gated == whole.cameras and [c.failures for c in gated][MOVED]
    with pytest.raises(UsageError, match="--max-shift-px must be a finite number >= 0"):
        camera_diffs(load(stores["old"]), load(stores["moved"]), max_shift_px=-1.0)


def test_moved_camera_pose_change_is_reported_exactly(moved_report: Any) -> None:
    assert [c.field for c in moved_report.config_changes] == [f"cameras[{MOVED}].sensor2ego"]
    for index, cam in enumerate(moved_report.cameras):
        if index == MOVED:
            assert cam.camera == "LEFT"
            assert cam.rotation_deg == pytest.approx(YAW_DEG, abs=1e-9)
            assert cam.translation_mm == pytest.approx(50.0, abs=1e-9)
            assert cam.translation_delta_mm == pytest.approx((30.0, -40.0, 0.0), abs=1e-9)
            assert cam.total.shift_max_px is not None and cam.total.shift_max_px > 0.01
            assert 0 < cam.total.shift_mean_px <= cam.total.shift_p99_px <= cam.total.shift_max_px
            assert cam.total.nearest_pixel_changed > 0
        else:
            assert cam.rotation_deg == 0.0 and cam.translation_mm == 0.0
            assert cam.total.shift_max_px == 0.0 and cam.total.nearest_pixel_changed == 0
            assert cam.total.cells_only_old == cam.total.cells_only_new == 0
    # the grid outputs change (the moved camera's cells are resampled); cells that gained or
    # lost the camera are split off
    for ih, (out, (_, stats)) in enumerate(zip(moved_report.output, moved_report.cameras[MOVED].heights, strict=True)):
        assert out.label == f"z={HEIGHTS[ih]:g} m"
        assert out.max_abs > 0 and math.isfinite(out.psnr_db)
        assert out.cells_coverage_changed == stats.cells_only_old + stats.cells_only_new
        assert 0 < out.max_abs_same_coverage <= out.max_abs


def test_one_shift_value_equals_an_independent_projection(moved_report: Any) -> None:
    """The reported max-shift cell: project its ego centre with both rigs (float64)."""
    old_rig, new_rig = parse_config(_data()), parse_config(_moved_data())
    stats = moved_report.cameras[MOVED].total
    ih, iy, ix = stats.max_shift_cell
    bev = old_rig.bev
    point = np.array([bev.x.min + (ix + 0.5) * bev.x.step, bev.y.min + (iy + 0.5) * bev.y.step, HEIGHTS[ih]])
    assert tuple(point) == pytest.approx(stats.max_shift_cell_ego_m, abs=0)
    uv_old, ok_old = project_bev_to_feature(old_rig, old_rig.cameras[MOVED], point)
    uv_new, ok_new = project_bev_to_feature(new_rig, new_rig.cameras[MOVED], point)
    assert ok_old and ok_new
    expected = float(np.hypot(*(uv_new - uv_old)))
    assert stats.shift_max_px == pytest.approx(expected, abs=1e-5)  # float32 grid/coords vs float64


def test_shift_map_and_mean_match_the_float64_projection(stores: dict[str, Path], moved_report: Any) -> None:
    old_rig, new_rig = parse_config(_data()), parse_config(_moved_data())
    ref_old, ref_new = compute_sampling_grid(old_rig), compute_sampling_grid(new_rig)
    ref = sampling_shift_px(ref_old.coords_feature_px, ref_old.valid, ref_new.coords_feature_px, ref_new.valid)
    a, b = load(stores["old"])["grid"], load(stores["moved"])["grid"]
    got = sampling_shift_px(a["coords"], a["valid"], b["coords"], b["valid"])
    np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))
    np.testing.assert_allclose(got[~np.isnan(got)], ref[~np.isnan(ref)], atol=1e-5)
    total = moved_report.cameras[MOVED].total
    assert total.shift_mean_px == pytest.approx(float(np.nanmean(ref[MOVED])), abs=1e-5)
    assert total.cells_both == int(np.count_nonzero(~np.isnan(ref[MOVED])))
    for ih, (height, stats) in enumerate(moved_report.cameras[MOVED].heights):
        assert height == HEIGHTS[ih]
        assert stats.shift_max_px == pytest.approx(float(np.nanmax(ref[MOVED, ih])), abs=1e-5)


def test_matrix_output_change_equals_the_direct_coo_product(stores: dict[str, Path], moved_report: Any) -> None:
    rig = parse_config(_data())
    features, depth = make_features(rig, 4, 3)
    inputs = SeededInputs(rig, 4, 3)
    assert inputs.features.tobytes() == features.tobytes()
    assert np.stack(list(inputs.depth_probs())).tobytes() == depth.tobytes()  # the same bytes as verify
    outs = []
    for key in ("old", "moved"):
        group = load(stores[key])["matrix"]
        lifted = lifted_columns(rig, "frustum", group["coo_col"], features, depth)
        outs.append(apply_entries(group["coo_row"], group["coo_val"], lifted, rig.bev.nx * rig.bev.ny))
    diff = outs[1] - outs[0]
    m = moved_report.matrix
    assert m is not None and m.mode == "frustum" and m.build_options["topk"] == TOPK
    assert m.output.max_abs == pytest.approx(float(np.abs(diff).max()), rel=1e-9)
    assert m.output.mean_abs == pytest.approx(float(np.abs(diff).mean()), rel=1e-9)
    assert m.output.peak == pytest.approx(float(outs[0].max() - outs[0].min()), rel=1e-12)
    assert 0 < m.rows_entry_set_changed <= m.rows_changed < m.n_rows


def test_matrix_is_skipped_with_a_note(stores: dict[str, Path]) -> None:
    report = diff_stores(stores["old"], stores["moved_topk4"])
    assert report.matrix is None
    assert report.notes == ["matrix/: skipped: build options differ (topk 8 vs 4)"]
    report = diff_stores(stores["old"], stores["grid_only"])
    assert report.matrix is None
    assert report.notes == ["matrix/: skipped: only OLD has a matrix/ group (`bevcompile matrix` writes it)"]


def _swap_first_cameras(data: dict[str, Any]) -> dict[str, Any]:
    data["cameras"][0], data["cameras"][1] = data["cameras"][1], data["cameras"][0]
    return data


INCOMPARABLE = [
    ("feature map", lambda d: d["feature"].update(stride=16) or d, {}, "cannot compare: feature map 12x8 vs 6x4"),
    ("camera order", _swap_first_cameras, {}, "cannot compare: cameras[0] is FRONT vs LEFT (same cameras in the same order needed)"),
    ("camera count", lambda d: d.update(cameras=d["cameras"][:3]) or d, {}, "cannot compare: 4 cameras vs 3 cameras (cameras[3] RIGHT only in OLD)"),
    ("bev x", lambda d: d["bev"].update(x=[-12.0, 12.0, 0.5]) or d, {}, "cannot compare: BEV x grid [-12.0, 12.0, 1.0] vs [-12.0, 12.0, 0.5]"),
    ("heights", lambda d: d["bev"].update(heights=[0.0]) or d, {}, "cannot compare: BEV heights [0.0, 0.5] vs [0.0]"),
    ("align_corners", lambda d: d, {"align_corners": True}, "cannot compare: grid align_corners False vs True"),
    ("bev frame", lambda d: rigs.in_lidar_frame(d | {"sensors": [rigs.SMALL_TOP_SENSOR]}), {},
     "cannot compare: BEV frame ego vs LIDAR_TOP (the cells are not the same places)"),
]


@pytest.mark.parametrize(("edit", "grid_kwargs", "message"), [c[1:] for c in INCOMPARABLE], ids=[c[0] for c in INCOMPARABLE])
def test_incomparable_stores_name_the_first_difference(
    stores: dict[str, Path], tmp_path: Path, edit: Any, grid_kwargs: dict[str, Any], message: str
) -> None:
    other = _build(edit(copy.deepcopy(_data())), tmp_path, **grid_kwargs)
    with pytest.raises(UsageError) as info:
        diff_stores(stores["old"], other)
    assert str(info.value) == message


def test_a_recalibrated_frame_sensor_moves_every_cameras_pose_in_the_bev_frame(tmp_path: Path) -> None:
    """``bev.frame: LIDAR_TOP``: moving the lidar by 20 mm (its calibration changed, the cameras
    did not) is a config change of ``sensors[0]`` and moves every camera by 20 mm in the BEV frame,
    which is what moves the tables."""
    old = rigs.in_lidar_frame(rigs.small_rig_with_sensor_data(heights=HEIGHTS))
    new = copy.deepcopy(old)
    new["sensors"][0]["sensor2ego"][0][3] += 0.02
    report = diff_stores(_build(old, tmp_path / "old"), _build(new, tmp_path / "new"))
    assert [c.field for c in report.config_changes] == ["sensors[0].sensor2ego"]
    for cam in report.cameras:
        assert cam.translation_mm == pytest.approx(20.0, abs=1e-9) and cam.rotation_deg == 0.0
        assert cam.total.shift_max_px is not None and cam.total.shift_max_px > 0.01


def test_config_changes_use_config_field_paths() -> None:
    old = rigs.nuscenes_data()
    new = rigs.nuscenes_data()
    new["cameras"][2]["translation"][1] += 0.01
    new["cameras"][0]["intrinsic"][0][2] += 2.0
    new["image_aug"]["crop"] = [0, 130]
    new["description"] = "edited free text is not a change"
    changes = config_changes(parse_config(old), parse_config(new))
    assert [c.field for c in changes] == ["cameras[0].intrinsic", "cameras[2].translation", "image_aug.crop"]
    assert changes[1].old == old["cameras"][2]["translation"] and changes[1].new == new["cameras"][2]["translation"]
    assert changes[2].old == [0.0, 140.0] and changes[2].new == [0.0, 130.0]
    one = rigs.nuscenes_data()
    one["cameras"][3]["image_aug"] = {"crop": [0, 130]}
    assert [c.field for c in config_changes(parse_config(old), parse_config(one))] == ["cameras[3].image_aug.crop"]


def test_rotation_angle_is_accurate_for_small_angles() -> None:
    for deg in (1e-6, 0.2, 30.0, 179.0):
        t = math.radians(deg)
        axis = np.array([1.0, 2.0, -2.0]) / 3.0
        k = np.array([[0, -axis[2], axis[1]], [axis[2], 0, -axis[0]], [-axis[1], axis[0], 0]])
        rotation = np.eye(3) + math.sin(t) * k + (1 - math.cos(t)) * k @ k  # Rodrigues
        base = np.array([[0.0, 0.0, 1.0], [-1.0, 0.0, 0.0], [0.0, -1.0, 0.0]])
        assert rotation_angle_deg(base, base @ rotation) == pytest.approx(deg, rel=1e-9, abs=1e-12)


def test_gate_rules() -> None:
    moved = ShiftStats(1000, 100, 5, 30, 0.4, 0.2, 0.3, 7, (0, 1, 2), (1.0, 2.0, 0.0))
    assert gate_failures(moved, None, None) == ()
    assert gate_failures(moved, 0.4, 0.03) == ()  # limits are inclusive
    assert gate_failures(moved, 0.39, 0.029) == (
        "max shift 0.4 px > --max-shift-px 0.39",
        "gained 30 of 1000 BEV cells (0.03) > --max-coverage-change 0.029",
    )
    gone = ShiftStats(1000, 0, 100, 0, None, None, None, 0, None, None)  # the camera lost every cell
    assert gate_failures(gone, 1.0, None) == (
        "no cell valid in both stores (lost 100, gained 0): shift unmeasurable, --max-shift-px 1 fails",
    )
    blind = ShiftStats(1000, 0, 0, 0, None, None, None, 0, None, None)  # sees nothing in either store
    assert gate_failures(blind, 0.0, 0.0) == ()


# --------------------------------------------------------------------------------------
# command line
# --------------------------------------------------------------------------------------



def test_cli_tables_exit_0(stores: dict[str, Path]) -> None:
    result = runner.invoke(app, ["diff", str(stores["old"]), str(stores["moved"])])
    assert result.exit_code == 0, result.output
    assert result.stderr == ""
    out = _flat(result.stdout)
    for needle in ("config changes", "cameras[1].sensor2ego", "LEFT 0.5 50", "FRONT 0 0", "per camera and height",
                   "grid/coords float32", "output change", "z=0.5 m", "matrix/", "rows (BEV cells) whose entry set changed"):
        assert needle in out, needle


def test_cli_gate_fails_with_one_stderr_line_per_camera(stores: dict[str, Path], moved_report: Any) -> None:
    old, moved = str(stores["old"]), str(stores["moved"])
    shift = moved_report.cameras[MOVED].total.shift_max_px
    result = runner.invoke(app, ["diff", old, moved, "--max-shift-px", "0.01", "--quiet"])
    assert result.exit_code == 1
    assert result.stdout == ""
    assert result.stderr.splitlines() == [
        f"{moved}: LEFT: max shift {shift:.4g} px > --max-shift-px 0.01 (vs {old})",
        f"error: diff gate failed: 1 of 4 cameras of {moved}",
    ]
    result = runner.invoke(app, ["diff", old, moved, "--max-shift-px", f"{shift + 0.001}", "--max-coverage-change", "0.5"])
    assert result.exit_code == 0, result.output
    assert result.stderr == "" and "4 of 4 cameras within" in _flat(result.stdout)


def test_cli_coverage_gate(stores: dict[str, Path], moved_report: Any) -> None:
    total = moved_report.cameras[MOVED].total
    assert total.cells_only_old + total.cells_only_new > 0  # the moved camera's footprint changed
    result = runner.invoke(app, ["diff", str(stores["old"]), str(stores["moved"]), "--max-coverage-change", "0", "--seed", "3", "--channels", "4"])
    assert result.exit_code == 1
    lines = result.stderr.splitlines()
    assert len(lines) == 2 and lines[0].startswith(f"{stores['moved']}: LEFT: ") and lines[1].startswith("error: diff gate failed")
    verb, cells = ("lost", total.cells_only_old) if total.cells_only_old else ("gained", total.cells_only_new)
    assert f"{verb} {cells} of {total.n_cells} BEV cells" in lines[0] and "> --max-coverage-change 0" in lines[0]
    assert "FAIL" in result.stdout


def test_cli_json_round_trip(stores: dict[str, Path], moved_report: Any) -> None:
    result = runner.invoke(app, ["diff", str(stores["old"]), str(stores["moved"]), "--json", "--seed", "3", "--channels", "4"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data == json.loads(json.dumps(moved_report.to_json(), allow_nan=False))
    assert data["passed"] is True and data["gate"] == {"max_shift_px": None, "max_coverage_change": None}
    left = data["cameras"][MOVED]
    assert left["camera"] == "LEFT" and left["rotation_deg"] == pytest.approx(YAW_DEG) and left["translation_mm"] == pytest.approx(50.0)
    assert [h["height_m"] for h in left["per_height"]] == list(HEIGHTS)
    assert data["shift_source"].startswith("grid/coords (float32)")
    same = runner.invoke(app, ["diff", str(stores["old"]), str(stores["same"]), "--json"])
    assert same.exit_code == 0 and all(o["psnr_db"] is None for o in json.loads(same.stdout)["output"])  # inf -> null


def test_cli_incomparable_exit_2_one_line(stores: dict[str, Path], tmp_path: Path) -> None:
    data = _data()
    data["feature"]["stride"] = 16
    other = _build(data, tmp_path)
    result = runner.invoke(app, ["diff", str(stores["old"]), str(other)])
    assert result.exit_code == 2
    assert result.stdout == ""
    assert result.stderr == "error: cannot compare: feature map 12x8 vs 6x4\n"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--max-shift-px", "-1"], "error: --max-shift-px must be a finite number >= 0, got -1.0\n"),
        (["--max-coverage-change", "1.5"], "error: --max-coverage-change must be a fraction in [0, 1], got 1.5\n"),
        (["--channels", "0"], "error: --channels must be in [1, 512], got 0\n"),
    ],
)
def test_cli_bad_options_exit_2(stores: dict[str, Path], args: list[str], message: str) -> None:
    result = runner.invoke(app, ["diff", str(stores["old"]), str(stores["same"]), *args])
    assert result.exit_code == 2
    assert result.stderr == message


def test_cli_not_a_store_exit_2(stores: dict[str, Path], tmp_path: Path) -> None:
    missing = tmp_path / "nope.zarr"
    result = runner.invoke(app, ["diff", str(stores["old"]), str(missing)])
    assert result.exit_code == 2
    assert result.stderr == f"error: {missing}: no such store\n"
    result = runner.invoke(app, ["diff", str(tmp_path), str(stores["old"])])
    assert result.exit_code == 2
    assert result.stderr == f"error: {tmp_path}: not a zarr store (no zarr.json at its root)\n"


# --------------------------------------------------------------------------------------
# damaged stores (content hash recomputed, so only diff's own checks can notice)
# --------------------------------------------------------------------------------------


def _damaged(stores: dict[str, Path], tmp_path: Path, array: str, edit: Any, key: str = "old") -> Path:
    """A copy of ``stores[key]`` whose ``array`` is replaced by ``edit(copy of its values)``."""
    store = damage.copy_store(stores[key], tmp_path / f"damaged-{key}")
    values = np.array(load(store)[array.split("/")[0]][array.split("/")[1]])
    damage.rewrite_array(store, array, edit(values))
    return store


def _first_valid_cell(stores: dict[str, Path], cam: int) -> tuple[int, int, int]:
    valid = np.asarray(load(stores["old"])["grid"]["valid"], dtype=bool)[cam]
    ih, iy, ix = (int(i) for i in np.argwhere(valid)[0])
    return ih, iy, ix


def _set_coords(cam: int, cell: tuple[int, int, int], value: float) -> Any:
    def edit(coords: np.ndarray) -> np.ndarray:
        coords[(cam, *cell, 0)] = value
        return coords

    return edit


@pytest.mark.parametrize("side", ["old", "new"])
@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_non_finite_shift_fails_the_gate(stores: dict[str, Path], tmp_path: Path, side: str, value: float) -> None:
    cell = _first_valid_cell(stores, 0)
    damaged = _damaged(stores, tmp_path, "grid/coords", _set_coords(0, cell, value))
    old, new = (damaged, stores["old"]) if side == "old" else (stores["old"], damaged)
    report = diff_stores(old, new, max_shift_px=1000.0, max_coverage_change=1.0)
    front = report.cameras[0].total
    assert front.shift_max_px is not None and not math.isfinite(front.shift_max_px)
    assert (math.isnan(front.shift_max_px) if math.isnan(value) else front.shift_max_px == math.inf)
    assert front.max_shift_cell == cell  # the first non-finite cell is the one reported
    assert report.cameras[0].failures == (
        f"max shift not finite ({front.shift_max_px} px; non-finite grid/coords): --max-shift-px 1000 fails",
    )
    assert not report.passed and [c.camera for c in report.failing_cameras] == ["FRONT"]
    assert all(c.passed and c.total.shift_max_px == 0.0 for c in report.cameras[1:])
    side_name = "OLD" if side == "old" else "NEW"
    assert report.notes == [
        f"{side_name} {damaged}: grid/coords has 1 non-finite value(s) (NaN/inf; a built store has none, "
        "`bevcompile inspect` checks it): the shift figures that use them are not finite"
    ]
    # no gate: the figure stays visible, nothing fails
    assert diff_stores(old, new).passed


def test_cli_nan_shift_gate_exit_1_one_line(stores: dict[str, Path], tmp_path: Path) -> None:
    damaged = _damaged(stores, tmp_path, "grid/coords", _set_coords(0, _first_valid_cell(stores, 0), math.nan))
    old = str(stores["old"])
    result = runner.invoke(app, ["diff", old, str(damaged), "--max-shift-px", "0.25"])
    assert result.exit_code == 1
    assert result.stderr.splitlines() == [
        f"{damaged}: FRONT: max shift not finite (nan px; non-finite grid/coords): --max-shift-px 0.25 fails (vs {old})",
        f"error: diff gate failed: 1 of 4 cameras of {damaged}",
    ]
    out = _flat(result.stdout)
    assert "FRONT nan nan nan" in out and "FAIL" in out and "3 of 4 cameras within --max-shift-px 0.25" in out
    assert "note: NEW" in out and "grid/coords has 1 non-finite value(s)" in out
    result = runner.invoke(app, ["diff", old, str(damaged), "--max-shift-px", "0.25", "--json"])
    assert result.exit_code == 1
    data = json.loads(result.stdout)
    front = data["cameras"][0]
    assert front["shift_max_px"] is None and front["passed"] is False and "not finite" in front["failures"][0]
    assert data["passed"] is False and len(data["failures"]) == 1 and len(data["notes"]) == 1


def test_gate_rules_fail_non_finite_figures() -> None:
    for value in (math.nan, math.inf):
        stats = ShiftStats(1000, 100, 0, 0, value, value, value, 1, (0, 0, 0), (0.0, 0.0, 0.0))
        assert gate_failures(stats, 1e9, None) == (f"max shift not finite ({value} px; non-finite grid/coords): --max-shift-px 1e+09 fails",)
        assert gate_failures(stats, None, 1.0) == ()  # the coverage figures are finite
        assert gate_failures(stats, None, None) == ()


def _one_row_with_two_entries(rows: np.ndarray) -> int:
    """Index ``i`` of an entry whose row also holds entry ``i + 1``."""
    return int(np.flatnonzero(rows[1:] == rows[:-1])[0])


def _swap_in_row(stores: dict[str, Path]) -> Any:
    i = _one_row_with_two_entries(np.asarray(load(stores["old"])["matrix"]["coo_row"]))

    def edit(cols: np.ndarray) -> np.ndarray:
        cols[i], cols[i + 1] = cols[i + 1], cols[i]
        return cols

    return edit, f"0 duplicate(s), 1 out of order (first between entries {i} and {i + 1})"


def _duplicate_in_row(stores: dict[str, Path]) -> Any:
    i = _one_row_with_two_entries(np.asarray(load(stores["old"])["matrix"]["coo_row"]))

    def edit(cols: np.ndarray) -> np.ndarray:
        cols[i + 1] = cols[i]
        return cols

    return edit, f"1 duplicate(s), 0 out of order (first between entries {i} and {i + 1})"


@pytest.mark.parametrize("make", [_swap_in_row, _duplicate_in_row], ids=["unsorted", "duplicate"])
def test_unsorted_or_duplicate_coo_is_one_line_exit_2(stores: dict[str, Path], tmp_path: Path, make: Any) -> None:
    edit, detail = make(stores)
    damaged = _damaged(stores, tmp_path, "matrix/coo_col", edit)
    message = f"{damaged}: matrix/coo_row, coo_col: entries not sorted by (row, col) without duplicates: {detail}"
    with pytest.raises(StoreError) as info:
        diff_stores(stores["old"], damaged)
    assert str(info.value) == message
    for old, new in ((stores["old"], damaged), (damaged, stores["moved"])):
        result = runner.invoke(app, ["diff", str(old), str(new)])
        assert result.exit_code == 2, result.output
        assert result.stdout == ""
        assert result.stderr == f"error: {message}\n"


def test_coo_out_of_range_and_shape_are_one_line_exit_2(stores: dict[str, Path], tmp_path: Path) -> None:
    _, ny, nx = load(stores["old"]).bev_shape
    n_rows = ny * nx  # no compact rows: one row per BEV cell
    damaged = _damaged(stores, tmp_path, "matrix/coo_row", lambda rows: np.concatenate([rows[:-1], [n_rows]]).astype(rows.dtype))
    result = runner.invoke(app, ["diff", str(stores["old"]), str(damaged)])
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr.startswith(f"error: {damaged}: matrix/coo_row out of range [0, {n_rows})") and result.stderr.count("\n") == 1
    short = _damaged(stores, tmp_path / "short", "matrix/coo_val", lambda vals: vals[:-1])
    result = runner.invoke(app, ["diff", str(stores["old"]), str(short)])
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr.startswith(f"error: {short}: matrix/coo_row, coo_col, coo_val are inconsistent") and result.stderr.count("\n") == 1


def test_compact_row_ids_not_increasing_is_one_line_exit_2(tmp_path: Path) -> None:
    options = MatrixOptions(topk=TOPK, compact_rows=True)
    clean = _build(_data(), tmp_path / "clean", matrix=options)
    damaged = damage.copy_store(clean, tmp_path / "damaged")
    row_ids = np.array(load(damaged)["matrix"]["row_ids"])
    row_ids[1] = row_ids[0]
    damage.rewrite_array(damaged, "matrix/row_ids", row_ids)
    assert diff_stores(clean, clean).matrix is not None  # compact rows compare fine
    result = runner.invoke(app, ["diff", str(clean), str(damaged)])
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr == f"error: {damaged}: matrix/row_ids not strictly increasing\n"


def test_nan_coo_value_makes_the_matrix_figures_nan(stores: dict[str, Path], tmp_path: Path) -> None:
    def edit(vals: np.ndarray) -> np.ndarray:
        vals[len(vals) // 2] = np.nan
        return vals

    damaged = _damaged(stores, tmp_path, "matrix/coo_val", edit)
    report = diff_stores(stores["old"], damaged)
    m = report.matrix
    assert m is not None
    assert math.isnan(m.output.max_abs) and math.isnan(m.output.mean_abs) and math.isnan(m.output.psnr_db)
    assert m.rows_entry_set_changed == 0 and m.rows_changed == 1
    assert report.notes == [
        f"NEW {damaged}: matrix/coo_val has 1 non-finite value(s) (NaN/inf; a built store has none, "
        "`bevcompile inspect` checks it): the COO output figures that use them are not finite"
    ]
    assert all(o.max_abs == 0.0 for o in report.output)  # the grid tables are untouched
    # the same NaN on both sides: no row changed, but the product is still NaN (and both notes)
    same = diff_stores(damaged, damaged)
    assert same.matrix is not None and same.matrix.rows_changed == 0 and math.isnan(same.matrix.output.max_abs)
    assert [n.split(":")[0] for n in same.notes] == [f"OLD {damaged}", f"NEW {damaged}"]
    result = runner.invoke(app, ["diff", str(stores["old"]), str(damaged)])
    assert result.exit_code == 0 and result.stderr == ""
    out = _flat(result.stdout)
    assert "COO output max abs / mean abs nan / nan" in out and "range of the old output) nan" in out


def test_nan_grid_norm_makes_that_heights_output_nan(stores: dict[str, Path], tmp_path: Path) -> None:
    cell = _first_valid_cell(stores, 0)

    def edit(norm: np.ndarray) -> np.ndarray:
        norm[(0, *cell, 1)] = np.nan
        return norm

    damaged = _damaged(stores, tmp_path, "grid/norm", edit)
    report = diff_stores(stores["old"], damaged)
    ih = cell[0]
    hit, other = report.output[ih], report.output[1 - ih]
    assert math.isnan(hit.max_abs) and math.isnan(hit.mean_abs) and math.isnan(hit.psnr_db)
    assert hit.max_abs_same_coverage is not None and math.isnan(hit.max_abs_same_coverage)
    assert other.max_abs == 0.0 and other.psnr_db == math.inf
    assert report.cameras[0].total.shift_max_px == 0.0  # the shift uses grid/coords only
    assert report.notes == [
        f"NEW {damaged}: grid/norm has 1 non-finite value(s) (NaN/inf; a built store has none, "
        "`bevcompile inspect` checks it): the output-change figures that use them are not finite"
    ]
    result = runner.invoke(app, ["diff", str(stores["old"]), str(damaged), "--max-shift-px", "0"])
    assert result.exit_code == 0 and result.stderr == ""
    assert f"z={HEIGHTS[ih]:g} m nan nan nan" in _flat(result.stdout)


# --------------------------------------------------------------------------------------
# bev.region matrices
# --------------------------------------------------------------------------------------


def _region_data(region: dict[str, Any] | None, moved: bool = False) -> dict[str, Any]:
    data = _moved_data() if moved else _data()
    if region is not None:
        data["bev"]["region"] = region
    return data


@pytest.fixture(scope="module")
def region_stores(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from ..matrix.test_region import REGION

    base = tmp_path_factory.mktemp("diff_region")
    other = {"keep": REGION["keep"], "rings": [{"beyond_m": 4, "factor": 2}]}
    options = MatrixOptions(mode="grid", topk=TOPK)
    return {
        "region": _build(_region_data(REGION), base / "region", matrix=options),
        "region_moved": _build(_region_data(REGION, moved=True), base / "region_moved", matrix=options),
        "other_region": _build(_region_data(other), base / "other_region", matrix=options),
        "full": _build(_region_data(None), base / "full", matrix=options),
    }


def _direct_output(store: Path, dense: bool) -> np.ndarray:
    """The COO product computed here (apply_entries on the stored rows; dense: each fine cell reads
    its row through matrix/expand, a full-grid store's rows are its cells)."""
    loaded = load(store)
    rig = loaded.rig
    group = loaded["matrix"]
    features, _ = make_features(rig, 4, 0)
    lifted = lifted_columns(rig, "grid", group["coo_col"], features, None)
    n_rows = int(loaded.array_info("matrix", "cells").shape[0]) + 1 if "expand" in group else rig.bev.nx * rig.bev.ny
    out = apply_entries(group["coo_row"], group["coo_val"], lifted, n_rows)
    return out[np.asarray(group["expand"])] if dense and "expand" in group else out


def test_region_stores_of_the_same_region_compare_row_by_row(region_stores: dict[str, Path]) -> None:
    old, new = region_stores["region"], region_stores["region_moved"]
    report = diff_stores(old, new, seed=0, channels=4)
    m = report.matrix
    n_kept = int(load(old).array_info("matrix", "cells").shape[0])
    assert m is not None and m.compared == "region rows" and m.n_rows == n_kept
    assert f"matrix/: both stores have the same bev.region: compared row by row over its {n_kept:,} kept (super-)cells" in report.notes
    diff = _direct_output(new, dense=False) - _direct_output(old, dense=False)
    assert m.output.max_abs == pytest.approx(float(np.abs(diff).max()), rel=1e-9)
    assert m.output.mean_abs == pytest.approx(float(np.abs(diff).mean()), rel=1e-9)
    assert m.rows_changed is not None and 0 < m.rows_changed < n_kept
    same = diff_stores(old, old).matrix
    assert same is not None and same.rows_changed == 0 and same.output.max_abs == 0.0


@pytest.mark.parametrize(("old", "new"), [("region", "other_region"), ("full", "region"), ("region", "full")])
def test_different_regions_compare_on_the_dense_map_and_say_so(region_stores: dict[str, Path], old: str, new: str) -> None:
    report = diff_stores(region_stores[old], region_stores[new], seed=0, channels=4)
    m = report.matrix
    assert m is not None and m.compared == "dense map"
    assert m.rows_entry_set_changed is None and m.rows_changed is None
    diff = _direct_output(region_stores[new], dense=True) - _direct_output(region_stores[old], dense=True)
    assert m.output.max_abs == pytest.approx(float(np.abs(diff).max()), rel=1e-9) and m.output.max_abs > 0
    assert m.output.mean_abs == pytest.approx(float(np.abs(diff).mean()), rel=1e-9)
    note = [n for n in report.notes if n.startswith("matrix/:")]
    assert len(note) == 1 and "compared on the dense 576-cell map the head sees" in note[0] and "changed rows are not counted" in note[0]
    want = {"region": "a bev.region of", "other_region": "a different bev.region", "full": "the full grid"}
    assert want[new] in note[0].split("NEW", 1)[1]
    result = runner.invoke(app, ["diff", str(region_stores[old]), str(region_stores[new])])
    assert result.exit_code == 0, result.output
    out = _flat(result.stdout)
    assert "COO output max abs / mean abs (dense map)" in out and "not counted" in out and "the output is compared on the dense" in out
    data = json.loads(runner.invoke(app, ["diff", str(region_stores[old]), str(region_stores[new]), "--json"]).stdout)
    assert data["matrix"]["compared"] == "dense map" and data["matrix"]["rows_changed"] is None


# --------------------------------------------------------------------------------------
# bev.region grid stores
# --------------------------------------------------------------------------------------


def test_diff_of_region_grid_stores_compares_the_cells_both_sample(tmp_path: Path) -> None:
    """Region vs region (moved camera): the shifts are over the kept cells and equal an independent
    re-projection of one super-cell's centre; region vs its full-grid twin: only the fine kept cells
    (equal (iy, ix, size)) are compared, and they are identical (0 shift, 0 output change)."""
    from ..matrix.test_region import REGION

    def with_region(data: dict[str, Any]) -> dict[str, Any]:
        data["bev"]["region"] = REGION
        return data

    full = _build(_data(), tmp_path / "full")
    old = _build(with_region(_data()), tmp_path / "old")
    moved = _build(with_region(_moved_data()), tmp_path / "moved")
    cells = np.asarray(load(old)["grid"]["cells"])
    n_fine = int(np.count_nonzero(cells[:, 2] == 1))

    twin = diff_stores(full, old, seed=1, channels=2)
    assert any(f"{n_fine} cells in both" in note for note in twin.notes), twin.notes
    assert all(c.total.shift_max_px in (0.0, None) for c in twin.cameras)
    assert all(o.max_abs == 0.0 for o in twin.output)

    report = diff_stores(old, moved, seed=1, channels=2)
    assert any(f"{cells.shape[0]} cells in both" in note for note in report.notes), report.notes
    rig_old, rig_new = load(old).rig, load(moved).rig
    k = int(np.flatnonzero(cells[:, 2] == 4)[0])
    iy, ix, size = (int(v) for v in cells[k])
    point = np.array([[rig_old.bev.x.min + (ix + size / 2) * rig_old.bev.x.step, rig_old.bev.y.min + (iy + size / 2) * rig_old.bev.y.step, HEIGHTS[0]]])
    shifts = []
    for cam in range(rig_old.n_cam):
        a, ok_a = project_bev_to_feature(rig_old, rig_old.cameras[cam], point)
        b, ok_b = project_bev_to_feature(rig_new, rig_new.cameras[cam], point)
        if ok_a[0] and ok_b[0]:
            shifts.append(float(np.hypot(*(b[0] - a[0]))))
    moved_stats = report.cameras[MOVED].total
    assert moved_stats.shift_max_px is not None and moved_stats.shift_max_px > 0
    # the max-shift cell's recorded centre: a kept (super-)cell's centre, its shift re-projected here
    ih, miy, mix = moved_stats.max_shift_cell  # type: ignore[misc]
    km = int(np.flatnonzero((cells[:, 0] == miy) & (cells[:, 1] == mix))[0])
    msize = int(cells[km, 2])
    centre = (rig_old.bev.x.min + (mix + msize / 2) * rig_old.bev.x.step, rig_old.bev.y.min + (miy + msize / 2) * rig_old.bev.y.step, HEIGHTS[ih])
    assert moved_stats.max_shift_cell_ego_m == pytest.approx(centre)
    a, _ = project_bev_to_feature(rig_old, rig_old.cameras[MOVED], np.array([centre]))
    b, _ = project_bev_to_feature(rig_new, rig_new.cameras[MOVED], np.array([centre]))
    assert moved_stats.shift_max_px == pytest.approx(float(np.hypot(*(b[0] - a[0]))), abs=1e-3)
    result = runner.invoke(app, ["diff", str(old), str(moved)])
    assert result.exit_code == 0, result.output
    assert "bev.region: compared the (super-)cells both stores sample" in " ".join(result.output.split())
    assert shifts  # the super-cell is seen by some camera in both (the moved camera's shift is measured there)
