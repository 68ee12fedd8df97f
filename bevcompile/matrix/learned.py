"""Learned matrix values on the fixed geometric topology: ``bevcompile absorb`` -> ``matrix/``.

DeployMatBEV-style training keeps the sparsity pattern the camera geometry gave (``bevcompile
matrix``) and learns the VALUES (``bevcompile.torch.LearnableLift``: the ELL values are the
parameter). ``absorb`` brings trained values back into the store:

* the topology is the geometric build's, rebuilt here from the stored config and
  ``build_options`` and required equal to the stored one: ``coo_row``, ``coo_col``, ``ell_index``,
  ``row_ids`` (and ``tile_cols`` / ``tile_col_offsets``, derived from them) never change; nor do
  a ``bev.region`` store's ``cells`` and ``expand`` (its rows are the kept (super-)cells and the
  zero row, learned like any row; ``camera_mass`` is laid out on the dense map through ``expand``);
* the learned values are the ELL "real slots" (slot ``j`` of row ``r`` with ``j < nnz(r)``, the
  row's j-th entry by increasing column); padding slots must be exactly 0; an entry whose learned
  value is 0 (or negative) stays in the COO;
* every value product is re-derived from them with the code of the geometric build
  (:func:`bevcompile.matrix.build.value_products`): ``coo_val``, ``ell_weight``, tiles, int8,
  ``camera_mass``;
* the geometric values are kept as ``init_ell_weight`` (float32 ``(rows_pad, k_pad)``) and the
  group attributes gain ``values: "learned"`` and ``learned {checkpoint, checkpoint_sha256, key,
  format, dtype, values_sha256, init_sha256, change}``.

A store built this way is a pure function of (config, ``build_options``, learned ELL values):
``inspect --strict`` rebuilds it with the same functions and requires bit equality.
Pure except :func:`run_absorb` (reads the checkpoint through :mod:`.checkpoint`, writes through
:mod:`bevcompile.store.zarr_io`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from ..errors import CheckpointError, StoreError, UsageError
from ..grid.build import check_grid_memory
from ..rig.config import RigConfig
from ..store.loader import LoadedStore, load
from ..store.root import root_attributes
from ..store.zarr_io import GroupData, WriteReport, array_sha256, write_groups
from .build import (
    MATRIX_COMMAND_GROUPS,
    QUANTIZE,
    VALUES_ATTR,
    VALUES_LEARNED,
    MatrixOptions,
    MatrixProducts,
    build_matrix,
    check_frustum_memory,
    is_learned,
    matrix_attributes,
    matrix_dims,
    value_products,
)
from .checkpoint import Checkpoint, Tensor, read_checkpoint
from .precision import Fp16Rule, row_distances_m
from .prior import ARRAY as PRIOR_ARRAY
from .prior import prior_of_store

INIT_ARRAY = "init_ell_weight"
TOPOLOGY_ARRAYS = ("coo_row", "coo_col", "ell_index", "row_ids", "tile_cols", "tile_col_offsets", "cells", "expand")
"""Arrays of a learned ``matrix/`` that are the geometric build's, bit for bit."""
LEARNED_RULE = (
    "the topology (coo_row, coo_col, ell_index, row_ids, tile_cols, tile_col_offsets) is the geometric build's; "
    "the learned values are the ELL real slots (slot j < nnz of row r: the row's j-th entry by increasing column), "
    "padding slots 0; coo_val, ell_weight, tiles, int8 and camera_mass are derived from them exactly as in a geometric "
    "build; an entry whose learned value is 0 stays in the COO"
)
INIT_RULE = "init_ell_weight: the geometric ell_weight of the same build_options; weight_rule, normalize_rule, topk_rule and kept_weight_fraction describe it"
KEEP = "keep"
"""``run_absorb(quantize=KEEP, tile_rows=KEEP)``: keep the store's ``--quantize`` / ``--tile-rows``."""

F32 = npt.NDArray[np.float32]
I64 = npt.NDArray[np.int64]


