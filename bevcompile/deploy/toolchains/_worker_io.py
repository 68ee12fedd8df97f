"""What every toolchain worker shares (imported by the worker scripts as ``_worker_io``, from their
own folder: they run in the toolchains' venvs and import no bevcompile module; stdlib only)."""

import json
import os
import resource
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


def read_spec() -> dict[str, Any]:
    """The JSON spec named by the first argument; its ``out_dir`` created."""
    with open(sys.argv[1]) as fh:
        spec: dict[str, Any] = json.load(fh)
    os.makedirs(spec["out_dir"], exist_ok=True)
    return spec


@contextmanager
def captured(log_path: str) -> Iterator[None]:
    """File descriptors 1 and 2 into ``log_path`` (the compilers print from C)."""
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    saved = os.dup(1), os.dup(2)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(log_fd)


def finish(result: dict[str, Any], out_dir: str, started: float) -> None:
    """``seconds`` and the process's peak RSS into ``result``; ``out_dir/result.json`` written."""
    result["seconds"] = time.time() - started
    result["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    with open(os.path.join(out_dir, "result.json"), "w") as fh:
        json.dump(result, fh, indent=1)
