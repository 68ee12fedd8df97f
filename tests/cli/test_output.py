"""Helpers of ``bevcompile.cli._output`` (tables, sizes)."""

from __future__ import annotations

import pytest

from bevcompile.cli._output import human_bytes


@pytest.mark.parametrize(
    ("nbytes", "text"),
    [(0, "0 B"), (1023, "1023 B"), (1024, "1.0 KiB"), (3 * 2**20, "3.0 MiB"), (1.5 * 2**30, "1.5 GiB"), (13183.6 * 2**30, "12.9 TiB"), (2**50, "1024.0 TiB")],
)
def test_human_bytes_units(nbytes: float, text: str) -> None:
    """A dense 40,000 x 88M matrix is reported in TiB, not as 13183.6 GiB."""
    assert human_bytes(nbytes) == text
