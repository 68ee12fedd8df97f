"""The Dask engine of ``bevcompile fleet`` (extra ``[fleet]``: ``dask[distributed]``).

Default: an embedded ``LocalCluster`` of worker processes on this machine (``workers``, default
the number of cores; one thread each, BLAS threads 1), started and stopped by :func:`run_fleet`.
With ``scheduler`` (``tcp://HOST:PORT``) it runs on an existing Dask cluster after two checks,
each a one-line :class:`~bevcompile.errors.UsageError` (exit 2): every worker runs this bevcompile
version, and every worker sees the output folder at the same path (it must be shared storage: a
probe file the client writes must be readable, and writable beside, from every worker).

Each vehicle is one task (:func:`~bevcompile.fleet.task.compile_vehicle`: its products in one
process; imports are paid once per worker); the reference vehicle goes first and every other
vehicle's task waits for it (its shift is measured against the reference's store). Results arrive
as they complete; the index is rewritten atomically every :data:`INDEX_INTERVAL_S` and at the end.
An interrupt (Ctrl-C, SIGTERM) sets the fleet's cancel event (tasks stop before their store is put
in place), cancels the tasks not started, waits up to :data:`CANCEL_GRACE_S` for the running ones,
writes the index and re-raises: every store stays whole (old or new, never half).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._version import __version__
from ..errors import DependencyError, UsageError
from ..store.zarr_io import STORE_FORMAT, check_out_dir
from .index import FleetIndex
from .manifest import Manifest
from .task import FleetContext, VehicleResult, compile_vehicle, worker_name

INDEX_INTERVAL_S = 5.0
INDEX_ATTR = "bevcompile_fleet_index"
"""Set on the exception that stopped a fleet (Ctrl-C, SIGTERM): the index written at the stop."""
CANCEL_GRACE_S = 30.0
CONNECT_TIMEOUT_S = 20.0
WORKER_WAIT_S = 30.0
START_TIMEOUT_S = 120.0


def _import_distributed() -> Any:
    try:
        import distributed
    except ImportError:
        raise DependencyError("bevcompile fleet needs Dask: pip install 'bevcompile[fleet]' (dask[distributed])") from None
    return distributed


def worker_identity() -> dict[str, Any]:
    """What the version check compares, run on every worker."""
    import sys

    import bevcompile

    return {"bevcompile": bevcompile.__version__, "store_format": STORE_FORMAT, "python": sys.version.split()[0], "worker": worker_name()}


def warm_up() -> str:
    """Import what every vehicle needs, once per worker (before the first vehicle is timed)."""
    import bevcompile.fleet.resolve
    import bevcompile.grid.build
    import bevcompile.grid.checks
    import bevcompile.interop.export
    import bevcompile.matrix.build
    import bevcompile.matrix.checks
    import bevcompile.report.diff
    import bevcompile.store.inspection  # noqa: F401

    return worker_name()


def probe_folder(path: str, token: str) -> str | None:
    """On a worker: None if ``path`` (the client's probe file) holds ``token`` and a file can be
    written beside it, else what is wrong."""
    try:
        with open(path, encoding="utf-8") as fh:
            if fh.read() != token:
                return f"{path} holds something else: not the folder the client sees"
        mine = f"{path}.{os.getpid()}-{uuid.uuid4().hex[:8]}"
        with open(mine, "w", encoding="utf-8") as fh:
            fh.write(token)
        os.remove(mine)
    except OSError as exc:
        return f"{path}: {exc.strerror or exc.__class__.__name__}"
    return None


@contextmanager
def _sigint_ignored() -> Iterator[None]:
    """Worker processes started inside inherit SIGINT ignored: a terminal's Ctrl-C reaches the
    whole process group, and only this process (the client) must see it, to stop the fleet
    in order (a worker killed by it could not finish putting a store in place)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@dataclass
class Engine:
    """A connected Dask client (and the LocalCluster it started, if any)."""

    client: Any
    cluster: Any
    description: dict[str, Any]

    def close(self) -> None:
        with _quiet():
            try:
                self.client.close(timeout=10)
            finally:
                if self.cluster is not None:
                    self.cluster.close(timeout=10)


@contextmanager
def _quiet() -> Iterator[None]:
    """Dask logs to stderr at shutdown (connections closing, tasks cancelled): the command already
    says what happened."""
    names = ("distributed", "tornado", "asyncio")
    levels = {n: logging.getLogger(n).level for n in names}
    for n in names:
        logging.getLogger(n).setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        for n, level in levels.items():
            logging.getLogger(n).setLevel(level)


def check_engine_options(workers: int | None, scheduler: str | None) -> None:
    """UsageError for ``--workers`` with ``--scheduler`` or a worker count below 1 (before any work)."""
    if scheduler is not None and workers is not None:
        raise UsageError("--workers and --scheduler exclude each other (the cluster's workers are what they are)")
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
        raise UsageError(f"--workers must be an integer >= 1, got {workers!r}")
    if scheduler is not None and not scheduler.strip():
        raise UsageError("--scheduler must be an address (tcp://HOST:PORT)")


def start_engine(*, workers: int | None, scheduler: str | None, out_dir: Path) -> Engine:
    """Connect to ``scheduler`` (after its checks), or start a LocalCluster of ``workers`` processes."""
    check_engine_options(workers, scheduler)
    distributed = _import_distributed()
    if scheduler is not None:
        try:
            with _quiet():
                client = distributed.Client(scheduler, timeout=CONNECT_TIMEOUT_S)
        except Exception as exc:
            raise UsageError(f"--scheduler {scheduler}: cannot connect ({exc.__class__.__name__}: {' '.join(str(exc).split())})") from None
        engine = Engine(client, None, {"scheduler": scheduler})
        try:
            _check_cluster(engine, scheduler, out_dir)
        except BaseException:
            engine.close()
            raise
        return engine
    n = workers if workers is not None else (os.cpu_count() or 1)
    with _quiet(), _sigint_ignored():
        cluster = distributed.LocalCluster(
            n_workers=n, threads_per_worker=1, processes=True, host="127.0.0.1", dashboard_address=":0",
            silence_logs=logging.CRITICAL, memory_limit="auto",
        )
    client = distributed.Client(cluster)
    engine = Engine(client, cluster, {"scheduler": "local", "workers": n})
    try:
        engine.description["worker_names"] = sorted(client.run(warm_up).values())
    except BaseException:
        engine.close()
        raise
    return engine


def _check_cluster(engine: Engine, scheduler: str, out_dir: Path) -> None:
    client = engine.client
    try:
        client.wait_for_workers(1, timeout=WORKER_WAIT_S)
    except Exception:
        raise UsageError(f"--scheduler {scheduler}: no worker joined within {WORKER_WAIT_S:g} s") from None
    identities = client.run(worker_identity)
    mine = worker_identity()
    for address, identity in sorted(identities.items()):
        if identity.get("bevcompile") != mine["bevcompile"] or identity.get("store_format") != mine["store_format"]:
            raise UsageError(
                f"--scheduler {scheduler}: worker {address} runs bevcompile {identity.get('bevcompile')} "
                f"(store format {identity.get('store_format')}), this is {mine['bevcompile']} ({mine['store_format']}): "
                "every worker must run the same version (same stores)"
            )
    token = uuid.uuid4().hex
    probe = out_dir / f".fleet-probe-{token[:12]}"
    try:
        probe.write_text(token, encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"--out {out_dir}: cannot write ({exc.strerror or exc})") from None
    try:
        answers = client.run(probe_folder, str(probe), token)
    finally:
        probe.unlink(missing_ok=True)
    for address, problem in sorted(answers.items()):
        if problem is not None:
            raise UsageError(
                f"--scheduler {scheduler}: worker {address} cannot use --out {out_dir} ({problem}): the output folder must be "
                "shared storage that every worker mounts at the same path"
            )
    engine.description.update(workers=len(identities), worker_names=sorted(i["worker"] for i in identities.values()))
    client.run(warm_up)


@dataclass
class FleetRun:
    """What :func:`run_fleet` returns: the index (also written to ``<out>/fleet.json``) and its path."""

    index: FleetIndex
    path: Path
    seconds: float


def run_fleet(
    manifest: Manifest,
    out_dir: str | Path,
    *,
    workers: int | None = None,
    scheduler: str | None = None,
    resume: bool = False,
    inspect: bool = True,
    max_shift_px: float | None = None,
    max_coverage_change: float | None = None,
    on_start: Callable[[int], None] | None = None,
    on_result: Callable[[VehicleResult], None] | None = None,
) -> FleetRun:
    """Compile every vehicle of ``manifest`` into ``<out_dir>/<id>.zarr`` (see the module docstring).

    Gates default to the manifest's. Raises UsageError / DependencyError before any vehicle for a
    bad engine setup; KeyboardInterrupt (after the orderly stop) for an interrupt."""
    from ..report.diff import _check_gates

    out = Path(out_dir)
    check_out_dir(out)
    check_engine_options(workers, scheduler)
    gates = (
        manifest.max_shift_px if max_shift_px is None else max_shift_px,
        manifest.max_coverage_change if max_coverage_change is None else max_coverage_change,
    )
    _check_gates(*gates)
    _import_distributed()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"--out {out}: cannot create the folder ({exc.strerror or exc})") from None
    out = out.resolve()
    t0 = time.perf_counter()
    run_id = uuid.uuid4().hex[:12]
    engine = start_engine(workers=workers, scheduler=scheduler, out_dir=out)
    cancel_name = f"bevcompile-fleet-cancel-{run_id}"
    ctx = FleetContext(
        manifest=manifest.path, template=manifest.template, products=manifest.products, out_dir=str(out), resume=resume,
        reference=manifest.reference, max_shift_px=gates[0], max_coverage_change=gates[1], cancel_event=cancel_name,
        inspect=inspect,
    )
    run_info: dict[str, Any] = {
        "tool_version": __version__,
        "manifest": str(Path(manifest.path).resolve()),
        "manifest_sha256": manifest.sha256,
        "description": manifest.description,
        "out": str(out),
        "products": {p.name: p.to_json() for p in manifest.products},
        "reference": manifest.reference,
        "gates": {"max_shift_px": gates[0], "max_coverage_change": gates[1]},
        "resume": resume,
        "inspect": inspect,
        "engine": engine.description,
    }
    results: dict[str, VehicleResult] = {v.id: VehicleResult(id=v.id, status="pending", sources=v.sources()) for v in manifest.vehicles}

    def index(seconds: float | None = None) -> FleetIndex:
        info = dict(run_info)
        info["seconds"] = round(time.perf_counter() - t0 if seconds is None else seconds, 3)
        return FleetIndex(info, [results[v.id] for v in manifest.vehicles])

    distributed = _import_distributed()
    client = engine.client
    futures: dict[Any, str] = {}
    final: FleetIndex | None = None
    written = False
    try:
        shared = client.scatter(ctx, broadcast=True, hash=False)
        reference = manifest.vehicle(manifest.reference)
        ref_future = client.submit(compile_vehicle, shared, reference, None, key=f"bevcompile-fleet-{run_id}-{reference.id}", priority=1, pure=False)
        futures[ref_future] = reference.id
        for vehicle in manifest.vehicles:
            if vehicle.id != reference.id:
                future = client.submit(compile_vehicle, shared, vehicle, ref_future, key=f"bevcompile-fleet-{run_id}-{vehicle.id}", pure=False)
                futures[future] = vehicle.id
        if on_start is not None:
            on_start(len(futures))
        last_write = time.monotonic()
        for future in distributed.as_completed(list(futures)):
            vehicle_id = futures[future]
            results[vehicle_id] = _result_of(future, vehicle_id, results[vehicle_id])
            if on_result is not None:
                on_result(results[vehicle_id])
            if time.monotonic() - last_write > INDEX_INTERVAL_S:
                index().write(out)
                last_write = time.monotonic()
        final = index()  # every vehicle read: the index is written before the engine closes
        path = final.write(out)
        written = True
    except BaseException as exc:
        if final is None:
            _stop(engine, distributed, cancel_name, futures, results, on_result)
            final = index()
        if not written:
            final.write(out)
        with contextlib.suppress(AttributeError, TypeError):
            setattr(exc, INDEX_ATTR, final)  # what the CLI says about the interrupted fleet
        raise
    finally:
        try:
            engine.close()
        except BaseException as exc:  # an interrupt while the engine closes: the index says what was done
            if final is not None:
                with contextlib.suppress(AttributeError, TypeError):
                    setattr(exc, INDEX_ATTR, final)
            raise
    return FleetRun(final, path, time.perf_counter() - t0)


