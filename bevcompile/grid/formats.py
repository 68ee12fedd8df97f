"""Fixed-point coordinate formats that NPU toolchains consume (``bevcompile grid --format``).

Pure numpy. Every format is encoded from the float64 :class:`~bevcompile.grid.SamplingGrid`
(``opencv`` excepted, see below) and its error is MEASURED after encoding: max over valid
cells and both axes of ``|decode(q) - coords|`` in feature pixels.

Formats (all arrays live in ``grid/``, shape ``(n_cam, n_h, ny, nx[, 2])``, last axis
``(x, y)`` = ``(u, v)``; round = round half to even; ``W``/``H`` = ``W_f``/``H_f``):

* ``norm_int16`` (always written by the base grid): ``q = clip(round(norm * 32767), ±32767)``.
  Invalid cells are NOT in-band: mask with ``grid/valid``.
* ``uq12`` (``grid/uq12`` uint16): ``q = clip(round(norm * 2047.5 + 2047.5), 0, 4095)``,
  ``norm = (q - 2047.5) / 2047.5``. Invalid cells are NOT in-band (they saturate to -1).
* ``opencv`` (``grid/opencv_map1`` int16 ``(..., 2)``, ``grid/opencv_map2`` uint16 ``(...)``):
  exactly ``cv2.convertMaps(map_x, map_y, cv2.CV_16SC2)`` of the float32 feature-pixel maps
  ``map_x, map_y = grid/coords[..., 0], grid/coords[..., 1]``: ``ix = round(32 x)``,
  ``map1 = sat_int16((ix >> 5, iy >> 5))`` (arithmetic shift), ``map2 = (iy & 31) * 32 + (ix & 31)``
  (INTER_BITS = 5). Decode ``u = map1[..., 0] + (map2 & 31) / 32``,
  ``v = map1[..., 1] + (map2 >> 5) / 32``. The input is the float32 ``grid/coords`` (not the
  float64 grid) so that ``cv2.convertMaps`` on the stored coords reproduces the maps bit for
  bit; the error is still measured against float64. Invalid cells ``(-2, -2)`` are in-band:
  ``cv2.remap`` with ``BORDER_CONSTANT`` 0 samples 0 there.
* ``pixel_q`` (``grid/pixel_q`` int16): absolute feature pixels with ``f`` fractional bits,
  ``q = clip(round(u * 2**f), -32768, 32767)``, ``u = q * 2**-f``. Default ``f`` (Horizon J5
  rule) ``clamp(15 - ceil(log2(max(H_f, W_f, ny, nx) + 1)), 0, 8)``; ``--frac-bits`` overrides
  it and must hold ``[-2, max(W_f, H_f)]`` px. Invalid cells decode to ``(-2, -2)``: in-band.
* ``norm_q16`` (``grid/norm_q16`` int16, Horizon J6 qint16 style): per-axis scale
  ``s = (2 / W + 1) / 32767`` (align_corners False) or ``(2 / (W - 1) + 1) / 32767`` (True),
  valid cells ``q = clip(round(norm / s), -32767, 32767)``, invalid cells ``q = -32768`` on both
  axes; ``norm = q * s``. The sentinel decodes more than one pixel left of / above the map
  (``u = -1.5 - W s / 2`` or ``-1 - (W - 1) s / 2``), so ``grid_sample`` (zeros padding) returns
  exactly 0 there: in-band.

Saturation never wraps: every encoder clips in float64 before the integer cast, and valid cells
of the grid (``-0.5 <= u < W - 0.5``) are inside every format's range except ``uq12`` /
``norm_int16`` under align_corners=True, where ``u < 0`` clamps to the first pixel centre; the
number of such saturated valid cells is recorded (``saturated_valid_cells``) and the measured
error includes them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from ..errors import UsageError
from .ipm import NORM_INT16_SCALE, SamplingGrid, feature_px_to_norm, norm_to_feature_px

FORMATS = ("norm_int16", "uq12", "opencv", "pixel_q", "norm_q16")
"""Every ``--format`` name, in the canonical order used in attributes."""
BASE_FORMAT = "norm_int16"
FORMAT_ARRAYS: dict[str, tuple[str, ...]] = {
    "norm_int16": ("norm_int16",),
    "uq12": ("uq12",),
    "opencv": ("opencv_map1", "opencv_map2"),
    "pixel_q": ("pixel_q",),
    "norm_q16": ("norm_q16",),
}
UQ12_MAX = 4095
UQ12_HALF = 2047.5
OPENCV_INTER_BITS = 5
OPENCV_TAB = 1 << OPENCV_INTER_BITS
NORM_Q16_MAX = 32767
NORM_Q16_INVALID = -32768
PIXEL_Q_MAX_DEFAULT_BITS = 8
INT16_MIN, INT16_MAX = -32768, 32767


def check_format_names(names: Iterable[str]) -> tuple[str, ...]:
    """Validate ``--format`` names; returns the extra formats (all but ``norm_int16``, which
    is always written) in canonical order, without duplicates."""
    names = list(names)
    unknown = [n for n in names if n not in FORMATS]
    if unknown:
        raise UsageError(f"unknown --format {unknown[0]!r}; known formats: {', '.join(FORMATS)}")
    return tuple(n for n in FORMATS if n in names and n != BASE_FORMAT)


# --------------------------------------------------------------------------------------
# uq12
# --------------------------------------------------------------------------------------


def encode_uq12(norm: npt.NDArray[np.floating]) -> npt.NDArray[np.uint16]:
    """``q = clip(round_half_even(norm * 2047.5 + 2047.5), 0, 4095)``.

    Convention: ``(..., 2)`` normalised ``(x, y)`` -> uint16 same shape (12 bits used).
    """
    scaled = np.rint(np.asarray(norm, dtype=np.float64) * UQ12_HALF + UQ12_HALF)
    scaled = np.where(np.isnan(scaled), 0.0, scaled)
    return np.clip(scaled, 0, UQ12_MAX).astype(np.uint16)


def decode_uq12(encoded: npt.NDArray[np.integer]) -> npt.NDArray[np.float64]:
    """``norm = (q - 2047.5) / 2047.5`` (float64)."""
    return (np.asarray(encoded, dtype=np.float64) - UQ12_HALF) / UQ12_HALF


# --------------------------------------------------------------------------------------
# opencv CV_16SC2 maps
# --------------------------------------------------------------------------------------


def encode_opencv_maps(
    map_x: npt.NDArray[np.floating], map_y: npt.NDArray[np.floating]
) -> tuple[npt.NDArray[np.int16], npt.NDArray[np.uint16]]:
    """``cv2.convertMaps(map_x, map_y, cv2.CV_16SC2)`` in numpy (``nninterpolate=False``).

    Convention:
        map_x, map_y: ``(...)`` float pixel coordinates (integer = pixel centre), as given
        (pass float32 to reproduce OpenCV bit for bit). returns ``map1`` ``(..., 2)`` int16
        ``(x >> 5, y >> 5)`` and ``map2`` ``(...)`` uint16 ``(iy & 31) * 32 + (ix & 31)`` with
        ``ix = saturate_int32(round_half_even(32 x))``. Non-finite input encodes as 0.
        Bit-exact for ``|x|, |y| < 2**26`` px; beyond, ``32 x`` overflows int32 and OpenCV's
        SIMD path (INT_MIN) and scalar path (saturation) disagree with each other.
    """

    def fixed(values: npt.NDArray[np.floating]) -> npt.NDArray[np.int64]:
        scaled = np.rint(np.asarray(values, dtype=np.float64) * OPENCV_TAB)
        scaled = np.where(np.isfinite(scaled), scaled, 0.0)
        return np.clip(scaled, -(2**31), 2**31 - 1).astype(np.int64)

    ix = fixed(map_x)
    iy = fixed(map_y)
    map1 = np.stack(
        [np.clip(ix >> OPENCV_INTER_BITS, INT16_MIN, INT16_MAX), np.clip(iy >> OPENCV_INTER_BITS, INT16_MIN, INT16_MAX)],
        axis=-1,
    ).astype(np.int16)
    map2 = ((iy & (OPENCV_TAB - 1)) * OPENCV_TAB + (ix & (OPENCV_TAB - 1))).astype(np.uint16)
    return map1, map2


def decode_opencv_maps(map1: npt.NDArray[np.integer], map2: npt.NDArray[np.integer]) -> npt.NDArray[np.float64]:
    """``(u, v) = map1 + (map2 & 31, map2 >> 5) / 32`` (float64, ``(..., 2)``)."""
    frac = np.asarray(map2).astype(np.int64)
    whole = np.asarray(map1, dtype=np.float64)
    return np.stack(
        [
            whole[..., 0] + (frac & (OPENCV_TAB - 1)) / OPENCV_TAB,
            whole[..., 1] + ((frac >> OPENCV_INTER_BITS) & (OPENCV_TAB - 1)) / OPENCV_TAB,
        ],
        axis=-1,
    )


# --------------------------------------------------------------------------------------
# pixel_q
# --------------------------------------------------------------------------------------


def j5_default_frac_bits(feature_size: tuple[int, int], bev_shape: tuple[int, int]) -> int:
    """Horizon J5 rule: ``clamp(15 - ceil(log2(max(H_f, W_f, ny, nx) + 1)), 0, 8)``.

    ``feature_size`` is ``(W_f, H_f)``; ``bev_shape`` is ``(ny, nx)``.
    """
    largest = max(*feature_size, *bev_shape)
    return int(min(max(15 - math.ceil(math.log2(largest + 1)), 0), PIXEL_Q_MAX_DEFAULT_BITS))


def pixel_q_max_frac_bits(feature_size: tuple[int, int]) -> int:
    """Largest ``f`` whose int16 range holds ``[-2, max(W_f, H_f)]`` px (-1 if none)."""
    largest = max(feature_size)
    f = -1
    while f < 15 and largest * 2 ** (f + 1) <= INT16_MAX and 2 * 2 ** (f + 1) <= -INT16_MIN:
        f += 1
    return f


def resolve_pixel_q_frac_bits(
    frac_bits: int | None, feature_size: tuple[int, int], bev_shape: tuple[int, int]
) -> int:
    """``frac_bits`` if given (checked against the feature-map range), else the J5 default."""
    f_max = pixel_q_max_frac_bits(feature_size)
    w_f, h_f = feature_size
    if f_max < 0:
        raise UsageError(f"pixel_q cannot hold the feature-map range [-2, {max(feature_size)}] px of a {w_f}x{h_f} map in int16")
    if frac_bits is None:
        return min(j5_default_frac_bits(feature_size, bev_shape), f_max)
    if isinstance(frac_bits, bool) or not isinstance(frac_bits, int | np.integer) or frac_bits < 0:
        raise UsageError(f"--frac-bits must be a non-negative integer, got {frac_bits!r}")
    if frac_bits > f_max:
        raise UsageError(
            f"--frac-bits {frac_bits} cannot hold the feature-map range [-2, {max(feature_size)}] px of the "
            f"{w_f}x{h_f} map in int16 pixel_q (max(W_f, H_f) * 2**{frac_bits} = {max(feature_size) * 2**frac_bits} "
            f"> 32767); use --frac-bits <= {f_max}"
        )
    return int(frac_bits)


def encode_pixel_q(uv_feature_px: npt.NDArray[np.floating], frac_bits: int) -> npt.NDArray[np.int16]:
    """``q = clip(round_half_even(uv * 2**f), -32768, 32767)``.

    Convention: ``(..., 2)`` ``(u, v)`` feature pixels -> int16 same shape; NaN encodes as 0.
    """
    scaled = np.rint(np.asarray(uv_feature_px, dtype=np.float64) * 2.0**frac_bits)
    scaled = np.where(np.isnan(scaled), 0.0, scaled)
    return np.clip(scaled, INT16_MIN, INT16_MAX).astype(np.int16)


def decode_pixel_q(encoded: npt.NDArray[np.integer], frac_bits: int) -> npt.NDArray[np.float64]:
    """``uv = q * 2**-f`` (float64, feature pixels)."""
    return np.asarray(encoded, dtype=np.float64) * 2.0**-frac_bits


# --------------------------------------------------------------------------------------
# norm_q16
# --------------------------------------------------------------------------------------


def norm_q16_scale(feature_size: tuple[int, int], align_corners: bool) -> tuple[float, float]:
    """Per-axis ``(s_x, s_y)``: ``(2 / W + 1) / 32767`` (align_corners False) or
    ``(2 / (W - 1) + 1) / 32767`` (True), with ``W`` the axis size."""

    def one(size: int) -> float:
        span = 2.0 / (size - 1) if align_corners else 2.0 / size
        return (span + 1.0) / NORM_Q16_MAX

    if align_corners and min(feature_size) < 2:
        raise UsageError("norm_q16 with align_corners needs a feature map at least 2 pixels wide and high")
    return one(feature_size[0]), one(feature_size[1])


def encode_norm_q16(
    norm: npt.NDArray[np.floating], valid: npt.NDArray[np.bool_], scale: tuple[float, float]
) -> npt.NDArray[np.int16]:
    """Valid cells ``q = clip(round_half_even(norm / s), -32767, 32767)``; invalid ``-32768``.

    Convention: norm ``(..., 2)`` ``(x, y)``; valid ``(...)`` bool; scale ``(s_x, s_y)``.
    returns int16 ``(..., 2)``.
    """
    s = np.asarray(scale, dtype=np.float64)
    scaled = np.rint(np.asarray(norm, dtype=np.float64) / s)
    scaled = np.where(np.isnan(scaled), 0.0, scaled)
    q = np.clip(scaled, -NORM_Q16_MAX, NORM_Q16_MAX)
    q = np.where(np.asarray(valid, dtype=bool)[..., None], q, NORM_Q16_INVALID)
    return q.astype(np.int16)


def decode_norm_q16(encoded: npt.NDArray[np.integer], scale: tuple[float, float]) -> npt.NDArray[np.float64]:
    """``norm = q * s`` per axis (float64)."""
    return np.asarray(encoded, dtype=np.float64) * np.asarray(scale, dtype=np.float64)


def off_map_margin(uv_feature_px: npt.NDArray[np.floating], feature_size: tuple[int, int]) -> npt.NDArray[np.bool_]:
    """True where bilinear sampling with zeros padding reads NO pixel, with half a pixel of
    margin: ``u <= -1.5 or u >= W_f + 0.5 or v <= -1.5 or v >= H_f + 0.5`` (the OFF-MAP RULE
    of in-band invalid encodings; exactly 0 needs ``u <= -1 or u >= W_f ...``)."""
    w_f, h_f = feature_size
    uv = np.asarray(uv_feature_px, dtype=np.float64)
    u, v = uv[..., 0], uv[..., 1]
    with np.errstate(invalid="ignore"):
        return (u <= -1.5) | (u >= w_f + 0.5) | (v <= -1.5) | (v >= h_f + 0.5)


def samples_zero(uv_feature_px: npt.NDArray[np.floating], feature_size: tuple[int, int]) -> npt.NDArray[np.bool_]:
    """True where bilinear sampling with zeros padding is exactly 0 whatever the features:
    ``u <= -1 or u >= W_f or v <= -1 or v >= H_f`` (every corner outside or weighted 0)."""
    w_f, h_f = feature_size
    uv = np.asarray(uv_feature_px, dtype=np.float64)
    u, v = uv[..., 0], uv[..., 1]
    with np.errstate(invalid="ignore"):
        return (u <= -1) | (u >= w_f) | (v <= -1) | (v >= h_f)


# --------------------------------------------------------------------------------------
# building the products
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FormatProduct:
    """One format's arrays (``grid/<name>``) and its attribute block (``grid`` attrs[name])."""

    name: str
    arrays: dict[str, np.ndarray]
    attrs: dict[str, Any] = field(default_factory=dict)

    @property
    def max_error_px(self) -> float:
        return float(self.attrs["max_error_px"])


