"""Files a user names: read only when regular and bounded, never written over a device.

Every file bevcompile reads because a user named it (a rig config, a template, a Kalibr camchain, an
OpenCV file, a fleet manifest, a region mask, a depth prior, a checkpoint, a nuScenes table) is
opened by :func:`open_regular`: without blocking (``O_NONBLOCK``: the open of a FIFO returns at
once), checked with ``fstat`` to be a regular file (a FIFO would block the first read forever,
``/dev/zero`` never end), and its size bounded before a byte is read. Every file a command writes
(``--out``) is checked by :func:`check_output_path` first: an existing path that is a device, a
FIFO or a socket is refused, because an atomic write renames its temporary over the path (run as
root, ``--out /dev/null`` would turn ``/dev/null`` into a regular file for the whole machine).

JSON from users and stores goes through :func:`loads_strict`: nesting bounded before parsing (no
``RecursionError``), and strict: no ``NaN`` / ``Infinity``, no number that overflows float64 or has
more digits than Python converts, no duplicate key, no byte-order mark, UTF-8 only.

Refusals are :class:`FileRefused` (a :class:`~bevcompile.errors.BevcompileError`, exit 2) with a
``code`` and a short ``reason``; each reader turns them into its own typed error naming the file
and the field (``ConfigError``, ``CheckpointError``, ``DepthPriorError``, ``StoreError``).
May import: :mod:`bevcompile.errors` only (every package imports this module).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from .errors import BevcompileError, printable, shown

MISSING = "missing"
DIRECTORY = "directory"
SPECIAL = "special"
TOO_LARGE = "too_large"
UNREADABLE = "unreadable"


class FileRefused(BevcompileError, ValueError):
    """A user-named file that is not read: ``code`` one of :data:`MISSING`, :data:`DIRECTORY`,
    :data:`SPECIAL` (FIFO, device, socket), :data:`TOO_LARGE`, :data:`UNREADABLE`; ``reason`` the
    phrase that follows the file name (``is a FIFO, not a regular file``); ``kind`` the file's
    kind for :data:`SPECIAL`, ``size`` its bytes for :data:`TOO_LARGE` (0: it grew while read),
    ``detail`` the OS's reason for :data:`UNREADABLE`."""

    def __init__(self, path: str | Path, code: str, reason: str, *, kind: str = "", size: int = 0, detail: str = "") -> None:
        self.path = str(path)
        self.code = code
        self.reason = reason
        self.kind = kind
        self.size = size
        self.detail = detail
        super().__init__(f"{printable(self.path, 300)}: {reason}")


def file_kind(mode: int) -> str:
    """``a FIFO``, ``a character device``, ``a block device``, ``a socket``, ``a directory`` or
    ``not a regular file``, for an ``st_mode``."""
    for test, kind in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory")):
        if test(mode):
            return kind
    return "not a regular file"


def human_size(n: int) -> str:
    """``1 MiB``, ``256 MiB``, ``64 GiB``, ``512 KiB``, ``100 B`` (whole units where they are)."""
    for shift, unit in ((40, "TiB"), (30, "GiB"), (20, "MiB"), (10, "KiB")):
        if n >= 1 << shift:
            value = n / (1 << shift)
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.1f} {unit}"
    return f"{n} B"


def os_reason(exc: OSError) -> str:
    """The one-line reason of an ``OSError`` (its ``strerror``, else its class)."""
    return exc.strerror or exc.__class__.__name__