def coo_slots(coo_row: npt.NDArray[np.integer[Any]]) -> I64:
    """ELL slot of every COO entry. Convention: ``coo_row`` ``(nnz,)`` sorted -> int64 ``(nnz,)``:
    the entry's position within its row (the ELL slot it occupies)."""
    row = np.asarray(coo_row, np.int64)
    if not row.size:
        return np.zeros(0, np.int64)
    starts = np.flatnonzero(np.r_[True, row[1:] != row[:-1]])
    counts = np.diff(np.r_[starts, row.size])
    return np.arange(row.size) - np.repeat(starts, counts)


def real_slots(coo_row: npt.NDArray[np.integer[Any]], shape: tuple[int, int]) -> npt.NDArray[np.bool_]:
    """Convention: ``coo_row`` ``(nnz,)`` sorted, ``shape`` ``(rows_pad, k_pad)`` -> bool of that
    shape, True at the slots that hold an entry (``slot < nnz(row)``), False at padding."""
    mask = np.zeros(shape, dtype=bool)
    row = np.asarray(coo_row, np.int64)
    if row.size:
        mask[row, coo_slots(row)] = True
    return mask


# --------------------------------------------------------------------------------------
# the learned products and the matrix/ group
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LearnedRecord:
    """Where the learned values came from (recorded in ``matrix/`` ``attrs["learned"]``; not
    derivable from the values, so ``--strict`` takes them from the store)."""

    checkpoint: str  # file name (not the path: the same file gives the same store from any folder)
    checkpoint_sha256: str
    key: str | None  # tensor path in the checkpoint (None: the one array of a .npy)
    format: str  # pytorch, npy, npz, safetensors
    dtype: str  # stored dtype of the tensor (converted to float32)

    def to_dict(self) -> dict[str, Any]:
        return {"checkpoint": self.checkpoint, "checkpoint_sha256": self.checkpoint_sha256, "key": self.key, "format": self.format, "dtype": self.dtype}

    @classmethod
    def from_attrs(cls, attrs: Mapping[str, Any]) -> LearnedRecord:
        info = attrs.get("learned")
        if not isinstance(info, Mapping):
            raise ValueError("values: learned but no learned attribute mapping")
        try:
            return cls(str(info["checkpoint"]), str(info["checkpoint_sha256"]), info["key"], str(info["format"]), str(info["dtype"]))
        except KeyError as exc:
            raise ValueError(f"learned attribute lacks {exc.args[0]!r}") from None


def learned_products(rig: RigConfig, geometric: MatrixProducts, learned_ell: npt.ArrayLike) -> MatrixProducts:
    """The products of ``geometric`` with the values of ``learned_ell`` on its topology.

    Convention: ``learned_ell`` ``(rows_pad, k_pad)`` in the store's ELL layout; only its real
    slots are read (padding is laid out as 0 again); float32. Returns :class:`MatrixProducts` whose
    topology arrays are ``geometric``'s and whose value arrays (``coo_val``, ``ell_weight``, tiles,
    int8, ``camera_mass``) and int8 figures are re-derived by
    :func:`bevcompile.matrix.build.value_products`; ``product_bytes`` gains ``init_ell_weight``.
    """
    learned_ell = np.asarray(learned_ell, dtype=np.float32)
    shape = (geometric.rows_pad, geometric.k_pad)
    if learned_ell.shape != shape:
        raise UsageError(f"learned values {learned_ell.shape} are not the ELL shape {shape}")
    options = geometric.options
    coo_val = np.ascontiguousarray(learned_ell[geometric.coo_row.astype(np.int64), coo_slots(geometric.coo_row)], dtype=np.float32)
    row_cells = geometric.row_ids.astype(np.int64) if geometric.row_ids is not None else np.arange(geometric.n_rows, dtype=np.int64)
    cells = row_cells[geometric.coo_row.astype(np.int64)]
    distance = row_distances_m(rig, geometric.n_rows, geometric.row_ids, geometric.region_cells) if options.quantize == "mixed" else None
    values = value_products(
        rig, options, geometric.coo_row, geometric.coo_col, coo_val, cells, geometric.n_rows, *shape, expand=geometric.expand, row_distance=distance
    )
    if geometric.region_cells is not None and geometric.expand is not None:  # bev.region: the cell table and expand are topology
        values.product_bytes["cells"] = int(geometric.region_cells.nbytes)
        values.product_bytes["expand"] = int(geometric.expand.nbytes)
    if geometric.row_ids is not None:
        values.product_bytes["row_ids"] = int(geometric.row_ids.nbytes)
    values.product_bytes[INIT_ARRAY] = int(geometric.ell_weight.nbytes)
    figures = replace(
        geometric.figures,
        int8_max_rel_error=values.int8_max_rel_error,
        int8_max_abs_error=values.int8_max_abs_error,
        fp16_max_rel_error=values.fp16_max_rel_error,
        fp16_max_abs_error=values.fp16_max_abs_error,
        n_fp16_rows=None if values.fp16_rows is None else int(values.fp16_rows.size),
        tile_bytes=values.product_bytes.get("tiles"),
        product_bytes=values.product_bytes,
    )
    return replace(geometric, coo_val=coo_val, figures=figures, extra={}, **values.fields())


