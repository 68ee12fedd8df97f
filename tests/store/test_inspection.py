"""The inspect runner (bevcompile.checks): path resolution, root checks, damage, plug-ins, --strict."""

from __future__ import annotations

import json
import os
import shutil
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bevcompile._version import __version__
from bevcompile.errors import UsageError
from bevcompile.grid.build import group_dimension_names, run_grid
from bevcompile.rig.config import RigConfig, config_sha256, parse_config
from bevcompile.store import plugins as checks_api
from bevcompile.store.inspection import InspectReport, StoreReport, inspect_paths, inspect_store, resolve_store_paths
from bevcompile.store.root import root_attributes
from bevcompile.store.zarr_io import open_store, write_groups

from .. import damage, rigs


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("stores")
    return {
        "small": run_grid(rigs.small_rig(), base / "small").store,
        "multi_ac": run_grid(
            rigs.small_rig(distortion=True, heights=(-0.5, 0.0, 1.0), bev_half_m=20.0), base / "multi", align_corners=True
        ).store,
        "nuscenes": run_grid(rigs.nuscenes_rig(), base / "nuscenes").store,
        "distorted": run_grid(rigs.distorted_rig(), base / "distorted", align_corners=True).store,
    }


@pytest.fixture
def small_copy(stores: dict[str, Path], tmp_path: Path) -> Path:
    return damage.copy_store(stores["small"], tmp_path / "small.zarr")


def _failures(report: StoreReport) -> list[tuple[str, str]]:
    return [(c.array, c.name) for c in report.failures]


def _only_grid_plugin(monkeypatch: pytest.MonkeyPatch) -> None:
    """Isolate from other engineers' grid plug-ins when a test adds arrays to grid/."""
    monkeypatch.setitem(checks_api.GROUP_PLUGINS, "grid", ("bevcompile.grid.checks.base",))


# --------------------------------------------------------------------------------------
# fresh stores pass (what CI runs after `bevcompile grid`)
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["small", "multi_ac", "nuscenes", "distorted"])
@pytest.mark.parametrize("strict", [False, True])
def test_fresh_grid_store_passes(stores: dict[str, Path], name: str, strict: bool) -> None:
    report = inspect_store(stores[name], strict=strict)
    assert report.failures == []
    assert len(report.checks) >= 25
    if strict:
        assert sum(1 for c in report.checks if c.name == "strict" and c.passed) >= 4


def test_folder_of_stores_and_json_report(stores: dict[str, Path]) -> None:
    report = inspect_paths([stores["small"].parent, stores["nuscenes"].parent])
    assert [Path(s.path).name for s in report.stores] == ["small.zarr", "nuscenes.zarr"]
    assert report.passed and report.n_failed == 0 and report.n_checks > 50
    data = json.loads(json.dumps(report.to_json(), allow_nan=False))
    store = data["stores"][1]
    assert store["name"] == "nuscenes" and store["config_sha256"] == config_sha256(rigs.nuscenes_rig())
    coords = store["groups"]["grid"]["arrays"]["coords"]
    assert coords["shape"] == [6, 1, 128, 128, 2] and coords["dtype"] == "float32"
    assert coords["bytes_in_memory"] == 6 * 128 * 128 * 2 * 4 and 0 < coords["bytes_on_disk"] < coords["bytes_in_memory"]
    assert store["groups"]["grid"]["key_attributes"]["align_corners"] is False
    assert "norm_int16.max_error_px" in store["groups"]["grid"]["key_attributes"]
    assert {"name", "array", "passed", "reason"} == set(store["checks"][0])


# --------------------------------------------------------------------------------------
# path resolution (exit 2 territory)
# --------------------------------------------------------------------------------------


