"""The collector's child processes (decode workers, the writer) end when it does, its
processes give freed memory back to the system, and the writer's memory is capped.

Without the first a `kill -9` of the collector would leave its writer holding the
store's lock, and a restart would find the store "held open". Without the second,
glibc keeps what a burst of large requests freed: it raises its mmap threshold
each time a large block is freed, so later large blocks come from heaps that it
seldom shrinks (the collector stayed at 4.9 GB once a flood was over). The third
is for what DuckDB's memory limit does not count: a string a query builds
(`repeat('x', 2000000000)` grew the writer, which also commits ingest, by 3.7 GB).
"""

import ctypes
import os
import resource
import signal
import sys
from pathlib import Path

_PR_SET_PDEATHSIG = 1
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameters
_M_ARENA_MAX = -8
_MMAP_THRESHOLD = 2**20  # blocks this large get mappings of their own, unmapped when freed
# malloc arenas a process may have: each reserves 64 MiB of address space, which `cap_memory` counts,
# and glibc makes up to 8 per core, one for each thread that finds the others busy.
_ARENAS = 4
# Allocators that keep address space they are done with, which `cap_memory` would count for good, told
# to give it back: DuckDB's (its own jemalloc) keeps what it frees, for DuckDB alone to reuse (the writer
# kept 1.3 GB of it after `repeat('x', 900000000)`), and Arrow's default (mimalloc) reserves 1 GiB at its
# first allocation on a thread; Arrow on the system's malloc unmaps large blocks once freed (`bound_heap`).
# Both read the environment when they start, so a process sets it before spawning the children it caps.
RETURN_ADDRESS_SPACE = {"DUCKDB_JE_MALLOC_CONF": "retain:false", "ARROW_DEFAULT_MEMORY_POOL": "system"}


def die_with_parent() -> None:
    """Ask Linux to kill this process when its parent exits; then check it has not already."""
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def _glibc():
    """The C library, where it is glibc (whose malloc these tune), else None."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None)
    return libc if hasattr(libc, "malloc_trim") else None


def bound_heap() -> None:
    """Fix glibc's mmap threshold (setting it turns off its growth): request bodies and their
    decoded copies, large blocks, are unmapped as soon as they are freed. Called first thing in a
    process, before its threads take arenas of their own."""
    if (libc := _glibc()) is not None:
        libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)
        libc.mallopt(_M_ARENA_MAX, _ARENAS)


def cap_memory(headroom: int) -> None:
    """Cap this process's address space at what it maps now plus `headroom` bytes, so an allocation
    past it fails where it is made (DuckDB's Out of Memory, Python's MemoryError) instead of growing
    the process: the libraries are mapped by now, and what comes later is the work's own memory."""
    if not sys.platform.startswith("linux"):
        return
    mapped = int(Path("/proc/self/statm").read_text().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = mapped + headroom
    resource.setrlimit(resource.RLIMIT_AS, (cap if hard == resource.RLIM_INFINITY else min(cap, hard), hard))


def return_memory() -> None:
    """Hand the free pages of every malloc arena back to the system (after a large piece of work)."""
    if (libc := _glibc()) is not None:
        libc.malloc_trim(0)
