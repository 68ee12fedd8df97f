"""Model presets: every setting a model family fixes, taken from that model's released config.

``preset: <name>`` in a rig config (``bevcompile presets`` lists them) fills the camera order,
the test-time image augmentation (computed from each camera's image size by the model's own
rule), the feature map(s) and pixel mapping, the BEV ranges, steps, frame and heights, the depth
bins and the ``interop:`` settings (rounding, overlap policy, precision); explicit config fields
override it (:func:`bevcompile.rig.config.parse_config` applies it). Each value names the
repository, file and commit it was read from (:class:`Source`) and each preset the test that
proves it against a restatement of the model's own code path.

Pure data and arithmetic; nothing here reads files. May import nothing of bevcompile but
:mod:`bevcompile.errors` (the rule of :mod:`bevcompile.rig`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

NUSCENES_ORDER = ("CAM_FRONT", "CAM_FRONT_RIGHT", "CAM_FRONT_LEFT", "CAM_BACK", "CAM_BACK_LEFT", "CAM_BACK_RIGHT")
"""mmdet3d's info files (``camera_types`` of its nuScenes converter): BEVFormer, Fast-BEV, PETR."""
BEVDET_ORDER = ("CAM_FRONT_LEFT", "CAM_FRONT", "CAM_FRONT_RIGHT", "CAM_BACK_LEFT", "CAM_BACK", "CAM_BACK_RIGHT")
"""``data_config['cams']`` of BEVDet and BEVDepth."""

_BEVDET = ("byounghun24/BEVDet", "d5132c43836350bbea9f84ee2c865fbde57a78b0")  # a dev3.0 fork of HuangJunJie2017/BEVDet
_BEVDET_CODE = ("byounghun24/BEVDet", "15e21d410747b8a53319e2df7b12da4121bf5d09")
_BEVDEPTH = "Megvii-BaseDetection/BEVDepth"
_BEVFORMER = "fundamentalvision/BEVFormer"
_FASTBEV = "Sense-GVT/Fast-BEV"
_PETR = "megvii-research/PETR"
_MMDET3D = ("open-mmlab/mmdetection3d", "010cd4ba8dc6b2ce749216ada9c0e25ab764bb3e")


@dataclass(frozen=True)
class Source:
    """Where one preset setting comes from: ``setting`` (the config field it fills), ``value``
    (as the upstream file writes it), and the repository, file and commit."""

    setting: str
    value: str
    repo: str
    path: str
    commit: str

    def to_json(self) -> dict[str, str]:
        return {"setting": self.setting, "value": self.value, "repo": self.repo, "path": self.path, "commit": self.commit}


OWN_EGO = "own"
"""``SamplePoses.key`` of a model that keys every camera to the ego pose of its own exposure."""


@dataclass(frozen=True)
class SamplePoses:
    """How the model folds one sample's ego motion into each camera's pose (docs/models.md,
    "Per-sample ego motion"): the camera's pose in the ego frame of the moment ``key`` fired
    (a sensor name, or :data:`OWN_EGO`: each camera its own exposure, so the pose is the static
    calibration), composed from the records rounded to float32 first (``float32_records``: the
    model makes float32 tensors of them before composing) or in float64; ``rule`` and
    ``source`` say where upstream does it."""

    key: str
    float32_records: bool
    rule: str
    source: Source
    compose: str = "float64"
    """``float64`` (numpy) or ``torch-float32``: the model composes float32 tensors with torch, whose
    ``inverse`` and ``@`` round as the installed torch's CPU kernels do (numpy's float32 LAPACK
    gives other bits), so the recipe calls the installed torch."""

    def sensor2ego(self, camera: str, camera2ego: Any, ego2global: Mapping[str, Any]) -> np.ndarray:
        """The 4x4 ``sensor2ego`` to write for ``camera`` (float64): ``inv(ego2global[key]) @
        ego2global[camera] @ camera2ego`` of the 4x4 records (each first rounded to float32 when
        ``float32_records``; :data:`OWN_EGO`: ``key = camera``), composed as ``compose`` says.
        ``ego2global``: the sample's ego poses (4x4, ego -> global) by sensor name."""
        def record(matrix: Any) -> np.ndarray:
            m = np.asarray(matrix, dtype=np.float64)
            return m.astype(np.float32).astype(np.float64) if self.float32_records else m

        key = camera if self.key == OWN_EGO else self.key
        if self.compose == "torch-float32":
            try:
                import torch
            except ImportError as exc:  # pragma: no cover - torch is in the test extras
                raise ImportError(f"the per-sample poses of this model compose float32 tensors with torch: pip install torch ({exc})") from exc
            tensors = [torch.tensor(np.asarray(m, dtype=np.float64), dtype=torch.float32) for m in (ego2global[key], ego2global[camera], camera2ego)]
            return np.asarray((tensors[0].inverse() @ tensors[1] @ tensors[2]).numpy(), dtype=np.float64)
        return np.asarray(np.linalg.inv(record(ego2global[key])) @ record(ego2global[camera]) @ record(camera2ego))

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "float32_records": self.float32_records, "compose": self.compose, "rule": self.rule, "source": self.source.to_json()}


AugRule = Callable[[int, int], dict[str, Any]]
"""``(image width, image height) -> image_aug`` (resize, crop, input_size, pad) of one camera."""


