"""The precision map (``bevcompile verify --map``, ``render --precision``): each form's per-cell error
against an independently computed one (the torch modules' output vs the float64 COO product), the
band / camera summaries against their definitions, the registry, the CLI, and on nuScenes the
figures the docs quote (int8 loses SNR with distance, mixed recovers the far band)."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from bevcompile.cli import app
from bevcompile.errors import UsageError
from bevcompile.matrix.build import MatrixOptions, run_matrix
from bevcompile.matrix.precision import row_distances_m
from bevcompile.report.precision import (
    FORMS,
    PrecisionForm,
    cell_snr_db,
    parse_bands,
    precision_map,
    register_form,
)
from bevcompile.report.render import render_precision
from bevcompile.rig.config import load_config
from bevcompile.store.loader import load
from bevcompile.store.verify import make_features
from bevcompile.torch import MatrixLift

from ..cli import flat, table_words
from ..deploy.test_torch import add_matrix_group, build_grid_store
from ..rigs import small_rig

runner = CliRunner()


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    rig = small_rig()
    path = build_grid_store(rig, tmp_path_factory.mktemp("precision"), npu=True)
    add_matrix_group(path, rig, MatrixOptions(topk=8, align=8, tile_rows=32, quantize="mixed", fp16_rows="beyond:10"))
    return path


def test_forms_equal_the_torch_modules_against_the_float64_coo_product(store: Path) -> None:
    """The map's ELL int8 / mixed SNR per cell equals the SNR of ``MatrixLift`` (float32 torch) on
    the same seeded inputs against an independent float64 COO product (np.add.at), to 0.05 dB
    where the number format sets the error."""
    pmap = precision_map(store, seed=2, channels=4)
    loaded = load(store)
    rig = loaded.rig
    feats, depth = make_features(rig, 4, 2)
    g = loaded["matrix"]
    row, col, val = (np.asarray(g[k]) for k in ("coo_row", "coo_col", "coo_val"))
    w_f, h_f = rig.feature_size
    plane = w_f * h_f
    per_cam = rig.depth.n_bins * plane
    cam, rem = col // per_cam, col % per_cam
    x = depth.astype(np.float64).reshape(rig.n_cam, rig.depth.n_bins, plane)[cam, rem // plane, rem % plane][:, None] * feats.astype(np.float64).reshape(rig.n_cam, 4, plane)[cam, :, rem % plane]
    ref = np.zeros((rig.bev.ny * rig.bev.nx, 4))
    np.add.at(ref, row, val[:, None].astype(np.float64) * x)
    for weights, name in (("int8", "matrix/ell_int8"), ("mixed", "matrix/ell_mixed"), ("float32", "matrix/ell")):
        out = MatrixLift(store, weights=weights)(torch.from_numpy(feats)[None], torch.from_numpy(depth)[None])[0]
        got = out.double().numpy().reshape(4, -1).T
        want = cell_snr_db(got, ref).reshape(rig.bev.ny, rig.bev.nx)
        mapped = pmap.form(name).snr_db
        assert np.array_equal(np.isnan(want), np.isnan(mapped))
        # the int8 cells (below 75 dB) agree to 0.05 dB, the fp16 ones (75-100 dB) to 0.5 dB (float32
        # rounding, ~140 dB, whose bits depend on the summation order, is a 1 % share there); the
        # rest are float32 rounding: above 95 dB in both
        snr = np.nan_to_num(want, nan=np.inf)
        for below, tol in ((75, 0.05), (100, 0.5)):
            cells = snr < below
            assert np.max(np.abs(want[cells] - mapped[cells]), initial=0.0) < tol, name
        assert np.all(np.nan_to_num(mapped[(snr >= 100) & ~np.isnan(want)], posinf=1e9) > 95), name
        assert (snr < 75).any() == (weights != "float32")


def test_summaries_follow_their_definitions(store: Path) -> None:
    pmap = precision_map(store, bands="5,10")
    rig = load(store).rig
    assert [f.name for f in pmap.forms] == [
        "gather/float32", "gather/lut", "matrix/ell", "matrix/ell_int8", "matrix/ell_mixed", "matrix/tiles", "matrix/tiles_int8", "matrix/tiles_mixed",
    ]
    dist = row_distances_m(rig, rig.bev.ny * rig.bev.nx).reshape(rig.bev.ny, rig.bev.nx)
    assert np.array_equal(pmap.distance_m, dist)
    int8 = pmap.form("matrix/ell_int8")
    labels = [b.label for b in int8.bands]
    assert labels == ["0-5 m", "5-10 m", ">= 10 m"]
    for band, (lo, hi) in zip(int8.bands, [(0, 5), (5, 10), (10, math.inf)], strict=True):
        cells = (dist >= lo) & (dist < hi) & ~np.isnan(int8.snr_db)
        assert band.n_cells == int(cells.sum())
        assert band.p05_db == float(np.percentile(int8.snr_db[cells], 5, method="lower"))
    assert sum(b.n_cells for b in int8.bands) == int8.overall.n_cells
    mixed = pmap.form("matrix/ell_mixed")
    assert mixed.bands[-1].snr_db > int8.bands[-1].snr_db + 10  # the fp16 rows (beyond 10 m)
    assert mixed.bands[0].snr_db == int8.bands[0].snr_db  # int8 rows: the same values
    assert pmap.form("matrix/ell").overall.snr_db > 120 and pmap.form("gather/float32").overall.snr_db > 120
    assert [c.label for c in int8.cameras] == list(rig.camera_names) and all(c.n_cells for c in int8.cameras)
    data = pmap.to_json()
    assert data["band_labels"] == labels and data["forms"][3]["form"] == "matrix/ell_int8"


def test_registry_takes_a_new_form_and_refuses_unknown_ones(store: Path) -> None:
    def exact(inputs: object) -> np.ndarray:
        from bevcompile.report.precision import FAMILIES

        return FAMILIES["matrix"].reference(inputs)  # type: ignore[arg-type]

    register_form(PrecisionForm("test/exact", "matrix", "the reference itself", lambda i: True, exact), replace=True)
    try:
        pmap = precision_map(store, forms=["test/exact", "matrix/ell"])
        assert [f.name for f in pmap.forms] == ["test/exact", "matrix/ell"]
        assert pmap.forms[0].overall.snr_db == math.inf
        with pytest.raises(ValueError, match="already registered"):
            register_form(FORMS["test/exact"])
        with pytest.raises(ValueError, match="unknown family 'npu'"):
            register_form(PrecisionForm("x", "npu", "", lambda i: True, exact))
    finally:
        del FORMS["test/exact"]
    with pytest.raises(UsageError, match="unknown precision form"):
        precision_map(store, forms=["matrix/nope"])


@pytest.mark.parametrize("text", ["", "20,10", "0,10", "a,b", "10,nan"])
def test_bad_bands_are_usage_errors(text: str) -> None:
    with pytest.raises(UsageError, match="--bands must be"):
        parse_bands(text)


def test_verify_map_and_render_precision_from_the_command_line(store: Path, tmp_path: Path) -> None:
    result = runner.invoke(app, ["verify", str(store), "--map", "--bands", "5,10"])
    assert result.exit_code == 0, result.output
    words = table_words(result.stdout)
    assert "SNR dB by distance" in words and "0-5 m 5-10 m >= 10 m" in words and "matrix/ell_mixed" in words
    as_json = runner.invoke(app, ["verify", str(store), "--map", "--json", "--seed", "1"])
    data = json.loads(as_json.stdout)
    assert as_json.exit_code == 0 and data["seed"] == 1 and data["bands_m"] == [20.0, 35.0, 50.0]
    assert {f["form"] for f in data["forms"]} >= {"matrix/ell_int8", "gather/lut"}
    bad = runner.invoke(app, ["verify", str(store), "--map", "--bands", "10,5"])
    assert bad.exit_code == 2 and bad.stderr.strip() == "error: --bands must be strictly increasing distances > 0 metres (e.g. 20,35,50), got '10,5'"
    png = tmp_path / "p.png"
    drawn = runner.invoke(app, ["render", str(store), "--precision", "--out", str(png), "--bands", "5,10"])
    assert drawn.exit_code == 0, drawn.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "8 forms" in flat(drawn.stdout) and "beyond 10 m" in flat(drawn.stdout)
    again = tmp_path / "q.png"
    render_precision(store, again, bands=(5.0, 10.0))
    assert again.read_bytes() == png.read_bytes()  # same store, same bytes
    both = runner.invoke(app, ["render", str(store), "--precision", "--height", "0"])
    assert both.exit_code == 2 and "--precision draws every deployed form" in both.stderr


def test_nuscenes_int8_loses_snr_with_distance_and_mixed_recovers_the_far_band(tmp_path: Path) -> None:
    """The figures docs/matrix.md quotes (benchmarks/precision.py): on the bundled nuScenes rig,
    frustum Top-24, the int8 ELL's band SNR falls with every band; mixed beyond:35 keeps the
    near bands' int8 values and lifts the bands beyond 35 m by more than 20 dB."""
    rig = load_config(None)
    path = run_matrix(rig, tmp_path, MatrixOptions(topk=24, align=16, quantize="mixed", fp16_rows="beyond:35"), jobs=2).store
    pmap = precision_map(path)
    int8 = [b.snr_db for b in pmap.form("matrix/ell_int8").bands]
    mixed = [b.snr_db for b in pmap.form("matrix/ell_mixed").bands]
    assert all(a > b for a, b in itertools.pairwise(int8)), int8
    assert int8[0] - int8[-1] > 4.0
    assert mixed[:2] == int8[:2]
    assert min(mixed[2:]) > max(int8) + 15.0, (int8, mixed)
