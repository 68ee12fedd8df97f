"""PETR's 3D position coordinates (``--to petr-coords3d``): against PETR's own
``position_embeding`` in torch (tests/upstream.py), the image-padding mask against
``F.interpolate``, the lens path, the options, and the ``inspect`` / ``verify`` plug-in."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml

from bevcompile.errors import UsageError
from bevcompile.grid.build import run_grid
from bevcompile.interop.export import run_export_interop
from bevcompile.interop.petr import PetrOptions, build_petr_coords, padding_mask, petr_depths
from bevcompile.rig.config import RigConfig, parse_config
from bevcompile.store.inspection import inspect_store
from bevcompile.store.loader import load
from bevcompile.store.verify import verify_store

from .. import damage, rigs, upstream

CALIBRATION = rigs.ROOT / "configs" / "nuscenes_calibration.yaml"


def petr_800x320_data() -> dict[str, Any]:
    """nuScenes written out by hand with PETR's 800x320 test settings: lidar frame, resize 0.5,
    bottom crop top 130, stride 16 (50 x 20 feature map)."""
    data = yaml.safe_load(CALIBRATION.read_text())
    data["name"] = "petr-by-hand"
    data["image_aug"] = {"resize": 0.5, "crop": [0, 130], "input_size": [800, 320]}
    data["feature"] = {"stride": 16, "pixel_mapping": "corner"}
    data["bev"] = {"x": [-51.2, 51.2, 0.8], "y": [-51.2, 51.2, 0.8], "z": [-5.0, 3.0], "heights": [0.0], "frame": "LIDAR_TOP"}
    return data


@functools.lru_cache(maxsize=2)
def petr_upstream(lid: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """PETR's own ``position_embeding`` (torch float32) on the nuScenes car."""
    data = yaml.safe_load(CALIBRATION.read_text())
    by_name = {c["name"]: c for c in data["cameras"]}
    lidar2img = []
    for camera in data["cameras"]:
        rot, tran = upstream.mmdet3d_sensor2lidar(by_name[camera["name"]], data["sensors"][0])
        viewpad = upstream.petr_resize_crop_intrinsics(camera["intrinsic"], 0.5, (0, 130))
        lidar2img.append(viewpad @ upstream.mmdet3d_lidar2img(rot, tran, np.eye(3)))
    return upstream.petr_position_coords_torch(lidar2img, (320, 800), (20, 50), lid=lid)


def test_float32_equals_petr_position_embeding_bit_for_bit_and_float64_is_within_3e_7() -> None:
    """``precision float32``: PETR's own torch float32 run (megvii-research/PETR petr_head.py
    @0677620), every coordinate of the 6 x 192 x 20 x 50 tensor and the mask, for LID (no pixel
    masked) and uniform depths (459 of 6,000 pixels masked: the far points of the lower rows leave
    the +-10 m z range).
    float64 (the lens model in float64, rounded once): measured on nuScenes, 453,219 of
    1,152,000 coordinates differ, by at most 2.98e-7 (3.6e-5 m of the 122.4 m range)."""
    rig = parse_config(petr_800x320_data())
    for lid, n_masked in ((True, 0), (False, 459)):
        coords, mask = petr_upstream(lid)
        ours = build_petr_coords(rig, PetrOptions(lid=lid, precision="float32"))
        assert np.array_equal(ours.coords3d, coords), lid
        assert np.array_equal(ours.coords_mask, mask) and int(mask.sum()) == n_masked
    coords, _ = petr_upstream(True)
    exact = build_petr_coords(rig, PetrOptions())
    differ = int(np.count_nonzero(exact.coords3d != coords))
    assert 400_000 < differ < 500_000
    assert float(np.max(np.abs(exact.coords3d.astype(np.float64) - coords))) < 3e-7


def test_depths_are_petr_lid_and_uniform_bins() -> None:
    lid = petr_depths(PetrOptions())
    b = (61.2 - 1.0) / (64 * 65)
    assert lid[0] == 1.0 and lid[1] == pytest.approx(1.0 + 2 * b) and lid[63] == pytest.approx(1.0 + b * 63 * 64)
    uniform = petr_depths(PetrOptions(lid=False, depth_num=4, depth_start=2.0, position_range=(-10.0, -10.0, -2.0, 10.0, 10.0, 2.0)))
    assert np.allclose(uniform, [2.0, 4.0, 6.0, 8.0])


