"""``bevcompile verify --map`` / ``render --precision``: WHERE on the BEV grid each deployed form loses precision.

Every deployed form of a store (a :class:`PrecisionForm`: gather float32 / LUT, ELL and tiles in
float32 / int8 / fp16 / mixed, and whatever else is registered) is computed on verify's seeded
inputs (:func:`bevcompile.store.verify.make_features`: features uniform on ``[0, 1)``, LSS depth
probabilities) in float32 arithmetic, as the torch modules and onnxruntime compute it, and compared
cell by cell with the float64 reference of its :class:`Family`:

* ``matrix`` — the store's own matrix in float64: ``sum_j coo_val[j] * X[coo_col[j]]`` over the
  entries of the cell's row (``X`` lifted in float64: :func:`bevcompile.matrix.checks.lifted_columns`),
  so a form's error is what its number format and float32 arithmetic cost, not the Top-K pruning
  (``verify``'s ``matrix/topk_vs_unpruned`` measures that);
* ``gather`` — bilinear sampling (zeros outside) at the float64 projection of every camera and
  height (:func:`bevcompile.grid.reference.bilinear_sample_px` on the sampling grid), 0 on
  invalid cells, summed over cameras and heights (``GridGather(reduce="sum",
  collapse_heights=True)``).

Per fine BEV cell ``(iy, ix)``: ``SNR = 10 log10(sum_c ref[c]^2 / sum_c (got[c] - ref[c])^2)`` dB
over the ``C`` channels (``+inf`` when equal; cells whose reference is 0 have no SNR, NaN). Per
distance band (``hypot(x, y)`` of the cell centre in BEV-frame metres, the origin of
``bev.frame``; bands ``[0, e1), [e1, e2), ..., [e_last, inf)``) and per camera (the cells the
camera feeds: ``matrix/camera_mass != 0``, or ``grid``'s valid flag at any height): the energy
SNR ``10 log10(sum ref^2 / sum err^2)`` over the cells, the 5th percentile and the median of the
cells' SNR, and the largest absolute error.

**Plugging a form in.** :func:`register_form` adds a :class:`PrecisionForm` (``name``, ``family``,
``available(inputs)``, ``compute(inputs) -> (n_cells, C)``, ``description``); every map then
measures it against its family's reference. A per-target ONNX form of ``export-onnx --target T``
is ``PrecisionForm(f"onnx/{T}/ell", "matrix", available, compute)`` whose ``compute`` builds (or
reads) the graph and runs it with onnxruntime on ``inputs.features`` / ``inputs.depth_probs``
(batch 1, ``(1, n_cam, C, H_f, W_f)``), returning the ``(ny * nx, C)`` output; a new family
(another reference) is :func:`register_family`.

Pure except the store read (:func:`bevcompile.store.loader.load`, hash-verified); nothing prints.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from ..errors import StoreError, UsageError
from ..grid.checks.gather import logical_gather_tables
from ..grid.ipm import compute_sampling_grid
from ..grid.reference import bilinear_sample_px
from ..matrix.build import INT8_PRODUCTS, MatrixOptions
from ..matrix.checks import apply_entries, lifted_columns
from ..matrix.layout import tile_blocks
from ..matrix.precision import decode_fp16, fp16_row_tile_offsets, row_distances_m, tile_row_span
from ..rig.config import RigConfig
from ..rig.presets import plain_data
from ..store.loader import LoadedStore, load
from ..store.verify import DEFAULT_CHANNELS, make_features

F32 = npt.NDArray[np.float32]
F64 = npt.NDArray[np.float64]

DEFAULT_BANDS_M = (20.0, 35.0, 50.0)
"""Band edges of ``--bands`` (metres): 0-20, 20-35, 35-50 and beyond 50 m."""
LOW_PERCENTILE = 5.0


# --------------------------------------------------------------------------------------
# inputs, families, forms (the registry)
# --------------------------------------------------------------------------------------


@dataclass
class MapInputs:
    """What a form computes from: the loaded store, its rig and verify's seeded inputs.

    Convention: ``features`` float32 ``(n_cam, C, H_f, W_f)`` uniform on ``[0, 1)``;
    ``depth_probs`` float32 ``(n_cam, D, H_f, W_f)`` (softmax over ``D``); ``cache`` holds what
    several forms share (decoded tables, lifted columns), keyed by name."""

    store: LoadedStore
    rig: RigConfig
    features: F32
    depth_probs: F32
    cache: dict[str, Any] = field(default_factory=dict)

    @property
    def n_cells(self) -> int:
        return self.rig.bev.ny * self.rig.bev.nx

    def cached(self, key: str, make: Callable[[], Any]) -> Any:
        if key not in self.cache:
            self.cache[key] = make()
        return self.cache[key]


@dataclass(frozen=True)
class Family:
    """A reference the forms of a family are measured against.

    ``reference(inputs)`` float64 ``(ny * nx, C)`` per fine cell; ``feeds(inputs)`` bool
    ``(n_cam, ny * nx)``: the cells each camera feeds (the per-camera summary's cells)."""

    name: str
    description: str
    available: Callable[[MapInputs], bool]
    reference: Callable[[MapInputs], F64]
    feeds: Callable[[MapInputs], npt.NDArray[np.bool_]]


@dataclass(frozen=True)
class PrecisionForm:
    """One deployed form: ``compute(inputs)`` -> ``(ny * nx, C)`` its output per fine cell (the
    float32 result, any float dtype), compared with ``FAMILIES[family].reference(inputs)``."""

    name: str
    family: str
    description: str
    available: Callable[[MapInputs], bool]
    compute: Callable[[MapInputs], np.ndarray]


FAMILIES: dict[str, Family] = {}
FORMS: dict[str, PrecisionForm] = {}
"""The registry, in drawing order. :func:`register_form` / :func:`register_family` extend it."""


def register_family(family: Family, *, replace: bool = False) -> None:
    """Add a reference family (``replace=True`` to redefine one)."""
    if family.name in FAMILIES and not replace:
        raise ValueError(f"precision family {family.name!r} is already registered")
    FAMILIES[family.name] = family


def register_form(form: PrecisionForm, *, replace: bool = False) -> None:
    """Add a deployed form to every precision map (``replace=True`` to redefine one)."""
    if form.family not in FAMILIES:
        raise ValueError(f"precision form {form.name!r}: unknown family {form.family!r} (register it first)")
    if form.name in FORMS and not replace:
        raise ValueError(f"precision form {form.name!r} is already registered")
    FORMS[form.name] = form


# --------------------------------------------------------------------------------------
# the matrix family
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Matrix:
    options: MatrixOptions
    group: Any  # StoreGroup
    n_rows: int
    cell_row: npt.NDArray[np.int64]  # (n_cells,) the row each fine cell reads, -1: none

    def to_cells(self, per_row: np.ndarray) -> F64:
        out = np.zeros((self.cell_row.size, per_row.shape[1]))
        has = self.cell_row >= 0
        out[has] = per_row[self.cell_row[has]]
        return out


def _has_matrix(inputs: MapInputs) -> bool:
    return inputs.store.has_group("matrix")


def _matrix(inputs: MapInputs) -> _Matrix:
    def make() -> _Matrix:
        group = inputs.store["matrix"]
        try:
            options = MatrixOptions.from_dict(group.attrs.get("build_options") or {})
        except (UsageError, TypeError) as exc:
            raise StoreError(f"{inputs.store.path}: matrix/ build_options unusable ({exc}); run `bevcompile inspect`") from None
        n_cells = inputs.n_cells
        if "expand" in group:  # bev.region: every fine cell reads its (super-)cell's row, the zero row outside
            cell_row = np.asarray(group["expand"], dtype=np.int64)
            n_rows = int(group["cells"].shape[0]) + 1
        elif options.compact_rows:
            ids = np.asarray(group["row_ids"], dtype=np.int64)
            cell_row = np.full(n_cells, -1, dtype=np.int64)
            cell_row[ids] = np.arange(ids.size)
            n_rows = int(ids.size)
        else:
            cell_row, n_rows = np.arange(n_cells, dtype=np.int64), n_cells
        return _Matrix(options, group, n_rows, cell_row)

    return inputs.cached("matrix", make)


def _depth(inputs: MapInputs, mode: str) -> F32 | None:
    return inputs.depth_probs if mode == "frustum" else None


def lifted_columns_f32(rig: RigConfig, mode: str, cols: npt.ArrayLike, features: np.ndarray, depth_probs: np.ndarray | None) -> F32:
    """``X[cols, :]`` in float32 as a deployed graph forms it: grid / ray the float32 features;
    frustum ``float32(depth) * float32(features)`` (one float32 product, the outer product's).
    Convention: as :func:`bevcompile.matrix.checks.lifted_columns`, returns float32 ``(len(cols), C)``."""
    w_f, h_f = rig.feature_size
    plane = w_f * h_f
    c = np.asarray(cols, dtype=np.int64).ravel()
    feats = np.asarray(features, dtype=np.float32).reshape(rig.n_cam, -1, plane)
    if mode != "frustum":
        return np.asarray(feats[c // plane, :, c % plane], dtype=np.float32)
    assert depth_probs is not None
    per_cam = rig.depth.n_bins * plane
    cam, rem = c // per_cam, c % per_cam
    depth = np.asarray(depth_probs, dtype=np.float32).reshape(rig.n_cam, rig.depth.n_bins, plane)
    return (depth[cam, rem // plane, rem % plane][:, None] * feats[cam, :, rem % plane]).astype(np.float32)


def _matrix_reference(inputs: MapInputs) -> F64:
    m = _matrix(inputs)
    g = m.group
    col = np.asarray(g["coo_col"])
    lifted = lifted_columns(inputs.rig, m.options.mode, col, inputs.features, _depth(inputs, m.options.mode))
    return m.to_cells(apply_entries(np.asarray(g["coo_row"]), np.asarray(g["coo_val"]), lifted, m.n_rows))


def _matrix_feeds(inputs: MapInputs) -> npt.NDArray[np.bool_]:
    mass = np.asarray(_matrix(inputs).group["camera_mass"])
    return np.asarray(mass != 0).reshape(inputs.rig.n_cam, -1)


def _ell_output(inputs: MapInputs, values: F32, post_scale: F32 | None) -> F64:
    """``sum_j values[r, j] * X[ell_index[r, j]]`` in float32 (then ``* post_scale[r]``, the int8
    rows' scale after the K-sum, as the module applies it) -> per fine cell."""
    m = _matrix(inputs)
    index = np.asarray(m.group["ell_index"])
    lifted = inputs.cached(
        "ell_lifted",
        lambda: lifted_columns_f32(inputs.rig, m.options.mode, index.ravel(), inputs.features, _depth(inputs, m.options.mode)).reshape(*index.shape, -1),
    )
    out = (np.asarray(values, np.float32)[:, :, None] * lifted).sum(axis=1, dtype=np.float32)
    if post_scale is not None:
        out = out * np.asarray(post_scale, np.float32)[:, None]
    return m.to_cells(out[: m.n_rows])


def _tile_output(inputs: MapInputs, values: np.ndarray, post_scale: F32 | None) -> F64:
    """Per tile ``block @ X[tile columns]`` (float32 MatMul), then ``* post_scale`` per tile row."""
    m = _matrix(inputs)
    g = m.group
    r = int(m.options.tile_rows or 1)
    offsets = np.asarray(g["tile_col_offsets"])
    cols = np.asarray(g["tile_cols"])
    depth = _depth(inputs, m.options.mode)
    out = np.zeros(((offsets.size - 1) * r, inputs.features.shape[1]), dtype=np.float32)
    for t, block in enumerate(tile_blocks(np.asarray(values, np.float32), offsets, r)):
        x = lifted_columns_f32(inputs.rig, m.options.mode, cols[offsets[t] : offsets[t + 1]], inputs.features, depth)
        out[t * r : (t + 1) * r] = block @ x
    if post_scale is not None:
        out = out * np.asarray(post_scale, np.float32)[:, None]
    return m.to_cells(out[: m.n_rows])


def _quantize(inputs: MapInputs) -> str | None:
    return _matrix(inputs).options.quantize if _has_matrix(inputs) else None


def _has_tiles(inputs: MapInputs) -> bool:
    return _has_matrix(inputs) and _matrix(inputs).options.tile_rows is not None


def _mixed_rows(inputs: MapInputs, n: int) -> npt.NDArray[np.bool_]:
    is16 = np.zeros(n, dtype=bool)
    is16[np.asarray(_matrix(inputs).group["fp16_rows"], dtype=np.int64)] = True
    return is16


def _ell_int8(inputs: MapInputs) -> F64:
    g = _matrix(inputs).group
    return _ell_output(inputs, np.asarray(g["ell_weight_int8"]).astype(np.float32), np.asarray(g["row_scale"]))


def _ell_mixed(inputs: MapInputs) -> F64:
    g = _matrix(inputs).group
    values = np.asarray(g["ell_weight_int8"]).astype(np.float32)
    scale = np.array(g["row_scale"], dtype=np.float32)
    rows = np.asarray(g["fp16_rows"], dtype=np.int64)
    values[rows] = decode_fp16(g["fp16_row_weight"])
    scale[rows] = 1.0  # the fp16 rows have no scale (the module's Mul by 1 is exact)
    return _ell_output(inputs, values, scale)


def _tiles_int8(inputs: MapInputs) -> F64:
    g = _matrix(inputs).group
    return _tile_output(inputs, np.asarray(g["tile_weight_int8"]).astype(np.float32), np.asarray(g["tile_row_scale"]))


def _tiles_mixed(inputs: MapInputs) -> F64:
    m = _matrix(inputs)
    g = m.group
    r = int(m.options.tile_rows or 1)
    offsets = np.asarray(g["tile_col_offsets"], dtype=np.int64)
    values = np.asarray(g["tile_weight_int8"]).astype(np.float32)
    scale = np.array(g["tile_row_scale"], dtype=np.float32)
    rows = np.asarray(g["fp16_rows"], dtype=np.int64)
    bounds = fp16_row_tile_offsets(offsets, r, rows)
    decoded = decode_fp16(g["fp16_row_tile_weight"])
    for i, row in enumerate(rows):
        values[tile_row_span(offsets, r, row)] = decoded[bounds[i] : bounds[i + 1]]
        scale[row] = 1.0
    return _tile_output(inputs, values, scale)


# --------------------------------------------------------------------------------------
# the gather family
# --------------------------------------------------------------------------------------


def _has_gather(inputs: MapInputs) -> bool:
    return inputs.store.has_group("gather") and inputs.rig.bev.region is None


def _gather_tables(inputs: MapInputs) -> dict[str, Any]:
    def make() -> dict[str, Any]:
        group = inputs.store["gather"]
        try:
            return logical_gather_tables(inputs.rig, group.load_all(), plain_data(group.attrs))
        except ValueError as exc:
            raise StoreError(f"{inputs.store.path}: gather/ unusable ({exc}); run `bevcompile inspect`") from None

    return inputs.cached("gather", make)


def _sampling(inputs: MapInputs) -> Any:
    return inputs.cached("sampling_grid", lambda: compute_sampling_grid(inputs.rig))


def _gather_reference(inputs: MapInputs) -> F64:
    truth = _sampling(inputs)
    total = np.zeros((inputs.features.shape[1], inputs.n_cells))
    for cam in range(inputs.rig.n_cam):
        sampled = bilinear_sample_px(inputs.features[cam], truth.coords_feature_px[cam])  # (C, n_h, ny, nx)
        sampled = np.where(truth.valid[cam][None], sampled, 0.0)
        total += sampled.sum(axis=1).reshape(sampled.shape[0], -1)
    return total.T


def _gather_feeds(inputs: MapInputs) -> npt.NDArray[np.bool_]:
    return np.asarray(_sampling(inputs).valid.any(axis=1)).reshape(inputs.rig.n_cam, -1)


def _gather_output(inputs: MapInputs, weight: F32) -> F32:
    """``sum_k weight * feats[index]`` in float32 per (camera, height, cell), then summed over
    cameras and heights in float32 -> ``(ny * nx, C)``."""
    tables = _gather_tables(inputs)
    index = np.asarray(tables["index"], dtype=np.int64)
    rig = inputs.rig
    c = inputs.features.shape[1]
    w_f, h_f = rig.feature_size
    stacked = np.asarray(inputs.features, np.float32).transpose(1, 0, 2, 3).reshape(c, rig.n_cam * h_f * w_f)
    per_cell = np.zeros((c, index.shape[0]), dtype=np.float32)
    for k in range(4):
        per_cell += stacked[:, index[:, k]] * np.asarray(weight[:, k], np.float32)
    per_cell = per_cell.reshape(c, rig.n_cam * len(rig.bev.heights), inputs.n_cells).sum(axis=1, dtype=np.float32)
    return np.asarray(per_cell.T)


def _gather_float(inputs: MapInputs) -> F32:
    return _gather_output(inputs, np.asarray(_gather_tables(inputs)["weight"], np.float32))


def _gather_lut(inputs: MapInputs) -> F32:
    tables = _gather_tables(inputs)
    codes = np.asarray(tables["codes"], dtype=np.int64)
    lut = np.asarray(tables["lut"], np.float32)
    cu0, cu1, cv0, cv1 = (lut[codes[:, k]] for k in range(4))  # GridGather: w(v_j, u_i) = lut[cv_j] * lut[cu_i] in float32
    return _gather_output(inputs, np.stack([cv0 * cu0, cv0 * cu1, cv1 * cu0, cv1 * cu1], axis=1).astype(np.float32))


def _register_builtin() -> None:
    register_family(Family("matrix", "the store's matrix (COO values) in float64", _has_matrix, _matrix_reference, _matrix_feeds), replace=True)
    register_family(Family("gather", "bilinear sampling at the float64 projection, summed over cameras and heights", _has_gather, _gather_reference, _gather_feeds), replace=True)
    q = _quantize
    for form in (
        PrecisionForm("gather/float32", "gather", "gather/index + weight, float32", _has_gather, _gather_float),
        PrecisionForm("gather/lut", "gather", "gather/index + weight_u8 codes through the LUT, float32", _has_gather, _gather_lut),
        PrecisionForm("matrix/ell", "matrix", "ELL float32", _has_matrix, lambda i: _ell_output(i, np.asarray(_matrix(i).group["ell_weight"]), None)),
        PrecisionForm("matrix/ell_int8", "matrix", "ELL int8 values, row scale after the K-sum", lambda i: q(i) in INT8_PRODUCTS, _ell_int8),
        PrecisionForm("matrix/ell_fp16", "matrix", "ELL float16 values", lambda i: q(i) == "fp16", lambda i: _ell_output(i, decode_fp16(_matrix(i).group["ell_weight_fp16"]), None)),
        PrecisionForm("matrix/ell_mixed", "matrix", "ELL int8 rows + float16 rows (fp16_rows)", lambda i: q(i) == "mixed", _ell_mixed),
        PrecisionForm("matrix/tiles", "matrix", "tiles float32 (MatMul)", _has_tiles, lambda i: _tile_output(i, np.asarray(_matrix(i).group["tile_weight"]), None)),
        PrecisionForm("matrix/tiles_int8", "matrix", "tiles int8, row scale after the MatMul", lambda i: _has_tiles(i) and q(i) in INT8_PRODUCTS, _tiles_int8),
        PrecisionForm("matrix/tiles_fp16", "matrix", "tiles float16", lambda i: _has_tiles(i) and q(i) == "fp16", lambda i: _tile_output(i, decode_fp16(_matrix(i).group["tile_weight_fp16"]), None)),
        PrecisionForm("matrix/tiles_mixed", "matrix", "tiles int8 rows + float16 rows", lambda i: _has_tiles(i) and q(i) == "mixed", _tiles_mixed),
    ):
        register_form(form, replace=True)


_register_builtin()


# --------------------------------------------------------------------------------------
# the map and its summaries
# --------------------------------------------------------------------------------------


def parse_bands(value: str | Sequence[float] | None) -> tuple[float, ...]:
    """Band edges in metres from ``"20,35,50"`` (or a sequence): strictly increasing, > 0, finite.
    :class:`UsageError` (one line) otherwise. None: :data:`DEFAULT_BANDS_M`."""
    if value is None:
        return DEFAULT_BANDS_M
    if isinstance(value, str):
        parts = [p.strip() for p in value.split(",") if p.strip()]
        try:
            edges = tuple(float(p) for p in parts)
        except ValueError:
            raise UsageError(f"--bands must be comma-separated distances in metres (e.g. 20,35,50), got {value!r}") from None
    else:
        edges = tuple(float(v) for v in value)
    if not edges or not all(math.isfinite(e) and e > 0 for e in edges) or any(b <= a for a, b in itertools.pairwise(edges)):
        raise UsageError(f"--bands must be strictly increasing distances > 0 metres (e.g. 20,35,50), got {value!r}")
    return edges


def band_labels(edges: Sequence[float]) -> list[str]:
    """``["0-20 m", "20-35 m", "35-50 m", ">= 50 m"]``."""
    lows = [0.0, *edges]
    return [f"{lo:g}-{hi:g} m" for lo, hi in zip(lows, edges, strict=False)] + [f">= {edges[-1]:g} m"]


def cell_snr_db(got: np.ndarray, ref: np.ndarray) -> F64:
    """Per cell ``10 log10(sum_c ref^2 / sum_c err^2)``. Convention: ``(n_cells, C)`` -> float64
    ``(n_cells,)``; ``+inf`` where the error is 0, NaN where the reference is 0."""
    r = np.asarray(ref, np.float64)
    e = np.asarray(got, np.float64) - r
    signal = (r * r).sum(axis=1)
    noise = (e * e).sum(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        snr = 10.0 * np.log10(signal / noise)
    snr = np.where(noise == 0, np.inf, snr)
    return np.where(signal > 0, snr, np.nan)


@dataclass(frozen=True)
class Summary:
    """The error of one form over a set of cells (a band, a camera's cells, all cells)."""

    label: str
    n_cells: int
    snr_db: float  # 10 log10(sum ref^2 / sum err^2) over the cells (inf: no error; nan: no cell)
    p05_db: float  # 5th percentile of the cells' SNR
    median_db: float
    max_abs: float

    def to_json(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "n_cells": self.n_cells,
            "snr_db": _json_float(self.snr_db),
            "p05_db": _json_float(self.p05_db),
            "median_db": _json_float(self.median_db),
            "max_abs": _json_float(self.max_abs),
        }


def _json_float(value: float) -> float | None:
    return float(value) if math.isfinite(value) else None


def summarise(label: str, got: np.ndarray, ref: np.ndarray, snr: F64, cells: npt.NDArray[np.bool_]) -> Summary:
    """:class:`Summary` over ``cells`` (bool ``(n_cells,)``) whose reference is not 0."""
    use = cells & ~np.isnan(snr)
    if not use.any():
        return Summary(label, 0, math.nan, math.nan, math.nan, math.nan)
    r = np.asarray(ref, np.float64)[use]
    e = np.asarray(got, np.float64)[use] - r
    noise = float((e * e).sum())
    energy = 10.0 * math.log10(float((r * r).sum()) / noise) if noise > 0 else math.inf
    values = snr[use]
    return Summary(
        label, int(use.sum()), energy,
        float(np.percentile(values, LOW_PERCENTILE, method="lower")), float(np.percentile(values, 50.0, method="lower")),
        float(np.abs(e).max()),
    )


@dataclass
class FormMap:
    """One form's map: ``snr_db`` float64 ``(ny, nx)`` (NaN: reference 0) and its summaries."""

    name: str
    family: str
    description: str
    snr_db: F64
    overall: Summary
    bands: list[Summary]
    cameras: list[Summary]

    def to_json(self) -> dict[str, Any]:
        return {
            "form": self.name,
            "family": self.family,
            "description": self.description,
            "all": self.overall.to_json(),
            "bands": [b.to_json() for b in self.bands],
            "cameras": [c.to_json() for c in self.cameras],
        }


@dataclass
class PrecisionMap:
    """Every available form of a store, measured per cell (see the module docstring)."""

    store: str
    name: str
    seed: int
    channels: int
    bands_m: tuple[float, ...]
    distance_m: F64  # (ny, nx) the cells' distance
    forms: list[FormMap]
    notes: list[str] = field(default_factory=list)

    def form(self, name: str) -> FormMap:
        for f in self.forms:
            if f.name == name:
                return f
        raise KeyError(name)

    def to_json(self) -> dict[str, Any]:
        return {
            "store": self.store,
            "name": self.name,
            "seed": self.seed,
            "channels": self.channels,
            "features": "uniform [0, 1), float32; depth: softmax of standard normal logits",
            "snr_definition": "per cell 10 log10(sum_c ref^2 / sum_c (got - ref)^2); a summary: the same over its cells' energies",
            "distance_definition": "hypot(x, y) of the cell centre in BEV-frame metres",
            "bands_m": list(self.bands_m),
            "band_labels": band_labels(self.bands_m),
            "forms": [f.to_json() for f in self.forms],
            "notes": list(self.notes),
        }


def precision_map(
    path: str | Path | LoadedStore,
    *,
    seed: int = 0,
    channels: int = DEFAULT_CHANNELS,
    bands: str | Sequence[float] | None = None,
    forms: Sequence[str] | None = None,
    extra_forms: Sequence[PrecisionForm] = (),
    progress: Callable[[int], None] | None = None,
) -> PrecisionMap:
    """The precision map of the store at ``path``: every registered, available form (or the
    ``forms`` named), then ``extra_forms`` (mapped for this call only, the registry untouched),
    against its family's float64 reference on verify's seeded inputs."""
    edges = parse_bands(bands)
    store = load(path)
    rig = store.rig
    features, depth = make_features(rig, channels, seed)
    inputs = MapInputs(store, rig, features, depth)
    ny, nx = rig.bev.ny, rig.bev.nx
    distance = row_distances_m(rig, ny * nx)
    band_of = np.searchsorted(np.asarray(edges), distance, side="right")  # 0 .. len(edges)
    labels = band_labels(edges)
    wanted = list(FORMS) if forms is None else list(forms)
    unknown = [f for f in wanted if f not in FORMS]
    if unknown:
        raise UsageError(f"unknown precision form(s) {', '.join(unknown)}; registered: {', '.join(FORMS)}")
    out = PrecisionMap(str(store.path), rig.name, seed, channels, edges, distance.reshape(ny, nx), [])
    if rig.bev.region is not None and store.has_group("gather"):
        out.notes.append("gather forms are not mapped for a bev.region store (its tables hold the kept cells only)")
    references: dict[str, F64] = {}
    for form in [FORMS[name] for name in wanted] + list(extra_forms):
        name = form.name
        if form.family not in FAMILIES:
            raise ValueError(f"precision form {name!r}: unknown family {form.family!r}")
        family = FAMILIES[form.family]
        if not (family.available(inputs) and form.available(inputs)):
            continue
        if form.family not in references:
            references[form.family] = family.reference(inputs)
        ref = references[form.family]
        got = np.asarray(form.compute(inputs), dtype=np.float64)
        if got.shape != ref.shape:
            raise ValueError(f"precision form {name}: output {got.shape}, reference {ref.shape}")
        snr = cell_snr_db(got, ref)
        feeds = family.feeds(inputs)
        out.forms.append(FormMap(
            name, form.family, form.description, snr.reshape(ny, nx),
            summarise("all cells", got, ref, snr, np.ones(snr.size, dtype=bool)),
            [summarise(label, got, ref, snr, band_of == b) for b, label in enumerate(labels)],
            [summarise(cam, got, ref, snr, feeds[c]) for c, cam in enumerate(rig.camera_names)],
        ))
        if progress is not None:
            progress(1)
    if not out.forms:
        out.notes.append("no deployed form to map: the store has neither matrix/ nor gather/")
    return out


def summaries_table(pmap: PrecisionMap, kind: str = "bands") -> tuple[list[str], list[list[str]]]:
    """``(header, rows)`` of a compact table: ``"bands"`` one row per form, one column per band
    (cells ``"SNR (p5)"`` in dB); ``"cameras"`` one row per camera, one column per form (its name
    without ``matrix/``; cells ``"SNR"`` over the cells the camera feeds)."""
    if kind == "bands":
        rows = [[f.name, *(f"{format_db(s.snr_db)} ({format_db(s.p05_db)})" if s.n_cells else "-" for s in f.bands)] for f in pmap.forms]
        return ["form", *band_labels(pmap.bands_m)], rows
    cameras = [c.label for c in pmap.forms[0].cameras] if pmap.forms else []
    rows = [[camera, *(format_db(f.cameras[i].snr_db) if f.cameras[i].n_cells else "-" for f in pmap.forms)] for i, camera in enumerate(cameras)]
    return ["camera", *(f.name.removeprefix("matrix/") for f in pmap.forms)], rows


def format_db(value: float) -> str:
    if math.isnan(value):
        return "n/a"
    return "inf" if math.isinf(value) else f"{value:.1f}"


__all__ = [
    "DEFAULT_BANDS_M",
    "FAMILIES",
    "FORMS",
    "Family",
    "FormMap",
    "MapInputs",
    "PrecisionForm",
    "PrecisionMap",
    "Summary",
    "band_labels",
    "cell_snr_db",
    "lifted_columns_f32",
    "parse_bands",
    "precision_map",
    "register_family",
    "register_form",
    "summaries_table",
]

