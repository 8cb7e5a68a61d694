"""The rank's process and its host, read from /proc: what a step's time depends on outside the GPU
where the rank shares its host (data loaders, a checkpoint being written, swapping, another job).

Every rank reads its own process (CPU, storage I/O, major page faults) and its host's memory in use and
stall shares (Linux PSI): a rank's step-time features need them. The host's disks and dirty pages are
read once per host (`host_wide`): by its node's sidecar (rankwatch/agent/nodesampler.py, with `own` off: the
sidecar's process is no rank's), else by local rank 0; the collector gives them to every rank of the host.

Read at most every `every_s` (a few small files, ~100 µs), whatever the sampler's period; a file the
kernel lacks (no PSI before 4.20, or outside Linux) is left out, once logged.
"""

import logging
import os
import re
import time
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path

from rankwatch.agent import semconv as sc
from rankwatch.agent.devices import Reading

log = logging.getLogger("rankwatch.agent")

PROC, SYS_BLOCK = Path("/proc"), Path("/sys/block")
SECTOR = 512  # /proc/diskstats counts 512-byte sectors, whatever the disk's own
_PRESSURES = {"cpu": sc.PRESSURE_CPU, "memory": sc.PRESSURE_MEMORY, "io": sc.PRESSURE_IO}
_NOT_DISKS = re.compile(r"(loop|ram|zram|fd|sr)\d*$")  # block devices that hold no data of a job's
_ATTRIBUTES = {sc.SOURCE: sc.SOURCE_HOST}


def _stalled_us(text: str) -> int:
    """The `some` line's total: microseconds some task stalled, since boot."""
    return int(text.split("\n", 1)[0].rsplit("total=", 1)[1])


def _fields(text: str) -> dict[str, int]:
    """`name: value [kB]` lines (meminfo, /proc/self/io) as integers, kB as bytes."""
    out = {}
    for line in text.splitlines():
        name, _, value = line.partition(":")
        words = value.split()
        if words and words[0].isdigit():
            out[name.strip()] = int(words[0]) * (1024 if words[1:] == ["kB"] else 1)
    return out


def _major_faults(stat: str) -> int:
    """/proc/self/stat's majflt (field 12), counted after the command's name (which may hold spaces)."""
    return int(stat.rsplit(")", 1)[1].split()[9])


class HostState:
    """`read()` gives the rank's process and host readings of rankwatch/agent/semconv.py (docs/telemetry.md)."""

    def __init__(
        self,
        root: Path = PROC,
        every_s: float = 1.0,
        clock_ns: Callable[[], int] = time.monotonic_ns,
        host_wide: bool = False,
        disks: Path = SYS_BLOCK,
        own: bool = True,
    ):
        """`own`: the process's readings and the host's as its rank sees them (CPU, I/O, faults, memory in
        use, PSI); `host_wide`: the host's disks and dirty pages."""
        self._root, self._every_ns, self._clock_ns, self._own = root, int(every_s * 1e9), clock_ns, own
        self._cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        self._files = {name: root / "pressure" / name for name in _PRESSURES} if own else {}
        self._process = {"io": root / "self" / "io", "stat": root / "self" / "stat"}
        self._disks: set[str] = set()
        if host_wide:
            with suppress(OSError):
                self._disks = {p.name for p in disks.iterdir() if not _NOT_DISKS.match(p.name)}
        self._last_ns = clock_ns()
        self._last = self._counters()

    def _counters(self) -> dict[str, float]:
        """Monotonic counters: CPU seconds, stalled microseconds, bytes, faults, disk sectors and busy ms."""
        counters = {"cpu_s": time.process_time()} if self._own else {}
        for name, path in list(self._files.items()):
            try:
                counters[name] = _stalled_us(path.read_text())
            except (OSError, ValueError, IndexError) as e:
                log.info("rankwatch: %s not readable (%s); no %s pressure from it", path, e, name)
                del self._files[name]
        if self._own:
            with suppress(OSError, KeyError):  # /proc/self/io needs the process's own ptrace permission
                io = _fields(self._process["io"].read_text())
                counters.update(read_bytes=io["read_bytes"], write_bytes=io["write_bytes"])
            with suppress(OSError, ValueError, IndexError):
                counters["major_faults"] = _major_faults(self._process["stat"].read_text())
        if self._disks:
            with suppress(OSError):
                for line in (self._root / "diskstats").read_text().splitlines():
                    words = line.split()
                    if len(words) >= 13 and words[2] in self._disks:
                        counters[f"read:{words[2]}"] = int(words[5]) * SECTOR
                        counters[f"write:{words[2]}"] = int(words[9]) * SECTOR
                        counters[f"busy:{words[2]}"] = int(words[12]) / 1e3  # ms doing I/O, as s
        return counters

    def read(self) -> list[Reading]:
        now = self._clock_ns()
        if now - self._last_ns < self._every_ns:
            return []
        counters = self._counters()
        seconds = (now - self._last_ns) / 1e9
        rate = {k: (v - self._last[k]) / seconds for k, v in counters.items() if k in self._last}
        readings: list[Reading] = [(sc.PROCESS_CPU_UTIL, rate["cpu_s"] / self._cpus, _ATTRIBUTES)] if self._own else []
        readings += [(_PRESSURES[name], rate[name] / 1e6, _ATTRIBUTES) for name in self._files if name in rate]
        for key, metric in (
            ("read_bytes", sc.PROCESS_READ_BPS),
            ("write_bytes", sc.PROCESS_WRITE_BPS),
            ("major_faults", sc.PROCESS_MAJOR_FAULTS),
        ):
            if key in rate:
                readings.append((metric, rate[key], _ATTRIBUTES))
        disks = [k.split(":", 1) for k in rate if ":" in k]
        if disks:
            readings += [
                (sc.DISK_READ_BPS, sum(rate[f"read:{d}"] for kind, d in disks if kind == "read"), _ATTRIBUTES),
                (sc.DISK_WRITE_BPS, sum(rate[f"write:{d}"] for kind, d in disks if kind == "write"), _ATTRIBUTES),
                (sc.DISK_BUSY, max(rate[f"busy:{d}"] for kind, d in disks if kind == "busy"), _ATTRIBUTES),
            ]
        with suppress(OSError, KeyError, ValueError, ZeroDivisionError):
            memory = _fields((self._root / "meminfo").read_text()) if self._own or self._disks else {}
            if self._own:
                readings.append((sc.SYSTEM_MEMORY_UTIL, 1 - memory["MemAvailable"] / memory["MemTotal"], _ATTRIBUTES))
            if self._disks:
                readings += [
                    (sc.MEMORY_DIRTY_BYTES, memory["Dirty"], _ATTRIBUTES),
                    (sc.MEMORY_WRITEBACK_BYTES, memory["Writeback"], _ATTRIBUTES),
                ]
        self._last_ns, self._last = now, counters
        return readings