def open_regular(path: str | Path, limit: int, what: str) -> tuple[BinaryIO, int]:
    """``(binary file, size)`` of ``path`` when it is a regular file (links followed) of at most
    ``limit`` bytes; :class:`FileRefused` otherwise, before anything is read. ``what`` names the
    expected content in the reasons (``a .npy file``). The caller closes the file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise FileRefused(path, MISSING, "no such file") from None
    except IsADirectoryError:
        raise FileRefused(path, DIRECTORY, f"is a directory, not {what}") from None
    except OSError as exc:  # a socket cannot be opened at all (ENXIO): say what it is
        with contextlib.suppress(OSError):
            mode = os.stat(path).st_mode
            if not stat.S_ISREG(mode) and not stat.S_ISDIR(mode):
                kind = file_kind(mode)
                raise FileRefused(path, SPECIAL, f"is {kind}, not a regular file ({what} is a file)", kind=kind) from None
        raise FileRefused(path, UNREADABLE, f"cannot read ({os_reason(exc)})", detail=os_reason(exc)) from None
    try:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            raise FileRefused(path, DIRECTORY, f"is a directory, not {what}")
        if not stat.S_ISREG(info.st_mode):
            kind = file_kind(info.st_mode)
            raise FileRefused(path, SPECIAL, f"is {kind}, not a regular file ({what} is a file)", kind=kind)
        if info.st_size > limit:
            raise FileRefused(
                path, TOO_LARGE, f"is {info.st_size:,} bytes, more than the {human_size(limit)} {what} may have", size=info.st_size
            )
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~os.O_NONBLOCK)
        handle = os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    return handle, int(info.st_size)


def read_regular(path: str | Path, limit: int, what: str) -> bytes:
    """The bytes of ``path`` (see :func:`open_regular`); a file that grew past ``limit`` while it
    was read is refused too."""
    handle, _size = open_regular(path, limit, what)
    with handle:
        try:
            raw = handle.read(limit + 1)
        except OSError as exc:
            raise FileRefused(path, UNREADABLE, f"cannot read ({os_reason(exc)})", detail=os_reason(exc)) from None
    if len(raw) > limit:  # it grew after the fstat
        raise FileRefused(path, TOO_LARGE, f"is more than the {human_size(limit)} {what} may have")
    return raw


def check_regular(path: str | Path, limit: int, what: str) -> int:
    """The size of ``path`` when :func:`open_regular` would read it (for readers that take a path:
    ``torch.load``, ``numpy.load`` with a memory map); :class:`FileRefused` otherwise."""
    handle, size = open_regular(path, limit, what)
    handle.close()
    return size


# --------------------------------------------------------------------------------------
# outputs
# --------------------------------------------------------------------------------------


def check_output_path(path: str | Path) -> str | None:
    """Why ``path`` must not be written by renaming a file over it, or None: it exists (links
    followed) and is a device, a FIFO or a socket. A missing path, a regular file and a dangling
    link are fine."""
    try:
        info = os.stat(path)
    except OSError:
        return None
    if stat.S_ISREG(info.st_mode) or stat.S_ISDIR(info.st_mode):
        return None
    return (
        f"is {file_kind(info.st_mode)}; bevcompile writes a file by renaming a new one over the path, which would replace "
        "it: give a regular file name"
    )


def replace_file(tmp: str | Path, target: str | Path) -> None:
    """``os.replace(tmp, target)`` unless ``target`` became a device, FIFO or socket since it was
    checked (:class:`FileRefused`; ``tmp`` is left for the caller to remove)."""
    why = check_output_path(target)
    if why is not None:
        raise FileRefused(target, SPECIAL, why)
    os.replace(tmp, target)


# --------------------------------------------------------------------------------------
# strict JSON
# --------------------------------------------------------------------------------------

MAX_JSON_DEPTH = 64
"""JSON nested deeper than this is refused before it is parsed (a store's deepest attribute, the
stored config, is 6 levels; Python's parser would raise RecursionError near 1,000)."""
MAX_INT_DIGITS = 4300
"""Python converts no longer decimal integer (``sys.get_int_max_str_digits``)."""


class JSONRefused(ValueError):
    """JSON that is not read (one-line reason)."""


_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)


def json_depth(raw: bytes) -> int:
    """The deepest nesting of ``[`` / ``{`` in JSON text ``raw`` (strings skipped), without
    parsing it: numpy over the bytes, so a megabyte of ``[`` costs milliseconds."""
    import numpy as np

    if b"[" not in raw and b"{" not in raw:
        return 0
    text = np.frombuffer(_STRING.sub(b'""', raw), dtype=np.uint8)
    step = ((text == ord("[")) | (text == ord("{"))).astype(np.int64) - ((text == ord("]")) | (text == ord("}"))).astype(np.int64)
    return int(np.cumsum(step).max()) if step.size else 0


