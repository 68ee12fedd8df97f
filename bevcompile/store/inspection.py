"""The ``inspect`` runner: CI-grade integrity checks of stores, robust to damage.

:func:`inspect_paths` finds the stores under the given paths, and for each store

1. checks the root: ``zarr.json`` readable, ``format`` readable by this tool, ``tool_version``
   present, the stored ``config`` re-parses with :func:`bevcompile.rig.config.parse_config` and
   hashes to the recorded ``config_sha256`` (recomputed), every recorded ``conventions``
   sentence equal to :data:`bevcompile.conventions.CONVENTIONS` (append-only: sentences a newer
   tool added may be absent), no damaged node (a group or array directory
   whose ``zarr.json`` is missing or unreadable);
2. reads every array of every group (each unreadable array -> one failed check naming the
   array and the reason: missing/truncated/garbage chunk, unreadable metadata) and compares its
   content with its recorded ``sha256`` attribute;
3. calls every plug-in module listed for the group in
   :data:`bevcompile.store.plugins.GROUP_PLUGINS` (imported lazily; a module that is not installed
   is skipped with a note; a group no installed module checks -> failed check
   ``unknown_group``); any exception a plug-in raises becomes a failed check;
4. with ``strict=True``, calls every plug-in's ``rebuild_<group>``, merges the results and
   requires bit equality (dtype, shape, bytes) with each stored array; an array no plug-in
   rebuilds fails ``cannot_rebuild``.

Nothing here prints: the CLI renders :class:`InspectReport`. Path resolution errors (a path
that is neither a store nor a folder of stores) raise :class:`~bevcompile.errors.UsageError`
(exit code 2); failed checks are data, not exceptions.
"""

from __future__ import annotations

import importlib
import inspect
import json
import math
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .._version import __version__
from ..conventions import CONVENTIONS
from ..errors import BevcompileError, StoreError, UsageError, hash_pair
from ..files import JSONRefused, loads_strict
from ..rig.config import RigConfig, config_sha256, parse_config
from . import plugins as checks_api
from .coords import coordinate_arrays, same_coordinate
from .plugins import Check, CheckContext
from .root import rig_conventions
from .zarr_io import (
    GROUP_CONFIG_ATTR,
    GROUPS_ATTR,
    READABLE_FORMATS,
    STORE_SUFFIX,
    StoreReader,
    array_sha256,
    find_stores,
    is_store,
    open_store,
    read_metadata_file,
)

ROOT = "/"
KEY_ATTRIBUTES = (
    "align_corners",
    "feature_size",
    "formats",
    "mode",
    "topk",
    "k",
    "K",
    "align",
    "k_pad",
    "normalize",
    "splat",
    "quantize",
    "tile_rows",
    "logical_shape",
    "padded_shape",
)
"""Group attributes shown in the report (plus ``build_options`` and every ``*error*`` value)."""


# --------------------------------------------------------------------------------------
# report data
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ArraySummary:
    """One array as the report lists it."""

    name: str  # "group/name"
    shape: tuple[int, ...]
    dtype: str
    chunks: tuple[int, ...]
    bytes_in_memory: int
    bytes_on_disk: int
    nchunks: int

    def to_json(self) -> dict[str, Any]:
        return {
            "shape": list(self.shape),
            "dtype": self.dtype,
            "chunks": list(self.chunks),
            "nchunks": self.nchunks,
            "bytes_in_memory": self.bytes_in_memory,
            "bytes_on_disk": self.bytes_on_disk,
        }


@dataclass
class GroupSummary:
    name: str
    key_attrs: dict[str, Any] = field(default_factory=dict)
    arrays: list[ArraySummary] = field(default_factory=list)
    plugins: list[str] = field(default_factory=list)  # modules that checked this group

    def to_json(self) -> dict[str, Any]:
        return {
            "key_attributes": self.key_attrs,
            "plugins": self.plugins,
            "arrays": {a.name.split("/", 1)[1]: a.to_json() for a in self.arrays},
        }


@dataclass
class StoreReport:
    """Everything ``inspect`` found about one store."""

    path: str
    name: str | None = None
    config_sha256: str | None = None
    tool_version: str | None = None
    format: str | None = None
    strict: bool = False
    groups: list[GroupSummary] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    @property
    def failures(self) -> list[Check]:
        return [c for c in self.checks if not c.passed]

    def failure_lines(self) -> list[str]:
        """``<store>: <array>: <check>: <reason>``, one per failed check."""
        return [f"{self.path}: {c.array}: {c.name}: {c.reason}" for c in self.failures]

    def add(self, name: str, array: str, passed: bool, reason: str) -> None:
        self.checks.append(Check(name, array, bool(passed), one_line(reason)))

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "name": self.name,
            "config_sha256": self.config_sha256,
            "tool_version": self.tool_version,
            "format": self.format,
            "strict": self.strict,
            "passed": self.passed,
            "n_checks": len(self.checks),
            "n_failed": len(self.failures),
            "groups": {g.name: g.to_json() for g in self.groups},
            "checks": [{"name": c.name, "array": c.array, "passed": c.passed, "reason": c.reason} for c in self.checks],
            "notes": list(self.notes),
        }


@dataclass
class InspectReport:
    stores: list[StoreReport]
    strict: bool = False

    @property
    def passed(self) -> bool:
        return all(s.passed for s in self.stores)

    @property
    def n_checks(self) -> int:
        return sum(len(s.checks) for s in self.stores)

    @property
    def n_failed(self) -> int:
        return sum(len(s.failures) for s in self.stores)

    def failure_lines(self) -> list[str]:
        return [line for s in self.stores for line in s.failure_lines()]

    def to_json(self) -> dict[str, Any]:
        return {
            "tool_version": __version__,
            "strict": self.strict,
            "passed": self.passed,
            "n_stores": len(self.stores),
            "n_checks": self.n_checks,
            "n_failed": self.n_failed,
            "stores": [s.to_json() for s in self.stores],
        }


