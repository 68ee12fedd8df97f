"""``bevcompile diff OLD NEW``: how far a calibration change moves the tables (and a gate for it)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from ..errors import CheckFailed, UsageError
from ..report.diff import SHIFT_PERCENTILE, CameraDiff, ShiftStats, StoreDiff, diff_stores
from ..report.drift import DEFAULT_TOP_CELLS, DriftReport, drift_stores, is_learned_store
from ..store.verify import DEFAULT_CHANNELS, format_psnr
from ._app import cli_command
from ._options import FeatureChannelsOption, FeatureSeedOption, JsonOption, QuietOption
from ._output import compact_json, new_table, print_json, print_table, progress_bar, stderr_lines, stdout_console

VALUE_WIDTH = 120


def _short(value: Any) -> Any:
    """Floats to 10 significant digits for display (JSON keeps them exact)."""
    if isinstance(value, float):
        return float(f"{value:.10g}")
    if isinstance(value, list | tuple):
        return [_short(v) for v in value]
    if isinstance(value, dict):
        return {k: _short(v) for k, v in value.items()}
    return value


def _compact(value: Any) -> str:
    return "(absent)" if value is None else compact_json(_short(value), VALUE_WIDTH)


def _px(value: float | None) -> str:
    return "–" if value is None else f"{value:.4g}"


def _psnr(value: float) -> str:
    """Like ``verify``'s ``format_psnr``, but a NaN (or -inf) PSNR shows as such, not ``n/a``."""
    return format_psnr(value) if math.isfinite(value) or value > 0 else f"{value}"


def _nearest(stats: ShiftStats) -> str:
    fraction = stats.nearest_pixel_changed_fraction
    return "–" if fraction is None else f"{stats.nearest_pixel_changed:,} ({100 * fraction:.1f} %)"


def _nearest_pct(stats: ShiftStats) -> str:
    fraction = stats.nearest_pixel_changed_fraction
    return "–" if fraction is None else f"{100 * fraction:.1f}%"


def _count(value: int | None, total: int) -> str:
    return "not counted" if value is None else f"{value:,} of {total:,}"


def _coverage(stats: ShiftStats) -> list[str]:
    return [f"{stats.cells_both:,}", f"{stats.cells_only_old:,}", f"{stats.cells_only_new:,}"]


def _result(camera: CameraDiff, gated: bool) -> str:
    if not gated:
        return ""
    return "[green]pass[/green]" if camera.passed else "[bold red]FAIL[/bold red]"


def _no_wrap_first(table: Table) -> None:
    """Camera names stay on one line (the figures wrap instead)."""
    table.columns[0].no_wrap = True


