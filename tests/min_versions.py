"""``make test-min``: the lowest versions ``pyproject.toml`` allows, as pip constraints.

``python tests/min_versions.py pyproject.toml`` prints ``name==floor`` for every runtime
dependency and for the ``[torch]`` extra (the floors users may really get); ``--check`` then
asserts that the installed versions are exactly those floors (so the smoke run proves them).
"""

from __future__ import annotations

import re
import sys
import tomllib
from importlib import metadata
from pathlib import Path

FLOOR = re.compile(r"^([A-Za-z0-9_.-]+)\s*>=\s*([0-9][A-Za-z0-9.]*)")


def floors(pyproject: Path) -> dict[str, str]:
    project = tomllib.loads(pyproject.read_text())["project"]
    out: dict[str, str] = {}
    for requirement in [*project["dependencies"], *project["optional-dependencies"]["torch"]]:
        match = FLOOR.match(requirement)
        if match is None:
            raise SystemExit(f"error: {pyproject}: {requirement!r} declares no '>=' floor")
        out[match.group(1)] = match.group(2)
    return out


def _release(version: str) -> tuple[int, ...]:
    """``2.13.0+cpu`` -> (2, 13): the release numbers without trailing zeros or a local label."""
    parts = [int(p) for p in re.findall(r"\d+", version.split("+")[0])]
    while parts and parts[-1] == 0:
        parts.pop()
    return tuple(parts)


def main(argv: list[str]) -> int:
    wanted = floors(Path(argv[1]))
    if "--check" not in argv:
        print("\n".join(f"{name}=={version}" for name, version in wanted.items()))
        return 0
    wrong = {name: metadata.version(name) for name, version in wanted.items() if _release(metadata.version(name)) != _release(version)}
    if wrong:
        print(f"error: installed above the declared floor: {wrong}", file=sys.stderr)
        return 1
    print("installed exactly the declared floors: " + ", ".join(f"{n} {v}" for n, v in wanted.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
