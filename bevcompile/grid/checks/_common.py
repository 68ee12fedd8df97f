"""Helpers shared by the NPU grid plug-ins (:mod:`.formats`, :mod:`.gather`, :mod:`.delta`).

Garbage input gives failed checks, not exceptions: :func:`_guard` turns a contract violation
(:class:`_Bad`) or any exception into ONE failed check.

verify bounds (features uniform in ``[0, 1)``, so the feature range ``peak`` is 1): bilinear
sampling with zeros padding is Lipschitz with constant ``peak`` per pixel along each axis (its
partial derivative is a convex combination of differences of neighbouring values, zeros
included, each at most ``peak`` in magnitude). A coordinate error of at most ``e`` px per axis
therefore changes a sample by at most ``2 e peak``; formats and delta are checked against
``2 e peak + 1e-6`` with ``e`` their recorded max error (itself re-measured by the checks).
Gather tables are checked against ``1e-5`` (float32 weights: measured ~5e-8); the LUT weights
against their recorded worst-case sample error ``+ 1e-6``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from ...rig.config import RigConfig
from ...store.plugins import Check, VerifyRow, compare

FEATURE_PEAK = 1.0
GATHER_THRESHOLD = 1e-5
BOUND_SLACK = 1e-6
ATTR_RTOL = 1e-9


class _Bad(ValueError):
    """A contract violation found while preparing a check (becomes a failed Check)."""


def _guard(checks: list[Check], name: str, array: str, fn: Callable[[], list[Check]]) -> None:
    """Run ``fn``; a contract violation or any exception becomes ONE failed check."""
    try:
        checks.extend(fn())
    except _Bad as exc:
        checks.append(Check(name, array, False, str(exc)))
    except Exception as exc:  # garbage input must not escape as a traceback
        text = " ".join(str(exc).split())
        checks.append(Check(name, array, False, f"could not be checked: {exc.__class__.__name__}: {text}"))


def _options(attrs: Mapping[str, Any], group: str) -> Mapping[str, Any]:
    options = attrs.get("build_options")
    if not isinstance(options, Mapping):
        raise _Bad(f"{group}/ attrs build_options missing or not a mapping")
    return options


def _align_corners(attrs: Mapping[str, Any]) -> bool:
    value = _options(attrs, "grid").get("align_corners")
    if not isinstance(value, bool):
        raise _Bad("grid/ attrs build_options.align_corners missing or not a boolean")
    return value


def _recorded_float(meta: Any, key: str, where: str) -> float:
    value = meta.get(key) if isinstance(meta, Mapping) else None
    if isinstance(value, bool) or not isinstance(value, int | float) or not np.isfinite(value):
        raise _Bad(f"{where} attribute {key} missing or not a finite number ({value!r})")
    return float(value)


def _recorded_int(meta: Any, key: str, where: str) -> int:
    value = meta.get(key) if isinstance(meta, Mapping) else None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _Bad(f"{where} attribute {key} missing or not an integer ({value!r})")
    return int(value)


def _expect(arrays: Mapping[str, np.ndarray], group: str, name: str, shape: tuple[int, ...] | None, dtypes: tuple[str, ...]) -> np.ndarray:
    """The array, or :class:`_Bad` if missing or of the wrong shape/dtype."""
    if name not in arrays:
        raise _Bad(f"{group}/{name} is missing or unreadable")
    array = np.asarray(arrays[name])
    if str(array.dtype) not in dtypes:
        raise _Bad(f"{group}/{name} has dtype {array.dtype}, expected {' or '.join(dtypes)}")
    if shape is not None and tuple(array.shape) != shape:
        raise _Bad(f"{group}/{name} has shape {list(array.shape)}, expected {list(shape)}")
    return array


def _cells(rig: RigConfig) -> tuple[int, int, int, int]:
    return (rig.n_cam, len(rig.bev.heights), rig.bev.ny, rig.bev.nx)


def _max_abs_err(decoded: np.ndarray, truth: np.ndarray, valid: np.ndarray) -> float:
    err = np.abs(np.asarray(decoded, dtype=np.float64) - truth)[valid]
    if err.size == 0:
        return 0.0
    return float(np.max(np.where(np.isnan(err), np.inf, err)))


def _agrees(recorded: float, measured: float) -> bool:
    return abs(recorded - measured) <= ATTR_RTOL * max(1.0, abs(measured))


# --------------------------------------------------------------------------------------


def _row(product: str, camera: str, got: npt.NDArray[np.floating], ref: npt.NDArray[np.floating], threshold: float, note: str) -> VerifyRow:
    max_abs, mean_abs, psnr = compare(product, camera, got, ref, FEATURE_PEAK)
    passed = bool(np.isfinite(threshold)) and max_abs <= threshold
    return VerifyRow(product, camera, max_abs, mean_abs, psnr, f"max_abs <= {threshold:.3g}", passed, note)


