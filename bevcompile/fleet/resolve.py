"""A vehicle's resolved rig config from its calibration sources.

Order: the start (a complete ``rig`` file; ``cameras`` with the template; a ``kalibr`` or
``nuscenes`` import with the template; or the template alone), then each ``opencv`` import
(merged camera by camera), then the ``overlay``; the name becomes the vehicle id (the store is
``<out>/<id>.zarr``) and a vehicle ``description`` replaces the rig's. The result is what
``parse_config`` makes of that data: :func:`bevcompile.rig.config.config_to_dict` of it, written
to a file, is the config the single commands rebuild the same store from.

An error names the file (or manifest field) the wrong value came from: every piece of the data
remembers where it was read (:class:`Provenance`).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError, shown
from ..rig.config import RigConfig, _Ctx, _list, _mapping, parse_config, read_config_data, read_opencv_yaml
from ..rig.importers._common import rig_data
from ..rig.importers.kalibr import KalibrOptions, kalibr_rig
from ..rig.importers.nuscenes import DEFAULT_CAMERAS, nuscenes_rig
from ..rig.importers.opencv import merge_camera, opencv_camera
from .manifest import Source, Template, Vehicle

POSE_FIELDS = ("rotation_wxyz", "translation", "sensor2ego")


@dataclass
class Provenance:
    """Where each part of the merged config data came from: config field path prefix ->
    ``(source file, field path there)``. :meth:`translate` re-labels a ``parse_config`` error."""

    origins: dict[str, tuple[str, str]] = field(default_factory=dict)

    def add(self, prefix: str, source: str, where: str) -> None:
        self.origins[prefix] = (source, where)

    def translate(self, exc: ConfigError) -> ConfigError:
        path = exc.field
        best = max(
            (p for p in self.origins if p == "" or path == p or path.startswith((p + ".", p + "["))),
            key=len,
            default=None,
        )
        if best is None:
            return exc
        source, where = self.origins[best]
        rest = path[len(best) :].lstrip(".") if not best or path[len(best) : len(best) + 1] == "." else path[len(best) :]
        if not where:
            mapped = rest
        elif not rest or rest.startswith("["):
            mapped = where + rest
        else:
            mapped = f"{where}.{rest}"
        return ConfigError(source, mapped, exc.message)


def _camera_list(source: Source, manifest: str) -> tuple[list[Any], list[Any], str, str]:
    """Cameras (and sensors) of a ``cameras:`` source: a file holding a list, or a mapping with
    ``cameras`` (and ``sensors``); or the inline list. Returns (cameras, sensors, source, field)."""
    if source.path is None:
        return list(source.inline), [], manifest, source.field
    data = read_config_data(source.path, what="a camera list")
    ctx = _Ctx(source.path)
    if isinstance(data, list):
        return data, [], source.path, ""
    data = _mapping(ctx, data, "")
    allowed = ("cameras", "sensors", "description", "name")
    for key in data:
        if key not in allowed:
            raise ctx.fail(str(key), "not part of a camera list (a cameras: file holds cameras, and sensors; the model settings come from the template)")
    if "cameras" not in data:
        raise ctx.fail("cameras", "missing required field")
    return _list(ctx, data["cameras"], "cameras"), list(_list(ctx, data.get("sensors", []), "sensors")), source.path, "cameras"


def _start(vehicle: Vehicle, template: Template | None, manifest: str, prov: Provenance) -> dict[str, Any]:
    start = vehicle.start
    model = template.data if template is not None else {}
    if template is not None:
        prov.add("", template.source, template.field)
    if start is None:
        return rig_data(model, name=vehicle.id, cameras=[])
    if start.kind == "rig":
        assert start.path is not None
        prov.add("", start.path, "")
        data = read_config_data(start.path)
        return dict(_mapping(_Ctx(start.path), data, ""))
    if start.kind == "cameras":
        cameras, sensors, source, where = _camera_list(start, manifest)
        prov.add("cameras", source, where)
        if sensors:
            prov.add("sensors", source, "sensors")
        return rig_data(model, name=vehicle.id, cameras=cameras, sensors=sensors)
    assert start.path is not None
    if start.kind == "kalibr":
        options = KalibrOptions(
            body=start.option("body", "auto"),
            ego_from_body=start.option("ego-from-body"),
            names=tuple(start.option("names", ())),
        )
        data = kalibr_rig(read_config_data(start.path, what="a Kalibr camchain"), source=start.path, template=model, name=vehicle.id, options=options)
        for i in range(len(data["cameras"])):
            prov.add(f"cameras[{i}]", start.path, f"cam{i}")
        return data
    data = nuscenes_rig(
        start.path, start.option("version"), start.option("scene"), template=model,
        cameras=tuple(start.option("cameras", DEFAULT_CAMERAS)), name=vehicle.id,
    )
    origin = f"{start.path}/{start.option('version')} ({start.option('scene')})"
    for i, camera in enumerate(data["cameras"]):
        prov.add(f"cameras[{i}]", origin, str(camera["name"]))
    return data


def _overlay(data: dict[str, Any], vehicle: Vehicle, manifest: str, prov: Provenance) -> None:
    ctx = _Ctx(manifest)
    overlay: Mapping[str, Any] = vehicle.overlay or {}
    cameras: list[Any] = data["cameras"] if isinstance(data.get("cameras"), list) else []
    names = [c.get("name") if isinstance(c, Mapping) else None for c in cameras]
    for camera, fields in overlay.items():
        where = f"{vehicle.field}.overlay.{camera}"
        if camera not in names:
            raise ctx.fail(where, f"no camera {shown(camera)} in this vehicle's calibration (cameras: {', '.join(map(str, names))})")
        index = names.index(camera)
        entry = dict(cameras[index])
        fields = dict(fields)
        if any(k in fields for k in POSE_FIELDS):
            quat = [k for k in ("rotation_wxyz", "translation") if k in fields]
            if "sensor2ego" in fields and quat:
                raise ctx.fail(f"{where}.sensor2ego", f"give either sensor2ego or rotation_wxyz + translation, not both ({quat[0]} is set too)")
            if quat and len(quat) == 1 and "sensor2ego" in entry:
                raise ctx.fail(
                    f"{where}.{quat[0]}",
                    "the camera's pose is a sensor2ego matrix: an overlay replaces it with sensor2ego, or with both rotation_wxyz and translation",
                )
            for key in ("sensor2ego",) if quat else ("rotation_wxyz", "translation"):
                entry.pop(key, None)
        entry.update(copy.deepcopy(fields))
        cameras[index] = entry
        for key in fields:
            prov.add(f"cameras[{index}].{key}", manifest, f"{where}.{key}")


def resolved_data(vehicle: Vehicle, template: Template | None, manifest: str) -> tuple[dict[str, Any], Provenance]:
    """The merged config data of ``vehicle`` (not yet validated) and where each part came from."""
    prov = Provenance()
    data = _start(vehicle, template, manifest, prov)
    for merge in vehicle.merges:
        assert merge.path is not None
        fields = opencv_camera(
            read_opencv_yaml(merge.path), source=merge.path, extrinsics=merge.option("extrinsics", "ego-to-cam"), lens=merge.option("lens", "auto")
        )
        camera = str(merge.option("camera"))
        base_source = vehicle.start.path if vehicle.start is not None and vehicle.start.path else manifest
        data = merge_camera(data, camera, fields, source=merge.path, base_source=str(base_source))
        index = [c.get("name") for c in data["cameras"]].index(camera)
        prov.add(f"cameras[{index}]", merge.path, "")
    if vehicle.overlay:
        _overlay(data, vehicle, manifest, prov)
    data["name"] = vehicle.id
    prov.add("name", manifest, f"{vehicle.field}.id")
    if vehicle.description is not None:
        data["description"] = vehicle.description
        prov.add("description", manifest, f"{vehicle.field}.description")
    if not data.get("cameras"):
        raise ConfigError(manifest, vehicle.field, "the calibration gives no camera")
    return data, prov


def resolve_vehicle(vehicle: Vehicle, template: Template | None, manifest: str) -> RigConfig:
    """The validated rig config of ``vehicle``. ConfigError naming the source of the wrong value."""
    data, prov = resolved_data(vehicle, template, manifest)
    source = vehicle.start.path if vehicle.start is not None and vehicle.start.path else manifest
    try:
        return parse_config(data, source=str(source))
    except ConfigError as exc:
        raise prov.translate(exc) from None
