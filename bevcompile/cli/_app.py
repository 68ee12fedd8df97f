"""The Typer application and the single place where errors become exit codes."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import typer

from ..errors import BevcompileError

F = TypeVar("F", bound=Callable[..., Any])

app = typer.Typer(
    name="bevcompile",
    help="Compile camera-to-BEV view transforms into static NPU tables (zarr stores).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
)


def fail(message: str, exit_code: int) -> typer.Exit:
    """Print ``error: <message>`` as ONE line on stderr and return the Exit to raise."""
    one_line = " ".join(str(message).split("\n"))
    print(f"error: {one_line}", file=sys.stderr, flush=True)
    return typer.Exit(exit_code)


def cli_command(name: str, **kwargs: Any) -> Callable[[F], F]:
    """Register a command; a :class:`BevcompileError` becomes one stderr line and its
    ``exit_code`` (2 for bad input, 1 for failed checks). Nothing else is caught here:
    anything else is a bug and keeps its traceback."""

    def decorator(func: F) -> F:
        @functools.wraps(func)
        def wrapper(*args: Any, **kw: Any) -> Any:
            try:
                return func(*args, **kw)
            except BevcompileError as exc:
                raise fail(str(exc), exc.exit_code) from None
            except KeyboardInterrupt:
                raise fail("interrupted; no store was changed", 130) from None

        app.command(name, **kwargs)(wrapper)
        return func

    return decorator


def _version_callback(value: bool) -> None:
    if value:
        from .._version import __version__

        print(f"bevcompile {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version_callback, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """Compile camera-to-BEV view transforms into static NPU tables (zarr stores)."""
