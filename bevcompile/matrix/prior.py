"""The depth prior of ``bevcompile matrix --mode ray``: what it is, how it is read, checked,
normalised and recorded. Pure numpy (reading one ``.npy`` file is the only I/O, at the edge).

A ray-mode matrix folds the depth axis of the frustum matrix with a fixed prior: the weight of
pixel ``(u, v)`` of camera ``cam`` in BEV cell ``r`` is ``sum_d p[cam, d, v, u] * s(point(u, v, d) -> r)``
(``s`` the frustum splat weight). ``p`` is the prior renormalised per pixel:

* ``--depth-prior uniform`` (default): ``p = 1 / D`` for every bin;
* ``--depth-prior FILE.npy``: a real array of shape ``(D,)`` (every camera and pixel),
  ``(n_cam, D)`` (per camera) or ``(n_cam, D, H_f, W_f)`` (per feature pixel), finite and
  ``>= 0``; ``p = raw / sum_d raw`` per pixel (the sum taken sequentially in increasing ``d``);
  a pixel whose raw prior sums to 0 contributes nothing (e.g. masked ego-vehicle pixels); a
  prior that is 0 everywhere is refused.

The raw prior (as float64) is stored as ``matrix/depth_prior``, named in ``build_options`` by
``"sha256:<hex>"`` of its float64 C-order bytes, so ``inspect --strict`` rebuilds the matrix from
config + build_options + that array; the group attributes also record the file's name, its own
sha256 and the shape.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from ..errors import DepthPriorError, UsageError
from ..files import MISSING, FileRefused, read_regular
from ..rig.config import RigConfig

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]

UNIFORM = "uniform"
TOKEN_RE = re.compile(r"^sha256:[0-9a-f]{64}$")
ARRAY = "depth_prior"
"""Name of the stored raw prior in ``matrix/`` (only for a file prior)."""
NORMALISATION_RULE = (
    "p[cam, d, v, u] = raw / sum_d raw per feature pixel (sum in increasing d; raw broadcast from (D,) or (n_cam, D)); "
    "a pixel whose raw prior sums to 0 contributes nothing"
)
WEIGHT_RULE = "W[row, (cam, v, u)] = sum over depth bins d (increasing) of p[cam, d, v, u] * frustum splat weight of point (u, v, d) in row"


def array_sha256(values: F64) -> str:
    """sha256 of the float64 C-order bytes of ``values``."""
    return hashlib.sha256(np.ascontiguousarray(values, dtype=np.float64).tobytes()).hexdigest()


def check_token(token: object) -> str:
    """``build_options["depth_prior"]``: ``"uniform"`` or ``"sha256:<64 hex>"`` (UsageError otherwise)."""
    if token == UNIFORM or (isinstance(token, str) and TOKEN_RE.match(token)):
        return str(token)
    raise UsageError(f"depth_prior must be 'uniform' or 'sha256:<64 hex digits>' (a stored prior), got {token!r}")


@dataclass(frozen=True)
class DepthPrior:
    """A checked depth prior.

    Convention: ``raw`` float64 ``(D,)``, ``(n_cam, D)`` or ``(n_cam, D, H_f, W_f)`` (None:
    uniform), finite, >= 0, not 0 everywhere; ``source`` ``"uniform"`` or the file name as given;
    ``file_sha256`` the file's bytes (None for uniform or an in-memory array).
    """

    raw: F64 | None = None
    source: str = UNIFORM
    file_sha256: str | None = None

    @property
    def uniform(self) -> bool:
        return self.raw is None

    @property
    def token(self) -> str:
        """What ``build_options["depth_prior"]`` records."""
        return UNIFORM if self.raw is None else f"sha256:{array_sha256(self.raw)}"

    def record(self) -> dict[str, Any]:
        """The ``matrix/`` ``attrs["depth_prior"]`` of a ray store (deterministic)."""
        if self.raw is None:
            return {"kind": UNIFORM, "rule": "p = 1 / D for every bin", "weight_rule": WEIGHT_RULE}
        return {
            "kind": "array",
            "array": f"matrix/{ARRAY}",
            "shape": list(self.raw.shape),
            "dtype": "float64",
            "sha256": array_sha256(self.raw),
            "source": Path(self.source).name,
            "file_sha256": self.file_sha256,
            "rule": NORMALISATION_RULE,
            "weight_rule": WEIGHT_RULE,
        }

    def normalised(self, rig: RigConfig) -> NormalisedPrior:
        return NormalisedPrior.of(self, rig)


@dataclass(frozen=True)
class NormalisedPrior:
    """``p[cam, d, pixel]`` evaluated elementwise on demand (never the full per-pixel array twice).

    Convention: ``raw`` float64 ``(n_cam or 1, D, plane or 1)``, ``total`` float64
    ``(n_cam or 1, plane or 1)`` = ``sum_d raw`` (sequential in increasing ``d``);
    ``p = raw / total`` elementwise (0 where ``total`` is 0), the same bits for every caller.
    """

    raw: F64
    total: F64

    @classmethod
    def of(cls, prior: DepthPrior, rig: RigConfig) -> NormalisedPrior:
        n_bins = rig.depth.n_bins
        w_f, h_f = rig.feature_size
        if prior.raw is None:
            raw = np.ones((1, n_bins, 1))
        elif prior.raw.ndim == 1:
            raw = prior.raw.reshape(1, n_bins, 1)
        elif prior.raw.ndim == 2:
            raw = prior.raw.reshape(rig.n_cam, n_bins, 1)
        else:
            raw = prior.raw.reshape(rig.n_cam, n_bins, h_f * w_f)
        total = np.zeros((raw.shape[0], raw.shape[2]))
        for d in range(n_bins):  # sequential in increasing d (the stated rule)
            total += raw[:, d]
        return cls(raw, total)

    @property
    def per_pixel(self) -> bool:
        """Whether ``p`` depends on the pixel (else :meth:`weights` ignores ``pixel``)."""
        return bool(self.raw.shape[2] > 1)

    def table(self, cam: int) -> F64:
        """``(D,)`` float64 ``p[cam, d]`` of a prior that does not depend on the pixel (one division
        per depth bin: the bits :meth:`weights` looks up)."""
        if self.per_pixel:
            raise ValueError("a per-pixel prior has no per-camera table")
        c = cam if self.raw.shape[0] > 1 else 0
        with np.errstate(invalid="ignore", divide="ignore"):
            table = self.raw[c, :, 0] / self.total[c, 0]
        if self.total[c, 0] == 0.0:
            table[:] = 0.0
        return table

    def max_weight(self) -> float:
        """The largest ``p[cam, d, pixel]`` of the prior (exactly: division by the same positive
        total is monotone, so a pixel's largest ``p`` is its largest raw value over its total)."""
        with np.errstate(invalid="ignore", divide="ignore"):
            best = self.raw.max(axis=1) / self.total
        best[self.total == 0.0] = 0.0
        return float(best.max())

    def weights(self, cam: int, depth_bin: I64, pixel: npt.NDArray[np.integer[Any]] | None) -> F64:
        """``p[cam, d, pixel]`` of each ``(depth_bin[i], pixel[i])`` (int arrays of one camera;
        ``pixel`` may be None unless :attr:`per_pixel`)."""
        c = cam if self.raw.shape[0] > 1 else 0
        if not self.per_pixel:  # one division per depth bin, looked up: the same bits
            return self.table(cam)[depth_bin]
        assert pixel is not None
        pix = pixel
        total = self.total[c, pix]
        with np.errstate(invalid="ignore", divide="ignore"):
            out = self.raw[c, depth_bin, pix] / total
        out[total == 0.0] = 0.0
        return out

    def dense(self, rig: RigConfig) -> F64:
        """``(n_cam, D, H_f, W_f)`` float64 (tests and references on small rigs)."""
        w_f, h_f = rig.feature_size
        plane = h_f * w_f
        out = np.empty((rig.n_cam, rig.depth.n_bins, plane))
        d = np.arange(rig.depth.n_bins)
        for cam in range(rig.n_cam):
            dd, pp = np.meshgrid(d, np.arange(plane), indexing="ij")
            out[cam] = self.weights(cam, dd.ravel(), pp.ravel()).reshape(rig.depth.n_bins, plane)
        return out.reshape(rig.n_cam, rig.depth.n_bins, h_f, w_f)


def allowed_shapes(rig: RigConfig) -> tuple[tuple[int, ...], ...]:
    w_f, h_f = rig.feature_size
    d = rig.depth.n_bins
    return (d,), (rig.n_cam, d), (rig.n_cam, d, h_f, w_f)


def check_prior(values: np.ndarray, rig: RigConfig, where: str, field: str = "") -> F64:
    """``values`` as a checked float64 raw prior (:class:`DepthPriorError` naming ``where`` otherwise)."""
    shapes = allowed_shapes(rig)
    _check_real(values, where, field)
    if tuple(values.shape) not in shapes:
        shown = ", ".join(str(s) for s in shapes)
        raise DepthPriorError(
            where, field,
            f"shape {tuple(values.shape)}; expected one of {shown} ((D,), (n_cam, D), (n_cam, D, H_f, W_f) for "
            f"{rig.n_cam} cameras, {rig.depth.n_bins} depth bins, feature map {rig.feature_size[0]}x{rig.feature_size[1]})",
        )
    return _checked_values(values, where, field)


def check_prior_values(values: np.ndarray, where: str, field: str = "") -> F64:
    """What can be checked of a raw prior without the rig (a fleet manifest's ``depth-prior``, read
    before the vehicles' rigs): a real array of 1, 2 or 4 dimensions, finite, >= 0, not 0
    everywhere; :func:`check_prior` checks the shape against each rig."""
    _check_real(values, where, field)
    if values.ndim not in (1, 2, 4):
        raise DepthPriorError(where, field, f"shape {tuple(values.shape)}; expected (D,), (n_cam, D) or (n_cam, D, H_f, W_f)")
    return _checked_values(values, where, field)


def _check_real(values: np.ndarray, where: str, field: str) -> None:
    if values.dtype.kind not in "fiu":
        raise DepthPriorError(where, field, f"dtype {values.dtype}: a depth prior is a real (float or integer) array")


def _checked_values(values: np.ndarray, where: str, field: str) -> F64:
    raw = np.asarray(values, dtype=np.float64)
    bad = ~np.isfinite(raw)
    if bad.any():
        raise DepthPriorError(where, field, f"{int(bad.sum())} value(s) not finite (first at index {_first(bad)})")
    negative = raw < 0
    if negative.any():
        raise DepthPriorError(where, field, f"{int(negative.sum())} negative value(s) (first at index {_first(negative)}, {raw[negative][0]:g}); a prior is >= 0")
    total = raw.sum(axis=-1 if raw.ndim < 3 else 1)
    if not np.all(np.isfinite(total)):
        raise DepthPriorError(where, field, "the per-pixel sum over depth bins overflows float64; scale the prior down")
    if not np.any(total > 0):
        raise DepthPriorError(where, field, "0 everywhere: no pixel has any depth weight")
    return np.ascontiguousarray(raw)


def _first(mask: npt.NDArray[np.bool_]) -> tuple[int, ...] | int:
    index = tuple(int(i) for i in np.unravel_index(int(np.flatnonzero(mask.ravel())[0]), mask.shape))
    return index[0] if len(index) == 1 else index


MAX_PRIOR_FILE_BYTES = 4 << 30
"""A ``--depth-prior`` file read without a rig (a fleet manifest's, checked against each vehicle
later) is at most 4 GiB; with the rig, at most what its largest allowed shape takes (below)."""
NPY_HEADER_SLACK = 1 << 20
"""Room for a ``.npy`` header (at most 4 GiB in format 3.0; numpy writes well under 1 MiB)."""


def prior_file_limit(rig: RigConfig) -> int:
    """The largest ``.npy`` a prior of ``rig`` can be: its per-pixel shape ``(n_cam, D, H_f,
    W_f)`` in the widest real dtype (16 bytes), plus a header: anything larger is refused unread."""
    w_f, h_f = rig.feature_size
    return rig.n_cam * rig.depth.n_bins * h_f * w_f * 16 + NPY_HEADER_SLACK


def read_depth_prior(path: str | Path, rig: RigConfig) -> DepthPrior:
    """``--depth-prior FILE.npy``: the checked prior and the file's sha256 (one-line
    :class:`DepthPriorError` for a missing, unreadable, pickled or ill-shaped file; a FIFO, a
    device or a file larger than any prior of ``rig`` is refused before it is read)."""
    values, sha = load_prior_file(path, prior_file_limit(rig))
    return DepthPrior(check_prior(values, rig, str(path)), str(path), sha)


def load_prior_file(path: str | Path, limit: int = MAX_PRIOR_FILE_BYTES) -> tuple[np.ndarray, str]:
    """The array of a ``.npy`` prior file (loaded without pickle) and the file's sha256, unchecked
    (one-line :class:`DepthPriorError` for a missing, unreadable, pickled or damaged file, and for
    a FIFO, a device or a file of more than ``limit`` bytes, refused before it is read)."""
    path = Path(path)
    where = str(path)
    try:
        data = read_regular(path, limit, "a .npy depth prior")
    except FileRefused as exc:
        raise DepthPriorError(where, "", "no such file" if exc.code == MISSING else exc.reason) from None
    if not data.startswith(b"\x93NUMPY"):
        raise DepthPriorError(where, "", "not a .npy file (save the prior with numpy.save)")
    import io

    try:
        values = np.load(io.BytesIO(data), allow_pickle=False)
    except ValueError as exc:
        raise DepthPriorError(where, "", f"a .npy that needs pickle to load or is damaged ({str(exc).splitlines()[0]})") from None
    except Exception as exc:
        raise DepthPriorError(where, "", f"a damaged .npy file ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from None
    return np.asarray(values), hashlib.sha256(data).hexdigest()


def prior_of_store(token: str, stored: np.ndarray | None, rig: RigConfig, where: str, record: object = None) -> DepthPrior:
    """The prior a ray store was built with: uniform, or its ``matrix/depth_prior`` array checked
    against the ``build_options`` token (ValueError naming what is wrong). ``record`` (the stored
    ``attrs["depth_prior"]``) gives the provenance no rebuild can recompute: the file's name and sha256."""
    token = check_token(token)
    if token == UNIFORM:
        return DepthPrior()
    if stored is None:
        raise ValueError(f"{where}: build_options.depth_prior is {token[:19]}… but matrix/{ARRAY} is missing or unreadable")
    raw = check_prior(np.asarray(stored), rig, where, f"matrix/{ARRAY}")
    if f"sha256:{array_sha256(raw)}" != token:
        raise ValueError(f"{where}: matrix/{ARRAY} does not hash to build_options.depth_prior ({token[:19]}…)")
    source, file_sha = where, None
    if isinstance(record, dict):
        source = str(record.get("source", where))
        file_sha = record.get("file_sha256") if isinstance(record.get("file_sha256"), str) else None
    return DepthPrior(raw, source, file_sha)


PRIOR_DIMS: dict[int, tuple[str, ...]] = {1: ("depth_bin",), 2: ("camera", "depth_bin"), 4: ("camera", "depth_bin", "v", "u")}
"""Zarr dimension names of a stored raw prior, by its rank."""


def prior_dims(raw: F64) -> tuple[str, ...]:
    """Zarr dimension names of a stored raw prior."""
    return PRIOR_DIMS[raw.ndim]