def bevdet_test_aug(input_w: int, input_h: int, resize_test: float = 0.0, crop_h: tuple[float, float] = (0.0, 0.0)) -> AugRule:
    """BEVDet's test-time ``sample_augmentation`` (``PrepareImageInputs``): ``resize = fW / W +
    resize_test``, resized ``(int(W r), int(H r))``, ``crop_h = int((1 - mean(crop_h)) newH) - fH``
    (the bottom of the image is kept), ``crop_w = int(max(0, newW - fW) / 2)``."""

    def rule(width: int, height: int) -> dict[str, Any]:
        return _bottom_aligned(width, height, float(input_w) / float(width) + resize_test, input_w, input_h, crop_h)

    return rule


def _bottom_aligned(width: int, height: int, resize: float, input_w: int, input_h: int, pct: tuple[float, float]) -> dict[str, Any]:
    """BEVDet's test crop of an image resized by ``resize`` to ``(int(W r), int(H r))``: ``top =
    int((1 - mean(pct)) newH) - fH`` (the bottom kept), ``left = int(max(0, newW - fW) / 2)``."""
    new_w, new_h = int(width * resize), int(height * resize)
    top = int((1 - (pct[0] + pct[1]) / 2) * new_h) - input_h
    left = int(max(0, new_w - input_w) / 2)
    return {"resize": resize, "crop": [left, top], "input_size": [input_w, input_h]}


def bevdepth_test_aug(input_w: int, input_h: int, bot_pct: tuple[float, float] = (0.0, 0.0)) -> AugRule:
    """BEVDepth's test-time ``sample_ida_augmentation`` (and PETR's ``ResizeCropFlipImage``
    ``_sample_augmentation``, the same rule): ``resize = max(fH / H, fW / W)``, then BEVDet's crop
    (bottom kept by ``bot_pct_lim``, centred horizontally)."""

    def rule(width: int, height: int) -> dict[str, Any]:
        return _bottom_aligned(width, height, max(input_h / height, input_w / width), input_w, input_h, bot_pct)

    return rule


