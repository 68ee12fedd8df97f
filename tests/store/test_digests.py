"""Store bytes are pinned: the shipped configs, built with a spread of options, give exactly the
recorded files (``tests/data/store_digests.json``: relative path -> SHA-256 of every file).

A change of these bytes must be deliberate: regenerate the record with
``.venv/bin/python -m tests.store.test_digests --update`` and say why in the commit.
(Recorded with bevcompile 0.2.0 before the package moved into subpackages; the move kept every byte.)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from bevcompile.cli import app

from ..rigs import ROOT, tree_digest

RECORD = ROOT / "tests" / "data" / "store_digests.json"
CONFIGS = ROOT / "configs"

# store label -> the commands that build it (the CLI as a user types it; --out is appended)
BUILDS: dict[str, list[list[str]]] = {
    "nuscenes": [
        ["grid", "nuscenes.yaml", "--format", "opencv", "--format", "pixel_q", "--format", "norm_q16", "--format", "uq12", "--align", "32"],
        ["matrix", "nuscenes.yaml", "--topk", "24", "--align", "16", "--tile-rows", "64", "--quantize", "int8"],
        ["export-interop", "{store}", "--to", "bevpoolv2", "--to", "fastbev-lut"],
    ],
    "nuscenes_scene0061_distorted": [
        ["grid", "nuscenes_scene0061_distorted.yaml", "--order", "cache", "--align-corners"],
        ["matrix", "nuscenes_scene0061_distorted.yaml", "--mode", "grid", "--compact-rows", "--normalize", "mean"],
    ],
    "nuscenes_200x200": [
        ["grid", "nuscenes_200x200.yaml", "--order", "feature", "--format", "norm_int16"],
        ["matrix", "nuscenes_200x200.yaml", "--splat", "nearest", "--rounding", "trunc", "--topk", "0", "--align", "1"],
    ],
}


def build(label: str, out: Path) -> Path:
    store = out / f"{label}.zarr"
    for command in BUILDS[label]:
        args = [str(CONFIGS / a) if a.endswith(".yaml") else a.replace("{store}", str(store)) for a in command]
        if args[0] != "export-interop":
            args += ["--out", str(out)]
        result = CliRunner().invoke(app, [*args, "--quiet"])
        assert result.exit_code == 0, result.output
    (built,) = out.glob("*.zarr")  # the config's name (nuscenes_scene0061_distorted.yaml names nuscenes-scene0061-distorted)
    return built


@pytest.mark.parametrize("label", sorted(BUILDS))
def test_store_bytes_equal_the_record(label: str, tmp_path: Path) -> None:
    recorded = json.loads(RECORD.read_text())[label]
    digest = tree_digest(build(label, tmp_path))
    assert len(digest) > 50 and recorded, "a record must pin files"
    changed = sorted(k for k in recorded.keys() & digest.keys() if recorded[k] != digest[k])
    assert not changed, f"{len(changed)} file(s) differ from the record, e.g. {changed[:5]}"
    assert sorted(digest) == sorted(recorded), f"files added {sorted(digest.keys() - recorded.keys())[:5]}, missing {sorted(recorded.keys() - digest.keys())[:5]}"


if __name__ == "__main__" and "--update" in sys.argv:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        record = {label: tree_digest(build(label, Path(tmp) / label)) for label in sorted(BUILDS)}
    RECORD.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    print(f"wrote {RECORD}: {sum(len(v) for v in record.values())} files in {len(record)} stores")
