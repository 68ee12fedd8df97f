"""``bevcompile.load``: a typed, read-only view of a store for model code (numpy only).

A deployment script should not have to know zarr, the group layout or the attribute names
to get the tables into its model. :func:`load` opens a store, checks that this version can
read it, re-parses the rig config it was built from and hands back a :class:`LoadedStore`:

* ``store.rig`` — the :class:`~bevcompile.config.RigConfig` the store was built from;
* ``store.conventions`` — the convention sentences recorded in the store;
* ``store["gather"]`` / ``store.group("gather")`` — a :class:`StoreGroup`: a read-only
  mapping of array name -> numpy array (``flags.writeable`` is False) with ``.attrs``.

Arrays are read on first access and cached; with ``verify=True`` (the default) each array's
content is checked against the ``sha256`` recorded at write time, so a model never loads a
silently corrupted table. :func:`load` also snapshots the store's identity (the root
attributes except the list of groups, every group's ``zarr.json`` bytes and every array's
recorded ``sha256``), so adding a group (``bevcompile matrix`` or ``export-interop`` into the
same store) leaves a loaded store readable;
every later lazy read checks the store still matches it, so a store rebuilt while a
``LoadedStore`` is held is a :class:`~bevcompile.errors.StoreError` ("... was rewritten since
it was loaded (reload it)"), never a mix of two builds. Every failure is a one-line
:class:`~bevcompile.errors.StoreError` (a missing group names the command that writes it; a
group or array whose folder exists but whose metadata is unreadable is reported as such).
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np

from ..errors import ConfigError, StoreError, hash_pair
from ..rig.config import RigConfig, config_sha256, parse_config
from .plugins import level_group, split_level_group
from .zarr_io import GROUP_CONFIG_ATTR, READABLE_FORMATS, ArrayInfo, StoreReader, open_store, read_metadata_file

GROUP_COMMANDS: dict[str, str] = {
    "grid": "bevcompile grid",
    "gather": "bevcompile grid",
    "delta": "bevcompile grid",
    "matrix": "bevcompile matrix",
    "interop": "bevcompile export-interop",
}
"""The command that writes each group (named in the error for a missing group)."""


def _read_bytes(path: Path) -> bytes | None:
    try:
        return read_metadata_file(path)  # a regular file of sane size: never a FIFO or a device
    except StoreError:
        return None


def _recorded_sha256(meta: bytes | None) -> str | None:
    """The ``sha256`` attribute in an array's ``zarr.json`` bytes (None if absent/unreadable)."""
    if meta is None:
        return None
    try:
        value = json.loads(meta).get("attributes", {}).get("sha256")
    except (ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


@dataclass(frozen=True)
class StoreIdentity:
    """What a store was when :func:`load` opened it (read straight from the ``zarr.json`` files).

    Convention: ``root`` the root attributes without ``groups`` (the list a command that adds a
    group changes; None if unreadable); ``groups`` group -> its ``zarr.json``
    bytes (None if unreadable); ``arrays`` ``(group, array)`` -> recorded ``sha256`` (None if
    its metadata has none or is unreadable).
    """

    root: Any
    groups: Mapping[str, bytes | None]
    arrays: Mapping[tuple[str, str], str | None]

    @classmethod
    def of(cls, path: Path) -> StoreIdentity:
        groups: dict[str, bytes | None] = {}
        arrays: dict[tuple[str, str], str | None] = {}
        for group_dir in _child_dirs(path):
            groups[group_dir.name] = _read_bytes(group_dir / "zarr.json")
            for array_dir in _child_dirs(group_dir):
                arrays[(group_dir.name, array_dir.name)] = _recorded_sha256(_read_bytes(array_dir / "zarr.json"))
        return cls(_root_identity(_read_bytes(path / "zarr.json")), MappingProxyType(groups), MappingProxyType(arrays))

    def changed(self, path: Path, group: str, array: str | None = None) -> bool:
        """True if the root, ``group`` (or ``group/array``) on disk differ from this snapshot."""
        if _root_identity(_read_bytes(path / "zarr.json")) != self.root:
            return True
        if _read_bytes(path / group / "zarr.json") != self.groups.get(group):
            return True
        if array is None:
            return False
        return _recorded_sha256(_read_bytes(path / group / array / "zarr.json")) != self.arrays.get((group, array))


def _child_dirs(path: Path) -> list[Path]:
    try:
        return sorted(p for p in path.iterdir() if p.is_dir() and not p.name.startswith("."))
    except OSError:
        return []


def _rewritten(path: Path) -> StoreError:
    return StoreError(f"{path} was rewritten since it was loaded (reload it): its arrays now belong to another build")


def _read_only(array: np.ndarray) -> np.ndarray:
    """A read-only view of a private read-only base: ``setflags(write=True)`` on it raises
    (numpy refuses to make a view writeable when its base is not)."""
    array.flags.writeable = False  # the base: only this module holds it
    view = array.view()
    view.flags.writeable = False
    return view


def _unreadable_detail(probe: Callable[[], Any], default: str) -> str:
    """Why a node whose folder exists cannot be opened: the reason in the reader's
    ``StoreError`` ("... missing or unreadable (<reason>)"), or ``default``."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            probe()
    except StoreError as exc:
        text = str(exc)
        start = text.find("(")
        return text[start + 1 : -1] if start >= 0 and text.endswith(")") else text
    return default


def _readable_array(reader: StoreReader, group: str, name: str) -> bool:
    return _unreadable_detail(lambda: reader.array_info(group, name), "") == ""


def _freeze(value: Any) -> Any:
    """Deep read-only copy of JSON-like attributes (dicts -> mappingproxy, lists -> tuples)."""
    if isinstance(value, Mapping):
        return MappingProxyType({str(k): _freeze(v) for k, v in value.items()})
    if isinstance(value, list | tuple):
        return tuple(_freeze(v) for v in value)
    return value


class StoreGroup(Mapping[str, np.ndarray]):
    """One group of a loaded store: a read-only mapping ``array name -> numpy array``.

    Arrays are read lazily (first access) and cached; every returned array has
    ``flags.writeable = False`` — copy it (``np.array(a)``) to modify. ``attrs`` is a
    read-only mapping of the group's attributes (nested dicts become mapping proxies,
    lists become tuples).
    """

    def __init__(self, reader: StoreReader, name: str, *, verify: bool, identity: StoreIdentity | None = None) -> None:
        self._reader = reader
        self.name = name
        self._verify = verify
        self._identity = identity
        try:
            self._names = tuple(reader.arrays(name))
        except StoreError:  # one array's zarr.json is not JSON: zarr cannot list any; keep the readable ones
            self._names = tuple(a for a in reader.child_dirs(name) if _readable_array(reader, name, a))
        self.attrs: Mapping[str, Any] = _freeze(reader.group_attrs(name))
        if identity is not None and identity.changed(reader.path, name):
            raise _rewritten(reader.path)
        self._cache: dict[str, np.ndarray] = {}

    def __getitem__(self, key: str) -> np.ndarray:
        if key not in self._names:
            if (self._reader.path / self.name / key).is_dir():
                detail = _unreadable_detail(lambda: self._reader.array_info(self.name, key), "not listed as an array")
                raise StoreError(
                    f"{self._reader.path}: array {self.name}/{key} is present but unreadable ({detail}); "
                    "the store is damaged: rebuild it"
                )
            available = ", ".join(self._names) or "none"
            raise StoreError(f"{self._reader.path}: no array {self.name}/{key} (arrays in {self.name}/: {available})")
        cached = self._cache.get(key)
        if cached is None:
            identity, path = self._identity, self._reader.path
            try:
                data = self._reader.read(self.name, key, verify_sha256=self._verify)
            except StoreError:
                if identity is not None and identity.changed(path, self.name, key):
                    raise _rewritten(path) from None
                raise
            # checked AFTER the read: the content matched the metadata at read time (verify), and
            # that metadata is still the one snapshotted at load()
            if identity is not None and identity.changed(path, self.name, key):
                raise _rewritten(path)
            cached = _read_only(data)
            self._cache[key] = cached
        return cached

    def get(self, key: str, default: Any = None) -> Any:
        """The array ``key`` or ``default`` when the group has no such array."""
        return self[key] if key in self._names else default

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __contains__(self, key: object) -> bool:
        return key in self._names

    def nbytes(self) -> int:
        """In-memory bytes of all arrays of the group (from metadata; nothing is read)."""
        return sum(self._reader.array_info(self.name, n).nbytes for n in self._names)

    def load_all(self) -> dict[str, np.ndarray]:
        """Read every array now (read-only views), e.g. before handing them to a thread."""
        return {name: self[name] for name in self._names}

    def __repr__(self) -> str:
        return f"StoreGroup({self.name!r}, arrays={list(self._names)})"


class LoadedStore:
    """A typed, read-only view of a bevcompile store (see :func:`load`).

    Attributes:
        path: the store directory.
        format: the store format string (``"bevcompile/1"``).
        tool_version: version of bevcompile that wrote the store.
        name: rig name.
        rig: the :class:`RigConfig` re-parsed from the stored config.
        config_sha256: hash of the stored config (checked against a recomputation).
        conventions: read-only mapping of the convention sentences recorded in the store.
        root_attrs: read-only mapping of all root attributes.
    """

    def __init__(
        self, reader: StoreReader, rig: RigConfig, *, verify: bool, identity: StoreIdentity | None = None
    ) -> None:
        attrs = reader.root_attrs
        self._reader = reader
        self._verify = verify
        self._identity = identity
        self.path: Path = reader.path
        self.format: str = str(attrs.get("format"))
        self.tool_version: str = str(attrs.get("tool_version"))
        self.name: str = rig.name
        self.rig: RigConfig = rig
        self.config_sha256: str = str(attrs.get("config_sha256"))
        self.conventions: Mapping[str, str] = _freeze(attrs.get("conventions") or {})
        self.root_attrs: Mapping[str, Any] = _freeze(attrs)
        self._groups: dict[str, StoreGroup] = {}

    @property
    def group_names(self) -> tuple[str, ...]:
        """Names of the readable groups, sorted."""
        return tuple(self._reader.groups())

    def has_group(self, name: str) -> bool:
        """True for a readable group AND for a group folder that is present but unreadable
        (so that ``source="auto"`` does not silently fall back to another group: reading it
        raises :class:`StoreError` saying what is wrong)."""
        if self._reader.has_group(name):
            return True
        try:
            return (self.path / name).is_dir()
        except OSError:
            return True  # there is something, and reading it will say what is wrong

    def group(self, name: str) -> StoreGroup:
        """The group ``name``; a missing group is a :class:`StoreError` naming the command
        that writes it."""
        cached = self._groups.get(name)
        if cached is not None:
            return cached
        if not self._reader.has_group(name):
            command = GROUP_COMMANDS.get(split_level_group(name)[0])
            if (self.path / name).is_dir():
                detail = _unreadable_detail(lambda: self._reader.group_attrs(name), "not a group")
                hint = f"; run `{command}` to rewrite it" if command else ""
                raise StoreError(f"{self.path}: group {name}/ is present but unreadable ({detail}){hint}")
            hint = f"; run `{command}` to add it" if command else ""
            present = ", ".join(self._reader.groups()) or "none"
            raise StoreError(f"{self.path}: no group {name}/ in this store (groups: {present}){hint}")
        if self._identity is not None and name not in self._identity.groups:
            raise StoreError(
                f"{self.path}: group {name}/ was added after this store was loaded; reload it to read {name}/"
            )
        group = StoreGroup(self._reader, name, verify=self._verify, identity=self._identity)
        group_sha = group.attrs.get(GROUP_CONFIG_ATTR)
        root_sha = self._reader.root_attrs.get("config_sha256")
        if group_sha != root_sha:  # never serve a group of another car, nor one that does not say whose it is
            command = GROUP_COMMANDS.get(name)
            if group_sha is None:
                why = f"records no {GROUP_CONFIG_ATTR}, so nothing proves it was built from this store's config"
            else:
                ours, root = hash_pair(group_sha, root_sha)
                why = f"was built from another config (config_sha256 {ours}, the store's {root})"
            raise StoreError(f"{self.path}: group {name}/ {why}" + (f"; run `{command}` to rebuild it" if command else ""))
        self._groups[name] = group
        return group

    def __getitem__(self, name: str) -> StoreGroup:
        return self.group(name)

    def array_info(self, group: str, name: str) -> ArrayInfo:
        """Shape, dtype, chunking and attributes of one array (reads metadata only)."""
        return self._reader.array_info(group, name)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self.has_group(name)

    @property
    def feature_size(self) -> tuple[int, int]:
        """``(W_f, H_f)`` of the rig's (level 0) feature map."""
        return self.rig.feature_size

    @property
    def n_levels(self) -> int:
        """Feature levels of the rig (``feature.levels``; 1 for a single feature map)."""
        return self.rig.n_levels

    def level_feature_size(self, level: int) -> tuple[int, int]:
        """``(W_l, H_l)`` of feature level ``level``."""
        return self.rig.level(level).feature_size

    def level_group(self, base: str, level: int) -> StoreGroup:
        """The group ``base`` (``grid``, ``gather``, ``delta``) of feature level ``level``:
        ``store.level_group("gather", 2)`` is ``store["gather_l2"]``; level 0 is ``store["gather"]``."""
        if not 0 <= level < self.n_levels:
            raise StoreError(f"{self.path}: no feature level {level} (the rig has {self.n_levels})")
        return self.group(level_group(base, level))

    @property
    def bev_frame(self) -> str:
        """The frame of the BEV grid (``bev.frame``): ``"ego"`` or a sensor's name, e.g. ``"LIDAR_TOP"``."""
        return self.rig.bev.frame

    @property
    def bev_shape(self) -> tuple[int, int, int]:
        """``(n_heights, ny, nx)``."""
        return len(self.rig.bev.heights), self.rig.bev.ny, self.rig.bev.nx

    def level_bev_shape(self, level: int) -> tuple[int, int, int]:
        """``(n_heights, ny, nx)`` of feature level ``level``'s grid (its own with
        ``feature.levels[l].bev``, else :attr:`bev_shape`)."""
        bev = self.rig.level(level).bev
        return len(bev.heights), bev.ny, bev.nx

    def __repr__(self) -> str:
        return f"LoadedStore({str(self.path)!r}, name={self.name!r}, groups={list(self.group_names)})"


