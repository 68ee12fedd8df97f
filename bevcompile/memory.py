"""The memory guard: refuse, before any work, a build that cannot fit what this process may use.

The kernel's OOM killer ends a process without a message or cleanup, and an address-space limit
(``ulimit -v``) turns a late allocation into a ``MemoryError`` half way through, so every command
that can allocate in proportion to its input estimates its peak first and refuses with one line
(:class:`~bevcompile.errors.UsageError`, exit 2) when it exceeds the memory this process may
really use: the smallest of the available memory (``MemAvailable``, plus what the process
already holds), the address-space limit ``RLIMIT_AS`` (less the address space already mapped
beyond the resident set) and the cgroup's memory limit (v2 ``memory.max`` or v1
``memory.limit_in_bytes``, less what the cgroup already uses, plus this process's share).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .errors import UsageError

CGROUP_ROOT = Path("/sys/fs/cgroup")


@dataclass(frozen=True)
class MemoryLimit:
    """What this process may still bring its resident memory up to, and what sets that bound."""

    bytes: int
    what: str  # "available memory", "the address-space limit (RLIMIT_AS)", "the cgroup memory limit"


def physical_memory_bytes() -> int | None:
    """This machine's physical memory (None where the OS does not say)."""
    import os

    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):
        return None


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _status_kib(field: str) -> int | None:
    text = _read(Path("/proc/self/status")) or ""
    for line in text.splitlines():
        if line.startswith(f"{field}:"):
            try:
                return int(line.split()[1]) * 1024
            except (IndexError, ValueError):
                return None
    return None


def peak_rss_bytes() -> int:
    """This process's peak resident set, in bytes, since it started running its program.

    ``VmHWM`` of ``/proc/self/status`` (Linux): the high-water mark of this process image's own
    address space, which ``exec`` starts afresh. Not ``getrusage(...).ru_maxrss``: Linux carries
    that across ``fork`` and ``exec``, so a command started by a big process (a test runner, a
    notebook, a build server) reported its parent's peak (1.0 GiB for a 105 MiB build in CI).
    Where there is no ``/proc`` it falls back to ``ru_maxrss`` (KiB on Linux, bytes on macOS).
    """
    hwm = _status_kib("VmHWM")
    if hwm is not None:
        return hwm
    import resource
    import sys

    maxrss = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    return maxrss if sys.platform == "darwin" else maxrss * 1024


def _meminfo_available() -> int | None:
    for line in (_read(Path("/proc/meminfo")) or "").splitlines():
        if line.startswith("MemAvailable:"):
            try:
                return int(line.split()[1]) * 1024
            except (IndexError, ValueError):
                return None
    return None


def _cgroup_limit(rss: int) -> int | None:
    """This process's room under its cgroup's memory limit (None: no limit, or not readable)."""
    text = _read(Path("/proc/self/cgroup")) or ""
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, rel = parts
        if hierarchy == "0" and controllers == "":  # cgroup v2
            folder = CGROUP_ROOT / rel.lstrip("/")
            limit, usage = _read(folder / "memory.max"), _read(folder / "memory.current")
        elif "memory" in controllers.split(","):  # cgroup v1
            folder = CGROUP_ROOT / "memory" / rel.lstrip("/")
            limit, usage = _read(folder / "memory.limit_in_bytes"), _read(folder / "memory.usage_in_bytes")
        else:
            continue
        try:
            max_bytes, used = int((limit or "").strip()), int((usage or "").strip())
        except ValueError:
            continue  # "max": no limit
        if max_bytes >= 1 << 60:  # v1 writes "no limit" as a huge number
            continue
        return max(0, max_bytes - used) + rss
    return None


def memory_limit() -> MemoryLimit | None:
    """The smallest bound on this process's resident memory (None where none can be read)."""
    import resource

    rss = _status_kib("VmRSS") or 0
    found: list[MemoryLimit] = []
    available = _meminfo_available()
    if available is not None:
        found.append(MemoryLimit(available + rss, "available memory"))
    else:
        physical = physical_memory_bytes()
        if physical is not None:
            found.append(MemoryLimit(physical, "this machine's memory"))
    try:
        soft, _hard = resource.getrlimit(resource.RLIMIT_AS)
    except (ValueError, OSError):
        soft = resource.RLIM_INFINITY
    if soft != resource.RLIM_INFINITY:
        mapped = _status_kib("VmSize") or rss
        found.append(MemoryLimit(max(0, soft - (mapped - rss)), "the address-space limit (RLIMIT_AS, ulimit -v)"))
    cgroup = _cgroup_limit(rss)
    if cgroup is not None:
        found.append(MemoryLimit(cgroup, "the cgroup memory limit"))
    return min(found, key=lambda limit: limit.bytes) if found else None


def refuse_beyond_memory(need: int, what: str, remedy: str) -> None:
    """:class:`UsageError` ``"<what> needs about <need>, more than the <have> <limit> allows; <remedy>"``
    when the estimated peak ``need`` (bytes, the whole process) exceeds :func:`memory_limit`."""
    limit = memory_limit()
    if limit is not None and need > limit.bytes:
        raise UsageError(f"{what} needs about {_size(need)}, more than the {_size(limit.bytes)} {limit.what} allows; {remedy}")


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
