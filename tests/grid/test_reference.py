"""The numpy grid_sample reference against PyTorch itself (every mode, padding and align_corners)."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bevcompile.grid.ipm import feature_px_to_norm
from bevcompile.grid.reference import bilinear_sample_px, grid_sample


@settings(max_examples=80, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    height=st.integers(1, 9),
    width=st.integers(1, 9),
    mode=st.sampled_from(["bilinear", "nearest"]),
    padding_mode=st.sampled_from(["zeros", "border"]),
    align_corners=st.booleans(),
)
def test_numpy_grid_sample_equals_torch(
    seed: int, height: int, width: int, mode: str, padding_mode: str, align_corners: bool
) -> None:
    rng = np.random.default_rng(seed)
    features = rng.standard_normal((2, 3, height, width))
    grid = rng.uniform(-1.6, 1.6, size=(2, 5, 4, 2))
    grid[0, 0, :, :] = [[-1, -1], [1, 1], [-1, 1], [0, 0]]  # edges and centre exactly
    grid[1, 0, 0] = np.rint(grid[1, 0, 0] * 4) / 4  # half-pixel ties for nearest
    ours = grid_sample(features, grid, mode=mode, padding_mode=padding_mode, align_corners=align_corners)
    ref = torch.nn.functional.grid_sample(
        torch.from_numpy(features), torch.from_numpy(grid), mode=mode, padding_mode=padding_mode, align_corners=align_corners
    ).numpy()
    assert np.abs(ours - ref).max() < 1e-12


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), align_corners=st.booleans())
def test_pixel_space_bilinear_equals_grid_sample(seed: int, align_corners: bool) -> None:
    rng = np.random.default_rng(seed)
    features = rng.standard_normal((3, 6, 11))
    uv = rng.uniform(-2.5, 12.5, size=(7, 2))
    via_norm = grid_sample(features[None], feature_px_to_norm(uv, (11, 6), align_corners)[None, None], align_corners=align_corners)
    assert np.abs(bilinear_sample_px(features, uv) - via_norm[0, :, 0]).max() < 1e-12
