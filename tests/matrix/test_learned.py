"""Learned matrix values (``bevcompile.matrix.learned``): the products re-derived from learned ELL
values, the learned-store checks of ``inspect`` / ``--strict`` / ``verify``, and the convention
that the learned values are the ELL real slots of the geometric topology."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from bevcompile.matrix.build import MatrixOptions, build_matrix
from bevcompile.matrix.learned import INIT_ARRAY, LearnedRecord, coo_slots, learned_group, learned_products, real_slots
from bevcompile.rig.config import RigConfig
from bevcompile.store.inspection import inspect_store
from bevcompile.store.root import root_attributes
from bevcompile.store.verify import verify_store
from bevcompile.store.zarr_io import store_path, write_groups

RECORD = LearnedRecord("ckpt.pt", "0" * 64, "lift.ell_weight", "pytorch", "float32")
OPTIONS = [
    MatrixOptions(mode="grid", topk=8, align=16, tile_rows=32, quantize="int8"),
    MatrixOptions(mode="frustum", topk=6, align=8, tile_rows=64, quantize="int8", compact_rows=True, normalize="mean"),
]


@pytest.mark.parametrize("options", OPTIONS, ids=["grid", "frustum-compact-mean"])
def test_init_values_reproduce_the_geometric_products_bit_for_bit(small: RigConfig, options: MatrixOptions) -> None:
    """absorb's derivation and the geometric build share value_products: learned == init gives back every array."""
    geometric = build_matrix(small, options)
    again = learned_products(small, geometric, geometric.ell_weight)
    for name, array in geometric.arrays().items():
        got = again.arrays()[name]
        assert got.dtype == array.dtype and np.array_equal(got, array), name
    assert again.figures.int8_max_rel_error == geometric.figures.int8_max_rel_error


def test_convention_learned_values_are_the_ell_real_slots(small: RigConfig) -> None:
    """COO entry k of row r is ELL slot coo_slots[k] of row r; padding is laid out 0 whatever the
    input holds there; an entry whose learned value is 0 (or negative) stays in the COO."""
    geometric = build_matrix(small, MatrixOptions(mode="grid", topk=8, align=16, tile_rows=32))
    shape = (geometric.rows_pad, geometric.k_pad)
    real = real_slots(geometric.coo_row, shape)
    assert int(real.sum()) == geometric.coo_row.size
    rng = np.random.default_rng(0)
    values = rng.standard_normal(shape).astype(np.float32)
    first = tuple(np.argwhere(real)[0])
    values[first] = 0.0
    learned = learned_products(small, geometric, values)  # padding of `values` is not 0: ignored
    slots = coo_slots(geometric.coo_row)
    assert np.array_equal(learned.coo_val, values[geometric.coo_row, slots])
    assert np.array_equal(learned.coo_row, geometric.coo_row) and np.array_equal(learned.coo_col, geometric.coo_col)
    assert np.all(learned.ell_weight[~real] == 0) and np.array_equal(learned.ell_weight[real], values[real])
    assert np.array_equal(learned.ell_index, geometric.ell_index)
    assert np.array_equal(learned.tile_cols, geometric.tile_cols)  # the tiles' columns are the topology's
    assert (learned.coo_val == 0).sum() >= 1 and (learned.coo_val < 0).any()


def _write_learned(rig: RigConfig, out: Path, options: MatrixOptions, tamper: str | None = None) -> Path:
    geometric = build_matrix(rig, options)
    rng = np.random.default_rng(1)
    values = (geometric.ell_weight * rng.uniform(0.5, 1.5, geometric.ell_weight.shape)).astype(np.float32)
    group = learned_group(rig, geometric, learned_products(rig, geometric, values), RECORD)
    if tamper == "value":
        group.arrays["ell_weight"] = group.arrays["ell_weight"].copy()
        r, j = np.argwhere(real_slots(geometric.coo_row, values.shape))[5]
        group.arrays["ell_weight"][r, j] += 0.25
    elif tamper == "init":
        group.arrays[INIT_ARRAY] = group.arrays[INIT_ARRAY] * np.float32(1.01)
    elif tamper == "hash":
        group.attrs["learned"] = {**group.attrs["learned"], "values_sha256": "f" * 64}
    path = store_path(out, rig.name)
    write_groups(path, root_attrs=root_attributes(rig), groups={"matrix": group}, force=True)
    return path


