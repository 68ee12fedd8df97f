"""The fleet index: ``<out>/fleet.json`` (and ``fleet.csv``), and the report over it.

``fleet.json`` (format ``bevcompile-fleet/1``): the run (manifest, its sha256, products and
their single-command equivalents, engine, gates, tool version, counts, wall time) and one record
per vehicle in manifest order: ``id``, ``status`` (built / resumed / failed / cancelled /
pending), ``error``, ``store``, ``rig_file``, ``sources``, ``config_sha256``, ``tool_version``,
``bytes`` (chunk bytes on disk), ``seconds`` and ``phases``, ``worker``, ``coverage`` (per camera,
per height: the fraction of BEV cells valid, ``grid/`` attrs), ``kept_weight`` (Top-K ``total`` /
``worst_row``, ``matrix/`` attrs), ``nnz``, ``delta_ratio`` (``delta/`` on-device bytes / norm_int16
bytes), ``shift`` (against the reference vehicle: per camera max/mean/p99 shift in feature pixels,
lost/gained coverage fractions, pose change; ``max_px``, ``coverage_change_max``), ``flags``
(gate failures: outliers), ``notes``. ``fleet.csv`` holds one row per vehicle with the scalar
figures, for spreadsheets. Both are rewritten atomically (a temporary, then a rename).
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import StoreError, UsageError
from ..files import MAX_JSON_DEPTH, MISSING, FileRefused, json_depth, read_regular, replace_file
from .task import VehicleResult, flags_for

INDEX_FORMAT = "bevcompile-fleet/1"
INDEX_JSON = "fleet.json"
INDEX_CSV = "fleet.csv"
STATUS_ORDER = ("built", "resumed", "failed", "cancelled", "pending")
CSV_COLUMNS = (
    "id", "status", "flagged", "error", "config_sha256", "tool_version", "bytes", "seconds",
    "coverage_min", "coverage_mean", "kept_weight_total", "kept_weight_worst_row", "nnz", "delta_ratio",
    "shift_max_px", "shift_max_camera", "coverage_change_max", "coverage_change_camera", "flags", "store", "rig_file",
)


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def camera_coverage(result: VehicleResult) -> dict[str, float]:
    """Per camera, the fraction of BEV cells it sees over all heights (the mean of the per-height fractions)."""
    return {cam: (sum(values) / len(values) if values else 0.0) for cam, values in result.coverage.items()}


def csv_row(result: VehicleResult) -> dict[str, Any]:
    coverage = list(camera_coverage(result).values())
    shift = result.shift or {}
    kept = result.kept_weight or {}
    return {
        "id": result.id,
        "status": result.status,
        "flagged": "yes" if result.flags else "",
        "error": result.error or "",
        "config_sha256": result.config_sha256 or "",
        "tool_version": result.tool_version or "",
        "bytes": result.bytes if result.bytes is not None else "",
        "seconds": result.seconds,
        "coverage_min": min(coverage) if coverage else "",
        "coverage_mean": sum(coverage) / len(coverage) if coverage else "",
        "kept_weight_total": kept.get("total", ""),
        "kept_weight_worst_row": kept.get("worst_row", ""),
        "nnz": result.nnz if result.nnz is not None else "",
        "delta_ratio": result.delta_ratio if result.delta_ratio is not None else "",
        "shift_max_px": shift.get("max_px", "") if shift.get("max_px") is not None else "",
        "shift_max_camera": shift.get("max_px_camera") or "",
        "coverage_change_max": shift.get("coverage_change_max", "") if shift.get("coverage_change_max") is not None else "",
        "coverage_change_camera": shift.get("coverage_change_camera") or "",
        "flags": "; ".join(result.flags),
        "store": result.store or "",
        "rig_file": result.rig_file or "",
    }


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    try:
        tmp.write_text(text, encoding="utf-8")
        replace_file(tmp, path)
    except (OSError, FileRefused) as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        reason = exc.reason if isinstance(exc, FileRefused) else exc.strerror or exc
        raise StoreError(f"{path}: cannot write the fleet index ({reason})") from None


def counts(results: Iterable[VehicleResult]) -> dict[str, int]:
    out = {status: 0 for status in STATUS_ORDER}
    flagged = 0
    total = 0
    for r in results:
        out[r.status] = out.get(r.status, 0) + 1
        flagged += bool(r.flags)
        total += 1
    return {"total": total, **out, "flagged": flagged}


@dataclass
class FleetIndex:
    """The index of one fleet run (see the module docstring)."""

    run: dict[str, Any]
    vehicles: list[VehicleResult] = field(default_factory=list)

    @property
    def counts(self) -> dict[str, int]:
        return counts(self.vehicles)

    @property
    def failed(self) -> list[VehicleResult]:
        return [v for v in self.vehicles if v.status == "failed"]

    @property
    def flagged(self) -> list[VehicleResult]:
        return [v for v in self.vehicles if v.flags]

    @property
    def incomplete(self) -> list[VehicleResult]:
        return [v for v in self.vehicles if v.status in ("cancelled", "pending")]

    def to_json(self) -> dict[str, Any]:
        return _finite({"format": INDEX_FORMAT, **self.run, "counts": self.counts, "vehicles": [v.to_json() for v in self.vehicles]})

    def csv_text(self) -> str:
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, fieldnames=CSV_COLUMNS, lineterminator="\n")
        writer.writeheader()
        for vehicle in self.vehicles:
            writer.writerow(csv_row(vehicle))
        return buffer.getvalue()

    def write(self, out_dir: str | Path) -> Path:
        """Rewrite ``fleet.json`` and ``fleet.csv`` atomically; returns the JSON path."""
        folder = Path(out_dir)
        path = folder / INDEX_JSON
        _atomic_write(path, json.dumps(self.to_json(), indent=1, allow_nan=False) + "\n")
        _atomic_write(folder / INDEX_CSV, self.csv_text())
        return path

    def regated(self, max_shift_px: float | None, max_coverage_change: float | None) -> FleetIndex:
        """The same index with every vehicle's flags recomputed for other gates."""
        vehicles = []
        for v in self.vehicles:
            copy = VehicleResult.from_json(v.to_json())
            copy.flags = flags_for(v, max_shift_px, max_coverage_change)
            vehicles.append(copy)
        run = dict(self.run)
        run["gates"] = {"max_shift_px": max_shift_px, "max_coverage_change": max_coverage_change, "regated_by": "fleet-report"}
        return FleetIndex(run, vehicles)


