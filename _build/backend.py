"""The build backend: setuptools' own, plus the long description a package index shows.

The README links to ``docs/...`` and ``configs/...`` relative to the repository, which a
package index cannot resolve. On import (so before any build hook reads pyproject.toml) this
module writes ``_build/README.pypi.md``: the README with every relative link and image made
absolute against the repository URL of ``[project.urls] Source`` (``<Source>/blob/main/<path>``).
pyproject.toml declares that file as the dynamic ``readme``; tests/test_packaging.py checks the
result in a built wheel's metadata.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F403  (every PEP 517 / 660 hook, unchanged)

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
LINK = re.compile(r"(!?\[[^\]]*\]\()([^)\s]+)(\))")


def absolute_links(text: str, base: str) -> str:
    """``[text](docs/x.md#a)`` -> ``[text](<base>/docs/x.md#a)``; absolute URLs and ``#anchors`` kept."""

    def fix(match: re.Match[str]) -> str:
        target = match.group(2)
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith(("#", "/")):
            return match.group(0)
        return f"{match.group(1)}{base}/{target.removeprefix('./')}{match.group(3)}"

    return LINK.sub(fix, text)


def write_long_description() -> Path:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base = project["urls"]["Source"].rstrip("/") + "/blob/main"
    out = HERE / "README.pypi.md"
    text = absolute_links((ROOT / "README.md").read_text(encoding="utf-8"), base)
    if not out.exists() or out.read_text(encoding="utf-8") != text:
        out.write_text(text, encoding="utf-8")
    return out


write_long_description()
__all__ = [name for name in dir(_setuptools) if not name.startswith("_")]
