"""The Typer application and the single place where errors become exit codes."""

from __future__ import annotations

import errno
import functools
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Any, TypeVar

import typer

from ..errors import BevcompileError, printable

F = TypeVar("F", bound=Callable[..., Any])


def _hide_flag_types() -> None:
    """Typer >= 0.2x prints a type column for every parameter: ``<bool>`` for flags too, which
    reads as "takes a value" (``--force true`` then parses ``true`` as the CONFIG path), and
    ``<list[Path]>`` beside a variadic argument already named by its metavar. Flags take no value
    and an argument with a metavar is named once: show no type for either. A no-op if Typer's
    help internals differ."""
    try:
        from typer.core import TyperArgument, TyperOption
    except ImportError:  # pragma: no cover - other Typer layouts
        return

    def untyped_when(cls: Any, hide: Callable[[Any], bool]) -> None:
        original = getattr(cls, "display_type_rich", None)
        if original is None or getattr(original, "_bevcompile_patched", False):
            return

        def display_type_rich(self: Any, ctx: Any) -> Any:
            return None if hide(self) else original(self, ctx)

        display_type_rich._bevcompile_patched = True  # type: ignore[attr-defined]
        cls.display_type_rich = display_type_rich

    untyped_when(TyperOption, lambda option: getattr(option, "is_flag", False) and option.metavar is None)
    untyped_when(TyperArgument, lambda argument: argument.metavar is not None)


_hide_flag_types()

app = typer.Typer(
    name="bevcompile",
    help="Compile camera-to-BEV view transforms into static NPU tables (zarr stores).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


_REPORTED: list[int] = []
"""Exit codes of the errors :func:`fail` printed in this process (the entry point prints a
line for an interrupt that no command reported, e.g. one during argument parsing)."""


def say(line: str) -> None:
    """Write one line to stderr. A stderr that cannot be written (``2> /dev/full``) loses the line
    but never the exit code: it is pointed at /dev/null so nothing (not even the interpreter's
    last flush, which would turn the exit code into 120) fails again."""
    try:
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        _stream_to_devnull(2, "stderr")


def fail(message: str, exit_code: int) -> typer.Exit:
    """Print ``error: <message>`` as ONE line on stderr and return the Exit to raise."""
    say(f"error: {printable(str(message))}")  # one line, bounded, control characters escaped
    _REPORTED.append(exit_code)
    return typer.Exit(exit_code)


def _note(message: str) -> None:
    """``note: <message>`` as one line on stderr (also under --quiet/--json: stdout stays clean)."""
    say(f"note: {printable(message)}")


def _show_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int, file: Any = None, line: str | None = None) -> None:
    say(f"warning: {printable(str(message))} ({category.__name__})")


@contextmanager
def warnings_as_one_line() -> Iterator[None]:
    """Every Python warning that reaches the terminal (a numpy ``RuntimeWarning``, a library's
    ``UserWarning``) is one ``warning: <message> (<category>)`` line on stderr, never the default
    two lines with a source line."""
    import warnings

    with warnings.catch_warnings():
        warnings.showwarning = _show_warning
        yield


def warnings_one_line_for_good() -> None:
    """:func:`warnings_as_one_line` for the rest of the process (the console script: a warning of
    the interpreter's last instants, a coroutine an interrupt left, is one line too)."""
    import warnings

    warnings.showwarning = _show_warning


def empty_argument(args: list[str]) -> str | None:
    """Why ``args`` holds an empty value, or None. No option or argument of bevcompile takes
    ``''``, and Typer reads an empty path as ``.``: ``--out ''`` would write into the current
    folder (an unset shell variable, ``--out "$OUT"``)."""
    for i, arg in enumerate(args):
        if arg == "":
            before = args[i - 1] if i and args[i - 1].startswith("-") else None
            return f"{before} ''" + ": an empty value; give a file or folder name ('.' for the current folder)" if before else "an empty argument ''; give a value ('.' for the current folder)"
        if arg.startswith("--") and arg.endswith("=") and "=" not in arg[:-1]:
            return f"{arg}'': an empty value; give a file or folder name ('.' for the current folder)"
    return None


def forget_reported_errors() -> None:
    """Start a new invocation (``main`` may run several times in one process, as in tests)."""
    _REPORTED.clear()
    _PIPE_BROKE.clear()


