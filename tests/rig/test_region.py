"""bev.region: config validation, round trip and hash, the mask files, the cell table and expand."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from bevcompile.cli import app
from bevcompile.conventions import CONVENTIONS, REGION_CONVENTIONS
from bevcompile.errors import ConfigError
from bevcompile.rig.config import config_sha256, config_to_dict, load_config, parse_config
from bevcompile.rig.region import decode_png, expand_of_cells, mask_bytes, polygon_mask, region_table

from ..rigs import ROOT, small_rig_data, write_yaml

CORRIDOR = [[[-12.0, -6.0], [12.0, -6.0], [12.0, 6.0], [-12.0, 6.0]]]
RINGS = [{"beyond_m": 4, "factor": 2}, {"beyond_m": 8, "factor": 4}]


def region_data(region: Any) -> dict[str, Any]:
    data = small_rig_data()  # 24 x 24 cells of 1 m, [-12, 12]
    data["bev"]["region"] = region
    return data


def test_corridor_and_rings_table_follows_the_stated_rules() -> None:
    rig = parse_config(region_data({"keep": CORRIDOR, "rings": RINGS}))
    table = region_table(rig.bev)
    ny, nx = rig.bev.ny, rig.bev.nx
    cells = table.cells
    # sorted by the first fine cell, aligned, inside the grid
    first = cells[:, 0].astype(np.int64) * nx + cells[:, 1]
    assert np.all(np.diff(first) > 0)
    assert np.all(cells[:, 0] % cells[:, 2] == 0) and np.all(cells[:, 1] % cells[:, 2] == 0)
    # a restatement of the rule, cell by cell: Chebyshev distance of the centre, factor of the last band beyond
    xc = rig.bev.x.min + (np.arange(nx) + 0.5) * rig.bev.x.step
    yc = rig.bev.y.min + (np.arange(ny) + 0.5) * rig.bev.y.step
    for iy, ix, size in cells:
        block_y, block_x = yc[iy : iy + size], xc[ix : ix + size]
        assert np.all(np.abs(block_y) < 6.0)  # every fine cell of a (super-)cell is kept
        dist = np.maximum(np.abs(block_x)[None, :], np.abs(block_y)[:, None])
        factor = np.where(dist > 8, 4, np.where(dist > 4, 2, 1))
        assert factor.min() >= size  # never coarser than any of its fine cells asks
        if size < 4:  # not coarser than it could be: the aligned block twice as big is not eligible
            by, bx = iy - iy % (2 * size), ix - ix % (2 * size)
            big_y, big_x = yc[by : by + 2 * size], xc[bx : bx + 2 * size]
            big = np.maximum(np.abs(big_x)[None, :], np.abs(big_y)[:, None])
            big_factor = np.where(big > 8, 4, np.where(big > 4, 2, 1))
            assert big_factor.min() < 2 * size or np.any(np.abs(big_y) >= 6.0)
    # expand: every kept fine cell reads its (super-)cell, the rest the zero row
    expand = table.expand.reshape(ny, nx)
    kept = np.abs(yc)[:, None] < 6.0
    assert np.all((expand < table.n_kept) == np.broadcast_to(kept, (ny, nx)))
    for r, (iy, ix, size) in enumerate(cells):
        assert np.all(expand[iy : iy + size, ix : ix + size] == r)
    assert table.n_fine_kept == int(kept.sum()) * nx
    assert set(np.unique(cells[:, 2]).tolist()) == {1, 2, 4}


def test_polygon_mask_equals_matplotlib_contains_points() -> None:
    """Independent reference: matplotlib.path.Path.contains_points on the cell centres (no centre
    lies on an edge here, where the two rules could differ)."""
    from matplotlib.path import Path as MplPath

    rig = parse_config(small_rig_data())
    polygons = [[(-10.2, -3.3), (9.7, -7.1), (4.1, 8.6), (-2.2, 1.3), (-8.9, 9.9)], [(3.3, -11.1), (11.6, -11.4), (11.2, -4.4)]]
    got = polygon_mask(polygons, rig.bev.x, rig.bev.y)
    xc = rig.bev.x.min + (np.arange(rig.bev.nx) + 0.5) * rig.bev.x.step
    yc = rig.bev.y.min + (np.arange(rig.bev.ny) + 0.5) * rig.bev.y.step
    points = np.stack(np.meshgrid(xc, yc), axis=-1).reshape(-1, 2)
    want = np.zeros(points.shape[0], dtype=bool)
    for polygon in polygons:
        want |= MplPath(np.asarray(polygon)).contains_points(points)
    assert got.sum() > 20
    assert np.array_equal(got.ravel(), want)


def test_region_round_trips_and_enters_the_hash() -> None:
    base = parse_config(small_rig_data())
    rig = parse_config(region_data({"keep": CORRIDOR, "rings": RINGS}))
    again = parse_config(config_to_dict(rig))
    assert again.bev == rig.bev and config_to_dict(again) == config_to_dict(rig)
    assert config_sha256(again) == config_sha256(rig)
    assert config_sha256(rig) != config_sha256(base)
    other = parse_config(region_data({"keep": CORRIDOR, "rings": RINGS[:1]}))
    assert config_sha256(other) != config_sha256(rig)
    assert "region" not in config_to_dict(base)["bev"]  # configs without a region keep their bytes


def test_mask_npy_and_png_read_alike_hash_by_content_and_round_trip(tmp_path: Path) -> None:
    """The PNG decoder against Pillow's encoder (its adaptive filters exercise every PNG filter type)."""
    from PIL import Image

    rig = parse_config(small_rig_data())
    mask = polygon_mask([[(-12, -5), (10, -5), (10, 7), (-12, 7)]], rig.bev.x, rig.bev.y)
    mask[3, 3] = True
    np.save(tmp_path / "keep.npy", mask)
    Image.fromarray((mask * 255).astype(np.uint8)).save(tmp_path / "keep.png", optimize=True)
    rgb = np.zeros((*mask.shape, 3), np.uint8)
    rgb[mask, 1] = 200
    Image.fromarray(rgb).save(tmp_path / "keep_rgb.png")
    rigs = []
    for name in ("keep.npy", "keep.png", "keep_rgb.png"):
        path = write_yaml(tmp_path / f"{name}.yaml", region_data({"keep": name, "rings": RINGS}))
        rigs.append(load_config(path))
    assert len({config_sha256(r) for r in rigs}) == 1  # the content, not the file, is hashed
    got = region_table(rigs[1].bev).expand.reshape(mask.shape) < region_table(rigs[1].bev).n_kept
    assert np.array_equal(got, mask)
    # the store's copy (run lengths) re-parses without the file
    resolved = config_to_dict(rigs[0])
    assert resolved["bev"]["region"]["keep"]["mask"] == "keep.npy"
    (tmp_path / "keep.npy").unlink()
    assert parse_config(resolved).bev == rigs[0].bev
    tampered = copy.deepcopy(resolved)
    tampered["bev"]["region"]["keep"]["runs"][1] += 1
    tampered["bev"]["region"]["keep"]["runs"][2] -= 1
    with pytest.raises(ConfigError, match=r"bev\.region\.keep\.sha256: differs from the content of runs"):
        parse_config(tampered)
    assert np.array_equal(decode_png((tmp_path / "keep.png").read_bytes()) > 0, mask)
    assert mask_bytes(mask) == mask.astype(np.uint8).tobytes()


