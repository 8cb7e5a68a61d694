"""A figure's unit from its name, as the pages show it: an evidence key ends in its unit
(`compute_s`, `cap_w`, `saving_j_per_step`, `busbw_gbps`), a device metric is a DCGM field.
Three significant digits and a unit that fits the size (collector/quantities.py), never a
16-digit float."""

import math
from collections.abc import Callable
from dataclasses import dataclass

import pandas as pd

from collector import quantities
from rankwatch.agent import semconv as sc

plain = quantities.Scale("", prefixed=False, space="")  # 3 significant digits, thousands separated, no unit


@dataclass(frozen=True)
class Unit:
    """How one value reads (`show`), and the unit of its stored values on a chart's axis."""

    show: Callable[[float], str]
    axis: str  # "" for a ratio


def _instant(ns: float) -> str:
    return f"{pd.Timestamp(int(ns), unit='ns', tz='UTC'):%Y-%m-%d %H:%M:%S} UTC"


def _times(value: float) -> str:
    return f"{plain(value)}x"


def _change(ratio: float) -> str:
    return quantities.percent(ratio - 1, signed=True)


_SHARE = Unit(quantities.percent, "fraction")
# a word of a key that is its unit, wherever it stands (`saving_j_per_step` is joules), the last found from the end
SYMBOLS: dict[str, Unit] = {
    "s": Unit(quantities.duration, "s"),
    "ns": Unit(_instant, "UTC"),  # evidence's *_ns are instants (epoch nanoseconds)
    "w": Unit(quantities.power, "W"),
    "j": Unit(quantities.energy, "J"),
    "kwh": Unit(lambda kwh: quantities.energy_wh(kwh * 3.6e6), "kWh"),
    "bytes": Unit(quantities.data_size, "B"),
    "gbps": Unit(lambda gbps: quantities.bandwidth(gbps * 1e9), "GB/s"),
    "percent": Unit(lambda pct: f"{plain(pct)}%", "%"),
}
# a key's last word (past "_by_rank", "_by_step") that says what kind of number it is
ENDINGS: dict[str, Unit] = {
    **dict.fromkeys(("fraction", "share", "saving", "risk"), _SHARE),
    "ratio": Unit(_times, ""),
    "slowdown": Unit(_change, ""),  # 1.005 is "+0.5%"
}
KEYS: dict[str, Unit] = {"caps": SYMBOLS["w"], "throttle_reasons": _SHARE}  # keys whose words say no unit

_MIB = quantities.Scale("B", factor=2**20)  # a size given in MiB (NVML's memory figures), shown in B, kB, MB, GB
_PER_S = quantities.Scale("/s", prefixed=False, space=" ")

