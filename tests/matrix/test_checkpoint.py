"""The checkpoint reader (``bevcompile.matrix.checkpoint``) against the formats' own writers:
``torch.save``, ``numpy.save``/``savez`` and the ``safetensors`` library (an independent
implementation of the format the reader parses by hand)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from bevcompile.errors import CheckpointError
from bevcompile.matrix.checkpoint import read_checkpoint


def test_safetensors_written_by_the_library_read_back_exactly(tmp_path: Path) -> None:
    from safetensors.numpy import save_file
    from safetensors.torch import save_file as save_torch

    rng = np.random.default_rng(0)
    arrays = {
        "a.f32": rng.standard_normal((5, 7)).astype(np.float32),
        "a.f64": rng.standard_normal((3,)),
        "b.f16": rng.standard_normal((2, 2)).astype(np.float16),
        "c.i32": np.arange(6, dtype=np.int32).reshape(2, 3),
        "d.u8": np.arange(4, dtype=np.uint8),
        "e.empty": np.zeros((0, 4), np.float32),
    }
    save_file(arrays, str(tmp_path / "x.safetensors"), metadata={"note": "hello"})
    ckpt = read_checkpoint(tmp_path / "x.safetensors")
    assert ckpt.format == "safetensors" and set(ckpt.tensors) == set(arrays)
    for name, array in arrays.items():
        got = ckpt.tensors[name].load()
        assert got.dtype == array.dtype and np.array_equal(got, array), name
    assert ckpt.tensors["c.i32"].kind == "i" and ckpt.tensors["a.f32"].kind == "f"
    # bfloat16 (torch writer): widened exactly to float32
    bf = torch.tensor([[1.5, -2.25], [3.0e-3, 1.0e30]], dtype=torch.bfloat16)
    save_torch({"w": bf}, str(tmp_path / "bf.safetensors"))
    got = read_checkpoint(tmp_path / "bf.safetensors").tensors["w"]
    assert got.dtype == "BF16" and got.kind == "f"
    assert np.array_equal(got.load(), bf.float().numpy())


def test_torch_checkpoints_are_flattened_to_dotted_paths(tmp_path: Path) -> None:
    state = {"model": {"lift.ell_weight": torch.ones(2, 3), "lift.ell_index": torch.zeros(2, 3, dtype=torch.int32)},
             "optimizer": {"state": {0: {"exp_avg": torch.zeros(2, 3)}}, "param_groups": [{"lr": 1e-4}]}, "step": 7,
             "bf": torch.tensor([1.5], dtype=torch.bfloat16)}
    torch.save(state, tmp_path / "c.pt")
    ckpt = read_checkpoint(tmp_path / "c.pt")
    assert ckpt.format == "pytorch"
    assert set(ckpt.tensors) == {"model.lift.ell_weight", "model.lift.ell_index", "optimizer.state.0.exp_avg", "bf"}
    assert ckpt.tensors["model.lift.ell_index"].kind == "i"
    assert np.array_equal(ckpt.tensors["bf"].load(), np.array([1.5], np.float32))
    torch.save(state, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    assert set(read_checkpoint(tmp_path / "legacy.pt").tensors) == set(ckpt.tensors)


def test_numpy_files(tmp_path: Path) -> None:
    np.save(tmp_path / "a.npy", np.eye(3, dtype=np.float32))
    np.savez(tmp_path / "b.npz", w=np.ones(2), i=np.arange(3))
    assert read_checkpoint(tmp_path / "a.npy").tensors[""].shape == (3, 3)
    b = read_checkpoint(tmp_path / "b.npz")
    assert b.format == "npz" and set(b.tensors) == {"w", "i"}
    np.save(tmp_path / "o.npy", np.array([{"x": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(CheckpointError, match=r"o\.npy: a \.npy that needs pickle to load"):
        read_checkpoint(tmp_path / "o.npy")


def _safetensors_bytes(header: dict[str, object], data: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return len(raw).to_bytes(8, "little") + raw + data


@pytest.mark.parametrize(
    ("header", "data", "message"),
    [
        ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 12]}}, b"\0" * 12, "do not hold F32 [2] (8 bytes)"),
        ({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8, "inside the 8-byte data"),
        ({"w": {"dtype": "Q4", "shape": [1], "data_offsets": [0, 1]}}, b"\0", "dtype 'Q4' is not one of"),
        ({"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 4, "shape [-1] is not a list of integers"),
    ],
)
def test_damaged_safetensors_are_one_line_errors(tmp_path: Path, header: dict[str, object], data: bytes, message: str) -> None:
    path = tmp_path / "bad.safetensors"
    path.write_bytes(_safetensors_bytes(header, data))
    with pytest.raises(CheckpointError, match=r"bad\.safetensors: w: safetensors ") as info:
        read_checkpoint(path)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_unrecognised_files(tmp_path: Path) -> None:
    (tmp_path / "t.pt").write_text("not a checkpoint at all")
    (tmp_path / "z.pt").write_bytes(b"PK\x03\x04garbage")
    with pytest.raises(CheckpointError, match=r"t\.pt: not a checkpoint: neither a PyTorch file"):
        read_checkpoint(tmp_path / "t.pt")
    with pytest.raises(CheckpointError, match=r"z\.pt: a damaged zip file"):
        read_checkpoint(tmp_path / "z.pt")
    with pytest.raises(CheckpointError, match=r"nope\.pt: no such file"):
        read_checkpoint(tmp_path / "nope.pt")
    with pytest.raises(CheckpointError, match="is a directory"):
        read_checkpoint(tmp_path)
