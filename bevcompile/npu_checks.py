"""Plug-in of ``inspect`` / ``verify`` / ``inspect --strict`` for the NPU grid products.

Implements the :mod:`bevcompile.checks_api` contract for

* the fixed-point FORMAT arrays of ``grid/`` (``uq12``, ``opencv_map1/2``, ``pixel_q``,
  ``norm_q16``; the four base arrays are served by :mod:`bevcompile.checks_grid`),
* ``gather/`` (static gather tables) and ``delta/`` (block-wise delta-LUT).

Pure: arrays and dataclasses in, :class:`Check` / :class:`VerifyRow` / arrays out. Every figure
is recomputed from the arrays and the float64 projection of the stored config; attributes are
only compared with the recomputation. Garbage input gives failed checks, not exceptions.

verify bounds (features uniform in ``[0, 1)``, so the feature range ``peak`` is 1): bilinear
sampling with zeros padding is Lipschitz with constant ``peak`` per pixel along each axis (its
partial derivative is a convex combination of differences of neighbouring values, zeros
included, each at most ``peak`` in magnitude). A coordinate error of at most ``e`` px per axis
therefore changes a sample by at most ``2 e peak``; formats and delta are checked against
``2 e peak + 1e-6`` with ``e`` their recorded max error (itself re-measured by the checks).
Gather tables are checked against ``1e-5`` (float32 weights: measured ~5e-8); the LUT weights
against their recorded worst-case sample error ``+ 1e-6``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from .checks_api import REBUILT_ATTRS, Check, CheckContext, VerifyRow, clamped_format_rows, compare, same_recorded
from .config import RigConfig
from .delta import (
    LUT_ARRAYS,
    N_TERMS,
    DeltaLUT,
    check_block,
    check_max_error,
    decode_delta,
    delta_basis,
    encode_delta,
    escape_frac_bits,
)
from .formats import (
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
    off_map_margin,
    pixel_q_max_frac_bits,
    samples_zero,
)
from .gather import (
    band_switches,
    bilinear_corners,
    build_gather_tables,
    camera_base_offsets,
    check_align,
    check_lut_frac_bits,
    check_order,
    gather_sample,
    layout_name,
    layout_tables,
    lut_table,
    lut_weights,
    mean_index_jump,
    worst_case_sample_error,
)
from .grid import SamplingGrid, build_grid_products, compute_sampling_grid, feature_px_to_norm
from .reference import bilinear_sample_px, grid_sample

FEATURE_PEAK = 1.0
GATHER_THRESHOLD = 1e-5
BOUND_SLACK = 1e-6
ATTR_RTOL = 1e-9


class _Bad(ValueError):
    """A contract violation found while preparing a check (becomes a failed Check)."""


def _guard(checks: list[Check], name: str, array: str, fn: Callable[[], list[Check]]) -> None:
    """Run ``fn``; a contract violation or any exception becomes ONE failed check."""
    try:
        checks.extend(fn())
    except _Bad as exc:
        checks.append(Check(name, array, False, str(exc)))
    except Exception as exc:  # garbage input must not escape as a traceback
        text = " ".join(str(exc).split())
        checks.append(Check(name, array, False, f"could not be checked: {exc.__class__.__name__}: {text}"))


def _options(attrs: Mapping[str, Any], group: str) -> Mapping[str, Any]:
    options = attrs.get("build_options")
    if not isinstance(options, Mapping):
        raise _Bad(f"{group}/ attrs build_options missing or not a mapping")
    return options


def _align_corners(attrs: Mapping[str, Any]) -> bool:
    value = _options(attrs, "grid").get("align_corners")
    if not isinstance(value, bool):
        raise _Bad("grid/ attrs build_options.align_corners missing or not a boolean")
    return value


def _recorded_float(meta: Any, key: str, where: str) -> float:
    value = meta.get(key) if isinstance(meta, Mapping) else None
    if isinstance(value, bool) or not isinstance(value, int | float) or not np.isfinite(value):
        raise _Bad(f"{where} attribute {key} missing or not a finite number ({value!r})")
    return float(value)


def _recorded_int(meta: Any, key: str, where: str) -> int:
    value = meta.get(key) if isinstance(meta, Mapping) else None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _Bad(f"{where} attribute {key} missing or not an integer ({value!r})")
    return int(value)


def _expect(arrays: Mapping[str, np.ndarray], group: str, name: str, shape: tuple[int, ...] | None, dtypes: tuple[str, ...]) -> np.ndarray:
    """The array, or :class:`_Bad` if missing or of the wrong shape/dtype."""
    if name not in arrays:
        raise _Bad(f"{group}/{name} is missing or unreadable")
    array = np.asarray(arrays[name])
    if str(array.dtype) not in dtypes:
        raise _Bad(f"{group}/{name} has dtype {array.dtype}, expected {' or '.join(dtypes)}")
    if shape is not None and tuple(array.shape) != shape:
        raise _Bad(f"{group}/{name} has shape {list(array.shape)}, expected {list(shape)}")
    return array


def _cells(rig: RigConfig) -> tuple[int, int, int, int]:
    return (rig.n_cam, len(rig.bev.heights), rig.bev.ny, rig.bev.nx)


def _max_abs_err(decoded: np.ndarray, truth: np.ndarray, valid: np.ndarray) -> float:
    err = np.abs(np.asarray(decoded, dtype=np.float64) - truth)[valid]
    if err.size == 0:
        return 0.0
    return float(np.max(np.where(np.isnan(err), np.inf, err)))


def _agrees(recorded: float, measured: float) -> bool:
    return abs(recorded - measured) <= ATTR_RTOL * max(1.0, abs(measured))


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


def rebuild_grid(rig: RigConfig, attrs: Mapping[str, Any]) -> dict[str, Any]:
    """Recompute the FORMAT arrays of ``grid/`` from ``build_options`` (formats,
    pixel_q_frac_bits, align_corners); the base arrays are rebuilt by checks_grid."""
    from .build import grid_group

    formats = _grid_formats(attrs)
    if not formats:
        return {}
    align_corners = _align_corners(attrs)
    bits = _pixel_q_bits(attrs, rig) if "pixel_q" in formats else None
    sampling = compute_sampling_grid(rig)
    out: dict[str, Any] = {}
    products = [build_format(name, sampling, align_corners, pixel_q_frac_bits=bits) for name in formats]
    for product in products:
        out.update(product.arrays)
    # the whole grid/ attribute set as the writer composes it (checks_grid returns the same base keys)
    out[REBUILT_ATTRS] = grid_group(build_grid_products(sampling, align_corners), rig, products, bits).attrs
    return out


# --------------------------------------------------------------------------------------
# gather/
# --------------------------------------------------------------------------------------


def _gather_options(attrs: Mapping[str, Any]) -> tuple[int, int, str]:
    options = _options(attrs, "gather")
    try:
        frac_bits = check_lut_frac_bits(options.get("frac_bits"))  # type: ignore[arg-type]
        align = check_align(options.get("align"))  # type: ignore[arg-type]
        order = check_order(options.get("order"))  # type: ignore[arg-type]
    except ValueError as exc:
        raise _Bad(f"gather/ build_options invalid: {exc}") from None
    return frac_bits, align, order


def _gather_rows(rig: RigConfig, arrays: Mapping[str, np.ndarray], attrs: Mapping[str, Any]) -> dict[str, Any]:
    """Contract of the stored tables; returns them in logical (row-major cell) order."""
    frac_bits, align, order = _gather_options(attrs)
    cells = _cells(rig)
    n_cells = int(np.prod(cells))
    layout = layout_name(align, order)
    if attrs.get("layout") != layout:
        raise _Bad(f"gather/ attrs layout {attrs.get('layout')!r}, build_options imply {layout!r}")
    n_pad = -(-n_cells // align) * align
    if attrs.get("n_cells") != n_cells or attrs.get("n_cells_padded") != (n_cells if layout == "bev" else n_pad):
        raise _Bad(f"gather/ attrs n_cells {attrs.get('n_cells')!r} / n_cells_padded {attrs.get('n_cells_padded')!r}, config implies {n_cells} / {n_pad}")
    if attrs.get("logical_shape") != list(cells):
        raise _Bad(f"gather/ attrs logical_shape {attrs.get('logical_shape')!r}, config implies {list(cells)}")
    shape = (*cells, 4) if layout == "bev" else (n_pad, 4)
    index = _expect(arrays, "gather", "index", shape, ("int32",)).reshape(-1, 4)
    weight = _expect(arrays, "gather", "weight", shape, ("float32",)).reshape(-1, 4)
    codes = _expect(arrays, "gather", "weight_u8", shape, ("uint8",)).reshape(-1, 4)
    lut = _expect(arrays, "gather", "lut", (1 << frac_bits,), ("float32",))
    lut_value = attrs.get("lut")
    lut_attrs: Mapping[str, Any] = lut_value if isinstance(lut_value, Mapping) else {}
    for key, got, want in (("align", attrs.get("align"), align), ("order", attrs.get("order"), order), ("lut.frac_bits", lut_attrs.get("frac_bits"), frac_bits)):
        if got != want:
            raise _Bad(f"gather/ attrs {key} {got!r}, build_options say {want!r}")
    wanted = {"index", "weight", "weight_u8", "lut"} | ({"cell_valid"} if layout != "bev" else set()) | ({"perm", "perm_inverse"} if order != "row" else set())
    extra = sorted(set(arrays) - wanted)
    if extra:
        raise _Bad(f"arrays not produced by these build_options: {', '.join(extra)}")
    out: dict[str, Any] = {"layout": layout, "n_cells": n_cells, "n_pad": n_pad, "frac_bits": frac_bits, "lut": lut, "stored_index": index}
    rows = np.arange(n_cells)
    if layout != "bev":
        cell_valid = _expect(arrays, "gather", "cell_valid", (n_pad,), ("bool",))
        out["cell_valid"] = cell_valid
        out["padding"] = (index[n_cells:], weight[n_cells:], codes[n_cells:], cell_valid[n_cells:])
    if order != "row":
        perm = _expect(arrays, "gather", "perm", (n_pad,), ("int32",)).astype(np.int64)
        inverse = _expect(arrays, "gather", "perm_inverse", (n_cells,), ("int32",)).astype(np.int64)
        head = perm[:n_cells]
        if head.size and (head.min() < 0 or head.max() >= n_cells or np.unique(head).size != n_cells):
            raise _Bad("gather/perm: the first n_cells entries are not a permutation of the cells")
        if inverse.size and (inverse.min() < 0 or inverse.max() >= n_pad or not np.array_equal(head[inverse], np.arange(n_cells))):
            raise _Bad("gather/perm_inverse is not the inverse of gather/perm")
        if np.any(perm[n_cells:] != 0):
            raise _Bad("gather/perm: padding entries are not 0")
        rows = inverse
    out["index"] = index[rows]
    out["weight"] = weight[rows]
    out["codes"] = codes[rows]
    if layout != "bev":
        out["cell_valid_logical"] = out["cell_valid"][rows]
    return out


def check_gather(ctx: CheckContext, arrays: Mapping[str, np.ndarray], attrs: Mapping[str, Any]) -> list[Check]:
    """Contract, index range, padding/invalid zeros, in-map mass, exact corners, LUT error."""
    checks: list[Check] = []
    state: dict[str, Any] = {}

    def contract() -> list[Check]:
        state.update(_gather_rows(ctx.rig, arrays, attrs))
        return [Check("contract", "gather/", True, f"layout {state['layout']}, {state['n_cells']} cells, {len(state['index'])} logical rows; shapes and dtypes as the config and build_options imply")]

    _guard(checks, "contract", "gather/", contract)
    if "index" not in state:
        return checks
    _guard(checks, "tables", "gather/index", lambda: _check_gather_tables(ctx, attrs, state))
    _guard(checks, "order_figures", "gather/", lambda: _check_order_figures(ctx, attrs, state))
    return checks


def _check_order_figures(ctx: CheckContext, attrs: Mapping[str, Any], state: Mapping[str, Any]) -> list[Check]:
    """The recorded locality figures (mean index jump, 8-row band switches) recomputed from the
    tables, in row order and in the stored (gather) order."""
    valid = ctx.grid_arrays.get("valid")
    valid_rows = (np.asarray(valid, dtype=bool) if valid is not None else ctx.sampling_grid().valid).reshape(-1)
    index_row = np.asarray(state["index"], dtype=np.int64)
    if "cell_valid" in state:
        index_gather, valid_gather = np.asarray(state["stored_index"], dtype=np.int64), np.asarray(state["cell_valid"], dtype=bool)
    else:
        index_gather, valid_gather = index_row, valid_rows
    feature_size = ctx.rig.feature_size
    want = {
        "mean_index_jump_row_order": mean_index_jump(index_row, valid_rows),
        "mean_index_jump_gather_order": mean_index_jump(index_gather, valid_gather),
        "band_switches_row_order": band_switches(index_row, valid_rows, feature_size),
        "band_switches_gather_order": band_switches(index_gather, valid_gather, feature_size),
    }
    bad = [f"{k} {attrs.get(k)!r} vs recomputed {v!r}" for k, v in want.items() if not same_recorded(attrs.get(k), v)]
    return [Check("order_figures", "gather/", not bad, "; ".join(bad) if bad else "mean index jump and band switches (row and gather order) equal the recomputation")]


def _check_gather_tables(ctx: CheckContext, attrs: Mapping[str, Any], state: Mapping[str, Any]) -> list[Check]:
    rig = ctx.rig
    w_f, h_f = rig.feature_size
    n_cam = rig.n_cam
    stacked = n_cam * h_f * w_f
    checks: list[Check] = []
    index = state["index"].astype(np.int64)
    weight = state["weight"].astype(np.float64)
    codes = state["codes"]
    in_range = bool(np.all((index >= 0) & (index < stacked)))
    checks.append(Check("index_in_range", "gather/index", in_range, f"indices in [{int(index.min()) if index.size else 0}, {int(index.max()) if index.size else 0}], stacked features hold {stacked}"))
    finite = bool(np.all(np.isfinite(weight)) and np.all((weight >= 0) & (weight <= 1)))
    checks.append(Check("weight_finite_unit", "gather/weight", finite, "every weight finite and in [0, 1]" if finite else "non-finite or out-of-[0, 1] weights"))

    truth = ctx.sampling_grid()
    valid = truth.valid.reshape(-1)
    pixel_index, weight64, _, _ = bilinear_corners(truth.coords_feature_px, truth.valid, truth.feature_size)
    base = camera_base_offsets(n_cam, truth.feature_size).reshape(n_cam, 1, 1, 1, 1)
    want_index = (pixel_index + base).reshape(-1, 4)
    weight64 = weight64.reshape(-1, 4)
    cam_base = np.repeat(camera_base_offsets(n_cam, truth.feature_size), valid.size // max(n_cam, 1))

    inv_w = float(np.abs(weight[~valid]).max()) if (~valid).any() else 0.0
    inv_i = bool(np.all(index[~valid] == cam_base[~valid][:, None]))
    checks.append(Check("invalid_cells_zero", "gather/weight", inv_w == 0.0 and inv_i, f"invalid cells: max |weight| {inv_w:.3g}, index = camera base: {inv_i}"))
    if "padding" in state:
        p_index, p_weight, p_codes, p_valid = state["padding"]
        ok = bool(np.all(p_index == 0) and np.all(p_weight == 0) and np.all(p_codes == 0) and not np.any(p_valid))
        checks.append(Check("padding_rows_zero", "gather/", ok, f"{len(p_index)} padding row(s): index 0, weight 0, codes 0, cell_valid False: {ok}"))
        grid_valid = np.asarray(ctx.grid_arrays["valid"]).reshape(-1) if "valid" in ctx.grid_arrays and np.asarray(ctx.grid_arrays["valid"]).size == valid.size else valid
        same = bool(np.array_equal(state["cell_valid_logical"], grid_valid))
        checks.append(Check("cell_valid_matches_grid", "gather/cell_valid", same, "cell_valid equals grid/valid in gather order" if same else "cell_valid differs from grid/valid"))
    mass_got = weight[valid].sum(axis=-1)
    mass_want = weight64[valid].sum(axis=-1)
    mass_err = float(np.abs(mass_got - mass_want).max()) if mass_got.size else 0.0
    checks.append(Check("valid_mass_is_in_map_mass", "gather/weight", mass_err <= 1e-6, f"max |sum(weight) - in-map bilinear mass| over valid cells {mass_err:.3g} (<= 1e-6)"))
    corners_ok = bool(np.array_equal(index[valid], want_index[valid]))
    w_err = float(np.abs(weight - weight64).max()) if weight.size else 0.0
    checks.append(
        Check(
            "corners_match_projection",
            "gather/index",
            corners_ok and w_err <= 2.0**-24,
            f"corner indices equal floor() of the float64 projection: {corners_ok}; max |weight - float64 weight| {w_err:.3g} (<= 2^-24)",
        )
    )
    rec_w32 = attrs.get("weight_float32_max_error")
    checks.append(Check("weight_error_attr", "gather/weight", isinstance(rec_w32, int | float) and _agrees(float(rec_w32), w_err), f"recorded weight_float32_max_error {rec_w32!r}, recomputed {w_err:.6g}"))

    lut = np.asarray(state["lut"])
    levels = 1 << state["frac_bits"]
    lut_ok = bool(np.array_equal(lut, lut_table(state["frac_bits"])))
    codes_ok = bool(np.all(codes.astype(np.int64) < levels))
    checks.append(Check("lut_table", "gather/lut", lut_ok and codes_ok, f"lut == c / {levels - 1} (float32): {lut_ok}; codes < {levels}: {codes_ok}"))
    if lut_ok and codes_ok:
        lut_w = lut_weights(codes, lut)
        lw_err = float(np.abs(lut_w - weight64).max()) if lut_w.size else 0.0
        ls_err = worst_case_sample_error(lut_w, weight64)
        rec_lw = attrs.get("lut_max_weight_error")
        rec_ls = attrs.get("lut_max_sample_error_unit_features")
        step = 1.0 / (levels - 1)
        ok = (
            isinstance(rec_lw, int | float)
            and isinstance(rec_ls, int | float)
            and _agrees(float(rec_lw), lw_err)
            and _agrees(float(rec_ls), ls_err)
            and lw_err <= step + 1e-7
            and float(np.abs(lut_w[~valid]).max() if (~valid).any() else 0.0) == 0.0
        )
        checks.append(
            Check(
                "lut_reconstruction",
                "gather/weight_u8",
                ok,
                f"max |lut weight - float64 weight| {lw_err:.4g} (recorded {rec_lw!r}, bound 1/(L-1) = {step:.4g}); worst-case sample error {ls_err:.4g} (recorded {rec_ls!r}); invalid cells reconstruct to 0",
            )
        )
    return checks


def verify_gather(ctx: CheckContext, arrays: Mapping[str, np.ndarray], attrs: Mapping[str, Any]) -> list[VerifyRow]:
    """Gather tables (float weights and LUT weights) against bilinear sampling at the float64
    projection (0 on invalid cells), per camera."""
    if ctx.features is None:
        raise ValueError("verify_gather needs ctx.features")
    rig = ctx.rig
    try:
        state = _gather_rows(rig, arrays, attrs)
        lut_bound = float(attrs["lut_max_sample_error_unit_features"])
    except (_Bad, KeyError, TypeError, ValueError) as exc:
        return [VerifyRow("gather", "all", float("inf"), float("inf"), 0.0, "contract", False, str(exc))]
    truth = ctx.sampling_grid()
    cells = _cells(rig)
    features = ctx.features
    index = state["index"]
    got = gather_sample(features, index, state["weight"]).reshape(-1, *cells)
    got_lut = gather_sample(features, index, lut_weights(state["codes"], state["lut"])).reshape(-1, *cells)
    rows = []
    for cam_index, camera in enumerate(rig.cameras):
        ref = np.where(truth.valid[cam_index][None], bilinear_sample_px(features[cam_index], truth.coords_feature_px[cam_index]), 0.0)
        rows.append(_row("gather/index+weight", camera.name, got[:, cam_index], ref, GATHER_THRESHOLD, "one Gather on the camera-stacked features + weighted sum"))
        rows.append(
            _row("gather/weight_u8+lut", camera.name, got_lut[:, cam_index], ref, lut_bound * FEATURE_PEAK + BOUND_SLACK, f"LUT weights ({len(state['lut'])} levels/axis); bound = recorded worst-case sample error")
        )
    return rows


def rebuild_gather(rig: RigConfig, attrs: Mapping[str, Any]) -> dict[str, Any]:
    """Recompute ``gather/`` from ``build_options`` (frac_bits, align, order)."""
    frac_bits, align, order = _gather_options(attrs)
    sampling = compute_sampling_grid(rig)
    tables = build_gather_tables(sampling, frac_bits)
    layout = layout_tables(tables, sampling.coords_feature_px, align=align, order=order)
    from .build import gather_group

    group = gather_group(tables, layout, rig)
    return {**group.arrays, REBUILT_ATTRS: group.attrs}


# --------------------------------------------------------------------------------------
# delta/
# --------------------------------------------------------------------------------------


def _delta_options(attrs: Mapping[str, Any]) -> tuple[int, float]:
    options = _options(attrs, "delta")
    try:
        return check_block(options.get("block")), check_max_error(options.get("max_error_px"))  # type: ignore[arg-type]
    except ValueError as exc:
        raise _Bad(f"delta/ build_options invalid: {exc}") from None


def _delta_lut(rig: RigConfig, arrays: Mapping[str, np.ndarray], attrs: Mapping[str, Any]) -> tuple[DeltaLUT, float]:
    """The stored LUT after every structural check (shapes, dtypes, slots, slabs, basis)."""
    block, bound = _delta_options(attrs)
    cells = _cells(rig)
    n_cam, n_h, ny, nx = cells
    nby, nbx = -(-ny // block), -(-nx // block)
    ints = ("int16", "int32")
    block_slot = _expect(arrays, "delta", "block_slot", (n_cam, n_h, nby, nbx), ints)
    coef = _expect(arrays, "delta", "coef", None, ("int16",))
    if coef.ndim != 3 or coef.shape[1:] != (N_TERMS, 2) or coef.shape[0] < 1:
        raise _Bad(f"delta/coef has shape {list(coef.shape)}, expected [R, {N_TERMS}, 2] with R >= 1")
    n_rows = coef.shape[0]
    scale = _expect(arrays, "delta", "scale", (n_rows, 2), ("float16",))
    res8_slot = _expect(arrays, "delta", "res8_slot", (n_rows,), ints)
    res16_slot = _expect(arrays, "delta", "res16_slot", (n_rows,), ints)
    res8 = _expect(arrays, "delta", "res8", None, ("int8",))
    res16 = _expect(arrays, "delta", "res16", None, ("int16",))
    for name, slab in (("res8", res8), ("res16", res16)):
        if slab.ndim != 4 or slab.shape[1:] != (block, block, 2) or slab.shape[0] < 1:
            raise _Bad(f"delta/{name} has shape {list(slab.shape)}, expected [N, {block}, {block}, 2] with N >= 1")
        if np.any(slab[0] != 0):
            raise _Bad(f"delta/{name} slab 0 is not all zeros")
    basis = _expect(arrays, "delta", "basis", (N_TERMS, block, block), ("float32",))
    if not np.array_equal(basis, delta_basis(block)):
        raise _Bad("delta/basis differs from the documented basis [1, tx, ty, tx^2, tx ty, ty^2]")
    for name, slots, limit in (("block_slot", block_slot, n_rows), ("res8_slot", res8_slot, res8.shape[0]), ("res16_slot", res16_slot, res16.shape[0])):
        values = slots.astype(np.int64)
        if values.size and (values.min() < 0 or values.max() >= limit):
            raise _Bad(f"delta/{name} holds values outside [0, {limit})")
    s64 = scale.astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        mant, _ = np.frexp(s64)
    if not (np.all(np.isfinite(s64)) and np.all(s64 > 0) and np.all(mant == 0.5)):
        raise _Bad("delta/scale holds values that are not finite positive powers of two")
    f16 = escape_frac_bits(rig.feature_size)
    if attrs.get("escape_frac_bits") != f16:
        raise _Bad(f"delta/ attrs escape_frac_bits {attrs.get('escape_frac_bits')!r}, feature map implies {f16}")
    extra = sorted(set(arrays) - set(LUT_ARRAYS))
    if extra:
        raise _Bad(f"arrays not produced by these build_options: {', '.join(extra)}")
    lut = DeltaLUT(block_slot, coef, scale, res8_slot, res16_slot, res8, res16, basis, block, cells, f16)
    return lut, bound


def check_delta(ctx: CheckContext, arrays: Mapping[str, np.ndarray], attrs: Mapping[str, Any]) -> list[Check]:
    """Structure, decode error within the recorded and configured bounds, invalid cells off
    the map, and the recorded on-device size."""
    checks: list[Check] = []
    state: dict[str, Any] = {}

    def contract() -> list[Check]:
        lut, bound = _delta_lut(ctx.rig, arrays, attrs)
        state["lut"], state["bound"] = lut, bound
        return [Check("contract", "delta/", True, f"block {lut.block}, {lut.coef.shape[0]} rows, {lut.res8.shape[0]} int8 slab(s), {lut.res16.shape[0]} escape slab(s); slots in range, slab 0 zero, basis exact")]

    _guard(checks, "contract", "delta/", contract)
    if "lut" not in state:
        return checks
    _guard(checks, "decoder_attrs", "delta/", lambda: [_check_delta_decoder_attrs(ctx, attrs, state["lut"], state["bound"])])
    _guard(checks, "decode", "delta/", lambda: _check_delta_decode(ctx, attrs, state["lut"], state["bound"]))
    return checks


def _check_delta_decoder_attrs(ctx: CheckContext, attrs: Mapping[str, Any], lut: DeltaLUT, bound: float) -> Check:
    """The attributes a decoder written from ``decode`` reads (B, the block grid, F16, the
    shapes), recomputed from build_options and the stored config: a hand edit fails here, not
    only under ``--strict``."""
    w_f, h_f = ctx.rig.feature_size
    n_cam, n_h, ny, nx = _cells(ctx.rig)
    want = {
        "block": lut.block,
        "block_grid": [-(-ny // lut.block), -(-nx // lut.block)],
        "logical_shape": [n_cam, n_h, ny, nx],
        "feature_size": [w_f, h_f],
        "escape_frac_bits": escape_frac_bits((w_f, h_f)),
        "max_error_bound_px": bound,
        "invalid_in_band": True,
    }
    wrong = [f"{key} {attrs.get(key)!r} (recomputed {value!r})" for key, value in want.items() if not same_recorded(attrs.get(key), value)]
    return Check(
        "decoder_attrs",
        "delta/",
        not wrong,
        "; ".join(wrong) if wrong else f"block {lut.block}, block_grid, logical_shape, feature_size, escape_frac_bits, max_error_bound_px as recomputed",
    )


def _check_delta_decode(ctx: CheckContext, attrs: Mapping[str, Any], lut: DeltaLUT, bound: float) -> list[Check]:
    truth = ctx.sampling_grid()
    decoded = decode_delta(lut)
    measured = _max_abs_err(decoded, truth.coords_feature_px, truth.valid)
    recorded = _recorded_float(attrs, "max_error_px", "delta/")
    checks = [
        Check(
            "decodes_within_max_error",
            "delta/",
            measured <= bound and measured <= recorded * (1 + ATTR_RTOL) + 1e-12 and _agrees(recorded, measured),
            f"max |decode - coords| on valid cells {measured:.6g} px (recomputed) vs recorded {recorded:.6g} px and bound --max-error-px {bound:.6g}",
        )
    ]
    invalid = ~truth.valid
    bad = int(np.count_nonzero(invalid & ~off_map_margin(decoded, truth.feature_size)))
    checks.append(Check("invalid_decode_off_map", "delta/", bad == 0, f"{bad} of {int(invalid.sum())} invalid cell(s) decode inside the map or its 1.5 px margin"))
    nbytes = sum(int(getattr(lut, name).nbytes) for name in LUT_ARRAYS)
    rec_total = attrs.get("on_device_bytes_total")
    norm16 = int(np.prod(lut.logical_shape)) * 4
    rec_ratio = attrs.get("ratio_vs_norm_int16")
    ok = rec_total == nbytes and attrs.get("norm_int16_bytes") == norm16 and isinstance(rec_ratio, int | float) and _agrees(float(rec_ratio), nbytes / norm16)
    checks.append(Check("on_device_size", "delta/", ok, f"on-device bytes {nbytes} (recorded {rec_total!r}) = {nbytes / norm16:.4f} of norm_int16 {norm16} (recorded ratio {rec_ratio!r})"))
    return checks


def verify_delta(ctx: CheckContext, arrays: Mapping[str, np.ndarray], attrs: Mapping[str, Any]) -> list[VerifyRow]:
    """The decoded delta grid (no mask: invalid cells are in-band) against bilinear sampling at
    the float64 projection, per camera; bound ``2 x max_error_px``."""
    if ctx.features is None:
        raise ValueError("verify_delta needs ctx.features")
    rig = ctx.rig
    try:
        lut, _ = _delta_lut(rig, arrays, attrs)
        recorded = _recorded_float(attrs, "max_error_px", "delta/")
    except _Bad as exc:
        return [VerifyRow("delta", "all", float("inf"), float("inf"), 0.0, "contract", False, str(exc))]
    truth = ctx.sampling_grid()
    decoded = decode_delta(lut)
    rows = []
    for cam_index, camera in enumerate(rig.cameras):
        feats = ctx.features[cam_index]
        ref = np.where(truth.valid[cam_index][None], bilinear_sample_px(feats, truth.coords_feature_px[cam_index]), 0.0)
        got = bilinear_sample_px(feats, decoded[cam_index])
        rows.append(_row("delta", camera.name, got, ref, 2.0 * recorded * FEATURE_PEAK + BOUND_SLACK, f"decoded grid, invalid in-band; bound 2 x max_error_px {recorded:.3g} px"))
    return rows


def rebuild_delta(rig: RigConfig, attrs: Mapping[str, Any]) -> dict[str, Any]:
    """Recompute ``delta/`` from ``build_options`` (block, max_error_px)."""
    from .build import delta_group

    block, bound = _delta_options(attrs)
    sampling = compute_sampling_grid(rig)
    group = delta_group(encode_delta(sampling.coords_feature_px, sampling.valid, sampling.feature_size, block=block, max_error_px=bound), rig)
    return {**group.arrays, REBUILT_ATTRS: group.attrs}


# --------------------------------------------------------------------------------------


def _row(product: str, camera: str, got: npt.NDArray[np.floating], ref: npt.NDArray[np.floating], threshold: float, note: str) -> VerifyRow:
    max_abs, mean_abs, psnr = compare(product, camera, got, ref, FEATURE_PEAK)
    passed = bool(np.isfinite(threshold)) and max_abs <= threshold
    return VerifyRow(product, camera, max_abs, mean_abs, psnr, f"max_abs <= {threshold:.3g}", passed, note)


__all__ = [
    "check_delta",
    "check_gather",
    "check_grid",
    "rebuild_delta",
    "rebuild_gather",
    "rebuild_grid",
    "verify_delta",
    "verify_gather",
    "verify_grid",
]
