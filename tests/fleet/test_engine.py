"""The Dask engine for real: a ``dask scheduler`` and two ``dask worker`` processes started with
their own CLIs (bounded in time, stopped by pid), the embedded LocalCluster, and Ctrl-C."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from typer.testing import CliRunner

from bevcompile._version import __version__ as VERSION
from bevcompile.cli import app
from bevcompile.store.inspection import inspect_store

from .fleets import SHIFT_GATE_PX, assert_same_bytes_as_single_commands, write_fleet

runner = CliRunner()
DASK = Path(sys.executable).parent / "dask"
START_TIMEOUT_S = 90.0
STOP_TIMEOUT_S = 30.0


def _spawn(args: list[str], cwd: Path, log: str) -> subprocess.Popen[bytes]:
    """A process in its own session (no terminal signal reaches it), its output in ``cwd/log``."""
    with open(cwd / log, "wb") as output:
        return subprocess.Popen(args, cwd=cwd, stdout=output, stderr=subprocess.STDOUT, start_new_session=True)


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(STOP_TIMEOUT_S)


def _wait_for_workers(address: str, n: int) -> None:
    from distributed import Client

    with Client(address, timeout=START_TIMEOUT_S) as client:
        client.wait_for_workers(n, timeout=START_TIMEOUT_S)


def _wait_for_workers_to_leave(address: str, n: int) -> None:
    """Until the scheduler has no more than ``n`` workers (a stopped worker is gone)."""
    from distributed import Client

    with Client(address, timeout=START_TIMEOUT_S) as client:
        deadline = time.monotonic() + START_TIMEOUT_S
        while len(client.scheduler_info(n_workers=-1)["workers"]) > n and time.monotonic() < deadline:
            time.sleep(0.2)


def _worker(cwd: Path, name: str, *extra: str) -> subprocess.Popen[bytes]:
    return _spawn(
        [str(DASK), "worker", "--scheduler-file", str(cwd / "scheduler.json"), "--nworkers", "1", "--nthreads", "1",
         "--no-dashboard", "--name", name, "--local-directory", str(cwd / "scratch"), *extra],
        cwd, f"{name}.log",
    )


@contextmanager
def real_cluster(folder: Path) -> Iterator[dict[str, Any]]:
    """A scheduler and two workers on localhost, each its own ``dask`` process (stopped by pid)."""
    folder.mkdir()
    processes = [_spawn([str(DASK), "scheduler", "--host", "127.0.0.1", "--port", "0", "--no-dashboard", "--scheduler-file", str(folder / "scheduler.json")], folder, "scheduler.log")]
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not (folder / "scheduler.json").is_file():
            assert processes[0].poll() is None and time.monotonic() < deadline, (folder / "scheduler.log").read_text()
            time.sleep(0.2)
        time.sleep(0.2)  # the file is written once, whole
        address = json.loads((folder / "scheduler.json").read_text())["address"]
        processes += [_worker(folder, "w1"), _worker(folder, "w2")]
        _wait_for_workers(address, 2)
        yield {"address": address, "folder": folder, "processes": processes}
    finally:
        for process in reversed(processes):
            _stop(process)


def test_a_real_cluster_builds_a_20_vehicle_fleet_equal_to_the_single_commands_and_refuses_bad_workers(tmp_path: Path) -> None:
    """One cluster for the three checks (a test of its own each would start one per xdist worker)."""
    with real_cluster(tmp_path / "cluster") as cluster:
        _twenty_vehicles(cluster, tmp_path / "twenty")
        _a_worker_of_another_version_is_refused(cluster, tmp_path / "version")
        _a_worker_that_cannot_see_the_output_folder_is_refused(cluster, tmp_path / "private")


def _twenty_vehicles(cluster: dict[str, Any], tmp_path: Path) -> None:
    manifest = write_fleet(tmp_path / "fleet", 20, outliers=[5, 13], bad=[9])
    out = tmp_path / "out"
    result = runner.invoke(app, ["fleet", str(manifest), "--out", str(out), "--scheduler", cluster["address"], "--max-shift-px", str(SHIFT_GATE_PX), "--json"])
    assert result.exit_code == 1, result.output
    index = json.loads(result.stdout)
    assert index["counts"] == {"total": 20, "built": 19, "resumed": 0, "failed": 1, "cancelled": 0, "pending": 0, "flagged": 2}
    assert index["engine"]["scheduler"] == cluster["address"] and index["engine"]["workers"] == 2
    assert len({v["worker"] for v in index["vehicles"] if v["status"] == "built"}) == 2  # both workers compiled vehicles
    assert [v["id"] for v in index["vehicles"] if v["flags"]] == ["car-0005", "car-0013"]  # exactly the planted outliers
    lines = result.stderr.splitlines()
    assert lines[0].startswith("car-0009: ") and "cameras[2].rotation_wxyz: quaternion must be unit length" in lines[0]
    assert lines[1].startswith("car-0005: flagged: LEFT: max shift ") and f"> --max-shift-px {SHIFT_GATE_PX:g}" in lines[1]
    assert lines[-1] == f"error: fleet: 1 failed, 2 flagged of 20 vehicles (see {out.resolve() / 'fleet.json'})"
    assert json.loads((out / "fleet.json").read_text())["counts"] == index["counts"]
    built = [v["id"] for v in index["vehicles"] if v["status"] == "built"]
    assert_same_bytes_as_single_commands(out, built, tmp_path / "single")


def _a_worker_of_another_version_is_refused(cluster: dict[str, Any], tmp_path: Path) -> None:
    folder = cluster["folder"]
    preload = folder / "other_version.py"
    preload.write_text("import bevcompile\nbevcompile.__version__ = '0.0.1'\n")
    worker = _worker(folder, "w-old", "--preload", str(preload))
    try:
        _wait_for_workers(cluster["address"], 3)
        manifest = write_fleet(tmp_path / "fleet", 2)
        result = runner.invoke(app, ["fleet", str(manifest), "--out", str(tmp_path / "out"), "--scheduler", cluster["address"]])
    finally:
        _stop(worker)
        _wait_for_workers_to_leave(cluster["address"], 2)
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith(f"error: --scheduler {cluster['address']}: worker tcp://127.0.0.1:")
    assert f"runs bevcompile 0.0.1 (store format bevcompile/1), this is {VERSION} (bevcompile/1): every worker must run the same version" in result.stderr
    assert result.stderr.count("\n") == 1 and not list((tmp_path / "out").glob("*.zarr"))


def _a_worker_that_cannot_see_the_output_folder_is_refused(cluster: dict[str, Any], tmp_path: Path) -> None:
    """A worker in its own mount namespace with a private tmpfs over the output's parent: the
    client's --out is not shared storage for it (skipped where no mount namespace can be made)."""
    hidden = tmp_path / "not-shared"
    hidden.mkdir(parents=True)
    probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", f"mount -t tmpfs none {hidden}"], capture_output=True, timeout=30)
    if probe.returncode != 0:
        print(f"skipped the shared-storage check: no private mount namespace here ({probe.stderr.decode().strip()})")
        return
    worker = _spawn(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c",
         f"mount -t tmpfs none {hidden} && exec {DASK} worker --scheduler-file {cluster['folder'] / 'scheduler.json'} --nworkers 1 "
         f"--nthreads 1 --no-dashboard --name w-private --local-directory /tmp"],
        cluster["folder"], "w-private.log",
    )
    try:
        _wait_for_workers(cluster["address"], 3)
        manifest = write_fleet(tmp_path / "fleet", 2)
        result = runner.invoke(app, ["fleet", str(manifest), "--out", str(hidden / "out"), "--scheduler", cluster["address"]])
    finally:
        os.killpg(worker.pid, signal.SIGTERM)
        _stop(worker)
    assert result.exit_code == 2, result.output
    assert f"cannot use --out {hidden / 'out'} (" in result.stderr and "No such file or directory" in result.stderr
    assert "the output folder must be shared storage that every worker mounts at the same path" in result.stderr


