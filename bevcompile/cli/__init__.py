"""Command-line interface: a thin layer over the library (``bevcompile --help``).

Each command lives in its own module and registers itself with ``_app.cli_command``.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Sequence
from typing import Any

import typer

from . import _app
from ._app import app

# isort: off
# registering the commands: import order = their order in `bevcompile --help`
from . import grid_cmd, matrix_cmd  # noqa: F401
from . import absorb_cmd  # noqa: F401
from . import inspect_cmd, verify_cmd, render_cmd  # noqa: F401
from . import diff_cmd  # noqa: F401
from . import export_cmd, targets_cmd  # noqa: F401
from . import fleet_cmd  # noqa: F401
from . import import_cmd  # noqa: F401
from . import presets_cmd  # noqa: F401
from . import configs_cmd  # noqa: F401
# isort: on


def main(argv: Sequence[str] | None = None, *, console: bool = False) -> None:
    """Console entry point. Command-line usage errors (an option that is not an integer, an
    unknown option, a missing argument) print ONE line ``error: ...`` and exit 2, like every
    other bad input; library errors are mapped in ``_app.cli_command``. SIGTERM is an exception
    for the whole invocation and a late Ctrl-C / SIGTERM (after the command's work) says what is
    already written; ``console=True`` (the console script) then blocks both signals on the way out."""
    from ..store.zarr_io import COMPLETED_WRITES

    command = typer.main.get_command(app)
    _app.forget_reported_errors()
    writes_before = len(COMPLETED_WRITES)
    previous = _app.install_sigterm_handler()
    try:
        code = _run(command, argv, writes_before)
    except (KeyboardInterrupt, _app.Terminated) as exc:  # in the last instants, outside any command
        code = _app.interrupted_outside_a_command(exc, writes_before)
    finally:
        if console:
            _app.hold_signals()
        elif previous is not None:
            signal.signal(signal.SIGTERM, previous)
    raise SystemExit(code)


def _run(command: Any, argv: Sequence[str] | None, writes_before: int) -> int:
    try:
        code = command.main(args=list(argv) if argv is not None else None, prog_name="bevcompile", standalone_mode=False)
    except (KeyboardInterrupt, _app.Terminated) as exc:
        return _app.interrupted_outside_a_command(exc, writes_before)
    except Exception as exc:
        format_message = getattr(exc, "format_message", None)
        exit_code = getattr(exc, "exit_code", None)
        if exc.__class__.__name__ == "NoArgsIsHelpError":  # bare `bevcompile`: the help was printed
            raise SystemExit(exit_code if isinstance(exit_code, int) else 2) from None
        if callable(format_message) and isinstance(exit_code, int):  # click/typer usage error
            ctx = getattr(exc, "ctx", None)
            where = f"{ctx.command_path}: " if ctx is not None and getattr(ctx, "command_path", None) else ""
            message = " ".join(str(format_message()).split())
            print(f"error: {where}{message} (see --help)", file=sys.stderr, flush=True)
            raise SystemExit(exit_code) from None
        if exc.__class__.__name__ == "Abort":
            print("error: aborted", file=sys.stderr, flush=True)
            raise SystemExit(1) from None
        raise
    if code == 130 and not _app.error_reported(130):  # Ctrl-C while Typer parsed the arguments, or after the command
        return _app.interrupted_outside_a_command(KeyboardInterrupt(), writes_before)
    return code if isinstance(code, int) else 0


__all__ = ["app", "main"]
