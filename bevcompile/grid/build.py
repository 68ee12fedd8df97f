"""Assemble products into store groups: the library functions behind ``bevcompile grid``.

This module glues the pure core (config dataclasses -> arrays) to the store writer. It
computes, measures and describes; it never prints.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from ..choices import canonical_choice
from ..conventions import CONVENTIONS
from ..errors import UsageError
from ..memory import refuse_beyond_memory
from ..progress import ProgressFn, start_phase
from ..rig.config import RigConfig, config_sha256
from ..rig.region import RegionTable
from ..store.plugins import level_group
from ..store.root import root_attributes
from ..store.zarr_io import GroupData, WriteReport, check_replaceable, store_path, write_groups
from .delta import (
    BASIS_TERMS,
    DEFAULT_BLOCK,
    DEFAULT_MAX_ERROR_PX,
    LUT_ARRAYS,
    DeltaEncoding,
    basis_denominator,
    check_block,
    check_escape_resolution,
    check_max_error,
    encode_delta,
    encode_region_delta,
)
from .formats import FORMATS, FormatProduct, build_formats, check_format_names, resolve_pixel_q_frac_bits
from .gather import (
    CORNER_ORDER,
    DEFAULT_LUT_FRAC_BITS,
    LUT_CODE_ORDER,
    ORDER_KEYS,
    ORDERS,
    GatherLayout,
    GatherTables,
    build_gather_tables,
    check_align,
    check_lut_frac_bits,
    check_order,
    layout_tables,
)
from .ipm import (
    INVALID_PX,
    NORM_INT16_SCALE,
    GridProducts,
    SamplingGrid,
    build_grid_products,
    compute_product_grid,
    coverage_fraction,
    grid_region,
    product_lattice_shape,
)

GRID_COMMAND_GROUPS = ("grid", "gather", "delta")
"""Groups owned (rewritten or removed) by ``bevcompile grid``."""




GRID_REGION_LAYOUT = (
    "bev.region: the cell axes (ny, nx) of every grid/, gather/ (bev layout) and delta/ array are one kept_cell axis: "
    "k < n_kept is the kept (super-)cell cells[k] = (iy, ix, size) (sorted by iy * nx + ix), sampled at its centre "
    "(x_min + (ix + size / 2) dx, y_min + (iy + size / 2) dy, heights[ih]) in the BEV frame; "
    "the dense BEV map of per-cell values is concat(values, 0)[expand] (expand = grid/expand, the same as matrix/expand)"
)
"""How a region store's grid products are laid out (``grid/``, ``gather/`` and ``delta/`` attributes ``region.layout``)."""


def grid_region_attributes(table: RegionTable) -> dict[str, Any]:
    """The ``region`` attribute of the ``grid/``, ``gather/`` and ``delta/`` groups of a ``bev.region`` build."""
    sizes, counts = np.unique(table.cells[:, 2], return_counts=True)
    return {
        "n_kept": table.n_kept,
        "n_fine_kept": table.n_fine_kept,
        "cells_by_size": {str(int(s)): int(c) for s, c in zip(sizes, counts, strict=True)},
        "bev_shape": [int(table.bev_shape[0]), int(table.bev_shape[1])],
        "layout": GRID_REGION_LAYOUT,
        "cells": "grid/cells: (n_kept, 3) int32 (iy, ix, size): first fine cell and side in fine cells",
        "expand": "grid/expand: (ny * nx,) int32: the kept cell of fine cell iy * nx + ix, n_kept (the zero row) outside the region",
    }


def _squeeze_lattice(array: np.ndarray) -> np.ndarray:
    """A region's one-row lattice ``(n_cam, n_h, 1, n_kept, ...)`` as stored: ``(n_cam, n_h, n_kept, ...)``."""
    return array.reshape(*array.shape[:2], *array.shape[3:])


def grid_group(
    products: GridProducts,
    rig: RigConfig,
    formats: Sequence[FormatProduct] = (),
    pixel_q_frac_bits: int | None = None,
    table: RegionTable | None = None,
) -> GroupData:
    """The ``grid/`` group: coords, valid, norm, norm_int16, the requested fixed-point
    ``formats`` (see :mod:`bevcompile.grid.formats`) and their attributes.

    ``build_options`` is ``{"align_corners"}`` plus, when formats are requested, ``"formats"``
    (canonical order) and, with pixel_q, ``"pixel_q_frac_bits"``: exactly what rebuilds the group.
    With a ``bev.region`` (``table``; products on the one-row lattice of
    :func:`~bevcompile.grid.ipm.compute_product_grid`) every array has one ``kept_cell`` axis
    instead of ``(y, x)`` and the group also holds ``cells`` and ``expand`` (:data:`GRID_REGION_LAYOUT`).
    """
    group = _grid_group(products, rig, formats, pixel_q_frac_bits)
    if table is None:
        return group
    arrays = {name: _squeeze_lattice(a) for name, a in group.arrays.items()}
    arrays["cells"] = table.cells
    arrays["expand"] = table.expand
    attrs = dict(group.attrs)
    attrs["shape_order"] = "(n_cam, n_heights, n_kept[, 2])"
    attrs["region"] = grid_region_attributes(table)
    chunks = {name: (1, *a.shape[1:]) for name, a in arrays.items() if name not in ("cells", "expand")}
    dims = {name: region_grid_dimension_names(name, a.ndim) for name, a in arrays.items()}
    return GroupData(arrays=arrays, attrs=attrs, chunks=chunks, dims=dims)


