"""Fixed-point grid formats: bit-exact rules, OpenCV equivalence, round trips, saturation."""

from __future__ import annotations

import cv2
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bevcompile.errors import UsageError
from bevcompile.grid.formats import (
    FORMATS,
    build_format,
    build_formats,
    check_format_names,
    decode_format_px,
    decode_norm_q16,
    decode_opencv_maps,
    decode_pixel_q,
    decode_uq12,
    encode_norm_q16,
    encode_opencv_maps,
    encode_pixel_q,
    encode_uq12,
    j5_default_frac_bits,
    norm_q16_scale,
    pixel_q_max_frac_bits,
    resolve_pixel_q_frac_bits,
    samples_zero,
)
from bevcompile.grid.gather import build_gather_tables, gather_sample
from bevcompile.grid.ipm import SamplingGrid, compute_sampling_grid, feature_px_to_norm, norm_to_feature_px
from bevcompile.grid.reference import bilinear_sample_px, grid_sample
from bevcompile.rig.config import RigConfig, parse_config

from .. import rigs

EXTRA = ("uq12", "opencv", "pixel_q", "norm_q16")


# --------------------------------------------------------------------------------------
# opencv
# --------------------------------------------------------------------------------------


def test_opencv_maps_equal_cv2_convertmaps_on_the_nuscenes_grid(nuscenes: RigConfig) -> None:
    sampling = compute_sampling_grid(nuscenes)
    coords32 = sampling.coords_feature_px.astype(np.float32)
    product = build_format("opencv", sampling, False)
    for cam in range(nuscenes.n_cam):
        map_x = np.ascontiguousarray(coords32[cam, 0, ..., 0])
        map_y = np.ascontiguousarray(coords32[cam, 0, ..., 1])
        map1, map2 = cv2.convertMaps(map_x, map_y, cv2.CV_16SC2)
        np.testing.assert_array_equal(product.arrays["opencv_map1"][cam, 0], map1)
        np.testing.assert_array_equal(product.arrays["opencv_map2"][cam, 0], map2)
    assert product.attrs["max_error_px"] <= 1 / 64 + 2.0**-24 * 44


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.floats(-70000, 70000, allow_nan=False, width=32),
            st.integers(-4000, 4000).map(lambda k: k / 64),  # exact halves of 1/32 steps: round half to even
        ),
        min_size=2,
        max_size=64,
    )
)
def test_opencv_maps_bit_exact_with_cv2_on_adversarial_values(values: list[float]) -> None:
    xs = np.asarray(values, dtype=np.float32)[None, :]
    ys = xs[:, ::-1].copy()
    map1, map2 = cv2.convertMaps(xs, ys, cv2.CV_16SC2)
    got1, got2 = encode_opencv_maps(xs, ys)
    np.testing.assert_array_equal(got1, map1)
    np.testing.assert_array_equal(got2, map2)
    inside = (np.abs(xs) < 32000) & (np.abs(ys) < 32000)
    decoded = decode_opencv_maps(got1, got2)
    assert np.all(np.abs(decoded[..., 0] - xs)[inside] <= 1 / 64) and np.all(np.abs(decoded[..., 1] - ys)[inside] <= 1 / 64)


@pytest.mark.parametrize("rig_name", ["nuscenes", "small_multi"])
def test_cv2_remap_with_opencv_maps_matches_the_gather_tables(rig_name: str) -> None:
    rig = rigs.nuscenes_rig() if rig_name == "nuscenes" else rigs.small_rig(distortion=True, heights=(-0.5, 0.0, 1.0), bev_half_m=20.0)
    sampling = compute_sampling_grid(rig)
    product = build_format("opencv", sampling, False)
    tables = build_gather_tables(sampling)
    w_f, h_f = rig.feature_size
    features = np.random.default_rng(5).random((rig.n_cam, 3, h_f, w_f), dtype=np.float32)
    gathered = gather_sample(features, tables.index, tables.weight)  # (C, n_cam, n_h, ny, nx)
    decoded = decode_opencv_maps(product.arrays["opencv_map1"], product.arrays["opencv_map2"])
    _, n_h, ny, nx = sampling.valid.shape
    e = product.attrs["max_error_px"]
    assert e <= 1 / 64 + 1e-5
    for cam in range(rig.n_cam):
        map1 = product.arrays["opencv_map1"][cam].reshape(n_h * ny, nx, 2)
        map2 = product.arrays["opencv_map2"][cam].reshape(n_h * ny, nx)
        for c in range(3):
            remapped = cv2.remap(features[cam, c], map1, map2, cv2.INTER_LINEAR, borderMode=cv2.BORDER_CONSTANT, borderValue=0)
            remapped = remapped.astype(np.float64).reshape(n_h, ny, nx)
            # cv2.remap samples exactly at the 1/32-px quantised positions (float32 arithmetic) ...
            at_codes = bilinear_sample_px(features[cam, c][None], decoded[cam])[0]
            assert np.abs(remapped - at_codes).max() <= 2e-6
            # ... so it differs from the exact gather tables by the quantisation only: 2 e (Lipschitz)
            assert np.abs(remapped - gathered[c, cam]).max() <= 2 * e + 2e-6
            assert np.all(remapped[~sampling.valid[cam]] == 0)  # invalid cells in-band


