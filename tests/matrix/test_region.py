"""Region matrices (bev.region): a super-cell's row is the merge of its fine cells' rows, proved
against the dense full-grid matrix; Top-K against the straightforward region reference; the
matrix/cells + matrix/expand arrays and the inspect / verify / --strict plug-in."""

from __future__ import annotations

from dataclasses import replace
from functools import cache
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from bevcompile.cli import app
from bevcompile.matrix.build import MatrixOptions, build_matrix
from bevcompile.matrix.reference import region_reference_matrix
from bevcompile.rig.config import RigConfig, parse_config
from bevcompile.rig.region import region_table

from ..cli import assert_strict_and_verify_pass
from ..rigs import small_rig_data, write_yaml

REGION = {
    "keep": [[[-12.0, -6.0], [12.0, -6.0], [12.0, 6.0], [-12.0, 6.0]]],
    "rings": [{"beyond_m": 4, "factor": 2}, {"beyond_m": 8, "factor": 4}],
}


@cache
def rigs() -> tuple[RigConfig, RigConfig]:
    data = small_rig_data()
    full = parse_config(data)
    data["bev"]["region"] = REGION
    return full, parse_config(data)


def dense(mode: str, splat: str, normalize: str, region: bool) -> np.ndarray:
    rig = rigs()[1 if region else 0]
    return build_matrix(rig, MatrixOptions(mode=mode, splat=splat, normalize=normalize, topk=0), jobs=1).dense().astype(np.float64)


@pytest.mark.parametrize("mode", ["frustum", "grid"])
@pytest.mark.parametrize("splat", ["bilinear", "nearest"])
@pytest.mark.parametrize("normalize", ["sum", "mean"])
def test_super_cell_row_is_the_merge_of_its_fine_rows(mode: str, splat: str, normalize: str) -> None:
    """--topk 0: sum -> the row is the SUM of its fine cells' full-grid rows; mean -> the fine cells'
    mean rows weighted by their raw mass, sum_i m_i W_i / sum_i m_i (m_i = the row sums of the
    full-grid sum matrix); fine cells keep their full-grid rows bit for bit; the zero row is empty."""
    full_rig, region_rig = rigs()
    table = region_table(region_rig.bev)
    w_full = dense(mode, splat, normalize, False)
    w_region = dense(mode, splat, normalize, True)
    mass = dense(mode, splat, "sum", False).sum(axis=1)
    assert w_region.shape == (table.n_kept + 1, w_full.shape[1])
    nx = full_rig.bev.nx
    worst = 0.0
    for r, (iy, ix, size) in enumerate(table.cells):
        fine = [(iy + a) * nx + ix + b for a in range(size) for b in range(size)]
        if size == 1:
            assert np.array_equal(w_region[r], w_full[fine[0]]), (r, iy, ix)
            continue
        if normalize == "sum":
            want = w_full[fine].sum(axis=0)
        else:
            want = (mass[fine, None] * w_full[fine]).sum(axis=0) / max(mass[fine].sum(), 1e-300)
        worst = max(worst, float(np.abs(want - w_region[r]).max()))
    assert worst <= 3e-7 * max(1.0, float(np.abs(w_region).max()))  # float32 values vs float64 sums
    assert not w_region[-1].any()
    assert set(np.unique(table.cells[:, 2]).tolist()) == {1, 2, 4}


@pytest.mark.parametrize("mode", ["frustum", "grid", "ray"])
@pytest.mark.parametrize("splat", ["bilinear", "nearest"])
def test_region_topk_equals_the_straightforward_region_reference_for_any_jobs(mode: str, splat: str) -> None:
    _full, rig = rigs()
    table = region_table(rig.bev)
    options = MatrixOptions(mode=mode, splat=splat, topk=5, normalize="mean")
    one = build_matrix(rig, options, jobs=1)
    two = build_matrix(rig, options, jobs=2)
    prior = one.depth_prior.normalised(rig).dense(rig) if one.depth_prior is not None else None
    ref = region_reference_matrix(rig, options, table.row_of_cell(), table.n_kept + 1, prior=prior)
    assert np.array_equal(one.coo_row, ref.row) and np.array_equal(one.coo_col, ref.col)
    assert np.allclose(one.coo_val, ref.value, rtol=1e-6, atol=0)
    for name, array in one.arrays().items():
        assert np.array_equal(array, two.arrays()[name]), name
    assert np.array_equal(one.region_cells, table.cells) and np.array_equal(one.expand, table.expand)


