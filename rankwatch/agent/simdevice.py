"""A simulated GPU, for jobs without one: power, clocks, temperature and energy that answer
load, a power cap and injected thermal throttling the way a real GPU's do (the model:
rankwatch/agent/gpumodel.py), so that power telemetry and power capping can be exercised end to end on
CPU. Its samples say `rankwatch.source=simulated`.

Compute at full load runs f_max / f times longer: `compute_scale()`, for a trainer to play out.
The energy counter integrates power between readings, the load held from one reading to the
next. Memory in use is constant; NVLink carries its peak rate while the GPU waits (in
collectives), none while it computes; ECC errors and XIDs come only when injected
(`inject_errors`).
"""

import threading
import time
from collections.abc import Callable

from rankwatch.agent import semconv as sc
from rankwatch.agent.devices import Device, Reading
from rankwatch.agent.gpumodel import GpuModel, operating_point


class SimulatedDevice(Device):
    """GPU `index` of the simulated host. `utilization()` says how busy it is now (0..1; default
    always busy); `clock_ns` is the time base its energy counter integrates over."""

    source = sc.SOURCE_SIMULATED

    def __init__(
        self,
        index: int,
        model: GpuModel = GpuModel(),
        utilization: Callable[[], float] | None = None,
        clock_ns: Callable[[], int] = time.monotonic_ns,
    ):
        self.index, self.model = index, model
        self._utilization = utilization or (lambda: 1.0)
        self._clock_ns = clock_ns
        self._limit_w = model.limit_max_w
        self._thermal = False
        self._energy_j = 0.0
        self._ecc_corrected = self._ecc_uncorrected = 0
        self._xids: list[int] = []  # injected, sent at the next reading
        self._lock = threading.Lock()
        self._last_ns, self._load = clock_ns(), self._load_now()

    def _read(self) -> list[Reading]:
        m = self.model
        with self._lock:
            self._advance()
            clock, power, reasons = self._operating_point(self._load)
            temperature = m.ambient_c + m.c_per_w * power
            return [
                (sc.POWER_INSTANT_W, power, {sc.POWER_KIND: sc.POWER_KIND_INSTANT}),
                (sc.ENERGY_J, self._energy_j, {}),
                (sc.SM_CLOCK_MHZ, clock, {}),
                (sc.MEM_CLOCK_MHZ, m.memory_clock_mhz, {}),
                (sc.GPU_TEMP_C, max(temperature, m.thermal_c) if self._thermal else temperature, {}),
                (sc.GPU_UTIL_PCT, 100.0 * self._load, {}),
                (sc.POWER_LIMIT_W, self._limit_w, {}),
                (sc.POWER_LIMIT_MIN_W, m.limit_min_w, {}),
                (sc.POWER_LIMIT_MAX_W, m.limit_max_w, {}),
                (sc.CLOCK_EVENT_REASONS, reasons, {}),
                (sc.FB_USED_MIB, m.memory_used_mib, {}),
                (sc.FB_TOTAL_MIB, m.memory_total_mib, {}),
                (sc.ECC_SBE_VOLATILE, self._ecc_corrected, {}),
                (sc.ECC_DBE_VOLATILE, self._ecc_uncorrected, {}),
                (sc.ECC_SBE_AGGREGATE, self._ecc_corrected, {}),
                (sc.ECC_DBE_AGGREGATE, self._ecc_uncorrected, {}),
                (sc.NVLINK_TX_BPS, m.nvlink_bps * (1 - self._load), {}),
                (sc.NVLINK_RX_BPS, m.nvlink_bps * (1 - self._load), {}),
                (sc.PCIE_TX_BPS, m.pcie_bps / 4, {}),
                (sc.PCIE_RX_BPS, m.pcie_bps, {}),
                *[(sc.XID_ERRORS, xid, {}) for xid in self._drain_xids()],
            ]

    def compute_scale(self) -> float:
        """f_max / f at full load: how many times longer compute takes under the cap and throttling."""
        with self._lock:
            return self.model.clock_max_mhz / self._operating_point(1.0)[0]

    def throttle_thermal(self, on: bool = True) -> None:
        """Start (or end) thermal throttling, as an overheating GPU would."""
        with self._lock:
            self._advance()
            self._thermal = on

    def inject_errors(self, corrected: int = 0, uncorrected: int = 0, xid: int | None = None) -> None:
        """ECC errors (added to the counters) and an XID error (e.g. 48, a double-bit ECC error; 79,
        the GPU fell off the bus), as a failing GPU raises them."""
        with self._lock:
            self._ecc_corrected += corrected
            self._ecc_uncorrected += uncorrected
            if xid is not None:
                self._xids.append(xid)

    def _drain_xids(self) -> list[int]:
        xids, self._xids = self._xids, []
        return xids

    def _operating_point(self, load: float) -> tuple[float, float, int]:
        return operating_point(self.model, load, self._limit_w, self._thermal)

    def _advance(self) -> None:
        """Integrate power since the last call at the load and settings of then; take the load now."""
        now = self._clock_ns()
        self._energy_j += self._operating_point(self._load)[1] * (now - self._last_ns) / 1e9
        self._last_ns, self._load = now, self._load_now()

    def _load_now(self) -> float:
        return min(max(float(self._utilization()), 0.0), 1.0)

    # -- the power-limit actuator --------------------------------------------------------------------
    def power_limit(self) -> float:
        return self._limit_w

    def power_limit_constraints(self) -> tuple[float, float]:
        return self.model.limit_min_w, self.model.limit_max_w

    def _set_power_limit(self, watts: float) -> None:
        with self._lock:
            self._advance()
            self._limit_w = watts
