"""Rig configuration: the only module that reads YAML.

A rig config describes the calibrated cameras, the image augmentation that turns a
calibrated image into the network input, the feature-map stride, the BEV grid and the LSS
depth bins. :func:`load_config` reads a YAML file, :func:`parse_config` validates plain
data; both return a frozen :class:`RigConfig` or raise :class:`~bevcompile.errors.ConfigError`
whose message names the file, the field path (``cameras[2].rotation_wxyz``) and the problem.

:func:`config_to_dict` gives the *resolved* config as plain data (every default filled in,
per-camera ``image_aug`` merged); it re-parses to an equal config, and
:func:`config_sha256` hashes its canonical JSON serialisation (free-text ``description``
fields excluded, so editing a comment does not invalidate a store).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from ..errors import ConfigError, shown
from ..files import (
    DIRECTORY,
    MISSING,
    SPECIAL,
    TOO_LARGE,
    UNREADABLE,
    FileRefused,
    check_output_path,
    read_regular,
    replace_file,
)
from .presets import PRESETS, AugRule, Preset

BEV_FRAME_EGO = "ego"
"""``bev.frame`` default: the BEV grid is in the ego frame."""
MAX_BEV_CELLS = 10**8
MAX_DEPTH_BINS = 4096
MAX_CONFIG_INT = 2**31 - 1
QUATERNION_TOLERANCE = 1e-6
ROTATION_TOLERANCE = 1e-6
AXIS_STEP_TOLERANCE = 1e-6
"""``bev.x``/``y``/``z``: ``(max - min) / step`` must be within this many steps of a whole number."""
DEFAULT_CONFIG_NAME = "nuscenes.yaml"
DISTORTION_MODELS = ("none", "opencv", "fisheye")
PIXEL_MAPPINGS = ("stride", "linspace", "corner", "normalized")
"""``feature.pixel_mapping``: where feature pixel ``j`` sits on the network input (README
"Conventions"): ``stride`` ``j*s + (s-1)/2`` (the centre of its ``s`` input pixels);
``linspace`` ``j*(W_in-1)/(W_f-1)`` (BEVDet's frustum); ``corner`` ``j*s`` (intrinsics divided
by the stride: Fast-BEV, M2BEV); ``normalized`` ``j*s + s/2`` (input pixels normalised by the
input size, then ``grid_sample(align_corners=False)``: BEVFormer, DETR3D, PETR)."""
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
"""The rig name (a file name: ``<name>.zarr``), matched whole (``re.fullmatch``: ``"x\n"`` is refused)."""
MAX_NAME_CHARS = 128
"""Longest rig name: the writer's temporary ``.<name>.zarr.tmp-<pid>-<host>-<8 hex>`` must fit
the 255-byte file names of every common file system, whatever the host name."""
MAX_CAMERA_NAME_CHARS = 64
"""Longest camera name (shown in tables and recorded in attributes)."""
MAX_CAMERA_DISTANCE_M = 100.0
"""Pose plausibility: a camera's centre lies within this many metres of the ego origin (a car,
a truck with its trailer); a translation beyond it is a unit or sign error (millimetres, a pose
given world -> camera), refused rather than compiled into a grid no camera sees."""
MAX_RESIZE = 16.0
"""``image_aug.resize`` lies in ``(0, 16]`` (BEVDet resizes by 0.3 to 1; a model that upsamples
by more than 16 is a typo)."""
MAX_IMAGE_SIDE = 32768
"""``image_size`` and ``input_size`` sides are at most this many pixels."""
MIN_FOCAL_PX = 1.0
MAX_FOCAL_PX = 1e6
"""``fx`` and ``fy`` in [1, 10^6] pixels: under a pixel every pixel sees more than a radian, over a
million (a 3 m lens on 3 um pixels) the rays are parallel to float precision; outside, the
geometry overflows (``fy = 5e-324`` divides to infinity)."""
PRINCIPAL_POINT_MARGIN = 4
"""``cx`` in ``[-4 W, 5 W]`` and ``cy`` in ``[-4 H, 5 H]``: within four image sizes of the image (a
crop can move it off the image, never far)."""
MAX_DISTORTION_COEFF = 1e4
"""``|k|`` of every distortion coefficient at most 10^4 (real calibrations stay within a few hundred)."""
MAX_EXTENT_M = 10_000.0
"""BEV bounds (``bev.x``, ``bev.y``, ``bev.z``), sampling heights and depth bins within 10 km: a
BEV grid covers what the cameras see, not the planet."""
_PLAIN_NUMBER = re.compile(r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?")
"""A number given as a string (JSON data, or ``1e-3``, which PyYAML leaves a string): plain ASCII
decimal only (YAML 1.2 core schema), so ``"1_000.5"``, ``"١.٧٢٢"``, ``"１.５"``, ``" 1"`` are refused."""
INTEROP_CHOICES: dict[str, dict[str, tuple[str, ...]]] = {
    "bevpoolv2": {"frustum_mapping": ("linspace", "stride", "rig"), "rounding": ("trunc", "floor"), "precision": ("float64", "float32"), "order": ("stable", "torch")},
    "fastbev-lut": {"overlap": ("first", "last", "nearest-centre"), "precision": ("float64", "float32")},
    "petr-coords3d": {"precision": ("float64", "float32")},
}
"""``interop:`` settings a config (or a model preset) may fix, per ``export-interop`` target, with
their allowed values (the interop package validates its options against these);
``bevpoolv2`` also takes ``z_bins`` (1 to 4096) and ``batch`` (1 to 256); ``fastbev-lut``
``xyz_layout`` (true/false); ``petr-coords3d`` ``depth_num`` (1 to 1024), ``lid`` (true/false),
``depth_start`` (metres, > 0) and ``position_range`` (six numbers, min x y z then max x y z)."""
INTEROP_INT_OPTIONS: dict[str, dict[str, tuple[int, int]]] = {
    "bevpoolv2": {"z_bins": (1, 4096), "batch": (1, 256)},
    "petr-coords3d": {"depth_num": (1, 1024)},
}
INTEROP_BOOL_OPTIONS: dict[str, tuple[str, ...]] = {"fastbev-lut": ("xyz_layout",), "petr-coords3d": ("lid",)}
INTEROP_NUMBER_OPTIONS: dict[str, dict[str, int]] = {"petr-coords3d": {"depth_start": 1, "position_range": 6}}
"""Numeric ``interop:`` settings: option -> how many numbers (1: a number, else a list of that length)."""
SIZE_RULES = ("exact", "ceil")
"""``feature.size_rule``: how a level's feature map follows from the network input:
``exact`` ``W_f = W_in / s`` (the input must be divisible by every stride); ``ceil``
``W_f = ceil(W_in / s)`` (strided convolutions with padding, e.g. a stride-64 FPN level of a
928-row input has 15 rows)."""
MAX_FEATURE_LEVELS = 8
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


# --------------------------------------------------------------------------------------
# dataclasses
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Distortion:
    """Lens model. ``model`` is ``none``, ``opencv`` (k1 k2 p1 p2 [k3 [k4 k5 k6]], OpenCV
    order, always stored padded to 8) or ``fisheye`` (k1 k2 k3 k4, OpenCV fisheye)."""

    model: str
    coeffs: tuple[float, ...]
    n_coeffs_given: int


@dataclass(frozen=True)
class ImageAug:
    """Calibrated image -> network input (BEVDet ``post_rot``/``post_tran``).

    Convention: input pixel ``u_in = u_image * resize - crop_left`` and
    ``v_in = v_image * resize - crop_top`` (pixel centres at integers). The network input is
    ``input_width x input_height``; its last ``pad_right`` columns and ``pad_bottom`` rows are
    zero padding appended after the crop (mmdet's ``PadMultiViewImage``), so the crop window is
    ``(input_width - pad_right) x (input_height - pad_bottom)`` and pixel coordinates are
    unchanged by the padding. ``flip``: the crop is mirrored left-right before the network, as
    Fast-BEV's ``img_transform`` states it: ``u_in = W_crop - (u_image * resize - crop_left)``,
    ``W_crop = input_width - pad_right`` (one input pixel right of the exact mirror
    ``W_crop - 1 - u``, as the model computes it); ``v_in`` unchanged.
    """

    resize: float
    crop_left: float
    crop_top: float
    input_width: int
    input_height: int
    pad_right: int = 0
    pad_bottom: int = 0
    flip: bool = False

    @property
    def crop_width(self) -> int:
        """``W_crop = input_width - pad_right``: the width the flip mirrors."""
        return self.input_width - self.pad_right


@dataclass(frozen=True)
class Camera:
    """One calibrated camera.

    ``ego_from_cam`` is the 4x4 rigid transform camera -> ego (row-major nested tuples):
    ``points_ego = R @ points_cam + t``. The camera frame is OpenCV's (x right, y down,
    z along the optical axis).
    """

    name: str
    image_width: int
    image_height: int
    intrinsic: tuple[tuple[float, float, float], ...]
    distortion: Distortion
    ego_from_cam: tuple[tuple[float, float, float, float], ...]
    image_aug: ImageAug
    pose_form: str  # "quaternion" or "matrix": how the pose was given (kept for round-trips)
    rotation_wxyz: tuple[float, float, float, float] | None
    translation: tuple[float, float, float] | None
    image_aug_override: tuple[tuple[str, Any], ...]
    description: str | None = None

    @property
    def fx(self) -> float:
        return self.intrinsic[0][0]

    @property
    def fy(self) -> float:
        return self.intrinsic[1][1]

    @property
    def cx(self) -> float:
        return self.intrinsic[0][2]

    @property
    def cy(self) -> float:
        return self.intrinsic[1][2]


@dataclass(frozen=True)
class Sensor:
    """A non-camera sensor of the rig (e.g. ``LIDAR_TOP``): a name and a pose, nothing else.

    ``ego_from_sensor`` is the 4x4 rigid transform sensor -> ego (row-major nested tuples):
    ``points_ego = R @ points_sensor + t``, given like a camera's pose (``rotation_wxyz`` +
    ``translation``, or ``sensor2ego``). A sensor may name the BEV frame (``bev.frame``).
    """

    name: str
    ego_from_sensor: tuple[tuple[float, float, float, float], ...]
    pose_form: str  # "quaternion" or "matrix": how the pose was given (kept for round-trips)
    rotation_wxyz: tuple[float, float, float, float] | None
    translation: tuple[float, float, float] | None
    description: str | None = None


@dataclass(frozen=True)
class FeatureLevel:
    """One feature map the network produces: its ``stride`` and ``pixel_mapping``, and ``bev``:
    the BEV grid of this level when the config gives it one (``feature.levels[l].bev``, levels 1
    and up: Fast-BEV's v3/v4 sample a coarser voxel grid per FPN level), else None (the level
    samples ``bev:``)."""

    stride: int
    pixel_mapping: str
    bev: BevSpec | None = None


def feature_map_size(input_size: int, stride: int, size_rule: str) -> int:
    """Feature-map length of an input length under ``size_rule`` (``exact``: ``n // s``,
    the config checked divisibility; ``ceil``: ``ceil(n / s)``)."""
    return -(-input_size // stride) if size_rule == "ceil" else input_size // stride


@dataclass(frozen=True)
class FeatureSpec:
    """Network input -> feature map(s). ``stride``/``pixel_mapping`` are level 0's (the only
    level unless ``levels`` lists more). ``stride``: feature pixel j covers input pixels
    ``[j*s, (j+1)*s)`` (centre at input ``j*s + (s-1)/2``); ``linspace``: feature pixel j sits
    at input ``j * (W_in - 1) / (W_f - 1)`` (BEVDet's frustum); ``corner``: at input ``j*s``;
    ``normalized``: at input ``(j + 1/2) W_in / W_f`` (``j*s + s/2`` when exact; see
    :data:`PIXEL_MAPPINGS`). ``size_rule``: :data:`SIZE_RULES`. ``levels``: every level
    (level 0 first) when the config lists ``feature.levels``, else empty."""

    stride: int
    pixel_mapping: str
    size_rule: str = "exact"
    levels: tuple[FeatureLevel, ...] = ()

    @property
    def all_levels(self) -> tuple[FeatureLevel, ...]:
        """Every feature level, level 0 first (one level unless ``feature.levels`` lists more)."""
        return self.levels or (FeatureLevel(self.stride, self.pixel_mapping),)


@dataclass(frozen=True)
class AxisSpec:
    """One BEV axis: ``[min, max, step]`` metres; ``n = round((max - min) / step)`` cells,
    cell i centred at ``min + (i + 0.5) * step``."""

    min: float
    max: float
    step: float
    n: int

    def centres(self) -> tuple[float, ...]:
        return tuple(self.min + (i + 0.5) * self.step for i in range(self.n))


@dataclass(frozen=True)
class RingSpec:
    """One distance band of ``bev.region.rings``: cells whose centre lies more than ``beyond_m``
    metres (Chebyshev, ``max(|x|, |y|)`` in the BEV frame) from the BEV frame's origin are merged
    into aligned super-cells of ``factor x factor`` fine cells (a power of two >= 2)."""

    beyond_m: float
    factor: int


@dataclass(frozen=True)
class RegionSpec:
    """``bev.region``: which BEV cells are computed, and at what resolution
    (:mod:`bevcompile.rig.region` derives the cell table and the ``expand`` index from it).

    ``polygons``: the ``keep`` polygons, ``(x, y)`` vertices in BEV-frame metres (a cell is kept
    iff its centre is inside one of them, even-odd rule); or ``mask``: the ``keep`` mask, row-major
    ``ny * nx`` bytes 0/1 (``[iy, ix]`` like every BEV array), read from ``mask_file`` (a ``.npy``
    or ``.png``, as given in the config), ``mask_sha256`` the SHA-256 of those bytes (the content,
    not the file: a ``.npy`` and a ``.png`` of the same cells hash alike). Neither: every cell is
    kept. ``rings``: the distance bands, ``beyond_m`` strictly increasing, factors strictly
    increasing.
    """

    polygons: tuple[tuple[tuple[float, float], ...], ...] | None = None
    mask: bytes | None = None
    mask_file: str | None = None
    mask_sha256: str | None = None
    rings: tuple[RingSpec, ...] = ()
    mask_shape: tuple[int, int] = (0, 0)

    @property
    def max_factor(self) -> int:
        return self.rings[-1].factor if self.rings else 1


@dataclass(frozen=True)
class BevSpec:
    """The BEV grid: ``x``, ``y`` cells, the ``z`` band and the sampling ``heights``, all in the
    frame ``frame`` names: ``"ego"`` (default) or the name of one of the rig's ``sensors``."""

    x: AxisSpec
    y: AxisSpec
    z: AxisSpec  # height band; a single bin unless a step is given
    heights: tuple[float, ...]
    frame: str = BEV_FRAME_EGO
    region: RegionSpec | None = None

    @property
    def nx(self) -> int:
        return self.x.n

    @property
    def ny(self) -> int:
        return self.y.n


@dataclass(frozen=True)
class DepthSpec:
    """LSS depth bins along the optical axis (camera z), ``arange(start, stop, step)``."""

    start: float
    stop: float
    step: float
    n_bins: int

    def values(self) -> tuple[float, ...]:
        return tuple(self.start + i * self.step for i in range(self.n_bins))


@dataclass(frozen=True)
class RigConfig:
    name: str
    cameras: tuple[Camera, ...]
    image_aug: Mapping[str, Any] | None  # the top-level (shared) augmentation, as given
    feature: FeatureSpec
    bev: BevSpec
    depth: DepthSpec
    description: str | None = None
    source: str = "<config>"
    sensors: tuple[Sensor, ...] = ()
    preset: str | None = None  # the model preset the config named (``preset:``), if any
    interop: tuple[tuple[str, tuple[tuple[str, Any], ...]], ...] = ()  # ``interop:`` per target, sorted

    def interop_options(self, target: str) -> dict[str, Any]:
        """The ``interop:`` settings of ``target`` (``bevpoolv2``, ``fastbev-lut``), as given (may be empty)."""
        return dict(dict(self.interop).get(target, ()))

    @property
    def interop_targets(self) -> tuple[str, ...]:
        """The targets ``interop:`` names (``export-interop`` builds them when no ``--to`` is given)."""
        return tuple(target for target, _ in self.interop)

    @property
    def n_cam(self) -> int:
        return len(self.cameras)

    def sensor(self, name: str) -> Sensor:
        """The sensor ``name`` of ``sensors`` (KeyError if there is none)."""
        for sensor in self.sensors:
            if sensor.name == name:
                return sensor
        raise KeyError(name)

    @property
    def bev_frame_sensor(self) -> Sensor | None:
        """The sensor whose frame the BEV grid is in, or None for the ego frame."""
        return None if self.bev.frame == BEV_FRAME_EGO else self.sensor(self.bev.frame)

    @property
    def input_size(self) -> tuple[int, int]:
        """``(width, height)`` of the network input (identical for every camera)."""
        aug = self.cameras[0].image_aug
        return aug.input_width, aug.input_height

    @property
    def feature_size(self) -> tuple[int, int]:
        """``(W_f, H_f)`` of the (level 0) feature map, by ``feature.size_rule``."""
        w_in, h_in = self.input_size
        s, rule = self.feature.stride, self.feature.size_rule
        return feature_map_size(w_in, s, rule), feature_map_size(h_in, s, rule)

    @property
    def n_levels(self) -> int:
        return len(self.feature.all_levels)

    def level(self, index: int) -> RigConfig:
        """This rig seen through feature level ``index`` alone (its stride, pixel mapping and
        feature map, and its own BEV grid when ``feature.levels[index].bev`` gives one; everything
        else unchanged): what every per-level product is built from. Level 0 of a single-level rig
        is the rig itself."""
        levels = self.feature.all_levels
        if not 0 <= index < len(levels):
            raise IndexError(f"feature level {index} of {len(levels)}")
        if len(levels) == 1:
            return self
        chosen = levels[index]
        return replace(
            self,
            feature=FeatureSpec(chosen.stride, chosen.pixel_mapping, self.feature.size_rule),
            bev=chosen.bev if chosen.bev is not None else self.bev,
        )

    @property
    def has_level_grids(self) -> bool:
        """Whether a feature level has its own BEV grid (``feature.levels[l].bev``)."""
        return any(level.bev is not None for level in self.feature.levels)

    @property
    def camera_names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.cameras)


