"""``bevcompile export-onnx`` and ``bevcompile export-interop``: from a store to a deployment path."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated

import typer

from ..errors import CheckFailed, UsageError
from ._app import cli_command
from ._options import JobsOption, JsonOption, QuietOption, canonical_choice
from ._output import human_bytes, new_table, print_json, print_table, progress_bar, stdout_console

StoreArg = Annotated[Path, typer.Argument(help="A bevcompile store (artifacts/<name>.zarr).", show_default=False, metavar="STORE")]


@cli_command("export-onnx", writes="file", short_help="Static ONNX graph of the store's lift (no GridSample/ScatterND/OneHot), checked with onnxruntime.")
def export_onnx_command(
    store: StoreArg,
    out: Annotated[Path, typer.Option("--out", "-o", help="The ONNX file to write.")] = Path("model.onnx"),
    product: Annotated[
        str, typer.Option("--product", metavar="gather|ell|tiles", help="gather (GridGather on gather/ or grid/), ell or tiles (MatrixLift on matrix/).")
    ] = "gather",
    opset: Annotated[int, typer.Option("--opset", help="ONNX opset, 9 to 23 (dynamo: 17+; int8-qdq: 13+).")] = 17,
    channels: Annotated[int, typer.Option("--channels", help="Feature channels C (static in the graph), 1 to 4096.")] = 64,
    batch: Annotated[int, typer.Option("--batch", help="Batch size N (static in the graph), 1 to 64.")] = 1,
    reduce: Annotated[
        str | None, typer.Option("--reduce", metavar="sum|mean", help="gather: sum or mean over the cameras that see a cell (default: sum).", show_default=False)
    ] = None,
    exporter: Annotated[
        str, typer.Option("--exporter", metavar="legacy|dynamo", help="legacy (TorchScript, fast) or dynamo (torch.export + onnxscript).")
    ] = "legacy",
    seed: Annotated[int, typer.Option("--seed", help="Seed of the random check inputs.")] = 0,
    weights: Annotated[
        str | None,
        typer.Option(
            "--weights",
            metavar="float32|float16|fp16|mixed|lut|int8|int8-qdq",
            help="float32 (default; float16 for a target that computes in float16 only); float16 (a --target's graph: float16 initializers + Cast); "
            "fp16 (ell/tiles: the store's --quantize fp16 values, the same as float16); mixed (ell/tiles: matrix --quantize mixed, "
            "int8 rows and fp16 rows in two row groups); "
            "lut (--target generic, gather: gather/weight_u8 + lut, dequantised in the graph); "
            "int8 (ell/tiles: matrix --quantize int8 values + row scales, dequantised in the graph by Cast + Mul; "
            "for an RKNN/LiteRT target: the float graph + the calibration set its quantiser reads); "
            "int8-qdq (generic: int8 initializers + DequantizeLinear with per-row scales; a QDQ target: the FULLY quantised graph, "
            "activations too; --opset 13+).",
            show_default=False,
        ),
    ] = None,
    target: Annotated[
        str | None,
        typer.Option(
            "--target", metavar="NAME|PROFILE.toml",
            help="generic (today's torch-traced graphs) or a target profile (bevcompile targets): the graph is built op by op within its limits, "
            "or refused with the limit it breaks. Default: for ell/tiles the target matrix --target recorded, else generic.",
            show_default=False,
        ),
    ] = None,
    form: Annotated[
        str | None,
        typer.Option("--form", metavar="gather|windows|tiles", help="A graph form instead of the target's first that fits (see docs/deploy.md).", show_default=False),
    ] = None,
    layout: Annotated[
        str | None,
        typer.Option("--layout", metavar="channel-last|channel-first", help="Layout of the gather form (default: the target's).", show_default=False),
    ] = None,
    tile_rows: Annotated[
        int | None, typer.Option("--tile-rows", help="Rows per tile of the tiles form (default 8), 1 to 4096.", show_default=False)
    ] = None,
    calibration: Annotated[
        list[Path] | None,
        typer.Option(
            "--calibration", metavar="FEATURES.npy",
            help="int8: features (S, n_cam, C, H_f, W_f) float (repeatable; frustum: a <name>_depth.npy beside it) the activation scales / "
            "the toolchain's calibration set come from (default: seeded samples).",
            show_default=False,
        ),
    ] = None,
    calibration_samples: Annotated[
        int, typer.Option("--calibration-samples", help="Seeded calibration samples without --calibration, 1 to 1024.")
    ] = 8,
    guard: Annotated[
        bool,
        typer.Option("--guard", help="Sanitise the inputs in the graph (NaN and +-inf become 0: Sub, Equal, Where) so a bad camera changes only the cells it feeds."),
    ] = False,
    classes: Annotated[
        int | None,
        typer.Option(
            "--classes", help="ell/tiles: lift an integer class map (N, n_cam, H_f, W_f) into (N, CLASSES, ny, nx) per-class scores, without OneHot "
            "(the torch module ClassLift; --target generic).", show_default=False,
        ),
    ] = None,
    rows: Annotated[
        str,
        typer.Option(
            "--rows",
            metavar="dense|compact",
            help="ell/tiles of a bev.region store: dense (the (N, C, ny, nx) map, one Gather of matrix/expand) "
            "or compact (the (N, C, n_kept) rows in matrix/cells order, no expand Gather).",
        ),
    ] = "dense",
    quiet: QuietOption = False,
    json_output: JsonOption = False,
) -> None:
    """Export the store's view transform as a static ONNX graph, then prove it: no GridSample/ScatterND/
    OneHot/NonZero/Loop/If, no dynamic shape, onnxruntime output within 1e-5 of the numpy reference
    (with --weights lut/int8/int8-qdq: the reference with the same dequantised weights; the distance to the
    float reference and the size against the float32 export are reported). A bev.region store's graph
    ends with one Gather of matrix/expand back to (N, C, ny, nx); --rows compact leaves it out."""
    from ..deploy.onnx_export import (
        EXPORTERS,
        PRODUCTS,
        REDUCTIONS,
        ROWS,
        WEIGHTS,
        ExportOptions,
        ExportResult,
        export_onnx,
        export_stages,
    )
    from ..deploy.targets import FORMS, LAYOUTS, canonical_target, load_profile

    defaulted = target is None
    target = canonical_target(recorded_target(store, canonical_choice(product, PRODUCTS)) if target is None else target)
    profile = load_profile(target)
    if weights is None:  # fp16 weights where the target computes in fp16 (and not float32)
        weights = "float16" if "float16" in profile.compute and "float32" not in profile.compute else "float32"
    options = ExportOptions(
        product=canonical_choice(product, PRODUCTS), opset=opset, channels=channels, batch=batch,
        reduce=canonical_choice(reduce or "sum", REDUCTIONS), seed=seed, exporter=canonical_choice(exporter, EXPORTERS),
        weights=canonical_choice(weights, WEIGHTS), rows=canonical_choice(rows, ROWS),
        target=target, form=canonical_choice(form, FORMS),
        layout=canonical_choice(layout, LAYOUTS), tile_rows=tile_rows,
        calibration=tuple(str(p) for p in calibration or ()), calibration_samples=calibration_samples,
        guard=guard, classes=classes or 0,
    )
    if classes is not None and classes < 1:
        raise UsageError(f"--classes must be in [1, 4096], got {classes}")
    options.validate()
    if reduce is not None and options.product != "gather":
        raise UsageError(f"--reduce applies to --product gather only, got --product {product}")
    if str(out) == "-":  # the graph goes to standard output: nothing else may
        if json_output:
            raise UsageError("--out - writes the ONNX graph to standard output; --json cannot share it")
        quiet = True
    result: ExportResult | None = None
    try:
        label = f"exporting {options.product}" + ("" if options.weights == "float32" else f" ({options.weights})")
        with progress_bar(label, export_stages(options), enabled=not (quiet or json_output)) as advance:
            result = export_onnx(store, out, options, progress=advance)
    except CheckFailed as exc:
        failed = getattr(exc, "result", None)
        if failed is not None and json_output:  # --json prints its report even with --quiet, as on success
            print_json(failed.to_json())
        elif failed is not None and not quiet:
            _print_export(failed)
        raise
    if json_output:
        print_json(result.to_json())
        return
    if not quiet:
        _print_export(result)
        if defaulted and result.target == "generic" and options.weights != "lut" and not options.classes:
            stdout_console.print(GENERIC_HINT, highlight=False, markup=False)


GENERIC_HINT = (
    "note: this is the generic graph traced from the torch modules, 4-26x GridSample's time in onnxruntime on the bundled rig; "
    "--target onnxruntime (or openvino) builds the forms that take 0.3-1.1x (docs/deploy.md); --target generic keeps this one"
)
"""Printed after a generic export the user did not ask for by name (``--target`` not given)."""


def recorded_target(store: Path, product: str) -> str:
    """The target ``matrix --target`` recorded for an ``ell`` / ``tiles`` export (``generic`` for
    the gather product, or a matrix built without one). A recorded name that is not a bundled
    profile (it came from a profile file) is a usage error naming it."""
    if product not in ("ell", "tiles"):
        return "generic"
    from ..deploy.targets import profile_names
    from ..store.loader import load

    loaded = load(store)
    if not loaded.has_group("matrix"):
        return "generic"  # the export says what is missing
    options = loaded["matrix"].attrs.get("build_options")
    name = options.get("target") if isinstance(options, Mapping) else None
    if not isinstance(name, str):
        return "generic"
    if name not in profile_names():
        raise UsageError(f"{store}: matrix/ was built for target {name!r}, not a bundled profile: pass --target PROFILE.toml (or --target generic)")
    return str(name)


def _print_export(result: object) -> None:
    from ..deploy.onnx_export import ORT_QDQ_ACCURACY_KEY, ORT_QDQ_CHECK_ACCURACY, ExportResult
    from ..deploy.onnx_graph import FORBIDDEN_OPS

    assert isinstance(result, ExportResult)
    scan = result.scan
    via = f"target {result.target}, {result.module}" if result.target != "generic" else result.module
    table = new_table(
        f"{result.path.name}: {result.product} via {via}, opset {scan.opset}, exporter {result.exporter}, "
        f"weights {result.weights}" + (f", rows {result.rows}" if result.rows != "dense" else ""),
        "op", "nodes", "status", right=("nodes",),
    )
    for op, count in scan.op_histogram.items():
        status = "FORBIDDEN" if op in FORBIDDEN_OPS else ("ok" if op not in scan.unexpected else "unexpected")
        table.add_row(op, str(count), status)
    print_table(table)
    checks = new_table("checks", "check", "result", "detail")
    checks.add_row("forbidden ops", "FAIL" if scan.forbidden else "pass",
                   "; ".join(scan.forbidden[:3]) or f"none of {', '.join(FORBIDDEN_OPS)}")
    checks.add_row("static shapes", "FAIL" if scan.dynamic else "pass",
                   "; ".join(scan.dynamic[:3]) or f"{scan.n_nodes} nodes, every tensor shape static")
    ok = result.max_abs <= result.tolerance
    quantised = result.weights != "float32"
    full_qdq = bool((result.plan or {}).get("qdq_activations"))
    torch_note = "" if result.plan is not None else f"; torch module {result.torch_max_abs:.2e}"
    if full_qdq and result.float_reference is not None:
        from ..deploy.onnx_export import INT8_MIN_PSNR_DB

        psnr = result.float_reference.psnr_db
        checks.add_row("fully quantised graph vs float reference", "pass" if psnr >= INT8_MIN_PSNR_DB else "FAIL",
                       f"PSNR {psnr:.1f} dB >= {INT8_MIN_PSNR_DB:g} dB; max abs vs the float-activation int8 reference {result.max_abs:.2e}")
    else:
        same = {"lut": " (same LUT weights)", "float16": " (same float16 weights)", "fp16": " (same float16 weights)", "mixed": " (same mixed weights)"}
        checks.add_row("onnxruntime vs numpy reference" + (same.get(result.weights, " (same dequantised weights)") if quantised else ""), "pass" if ok else "FAIL",
                       f"max abs {result.max_abs:.2e} (mean {result.mean_abs:.2e}) <= {result.tolerance:g}{torch_note}")
    q = result.float_reference
    if q is not None:
        checks.add_row(f"{result.weights} vs float reference", "report",
                       f"PSNR {q.psnr_db:.1f} dB, max abs {q.max_abs:.2e} (mean {q.mean_abs:.2e}); "
                       f"reference {q.reference}, PSNR peak = its range {q.peak:.3g}")
    d = result.ort_default
    if d is not None:
        fused = d.max_abs_vs_reference > result.tolerance
        checks.add_row("onnxruntime, default session", "report",
                       f"max abs {d.max_abs_vs_reference:.2e} vs the same-weights reference; PSNR {d.float_reference.psnr_db:.1f} dB "
                       f"vs float reference" + (
                           "; its DequantizeLinear+MatMul fusion (MatMulNBits) quantises the activations: "
                           f"set session config {ORT_QDQ_ACCURACY_KEY}={ORT_QDQ_CHECK_ACCURACY} for float ones (as the check does)"
                           if fused else "; agrees with the check session"))
    print_table(checks)
    shapes = ", ".join(f"{k} {'x'.join(map(str, v))}" for k, v in result.inputs.items())
    stdout_console.print(f"inputs: {shapes} -> bev {'x'.join(map(str, result.output))}")
    if result.cost is not None:
        cost = result.cost
        gathered = (
            f"gathered {human_bytes(cost['gathered_bytes'])} ({cost['gathers']} Gather, at most {cost['max_gather_indices']:,} indices "
            f"from an axis of {cost['max_gather_axis']:,})" if cost["gathers"] else "no Gather"
        )
        stdout_console.print(
            f"cost per inference: {cost['nodes']} nodes, constants {human_bytes(cost['constant_bytes'])}, {gathered}, {cost['macs'] / 1e6:,.1f} M MACs",
            highlight=False,
        )
        for form_name, reasons in result.refused:
            stdout_console.print(f"form {form_name} did not fit {result.target}: {'; '.join(reasons)}", highlight=False, markup=False)
    stdout_console.print(
        f"{scan.n_initializers} initializers ({human_bytes(scan.initializer_bytes)}); file {human_bytes(result.file_bytes)}; "
        f"export {result.export_seconds:.2f} s, onnxruntime {result.ort_seconds:.2f} s"
    )
    if result.qdq is not None and result.qdq.nodes:
        axes = ", ".join(f"axis {axis}: {count}" for axis, count in result.qdq.axes.items())
        reshaped = sum(node.reshaped for node in result.qdq.nodes)
        stdout_console.print(
            f"QDQ: {len(result.qdq.nodes)} DequantizeLinear (int8 weights, per-row float32 scales, zero point 0; {axes})"
            + (f", {reshaped} followed by a Reshape" if reshaped else "")
        )
    base = result.float32_export
    if quantised and base is not None:
        const_ratio, file_ratio = result.constant_ratio_vs_float32, result.file_ratio_vs_float32
        stdout_console.print(
            f"vs the float32 export: constants (initializers + Constant nodes) {human_bytes(scan.constant_bytes)} vs "
            f"{human_bytes(base.constant_bytes)}" + (f" ({100 * const_ratio:.1f} %)" if const_ratio is not None else "")
            + f"; file {human_bytes(result.file_bytes)} vs {human_bytes(base.file_bytes)}"
            + (f" ({100 * file_ratio:.1f} %)" if file_ratio is not None else "")
        )
    for note in result.notes:
        stdout_console.print(f"note: {note}", highlight=False, markup=False)
    if result.calibration_dir is not None:
        stdout_console.print(f"wrote {result.calibration_dir}/ (the calibration set: dataset.txt, features_*.npy)", highlight=False, markup=False)
    if result.passed:
        stdout_console.print(f"wrote [bold]{result.path}[/bold]")


@cli_command("export-interop", short_help='BEVDet BEVPoolv2 arrays / Fast-BEV LUT / PETR position coordinates into interop/ (and .npy files).')
def export_interop_command(
    store: StoreArg,
    to: Annotated[
        list[str] | None,
        typer.Option(
            "--to", metavar="bevpoolv2|fastbev-lut|petr-coords3d",
            help="bevpoolv2 (BEVDet BEVPoolv2 / TensorRT arrays), fastbev-lut or petr-coords3d (PETR's 3D position coordinates; "
            "depth bins and position range from the config's interop: section) (repeatable; default: the targets the config's interop: section names).",
            show_default=False,
        ),
    ] = None,
    npy: Annotated[Path | None, typer.Option("--npy", help="Also write the arrays as .npy files into this folder.")] = None,
    frustum_mapping: Annotated[
        str | None,
        typer.Option(
            "--frustum-mapping", metavar="linspace|stride|rig", help="bevpoolv2: linspace (BEVDet), stride, or rig (the config's pixel_mapping) (default: linspace).", show_default=False
        ),
    ] = None,
    rounding: Annotated[
        str | None, typer.Option("--rounding", metavar="trunc|floor", help="bevpoolv2: trunc (BEVDet .long(), toward zero) or floor (default: trunc).", show_default=False)
    ] = None,
    z_bins: Annotated[
        int | None, typer.Option("--z-bins", help="bevpoolv2: voxels along z over bev.z (default: the config's bins).")
    ] = None,
    batch: Annotated[
        int | None,
        typer.Option("--batch", help="bevpoolv2: batch size B the arrays are laid out for (BEVDet's batch-major ranks), 1 to 256 (default: 1).", show_default=False),
    ] = None,
    overlap: Annotated[
        str | None, typer.Option("--overlap", metavar="first|last|nearest-centre", help="fastbev-lut: first, last (Fast-BEV's loop order) or nearest-centre (default: first).", show_default=False)
    ] = None,
    precision: Annotated[
        str | None,
        typer.Option(
            "--precision", metavar="float64|float32",
            help="float64 (the exact geometry) or float32 (the upstream op sequence in float32, ties as upstream rounds them: "
            "BEVDet's get_lidar_coor, Fast-BEV's projection, PETR's position_embeding) (default: float64).", show_default=False,
        ),
    ] = None,
    xyz_layout: Annotated[
        bool | None,
        typer.Option("--xyz-layout/--no-xyz-layout", help="fastbev-lut: also write the LUT in Fast-BEV's voxel order (X, Y, Z) as fastbev_lut_xyz.", show_default=False),
    ] = None,
    jobs: JobsOption = None,
    quiet: QuietOption = False,
    json_output: JsonOption = False,
) -> None:
    """Write BEVDet BEVPoolv2 arrays, a Fast-BEV LUT and/or PETR's position coordinates into the store's interop/ group (and .npy files)."""
    from ..interop.bevpoolv2 import frustum_shape
    from ..interop.export import interop_command_targets, run_export_interop
    from ..interop.petr import PetrOptions
    from ..parallel import resolve_jobs
    from ..store.loader import load

    loaded = load(store, verify=False)
    targets = interop_command_targets(
        to, rig=loaded.rig, frustum_mapping=frustum_mapping, rounding=rounding, z_bins=z_bins, batch=batch, overlap=overlap,
        precision=precision, xyz_layout=xyz_layout,
    )
    n_jobs = resolve_jobs(jobs)
    total = 0
    if "bevpoolv2" in targets:
        total += 2 * int(math.prod(frustum_shape(loaded.rig)))  # two streamed passes
    if "fastbev-lut" in targets:
        total += int(math.prod(loaded.bev_shape)) * loaded.n_levels
    if "petr-coords3d" in targets:
        w_f, h_f = loaded.rig.level(0).feature_size
        total += loaded.rig.n_cam * PetrOptions.from_dict(targets["petr-coords3d"]).depth_num * h_f * w_f
    with progress_bar("building interop arrays", total, enabled=not (quiet or json_output)) as advance:
        result = run_export_interop(loaded.path, targets, npy_dir=npy, progress=advance, jobs=n_jobs)
    if json_output:
        print_json(result.to_json())
        return
    if quiet:
        return
    rig = loaded.rig
    if "bevpoolv2" in result.targets:
        a = result.attrs["bevpoolv2"]
        o = result.attrs["build_options"]["bevpoolv2"]
        n_cam, n_d, h_f, w_f = a["depth_shape"]
        x, y, z = a["grid_size"]
        table = new_table(
            f"{rig.name}: BEVPoolv2 (frustum {o['frustum_mapping']}, rounding {o['rounding']}, grid {x}x{y}x{z}, batch {a['batch']}"
            + (f", {o['precision']}" if o.get("precision", "float64") != "float64" else "") + ")",
            "figure", "value", right=("value",),
        )
        batch_factor = f"{a['batch']} x " if a["batch"] > 1 else ""
        table.add_row("frustum points", f"{batch_factor}{n_cam} x {n_d} x {h_f} x {w_f} = {a['n_points']:,}")
        table.add_row("kept points", f"{a['n_kept']:,} ({100 * a['n_kept'] / max(1, a['n_points']):.1f} %)")
        table.add_row("intervals (occupied voxels)", f"{a['n_intervals']:,} of {a['batch'] * x * y * z:,}")
        table.add_row("max interval length", f"{a['max_interval_length']:,}")
        print_table(table)
    if "fastbev-lut" in result.targets:
        a = result.attrs["fastbev-lut"]
        table = new_table(
            f"{rig.name}: Fast-BEV LUT (overlap {a['overlap']}" + (f", {a['precision']}" if "precision" in a else "") + ")",
            "figure", "value", right=("value",),
        )
        table.add_row("cells (heights x ny x nx)", f"{a['n_cells']:,}")
        table.add_row("seen by a camera", f"{a['n_seen']:,} ({100 * a['n_seen'] / max(1, a['n_cells']):.1f} %)")
        table.add_row("seen by more than one", f"{a['n_overlap']:,}")
        if "region" in a:
            table.add_row("outside the bev.region (-1)", f"{a['region']['n_cells_outside']:,}")
        for level in a.get("levels", [])[1:]:
            table.add_row(f"level {level['level']}: seen by a camera", f"{level['n_seen']:,}")
        print_table(table)
    if "petr-coords3d" in result.targets:
        a = result.attrs["petr-coords3d"]
        o = result.attrs["build_options"]["petr-coords3d"]
        w_f, h_f = a["feature_size"]
        table = new_table(
            f"{rig.name}: PETR position coordinates ({o['depth_num']} {'LID' if o['lid'] else 'uniform'} depths, {o['precision']}, {a['frame']} frame)",
            "figure", "value", right=("value",),
        )
        table.add_row("pixels (cameras x H_f x W_f)", f"{rig.n_cam} x {h_f} x {w_f} = {rig.n_cam * h_f * w_f:,}")
        table.add_row("depths (m)", f"{a['depths'][0]:.3f} .. {a['depths'][-1]:.3f}")
        table.add_row("masked pixels", f"{a['n_masked']:,}")
        table.add_row("coordinates inside position_range", f"{100 * a['inside_fraction']:.1f} %")
        print_table(table)
    sizes = new_table("interop/ arrays", "array", "shape", "dtype", "on disk", right=("on disk",))
    for name, array in result.arrays.items():
        key = f"interop/{name}"
        sizes.add_row(key, "x".join(map(str, array.shape)), str(array.dtype), human_bytes(result.bytes_written.get(key, 0)))
    print_table(sizes)
    for note in result.notes:
        stdout_console.print(f"note: {note}")
    if result.kept_targets:
        stdout_console.print(f"kept (rebuilt from recorded options): {', '.join(result.kept_targets)}")
    for path in result.npy_files:
        stdout_console.print(f"wrote {path}")
    stdout_console.print(f"wrote [bold]{result.store}[/bold] interop/")
