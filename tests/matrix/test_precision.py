"""Reduced precision (``--quantize fp16 | mixed``) and the numpy references of the deployed lift
(bevcompile.matrix.precision): each formula against an independent restatement (Python's own IEEE
half via ``struct``, a Monte Carlo estimate of the row SNR, per-row Python loops, a dense one-hot
product), the store format, its inspect / --strict checks and what damage they catch."""

from __future__ import annotations

import math
import struct
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import bevcompile.matrix.checks as mc
from bevcompile.errors import UsageError
from bevcompile.matrix.build import MatrixOptions, build_matrix, matrix_attributes
from bevcompile.matrix.layout import coo_to_dense, dequantize_rows_int8, quantize_rows_int8, tile_blocks
from bevcompile.matrix.learned import LearnedRecord, absorb_options, learned_group, learned_products
from bevcompile.matrix.precision import (
    Fp16Rule,
    class_lift_reference,
    decode_fp16,
    encode_fp16,
    fp16_row_tile_weight,
    int8_row_snr_db,
    mixed_ell_values,
    mixed_tile_values,
    row_distances_m,
    sanitize,
    select_fp16_rows,
)
from bevcompile.store.inspection import json_attrs
from bevcompile.store.plugins import REBUILT_ATTRS

from ..rigs import small_rig
from .test_checks import MULTI, _ctx, _failed, _group

# --------------------------------------------------------------------------------------
# the numeric conventions
# --------------------------------------------------------------------------------------


def _half(x: float) -> float:
    """IEEE binary16 of ``x`` by Python's ``struct`` ('e': round to nearest even), not numpy."""
    return float(struct.unpack("<e", struct.pack("<e", x))[0])


@settings(max_examples=200)
@given(st.floats(min_value=-65504.0, max_value=65504.0, allow_nan=False, width=32))
def test_convention_fp16_encode_is_ieee_half_round_to_nearest_even(x: float) -> None:
    h = encode_fp16(np.array([x], dtype=np.float32))
    assert h.dtype == np.float16
    assert float(h[0]) == _half(float(np.float32(x)))
    assert decode_fp16(h).dtype == np.float32 and float(decode_fp16(h)[0]) == float(h[0])  # exact


def test_convention_fp16_subnormals_and_ties() -> None:
    tiny = np.array([2.0**-24, 3 * 2.0**-25, 2.0**-26, 1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11], dtype=np.float32)
    got = decode_fp16(encode_fp16(tiny)).astype(np.float64)
    want = [_half(float(v)) for v in tiny]
    assert list(got) == want
    assert got[2] == 0.0  # below half the smallest subnormal: 0 (tie to even)
    assert got[3] == 1.0 and got[4] == 1.0 + 2.0**-9  # ties to even mantissa


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan, 65520.0, -1e6])
def test_fp16_refuses_values_it_cannot_hold(bad: float) -> None:
    w = np.array([[0.5, bad, 0.25]], dtype=np.float32)
    with pytest.raises(UsageError, match=r"1 of the weights are not finite or exceed float16's range \(\|w\| < 65520; first at \(0, 1\)"):
        encode_fp16(w)
    assert encode_fp16(np.array([65504.0, 65519.0], dtype=np.float32)).tolist() == [65504.0, 65504.0]  # rounds down, in range


def test_int8_row_snr_predicts_the_measured_snr_on_uniform_inputs() -> None:
    """The closed form against a Monte Carlo measurement on i.i.d. U[0, 1) inputs (200k draws per
    row): within 0.2 dB, for rows of many equal-ish weights, few unequal ones and one dominant."""
    rng = np.random.default_rng(3)
    rows = np.zeros((4, 24), dtype=np.float32)
    rows[0] = rng.uniform(0.8, 1.0, 24)
    rows[1, :3] = [0.9, 0.31, 0.07]
    rows[2, :12] = np.r_[1.0, rng.uniform(0.0, 0.05, 11)]
    rows[3] = 0.0  # empty
    q, scale = quantize_rows_int8(rows)
    predicted = int8_row_snr_db(rows, q, scale)
    assert math.isinf(predicted[3])
    deq = dequantize_rows_int8(q, scale).astype(np.float64)
    x = rng.random((200_000, 24))
    for r in range(3):
        signal = x @ rows[r].astype(np.float64)
        noise = x @ (deq[r] - rows[r])
        measured = 10 * np.log10((signal**2).mean() / (noise**2).mean())
        assert abs(measured - predicted[r]) < 0.2, (r, measured, predicted[r])
    assert predicted[0] > predicted[2]  # many equal weights average their rounding out; a dominant one does not