def region_grid_dimension_names(name: str, ndim: int) -> tuple[str, ...]:
    """``grid/`` axes of a region store: ``(camera, height, kept_cell[, uv|xy])``; ``cells``
    ``(kept_cell, cell_field)``, ``expand`` ``(cell,)`` (as in ``matrix/``)."""
    if name == "cells":
        return ("kept_cell", "cell_field")
    if name == "expand":
        return ("cell",)
    cell = ("camera", "height", "kept_cell")
    return cell if ndim == 3 else (*cell, "xy" if name.startswith("norm") else "uv")


def _grid_group(products: GridProducts, rig: RigConfig, formats: Sequence[FormatProduct], pixel_q_frac_bits: int | None) -> GroupData:
    w_f, h_f = products.feature_size
    per_cam_chunks = (1, *products.valid.shape[1:])
    attrs: dict[str, Any] = {
        "build_options": {"align_corners": products.align_corners},
        "align_corners": products.align_corners,
        "feature_size": [w_f, h_f],
        "feature_size_order": "[W_f, H_f]",
        "cameras": list(rig.camera_names),
        "heights": list(rig.bev.heights),
        "shape_order": "(n_cam, n_heights, ny, nx[, 2])",
        "component_order": "(u, v) for coords; (x, y) for norm and its encodings",
        "coords_unit": "feature-map pixels, integer = pixel centre",
        "valid_rule": CONVENTIONS["valid_rule"],
        "invalid_coords_px": [INVALID_PX, INVALID_PX],
        "norm_formula": (
            "norm = 2 u / (W_f - 1) - 1" if products.align_corners else "norm = (2 u + 1) / W_f - 1"
        ),
        "norm_int16": {
            "arrays": ["norm_int16"],
            "invalid_in_band": False,
            "dtype": "int16",
            "axis_order": "(x, y) normalised (grid_sample)",
            "encode": "q = clip(round_half_even(norm * 32767), -32767, 32767)",
            "decode": "norm = q / 32767",
            "scale": 1.0 / NORM_INT16_SCALE,
            "offset": 0.0,
            "invalid_note": "invalid cells saturate to -1.0, which samples in range: mask with grid/valid",
            "max_error_px": products.norm_int16_max_error_px,
            "saturated_valid_cells": products.norm_int16_saturated_valid_cells,
            "saturation_note": (
                "under align_corners=True, valid cells with u < 0, u > W_f - 1, v < 0 or v > H_f - 1 lie "
                "outside [-1, 1] and are clamped to the border pixel centre (up to 0.5 px); norm_q16 has headroom"
            ),
            "feature_size": [w_f, h_f],
        },
        "coverage": coverage_fraction(products.valid).round(6).tolist(),
    }
    arrays: dict[str, np.ndarray] = {
        "coords": products.coords,
        "valid": products.valid,
        "norm": products.norm,
        "norm_int16": products.norm_int16,
    }
    chunks: dict[str, tuple[int, ...]] = {
        "coords": (*per_cam_chunks, 2),
        "valid": per_cam_chunks,
        "norm": (*per_cam_chunks, 2),
        "norm_int16": (*per_cam_chunks, 2),
    }
    if formats:
        attrs["build_options"]["formats"] = [f.name for f in formats]
        if pixel_q_frac_bits is not None:
            attrs["build_options"]["pixel_q_frac_bits"] = pixel_q_frac_bits
        attrs["formats"] = ["norm_int16", *(f.name for f in formats)]
        for fmt in formats:
            attrs[fmt.name] = fmt.attrs
            for name, array in fmt.arrays.items():
                arrays[name] = array
                chunks[name] = (*per_cam_chunks, *array.shape[4:])
    return GroupData(arrays=arrays, attrs=attrs, chunks=chunks, dims={name: grid_dimension_names(name, a.ndim) for name, a in arrays.items()})


def grid_dimension_names(name: str, ndim: int) -> tuple[str, ...]:
    """``grid/`` axes: ``(camera, height, y, x)`` and a last axis ``uv`` (feature pixels) or ``xy``
    (grid_sample's normalised x, y: ``norm``, ``norm_int16``, ``norm_q16``)."""
    cell = ("camera", "height", "y", "x")
    return cell if ndim == 4 else (*cell, "xy" if name.startswith("norm") else "uv")


def group_dimension_names(group: str, name: str, ndim: int, *, region: bool) -> tuple[str, ...]:
    """The zarr ``dimension_names`` of array ``name`` (of rank ``ndim``) in ``group`` (``grid``,
    ``gather``, ``delta``; ``region``: the store's config has a ``bev.region``): what the writer
    records and ``inspect`` compares (``dimension_names_<group>`` of the plug-ins)."""
    if group == "grid":
        return region_grid_dimension_names(name, ndim) if region else grid_dimension_names(name, ndim)
    if group == "gather":
        return ("camera", "height", "kept_cell", "corner") if region and ndim == 4 else gather_dimension_names(name, ndim)
    if group == "delta":
        return {**DELTA_DIMENSION_NAMES, **(REGION_DELTA_DIMENSION_NAMES if region else {})}[name]
    raise ValueError(f"no dimension names for group {group!r}")


