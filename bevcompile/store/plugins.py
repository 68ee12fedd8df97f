"""The plug-in contract between product groups and ``inspect`` / ``verify`` / ``--strict``.

Each store group (``grid``, ``gather``, ``delta``, ``matrix``, ``interop``) is served by one or
more plug-in modules listed in :data:`GROUP_PLUGINS`; each contributes up to three pure
functions (no zarr, no printing), looked up by name. The per-level groups of a multi-level rig
(``grid_l1``, ``gather_l2``, ... :data:`LEVEL_GROUPS`) are served by the plug-ins of their base
group with a context of that level (``ctx.rig`` = :meth:`RigConfig.level`, ``ctx.grid_arrays``
from that level's ``grid`` group); the runner renames the array paths of their results.

* ``check(ctx, arrays, attrs) -> list[Check]`` — invariant checks of the group's arrays.
  ``arrays`` holds only the arrays that could be read; a contract array absent from
  ``arrays`` must yield a failed :class:`Check` (the runner has already reported *why* it
  could not be read). Recompute, do not trust attributes.
* ``verify(ctx, arrays, attrs) -> list[VerifyRow]`` — equivalence of the group's NPU forms
  with the float reference on ``ctx.features`` (seeded random features).
* ``rebuild(rig, attrs) -> dict[str, np.ndarray]`` — recompute the group's arrays from the
  stored config and the group's ``attrs["build_options"]``, for ``inspect --strict`` (bit
  equality). Optionally the dict also holds, under the reserved key :data:`REBUILT_ATTRS`
  (``"__attrs__"``, never an array name), the group attributes the build writes (a mapping; a
  module may return only the keys it owns: the runner merges the mappings of every module of
  the group key by key). ``--strict`` then compares the stored group attributes with them key
  by key; a plug-in that returns no ``"__attrs__"`` keeps working (its attributes are not
  compared, with a note).
  A ``rebuild`` with a third parameter ``rebuild(rig, attrs, arrays)`` also gets the group's
  readable stored arrays: for products derived from values that no config rebuilds (the learned
  values ``bevcompile absorb`` wrote into ``matrix/``), which it re-derives from them.
* ``dimension_names(name, ndim, attrs) -> tuple[str, ...] | None`` — the zarr ``dimension_names``
  the build gives the group's array ``name`` of rank ``ndim`` (``attrs``: the group's attributes;
  None: no array of this group). Plain ``inspect`` compares each stored array's with the first
  module's answer (``array_metadata``).

The runners (``bevcompile.store.inspection``, ``bevcompile.store.verify``) catch every exception a plug-in
raises and turn it into a failed check, so a damaged store never produces a traceback.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ..rig.config import RigConfig

if TYPE_CHECKING:
    from ..grid.ipm import SamplingGrid


@dataclass(frozen=True)
class Check:
    """One invariant check. ``array`` is ``"group/name"`` (or ``"group/"``/``"/"`` for
    attribute-level checks); ``reason`` is one line, stating the measured figure."""

    name: str
    array: str
    passed: bool
    reason: str


@dataclass(frozen=True)
class VerifyRow:
    """One line of the ``verify`` table: an NPU product against the float reference."""

    product: str
    camera: str  # camera name, or "all"
    max_abs: float
    mean_abs: float
    psnr_db: float  # peak = feature value range; inf when identical
    threshold: str  # human-readable criterion, e.g. "max_abs <= 1e-05"
    passed: bool
    note: str = ""
    informational: bool = False  # measured and reported, never judged (``passed`` is True)


@dataclass
class CheckContext:
    """What a plug-in may use besides its own group."""

    rig: RigConfig
    store_path: str
    root_attrs: Mapping[str, Any]
    grid_arrays: Mapping[str, np.ndarray] = field(default_factory=dict)  # readable grid/ arrays
    grid_attrs: Mapping[str, Any] = field(default_factory=dict)
    # verify only: seeded random features and (frustum mode) depth probabilities
    features: np.ndarray | None = None  # (n_cam, C, H_f, W_f) float32, values in [0, 1)
    depth_probs: np.ndarray | None = None  # (n_cam, D, H_f, W_f) float32, softmax over D
    seed: int = 0
    level: int = 0  # the feature level of the group being checked (rig is that level's view)
    _sampling_grid: SamplingGrid | None = field(default=None, repr=False)

    def sampling_grid(self) -> SamplingGrid:
        """The float64 IPM grid of ``rig`` (the reference every grid product is measured
        against), computed once per context and shared by every plug-in; its arrays are
        read-only."""
        if self._sampling_grid is None:
            from ..grid.ipm import (
                compute_sampling_grid,  # the one product the contract serves (store/ sits below grid/)
            )

            grid = compute_sampling_grid(self.rig)
            grid.coords_feature_px.setflags(write=False)
            grid.valid.setflags(write=False)
            self._sampling_grid = grid
        return self._sampling_grid


CheckFn = Callable[[CheckContext, Mapping[str, np.ndarray], Mapping[str, Any]], list[Check]]
VerifyFn = Callable[[CheckContext, Mapping[str, np.ndarray], Mapping[str, Any]], list[VerifyRow]]
RebuildFn = Callable[..., dict[str, Any]]
"""``(rig, attrs) -> arrays`` or ``(rig, attrs, stored arrays) -> arrays`` (see the module docstring)."""

REBUILT_ATTRS = "__attrs__"
"""Reserved key of a ``rebuild_<group>`` result: the rebuilt group attributes (optional)."""

LEVEL_GROUPS = ("grid", "gather", "delta")
"""The groups ``bevcompile grid`` writes once per feature level (``feature.levels``): level 0 as
``grid``/``gather``/``delta``, level ``l >= 1`` as ``grid_l<l>``/``gather_l<l>``/``delta_l<l>``; each
is the single-level product of :meth:`RigConfig.level` and addresses that level's own features
``(n_cam, H_l, W_l)``."""
_LEVEL_GROUP_RE = re.compile(r"^(grid|gather|delta)_l([1-9][0-9]?)$")


def level_group(base: str, level: int) -> str:
    """Group name of ``base`` (``grid``, ``gather``, ``delta``) at feature level ``level``."""
    return base if level == 0 else f"{base}_l{level}"


def split_level_group(group: str) -> tuple[str, int]:
    """``("gather", 2)`` for ``gather_l2``; ``(group, 0)`` for every other name."""
    match = _LEVEL_GROUP_RE.match(group)
    return (match.group(1), int(match.group(2))) if match else (group, 0)


def relabel_level(text: str, level: int) -> str:
    """Array paths of a level-0 plug-in result (``grid/valid``, ``gather/``) renamed to level
    ``level``'s groups (``grid_l1/valid``, ``gather_l1/``)."""
    if level == 0:
        return text
    return re.sub(r"\b(grid|gather|delta)/", lambda m: f"{m.group(1)}_l{level}/", text)


