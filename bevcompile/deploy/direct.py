"""``export-onnx --target T``: the graph builder's path (no torch), proven like the torch path.

:func:`export_direct` reads the product as a :class:`~bevcompile.deploy.lift.LiftMatrix`, lets the
target profile choose the form (:func:`bevcompile.deploy.plan.plan_for_target`), writes the graph,
and checks it exactly as :func:`bevcompile.deploy.onnx_export.export_onnx` checks the torch graphs:
the forbidden-op and static-shape scan, then onnxruntime against the independent numpy reference
(``grid_sample`` on ``grid/norm`` for ``gather``, the ``matrix/`` COO for ``ell``/``tiles``; with
``float16``/``int8`` weights the reference uses the same rounded/dequantised values read straight
from the store's arrays; tolerance as the torch path).

int8, by the target's route (:data:`bevcompile.deploy.targets.INT8_ROUTES`):

* ``qdq`` and ``--weights int8-qdq``: a FULLY quantised graph — the int8 values with their per-row
  scales in DequantizeLinear, and every activation through QuantizeLinear -> DequantizeLinear with a
  symmetric int8 scale calibrated on ``--calibration`` samples (or :data:`CALIBRATION_SAMPLES`
  seeded ones). Its check is the PSNR against the float reference (>= :data:`INT8_MIN_PSNR_DB`),
  the max abs against the same-weights float-activation reference is reported.
* ``toolchain-calibration`` (``--weights int8`` or ``int8-qdq``): the float graph whose weights are
  the store's dequantised int8 values (a per-channel quantiser recovers them), and beside the file a
  calibration set ``<out>.calib/`` — ``features_000.npy`` ... (the graph's input shape), ``depth_*``
  in frustum mode, ``dataset.txt`` (RKNN's format: one sample per line, its inputs separated by a
  space, paths relative to the folder) and ``features.npy`` (all samples stacked, onnx2tf's ``-cind``).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import StoreError, UsageError
from ..store.loader import load
from ..store.zarr_io import output_file
from . import onnx_export as ox
from .graph import QDQ_SESSION_LEVEL, build_graph, calibrate_activation_scales
from .lift import LiftMatrix, product_lift
from .onnx_graph import _require_onnx, scan_graph
from .plan import Candidate, plan_for_target
from .targets import TargetProfile, load_profile

CALIBRATION_MAX_BYTES = 16 << 30
"""A ``--calibration`` file larger than this is refused before it is read (it is memory-mapped)."""


def _feeds(inputs: dict[str, np.ndarray], rank: int) -> dict[str, np.ndarray]:
    """The graph's inputs from the ``(N, n_cam, ...)`` arrays (rank 4: ``(N * n_cam, ...)``)."""
    if rank == 5:
        return inputs
    return {k: np.ascontiguousarray(v.reshape(-1, *v.shape[2:])) for k, v in inputs.items()}


def calibration_inputs(store: Any, options: ox.ExportOptions, frustum: bool) -> list[dict[str, np.ndarray]]:
    """The samples of the activation scales / the toolchain's calibration set, as ``(N, n_cam, ...)``
    arrays: the user's ``--calibration`` .npy files (each ``(S, n_cam, C, H_f, W_f)`` or one sample
    ``(n_cam, C, H_f, W_f)``; frustum mode: a sibling ``<name>_depth.npy`` of ``(S, n_cam, D, H_f,
    W_f)``, else seeded softmax depth), or ``options.calibration_samples`` seeded ones (seed + 1 + i)."""
    w_f, h_f = store.feature_size
    n_cam, c = store.rig.n_cam, options.channels
    samples = []
    if not options.calibration:
        for i in range(options.calibration_samples):
            samples.append(ox.make_inputs(store, c, options.batch, options.seed + 1 + i, frustum))
        return samples
    rng = np.random.default_rng(options.seed + 1)
    for name in options.calibration:
        path = Path(name)
        from ..files import FileRefused, check_regular

        try:
            check_regular(path, CALIBRATION_MAX_BYTES, "a .npy file of features")
            array = np.load(path, allow_pickle=False, mmap_mode="r")
        except FileRefused as exc:
            raise UsageError(f"--calibration {name}: not a readable .npy file ({exc.reason})") from None
        except (OSError, ValueError) as exc:
            raise UsageError(f"--calibration {name}: not a readable .npy file ({exc})") from None
        if array.ndim == 4:
            array = array[None]
        if array.ndim != 5 or tuple(array.shape[1:]) != (n_cam, c, h_f, w_f) or not np.issubdtype(array.dtype, np.floating):
            raise UsageError(f"--calibration {name}: shape {tuple(array.shape)} {array.dtype}; expected float (S, {n_cam}, {c}, {h_f}, {w_f}) features (--channels {c})")
        depth_path = path.with_name(path.stem + "_depth.npy")
        depth = np.load(depth_path, allow_pickle=False) if frustum and depth_path.is_file() else None
        for i in range(array.shape[0]):
            sample = {"features": np.asarray(array[i : i + 1], np.float32)}
            if frustum:
                if depth is not None:
                    sample["depth"] = np.asarray(depth[i : i + 1], np.float32)
                else:
                    from ..store.verify import random_depth_probs

                    sample["depth"] = random_depth_probs(rng, (1, n_cam, store.rig.depth.n_bins, h_f, w_f), axis=2)
            samples.append(sample)
    if not np.isfinite(np.concatenate([s["features"].reshape(-1) for s in samples])).all():
        raise UsageError("--calibration: the samples hold NaN or Inf")
    return samples


