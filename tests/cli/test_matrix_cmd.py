"""`bevcompile matrix` from the command line: the bundled rig, the store it writes, the summary,
JSON, and one-line errors (exit 2)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from bevcompile import memory
from bevcompile.cli import app
from bevcompile.matrix.build import MatrixOptions, build_matrix
from bevcompile.store.zarr_io import open_store

from ..rigs import nuscenes_rig, small_rig, small_rig_data, write_yaml
from . import table_words as _flat

runner = CliRunner()



def test_bare_matrix_topk24_align16_uses_the_bundled_rig(tmp_path: Path) -> None:
    """`bevcompile matrix --topk 24 --align 16` from a folder without configs: bundled nuScenes rig, artifacts/."""
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        result = runner.invoke(app, ["matrix", "--topk", "24", "--align", "16"])
    finally:
        os.chdir(cwd)
    assert result.exit_code == 0, result.output
    out = _flat(result.stdout)
    for needle in ("rows (logical / padded)", "16,384 / 16,384", "249,216", "per-row nnz min / median / max", "1 / 17 / 24",
                   "build time", "peak memory", "bytes per product", "ELL shape (rows_pad x k_pad) 16,384 x 32"):
        assert needle in out, needle
    assert f"wrote {Path('artifacts') / 'nuscenes.zarr'} matrix/" in out
    reader = open_store(tmp_path / "artifacts" / "nuscenes.zarr")
    assert reader.groups() == ["matrix"]
    attrs = reader.group_attrs("matrix")
    assert attrs["build_options"] == MatrixOptions(topk=24, align=16).to_dict()
    assert attrs["ell"]["shape"] == [16384, 32] and attrs["logical_shape"] == [16384, 249216]
    want = build_matrix(nuscenes_rig(), MatrixOptions(topk=24, align=16))
    assert np.array_equal(reader.read("matrix", "coo_col"), want.coo_col)
    assert reader.array_info("matrix", "ell_index").dtype == "int32"


def test_json_summary_all_products(tmp_path: Path) -> None:
    config = write_yaml(tmp_path / "rig.yaml", small_rig_data(heights=(0.0, 1.0)))
    args = ["matrix", str(config), "--out", str(tmp_path), "--mode", "grid", "--topk", "3", "--align", "8",
            "--tile-rows", "32", "--quantize", "int8", "--compact-rows", "--normalize", "mean", "--json"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["name"] == "small" and summary["build_options"]["mode"] == "grid"
    assert summary["row_nnz"]["max"] <= 3 and summary["padded_shape"][0] % 8 == 0
    assert 0 < summary["int8_max_rel_error"] <= 0.5 / 127 * 1.001
    assert summary["tile_bytes"] > 0 and summary["dense_bytes"] == summary["logical_shape"][0] * summary["logical_shape"][1] * 4
    reader = open_store(tmp_path / "small.zarr")
    names = set(reader.arrays("matrix"))
    assert {"row_ids", "tile_cols", "tile_col_offsets", "tile_weight", "ell_weight_int8", "row_scale", "tile_weight_int8", "tile_row_scale"} <= names


def test_quiet_prints_nothing_and_keeps_the_grid_group(tmp_path: Path) -> None:
    config = write_yaml(tmp_path / "rig.yaml", small_rig_data())
    assert runner.invoke(app, ["grid", str(config), "--out", str(tmp_path), "--quiet"]).exit_code == 0
    result = runner.invoke(app, ["matrix", str(config), "--out", str(tmp_path), "--quiet", "--splat", "nearest", "--rounding", "trunc"])
    assert result.exit_code == 0 and result.stdout == ""
    reader = open_store(tmp_path / "small.zarr")
    assert {"grid", "matrix"} <= set(reader.groups())
    assert reader.group_attrs("matrix")["rounding"] == "trunc"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--topk", "-1"], "error: --topk must be an integer >= 0, got -1"),
        (["--align", "0"], "error: --align must be an integer in [1, 65536], got 0"),
        (["--mode", "voxel"], "error: --mode must be one of frustum, grid, ray, got 'voxel'"),
        (["--splat", "cubic"], "error: --splat must be one of nearest, bilinear, got 'cubic'"),
        (["--normalize", "max"], "error: --normalize must be one of sum, mean, got 'max'"),
        (["--tile-rows", "0"], "error: --tile-rows must be an integer >= 1, got 0"),
        (["--quantize", "int4"], "error: --quantize must be one of none, int8, fp16, mixed, got 'int4'"),
        (["--rounding", "round"], "error: --rounding must be one of floor, trunc, got 'round'"),
        (["--quantize", "mixed"], "error: --quantize mixed needs --fp16-rows beyond:METRES, snr:DB or fraction:F (which rows keep float16 values)"),
        (["--quantize", "int8", "--fp16-rows", "beyond:30"], "error: --fp16-rows applies to --quantize mixed only (--quantize int8)"),
        (["--quantize", "mixed", "--fp16-rows", "far:30"], "error: --fp16-rows kind must be one of beyond, snr, fraction, got 'far'"),
        (["--quantize", "mixed", "--fp16-rows", "fraction:2"], "error: --fp16-rows fraction: the fraction must be in (0, 1], got 2"),
        (["--jobs", "0"], "error: --jobs must be an integer in [1, 1024], got 0"),
        (["-j", "1025"], "error: --jobs must be an integer in [1, 1024], got 1025"),
        (["--mode", "grid", "--rounding", "trunc"], "error: --rounding trunc applies to --mode frustum and ray only (grid-mode rows are BEV cells, nothing is rounded)"),
        (
            ["--align", "65536"],
            "error: ELL (at least 65,536 rows_pad x 65,536 k_pad, from --align 65,536) would hold 4,294,967,296 slots "
            "(16.0 GiB per float32 array), over the 268,435,456-slot limit of one product; lower --align",
        ),
        (
            ["--topk", "100000000"],
            "error: ELL (16,384 rows_pad x 100,000,000 k_pad, from --topk 100,000,000 --align 16) would hold "
            "1,638,400,000,000 slots (6,103.5 GiB per float32 array), over the 268,435,456-slot limit of one product; lower --topk or --align",
        ),
        (
            ["--tile-rows", "100000000"],
            "error: the tiles (at least 100,000,000 rows x 16 columns, from --tile-rows 100,000,000 --align 16) would hold "
            "1,600,000,000 slots (6.0 GiB per float32 array), over the 268,435,456-slot limit of one product; use fewer --tile-rows or a smaller --align",
        ),
    ],
)
def test_bad_values_are_one_line_exit_2_and_write_nothing(tmp_path: Path, args: list[str], message: str) -> None:
    result = runner.invoke(app, ["matrix", "--out", str(tmp_path), *args])
    assert result.exit_code == 2
    assert result.stderr.strip() == message
    assert not any(tmp_path.iterdir())


def test_missing_config_is_one_line_exit_2(tmp_path: Path) -> None:
    result = runner.invoke(app, ["matrix", str(tmp_path / "nope.yaml"), "--out", str(tmp_path)])
    assert result.exit_code == 2
    assert result.stderr.strip() == f"error: {tmp_path / 'nope.yaml'}: file not found"


def test_refuses_a_store_of_another_config_without_force(tmp_path: Path) -> None:
    config = write_yaml(tmp_path / "rig.yaml", small_rig_data())
    assert runner.invoke(app, ["matrix", str(config), "--out", str(tmp_path), "-q"]).exit_code == 0
    before = open_store(tmp_path / "small.zarr").read("matrix", "coo_col")
    other = write_yaml(tmp_path / "other.yaml", small_rig_data(bev_half_m=10.0))
    result = runner.invoke(app, ["matrix", str(other), "--out", str(tmp_path), "-q"])
    assert result.exit_code == 2
    assert "was built from a different config" in result.stderr and "pass --force to replace it" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert np.array_equal(open_store(tmp_path / "small.zarr").read("matrix", "coo_col"), before)
    result = runner.invoke(app, ["matrix", str(other), "--out", str(tmp_path), "-q", "--force"])
    assert result.exit_code == 0
    assert open_store(tmp_path / "small.zarr").read("matrix", "coo_row").max() < 20 * 20
    assert small_rig().bev.nx == 24  # the replaced store was the 24 x 24 rig


def test_force_says_which_groups_of_the_replaced_store_it_drops(tmp_path: Path) -> None:
    """`matrix --force` over another config's store keeps nothing of it: it says so, group by
    group, on stderr (also with --quiet), instead of deleting grid/, gather/, delta/ silently."""
    config = write_yaml(tmp_path / "rig.yaml", small_rig_data())
    assert runner.invoke(app, ["grid", str(config), "--out", str(tmp_path), "-q"]).exit_code == 0
    other = write_yaml(tmp_path / "other.yaml", small_rig_data(bev_half_m=10.0))
    result = runner.invoke(app, ["matrix", str(other), "--out", str(tmp_path), "-q", "--force"])
    assert result.exit_code == 0, result.output
    assert result.stderr == (
        f"note: --force replaced {tmp_path / 'small.zarr'} (built from another config) and dropped its group(s) "
        "delta/, gather/, grid/; this command does not rebuild them\n"
    )
    assert open_store(tmp_path / "small.zarr").groups() == ["matrix"]
    again = runner.invoke(app, ["matrix", str(other), "--out", str(tmp_path), "-q", "--force"])
    assert again.exit_code == 0 and again.stderr == ""  # same config: nothing dropped, nothing said


@pytest.mark.parametrize("command", ["grid", "matrix"])
def test_one_wording_for_an_integer_option_out_of_range(tmp_path: Path, command: str) -> None:
    result = runner.invoke(app, [command, "--out", str(tmp_path), "--align", "0"])
    assert result.exit_code == 2
    bound = {"grid": 1 << 20, "matrix": 65536}[command]
    assert result.stderr == f"error: --align must be an integer in [1, {bound}], got 0\n"


def test_fp16_and_mixed_summaries_then_inspect_strict(tmp_path: Path) -> None:
    """``--quantize fp16`` and ``--quantize mixed --fp16-rows``: the summary names the fp16 error
    and the fp16 rows; the JSON records them; ``inspect --strict`` and ``verify`` pass."""
    from . import assert_strict_and_verify_pass

    mixed = runner.invoke(app, ["matrix", "--out", str(tmp_path), "--topk", "24", "--tile-rows", "512", "--quantize", "mixed", "--fp16-rows", "beyond:35"])
    assert mixed.exit_code == 0, mixed.output
    words = _flat(mixed.stdout)
    assert "fp16 max error (rel. to row max)" in words and "mixed: fp16 rows (beyond:35.0) 9,744 (61.8 % of rows with entries)" in words
    assert "ell_mixed" in words and "tiles_mixed" in words
    verify = assert_strict_and_verify_pass(tmp_path / "nuscenes.zarr")
    assert "matrix/ell_mixed" in verify and "matrix/tiles_mixed" in verify
    fp16 = runner.invoke(app, ["matrix", "--out", str(tmp_path), "--topk", "24", "--quantize", "FP16", "--json", "--quiet"])
    data = json.loads(fp16.stdout)
    assert fp16.exit_code == 0 and data["build_options"]["quantize"] == "fp16" and "fp16_rows" not in data["build_options"]
    assert 0 < data["fp16_max_rel_error"] < 1e-3 and data["n_fp16_rows"] is None
    assert data["product_bytes"]["ell_fp16"] == 16384 * 32 * (4 + 2)


def test_summary_reports_tiles_int8_and_topk_figures(tmp_path: Path) -> None:
    config = write_yaml(tmp_path / "rig.yaml", small_rig_data())
    result = runner.invoke(app, ["matrix", str(config), "--out", str(tmp_path), "--topk", "4", "--tile-rows", "64", "--quantize", "int8"])
    assert result.exit_code == 0, result.output
    out = _flat(result.stdout)
    assert "Top-K kept weight (all rows / worst row)" in out
    assert "tiles (9 x 64 rows) vs dense" in out and "int8 max error (rel. to row max)" in out
    for product in ("coo", "ell", "tiles", "ell_int8", "tiles_int8", "camera_mass", "dense (rows x cols float32)"):
        assert product in out


@pytest.mark.parametrize(("normalize", "topk", "noted"), [("sum", 2, True), ("mean", 2, False), ("sum", 0, False)])
def test_summary_notes_the_mass_topk_drops_under_sum(tmp_path: Path, normalize: str, topk: int, noted: bool) -> None:
    config = write_yaml(tmp_path / "rig.yaml", small_rig_data())
    result = runner.invoke(app, ["matrix", str(config), "--out", str(tmp_path), "--topk", str(topk), "--normalize", normalize])
    assert result.exit_code == 0, result.output
    out = _flat(result.stdout)
    assert ("note: Top-2 keeps" in out and "cells with the most sources lose mass" in out) == noted


def test_an_empty_matrix_is_written_and_flagged(tmp_path: Path) -> None:
    """A BEV box no camera reaches: the build succeeds and the summary says the matrix is empty."""
    data = small_rig_data()
    data["bev"]["x"] = [400.0, 410.0, 1.0]
    data["bev"]["y"] = [400.0, 410.0, 1.0]
    config = write_yaml(tmp_path / "far.yaml", data)
    result = runner.invoke(app, ["matrix", str(config), "--out", str(tmp_path), "--topk", "3", "--tile-rows", "8"])
    assert result.exit_code == 0, result.output
    flat = _flat(result.stdout)
    assert "warning: the matrix is empty" in " ".join(result.stderr.split())
    assert "nnz 0 " in flat
    assert "Top-K kept weight" not in flat and "%)" not in flat
    quiet = runner.invoke(app, ["matrix", str(config), "--out", str(tmp_path), "--quiet"])
    assert quiet.exit_code == 0 and quiet.stdout == "" and "the matrix is empty" in quiet.stderr


def test_out_that_is_a_store_is_refused(tmp_path: Path) -> None:
    """`--out artifacts/nuscenes.zarr` would write a store into the store: refused before any work."""
    config = write_yaml(tmp_path / "rig.yaml", small_rig_data())
    assert runner.invoke(app, ["matrix", str(config), "--out", str(tmp_path), "-q"]).exit_code == 0
    before = open_store(tmp_path / "small.zarr").read("matrix", "coo_col")
    result = runner.invoke(app, ["matrix", str(config), "--out", str(tmp_path / "small.zarr"), "-q"])
    assert result.exit_code == 2
    assert result.stderr == f"error: --out {tmp_path / 'small.zarr'} is a zarr store; --out takes the folder that holds stores\n"
    assert sorted(p.name for p in (tmp_path / "small.zarr").iterdir()) == ["matrix", "zarr.json"]
    assert np.array_equal(open_store(tmp_path / "small.zarr").read("matrix", "coo_col"), before)


def test_frustum_grid_too_big_for_this_machine_is_one_line_exit_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--compact-rows does not shrink the per-cell arrays of a frustum build: a BEV grid this
    machine cannot hold is refused before any work, like `bevcompile grid` (exit 2, one line)."""

    monkeypatch.setattr(memory, "memory_limit", lambda: memory.MemoryLimit(2**20, "available memory"))
    config = write_yaml(tmp_path / "rig.yaml", small_rig_data())
    result = runner.invoke(app, ["matrix", str(config), "--out", str(tmp_path / "out"), "--topk", "4", "--compact-rows"])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {config}: bevcompile matrix --mode frustum of "), lines
    assert "more than the 1 MiB available memory allows; use coarser bev steps" in lines[0]
    assert not (tmp_path / "out").exists()


