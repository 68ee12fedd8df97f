"""One vehicle without Dask: byte-identical to the single commands, atomic and isolated failures,
resume, cancellation, and the calibration shift equal to ``bevcompile diff``'s."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import bevcompile.fleet.task as task_mod
from bevcompile import load
from bevcompile._version import __version__ as VERSION
from bevcompile.fleet.manifest import load_manifest
from bevcompile.fleet.task import Cancelled, FleetContext, VehicleResult, compile_vehicle, flags_for
from bevcompile.report.diff import diff_stores
from bevcompile.store.inspection import StoreReport

from ..rigs import tree_digest
from .fleets import SHIFT_GATE_PX, assert_same_bytes_as_single_commands, write_fleet

INTEROP = ["export-interop", "--to", "fastbev-lut"]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A 5-vehicle fleet compiled vehicle by vehicle: car-0002 an outlier, car-0003 a bad calibration."""
    folder = tmp_path_factory.mktemp("fleet")
    products = {"grid": {"format": ["uq12"]}, "matrix": {"topk": 8, "align": 16}, "export-interop": {"to": "fastbev-lut"}}
    manifest = load_manifest(write_fleet(folder, 5, outliers=[2], bad=[3], products=products))
    ctx = FleetContext(manifest.path, manifest.template, manifest.products, str(folder / "out"), reference=manifest.reference, max_shift_px=SHIFT_GATE_PX)
    reference = compile_vehicle(ctx, manifest.vehicles[0])
    results = {v.id: compile_vehicle(ctx, v, reference) for v in manifest.vehicles[1:]}
    return {"folder": folder, "manifest": manifest, "ctx": ctx, "results": {reference.id: reference, **results}}


def test_stores_equal_the_single_commands_file_for_file(built: dict[str, Any], tmp_path: Path) -> None:
    out = Path(built["ctx"].out_dir)
    ok = [r.id for r in built["results"].values() if r.status == "built"]
    assert ok == ["car-0000", "car-0001", "car-0002", "car-0004"]
    assert_same_bytes_as_single_commands(out, ok, tmp_path, (["grid", "--format", "uq12"], ["matrix", "--topk", "8", "--align", "16"], INTEROP))
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []  # no staging folder left


def test_a_bad_calibration_fails_alone_with_its_one_line_error(built: dict[str, Any]) -> None:
    bad = built["results"]["car-0003"]
    assert bad.status == "failed" and bad.store is None and not (Path(built["ctx"].out_dir) / "car-0003.zarr").exists()
    assert bad.error == f"{built['folder'] / 'calib' / 'car-0003.yaml'}: cameras[2].rotation_wxyz: quaternion must be unit length (tolerance 1e-06), its norm is 1.11803399"


def test_figures_come_from_the_store_and_the_shift_equals_bevcompile_diff(built: dict[str, Any]) -> None:
    results = built["results"]
    reference, outlier = results["car-0000"], results["car-0002"]
    assert reference.shift == {"reference": "car-0000", "is_reference": True} and reference.flags == []
    store = load(outlier.store)
    assert outlier.coverage == {c: list(v) for c, v in zip(store["grid"].attrs["cameras"], store["grid"].attrs["coverage"], strict=True)}
    assert outlier.kept_weight == {"total": store["matrix"].attrs["kept_weight_fraction"]["total"], "worst_row": store["matrix"].attrs["kept_weight_fraction"]["worst_row"]}
    assert outlier.delta_ratio == store["delta"].attrs["ratio_vs_norm_int16"] and outlier.bytes and outlier.bytes > 0
    diff = diff_stores(reference.store, outlier.store, max_shift_px=SHIFT_GATE_PX).to_json()
    for camera in diff["cameras"]:
        recorded = outlier.shift["cameras"][camera["camera"]]
        for key in ("shift_max_px", "shift_mean_px", "lost_fraction", "gained_fraction", "cells_both", "rotation_deg", "translation_mm"):
            assert recorded[key] == camera[key], (camera["camera"], key)
    assert outlier.flags == [line.split(": ", 1)[1].replace(" (vs " + reference.store + ")", "") for line in diff["failures"]]
    assert outlier.flags == [f"LEFT: max shift {outlier.shift['cameras']['LEFT']['shift_max_px']:.4g} px > --max-shift-px {SHIFT_GATE_PX:g}"]
    assert results["car-0001"].flags == [] and results["car-0004"].flags == [] and 0 < results["car-0001"].shift["max_px"] < SHIFT_GATE_PX


