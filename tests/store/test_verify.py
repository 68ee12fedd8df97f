"""The verify runner (bevcompile.verify): features, target resolution, staleness, damage, plug-ins."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from bevcompile.errors import CheckFailed, ConfigError, StoreError, UsageError
from bevcompile.grid.build import run_grid
from bevcompile.rig.config import parse_config
from bevcompile.store import plugins as checks_api
from bevcompile.store.root import root_attributes
from bevcompile.store.verify import make_features, resolve_target, verify_store
from bevcompile.store.zarr_io import open_store, write_groups

from .. import damage, rigs


@pytest.fixture(scope="module")
def small_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return run_grid(rigs.small_rig(distortion=True, heights=(0.0, 0.5)), tmp_path_factory.mktemp("verify")).store


@pytest.fixture
def small_copy(small_store: Path, tmp_path: Path) -> Path:
    return damage.copy_store(small_store, tmp_path / small_store.name)


def test_features_are_seeded_shaped_and_normalised() -> None:
    rig = rigs.small_rig()
    features, depth = make_features(rig, 5, 3)
    w_f, h_f = rig.feature_size
    assert features.shape == (rig.n_cam, 5, h_f, w_f) and features.dtype == np.float32
    assert depth.shape == (rig.n_cam, rig.depth.n_bins, h_f, w_f) and depth.dtype == np.float32
    assert features.min() >= 0.0 and features.max() < 1.0
    np.testing.assert_allclose(depth.sum(axis=1), 1.0, atol=1e-6)
    again, depth_again = make_features(rig, 5, 3)
    assert again.tobytes() == features.tobytes() and depth_again.tobytes() == depth.tobytes()
    other, _ = make_features(rig, 5, 4)
    assert other.tobytes() != features.tobytes()


@pytest.mark.parametrize(("channels", "seed"), [(0, 0), (10_000, 0), (4, -1)])
def test_bad_feature_options_are_usage_errors(channels: int, seed: int) -> None:
    with pytest.raises(UsageError):
        make_features(rigs.small_rig(), channels, seed)


def test_fresh_store_verifies_with_every_row_measured(small_store: Path) -> None:
    report = verify_store(small_store, seed=1, channels=3)
    assert report.passed and report.failures == []
    rig = rigs.small_rig(distortion=True, heights=(0.0, 0.5))
    grid_rows = [r for r in report.rows if r.product.startswith(("grid/", "torch"))]
    assert {r.camera for r in grid_rows} == set(rig.camera_names)
    assert len(grid_rows) == 5 * rig.n_cam  # coords, norm, norm_int16, torch float64, torch float32
    measured = [r for r in grid_rows if r.product != "torch grid_sample(grid/norm)"]  # float64 torch may equal numpy exactly
    assert all(r.max_abs > 0 and r.mean_abs > 0 and math.isfinite(r.psnr_db) for r in measured)
    data = json.loads(json.dumps(report.to_json(), allow_nan=False))
    assert data["passed"] is True and data["seed"] == 1 and data["channels"] == 3 and data["feature_peak"] == 1.0


def test_same_seed_same_report(small_store: Path) -> None:
    assert verify_store(small_store, seed=5).to_json() == verify_store(small_store, seed=5).to_json()


def test_resolve_target_config_store_and_default(small_store: Path, tmp_path: Path) -> None:
    yaml_path = rigs.write_yaml(tmp_path / "rig.yaml", rigs.small_rig_data(distortion=True, heights=(0.0, 0.5)))
    store, rig = resolve_target(yaml_path, small_store.parent)
    assert store == small_store and rig is not None and rig.name == "small"
    assert resolve_target(small_store, "unused") == (small_store, None)
    with pytest.raises(StoreError, match="no store for rig 'nuscenes'"):
        resolve_target(None, tmp_path)
    with pytest.raises(StoreError, match=r"no store for rig 'small'.*bevcompile grid"):
        resolve_target(yaml_path, tmp_path / "elsewhere")
    with pytest.raises(StoreError, match="no such store or config file"):
        resolve_target(tmp_path / "nothing.zarr", tmp_path)
    with pytest.raises(ConfigError, match="file not found"):
        resolve_target(tmp_path / "nothing.yaml", tmp_path)
    (tmp_path / "plain").mkdir()
    with pytest.raises(StoreError, match=r"plain: not a store, and holds no <name>.zarr store"):
        resolve_target(tmp_path / "plain", tmp_path)


def test_stale_store_is_a_failed_check_naming_the_rebuild(small_store: Path, tmp_path: Path) -> None:
    data = rigs.small_rig_data(distortion=True, heights=(0.0, 0.5))
    data["cameras"][0]["intrinsic"][0][0] = 111.0
    yaml_path = rigs.write_yaml(tmp_path / "recalibrated.yaml", data)
    store, rig = resolve_target(yaml_path, small_store.parent)
    with pytest.raises(CheckFailed, match=r"stale: .*rebuild with `bevcompile grid` / `bevcompile matrix`"):
        verify_store(store, expected_rig=rig)


def test_damaged_store_gives_failed_integrity_rows(small_copy: Path) -> None:
    damage.garbage_chunk(small_copy, "grid/norm")
    report = verify_store(small_copy)
    assert not report.passed
    integrity = [r for r in report.failures if r.product == "integrity"]
    assert [r.camera for r in integrity][:1] == ["grid/norm"]
    assert "chunk data unreadable" in integrity[0].note
    # the grid plug-in cannot run without grid/norm: its exception is a failed row, not a traceback
    assert any(r.camera == "grid/" and "grid/norm missing or unreadable" in r.note for r in integrity)
    json.dumps(report.to_json(), allow_nan=False)
    assert all("\n" not in line for line in report.failure_lines())


def test_tampered_norm_fails_verify(small_copy: Path) -> None:
    reader = open_store(small_copy)
    norm = reader.read("grid", "norm").copy()
    valid = reader.read("grid", "valid")
    norm[0][valid[0], 1] += np.float32(0.1)
    damage.rewrite_array(small_copy, "grid/norm", norm)
    report = verify_store(small_copy)
    failed = {(r.product, r.camera) for r in report.failures if r.product != "integrity"}
    # torch and numpy agree on the tampered grid: only the comparison with the projection fails ...
    assert failed == {("grid/norm", "FRONT")}
    # ... and inspect's invariants, which verify runs too, name the arrays that disagree with coords
    integrity = {r.camera for r in report.failures if r.product == "integrity"}
    assert integrity == {"grid/norm", "grid/norm_int16"}


def test_plugin_verify_rows_and_exceptions(small_copy: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(checks_api.GROUP_PLUGINS, "fake", ("tests.fake_plugins",))
    monkeypatch.setitem(checks_api.GROUP_PLUGINS, "boom", ("tests.fake_plugins",))
    rig = parse_config(open_store(small_copy).root_attrs["config"])
    for group in ("fake", "boom"):
        write_groups(small_copy, root_attrs=root_attributes(rig), groups={group: rigs.group_data({"x": np.arange(4, dtype=np.int32)})})
    report = verify_store(small_copy, channels=2)
    fake = [r for r in report.rows if r.product == "fake/x"]
    w_f, h_f = rig.feature_size
    assert len(fake) == 1 and fake[0].passed and fake[0].note == f"features {(rig.n_cam, 2, h_f, w_f)}"
    boom = [r.note for r in report.failures if r.camera == "boom/"]
    # verify runs inspect's checks too: check_boom's and verify_boom's exceptions are one failed row each
    assert len(boom) == 2
    assert any("tests.fake_plugins.verify_boom raised KeyError" in note for note in boom)
    assert any("check_boom raised RuntimeError: plug-in exploded with a second line" in note for note in boom)


def test_store_with_nothing_verifiable_fails(tmp_path: Path) -> None:
    rig = rigs.small_rig()
    path = tmp_path / "small.zarr"
    write_groups(path, root_attrs=root_attributes(rig), groups={})
    report = verify_store(path)
    assert not report.passed
