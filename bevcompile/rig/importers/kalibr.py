"""Kalibr's multi-camera calibration (``camchain.yaml``) -> rig config data.

The format (ethz-asl/kalibr ``kalibr_common/ConfigReader.py``: ``CameraChainParameters`` writes it
with ``yaml.dump``): a mapping ``cam0`` .. ``camN``, each with ``camera_model`` (``pinhole``; also
``omni``, ``ds``, ``eucm``), ``intrinsics`` (pinhole: ``[fu, fv, pu, pv]``), ``distortion_model``
(``radtan``, ``equidistant``, ``fov``, ``none``), ``distortion_coeffs``, ``resolution``
``[width, height]``, and the extrinsics ``T_cn_cnm1`` (4x4, camera n-1 -> camera n:
``p_cn = T_cn_cnm1 p_cnm1``; every camera but cam0) and/or ``T_cam_imu`` (4x4, IMU -> camera:
``p_cam = T_cam_imu p_imu``, written by ``kalibr_calibrate_imu_camera``); also ``rostopic``,
``cam_overlaps``, ``timeshift_cam_imu`` (not used).

Mapping (Kalibr's projection ``u = fu * d(x/z, y/z) + pu`` is OpenCV's; ``radtan`` ``(k1, k2, r1, r2)``
is OpenCV's ``(k1, k2, p1, p2)`` and ``equidistant`` is OpenCV's fisheye ``theta_d = theta (1 + k1
theta^2 + k2 theta^4 + k3 theta^6 + k4 theta^8)``): ``intrinsic = [[fu, 0, pu], [0, fv, pv], [0, 0, 1]]``,
``distortion`` ``opencv`` / ``fisheye`` / ``none`` with the coefficients copied exactly,
``image_size = resolution``. Only ``pinhole`` cameras with ``radtan``, ``equidistant`` or
``none`` are supported (bevcompile's lens models are OpenCV's).

The body frame: ``body`` ``imu`` (``body_from_cam = T_cam_imu^-1``) or ``camK`` (the chain:
``T_cn_c0 = T_cn_cnm1 ... T_c1_c0``, ``body_from_cam_n = T_cK_c0 T_cn_c0^-1``); ``ego_from_body``
(4x4, default identity, required for a camera body: a camera frame is x right, y down, z forward,
not the ego frame's x forward, y left, z up) places it in the ego frame:
``sensor2ego = ego_from_body @ body_from_cam``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...errors import ConfigError, shown
from ..config import _Ctx, _integer, _list, _mapping, _numbers, _string, read_config_data
from ._common import IDENTITY, Matrix4, check_name, compose, invert, pose_fields, rig_data, rigid_matrix, template_data

CAMERA_MODELS = ("pinhole",)
UNSUPPORTED_CAMERA_MODELS = ("omni", "ds", "eucm")
DISTORTION_MODELS = {"radtan": ("opencv", 4), "equidistant": ("fisheye", 4), "none": ("none", 0)}
UNSUPPORTED_DISTORTION_MODELS = ("fov",)
CAMERA_KEYS = (
    "camera_model", "intrinsics", "distortion_model", "distortion_coeffs", "resolution",
    "T_cn_cnm1", "T_cam_imu", "timeshift_cam_imu", "cam_overlaps", "rostopic",
)
_CAM_KEY = re.compile(r"^cam(0|[1-9][0-9]*)$")
BODY_AUTO = "auto"


@dataclass(frozen=True)
class KalibrOptions:
    """``body``: ``imu``, ``camK`` or ``auto`` (``imu`` when every camera has ``T_cam_imu``, else
    ``cam0``); ``ego_from_body``: 4x4 rows (None = identity; required for a camera body);
    ``names``: the rig camera names in chain order (default ``cam0`` .. ``camN``)."""

    body: str = BODY_AUTO
    ego_from_body: tuple[tuple[float, ...], ...] | None = None
    names: tuple[str, ...] = ()


def check_body(body: str, source: str, field: str = "--body") -> str:
    if body not in ("imu", BODY_AUTO) and not _CAM_KEY.match(body):
        raise ConfigError(source, field, f"must be imu, camK (cam0, cam1, ...) or auto, got {shown(body)}")
    return body


def parse_ego_from_body(value: Any, source: str, field: str = "--ego-from-body") -> tuple[tuple[float, ...], ...]:
    """A 4x4 rigid ``ego_from_body`` (a 4x4 list, or 16 numbers row by row)."""
    ctx = _Ctx(source)
    if isinstance(value, list | tuple) and not any(isinstance(v, list | tuple) for v in value):
        if len(value) != 16:
            raise ctx.fail(field, f"expected 16 numbers (the 4x4 row by row) or a 4x4 list, got {len(value)} number(s)")
        value = [list(value[4 * i : 4 * i + 4]) for i in range(4)]
    return tuple(tuple(row) for row in rigid_matrix(ctx, value, field))


def _camera(ctx: _Ctx, data: Any, key: str, name: str) -> dict[str, Any]:
    data = _mapping(ctx, data, key)
    unknown = [k for k in data if k not in CAMERA_KEYS]
    if unknown:
        raise ctx.fail(f"{key}.{unknown[0]}", f"unknown field (a Kalibr camera holds: {', '.join(CAMERA_KEYS)})")
    for required in ("camera_model", "intrinsics", "distortion_model", "distortion_coeffs", "resolution"):
        if required not in data:
            raise ctx.fail(f"{key}.{required}", "missing required field")
    model = _string(ctx, data["camera_model"], f"{key}.camera_model")
    if model in UNSUPPORTED_CAMERA_MODELS:
        raise ctx.fail(
            f"{key}.camera_model",
            f"{shown(model)} is not supported: bevcompile's lens models are OpenCV's (Kalibr pinhole with radtan, equidistant or none)",
        )
    if model not in CAMERA_MODELS:
        raise ctx.fail(f"{key}.camera_model", f"unknown camera model {shown(model)} (Kalibr: pinhole, omni, ds, eucm)")
    fu, fv, pu, pv = _numbers(ctx, data["intrinsics"], f"{key}.intrinsics", 4)
    for i, (label, value) in enumerate((("fu", fu), ("fv", fv))):
        if value <= 0:
            raise ctx.fail(f"{key}.intrinsics[{i}]", f"focal length {label} must be > 0, got {value:g}")
    dist_model = _string(ctx, data["distortion_model"], f"{key}.distortion_model")
    if dist_model in UNSUPPORTED_DISTORTION_MODELS:
        raise ctx.fail(f"{key}.distortion_model", f"{shown(dist_model)} is not supported (radtan, equidistant or none)")
    if dist_model not in DISTORTION_MODELS:
        raise ctx.fail(f"{key}.distortion_model", f"unknown distortion model {shown(dist_model)} (Kalibr: radtan, equidistant, fov, none)")
    ours, n_coeffs = DISTORTION_MODELS[dist_model]
    coeffs = _numbers(ctx, data["distortion_coeffs"], f"{key}.distortion_coeffs", n_coeffs)
    size = _list(ctx, data["resolution"], f"{key}.resolution", 2)
    width, height = (_integer(ctx, v, f"{key}.resolution[{i}]") for i, v in enumerate(size))
    for i, v in enumerate((width, height)):
        if v <= 0:
            raise ctx.fail(f"{key}.resolution[{i}]", f"must be > 0, got {v}")
    distortion: dict[str, Any] = {"model": ours} if ours == "none" else {"model": ours, "coeffs": coeffs}
    topic = data.get("rostopic")
    described = f"Kalibr {key} ({model}-{dist_model}" + (f", {topic}" if isinstance(topic, str) else "") + ")"
    return {
        "name": name,
        "description": described,
        "image_size": [width, height],
        "intrinsic": [[fu, 0.0, pu], [0.0, fv, pv], [0.0, 0.0, 1.0]],
        "distortion": distortion,
    }


def kalibr_rig(
    data: Any,
    *,
    source: str,
    template: Mapping[str, Any],
    name: str,
    options: KalibrOptions = KalibrOptions(),
) -> dict[str, Any]:
    """Rig config data from a parsed ``camchain.yaml`` (see the module docstring).

    Raises:
        ConfigError: ``<source>: cam<i>.<field>: ...`` (or ``--body`` / ``--names`` / ``--ego-from-body``).
    """
    ctx = _Ctx(source)
    data = _mapping(ctx, data, "")
    for key in data:
        if not _CAM_KEY.match(str(key)):
            raise ctx.fail(str(key), "unknown field (a Kalibr camchain holds cam0, cam1, ... camN)")
    keys = [f"cam{i}" for i in range(len(data))]
    missing = [k for k in keys if k not in data]
    if not data:
        raise ctx.fail("", "holds no camera (expected cam0, cam1, ...)")
    if missing:
        raise ctx.fail(missing[0], f"missing: the cameras must be numbered cam0 .. cam{len(data) - 1} without a gap")
    names = list(options.names) or keys
    if len(names) != len(keys):
        raise ConfigError(source, "--names", f"gives {len(names)} name(s) for the {len(keys)} cameras of the chain ({', '.join(keys)})")
    if len(set(names)) != len(names):
        raise ConfigError(source, "--names", f"names must be distinct, got {', '.join(names)}")
    check_name(name, source)
    cameras = [_camera(ctx, data[key], key, names[i]) for i, key in enumerate(keys)]

    body = check_body(options.body, source)
    if body == BODY_AUTO:
        body = "imu" if all("T_cam_imu" in data[k] for k in keys) else "cam0"
    if body != "imu" and body not in keys:
        raise ConfigError(source, "--body", f"{body} is not a camera of the chain ({', '.join(keys)})")
    if options.ego_from_body is None and body != "imu":
        raise ConfigError(
            source,
            "--ego-from-body",
            f"required with --body {body}: the ego frame is x forward, y left, z up and a camera frame x right, y down, "
            "z forward; give the 4x4 that places the body frame in the ego frame",
        )
    ego_from_body: Matrix4 = [list(r) for r in options.ego_from_body] if options.ego_from_body is not None else IDENTITY
    if body == "imu":
        body_from_cams = []
        for key in keys:
            if "T_cam_imu" not in data[key]:
                raise ctx.fail(f"{key}.T_cam_imu", "missing (needed for --body imu); or choose --body cam0 with --ego-from-body")
            body_from_cams.append(invert(rigid_matrix(ctx, data[key]["T_cam_imu"], f"{key}.T_cam_imu")))
    else:
        cn_from_c0: list[Matrix4] = [IDENTITY]
        if "T_cn_cnm1" in data[keys[0]]:
            raise ctx.fail(f"{keys[0]}.T_cn_cnm1", "cam0 is the base of the chain and has no T_cn_cnm1")
        for key in keys[1:]:
            if "T_cn_cnm1" not in data[key]:
                raise ctx.fail(f"{key}.T_cn_cnm1", f"missing (needed for --body {body}); or choose --body imu")
            cn_from_c0.append(compose(rigid_matrix(ctx, data[key]["T_cn_cnm1"], f"{key}.T_cn_cnm1"), cn_from_c0[-1]))
        body_from_c0 = cn_from_c0[keys.index(body)]
        body_from_cams = [compose(body_from_c0, invert(t)) for t in cn_from_c0]
    for camera, body_from_cam in zip(cameras, body_from_cams, strict=True):
        camera.update(pose_fields(compose(ego_from_body, body_from_cam)))
    description = f"Kalibr camchain {Path(source).name}: {len(keys)} camera(s), body frame {body}" + (
        "" if options.ego_from_body is None else " placed in ego by --ego-from-body"
    )
    return rig_data(template, name=name, cameras=cameras, description=description)


def import_kalibr(
    path: str | Path,
    *,
    template: Mapping[str, Any] | None = None,
    name: str = "kalibr",
    options: KalibrOptions = KalibrOptions(),
) -> dict[str, Any]:
    """Read ``camchain.yaml`` and return rig config data (template: :func:`template_data`)."""
    data = read_config_data(path, what="a Kalibr camchain")
    return kalibr_rig(data, source=str(path), template=template if template is not None else template_data(None), name=name, options=options)


def split_names(text: str | Sequence[str] | None) -> tuple[str, ...]:
    """``--names a,b,c`` (or a list) -> names."""
    if text is None:
        return ()
    items = text.split(",") if isinstance(text, str) else list(text)
    return tuple(str(i).strip() for i in items if str(i).strip())
