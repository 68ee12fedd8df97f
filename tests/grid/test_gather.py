"""Static gather tables: equivalence with torch grid_sample, conventions, LUT, layouts."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bevcompile.errors import UsageError
from bevcompile.grid.gather import (
    CORNER_ORDER,
    band_switches,
    bilinear_corners,
    build_gather_tables,
    gather_sample,
    layout_name,
    layout_tables,
    lut_table,
    lut_weights,
    mean_index_jump,
    order_permutation,
    quantise_lut_codes,
    worst_case_sample_error,
)
from bevcompile.grid.ipm import SamplingGrid, build_grid_products, compute_sampling_grid, feature_px_to_norm
from bevcompile.grid.reference import grid_sample
from bevcompile.rig.config import RigConfig

from .. import rigs

RIGS = {
    "nuscenes": rigs.nuscenes_rig,
    "distorted": rigs.distorted_rig,
    "small_multi": lambda: rigs.small_rig(distortion=True, heights=(-0.5, 0.0, 1.0), bev_half_m=20.0),
}


def _torch_grid_sample(features: np.ndarray, grid: np.ndarray, align_corners: bool, dtype: torch.dtype) -> np.ndarray:
    with torch.no_grad():
        out = torch.nn.functional.grid_sample(
            torch.from_numpy(np.asarray(features)).to(dtype),
            torch.from_numpy(np.asarray(grid)).to(dtype),
            mode="bilinear",
            padding_mode="zeros",
            align_corners=align_corners,
        )
    return out.numpy().astype(np.float64)


def _stacked_reference(features: np.ndarray, norm: np.ndarray, align_corners: bool, dtype: torch.dtype) -> np.ndarray:
    """torch grid_sample per camera, returned as (C, n_cam, n_h, ny, nx)."""
    n_cam, n_h, ny, nx, _ = norm.shape
    out = _torch_grid_sample(features, norm.reshape(n_cam, n_h * ny, nx, 2), align_corners, dtype)
    return out.reshape(n_cam, -1, n_h, ny, nx).transpose(1, 0, 2, 3, 4)


@pytest.mark.parametrize("rig_name", list(RIGS))
@pytest.mark.parametrize("align_corners", [False, True])
def test_gather_equals_torch_grid_sample(rig_name: str, align_corners: bool) -> None:
    rig = RIGS[rig_name]()
    sampling = compute_sampling_grid(rig)
    tables = build_gather_tables(sampling)
    w_f, h_f = rig.feature_size
    features = np.random.default_rng(3).random((rig.n_cam, 5, h_f, w_f), dtype=np.float32)
    got = gather_sample(features, tables.index, tables.weight)

    # (1) the float64 grid: torch in float64 on the exact norm -> 1e-6 relative
    norm64 = feature_px_to_norm(sampling.coords_feature_px, sampling.feature_size, align_corners)
    ref64 = _stacked_reference(features, norm64, align_corners, torch.float64)
    rel = np.abs(got - ref64).max() / max(1.0, np.abs(ref64).max())
    assert rel <= 1e-6, rel
    assert np.all(ref64[:, ~sampling.valid] == 0) and np.all(got[:, ~sampling.valid] == 0)

    # (2) the stored float32 grid/norm, torch float32: differs only by float32 rounding of
    # norm (<= 2^-25 (W_f + H_f) px per the Lipschitz bound) and torch's float32 arithmetic
    products = build_grid_products(sampling, align_corners)
    ref32 = _stacked_reference(features, products.norm, align_corners, torch.float32)
    bound = 2.0**-25 * (w_f + h_f) + 4e-6
    assert np.abs(got - ref32).max() <= bound


@pytest.mark.parametrize("align_corners", [False, True])
def test_gather_equals_numpy_reference_on_small_rigs(small_distorted_multi: RigConfig, align_corners: bool) -> None:
    sampling = compute_sampling_grid(small_distorted_multi)
    tables = build_gather_tables(sampling)
    w_f, h_f = small_distorted_multi.feature_size
    features = np.random.default_rng(0).random((small_distorted_multi.n_cam, 3, h_f, w_f))
    norm = feature_px_to_norm(sampling.coords_feature_px, sampling.feature_size, align_corners)
    n_cam, n_h, ny, nx, _ = norm.shape
    ref = grid_sample(features, norm.reshape(n_cam, n_h * ny, nx, 2), align_corners=align_corners)
    ref = ref.reshape(n_cam, 3, n_h, ny, nx).transpose(1, 0, 2, 3, 4)
    assert np.abs(gather_sample(features, tables.index, tables.weight) - ref).max() < 3e-7
    assert 0 < sampling.valid.mean() < 1  # partial coverage: both kinds of cells exercised


def _one_cell_grid(uv: tuple[float, float], valid: bool, cam: int = 1, feature_size: tuple[int, int] = (6, 4)) -> SamplingGrid:
    coords = np.full((2, 1, 1, 1, 2), -2.0)
    coords[cam, 0, 0, 0] = uv
    ok = np.zeros((2, 1, 1, 1), dtype=bool)
    ok[cam, 0, 0, 0] = valid
    coords[~ok] = -2.0
    return SamplingGrid(coords, ok, feature_size)


def test_convention_corner_order_and_flat_index() -> None:
    w_f, h_f = 6, 4
    tables = build_gather_tables(_one_cell_grid((1.25, 2.5), True))
    base = 1 * h_f * w_f
    assert CORNER_ORDER == ("v0u0", "v0u1", "v1u0", "v1u1")
    assert tables.index[1, 0, 0, 0].tolist() == [base + 2 * w_f + 1, base + 2 * w_f + 2, base + 3 * w_f + 1, base + 3 * w_f + 2]
    np.testing.assert_array_equal(tables.weight[1, 0, 0, 0], np.array([0.375, 0.125, 0.375, 0.125], dtype=np.float32))
    # the other camera's (invalid) cell: weight 0, index = that camera's base (0)
    assert tables.index[0, 0, 0, 0].tolist() == [0, 0, 0, 0]
    assert tables.weight[0, 0, 0, 0].tolist() == [0.0, 0.0, 0.0, 0.0]


def test_convention_out_of_map_corners_weight_zero_index_clamped() -> None:
    w_f, h_f = 6, 4
    # valid cell left of the first column centre and below the last row centre
    tables = build_gather_tables(_one_cell_grid((-0.25, 3.25), True))
    base = h_f * w_f
    # corners (v0=3,u0=-1) out, (3, 0) in, (v1=4, *) out
    assert tables.index[1, 0, 0, 0].tolist() == [base + 3 * w_f + 0, base + 3 * w_f + 0, base + 3 * w_f + 0, base + 3 * w_f + 0]
    np.testing.assert_allclose(tables.weight[1, 0, 0, 0], [0.0, 0.75 * 0.75, 0.0, 0.0])
    assert tables.index.min() >= 0 and tables.index.max() < 2 * h_f * w_f


@settings(max_examples=150, deadline=None)
@given(
    u=st.floats(-1e30, 1e30, allow_nan=False),
    v=st.floats(-1e30, 1e30, allow_nan=False),
    valid=st.booleans(),
)
def test_tables_never_fault_whatever_the_coordinates(u: float, v: float, valid: bool) -> None:
    tables = build_gather_tables(_one_cell_grid((u, v), valid))
    assert tables.index.min() >= 0 and tables.index.max() < 2 * 4 * 6
    w = tables.weight.astype(np.float64)
    assert np.all(np.isfinite(w)) and np.all((w >= 0) & (w <= 1)) and w.sum() <= 1 + 1e-6
    if not (-1 < u < 6 and -1 < v < 4) or not valid:
        # nothing is sampled: float weights and LUT-reconstructed weights are exactly 0
        assert w.sum() == 0 and lut_weights(tables.weight_u8, tables.lut).sum() == 0
    if not valid:
        assert tables.weight_u8.sum() == 0


@settings(max_examples=150, deadline=None)
@given(
    u=st.floats(-0.5, 5.5, exclude_max=True),
    v=st.floats(-0.5, 3.5, exclude_max=True),
    frac_bits=st.integers(1, 8),
)
def test_lut_round_trip(u: float, v: float, frac_bits: int) -> None:
    sampling = _one_cell_grid((u, v), True)
    tables = build_gather_tables(sampling, frac_bits)
    levels = 1 << frac_bits
    _, weight64, _, inside = bilinear_corners(sampling.coords_feature_px, sampling.valid, sampling.feature_size)
    recon = lut_weights(tables.weight_u8, tables.lut)
    # per-axis error <= 1 / (2 (L - 1)); a product of two such weights <= 1 / (L - 1)
    assert np.abs(recon - weight64).max() <= 1.0 / (levels - 1) + 1e-7
    assert np.all(recon[~inside] == 0)  # masked corners are exactly 0
    assert tables.weight_u8.max() < levels
    assert len(tables.lut) == levels and tables.lut[0] == 0.0 and tables.lut[-1] == 1.0


def test_convention_lut_codes_formula_and_exact_pixel_centres() -> None:
    frac = np.array([[0.0, 0.5], [0.25, 0.999]])
    inside = np.ones((2, 4), dtype=bool)
    codes = quantise_lut_codes(frac, inside, 8)
    # q = round_half_even(a * 255): 0 -> 0, 0.5 -> 128 (127.5 rounds to even), 0.25 -> 64, 0.999 -> 255
    assert codes.tolist() == [[255, 0, 127, 128], [191, 64, 0, 255]]
    np.testing.assert_array_equal(lut_table(2), np.array([0, 1 / 3, 2 / 3, 1], dtype=np.float32))
    # a_u = 0 (on a pixel column): the u weights are exactly (1, 0)
    recon = lut_weights(codes[:1], lut_table(8))[0]
    assert recon[1] == 0.0 and recon[3] == 0.0
    np.testing.assert_allclose(recon[[0, 2]], [127 / 255, 128 / 255], rtol=1e-7)
    with pytest.raises(UsageError, match=r"--frac-bits must be in \[1, 8\]"):
        lut_table(9)
    with pytest.raises(UsageError, match=r"--frac-bits must be in \[1, 8\]"):
        build_gather_tables(_one_cell_grid((1.0, 1.0), True), 0)


def test_lut_worst_case_sample_error_bounds_random_features(nuscenes: RigConfig) -> None:
    sampling = compute_sampling_grid(nuscenes)
    tables = build_gather_tables(sampling)
    _, weight64, _, _ = bilinear_corners(sampling.coords_feature_px, sampling.valid, sampling.feature_size)
    recon = lut_weights(tables.weight_u8, tables.lut)
    bound = worst_case_sample_error(recon, weight64)
    assert 0 < bound <= 1 / 255
    w_f, h_f = nuscenes.feature_size
    features = np.random.default_rng(1).random((nuscenes.n_cam, 4, h_f, w_f))
    diff = np.abs(gather_sample(features, tables.index, recon) - gather_sample(features, tables.index, weight64))
    assert diff.max() <= bound + 1e-12
    # the worst case is attained by the adversarial feature map (1 where the error is positive)
    cell = np.unravel_index(np.argmax(np.maximum(np.clip(recon - weight64, 0, None).sum(-1), np.clip(weight64 - recon, 0, None).sum(-1))), recon.shape[:-1])
    assert worst_case_sample_error(recon[cell][None], weight64[cell][None]) == pytest.approx(bound)


def test_convention_flat_layout_padding_and_row_order(small_distorted_multi: RigConfig) -> None:
    sampling = compute_sampling_grid(small_distorted_multi)
    tables = build_gather_tables(sampling)
    n_cells = sampling.valid.size
    layout = layout_tables(tables, sampling.coords_feature_px, align=7)
    n_pad = -(-n_cells // 7) * 7
    assert layout.layout == "flat" and n_pad > n_cells
    assert layout.index.shape == (n_pad, 4) and layout.n_cells == n_cells and layout.n_cells_padded == n_pad
    assert layout.cell_valid is not None and layout.perm is None
    # flat = ((cam * n_h + ih) * ny + iy) * nx + ix
    _n_cam, n_h, ny, nx = sampling.valid.shape
    cam, ih, iy, ix = 2, 1, 5, 7
    flat = ((cam * n_h + ih) * ny + iy) * nx + ix
    np.testing.assert_array_equal(layout.index[flat], tables.index[cam, ih, iy, ix])
    np.testing.assert_array_equal(layout.cell_valid[:n_cells], sampling.valid.reshape(-1))
    assert not layout.cell_valid[n_cells:].any()
    assert np.all(layout.index[n_cells:] == 0) and np.all(layout.weight[n_cells:] == 0) and np.all(layout.weight_u8[n_cells:] == 0)
    # align 1 + row order keeps the shape
    assert layout_tables(tables, sampling.coords_feature_px).index.shape == (*sampling.valid.shape, 4)


@pytest.mark.parametrize("order", ["cache", "feature"])
def test_permuted_order_permutes_and_samples_the_same(small_distorted_multi: RigConfig, order: str) -> None:
    sampling = compute_sampling_grid(small_distorted_multi)
    tables = build_gather_tables(sampling)
    row = layout_tables(tables, sampling.coords_feature_px, align=32)
    permuted = layout_tables(tables, sampling.coords_feature_px, align=32, order=order)
    assert permuted.layout == f"flat_{order}" == layout_name(32, order)
    assert permuted.perm is not None and permuted.perm_inverse is not None
    n = permuted.n_cells
    assert sorted(permuted.perm[:n].tolist()) == list(range(n)) and np.all(permuted.perm[n:] == 0)
    np.testing.assert_array_equal(permuted.perm[:n][permuted.perm_inverse], np.arange(n))
    w_f, h_f = small_distorted_multi.feature_size
    features = np.random.default_rng(2).random((small_distorted_multi.n_cam, 2, h_f, w_f))
    out_row = gather_sample(features, row.index, row.weight)[:, :n]
    out_permuted = gather_sample(features, permuted.index, permuted.weight)[:, permuted.perm_inverse]
    np.testing.assert_array_equal(out_row, out_permuted)
    # both keys: valid rows first, and (cam, floor(v) // 8) never decreases along them
    assert permuted.cell_valid is not None and row.cell_valid is not None
    valid_rows = permuted.cell_valid
    assert not np.any(valid_rows[1:n] & ~valid_rows[: n - 1])
    first = permuted.index[valid_rows, 0].astype(np.int64)
    cam, within = np.divmod(first, w_f * h_f)
    band = cam * 100 + (within // w_f) // 8
    assert np.all(np.diff(band) >= 0)
    assert permuted.band_switches_gather_order == len(np.unique(band)) - 1 <= row.band_switches_row_order
    assert permuted.jump_row_order == pytest.approx(mean_index_jump(row.index, row.cell_valid))
    assert band_switches(permuted.index, permuted.cell_valid, (w_f, h_f)) == permuted.band_switches_gather_order
    if order == "feature":
        # the first corner's feature address ascends: the gather reads memory monotonically
        assert np.all(np.diff(first) >= 0)
        assert permuted.jump_gather_order == pytest.approx(np.abs(np.diff(first)).mean())
        assert permuted.jump_gather_order < permuted.jump_row_order
    else:
        # inside a band: floor(u) never decreases, and floor(v) sweeps down even columns, up odd ones
        v0, u0 = np.divmod(within, w_f)
        key = np.stack([cam, v0 // 8, u0, np.where(u0 % 2 == 0, v0, -v0)], axis=1)
        order_of_rows = np.lexsort(key.T[::-1])
        np.testing.assert_array_equal(key[order_of_rows], key)


@pytest.mark.parametrize("order", ["cache", "feature"])
def test_order_permutation_is_deterministic_with_ties(order: str) -> None:
    coords = np.zeros((1, 1, 2, 3, 2))
    valid = np.ones((1, 1, 2, 3), dtype=bool)
    valid[0, 0, 0, 1] = False
    perm = order_permutation(coords, valid, (4, 3), order)
    # all valid cells tie on every key: flat order among them, the invalid cell last
    assert perm.tolist() == [0, 2, 3, 4, 5, 1]


def test_order_keys_by_hand() -> None:
    # one camera, one height, one BEV row of 5 cells; (u, v) in feature pixels
    # in a 5 x 14 feature map; the last cell's corner is clamped from (-1, -1) to (0, 0)
    coords = np.array([[[[[3.5, 9.2], [0.2, 1.7], [1.9, 1.1], [1.1, 6.0], [0.7, 12.4], [-0.3, -0.4]]]]])
    valid = np.ones((1, 1, 1, 6), dtype=bool)
    # feature: by (v0, u0) = (9,3) (1,0) (1,1) (6,1) (12,0) (0,0)
    assert order_permutation(coords, valid, (5, 14), "feature").tolist() == [5, 1, 2, 3, 0, 4]
    # cache: band v0 // 8 = 1 0 0 0 1 0; then u0; column 1 (odd) sweeps v0 descending
    assert order_permutation(coords, valid, (5, 14), "cache").tolist() == [5, 1, 3, 2, 4, 0]


def test_layout_option_errors(small: RigConfig) -> None:
    sampling = compute_sampling_grid(small)
    tables = build_gather_tables(sampling)
    with pytest.raises(UsageError, match=r"--align must be an integer in \[1, 1048576\], got 0"):
        layout_tables(tables, sampling.coords_feature_px, align=0)
    with pytest.raises(UsageError, match="--order must be one of row, cache, feature, got 'zigzag'"):
        layout_tables(tables, sampling.coords_feature_px, order="zigzag")