def one_line(text: str) -> str:
    return " ".join(str(text).split())


def _exc_line(exc: BaseException) -> str:
    if isinstance(exc, BevcompileError):
        return one_line(str(exc))
    text = one_line(str(exc))
    return f"{exc.__class__.__name__}: {text}" if text else exc.__class__.__name__


# --------------------------------------------------------------------------------------
# path resolution
# --------------------------------------------------------------------------------------


def looks_like_store(path: Path) -> bool:
    """A store, or a damaged one: a directory with ``zarr.json`` at its root, or any
    ``<name>.zarr`` directory (a store whose root ``zarr.json`` was deleted is still inspected,
    and fails, rather than being mistaken for a folder of stores)."""
    return path.is_dir() and (is_store(path) or path.suffix == STORE_SUFFIX)


BEVCOMPILE_ROOT_KEYS = ("format", "tool_version", "config", "conventions", GROUPS_ATTR)
"""Root attributes of a bevcompile store: a zarr root holding none of them is not one
(``config_sha256`` is not among them: every group records it too)."""
ANCESTOR_LEVELS = 3
"""How far up :func:`enclosing_store` looks (store/group/array/c)."""


def _zarr_json(path: Path) -> dict[str, Any] | None:
    """The parsed ``zarr.json`` of ``path`` (None if absent, unreadable or not an object)."""
    try:
        meta = json.loads(read_metadata_file(path / "zarr.json"))
    except (StoreError, ValueError, UnicodeDecodeError):
        return None
    return meta if isinstance(meta, dict) else None


def _is_bevcompile_root(path: Path) -> bool:
    meta = _zarr_json(path)
    attrs = meta.get("attributes") if meta is not None else None
    return meta is not None and meta.get("node_type") == "group" and isinstance(attrs, dict) and any(k in attrs for k in BEVCOMPILE_ROOT_KEYS)


def enclosing_store(path: Path) -> Path | None:
    """The bevcompile store ``path`` lies inside (a group or array folder of it), else None.

    Only an intact ancestor root counts (``zarr.json`` with bevcompile root attributes), so a
    damaged store (root attributes missing or garbage) is never mistaken for a group folder."""
    if _is_bevcompile_root(path):
        return None
    try:
        ancestors = list(path.resolve().parents)[:ANCESTOR_LEVELS]
    except OSError:
        return None
    for parent in ancestors:
        if _is_bevcompile_root(parent):
            return parent
    return None


def _foreign_zarr(path: Path) -> bool:
    """A readable zarr v3 root that is plainly not a bevcompile store: no bevcompile root
    attribute, not named ``*.zarr`` and no child folder named like a bevcompile group (a
    damaged store keeps at least one of those, and stays a failed inspect)."""
    meta = _zarr_json(path)
    if meta is None or path.suffix == STORE_SUFFIX or _is_bevcompile_root(path):
        return False
    return not any(checks_api.split_level_group(name)[0] in checks_api.GROUP_PLUGINS for name in (p.name for p in _subdirs(path)))


def not_a_store_root(path: Path, command: str = "inspect") -> None:
    """UsageError (exit 2) for a group/array folder of a store or a foreign zarr root
    (``inspect``, ``verify``, ``render`` and :func:`bevcompile.load` all take the store root)."""
    store = enclosing_store(path)
    if store is not None:
        try:
            inner = path.resolve().relative_to(store)
        except ValueError:
            inner = Path(path.name)
        kind = "group" if len(inner.parts) == 1 else "node"
        raise UsageError(f"{path}: is the {inner.as_posix()}/ {kind} of the store {store}; {command} the store")
    if _foreign_zarr(path):
        raise UsageError(f"{path}: a zarr folder but not a bevcompile store (no bevcompile root attributes, no bevcompile group)")


def _subdirs(path: Path) -> list[Path]:
    try:
        return sorted(p for p in path.iterdir() if p.is_dir())
    except OSError:
        return []


def resolve_store_paths(paths: Sequence[str | Path]) -> list[Path]:
    """The stores named by ``paths``: each a store (also a damaged one) or a folder of stores.

    Raises :class:`UsageError` (exit 2) for a path that does not exist, is a file, or is a
    folder holding no store.
    """
    out: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if str(path) == "-":
            raise UsageError("-: inspect reads stores, which are folders; standard input cannot hold one")
        if not path.exists():
            raise UsageError(f"{path}: no such store or folder")
        if not path.is_dir():
            raise UsageError(f"{path}: not a store or a folder of stores (it is a file)")
        if looks_like_store(path):
            not_a_store_root(path)
            out.append(path)
            continue
        found = find_stores(path)
        if not found:
            raise UsageError(f"{path}: not a store, and holds no <name>{STORE_SUFFIX} store")
        out.extend(found)
    seen: set[Path] = set()
    unique = []
    for path in out:
        key = path.resolve()
        if key not in seen:
            seen.add(key)
            unique.append(path)
    return unique


# --------------------------------------------------------------------------------------
# plug-ins
# --------------------------------------------------------------------------------------


@dataclass
class PluginSet:
    functions: list[tuple[str, Callable[..., Any]]]
    notes: list[str]
    import_failures: list[Check]


