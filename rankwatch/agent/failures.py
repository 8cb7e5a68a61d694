"""A rank's end other than a clean one, told before it goes.

An exception that reaches the top of the process (Ctrl-C, and SIGTERM where the script takes it as
Ctrl-C as the reference trainer does, among them) or an `os._exit` with a nonzero code becomes one
`rank_failed` event (rankwatch/agent/semconv.py) with its cause, the step the rank was in and, for an exception,
its stack; then the session shuts down, handing over (or exporting) what the rank recorded. What ends
a rank without a word (SIGKILL, a crash, a SIGTERM left at its default) is told by its node's sidecar
(rankwatch/agent/node.py), which sees its link close without a goodbye. SIGTERM is not taken here: a Python
handler runs only once the main thread is back in the interpreter, and a rank blocked in a collective
whose peer died would then wait out torchrun's grace period for SIGKILL instead of ending at once.

`Watch` chains `sys.excepthook` and wraps `os._exit` for this process alone (a forked child, a data
loader's worker, exits as before). Telling cannot hang the rank's end: the shutdown runs on a thread of
its own, waited for SHUTDOWN_S at most. `close()` puts both back.
"""

import logging
import os
import re
import sys
import threading
import traceback
from collections.abc import Callable
from typing import NoReturn

from rankwatch.agent import semconv as sc

log = logging.getLogger("rankwatch.agent")

SHUTDOWN_S = 5.0  # how long a failing rank waits for its telemetry to be handed over
MAX_STACK_CHARS = 16_384  # the stack's end, where the failure is
RESTART_ENV = "TORCHELASTIC_RESTART_COUNT"  # torchrun's count of the workers' restarts
# what a collective raises when a peer died (gloo's "Connection closed by peer", NCCL's aborted communicator)
_PEER_GONE = re.compile(
    r"(closed|reset) by peer|remote (process|worker) (exited|crashed)|communicator was aborted|broken pipe",
    re.IGNORECASE,
)


def attempt() -> int:
    """Which attempt of the job this process is (torchrun's restarts; 0 without torchrun)."""
    try:
        return int(os.environ.get(RESTART_ENV, 0))
    except ValueError:
        return 0


def attempted() -> dict[str, int]:
    """The resource attribute of the attempt, under torchrun (which counts its workers' restarts)."""
    return {sc.ATTEMPT: attempt()} if RESTART_ENV in os.environ else {}


def cause_of(error: BaseException) -> str:
    """Out of memory (torch's OutOfMemoryError, MemoryError, an error saying so); stopped with the job
    (Ctrl-C, SIGTERM where the script takes it as Ctrl-C, or a collective raising as a peer's connection
    closed: the job failed elsewhere first); or another exception."""
    if isinstance(error, MemoryError) or type(error).__name__ == "OutOfMemoryError":
        return sc.CAUSE_OUT_OF_MEMORY
    if isinstance(error, KeyboardInterrupt) or _PEER_GONE.search(str(error)[:2000]):
        return sc.CAUSE_TERMINATED
    if "out of memory" in str(error)[:500].lower():  # a RuntimeError from an older torch, or NCCL's
        return sc.CAUSE_OUT_OF_MEMORY
    return sc.CAUSE_EXCEPTION


class Watch:
    """Tells `fail(cause, body, attributes)` how the process ends, then calls `shutdown()`."""

    def __init__(self, fail: Callable[[str, str, dict], None], shutdown: Callable[[], None]):
        self._fail, self._shutdown = fail, shutdown
        self._pid = os.getpid()
        self._told = threading.Lock()
        self._hook = sys.excepthook
        sys.excepthook = self._excepthook
        self._exit = os._exit
        os._exit = self._os_exit

    def close(self) -> None:
        """Put back what was taken (where nothing replaced it since)."""
        if sys.excepthook == self._excepthook:
            sys.excepthook = self._hook
        if os._exit == self._os_exit:
            os._exit = self._exit

    def _tell(self, cause: str, body: str, **attributes) -> None:
        """Once, in this process: the event, then the shutdown, bounded."""
        if os.getpid() != self._pid or not self._told.acquire(blocking=False):
            return
        try:
            self._fail(cause, body, {sc.FAILURE_CAUSE: cause, sc.ATTEMPT: attempt(), **attributes})
        except Exception:  # the rank's end goes on whatever telling it met
            log.exception("rankwatch: telling this rank's failure failed")
        finally:
            self._end()

    def _end(self) -> None:
        """The session's shutdown, waited for SHUTDOWN_S at most (the failure may have struck inside the
        agent, holding a lock the shutdown takes)."""
        ending = threading.Thread(target=self._shutdown, name="rankwatch-ending", daemon=True)
        ending.start()
        ending.join(SHUTDOWN_S)

    def _excepthook(self, kind, error, tb) -> None:
        self._hook(kind, error, tb)  # the traceback printed first, as without the agent
        stack = "".join(traceback.format_exception(kind, error, tb))[-MAX_STACK_CHARS:]
        self._tell(
            cause_of(error),
            stack,
            **{sc.FAILURE_EXCEPTION: f"{kind.__module__}.{kind.__qualname__}", sc.FAILURE_MESSAGE: str(error)[:1000]},
        )

    def _os_exit(self, status: int) -> NoReturn:
        if status:
            self._tell(sc.CAUSE_EXIT, f"exited with code {status}", **{sc.FAILURE_EXIT_CODE: int(status)})
        elif os.getpid() == self._pid:  # a clean end that skips the exit hooks: what is recorded still goes
            self._end()
        self._exit(status)
