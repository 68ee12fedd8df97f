"""bevcompile.render: the coverage picture (PNG size, colours at known cells, orientation)."""

from __future__ import annotations

import struct
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from matplotlib.image import imread

from bevcompile.errors import DependencyError, StoreError, UsageError
from bevcompile.grid.build import run_grid
from bevcompile.report.render import (
    ARROW_FRACTION,
    DPI,
    EGO_MARGIN_M,
    FIGSIZE_IN,
    UNSEEN_RGB,
    coverage_rgb,
    render_store,
)
from bevcompile.rig.config import RigConfig
from bevcompile.store.root import root_attributes
from bevcompile.store.zarr_io import open_store, write_groups

from .. import damage, rigs

EXPECTED_SIZE = (round(FIGSIZE_IN[0] * DPI), round(FIGSIZE_IN[1] * DPI))


@pytest.fixture(scope="module")
def nuscenes_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return run_grid(rigs.nuscenes_rig(), tmp_path_factory.mktemp("render")).store


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def _homogeneous_cells(coverage: np.ndarray, radius: int = 2) -> np.ndarray:
    """(ny, nx) True where every cell within ``radius`` has the same camera set (no outline nearby)."""
    n_cam, ny, nx = coverage.shape
    code = (coverage.astype(np.int64) << np.arange(n_cam)[:, None, None]).sum(axis=0)
    same = np.ones((ny, nx), dtype=bool)
    padded = np.pad(code, radius, mode="edge")
    for dy in range(-radius, radius + 1):
        for dx in range(-radius, radius + 1):
            same &= padded[radius + dy : radius + dy + ny, radius + dx : radius + dx + nx] == code
    return same


def _clear_of_drawings(rig: RigConfig, x_m: float, y_m: float, clearance_m: float = 1.5) -> bool:
    """True if (x, y) is away from the ego box and every camera arrow (segments in metres)."""
    positions = np.array([[row[3] for row in cam.ego_from_cam[:2]] for cam in rig.cameras])
    lo, hi = positions.min(axis=0) - EGO_MARGIN_M - clearance_m, positions.max(axis=0) + EGO_MARGIN_M + clearance_m
    if lo[0] <= x_m <= hi[0] and lo[1] <= y_m <= hi[1]:
        return False
    length = ARROW_FRACTION * max(rig.bev.x.max - rig.bev.x.min, rig.bev.y.max - rig.bev.y.min)
    point = np.array([x_m, y_m])
    for cam, start in zip(rig.cameras, positions, strict=True):
        axis = np.array([cam.ego_from_cam[0][2], cam.ego_from_cam[1][2]])
        direction = axis / np.linalg.norm(axis)
        t = float(np.clip((point - start) @ direction, 0.0, length))
        if np.linalg.norm(point - (start + t * direction)) < clearance_m:
            return False
    return True


def test_png_has_the_fixed_size_and_default_name(nuscenes_store: Path) -> None:
    result = render_store(nuscenes_store)
    assert result.path == nuscenes_store.parent / "nuscenes_coverage.png"
    assert _png_size(result.path) == EXPECTED_SIZE == (result.width_px, result.height_px) == (1500, 750)
    assert imread(result.path).shape == (750, 1500, 4)


def test_coverage_colours_match_grid_valid_at_known_cells(nuscenes_store: Path, nuscenes: RigConfig, tmp_path: Path) -> None:
    result = render_store(nuscenes_store, tmp_path / "cov.png")
    image = imread(result.path)[..., :3]
    valid = open_store(nuscenes_store).read("grid", "valid")[:, 0]
    assert np.array_equal(result.coverage, valid)
    colours = np.asarray(result.colours)
    bev = nuscenes.bev
    xs = np.asarray(bev.x.centres())
    ys = np.asarray(bev.y.centres())
    far = np.hypot(xs[None, :], ys[:, None]) > 12.0  # (ny, nx): away from the cameras' arrows
    quiet = _homogeneous_cells(valid) & far
    count = valid.sum(axis=0)
    picks: list[tuple[int, int]] = []
    for cam in range(nuscenes.n_cam):  # a cell each camera sees alone
        iy, ix = np.argwhere(quiet & valid[cam] & (count == 1))[0]
        picks.append((int(iy), int(ix)))
    iy, ix = np.argwhere(quiet & (count == 2))[0]
    picks.append((int(iy), int(ix)))  # an overlap
    unseen = [
        (int(iy), int(ix))
        for iy, ix in np.argwhere(_homogeneous_cells(valid, 1) & (count == 0))
        if _clear_of_drawings(nuscenes, float(xs[ix]), float(ys[iy]))
    ]
    assert unseen
    picks.append(unseen[0])
    for iy, ix in picks:
        col, row = result.pixel_of(float(xs[ix]), float(ys[iy]))
        seen = valid[:, iy, ix]
        allowed = colours[seen] if seen.any() else np.asarray([UNSEEN_RGB])
        got = image[row, col]
        # one camera: its colour; an overlap: the colour of one of the cameras (stripes), never a mix
        assert np.abs(allowed - got).max(axis=1).min() <= 1.5 / 255, f"cell iy={iy} ix={ix} cams={np.flatnonzero(seen)}: {got}"


