"""``bevcompile absorb``: trained values back into the store, and every bad checkpoint refused.

The round trip is the issue's: train ``LearnableLift`` a few steps -> ``torch.save`` -> absorb ->
``MatrixLift`` on the store and the exported ONNX graph (onnxruntime) equal the trained module to
1e-6. Every refusal is one line ``error: ...``, exit 2, and leaves the store's files byte for byte
as they were (``tree_digest``).
"""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from bevcompile.cli import app
from bevcompile.deploy.onnx_export import ExportOptions, export_onnx
from bevcompile.matrix.build import MatrixOptions, run_matrix
from bevcompile.matrix.prior import DepthPrior
from bevcompile.rig.config import RigConfig
from bevcompile.store.loader import load
from bevcompile.torch import LearnableLift, MatrixLift

from ..rigs import small_rig_data, tree_digest, write_yaml


def run(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(app, [*args])
    return result.exit_code, result.stdout, result.stderr


def train(lift: LearnableLift, rig: RigConfig, steps: int = 4, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A few Adam steps towards a random target; returns the (features, depth) to compare on."""
    g = torch.Generator().manual_seed(seed)
    w_f, h_f = rig.feature_size
    x = torch.rand(2, rig.n_cam, 3, h_f, w_f, generator=g)
    d = torch.rand(2, rig.n_cam, rig.depth.n_bins, h_f, w_f, generator=g).softmax(2) if lift.mode == "frustum" else None
    target = torch.rand(2, 3, rig.bev.ny, rig.bev.nx, generator=g)
    opt = torch.optim.Adam(lift.parameters(), lr=0.05)
    for _ in range(steps):
        loss = (lift(x, d) - target).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return x, d


@pytest.fixture(scope="module")
def grid_store(tmp_path_factory: pytest.TempPathFactory, small: RigConfig) -> Path:
    return run_matrix(small, tmp_path_factory.mktemp("grid"), MatrixOptions(mode="grid", topk=8, align=16)).store


def fresh(store: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "s" / store.name
    shutil.copytree(store, copy)
    return copy


def _options_and_prior(small: RigConfig, mode: str) -> tuple[MatrixOptions, DepthPrior | None]:
    """``ray-prior``: a ray store with a per-camera depth prior (stored as matrix/depth_prior)."""
    if mode != "ray-prior":
        return MatrixOptions(mode=mode, topk=8, align=16), None
    prior = DepthPrior(np.linspace(1.0, 0.1, small.n_cam * small.depth.n_bins).reshape(small.n_cam, small.depth.n_bins))
    return MatrixOptions(mode="ray", topk=8, align=16, depth_prior=prior.token), prior


@pytest.mark.parametrize("mode", ["grid", "frustum", "ray", "ray-prior"])
def test_absorb_round_trip_matrix_lift_and_onnx_equal_the_trained_module(tmp_path: Path, small: RigConfig, mode: str) -> None:
    """Every mode, ray stores included (features alone; the file prior rebuilt from matrix/depth_prior by --strict)."""
    options, prior = _options_and_prior(small, mode)
    store = run_matrix(small, tmp_path, options, depth_prior=prior).store
    lift = LearnableLift(store)
    x, d = train(lift, small)
    with torch.no_grad():
        trained = lift(x, d) if d is not None else lift(x)
    ckpt = tmp_path / "ckpt.pt"
    torch.save({"model": {"lift": lift.state_dict()}, "step": 4}, ckpt)
    code, out, err = run("absorb", str(store), str(ckpt), "--tile-rows", "64", "--quantize", "int8")
    assert code == 0, err
    assert "model.lift.ell_weight" in out and "equal to the store's" in out
    attrs = load(store)["matrix"].attrs
    assert attrs["values"] == "learned" and attrs["learned"]["key"] == "model.lift.ell_weight"
    assert attrs["learned"]["checkpoint"] == "ckpt.pt" and attrs["build_options"]["tile_rows"] == 64
    for form in ("ell", "tiles"):
        deployed = MatrixLift(store, form=form)
        with torch.no_grad():
            got = deployed(x, d) if d is not None else deployed(x)
        assert torch.max(torch.abs(got - trained)).item() <= 1e-6, form
    # the exported static graph (onnxruntime) equals the trained module too
    import onnxruntime as ort

    onnx_path = tmp_path / "ell.onnx"
    export_onnx(store, onnx_path, ExportOptions(product="ell", channels=3, batch=2))
    session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    feeds = {"features": x.numpy()} | ({"depth": d.numpy()} if d is not None else {})
    graph_out = session.run(["bev"], feeds)[0]
    assert np.max(np.abs(graph_out - trained.numpy())) <= 1e-6
    code, _, err = run("inspect", "--strict", str(store), "--quiet")
    assert code == 0, err
    # the geometric values are kept, bit for bit the geometric build's
    geometric = run_matrix(small, tmp_path / "geo", options, depth_prior=prior).products
    assert np.array_equal(load(store)["matrix"]["init_ell_weight"], geometric.ell_weight)


def test_absorb_npy_and_safetensors_and_a_second_absorb(tmp_path: Path, grid_store: Path, small: RigConfig) -> None:
    from safetensors.numpy import save_file

    store = fresh(grid_store, tmp_path)
    lift = LearnableLift(store)
    train(lift, small)
    values = lift.learned_values()
    np.save(tmp_path / "values.npy", values)
    code, out, err = run("absorb", str(store), str(tmp_path / "values.npy"), "--json")
    assert code == 0, err
    assert '"format": "npy"' in out and '"previous_values": "geometric"' in out
    first = np.array(load(store)["matrix"]["ell_weight"])
    assert np.array_equal(first, values)
    # absorbing again (more training) keeps the geometric init, not the first learned values
    init = np.array(load(store)["matrix"]["init_ell_weight"])
    again = LearnableLift(store)
    assert np.array_equal(again.learned_values(), values)  # starts from the absorbed values
    train(again, small, seed=1)
    save_file({"lift.ell_weight": again.learned_values(), "other": np.zeros(3, np.float32)}, str(tmp_path / "v.safetensors"))
    code, out, err = run("absorb", str(store), str(tmp_path / "v.safetensors"))
    assert code == 0, err
    group = load(store)["matrix"]
    assert np.array_equal(group["init_ell_weight"], init)
    assert np.array_equal(group["ell_weight"], again.learned_values())
    assert group.attrs["learned"]["format"] == "safetensors"


def test_matrix_refuses_a_learned_store_without_force(tmp_path: Path, grid_store: Path, small: RigConfig) -> None:
    store = fresh(grid_store, tmp_path)
    np.save(tmp_path / "v.npy", LearnableLift(store).learned_values() * 2)
    assert run("absorb", str(store), str(tmp_path / "v.npy"), "--quiet")[0] == 0
    config = write_yaml(tmp_path / "small.yaml", small_rig_data())
    before = tree_digest(store)
    code, _, err = run("matrix", str(config), "--out", str(store.parent), "--mode", "grid", "--topk", "8", "--quiet")
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("error: ") and "learned values" in err and "bevcompile absorb" in err and "--force" in err
    assert tree_digest(store) == before
    code, _, err = run("matrix", str(config), "--out", str(store.parent), "--mode", "grid", "--topk", "8", "--quiet", "--force")
    assert code == 0, err
    assert "values" not in load(store)["matrix"].attrs and "init_ell_weight" not in load(store)["matrix"]


def _evil_pickle(path: Path, marker: Path) -> None:
    class Evil:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (os.system, (f"touch {marker}",))

    torch.save({"lift.ell_weight": Evil()}, path)


class Custom:
    def __init__(self) -> None:
        self.weight = torch.zeros(2)


BAD = ["wrong_shape", "nan", "padding", "topology", "missing_key", "ambiguous", "not_a_checkpoint", "needs_code", "custom_class", "integer", "none_of_the_shape", "npy_with_key"]


@pytest.mark.parametrize("case", BAD)
def test_every_bad_checkpoint_is_one_line_exit_2_and_leaves_the_store(tmp_path: Path, grid_store: Path, case: str) -> None:
    store = fresh(grid_store, tmp_path)
    lift = LearnableLift(store)
    state = {k: v.clone() for k, v in lift.state_dict().items()}
    w = state["ell_weight"]
    ckpt = tmp_path / "ckpt.pt"
    extra: list[str] = []
    marker = tmp_path / "code_ran"
    expect: tuple[str, ...]
    if case == "wrong_shape":
        state["ell_weight"] = w[:, :8].contiguous()
        state.pop("ell_index")
        torch.save(state, ckpt)
        extra = ["--key", "ell_weight"]
        expect = ("ckpt.pt: ell_weight: shape (576, 8) is not the store's ELL shape (576, 16)",)
    elif case == "nan":
        w[0, 0] = float("nan")
        torch.save(state, ckpt)
        expect = ("ckpt.pt: ell_weight: 1 value(s) not finite (first at row 0, slot 0)",)
    elif case == "padding":
        pad = np.argwhere(~lift.ell_mask.numpy())[0]
        w[pad[0], pad[1]] = 0.5
        torch.save(state, ckpt)
        expect = ("ckpt.pt: ell_weight: 1 padding slot(s) not exactly 0", f"row {pad[0]}, slot {pad[1]}")
    elif case == "topology":
        state["ell_index"][3, 0] += 1
        torch.save(state, ckpt)
        expect = ("ckpt.pt: ell_index: the topology differs from the store's: 1 index(es) differ (first at row 3, slot 0)",)
    elif case == "missing_key":
        torch.save({"model": state}, ckpt)
        extra = ["--key", "lift.ell_weight"]
        expect = ("ckpt.pt: lift.ell_weight: no such tensor in the checkpoint", "model.ell_weight float32 (576, 16)")
    elif case == "ambiguous":
        opt = torch.optim.Adam(lift.parameters())
        lift(torch.rand(1, 4, 1, 8, 12)).sum().backward()
        opt.step()
        torch.save({"model": lift.state_dict(), "optimizer": opt.state_dict()}, ckpt)
        expect = ("ckpt.pt: 3 tensors of the ELL shape (576, 16): model.ell_weight, optimizer.state.0.exp_avg, optimizer.state.0.exp_avg_sq; pass --key NAME",)
    elif case == "not_a_checkpoint":
        ckpt.write_text("step: 3\nloss: 0.1\n")
        expect = ("ckpt.pt: not a checkpoint",)
    elif case == "needs_code":
        _evil_pickle(ckpt, marker)
        expect = ("ckpt.pt: a pickle that needs code to load (it asks for posix.system)", "weights_only=True")
    elif case == "custom_class":
        torch.save({"lift": Custom()}, ckpt)
        expect = ("ckpt.pt: a pickle that needs code to load (it asks for tests.cli.test_absorb_cmd.Custom)",)
    elif case == "integer":
        state["ell_weight"] = torch.zeros(w.shape, dtype=torch.int32)
        torch.save(state, ckpt)
        extra = ["--key", "ell_weight"]
        expect = ("ckpt.pt: ell_weight: dtype int32: the learned values must be floating point",)
    elif case == "none_of_the_shape":
        torch.save({"backbone.weight": torch.zeros(3, 3)}, ckpt)
        expect = ("ckpt.pt: no floating-point tensor of the store's ELL shape (576, 16) (rows_pad, k_pad); 2-D float tensors: backbone.weight float32 (3, 3)",)
    else:  # npy_with_key
        ckpt = tmp_path / "v.npy"
        np.save(ckpt, w.numpy())
        extra = ["--key", "ell_weight"]
        expect = ("--key 'ell_weight': ", "is a .npy holding one array")
    before = tree_digest(store)
    code, out, err = run("absorb", str(store), str(ckpt), *extra)
    assert code == 2, (out, err)
    assert err.startswith("error: ") and err.count("\n") == 1, err
    for piece in expect:
        assert piece in err, err
    assert tree_digest(store) == before
    assert not marker.exists()


def test_a_plain_pickle_never_runs_its_code(tmp_path: Path, grid_store: Path) -> None:
    """A bare pickle (not torch.save) with an os.system reduce: refused, nothing executed."""
    store = fresh(grid_store, tmp_path)
    marker = tmp_path / "code_ran"

    class Evil:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (os.system, (f"touch {marker}",))

    ckpt = tmp_path / "ckpt.pkl"
    ckpt.write_bytes(pickle.dumps({"w": Evil()}, protocol=2))
    code, _, err = run("absorb", str(store), str(ckpt))
    assert code == 2 and "needs code to load" in err and err.count("\n") == 1
    assert not marker.exists()


def test_absorb_on_a_store_without_matrix_names_the_command(tmp_path: Path, small: RigConfig) -> None:
    from bevcompile.grid.build import run_grid

    store = run_grid(small, tmp_path).store
    np.save(tmp_path / "v.npy", np.zeros((576, 16), np.float32))
    code, _, err = run("absorb", str(store), str(tmp_path / "v.npy"))
    assert code == 2 and "no group matrix/" in err and "bevcompile matrix" in err


@pytest.mark.parametrize(("mode", "normalize"), [("grid", "sum"), ("frustum", "mean")])
def test_region_store_learned_round_trip(tmp_path: Path, mode: str, normalize: str) -> None:
    """Issue 17's loop on a bev.region store (corridor + rings, so super-cells of sizes 2 and 4):
    train LearnableLift a few steps on the dense map -> absorb -> MatrixLift (ell and tiles, rows
    dense and compact) and the exported graphs (dense, and --rows compact) equal the trained module
    to 1e-6; inspect --strict, verify (float64 reference carrying the learned values) and the drift
    report (over the compact rows) pass."""
    from ..matrix.test_region import REGION

    data = small_rig_data()
    data["bev"]["region"] = REGION
    config = write_yaml(tmp_path / "small.yaml", data)
    code, _, err = run("matrix", str(config), "--mode", mode, "--normalize", normalize, "--topk", "8", "--align", "16", "--out", str(tmp_path), "--quiet")
    assert code == 0, err
    store = tmp_path / "small.zarr"
    loaded = load(store)
    rig = loaded.rig
    expand = torch.from_numpy(np.asarray(loaded["matrix"]["expand"]).astype(np.int64))
    n_kept = int(loaded.array_info("matrix", "cells").shape[0])
    assert {int(s) for s in np.unique(loaded["matrix"]["cells"][:, 2])} == {1, 2, 4}
    lift = LearnableLift(store)
    assert set(LearnableLift(store, rows="compact").state_dict()) == set(lift.state_dict())
    x, d = train(lift, rig)
    with torch.no_grad():
        trained = lift(x, d) if d is not None else lift(x)
    assert trained.shape == (2, 3, rig.bev.ny, rig.bev.nx)
    ckpt = tmp_path / "ckpt.pt"
    torch.save({"model": {"lift": lift.state_dict()}}, ckpt)
    code, out, err = run("absorb", str(store), str(ckpt), "--tile-rows", "32", "--quantize", "int8")
    assert code == 0, err
    assert "model.lift.ell_weight" in out and "equal to the store's" in out
    flat = trained.reshape(2, 3, -1)
    for form in ("ell", "tiles"):
        with torch.no_grad():
            dense = MatrixLift(store, form=form)(*((x, d) if d is not None else (x,)))
            compact = MatrixLift(store, form=form, rows="compact")(*((x, d) if d is not None else (x,)))
        assert torch.max(torch.abs(dense - trained)).item() <= 1e-6, form
        assert compact.shape == (2, 3, n_kept)
        padded = torch.cat([compact, torch.zeros(2, 3, 1)], dim=2)
        assert torch.max(torch.abs(padded[:, :, expand] - flat)).item() <= 1e-6, form
    import onnxruntime as ort

    feeds = {"features": x.numpy()} | ({"depth": d.numpy()} if d is not None else {})
    for rows in ("dense", "compact"):
        path = tmp_path / f"{rows}.onnx"
        export_onnx(store, path, ExportOptions(product="ell", channels=3, batch=2, rows=rows))
        got = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(["bev"], feeds)[0]
        want = trained.numpy() if rows == "dense" else compact.numpy()
        assert got.shape == want.shape and np.max(np.abs(got - want)) <= 1e-6, rows
    code, out, err = run("inspect", "--strict", str(store))
    assert code == 0, err + out
    code, out, err = run("verify", str(store))
    assert code == 0, err + out
    assert "matrix/learned_vs_init" in out and "rows passed" in out
    code, out, err = run("diff", "--against-init", str(store))
    assert code == 0, err
    assert f"bev.region store: figures over its {n_kept} compact rows" in " ".join(out.split())
