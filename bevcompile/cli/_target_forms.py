"""The precision map's forms of ``export-onnx --target`` (``verify --map --target NAME``).

The report registry (:mod:`bevcompile.report.precision`) and the graph builder
(:mod:`bevcompile.deploy`) may not import each other; the command line joins them: for every named
target, the product's graph as the target's planner writes it (its form, its default weights — float16
for an fp16 NPU — and, for a QDQ target, its fully quantised graph with activation scales calibrated on
8 seeded samples), run by onnxruntime on the map's features. What a runtime that executes the graph as
written computes; the device's own arithmetic (RKNN's fp16 accumulators, OpenVINO's int8 kernels) is
measured by ``benchmarks/npu_check.py``.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def _run_target(inputs: Any, target: str, weights: str) -> np.ndarray:
    import onnxruntime as ort

    from ..deploy.direct import _feeds, calibration_inputs, planned_model
    from ..deploy.graph import QDQ_SESSION_LEVEL
    from ..deploy.lift import product_lift
    from ..deploy.onnx_export import ExportOptions
    from ..deploy.targets import load_profile

    store = inputs.store
    int8 = weights == "int8-qdq"
    lift = product_lift(store, "ell", precision="int8" if int8 else weights)
    options = ExportOptions(product="ell", channels=int(inputs.features.shape[1]), weights=weights)  # opset 17, batch 1, 8 seeded samples
    candidate, _, model = planned_model(
        load_profile(target), lift, options, weights=weights, full_qdq=int8, samples=lambda: calibration_inputs(store, options, lift.frustum)
    )
    assert candidate.plan is not None
    c = options.channels
    feeds = {"features": np.asarray(inputs.features, np.float32)[None]}
    if lift.frustum:
        feeds["depth"] = np.asarray(inputs.depth_probs, np.float32)[None]
    session_options = ort.SessionOptions()
    session_options.graph_optimization_level = getattr(ort.GraphOptimizationLevel, QDQ_SESSION_LEVEL)
    out = ort.InferenceSession(model.SerializeToString(), session_options, providers=["CPUExecutionProvider"]).run(None, _feeds(feeds, candidate.plan.input_rank))[0]
    return np.asarray(out.reshape(c, -1).T)  # (ny * nx, C)


def target_forms(targets: list[str]) -> list[Any]:
    """The forms ``target:<name>`` (and ``target:<name>/int8`` for a QDQ target) of each target, for
    :func:`~bevcompile.report.precision.precision_map`'s ``extra_forms``: mapped for one call, never
    registered (the registry is the process's; a --target must not leak into a later map)."""
    from ..deploy.targets import load_profile
    from ..report.precision import PrecisionForm

    forms = []
    for target in targets:
        profile = load_profile(target)
        variants = []
        if profile.computes_float and "torch" not in profile.forms:
            variants.append(("float16" if "float16" in profile.compute and "float32" not in profile.compute else "float32", ""))
        if profile.int8 == "qdq" and "int8" in profile.compute and "torch" not in profile.forms:
            variants.append(("int8-qdq", "/int8"))
        for weights, suffix in variants:
            name = f"target:{profile.name}{suffix}"

            def available(inputs: Any, profile_name: str = profile.name, w: str = weights) -> bool:
                from ..errors import BevcompileError

                if not inputs.store.has_group("matrix"):
                    return False
                try:
                    _run_target(inputs, profile_name, w)
                except BevcompileError:
                    return False
                return True

            def compute(inputs: Any, profile_name: str = profile.name, w: str = weights) -> np.ndarray:
                return _run_target(inputs, profile_name, w)

            forms.append(PrecisionForm(name, "matrix", f"the {profile.name} graph of the ELL ({weights}), run by onnxruntime", available, compute))
    return forms
