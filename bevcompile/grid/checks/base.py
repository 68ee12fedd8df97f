"""Plug-in of ``inspect`` / ``verify`` / ``inspect --strict`` for the four base ``grid/`` arrays.

Implements the :mod:`bevcompile.store.plugins` contract for ``coords``, ``valid``, ``norm`` and
``norm_int16`` (the fixed-point formats that also live in ``grid/`` are served by
``bevcompile.npu_checks``). Pure: arrays and dataclasses in, :class:`Check` /
:class:`VerifyRow` / arrays out; never reads the store, never prints.

Conventions checked (README "Conventions", ``bevcompile.conventions``):

* ``coords`` ``(n_cam, n_h, ny, nx, 2)`` float32 ``(u, v)`` feature pixels, integer = pixel
  centre; ``valid`` ``(n_cam, n_h, ny, nx)`` bool; ``norm`` float32 and ``norm_int16`` int16,
  ``(n_cam, n_h, ny, nx, 2)`` ``(x, y)`` in ``grid_sample`` normalised units.
* VALID RULE bounds ``-0.5 <= u < W_f - 0.5``, ``-0.5 <= v < H_f - 0.5`` on the float64
  projection. float32 rounding is monotonic and both bounds are exact in float32, so on the
  stored float32 coords the rule reads ``-0.5 <= u <= W_f - 0.5`` (upper bound inclusive).
* invalid cells: ``coords == (-2, -2)`` exactly; ``grid_sample`` of ``norm`` there is exactly 0.

Tolerances are derived, never guessed: a float32 value ``f32(x)`` differs from ``x`` by at most
half a float32 ulp, ``0.5 * spacing(f32(x))`` (taking the spacing of the *rounded* value is
conservative at binade boundaries).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from ...rig.config import RigConfig
from ...rig.geometry import project_bev_to_feature
from ...rig.region import RegionTable, expand_of_cells
from ...store.plugins import REBUILT_ATTRS, Check, CheckContext, VerifyRow, clamped_format_rows, compare, same_recorded
from ..build import group_dimension_names
from ..formats import FORMAT_ARRAYS
from ..ipm import (
    INVALID_PX,
    NORM_INT16_SCALE,
    bev_cell_centres,
    build_grid_products,
    compute_product_grid,
    coverage_fraction,
    decode_norm_int16,
    feature_px_to_norm,
    grid_region,
    inside_feature_map,
    norm_to_feature_px,
    product_lattice_shape,
    region_cell_centres,
)
from ..reference import bilinear_sample_px, grid_sample
from ._common import REGION_ARRAYS, region_plugin, region_rebuild

GROUP = "grid"
BASE_ARRAYS = ("coords", "valid", "norm", "norm_int16")
MAX_RECHECK_CELLS_PER_CAMERA = 1 << 18
"""``coords_match_config`` re-projects at most this many cells per camera (evenly spaced)."""
FLOAT_PATH_THRESHOLD = 1e-5
"""verify: nominal max abs error of the float32 grid forms (coords, norm) and of torch."""
FEATURE_PEAK = 1.0
"""verify: features are uniform in [0, 1), so the feature range (PSNR peak) is 1."""
COVERAGE_ATTR_DECIMALS = 6


def half_ulp32(values: npt.NDArray[np.floating]) -> npt.NDArray[np.float64]:
    """Half a float32 ulp of each (float32) value: the max rounding error of ``f32(x)``
    (0 for a non-finite value, so that it cannot widen a tolerance)."""
    values32 = np.asarray(values, dtype=np.float32)
    finite = np.isfinite(values32)
    spacing = np.spacing(np.abs(np.where(finite, values32, np.float32(0.0)))).astype(np.float64)
    return np.where(finite, 0.5 * spacing, 0.0)


def expected_shapes(rig: RigConfig) -> dict[str, tuple[tuple[int, ...], str]]:
    """Shape and dtype the config implies for each base array.

    Convention: ``coords``/``norm``/``norm_int16`` ``(n_cam, n_heights, ny, nx, 2)``;
    ``valid`` ``(n_cam, n_heights, ny, nx)``.
    """
    cells = (rig.n_cam, len(rig.bev.heights), *product_lattice_shape(rig.bev))  # a region's lattice (1, n_kept)
    return {
        "coords": ((*cells, 2), "float32"),
        "valid": (cells, "bool"),
        "norm": ((*cells, 2), "float32"),
        "norm_int16": ((*cells, 2), "int16"),
    }


def _align_corners(attrs: Mapping[str, Any]) -> bool:
    """The recorded align_corners (``build_options`` and the top-level copy must agree)."""
    options = attrs.get("build_options")
    if not isinstance(options, Mapping) or not isinstance(options.get("align_corners"), bool):
        raise ValueError("grid/ attrs build_options.align_corners is missing or not a boolean")
    top = attrs.get("align_corners")
    if top is not options["align_corners"]:
        raise ValueError(f"grid/ attrs align_corners={top!r} disagrees with build_options.align_corners={options['align_corners']!r}")
    return bool(options["align_corners"])


def _finite_or_inf(values: npt.NDArray[np.floating]) -> npt.NDArray[np.float64]:
    """NaN (a tampered value) becomes +inf so that it fails every ``<=`` test and every max."""
    values = np.asarray(values, dtype=np.float64)
    return np.where(np.isnan(values), np.inf, values)


def _fmt(value: float) -> str:
    return f"{value:.3g}"


# --------------------------------------------------------------------------------------
# check_grid
# --------------------------------------------------------------------------------------


def dimension_names_grid(name: str, ndim: int, attrs: Mapping[str, Any]) -> tuple[str, ...] | None:
    """The ``dimension_names`` the writer gives ``grid/<name>`` (its formats included; None for an
    array no build writes: the contract check reports it)."""
    region = "region" in attrs
    known = set(BASE_ARRAYS) | {a for names in FORMAT_ARRAYS.values() for a in names} | (set(REGION_ARRAYS) if region else set())
    return group_dimension_names("grid", name, ndim, region=region) if name in known else None


@region_plugin("grid")
def check_grid(ctx: CheckContext, arrays: Mapping[str, np.ndarray], attrs: Mapping[str, Any]) -> list[Check]:
    """Invariant checks of the base ``grid/`` arrays against the config and the attributes.

    Every figure is recomputed from the arrays and the stored config; attributes are only
    compared with the recomputation.
    """
    rig = ctx.rig
    checks: list[Check] = []
    feature_size = rig.feature_size
    w_f, h_f = feature_size

    # -- attributes ------------------------------------------------------------------------
    align_corners: bool | None
    try:
        align_corners = _align_corners(attrs)
        checks.append(Check("build_options", "grid/", True, f"align_corners={align_corners} (build_options and attribute agree)"))
    except ValueError as exc:
        align_corners = None
        checks.append(Check("build_options", "grid/", False, str(exc)))
    recorded_size = attrs.get("feature_size")
    checks.append(
        Check(
            "feature_size",
            "grid/",
            recorded_size == [w_f, h_f],
            f"recorded {recorded_size}, config implies [W_f, H_f] = [{w_f}, {h_f}]",
        )
    )
    cams = attrs.get("cameras")
    heights = attrs.get("heights")
    checks.append(
        Check(
            "cameras_heights",
            "grid/",
            cams == list(rig.camera_names) and heights == list(rig.bev.heights),
            f"recorded cameras {cams} heights {heights}; config {list(rig.camera_names)} {list(rig.bev.heights)}",
        )
    )
    checks.append(
        Check(
            "invalid_coords_attr",
            "grid/",
            attrs.get("invalid_coords_px") == [INVALID_PX, INVALID_PX],
            f"recorded invalid_coords_px {attrs.get('invalid_coords_px')}, convention [{INVALID_PX:g}, {INVALID_PX:g}]",
        )
    )

    # -- contract: presence, shape, dtype ---------------------------------------------------
    ok: dict[str, np.ndarray] = {}
    for name, (shape, dtype) in expected_shapes(rig).items():
        key = f"grid/{name}"
        if name not in arrays:
            checks.append(Check("contract", key, False, "array missing or unreadable (see the store's read and metadata checks)"))
            continue
        arr = arrays[name]
        good = tuple(arr.shape) == shape and str(arr.dtype) == dtype
        checks.append(
            Check("contract", key, good, f"shape {tuple(arr.shape)} dtype {arr.dtype}; config implies {shape} {dtype}")
        )
        if good:
            ok[name] = arr

    # arrays no build of grid/ writes (the base arrays, or a format's: npu_checks checks that the
    # formats present are the ones build_options lists)
    table = grid_region(rig.bev)
    known = set(BASE_ARRAYS) | {a for names in FORMAT_ARRAYS.values() for a in names} | (set(REGION_ARRAYS) if table is not None else set())
    extra = sorted(set(arrays) - known)
    if extra:
        checks.append(Check("contract", "grid/", False, f"arrays not produced by these build_options: {', '.join(extra)}"))
    if table is not None:
        checks.extend(_check_region_tables(rig, arrays, table))

    valid = ok.get("valid")
    coords = ok.get("coords")
    if valid is not None:
        coverage = coverage_fraction(valid)
        recorded = attrs.get("coverage")
        try:
            diff = float(np.max(np.abs(np.asarray(recorded, dtype=np.float64) - coverage)))
            good = np.asarray(recorded).shape == coverage.shape and diff <= 0.5 * 10.0**-COVERAGE_ATTR_DECIMALS + 1e-12
        except (TypeError, ValueError):
            diff, good = float("nan"), False
        checks.append(
            Check("coverage_attr", "grid/valid", bool(good), f"recorded coverage vs recomputed from valid: max diff {_fmt(diff)} (rounding 5e-07 allowed)")
        )

    if coords is not None and valid is not None:
        checks.extend(_check_coords(rig, coords, valid))
    if ok.get("norm") is not None and coords is not None and valid is not None and align_corners is not None:
        checks.extend(_check_norm(ok["norm"], coords, valid, feature_size, align_corners))
    if ok.get("norm_int16") is not None and coords is not None and valid is not None and align_corners is not None:
        checks.extend(_check_norm_int16(ok["norm_int16"], ok.get("norm"), coords, valid, feature_size, align_corners, attrs))
    return checks


def _check_coords(rig: RigConfig, coords: np.ndarray, valid: np.ndarray) -> list[Check]:
    checks: list[Check] = []
    w_f, h_f = rig.feature_size
    key = "grid/coords"
    on = coords[valid]
    off = coords[~valid]
    finite = bool(np.all(np.isfinite(on)))
    checks.append(Check("finite_where_valid", key, finite, f"{int(np.sum(~np.isfinite(on)))} non-finite value(s) on {on.shape[0]} valid cell(s)"))
    n_bad_sentinel = int(np.sum(np.any(off != INVALID_PX, axis=-1)))
    checks.append(
        Check("invalid_sentinel", key, n_bad_sentinel == 0, f"{n_bad_sentinel} of {off.shape[0]} invalid cell(s) differ from ({INVALID_PX:g}, {INVALID_PX:g})")
    )
    with np.errstate(invalid="ignore"):
        inside = (on[:, 0] >= -0.5) & (on[:, 0] <= w_f - 0.5) & (on[:, 1] >= -0.5) & (on[:, 1] <= h_f - 0.5)
    n_out = int(np.sum(~inside))
    finite_on = on[np.all(np.isfinite(on), axis=-1)]
    if finite_on.shape[0]:
        span = (
            f"u in [{_fmt(float(finite_on[:, 0].min()))}, {_fmt(float(finite_on[:, 0].max()))}], "
            f"v in [{_fmt(float(finite_on[:, 1].min()))}, {_fmt(float(finite_on[:, 1].max()))}]"
        )
    else:
        span = "no valid cell"
    checks.append(
        Check(
            "valid_rule_bounds",
            key,
            n_out == 0,
            f"{n_out} valid cell(s) outside -0.5 <= u <= {w_f - 0.5:g}, -0.5 <= v <= {h_f - 0.5:g} (float32 form of the VALID RULE); {span}",
        )
    )
    checks.append(_check_coords_match_config(rig, coords, valid))
    return checks


def _recheck_indices(n_cells: int) -> np.ndarray:
    if n_cells <= MAX_RECHECK_CELLS_PER_CAMERA:
        return np.arange(n_cells)
    return np.unique(np.linspace(0, n_cells - 1, MAX_RECHECK_CELLS_PER_CAMERA).round().astype(np.int64))


def _check_region_tables(rig: RigConfig, arrays: Mapping[str, np.ndarray], table: RegionTable) -> list[Check]:
    """``grid/cells`` and ``grid/expand`` of a ``bev.region`` store: the cell table and expand
    index the stored config's region gives (:func:`bevcompile.rig.region.region_table`, rebuilt),
    ``expand`` the index of the stored ``cells``, and the ``region`` attribute's counts (``matrix/``
    holds the same two arrays, checked against the same rebuild: so the two agree)."""
    out: list[Check] = []
    for name, want in (("cells", table.cells), ("expand", table.expand)):
        got = arrays.get(name)
        if got is None:
            out.append(Check("region_tables", f"grid/{name}", False, f"grid/{name} is missing (a bev.region store holds the cell table)"))
            continue
        got = np.asarray(got)
        same = got.shape == want.shape and str(got.dtype) == "int32" and bool(np.array_equal(got, want))
        what = f"{table.n_kept} kept (super-)cells" if name == "cells" else f"({want.size},) index of {table.n_fine_kept} fine cells into {table.n_kept} cells + the zero row"
        out.append(Check("region_tables", f"grid/{name}", same, f"{what}, as the stored bev.region gives" if same else f"shape {list(got.shape)} {got.dtype}: differs from the stored bev.region's {list(want.shape)} int32"))
    cells = arrays.get("cells")
    expand = arrays.get("expand")
    if cells is not None and expand is not None:
        c, e = np.asarray(cells), np.asarray(expand)
        ny, nx = rig.bev.ny, rig.bev.nx
        ok = c.ndim == 2 and c.shape[1:] == (3,) and e.shape == (ny * nx,) and bool(c.size == 0 or (c.min() >= 0 and c[:, 0].max() < ny and c[:, 1].max() < nx))
        ok = ok and bool(np.array_equal(expand_of_cells(c, (ny, nx)), e))
        out.append(Check("region_expand_of_cells", "grid/expand", ok, "each fine cell reads the stored (super-)cell holding it, the zero row elsewhere" if ok else "grid/expand is not the index of grid/cells"))
    return out


def _check_coords_match_config(rig: RigConfig, coords: np.ndarray, valid: np.ndarray) -> Check:
    """Re-project (a bounded, evenly spaced sample of) the cells with the stored config (a
    region's kept (super-)cells at their centres)."""
    n_cells = int(np.prod(valid.shape[1:]))
    index = _recheck_indices(n_cells)
    table = grid_region(rig.bev)
    centres = (bev_cell_centres(rig.bev) if table is None else region_cell_centres(rig.bev, table)).reshape(-1, 3)[index]
    worst_ratio = 0.0
    worst_px = 0.0
    n_valid_mismatch = 0
    for cam_index, camera in enumerate(rig.cameras):
        uv64, proj_ok = project_bev_to_feature(rig, camera, centres)
        proj_ok &= inside_feature_map(uv64, rig.feature_size)
        stored_valid = valid[cam_index].reshape(-1)[index]
        n_valid_mismatch += int(np.sum(stored_valid != proj_ok))
        both = stored_valid & proj_ok
        stored = coords[cam_index].reshape(-1, 2)[index][both].astype(np.float64)
        diff = _finite_or_inf(np.abs(stored - uv64[both]))
        if diff.size:
            tol = half_ulp32(stored) + 1e-9
            worst_ratio = max(worst_ratio, float(np.max(diff / tol)))
            worst_px = max(worst_px, float(np.max(diff)))
    sampled = "all" if index.size == n_cells else f"{index.size} evenly spaced"
    passed = n_valid_mismatch == 0 and worst_ratio <= 1.0
    return Check(
        "coords_match_config",
        "grid/coords",
        passed,
        f"re-projected {sampled} cells x {rig.n_cam} cameras with the stored config: {n_valid_mismatch} valid flag(s) differ, "
        f"max |coords - float64 projection| {_fmt(worst_px)} px = {worst_ratio:.3g} x the float32 half-ulp bound",
    )


def _check_norm(
    norm: np.ndarray, coords: np.ndarray, valid: np.ndarray, feature_size: tuple[int, int], align_corners: bool
) -> list[Check]:
    """norm == feature_px_to_norm(coords) within float32 rounding of both.

    Stored ``norm = f32(n(u64))`` and ``coords = f32(u64)`` with ``n`` affine of slope
    ``s = 2/(W-1)`` (align_corners) or ``2/W``. So ``|norm - n(coords)| <= s * e(u) + e(norm)``
    with ``e`` the float32 half-ulp of each stored value, plus float64 arithmetic (1e-12).
    """
    size = np.array(feature_size, dtype=np.float64)
    slope = 2.0 / (size - 1.0) if align_corners else 2.0 / size
    expected = feature_px_to_norm(coords.astype(np.float64), feature_size, align_corners)
    diff = _finite_or_inf(np.abs(norm.astype(np.float64) - expected))
    tol = slope * half_ulp32(coords) + half_ulp32(norm) + 1e-12
    ratio = float(np.max(diff / tol)) if diff.size else 0.0
    checks = [
        Check(
            "norm_matches_coords",
            "grid/norm",
            ratio <= 1.0,
            f"max |norm - feature_px_to_norm(coords, align_corners={align_corners})| {_fmt(float(diff.max()) if diff.size else 0.0)}"
            f" = {ratio:.3g} x the float32 rounding bound",
        )
    ]
    invalid_norm = norm[~valid].reshape(1, 1, -1, 2)
    if invalid_norm.shape[2]:
        ones = np.ones((1, 1, feature_size[1], feature_size[0]), dtype=np.float32)
        sampled = grid_sample(ones, invalid_norm, mode="bilinear", padding_mode="zeros", align_corners=align_corners)
        n_nonzero = int(np.count_nonzero(sampled))
        worst = float(np.max(np.abs(sampled)))
    else:
        n_nonzero, worst = 0, 0.0
    checks.append(
        Check(
            "invalid_samples_zero",
            "grid/norm",
            n_nonzero == 0,
            f"grid_sample(ones, zeros padding) at {invalid_norm.shape[2]} invalid cell(s): {n_nonzero} non-zero (max {_fmt(worst)})",
        )
    )
    return checks


def _check_norm_int16(
    norm_int16: np.ndarray,
    norm: np.ndarray | None,
    coords: np.ndarray,
    valid: np.ndarray,
    feature_size: tuple[int, int],
    align_corners: bool,
    attrs: Mapping[str, Any],
) -> list[Check]:
    """Decode error vs the recorded bound (recomputed), encoding and invalid saturation.

    The recorded ``max_error_px`` was measured against the float64 coords; against the stored
    float32 coords the error may exceed it by the half-ulp of the coordinate, no more.
    """
    checks: list[Check] = []
    key = "grid/norm_int16"
    meta = attrs.get("norm_int16")
    recorded = meta.get("max_error_px") if isinstance(meta, Mapping) else None
    decoded_px = norm_to_feature_px(decode_norm_int16(norm_int16), feature_size, align_corners)
    err = _finite_or_inf(np.abs(decoded_px - coords.astype(np.float64))[valid])
    measured = float(err.max()) if err.size else 0.0
    if isinstance(recorded, int | float) and not isinstance(recorded, bool) and np.isfinite(recorded):
        tol = float(recorded) + half_ulp32(coords[valid]) + 1e-12
        excess = int(np.sum(err > tol))
        checks.append(
            Check(
                "decodes_within_recorded_error",
                key,
                excess == 0,
                f"max |decode(norm_int16) - coords| on valid cells {measured:.6g} px (recomputed) vs recorded max_error_px "
                f"{float(recorded):.6g} (+ float32 half-ulp of coords): {excess} value(s) over",
            )
        )
        # nor inflated: verify derives its norm_int16 threshold from this attribute
        ulps = half_ulp32(coords[valid])
        ulp_slack = (float(ulps.max()) if ulps.size else 0.0) + 1e-12
        agrees = measured - ulp_slack <= float(recorded) <= measured + ulp_slack
        checks.append(
            Check(
                "recorded_error_is_measured",
                key,
                agrees,
                f"recorded max_error_px {float(recorded):.6g} vs recomputed {measured:.6g} px (equal up to the float32 half-ulp of coords {ulp_slack:.3g})",
            )
        )
    else:
        checks.append(Check("decodes_within_recorded_error", key, False, f"attribute norm_int16.max_error_px missing or not a finite number ({recorded!r}); measured {measured:.6g} px"))
    # quantisation bound: half a quantum of norm, in pixels, per component, plus float32 rounding
    # of coords -- on the components whose norm is representable (|norm| <= 1). With
    # align_corners=True the VALID RULE admits u in [-0.5, 0) and (W_f - 1, W_f - 0.5), whose norm
    # lies outside [-1, 1] and saturates: those are counted and covered by max_error_px instead.
    size = np.array(feature_size, dtype=np.float64)
    px_per_norm = (size - 1.0) / 2.0 if align_corners else size / 2.0
    half_quantum_px = 0.5 / NORM_INT16_SCALE * px_per_norm  # (2,) per component
    err_components = _finite_or_inf(np.abs(decoded_px - coords.astype(np.float64)))[valid]  # (n_valid, 2)
    norm_of_coords = feature_px_to_norm(coords.astype(np.float64), feature_size, align_corners)[valid]
    representable = np.abs(norm_of_coords) <= 1.0
    slack = half_ulp32(coords[valid]) + 1e-12
    over = representable & (err_components > half_quantum_px + slack)
    n_saturated = int(np.sum(np.any(~representable, axis=-1)))
    worst = float(np.max(np.where(representable, err_components, 0.0), initial=0.0))
    saturated_note = (
        f"; {n_saturated} valid cell(s) lie outside norm [-1, 1] (align_corners={align_corners}) and saturate, "
        f"up to {measured:.3g} px (covered by max_error_px)"
        if n_saturated
        else "; no valid cell saturates"
    )
    checks.append(
        Check(
            "quantisation_bound",
            key,
            int(np.sum(over)) == 0,
            f"max decode error on representable values {worst:.6g} px vs half a quantum "
            f"({half_quantum_px[0]:.6g}, {half_quantum_px[1]:.6g}) px for (u, v): {int(np.sum(over))} over{saturated_note}",
        )
    )
    if norm is not None:
        scaled = norm.astype(np.float64) * NORM_INT16_SCALE
        expected = np.clip(scaled, -NORM_INT16_SCALE, NORM_INT16_SCALE)
        diff = _finite_or_inf(np.abs(norm_int16.astype(np.float64) - expected))
        tol = 0.5 + NORM_INT16_SCALE * half_ulp32(norm) + 1e-9
        n_bad = int(np.sum(diff > tol))
        checks.append(
            Check(
                "encodes_norm",
                key,
                n_bad == 0,
                f"{n_bad} value(s) farther than half a step (+ float32 rounding of norm) from clip(norm * 32767); max {_fmt(float(diff.max()) if diff.size else 0.0)}",
            )
        )
    want = {"scale": 1.0 / NORM_INT16_SCALE, "offset": 0.0}
    got = meta if isinstance(meta, Mapping) else {}
    bad = [f"norm_int16.{k} {got.get(k)!r}, recomputed {v!r}" for k, v in want.items() if not same_recorded(got.get(k), v)]
    checks.append(Check("dequantisation_attrs", key, not bad, "; ".join(bad) if bad else "norm_int16.scale = 1/32767 and norm_int16.offset = 0 as recomputed"))
    off = norm_int16[~valid]
    n_bad_invalid = int(np.sum(np.any(off != -NORM_INT16_SCALE, axis=-1)))
    checks.append(
        Check(
            "invalid_saturated",
            key,
            n_bad_invalid == 0,
            f"{n_bad_invalid} of {off.shape[0]} invalid cell(s) not saturated to (-32767, -32767) (documented: decode to -1, mask with grid/valid)",
        )
    )
    return checks


# --------------------------------------------------------------------------------------
# rebuild_grid
# --------------------------------------------------------------------------------------


@region_rebuild
def rebuild_grid(rig: RigConfig, attrs: Mapping[str, Any]) -> dict[str, Any]:
    """Recompute ``coords``, ``valid``, ``norm``, ``norm_int16`` exactly as ``bevcompile grid`` does,
    from the stored config and ``attrs["build_options"]["align_corners"]``, and the group
    attributes the build writes for them (under :data:`~bevcompile.checks_api.REBUILT_ATTRS`)."""
    from ..build import grid_group  # the writer's own attributes (build imports the plug-in modules' deps)

    align_corners = _align_corners(attrs)
    products = build_grid_products(compute_product_grid(rig), align_corners)
    table = grid_region(rig.bev)
    out: dict[str, Any] = {
        "coords": products.coords,
        "valid": products.valid,
        "norm": products.norm,
        "norm_int16": products.norm_int16,
        REBUILT_ATTRS: grid_group(products, rig, table=table).attrs,  # the base attributes (npu_checks adds the formats')
    }
    if table is not None:
        out["cells"], out["expand"] = table.cells, table.expand
    return out


# --------------------------------------------------------------------------------------
# verify_grid
# --------------------------------------------------------------------------------------


def float32_grid_bound(feature_size: tuple[int, int], peak: float = FEATURE_PEAK) -> tuple[float, float]:
    """Worst-case sampled-value error of the float32 ``coords`` and ``norm`` forms.

    bilinear sampling with zeros padding is Lipschitz with constant ``peak`` per pixel on each
    axis (neighbouring values differ by at most the feature range). ``|f32(u) - u| <= 2^-24 |u|
    <= 2^-24 W`` for coords; ``|f32(n) - n| <= 2^-24`` for ``|n| <= 1``, i.e. ``2^-25 W`` px for
    norm. Returns ``(coords bound, norm bound)`` in feature units.
    """
    w_f, h_f = feature_size
    coords_bound = peak * 2.0**-24 * (w_f + h_f)
    norm_bound = peak * 2.0**-25 * (w_f + h_f)
    return coords_bound, norm_bound


def torch_float32_bound(feature_size: tuple[int, int], peak: float = FEATURE_PEAK) -> float:
    """Threshold of PyTorch's float32 ``grid_sample`` against the float64 numpy reference on the
    same grid: torch un-normalises ``((n + 1) W - 1) / 2`` in float32, at most 3 roundings of a
    value ``<= 2W`` (``3 * 2^-24 W`` px per axis), then float32 bilinear weights; times the
    Lipschitz constant ``peak`` per pixel and axis: ``max(1e-5, peak 2^-22 (W_f + H_f))``.
    """
    w_f, h_f = feature_size
    return max(FLOAT_PATH_THRESHOLD, peak * 2.0**-22 * (w_f + h_f))


@region_plugin("grid")
def verify_grid(ctx: CheckContext, arrays: Mapping[str, np.ndarray], attrs: Mapping[str, Any]) -> list[VerifyRow]:
    """The grid forms against bilinear sampling at the float64 projections, per camera.

    Reference: :func:`bevcompile.grid.reference.bilinear_sample_px` of ``ctx.features`` at the float64
    projection of every cell (recomputed from the stored config), 0 on invalid cells.
    Rows: ``grid/coords`` (float32 pixels), ``grid/norm`` (numpy ``grid_sample``, the store's
    align_corners), ``grid/norm_int16`` (decoded, masked with ``grid/valid``) and, where PyTorch
    is installed, ``torch grid_sample(grid/norm)`` against the numpy ``grid_sample``.
    """
    if ctx.features is None:
        raise ValueError("verify_grid needs ctx.features")
    rig = ctx.rig
    features = ctx.features
    feature_size = rig.feature_size
    align_corners = _align_corners(attrs)
    shapes = expected_shapes(rig)
    for name in BASE_ARRAYS:
        if name not in arrays:
            raise ValueError(f"grid/{name} missing or unreadable")
        shape, dtype = shapes[name]
        if tuple(arrays[name].shape) != shape or str(arrays[name].dtype) != dtype:
            raise ValueError(f"grid/{name} has shape {arrays[name].shape} dtype {arrays[name].dtype}, expected {shape} {dtype}")
    coords = arrays["coords"]
    valid = arrays["valid"]
    norm = arrays["norm"]
    norm_int16 = arrays["norm_int16"]
    truth = ctx.sampling_grid()
    coords_bound, norm_bound = float32_grid_bound(feature_size)
    float_threshold = max(FLOAT_PATH_THRESHOLD, coords_bound, norm_bound)
    torch_threshold = torch_float32_bound(feature_size)
    meta = attrs.get("norm_int16")
    recorded = float(meta["max_error_px"]) if isinstance(meta, Mapping) and isinstance(meta.get("max_error_px"), int | float) else float("nan")
    int16_threshold = FEATURE_PEAK * 2.0 * recorded + 1e-6
    torch_fn, torch_note = _torch_grid_sample()

    rows: list[VerifyRow] = []
    n_h, ny, nx = valid.shape[1:]
    for cam_index, camera in enumerate(rig.cameras):
        feats = features[cam_index]
        valid_true = truth.valid[cam_index]
        ref = np.where(valid_true[None], bilinear_sample_px(feats, truth.coords_feature_px[cam_index]), 0.0)
        cam_valid = valid[cam_index]

        got = np.where(cam_valid[None], bilinear_sample_px(feats, coords[cam_index]), 0.0)
        rows.append(_row("grid/coords", camera.name, got, ref, float_threshold, "bilinear at float32 coords vs float64 projection"))

        grid = norm[cam_index].reshape(1, n_h * ny, nx, 2)
        sampled = grid_sample(feats[None], grid, align_corners=align_corners)[0].reshape(-1, n_h, ny, nx)
        rows.append(_row("grid/norm", camera.name, sampled, ref, float_threshold, f"numpy grid_sample(align_corners={align_corners}), zeros padding"))

        grid16 = decode_norm_int16(norm_int16[cam_index]).reshape(1, n_h * ny, nx, 2)
        sampled16 = grid_sample(feats[None], grid16, align_corners=align_corners)[0].reshape(-1, n_h, ny, nx)
        sampled16 = np.where(cam_valid[None], sampled16, 0.0)
        n_saturated = int(np.sum(np.any(np.abs(feature_px_to_norm(coords[cam_index][cam_valid], feature_size, align_corners)) > 1.0, axis=-1)))
        if align_corners:  # valid cells may saturate (norm outside [-1, 1]): judge them apart
            size = np.array(feature_size, dtype=np.float64)
            half_quantum_px = 0.5 / NORM_INT16_SCALE * (size - 1.0) / 2.0
            rows.extend(
                clamped_format_rows(
                    "grid/norm_int16", camera.name, sampled16, ref, truth.coords_feature_px[cam_index], valid_true, feature_size,
                    half_quantum_px, norm_bound + 1e-6, FEATURE_PEAK, "decoded from the float32 norm, masked with grid/valid",
                )
            )
        else:
            note16 = f"decoded, masked with grid/valid; bound 2 x max_error_px {recorded:.3g} px"
            if n_saturated:
                note16 += f"; {n_saturated} valid cell(s) outside norm [-1, 1] saturate"
            rows.append(_row("grid/norm_int16", camera.name, sampled16, ref, int16_threshold, note16))

        if torch_fn is not None:
            got_torch = torch_fn(feats[None], grid, align_corners, "float64")[0].reshape(-1, n_h, ny, nx)
            rows.append(
                _row("torch grid_sample(grid/norm)", camera.name, got_torch, sampled, FLOAT_PATH_THRESHOLD, f"{torch_note}, float64 on the stored float32 grid vs numpy reference")
            )
            got_torch32 = torch_fn(feats[None], grid, align_corners, "float32")[0].reshape(-1, n_h, ny, nx)
            rows.append(
                _row(
                    "torch grid_sample(grid/norm) float32",
                    camera.name,
                    got_torch32,
                    sampled,
                    torch_threshold,
                    "float32 as deployed: torch un-normalises in float32 (<= 3 roundings of a value <= W px per axis)",
                )
            )
        elif cam_index == 0:
            rows.append(
                VerifyRow(
                    "torch grid_sample(grid/norm)", "all", math.nan, math.nan, math.nan, "not run", True, f"skipped: {torch_note}", informational=True
                )
            )
    return rows


def _row(product: str, camera: str, got: np.ndarray, ref: np.ndarray, threshold: float, note: str) -> VerifyRow:
    max_abs, mean_abs, psnr = compare(product, camera, got, ref, FEATURE_PEAK)
    passed = bool(np.isfinite(threshold)) and max_abs <= threshold
    return VerifyRow(product, camera, max_abs, mean_abs, psnr, f"max_abs <= {threshold:.3g}", passed, note)


def _torch_grid_sample() -> tuple[Any, str]:
    """``(fn(features (N,C,H,W), grid (N,Ho,Wo,2), align_corners) -> float64 ndarray, note)``;
    ``fn`` is None when torch is not installed."""
    try:
        import torch
    except ImportError as exc:
        return None, f"PyTorch not installed ({exc.__class__.__name__})"

    def run(features: np.ndarray, grid: np.ndarray, align_corners: bool, dtype: str = "float32") -> np.ndarray:
        """torch ``grid_sample`` in ``dtype``; a float32 grid upcasts to float64 exactly."""
        with torch.no_grad():
            out = torch.nn.functional.grid_sample(
                torch.from_numpy(np.ascontiguousarray(features, dtype=dtype)),
                torch.from_numpy(np.ascontiguousarray(grid, dtype=dtype)),
                mode="bilinear",
                padding_mode="zeros",
                align_corners=align_corners,
            )
        return out.numpy().astype(np.float64)

    return run, f"torch {torch.__version__}"
