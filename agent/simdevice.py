"""A simulated GPU, for jobs without one: power, clocks, temperature and energy that answer
load, a power cap and injected thermal throttling the way a real GPU's do, so that power
telemetry and power capping can be exercised end to end on CPU. Its samples say
`rankwatch.source=simulated`.

The power model (dynamic power goes as f·V², and voltage roughly with the clock f):

    P(u, f) = P_idle + (P_max - P_idle) · u · (f / f_max)³        u: utilization, 0..1

A cap C binds when P(u, f_max) > C; the clock is then the highest that fits,
f = f_max · ((C - P_idle) / ((P_max - P_idle) · u))^(1/3), floored at f_min (where power may
stay above the cap, as on a real GPU at its lowest clock), and the clock-event reasons say
sw_power_cap. Compute at full load runs f_max / f times longer: `compute_scale()`, for a
trainer to play out. Injected thermal throttling holds the clock at a thermal clock at most,
raises the temperature and sets the thermal reasons. Otherwise the temperature follows power,
T = T_ambient + k · P. The energy counter integrates power between readings, the load held
from one reading to the next. Memory in use is constant; NVLink carries its peak rate while
the GPU waits (in collectives), none while it computes; ECC errors and XIDs come only when
injected (`inject_errors`).
"""

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from agent import semconv as sc
from agent.devices import Device, Reading

if TYPE_CHECKING:
    import numpy as np

_BIT = {name: bit for bit, name in sc.CLOCK_EVENT_REASON_BITS.items()}
SW_POWER_CAP = _BIT["sw_power_cap"]
THERMAL = _BIT["sw_thermal_slowdown"] | _BIT["hw_thermal_slowdown"]


@dataclass(frozen=True)
class GpuModel:
    """The simulated GPU's figures; the defaults are an H100 SXM's."""

    idle_w: float = 70.0
    max_w: float = 700.0  # at full utilization and full clock
    clock_max_mhz: float = 1980.0
    clock_min_mhz: float = 345.0
    memory_clock_mhz: float = 2619.0
    limit_min_w: float = 200.0  # the power limits it accepts; the default limit is the highest
    limit_max_w: float = 700.0
    ambient_c: float = 30.0
    c_per_w: float = 0.06  # temperature rise per watt
    thermal_clock_mhz: float = 1500.0  # throttled clock and temperature, as the fleet simulator's
    thermal_c: float = 88.0
    memory_total_mib: float = 81559.0  # HBM3, 80 GB
    memory_used_mib: float = 62000.0  # a training job's weights, optimizer state, activations and cache
    nvlink_bps: float = 450e9  # NVLink 4, one direction, all 18 links, while collectives run (load 0)
    pcie_bps: float = 2e9  # the host's share: data batches in, a little back

    def power(self, load: "float | np.ndarray", clock_mhz: "float | np.ndarray") -> "float | np.ndarray":
        """P(u, f), W: the power model above; scalars or numpy arrays."""
        return self.idle_w + (self.max_w - self.idle_w) * load * (clock_mhz / self.clock_max_mhz) ** 3

    def fitting_clock(self, load: "float | np.ndarray", limit_w: "float | np.ndarray") -> "float | np.ndarray":
        """The clock at which `load` (> 0) draws `limit_w`: P(u, f) = limit solved for f."""
        return self.clock_max_mhz * ((limit_w - self.idle_w) / ((self.max_w - self.idle_w) * load)) ** (1 / 3)


def operating_point(model: GpuModel, load: float, limit_w: float, thermal: bool = False) -> tuple[float, float, int]:
    """SM clock (MHz), power (W) and clock-event reasons at `load` (0..1) under the power limit and
    thermal throttling: the device's own state."""
    m = model
    clock, reasons = (m.thermal_clock_mhz, THERMAL) if thermal else (m.clock_max_mhz, 0)
    if load > 0 and m.power(load, clock) > limit_w:
        clock, reasons = float(m.fitting_clock(load, limit_w)), reasons | SW_POWER_CAP
    clock = max(clock, m.clock_min_mhz)
    return clock, float(m.power(load, clock)), reasons


def operating_points(model: GpuModel, load: "float | np.ndarray", limit_w: "float | np.ndarray",
                     thermal: "bool | np.ndarray" = False) -> "tuple[np.ndarray, np.ndarray, np.ndarray]":
    """`operating_point` of numpy arrays, broadcast together (a value per rank): the fleet
    simulator's and the power analyzer's prediction for caps."""
    import numpy as np  # here only: the agent, which runs in every training process, does without it

    m = model
    load, limit_w, thermal = np.asarray(load, float), np.asarray(limit_w, float), np.asarray(thermal, bool)
    clock = np.where(thermal, m.thermal_clock_mhz, m.clock_max_mhz)
    capped = (load > 0) & (m.power(load, clock) > limit_w)
    with np.errstate(divide="ignore", invalid="ignore"):
        clock = np.maximum(np.where(capped, m.fitting_clock(load, limit_w), clock), m.clock_min_mhz)
    reasons = np.where(thermal, THERMAL, 0) | np.where(capped, SW_POWER_CAP, 0)
    return clock, np.asarray(m.power(load, clock)), reasons


class SimulatedDevice(Device):
    """GPU `index` of the simulated host. `utilization()` says how busy it is now (0..1; default
    always busy); `clock_ns` is the time base its energy counter integrates over."""

    source = sc.SOURCE_SIMULATED

    def __init__(self, index: int, model: GpuModel = GpuModel(), utilization: Callable[[], float] | None = None,
                 clock_ns: Callable[[], int] = time.monotonic_ns):
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
            return [(sc.POWER_INSTANT_W, power, {sc.POWER_KIND: sc.POWER_KIND_INSTANT}),
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
                    *[(sc.XID_ERRORS, xid, {}) for xid in self._drain_xids()]]

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