def test_a_learned_store_passes_inspect_strict_and_verify(tmp_path: Path, small: RigConfig) -> None:
    path = _write_learned(small, tmp_path, OPTIONS[1])
    report = inspect_store(path, strict=True)
    assert report.passed, report.failure_lines()
    names = {c.name for c in report.checks}
    assert {"learned_record", "learned_values_sha256", "learned_init_sha256", "learned_change", "init_values", "init_padding_zero"} <= names
    assert any(c.name == "strict" and c.array == f"matrix/{INIT_ARRAY}" and c.passed for c in report.checks)
    verify = verify_store(path, channels=3)
    assert verify.passed, verify.failure_lines()
    info = [r for r in verify.rows if r.product == "matrix/learned_vs_init"]
    assert len(info) == 1 and info[0].informational and info[0].max_abs > 0
    coo = [r for r in verify.rows if r.product == "matrix/coo" and r.camera == "all"]
    assert coo[0].max_abs < 1e-5 and "learned values" in coo[0].note


@pytest.mark.parametrize(
    ("tamper", "failing"),
    [
        ("value", {"learned_values_sha256", "ell_reconstructs_coo"}),
        ("init", {"learned_init_sha256", "learned_change"}),
        ("hash", {"learned_values_sha256"}),
    ],
)
def test_tampered_learned_stores_fail(tmp_path: Path, small: RigConfig, tamper: str, failing: set[str]) -> None:
    path = _write_learned(small, tmp_path, OPTIONS[0], tamper)
    report = inspect_store(path, strict=True)
    failed = {c.name for c in report.failures}
    assert failing <= failed, report.failure_lines()
    if tamper == "init":  # the init is the geometric build's, bit for bit
        assert any(c.name == "strict" and c.array == f"matrix/{INIT_ARRAY}" for c in report.failures)
    if tamper == "value":  # coo_val (derived from the learned ELL slots) no longer matches the stored one
        verify = verify_store(path, channels=2)
        assert not verify.passed


def test_a_geometric_store_may_not_carry_an_init(tmp_path: Path, small: RigConfig) -> None:
    geometric = build_matrix(small, OPTIONS[0])
    group = learned_group(small, geometric, learned_products(small, geometric, geometric.ell_weight), RECORD)
    del group.attrs["values"]
    path = store_path(tmp_path, small.name)
    write_groups(path, root_attrs=root_attributes(small), groups={"matrix": replace(group)}, force=True)
    failures = " ".join(inspect_store(path).failure_lines())
    assert "arrays not produced by these build_options: init_ell_weight" in failures


@pytest.mark.parametrize("topk", [0, 6], ids=["k0", "k6"])
def test_region_store_learned_values_products_verify_and_tampering(tmp_path: Path, topk: int) -> None:
    """A bev.region store: init values give back every geometric array bit for bit (camera_mass laid
    out on the dense map through expand; cells / expand kept); learned values pass inspect --strict
    and verify (K = 0 too: the reference's entries carry the learned values, not the pooling
    reference), and a tampered learned value fails both."""
    from bevcompile.rig.config import parse_config
    from bevcompile.rig.region import region_table

    from ..rigs import small_rig_data
    from .test_region import REGION

    data = small_rig_data()
    data["bev"]["region"] = REGION
    rig = parse_config(data)
    options = MatrixOptions(mode="frustum", topk=topk, align=8, tile_rows=32, quantize="int8", normalize="mean")
    geometric = build_matrix(rig, options)
    again = learned_products(rig, geometric, geometric.ell_weight)
    for name, array in geometric.arrays().items():
        got = again.arrays()[name]
        assert got.dtype == array.dtype and np.array_equal(got, array), name
    assert {"cells", "expand"} <= set(again.figures.product_bytes)
    # camera_mass of learned values: each fine cell carries its (super-)cell row's mass, 0 outside
    values = (geometric.ell_weight * np.random.default_rng(3).uniform(0.5, 1.5, geometric.ell_weight.shape)).astype(np.float32)
    learned = learned_products(rig, geometric, values)
    table = region_table(rig.bev)
    cam = learned.coo_col.astype(np.int64) // learned.cols_per_camera
    for c in range(rig.n_cam):
        per_row = np.array([learned.coo_val[(cam == c) & (learned.coo_row == r)].astype(np.float64).sum() for r in range(table.n_kept + 1)])
        assert np.array_equal(learned.camera_mass[c].ravel(), per_row[table.expand].astype(np.float32))
    for tamper in (None, "value"):
        path = _write_learned(rig, tmp_path / str(tamper), options, tamper)
        report = inspect_store(path, strict=True)
        verify = verify_store(path, channels=3)
        if tamper is None:
            assert report.passed, report.failure_lines()
            assert verify.passed, verify.failure_lines()
            coo = [r for r in verify.rows if r.product == "matrix/coo" and r.camera == "all"]
            assert coo[0].max_abs < 1e-5 and "learned values" in coo[0].note and "region" in coo[0].note
            assert any(r.product == "matrix/learned_vs_init" and r.max_abs > 0 for r in verify.rows)
        else:
            assert {"learned_values_sha256", "ell_reconstructs_coo"} <= {c.name for c in report.failures}
            assert not verify.passed
