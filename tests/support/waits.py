"""Waiting for what other threads and processes do, as long as a loaded machine makes it take."""

import time
from collections.abc import Callable


def wait_until(condition: Callable[[], object], what: str, timeout_s: float = 30.0, every_s: float = 0.05) -> None:
    """Poll `condition` every `every_s` until it holds: what a background thread or process does takes as long
    as a loaded machine makes it take, so a test waits for it rather than sleeping a fixed time. A condition that
    costs a collector a query each time (a lake's: tens of milliseconds of CPU) is polled less often."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} (after {timeout_s:.0f} s)"
        time.sleep(every_s)
