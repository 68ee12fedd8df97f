"""Typed error tree.

Every error the library raises on purpose derives from :class:`BevcompileError` and
also from the builtin exception it resembles, so callers may catch either. The CLI maps
them to exit codes in exactly one place (``bevcompile.cli._app.cli_command``):

================  =========  ==========================================================
class             exit code  meaning
================  =========  ==========================================================
ConfigError       2          a rig config is missing, unreadable or invalid
UsageError        2          a command-line value is invalid or inconsistent
StoreError        2          a path is not a readable bevcompile store
StoreConflictError 2         refusing to replace a store built from another config
StoreLockedError  2          another process is writing the store (its lock was not released in time)
DependencyError   2          an optional extra (torch, onnx, matplotlib) is missing
CheckpointError   2          a checkpoint given to ``absorb`` is unreadable or does not fit the store
DepthPriorError   2          a ``--depth-prior`` file is unreadable or does not fit the rig
CheckFailed       1          an integrity/equivalence check failed (inspect/verify)
================  =========  ==========================================================
"""

from __future__ import annotations


class BevcompileError(Exception):
    """Base class of every deliberate bevcompile error."""

    exit_code: int = 2


class _WhereError(BevcompileError):
    """An error in one field of one file: the message reads ``<file>: <field path>: <what is wrong>``
    on one line (the field path is left out when the file itself is the problem)."""

    def __init__(self, source: str, field: str, message: str) -> None:
        self.source = source
        self.field = printable(field, 200)  # a key of the config: may hold anything, ESC included
        self.message = printable(message)
        where = f"{printable(source, 300)}: {self.field}" if field else printable(source, 300)
        # cut once, the whole line: a second cut would count the characters of the first one's
        # remainder ("67 more") instead of those of the message
        super().__init__(printable(f"{where}: {message}"))


class ConfigError(_WhereError, ValueError):
    """Invalid rig configuration.

    The message always reads ``<file>: <field path>: <what is wrong>`` on one line.
    """


class UsageError(BevcompileError, ValueError):
    """A command-line or API argument is invalid (e.g. ``--frac-bits`` too large)."""


class StoreError(BevcompileError, OSError):
    """A path is not a readable bevcompile store, or a store could not be written."""


class StoreConflictError(StoreError, FileExistsError):
    """An existing store was built from a different config; ``--force`` replaces it."""


class StoreLockedError(StoreError, BlockingIOError):
    """Another process holds the store's write lock and did not release it in time."""


class DependencyError(BevcompileError, ImportError):
    """An optional extra is needed for this feature but is not installed."""


class CheckpointError(_WhereError, ValueError):
    """A training checkpoint (``bevcompile absorb``) is unreadable, unsafe or does not fit the store.

    The message reads ``<file>: <tensor path>: <what is wrong>`` on one line (the tensor path is
    left out when the file itself is the problem).
    """


class DepthPriorError(_WhereError, ValueError):
    """A ``bevcompile matrix --mode ray --depth-prior FILE.npy`` prior is unreadable or does not fit
    the rig (shape, finiteness, sign). The message reads ``<file>: <what is wrong>`` on one line."""


class CheckFailed(BevcompileError, AssertionError):
    """One or more integrity or equivalence checks failed."""

    exit_code = 1


def unreadable(exc: OSError, expected: str) -> str:
    """The one-line reason a file could not be read, for ``expected`` (``"a .npy file"``):
    ``is a directory, not a .npy file``, ``no such file`` or ``cannot read (<strerror>)``."""
    if isinstance(exc, IsADirectoryError):
        return f"is a directory, not {expected}"
    if isinstance(exc, FileNotFoundError):
        return "no such file"
    return f"cannot read ({exc.strerror or exc})"


def check_int_option(name: str, value: object, low: int, high: int | None = None) -> int:
    """``value`` as an int, or the one wording every command uses for an integer option out of
    range: ``--<name> must be an integer in [low, high], got <value>`` (``>= low`` without a
    ``high``); booleans are not integers."""
    import numbers

    ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if ok and low <= int(value) and (high is None or int(value) <= high):  # type: ignore[call-overload]
        return int(value)  # type: ignore[call-overload]
    bounds = f"in [{low}, {high}]" if high is not None else f">= {low}"
    raise UsageError(f"--{name} must be an integer {bounds}, got {value!r}")

# --------------------------------------------------------------------------------------
# the text every message goes through: one line, bounded, no terminal control characters
# --------------------------------------------------------------------------------------

MAX_MESSAGE_CHARS = 1000
"""An error line is cut to this many characters (a value echoed in it is cut much earlier, see
:func:`shown`): a config of megabytes must not print a line of megabytes."""
SHOWN_VALUE_CHARS = 60
"""A value quoted in a message (:func:`shown`) keeps this many characters of its ``repr``."""


def printable(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """``text`` as one terminal-safe line: line breaks and tabs become spaces, every other
    control or format character (ESC, DEL, C1, bidi overrides) is shown escaped (``\\x1b``), and
    the result is cut to ``limit`` characters, saying how many were cut."""
    out = []
    for ch in str(text):
        if ch in "\n\r\t\v\f\u2028\u2029":
            out.append(" ")
        elif _is_control(ch):
            code = ord(ch)
            out.append(f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")
        else:
            out.append(ch)
    line = " ".join("".join(out).split(" ")) if out else ""
    if len(line) > limit:
        return f"{line[: max(limit - 30, 10)]}… ({len(line) - max(limit - 30, 10):,} more characters)"
    return line


def _is_control(ch: str) -> bool:
    import unicodedata

    return unicodedata.category(ch) in ("Cc", "Cf", "Cs", "Co", "Cn") and ch != "\u200d"


def shown(value: object, limit: int = SHOWN_VALUE_CHARS) -> str:
    """``repr(value)`` for a message, cut in the middle to about ``limit`` characters (the
    length is then given), with control characters escaped."""
    text = repr(value)
    if len(text) > limit:
        half = max(limit // 2 - 2, 4)
        size = f"{len(value):,} characters" if isinstance(value, str) else f"{len(text):,} characters as text"
        text = f"{text[:half]}…{text[-half:]} ({size})"
    return printable(text, 4 * limit)


HASH_SHOWN_CHARS = 12


def hash_pair(a: object, b: object) -> tuple[str, str]:
    """Two hex digests shortened for a message, but never cut before they differ:
    ``("c1c66ac95cc3d1…", "c1c66ac95cc3e7…")``. Non-strings are shown with :func:`shown`."""
    if not (isinstance(a, str) and isinstance(b, str)):
        return (a[:HASH_SHOWN_CHARS] + "…" if isinstance(a, str) else shown(a)), (b[:HASH_SHOWN_CHARS] + "…" if isinstance(b, str) else shown(b))
    first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    n = max(HASH_SHOWN_CHARS, first + 2) if a != b else HASH_SHOWN_CHARS
    return (printable(a[:n], 80) + ("…" if len(a) > n else "")), (printable(b[:n], 80) + ("…" if len(b) > n else ""))