def test_convention_option_values_in_any_case_write_the_same_bytes(tmp_path: Path) -> None:
    """`--mode GRID --splat Nearest ...` builds what the lower-case spelling builds, byte for byte;
    the store records the lower-case names."""
    from ..rigs import tree_digest

    config = write_yaml(tmp_path / "rig.yaml", small_rig_data())
    spellings = {
        "lower": ["--mode", "frustum", "--splat", "nearest", "--normalize", "mean", "--rounding", "trunc", "--quantize", "int8"],
        "mixed": ["--mode", "Frustum", "--splat", "NEAREST", "--normalize", "Mean", "--rounding", "TRUNC", "--quantize", "INT8"],
    }
    for sub, args in spellings.items():
        result = runner.invoke(app, ["matrix", str(config), "--out", str(tmp_path / sub), "-q", *args])
        assert result.exit_code == 0, result.output
    digest = tree_digest(tmp_path / "lower" / "small.zarr")
    assert digest == tree_digest(tmp_path / "mixed" / "small.zarr") and len(digest) > 10
    attrs = open_store(tmp_path / "mixed" / "small.zarr").group_attrs("matrix")["build_options"]
    assert (attrs["mode"], attrs["splat"], attrs["normalize"], attrs["rounding"], attrs["quantize"]) == ("frustum", "nearest", "mean", "trunc", "int8")
    none = runner.invoke(app, ["matrix", str(config), "--out", str(tmp_path / "none"), "-q", "--quantize", "NONE"])
    assert none.exit_code == 0, none.output
    unknown = runner.invoke(app, ["matrix", str(config), "--out", str(tmp_path / "bad"), "--splat", "Cubic"])
    assert unknown.exit_code == 2
    assert "error: --splat must be one of nearest, bilinear, got 'Cubic'" in unknown.stderr


