"""What ``inspect``, ``verify`` and ``render`` cost on the bundled rig: the table of ``docs/checks.md``.

Usage::

    .venv/bin/python benchmarks/check_costs.py     # ~1 min; machine-dependent (says the load it ran under)

Two stores of ``configs/nuscenes.yaml`` are built in a temporary folder, as the CLI builds them:
``bevcompile grid`` (grid/ + gather/ + delta/) and the same plus ``bevcompile matrix --topk 24
--align 16``. Each command then runs in a fresh process (wall time, CPU time and peak RSS of that
process; the best of ``--repeat`` runs); the library calls (``inspect_store``, ``verify_store``)
are timed in this process after one warm-up, in CPU seconds (``time.process_time``, so a loaded
machine inflates them less), and exclude the start-up and imports.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _common import CONFIGS, ProcessCost, bevcompile, machine, markdown_table

from bevcompile.store.inspection import inspect_store
from bevcompile.store.verify import verify_store


def _best(runs: list[ProcessCost]) -> ProcessCost:
    return min(runs, key=lambda r: r.wall_s)


def _library_seconds(fn: Callable[[], Any], repeat: int) -> tuple[float, Any]:
    result = fn()  # warm-up: imports, first reads
    best = float("inf")
    for _ in range(repeat):
        t0 = time.process_time()
        result = fn()
        best = min(best, time.process_time() - t0)
    return best, result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3, help="runs per figure (the fastest is reported)")
    args = parser.parse_args(argv)
    load_at_start = machine()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        grid_only = Path(tmp) / "grid"
        with_matrix = Path(tmp) / "matrix"
        config = str(CONFIGS / "nuscenes.yaml")
        bevcompile("grid", config, "--out", str(grid_only), "--quiet")
        bevcompile("grid", config, "--out", str(with_matrix), "--quiet")
        bevcompile("matrix", config, "--out", str(with_matrix), "--topk", "24", "--align", "16", "--quiet")
        for label, folder in (("`grid`", grid_only), ("`grid` + `matrix --topk 24 --align 16`", with_matrix)):
            store = str(folder / "nuscenes.zarr")
            inspect_s, report = _library_seconds(lambda s=store: inspect_store(s), args.repeat)
            strict_s, strict = _library_seconds(lambda s=store: inspect_store(s, strict=True), args.repeat)
            verify_s, verified = _library_seconds(lambda s=store: verify_store(s), args.repeat)
            png = str(Path(tmp) / "coverage.png")
            commands: list[tuple[str, list[str], str, float | None]] = [
                ("`inspect`", ["inspect", store, "--quiet"], f"{len(report.checks)} checks", inspect_s),
                ("`inspect --strict`", ["inspect", store, "--strict", "--quiet"], f"{len(strict.checks)} checks", strict_s),
                ("`verify`", ["verify", store, "--quiet"], f"{len(verified.rows)} rows", verify_s),
                ("`render`", ["render", store, "--out", png, "--quiet"], "1500x750 PNG", None),
            ]
            for name, cli_args, what, library_s in commands:
                cost = _best([bevcompile(*cli_args) for _ in range(args.repeat)])
                rows.append([
                    name,
                    label,
                    what,
                    "" if library_s is None else f"{library_s:.2f} s",
                    f"{cost.wall_s:.1f} s",
                    f"{cost.cpu_s:.1f} s",
                    f"{cost.peak_rss_bytes / 1e6:.0f} MB",
                ])
    print(f"<!-- inspect / verify / render costs (measured on {load_at_start}) -->")
    print(markdown_table(["command", "store", "work", "library call (CPU)", "CLI process: wall", "CPU", "peak RSS"], rows, right=(3, 4, 5, 6)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
