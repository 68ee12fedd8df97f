"""The matrix/ plug-in of inspect / verify / --strict: clean groups pass, each kind of damage
fails the check that names it, verify compares every form with the independent references."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

import bevcompile.matrix.checks as mc
from bevcompile.cli import app
from bevcompile.matrix.build import MatrixOptions, build_matrix, matrix_attributes, run_matrix
from bevcompile.matrix.reference import bev_pool
from bevcompile.rig.config import RigConfig
from bevcompile.store.inspection import json_attrs
from bevcompile.store.plugins import REBUILT_ATTRS, CheckContext
from bevcompile.store.root import root_attributes
from bevcompile.store.verify import make_features
from bevcompile.store.zarr_io import open_store

from ..rigs import small_rig

MULTI = small_rig(distortion=True, heights=(-0.5, 0.0, 1.0), bev_half_m=20.0)
FULL = MatrixOptions(topk=6, align=8, tile_rows=64, quantize="int8", compact_rows=True, normalize="mean")


def _group(rig: RigConfig, options: MatrixOptions) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    products = build_matrix(rig, options)
    return {k: v.copy() for k, v in products.arrays().items()}, matrix_attributes(products, rig)


def _ctx(rig: RigConfig, channels: int = 3, seed: int = 0) -> CheckContext:
    feats, depth = make_features(rig, channels, seed)
    return CheckContext(rig=rig, store_path="<test>", root_attrs=root_attributes(rig), features=feats, depth_probs=depth, seed=seed)


def _failed(checks: list[Any]) -> set[tuple[str, str]]:
    return {(c.name, c.array) for c in checks if not c.passed}


@pytest.mark.parametrize(
    "options",
    [
        FULL,
        MatrixOptions(mode="grid", topk=0, align=1, tile_rows=5, quantize="int8"),
        MatrixOptions(topk=0, splat="nearest", rounding="trunc", align=16),
    ],
)
def test_clean_group_passes_every_check_and_rebuilds_bit_identically(options: MatrixOptions) -> None:
    arrays, attrs = _group(MULTI, options)
    checks = mc.check_matrix(_ctx(MULTI), arrays, attrs)
    assert not _failed(checks), [c for c in checks if not c.passed]
    names = {c.name for c in checks}
    assert {"contract", "coo_sorted_unique", "ell_padding_zero", "ell_reconstructs_coo", "camera_mass"} <= names
    rebuilt = mc.rebuild_matrix(MULTI, attrs)
    assert json_attrs(rebuilt.pop(REBUILT_ATTRS)) == json_attrs(attrs)
    assert rebuilt.keys() == arrays.keys()
    for name, arr in arrays.items():
        assert rebuilt[name].dtype == arr.dtype and rebuilt[name].tobytes() == arr.tobytes(), name


def _swap_first_two(a: dict[str, np.ndarray]) -> None:
    """Swap the first two entries of the first row that has two (columns now decrease)."""
    i = int(np.flatnonzero(np.diff(a["coo_row"]) == 0)[0])
    a["coo_col"][[i, i + 1]] = a["coo_col"][[i + 1, i]]


def _row_over_k(a: dict[str, np.ndarray]) -> None:
    """Give the first full row (K = 6 entries) a 7th by relabelling the next row's first entry."""
    nnz = np.bincount(a["coo_row"])
    r = int(np.flatnonzero(nnz == FULL.topk)[0])
    start = int(nnz[:r].sum())
    a["coo_row"][start + FULL.topk] = r


