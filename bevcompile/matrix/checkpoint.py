"""Training checkpoints for ``bevcompile absorb``: the ONLY module that reads them.

A checkpoint is recognised by its first bytes, not its name:

* PyTorch (``torch.save``: a zip holding ``<name>/data.pkl``, or the legacy pickle format):
  ``torch.load(path, weights_only=True, map_location="cpu")`` (memory-mapped for the zip
  format). ``weights_only`` is PyTorch's restricted unpickler: tensors, dicts, lists and plain
  numbers only, so no pickle code ever runs; a pickle that needs code (a custom class, an
  ``os.system`` reduce) is refused with one line naming the global it asked for.
* numpy ``.npy`` (``\\x93NUMPY``; one array, memory-mapped) and ``.npz`` (a zip of ``.npy``
  members), read with ``allow_pickle=False``.
* ``.safetensors``: an 8-byte little-endian header length ``N``, a JSON header of ``N`` bytes
  (``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``), then the
  raw little-endian data; read here directly (no dependency), every offset and size checked.

Nested containers (a ``{"model": state_dict, "optimizer": ...}`` checkpoint) are flattened to
dotted tensor paths (``model.lift.ell_weight``, ``optimizer.state.0.exp_avg``). Every failure is a
one-line :class:`~bevcompile.errors.CheckpointError` ``<file>: <tensor path>: <what is wrong>``.
"""

from __future__ import annotations

import hashlib
import math
import re
import zipfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .._version import TORCH_REQUIREMENT
from ..errors import CheckpointError, DependencyError
from ..files import MISSING, FileRefused, JSONRefused, loads_strict, open_regular

NPY_MAGIC = b"\x93NUMPY"
ZIP_MAGIC = b"PK\x03\x04"
SAFETENSORS_MAX_HEADER = 100 * 2**20
"""Largest safetensors JSON header read (the format's own reference limit is 100 MB)."""
SAFETENSORS_DTYPES: dict[str, str] = {
    "F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": "bf16",
    "I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "i1",
    "U64": "<u8", "U32": "<u4", "U16": "<u2", "U8": "u1", "BOOL": "?",
}
FORMATS = ("pytorch", "npy", "npz", "safetensors")
MAX_CHECKPOINT_BYTES = 32 << 30
"""A checkpoint file is at most 32 GiB (a full training state of a large model; its sha256 is
read whole): a larger one, a FIFO or a device is refused before anything is read."""


