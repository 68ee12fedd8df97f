"""The memory guard: refuse, before any work, a build that cannot fit this machine.

The kernel's OOM killer ends a process without a message or cleanup, so every command that
can allocate in proportion to its input estimates its peak first and refuses with one line
(:class:`~bevcompile.errors.UsageError`, exit 2) when it exceeds the memory there is.
"""

from __future__ import annotations

from .errors import UsageError


def physical_memory_bytes() -> int | None:
    """This machine's physical memory (None where the OS does not say)."""
    import os

    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):
        return None


def refuse_beyond_memory(need: int, what: str, remedy: str) -> None:
    """:class:`UsageError` ``"<what> needs about <need>, more than this machine's <have>; <remedy>"``
    when the estimated peak ``need`` (bytes) exceeds the physical memory (the kernel's OOM killer
    would otherwise end the process without a message or cleanup)."""
    have = physical_memory_bytes()
    if have is not None and need > have:
        raise UsageError(f"{what} needs about {_size(need)}, more than this machine's {_size(have)}; {remedy}")


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:,.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:,.0f} MiB"


def release_free_memory() -> None:
    """Hand the memory the allocator holds free back to the OS (glibc ``malloc_trim``; a no-op
    elsewhere). Called between the phases of a streamed build: the peak of one phase's
    temporaries (in several threads' arenas) would otherwise stay resident through the next."""
    import contextlib
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):  # pragma: no cover - glibc only
        return
    with contextlib.suppress(OSError, AttributeError):  # musl, or no libc.so.6
        ctypes.CDLL("libc.so.6").malloc_trim(0)
