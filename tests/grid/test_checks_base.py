"""The grid/ plug-in (bevcompile.checks_grid): checks, rebuild and verify on in-memory products."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bevcompile.grid.build import grid_group
from bevcompile.grid.checks.base import (
    FLOAT_PATH_THRESHOLD,
    check_grid,
    float32_grid_bound,
    half_ulp32,
    rebuild_grid,
    torch_float32_bound,
    verify_grid,
)
from bevcompile.grid.ipm import (
    INVALID_PX,
    NORM_INT16_SCALE,
    build_grid_products,
    compute_sampling_grid,
    feature_px_to_norm,
    norm_to_feature_px,
)
from bevcompile.grid.reference import bilinear_sample_px
from bevcompile.rig.config import RigConfig
from bevcompile.store.inspection import json_attrs
from bevcompile.store.plugins import REBUILT_ATTRS, Check, CheckContext
from bevcompile.store.root import root_attributes
from bevcompile.store.verify import make_features

from .. import rigs


def _products(rig: RigConfig, align_corners: bool = False) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    products = build_grid_products(compute_sampling_grid(rig), align_corners)
    group = grid_group(products, rig)
    attrs = json.loads(json.dumps(group.attrs))  # as stored: plain JSON
    return {k: v.copy() for k, v in group.arrays.items()}, attrs


def _ctx(rig: RigConfig, features: np.ndarray | None = None) -> CheckContext:
    return CheckContext(rig=rig, store_path="<memory>", root_attrs=root_attributes(rig), features=features)


def _named(checks: list[Check], name: str, array: str | None = None) -> Check:
    found = [c for c in checks if c.name == name and (array is None or c.array == array)]
    assert len(found) == 1, f"expected one {name} check, got {found}"
    return found[0]


def _failed_names(checks: list[Check]) -> set[str]:
    return {c.name for c in checks if not c.passed}


def _a_valid_cell(valid: np.ndarray) -> tuple[int, ...]:
    return tuple(int(i) for i in np.argwhere(valid)[len(np.argwhere(valid)) // 2])


def _an_invalid_cell(valid: np.ndarray) -> tuple[int, ...]:
    return tuple(int(i) for i in np.argwhere(~valid)[0])


@pytest.mark.parametrize(
    ("rig_factory", "align_corners"),
    [
        (rigs.small_rig, False),
        (rigs.small_rig, True),
        (lambda: rigs.small_rig(distortion=True, heights=(-0.5, 0.0, 1.0), bev_half_m=20.0), True),
        (lambda: rigs.small_rig(pixel_mapping="linspace", distortion=True), False),
        (rigs.nuscenes_rig, False),
        (rigs.distorted_rig, True),
    ],
)
def test_fresh_products_pass_every_check(rig_factory: Any, align_corners: bool) -> None:
    rig = rig_factory()
    arrays, attrs = _products(rig, align_corners)
    checks = check_grid(_ctx(rig), arrays, attrs)
    assert [c for c in checks if not c.passed] == []
    names = {c.name for c in checks}
    assert {
        "contract",
        "finite_where_valid",
        "invalid_sentinel",
        "valid_rule_bounds",
        "coords_match_config",
        "norm_matches_coords",
        "invalid_samples_zero",
        "decodes_within_recorded_error",
        "quantisation_bound",
        "encodes_norm",
        "invalid_saturated",
        "coverage_attr",
        "build_options",
    } <= names


def test_tolerances_are_tight_not_vacuous(nuscenes: RigConfig) -> None:
    """The derived float32 bounds are nearly attained on a real rig (so they would catch a one-ulp edit)."""
    arrays, attrs = _products(nuscenes)
    checks = check_grid(_ctx(nuscenes), arrays, attrs)
    for name in ("coords_match_config", "norm_matches_coords"):
        reason = _named(checks, name).reason
        ratio = float(reason.split(" = ")[-1].split(" x ")[0])
        assert 0.5 < ratio <= 1.0, reason


def test_one_ulp_edit_of_coords_is_caught(small: RigConfig) -> None:
    arrays, attrs = _products(small)
    cell = _a_valid_cell(arrays["valid"])
    u = arrays["coords"][cell][0]
    arrays["coords"][(*cell, 0)] = np.nextafter(np.nextafter(u, np.float32(np.inf)), np.float32(np.inf))
    checks = check_grid(_ctx(small), arrays, attrs)
    assert not _named(checks, "coords_match_config").passed


def test_convention_valid_rule_float32_bounds_are_inclusive_above(small: RigConfig) -> None:
    """VALID RULE: -0.5 <= u < W_f - 0.5 in float64; its float32 form is -0.5 <= u <= W_f - 0.5."""
    w_f, _h_f = small.feature_size
    cell = _a_valid_cell(_products(small)[0]["valid"])
    for u, ok in (
        (np.float32(w_f - 0.5), True),
        (np.nextafter(np.float32(w_f - 0.5), np.float32(np.inf)), False),
        (np.float32(-0.5), True),
        (np.nextafter(np.float32(-0.5), np.float32(-np.inf)), False),
    ):
        arrays, attrs = _products(small)
        arrays["coords"][(*cell, 0)] = u
        check = _named(check_grid(_ctx(small), arrays, attrs), "valid_rule_bounds")
        assert check.passed is ok, (u, check.reason)


def test_convention_invalid_cells_hold_sentinel_and_sample_exactly_zero_in_torch(small: RigConfig) -> None:
    """Independent of our reference: torch grid_sample returns exactly 0 at every invalid cell."""
    arrays, _ = _products(small)
    invalid = ~arrays["valid"]
    assert np.all(arrays["coords"][invalid] == INVALID_PX)
    w_f, h_f = small.feature_size
    grid = torch.from_numpy(arrays["norm"][invalid].reshape(1, 1, -1, 2))
    sampled = torch.nn.functional.grid_sample(torch.ones(1, 1, h_f, w_f), grid, align_corners=False)
    assert int(torch.count_nonzero(sampled)) == 0


@pytest.mark.parametrize(
    ("tamper", "failing"),
    [
        ("nan_at_valid", {"finite_where_valid"}),
        ("invalid_not_sentinel", {"invalid_sentinel", "norm_matches_coords"}),
        ("valid_flag_flipped", {"coords_match_config"}),
        ("norm_other_align", {"norm_matches_coords", "encodes_norm"}),
        ("invalid_norm_inside", {"invalid_samples_zero", "norm_matches_coords", "encodes_norm"}),
        ("int16_off_by_two", {"decodes_within_recorded_error", "encodes_norm"}),
        ("int16_invalid_not_saturated", {"invalid_saturated", "encodes_norm"}),
        ("max_error_lowered", {"decodes_within_recorded_error", "recorded_error_is_measured"}),
        ("max_error_raised", {"recorded_error_is_measured"}),
        ("max_error_missing", {"decodes_within_recorded_error"}),
        ("coverage_attr_edited", {"coverage_attr"}),
        ("align_attr_flipped", {"build_options"}),
        ("feature_size_attr", {"feature_size"}),
        ("wrong_dtype", {"contract"}),
        ("wrong_shape", {"contract"}),
        ("missing_array", {"contract"}),
    ],
)
def test_each_tamper_fails_its_check(small: RigConfig, tamper: str, failing: set[str]) -> None:
    arrays, attrs = _products(small)
    valid = arrays["valid"]
    cell = _a_valid_cell(valid)
    bad = _an_invalid_cell(valid)
    w_f, h_f = small.feature_size
    if tamper == "nan_at_valid":
        arrays["coords"][(*cell, 0)] = np.nan
    elif tamper == "invalid_not_sentinel":
        arrays["coords"][bad] = (-2.0, -1.5)
    elif tamper == "valid_flag_flipped":
        arrays["valid"][bad] = True
        arrays["coords"][bad] = (3.0, 3.0)
    elif tamper == "norm_other_align":
        arrays["norm"] = feature_px_to_norm(arrays["coords"], (w_f, h_f), True).astype(np.float32)
    elif tamper == "invalid_norm_inside":
        arrays["norm"][bad] = feature_px_to_norm(np.array([-0.75, 3.0]), (w_f, h_f), False)
    elif tamper == "int16_off_by_two":
        arrays["norm_int16"][(*cell, 0)] += 2
    elif tamper == "int16_invalid_not_saturated":
        arrays["norm_int16"][(*bad, 1)] = 0
    elif tamper == "max_error_lowered":
        attrs["norm_int16"]["max_error_px"] /= 2
    elif tamper == "max_error_raised":  # would loosen verify's norm_int16 threshold
        attrs["norm_int16"]["max_error_px"] *= 2
    elif tamper == "max_error_missing":
        del attrs["norm_int16"]["max_error_px"]
    elif tamper == "coverage_attr_edited":
        attrs["coverage"][0][0] += 0.01
    elif tamper == "align_attr_flipped":
        attrs["align_corners"] = True
    elif tamper == "feature_size_attr":
        attrs["feature_size"] = [h_f, w_f]
    elif tamper == "wrong_dtype":
        arrays["coords"] = arrays["coords"].astype(np.float64)
    elif tamper == "wrong_shape":
        arrays["valid"] = arrays["valid"][:, :, :-1]
    elif tamper == "missing_array":
        del arrays["norm"]
    checks = check_grid(_ctx(small), arrays, attrs)
    assert failing <= _failed_names(checks), [c for c in checks if not c.passed]
    if tamper not in ("valid_flag_flipped", "nan_at_valid", "int16_off_by_two"):
        assert _failed_names(checks) == failing, [c for c in checks if not c.passed]


def test_align_corners_true_saturation_is_reported_not_hidden() -> None:
    """align_corners=True: valid cells with u in [-0.5, 0) have |norm| > 1 and saturate in int16;
    the check passes (max_error_px records it honestly) but says how many cells saturate."""
    rig = rigs.small_rig(distortion=True, heights=(-0.5, 0.0, 1.0), bev_half_m=20.0)
    arrays, attrs = _products(rig, align_corners=True)
    check = _named(check_grid(_ctx(rig), arrays, attrs), "quantisation_bound")
    assert check.passed
    assert "saturate" in check.reason and "no valid cell saturates" not in check.reason
    assert attrs["norm_int16"]["max_error_px"] > 0.4


def test_rebuild_grid_is_bit_identical_to_the_build(small_distorted_multi: RigConfig) -> None:
    arrays, attrs = _products(small_distorted_multi, align_corners=True)
    rebuilt = rebuild_grid(small_distorted_multi, attrs)
    assert json_attrs(rebuilt.pop(REBUILT_ATTRS)) == json_attrs(attrs)
    assert sorted(rebuilt) == sorted(arrays)
    for name, value in arrays.items():
        assert rebuilt[name].dtype == value.dtype and rebuilt[name].tobytes() == value.tobytes(), name


def test_rebuild_grid_refuses_inconsistent_build_options(small: RigConfig) -> None:
    _, attrs = _products(small)
    attrs["build_options"] = {"align_corners": "yes"}
    with pytest.raises(ValueError, match=r"build_options\.align_corners"):
        rebuild_grid(small, attrs)


def test_verify_grid_rows_pass_and_torch_matches_reference(nuscenes: RigConfig) -> None:
    arrays, attrs = _products(nuscenes)
    features, _ = make_features(nuscenes, 4, 0)
    rows = verify_grid(_ctx(nuscenes, features), arrays, attrs)
    products = {r.product for r in rows}
    assert products == {"grid/coords", "grid/norm", "grid/norm_int16", "torch grid_sample(grid/norm)", "torch grid_sample(grid/norm) float32"}
    assert len(rows) == 5 * nuscenes.n_cam
    assert all(r.passed for r in rows), [r for r in rows if not r.passed]
    # float64 torch on the same grid: the same semantics as the numpy reference, to rounding
    assert all(r.max_abs <= 1e-12 for r in rows if r.product == "torch grid_sample(grid/norm)")
    # measured, not vacuous: torch float32 (float32 un-normalisation) differs from the float64 reference
    torch32 = [r for r in rows if r.product == "torch grid_sample(grid/norm) float32"]
    assert all(0 < r.max_abs <= FLOAT_PATH_THRESHOLD for r in torch32)
    int16 = [r for r in rows if r.product == "grid/norm_int16"]
    recorded = attrs["norm_int16"]["max_error_px"]
    assert all(r.max_abs <= 2 * recorded + 1e-6 for r in int16)
    coords_bound, norm_bound = float32_grid_bound(nuscenes.feature_size)
    assert all(r.max_abs <= coords_bound for r in rows if r.product == "grid/coords")
    assert all(r.max_abs <= norm_bound for r in rows if r.product == "grid/norm")


def test_torch_on_stored_norm_matches_float64_projection_independently(nuscenes: RigConfig) -> None:
    """Independent of verify_grid: torch grid_sample(grid/norm) vs bilinear at the float64 projection."""
    arrays, _ = _products(nuscenes)
    truth = compute_sampling_grid(nuscenes)
    features, _ = make_features(nuscenes, 3, 7)
    grid = torch.from_numpy(arrays["norm"].reshape(nuscenes.n_cam, -1, nuscenes.bev.nx, 2))
    got = torch.nn.functional.grid_sample(torch.from_numpy(features), grid, align_corners=False).numpy()
    for cam in range(nuscenes.n_cam):
        ref = np.where(truth.valid[cam], bilinear_sample_px(features[cam], truth.coords_feature_px[cam]), 0.0)
        assert np.max(np.abs(got[cam].reshape(ref.shape) - ref)) <= FLOAT_PATH_THRESHOLD


def test_verify_grid_flags_the_camera_whose_norm_is_off(small: RigConfig) -> None:
    arrays, attrs = _products(small)
    w_f, _ = small.feature_size
    valid0 = arrays["valid"][1]
    arrays["norm"][1][valid0, 0] += np.float32(2.0 / w_f * 0.5)  # half a pixel on camera LEFT
    arrays["norm_int16"][2][arrays["valid"][2], 1] -= 30  # 30 quanta on camera BACK
    features, _ = make_features(small, 4, 1)
    rows = verify_grid(_ctx(small, features), arrays, attrs)
    failed = {(r.product, r.camera) for r in rows if not r.passed}
    assert failed == {("grid/norm", "LEFT"), ("grid/norm_int16", "BACK")}


def test_verify_grid_refuses_missing_arrays(small: RigConfig) -> None:
    arrays, attrs = _products(small)
    del arrays["coords"]
    features, _ = make_features(small, 2, 0)
    with pytest.raises(ValueError, match="grid/coords missing"):
        verify_grid(_ctx(small, features), arrays, attrs)


def test_norm_int16_scale_is_the_documented_one() -> None:
    assert NORM_INT16_SCALE == 32767


@settings(max_examples=300, deadline=None)
@given(
    width=st.integers(min_value=2, max_value=4096),
    frac=st.floats(min_value=0.0, max_value=1.0, exclude_max=True),
    align_corners=st.booleans(),
)
def test_derived_float32_tolerances_hold_for_any_coordinate(width: int, frac: float, align_corners: bool) -> None:
    """The tolerances of norm_matches_coords and quantisation_bound, derived from float32
    rounding, hold for every valid coordinate the VALID RULE admits (u in [-0.5, W - 0.5))."""
    u64 = np.array([-0.5 + frac * width])
    size = (width, width)
    coords32 = u64.astype(np.float32)
    norm64 = feature_px_to_norm(np.stack([u64, u64], axis=-1), size, align_corners)[..., 0]
    norm32 = norm64.astype(np.float32)
    slope = 2.0 / (width - 1) if align_corners else 2.0 / width
    recomputed = feature_px_to_norm(np.stack([coords32, coords32], axis=-1).astype(np.float64), size, align_corners)[..., 0]
    assert abs(float(norm32[0]) - float(recomputed[0])) <= slope * float(half_ulp32(coords32)[0]) + float(half_ulp32(norm32)[0]) + 1e-12
    if abs(norm64[0]) <= 1.0:  # representable in int16: decode error <= half a quantum (+ float32 coords rounding)
        q = np.clip(np.rint(norm64 * NORM_INT16_SCALE), -NORM_INT16_SCALE, NORM_INT16_SCALE)
        decoded = norm_to_feature_px(np.stack([q, q], axis=-1) / NORM_INT16_SCALE, size, align_corners)[..., 0]
        px_per_norm = (width - 1) / 2.0 if align_corners else width / 2.0
        bound = 0.5 / NORM_INT16_SCALE * px_per_norm + float(half_ulp32(coords32)[0]) + 1e-12
        assert abs(float(decoded[0]) - float(coords32[0])) <= bound


def test_torch_float32_threshold_covers_large_feature_maps() -> None:
    """PyTorch float32 grid_sample on a 640 x 360 map (the dense rig) differs from float64 by ~4.5e-5
    on unit features: more than 1e-5, inside the derived bound 2^-22 (W_f + H_f)."""
    rng = np.random.default_rng(0)
    w_f, h_f = 640, 360
    features = rng.random((1, 2, h_f, w_f), dtype=np.float32)
    grid = rng.uniform(-1, 1, (1, 64, 64, 2)).astype(np.float32)
    got32 = torch.nn.functional.grid_sample(torch.from_numpy(features), torch.from_numpy(grid), align_corners=False).numpy()
    got64 = torch.nn.functional.grid_sample(torch.from_numpy(features).double(), torch.from_numpy(grid).double(), align_corners=False).numpy()
    error = float(np.max(np.abs(got32 - got64)))
    assert FLOAT_PATH_THRESHOLD < error <= torch_float32_bound((w_f, h_f))
    assert torch_float32_bound((8, 8)) == FLOAT_PATH_THRESHOLD  # small maps keep the 1e-5 floor


def test_audit_norm_int16_attrs_extra_array_and_align_corners_verify() -> None:
    """scale/offset recomputed; an unknown array fails the contract; verify's norm_int16 rows
    under align_corners judge saturated cells apart, so random codes fail."""
    import copy

    from bevcompile.grid.build import GridBuildOptions, build_grid_command
    from bevcompile.grid.checks import base as checks_grid
    from bevcompile.store.plugins import CheckContext
    from bevcompile.store.verify import make_features

    rig = rigs.small_rig(distortion=True, heights=(-0.5, 0.0, 1.0), bev_half_m=20.0)
    grid = build_grid_command(rig, GridBuildOptions(align_corners=True, npu=False)).groups["grid"]
    features, _ = make_features(rig, 3, 0)
    ctx = CheckContext(rig=rig, store_path="<memory>", root_attrs={}, grid_arrays=grid.arrays, grid_attrs=grid.attrs, features=features)
    assert all(c.passed for c in checks_grid.check_grid(ctx, grid.arrays, grid.attrs))
    attrs = copy.deepcopy(grid.attrs)
    attrs["norm_int16"]["scale"] = 1.0 / 32768
    failed = [c for c in checks_grid.check_grid(ctx, grid.arrays, attrs) if not c.passed]
    assert [(c.array, c.name) for c in failed] == [("grid/norm_int16", "dequantisation_attrs")]
    extra = {**grid.arrays, "zz_unknown": np.zeros(3, np.int32)}
    failed = [c for c in checks_grid.check_grid(ctx, extra, grid.attrs) if not c.passed]
    assert [(c.array, c.name, c.reason) for c in failed] == [("grid/", "contract", "arrays not produced by these build_options: zz_unknown")]
    rows = checks_grid.verify_grid(ctx, grid.arrays, grid.attrs)
    assert all(r.passed for r in rows) and any(r.product == "grid/norm_int16 saturated" for r in rows)
    q = grid.arrays["norm_int16"].copy()
    valid = grid.arrays["valid"]
    q[valid] = np.random.default_rng(0).integers(-32767, 32768, (int(valid.sum()), 2))
    rows = checks_grid.verify_grid(ctx, {**grid.arrays, "norm_int16": q}, grid.attrs)
    assert any(not r.passed for r in rows if r.product.startswith("grid/norm_int16"))
