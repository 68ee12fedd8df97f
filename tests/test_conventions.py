"""Each convention is stated once, verbatim, in docs/conventions.md and in every store's attributes."""

from __future__ import annotations

from pathlib import Path

from bevcompile.conventions import CONVENTIONS
from bevcompile.grid.build import run_grid
from bevcompile.store.zarr_io import open_store

from .rigs import ROOT, small_rig


def test_convention_sentences_are_in_the_conventions_page() -> None:
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