def test_fp16_rule_parse_and_canonical_token() -> None:
    assert Fp16Rule.parse("beyond:35").token == "beyond:35.0"
    assert Fp16Rule.parse(" SNR : 58.5 ") == Fp16Rule("snr", 58.5)
    assert Fp16Rule.parse("fraction:1") == Fp16Rule("fraction", 1.0)
    for text, message in (
        ("35", "must be KIND:VALUE"),
        ("far:35", "kind must be one of beyond, snr, fraction, got 'far'"),
        ("beyond:x", "the value must be a number, got 'x'"),
        ("beyond:-1", "the distance must be >= 0 metres"),
        ("fraction:0", r"the fraction must be in \(0, 1\], got 0"),
        ("snr:nan", "must be a finite number"),
    ):
        with pytest.raises(UsageError, match=message):
            Fp16Rule.parse(text)


def test_select_fp16_rows_by_each_rule() -> None:
    snr = np.array([50.0, 70.0, 50.0, np.inf, 40.0, 55.0])
    dist = np.array([10.0, 40.0, 36.0, 60.0, np.nan, 35.0])
    has = np.array([True, True, True, False, True, True])  # row 3 is empty: never selected
    assert select_fp16_rows(Fp16Rule("beyond", 35.0), snr, dist, has).tolist() == [1, 2]  # > 35: 35.0 itself stays int8
    assert select_fp16_rows(Fp16Rule("snr", 55.0), snr, dist, has).tolist() == [0, 2, 4]
    # fraction: ceil(0.5 * 5) = 3 of the 5 rows with entries, lowest SNR first, the tie 50/50 by row
    assert select_fp16_rows(Fp16Rule("fraction", 0.5), snr, dist, has).tolist() == [0, 2, 4]
    assert select_fp16_rows(Fp16Rule("fraction", 0.4), snr, dist, has).tolist() == [0, 4]
    assert select_fp16_rows(Fp16Rule("fraction", 1.0), snr, dist, has).tolist() == [0, 1, 2, 4, 5]


def test_row_distances_of_cells_compact_rows_and_region_cells() -> None:
    rig = small_rig()
    b = rig.bev
    d = row_distances_m(rig, b.ny * b.nx + 2)  # two padding rows
    iy, ix = 3, 7
    assert d[iy * b.nx + ix] == pytest.approx(math.hypot(b.x.min + 7.5 * b.x.step, b.y.min + 3.5 * b.y.step), abs=1e-12)
    assert np.isnan(d[-2:]).all()
    ids = np.array([5, iy * b.nx + ix])
    assert row_distances_m(rig, 2, ids)[1] == d[iy * b.nx + ix]
    cells = np.array([[4, 8, 4]])  # a 4x4 super-cell: its centre is the corner shared by its 4 middle cells
    got = row_distances_m(rig, 2, region_cells=cells)
    assert got[0] == pytest.approx(math.hypot(b.x.min + 10 * b.x.step, b.y.min + 6 * b.y.step), abs=1e-12) and np.isnan(got[1])