def _print_diff(report: StoreDiff) -> None:
    w_f, h_f = report.feature_size
    stdout_console.print(
        f"[bold]{escape(report.old)}[/bold] -> [bold]{escape(report.new)}[/bold]  rig {escape(report.old_name)}"
        + (f" -> {escape(report.new_name)}" if report.new_name != report.old_name else "")
        + f"  feature map {w_f}x{h_f}  align_corners={report.align_corners}  seed {report.seed}  channels {report.channels}"
    )
    if report.config_changes:
        table = new_table("config changes", "field", "old", "new")
        for change in report.config_changes:
            table.add_row(escape(change.field), escape(_compact(change.old)), escape(_compact(change.new)))
        print_table(table)
    else:
        stdout_console.print(f"config: identical (config_sha256 {report.old_config_sha256[:12]}…)")

    gated = report.gated
    p = f"p{SHIFT_PERCENTILE:g}"
    pose = new_table(
        "cameras: pose change and coverage (BEV cells over all heights: valid in both, lost = only old, gained = only new)",
        "camera", "rot deg", "trans mm", "both", "lost", "gained",
        right=("rot deg", "trans mm", "both", "lost", "gained"),
    )
    _no_wrap_first(pose)
    for cam in report.cameras:
        pose.add_row(escape(cam.camera), f"{cam.rotation_deg:.4g}", f"{cam.translation_mm:.4g}", *_coverage(cam.total))
    print_table(pose)
    columns = ["camera", "max px", "mean px", f"{p} px", "nearest px changed"]
    if gated:
        columns.append("result")
    shift = new_table(
        "cameras: sampling shift (grid/coords float32, feature px, cells valid in both)",
        *columns, right=("max px", "mean px", f"{p} px", "nearest px changed"),
    )
    _no_wrap_first(shift)
    for cam in report.cameras:
        t = cam.total
        row = [escape(cam.camera), _px(t.shift_max_px), _px(t.shift_mean_px), _px(t.shift_p99_px), _nearest(t)]
        if gated:
            row.append(_result(cam, gated))
        shift.add_row(*row)
    print_table(shift)

    if len(report.heights) > 1:
        per_height = new_table(
            "per camera and height (shift in feature px; nearest: % of cells whose nearest pixel changed)",
            "camera", "z m", "both", "lost", "gained", "max", "mean", p, "nearest",
            right=("z m", "both", "lost", "gained", "max", "mean", p, "nearest"),
        )
        _no_wrap_first(per_height)
        for cam in report.cameras:
            for height, s in cam.heights:
                per_height.add_row(escape(cam.camera), f"{height:g}", *_coverage(s), _px(s.shift_max_px), _px(s.shift_mean_px),
                                   _px(s.shift_p99_px), _nearest_pct(s))
        print_table(per_height)

    output = new_table(
        f"output change  (sum over cameras of grid_sample on grid/norm: bilinear, zeros, align_corners={report.align_corners};"
        " features uniform [0, 1), PSNR peak 1)",
        "height", "max abs", "mean abs", "PSNR dB", "coverage changed", "max abs elsewhere",
        right=("max abs", "mean abs", "PSNR dB", "coverage changed", "max abs elsewhere"),
    )
    for out in report.output:
        changed = "–" if out.cells_coverage_changed is None else f"{out.cells_coverage_changed:,} cells"
        output.add_row(escape(out.label), f"{out.max_abs:.4g}", f"{out.mean_abs:.4g}", _psnr(out.psnr_db), changed,
                       _px(out.max_abs_same_coverage))
    print_table(output)

    if report.matrix is not None:
        m = report.matrix
        options = ", ".join(f"{k}={v}" for k, v in m.build_options.items() if v is not None)
        table = new_table(f"matrix/  ({escape(options)})", "figure", "value", right=("value",))
        table.add_row("nnz old / new", f"{m.nnz_old:,} / {m.nnz_new:,}")
        rows = {"cells": "rows (BEV cells)", "region rows": "rows (the region's (super-)cells)", "dense map": "rows (different cells: see the note)"}[m.compared]
        table.add_row(f"{rows} whose entry set changed", _count(m.rows_entry_set_changed, m.n_rows))
        table.add_row("rows whose entries or weights changed", _count(m.rows_changed, m.n_rows))
        table.add_row("COO output max abs / mean abs" + (" (dense map)" if m.compared == "dense map" else ""), f"{m.output.max_abs:.4g} / {m.output.mean_abs:.4g}")
        table.add_row(f"COO output PSNR dB (peak {m.output.peak:.4g} = range of the old output)", _psnr(m.output.psnr_db))
        print_table(table)
    for note in report.notes:
        stdout_console.print(f"note: {escape(note)}")
    if gated:
        gates = ", ".join(
            g for g in (
                f"--max-shift-px {report.max_shift_px:g}" if report.max_shift_px is not None else "",
                f"--max-coverage-change {report.max_coverage_change:g}" if report.max_coverage_change is not None else "",
            ) if g
        )
        n_fail = len(report.failing_cameras)
        style = "green" if report.passed else "red"
        stdout_console.print(f"[{style}]{len(report.cameras) - n_fail} of {len(report.cameras)} cameras within {gates}[/{style}]")


def _learned_pair(old: Path, new: Path) -> bool:
    """NEW is a learned store of OLD's config: the drift report, not the calibration diff."""
    from ..store.loader import load

    try:
        a, b = load(old), load(new)
    except Exception:
        return False  # the calibration diff reports the unreadable store
    return is_learned_store(b) and a.config_sha256 == b.config_sha256


