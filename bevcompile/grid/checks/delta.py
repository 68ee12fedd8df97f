"""Plug-in of ``inspect`` / ``verify`` / ``--strict`` for ``delta/`` (the block-wise delta-LUT).

Pure: arrays and dataclasses in, :class:`~bevcompile.store.plugins.Check` /
:class:`~bevcompile.store.plugins.VerifyRow` / arrays out. Every figure is recomputed from the
arrays and the float64 projection of the stored config; attributes are only compared with the
recomputation. The verify bounds are stated in :mod:`bevcompile.grid.checks._common`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ...rig.config import RigConfig
from ...store.plugins import REBUILT_ATTRS, Check, CheckContext, VerifyRow, same_recorded
from ..build import group_dimension_names
from ..delta import (
    LUT_ARRAYS,
    N_TERMS,
    DeltaLUT,
    check_block,
    check_max_error,
    decode_delta,
    delta_basis,
    encode_delta,
    encode_region_delta,
    escape_frac_bits,
    region_cell_positions,
)
from ..formats import (
    off_map_margin,
)
from ..ipm import compute_product_grid, grid_region
from ..reference import bilinear_sample_px
from ._common import (
    ATTR_RTOL,
    BOUND_SLACK,
    FEATURE_PEAK,
    _agrees,
    _Bad,
    _cells,
    _expect,
    _guard,
    _max_abs_err,
    _options,
    _recorded_float,
    _row,
    region_plugin,
    region_rebuild,
)

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
    table = grid_region(rig.bev)
    cell_pos = None
    if table is None:
        block_slot = _expect(arrays, "delta", "block_slot", (n_cam, n_h, nby, nbx), ints)
    else:  # bev.region: blocks over each cell size's lattice, then one Gather of cell_pos
        want_pos, lattices = region_cell_positions(table.cells, table.bev_shape, block)
        n_blocks = sum(b_y * b_x for _, b_y, b_x in lattices)
        block_slot = _expect(arrays, "delta", "block_slot", (n_cam, n_h, n_blocks), ints).reshape(n_cam, n_h, n_blocks, 1)
        cell_pos = _expect(arrays, "delta", "cell_pos", (table.n_kept,), ("int32",))
        if not np.array_equal(cell_pos, want_pos):
            raise _Bad("delta/cell_pos differs from the positions grid/cells and the block give (the kept cells' lattice blocks)")
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
    extra = sorted(set(arrays) - set(LUT_ARRAYS) - ({"cell_pos"} if table is not None else set()))
    if extra:
        raise _Bad(f"arrays not produced by these build_options: {', '.join(extra)}")
    lut = DeltaLUT(block_slot, coef, scale, res8_slot, res16_slot, res8, res16, basis, block, cells, f16, cell_pos)
    return lut, bound


def dimension_names_delta(name: str, ndim: int, attrs: Mapping[str, Any]) -> tuple[str, ...] | None:
    """The ``dimension_names`` the writer gives ``delta/<name>`` (None: no such array; the
    contract check reports it)."""
    try:
        return group_dimension_names("delta", name, ndim, region="region" in attrs)
    except KeyError:
        return None


@region_plugin("delta")
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
    region = lut.cell_pos is not None  # a region's lattice (1, n_kept), recorded as (n_cam, n_h, n_kept) and n_blocks
    want = {
        "block": lut.block,
        "block_grid": [int(lut.block_slot.shape[2])] if region else [-(-ny // lut.block), -(-nx // lut.block)],
        "logical_shape": [n_cam, n_h, nx] if region else [n_cam, n_h, ny, nx],
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
    nbytes = sum(int(getattr(lut, name).nbytes) for name in lut.array_names)
    rec_total = attrs.get("on_device_bytes_total")
    norm16 = int(np.prod(lut.logical_shape)) * 4
    rec_ratio = attrs.get("ratio_vs_norm_int16")
    ok = rec_total == nbytes and attrs.get("norm_int16_bytes") == norm16 and isinstance(rec_ratio, int | float) and _agrees(float(rec_ratio), nbytes / norm16)
    checks.append(Check("on_device_size", "delta/", ok, f"on-device bytes {nbytes} (recorded {rec_total!r}) = {nbytes / norm16:.4f} of norm_int16 {norm16} (recorded ratio {rec_ratio!r})"))
    return checks


@region_plugin("delta")
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


@region_rebuild
def rebuild_delta(rig: RigConfig, attrs: Mapping[str, Any]) -> dict[str, Any]:
    """Recompute ``delta/`` from ``build_options`` (block, max_error_px)."""
    from ..build import delta_group

    block, bound = _delta_options(attrs)
    sampling = compute_product_grid(rig)
    table = grid_region(rig.bev)
    if table is None:
        encoding = encode_delta(sampling.coords_feature_px, sampling.valid, sampling.feature_size, block=block, max_error_px=bound)
    else:
        encoding = encode_region_delta(
            sampling.coords_feature_px[:, :, 0], sampling.valid[:, :, 0], sampling.feature_size, table.cells, table.bev_shape, block=block, max_error_px=bound
        )
    group = delta_group(encoding, rig, table)
    return {**group.arrays, REBUILT_ATTRS: group.attrs}


