"""Packaging: the metadata a package index shows (Project-URLs, authors, a long description whose
links resolve there), messages that ask for what the metadata allows, and the example configs
inside the package (``bevcompile configs``), proven on a wheel installed apart from the checkout."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from typer.testing import CliRunner

from bevcompile._version import TORCH_REQUIREMENT
from bevcompile.cli import app
from bevcompile.cli.configs_cmd import bundled_configs

from .rigs import ROOT

PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
runner = CliRunner()


def _backend() -> object:
    spec = importlib.util.spec_from_file_location("bevcompile_build_backend", ROOT / "_build" / "backend.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_metadata_names_urls_and_authors_and_messages_ask_for_the_declared_torch() -> None:
    assert {"Homepage", "Source", "Documentation", "Issues"} <= set(PROJECT["urls"])
    assert PROJECT["authors"] and PROJECT["maintainers"]
    assert PROJECT["optional-dependencies"]["torch"] == [TORCH_REQUIREMENT]
    assert TORCH_REQUIREMENT in PROJECT["optional-dependencies"]["onnx"]
    from bevcompile.deploy.onnx_graph import EXTRA_HINT

    assert TORCH_REQUIREMENT in EXTRA_HINT and "==" not in EXTRA_HINT
    for path in (ROOT / "bevcompile").rglob("*.py"):  # no message pins an exact torch the metadata does not
        assert "torch==" not in path.read_text(), path


def test_every_dependency_floor_is_a_release_that_pip_installs() -> None:
    """The floors ``make test-min`` installs: scipy 1.11.0 was yanked, so the floor is 1.11.1
    (pip index versions scipy lists 1.11.1 as the lowest 1.11); every floor names major.minor at least."""
    floors = dict(re.match(r"^([A-Za-z0-9_.-]+)\s*>=\s*([0-9.]+)", r).groups() for r in PROJECT["dependencies"])  # type: ignore[union-attr]
    assert floors["scipy"] == "1.11.1"
    assert all(v.count(".") >= 1 for v in floors.values()), floors


def test_long_description_links_are_absolute() -> None:
    backend = _backend()
    base = PROJECT["urls"]["Source"] + "/blob/main"
    text = backend.absolute_links((ROOT / "README.md").read_text(), base)  # type: ignore[attr-defined]
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    assert targets and all(t.startswith(("https://", "http://", "#")) for t in targets), [t for t in targets if not t.startswith(("http", "#"))][:5]
    assert f"]({base}/docs/models.md" in text
    assert backend.absolute_links("[a](https://x.org/y) [b](#c) ![i](docs/p.png)", "B") == "[a](https://x.org/y) [b](#c) ![i](B/docs/p.png)"  # type: ignore[attr-defined]


def test_bundled_configs_are_the_repositorys_and_copy_out(tmp_path: Path) -> None:
    files = bundled_configs()
    on_disk = {str(p.relative_to(ROOT / "configs")): p.read_bytes() for p in sorted((ROOT / "configs").rglob("*.yaml"))}
    assert files == on_disk and "fleet/example.yaml" in files
    result = runner.invoke(app, ["configs"])
    assert result.exit_code == 0 and "nuscenes_calibration.yaml" in result.output
    result = runner.invoke(app, ["configs", "--copy", str(tmp_path / "configs")])
    assert result.exit_code == 0 and f"{len(files)} config(s) copied, 0 already there" in result.output
    (tmp_path / "configs" / "nuscenes.yaml").write_text("name: mine\n")
    result = runner.invoke(app, ["configs", "--copy", str(tmp_path / "configs")])
    assert result.exit_code == 2 and "nuscenes.yaml: exists and differs from the bundled config (1 such file(s)); --force replaces them" in " ".join(result.output.split())
    assert (tmp_path / "configs" / "nuscenes.yaml").read_text() == "name: mine\n"
    result = runner.invoke(app, ["configs", "--copy", str(tmp_path / "configs"), "--force"])
    assert result.exit_code == 0 and "1 config(s) copied" in result.output
    assert (tmp_path / "configs" / "nuscenes.yaml").read_bytes() == files["nuscenes.yaml"]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(ROOT)], capture_output=True, text=True, timeout=600
    )
    if result.returncode != 0 and "No matching distribution found for setuptools" in result.stderr:
        pytest.skip("the isolated build cannot reach a package index for setuptools")
    assert result.returncode == 0, result.stderr[-2000:]
    (built,) = out.glob("bevcompile-*.whl")
    return built


def test_the_wheel_carries_the_metadata_and_runs_the_readme_session_from_its_own_configs(wheel: Path, tmp_path: Path) -> None:
    """A wheel unpacked apart from the checkout (its own bevcompile first on the path, the
    dependencies of this environment): METADATA has the URLs, authors and absolute links; the
    README's session runs in an empty folder with the configs from ``bevcompile configs --copy``."""
    with zipfile.ZipFile(wheel) as archive:
        meta = archive.read(next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))).decode()
        assert sum(n.startswith("bevcompile/data/configs/") for n in archive.namelist()) == len(bundled_configs())
        archive.extractall(tmp_path / "site")
    assert "Project-URL: Source, " in meta and "Author: " in meta and "](docs/" not in meta and "](configs/" not in meta
    work = tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site"), "COLUMNS": "120", "NO_COLOR": "1"}
    code = "import sys; from bevcompile._entry import main; sys.argv[0] = 'bevcompile'; sys.exit(main())"

    def bevcompile(*args: str) -> str:
        result = subprocess.run([sys.executable, "-c", code, *args], cwd=work, env=env, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stdout + result.stderr
        return result.stdout

    where = subprocess.run([sys.executable, "-c", "import bevcompile; print(bevcompile.__file__)"], cwd=work, env=env, capture_output=True, text=True)
    assert where.stdout.startswith(str(tmp_path / "site")), where.stdout  # the wheel, not the checkout
    assert "10 config(s) copied" in bevcompile("configs", "--copy", "configs")
    bevcompile("grid", "configs/nuscenes.yaml", "--format", "uq12", "--out", "artifacts", "--quiet")
    bevcompile("matrix", "configs/nuscenes.yaml", "--topk", "24", "--align", "16", "--out", "artifacts", "--quiet")
    assert "checks passed in 1 store(s)" in bevcompile("inspect", "artifacts")