def max_error_px(decoded_px: npt.NDArray[np.floating], coords_px: npt.NDArray[np.floating], valid: npt.NDArray[np.bool_]) -> float:
    """Max over valid cells and both axes of ``|decoded - coords|`` (feature px; 0 if none)."""
    err = np.abs(np.asarray(decoded_px, dtype=np.float64) - np.asarray(coords_px, dtype=np.float64))[np.asarray(valid, dtype=bool)]
    if err.size == 0:
        return 0.0
    return float(np.max(np.where(np.isnan(err), np.inf, err)))


def decode_format_px(
    name: str,
    arrays: Mapping[str, np.ndarray],
    feature_size: tuple[int, int],
    align_corners: bool,
    *,
    frac_bits: int | None = None,
) -> npt.NDArray[np.float64]:
    """Decode format ``name`` to ``(u, v)`` feature pixels, ``(..., 2)`` float64.

    ``arrays`` maps the format's array names (:data:`FORMAT_ARRAYS`) to their data;
    ``frac_bits`` is needed for ``pixel_q``. Scales are recomputed from the feature size and
    align_corners (not read from attributes).
    """
    if name == "norm_int16":
        return norm_to_feature_px(arrays["norm_int16"].astype(np.float64) / NORM_INT16_SCALE, feature_size, align_corners)
    if name == "uq12":
        return norm_to_feature_px(decode_uq12(arrays["uq12"]), feature_size, align_corners)
    if name == "opencv":
        return decode_opencv_maps(arrays["opencv_map1"], arrays["opencv_map2"])
    if name == "pixel_q":
        if frac_bits is None:
            raise UsageError("decoding pixel_q needs frac_bits")
        return decode_pixel_q(arrays["pixel_q"], frac_bits)
    if name == "norm_q16":
        scale = norm_q16_scale(feature_size, align_corners)
        return norm_to_feature_px(decode_norm_q16(arrays["norm_q16"], scale), feature_size, align_corners)
    raise UsageError(f"unknown format {name!r}; known formats: {', '.join(FORMATS)}")


