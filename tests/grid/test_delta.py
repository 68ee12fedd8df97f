"""Block-wise delta-LUT codec: size targets, error bound, in-band invalid cells, decoders."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bevcompile.errors import UsageError
from bevcompile.grid.delta import LUT_ARRAYS, DeltaLUT, decode_delta, delta_basis, encode_delta, escape_frac_bits
from bevcompile.grid.formats import off_map_margin, samples_zero
from bevcompile.grid.ipm import compute_sampling_grid, feature_px_to_norm
from bevcompile.rig.config import RigConfig, load_config

from ..rigs import ROOT

FIELD_REPORT_RATIO = 18 / 156  # "156 KB -> 18 KB" on a 200x200 grid


def _check_encoding(coords: np.ndarray, valid: np.ndarray, feature_size: tuple[int, int], block: int, max_error: float) -> None:
    enc = encode_delta(coords, valid, feature_size, block=block, max_error_px=max_error)
    decoded = decode_delta(enc.lut)
    assert decoded.shape == coords.shape and np.all(np.isfinite(decoded))
    err = np.abs(decoded - coords)[valid]
    measured = float(err.max()) if err.size else 0.0
    assert measured <= max_error
    assert enc.max_error_px == measured
    assert np.all(off_map_margin(decoded[~valid], feature_size)) and enc.invalid_not_off_map == 0
    assert np.all(samples_zero(decoded[~valid], feature_size))
    assert enc.n_predictor_only + enc.n_residual + enc.n_escape == enc.n_active
    assert enc.on_device_total == sum(getattr(enc.lut, n).nbytes for n in LUT_ARRAYS)
    again = encode_delta(coords, valid, feature_size, block=block, max_error_px=max_error)
    for name in LUT_ARRAYS:  # deterministic, bit for bit
        assert np.array_equal(getattr(again.lut, name), getattr(enc.lut, name))


def test_nuscenes_meets_the_size_target(nuscenes: RigConfig) -> None:
    sampling = compute_sampling_grid(nuscenes)
    enc = encode_delta(sampling.coords_feature_px, sampling.valid, sampling.feature_size)
    assert enc.norm_int16_bytes == 6 * 128 * 128 * 2 * 2
    assert enc.ratio <= 0.20, enc.ratio  # measured 0.0926 (36404 B vs 393216 B)
    assert enc.max_error_px <= 1 / 16 and enc.max_error_px_float32 <= 1 / 16 + 1e-5
    assert enc.invalid_not_off_map == 0
    _check_encoding(sampling.coords_feature_px, sampling.valid, sampling.feature_size, 10, 1 / 16)


def test_200x200_config_beats_the_field_report() -> None:
    rig = load_config(ROOT / "configs" / "nuscenes_200x200.yaml")
    assert (rig.bev.ny, rig.bev.nx) == (200, 200)
    sampling = compute_sampling_grid(rig)
    enc = encode_delta(sampling.coords_feature_px, sampling.valid, sampling.feature_size)
    assert enc.norm_int16_bytes == 6 * 200 * 200 * 4
    assert enc.ratio < FIELD_REPORT_RATIO, enc.ratio  # measured 0.0624 (59928 B vs 960000 B)
    assert enc.max_error_px <= 1 / 16


def test_convention_delta_basis_and_empty_row() -> None:
    basis = delta_basis(10)
    t = np.array([-9, -7, -5, -3, -1, 1, 3, 5, 7, 9]) / 16  # (2 l - (B - 1)) / D, D = 16
    np.testing.assert_array_equal(basis[0], np.ones((10, 10)))
    np.testing.assert_array_equal(basis[1], np.broadcast_to(t[None, :], (10, 10)))  # tx varies along lx (last axis)
    np.testing.assert_array_equal(basis[2], np.broadcast_to(t[:, None], (10, 10)))
    np.testing.assert_array_equal(basis[4], t[:, None] * t[None, :])
    assert delta_basis(1).tolist() == [[[1.0]], [[0.0]], [[0.0]], [[0.0]], [[0.0]], [[0.0]]]
    coords = np.full((1, 1, 3, 3, 2), np.nan)
    enc = encode_delta(coords, np.zeros((1, 1, 3, 3), dtype=bool), (12, 8), block=2)
    assert enc.n_active == 0 and enc.lut.coef.shape[0] == 1
    assert decode_delta(enc.lut).tolist() == np.full((1, 1, 3, 3, 2), -2.0).tolist()  # row 0: (-2, -2)


def _reference_decode(lut: DeltaLUT) -> np.ndarray:
    """Straight from the documented formula, one cell at a time (independent of decode_delta)."""
    n_cam, n_h, ny, nx = lut.logical_shape
    b = lut.block
    out = np.empty((n_cam, n_h, ny, nx, 2))
    for cam in range(n_cam):
        for ih in range(n_h):
            for iy in range(ny):
                for ix in range(nx):
                    k = int(lut.block_slot[cam, ih, iy // b, ix // b])
                    ly, lx = iy % b, ix % b
                    for c in range(2):
                        pred = sum(int(lut.coef[k, j, c]) * float(lut.basis[j, ly, lx]) for j in range(6))
                        out[cam, ih, iy, ix, c] = (
                            float(lut.scale[k, 0]) * pred
                            + float(lut.scale[k, 1]) * int(lut.res8[lut.res8_slot[k], ly, lx, c])
                            + 2.0**-lut.escape_frac_bits * int(lut.res16[lut.res16_slot[k], ly, lx, c])
                        )
    return out


def test_decoder_matches_the_documented_formula(small_distorted_multi: RigConfig) -> None:
    sampling = compute_sampling_grid(small_distorted_multi)
    enc = encode_delta(sampling.coords_feature_px[:2], sampling.valid[:2], sampling.feature_size, block=7)
    assert enc.n_residual > 0 and enc.n_predictor_only > 0
    np.testing.assert_array_equal(decode_delta(enc.lut), _reference_decode(enc.lut))


def _torch_decode(lut: DeltaLUT) -> torch.Tensor:
    """The NPU graph: Gather rows by block id, Gather slabs, MatMul, Mul, Add, Reshape/Permute."""
    b = lut.block
    slot = torch.from_numpy(lut.block_slot.astype(np.int64)).reshape(-1)
    coef = torch.from_numpy(lut.coef.astype(np.float32))[slot]  # (nb, 6, 2)
    scale = torch.from_numpy(lut.scale.astype(np.float32))[slot]  # (nb, 2)
    basis = torch.from_numpy(lut.basis).reshape(6, b * b)
    pred = torch.matmul(coef.transpose(1, 2), basis).transpose(1, 2)  # (nb, B*B, 2)
    r8 = torch.from_numpy(lut.res8.astype(np.float32)).reshape(-1, b * b, 2)[torch.from_numpy(lut.res8_slot.astype(np.int64))[slot]]
    r16 = torch.from_numpy(lut.res16.astype(np.float32)).reshape(-1, b * b, 2)[torch.from_numpy(lut.res16_slot.astype(np.int64))[slot]]
    coords = pred * scale[:, None, 0:1] + r8 * scale[:, None, 1:2] + r16 * 2.0**-lut.escape_frac_bits
    n_cam, n_h, ny, nx = lut.logical_shape
    nby, nbx = lut.block_slot.shape[2:]
    grid = coords.reshape(n_cam, n_h, nby, nbx, b, b, 2).permute(0, 1, 2, 4, 3, 5, 6).reshape(n_cam, n_h, nby * b, nbx * b, 2)
    return grid[:, :, :ny, :nx]


@pytest.mark.parametrize("align_corners", [False, True])
def test_torch_decoder_and_grid_sample_within_the_bound(nuscenes: RigConfig, align_corners: bool) -> None:
    sampling = compute_sampling_grid(nuscenes)
    enc = encode_delta(sampling.coords_feature_px, sampling.valid, sampling.feature_size)
    decoded_torch = _torch_decode(enc.lut).numpy().astype(np.float64)
    assert np.abs(decoded_torch - decode_delta(enc.lut)).max() <= 1e-5  # float32 device arithmetic
    w_f, h_f = nuscenes.feature_size
    features = torch.from_numpy(np.random.default_rng(9).random((6, 4, h_f, w_f), dtype=np.float32))

    def sample(coords: np.ndarray) -> np.ndarray:
        norm = feature_px_to_norm(coords, nuscenes.feature_size, align_corners).reshape(6, 128, 128, 2)
        with torch.no_grad():
            return torch.nn.functional.grid_sample(features.double(), torch.from_numpy(norm), align_corners=align_corners).numpy()

    got = sample(decoded_torch)
    ref = sample(sampling.coords_feature_px)  # invalid cells hold (-2, -2): exactly 0
    assert np.abs(got - ref).max() <= 2 * enc.max_error_px + 1e-5
    assert np.all(got.reshape(6, 4, 1, 128, 128).transpose(1, 0, 2, 3, 4)[:, ~sampling.valid] == 0)


@st.composite
def adversarial_grids(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, tuple[int, int], int, float]:
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    n_cam, n_h = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    ny, nx = draw(st.integers(1, 23)), draw(st.integers(1, 23))
    feature_size = draw(st.sampled_from([(12, 8), (44, 16), (300, 200)]))
    block = draw(st.sampled_from([1, 2, 3, 5, 10, 16]))
    max_error = draw(st.sampled_from([1 / 16, 1 / 4, 0.01]))
    kind = draw(st.sampled_from(["smooth", "steep", "mixed", "edge"]))
    w_f, h_f = feature_size
    iy, ix = np.meshgrid(np.arange(ny), np.arange(nx), indexing="ij")
    shape = (n_cam, n_h, ny, nx)
    coords = np.empty((*shape, 2))
    if kind in ("smooth", "mixed"):
        # a perspective-like map with random scale: gentle to very steep gradients
        gain = 10 ** rng.uniform(-2, 1.5)
        depth = 1.0 + 0.05 * iy + 0.03 * ix
        coords[..., 0] = w_f / 2 + gain * (ix - nx / 2) / depth
        coords[..., 1] = h_f / 2 + gain * (iy - ny / 2) / depth
    if kind in ("steep", "mixed"):
        noise = np.stack([rng.uniform(-1, w_f, shape), rng.uniform(-1, h_f, shape)], axis=-1)
        pick = rng.random(shape) < (1.0 if kind == "steep" else 0.2)
        coords = np.where(pick[..., None], noise, coords) if kind == "mixed" else noise
    if kind == "edge":  # every valid cell on the border of the extended map
        coords[..., 0] = rng.choice([-1.0, -0.5, w_f - 0.5, float(w_f)], shape)
        coords[..., 1] = rng.choice([-1.0, -0.5, h_f - 0.5, float(h_f)], shape)
    inside = (coords[..., 0] >= -1) & (coords[..., 0] <= w_f) & (coords[..., 1] >= -1) & (coords[..., 1] <= h_f)
    valid = inside & (rng.random(shape) < draw(st.sampled_from([0.0, 0.3, 0.9, 1.0])))
    # all-invalid blocks: wipe a random rectangle
    y0, x0 = rng.integers(0, ny), rng.integers(0, nx)
    valid[..., y0 : y0 + block, x0 : x0 + block] = False
    # invalid cells may hold anything: huge-but-finite values, NaN
    junk = rng.choice([1e300, -1e300, np.nan, 3.0, -2.0], (*shape, 2))
    coords = np.where(valid[..., None], coords, junk)
    return coords, valid, feature_size, block, max_error


@settings(max_examples=60, deadline=None)
@given(adversarial_grids())
def test_delta_round_trip_on_adversarial_grids(case: tuple[np.ndarray, np.ndarray, tuple[int, int], int, float]) -> None:
    _check_encoding(*case)


def test_steep_blocks_use_the_escape_form_and_still_meet_the_bound() -> None:
    rng = np.random.default_rng(0)
    coords = np.stack([rng.uniform(-0.5, 43.5, (1, 1, 20, 20)), rng.uniform(-0.5, 15.5, (1, 1, 20, 20))], axis=-1)
    valid = np.ones((1, 1, 20, 20), dtype=bool)
    enc = encode_delta(coords, valid, (44, 16), block=10, max_error_px=1 / 16)
    assert enc.n_escape == 4 and enc.max_error_px <= 2.0 ** -(escape_frac_bits((44, 16)) + 1)
    _check_encoding(coords, valid, (44, 16), 10, 1 / 16)
    # single-cell blocks: every valid cell is its own (predictor-only) block
    single = encode_delta(coords, valid, (44, 16), block=1)
    assert single.n_active == 400 and single.n_escape == 0 and single.max_error_px <= 1 / 16


def test_delta_usage_errors() -> None:
    coords = np.zeros((1, 1, 2, 2, 2))
    valid = np.ones((1, 1, 2, 2), dtype=bool)
    with pytest.raises(UsageError, match=r"--block must be an integer in \[1, 256\], got 0"):
        encode_delta(coords, valid, (12, 8), block=0)
    for bad in (0.0, -1.0, float("nan"), 2.0):
        with pytest.raises(UsageError, match=r"--max-error-px must be in \(0, 1\] feature pixels"):
            encode_delta(coords, valid, (12, 8), max_error_px=bad)
    with pytest.raises(UsageError, match=r"--max-error-px 1e-05 is below the escape form's resolution 2\*\*-10 px for a 44x16 feature map"):
        encode_delta(coords, valid, (44, 16), max_error_px=1e-5)
    far = coords.copy()
    far[0, 0, 1, 0] = (1e300, 3.0)
    with pytest.raises(UsageError, match=r"delta: valid cell \(0, 0, 1, 0\) has coords \[1e\+300, 3.0\], outside the extended map \[-1, 12\] x \[-1, 8\] px"):
        encode_delta(far, valid, (12, 8))
    with pytest.raises(UsageError, match="coords must be"):
        encode_delta(coords[0], valid[0], (12, 8))


def test_region_delta_decodes_every_kept_cell_within_the_bound_and_puts_invalid_ones_off_the_map() -> None:
    """A region's delta-LUT (blocks on each cell size's lattice, then one Gather of cell_pos)
    decodes the kept cells' float64 coords within max_error_px (measured here, not read from the
    encoding), invalid kept cells off the map; cell_pos is the documented position formula; a
    smooth synthetic field stays predictor-only/residual (no escape) although its cells are sparse."""
    import numpy as np

    from bevcompile.grid.delta import decode_delta, encode_region_delta
    from bevcompile.grid.formats import off_map_margin
    from bevcompile.rig.region import build_table

    ny = nx = 32
    yy, xx = np.mgrid[0:ny, 0:nx]
    kept = (np.abs(xx - 15.5) < 9) & (np.abs(yy - 15.5) < 14)
    factors = np.where(np.maximum(np.abs(xx - 15.5), np.abs(yy - 15.5)) > 8, 2, 1)
    table = build_table(kept, factors)
    cells = table.cells
    size = cells[:, 2].astype(np.float64)
    cx, cy = cells[:, 1] + size / 2, cells[:, 0] + size / 2
    u = 3.0 + 0.9 * cx + 0.004 * cx * cy
    v = 2.0 + 0.5 * cy + 0.002 * cx * cx
    coords = np.stack([u, v], axis=-1)[None, None]  # (1, 1, n_kept, 2)
    valid = np.ones(coords.shape[:-1], dtype=bool)
    valid[0, 0, ::7] = False
    coords = np.where(valid[..., None], coords, -2.0)
    enc = encode_region_delta(coords, valid, (64, 48), cells, (ny, nx), block=4, max_error_px=1 / 16)
    decoded = decode_delta(enc.lut)[:, :, 0]
    assert decoded.shape == coords.shape
    assert np.abs(decoded - coords)[valid].max() <= 1 / 16
    assert off_map_margin(decoded[~valid], (64, 48)).all()
    smooth = encode_region_delta(np.stack([u, v], axis=-1)[None, None], np.ones_like(valid), (64, 48), cells, (ny, nx), block=4, max_error_px=1 / 16)
    assert smooth.n_escape == 0 and smooth.max_error_px <= 1 / 16
    # cell_pos: sizes increasing, each size's lattice of 4 x 4 blocks row-major
    pos = np.asarray(enc.lut.cell_pos, dtype=np.int64)
    fine = cells[:, 2] == 1
    by, ly = np.divmod(cells[fine, 0], 4)
    bx, lx = np.divmod(cells[fine, 1], 4)
    assert np.array_equal(pos[fine], ((by * 8 + bx) * 4 + ly) * 4 + lx)
    coarse = ~fine
    by, ly = np.divmod(cells[coarse, 0] // 2, 4)
    bx, lx = np.divmod(cells[coarse, 1] // 2, 4)
    assert np.array_equal(pos[coarse], ((64 + by * 4 + bx) * 4 + ly) * 4 + lx)
    assert enc.norm_int16_bytes == cells.shape[0] * 4
