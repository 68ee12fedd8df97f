"""The fuzzer of the matrix inputs read from files (issue 31), in the style of the config fuzz:
seeded mutations of checkpoints (``absorb``: .npy, .npz, .safetensors, torch.save zip and legacy
pickle) and of ``--depth-prior`` .npy files, byte by byte and in their headers, keep the promise
"bad input never gets a traceback": every file is read (and its values checked) or refused in
one bounded, control-character-free line of the reader's error class (~5 s)."""

from __future__ import annotations

import io
import json
import random
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from bevcompile.errors import CheckpointError, DependencyError, DepthPriorError
from bevcompile.matrix.checkpoint import read_checkpoint
from bevcompile.matrix.learned import check_values, select_values
from bevcompile.matrix.prior import read_depth_prior

from ..rigs import small_rig

ELL = (16, 8)
HEADER_VALUES = [
    "NaN", "Infinity", "1e999", "-1", "0", "18446744073709551616", "9" * 5001, "[" * 5000 + "]" * 5000, '"\x1b[2J"', "null",
    "true", '"F32"', '"BF16"', '"X"', "[]", "[1, 2]", "[0, 1e30]", "{}", '{"a": 1, "a": 2}',
]


def _assert_clean(exc: BaseException, kinds: tuple[type[BaseException], ...]) -> None:
    message = str(exc)
    assert isinstance(exc, kinds), f"{type(exc).__name__}: {message[:300]}"
    assert "\n" not in message and len(message) <= 1000, message[:200]
    assert not any(ord(ch) < 32 or 0x7F <= ord(ch) < 0xA0 for ch in message), repr(message[:200])


def _mutations(raw: bytes, rng: random.Random, header: tuple[int, int] | None = None) -> bytes:
    data = bytearray(raw)
    for _ in range(rng.randint(1, 3)):
        action = rng.random()
        if action < 0.35 and data:  # flip bytes (in the header half the time: where the parsers decide)
            top = min(header[1], len(data)) if header and rng.random() < 0.5 else len(data)
            for _ in range(rng.randint(1, 4)):
                data[rng.randrange(max(top, 1))] = rng.randrange(256)
        elif action < 0.55:  # truncate
            del data[rng.randrange(len(data) + 1) :]
        elif action < 0.7:  # grow
            data += bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
        elif header is not None:  # a header value replaced by a hostile one
            start, end = header
            text = bytes(data[start:end]).decode("latin-1")
            numbers = [i for i, ch in enumerate(text) if ch.isdigit() or ch == '"']
            if numbers:
                at = rng.choice(numbers)
                piece = rng.choice(HEADER_VALUES)
                text = text[:at] + piece + text[at + rng.randint(1, 12) :]
                data[start:end] = text.encode("latin-1", "replace")  # may change the length: the header's own length field then lies
    return bytes(data)


def _safetensors(values: np.ndarray) -> tuple[bytes, tuple[int, int]]:
    header = json.dumps({"w": {"dtype": "F32", "shape": list(values.shape), "data_offsets": [0, values.nbytes]}, "__metadata__": {"k": "v"}}).encode()
    return struct.pack("<Q", len(header)) + header + values.astype("<f4").tobytes(), (8, 8 + len(header))


def _npy(values: np.ndarray) -> tuple[bytes, tuple[int, int]]:
    buffer = io.BytesIO()
    np.save(buffer, values)
    raw = buffer.getvalue()
    return raw, (8, raw.index(b"\n") + 1)


def _npz(values: np.ndarray) -> tuple[bytes, tuple[int, int]]:
    buffer = io.BytesIO()
    np.savez(buffer, w=values, i=np.arange(3))
    return buffer.getvalue(), (0, 120)


def _torch(values: np.ndarray, legacy: bool) -> tuple[bytes, tuple[int, int]]:
    import torch

    buffer = io.BytesIO()
    torch.save({"lift": {"ell_weight": torch.from_numpy(values)}}, buffer, _use_new_zipfile_serialization=not legacy)
    return buffer.getvalue(), (0, 200)


FORMATS: dict[str, Callable[[np.ndarray], tuple[bytes, tuple[int, int]]]] = {
    "npy": _npy, "npz": _npz, "safetensors": _safetensors,
    "torch": lambda v: _torch(v, False), "torch-legacy": lambda v: _torch(v, True),
}


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_mutated_checkpoints_are_read_or_refused_in_one_clean_line(tmp_path: Path, fmt: str) -> None:
    if fmt.startswith("torch"):
        pytest.importorskip("torch")
    rng = random.Random(31)
    values = np.zeros(ELL, np.float32)
    values[:, :4] = np.random.default_rng(0).uniform(0.1, 1.0, (ELL[0], 4))
    real = np.zeros(ELL, bool)
    real[:, :4] = True
    raw, header = FORMATS[fmt](values)
    read, cases = 0, 25 if fmt.startswith("torch") else 60  # torch.load is slow
    for case in range(cases):
        path = tmp_path / f"c{case}.{fmt}"
        path.write_bytes(_mutations(raw, rng, header))
        try:
            contents = read_checkpoint(path)
            tensor = select_values(contents, str(path), ELL, None)
            check_values(tensor, str(path), ELL, real)
            read += 1
        except Exception as exc:
            _assert_clean(exc, (CheckpointError, DependencyError))
    assert read < cases  # the mutations bite


def test_mutated_depth_priors_are_read_or_refused_in_one_clean_line(tmp_path: Path) -> None:
    rig = small_rig()
    rng = random.Random(31)
    shapes = [(rig.depth.n_bins,), (rig.n_cam, rig.depth.n_bins), (rig.n_cam, rig.depth.n_bins, rig.feature_size[1], rig.feature_size[0])]
    read = 0
    for case in range(150):
        values = np.random.default_rng(case).uniform(0, 1, shapes[case % 3])
        raw, header = _npy(values.astype(rng.choice(["<f8", "<f4", ">f8", "<i4", "<f2"])))
        path = tmp_path / f"p{case}.npy"
        path.write_bytes(_mutations(raw, rng, header))
        try:
            prior = read_depth_prior(path, rig)
            assert prior.raw is not None and np.all(np.isfinite(prior.raw)) and np.all(prior.raw >= 0)
            read += 1
        except Exception as exc:
            _assert_clean(exc, (DepthPriorError,))
    assert 0 < read < 150