DAMAGE: list[tuple[str, Callable[[dict[str, np.ndarray], dict[str, Any]], None], set[tuple[str, str]]]] = [
    ("unsorted coo", lambda a, _: _swap_first_two(a), {("coo_sorted_unique", "matrix/coo_row"), ("ell_reconstructs_coo", "matrix/ell_weight")}),
    ("col out of range", lambda a, _: a["coo_col"].__setitem__(0, 10**9), {("coo_in_range", "matrix/coo_row")}),
    ("ell padding weight", lambda a, _: a["ell_weight"].__setitem__((0, -1), 0.5), {("ell_padding_zero", "matrix/ell_weight")}),
    ("ell padding index", lambda a, _: a["ell_index"].__setitem__((0, -1), -1), {("ell_index_in_range", "matrix/ell_index")}),
    ("row_scale", lambda a, _: a["row_scale"].__setitem__(0, a["row_scale"][0] * 2), {("int8_scale", "matrix/row_scale")}),
    ("int8 value", lambda a, _: a["ell_weight_int8"].__setitem__((0, 0), 3), {("int8_values", "matrix/ell_weight_int8")}),
    ("mean row", lambda a, _: a["coo_val"].__setitem__(0, a["coo_val"][0] * 1.5), {("mean_rows_sum_to_1", "matrix/coo_val")}),
    ("camera mass", lambda a, _: a["camera_mass"].__setitem__((0, 10, 10), 7.0), {("camera_mass", "matrix/camera_mass")}),
    ("tile weight", lambda a, _: a["tile_weight"].__setitem__(int(np.flatnonzero(a["tile_weight"])[0]), 0.25), {("tiles_reconstruct_coo", "matrix/tile_weight")}),
    ("missing ell", lambda a, _: a.pop("ell_weight"), {("contract", "matrix/ell_weight")}),
    ("row over K", lambda a, _: _row_over_k(a), {("row_nnz_le_k", "matrix/coo_row")}),
    ("logical shape attr", lambda _, t: t.__setitem__("logical_shape", [1, 1]), {("attrs", "matrix/")}),
    ("recorded int8 error", lambda _, t: t["int8"].__setitem__("max_rel_error", 1e-9), {("int8_recorded_error", "matrix/")}),
    ("negative value", lambda a, _: a["coo_val"].__setitem__(3, -a["coo_val"][3]), {("coo_values", "matrix/coo_val")}),
    ("row_ids", lambda a, _: a["row_ids"].__setitem__(1, a["row_ids"][0]), {("row_ids", "matrix/row_ids")}),
    ("dtype", lambda a, _: a.__setitem__("coo_val", a["coo_val"].astype(np.float64)), {("contract", "matrix/coo_val")}),
    ("ell padding moved", lambda a, _: _move_padding_index(a), {("ell_padding_index", "matrix/ell_index")}),
    ("topk attr", lambda _, t: t.__setitem__("topk", 10), {("attrs", "matrix/")}),
    ("mode attr", lambda _, t: t.__setitem__("mode", "grid"), {("attrs", "matrix/")}),
    ("k_pad attr", lambda _, t: t["ell"].__setitem__("k_pad", 24), {("attrs", "matrix/")}),
    ("row_nnz attr", lambda _, t: t["row_nnz"].__setitem__("max", 1), {("attrs", "matrix/")}),
    ("int8 abs error attr", lambda _, t: t["int8"].__setitem__("max_abs_error", 1e-9), {("int8_recorded_error", "matrix/")}),
    (
        "row_ids out of range",
        lambda a, _: a["row_ids"].__setitem__(-1, 10**6),
        {("row_ids", "matrix/row_ids"), ("camera_mass", "matrix/camera_mass")},
    ),
    (
        "negative tile offset",
        lambda a, _: a["tile_col_offsets"].__setitem__(1, -8),
        {("tiles_layout", "matrix/tile_col_offsets"), ("int8_values", "matrix/tile_weight_int8")},
    ),
]


def _move_padding_index(a: dict[str, np.ndarray]) -> None:
    """Point the last (padding) slot of the first non-full row at another in-range column."""
    r = int(np.flatnonzero(a["ell_weight"][:, -1] == 0)[0])
    a["ell_index"][r, -1] = a["ell_index"][r, 0] + 1


@pytest.mark.parametrize(("label", "damage", "expected"), DAMAGE, ids=[d[0] for d in DAMAGE])
def test_each_damage_fails_the_check_that_names_it(label: str, damage: Callable[..., None], expected: set[tuple[str, str]]) -> None:
    arrays, attrs = _group(MULTI, FULL)
    damage(arrays, attrs)
    failed = _failed(mc.check_matrix(_ctx(MULTI), arrays, attrs))
    assert expected <= failed, (label, failed)


