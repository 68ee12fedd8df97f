"""The ``interop/`` group: build the requested targets, keep the others, write atomically.

:func:`run_export_interop` is the only I/O of the interop package: the ``interop/`` group through
:func:`bevcompile.store.zarr_io.write_groups`, and ``.npy`` files (BEVDet's array names) on request.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..choices import canonical_choice
from ..conventions import REGION_CONVENTIONS
from ..errors import StoreError, UsageError
from ..files import FileRefused, check_output_path, replace_file
from ..parallel import resolve_jobs
from ..rig.config import RigConfig
from ..rig.region import region_table
from ..store.coords import level_axis_names
from .bevpoolv2 import (
    BEVPOOL_ARRAYS,
    BEVPOOL_PREFIX,
    FRUSTUM_MAPPINGS,
    PRECISIONS,
    ROUNDINGS,
    BevPoolOptions,
    ProgressFn,
    bevpoolv2_attrs,
    build_bevpoolv2,
)
from .fastbev import (
    FASTBEV_LUT_ARRAY,
    FASTBEV_LUT_XYZ_ARRAY,
    FASTBEV_N_VIEWS_ARRAY,
    OVERLAP_POLICIES,
    FastBevOptions,
    fastbev_attrs,
    fastbev_level_arrays,
    level_of_array,
)
from .petr import PETR_ARRAYS, PETR_COORDS_ARRAY, PETR_MASK_ARRAY, PetrOptions, build_petr_coords, petr_attrs

INTEROP_TARGETS = ("bevpoolv2", "fastbev-lut", "petr-coords3d")


# --------------------------------------------------------------------------------------
# the interop/ group
# --------------------------------------------------------------------------------------


def own_grid_levels(rig: RigConfig) -> frozenset[int]:
    """The feature levels with their own BEV grid (``feature.levels[l].bev``; never level 0)."""
    return frozenset(level for level in range(1, rig.n_levels) if rig.feature.levels[level].bev is not None)


def interop_dimension_names(name: str, own_levels: Collection[int] = ()) -> tuple[str, ...]:
    """``interop/`` axes of the array ``name``: BEVPoolv2's kept ``point`` s and ``interval`` s,
    Fast-BEV's ``(height, y, x)`` voxels (``(x, y, height)`` in its own voxel order, ``_xyz``; the
    same for every feature level ``_l<l>``, except a level in ``own_levels`` (its own BEV grid,
    ``feature.levels[l].bev``), whose axes are ``height_l<l>``, ``y_l<l>``, ``x_l<l>``), PETR's
    ``(camera, coord, feature_y, feature_x)``."""
    if name.startswith(BEVPOOL_PREFIX):
        return ("interval",) if name.startswith(BEVPOOL_PREFIX + "interval_") else ("point",)
    if name.startswith((FASTBEV_LUT_ARRAY, FASTBEV_N_VIEWS_ARRAY)):
        level = level_of_array(name)
        height, y, x = level_axis_names(level) if level in own_levels else ("height", "y", "x")
        return (x, y, height) if name.startswith(FASTBEV_LUT_XYZ_ARRAY) else (height, y, x)
    if name == PETR_COORDS_ARRAY:
        return ("camera", "petr_coord", "feature_y", "feature_x")
    if name == PETR_MASK_ARRAY:
        return ("camera", "feature_y", "feature_x")
    raise StoreError(f"interop/{name}: no dimension names defined for this array")


def build_target(
    rig: RigConfig, target: str, build_options: Any, progress: ProgressFn | None = None, *, jobs: int | None = None
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Arrays (named as in ``interop/``) and attributes of one target from its build options
    (``jobs`` threads where the target streams; the arrays do not depend on it)."""
    if target == "bevpoolv2":
        bev = build_bevpoolv2(rig, BevPoolOptions.from_dict(build_options), progress=progress, jobs=jobs)
        return {BEVPOOL_PREFIX + k: v for k, v in bev.arrays().items()}, bevpoolv2_attrs(bev)
    if target == "fastbev-lut":
        arrays, luts = fastbev_level_arrays(rig, FastBevOptions.from_dict(build_options))
        if progress is not None:
            progress(sum(int(lut.lut.size) for lut in luts))
        return arrays, fastbev_attrs(luts, rig)
    if target == "petr-coords3d":
        petr = build_petr_coords(rig, PetrOptions.from_dict(build_options))
        if progress is not None:
            progress(int(petr.coords3d.size // 3))
        return petr.arrays(), petr_attrs(petr, rig)
    raise UsageError(f"--to must be one of {', '.join(INTEROP_TARGETS)}, got {target!r}")


def interop_command_targets(
    to: Sequence[str] | None,
    *,
    rig: RigConfig | None = None,
    frustum_mapping: str | None = None,
    rounding: str | None = None,
    z_bins: int | None = None,
    batch: int | None = None,
    overlap: str | None = None,
    precision: str | None = None,
    xyz_layout: bool | None = None,
) -> dict[str, dict[str, Any]]:
    """Validated ``targets`` of :func:`run_export_interop` from the values of ``bevcompile
    export-interop`` as a user gives them (``--to`` repeatable, enumerated values in any case; an
    option of a target that is not requested is refused): what the CLI and a fleet manifest's
    ``export-interop:`` product both build with. With ``rig``, its config's (or preset's)
    ``interop:`` section gives the default targets and options; explicit values override them.
    :class:`UsageError` for a bad value."""
    configured = rig.interop_targets if rig is not None else ()
    if not to and not configured:
        if rig is None:
            raise UsageError(f"--to is required: one or more of {', '.join(INTEROP_TARGETS)}")
        raise UsageError("give --to bevpoolv2, --to fastbev-lut and/or --to petr-coords3d (the store's config names no interop targets)")
    requested = [canonical_choice(target, INTEROP_TARGETS) for target in to] if to else list(configured)
    for name in requested:
        if name not in INTEROP_TARGETS:
            raise UsageError(f"--to must be one of {', '.join(INTEROP_TARGETS)}, got {name!r}")
    names = set(requested)
    given = {"--frustum-mapping": frustum_mapping, "--rounding": rounding, "--z-bins": z_bins, "--batch": batch, "--overlap": overlap, "--xyz-layout": xyz_layout}
    for flag, value in given.items():
        applies = "fastbev-lut" if flag in ("--overlap", "--xyz-layout") else "bevpoolv2"
        if value is not None and applies not in names:
            raise UsageError(f"{flag} applies to --to {applies} only, which is not requested (--to {', '.join(sorted(names))})")
    targets: dict[str, dict[str, Any]] = {}
    for name in requested:
        fixed = rig.interop_options(name) if rig is not None else {}  # explicit options override the config's
        chosen_precision = canonical_choice(precision or fixed.get("precision", "float64"), PRECISIONS)
        if name == "bevpoolv2":
            bev_options = BevPoolOptions(
                canonical_choice(frustum_mapping or fixed.get("frustum_mapping", "linspace"), FRUSTUM_MAPPINGS),
                canonical_choice(rounding or fixed.get("rounding", "trunc"), ROUNDINGS),
                z_bins if z_bins is not None else fixed.get("z_bins"),
                batch if batch is not None else fixed.get("batch", 1),
                chosen_precision,
                str(fixed.get("order", "stable")),
            )
            bev_options.validate()
            targets[name] = bev_options.to_dict()
        elif name == "petr-coords3d":
            targets[name] = PetrOptions.from_dict(dict(fixed) | {"precision": chosen_precision}).to_dict()
        else:
            lut_options = FastBevOptions(
                canonical_choice(overlap or fixed.get("overlap", "first"), OVERLAP_POLICIES),
                chosen_precision,
                bool(xyz_layout) if xyz_layout is not None else bool(fixed.get("xyz_layout", False)),
            )
            lut_options.validate()
            targets[name] = lut_options.to_dict()
    return targets


def target_arrays(target: str, rig: RigConfig | None = None, build_options: Any = None) -> tuple[str, ...]:
    """Names of the ``interop/`` arrays a target owns (the Fast-BEV LUT: per feature level of
    ``rig``, and in Fast-BEV's voxel order too when its ``build_options`` ask for it)."""
    if target == "bevpoolv2":
        return tuple(BEVPOOL_PREFIX + name for name in BEVPOOL_ARRAYS)
    if target == "petr-coords3d":
        return PETR_ARRAYS
    n_levels = rig.n_levels if rig is not None else 1
    xyz = isinstance(build_options, Mapping) and build_options.get("xyz_layout") is True
    names: list[str] = []
    for level in range(n_levels):
        suffix = "" if level == 0 else f"_l{level}"
        names += [FASTBEV_LUT_ARRAY + suffix, FASTBEV_N_VIEWS_ARRAY + suffix] + ([FASTBEV_LUT_XYZ_ARRAY + suffix] if xyz else [])
    return tuple(names)


def interop_group_attrs(rig: RigConfig, build_options: dict[str, Any], target_attrs: dict[str, Any]) -> dict[str, Any]:
    """Group attributes: ``build_options`` per target (rebuilds the arrays bit-exactly) plus,
    per target, the formulas and measured figures; with a ``bev.region``, ``region`` (what each
    target does with it, and its fine-cell counts; absent without a region, so those stores keep
    their bytes)."""
    w_f, h_f = rig.feature_size
    attrs: dict[str, Any] = {
        "build_options": {t: build_options[t] for t in INTEROP_TARGETS if t in build_options},
        "targets": [t for t in INTEROP_TARGETS if t in build_options],
        "cameras": list(rig.camera_names),
        "feature_size": [w_f, h_f],
        "feature_size_order": "[W_f, H_f]",
    }
    if rig.bev.region is not None:
        table = region_table(rig.bev)
        attrs["region"] = {
            "rule": REGION_CONVENTIONS["region_interop"],
            "bev_shape": [rig.bev.ny, rig.bev.nx],
            "n_fine_cells_inside": table.n_fine_kept,
            "n_fine_cells_outside": rig.bev.ny * rig.bev.nx - table.n_fine_kept,
        }
    for target in attrs["targets"]:
        attrs[target] = target_attrs[target]
    return attrs


@dataclass
class InteropRunResult:
    """What :func:`run_export_interop` wrote."""

    store: Any  # pathlib.Path
    targets: tuple[str, ...]  # targets built by this run
    kept_targets: tuple[str, ...]  # other targets of the group, rebuilt from their recorded options
    arrays: dict[str, np.ndarray]
    attrs: dict[str, Any]
    bytes_written: dict[str, int]
    npy_files: list[Any]  # pathlib.Path
    notes: list[str]

    def to_json(self) -> dict[str, Any]:
        return {
            "store": str(self.store),
            "targets": list(self.targets),
            "kept_targets": list(self.kept_targets),
            "build_options": self.attrs["build_options"],
            **{t: self.attrs[t] for t in self.attrs["targets"]},
            "arrays": {k: {"shape": list(v.shape), "dtype": str(v.dtype)} for k, v in self.arrays.items()},
            "bytes_written": self.bytes_written,
            "npy_files": [str(p) for p in self.npy_files],
            "notes": self.notes,
        }


def npy_names(target: str, rig: RigConfig | None = None, build_options: Any = None) -> dict[str, str]:
    """``interop/`` array name -> ``.npy`` file name (BEVDet's own names for BEVPoolv2; the
    Fast-BEV LUT and PETR arrays under their own names)."""
    if target == "bevpoolv2":
        return {BEVPOOL_PREFIX + name: f"{name}.npy" for name in BEVPOOL_ARRAYS}
    return {name: f"{name}.npy" for name in target_arrays(target, rig, build_options)}


def run_export_interop(
    store_path: Any,
    targets: dict[str, dict[str, Any]],
    *,
    npy_dir: Any = None,
    progress: ProgressFn | None = None,
    jobs: int | None = None,
) -> InteropRunResult:
    """Build the requested interop targets for the store at ``store_path`` and write them into
    its ``interop/`` group (atomically, see :func:`bevcompile.store.zarr_io.write_groups`); targets
    already in the group and not requested are rebuilt from their recorded build options and
    kept. With ``npy_dir``, the requested targets are also written as ``.npy`` files (BEVDet's
    array names) plus ``interop.json`` (the group attributes).

    ``targets`` maps target name -> build options (``BevPoolOptions.to_dict()`` /
    ``FastBevOptions.to_dict()`` / ``PetrOptions.to_dict()``). ``jobs``: threads of the BEVPoolv2
    build (default: the cores this process may use; the bytes do not depend on it).
    """
    import json
    import os
    from pathlib import Path

    from ..store.loader import load
    from ..store.root import root_attributes
    from ..store.zarr_io import GroupData, write_groups

    for target in targets:
        if target not in INTEROP_TARGETS:
            raise UsageError(f"--to must be one of {', '.join(INTEROP_TARGETS)}, got {target!r}")
    jobs = resolve_jobs(jobs)
    if npy_dir is not None and Path(npy_dir).exists() and not Path(npy_dir).is_dir():
        raise UsageError(f"--npy {npy_dir}: is a file; give a folder for the .npy files")
    store = load(store_path, verify=False)
    rig = store.rig
    notes: list[str] = []
    build_options: dict[str, Any] = {}
    kept: list[str] = []
    if store.has_group("interop"):
        recorded = store["interop"].attrs.get("build_options")
        if isinstance(recorded, Mapping):
            for target, options in recorded.items():
                if target in INTEROP_TARGETS and target not in targets:
                    build_options[target] = _thaw(options)
                    kept.append(target)
    for target, options in targets.items():
        build_options[target] = dict(options)
    arrays: dict[str, np.ndarray] = {}
    target_attrs: dict[str, Any] = {}
    for target in [t for t in INTEROP_TARGETS if t in build_options]:
        try:
            target_arrays_, attrs_ = build_target(rig, target, build_options[target], progress if target in targets else None, jobs=jobs)
        except UsageError as exc:
            if target in targets:
                raise
            notes.append(f"dropped {target}: its recorded build_options do not rebuild ({exc})")
            kept.remove(target)
            del build_options[target]
            continue
        arrays.update(target_arrays_)
        target_attrs[target] = attrs_
    attrs = interop_group_attrs(rig, build_options, target_attrs)
    folder = Path(npy_dir) if npy_dir is not None else None
    if folder is not None:  # before the store is touched: a bad --npy changes nothing
        if str(folder) == "-":
            raise UsageError("--npy -: the .npy files are several files and cannot be written to standard output; give a folder")
        if not os.path.lexists(folder.parent):
            raise StoreError(f"{folder}: cannot create the .npy folder: its parent {folder.parent} does not exist")
        try:
            folder.mkdir(exist_ok=True)
            probe = folder / f".bevcompile-write-probe-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            raise StoreError(f"{folder}: cannot write .npy files ({exc.strerror or exc})") from None
        for target in [t for t in INTEROP_TARGETS if t in targets]:
            for file_name in npy_names(target, rig, build_options[target]).values():
                if (folder / file_name).is_dir():
                    raise StoreError(f"{folder / file_name}: is a directory, cannot write the .npy file there")
                special = check_output_path(folder / file_name)
                if special is not None:
                    raise StoreError(f"{folder / file_name}: {special}")
    report = write_groups(
        store.path,
        root_attrs=root_attributes(rig),
        groups={"interop": GroupData(arrays=arrays, attrs=attrs, dims={name: interop_dimension_names(name, own_grid_levels(rig)) for name in arrays})},
        replace_groups=("interop",),
    )
    npy_files: list[Path] = []
    if folder is not None:
        try:
            for target in [t for t in INTEROP_TARGETS if t in targets]:
                for array_name, file_name in npy_names(target, rig, build_options[target]).items():
                    path = folder / file_name
                    tmp = folder / f".{file_name}.tmp-{os.getpid()}"
                    with open(tmp, "wb") as fh:
                        np.save(fh, arrays[array_name], allow_pickle=False)
                    replace_file(tmp, path)
                    npy_files.append(path)
            meta = folder / "interop.json"
            tmp = folder / f".interop.json.tmp-{os.getpid()}"
            tmp.write_text(json.dumps(attrs, indent=2, sort_keys=True, allow_nan=False) + "\n")
            replace_file(tmp, meta)
            npy_files.append(meta)
        except FileRefused as exc:
            tmp.unlink(missing_ok=True)
            raise StoreError(f"{folder}: cannot write .npy files ({exc})") from None
        except OSError as exc:
            raise StoreError(f"{folder}: cannot write .npy files ({exc.strerror or exc})") from None
    return InteropRunResult(
        store=store.path,
        targets=tuple(t for t in INTEROP_TARGETS if t in targets),
        kept_targets=tuple(kept),
        arrays=arrays,
        attrs=attrs,
        bytes_written=report.bytes_per_array,
        npy_files=npy_files,
        notes=notes,
    )


def _thaw(value: Any) -> Any:
    """Plain dict/list copy of a (possibly read-only) attribute value."""
    if hasattr(value, "items"):
        return {str(k): _thaw(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_thaw(v) for v in value]
    return value
