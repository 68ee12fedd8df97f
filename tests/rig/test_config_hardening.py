"""Bad configs that cost or crash: pathological YAML refused before it costs memory, YAML 1.1 and
non-ASCII number spellings, names checked for characters and length up front, the pose and
resize bounds, binary files, standard input (the reproducers of issue 21)."""

from __future__ import annotations

import io
import sys
import time
from pathlib import Path

import pytest

from bevcompile.errors import ConfigError
from bevcompile.rig import config as config_module
from bevcompile.rig.config import MAX_CAMERA_DISTANCE_M, load_config, parse_config

from ..rigs import NUSCENES_YAML, nuscenes_data, write_yaml


def _error(path: Path) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert "\n" not in message and "\x1b" not in message and len(message) <= 1000
    return message


def test_nested_aliases_are_refused_before_they_expand(tmp_path: Path) -> None:
    """A 4 KB "billion laughs" (9^9 values once expanded) is refused in well under a second."""
    lines = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 9)]
    path = tmp_path / "laughs.yaml"
    path.write_text("\n".join(lines) + "\n")
    assert path.stat().st_size < 5000
    t0 = time.perf_counter()
    message = _error(path)
    assert time.perf_counter() - t0 < 2.0  # measured ~0.01 s; 13 s and 3.2 GB before the bound
    assert message.endswith("holds more than 100,000 values once its aliases are expanded")


def test_a_recursive_alias_and_deep_nesting_are_one_line(tmp_path: Path) -> None:
    (tmp_path / "rec.yaml").write_text("a: &a [1, *a]\n")
    assert "recursive alias" in _error(tmp_path / "rec.yaml")
    (tmp_path / "deep.yaml").write_text("[" * 200 + "]" * 200 + "\n")
    assert _error(tmp_path / "deep.yaml").endswith("nested more than 32 levels deep")


def test_a_config_over_one_mib_is_refused_unread(tmp_path: Path) -> None:
    path = tmp_path / "big.yaml"
    path.write_bytes(b"# " + b"x" * (config_module.MAX_CONFIG_BYTES) + b"\n")
    assert _error(path) == f"{path}: is 1,048,579 bytes, larger than 1 MiB: not a rig config"


def test_a_binary_file_is_a_plain_one_line_message(tmp_path: Path) -> None:
    path = tmp_path / "image.yaml"
    path.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00")
    assert _error(path) == f"{path}: not a UTF-8 text file (byte 0x89 at offset 0): expected a rig config"


@pytest.mark.parametrize(
    ("spelling", "reason"),
    [
        ("0x_1", "YAML 1.1-only spelling"),
        ("0x1_0", "YAML 1.1-only spelling"),
        ("1_0e3", "expected a number, got string '1_0e3'"),
        ('"1_000.5"', "expected a number, got string '1_000.5'"),
        ('"١.٧٢٢"', "expected a number, got string '١.٧٢٢'"),
        ('"１.５"', "expected a number, got string '１.５'"),
        ('" 1.5"', "expected a number, got string ' 1.5'"),
    ],
)
def test_yaml_1_1_and_non_ascii_number_spellings_are_refused(tmp_path: Path, spelling: str, reason: str) -> None:
    text = NUSCENES_YAML.read_text().replace("resize: 0.44", f"resize: {spelling}", 1)
    assert text != NUSCENES_YAML.read_text()
    path = tmp_path / "spelling.yaml"
    path.write_text(text)
    message = _error(path)
    assert reason in message, message


def test_plain_decimal_strings_still_read_as_numbers() -> None:
    data = nuscenes_data()
    data["image_aug"]["resize"] = "0.44"
    data["depth"]["bins"] = ["1.0", "60", "1e0"]
    rig = parse_config(data)
    assert rig.cameras[0].image_aug.resize == 0.44 and rig.depth.n_bins == 59


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("x\n", "must be a file-name-safe identifier"),
        ("a" * 129, "is 129 characters, more than 128"),
        ("a" * 251, "is 251 characters, more than 128"),
        ("-x", "must be a file-name-safe identifier"),
    ],
)
def test_rig_names_are_checked_for_characters_and_length_up_front(name: str, reason: str) -> None:
    data = nuscenes_data()
    data["name"] = name
    with pytest.raises(ConfigError, match=reason):
        parse_config(data)


@pytest.mark.parametrize(
    ("name", "reason"),
    [("CAM\x1b[31m", "must be printable"), (" CAM", "must be printable"), ("C" * 65, "is 65 characters, more than 64")],
)
def test_camera_names_are_printable_and_bounded(name: str, reason: str) -> None:
    data = nuscenes_data()
    data["cameras"][1]["name"] = name
    with pytest.raises(ConfigError, match=reason) as info:
        parse_config(data)
    assert "\x1b" not in str(info.value)


def test_a_camera_name_in_any_script_is_accepted() -> None:
    data = nuscenes_data()
    data["cameras"][0]["name"] = "CAM_前"
    assert parse_config(data).cameras[0].name == "CAM_前"