GROUP_PLUGINS: dict[str, tuple[str, ...]] = {
    # group -> modules exposing check_<group> / verify_<group> / rebuild_<group>.
    # Every listed module that defines the function is called and the results merged
    # (rebuild dicts are merged; each module handles the arrays it owns).
    "grid": ("bevcompile.grid.checks.base", "bevcompile.grid.checks.formats"),
    "gather": ("bevcompile.grid.checks.gather",),
    "delta": ("bevcompile.grid.checks.delta",),
    "matrix": ("bevcompile.matrix.checks",),
    "interop": ("bevcompile.interop.checks",),
}


def psnr_db(max_abs_or_mse: float, peak: float, *, is_mse: bool = True) -> float:
    """PSNR in dB for a mean squared error (or, with ``is_mse=False``, a max abs error)."""
    mse = max_abs_or_mse if is_mse else max_abs_or_mse**2
    if mse <= 0:
        return float("inf")
    return float(10.0 * np.log10(peak * peak / mse))


def compare(product: str, camera: str, got: np.ndarray, ref: np.ndarray, peak: float) -> tuple[float, float, float]:
    """(max abs, mean abs, PSNR dB) of ``got`` against ``ref``."""
    diff = np.abs(np.asarray(got, dtype=np.float64) - np.asarray(ref, dtype=np.float64))
    if diff.size == 0:
        return 0.0, 0.0, float("inf")
    return float(diff.max()), float(diff.mean()), psnr_db(float(np.mean(diff * diff)), peak)


