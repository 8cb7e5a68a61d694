"""The rank's process and its host, read from /proc: CPU the rank gets, memory in use, and how long the
host's tasks stalled for CPU, memory and I/O (Linux PSI). A step's compute time depends on them where
the rank shares its host (data loaders, a checkpoint being written, another job), and a prediction of
step time from device state alone would miss them.

Read at most every `every_s` (a few files, ~50 µs), whatever the sampler's period; a file the kernel
lacks (no PSI before 4.20, or outside Linux) is left out, once logged.
"""

import os
import time
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path

from agent import semconv as sc
from agent.devices import Reading
from agent.export import log

PROC = Path("/proc")
_PRESSURES = {"cpu": sc.PRESSURE_CPU, "memory": sc.PRESSURE_MEMORY, "io": sc.PRESSURE_IO}
_ATTRIBUTES = {sc.SOURCE: sc.SOURCE_HOST}


def _stalled_us(text: str) -> int:
    """The `some` line's total: microseconds some task stalled, since boot."""
    some = text.split("\n", 1)[0]
    return int(some.rsplit("total=", 1)[1])


def _memory_used(text: str) -> float:
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    total, available = int(fields["MemTotal"].split()[0]), int(fields["MemAvailable"].split()[0])
    return 1 - available / total


class HostState:
    """`read()` gives the rank's CPU utilization, the host's memory in use and its PSI stall shares."""

    def __init__(self, root: Path = PROC, every_s: float = 1.0, clock_ns: Callable[[], int] = time.monotonic_ns):
        self._root, self._every_ns, self._clock_ns = root, int(every_s * 1e9), clock_ns
        self._cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        self._files = {name: root / "pressure" / name for name in _PRESSURES}
        self._last_ns = clock_ns()
        self._last = self._counters()

    def _counters(self) -> dict[str, float]:
        """Monotonic counters: the process's CPU seconds, each PSI file's stalled microseconds."""
        counters = {"cpu_s": time.process_time()}
        for name, path in list(self._files.items()):
            try:
                counters[name] = _stalled_us(path.read_text())
            except (OSError, ValueError, IndexError) as e:
                log.info("rankwatch: %s not readable (%s); no %s pressure from it", path, e, name)
                del self._files[name]
        return counters

    def read(self) -> list[Reading]:
        now = self._clock_ns()
        if now - self._last_ns < self._every_ns:
            return []
        counters = self._counters()
        seconds = (now - self._last_ns) / 1e9
        readings: list[Reading] = [
            (sc.PROCESS_CPU_UTIL, (counters["cpu_s"] - self._last["cpu_s"]) / seconds / self._cpus, _ATTRIBUTES)
        ]
        readings.extend(
            (_PRESSURES[name], (counters[name] - self._last[name]) / 1e6 / seconds, _ATTRIBUTES)
            for name in self._files
            if name in self._last
        )
        with suppress(OSError, KeyError, ValueError):
            readings.append((sc.SYSTEM_MEMORY_UTIL, _memory_used((self._root / "meminfo").read_text()), _ATTRIBUTES))
        self._last_ns, self._last = now, counters
        return readings
