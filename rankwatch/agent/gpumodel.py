"""The GPU power model: how a GPU's power, clock and clock-event reasons answer its load, a power
limit and thermal throttling. One definition for the simulated GPU (rankwatch/agent/simdevice.py), the fleet
simulator (trainer/simulate.py) and the power analyzer's prediction for caps
(collector/analysis/analyzers/power.py). A leaf: semconv and the standard library (numpy only inside
`operating_points`), so every one of them imports it without the others' machinery.

Dynamic power goes as f·V², and voltage roughly with the clock f:

    P(u, f) = P_idle + (P_max - P_idle) · u · (f / f_max)³        u: utilization, 0..1

A cap C binds when P(u, f_max) > C; the clock is then the highest that fits,
f = f_max · ((C - P_idle) / ((P_max - P_idle) · u))^(1/3), floored at f_min (where power may
stay above the cap, as on a real GPU at its lowest clock), and the clock-event reasons say
sw_power_cap. Thermal throttling holds the clock at a thermal clock at most, at the thermal
temperature at least, and sets the thermal reasons. Otherwise the temperature follows power,
T = T_ambient + k · P.
"""

from dataclasses import dataclass
from typing import TYPE_CHECKING

from rankwatch.agent import semconv as sc

if TYPE_CHECKING:
    import numpy as np

_BIT = {name: bit for bit, name in sc.CLOCK_EVENT_REASON_BITS.items()}
SW_POWER_CAP = _BIT["sw_power_cap"]
THERMAL = _BIT["sw_thermal_slowdown"] | _BIT["hw_thermal_slowdown"]


@dataclass(frozen=True)
class GpuModel:
    """A GPU's figures for the model (and the simulated GPU's readings); the defaults are an H100 SXM's."""

    idle_w: float = 70.0
    max_w: float = 700.0  # at full utilization and full clock
    clock_max_mhz: float = 1980.0
    clock_min_mhz: float = 345.0
    memory_clock_mhz: float = 2619.0
    limit_min_w: float = 200.0  # the power limits it accepts; the default limit is the highest
    limit_max_w: float = 700.0
    ambient_c: float = 30.0
    c_per_w: float = 0.06  # temperature rise per watt
    thermal_clock_mhz: float = 1500.0  # thermal throttling's clock (at most) and temperature (at least)
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


def operating_points(
    model: GpuModel, load: "float | np.ndarray", limit_w: "float | np.ndarray", thermal: "bool | np.ndarray" = False
) -> "tuple[np.ndarray, np.ndarray, np.ndarray]":
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
