"""Concurrent writers and killed writers, with real processes (issue 21: a ``matrix`` and a
``grid`` on one ``--out`` lost or mixed data in 17 of 36 trials). Seeded and bounded: two
concurrent pairs and four kills at random instants of a write, each asserting the promise —
every command exits 0 (or was killed), no write is lost or mixed, the store is intact."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bevcompile.store.inspection import inspect_store
from bevcompile.store.zarr_io import open_store

from ..rigs import small_rig_data, write_yaml

BIN = str(Path(sys.executable).parent / "bevcompile")


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_yaml(tmp_path_factory.mktemp("concurrency") / "small.yaml", small_rig_data(bev_step_m=0.25))


def _start(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([BIN, *args, "--quiet"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.parametrize("trial", [0, 1])
def test_two_writers_at_once_keep_both_groups(tmp_path: Path, config: Path, trial: int) -> None:
    out = str(tmp_path)
    grid = _start("grid", str(config), "--out", out)
    time.sleep(0.2 * trial)
    matrix = _start("matrix", str(config), "--out", out, "--mode", "grid", "--align", "1")
    results = [(p.wait(300), p.stderr.read() if p.stderr else "") for p in (grid, matrix)]
    assert [code for code, _ in results] == [0, 0], results
    assert all(err == "" or err.startswith("note: waiting for ") for _, err in results), results
    store = tmp_path / "small.zarr"
    assert open_store(store).groups() == ["delta", "gather", "grid", "matrix"]
    report = inspect_store(store)
    assert report.passed, report.failure_lines()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["small.zarr"]  # no lock, no temporary left


def test_writers_killed_at_random_instants_leave_an_intact_store(tmp_path: Path, config: Path) -> None:
    out = str(tmp_path)
    assert subprocess.run([BIN, "matrix", str(config), "--out", out, "--mode", "grid", "--quiet"], check=False).returncode == 0
    rng = random.Random(21)
    store = tmp_path / "small.zarr"
    for _ in range(4):
        writer = _start("grid", str(config), "--out", out)
        time.sleep(rng.uniform(0.5, 4.0))
        writer.send_signal(signal.SIGKILL)
        writer.wait(60)
        groups = open_store(store).groups()
        assert "matrix" in groups, groups  # the matrix/ of the earlier write is never lost
        assert inspect_store(store).passed
    result = subprocess.run([BIN, "grid", str(config), "--out", out, "--quiet"], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["small.zarr"]  # the next write swept the leftovers
    assert open_store(store).groups() == ["delta", "gather", "grid", "matrix"] and inspect_store(store).passed