def value_change(init_coo: F32, learned_coo: F32) -> dict[str, Any]:
    """How far the learned COO values are from the init (float64 figures, recorded in the store).

    Convention: both ``(nnz,)`` float32 in COO order; ``mean_rel_change`` = mean over entries of
    ``|w - w_init| / |w_init|`` (``w_init > 0`` for every geometric entry), ``max_rel_change`` its max."""
    w0 = np.asarray(init_coo, np.float64)
    w1 = np.asarray(learned_coo, np.float64)
    rel = np.abs(w1 - w0) / np.where(w0 != 0, np.abs(w0), 1.0)
    return {
        "entries": int(w0.size),
        "changed": int(np.count_nonzero(w1 != w0)),
        "zero": int(np.count_nonzero(w1 == 0)),
        "negative": int(np.count_nonzero(w1 < 0)),
        "mean_rel_change": float(rel.mean()) if rel.size else 0.0,
        "max_rel_change": float(rel.max()) if rel.size else 0.0,
        "mass_init": float(w0.sum()),
        "mass_learned": float(w1.sum()),
        "definition": "over the COO entries: changed = learned != init; rel_change = |learned - init| / init (float64)",
    }


def learned_attributes(rig: RigConfig, geometric: MatrixProducts, learned: MatrixProducts, record: LearnedRecord) -> dict[str, Any]:
    """``matrix/`` attributes of a learned store: those of a build of ``learned`` plus ``values``
    and ``learned`` (deterministic: no timings, no paths)."""
    attrs = matrix_attributes(learned, rig)
    attrs[VALUES_ATTR] = VALUES_LEARNED
    attrs["learned"] = {
        **record.to_dict(),
        "values_sha256": array_sha256(learned.ell_weight),
        "init_sha256": array_sha256(geometric.ell_weight),
        "rule": LEARNED_RULE,
        "init": INIT_RULE,
        "change": value_change(geometric.coo_val, learned.coo_val),
    }
    return attrs


INIT_SOURCE = "ell_weight"
"""The array ``init_ell_weight`` keeps a copy of (same shape, same dimension names)."""


def learned_group(rig: RigConfig, geometric: MatrixProducts, learned: MatrixProducts, record: LearnedRecord) -> GroupData:
    """The ``matrix/`` group of a learned store: the learned products, ``init_ell_weight`` and the attributes."""
    arrays = {**learned.arrays(), INIT_ARRAY: geometric.ell_weight}
    dims = matrix_dims(arrays, {INIT_ARRAY: INIT_SOURCE})
    return GroupData(arrays=arrays, attrs=learned_attributes(rig, geometric, learned, record), dims=dims)