# --------------------------------------------------------------------------------------
# uq12, pixel_q, norm_q16 round trips and rules
# --------------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(st.floats(-1.0, 1.0))
def test_uq12_round_trip(norm: float) -> None:
    q = encode_uq12(np.array([norm, -norm]))
    assert q.dtype == np.uint16 and q.max() <= 4095
    assert np.abs(decode_uq12(q) - [norm, -norm]).max() <= 0.5 / 2047.5 + 1e-15
    assert int(q[0]) == int(np.rint(norm * 2047.5 + 2047.5))


def test_uq12_saturates_never_wraps() -> None:
    q = encode_uq12(np.array([-1e30, -1.5, -1.0, 1.0, 1.2, 1e30, np.nan]))
    assert q.tolist() == [0, 0, 0, 4095, 4095, 4095, 0]
    # the rule is round_half_even(norm * 2047.5 + 2047.5): 2047.5 -> 2048, 2048.5 -> 2048, 2049.5 -> 2050
    assert encode_uq12(np.array([0.0, 1 / 2047.5, 2 / 2047.5])).tolist() == [2048, 2048, 2050]


@settings(max_examples=200, deadline=None)
@given(u=st.floats(-2.0, 44.0), frac_bits=st.integers(0, 9))
def test_pixel_q_round_trip_within_range(u: float, frac_bits: int) -> None:
    q = encode_pixel_q(np.array([u, 0.0]), frac_bits)
    assert abs(decode_pixel_q(q, frac_bits)[0] - u) <= 2.0 ** -(frac_bits + 1)


def test_pixel_q_extremes_never_wrap() -> None:
    f = pixel_q_max_frac_bits((44, 16))
    assert f == 9  # 44 * 2**9 = 22528 <= 32767 < 44 * 2**10
    extremes = np.array([[-0.5, -0.5], [43.5 - 1e-9, 15.5 - 1e-9], [-2.0, -2.0]])
    decoded = decode_pixel_q(encode_pixel_q(extremes, f), f)
    assert np.abs(decoded - extremes).max() <= 2.0 ** -(f + 1)
    q = encode_pixel_q(np.array([[1e9, -1e9], [np.nan, 3.0]]), 4)
    assert q.tolist() == [[32767, -32768], [0, 48]]  # clamped to the rails, never wrapped


def test_convention_j5_default_frac_bits() -> None:
    # f = clamp(15 - ceil(log2(max(H_f, W_f, ny, nx) + 1)), 0, 8)
    assert j5_default_frac_bits((44, 16), (128, 128)) == 7
    assert j5_default_frac_bits((44, 16), (200, 200)) == 7
    assert j5_default_frac_bits((44, 16), (256, 256)) == 6
    assert j5_default_frac_bits((12, 8), (24, 24)) == 8  # 15 - 5 = 10, clamped to 8
    assert j5_default_frac_bits((40000, 16), (8, 8)) == 0
    assert resolve_pixel_q_frac_bits(None, (44, 16), (128, 128)) == 7
    assert resolve_pixel_q_frac_bits(9, (44, 16), (128, 128)) == 9


def test_pixel_q_frac_bits_that_cannot_hold_the_map_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match=r"--frac-bits 8 cannot hold the feature-map range \[-2, 192\] px of the 192x128 map in int16 pixel_q .*use --frac-bits <= 7"):
        resolve_pixel_q_frac_bits(8, (192, 128), (24, 24))


