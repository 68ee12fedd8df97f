"""``bevcompile export-onnx`` and ``bevcompile export-interop`` on the command line."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from typer.testing import CliRunner

from bevcompile.cli import app
from bevcompile.matrix.build import MatrixOptions
from bevcompile.rig.config import RigConfig
from bevcompile.store.loader import load

from ..deploy.test_torch import add_matrix_group, build_grid_store

runner = CliRunner()


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory, small_distorted_multi: RigConfig) -> Path:
    return build_grid_store(small_distorted_multi, tmp_path_factory.mktemp("cli"), npu=True)


def test_export_onnx_prints_histogram_and_writes_the_file(store: Path, tmp_path: Path) -> None:
    out = tmp_path / "gather.onnx"
    result = runner.invoke(app, ["export-onnx", str(store), "--product", "gather", "--out", str(out), "--channels", "4"])
    assert result.exit_code == 0, result.output
    assert "Gather" in result.stdout and "ReduceSum" in result.stdout
    assert "forbidden ops" in result.stdout and "pass" in result.stdout
    assert f"wrote {out}" in " ".join(result.stdout.split())
    assert {n.op_type for n in onnx.load(str(out)).graph.node} >= {"Gather", "Mul", "ReduceSum"}


def test_export_onnx_json(store: Path, tmp_path: Path) -> None:
    out = tmp_path / "g.onnx"
    result = runner.invoke(app, ["export-onnx", str(store), "--out", str(out), "--channels", "2", "--batch", "2", "--reduce", "mean", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["passed"] is True and data["failures"] == []
    assert data["graph"]["forbidden"] == [] and data["graph"]["dynamic"] == []
    assert data["inputs"] == {"features": [2, 4, 2, 8, 12]}
    assert data["output"] == [2, 2, 3, 40, 40]
    assert data["max_abs_vs_reference"] <= 1e-5
    assert data["graph"]["op_histogram"]["Gather"] == 1


def test_export_onnx_option_values_in_any_case(store: Path, tmp_path: Path) -> None:
    """`--product GATHER --weights LUT --exporter Legacy --reduce Mean` is the lower-case spelling; an
    unknown value is quoted as typed."""
    out = tmp_path / "g.onnx"
    args = ["--product", "GATHER", "--weights", "LUT", "--exporter", "Legacy", "--reduce", "Mean", "--channels", "2", "--json"]
    result = runner.invoke(app, ["export-onnx", str(store), "--out", str(out), *args])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert (data["product"], data["weights"], data["exporter"], data["passed"]) == ("gather", "lut", "legacy", True)
    unknown = runner.invoke(app, ["export-onnx", str(store), "--out", str(tmp_path / "m.onnx"), "--product", "Dense"])
    assert unknown.exit_code == 2
    assert "error: --product must be one of gather, ell, tiles, got 'Dense'" in unknown.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--product", "dense"], "error: --product must be one of gather, ell, tiles, got 'dense'"),
        (["--product", "ell"], "no group matrix/ in this store"),
        (["--channels", "0"], "error: --channels must be in [1, 4096], got 0"),
        (["--exporter", "tvm"], "error: --exporter must be one of legacy, dynamo"),
        (["--product", "ell", "--weights", "lut"],
         "error: --weights lut applies to --product gather only, got --product ell (use --weights float32, int8, int8-qdq, fp16 or mixed)"),
        (["--product", "tiles", "--weights", "lut"],
         "error: --weights lut applies to --product gather only, got --product tiles (use --weights float32, int8, int8-qdq, fp16 or mixed)"),
        (["--weights", "int8"],
         "error: --weights int8 applies to --product ell or tiles only, got --product gather (use --weights float32 or lut)"),
        (["--weights", "int8-qdq", "--product", "gather"],
         "error: --weights int8-qdq applies to --product ell or tiles only, got --product gather (use --weights float32 or lut)"),
        (["--product", "tiles", "--weights", "int8-qdq", "--opset", "12"],
         "error: --weights int8-qdq needs --opset 13 or higher (DequantizeLinear with a per-row scale), got --opset 12"),
        (["--weights", "int4"], "error: --weights must be one of float32, float16, fp16, mixed, lut, int8, int8-qdq, got 'int4'"),
        (["--product", "ell", "--reduce", "mean"], "error: --reduce applies to --product gather only, got --product ell"),
        (["--product", "dense", "--reduce", "mean"], "error: --product must be one of gather, ell, tiles, got 'dense'"),
        (["--opset", "8"], "error: --opset must be in [9, 23], got 8"),
    ],
)
def test_export_onnx_usage_errors(store: Path, tmp_path: Path, args: list[str], message: str) -> None:
    result = runner.invoke(app, ["export-onnx", str(store), "--out", str(tmp_path / "m.onnx"), *args])
    assert result.exit_code == 2
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "m.onnx").exists()


@pytest.fixture(scope="module")
def int8_store(tmp_path_factory: pytest.TempPathFactory, small: RigConfig) -> Path:
    store = build_grid_store(small, tmp_path_factory.mktemp("cli_int8"))
    add_matrix_group(store, small, MatrixOptions(mode="frustum", topk=6, align=8, tile_rows=64, quantize="int8"))
    return store


def test_export_onnx_weights_lut_json(store: Path, tmp_path: Path) -> None:
    out = tmp_path / "lut.onnx"
    result = runner.invoke(app, ["export-onnx", str(store), "--out", str(out), "--channels", "2", "--weights", "lut", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["passed"] is True and data["weights"] == "lut"
    assert data["max_abs_vs_reference"] <= 1e-5
    assert data["float_reference"]["reference"] == "numpy grid_sample on grid/norm"
    assert 0 < data["float_reference"]["max_abs"] < 0.05 and data["float_reference"]["psnr_db"] >= 40
    assert data["float32_export"]["file_bytes"] > data["file_bytes"] == out.stat().st_size
    assert 0 < data["constant_bytes_vs_float32"] < 1 and 0 < data["file_bytes_vs_float32"] < 1
    assert data["graph"]["op_histogram"]["Cast"] == 1


@pytest.fixture
def wide_tables(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tables 200 columns wide, so that a cell's text is not folded (a plain `pytest` run in a
    narrow terminal would otherwise split the phrases these tests look for)."""
    from bevcompile.cli import _output

    monkeypatch.setattr(_output.stdout_console, "width", 200)