def plugin_functions(group: str, kind: str) -> PluginSet:
    """``<kind>_<group>`` of every module GROUP_PLUGINS lists for ``group`` (kind: check,
    verify or rebuild). A module that is not installed is skipped with a note; a module that
    fails to import is a failed check."""
    functions: list[tuple[str, Callable[..., Any]]] = []
    notes: list[str] = []
    failures: list[Check] = []
    base, _level = checks_api.split_level_group(group)  # grid_l1 is served by grid's plug-ins
    for module_name in checks_api.GROUP_PLUGINS.get(base, ()):
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name is not None and module_name.startswith(exc.name):
                notes.append(f"{group}/: plug-in {module_name} is not installed; skipped")
                continue
            failures.append(Check("plugin_import", f"{group}/", False, f"plug-in {module_name} failed to import ({_exc_line(exc)})"))
            continue
        except Exception as exc:
            failures.append(Check("plugin_import", f"{group}/", False, f"plug-in {module_name} failed to import ({_exc_line(exc)})"))
            continue
        fn = getattr(module, f"{kind}_{base}", None)
        if callable(fn):
            functions.append((module_name, fn))
    return PluginSet(functions, notes, failures)


# --------------------------------------------------------------------------------------
# loading a store robustly (shared with verify)
# --------------------------------------------------------------------------------------


@dataclass
class InspectedStore:
    """A store read as far as damage allows. ``checks`` hold the root and read checks."""

    report: StoreReport
    reader: StoreReader | None = None
    root_attrs: dict[str, Any] = field(default_factory=dict)
    rig: RigConfig | None = None
    arrays: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)  # group -> readable arrays
    coordinates: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)  # group -> readable coordinate arrays
    group_attrs: dict[str, dict[str, Any]] = field(default_factory=dict)


