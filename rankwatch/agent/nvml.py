"""A GPU read and power-capped through NVML (nvidia-ml-py's `pynvml`).

Each metric is read by the first of its NVML calls that the GPU and driver
support: power from the instantaneous field where the GPU has it, else the
driver's windowed average; clock-event reasons from the current call, else
the one older drivers call "throttle reasons". A call that answers
NotSupported or NoPermission, or that the driver's library lacks, is not
tried again; after any other error the next call is tried, or the metric
skipped, for that reading only. Nothing here stops training.

NVLink traffic comes as counters (KiB since the driver loaded, summed over the
links), sent as the rate between two readings; XID errors as events, drained
without waiting at each reading. The fault counters beyond the GPU core (PCIe
replays and link, NVLink errors, remapped rows, HBM temperature) are read at most
every `FAULTS_EVERY_S` (rankwatch/agent/faults.py): they move slowly.
"""

import logging
import os
from collections.abc import Callable

import pynvml

from rankwatch.agent import semconv as sc
from rankwatch.agent.devices import Device, Reading
from rankwatch.agent.faults import FAULTS_EVERY_S, Due

log = logging.getLogger("rankwatch.agent")

_UNSUPPORTED = (pynvml.NVMLError_NotSupported, pynvml.NVMLError_FunctionNotFound, pynvml.NVMLError_NoPermission)
_ALL_LINKS = 0xFFFFFFFF  # an NVLink field's scopeId that sums every link
_NVLINK = (
    (sc.NVLINK_TX_BPS, pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX),
    (sc.NVLINK_RX_BPS, pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX),
)
_ECC = (
    (sc.ECC_SBE_VOLATILE, pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_VOLATILE_ECC),
    (sc.ECC_DBE_VOLATILE, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC),
    (sc.ECC_SBE_AGGREGATE, pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_AGGREGATE_ECC),
    (sc.ECC_DBE_AGGREGATE, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_AGGREGATE_ECC),
)
_PCIE = ((sc.PCIE_TX_BPS, pynvml.NVML_PCIE_UTIL_TX_BYTES), (sc.PCIE_RX_BPS, pynvml.NVML_PCIE_UTIL_RX_BYTES))
_NVLINK_ERRORS = (
    (sc.NVLINK_CRC_FLIT_ERRORS, pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT),
    (sc.NVLINK_CRC_DATA_ERRORS, pynvml.NVML_NVLINK_ERROR_DL_CRC_DATA),
    (sc.NVLINK_REPLAY_ERRORS, pynvml.NVML_NVLINK_ERROR_DL_REPLAY),
    (sc.NVLINK_RECOVERY_ERRORS, pynvml.NVML_NVLINK_ERROR_DL_RECOVERY),
)
MAX_XIDS = 16  # XID events sent per reading; a GPU raising more is broken enough, and a reading stays bounded
MIB = 2**20
_FIELD_VALUE = {  # nvmlFieldValue_t.valueType -> the member of its value union
    pynvml.NVML_VALUE_TYPE_DOUBLE: "dVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_INT: "uiVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG: "ulVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: "ullVal",
    pynvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG: "sllVal",
    pynvml.NVML_VALUE_TYPE_SIGNED_INT: "siVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_SHORT: "usVal",
}