def format_invalid_in_band(name: str) -> bool:
    """Whether invalid cells are encoded in-band (sample 0 without ``grid/valid``)."""
    return name in ("opencv", "pixel_q", "norm_q16")


def build_format(
    name: str,
    grid: SamplingGrid,
    align_corners: bool,
    *,
    pixel_q_frac_bits: int | None = None,
) -> FormatProduct:
    """Encode ``grid`` in format ``name`` (not ``norm_int16``: the base grid writes it) and
    measure its error. ``pixel_q_frac_bits`` must be resolved (see
    :func:`resolve_pixel_q_frac_bits`) for ``pixel_q``."""
    coords = grid.coords_feature_px
    valid = grid.valid
    feature_size = grid.feature_size
    w_f, h_f = feature_size
    norm = feature_px_to_norm(coords, feature_size, align_corners)
    common: dict[str, Any] = {"arrays": list(FORMAT_ARRAYS.get(name, ())), "invalid_in_band": format_invalid_in_band(name)}
    if name == "uq12":
        q = encode_uq12(norm)
        pre = norm * UQ12_HALF + UQ12_HALF
        saturated = int(np.count_nonzero(((pre < -0.5) | (pre > UQ12_MAX + 0.5)).any(axis=-1) & valid))
        decoded = decode_format_px(name, {"uq12": q}, feature_size, align_corners)
        attrs = {
            **common,
            "dtype": "uint16",
            "bits": 12,
            "axis_order": "(x, y) normalised (grid_sample)",
            "encode": "q = clip(round_half_even(norm * 2047.5 + 2047.5), 0, 4095)",
            "decode": "norm = (q - 2047.5) / 2047.5",
            "scale": 1.0 / UQ12_HALF,
            "offset": -1.0,
            "invalid_note": "invalid cells saturate to q = 0 (norm -1, in range): mask with grid/valid",
        }
        arrays: dict[str, np.ndarray] = {"uq12": q}
    elif name == "opencv":
        coords32 = coords.astype(np.float32)
        map1, map2 = encode_opencv_maps(coords32[..., 0], coords32[..., 1])
        map1_64, map2_64 = encode_opencv_maps(coords[..., 0], coords[..., 1])
        differing = int(np.count_nonzero((map1 != map1_64).any(axis=-1) | (map2 != map2_64)))
        saturated = int(np.count_nonzero((np.abs(coords * OPENCV_TAB) >= 2**31).any(axis=-1) & valid))
        decoded = decode_opencv_maps(map1, map2)
        arrays = {"opencv_map1": map1, "opencv_map2": map2}
        attrs = {
            **common,
            "dtype": {"opencv_map1": "int16 (..., 2)", "opencv_map2": "uint16 (...)"},
            "inter_bits": OPENCV_INTER_BITS,
            "axis_order": "map1 (x, y) = (u, v) integer feature pixels; map2 = (v frac) * 32 + (u frac)",
            "encoded_from": "grid/coords (float32): cv2.convertMaps(coords[..., 0], coords[..., 1], cv2.CV_16SC2)",
            "encode": "ix = round_half_even(32 u); iy = round_half_even(32 v); map1 = (ix >> 5, iy >> 5); map2 = (iy & 31) * 32 + (ix & 31)",
            "decode": "u = map1[..., 0] + (map2 & 31) / 32; v = map1[..., 1] + (map2 >> 5) / 32",
            "scale": 1.0 / OPENCV_TAB,
            "offset": 0.0,
            "invalid_note": "invalid cells map to (-2, -2): cv2.remap(INTER_LINEAR, BORDER_CONSTANT 0) samples 0",
            "cells_differing_from_float64_encoding": differing,
        }
    elif name == "pixel_q":
        if pixel_q_frac_bits is None:
            raise UsageError("pixel_q needs resolved fractional bits")
        f = int(pixel_q_frac_bits)
        q16 = encode_pixel_q(coords, f)
        pre = coords * 2.0**f
        saturated = int(np.count_nonzero(((pre < INT16_MIN - 0.5) | (pre > INT16_MAX + 0.5)).any(axis=-1) & valid))
        decoded = decode_pixel_q(q16, f)
        arrays = {"pixel_q": q16}
        attrs = {
            **common,
            "dtype": "int16",
            "frac_bits": f,
            "axis_order": "(u, v) absolute feature pixels, integer = pixel centre",
            "encode": f"q = clip(round_half_even(u * 2**{f}), -32768, 32767)",
            "decode": f"u = q * 2**-{f}",
            "scale": 2.0**-f,
            "offset": 0.0,
            "range_px": [INT16_MIN * 2.0**-f, INT16_MAX * 2.0**-f],
            "default_rule": "J5: clamp(15 - ceil(log2(max(H_f, W_f, ny, nx) + 1)), 0, 8)",
            "invalid_note": "invalid cells decode to (-2, -2) px: bilinear sampling with zeros padding reads 0",
        }
    elif name == "norm_q16":
        scale = norm_q16_scale(feature_size, align_corners)
        q16 = encode_norm_q16(norm, valid, scale)
        pre = norm / np.asarray(scale)
        saturated = int(np.count_nonzero(((pre < -NORM_Q16_MAX - 0.5) | (pre > NORM_Q16_MAX + 0.5)).any(axis=-1) & valid))
        decoded = decode_format_px(name, {"norm_q16": q16}, feature_size, align_corners)
        sentinel_px = norm_to_feature_px(np.array([NORM_Q16_INVALID * scale[0], NORM_Q16_INVALID * scale[1]]), feature_size, align_corners)
        arrays = {"norm_q16": q16}
        span = "2 / (W - 1)" if align_corners else "2 / W"
        attrs = {
            **common,
            "dtype": "int16",
            "axis_order": "(x, y) normalised (grid_sample)",
            "scale": [scale[0], scale[1]],
            "scale_formula": f"s = ({span} + 1) / 32767 per axis (W = axis size)",
            "offset": 0.0,
            "encode": "valid: q = clip(round_half_even(norm / s), -32767, 32767); invalid: q = -32768 (both axes)",
            "decode": "norm = q * s",
            "invalid_code": NORM_Q16_INVALID,
            "invalid_decodes_to_px": [float(sentinel_px[0]), float(sentinel_px[1])],
            "invalid_note": "q = -32768 decodes more than 1 px outside the map: grid_sample with zeros padding returns exactly 0",
        }
    else:
        raise UsageError(f"unknown --format {name!r}; known formats: {', '.join(FORMATS)}")
    attrs["max_error_px"] = max_error_px(decoded, coords, valid)
    attrs["saturated_valid_cells"] = saturated
    attrs["feature_size"] = [w_f, h_f]
    return FormatProduct(name, arrays, attrs)


def build_formats(
    grid: SamplingGrid,
    names: Iterable[str],
    align_corners: bool,
    *,
    frac_bits: int | None = None,
    bev_shape: tuple[int, int] | None = None,
) -> tuple[list[FormatProduct], int | None]:
    """Every requested extra format (canonical order) and the resolved pixel_q fractional
    bits (None when pixel_q is not requested). ``bev_shape`` ``(ny, nx)`` of the J5 rule
    defaults to the grid's cell axes (give the BEV grid's for a region's one-row lattice)."""
    extra = check_format_names(names)
    pixel_q_bits: int | None = None
    if "pixel_q" in extra:
        ny, nx = bev_shape if bev_shape is not None else grid.valid.shape[-2:]
        pixel_q_bits = resolve_pixel_q_frac_bits(frac_bits, grid.feature_size, (ny, nx))
    products = [build_format(n, grid, align_corners, pixel_q_frac_bits=pixel_q_bits) for n in extra]
    return products, pixel_q_bits
