"""The library behind ``bevcompile grid``: the options the CLI and a fleet manifest both give
(:func:`grid_command_options`), and the ``build_options`` a build records (what ``fleet --resume``
compares), pinned against real builds; and the grid command's memory estimate, measured, not
assumed: on a few sizes the estimate of :func:`bevcompile.grid.build.check_grid_memory` is at least
the peak (``ru_maxrss``) of a real ``bevcompile grid`` process."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from bevcompile.errors import UsageError
from bevcompile.grid.build import (
    GRID_BYTES_BASE,
    GRID_BYTES_PER_SAMPLE,
    GridBuildOptions,
    grid_command_options,
    run_grid,
    total_grid_cells,
)
from bevcompile.rig.config import load_config
from bevcompile.store.zarr_io import open_store

from ..rigs import NUSCENES_YAML, small_rig


@pytest.mark.parametrize(
    "given",
    [
        {},
        {"align_corners": True, "formats": ("UQ12", "opencv", "norm_int16"), "align": 32, "order": "Cache"},
        {"formats": ("pixel_q",), "frac_bits": 6, "block": 4, "max_error_px": 0.5},
        {"formats": ("pixel_q", "norm_q16"), "order": "feature", "block": 16, "max_error_px": 1},
    ],
)
def test_recorded_build_options_equal_what_a_build_records(tmp_path: Path, given: dict) -> None:  # type: ignore[type-arg]
    rig = small_rig()
    options = grid_command_options(**given).validated()
    run_grid(rig, tmp_path, **options.run_kwargs())
    reader = open_store(tmp_path / "small.zarr")
    recorded = {group: reader.group_attrs(group)["build_options"] for group in reader.groups()}
    assert options.recorded_build_options(rig) == recorded


def test_command_options_take_enumerated_values_in_any_case_and_the_cli_defaults() -> None:
    options = grid_command_options(formats=("OpenCV", "UQ12"), order="CACHE")
    assert options.formats == ("opencv", "uq12") and options.order == "cache" and options.npu is True
    assert options.validated().formats == ("uq12", "opencv")  # canonical order (FORMATS), as the store records it
    assert grid_command_options() == GridBuildOptions(npu=True)
    with pytest.raises(UsageError, match="unknown --format 'nope'"):
        grid_command_options(formats=("nope",)).validated()
    with pytest.raises(UsageError, match="--order must be one of row, cache, feature, got 'diagonal'"):
        grid_command_options(order="diagonal").validated()


MEASURE = (
    "import resource, subprocess, sys\n"
    "subprocess.run([sys.argv[1], 'grid', sys.argv[2], '--out', sys.argv[3], '--quiet'], check=True)\n"
    "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)\n"
)


@pytest.mark.parametrize("cells_per_side", [128, 400])
def test_the_grid_memory_estimate_is_not_under_the_measured_peak(tmp_path: Path, cells_per_side: int) -> None:
    step = 102.4 / cells_per_side
    text = re.sub(r"x: \[[^\]]*\]", f"x: [-51.2, 51.2, {step!r}]", NUSCENES_YAML.read_text(), count=1)
    text = re.sub(r"y: \[[^\]]*\]", f"y: [-51.2, 51.2, {step!r}]", text, count=1)
    config = tmp_path / "rig.yaml"
    config.write_text(text)
    rig = load_config(config)
    estimate = GRID_BYTES_BASE + GRID_BYTES_PER_SAMPLE * total_grid_cells(rig)
    bevcompile = Path(sys.executable).parent / "bevcompile"
    result = subprocess.run([sys.executable, "-c", MEASURE, str(bevcompile), str(config), str(tmp_path / "out")],
                            capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr
    peak = int(result.stdout)
    assert peak <= estimate, f"{cells_per_side}^2: peak {peak / 2**20:.0f} MiB > estimate {estimate / 2**20:.0f} MiB"


# --------------------------------------------------------------------------------------
# bev.region: the grid products sample the kept (super-)cells at their centres
# --------------------------------------------------------------------------------------


def region_grid_stores(tmp_path: Path, **options: object) -> tuple[Path, Path]:
    """``run_grid`` of the small rig without and with tests/matrix/test_region.REGION (also used by tests/deploy)."""
    from bevcompile.grid.build import run_grid
    from bevcompile.rig.config import parse_config

    from ..matrix.test_region import REGION
    from ..rigs import small_rig_data

    data = small_rig_data()
    full = run_grid(parse_config(data), tmp_path / "full", **options).store  # type: ignore[arg-type]
    data["bev"]["region"] = REGION
    region = run_grid(parse_config(data), tmp_path / "region", **options).store  # type: ignore[arg-type]
    return full, region


@pytest.mark.parametrize("align", [1, 16])
def test_convention_region_grid_samples_each_kept_cell_at_its_centre(tmp_path: Path, align: int) -> None:
    """grid/ of a region store: one kept_cell axis in grid/cells order; each (super-)cell's coords
    are the projection of (x_min + (ix + size/2) dx, y_min + (iy + size/2) dy), restated here with
    the rig geometry (not the build's centre function); fine cells equal the full grid bit for bit;
    grid/cells and grid/expand are the region table; gather/ and delta/ follow the same axis."""
    import numpy as np

    from bevcompile.grid.ipm import inside_feature_map
    from bevcompile.rig.geometry import project_bev_to_feature
    from bevcompile.rig.region import region_table
    from bevcompile.store.loader import load

    full, region = region_grid_stores(tmp_path, align=align, formats=("pixel_q", "uq12"))
    r, f = load(region), load(full)
    rig = r.rig
    table = region_table(rig.bev)
    cells = np.asarray(r["grid"]["cells"])
    assert np.array_equal(cells, table.cells) and np.array_equal(np.asarray(r["grid"]["expand"]), table.expand)
    assert set(np.unique(cells[:, 2]).tolist()) == {1, 2, 4}
    n_kept = cells.shape[0]
    coords = np.asarray(r["grid"]["coords"])
    assert coords.shape == (rig.n_cam, 1, n_kept, 2) and np.asarray(r["grid"]["pixel_q"]).shape == (rig.n_cam, 1, n_kept, 2)
    import zarr

    root = zarr.open_group(str(region), mode="r")
    assert tuple(root["grid"]["coords"].metadata.dimension_names) == ("camera", "height", "kept_cell", "uv")  # type: ignore[index,union-attr]
    assert tuple(root["delta"]["block_slot"].metadata.dimension_names) == ("camera", "height", "block")  # type: ignore[index,union-attr]
    x = rig.bev.x.min + (cells[:, 1] + cells[:, 2] / 2) * rig.bev.x.step
    y = rig.bev.y.min + (cells[:, 0] + cells[:, 2] / 2) * rig.bev.y.step
    points = np.stack([x, y, np.zeros_like(x)], axis=1)
    valid = np.asarray(r["grid"]["valid"])
    for cam_index, camera in enumerate(rig.cameras):
        uv, ok = project_bev_to_feature(rig, camera, points)
        ok &= inside_feature_map(uv, rig.feature_size)
        assert np.array_equal(valid[cam_index, 0], ok)
        assert np.array_equal(coords[cam_index, 0][ok], uv[ok].astype(np.float32))
    fine = cells[:, 2] == 1
    flat = cells[fine, 0] * rig.bev.nx + cells[fine, 1]
    for name in ("coords", "valid", "norm", "norm_int16", "pixel_q", "uq12"):
        dense = np.asarray(f["grid"][name]).reshape(rig.n_cam, 1, rig.bev.ny * rig.bev.nx, *np.asarray(f["grid"][name]).shape[4:])
        assert np.array_equal(np.asarray(r["grid"][name])[:, :, fine], dense[:, :, flat]), name
    assert r["grid"].attrs["region"]["n_kept"] == n_kept
    assert list(r["gather"].attrs["logical_shape"]) == [rig.n_cam, 1, n_kept]
    if align == 1:
        assert np.asarray(r["gather"]["index"]).shape == (rig.n_cam, 1, n_kept, 4)
    else:
        assert np.asarray(r["gather"]["index"]).shape[0] == -(-rig.n_cam * n_kept // align) * align
    assert np.asarray(r["delta"]["cell_pos"]).shape == (n_kept,)
    assert list(r["delta"].attrs["logical_shape"]) == [rig.n_cam, 1, n_kept]
