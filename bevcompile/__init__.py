"""bevcompile: compile camera-to-BEV view transforms into static NPU tables.

Library entry points (numpy only):

* :func:`load_config` / :func:`parse_config` — validated rig config.
* :func:`compute_sampling_grid` — float64 IPM grid of every BEV cell in every camera.
* :func:`run_grid` — compute and write the ``grid/`` group into ``<out>/<name>.zarr``.
"""

from ._version import __version__
from .build import run_grid
from .config import RigConfig, config_sha256, config_to_dict, load_config, parse_config
from .errors import (
    BevcompileError,
    CheckFailed,
    ConfigError,
    DependencyError,
    StoreConflictError,
    StoreError,
    UsageError,
)
from .grid import compute_sampling_grid, feature_px_to_norm, norm_to_feature_px

__all__ = [
    "BevcompileError",
    "CheckFailed",
    "ConfigError",
    "DependencyError",
    "RigConfig",
    "StoreConflictError",
    "StoreError",
    "UsageError",
    "__version__",
    "compute_sampling_grid",
    "config_sha256",
    "config_to_dict",
    "feature_px_to_norm",
    "load_config",
    "norm_to_feature_px",
    "parse_config",
    "run_grid",
]