# --------------------------------------------------------------------------------------
# YAML loading
# --------------------------------------------------------------------------------------


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate mapping keys (a silent override is a typo) and number
    spellings only YAML 1.1 knows (``1:30`` = 90, ``0b101``, ``017`` = 15, ``1_000``), which a
    YAML 1.2 reader (and a reader of the config) takes for something else. Merge keys
    (``<<: *anchor``) are supported; an explicit key overrides a merged one."""


_MERGE_TAG = "tag:yaml.org,2002:merge"
_YAML11_ONLY_INT = re.compile(
    r"^[-+]?(0b[0-1_]+|0[0-7_]+|[0-9][0-9_]*(:[0-5]?[0-9])+|[0-9][0-9_]*_[0-9_]*|0x[0-9a-fA-F_]*_[0-9a-fA-F_]*)$"
)
"""Plain integers PyYAML (YAML 1.1) reads unlike YAML 1.2: binary, leading-zero octal,
sexagesimal, digit groups with ``_`` (also in hexadecimal: ``0x_1``, ``0x1_0``)."""
_YAML11_ONLY_FLOAT = re.compile(r"^[-+]?[0-9][0-9_]*(:[0-5]?[0-9])+\.[0-9_]*$|^[-+]?[0-9.]*_[0-9._]*([eE][-+][0-9]+)?$")
"""Sexagesimal floats (``1:30.5``) and floats with ``_`` digit groups."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
    explicit = [key_node for key_node, _ in node.value if key_node.tag != _MERGE_TAG]
    loader.flatten_mapping(node)  # `<<: *anchor` (merged keys first, so explicit keys override them)
    seen: set[Any] = set()
    for key_node in explicit:
        key = loader.construct_object(key_node, deep=deep)
        try:
            duplicate = key in seen
        except TypeError:
            raise yaml.constructor.ConstructorError(None, None, "found unhashable key (a list or mapping as a key)", key_node.start_mark) from None
        if duplicate:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}", key_node.start_mark
            )
        seen.add(key)
    return dict(loader.construct_mapping(node, deep=deep))


def _refuse_yaml11_number(loader: _StrictLoader, node: yaml.ScalarNode, pattern: re.Pattern[str], kind: str) -> None:
    text = str(loader.construct_scalar(node))
    if node.style is None and pattern.match(text):
        value = (yaml.SafeLoader.construct_yaml_int if kind == "integer" else yaml.SafeLoader.construct_yaml_float)(loader, node)
        raise yaml.constructor.ConstructorError(
            None,
            None,
            f"{kind} {text!r} is a YAML 1.1-only spelling (read as {value!r}); write it in plain decimal",
            node.start_mark,
        )


def _scalar_problem(node: yaml.Node, exc: Exception) -> yaml.constructor.ConstructorError:
    """A constructor's ValueError/OverflowError (``!!int 16px``, a date ``2024-13-45``, an int of
    more than 4300 digits) as a YAML error with the scalar's position."""
    lines = str(exc).strip().splitlines()
    return yaml.constructor.ConstructorError(None, None, lines[0] if lines else exc.__class__.__name__, node.start_mark)


def _constructed(construct: Callable[[_StrictLoader, yaml.ScalarNode], Any], loader: _StrictLoader, node: yaml.ScalarNode) -> Any:
    """PyYAML's own scalar constructor, its ValueError/OverflowError made a positioned YAML error."""
    try:
        return construct(loader, node)
    except (ValueError, OverflowError) as exc:
        raise _scalar_problem(node, exc) from None


def _construct_int(loader: _StrictLoader, node: yaml.ScalarNode) -> int:
    _refuse_yaml11_number(loader, node, _YAML11_ONLY_INT, "integer")
    return int(_constructed(yaml.SafeLoader.construct_yaml_int, loader, node))


def _construct_float(loader: _StrictLoader, node: yaml.ScalarNode) -> float:
    _refuse_yaml11_number(loader, node, _YAML11_ONLY_FLOAT, "number")
    return float(_constructed(yaml.SafeLoader.construct_yaml_float, loader, node))


def _construct_timestamp(loader: _StrictLoader, node: yaml.ScalarNode) -> Any:
    return _constructed(yaml.SafeLoader.construct_yaml_timestamp, loader, node)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)
_StrictLoader.add_constructor("tag:yaml.org,2002:int", _construct_int)
_StrictLoader.add_constructor("tag:yaml.org,2002:float", _construct_float)
_StrictLoader.add_constructor("tag:yaml.org,2002:timestamp", _construct_timestamp)

