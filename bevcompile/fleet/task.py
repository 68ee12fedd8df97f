"""One vehicle, start to finish, in one worker process (a Dask task, or called directly).

:func:`compile_vehicle`: resolve the vehicle's rig config (:mod:`.resolve`); with ``resume``,
keep a store that already holds this config (same ``config_sha256`` and stored config), the same
build options in every group, this tool's version, and passes ``inspect``; otherwise build every
product into a staging folder beside the store (the single commands' library functions), run
``inspect`` on it (unless ``inspect`` is off), and put it in place in one atomic swap (the old store, if any, stays whole
until then); write the resolved config to ``<out>/rigs/<id>.yaml``; read the figures of the
index from the store's attributes; and measure the calibration shift against the reference
vehicle's store with the ``diff`` machinery. Every failure is a result (status ``failed`` and
its one-line error), never an exception, so the fleet goes on.
"""

from __future__ import annotations

import json
import math
import os
import socket
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .._version import __version__
from ..errors import BevcompileError, CheckFailed
from ..rig.config import RigConfig, config_sha256, config_to_dict, write_config_yaml
from .manifest import Template, Vehicle
from .products import Product, build_products, expected_groups

RIGS_FOLDER = "rigs"
"""``<out>/rigs/<id>.yaml``: each vehicle's resolved rig config (the single commands rebuild its store from it)."""
STATUSES = ("built", "resumed", "failed", "cancelled")


class Cancelled(Exception):
    """The fleet was cancelled: this vehicle stops before its store is put in place."""


@dataclass(frozen=True)
class FleetContext:
    """What every vehicle of a fleet shares (sent to each worker once)."""

    manifest: str
    template: Template | None
    products: tuple[Product, ...]
    out_dir: str
    resume: bool = False
    reference: str | None = None
    max_shift_px: float | None = None
    max_coverage_change: float | None = None
    cancel_event: str | None = None
    inspect: bool = True


@dataclass
class VehicleResult:
    """What the index records of one vehicle (``to_json``). ``status``: ``built`` (this run wrote
    the store), ``resumed`` (the store was already this build: kept), ``failed`` (``error`` says
    why; no store was changed), ``cancelled``."""

    id: str
    status: str
    error: str | None = None
    store: str | None = None
    rig_file: str | None = None
    sources: list[str] = field(default_factory=list)
    config_sha256: str | None = None
    tool_version: str | None = None
    bytes: int | None = None
    seconds: float = 0.0
    phases: dict[str, float] = field(default_factory=dict)
    worker: str = ""
    cameras: list[str] = field(default_factory=list)
    coverage: dict[str, list[float]] = field(default_factory=dict)
    kept_weight: dict[str, float] | None = None
    nnz: int | None = None
    delta_ratio: float | None = None
    shift: dict[str, Any] | None = None
    flags: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status in ("built", "resumed")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> VehicleResult:
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in known})


def worker_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def _cancel_check(name: str | None) -> Callable[[], None]:
    """A checkpoint that raises :class:`Cancelled` once the fleet's cancel event is set (inside a
    Dask worker; a no-op elsewhere)."""
    if name is None:
        return lambda: None
    try:
        from distributed import Event, get_worker

        get_worker()
    except (ImportError, ValueError):
        return lambda: None
    event = Event(name)

    def check() -> None:
        try:
            cancelled = event.is_set()
        except Exception:  # the scheduler went away: the fleet is over
            cancelled = True
        if cancelled:
            raise Cancelled

    return check


def _json_equal(a: Any, b: Any) -> bool:
    def canon(v: Any) -> str:
        return json.dumps(json.loads(json.dumps(v, default=str)), sort_keys=True)

    return canon(a) == canon(b)


def up_to_date(path: Path, rig: RigConfig, products: tuple[Product, ...]) -> str | None:
    """None if the store at ``path`` is exactly this build and passes ``inspect``, else why not."""
    from ..store.inspection import inspect_store
    from ..store.zarr_io import is_store, open_store

    if not is_store(path):
        return "no store yet"
    try:
        reader = open_store(path)
        attrs = reader.root_attrs
        if attrs.get("config_sha256") != config_sha256(rig) or not _json_equal(attrs.get("config"), config_to_dict(rig)):
            return "the calibration changed"
        if attrs.get("tool_version") != __version__:
            return f"built by bevcompile {attrs.get('tool_version')}, this is {__version__}"
        want = expected_groups(rig, products)
        have = reader.groups()
        if sorted(have) != sorted(want):
            return f"groups {', '.join(have) or 'none'}, the products write {', '.join(sorted(want))}"
        for group, options in want.items():
            if not _json_equal(reader.group_attrs(group).get("build_options"), options):
                return f"{group}/ was built with other options"
    except BevcompileError as exc:
        return f"unreadable ({exc})"
    report = inspect_store(path)
    if not report.passed:
        return f"fails inspect ({report.failure_lines()[0]})"
    return None