@pytest.mark.parametrize("distance", [1e300, 1e4, MAX_CAMERA_DISTANCE_M + 1])
def test_a_camera_far_from_the_ego_origin_is_refused(distance: float) -> None:
    """A camera 1e300 m away gave exit 0 and 100 % coverage; poses are bounded to vehicle size."""
    data = nuscenes_data()
    data["cameras"][2]["translation"] = [distance, 0.0, 1.5]
    with pytest.raises(ConfigError, match=r"cameras\[2\]\.translation: puts the camera .* m from the ego origin, more than the 100 m"):
        parse_config(data)


def test_a_huge_resize_is_refused_without_an_overflow() -> None:
    data = nuscenes_data()
    data["image_aug"]["resize"] = 1e308
    with pytest.raises(ConfigError, match=r"image_aug\.resize: must be in \(0, 16\], got 1e\+308"):
        parse_config(data)


def test_error_lines_are_bounded_and_escape_control_characters(tmp_path: Path) -> None:
    """An unknown key of a megabyte with an ESC sequence: one short line, the ESC shown escaped."""
    data = nuscenes_data()
    data["\x1b[2J" + "k" * 100_000] = 1
    path = write_yaml(tmp_path / "key.yaml", data)
    message = _error(path)
    assert "\\x1b[2J" in message and "more characters)" in message


def test_a_config_on_standard_input(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(NUSCENES_YAML.read_bytes())))
    rig = load_config("-")
    assert rig.name == "nuscenes" and rig.source == "-"


# --------------------------------------------------------------------------------------
# issue 31: degenerate geometry is refused by physical sense (docs/config.md states the bounds)
# --------------------------------------------------------------------------------------


def _camera0(data: dict, key: str, value: object) -> dict:  # type: ignore[type-arg]
    data["cameras"][0][key] = value
    return data


def _intrinsic(r: int, c: int, value: float):  # type: ignore[no-untyped-def]
    def edit(data: dict) -> dict:  # type: ignore[type-arg]
        data["cameras"][0]["intrinsic"][r][c] = value
        return data

    return edit


@pytest.mark.parametrize(
    ("edit", "field", "message"),
    [
        (_intrinsic(1, 1, 5e-324), "cameras[0].intrinsic[1][1]", "fy must be in [1, 1e+06] pixels, got 4.94066e-324"),
        (_intrinsic(0, 0, 1e300), "cameras[0].intrinsic[0][0]", "fx must be in [1, 1e+06] pixels, got 1e+300"),
        (_intrinsic(0, 2, -(2.0**63)), "cameras[0].intrinsic[0][2]", "cx must be in [-6400, 8000] pixels (within 4 image sizes of the image)"),
        (_intrinsic(1, 2, 1e6), "cameras[0].intrinsic[1][2]", "cy must be in [-3600, 4500] pixels"),
        (lambda d: _camera0(d, "distortion", {"model": "opencv", "coeffs": [1e300, 0, 0, 0, 0]}), "cameras[0].distortion.coeffs[0]",
         "|coefficient| must be at most 10000, got 1e+300"),
        (lambda d: d["bev"].update(heights=[0.0, 1e300]) or d, "bev.heights[1]", "must be within +-10000 m, got 1e+300"),
        (lambda d: d["bev"].update(x=[-1e300, 1e300, 1e298]) or d, "bev.x[0]", "must be within +-10000 m, got -1e+300"),
        (lambda d: d["depth"].update(bins=[1.0, 1e300, 1e297]) or d, "depth.bins[1]", "must be at most 10000 m, got 1e+300"),
    ],
)
def test_degenerate_geometry_is_refused_with_its_bound(edit, field: str, message: str) -> None:  # type: ignore[no-untyped-def]
    """issue 31: each was accepted silently, exit 0 (fy = 5e-324 made `matrix` print numpy's
    overflow RuntimeWarning with a source line)."""
    with pytest.raises(ConfigError) as info:
        parse_config(edit(nuscenes_data()), source="rig.yaml")
    assert str(info.value).startswith(f"rig.yaml: {field}: {message}"), str(info.value)


def test_long_quoted_values_are_cut_and_the_cut_counts_the_line() -> None:
    """issue 31: distortion.model and preset quoted 200,000 characters, then the line cap said
    "(67 more characters)" of a 200,000-character value."""
    data = nuscenes_data()
    data["cameras"][0]["distortion"] = {"model": "x" * 200_000}
    with pytest.raises(ConfigError) as info:
        parse_config(data, source="rig.yaml")
    message = str(info.value)
    assert len(message) < 300 and "(200,000 characters)" in message, message
    data = nuscenes_data()
    data["preset"] = "p" * 200_000
    with pytest.raises(ConfigError) as info:
        parse_config(data, source="rig.yaml")
    assert len(str(info.value)) < 400 and "(200,000 characters)" in str(info.value)
    error = ConfigError("rig.yaml", "name", "y" * 5000)
    assert str(error).endswith(f"({5000 + len('rig.yaml: name: ') - 970:,} more characters)") and len(str(error)) <= 1000
