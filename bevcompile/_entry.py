"""The ``bevcompile`` console script.

Loading the CLI imports numpy, zarr, rich and every command module (about a second); a Ctrl-C
in that window must end like one during a command: one line, exit 130, no traceback.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

INTERRUPTED_AT_START = "error: interrupted while starting; nothing was written"


def main(argv: Sequence[str] | None = None) -> None:
    try:
        from .cli import main as cli_main
    except KeyboardInterrupt:
        print(INTERRUPTED_AT_START, file=sys.stderr, flush=True)
        raise SystemExit(130) from None
    cli_main(argv)
