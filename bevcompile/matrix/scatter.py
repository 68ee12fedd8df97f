"""``np.add.at`` without the GIL: the scatter-adds of the streamed builds' worker threads.

``np.add.at(out, index, values)`` holds the GIL for its whole loop, so while one ``--jobs`` thread
scatters (row masses, histogram counts) the others cannot start their next numpy call. A scatter-add
is also a sparse matrix-vector product, ``out += A @ x`` with ``A`` the one-column CSC matrix of
row indices ``index``, values ``values`` (column pointers ``[0, m]``) and ``x = [1]``, and scipy's
sparsetools ``csc_matvec`` releases the GIL: it runs ``out[index[n]] += values[n] * x[0]`` for
``n`` in order, the same additions in the same order as ``np.add.at`` (``values[n] * 1`` is
exact), so the same bits (pinned by ``tests/matrix/test_scatter.py``). (``coo_matvec`` does the
same but also reads a column index per value.)

``csc_matvec`` is scipy's internal routine (``scipy.sparse._sparsetools``, the same arguments
since scipy 0.14); if it is missing, refuses the arrays or its call signature ever changes (it
checks its arguments before it writes anything), :func:`scatter_add` falls back to ``np.add.at``.

May import: numpy, scipy.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

try:  # pragma: no branch
    from scipy.sparse._sparsetools import csc_matvec as _csc_matvec
except ImportError:  # pragma: no cover - a scipy without it: np.add.at
    _csc_matvec = None

__all__ = ["scatter_add"]

_DTYPES = (np.dtype(np.float64), np.dtype(np.int32), np.dtype(np.int64))
"""The ``out`` types the streams scatter into (sparsetools has each)."""
_ones: dict[np.dtype[Any], npt.NDArray[Any]] = {}


def _filled(cache: dict[np.dtype[Any], npt.NDArray[Any]], value: int, dtype: np.dtype[Any], n: int) -> npt.NDArray[Any]:
    """A read-only array of at least ``n`` times ``value`` (shared by the threads; grown, never written)."""
    have = cache.get(dtype)
    if have is None or have.size < n:
        have = np.full(max(n, 1 << 16, 2 * (0 if have is None else have.size)), value, dtype=dtype)
        have.flags.writeable = False
        cache[dtype] = have  # one assignment: a thread sees the old array or the new one
    return have[:n]


def scatter_add(out: npt.NDArray[Any], index: npt.NDArray[np.int64], values: npt.NDArray[Any] | None = None) -> None:
    """``out[index[n]] += values[n]`` for ``n`` in order (``values`` None: ``+= 1``), exactly as
    ``np.add.at(out, index, values)``, releasing the GIL.

    Convention: ``out`` 1-D C-contiguous float64, int32 or int64 (a view is written through);
    ``index`` ``(m,)`` int64 in ``[0, out.size)``, not checked (as ``np.add.at``, whose bounds
    test the fallback keeps); ``values`` ``(m,)`` of ``out``'s dtype."""
    m = int(index.size)
    if not m:
        return
    dtype = out.dtype
    if (
        _csc_matvec is None
        or dtype not in _DTYPES
        or out.ndim != 1
        or not out.flags.c_contiguous
        or not out.flags.writeable
        or index.dtype != np.int64
        or (values is not None and (values.dtype != dtype or values.size != m))
    ):
        np.add.at(out, index, dtype.type(1) if values is None else values)
        return
    data = _filled(_ones, 1, dtype, m) if values is None else np.ascontiguousarray(values).reshape(-1)
    try:
        _csc_matvec(out.size, 1, np.array((0, m), dtype=np.int64), np.ascontiguousarray(index).reshape(-1), data, _filled(_ones, 1, dtype, 1), out)
    except (TypeError, ValueError):  # another scipy's signature: refused before any write
        np.add.at(out, index, dtype.type(1) if values is None else values)
