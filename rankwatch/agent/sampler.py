"""Device samples in the background, and the energy of any stretch of time.

A thread reads the readers (the rank's GPU, its process and host, the RAPL zones,
the InfiniBand ports) every `period_s` (a reader may read less often: it then gives
nothing), stamps their readings with the agent's clock and hands them over
about every `flush_s` to a second thread, which passes them to `emit`
(`Exporter.samples`): a slow or absent collector never delays sampling, and
when batches pile up the oldest are dropped. The GPU's energy counter is kept
for the last `keep_s`, so that `energy_between` can give a step its energy.
"""

import queue
import threading
import time
from bisect import bisect_left
from collections.abc import Callable, Sequence
from contextlib import suppress
from operator import itemgetter
from typing import Protocol

from rankwatch.agent import semconv as sc
from rankwatch.agent.devices import Reading
from rankwatch.agent.export import Attributes, log

Point = tuple[str, int, float, Attributes]  # metric, time ns, value, attributes: Exporter.samples' shape
STUCK_NS = 10**9  # a sampler this late is not waited for


class Reader(Protocol):
    def read(self) -> list[Reading]: ...


class Sampler:
    """Reads `readers` every `period_s` once started, until stopped. `now_ns` is the time base of
    the samples and of `energy_between` (the agent's clock, so they line up with its spans)."""

    def __init__(
        self,
        readers: Sequence[Reader],
        emit: Callable[[list[Point]], object],
        period_s: float = 0.1,
        flush_s: float = 1.0,
        now_ns: Callable[[], int] = time.time_ns,
        keep_s: float = 600.0,
        max_batches: int = 60,
        on_sample: Callable[[], object] = lambda: None,
    ):
        """`on_sample`: called after each sample (the agent emits the steps it held for their energy)."""
        self._readers, self._emit, self._now_ns, self._on_sample = list(readers), emit, now_ns, on_sample
        self._period_s, self._flush_s = period_s, flush_s
        self._keep = max(int(keep_s / period_s), 2)
        self._energy: list[tuple[int, float]] = []  # (time ns, J) of the GPU's counter, oldest first
        self._last_ns: int | None = None  # the latest sample's time
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._outbox: queue.Queue[list[Point] | None] = queue.Queue(max_batches)
        self._failing: set[int] = set()  # readers (by position) whose failure is logged
        self._emit_failed = False  # and whether emit's is
        self.dropped = 0  # points that never reached `emit`, or that it refused
        self._sampling = threading.Thread(target=self._sample, name="rankwatch-sampler", daemon=True)
        self._sending = threading.Thread(target=self._send, name="rankwatch-samples-export", daemon=True)

    def start(self) -> "Sampler":
        self._sending.start()
        self._sampling.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """Take a last sample, hand over what is left, and join both threads (up to `timeout_s`
        each: an export stuck on the network is left behind)."""
        self._stop.set()
        self._sampling.join(timeout_s)
        self._sending.join(timeout_s)

    def energy_between(self, t0_ns: int, t1_ns: int) -> float | None:
        """Joules the GPU used from t0 to t1: its energy counter, interpolated linearly between
        the samples around each end. None when the samples do not reach both ends (no counter,
        before the first sample, past the latest, older than `keep_s`)."""
        with self._lock:
            if not self._energy or t0_ns < self._energy[0][0] or t1_ns > self._energy[-1][0]:
                return None
            return self._energy_at(t1_ns) - self._energy_at(t0_ns)

    def covers(self, t_ns: int) -> bool:
        """Whether `energy_between` can already say all it will about an interval ending at
        `t_ns`: a sample at or after it exists, or none will come (the sampler stopped, or is a
        second late). The agent holds a step's span until then."""
        with self._lock:
            last = self._last_ns
        return (last is not None and last >= t_ns) or not self._sampling.is_alive() or self._now_ns() - t_ns > STUCK_NS

    def _energy_at(self, t_ns: int) -> float:
        i = bisect_left(self._energy, t_ns, key=itemgetter(0))
        t1, e1 = self._energy[i]
        if t1 == t_ns:
            return e1
        t0, e0 = self._energy[i - 1]
        return e0 + (e1 - e0) * (t_ns - t0) / (t1 - t0)

    def _read_all(self) -> list[Point]:
        """One sample of every reader, stamped now; a failing reader is skipped (and logged once)."""
        now = self._now_ns()
        points: list[Point] = []
        for i, reader in enumerate(self._readers):
            try:
                points += [(metric, now, float(value), attributes) for metric, value, attributes in reader.read()]
            except Exception:  # whatever one reader raises, the others are still read
                if i not in self._failing:
                    self._failing.add(i)
                    log.exception("rankwatch: reading %s failed; skipped while it fails", type(reader).__name__)
        energy = [value for metric, _, value, _ in points if metric == sc.ENERGY_J]
        with self._lock:
            self._last_ns = now
            if energy:
                self._energy.append((now, energy[0]))
                if len(self._energy) > 2 * self._keep:
                    del self._energy[: -self._keep]
        return points

    def _sample(self) -> None:
        batch: list[Point] = []
        next_tick = next_flush = time.monotonic()
        while True:
            stopping = self._stop.wait(max(next_tick - time.monotonic(), 0.0))
            batch += self._read_all()
            self._on_sample()
            now = time.monotonic()
            if (stopping or now >= next_flush) and batch:
                self._hand_over(batch)
                batch, next_flush = [], now + self._flush_s
            if stopping:
                self._hand_over(None)
                return
            next_tick = max(next_tick + self._period_s, now)  # ticks missed while reading are skipped

    def _hand_over(self, batch: list[Point] | None) -> None:
        """Queue a batch (None: the end) for the export thread, dropping the oldest when full."""
        while True:
            try:
                self._outbox.put_nowait(batch)
                return
            except queue.Full:
                with suppress(queue.Empty):
                    self._count_dropped(len(self._outbox.get_nowait() or ()))

    def _send(self) -> None:
        while (batch := self._outbox.get()) is not None:
            try:
                accepted = self._emit(batch)
            except Exception:  # the export thread outlives a failed export
                if not self._emit_failed:
                    self._emit_failed = True
                    log.exception("rankwatch: exporting device samples failed; samples are dropped while it fails")
                accepted = False
            if accepted is False:
                self._count_dropped(len(batch))

    def _count_dropped(self, points: int) -> None:
        with self._lock:
            self.dropped += points
