"""Plug-in of ``inspect`` / ``verify`` / ``--strict`` for the fixed-point FORMAT arrays of ``grid/``
(``uq12``, ``opencv_map1/2``, ``pixel_q``, ``norm_q16``; the four base arrays are served by
:mod:`bevcompile.grid.checks.base`).

Pure: arrays and dataclasses in, :class:`~bevcompile.store.plugins.Check` /
:class:`~bevcompile.store.plugins.VerifyRow` / arrays out. Every figure is recomputed from the
arrays and the float64 projection of the stored config; attributes are only compared with the
recomputation. The verify bounds are stated in :mod:`bevcompile.grid.checks._common`.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import numpy as np

from ...rig.config import RigConfig
from ...store.plugins import REBUILT_ATTRS, Check, CheckContext, VerifyRow, clamped_format_rows, same_recorded
from ..formats import (
    BASE_FORMAT,
    FORMAT_ARRAYS,
    FORMATS,
    INT16_MAX,
    INT16_MIN,
    NORM_Q16_INVALID,
    NORM_Q16_MAX,
    OPENCV_INTER_BITS,
    OPENCV_TAB,
    UQ12_HALF,
    UQ12_MAX,
    build_format,
    check_format_names,
    decode_format_px,
    encode_opencv_maps,
    format_invalid_in_band,
    norm_q16_scale,
    pixel_q_max_frac_bits,
    samples_zero,
)
from ..ipm import SamplingGrid, build_grid_products, compute_product_grid, feature_px_to_norm, grid_region
from ..reference import bilinear_sample_px, grid_sample
from ._common import (
    ATTR_RTOL,
    BOUND_SLACK,
    FEATURE_PEAK,
    _agrees,
    _align_corners,
    _Bad,
    _cells,
    _expect,
    _guard,
    _max_abs_err,
    _options,
    _recorded_float,
    _recorded_int,
    _row,
    region_plugin,
    region_rebuild,
)

# --------------------------------------------------------------------------------------
# grid/ formats
# --------------------------------------------------------------------------------------


def _grid_formats(attrs: Mapping[str, Any]) -> tuple[str, ...]:
    """The extra formats ``build_options`` claims (canonical order)."""
    listed = _options(attrs, "grid").get("formats", [])
    if not isinstance(listed, list) or not all(isinstance(n, str) for n in listed):
        raise _Bad(f"grid/ build_options.formats must be a list of names, got {listed!r}")
    unknown = [n for n in listed if n not in FORMATS or n == BASE_FORMAT]
    if unknown:
        raise _Bad(f"grid/ build_options.formats lists unknown format {unknown[0]!r}")
    return check_format_names(listed)


def _pixel_q_bits(attrs: Mapping[str, Any], rig: RigConfig) -> int:
    bits = _recorded_int(_options(attrs, "grid"), "pixel_q_frac_bits", "grid/ build_options")
    f_max = pixel_q_max_frac_bits(rig.feature_size)
    if not 0 <= bits <= f_max:
        raise _Bad(f"grid/ build_options.pixel_q_frac_bits {bits} cannot hold the feature-map range (allowed 0..{f_max})")
    return bits


def _format_arrays(name: str, arrays: Mapping[str, np.ndarray], rig: RigConfig) -> dict[str, np.ndarray]:
    cells = _cells(rig)
    dtypes = {"uq12": "uint16", "opencv_map1": "int16", "opencv_map2": "uint16", "pixel_q": "int16", "norm_q16": "int16"}
    out = {}
    for array_name in FORMAT_ARRAYS[name]:
        shape = cells if array_name == "opencv_map2" else (*cells, 2)
        out[array_name] = _expect(arrays, "grid", array_name, shape, (dtypes[array_name],))
    return out


def _format_saturation(name: str, truth: SamplingGrid, align_corners: bool, bits: int | None) -> np.ndarray:
    """Valid cells whose true value lies outside the format's representable range."""
    coords = truth.coords_feature_px
    norm = feature_px_to_norm(coords, truth.feature_size, align_corners)
    if name == "uq12":
        pre = norm * UQ12_HALF + UQ12_HALF
        out = (pre < -0.5) | (pre > UQ12_MAX + 0.5)
    elif name == "norm_q16":
        pre = norm / np.asarray(norm_q16_scale(truth.feature_size, align_corners))
        out = (pre < -NORM_Q16_MAX - 0.5) | (pre > NORM_Q16_MAX + 0.5)
    elif name == "pixel_q":
        pre = coords * 2.0 ** (bits or 0)
        out = (pre < INT16_MIN - 0.5) | (pre > INT16_MAX + 0.5)
    else:
        out = np.abs(coords * OPENCV_TAB) >= 2**31
    return out.any(axis=-1) & truth.valid


