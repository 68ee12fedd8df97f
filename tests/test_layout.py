"""The package layout: subpackages by product, the import rules their ``__init__`` docstrings
state, and the names users import (the 0.2 flat module names included) keep working."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from .rigs import ROOT

PKG = ROOT / "bevcompile"

# package -> the bevcompile packages/modules its modules may import at module level
# (the rule each package's __init__ docstring states; "cli" may import anything; every package may
# import _version, _legacy, progress and files, the one reader/writer of user-named files)
ALLOWED: dict[str, set[str]] = {
    "rig": {"errors"},
    "store": {"rig", "errors", "conventions"},
    "grid": {"rig", "store", "errors", "conventions", "memory", "choices"},
    "matrix": {"grid", "rig", "store", "errors", "memory", "choices", "parallel"},
    "interop": {"grid", "matrix", "rig", "store", "errors", "conventions", "choices", "parallel", "memory"},
    "report": {"store", "grid", "matrix", "rig", "errors"},
    "deploy": {"store", "grid", "matrix", "errors", "memory"},
    "fleet": {"grid", "matrix", "interop", "report", "rig", "store", "errors", "choices"},
    "memory": {"errors"},
    "choices": set(),
    "parallel": {"errors"},
    "files": {"errors"},
}
# deliberate function-level imports across the rules, each with its reason
LAZY_EXCEPTIONS = {
    ("store", "grid"): "store.plugins.CheckContext.sampling_grid computes the one product the contract serves",
}


def _imports(path: Path) -> list[tuple[str, bool]]:
    """(imported bevcompile module, at module level?) for every relative import in ``path``
    (imports under ``if TYPE_CHECKING:`` are for annotations only and not counted)."""
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    package = parts if parts[-1] == "__init__" else parts[:-1]
    package = [p for p in package if p != "__init__"]
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for node in tree.body if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING" for n in node.body}
    top = {id(node) for node in tree.body}
    out = []
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.level > 0:
            base = package[: len(package) - (node.level - 1)]
            module = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:
                out.append((f"{module}.{alias.name}" if not node.module else module, id(node) in top))
    return out


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_every_subpackage_says_what_lives_there_and_what_it_may_import() -> None:
    packages = sorted(p.name for p in PKG.iterdir() if (p / "__init__.py").exists())
    assert packages == ["cli", "deploy", "fleet", "grid", "interop", "matrix", "report", "rig", "store"]
    for name in packages:
        doc = ast.get_docstring(ast.parse((PKG / name / "__init__.py").read_text())) or ""
        assert len(doc.splitlines()) >= 3, name
        if name != "cli":
            assert "May import" in doc, name


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_import_rules(package: str) -> None:
    files = [PKG / f"{package}.py"] if (PKG / f"{package}.py").exists() else sorted((PKG / package).rglob("*.py"))
    bad = []
    for path in files:
        for module, at_top in _imports(path):
            target = _package(module)
            if target in ("", package, "_legacy", "_version", "progress", "files") or target in ALLOWED[package]:
                continue
            if not at_top and (package, target) in LAZY_EXCEPTIONS:
                continue
            bad.append(f"{path.relative_to(ROOT)} imports {module}")
    assert not bad, bad


OLD_NAMES = {
    "bevcompile.config": ("bevcompile.rig.config", "load_config"),
    "bevcompile.checks_api": ("bevcompile.store.plugins", "Check"),
    "bevcompile.npu_checks": ("bevcompile.grid.checks.formats", "check_grid"),
    "bevcompile.diff": ("bevcompile.report.diff", "diff_stores"),
    "bevcompile.matrix_layout": ("bevcompile.matrix.layout", "dequantize_rows_int8"),
}


@pytest.mark.parametrize("old", sorted(OLD_NAMES))
def test_0_2_module_names_import_the_same_objects(old: str) -> None:
    new, name = OLD_NAMES[old]
    assert getattr(importlib.import_module(old), name) is getattr(importlib.import_module(new), name)


def test_0_2_names_served_by_the_packages_of_the_same_name() -> None:
    import bevcompile.grid
    import bevcompile.interop
    import bevcompile.matrix
    import bevcompile.store
    from bevcompile.grid.ipm import compute_sampling_grid
    from bevcompile.interop.bevpoolv2 import build_bevpoolv2
    from bevcompile.matrix.build import MatrixOptions
    from bevcompile.store.zarr_io import write_groups

    assert bevcompile.grid.compute_sampling_grid is compute_sampling_grid
    assert bevcompile.matrix.MatrixOptions is MatrixOptions
    assert bevcompile.store.write_groups is write_groups
    assert bevcompile.interop.build_bevpoolv2 is build_bevpoolv2
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        _ = bevcompile.grid.nothing_here


def test_a_moved_module_keeps_its_own_spec() -> None:
    import bevcompile.rig.config as new

    old = importlib.import_module("bevcompile.config")
    assert old is new and new.__spec__ is not None and new.__spec__.name == "bevcompile.rig.config"


def test_public_names_and_the_torch_entry_point() -> None:
    code = (
        "import bevcompile, sys\n"
        "assert 'numpy' not in sys.modules, 'import bevcompile must stay lazy'\n"
        "names = [n for n in bevcompile.__all__ if n != '__version__']\n"
        "assert all(getattr(bevcompile, n) is not None for n in names)\n"
        "from bevcompile.torch import GridGather, MatrixLift\n"
        "import bevcompile.deploy.torch as t\n"
        "assert GridGather is t.GridGather and MatrixLift is t.MatrixLift\n"
        "print(len(names))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stderr
    assert int(result.stdout) >= 25