def load(path: str | Path | LoadedStore, *, verify: bool = True) -> LoadedStore:
    """Open a store as a typed, read-only view (numpy only, no extra dependencies).

    Args:
        path: the store directory (``artifacts/<name>.zarr``); a :class:`LoadedStore` is
            returned unchanged.
        verify: check each array's content against its recorded ``sha256`` when it is read.

    Raises:
        StoreError: not a store, a format version this tool cannot read, a stored config
            that does not parse or whose hash does not match ``config_sha256``, and (later,
            on access) a missing group/array or unreadable/corrupted data.

    Example::

        store = bevcompile.load("artifacts/nuscenes.zarr")
        index = store["gather"]["index"]        # int32 (n_cam, n_heights, ny, nx, 4), read-only
        w_f, h_f = store.feature_size
    """
    if isinstance(path, LoadedStore):
        return path
    for _attempt in range(SWAP_RETRIES):
        reader = open_store(path)
        before = reader.generation()
        loaded = _load(reader, verify)
        if reader.generation() == before:
            return loaded
    raise _rewritten(Path(path))  # rebuilt again and again while being opened


SWAP_RETRIES = 5
"""``load`` opens a store again when a writer swapped a new build in while it was being opened."""


def _load(reader: StoreReader, verify: bool) -> LoadedStore:
    attrs = reader.root_attrs
    fmt = attrs.get("format")
    if fmt is None:
        from .inspection import not_a_store_root

        not_a_store_root(Path(reader.path), "load")
        raise StoreError(f"{reader.path}: not a bevcompile store (no 'format' root attribute)")
    if fmt not in READABLE_FORMATS:
        raise StoreError(
            f"{reader.path}: store format {fmt!r} cannot be read by this bevcompile (reads {', '.join(READABLE_FORMATS)}); "
            "rebuild the store or upgrade bevcompile"
        )
    config_data = attrs.get("config")
    if config_data is None:
        raise StoreError(f"{reader.path}: no 'config' root attribute")
    try:
        rig = parse_config(config_data, source=f"{reader.path}:config")
    except ConfigError as exc:
        raise StoreError(f"stored config does not parse: {exc}") from None
    recorded = attrs.get("config_sha256")
    actual = config_sha256(rig)
    if recorded != actual:
        raise StoreError(
            f"{reader.path}: stored config hash {hash_pair(recorded, actual)[0]} does not match its config ({hash_pair(recorded, actual)[1]}); "
            "the store was edited or is damaged"
        )
    identity = StoreIdentity.of(reader.path)
    if identity.root != _without_groups(attrs):
        raise _rewritten(reader.path)  # replaced between opening it and taking the snapshot
    return LoadedStore(reader, rig, verify=verify, identity=identity)


