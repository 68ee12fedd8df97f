"""The nuScenes devkit's JSON tables -> rig config data of one scene's vehicle.

Tables (nutonomy/nuscenes-devkit ``docs/schema_nuscenes.md``), in ``<dataroot>/<version>/``:
``scene.json`` (``token``, ``name``, ``log_token``, ``first_sample_token``), ``sample.json``
(``token``, ``scene_token``), ``sample_data.json`` (``sample_token``, ``calibrated_sensor_token``,
``is_key_frame``, ``width``, ``height``, ``filename``), ``calibrated_sensor.json`` (``token``,
``sensor_token``, ``translation`` [x, y, z] m, ``rotation`` [w, x, y, z], ``camera_intrinsic``
3x3, empty for other sensors; "all extrinsic parameters are given with respect to the ego
vehicle body frame", "all camera images come undistorted and rectified"), ``sensor.json``
(``token``, ``channel``, ``modality`` camera/lidar/radar), ``log.json`` (``token``, ``logfile``,
``vehicle``, ``location``).

The scene's first sample's key-frame ``sample_data`` give, per channel, the calibrated sensor:
each camera becomes a rig camera (``rotation_wxyz`` = ``rotation``, ``translation``,
``intrinsic`` = ``camera_intrinsic``, ``image_size`` = ``[width, height]``, distortion ``none``,
numbers copied exactly) and ``LIDAR_TOP`` a rig sensor (same pose fields). ``sample_data.json``
(about 2.6 million records in v1.0-trainval) is streamed, never loaded whole.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from ...errors import ConfigError, shown
from ...files import MISSING, FileRefused, JSONRefused, open_regular, raw_decode_strict, strict_decoder
from ..config import _Ctx, _integer, _mapping, _matrix, _numbers, _string
from ._common import check_name, rig_data, template_data

DEFAULT_CAMERAS = ("CAM_FRONT", "CAM_FRONT_RIGHT", "CAM_FRONT_LEFT", "CAM_BACK", "CAM_BACK_LEFT", "CAM_BACK_RIGHT")
"""The camera order of the bundled rig (mmdet3d's nuScenes info order)."""
LIDAR_CHANNELS = ("LIDAR_TOP",)
TABLES = ("scene", "sample", "sample_data", "calibrated_sensor", "sensor", "log")
READ_CHUNK = 1 << 20
MAX_TABLE_BYTES = 16 << 30
"""A table file is at most 16 GiB (v1.0-trainval's ``sample_data.json`` is about 1 GiB)."""
MAX_RECORD_BYTES = 1 << 24
"""A single table record larger than this is not a nuScenes record (bounds the stream's buffer)."""


def table_path(dataroot: str | Path, version: str, table: str) -> Path:
    return Path(dataroot) / version / f"{table}.json"


def iter_json_array(path: str | Path) -> Iterator[tuple[int, Any]]:
    """``(index, record)`` of a JSON file holding one array, streamed (memory: one chunk + one record).

    ConfigError ``<path>: [<index>]: ...`` for a file that is not a JSON array of values."""
    source = str(path)
    decoder = strict_decoder()
    try:  # a regular file of bounded size (a FIFO would block the first read)
        binary, _size = open_regular(path, MAX_TABLE_BYTES, "a nuScenes table")
    except FileRefused as exc:
        if exc.code == MISSING:
            raise ConfigError(source, "", "file not found (is --dataroot/--version right?)") from None
        raise ConfigError(source, "", exc.reason) from None
    fh = io.TextIOWrapper(binary, encoding="utf-8")
    with fh:
        buffer, pos, index, done = "", 0, 0, False

        def fill() -> bool:
            nonlocal buffer, pos
            try:
                chunk = fh.read(READ_CHUNK)
            except (OSError, UnicodeDecodeError) as exc:
                raise ConfigError(source, "", f"cannot read file ({exc.__class__.__name__}: {exc})") from None
            if not chunk:
                return False
            buffer = buffer[pos:] + chunk
            pos = 0
            return True

        def skip_space() -> bool:
            nonlocal pos
            while True:
                while pos < len(buffer) and buffer[pos] in " \t\r\n":
                    pos += 1
                if pos < len(buffer):
                    return True
                if not fill():
                    return False

        if not skip_space() or buffer[pos] != "[":
            raise ConfigError(source, "", "not a JSON array (a nuScenes table is a list of records)")
        pos += 1
        while not done:
            if not skip_space():
                raise ConfigError(source, f"[{index}]", "file ends inside the array (truncated?)")
            if buffer[pos] == "]":
                done = True
                break
            if index:
                if buffer[pos] != ",":
                    raise ConfigError(source, f"[{index}]", f"expected ',' between records, got {buffer[pos]!r}")
                pos += 1
                if not skip_space():
                    raise ConfigError(source, f"[{index}]", "file ends inside the array (truncated?)")
            while True:
                try:
                    record, end = raw_decode_strict(decoder, buffer, pos)
                    if end == len(buffer) and fill():  # a number may go on in the next chunk
                        continue
                    break
                except JSONRefused as exc:  # nested too deep, NaN, a 5,000-digit number, a duplicate key
                    raise ConfigError(source, f"[{index}]", f"invalid JSON ({exc})") from None
                except json.JSONDecodeError as exc:
                    if len(buffer) - pos > MAX_RECORD_BYTES:
                        raise ConfigError(source, f"[{index}]", f"invalid JSON ({exc.msg})") from None
                    if not fill():
                        raise ConfigError(source, f"[{index}]", f"invalid JSON ({exc.msg})") from None
            pos = end
            yield index, record
            index += 1


def _records(path: Path, want: Mapping[str, Any] | None = None) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """``(field path, record)`` of every mapping record (``want``: only those with these values)."""
    ctx = _Ctx(str(path))
    for index, record in iter_json_array(path):
        record = _mapping(ctx, record, f"[{index}]")
        if want is None or all(record.get(k) == v for k, v in want.items()):
            yield f"[{index}]", record


def _one(path: Path, key: str, value: Any, what: str) -> tuple[str, Mapping[str, Any]]:
    for where, record in _records(path, {key: value}):
        return where, record
    raise ConfigError(str(path), "", f"no record with {key} {shown(value)} ({what})")


def _by_token(path: Path, tokens: set[str]) -> dict[str, tuple[str, Mapping[str, Any]]]:
    found: dict[str, tuple[str, Mapping[str, Any]]] = {}
    for where, record in _records(path):
        token = record.get("token")
        if isinstance(token, str) and token in tokens:
            found[token] = (where, record)
    missing = sorted(tokens - set(found))
    if missing:
        raise ConfigError(str(path), "", f"no record with token {shown(missing[0])}")
    return found


def nuscenes_rig(
    dataroot: str | Path,
    version: str,
    scene: str,
    *,
    template: Mapping[str, Any] | None = None,
    cameras: Sequence[str] = DEFAULT_CAMERAS,
    name: str | None = None,
    lidar: bool = True,
) -> dict[str, Any]:
    """Rig config data of the vehicle of ``scene`` (see the module docstring): the cameras in
    ``cameras`` order, and ``LIDAR_TOP`` as a sensor (``lidar``). ``name`` defaults to the scene's.

    Raises:
        ConfigError: ``<table file>: [<index>].<field>: ...`` for a record that is not as the schema says,
            ``--scene`` / ``--cameras`` for names the tables do not hold.
    """
    version_dir = Path(dataroot) / version
    if not version_dir.is_dir():
        raise ConfigError(str(version_dir), "", "no such folder (--dataroot D --version V reads D/V/*.json)")
    paths = {t: table_path(dataroot, version, t) for t in TABLES}
    scene_where, scene_record = _one(paths["scene"], "name", scene, "--scene")
    ctx = _Ctx(str(paths["scene"]))
    first_sample = _string(ctx, scene_record.get("first_sample_token"), f"{scene_where}.first_sample_token")
    scene_token = _string(ctx, scene_record.get("token"), f"{scene_where}.token")
    log_token = _string(ctx, scene_record.get("log_token"), f"{scene_where}.log_token")
    sample_where, sample = _one(paths["sample"], "token", first_sample, f"first sample of {scene}")
    if sample.get("scene_token") != scene_token:
        raise ConfigError(str(paths["sample"]), f"{sample_where}.scene_token", f"is {shown(sample.get('scene_token'))}, not the token of {scene} ({scene_token})")
    _, log = _one(paths["log"], "token", log_token, f"log of {scene}")

    key_frames = [(w, r) for w, r in _records(paths["sample_data"], {"sample_token": first_sample}) if r.get("is_key_frame") is True]
    if not key_frames:
        raise ConfigError(str(paths["sample_data"]), "", f"no key-frame record of sample {first_sample} (first sample of {scene})")
    sd_ctx = _Ctx(str(paths["sample_data"]))
    calib_tokens = {_string(sd_ctx, r.get("calibrated_sensor_token"), f"{w}.calibrated_sensor_token") for w, r in key_frames}
    calibrated = _by_token(paths["calibrated_sensor"], calib_tokens)
    cs_ctx = _Ctx(str(paths["calibrated_sensor"]))
    sensor_tokens = {_string(cs_ctx, rec.get("sensor_token"), f"{w}.sensor_token") for w, rec in calibrated.values()}
    sensors = _by_token(paths["sensor"], sensor_tokens)
    se_ctx = _Ctx(str(paths["sensor"]))

    by_channel: dict[str, tuple[str, Mapping[str, Any], str, Mapping[str, Any], str]] = {}
    for sd_where, sd in key_frames:
        cs_where, cs = calibrated[str(sd["calibrated_sensor_token"])]
        s_where, sensor = sensors[str(cs["sensor_token"])]
        channel = _string(se_ctx, sensor.get("channel"), f"{s_where}.channel")
        modality = _string(se_ctx, sensor.get("modality"), f"{s_where}.modality")
        by_channel[channel] = (sd_where, sd, cs_where, cs, modality)

    out_cameras = []
    for channel in cameras:
        if channel not in by_channel or by_channel[channel][4] != "camera":
            have = sorted(c for c, v in by_channel.items() if v[4] == "camera")
            raise ConfigError(str(paths["sample_data"]), "--cameras", f"{scene} has no camera {shown(channel)} (cameras: {', '.join(have)})")
        sd_where, sd, cs_where, cs, _ = by_channel[channel]
        intrinsic = _matrix(cs_ctx, cs.get("camera_intrinsic"), f"{cs_where}.camera_intrinsic", 3, 3)
        width = _integer(sd_ctx, sd.get("width"), f"{sd_where}.width")
        height = _integer(sd_ctx, sd.get("height"), f"{sd_where}.height")
        out_cameras.append(
            {
                "name": channel,
                "description": f"nuScenes calibrated_sensor {cs.get('token')} (sensor {cs.get('sensor_token')}; {sd.get('filename')})",
                "image_size": [width, height],
                "intrinsic": intrinsic,
                "distortion": {"model": "none"},
                **_pose(cs_ctx, cs, cs_where),
            }
        )
    out_sensors = []
    if lidar:
        for channel in LIDAR_CHANNELS:
            if channel in by_channel:
                _, _, cs_where, cs, _ = by_channel[channel]
                out_sensors.append({"name": channel, "description": f"nuScenes calibrated_sensor {cs.get('token')} (sensor {cs.get('sensor_token')})", **_pose(cs_ctx, cs, cs_where)})
    rig_name = check_name(name if name is not None else scene, str(paths["scene"]), "--name" if name is not None else f"{scene_where}.name")
    description = (
        f"nuScenes {version} {scene} (log {log.get('logfile')}, {log.get('location')}, vehicle {log.get('vehicle')}), first key frame "
        f"sample {first_sample}; calibrated_sensor records verbatim; images undistorted and rectified (distortion none)"
    )
    return rig_data(template if template is not None else template_data(None), name=rig_name, cameras=out_cameras, sensors=out_sensors, description=description)


def _pose(ctx: _Ctx, record: Mapping[str, Any], where: str) -> dict[str, Any]:
    rotation = _numbers(ctx, record.get("rotation"), f"{where}.rotation", 4)
    translation = _numbers(ctx, record.get("translation"), f"{where}.translation", 3)
    return {"rotation_wxyz": rotation, "translation": translation}


def split_cameras(text: str | Sequence[str] | None) -> tuple[str, ...]:
    if text is None:
        return DEFAULT_CAMERAS
    items = text.split(",") if isinstance(text, str) else list(text)
    return tuple(str(i).strip() for i in items if str(i).strip())

