"""``bevcompile matrix``: the sparse aggregation matrix ``F_bev = W @ F_img`` into the rig's store."""

from __future__ import annotations

from typing import Annotated

import numpy as np
import typer

from ..errors import UsageError
from ..matrix.build import MatrixOptions, MatrixRunResult, matrix_pass_units, run_matrix
from ..matrix.prior import UNIFORM, DepthPrior, read_depth_prior
from ..parallel import resolve_jobs
from ..rig.config import load_config
from ._app import cli_command
from ._options import DEFAULT_OUT, ConfigArg, ForceOption, JobsOption, JsonOption, OutOption, QuietOption
from ._output import (
    human_bytes,
    new_table,
    note_dropped_groups,
    print_json,
    print_table,
    progress_bar,
    stderr_console,
    stdout_console,
)


@cli_command("matrix", short_help='The lift as one sparse matrix F_bev = W @ F_img (COO, ELL, tiles, int8) -> matrix/.')
def matrix(
    config: ConfigArg = None,
    out: OutOption = DEFAULT_OUT,
    mode: Annotated[
        str,
        typer.Option(
            "--mode",
            metavar="frustum|grid|ray",
            help="frustum: columns (cam, depth bin, v, u) of the LSS depth x feature outer product; "
            "grid: columns (cam, v, u), grid_sample weights of every cell; "
            "ray: columns (cam, v, u), the frustum's points folded over depth with --depth-prior (no depth input).",
        ),
    ] = "frustum",
    topk: Annotated[
        int, typer.Option("--topk", help="Keep the K largest-weight entries per BEV row (0 = keep all).")
    ] = 0,
    align: Annotated[
        int, typer.Option("--align", help="Pad rows, columns, ELL width and tile widths to multiples of N.")
    ] = 16,
    splat: Annotated[
        str,
        typer.Option(
            "--splat",
            metavar="bilinear|nearest",
            help="bilinear: split each point over the 4 nearest cell centres (grid: bilinear grid_sample); "
            "nearest: weight 1 to the containing cell (grid: nearest grid_sample).",
        ),
    ] = "bilinear",
    normalize: Annotated[
        str, typer.Option("--normalize", metavar="sum|mean", help="sum: raw weights; mean: every kept row sums to 1.")
    ] = "sum",
    tile_rows: Annotated[
        int | None,
        typer.Option("--tile-rows", help="Also write block-dense tiles of R rows (plain MatMul form).", show_default=False),
    ] = None,
    quantize: Annotated[
        str | None,
        typer.Option(
            "--quantize",
            metavar="int8|fp16|mixed|none",
            help="int8: also write symmetric per-row int8 ELL (and tiles) + row_scale; fp16: float16 ELL (and tiles); "
            "mixed: the int8 product plus float16 values of the rows --fp16-rows selects.",
            show_default=False,
        ),
    ] = None,
    fp16_rows: Annotated[
        str | None,
        typer.Option(
            "--fp16-rows",
            metavar="beyond:M|snr:DB|fraction:F",
            help="--quantize mixed: the rows kept in float16: cells farther than M metres, rows whose predicted int8 SNR is "
            "below DB dB, or the fraction F of rows with the lowest predicted int8 SNR.",
            show_default=False,
        ),
    ] = None,
    compact_rows: Annotated[
        bool, typer.Option("--compact-rows", help="Keep only rows with entries; write row_ids (row -> BEV cell).")
    ] = False,
    rounding: Annotated[
        str,
        typer.Option(
            "--rounding",
            metavar="floor|trunc",
            help="frustum cell of a point: floor (the cell containing it) or trunc (BEVDet .long(), bit-exact bev_pool_v2).",
        ),
    ] = "floor",
    depth_prior: Annotated[
        str,
        typer.Option(
            "--depth-prior",
            metavar="uniform|FILE.npy",
            help="--mode ray: uniform (every depth bin 1/D) or a .npy of shape (D,), (n_cam, D) or (n_cam, D, H_f, W_f), "
            "finite, >= 0, renormalised per pixel; stored in matrix/depth_prior.",
        ),
    ] = "uniform",
    precision: Annotated[
        str,
        typer.Option(
            "--precision",
            metavar="float64|float32|float16",
            help="--mode frustum: float64 (exact geometry), float32 (BEVDet's own float32 lift: every point in the voxel "
            "of BEVDet's float32 run) or float16 (BEVDepth's get_geometry as its float16 training computes it; points whose "
            "float16 geometry overflows are dropped); linspace feature mapping, pinhole cameras. Recorded in build_options.",
        ),
    ] = "float64",
    target: Annotated[
        str | None,
        typer.Option(
            "--target", metavar="NAME|PROFILE.toml",
            help="The NPU target profile the matrix is for (bevcompile targets): recorded in build_options (the entries do not "
            "depend on it); export-onnx --product ell/tiles builds for it when given no --target.",
            show_default=False,
        ),
    ] = None,
    force: ForceOption = False,
    jobs: JobsOption = None,
    quiet: QuietOption = False,
    json_output: JsonOption = False,
) -> None:
    """Build the sparse camera-to-BEV matrix (COO, ELL, optional tiles / int8 / compact rows) and
    write the matrix/ group of <out>/<name>.zarr."""
    uniform = depth_prior.strip().lower() == UNIFORM
    if not uniform and mode.strip().lower() != "ray":
        raise UsageError(f"--depth-prior applies to --mode ray only (--mode {mode})")
    n_jobs = resolve_jobs(jobs)
    rig = load_config(config)
    prior = DepthPrior() if uniform else read_depth_prior(depth_prior, rig)
    target_name = None
    if target is not None:
        from ..deploy.targets import canonical_target, load_profile

        target_name = load_profile(canonical_target(target)).name
    options = MatrixOptions.from_command(
        mode=mode, topk=topk, align=align, splat=splat, normalize=normalize, tile_rows=tile_rows, quantize=quantize,
        compact_rows=compact_rows, rounding=rounding, depth_prior=prior.token, fp16_rows=fp16_rows, precision=precision,
        target=target_name,
    )
    label = "sampling BEV cells" if options.mode == "grid" else "pass 1/2: lifting frustum points"
    unit = "samples" if options.mode == "grid" else "points"
    with progress_bar(label, matrix_pass_units(rig, options), enabled=not (quiet or json_output), unit=unit) as advance:
        result = run_matrix(rig, out, options, force=force, progress=advance, jobs=n_jobs, depth_prior=prior if options.mode == "ray" else None)
    if not result.products.figures.nnz:  # on stderr, also under --quiet/--json
        stderr_console.print(
            "[yellow]warning:[/yellow] the matrix is empty: no frustum point / grid sample of any camera lands in the "
            "BEV x/y/z range (check bev.x/y/z, the extrinsics and depth.bins); `bevcompile grid` then `bevcompile render` show the coverage"
        )
    note_dropped_groups(result.store, result.write.dropped_groups)
    if json_output:
        print_json(result.to_json())
        return
    if quiet:
        return
    _print_summary(result)


