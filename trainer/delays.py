"""Injected slowness that lands where the work runs: the GPU stream on CUDA, the host on CPU.

On a GPU the host runs ahead of the device, so host time says nothing about how long the
device worked, and a host sleep only delays the enqueueing, which a queue of launched work
hides. So a fault's delay is a busy-wait kernel on the stream (`torch.cuda._sleep`), sized
from the device time of the same work measured by CUDA events read once passed (no sync).
"""

import statistics
import time
from collections import deque

import torch


class Delay:
    """Waits of a given length on the current stream (CUDA) or the host (CPU)."""

    def __init__(self, cuda: bool):
        self._cuda = cuda
        self._cycles_per_s = 0.0  # timed at the first delay: a job without faults never syncs for it

    def __call__(self, seconds: float) -> None:
        if seconds <= 0:
            return
        if not self._cuda:
            time.sleep(seconds)
            return
        self._cycles_per_s = self._cycles_per_s or _sleep_rate()
        torch.cuda._sleep(int(seconds * self._cycles_per_s))


def _sleep_rate() -> float:
    """Cycles of `torch.cuda._sleep` per second on this GPU, timed once (a sync, at setup only)."""
    cycles = 10_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(cycles // 10)  # warm-up: the first launch loads the kernel
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / (start.elapsed_time(end) / 1e3)


class WorkTime:
    """How long a recurring stretch of work last took where it ran, less the delay injected into it:
    CUDA events on the stream, read once passed; host clock readings on CPU. Stretches may overlap
    (gradient buckets): `start` returns the mark that `stop` takes."""

    def __init__(self, cuda: bool):
        self._cuda = cuda
        self._pending: deque = deque()  # (start, end, injected s), oldest first
        self._recent: deque[float] = deque(maxlen=16)
        self.last_s: float | None = None

    def start(self):
        return self._mark()

    def stop(self, start, injected_s: float = 0.0) -> None:
        self._pending.append((start, self._mark(), injected_s))
        while self._pending and (not self._cuda or self._pending[0][1].query()):
            a, b, injected = self._pending.popleft()
            took = a.elapsed_time(b) / 1e3 if self._cuda else b - a
            self.last_s = max(took - injected, 0.0)
            self._recent.append(self.last_s)

    @property
    def typical_s(self) -> float:
        """The median of the last 16 stretches (0 before the first): a collective that waited for a late
        or hung peer does not size the next delay."""
        return statistics.median(self._recent) if self._recent else 0.0

    def _mark(self):
        if not self._cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