def _figures(result: VehicleResult, path: Path) -> None:
    """Coverage per camera, Top-K kept weight, nnz, delta ratio and bytes, from the stored attributes."""
    from ..store.zarr_io import open_store

    reader = open_store(path)
    result.bytes = reader.disk_bytes()
    result.tool_version = str(reader.root_attrs.get("tool_version"))
    groups = reader.groups()
    if "grid" in groups:
        attrs = reader.group_attrs("grid")
        result.cameras = [str(c) for c in attrs.get("cameras", [])]
        result.coverage = {str(c): [float(v) for v in cov] for c, cov in zip(attrs.get("cameras", []), attrs.get("coverage", []), strict=False)}
    if "matrix" in groups:
        attrs = reader.group_attrs("matrix")
        kept = attrs.get("kept_weight_fraction") or {}
        result.kept_weight = {"total": float(kept.get("total", 1.0)), "worst_row": float(kept.get("worst_row", 1.0))}
        result.nnz = attrs.get("nnz")
    if "delta" in groups:
        result.delta_ratio = reader.group_attrs("delta").get("ratio_vs_norm_int16")


_REFERENCE_CACHE: dict[tuple[str, str, int], Any] = {}


def _reference_store(path: Path) -> Any:
    """The reference store, loaded once per worker process (keyed by path, config and zarr.json mtime)."""
    from ..store.loader import load

    meta = path / "zarr.json"
    stat = meta.stat()
    store = load(path)
    key = (str(path), store.config_sha256, stat.st_mtime_ns)
    cached = _REFERENCE_CACHE.get(key)
    if cached is not None:
        return cached
    _REFERENCE_CACHE.clear()
    _REFERENCE_CACHE[key] = store
    return store


def _shift(result: VehicleResult, path: Path, ctx: FleetContext, reference: VehicleResult | None) -> None:
    """Calibration shift against the reference vehicle (``report.diff.camera_diffs``: per camera the
    pose change and the ``diff`` shift figures, as ``bevcompile diff --json`` writes them)."""
    from ..errors import UsageError
    from ..report.diff import camera_diffs
    from ..store.loader import load

    if ctx.reference is None or ctx.reference == result.id:
        result.shift = {"reference": result.id, "is_reference": True}
        return
    if not any(p.name == "grid" for p in ctx.products):
        result.notes.append("no calibration shift: the products have no grid/ (the diff machinery compares grid/coords)")
        return
    if reference is None or not reference.ok or reference.store is None:
        why = reference.error if reference is not None else "not built"
        result.shift = {"reference": ctx.reference, "comparable": None, "reason": f"the reference vehicle has no store ({why})"}
        return
    try:
        diffs = camera_diffs(_reference_store(Path(reference.store)), load(path))
    except UsageError as exc:
        result.shift = {"reference": ctx.reference, "comparable": False, "reason": str(exc)}
        return
    cameras = {c.camera: {"rotation_deg": c.rotation_deg, "translation_mm": c.translation_mm, **c.total.to_json()} for c in diffs}
    shifts = [(v["shift_max_px"], name) for name, v in cameras.items() if v["shift_max_px"] is not None]
    finite = [(v, n) for v, n in shifts if math.isfinite(v)]
    worst = max(finite, key=lambda item: item[0]) if finite else (None, None)  # ties: the first camera
    changes = [(max(v["lost_fraction"], v["gained_fraction"]), name) for name, v in cameras.items()]
    change = max(changes, key=lambda item: item[0]) if changes else (0.0, None)
    result.shift = {
        "reference": ctx.reference,
        "comparable": True,
        "max_px": worst[0] if len(finite) == len(shifts) else math.inf,
        "max_px_camera": worst[1],
        "coverage_change_max": change[0],
        "coverage_change_camera": change[1],
        "cameras": cameras,
    }


_STATS_FIELDS = (
    "n_cells", "cells_both", "cells_only_old", "cells_only_new", "shift_max_px", "shift_mean_px", "shift_p99_px",
    "nearest_pixel_changed", "max_shift_cell", "max_shift_cell_ego_m",
)