def _without_groups(attrs: Any) -> Any:
    if not isinstance(attrs, dict):
        return None
    return {key: value for key, value in attrs.items() if key != "groups"}


def _root_identity(meta: bytes | None) -> Any:
    """The root attributes minus ``groups`` (None if unreadable): what must not change
    while a store is loaded. A command that adds a group changes only ``groups``."""
    try:
        return _without_groups(json.loads(meta or b"").get("attributes"))
    except (ValueError, AttributeError):
        return None


@dataclass(frozen=True)
class MatrixLayout:
    """How a store's ``matrix/`` group maps onto the BEV grid (derived from its arrays and
    ``build_options``; nothing is taken on trust from other attributes).

    Convention:
        ``mode`` ``"frustum"`` (columns ``((cam*D + d)*H_f + v)*W_f + u``), ``"grid"`` or ``"ray"``
        (columns ``(cam*H_f + v)*W_f + u``: features alone, no depth); ``n_rows`` logical rows; ``row_cells`` int64
        ``(n_rows,)`` = BEV cell ``iy*nx + ix`` of each row (``row_ids``, or ``arange``);
        ``rows_pad``/``k_pad`` the ELL shape; ``tile_rows`` R (None without tiles).
    """

    mode: str
    n_rows: int
    n_cols: int
    n_cells: int
    row_cells: np.ndarray
    rows_pad: int
    k_pad: int
    tile_rows: int | None
    build_options: Mapping[str, Any]
    expand: np.ndarray | None = None
    """``bev.region`` stores: int32 ``(ny * nx,)`` ``matrix/expand``, the row of every fine cell
    (``n_rows - 1``, the zero row, outside the region); ``row_cells`` is then ``arange(n_rows)``."""


