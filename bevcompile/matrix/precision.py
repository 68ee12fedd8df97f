"""Reduced-precision forms of the matrix and the numpy references of the deployed lift.

Pure numpy. Everything a deployment (the torch modules, an ONNX graph builder, ``verify``) needs to
compute EXACTLY what a store's fp16 / mixed product, a guarded graph or a class-input lift mean:

* **fp16** (``bevcompile matrix --quantize fp16``): :func:`encode_fp16` / :func:`decode_fp16`.
* **mixed** (``--quantize mixed --fp16-rows RULE``): the int8 product of every row (as
  ``--quantize int8`` stores it) plus float16 values for the rows a :class:`Fp16Rule` selects;
  :func:`int8_row_snr_db` (the per-row figure the ``snr`` and ``fraction`` rules rank by),
  :func:`row_distances_m` (the ``beyond`` rule's distance), :func:`select_fp16_rows`,
  :func:`mixed_ell_values` / :func:`mixed_tile_values` (the dequantised weights a mixed product
  computes with), :func:`fp16_row_tile_weight` / :func:`fp16_row_tile_offsets` (its tile rows).
* **guard**: :func:`sanitize` (non-finite inputs become 0 before the lift).
* **class inputs**: :func:`class_lift_reference` (``lift(one_hot(labels))`` in float64, one-hot
  built explicitly: the reference of ``ClassLift`` and of a OneHot-free graph).

Conventions (also in docs/matrix.md "Reduced precision" and docs/deploy.md):

* fp16 encode ``h = float16(w)`` (IEEE binary16, round to nearest even, subnormals kept; a
  ``|w| >= 65520`` (it would round to inf) or non-finite value is refused); decode ``float32(h)`` (exact).
* mixed: row ``r`` decodes to ``float32(fp16 value)`` if ``r`` is in ``fp16_rows``, else to the
  int8 decode ``float32(q[r, j]) * row_scale[r]``. A deployed graph computes the two row groups
  separately and puts the rows back in order with one Gather (no scatter).
* guard: ``sanitize(x) = where(x - x == 0, x, 0)``: finite values unchanged (bit for bit, -0.0
  included), NaN, +inf and -inf become +0.0 (``x - x`` is NaN exactly for those).
* class lift: ``out[n, k, r] = sum_j W[r, col_j] * [labels[n, cam, v, u] == k] (* depth[n, cam, d, v, u]
  in frustum mode)`` with ``(cam, [d,] v, u)`` the column's pixel; a label outside ``[0, n_classes)``
  (an ignore label such as 255, or -1) matches no class and contributes nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from ..errors import UsageError
from ..rig.config import RigConfig

F32 = npt.NDArray[np.float32]
F64 = npt.NDArray[np.float64]
I32 = npt.NDArray[np.int32]
I64 = npt.NDArray[np.int64]

FP16_MAX = float(np.finfo(np.float16).max)
"""65504: the largest finite float16."""
FP16_OVERFLOW = 65520.0
"""``|w| >= 65520`` rounds to inf in float16 (65504 + half its ulp of 32): such weights are refused."""
FP16_RULES = ("beyond", "snr", "fraction")
"""Kinds of :class:`Fp16Rule` (``--fp16-rows KIND:VALUE``)."""
ROW_SNR_FEATURE_MEAN = 0.5
ROW_SNR_FEATURE_VAR = 1.0 / 12.0
"""The inputs :func:`int8_row_snr_db` predicts for: i.i.d. uniform on ``[0, 1)`` (verify's seeded features)."""


# --------------------------------------------------------------------------------------
# fp16
# --------------------------------------------------------------------------------------


def encode_fp16(weight: npt.ArrayLike, what: str = "weights") -> npt.NDArray[np.float16]:
    """``float16(w)`` (round to nearest even, subnormals kept).

    Convention: any shape float -> float16 of the same shape. :class:`UsageError` (one line,
    naming ``what``) when a value is not finite or ``|w| >= 65520`` (float16 would hold inf;
    ``65504 <= |w| < 65520`` rounds to 65504).
    """
    w = np.asarray(weight)
    if w.size:
        finite = np.isfinite(w)
        over = finite & (np.abs(w) >= FP16_OVERFLOW)
        if not finite.all() or over.any():
            bad = ~finite | over
            first = np.unravel_index(int(np.argmax(bad)), w.shape)
            raise UsageError(
                f"--quantize fp16/mixed: {int(np.count_nonzero(bad)):,} of the {what} are not finite or exceed float16's range "
                f"(|w| < {FP16_OVERFLOW:g}; first at {tuple(int(i) for i in first)}: {float(w[first])!r}); keep float32 or int8 for these values"
            )
    with np.errstate(over="ignore"):  # refused above; float16 conversion itself never sees an overflow here
        return w.astype(np.float16)


def decode_fp16(h: npt.ArrayLike) -> F32:
    """``float32(h)`` (exact). Convention: float16 any shape -> float32 of the same shape."""
    return np.asarray(h, dtype=np.float16).astype(np.float32)


def decoded_errors(weight: npt.ArrayLike, decoded: npt.ArrayLike) -> tuple[float, float]:
    """(max relative error w.r.t. the row's max ``|w|``, max absolute error) of ``decoded`` rows.

    Convention: ``weight`` and ``decoded`` ``(rows, n)`` (any float dtype; compared in float64);
    a row whose max ``|w|`` is 0 counts as relative error 0 (the int8 figure's definition)."""
    w = np.asarray(weight, dtype=np.float64)
    if w.size == 0:
        return 0.0, 0.0
    err = np.abs(np.asarray(decoded, dtype=np.float64) - w)
    peak = np.abs(w).max(axis=1)
    rel = np.where(peak[:, None] > 0, err / np.where(peak[:, None] > 0, peak[:, None], 1.0), 0.0)
    return float(rel.max()), float(err.max())


# --------------------------------------------------------------------------------------
# mixed: which rows stay fp16
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Fp16Rule:
    """Which rows of a ``--quantize mixed`` product keep float16 values (only rows with entries):

    * ``beyond:M`` — rows whose BEV cell centre is more than ``M`` metres from the BEV frame's
      origin (:func:`row_distances_m`; Euclidean in the x/y plane);
    * ``snr:DB`` — rows whose predicted int8 SNR (:func:`int8_row_snr_db`) is below ``DB`` dB;
    * ``fraction:F`` — the ``ceil(F * n)`` rows of lowest predicted int8 SNR among the ``n``
      rows with entries (ties: the lower row first), ``0 < F <= 1``.

    ``token`` (``"beyond:35.0"``) is the canonical text stored in ``build_options.fp16_rows``.
    """

    kind: str
    value: float

    @classmethod
    def parse(cls, text: str) -> Fp16Rule:
        """``"beyond:35"`` -> ``Fp16Rule("beyond", 35.0)``; :class:`UsageError` (one line) otherwise."""
        if not isinstance(text, str) or ":" not in text:
            raise UsageError(f"--fp16-rows must be KIND:VALUE with KIND one of {', '.join(FP16_RULES)} (e.g. beyond:35), got {text!r}")
        kind, _, raw = text.partition(":")
        kind = kind.strip().lower()
        if kind not in FP16_RULES:
            raise UsageError(f"--fp16-rows kind must be one of {', '.join(FP16_RULES)}, got {kind!r}")
        try:
            value = float(raw.strip())
        except ValueError:
            raise UsageError(f"--fp16-rows {kind}: the value must be a number, got {raw.strip()!r}") from None
        return cls(kind, value).validate()

    def validate(self) -> Fp16Rule:
        if self.kind not in FP16_RULES:
            raise UsageError(f"--fp16-rows kind must be one of {', '.join(FP16_RULES)}, got {self.kind!r}")
        v = self.value
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            raise UsageError(f"--fp16-rows {self.kind}: the value must be a finite number, got {v!r}")
        if self.kind == "beyond" and v < 0:
            raise UsageError(f"--fp16-rows beyond: the distance must be >= 0 metres, got {v:g}")
        if self.kind == "fraction" and not 0 < v <= 1:
            raise UsageError(f"--fp16-rows fraction: the fraction must be in (0, 1], got {v:g}")
        return self

    @property
    def token(self) -> str:
        return f"{self.kind}:{float(self.value)!r}"

    def describe(self) -> str:
        if self.kind == "beyond":
            return f"rows with entries whose cell centre is more than {self.value:g} m from the BEV frame's origin"
        if self.kind == "snr":
            return f"rows with entries whose predicted int8 SNR is below {self.value:g} dB"
        return f"the fraction {self.value:g} of the rows with entries with the lowest predicted int8 SNR (ceil, ties: lower row first)"


def int8_row_snr_db(weight: npt.ArrayLike, q: npt.ArrayLike, row_scale: npt.ArrayLike) -> F64:
    """Predicted SNR (dB) of each row's int8 output for i.i.d. inputs uniform on ``[0, 1)``.

    With ``e = float32(q) * s - w`` (the decode error, float64) and inputs of mean ``m = 1/2`` and
    variance ``v = 1/12``: ``E[(e . x)^2] = v ||e||^2 + m^2 (sum e)^2``, likewise for ``w``; the
    SNR is ``10 log10(E[(w . x)^2] / E[(e . x)^2])`` (``+inf`` when the decode is exact or the
    row is empty). Rows fed by few, unequal weights score lowest: their rounding errors do not
    average out against a large coherent sum.

    Convention: ``weight`` float ``(rows, n)``, ``q`` int8 ``(rows, n)``, ``row_scale`` float32
    ``(rows,)`` -> float64 ``(rows,)``.
    """
    w = np.asarray(weight, dtype=np.float64)
    deq = np.asarray(q).astype(np.float32) * np.asarray(row_scale, np.float32)[:, None]
    e = deq.astype(np.float64) - w
    signal = ROW_SNR_FEATURE_VAR * (w * w).sum(axis=1) + ROW_SNR_FEATURE_MEAN**2 * w.sum(axis=1) ** 2
    noise = ROW_SNR_FEATURE_VAR * (e * e).sum(axis=1) + ROW_SNR_FEATURE_MEAN**2 * e.sum(axis=1) ** 2
    with np.errstate(divide="ignore", invalid="ignore"):
        out = 10.0 * np.log10(signal / noise)
    return np.where(noise > 0, out, np.inf)


def row_centres_m(rig: RigConfig, n_rows: int, row_ids: npt.ArrayLike | None = None, region_cells: npt.ArrayLike | None = None) -> F64:
    """``(x, y)`` BEV-frame metres of the centre of each matrix row's cell.

    Convention: rows are BEV cells ``iy * nx + ix`` (``row_ids`` given: row ``r`` is cell
    ``row_ids[r]``; ``region_cells`` ``(n_kept, 3)`` ``(iy, ix, size)``: row ``r < n_kept`` is
    that (super-)cell, centred at ``(x_min + (ix + size/2) dx, y_min + (iy + size/2) dy)``, the zero
    row NaN). returns float64 ``(n_rows, 2)``; rows past the cells (padding) are NaN.
    """
    b = rig.bev
    out = np.full((n_rows, 2), np.nan)
    if region_cells is not None:
        cells = np.asarray(region_cells, dtype=np.float64).reshape(-1, 3)
        k = min(n_rows, cells.shape[0])
        out[:k, 0] = b.x.min + (cells[:k, 1] + cells[:k, 2] / 2) * b.x.step
        out[:k, 1] = b.y.min + (cells[:k, 0] + cells[:k, 2] / 2) * b.y.step
        return out
    ids = np.arange(b.ny * b.nx) if row_ids is None else np.asarray(row_ids, dtype=np.int64)
    k = min(n_rows, ids.size)
    iy, ix = np.divmod(ids[:k], b.nx)
    out[:k, 0] = b.x.min + (ix + 0.5) * b.x.step
    out[:k, 1] = b.y.min + (iy + 0.5) * b.y.step
    return out


def row_distances_m(rig: RigConfig, n_rows: int, row_ids: npt.ArrayLike | None = None, region_cells: npt.ArrayLike | None = None) -> F64:
    """Euclidean distance (metres) of each row's cell centre (:func:`row_centres_m`) from the
    origin of the BEV frame (``bev.frame``: the ego origin, or the frame's sensor). float64
    ``(n_rows,)``; NaN for rows without a cell (the zero row, padding)."""
    centres = row_centres_m(rig, n_rows, row_ids, region_cells)
    return np.hypot(centres[:, 0], centres[:, 1])


def select_fp16_rows(rule: Fp16Rule, snr_db: npt.ArrayLike, distance_m: npt.ArrayLike, has_entries: npt.ArrayLike) -> I32:
    """The rows a :class:`Fp16Rule` keeps in float16, sorted.

    Convention: ``snr_db`` (:func:`int8_row_snr_db`), ``distance_m`` (:func:`row_distances_m`,
    NaN = no cell) and ``has_entries`` (bool) are ``(n,)`` over the rows considered (the logical
    rows); returns int32 ``(n_fp16,)`` strictly increasing row indices, all with entries.
    """
    snr = np.asarray(snr_db, dtype=np.float64)
    dist = np.asarray(distance_m, dtype=np.float64)
    has = np.asarray(has_entries, dtype=bool)
    if rule.kind == "beyond":
        with np.errstate(invalid="ignore"):
            chosen = has & (dist > rule.value)
        return np.flatnonzero(chosen).astype(np.int32)
    if rule.kind == "snr":
        return np.flatnonzero(has & (snr < rule.value)).astype(np.int32)
    candidates = np.flatnonzero(has)
    take = math.ceil(rule.value * candidates.size)
    order = np.lexsort((candidates, snr[candidates]))  # lowest SNR first, ties by row
    return np.sort(candidates[order[:take]]).astype(np.int32)


def mixed_ell_values(ell_weight_int8: npt.ArrayLike, row_scale: npt.ArrayLike, fp16_rows: npt.ArrayLike, fp16_row_weight: npt.ArrayLike) -> F32:
    """The float32 weights a mixed ELL product computes with.

    Convention: ``ell_weight_int8`` int8 ``(rows_pad, k_pad)``, ``row_scale`` float32
    ``(rows_pad,)``, ``fp16_rows`` int ``(n16,)``, ``fp16_row_weight`` float16 ``(n16, k_pad)`` ->
    float32 ``(rows_pad, k_pad)``: ``float32(q) * row_scale[r]`` per row, replaced by
    ``float32(fp16_row_weight[i])`` on row ``fp16_rows[i]``.
    """
    q = np.asarray(ell_weight_int8)
    out = (q.astype(np.float32) * np.asarray(row_scale, np.float32)[:, None]).astype(np.float32)
    rows = np.asarray(fp16_rows, dtype=np.int64)
    out[rows] = decode_fp16(np.asarray(fp16_row_weight).reshape(rows.size, q.shape[1]))
    return out


def tile_row_span(tile_col_offsets: npt.ArrayLike, tile_rows: int, row: int) -> slice:
    """Where row ``row`` lies in the flat tile layout (``tile_weight`` and its int8 / fp16 forms):
    tile ``t = row // R``, ``w = o[t+1] - o[t]``, ``R o[t] + (row - t R) w`` to ``... + w``."""
    o = np.asarray(tile_col_offsets, dtype=np.int64)
    t = int(row) // int(tile_rows)
    w = int(o[t + 1] - o[t])
    start = int(tile_rows) * int(o[t]) + (int(row) - t * int(tile_rows)) * w
    return slice(start, start + w)


def fp16_row_tile_offsets(tile_col_offsets: npt.ArrayLike, tile_rows: int, fp16_rows: npt.ArrayLike) -> I64:
    """Offsets of each fp16 row's tile block row in ``fp16_row_tile_weight``.

    Convention: row ``r`` lies in tile ``t = r // R`` whose blocks are ``w_t = o[t+1] - o[t]`` wide;
    returns int64 ``(n16 + 1,)`` = ``[0, cumsum(w_{t(r)} for r in fp16_rows)]``."""
    o = np.asarray(tile_col_offsets, dtype=np.int64)
    tiles = np.asarray(fp16_rows, dtype=np.int64) // int(tile_rows)
    widths = o[tiles + 1] - o[tiles]
    out = np.zeros(widths.size + 1, dtype=np.int64)
    np.cumsum(widths, out=out[1:])
    return out


def fp16_row_tile_weight(tile_weight: npt.ArrayLike, tile_col_offsets: npt.ArrayLike, tile_rows: int, fp16_rows: npt.ArrayLike) -> npt.NDArray[np.float16]:
    """The float16 tile values of a mixed product's fp16 rows.

    Convention: ``tile_weight`` float32 ``(R * T,)`` (the tiles' layout, see
    :func:`bevcompile.matrix.layout.tile_layout`); returns float16 ``(sum of widths,)``: for each
    ``r`` in ``fp16_rows`` (in order) the row ``r - t R`` of tile ``t = r // R``'s block,
    ``float16`` of ``tile_weight[R o[t] + (r - t R) w_t : ... + w_t]``, at
    :func:`fp16_row_tile_offsets`."""
    tw = np.asarray(tile_weight)
    o = np.asarray(tile_col_offsets, dtype=np.int64)
    r_ = int(tile_rows)
    rows = np.asarray(fp16_rows, dtype=np.int64)
    offsets = fp16_row_tile_offsets(o, r_, rows)
    out = np.zeros(int(offsets[-1]), dtype=np.float32)
    for i, r in enumerate(rows):
        out[offsets[i] : offsets[i + 1]] = tw[tile_row_span(o, r_, r)]
    return encode_fp16(out, "tile weights")


def mixed_tile_values(
    tile_weight_int8: npt.ArrayLike,
    tile_row_scale: npt.ArrayLike,
    tile_col_offsets: npt.ArrayLike,
    tile_rows: int,
    fp16_rows: npt.ArrayLike,
    fp16_row_tile_weight_: npt.ArrayLike,
) -> F32:
    """The float32 tile weights a mixed tile product computes with: the int8 decode of every
    tile row (``float32(q) * tile_row_scale[t R + i]``), replaced on the fp16 rows by
    ``float32`` of their ``fp16_row_tile_weight`` block rows. Convention: float32 ``(R * T,)``,
    the layout of ``tile_weight``."""
    q = np.asarray(tile_weight_int8)
    o = np.asarray(tile_col_offsets, dtype=np.int64)
    scale = np.asarray(tile_row_scale, np.float32)
    r_ = int(tile_rows)
    out = np.zeros(q.size, dtype=np.float32)
    for t in range(o.size - 1):
        a, b = int(o[t]), int(o[t + 1])
        block = q[r_ * a : r_ * b].reshape(r_, b - a).astype(np.float32) * scale[t * r_ : (t + 1) * r_, None]
        out[r_ * a : r_ * b] = block.ravel()
    rows = np.asarray(fp16_rows, dtype=np.int64)
    offsets = fp16_row_tile_offsets(o, r_, rows)
    values = decode_fp16(fp16_row_tile_weight_)
    for i, r in enumerate(rows):
        out[tile_row_span(o, r_, r)] = values[offsets[i] : offsets[i + 1]]
    return out


# --------------------------------------------------------------------------------------
# guard and class inputs
# --------------------------------------------------------------------------------------


def sanitize(x: npt.ArrayLike) -> np.ndarray:
    """The guard: ``where(x - x == 0, x, 0)`` in ``x``'s dtype.

    Convention: any shape and float dtype -> the same shape and dtype; finite values are
    returned bit for bit (``-0.0`` included), NaN and +-inf become ``+0.0``."""
    a = np.asarray(x)
    with np.errstate(invalid="ignore"):
        keep = (a - a) == 0
    return np.where(keep, a, np.zeros((), dtype=a.dtype)).astype(a.dtype, copy=False)


def class_lift_reference(
    coo_row: npt.ArrayLike,
    coo_col: npt.ArrayLike,
    coo_val: npt.ArrayLike,
    labels: npt.ArrayLike,
    n_classes: int,
    n_rows: int,
    *,
    n_depth: int | None = None,
    depth: npt.ArrayLike | None = None,
) -> F64:
    """``lift(one_hot(labels))`` in float64 with the one-hot built explicitly.

    Convention: ``labels`` int ``(N, n_cam, H_f, W_f)``; ``coo_*`` the matrix's COO (columns
    ``(cam * H_f + v) * W_f + u``, or in frustum mode — ``n_depth = D`` and ``depth`` float
    ``(N, n_cam, D, H_f, W_f)`` — ``((cam * D + d) * H_f + v) * W_f + u``); returns float64
    ``(N, n_classes, n_rows)`` = ``sum_j coo_val[j] * onehot[n, k, pixel(col_j)] (* depth[n, col_j])``
    over the entries of row ``r``, with ``onehot[n, k, p] = 1`` iff ``labels.flat[p] == k``
    (a label outside ``[0, n_classes)`` gives a zero vector).
    """
    lab = np.asarray(labels)
    if lab.ndim != 4:
        raise ValueError(f"labels must be (N, n_cam, H_f, W_f), got {lab.shape}")
    n, n_cam, h_f, w_f = lab.shape
    plane = h_f * w_f
    flat = lab.reshape(n, n_cam * plane).astype(np.int64)
    onehot = np.zeros((n, n_classes, n_cam * plane))
    valid = (flat >= 0) & (flat < n_classes)
    b_idx, p_idx = np.nonzero(valid)
    onehot[b_idx, flat[b_idx, p_idx], p_idx] = 1.0
    row = np.asarray(coo_row, dtype=np.int64)
    col = np.asarray(coo_col, dtype=np.int64)
    val = np.asarray(coo_val, dtype=np.float64)
    if n_depth is None:
        pixel = col
        factor = np.ones((n, col.size))
    else:
        if depth is None:
            raise ValueError("frustum mode needs depth")
        per_cam = n_depth * plane
        pixel = (col // per_cam) * plane + col % plane
        factor = np.asarray(depth, dtype=np.float64).reshape(n, -1)[:, col]
    out = np.zeros((n, n_classes, n_rows))
    for b in range(n):
        for k in range(n_classes):
            out[b, k] = np.bincount(row, weights=val * factor[b] * onehot[b, k, pixel], minlength=n_rows)
    return out


__all__ = [
    "FP16_MAX",
    "FP16_RULES",
    "Fp16Rule",
    "class_lift_reference",
    "decode_fp16",
    "decoded_errors",
    "encode_fp16",
    "fp16_row_tile_offsets",
    "fp16_row_tile_weight",
    "int8_row_snr_db",
    "mixed_ell_values",
    "mixed_tile_values",
    "row_centres_m",
    "row_distances_m",
    "sanitize",
    "select_fp16_rows",
    "tile_row_span",
]

