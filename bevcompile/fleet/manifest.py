"""The fleet manifest: which products, with which options, for which vehicles' calibrations.

A manifest is YAML (read by :func:`bevcompile.rig.config.read_config_data`: the rig config's
strict rules) and is validated completely, with the field path of the first problem, before any
vehicle is built (``docs/fleet.md`` documents every key)::

    description: free text                     # optional
    products:                                  # required: grid, matrix, export-interop
      grid: {format: [opencv, uq12], align: 32}
      matrix: {topk: 24, align: 16}
    template: model.yaml                       # a rig config without cameras (or inline mapping)
    reference: car-0001                        # the vehicle shifts are measured against (default: the first)
    max_shift_px: 0.5                          # optional gates (bevcompile fleet --max-shift-px overrides)
    max_coverage_change: 0.02
    vehicles:
      - {id: car-0001, rig: calib/car-0001.yaml}                       # a complete rig config
      - {id: car-0002, cameras: calib/car-0002-cameras.yaml}           # cameras; model from template
      - {id: car-0003, import: {kalibr: calib/car-0003/camchain.yaml, body: imu}}
      - {id: car-0004, import: {nuscenes: /data/nuscenes, version: v1.0-mini, scene: scene-0103}}
      - id: car-0005
        rig: calib/car-0001.yaml
        import: {opencv: calib/car-0005/front.yml, camera: CAM_FRONT}  # merged into the rig
        overlay: {CAM_BACK: {translation: [0.06, 0.01, 1.57]}}         # changes some fields

Relative paths are relative to the manifest's folder (they are resolved to absolute paths:
with ``--scheduler`` the workers read the calibrations, so they must be on shared storage too).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError, shown
from ..files import FileRefused, read_regular
from ..rig.config import _NAME_RE, MAX_CONFIG_BYTES, _Ctx, _list, _mapping, _number, _string, read_config_data
from ..rig.importers._common import template_data
from ..rig.importers.kalibr import check_body, parse_ego_from_body
from ..rig.importers.opencv import EXTRINSICS, LENSES
from .products import Product, parse_products

MANIFEST_KEYS = ("description", "products", "template", "reference", "max_shift_px", "max_coverage_change", "vehicles")
VEHICLE_KEYS = ("id", "description", "rig", "cameras", "import", "overlay")
IMPORT_FORMATS = ("kalibr", "nuscenes", "opencv")
IMPORT_OPTIONS = {
    "kalibr": ("body", "ego-from-body", "names"),
    "nuscenes": ("version", "scene", "cameras"),
    "opencv": ("camera", "extrinsics", "lens"),
}
IMPORT_REQUIRED = {"kalibr": (), "nuscenes": ("version", "scene"), "opencv": ("camera",)}
OVERLAY_FIELDS = ("image_size", "intrinsic", "distortion", "rotation_wxyz", "translation", "sensor2ego", "image_aug", "description")


@dataclass(frozen=True)
class Source:
    """One calibration source of a vehicle. ``kind``: ``rig`` / ``cameras`` (``path`` or ``inline``)
    or an importer (``kalibr`` / ``nuscenes`` / ``opencv``: ``path`` and ``options``, option names
    canonical with dashes). ``field``: its manifest field path."""

    kind: str
    field: str
    path: str | None = None
    inline: Any = None
    options: tuple[tuple[str, Any], ...] = ()

    def option(self, name: str, default: Any = None) -> Any:
        return dict(self.options).get(name, default)


@dataclass(frozen=True)
class Vehicle:
    """One vehicle: ``start`` (rig / cameras / kalibr / nuscenes, or None: the template's model
    settings with no camera), then ``merges`` (opencv imports, in order), then ``overlay``
    (camera name -> fields, as plain data)."""

    id: str
    index: int
    start: Source | None
    merges: tuple[Source, ...] = ()
    overlay: Any = None
    description: str | None = None

    @property
    def field(self) -> str:
        return f"vehicles[{self.index}]"

    def sources(self) -> list[str]:
        """The files this vehicle's calibration is read from (for the index)."""
        out = [s.path for s in ((self.start,) if self.start else ()) + self.merges if s.path is not None]
        return [str(p) for p in out]


@dataclass(frozen=True)
class Template:
    data: dict[str, Any]
    source: str  # the template file, or "<manifest>: template" for an inline one
    field: str  # "" for a file, "template" for an inline template


@dataclass(frozen=True)
class Manifest:
    path: str
    sha256: str
    products: tuple[Product, ...]
    vehicles: tuple[Vehicle, ...]
    reference: str
    template: Template | None = None
    description: str | None = None
    max_shift_px: float | None = None
    max_coverage_change: float | None = None

    def vehicle(self, vehicle_id: str) -> Vehicle:
        return next(v for v in self.vehicles if v.id == vehicle_id)


