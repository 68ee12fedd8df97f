"""``bevcompile absorb STORE CHECKPOINT``: trained matrix values back into the store's ``matrix/``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from ..matrix.build import QUANTIZE
from ..matrix.learned import KEEP, AbsorbResult, run_absorb
from ._app import cli_command
from ._options import JsonOption, QuietOption, canonical_choice
from ._output import human_bytes, new_table, print_json, print_table, progress_bar, stdout_console


@cli_command("absorb", short_help="Trained matrix values (a LearnableLift checkpoint) back into matrix/: COO, ELL, tiles, int8 re-derived.")
def absorb(
    store: Annotated[Path, typer.Argument(help="The store whose matrix/ the values were trained on.", show_default=False, metavar="STORE")],
    checkpoint: Annotated[
        Path,
        typer.Argument(
            help="PyTorch checkpoint (torch.load(weights_only=True): no pickle code runs), .npy, .npz or .safetensors.",
            show_default=False,
            metavar="CHECKPOINT",
        ),
    ],
    key: Annotated[
        str | None,
        typer.Option(
            "--key",
            help="Dotted name of the values in the checkpoint (e.g. model.lift.ell_weight); default: the single "
            "floating-point tensor of the store's ELL shape.",
            show_default=False,
        ),
    ] = None,
    quantize: Annotated[
        str | None,
        typer.Option(
            "--quantize", metavar="int8|fp16|mixed|none",
            help="int8 / fp16 / mixed: also write those products of the learned values (mixed needs --fp16-rows unless the store has a rule); default: as the store has.",
            show_default=False,
        ),
    ] = None,
    fp16_rows: Annotated[
        str | None,
        typer.Option("--fp16-rows", metavar="beyond:M|snr:DB|fraction:F", help="--quantize mixed: the rows kept in float16; default: the store's rule.", show_default=False),
    ] = None,
    tile_rows: Annotated[
        int | None,
        typer.Option("--tile-rows", help="Also lay the learned values out as tiles of R rows; default: as the store has.", show_default=False),
    ] = None,
    quiet: QuietOption = False,
    json_output: JsonOption = False,
) -> None:
    """Absorb trained matrix values into STORE's matrix/ (atomically; a refused checkpoint leaves the store as it was).

    The values are checked first (shape = the store's ELL shape, floating point, finite, padding
    slots exactly 0, the checkpoint's ell_index beside them equal to the store's); the topology and
    the geometric values are rebuilt from the stored config and must equal the store's. Then COO
    values, ELL, tiles, int8 and camera_mass are re-derived from the learned values, the geometric
    values are kept as matrix/init_ell_weight, and matrix/ records values: learned, the checkpoint
    (file name, sha256, key) and both hashes. Exit 0, or 2 with one line for a bad checkpoint or store.
    """
    quantize_value = KEEP if quantize is None else canonical_choice(quantize, (*QUANTIZE, "none"))
    with progress_bar("rebuilding the geometric topology", None, enabled=not (quiet or json_output)) as advance:
        result = run_absorb(
            store,
            checkpoint,
            key=key,
            quantize=None if quantize_value == "none" else quantize_value,
            tile_rows=KEEP if tile_rows is None else tile_rows,
            progress=advance,
            fp16_rows=KEEP if fp16_rows is None else fp16_rows,
        )
    if json_output:
        print_json(result.to_json())
        return
    if quiet:
        return
    _print_summary(result)


def _print_summary(result: AbsorbResult) -> None:
    r, c, p = result.record, result.change, result.products
    o = result.options
    table = new_table(
        f"{escape(result.store.name)}: learned matrix values from {escape(r.checkpoint)} ({r.format}), "
        f"mode {o.mode}, ELL {p.rows_pad:,} x {p.k_pad}",
        "figure",
        "value",
        right=("value",),
    )
    table.add_row("tensor", escape(f"{r.key or '<the .npy array>'} ({r.dtype})"))
    table.add_row("checkpoint sha256", f"{r.checkpoint_sha256[:16]}…")
    table.add_row("topology (ell_index in the checkpoint)", "equal to the store's" if result.index_checked else "not in the checkpoint")
    table.add_row("replaced values", result.previous)
    table.add_row("entries changed / total", f"{c['changed']:,} / {c['entries']:,}")
    table.add_row("entries now 0 / negative", f"{c['zero']:,} / {c['negative']:,}")
    table.add_row("|w - w_init| / w_init mean / max", f"{c['mean_rel_change']:.4g} / {c['max_rel_change']:.4g}")
    table.add_row("total mass init -> learned", f"{c['mass_init']:.6g} -> {c['mass_learned']:.6g}")
    if p.figures.int8_max_rel_error is not None:
        table.add_row("int8 max error (rel. to row max)", f"{p.figures.int8_max_rel_error:.2e}")
    table.add_row("products re-derived", ", ".join(sorted(p.arrays())))
    print_table(table)
    stdout_console.print(
        f"wrote [bold]{escape(str(result.store))}[/bold] matrix/ (values: learned, init kept as init_ell_weight; "
        f"{human_bytes(result.write.total_bytes)} on disk); `bevcompile diff --against-init {escape(str(result.store))}` reports the drift"
    )
