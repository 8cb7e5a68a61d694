"""Fault counters beyond the GPU core, read once per node at a slow rate: what wears out before a GPU
or a link fails outright, so that the collector can blame a machine and not only a GPU.

The GPU's own (PCIe replays and link, NVLink errors, remapped rows, HBM temperature) are read through
NVML wherever the GPU is read (rankwatch/agent/nvml.py: its node's sidecar, else its rank); the host's
InfiniBand ports here, once per host (its sidecar, else local rank 0), one series per port. Both at most
every `FAULTS_EVERY_S`.

A port's counter file that cannot be read is left out from then on, once logged: a port counted in
one reading and not the next would make the host's total jump when it comes back.
"""

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from rankwatch.agent import semconv as sc
from rankwatch.agent.devices import Reading

log = logging.getLogger("rankwatch.agent")

# Error counters move slowly (a failing link errs for minutes before it drops), and a straggler window
# of a real job spans a minute or more: a reading every 10 s shows their rise there, while the sampler
# thread pays its NVML calls (one per NVLink per counter) once per 100 of its 10 Hz samples.
FAULTS_EVERY_S = 10.0
INFINIBAND = Path("/sys/class/infiniband")
INFINIBAND_ENV = "RANKWATCH_INFINIBAND"  # another root for the ports' tree (a container's mount, a test's)
_COUNTERS = {  # a port's counter file -> its metric
    "symbol_error": sc.IB_SYMBOL_ERRORS,
    "link_downed": sc.IB_LINK_DOWNED,
    "port_rcv_errors": sc.IB_RCV_ERRORS,
    "port_xmit_discards": sc.IB_XMIT_DISCARDS,
}


class Due:
    """Whether a slow reader's time has come: at the first ask, then once `every_s` has passed since
    the last time it came."""

    def __init__(self, every_s: float, clock_ns: Callable[[], int] = time.monotonic_ns):
        self._every_ns, self._clock_ns = int(every_s * 1e9), clock_ns
        self._next_ns: int | None = None

    def __call__(self) -> bool:
        now = self._clock_ns()
        if self._next_ns is not None and now < self._next_ns:
            return False
        self._next_ns = now + self._every_ns
        return True


class InfinibandPorts:
    """The counters of every InfiniBand (or RoCE) port under `root` (/sys/class/infiniband, else
    $RANKWATCH_INFINIBAND): `read()` gives each as counted now, labelled with its port (`mlx5_0/1`)."""

    def __init__(
        self,
        root: Path | None = None,
        every_s: float = FAULTS_EVERY_S,
        clock_ns: Callable[[], int] = time.monotonic_ns,
    ):
        root = root or Path(os.environ.get(INFINIBAND_ENV) or INFINIBAND)
        self._due = Due(every_s, clock_ns)
        self._files: list[tuple[str, Path, dict[str, str]]] = [
            (metric, counters / name, {sc.SOURCE: sc.SOURCE_HOST, sc.IB_PORT: f"{device.name}/{port.name}"})
            for device in sorted(root.glob("*"))
            for port in sorted(device.glob("ports/*"))
            if (counters := port / "counters").is_dir()
            for name, metric in _COUNTERS.items()
            if (counters / name).is_file()
        ]

    @property
    def available(self) -> bool:
        return bool(self._files)

    def read(self) -> list[Reading]:
        if not self._due():
            return []
        readings: list[Reading] = []
        for entry in list(self._files):
            metric, path, attributes = entry
            try:
                readings.append((metric, float(int(path.read_bytes())), attributes))
            except (OSError, ValueError) as e:
                log.info("rankwatch: %s not readable (%s); not read again", path, e)
                self._files.remove(entry)
        return readings
