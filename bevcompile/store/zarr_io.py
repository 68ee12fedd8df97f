"""The zarr (v3) store: the only module that touches zarr or the store's files.

Layout: ``<out>/<rig name>.zarr`` is a zarr v3 group whose root attributes describe the
store (``format``, ``tool_version``, ``name``, ``config``, ``config_sha256``,
``conventions``) and whose sub-groups (``grid``, ``gather``, ``delta``, ``matrix``, ...)
hold the products. Every array carries a ``sha256`` attribute: the SHA-256 of its
dtype, shape and C-order little-endian bytes (see :func:`array_sha256`).

Writes are atomic: a new store is built in a hidden temporary sibling
(``.<name>.zarr.tmp-*``) and renamed into place; if a store already exists it is moved aside,
the new one renamed in, and the old one deleted — a failure at any point leaves the earlier
store as it was and no half-written store behind. Groups of an existing store that the
writer does not replace are carried over only when the existing store was built from the
same config (same ``config_sha256``); otherwise ``force=True`` is required and the old store
is replaced as a whole.

Reading never lets a zarr/OS/codec exception escape: every failure is a one-line
:class:`~bevcompile.errors.StoreError` naming the store, the array and what is wrong.
Missing chunks are detected (zarr would silently return the fill value).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import shutil
import uuid
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import BevcompileError, StoreConflictError, StoreError, UsageError

STORE_FORMAT = "bevcompile/1"
READABLE_FORMATS = ("bevcompile/1",)
STORE_SUFFIX = ".zarr"
CHUNK_TARGET_BYTES = 4 << 20
ZSTD_LEVEL = 3


@dataclass
class GroupData:
    """Arrays and attributes of one group to write.

    ``chunks`` may give an explicit chunk shape per array; the rest use :func:`default_chunks`.
    """

    arrays: dict[str, np.ndarray]
    attrs: dict[str, Any] = field(default_factory=dict)
    chunks: dict[str, tuple[int, ...]] = field(default_factory=dict)


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


def check_out_dir(out_dir: str | Path) -> None:
    """Refuse an output folder that is a zarr store (holds ``zarr.json``, or is named ``*.zarr``)
    or lies inside one: ``--out artifacts/nuscenes.zarr`` would write a store *into* the store,
    which then fails ``inspect``. :class:`UsageError` (exit 2), before anything is created."""
    folder = Path(out_dir)
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
    """SHA-256 of ``dtype.str`` (little-endian), shape and C-order bytes of ``array``."""
    arr = np.ascontiguousarray(array)
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


def _write_group(root: Any, group_name: str, data: GroupData) -> dict[str, int]:
    from zarr.codecs import ZstdCodec

    group = root.create_group(group_name, overwrite=True)
    group.attrs.update(_json_safe(data.attrs, f"{group_name}/"))
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
            config={"write_empty_chunks": True},
        )
        if array.size:
            zarray[...] = array
        del zarray
        sizes[f"{group_name}/{name}"] = 0
    return sizes


def check_replaceable(path: str | Path, new_sha: str, *, force: bool = False) -> bool:
    """Whether a write of config ``new_sha`` may go to ``path``; True if an existing store of the
    same config is there (its other groups are kept), False if there is nothing to keep.

    Raises :class:`StoreConflictError` (unless ``force``) for a store of another config, a zarr
    store that is not a bevcompile store, or a directory that is not a readable store;
    :class:`StoreError` for a path that exists and is not a directory; :class:`UsageError` for a
    folder that is itself (inside) a zarr store (see :func:`check_out_dir`). Cheap: the builders call
    it before any work so that a refusal costs nothing, and :func:`write_groups` again.
    """
    path = Path(path)
    check_out_dir(path.parent)
    recover_interrupted_writes(path)  # a store a killed writer left moved aside is judged, not missed
    if not path.exists():
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
        return True
    if force:
        return False
    if not isinstance(old_sha, str):
        raise StoreConflictError(f"{path}: exists but is not a bevcompile store (no config_sha256 in its root attributes); pass --force to replace it")
    raise StoreConflictError(
        f"{path}: was built from a different config (config_sha256 {old_sha[:12]}…, new {new_sha[:12]}…); pass --force to replace it"
    )


GROUPS_ATTR = "groups"
"""Root attribute: the sorted names of the store's groups, rewritten by every write."""
TMP_MARK = ".tmp-"
OLD_MARK = ".old-"
STORE_WRITTEN_ATTR = "bevcompile_store_written"
"""Set on an interrupt (KeyboardInterrupt, SIGTERM) that arrived after the new store was in
place (while the old copy was being deleted): the CLI then says the store was written."""
COMPLETED_WRITES: list[str] = []
"""Stores this process has put in place, in order: an interrupt after a write (while the
command summarises, or writes its next store) is then reported as "already written"."""