# Device and host metrics (rankwatch/agent/semconv.py): heading, and unit (a Scale's fits the values' size); the Power
# page draws them per rank in this order
DEVICE_METRICS: dict[str, tuple[str, str | quantities.Scale]] = {
    sc.POWER_W: ("Power", quantities.power),
    sc.POWER_INSTANT_W: ("Power (instantaneous)", quantities.power),
    sc.POWER_LIMIT_W: ("Power limit", quantities.power),
    sc.POWER_LIMIT_MIN_W: ("Lowest power limit", quantities.power),
    sc.POWER_LIMIT_MAX_W: ("Highest power limit", quantities.power),
    sc.ENERGY_J: ("GPU energy (counter)", quantities.energy),
    sc.SM_CLOCK_MHZ: ("SM clock", "MHz"),
    sc.MEM_CLOCK_MHZ: ("Memory clock", "MHz"),
    sc.GPU_TEMP_C: ("GPU temperature", "°C"),
    sc.GPU_UTIL_PCT: ("GPU utilization", "%"),
    "memory_used_pct": ("GPU memory used", "% of the GPU's"),
    sc.FB_USED_MIB: ("GPU memory in use", _MIB),
    sc.FB_TOTAL_MIB: ("GPU memory", _MIB),
    sc.NVLINK_TX_BPS: ("NVLink sent", quantities.bandwidth),
    sc.NVLINK_RX_BPS: ("NVLink received", quantities.bandwidth),
    sc.PCIE_TX_BPS: ("PCIe sent", quantities.bandwidth),
    sc.PCIE_RX_BPS: ("PCIe received", quantities.bandwidth),
    sc.CLOCK_EVENT_REASONS: ("Clocks held back by", ""),
    sc.XID_ERRORS: ("XID error", ""),
    sc.ECC_SBE_VOLATILE: ("ECC errors corrected, since the driver loaded", ""),
    sc.ECC_DBE_VOLATILE: ("ECC errors uncorrected, since the driver loaded", ""),
    sc.ECC_SBE_AGGREGATE: ("ECC errors corrected, over the GPU's life", ""),
    sc.ECC_DBE_AGGREGATE: ("ECC errors uncorrected, over the GPU's life", ""),
    sc.HOST_POWER_W: ("Host power (RAPL)", quantities.power),
    sc.HOST_ENERGY_J: ("Host energy (RAPL)", quantities.energy),
    sc.PROCESS_CPU_UTIL: ("Process CPU use, per CPU", quantities.percent),
    sc.SYSTEM_MEMORY_UTIL: ("Host memory in use", quantities.percent),
    sc.PRESSURE_CPU: ("Host CPU pressure (time waiting for a CPU)", quantities.percent),
    sc.PRESSURE_MEMORY: ("Host memory pressure", quantities.percent),
    sc.PRESSURE_IO: ("Host I/O pressure", quantities.percent),
    sc.PROCESS_READ_BPS: ("Process storage reads", quantities.bandwidth),
    sc.PROCESS_WRITE_BPS: ("Process storage writes", quantities.bandwidth),
    sc.PROCESS_MAJOR_FAULTS: ("Page faults read from storage", _PER_S),
    sc.DISK_READ_BPS: ("Host disk reads", quantities.bandwidth),
    sc.DISK_WRITE_BPS: ("Host disk writes", quantities.bandwidth),
    sc.DISK_BUSY: ("Busiest disk's time busy", quantities.percent),
    sc.MEMORY_DIRTY_BYTES: ("Pages waiting to be written", quantities.data_size),
    sc.MEMORY_WRITEBACK_BYTES: ("Pages being written", quantities.data_size),
    sc.PCIE_REPLAY_COUNTER: ("PCIe replays, since the driver loaded", ""),
    sc.PCIE_LINK_GEN: ("PCIe link generation", ""),
    sc.PCIE_LINK_WIDTH: ("PCIe link width", "lanes"),
    sc.NVLINK_CRC_FLIT_ERRORS: ("NVLink CRC flit errors, since the driver loaded", ""),
    sc.NVLINK_CRC_DATA_ERRORS: ("NVLink CRC data errors, since the driver loaded", ""),
    sc.NVLINK_REPLAY_ERRORS: ("NVLink replays, since the driver loaded", ""),
    sc.NVLINK_RECOVERY_ERRORS: ("NVLink recoveries, since the driver loaded", ""),
    sc.REMAPPED_ROWS_CORRECTABLE: ("GPU memory rows remapped for corrected errors, over the GPU's life", ""),
    sc.REMAPPED_ROWS_UNCORRECTABLE: ("GPU memory rows remapped for uncorrected errors, over the GPU's life", ""),
    sc.ROW_REMAP_FAILURE: ("GPU memory row remap failed", ""),
    sc.MEMORY_TEMP_C: ("GPU memory (HBM) temperature", "°C"),
    sc.IB_SYMBOL_ERRORS: ("InfiniBand symbol errors", ""),
    sc.IB_LINK_DOWNED: ("InfiniBand link downs", ""),
    sc.IB_RCV_ERRORS: ("InfiniBand receive errors", ""),
    sc.IB_XMIT_DISCARDS: ("InfiniBand send discards", ""),
}


def unit(key: str) -> Unit | None:
    """The unit a key's name says (a device metric's, the key's kind of number, a unit word in it);
    None for a bare number."""
    if key in DEVICE_METRICS:
        shown = DEVICE_METRICS[key][1]
        if isinstance(shown, quantities.Scale):
            return Unit(shown, shown.unit)
        return Unit(lambda v: f"{plain(v)} {shown}".rstrip(), shown) if shown else None
    words = key.lower().removesuffix("_by_rank").removesuffix("_by_step").split("_")
    found = KEYS.get(key) or ENDINGS.get(words[-1])
    return found or next((SYMBOLS[word] for word in reversed(words) if word in SYMBOLS), None)


def label(key: str) -> str:
    """A key in words, its unit words dropped (the value says the unit): `lost_s_per_step` is
    "lost per step", a DCGM field its heading."""
    if key in DEVICE_METRICS:
        return DEVICE_METRICS[key][0]
    words = [w for w in key.split("_") if w.lower() not in SYMBOLS]
    return " ".join(words) or key


def figure(key: str, value: object) -> str:
    """One value as read: in the unit its key names, 3 significant digits; "—" for none."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "—"
    if isinstance(value, bool) or not isinstance(value, int | float):
        return (", ".join(map(str, value)) or "none") if isinstance(value, list) else str(value)
    found = unit(key)
    if found is not None:
        return found.show(float(value))
    return f"{value:,}" if isinstance(value, int) else plain(value)