def test_convention_norm_q16_scale_and_in_band_invalid() -> None:
    assert norm_q16_scale((44, 16), False) == ((2 / 44 + 1) / 32767, (2 / 16 + 1) / 32767)
    assert norm_q16_scale((44, 16), True) == ((2 / 43 + 1) / 32767, (2 / 15 + 1) / 32767)
    for align_corners in (False, True):
        scale = norm_q16_scale((44, 16), align_corners)
        q = encode_norm_q16(np.array([[0.3, -0.2], [9.0, 9.0]]), np.array([True, False]), scale)
        assert q[1].tolist() == [-32768, -32768]
        px = norm_to_feature_px(decode_norm_q16(q, scale), (44, 16), align_corners)
        assert px[1, 0] < -1.0 and px[1, 1] < -1.0  # every bilinear corner outside the map
        assert samples_zero(px[1:], (44, 16)).all()


@settings(max_examples=200, deadline=None)
@given(u=st.floats(-0.5, 43.5, exclude_max=True), v=st.floats(-0.5, 15.5, exclude_max=True), align_corners=st.booleans())
def test_norm_q16_round_trip_valid_cells_never_saturate(u: float, v: float, align_corners: bool) -> None:
    scale = norm_q16_scale((44, 16), align_corners)
    norm = feature_px_to_norm(np.array([[u, v]]), (44, 16), align_corners)
    q = encode_norm_q16(norm, np.array([True]), scale)
    assert q.min() >= -32767 and q.max() <= 32767  # the sentinel -32768 is never a valid code
    px = norm_to_feature_px(decode_norm_q16(q, scale), (44, 16), align_corners)
    assert np.abs(px - [[u, v]]).max() <= 0.5 * max(22.0 * scale[0], 8.0 * scale[1]) + 1e-12


@pytest.mark.parametrize("align_corners", [False, True])
def test_norm_q16_invalid_cells_sample_exactly_zero_in_torch_float32(nuscenes: RigConfig, align_corners: bool) -> None:
    sampling = compute_sampling_grid(nuscenes)
    product = build_format("norm_q16", sampling, align_corners)
    grid = decode_norm_q16(product.arrays["norm_q16"], norm_q16_scale(nuscenes.feature_size, align_corners)).astype(np.float32)
    w_f, h_f = nuscenes.feature_size
    features = np.random.default_rng(0).random((6, 2, h_f, w_f), dtype=np.float32) + 0.5
    with torch.no_grad():
        out = torch.nn.functional.grid_sample(
            torch.from_numpy(features), torch.from_numpy(grid.reshape(6, 128, 128, 2)), align_corners=align_corners
        ).numpy()
    out = out.reshape(6, 2, 1, 128, 128)
    assert np.all(out.transpose(1, 0, 2, 3, 4)[:, ~sampling.valid] == 0.0)


# --------------------------------------------------------------------------------------
# products: measured error, saturation at the extremes, names
# --------------------------------------------------------------------------------------


def _half_step_px(name: str, feature_size: tuple[int, int], align_corners: bool, bits: int) -> float:
    """Half a quantisation step of a format in feature pixels (the coarser axis)."""
    px_per_norm = max((n - 1) / 2 if align_corners else n / 2 for n in feature_size)
    return {
        "uq12": 0.5 * px_per_norm / 2047.5,
        "norm_q16": 0.5 * px_per_norm * max(norm_q16_scale(feature_size, align_corners)),
        "pixel_q": 2.0 ** -(bits + 1),
        "opencv": 1 / 64 + 2.0**-24 * max(feature_size),
    }[name]


def _edge_grid(feature_size: tuple[int, int]) -> SamplingGrid:
    """Valid cells at the extremes of the VALID RULE and one invalid cell."""
    w_f, h_f = feature_size
    eps = 1e-9
    uv = np.array([[-0.5, -0.5], [w_f - 0.5 - eps, h_f - 0.5 - eps], [-0.5, h_f - 0.5 - eps], [w_f / 2, h_f / 2], [-2.0, -2.0]])
    valid = np.array([True, True, True, True, False])
    return SamplingGrid(uv.reshape(1, 1, 1, 5, 2), valid.reshape(1, 1, 1, 5), feature_size)


