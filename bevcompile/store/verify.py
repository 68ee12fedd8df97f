"""The ``verify`` runner: every NPU form of a store against the float reference path.

Seeded random features ``(n_cam, C, H_f, W_f)`` float32 uniform in ``[0, 1)`` (per feature
level, each of its own map size; the groups of level ``l`` see level ``l``'s) (so the PSNR
peak, the feature range, is 1) and LSS depth probabilities ``(n_cam, D, H_f, W_f)`` float32
(softmax over ``D`` of standard-normal logits) go into :class:`~bevcompile.checks_api.CheckContext`;
every plug-in's ``verify_<group>`` compares its products with the float reference and returns
one :class:`~bevcompile.checks_api.VerifyRow` per product and camera.

The store is read with the same robust loader as ``inspect`` and gets inspect's integrity
checks (without ``--strict``): an unreadable array, a content hash mismatch, an unusable stored
config or a broken invariant becomes a failed row (product ``integrity``), never a traceback. Pure: nothing here prints.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from ..errors import CheckFailed, StoreError, UsageError, hash_pair
from ..rig.config import RigConfig, config_sha256, load_config
from .inspection import call_plugin, check_context, load_store, plugin_functions, run_plugin_checks
from .plugins import LEVEL_GROUPS, CheckContext, VerifyRow, relabel_level, split_level_group
from .zarr_io import STDIO, is_store, open_store, store_path, the_one_store

DEFAULT_CHANNELS = 8
MAX_CHANNELS = 512
CONFIG_SUFFIXES = (".yaml", ".yml")


def check_feature_options(seed: int, channels: int) -> None:
    """``--seed`` / ``--channels`` of the seeded inputs (``verify``, ``diff``): one-line usage errors."""
    if isinstance(channels, bool) or not isinstance(channels, int) or channels < 1 or channels > MAX_CHANNELS:
        raise UsageError(f"--channels must be in [1, {MAX_CHANNELS}], got {channels}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise UsageError(f"--seed must be >= 0, got {seed}")

def random_depth_probs(rng: np.random.Generator, shape: tuple[int, ...], axis: int) -> npt.NDArray[np.float32]:
    """Seeded LSS depth probabilities: softmax over ``axis`` of standard-normal logits.

    Convention: ``shape`` e.g. ``(n_cam, D, H_f, W_f)`` with ``axis=1``; returns float32 of
    ``shape`` summing to 1 over ``axis`` (within float32). Draws ``prod(shape)`` normals from ``rng``.
    """
    logits = rng.standard_normal(shape)
    weights = np.exp(logits - logits.max(axis=axis, keepdims=True))
    return (weights / weights.sum(axis=axis, keepdims=True)).astype(np.float32)


def make_features(
    rig: RigConfig, channels: int, seed: int
) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]:
    """Seeded random inputs of the view transform.

    Convention:
        features: ``(n_cam, C, H_f, W_f)`` float32, uniform in ``[0, 1)``.
        depth_probs: ``(n_cam, D, H_f, W_f)`` float32, softmax over ``D`` (sums to 1 within float32).
        Both from ``numpy.random.default_rng(seed)``, features drawn first: same seed, same bytes.
    """
    check_feature_options(seed, channels)
    w_f, h_f = rig.feature_size
    rng = np.random.default_rng(seed)
    features = rng.random((rig.n_cam, channels, h_f, w_f), dtype=np.float32)
    depth_probs = random_depth_probs(rng, (rig.n_cam, rig.depth.n_bins, h_f, w_f), axis=1)
    return features, depth_probs


@dataclass
class VerifyReport:
    store: str
    name: str | None
    config_sha256: str | None
    seed: int
    channels: int
    rows: list[VerifyRow] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return bool(self.rows) and all(r.passed for r in self.rows)

    @property
    def n_judged(self) -> int:
        """Rows with a pass/fail criterion (informational rows are reported, not judged)."""
        return sum(1 for r in self.rows if not r.informational)

    @property
    def failures(self) -> list[VerifyRow]:
        return [r for r in self.rows if not r.passed]

    def failure_lines(self) -> list[str]:
        return [
            f"{self.store}: {r.product}: {r.camera}: max_abs {r.max_abs:.3g} (mean {r.mean_abs:.3g}, PSNR {format_psnr(r.psnr_db)}) fails {r.threshold}"
            + (f": {r.note}" if r.note else "")
            for r in self.failures
        ]

    def to_json(self) -> dict[str, Any]:
        return {
            "store": self.store,
            "name": self.name,
            "config_sha256": self.config_sha256,
            "seed": self.seed,
            "channels": self.channels,
            "feature_peak": 1.0,
            "passed": self.passed,
            "n_rows": len(self.rows),
            "n_judged": self.n_judged,
            "n_failed": len(self.failures),
            "rows": [
                {
                    "product": r.product,
                    "camera": r.camera,
                    "max_abs": _json_float(r.max_abs),
                    "mean_abs": _json_float(r.mean_abs),
                    "psnr_db": _json_float(r.psnr_db),
                    "threshold": r.threshold,
                    "passed": r.passed,
                    "informational": r.informational,
                    "note": r.note,
                }
                for r in self.rows
            ],
            "notes": list(self.notes),
        }


def _json_float(value: float) -> float | None:
    """JSON has no inf/NaN: ``null`` (for PSNR: identical outputs, infinite PSNR)."""
    return float(value) if math.isfinite(value) else None


def format_psnr(value: float) -> str:
    if math.isinf(value) and value > 0:
        return "inf"
    return f"{value:.1f}" if math.isfinite(value) else "n/a"


def _integrity_row(array: str, reason: str) -> VerifyRow:
    return VerifyRow("integrity", array, math.nan, math.nan, math.nan, "store readable and intact", False, reason)


def resolve_target(target: str | Path | None, out_dir: str | Path) -> tuple[Path, RigConfig | None]:
    """``(store path, config the user named or None)``.

    ``target`` may be a store (a directory), a rig config YAML (its store is
    ``<out_dir>/<name>.zarr``) or None (the bundled rig's store in ``out_dir``). A missing
    store raises :class:`StoreError` (exit 2); a store of another config (stale) raises
    :class:`CheckFailed` (exit 1) naming the rebuild command.
    """
    rig: RigConfig | None = None
    if target is not None and str(target) == STDIO:
        rig = load_config(STDIO)  # the config on standard input
    elif target is not None:
        path = the_one_store(target, "verify")
        if path.is_dir():
            if not is_store(path):
                open_store(path)  # says why (no zarr.json, or a permission this user lacks)
                raise StoreError(f"{path}: not a bevcompile store (no zarr.json at its root)")
            from .inspection import not_a_store_root

            not_a_store_root(path, "verify")
            return path, None
        if not path.exists() and path.suffix.lower() not in CONFIG_SUFFIXES:
            raise StoreError(f"{path}: no such store or config file")
        rig = load_config(path)
    else:
        rig = load_config(None)
    store = store_path(out_dir, rig.name)
    if not is_store(store):
        raise StoreError(f"{store}: no store for rig {rig.name!r} in {out_dir}; build it with `bevcompile grid` (and `bevcompile matrix`)")
    return store, rig


def check_not_stale(store: Path, rig: RigConfig, recorded_sha: Any) -> None:
    expected = config_sha256(rig)
    if recorded_sha != expected:
        raise CheckFailed(
            f"{store}: stale: built from config_sha256 {hash_pair(recorded_sha, expected)[0]}, the config {rig.source} hashes to "
            f"{hash_pair(recorded_sha, expected)[1]}; rebuild with `bevcompile grid` / `bevcompile matrix` (--force)"
        )


def _level_product(product: str, level: int) -> str:
    """A level-0 plug-in's product name for feature level ``level`` (``grid_l1/norm``, ``gather (level 1)``)."""
    renamed = relabel_level(product, level)
    return renamed if renamed != product else f"{product} (level {level})"


def verify_store(
    path: str | Path,
    *,
    seed: int = 0,
    channels: int = DEFAULT_CHANNELS,
    expected_rig: RigConfig | None = None,
    progress: Callable[[int], None] | None = None,
) -> VerifyReport:
    """Run every plug-in's ``verify_<group>`` on the store at ``path`` (see the module docstring).

    ``expected_rig`` (the config the user named) makes a stale store a :class:`CheckFailed`.
    """
    check_feature_options(seed, channels)
    loaded = load_store(path)
    report = VerifyReport(str(path), loaded.report.name, loaded.report.config_sha256, seed, channels)
    if loaded.reader is None:
        raise StoreError(f"{path}: not a readable store ({loaded.report.checks[0].reason})")
    if expected_rig is not None:
        check_not_stale(Path(path), expected_rig, loaded.root_attrs.get("config_sha256"))
    run_plugin_checks(loaded)  # the integrity checks of inspect (without --strict): a damaged store fails verify too
    report.notes.extend(loaded.report.notes)
    for check in loaded.report.failures:
        report.rows.append(_integrity_row(check.array, f"{check.name}: {check.reason}"))
    rig = loaded.rig
    if rig is None:
        return report
    contexts: dict[int | None, CheckContext] = {}
    for summary in loaded.report.groups:
        group = summary.name
        base, level = split_level_group(group)
        if level >= rig.n_levels:
            continue  # an integrity row (feature_level) already says so
        key = level if base in LEVEL_GROUPS else None  # matrix/, interop/: the whole rig (level 0 features)
        if key not in contexts:  # one per store and feature level: plug-ins share its float64 reference grid
            features, depth_probs = make_features(rig.level(level), channels, seed)
            ctx = check_context(loaded, rig, key)
            ctx.features = features
            ctx.depth_probs = depth_probs
            ctx.seed = seed
            contexts[key] = ctx
        ctx = contexts[key]
        plugins = plugin_functions(group, "verify")
        report.notes.extend(plugins.notes)
        for failure in plugins.import_failures:
            report.rows.append(_integrity_row(failure.array, failure.reason))
        if not plugins.functions:
            report.notes.append(f"{group}/: no installed plug-in verifies this group")
            continue
        for module_name, fn in plugins.functions:
            try:
                rows = list(
                    call_plugin(
                        fn, ctx, loaded.arrays.get(group, {}), loaded.group_attrs.get(group, {}), notes=report.notes, label=f"{module_name}.verify_{group}"
                    )
                )
                if not all(isinstance(r, VerifyRow) for r in rows):
                    raise TypeError("returned something other than VerifyRow objects")
            except MemoryError:  # the machine, not the store: one line, exit 2 at the CLI
                raise
            except Exception as exc:
                text = " ".join(str(exc).split())
                report.rows.append(_integrity_row(f"{group}/", f"{module_name}.verify_{group} raised {exc.__class__.__name__}: {text}"))
                continue
            report.rows.extend(rows if level == 0 else [replace(r, product=_level_product(r.product, level)) for r in rows])
            if progress is not None:
                progress(1)
    if not report.rows:
        report.notes.append("no plug-in produced a verification row")
    return report