def test_padding_mask_is_the_nearest_interpolated_padding() -> None:
    """PETR's ``masks``: 0 inside ``img_shape``, 1 in the padding, ``F.interpolate`` (nearest) to
    the feature map. A 800 x 330 crop padded to 800 x 352 (stride 16: 50 x 22)."""
    data = petr_800x320_data()
    data["image_aug"] = {"resize": 0.5, "crop": [0, 120], "input_size": [800, 352], "pad": [0, 22]}
    rig = parse_config(data)
    masks = torch.ones((1, rig.n_cam, 352, 800))
    masks[:, :, :330, :800] = 0
    want = torch.nn.functional.interpolate(masks, size=(22, 50)).to(torch.bool)[0].numpy()
    assert want.any() and np.array_equal(padding_mask(rig), want)
    assert np.array_equal(build_petr_coords(rig).coords_mask & want, want)


def test_lens_cameras_lift_through_the_lens_and_float32_refuses_them() -> None:
    rig = rigs.small_rig(distortion=True)
    with pytest.raises(UsageError, match=r"--precision float32 restates PETR's pinhole position embedding; camera FRONT has a opencv lens"):
        build_petr_coords(rig, PetrOptions(precision="float32"))
    result = build_petr_coords(rig, PetrOptions(depth_num=8, position_range=(-30.0, -30.0, -5.0, 30.0, 30.0, 5.0)))
    assert result.coords3d.shape == (rig.n_cam, 24, *reversed(rig.feature_size)) and np.isfinite(result.coords3d).all()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"depth_num": 0}, r"depth_num must be an integer in \[1, 1024\], got 0"),
        ({"depth_start": -1.0}, r"depth_start must be > 0, got -1.0"),
        ({"position_range": [1, 0, 0, 0, 1, 1]}, r"position_range must be six numbers with min < max per axis"),
        ({"depth_start": 70.0}, r"position_range max x \(61.2\) must exceed depth_start \(70\)"),
        ({"lid": "yes"}, r"lid must be a boolean, got 'yes'"),
        ({"bins": 3}, r"unknown petr-coords3d build option\(s\): bins"),
    ],
)
def test_bad_options_are_refused(options: dict[str, Any], message: str) -> None:
    with pytest.raises(UsageError, match=message):
        PetrOptions.from_dict(options)


def test_options_round_trip() -> None:
    options = PetrOptions(depth_num=32, lid=False, precision="float32")
    assert PetrOptions.from_dict(options.to_dict()) == options
    assert PetrOptions.from_dict({}) == PetrOptions()


def _store(tmp_path: Path) -> tuple[RigConfig, Path]:
    rig = rigs.small_rig(heights=(0.0,), bev_half_m=12.0, pixel_mapping="corner")
    store = run_grid(rig, tmp_path).store
    run_export_interop(store, {"petr-coords3d": PetrOptions(depth_num=16, position_range=(-30.0, -30.0, -5.0, 30.0, 30.0, 5.0)).to_dict()})
    return rig, store


def test_a_petr_store_passes_inspect_and_verify_and_damage_fails(tmp_path: Path) -> None:
    """inspect rebuilds the coordinates and re-derives the mask; verify projects every stored
    point back through the rig (within 0.05 input px of the pixel PETR lifts); a moved
    coordinate fails the rebuild, a flipped mask entry the mask rule."""
    _rig, store = _store(tmp_path)
    assert inspect_store(store).passed
    rows = [r for r in verify_store(store).rows if r.product == "interop/petr_coords3d"]
    assert len(rows) == 1 and rows[0].passed and rows[0].max_abs < 0.05
    coords = np.asarray(load(store)["interop"]["petr_coords3d"]).copy()
    coords[0, 5, 1, 1] += 0.01
    moved = damage.copy_store(store, tmp_path / "moved.zarr")
    damage.rewrite_array(moved, "interop/petr_coords3d", coords)
    assert ("petr_matches_rebuild", "interop/petr_coords3d") in [(c.name, c.array) for c in inspect_store(moved).failures]
    assert not verify_store(moved).passed
    mask = np.asarray(load(store)["interop"]["petr_coords_mask"]).copy()
    mask[0, 0, 0] = ~mask[0, 0, 0]
    damage.rewrite_array(store, "interop/petr_coords_mask", mask)
    assert ("mask_rule", "interop/petr_coords_mask") in [(c.name, c.array) for c in inspect_store(store).failures]