def error_reported(exit_code: int) -> bool:
    """Whether :func:`fail` already printed an error with this exit code."""
    return exit_code in _REPORTED


class Terminated(BaseException):
    """SIGTERM (a CI timeout, ``docker stop``, ``kill``) raised in the main thread, so that the
    store writer's cleanup runs as it does for Ctrl-C."""


def _raise_terminated(signum: int, frame: Any) -> None:
    raise Terminated


def interrupted_outside_a_command(exc: BaseException, writes_before: int) -> int:
    """A Ctrl-C / SIGTERM while Typer parsed the arguments or after a command returned (while
    the summary was printed, or on the way out): one line saying what is already written."""
    _silence_abandoned_io()
    code, what = (143, "terminated (SIGTERM)") if isinstance(exc, Terminated) else (130, "interrupted")
    if not error_reported(code):
        say(f"error: {what}; {_left_behind(exc, 'store', writes_before).replace('no store was left half-written (writes are atomic)', 'nothing was written')}")
        _REPORTED.append(code)
    return code


def install_sigterm_handler() -> Any:
    """SIGTERM raises :class:`Terminated` in the main thread for the whole invocation (not only
    inside a command: a late one must still say what was written). Returns the previous handler."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, _raise_terminated)


def hold_signals() -> None:
    """Ignore SIGINT and SIGTERM for the rest of the process: its outcome is decided and printed,
    a signal now would only turn a finished command into a silent kill. Ignored, not only masked:
    a mask is per thread, and another thread (zarr's I/O loop) would take the signal and run the
    handler in the main thread anyway."""
    with suppress(AttributeError, ValueError, OSError):
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            with suppress(ValueError, OSError):
                signal.signal(sig, signal.SIG_IGN)


@contextmanager
def _sigterm_as_exception() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


WRITES = ("store", "file", "nothing")
"""What a command writes, for the interrupt message: a zarr store (``grid``, ``matrix``,
``export-interop``), one file written atomically (``export-onnx``, ``render``) or nothing."""


def _left_behind(exc: BaseException, writes: str, writes_before: int = 0) -> str:
    """What an interrupt left behind: writes are atomic, so either nothing or a complete store
    (``writes_before``: how many stores this process had written when the command started)."""
    if writes == "nothing":
        return "nothing was written"
    if writes == "file":
        return "no file was left half-written (writes are atomic)"
    from ..store.zarr_io import COMPLETED_WRITES, STORE_WRITTEN_ATTR

    written = getattr(exc, STORE_WRITTEN_ATTR, None) or ", ".join(COMPLETED_WRITES[writes_before:])
    if written:
        return f"{written} was already written completely (its old copy is removed by the next write)"
    return "no store was left half-written (writes are atomic)"


ALLOCATION_FAILURE_MARKERS = ("can't allocate memory", "out of memory", "failed to allocate memory", "bad_alloc")
"""A ``RuntimeError`` whose text holds one of these is an allocator failure, not a bug: torch's CPU
allocator raises ``RuntimeError: ... DefaultCPUAllocator: can't allocate memory: you tried to
allocate N bytes`` (and CUDA ``... out of memory``) where numpy would raise ``MemoryError``."""


def _is_allocation_failure(exc: BaseException) -> bool:
    text = str(exc).lower()
    return any(marker in text for marker in ALLOCATION_FAILURE_MARKERS)


def _out_of_memory(exc: BaseException, writes: str = "store", writes_before: int = 0) -> typer.Exit:
    """The one-line out-of-memory error (exit 2) for a ``MemoryError`` or an allocator ``RuntimeError``."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    # torch puts the allocator's own sentence last, after a C++ location line
    detail = next(
        (line for line in reversed(lines) if _is_allocation_failure(Exception(line))), lines[0] if lines else ""
    )
    detail = " ".join(detail.split()) or type(exc).__name__
    return fail(
        f"out of memory ({detail}); {_left_behind(exc, writes, writes_before)}. The problem is too large for this machine: "
        "reduce the BEV cells, heights, cameras or depth bins, or --channels / --batch",
        2,
    )


BROKEN_PIPE_EXIT = 141
"""Exit code when the reader of stdout went away (``bevcompile inspect | head``): 128 + SIGPIPE,
what the shell reports for any tool the pipe stopped; nothing is printed."""
OUTPUT_ERRNOS = (errno.ENOSPC, errno.EIO, errno.EBADF, errno.EDQUOT, errno.EFBIG, errno.EINVAL)


def _stream_to_devnull(fd: int, name: str) -> None:
    """Point stdout (1) or stderr (2) at /dev/null, so the interpreter's final flush cannot fail
    again (Python would then exit 120)."""
    try:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, fd)
        os.close(null)
        setattr(sys, name, open(fd, "w", closefd=False))  # noqa: SIM115
    except (OSError, ValueError):
        pass