def matrix_layout(store: LoadedStore) -> MatrixLayout:
    """The :class:`MatrixLayout` of ``store["matrix"]`` (StoreError if inconsistent)."""
    group = store["matrix"]
    options = group.attrs.get("build_options")
    if not isinstance(options, Mapping) or options.get("mode") not in ("frustum", "grid", "ray"):
        raise StoreError(f"{store.path}: matrix/ has no readable build_options.mode (frustum, grid or ray)")
    mode = str(options["mode"])
    rig = store.rig
    w_f, h_f = rig.feature_size
    n_cols = rig.n_cam * (rig.depth.n_bins if mode == "frustum" else 1) * h_f * w_f
    _, ny, nx = store.bev_shape
    n_cells = ny * nx
    expand: np.ndarray | None = None
    if "expand" in group:  # bev.region: rows = the kept (super-)cells + the zero row
        expand = np.asarray(group["expand"])
        n_kept = int(store.array_info("matrix", "cells").shape[0]) if "cells" in group else -1
        if expand.shape != (n_cells,) or n_kept < 0 or (expand.size and (int(expand.min()) < 0 or int(expand.max()) > n_kept)):
            raise StoreError(f"{store.path}: matrix/expand is not a ({n_cells},) index into matrix/cells rows + the zero row")
        row_cells = np.arange(n_kept + 1, dtype=np.int64)
    elif "row_ids" in group:
        row_cells = np.asarray(group["row_ids"], dtype=np.int64)
        if row_cells.ndim != 1 or (row_cells.size and (row_cells.min() < 0 or row_cells.max() >= n_cells)):
            raise StoreError(f"{store.path}: matrix/row_ids out of range [0, {n_cells})")
    else:
        row_cells = np.arange(n_cells, dtype=np.int64)
    ell_shape = store.array_info("matrix", "ell_index").shape
    if len(ell_shape) != 2 or ell_shape[0] < row_cells.size:
        raise StoreError(f"{store.path}: matrix/ell_index has shape {ell_shape}; expected ({row_cells.size}+, k_pad)")
    tile_rows = options.get("tile_rows")
    return MatrixLayout(
        mode=mode,
        n_rows=int(row_cells.size),
        n_cols=n_cols,
        n_cells=n_cells,
        row_cells=row_cells,
        rows_pad=int(ell_shape[0]),
        k_pad=int(ell_shape[1]),
        tile_rows=int(tile_rows) if tile_rows is not None else None,
        build_options=options,
        expand=expand,
    )