def test_the_default_local_cluster_builds_then_resumes(tmp_path: Path) -> None:
    manifest = write_fleet(tmp_path / "fleet", 4)
    out = tmp_path / "out"
    first = runner.invoke(app, ["fleet", str(manifest), "--out", str(out), "--workers", "2"])
    assert first.exit_code == 0, first.output
    text = " ".join(first.stdout.split())
    assert "fleet fleet.yaml: 4 vehicles, reference car-0000, LocalCluster, 2 workers" in text and f"wrote {out.resolve() / 'fleet.json'} and fleet.csv" in text
    assert_same_bytes_as_single_commands(out, ["car-0000", "car-0001", "car-0002", "car-0003"], tmp_path / "single")
    again = runner.invoke(app, ["fleet", str(manifest), "--out", str(out), "--workers", "1", "--resume", "--json"])
    assert again.exit_code == 0, again.output
    index = json.loads(again.stdout)
    assert index["counts"]["resumed"] == 4 and index["counts"]["built"] == 0 and index["engine"]["workers"] == 1


def _sigint_as_a_terminal_gives_it() -> None:
    """In the child, before exec: SIGINT at its default and unblocked, as a shell gives a foreground
    job. The test process's own disposition is not the terminal's: a native library loaded by an
    earlier test in the same worker may ignore SIGINT at the OS level (Python's getsignal does not
    see that), and an ignored SIGINT is inherited through exec, so Python never installs its
    KeyboardInterrupt handler (the fleet then ran to its end, exit 0: CI, 2026-12-07)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _sigint_state(pid: int) -> tuple[str, str]:
    """Whether process ``pid`` ignores / blocks SIGINT at the OS level (``/proc/PID/status``): ``("0", "0")`` neither."""
    fields = dict(line.split(":\t", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":\t" in line)
    bit = 1 << (signal.SIGINT - 1)
    ignored, blocked = (str(int(bool(int(fields[k].strip(), 16) & bit))) for k in ("SigIgn", "SigBlk"))
    return ignored, blocked


def _interrupt_when(tmp_path: Path, n: int, ready: Callable[[int], bool]) -> tuple[subprocess.Popen[str], str, int]:
    """Run ``bevcompile fleet`` of ``n`` vehicles, Ctrl-C it (SIGINT to its process group, as a
    terminal does) once ``ready(stores on disk)``; ``(process, stderr, stores seen then)``."""
    manifest = write_fleet(tmp_path / "fleet", n)
    out = tmp_path / "out"
    process = subprocess.Popen(
        [str(Path(sys.executable).parent / "bevcompile"), "fleet", str(manifest), "--out", str(out), "--workers", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, cwd=tmp_path,
        preexec_fn=_sigint_as_a_terminal_gives_it,
    )
    try:
        deadline = time.monotonic() + 3 * START_TIMEOUT_S  # a loaded CI machine starts the workers slowly
        while not ready(len(list(out.glob("*.zarr")))) and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        seen = len(list(out.glob("*.zarr"))) if process.poll() is None else -1
        if process.poll() is None:
            assert _sigint_state(process.pid) == ("0", "0"), f"the fleet ignores or blocks SIGINT: {_sigint_state(process.pid)}"
        os.killpg(process.pid, signal.SIGINT)
        _, stderr = process.communicate(timeout=CANCEL_BOUND_S)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    return process, stderr, seen


def test_ctrl_c_stops_the_fleet_and_leaves_every_store_whole(tmp_path: Path) -> None:
    n = 40  # the Ctrl-C must reach a running fleet: its start ignores it (the workers must not see it), its end is tested below
    process, stderr, seen = _interrupt_when(tmp_path, n, lambda stores: stores >= 2)
    assert 2 <= seen < n, f"the fleet was not running when interrupted ({seen} of {n} stores; exit {process.returncode}): {stderr}"
    assert process.returncode == 130, stderr
    assert stderr.startswith("error: interrupted; ") and stderr.count("\n") == 1
    assert "every store is whole (old or new, never half)" in stderr
    out = tmp_path / "out"
    index = json.loads((out / "fleet.json").read_text())
    built = {v["id"] for v in index["vehicles"] if v["status"] == "built"}
    stores = {p.name.removesuffix(".zarr") for p in out.glob("*.zarr")}
    assert built == stores and index["counts"]["cancelled"] + index["counts"]["pending"] > 0
    assert all(inspect_store(out / f"{vehicle}.zarr").passed for vehicle in stores)
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]  # no staging folder, no temporary


def test_ctrl_c_after_the_last_vehicle_says_what_was_done(tmp_path: Path) -> None:
    """A Ctrl-C after every store is in place, while the index is written and the workers shut down,
    said "interrupted before any vehicle was started; nothing was written" (exit 130) or was lost.
    Now: exit 130 and the count of what was done, from the index on disk; or, when it came after
    the command had finished, exit 0 and the summary."""
    n = 4
    process, stderr, _ = _interrupt_when(tmp_path, n, lambda stores: stores >= n)
    index = json.loads((tmp_path / "out" / "fleet.json").read_text())
    assert index["counts"]["built"] == n, index["counts"]
    if process.returncode == 130:
        assert stderr.startswith(f"error: interrupted; {n} of {n} vehicles done ({n} built), 0 failed, 0 cancelled; "), stderr
    else:
        assert process.returncode == 0 and not stderr, (process.returncode, stderr)


CANCEL_BOUND_S = 120.0


def test_an_interrupt_reads_every_result_that_landed_before_it(tmp_path: Path) -> None:
    """The race behind a CI failure: the interrupt arrives while tasks have finished (their stores
    are in place) but the result loop has not read them yet. The index must still say ``built``
    for exactly the stores on disk (the stop asks the scheduler what finished, after the cancel
    event, instead of cancelling those tasks as 'not started')."""
    from bevcompile.fleet.engine import INDEX_ATTR, run_fleet
    from bevcompile.fleet.manifest import load_manifest

    n = 4
    manifest = load_manifest(write_fleet(tmp_path / "fleet", n))
    out = tmp_path / "out"
    seen: list[str] = []

    def interrupt_once_every_store_is_in_place(result: Any) -> None:
        seen.append(result.id)
        if len(seen) > 1:
            return
        deadline = time.monotonic() + START_TIMEOUT_S
        while len(list(out.glob("*.zarr"))) < n and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(2.0)  # the tasks return (figures, shift) while this loop is not reading
        raise KeyboardInterrupt

    try:
        run_fleet(manifest, out, workers=2, on_result=interrupt_once_every_store_is_in_place)
    except KeyboardInterrupt as exc:
        stopped = getattr(exc, INDEX_ATTR)
    else:
        raise AssertionError("the interrupt raised in on_result did not stop the fleet")
    index = json.loads((out / "fleet.json").read_text())
    stores = {p.name.removesuffix(".zarr") for p in out.glob("*.zarr")}
    assert len(stores) == n
    assert {v["id"] for v in index["vehicles"] if v["status"] == "built"} == stores
    assert {r.id for r in stopped.vehicles if r.status == "built"} == stores