def gather_dimension_names(name: str, ndim: int) -> tuple[str, ...]:
    """``gather/`` axes: ``lut`` ``(level,)``; BEV layout ``(camera, height, y, x, corner)``; flat
    layout ``(row, corner)`` / ``(row,)`` (padded rows), ``perm_inverse`` ``(cell,)`` (one per cell)."""
    if name == "lut":
        return ("level",)
    if name == "perm_inverse":
        return ("cell",)
    if ndim == 5:
        return ("camera", "height", "y", "x", "corner")
    return ("row", "corner")[:ndim]


DELTA_DIMENSION_NAMES: dict[str, tuple[str, ...]] = {
    "block_slot": ("camera", "height", "block_y", "block_x"),
    "coef": ("row", "term", "uv"),
    "scale": ("row", "exponent"),
    "res8_slot": ("row",),
    "res16_slot": ("row",),
    "res8": ("res8_slab", "ly", "lx", "uv"),
    "res16": ("res16_slab", "ly", "lx", "uv"),
    "basis": ("term", "ly", "lx"),
}
"""``delta/`` axes (see :mod:`bevcompile.grid.delta`): ``row`` a row of the per-block tables."""
REGION_DELTA_DIMENSION_NAMES: dict[str, tuple[str, ...]] = {"block_slot": ("camera", "height", "block"), "cell_pos": ("kept_cell",)}
"""The ``delta/`` axes that differ with a ``bev.region``: one block axis, and each kept cell's position."""


