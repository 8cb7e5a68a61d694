"""Device samples in the background, and the energy of any stretch of time.

A thread reads the readers (the rank's GPU, its process and host, the RAPL zones,
the InfiniBand ports) every `period_s` (a reader may read less often: it then gives
nothing), stamps their readings with the agent's clock and hands them over
about every `flush_s` to a second thread, which passes them to `emit`
(`Exporter.samples`): a slow or absent collector never delays sampling, and
when batches pile up the oldest are dropped. Each GPU's energy counter is kept
for the last `keep_s`, so that `energy_between` can give a step its energy (a
rank's sampler reads one GPU; a node sidecar's, rankwatch/agent/nodesampler.py, every
GPU its ranks named, told apart by their `gpu` attribute).
"""

import logging
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
from rankwatch.agent.spanwire import Attributes

log = logging.getLogger("rankwatch.agent")

Point = tuple[str, int, float, Attributes]  # metric, time ns, value, attributes: Exporter.samples' shape
STUCK_NS = 10**9  # a sampler this late is not waited for
GPU_SAMPLE_S = 0.1  # the period where a GPU is read: a step's energy waits for the sample after its end
HOST_SAMPLE_S = 1.0  # where none is: nothing waits for it, and the host's readings change once a second (host.py)


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
        name: str = "rankwatch-sampler",
    ):
        """`on_sample`: called after each sample (the agent emits the steps it held for their energy); `name`: the
        sampling thread's."""
        self._readers, self._emit, self._now_ns, self._on_sample = list(readers), emit, now_ns, on_sample
        self._period_s, self._flush_s, self._keep_s = period_s, flush_s, keep_s
        self._keep = max(int(keep_s / period_s), 2)
        self._reading = threading.Lock()  # held while the readers are read: one taken out is read no more
        self._energy: dict[object, list[tuple[int, float]]] = {}  # `gpu` -> (time ns, J) of its counter, oldest first
        self._last_ns: int | None = None  # the latest sample's time
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()  # a sample now: stopping, readers added, or a flush asked for
        self._flushes: queue.SimpleQueue[threading.Event] = queue.SimpleQueue()  # each set once `emit` had it all
        # batches; a flush's event, after the batch it waits for; None: the end
        self._outbox: queue.Queue[list[Point] | threading.Event | None] = queue.Queue(max_batches)
        self._failing: set[int] = set()  # readers (by id) whose failure is logged
        self._emit_failed = False  # and whether emit's is
        self.dropped = 0  # points that never reached `emit`, or that it refused
        self._sampling = threading.Thread(target=self._sample, name=name, daemon=True)
        self._sending = threading.Thread(target=self._send, name="rankwatch-samples-export", daemon=True)

    def start(self) -> "Sampler":
        self._sending.start()
        self._sampling.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """Take a last sample, hand over what is left, and join both threads (up to `timeout_s`
        each: an export stuck on the network is left behind)."""
        self._stop.set()
        self._wake.set()
        self._sampling.join(timeout_s)
        self._sending.join(timeout_s)

    def add(self, readers: Sequence[Reader], period_s: float | None = None) -> None:
        """Read `readers` too from the next sample on, and every `period_s` from the next tick on where given
        (what a node's sidecar read for the rank until it went away; a GPU the sidecar's ranks named). The next
        sample is taken at once: a step begun now finds the new GPU's energy counter read before it."""
        with self._reading:
            self._readers = [*self._readers, *readers]
            if period_s is not None:
                self._period_s, self._keep = period_s, max(int(self._keep_s / period_s), 2)
        self._wake.set()

    def remove(self, readers: Sequence[Reader]) -> None:
        """Read `readers` no more: once this returns, none of them is being read (the caller may close them)."""
        with self._reading:
            self._readers = [reader for reader in self._readers if not any(reader is r for r in readers)]
            self._failing -= {id(reader) for reader in readers}

    def flush(self, timeout_s: float = 5.0) -> None:
        """Sample now, hand over all that was sampled, and wait (up to `timeout_s`) until `emit` had it: a node's
        sidecar exports a leaving rank's last samples before it forgets the rank."""
        if not self._sampling.is_alive():
            return
        done = threading.Event()
        self._flushes.put(done)
        self._wake.set()
        done.wait(timeout_s)

    def energy_between(self, t0_ns: int, t1_ns: int, gpu: object = None) -> float | None:
        """Joules GPU `gpu` (its `gpu` attribute; None: the one GPU read) used from t0 to t1: its
        energy counter, interpolated linearly between the samples around each end. None when the
        samples do not reach both ends (no counter, before the first sample, past the latest, older
        than `keep_s`)."""
        with self._lock:
            counter = self._energy.get(gpu) if gpu is not None else next(iter(self._energy.values()), None)
            if not counter or t0_ns < counter[0][0] or t1_ns > counter[-1][0]:
                return None
            return _energy_at(counter, t1_ns) - _energy_at(counter, t0_ns)

    def covers(self, t_ns: int) -> bool:
        """Whether `energy_between` can already say all it will about an interval ending at
        `t_ns`: a sample at or after it exists, or none will come (the sampler stopped, or is a
        second late). The agent holds a step's span until then."""
        with self._lock:
            last = self._last_ns
        return (last is not None and last >= t_ns) or not self._sampling.is_alive() or self._now_ns() - t_ns > STUCK_NS

    def _read_all(self) -> list[Point]:
        """One sample of every reader, stamped now; a failing reader is skipped (and logged once)."""
        now = self._now_ns()
        points: list[Point] = []
        with self._reading:
            for reader in self._readers:
                try:
                    points += [(metric, now, float(value), attributes) for metric, value, attributes in reader.read()]
                except Exception:  # whatever one reader raises, the others are still read
                    if id(reader) not in self._failing:
                        self._failing.add(id(reader))
                        log.exception("rankwatch: reading %s failed; skipped while it fails", type(reader).__name__)
        energy = {attributes.get(sc.GPU): value for metric, _, value, attributes in points if metric == sc.ENERGY_J}
        with self._lock:
            self._last_ns = now
            for gpu, joules in energy.items():
                counter = self._energy.setdefault(gpu, [])
                counter.append((now, joules))
                if len(counter) > 2 * self._keep:
                    del counter[: -self._keep]
        return points

    def _sample(self) -> None:
        batch: list[Point] = []
        next_tick = next_flush = time.monotonic()
        while True:
            early = self._wake.wait(max(next_tick - time.monotonic(), 0.0))
            self._wake.clear()
            stopping = self._stop.is_set()
            batch += self._read_all()
            self._on_sample()
            now = time.monotonic()
            flushes = [self._flushes.get() for _ in range(self._flushes.qsize())]
            if (stopping or flushes or now >= next_flush) and batch:
                self._hand_over(batch)
                batch, next_flush = [], now + self._flush_s
            for done in flushes:
                self._hand_over(done)
            if stopping:
                self._hand_over(None)
                return
            if not early:  # (a sample taken early leaves the ticks where they were)
                next_tick = max(next_tick + self._period_s, now)  # ticks missed while reading are skipped

    def _hand_over(self, batch: list[Point] | threading.Event | None) -> None:
        """Queue a batch (a flush's event; None: the end) for the export thread, dropping the oldest when full."""
        while True:
            try:
                self._outbox.put_nowait(batch)
                return
            except queue.Full:
                with suppress(queue.Empty):
                    dropped = self._outbox.get_nowait()
                    if isinstance(dropped, threading.Event):
                        dropped.set()  # (the flush is let go: the batches before it are dropped)
                    else:
                        self._count_dropped(len(dropped or ()))

    def _send(self) -> None:
        while (batch := self._outbox.get()) is not None:
            if isinstance(batch, threading.Event):  # a flush: everything before it was emitted
                batch.set()
                continue
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


def _energy_at(counter: list[tuple[int, float]], t_ns: int) -> float:
    """The counter at `t_ns`, interpolated between the samples around it (within the samples)."""
    i = bisect_left(counter, t_ns, key=itemgetter(0))
    t1, e1 = counter[i]
    if t1 == t_ns:
        return e1
    t0, e0 = counter[i - 1]
    return e0 + (e1 - e0) * (t_ns - t0) / (t1 - t0)