@dataclass(frozen=True)
class Tensor:
    """One tensor of a checkpoint, read on demand.

    Convention: ``name`` the dotted path (``""`` for the one array of a ``.npy``); ``shape`` its
    shape; ``dtype`` the stored dtype as the format names it (``float32``, ``bfloat16``, ``F16``
    ...); ``kind`` ``"f"`` floating point, ``"i"``/``"u"`` integer, ``"b"`` bool; ``load()``
    returns it as numpy (bfloat16 widened exactly to float32).
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    kind: str
    load: Callable[[], np.ndarray]


@dataclass(frozen=True)
class Checkpoint:
    """The tensors of a checkpoint file, its format and the SHA-256 of its bytes."""

    path: Path
    format: str
    sha256: str
    tensors: Mapping[str, Tensor]


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_checkpoint(path: str | Path, *, shown: str | None = None) -> Checkpoint:
    """Open a checkpoint (see the module docstring); ``shown`` is the file name used in errors
    (default: ``path`` as given). Raises :class:`CheckpointError` (one line) for a missing,
    unreadable, unsafe or unrecognised file, and :class:`DependencyError` for a PyTorch
    checkpoint without PyTorch installed."""
    path = Path(path)
    where = shown if shown is not None else str(path)
    try:  # a regular file of bounded size, before a byte is read (a FIFO would block, /dev/zero never end)
        handle, _size = open_regular(path, MAX_CHECKPOINT_BYTES, "a checkpoint file")
        with handle:
            head = handle.read(16)
    except FileRefused as exc:
        raise CheckpointError(where, "", "no such file" if exc.code == MISSING else exc.reason) from None
    except OSError as exc:
        raise CheckpointError(where, "", f"cannot read ({exc.strerror or exc.__class__.__name__})") from None
    try:
        sha = file_sha256(path)
    except OSError as exc:
        raise CheckpointError(where, "", f"cannot read ({exc.strerror or exc.__class__.__name__})") from None
    if head.startswith(NPY_MAGIC):
        return Checkpoint(path, "npy", sha, _read_npy(path, where))
    if head.startswith(ZIP_MAGIC):
        try:
            with zipfile.ZipFile(path) as archive:
                names = archive.namelist()
        except Exception as exc:  # BadZipFile, OSError, a member name that is not UTF-8 ...
            raise CheckpointError(where, "", f"a damaged zip file ({_first_line(exc)})") from None
        if any(n == "data.pkl" or n.endswith("/data.pkl") for n in names):
            return Checkpoint(path, "pytorch", sha, _read_torch(path, where, mmap=True))
        if names and all(n.endswith(".npy") for n in names):
            return Checkpoint(path, "npz", sha, _read_npz(path, where))
        raise CheckpointError(where, "", "a zip file that is neither a PyTorch checkpoint (no data.pkl) nor a numpy .npz")
    if _looks_like_safetensors(path, head):
        return Checkpoint(path, "safetensors", sha, _read_safetensors(path, where))
    if head[:1] == b"\x80":  # a pickle: the legacy (non-zip) torch.save format, or a plain pickle
        return Checkpoint(path, "pytorch", sha, _read_torch(path, where, mmap=False))
    raise CheckpointError(
        where, "", "not a checkpoint: neither a PyTorch file (torch.save), a numpy .npy/.npz nor a .safetensors file"
    )


# --------------------------------------------------------------------------------------
# numpy
# --------------------------------------------------------------------------------------


def _numpy_tensor(name: str, array: np.ndarray, loader: Callable[[], np.ndarray]) -> Tensor:
    return Tensor(name, tuple(int(s) for s in array.shape), str(array.dtype), array.dtype.kind, loader)


def _constant_tensor(name: str, array: np.ndarray) -> Tensor:
    """A :class:`Tensor` of an array already in memory."""
    return _numpy_tensor(name, array, lambda: array)


def _read_npy(path: Path, where: str) -> dict[str, Tensor]:
    try:
        array = np.load(path, mmap_mode="r", allow_pickle=False)
    except ValueError as exc:  # an object array: needs pickle
        raise CheckpointError(where, "", f"a .npy that needs pickle to load ({_first_line(exc)}); save a numeric array") from None
    except Exception as exc:
        raise CheckpointError(where, "", f"a damaged .npy file ({_first_line(exc)})") from None
    return {"": _numpy_tensor("", array, lambda: np.asarray(array))}


def _read_npz(path: Path, where: str) -> dict[str, Tensor]:
    """The members of a ``.npz``, each known by its ``.npy`` header (shape, dtype) and read only
    when loaded: a member is never inflated before its shape has been checked."""
    out: dict[str, Tensor] = {}
    try:
        with zipfile.ZipFile(path) as archive:
            for info in archive.infolist():
                name = info.filename.removesuffix(".npy")
                with archive.open(info) as member:
                    version = np.lib.format.read_magic(member)
                    read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
                    shape, _fortran, dtype = read_header(member)
                if dtype.hasobject:
                    raise ValueError("Object arrays cannot be loaded when allow_pickle=False")
                out[name] = Tensor(name, tuple(int(n) for n in shape), str(dtype), dtype.kind, _npz_loader(path, name))
    except ValueError as exc:
        raise CheckpointError(where, "", f"a .npz that needs pickle to load ({_first_line(exc)}); save numeric arrays") from None
    except Exception as exc:
        raise CheckpointError(where, "", f"a damaged .npz file ({_first_line(exc)})") from None
    return out


def _npz_loader(path: Path, name: str) -> Callable[[], np.ndarray]:
    def load() -> np.ndarray:
        with np.load(path, allow_pickle=False) as archive:
            return np.asarray(archive[name])

    return load


# --------------------------------------------------------------------------------------
# PyTorch
# --------------------------------------------------------------------------------------

_NEEDS_CODE = re.compile(r"(?:Unsupported global: GLOBAL|unsupported GLOBAL)\s+(\S+)")


def _read_torch(path: Path, where: str, *, mmap: bool) -> dict[str, Tensor]:
    try:
        import torch
    except ImportError:
        raise DependencyError(
            f"{where}: a PyTorch checkpoint; reading it needs PyTorch: pip install 'bevcompile[torch]' ({TORCH_REQUIREMENT}), "
            "or save the values as .npy / .safetensors"
        ) from None
    import pickle
    import warnings

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # protocol notes of the weights-only unpickler
            data = torch.load(path, weights_only=True, map_location="cpu", mmap=mmap)
    except pickle.UnpicklingError as exc:
        needs = _NEEDS_CODE.search(str(exc))
        what = f" (it asks for {needs.group(1).rstrip('.')})" if needs else ""
        raise CheckpointError(
            where, "",
            f"a pickle that needs code to load{what}: absorb reads checkpoints with torch.load(weights_only=True) and runs "
            "no pickle code; save a state_dict (tensors only)",
        ) from None
    except Exception as exc:
        raise CheckpointError(where, "", f"not a readable PyTorch checkpoint ({_first_line(exc)})") from None
    out: dict[str, Tensor] = {}
    _flatten(data, "", out, torch)
    return out


def _flatten(value: Any, prefix: str, out: dict[str, Tensor], torch: Any) -> None:
    """Tensors of nested dicts/lists under dotted paths (other leaves are not tensors: skipped)."""
    if isinstance(value, torch.Tensor):
        out[prefix] = _torch_tensor(prefix, value, torch)
    elif isinstance(value, Mapping):
        for key, item in value.items():
            _flatten(item, f"{prefix}.{key}" if prefix else str(key), out, torch)
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            _flatten(item, f"{prefix}.{i}" if prefix else str(i), out, torch)
    elif isinstance(value, np.ndarray):  # weights_only admits numpy arrays of plain dtypes
        out[prefix] = _constant_tensor(prefix, value)


def _torch_tensor(name: str, tensor: Any, torch: Any) -> Tensor:
    dtype = tensor.dtype
    kind = "f" if dtype.is_floating_point else "b" if dtype == torch.bool else "c" if dtype.is_complex else "u" if dtype == torch.uint8 else "i"

    def load() -> np.ndarray:
        t = tensor.detach()
        if t.dtype == torch.bfloat16:
            t = t.to(torch.float32)  # exact: bfloat16 is the top half of a float32
        return np.asarray(t.contiguous().numpy())

    return Tensor(name, tuple(int(s) for s in tensor.shape), str(dtype).removeprefix("torch."), kind, load)


# --------------------------------------------------------------------------------------
# safetensors
# --------------------------------------------------------------------------------------


def _looks_like_safetensors(path: Path, head: bytes) -> bool:
    if len(head) < 9:
        return False
    n = int.from_bytes(head[:8], "little")
    try:
        size = path.stat().st_size
    except OSError:
        return False
    return 2 <= n <= min(SAFETENSORS_MAX_HEADER, size - 8) and head[8:9] == b"{"


def _read_safetensors(path: Path, where: str) -> dict[str, Tensor]:
    size = path.stat().st_size
    with path.open("rb") as handle:
        n = int.from_bytes(handle.read(8), "little")
        raw = handle.read(n)
    try:
        header = loads_strict(raw)
    except JSONRefused as exc:
        raise CheckpointError(where, "", f"a .safetensors file whose header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise CheckpointError(where, "", "a .safetensors file whose header is not a JSON object")
    data_start = 8 + n
    data_size = size - data_start
    out: dict[str, Tensor] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(info, dict):
            raise CheckpointError(where, name, "safetensors header entry is not an object")
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if dtype not in SAFETENSORS_DTYPES:
            raise CheckpointError(where, name, f"safetensors dtype {dtype!r} is not one of {', '.join(SAFETENSORS_DTYPES)}")
        if not (isinstance(shape, list) and all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape)):
            raise CheckpointError(where, name, f"safetensors shape {shape!r} is not a list of integers >= 0")
        if not (
            isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        ):
            raise CheckpointError(where, name, f"safetensors data_offsets {offsets!r} are not [begin, end]")
        begin, end = offsets
        code = SAFETENSORS_DTYPES[dtype]
        itemsize = 2 if code == "bf16" else np.dtype(code).itemsize
        want = math.prod(shape) * itemsize
        if not 0 <= begin <= end <= data_size or end - begin != want:
            raise CheckpointError(
                where, name,
                f"safetensors data_offsets [{begin}, {end}] do not hold {dtype} {shape} ({want} bytes) inside the {data_size}-byte data",
            )
        kind = "f" if dtype.startswith(("F", "BF")) else "b" if dtype == "BOOL" else "u" if dtype.startswith("U") else "i"
        out[name] = Tensor(name, tuple(shape), dtype, kind, _safetensors_loader(path, data_start + begin, tuple(shape), code))
    return out


def _safetensors_loader(path: Path, offset: int, shape: tuple[int, ...], code: str) -> Callable[[], np.ndarray]:
    def load() -> np.ndarray:
        count = math.prod(shape)
        if code == "bf16":  # the top 16 bits of a float32: widen exactly
            bits = np.fromfile(path, dtype="<u2", count=count, offset=offset).astype(np.uint32) << 16
            return bits.view(np.float32).reshape(shape)
        return np.fromfile(path, dtype=np.dtype(code), count=count, offset=offset).reshape(shape)

    return load


def _first_line(exc: BaseException) -> str:
    text = " ".join(str(exc).strip().split("\n")[:1]).strip()
    return f"{exc.__class__.__name__}: {text}" if text else exc.__class__.__name__
