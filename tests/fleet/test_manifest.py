"""The fleet manifest: every form of it parses to what it says, and every mistake is one
``<manifest>: <field path>: <problem>`` error before any vehicle is built."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from bevcompile.errors import ConfigError
from bevcompile.fleet.manifest import load_manifest, parse_manifest
from bevcompile.fleet.products import Product
from bevcompile.matrix.prior import DepthPrior

from .fleets import template

BASE: dict[str, Any] = {"products": {"grid": {}}, "template": {"image_aug": {"input_size": [96, 64]}}, "vehicles": [{"id": "a", "cameras": []}]}


def _parse(data: dict[str, Any], base: Path = Path("/fleet")) -> Any:
    return parse_manifest(data, source="/fleet/fleet.yaml", base=base)


def test_every_source_form_parses_with_paths_relative_to_the_manifest(tmp_path: Path) -> None:
    (tmp_path / "model.yaml").write_text(yaml.safe_dump(template()))
    (tmp_path / "T.yaml").write_text(yaml.safe_dump([[1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]]))
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump({
        "description": "spring recalibration",
        "products": {"grid": {"format": "UQ12", "align_corners": True}, "matrix": {"topk": 24, "align": 16}, "export-interop": {"to": "bevpoolv2"}},
        "template": "model.yaml",
        "reference": "b",
        "max_shift_px": 0.5,
        "vehicles": [
            {"id": "a", "rig": "calib/a.yaml"},
            {"id": "b", "cameras": "calib/b-cameras.yaml", "description": "car b"},
            {"id": "c", "import": {"kalibr": "c/camchain.yaml", "body": "cam0", "ego-from-body": "T.yaml", "names": "F,B"}},
            {"id": "d", "import": {"nuscenes": "/data/nuscenes", "version": "v1.0-mini", "scene": "scene-0103"}},
            {"id": "e", "rig": "calib/a.yaml", "import": [{"opencv": "e/front.yml", "camera": "CAM_FRONT", "extrinsics": "CAM-TO-EGO"}],
             "overlay": {"CAM_BACK": {"translation": [0.05, 0.01, 1.57]}}},
        ],
    }, sort_keys=False))
    m = load_manifest(path)
    assert [p.name for p in m.products] == ["grid", "matrix", "export-interop"]
    assert m.products[0].grid is not None and m.products[0].grid.formats == ("uq12",) and m.products[0].grid.align_corners
    assert m.products[2].interop == {"bevpoolv2": {"frustum_mapping": "linspace", "rounding": "trunc", "z_bins": None, "batch": 1}}
    assert m.reference == "b" and m.max_shift_px == 0.5 and m.max_coverage_change is None and m.description == "spring recalibration"
    assert m.template is not None and m.template.source == str(tmp_path / "model.yaml") and "cameras" not in m.template.data
    a, b, c, d, e = m.vehicles
    assert a.start is not None and a.start.kind == "rig" and a.start.path == str(tmp_path / "calib" / "a.yaml")
    assert b.start is not None and b.start.kind == "cameras" and b.description == "car b"
    assert c.start is not None and c.start.kind == "kalibr" and c.start.path == str(tmp_path / "c" / "camchain.yaml")
    assert c.start.option("names") == ("F", "B") and c.start.option("ego-from-body")[0] == (1.0, 0.0, 0.0, 0.0)
    assert d.start is not None and d.start.kind == "nuscenes" and d.start.path == "/data/nuscenes" and d.start.option("scene") == "scene-0103"
    assert [s.kind for s in e.merges] == ["opencv"] and e.merges[0].option("extrinsics") == "cam-to-ego"
    assert e.overlay == {"CAM_BACK": {"translation": [0.05, 0.01, 1.57]}}
    assert len(m.sha256) == 64


def test_reference_defaults_to_the_first_vehicle_and_products_build_in_command_order() -> None:
    m = _parse({**BASE, "products": {"matrix": {}, "grid": {}}, "vehicles": [{"id": "x", "cameras": []}, {"id": "y", "cameras": []}]})
    assert m.reference == "x" and [p.name for p in m.products] == ["grid", "matrix"]


@pytest.mark.parametrize(
    ("options", "command"),
    [
        ({"format": ["opencv", "UQ12"], "align": 32}, ["grid", "--format", "opencv", "--format", "UQ12", "--align", "32"]),
        ({"align-corners": True, "frac-bits": 6, "max_error_px": 0.5}, ["grid", "--align-corners", "--frac-bits", "6", "--max-error-px", "0.5"]),
    ],
)
def test_grid_options_spell_as_the_cli_and_say_their_command(options: dict[str, Any], command: list[str]) -> None:
    product: Product = _parse({**BASE, "products": {"grid": options}}).products[0]
    assert product.command() == command


@pytest.mark.parametrize(
    ("edit", "field", "message"),
    [
        (lambda d: d.pop("products"), "products", "missing required field"),
        (lambda d: d["products"].update(lss={}), "products.lss", "unknown product (products: grid, matrix, export-interop)"),
        (lambda d: d.update(products={"export-interop": {"to": "bevpoolv2"}}), "products.export-interop", "needs grid or matrix as well"),
        (lambda d: d.update(products={"export-interop": {}, "grid": {}}), "products.export-interop.to", "missing required option"),
        (lambda d: d["products"].update(matrix={"topk": -1}), "products.matrix", "--topk must be an integer >= 0, got -1"),
        (lambda d: d["products"].update(matrix={"mode": "voxel"}), "products.matrix", "--mode must be one of frustum, grid, ray, got 'voxel'"),
        (lambda d: d["products"].update(grid={"format": ["opencv", 3]}), "products.grid.format[1]", "expected a string, got int"),
        (lambda d: d["products"].update(grid={"align": "wide"}), "products.grid.align", "expected an integer, got str 'wide'"),
        (lambda d: d["products"].update(grid={"align-corners": "yes"}), "products.grid.align-corners", "expected true or false"),
        (lambda d: d["products"].update(grid={"align-corners": True, "align_corners": False}), "products.grid.align_corners", "given twice (also as 'align-corners')"),
        (lambda d: d["products"].update(grid={"force": True}), "products.grid.force", "not a fleet product option"),
        (lambda d: d["products"].update(grid={"topk": 4}), "products.grid.topk", "unknown option of grid"),
        (lambda d: d.update(vehicles=[]), "vehicles", "must list at least one vehicle"),
        (lambda d: d["vehicles"][0].update(id="car 1"), "vehicles[0].id", "must be a file-name-safe identifier"),
        (lambda d: d["vehicles"].append({"id": "a", "cameras": []}), "vehicles[1].id", "duplicate vehicle id 'a' (also vehicles[0])"),
        (lambda d: d["vehicles"][0].update(rig="r.yaml"), "vehicles[0].cameras", "give either rig"),
        (lambda d: d["vehicles"][0].pop("cameras"), "vehicles[0]", "no calibration: give rig, cameras or import"),
        (lambda d: d["vehicles"][0].update(colour="red"), "vehicles[0].colour", "unknown field"),
        (lambda d: d["vehicles"][0].update(**{"import": {"kalibr": "c.yaml"}}), "vehicles[0].import.kalibr", "must come first and alone"),
        (lambda d: d["vehicles"][0].update(**{"import": {"kalibr": "c.yaml", "opencv": "f.yml"}}), "vehicles[0].import", "exactly one format key"),
        (lambda d: d["vehicles"][0].update(**{"import": {"opencv": "f.yml"}}), "vehicles[0].import.camera", "missing required option of the opencv importer"),
        (lambda d: d["vehicles"][0].update(**{"import": {"opencv": "f.yml", "camera": "F", "lens": "pinhole"}}), "vehicles[0].import.lens", "must be one of auto, opencv, fisheye"),
        (lambda d: d["vehicles"][0].update(**{"import": {"nuscenes": "/d", "scene": "s"}}), "vehicles[0].import.version", "missing required option"),
        (lambda d: d["vehicles"][0].update(**{"import": {"kalibr": "c.yaml", "body": "lidar"}}), "vehicles[0].import.body", "must be imu, camK"),
        (lambda d: d["vehicles"][0].update(overlay={"F": {"colour": 1}}), "vehicles[0].overlay.F.colour", "not a camera field an overlay changes"),
        (lambda d: d.pop("template"), "vehicles[0].cameras", "needs the manifest's template"),
        (lambda d: d.update(template={"cameras": []}), "template.cameras", "a template holds the model settings only"),
        (lambda d: d.update(reference="zz"), "reference", "'zz' is not the id of a vehicle"),
        (lambda d: d.update(max_coverage_change=2), "max_coverage_change", "must be in [0, 1], got 2"),
        (lambda d: d.update(parallelism=4), "parallelism", "unknown field"),
    ],
)
def test_mistakes_are_one_line_errors_with_the_field_path(edit, field: str, message: str) -> None:  # type: ignore[no-untyped-def]
    data = yaml.safe_load(yaml.safe_dump(BASE))
    edit(data)
    with pytest.raises(ConfigError) as info:
        _parse(data)
    assert info.value.source == "/fleet/fleet.yaml" and info.value.field == field
    assert message in info.value.message and "\n" not in str(info.value)


def test_a_mixed_matrix_takes_its_fp16_rows_rule() -> None:
    data = yaml.safe_load(yaml.safe_dump(BASE))
    data["products"] = {"matrix": {"topk": 24, "quantize": "mixed", "fp16-rows": "beyond:35"}}
    product = _parse(data).products[0]
    assert product.matrix is not None and product.matrix.fp16_rows == "beyond:35.0"
    assert product.resolved["fp16_rows"] == "beyond:35.0"
    assert product.command() == ["matrix", "--topk", "24", "--quantize", "mixed", "--fp16-rows", "beyond:35"]
    data["products"]["matrix"]["fp16-rows"] = "near:3"
    with pytest.raises(ConfigError) as info:
        _parse(data)
    assert info.value.field == "products.matrix" and "--fp16-rows kind must be one of beyond, snr, fraction" in info.value.message


def test_a_ray_matrix_depth_prior_is_a_file_relative_to_the_manifest_recorded_by_its_hash(tmp_path: Path) -> None:
    (tmp_path / "priors").mkdir()
    raw = np.linspace(2.0, 0.5, 8)
    np.save(tmp_path / "priors" / "depth.npy", raw)
    data = yaml.safe_load(yaml.safe_dump(BASE))
    data["products"] = {"matrix": {"mode": "ray", "topk": 8, "depth-prior": "priors/depth.npy"}}
    product = _parse(data, base=tmp_path).products[0]
    path = str(tmp_path / "priors" / "depth.npy")
    assert product.depth_prior_file == path
    assert product.matrix is not None and product.matrix.depth_prior == DepthPrior(raw).token  # the array's hash, as the CLI records it
    assert product.resolved["depth_prior"] == product.matrix.depth_prior
    assert product.command() == ["matrix", "--mode", "ray", "--topk", "8", "--depth-prior", path]
    data["products"]["matrix"]["depth-prior"] = "UNIFORM"
    uniform = _parse(data, base=tmp_path).products[0]
    assert uniform.depth_prior_file is None and uniform.matrix is not None and uniform.matrix.depth_prior == "uniform"


@pytest.mark.parametrize(
    ("prior", "mode", "field", "message"),
    [
        ("missing.npy", "ray", "products.matrix.depth-prior", "missing.npy: "),
        ("text.npy", "ray", "products.matrix.depth-prior", "not a .npy file"),
        ("negative.npy", "ray", "products.matrix.depth-prior", "1 negative value(s)"),
        ("cube.npy", "ray", "products.matrix.depth-prior", "shape (2, 2, 2); expected (D,), (n_cam, D) or (n_cam, D, H_f, W_f)"),
        ("good.npy", "frustum", "products.matrix", "--depth-prior applies to --mode ray only (--mode frustum)"),
    ],
)
def test_a_bad_depth_prior_is_a_one_line_error_with_its_field_path(tmp_path: Path, prior: str, mode: str, field: str, message: str) -> None:
    np.save(tmp_path / "good.npy", np.ones(8))
    np.save(tmp_path / "negative.npy", np.array([1.0, -1.0, 1.0]))
    np.save(tmp_path / "cube.npy", np.ones((2, 2, 2)))
    (tmp_path / "text.npy").write_text("1 2 3")
    data = yaml.safe_load(yaml.safe_dump(BASE))
    data["products"] = {"matrix": {"mode": mode, "depth-prior": prior}}
    with pytest.raises(ConfigError) as info:
        _parse(data, base=tmp_path)
    assert info.value.field == field and message in info.value.message and "\n" not in str(info.value)


def test_a_manifest_that_is_not_a_file_or_not_yaml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"nope\.yaml: file not found"):
        load_manifest(tmp_path / "nope.yaml")
    (tmp_path / "bad.yaml").write_text("products: [\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml: invalid YAML: line 2"):
        load_manifest(tmp_path / "bad.yaml")