def same_recorded(got: Any, want: Any) -> bool:
    """Whether a recorded attribute ``got`` equals its recomputation ``want``: numbers to 1e-12
    relative (a float recomputed in another order), lists element by element, anything else
    exactly and of the same type (so ``True`` is not ``1``)."""
    if isinstance(want, float):
        return isinstance(got, int | float) and not isinstance(got, bool) and math.isclose(float(got), want, rel_tol=1e-12, abs_tol=0.0)
    if isinstance(want, list):
        return isinstance(got, list | tuple) and len(got) == len(want) and all(same_recorded(g, w) for g, w in zip(got, want, strict=True))
    return type(got) is type(want) and bool(got == want)


def clamped_format_rows(
    product: str,
    camera: str,
    got: np.ndarray,
    ref: np.ndarray,
    truth_px: np.ndarray,
    valid: np.ndarray,
    feature_size: tuple[int, int],
    half_step_px: np.ndarray,
    slack: float,
    peak: float,
    note: str,
) -> list[VerifyRow]:
    """verify rows of a normalised format whose valid cells may saturate (uq12 and norm_int16
    under ``align_corners=True``: norm is limited to ``[-1, 1]``, i.e. ``u`` to ``[0, W_f - 1]``,
    while the VALID RULE admits ``[-0.5, W_f - 0.5)``).

    ``got``/``ref`` are ``(C, *cells)`` samples, ``truth_px`` the float64 projection ``(*cells, 2)``,
    ``valid`` ``(*cells)``. A bilinear sample moves by at most ``peak`` per pixel per axis, so

    * unsaturated cells (and invalid ones): ``|got - ref| <= peak (h_u + h_v) + slack`` with ``h``
      half a quantisation step per axis (at most twice their own max coordinate error);
    * saturated cells, judged one by one against their known clamp: ``|got - ref| <= peak
      sum_a (d_a + h_a) + slack`` with ``d_a`` the distance from the true coordinate to the
      border pixel centre it clamps to.

    Each bound is fixed by the config, so damaged codes fail (the recorded max error, ~0.5 px,
    would not).
    """
    size = np.array(feature_size, dtype=np.float64)
    truth = np.asarray(truth_px, dtype=np.float64)
    clamp = np.abs(truth - np.clip(truth, 0.0, size - 1.0))
    clamp = np.where(np.asarray(valid, dtype=bool)[..., None], clamp, 0.0)
    saturated = np.any(clamp > 0.0, axis=-1)
    half = np.asarray(half_step_px, dtype=np.float64)
    diff = np.abs(np.asarray(got, dtype=np.float64) - np.asarray(ref, dtype=np.float64))
    diff = np.where(np.isnan(diff), np.inf, diff)
    plain_bound = peak * float(half.sum()) + slack
    rows = []
    keep = ~saturated
    max_abs, mean_abs, psnr = compare(product, camera, np.asarray(got)[:, keep], np.asarray(ref)[:, keep], peak)
    rows.append(
        VerifyRow(
            product, camera, max_abs, mean_abs, psnr, f"max_abs <= {plain_bound:.3g}", bool(max_abs <= plain_bound),
            f"{note}; unsaturated cells: bound half a step per axis (u {half[0]:.3g} + v {half[1]:.3g} px)",
        )
    )
    n_sat = int(np.count_nonzero(saturated))
    if n_sat:
        cell_bound = peak * (clamp[saturated] + half).sum(axis=-1) + slack  # (n_sat,)
        excess = diff[:, saturated] - cell_bound[None]
        max_abs, mean_abs, psnr = compare(product, camera, np.asarray(got)[:, saturated], np.asarray(ref)[:, saturated], peak)
        rows.append(
            VerifyRow(
                f"{product} saturated",
                camera,
                max_abs,
                mean_abs,
                psnr,
                f"per cell <= clamp distance + half step (max {float(cell_bound.max()):.3g})",
                bool(np.all(excess <= 0.0)),
                f"{n_sat} valid cell(s) outside norm [-1, 1] clamp to the border pixel centre",
            )
        )
    return rows
