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

from ._version import __version__
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