def _print_drift(report: DriftReport) -> None:
    stdout_console.print(
        f"[bold]drift[/bold] of matrix values ({report.mode} mode, {report.entries:,} entries, {report.changed:,} changed): "
        f"{escape(report.before)} -> {escape(report.after)}; total mass {report.mass_before:.6g} -> {report.mass_after:.6g}"
    )
    table = new_table(
        "per camera: mass share, relative change |w - w_before| / w_before over its entries, mass outside its footprint (VALID RULE)",
        "camera", "entries", "share before", "share after", "mean rel", "max rel", "outside before", "outside after",
        right=("entries", "share before", "share after", "mean rel", "max rel", "outside before", "outside after"),
    )
    _no_wrap_first(table)
    for c in report.cameras:
        table.add_row(
            escape(c.camera), f"{c.entries:,}", f"{100 * c.share_before:.2f} %", f"{100 * c.share_after:.2f} %",
            f"{c.mean_rel_change:.4g}", f"{c.max_rel_change:.4g}", f"{100 * c.outside_before:.2f} %", f"{100 * c.outside_after:.2f} %",
        )
    print_table(table)
    cells = new_table(
        "cells whose camera share moved most (share = camera mass / all cameras' mass in the cell)",
        "camera", "cell (iy, ix)", "x m", "y m", "share before", "share after",
        right=("x m", "y m", "share before", "share after"),
    )
    _no_wrap_first(cells)
    for c in report.cameras:
        for move in c.top_cells:
            label = f"({move.iy}, {move.ix})" if move.size == 1 else f"({move.iy}, {move.ix}) x{move.size}"
            cells.add_row(escape(c.camera), label, f"{move.x_m:.2f}", f"{move.y_m:.2f}",
                          f"{100 * move.share_before:.1f} %", f"{100 * move.share_after:.1f} %")
    if cells.row_count:
        print_table(cells)
    for note in report.notes:
        stdout_console.print(f"note: {escape(note)}")


@cli_command("diff", writes="nothing", short_help="How far a recalibration moves the tables: pose, grid shift, coverage, output change (gate: exit 1).")
def diff(
    old: Annotated[Path, typer.Argument(help="The reference store (e.g. the nominal calibration the model was validated with).", show_default=False, metavar="OLD")],
    new: Annotated[
        Path | None,
        typer.Argument(help="The store to judge (e.g. one car's recalibration, or a learned store: the drift report).", show_default=False, metavar="NEW"),
    ] = None,
    max_shift_px: Annotated[
        float | None,
        typer.Option("--max-shift-px", help="Gate: fail (exit 1) if a camera's max sampling shift exceeds X feature pixels.", show_default=False),
    ] = None,
    max_coverage_change: Annotated[
        float | None,
        typer.Option(
            "--max-coverage-change",
            help="Gate: fail (exit 1) if a camera loses or gains more than this fraction of its BEV cells (0..1).",
            show_default=False,
        ),
    ] = None,
    seed: FeatureSeedOption = 0,
    channels: FeatureChannelsOption = DEFAULT_CHANNELS,
    against_init: Annotated[
        bool,
        typer.Option("--against-init", help="Drift report of ONE learned store (bevcompile absorb) against its own init_ell_weight."),
    ] = False,
    top: Annotated[int, typer.Option("--top", help="Drift report: cells listed per camera whose camera share moved most.")] = DEFAULT_TOP_CELLS,
    json_output: JsonOption = False,
    quiet: QuietOption = False,
) -> None:
    """Compare two stores of the same layout (same cameras, feature map, BEV grid, heights, align_corners).

    Reports the config changes, each camera's pose change (degrees, mm), the grid change
    (coverage, sampling shift in feature pixels, nearest-pixel changes), the output change on
    seeded random features and the matrix/ change. Exit 0, 1 when a gate fails (one line per
    failing camera on stderr; a non-finite figure fails its gate), 2 when a path is not a store,
    an array is damaged or the stores cannot be compared.

    Learned matrices: `diff --against-init LEARNED`, or `diff INIT LEARNED` with a learned NEW of the
    same config, print the drift report instead (per camera: mass share before/after, mean
    |dw|/|w_init|, the cells whose camera share moved most, mass outside the camera's footprint).
    """
    if against_init or (new is not None and _learned_pair(old, new)):
        if against_init and new is not None:
            raise UsageError("--against-init takes ONE store (the learned one); without it, diff INIT LEARNED")
        drift_report = drift_stores(old, new, top=top)
        if json_output:
            print_json(drift_report.to_json())
        elif not quiet:
            _print_drift(drift_report)
        return
    if new is None:
        raise UsageError("diff needs OLD and NEW (or --against-init LEARNED for a learned store)")
    with progress_bar(f"comparing {old.name} and {new.name}", None, enabled=not (quiet or json_output)):
        report = diff_stores(old, new, seed=seed, channels=channels, max_shift_px=max_shift_px, max_coverage_change=max_coverage_change)
    if json_output:
        print_json(report.to_json())
    elif not quiet:
        _print_diff(report)
    stderr_lines(report.failure_lines())
    if not report.passed:
        raise CheckFailed(f"diff gate failed: {len(report.failing_cameras)} of {len(report.cameras)} cameras of {report.new}")