@pytest.mark.parametrize("feature_size", [(44, 16), (12, 8), (2000, 1000)])
@pytest.mark.parametrize("align_corners", [False, True])
def test_saturation_never_moves_a_valid_cell_at_the_extremes(feature_size: tuple[int, int], align_corners: bool) -> None:
    sampling = _edge_grid(feature_size)
    bits = resolve_pixel_q_frac_bits(None, feature_size, (1, 5))
    for name in EXTRA:
        product = build_format(name, sampling, align_corners, pixel_q_frac_bits=bits)
        decoded = decode_format_px(name, product.arrays, feature_size, align_corners, frac_bits=bits)
        err = np.abs(decoded - sampling.coords_feature_px)[sampling.valid].max()
        assert err == pytest.approx(product.attrs["max_error_px"])
        if name == "uq12" and align_corners:
            # under align_corners=True the format spans pixel centres 0 .. W-1 only: u < 0 and
            # u > W - 1 clamp to the border pixel centre (never wrap), counted and included in
            # the measured error
            w_f, h_f = feature_size
            assert product.attrs["saturated_valid_cells"] == 3 and err == pytest.approx(0.5)
            assert decoded[0, 0, 0, 0].tolist() == [0.0, 0.0]
            assert decoded[0, 0, 0, 1].tolist() == pytest.approx([w_f - 1, h_f - 1])
            assert decoded[0, 0, 0, 2].tolist() == pytest.approx([0.0, h_f - 1])
        else:
            assert product.attrs["saturated_valid_cells"] == 0
            assert err <= _half_step_px(name, feature_size, align_corners, bits) * (1 + 1e-9)
        if product.attrs["invalid_in_band"]:
            assert samples_zero(decoded[~sampling.valid], feature_size).all()


@pytest.mark.parametrize("rig_name", ["nuscenes", "distorted", "small_multi"])
@pytest.mark.parametrize("align_corners", [False, True])
def test_every_format_samples_within_its_recorded_error(rig_name: str, align_corners: bool) -> None:
    rig = {"nuscenes": rigs.nuscenes_rig, "distorted": rigs.distorted_rig}.get(rig_name, lambda: rigs.small_rig(distortion=True, heights=(-0.5, 0.0, 1.0), bev_half_m=20.0))()
    sampling = compute_sampling_grid(rig)
    products, bits = build_formats(sampling, FORMATS, align_corners)
    assert [p.name for p in products] == list(EXTRA) and bits == resolve_pixel_q_frac_bits(None, rig.feature_size, (rig.bev.ny, rig.bev.nx))
    w_f, h_f = rig.feature_size
    features = np.random.default_rng(4).random((rig.n_cam, 2, h_f, w_f))
    n_cam, n_h, ny, nx = sampling.valid.shape
    norm64 = feature_px_to_norm(sampling.coords_feature_px, sampling.feature_size, align_corners)
    ref = grid_sample(features, norm64.reshape(n_cam, n_h * ny, nx, 2), align_corners=align_corners)
    for product in products:
        decoded = decode_format_px(product.name, product.arrays, rig.feature_size, align_corners, frac_bits=bits)
        e = product.attrs["max_error_px"]
        assert e == pytest.approx(np.abs(decoded - sampling.coords_feature_px)[sampling.valid].max())
        got = grid_sample(features, feature_px_to_norm(decoded, rig.feature_size, align_corners).reshape(n_cam, n_h * ny, nx, 2), align_corners=align_corners)
        if not product.attrs["invalid_in_band"]:
            got = np.where(sampling.valid.reshape(n_cam, 1, n_h * ny, nx), got, 0.0)
        assert np.abs(got - ref).max() <= 2 * e + 1e-9, product.name
        assert all(np.all(np.isfinite(a)) for a in product.arrays.values())


def test_format_names() -> None:
    assert check_format_names(["pixel_q", "opencv", "norm_int16", "opencv"]) == ("opencv", "pixel_q")
    with pytest.raises(UsageError, match="unknown --format 'int8'; known formats: norm_int16, uq12, opencv, pixel_q, norm_q16"):
        check_format_names(["int8"])


def test_pixel_q_on_a_wide_feature_map_uses_fewer_bits() -> None:
    data = rigs.small_rig_data()
    data["image_aug"] = {"resize": 1.0, "crop": [0, 0], "input_size": [192, 128]}
    data["feature"]["stride"] = 1
    rig = parse_config(data, "<wide>")
    assert rig.feature_size == (192, 128)
    product = build_formats(compute_sampling_grid(rig), ["pixel_q"], False)
    assert product[1] == 7 and product[0][0].attrs["frac_bits"] == 7
    with pytest.raises(UsageError, match="--frac-bits 8 cannot hold"):
        build_formats(compute_sampling_grid(rig), ["pixel_q"], False, frac_bits=8)
