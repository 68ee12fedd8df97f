"""The NPU plug-in of inspect / verify / --strict: passes on honest groups, catches tampering."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bevcompile.grid.build import GridBuildOptions, build_grid_command, run_grid
from bevcompile.grid.checks import delta as delta_checks
from bevcompile.grid.checks import formats as format_checks
from bevcompile.grid.checks import gather as gather_checks
from bevcompile.grid.delta import decode_delta
from bevcompile.grid.ipm import compute_sampling_grid
from bevcompile.rig.config import RigConfig
from bevcompile.store.inspection import inspect_store, json_attrs
from bevcompile.store.plugins import REBUILT_ATTRS, CheckContext
from bevcompile.store.verify import make_features, verify_store

from .. import rigs
from ..cli import assert_strict_and_verify_pass

ALL_FORMATS = ("uq12", "opencv", "pixel_q", "norm_q16")
PLUGIN = {"grid": format_checks, "gather": gather_checks, "delta": delta_checks}  # group -> its NPU plug-in module


def _rig() -> RigConfig:
    return rigs.small_rig(distortion=True, heights=(-0.5, 0.0, 1.0), bev_half_m=20.0)


@pytest.fixture(scope="module")
def built() -> dict[str, Any]:
    rig = _rig()
    options = GridBuildOptions(formats=ALL_FORMATS, align=7, order="cache", block=6)
    groups = build_grid_command(rig, options).groups
    return {"rig": rig, "groups": groups}


def _ctx(built: dict[str, Any], grid_arrays: dict[str, np.ndarray] | None = None) -> CheckContext:
    rig = built["rig"]
    features, _ = make_features(rig, 3, 0)
    grid = built["groups"]["grid"]
    return CheckContext(
        rig=rig,
        store_path="<memory>",
        root_attrs={},
        grid_arrays=grid.arrays if grid_arrays is None else grid_arrays,
        grid_attrs=grid.attrs,
        features=features,
    )


def _run_checks(built: dict[str, Any], group: str, arrays: dict[str, np.ndarray] | None = None, attrs: dict[str, Any] | None = None) -> list[Any]:
    data = built["groups"][group]
    fn = getattr(PLUGIN[group], f"check_{group}")
    return list(fn(_ctx(built), data.arrays if arrays is None else arrays, data.attrs if attrs is None else attrs))


@pytest.mark.parametrize("group", ["grid", "gather", "delta"])
def test_honest_groups_pass_every_check(built: dict[str, Any], group: str) -> None:
    checks = _run_checks(built, group)
    assert len(checks) >= 4
    failed = [c for c in checks if not c.passed]
    assert not failed, failed


@pytest.mark.parametrize("group", ["grid", "gather", "delta"])
def test_verify_rows_pass_per_camera(built: dict[str, Any], group: str) -> None:
    data = built["groups"][group]
    rows = getattr(PLUGIN[group], f"verify_{group}")(_ctx(built), data.arrays, data.attrs)
    per_product = {"grid": 4, "gather": 2, "delta": 1}[group]
    assert len(rows) == per_product * 4  # 4 cameras
    assert all(r.passed for r in rows), [r for r in rows if not r.passed]
    assert {r.camera for r in rows} == {"FRONT", "LEFT", "BACK", "RIGHT"}
    if group == "gather":
        assert max(r.max_abs for r in rows if r.product == "gather/index+weight") < 1e-6


@pytest.mark.parametrize("group", ["grid", "gather", "delta"])
def test_rebuild_is_bit_identical(built: dict[str, Any], group: str) -> None:
    data = built["groups"][group]
    rebuilt = getattr(PLUGIN[group], f"rebuild_{group}")(built["rig"], data.attrs)
    assert json_attrs(rebuilt.pop(REBUILT_ATTRS)) == json_attrs(data.attrs)  # the whole group's attributes
    expected = {k: v for k, v in data.arrays.items() if group != "grid" or k not in ("coords", "valid", "norm", "norm_int16")}
    assert sorted(rebuilt) == sorted(expected)
    for name, array in expected.items():
        assert rebuilt[name].dtype == array.dtype and np.array_equal(rebuilt[name], array), name


def _edit(arrays: dict[str, np.ndarray], name: str, fn: Callable[[np.ndarray], None]) -> dict[str, np.ndarray]:
    out = dict(arrays)
    out[name] = arrays[name].copy()
    fn(out[name])
    return out


def _set(index: Any, value: Any) -> Callable[[np.ndarray], None]:
    def apply(a: np.ndarray) -> None:
        a[index] = value

    return apply


TAMPER_ARRAYS = [
    ("gather", "index", _set((0, 0), 10**6), "index_in_range"),
    ("gather", "weight", _set((-1, 2), 0.5), "padding_rows_zero"),
    ("gather", "weight", _set((0, 0), np.float32(np.nan)), "weight_finite_unit"),
    ("gather", "weight_u8", _set((0, 1), 77), "lut_reconstruction"),
    ("gather", "perm", lambda a: a.__setitem__(slice(0, 2), a[[1, 0]]), "contract"),
    ("gather", "cell_valid", lambda a: a.__setitem__(0, ~a[0]), "cell_valid_matches_grid"),
    ("gather", "lut", _set(3, 0.5), "lut_table"),
    ("delta", "scale", _set((1, 0), 0.75), "contract"),
    ("delta", "block_slot", _set((0, 0, 0, 0), 10**4), "contract"),
    ("delta", "basis", _set((1, 0, 0), 0.0), "contract"),
    ("grid", "uq12", _set((..., 0), 4095), "decodes_within_recorded_error"),
    ("grid", "norm_q16", lambda a: a.__setitem__(a == -32768, 0), "invalid_in_band_samples_zero"),
    ("grid", "pixel_q", lambda a: a.__setitem__(..., a.astype(np.int32).clip(-32768, 32767).astype(np.int16) + 1), "decodes_within_recorded_error"),
    ("grid", "opencv_map2", _set((0, 1, 5, 5), 1023), "matches_convertmaps_of_coords"),
]


@pytest.mark.parametrize(("group", "name", "edit", "check"), TAMPER_ARRAYS, ids=[f"{g}-{n}-{c}" for g, n, _, c in TAMPER_ARRAYS])
def test_tampered_arrays_fail_the_right_check(built: dict[str, Any], group: str, name: str, edit: Callable[[np.ndarray], None], check: str) -> None:
    arrays = _edit(built["groups"][group].arrays, name, edit)
    checks = _run_checks(built, group, arrays=arrays)
    failed = {c.name for c in checks if not c.passed}
    assert check in failed, [(c.name, c.reason) for c in checks if not c.passed] or checks
    assert all(isinstance(c.reason, str) and "\n" not in c.reason for c in checks)


def _residual_cell(built: dict[str, Any], want_valid: bool) -> tuple[Any, np.ndarray, tuple[int, int, int, int]]:
    """A (valid or invalid) cell of a block stored with int8 residuals."""
    data = built["groups"]["delta"]
    lut = delta_checks._delta_lut(built["rig"], data.arrays, data.attrs)[0]
    truth = compute_sampling_grid(built["rig"])
    slot = lut.block_slot.astype(np.int64)
    b = lut.block
    cells = truth.valid if want_valid else ~truth.valid
    cell = next(tuple(int(i) for i in p) for p in np.argwhere(cells) if lut.res8_slot[slot[p[0], p[1], p[2] // b, p[3] // b]] > 0)
    return lut, decode_delta(lut), cell  # type: ignore[return-value]


def test_tampered_delta_valid_cell_is_caught(built: dict[str, Any]) -> None:
    lut, _, (cam, ih, iy, ix) = _residual_cell(built, want_valid=True)
    b = lut.block
    k = int(lut.block_slot[cam, ih, iy // b, ix // b])
    where = (int(lut.res8_slot[k]), iy % b, ix % b, 0)
    flipped = -127 if lut.res8[where] >= 0 else 127
    arrays = _edit(built["groups"]["delta"].arrays, "res8", _set(where, flipped))
    failed = {c.name for c in _run_checks(built, "delta", arrays=arrays) if not c.passed}
    assert "decodes_within_max_error" in failed


def test_tampered_delta_invalid_cell_is_caught(built: dict[str, Any]) -> None:
    """Move an invalid cell of a residual block back into the map."""
    data = built["groups"]["delta"]
    lut, decoded, (cam, ih, iy, ix) = _residual_cell(built, want_valid=False)
    slot = lut.block_slot.astype(np.int64)
    b = lut.block
    k = slot[cam, ih, iy // b, ix // b]
    step = float(lut.scale[k, 1])
    target = np.array([3.0, 3.0])
    r = np.clip(np.rint((target - (decoded[cam, ih, iy, ix] - lut.res8[lut.res8_slot[k], iy % b, ix % b] * step)) / step), -127, 127)
    arrays = _edit(data.arrays, "res8", _set((int(lut.res8_slot[k]), iy % b, ix % b), r.astype(np.int8)))
    failed = {c.name for c in _run_checks(built, "delta", arrays=arrays) if not c.passed}
    assert "invalid_decode_off_map" in failed


@pytest.mark.parametrize(
    ("group", "edit", "check"),
    [
        ("grid", lambda a: a["uq12"].update(max_error_px=1e-9), "decodes_within_recorded_error"),
        ("grid", lambda a: a["uq12"].update(invalid_in_band=True), "invalid_not_in_band"),
        ("grid", lambda a: a["build_options"].update(formats="opencv"), "formats_listed"),
        ("grid", lambda a: a["build_options"].update(pixel_q_frac_bits=15), "pixel_q_contract"),
        ("grid", lambda a: a.update(formats=["norm_int16"]), "formats_listed"),
        ("gather", lambda a: a["build_options"].update(order="random"), "contract"),
        ("gather", lambda a: a.update(lut_max_weight_error=0.0), "lut_reconstruction"),
        ("gather", lambda a: a.update(n_cells=5), "contract"),
        ("gather", lambda a: a.update(align=64), "contract"),
        ("gather", lambda a: a.update(mean_index_jump_gather_order=1.0), "order_figures"),
        ("gather", lambda a: a.update(band_switches_row_order=10**6), "order_figures"),
        ("delta", lambda a: a.update(max_error_px=0.0), "decodes_within_max_error"),
        ("delta", lambda a: a["build_options"].update(max_error_px=1e-4), "decodes_within_max_error"),
        ("delta", lambda a: a.update(on_device_bytes_total=1), "on_device_size"),
        ("delta", lambda a: a["build_options"].update(block="ten"), "contract"),
        ("delta", lambda a: a.pop("build_options"), "contract"),
        ("delta", lambda a: a.update(block=11), "decoder_attrs"),
        ("delta", lambda a: a.update(block_grid=[1, 1]), "decoder_attrs"),
        ("delta", lambda a: a.update(logical_shape=[1, 1, 1, 1]), "decoder_attrs"),
        ("delta", lambda a: a.update(max_error_bound_px=1.0), "decoder_attrs"),
    ],
)
def test_tampered_attributes_fail_and_never_raise(built: dict[str, Any], group: str, edit: Callable[[dict[str, Any]], None], check: str) -> None:
    attrs = copy.deepcopy(built["groups"][group].attrs)
    edit(attrs)
    checks = _run_checks(built, group, attrs=attrs)
    assert check in {c.name for c in checks if not c.passed}, [(c.name, c.passed, c.reason) for c in checks]


@pytest.mark.parametrize("group", ["grid", "gather", "delta"])
def test_missing_or_garbage_arrays_are_failed_checks_not_exceptions(built: dict[str, Any], group: str) -> None:
    arrays = dict(built["groups"][group].arrays)
    victim = {"grid": "pixel_q", "gather": "weight", "delta": "coef"}[group]
    del arrays[victim]
    checks = _run_checks(built, group, arrays=arrays)
    assert any(not c.passed and f"{group}/{victim} is missing or unreadable" in c.reason for c in checks)
    garbage = {name: np.array(["x"]) for name in built["groups"][group].arrays}
    checks = _run_checks(built, group, arrays=garbage)
    assert checks and any(not c.passed for c in checks)
    rows = getattr(PLUGIN[group], f"verify_{group}")(_ctx(built), garbage, built["groups"][group].attrs)
    assert rows and not all(r.passed for r in rows)


def test_store_without_formats_has_no_format_checks(small: RigConfig) -> None:
    groups = build_grid_command(small, GridBuildOptions()).groups
    ctx = CheckContext(rig=small, store_path="<memory>", root_attrs={}, grid_arrays=groups["grid"].arrays, grid_attrs=groups["grid"].attrs)
    checks = format_checks.check_grid(ctx, groups["grid"].arrays, groups["grid"].attrs)
    assert [c.name for c in checks] == ["formats_listed"] and checks[0].passed
    assert format_checks.rebuild_grid(small, groups["grid"].attrs) == {}
    assert groups["gather"].arrays["index"].shape == (4, 1, 24, 24, 4)  # bev layout by default


def test_inspect_strict_and_verify_pass_end_to_end(tmp_path: Path) -> None:
    rig = _rig()
    run_grid(rig, tmp_path, npu=True, formats=ALL_FORMATS, align=32, order="cache", align_corners=True)
    report = inspect_store(tmp_path / "small.zarr", strict=True)
    mine = [c for c in report.checks if c.array.startswith(("gather", "delta")) or any(n in c.array for n in ("uq12", "opencv", "pixel_q", "norm_q16"))]
    assert len(mine) > 40
    assert all(c.passed for c in report.checks), [c for c in report.checks if not c.passed]
    strict = {c.array for c in report.checks if c.name == "strict"}
    assert {"gather/perm", "delta/res8", "grid/norm_q16", "grid/opencv_map2"} <= strict
    verified = verify_store(tmp_path / "small.zarr", channels=2)
    products = {r.product for r in verified.rows}
    assert {"gather/index+weight", "gather/weight_u8+lut", "delta", "grid/uq12", "grid/opencv", "grid/pixel_q", "grid/norm_q16"} <= products
    assert all(r.passed for r in verified.rows), [r for r in verified.rows if not r.passed]


# --------------------------------------------------------------------------------------
# audit fixes: per-axis bound, invalid encodings, dequantisation attrs, extra arrays, verify
# --------------------------------------------------------------------------------------


def _failed(checks: list[Any]) -> set[tuple[str, str]]:
    return {(c.array, c.name) for c in checks if not c.passed}


@pytest.mark.parametrize("name", ["uq12", "norm_q16"])
def test_off_by_one_v_codes_fail_the_per_axis_quantisation_bound(built: dict[str, Any], name: str) -> None:
    """+1 on the v code of every valid cell whose v rounding error is small: within the larger
    (u) axis's half step, beyond the v axis's own."""
    from bevcompile.grid.formats import decode_format_px

    rig = built["rig"]
    arrays = dict(built["groups"]["grid"].arrays)
    truth = compute_sampling_grid(rig)
    q = arrays[name].copy()
    decoded = decode_format_px(name, {name: q}, rig.feature_size, False)
    step_v = format_checks._quantisation_bound(name, rig.feature_size, False, None)[1] * 2
    err_v = np.abs(decoded[..., 1] - truth.coords_feature_px[..., 1])
    pick = truth.valid & (err_v <= 0.3 * step_v) & (q[..., 1] < q[..., 1].max())
    q[..., 1] = np.where(pick, q[..., 1] + 1, q[..., 1])
    arrays[name] = q
    assert (f"grid/{name}", "no_saturation") in _failed(_run_checks(built, "grid", arrays=arrays))


@pytest.mark.parametrize(
    ("array", "value", "key"),
    [("uq12", 2000, "grid/uq12"), ("opencv_map1", 0, "grid/opencv_map1"), ("opencv_map2", 5, "grid/opencv_map1"), ("pixel_q", 0, "grid/pixel_q")],
)
def test_invalid_cells_hold_the_documented_code(built: dict[str, Any], array: str, value: int, key: str) -> None:
    arrays = dict(built["groups"]["grid"].arrays)
    data = arrays[array].copy()
    invalid = ~built["groups"]["grid"].arrays["valid"]
    first = tuple(np.argwhere(invalid)[0])
    data[first] = value
    arrays[array] = data
    assert (key, "invalid_encoding") in _failed(_run_checks(built, "grid", arrays=arrays))


@pytest.mark.parametrize(("fmt", "key", "value"), [("pixel_q", "scale", 0.5), ("uq12", "offset", 0.0), ("norm_q16", "offset", 0.5), ("opencv", "scale", 1.0)])
def test_dequantisation_attrs_are_recomputed(built: dict[str, Any], fmt: str, key: str, value: float) -> None:
    attrs = copy.deepcopy(built["groups"]["grid"].attrs)
    attrs[fmt][key] = value
    failed = [c for c in _run_checks(built, "grid", attrs=attrs) if not c.passed]
    assert [c.name for c in failed] == ["dequantisation_attrs"] and f"{fmt}.{key} {value!r}" in failed[0].reason


@pytest.mark.parametrize("group", ["gather", "delta"])
def test_an_unknown_extra_array_fails_the_contract(built: dict[str, Any], group: str) -> None:
    arrays = {**built["groups"][group].arrays, "zz_unknown": np.zeros(10, np.int32)}
    failed = [c for c in _run_checks(built, group, arrays=arrays) if not c.passed]
    assert [(c.array, c.name) for c in failed] == [(f"{group}/", "contract")]
    assert failed[0].reason == "arrays not produced by these build_options: zz_unknown"


def test_verify_uq12_under_align_corners_can_fail() -> None:
    """Saturated cells are judged against their clamp bound, the others by half a step per axis:
    random codes on valid cells fail (the old 2 x recorded error ~ 1.0 threshold passed them)."""
    rig = _rig()
    groups = build_grid_command(rig, GridBuildOptions(align_corners=True, formats=("uq12",), npu=False)).groups
    grid = groups["grid"]
    features, _ = make_features(rig, 3, 0)
    ctx = CheckContext(rig=rig, store_path="<memory>", root_attrs={}, grid_arrays=grid.arrays, grid_attrs=grid.attrs, features=features)
    rows = format_checks.verify_grid(ctx, grid.arrays, grid.attrs)
    assert rows and all(r.passed for r in rows)
    assert any(r.product == "grid/uq12 saturated" for r in rows)
    q = grid.arrays["uq12"].copy()
    rng = np.random.default_rng(0)
    valid = grid.arrays["valid"]
    q[valid] = rng.integers(0, 4096, (int(valid.sum()), 2))
    damaged = {**grid.arrays, "uq12": q}
    rows = format_checks.verify_grid(ctx, damaged, grid.attrs)
    assert any(not r.passed for r in rows if r.product == "grid/uq12")
    assert any(not r.passed for r in rows if r.product == "grid/uq12 saturated")


# --------------------------------------------------------------------------------------
# bev.region stores
# --------------------------------------------------------------------------------------


def test_region_grid_store_passes_inspect_strict_and_verify_and_damage_is_caught(tmp_path: Path) -> None:
    """A region grid store (every format, flat cache-ordered gather) passes inspect, --strict (bit
    for bit rebuild) and verify; a damaged grid/expand, a swapped kept cell's coords and a
    damaged delta/cell_pos each fail with their check's name."""
    import zarr
    from typer.testing import CliRunner

    from bevcompile.cli import app

    from ..matrix.test_region import REGION

    data = rigs.small_rig_data()
    data["bev"]["region"] = REGION
    config = rigs.write_yaml(tmp_path / "small.yaml", data)
    runner = CliRunner()
    args = ["grid", str(config), "--out", str(tmp_path), "--quiet", "--align", "8", "--order", "cache"]
    for name in ("opencv", "pixel_q", "norm_q16", "uq12"):
        args += ["--format", name]
    assert runner.invoke(app, args).exit_code == 0
    store = tmp_path / "small.zarr"
    assert_strict_and_verify_pass(store)
    report = inspect_store(store)
    names = {c.name for c in report.checks}
    assert {"region_tables", "region_expand_of_cells", "coords_match_config"} <= names

    expand = zarr.open_array(store / "grid" / "expand", mode="r+")
    original = np.asarray(expand[:])
    damaged = original.copy()
    damaged[0] = (damaged[0] + 1) % (damaged.max() + 1)
    expand[:] = damaged
    out = runner.invoke(app, ["inspect", str(store)])
    assert out.exit_code == 1 and "region_tables" in out.output and "grid/expand" in out.output, out.output
    expand[:] = original

    coords = zarr.open_array(store / "grid" / "coords", mode="r+")
    values = np.asarray(coords[:])
    valid = np.asarray(zarr.open_array(store / "grid" / "valid", mode="r")[:])
    k = np.flatnonzero(valid[0, 0])[:2]
    values[0, 0, k] = values[0, 0, k[::-1]]
    coords[:] = values
    out = runner.invoke(app, ["inspect", str(store)])
    assert out.exit_code == 1 and "coords_match_config" in out.output, out.output
    values[0, 0, k] = values[0, 0, k[::-1]]
    coords[:] = values

    pos = zarr.open_array(store / "delta" / "cell_pos", mode="r+")
    p = np.asarray(pos[:])
    p[[0, 1]] = p[[1, 0]]
    pos[:] = p
    out = runner.invoke(app, ["inspect", str(store)])
    assert out.exit_code == 1 and "delta/cell_pos differs" in " ".join(out.output.split()), out.output