@pytest.mark.parametrize(
    ("region", "field", "message"),
    [
        ({}, "bev.region", "empty region"),
        ({"keep": []}, "bev.region.keep", "empty region"),
        ({"keep": [[[30, 30], [40, 30], [40, 40]]]}, "bev.region.keep", "empty region: no BEV cell centre is inside it"),
        ({"keep": [[[0, 0], [1, 1]]]}, "bev.region.keep[0]", "3 to"),
        ({"keep": [[[0, 0], [1, "a"], [2, 2]]]}, "bev.region.keep[0][1][1]", "expected a number"),
        ({"keep": 3}, "bev.region.keep", "expected a list of polygons or a mask file name"),
        ({"keep": "mask.txt"}, "bev.region.keep", "must be a .npy or .png file"),
        ({"keep": "missing.npy"}, "bev.region.keep", "not found"),
        ({"rings": []}, "bev.region.rings", "empty list"),
        ({"rings": [{"beyond_m": 4, "factor": 3}]}, "bev.region.rings[0].factor", "power of two"),
        ({"rings": [{"beyond_m": 4, "factor": 16}]}, "bev.region.rings[0].factor", "does not divide the grid 24 x 24"),
        ({"rings": [{"beyond_m": 8, "factor": 2}, {"beyond_m": 4, "factor": 4}]}, "bev.region.rings[1].beyond_m", "not beyond"),
        ({"rings": [{"beyond_m": 4, "factor": 4}, {"beyond_m": 8, "factor": 2}]}, "bev.region.rings[1].factor", "not coarser"),
        ({"rings": [{"beyond_m": 4}]}, "bev.region.rings[0].factor", "missing required field"),
        ({"rings": [{"beyond_m": 4, "factor": 2, "x": 1}]}, "bev.region.rings[0].x", "unknown field"),
        ({"keep": CORRIDOR, "shape": 1}, "bev.region.shape", "unknown field"),
    ],
)
def test_bad_regions_fail_with_the_field_path(region: Any, field: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(region_data(region), source="rig.yaml")
    text = str(info.value)
    assert text.startswith(f"rig.yaml: {field}: "), text
    assert message in text, text


def test_bad_mask_files_fail_in_one_line(tmp_path: Path) -> None:
    np.save(tmp_path / "small.npy", np.ones((4, 4), bool))
    np.save(tmp_path / "float.npy", np.ones((24, 24)))
    (tmp_path / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\nnonsense")
    np.save(tmp_path / "empty.npy", np.zeros((24, 24), bool))
    for name, message in (
        ("small.npy", "is 4 x 4, expected ny x nx = 24 x 24"),
        ("float.npy", "holds float64"),
        ("broken.png", "broken.png"),
        ("empty.npy", "empty region"),
    ):
        path = write_yaml(tmp_path / f"{name}.yaml", region_data({"keep": name}))
        result = CliRunner().invoke(app, ["matrix", str(path), "--out", str(tmp_path / "out")])
        assert result.exit_code == 2, result.output
        lines = [line for line in result.output.splitlines() if line.strip()]
        assert lines[-1].startswith(f"error: {path}: bev.region.keep: "), result.output
        assert message in lines[-1], result.output
        assert "Traceback" not in result.output


def _png(width: int, height: int, idat: bytes) -> bytes:
    """A grey 8-bit PNG of the declared size holding ``idat`` (whatever it inflates to)."""
    import struct
    import zlib

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def test_mask_files_are_judged_by_their_header_before_their_data(tmp_path: Path) -> None:
    """issue 31: a 0.9 MB PNG of 30000 x 30000 took 1.8 GB before it was refused (and was called
    "not a readable .npy file (MemoryError)"). The declared size is checked first: a PNG or .npy
    header of the wrong shape or dtype is refused before any data is inflated or loaded; a PNG
    whose data inflates past what its header declares stops there."""
    import zlib

    (tmp_path / "huge.png").write_bytes(_png(30000, 30000, zlib.compress(b"\0" * 4096)))
    (tmp_path / "bomb.png").write_bytes(_png(24, 24, zlib.compress(b"\0" * (64 << 20))))  # 64 MiB for 600 bytes
    header = np.lib.format.header_data_from_array_1_0(np.zeros((1, 1), np.uint8)) | {"shape": (30000, 30000)}
    with open(tmp_path / "huge.npy", "wb") as fh:
        np.lib.format.write_array_header_1_0(fh, header)  # 900 MB declared, no data
    with open(tmp_path / "float.npy", "wb") as fh:
        np.lib.format.write_array_header_1_0(fh, np.lib.format.header_data_from_array_1_0(np.zeros((24, 24))))
    for name, message in (
        ("huge.png", "mask file 'huge.png' is 30000 x 30000, expected ny x nx = 24 x 24"),
        ("bomb.png", "mask file 'bomb.png': PNG data holds more than the 600 bytes its header declares"),
        ("huge.npy", "mask file 'huge.npy' is 30000 x 30000, expected ny x nx = 24 x 24"),
        ("float.npy", "mask file 'float.npy' holds float64: expected bool or integer"),
    ):
        with pytest.raises(ConfigError) as info:
            parse_config(region_data({"keep": name}), source="rig.yaml", base_dir=tmp_path)
        assert str(info.value).startswith(f"rig.yaml: bev.region.keep: {message}"), str(info.value)


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 40), st.integers(1, 40), st.sampled_from([0.5, 0.25, 1.0, 0.3]),
    st.lists(st.lists(st.tuples(st.integers(-50, 50), st.integers(-50, 50)), min_size=3, max_size=8), min_size=1, max_size=3),
)
def test_scanline_polygon_mask_equals_the_rule_cell_by_cell(nx: int, ny: int, step: float, polygons: list[list[tuple[int, int]]]) -> None:
    """The scanline form (runs per row, never an (ny, nx) temporary per edge) decides every cell
    as the even-odd rule of the module docstring evaluated on every centre, ties included
    (vertices on half-cell multiples put centres on edges and vertices)."""
    from bevcompile.rig.config import AxisSpec
    from bevcompile.rig.region import cell_centres, polygon_kept_count

    x = AxisSpec(-nx * step / 2, nx * step / 2, step, nx)
    y = AxisSpec(-ny * step / 2, ny * step / 2, step, ny)
    scaled = [[(vx * step / 4, vy * step / 4) for vx, vy in polygon] for polygon in polygons]
    xc, yc = cell_centres(x, y)
    want = np.zeros((ny, nx), dtype=bool)
    for polygon in scaled:  # the rule, literally: every centre against every edge
        inside = np.zeros((ny, nx), dtype=bool)
        vertices = np.asarray(polygon, dtype=np.float64)
        for (x0, y0), (x1, y1) in zip(vertices, np.roll(vertices, -1, axis=0), strict=True):
            if y0 != y1:
                inside ^= (((y0 <= yc) & (yc < y1)) | ((y1 <= yc) & (yc < y0))) & (xc < x0 + (yc - y0) * (x1 - x0) / (y1 - y0))
        want |= inside
    assert np.array_equal(polygon_mask(scaled, x, y), want)
    assert polygon_kept_count(scaled, x, y) == int(want.sum())


