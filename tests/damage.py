"""Deliberate damage to stores, for the inspect/verify robustness tests.

Each helper corrupts a store on disk the way a failing disk, a bad copy or a hand edit would,
bypassing the library's writer (tests may touch zarr and the files directly).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bevcompile.store.zarr_io import array_sha256


def chunk_files(store: Path, array: str) -> list[Path]:
    """Chunk files of ``group/name``, sorted (zarr v3 default key encoding: ``c/i/j/...``)."""
    return sorted(p for p in (store / array / "c").rglob("*") if p.is_file())


def delete_chunk(store: Path, array: str) -> Path:
    victim = chunk_files(store, array)[0]
    victim.unlink()
    return victim


def truncate_chunk(store: Path, array: str) -> Path:
    victim = chunk_files(store, array)[0]
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 2])
    return victim


def garbage_chunk(store: Path, array: str) -> Path:
    victim = chunk_files(store, array)[0]
    size = victim.stat().st_size
    victim.write_bytes(np.random.default_rng(0).integers(0, 256, size=max(size, 64), dtype=np.uint8).tobytes())
    return victim


def delete_metadata(store: Path, node: str = "") -> Path:
    """Delete the ``zarr.json`` of the root (``""``), a group (``"grid"``) or an array (``"grid/coords"``)."""
    victim = store / node / "zarr.json" if node else store / "zarr.json"
    victim.unlink()
    return victim


def corrupt_metadata(store: Path, node: str) -> None:
    (store / node / "zarr.json").write_text("{ not json")


def reconsolidate(store: Path) -> None:
    """Rebuild the store's consolidated metadata (what a careful hand edit does after editing:
    the damage under test is then the edit alone, not a stale consolidated copy)."""
    import warnings

    import zarr

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        zarr.consolidate_metadata(str(store))


def edit_attr(store: Path, node: str, keys: Sequence[str], value: Any, *, consolidate: bool = True) -> None:
    """Set ``attributes[keys[0]][keys[1]]... = value`` in a node's ``zarr.json`` (a hand edit; the
    consolidated metadata rebuilt after it unless ``consolidate=False``)."""
    meta_path = store / node / "zarr.json" if node else store / "zarr.json"
    meta = json.loads(meta_path.read_text())
    target = meta["attributes"]
    for key in keys[:-1]:
        target = target[key]
    target[keys[-1]] = value
    meta_path.write_text(json.dumps(meta, indent=2))
    if consolidate:
        reconsolidate(store)


def get_attr(store: Path, node: str, keys: Sequence[str]) -> Any:
    meta_path = store / node / "zarr.json" if node else store / "zarr.json"
    target = json.loads(meta_path.read_text())["attributes"]
    for key in keys:
        target = target[key]
    return target


def rewrite_array(store: Path, array: str, data: np.ndarray, *, update_sha256: bool = True) -> None:
    """Replace ``group/name`` with ``data`` (any dtype/shape), keeping the other attributes;
    ``update_sha256`` records the new content hash (so only the content checks can notice)."""
    import zarr

    group_name, name = array.split("/")
    root = zarr.open_group(str(store), mode="r+", zarr_format=3, use_consolidated=False)
    group = root[group_name]
    assert isinstance(group, zarr.Group)
    old = group[name]
    attrs = dict(old.attrs)
    dims = old.metadata.dimension_names  # kept: a consistent edit changes the values, not the axes' names
    del group[name]
    if update_sha256:
        attrs["sha256"] = array_sha256(data)
    keep_dims = dims is not None and len(dims) == data.ndim
    new = group.create_array(
        name, shape=data.shape, dtype=data.dtype, chunks=data.shape, fill_value=0, attributes=attrs, dimension_names=dims if keep_dims else None
    )
    new[...] = data
    reconsolidate(store)


def copy_store(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def fifo_metadata(store: Path, node: str = "") -> Path:
    """Replace a ``zarr.json`` by a FIFO (a reader that opens it without care blocks forever)."""
    import os

    victim = store / node / "zarr.json" if node else store / "zarr.json"
    victim.unlink()
    os.mkfifo(victim)
    return victim


def device_metadata(store: Path, node: str, device: str = "/dev/zero") -> Path:
    """Replace a ``zarr.json`` by a link to a device that never ends."""
    victim = store / node / "zarr.json"
    victim.unlink()
    victim.symlink_to(device)
    return victim


def fifo_chunk(store: Path, array: str) -> Path:
    import os

    victim = chunk_files(store, array)[0]
    victim.unlink()
    os.mkfifo(victim)
    return victim


def huge_chunk(store: Path, array: str) -> Path:
    """A sparse chunk file far larger than any chunk of the array can be."""
    victim = chunk_files(store, array)[0]
    with open(victim, "r+b") as fh:
        fh.truncate(1 << 34)
    return victim


def foreign_group(store: Path, group: str, other_store: Path) -> None:
    """``group/`` copied in from another rig's store (replacing this store's own)."""
    shutil.rmtree(store / group)
    shutil.copytree(other_store / group, store / group)
    reconsolidate(store)


def stale_consolidated(store: Path) -> None:
    """Consolidate, then change a group's attributes without consolidating again."""
    import warnings

    import zarr

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        zarr.consolidate_metadata(str(store))
    edit_attr(store, "grid", ["build_options", "note"], "edited after consolidation", consolidate=False)


def remove_array(store: Path, array: str) -> None:
    """Delete ``group/name`` folder and all (no re-consolidation: callers decide)."""
    shutil.rmtree(store / array)