def _path(ctx: _Ctx, value: Any, where: str, base: Path) -> str:
    text = _string(ctx, value, where)
    if not text.strip():
        raise ctx.fail(where, "must not be empty")
    path = Path(text).expanduser()
    return str(path if path.is_absolute() else (base / path).resolve())


def _import(ctx: _Ctx, value: Any, where: str, base: Path) -> Source:
    value = _mapping(ctx, value, where)
    formats = [k for k in value if k in IMPORT_FORMATS]
    if len(formats) != 1:
        what = f"{len(formats)} ({', '.join(formats)})" if formats else "none"
        raise ctx.fail(where, f"an import names exactly one format key ({', '.join(IMPORT_FORMATS)}: the file or folder), got {what}")
    kind = formats[0]
    allowed = IMPORT_OPTIONS[kind]
    options: dict[str, Any] = {}
    for key, item in value.items():
        if key == kind:
            continue
        canonical = str(key).replace("_", "-")
        if canonical not in allowed:
            raise ctx.fail(f"{where}.{key}", f"unknown option of the {kind} importer (options: {', '.join(allowed)})")
        options[canonical] = item
    for required in IMPORT_REQUIRED[kind]:
        if required not in options:
            raise ctx.fail(f"{where}.{required}", f"missing required option of the {kind} importer")
    if kind == "kalibr":
        if "body" in options:
            options["body"] = check_body(_string(ctx, options["body"], f"{where}.body"), ctx.source, f"{where}.body")
        if "ego-from-body" in options:
            given = options["ego-from-body"]
            if isinstance(given, str):
                options["ego-from-body"] = read_config_data(_path(ctx, given, f"{where}.ego-from-body", base), what="a 4x4 matrix")
            options["ego-from-body"] = parse_ego_from_body(options["ego-from-body"], ctx.source, f"{where}.ego-from-body")
        if "names" in options:
            names = options["names"]
            items = names.split(",") if isinstance(names, str) else _list(ctx, names, f"{where}.names")
            options["names"] = tuple(_string(ctx, n, f"{where}.names[{i}]").strip() for i, n in enumerate(items))
    elif kind == "nuscenes":
        for key in ("version", "scene"):
            options[key] = _string(ctx, options[key], f"{where}.{key}")
        if "cameras" in options:
            cams = options["cameras"]
            items = cams.split(",") if isinstance(cams, str) else _list(ctx, cams, f"{where}.cameras")
            options["cameras"] = tuple(_string(ctx, c, f"{where}.cameras[{i}]").strip() for i, c in enumerate(items))
    else:
        options["camera"] = _string(ctx, options["camera"], f"{where}.camera")
        for key, allowed_values in (("extrinsics", EXTRINSICS), ("lens", LENSES)):
            if key in options:
                text = _string(ctx, options[key], f"{where}.{key}").lower()
                if text not in allowed_values:
                    raise ctx.fail(f"{where}.{key}", f"must be one of {', '.join(allowed_values)}, got {shown(options[key])}")
                options[key] = text
    return Source(kind, where, path=_path(ctx, value[kind], f"{where}.{kind}", base), options=tuple(sorted(options.items())))


def _vehicle(ctx: _Ctx, value: Any, index: int, base: Path, has_template: bool) -> Vehicle:
    where = f"vehicles[{index}]"
    value = _mapping(ctx, value, where)
    for key in value:
        if key not in VEHICLE_KEYS:
            raise ctx.fail(f"{where}.{key}", f"unknown field (allowed here: {', '.join(VEHICLE_KEYS)})")
    if "id" not in value:
        raise ctx.fail(f"{where}.id", "missing required field")
    vehicle_id = _string(ctx, value["id"], f"{where}.id")
    if not _NAME_RE.fullmatch(vehicle_id):
        raise ctx.fail(f"{where}.id", f"must be a file-name-safe identifier (letters, digits, '.', '_', '-'): it names <out>/<id>.zarr, got {shown(vehicle_id)}")
    if "rig" in value and "cameras" in value:
        raise ctx.fail(f"{where}.cameras", "give either rig (a complete rig config) or cameras (with the template), not both")
    start: Source | None = None
    if "rig" in value:
        start = Source("rig", f"{where}.rig", path=_path(ctx, value["rig"], f"{where}.rig", base))
    elif "cameras" in value:
        cams = value["cameras"]
        if isinstance(cams, str):
            start = Source("cameras", f"{where}.cameras", path=_path(ctx, cams, f"{where}.cameras", base))
        else:
            start = Source("cameras", f"{where}.cameras", inline=_list(ctx, cams, f"{where}.cameras"))
    merges: list[Source] = []
    if "import" in value:
        raw = value["import"]
        items = raw if isinstance(raw, list | tuple) else [raw]
        for i, item in enumerate(items):
            item_where = f"{where}.import" + (f"[{i}]" if isinstance(raw, list | tuple) else "")
            source = _import(ctx, item, item_where, base)
            if source.kind in ("kalibr", "nuscenes"):
                if start is not None or merges:
                    other = start.field if start is not None else merges[0].field
                    raise ctx.fail(
                        f"{item_where}.{source.kind}",
                        f"a {source.kind} import gives every camera: it must come first and alone as the vehicle's calibration ({other} is given too)",
                    )
                start = source
            else:
                merges.append(source)
    if start is None and not merges:
        raise ctx.fail(where, "no calibration: give rig, cameras or import")
    if (start is None or start.kind != "rig") and not has_template:
        what = start.field if start is not None else merges[0].field
        raise ctx.fail(what, "needs the manifest's template (the model settings: image_aug, feature, bev, depth); or give a complete rig")
    overlay = None
    if "overlay" in value:
        overlay = dict(_mapping(ctx, value["overlay"], f"{where}.overlay"))
        for camera, fields in overlay.items():
            fields = _mapping(ctx, fields, f"{where}.overlay.{camera}")
            for key in fields:
                if key not in OVERLAY_FIELDS:
                    raise ctx.fail(f"{where}.overlay.{camera}.{key}", f"not a camera field an overlay changes ({', '.join(OVERLAY_FIELDS)})")
    description = None if value.get("description") is None else _string(ctx, value["description"], f"{where}.description")
    return Vehicle(vehicle_id, index, start, tuple(merges), overlay, description)