MAX_CONFIG_BYTES = 1 << 20
"""A rig config is a few KiB (nuScenes: 3 KiB); a file over 1 MiB (or a device, FIFO) is refused
before it is read."""
MAX_YAML_DEPTH = 32
"""Nesting levels a config may have (it uses 5): deeper is refused while it is being read."""
MAX_YAML_NODES = 100_000
"""Values (scalars, lists, mappings) a config may hold once every alias is expanded (nuScenes:
about 400). Nested aliases (``&a [*b, *b, ...]``) are refused before they are expanded."""


class _Bounded(yaml.YAMLError):
    """A config over one of the YAML bounds (depth, values after alias expansion)."""

    def __init__(self, problem: str, mark: Any) -> None:
        super().__init__(problem)
        self.problem = problem
        self.problem_mark = mark


class _BoundedLoader(_StrictLoader):
    """:class:`_StrictLoader` that counts while it composes: at most :data:`MAX_YAML_DEPTH` levels
    and :data:`MAX_YAML_NODES` values, aliases counted at their expanded size (memoised, so a
    4 KB "billion laughs" costs microseconds, not gigabytes)."""

    def __init__(self, stream: Any) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        self._depth += 1
        try:
            if self._depth > MAX_YAML_DEPTH:
                raise _Bounded(f"nested more than {MAX_YAML_DEPTH} levels deep", self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def _expanded_size(root: yaml.Node) -> int:
    """Values of the composed document once every alias is expanded (iterative, memoised by
    node); :class:`_Bounded` beyond :data:`MAX_YAML_NODES` or for a recursive alias."""
    sizes: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        key = id(node)
        if done:
            on_path.discard(key)
            children = _children(node)
            size = 1 + sum(sizes[id(child)] for child in children)
            if size > MAX_YAML_NODES:
                raise _Bounded(f"holds more than {MAX_YAML_NODES:,} values once its aliases are expanded", node.start_mark)
            sizes[key] = size
            continue
        if key in sizes:
            continue
        if key in on_path:
            raise _Bounded("a recursive alias (an anchor used inside itself)", node.start_mark)
        on_path.add(key)
        stack.append((node, True))
        for child in _children(node):
            if id(child) in on_path:
                raise _Bounded("a recursive alias (an anchor used inside itself)", child.start_mark)
            if id(child) not in sizes:
                stack.append((child, False))
    return sizes[id(root)]


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [item for pair in node.value for item in pair]
    return []


def _load_yaml(text: str, loader_class: type[_BoundedLoader]) -> Any:
    """Compose with the bounds, check the expanded size, then construct (strict scalars)."""
    loader = loader_class(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _expanded_size(node)
        return loader.construct_document(node)
    finally:
        loader.dispose()


def default_config_path() -> Path:
    """Path of the bundled default rig (real nuScenes calibration, BEVDet-R50 settings)."""
    return Path(str(resources.files("bevcompile") / "data" / DEFAULT_CONFIG_NAME))


STDIN = "-"
"""The config path that means standard input (``bevcompile grid - < rig.yaml``)."""


def _read_stdin(what: str) -> bytes:
    import sys

    stream = getattr(sys.stdin, "buffer", None)
    if stream is None:
        raise ConfigError("<stdin>", "", f"standard input is closed, expected {what}")
    raw: bytes = stream.read(MAX_CONFIG_BYTES + 1)
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError("<stdin>", "", f"more than {MAX_CONFIG_BYTES >> 20} MiB: not {what}")
    return raw


def _decode(source: str, raw: bytes, what: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        byte = raw[exc.start : exc.start + 1].hex()
        raise ConfigError(source, "", f"not a UTF-8 text file (byte 0x{byte} at offset {exc.start:,}): expected {what}") from None


def _read_text(path: str | Path, what: str) -> tuple[str, str]:
    """``(source, text)``: the UTF-8 text of a YAML file (``-``: standard input, source
    ``<stdin>``) of at most :data:`MAX_CONFIG_BYTES`; one-line ConfigError otherwise. ``what``
    names the expected content (``a rig config``, ``a Kalibr camchain``) in the refusals."""
    source = str(path)
    if source == STDIN:
        return "<stdin>", _decode("<stdin>", _read_stdin(what), what)
    try:
        raw = read_regular(path, MAX_CONFIG_BYTES, what)
    except FileRefused as exc:
        raise ConfigError(source, "", _refusal(exc, what)) from None
    return source, _decode(source, raw, what)


def _refusal(exc: FileRefused, what: str) -> str:
    """The config readers' wording of a refused file (:func:`bevcompile.files.open_regular`)."""
    limit = f"larger than {MAX_CONFIG_BYTES >> 20} MiB: not {what}"
    return {
        MISSING: "file not found",
        DIRECTORY: "is a directory, expected a YAML file",
        SPECIAL: "is not a regular file (a device, pipe or socket), expected a YAML file",
        TOO_LARGE: f"is {exc.size:,} bytes, {limit}" if exc.size else limit,
        UNREADABLE: f"cannot read file ({exc.detail})",
    }.get(exc.code, exc.reason)


def _parse_yaml(text: str, source: str, loader: type[_BoundedLoader] | None = None) -> Any:
    try:
        data = _load_yaml(text, loader or _BoundedLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(source, "", f"invalid YAML: {where}{problem}") from None
    except RecursionError:
        raise ConfigError(source, "", f"invalid YAML: nested more than {MAX_YAML_DEPTH} levels deep") from None
    except (ValueError, OverflowError, TypeError) as exc:
        # PyYAML's constructors: `!!int 16px`, a date `2024-13-45`, an int of more than 4300 digits ...
        lines = str(exc).strip().splitlines()
        problem = lines[0] if lines else exc.__class__.__name__
        raise ConfigError(source, "", f"invalid YAML: {problem}") from None
    if data is None:
        raise ConfigError(source, "", "file is empty")
    return data


def read_config_data(path: str | Path, *, what: str = "a rig config") -> Any:
    """Read a YAML file (a rig config, a fleet manifest, a Kalibr camchain, ...; ``-``: standard
    input) into plain data, mapping every failure to a one-line ConfigError. Bounded before it
    costs: at most :data:`MAX_CONFIG_BYTES` bytes, :data:`MAX_YAML_DEPTH` levels and
    :data:`MAX_YAML_NODES` values after alias expansion. ``what`` names the expected content in
    the refusals."""
    source, text = _read_text(path, what)
    return _parse_yaml(text, source)


class _OpenCVLoader(_BoundedLoader):
    """:class:`_BoundedLoader` for OpenCV ``FileStorage`` YAML: a ``!!opencv-matrix`` node is the
    plain mapping it holds (``rows``, ``cols``, ``dt``, ``data``; ``!!opencv-nd-matrix``: ``sizes``,
    ``dt``, ``data``)."""


def _construct_opencv_matrix(loader: _OpenCVLoader, node: yaml.Node) -> Any:
    if not isinstance(node, yaml.MappingNode):
        raise yaml.constructor.ConstructorError(None, None, "an !!opencv-matrix must be a mapping (rows, cols, dt, data)", node.start_mark)
    return _construct_mapping(loader, node, deep=True)


_OpenCVLoader.add_constructor("tag:yaml.org,2002:opencv-matrix", _construct_opencv_matrix)
_OpenCVLoader.add_constructor("tag:yaml.org,2002:opencv-nd-matrix", _construct_opencv_matrix)
_OPENCV_DIRECTIVE = re.compile(r"^%YAML[: ]1\.[0-9]+[ \t]*(\r?\n|$)")


def read_opencv_yaml(path: str | Path) -> Any:
    """Read an OpenCV ``FileStorage`` YAML file (``cv2.FileStorage(..., FILE_STORAGE_WRITE)``):
    its first line ``%YAML:1.0`` (OpenCV 3/4) or ``%YAML 1.2`` (OpenCV 5), directives PyYAML
    refuses, is dropped and ``!!opencv-matrix`` nodes read as mappings. One-line ConfigError on failure."""
    source, text = _read_text(path, "an OpenCV calibration file")
    match = _OPENCV_DIRECTIVE.match(text)
    if match:
        text = "\n" + text[match.end() :]  # keep the line numbers of error messages
    return _parse_yaml(text, source, _OpenCVLoader)


def dump_config_yaml(data: Mapping[str, Any], header: Sequence[str] = ()) -> str:
    """YAML text of plain config data (a rig config, ``config_to_dict`` output): keys in the given
    order, lists of scalars in flow style, floats written as Python's shortest round-trip ``repr``
    so that :func:`read_config_data` reads back exactly the same numbers; ``header`` lines become
    ``#`` comments at the top."""
    body = yaml.safe_dump(dict(data), sort_keys=False, default_flow_style=None, width=10_000, allow_unicode=True)
    comments = "".join(f"# {line}\n" if line else "#\n" for line in header)
    return comments + body


def write_config_yaml(path: str | Path, data: Mapping[str, Any], header: Sequence[str] = ()) -> Path:
    """Write :func:`dump_config_yaml` to ``path`` atomically (a temporary sibling, then a rename):
    a reader never sees half a file. ConfigError (one line) if the folder cannot be written."""
    target = Path(path)
    special = check_output_path(target)  # a device, FIFO or socket: the rename would replace it
    if special is not None:
        raise ConfigError(str(target), "", special)
    text = dump_config_yaml(data, header)
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}"
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(text, encoding="utf-8")
        replace_file(tmp, target)
    except FileRefused as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise ConfigError(str(target), "", exc.reason) from None
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise ConfigError(str(target), "", f"cannot write file ({exc.strerror or exc})") from None
    return target


def load_config(path: str | Path | None = None) -> RigConfig:
    """Load and validate a rig config; ``None`` loads the bundled default."""
    if path is None:
        path = default_config_path()
        data = read_config_data(path)
        return parse_config(data, source=f"<bundled {DEFAULT_CONFIG_NAME}>")
    return parse_config(read_config_data(path), source=str(path))


# --------------------------------------------------------------------------------------
# parsing helpers (each reports its field path)
# --------------------------------------------------------------------------------------


class _Ctx:
    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, field: str, message: str) -> ConfigError:
        return ConfigError(self.source, field, message)


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, Mapping):
        return "mapping"
    if isinstance(value, list | tuple):
        return "list"
    return type(value).__name__


def _mapping(ctx: _Ctx, value: Any, field: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ctx.fail(field, f"expected a mapping, got {_type_name(value)}")
    for key in value:
        if not isinstance(key, str):
            raise ctx.fail(field, f"keys must be strings, got {shown(key)}")
    return value


def _check_keys(
    ctx: _Ctx, data: Mapping[str, Any], field: str, required: Sequence[str], optional: Sequence[str]
) -> None:
    allowed = set(required) | set(optional)
    unknown = [k for k in data if k not in allowed]
    if unknown:
        prefix = f"{field}." if field else ""
        raise ctx.fail(
            f"{prefix}{unknown[0]}",
            f"unknown field (allowed here: {', '.join(sorted(allowed))})",
        )
    for key in required:
        if key not in data:
            prefix = f"{field}." if field else ""
            raise ctx.fail(f"{prefix}{key}", "missing required field")


def _number(ctx: _Ctx, value: Any, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ctx.fail(field, f"expected a number, got {_type_name(value)}")
    if isinstance(value, str):
        # PyYAML reads '1e-3' (no dot) as a string; accept it when it is a plain ASCII decimal number
        if not _PLAIN_NUMBER.fullmatch(value):
            raise ctx.fail(field, f"expected a number, got string {shown(value)} (numbers are plain ASCII decimals: 1.5, -2, 1e-3)")
        value = float(value)
    try:
        number = float(value)
    except OverflowError:
        raise ctx.fail(field, f"number too large ({len(str(value))} digits)") from None
    if not math.isfinite(number):
        raise ctx.fail(field, f"must be finite, got {number}")
    return number


def _integer(ctx: _Ctx, value: Any, field: str) -> int:
    if isinstance(value, bool):
        raise ctx.fail(field, "expected an integer, got boolean")
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if isinstance(value, int):
        if abs(value) > MAX_CONFIG_INT:
            digits = len(str(abs(value)))
            raise ctx.fail(field, f"integer too large ({digits} digits; at most {MAX_CONFIG_INT:,})")
        return value
    if isinstance(value, float) and not math.isfinite(value):
        raise ctx.fail(field, f"must be finite, got {value}")
    raise ctx.fail(field, f"expected an integer, got {_type_name(value)} {shown(value)}")


def _string(ctx: _Ctx, value: Any, field: str) -> str:
    if not isinstance(value, str):
        raise ctx.fail(field, f"expected a string, got {_type_name(value)}")
    return value


def _list(ctx: _Ctx, value: Any, field: str, length: int | Sequence[int] | None = None) -> list[Any]:
    if not isinstance(value, list | tuple):
        raise ctx.fail(field, f"expected a list, got {_type_name(value)}")
    if length is not None:
        lengths = (length,) if isinstance(length, int) else tuple(length)
        if len(value) not in lengths:
            want = " or ".join(str(n) for n in lengths)
            raise ctx.fail(field, f"expected {want} values, got {len(value)}")
    return list(value)


def _numbers(ctx: _Ctx, value: Any, field: str, length: int | Sequence[int] | None = None) -> list[float]:
    items = _list(ctx, value, field, length)
    return [_number(ctx, item, f"{field}[{i}]") for i, item in enumerate(items)]


def _matrix(ctx: _Ctx, value: Any, field: str, rows: int, cols: int) -> list[list[float]]:
    items = _list(ctx, value, field, rows)
    return [_numbers(ctx, row, f"{field}[{i}]", cols) for i, row in enumerate(items)]


# --------------------------------------------------------------------------------------
# rotations (pure math, used here and by geometry)
# --------------------------------------------------------------------------------------


def rotation_from_quaternion_wxyz(quaternion_wxyz: Sequence[float]) -> list[list[float]]:
    """Rotation matrix of a (normalised) Hamilton quaternion ``(w, x, y, z)``.

    Same formula as pyquaternion/nuscenes-devkit ``Quaternion(w, x, y, z).rotation_matrix``.
    """
    w, x, y, z = (float(c) for c in quaternion_wxyz)
    norm = math.sqrt(w * w + x * x + y * y + z * z)
    w, x, y, z = w / norm, x / norm, y / norm, z / norm
    return [
        [1 - 2 * (y * y + z * z), 2 * (x * y - w * z), 2 * (x * z + w * y)],
        [2 * (x * y + w * z), 1 - 2 * (x * x + z * z), 2 * (y * z - w * x)],
        [2 * (x * z - w * y), 2 * (y * z + w * x), 1 - 2 * (x * x + y * y)],
    ]


def _check_rotation(ctx: _Ctx, rotation: list[list[float]], field: str) -> None:
    worst = 0.0
    for i in range(3):
        for j in range(3):
            dot = sum(rotation[k][i] * rotation[k][j] for k in range(3))
            worst = max(worst, abs(dot - (1.0 if i == j else 0.0)))
    if worst > ROTATION_TOLERANCE:
        raise ctx.fail(
            field,
            f"rotation part is not orthonormal (max |R^T R - I| = {worst:.3g} > {ROTATION_TOLERANCE:g})",
        )
    r = rotation
    det = (
        r[0][0] * (r[1][1] * r[2][2] - r[1][2] * r[2][1])
        - r[0][1] * (r[1][0] * r[2][2] - r[1][2] * r[2][0])
        + r[0][2] * (r[1][0] * r[2][1] - r[1][1] * r[2][0])
    )
    if det < 0:
        raise ctx.fail(field, f"rotation part is a reflection (det = {det:.6g}), not a rotation")


# --------------------------------------------------------------------------------------
# section parsers
# --------------------------------------------------------------------------------------

_AUG_KEYS = ("resize", "crop", "input_size", "pad", "flip")


def _parse_aug_fields(ctx: _Ctx, data: Any, field: str) -> dict[str, Any]:
    data = _mapping(ctx, data, field)
    _check_keys(ctx, data, field, (), _AUG_KEYS)
    out: dict[str, Any] = {}
    if "resize" in data:
        resize = _number(ctx, data["resize"], f"{field}.resize")
        if not 0 < resize <= MAX_RESIZE:
            raise ctx.fail(f"{field}.resize", f"must be in (0, {MAX_RESIZE:g}], got {resize:g}")
        out["resize"] = resize
    if "crop" in data:
        crop = _numbers(ctx, data["crop"], f"{field}.crop", 2)
        out["crop"] = crop
    if "input_size" in data:
        size = [_integer(ctx, v, f"{field}.input_size[{i}]") for i, v in enumerate(
            _list(ctx, data["input_size"], f"{field}.input_size", 2))]
        for i, v in enumerate(size):
            if not 0 < v <= MAX_IMAGE_SIDE:
                raise ctx.fail(f"{field}.input_size[{i}]", f"must be in [1, {MAX_IMAGE_SIDE}] pixels, got {v}")
        out["input_size"] = size
    if "pad" in data:
        pad = [_integer(ctx, v, f"{field}.pad[{i}]") for i, v in enumerate(_list(ctx, data["pad"], f"{field}.pad", 2))]
        for i, v in enumerate(pad):
            if v < 0:
                raise ctx.fail(f"{field}.pad[{i}]", f"must be >= 0, got {v}")
        out["pad"] = pad
    if "flip" in data:
        if not isinstance(data["flip"], bool):
            raise ctx.fail(f"{field}.flip", f"expected true or false, got {_type_name(data['flip'])}")
        out["flip"] = data["flip"]
    return out


def _check_camera_name(ctx: _Ctx, name: str, field: str) -> None:
    """Non-empty, at most :data:`MAX_CAMERA_NAME_CHARS`, printable (no control characters, no
    surrounding spaces); any script (``CAM_前``)."""
    if not name.strip():
        raise ctx.fail(field, "must not be empty")
    if len(name) > MAX_CAMERA_NAME_CHARS:
        raise ctx.fail(field, f"is {len(name)} characters, more than {MAX_CAMERA_NAME_CHARS}")
    if not name.isprintable() or name != name.strip():
        raise ctx.fail(field, f"must be printable, without control characters or surrounding spaces, got {shown(name)}")


def _check_pose(ctx: _Ctx, ego_from_cam: Sequence[Sequence[float]], field: str, what: str = "camera") -> None:
    """Pose plausibility: the sensor's centre within :data:`MAX_CAMERA_DISTANCE_M` of the ego origin."""
    distance = math.hypot(*(float(ego_from_cam[i][3]) for i in range(3)))
    if distance > MAX_CAMERA_DISTANCE_M:
        raise ctx.fail(
            field,
            f"puts the {what} {distance:.4g} m from the ego origin, more than the {MAX_CAMERA_DISTANCE_M:g} m a vehicle's "
            f"{what} can be (translations are metres, the pose {what} -> ego)",
        )


def _parse_distortion(ctx: _Ctx, data: Any, field: str) -> Distortion:
    data = _mapping(ctx, data, field)
    _check_keys(ctx, data, field, ("model",), ("coeffs",))
    model = _string(ctx, data["model"], f"{field}.model")
    if model not in DISTORTION_MODELS:
        raise ctx.fail(f"{field}.model", f"unknown model {shown(model)} (expected one of {', '.join(DISTORTION_MODELS)})")
    if model == "none":
        if "coeffs" in data and data["coeffs"] not in (None, [], ()):
            raise ctx.fail(f"{field}.coeffs", "model 'none' takes no coefficients")
        return Distortion("none", (), 0)
    if "coeffs" not in data:
        raise ctx.fail(f"{field}.coeffs", f"missing required field for model {shown(model)}")
    lengths = (4, 5, 8) if model == "opencv" else (4,)
    coeffs = _numbers(ctx, data["coeffs"], f"{field}.coeffs", lengths)
    for i, coeff in enumerate(coeffs):
        if abs(coeff) > MAX_DISTORTION_COEFF:
            raise ctx.fail(f"{field}.coeffs[{i}]", f"|coefficient| must be at most {MAX_DISTORTION_COEFF:g}, got {coeff:g}")
    if model == "opencv":
        padded = tuple(coeffs + [0.0] * (8 - len(coeffs)))
        return Distortion("opencv", padded, len(coeffs))
    return Distortion("fisheye", tuple(coeffs), 4)


_POSE_KEYS = ("rotation_wxyz", "translation", "sensor2ego")

Matrix4 = tuple[tuple[float, float, float, float], ...]
Pose = tuple[Matrix4, str, tuple[float, float, float, float] | None, tuple[float, float, float] | None]


def _parse_pose(ctx: _Ctx, data: Mapping[str, Any], field: str, what: str) -> Pose:
    """A sensor -> ego pose given as ``rotation_wxyz`` + ``translation`` or as ``sensor2ego``:
    ``(ego_from_sensor 4x4, pose form, rotation_wxyz or None, translation or None)``."""
    has_quat = "rotation_wxyz" in data or "translation" in data
    if has_quat and "sensor2ego" in data:
        key = "rotation_wxyz" if "rotation_wxyz" in data else "translation"
        raise ctx.fail(f"{field}.sensor2ego", f"give either sensor2ego or rotation_wxyz + translation, not both ({key} is set too)")
    rotation_wxyz: tuple[float, float, float, float] | None = None
    translation: tuple[float, float, float] | None = None
    if "sensor2ego" in data:
        matrix = _matrix(ctx, data["sensor2ego"], f"{field}.sensor2ego", 4, 4)
        if matrix[3] != [0.0, 0.0, 0.0, 1.0]:
            raise ctx.fail(f"{field}.sensor2ego[3]", f"bottom row must be [0, 0, 0, 1], got {matrix[3]}")
        _check_rotation(ctx, [row[:3] for row in matrix[:3]], f"{field}.sensor2ego")
        _check_pose(ctx, matrix, f"{field}.sensor2ego", what)
        ego_from_sensor: Matrix4 = tuple((row[0], row[1], row[2], row[3]) for row in matrix)
        pose_form = "matrix"
    else:
        if "rotation_wxyz" not in data:
            raise ctx.fail(f"{field}.rotation_wxyz", f"missing required field (or give sensor2ego: a 4x4 {what} -> ego matrix)")
        if "translation" not in data:
            raise ctx.fail(f"{field}.translation", f"missing required field (or give sensor2ego: a 4x4 {what} -> ego matrix)")
        quat = _numbers(ctx, data["rotation_wxyz"], f"{field}.rotation_wxyz", 4)
        norm = math.sqrt(sum(q * q for q in quat))
        if abs(norm - 1.0) > QUATERNION_TOLERANCE:
            raise ctx.fail(
                f"{field}.rotation_wxyz",
                f"quaternion must be unit length (tolerance {QUATERNION_TOLERANCE:g}), its norm is {norm:.9g}",
            )
        trans = _numbers(ctx, data["translation"], f"{field}.translation", 3)
        _check_pose(ctx, [[0.0, 0.0, 0.0, t] for t in trans], f"{field}.translation", what)
        rot = rotation_from_quaternion_wxyz(quat)
        ego_from_sensor = (
            (rot[0][0], rot[0][1], rot[0][2], trans[0]),
            (rot[1][0], rot[1][1], rot[1][2], trans[1]),
            (rot[2][0], rot[2][1], rot[2][2], trans[2]),
            (0.0, 0.0, 0.0, 1.0),
        )
        rotation_wxyz = (quat[0], quat[1], quat[2], quat[3])
        translation = (trans[0], trans[1], trans[2])
        pose_form = "quaternion"
    return ego_from_sensor, pose_form, rotation_wxyz, translation


def _parse_camera(ctx: _Ctx, data: Any, field: str, shared_aug: dict[str, Any], preset_aug: AugRule | None = None) -> Camera:
    data = _mapping(ctx, data, field)
    _check_keys(
        ctx, data, field, ("name", "image_size", "intrinsic"),
        ("distortion", *_POSE_KEYS, "image_aug", "description"),
    )
    name = _string(ctx, data["name"], f"{field}.name")
    _check_camera_name(ctx, name, f"{field}.name")
    description = None
    if "description" in data and data["description"] is not None:
        description = _string(ctx, data["description"], f"{field}.description")

    size_items = _list(ctx, data["image_size"], f"{field}.image_size", 2)
    width, height = (_integer(ctx, v, f"{field}.image_size[{i}]") for i, v in enumerate(size_items))
    for i, v in enumerate((width, height)):
        if not 0 < v <= MAX_IMAGE_SIDE:
            raise ctx.fail(f"{field}.image_size[{i}]", f"must be in [1, {MAX_IMAGE_SIDE}] pixels, got {v}")

    k = _matrix(ctx, data["intrinsic"], f"{field}.intrinsic", 3, 3)
    for (r, c), what in (((0, 0), "fx"), ((1, 1), "fy")):
        if k[r][c] <= 0:
            raise ctx.fail(f"{field}.intrinsic[{r}][{c}]", f"{what} must be > 0, got {k[r][c]:g}")
        if not MIN_FOCAL_PX <= k[r][c] <= MAX_FOCAL_PX:
            raise ctx.fail(f"{field}.intrinsic[{r}][{c}]", f"{what} must be in [{MIN_FOCAL_PX:g}, {MAX_FOCAL_PX:g}] pixels, got {k[r][c]:g}")
    for (r, c), what, size in (((0, 2), "cx", width), ((1, 2), "cy", height)):
        low, high = -PRINCIPAL_POINT_MARGIN * size, (PRINCIPAL_POINT_MARGIN + 1) * size
        if not low <= k[r][c] <= high:
            raise ctx.fail(
                f"{field}.intrinsic[{r}][{c}]",
                f"{what} must be in [{low:g}, {high:g}] pixels (within {PRINCIPAL_POINT_MARGIN} image sizes of the image), got {k[r][c]:g}",
            )
    if k[2] != [0.0, 0.0, 1.0]:
        raise ctx.fail(f"{field}.intrinsic[2]", f"bottom row must be [0, 0, 1], got {k[2]}")
    if k[0][1] != 0.0:
        raise ctx.fail(f"{field}.intrinsic[0][1]", f"skew must be 0 (OpenCV camera models have none), got {k[0][1]:g}")
    if k[1][0] != 0.0:
        raise ctx.fail(f"{field}.intrinsic[1][0]", f"must be 0, got {k[1][0]:g}")
    intrinsic = tuple(tuple(row) for row in k)

    distortion = (
        _parse_distortion(ctx, data["distortion"], f"{field}.distortion")
        if "distortion" in data
        else Distortion("none", (), 0)
    )

    ego_from_cam, pose_form, rotation_wxyz, translation = _parse_pose(ctx, data, field, "camera")

    override: dict[str, Any] = {}
    if "image_aug" in data:
        override = _parse_aug_fields(ctx, data["image_aug"], f"{field}.image_aug")
    from_preset = preset_aug(width, height) if preset_aug is not None else {}
    merged: dict[str, Any] = {"resize": 1.0, "crop": [0.0, 0.0], "pad": [0, 0], "flip": False} | from_preset | shared_aug | override
    aug_field = f"{field}.image_aug" if override and not shared_aug else "image_aug"
    if "input_size" not in merged:
        raise ctx.fail(f"{aug_field}.input_size", "missing required field (network input [width, height])")
    resize = merged["resize"]
    crop_left, crop_top = merged["crop"]
    input_w, input_h = merged["input_size"]
    pad_right, pad_bottom = merged["pad"]
    if pad_right >= input_w or pad_bottom >= input_h:
        pad_field = f"{field}.image_aug.pad" if "pad" in override else "image_aug.pad"
        raise ctx.fail(pad_field, f"padding [{pad_right}, {pad_bottom}] must be smaller than input_size {input_w}x{input_h}")
    window_w, window_h = input_w - pad_right, input_h - pad_bottom
    # BEVDet: resized image is (int(W * resize), int(H * resize)).
    resized_w = math.floor(width * resize + 1e-9)
    resized_h = math.floor(height * resize + 1e-9)
    crop_field = (
        f"{field}.image_aug.crop"
        if any(k in override for k in ("crop", "input_size", "resize", "pad"))
        else "image_aug.crop"
    )
    if crop_left < 0 or crop_top < 0 or crop_left + window_w > resized_w + 1e-9 or crop_top + window_h > resized_h + 1e-9:
        window = f"input_size {input_w}x{input_h}" if not (pad_right or pad_bottom) else (
            f"input_size {input_w}x{input_h} - pad [{pad_right}, {pad_bottom}] = {window_w}x{window_h}"
        )
        raise ctx.fail(
            crop_field,
            f"crop window [{crop_left:g}, {crop_top:g}] + {window} lies outside the resized "
            f"image of camera {shown(name)} ({width}x{height} * {resize:g} = {resized_w}x{resized_h})",
        )
    image_aug = ImageAug(
        float(resize), float(crop_left), float(crop_top), int(input_w), int(input_h), int(pad_right), int(pad_bottom), bool(merged["flip"])
    )
    return Camera(
        name=name,
        image_width=width,
        image_height=height,
        intrinsic=intrinsic,  # type: ignore[arg-type]
        distortion=distortion,
        ego_from_cam=ego_from_cam,
        image_aug=image_aug,
        pose_form=pose_form,
        rotation_wxyz=rotation_wxyz,
        translation=translation,
        image_aug_override=tuple(sorted(override.items())),
        description=description,
    )


def _parse_sensors(ctx: _Ctx, data: Any, camera_names: Mapping[str, int]) -> tuple[Sensor, ...]:
    """``sensors:``: non-camera sensors (a name and a pose each), names unique among cameras too."""
    items = _list(ctx, data, "sensors")
    sensors: list[Sensor] = []
    seen: dict[str, int] = {}
    for i, item in enumerate(items):
        field = f"sensors[{i}]"
        item = _mapping(ctx, item, field)
        _check_keys(ctx, item, field, ("name",), (*_POSE_KEYS, "description"))
        name = _string(ctx, item["name"], f"{field}.name")
        if not name.strip():
            raise ctx.fail(f"{field}.name", "must not be empty")
        if name == BEV_FRAME_EGO:
            raise ctx.fail(f"{field}.name", f"{BEV_FRAME_EGO!r} is the ego frame itself, not a sensor name")
        if name in camera_names:
            raise ctx.fail(f"{field}.name", f"{shown(name)} is also the name of cameras[{camera_names[name]}]; sensor names must differ from camera names")
        if name in seen:
            raise ctx.fail(f"{field}.name", f"duplicate sensor name {shown(name)} (also sensors[{seen[name]}])")
        seen[name] = i
        description = None
        if item.get("description") is not None:
            description = _string(ctx, item["description"], f"{field}.description")
        ego_from_sensor, pose_form, rotation_wxyz, translation = _parse_pose(ctx, item, field, "sensor")
        sensors.append(Sensor(name, ego_from_sensor, pose_form, rotation_wxyz, translation, description))
    return tuple(sensors)


def _parse_axis(ctx: _Ctx, value: Any, field: str, allow_two: bool) -> AxisSpec:
    values = _numbers(ctx, value, field, (2, 3) if allow_two else 3)
    lo, hi = values[0], values[1]
    for i, bound in enumerate((lo, hi)):
        if abs(bound) > MAX_EXTENT_M:
            raise ctx.fail(f"{field}[{i}]", f"must be within +-{MAX_EXTENT_M:g} m, got {bound:g}")
    if lo >= hi:
        raise ctx.fail(field, f"min must be < max, got [{lo:g}, {hi:g}]")
    step = values[2] if len(values) == 3 else hi - lo
    if step <= 0:
        raise ctx.fail(f"{field}[2]", f"step must be > 0, got {step:g}")
    ratio = (hi - lo) / step
    if not math.isfinite(ratio) or ratio > MAX_BEV_CELLS:
        raise ctx.fail(field, f"{ratio:.3g} steps of {step:g} m from {lo:g} to {hi:g} m exceeds the limit of {MAX_BEV_CELLS:,} cells")
    n = round(ratio)
    if n < 1 or abs(ratio - n) > AXIS_STEP_TOLERANCE:  # absolute, in steps: fine grids are held to it too
        raise ctx.fail(field, f"range {hi - lo:.10g} m is not a whole number of {step:g} m steps ({ratio:.12g})")
    return AxisSpec(lo, hi, step, int(n))


MAX_REGION_POLYGONS = 256
MAX_POLYGON_VERTICES = 4096
MAX_MASK_BYTES = 256 << 20
"""A ``bev.region.keep`` mask file is at most 256 MiB (a 10^8-cell grid as ``uint8`` ``.npy``)."""
MASK_SUFFIXES = (".npy", ".png")


def _parse_polygons(ctx: _Ctx, items: list[Any], field: str) -> tuple[tuple[tuple[float, float], ...], ...]:
    if not items:
        raise ctx.fail(field, "empty region: the list of polygons is empty")
    if len(items) > MAX_REGION_POLYGONS:
        raise ctx.fail(field, f"{len(items)} polygons, more than {MAX_REGION_POLYGONS}")
    polygons = []
    for i, item in enumerate(items):
        vertices = _list(ctx, item, f"{field}[{i}]")
        if not 3 <= len(vertices) <= MAX_POLYGON_VERTICES:
            raise ctx.fail(f"{field}[{i}]", f"a polygon needs 3 to {MAX_POLYGON_VERTICES} [x, y] vertices (metres, BEV frame), got {len(vertices)}")
        polygons.append(tuple((lambda v: (v[0], v[1]))(_numbers(ctx, v, f"{field}[{i}][{j}]", 2)) for j, v in enumerate(vertices)))
    return tuple(polygons)


def _read_mask_file(ctx: _Ctx, name: str, field: str, base_dir: Path | None, shape: tuple[int, int]) -> Any:
    """The keep mask of file ``name`` (relative to ``base_dir``, the config's folder) as a 2-D
    array of ``shape`` ``(ny, nx)`` (non-zero = kept); one-line ConfigError otherwise. The shape
    and type are checked from the file's header (the ``.npy`` header, the PNG's IHDR) before its
    data is decoded: a small file that declares a huge array costs nothing."""
    import io

    import numpy as np

    from .region import decode_png, png_header

    suffix = Path(name).suffix.lower()
    if suffix not in MASK_SUFFIXES:
        raise ctx.fail(field, f"mask file {shown(name)} must be a .npy or .png file")
    path = Path(name) if Path(name).is_absolute() or base_dir is None else base_dir / name
    try:
        raw = read_regular(path, MAX_MASK_BYTES, "a mask file")
    except FileRefused as exc:
        if exc.code == MISSING:
            raise ctx.fail(field, f"mask file {shown(name)} not found (relative paths are relative to the config's folder)") from None
        if exc.code == UNREADABLE:
            raise ctx.fail(field, f"cannot read mask file {shown(name)} ({exc.detail})") from None
        raise ctx.fail(field, f"mask file {shown(name)} {exc.reason}") from None

    def wrong_shape(given: tuple[int, ...]) -> ConfigError:
        text = " x ".join(str(n) for n in given)
        return ctx.fail(field, f"mask file {shown(name)} is {text}, expected ny x nx = {shape[0]} x {shape[1]} ([iy, ix], row 0 = y_min)")

    if suffix == ".png":
        try:
            width, height = png_header(raw)[:2]
            if (height, width) != shape:
                raise wrong_shape((height, width))
            return decode_png(raw)
        except ConfigError:
            raise
        except ValueError as exc:
            raise ctx.fail(field, f"mask file {shown(name)}: {' '.join(str(exc).split())}") from None
    buffer = io.BytesIO(raw)
    try:  # the header first: shape and dtype before any data is read
        version = np.lib.format.read_magic(buffer)
        read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        declared, _fortran, dtype = read_header(buffer)
    except Exception as exc:  # not a .npy header: ValueError, EOFError ...
        raise ctx.fail(field, f"mask file {shown(name)} is not a readable .npy file ({' '.join(str(exc).split()) or exc.__class__.__name__})") from None
    if not (dtype == np.bool_ or np.issubdtype(dtype, np.integer)):
        raise ctx.fail(field, f"mask file {shown(name)} holds {dtype}: expected bool or integer (non-zero = kept)")
    if tuple(declared) != shape:
        raise wrong_shape(tuple(declared))
    try:
        array = np.load(io.BytesIO(raw), allow_pickle=False)
    except Exception as exc:  # a truncated or damaged .npy: ValueError, EOFError, OSError ...
        raise ctx.fail(field, f"mask file {shown(name)} is not a readable .npy file ({' '.join(str(exc).split()) or exc.__class__.__name__})") from None
    return array


def _parse_mask(ctx: _Ctx, value: Any, field: str, x: AxisSpec, y: AxisSpec, base_dir: Path | None) -> tuple[bytes, str, str]:
    """``(content, file name, sha256)`` of a ``keep`` mask: a file name, or the resolved mapping
    ``{mask, shape, sha256, runs}`` of :func:`config_to_dict` (checked against its hash)."""
    from .region import mask_bytes, mask_from_runs, mask_sha256

    if isinstance(value, str):
        value = {"mask": value}
    data = _mapping(ctx, value, field)
    _check_keys(ctx, data, field, ("mask",), ("shape", "sha256", "runs"))
    name = _string(ctx, data["mask"], f"{field}.mask")
    if not name.strip():
        raise ctx.fail(f"{field}.mask", "must name a .npy or .png file")
    if "runs" in data:
        for key in ("shape", "sha256"):
            if key not in data:
                raise ctx.fail(f"{field}.{key}", "missing required field (with runs)")
        shape = [_integer(ctx, v, f"{field}.shape[{i}]") for i, v in enumerate(_list(ctx, data["shape"], f"{field}.shape", 2))]
        if shape != [y.n, x.n]:
            raise ctx.fail(f"{field}.shape", f"{shape[0]} x {shape[1]} differs from the grid's {y.n} x {x.n} (ny x nx)")
        runs = [_integer(ctx, v, f"{field}.runs[{i}]") for i, v in enumerate(_list(ctx, data["runs"], f"{field}.runs"))]
        content = mask_from_runs(runs, y.n * x.n)
        if content is None:
            raise ctx.fail(f"{field}.runs", f"run lengths must be >= 0 and sum to {y.n * x.n:,} (ny * nx), got {sum(runs):,}")
        digest = mask_sha256(content)
        if _string(ctx, data["sha256"], f"{field}.sha256") != digest:
            raise ctx.fail(f"{field}.sha256", f"differs from the content of runs ({digest[:12]}…)")
        return content, name, digest
    for key in ("shape", "sha256"):
        if key in data:
            raise ctx.fail(f"{field}.{key}", "only with runs (the resolved form of a mask)")
    array = _read_mask_file(ctx, name, field, base_dir, (y.n, x.n))
    content = mask_bytes(array)
    return content, name, mask_sha256(content)


def _parse_rings(ctx: _Ctx, value: Any, field: str, x: AxisSpec, y: AxisSpec) -> tuple[RingSpec, ...]:
    items = _list(ctx, value, field)
    if not items:
        raise ctx.fail(field, "empty list: give at least one {beyond_m, factor} band, or leave rings out")
    rings: list[RingSpec] = []
    for i, item in enumerate(items):
        where = f"{field}[{i}]"
        band = _mapping(ctx, item, where)
        _check_keys(ctx, band, where, ("beyond_m", "factor"), ())
        beyond = _number(ctx, band["beyond_m"], f"{where}.beyond_m")
        factor = _integer(ctx, band["factor"], f"{where}.factor")
        if beyond < 0:
            raise ctx.fail(f"{where}.beyond_m", f"must be >= 0 metres, got {beyond:g}")
        if factor < 2 or factor & (factor - 1):
            raise ctx.fail(f"{where}.factor", f"must be a power of two >= 2, got {factor}")
        if rings and beyond <= rings[-1].beyond_m:
            raise ctx.fail(f"{where}.beyond_m", f"{beyond:g} is not beyond the previous band's {rings[-1].beyond_m:g} m (bands are listed outwards)")
        if rings and factor <= rings[-1].factor:
            raise ctx.fail(f"{where}.factor", f"{factor} is not coarser than the previous band's {rings[-1].factor} (factors grow outwards)")
        if y.n % factor or x.n % factor:
            raise ctx.fail(f"{where}.factor", f"{factor} does not divide the grid {y.n} x {x.n} (ny x nx): super-cells are aligned {factor} x {factor} blocks")
        rings.append(RingSpec(beyond, factor))
    return tuple(rings)


def _parse_region(ctx: _Ctx, value: Any, x: AxisSpec, y: AxisSpec, base_dir: Path | None) -> RegionSpec:
    from .region import polygon_kept_count

    field = "bev.region"
    data = _mapping(ctx, value, field)
    _check_keys(ctx, data, field, (), ("keep", "rings"))
    if not data:
        raise ctx.fail(field, "empty region: give keep (polygons or a mask file) and/or rings")
    polygons = mask = mask_file = digest = None
    if "keep" in data:
        keep = data["keep"]
        if isinstance(keep, list | tuple):
            polygons = _parse_polygons(ctx, list(keep), f"{field}.keep")
            kept = polygon_kept_count(polygons, x, y)  # the runs of each row, never an (ny, nx) mask
        else:
            if not isinstance(keep, str | Mapping):
                raise ctx.fail(f"{field}.keep", f"expected a list of polygons or a mask file name, got {_type_name(keep)}")
            mask, mask_file, digest = _parse_mask(ctx, keep, f"{field}.keep", x, y, base_dir)
            kept = mask.count(1)
        if kept == 0:
            raise ctx.fail(f"{field}.keep", "empty region: no BEV cell centre is inside it")
    rings = _parse_rings(ctx, data["rings"], f"{field}.rings", x, y) if "rings" in data else ()
    return RegionSpec(polygons, mask, mask_file, digest, rings, (y.n, x.n) if mask is not None else (0, 0))


def _parse_bev(ctx: _Ctx, data: Any, sensors: Sequence[Sensor], base_dir: Path | None = None) -> BevSpec:
    data = _mapping(ctx, data, "bev")
    _check_keys(ctx, data, "bev", ("x", "y", "z"), ("heights", "frame", "region"))
    frame = BEV_FRAME_EGO
    if "frame" in data:
        frame = _string(ctx, data["frame"], "bev.frame")
        names = [sensor.name for sensor in sensors]
        if frame != BEV_FRAME_EGO and frame not in names:
            listed = f"one of the sensors: {', '.join(names)}" if names else "a sensor listed under sensors: (there is none)"
            raise ctx.fail("bev.frame", f"unknown frame {shown(frame)}: expected {BEV_FRAME_EGO!r} or {listed}")
    x = _parse_axis(ctx, data["x"], "bev.x", allow_two=False)
    y = _parse_axis(ctx, data["y"], "bev.y", allow_two=False)
    z = _parse_axis(ctx, data["z"], "bev.z", allow_two=True)
    heights: tuple[float, ...] = (0.0,)
    if "heights" in data:
        hs = _numbers(ctx, data["heights"], "bev.heights")
        if not hs:
            raise ctx.fail("bev.heights", "must hold at least one height")
        if len(set(hs)) != len(hs):
            raise ctx.fail("bev.heights", f"heights must be distinct, got {hs}")
        for i, h in enumerate(hs):
            if abs(h) > MAX_EXTENT_M:
                raise ctx.fail(f"bev.heights[{i}]", f"must be within +-{MAX_EXTENT_M:g} m, got {h:g}")
        heights = tuple(hs)
    cells = x.n * y.n * len(heights)
    if cells > MAX_BEV_CELLS:
        raise ctx.fail(
            "bev", f"grid of {x.n} x {y.n} x {len(heights)} = {cells:,} cells exceeds the limit of {MAX_BEV_CELLS:,}"
        )
    region = _parse_region(ctx, data["region"], x, y, base_dir) if "region" in data else None
    return BevSpec(x, y, z, heights, frame, region)


def _parse_depth(ctx: _Ctx, data: Any) -> DepthSpec:
    data = _mapping(ctx, data, "depth")
    _check_keys(ctx, data, "depth", ("bins",), ())
    start, stop, step = _numbers(ctx, data["bins"], "depth.bins", 3)
    if step <= 0:
        raise ctx.fail("depth.bins[2]", f"step must be > 0, got {step:g}")
    if start <= 0:
        raise ctx.fail("depth.bins[0]", f"depths are distances in front of the camera and must be > 0, got {start:g}")
    if stop <= start:
        raise ctx.fail("depth.bins", f"stop must be > start, got [{start:g}, {stop:g}]")
    if stop > MAX_EXTENT_M:
        raise ctx.fail("depth.bins[1]", f"must be at most {MAX_EXTENT_M:g} m, got {stop:g}")
    ratio = (stop - start) / step
    if not math.isfinite(ratio) or ratio > 2 * MAX_DEPTH_BINS:
        raise ctx.fail("depth.bins", f"{ratio:.6g} depth bins is more than the limit of {MAX_DEPTH_BINS}")
    n_bins = math.ceil(ratio - 1e-9)  # len(torch.arange(start, stop, step))
    if n_bins > MAX_DEPTH_BINS:
        raise ctx.fail("depth.bins", f"{n_bins} depth bins is more than the limit of {MAX_DEPTH_BINS}")
    return DepthSpec(start, stop, step, n_bins)


def _parse_mapping(ctx: _Ctx, value: Any, field: str) -> str:
    mapping = _string(ctx, value, field)
    if mapping not in PIXEL_MAPPINGS:
        raise ctx.fail(field, f"expected one of {', '.join(PIXEL_MAPPINGS)}, got {shown(mapping)}")
    return mapping


def _parse_stride(ctx: _Ctx, value: Any, field: str) -> int:
    stride = _integer(ctx, value, field)
    if stride <= 0:
        raise ctx.fail(field, f"must be > 0, got {stride}")
    return stride


def _parse_feature(ctx: _Ctx, data: Any) -> FeatureSpec:
    data = _mapping(ctx, data, "feature")
    _check_keys(ctx, data, "feature", (), ("stride", "pixel_mapping", "size_rule", "levels"))
    if ("stride" in data) == ("levels" in data):
        raise ctx.fail("feature.stride", "give either stride (one feature map) or levels (several), not both"
                       if "stride" in data else "missing required field (or give levels: a list of {stride, pixel_mapping})")
    mapping = _parse_mapping(ctx, data["pixel_mapping"], "feature.pixel_mapping") if "pixel_mapping" in data else "stride"
    size_rule = "exact"
    if "size_rule" in data:
        size_rule = _string(ctx, data["size_rule"], "feature.size_rule")
        if size_rule not in SIZE_RULES:
            raise ctx.fail("feature.size_rule", f"expected one of {', '.join(SIZE_RULES)}, got {shown(size_rule)}")
    if "stride" in data:
        return FeatureSpec(_parse_stride(ctx, data["stride"], "feature.stride"), mapping, size_rule)
    items = _list(ctx, data["levels"], "feature.levels")
    if not 1 <= len(items) <= MAX_FEATURE_LEVELS:
        raise ctx.fail("feature.levels", f"must list 1 to {MAX_FEATURE_LEVELS} levels, got {len(items)}")
    levels: list[FeatureLevel] = []
    seen: dict[int, int] = {}
    for i, item in enumerate(items):
        field = f"feature.levels[{i}]"
        item = _mapping(ctx, item, field)
        _check_keys(ctx, item, field, ("stride",), ("pixel_mapping", "bev"))
        if "bev" in item and i == 0:
            raise ctx.fail(f"{field}.bev", "level 0 samples bev: (give a level its own grid from feature.levels[1] on)")
        stride = _parse_stride(ctx, item["stride"], f"{field}.stride")
        if stride in seen:
            raise ctx.fail(f"{field}.stride", f"duplicate stride {stride} (also feature.levels[{seen[stride]}])")
        seen[stride] = i
        level_mapping = _parse_mapping(ctx, item["pixel_mapping"], f"{field}.pixel_mapping") if "pixel_mapping" in item else mapping
        levels.append(FeatureLevel(stride, level_mapping))
    return FeatureSpec(levels[0].stride, levels[0].pixel_mapping, size_rule, tuple(levels) if len(levels) > 1 else ())


_LEVEL_BEV_KEYS = ("x", "y", "z", "heights")
"""What ``feature.levels[l].bev`` may give: the level's own cells and heights (``frame`` is ``bev.frame``'s)."""


def _parse_level_grids(ctx: _Ctx, data: Mapping[str, Any], feature: FeatureSpec, bev: BevSpec) -> FeatureSpec:
    """``feature.levels[l].bev``: level ``l``'s own BEV grid, ``bev:``'s fields overridden key by
    key (``x``, ``y``, ``z``, ``heights``), in ``bev.frame``; refused with a ``bev.region`` (the
    region is a set of level 0's cells)."""
    if not feature.levels:
        return feature
    items = data["levels"]
    base: dict[str, Any] = {
        "x": [bev.x.min, bev.x.max, bev.x.step],
        "y": [bev.y.min, bev.y.max, bev.y.step],
        "z": [bev.z.min, bev.z.max, bev.z.step],
        "heights": list(bev.heights),
    }
    levels: list[FeatureLevel] = []
    for i, (level, item) in enumerate(zip(feature.levels, items, strict=True)):
        if "bev" not in item:
            levels.append(level)
            continue
        field = f"feature.levels[{i}].bev"
        given = _mapping(ctx, item["bev"], field)
        _check_keys(ctx, given, field, (), _LEVEL_BEV_KEYS)
        if not given:
            raise ctx.fail(field, f"empty: give the level's own {', '.join(_LEVEL_BEV_KEYS)} (or leave bev out: the level samples bev:)")
        if bev.region is not None:
            raise ctx.fail(field, "a level's own BEV grid cannot be combined with bev.region (the region is a set of bev:'s cells)")
        merged = base | dict(given)
        x = _parse_axis(ctx, merged["x"], f"{field}.x" if "x" in given else "bev.x", allow_two=False)
        y = _parse_axis(ctx, merged["y"], f"{field}.y" if "y" in given else "bev.y", allow_two=False)
        z = _parse_axis(ctx, merged["z"], f"{field}.z" if "z" in given else "bev.z", allow_two=True)
        heights = tuple(bev.heights)
        if "heights" in given:
            hs = _numbers(ctx, given["heights"], f"{field}.heights")
            if not hs:
                raise ctx.fail(f"{field}.heights", "must hold at least one height")
            if len(set(hs)) != len(hs):
                raise ctx.fail(f"{field}.heights", f"heights must be distinct, got {hs}")
            heights = tuple(hs)
        cells = x.n * y.n * len(heights)
        if cells > MAX_BEV_CELLS:
            raise ctx.fail(field, f"grid of {x.n} x {y.n} x {len(heights)} = {cells:,} cells exceeds the limit of {MAX_BEV_CELLS:,}")
        levels.append(replace(level, bev=BevSpec(x, y, z, heights, bev.frame, None)))
    return replace(feature, levels=tuple(levels))


def _parse_interop(ctx: _Ctx, data: Any) -> tuple[tuple[str, tuple[tuple[str, Any], ...]], ...]:
    """``interop:``: per ``export-interop`` target, the settings it fixes (:data:`INTEROP_CHOICES`)."""
    data = _mapping(ctx, data, "interop")
    _check_keys(ctx, data, "interop", (), tuple(INTEROP_CHOICES))
    out: list[tuple[str, tuple[tuple[str, Any], ...]]] = []
    for target in sorted(data):
        field = f"interop.{target}"
        options = _mapping(ctx, data[target] if data[target] is not None else {}, field)
        choices, ints, bools = INTEROP_CHOICES[target], INTEROP_INT_OPTIONS.get(target, {}), INTEROP_BOOL_OPTIONS.get(target, ())
        numbers = INTEROP_NUMBER_OPTIONS.get(target, {})
        _check_keys(ctx, options, field, (), (*choices, *ints, *bools, *numbers))
        items: dict[str, Any] = {}
        for key, value in options.items():
            if key in numbers:
                items[key] = _interop_numbers(ctx, value, f"{field}.{key}", numbers[key])
            elif key in bools:
                if not isinstance(value, bool):
                    raise ctx.fail(f"{field}.{key}", f"expected true or false, got {_type_name(value)}")
                items[key] = value
            elif key in ints:
                if value is None and key == "z_bins":
                    items[key] = None
                    continue
                number = _integer(ctx, value, f"{field}.{key}")
                lo, hi = ints[key]
                if not lo <= number <= hi:
                    raise ctx.fail(f"{field}.{key}", f"must be in [{lo}, {hi}], got {number}")
                items[key] = number
            else:
                text = _string(ctx, value, f"{field}.{key}")
                if text not in choices[key]:
                    raise ctx.fail(f"{field}.{key}", f"expected one of {', '.join(choices[key])}, got {shown(text)}")
                items[key] = text
        out.append((target, tuple(sorted(items.items()))))
    return tuple(out)


def _interop_numbers(ctx: _Ctx, value: Any, field: str, count: int) -> float | tuple[float, ...]:
    """A numeric ``interop:`` setting: ``depth_start`` (> 0) or ``position_range`` (min < max per axis)."""
    if count == 1:
        number = _number(ctx, value, field)
        if not number > 0.0:
            raise ctx.fail(field, f"must be > 0, got {number:g}")
        return number
    values = _numbers(ctx, value, field, count)
    half = count // 2
    for axis in range(half):
        if not values[axis] < values[axis + half]:
            raise ctx.fail(field, f"min must be < max on every axis, got {values[axis]:g} >= {values[axis + half]:g} (axis {'xyz'[axis] if half == 3 else axis})")
    return tuple(values)


def _with_preset(ctx: _Ctx, data: Mapping[str, Any]) -> tuple[Mapping[str, Any], Preset | None]:
    """``data`` with the sections of its ``preset:`` filled in under the explicit fields
    (mappings merged key by key, the config's keys winning; an explicit ``feature.stride`` or
    ``feature.levels`` replaces the preset's feature maps)."""
    if "preset" not in data:
        return data, None
    name = _string(ctx, data["preset"], "preset")
    if name not in PRESETS:
        raise ctx.fail("preset", f"unknown preset {shown(name)}: expected one of {', '.join(PRESETS)} (see bevcompile presets)")
    chosen = PRESETS[name]
    merged = dict(data)
    for section, values in chosen.fields.items():
        if section == "camera_order":
            merged.setdefault(section, list(values))
            continue
        explicit = data.get(section)
        if explicit is None:
            merged[section] = _copy_plain(values)
            continue
        if not isinstance(explicit, Mapping):
            continue  # reported with its field path by the section's parser
        base = _copy_plain(values)
        if section == "feature" and ("stride" in explicit or "levels" in explicit):
            base.pop("stride", None)
            base.pop("levels", None)
        if section == "interop":
            for target, options in explicit.items():
                base[target] = dict(base.get(target) or {}) | dict(options or {}) if isinstance(options, Mapping | type(None)) else options
            merged[section] = base
            continue
        merged[section] = base | dict(explicit)
    return merged, chosen


def _copy_plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _copy_plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_copy_plain(v) for v in value]
    return value


def _ordered_cameras(ctx: _Ctx, cameras: list[Camera], data: Any, field: str) -> list[Camera]:
    """``cameras`` in the order ``camera_order`` names (every camera exactly once)."""
    names = [_string(ctx, v, f"{field}[{i}]") for i, v in enumerate(_list(ctx, data, field))]
    by_name = {cam.name: cam for cam in cameras}
    for i, name in enumerate(names):
        if name not in by_name:
            raise ctx.fail(f"{field}[{i}]", f"no camera named {shown(name)} (cameras: {', '.join(by_name)})")
        if names.index(name) != i:
            raise ctx.fail(f"{field}[{i}]", f"camera {shown(name)} is named twice")
    missing = [cam.name for cam in cameras if cam.name not in names]
    if missing:
        raise ctx.fail(field, f"lists {len(names)} of the {len(cameras)} cameras; missing {', '.join(missing)}")
    return [by_name[name] for name in names]


def parse_config(data: Any, source: str = "<config>", *, base_dir: str | Path | None = None) -> RigConfig:
    """Validate plain data (as read from YAML) into a :class:`RigConfig`.

    A ``preset:`` (:mod:`bevcompile.rig.presets`) fills every section it fixes; the config's
    explicit fields override it, and ``name`` defaults to the preset's name.

    ``base_dir``: the folder relative file names in the config (a ``bev.region.keep`` mask) are
    relative to (default: the folder of ``source`` when it names a file, else the working folder).

    Raises:
        ConfigError: ``<source>: <field path>: <problem>`` for the first problem found.
    """
    ctx = _Ctx(source)
    data = _mapping(ctx, data, "")
    data, chosen = _with_preset(ctx, data)
    optional = ("image_aug", "depth", "description", "sensors", "preset", "camera_order", "interop")
    if chosen is None:
        _check_keys(ctx, data, "", ("cameras",), ("name", "feature", "bev", *optional))
        for key in ("name", "feature", "bev"):
            if key not in data:
                raise ctx.fail(key, "missing required field (or add a preset: line naming the model you deploy; `bevcompile presets` lists them)")
        name = _string(ctx, data["name"], "name")
    else:
        _check_keys(ctx, data, "", ("cameras",), ("name", "feature", "bev", *optional))
        name = _string(ctx, data["name"], "name") if "name" in data else chosen.name
        frame_sensor = chosen.frame_sensor
        listed = [s.get("name") for s in data.get("sensors") or () if isinstance(s, Mapping)]
        if frame_sensor is not None and data["bev"].get("frame") == frame_sensor and frame_sensor not in listed:
            raise ctx.fail(
                "sensors",
                f"preset {chosen.name} puts the BEV grid in the {frame_sensor} frame: list {frame_sensor} "
                "under sensors: (its calibrated pose, sensor -> ego)",
            )
    if not _NAME_RE.fullmatch(name):
        raise ctx.fail("name", f"must be a file-name-safe identifier (letters, digits, '.', '_', '-'; starting with a letter or digit), got {shown(name)}")
    if len(name) > MAX_NAME_CHARS:
        raise ctx.fail("name", f"is {len(name)} characters, more than {MAX_NAME_CHARS} (the store folder <name>.zarr and its temporaries must fit a 255-byte file name)")
    description = None
    if data.get("description") is not None:
        description = _string(ctx, data["description"], "description")
    shared_aug: dict[str, Any] = {}
    if "image_aug" in data:
        shared_aug = _parse_aug_fields(ctx, data["image_aug"], "image_aug")
    feature = _parse_feature(ctx, data["feature"])

    camera_items = _list(ctx, data["cameras"], "cameras")
    if not camera_items:
        raise ctx.fail("cameras", "must list at least one camera")
    cameras: list[Camera] = []
    seen: dict[str, int] = {}
    for i, item in enumerate(camera_items):
        camera = _parse_camera(ctx, item, f"cameras[{i}]", shared_aug, chosen.image_aug if chosen is not None else None)
        if camera.name in seen:
            raise ctx.fail(f"cameras[{i}].name", f"duplicate camera name {shown(camera.name)} (also cameras[{seen[camera.name]}])")
        seen[camera.name] = i
        aug = camera.image_aug
        for level_index, level in enumerate(feature.all_levels if feature.size_rule == "exact" else ()):
            for axis, size in (("width", aug.input_width), ("height", aug.input_height)):
                if size % level.stride:
                    where = f"cameras[{i}].image_aug.input_size" if "input_size" in dict(camera.image_aug_override) else "image_aug.input_size"
                    stride_field = "feature.stride" if not feature.levels else f"feature.levels[{level_index}].stride"
                    raise ctx.fail(
                        where,
                        f"input {axis} {size} is not divisible by {stride_field} {level.stride}"
                        + ("" if not feature.levels else " (or set feature.size_rule: ceil)"),
                    )
        if cameras:
            first = cameras[0].image_aug
            if (aug.input_width, aug.input_height) != (first.input_width, first.input_height):
                raise ctx.fail(
                    f"cameras[{i}].image_aug.input_size",
                    f"{aug.input_width}x{aug.input_height} differs from cameras[0] "
                    f"({first.input_width}x{first.input_height}); all cameras share one feature map shape",
                )
        cameras.append(camera)
    for level_index, level in enumerate(feature.all_levels):
        w_f = feature_map_size(cameras[0].image_aug.input_width, level.stride, feature.size_rule)
        h_f = feature_map_size(cameras[0].image_aug.input_height, level.stride, feature.size_rule)
        if w_f < 2 or h_f < 2:
            where = "feature.stride" if not feature.levels else f"feature.levels[{level_index}].stride"
            raise ctx.fail(where, f"feature map {w_f}x{h_f} is smaller than 2x2")
    if "camera_order" in data:
        cameras = _ordered_cameras(ctx, cameras, data["camera_order"], "camera_order")
    sensors = _parse_sensors(ctx, data["sensors"], seen) if "sensors" in data else ()
    if base_dir is None and not source.startswith("<"):
        base_dir = Path(source).parent
    bev = _parse_bev(ctx, data["bev"], sensors, Path(base_dir) if base_dir is not None else None)
    feature = _parse_level_grids(ctx, data["feature"], feature, bev)
    depth = _parse_depth(ctx, data["depth"]) if "depth" in data else DepthSpec(1.0, 60.0, 1.0, 59)
    interop = _parse_interop(ctx, data["interop"]) if "interop" in data else ()
    return RigConfig(
        name=name,
        cameras=tuple(cameras),
        image_aug=dict(shared_aug) if shared_aug else None,
        feature=feature,
        bev=bev,
        depth=depth,
        description=description,
        source=source,
        sensors=sensors,
        preset=chosen.name if chosen is not None else None,
        interop=interop,
    )


# --------------------------------------------------------------------------------------
# canonical form and hash
# --------------------------------------------------------------------------------------


def config_to_dict(rig: RigConfig, *, descriptions: bool = True) -> dict[str, Any]:
    """The resolved config as plain data (JSON/YAML-serialisable); re-parses to ``rig``.

    Every default is explicit and each camera carries its full ``image_aug``.
    """
    cameras: list[dict[str, Any]] = []
    for cam in rig.cameras:
        entry: dict[str, Any] = {"name": cam.name}
        if descriptions and cam.description is not None:
            entry["description"] = cam.description
        entry["image_size"] = [cam.image_width, cam.image_height]
        entry["intrinsic"] = [list(row) for row in cam.intrinsic]
        if cam.distortion.model == "none":
            entry["distortion"] = {"model": "none"}
        else:
            entry["distortion"] = {
                "model": cam.distortion.model,
                "coeffs": list(cam.distortion.coeffs[: cam.distortion.n_coeffs_given]),
            }
        entry.update(_pose_dict(cam.pose_form, cam.rotation_wxyz, cam.translation, cam.ego_from_cam))
        aug = cam.image_aug
        entry["image_aug"] = {
            "resize": aug.resize,
            "crop": [aug.crop_left, aug.crop_top],
            "input_size": [aug.input_width, aug.input_height],
        }
        if aug.pad_right or aug.pad_bottom or rig.preset is not None:  # only when used: configs without padding keep their hash
            entry["image_aug"]["pad"] = [aug.pad_right, aug.pad_bottom]
        if aug.flip:  # only when set: configs without a flip keep their hash
            entry["image_aug"]["flip"] = True
        cameras.append(entry)
    bev = rig.bev
    out: dict[str, Any] = {"name": rig.name}
    if descriptions and rig.description is not None:
        out["description"] = rig.description
    if rig.preset is not None:  # a preset re-applied under the resolved fields gives the same config
        out["preset"] = rig.preset
        out["camera_order"] = list(rig.camera_names)
    out["cameras"] = cameras
    if rig.sensors:  # only when listed: configs without sensors keep their hash
        out["sensors"] = [
            {"name": sensor.name}
            | ({"description": sensor.description} if descriptions and sensor.description is not None else {})
            | _pose_dict(sensor.pose_form, sensor.rotation_wxyz, sensor.translation, sensor.ego_from_sensor)
            for sensor in rig.sensors
        ]
    feature = rig.feature
    if feature.levels:
        out["feature"] = {"levels": [
            {"stride": lv.stride, "pixel_mapping": lv.pixel_mapping} | ({"bev": _level_bev_dict(lv.bev)} if lv.bev is not None else {})
            for lv in feature.levels
        ]}
    else:
        out["feature"] = {"stride": feature.stride, "pixel_mapping": feature.pixel_mapping}
    if feature.size_rule != "exact" or rig.preset is not None:  # only when set: exact configs keep their hash
        out["feature"]["size_rule"] = feature.size_rule
    out["bev"] = {
        "x": [bev.x.min, bev.x.max, bev.x.step],
        "y": [bev.y.min, bev.y.max, bev.y.step],
        "z": [bev.z.min, bev.z.max, bev.z.step],
        "heights": list(bev.heights),
    }
    if bev.frame != BEV_FRAME_EGO or rig.preset is not None:  # only when set: ego-frame configs keep their hash
        out["bev"]["frame"] = bev.frame
    if bev.region is not None:  # only when set: configs without a region keep their hash
        out["bev"]["region"] = _region_dict(bev.region, descriptions)
    out["depth"] = {"bins": [rig.depth.start, rig.depth.stop, rig.depth.step]}
    if rig.interop:
        out["interop"] = {target: {k: list(v) if isinstance(v, tuple) else v for k, v in options} for target, options in rig.interop}
    return out


def _level_bev_dict(bev: BevSpec) -> dict[str, Any]:
    """A level's own BEV grid resolved (every field it may give; its frame is ``bev.frame``)."""
    return {
        "x": [bev.x.min, bev.x.max, bev.x.step],
        "y": [bev.y.min, bev.y.max, bev.y.step],
        "z": [bev.z.min, bev.z.max, bev.z.step],
        "heights": list(bev.heights),
    }


def _region_dict(region: RegionSpec, descriptions: bool) -> dict[str, Any]:
    """``bev.region`` resolved: polygons as given; a mask as its content (run lengths, shape and
    SHA-256, so the store re-parses without the file); for the hash (``descriptions=False``) a
    mask is its shape and content hash only (not its file name)."""
    from .region import mask_runs

    out: dict[str, Any] = {}
    if region.polygons is not None:
        out["keep"] = [[list(v) for v in polygon] for polygon in region.polygons]
    elif region.mask is not None:
        shape = [region.mask_shape[0], region.mask_shape[1]]
        keep: dict[str, Any] = {"shape": shape, "sha256": region.mask_sha256}
        if descriptions:
            keep = {"mask": region.mask_file, "shape": shape, "sha256": region.mask_sha256, "runs": mask_runs(region.mask)}
        out["keep"] = keep
    if region.rings:
        out["rings"] = [{"beyond_m": ring.beyond_m, "factor": ring.factor} for ring in region.rings]
    return out


def _pose_dict(
    pose_form: str, rotation_wxyz: Sequence[float] | None, translation: Sequence[float] | None, matrix: Matrix4
) -> dict[str, Any]:
    """A pose as it was given: ``rotation_wxyz`` + ``translation``, or ``sensor2ego``."""
    if pose_form == "quaternion":
        assert rotation_wxyz is not None and translation is not None
        return {"rotation_wxyz": list(rotation_wxyz), "translation": list(translation)}
    return {"sensor2ego": [list(row) for row in matrix]}


def canonical_json(data: Any) -> str:
    """Canonical JSON: sorted keys, no whitespace, shortest round-trip floats, no NaN."""
    return json.dumps(data, sort_keys=True, separators=(",", ":"), allow_nan=False, ensure_ascii=True)


def config_sha256(rig: RigConfig) -> str:
    """SHA-256 (hex) of the canonical JSON of the resolved config, descriptions excluded."""
    return hashlib.sha256(canonical_json(config_to_dict(rig, descriptions=False)).encode()).hexdigest()