def camera_centroid(result: Any, image: np.ndarray, names: list[str], name: str) -> tuple[float, float]:
    """(row, column) centroid of the pixels drawn in camera ``name``'s colour."""
    colour = np.asarray(result.colours[names.index(name)])
    rows, cols = np.nonzero(np.all(np.abs(image - colour) < 1.5 / 255, axis=-1))
    assert rows.size > 1000
    return float(rows.mean()), float(cols.mean())


def test_convention_render_orientation_x_forward_up_y_left_left(nuscenes_store: Path, nuscenes: RigConfig, tmp_path: Path) -> None:
    """Found from the pixels alone: the front camera's colour sits above the back camera's, and
    the front-left camera's colour left of the front-right camera's."""
    result = render_store(nuscenes_store, tmp_path / "orient.png")
    image = imread(result.path)[..., :3]
    names = list(nuscenes.camera_names)

    def centroid(name: str) -> tuple[float, float]:
        return camera_centroid(result, image, names, name)

    front, back = centroid("CAM_FRONT"), centroid("CAM_BACK")
    front_left, front_right = centroid("CAM_FRONT_LEFT"), centroid("CAM_FRONT_RIGHT")
    assert front[0] < back[0] - 200  # forward is up
    assert front_left[1] < front_right[1] - 200  # left is left
    assert result.pixel_of(40.0, 0.0)[1] < result.pixel_of(-40.0, 0.0)[1]
    assert result.pixel_of(0.0, 40.0)[0] < result.pixel_of(0.0, -40.0)[0]


def test_render_of_a_lidar_frame_store_keeps_forward_up_and_left_left(tmp_path: Path) -> None:
    """``bev.frame: LIDAR_TOP`` (nuScenes lidar: x right, y forward): the picture is drawn in that
    frame turned so that the car still drives UP -- lidar +y up, +x right -- as found from the
    pixels alone (front camera above back, front-left left of front-right), and the cells are
    the lidar frame's (``pixel_of`` takes lidar coordinates)."""
    from bevcompile.rig.config import parse_config

    rig = parse_config(rigs.in_lidar_frame(rigs.nuscenes_data()))
    result = render_store(run_grid(rig, tmp_path).store, tmp_path / "lidar.png")
    assert result.up_axis == 1
    image = imread(result.path)[..., :3]
    names = list(rig.camera_names)

    def centroid(name: str) -> tuple[float, float]:
        return camera_centroid(result, image, names, name)

    front, back = centroid("CAM_FRONT"), centroid("CAM_BACK")
    front_left, front_right = centroid("CAM_FRONT_LEFT"), centroid("CAM_FRONT_RIGHT")
    assert front[0] < back[0] - 200 and front_left[1] < front_right[1] - 200
    assert result.pixel_of(0.0, 40.0)[1] < result.pixel_of(0.0, -40.0)[1]  # lidar +y (forward) is up
    assert result.pixel_of(40.0, 0.0)[0] > result.pixel_of(-40.0, 0.0)[0]  # lidar +x (right) is right


def test_render_is_deterministic(nuscenes_store: Path, tmp_path: Path) -> None:
    first = render_store(nuscenes_store, tmp_path / "a.png").path.read_bytes()
    second = render_store(nuscenes_store, tmp_path / "b.png").path.read_bytes()
    assert first == second


def test_height_selection_and_any_height(tmp_path: Path) -> None:
    rig = rigs.small_rig(distortion=True, heights=(-0.5, 0.0, 1.0), bev_half_m=20.0)
    store = run_grid(rig, tmp_path).store
    valid = open_store(store).read("grid", "valid")
    any_height = render_store(store, tmp_path / "any.png")
    assert np.array_equal(any_height.coverage, valid.any(axis=1)) and "any of z" in any_height.height_label
    one = render_store(store, tmp_path / "one.png", height=1.0)
    assert np.array_equal(one.coverage, valid[:, 2]) and one.height_label == "z = 1 m"
    assert not np.array_equal(one.coverage, any_height.coverage)
    with pytest.raises(UsageError, match=r"--height 2 is not a sampling height of this store \(-0.5, 0, 1\)"):
        render_store(store, tmp_path / "x.png", height=2.0)