# --------------------------------------------------------------------------------------
# NPU products of ``bevcompile grid``: formats (grid/), gather/, delta/
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GridBuildOptions:
    """Every option of ``bevcompile grid`` that shapes the arrays.

    ``frac_bits`` is ``--frac-bits``: the gather LUT's fractional bits (default 8) AND pixel_q's
    (default: the J5 rule). ``npu`` writes ``gather/`` and ``delta/`` (the CLI always does).
    """

    align_corners: bool = False
    formats: tuple[str, ...] = ()
    frac_bits: int | None = None
    align: int = 1
    order: str = "row"
    block: int = DEFAULT_BLOCK
    max_error_px: float = DEFAULT_MAX_ERROR_PX
    npu: bool = True

    def validated(self) -> GridBuildOptions:
        """Checked and normalised copy (formats canonical, without norm_int16); UsageError."""
        if not isinstance(self.align_corners, bool):
            raise UsageError(f"align_corners must be a boolean, got {self.align_corners!r}")
        frac_bits = None if self.frac_bits is None else check_lut_frac_bits(self.frac_bits)
        return replace(
            self,
            formats=check_format_names(self.formats),
            frac_bits=frac_bits,
            align=check_align(self.align),
            order=check_order(self.order),
            block=check_block(self.block),
            max_error_px=check_max_error(self.max_error_px),
        )

    @property
    def lut_frac_bits(self) -> int:
        return DEFAULT_LUT_FRAC_BITS if self.frac_bits is None else self.frac_bits

    def run_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of :func:`run_grid` that build with these options."""
        return {
            "align_corners": self.align_corners,
            "npu": self.npu,
            "formats": tuple(self.formats),
            "frac_bits": self.frac_bits,
            "align": self.align,
            "order": self.order,
            "block": self.block,
            "max_error_px": self.max_error_px,
        }

    def recorded_build_options(self, rig: RigConfig) -> dict[str, dict[str, Any]]:
        """The ``build_options`` attribute each group of a build of ``rig`` with these (validated)
        options records, by group (``grid``, and with ``npu`` ``gather`` and ``delta``): what a
        store must hold to be this build (``bevcompile fleet --resume``). Pinned against real
        builds by ``tests/grid/test_build.py``."""
        grid: dict[str, Any] = {"align_corners": self.align_corners}
        if self.formats:
            grid["formats"] = list(self.formats)
            if "pixel_q" in self.formats:
                grid["pixel_q_frac_bits"] = resolve_pixel_q_frac_bits(self.frac_bits, rig.feature_size, (rig.bev.ny, rig.bev.nx))
        out = {"grid": grid}
        if self.npu:
            out["gather"] = {"frac_bits": self.lut_frac_bits, "align": self.align, "order": self.order}
            out["delta"] = {"block": self.block, "max_error_px": self.max_error_px}
        return out


def grid_command_options(*, formats: Sequence[str] = (), order: str = "row", **options: Any) -> GridBuildOptions:
    """The options of ``bevcompile grid`` as a user gives them (the keyword arguments of
    :class:`GridBuildOptions`; enumerated values in any case, :func:`~bevcompile.choices.canonical_choice`),
    with the NPU products the command always writes: what the CLI and a fleet manifest's ``grid:`` product
    both pass to :func:`run_grid` (through :meth:`GridBuildOptions.run_kwargs`). Not validated here
    (:meth:`GridBuildOptions.validated`)."""
    return GridBuildOptions(
        formats=tuple(canonical_choice(name, FORMATS) for name in formats), order=canonical_choice(order, ORDERS), npu=True, **options
    )


@dataclass
class GridCommandBuild:
    """Everything ``bevcompile grid`` computed: products, store groups and summary figures."""

    sampling: SamplingGrid
    products: GridProducts
    formats: list[FormatProduct]
    pixel_q_frac_bits: int | None
    gather: GatherTables | None
    layout: GatherLayout | None
    delta: DeltaEncoding | None
    groups: dict[str, GroupData]
    summary: dict[str, Any]


def grid_command_groups(rig: RigConfig) -> tuple[str, ...]:
    """Every group ``bevcompile grid`` owns for ``rig``: :data:`GRID_COMMAND_GROUPS` at every
    feature level (``grid``, ``gather``, ``delta``, then ``grid_l1``, ... for ``feature.levels``)."""
    return tuple(level_group(base, level) for level in range(rig.n_levels) for base in GRID_COMMAND_GROUPS)


def build_grid_command(
    rig: RigConfig,
    options: GridBuildOptions,
    *,
    progress: ProgressFn | None = None,
    sampling: SamplingGrid | None = None,
) -> GridCommandBuild:
    """Pure: compute every group ``bevcompile grid`` writes (no I/O), at every feature level.

    Level 0 gives ``grid/``, ``gather/``, ``delta/`` and the build's products and summary; level
    ``l >= 1`` of ``feature.levels`` gives ``grid_l<l>/``, ``gather_l<l>/``, ``delta_l<l>/``, each
    the single-level build of :meth:`RigConfig.level` (its own feature map; ``summary["levels"]``
    lists every level). Options that depend on the rig (pixel_q range, delta escape resolution)
    are checked for every level before any grid is computed. ``sampling`` may pass a precomputed
    float64 grid of level 0.
    """
    options = options.validated()
    levels = [rig.level(index) for index in range(rig.n_levels)]
    for level_rig in levels:
        _check_level_options(level_rig, options)
    built = _build_level(levels[0], options, progress, sampling)
    if len(levels) == 1:
        return built
    summaries = [_level_summary(0, levels[0], built)]
    for index, level_rig in enumerate(levels[1:], start=1):
        other = _build_level(level_rig, options, progress, None)
        built.groups.update({level_group(name, index): group for name, group in other.groups.items()})
        summaries.append(_level_summary(index, level_rig, other))
    built.summary["levels"] = summaries
    return built


def _level_summary(index: int, level_rig: RigConfig, built: GridCommandBuild) -> dict[str, Any]:
    w_f, h_f = level_rig.feature_size
    valid = built.products.valid
    return {
        "level": index,
        "groups": [level_group(name, index) for name in built.groups],
        "stride": level_rig.feature.stride,
        "pixel_mapping": level_rig.feature.pixel_mapping,
        "feature_size": [w_f, h_f],
        "coverage": float(valid.any(axis=0).mean()) if valid.size else 0.0,
    }


def _check_level_options(rig: RigConfig, options: GridBuildOptions) -> None:
    bev_shape = (rig.bev.ny, rig.bev.nx)
    if "pixel_q" in options.formats:
        resolve_pixel_q_frac_bits(options.frac_bits, rig.feature_size, bev_shape)
    if options.npu:
        check_escape_resolution(rig.feature_size, options.max_error_px)


def _build_level(
    rig: RigConfig, options: GridBuildOptions, progress: ProgressFn | None, sampling: SamplingGrid | None
) -> GridCommandBuild:
    """The groups of one single-level rig (``rig.level(i)``), named ``grid``, ``gather``, ``delta``."""
    table = grid_region(rig.bev)
    if sampling is None:
        sampling = compute_product_grid(rig, progress=progress)
    start_phase(progress, "fixed-point formats")
    products = build_grid_products(sampling, options.align_corners)
    formats, pixel_q_bits = build_formats(
        sampling, options.formats, options.align_corners, frac_bits=options.frac_bits, bev_shape=(rig.bev.ny, rig.bev.nx)
    )
    groups = {"grid": grid_group(products, rig, formats, pixel_q_bits, table)}
    summary: dict[str, Any] = {"formats": _format_summary(products, formats), "gather": None, "delta": None}
    if table is not None:
        summary["region"] = grid_region_attributes(table)
    tables = layout = encoding = None
    if options.npu:
        start_phase(progress, "gather tables")
        tables = build_gather_tables(sampling, options.lut_frac_bits)
        layout = layout_tables(tables, sampling.coords_feature_px, align=options.align, order=options.order)
        groups["gather"] = gather_group(tables, layout, rig, table)
        start_phase(progress, "delta-LUT")
        if table is None:
            encoding = encode_delta(
                sampling.coords_feature_px, sampling.valid, sampling.feature_size, block=options.block, max_error_px=options.max_error_px
            )
        else:
            encoding = encode_region_delta(
                sampling.coords_feature_px[:, :, 0], sampling.valid[:, :, 0], sampling.feature_size, table.cells, table.bev_shape,
                block=options.block, max_error_px=options.max_error_px,
            )
        groups["delta"] = delta_group(encoding, rig, table)
        summary["gather"] = _gather_summary(groups["gather"].attrs)
        summary["delta"] = _delta_summary(groups["delta"].attrs)
    return GridCommandBuild(sampling, products, formats, pixel_q_bits, tables, layout, encoding, groups, summary)


def build_grid_command_groups(rig: RigConfig, options: GridBuildOptions) -> dict[str, GroupData]:
    """The store groups of ``bevcompile grid`` for ``rig`` and ``options`` (pure)."""
    return build_grid_command(rig, options).groups


def gather_group(tables: GatherTables, layout: GatherLayout, rig: RigConfig, table: RegionTable | None = None) -> GroupData:
    """The ``gather/`` group (index, weight, weight_u8, lut [, cell_valid, perm, perm_inverse]).

    With a ``bev.region`` (``table``) a cell is a kept (super-)cell: the bev layout is
    ``(n_cam, n_heights, n_kept, 4)``, flat rows ``(cam * n_heights + ih) * n_kept + k``
    (:data:`GRID_REGION_LAYOUT`; ``cells`` / ``expand`` live in ``grid/``)."""
    group = _gather_group(tables, layout, rig)
    if table is None:
        return group
    arrays = {name: _squeeze_lattice(a) if name in ("index", "weight", "weight_u8") and layout.layout == "bev" else a for name, a in group.arrays.items()}
    attrs = dict(group.attrs)
    n_h = len(rig.bev.heights)
    attrs["logical_shape"] = [rig.n_cam, n_h, table.n_kept]
    if layout.layout == "bev":
        attrs["table_shape"] = "(n_cam, n_heights, n_kept, 4)"
    else:
        attrs["flat_cell_formula"] = "flat = (cam * n_heights + ih) * n_kept + k (k: the kept cell, grid/cells order)"
    attrs["region"] = grid_region_attributes(table)
    dims = {name: group_dimension_names("gather", name, a.ndim, region=True) for name, a in arrays.items()}
    return GroupData(arrays=arrays, attrs=attrs, dims=dims)


def _gather_group(tables: GatherTables, layout: GatherLayout, rig: RigConfig) -> GroupData:
    w_f, h_f = tables.feature_size
    n_h, ny, nx = len(rig.bev.heights), rig.bev.ny, rig.bev.nx
    levels = 1 << tables.frac_bits
    arrays: dict[str, np.ndarray] = {
        "index": layout.index,
        "weight": layout.weight,
        "weight_u8": layout.weight_u8,
        "lut": tables.lut,
    }
    if layout.cell_valid is not None:
        arrays["cell_valid"] = layout.cell_valid
    if layout.perm is not None and layout.perm_inverse is not None:
        arrays["perm"] = layout.perm
        arrays["perm_inverse"] = layout.perm_inverse
    table_shape = "(n_cam, n_heights, ny, nx, 4)" if layout.layout == "bev" else "(n_cells_padded, 4)"
    attrs: dict[str, Any] = {
        "build_options": {"frac_bits": tables.frac_bits, "align": layout.align, "order": layout.order},
        "layout": layout.layout,
        "table_shape": table_shape,
        "logical_shape": [rig.n_cam, n_h, ny, nx],
        "n_cells": layout.n_cells,
        "n_cells_padded": layout.n_cells_padded,
        "align": layout.align,
        "order": layout.order,
        "feature_size": [w_f, h_f],
        "stacked_feature_size": rig.n_cam * h_f * w_f,
        "corner_order": list(CORNER_ORDER),
        "corner_formula": "u0 = floor(u), u1 = u0 + 1, v0 = floor(v), v1 = v0 + 1; (u, v) feature pixels, integer = pixel centre",
        "index_formula": "index = cam * H_f * W_f + v * W_f + u (flat into features of shape (n_cam, H_f, W_f) per channel)",
        "weight_formula": "a_u = u - u0, a_v = v - v0; weights ((1-a_u)(1-a_v), a_u(1-a_v), (1-a_u)a_v, a_u a_v) in float64, stored float32",
        "sample_formula": "out[c, cell] = sum_k weight[cell, k] * features.transpose(1, 0, 2, 3).reshape(C, -1)[c, index[cell, k]]",
        "equivalent_to": "torch.nn.functional.grid_sample(features, grid/norm, mode='bilinear', padding_mode='zeros', align_corners=grid.align_corners)",
        "out_of_map_corners": "weight 0; u/v clamped into the map (index always in range)",
        "invalid_cells": "weight 0 on all 4 corners; index cam * H_f * W_f",
        "lut": {
            "frac_bits": tables.frac_bits,
            "levels": levels,
            "table": f"lut[c] = c / {levels - 1} (float32, shape ({levels},))",
            "code_order": list(LUT_CODE_ORDER),
            "quantise": f"q = round_half_even(a * {levels - 1}); code_u1 = q_u, code_u0 = {levels - 1} - q_u (same for v); out-of-map side and invalid cell: 0",
            "reconstruct": "w(v_j, u_i) = lut[code_v_j] * lut[code_u_i]",
        },
        **tables.figures,
        "mean_index_jump_row_order": layout.jump_row_order,
        "mean_index_jump_gather_order": layout.jump_gather_order,
        "mean_index_jump_definition": "mean |index[k+1, 0] - index[k, 0]| over consecutive valid rows in gather order",
        "band_switches_row_order": layout.band_switches_row_order,
        "band_switches_gather_order": layout.band_switches_gather_order,
        "band_switches_definition": "number of consecutive valid rows (gather order) whose 8-row feature band (cam, floor(v0) // 8) differs",
    }
    if layout.layout != "bev":
        attrs["flat_cell_formula"] = "flat = ((cam * n_heights + ih) * ny + iy) * nx + ix"
        attrs["padding_rows"] = "rows k >= n_cells: index 0, weight 0, weight_u8 0, cell_valid False" + (", perm 0" if layout.perm is not None else "")
        attrs["cell_valid"] = "cell_valid[k] = row k holds a real cell that is valid (grid/valid); False on padding rows"
    if layout.perm is not None:
        attrs["perm"] = "row k holds flat cell perm[k] (k < n_cells); perm_inverse[flat cell] = its row (length n_cells)"
        attrs["order_key"] = ORDER_KEYS[layout.order]
    return GroupData(arrays=arrays, attrs=attrs, dims={name: gather_dimension_names(name, a.ndim) for name, a in arrays.items()})


REGION_DELTA_DECODE = (
    "each cell size s present (increasing) has its lattice of (ny / s) x (nx / s) s-cells tiled into B x B blocks (row-major, edge padded); "
    "block b of block_slot[cam, ih, b] decodes like a full-grid block into positions b * B * B + ly * B + lx; "
    "kept cell k (grid/cells order) reads position cell_pos[k] (one Gather); lattice cells that are no kept cell are don't-care"
)


def delta_group(encoding: DeltaEncoding, rig: RigConfig, table: RegionTable | None = None) -> GroupData:
    """The ``delta/`` group (every array the decoder reads; see :mod:`bevcompile.grid.delta`).

    With a ``bev.region`` (``table``; :func:`~bevcompile.grid.delta.encode_region_delta`)
    ``block_slot`` is ``(n_cam, n_heights, n_blocks)`` over the kept cells folded into rows of B
    (:data:`REGION_DELTA_DECODE`)."""
    group = _delta_group(encoding, rig)
    if table is None:
        return group
    arrays = dict(group.arrays)
    arrays["block_slot"] = arrays["block_slot"].reshape(*arrays["block_slot"].shape[:2], -1)
    attrs = dict(group.attrs)
    attrs["logical_shape"] = [rig.n_cam, len(rig.bev.heights), table.n_kept]
    attrs["block_grid"] = [int(arrays["block_slot"].shape[2])]
    attrs["decode"] = f"{REGION_DELTA_DECODE}: {attrs['decode']}"
    attrs["region"] = grid_region_attributes(table)
    dims = {name: group_dimension_names("delta", name, array.ndim, region=True) for name, array in arrays.items()}
    attrs["on_device_arrays"] = [*LUT_ARRAYS, "cell_pos"]
    return GroupData(arrays=arrays, attrs=attrs, dims=dims)


def _delta_group(encoding: DeltaEncoding, rig: RigConfig) -> GroupData:
    lut = encoding.lut
    w_f, h_f = rig.feature_size
    n_cam, n_h, ny, nx = lut.logical_shape
    attrs: dict[str, Any] = {
        "build_options": {"block": lut.block, "max_error_px": encoding.max_error_bound_px},
        "block": lut.block,
        "block_grid": [int(lut.block_slot.shape[2]), int(lut.block_slot.shape[3])],
        "logical_shape": [n_cam, n_h, ny, nx],
        "feature_size": [w_f, h_f],
        "component_order": "(u, v) feature pixels, integer = pixel centre",
        "escape_frac_bits": lut.escape_frac_bits,
        "basis_terms": list(BASIS_TERMS),
        "basis_formula": f"tx = (2 lx - (B - 1)) / {basis_denominator(lut.block)}, ty = (2 ly - (B - 1)) / {basis_denominator(lut.block)}; basis[j, ly, lx]",
        "decode": (
            "k = block_slot[cam, ih, iy // B, ix // B]; (ly, lx) = (iy % B, ix % B); "
            "coords[c] = scale[k, 0] * sum_j coef[k, j, c] * basis[j, ly, lx] + scale[k, 1] * res8[res8_slot[k], ly, lx, c] "
            f"+ 2**-{lut.escape_frac_bits} * res16[res16_slot[k], ly, lx, c]"
        ),
        "row_0": "empty block: decodes every cell to (-2, -2)",
        "invalid_in_band": True,
        "invalid_rule": "invalid cells decode off the map: u <= -1.5 or u >= W_f + 0.5 or v <= -1.5 or v >= H_f + 0.5 (grid_sample zeros padding reads exactly 0); no valid bitmap is loaded",
        "max_error_bound_px": encoding.max_error_bound_px,
        "max_error_px": encoding.max_error_px,
        "max_error_px_float32_decode": encoding.max_error_px_float32,
        "error_definition": "max over valid cells and both axes of |decode - coords| in feature pixels (float64 grid)",
        "n_blocks": encoding.n_blocks,
        "n_active_blocks": encoding.n_active,
        "n_predictor_only": encoding.n_predictor_only,
        "n_residual": encoding.n_residual,
        "n_escape": encoding.n_escape,
        "on_device_arrays": list(LUT_ARRAYS),
        "on_device_bytes": encoding.on_device_bytes,
        "on_device_bytes_total": encoding.on_device_total,
        "norm_int16_bytes": encoding.norm_int16_bytes,
        "ratio_vs_norm_int16": encoding.ratio,
    }
    return GroupData(arrays=lut.arrays(), attrs=attrs, dims=dict(DELTA_DIMENSION_NAMES))


def _format_summary(products: GridProducts, formats: Sequence[FormatProduct]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = [
        {
            "name": "norm_int16",
            "arrays": ["grid/norm_int16"],
            "max_error_px": products.norm_int16_max_error_px,
            "invalid_in_band": False,
            "saturated_valid_cells": products.norm_int16_saturated_valid_cells,
        }
    ]
    for fmt in formats:
        rows.append(
            {
                "name": fmt.name,
                "arrays": [f"grid/{a}" for a in fmt.arrays],
                "max_error_px": fmt.max_error_px,
                "invalid_in_band": bool(fmt.attrs["invalid_in_band"]),
                "saturated_valid_cells": int(fmt.attrs["saturated_valid_cells"]),
                **({"frac_bits": fmt.attrs["frac_bits"]} if "frac_bits" in fmt.attrs else {}),
            }
        )
    return rows


def _gather_summary(attrs: dict[str, Any]) -> dict[str, Any]:
    keys = (
        "layout", "n_cells", "n_cells_padded", "align", "order", "weight_float32_max_error",
        "gather_max_sample_error_unit_features", "lut_max_weight_error", "lut_max_sample_error_unit_features",
        "mean_index_jump_row_order", "mean_index_jump_gather_order", "band_switches_row_order", "band_switches_gather_order",
    )
    return {"frac_bits": attrs["lut"]["frac_bits"], "lut_levels": attrs["lut"]["levels"], **{k: attrs[k] for k in keys}}


def _delta_summary(attrs: dict[str, Any]) -> dict[str, Any]:
    keys = (
        "block", "max_error_bound_px", "max_error_px", "n_blocks", "n_active_blocks", "n_predictor_only", "n_residual",
        "n_escape", "on_device_bytes_total", "norm_int16_bytes", "ratio_vs_norm_int16",
    )
    return {k: attrs[k] for k in keys}


@dataclass
class CameraSummary:
    name: str
    coverage: list[float]  # per height, fraction of BEV cells valid
    u_range: tuple[float, float] | None
    v_range: tuple[float, float] | None


@dataclass
class GridRunResult:
    rig: RigConfig
    store: Path
    products: GridProducts
    cameras: list[CameraSummary]
    write: WriteReport
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "store": str(self.store),
            "name": self.rig.name,
            "config_sha256": config_sha256(self.rig),
            "align_corners": self.products.align_corners,
            "feature_size": list(self.products.feature_size),
            "bev_shape": [len(self.rig.bev.heights), self.rig.bev.ny, self.rig.bev.nx],
            "heights": list(self.rig.bev.heights),
            "norm_int16_max_error_px": self.products.norm_int16_max_error_px,
            "cameras": [
                {
                    "name": c.name,
                    "coverage": c.coverage,
                    "u_range": list(c.u_range) if c.u_range else None,
                    "v_range": list(c.v_range) if c.v_range else None,
                }
                for c in self.cameras
            ],
            "bytes_written": self.write.bytes_per_array,
            "bytes_total": self.write.total_bytes,
            **self.extra,
        }


def summarise_cameras(rig: RigConfig, products: GridProducts) -> list[CameraSummary]:
    out = []
    coverage = coverage_fraction(products.valid)
    for cam_index, camera in enumerate(rig.cameras):
        valid = products.valid[cam_index]
        coords = products.coords[cam_index][valid]
        u_range: tuple[float, float] | None = None
        v_range: tuple[float, float] | None = None
        if coords.size:
            u_range = (float(coords[:, 0].min()), float(coords[:, 0].max()))
            v_range = (float(coords[:, 1].min()), float(coords[:, 1].max()))
        out.append(CameraSummary(camera.name, [float(c) for c in coverage[cam_index]], u_range, v_range))
    return out


GRID_BYTES_PER_SAMPLE = 336
"""Peak memory of ``bevcompile grid`` per sample (camera x height x BEV cell), whole process
(``ru_maxrss``), never under the measured peak: 74 MB at 60 k samples, 237 MB at 0.96 M, 853 MB at
3.84 M (nuScenes 100/400/800 cells a side, bevcompile 0.2, tests/grid/test_build.py re-measures
two sizes), and 316 B/sample at 24 M (2000 x 2000: the size at which 256 B was 22 % under)."""
GRID_BYTES_BASE = 96 * 2**20
"""The interpreter, numpy, zarr and the tool before the first array (74 MB measured at 60 k samples)."""




def check_grid_memory(rig: RigConfig, what: str = "bevcompile grid", block: int | None = None) -> None:
    """Refuse, before any work, a rig whose grid cannot fit in this machine's memory.

    The config limit (10^8 BEV cells) is about the format; this is about the machine: a grid
    within it can still need far more memory than there is, and the kernel would kill the
    process (no error message, no cleanup). Estimate: ``64 MiB + 256 B`` per sample, where the
    delta-LUT's ``block`` (when given) pads ny and nx up to multiples of itself: its temporaries
    scale with the padded grid (measured ~225 B per padded sample, 257 x 257 at ``--block 256``).
    """
    samples = total_grid_cells(rig)
    padding = ""
    if block is not None and block > 0:
        padded_ny = -(-rig.bev.ny // block) * block
        padded_nx = -(-rig.bev.nx // block) * block
        padded = sum(
            rig.n_cam * len(level.bev.heights) * (-(-level.bev.ny // block) * block) * (-(-level.bev.nx // block) * block)
            for level in (rig.level(i) for i in range(rig.n_levels))
        )
        if padded > samples:
            samples = padded
            padding = f" (padded to {padded_ny} x {padded_nx} by --block {block})"
    grids = (
        f"{rig.n_levels} feature levels of their own grids ({rig.bev.ny} x {rig.bev.nx} cells at level 0)"
        if rig.has_level_grids
        else (f"{rig.n_levels} feature levels x " if rig.n_levels > 1 else "") + f"{rig.n_cam} cameras x {len(rig.bev.heights)} heights x {rig.bev.ny} x {rig.bev.nx} cells"
    )
    refuse_beyond_memory(
        GRID_BYTES_BASE + GRID_BYTES_PER_SAMPLE * samples,
        f"{rig.source}: {what} of {grids}{padding} = {samples:,} samples",
        "use coarser bev steps or fewer heights" + (" or a smaller --block" if padding else ""),
    )






def run_grid(
    rig: RigConfig,
    out_dir: str | Path,
    *,
    align_corners: bool = False,
    force: bool = False,
    progress: ProgressFn | None = None,
    npu: bool = True,
    formats: Sequence[str] = (),
    frac_bits: int | None = None,
    align: int = 1,
    order: str = "row",
    block: int = DEFAULT_BLOCK,
    max_error_px: float = DEFAULT_MAX_ERROR_PX,
) -> GridRunResult:
    """Compute the IPM grid of ``rig`` and write the ``grid/`` group into
    ``<out_dir>/<name>.zarr`` (atomically; see :func:`bevcompile.store.zarr_io.write_groups`).

    ``formats`` adds fixed-point formats to ``grid/``. ``npu=True`` (what ``bevcompile grid``
    always does) also writes ``gather/`` and ``delta/`` (see :func:`build_grid_command`).
    Every group of :func:`grid_command_groups` not written is removed from an existing store,
    so a store never holds NPU tables of an older build. Options are validated before any
    work (:class:`~bevcompile.errors.UsageError`).
    """
    options = GridBuildOptions(
        align_corners=align_corners,
        formats=tuple(formats),
        frac_bits=frac_bits,
        align=align,
        order=order,
        block=block,
        max_error_px=max_error_px,
        npu=npu,
    ).validated()
    check_grid_memory(rig, block=options.block if options.npu else None)
    path = store_path(out_dir, rig.name)
    attrs = root_attributes(rig)
    check_replaceable(path, attrs["config_sha256"], force=force)  # refuse before the build, not after
    start_phase(progress, "projecting BEV cells", product_grid_samples(rig), "samples")  # after the guard: a region's cell table costs time
    built = build_grid_command(rig, options, progress=progress)
    start_phase(progress, f"writing {path.name}")
    report = write_groups(
        path,
        root_attrs=attrs,
        groups=built.groups,
        force=force,
        replace_groups=grid_command_groups(rig),
    )
    extra = dict(built.summary)
    extra["arrays"] = {
        f"{group}/{name}": {"shape": list(array.shape), "dtype": str(array.dtype)}
        for group, data in built.groups.items()
        for name, array in data.arrays.items()
    }
    return GridRunResult(rig, path, built.products, summarise_cameras(rig, built.products), report, extra=extra)


def total_grid_cells(rig: RigConfig) -> int:
    """Samples of ``bevcompile grid``: camera x height x BEV cell, at every feature level (each
    level on its own grid when ``feature.levels[l].bev`` gives one)."""
    levels = [rig.level(i).bev for i in range(rig.n_levels)]
    return sum(rig.n_cam * len(bev.heights) * bev.ny * bev.nx for bev in levels)


def product_grid_samples(rig: RigConfig) -> int:
    """Samples ``bevcompile grid`` projects (its progress total): :func:`total_grid_cells`, or with
    a ``bev.region`` camera x height x kept (super-)cell at every feature level."""
    total = 0
    for bev in (rig.level(i).bev for i in range(rig.n_levels)):
        lattice = product_lattice_shape(bev)
        total += rig.n_cam * len(bev.heights) * lattice[0] * lattice[1]
    return total


def as_float_list(values: np.ndarray) -> list[float]:
    return [float(v) for v in np.asarray(values).ravel()]