def test_mixed_values_replace_the_fp16_rows_and_decode_the_others() -> None:
    rng = np.random.default_rng(0)
    w = rng.uniform(0, 1, (6, 4)).astype(np.float32)
    q, s = quantize_rows_int8(w)
    rows = np.array([1, 4], dtype=np.int32)
    got = mixed_ell_values(q, s, rows, encode_fp16(w[rows]))
    for r in range(6):
        want = [float(np.float32(_half(float(v)))) for v in w[r]] if r in rows else [float(np.float32(np.float32(int(v)) * s[r])) for v in q[r]]
        assert got[r].tolist() == want
    # tiles: 3 tiles of 2 rows; rows 1 and 4 in fp16
    row, col = np.nonzero(w > 0.3)
    from bevcompile.matrix.layout import tile_layout, tile_scales_and_int8

    _cols, offsets, tw = tile_layout(row, col, w[row, col], 6, 4, 2, 2)
    ts, tq = tile_scales_and_int8(tw, offsets, 2, s)
    t16 = fp16_row_tile_weight(tw, offsets, 2, rows)
    values = mixed_tile_values(tq, ts, offsets, 2, rows, t16)
    for t, (block, vblock) in enumerate(zip(tile_blocks(tw, offsets, 2), tile_blocks(values, offsets, 2), strict=True)):
        for i in range(2):
            r = 2 * t + i
            want = decode_fp16(encode_fp16(block[i])) if r in rows else dequantize_rows_int8(quantize_rows_int8(block[i : i + 1], s[r : r + 1])[0], s[r : r + 1])[0]
            assert np.array_equal(vblock[i], want), r


def test_convention_sanitize_keeps_finite_bits_and_zeroes_the_rest() -> None:
    x = np.array([1.5, -0.0, 0.0, np.nan, np.inf, -np.inf, 3.4e38, -1e-45], dtype=np.float32)
    got = sanitize(x)
    assert got.dtype == np.float32
    want = np.array([v if math.isfinite(v) else 0.0 for v in x.tolist()], dtype=np.float32)
    assert got.tobytes() == want.tobytes()  # bit for bit, -0.0 included
    half = np.array([np.nan, -np.inf, 2.5, -0.0], dtype=np.float16)
    assert sanitize(half).tobytes() == np.array([0.0, 0.0, 2.5, -0.0], dtype=np.float16).tobytes()