def _host_tag() -> str:
    """This host's name, safe in a file name: the sweep of killed writers' leftovers only judges
    entries of its own host (a pid means nothing on another machine or container)."""
    import socket

    return "".join(ch if ch.isalnum() or ch in "._" else "_" for ch in socket.gethostname()) or "host"


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


def recover_interrupted_writes(path: str | Path) -> list[Path]:
    """Clean up after writers of ``path`` that were killed (SIGKILL, power loss) mid-write.

    A writer builds ``.<name>.tmp-<pid>-<host>-<rand>`` beside the store and swaps it in through
    ``.<name>.old-<pid>-<host>-<rand>``. For a writer of this host whose process no longer exists:
    its temporary is deleted; its ``.old-`` copy is renamed back to ``<name>`` if the kill fell
    between the two renames (no store at ``path``), else deleted. Files of live processes, and of
    other hosts (a shared folder), are left alone.
    Returns the paths removed or restored.
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
        if mark == OLD_MARK and not path.exists():
            try:
                os.rename(sibling, path)
            except OSError:
                continue  # read-only folder: left for a later write; this one reports the folder
        else:
            shutil.rmtree(sibling, ignore_errors=True)
        touched.append(sibling)
    return touched


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
    one) is replaced only with ``force=True``; otherwise :class:`StoreConflictError`.
    """
    import zarr

    path = Path(path)
    new_sha = root_attrs.get("config_sha256")
    if not isinstance(new_sha, str):
        raise StoreError("root_attrs must include config_sha256")
    parent = path.parent
    check_out_dir(parent)
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StoreError(f"{parent}: cannot create output folder ({exc.strerror or exc})") from None
    carry_over = check_replaceable(path, new_sha, force=force)  # also recovers killed writers' leftovers
    existed = path.exists()
    dropped = () if carry_over or not existed else tuple(g for g in _group_names(path) if g not in groups)

    tmp = parent / f".{path.name}{TMP_MARK}{_writer_tag()}-{uuid.uuid4().hex[:8]}"
    sizes: dict[str, int] = {}
    kept: list[str] = []
    try:
        if carry_over:
            shutil.copytree(path, tmp)
            root = zarr.open_group(str(tmp), mode="r+", zarr_format=3)
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
            sizes.update(_write_group(root, name, data))
        root.attrs[GROUPS_ATTR] = sorted(root.group_keys())  # inspect fails a store that lost one
        del root
        for key in sizes:
            sizes[key] = _dir_bytes(tmp / key)
        _swap_into_place(tmp, path)
    except BaseException as exc:
        if getattr(exc, STORE_WRITTEN_ATTR, None):  # interrupted while the old copy was deleted
            COMPLETED_WRITES.append(str(path))
        _remove_temporary(tmp)
        if isinstance(exc, OSError) and not isinstance(exc, BevcompileError):
            raise StoreError(f"{parent}: cannot write store ({_os_reason(exc)})") from None
        raise
    COMPLETED_WRITES.append(str(path))
    return WriteReport(path, existed, tuple(kept), sizes, dropped)


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
        parent.mkdir(parents=True, exist_ok=True)
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
    recover_interrupted_writes(path)
    if os.path.lexists(path) and not is_store(path):
        raise StoreError(f"{path}: exists and is not a store; it is not replaced (remove it, or choose another folder)")
    try:
        _swap_into_place(built, path)
    except BaseException as exc:
        if getattr(exc, STORE_WRITTEN_ATTR, None):
            COMPLETED_WRITES.append(str(path))
        if isinstance(exc, OSError) and not isinstance(exc, BevcompileError):
            raise StoreError(f"{path}: cannot put the new store in place ({_os_reason(exc)})") from None
        raise
    COMPLETED_WRITES.append(str(path))


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