def test_expand_of_cells_inverts_the_table() -> None:
    rig = parse_config(region_data({"keep": CORRIDOR, "rings": RINGS}))
    table = region_table(rig.bev)
    assert np.array_equal(expand_of_cells(table.cells, table.bev_shape), table.expand)
    assert table.expand.dtype == np.int32 and table.expand.shape == (rig.bev.ny * rig.bev.nx,)


def test_convention_region_sentences_are_in_the_docs() -> None:
    page = (ROOT / "docs" / "conventions.md").read_text()
    for key, sentence in REGION_CONVENTIONS.items():
        assert f"- {sentence}\n" in page, key
    assert not set(REGION_CONVENTIONS) & set(CONVENTIONS)


def test_convention_region_expand_reads_the_zero_row_outside() -> None:
    """The expand sentence as code: dense = concat(rows, 0)[expand]."""
    rig = parse_config(region_data({"keep": CORRIDOR, "rings": RINGS}))
    table = region_table(rig.bev)
    rows = np.arange(1, table.n_kept + 1, dtype=np.float64)  # row r holds r + 1
    dense = np.r_[rows, 0.0][table.expand].reshape(rig.bev.ny, rig.bev.nx)
    iy, ix, size = table.cells[-1]
    assert np.all(dense[iy : iy + size, ix : ix + size] == table.n_kept)
    assert dense[0, 0] == 0.0  # y = -11.5 m: outside the corridor
    centre = table.centres(rig.bev.x.min, rig.bev.x.step, rig.bev.y.min, rig.bev.y.step)
    assert np.allclose(centre[-1], [rig.bev.x.min + (ix + size / 2), rig.bev.y.min + (iy + size / 2)])