def _write_calibration_set(folder: Path, samples: list[dict[str, np.ndarray]], rank: int) -> None:
    """``features_000.npy`` ... + ``dataset.txt`` + ``features.npy`` (see the module docstring)."""
    folder.mkdir(parents=True)
    lines = []
    stacked: dict[str, list[np.ndarray]] = {}
    for i, sample in enumerate(samples):
        names = []
        for key, value in _feeds(sample, rank).items():
            name = f"{key}_{i:03d}.npy"
            np.save(folder / name, value)
            names.append(name)
            stacked.setdefault(key, []).append(value)
        lines.append(" ".join(names))
    (folder / "dataset.txt").write_text("\n".join(lines) + "\n")
    for key, values in stacked.items():
        np.save(folder / f"{key}.npy", np.stack(values))


def _references(store: Any, options: ox.ExportOptions, inputs: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """``(same-weights reference, float reference)``: :func:`~bevcompile.deploy.onnx_export.export_references`,
    at the kept cells for a gather ``--rows compact``."""
    same, float_ref = ox.export_references(store, options, inputs["features"], inputs.get("depth"))
    if options.product == "gather" and options.rows == "compact":
        compact_float = _compact_gather(store, float_ref)
        return (compact_float if same is float_ref else _compact_gather(store, same)), compact_float
    return same, float_ref


def _compact_gather(store: Any, dense: np.ndarray) -> np.ndarray:
    """A region store's ``(N, C, n_heights, ny, nx)`` gather output at its kept cells: ``(N, C, n_heights, n_kept)``."""
    expand = np.asarray(store["grid"]["expand"], np.int64)
    n_kept = int(np.asarray(store["grid"]["cells"]).shape[0])
    first = np.full(n_kept, -1, np.int64)
    fine = np.flatnonzero(expand < n_kept)
    first[expand[fine[::-1]]] = fine[::-1]
    flat = dense.reshape(*dense.shape[:3], -1)
    return flat[..., first]


def export_direct(store_path: Any, out: Any, options: ox.ExportOptions, *, progress: Callable[[int], None]) -> ox.ExportResult:
    """See the module docstring; the same contract as :func:`bevcompile.deploy.onnx_export.export_onnx`."""
    onnx, ort = _require_onnx()
    profile: TargetProfile = load_profile(options.target)
    store = load(store_path)
    if output_file(out) is None:
        raise UsageError("--out - is a --target generic option; a target's graph (and its calibration set) goes to a file")
    out = Path(out)
    if options.product != "gather" and store.has_group("matrix") and int(store["matrix"].attrs.get("nnz", 1) or 0) == 0:
        raise UsageError(f"{store.path}: matrix/ is empty (no entries: no camera reaches the BEV range), nothing to export")
    if options.product != "gather" and not store.has_group("matrix"):
        raise StoreError(f"{store.path}: no group matrix/ in this store; run `bevcompile matrix` to add it")
    if options.rows == "compact" and options.product == "gather" and "expand" not in store["grid"]:
        raise UsageError(f"{store.path}: grid/expand: --rows compact needs a store built with a bev.region; drop --rows compact")
    ox.check_export_memory(store, replace_weights(options))
    int8 = options.weights in ("int8", "int8-qdq")
    route = profile.int8 if int8 else None
    if int8 and route == "none":
        raise UsageError(f"--target {profile.name} has no int8 route ({profile.int8_source})")
    if int8 and "int8" not in profile.compute:
        raise UsageError(f"--target {profile.name} computes in {', '.join(profile.compute)}, not int8")
    if not int8 and not profile.computes_float:
        raise UsageError(
            f"--target {profile.name} computes in int8 only ({profile.int8_source}): export --weights int8 (the float graph + the calibration set its toolchain quantises)"
        )
    precision = "int8" if int8 else {"fp16": "float16"}.get(options.weights, options.weights)
    lift = product_lift(store, options.product, reduce=options.reduce, rows=options.rows, precision=precision)
    toolchain_quantises = route == "toolchain-calibration"
    graph_weights = "float32" if toolchain_quantises else {"fp16": "float16"}.get(options.weights, options.weights)
    full_qdq = route == "qdq" and options.weights == "int8-qdq"
    if toolchain_quantises:  # the float graph carries the dequantised int8 values
        lift = replace_lift_float(lift)
    progress(1)

    t0 = time.perf_counter()
    samples: list[dict[str, np.ndarray]] = []

    def calibration() -> list[dict[str, np.ndarray]]:  # read once, and only after the plan fits
        if not samples:
            samples.extend(calibration_inputs(store, options, lift.frustum))
        return samples

    candidate, refused, model = planned_model(profile, lift, options, weights=graph_weights, full_qdq=full_qdq, samples=calibration)
    plan = candidate.plan
    assert plan is not None
    inputs = ox.make_inputs(store, options.channels, options.batch, options.seed, lift.frustum)
    if toolchain_quantises:
        calibration()
    metadata = _metadata(store, options, profile, plan.form, route)
    for key, value in metadata.items():
        prop = model.metadata_props.add()
        prop.key, prop.value = key, value
    export_seconds = time.perf_counter() - t0
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    try:
        onnx.save(model, str(tmp))
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise StoreError(f"--out {out}: cannot write ({exc.strerror or exc})") from None
    progress(1)
    scan = scan_graph(model)
    progress(1)

    failures: list[str] = []
    failures += [f"forbidden op {f}" for f in scan.forbidden]
    failures += [f"non-static shape {d}" for d in scan.dynamic[:10]]
    same, float_ref = _references(store, options, inputs)
    t0 = time.perf_counter()
    session_options = ort.SessionOptions()
    if full_qdq or options.weights == "int8-qdq":
        session_options.graph_optimization_level = getattr(ort.GraphOptimizationLevel, QDQ_SESSION_LEVEL)
    ort_out = ox.run_checked(ort, tmp, _feeds(inputs, plan.input_rank), session_options, same.shape, failures)
    ort_out = ort_out.reshape(same.shape) if ort_out.size == same.size else np.full(same.shape, np.nan, np.float32)
    ort_seconds = time.perf_counter() - t0
    progress(1)
    diff = np.abs(ort_out.astype(np.float64) - same)
    finite = bool(np.isfinite(diff).all())
    max_abs = float(diff.max()) if finite and diff.size else (0.0 if finite else float("inf"))
    mean_abs = float(diff.mean()) if finite and diff.size else (0.0 if finite else float("inf"))
    tolerance = ox.export_tolerance(store, replace_weights(options))
    quantisation = ox._quantisation_report(ort_out, float_ref, options.product) if options.weights != "float32" else None
    if full_qdq:
        assert quantisation is not None
        if not quantisation.psnr_db >= ox.INT8_MIN_PSNR_DB:
            failures.append(f"the fully quantised graph is {quantisation.psnr_db:.1f} dB from the float reference (< {ox.INT8_MIN_PSNR_DB:g} dB)")
    elif not max_abs <= tolerance:
        same_note = "" if options.weights == "float32" else f" ({options.weights}: same weights)"
        failures.append(f"onnxruntime output differs from the numpy reference{same_note} by {max_abs:.3g} > {tolerance:.3g}")
    assert candidate.cost is not None
    result = ox.ExportResult(
        path=out, product=options.product, exporter="bevcompile", inputs={k: list(v.shape) for k, v in _feeds(inputs, plan.input_rank).items()},
        output=list(ort_out.shape), scan=scan, max_abs=max_abs, mean_abs=mean_abs, torch_max_abs=float("nan"), tolerance=tolerance,
        file_bytes=tmp.stat().st_size, export_seconds=export_seconds, ort_seconds=ort_seconds,
        module=f"{plan.form} form, layout {plan.layout}" + (f", patch {plan.patch[0]}x{plan.patch[1]}" if plan.patch else "")
        + (f", tile rows {plan.tile_rows or 8}" if plan.form == "tiles" else ""),
        failures=failures, weights=options.weights, rows=options.rows, float_reference=quantisation,
        target=profile.name, form=plan.form, plan=plan.to_json(), cost=candidate.cost.to_json(), refused=refused, int8_route=route,
    )
    result.notes.extend(plan.notes)
    if full_qdq:
        result.notes.append(
            f"fully quantised: {len(candidate.activations)} activations through QuantizeLinear -> DequantizeLinear (scales from "
            f"{'the --calibration samples' if options.calibration else f'{len(samples)} seeded samples'}); max abs vs the float-activation int8 reference {max_abs:.3g}"
        )
    if toolchain_quantises:
        result.notes.append(f"int8 by the {profile.toolchain} quantiser: the float graph holds the dequantised int8 values; calibration set beside the file")
    if failures:
        raise ox.rejected_graph(out, tmp, result, failures)
    calib_dir = None
    if toolchain_quantises:
        calib_dir = out.with_name(out.name + ".calib")
        staging = out.with_name(f".{out.name}.calib.tmp-{os.getpid()}")
        shutil.rmtree(staging, ignore_errors=True)
        _write_calibration_set(staging, samples, plan.input_rank)
        shutil.rmtree(calib_dir, ignore_errors=True)
        os.replace(staging, calib_dir)
        result.calibration_dir = calib_dir
    os.replace(tmp, out)
    return result


def planned_model(
    profile: TargetProfile, lift: LiftMatrix, options: ox.ExportOptions, *, weights: str, full_qdq: bool,
    samples: Callable[[], list[dict[str, np.ndarray]]],
) -> tuple[Candidate, list[tuple[str, list[str]]], Any]:
    """``(candidate, refused forms, model)``: the target's form for ``lift`` (:func:`plan_for_target`
    with the options' form, layout, tile rows and guard) and its graph; with ``full_qdq``, rebuilt
    with every activation's scale calibrated on ``samples()`` (``(N, n_cam, ...)`` inputs, asked
    for only then)."""
    candidate, refused = plan_for_target(
        profile, lift, channels=options.channels, batch=options.batch, opset=options.opset, weights=weights,
        qdq_activations=full_qdq, form=options.form, layout=options.layout, tile_rows=options.tile_rows, product=options.product, guard=options.guard,
    )
    plan = candidate.plan
    assert plan is not None
    model = candidate.model
    if full_qdq:
        scales = calibrate_activation_scales(model, candidate.activations, [_feeds(s, plan.input_rank) for s in samples()])
        model, _ = build_graph(lift, plan, scales)
    return candidate, refused, model


def replace_weights(options: ox.ExportOptions) -> ox.ExportOptions:
    """The options as the torch path's helpers (memory estimate, tolerance) read them."""
    return dataclasses.replace(options, weights="float32" if options.weights == "float16" else options.weights)


def replace_lift_float(lift: LiftMatrix) -> LiftMatrix:
    """The int8 lift as float values only (``value`` already holds ``q * scale``)."""
    return dataclasses.replace(lift, q=None, row_scale=None, precision="float32")


def _metadata(store: Any, options: ox.ExportOptions, profile: TargetProfile, form: str, route: str | None) -> dict[str, str]:
    return ox.metadata_entries(
        store, dataclasses.replace(options, target=profile.name), "bevcompile", form=form, input_rank=str(profile.input_rank), int8_route=route or ""
    )


__all__ = ["calibration_inputs", "export_direct", "planned_model"]