def object_depth(value: Any) -> int:
    """The nesting depth of parsed JSON (lists and dicts), iteratively (no recursion)."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            deepest = max(deepest, depth)
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            deepest = max(deepest, depth)
            stack.extend((v, depth + 1) for v in item)
    return deepest


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise JSONRefused(f"duplicate key {shown(key)}")
        out[key] = value
    return out


def _no_constant(name: str) -> Any:
    raise JSONRefused(f"{name}: strict JSON has no NaN or Infinity")


def _finite_float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise JSONRefused(f"the number {shown(text)} overflows a float64")
    return value


def _bounded_int(text: str) -> int:
    digits = len(text.lstrip("-"))
    if digits > MAX_INT_DIGITS:
        raise JSONRefused(f"an integer of {digits:,} digits, more than {MAX_INT_DIGITS:,}")
    return int(text)


def strict_decoder() -> json.JSONDecoder:
    """A decoder refusing NaN/Infinity, overflowing floats, over-long integers and duplicate keys
    (:class:`JSONRefused`); nesting is the caller's (:func:`raw_decode_strict`, :func:`loads_strict`)."""
    return json.JSONDecoder(object_pairs_hook=_unique_keys, parse_constant=_no_constant, parse_float=_finite_float, parse_int=_bounded_int)


def raw_decode_strict(decoder: json.JSONDecoder, text: str, pos: int, max_depth: int = MAX_JSON_DEPTH) -> tuple[Any, int]:
    """``decoder.raw_decode(text, pos)`` of a :func:`strict_decoder`, nesting bounded:
    :class:`JSONRefused` for a value nested deeper than ``max_depth`` (also one Python's own
    parser cannot hold), :class:`json.JSONDecodeError` as usual for invalid JSON."""
    try:
        value, end = decoder.raw_decode(text, pos)
    except RecursionError:
        raise JSONRefused(f"nested more than {max_depth} levels deep") from None
    if object_depth(value) > max_depth:
        raise JSONRefused(f"nested more than {max_depth} levels deep")
    return value, end


def loads_strict(raw: bytes | str, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Parse strict JSON (module docstring); :class:`JSONRefused` with a one-line reason."""
    if isinstance(raw, str):
        if raw.startswith("\ufeff"):
            raise JSONRefused("starts with a byte-order mark (BOM): JSON is UTF-8 without one")
        data = raw.encode("utf-8", "surrogatepass")
    else:
        data = bytes(raw)
        if data.startswith(b"\xef\xbb\xbf"):
            raise JSONRefused("starts with a byte-order mark (BOM): JSON is UTF-8 without one")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise JSONRefused(f"not UTF-8 (byte 0x{data[exc.start : exc.start + 1].hex()} at offset {exc.start:,})") from None
    depth = json_depth(data)
    if depth > max_depth:
        raise JSONRefused(f"nested {depth:,} levels deep, more than {max_depth}")
    try:
        value, end = strict_decoder().raw_decode(text, len(text) - len(text.lstrip()))
    except json.JSONDecodeError as exc:
        raise JSONRefused(f"not JSON ({exc.msg}: line {exc.lineno}, column {exc.colno})") from None
    except RecursionError:  # not reached after the depth scan; kept for safety
        raise JSONRefused(f"nested more than {max_depth} levels deep") from None
    if text[end:].strip():
        raise JSONRefused(f"not JSON (extra data after the value: line {text.count(chr(10), 0, end) + 1})")
    return value


def load_json_file(path: str | Path, limit: int, what: str, refuse: Callable[[str], Exception]) -> Any:
    """Strict JSON of a regular file of at most ``limit`` bytes; ``refuse(reason)`` builds the
    caller's error for a refused file or document."""
    try:
        return loads_strict(read_regular(path, limit, what))
    except FileRefused as exc:
        raise refuse(exc.reason) from None
    except JSONRefused as exc:
        raise refuse(str(exc)) from None
