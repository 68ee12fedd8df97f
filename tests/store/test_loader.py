"""bevcompile.load: typed, read-only view of a store; clear errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from bevcompile.conventions import CONVENTIONS
from bevcompile.errors import StoreError
from bevcompile.grid.build import run_grid
from bevcompile.matrix.build import MatrixOptions
from bevcompile.rig.config import RigConfig, config_sha256, config_to_dict
from bevcompile.store.loader import LoadedStore, StoreGroup, load, matrix_layout

from ..damage import copy_store, corrupt_metadata, edit_attr, rewrite_array
from ..deploy.test_torch import add_matrix_group


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory, small_distorted_multi: RigConfig) -> Path:
    return run_grid(small_distorted_multi, tmp_path_factory.mktemp("loader"), npu=True).store


def test_load_gives_rig_conventions_and_groups(store: Path, small_distorted_multi: RigConfig) -> None:
    loaded = load(store)
    assert isinstance(loaded, LoadedStore)
    assert config_to_dict(loaded.rig) == config_to_dict(small_distorted_multi)  # the resolved config
    assert loaded.rig.source.endswith("small.zarr:config")
    assert loaded.config_sha256 == config_sha256(small_distorted_multi)
    assert dict(loaded.conventions) == CONVENTIONS
    assert loaded.format == "bevcompile/1"
    assert {"grid", "gather"} <= set(loaded.group_names)
    assert loaded.feature_size == (12, 8)
    assert loaded.bev_shape == (3, 40, 40)
    assert "grid" in loaded and "matrix" not in loaded
    assert load(loaded) is loaded  # a loaded store passes through


def test_group_arrays_and_attrs_are_read_only(store: Path) -> None:
    grid = load(store)["grid"]
    assert isinstance(grid, StoreGroup)
    assert set(grid) == {"coords", "valid", "norm", "norm_int16"} | set(grid)  # at least the foundation arrays
    coords = grid["coords"]
    assert coords.dtype == np.float32 and coords.shape == (4, 3, 40, 40, 2)
    assert not coords.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        coords[0, 0, 0, 0, 0] = 1.0
    assert grid["coords"] is coords  # cached
    with pytest.raises(TypeError):
        grid.attrs["align_corners"] = True  # type: ignore[index]
    assert grid.attrs["feature_size"] == (12, 8)  # lists become tuples
    assert grid.get("nope") is None
    assert grid.nbytes() >= coords.nbytes


def test_missing_group_and_array_are_clear_errors(store: Path) -> None:
    loaded = load(store)
    with pytest.raises(StoreError, match=r"no group matrix/ in this store .*run `bevcompile matrix`"):
        loaded["matrix"]
    with pytest.raises(StoreError, match=r"no array grid/nope \(arrays in grid/: coords"):
        loaded["grid"]["nope"]


def test_unreadable_format_version(store: Path, tmp_path: Path) -> None:
    copy = copy_store(store, tmp_path / "future.zarr")
    edit_attr(copy, "", ["format"], "bevcompile/2")
    with pytest.raises(StoreError, match=r"store format 'bevcompile/2' cannot be read by this bevcompile \(reads bevcompile/1\)"):
        load(copy)


def test_not_a_store_and_tampered_config(store: Path, tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="no such store"):
        load(tmp_path / "missing.zarr")
    copy = copy_store(store, tmp_path / "edited.zarr")
    edit_attr(copy, "", ["config", "bev", "x"], [-30.0, 30.0, 1.0])
    with pytest.raises(StoreError, match=r"stored config hash .* does not match its config"):
        load(copy)
    bad = copy_store(store, tmp_path / "bad.zarr")
    edit_attr(bad, "", ["config", "feature", "stride"], -1)
    with pytest.raises(StoreError, match=r"stored config does not parse: .*feature.stride"):
        load(bad)


def test_corrupted_array_is_refused_when_verifying(store: Path, tmp_path: Path) -> None:
    copy = copy_store(store, tmp_path / "corrupt.zarr")
    weight = np.array(load(copy)["gather"]["weight"])
    weight[0, 0, 0, 0, 0] += 0.5
    rewrite_array(copy, "gather/weight", weight, update_sha256=False)
    with pytest.raises(StoreError, match=r"gather/weight: content sha256 .* does not match recorded"):
        load(copy)["gather"]["weight"]
    assert load(copy, verify=False)["gather"]["weight"][0, 0, 0, 0, 0] == weight[0, 0, 0, 0, 0]


def test_matrix_layout(tmp_path: Path, small: RigConfig) -> None:
    path = run_grid(small, tmp_path).store
    add_matrix_group(path, small, MatrixOptions(mode="grid", topk=4, align=16, compact_rows=True, tile_rows=8))
    loaded = load(path)
    layout = matrix_layout(loaded)
    row_ids = loaded["matrix"]["row_ids"]
    assert layout.mode == "grid"
    assert layout.n_cols == 4 * 8 * 12
    assert layout.n_rows == row_ids.size < 24 * 24
    assert np.array_equal(layout.row_cells, row_ids)
    assert layout.rows_pad % 16 == 0 and layout.k_pad == 16
    assert layout.tile_rows == 8


def test_read_only_arrays_cannot_be_made_writable_again(store: Path) -> None:
    """The handed-out arrays are views of a private read-only base: setflags(write=True) raises,
    so nothing can write into the cache that later modules are built from."""
    loaded = load(store)
    index = loaded["gather"]["index"]
    with pytest.raises(ValueError, match="WRITEABLE"):
        index.setflags(write=True)
    with pytest.raises(ValueError, match="WRITEABLE"):
        index.flags.writeable = True
    assert loaded["gather"]["index"] is index


def test_a_store_rebuilt_while_loaded_is_refused_not_mixed(tmp_path: Path, small: RigConfig) -> None:
    """load(), read one array, rebuild the store (same config, other options: no --force), read
    another: a StoreError, not the new array next to the old one."""
    path = run_grid(small, tmp_path).store
    add_matrix_group(path, small, MatrixOptions(mode="grid", topk=6, align=4))
    loaded = load(path)
    index = loaded["matrix"]["ell_index"]
    unopened = load(path, verify=False)  # the check does not depend on verify
    add_matrix_group(path, small, MatrixOptions(mode="grid", topk=4, align=4))  # rewrites the store (atomic swap)
    with pytest.raises(StoreError, match=r"small\.zarr was rewritten since it was loaded \(reload it\)"):
        loaded["matrix"]["ell_weight"]
    with pytest.raises(StoreError, match="was rewritten since it was loaded"):
        unopened["matrix"]  # a group first opened after the rebuild: its attrs are the new build's
    assert loaded["matrix"]["ell_index"] is index  # what was read before stays (it is the loaded build)
    assert loaded["grid"]["coords"].shape == (4, 1, 24, 24, 2)  # grid/ is byte-identical to the loaded build's
    fresh = load(path)
    assert fresh["matrix"]["ell_weight"].shape[1] == 4  # a reload reads the new build


def test_adding_a_group_keeps_a_loaded_store_readable(tmp_path: Path, small: RigConfig) -> None:
    """load(), read grid/, add matrix/ into the same store (root `groups` attribute changes): the
    loaded grid/ and gather/ stay readable (they are byte-identical); the new group is not part of
    the loaded snapshot (a clear error says to reload), and a reload reads it."""
    path = run_grid(small, tmp_path).store
    loaded = load(path)
    coords = loaded["grid"]["coords"]
    add_matrix_group(path, small, MatrixOptions(mode="grid", topk=6, align=4))
    assert np.array_equal(loaded["grid"]["norm"], load(path)["grid"]["norm"])
    assert loaded["gather"]["index"].shape[-1] == 4
    assert loaded["grid"]["coords"] is coords
    with pytest.raises(StoreError, match=r"small\.zarr: group matrix/ was added after this store was loaded; reload it"):
        loaded["matrix"]
    assert load(path)["matrix"]["ell_index"].shape[1] == 8  # k_pad = 6 padded to align 4


def test_unreadable_group_and_array_are_not_reported_as_missing(store: Path, tmp_path: Path) -> None:
    bad_group = copy_store(store, tmp_path / "bad_group.zarr")
    corrupt_metadata(bad_group, "gather")
    with pytest.raises(StoreError, match=r"group gather/ is present but unreadable \(.*\); run `bevcompile grid` to rewrite it"):
        load(bad_group)["gather"]
    # present means present: GridGather(source="auto") must not fall back to grid/ in silence
    assert load(bad_group).has_group("gather") and "gather" in load(bad_group)
    assert not load(bad_group).has_group("matrix")
    bad_array = copy_store(store, tmp_path / "bad_array.zarr")
    corrupt_metadata(bad_array, "gather/index")
    with pytest.raises(StoreError, match=r"array gather/index is present but unreadable \(.*\)"):
        load(bad_array)["gather"]["index"]
    with pytest.raises(StoreError, match=r"no array gather/nope \(arrays in gather/"):
        load(bad_array)["gather"]["nope"]
