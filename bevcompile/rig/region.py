"""BEV regions: which cells a product computes, at what resolution, and the way back to the dense map.

Pure numpy (no I/O: :mod:`bevcompile.rig.config` reads the mask files). The rules (stated once,
also in :data:`bevcompile.conventions.REGION_CONVENTIONS` and ``docs/conventions.md``):

* **Kept cells** (``bev.region.keep``): a fine cell ``(iy, ix)`` is kept iff its centre is inside
  one of the polygons (BEV-frame metres, even-odd crossing rule, a crossing counted for an edge
  with ``y0 <= y_c < y1`` or ``y1 <= y_c < y0``, i.e. half-open in y), or iff the mask is non-zero
  at ``[iy, ix]``; without ``keep`` every cell is kept.
* **Rings** (``bev.region.rings``): the distance of a fine cell is the Chebyshev distance
  ``max(|x_c|, |y_c|)`` of its centre from the BEV frame's origin; its factor is that of the last
  band with ``beyond_m < distance`` (1 within the first band). An aligned block of ``f x f`` fine
  cells (``iy % f == ix % f == 0``) becomes one super-cell iff EVERY fine cell in it is kept and has
  factor ``>= f`` and no larger super-cell holds it; otherwise it is split into its four
  ``f/2`` blocks: a block that straddles a band boundary or the keep boundary belongs to the finer band.
* **Cell table** ``cells`` int32 ``(n_kept, 3)``: ``(iy, ix, size)`` of each kept (super-)cell, its
  first (lowest-index) fine cell and its side in fine cells, sorted by ``iy * nx + ix``. Its
  centre is ``(x_min + (ix + size / 2) dx, y_min + (iy + size / 2) dy)``.
* **Expand** ``expand`` int32 ``(ny * nx,)``: fine cell ``iy * nx + ix`` reads compact row
  ``expand[iy * nx + ix]``: the row of the (super-)cell holding it, or ``n_kept`` (the zero row
  appended after the compact rows) outside the region. ``dense = concat(rows, 0)[expand]``.
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from .config import AxisSpec, BevSpec, RegionSpec

Bool2 = npt.NDArray[np.bool_]
I32 = npt.NDArray[np.int32]


@dataclass(frozen=True)
class RegionTable:
    """The kept (super-)cells of a BEV grid and the ``expand`` index back to it (module docstring).

    Convention: ``cells`` int32 ``(n_kept, 3)`` ``(iy, ix, size)`` sorted by ``iy * nx + ix``;
    ``expand`` int32 ``(ny * nx,)`` values in ``[0, n_kept]`` (``n_kept`` = the zero row);
    ``bev_shape`` ``(ny, nx)``.
    """

    cells: I32
    expand: I32
    bev_shape: tuple[int, int]

    @property
    def n_kept(self) -> int:
        return int(self.cells.shape[0])

    @property
    def n_fine_kept(self) -> int:
        """Fine cells inside the region (``expand < n_kept``)."""
        return int(np.count_nonzero(self.fine_kept()))

    def fine_kept(self) -> Bool2:
        """``(ny * nx,)`` bool: the fine cells inside the region (``expand < n_kept``)."""
        return np.asarray(self.expand < self.n_kept)

    def row_of_cell(self) -> npt.NDArray[np.int64]:
        """``(ny * nx,)`` int64: the compact row of each fine cell, -1 outside the region."""
        out = self.expand.astype(np.int64)
        out[out == self.n_kept] = -1
        return out

    def centres(self, x_min: float, dx: float, y_min: float, dy: float) -> npt.NDArray[np.float64]:
        """``(n_kept, 2)`` float64 ``(x, y)`` metres of each (super-)cell's centre in the BEV frame."""
        iy, ix, size = (self.cells[:, i].astype(np.float64) for i in range(3))
        return np.stack([x_min + (ix + size / 2) * dx, y_min + (iy + size / 2) * dy], axis=1)


