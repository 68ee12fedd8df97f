"""Block-wise delta-LUT compression of a sampling grid (the ``delta/`` group).

Pure numpy. Encodes the float64 feature-pixel grid ``(n_cam, n_h, ny, nx, 2)`` so that a model
decodes it with a handful of NPU-friendly tensor ops (Gather by block id, MatMul, Mul, Add,
Reshape/Transpose), every valid cell within ``max_error_px`` (default 1/16 feature pixel).

Design (README "Store contract: delta/"):

* Per camera and height the BEV grid is tiled into ``B x B`` blocks (``--block``, default 10;
  the bottom/right edge is padded and the padding is cropped after decoding). Block
  ``(cam, ih, by, bx)`` covers cells ``iy = by * B + ly``, ``ix = bx * B + lx``.
* ``block_slot[cam, ih, by, bx]`` is a row of the per-block tables. Row 0 is the EMPTY row
  (blocks with no valid cell): it decodes every cell to ``(-2, -2)``.
* Each row holds a quadratic PREDICTOR ``coef`` int16 ``(6, 2)`` over the constant basis
  ``basis`` float32 ``(6, B, B)`` = ``[1, tx, ty, tx^2, tx ty, ty^2]`` with
  ``tx = (2 lx - (B - 1)) / D``, ``ty = (2 ly - (B - 1)) / D``, ``D = 2**ceil(log2(max(B - 1, 1)))``
  (exact dyadic values in ``[-1, 1]``), a per-row ``scale`` float16 ``(2,)`` =
  ``(2**e_coef, 2**e_res)`` (exact powers of two), an int8 RESIDUAL slab ``res8[res8_slot]``
  ``(B, B, 2)`` and an int16 ESCAPE slab ``res16[res16_slot]`` ``(B, B, 2)``. Slab 0 of both
  tables is all zeros.
* DECODE (``k = block_slot[block]``, cell ``(ly, lx)``, axis ``c``)::

      coords = scale[k, 0] * sum_j coef[k, j, c] * basis[j, ly, lx]
             + scale[k, 1] * res8[res8_slot[k], ly, lx, c]
             + 2**-F16 * res16[res16_slot[k], ly, lx, c]

  with ``F16`` = ``escape_frac_bits`` (the largest ``f`` whose int16 range holds
  ``[-2, max(W_f, H_f)]``). In float64 every term is exact, so the decode is bit-reproducible.
* Row kinds: PREDICTOR-ONLY (the quadratic alone meets the bound and puts the block's invalid
  cells off the map; slabs 0), RESIDUAL (int8 residuals with the finest power-of-two step
  ``2**e_res <= 2 max_error_px`` that fits), ESCAPE (``coef = 0``, absolute int16 coordinates
  with ``F16`` fractional bits in the escape slab; always meets the bound).
* INVALID cells are encoded IN-BAND: they decode OFF THE MAP with half a pixel of margin
  (``u <= -1.5 or u >= W_f + 0.5 or v <= -1.5 or v >= H_f + 0.5``; ``(-2, -2)`` where
  reachable), so ``grid_sample`` (bilinear, zeros padding) reads exactly 0 there. No valid
  bitmap is needed and none is loaded.
* ON-DEVICE SIZE = bytes of ``block_slot, coef, scale, res8_slot, res16_slot, res8, res16,
  basis`` (everything the decoder reads); compare with ``norm_int16`` of the same cells,
  ``n_cam * n_h * ny * nx * 2 * 2`` bytes (which also needs ``grid/valid`` to mask invalid cells).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import numpy.typing as npt

from ..errors import UsageError, check_int_option
from .formats import off_map_margin, pixel_q_max_frac_bits
from .ipm import INVALID_PX

BASIS_TERMS = ("1", "tx", "ty", "tx^2", "tx*ty", "ty^2")
N_TERMS = len(BASIS_TERMS)
DEFAULT_BLOCK = 10
MAX_BLOCK = 256
DEFAULT_MAX_ERROR_PX = 1.0 / 16.0
MAX_MAX_ERROR_PX = 1.0
RES8_MAX = 127
COEF_MAX = 32767
EXP_MIN, EXP_MAX = -24, 15  # float16 represents 2**e exactly for e in [-24, 15]
RES_EXP_SPAN = 8  # residual steps tried: 2**e for e in [e_hi - 8, e_hi]
RIDGE = 1e-9
LUT_ARRAYS = ("block_slot", "coef", "scale", "res8_slot", "res16_slot", "res8", "res16", "basis")
"""Every array the decoder reads: the on-device set, in the order of the decode formula."""


def check_block(block: int) -> int:
    return check_int_option("block", block, 1, MAX_BLOCK)


def check_max_error(max_error_px: float) -> float:
    try:
        value = float(max_error_px)
    except (TypeError, ValueError):
        raise UsageError(f"--max-error-px must be a number, got {max_error_px!r}") from None
    if not math.isfinite(value) or not 0.0 < value <= MAX_MAX_ERROR_PX:
        raise UsageError(f"--max-error-px must be in (0, {MAX_MAX_ERROR_PX:g}] feature pixels, got {max_error_px!r}")
    return value


def basis_denominator(block: int) -> int:
    """``D = 2**ceil(log2(max(B - 1, 1)))``."""
    return 1 << max(0, math.ceil(math.log2(max(block - 1, 1))))


def delta_basis(block: int) -> npt.NDArray[np.float32]:
    """The predictor basis ``(6, B, B)`` float32 (exact dyadic values), terms :data:`BASIS_TERMS`.

    Convention: ``[j, ly, lx]``; ``tx = (2 lx - (B - 1)) / D``, ``ty = (2 ly - (B - 1)) / D``.
    """
    block = check_block(block)
    d = float(basis_denominator(block))
    t = (2.0 * np.arange(block, dtype=np.float64) - (block - 1)) / d
    ty, tx = np.meshgrid(t, t, indexing="ij")
    terms = np.stack([np.ones_like(tx), tx, ty, tx * tx, tx * ty, ty * ty])
    return terms.astype(np.float32)


def escape_frac_bits(feature_size: tuple[int, int]) -> int:
    """``F16``: the largest fractional-bit count whose int16 range holds ``[-2, max(W_f, H_f)]``."""
    return pixel_q_max_frac_bits(feature_size)


def check_escape_resolution(feature_size: tuple[int, int], max_error_px: float) -> int:
    """``F16`` for ``feature_size``; UsageError if the escape form cannot meet ``max_error_px``."""
    w_f, h_f = feature_size
    f16 = escape_frac_bits(feature_size)
    if f16 < 0:
        raise UsageError(f"delta: a {w_f}x{h_f} feature map does not fit the int16 escape form")
    if 2.0 ** -(f16 + 1) > max_error_px:
        raise UsageError(
            f"--max-error-px {max_error_px:g} is below the escape form's resolution 2**-{f16 + 1} px "
            f"for a {w_f}x{h_f} feature map"
        )
    return f16


def _index_dtype(n: int) -> type[np.signedinteger[Any]]:
    return np.int16 if n <= np.iinfo(np.int16).max + 1 else np.int32


@dataclass(frozen=True)
class DeltaLUT:
    """The arrays of the ``delta/`` group (see the module docstring).

    Convention:
        block_slot ``(n_cam, n_h, nby, nbx)`` int16/int32 rows; coef ``(R, 6, 2)`` int16;
        scale ``(R, 2)`` float16 ``(2**e_coef, 2**e_res)``; res8_slot / res16_slot ``(R,)``
        int16/int32; res8 ``(N8, B, B, 2)`` int8; res16 ``(N16, B, B, 2)`` int16 (absolute
        ``(u, v)`` in units of ``2**-escape_frac_bits`` px); basis ``(6, B, B)`` float32.
        Last axis of coef / res8 / res16: ``(u, v)`` feature pixels.
    """

    block_slot: npt.NDArray[np.signedinteger[Any]]
    coef: npt.NDArray[np.int16]
    scale: npt.NDArray[np.float16]
    res8_slot: npt.NDArray[np.signedinteger[Any]]
    res16_slot: npt.NDArray[np.signedinteger[Any]]
    res8: npt.NDArray[np.int8]
    res16: npt.NDArray[np.int16]
    basis: npt.NDArray[np.float32]
    block: int
    logical_shape: tuple[int, int, int, int]  # (n_cam, n_h, ny, nx); a region's (n_cam, n_h, 1, n_kept)
    escape_frac_bits: int
    cell_pos: npt.NDArray[np.int32] | None = None  # bev.region: (n_kept,) position of each kept cell in the decoded blocks

    @property
    def array_names(self) -> tuple[str, ...]:
        """:data:`LUT_ARRAYS`, and ``cell_pos`` for a region."""
        return LUT_ARRAYS if self.cell_pos is None else (*LUT_ARRAYS, "cell_pos")

    def arrays(self) -> dict[str, np.ndarray]:
        return {name: getattr(self, name) for name in self.array_names}

    def on_device_bytes(self) -> dict[str, int]:
        return {name: int(getattr(self, name).nbytes) for name in self.array_names}


@dataclass(frozen=True)
class DeltaEncoding:
    """A :class:`DeltaLUT` and the figures measured after encoding."""

    lut: DeltaLUT
    max_error_px: float  # measured, valid cells, both axes, float64 decode
    max_error_px_float32: float  # measured with the decode run in float32 (device arithmetic)
    max_error_bound_px: float
    n_blocks: int
    n_active: int
    n_predictor_only: int
    n_residual: int
    n_escape: int
    invalid_not_off_map: int  # invalid cells that do not decode off the map (0 by construction)
    on_device_bytes: dict[str, int] = field(default_factory=dict)
    norm_int16_bytes: int = 0

    @property
    def on_device_total(self) -> int:
        return sum(self.on_device_bytes.values())

    @property
    def ratio(self) -> float:
        return self.on_device_total / self.norm_int16_bytes if self.norm_int16_bytes else float("nan")


def _blocks(values: np.ndarray, block: int, fill: Any) -> np.ndarray:
    """``(n_cam, n_h, ny, nx, *tail)`` -> ``(n_blocks, B * B, *tail)`` (edge padded with ``fill``)."""
    n_cam, n_h, ny, nx = values.shape[:4]
    tail = values.shape[4:]
    nby, nbx = -(-ny // block), -(-nx // block)
    padded = np.full((n_cam, n_h, nby * block, nbx * block, *tail), fill, dtype=values.dtype)
    padded[:, :, :ny, :nx] = values
    padded = padded.reshape(n_cam, n_h, nby, block, nbx, block, *tail)
    order = (0, 1, 2, 4, 3, 5, *range(6, 6 + len(tail)))
    return padded.transpose(order).reshape(n_cam * n_h * nby * nbx, block * block, *tail)


def _unblocks(values: np.ndarray, block: int, logical_shape: tuple[int, int, int, int]) -> np.ndarray:
    """Inverse of :func:`_blocks` (crops the padding)."""
    n_cam, n_h, ny, nx = logical_shape
    nby, nbx = -(-ny // block), -(-nx // block)
    tail = values.shape[2:]
    grid = values.reshape(n_cam, n_h, nby, nbx, block, block, *tail)
    order = (0, 1, 2, 4, 3, 5, *range(6, 6 + len(tail)))
    grid = grid.transpose(order).reshape(n_cam, n_h, nby * block, nbx * block, *tail)
    return grid[:, :, :ny, :nx]


def _pow2_exponent(max_abs: np.ndarray, limit: int) -> np.ndarray:
    """Smallest ``e`` in ``[EXP_MIN, EXP_MAX]`` with ``max_abs / 2**e <= limit``."""
    with np.errstate(divide="ignore"):
        e = np.ceil(np.log2(np.maximum(max_abs, 1e-300) / limit))
    return np.clip(e, EXP_MIN, EXP_MAX).astype(np.int64)


def decode_delta(lut: DeltaLUT, dtype: npt.DTypeLike = np.float64) -> npt.NDArray[np.floating]:
    """Decode a :class:`DeltaLUT` to ``(n_cam, n_h, ny, nx, 2)`` ``(u, v)`` feature pixels.

    Exactly the tensor ops a model runs: Gather rows by block id, Gather slabs by slot, one
    MatMul with the constant basis, Mul by the per-row scales, Add, Reshape/Transpose/Slice.
    ``dtype=float32`` reproduces device arithmetic (float64 is exact). A region's LUT (``cell_pos``)
    decodes to ``(n_cam, n_h, 1, n_kept, 2)``: the blocks, then one Gather of ``cell_pos``.
    """
    block = lut.block
    bb = block * block
    slot = np.asarray(lut.block_slot, dtype=np.int64).reshape(-1)
    coef = np.asarray(lut.coef).astype(dtype)[slot]  # Gather (n_blocks, 6, 2)
    scale = np.asarray(lut.scale).astype(dtype)[slot]  # Gather (n_blocks, 2)
    basis = np.asarray(lut.basis).astype(dtype).reshape(N_TERMS, bb)
    pred = np.einsum("kjc,jn->knc", coef, basis)  # MatMul (n_blocks, B*B, 2)
    res8 = np.asarray(lut.res8).astype(dtype).reshape(-1, bb, 2)[np.asarray(lut.res8_slot, dtype=np.int64)[slot]]
    res16 = np.asarray(lut.res16).astype(dtype).reshape(-1, bb, 2)[np.asarray(lut.res16_slot, dtype=np.int64)[slot]]
    escape_scale = np.asarray(2.0**-lut.escape_frac_bits, dtype=dtype)
    coords = pred * scale[:, None, 0:1] + res8 * scale[:, None, 1:2] + res16 * escape_scale
    if lut.cell_pos is not None:  # bev.region: ONE Gather of the kept cells from the decoded blocks
        n_cam, n_h = lut.logical_shape[:2]
        picked = coords.reshape(n_cam, n_h, -1, 2)[:, :, np.asarray(lut.cell_pos, dtype=np.int64)]
        return picked.reshape(*lut.logical_shape, 2)
    return _unblocks(coords, block, lut.logical_shape)


def _place_invalid(pred: np.ndarray, step: float, feature_size: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """Residuals that move predicted invalid cells off the map at residual ``step``.

    Candidates in order: towards ``(-2, -2)``, ``(W_f + 1, -2)``, ``(-2, H_f + 1)``,
    ``(W_f + 1, H_f + 1)``, then residual 0; the first whose decode satisfies the OFF-MAP RULE
    wins. Returns ``(residual int64 (..., 2), placed bool (...))``.
    """
    w_f, h_f = feature_size
    targets = [(INVALID_PX, INVALID_PX), (w_f + 1.0, INVALID_PX), (INVALID_PX, h_f + 1.0), (w_f + 1.0, h_f + 1.0)]
    residual = np.zeros(pred.shape, dtype=np.int64)
    placed = np.zeros(pred.shape[:-1], dtype=bool)
    for target in [*targets, None]:
        if target is None:
            r = np.zeros(pred.shape, dtype=np.int64)
        else:
            r = np.clip(np.rint((np.asarray(target) - pred) / step), -RES8_MAX, RES8_MAX).astype(np.int64)
        ok = off_map_margin(pred + r * step, feature_size) & ~placed
        residual = np.where(ok[..., None], r, residual)
        placed |= ok
    return residual, placed


def encode_delta(
    coords_feature_px: npt.NDArray[np.floating],
    valid: npt.NDArray[np.bool_],
    feature_size: tuple[int, int],
    *,
    block: int = DEFAULT_BLOCK,
    max_error_px: float = DEFAULT_MAX_ERROR_PX,
    care: npt.NDArray[np.bool_] | None = None,
) -> DeltaEncoding:
    """Encode a feature-pixel grid into a :class:`DeltaLUT` and measure it.

    ``care`` ``(n_cam, n_h, ny, nx)`` bool (optional, default all): cells that matter; the others
    are treated like the edge padding (not fitted, may decode to anything; they must be invalid).

    Convention:
        coords_feature_px ``(n_cam, n_h, ny, nx, 2)`` float ``(u, v)`` feature pixels (invalid
        cells may hold anything, NaN included: they are ignored); valid ``(n_cam, n_h, ny, nx)``.
        Valid cells must lie in the extended map ``[-1, W_f] x [-1, H_f]`` (the VALID RULE keeps
        grid cells in ``[-0.5, W_f - 0.5)``); otherwise :class:`UsageError`.
    """
    block = check_block(block)
    max_error_px = check_max_error(max_error_px)
    coords = np.asarray(coords_feature_px, dtype=np.float64)
    valid = np.asarray(valid, dtype=bool)
    if coords.ndim != 5 or coords.shape[-1] != 2 or valid.shape != coords.shape[:-1]:
        raise UsageError(f"delta: coords must be (n_cam, n_h, ny, nx, 2) with valid (n_cam, n_h, ny, nx); got {coords.shape} and {valid.shape}")
    w_f, h_f = feature_size
    f16 = check_escape_resolution(feature_size, max_error_px)
    with np.errstate(invalid="ignore"):
        inside = np.isfinite(coords).all(axis=-1) & (coords[..., 0] >= -1) & (coords[..., 0] <= w_f) & (coords[..., 1] >= -1) & (coords[..., 1] <= h_f)
    bad = valid & ~inside
    if bad.any():
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        raise UsageError(
            f"delta: valid cell {where} has coords {coords[where].tolist()}, outside the extended map "
            f"[-1, {w_f}] x [-1, {h_f}] px"
        )
    logical_shape = (coords.shape[0], coords.shape[1], coords.shape[2], coords.shape[3])
    bb = block * block
    x = _blocks(np.where(valid[..., None], coords, 0.0), block, 0.0)  # (nb, B*B, 2)
    vb = _blocks(valid, block, False)  # (nb, B*B)
    real = _blocks(np.ones(valid.shape, dtype=bool) if care is None else np.asarray(care, dtype=bool), block, False)
    n_blocks = int(vb.shape[0])
    basis32 = delta_basis(block)
    basis = basis32.astype(np.float64).reshape(N_TERMS, bb)  # (6, n)

    active = np.nonzero(vb.any(axis=1))[0]
    n_active = int(active.size)
    xa, va, ra = x[active], vb[active], real[active]
    inv = ra & ~va  # invalid, non-padding cells of active blocks

    # -- quadratic predictor: ridge least squares on the valid cells, then int16 ----------
    w = va.astype(np.float64)
    gram = np.einsum("kn,in,jn->kij", w, basis, basis) + RIDGE * np.eye(N_TERMS)
    rhs = np.einsum("kn,in,knc->kic", w, basis, xa)
    coef = np.linalg.solve(gram, rhs) if n_active else np.zeros((0, N_TERMS, 2))
    e_coef = _pow2_exponent(np.abs(coef).max(axis=(1, 2)) if n_active else np.zeros(0), COEF_MAX)
    coef_q = np.clip(np.rint(coef / 2.0 ** e_coef[:, None, None]), -COEF_MAX, COEF_MAX).astype(np.int64)
    pred = np.einsum("kjc,jn->knc", coef_q.astype(np.float64), basis) * 2.0 ** e_coef[:, None, None]

    # -- row kinds ------------------------------------------------------------------------
    err = np.abs(pred - xa).max(axis=-1)
    predictor_only = np.all(~va | (err <= max_error_px), axis=1) & np.all(~inv | off_map_margin(pred, feature_size), axis=1)
    e_hi = int(np.clip(math.floor(math.log2(2.0 * max_error_px)), EXP_MIN, EXP_MAX))
    e_res = np.zeros(n_active, dtype=np.int64)
    residual = np.zeros((n_active, bb, 2), dtype=np.int64)
    chosen = predictor_only.copy()
    for e in range(max(EXP_MIN, e_hi - RES_EXP_SPAN), e_hi + 1):
        todo = np.nonzero(~chosen)[0]
        if todo.size == 0:
            break
        step = 2.0**e
        p = pred[todo]
        r_valid = np.rint((xa[todo] - p) / step)
        fits = np.all(~va[todo] | (np.abs(r_valid) <= RES8_MAX).all(axis=-1), axis=1)
        r_inv, placed = _place_invalid(p, step, feature_size)
        ok = fits & np.all(~inv[todo] | placed, axis=1)
        rows = todo[ok]
        r = np.where(va[todo][..., None], np.clip(r_valid, -RES8_MAX, RES8_MAX).astype(np.int64), np.where(inv[todo][..., None], r_inv, 0))
        residual[rows] = r[ok]
        e_res[rows] = e
        chosen[rows] = True
    escape = ~chosen
    is_residual = chosen & ~predictor_only

    # -- tables ---------------------------------------------------------------------------
    n_rows = n_active + 1
    n8 = 1 + int(is_residual.sum())
    n16 = 1 + int(escape.sum())
    coef_table = np.zeros((n_rows, N_TERMS, 2), dtype=np.int16)
    scale_exp = np.zeros((n_rows, 2), dtype=np.int64)
    empty_exp = int(_pow2_exponent(np.array([abs(INVALID_PX)]), COEF_MAX)[0])
    coef_table[0, 0, :] = round(INVALID_PX / 2.0**empty_exp)
    scale_exp[0] = (empty_exp, 0)
    body = np.where(escape[:, None, None], 0, coef_q)
    coef_table[1:] = body.astype(np.int16)
    scale_exp[1:, 0] = np.where(escape, 0, e_coef)
    scale_exp[1:, 1] = np.where(is_residual, e_res, 0)
    res8_slot = np.zeros(n_rows, dtype=np.int64)
    res8_slot[1:][is_residual] = np.arange(1, n8)
    res16_slot = np.zeros(n_rows, dtype=np.int64)
    res16_slot[1:][escape] = np.arange(1, n16)
    res8 = np.zeros((n8, bb, 2), dtype=np.int8)
    res8[1:] = residual[is_residual].astype(np.int8)
    res16 = np.zeros((n16, bb, 2), dtype=np.int16)
    if escape.any():
        esc_x = xa[escape]
        esc_q = np.rint(esc_x * 2.0**f16)
        esc_q = np.where(va[escape][..., None], esc_q, INVALID_PX * 2.0**f16)
        res16[1:] = esc_q.astype(np.int16)
    block_slot = np.zeros(n_blocks, dtype=np.int64)
    block_slot[active] = np.arange(1, n_rows)
    n_cam, n_h, ny, nx = logical_shape
    nby, nbx = -(-ny // block), -(-nx // block)
    slot_dtype = _index_dtype(n_rows)
    lut = DeltaLUT(
        block_slot=block_slot.reshape(n_cam, n_h, nby, nbx).astype(slot_dtype),
        coef=coef_table,
        scale=(2.0 ** scale_exp.astype(np.float64)).astype(np.float16),
        res8_slot=res8_slot.astype(_index_dtype(n8)),
        res16_slot=res16_slot.astype(_index_dtype(n16)),
        res8=res8.reshape(n8, block, block, 2),
        res16=res16.reshape(n16, block, block, 2),
        basis=basis32,
        block=block,
        logical_shape=logical_shape,
        escape_frac_bits=f16,
    )

    # -- measure --------------------------------------------------------------------------
    decoded = decode_delta(lut)
    decoded32 = decode_delta(lut, np.float32).astype(np.float64)
    invalid_cells = ~valid
    return DeltaEncoding(
        lut=lut,
        max_error_px=_max_err(decoded, coords, valid),
        max_error_px_float32=_max_err(decoded32, coords, valid),
        max_error_bound_px=max_error_px,
        n_blocks=n_blocks,
        n_active=n_active,
        n_predictor_only=int(predictor_only.sum()),
        n_residual=int(is_residual.sum()),
        n_escape=int(escape.sum()),
        invalid_not_off_map=int(np.count_nonzero(invalid_cells & ~off_map_margin(decoded, feature_size))),
        on_device_bytes=lut.on_device_bytes(),
        norm_int16_bytes=int(np.prod(logical_shape)) * 2 * 2,
    )


def _max_err(decoded: np.ndarray, coords: np.ndarray, valid: np.ndarray) -> float:
    err = np.abs(decoded - coords)[valid]
    return float(err.max()) if err.size else 0.0


# --------------------------------------------------------------------------------------
# bev.region: B x B blocks on each cell size's own lattice, one Gather back to the kept cells
# --------------------------------------------------------------------------------------
#
# A kept (super-)cell (iy, ix, size s) sits at (iy / s, ix / s) of the lattice of s-cells,
# (ny / s) x (nx / s) cells of side s (its centre is that lattice cell's centre). Each size present
# is tiled into the usual B x B blocks (edge padded), the sizes in increasing order, each lattice's
# blocks row-major: block_slot[cam, ih, b] is a row of the same per-block tables as the full grid's.
# Lattice cells that are not a kept cell of that size are DON'T-CARE (not fitted, not measured,
# decode to anything); blocks without a valid kept cell are the empty row 0. The decode is the full
# grid's (Gather rows by block id, MatMul with the basis, Mul, Add) giving (n_cam, n_h, n_blocks * B * B, 2)
# followed by ONE Gather of the static int32 ``cell_pos`` (n_kept,): kept cell k reads position
# cell_pos[k] = (block_offset(s) + (by * nbx_s + bx)) * B * B + ly * B + lx with
# (by, ly) = divmod(iy / s, B), (bx, lx) = divmod(ix / s, B). A region's spatial neighbours stay in
# one block (the 2-D predictor fits them as on the full grid), whatever the region's shape.


def region_cell_positions(cells: npt.NDArray[np.integer[Any]], bev_shape: tuple[int, int], block: int) -> tuple[npt.NDArray[np.int32], list[tuple[int, int, int]]]:
    """``cell_pos`` ``(n_kept,)`` int32 and the lattices ``[(size, nby, nbx), ...]`` (increasing
    size) of the region delta-LUT (see the comment above) for the cell table ``cells``."""
    block = check_block(block)
    ny, nx = bev_shape
    cells64 = np.asarray(cells, dtype=np.int64).reshape(-1, 3)
    pos = np.zeros(cells64.shape[0], dtype=np.int64)
    lattices: list[tuple[int, int, int]] = []
    offset = 0
    for size in sorted({int(v) for v in np.unique(cells64[:, 2])}):
        rows = np.flatnonzero(cells64[:, 2] == size)
        nby, nbx = -(-(ny // size) // block), -(-(nx // size) // block)
        by, ly = np.divmod(cells64[rows, 0] // size, block)
        bx, lx = np.divmod(cells64[rows, 1] // size, block)
        pos[rows] = ((offset + by * nbx + bx) * block + ly) * block + lx
        lattices.append((size, nby, nbx))
        offset += nby * nbx
    if offset * block * block > np.iinfo(np.int32).max:
        raise UsageError(f"delta: {offset} blocks of {block} x {block} cells do not fit int32 cell positions")
    return pos.astype(np.int32), lattices


def encode_region_delta(
    coords_feature_px: npt.NDArray[np.floating],
    valid: npt.NDArray[np.bool_],
    feature_size: tuple[int, int],
    cells: npt.NDArray[np.integer[Any]],
    bev_shape: tuple[int, int],
    *,
    block: int = DEFAULT_BLOCK,
    max_error_px: float = DEFAULT_MAX_ERROR_PX,
) -> DeltaEncoding:
    """Encode a region's kept cells into a :class:`DeltaLUT` with ``cell_pos`` and measure it
    (every figure over the kept cells; see the comment above).

    Convention:
        coords_feature_px ``(n_cam, n_h, n_kept, 2)`` float ``(u, v)`` feature pixels, valid
        ``(n_cam, n_h, n_kept)``, both in the order of ``cells`` ``(n_kept, 3)`` ``(iy, ix, size)``;
        ``bev_shape`` ``(ny, nx)``. The LUT's ``logical_shape`` is ``(n_cam, n_h, 1, n_kept)``.
    """
    block = check_block(block)
    coords = np.asarray(coords_feature_px, dtype=np.float64)
    valid = np.asarray(valid, dtype=bool)
    n_cam, n_h, n_kept = valid.shape
    cell_pos, lattices = region_cell_positions(cells, bev_shape, block)
    n_slots = sum(nby * nbx for _, nby, nbx in lattices) * block * block
    flat_coords = np.zeros((n_cam, n_h, n_slots, 2), dtype=np.float64)
    flat_valid = np.zeros((n_cam, n_h, n_slots), dtype=bool)
    care = np.zeros(n_slots, dtype=bool)
    flat_coords[:, :, cell_pos] = np.where(valid[..., None], coords, 0.0)
    flat_valid[:, :, cell_pos] = valid
    care[cell_pos] = True
    # the blocked layout (n_cam, n_h, n_blocks, B * B) IS one lattice of n_blocks x 1 blocks
    shape4 = (n_cam, n_h, n_slots // block, block)
    encoding = encode_delta(
        flat_coords.reshape(*shape4, 2), flat_valid.reshape(shape4), feature_size, block=block, max_error_px=max_error_px,
        care=np.broadcast_to(care.reshape(1, 1, *shape4[2:]), shape4),
    )
    lut = replace(encoding.lut, cell_pos=cell_pos, logical_shape=(n_cam, n_h, 1, n_kept))
    decoded = decode_delta(lut)[:, :, 0]
    decoded32 = decode_delta(lut, np.float32)[:, :, 0].astype(np.float64)
    return replace(
        encoding,
        lut=lut,
        max_error_px=_max_err(decoded, coords, valid),
        max_error_px_float32=_max_err(decoded32, coords, valid),
        invalid_not_off_map=int(np.count_nonzero(~valid & ~off_map_margin(decoded, feature_size))),
        on_device_bytes=lut.on_device_bytes(),
        norm_int16_bytes=n_cam * n_h * n_kept * 2 * 2,
    )