def test_a_broken_precondition_keeps_the_specific_failures() -> None:
    """An out-of-range row id or a broken tile layout is named; the dependent checks do not crash."""
    arrays, attrs = _group(MULTI, FULL)
    arrays["row_ids"][-1] = 10**6
    arrays["tile_col_offsets"][[1, 2]] = arrays["tile_col_offsets"][[2, 1]]
    checks = mc.check_matrix(_ctx(MULTI), arrays, attrs)
    by_name = {c.name: c for c in checks if not c.passed}
    assert "plugin_error" not in by_name
    assert "not a positive multiple of align" in by_name["tiles_layout"].reason
    assert by_name["camera_mass"].reason.startswith("not checked: row_ids is invalid")


def test_unusable_build_options_fail_one_check() -> None:
    arrays, attrs = _group(MULTI, FULL)
    attrs["build_options"] = {**attrs["build_options"], "topk": -3}
    checks = mc.check_matrix(_ctx(MULTI), arrays, attrs)
    assert [(c.name, c.passed) for c in checks] == [("build_options", False)]
    assert "--topk must be an integer >= 0" in checks[0].reason


# --------------------------------------------------------------------------------------
# verify
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "reference"),
    [
        (MatrixOptions(topk=0, splat="nearest", align=4), "BEVDet-style voxel pooling"),
        (MatrixOptions(topk=0, splat="bilinear", rounding="trunc", normalize="mean", align=4, tile_rows=32, quantize="int8"), "BEVDet-style voxel pooling"),
        (MatrixOptions(mode="grid", topk=0, align=4, tile_rows=50, quantize="int8"), "grid_sample"),
        (FULL, "straightforward build"),
    ],
)
def test_verify_every_form_against_the_reference(options: MatrixOptions, reference: str) -> None:
    arrays, attrs = _group(MULTI, options)
    rows = mc.verify_matrix(_ctx(MULTI), arrays, attrs)
    products = {r.product for r in rows}
    want = {"matrix/coo", "matrix/ell"} | ({"matrix/tiles"} if options.tile_rows else set())
    if options.quantize:
        want |= {"matrix/ell_int8"} | ({"matrix/tiles_int8"} if options.tile_rows else set())
    if options.topk:
        want |= {"matrix/topk_vs_unpruned"}
    assert products == want
    assert {r.camera for r in rows if r.product == "matrix/coo"} == {*MULTI.camera_names, "all"}
    assert all(r.passed for r in rows), [r for r in rows if not r.passed]
    assert [r.product for r in rows if r.informational] == (["matrix/topk_vs_unpruned"] if options.topk else [])
    assert all(reference in r.note for r in rows if not r.informational)
    for r in rows:
        if r.informational:
            continue
        if r.product.endswith("int8"):
            assert 40.0 <= r.psnr_db < 120 and "PSNR >= 40" in r.threshold
        else:
            assert r.psnr_db > 100


@pytest.mark.parametrize("normalize", ["sum", "mean"])
def test_verify_reports_what_topk_pruning_costs(normalize: str) -> None:
    """The informational row compares the stored Top-K product with the unpruned lift; here
    checked against BEVDet-style voxel pooling (independent of both matrix builders)."""
    ctx = _ctx(MULTI, seed=4)
    assert ctx.features is not None and ctx.depth_probs is not None
    pooled = bev_pool(MULTI, ctx.features, ctx.depth_probs, splat="nearest", normalize=normalize).sum(axis=0)
    unpruned = pooled.reshape(pooled.shape[0], -1).T  # (cells, C)
    everything, _ = _group(MULTI, MatrixOptions(topk=0, splat="nearest", normalize=normalize, align=4))
    max_row_nnz = int(np.bincount(everything["coo_row"]).max())
    for topk in (2, max_row_nnz):
        options = MatrixOptions(topk=topk, splat="nearest", normalize=normalize, align=4)
        arrays, attrs = _group(MULTI, options)
        rows = mc.verify_matrix(ctx, arrays, attrs)
        (info,) = [r for r in rows if r.product == "matrix/topk_vs_unpruned"]
        assert info.informational and info.passed and info.camera == "all"
        assert "informational" in info.threshold and "kept weight" in info.note
        # the Top-K product from the COO arrays: col = ((cam * D + d) * H_f + v) * W_f + u
        cam, d, v, u = np.unravel_index(arrays["coo_col"], ctx.depth_probs.shape)
        lifted = ctx.depth_probs[cam, d, v, u][:, None].astype(np.float64) * ctx.features[cam, :, v, u]
        topk_out = np.zeros_like(unpruned)
        np.add.at(topk_out, arrays["coo_row"], arrays["coo_val"][:, None].astype(np.float64) * lifted)
        want = float(np.abs(topk_out - unpruned).max())
        assert info.max_abs == pytest.approx(want, rel=1e-6, abs=1e-9)
        if topk == 2:
            assert info.max_abs > 1e-3 and attrs["kept_weight_fraction"]["total"] < 1
        else:  # K = the fullest row's entry count: nothing pruned
            assert info.max_abs < 1e-6 * np.abs(unpruned).max() and attrs["kept_weight_fraction"]["total"] == 1