def test_class_lift_reference_is_the_dense_matrix_times_one_hot() -> None:
    """Against ``W_dense @ one_hot`` (numpy eye indexing), grid columns and frustum columns with depth."""
    rng = np.random.default_rng(1)
    n_cam, h, w, n_classes, d = 2, 3, 4, 3, 2
    labels = rng.integers(-1, n_classes + 1, (2, n_cam, h, w))  # -1 and n_classes: no class
    n_rows = 5
    for depth_bins in (None, d):
        n_cols = n_cam * (depth_bins or 1) * h * w
        row, col = np.nonzero(rng.random((n_rows, n_cols)) < 0.4)
        val = rng.random(row.size).astype(np.float32)
        depth = rng.random((2, n_cam, d, h, w)) if depth_bins else None
        got = class_lift_reference(row, col, val, labels, n_classes, n_rows, n_depth=depth_bins, depth=depth)
        dense = coo_to_dense(row, col, val, (n_rows, n_cols)).astype(np.float64)
        for b in range(2):
            flat = labels[b].reshape(n_cam, h * w)
            onehot = np.zeros((n_cam, h * w, n_classes))
            for c in range(n_cam):
                for p in range(h * w):
                    if 0 <= flat[c, p] < n_classes:
                        onehot[c, p, flat[c, p]] = 1.0
            if depth_bins:  # X[(cam, d, v, u), k] = depth * onehot
                x = (depth[b].reshape(n_cam, d, h * w)[..., None] * onehot[:, None]).reshape(n_cols, n_classes)
            else:
                x = onehot.reshape(n_cols, n_classes)
            assert np.allclose(got[b], (dense @ x).T, rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------------------
# the store format and its checks
# --------------------------------------------------------------------------------------

MIXED = MatrixOptions(topk=6, align=8, tile_rows=64, quantize="mixed", fp16_rows="beyond:12.0")
FP16 = MatrixOptions(mode="grid", topk=4, align=4, tile_rows=50, quantize="fp16", compact_rows=True)


def test_options_keep_existing_build_options_and_need_a_rule_for_mixed() -> None:
    assert "fp16_rows" not in MatrixOptions(quantize="int8").to_dict()
    assert "fp16_rows" not in FP16.to_dict()
    assert MIXED.to_dict()["fp16_rows"] == "beyond:12.0"
    assert MatrixOptions.from_command(quantize="MIXED", fp16_rows="fraction:0.25").fp16_rows == "fraction:0.25"
    with pytest.raises(UsageError, match="--quantize mixed needs --fp16-rows beyond:METRES, snr:DB or fraction:F"):
        MatrixOptions(quantize="mixed").validate()
    with pytest.raises(UsageError, match=r"--fp16-rows applies to --quantize mixed only \(--quantize int8\)"):
        MatrixOptions(quantize="int8", fp16_rows="snr:50").validate()
    assert absorb_options(MIXED, quantize="int8").fp16_rows is None
    assert absorb_options(MatrixOptions(quantize="int8"), quantize="mixed", fp16_rows="snr:50").fp16_rows == "snr:50.0"
    with pytest.raises(UsageError, match="needs --fp16-rows"):
        absorb_options(MatrixOptions(), quantize="mixed")


@pytest.mark.parametrize("options", [MIXED, FP16, MatrixOptions(mode="ray", topk=5, align=8, tile_rows=16, quantize="mixed", fp16_rows="fraction:0.3", compact_rows=True)])
def test_reduced_precision_group_passes_every_check_and_rebuilds_bit_identically(options: MatrixOptions) -> None:
    arrays, attrs = _group(MULTI, options)
    checks = mc.check_matrix(_ctx(MULTI), arrays, attrs)
    assert not _failed(checks), [c for c in checks if not c.passed]
    names = {c.name for c in checks}
    assert ({"fp16_values", "fp16_recorded_error"} if options.quantize == "fp16" else {"mixed_rows", "mixed_values", "int8_values"}) <= names
    rebuilt = mc.rebuild_matrix(MULTI, attrs)
    assert json_attrs(rebuilt.pop(REBUILT_ATTRS)) == json_attrs(attrs)
    assert rebuilt.keys() == arrays.keys()
    for name, arr in arrays.items():
        assert rebuilt[name].dtype == arr.dtype and rebuilt[name].tobytes() == arr.tobytes(), name
    rows = [r for r in mc.verify_matrix(_ctx(MULTI), arrays, attrs) if "fp16" in r.product or "mixed" in r.product]
    assert rows and all(r.passed for r in rows), rows


def test_store_format_of_fp16_and_mixed() -> None:
    """The arrays are what the attributes say, restated from the float32 values."""
    p = build_matrix(MULTI, FP16)
    assert p.ell_weight_fp16 is not None and p.tile_weight_fp16 is not None
    assert p.ell_weight_fp16.dtype == np.float16 and p.ell_weight_fp16.shape == p.ell_weight.shape
    assert [float(v) for v in p.tile_weight_fp16[:50]] == [_half(float(v)) for v in p.tile_weight[:50]]
    assert p.row_scale is None and "fp16" in matrix_attributes(p, MULTI) and "int8" not in matrix_attributes(p, MULTI)
    m = build_matrix(MULTI, MIXED)
    int8 = build_matrix(MULTI, MatrixOptions(topk=6, align=8, tile_rows=64, quantize="int8"))
    for name in ("ell_weight_int8", "row_scale", "tile_weight_int8", "tile_row_scale"):  # int8 exactly as --quantize int8
        assert getattr(m, name).tobytes() == getattr(int8, name).tobytes()
    rows = m.fp16_rows
    assert rows is not None and rows.dtype == np.int32 and rows.size
    dist = row_distances_m(MULTI, m.n_rows)
    nnz = np.bincount(m.coo_row, minlength=m.n_rows)
    assert set(rows.tolist()) == {r for r in range(m.n_rows) if nnz[r] and dist[r] > 12.0}
    assert m.fp16_row_weight is not None and np.array_equal(m.fp16_row_weight, m.ell_weight[rows].astype(np.float16))
    attrs = matrix_attributes(m, MULTI)
    assert attrs["mixed"]["rule"] == "beyond:12.0" and attrs["mixed"]["n_fp16_rows"] == rows.size
    assert attrs["build_options"]["fp16_rows"] == "beyond:12.0"
    b = m.figures.product_bytes
    assert b["ell_int8"] < b["ell_mixed"] < b["ell"]
    n16, (rows_pad, k_pad) = rows.size, m.ell_index.shape
    assert b["ell_mixed"] == m.ell_index.nbytes + (rows_pad - n16) * (k_pad + 4) + n16 * k_pad * 2 + rows_pad * 4


def _set_first(name: str, value: Any) -> Any:
    def damage(a: dict[str, np.ndarray], _attrs: dict[str, Any]) -> None:
        a[name].flat[0] = value

    return damage


def _drop_fp16_row(a: dict[str, np.ndarray], _attrs: dict[str, Any]) -> None:
    a["fp16_rows"] = a["fp16_rows"][1:]
    a["fp16_row_weight"] = a["fp16_row_weight"][1:]


def _record(block: str, key: str, value: Any) -> Any:
    def damage(_a: dict[str, np.ndarray], attrs: dict[str, Any]) -> None:
        attrs[block][key] = value

    return damage


@pytest.mark.parametrize(
    ("options", "damage", "expected"),
    [
        (MIXED, _drop_fp16_row, ("mixed_rows", "matrix/fp16_rows")),
        (MIXED, _set_first("fp16_row_weight", np.float16(7.0)), ("mixed_values", "matrix/fp16_row_weight")),
        (MIXED, _set_first("fp16_row_tile_weight", np.float16(np.nan)), ("mixed_values", "matrix/fp16_row_tile_weight")),
        (MIXED, _record("mixed", "max_abs_error", 1.0), ("mixed_recorded_error", "matrix/")),
        (FP16, _set_first("ell_weight_fp16", np.float16(np.inf)), ("fp16_values", "matrix/ell_weight_fp16")),
        (FP16, _set_first("tile_weight_fp16", np.float16(3.0)), ("fp16_values", "matrix/tile_weight_fp16")),
        (FP16, _record("fp16", "max_rel_error", 0.5), ("fp16_recorded_error", "matrix/")),
    ],
)
def test_each_damage_fails_the_check_that_names_it(options: MatrixOptions, damage: Any, expected: tuple[str, str]) -> None:
    arrays, attrs = _group(MULTI, options)
    attrs = json_attrs(attrs)
    damage(arrays, attrs)
    assert expected in _failed(mc.check_matrix(_ctx(MULTI), arrays, attrs))


def test_a_learned_mixed_store_rederives_its_fp16_rows_from_the_learned_values() -> None:
    """absorb: the rule runs on the learned values (a row whose int8 SNR dropped joins the fp16
    rows); the group passes every check and rebuilds bit for bit from its stored values."""
    options = MatrixOptions(topk=6, align=8, quantize="mixed", fp16_rows="snr:52.0")
    geometric = build_matrix(MULTI, options)
    learned = geometric.ell_weight.copy()
    mask = learned != 0
    learned[mask] *= np.random.default_rng(5).uniform(0.2, 1.8, int(mask.sum())).astype(np.float32)
    products = learned_products(MULTI, geometric, learned)
    assert products.fp16_rows is not None and not np.array_equal(products.fp16_rows, geometric.fp16_rows)
    record = LearnedRecord("ckpt.npy", "0" * 64, None, "npy", "float32")
    group = learned_group(MULTI, geometric, products, record)
    arrays = {k: v.copy() for k, v in group.arrays.items()}
    checks = mc.check_matrix(_ctx(MULTI), arrays, group.attrs)
    assert not _failed(checks), [c for c in checks if not c.passed]
    rebuilt = mc.rebuild_matrix(MULTI, group.attrs, arrays)
    assert rebuilt["fp16_rows"].tobytes() == arrays["fp16_rows"].tobytes()
