"""The importers' fuzzer, part of the suite (issue 31), in the style of the config fuzz: seeded
mutations of a Kalibr camchain (as data), an OpenCV FileStorage file (as text and as values) and
the nuScenes tables (as JSON text) keep the promise "bad input never gets a traceback": every
import either yields rig data that ``parse_config`` accepts or refuses in one bounded,
control-character-free ``ConfigError`` line (~5 s)."""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path
from typing import Any

import pytest

from bevcompile.errors import ConfigError
from bevcompile.rig.config import parse_config
from bevcompile.rig.importers._common import template_data
from bevcompile.rig.importers.kalibr import KalibrOptions, kalibr_rig
from bevcompile.rig.importers.nuscenes import nuscenes_rig
from bevcompile.rig.importers.opencv import import_opencv

from ..test_config_fuzz import VALUES, _assert_clean, _mutate
from .test_kalibr import camchain
from .test_nuscenes import SCENE, write_tables

OPENCV_TEXT = """%YAML:1.0
---
camera_matrix: !!opencv-matrix
   rows: 3
   cols: 3
   dt: d
   data: [ 1260.0, 0., 800.0, 0., 1260.0, 450.0, 0., 0., 1. ]
distortion_coefficients: !!opencv-matrix
   rows: 1
   cols: 5
   dt: d
   data: [ -0.1, 0.02, 0.001, 0.0005, 0. ]
image_width: 1600
image_height: 900
rvec: [ 1.2, -1.2, 1.2 ]
tvec: [ 0.1, 1.4, -1.6 ]
"""
TEXT_PIECES = [
    "1e308", "-1e308", "1e-320", "nan", ".inf", "0x10", "'x'", "[]", "{}", "!!opencv-matrix", "\x1b[2J", "9" * 5000, "[[[[[[[[",
    "rows: 99", "dt: u", "null", "~", "-", ":", "&a [*a]", "\t", "\ufeff", "ö" * 200,
]


def _parsed_or_clean(build: Any) -> bool:
    """Run an import; what it returns must parse (or be refused cleanly by parse_config)."""
    try:
        data = build()
        parse_config(data, source="<imported>")
    except Exception as exc:
        _assert_clean(exc)
        return False
    return True


def test_mutated_kalibr_camchains_import_or_are_one_clean_line() -> None:
    rng = random.Random(31)
    template = template_data(None)
    template["image_aug"] = {"resize": 1.0, "crop": [0, 0], "input_size": [752, 480]}
    base = camchain(3)
    accepted = 0
    for case in range(200):
        mutant = _mutate(base, rng)
        body = rng.choice(["auto", "imu", "cam0", "cam1"])
        accepted += _parsed_or_clean(
            lambda m=mutant, b=body, c=case: kalibr_rig(m, source=f"<camchain {c}>", template=template, name="k", options=KalibrOptions(body=b))
        )
    assert 0 < accepted < 200  # both sides of the promise are exercised


def test_mutated_opencv_files_import_or_are_one_clean_line(tmp_path: Path) -> None:
    rng = random.Random(31)
    lines = OPENCV_TEXT.splitlines()
    accepted = 0
    for case in range(150):
        text = list(lines)
        for _ in range(rng.randint(1, 3)):
            i = rng.randrange(2, len(text))
            action = rng.random()
            if action < 0.5:  # replace a value after the colon, or a whole line
                head = text[i].split(":")[0]
                text[i] = f"{head}: {rng.choice(TEXT_PIECES)}" if ":" in text[i] else rng.choice(TEXT_PIECES)
            elif action < 0.75:
                del text[i]
            else:
                text.insert(i, f"{rng.choice(['rvec', 'R', 'T', 'ego_from_cam', 'distortion_model', 'extra'])}: {rng.choice(TEXT_PIECES)}")
        path = tmp_path / f"cam{case}.yaml"
        path.write_text("\n".join(text) + "\n", encoding="utf-8", errors="surrogatepass")
        accepted += _parsed_or_clean(lambda p=path: import_opencv(p, rig=None, camera=rng.choice(["CAM_FRONT", "NEW"])))
    assert 0 < accepted < 150


def test_opencv_values_mutated_as_data_import_or_are_one_clean_line(tmp_path: Path) -> None:
    from bevcompile.rig.importers.opencv import merge_camera, opencv_camera

    rng = random.Random(131)
    base = {
        "camera_matrix": {"rows": 3, "cols": 3, "dt": "d", "data": [1260.0, 0.0, 800.0, 0.0, 1260.0, 450.0, 0.0, 0.0, 1.0]},
        "distortion_coefficients": [-0.1, 0.02, 0.001, 0.0005, 0.0],
        "image_width": 1600,
        "image_height": 900,
        "rvec": [1.2, -1.2, 1.2],
        "tvec": [0.1, 1.4, -1.6],
    }
    rig = template_data(None)
    rig_data = {"name": "r", "cameras": [], **rig}
    accepted = 0
    for case in range(200):
        mutant = _mutate(base, rng)
        accepted += _parsed_or_clean(
            lambda m=mutant, c=case: merge_camera(rig_data, "NEW", opencv_camera(m, source=f"<cv {c}>"), source=f"<cv {c}>", base_source="<rig>")
        )
    assert 0 < accepted < 200


def test_mutated_nuscenes_tables_import_or_are_one_clean_line(tmp_path: Path) -> None:
    rng = random.Random(31)
    write_tables(tmp_path / "pristine")
    tables = {p.stem: p.read_text() for p in (tmp_path / "pristine" / "v1.0-mini").glob("*.json")}
    accepted = 0
    for case in range(80):
        root = tmp_path / f"d{case}"
        folder = root / "v1.0-mini"
        folder.mkdir(parents=True)
        for name, text in tables.items():
            (folder / f"{name}.json").write_text(text)
        victim = rng.choice(sorted(tables))
        if rng.random() < 0.5:  # structural: a record's value replaced
            records = json.loads(tables[victim])
            record = rng.choice(records)
            key = rng.choice(sorted(record))
            record[key] = copy.deepcopy(rng.choice(VALUES[:-2]))  # json.dumps writes NaN/Infinity: strict readers refuse it
            text = json.dumps(records)
        else:  # textual: a slice replaced by a hostile piece
            text = tables[victim]
            at = rng.randrange(len(text))
            text = text[:at] + rng.choice(["[" * 100_000, "9" * 5001, "NaN", '"\x1b[2J"', "", "}", '{"token": 1}, ', "\ufeff"]) + text[at + rng.randint(0, 40) :]
        (folder / f"{victim}.json").write_text(text, encoding="utf-8", errors="surrogatepass")
        accepted += _parsed_or_clean(lambda r=root: nuscenes_rig(r, "v1.0-mini", SCENE))
    assert 0 < accepted < 80


@pytest.mark.parametrize("rvec", [[1e308, 1e308, 1e308], [float("nan"), 0, 0], [1e200, 0, 0]])
def test_an_absurd_rotation_vector_is_one_line(tmp_path: Path, rvec: list[float]) -> None:
    """issue 31: rvec [1e308, 1e308, 1e308] raised ValueError: math domain error."""
    path = tmp_path / "cam.yaml"
    path.write_text(OPENCV_TEXT.replace("rvec: [ 1.2, -1.2, 1.2 ]", f"rvec: [{', '.join(map(repr, rvec))}]").replace("nan", ".nan"))
    with pytest.raises(ConfigError, match=r"rvec(\[0\])?: "):
        import_opencv(path, rig=None, camera="CAM_FRONT")
