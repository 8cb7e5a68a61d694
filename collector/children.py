"""The collector's child processes (decode workers, the writer) end when it does.

Without this a `kill -9` of the collector would leave its writer holding the
store's lock, and a restart would find the store "held open".
"""

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Ask Linux to kill this process when its parent exits; then check it has not already."""
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)
