"""The GPU a rank reads and may power-cap, real (NVML) or simulated: the contract both keep
(rankwatch/agent/opendevice.py picks which one a rank gets).

Both kinds share one contract, so the sampler, the agent and a power-cap
command need not ask which they hold: `read()` gives the device metrics of
rankwatch/agent/semconv.py, and the cap is always clamped to what the GPU accepts and
put back as it was when the job ends.
"""

import atexit
import logging
from abc import ABC, abstractmethod

from rankwatch.agent import semconv as sc
from rankwatch.agent.spanwire import Attributes

log = logging.getLogger("rankwatch.agent")

Reading = tuple[str, float, Attributes]  # metric, value, attributes (the sampler adds the time)


class Device(ABC):
    """One GPU: its readings and its power-limit actuator."""

    source: str  # sc.SOURCE_NVML or sc.SOURCE_SIMULATED
    index: int  # on the host: the `gpu` attribute
    _restore_w: float | None = None  # the limit in force before the first cap, while a cap is set

    def read(self) -> list[Reading]:
        """The device metrics now, each labelled with the GPU and where it came from."""
        labels: Attributes = {sc.GPU: self.index, sc.SOURCE: self.source}
        return [(metric, value, {**labels, **attributes}) for metric, value, attributes in self._read()]

    def uuid(self) -> str | None:
        """The GPU's NVML UUID, by which the node's sidecar reads it for the rank (rankwatch/agent/nodesampler.py);
        None where no other process can read it (a simulated GPU follows its own rank's activity)."""
        return None

    def compute_scale(self) -> float:
        """How many times longer compute takes than at full clock, for a trainer that has to
        play it out; a real GPU slows down by itself, so 1."""
        return 1.0

    def set_power_cap(self, watts: float) -> float:
        """Cap the GPU's power, clamped to its constraints; returns the cap applied. The limit
        in force before the first cap is put back by `restore_power_cap` (at exit too): an
        operator's own limit outlives the job."""
        low, high = self.power_limit_constraints()
        applied = min(max(watts, low), high)
        if applied != watts:
            log.info(
                "rankwatch: GPU %d power cap %.0f W clamped to %.0f W (the GPU accepts %.0f-%.0f W)",
                self.index,
                watts,
                applied,
                low,
                high,
            )
        before = self.power_limit() if self._restore_w is None else None
        self._set_power_limit(applied)
        if before is not None:
            self._restore_w = before
            atexit.register(self.restore_power_cap)
        return applied

    def restore_power_cap(self) -> None:
        """Put back the limit that was in force before the first `set_power_cap`, if any."""
        if self._restore_w is not None:
            self._set_power_limit(self._restore_w)
            self._restore_w = None
            atexit.unregister(self.restore_power_cap)

    def close(self) -> None:
        self.restore_power_cap()

    @abstractmethod
    def _read(self) -> list[Reading]:
        """Readings without the GPU and source labels."""

    @abstractmethod
    def power_limit(self) -> float:
        """The power limit set now, W."""

    @abstractmethod
    def power_limit_constraints(self) -> tuple[float, float]:
        """The lowest and highest power limit the GPU accepts, W."""

    @abstractmethod
    def _set_power_limit(self, watts: float) -> None:
        """Set the limit, already within the constraints."""
