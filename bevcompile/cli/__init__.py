"""Command-line interface: a thin layer over the library (``bevcompile --help``).

Each command lives in its own module and registers itself with ``_app.cli_command``.
"""

from __future__ import annotations

from . import export_cmd, grid_cmd, inspect_cmd, matrix_cmd  # noqa: F401  (register commands)
from ._app import app


def main() -> None:
    app()


__all__ = ["app", "main"]
