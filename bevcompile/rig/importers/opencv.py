"""One camera's OpenCV calibration (``cv2.FileStorage`` YAML) -> merged into a rig's config data.

Keys read (OpenCV's calibration sample ``samples/cpp/calibration.cpp`` and ROS ``camera_info``
names): ``camera_matrix`` 3x3, ``distortion_coefficients`` (4, 5, 8, 12 or 14 numbers, OpenCV
order ``k1 k2 p1 p2 [k3 [k4 k5 k6 [s1 s2 s3 s4 [tx ty]]]]``; the thin-prism and tilt terms must
be 0: bevcompile's model stops at k6), optional ``distortion_model`` (``plumb_bob`` /
``rational_polynomial`` = OpenCV's, ``equidistant`` / ``fisheye`` = ``cv2.fisheye``'s k1..k4),
``image_width`` / ``image_height``, and the extrinsics: ``R`` (3x3, or a Rodrigues rotation vector)
with ``T`` (3 numbers), or ``rvec`` / ``tvec``, in OpenCV's convention ego -> camera
(``p_cam = R p_ego + T``, as ``cv2.solvePnP`` / ``cv2.projectPoints`` use them; ``--extrinsics
cam-to-ego`` reads them the other way), or a 4x4 ``cam_from_ego`` or ``ego_from_cam``. Matrices
are ``!!opencv-matrix`` (``rows``, ``cols``, ``dt``, ``data`` row-major), ``!!opencv-nd-matrix``
(``sizes``, ``data``) or plain nested lists.

The file replaces exactly what it holds in the rig's camera of the same name (intrinsics,
distortion, image size, pose; the rest of the camera entry is kept), or adds the camera (then
``camera_matrix``, the image size and a pose are required). Numbers are copied exactly, except
a pose that must be inverted or a rotation vector (float64, written as ``sensor2ego``).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ...errors import ConfigError, shown
from ..config import _Ctx, _integer, _list, _mapping, _number, _string, read_config_data, read_opencv_yaml
from ._common import Matrix4, check_name, invert, pose_fields, rigid_matrix

EXTRINSICS = ("ego-to-cam", "cam-to-ego")
LENSES = ("auto", "opencv", "fisheye")
FISHEYE_MODELS = ("equidistant", "fisheye", "kannala_brandt")
OPENCV_MODELS = ("plumb_bob", "rational_polynomial", "radtan", "opencv")
MAX_RVEC_ANGLE = 1000.0
"""Largest rotation-vector angle read (radians; OpenCV writes ``[0, pi]``): beyond it ``cos`` and
``sin`` of the angle carry no precision, and ``1e308`` would overflow the norm."""
KEYS = (
    "camera_matrix", "distortion_coefficients", "distortion_model", "image_width", "image_height",
    "R", "T", "rvec", "tvec", "cam_from_ego", "ego_from_cam",
)


def opencv_matrix(ctx: _Ctx, value: Any, field: str) -> list[list[float]]:
    """Rows of a matrix node: ``{rows, cols, dt, data}``, ``{sizes, dt, data}`` or nested lists
    (a flat list or an nd-matrix is one column)."""
    if isinstance(value, Mapping):
        data = _list(ctx, value.get("data"), f"{field}.data")
        numbers = [_number(ctx, v, f"{field}.data[{i}]") for i, v in enumerate(data)]
        if "rows" in value or "cols" in value:
            rows = _integer(ctx, value.get("rows"), f"{field}.rows")
            cols = _integer(ctx, value.get("cols"), f"{field}.cols")
        else:
            sizes = [_integer(ctx, v, f"{field}.sizes[{i}]") for i, v in enumerate(_list(ctx, value.get("sizes"), f"{field}.sizes"))]
            rows, cols = [*sizes, 1][:2] if sizes else (0, 0)
        if rows < 1 or cols < 1 or rows * cols != len(numbers):
            raise ctx.fail(f"{field}.data", f"holds {len(numbers)} values for a {rows}x{cols} matrix")
        return [numbers[r * cols : (r + 1) * cols] for r in range(rows)]
    items = _list(ctx, value, field)
    if items and all(isinstance(row, list | tuple) for row in items):
        return [[_number(ctx, v, f"{field}[{r}][{c}]") for c, v in enumerate(row)] for r, row in enumerate(items)]
    return [[_number(ctx, v, f"{field}[{i}]")] for i, v in enumerate(items)]


def _flat(rows: list[list[float]]) -> list[float]:
    return [v for row in rows for v in row]


def rodrigues(rvec: list[float]) -> list[list[float]]:
    """Rotation matrix of a rotation vector (``cv2.Rodrigues``): ``theta = |r|``, ``k = r / theta``,
    ``R = cos(theta) I + (1 - cos(theta)) k k^T + sin(theta) [k]_x``."""
    theta = math.sqrt(math.fsum(v * v for v in rvec))
    if theta == 0.0:
        return [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]
    kx, ky, kz = (v / theta for v in rvec)
    c, s = math.cos(theta), math.sin(theta)
    v = 1.0 - c
    return [
        [c + kx * kx * v, kx * ky * v - kz * s, kx * kz * v + ky * s],
        [ky * kx * v + kz * s, c + ky * ky * v, ky * kz * v - kx * s],
        [kz * kx * v - ky * s, kz * ky * v + kx * s, c + kz * kz * v],
    ]


def _rotation(ctx: _Ctx, value: Any, field: str) -> list[list[float]]:
    rows = opencv_matrix(ctx, value, field)
    shape = (len(rows), len(rows[0]) if rows else 0)
    if shape == (3, 3):
        return rows
    if shape in ((3, 1), (1, 3)):
        rvec = _flat(rows)
        angle = math.hypot(*rvec)  # no overflow, unlike sqrt(sum of squares): 1e308 stays finite
        if not angle <= MAX_RVEC_ANGLE:
            raise ctx.fail(field, f"a rotation vector of {angle:g} rad: expected at most {MAX_RVEC_ANGLE:g} (cv2.Rodrigues gives angles in [0, pi])")
        return rodrigues(rvec)
    raise ctx.fail(field, f"expected a 3x3 rotation matrix or a 3-vector (Rodrigues), got {shape[0]}x{shape[1]}")


def _pose(ctx: _Ctx, data: Mapping[str, Any], extrinsics: str) -> Matrix4 | None:
    """``ego_from_cam`` of the file, None when it holds no extrinsics."""
    given = [k for k in ("R", "T", "rvec", "tvec", "cam_from_ego", "ego_from_cam") if k in data]
    if not given:
        return None
    for key in ("cam_from_ego", "ego_from_cam"):
        if key in data:
            others = [k for k in given if k != key]
            if others:
                raise ctx.fail(others[0], f"give the pose once: {key} is set too")
            matrix = rigid_matrix(ctx, opencv_matrix(ctx, data[key], key), key)
            return matrix if key == "ego_from_cam" else invert(matrix)
    rot_key = "R" if "R" in data else "rvec" if "rvec" in data else None
    trans_key = "T" if "T" in data else "tvec" if "tvec" in data else None
    if ("R" in data and "rvec" in data) or ("T" in data and "tvec" in data):
        raise ctx.fail("rvec" if "rvec" in data else "tvec", "give the rotation once (R or rvec) and the translation once (T or tvec)")
    if rot_key is None or trans_key is None:
        missing = "R" if rot_key is None else "T"
        raise ctx.fail(missing, f"missing: the extrinsics need a rotation (R or rvec) and a translation (T or tvec); {given[0]} is given")
    rotation = _rotation(ctx, data[rot_key], rot_key)
    translation = _flat(opencv_matrix(ctx, data[trans_key], trans_key))
    if len(translation) != 3:
        raise ctx.fail(trans_key, f"expected 3 values, got {len(translation)}")
    matrix = rigid_matrix(ctx, [[*rotation[i], translation[i]] for i in range(3)] + [[0.0, 0.0, 0.0, 1.0]], rot_key)
    return invert(matrix) if extrinsics == "ego-to-cam" else matrix


def _distortion(ctx: _Ctx, data: Mapping[str, Any], lens: str) -> dict[str, Any]:
    coeffs = _flat(opencv_matrix(ctx, data["distortion_coefficients"], "distortion_coefficients"))
    if lens == "auto":
        model = data.get("distortion_model")
        if model is not None:
            model = _string(ctx, model, "distortion_model").lower()
            if model not in FISHEYE_MODELS + OPENCV_MODELS:
                raise ctx.fail("distortion_model", f"unknown model {shown(model)} (plumb_bob, rational_polynomial, equidistant, fisheye)")
        lens = "fisheye" if model in FISHEYE_MODELS else "opencv"
    if lens == "fisheye":
        if len(coeffs) != 4:
            raise ctx.fail("distortion_coefficients", f"a fisheye (equidistant) lens has 4 coefficients k1..k4, got {len(coeffs)}")
        return {"model": "fisheye", "coeffs": coeffs}
    if len(coeffs) not in (4, 5, 8, 12, 14):
        raise ctx.fail("distortion_coefficients", f"expected 4, 5, 8, 12 or 14 coefficients (OpenCV order), got {len(coeffs)}")
    if len(coeffs) > 8:
        extra = [i for i in range(8, len(coeffs)) if coeffs[i] != 0.0]
        if extra:
            raise ctx.fail(
                f"distortion_coefficients[{extra[0]}]",
                f"thin-prism / tilt terms (s1..s4, tx, ty) must be 0, got {coeffs[extra[0]]!r}: bevcompile's lens model ends at k6",
            )
        coeffs = coeffs[:8]
    return {"model": "opencv", "coeffs": coeffs}


def opencv_camera(data: Any, *, source: str, extrinsics: str = "ego-to-cam", lens: str = "auto") -> dict[str, Any]:
    """The camera fields an OpenCV calibration file holds (any of ``intrinsic``, ``distortion``,
    ``image_size``, ``sensor2ego``). ConfigError ``<source>: <key>: ...``."""
    ctx = _Ctx(source)
    if extrinsics not in EXTRINSICS:
        raise ConfigError(source, "--extrinsics", f"must be one of {', '.join(EXTRINSICS)}, got {shown(extrinsics)}")
    if lens not in LENSES:
        raise ConfigError(source, "--lens", f"must be one of {', '.join(LENSES)}, got {shown(lens)}")
    data = _mapping(ctx, data, "")
    if not any(k in data for k in KEYS):
        raise ctx.fail("", f"holds no camera calibration (none of {', '.join(KEYS)})")
    fields: dict[str, Any] = {}
    if "camera_matrix" in data:
        k = opencv_matrix(ctx, data["camera_matrix"], "camera_matrix")
        if len(k) != 3 or any(len(row) != 3 for row in k):
            raise ctx.fail("camera_matrix", f"expected a 3x3 matrix, got {len(k)}x{len(k[0]) if k else 0}")
        fields["intrinsic"] = k
    if "distortion_coefficients" in data:
        fields["distortion"] = _distortion(ctx, data, lens)
    elif "distortion_model" in data:
        raise ctx.fail("distortion_model", "given without distortion_coefficients")
    if ("image_width" in data) != ("image_height" in data):
        raise ctx.fail("image_height" if "image_width" in data else "image_width", "missing (the image size needs image_width and image_height)")
    if "image_width" in data:
        fields["image_size"] = [_integer(ctx, data["image_width"], "image_width"), _integer(ctx, data["image_height"], "image_height")]
    pose = _pose(ctx, data, extrinsics)
    if pose is not None:
        fields.update(pose_fields(pose))
    return fields


def merge_camera(rig: Mapping[str, Any], camera: str, fields: Mapping[str, Any], *, source: str, base_source: str) -> dict[str, Any]:
    """``rig`` (plain config data) with ``camera`` updated by ``fields`` (or added)."""
    out = copy.deepcopy(dict(rig))
    base_ctx = _Ctx(base_source)
    cameras = [dict(c) for c in _list(base_ctx, out.get("cameras", []), "cameras")]
    names = [c.get("name") for c in cameras]
    entry: dict[str, Any]
    if camera in names:
        index = names.index(camera)
        entry = cameras[index]
    else:
        missing = [k for k, f in (("camera_matrix", "intrinsic"), ("image_width", "image_size"), ("R", "sensor2ego")) if f not in fields]
        if missing:
            raise ConfigError(
                source, missing[0], f"missing: camera {shown(camera)} is not in {base_source} ({', '.join(map(str, names))}), so the file must give all of it"
            )
        index = len(cameras)
        entry = {"name": camera}
        cameras.append(entry)
    if "sensor2ego" in fields:
        for key in ("rotation_wxyz", "translation", "sensor2ego"):
            entry.pop(key, None)
    entry.update(copy.deepcopy(dict(fields)))
    entry["description"] = f"OpenCV calibration {Path(source).name}"
    ordered: dict[str, Any] = {k: entry[k] for k in ("name", "description", "image_size", "intrinsic", "distortion", "rotation_wxyz", "translation", "sensor2ego", "image_aug") if k in entry}
    ordered.update({k: v for k, v in entry.items() if k not in ordered})
    cameras[index] = ordered
    out["cameras"] = cameras
    return out


def import_opencv(
    path: str | Path,
    *,
    rig: str | Path | None,
    camera: str,
    name: str | None = None,
    extrinsics: str = "ego-to-cam",
    lens: str = "auto",
) -> dict[str, Any]:
    """Read ``path`` and merge its camera into the rig config ``rig`` (None: the bundled rig)."""
    from ..config import default_config_path

    base = Path(rig) if rig is not None else default_config_path()
    base_source = str(rig) if rig is not None else "<bundled nuscenes.yaml>"
    fields = opencv_camera(read_opencv_yaml(path), source=str(path), extrinsics=extrinsics, lens=lens)
    data = read_config_data(base)
    merged = merge_camera(_mapping(_Ctx(base_source), data, ""), camera, fields, source=str(path), base_source=base_source)
    if name is not None:
        merged["name"] = check_name(name, str(path))
    return merged