# --------------------------------------------------------------------------------------
# finding and checking the learned values in a checkpoint
# --------------------------------------------------------------------------------------


def _shape(shape: tuple[int, ...]) -> str:
    return "(" + ", ".join(str(s) for s in shape) + ")"


def _label(tensor: Tensor) -> str:
    return f"{tensor.name or '<array>'} {tensor.dtype} {_shape(tensor.shape)}"


def select_values(checkpoint: Checkpoint, shown: str, ell_shape: tuple[int, int], key: str | None) -> Tensor:
    """The tensor holding the learned values: ``key``, or the single floating-point tensor of the
    store's ELL shape. None or several -> :class:`CheckpointError` listing the candidates."""
    tensors = checkpoint.tensors
    if checkpoint.format == "npy":
        if key is not None:
            raise UsageError(f"--key {key!r}: {shown} is a .npy holding one array; --key names a tensor of a .pt, .npz or .safetensors file")
        return tensors[""]
    if key is not None:
        if key in tensors:
            return tensors[key]
        near = [name for name in tensors if name.endswith("." + key) or key.endswith("." + name)]
        labels = [_label(t) for t in tensors.values() if t.shape == ell_shape and t.kind == "f"]
        hint = f"; did you mean {', '.join(near[:5])}?" if near else ""
        listing = f"; tensors of the ELL shape {_shape(ell_shape)}: {', '.join(labels) if labels else 'none'}"
        raise CheckpointError(shown, key, f"no such tensor in the checkpoint{hint}{listing}")
    fits = [t for t in tensors.values() if t.shape == ell_shape and t.kind == "f"]
    if len(fits) == 1:
        return fits[0]
    if not fits:
        floats = [t for t in tensors.values() if t.kind == "f" and len(t.shape) == 2]
        seen = ", ".join(_label(t) for t in floats[:8]) + (f", … ({len(floats) - 8} more)" if len(floats) > 8 else "")
        raise CheckpointError(
            shown, "",
            f"no floating-point tensor of the store's ELL shape {_shape(ell_shape)} (rows_pad, k_pad); 2-D float tensors: {seen or 'none'}",
        )
    names = ", ".join(t.name for t in fits)
    raise CheckpointError(shown, "", f"{len(fits)} tensors of the ELL shape {_shape(ell_shape)}: {names}; pass --key NAME")


def _first(mask: npt.NDArray[np.bool_]) -> tuple[int, int]:
    """``(row, slot)`` of the first True of a 2-D mask (row-major)."""
    r, j = np.nonzero(mask)
    return int(r[0]), int(j[0])


def check_values(tensor: Tensor, shown: str, ell_shape: tuple[int, int], real: npt.NDArray[np.bool_]) -> F32:
    """The learned values as float32, or :class:`CheckpointError` for a wrong shape or dtype, a
    value that is not finite (in float32) or a padding slot that is not exactly 0."""
    field = tensor.name or ""
    if tensor.shape != ell_shape:
        raise CheckpointError(shown, field, f"shape {_shape(tensor.shape)} is not the store's ELL shape {_shape(ell_shape)} (rows_pad, k_pad)")
    if tensor.kind != "f":
        raise CheckpointError(shown, field, f"dtype {tensor.dtype}: the learned values must be floating point")
    raw = tensor.load()
    with np.errstate(over="ignore", invalid="ignore"):
        values = np.ascontiguousarray(raw, dtype=np.float32)
    bad = ~np.isfinite(values)
    if bad.any():
        r, j = _first(bad)
        cause = "" if not np.all(np.isfinite(np.asarray(raw, np.float64)[bad])) else " after conversion to float32"
        raise CheckpointError(shown, field, f"{int(bad.sum())} value(s) not finite{cause} (first at row {r}, slot {j})")
    padding = (~real) & (values != 0)
    if padding.any():
        r, j = _first(padding)
        raise CheckpointError(
            shown, field,
            f"{int(padding.sum())} padding slot(s) not exactly 0 (first at row {r}, slot {j}); LearnableLift keeps padding at 0: "
            "were these values trained on another store's topology?",
        )
    return values