@pytest.mark.usefixtures("wide_tables")
def test_export_onnx_weights_int8_summary(int8_store: Path, tmp_path: Path) -> None:
    out = tmp_path / "ell.onnx"
    result = runner.invoke(app, ["export-onnx", str(int8_store), "--product", "ell", "--weights", "int8", "--out", str(out), "--channels", "3"])
    assert result.exit_code == 0, result.output
    assert "int8 vs float reference" in result.stdout and "report" in result.stdout and "PSNR" in result.stdout
    assert "(same dequantised weights)" in result.stdout
    text = " ".join(result.stdout.split())
    assert "weights int8" in text
    assert "vs the float32 export: constants (initializers + Constant nodes)" in text
    assert f"wrote {out}" in text
    assert "Cast" in {n.op_type for n in onnx.load(str(out)).graph.node}


@pytest.mark.usefixtures("wide_tables")
def test_export_onnx_weights_int8_qdq(int8_store: Path, tmp_path: Path) -> None:
    """tiles: one DequantizeLinear per tile (int8 block, per-row scale), reported ok; the default
    onnxruntime session is reported next to the check; ell --json carries the qdq summary."""
    out = tmp_path / "tiles.onnx"
    result = runner.invoke(app, ["export-onnx", str(int8_store), "--product", "tiles", "--weights", "int8-qdq", "--out", str(out), "--channels", "3"])
    assert result.exit_code == 0, result.output
    text = " ".join(result.stdout.split())
    n_tiles = len(load(int8_store)["matrix"]["tile_col_offsets"]) - 1
    assert re.search(rf"DequantizeLinear\W+{n_tiles}\W+ok", text)
    assert "weights int8-qdq" in text and "(same dequantised weights)" in text and "int8-qdq vs float reference" in text
    assert "onnxruntime, default session" in text
    assert f"QDQ: {n_tiles} DequantizeLinear (int8 weights, per-row float32 scales, zero point 0; axis 1: {n_tiles})" in text
    assert f"wrote {out}" in text
    assert sum(n.op_type == "DequantizeLinear" for n in onnx.load(str(out)).graph.node) == n_tiles
    out = tmp_path / "ell.onnx"
    result = runner.invoke(app, ["export-onnx", str(int8_store), "--product", "ell", "--weights", "int8-qdq", "--out", str(out), "--channels", "2", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["passed"] is True and data["weights"] == "int8-qdq" and data["max_abs_vs_reference"] <= 1e-5
    assert data["graph"]["op_histogram"]["DequantizeLinear"] == 1 and "Cast" not in data["graph"]["op_histogram"]
    assert data["qdq"]["n_dequantize_linear"] == 1 and data["qdq"]["axes"] == {"0": 1} and data["qdq"]["missing"] == []
    assert data["qdq"]["nodes"][0]["weight"] == "ell_weight" and data["qdq"]["nodes"][0]["quantized"] == "ell_weight_quantized"
    assert data["onnxruntime_default"]["max_abs_vs_reference"] <= 1e-5  # ELL: DequantizeLinear feeds a Mul, nothing to fuse
    assert 0 < data["constant_bytes_vs_float32"] < 1 and data["float32_export"]["file_bytes"] > data["file_bytes"]


def test_export_onnx_quantised_weights_need_the_quantised_store(store: Path, tmp_path: Path, small: RigConfig) -> None:
    """int8 on a matrix built without --quantize int8, lut on a store without gather/: exit 2, one line."""
    plain = build_grid_store(small, tmp_path / "plain")
    add_matrix_group(plain, small, MatrixOptions(mode="grid", topk=4, align=4))
    out = tmp_path / "m.onnx"
    result = runner.invoke(app, ["export-onnx", str(plain), "--product", "ell", "--weights", "int8", "--out", str(out)])
    assert result.exit_code == 2
    assert "weights='int8' needs matrix/ell_weight_int8 + row_scale; rebuild the matrix with `bevcompile matrix --quantize int8`" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    result = runner.invoke(app, ["export-onnx", str(plain), "--product", "gather", "--weights", "lut", "--out", str(out)])
    assert result.exit_code == 2
    assert "weights='lut' needs the gather/ group (weight_u8 + lut)" in result.stderr and "`bevcompile grid`" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not out.exists()


def test_export_onnx_missing_store(tmp_path: Path) -> None:
    result = runner.invoke(app, ["export-onnx", str(tmp_path / "nope.zarr"), "--out", str(tmp_path / "m.onnx")])
    assert result.exit_code == 2
    assert "no such store" in result.stderr


def test_export_onnx_failed_check_exits_1(store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from bevcompile.deploy import onnx_export

    monkeypatch.setattr(onnx_export, "export_tolerance", lambda store, options: 1e-30)
    result = runner.invoke(app, ["export-onnx", str(store), "--out", str(tmp_path / "m.onnx"), "--channels", "3"])
    assert result.exit_code == 1
    assert "onnxruntime output differs from the numpy reference by" in result.stderr
    assert "FAIL" in result.stdout  # the table is still printed
    assert not (tmp_path / "m.onnx").exists() and (tmp_path / "m.rejected.onnx").exists()
    # --json prints the report of a failed export too, also with --quiet (as every command's --json does)
    result = runner.invoke(app, ["export-onnx", str(store), "--out", str(tmp_path / "q.onnx"), "--channels", "3", "--json", "--quiet"])
    assert result.exit_code == 1
    report = json.loads(result.stdout)
    assert report["passed"] is False and report["failures"]


def test_export_interop_both_targets_with_npy(store: Path, tmp_path: Path, small_distorted_multi: RigConfig) -> None:
    npy = tmp_path / "npy"
    result = runner.invoke(
        app,
        ["export-interop", str(store), "--to", "bevpoolv2", "--to", "fastbev-lut", "--npy", str(npy),
         "--rounding", "floor", "--frustum-mapping", "rig", "--z-bins", "2", "--overlap", "nearest-centre"],
    )
    assert result.exit_code == 0, result.output
    out = " ".join(result.stdout.split())
    assert "frustum points" in out and "4 x 8 x 8 x 12 = 3,072" in out
    assert "kept points" in out and "intervals (occupied voxels)" in out
    assert "Fast-BEV LUT (overlap nearest-centre)" in out
    for name in ("ranks_bev", "ranks_depth", "ranks_feat", "interval_starts", "interval_lengths", "fastbev_lut"):
        arr = np.load(npy / f"{name}.npy")
        assert arr.dtype == np.int32
        assert np.array_equal(arr, load(store)["interop"][("bevpoolv2_" + name) if name != "fastbev_lut" else name])
    attrs = load(store)["interop"].attrs
    assert attrs["build_options"]["bevpoolv2"] == {"frustum_mapping": "rig", "rounding": "floor", "z_bins": 2, "batch": 1}
    assert attrs["bevpoolv2"]["grid_size"] == (40, 40, 2)


def test_export_interop_json(store: Path) -> None:
    result = runner.invoke(app, ["export-interop", str(store), "--to", "bevpoolv2", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["targets"] == ["bevpoolv2"]
    assert data["build_options"]["bevpoolv2"] == {"frustum_mapping": "linspace", "rounding": "trunc", "z_bins": None, "batch": 1}
    assert data["bevpoolv2"]["n_points"] == 4 * 8 * 8 * 12
    assert 0 < data["bevpoolv2"]["n_kept"] < data["bevpoolv2"]["n_points"]


def test_export_onnx_checks_its_options_before_importing_torch() -> None:
    """A bad option is the usage error even where PyTorch is missing (and costs no torch import):
    the option names the CLI canonicalises come from torch-free modules."""
    code = (
        "import sys; sys.modules['torch'] = None; from bevcompile._entry import main; "
        "main(['export-onnx', 'x.zarr', '--product', 'Dense', '--reduce', 'Mean'])"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert result.returncode == 2, result.stderr
    assert result.stderr == "error: --product must be one of gather, ell, tiles, got 'Dense'\n"


def test_export_interop_option_values_in_any_case(store: Path, tmp_path: Path) -> None:
    """`--to BEVPoolV2 --frustum-mapping Rig --rounding FLOOR` records the lower-case names, as
    the lower-case spelling does."""
    store = Path(shutil.copytree(store, tmp_path / store.name))  # the module's store keeps its interop/ group
    args = ["--to", "BEVPoolV2", "--frustum-mapping", "Rig", "--rounding", "FLOOR", "--to", "FastBEV-LUT", "--overlap", "Nearest-Centre", "--json"]
    result = runner.invoke(app, ["export-interop", str(store), *args])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["targets"] == ["bevpoolv2", "fastbev-lut"]
    assert data["build_options"]["bevpoolv2"] == {"frustum_mapping": "rig", "rounding": "floor", "z_bins": None, "batch": 1}
    assert data["build_options"]["fastbev-lut"] == {"overlap": "nearest-centre"}
    unknown = runner.invoke(app, ["export-interop", str(store), "--to", "LSS"])
    assert unknown.exit_code == 2
    assert "error: --to must be one of bevpoolv2, fastbev-lut, petr-coords3d, got 'LSS'" in unknown.stderr


def test_export_interop_batch(store: Path, tmp_path: Path) -> None:
    one = json.loads(runner.invoke(app, ["export-interop", str(store), "--to", "bevpoolv2", "--json"]).stdout)["bevpoolv2"]
    result = runner.invoke(app, ["export-interop", str(store), "--to", "bevpoolv2", "--batch", "3", "--npy", str(tmp_path / "npy")])
    assert result.exit_code == 0, result.output
    out = " ".join(result.stdout.split())
    assert "batch 3" in out and f"3 x 4 x 8 x 8 x 12 = {3 * 3072:,}" in out
    attrs = load(store)["interop"].attrs["bevpoolv2"]
    assert attrs["batch"] == 3 and attrs["n_kept"] == 3 * one["n_kept"] and attrs["n_intervals"] == 3 * one["n_intervals"]
    ranks_bev = np.load(tmp_path / "npy" / "ranks_bev.npy")
    assert ranks_bev.size == 3 * one["n_kept"] and ranks_bev.max() >= 2 * 40 * 40  # batch 2 lies in the third voxel block
    assert runner.invoke(app, ["inspect", str(store), "--quiet"]).exit_code == 0


def test_export_interop_jobs_write_the_same_arrays(store: Path, tmp_path: Path) -> None:
    """`--jobs N` changes only the wall time: the .npy files are the same bytes for 1 and 3 threads."""
    for jobs in ("1", "3"):
        copy = Path(shutil.copytree(store, tmp_path / jobs / store.name))
        args = ["export-interop", str(copy), "--to", "bevpoolv2", "--batch", "2", "--npy", str(tmp_path / jobs / "npy"), "--jobs", jobs, "-q"]
        result = runner.invoke(app, args)
        assert result.exit_code == 0, result.output
    for name in ("ranks_bev", "ranks_depth", "ranks_feat", "interval_starts", "interval_lengths"):
        one, three = (np.load(tmp_path / jobs / "npy" / f"{name}.npy") for jobs in ("1", "3"))
        assert one.dtype == three.dtype == np.int32 and one.size > 0 and one.tobytes() == three.tobytes(), name


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--to", "lss"], "error: --to must be one of bevpoolv2, fastbev-lut, petr-coords3d, got 'lss'"),
        (["--to", "fastbev-lut", "--overlap", "random"], "error: --overlap must be one of first, last, nearest-centre"),
        (["--to", "bevpoolv2", "--rounding", "round"], "error: --rounding must be one of trunc, floor"),
        (["--to", "bevpoolv2", "--z-bins", "0"], "error: --z-bins must be in [1, 4096], got 0"),
        (["--to", "bevpoolv2", "--batch", "0"], "error: --batch must be an integer in [1, 256], got 0"),
        (["--to", "bevpoolv2", "--jobs", "0"], "error: --jobs must be an integer in [1, 1024], got 0"),
        (["--to", "bevpoolv2", "--overlap", "last"], "error: --overlap applies to --to fastbev-lut only, which is not requested (--to bevpoolv2)"),
        (["--to", "fastbev-lut", "--rounding", "floor"], "error: --rounding applies to --to bevpoolv2 only, which is not requested (--to fastbev-lut)"),
        (["--to", "lss", "--overlap", "last"], "error: --to must be one of bevpoolv2, fastbev-lut, petr-coords3d, got 'lss'"),
        (["--to", "bevpoolv2", "--precision", "half"], "error: --precision must be one of float64, float32, got 'half'"),
        (["--to", "bevpoolv2", "--xyz-layout"], "error: --xyz-layout applies to --to fastbev-lut only, which is not requested (--to bevpoolv2)"),
        (["--to", "fastbev-lut", "--precision", "float32"], "error: --precision float32 restates Fast-BEV's pinhole projection; camera FRONT has a opencv lens"),
        (["--to", "petr-coords3d", "--overlap", "last"], "error: --overlap applies to --to fastbev-lut only, which is not requested (--to petr-coords3d)"),
        (["--to", "petr-coords3d", "--precision", "float32"], "error: --precision float32 restates PETR's pinhole position embedding; camera FRONT has a opencv lens"),
    ],
)
def test_export_interop_usage_errors(store: Path, args: list[str], message: str) -> None:
    result = runner.invoke(app, ["export-interop", str(store), *args])
    assert result.exit_code == 2
    assert message in result.stderr


def test_export_interop_precision_float32_and_xyz_layout(tmp_path: Path, small: RigConfig) -> None:
    """``--precision float32`` (pinhole rig) and ``--xyz-layout``: recorded in build_options, named
    in the tables, the LUT also written as fastbev_lut_xyz (.npy too); inspect passes."""
    store = build_grid_store(small, tmp_path / "s", npu=True)
    result = runner.invoke(app, [
        "export-interop", str(store), "--to", "bevpoolv2", "--to", "fastbev-lut", "--precision", "FLOAT32", "--xyz-layout",
        "--overlap", "last", "--npy", str(tmp_path / "npy"),
    ])
    assert result.exit_code == 0, result.output
    out = " ".join(result.stdout.split())
    assert "batch 1, float32)" in out and "Fast-BEV LUT (overlap last, float32)" in out and "interop/fastbev_lut_xyz" in out
    options = load(store)["interop"].attrs["build_options"]
    assert options["bevpoolv2"]["precision"] == "float32"
    assert dict(options["fastbev-lut"]) == {"overlap": "last", "precision": "float32", "points": "get_points", "xyz_layout": True}
    xyz = np.load(tmp_path / "npy" / "fastbev_lut_xyz.npy")
    assert np.array_equal(xyz, np.transpose(np.load(tmp_path / "npy" / "fastbev_lut.npy"), (2, 1, 0)))
    assert runner.invoke(app, ["inspect", str(store), "--strict", "--quiet"]).exit_code == 0


def test_export_interop_requires_to_when_the_config_names_no_target(store: Path) -> None:
    result = runner.invoke(app, ["export-interop", str(store)])
    assert result.exit_code == 2
    assert "error: give --to bevpoolv2, --to fastbev-lut and/or --to petr-coords3d (the store's config names no interop targets)" in result.stderr


def test_export_interop_defaults_to_the_config_interop_section(tmp_path: Path, small: RigConfig) -> None:
    """No --to: the targets and options of the config's ``interop:`` section (a preset's); an
    explicit flag overrides one option and keeps the others."""
    rig = dataclasses.replace(small, interop=(("fastbev-lut", (("overlap", "last"), ("precision", "float32"), ("xyz_layout", True))),))
    store = build_grid_store(rig, tmp_path / "s", npu=True)
    result = runner.invoke(app, ["export-interop", str(store), "--quiet"])
    assert result.exit_code == 0, result.output
    interop = load(store)["interop"]
    assert dict(interop.attrs["build_options"]["fastbev-lut"]) == {"overlap": "last", "precision": "float32", "points": "get_points", "xyz_layout": True}
    assert "bevpoolv2_ranks_bev" not in interop and "fastbev_lut_xyz" in interop
    result = runner.invoke(app, ["export-interop", str(store), "--overlap", "first", "--quiet"])
    assert result.exit_code == 0, result.output
    assert dict(load(store)["interop"].attrs["build_options"]["fastbev-lut"]) == {"overlap": "first", "precision": "float32", "points": "get_points", "xyz_layout": True}
    result = runner.invoke(app, ["export-interop", str(store), "--to", "bevpoolv2", "--quiet"])
    assert result.exit_code == 0, result.output
    assert dict(load(store)["interop"].attrs["build_options"]["bevpoolv2"]) == {"frustum_mapping": "linspace", "rounding": "trunc", "z_bins": None, "batch": 1}


def test_help_shows_the_defaults_of_options_that_apply_to_one_target() -> None:
    text = " ".join(runner.invoke(app, ["export-interop", "--help"], env={"COLUMNS": "200"}).stdout.split())
    for phrase in ("(default: linspace)", "(default: trunc)", "(default: 1)", "(default: first)"):
        assert phrase in text, phrase
    assert "(default: sum)" in " ".join(runner.invoke(app, ["export-onnx", "--help"], env={"COLUMNS": "200"}).stdout.split())


def test_export_onnx_out_of_memory_is_one_line_exit_2(store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Above the physical memory: refused before any work (exit 2). An allocator failure that still
    happens — torch raises RuntimeError, not MemoryError — is the one-line out-of-memory error."""
    from bevcompile.deploy import onnx_export

    monkeypatch.setattr(onnx_export, "_memory_limit", lambda: (2**20, "available memory"))
    result = runner.invoke(app, ["export-onnx", str(store), "--channels", "8", "--out", str(tmp_path / "a.onnx")])
    assert result.exit_code == 2
    assert re.fullmatch(r"error: .*needs about .*more than the 1 MiB available memory allows; reduce --channels or --batch\n", result.stderr)

    def allocator_failure(*args: object, **kwargs: object) -> None:
        raise RuntimeError(
            "[enforce fail at alloc_cpu.cpp:121] data. DefaultCPUAllocator: can't allocate memory: "
            "you tried to allocate 68719476736 bytes. Error code 12 (Cannot allocate memory)"
        )

    monkeypatch.setattr(onnx_export, "export_onnx", allocator_failure)
    result = runner.invoke(app, ["export-onnx", str(store), "--out", str(tmp_path / "b.onnx")])
    assert result.exit_code == 2
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.output
    assert result.stderr.startswith("error: out of memory (") and "can't allocate memory" in result.stderr
    assert "--channels / --batch" in result.stderr

    def a_bug(*args: object, **kwargs: object) -> None:
        raise RuntimeError("expected m1 and m2 to have the same dtype")

    monkeypatch.setattr(onnx_export, "export_onnx", a_bug)
    result = runner.invoke(app, ["export-onnx", str(store), "--out", str(tmp_path / "c.onnx")])
    assert result.exit_code == 1 and isinstance(result.exception, RuntimeError)  # other RuntimeErrors stay bugs


def test_export_interop_petr_coords3d(tmp_path: Path, small: RigConfig) -> None:
    """``--to petr-coords3d``: the table (depths, masked pixels), the arrays and .npy files, the
    options of the config's ``interop:`` section under an explicit --precision; inspect passes."""
    rig = dataclasses.replace(small, interop=(("petr-coords3d", (("depth_num", 16), ("lid", False))),))
    store = build_grid_store(rig, tmp_path / "s", npu=True)
    result = runner.invoke(app, ["export-interop", str(store), "--to", "petr-coords3d", "--precision", "float32", "--npy", str(tmp_path / "npy")])
    assert result.exit_code == 0, result.output
    out = " ".join(result.stdout.split())
    assert "PETR position coordinates (16 uniform depths, float32, ego frame)" in out and "masked pixels" in out
    w_f, h_f = small.feature_size
    assert np.load(tmp_path / "npy" / "petr_coords3d.npy").shape == (small.n_cam, 48, h_f, w_f)
    assert np.load(tmp_path / "npy" / "petr_coords_mask.npy").dtype == np.bool_
    options = dict(load(store)["interop"].attrs["build_options"]["petr-coords3d"])
    assert (options["depth_num"], options["lid"], options["precision"]) == (16, False, "float32")
    assert runner.invoke(app, ["inspect", str(store), "--quiet"]).exit_code == 0


@pytest.fixture(scope="module")
def region_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from bevcompile.matrix.build import run_matrix
    from bevcompile.rig.config import parse_config

    from ..matrix.test_region import REGION
    from ..rigs import small_rig_data

    data = small_rig_data()
    data["bev"]["region"] = REGION
    return run_matrix(parse_config(data), tmp_path_factory.mktemp("region"), MatrixOptions(mode="grid", topk=8, align=16, tile_rows=32)).store


@pytest.mark.parametrize("product", ["ell", "tiles"])
def test_export_onnx_rows_compact_returns_the_region_rows_without_the_expand_gather(region_store: Path, tmp_path: Path, product: str) -> None:
    """--rows compact: output (N, C, n_kept), one Gather fewer than the default (dense) graph and
    none reading matrix/expand; onnxruntime equals the dense graph's output at each row's cells."""
    import onnxruntime as ort

    from bevcompile.deploy.onnx_export import make_inputs

    loaded = load(region_store)
    expand = np.asarray(loaded["matrix"]["expand"])
    n_kept = int(loaded.array_info("matrix", "cells").shape[0])
    graphs = {}
    for rows in ("dense", "compact"):
        out = tmp_path / f"{rows}.onnx"
        result = runner.invoke(app, ["export-onnx", str(region_store), "--product", product, "--rows", rows, "--channels", "3", "--out", str(out), "--json"])
        assert result.exit_code == 0, result.output
        data = json.loads(result.stdout)
        assert data["rows"] == rows and data["passed"] and data["max_abs_vs_reference"] <= 1e-5
        assert data["output"] == ([1, 3, n_kept] if rows == "compact" else [1, 3, 24, 24])
        graphs[rows] = onnx.load(str(out))
    gathers = {rows: sum(n.op_type == "Gather" for n in g.graph.node) for rows, g in graphs.items()}
    assert gathers["compact"] == gathers["dense"] - 1
    consts = {i.name: onnx.numpy_helper.to_array(i) for i in graphs["compact"].graph.initializer}
    consts |= {n.output[0]: onnx.numpy_helper.to_array(n.attribute[0].t) for n in graphs["compact"].graph.node if n.op_type == "Constant" and n.attribute}
    assert not any(n.op_type == "Gather" and np.array_equal(np.ravel(consts.get(n.input[1], [])), expand) for n in graphs["compact"].graph.node)
    assert {p.key: p.value for p in graphs["compact"].metadata_props}["bevcompile.rows"] == "compact"
    feeds = make_inputs(loaded, 3, 1, seed=5, with_depth=False)
    dense, compact = (ort.InferenceSession(str(tmp_path / f"{r}.onnx"), providers=["CPUExecutionProvider"]).run(["bev"], feeds)[0] for r in ("dense", "compact"))
    padded = np.concatenate([compact, np.zeros((1, 3, 1), np.float32)], axis=2)
    assert np.array_equal(padded[:, :, expand], dense.reshape(1, 3, -1))
    text = runner.invoke(app, ["export-onnx", str(region_store), "--product", product, "--rows", "COMPACT", "--channels", "3", "--out", str(tmp_path / "t.onnx")])
    assert text.exit_code == 0, text.output
    assert "rows compact" in text.stdout and f"bev 1x3x{n_kept}" in text.stdout


@pytest.mark.parametrize(
    ("which", "args", "message"),
    [
        ("int8", ["--product", "ell", "--rows", "compact"],
         "matrix/expand: --rows compact needs a store built with a bev.region (its rows are the kept (super-)cells); "
         "this matrix's rows are the BEV cells: drop --rows compact"),
        ("region", ["--rows", "compact"],
         "error: --rows compact applies to --product ell or tiles (the matrix rows of a bev.region store), got --product gather"),
        ("region", ["--product", "ell", "--rows", "sparse"], "error: --rows must be one of dense, compact, got 'sparse'"),
    ],
)
def test_export_onnx_rows_compact_errors(request: pytest.FixtureRequest, tmp_path: Path, which: str, args: list[str], message: str) -> None:
    path = request.getfixturevalue(f"{which}_store")
    result = runner.invoke(app, ["export-onnx", str(path), "--out", str(tmp_path / "m.onnx"), *args])
    assert result.exit_code == 2, result.output
    assert message in result.stderr and result.stderr.startswith("error: ")
    assert len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "m.onnx").exists()


def test_export_interop_on_a_region_store_keeps_the_dense_grid_and_reports_the_cells_outside(region_store: Path, tmp_path: Path) -> None:
    """``export-interop`` on a ``bev.region`` store (matrix only, no grid/): the Fast-BEV LUT stays
    ``(n_heights, ny, nx)`` with -1 on every voxel of a cell outside the region (the table says how
    many), BEVPoolv2 keeps no point there; the ``.npy`` files and ``interop.json`` carry the
    region; inspect passes."""
    from bevcompile.rig.region import region_table

    store = tmp_path / region_store.name
    shutil.copytree(region_store, store)
    rig = load(store).rig
    table = region_table(rig.bev)
    n_outside = rig.bev.ny * rig.bev.nx - table.n_fine_kept
    npy = tmp_path / "npy"
    result = runner.invoke(app, ["export-interop", str(store), "--to", "bevpoolv2", "--to", "fastbev-lut", "--overlap", "last", "--npy", str(npy)])
    assert result.exit_code == 0, result.output
    out = " ".join(result.stdout.split())
    assert "Fast-BEV LUT (overlap last)" in out
    assert re.search(rf"│\s*outside the bev\.region \(-1\)\s*│\s*{n_outside:,}\s*│", result.stdout), result.stdout
    assert f"wrote {store} interop/" in out
    lut = np.load(npy / "fastbev_lut.npy")
    inside = table.fine_kept().reshape(rig.bev.ny, rig.bev.nx)
    assert lut.shape == (1, rig.bev.ny, rig.bev.nx) and (lut[:, ~inside] == -1).all() and (lut[:, inside] >= 0).any()
    ranks_bev = np.load(npy / "ranks_bev.npy").astype(np.int64)
    assert inside.reshape(-1)[ranks_bev % (rig.bev.ny * rig.bev.nx)].all()
    recorded = json.loads((npy / "interop.json").read_text())
    assert recorded["region"]["n_fine_cells_outside"] == n_outside
    assert recorded["fastbev-lut"]["region"]["n_cells_outside"] == n_outside
    inspected = runner.invoke(app, ["inspect", str(store)])
    assert inspected.exit_code == 0 and "checks passed" in inspected.output, inspected.output
