"""The flat module names of bevcompile 0.2 (``bevcompile.config``, ``bevcompile.npu_checks``, ...).

bevcompile 0.3 moved its modules into product subpackages (see :mod:`bevcompile`). Scripts
written against 0.2 keep working: every old dotted name in :data:`MOVED` imports as the SAME
module object as its new home (so ``isinstance`` checks and monkeypatches work either way),
through the one finder :func:`install` puts on ``sys.meta_path``. The old modules that were split
(``bevcompile.interop``, ``bevcompile.npu_checks``) and the four whose name is now a package's
(``bevcompile.grid``, ``bevcompile.matrix``, ``bevcompile.store``, ``bevcompile.interop``) serve
their old public names from the package (:func:`package_getattr`). New code should use the new
paths; these names are for compatibility only and are not type-checked.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

MOVED: dict[str, str] = {
    "bevcompile.config": "bevcompile.rig.config",
    "bevcompile.geometry": "bevcompile.rig.geometry",
    "bevcompile.gather": "bevcompile.grid.gather",
    "bevcompile.formats": "bevcompile.grid.formats",
    "bevcompile.delta": "bevcompile.grid.delta",
    "bevcompile.reference": "bevcompile.grid.reference",
    "bevcompile.build": "bevcompile.grid.build",
    "bevcompile.checks_grid": "bevcompile.grid.checks.base",
    "bevcompile.npu_checks": "bevcompile.grid.checks",
    "bevcompile.matrix_entries": "bevcompile.matrix.entries",
    "bevcompile.matrix_layout": "bevcompile.matrix.layout",
    "bevcompile.matrix_checks": "bevcompile.matrix.checks",
    "bevcompile.reference_pool": "bevcompile.matrix.reference",
    "bevcompile.interop_checks": "bevcompile.interop.checks",
    "bevcompile.loader": "bevcompile.store.loader",
    "bevcompile.checks": "bevcompile.store.inspection",
    "bevcompile.checks_api": "bevcompile.store.plugins",
    "bevcompile.verify": "bevcompile.store.verify",
    "bevcompile.diff": "bevcompile.report.diff",
    "bevcompile.render": "bevcompile.report.render",
    "bevcompile.onnx_export": "bevcompile.deploy.onnx_export",
    "bevcompile.onnx_graph": "bevcompile.deploy.onnx_graph",
}
"""Old flat module -> its new home (a module, or a package serving the old names)."""


class _AliasFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports an old name in :data:`MOVED` as the already-importable new module."""

    def __init__(self) -> None:
        self._specs: dict[str, importlib.machinery.ModuleSpec | None] = {}

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(MOVED[spec.name])
        self._specs[spec.name] = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # the import system stamped the alias's spec on the real module: give it back its own
        real = self._specs.pop(module.__spec__.name if module.__spec__ else "", None)
        if real is not None:
            module.__spec__ = real


_FINDER = _AliasFinder()


def install() -> None:
    """Put the alias finder on ``sys.meta_path`` (once)."""
    if not any(isinstance(f, _AliasFinder) for f in sys.meta_path):
        sys.meta_path.append(_FINDER)


def package_getattr(package: str, homes: Sequence[str]) -> Callable[[str], Any]:
    """A PEP 562 ``__getattr__`` for ``package`` serving the public names of the old flat module
    of the same name from the submodules ``homes`` (imported on first use)."""

    def __getattr__(name: str) -> Any:
        if not name.startswith("_"):
            for home in homes:
                module = importlib.import_module(f"{package}.{home}")
                if name in vars(module):
                    return vars(module)[name]
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