def flags_for(result: VehicleResult, max_shift_px: float | None, max_coverage_change: float | None) -> list[str]:
    """The gate failures (outliers) of a vehicle, from its recorded shift figures, by the rules of
    ``bevcompile diff``'s gates (:func:`bevcompile.report.diff.gate_failures`): ``<camera>: <figure> > <gate>``.
    A vehicle whose shift could not be measured (not comparable, no reference store) is flagged
    when a gate is set."""
    from ..report.diff import ShiftStats, gate_failures

    shift = result.shift
    if (max_shift_px is None and max_coverage_change is None) or not result.ok or shift is None or shift.get("is_reference"):
        return []
    if not shift.get("comparable"):
        return [f"calibration shift unmeasured against {shift.get('reference')}: {shift.get('reason')}"]
    out: list[str] = []
    for camera, figures in (shift.get("cameras") or {}).items():
        values = {k: figures.get(k) for k in _STATS_FIELDS}
        values["shift_max_px"] = math.nan if figures.get("shift_max_px") is None and figures.get("cells_both") else values["shift_max_px"]
        for key in ("max_shift_cell", "max_shift_cell_ego_m"):
            values[key] = tuple(values[key]) if values[key] is not None else None
        out.extend(f"{camera}: {failure}" for failure in gate_failures(ShiftStats(**values), max_shift_px, max_coverage_change))
    return out


def compile_vehicle(ctx: FleetContext, vehicle: Vehicle, reference: VehicleResult | None = None) -> VehicleResult:
    """Build (or keep) one vehicle's store; never raises for a bad vehicle (see the module docstring).

    ``reference``: the reference vehicle's result (its store must be in place before the shift is
    measured; the engine makes every other vehicle wait for it)."""
    from ..store.inspection import inspect_store
    from ..store.zarr_io import install_store, remove_folder, staging_folder, store_path
    from .resolve import resolve_vehicle

    t0 = time.perf_counter()
    result = VehicleResult(id=vehicle.id, status="failed", sources=vehicle.sources(), worker=worker_name())
    out = Path(ctx.out_dir)
    path = store_path(out, vehicle.id)
    checkpoint = _cancel_check(ctx.cancel_event)
    phases = result.phases

    def timed(name: str, fn: Callable[[], Any]) -> Any:
        t = time.perf_counter()
        try:
            return fn()
        finally:
            phases[name] = round(phases.get(name, 0.0) + time.perf_counter() - t, 4)

    try:
        checkpoint()
        rig = timed("resolve", lambda: resolve_vehicle(vehicle, ctx.template, ctx.manifest))
        result.config_sha256 = config_sha256(rig)
        why = timed("resume_check", lambda: up_to_date(path, rig, ctx.products)) if ctx.resume else "no --resume"
        if why is None:
            result.status = "resumed"
        else:
            if ctx.resume:
                result.notes.append(f"rebuilt: {why}")
            staging = staging_folder(path)
            try:
                built = timed("build", lambda: build_products(rig, staging, ctx.products, checkpoint=checkpoint))
                checkpoint()
                if ctx.inspect:
                    report = timed("inspect", lambda: inspect_store(built))
                    if not report.passed:
                        raise CheckFailed(f"the new store fails inspect: {report.failure_lines()[0]}")
                    checkpoint()
                timed("install", lambda: install_store(built, path))
            finally:
                remove_folder(staging)
            result.status = "built"
        result.store = str(path)
        rig_file = out / RIGS_FOLDER / f"{vehicle.id}.yaml"
        header = [
            f"{vehicle.id}: the resolved rig config of bevcompile fleet {Path(ctx.manifest).name} ({vehicle.field}), bevcompile {__version__}",
            f"calibration read from: {', '.join(result.sources) or ctx.manifest}",
            f"config_sha256 {result.config_sha256}: the single commands rebuild {path.name} from this file",
        ]
        timed("rig_file", lambda: write_config_yaml(rig_file, config_to_dict(rig), header))
        result.rig_file = str(rig_file)
        timed("figures", lambda: _figures(result, path))
        timed("shift", lambda: _shift(result, path, ctx, reference))
        result.flags = flags_for(result, ctx.max_shift_px, ctx.max_coverage_change)
    except Cancelled:
        result.status = "cancelled"
        result.error = "cancelled before its store was put in place (any earlier store is unchanged)"
    except BevcompileError as exc:
        result.status = "failed"
        result.error = " ".join(str(exc).split())
    except MemoryError as exc:
        result.status = "failed"
        result.error = f"out of memory ({' '.join(str(exc).split()) or 'MemoryError'}); the vehicle's problem is too large for its worker"
    except Exception as exc:  # a bug: the vehicle fails with its location, the fleet goes on
        frame = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
        where = f" at {Path(frame.filename).name}:{frame.lineno}" if frame else ""
        result.status = "failed"
        result.error = f"internal error{where}: {exc.__class__.__name__}: {' '.join(str(exc).split())}"
    if not result.ok and os.path.isdir(path):
        result.notes.append(f"{path} from an earlier build is unchanged")
    result.seconds = round(time.perf_counter() - t0, 4)
    return result
