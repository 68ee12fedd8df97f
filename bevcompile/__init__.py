"""bevcompile: compile camera-to-BEV view transforms into static NPU tables.

Library entry points (numpy only; PyTorch/ONNX live in the optional ``bevcompile.torch`` and
``bevcompile.onnx_export`` modules):

* :func:`load_config` / :func:`parse_config` — validated rig config.
* :func:`compute_sampling_grid` — float64 IPM grid of every BEV cell in every camera.
* :func:`run_grid` — grids, gather tables, fixed-point formats and delta-LUT into
  ``<out>/<name>.zarr`` (what ``bevcompile grid`` does).
* :func:`build_matrix` / :func:`run_matrix` — the sparse aggregation matrix (``bevcompile matrix``).
* :func:`load` — a typed, read-only view of a store for model code.
* :func:`inspect_store` / :func:`verify_store` — integrity checks and equivalence reports.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

from ._version import __version__

if TYPE_CHECKING:
    from .build import run_grid
    from .checks import inspect_store
    from .config import RigConfig, config_sha256, config_to_dict, load_config, parse_config
    from .delta import decode_delta, encode_delta
    from .errors import (
        BevcompileError,
        CheckFailed,
        ConfigError,
        DependencyError,
        StoreConflictError,
        StoreError,
        UsageError,
    )
    from .gather import build_gather_tables, gather_sample
    from .grid import compute_sampling_grid, feature_px_to_norm, norm_to_feature_px
    from .loader import LoadedStore, load
    from .matrix import MatrixOptions, build_matrix, run_matrix
    from .reference import grid_sample
    from .verify import verify_store

# Imported on first use (PEP 562), so that ``import bevcompile`` (and the console entry point,
# which must be able to catch a Ctrl-C while numpy and zarr load) costs nothing up front.
_EXPORTS = {
    "run_grid": "build",
    "inspect_store": "checks",
    "RigConfig": "config",
    "config_sha256": "config",
    "config_to_dict": "config",
    "load_config": "config",
    "parse_config": "config",
    "decode_delta": "delta",
    "encode_delta": "delta",
    "BevcompileError": "errors",
    "CheckFailed": "errors",
    "ConfigError": "errors",
    "DependencyError": "errors",
    "StoreConflictError": "errors",
    "StoreError": "errors",
    "UsageError": "errors",
    "build_gather_tables": "gather",
    "gather_sample": "gather",
    "compute_sampling_grid": "grid",
    "feature_px_to_norm": "grid",
    "norm_to_feature_px": "grid",
    "LoadedStore": "loader",
    "load": "loader",
    "MatrixOptions": "matrix",
    "build_matrix": "matrix",
    "run_matrix": "matrix",
    "grid_sample": "reference",
    "verify_store": "verify",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        # ``bevcompile.delta.decode_delta`` after a bare ``import bevcompile``: submodules load
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
