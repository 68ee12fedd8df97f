"""Coordinate arrays (bevcompile/store/coords.py) and consolidated metadata: what xarray needs
to select by camera name, metres and heights, and to open a store without a warning."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest

from bevcompile.grid.build import run_grid
from bevcompile.matrix.build import MatrixOptions, run_matrix
from bevcompile.rig.config import parse_config
from bevcompile.rig.region import region_table
from bevcompile.store.coords import coordinate_values
from bevcompile.store.inspection import inspect_store
from bevcompile.store.zarr_io import open_store

from .. import damage
from ..matrix.test_region import REGION
from ..rigs import small_rig, small_rig_data


def test_convention_coordinates_are_the_rigs_names_and_cell_centres() -> None:
    """camera names in the rig's order, x / y the cell centres min + (i + 0.5) step (metres,
    BEV frame), heights and depth bins as configured; kept_cell only with a region."""
    rig = small_rig(heights=(0.0, 1.0))
    values = coordinate_values(rig)
    assert [str(v) for v in values["camera"]] == list(rig.camera_names)
    assert np.array_equal(values["x"], rig.bev.x.min + (np.arange(rig.bev.nx) + 0.5) * rig.bev.x.step)
    assert np.array_equal(values["y"], rig.bev.y.min + (np.arange(rig.bev.ny) + 0.5) * rig.bev.y.step)
    assert values["height"].tolist() == [0.0, 1.0] and values["depth"].tolist() == list(rig.depth.values())
    assert "kept_cell" not in values


def test_xarray_selects_by_camera_metres_and_kept_cell_in_a_region_store(tmp_path: Path) -> None:
    """The issue's reader: ``xr.open_zarr(store, group="grid").sel(camera=...)`` works without a
    warning; a region store's grid/ indexes its kept cells by their fine-cell index iy * nx + ix."""
    import xarray as xr

    data = small_rig_data()
    data["bev"]["region"] = REGION
    rig = parse_config(data)
    run_grid(rig, tmp_path)
    run_matrix(rig, tmp_path, MatrixOptions(mode="grid", align=1))
    store = tmp_path / f"{rig.name}.zarr"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        grid = xr.open_zarr(str(store), group="grid")
        camera = str(rig.camera_names[1])
        assert grid.sel(camera=camera)["valid"].shape[0] == len(rig.bev.heights)
    cells = region_table(rig.bev).cells
    assert grid["kept_cell"].values.tolist() == (cells[:, 0].astype(np.int64) * rig.bev.nx + cells[:, 1]).tolist()
    first = int(grid["kept_cell"].values[3])
    picked = grid.sel(kept_cell=first, camera=camera)["coords"].values
    assert np.array_equal(picked, grid["coords"].values[1, :, 3])
    report = inspect_store(store)
    assert report.passed, report.failure_lines()
    assert {c.array for c in report.checks if c.name == "coordinates"} >= {"grid/", "matrix/"}


def test_inspect_fails_wrong_coordinates_and_notes_missing_ones_and_missing_consolidation(tmp_path: Path) -> None:
    rig = small_rig()
    run_grid(rig, tmp_path)
    store = tmp_path / f"{rig.name}.zarr"
    assert open_store(store).coordinates("grid") == ["camera", "height", "x", "y"]
    assert "camera" not in open_store(store).arrays("grid")  # product plug-ins never see them
    wrong = np.asarray(coordinate_values(rig)["x"]) + 0.25
    damage.rewrite_array(store, "grid/x", wrong)  # hash updated: only the coordinates check can tell
    failed = [(c.name, c.array) for c in inspect_store(store).checks if not c.passed]
    assert failed == [("coordinates", "grid/")]
    # an older store: no coordinate arrays, no consolidated metadata -> notes, not failures
    for name in ("camera", "height", "x", "y"):
        damage.remove_array(store, f"grid/{name}")
    meta = json.loads((store / "zarr.json").read_text())
    meta.pop("consolidated_metadata", None)
    (store / "zarr.json").write_text(json.dumps(meta))
    report = inspect_store(store)
    assert report.passed, report.failure_lines()
    assert any(n.startswith("grid/ has no coordinate array for axis camera, height, x, y") for n in report.notes)
    assert any(n.startswith("no consolidated metadata") for n in report.notes)


def test_consolidated_metadata_survives_concurrent_writers_and_a_later_consolidate(tmp_path: Path) -> None:
    """Two products written one after the other (the lock serialises them) both appear in the
    consolidated copy; a user's ``zarr.consolidate_metadata()`` afterwards writes the same copy."""
    import zarr

    rig = small_rig()
    run_grid(rig, tmp_path)
    run_matrix(rig, tmp_path, MatrixOptions(mode="grid", align=1))
    store = tmp_path / f"{rig.name}.zarr"
    before = (store / "zarr.json").read_bytes()
    assert sorted(zarr.open_consolidated(str(store), zarr_format=3).group_keys()) == ["delta", "gather", "grid", "matrix"]
    with pytest.warns(UserWarning, match="Consolidated metadata"):
        zarr.consolidate_metadata(str(store))
    assert (store / "zarr.json").read_bytes() == before
    assert inspect_store(store).passed
