"""The drift report of learned matrix values (``bevcompile diff --against-init`` / ``diff INIT
LEARNED``) and the learned-minus-init panel of ``render``, on a store where ONE camera's learned
weights were doubled: its mass share must rise, the others' fall, and only its entries change."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from bevcompile.cli import app
from bevcompile.matrix.build import MatrixOptions, run_matrix
from bevcompile.report.drift import drift_stores
from bevcompile.rig.config import RigConfig
from bevcompile.store.loader import load

CAM = 1


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory, small_distorted_multi: RigConfig) -> tuple[Path, Path]:
    """Overlapping cameras (cells seen by two), three heights, partial coverage."""
    base = tmp_path_factory.mktemp("drift")
    geometric = run_matrix(small_distorted_multi, base / "init", MatrixOptions(mode="grid", topk=16, align=16)).store
    learned = base / "learned" / geometric.name
    shutil.copytree(geometric, learned)
    group = load(learned)["matrix"]
    index, weight = np.asarray(group["ell_index"]), np.array(group["ell_weight"])
    per_cam = group.attrs["columns_per_camera"]
    weight[(index // per_cam) == CAM] *= 2  # padding slots stay 0
    np.save(base / "v.npy", weight)
    result = CliRunner().invoke(app, ["absorb", str(learned), str(base / "v.npy"), "--quiet"])
    assert result.exit_code == 0, result.stderr
    return geometric, learned


def test_doubling_one_camera_moves_its_share_and_only_its_entries(stores: tuple[Path, Path], small_distorted_multi: RigConfig) -> None:
    small = small_distorted_multi
    geometric, learned = stores
    report = drift_stores(learned)
    two = drift_stores(geometric, learned)
    assert report.to_json()["cameras"] == two.to_json()["cameras"]
    cams = {c.camera: c for c in report.cameras}
    moved = cams[small.camera_names[CAM]]
    assert moved.share_after > moved.share_before and moved.mean_rel_change == pytest.approx(1.0) == moved.max_rel_change
    for name, c in cams.items():
        if name != moved.camera:
            assert c.share_after < c.share_before and c.mean_rel_change == 0 and c.max_rel_change == 0
    # the cells listed for the doubled camera: its share rises, as (2 m) / (2 m + rest)
    assert moved.top_cells and all(m.share_after > m.share_before for m in moved.top_cells)
    cell = moved.top_cells[0]
    s = cell.share_before
    assert cell.share_after == pytest.approx(2 * s / (2 * s + (1 - s)), rel=1e-6)
    assert moved.outside_before == 0 and moved.outside_after == 0  # grid mode: entries only where the camera sees
    assert report.changed == moved.entries


def test_drift_cli(stores: tuple[Path, Path]) -> None:
    geometric, learned = stores
    runner = CliRunner()
    result = runner.invoke(app, ["diff", "--against-init", str(learned)])
    assert result.exit_code == 0, result.stderr
    assert "drift of matrix values (grid mode" in result.stdout and "cells whose camera share moved most" in result.stdout
    result = runner.invoke(app, ["diff", str(geometric), str(learned), "--json", "--top", "2"])
    assert result.exit_code == 0 and len(json.loads(result.stdout)["cameras"][CAM]["top_cells"]) == 2
    result = runner.invoke(app, ["diff", "--against-init", str(geometric)])
    assert result.exit_code == 2 and "holds geometric values" in result.stderr and result.stderr.count("\n") == 1
    result = runner.invoke(app, ["diff", "--against-init", str(learned), str(geometric)])
    assert result.exit_code == 2 and "--against-init takes ONE store" in result.stderr
    result = runner.invoke(app, ["diff", str(geometric)])
    assert result.exit_code == 2 and "diff needs OLD and NEW" in result.stderr


def test_render_draws_the_learned_minus_init_mass(stores: tuple[Path, Path], tmp_path: Path) -> None:
    from bevcompile.report.render import _learned_panel, render_store
    from bevcompile.store.zarr_io import open_store

    geometric, learned = stores
    result = render_store(learned, tmp_path / "l.png")
    assert result.second_panel == "learned - init camera mass, per camera" and (tmp_path / "l.png").stat().st_size > 0
    delta = _learned_panel(open_store(learned), load(learned).rig)
    mass = np.asarray(load(learned)["matrix"]["camera_mass"], np.float64)
    assert delta is not None and np.allclose(delta[CAM], mass[CAM] / 2, rtol=1e-6, atol=1e-7)
    assert np.all(np.delete(np.abs(delta), CAM, axis=0) <= 1e-6)
    assert render_store(geometric, tmp_path / "g.png").second_panel.startswith("matrix/camera_mass")


def test_region_store_drift_is_computed_over_its_compact_rows(tmp_path: Path) -> None:
    """A bev.region frustum store (super-cells of sizes 2 and 4), one camera's learned weights doubled:
    per-camera mass over the compact rows, a listed cell is a (super-)cell of matrix/cells (its size
    and centre), and the mass outside the footprint equals a per-row loop over the fine cells the
    camera sees (grid/ geometry: compute_sampling_grid's valid)."""
    from bevcompile.grid.ipm import compute_sampling_grid
    from bevcompile.rig.config import parse_config

    from ..matrix.test_region import REGION
    from ..rigs import small_rig_data

    data = small_rig_data()
    data["bev"]["region"] = REGION
    rig = parse_config(data)
    store = run_matrix(rig, tmp_path, MatrixOptions(mode="frustum", topk=16, align=16)).store
    group = load(store)["matrix"]
    index, weight = np.asarray(group["ell_index"]), np.array(group["ell_weight"])
    per_cam = group.attrs["columns_per_camera"]
    weight[(index // per_cam) == CAM] *= 2
    np.save(tmp_path / "v.npy", weight)
    assert CliRunner().invoke(app, ["absorb", str(store), str(tmp_path / "v.npy"), "--quiet"]).exit_code == 0
    report = drift_stores(store)
    loaded = load(store)["matrix"]
    cells = np.asarray(loaded["cells"])
    row, col, val = np.asarray(loaded["coo_row"]), np.asarray(loaded["coo_col"]), np.asarray(loaded["coo_val"], np.float64)
    valid = np.asarray(compute_sampling_grid(rig).valid).any(axis=1)  # (n_cam, ny, nx)
    total = val.sum()
    for c, drift in enumerate(report.cameras):
        mine = col // per_cam == c
        assert drift.share_after == pytest.approx(val[mine].sum() / total, rel=1e-9)
        outside = sum(
            val[mine & (row == r)].sum()
            for r, (iy, ix, size) in enumerate(cells)
            if not valid[c, iy : iy + size, ix : ix + size].any()
        )
        assert drift.outside_after == pytest.approx(outside / val[mine].sum(), rel=1e-9, abs=1e-12)
    moved = report.cameras[CAM]
    assert moved.share_after > moved.share_before and moved.top_cells
    sizes = {(int(iy), int(ix)): int(size) for iy, ix, size in cells}
    for cell in moved.top_cells:
        assert sizes[(cell.iy, cell.ix)] == cell.size
        assert cell.x_m == pytest.approx(rig.bev.x.min + (cell.ix + cell.size / 2) * rig.bev.x.step)
        assert cell.y_m == pytest.approx(rig.bev.y.min + (cell.iy + cell.size / 2) * rig.bev.y.step)
    assert any(c.outside_after > 0 for c in report.cameras)  # frustum: points above the ground plane
    assert report.notes and f"{cells.shape[0]:,} compact rows" in report.notes[0]
    listed = [m for c in report.to_json()["cameras"] for m in c["top_cells"]]
    assert all(m.get("size", 1) == sizes[(m["iy"], m["ix"])] for m in listed)
    # render's learned-minus-init panel reads each fine cell's row through matrix/expand
    from bevcompile.report.render import _learned_panel
    from bevcompile.store.zarr_io import open_store

    delta = _learned_panel(open_store(store), rig)
    mass = np.asarray(loaded["camera_mass"], np.float64)
    assert delta is not None and np.allclose(delta[CAM], mass[CAM] / 2, rtol=1e-6, atol=1e-7)
    assert np.all(np.delete(np.abs(delta), CAM, axis=0) <= 1e-6)
