"""The products of a fleet vehicle: the single commands' options, built by the same library calls.

A manifest's ``products:`` maps a command name to its options, spelled as the CLI spells them
without the dashes (``align-corners``, ``frac-bits``, ``max-error-px``, ``tile-rows``,
``compact-rows``, ``frustum-mapping``, ``z-bins``; ``_`` for ``-`` is accepted too); enumerated
values in any case; a repeatable option (``format``, ``to``) takes a list or one value; a flag
takes ``true``/``false``. The products are built in the order ``grid``, ``matrix``,
``export-interop`` (the order one would run the commands) with :func:`~bevcompile.grid.build.run_grid`,
:func:`~bevcompile.matrix.build.run_matrix` and :func:`~bevcompile.interop.export.run_export_interop`,
given exactly what the CLI gives them (:func:`~bevcompile.grid.build.grid_command_options`,
:meth:`~bevcompile.matrix.build.MatrixOptions.from_command`,
:func:`~bevcompile.interop.export.interop_command_targets`).

``matrix``'s ``depth-prior`` (``--mode ray``) is ``uniform`` or a ``.npy`` file, relative to the
manifest's folder like every manifest path (resolved to an absolute path: with ``--scheduler`` the
workers read it, so it must be on shared storage). The manifest check reads it once (a real array
of 1, 2 or 4 dimensions, finite, >= 0) and records its hash in the build options; each vehicle
checks its shape against its own rig, and refuses a file that changed since (one line, like any
vehicle error).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import DepthPriorError, UsageError
from ..grid.build import GridBuildOptions, grid_command_options
from ..grid.delta import DEFAULT_BLOCK, DEFAULT_MAX_ERROR_PX
from ..interop.export import interop_command_targets
from ..matrix.build import MatrixOptions
from ..matrix.prior import UNIFORM, DepthPrior, check_prior_values, load_prior_file, read_depth_prior
from ..rig.config import RigConfig, _Ctx, _integer, _list, _mapping, _number, _string

PRODUCT_ORDER = ("grid", "matrix", "export-interop")
"""Products, in the order they are built (and their commands would be run)."""
GROUPS = {"grid": ("grid", "gather", "delta"), "matrix": ("matrix",), "export-interop": ("interop",)}
"""The store groups each product writes."""


@dataclass(frozen=True)
class Option:
    name: str  # as the CLI spells it, without the dashes
    kind: str  # bool | int | int? | float | str | str? | list
    default: Any = None


OPTIONS: dict[str, tuple[Option, ...]] = {
    "grid": (
        Option("align-corners", "bool", False),
        Option("format", "list", ()),
        Option("frac-bits", "int?", None),
        Option("align", "int", 1),
        Option("order", "str", "row"),
        Option("block", "int", DEFAULT_BLOCK),
        Option("max-error-px", "float", DEFAULT_MAX_ERROR_PX),
    ),
    "matrix": (
        Option("mode", "str", "frustum"),
        Option("topk", "int", 0),
        Option("align", "int", 16),
        Option("splat", "str", "bilinear"),
        Option("normalize", "str", "sum"),
        Option("tile-rows", "int?", None),
        Option("quantize", "str?", None),
        Option("compact-rows", "bool", False),
        Option("rounding", "str", "floor"),
        Option("depth-prior", "str", UNIFORM),
        Option("fp16-rows", "str?", None),
    ),
    "export-interop": (
        Option("to", "list", ()),
        Option("frustum-mapping", "str?", None),
        Option("rounding", "str?", None),
        Option("z-bins", "int?", None),
        Option("batch", "int?", None),
        Option("overlap", "str?", None),
    ),
}
REFUSED = {
    "force": "a fleet replaces each vehicle's store as a whole (a recalibrated car gets new tables)",
    "out": "the fleet's --out holds every store",
    "quiet": "give --quiet to bevcompile fleet",
    "json": "give --json to bevcompile fleet",
    "npy": "a fleet writes stores only; export .npy files from a store with bevcompile export-interop --npy",
}


@dataclass(frozen=True)
class Product:
    """One product with its options: ``given`` (canonical option names -> values as given), and
    the library options it builds with (exactly one of ``grid``, ``matrix``, ``interop``)."""

    name: str
    given: dict[str, Any]
    grid: GridBuildOptions | None = None
    matrix: MatrixOptions | None = None
    interop: dict[str, dict[str, Any]] | None = None
    resolved: dict[str, Any] = field(default_factory=dict)
    depth_prior_file: str | None = None  # matrix: the absolute path of a depth-prior .npy (None: uniform)

    @property
    def groups(self) -> tuple[str, ...]:
        return GROUPS[self.name]

    def command(self) -> list[str]:
        """The single command (argv after ``bevcompile``, without CONFIG/STORE and --out) it equals."""
        args = [self.name]
        for option in OPTIONS[self.name]:
            if option.name not in self.given:
                continue
            value = self.given[option.name]
            if value is None:
                continue
            if option.kind == "bool":
                if value:
                    args.append(f"--{option.name}")
            elif option.kind == "list":
                for item in value:
                    args += [f"--{option.name}", str(item)]
            else:
                args += [f"--{option.name}", str(value)]
        return args

    def recorded_build_options(self, rig: RigConfig) -> dict[str, Any]:
        """``build_options`` of each group this product writes for ``rig`` (see :mod:`.task` resume)."""
        if self.grid is not None:
            return self.grid.recorded_build_options(rig)
        if self.matrix is not None:
            return {"matrix": self.matrix.to_dict()}
        assert self.interop is not None
        return {"interop": {target: dict(options) for target, options in self.interop.items()}}

    def to_json(self) -> dict[str, Any]:
        return {"options": dict(self.given), "resolved": self.resolved, "command": self.command()}


def _value(ctx: _Ctx, option: Option, value: Any, where: str) -> Any:
    if option.kind == "bool":
        if not isinstance(value, bool):
            raise ctx.fail(where, f"expected true or false, got {value!r}")
        return value
    if option.kind in ("int", "int?"):
        if value is None and option.kind == "int?":
            return None
        return _integer(ctx, value, where)
    if option.kind == "float":
        return _number(ctx, value, where)
    if option.kind in ("str", "str?"):
        if value is None and option.kind == "str?":
            return None
        return _string(ctx, value, where)
    items = value if isinstance(value, list | tuple) else [value]
    return tuple(_string(ctx, item, f"{where}[{i}]" if isinstance(value, list | tuple) else where) for i, item in enumerate(_list(ctx, items, where)))


def parse_product(ctx: _Ctx, name: str, data: Any, field_path: str, base: Path | None = None) -> Product:
    """One ``products.<name>`` entry -> :class:`Product` (ConfigError with the field path);
    ``base``: the folder relative paths are relative to (the manifest's; default: the current one)."""
    data = {} if data is None else _mapping(ctx, data, field_path)
    known = {o.name: o for o in OPTIONS[name]}
    given: dict[str, Any] = {}
    spelled: dict[str, str] = {}
    for key, value in data.items():
        canonical = str(key).lstrip("-").replace("_", "-")
        where = f"{field_path}.{key}"
        if canonical in REFUSED:
            raise ctx.fail(where, f"not a fleet product option: {REFUSED[canonical]}")
        if canonical not in known:
            raise ctx.fail(where, f"unknown option of {name} (options: {', '.join(known)})")
        if canonical in spelled:
            raise ctx.fail(where, f"given twice (also as {spelled[canonical]!r})")
        spelled[canonical] = str(key)
        given[canonical] = _value(ctx, known[canonical], value, where)
    values = {o.name: given.get(o.name, o.default) for o in OPTIONS[name]}
    try:
        if name == "grid":
            options = grid_command_options(
                align_corners=values["align-corners"], formats=values["format"], frac_bits=values["frac-bits"], align=values["align"],
                order=values["order"], block=values["block"], max_error_px=values["max-error-px"],
            ).validated()
            resolved = {
                "align_corners": options.align_corners, "formats": list(options.formats), "frac_bits": options.frac_bits,
                "align": options.align, "order": options.order, "block": options.block, "max_error_px": options.max_error_px,
            }
            return Product(name, given, grid=options, resolved=resolved)
        if name == "matrix":
            prior_file, token = _depth_prior(ctx, values["depth-prior"], f"{field_path}.depth-prior", base)
            if prior_file is not None:
                given["depth-prior"] = prior_file
            matrix = MatrixOptions.from_command(
                mode=values["mode"], topk=values["topk"], align=values["align"], splat=values["splat"], normalize=values["normalize"],
                tile_rows=values["tile-rows"], quantize=values["quantize"], compact_rows=values["compact-rows"], rounding=values["rounding"],
                depth_prior=token, fp16_rows=values["fp16-rows"],
            )
            return Product(name, given, matrix=matrix, resolved=matrix.to_dict(), depth_prior_file=prior_file)
        if "to" not in given:
            raise ctx.fail(f"{field_path}.to", "missing required option (bevpoolv2 and/or fastbev-lut)")
        targets = interop_command_targets(
            values["to"], frustum_mapping=values["frustum-mapping"], rounding=values["rounding"], z_bins=values["z-bins"],
            batch=values["batch"], overlap=values["overlap"],
        )
        return Product(name, given, interop=targets, resolved={t: dict(o) for t, o in targets.items()})
    except UsageError as exc:
        raise ctx.fail(field_path, str(exc)) from None


def _depth_prior(ctx: _Ctx, value: str, where: str, base: Path | None) -> tuple[str | None, str]:
    """``matrix.depth-prior``: ``(None, "uniform")``, or a ``.npy`` file's absolute path and the
    ``build_options`` token of its array (ConfigError naming ``where`` and the file)."""
    if value.strip().lower() == UNIFORM:
        return None, UNIFORM
    if not value.strip():
        raise ctx.fail(where, "must be 'uniform' or a .npy file")
    path = Path(value).expanduser()
    path = path if path.is_absolute() else ((base or Path.cwd()) / path).resolve()
    try:
        values, _sha = load_prior_file(path)
        raw = check_prior_values(values, str(path))
    except DepthPriorError as exc:
        raise ctx.fail(where, str(exc)) from None
    return str(path), DepthPrior(raw).token


def parse_products(ctx: _Ctx, data: Any, base: Path | None = None) -> tuple[Product, ...]:
    """``products:`` -> products in build order. At least one; ``export-interop`` needs ``grid``
    or ``matrix`` (it reads a store). ``base``: the manifest's folder (relative paths)."""
    data = _mapping(ctx, data, "products")
    for key in data:
        if key not in PRODUCT_ORDER:
            raise ctx.fail(f"products.{key}", f"unknown product (products: {', '.join(PRODUCT_ORDER)})")
    if not data:
        raise ctx.fail("products", f"must name at least one product ({', '.join(PRODUCT_ORDER)})")
    if "export-interop" in data and not ({"grid", "matrix"} & set(data)):
        raise ctx.fail("products.export-interop", "needs grid or matrix as well (export-interop adds a group to a store)")
    return tuple(parse_product(ctx, name, data[name], f"products.{name}", base) for name in PRODUCT_ORDER if name in data)


def build_products(rig: RigConfig, out_dir: Path, products: tuple[Product, ...], *, checkpoint: Callable[[], None] | None = None) -> Path:
    """Build every product of ``rig`` into ``<out_dir>/<name>.zarr`` with the single commands'
    library functions, in order; ``checkpoint`` is called between products (it raises to stop).
    Returns the store path."""
    from ..grid.build import run_grid
    from ..interop.export import run_export_interop
    from ..matrix.build import run_matrix
    from ..store.zarr_io import store_path

    path = store_path(out_dir, rig.name)
    for i, product in enumerate(products):
        if i and checkpoint is not None:
            checkpoint()
        if product.grid is not None:
            run_grid(rig, out_dir, **product.grid.run_kwargs())
        elif product.matrix is not None:
            run_matrix(rig, out_dir, product.matrix, depth_prior=_vehicle_prior(product, rig))
        else:
            assert product.interop is not None
            run_export_interop(path, product.interop)
    return path


def expected_groups(rig: RigConfig, products: tuple[Product, ...]) -> dict[str, Any]:
    """Group name -> the ``build_options`` a build of ``products`` records there."""
    out: dict[str, Any] = {}
    for product in products:
        out.update(product.recorded_build_options(rig))
    return out


def _vehicle_prior(product: Product, rig: RigConfig) -> DepthPrior | None:
    """The depth prior of a ``matrix`` product for ``rig`` (None: uniform): the manifest's file,
    checked against the rig, and the same array the manifest check hashed."""
    if product.depth_prior_file is None:
        return None
    assert product.matrix is not None
    prior = read_depth_prior(product.depth_prior_file, rig)
    if prior.token != product.matrix.depth_prior:
        raise DepthPriorError(product.depth_prior_file, "", "changed since the fleet manifest was read (its array's sha256 differs); run the fleet again")
    return prior
