"""The zarr (v3) store: the only module that touches zarr or the store's files.

Layout: ``<out>/<rig name>.zarr`` is a zarr v3 group whose root attributes describe the
store (``format``, ``tool_version``, ``name``, ``config``, ``config_sha256``,
``conventions``) and whose sub-groups (``grid``, ``gather``, ``delta``, ``matrix``, ...)
hold the products. Every array carries a ``sha256`` attribute: the SHA-256 of its
dtype, shape and C-order little-endian bytes (see :func:`array_sha256`).

Writes are atomic: a new store is built in a hidden temporary sibling
(``.<name>.zarr.tmp-*``) and swapped into place with one ``renameat2(RENAME_EXCHANGE)`` (Linux;
elsewhere the old store is moved aside, the new one renamed in), then the old copy is deleted —
a failure at any point leaves the earlier store as it was and no half-written store behind.
Groups of an existing store that the writer does not replace are carried over only when the
existing store was built from the same config (same ``config_sha256``); otherwise
``force=True`` is required and the old store is replaced as a whole.

One writer per store: :func:`write_groups` holds an exclusive ``flock`` on
``.<name>.zarr.lock`` beside the store (the OS releases it when the process dies) from reading
the existing store to the swap; a second writer waits for it (``BEVCOMPILE_LOCK_TIMEOUT``
seconds, default 600; 0 = fail at once) and then re-reads the store, so no write is lost or
mixed. A store path that is a symbolic link is written through: the store is rebuilt at the
link's target (and locked there), the link is kept. Every write consolidates the metadata
(``zarr.consolidate_metadata``) in the temporary copy under the lock, so the swap installs the
nodes and their consolidated copy together and xarray's default open reads it without warning.
Every group gets the coordinate arrays of its named axes (:mod:`.coords`).

Reading never lets a zarr/OS/codec exception escape: every failure is a one-line
:class:`~bevcompile.errors.StoreError` naming the store, the array and what is wrong.
Missing chunks are detected (zarr would silently return the fill value).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import math
import os
import re
import shutil
import stat
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import (
    BevcompileError,
    StoreConflictError,
    StoreError,
    StoreLockedError,
    UsageError,
    hash_pair,
    printable,
    shown,
)
from ..files import MAX_JSON_DEPTH, check_output_path, json_depth
from .coords import coordinate_arrays, is_coordinate

STORE_FORMAT = "bevcompile/1"
READABLE_FORMATS = ("bevcompile/1",)
STORE_SUFFIX = ".zarr"
CHUNK_TARGET_BYTES = 4 << 20
ZSTD_LEVEL = 3


@dataclass
class GroupData:
    """Arrays and attributes of one group to write.

    ``chunks`` may give an explicit chunk shape per array; the rest use :func:`default_chunks`.
    ``dims`` names every axis of every array (zarr v3 ``dimension_names``, what xarray reads):
    within a group one name is one length, e.g. ``grid/coords`` ``(camera, height, y, x, uv)``.
    """

    arrays: dict[str, np.ndarray]
    attrs: dict[str, Any] = field(default_factory=dict)
    chunks: dict[str, tuple[int, ...]] = field(default_factory=dict)
    dims: dict[str, tuple[str, ...]] = field(default_factory=dict)


@dataclass(frozen=True)
class ArrayInfo:
    group: str
    name: str
    shape: tuple[int, ...]
    dtype: str
    chunks: tuple[int, ...]
    nbytes: int
    nbytes_stored: int
    nchunks: int
    nchunks_initialized: int
    attrs: dict[str, Any]


@dataclass(frozen=True)
class WriteReport:
    path: Path
    replaced_existing: bool
    kept_groups: tuple[str, ...]
    bytes_per_array: dict[str, int]  # "group/name" -> bytes on disk
    dropped_groups: tuple[str, ...] = ()  # groups of a replaced store of ANOTHER config (--force) not rewritten
    consolidated: bool = False  # the existing store's consolidated metadata was rebuilt for the new one
    target: Path | None = None  # where the store really is when ``path`` is a symbolic link

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_per_array.values())


def store_path(out_dir: str | Path, name: str) -> Path:
    """``<out_dir>/<name>.zarr``."""
    return Path(out_dir) / f"{name}{STORE_SUFFIX}"


def _has_zarr_json(folder: Path) -> bool:
    try:
        return (folder / "zarr.json").is_file()
    except OSError:
        return False


STDIO = "-"
"""``-`` as a path: standard output (a file written by ``export-onnx`` / ``render``) or standard
input (a config); refused where a folder is needed (a store cannot be streamed)."""


def output_file(out: str | Path, option: str = "--out") -> Path | None:
    """Check, before any work, the file a command will write: None for ``-`` (standard output;
    refused when it is a terminal), else the path, whose folder must exist (no folder is
    created) and be writable. :class:`UsageError` / :class:`StoreError` (exit 2) naming ``out``."""
    import sys
    import tempfile

    if str(out) == STDIO:
        stream = sys.stdout
        if stream is None or getattr(stream, "buffer", None) is None:
            raise UsageError(f"{option} -: standard output is closed")
        if stream.isatty():
            raise UsageError(f"{option} -: refusing to write a binary file to a terminal; redirect it (> file) or give a file name")
        return None
    path = Path(out)
    if path.is_dir():
        raise UsageError(f"{option} {path} is a directory; give a file name such as {path / 'out'}")
    special = check_output_path(path)  # a device, FIFO or socket: the rename would replace it
    if special is not None:
        raise StoreError(f"{option} {path}: {special}")
    folder = path.parent
    if not folder.is_dir():
        raise StoreError(f"{option} {path}: its folder {folder} does not exist (no folder is created for a file)")
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=f".{path.name}.probe-", delete=True):
            pass
    except OSError as exc:
        raise StoreError(f"{option} {path}: cannot write ({_os_reason(exc)})") from None
    return path


def check_out_dir(out_dir: str | Path) -> None:
    """Refuse an output folder that is a zarr store (holds ``zarr.json``, or is named ``*.zarr``)
    or lies inside one: ``--out artifacts/nuscenes.zarr`` would write a store *into* the store,
    which then fails ``inspect``. :class:`UsageError` (exit 2), before anything is created.
    ``-`` is refused: a store is a folder, standard output cannot hold one."""
    if str(out_dir) == STDIO:
        raise UsageError("--out -: a store is a folder of files and cannot be written to standard output; give a folder")
    folder = Path(out_dir)
    try:
        os.stat(folder) if os.path.lexists(folder) else None
    except OSError as exc:
        if exc.errno == errno.ENAMETOOLONG:
            raise StoreError(f"--out {shown(str(folder), 80)}: path too long ({_os_reason(exc)})") from None
    try:
        absolute = os.fsencode(os.path.abspath(folder))
    except FileNotFoundError:  # os.getcwd(): the working folder was deleted
        raise StoreError(f"--out {shown(str(folder), 80)}: the current folder no longer exists; cd into an existing folder") from None
    if len(absolute) >= 4000:  # PATH_MAX 4096, with the store and its temporaries
        raise StoreError(
            f"--out {shown(str(folder), 80)}: path too long for the file system ({len(absolute):,} bytes as an absolute path, "
            "at most 3,999 with room for the store's name)"
        )
    if folder.name.endswith(STORE_SUFFIX) or _has_zarr_json(folder):
        raise UsageError(f"--out {folder} is a zarr store; --out takes the folder that holds stores")
    try:
        resolved = folder.resolve()
    except (OSError, RuntimeError):  # a link loop: the write reports it
        return
    if resolved.name.endswith(STORE_SUFFIX) or _has_zarr_json(resolved):
        raise UsageError(f"--out {folder} is a zarr store ({resolved}); --out takes the folder that holds stores")
    for parent in resolved.parents:
        if parent.name.endswith(STORE_SUFFIX) or _has_zarr_json(parent):
            raise UsageError(f"--out {folder} is inside the zarr store {parent}; --out takes the folder that holds stores")


def array_sha256(array: np.ndarray) -> str:
    """SHA-256 of ``dtype.str`` (little-endian), shape and C-order bytes of ``array``; of a string
    array (a coordinate's camera names), of ``"str"``, its shape and the JSON list of its strings
    (the same for the object array written and the string array zarr reads back)."""
    arr = np.ascontiguousarray(array)
    if arr.dtype.kind in "OUT":
        digest = hashlib.sha256(b"str")
        digest.update(json.dumps(list(arr.shape)).encode())
        digest.update(json.dumps([str(v) for v in arr.reshape(-1).tolist()]).encode())
        return digest.hexdigest()
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    digest = hashlib.sha256()
    digest.update(arr.dtype.str.encode())
    digest.update(json.dumps(list(arr.shape)).encode())
    digest.update(arr.tobytes())
    return digest.hexdigest()


def default_chunks(shape: tuple[int, ...], itemsize: int, target_bytes: int = CHUNK_TARGET_BYTES) -> tuple[int, ...]:
    """Chunk shape: whole array if it fits ``target_bytes``; else split leading axes first."""
    chunks = [max(1, int(s)) for s in shape]
    for axis in range(len(chunks)):
        rest = itemsize * math.prod(chunks[axis + 1 :])
        if rest * chunks[axis] <= target_bytes:
            break
        chunks[axis] = max(1, target_bytes // rest) if rest <= target_bytes else 1
    return tuple(chunks)


def _json_safe(value: Any, where: str) -> Any:
    """Reject NaN/inf and numpy scalars in attributes (they must be plain JSON)."""
    try:
        return json.loads(json.dumps(value, allow_nan=False, default=_to_builtin))
    except ValueError as exc:
        raise StoreError(f"attribute {where} is not finite JSON: {exc}") from None


def _to_builtin(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


# --------------------------------------------------------------------------------------
# writing
# --------------------------------------------------------------------------------------


def _dir_bytes(path: Path) -> int:
    """Bytes of the chunk files under ``path`` (links not followed; an entry that cannot be
    stat-ed, e.g. a dangling link, counts 0: reading the array reports it)."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            if name != "zarr.json":
                with contextlib.suppress(OSError):
                    total += os.lstat(os.path.join(root, name)).st_size
    return total


GROUP_CONFIG_ATTR = "config_sha256"
"""Group attribute the writer adds: the ``config_sha256`` of the config the group was built from
(the root's, when the group was written); inspect fails a group whose value is not the root's."""


def check_dimension_names(group_name: str, data: GroupData) -> None:
    """Every array has ``dims`` of its rank, and within the group one name has one length."""
    lengths: dict[str, tuple[int, str]] = {}
    for name, array in data.arrays.items():
        dims = data.dims.get(name)
        if dims is None or len(dims) != np.ndim(array):
            raise StoreError(f"{group_name}/{name}: dimension names {dims} do not name its {np.ndim(array)} axes")
        for dim, size in zip(dims, np.shape(array), strict=True):
            seen = lengths.setdefault(dim, (int(size), name))
            if seen[0] != size:
                raise StoreError(f"{group_name}/{name}: dimension {dim!r} has length {size}, {seen[0]} in {group_name}/{seen[1]}")


def _axis_lengths(data: GroupData) -> dict[str, int]:
    """Axis name -> length over the group's arrays (one length per name: check_dimension_names)."""
    out: dict[str, int] = {}
    for name, array in data.arrays.items():
        for dim, size in zip(data.dims.get(name, ()), np.shape(array), strict=False):
            out.setdefault(dim, int(size))
    return out


def _stored_rig(root_attrs: Mapping[str, Any]) -> Any:
    """The rig of the stored ``config`` (its coordinates), None when it does not parse."""
    from ..rig.config import parse_config

    try:
        return parse_config(dict(root_attrs["config"]), source="stored config")
    except Exception:
        return None


def _write_coordinates(group: Any, data: GroupData, coords: Mapping[str, np.ndarray]) -> None:
    """The group's coordinate arrays (:mod:`bevcompile.store.coords`): one chunk each, strings
    as zarr's ``string`` data type; a product array of the same name wins."""
    from zarr.codecs import ZstdCodec

    for name, values in coords.items():
        if name in data.arrays:
            continue
        text = values.dtype == object
        zarray = group.create_array(
            name,
            shape=values.shape,
            dtype=str if text else values.dtype,
            chunks=(max(1, values.shape[0]),),
            compressors=ZstdCodec(level=ZSTD_LEVEL, checksum=True),
            fill_value="" if text else 0,
            attributes={"sha256": array_sha256(values)},
            dimension_names=(name,),
            config={"write_empty_chunks": True},
        )
        if values.size:
            zarray[...] = values
        del zarray


def _write_group(root: Any, group_name: str, data: GroupData, coords: Mapping[str, np.ndarray] | None = None) -> dict[str, int]:
    from zarr.codecs import ZstdCodec

    check_dimension_names(group_name, data)
    group = root.create_group(group_name, overwrite=True)
    group.attrs.update(_json_safe(data.attrs, f"{group_name}/"))
    if coords:
        _write_coordinates(group, data, coords)
    sizes: dict[str, int] = {}
    for name, array in data.arrays.items():
        array = np.ascontiguousarray(array)
        if array.dtype.kind == "f" and not np.all(np.isfinite(array)):
            raise StoreError(f"refusing to write non-finite values into {group_name}/{name}")
        if array.dtype.kind not in "biuf":
            raise StoreError(f"unsupported dtype {array.dtype} for {group_name}/{name}")
        chunks = data.chunks.get(name) or default_chunks(array.shape, array.dtype.itemsize)
        zarray = group.create_array(
            name,
            shape=array.shape,
            dtype=array.dtype,
            chunks=tuple(min(max(1, c), max(1, s)) for c, s in zip(chunks, array.shape, strict=True)),
            compressors=ZstdCodec(level=ZSTD_LEVEL, checksum=True),
            fill_value=0,
            attributes={"sha256": array_sha256(array)},
            dimension_names=data.dims[name],
            config={"write_empty_chunks": True},
        )
        if array.size:
            zarray[...] = array
        del zarray
        sizes[f"{group_name}/{name}"] = 0
    return sizes


def resolve_store_link(path: str | Path) -> Path:
    """Where the store at ``path`` really is: ``path`` itself, or, for a symbolic link, its
    target (all links resolved). A store link is written through — the store is rebuilt at the
    target and the link kept — never replaced by a folder. :class:`StoreError` for a link that
    loops or whose target's folder does not exist."""
    path = Path(path)
    try:
        if not path.is_symlink():
            return path
        target = Path(os.path.realpath(path, strict=True)) if path.exists() else _dangling_target(path)
    except (OSError, RuntimeError) as exc:
        raise StoreError(f"{path}: a symbolic link that cannot be followed ({_os_reason(exc) if isinstance(exc, OSError) else 'a loop'}); remove it") from None
    if not target.parent.is_dir():
        raise StoreError(f"{path}: a symbolic link to {target}, whose folder {target.parent} does not exist; create it or remove the link")
    return target


def _dangling_target(path: Path) -> Path:
    """The path a dangling link ``path`` points to (its folder resolved), or OSError for a loop."""
    hops = 0
    while path.is_symlink():
        hops += 1
        if hops > 40:
            raise OSError(errno.ELOOP, "Too many levels of symbolic links", str(path))
        link = Path(os.readlink(path))
        path = link if link.is_absolute() else path.parent / link
    return Path(os.path.realpath(path.parent)) / path.name


def create_out_dir(folder: str | Path) -> None:
    """Create the output folder ``folder`` (one level: its parent must exist; no folder beyond
    what ``--out`` names is created). :class:`StoreError` naming the folder otherwise."""
    folder = Path(folder)
    try:
        if folder.is_dir():
            return
        if folder.is_symlink():
            raise StoreError(f"{folder}: a symbolic link to {os.readlink(folder)}, which is not a folder; create its target or remove the link")
        if os.path.lexists(folder):
            raise StoreError(f"{folder}: exists and is not a folder")
        if not folder.parent.is_dir():
            raise StoreError(f"{folder}: cannot create the output folder: its parent {folder.parent} does not exist")
        folder.mkdir()
    except FileExistsError:
        if not folder.is_dir():
            raise StoreError(f"{folder}: exists and is not a folder") from None
    except StoreError:
        raise
    except OSError as exc:
        raise StoreError(f"{folder}: cannot create output folder ({_os_reason(exc)})") from None


def check_replaceable(path: str | Path, new_sha: str, *, force: bool = False) -> bool:
    """Whether a write of config ``new_sha`` may go to ``path``; True if an existing store of the
    same config is there (its other groups are kept), False if there is nothing to keep.

    Raises :class:`StoreConflictError` (unless ``force``) for a store of another config, a zarr
    store that is not a bevcompile store, or a directory that is not a readable store;
    :class:`StoreError` for a path that exists and is not a directory; :class:`UsageError` for a
    folder that is itself (inside) a zarr store (see :func:`check_out_dir`). Cheap: the builders call
    it before any work so that a refusal costs nothing, and :func:`write_groups` again under the
    store's lock. A symbolic link is judged by its target (see :func:`resolve_store_link`).
    """
    path = Path(path)
    check_out_dir(path.parent)
    path = resolve_store_link(path)
    if path.parent.is_dir():
        try:
            with store_lock(path, timeout=0):
                recover_interrupted_writes(path)  # a store a killed writer left moved aside is judged, not missed
        except StoreLockedError:
            pass  # a writer is at work: it recovers; write_groups judges again under the lock
    return _judge_existing(path, new_sha, force)


def _judge_existing(path: Path, new_sha: str, force: bool) -> bool:
    if not os.path.lexists(path):
        return False
    if not path.is_dir():
        raise StoreError(f"{path}: exists and is not a directory")
    try:
        old_sha = open_store(path).root_attrs.get("config_sha256")
    except StoreError as exc:
        if not force:
            raise StoreConflictError(f"{path}: exists but is not a readable bevcompile store ({exc}); pass --force to replace it") from None
        return False
    if old_sha == new_sha:
        unsafe = check_regular_files(path, 1 << 62)  # its groups are copied: a FIFO would block the copy
        if unsafe is not None:
            if force:
                return False
            raise StoreConflictError(f"{path}: exists but is damaged ({unsafe}); pass --force to replace it")
        return True
    if force:
        return False
    if not isinstance(old_sha, str):
        raise StoreConflictError(f"{path}: exists but is not a bevcompile store (no config_sha256 in its root attributes); pass --force to replace it")
    raise StoreConflictError(
        f"{path}: was built from a different config (config_sha256 {', new '.join(hash_pair(old_sha, new_sha))}); pass --force to replace it"
    )


GROUPS_ATTR = "groups"
"""Root attribute: the sorted names of the store's groups, rewritten by every write."""
TMP_MARK = ".tmp-"
OLD_MARK = ".old-"
LOCK_MARK = ".lock"
"""``.<name>.zarr.lock`` beside the store: the writers' lock file (removed by the holder on release)."""
LOCK_TIMEOUT_ENV = "BEVCOMPILE_LOCK_TIMEOUT"
DEFAULT_LOCK_TIMEOUT_S = 600.0
"""How long a second writer waits for the store's lock (``BEVCOMPILE_LOCK_TIMEOUT`` overrides; 0 = fail at once)."""
LOCK_POLL_S = 0.05
STORE_WRITTEN_ATTR = "bevcompile_store_written"
"""Set on an interrupt (KeyboardInterrupt, SIGTERM) that arrived after the new store was in
place (while the old copy was being deleted): the CLI then says the store was written."""
COMPLETED_WRITES: list[str] = []
"""Stores this process has put in place, in order: an interrupt after a write (while the
command summarises, or writes its next store) is then reported as "already written"."""
LOCK_WAIT_REPORTERS: list[Callable[[str], None]] = []
"""Called once with a one-line message when a writer starts waiting for another's lock (the
CLI prints it on stderr; the library alone stays silent)."""
_HELD = threading.local()
"""The store locks this thread holds (re-entrant per thread; another thread waits like another process)."""


def _held_locks() -> set[str]:
    held = getattr(_HELD, "locks", None)
    if held is None:
        held = _HELD.locks = set()
    return held


def _host_tag() -> str:
    """This host's name, safe in a file name: the sweep of killed writers' leftovers only judges
    entries of its own host (a pid means nothing on another machine or container)."""
    import socket

    return "".join(ch if ch.isalnum() or ch in "._" else "_" for ch in socket.gethostname())[:64] or "host"


def _writer_tag() -> str:
    """``<pid>-<host>`` of this writer, in the names of its temporaries."""
    return f"{os.getpid()}-{_host_tag()}"


def _parse_writer(rest: str) -> tuple[int, str] | None:
    """``(pid, host)`` of a temporary's name tail ``<pid>-<host>-<rand>``; None if not ours to judge."""
    parts = rest.split("-")
    if len(parts) < 3 or not parts[0].isdigit():
        return None
    return int(parts[0]), "-".join(parts[1:-1])


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True  # exists (another user's) or cannot tell: leave its files alone
    return True


def lock_path(path: str | Path) -> Path:
    """``<folder>/.<name>.zarr.lock``: the lock file of the store at ``path``."""
    path = Path(path)
    return path.parent / f".{path.name}{LOCK_MARK}"


def lock_timeout() -> float:
    """Seconds a writer waits for another's lock: ``BEVCOMPILE_LOCK_TIMEOUT`` or 600."""
    raw = os.environ.get(LOCK_TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_LOCK_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise UsageError(f"{LOCK_TIMEOUT_ENV}={shown(raw)}: expected seconds to wait for another writer's lock (a number >= 0)")
    return value


def _holder_record() -> bytes:
    import sys

    argv = [Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "python", *sys.argv[1:2]]
    since = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    return json.dumps({"pid": os.getpid(), "host": _host_tag(), "command": " ".join(argv)[:80], "since": since}).encode()


def describe_holder(lock: str | Path) -> str:
    """``pid 123 on host (bevcompile matrix, since 2026-05-01 12:00:01 UTC)`` from a lock file."""
    try:
        fd = os.open(lock, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return "another process"
    try:
        return _holder_text(os.pread(fd, 4096, 0))
    finally:
        os.close(fd)


def _holder_text(raw: bytes) -> str:
    try:
        info = json.loads(raw)
        pid, host, command, since = int(info["pid"]), str(info["host"]), str(info["command"]), str(info["since"])
    except (ValueError, TypeError, KeyError, RecursionError):
        return "another process"
    return printable(f"pid {pid} on {host} ({command}, since {since})", 160)


@contextlib.contextmanager
def store_lock(path: str | Path, *, timeout: float | None = None) -> Iterator[None]:
    """Hold the exclusive write lock of the store at ``path`` for the block.

    An ``flock`` on :func:`lock_path` (released by the OS when the process dies, so a killed
    writer never leaves a stale lock); a second writer waits ``timeout`` seconds (default
    :func:`lock_timeout`), telling :data:`LOCK_WAIT_REPORTERS` once, then raises
    :class:`StoreLockedError` naming the holder. Re-entrant within a process. The holder removes
    the file on release (a waiter that locked the removed file retries on the new one).
    """
    import fcntl

    path = Path(path)
    key = os.path.abspath(path)
    if key in _held_locks():
        yield
        return
    lock = lock_path(path)
    wait = lock_timeout() if timeout is None else timeout
    started = time.monotonic()
    reported = False
    while True:
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0), 0o644)
        except OSError as exc:
            raise StoreError(f"{path.parent}: cannot write store ({_os_reason(exc)})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder_text(os.pread(fd, 4096, 0))
            os.close(fd)
            waited = time.monotonic() - started
            if waited >= wait:
                how_long = f"; waited {waited:.0f} s ({LOCK_TIMEOUT_ENV})" if wait else f" (waiting disabled: {LOCK_TIMEOUT_ENV}=0)"
                raise StoreLockedError(f"{path}: is being written by {holder}{how_long}; try again when it is done") from None
            if not reported:
                reported = True
                for report in LOCK_WAIT_REPORTERS:
                    report(f"waiting for {path}: it is being written by {holder} (up to {wait:.0f} s)")
            time.sleep(LOCK_POLL_S)
            continue
        except OSError as exc:  # ENOLCK: a filesystem without locks
            os.close(fd)
            raise StoreError(f"{lock}: cannot lock the store for writing ({_os_reason(exc)})") from None
        try:  # the previous holder may have removed the file we opened: lock the one in place
            here, ours = os.stat(lock, follow_symlinks=False), os.fstat(fd)
            current = (here.st_dev, here.st_ino) == (ours.st_dev, ours.st_ino)
        except OSError:
            current = False
        if current:
            break
        os.close(fd)
    _held_locks().add(key)
    try:
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
            os.pwrite(fd, _holder_record(), 0)
        yield
    finally:
        _held_locks().discard(key)
        with contextlib.suppress(OSError):
            os.unlink(lock)
        os.close(fd)


def recover_interrupted_writes(path: str | Path) -> list[Path]:
    """Clean up after writers of ``path`` that were killed (SIGKILL, power loss) mid-write.

    A writer builds ``.<name>.tmp-<pid>-<host>-<rand>`` beside the store and swaps it in (through
    ``.<name>.old-<pid>-<host>-<rand>`` where the OS cannot exchange two folders). For a writer of
    this host whose process no longer exists: its temporary is deleted; its ``.old-`` copy is
    renamed back to ``<name>`` if the kill fell between the two renames (no store at ``path``),
    else deleted (a symbolic link, left by versions that moved a store link aside, is unlinked).
    Files of live processes, and of other hosts (a shared folder), are left alone. Call it holding
    the store's lock (:func:`store_lock`). Returns the paths removed or restored.
    """
    path = Path(path)
    touched: list[Path] = []
    if not path.parent.is_dir():
        return touched
    prefix = f".{path.name}"
    host = _host_tag()
    try:
        siblings = sorted(path.parent.iterdir())
    except OSError:
        return touched  # unreadable folder: the write itself reports it
    for sibling in siblings:
        name = sibling.name
        if not name.startswith(prefix):
            continue
        rest = name[len(prefix) :]
        mark = TMP_MARK if rest.startswith(TMP_MARK) else OLD_MARK if rest.startswith(OLD_MARK) else None
        if mark is None:
            continue
        writer = _parse_writer(rest[len(mark) :])
        if writer is None or writer[1] != host or _pid_alive(writer[0]):
            continue
        if mark == OLD_MARK and not os.path.lexists(path):
            try:
                os.rename(sibling, path)
            except OSError:
                continue  # read-only folder: left for a later write; this one reports the folder
        elif sibling.is_symlink():
            with contextlib.suppress(OSError):
                sibling.unlink()
        else:
            shutil.rmtree(sibling, ignore_errors=True)
        touched.append(sibling)
    return touched


def _is_consolidated(path: Path) -> bool:
    """Whether the store's root ``zarr.json`` carries consolidated metadata."""
    try:
        meta = json.loads(read_metadata_file(path / "zarr.json"))
    except (StoreError, ValueError):
        return False
    return isinstance(meta, dict) and meta.get("consolidated_metadata") is not None


def write_groups(
    path: str | Path,
    *,
    root_attrs: Mapping[str, Any],
    groups: Mapping[str, GroupData],
    force: bool = False,
    replace_groups: Iterable[str] = (),
) -> WriteReport:
    """Atomically create or update the store at ``path``.

    ``root_attrs`` must hold ``config_sha256``. Groups in ``groups`` and in
    ``replace_groups`` are (re)written/removed; other groups of an existing store with the
    same ``config_sha256`` are kept. An existing store of another config (or an unreadable
    one) is replaced only with ``force=True``; otherwise :class:`StoreConflictError`. The
    store's lock is held from judging the existing store to the swap (:func:`store_lock`);
    its output folder is created (one level), a store link is written through, consolidated
    metadata is rebuilt (see the module docstring).
    """
    import zarr

    link = Path(path)
    new_sha = root_attrs.get("config_sha256")
    if not isinstance(new_sha, str):
        raise StoreError("root_attrs must include config_sha256")
    check_out_dir(link.parent)
    create_out_dir(link.parent)
    path = resolve_store_link(link)
    parent = path.parent
    with store_lock(path):
        carry_over = check_replaceable(path, new_sha, force=force)  # also recovers killed writers' leftovers
        existed = os.path.lexists(path)
        dropped = () if carry_over or not existed else tuple(g for g in _group_names(path) if g not in groups)
        consolidate = existed and _is_consolidated(path)  # reported: a user's consolidated copy was rebuilt
        rig = _stored_rig(root_attrs)
        tmp = parent / f".{path.name}{TMP_MARK}{_writer_tag()}-{uuid.uuid4().hex[:8]}"
        sizes: dict[str, int] = {}
        kept: list[str] = []
        try:
            if carry_over:
                shutil.copytree(path, tmp)
                # the stored per-node metadata, never a consolidated copy of it (which may be stale)
                root = zarr.open_group(str(tmp), mode="r+", zarr_format=3, use_consolidated=False)
                for name in sorted(set(groups) | set(replace_groups)):
                    if name in root:
                        del root[name]
                kept = sorted(k for k in root.group_keys())
                root.attrs.clear()
                root.attrs.update(_json_safe(dict(root_attrs), "root"))
            else:
                root = zarr.open_group(str(tmp), mode="w-", zarr_format=3)
                root.attrs.update(_json_safe(dict(root_attrs), "root"))
            for name, data in groups.items():
                stamped = GroupData(data.arrays, {**data.attrs, GROUP_CONFIG_ATTR: new_sha}, data.chunks, data.dims)
                coords = coordinate_arrays(rig, _axis_lengths(stamped), name) if rig is not None else {}
                sizes.update(_write_group(root, name, stamped, coords))
            root.attrs[GROUPS_ATTR] = sorted(root.group_keys())  # inspect fails a store that lost one
            del root
            # every store carries consolidated metadata (xarray's default open reads it, silently), built in
            # the temporary copy under the lock, so it is swapped in with the nodes it describes
            import warnings

            with warnings.catch_warnings():  # "not part of the v3 specification": the readers we serve use it
                warnings.simplefilter("ignore")
                zarr.consolidate_metadata(str(tmp))
            for key in sizes:
                sizes[key] = _dir_bytes(tmp / key)
            _swap_into_place(tmp, path, str(link))
        except BaseException as exc:
            if getattr(exc, STORE_WRITTEN_ATTR, None):  # the new store is in place: an interrupt after the swap
                setattr(exc, STORE_WRITTEN_ATTR, str(link))
                raise
            _remove_temporary(tmp)
            if isinstance(exc, OSError) and not isinstance(exc, BevcompileError):
                raise StoreError(f"{parent}: cannot write store ({_os_reason(exc)})") from None
            raise
    return WriteReport(link, existed, tuple(kept), sizes, dropped_groups=dropped, consolidated=consolidate, target=path if path != link else None)


def _group_names(path: Path) -> list[str]:
    """The groups of the store at ``path`` that a forced replacement drops (its folders holding a
    ``zarr.json``, so a store with an unreadable root is listed too)."""
    try:
        return sorted(p.name for p in path.iterdir() if p.is_dir() and (p / "zarr.json").is_file())
    except OSError:
        return []


def staging_folder(path: str | Path) -> Path:
    """A new, empty folder beside the store ``path`` to build a whole store in (with the usual
    writers, as ``<folder>/<name>.zarr``) before :func:`install_store` puts it in place at once.

    It is named like a writer's temporary (``.<name>.zarr.tmp-<pid>-<host>-<rand>``), so that if
    this process is killed the next write of ``path`` removes it (:func:`recover_interrupted_writes`).
    ``StoreError`` if the output folder cannot be created; ``UsageError`` if it is (in) a store.
    """
    path = Path(path)
    parent = path.parent
    check_out_dir(parent)
    try:
        parent.mkdir(parents=True, exist_ok=True)  # the fleet's own folder layout (out/<vehicle>/)
        recover_interrupted_writes(path)
        folder = parent / f".{path.name}{TMP_MARK}{_writer_tag()}-{uuid.uuid4().hex[:8]}"
        folder.mkdir()
    except OSError as exc:
        raise StoreError(f"{parent}: cannot create a folder to build {path.name} in ({_os_reason(exc)})") from None
    return folder


def install_store(built: str | Path, path: str | Path) -> None:
    """Put the complete store ``built`` (made in a :func:`staging_folder` of ``path``, so on the same
    file system) in place at ``path``, replacing the store that is there whatever its config: the
    old store is moved aside, the new one renamed in (Ctrl-C / SIGTERM held between the two renames)
    and the old one deleted, so ``path`` always holds one whole store. ``StoreError`` if ``path``
    exists and is not a store (a file, or a folder without ``zarr.json``): it is never replaced."""
    built, path = Path(built), Path(path)
    with store_lock(path):  # one writer per store, as write_groups
        recover_interrupted_writes(path)
        if os.path.lexists(path) and not is_store(path):
            raise StoreError(f"{path}: exists and is not a store; it is not replaced (remove it, or choose another folder)")
        try:
            _swap_into_place(built, path, str(path))
        except BaseException as exc:
            if getattr(exc, STORE_WRITTEN_ATTR, None):
                raise
            if isinstance(exc, OSError) and not isinstance(exc, BevcompileError):
                raise StoreError(f"{path}: cannot put the new store in place ({_os_reason(exc)})") from None
            raise


def remove_folder(folder: str | Path) -> None:
    """Remove a :func:`staging_folder` (whatever a failed or cancelled build left in it)."""
    shutil.rmtree(folder, ignore_errors=True)


def _os_reason(exc: OSError) -> str:
    """``Read-only file system``: the strerror of an OSError (of the first failure of a
    ``shutil.copytree``), else its first line."""
    if isinstance(exc, shutil.Error) and exc.args and isinstance(exc.args[0], list) and exc.args[0]:
        first = exc.args[0][0]
        if not (isinstance(first, tuple) and first):
            return _one_line(exc)
        why = str(first[-1]).splitlines()[0]
        # copytree records str(OSError): "[Errno 28] No space left on device: 'src' -> 'dst'"
        matched = re.match(r"\[Errno \d+\] ([^:]+)", why)
        return matched.group(1) if matched else why
    if exc.strerror:
        return str(exc.strerror)
    return _one_line(exc)


TMP_SETTLE_SECONDS = 0.2
"""Quiet time the temporary must stay gone after an interrupted write before the writer leaves."""
TMP_CLEANUP_TIMEOUT = 10.0


def _cancel_zarr_io(timeout: float) -> None:
    """Cancel the chunk writes zarr still runs on its I/O thread after the main thread was
    interrupted (Ctrl-C, SIGTERM, a failed chunk of a batch), and wait until they have stopped:
    otherwise they re-create folders under the temporary while it is being removed. A writer
    process owns zarr's I/O loop for the duration of its write."""
    import asyncio

    try:
        from zarr.core import sync as zarr_sync
    except ImportError:  # pragma: no cover - other zarr layouts
        return
    loop = getattr(zarr_sync, "loop", [None])[0]
    if loop is None or loop.is_closed() or not loop.is_running():
        return

    async def cancel_pending() -> None:
        current = asyncio.current_task()
        pending = [task for task in asyncio.all_tasks() if task is not current and not task.done()]
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending, timeout=timeout)

    with contextlib.suppress(Exception):
        asyncio.run_coroutine_threadsafe(cancel_pending(), loop).result(timeout + 1)


def _remove_temporary(tmp: Path) -> None:
    """Remove a failed write's temporary for good: zarr's pending writes are cancelled first,
    then the folder is removed until it stays gone for :data:`TMP_SETTLE_SECONDS` (a chunk
    write already inside a worker thread may re-create it once)."""
    import time

    _cancel_zarr_io(TMP_CLEANUP_TIMEOUT / 2)
    deadline = time.monotonic() + TMP_CLEANUP_TIMEOUT
    while True:
        shutil.rmtree(tmp, ignore_errors=True)
        time.sleep(TMP_SETTLE_SECONDS)
        if not os.path.lexists(tmp) or time.monotonic() > deadline:
            return


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _exchange(a: Path, b: Path) -> bool:
    """Exchange ``a`` and ``b`` atomically (Linux ``renameat2(RENAME_EXCHANGE)``): at every
    instant each name holds a complete tree. False where the OS or filesystem cannot."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _swap_into_place(tmp: Path, path: Path, record: str) -> None:
    """Put ``tmp`` at ``path``. An existing store is exchanged with it in one step (so a reader
    always finds a complete store at ``path``), or, where the OS cannot exchange, moved aside
    first; the old copy is deleted after. Ctrl-C / SIGTERM are held back during the swap, and the
    write is recorded (``record`` appended to :data:`COMPLETED_WRITES`) before they are let
    through: a signal that was waiting, or one that arrives while the old copy is deleted, is
    re-raised marked :data:`STORE_WRITTEN_ATTR` (the new store is complete; the next write removes
    the rest), and a failure to delete the old copy is no failure of the write."""
    old: Path | None = None
    done = False
    try:
        with _signals_held():
            if not os.path.lexists(path):
                os.rename(tmp, path)
            else:
                old = path.parent / f".{path.name}{OLD_MARK}{_writer_tag()}-{uuid.uuid4().hex[:8]}"
                if _exchange(tmp, path):  # tmp now holds the previous store: name it as the old copy
                    try:
                        os.rename(tmp, old)
                    except OSError:
                        old = tmp
                else:
                    os.rename(path, old)
                    try:
                        os.rename(tmp, path)
                    except BaseException:
                        os.rename(old, path)
                        raise
            COMPLETED_WRITES.append(record)
            done = True
    except BaseException as exc:
        if done:  # a signal that waited for the mask to lift: the new store is in place
            setattr(exc, STORE_WRITTEN_ATTR, record)
        raise
    if old is None:
        return
    try:
        shutil.rmtree(old, ignore_errors=True)
    except OSError:  # the new store is in place; a leftover old copy is removed by the next write
        pass
    except BaseException as exc:
        setattr(exc, STORE_WRITTEN_ATTR, record)
        raise


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """Hold SIGINT and SIGTERM back for the block and deliver them right after it.

    A signal mask is per thread, and a process-directed signal goes to any thread that does not
    block it (zarr's I/O thread): Python then runs the handler in the main thread at once, mask
    or not. So in the main thread the handlers themselves are swapped for one that only records
    the signal, and the recorded one is handed to the previous handler when the block ends;
    elsewhere (no handlers can be set) the thread's mask is used."""
    import signal

    held = (signal.SIGINT, signal.SIGTERM)
    if threading.current_thread() is not threading.main_thread():
        try:
            previous_mask = signal.pthread_sigmask(signal.SIG_BLOCK, set(held))
        except (AttributeError, ValueError, OSError):  # no POSIX signal masks here
            yield
            return
        try:
            yield
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous_mask)
        return
    pending: list[int] = []
    previous = {int(sig): signal.getsignal(sig) for sig in held}
    swapped = {sig: handler for sig, handler in previous.items() if handler is not None}  # None: not set from Python
    for sig in swapped:
        signal.signal(sig, lambda signum, frame: pending.append(signum))
    try:
        yield
    finally:
        for sig, handler in swapped.items():
            signal.signal(sig, handler)
        if pending:
            handler = swapped[pending[0]]
            if callable(handler):
                handler(pending[0], None)  # raises KeyboardInterrupt / the CLI's Terminated
            elif handler == signal.SIG_DFL:
                os.kill(os.getpid(), pending[0])


# --------------------------------------------------------------------------------------
# reading
# --------------------------------------------------------------------------------------


def is_store(path: str | Path) -> bool:
    """True if ``path`` is a directory with a zarr v3 group ``zarr.json`` at its root (False,
    not an exception, where permissions hide it: :class:`StoreReader` then says why)."""
    path = Path(path)
    try:
        return path.is_dir() and (path / "zarr.json").is_file()
    except OSError:
        return False


def find_stores(folder: str | Path) -> list[Path]:
    """Stores directly inside ``folder`` (``*.zarr``, hidden temporaries skipped), sorted.
    A ``*.zarr`` entry this user cannot even stat is listed (reading it then fails clearly)."""
    folder = Path(folder)
    try:
        entries = sorted(folder.iterdir())
    except OSError as exc:
        raise StoreError(f"{folder}: cannot list the folder ({_os_reason(exc)})") from None
    out = []
    for entry in entries:
        if entry.suffix != STORE_SUFFIX or entry.name.startswith("."):
            continue
        try:
            if not entry.is_dir():
                continue
        except OSError:
            pass
        out.append(entry)
    return out


MAX_METADATA_BYTES = 64 << 20
"""A ``zarr.json`` larger than this is refused unread (a store's largest, the consolidated root of
a many-camera rig, is a few MiB)."""
CHUNK_FILE_SLACK_BYTES = 1 << 16
"""A chunk file may exceed its chunk's raw size by the codec's worst-case overhead: zstd adds at
most ~1/128 plus a header; a file beyond ``2 x raw + 64 KiB`` is no chunk of this array."""


def _file_kind(mode: int) -> str:
    for test, kind in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory")):
        if test(mode):
            return kind
    return "not a regular file"


def read_metadata_file(path: str | Path, limit: int = MAX_METADATA_BYTES) -> bytes:
    """The bytes of a store's metadata file, read only when it is a regular file (links
    followed) of at most ``limit`` bytes: a FIFO would block the reader forever, a link to
    ``/dev/zero`` never end; and JSON nested at most :data:`bevcompile.files.MAX_JSON_DEPTH`
    levels (checked without parsing: every reader, zarr's included, parses it after this).
    :class:`StoreError` otherwise (``FileNotFoundError`` kept as the cause for a missing file)."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise StoreError(f"{path}: missing") from FileNotFoundError(str(path))
    except OSError as exc:
        raise StoreError(f"{path}: cannot read ({_os_reason(exc)})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise StoreError(f"{path}: {_file_kind(info.st_mode)}, not a regular file")
        if info.st_size > limit:
            raise StoreError(f"{path}: {info.st_size:,} bytes, more than the {limit >> 20} MiB a metadata file may have")
        chunks = []
        total = 0
        while total <= limit:
            block = os.read(fd, min(1 << 20, limit + 1 - total))
            if not block:
                break
            chunks.append(block)
            total += len(block)
        if total > limit:
            raise StoreError(f"{path}: more than the {limit >> 20} MiB a metadata file may have")
        raw = b"".join(chunks)
        depth = json_depth(raw)  # before any parser sees it: 200,000 '[' would exhaust the recursion limit
        if depth > MAX_JSON_DEPTH:
            raise StoreError(f"{path}: JSON nested {depth:,} levels deep, more than {MAX_JSON_DEPTH}")
        return raw
    except StoreError:
        raise
    except OSError as exc:
        raise StoreError(f"{path}: cannot read ({_os_reason(exc)})") from None
    finally:
        os.close(fd)


def check_regular_files(folder: str | Path, max_file_bytes: int, *, limit_entries: int = 1_000_000) -> str | None:
    """Why the files under ``folder`` cannot be read safely, or None: every entry must be a
    folder or a regular file (links followed) of at most ``max_file_bytes``. Checked before zarr
    reads a chunk: it would block on a FIFO and read a device without end."""
    seen = 0
    for root, dirs, files in os.walk(folder, followlinks=False):
        for name in [*dirs, *files]:
            seen += 1
            if seen > limit_entries:
                return f"more than {limit_entries:,} entries"
            full = os.path.join(root, name)
            try:
                info = os.stat(full)
            except OSError as exc:
                if exc.errno in (errno.ENOENT, errno.ELOOP):
                    continue  # a dangling or looping link: zarr counts it as a missing chunk
                return f"{os.path.relpath(full, folder)}: cannot be read ({_os_reason(exc)})"
            if stat.S_ISDIR(info.st_mode):
                continue
            if not stat.S_ISREG(info.st_mode):
                return f"{os.path.relpath(full, folder)}: {_file_kind(info.st_mode)}, not a regular file"
            if info.st_size > max_file_bytes:
                return f"{os.path.relpath(full, folder)}: {info.st_size:,} bytes, more than a chunk of this array can be ({max_file_bytes:,})"
    return None


def the_one_store(path: str | Path, command: str) -> Path:
    """``path`` if it is a store (or named ``*.zarr``); for a folder that holds exactly one
    ``<name>.zarr`` store, that store (as ``inspect`` accepts folders). :class:`StoreError` for a
    folder holding none or several, ``-`` (a store is a folder, not a stream)."""
    path = Path(path)
    if str(path) == STDIO:
        raise StoreError(f"-: {command} reads a store, which is a folder; standard input cannot hold one")
    try:
        if not path.is_dir() or is_store(path) or path.suffix == STORE_SUFFIX:
            return path
    except OSError:
        return path  # the reader says why
    found = find_stores(path)
    if len(found) == 1:
        return found[0]
    if not found:
        raise StoreError(f"{path}: not a store, and holds no <name>{STORE_SUFFIX} store")
    names = ", ".join(p.name for p in found[:5]) + (", …" if len(found) > 5 else "")
    raise StoreError(f"{path}: holds {len(found)} stores ({names}); {command} one of them")


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    return f"{exc.__class__.__name__}: {first}" if first else exc.__class__.__name__


class StoreReader:
    """Read-only access to a store. Every method raises :class:`StoreError` (never a zarr
    or codec exception) with a one-line message naming the store and the array."""

    def __init__(self, path: str | Path) -> None:
        import zarr

        self.path = Path(path)
        try:
            if not self.path.exists():
                raise StoreError(f"{self.path}: no such store")
            if not self.path.is_dir():
                raise StoreError(f"{self.path}: not a store (not a directory)")
            os.lstat(self.path / "zarr.json")  # EACCES is an error here, not "no zarr.json"
        except FileNotFoundError:
            raise StoreError(f"{self.path}: not a zarr store (no zarr.json at its root)") from None
        except StoreError:
            raise
        except OSError as exc:  # Path.is_file() raises EACCES instead of returning False
            raise StoreError(f"{self.path}: cannot read the store ({_os_reason(exc)})") from None
        try:  # a regular file of sane size, before zarr reads it
            read_metadata_file(self.path / "zarr.json")
        except StoreError as exc:
            raise StoreError(f"{self.path}: root metadata unreadable ({_strip_path(str(exc), self.path / 'zarr.json')})") from None
        try:
            # the per-node metadata, never the consolidated copy (stale after a hand edit; inspect compares them)
            self._root = zarr.open_group(str(self.path), mode="r", zarr_format=3, use_consolidated=False)
            attrs = dict(self._root.attrs)
        except Exception as exc:
            raise StoreError(f"{self.path}: root metadata unreadable ({_one_line(exc)})") from None
        self.root_attrs: dict[str, Any] = attrs

    # -- structure ---------------------------------------------------------------------

    def groups(self) -> list[str]:
        """Sub-group names, sorted (groups whose metadata is unreadable are skipped; see
        :meth:`damaged_nodes`)."""
        out = []
        for entry in sorted(p.name for p in self.path.iterdir() if p.is_dir()):
            try:
                self._group(entry)
            except StoreError:
                continue
            out.append(entry)
        return out

    def damaged_nodes(self) -> list[str]:
        """Sub-directories (groups, arrays) whose ``zarr.json`` is missing or unreadable."""
        bad: list[str] = []
        for group_dir in sorted(p for p in self.path.iterdir() if p.is_dir()):
            try:
                group = self._group(group_dir.name)
            except StoreError:
                bad.append(group_dir.name)
                continue
            del group
            known = set(self.arrays(group_dir.name))
            for array_dir in sorted(p for p in group_dir.iterdir() if p.is_dir()):
                if array_dir.name not in known:
                    bad.append(f"{group_dir.name}/{array_dir.name}")
        return bad

    def child_dirs(self, group: str | None = None) -> list[str]:
        """Names of the sub-folders of the root (or of ``group``), sorted, hidden ones skipped:
        the nodes that *should* exist, whether or not their metadata is readable. Unlike
        :meth:`groups`/:meth:`arrays` this never parses metadata, so one corrupt ``zarr.json``
        cannot hide its healthy siblings. An unlistable folder raises :class:`StoreError`."""
        base = self.path if group is None else self.path / group
        try:
            return sorted(p.name for p in base.iterdir() if p.is_dir() and not p.name.startswith("."))
        except OSError as exc:
            raise StoreError(f"{self.path}: cannot list {group + '/' if group else 'the store root'} ({_one_line(exc)})") from None

    def stray_entries(self, group: str | None = None) -> list[str]:
        """Entries of the root (or of ``group``) that should be folders but are not: files other
        than ``zarr.json``, broken or looping links. Hidden names are skipped."""
        base = self.path if group is None else self.path / group
        try:
            return sorted(p.name for p in base.iterdir() if not p.name.startswith(".") and p.name != "zarr.json" and not p.is_dir())
        except OSError:
            return []  # child_dirs reports an unlistable folder

    def foreign_entries(self, group: str, name: str, shape: tuple[int, ...], chunks: tuple[int, ...]) -> list[str]:
        """Entries of an array folder that no chunk of this array can be: anything but
        ``zarr.json`` and ``c/`` beside them, and under ``c/`` any path that is not a chunk key
        ``c/i/j/...`` inside the chunk grid (zarr v3 default encoding, ``/`` separator).
        Hidden names are skipped; at most 10 are listed."""
        base = self.path / group / name
        grid = [-(-size // max(chunk, 1)) for size, chunk in zip(shape, chunks, strict=False)]
        out: list[str] = []
        try:
            out.extend(p.name for p in sorted(base.iterdir()) if not p.name.startswith(".") and p.name not in ("zarr.json", "c"))
            chunk_root = base / "c"
            if len(grid) and chunk_root.is_dir():
                for folder, dirs, files in os.walk(chunk_root):
                    rel = Path(folder).relative_to(chunk_root).parts
                    depth = len(rel)
                    for entry in sorted(dirs) + sorted(files):
                        if entry.startswith("."):
                            continue
                        key = (*rel, entry)
                        is_dir = entry in dirs
                        ok = entry.isdecimal() and int(entry) < grid[depth] and (depth < len(grid) - 1 if is_dir else depth == len(grid) - 1)
                        if not ok:
                            out.append("c/" + "/".join(key) + ("/" if is_dir else ""))
                    dirs[:] = [d for d in dirs if d.isdecimal() and depth < len(grid) - 1 and int(d) < grid[depth]]
                    if len(out) >= 10:
                        break
        except OSError:
            return out  # unreadable folders are reported by the read itself
        return out[:10]

    def consolidated_problems(self) -> list[str] | None:
        """None when the root carries no consolidated metadata; else what in it disagrees with
        the per-node metadata (nodes it lists that are gone or differ, nodes it misses): the view
        readers of the consolidated metadata (xarray's default) would get. At most 10 listed."""
        try:
            meta = json.loads(read_metadata_file(self.path / "zarr.json"))
        except (StoreError, ValueError):
            return None
        consolidated = meta.get("consolidated_metadata") if isinstance(meta, dict) else None
        if consolidated is None:
            return None
        listed = consolidated.get("metadata") if isinstance(consolidated, dict) else None
        if not isinstance(listed, dict):
            return ["consolidated_metadata holds no 'metadata' mapping"]
        actual: dict[str, Any] = {}
        for group in self.child_dirs():
            for key in [group, *(f"{group}/{name}" for name in self.child_dirs(group))]:
                try:
                    actual[key] = json.loads(read_metadata_file(self.path / key / "zarr.json"))
                except (StoreError, ValueError):
                    actual[key] = None
        problems = [f"{key} is listed but gone" for key in sorted(set(listed) - set(actual))]
        problems += [f"{key} is not listed" for key in sorted(set(actual) - set(listed))]
        for key in sorted(set(listed) & set(actual)):
            entry, node = listed[key], actual[key]
            if isinstance(entry, dict) and isinstance(node, dict):
                entry = {k: v for k, v in entry.items() if k != "consolidated_metadata"}
                node = {k: v for k, v in node.items() if k != "consolidated_metadata"}
            if entry != node:
                problems.append(f"{key} differs from its zarr.json")
        return problems[:10] + ([f"… and {len(problems) - 10} more"] if len(problems) > 10 else [])

    def generation(self) -> tuple[int, int] | None:
        """``(st_dev, st_ino)`` of the store folder: a writer's swap changes it, so a reader that
        sees it change while reading has read across two builds (and reads again)."""
        try:
            info = os.stat(self.path)
        except OSError:
            return None
        return info.st_dev, info.st_ino

    def _group(self, group: str) -> Any:
        try:
            read_metadata_file(self.path / group / "zarr.json")
        except StoreError as exc:
            raise StoreError(f"{self.path}: group {group}/ is missing or unreadable ({_strip_path(str(exc), self.path / group / 'zarr.json')})") from None
        try:
            node = self._root[group]
        except Exception as exc:
            raise StoreError(f"{self.path}: group {group}/ is missing or unreadable ({_one_line(exc)})") from None
        if node.__class__.__name__ != "Group":
            raise StoreError(f"{self.path}: {group} is not a group")
        return node

    def has_group(self, group: str) -> bool:
        try:
            self._group(group)
        except StoreError:
            return False
        return True

    def group_attrs(self, group: str) -> dict[str, Any]:
        node = self._group(group)
        try:
            return dict(node.attrs)
        except Exception as exc:
            raise StoreError(f"{self.path}: {group}/ attributes unreadable ({_one_line(exc)})") from None

    def _array_metas(self, group: str) -> dict[str, dict[str, Any]]:
        """Name -> parsed ``zarr.json`` of every sub-folder that describes an array (read without
        zarr, which would read every child's metadata unchecked: a FIFO there would block it)."""
        self._group(group)
        out: dict[str, dict[str, Any]] = {}
        for name in self.child_dirs(group):
            try:
                meta = json.loads(read_metadata_file(self.path / group / name / "zarr.json"))
            except (StoreError, ValueError):
                continue
            if isinstance(meta, dict) and meta.get("node_type") == "array":
                out[name] = meta
        return out

    def arrays(self, group: str) -> list[str]:
        """The group's product arrays: sub-folders whose ``zarr.json`` is a sane regular file
        describing an array, coordinate arrays (:meth:`coordinates`) left out."""
        return [name for name, meta in self._array_metas(group).items() if not _coordinate_meta(name, meta)]

    def coordinates(self, group: str) -> list[str]:
        """The group's coordinate arrays (:mod:`bevcompile.store.coords`), which :meth:`arrays` leaves out."""
        return [name for name, meta in self._array_metas(group).items() if _coordinate_meta(name, meta)]

    def axis_lengths(self, group: str) -> dict[str, int]:
        """Axis name -> length over the group's product arrays (their ``dimension_names`` and shapes)."""
        out: dict[str, int] = {}
        for name, meta in self._array_metas(group).items():
            dims, shape = meta.get("dimension_names"), meta.get("shape")
            if _coordinate_meta(name, meta) or not (isinstance(dims, list) and isinstance(shape, list)):
                continue
            for dim, size in zip(dims, shape, strict=False):
                if isinstance(dim, str) and isinstance(size, int):
                    out.setdefault(dim, size)
        return out

    def has_array(self, group: str, name: str) -> bool:
        try:
            return name in self.arrays(group)
        except StoreError:
            return False

    def _array(self, group: str, name: str) -> Any:
        node = self._group(group)
        try:
            read_metadata_file(self.path / group / name / "zarr.json")
        except StoreError as exc:
            raise StoreError(f"{self.path}: {group}/{name} is missing or unreadable ({_strip_path(str(exc), self.path / group / name / 'zarr.json')})") from None
        try:
            arr = node[name]
        except Exception as exc:
            raise StoreError(f"{self.path}: {group}/{name} is missing or unreadable ({_one_line(exc)})") from None
        if arr.__class__.__name__ != "Array":
            raise StoreError(f"{self.path}: {group}/{name} is not an array")
        return arr

    def array_info(self, group: str, name: str) -> ArrayInfo:
        arr = self._array(group, name)
        try:
            stored = arr.nbytes_stored() if callable(arr.nbytes_stored) else arr.nbytes_stored
            return ArrayInfo(
                group=group,
                name=name,
                shape=tuple(int(s) for s in arr.shape),
                dtype=str(np.dtype(arr.dtype)),
                chunks=tuple(int(c) for c in arr.chunks),
                nbytes=int(arr.nbytes),
                nbytes_stored=int(stored),
                nchunks=int(arr.nchunks),
                nchunks_initialized=int(arr.nchunks_initialized),
                attrs=dict(arr.attrs),
            )
        except Exception as exc:
            raise StoreError(f"{self.path}: {group}/{name} metadata unreadable ({_one_line(exc)})") from None

    # -- data --------------------------------------------------------------------------

    def read(self, group: str, name: str, *, verify_sha256: bool = False) -> np.ndarray:
        """The whole array as numpy. Missing chunks, undecodable chunk files and (with
        ``verify_sha256``) content that does not match the recorded ``sha256`` raise
        :class:`StoreError`."""
        arr = self._array(group, name)
        where = f"{self.path}: {group}/{name}"
        chunk_bytes = int(np.dtype(arr.dtype).itemsize) * math.prod(int(c) for c in arr.chunks)
        unsafe = check_regular_files(self.path / group / name, max(2 * chunk_bytes, MAX_METADATA_BYTES) + CHUNK_FILE_SLACK_BYTES)
        if unsafe is not None:  # before zarr lists or reads a chunk: it would block on a FIFO
            raise StoreError(f"{where}: {unsafe}")
        try:
            nchunks, initialised = int(arr.nchunks), int(arr.nchunks_initialized)
        except Exception as exc:
            raise StoreError(f"{where}: cannot list chunks ({_one_line(exc)})") from None
        if initialised < nchunks and math.prod(arr.shape) > 0:
            raise StoreError(f"{where}: {nchunks - initialised} of {nchunks} chunk(s) missing")
        try:
            data = np.asarray(arr[...])
        except Exception as exc:
            raise StoreError(f"{where}: chunk data unreadable ({_one_line(exc)})") from None
        if verify_sha256:
            recorded = arr.attrs.get("sha256")
            if recorded is None:
                raise StoreError(f"{where}: no sha256 attribute")
            actual = array_sha256(data)
            if actual != recorded:
                got, want = hash_pair(actual, recorded)
                raise StoreError(f"{where}: content sha256 {got} does not match recorded {want}")
        return data

    def read_group(self, group: str, names: Iterable[str] | None = None) -> dict[str, np.ndarray]:
        names = self.arrays(group) if names is None else list(names)
        return {name: self.read(group, name) for name in names}

    def disk_bytes(self, group: str | None = None) -> int:
        """Bytes of chunk files on disk (metadata excluded), for a group or the whole store."""
        base = self.path if group is None else self.path / group
        return _dir_bytes(base) if base.exists() else 0


def _coordinate_meta(name: str, meta: Mapping[str, Any]) -> bool:
    dims = meta.get("dimension_names")
    return is_coordinate(name, tuple(dims) if isinstance(dims, list) else None)


def open_store(path: str | Path) -> StoreReader:
    """Open a store read-only (raises :class:`StoreError` if it is not one)."""
    return StoreReader(path)


def read_root_attrs_file(path: str | Path) -> dict[str, Any]:
    """Root attributes straight from ``zarr.json`` (for damaged stores zarr will not open)."""
    try:
        meta = json.loads(read_metadata_file(Path(path) / "zarr.json"))
        attrs = meta.get("attributes", {})
        return attrs if isinstance(attrs, dict) else {}
    except Exception as exc:
        raise StoreError(f"{path}: zarr.json unreadable ({_one_line(exc)})") from None


def _strip_path(message: str, path: Path) -> str:
    prefix = f"{path}: "
    return message[len(prefix) :] if message.startswith(prefix) else message
