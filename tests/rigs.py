"""Small, fast rigs for tests (shared by every test module).

``small_rig_data(...)`` returns plain config data (as YAML would give) for a 4-camera rig
looking front/left/back/right from 1.5 m, with a small feature map and BEV grid so that
exhaustive references stay fast. Options add lens distortion, several heights, the
linspace pixel mapping or a BEV grid larger than what the cameras see (partial coverage).
"""

from __future__ import annotations

import copy
import hashlib
import os
from pathlib import Path
from typing import Any

import yaml

from bevcompile.rig.config import RigConfig, load_config, parse_config

ROOT = Path(__file__).resolve().parents[1]
NUSCENES_YAML = ROOT / "configs" / "nuscenes.yaml"
DISTORTED_YAML = ROOT / "configs" / "nuscenes_scene0061_distorted.yaml"

# camera -> ego rotations (columns = camera x, y, z axes in ego) for yaw 0, 90, 180, 270 deg
_FORWARD = [[0.0, 0.0, 1.0], [-1.0, 0.0, 0.0], [0.0, -1.0, 0.0]]  # cam z -> ego +x, cam x -> ego -y


def _yawed(yaw_quarter_turns: int) -> list[list[float]]:
    import numpy as np

    c, s = [(1, 0), (0, 1), (-1, 0), (0, -1)][yaw_quarter_turns % 4]
    yaw = np.array([[c, -s, 0], [s, c, 0], [0, 0, 1]], dtype=float)
    return (yaw @ np.array(_FORWARD)).tolist()


def small_rig_data(
    *,
    distortion: bool = False,
    heights: tuple[float, ...] = (0.0,),
    pixel_mapping: str = "stride",
    bev_half_m: float = 12.0,
    bev_step_m: float = 1.0,
    n_cam: int = 4,
    depth_bins: tuple[float, float, float] = (1.0, 17.0, 2.0),
) -> dict[str, Any]:
    """4 cameras (front, left, back, right) at 1.5 m, pitched 10 deg down; 96x64 input, stride 8
    -> 12x8 feature map; BEV [-bev_half_m, bev_half_m] at bev_step_m."""
    import math

    import numpy as np

    pitch = math.radians(10.0)
    # pitch down about the camera x axis: rotate camera frame by +pitch around its x axis
    pitch_cam = np.array(
        [[1, 0, 0], [0, math.cos(pitch), -math.sin(pitch)], [0, math.sin(pitch), math.cos(pitch)]], dtype=float
    )
    names = ["FRONT", "LEFT", "BACK", "RIGHT"][:n_cam]
    positions = [[1.5, 0.0, 1.5], [0.5, 0.8, 1.5], [-0.5, 0.0, 1.5], [0.5, -0.8, 1.5]]
    lens = [
        {"model": "opencv", "coeffs": [-0.2, 0.05, 0.001, -0.0005, -0.005]},
        {"model": "fisheye", "coeffs": [0.05, -0.02, 0.004, -0.0008]},
        {"model": "opencv", "coeffs": [0.1, -0.02, 0.0005, 0.0005, 0.002, 0.15, -0.01, 0.003]},
        {"model": "opencv", "coeffs": [-0.15, 0.03, 0.0, 0.0]},
    ]
    cameras = []
    for i, name in enumerate(names):
        rotation = (np.array(_yawed(i)) @ pitch_cam.T).tolist()
        sensor2ego = [rotation[r] + [positions[i][r]] for r in range(3)] + [[0.0, 0.0, 0.0, 1.0]]
        cameras.append(
            {
                "name": name,
                "image_size": [192, 128],
                "intrinsic": [[110.0, 0.0, 95.5], [0.0, 110.0, 63.5], [0.0, 0.0, 1.0]],
                "distortion": lens[i] if distortion else {"model": "none"},
                "sensor2ego": sensor2ego,
            }
        )
    return {
        "name": "small",
        "cameras": cameras,
        "image_aug": {"resize": 0.5, "crop": [0, 0], "input_size": [96, 64]},
        "feature": {"stride": 8, "pixel_mapping": pixel_mapping},
        "bev": {
            "x": [-bev_half_m, bev_half_m, bev_step_m],
            "y": [-bev_half_m, bev_half_m, bev_step_m],
            "z": [-3.0, 5.0],
            "heights": list(heights),
        },
        "depth": {"bins": list(depth_bins)},
    }


def small_rig(**kwargs: Any) -> RigConfig:
    return parse_config(small_rig_data(**kwargs), source="<small rig>")


def nuscenes_data() -> dict[str, Any]:
    return copy.deepcopy(yaml.safe_load(NUSCENES_YAML.read_text()))


def nuscenes_rig() -> RigConfig:
    return load_config(NUSCENES_YAML)


def distorted_rig() -> RigConfig:
    return load_config(DISTORTED_YAML)


SMALL_TOP_SENSOR = {
    "name": "LIDAR_TOP",
    # yaw -90 deg (sensor x -> ego -y, sensor y -> ego +x), 1.9 m up, 0.4 m ahead, 0.1 m left
    "sensor2ego": [[0.0, 1.0, 0.0, 0.4], [-1.0, 0.0, 0.0, 0.1], [0.0, 0.0, 1.0, 1.9], [0.0, 0.0, 0.0, 1.0]],
}


def small_rig_with_sensor_data(**kwargs: Any) -> dict[str, Any]:
    """:func:`small_rig_data` plus a yawed ``LIDAR_TOP`` sensor (frame still ego)."""
    data = small_rig_data(**kwargs)
    data["sensors"] = [copy.deepcopy(SMALL_TOP_SENSOR)]
    return data