def test_second_panel_uses_the_matrix_group(nuscenes_store: Path, nuscenes: RigConfig, tmp_path: Path) -> None:
    store = damage.copy_store(nuscenes_store, tmp_path / "nuscenes.zarr")
    assert render_store(store, tmp_path / "none.png").second_panel == "cameras per cell"
    ny, nx = nuscenes.bev.ny, nuscenes.bev.nx
    rows = np.array([0, 0, 5, ny * nx - 1], dtype=np.int32)
    write_groups(store, root_attrs=root_attributes(nuscenes), groups={"matrix": rigs.group_data({"coo_row": rows})})
    assert render_store(store, tmp_path / "nnz.png").second_panel == "matrix non-zeros per BEV cell (from coo_row)"
    mass = np.random.default_rng(0).random((nuscenes.n_cam, ny, nx), dtype=np.float32)
    write_groups(store, root_attrs=root_attributes(nuscenes), groups={"matrix": rigs.group_data({"camera_mass": mass, "coo_row": rows})})
    result = render_store(store, tmp_path / "mass.png")
    assert result.second_panel == "matrix/camera_mass, summed over cameras"
    assert _png_size(result.path) == EXPECTED_SIZE


def test_coverage_rgb_stripes_overlaps_with_the_cameras_own_colours() -> None:
    """No muddy mean: an overlap cell shows each seeing camera's exact colour in diagonal stripes."""
    coverage = np.array([[[True, True, False]], [[False, True, False]]])
    red, blue = (1.0, 0.0, 0.0), (0.0, 0.0, 1.0)
    rgb = coverage_rgb(coverage, [red, blue])  # one pixel per cell: the overlap takes k = (0 + 1) % 2 -> blue
    np.testing.assert_array_equal(rgb[0], [red, blue, list(UNSEEN_RGB)])
    big = coverage_rgb(coverage, [red, blue], supersample=4)  # 4 x 4 pixels per cell, stripes 2 wide
    assert big.shape == (4, 12, 3)
    overlap = big[:, 4:8]
    k = ((np.arange(4)[:, None] + np.arange(4, 8)[None, :]) // 2) % 2
    np.testing.assert_array_equal(overlap, np.where(k[..., None] == 0, red, blue))
    assert (big[:, :4] == red).all() and (big[:, 8:] == UNSEEN_RGB).all()


def test_missing_matplotlib_is_a_dependency_error(nuscenes_store: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(DependencyError, match=r"pip install 'bevcompile\[plot\]'"):
        render_store(nuscenes_store, tmp_path / "x.png")


def test_bad_output_and_damaged_store(nuscenes_store: Path, tmp_path: Path) -> None:
    with pytest.raises(UsageError, match=r"give a \.png file name"):
        render_store(nuscenes_store, tmp_path / "x.jpg")
    (tmp_path / "dir.png").mkdir()
    with pytest.raises(UsageError, match="is a directory"):
        render_store(nuscenes_store, tmp_path / "dir.png")
    broken = damage.copy_store(nuscenes_store, tmp_path / "broken" / "nuscenes.zarr")
    damage.delete_chunk(broken, "grid/valid")
    with pytest.raises(StoreError, match="grid/valid: 1 of 6 chunk"):
        render_store(broken)
    assert not (broken.parent / "nuscenes_coverage.png").exists()


def test_a_matrix_only_store_renders_the_projection_coverage(tmp_path: Path) -> None:
    """No grid/: the coverage is the VALID RULE on the stored config's projection (what grid/valid
    would hold), labelled as such; the right panel is the matrix's."""
    from bevcompile.grid.ipm import compute_sampling_grid
    from bevcompile.matrix.build import MatrixOptions, run_matrix

    rig = rigs.small_rig()
    run_matrix(rig, tmp_path / "m", MatrixOptions(topk=4, align=4))
    result = render_store(tmp_path / "m" / "small.zarr", tmp_path / "x.png")
    assert (tmp_path / "x.png").is_file()
    assert np.array_equal(result.coverage, compute_sampling_grid(rig).valid.any(axis=1))
    assert result.second_panel.startswith("matrix/camera_mass")
    assert result.to_json()["coverage_source"] == "stored config's projection, no grid/"
    full = run_grid(rig, tmp_path / "g").store
    drawn = render_store(full, tmp_path / "y.png")
    assert np.array_equal(drawn.coverage, result.coverage) and drawn.to_json()["coverage_source"] == "grid/valid"


def test_non_finite_camera_mass_is_refused(tmp_path: Path) -> None:
    from bevcompile.matrix.build import MatrixOptions, run_matrix

    rig = rigs.small_rig()
    store = run_grid(rig, tmp_path).store
    run_matrix(rig, tmp_path, MatrixOptions(topk=4, align=4))
    mass = open_store(store).read("matrix", "camera_mass").copy()
    mass[0, 0, 0] = np.nan
    damage.rewrite_array(store, "matrix/camera_mass", mass)
    with pytest.raises(StoreError, match="matrix/camera_mass holds non-finite values; run bevcompile inspect"):
        render_store(store, tmp_path / "x.png")


def test_render_level_draws_that_levels_coverage(tmp_path: Path) -> None:
    """``--level 1`` of a ``feature.levels`` store draws ``grid_l1/valid`` (its own coverage, its
    own default file name); a level the store lacks is a one-line usage error."""
    from ..grid.test_build_levels import multi_level_rig

    store = run_grid(multi_level_rig(), tmp_path).store
    result = render_store(store, level=1)
    assert result.path.name == "small_l1_coverage.png" and result.coverage_source == "grid_l1/valid"
    valid = open_store(store).read("grid_l1", "valid")
    assert np.array_equal(result.coverage, valid.any(axis=1))
    assert render_store(store, tmp_path / "l0.png").coverage_source == "grid/valid"
    with pytest.raises(UsageError, match=r"^--level 3 is not a feature level of this store \(0 to 1\)$"):
        render_store(store, tmp_path / "x.png", level=3)


def test_render_draws_the_bev_region_outline_and_the_ring_boundaries(tmp_path: Path) -> None:
    """A bev.region store: drawn over the coverage along the kept corridor's edge y = +-8 m and along
    the 4 m ring boundary inside it (pixels that differ from the same rig's picture without a region)."""
    from typer.testing import CliRunner

    from bevcompile.cli import app

    from ..rigs import small_rig_data, write_yaml

    region_spec = {"keep": [[[-12.0, -8.0], [12.0, -8.0], [12.0, 8.0], [-12.0, 8.0]]], "rings": [{"beyond_m": 4, "factor": 2}]}
    images: dict[str, np.ndarray] = {}
    results = {}
    for label, region in (("full", None), ("region", region_spec)):
        data = small_rig_data()
        if region is not None:
            data["bev"]["region"] = region
        built = CliRunner().invoke(app, ["matrix", str(write_yaml(tmp_path / f"{label}.yaml", data)), "--topk", "4", "--out", str(tmp_path / label), "--quiet"])
        assert built.exit_code == 0, built.output
        results[label] = render_store(tmp_path / label / "small.zarr", tmp_path / f"{label}.png")
        images[label] = imread(results[label].path)[..., :3]
    changed = np.abs(images["region"] - images["full"]).sum(axis=2) > 0.3

    def changed_fraction(points: list[tuple[float, float]]) -> float:
        hits = 0
        for x, y in points:
            col, row = results["region"].pixel_of(x, y)
            hits += bool(changed[row - 2 : row + 3, col - 2 : col + 3].any())
        return hits / len(points)

    edge = [(x, 8.0) for x in np.linspace(-10.5, 10.5, 43)] + [(x, -8.0) for x in np.linspace(-10.5, 10.5, 43)]
    ring = [(4.0, y) for y in np.linspace(-3.0, 3.0, 13)] + [(x, 4.0) for x in np.linspace(-3.0, 3.0, 13)]
    inner = [(0.5 * x, 6.5) for x in np.linspace(-10.0, 10.0, 21)]  # inside, between the lines: unchanged
    assert changed_fraction(edge) > 0.9
    assert changed_fraction(ring) > 0.5
    assert changed_fraction(inner) < 0.2


def test_render_of_a_region_grid_store_draws_each_kept_cell_with_its_super_cell_coverage(tmp_path: Path) -> None:
    """A region grid store (grid/valid over the kept cells): the coverage drawn is grid/valid read
    through grid/expand (each fine cell shows its (super-)cell, outside the region no camera)."""
    from bevcompile.rig.config import parse_config

    from ..matrix.test_region import REGION

    data = rigs.small_rig_data()
    data["bev"]["region"] = REGION
    store = run_grid(parse_config(data), tmp_path).store
    result = render_store(store, tmp_path / "region.png")
    reader = open_store(store)
    valid = reader.read("grid", "valid")[:, 0]  # (n_cam, n_kept)
    expand = reader.read("grid", "expand").astype(np.int64)
    n_kept = valid.shape[1]
    for cam in range(valid.shape[0]):
        want = np.r_[valid[cam], False][expand].reshape(24, 24)
        assert np.array_equal(result.coverage[cam], want)
    assert not result.coverage[:, (expand == n_kept).reshape(24, 24)].any()
    assert result.coverage.any()