def _gate(ctx: _Ctx, data: Mapping[str, Any], key: str, upper: float | None) -> float | None:
    if data.get(key) is None:
        return None
    value = _number(ctx, data[key], key)
    if value < 0 or (upper is not None and value > upper):
        raise ctx.fail(key, f"must be in [0, {upper:g}], got {value:g}" if upper is not None else f"must be >= 0, got {value:g}")
    return value


def parse_manifest(data: Any, *, source: str, base: str | Path, sha256: str = "") -> Manifest:
    """Validate manifest data (as read from YAML) into a :class:`Manifest`.

    Raises:
        ConfigError: ``<source>: <field path>: <problem>`` for the first problem (exit 2).
    """
    ctx = _Ctx(source)
    base = Path(base)
    data = _mapping(ctx, data, "")
    for key in data:
        if key not in MANIFEST_KEYS:
            raise ctx.fail(str(key), f"unknown field (allowed here: {', '.join(MANIFEST_KEYS)})")
    for key in ("products", "vehicles"):
        if key not in data:
            raise ctx.fail(key, "missing required field")
    products = parse_products(ctx, data["products"], base)
    template = None
    if data.get("template") is not None:
        given = data["template"]
        if isinstance(given, str):
            path = _path(ctx, given, "template", base)
            template = Template(template_data(path), path, "")
        else:
            template = Template(template_data(None, given, source=source, field="template"), source, "template")
    items = _list(ctx, data["vehicles"], "vehicles")
    if not items:
        raise ctx.fail("vehicles", "must list at least one vehicle")
    vehicles: list[Vehicle] = []
    seen: dict[str, int] = {}
    for i, item in enumerate(items):
        vehicle = _vehicle(ctx, item, i, base, template is not None)
        if vehicle.id in seen:
            raise ctx.fail(f"vehicles[{i}].id", f"duplicate vehicle id {shown(vehicle.id)} (also vehicles[{seen[vehicle.id]}])")
        seen[vehicle.id] = i
        vehicles.append(vehicle)
    reference = vehicles[0].id
    if data.get("reference") is not None:
        reference = _string(ctx, data["reference"], "reference")
        if reference not in seen:
            raise ctx.fail("reference", f"{shown(reference)} is not the id of a vehicle of the manifest")
    description = None if data.get("description") is None else _string(ctx, data["description"], "description")
    return Manifest(
        path=source,
        sha256=sha256,
        products=products,
        vehicles=tuple(vehicles),
        reference=reference,
        template=template,
        description=description,
        max_shift_px=_gate(ctx, data, "max_shift_px", None),
        max_coverage_change=_gate(ctx, data, "max_coverage_change", 1.0),
    )


def load_manifest(path: str | Path) -> Manifest:
    """Read and validate a manifest file (ConfigError, one line, for any problem)."""
    path = Path(path)
    data = read_config_data(path, what="a fleet manifest")
    try:  # the bytes just read, as bounded as then
        sha = hashlib.sha256(read_regular(path, MAX_CONFIG_BYTES, "a fleet manifest")).hexdigest()
    except FileRefused as exc:  # pragma: no cover - read just above
        raise ConfigError(str(path), "", exc.reason) from None
    return parse_manifest(data, source=str(path), base=path.resolve().parent, sha256=sha)