def _value(field) -> float:
    """An NVML field value's number, from the member of its union that its type names."""
    return getattr(field.value, _FIELD_VALUE[field.valueType])


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
    """A GPU through NVML: `gpu` is the CUDA device index in this process (a rank's), or the GPU's NVML UUID
    (the node's sidecar's way to the GPU a rank named: rankwatch/agent/nodesampler.py). NVML stays initialised
    until `close()`."""

    source = sc.SOURCE_NVML

    def __init__(self, gpu: int | str, faults_every_s: float = FAULTS_EVERY_S):
        pynvml.nvmlInit()
        try:
            self._handle = visible_handle(gpu) if isinstance(gpu, int) else pynvml.nvmlDeviceGetHandleByUUID(gpu)
            self.index = pynvml.nvmlDeviceGetIndex(self._handle)
        except Exception:
            pynvml.nvmlShutdown()
            raise
        # per metric, the NVML calls that may read it, preferred first
        self._calls: list[list[Callable[[], list[Reading]]]] = [
            [self._power_instant, self._power_average],
            [self._energy],
            [self._sm_clock],
            [self._memory_clock],
            [self._temperature],
            [self._utilization],
            [self._enforced_limit],
            [self._limit_constraints],
            [self._clock_event_reasons, self._clock_throttle_reasons],
            [self._memory],
            [self._ecc],
            [self._xid],
            [self._nvlink],
            [self._pcie],
        ]  # PCIe last: its call measures over 20 ms
        self._fault_calls: list[list[Callable[[], list[Reading]]]] = [
            [self._pcie_replays],
            [self._pcie_link_generation],
            [self._pcie_link_width],
            [self._nvlink_errors],
            [self._remapped_rows],
            [self._memory_temperature],
        ]
        self._faults_due = Due(faults_every_s)
        self._links: list[int] | None = None  # the NVLinks active at the first fault reading
        self._link_counters = list(_NVLINK_ERRORS)  # the error counters they have
        self._warned: set[str] = set()
        self._xid_events = None  # NVML's event set, registered for XID errors at the first reading
        self._nvlink_last: tuple[int, list[float]] | None = None  # (µs, KiB per direction) of the last reading

    def uuid(self) -> str | None:
        """The GPU's NVML UUID ("GPU-…"): the one name for it that every process of the host agrees on,
        whatever CUDA_VISIBLE_DEVICES each was given (None where NVML does not say)."""
        try:
            return pynvml.nvmlDeviceGetUUID(self._handle)
        except pynvml.NVMLError as e:
            log.info("rankwatch: GPU %d: no UUID (%s)", self.index, e)
            return None

    def _read(self) -> list[Reading]:
        readings = self._first_supported(self._calls)
        if self._faults_due():
            readings += self._first_supported(self._fault_calls)
        return readings

    def _first_supported(self, metrics: list[list[Callable[[], list[Reading]]]]) -> list[Reading]:
        """Each metric's readings from the first of its calls that answers (a call the GPU lacks dropped)."""
        readings = []
        for calls in metrics:
            for call in list(calls):
                try:
                    readings += call()
                    break
                except _UNSUPPORTED as e:
                    calls.remove(call)
                    log.info(
                        "rankwatch: GPU %d: %s: %s; %s",
                        self.index,
                        call.__name__.strip("_"),
                        e,
                        f"reading {calls[0].__name__.strip('_')} instead" if calls else "not read again",
                    )
                except pynvml.NVMLError as e:
                    if call.__name__ not in self._warned:
                        self._warned.add(call.__name__)
                        log.warning(
                            "rankwatch: GPU %d: %s failed (%s); skipped while it fails",
                            self.index,
                            call.__name__.strip("_"),
                            e,
                        )
        return readings

    def _fields(self, ids: list) -> list:
        """NVML field values (ids, or (id, scope) pairs); a field's own error raised as NVML's."""
        fields = pynvml.nvmlDeviceGetFieldValues(self._handle, ids)
        for field in fields:
            if field.nvmlReturn != pynvml.NVML_SUCCESS:
                raise pynvml.NVMLError(field.nvmlReturn)
        return list(fields)

    def _power_instant(self) -> list[Reading]:
        (field,) = self._fields([pynvml.NVML_FI_DEV_POWER_INSTANT])
        milliwatts = _value(field)
        return [(sc.POWER_INSTANT_W, milliwatts / 1e3, {sc.POWER_KIND: sc.POWER_KIND_INSTANT})]

    def _power_average(self) -> list[Reading]:
        return [
            (sc.POWER_W, pynvml.nvmlDeviceGetPowerUsage(self._handle) / 1e3, {sc.POWER_KIND: sc.POWER_KIND_AVERAGE})
        ]

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

    def _memory(self) -> list[Reading]:
        memory = pynvml.nvmlDeviceGetMemoryInfo(self._handle)
        return [(sc.FB_USED_MIB, memory.used / MIB, {}), (sc.FB_TOTAL_MIB, memory.total / MIB, {})]

    def _ecc(self) -> list[Reading]:
        return [
            (metric, pynvml.nvmlDeviceGetTotalEccErrors(self._handle, kind, counter), {})
            for metric, kind, counter in _ECC
        ]

    def _xid(self) -> list[Reading]:
        """The XID errors raised since the last reading (at most MAX_XIDS), each its code."""
        if self._xid_events is None:
            events = pynvml.nvmlEventSetCreate()
            try:
                pynvml.nvmlDeviceRegisterEvents(self._handle, pynvml.nvmlEventTypeXidCriticalError, events)
            except pynvml.NVMLError:
                pynvml.nvmlEventSetFree(events)
                raise
            self._xid_events = events
        readings: list[Reading] = []
        while len(readings) < MAX_XIDS:
            try:
                event = pynvml.nvmlEventSetWait_v2(self._xid_events, 0)  # 0 ms: never waits
            except pynvml.NVMLError_Timeout:
                break
            readings.append((sc.XID_ERRORS, float(event.eventData), {}))
        return readings

    def _nvlink(self) -> list[Reading]:
        """NVLink data rates since the last reading, from the links' counters (none at the first)."""
        fields = self._fields([(field_id, _ALL_LINKS) for _, field_id in _NVLINK])
        now = (fields[0].timestamp, [_value(f) for f in fields])
        last, self._nvlink_last = self._nvlink_last, now
        if last is None or now[0] <= last[0]:
            return []
        seconds = (now[0] - last[0]) / 1e6
        return [
            (metric, max(kib - before, 0) * 1024 / seconds, {})
            for (metric, _), kib, before in zip(_NVLINK, now[1], last[1], strict=True)
        ]

    def _pcie(self) -> list[Reading]:
        """PCIe data rates, NVML's KB/s over the call's own 20 ms window, as bytes/s."""
        return [
            (metric, pynvml.nvmlDeviceGetPcieThroughput(self._handle, counter) * 1024.0, {})
            for metric, counter in _PCIE
        ]

    # -- the fault counters ------------------------------------------------------------------------------
    def _pcie_replays(self) -> list[Reading]:
        return [(sc.PCIE_REPLAY_COUNTER, pynvml.nvmlDeviceGetPcieReplayCounter(self._handle), {})]

    def _pcie_link_generation(self) -> list[Reading]:
        return [(sc.PCIE_LINK_GEN, pynvml.nvmlDeviceGetCurrPcieLinkGeneration(self._handle), {})]

    def _pcie_link_width(self) -> list[Reading]:
        return [(sc.PCIE_LINK_WIDTH, pynvml.nvmlDeviceGetCurrPcieLinkWidth(self._handle), {})]

    def _nvlink_errors(self) -> list[Reading]:
        """NVLink error counters, each summed over the links active at the first reading: per link, as
        nvidia-smi reads them (the all-links fields answer 0 on Hopper). A counter the links lack (CRC
        data errors on Hopper) is not asked again; no active link is no NVLink."""
        if self._links is None:
            self._links = [link for link in range(pynvml.NVML_NVLINK_MAX_LINKS) if self._link_active(link)]
        if not self._links:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        readings: list[Reading] = []
        for metric, counter in list(self._link_counters):
            try:
                total = sum(pynvml.nvmlDeviceGetNvLinkErrorCounter(self._handle, link, counter) for link in self._links)
            except _UNSUPPORTED as e:
                log.info("rankwatch: GPU %d: NVLink counter %s: %s; not read again", self.index, metric, e)
                self._link_counters.remove((metric, counter))
                continue
            readings.append((metric, total, {}))
        if not self._link_counters:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return readings

    def _link_active(self, link: int) -> bool:
        try:
            return pynvml.nvmlDeviceGetNvLinkState(self._handle, link) == pynvml.NVML_FEATURE_ENABLED
        except pynvml.NVMLError:  # no such link, or no NVLink at all
            return False

    def _remapped_rows(self) -> list[Reading]:
        corrected, uncorrected, _pending, failed = pynvml.nvmlDeviceGetRemappedRows(self._handle)
        return [
            (sc.REMAPPED_ROWS_CORRECTABLE, corrected, {}),
            (sc.REMAPPED_ROWS_UNCORRECTABLE, uncorrected, {}),
            (sc.ROW_REMAP_FAILURE, float(bool(failed)), {}),
        ]

    def _memory_temperature(self) -> list[Reading]:
        (field,) = self._fields([pynvml.NVML_FI_DEV_MEMORY_TEMP])
        return [(sc.MEMORY_TEMP_C, _value(field), {})]

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
                f"run the job as root, or set it yourself: sudo nvidia-smi -i {self.index} -pl {watts:.0f}"
            ) from e

    def close(self) -> None:
        """Restore the power limit, then let NVML go (once)."""
        if self._handle is not None:
            super().close()
            self._handle = None
            if self._xid_events is not None:
                pynvml.nvmlEventSetFree(self._xid_events)
                self._xid_events = None
            pynvml.nvmlShutdown()
