"""The collector's child processes (decode workers, the writer) end when it does, and its
processes give freed memory back to the system.

Without the first a `kill -9` of the collector would leave its writer holding the
store's lock, and a restart would find the store "held open". Without the second,
glibc keeps what a burst of large requests freed: it raises its mmap threshold
each time a large block is freed, so later large blocks come from heaps that it
seldom shrinks (the collector stayed at 4.9 GB once a flood was over).
"""

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
_MMAP_THRESHOLD = 2**20  # blocks this large get mappings of their own, unmapped when freed


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
    decoded copies, large blocks, are unmapped as soon as they are freed."""
    if (libc := _glibc()) is not None:
        libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)


def return_memory() -> None:
    """Hand the free pages of every malloc arena back to the system (after a large piece of work)."""
    if (libc := _glibc()) is not None:
        libc.malloc_trim(0)
