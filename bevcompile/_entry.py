"""The ``bevcompile`` console script.

Loading the CLI imports numpy, zarr, rich and every command module (about a second); a Ctrl-C
in that window must end like one during a command: one line, exit 130, no traceback.

Before anything is imported the standard streams are made safe to use: a closed stdout or
stderr (``>&-``, a daemon) is opened on ``/dev/null`` (the command runs; its output goes
nowhere, as with ``> /dev/null``), and text that the stream's encoding cannot carry
(``PYTHONIOENCODING=ascii`` and a camera named ``CAM_前``) is written backslash-escaped instead
of raising. A stdout whose reader went away (``| head``) ends the command quietly in the one
place that maps errors (:func:`bevcompile.cli._app.cli_command`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Sequence

INTERRUPTED_AT_START = "error: interrupted while starting; nothing was written"


def usable_standard_streams() -> None:
    """Closed standard streams on ``/dev/null``; unencodable characters backslash-escaped."""
    for fd, name, mode in ((0, "stdin", "r"), (1, "stdout", "w"), (2, "stderr", "w")):
        try:
            os.fstat(fd)
        except OSError:  # closed: open /dev/null there (os.open takes the lowest free descriptor)
            null = os.open(os.devnull, os.O_RDWR)
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
            setattr(sys, name, open(fd, mode, closefd=False, encoding="utf-8", errors="backslashreplace"))  # noqa: SIM115
            continue
        stream = getattr(sys, name, None)
        if stream is None:
            setattr(sys, name, open(fd, mode, closefd=False, encoding="utf-8", errors="backslashreplace"))  # noqa: SIM115
        elif name != "stdin" and hasattr(stream, "reconfigure"):
            with contextlib.suppress(ValueError, OSError):  # a stream that cannot be reconfigured
                stream.reconfigure(errors="backslashreplace")


TERMINATED_AT_START = "error: terminated (SIGTERM) while starting; nothing was written"


def _held_at_start(signum: int, frame: object) -> None:
    """SIGTERM before the CLI installed its own handler (while numpy, zarr, rich load) is only
    recorded: an exception raised inside an import can be swallowed by the module being imported.
    The CLI acts on it once its own handler is in place (the default action would kill the
    process without a word)."""
    _held_at_start.terminated = True  # type: ignore[attr-defined]


_held_at_start.terminated = False  # type: ignore[attr-defined]


def main(argv: Sequence[str] | None = None) -> None:
    usable_standard_streams()
    _held_at_start.terminated = False  # type: ignore[attr-defined]
    with contextlib.suppress(ValueError, OSError):  # not the main thread: no handler can be set
        signal.signal(signal.SIGTERM, _held_at_start)  # replaced by the CLI's, which acts on a recorded one
    try:
        from .cli import main as cli_main
    except KeyboardInterrupt:
        print(INTERRUPTED_AT_START, file=sys.stderr, flush=True)
        raise SystemExit(130) from None
    if _held_at_start.terminated:  # type: ignore[attr-defined]
        print(TERMINATED_AT_START, file=sys.stderr, flush=True)
        raise SystemExit(143)
    cli_main(argv, console=True)
