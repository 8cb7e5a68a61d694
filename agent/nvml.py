"""A GPU read and power-capped through NVML (nvidia-ml-py's `pynvml`).

Each metric is read by the first of its NVML calls that the GPU and driver
support: power from the instantaneous field where the GPU has it, else the
driver's windowed average; clock-event reasons from the current call, else
the one older drivers call "throttle reasons". A call that answers
NotSupported, or that the driver's library lacks, is not tried again; after
any other error the next call is tried, or the metric skipped, for that
reading only. Nothing here stops training.
"""

import os
from collections.abc import Callable

import pynvml

from agent import semconv as sc
from agent.devices import Device, Reading
from agent.export import log

_UNSUPPORTED = (pynvml.NVMLError_NotSupported, pynvml.NVMLError_FunctionNotFound)
_FIELD_VALUE = {  # nvmlFieldValue_t.valueType -> the member of its value union
    pynvml.NVML_VALUE_TYPE_DOUBLE: "dVal", pynvml.NVML_VALUE_TYPE_UNSIGNED_INT: "uiVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG: "ulVal", pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: "ullVal",
    pynvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG: "sllVal", pynvml.NVML_VALUE_TYPE_SIGNED_INT: "siVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_SHORT: "usVal",
}


def visible_handle(local_index: int):
    """The NVML handle of CUDA device `local_index`: NVML numbers every GPU of the host, CUDA
    only those of CUDA_VISIBLE_DEVICES (indices or UUIDs), in that order."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return pynvml.nvmlDeviceGetHandleByIndex(local_index)
    entry = visible.split(",")[local_index].strip()
    if entry.startswith(("GPU-", "MIG-")):
        return pynvml.nvmlDeviceGetHandleByUUID(entry)
    return pynvml.nvmlDeviceGetHandleByIndex(int(entry))


class NvmlDevice(Device):
    """The GPU that CUDA calls `local_index`; NVML stays initialised until `close()`."""

    source = sc.SOURCE_NVML

    def __init__(self, local_index: int):
        pynvml.nvmlInit()
        try:
            self._handle = visible_handle(local_index)
            self.index = pynvml.nvmlDeviceGetIndex(self._handle)
        except Exception:
            pynvml.nvmlShutdown()
            raise
        # per metric, the NVML calls that may read it, preferred first
        self._calls: list[list[Callable[[], list[Reading]]]] = [
            [self._power_instant, self._power_average], [self._energy], [self._sm_clock], [self._memory_clock],
            [self._temperature], [self._utilization], [self._enforced_limit], [self._limit_constraints],
            [self._clock_event_reasons, self._clock_throttle_reasons]]
        self._warned: set[str] = set()

    def _read(self) -> list[Reading]:
        readings = []
        for calls in self._calls:
            for call in list(calls):
                try:
                    readings += call()
                    break
                except _UNSUPPORTED as e:
                    calls.remove(call)
                    log.info("rankwatch: GPU %d: %s: %s; %s", self.index, call.__name__.strip("_"), e,
                             f"reading {calls[0].__name__.strip('_')} instead" if calls else "not read again")
                except pynvml.NVMLError as e:
                    if call.__name__ not in self._warned:
                        self._warned.add(call.__name__)
                        log.warning("rankwatch: GPU %d: %s failed (%s); skipped while it fails", self.index,
                                    call.__name__.strip("_"), e)
        return readings

    def _power_instant(self) -> list[Reading]:
        field = pynvml.nvmlDeviceGetFieldValues(self._handle, [pynvml.NVML_FI_DEV_POWER_INSTANT])[0]
        if field.nvmlReturn != pynvml.NVML_SUCCESS:
            raise pynvml.NVMLError(field.nvmlReturn)
        milliwatts = getattr(field.value, _FIELD_VALUE[field.valueType])
        return [(sc.POWER_INSTANT_W, milliwatts / 1e3, {sc.POWER_KIND: sc.POWER_KIND_INSTANT})]

    def _power_average(self) -> list[Reading]:
        return [(sc.POWER_W, pynvml.nvmlDeviceGetPowerUsage(self._handle) / 1e3,
                 {sc.POWER_KIND: sc.POWER_KIND_AVERAGE})]

    def _energy(self) -> list[Reading]:
        return [(sc.ENERGY_J, pynvml.nvmlDeviceGetTotalEnergyConsumption(self._handle) / 1e3, {})]

    def _sm_clock(self) -> list[Reading]:
        return [(sc.SM_CLOCK_MHZ, pynvml.nvmlDeviceGetClockInfo(self._handle, pynvml.NVML_CLOCK_SM), {})]

    def _memory_clock(self) -> list[Reading]:
        return [(sc.MEM_CLOCK_MHZ, pynvml.nvmlDeviceGetClockInfo(self._handle, pynvml.NVML_CLOCK_MEM), {})]

    def _temperature(self) -> list[Reading]:
        return [(sc.GPU_TEMP_C, pynvml.nvmlDeviceGetTemperature(self._handle, pynvml.NVML_TEMPERATURE_GPU), {})]

    def _utilization(self) -> list[Reading]:
        return [(sc.GPU_UTIL_PCT, pynvml.nvmlDeviceGetUtilizationRates(self._handle).gpu, {})]

    def _enforced_limit(self) -> list[Reading]:
        return [(sc.POWER_LIMIT_W, pynvml.nvmlDeviceGetEnforcedPowerLimit(self._handle) / 1e3, {})]

    def _limit_constraints(self) -> list[Reading]:
        low, high = self.power_limit_constraints()
        return [(sc.POWER_LIMIT_MIN_W, low, {}), (sc.POWER_LIMIT_MAX_W, high, {})]

    def _clock_event_reasons(self) -> list[Reading]:
        return [(sc.CLOCK_EVENT_REASONS, pynvml.nvmlDeviceGetCurrentClocksEventReasons(self._handle), {})]

    def _clock_throttle_reasons(self) -> list[Reading]:
        return [(sc.CLOCK_EVENT_REASONS, pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(self._handle), {})]

    # -- the power-limit actuator --------------------------------------------------------------------
    def power_limit(self) -> float:
        return pynvml.nvmlDeviceGetPowerManagementLimit(self._handle) / 1e3

    def power_limit_constraints(self) -> tuple[float, float]:
        low, high = pynvml.nvmlDeviceGetPowerManagementLimitConstraints(self._handle)
        return low / 1e3, high / 1e3

    def _set_power_limit(self, watts: float) -> None:
        try:
            pynvml.nvmlDeviceSetPowerManagementLimit(self._handle, round(watts * 1e3))
        except pynvml.NVMLError_NoPermission as e:
            raise PermissionError(
                f"rankwatch: setting GPU {self.index}'s power limit to {watts:.0f} W needs root (NVML: {e}); "
                f"run the job as root, or set it yourself: sudo nvidia-smi -i {self.index} -pl {watts:.0f}") from e

    def close(self) -> None:
        """Restore the power limit, then let NVML go (once)."""
        if self._handle is not None:
            super().close()
            self._handle = None
            pynvml.nvmlShutdown()