def check_index(checkpoint: Checkpoint, shown: str, values_key: str, ell_index: npt.NDArray[np.int32]) -> str | None:
    """When the checkpoint holds ``ell_index`` beside the values (same prefix), it must be the
    store's exactly (a changed topology: :class:`CheckpointError`). Returns its name (None if absent)."""
    prefix = values_key.rpartition(".")[0]
    name = f"{prefix}.ell_index" if prefix else "ell_index"
    tensor = checkpoint.tensors.get(name)
    if tensor is None:
        return None
    if tensor.shape != ell_index.shape or tensor.kind not in "iu":
        raise CheckpointError(shown, name, f"{tensor.dtype} {_shape(tensor.shape)} is not the store's int32 {_shape(ell_index.shape)} topology")
    index = np.asarray(tensor.load(), dtype=np.int64)
    differ = index != ell_index.astype(np.int64)
    if differ.any():
        r, j = _first(differ)
        raise CheckpointError(
            shown, name,
            f"the topology differs from the store's: {int(differ.sum())} index(es) differ (first at row {r}, slot {j}); "
            "these values were trained on another matrix",
        )
    return name


# --------------------------------------------------------------------------------------
# bevcompile absorb
# --------------------------------------------------------------------------------------


@dataclass
class AbsorbResult:
    """What :func:`run_absorb` read and wrote (``to_json`` for ``--json``)."""

    store: Path
    checkpoint: Path
    record: LearnedRecord
    index_checked: str | None
    options: MatrixOptions
    products: MatrixProducts
    change: dict[str, Any]
    previous: str  # "geometric" or "learned" (a re-absorb)
    write: WriteReport
    seconds: float

    def to_json(self) -> dict[str, Any]:
        p = self.products
        return {
            "store": str(self.store),
            "checkpoint": str(self.checkpoint),
            **{k: v for k, v in self.record.to_dict().items() if k != "checkpoint"},
            "ell_index_checked": self.index_checked,
            "previous_values": self.previous,
            "build_options": self.options.to_dict(),
            "ell_shape": [p.rows_pad, p.k_pad],
            "nnz": p.figures.nnz,
            "change": self.change,
            "int8_max_rel_error": p.figures.int8_max_rel_error,
            "products": sorted([*p.arrays(), INIT_ARRAY]),
            "bytes_written": self.write.bytes_per_array,
            "bytes_total": self.write.total_bytes,
            "seconds": round(self.seconds, 3),
        }


def absorb_options(
    stored: MatrixOptions, quantize: str | None = KEEP, tile_rows: int | str | None = KEEP, fp16_rows: str | None = KEEP
) -> MatrixOptions:
    """The stored build options with ``--quantize`` / ``--tile-rows`` / ``--fp16-rows`` changed
    (``KEEP``: as stored; a ``--quantize`` other than mixed drops the stored rule). They only add
    or drop products laid out from the values; the topology options stay."""
    changes: dict[str, Any] = {}
    if quantize != KEEP:
        if quantize not in QUANTIZE:
            raise UsageError(f"--quantize must be one of int8, fp16, mixed, none, got {quantize!r}")
        changes["quantize"] = quantize
        if quantize != "mixed":
            changes["fp16_rows"] = None
    if fp16_rows != KEEP:
        changes["fp16_rows"] = None if fp16_rows is None else Fp16Rule.parse(fp16_rows).token
    if tile_rows != KEEP:
        changes["tile_rows"] = tile_rows
    return replace(stored, **changes).validate()