def test_verify_fails_a_perturbed_weight_and_names_the_camera() -> None:
    arrays, attrs = _group(MULTI, MatrixOptions(topk=4, align=4))
    cols_per_cam = attrs["columns_per_camera"]
    i = int(np.flatnonzero(arrays["coo_col"] // cols_per_cam == 2)[0])
    arrays["coo_val"][i] *= 1.01
    rows = mc.verify_matrix(_ctx(MULTI), arrays, attrs)
    failed = {(r.product, r.camera) for r in rows if not r.passed}
    assert ("matrix/coo", MULTI.camera_names[2]) in failed and ("matrix/coo", "all") in failed
    assert ("matrix/coo", MULTI.camera_names[0]) not in failed
    assert ("matrix/ell", "all") not in failed  # the ELL copy is intact


def test_verify_samples_rows_on_big_rigs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mc, "VERIFY_FULL_POINTS", 1000)
    monkeypatch.setattr(mc, "VERIFY_SAMPLED_ROWS", 40)
    for options in (MatrixOptions(topk=5, align=4, quantize="int8"), MatrixOptions(topk=0, splat="nearest", align=4)):
        arrays, attrs = _group(MULTI, options)
        rows = mc.verify_matrix(_ctx(MULTI, seed=3), arrays, attrs)
        assert all(r.passed for r in rows)
        assert all("40 seeded sampled rows" in r.note for r in rows)
        arrays["coo_val"] *= 1.001
        assert not all(r.passed for r in mc.verify_matrix(_ctx(MULTI, seed=3), arrays, attrs))


def test_inspect_strict_and_verify_cli_pass_on_a_fresh_store(tmp_path: Path) -> None:
    run_matrix(MULTI, tmp_path, FULL)
    store = str(tmp_path / "small.zarr")
    runner = CliRunner()
    result = runner.invoke(app, ["inspect", store, "--strict", "--quiet"])
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, ["verify", store, "--quiet"])
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, ["verify", store, "--verbose"])
    assert result.exit_code == 0, result.output
    out = " ".join(result.stdout.split())
    assert "matrix/topk_vs_unpruned (informational: Top-6 vs the unpruned lift (K = 0))" in out
    assert "rows passed (1 informational row not judged)" in out and "│ info" in result.stdout
    report = json.loads(runner.invoke(app, ["verify", store, "--json"]).stdout)
    info = [row for row in report["rows"] if row["informational"]]
    assert [row["product"] for row in info] == ["matrix/topk_vs_unpruned"] and report["n_judged"] == report["n_rows"] - 1


def test_verify_fails_a_store_that_inspect_fails(tmp_path: Path) -> None:
    """A deleted camera_mass, or one doubled with its sha256 recomputed, breaks only an inspect
    invariant (no verify row compares it); verify runs inspect's checks and exits 1 naming it."""
    from ..damage import rewrite_array

    run_matrix(MULTI, tmp_path, FULL)
    store = tmp_path / "small.zarr"
    mass = np.asarray(open_store(store).read("matrix", "camera_mass"))
    rewrite_array(store, "matrix/camera_mass", mass * 2)
    result = CliRunner().invoke(app, ["verify", str(store), "--quiet"])
    assert result.exit_code == 1, result.output
    assert "matrix/camera_mass" in result.stderr and "camera_mass: max |camera_mass - recomputed from COO|" in result.stderr
