"""Command-line interface: a thin layer over the library (``bevcompile --help``).

Each command lives in its own module and registers itself with ``_app.cli_command``.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Sequence
from typing import Any

import typer

from ..errors import printable
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

    previous = _app.install_sigterm_handler()
    _app.forget_reported_errors()
    writes_before = len(COMPLETED_WRITES)
    try:
        if getattr(previous, "terminated", False):  # a SIGTERM the entry point held while the CLI loaded
            raise _app.Terminated
        if console:
            _app.warnings_one_line_for_good()
        command = typer.main.get_command(app)
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
    args = list(argv) if argv is not None else sys.argv[1:]
    empty = _app.empty_argument(args)
    if empty is not None:
        _app.say(f"error: bevcompile: {empty} (see --help)")
        return 2
    try:
        with _app.broken_pipes_raise_everywhere():
            code = command.main(args=args, prog_name="bevcompile", standalone_mode=False)
    except (KeyboardInterrupt, _app.Terminated) as exc:
        return _app.interrupted_outside_a_command(exc, writes_before)
    except BrokenPipeError:  # `bevcompile --help | head -1`: the reader left, as for any command
        return _app.stop_quietly_on_a_broken_pipe()
    except SystemExit as exc:  # Typer turns EPIPE while printing --help into sys.exit(1)
        if exc.code == 1 and _app.stdout_reader_gone():
            return _app.stop_quietly_on_a_broken_pipe()
        raise
    except OSError as exc:  # `--help` / `--version` > /dev/full (a command maps its own in cli_command)
        if not _app.is_output_error(exc):
            raise
        return _app.cannot_write_stdout(exc)
    except Exception as exc:
        format_message = getattr(exc, "format_message", None)
        exit_code = getattr(exc, "exit_code", None)
        if exc.__class__.__name__ == "NoArgsIsHelpError":  # bare `bevcompile`: the help was printed
            raise SystemExit(exit_code if isinstance(exit_code, int) else 2) from None
        if callable(format_message) and isinstance(exit_code, int):  # click/typer usage error
            ctx = getattr(exc, "ctx", None)
            where = f"{ctx.command_path}: " if ctx is not None and getattr(ctx, "command_path", None) else ""
            _app.say(f"error: {printable(where + str(format_message()))} (see --help)")
            raise SystemExit(exit_code) from None
        if exc.__class__.__name__ == "Abort":
            _app.say("error: aborted")
            raise SystemExit(1) from None
        raise
    if code == 130 and not _app.error_reported(130):  # Ctrl-C while Typer parsed the arguments, or after the command
        return _app.interrupted_outside_a_command(KeyboardInterrupt(), writes_before)
    return code if isinstance(code, int) else 0


__all__ = ["app", "main"]