def test_resume_keeps_up_to_date_stores_and_rebuilds_changed_ones(built: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    ctx = replace(built["ctx"], resume=True)
    manifest, results = built["manifest"], built["results"]
    vehicle = manifest.vehicles[1]
    before = tree_digest(Path(results["car-0001"].store))
    kept = compile_vehicle(ctx, vehicle, results["car-0000"])
    assert kept.status == "resumed" and "build" not in kept.phases and tree_digest(Path(kept.store)) == before
    assert kept.shift == results["car-0001"].shift and kept.coverage == results["car-0001"].coverage
    other = replace(ctx, products=manifest.products[:2])  # no export-interop any more
    rebuilt = compile_vehicle(other, vehicle, results["car-0000"])
    assert rebuilt.status == "built" and rebuilt.notes == ["rebuilt: groups delta, gather, grid, interop, matrix, the products write delta, gather, grid, matrix"]
    assert "interop" not in load(rebuilt.store).group_names
    monkeypatch.setattr(task_mod, "__version__", "9.9.9")
    why = task_mod.up_to_date(Path(rebuilt.store), load(rebuilt.store).rig, other.products)
    assert why == f"built by bevcompile {VERSION}, this is 9.9.9"


def test_a_store_failing_inspect_is_rebuilt_on_resume_and_never_installed(built: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    ctx = replace(built["ctx"], resume=True)
    vehicle, reference = built["manifest"].vehicles[4], built["results"]["car-0000"]
    path = Path(ctx.out_dir) / "car-0004.zarr"
    chunk = next(p for p in sorted((path / "grid" / "coords").rglob("*")) if p.is_file() and p.name != "zarr.json")
    chunk.write_bytes(b"garbage")
    result = compile_vehicle(ctx, vehicle, reference)
    assert result.status == "built" and result.notes[0].startswith("rebuilt: fails inspect (")
    good = tree_digest(path)

    def failing(store: Any) -> StoreReport:
        report = StoreReport(path=str(store))
        report.add("sha256", "grid/coords", False, "content sha256 abc does not match recorded def")
        return report

    monkeypatch.setattr("bevcompile.store.inspection.inspect_store", failing)
    failed = compile_vehicle(replace(ctx, resume=False), vehicle, reference)
    assert failed.status == "failed" and failed.error is not None and failed.error.startswith("the new store fails inspect: ")
    assert tree_digest(path) == good and failed.notes == [f"{path} from an earlier build is unchanged"]
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".car-0004")]


