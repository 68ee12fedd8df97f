"""Each convention is stated once, verbatim, in docs/conventions.md and in every store's attributes."""

from __future__ import annotations

from pathlib import Path

from bevcompile.conventions import CONVENTIONS
from bevcompile.grid.build import run_grid
from bevcompile.store.zarr_io import open_store

from .rigs import ROOT, small_rig


def test_convention_sentences_are_in_the_docs() -> None:
    page = (ROOT / "docs" / "conventions.md").read_text()
    for key, sentence in CONVENTIONS.items():
        assert f"- {sentence}\n" in page, key


def test_convention_sentences_are_in_the_store(tmp_path: Path) -> None:
    run_grid(small_rig(), tmp_path)
    reader = open_store(tmp_path / "small.zarr")
    assert reader.root_attrs["conventions"] == CONVENTIONS
    assert reader.group_attrs("grid")["valid_rule"] == CONVENTIONS["valid_rule"]


def test_readme_starts_with_the_two_setup_commands() -> None:
    readme = (ROOT / "README.md").read_text()
    block = readme.split("```sh\n", 1)[1].split("```", 1)[0]
    assert [line.split()[0:2] for line in block.strip().splitlines()] == [["make", "demo"], ["make", "test"]]


def test_conditional_convention_sentences_are_in_the_docs_and_only_in_stores_that_use_them(tmp_path: Path) -> None:
    """Per-level BEV grids and the image flip add their sentence to a store's ``conventions`` only
    when the config uses them (other stores keep their bytes); docs/conventions.md states both."""
    from bevcompile.conventions import FLIP_CONVENTIONS, LEVEL_GRID_CONVENTIONS
    from bevcompile.rig.config import parse_config
    from bevcompile.store.root import rig_conventions

    from .rigs import small_rig_data

    page = (ROOT / "docs" / "conventions.md").read_text()
    for key, sentence in (LEVEL_GRID_CONVENTIONS | FLIP_CONVENTIONS).items():
        assert f"- {sentence}\n" in page, key
        assert key not in CONVENTIONS
    data = small_rig_data()
    assert rig_conventions(parse_config(data)) == CONVENTIONS
    data["image_aug"]["flip"] = True
    data["feature"] = {"levels": [{"stride": 8}, {"stride": 16, "bev": {"x": [-12.0, 12.0, 2.0]}}]}
    rig = parse_config(data)
    run_grid(rig, tmp_path)
    recorded = open_store(tmp_path / "small.zarr").root_attrs["conventions"]
    assert recorded == CONVENTIONS | LEVEL_GRID_CONVENTIONS | FLIP_CONVENTIONS == rig_conventions(rig)