def geometric_reference(loaded: LoadedStore, options: MatrixOptions, progress: Callable[[int], None] | None = None) -> MatrixProducts:
    """The geometric build of the store's config with ``options``, required equal to the store's
    topology and geometric values (``ell_weight``, or ``init_ell_weight`` of a learned store):
    :class:`StoreError` naming the first array that differs (the store is stale or damaged)."""
    rig = loaded.rig
    if options.mode == "grid":
        check_grid_memory(rig, "bevcompile absorb (geometric rebuild, --mode grid)")
    check_frustum_memory(rig, options)
    group = loaded["matrix"]
    prior = None
    if options.mode == "ray":
        try:
            stored = group[PRIOR_ARRAY] if PRIOR_ARRAY in group else None  # noqa: SIM401 - a store group, not a dict
            prior = prior_of_store(options.depth_prior, stored, rig, f"{loaded.path}: matrix/", group.attrs.get("depth_prior"))
        except ValueError as exc:
            raise StoreError(f"{exc}; rebuild it with `bevcompile matrix --force`") from None
    geometric = build_matrix(rig, options, progress=progress, depth_prior=prior)
    init_name = INIT_ARRAY if is_learned(group.attrs) else "ell_weight"
    built = geometric.arrays()
    for name in (*(n for n in TOPOLOGY_ARRAYS if n in built and n in group), init_name):
        stored = group[name]
        want = built["ell_weight" if name == INIT_ARRAY else name]
        if stored.dtype != want.dtype or stored.shape != want.shape or not np.array_equal(stored, want):
            raise StoreError(
                f"{loaded.path}: matrix/{name} differs from the geometric rebuild of its config and build_options "
                "(a stale or damaged store: `bevcompile inspect --strict` says more); rebuild it with `bevcompile matrix --force`"
            )
    return geometric


def run_absorb(
    store: str | Path,
    checkpoint: str | Path,
    *,
    key: str | None = None,
    quantize: str | None = KEEP,
    tile_rows: int | str | None = KEEP,
    progress: Callable[[int], None] | None = None,
    fp16_rows: str | None = KEEP,
) -> AbsorbResult:
    """Absorb the learned values of ``checkpoint`` into ``store``'s ``matrix/`` (see the module
    docstring). Every check runs before the write, which is atomic: a refusal leaves the store as
    it was. Raises :class:`CheckpointError` (bad checkpoint), :class:`StoreError` (not a store, no
    ``matrix/``, a stale topology), :class:`UsageError` (bad options) — all exit 2 in the CLI."""
    t0 = time.perf_counter()
    store_dir = Path(store)
    loaded = load(store_dir)
    rig = loaded.rig
    group = loaded["matrix"]
    try:
        stored_options = MatrixOptions.from_dict(group.attrs.get("build_options") or {})
    except (UsageError, TypeError) as exc:
        raise StoreError(f"{loaded.path}: matrix/ build_options unusable ({exc}); run `bevcompile inspect`") from None
    options = absorb_options(stored_options, quantize, tile_rows, fp16_rows)
    previous = VALUES_LEARNED if is_learned(group.attrs) else "geometric"
    ell_index = group["ell_index"]
    ell_shape = (int(ell_index.shape[0]), int(ell_index.shape[1]))
    shown = str(checkpoint)
    contents = read_checkpoint(checkpoint, shown=shown)
    tensor = select_values(contents, shown, ell_shape, key)
    values = check_values(tensor, shown, ell_shape, real_slots(group["coo_row"], ell_shape))
    index_checked = check_index(contents, shown, tensor.name, ell_index) if tensor.name else None
    geometric = geometric_reference(loaded, options, progress)
    learned = learned_products(rig, geometric, values)
    record = LearnedRecord(Path(checkpoint).name, contents.sha256, tensor.name or None, contents.format, tensor.dtype)
    report = write_groups(
        loaded.path,
        root_attrs=root_attributes(rig),
        groups={"matrix": learned_group(rig, geometric, learned, record)},
        replace_groups=MATRIX_COMMAND_GROUPS,
    )
    change = value_change(geometric.coo_val, learned.coo_val)
    return AbsorbResult(loaded.path, Path(checkpoint), record, index_checked, options, learned, change, previous, report, time.perf_counter() - t0)