def fastbev_test_aug(input_w: int, input_h: int, test_resize: float = 0.0) -> AugRule:
    """Fast-BEV's test-time ``RandomAugImageMultiViewImage.sample_augmentation``: ``resize = fW / W
    + test_resize``, a CENTRED crop ``((newW - fW) // 2, (newH - fH) // 2)``."""

    def rule(width: int, height: int) -> dict[str, Any]:
        resize = float(input_w) / float(width) + test_resize
        new_w, new_h = int(width * resize), int(height * resize)
        return {"resize": resize, "crop": [(new_w - input_w) // 2, (new_h - input_h) // 2], "input_size": [input_w, input_h]}

    return rule


def bevformer_test_aug(scale: float, size_divisor: int = 32) -> AugRule:
    """BEVFormer's test pipeline: ``RandomScaleImageMultiViewImage(scales=[scale])`` (images
    ``(int(W s), int(H s))``, ``lidar2img`` scaled) then ``PadMultiViewImage(size_divisor)``
    (zeros appended right and bottom; ``img_shape`` is the padded shape)."""

    def rule(width: int, height: int) -> dict[str, Any]:
        w, h = int(width * scale), int(height * scale)
        padded_w, padded_h = -(-w // size_divisor) * size_divisor, -(-h // size_divisor) * size_divisor
        aug: dict[str, Any] = {"resize": float(scale), "crop": [0, 0], "input_size": [padded_w, padded_h]}
        if (padded_w, padded_h) != (w, h):
            aug["pad"] = [padded_w - w, padded_h - h]
        return aug

    return rule


@dataclass(frozen=True)
class Preset:
    """One model's fixed settings.

    ``fields``: config sections as a config writes them (``feature``, ``bev``, ``depth``,
    ``interop``, ``camera_order``); ``image_aug``: the model's test-time rule per camera image
    size; ``frame_sensor``: the sensor ``bev.frame`` names (the config must list it);
    ``sources``: where every value comes from; ``proof``: the test that restates the model's
    code path and compares.
    """

    name: str
    title: str
    fields: Mapping[str, Any]
    image_aug: AugRule
    image_aug_rule: str
    sources: tuple[Source, ...]
    proof: str
    sample_poses: SamplePoses
    notes: tuple[str, ...] = field(default=())

    @property
    def frame_sensor(self) -> str | None:
        frame = self.fields.get("bev", {}).get("frame", "ego")
        return None if frame == "ego" else str(frame)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "title": self.title,
            "fields": plain_data(self.fields),
            "image_aug_rule": self.image_aug_rule,
            "sources": [s.to_json() for s in self.sources],
            "proof": self.proof,
            "sample_poses": self.sample_poses.to_json(),
            "notes": list(self.notes),
        }


def plain_data(value: Any) -> Any:
    """Frozen data (mappings, mapping proxies, tuples) -> plain dicts (str keys) and lists, as
    JSON and YAML writers take it (the rig's attributes and presets; ``report.diff`` uses it too)."""
    if isinstance(value, Mapping):
        return {str(k): plain_data(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain_data(v) for v in value]
    return value


def _src(setting: str, value: str, repo: str, path: str, commit: str) -> Source:
    return Source(setting, value, repo, path, commit)


# BEVFormer's pillar: zs = linspace(0.5, Z - 0.5, 4) / Z, z = zs * (pc_range[5] - pc_range[2]) + pc_range[2]
# with Z = 8: z = -5 + 0.5 + k * 7 / 3 = -4.5, -13/6, 1/6, 2.5 m (lidar frame)
_BEVFORMER_HEIGHTS = (-4.5, -13.0 / 6.0, 1.0 / 6.0, 2.5)

_BEVDET_SOURCES = (
    _src("camera_order", "data_config['cams'] = ['CAM_FRONT_LEFT', 'CAM_FRONT', 'CAM_FRONT_RIGHT', 'CAM_BACK_LEFT', 'CAM_BACK', 'CAM_BACK_RIGHT']",
         _BEVDET[0], "configs/bevdet/bevdet-r50.py", _BEVDET[1]),
    _src("image_aug", "data_config: input_size (256, 704), src_size (900, 1600), resize_test 0.00, crop_h (0.0, 0.0); "
         "PrepareImageInputs.sample_augmentation (test): resize = fW / W + resize_test, crop_h = int((1 - mean(crop_h)) * newH) - fH, "
         "crop_w = int(max(0, newW - fW) / 2)", _BEVDET[0], "configs/bevdet/bevdet-r50.py + mmdet3d/datasets/pipelines/loading.py", _BEVDET[1]),
    _src("feature", "downsample=16; create_frustum: x = linspace(0, W_in - 1, W_feat), y = linspace(0, H_in - 1, H_feat)",
         _BEVDET_CODE[0], "configs/bevdet/bevdet-r50.py + mmdet3d/models/necks/view_transformer.py", _BEVDET_CODE[1]),
    _src("bev", "grid_config x [-51.2, 51.2, 0.8], y [-51.2, 51.2, 0.8], z [-5, 3, 8]; prepare_inputs: "
         "sensor2keyegos = inv(ego2global[cam 0]) @ ego2global @ sensor2ego (the key ego frame)",
         _BEVDET_CODE[0], "configs/bevdet/bevdet-r50.py + mmdet3d/models/detectors/bevdet.py", _BEVDET_CODE[1]),
    _src("interop.bevpoolv2", "voxel_pooling_prepare_v2: coor = ((coor - grid_lower_bound) / grid_interval).long() (toward zero), float32 tensors",
         _BEVDET_CODE[0], "mmdet3d/models/necks/view_transformer.py", _BEVDET_CODE[1]),
)

_BEVDET_POSES = SamplePoses(
    key="CAM_FRONT_LEFT",
    float32_records=True,
    rule="key = camera 0 (CAM_FRONT_LEFT); get_sensor_transforms makes float32 tensors (torch.Tensor) of sensor2ego and ego2global, "
    "prepare_inputs composes inv(keyego2global.double()) @ ego2global.double() @ sensor2ego.double() and casts .float()",
    source=_src("sample_poses", "PrepareImageInputs.get_sensor_transforms: torch.Tensor(Quaternion(...).rotation_matrix), torch.Tensor(translation); "
                "BEVDet.prepare_inputs: sensor2keyegos = (global2keyego @ ego2globals.double() @ sensor2egos.double()).float()",
                _BEVDET_CODE[0], "mmdet3d/datasets/pipelines/loading.py + mmdet3d/models/detectors/bevdet.py", _BEVDET_CODE[1]),
)
_BEVDEPTH_POSES = SamplePoses(
    key=OWN_EGO,
    float32_records=True,
    rule="key_info[cam]: every camera is keyed to the ego pose of its OWN exposure: sweepsensor2keyego = inv(keyego2global[cam]) @ "
    "sweepego2global[cam] @ sensor2ego[cam] in torch float32 (for the key frame the static calibration up to the float32 rounding of inv(E) @ E)",
    compose="torch-float32",
    source=_src("sample_poses", "get_image: keyego2global from key_info[cam]['ego_pose'], sweepego2global from cam_info[cam]['ego_pose'] "
                "(the same record in the key frame); sweepsensor2keyego = global2keyego @ sweepego2global @ sweepsensor2sweepego (torch.Tensor, float32)",
                _BEVDEPTH, "bevdepth/datasets/nusc_det_dataset.py", "61d4e0c6e2033d2ceb9b72ac70df8ce11bbe79ca"),
)
_MMDET3D_POSES = SamplePoses(
    key="LIDAR_TOP",
    float32_records=False,
    rule="obtain_sensor2top (numpy float64): the camera in the lidar frame of the lidar sample, through both ego poses; "
    "with bev.frame LIDAR_TOP write the camera in the lidar sample's ego frame",
    source=_src("sample_poses", "obtain_sensor2top: R = (l2e_r_s.T @ e2g_r_s.T) @ (inv(e2g_r).T @ inv(l2e_r).T), float64 numpy",
                _MMDET3D[0], "tools/data_converter/nuscenes_converter.py", _MMDET3D[1]),
)

PRESETS: dict[str, Preset] = {}


def _register(preset: Preset) -> None:
    PRESETS[preset.name] = preset


_register(Preset(
    name="bevdet-r50",
    title="BEVDet-R50 (dev3.0)",
    fields={
        "camera_order": list(BEVDET_ORDER),
        "feature": {"stride": 16, "pixel_mapping": "linspace"},
        "bev": {"x": [-51.2, 51.2, 0.8], "y": [-51.2, 51.2, 0.8], "z": [-5.0, 3.0, 8.0], "heights": [0.0], "frame": "ego"},
        "depth": {"bins": [1.0, 60.0, 1.0]},
        "interop": {"bevpoolv2": {"frustum_mapping": "linspace", "rounding": "trunc", "precision": "float32"}},
    },
    image_aug=bevdet_test_aug(704, 256, resize_test=0.0, crop_h=(0.0, 0.0)),
    image_aug_rule="BEVDet test-time: resize = 704 / W, bottom-aligned crop (1600x900 -> resize 0.44, crop [0, 140])",
    sources=(*_BEVDET_SOURCES, _src("depth", "grid_config depth [1.0, 60.0, 1.0]", _BEVDET[0], "configs/bevdet/bevdet-r50.py", _BEVDET[1])),
    proof="tests/rig/test_presets.py::test_bevdet_r50_preset_equals_bevdet_dev3_code_path",
    sample_poses=_BEVDET_POSES,
))

_register(Preset(
    name="bevdepth-r50",
    title="BEVDepth-R50 (Megvii)",
    fields={
        "camera_order": list(BEVDET_ORDER),
        "feature": {"stride": 16, "pixel_mapping": "linspace"},
        "bev": {"x": [-51.2, 51.2, 0.8], "y": [-51.2, 51.2, 0.8], "z": [-5.0, 3.0, 8.0], "heights": [0.0], "frame": "ego"},
        "depth": {"bins": [2.0, 58.0, 0.5]},
        "interop": {"bevpoolv2": {"frustum_mapping": "linspace", "rounding": "trunc", "precision": "float32"}},
    },
    image_aug=bevdepth_test_aug(704, 256, bot_pct=(0.0, 0.0)),
    image_aug_rule="BEVDepth test-time: resize = max(256 / H, 704 / W), bottom-aligned crop (1600x900 -> resize 0.44, crop [0, 140])",
    sources=(
        _src("camera_order", "ida_aug_conf['cams'] = ['CAM_FRONT_LEFT', 'CAM_FRONT', 'CAM_FRONT_RIGHT', 'CAM_BACK_LEFT', 'CAM_BACK', 'CAM_BACK_RIGHT']",
             _BEVDEPTH, "bevdepth/exps/nuscenes/base_exp.py", "03a4caaa4766ab85a26faee1927a822ceab473ba"),
        _src("image_aug", "final_dim (256, 704), H 900, W 1600, bot_pct_lim (0.0, 0.0); sample_ida_augmentation (test): resize = max(fH / H, fW / W)",
             _BEVDEPTH, "bevdepth/exps/nuscenes/base_exp.py", "03a4caaa4766ab85a26faee1927a822ceab473ba"),
        _src("feature", "downsample_factor 16; create_frustum: x_coords = linspace(0, ogfW - 1, fW)",
             _BEVDEPTH, "bevdepth/layers/backbones/base_lss_fpn.py", "056cf66a16b295a33432d377784e51479ce53b3a"),
        _src("bev", "x_bound [-51.2, 51.2, 0.8], y_bound [-51.2, 51.2, 0.8], z_bound [-5, 3, 8] (sensor2ego_mats: camera -> key ego)",
             _BEVDEPTH, "bevdepth/exps/nuscenes/base_exp.py", "03a4caaa4766ab85a26faee1927a822ceab473ba"),
        _src("depth", "d_bound [2.0, 58.0, 0.5]", _BEVDEPTH, "bevdepth/exps/nuscenes/base_exp.py", "03a4caaa4766ab85a26faee1927a822ceab473ba"),
        _src("interop.bevpoolv2", "geom_xyz = ((geom_xyz - (voxel_coord - voxel_size / 2.0)) / voxel_size).int() (toward zero)",
             _BEVDEPTH, "bevdepth/layers/backbones/base_lss_fpn.py", "056cf66a16b295a33432d377784e51479ce53b3a"),
    ),
    proof="tests/rig/test_presets.py::test_bevdepth_r50_preset_equals_bevdepth_get_geometry",
    sample_poses=_BEVDEPTH_POSES,
    notes=(
        "BEVDepth pools with its own voxel_pooling CUDA op; the BEVPoolv2 arrays hold the same point -> voxel assignment.",
        "Precision: the released checkpoints were trained with PyTorch Lightning precision=16 (bevdepth/exps/base_cli.py @1f0d954), "
        "so get_geometry's matmuls ran in float16 under autocast; this preset's interop arrays reproduce BEVDepth's float32 path (interop "
        "precision float32); bevcompile matrix --precision float16 reproduces the float16 one (points that overflow float16 beyond ~41 m "
        "are dropped, as BEVDepth's CPU run drops them): tests/matrix/test_lift16.py.",
    ),
))

_BEVFORMER_SOURCES = (
    _src("camera_order", "camera_types = ['CAM_FRONT', 'CAM_FRONT_RIGHT', 'CAM_FRONT_LEFT', 'CAM_BACK', 'CAM_BACK_LEFT', 'CAM_BACK_RIGHT'] (the info files)",
         _MMDET3D[0], "tools/data_converter/nuscenes_converter.py", _MMDET3D[1]),
    _src("bev", "point_sampling: lidar2img (lidar frame); point_cloud_range [-51.2, -51.2, -5.0, 51.2, 51.2, 3.0]; get_reference_points: "
         "xs = linspace(0.5, W - 0.5, W) / W, zs = linspace(0.5, Z - 0.5, num_points_in_pillar) / Z",
         _BEVFORMER, "projects/mmdet3d_plugin/bevformer/modules/encoder.py", "001242c6e2a6a4919a1342cc38b79e56d3921512"),
    _src("feature", "point_sampling: reference_points_cam /= img_shape (padded); MSDeformAttn: grid_sample(2 * loc - 1, align_corners=False)",
         _BEVFORMER, "projects/mmdet3d_plugin/bevformer/modules/encoder.py", "001242c6e2a6a4919a1342cc38b79e56d3921512"),
    _src("image_aug", "PadMultiViewImage(size_divisor=32): img_shape = padded shape; RandomScaleImageMultiViewImage: lidar2img = scale_factor @ lidar2img",
         _BEVFORMER, "projects/mmdet3d_plugin/datasets/pipelines/transform_3d.py", "2f37d0d4932b064dce49154aef7173688410420f"),
)

_register(Preset(
    name="bevformer-base",
    title="BEVFormer-base",
    fields={
        "camera_order": list(NUSCENES_ORDER),
        "feature": {"levels": [{"stride": s} for s in (8, 16, 32, 64)], "pixel_mapping": "normalized", "size_rule": "ceil"},
        "bev": {"x": [-51.2, 51.2, 0.512], "y": [-51.2, 51.2, 0.512], "z": [-5.0, 3.0], "heights": list(_BEVFORMER_HEIGHTS), "frame": "LIDAR_TOP"},
    },
    image_aug=bevformer_test_aug(1.0),
    image_aug_rule="BEVFormer-base test: full resolution, padded to a multiple of 32 (1600x900 -> input 1600x928, pad [0, 28])",
    sources=(
        *_BEVFORMER_SOURCES,
        _src("bev", "bev_h_ = 200, bev_w_ = 200, num_points_in_pillar=4; test_pipeline: PadMultiViewImage(size_divisor=32), img_scale (1600, 900)",
             _BEVFORMER, "projects/configs/bevformer/bevformer_base.py", "13db21e27307a5ef75403000115e5eef2b6da7d3"),
        _src("feature", "img_backbone out_indices (1, 2, 3) (strides 8, 16, 32); img_neck FPN num_outs=4, add_extra_convs='on_output' (stride 64: "
             "ceil(928 / 64) = 15 rows); _num_levels_ = 4", _BEVFORMER, "projects/configs/bevformer/bevformer_base.py", "13db21e27307a5ef75403000115e5eef2b6da7d3"),
    ),
    proof="tests/rig/test_presets.py::test_bevformer_presets_equal_bevformer_point_sampling",
    sample_poses=_MMDET3D_POSES,
))

_register(Preset(
    name="bevformer-tiny",
    title="BEVFormer-tiny",
    fields={
        "camera_order": list(NUSCENES_ORDER),
        "feature": {"stride": 32, "pixel_mapping": "normalized"},
        "bev": {"x": [-51.2, 51.2, 2.048], "y": [-51.2, 51.2, 2.048], "z": [-5.0, 3.0], "heights": list(_BEVFORMER_HEIGHTS), "frame": "LIDAR_TOP"},
    },
    image_aug=bevformer_test_aug(0.5),
    image_aug_rule="BEVFormer-tiny test: scale 0.5, padded to a multiple of 32 (1600x900 -> 800x450, input 800x480, pad [0, 30])",
    sources=(
        *_BEVFORMER_SOURCES,
        _src("bev", "bev_h_ = 50, bev_w_ = 50; test_pipeline: RandomScaleImageMultiViewImage(scales=[0.5]), PadMultiViewImage(size_divisor=32)",
             _BEVFORMER, "projects/configs/bevformer/bevformer_tiny.py", "68e6af5628211d82261efc328d7d4d5a9ca0cf5f"),
        _src("feature", "img_backbone out_indices (3,) (stride 32), FPN num_outs=1, _num_levels_ = 1",
             _BEVFORMER, "projects/configs/bevformer/bevformer_tiny.py", "68e6af5628211d82261efc328d7d4d5a9ca0cf5f"),
    ),
    proof="tests/rig/test_presets.py::test_bevformer_presets_equal_bevformer_point_sampling",
    sample_poses=_MMDET3D_POSES,
))

_FASTBEV_SOURCES = (
    _src("camera_order", "camera_types = ['CAM_FRONT', 'CAM_FRONT_RIGHT', 'CAM_FRONT_LEFT', 'CAM_BACK', 'CAM_BACK_LEFT', 'CAM_BACK_RIGHT'] (the info files)",
         _MMDET3D[0], "tools/data_converter/nuscenes_converter.py", _MMDET3D[1]),
    _src("image_aug", "sample_augmentation (test): resize = fW / W + test_resize, crop_h_start = (newH - fH) // 2, crop_w_start = (newW - fW) // 2",
         _FASTBEV, "mmdet3d/datasets/pipelines/transforms_3d.py", "feacd875022cf2733fc1cf953f97fd735966a221"),
    _src("feature", "_compute_projection: intrinsic[:2] /= stride (feature pixel j at input j * s); stride_i = ceil(img W / feat W)",
         _FASTBEV, "mmdet3d/models/detectors/fastbev.py", "b0603230c89f7ef4d422672cb6fda476727aa78b"),
    _src("bev", "get_points: points = arange(n_voxels) * voxel_size + (origin - n_voxels / 2 * voxel_size) (voxel CORNERS); "
         "projection = intrinsic @ lidar2img (lidar frame)",
         _FASTBEV, "mmdet3d/models/detectors/fastbev.py", "b0603230c89f7ef4d422672cb6fda476727aa78b"),
    _src("bev", "KittiSetOrigin: origin = (point_cloud_range[:3] + point_cloud_range[3:]) / 2 (float32)",
         _FASTBEV, "mmdet3d/datasets/pipelines/multi_view.py", "feacd875022cf2733fc1cf953f97fd735966a221"),
    _src("interop.fastbev-lut", "backproject_inplace: x = (p0 / p2).round() (half to even), valid = 0 <= x < W and 0 <= y < H and z > 0; "
         "cameras in order, later ones overwrite (overlap 'last'); volume (C, X, Y, Z)",
         _FASTBEV, "mmdet3d/models/detectors/fastbev.py", "b0603230c89f7ef4d422672cb6fda476727aa78b"),
)
_FASTBEV_BEV = {"x": [-50.25, 49.75, 0.5], "y": [-50.25, 49.75, 0.5], "z": [-4.75, 1.25, 1.5], "heights": [-4.0, -2.5, -1.0, 0.5], "frame": "LIDAR_TOP"}
_FASTBEV_NOTES = (
    "Fast-BEV samples voxel CORNERS: points x = -50 + 0.5 i (n_voxels 200, voxel_size 0.5, origin 0); the preset writes "
    "bev.x = [-50.25, 49.75, 0.5], whose cell centres are exactly those points (z: -4, -2.5, -1, 0.5 from origin -1, 4 x 1.5 m).",
)

_register(Preset(
    name="fastbev-m0",
    title="Fast-BEV M0 (R18)",
    fields={
        "camera_order": list(NUSCENES_ORDER),
        "feature": {"stride": 4, "pixel_mapping": "corner"},
        "bev": dict(_FASTBEV_BEV),
        "interop": {"fastbev-lut": {"overlap": "last", "precision": "float32", "xyz_layout": True}},
    },
    image_aug=fastbev_test_aug(704, 256, test_resize=0.0),
    image_aug_rule="Fast-BEV test-time: resize = 704 / W, CENTRED crop (1600x900 -> resize 0.44, crop [0, 70])",
    sources=(
        *_FASTBEV_SOURCES,
        _src("feature", "multi_scale_id=[0] (FPN level 0: stride 4); n_voxels=[[200, 200, 4]], voxel_size=[[0.5, 0.5, 1.5]]; "
             "point_cloud_range = [-50, -50, -5, 50, 50, 3]; data_config input_size (256, 704), test_resize 0.0",
             _FASTBEV, "configs/fastbev/exp/paper/fastbev_m0_r18_s256x704_v200x200x4_c192_d2_f4.py", "500e4e5bc7af2adde33740af4de9be9be36569e6"),
    ),
    proof="tests/rig/test_presets.py::test_fastbev_presets_equal_fastbev_backproject_inplace",
    sample_poses=_MMDET3D_POSES,
    notes=_FASTBEV_NOTES,
))

_register(Preset(
    name="fastbev-r50-ms",
    title="Fast-BEV R50 multi-stride",
    fields={
        "camera_order": list(NUSCENES_ORDER),
        "feature": {"levels": [{"stride": s} for s in (4, 8, 16)], "pixel_mapping": "corner"},
        "bev": dict(_FASTBEV_BEV),
        "interop": {"fastbev-lut": {"overlap": "last", "precision": "float32", "xyz_layout": True}},
    },
    image_aug=fastbev_test_aug(704, 256, test_resize=0.0),
    image_aug_rule="Fast-BEV test-time: resize = 704 / W, CENTRED crop (1600x900 -> resize 0.44, crop [0, 70])",
    sources=(
        *_FASTBEV_SOURCES,
        _src("feature", "multi_scale_id=[0, 1, 2]  # 4x/8x/16x; style='v2' (img ms: one volume per level, same voxels); n_voxels=[[200, 200, 4]], "
             "voxel_size=[[0.5, 0.5, 1.5]]", _FASTBEV, "configs/fastbev/exp/paper/fastbev_r50_v2_imgms_e48_s256x704_v200x200x4_c256_d2_f4.py",
             "d16b76fc6571ef06ff97dc0a4aac4d710438bbe1"),
    ),
    proof="tests/rig/test_presets.py::test_fastbev_presets_equal_fastbev_backproject_inplace",
    sample_poses=_MMDET3D_POSES,
    notes=(*_FASTBEV_NOTES, "One LUT per level (fastbev_lut, fastbev_lut_l1, fastbev_lut_l2); Fast-BEV concatenates the levels' volumes along channels."),
))

_FASTBEV_V4_CONFIG = ("configs/fastbev/exp/paper/fastbev_r50_v4_ms_20cbgs_s256x704_v200x200x6_c256_d6_f4.py", "d16b76fc6571ef06ff97dc0a4aac4d710438bbe1")
_FASTBEV_CODE = ("mmdet3d/models/detectors/fastbev.py", "b0603230c89f7ef4d422672cb6fda476727aa78b")
_FASTBEV_AUG = ("mmdet3d/datasets/pipelines/transforms_3d.py", "feacd875022cf2733fc1cf953f97fd735966a221")
_THIRD = 1.0 / 3.0
_FASTBEV_V4_HEIGHTS = [-4.0, -3.0, -2.0, -1.0, 0.0, 1.0]
"""Fast-BEV R50 v4's voxel z: n 6 of 1 m from origin -1 (``point_cloud_range`` z -5 to 3): -4 + k."""

_register(Preset(
    name="fastbev-r50-v4",
    title="Fast-BEV R50 v4 (image + BEV multi-scale)",
    fields={
        "camera_order": list(NUSCENES_ORDER),
        "feature": {
            "levels": [
                {"stride": 4},
                {"stride": 8, "bev": {"x": [-50.0 - _THIRD, 50.0 - _THIRD, 2.0 / 3.0], "y": [-50.0 - _THIRD, 50.0 - _THIRD, 2.0 / 3.0]}},
                {"stride": 16, "bev": {"x": [-50.5, 49.5, 1.0], "y": [-50.5, 49.5, 1.0]}},
            ],
            "pixel_mapping": "corner",
        },
        "bev": {"x": [-50.25, 49.75, 0.5], "y": [-50.25, 49.75, 0.5], "z": [-4.5, 1.5, 1.0], "heights": list(_FASTBEV_V4_HEIGHTS), "frame": "LIDAR_TOP"},
        "interop": {"fastbev-lut": {"overlap": "last", "precision": "float32", "xyz_layout": True}},
    },
    image_aug=fastbev_test_aug(704, 256, test_resize=0.0),
    image_aug_rule="Fast-BEV test-time: resize = 704 / W, CENTRED crop (1600x900 -> resize 0.44, crop [0, 70]); "
    "test-time augmentation: a second pass with image_aug flip: true",
    sources=(
        *_FASTBEV_SOURCES,
        _src("feature", "multi_scale_id=[0, 1, 2]  # 4x/8x/16x; style='v4'  # img/bev ms; data_config input_size (256, 704), test_resize 0.0",
             _FASTBEV, *_FASTBEV_V4_CONFIG),
        _src("bev", "n_voxels=[[200, 200, 6], [150, 150, 6], [100, 100, 6]], voxel_size=[[0.5, 0.5, 1.0], [2/3, 2/3, 1.0], [1.0, 1.0, 1.0]]; "
             "point_cloud_range = [-50, -50, -5, 50, 50, 3]", _FASTBEV, *_FASTBEV_V4_CONFIG),
        _src("bev", "extract_feat: style v3/v4 (bev ms): n_voxels, voxel_size = self.n_voxels[lvl], self.voxel_size[lvl] (one voxel grid per level); "
             "multi_scale_3d_scaler 'upsample' resizes levels 1, 2 to level 0's (X, Y) after the backprojection",
             _FASTBEV, *_FASTBEV_CODE),
        _src("image_aug.flip", "TestTimeAugImageMultiViewImage: for flip in [False, True]: data_config['test_flip'] = flip (the two passes' images "
             "and extrinsics concatenated); img_transform: if flip: post_rot = [[-1, 0], [0, 1]] @ post_rot, post_tran = [[-1, 0], [0, 1]] @ post_tran "
             "+ [crop[2] - crop[0], 0]; img.transpose(FLIP_LEFT_RIGHT)", _FASTBEV, *_FASTBEV_AUG),
        _src("image_aug.flip", "test_cfg use_tta=True; test_pipeline TestTimeAugImageMultiViewImage(data_config, is_train=False)",
             _FASTBEV, *_FASTBEV_V4_CONFIG),
        _src("image_aug.flip", "aug_test: for tta_id in range(2): extract_feat(imgs[:, 24*tta_id:24*(tta_id+1)]) with "
             "extrinsic_copy[24*tta_id:24*(tta_id+1)]; get_tta_bboxes merges the two passes' boxes", _FASTBEV, *_FASTBEV_CODE),
    ),
    proof="tests/rig/test_presets.py::test_fastbev_r50_v4_preset_equals_fastbev_per_level_and_flipped",
    sample_poses=_MMDET3D_POSES,
    notes=(
        "Fast-BEV samples voxel CORNERS: level l's points are x = -50 + s_l i (s_l = 0.5, 2/3, 1 m; origin 0); the preset writes each level's "
        "bev.x = [-50 - s_l / 2, 50 - s_l / 2, s_l], whose cell centres are those points (z: -4 to 1 m from origin -1, 6 x 1 m at every level).",
        "One voxel grid per level (feature.levels[l].bev): fastbev_lut (200 x 200 x 6), fastbev_lut_l1 (150 x 150 x 6), fastbev_lut_l2 (100 x 100 x 6); "
        "the network resizes levels 1 and 2 to 200 x 200 (bilinear, align_corners=False) after sampling them and concatenates the channels.",
        "Level 1's step 2/3 m is not exact in float32: the float32 LUT restates get_points (float32(2/3) i + new_origin), not the float32 of the cell centres.",
        "Test-time augmentation (use_tta=True): the network runs twice, on the images and on the images mirrored left-right, and merges the boxes. "
        "The preset builds the first pass; add image_aug: {flip: true} (and another name) for the second, whose tables index the mirrored images' "
        "features (u_in = 704 - u_in of the unmirrored crop, as Fast-BEV's img_transform states it).",
    ),
))

_PETR_HEAD = ("projects/mmdet3d_plugin/models/dense_heads/petr_head.py", "0677620645e3a4746c5ac6840f6b39432f098a80")
_PETR_CONFIG = ("projects/configs/petr/petr_vovnet_gridmask_p4_800x320.py", "587a9572df851845170340ddfce3c303f1cda85b")
_PETR_RANGE = [-61.2, -61.2, -10.0, 61.2, 61.2, 10.0]

_register(Preset(
    name="petr-vov-p4-800x320",
    title="PETR VoVNet-99 P4 800x320",
    fields={
        "camera_order": list(NUSCENES_ORDER),
        "feature": {"stride": 16, "pixel_mapping": "corner"},
        "bev": {"x": [-51.2, 51.2, 0.8], "y": [-51.2, 51.2, 0.8], "z": [-5.0, 3.0], "heights": [0.0], "frame": "LIDAR_TOP"},
        "interop": {"petr-coords3d": {"depth_num": 64, "depth_start": 1.0, "lid": True, "position_range": list(_PETR_RANGE), "precision": "float32"}},
    },
    image_aug=bevdepth_test_aug(800, 320, bot_pct=(0.0, 0.0)),
    image_aug_rule="PETR test-time: resize = max(320 / H, 800 / W), bottom-aligned crop (1600x900 -> resize 0.5, crop [0, 130])",
    sources=(
        _src("camera_order", "camera_types = ['CAM_FRONT', 'CAM_FRONT_RIGHT', 'CAM_FRONT_LEFT', 'CAM_BACK', 'CAM_BACK_LEFT', 'CAM_BACK_RIGHT'] (the info files)",
             _MMDET3D[0], "tools/data_converter/nuscenes_converter.py", _MMDET3D[1]),
        _src("image_aug", "ida_aug_conf final_dim (320, 800), H 900, W 1600, bot_pct_lim (0.0, 0.0); test_pipeline ResizeCropFlipImage(training=False), "
             "PadMultiViewImage(size_divisor=32) (800x320: no padding)", _PETR, *_PETR_CONFIG),
        _src("image_aug", "_sample_augmentation (test): resize = max(fH / H, fW / W), crop_h = int((1 - mean(bot_pct_lim)) * newH) - fH, "
             "crop_w = int(max(0, newW - fW) / 2); intrinsics[:2, :3] = post_rot @ intrinsics[:2, :3], intrinsics[:2, 2] += post_tran",
             _PETR, "projects/mmdet3d_plugin/datasets/pipelines/transform_3d.py", "0677620645e3a4746c5ac6840f6b39432f098a80"),
        _src("feature", "img_backbone VoVNetCP out_features ('stage4', 'stage5'), CPFPN num_outs=2; position_level = 0 (stride 16: 50 x 20); "
             "coords_w = arange(W) * pad_w / W (pixel j at input j * 16)", _PETR, *_PETR_HEAD),
        _src("bev", "get_data_info: lidar2img = viewpad @ lidar2cam_rt.T (the lidar frame); point_cloud_range [-51.2, -51.2, -5.0, 51.2, 51.2, 3.0] "
             "(PETR has no BEV grid: bev: only sizes the grid/ group every store holds)",
             _PETR, "projects/mmdet3d_plugin/datasets/nuscenes_dataset.py", "3f789cea950e69f642ac672842d9f27294bb8ee8"),
        _src("interop.petr-coords3d", "pts_bbox_head: LID=True, position_range=[-61.2, -61.2, -10.0, 61.2, 61.2, 10.0]; PETRHead defaults depth_num=64, depth_start=1",
             _PETR, *_PETR_CONFIG),
        _src("interop.petr-coords3d", "position_embeding: coords_d = depth_start + bin_size * index * (index + 1), bin_size = (position_range[3] - depth_start) / "
             "(depth_num * (1 + depth_num)); img2lidars = inv(lidar2img); coords3d normalised by position_range; coords_mask = count outside [0, 1] > D * 0.5",
             _PETR, *_PETR_HEAD),
    ),
    proof="tests/rig/test_presets.py::test_petr_preset_equals_petr_position_embeding",
    sample_poses=_MMDET3D_POSES,
    notes=(
        "PETR's product is its 3D position embedding input (interop petr-coords3d: bevcompile export-interop), not a BEV grid; "
        "its transformer attends to every feature pixel, so gather tables do not apply.",
    ),
))


def preset(name: str) -> Preset:
    """The preset ``name`` (KeyError if unknown)."""
    return PRESETS[name]