def _swap_into_place(tmp: Path, path: Path) -> None:
    """Rename ``tmp`` to ``path``; an existing store goes aside first and is deleted after.
    Ctrl-C / SIGTERM are held back between the two renames (never a moment without a store at
    ``path``); one that arrives while the old copy is deleted is re-raised marked
    :data:`STORE_WRITTEN_ATTR` (the new store is complete; the next write removes the rest)."""
    if not path.exists():
        os.rename(tmp, path)
        return
    old = path.parent / f".{path.name}{OLD_MARK}{_writer_tag()}-{uuid.uuid4().hex[:8]}"
    with _signals_held():
        os.rename(path, old)
        try:
            os.rename(tmp, path)
        except BaseException:
            os.rename(old, path)
            raise
    try:
        shutil.rmtree(old, ignore_errors=True)
    except BaseException as exc:
        setattr(exc, STORE_WRITTEN_ATTR, str(path))
        raise


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """Block SIGINT and SIGTERM in this thread for the block (delivered right after it)."""
    import signal

    held = {signal.SIGINT, signal.SIGTERM}
    try:
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    except (AttributeError, ValueError, OSError):  # no POSIX signal masks here
        yield
        return
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


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
            if not (self.path / "zarr.json").is_file():
                raise StoreError(f"{self.path}: not a zarr store (no zarr.json at its root)")
        except StoreError:
            raise
        except OSError as exc:  # Path.is_file() raises EACCES instead of returning False
            raise StoreError(f"{self.path}: cannot read the store ({_os_reason(exc)})") from None
        try:
            self._root = zarr.open_group(str(self.path), mode="r", zarr_format=3)
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
            known = set(group.array_keys())
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

    def _group(self, group: str) -> Any:
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

    def arrays(self, group: str) -> list[str]:
        node = self._group(group)
        try:
            return sorted(node.array_keys())
        except Exception as exc:
            raise StoreError(f"{self.path}: cannot list arrays of {group}/ ({_one_line(exc)})") from None

    def has_array(self, group: str, name: str) -> bool:
        try:
            return name in self.arrays(group)
        except StoreError:
            return False

    def _array(self, group: str, name: str) -> Any:
        node = self._group(group)
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
                raise StoreError(f"{where}: content sha256 {actual[:12]}… does not match recorded {str(recorded)[:12]}…")
        return data

    def read_group(self, group: str, names: Iterable[str] | None = None) -> dict[str, np.ndarray]:
        names = self.arrays(group) if names is None else list(names)
        return {name: self.read(group, name) for name in names}

    def disk_bytes(self, group: str | None = None) -> int:
        """Bytes of chunk files on disk (metadata excluded), for a group or the whole store."""
        base = self.path if group is None else self.path / group
        return _dir_bytes(base) if base.exists() else 0


def open_store(path: str | Path) -> StoreReader:
    """Open a store read-only (raises :class:`StoreError` if it is not one)."""
    return StoreReader(path)


def read_root_attrs_file(path: str | Path) -> dict[str, Any]:
    """Root attributes straight from ``zarr.json`` (for damaged stores zarr will not open)."""
    try:
        meta = json.loads((Path(path) / "zarr.json").read_text())
        attrs = meta.get("attributes", {})
        return attrs if isinstance(attrs, dict) else {}
    except Exception as exc:
        raise StoreError(f"{path}: zarr.json unreadable ({_one_line(exc)})") from None
