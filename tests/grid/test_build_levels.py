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