def in_lidar_frame(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` (a config listing LIDAR_TOP) with ``bev.frame: LIDAR_TOP`` and its own name."""
    out = copy.deepcopy(data)
    out["bev"]["frame"] = "LIDAR_TOP"
    out["name"] = f"{out['name']}-lidar"
    return out


def _pose(entry: dict[str, Any]) -> Any:
    import numpy as np

    from bevcompile.rig.config import rotation_from_quaternion_wxyz

    if "sensor2ego" in entry:
        return np.array(entry["sensor2ego"], dtype=np.float64)
    m = np.eye(4)
    m[:3, :3] = rotation_from_quaternion_wxyz(entry["rotation_wxyz"])
    m[:3, 3] = entry["translation"]
    return m


def lidar_from_cam_numpy(data: dict[str, Any], cam_index: int) -> Any:
    """Independent cam -> LIDAR_TOP 4x4: ``inv(lidar2ego) @ cam2ego`` with numpy's matmul and
    ``linalg.inv`` (the product as mmdet3d's infos hold it for one static pose)."""
    import numpy as np

    lidar = next(s for s in data["sensors"] if s["name"] == "LIDAR_TOP")
    return np.linalg.inv(_pose(lidar)) @ _pose(data["cameras"][cam_index])


def lidar_poses_as_ego(data: dict[str, Any]) -> dict[str, Any]:
    """The same rig with every camera given ``sensor2ego`` = its cam -> LIDAR_TOP matrix and the
    ego frame: what a user had to hand-make before ``bev.frame`` (same geometry, other numbers)."""
    out = copy.deepcopy(data)
    for i, cam in enumerate(out["cameras"]):
        matrix = lidar_from_cam_numpy(data, i)
        for key in ("rotation_wxyz", "translation"):
            cam.pop(key, None)
        cam["sensor2ego"] = [[float(v) for v in row] for row in matrix[:3]] + [[0.0, 0.0, 0.0, 1.0]]
    out.pop("sensors", None)
    out["bev"].pop("frame", None)
    out["name"] = f"{data['name']}-handmade"
    return out


def write_yaml(path: Path, data: Any) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def tree_digest(path: Path) -> dict[str, str]:
    """SHA-256 of every file below ``path`` (relative path -> hex): byte-identity of stores."""
    out = {}
    for root, _dirs, files in os.walk(path):
        for name in files:
            full = Path(root) / name
            out[str(full.relative_to(path))] = hashlib.sha256(full.read_bytes()).hexdigest()
    return out


def group_data(arrays: dict[str, Any], attrs: dict[str, Any] | None = None) -> Any:
    """A ``GroupData`` for an ad-hoc test group: every axis named ``<array>_<axis>`` (the writer
    requires dimension names on every array)."""
    import numpy as np

    from bevcompile.store.zarr_io import GroupData

    dims = {name: tuple(f"{name}_{axis}" for axis in range(np.ndim(a))) for name, a in arrays.items()}
    return GroupData(arrays, dict(attrs or {}), dims=dims)


RING_YAWS_DEG = (0.0, -55.0, 55.0, 180.0, 110.0, -110.0)


def ring_rig_data(*, yaws_deg: tuple[float, ...] = RING_YAWS_DEG, radius_m: float = 1.0, stride: int = 4) -> dict[str, Any]:
    """A regular, tie-heavy rig (the small version of ``configs/ring-6cam.yaml``): identical level
    pinhole cameras on a ring ``radius_m`` from the ego origin, 1.55 m up, looking outwards at the
    given yaws; 96x64 input, ``stride`` 4 -> 24x16 feature map; BEV +-12 m at 1 m, depth 1..17 m.

    Level cameras: a pixel column's rays share their ego x and y components bitwise (``R[0, 1] =
    R[1, 1] = 0``), so the points of its 16 pixels at one depth have the same BEV x/y and their
    matrix entries tie exactly on weight and distance (only the column breaks the tie)."""
    import math

    cameras = []
    for i, yaw in enumerate(yaws_deg):
        c, s = (1.0, 0.0) if yaw == 0 else (-1.0, 0.0) if yaw == 180 else (math.cos(math.radians(yaw)), math.sin(math.radians(yaw)))
        x, y = radius_m * c, radius_m * s
        sensor2ego = [[s, 0.0, c, x], [-c, 0.0, s, y], [0.0, -1.0, 0.0, 1.55], [0.0, 0.0, 0.0, 1.0]]
        cameras.append(
            {
                "name": f"CAM_{i}",
                "image_size": [192, 128],
                "intrinsic": [[110.0, 0.0, 95.3], [0.0, 110.0, 61.5], [0.0, 0.0, 1.0]],
                "sensor2ego": sensor2ego,
            }
        )
    return {
        "name": "ring",
        "cameras": cameras,
        "image_aug": {"resize": 0.5, "crop": [0, 0], "input_size": [96, 64]},
        "feature": {"stride": stride, "pixel_mapping": "stride"},
        "bev": {"x": [-12.0, 12.0, 1.0], "y": [-12.0, 12.0, 1.0], "z": [-3.0, 5.0], "heights": [0.0]},
        "depth": {"bins": [1.0, 17.0, 1.0]},
    }


def ring_rig(**kwargs: Any) -> RigConfig:
    return parse_config(ring_rig_data(**kwargs), source="<ring rig>")
