"""``bevcompile grid`` at several feature levels (``feature.levels``): one set of groups per level."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bevcompile.grid.build import grid_command_groups, run_grid
from bevcompile.rig.config import RigConfig, parse_config
from bevcompile.store.inspection import inspect_store
from bevcompile.store.loader import load
from bevcompile.store.verify import verify_store

from .. import rigs


def multi_level_rig(**kwargs: Any) -> RigConfig:
    """The small rig (96x64 input) with two feature levels: stride 8 (12x8) and 16 (6x4)."""
    data = rigs.small_rig_data(distortion=True, heights=(-0.5, 0.0), bev_half_m=16.0, **kwargs)
    data["feature"] = {"levels": [{"stride": 8}, {"stride": 16, "pixel_mapping": "normalized"}]}
    return parse_config(data)


@pytest.fixture(scope="module")
def multi_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return run_grid(multi_level_rig(), tmp_path_factory.mktemp("levels"), formats=("opencv",)).store


def test_every_level_has_its_groups_equal_to_the_single_level_build(multi_store: Path, tmp_path: Path) -> None:
    """Level 0 is grid/ gather/ delta/, level 1 grid_l1/ gather_l1/ delta_l1/; each group holds
    exactly the arrays (same bytes) the single-level build of that level (``rig.level(l)``) gives,
    so level 1's tables address level 1's own 6x4 feature maps."""
    rig = multi_level_rig()
    store = load(multi_store)
    assert grid_command_groups(rig) == ("grid", "gather", "delta", "grid_l1", "gather_l1", "delta_l1")
    assert set(store.group_names) == set(grid_command_groups(rig))
    assert store.n_levels == 2 and store.level_feature_size(1) == (6, 4)
    for level in (0, 1):
        single = load(run_grid(rig.level(level), tmp_path / f"l{level}", formats=("opencv",)).store)
        for base in ("grid", "gather", "delta"):
            ours, theirs = store.level_group(base, level), single[base]
            assert set(ours) == set(theirs), (base, level)
            for name in ours:
                assert np.asarray(ours[name]).tobytes() == np.asarray(theirs[name]).tobytes(), f"{base} level {level} {name}"
    assert store["gather_l1"]["index"].max() < rig.n_cam * 6 * 4  # indexes level 1's features
    assert not np.array_equal(store["grid"]["coords"], store["grid_l1"]["coords"])  # other map, other pixels


def test_a_multi_level_store_passes_inspect_strict_and_verify_per_level(multi_store: Path) -> None:
    assert inspect_store(multi_store).passed
    strict = inspect_store(multi_store, strict=True)
    assert strict.passed
    assert any(c.array.startswith("grid_l1/") and c.name == "strict" for c in strict.checks)
    levels_check = [c for c in strict.checks if c.name == "feature_levels"]
    assert {c.array for c in levels_check} == {"grid/", "gather/", "delta/"} and all(c.passed for c in levels_check)
    report = verify_store(multi_store)
    assert report.passed
    assert any("level 1" in r.product or r.product.startswith("grid_l1/") for r in report.rows)


def test_a_missing_or_extra_level_group_fails_inspect(multi_store: Path, tmp_path: Path) -> None:
    import shutil

    from .. import damage

    missing = damage.copy_store(multi_store, tmp_path / "missing.zarr")
    shutil.rmtree(missing / "gather_l1")
    failures = [(c.name, c.array) for c in inspect_store(missing).failures]
    assert ("feature_levels", "gather/") in failures
    extra = damage.copy_store(multi_store, tmp_path / "extra.zarr")
    shutil.copytree(extra / "grid_l1", extra / "grid_l5")
    failures = [(c.name, c.array) for c in inspect_store(extra).failures]
    assert ("feature_level", "grid_l5/") in failures


def test_damage_in_a_level_group_is_reported_under_its_own_name(multi_store: Path, tmp_path: Path) -> None:
    from .. import damage

    copy = damage.copy_store(multi_store, tmp_path / "damaged.zarr")
    index = np.asarray(load(copy)["gather_l1"]["index"]).copy()
    index.reshape(-1)[5] += 1
    damage.rewrite_array(copy, "gather_l1/index", index)
    failures = {c.array for c in inspect_store(copy).failures}
    assert failures and all(a.startswith("gather_l1/") for a in failures), failures


def level_grid_rig(flip: bool = False) -> RigConfig:
    """The small pinhole rig (corner mapping) with level 1 on its own grid: 1.5 x 2 m cells,
    x in [-12, 12], y in [-9, 9], one height 0.5 m (level 0: 1 m cells in [-16, 16], heights 0 and 1)."""
    data = rigs.small_rig_data(heights=(0.0, 1.0), bev_half_m=16.0, pixel_mapping="corner")
    data["feature"] = {"levels": [{"stride": 8}, {"stride": 16, "bev": {"x": [-12, 12, 1.5], "y": [-9, 9, 2.0], "heights": [0.5]}}], "pixel_mapping": "corner"}
    if flip:
        data["image_aug"]["flip"] = True
    return parse_config(data)


def test_a_level_on_its_own_grid_lays_its_groups_out_on_it(tmp_path: Path) -> None:
    """``feature.levels[1].bev``: grid_l1/, gather_l1/, delta_l1/ are the single-level build of
    ``rig.level(1)`` (its own 16 x 9 cells, one height) bit for bit, with that grid's coordinates
    (x, y in metres, height); the Fast-BEV LUT of level 1 is on it too (interop/ axes x_l1, y_l1,
    height_l1 with their coordinates); the store passes inspect --strict and verify;
    ``GridGather(store, level=1)`` returns level 1's grid; xarray selects by its metres."""
    import warnings

    import torch
    import xarray as xr

    from bevcompile.deploy.torch import GridGather
    from bevcompile.interop.export import run_export_interop
    from bevcompile.interop.fastbev import FastBevOptions

    rig = level_grid_rig()
    path = run_grid(rig, tmp_path).store
    run_export_interop(path, {"fastbev-lut": FastBevOptions("last", "float32", True).to_dict()})
    store = load(path)
    assert store.level_bev_shape(1) == (1, 9, 16) and store.bev_shape == (2, 32, 32)
    single = load(run_grid(rig.level(1), tmp_path / "single").store)
    for base in ("grid", "gather", "delta"):
        ours, theirs = store.level_group(base, 1), single[base]
        assert set(ours) == set(theirs)
        for name in ours:
            assert np.asarray(ours[name]).tobytes() == np.asarray(theirs[name]).tobytes(), (base, name)
    assert store["grid_l1"]["valid"].shape == (4, 1, 9, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        grid_l1 = xr.open_zarr(path, group="grid_l1")
        interop = xr.open_zarr(path, group="interop")
    np.testing.assert_array_equal(grid_l1["x"].values, -12 + 1.5 * (np.arange(16) + 0.5))
    np.testing.assert_array_equal(grid_l1["y"].values, -9 + 2.0 * (np.arange(9) + 0.5))
    np.testing.assert_array_equal(grid_l1["height"].values, [0.5])
    assert interop["fastbev_lut_l1"].dims == ("height_l1", "y_l1", "x_l1") and interop["fastbev_lut"].dims == ("height", "y", "x")
    np.testing.assert_array_equal(interop["x_l1"].values, grid_l1["x"].values)
    cell = interop["fastbev_lut_l1"].sel(x_l1=8.25, y_l1=0.0, height_l1=0.5)
    assert int(cell) == int(store["interop"]["fastbev_lut_l1"][0, 4, 13])
    assert inspect_store(path).passed and inspect_store(path, strict=True).passed and verify_store(path).passed
    gather = GridGather(path, level=1)
    assert gather(torch.rand(1, 4, 3, 4, 6)).shape == (1, 3, 1, 9, 16)


def test_flipped_grid_coords_are_the_mirrored_input_pixels(tmp_path: Path) -> None:
    """``image_aug.flip`` reaches the stored grid: with the corner mapping, a flipped cell's
    feature u is ``W_crop / s - u`` of the unflipped one (96 / 8 = 12 at level 0, 6 at level 1), v
    unchanged, wherever the cell is valid in both; the flipped store passes inspect --strict and verify."""
    plain, flipped = (load(run_grid(level_grid_rig(flip), tmp_path / str(flip)).store) for flip in (False, True))
    for level, w_f in ((0, 12.0), (1, 6.0)):
        a, b = plain.level_group("grid", level), flipped.level_group("grid", level)
        both = np.asarray(a["valid"]) & np.asarray(b["valid"])
        assert both.sum() > 50
        coords_a, coords_b = np.asarray(a["coords"], dtype=np.float64), np.asarray(b["coords"], dtype=np.float64)
        np.testing.assert_allclose(coords_b[both][:, 0], w_f - coords_a[both][:, 0], rtol=0, atol=2e-5)
        np.testing.assert_array_equal(coords_b[both][:, 1], coords_a[both][:, 1])
    assert inspect_store(flipped.path, strict=True).passed and verify_store(flipped.path).passed
