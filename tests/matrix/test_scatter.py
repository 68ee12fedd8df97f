"""``bevcompile.matrix.scatter``: ``scatter_add`` is ``np.add.at`` bit for bit (the same additions
in the same order), for every type the streams scatter into, through views, with and without
values, on scipy's GIL-free routine and on the fallback. That it lets the other threads run is a
measurement, not a test: ``benchmarks/gil_scaling.py``."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import bevcompile.matrix.scatter as scatter_mod
from bevcompile.matrix.scatter import scatter_add


@pytest.fixture(params=["sparsetools", "fallback"])
def route(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "fallback":
        monkeypatch.setattr(scatter_mod, "_csc_matvec", None)
    else:
        assert scatter_mod._csc_matvec is not None  # the scipy the constraints pin has it
    return str(request.param)


@pytest.mark.parametrize("dtype", [np.float64, np.int32, np.int64])
def test_scatter_add_is_add_at_through_a_view(route: str, dtype: type) -> None:
    rng = np.random.default_rng(0)
    index = rng.integers(0, 95, 40_000).astype(np.int64)
    values = (rng.standard_normal(40_000) * 1e3).astype(dtype)
    got = np.arange(100).astype(dtype)
    want = got.copy()
    scatter_add(got[5:], index, values)  # written through the view
    np.add.at(want[5:], index, values)
    assert np.array_equal(got, want)
    scatter_add(got, index)  # += 1
    np.add.at(want, index, dtype(1))
    assert np.array_equal(got, want)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 9), st.floats(-1e12, 1e12, allow_nan=False, allow_subnormal=True)), max_size=200),
    st.sampled_from(["sparsetools", "fallback"]),
)
def test_scatter_add_sums_in_index_order_bit_for_bit(pairs: list[tuple[int, float]], which: str) -> None:
    index = np.array([i for i, _ in pairs], dtype=np.int64)
    values = np.array([v for _, v in pairs], dtype=np.float64)
    got = np.full(10, 0.1)
    want = got.copy()
    saved = scatter_mod._csc_matvec
    try:
        if which == "fallback":
            scatter_mod._csc_matvec = None
        scatter_add(got, index, values)
    finally:
        scatter_mod._csc_matvec = saved
    for i, v in zip(index.tolist(), values.tolist(), strict=True):  # one by one, in order
        want[i] += v
    assert got.view(np.int64).tolist() == want.view(np.int64).tolist()


def test_arrays_sparsetools_cannot_take_fall_back_to_add_at() -> None:
    out = np.zeros(20, dtype=np.float32)  # not one of the stream types
    scatter_add(out, np.array([1, 1, 3], dtype=np.int64), np.array([0.5, 0.25, 2.0], dtype=np.float32))
    assert out[[1, 3]].tolist() == [0.75, 2.0]
    strided = np.zeros(40)[::2]  # not contiguous
    scatter_add(strided, np.array([2, 2], dtype=np.int64), np.array([1.0, 2.0]))
    assert strided[2] == 3.0
    with pytest.raises(IndexError):  # the fallback keeps np.add.at's bounds test
        scatter_add(strided, np.array([25], dtype=np.int64), np.array([1.0]))


def test_a_sparsetools_that_refuses_the_call_falls_back_to_add_at(monkeypatch: pytest.MonkeyPatch) -> None:
    """Another scipy's ``csc_matvec`` signature raises before writing: the sums are still ``np.add.at``'s."""

    def refuses(*args: object) -> None:
        raise TypeError("csc_matvec() takes 7 positional arguments")

    monkeypatch.setattr(scatter_mod, "_csc_matvec", refuses)
    out = np.zeros(5)
    scatter_add(out, np.array([0, 0, 4], dtype=np.int64), np.array([1.0, 2.0, 3.0]))
    assert out.tolist() == [3.0, 0.0, 0.0, 0.0, 3.0]