def cell_centres(x: AxisSpec, y: AxisSpec) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
    """``(x_c, y_c)`` float64 ``(ny, nx)``: the fine cell centres, metres in the BEV frame."""
    xc = x.min + (np.arange(x.n) + 0.5) * x.step
    yc = y.min + (np.arange(y.n) + 0.5) * y.step
    return np.broadcast_to(xc[None, :], (y.n, x.n)), np.broadcast_to(yc[:, None], (y.n, x.n))


SCAN_ELEMENTS = 1 << 22
"""Edge x row crossings evaluated at once by :func:`polygon_intervals` (bounds its memory)."""


def polygon_intervals(
    polygons: Sequence[Sequence[Sequence[float]]], x: AxisSpec, y: AxisSpec
) -> Iterator[tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]]]:
    """The cells inside each polygon as runs ``(iy, ix_start, ix_end)`` (``ix`` in ``[start, end)``),
    in chunks of rows: a scanline form of the even-odd rule that never holds an ``(ny, nx)`` array.

    Edge ``e`` toggles, in row ``iy``, exactly the cells with ``x_c < x_cross_e(iy)`` (the same
    float64 ``x_cross`` as the rule, for the edges that span ``y_c``): a prefix ``[0, k_e)`` of the
    row, ``k_e`` the number of centres below ``x_cross`` (``searchsorted``; the centres increase).
    With the ``k`` of a polygon's edges sorted, ``k_(0) = 0``, a cell in ``[k_(i), k_(i+1))`` is
    toggled ``E - i`` times: inside iff that is odd. Runs of different polygons may overlap."""
    xc = x.min + (np.arange(x.n) + 0.5) * x.step
    yc_all = y.min + (np.arange(y.n) + 0.5) * y.step
    for polygon in polygons:
        vertices = np.asarray(polygon, dtype=np.float64)
        x0, y0 = vertices[:, 0], vertices[:, 1]
        x1, y1 = np.roll(x0, -1), np.roll(y0, -1)
        slanted = y0 != y1  # a horizontal edge never crosses the +x ray (half-open rule)
        x0, y0, x1, y1 = x0[slanted], y0[slanted], x1[slanted], y1[slanted]
        n_edges = x0.size
        if n_edges == 0:
            continue
        rows_per_chunk = max(1, SCAN_ELEMENTS // n_edges)
        for first in range(0, y.n, rows_per_chunk):
            yc = yc_all[first : first + rows_per_chunk][:, None]  # (rows, 1)
            spans = ((y0 <= yc) & (yc < y1)) | ((y1 <= yc) & (yc < y0))
            with np.errstate(invalid="ignore", over="ignore"):
                x_cross = x0 + (yc - y0) * (x1 - x0) / (y1 - y0)
            k = np.searchsorted(xc, np.where(np.isnan(x_cross), -np.inf, x_cross), side="left")
            k = np.sort(np.where(spans, k, 0), axis=1)  # (rows, E): non-spanning edges toggle nothing
            starts = np.concatenate([np.zeros((k.shape[0], 1), dtype=k.dtype), k[:, :-1]], axis=1)
            odd = ((n_edges - np.arange(n_edges)) % 2 == 1)[None, :]
            keep = odd & (k > starts)
            rows = np.broadcast_to(np.arange(first, first + k.shape[0])[:, None], k.shape)
            yield rows[keep].astype(np.int64), starts[keep].astype(np.int64), k[keep].astype(np.int64)


def polygon_mask(polygons: Sequence[Sequence[Sequence[float]]], x: AxisSpec, y: AxisSpec) -> Bool2:
    """``(ny, nx)`` bool: cells whose centre is inside one of ``polygons`` (even-odd crossing rule,
    half-open in y; see the module docstring), painted from the runs of :func:`polygon_intervals`
    a block of rows at a time."""
    rows, starts, ends = _all_runs(polygons, x, y)
    out = np.zeros((y.n, x.n), dtype=bool)
    block = max(1, SCAN_ELEMENTS // (x.n + 1))
    bounds = np.searchsorted(rows, np.arange(0, y.n + block, block))  # rows are sorted
    for i, first in enumerate(range(0, y.n, block)):
        n_rows = min(block, y.n - first)
        part = slice(bounds[i], bounds[i + 1])
        delta = np.zeros((n_rows, x.n + 1), dtype=np.int32)
        np.add.at(delta, (rows[part] - first, starts[part]), 1)
        np.add.at(delta, (rows[part] - first, ends[part]), -1)
        out[first : first + n_rows] = np.cumsum(delta, axis=1)[:, : x.n] > 0
    return out


def _all_runs(
    polygons: Sequence[Sequence[Sequence[float]]], x: AxisSpec, y: AxisSpec
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """Every run of :func:`polygon_intervals`, sorted by row."""
    parts = list(polygon_intervals(polygons, x, y))
    if not parts:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    rows, starts, ends = (np.concatenate([p[i] for p in parts]) for i in range(3))
    order = np.argsort(rows, kind="stable")
    return rows[order], starts[order], ends[order]


def polygon_kept_count(polygons: Sequence[Sequence[Sequence[float]]], x: AxisSpec, y: AxisSpec) -> int:
    """``polygon_mask(...).sum()`` without the mask: the length of the union of the runs of
    :func:`polygon_intervals` (memory in the runs, not the cells: a 10^8-cell grid costs what
    its rows do)."""
    rows, starts, ends = _all_runs(polygons, x, y)
    if not rows.size:
        return 0
    width = x.n + 1  # the rows laid end to end on one line: row r's runs lie in [r * width, r * width + nx]
    a, b = rows * width + starts, rows * width + ends
    order = np.lexsort((b, a))
    a, b = a[order], b[order]
    reach = np.maximum.accumulate(b)
    before = np.r_[np.int64(-1), reach[:-1]]
    return int(np.maximum(b - np.maximum(a, before), 0).sum())


def ring_factors(rings: Sequence[Any], x: AxisSpec, y: AxisSpec) -> npt.NDArray[np.int64]:
    """``(ny, nx)`` int64: each fine cell's band factor (1 within the first band)."""
    xc, yc = cell_centres(x, y)
    distance = np.maximum(np.abs(xc), np.abs(yc))
    out = np.ones((y.n, x.n), dtype=np.int64)
    for ring in rings:
        out[distance > ring.beyond_m] = ring.factor
    return out


def keep_mask(region: RegionSpec | None, x: AxisSpec, y: AxisSpec) -> Bool2:
    """``(ny, nx)`` bool: the fine cells the region keeps (every cell without ``keep``)."""
    if region is None or (region.polygons is None and region.mask is None):
        return np.ones((y.n, x.n), dtype=bool)
    if region.polygons is not None:
        return polygon_mask(region.polygons, x, y)
    assert region.mask is not None
    return np.frombuffer(region.mask, dtype=np.uint8).reshape(y.n, x.n).astype(bool)


def region_table(bev: BevSpec) -> RegionTable:
    """The :class:`RegionTable` of ``bev`` (``bev.region`` None: every fine cell, size 1)."""
    return build_table(keep_mask(bev.region, bev.x, bev.y), ring_factors(bev.region.rings if bev.region else (), bev.x, bev.y))


def build_table(kept: Bool2, factors: npt.NDArray[np.int64]) -> RegionTable:
    """The cell table and ``expand`` of the kept cells ``kept`` ``(ny, nx)`` bool with band factors
    ``factors`` ``(ny, nx)`` (powers of two dividing ``ny`` and ``nx``), by the quadtree rule of the
    module docstring."""
    ny, nx = kept.shape
    eligible = np.where(kept, factors, 0)
    assigned = np.zeros((ny, nx), dtype=bool)
    iy_parts: list[npt.NDArray[np.int64]] = []
    ix_parts: list[npt.NDArray[np.int64]] = []
    size_parts: list[npt.NDArray[np.int64]] = []
    sizes = sorted({int(f) for f in np.unique(factors) if f > 1}, reverse=True)
    for f in sizes:
        by, bx = ny // f, nx // f
        block_min = eligible.reshape(by, f, bx, f).min(axis=(1, 3))
        block_taken = assigned.reshape(by, f, bx, f).any(axis=(1, 3))
        chosen = (block_min >= f) & ~block_taken
        qy, qx = np.nonzero(chosen)
        iy_parts.append(qy * f)
        ix_parts.append(qx * f)
        size_parts.append(np.full(qy.size, f, dtype=np.int64))
        assigned |= np.repeat(np.repeat(chosen, f, axis=0), f, axis=1)
    fy, fx = np.nonzero(kept & ~assigned)
    iy_parts.append(fy)
    ix_parts.append(fx)
    size_parts.append(np.ones(fy.size, dtype=np.int64))
    iy = np.concatenate(iy_parts)
    ix = np.concatenate(ix_parts)
    size = np.concatenate(size_parts)
    order = np.argsort(iy * nx + ix, kind="stable")
    cells = np.stack([iy[order], ix[order], size[order]], axis=1).astype(np.int32)
    return RegionTable(cells, expand_of_cells(cells, (ny, nx)), (ny, nx))


def expand_of_cells(cells: npt.NDArray[np.integer[Any]], bev_shape: tuple[int, int]) -> I32:
    """The ``expand`` index ``(ny * nx,)`` int32 of the cell table ``cells`` ``(n_kept, 3)``
    (cells outside every (super-)cell read ``n_kept``, the zero row)."""
    ny, nx = bev_shape
    n_kept = int(cells.shape[0])
    expand = np.full((ny, nx), n_kept, dtype=np.int32)
    for size in np.unique(cells[:, 2]) if n_kept else ():
        rows = np.flatnonzero(cells[:, 2] == size)
        s = int(size)
        dy, dx = np.meshgrid(np.arange(s), np.arange(s), indexing="ij")
        yy = cells[rows, 0][:, None, None] + dy[None]
        xx = cells[rows, 1][:, None, None] + dx[None]
        expand[yy, xx] = rows[:, None, None].astype(np.int32)
    return expand.reshape(-1)


# --------------------------------------------------------------------------------------
# the mask as data: content hash, run lengths, PNG decoding
# --------------------------------------------------------------------------------------


def mask_bytes(mask: npt.NDArray[Any]) -> bytes:
    """The canonical content of a keep mask: row-major ``uint8`` 0/1 of ``mask != 0``."""
    return (np.asarray(mask) != 0).astype(np.uint8).tobytes()


def mask_sha256(content: bytes) -> str:
    """SHA-256 (hex) of a mask's canonical content (:func:`mask_bytes`)."""
    return hashlib.sha256(content).hexdigest()


def mask_runs(content: bytes) -> list[int]:
    """Run lengths of the canonical content, alternating 0-runs and 1-runs, starting with a
    0-run (possibly of length 0)."""
    flat = np.frombuffer(content, dtype=np.uint8)
    if flat.size == 0:
        return []
    change = np.flatnonzero(np.diff(flat)) + 1
    bounds = np.r_[0, change, flat.size]
    runs = np.diff(bounds).tolist()
    return ([0] if flat[0] else []) + [int(r) for r in runs]


def mask_from_runs(runs: Sequence[int], size: int) -> bytes | None:
    """The canonical content of :func:`mask_runs` ``runs`` (None if they do not cover ``size``)."""
    if any(r < 0 for r in runs) or sum(runs) != size:
        return None
    values = np.arange(len(runs)) % 2
    return np.repeat(values.astype(np.uint8), np.asarray(runs, dtype=np.int64)).tobytes()


def png_header(raw: bytes) -> tuple[int, int, int, int, int]:
    """``(width, height, bit depth, colour type, interlace)`` of a PNG's IHDR chunk (the first
    chunk), read before any pixel data. ValueError with a one-line reason for a file that is not
    a PNG."""
    if raw[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError("not a PNG file (bad signature)")
    if len(raw) < 33 or raw[12:16] != b"IHDR":
        raise ValueError("PNG without an IHDR chunk")
    (length,) = struct.unpack(">I", raw[8:12])
    if length != 13:
        raise ValueError("PNG IHDR chunk is not 13 bytes")
    width, height, depth, colour, _compression, _filter, interlace = struct.unpack(">IIBBBBB", raw[16:29])
    return width, height, depth, colour, interlace


def decode_png(raw: bytes) -> npt.NDArray[np.uint8]:
    """A non-interlaced 8-bit PNG (grey, grey+alpha, RGB, RGBA, palette) as ``(height, width)``
    uint8: the grey value, the max of R, G, B, or the palette index (alpha ignored). ValueError
    with a one-line reason for anything else. The pixel data is inflated no further than the
    size the header declares (a small file cannot inflate to gigabytes)."""
    width, height, depth, colour, interlace = png_header(raw)
    channels = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}.get(colour)
    if channels is None or depth != 8 or interlace != 0:
        raise ValueError(f"PNG of bit depth {depth}, colour type {colour}, interlace {interlace}: only 8-bit non-interlaced PNGs are read")
    pos = 8
    data = bytearray()
    while pos + 8 <= len(raw):
        (length,) = struct.unpack(">I", raw[pos : pos + 4])
        chunk = raw[pos + 4 : pos + 8]
        if chunk == b"IDAT":
            data += raw[pos + 8 : pos + 8 + length]
        elif chunk == b"IEND":
            break
        pos += 12 + length
    expected = height * (width * channels + 1)
    try:
        inflate = zlib.decompressobj()
        pixels = inflate.decompress(bytes(data), expected + 1)
    except zlib.error as exc:
        raise ValueError(f"PNG data does not decompress ({exc})") from None
    stride = width * channels
    if len(pixels) > expected or inflate.unconsumed_tail:
        raise ValueError(f"PNG data holds more than the {expected} bytes its header declares")
    if len(pixels) != expected:
        raise ValueError(f"PNG data holds {len(pixels)} bytes, expected {expected}")
    rows = np.frombuffer(pixels, dtype=np.uint8).reshape(height, stride + 1)
    out = np.zeros((height, stride), dtype=np.uint8)  # one byte a sample; one row at a time in int64
    prev = np.zeros(stride, dtype=np.int64)
    for r in range(height):
        kind, line = int(rows[r, 0]), rows[r, 1:].astype(np.int64)
        cur = np.zeros(stride, dtype=np.int64)
        if kind == 0:
            cur = line
        elif kind == 2:
            cur = (line + prev) & 255
        elif kind in (1, 3, 4):
            for i in range(stride):  # sequential by definition (each byte depends on its left neighbour)
                left = cur[i - channels] if i >= channels else 0
                up = prev[i]
                if kind == 1:
                    pred = left
                elif kind == 3:
                    pred = (left + up) // 2
                else:
                    up_left = prev[i - channels] if i >= channels else 0
                    p = left + up - up_left
                    pa, pb, pc = abs(p - left), abs(p - up), abs(p - up_left)
                    pred = left if pa <= pb and pa <= pc else up if pb <= pc else up_left
                cur[i] = (line[i] + pred) & 255
        else:
            raise ValueError(f"PNG row {r} has unknown filter type {kind}")
        out[r] = cur
        prev = cur
    image = out.reshape(height, width, channels).astype(np.uint8)
    if channels in (1, 2):
        return image[:, :, 0].copy()
    return image[:, :, :3].max(axis=2)