def test_a_cancelled_vehicle_leaves_its_store_as_it_was(built: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    ctx, vehicle = built["ctx"], built["manifest"].vehicles[1]
    path = Path(ctx.out_dir) / "car-0001.zarr"
    before = tree_digest(path)
    calls: list[int] = []

    def cancel_on_second() -> None:
        calls.append(1)
        if len(calls) == 3:  # after the first product, before the second
            raise Cancelled

    monkeypatch.setattr(task_mod, "_cancel_check", lambda name: cancel_on_second)
    result = compile_vehicle(ctx, vehicle, built["results"]["car-0000"])
    assert result.status == "cancelled" and "cancelled before its store was put in place" in str(result.error)
    assert tree_digest(path) == before and not [p for p in path.parent.iterdir() if p.name.startswith(".car-0001")]


def test_results_round_trip_and_flags_follow_the_gates(built: dict[str, Any]) -> None:
    outlier = built["results"]["car-0002"]
    again = VehicleResult.from_json(json.loads(json.dumps(outlier.to_json())))
    assert again == outlier
    assert flags_for(again, None, None) == []
    assert flags_for(again, 10.0, None) == []
    assert flags_for(again, 0.0, 0.0)[0].startswith("FRONT: ")  # every moved camera exceeds a zero gate
    unmeasured = replace(again, shift={"reference": "car-0000", "comparable": False, "reason": "cannot compare: feature map 12x8 vs 24x16"})
    assert flags_for(unmeasured, 1.0, None) == ["calibration shift unmeasured against car-0000: cannot compare: feature map 12x8 vs 24x16"]
    assert np.isfinite(again.shift["max_px"])


def test_no_inspect_skips_only_the_check(built: dict[str, Any]) -> None:
    ctx = replace(built["ctx"], inspect=False)
    result = compile_vehicle(ctx, built["manifest"].vehicles[1], built["results"]["car-0000"])
    assert result.status == "built" and "inspect" not in result.phases and "build" in result.phases
    assert tree_digest(Path(result.store)) == tree_digest(Path(built["results"]["car-0001"].store))  # the same bytes


def test_a_ray_fleet_with_a_depth_prior_equals_the_single_command_and_checks_the_file_per_vehicle(tmp_path: Path) -> None:
    """``matrix: {mode: ray, depth-prior: FILE}``: each vehicle's store equals ``bevcompile matrix
    --mode ray --depth-prior FILE`` file for file; a file that changed after the manifest was read
    fails the vehicle with one line (as a prior that does not fit its rig would), the store not made."""
    folder = tmp_path / "fleet"
    folder.mkdir()
    prior = folder / "depth.npy"
    np.save(prior, np.linspace(2.0, 0.5, 8))
    products = {"matrix": {"mode": "ray", "topk": 8, "align": 16, "depth-prior": "depth.npy"}}
    manifest = load_manifest(write_fleet(folder, 2, products=products))
    ctx = FleetContext(manifest.path, manifest.template, manifest.products, str(folder / "out"), reference=manifest.reference, max_shift_px=SHIFT_GATE_PX)
    reference = compile_vehicle(ctx, manifest.vehicles[0])
    other = compile_vehicle(ctx, manifest.vehicles[1], reference)
    assert reference.status == other.status == "built", (reference.error, other.error)
    command = ["matrix", "--mode", "ray", "--topk", "8", "--align", "16", "--depth-prior", str(prior)]
    assert_same_bytes_as_single_commands(folder / "out", ["car-0000", "car-0001"], tmp_path / "single", (command,))
    np.save(prior, np.linspace(2.0, 0.25, 8))  # changed after the manifest was read
    ctx_changed = replace(ctx, out_dir=str(tmp_path / "out2"))
    changed = compile_vehicle(ctx_changed, manifest.vehicles[1], reference)
    assert changed.status == "failed" and not (tmp_path / "out2" / "car-0001.zarr").exists()
    assert changed.error == f"{prior}: changed since the fleet manifest was read (its array's sha256 differs); run the fleet again"


def test_a_depth_prior_that_does_not_fit_a_vehicles_rig_fails_that_vehicle_with_one_line(tmp_path: Path) -> None:
    folder = tmp_path / "fleet"
    folder.mkdir()
    np.save(folder / "three-cameras.npy", np.ones((3, 8)))  # the test rig has 4 cameras
    products = {"matrix": {"mode": "ray", "topk": 8, "depth-prior": "three-cameras.npy"}}
    manifest = load_manifest(write_fleet(folder, 1, products=products))  # the manifest cannot know the vehicles' cameras
    ctx = FleetContext(manifest.path, manifest.template, manifest.products, str(folder / "out"), reference=manifest.reference)
    result = compile_vehicle(ctx, manifest.vehicles[0])
    assert result.status == "failed" and result.error is not None and "\n" not in result.error
    assert result.error.startswith(f"{folder / 'three-cameras.npy'}: shape (3, 8); expected one of (8,), (4, 8)")
