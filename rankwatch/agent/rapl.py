"""Host power from the CPU's RAPL energy counters (Linux powercap), where they are readable.

Each top-level zone (`intel-rapl:N`: a CPU package, or the platform, `psys`,
which contains the packages) counts microjoules in `energy_uj` and wraps to 0
past `max_energy_range_uj`. Since 2020 kernels make `energy_uj` readable by
root only (CVE-2020-8694), so most jobs see no zone and send nothing. The
counter is read as joules since the reader started (wraps undone), with the
average power since the previous reading; both are per host, so one rank per
host should read them.
"""

import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rankwatch.agent import semconv as sc
from rankwatch.agent.devices import Reading

log = logging.getLogger("rankwatch.agent")

POWERCAP = Path("/sys/class/powercap")


@dataclass
class _Zone:
    name: str
    counter: Path
    range_uj: int
    last_uj: int
    total_j: float = 0.0


class Rapl:
    """The readable top-level RAPL zones under `root`; `read()` gives host energy and power."""

    def __init__(self, root: Path = POWERCAP, clock_ns: Callable[[], int] = time.monotonic_ns):
        self._clock_ns = clock_ns
        self._zones: list[_Zone] = []
        for path in sorted(root.glob("intel-rapl:*")):
            if not re.fullmatch(r"intel-rapl:\d+", path.name):
                continue  # a subzone (core, uncore, dram), inside its package's count
            try:
                self._zones.append(
                    _Zone(
                        (path / "name").read_text().strip(),
                        path / "energy_uj",
                        int((path / "max_energy_range_uj").read_text()),
                        int((path / "energy_uj").read_text()),
                    )
                )
            except OSError as e:
                log.info("rankwatch: RAPL zone %s not readable (%s); no host power from it", path.name, e)
        self._last_ns = clock_ns()

    @property
    def available(self) -> bool:
        return bool(self._zones)

    def read(self) -> list[Reading]:
        now = self._clock_ns()
        seconds, self._last_ns = (now - self._last_ns) / 1e9, now
        readings: list[Reading] = []
        for zone in self._zones:
            counter = int(zone.counter.read_text())
            delta_uj = counter - zone.last_uj if counter >= zone.last_uj else zone.range_uj - zone.last_uj + counter
            zone.last_uj, zone.total_j = counter, zone.total_j + delta_uj / 1e6
            attributes = {sc.SOURCE: sc.SOURCE_RAPL, sc.RAPL_ZONE: zone.name}
            readings.append((sc.HOST_ENERGY_J, zone.total_j, attributes))
            if seconds > 0:
                readings.append((sc.HOST_POWER_W, delta_uj / 1e6 / seconds, attributes))
        return readings
