"""bevcompile: compile camera-to-BEV view transforms into static NPU tables.

The package, by product (each subpackage's ``__init__`` says what lives there and what it may import)::

    rig/      the calibrated rig: config (the only YAML reader) and camera geometry
    grid/     IPM sampling grids, gather tables, fixed-point formats, delta-LUT  (bevcompile grid)
    matrix/   the sparse aggregation matrix: streamed Top-K build, ELL/tiles/int8  (bevcompile matrix)
    interop/  BEVDet BEVPoolv2 arrays, Fast-BEV LUT                              (bevcompile export-interop)
    store/    the zarr v3 store: atomic writes, the loader, inspect/verify runners, plug-in contract
    report/   diff of two calibrations, the coverage picture                    (bevcompile diff / render)
    deploy/   PyTorch modules and ONNX export                                   (bevcompile export-onnx)
    cli/      the command line, one module per command
    errors.py the typed error tree; conventions.py the conventions, stated once; memory.py the memory guard;
    parallel.py --jobs (the ordered thread map every parallel build uses)

Library entry points, importable from here (numpy only; imported on first use):

* :func:`load_config` / :func:`parse_config` — validated rig config.
* :func:`compute_sampling_grid` — float64 IPM grid of every BEV cell in every camera.
* :func:`run_grid` — grids, gather tables, fixed-point formats and delta-LUT into
  ``<out>/<name>.zarr`` (what ``bevcompile grid`` does).
* :func:`build_matrix` / :func:`run_matrix` — the sparse aggregation matrix (``bevcompile matrix``).
* :func:`load` — a typed, read-only view of a store for model code.
* :func:`inspect_store` / :func:`verify_store` — integrity checks and equivalence reports.

PyTorch modules: :mod:`bevcompile.torch` (extra ``[torch]``). The flat module names of 0.2
(``bevcompile.config``, ``bevcompile.checks_api``, ...) still import (:mod:`bevcompile._legacy`).
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

from . import _legacy
from ._version import __version__

_legacy.install()

if TYPE_CHECKING:
    from .errors import (
        BevcompileError,
        CheckFailed,
        ConfigError,
        DependencyError,
        StoreConflictError,
        StoreError,
        UsageError,
    )
    from .grid.build import run_grid
    from .grid.delta import decode_delta, encode_delta
    from .grid.gather import build_gather_tables, gather_sample
    from .grid.ipm import compute_sampling_grid, feature_px_to_norm, norm_to_feature_px
    from .grid.reference import grid_sample
    from .matrix.build import MatrixOptions, build_matrix, run_matrix
    from .rig.config import RigConfig, config_sha256, config_to_dict, load_config, parse_config
    from .store.inspection import inspect_store
    from .store.loader import LoadedStore, load
    from .store.verify import verify_store

# Imported on first use (PEP 562), so that ``import bevcompile`` (and the console entry point,
# which must be able to catch a Ctrl-C while numpy and zarr load) costs nothing up front.
_EXPORTS = {
    "run_grid": "grid.build",
    "inspect_store": "store.inspection",
    "RigConfig": "rig.config",
    "config_sha256": "rig.config",
    "config_to_dict": "rig.config",
    "load_config": "rig.config",
    "parse_config": "rig.config",
    "decode_delta": "grid.delta",
    "encode_delta": "grid.delta",
    "BevcompileError": "errors",
    "CheckFailed": "errors",
    "ConfigError": "errors",
    "DependencyError": "errors",
    "StoreConflictError": "errors",
    "StoreError": "errors",
    "UsageError": "errors",
    "build_gather_tables": "grid.gather",
    "gather_sample": "grid.gather",
    "compute_sampling_grid": "grid.ipm",
    "feature_px_to_norm": "grid.ipm",
    "norm_to_feature_px": "grid.ipm",
    "LoadedStore": "store.loader",
    "load": "store.loader",
    "MatrixOptions": "matrix.build",
    "build_matrix": "matrix.build",
    "run_matrix": "matrix.build",
    "grid_sample": "grid.reference",
    "verify_store": "store.verify",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        # ``bevcompile.grid.delta.decode_delta`` after a bare ``import bevcompile``: submodules load
        # on first attribute access, as they would have after an eager import
        if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
            return importlib.import_module(f".{name}", __name__)
        raise AttributeError(f"module 'bevcompile' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


__all__ = [
    "BevcompileError",
    "CheckFailed",
    "ConfigError",
    "DependencyError",
    "LoadedStore",
    "MatrixOptions",
    "RigConfig",
    "StoreConflictError",
    "StoreError",
    "UsageError",
    "__version__",
    "build_gather_tables",
    "build_matrix",
    "compute_sampling_grid",
    "config_sha256",
    "config_to_dict",
    "decode_delta",
    "encode_delta",
    "feature_px_to_norm",
    "gather_sample",
    "grid_sample",
    "inspect_store",
    "load",
    "load_config",
    "norm_to_feature_px",
    "parse_config",
    "run_grid",
    "run_matrix",
    "verify_store",
]