def _stdout_to_devnull() -> None:
    _stream_to_devnull(1, "stdout")


def stop_quietly_on_a_broken_pipe() -> int:
    """The reader of stdout went away: no more output, no message, exit 141."""
    _stdout_to_devnull()
    _REPORTED.append(BROKEN_PIPE_EXIT)
    return BROKEN_PIPE_EXIT


def cannot_write_stdout(exc: OSError, done: str = "nothing was written") -> int:
    """A full or failing stdout outside a command (``--help > /dev/full``): one line, exit 2."""
    _stdout_to_devnull()
    fail(f"cannot write to standard output ({exc.strerror or exc}); {done}", 2)
    return 2


@contextmanager
def broken_pipes_raise_everywhere() -> Iterator[None]:
    """rich turns a broken pipe into ``SystemExit(1)`` (``Console.on_broken_pipe``), also in the
    consoles Typer makes for ``--help``: for this invocation every console re-raises it instead,
    so that it ends as a broken pipe does anywhere in bevcompile (quietly, exit 141)."""
    from rich.console import Console

    original = Console.on_broken_pipe
    Console.on_broken_pipe = lambda self: _reraise_broken_pipe()  # type: ignore[method-assign]
    try:
        yield
    finally:
        Console.on_broken_pipe = original  # type: ignore[method-assign]


_PIPE_BROKE: list[bool] = []


def _reraise_broken_pipe() -> None:
    _PIPE_BROKE.append(True)
    raise BrokenPipeError(errno.EPIPE, "Broken pipe")


def stdout_reader_gone() -> bool:
    """Whether stdout is a pipe whose reader went away: rich said so, or ``poll`` reports an
    error on it (Typer and Click turn EPIPE during ``--help`` into ``sys.exit(1)``)."""
    if _PIPE_BROKE:
        return True
    import select

    try:
        poller = select.poll()
        poller.register(1, select.POLLOUT)
        return any(events & select.POLLERR for _fd, events in poller.poll(0))
    except (OSError, ValueError, AttributeError):
        return False


def _broken_pipes_raise() -> None:
    """rich turns a broken pipe into ``SystemExit(1)`` (``Console.on_broken_pipe``); re-raise it
    instead, so that :func:`cli_command` ends it like any other: quietly, exit 141."""
    from . import _output

    for console in (_output.stdout_console, _output.stderr_console):
        console.on_broken_pipe = _reraise_broken_pipe  # type: ignore[method-assign]


def is_output_error(exc: OSError) -> bool:
    """An OSError of writing stdout (``> /dev/full``): no file name, an errno of a failing
    stream. Library write failures are StoreErrors already."""
    return exc.filename is None and exc.errno in OUTPUT_ERRNOS


def _special_output(out: Any) -> str | None:
    """Why the file option ``--out`` of a command that writes one file must not be written: it is
    a device, FIFO or socket (an atomic write would rename a new file over it). None otherwise,
    also for ``-`` (standard output); the command's own checks follow."""
    from ..files import check_output_path

    if out is None or str(out) == "-":
        return None
    reason = check_output_path(out)
    return None if reason is None else f"--out {out}: {reason}"


def _cwd_gone(exc: OSError) -> bool:
    """A ``FileNotFoundError`` without a file name because the working folder was deleted
    (``os.getcwd()`` fails: every relative path, ``.`` included, is then unresolvable)."""
    if not isinstance(exc, FileNotFoundError) or exc.filename is not None:
        return False
    try:
        os.getcwd()
    except FileNotFoundError:
        return True
    return False


def _silence_abandoned_io() -> None:
    """An interrupt can leave zarr's event-loop tasks (chunk reads and writes) pending; asyncio
    logs "Task was destroyed but it is pending!" for each when the interpreter exits. The
    command already said what happened in one line: nothing more goes to stderr."""
    import logging
    import warnings

    logging.getLogger("asyncio").setLevel(logging.CRITICAL + 1)
    warnings.filterwarnings("ignore", message=r"coroutine .* was never awaited", category=RuntimeWarning)


