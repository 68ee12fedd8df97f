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
DependencyError   2          an optional extra (torch, onnx, matplotlib) is missing
CheckpointError   2          a checkpoint given to ``absorb`` is unreadable or does not fit the store
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
        self.field = field
        self.message = message
        where = f"{source}: {field}" if field else source
        super().__init__(f"{where}: {message}")


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


class DependencyError(BevcompileError, ImportError):
    """An optional extra is needed for this feature but is not installed."""


class CheckpointError(_WhereError, ValueError):
    """A training checkpoint (``bevcompile absorb``) is unreadable, unsafe or does not fit the store.

    The message reads ``<file>: <tensor path>: <what is wrong>`` on one line (the tensor path is
    left out when the file itself is the problem).
    """


class CheckFailed(BevcompileError, AssertionError):
    """One or more integrity or equivalence checks failed."""

    exit_code = 1


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