def _quantisation_bound(name: str, feature_size: tuple[int, int], align_corners: bool, bits: int | None) -> np.ndarray:
    """Half a quantisation step in feature px PER AXIS ``(u, v)`` (the steps of uq12 and norm_q16
    differ between the axes: they scale with the axis size), plus float32 input rounding for
    opencv (encoded from the float32 coords)."""
    size = np.array(feature_size, dtype=np.float64)  # (W_f, H_f)
    px_per_norm = (size - 1.0) / 2.0 if align_corners else size / 2.0
    if name == "uq12":
        return 0.5 * px_per_norm / UQ12_HALF
    if name == "norm_q16":
        return 0.5 * px_per_norm * np.asarray(norm_q16_scale(feature_size, align_corners), dtype=np.float64)
    if name == "pixel_q":
        return np.full(2, 0.5 * 2.0 ** -(bits or 0))
    return 0.5 / OPENCV_TAB + 2.0**-24 * size


def _max_abs_err_axes(decoded: np.ndarray, truth: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """Max ``|decoded - truth|`` per axis over ``valid`` cells (NaN counts as inf)."""
    err = np.abs(np.asarray(decoded, dtype=np.float64) - truth)[valid]
    if err.size == 0:
        return np.zeros(2)
    return np.max(np.where(np.isnan(err), np.inf, err), axis=0)


@region_plugin("grid")
def check_grid(ctx: CheckContext, arrays: Mapping[str, np.ndarray], attrs: Mapping[str, Any]) -> list[Check]:
    """Checks of the fixed-point FORMAT arrays of ``grid/`` (not the four base arrays)."""
    checks: list[Check] = []
    state: dict[str, Any] = {}

    def listing() -> list[Check]:
        formats = _grid_formats(attrs)
        state["formats"] = formats
        state["align_corners"] = _align_corners(attrs)
        listed = attrs.get("formats", [BASE_FORMAT])
        ok = listed == [BASE_FORMAT, *formats]
        unclaimed = sorted(
            a for n in FORMATS if n != BASE_FORMAT and n not in formats for a in FORMAT_ARRAYS[n] if a in arrays
        )
        result = [Check("formats_listed", "grid/", ok, f"attrs formats {listed!r}; build_options implies {[BASE_FORMAT, *formats]!r}")]
        if unclaimed:
            result.append(Check("unclaimed_format_arrays", "grid/", False, f"arrays {unclaimed} belong to formats build_options does not list"))
        return result

    _guard(checks, "formats_listed", "grid/", listing)
    if "formats" not in state or not state["formats"]:
        return checks
    truth = ctx.sampling_grid()
    for name in state["formats"]:
        run = functools.partial(_check_format, name, ctx, arrays, attrs, truth, state["align_corners"])
        _guard(checks, f"{name}_contract", f"grid/{FORMAT_ARRAYS[name][0]}", run)
    return checks


def _check_format(
    name: str, ctx: CheckContext, arrays: Mapping[str, np.ndarray], attrs: Mapping[str, Any], truth: SamplingGrid, align_corners: bool
) -> list[Check]:
    rig = ctx.rig
    key = f"grid/{FORMAT_ARRAYS[name][0]}"
    data = _format_arrays(name, arrays, rig)
    meta = attrs.get(name)
    if not isinstance(meta, Mapping):
        raise _Bad(f"grid/ attrs {name} missing (scale, decode formula, max_error_px)")
    bits = _pixel_q_bits(attrs, rig) if name == "pixel_q" else None
    checks = [Check("shape_dtype", key, True, f"{name}: {', '.join(f'{k} {list(v.shape)} {v.dtype}' for k, v in data.items())}")]
    feature_size = rig.feature_size
    decoded = decode_format_px(name, data, feature_size, align_corners, frac_bits=bits)
    valid = truth.valid
    measured = _max_abs_err(decoded, truth.coords_feature_px, valid)
    recorded = _recorded_float(meta, "max_error_px", f"grid/ {name}")
    checks.append(
        Check(
            "decodes_within_recorded_error",
            key,
            measured <= recorded * (1 + ATTR_RTOL) + 1e-12 and _agrees(recorded, measured),
            f"max |decode - coords| on valid cells {measured:.6g} px (recomputed from the float64 projection) vs recorded {recorded:.6g} px",
        )
    )
    saturated = _format_saturation(name, truth, align_corners, bits)
    n_sat = int(np.count_nonzero(saturated))
    recorded_sat = meta.get("saturated_valid_cells")
    inherent = name == "uq12" and align_corners
    bound = _quantisation_bound(name, feature_size, align_corners, bits)
    within = _max_abs_err_axes(decoded, truth.coords_feature_px, valid & ~saturated)
    checks.append(
        Check(
            "no_saturation",
            key,
            recorded_sat == n_sat and (n_sat == 0 or inherent) and bool(np.all(within <= bound * (1 + ATTR_RTOL))),
            f"{n_sat} valid cell(s) outside the representable range (recorded {recorded_sat!r})"
            + ("; inherent to uq12 with align_corners=True (u < 0 clamps to the first pixel centre)" if inherent and n_sat else "")
            + f"; unsaturated cells within half a quantisation step per axis: (u, v) {within[0]:.4g}, {within[1]:.4g}"
            f" <= {bound[0]:.4g}, {bound[1]:.4g} px",
        )
    )
    if format_invalid_in_band(name):
        invalid = ~truth.valid
        zero = samples_zero(decoded, feature_size)
        bad = int(np.count_nonzero(invalid & ~zero))
        checks.append(
            Check(
                "invalid_in_band_samples_zero",
                key,
                bad == 0 and meta.get("invalid_in_band") is True,
                f"{bad} of {int(invalid.sum())} invalid cell(s) decode where bilinear sampling with zeros padding is not exactly 0",
            )
        )
    else:
        checks.append(Check("invalid_not_in_band", key, meta.get("invalid_in_band") is False, f"attrs invalid_in_band={meta.get('invalid_in_band')!r}: consumers must mask with grid/valid"))
    checks.append(_check_invalid_encoding(name, key, data, ~valid, bits))
    checks.append(_check_dequantisation_attrs(name, key, meta, feature_size, align_corners, bits))
    if name == "norm_q16":
        q = data["norm_q16"]
        sentinel_on_valid = int(np.count_nonzero((q == NORM_Q16_INVALID).any(axis=-1) & valid))
        scale = norm_q16_scale(feature_size, align_corners)
        rec_scale = meta.get("scale")
        scale_ok = isinstance(rec_scale, list) and len(rec_scale) == 2 and all(_agrees(float(a), b) for a, b in zip(rec_scale, scale, strict=True))
        checks.append(
            Check(
                "sentinel_and_scale",
                key,
                sentinel_on_valid == 0 and bool(np.all(q[~valid] == NORM_Q16_INVALID)) and scale_ok,
                f"{sentinel_on_valid} valid cell(s) use the invalid code -32768; recorded scale {rec_scale!r}, recomputed {list(scale)}",
            )
        )
    if name == "pixel_q":
        checks.append(Check("frac_bits", key, meta.get("frac_bits") == bits, f"attrs frac_bits {meta.get('frac_bits')!r}, build_options {bits}"))
    if name == "opencv" and "coords" in ctx.grid_arrays:
        coords32 = np.asarray(ctx.grid_arrays["coords"], dtype=np.float32)
        if coords32.shape == (*_cells(rig), 2):
            map1, map2 = encode_opencv_maps(coords32[..., 0], coords32[..., 1])
            same = bool(np.array_equal(map1, data["opencv_map1"]) and np.array_equal(map2, data["opencv_map2"]))
            checks.append(Check("matches_convertmaps_of_coords", key, same, "opencv maps equal cv2.convertMaps(grid/coords, CV_16SC2) (numpy port)" if same else "opencv maps differ from cv2.convertMaps of grid/coords"))
    return checks


def dequantisation_attrs(name: str, feature_size: tuple[int, int], align_corners: bool, bits: int | None) -> dict[str, Any]:
    """The numeric attributes a consumer dequantises ``name`` with (``value = q * scale +
    offset``, per axis for norm_q16), as the build writes them."""
    if name == "uq12":
        return {"scale": 1.0 / UQ12_HALF, "offset": -1.0}
    if name == "opencv":
        return {"scale": 1.0 / OPENCV_TAB, "offset": 0.0, "inter_bits": OPENCV_INTER_BITS}
    if name == "pixel_q":
        return {"scale": 2.0 ** -(bits or 0), "offset": 0.0, "frac_bits": bits}
    scale = norm_q16_scale(feature_size, align_corners)
    return {"scale": [scale[0], scale[1]], "offset": 0.0, "invalid_code": NORM_Q16_INVALID}


def _check_dequantisation_attrs(name: str, key: str, meta: Mapping[str, Any], feature_size: tuple[int, int], align_corners: bool, bits: int | None) -> Check:
    want = dequantisation_attrs(name, feature_size, align_corners, bits)
    bad = [f"{name}.{k} {meta.get(k)!r}, recomputed {v!r}" for k, v in want.items() if not same_recorded(meta.get(k), v)]
    return Check(
        "dequantisation_attrs",
        key,
        not bad,
        "; ".join(bad) if bad else f"{', '.join(f'{name}.{k}' for k in want)} equal the recomputation",
    )


def _check_invalid_encoding(name: str, key: str, data: Mapping[str, np.ndarray], invalid: np.ndarray, bits: int | None) -> Check:
    """Invalid cells hold exactly the documented code (``grid.attrs[name].invalid_note``):
    uq12 ``(0, 0)`` (norm -1); opencv ``map1 = (-2, -2)``, ``map2 = 0`` and pixel_q
    ``(-2 * 2**f, -2 * 2**f)`` (both decode to ``(-2, -2)`` px); norm_q16 ``(-32768, -32768)``
    (checked by ``sentinel_and_scale``). A consumer that forgets the mask reads these."""
    n_invalid = int(np.count_nonzero(invalid))
    if name == "uq12":
        bad = np.any(data["uq12"][invalid] != 0, axis=-1)
        code = "(0, 0)"
    elif name == "opencv":
        bad = np.any(data["opencv_map1"][invalid] != -2, axis=-1) | (data["opencv_map2"][invalid] != 0)
        code = "map1 (-2, -2), map2 0"
    elif name == "pixel_q":
        sentinel = -2 * (1 << (bits or 0))
        bad = np.any(data["pixel_q"][invalid] != sentinel, axis=-1)
        code = f"({sentinel}, {sentinel}) = (-2, -2) px"
    else:
        bad = np.any(data["norm_q16"][invalid] != NORM_Q16_INVALID, axis=-1)
        code = f"({NORM_Q16_INVALID}, {NORM_Q16_INVALID})"
    n_bad = int(np.count_nonzero(bad))
    return Check("invalid_encoding", key, n_bad == 0, f"{n_bad} of {n_invalid} invalid cell(s) differ from the documented code {code}")


@region_plugin("grid")
def verify_grid(ctx: CheckContext, arrays: Mapping[str, np.ndarray], attrs: Mapping[str, Any]) -> list[VerifyRow]:
    """Every extra format against bilinear sampling at the float64 projection, per camera.

    Normalised formats (uq12, norm_q16) are sampled with the numpy ``grid_sample`` at the
    store's align_corners; pixel formats (pixel_q, opencv) with bilinear sampling at their
    decoded pixels. Formats whose invalid cells are not in-band are masked with ``grid/valid``.
    """
    if ctx.features is None:
        raise ValueError("verify_grid needs ctx.features")
    formats = _grid_formats(attrs)
    if not formats:
        return []
    rig = ctx.rig
    align_corners = _align_corners(attrs)
    truth = ctx.sampling_grid()
    features = ctx.features
    n_h, ny, nx = truth.valid.shape[1:]
    rows: list[VerifyRow] = []
    refs = [np.where(truth.valid[c][None], bilinear_sample_px(features[c], truth.coords_feature_px[c]), 0.0) for c in range(rig.n_cam)]
    stored_valid = np.asarray(ctx.grid_arrays["valid"]) if "valid" in ctx.grid_arrays else None
    mask = stored_valid if stored_valid is not None and stored_valid.shape == truth.valid.shape else truth.valid
    for name in formats:
        product = f"grid/{name}"
        try:
            data = _format_arrays(name, arrays, rig)
            bits = _pixel_q_bits(attrs, rig) if name == "pixel_q" else None
            recorded = _recorded_float(attrs.get(name), "max_error_px", f"grid/ {name}")
        except _Bad as exc:
            rows.append(VerifyRow(product, "all", float("inf"), float("inf"), 0.0, "contract", False, str(exc)))
            continue
        threshold = 2.0 * recorded * FEATURE_PEAK + BOUND_SLACK
        decoded = decode_format_px(name, data, rig.feature_size, align_corners, frac_bits=bits)
        in_band = format_invalid_in_band(name)
        for cam_index, camera in enumerate(rig.cameras):
            feats = features[cam_index]
            if name in ("uq12", "norm_q16"):
                grid = feature_px_to_norm(decoded[cam_index], rig.feature_size, align_corners).reshape(1, n_h * ny, nx, 2)
                got = grid_sample(feats[None], grid, align_corners=align_corners)[0].reshape(-1, n_h, ny, nx)
            else:
                got = bilinear_sample_px(feats, decoded[cam_index])
            if not in_band:
                got = np.where(mask[cam_index][None], got, 0.0)
            if name == "uq12" and align_corners:  # valid cells may saturate: judge them apart
                half = _quantisation_bound(name, rig.feature_size, align_corners, bits)
                rows.extend(
                    clamped_format_rows(
                        product, camera.name, got, refs[cam_index], truth.coords_feature_px[cam_index], truth.valid[cam_index],
                        rig.feature_size, half, BOUND_SLACK, FEATURE_PEAK, "masked with grid/valid",
                    )
                )
                continue
            note = f"bound 2 x max_error_px {recorded:.3g} px" + ("" if in_band else "; masked with grid/valid")
            rows.append(_row(product, camera.name, got, refs[cam_index], threshold, note))
    return rows


@region_rebuild
def rebuild_grid(rig: RigConfig, attrs: Mapping[str, Any]) -> dict[str, Any]:
    """Recompute the FORMAT arrays of ``grid/`` from ``build_options`` (formats,
    pixel_q_frac_bits, align_corners); the base arrays are rebuilt by checks_grid."""
    from ..build import grid_group

    formats = _grid_formats(attrs)
    if not formats:
        return {}
    align_corners = _align_corners(attrs)
    bits = _pixel_q_bits(attrs, rig) if "pixel_q" in formats else None
    sampling = compute_product_grid(rig)
    out: dict[str, Any] = {}
    products = [build_format(name, sampling, align_corners, pixel_q_frac_bits=bits) for name in formats]
    for product in products:
        out.update(product.arrays)
    # the whole grid/ attribute set as the writer composes it (checks_grid returns the same base keys)
    out[REBUILT_ATTRS] = grid_group(build_grid_products(sampling, align_corners), rig, products, bits, grid_region(rig.bev)).attrs
    return out