def test_region_matrix_is_smaller_and_camera_mass_reads_expand() -> None:
    full_rig, rig = rigs()
    options = MatrixOptions(topk=8, align=16, tile_rows=32, quantize="int8")
    full = build_matrix(full_rig, options, jobs=1)
    region = build_matrix(rig, options, jobs=1)
    table = region_table(rig.bev)
    assert region.n_rows == table.n_kept + 1 < full.n_rows
    assert region.figures.product_bytes["ell"] < full.figures.product_bytes["ell"]
    assert region.camera_mass.shape == full.camera_mass.shape
    outside = table.expand.reshape(rig.bev.ny, rig.bev.nx) == table.n_kept
    assert not region.camera_mass[:, outside].any()


def test_compact_rows_with_a_region_is_refused(tmp_path: Path) -> None:
    data = small_rig_data()
    data["bev"]["region"] = REGION
    config = write_yaml(tmp_path / "small.yaml", data)
    result = CliRunner().invoke(app, ["matrix", str(config), "--compact-rows", "--out", str(tmp_path)])
    assert result.exit_code == 2, result.output
    assert "--compact-rows does not combine with a bev.region" in result.output


def test_region_store_passes_inspect_strict_and_verify_and_damage_is_caught(tmp_path: Path) -> None:
    data = small_rig_data()
    data["bev"]["region"] = REGION
    config = write_yaml(tmp_path / "small.yaml", data)
    runner = CliRunner()
    build = runner.invoke(app, ["matrix", str(config), "--topk", "8", "--align", "16", "--tile-rows", "32", "--quantize", "int8", "--out", str(tmp_path), "--quiet"])
    assert build.exit_code == 0, build.output
    store = tmp_path / "small.zarr"
    verified = assert_strict_and_verify_pass(store)
    assert "straightforward region build" in verified or "rows passed" in verified
    # a damaged expand: inspect names it
    from bevcompile.store.zarr_io import open_store

    reader = open_store(store)
    expand = np.asarray(reader.read("matrix", "expand"))
    expand[0] = 0 if expand[0] != 0 else 1
    import zarr

    zarr.open_array(store / "matrix" / "expand", mode="r+")[:] = expand
    damaged = runner.invoke(app, ["inspect", str(store)])
    assert damaged.exit_code == 1, damaged.output
    assert "region_expand" in damaged.output


@pytest.mark.parametrize("splat", ["bilinear", "nearest"])
def test_pass2_prefilter_of_fine_cells_changes_nothing_but_the_entries_built(monkeypatch: pytest.MonkeyPatch, splat: str) -> None:
    """The frustum hook (FrustumStream.begin_region_collect: fine cells filtered by their rows' pass-1
    thresholds before their entries are built) gives the same arrays, figures and candidate count as
    the region build without it, from fewer pass-2 entries."""
    from bevcompile.matrix import entries as entries_module
    from bevcompile.matrix.entries import FrustumStream

    _full, rig = rigs()
    options = MatrixOptions(mode="frustum", splat=splat, topk=3, normalize="mean", tile_rows=32, quantize="int8")
    built: dict[str, int] = {}
    original = FrustumStream.collect

    def counting(self: FrustumStream, block: object) -> object:
        out = original(self, block)  # type: ignore[arg-type]
        built[label] = built.get(label, 0) + len(out[0])
        return out

    monkeypatch.setattr(entries_module.FrustumStream, "collect", counting)
    label = "hook"
    with_hook = build_matrix(rig, options, jobs=1)
    monkeypatch.delattr(entries_module.FrustumStream, "begin_region_collect")
    label = "none"
    without = build_matrix(rig, options, jobs=1)
    for name, array in with_hook.arrays().items():
        assert np.array_equal(array, without.arrays()[name]), name
    assert with_hook.figures == replace(without.figures, build_seconds=with_hook.figures.build_seconds, peak_rss_bytes=with_hook.figures.peak_rss_bytes)
    assert with_hook.figures.n_candidates == without.figures.n_candidates
    assert built["hook"] < built["none"]
