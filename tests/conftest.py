from __future__ import annotations

import pytest

from bevcompile.config import RigConfig

from . import rigs


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
