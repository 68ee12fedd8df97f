"""Stores the command tests of inspect, verify and render share."""

from __future__ import annotations

from pathlib import Path

import pytest

from bevcompile.grid.build import run_grid

from .. import damage, rigs


@pytest.fixture(scope="module")
def small_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The small rig's grid store (built once per test module)."""
    return run_grid(rigs.small_rig(), tmp_path_factory.mktemp("cli")).store


@pytest.fixture
def small_copy(small_store: Path, tmp_path: Path) -> Path:
    """A copy of :func:`small_store` a test may damage, at ``<tmp>/artifacts/small.zarr``."""
    return damage.copy_store(small_store, tmp_path / "artifacts" / "small.zarr")