def test_resolve_rejects_what_is_not_a_store(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="no such store or folder"):
        resolve_store_paths([tmp_path / "missing"])
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(UsageError, match="it is a file"):
        resolve_store_paths([tmp_path / "file.txt"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError, match=r"holds no <name>\.zarr store"):
        resolve_store_paths([tmp_path / "empty"])


def test_resolve_keeps_a_store_without_root_metadata_and_dedups(small_copy: Path) -> None:
    damage.delete_metadata(small_copy, "")
    assert resolve_store_paths([small_copy, small_copy.parent, small_copy]) == [small_copy]


# --------------------------------------------------------------------------------------
# damage: each yields failed checks with a one-line reason, never a traceback
# --------------------------------------------------------------------------------------

def _flip_align_corners_everywhere(store: Path) -> None:
    damage.edit_attr(store, "grid", ["align_corners"], True)
    damage.edit_attr(store, "grid", ["build_options", "align_corners"], True)


DAMAGES: list[tuple[str, Callable[[Path], object], str, str, str]] = [
    ("missing chunk", lambda s: damage.delete_chunk(s, "grid/coords"), "grid/coords", "read", "1 of 4 chunk(s) missing"),
    ("truncated chunk", lambda s: damage.truncate_chunk(s, "grid/norm"), "grid/norm", "read", "chunk data unreadable"),
    ("garbage chunk", lambda s: damage.garbage_chunk(s, "grid/valid"), "grid/valid", "read", "chunk data unreadable"),
    ("root zarr.json deleted", lambda s: damage.delete_metadata(s, ""), "/", "root_metadata", "no zarr.json at its root"),
    ("root zarr.json corrupt", lambda s: damage.corrupt_metadata(s, ""), "/", "root_metadata", "root metadata unreadable"),
    ("group zarr.json deleted", lambda s: damage.delete_metadata(s, "grid"), "grid/", "node_metadata", "group folder has no readable zarr.json"),
    ("array zarr.json deleted", lambda s: damage.delete_metadata(s, "grid/norm_int16"), "grid/norm_int16", "node_metadata", "array folder has no readable zarr.json"),
    ("array zarr.json corrupt", lambda s: damage.corrupt_metadata(s, "grid/norm"), "grid/norm", "node_metadata", "JSONDecodeError"),
    ("align_corners flipped", lambda s: damage.edit_attr(s, "grid", ["align_corners"], True), "grid/", "build_options", "disagrees"),
    (
        "align_corners flipped everywhere",
        lambda s: _flip_align_corners_everywhere(s),
        "grid/norm",
        "norm_matches_coords",
        "align_corners=True",
    ),
    (
        "max_error_px lowered",
        lambda s: damage.edit_attr(s, "grid", ["norm_int16", "max_error_px"], damage.get_attr(s, "grid", ["norm_int16", "max_error_px"]) / 2),
        "grid/norm_int16",
        "decodes_within_recorded_error",
        "value(s) over",
    ),
    ("config edited", lambda s: damage.edit_attr(s, "", ["config", "depth", "bins"], [1.0, 30.0, 1.0]), "/", "config", "vs recorded"),
    ("config broken", lambda s: damage.edit_attr(s, "", ["config", "bev", "x"], [1.0, -1.0, 0.5]), "/", "config", "bev.x: min must be < max"),
    ("conventions changed", lambda s: damage.edit_attr(s, "", ["conventions", "pixel_centres"], "corners"), "/", "conventions", "pixel_centres differ"),
    ("convention unknown to this tool", lambda s: damage.edit_attr(s, "", ["conventions", "feature_wavelet"], "x"), "/", "conventions", "feature_wavelet differ"),
    ("format unknown", lambda s: damage.edit_attr(s, "", ["format"], "bevcompile/99"), "/", "format", "'bevcompile/99'"),
    ("tool_version missing", lambda s: damage.edit_attr(s, "", ["tool_version"], ""), "/", "tool_version", "built by bevcompile ''"),
    (
        "wrong dtype (hash updated)",
        lambda s: damage.rewrite_array(s, "grid/coords", open_store(s).read("grid", "coords").astype(np.float64)),
        "grid/coords",
        "contract",
        "dtype float64; config implies (4, 1, 24, 24, 2) float32",
    ),
    ("group deleted", lambda s: shutil.rmtree(s / "delta"), "/", "groups_recorded", "recorded group(s) missing: delta/ (deleted, or a partial copy)"),
    ("group replaced by a file", lambda s: _replace_by_file(s / "gather"), "gather", "node_metadata", "not a folder where a group should be"),
    ("array replaced by a dangling link", lambda s: _replace_by_link(s / "grid" / "norm", "/nonexistent"), "grid/norm", "node_metadata", "not a folder where an array should be"),
    ("chunk replaced by a dangling link", lambda s: _replace_by_link(damage.chunk_files(s, "grid/coords")[0], "/nonexistent"), "grid/coords", "read", "1 of 4 chunk(s) missing"),
    ("chunk replaced by a link loop", lambda s: _replace_by_link(damage.chunk_files(s, "grid/valid")[0], "loop"), "grid/valid", "read", "1 of 4 chunk(s) missing"),
    (
        "wrong dtype (hash kept)",
        lambda s: damage.rewrite_array(s, "grid/valid", open_store(s).read("grid", "valid").astype(np.uint8), update_sha256=False),
        "grid/valid",
        "sha256",
        "does not match recorded",
    ),
]


def _replace_by_file(path: Path) -> None:
    shutil.rmtree(path)
    path.write_text("not a group")


def _replace_by_link(path: Path, target: str) -> None:
    """``path`` (a file or folder) becomes a symlink to ``target``; ``"loop"``: a link to itself."""
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink()
    os.symlink(path if target == "loop" else target, path)


@pytest.mark.parametrize(("label", "corrupt", "array", "check", "reason"), DAMAGES, ids=[d[0] for d in DAMAGES])
def test_damage_yields_a_named_failed_check(
    small_copy: Path, label: str, corrupt: Callable[[Path], object], array: str, check: str, reason: str
) -> None:
    corrupt(small_copy)
    report = inspect_store(small_copy)
    assert not report.passed
    matching = [c for c in report.failures if c.array == array and c.name == check]
    assert matching, f"{label}: no failed {array} {check}; failures: {report.failure_lines()}"
    assert reason in matching[0].reason
    for line in report.failure_lines():
        assert "\n" not in line and line.startswith(f"{small_copy}: ")


def test_conventions_are_append_only(small_copy: Path) -> None:
    """A store built before a sentence was added (here: without the two newest pixel mappings)
    still passes, and the report says which sentences it lacks."""
    conventions = damage.get_attr(small_copy, "", ["conventions"])
    del conventions["feature_corner"], conventions["feature_normalized"]
    damage.edit_attr(small_copy, "", ["conventions"], conventions)
    report = inspect_store(small_copy)
    assert report.passed, report.failure_lines()
    (check,) = [c for c in report.checks if c.name == "conventions"]
    assert check.passed and "2 added since the store was built (feature_corner, feature_normalized)" in check.reason


def test_a_corrupt_array_does_not_hide_its_siblings(small_copy: Path) -> None:
    damage.corrupt_metadata(small_copy, "grid/norm")
    report = inspect_store(small_copy)
    sha_ok = {c.array for c in report.checks if c.name == "sha256" and c.passed}
    assert {"grid/coords", "grid/valid", "grid/norm_int16", "gather/index"} <= sha_ok
    assert "grid/norm" not in sha_ok


def test_hand_edit_with_consistent_hash_is_caught_by_strict_only(small_copy: Path) -> None:
    """One norm value moved by one float32 ulp where that stays inside every derived tolerance:
    all non-strict invariants still hold (the hash is updated too), --strict sees the edit."""
    reader = open_store(small_copy)
    rig = parse_config(reader.root_attrs["config"])
    norm = reader.read("grid", "norm")
    coords = reader.read("grid", "coords").astype(np.float64)
    valid = reader.read("grid", "valid")
    w_f, _ = rig.feature_size
    exact = (2.0 * coords[..., 0] + 1.0) / w_f - 1.0
    nudged = np.nextafter(norm[..., 0], np.float32(np.inf))
    tol = (2.0 / w_f) * 0.5 * np.spacing(np.abs(coords[..., 0]).astype(np.float32)) + 0.5 * np.spacing(np.abs(nudged))
    scaled = nudged.astype(np.float64) * 32767
    far_from_half = np.abs(np.abs(scaled - np.floor(scaled)) - 0.5) > 0.01
    candidates = np.argwhere(valid & (np.abs(nudged - exact) < 0.9 * tol) & far_from_half)
    assert len(candidates) > 0
    cell = tuple(int(i) for i in candidates[0])
    norm = norm.copy()
    norm[(*cell, 0)] = nudged[cell]
    damage.rewrite_array(small_copy, "grid/norm", norm)
    assert inspect_store(small_copy).passed
    strict = inspect_store(small_copy, strict=True)
    assert _failures(strict) == [("grid/norm", "strict")]
    assert "1 of 4608 element(s) differ" in strict.failures[0].reason


def test_store_of_another_calibration_with_consistent_hash_is_caught(small_copy: Path) -> None:
    """A hand-edited calibration (hash recomputed so the config check passes) no longer matches
    the arrays: the re-projection check fails without --strict."""
    attrs = open_store(small_copy).root_attrs
    config = attrs["config"]
    config["cameras"][0]["sensor2ego"][0][3] += 0.05  # FRONT camera 5 cm forward
    rig = parse_config(config)
    damage.edit_attr(small_copy, "", ["config"], config)
    damage.edit_attr(small_copy, "", ["config_sha256"], config_sha256(rig))
    report = inspect_store(small_copy)
    assert ("grid/coords", "coords_match_config") in _failures(report)
    assert ("/", "config") not in _failures(report)


def test_empty_store_fails(tmp_path: Path) -> None:
    rig = rigs.small_rig()
    path = tmp_path / "small.zarr"
    write_groups(path, root_attrs=root_attributes(rig), groups={})
    report = inspect_store(path)
    assert _failures(report) == [("/", "groups")]


def test_renamed_store_passes_with_a_note(stores: dict[str, Path], tmp_path: Path) -> None:
    copy = damage.copy_store(stores["small"], tmp_path / "deployed_v3.zarr")
    report = inspect_store(copy)
    assert report.passed
    assert any("not small.zarr" in n for n in report.notes)


# --------------------------------------------------------------------------------------
# plug-ins
# --------------------------------------------------------------------------------------


def _add_group(store: Path, group: str, arrays: dict[str, np.ndarray] | None = None) -> None:
    rig = parse_config(open_store(store).root_attrs["config"])
    data = rigs.group_data(arrays if arrays is not None else {"x": np.arange(4, dtype=np.int32)}, {"build_options": {}})
    write_groups(store, root_attrs=root_attributes(rig), groups={group: data})


def test_plugin_checks_run_and_their_exceptions_become_failed_checks(small_copy: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(checks_api.GROUP_PLUGINS, "fake", ("tests.fake_plugins",))
    monkeypatch.setitem(checks_api.GROUP_PLUGINS, "boom", ("tests.fake_plugins",))
    _add_group(small_copy, "fake")
    _add_group(small_copy, "boom")
    report = inspect_store(small_copy, strict=True)
    assert ("fake/x", "fake_content") in [(c.array, c.name) for c in report.checks if c.passed]
    assert ("fake/x", "strict") in [(c.array, c.name) for c in report.checks if c.passed]
    boom = [c for c in report.failures if c.array == "boom/"]
    assert [c.name for c in boom] == ["plugin_error", "strict"]
    assert boom[0].reason == "tests.fake_plugins.check_boom raised RuntimeError: plug-in exploded with a second line"
    assert "ZeroDivisionError" in boom[1].reason
    assert ("boom/x", "cannot_rebuild") in _failures(report)


@pytest.mark.parametrize("strict", [False, True])
def test_a_plugin_out_of_memory_is_not_a_damaged_store(small_copy: Path, monkeypatch: pytest.MonkeyPatch, strict: bool) -> None:
    """MemoryError is about the machine: it propagates (the CLI makes it one line, exit 2)
    instead of becoming a failed `plugin_error` check that calls an intact store damaged."""
    import bevcompile.store.inspection as checks_module
    from bevcompile.store.verify import verify_store

    monkeypatch.setitem(checks_api.GROUP_PLUGINS, "oom", ("tests.fake_plugins",))
    _add_group(small_copy, "oom")
    if strict:  # only the rebuild runs out of memory
        monkeypatch.setattr(checks_module, "run_plugin_checks", lambda loaded: None)
    with pytest.raises(MemoryError):
        inspect_store(small_copy, strict=strict)
    if not strict:
        with pytest.raises(MemoryError):
            verify_store(small_copy)


def test_unknown_group_and_plugin_not_installed(small_copy: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(checks_api.GROUP_PLUGINS, "later", ("bevcompile.plugin_that_does_not_exist_yet",))
    _add_group(small_copy, "later")
    _add_group(small_copy, "mystery")
    report = inspect_store(small_copy)
    failures = {(c.array, c.name): c.reason for c in report.failures}
    assert set(failures) == {("later/", "unknown_group"), ("mystery/", "unknown_group")}
    assert "not installed" in failures[("later/", "unknown_group")]
    assert "no plug-in is registered" in failures[("mystery/", "unknown_group")]
    assert "later/: plug-in bevcompile.plugin_that_does_not_exist_yet is not installed; skipped" in report.notes


def test_plugin_that_fails_to_import_is_a_failed_check(small_copy: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    plugin_dir = tmp_path / "plugins"
    plugin_dir.mkdir()
    (plugin_dir / "broken_plugin_for_test.py").write_text("import bevcompile_no_such_dependency  # noqa\n")
    monkeypatch.syspath_prepend(str(plugin_dir))
    monkeypatch.setitem(checks_api.GROUP_PLUGINS, "fake", ("broken_plugin_for_test", "tests.fake_plugins"))
    _add_group(small_copy, "fake")
    report = inspect_store(small_copy)
    assert _failures(report) == [("fake/", "plugin_import")]
    assert "No module named 'bevcompile_no_such_dependency'" in report.failures[0].reason
    assert any(c.name == "fake_content" and c.passed for c in report.checks)  # the other plug-in still ran


def test_plugin_warnings_become_notes(small_copy: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(checks_api.GROUP_PLUGINS, "noisy", ("tests.fake_plugins",))
    _add_group(small_copy, "noisy")
    report = inspect_store(small_copy)
    assert report.passed
    assert "tests.fake_plugins.check_noisy warned: RuntimeWarning: something odd over two lines" in report.notes


def test_strict_rebuild_mismatch_disagreement_and_extra(small_copy: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    other = tmp_path / "plugins"
    other.mkdir()
    (other / "other_wrong_plugin_for_test.py").write_text(
        textwrap.dedent(
            """
            import numpy as np

            def rebuild_wrong(rig, attrs):
                return {"x": np.arange(4, dtype=np.int32)}
            """
        )
    )
    monkeypatch.syspath_prepend(str(other))
    monkeypatch.setitem(checks_api.GROUP_PLUGINS, "wrong", ("tests.fake_plugins", "other_wrong_plugin_for_test"))
    _add_group(small_copy, "wrong")
    report = inspect_store(small_copy, strict=True)
    failures = [(c.array, c.name, c.reason) for c in report.failures]
    assert failures == [
        ("wrong/x", "strict", "rebuilds disagree: tests.fake_plugins and other_wrong_plugin_for_test return different arrays"),
        ("wrong/x", "strict", "differs from the rebuild by tests.fake_plugins: 4 of 4 element(s) differ (max |diff| 3)"),
        ("wrong/y", "strict", "tests.fake_plugins rebuilds wrong/y from build_options but the store lacks it"),
    ]
    # plug-ins that return no "__attrs__" keep working: their group's attributes are not compared
    assert "wrong/ attributes not compared under --strict: no installed plug-in rebuilds them" in report.notes


def test_strict_cannot_rebuild_an_array_no_plugin_owns(small_copy: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _only_grid_plugin(monkeypatch)
    reader = open_store(small_copy)
    arrays = {name: reader.read("grid", name) for name in reader.arrays("grid")}
    arrays["extra"] = np.zeros(3, dtype=np.float32)
    rig = parse_config(reader.root_attrs["config"])
    group = rigs.group_data(arrays, reader.group_attrs("grid"))
    group.dims.update({name: group_dimension_names("grid", name, a.ndim, region=False) for name, a in arrays.items() if name != "extra"})
    write_groups(small_copy, root_attrs=root_attributes(rig), groups={"grid": group})
    assert _failures(inspect_store(small_copy)) == [("grid/", "contract")]  # arrays not produced by these build_options: extra
    assert _failures(inspect_store(small_copy, strict=True)) == [("grid/", "contract"), ("grid/extra", "cannot_rebuild")]


def test_unusable_config_skips_plugins_with_a_failed_check(small_copy: Path) -> None:
    damage.edit_attr(small_copy, "", ["config"], {"name": "small"})
    report = inspect_store(small_copy, strict=True)
    failures = _failures(report)
    assert ("/", "config") in failures
    assert ("grid/", "plugin_checks") in failures and ("grid/", "strict") in failures


def test_report_json_is_strict_json(small_copy: Path) -> None:
    damage.delete_chunk(small_copy, "grid/coords")
    report = InspectReport([inspect_store(small_copy)])
    data = json.loads(json.dumps(report.to_json(), allow_nan=False))
    assert data["passed"] is False and data["n_failed"] == len(report.failure_lines()) >= 1
    assert data["stores"][0]["checks"][0]["name"] == "root_metadata"


def test_report_is_deterministic(stores: dict[str, Path]) -> None:
    first = json.dumps(inspect_paths([stores["multi_ac"]], strict=True).to_json())
    second = json.dumps(inspect_paths([stores["multi_ac"]], strict=True).to_json())
    assert first == second


def test_config_parse_of_rig_used(stores: dict[str, Path]) -> None:
    """The runner's config check recomputes the hash with the library (not the attribute)."""
    rig: RigConfig = parse_config(open_store(stores["small"]).root_attrs["config"])
    assert config_sha256(rig) == open_store(stores["small"]).root_attrs["config_sha256"]


# --------------------------------------------------------------------------------------
# audit fixes: --strict compares attributes; group folders are not stores
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def npu_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    formats = ("uq12", "norm_q16", "pixel_q", "opencv")
    return run_grid(rigs.small_rig(distortion=True), tmp_path_factory.mktemp("npu"), formats=formats, align=7, order="cache", block=6).store


@pytest.mark.parametrize(
    ("node", "keys", "value", "line"),
    [
        ("delta", ["block"], 11, "attrs.block stored 11, rebuilt 6"),
        ("delta", ["max_error_px_float32_decode"], 0.001, "attrs.max_error_px_float32_decode stored 0.001, rebuilt "),
        ("delta", ["invalid_in_band"], False, "attrs.invalid_in_band stored false, rebuilt true"),
        ("gather", ["lut", "levels"], 255, "attrs.lut.levels stored 255, rebuilt 256"),
        ("gather", ["gather_max_sample_error_unit_features"], 1e-12, "attrs.gather_max_sample_error_unit_features stored 1e-12, rebuilt "),
        ("grid", ["norm_q16", "invalid_code"], -32767, "attrs.norm_q16.invalid_code stored -32767, rebuilt -32768"),
        ("grid", ["uq12", "decode"], "norm = q / 4095", 'attrs.uq12.decode stored "norm = q / 4095", rebuilt "norm = (q - 2047.5) / 2047.5"'),
        ("grid", ["zz_added"], 1, "attrs.zz_added stored 1, not written by the build"),
    ],
)
def test_strict_compares_group_attributes_key_by_key(npu_store: Path, tmp_path: Path, node: str, keys: list[str], value: object, line: str) -> None:
    store = damage.copy_store(npu_store, tmp_path / "s.zarr")
    assert inspect_store(store, strict=True).passed
    damage.edit_attr(store, node, keys, value)
    strict = inspect_store(store, strict=True)
    failed = [(c.array, c.name, c.reason) for c in strict.failures if c.name == "strict_attrs"]
    assert len(failed) == 1 and failed[0][:2] == (f"{node}/", "strict_attrs") and failed[0][2].startswith(line), failed
    assert f"{store}: {node}/: strict_attrs: {line}" in "\n".join(strict.failure_lines())


def test_strict_on_a_store_of_another_version_names_both_versions(npu_store: Path, tmp_path: Path) -> None:
    """--strict compares with what THIS version builds: a store written by another version gets a
    note naming both (the likely reason for a strict failure); one from this version gets none."""
    store = damage.copy_store(npu_store, tmp_path / "s.zarr")
    assert not any("built by bevcompile" in n for n in inspect_store(store, strict=True).notes)
    damage.edit_attr(store, "", ["tool_version"], "0.0.9")
    damage.edit_attr(store, "grid", ["zz_added"], 1)
    strict = inspect_store(store, strict=True)
    assert not strict.passed
    assert f"built by bevcompile 0.0.9, inspected with {__version__} (inspect --strict compares the bytes)" in strict.notes


def test_package_version_matches_pyproject() -> None:
    pyproject = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    assert f'\nversion = "{__version__}"\n' in pyproject


def test_group_folder_is_not_a_store_but_a_damaged_root_still_is(stores: dict[str, Path], tmp_path: Path) -> None:
    store = stores["small"]
    with pytest.raises(UsageError, match=r"grid: is the grid/ group of the store .*small\.zarr; inspect the store"):
        resolve_store_paths([store / "grid"])
    with pytest.raises(UsageError, match=r"is the grid/coords/ node of the store"):
        resolve_store_paths([store / "grid" / "coords"])
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "zarr.json").write_text(json.dumps({"zarr_format": 3, "node_type": "group", "attributes": {}}))
    with pytest.raises(UsageError, match="a zarr folder but not a bevcompile store"):
        resolve_store_paths([foreign])
    # a real store whose root attributes were wiped, or are garbage: still inspected, and fails
    for name, attrs in (("wiped.zarr", {}), ("garbage", {"format": 7})):
        broken = damage.copy_store(store, tmp_path / name)
        meta = json.loads((broken / "zarr.json").read_text())
        meta["attributes"] = attrs
        (broken / "zarr.json").write_text(json.dumps(meta))
        assert resolve_store_paths([broken]) == [broken]
        assert not inspect_store(broken).passed


def test_files_that_are_no_chunk_of_an_array_fail(small_copy: Path) -> None:
    """A store is only what zarr wrote: a stray file in an array folder, an out-of-grid chunk
    and junk among the chunks each fail node_metadata (they are invisible to zarr reads)."""
    assert inspect_store(small_copy).passed
    (small_copy / "grid" / "coords" / "README").write_text("notes")
    out_of_grid = small_copy / "grid" / "valid" / "c" / "99" / "0" / "0" / "0"
    out_of_grid.mkdir(parents=True)
    (out_of_grid / "0").write_bytes(b"x")
    (small_copy / "grid" / "norm" / "c" / "junk").write_bytes(b"x")
    reasons = {c.array: c.reason for c in inspect_store(small_copy).failures if c.name == "node_metadata"}
    assert reasons == {
        "grid/coords": "file(s) that are no chunk of this array: README",
        "grid/valid": "file(s) that are no chunk of this array: c/99/",
        "grid/norm": "file(s) that are no chunk of this array: c/junk",
    }


@pytest.mark.parametrize("mode", ["grid", "frustum", "ray"])
@pytest.mark.parametrize("provenance", ["other", "removed", "rewritten"])
def test_plain_inspect_fails_a_group_copied_from_another_rigs_store_and_load_refuses_it(tmp_path: Path, mode: str, provenance: str) -> None:
    """Two rigs that differ only in one camera's mounting (same shapes): a ``matrix/`` copied from
    the other car's store passes every shape and plug-in invariant. Its ``config_sha256`` names the
    other config (``group_config`` fails), or was removed (fails too: nothing proves whose it is)
    or rewritten to the root's (issue 31: 114/114 passed). ``values_match_config`` re-derives a
    few rows from the root's config and fails in every case."""
    from bevcompile.errors import StoreError
    from bevcompile.matrix.build import MatrixOptions, run_matrix
    from bevcompile.store.loader import load

    ours = rigs.small_rig_data()
    theirs = rigs.small_rig_data()
    theirs["cameras"][0]["sensor2ego"][0][3] += 0.05  # 5 cm further forward
    for data, out in ((ours, tmp_path / "ours"), (theirs, tmp_path / "theirs")):
        run_matrix(parse_config(data), out, MatrixOptions(mode=mode, align=1, topk=8))
    store = tmp_path / "ours" / "small.zarr"
    assert inspect_store(store).passed
    shutil.rmtree(store / "matrix")
    shutil.copytree(tmp_path / "theirs" / "small.zarr" / "matrix", store / "matrix")
    meta = json.loads((store / "matrix" / "zarr.json").read_text())
    if provenance == "removed":
        del meta["attributes"]["config_sha256"]
    elif provenance == "rewritten":
        meta["attributes"]["config_sha256"] = json.loads((store / "zarr.json").read_text())["attributes"]["config_sha256"]
    (store / "matrix" / "zarr.json").write_text(json.dumps(meta))
    damage.reconsolidate(store)  # a copy by a tool that re-consolidates: only the group's provenance tells
    report = inspect_store(store)
    failed = {(c.name, c.array): c.reason for c in report.checks if not c.passed}
    assert set(failed) == ({("group_config", "matrix/")} if provenance != "rewritten" else set()) | {("values_match_config", "matrix/coo_val")}
    assert "built from another rig's geometry" in failed[("values_match_config", "matrix/coo_val")]
    if provenance == "other":
        assert "built from another config (config_sha256 " in failed[("group_config", "matrix/")]
        with pytest.raises(StoreError, match=r"group matrix/ was built from another config .*; run `bevcompile matrix` to rebuild it"):
            load(store)["matrix"]
    elif provenance == "removed":
        assert failed[("group_config", "matrix/")].startswith("records no config_sha256")
        with pytest.raises(StoreError, match=r"group matrix/ records no config_sha256, so nothing proves .*; run `bevcompile matrix`"):
            load(store)["matrix"]


def test_values_match_config_passes_every_kind_of_matrix(tmp_path: Path) -> None:
    """The spot check re-derives what the build wrote, whatever the mode, splat, rounding,
    normalisation, K, row compaction or region (a false failure would fail a healthy store)."""
    from bevcompile.matrix.build import MatrixOptions, run_matrix

    region = rigs.small_rig_data()
    region["bev"]["region"] = {"keep": [[[-12.0, -6.0], [12.0, -6.0], [12.0, 6.0], [-12.0, 6.0]]], "rings": [{"beyond_m": 4, "factor": 2}]}
    cases = [
        (rigs.small_rig(heights=(0.0, 1.0)), MatrixOptions(mode="grid", splat="nearest", normalize="mean", topk=0)),
        (rigs.small_rig(), MatrixOptions(mode="frustum", splat="nearest", rounding="trunc", normalize="sum", topk=3, compact_rows=True)),
        (parse_config(region), MatrixOptions(mode="ray", splat="bilinear", normalize="mean", topk=0)),
        (parse_config(region), MatrixOptions(mode="grid", splat="bilinear", normalize="sum", topk=4)),
    ]
    for i, (rig, options) in enumerate(cases):
        run_matrix(rig, tmp_path / str(i), options)
        report = inspect_store(tmp_path / str(i) / f"{rig.name}.zarr")
        (check,) = [c for c in report.checks if c.name == "values_match_config"]
        assert report.passed and check.passed, [c for c in report.checks if not c.passed]
        assert " entries re-derived from the stored config" in check.reason


def test_a_group_without_a_recorded_config_fails_group_config(small_copy: Path) -> None:
    """issue 31: a group whose config_sha256 was removed passed plain inspect and --strict with a
    note; nothing proves it belongs to this store (0.3 writes it into every group)."""
    meta = json.loads((small_copy / "grid" / "zarr.json").read_text())
    del meta["attributes"]["config_sha256"]
    (small_copy / "grid" / "zarr.json").write_text(json.dumps(meta))
    damage.reconsolidate(small_copy)
    for strict in (False, True):
        report = inspect_store(small_copy, strict=strict)
        assert _failures(report) == [("grid/", "group_config")]


NEW_DAMAGE: dict[str, tuple[Callable[[Path, Path], object], str, str]] = {
    # label: (damage(store, other store), failing array, failing check)
    "root zarr.json is a FIFO": (lambda s, o: damage.fifo_metadata(s), "/", "root_metadata"),
    "group zarr.json links to /dev/zero": (lambda s, o: damage.device_metadata(s, "gather"), "gather/", "node_metadata"),
    "array zarr.json is a FIFO": (lambda s, o: damage.fifo_metadata(s, "grid/valid"), "grid/valid", "node_metadata"),
    "chunk is a FIFO": (lambda s, o: damage.fifo_chunk(s, "grid/coords"), "grid/coords", "read"),
    "chunk of 16 GiB": (lambda s, o: damage.huge_chunk(s, "grid/norm"), "grid/norm", "read"),
    "group copied from another rig": (lambda s, o: damage.foreign_group(s, "delta", o), "delta/", "group_config"),
    "stale consolidated metadata": (lambda s, o: damage.stale_consolidated(s), "/", "consolidated_metadata"),
}


@pytest.mark.parametrize("label", sorted(NEW_DAMAGE))
def test_new_damage_kinds_fail_inspect_and_load_without_hanging(label: str, stores: dict[str, Path], tmp_path: Path) -> None:
    """The damage kinds of issue 21: caught by plain inspect (a named failed check, no hang, no
    exception) and by ``bevcompile.load`` (a StoreError, never a mixed or endless read)."""
    from bevcompile.errors import StoreError
    from bevcompile.store.loader import load

    other = tmp_path / "other"
    data = rigs.small_rig_data()
    data["cameras"][0]["sensor2ego"][0][3] += 0.05
    run_grid(parse_config(data), other)
    store = damage.copy_store(stores["small"], tmp_path / "small.zarr")
    harm, array, check = NEW_DAMAGE[label]
    harm(store, other / "small.zarr")
    report = inspect_store(store)
    assert (array, check) in _failures(report), _failures(report)
    if check != "consolidated_metadata":  # the per-node metadata is intact there: load reads it
        with pytest.raises(StoreError):
            loaded = load(store)
            for group in ("grid", "gather", "delta"):  # every array folder there is, by name
                for folder in sorted(p for p in (store / group).iterdir() if p.is_dir()):
                    loaded[group][folder.name]


def test_a_lidar_frame_store_passes_inspect_strict_and_verify(tmp_path: Path) -> None:
    """Every product of a ``bev.frame: LIDAR_TOP`` store (grid, gather, delta, matrix, interop)
    is checked against the stored config's own frame: plain inspect, --strict (rebuilds) and
    verify pass, and the loader names the frame. Moving the lidar in the stored config (hash
    recomputed) fails plain inspect's re-projection, like moving a camera does."""
    from bevcompile.interop.export import run_export_interop
    from bevcompile.matrix.build import MatrixOptions, run_matrix
    from bevcompile.store.loader import load
    from bevcompile.store.verify import verify_store

    rig = parse_config(rigs.in_lidar_frame(rigs.small_rig_with_sensor_data(bev_half_m=16.0)))
    store = run_grid(rig, tmp_path).store
    run_matrix(rig, tmp_path, MatrixOptions(topk=8))
    run_export_interop(store, {"bevpoolv2": {}, "fastbev-lut": {"overlap": "last"}})
    assert load(store).bev_frame == "LIDAR_TOP"
    assert inspect_store(store).passed and inspect_store(store, strict=True).passed
    assert verify_store(store).passed
    config = open_store(store).root_attrs["config"]
    config["sensors"][0]["sensor2ego"][2][3] += 0.05  # lidar 5 cm higher: every cell moves
    damage.edit_attr(store, "", ["config"], config)
    damage.edit_attr(store, "", ["config_sha256"], config_sha256(parse_config(config)))
    assert ("grid/coords", "coords_match_config") in _failures(inspect_store(store))


def _edit_text(store: Path, node: str, edit: Callable[[str], str]) -> None:
    path = store / node / "zarr.json" if node else store / "zarr.json"
    path.write_text(edit(path.read_text()))


def _edit_json(store: Path, node: str, edit: Callable[[dict[str, Any]], None]) -> None:
    """Edit ``node``'s zarr.json; for a node below the root, also drop the root's consolidated copy
    (a store without one is only a note) so that the damage is the one check's to find, not the
    consolidated_metadata check's too ("stale consolidated metadata" is that check's case)."""
    path = store / node / "zarr.json" if node else store / "zarr.json"
    meta = json.loads(path.read_text())
    edit(meta)
    path.write_text(json.dumps(meta))  # json.dumps writes NaN / Infinity: not JSON
    if node:
        root_path = store / "zarr.json"
        root = json.loads(root_path.read_text())
        if root.pop("consolidated_metadata", None) is not None:
            root_path.write_text(json.dumps(root))


METADATA_DAMAGE: dict[str, tuple[Callable[[Path], None], str, str, str]] = {
    # issue 31: each passed plain inspect (array-level Infinity and a group without config_sha256 passed --strict too)
    "NaN in a root attribute": (
        lambda s: _edit_json(s, "", lambda m: m["attributes"].update(extra=float("nan"))), "/", "metadata_json", "attributes.extra is not a finite number"),
    "Infinity in a group attribute": (
        lambda s: _edit_json(s, "grid", lambda m: m["attributes"]["norm_int16"].update(note=float("inf"))),
        "grid/", "metadata_json", "attributes.norm_int16.note is not a finite number"),
    "-Infinity in an array attribute": (
        lambda s: _edit_json(s, "grid/valid", lambda m: m["attributes"].update(note=float("-inf"))), "grid/valid", "metadata_json", "attributes.note"),
    "fill_value NaN": (lambda s: _edit_json(s, "grid/coords", lambda m: m.update(fill_value="NaN")), "grid/coords", "array_metadata", 'fill_value "NaN", the writer\'s is 0'),
    "renamed dimension_names": (
        lambda s: _edit_json(s, "grid/coords", lambda m: m.update(dimension_names=["cam", "height", "y", "x", "uv"])),
        "grid/coords", "array_metadata", "dimension_names"),
    "swapped dimension_names": (
        lambda s: _edit_json(s, "grid/valid", lambda m: m.update(dimension_names=["camera", "height", "x", "y"])),
        "grid/valid", "array_metadata", "bevcompile.grid.checks.base names them"),
    "a byte-order mark": (lambda s: _edit_text(s, "", lambda t: "\ufeff" + t), "/", "metadata_json", "byte-order mark"),
    "a duplicate key": (lambda s: _edit_text(s, "", lambda t: t.replace('"node_type"', '"zarr_format": 3, "node_type"', 1)), "/", "metadata_json", "duplicate key 'zarr_format'"),
}


@pytest.mark.parametrize("label", sorted(METADATA_DAMAGE))
def test_metadata_that_is_not_strict_or_not_the_writers_fails_plain_inspect(small_copy: Path, label: str) -> None:
    """Every zarr.json is strict JSON (no NaN/Infinity, duplicate key or BOM: zarr and Python's
    json read all three), every array has the writer's fill_value and the dimension_names its
    group's plug-in gives; each failure names the node."""
    damage_fn, array, check, reason = METADATA_DAMAGE[label]
    damage_fn(small_copy)
    report = inspect_store(small_copy)
    failed = [(c.array, c.name, c.reason) for c in report.failures]
    assert [(a, n) for a, n, _ in failed] == [(array, check)], failed
    assert reason in failed[0][2], failed


def test_a_root_zarr_json_nested_200000_deep_is_a_failed_check_not_a_recursion_error(small_copy: Path) -> None:
    """issue 31: inspect/verify raised RecursionError (diff and grid said it in one line)."""
    from typer.testing import CliRunner

    from bevcompile.cli import app

    _edit_text(small_copy, "", lambda t: t.replace('"attributes": {', '"attributes": {"deep": ' + "[" * 200_000 + "]" * 200_000 + ", ", 1))
    result = CliRunner().invoke(app, ["inspect", str(small_copy), "--quiet"])
    assert result.exit_code == 1, result.output
    assert f"{small_copy}: /: root_metadata: " in result.stderr and "JSON nested 200,00" in result.stderr
    result = CliRunner().invoke(app, ["verify", str(small_copy), "--quiet"])
    assert result.exit_code == 2 and "JSON nested 200,00" in result.stderr and result.stderr.count("\n") == 1
