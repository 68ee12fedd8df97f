"""The conventions every product follows, stated once.

These exact sentences appear in docs/conventions.md and in every store's root attribute
``conventions``; ``tests/test_conventions.py`` pins both. Append-only: a sentence never
changes meaning; new ones are added at the end.
"""

from __future__ import annotations

CONVENTIONS: dict[str, str] = {
    "ego_frame": "Ego frame: x forward, y left, z up, metres (nuScenes ego: origin at the rear axle centre on the ground).",
    "camera_frame": "Camera frame: OpenCV, x right, y down, z along the optical axis; poses are camera -> ego: points_ego = R @ points_cam + t.",
    "bev_cells": "BEV arrays are [..., ny, nx]; cell (iy, ix) has centre (x_min + (ix + 0.5) dx, y_min + (iy + 0.5) dy); nx = round((x_max - x_min) / dx); flattened cell index = iy * nx + ix.",
    "pixel_centres": "Pixel coordinates are (u, v) = (column, row); integer values are pixel centres (OpenCV convention); grid coordinates are in FEATURE-map pixels.",
    "image_aug": "Image augmentation (BEVDet post_rot/post_tran): calibrated pixel u becomes input pixel u * resize - crop_left, v becomes v * resize - crop_top.",
    "image_pad": "Image padding (image_aug pad [right, bottom]): the last right columns and bottom rows of the network input are zeros appended after the crop; pixel coordinates are unchanged and the feature map covers the padded input.",
    "feature_stride": "pixel_mapping stride: feature pixel j covers input pixels [j*s, (j+1)*s), so input u_in sits at feature (u_in - (s - 1) / 2) / s.",
    "feature_linspace": "pixel_mapping linspace: feature pixel j sits at input j * (W_in - 1) / (W_f - 1) (BEVDet frustum).",
    "feature_corner": "pixel_mapping corner: feature pixel j sits at input j * s, so input u_in sits at feature u_in / s (intrinsics divided by the stride: Fast-BEV, M2BEV).",
    "feature_normalized": "pixel_mapping normalized: feature pixel j sits at input j * s + s / 2, so input u_in sits at feature u_in * W_f / W_in - 1/2 (input pixels divided by the input size, then grid_sample align_corners=False: BEVFormer, DETR3D, PETR).",
    "valid_rule": "A cell is valid in a camera iff its centre is in front of the camera (z_cam > 1e-6 m), inside the lens's monotonic field of view, and its nearest feature pixel exists: -0.5 <= u < W_f - 0.5 and -0.5 <= v < H_f - 0.5.",
    "invalid_cells": "Invalid cells hold coords (-2, -2), two pixels outside the map, so bilinear grid_sample with zeros padding returns exactly 0 there.",
    "grid_sample": "norm follows torch.nn.functional.grid_sample: align_corners=False norm = (2 u + 1) / W_f - 1; align_corners=True norm = 2 u / (W_f - 1) - 1; bilinear, padding_mode zeros.",
    "depth": "LSS depth bins are distances along the camera's optical axis (camera z), d_k = start + k * step for k < ceil((stop - start) / step).",
    "bev_frame": "BEV frame (bev.frame): the BEV cells, heights and z band are coordinates in the ego frame (default) or in the frame of a listed sensor (pose sensor -> ego, like a camera's); a camera's pose in it is bev_from_cam = inv(ego_from_sensor) @ ego_from_cam.",
    "feature_size_rule": "Feature map size (feature.size_rule): exact (default) W_f = W_in / s, the input divisible by s; ceil W_f = ceil(W_in / s) (strided convolutions with padding); pixel_mapping normalized places input u_in at feature u_in * W_f / W_in - 1/2 under both rules (feature pixel j at input (j + 1/2) * W_in / W_f).",
    "feature_levels": "Feature levels (feature.levels): each level has its own stride, pixel_mapping and feature map (n_cam, H_l, W_l); level 0's tables are grid/, gather/, delta/, level l's grid_l<l>/, gather_l<l>/, delta_l<l>/, each indexing its own level's features; matrix/ and the BEVPoolv2 arrays use level 0, the Fast-BEV LUT has one table per level.",
}

REGION_CONVENTIONS: dict[str, str] = {
    "region_keep": "BEV region keep: a fine cell is kept iff its centre is inside a keep polygon (BEV-frame metres, even-odd rule, half-open in y) or the keep mask is non-zero at [iy, ix]; without keep every cell is kept.",
    "region_rings": "BEV region rings: a cell's distance is max(|x_c|, |y_c|) of its centre from the BEV frame's origin; its factor is that of the last band with beyond_m < distance; an aligned f x f block is one super-cell iff all its fine cells are kept with factor >= f (a block straddling a band or the keep boundary belongs to the finer band).",
    "region_cells": "BEV region cell table: (iy, ix, size) of each kept (super-)cell, its first fine cell and side in fine cells, sorted by iy * nx + ix; its centre is (x_min + (ix + size / 2) dx, y_min + (iy + size / 2) dy).",
    "region_expand": "BEV region expand: int32 (ny * nx,); fine cell iy * nx + ix reads compact row expand[iy * nx + ix], the row of its (super-)cell, or n_kept (the zero row after the compact rows) outside the region: dense = concat(rows, 0)[expand].",
    "region_grid": "BEV region grid products: grid/, gather/ (layout bev) and delta/ replace the cell axes (ny, nx) by one kept_cell axis of length n_kept in the cell table's order (grid/cells, grid/expand = matrix/cells, matrix/expand), each (super-)cell sampled at its centre; the delta-LUT tiles each cell size's lattice into B x B blocks and gathers the kept cells with delta/cell_pos.",
    "region_interop": "BEV region interop: the interop/ arrays keep the full grid's dense fine voxel grid (nx, ny, nz); BEVPoolv2 drops every frustum point of a fine cell outside the region, the Fast-BEV LUT is -1 (n_views 0) on every voxel of such a cell and equals the full grid's LUT on every other voxel (no super-cells: inside a ring each fine voxel still reads its own pixel); PETR's per-pixel coordinates do not depend on the region.",
}
"""The conventions of a BEV region (``bev.region``): recorded in a store's root ``conventions``
only when its config has a region, so stores without one keep their bytes."""

LEVEL_GRID_CONVENTIONS: dict[str, str] = {
    "feature_level_grids": "Feature level grids (feature.levels[l].bev): level l samples its own BEV cells and heights, in bev.frame, instead of those of bev:; its grid_l<l>/, gather_l<l>/, delta_l<l>/ and its Fast-BEV LUT fastbev_lut_l<l> are laid out on that grid ([..., ny_l, nx_l]; interop/ names its axes height_l<l>, y_l<l>, x_l<l>); matrix/ and the BEVPoolv2 arrays use bev: (level 0).",
}
"""The convention of per-level BEV grids: recorded in a store's root ``conventions`` only when a
feature level has its own grid, so other stores keep their bytes."""

FLIP_CONVENTIONS: dict[str, str] = {
    "image_flip": "Image flip (image_aug flip: true): after the resize and crop the input is mirrored left-right as Fast-BEV's img_transform states it: input pixel u_in becomes W_crop - u_in (W_crop = input width - pad right; post_rot = [[-1, 0], [0, 1]] @ post_rot, post_tran = [[-1, 0], [0, 1]] @ post_tran + [W_crop, 0]) and v_in is unchanged; the mirrored image's column j holds column W_crop - 1 - j, so a point sits one input pixel right of the exact mirror, as in the model.",
}
"""The convention of ``image_aug.flip``: recorded in a store's root ``conventions`` only when a
camera flips, so other stores keep their bytes."""

