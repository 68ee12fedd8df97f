"""Float reference paths in plain numpy (no torch at runtime).

:func:`grid_sample` reproduces ``torch.nn.functional.grid_sample`` for 4-D inputs
(``mode`` bilinear or nearest, ``padding_mode`` zeros or border, both ``align_corners``),
computing in float64. ``tests/grid/test_reference.py`` checks it against PyTorch itself.
Every NPU product is measured against this function (or against PyTorch in tests).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from ..errors import UsageError


def unnormalize(coord: npt.NDArray[np.floating], size: int, align_corners: bool) -> np.ndarray:
    """PyTorch ``grid_sampler_unnormalize``: normalised -> pixel (integer = pixel centre)."""
    coord = np.asarray(coord, dtype=np.float64)
    if align_corners:
        return (coord + 1.0) / 2.0 * (size - 1)
    return ((coord + 1.0) * size - 1.0) / 2.0


def grid_sample(
    features: npt.NDArray[np.floating],
    grid_norm: npt.NDArray[np.floating],
    *,
    mode: str = "bilinear",
    padding_mode: str = "zeros",
    align_corners: bool = False,
) -> npt.NDArray[np.float64]:
    """numpy ``torch.nn.functional.grid_sample`` (4-D).

    Convention:
        features: ``(N, C, H, W)`` any float dtype.
        grid_norm: ``(N, H_out, W_out, 2)`` normalised ``(x, y)``; x indexes W, y indexes H.
        returns ``(N, C, H_out, W_out)`` float64.
        Non-finite grid values sample 0 (PyTorch would propagate NaN; the store never has them).
    """
    if mode not in ("bilinear", "nearest"):
        raise UsageError(f"grid_sample mode must be bilinear or nearest, got {mode!r}")
    if padding_mode not in ("zeros", "border"):
        raise UsageError(f"grid_sample padding_mode must be zeros or border, got {padding_mode!r}")
    feats = np.asarray(features, dtype=np.float64)
    grid = np.asarray(grid_norm, dtype=np.float64)
    n, c, h, w = feats.shape
    if grid.shape[0] != n or grid.shape[-1] != 2 or grid.ndim != 4:
        raise UsageError(f"grid shape {grid.shape} does not fit features {feats.shape}")
    x = unnormalize(grid[..., 0], w, align_corners)
    y = unnormalize(grid[..., 1], h, align_corners)
    finite = np.isfinite(x) & np.isfinite(y)
    x = np.where(finite, x, -10.0)
    y = np.where(finite, y, -10.0)
    if padding_mode == "border":
        x = np.clip(x, 0, w - 1)
        y = np.clip(y, 0, h - 1)
    flat = feats.reshape(n, c, h * w)
    batch = np.arange(n)[:, None, None]

    def gather(ix: np.ndarray, iy: np.ndarray) -> np.ndarray:
        inside = (ix >= 0) & (ix < w) & (iy >= 0) & (iy < h) & finite
        index = np.where(inside, iy * w + ix, 0)
        values = flat[batch, :, index]  # (N, Ho, Wo, C)
        return np.where(inside[..., None], values, 0.0)

    if mode == "nearest":
        ix = np.rint(x).astype(np.int64)  # nearbyint: round half to even, as PyTorch
        iy = np.rint(y).astype(np.int64)
        out = gather(ix, iy)
    else:
        x0 = np.floor(x)
        y0 = np.floor(y)
        wx1 = x - x0
        wy1 = y - y0
        wx0 = 1.0 - wx1
        wy0 = 1.0 - wy1
        ix0 = x0.astype(np.int64)
        iy0 = y0.astype(np.int64)
        out = (
            gather(ix0, iy0) * (wx0 * wy0)[..., None]
            + gather(ix0 + 1, iy0) * (wx1 * wy0)[..., None]
            + gather(ix0, iy0 + 1) * (wx0 * wy1)[..., None]
            + gather(ix0 + 1, iy0 + 1) * (wx1 * wy1)[..., None]
        )
    return np.moveaxis(out, -1, 1)


def bilinear_sample_px(
    features: npt.NDArray[np.floating], uv_px: npt.NDArray[np.floating]
) -> npt.NDArray[np.float64]:
    """Bilinear sampling at feature-pixel coordinates, zeros outside (no normalisation).

    Convention:
        features: ``(C, H, W)``; uv_px: ``(..., 2)`` ``(u, v)`` pixels, integer = centre.
        returns ``(C, ...)`` float64. Equals :func:`grid_sample` (bilinear, zeros) at the
        normalised form of ``uv_px`` under either align_corners.
    """
    feats = np.asarray(features, dtype=np.float64)
    uv = np.asarray(uv_px, dtype=np.float64)
    c, h, w = feats.shape
    x = uv[..., 0]
    y = uv[..., 1]
    finite = np.isfinite(x) & np.isfinite(y)
    x = np.where(finite, x, -10.0)
    y = np.where(finite, y, -10.0)
    x0 = np.floor(x)
    y0 = np.floor(y)
    ix0 = x0.astype(np.int64)
    iy0 = y0.astype(np.int64)
    flat = feats.reshape(c, h * w)
    out = np.zeros((c, *x.shape), dtype=np.float64)
    for dx, dy in ((0, 0), (1, 0), (0, 1), (1, 1)):
        ix = ix0 + dx
        iy = iy0 + dy
        weight = (x - x0 if dx else 1.0 - (x - x0)) * (y - y0 if dy else 1.0 - (y - y0))
        inside = (ix >= 0) & (ix < w) & (iy >= 0) & (iy < h) & finite
        index = np.where(inside, iy * w + ix, 0)
        out += np.where(inside, weight, 0.0) * flat[:, index]
    return out