def _result_of(future: Any, vehicle_id: str, pending: VehicleResult) -> VehicleResult:
    """The task's result; an infrastructure failure (a worker died, a task error) is a failed vehicle."""
    try:
        result = future.result()
    except BaseException as exc:  # KilledWorker, CancelledError, a task exception
        if isinstance(exc, KeyboardInterrupt):
            raise
        name = exc.__class__.__name__
        detail = " ".join(str(exc).split())
        status = "cancelled" if name == "CancelledError" else "failed"
        why = (
            "its worker process died while building it (out of memory? the worker's log says)"
            if name == "KilledWorker"
            else f"{name}: {detail}" if detail else name
        )
        failed = VehicleResult.from_json(pending.to_json())
        failed.status, failed.error = status, why
        return failed
    assert isinstance(result, VehicleResult)
    return result


def _stop(
    engine: Engine,
    distributed: Any,
    cancel_name: str,
    futures: dict[Any, str],
    results: dict[str, VehicleResult],
    on_result: Callable[[VehicleResult], None] | None,
) -> None:
    """The orderly stop after an interrupt: cancel event, cancel what has not started, wait (a
    bounded time, a second interrupt ends the wait) for the running vehicles.

    Every vehicle whose task may have put a store in place gets the task's own result, so the
    index says ``built`` for exactly the stores this run installed. The cancel event is set
    FIRST: a task that starts after it stops at its first checkpoint (no store). Then the
    scheduler is asked which tasks are running and which have finished; a task is cancelled only
    if it was neither when asked (after the event), so it never installs a store. The finished
    ones include tasks that completed while the interrupt arrived but that the result loop had
    not read yet, and tasks that finished after the client's last look (its ``done()`` lags
    the scheduler)."""
    client = engine.client
    unread = [f for f in futures if results[futures[f]].status == "pending"]
    with _quiet():
        try:
            distributed.Event(cancel_name, client=client).set()
            running = {key for keys in client.processing().values() for key in keys}
            held = {key for key, workers in client.who_has(unread).items() if workers}
        except Exception:  # the scheduler is gone: nothing more will run; read what the client has
            running, held = set(), set()
        settle: list[Any] = []
        not_started: list[Any] = []
        for f in unread:
            (settle if f.key in running or f.key in held or f.done() else not_started).append(f)
        with contextlib.suppress(Exception):
            client.cancel(not_started)
        for f in not_started:
            pending = results[futures[f]]
            pending.status, pending.error = "cancelled", "not started: the fleet was interrupted"
        try:
            for future in distributed.as_completed(settle, timeout=CANCEL_GRACE_S):
                results[futures[future]] = _result_of(future, futures[future], results[futures[future]])
                if on_result is not None:
                    on_result(results[futures[future]])
        except BaseException:  # the grace time ran out, or a second Ctrl-C
            pass
        for f in settle:
            pending = results[futures[f]]
            if pending.status == "pending":
                pending.status = "cancelled"
                pending.error = "still running when the fleet stopped (its store, if any, is whole: old or new)"