def cli_command(name: str, *, writes: str = "store", parent: typer.Typer | None = None, **kwargs: Any) -> Callable[[F], F]:
    """Register a command; a :class:`BevcompileError` becomes one stderr line and its
    ``exit_code`` (2 for bad input, 1 for failed checks). Ctrl-C and SIGTERM stop the command
    with one line (exit 130 / 143) saying what the atomic writer left (nothing, or a complete
    store); a ``MemoryError`` or an allocator ``RuntimeError`` (torch's "can't allocate memory":
    a problem too large for this machine) is one line, exit 2. Nothing else is caught here: anything else is a bug and keeps its traceback.
    ``parent``: the command group it belongs to (``bevcompile import kalibr``), default the root."""

    if writes not in WRITES:
        raise ValueError(f"writes must be one of {WRITES}, got {writes!r}")

    def decorator(func: F) -> F:
        @functools.wraps(func)
        def wrapper(*args: Any, **kw: Any) -> Any:
            from ..store.zarr_io import COMPLETED_WRITES, LOCK_WAIT_REPORTERS

            if _note not in LOCK_WAIT_REPORTERS:  # a second writer of the same store says why it waits
                LOCK_WAIT_REPORTERS.append(_note)
            _broken_pipes_raise()
            writes_before = len(COMPLETED_WRITES)
            if writes == "file":  # before any work (loading torch costs seconds): --out must not be a device
                special = _special_output(kw.get("out"))
                if special is not None:
                    raise fail(special, 2)
            try:
                with _sigterm_as_exception(), warnings_as_one_line():
                    return func(*args, **kw)
            except BevcompileError as exc:
                raise fail(str(exc), exc.exit_code) from None
            except KeyboardInterrupt as exc:
                _silence_abandoned_io()
                raise fail(f"interrupted; {_left_behind(exc, writes, writes_before)}", 130) from None
            except Terminated as exc:
                _silence_abandoned_io()
                raise fail(f"terminated (SIGTERM); {_left_behind(exc, writes, writes_before)}", 143) from None
            except BrokenPipeError:  # the reader of stdout went away: stop quietly
                raise typer.Exit(stop_quietly_on_a_broken_pipe()) from None
            except OSError as exc:
                if _cwd_gone(exc):
                    raise fail(f"the current folder no longer exists ({exc.strerror}); cd into an existing folder", 2) from None
                if not is_output_error(exc):
                    raise
                _stdout_to_devnull()
                done = _left_behind(exc, writes, writes_before) if writes == "store" else "its work was done"
                raise fail(f"cannot write to standard output ({exc.strerror or exc}); {done}", 2) from None
            except MemoryError as exc:
                raise _out_of_memory(exc, writes, writes_before) from None
            except RuntimeError as exc:
                if not _is_allocation_failure(exc):
                    raise
                raise _out_of_memory(exc, writes, writes_before) from None

        (parent if parent is not None else app).command(name, **kwargs)(wrapper)
        return func

    return decorator


VERSION_STACK = ("numpy", "scipy", "zarr", "typer", "rich", "pyyaml")
VERSION_EXTRAS = ("torch", "onnx", "onnxruntime", "onnxscript", "opencv-python-headless", "matplotlib", "dask", "distributed")


def version_lines() -> list[str]:
    """``bevcompile X`` and the versions of what it runs on, read from the installed packages'
    metadata (nothing is imported: torch is not loaded to print its version)."""
    import platform
    from importlib.metadata import PackageNotFoundError, version

    from .._version import __version__

    def of(name: str) -> str:
        try:
            return f"{name} {version(name)}"
        except PackageNotFoundError:
            return f"{name} not installed"

    return [
        f"bevcompile {__version__}",
        f"python {platform.python_version()}, " + ", ".join(of(name) for name in VERSION_STACK),
        "extras: " + ", ".join(of(name) for name in VERSION_EXTRAS),
    ]


def _version_callback(value: bool) -> None:
    if value:
        print("\n".join(version_lines()))
        raise typer.Exit(0)


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version_callback, is_eager=True, help="Print the version (and those of numpy, zarr, torch, ...) and exit."
    ),
) -> None:
    """Compile camera-to-BEV view transforms into static NPU tables (zarr stores)."""
