from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

from bevcompile.rig.config import RigConfig

from . import rigs

# Property tests: `dev` (plain `pytest`) draws new examples every run; `ci` (`make test`, and so
# `.ci/run`) is derandomised, so a CI run is reproducible and a failure re-runs the same way.
settings.register_profile("dev", deadline=None)
settings.register_profile("ci", deadline=None, derandomize=True, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


@pytest.fixture(scope="session")
def nuscenes() -> RigConfig:
    return rigs.nuscenes_rig()


@pytest.fixture(scope="session")
def distorted() -> RigConfig:
    return rigs.distorted_rig()


@pytest.fixture(scope="session")
def small() -> RigConfig:
    return rigs.small_rig()


@pytest.fixture(scope="session")
def small_distorted_multi() -> RigConfig:
    """Distorted lenses, three heights, BEV larger than the cameras see (partial coverage)."""
    return rigs.small_rig(distortion=True, heights=(-0.5, 0.0, 1.0), bev_half_m=20.0)
