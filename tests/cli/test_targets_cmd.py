"""``bevcompile targets`` and ``bevcompile export-onnx --target``: exit codes and messages."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from typer.testing import CliRunner

from bevcompile.cli import app
from bevcompile.matrix.build import MatrixOptions
from bevcompile.rig.config import RigConfig

from ..deploy.test_torch import add_matrix_group, build_grid_store

runner = CliRunner()


@pytest.fixture(scope="module")
def ray_store(tmp_path_factory: pytest.TempPathFactory, small_distorted_multi: RigConfig) -> Path:
    store = build_grid_store(small_distorted_multi, tmp_path_factory.mktemp("targets"))
    add_matrix_group(store, small_distorted_multi, MatrixOptions(mode="ray", topk=8, align=8, tile_rows=64, quantize="int8"))
    return store


@pytest.fixture(scope="module")
def frustum_store(tmp_path_factory: pytest.TempPathFactory, small_distorted_multi: RigConfig) -> Path:
    store = build_grid_store(small_distorted_multi, tmp_path_factory.mktemp("targets_f"))
    add_matrix_group(store, small_distorted_multi, MatrixOptions(mode="frustum", topk=8, align=8))
    return store


def test_targets_lists_every_profile_and_shows_one_with_sources() -> None:
    listed = runner.invoke(app, ["targets"])
    assert listed.exit_code == 0, listed.output
    for name in ("generic", "rk3588", "rk3568", "rv1106", "openvino", "litert", "onnxruntime"):
        assert name in listed.stdout
    one = runner.invoke(app, ["targets", "rk3588"])
    assert one.exit_code == 0, one.output
    flat = " ".join(one.stdout.split())
    assert "gather.max_indices" in flat and "8,191" in flat and "REGTASK" in flat
    data = json.loads(runner.invoke(app, ["targets", "openvino", "--json"]).stdout)
    assert any("INFERENCE_PRECISION_HINT" in note["what"] for note in data["runtime"])
    assert all(limit["source"] for limit in json.loads(runner.invoke(app, ["targets", "rk3588", "--json"]).stdout)["limits"])


def test_targets_unknown_name_is_one_line_exit_2() -> None:
    result = runner.invoke(app, ["targets", "rk9999"])
    assert result.exit_code == 2
    assert result.stderr.strip().count("\n") == 0 and "rk3588" in result.stderr


def test_export_for_rk3588_writes_the_windows_graph_and_its_cost(ray_store: Path, tmp_path: Path) -> None:
    out = tmp_path / "lift.onnx"
    result = runner.invoke(app, ["export-onnx", str(ray_store), "--product", "ell", "--target", "rk3588", "--channels", "8", "--out", str(out), "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["target"] == "rk3588" and data["form"] == "windows" and data["weights"] == "float16"  # fp16 where the target computes fp16
    assert data["cost"]["gathers"] == 0 and data["cost"]["nodes"] == data["graph"]["n_nodes"]
    assert data["inputs"] == {"features": [4, 8, 8, 12]}  # rank 4: (N * n_cam, C, H_f, W_f)
    model = onnx.load(str(out))
    meta = {p.key: p.value for p in model.metadata_props}
    assert meta["bevcompile.target"] == "rk3588" and meta["bevcompile.form"] == "windows"
    assert "Gather" not in {n.op_type for n in model.graph.node}
    text = runner.invoke(app, ["export-onnx", str(ray_store), "--product", "ell", "--target", "rk3588", "--channels", "8", "--out", str(out)])
    assert text.exit_code == 0
    assert "cost per inference:" in text.stdout and "M MACs" in text.stdout


def test_export_int8_for_a_toolchain_that_quantises_writes_the_calibration_set(ray_store: Path, tmp_path: Path) -> None:
    out = tmp_path / "lift.onnx"
    result = runner.invoke(app, ["export-onnx", str(ray_store), "--product", "ell", "--target", "rk3588", "--weights", "int8",
                                 "--calibration-samples", "3", "--channels", "8", "--out", str(out), "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["int8_route"] == "toolchain-calibration"
    calib = Path(data["calibration_dir"])
    assert calib == tmp_path / "lift.onnx.calib"
    lines = (calib / "dataset.txt").read_text().splitlines()
    assert lines == ["features_000.npy", "features_001.npy", "features_002.npy"]
    assert np.load(calib / "features_000.npy").shape == (4, 8, 8, 12)
    assert np.load(calib / "features.npy").shape == (3, 4, 8, 8, 12)
    # the user's own samples: (S, n_cam, C, H_f, W_f)
    samples = tmp_path / "mine.npy"
    np.save(samples, np.random.default_rng(0).random((2, 4, 8, 8, 12), dtype=np.float32))
    again = runner.invoke(app, ["export-onnx", str(ray_store), "--product", "ell", "--target", "rk3588", "--weights", "int8",
                                "--calibration", str(samples), "--channels", "8", "--out", str(out), "--quiet"])
    assert again.exit_code == 0, again.output
    assert (calib / "dataset.txt").read_text().splitlines() == ["features_000.npy", "features_001.npy"]


def test_export_refused_by_a_target_is_one_line_exit_2_and_writes_nothing(frustum_store: Path, tmp_path: Path) -> None:
    out = tmp_path / "lift.onnx"
    result = runner.invoke(app, ["export-onnx", str(frustum_store), "--product", "ell", "--target", "rk3588", "--channels", "8", "--out", str(out)])
    assert result.exit_code == 2
    message = result.stderr.strip()
    assert "\n" not in message and message.startswith("error: --target rk3588 cannot take --product ell")
    assert "--mode ray" in message and "compiled.max_ratio" in message and "depth input" in message
    assert not out.exists() and not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--target", "rk3588", "--weights", "lut"], "--weights lut with --target rk3588"),
        (["--target", "rv1106", "--weights", "float32"], "computes in int8 only"),
        (["--target", "rk3588", "--batch", "2"], "batch.max 1"),
        (["--target", "nope"], "--target must be one of"),
        (["--weights", "float16"], "give a --target"),
        (["--target", "onnxruntime", "--form", "spiral"], "--form must be one of"),
        (["--target", "rk3588", "--weights", "int8", "--calibration", "/no/such.npy"], "--calibration /no/such.npy: not a readable .npy file"),
    ],
)
def test_export_target_usage_errors(ray_store: Path, tmp_path: Path, args: list[str], message: str) -> None:
    result = runner.invoke(app, ["export-onnx", str(ray_store), "--product", "ell", "--channels", "8", "--out", str(tmp_path / "x.onnx"), *args])
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.stderr.split())
    assert not (tmp_path / "x.onnx").exists()


def test_a_calibration_file_of_the_wrong_shape_is_refused(ray_store: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.npy"
    np.save(bad, np.zeros((2, 3, 8, 8, 12), np.float32))
    result = runner.invoke(app, ["export-onnx", str(ray_store), "--product", "ell", "--target", "rk3588", "--weights", "int8", "--calibration", str(bad),
                                 "--channels", "8", "--out", str(tmp_path / "x.onnx")])
    assert result.exit_code == 2
    assert "expected float (S, 4, 8, 8, 12)" in " ".join(result.stderr.split())


def test_verify_map_adds_the_graph_of_each_named_target(ray_store: Path) -> None:
    """verify --map --target rk3588 --target openvino: the rk3588 (float16 weights) and OpenVINO (float32
    and fully quantised) graphs of the ELL join the map's forms; float32 stays far above float16, which
    stays above the fully quantised graph; --target without --map is a usage error."""
    result = runner.invoke(app, ["verify", str(ray_store), "--map", "--target", "rk3588", "--target", "openvino", "--channels", "4", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    forms = {f["form"]: f for f in data["forms"]}
    assert {"target:rk3588", "target:openvino", "target:openvino/int8"} <= set(forms)

    def snr(name: str) -> float:
        return float(forms[name]["all"]["snr_db"])

    assert snr("target:openvino") > 120 > snr("target:rk3588") > 60 > snr("target:openvino/int8") > 30
    bad = runner.invoke(app, ["verify", str(ray_store), "--target", "rk3588"])
    assert bad.exit_code == 2 and "--map" in bad.stderr
    plain = runner.invoke(app, ["verify", str(ray_store), "--map", "--channels", "4", "--json"])
    assert plain.exit_code == 0 and not any(f["form"].startswith("target:") for f in json.loads(plain.stdout)["forms"])


def test_a_fifo_named_as_profile_or_calibration_is_refused_at_once(ray_store: Path, tmp_path: Path) -> None:
    """--target FILE.toml and --calibration FILE.npy go through the one reader of user-named files: a
    FIFO is refused in one line (never read, never waited on)."""
    import os

    fifo = tmp_path / "profile.toml"
    os.mkfifo(fifo)
    result = runner.invoke(app, ["targets", str(fifo)])
    assert result.exit_code == 2 and "is a FIFO, not a regular file" in result.stderr
    npy = tmp_path / "features.npy"
    os.mkfifo(npy)
    result = runner.invoke(app, ["export-onnx", str(ray_store), "--product", "ell", "--target", "rk3588", "--weights", "int8",
                                 "--calibration", str(npy), "--channels", "8", "--out", str(tmp_path / "x.onnx")])
    assert result.exit_code == 2 and "is a FIFO, not a regular file" in result.stderr


def test_matrix_records_its_target_and_export_builds_for_it(tmp_path: Path) -> None:
    """matrix --target rk3588 records the profile's name in build_options (the entries are those of the
    build without it) and export-onnx --product ell/tiles builds for it when given no --target (the gather
    product, and --target generic, keep today's graphs); an unknown target is one line, exit 2, nothing written."""
    from bevcompile.store.loader import load

    from ..rigs import small_rig_data, write_yaml

    config = write_yaml(tmp_path / "rig.yaml", small_rig_data(heights=(0.0,)))
    base = ["matrix", str(config), "--mode", "ray", "--topk", "8", "--align", "8", "--quiet"]
    assert runner.invoke(app, [*base, "--out", str(tmp_path / "plain")]).exit_code == 0
    made = runner.invoke(app, [*base, "--out", str(tmp_path / "rk"), "--target", "RK3588"])
    assert made.exit_code == 0, made.output
    (plain,), (rk,) = (list((tmp_path / d).glob("*.zarr")) for d in ("plain", "rk"))
    options = dict(load(rk)["matrix"].attrs["build_options"])
    assert options.pop("target") == "rk3588" and options == dict(load(plain)["matrix"].attrs["build_options"])
    for name in ("coo_row", "coo_col", "coo_val", "ell_index", "ell_weight"):
        assert np.asarray(load(rk)["matrix"][name]).tobytes() == np.asarray(load(plain)["matrix"][name]).tobytes(), name
    assert runner.invoke(app, ["inspect", str(rk), "--strict", "--quiet"]).exit_code == 0

    def exported(store: Path, *extra: str) -> dict[str, str]:
        out = tmp_path / f"{store.parent.name}-{len(extra)}.onnx"
        result = runner.invoke(app, ["export-onnx", str(store), "--channels", "8", "--out", str(out), "--quiet", *extra])
        assert result.exit_code == 0, result.output
        return {p.key: p.value for p in onnx.load(str(out)).metadata_props}

    assert exported(rk, "--product", "ell")["bevcompile.target"] == "rk3588"
    assert exported(rk, "--product", "ell", "--target", "generic")["bevcompile.form"] == "torch"
    assert exported(plain, "--product", "ell")["bevcompile.form"] == "torch"
    from bevcompile.cli.export_cmd import recorded_target

    assert recorded_target(rk, "gather") == "generic" and recorded_target(rk, "tiles") == "rk3588"
    bad = runner.invoke(app, [*base, "--out", str(tmp_path / "bad"), "--target", "rk9999"])
    assert bad.exit_code == 2 and bad.stderr.count("\n") == 1 and "--target must be one of" in bad.stderr
    assert not (tmp_path / "bad").exists() or not list((tmp_path / "bad").glob("*.zarr"))


def test_a_generic_export_nobody_asked_for_says_how_to_get_the_fast_forms(ray_store: Path, tmp_path: Path) -> None:
    """export-onnx without --target (and no target recorded) writes today's generic graph and says, in
    one last line, what it costs and which --target builds the fast forms; --target generic (asked for
    by name), --quiet and --json print no such line."""
    from bevcompile.cli.export_cmd import GENERIC_HINT

    def run(*extra: str) -> str:
        result = runner.invoke(app, ["export-onnx", str(ray_store), "--product", "gather", "--channels", "4", "--out", str(tmp_path / "g.onnx"), *extra])
        assert result.exit_code == 0, result.output
        return result.stdout

    assert run().rstrip().splitlines()[-1] == GENERIC_HINT
    assert "--target onnxruntime" in GENERIC_HINT and "GridSample" in GENERIC_HINT
    assert GENERIC_HINT not in run("--target", "generic") and GENERIC_HINT not in run("--json") and not run("--quiet").strip()