TOPK_SUM_NOTE_BELOW = 0.9
"""The summary notes the Top-K mass loss of ``--normalize sum`` below this kept fraction."""


def _print_summary(result: MatrixRunResult) -> None:
    rig, p = result.rig, result.products
    o, f = p.options, p.figures
    w_f, h_f = rig.feature_size
    detail = f"{rig.depth.n_bins} depth bins, splat {o.splat}, rounding {o.rounding}" if o.mode != "grid" else f"splat {o.splat}"
    if o.precision != "float64":
        detail += f", {o.precision} points"
    if o.mode == "ray":
        prior = p.depth_prior
        detail += ", depth prior " + ("uniform" if prior is None or prior.raw is None else f"{prior.record()['source']} {tuple(prior.raw.shape)}")
    table = new_table(
        f"{rig.name}: matrix mode {o.mode} ({detail}), feature map {w_f}x{h_f}, BEV {rig.bev.nx}x{rig.bev.ny}, "
        f"top-K {o.topk or 'all'}, normalize {o.normalize}, align {o.align}",
        "figure",
        "value",
        right=("value",),
    )
    table.add_row("rows (logical / padded)", f"{p.n_rows:,} / {p.rows_pad:,}" + (" (compacted)" if o.compact_rows else ""))
    table.add_row("cols (logical / padded)", f"{p.n_cols:,} / {p.cols_pad:,}")
    table.add_row("nnz", f"{f.nnz:,}")
    table.add_row("per-row nnz min / median / max", f"{f.row_nnz_min} / {f.row_nnz_median:g} / {f.row_nnz_max}")
    table.add_row("empty BEV cells", f"{f.n_empty_rows:,}")
    table.add_row("ELL shape (rows_pad x k_pad)", f"{p.rows_pad:,} x {p.k_pad}")
    if o.topk and f.nnz:
        table.add_row(
            "Top-K kept weight (all rows / worst row)",
            f"{100 * f.kept_weight_fraction_total:.2f} % / {100 * f.kept_weight_fraction_worst_row:.2f} %",
        )
    if o.mode != "grid":
        table.add_row("frustum points (total / in range)", f"{f.n_points:,} / {f.n_points_in_range:,}")
    if f.tile_bytes is not None:
        table.add_row(
            f"tiles ({p.n_tiles} x {o.tile_rows} rows) vs dense",
            f"{human_bytes(f.tile_bytes)} vs {human_bytes(f.dense_bytes)}" + (f" ({100 * f.tile_bytes / f.dense_bytes:.3f} %)" if f.nnz and f.dense_bytes else ""),
        )
    if f.int8_max_rel_error is not None:
        table.add_row("int8 max error (rel. to row max)", f"{f.int8_max_rel_error:.2e}")
    if f.fp16_max_rel_error is not None:
        table.add_row("fp16 max error (rel. to row max)", f"{f.fp16_max_rel_error:.2e}")
    if f.n_fp16_rows is not None:
        rows_with_entries = int(np.count_nonzero(np.bincount(p.coo_row, minlength=p.n_rows)))
        share = f" ({100 * f.n_fp16_rows / rows_with_entries:.1f} % of rows with entries)" if rows_with_entries else ""
        table.add_row(f"mixed: fp16 rows ({o.fp16_rows})", f"{f.n_fp16_rows:,}{share}")
    table.add_row("build time", f"{result.build_seconds:.2f} s")
    table.add_row("threads (--jobs)", f"{p.extra.get('jobs', 1)}")
    table.add_row("peak memory (RSS)", human_bytes(result.peak_rss_bytes))
    print_table(table)
    sizes = new_table("bytes per product", "product", "in memory", right=("in memory",))
    for name, nbytes in f.product_bytes.items():
        sizes.add_row(name, human_bytes(nbytes))
    sizes.add_row("dense (rows x cols float32)", human_bytes(f.dense_bytes))
    print_table(sizes)
    if o.topk and f.nnz and o.normalize == "sum" and f.kept_weight_fraction_total < TOPK_SUM_NOTE_BELOW:
        stdout_console.print(
            f"note: Top-{o.topk} keeps {100 * f.kept_weight_fraction_total:.1f} % of the weight and --normalize sum "
            "keeps raw weights, so the cells with the most sources lose mass; `bevcompile verify` measures what "
            "that costs (matrix/topk_vs_unpruned), --normalize mean re-normalises each row"
        )
    stdout_console.print(f"wrote [bold]{result.store}[/bold] matrix/ ({human_bytes(result.write.total_bytes)} on disk)")
