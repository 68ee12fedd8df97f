"""The library behind ``bevcompile grid``: the options the CLI and a fleet manifest both give
(:func:`grid_command_options`), and the ``build_options`` a build records (what ``fleet --resume``
compares), pinned against real builds."""

from __future__ import annotations

from pathlib import Path

import pytest

from bevcompile.errors import UsageError
from bevcompile.grid.build import GridBuildOptions, grid_command_options, run_grid
from bevcompile.store.zarr_io import open_store

from ..rigs import small_rig


@pytest.mark.parametrize(
    "given",
    [
        {},
        {"align_corners": True, "formats": ("UQ12", "opencv", "norm_int16"), "align": 32, "order": "Cache"},
        {"formats": ("pixel_q",), "frac_bits": 6, "block": 4, "max_error_px": 0.5},
        {"formats": ("pixel_q", "norm_q16"), "order": "feature", "block": 16, "max_error_px": 1},
    ],
)
def test_recorded_build_options_equal_what_a_build_records(tmp_path: Path, given: dict) -> None:  # type: ignore[type-arg]
    rig = small_rig()
    options = grid_command_options(**given).validated()
    run_grid(rig, tmp_path, **options.run_kwargs())
    reader = open_store(tmp_path / "small.zarr")
    recorded = {group: reader.group_attrs(group)["build_options"] for group in reader.groups()}
    assert options.recorded_build_options(rig) == recorded


def test_command_options_take_enumerated_values_in_any_case_and_the_cli_defaults() -> None:
    options = grid_command_options(formats=("OpenCV", "UQ12"), order="CACHE")
    assert options.formats == ("opencv", "uq12") and options.order == "cache" and options.npu is True
    assert options.validated().formats == ("uq12", "opencv")  # canonical order (FORMATS), as the store records it
    assert grid_command_options() == GridBuildOptions(npu=True)
    with pytest.raises(UsageError, match="unknown --format 'nope'"):
        grid_command_options(formats=("nope",)).validated()
    with pytest.raises(UsageError, match="--order must be one of row, cache, feature, got 'diagonal'"):
        grid_command_options(order="diagonal").validated()