def test_jobs_write_the_same_store_for_every_count(tmp_path: Path) -> None:
    """`--jobs N` only changes the wall time: the store is the same bytes for 1, 2 and 3 threads;
    the summary and --json say how many threads ran."""
    from ..rigs import tree_digest

    config = write_yaml(tmp_path / "rig.yaml", small_rig_data(distortion=True, heights=(0.0, 1.0)))
    for jobs in ("1", "2", "3"):
        result = runner.invoke(app, ["matrix", str(config), "--out", str(tmp_path / jobs), "--topk", "4", "--tile-rows", "32", "--jobs", jobs])
        assert result.exit_code == 0, result.output
        assert f"threads (--jobs) {jobs} " in _flat(result.stdout)
    digest = tree_digest(tmp_path / "1" / "small.zarr")
    assert len(digest) > 10 and tree_digest(tmp_path / "2" / "small.zarr") == digest == tree_digest(tmp_path / "3" / "small.zarr")
    summary = json.loads(runner.invoke(app, ["matrix", str(config), "--out", str(tmp_path / "j"), "-j", "2", "--json"]).stdout)
    assert summary["jobs"] == 2 and summary["selection"]["candidates"] == summary["points"]["candidates_sorted"] > 0


def test_matrix_mode_ray_with_a_prior_file_then_inspect_strict(tmp_path: Path) -> None:
    """`matrix --mode ray --depth-prior FILE.npy`: columns (cam, v, u), the prior stored and named by
    sha256, the summary names it; inspect --strict rebuilds the store from config + build_options + the prior."""
    rig = small_rig()
    cfg = write_yaml(tmp_path / "small.yaml", small_rig_data())
    prior = tmp_path / "prior.npy"
    np.save(prior, np.linspace(2.0, 0.5, rig.depth.n_bins).astype(np.float32))
    result = runner.invoke(app, ["matrix", str(cfg), "--out", str(tmp_path), "--mode", "ray", "--topk", "6", "--depth-prior", str(prior)])
    assert result.exit_code == 0, result.output
    out = _flat(result.stdout)
    w_f, h_f = rig.feature_size
    assert "matrix mode ray" in out and f"depth prior prior.npy ({rig.depth.n_bins},)" in out
    assert f"cols (logical / padded) {rig.n_cam * w_f * h_f:,}" in out
    group = open_store(tmp_path / "small.zarr").group_attrs("matrix")
    assert group["build_options"]["depth_prior"].startswith("sha256:") and group["depth_prior"]["source"] == "prior.npy"
    strict = runner.invoke(app, ["inspect", "--strict", str(tmp_path / "small.zarr")])
    assert strict.exit_code == 0, strict.output


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("negative", "prior.npy: 1 negative value(s) (first at index 3, -1); a prior is >= 0"),
        ("nan", "prior.npy: 1 value(s) not finite (first at index 0)"),
        ("shape", "prior.npy: shape (4, 7); expected one of"),
        ("zeros", "prior.npy: 0 everywhere: no pixel has any depth weight"),
        ("text", "prior.npy: not a .npy file (save the prior with numpy.save)"),
        ("pickle", "prior.npy: a .npy that needs pickle to load or is damaged"),
        ("missing", "prior.npy: no such file"),
    ],
)
def test_bad_depth_prior_is_one_line_exit_2_and_nothing_written(tmp_path: Path, content: str, message: str) -> None:
    rig = small_rig()
    cfg = write_yaml(tmp_path / "small.yaml", small_rig_data())
    prior = tmp_path / "prior.npy"
    good = np.ones(rig.depth.n_bins)
    if content == "negative":
        good[3] = -1.0
        np.save(prior, good)
    elif content == "nan":
        good[0] = np.nan
        np.save(prior, good)
    elif content == "shape":
        np.save(prior, np.ones((4, 7)))
    elif content == "zeros":
        np.save(prior, np.zeros((rig.n_cam, rig.depth.n_bins)))
    elif content == "text":
        prior.write_text("1 2 3")
    elif content == "pickle":
        np.save(prior, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    result = runner.invoke(app, ["matrix", str(cfg), "--out", str(tmp_path / "out"), "--mode", "ray", "--depth-prior", str(prior)])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0].replace(str(tmp_path) + "/", ""), result.stderr
    assert not (tmp_path / "out").exists()


def test_depth_prior_needs_mode_ray(tmp_path: Path) -> None:
    cfg = write_yaml(tmp_path / "small.yaml", small_rig_data())
    result = runner.invoke(app, ["matrix", str(cfg), "--out", str(tmp_path), "--depth-prior", "p.npy"])
    assert result.exit_code == 2 and "error: --depth-prior applies to --mode ray only (--mode frustum)" in result.stderr