def load_store(path: str | Path, *, progress: Callable[[int], None] | None = None) -> InspectedStore:
    """Open ``path``, run the root checks and read every array (checking its sha256).

    Never raises for a damaged store: every problem becomes a failed check in
    ``loaded.report.checks``. zarr's warnings about the damage (already reported as checks)
    are silenced so that stderr carries exactly one line per failure.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _attempt in range(SWAP_RETRIES - 1):
            before = _generation(Path(path))
            loaded = _load_store(Path(path), progress)
            if _generation(Path(path)) == before:
                return loaded
        loaded = _load_store(Path(path), progress)
        loaded.report.notes.append(f"the store was replaced by a writer {SWAP_RETRIES} times while being read: checks may mix two builds")
        return loaded


SWAP_RETRIES = 4
"""A store a writer swapped while it was being read is read again (up to this many times): a
report never mixes two builds."""


def _generation(path: Path) -> tuple[int, int] | None:
    try:
        info = path.stat()
    except OSError:
        return None
    return info.st_dev, info.st_ino


def _load_store(path: Path, progress: Callable[[int], None] | None) -> InspectedStore:
    path = Path(path)
    report = StoreReport(path=str(path))
    loaded = InspectedStore(report)
    try:
        reader = open_store(path)
    except StoreError as exc:
        present = [p.name for p in _subdirs(path) if not p.name.startswith(".")]
        report.add(
            "root_metadata",
            ROOT,
            False,
            f"store root unreadable, nothing else can be checked ({_strip_store(str(exc), path)}); sub-folders present: {present or 'none'}",
        )
        return loaded
    loaded.reader = reader
    report.add("root_metadata", ROOT, True, "root zarr.json readable")
    attrs = loaded.root_attrs = dict(reader.root_attrs)
    _root_checks(loaded, attrs)

    # Probe every folder on its own (StoreReader.damaged_nodes() would stop at the first
    # corrupt zarr.json of a group, hiding its healthy siblings).
    n_damaged = 0 if strict_metadata(report, path, "", ROOT) is not None else 1
    try:
        group_dirs = reader.child_dirs()
    except StoreError as exc:
        report.add("node_metadata", ROOT, False, _strip_store(str(exc), path))
        group_dirs = []
        n_damaged += 1
    groups: list[str] = []
    for group in group_dirs:
        if reader.has_group(group):
            groups.append(group)
        else:
            n_damaged += 1
            report.add("node_metadata", f"{group}/", False, "group folder has no readable zarr.json (metadata deleted or corrupt); its arrays cannot be read")
    report.add("groups", ROOT, bool(groups), f"product groups: {', '.join(groups) if groups else 'none (an empty store)'}")
    for stray in reader.stray_entries():
        n_damaged += 1
        report.add("node_metadata", f"{stray}", False, "not a folder where a group should be (a file, or a broken or looping link)")
    stale = reader.consolidated_problems()
    if stale is None:
        report.notes.append(
            "no consolidated metadata (a store written before bevcompile consolidated every write, or its copy removed): "
            "xarray's default open warns; rebuild, or run zarr.consolidate_metadata"
        )
    else:
        report.add(
            "consolidated_metadata", ROOT, not stale,
            f"consolidated metadata is stale ({'; '.join(stale)}): readers that use it see another store; "
            "run zarr.consolidate_metadata again, or rebuild" if stale else "consolidated metadata matches every node's zarr.json",
        )
    recorded = attrs.get(GROUPS_ATTR)
    if recorded is None:
        report.notes.append(f"no root `{GROUPS_ATTR}` attribute (built before bevcompile recorded it): a deleted group cannot be detected")
    elif not (isinstance(recorded, list) and all(isinstance(g, str) for g in recorded)):
        report.add("groups_recorded", ROOT, False, f"root attribute {GROUPS_ATTR!r} is not a list of names: {recorded!r}")
    else:
        missing = sorted(set(recorded) - set(group_dirs))
        extra = sorted(set(group_dirs) - set(recorded))
        why = []
        if missing:
            why.append(f"recorded group(s) missing: {', '.join(g + '/' for g in missing)} (deleted, or a partial copy)")
        if extra:
            why.append(f"group(s) not recorded by the last write: {', '.join(g + '/' for g in extra)}")
        report.add("groups_recorded", ROOT, not why, "; ".join(why) if why else f"every recorded group present: {', '.join(recorded)}")
    for group in groups:
        summary = GroupSummary(group)
        report.groups.append(summary)
        try:
            gattrs = reader.group_attrs(group)
        except StoreError as exc:
            report.add("group_metadata", f"{group}/", False, _strip_store(str(exc), path))
            gattrs = {}
        loaded.group_attrs[group] = gattrs
        summary.key_attrs = key_attributes(gattrs)
        _group_config_check(report, group, gattrs.get(GROUP_CONFIG_ATTR), attrs.get("config_sha256"))
        if strict_metadata(report, path, group, f"{group}/") is None:
            n_damaged += 1
        namers = plugin_functions(group, "dimension_names").functions
        try:
            names = reader.child_dirs(group)
        except StoreError as exc:
            report.add("node_metadata", f"{group}/", False, _strip_store(str(exc), path))
            n_damaged += 1
            names = []
        for stray in reader.stray_entries(group):
            n_damaged += 1
            report.add("node_metadata", f"{group}/{stray}", False, "not a folder where an array should be (a file, or a broken or looping link)")
        readable: dict[str, np.ndarray] = {}
        try:
            coordinate_names = set(reader.coordinates(group)) if names else set()
        except StoreError:  # reported by the reads below
            coordinate_names = set()
        loaded.coordinates[group] = {}
        for name in names:
            key = f"{group}/{name}"
            try:
                info = reader.array_info(group, name)
            except StoreError as exc:
                n_damaged += 1
                report.add(
                    "node_metadata",
                    key,
                    False,
                    f"array folder has no readable zarr.json (metadata deleted or corrupt): {_strip_store(str(exc), path)}",
                )
                continue
            if name not in coordinate_names:  # the summary lists product arrays; coordinates are checked below
                summary.arrays.append(
                    ArraySummary(key, info.shape, info.dtype, info.chunks, info.nbytes, reader.disk_bytes(key), info.nchunks)
                )
            foreign = reader.foreign_entries(group, name, info.shape, info.chunks)
            if foreign:
                n_damaged += 1
                report.add("node_metadata", key, False, f"file(s) that are no chunk of this array: {', '.join(foreign)}")
            meta = strict_metadata(report, path, key, key)
            if meta is None or not array_metadata(report, key, meta, len(info.shape), gattrs, namers):
                n_damaged += 1
            try:
                data = reader.read(group, name)
            except StoreError as exc:
                report.add("read", key, False, _strip_store(str(exc), path))
                continue
            finally:
                if progress is not None:
                    progress(1)
            recorded = info.attrs.get("sha256")
            actual = array_sha256(data)
            if not isinstance(recorded, str):
                report.add("sha256", key, False, "no sha256 attribute recorded")
            elif actual != recorded:
                report.add("sha256", key, False, "content sha256 {} does not match recorded {}".format(*hash_pair(actual, recorded)))
            else:
                report.add("sha256", key, True, f"content matches recorded sha256 {recorded[:12]}…")
            (loaded.coordinates[group] if name in coordinate_names else readable)[name] = data
        loaded.arrays[group] = readable
    if not n_damaged:
        report.add(
            "node_metadata", ROOT, True,
            "every group and array folder has readable metadata, in strict JSON (no NaN or Infinity, duplicate key or "
            "byte-order mark), every array the writer's fill_value 0 and the dimension_names its group's plug-ins give",
        )
    return loaded


def strict_metadata(report: StoreReport, store: Path, node: str, where: str) -> dict[str, Any] | None:
    """The ``zarr.json`` of ``node`` (``""`` the root, ``group``, ``group/array``) parsed as strict
    JSON (:func:`bevcompile.files.loads_strict`: no NaN or Infinity, no duplicate key, no
    byte-order mark; zarr and Python's json accept all three, the docs promise strict JSON);
    None, with a failed ``metadata_json`` check naming the node and what is wrong, otherwise.
    A file that cannot be read at all is the node checks' to report (None, no check)."""
    try:
        raw = read_metadata_file(store / node / "zarr.json" if node else store / "zarr.json")
    except StoreError:
        return None
    try:
        meta = loads_strict(raw)
    except JSONRefused as exc:
        reason = str(exc)
        if "NaN" in reason or "Infinity" in reason or "overflows" in reason:
            reason = f"{_nonfinite_path(raw) or 'a value'} is not a finite number ({reason})"
        report.add("metadata_json", where, False, f"zarr.json is not strict JSON: {reason}")
        return None
    if not isinstance(meta, dict):
        report.add("metadata_json", where, False, f"zarr.json is not a JSON object ({type(meta).__name__})")
        return None
    return meta


def _nonfinite_path(raw: bytes) -> str | None:
    """The key path of the first NaN / Infinity in a (lenient) parse of ``raw``, e.g.
    ``attributes.norm_int16.max_error_px``."""
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        item, where = stack.pop(0)
        if isinstance(item, float) and not math.isfinite(item):
            return where or "the document"
        if isinstance(item, dict):
            stack.extend((v, f"{where}.{k}" if where else str(k)) for k, v in item.items())
        elif isinstance(item, list):
            stack.extend((v, f"{where}[{i}]") for i, v in enumerate(item))
    return None


def array_metadata(
    report: StoreReport, key: str, meta: Mapping[str, Any], ndim: int, group_attrs: Mapping[str, Any],
    namers: Sequence[tuple[str, Callable[..., Any]]],
) -> bool:
    """``array_metadata``: the array's ``fill_value`` is the writer's 0 (``""`` for a string coordinate array; a read of a missing chunk
    is refused, but a reader that fills it gets 0, never a tampered NaN), and its
    ``dimension_names`` are those the group's plug-ins give (``dimension_names_<group>(name,
    ndim, attrs)``; xarray labels the axes by them). False (with a failed check) otherwise."""
    fill = meta.get("fill_value")
    problems = []
    if meta.get("data_type") == "string":  # the coordinate arrays of names (store.coords): the writer's fill is ""
        if fill != "":
            problems.append(f"fill_value {_short(fill)}, the writer's is \"\" (a string array)")
    elif not (type(fill) in (int, float, bool) and fill == 0):
        problems.append(f"fill_value {_short(fill)}, the writer's is 0")
    name = key.split("/", 1)[1]
    stored = meta.get("dimension_names")
    for module_name, fn in namers:
        try:
            expected = fn(name, ndim, group_attrs)
        except Exception as exc:  # a plug-in that cannot name them: the contract checks say why
            problems.append(f"{module_name}.dimension_names raised {_exc_line(exc)}")
            break
        if expected is None:
            continue
        if list(stored or []) != list(expected):
            problems.append(f"dimension_names {_short(stored)}, {module_name} names them {_short(list(expected))}")
        break
    for problem in problems:
        report.add("array_metadata", key, False, problem)
    return not problems


def _group_config_check(report: StoreReport, group: str, group_sha: Any, root_sha: Any) -> None:
    """``group_config``: the group was built from the config of the root (a group copied in from
    another rig's store, or left by a mixed write, names another)."""
    if group_sha is None:
        report.add(
            "group_config", f"{group}/", False,
            f"records no {GROUP_CONFIG_ATTR}: nothing proves it was built from the root's config (a copy from another "
            "store with the attribute removed, or a store of bevcompile < 0.3); rebuild it",
        )
        return
    if group_sha == root_sha:
        report.add("group_config", f"{group}/", True, f"built from the root's config ({hash_pair(group_sha, root_sha)[0]})")
        return
    ours, root = hash_pair(group_sha, root_sha)
    report.add(
        "group_config", f"{group}/", False,
        f"built from another config (config_sha256 {ours}, the root's {root}): copied from another store or left by a mixed write; rebuild it",
    )


def _strip_store(message: str, path: Path) -> str:
    """Store errors start with the store path; the failure line names the store already."""
    prefix = f"{path}: "
    return message[len(prefix) :] if message.startswith(prefix) else message


def _root_checks(loaded: InspectedStore, attrs: Mapping[str, Any]) -> None:
    report = loaded.report
    fmt = attrs.get("format")
    report.format = fmt if isinstance(fmt, str) else None
    report.add(
        "format",
        ROOT,
        fmt in READABLE_FORMATS,
        f"format {fmt!r}; this tool ({__version__}) reads {', '.join(READABLE_FORMATS)}",
    )
    version = attrs.get("tool_version")
    report.tool_version = version if isinstance(version, str) else None
    report.add("tool_version", ROOT, isinstance(version, str) and bool(version.strip()), f"built by bevcompile {version!r}")
    if isinstance(version, str) and version != __version__:
        report.notes.append(f"built by bevcompile {version}, inspected with {__version__} (inspect --strict compares the bytes)")
    name = attrs.get("name")
    report.name = name if isinstance(name, str) else None
    recorded_sha = attrs.get("config_sha256")
    report.config_sha256 = recorded_sha if isinstance(recorded_sha, str) else None

    config = attrs.get("config")
    rig: RigConfig | None = None
    if config is None:
        report.add("config", ROOT, False, "no stored config attribute")
    else:
        try:
            rig = parse_config(config, source="stored config")
        except BevcompileError as exc:
            report.add("config", ROOT, False, f"stored config does not parse: {exc}")
        except Exception as exc:  # defensive: the parser should only raise ConfigError
            report.add("config", ROOT, False, f"stored config does not parse ({_exc_line(exc)})")
    if rig is not None:
        actual = config_sha256(rig)
        report.add(
            "config",
            ROOT,
            actual == recorded_sha,
            f"stored config re-parses (rig {rig.name!r}, {rig.n_cam} cameras); sha256 {' vs recorded '.join(hash_pair(actual, recorded_sha))}",
        )
        report.add("name", ROOT, name == rig.name, f"root name {name!r}, config name {rig.name!r}")
        if loaded.report.path and Path(loaded.report.path).name != f"{rig.name}{STORE_SUFFIX}":
            report.notes.append(
                f"store folder is {Path(loaded.report.path).name}, not {rig.name}{STORE_SUFFIX}: "
                "`bevcompile verify CONFIG` and the build commands look for the latter"
            )
        loaded.rig = rig
    conventions = attrs.get("conventions")
    expected = rig_conventions(loaded.rig) if loaded.rig is not None else dict(CONVENTIONS)
    if conventions == expected:
        report.add("conventions", ROOT, True, f"all {len(expected)} convention sentences match this tool's")
    elif not isinstance(conventions, Mapping):
        report.add("conventions", ROOT, False, f"no conventions attribute (got {type(conventions).__name__})")
    else:
        # conventions are append-only: a sentence never changes meaning, newer tools may add ones
        # (e.g. a new pixel_mapping); a store that lacks only those is still read correctly
        differ = sorted(k for k in conventions if conventions.get(k) != expected.get(k))
        added = sorted(k for k in expected if k not in conventions)
        if differ:
            report.add("conventions", ROOT, False, f"built under other conventions: {', '.join(differ)} differ from this tool's")
        else:
            report.add(
                "conventions", ROOT, True,
                f"all {len(conventions)} recorded convention sentences match this tool's; "
                f"{len(added)} added since the store was built ({', '.join(added)})",
            )


def key_attributes(attrs: Mapping[str, Any]) -> dict[str, Any]:
    """The attributes worth a glance: build options, align/K/formats, and every error bound."""
    out: dict[str, Any] = {}
    if "build_options" in attrs:
        out["build_options"] = attrs["build_options"]
    for key, value in attrs.items():
        if key == "build_options":
            continue
        if key in KEY_ATTRIBUTES or "error" in key.lower():
            out[key] = value
        elif isinstance(value, Mapping):
            for sub, subvalue in value.items():
                if isinstance(sub, str) and ("error" in sub.lower() or sub in KEY_ATTRIBUTES) and not isinstance(subvalue, Mapping | list):
                    out[f"{key}.{sub}"] = subvalue
    return out


# --------------------------------------------------------------------------------------
# the runner
# --------------------------------------------------------------------------------------


def call_plugin(fn: Callable[..., Any], *args: Any, notes: list[str], label: str) -> Any:
    """Call a plug-in function; warnings it emits become one-line notes (stderr stays one line
    per failure). Exceptions propagate to the caller, which turns them into failed checks."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fn(*args)
    for warning in caught:
        notes.append(f"{label} warned: {warning.category.__name__}: {one_line(str(warning.message))}")
    return result


def check_context(loaded: InspectedStore, rig: RigConfig, level: int | None = None) -> CheckContext:
    """The plug-in context of a per-level group of feature level ``level`` (``rig`` seen through
    that level, :meth:`RigConfig.level`, and that level's ``grid`` group), or, with ``level=None``,
    of the groups that are not per level (``matrix``, ``interop``: the whole rig, ``grid/``)."""
    grid = checks_api.level_group("grid", level or 0)
    return CheckContext(
        rig=rig if level is None else rig.level(level),
        store_path=loaded.report.path,
        root_attrs=loaded.root_attrs,
        grid_arrays=loaded.arrays.get(grid, {}),
        grid_attrs=loaded.group_attrs.get(grid, {}),
        level=level or 0,
    )


def group_level(report: StoreReport, rig: RigConfig, group: str) -> int | None:
    """The feature level of ``group`` (0 for every group but ``grid_l<l>`` ...); None, with a
    failed check, when the stored config has no such level."""
    _base, level = checks_api.split_level_group(group)
    if level >= rig.n_levels:
        report.add(
            "feature_level", f"{group}/", False,
            f"group of feature level {level}, but the stored config has {rig.n_levels} level(s)",
        )
        return None
    return level


def _check_levels_present(report: StoreReport, rig: RigConfig, groups: Sequence[str]) -> None:
    """A multi-level store holds every level of each per-level group it has (level 0 present)."""
    if rig.n_levels == 1:
        return
    for base in checks_api.LEVEL_GROUPS:
        if base not in groups:
            continue
        missing = [checks_api.level_group(base, lv) for lv in range(1, rig.n_levels) if checks_api.level_group(base, lv) not in groups]
        report.add(
            "feature_levels", f"{base}/", not missing,
            f"{rig.n_levels} feature levels: " + (f"missing {', '.join(g + '/' for g in missing)}" if missing else "one group per level"),
        )


def run_plugin_checks(loaded: InspectedStore) -> None:
    """Run every plug-in's ``check_<group>`` on a loaded store (inspect without --strict; verify too)."""
    report = loaded.report
    contexts: dict[int | None, CheckContext] = {}
    if loaded.rig is not None:
        _check_levels_present(report, loaded.rig, [g.name for g in report.groups])
    for summary in report.groups:
        group = summary.name
        plugins = plugin_functions(group, "check")
        report.notes.extend(plugins.notes)
        report.checks.extend(plugins.import_failures)
        if not plugins.functions:
            if not plugins.import_failures:
                listed = checks_api.GROUP_PLUGINS.get(group, ())
                why = f"listed plug-ins {', '.join(listed)} are not installed" if listed else "no plug-in is registered for it"
                report.add("unknown_group", f"{group}/", False, f"unknown group: {why}, so nothing can vouch for its arrays")
            continue
        if loaded.rig is None:
            report.add("plugin_checks", f"{group}/", False, "skipped: the stored config is unusable (see the config check)")
            continue
        level = group_level(report, loaded.rig, group)
        if level is None:
            continue
        key = level if checks_api.split_level_group(group)[0] in checks_api.LEVEL_GROUPS else None
        if key not in contexts:  # one context per store and level: plug-ins share its float64 reference grid
            contexts[key] = check_context(loaded, loaded.rig, key)
        ctx = contexts[key]
        for module_name, fn in plugins.functions:
            summary.plugins.append(module_name)
            try:
                result = call_plugin(
                    fn, ctx, loaded.arrays.get(group, {}), loaded.group_attrs.get(group, {}), notes=report.notes, label=f"{module_name}.check_{group}"
                )
                checks = list(result)
                if not all(isinstance(c, Check) for c in checks):
                    raise TypeError("returned something other than Check objects")
            except MemoryError:  # the machine, not the store: one line, exit 2 at the CLI
                raise
            except Exception as exc:
                report.add("plugin_error", f"{group}/", False, f"{module_name}.check_{group} raised {_exc_line(exc)}")
                continue
            report.checks.extend(
                Check(c.name, checks_api.relabel_level(c.array, level), bool(c.passed), one_line(checks_api.relabel_level(c.reason, level)))
                for c in checks
            )


def _strict_checks(loaded: InspectedStore) -> None:
    report = loaded.report
    for summary in report.groups:
        group = summary.name
        stored = loaded.arrays.get(group, {})
        unreadable = sorted(a.name.split("/", 1)[1] for a in summary.arrays if a.name.split("/", 1)[1] not in stored)
        plugins = plugin_functions(group, "rebuild")
        if loaded.rig is None:
            report.add("strict", f"{group}/", False, "cannot rebuild: the stored config is unusable (see the config check)")
            continue
        level = group_level(report, loaded.rig, group)
        if level is None:
            continue
        level_rig = loaded.rig.level(level) if checks_api.split_level_group(group)[0] in checks_api.LEVEL_GROUPS else loaded.rig
        rebuilt: dict[str, np.ndarray] = {}
        origin: dict[str, str] = {}
        rebuilt_attrs: dict[str, Any] | None = None
        attrs_ok = True  # every module's rebuild ran and their attributes agree
        for module_name, fn in plugins.functions:
            try:
                args = (level_rig, loaded.group_attrs.get(group, {}), stored)
                result = call_plugin(fn, *args[: _rebuild_arity(fn)], notes=report.notes, label=f"{module_name}.rebuild_{group}")
                items = dict(result)
                module_attrs = items.pop(checks_api.REBUILT_ATTRS, None)
                if module_attrs is not None:
                    if not isinstance(module_attrs, Mapping):
                        raise TypeError(f"{checks_api.REBUILT_ATTRS!r} is not a mapping")
                    module_attrs = json_attrs(module_attrs)
            except MemoryError:
                raise
            except Exception as exc:
                report.add("strict", f"{group}/", False, f"{module_name}.rebuild_{group} raised {_exc_line(exc)}")
                attrs_ok = False
                continue
            if module_attrs is not None:
                conflicts: list[str] = []
                rebuilt_attrs = _merge_attrs(rebuilt_attrs or {}, module_attrs, "attrs", conflicts)
                for where in conflicts:
                    attrs_ok = False
                    report.add("strict_attrs", f"{group}/", False, f"rebuilds disagree on {where} ({module_name} and another plug-in)")
            for name, value in sorted(items.items()):
                array = np.asarray(value)
                if name in rebuilt and not _bit_equal(rebuilt[name], array):
                    report.add("strict", f"{group}/{name}", False, f"rebuilds disagree: {origin[name]} and {module_name} return different arrays")
                    continue
                rebuilt.setdefault(name, array)
                origin.setdefault(name, module_name)
        for name in sorted(stored):
            key = f"{group}/{name}"
            if name not in rebuilt:
                report.add("cannot_rebuild", key, False, f"no installed plug-in rebuilds {key} ({', '.join(checks_api.GROUP_PLUGINS.get(group, ())) or 'none registered'})")
                continue
            got, want = stored[name], rebuilt[name]
            if _bit_equal(got, want):
                report.add("strict", key, True, f"bit-identical to the rebuild by {origin[name]}")
            else:
                report.add("strict", key, False, f"differs from the rebuild by {origin[name]}: {_difference(got, want)}")
        for name in sorted(set(rebuilt) - set(stored) - set(unreadable)):
            report.add("strict", f"{group}/{name}", False, f"{origin[name]} rebuilds {group}/{name} from build_options but the store lacks it")
        if rebuilt_attrs is None:
            if plugins.functions and attrs_ok:
                report.notes.append(f"{group}/ attributes not compared under --strict: no installed plug-in rebuilds them")
        elif attrs_ok:
            _compare_attrs(report, group, json_attrs(loaded.group_attrs.get(group, {})), rebuilt_attrs)


def _rebuild_arity(fn: Callable[..., Any]) -> int:
    """3 for a ``rebuild_<group>(rig, attrs, arrays)`` that takes the stored arrays, else 2."""
    try:
        return 3 if len(inspect.signature(fn).parameters) >= 3 else 2
    except (TypeError, ValueError):
        return 2


STRICT_ATTRS_MAX_LINES = 20
"""At most this many ``strict_attrs`` failures per group (then one line counting the rest)."""
STRICT_ATTRS_EXCLUDED: dict[str, dict[str, str]] = {}
"""Group attributes ``--strict`` does not compare, with the reason: none today (every group
attribute is a pure function of the stored config and ``build_options``; builds are
deterministic, so floats are compared exactly)."""


def json_attrs(value: Any) -> Any:
    """Attributes as the store holds them: a JSON round trip (tuples become lists, numpy
    scalars and arrays plain numbers and lists)."""

    def builtin(item: Any) -> Any:
        if isinstance(item, np.generic):
            return item.item()
        if isinstance(item, np.ndarray):
            return item.tolist()
        if isinstance(item, Path):
            return str(item)
        raise TypeError(f"{type(item).__name__} is not JSON serialisable")

    return json.loads(json.dumps(value, default=builtin))


def _merge_attrs(into: dict[str, Any], add: Mapping[str, Any], path: str, conflicts: list[str]) -> dict[str, Any]:
    """``into`` updated with ``add``, mappings merged key by key; a leaf two modules set to
    different values is recorded in ``conflicts``."""
    out = dict(into)
    for key, value in add.items():
        where = f"{path}.{key}"
        if key not in out:
            out[key] = value
        elif isinstance(out[key], dict) and isinstance(value, dict):
            out[key] = _merge_attrs(out[key], value, where, conflicts)
        elif not _json_equal(out[key], value):
            conflicts.append(where)
    return out


def _json_equal(a: Any, b: Any) -> bool:
    """JSON equality that tells ``true`` from ``1`` and ``1`` from ``1.0`` (floats exactly)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_json_equal(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_json_equal(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


def _attr_differences(stored: Any, rebuilt: Any, path: str) -> list[tuple[str, str]]:
    """``(key path, what differs)`` of two JSON values, descending into mappings."""
    if isinstance(stored, dict) and isinstance(rebuilt, dict):
        out: list[tuple[str, str]] = []
        for key in sorted(set(stored) | set(rebuilt), key=str):
            where = f"{path}.{key}"
            if key not in rebuilt:
                out.append((where, f"stored {_short(stored[key])}, not written by the build"))
            elif key not in stored:
                out.append((where, f"missing, rebuilt {_short(rebuilt[key])}"))
            else:
                out.extend(_attr_differences(stored[key], rebuilt[key], where))
        return out
    if _json_equal(stored, rebuilt):
        return []
    return [(path, f"stored {_short(stored)}, rebuilt {_short(rebuilt)}")]


def _short(value: Any, width: int = 80) -> str:
    text = json.dumps(value, separators=(",", ":"))
    return text if len(text) <= width else text[: width - 1] + "…"


def _compare_attrs(report: StoreReport, group: str, stored: Any, rebuilt: dict[str, Any]) -> None:
    """``strict_attrs``: the stored group attributes equal the rebuilt ones, key by key."""
    excluded = {GROUP_CONFIG_ATTR: "written by the store writer (checked by group_config)", **STRICT_ATTRS_EXCLUDED.get(group, {})}
    if isinstance(stored, dict):
        stored = {k: v for k, v in stored.items() if k not in excluded}
    rebuilt = {k: v for k, v in rebuilt.items() if k not in excluded}
    diffs = _attr_differences(stored, rebuilt, "attrs")
    for where, what in diffs[:STRICT_ATTRS_MAX_LINES]:
        report.add("strict_attrs", f"{group}/", False, f"{where} {what}")
    if len(diffs) > STRICT_ATTRS_MAX_LINES:
        report.add("strict_attrs", f"{group}/", False, f"… and {len(diffs) - STRICT_ATTRS_MAX_LINES} more attribute difference(s)")
    if not diffs:
        note = f" ({', '.join(sorted(excluded))} excluded)" if excluded else ""
        report.add("strict_attrs", f"{group}/", True, f"all {len(rebuilt)} group attribute(s) equal the rebuild{note}")


def _bit_equal(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes()


def _difference(got: np.ndarray, want: np.ndarray) -> str:
    if got.dtype != want.dtype or got.shape != want.shape:
        return f"stored {got.dtype}{list(got.shape)}, rebuilt {want.dtype}{list(want.shape)}"
    ne = got != want
    if got.dtype.kind == "f":
        ne &= ~(np.isnan(got) & np.isnan(want))
    n = int(np.count_nonzero(ne))
    if got.dtype.kind in "fiu" and n:
        with np.errstate(invalid="ignore", over="ignore"):
            diff = np.abs(got.astype(np.float64) - want.astype(np.float64))[ne]
        return f"{n} of {got.size} element(s) differ (max |diff| {float(np.nanmax(diff)) if np.any(np.isfinite(diff)) else math.inf:.3g})"
    return f"{n} of {got.size} element(s) differ"


def inspect_store(path: str | Path, *, strict: bool = False, progress: Callable[[int], None] | None = None) -> StoreReport:
    """Every check of one store (see the module docstring). Never raises for a damaged store."""
    loaded = load_store(path, progress=progress)
    loaded.report.strict = strict
    if loaded.reader is None:
        return loaded.report
    run_plugin_checks(loaded)
    check_coordinates(loaded)
    if strict:
        _strict_checks(loaded)
    return loaded.report


def check_coordinates(loaded: InspectedStore) -> None:
    """``coordinates``: every group's coordinate arrays (:mod:`bevcompile.store.coords`) hold the
    stored config's values; one the group's axes call for and the store lacks is a note (a store
    written before bevcompile wrote them)."""
    if loaded.rig is None or loaded.reader is None:
        return
    report = loaded.report
    for group, stored in loaded.coordinates.items():
        try:
            expected = coordinate_arrays(loaded.rig, loaded.reader.axis_lengths(group), group)
        except StoreError:
            continue
        wrong = sorted(name for name, values in stored.items() if name not in expected or not same_coordinate(values, expected[name]))
        missing = sorted(set(expected) - set(stored))
        if missing:
            report.notes.append(f"{group}/ has no coordinate array for axis {', '.join(missing)} (written before bevcompile stored coordinates): xarray cannot select by it")
        if wrong:
            report.add("coordinates", f"{group}/", False, f"coordinate array(s) {', '.join(wrong)} differ from the stored config's (or name no axis of the group)")
        elif stored:
            report.add("coordinates", f"{group}/", True, f"coordinates {', '.join(stored)} match the stored config")


def count_arrays(paths: Iterable[Path]) -> int:
    """Arrays in the stores (for a progress bar's total); damaged parts count as 0."""
    total = 0
    for path in paths:
        for group_dir in _subdirs(path):
            total += sum(1 for a in _subdirs(group_dir))
    return total


def inspect_paths(
    paths: Sequence[str | Path], *, strict: bool = False, progress: Callable[[int], None] | None = None
) -> InspectReport:
    """Resolve ``paths`` (see :func:`resolve_store_paths`) and inspect every store."""
    stores = resolve_store_paths(paths)
    return InspectReport([inspect_store(p, strict=strict, progress=progress) for p in stores], strict=strict)
