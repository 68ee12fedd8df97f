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
from typing import Any, TypeVar, cast

import numpy as np
import numpy.typing as npt

from ...rig.config import RigConfig
from ...store.plugins import Check, VerifyRow, compare

_F = TypeVar("_F", bound=Callable[..., Any])

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
    """``(n_cam, n_h, ny, nx)``; a region's lattice ``(n_cam, n_h, 1, n_kept)``."""
    from ..ipm import product_lattice_shape

    return (rig.n_cam, len(rig.bev.heights), *product_lattice_shape(rig.bev))


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




# --------------------------------------------------------------------------------------
# bev.region: the stored kept_cell axis seen as the one-row lattice the checks run on
# --------------------------------------------------------------------------------------

REGION_ARRAYS = ("cells", "expand")
"""``grid/`` arrays of a ``bev.region`` store that are no per-cell product (the cell table)."""


def _lattice_arrays(group: str, arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Stored region arrays ``(n_cam, n_h, n_kept, ...)`` as the lattice ``(n_cam, n_h, 1, n_kept, ...)``
    (``grid/`` per-cell arrays, ``gather/`` bev-layout tables); ``cells``, ``expand`` and every
    other array unchanged."""
    out: dict[str, np.ndarray] = {}
    for name, array in arrays.items():
        a = np.asarray(array)
        per_cell = (group == "grid" and name not in REGION_ARRAYS and a.ndim >= 3) or (group == "gather" and name in ("index", "weight", "weight_u8") and a.ndim == 4)
        out[name] = a.reshape(*a.shape[:2], 1, *a.shape[2:]) if per_cell else a
    return out


def _squeezed(out: dict[str, Any]) -> dict[str, Any]:
    """A rebuild of the lattice back to the stored ``kept_cell`` layout."""
    return {name: (value.reshape(*value.shape[:2], *value.shape[3:]) if isinstance(value, np.ndarray) and value.ndim >= 4 and value.shape[2] == 1 else value) for name, value in out.items()}


def region_plugin(group: str) -> Callable[[_F], _F]:
    """Decorate a ``check_`` / ``verify_`` plug-in so that, on a ``bev.region`` store, it runs on the
    one-row lattice of :func:`~bevcompile.grid.ipm.compute_product_grid`: the stored arrays (and
    ``ctx.grid_arrays``) gain the singleton axis, and ``ctx.sampling_grid()`` is the projection of
    the kept (super-)cells' centres. Without a region the plug-in runs unchanged."""
    import dataclasses
    import functools

    from ..ipm import compute_product_grid, grid_region

    def decorate(fn: _F) -> _F:
        @functools.wraps(fn)
        def run(ctx: Any, arrays: Mapping[str, np.ndarray], attrs: Mapping[str, Any]) -> Any:
            if grid_region(ctx.rig.bev) is None:
                return fn(ctx, arrays, attrs)
            grid = compute_product_grid(ctx.rig)
            grid.coords_feature_px.setflags(write=False)
            grid.valid.setflags(write=False)
            lattice_ctx = dataclasses.replace(ctx, grid_arrays=_lattice_arrays("grid", ctx.grid_arrays), _sampling_grid=grid)
            return fn(lattice_ctx, _lattice_arrays(group, arrays), attrs)

        return cast(_F, run)

    return decorate


def region_rebuild(fn: _F) -> _F:
    """Wrap a ``rebuild_`` plug-in (built on the lattice) to return the stored ``kept_cell`` layout."""
    import functools

    from ..ipm import grid_region

    @functools.wraps(fn)
    def run(rig: RigConfig, *args: Any) -> dict[str, Any]:
        out = fn(rig, *args)
        return out if grid_region(rig.bev) is None else _squeezed(out)

    return cast(_F, run)