MAX_INDEX_BYTES = 1 << 30
"""A ``fleet.json`` is at most 1 GiB (about a kilobyte per vehicle)."""


def read_index(folder: str | Path) -> FleetIndex:
    """Read ``<folder>/fleet.json``. UsageError (exit 2) if it is missing or not a fleet index."""
    folder = Path(folder)
    path = folder / INDEX_JSON if folder.is_dir() or not folder.name.endswith(".json") else folder
    try:  # a regular file of bounded size, nesting bounded before it is parsed
        raw = read_regular(path, MAX_INDEX_BYTES, "a fleet index")
        depth = json_depth(raw)
        if depth > MAX_JSON_DEPTH:
            raise ValueError(f"nested {depth:,} levels deep, more than {MAX_JSON_DEPTH}")
        data = json.loads(raw.decode("utf-8"))
    except FileRefused as exc:
        if exc.code == MISSING:
            raise UsageError(f"{path}: no fleet index here (bevcompile fleet MANIFEST --out {folder} writes it)") from None
        raise UsageError(f"{path}: {exc.reason}") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise UsageError(f"{path}: not a readable fleet index ({exc.__class__.__name__}: {' '.join(str(exc).split())})") from None
    if not isinstance(data, Mapping) or data.get("format") != INDEX_FORMAT:
        found = data.get("format") if isinstance(data, Mapping) else type(data).__name__
        raise UsageError(f"{path}: not a fleet index (format {found!r}, expected {INDEX_FORMAT!r})")
    vehicles = data.get("vehicles")
    if not isinstance(vehicles, list) or not all(isinstance(v, Mapping) and isinstance(v.get("id"), str) for v in vehicles):
        raise UsageError(f"{path}: vehicles: expected a list of vehicle records with an id")
    run = {k: v for k, v in data.items() if k not in ("format", "counts", "vehicles")}
    try:
        records = [VehicleResult.from_json(dict(v)) for v in vehicles]
    except TypeError as exc:
        raise UsageError(f"{path}: vehicles: a record is not a vehicle record ({exc})") from None
    return FleetIndex(run, records)


def distribution(values: Iterable[float | None]) -> tuple[float, float, float] | None:
    """(min, median, max) of the finite values, None when there are none."""
    finite = sorted(v for v in values if isinstance(v, int | float) and math.isfinite(v))
    if not finite:
        return None
    n = len(finite)
    median = finite[n // 2] if n % 2 else 0.5 * (finite[n // 2 - 1] + finite[n // 2])
    return finite[0], median, finite[-1]
