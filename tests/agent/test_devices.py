"""Device telemetry: the NVML reader and power-cap actuator, the simulated GPU, host RAPL, the sampler.

NVML is replaced at the pynvml boundary (the functions rankwatch/agent/nvml.py calls are
monkeypatched, as Zeus tests its NVML code): the one mock in these tests, of a
hardware boundary that this machine does not have. Everything else runs for
real: the simulated GPU, RAPL files laid out like /sys/class/powercap in a
temporary directory, the sampler's threads.
"""

import logging
import threading
import time
from collections import Counter

import numpy as np
import pynvml
import pytest

from rankwatch.agent import semconv as sc
from rankwatch.agent.export import Exporter
from rankwatch.agent.gpumodel import SW_POWER_CAP, THERMAL, GpuModel, operating_points
from rankwatch.agent.nvml import MAX_XIDS, NvmlDevice
from rankwatch.agent.opendevice import open_device
from rankwatch.agent.rapl import Rapl
from rankwatch.agent.sampler import Sampler
from rankwatch.agent.simdevice import SimulatedDevice
from tests.support.otlp_payloads import query
from tests.support.waits import wait_until

H100 = GpuModel()


class FakeNvml:
    """An H100 as pynvml answers for it. `errors`: pynvml function -> the NVML error it raises
    (NOT_SUPPORTED: the GPU lacks it; FUNCTION_NOT_FOUND: the driver does); `instant`: whether
    the GPU has the instantaneous power field; `permitted`: whether setting the limit is."""

    def __init__(self):
        self.errors: dict[str, int] = {}
        self.instant = True
        self.permitted = True
        self.limit_mw = 650_000  # an operator's limit, below the default
        self.initialised = 0
        self.calls: Counter[str] = Counter()
        self.now_us = 1_000_000  # the field values' timestamps
        self.nvlink_kib = [0, 0]  # the links' counters, TX and RX
        self.xids: list[int] = []  # XID events waiting to be read
        self.event_sets = 0  # created and not yet freed
        self.fields_asked: Counter[int] = Counter()

    def install(self, monkeypatch) -> "FakeNvml":
        for name in dir(pynvml):  # a device call this H100 does not answer is NotSupported, never the real library's
            if name.startswith("nvmlDevice") and not hasattr(self, name):
                monkeypatch.setattr(pynvml, name, self._counted(name, self._unsupported))
        for name in dir(self):
            if name.startswith("nvml"):
                monkeypatch.setattr(pynvml, name, self._counted(name, getattr(self, name)))
        return self

    def _unsupported(self, *args):
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)

    def _counted(self, name, fn):
        def call(*args):
            self.calls[name] += 1
            if name in self.errors:
                raise pynvml.NVMLError(self.errors[name])
            return fn(*args)

        return call

    def nvmlInit(self):
        self.initialised += 1

    def nvmlShutdown(self):
        self.initialised -= 1

    def nvmlDeviceGetHandleByIndex(self, index):
        return ("handle", index)

    def nvmlDeviceGetHandleByUUID(self, uuid):
        return ("handle", {"GPU-aaaa": 2, "GPU-bbbb": 6}[uuid])

    def nvmlDeviceGetIndex(self, handle):
        return handle[1]

    def nvmlDeviceGetFieldValues(self, handle, field_ids):
        values = (pynvml.c_nvmlFieldValue_t * len(field_ids))()
        nvlink = {pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX: 0, pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX: 1}
        for value, field_id in zip(values, field_ids, strict=True):
            field_id, scope = field_id if isinstance(field_id, tuple) else (field_id, 0)
            value.fieldId, value.scopeId, value.timestamp = field_id, scope, self.now_us
            self.fields_asked[field_id] += 1
            if field_id == pynvml.NVML_FI_DEV_POWER_INSTANT and self.instant:
                value.nvmlReturn, value.valueType = pynvml.NVML_SUCCESS, pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
                value.value.uiVal = 612_345  # mW
            elif field_id in nvlink and scope == 0xFFFFFFFF:  # every link's sum
                value.nvmlReturn, value.valueType = pynvml.NVML_SUCCESS, pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
                value.value.ullVal = self.nvlink_kib[nvlink[field_id]]
            else:
                value.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
        return values

    def nvmlDeviceGetMemoryInfo(self, handle):
        return pynvml.c_nvmlMemory_t(total=81_559 * 2**20, free=21_559 * 2**20, used=60_000 * 2**20)

    def nvmlDeviceGetTotalEccErrors(self, handle, error_type, counter_type):
        return {
            (pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_VOLATILE_ECC): 3,
            (pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC): 0,
            (pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_AGGREGATE_ECC): 12,
            (pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_AGGREGATE_ECC): 1,
        }[error_type, counter_type]

    def nvmlDeviceGetPcieThroughput(self, handle, counter):
        return {pynvml.NVML_PCIE_UTIL_TX_BYTES: 1_000, pynvml.NVML_PCIE_UTIL_RX_BYTES: 250_000}[counter]  # KB/s

    def nvmlEventSetCreate(self):
        self.event_sets += 1
        return "event set"

    def nvmlEventSetFree(self, events):
        self.event_sets -= 1

    def nvmlDeviceRegisterEvents(self, handle, event_types, events):
        assert event_types == pynvml.nvmlEventTypeXidCriticalError and events == "event set"

    def nvmlEventSetWait_v2(self, events, timeout_ms):
        assert timeout_ms == 0  # the sampler never waits for an event
        if not self.xids:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)
        return pynvml.c_nvmlEventData_t(eventType=pynvml.nvmlEventTypeXidCriticalError, eventData=self.xids.pop(0))

    def nvmlDeviceGetPowerUsage(self, handle):
        return 598_000  # mW, averaged

    def nvmlDeviceGetTotalEnergyConsumption(self, handle):
        return 123_456_789  # mJ

    def nvmlDeviceGetClockInfo(self, handle, clock):
        return {pynvml.NVML_CLOCK_SM: 1755, pynvml.NVML_CLOCK_MEM: 2619}[clock]

    def nvmlDeviceGetTemperature(self, handle, sensor):
        assert sensor == pynvml.NVML_TEMPERATURE_GPU
        return 64

    def nvmlDeviceGetUtilizationRates(self, handle):
        return pynvml.c_nvmlUtilization_t(gpu=97, memory=41)

    def nvmlDeviceGetEnforcedPowerLimit(self, handle):
        return self.limit_mw

    def nvmlDeviceGetPowerManagementLimit(self, handle):
        return self.limit_mw

    def nvmlDeviceGetPowerManagementLimitConstraints(self, handle):
        return [200_000, 700_000]

    def nvmlDeviceSetPowerManagementLimit(self, handle, milliwatts):
        if not self.permitted:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NO_PERMISSION)
        self.limit_mw = milliwatts

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle):
        return 0x4 | 0x20  # sw power cap, sw thermal slowdown

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle):
        return 0x4 | 0x20


@pytest.fixture
def nvml(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return FakeNvml().install(monkeypatch)


def by_metric(readings) -> dict:
    """metric -> (value, attributes); each metric must appear once."""
    metrics = [metric for metric, _, _ in readings]
    assert len(metrics) == len(set(metrics)), metrics
    return {metric: (value, attributes) for metric, value, attributes in readings}


def reason_names(mask: float) -> set[str]:
    return {name for bit, name in sc.CLOCK_EVENT_REASON_BITS.items() if int(mask) & bit}


# -- NVML reader ------------------------------------------------------------------------------------
def test_nvml_reader_gives_dcgm_metrics_in_watts_and_joules_preferring_instant_power(nvml):
    readings = by_metric(NvmlDevice(3).read())
    values = {metric: value for metric, (value, _) in readings.items()}
    assert values == {
        sc.POWER_INSTANT_W: pytest.approx(612.345),
        sc.ENERGY_J: pytest.approx(123_456.789),
        sc.SM_CLOCK_MHZ: 1755,
        sc.MEM_CLOCK_MHZ: 2619,
        sc.GPU_TEMP_C: 64,
        sc.GPU_UTIL_PCT: 97,
        sc.POWER_LIMIT_W: 650.0,
        sc.POWER_LIMIT_MIN_W: 200.0,
        sc.POWER_LIMIT_MAX_W: 700.0,
        sc.CLOCK_EVENT_REASONS: 0x24,
        sc.FB_USED_MIB: 60_000,
        sc.FB_TOTAL_MIB: 81_559,
        sc.ECC_SBE_VOLATILE: 3,
        sc.ECC_DBE_VOLATILE: 0,
        sc.ECC_SBE_AGGREGATE: 12,
        sc.ECC_DBE_AGGREGATE: 1,
        sc.PCIE_TX_BPS: 1_000 * 1024,
        sc.PCIE_RX_BPS: 250_000 * 1024,
    }  # NVLink: a rate, from the second reading
    assert reason_names(values[sc.CLOCK_EVENT_REASONS]) == {"sw_power_cap", "sw_thermal_slowdown"}
    assert readings[sc.POWER_INSTANT_W][1][sc.POWER_KIND] == sc.POWER_KIND_INSTANT
    assert all(
        attributes[sc.GPU] == 3 and attributes[sc.SOURCE] == sc.SOURCE_NVML for _, attributes in readings.values()
    )
    assert nvml.calls["nvmlDeviceGetPowerUsage"] == 0


def test_nvml_power_falls_back_to_the_average_and_says_so(nvml):
    nvml.instant = False
    device = NvmlDevice(0)
    for _ in range(3):
        readings = by_metric(device.read())
        assert readings[sc.POWER_W] == (
            598.0,
            {sc.GPU: 0, sc.SOURCE: sc.SOURCE_NVML, sc.POWER_KIND: sc.POWER_KIND_AVERAGE},
        )
        assert sc.POWER_INSTANT_W not in readings
    assert nvml.fields_asked[pynvml.NVML_FI_DEV_POWER_INSTANT] == 1  # not supported: not asked again


def test_nvml_calls_not_supported_are_skipped_from_then_on_other_errors_once(nvml):
    nvml.errors = {
        "nvmlDeviceGetTotalEnergyConsumption": pynvml.NVML_ERROR_NOT_SUPPORTED,
        "nvmlDeviceGetCurrentClocksEventReasons": pynvml.NVML_ERROR_FUNCTION_NOT_FOUND,  # an older driver
        "nvmlDeviceGetTemperature": pynvml.NVML_ERROR_UNKNOWN,
    }
    device = NvmlDevice(0)
    first = by_metric(device.read())
    assert sc.ENERGY_J not in first and sc.GPU_TEMP_C not in first
    assert reason_names(first[sc.CLOCK_EVENT_REASONS][0]) == {"sw_power_cap", "sw_thermal_slowdown"}
    nvml.errors = {}
    second = by_metric(device.read())
    assert sc.ENERGY_J not in second  # not supported: never asked again
    assert second[sc.GPU_TEMP_C][0] == 64  # a passing error: asked again
    assert nvml.calls["nvmlDeviceGetTotalEnergyConsumption"] == 1
    assert nvml.calls["nvmlDeviceGetCurrentClocksEventReasons"] == 1
    assert nvml.calls["nvmlDeviceGetCurrentClocksThrottleReasons"] == 2


def test_nvlink_rate_is_the_links_counters_rise_over_the_time_between_readings(nvml):
    device = NvmlDevice(0)
    assert sc.NVLINK_TX_BPS not in by_metric(device.read())  # one counter reading: no rate yet
    nvml.nvlink_kib, nvml.now_us = [45_000_000, 9_000_000], nvml.now_us + 100_000  # KiB, over 100 ms
    rates = by_metric(device.read())
    assert rates[sc.NVLINK_TX_BPS][0] == pytest.approx(45_000_000 * 1024 / 0.1)
    assert rates[sc.NVLINK_RX_BPS][0] == pytest.approx(9_000_000 * 1024 / 0.1)
    # the driver reloaded: counters start over, never a negative rate
    nvml.nvlink_kib, nvml.now_us = [0, 0], nvml.now_us + 100_000
    assert by_metric(device.read())[sc.NVLINK_TX_BPS][0] == 0


def test_xid_errors_are_sent_once_each_as_they_happen_and_the_event_set_freed(nvml):
    device = NvmlDevice(0)
    assert sc.XID_ERRORS not in by_metric(device.read())
    nvml.xids = [48, 79]  # a double-bit ECC error, then the GPU fell off the bus
    assert [value for metric, value, _ in device.read() if metric == sc.XID_ERRORS] == [48, 79]
    assert sc.XID_ERRORS not in by_metric(device.read())
    nvml.xids = [13] * 100  # a storm: a reading takes a bounded number
    assert sum(metric == sc.XID_ERRORS for metric, _, _ in device.read()) == MAX_XIDS
    assert nvml.calls["nvmlEventSetCreate"] == 1
    device.close()
    assert nvml.event_sets == 0 and nvml.initialised == 0


@pytest.mark.parametrize(
    "failing",
    [
        "nvmlDeviceRegisterEvents",
        "nvmlDeviceGetMemoryInfo",
        "nvmlDeviceGetTotalEccErrors",
        "nvmlDeviceGetPcieThroughput",
    ],
)
def test_device_metrics_a_gpu_lacks_or_forbids_are_not_asked_again(nvml, failing):
    nvml.errors = {
        failing: pynvml.NVML_ERROR_NO_PERMISSION if failing.endswith("Events") else pynvml.NVML_ERROR_NOT_SUPPORTED
    }  # ECC off, no NVML events in a container...
    device = NvmlDevice(0)
    for _ in range(3):
        assert sc.POWER_INSTANT_W in by_metric(device.read())  # the rest is read
    assert nvml.calls[failing] == 1
    device.close()
    assert nvml.event_sets == 0


def test_clock_event_reasons_in_words():
    assert sc.clock_event_words(0x4 | 0x40) == ["power cap", "hardware thermal slowdown"]
    assert sc.clock_event_words(0) == []
    assert set(sc.CLOCK_EVENT_REASON_WORDS) == set(sc.CLOCK_EVENT_REASON_BITS.values())


@pytest.mark.parametrize("visible, local_index, gpu", [("4,5", 1, 5), ("GPU-aaaa,GPU-bbbb", 1, 6)])
def test_nvml_device_is_the_one_cuda_numbers_local_index(nvml, monkeypatch, visible, local_index, gpu):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert NvmlDevice(local_index).index == gpu


# -- NVML power-cap actuator ----------------------------------------------------------------------------
def test_nvml_cap_is_clamped_to_the_constraints_and_the_previous_limit_restored_on_close(nvml):
    device = NvmlDevice(0)
    assert device.set_power_cap(150) == 200
    assert nvml.limit_mw == 200_000
    assert device.set_power_cap(450.5) == 450.5
    assert nvml.limit_mw == 450_500
    assert device.set_power_cap(900) == 700
    device.close()
    assert nvml.limit_mw == 650_000  # the operator's limit, not the GPU's default
    assert nvml.initialised == 0


def test_nvml_cap_without_permission_says_what_to_do(nvml):
    nvml.permitted = False
    device = NvmlDevice(2)
    with pytest.raises(PermissionError, match=r"needs root.*nvidia-smi -i 2 -pl 300"):
        device.set_power_cap(300)
    device.close()  # nothing to restore: no second error
    assert nvml.limit_mw == 650_000


# -- which device a rank gets ----------------------------------------------------------------------------
def test_open_device_is_nvml_when_the_driver_answers(nvml):
    device = open_device(1)
    assert isinstance(device, NvmlDevice) and device.index == 1
    device.close()


@pytest.mark.parametrize(
    "failing, error",
    [
        ("nvmlInit", pynvml.NVML_ERROR_LIBRARY_NOT_FOUND),
        ("nvmlDeviceGetHandleByIndex", pynvml.NVML_ERROR_INVALID_ARGUMENT),
    ],
)
def test_without_nvml_a_rank_has_no_gpu_unless_asked_to_simulate_one_and_says_why(nvml, caplog, failing, error):
    """A job on CPUs gets no invented GPU: no device at all by default, a simulated one only where asked."""
    nvml.errors = {failing: error}
    with caplog.at_level(logging.INFO, logger="rankwatch.agent"):
        assert open_device(1) is None
        device = open_device(1, simulate=True)
    assert isinstance(device, SimulatedDevice) and device.index == 1
    assert nvml.initialised == 0
    assert str(pynvml.NVMLError(error)) in caplog.text
    assert "no GPU telemetry (--simulate-gpu simulates one)" in caplog.text and "is simulated" in caplog.text


# -- the simulated GPU ------------------------------------------------------------------------------------
class Load:
    """A utilization the test sets, and a clock it moves."""

    def __init__(self, utilization: float = 1.0):
        self.utilization, self.ns = utilization, 0

    def device(self, model: GpuModel = H100) -> SimulatedDevice:
        return SimulatedDevice(0, model, utilization=lambda: self.utilization, clock_ns=lambda: self.ns)


def test_simulated_power_rises_with_utilization_and_clock():
    load = Load()
    device = load.device()
    powers = []
    for u in (0.0, 0.5, 1.0):
        load.utilization = u
        powers.append(by_metric(device.read())[sc.POWER_INSTANT_W][0])
    assert powers == pytest.approx([H100.idle_w, (H100.idle_w + H100.max_w) / 2, H100.max_w])
    device.throttle_thermal()  # a lower clock at the same load
    throttled = by_metric(device.read())
    assert throttled[sc.SM_CLOCK_MHZ][0] == H100.thermal_clock_mhz
    assert throttled[sc.POWER_INSTANT_W][0] == pytest.approx(
        H100.idle_w + (H100.max_w - H100.idle_w) * (H100.thermal_clock_mhz / H100.clock_max_mhz) ** 3
    )
    assert all(attributes[sc.SOURCE] == sc.SOURCE_SIMULATED for _, attributes in throttled.values())


def test_simulated_cap_lowers_the_clock_until_power_fits_and_compute_slows():
    load = Load()
    device = load.device()
    assert device.compute_scale() == 1.0
    assert device.set_power_cap(400) == 400
    capped = by_metric(device.read())
    clock = capped[sc.SM_CLOCK_MHZ][0]
    assert capped[sc.POWER_INSTANT_W][0] == pytest.approx(400)
    assert capped[sc.POWER_LIMIT_W][0] == 400
    assert clock < H100.clock_max_mhz
    assert device.compute_scale() == pytest.approx(H100.clock_max_mhz / clock)
    assert reason_names(capped[sc.CLOCK_EVENT_REASONS][0]) == {"sw_power_cap"}
    load.utilization = 0.3  # 259 W at full clock: the cap does not bind
    light = by_metric(device.read())
    assert light[sc.SM_CLOCK_MHZ][0] == H100.clock_max_mhz and light[sc.CLOCK_EVENT_REASONS][0] == 0
    assert device.set_power_cap(50) == H100.limit_min_w  # clamped to the constraints
    device.restore_power_cap()
    assert device.power_limit() == H100.limit_max_w and device.compute_scale() == 1.0


def test_simulated_clock_is_floored_where_the_cap_cannot_be_met():
    model = GpuModel(clock_min_mhz=1500.0)
    device = Load().device(model)
    device.set_power_cap(200)
    readings = by_metric(device.read())
    assert readings[sc.SM_CLOCK_MHZ][0] == 1500.0
    assert readings[sc.POWER_INSTANT_W][0] > 200
    device.close()


def test_the_power_model_answers_a_rank_per_element_as_the_device_does():
    """The analyzer and the fleet simulator ask the model for every rank at once."""
    load, limit, thermal = (a.ravel() for a in np.meshgrid([0.0, 0.1, 0.5, 1.0], [200.0, 450.0, 700.0], [False, True]))
    clock, power, reasons = operating_points(H100, load, limit, thermal)
    base = np.where(thermal, H100.thermal_clock_mhz, H100.clock_max_mhz)
    binds = H100.power(load, base) > limit
    assert binds.any() and not binds.all()
    assert np.array_equal(reasons & SW_POWER_CAP > 0, binds)
    assert np.array_equal(reasons & THERMAL > 0, thermal)
    assert np.allclose(power[binds], limit[binds])  # the highest clock that fits (the floor is lower)
    assert np.array_equal(clock[~binds], base[~binds])
    for i in range(len(load)):  # a GPU of the simulator, capped and throttled alike, reads the same
        device = Load(load[i]).device()
        device.set_power_cap(limit[i])
        device.throttle_thermal(bool(thermal[i]))
        readings = by_metric(device.read())
        assert (readings[sc.SM_CLOCK_MHZ][0], readings[sc.POWER_INSTANT_W][0]) == pytest.approx((clock[i], power[i]))
        assert readings[sc.CLOCK_EVENT_REASONS][0] == reasons[i]
        device.close()


def test_simulated_energy_integrates_power_over_time():
    load = Load(1.0)
    device = load.device()
    energy = []
    for at_s, utilization, action in ((10, 0.0, "read"), (15, 1.0, "read"), (20, 1.0, "cap"), (30, 1.0, "read")):
        load.ns, load.utilization = at_s * 10**9, utilization
        if action == "cap":
            device.set_power_cap(400)
        else:
            energy.append(by_metric(device.read())[sc.ENERGY_J][0])
    # 700 W for 10 s, idle 70 W for 5 s, 700 W for 5 s, capped at 400 W for 10 s
    assert energy == pytest.approx([7000, 7000 + 350, 7000 + 350 + 3500 + 4000])
    device.close()


def test_simulated_gpu_reports_memory_links_and_the_errors_injected():
    load = Load(1.0)
    device = load.device()
    busy = by_metric(device.read())
    assert (busy[sc.FB_USED_MIB][0], busy[sc.FB_TOTAL_MIB][0]) == (H100.memory_used_mib, H100.memory_total_mib)
    assert busy[sc.NVLINK_TX_BPS][0] == 0 and busy[sc.PCIE_RX_BPS][0] > 0  # computing: the links are quiet
    assert busy[sc.ECC_DBE_VOLATILE][0] == 0 and sc.XID_ERRORS not in busy
    load.utilization = 0.0  # waiting in a collective
    device.inject_errors(corrected=5, uncorrected=2, xid=48)
    waiting = by_metric(device.read())
    assert waiting[sc.NVLINK_TX_BPS][0] == H100.nvlink_bps
    assert (waiting[sc.ECC_SBE_VOLATILE][0], waiting[sc.ECC_DBE_VOLATILE][0], waiting[sc.XID_ERRORS][0]) == (5, 2, 48)
    assert sc.XID_ERRORS not in by_metric(device.read())  # an XID is sent once
    device.close()


def test_simulated_thermal_throttling_sets_clock_temperature_and_reasons():
    device = Load().device()
    hot_before = by_metric(device.read())[sc.GPU_TEMP_C][0]
    device.throttle_thermal()
    throttled = by_metric(device.read())
    assert throttled[sc.SM_CLOCK_MHZ][0] == H100.thermal_clock_mhz
    assert throttled[sc.GPU_TEMP_C][0] >= H100.thermal_c > hot_before
    assert int(throttled[sc.CLOCK_EVENT_REASONS][0]) == THERMAL
    assert reason_names(THERMAL) == {"sw_thermal_slowdown", "hw_thermal_slowdown"}
    assert device.compute_scale() == pytest.approx(H100.clock_max_mhz / H100.thermal_clock_mhz)
    device.throttle_thermal(False)
    assert by_metric(device.read())[sc.CLOCK_EVENT_REASONS][0] == 0


# -- RAPL -----------------------------------------------------------------------------------------------
def rapl_zone(root, name: str, label: str, energy_uj: int | None, range_uj: int = 262_143_328_850):
    zone = root / name
    zone.mkdir()
    (zone / "name").write_text(label + "\n")
    (zone / "max_energy_range_uj").write_text(f"{range_uj}\n")
    if energy_uj is not None:
        (zone / "energy_uj").write_text(f"{energy_uj}\n")
    return zone


def test_rapl_host_energy_and_power_across_a_wrap(tmp_path):
    package = rapl_zone(tmp_path, "intel-rapl:0", "package-0", 262_143_328_850 - 1_000_000)  # 1 J before the wrap
    rapl_zone(tmp_path, "intel-rapl:0:0", "dram", 5_000_000)  # a subzone: inside the package's count
    rapl_zone(tmp_path, "intel-rapl:1", "package-1", None)  # not readable
    now = [0]
    rapl = Rapl(tmp_path, clock_ns=lambda: now[0])
    assert rapl.available
    readings = []
    for at_s, counter_uj in ((2, 3_000_000), (4, 13_000_000)):
        now[0] = at_s * 10**9
        (package / "energy_uj").write_text(f"{counter_uj}\n")
        readings.append(by_metric(rapl.read()))
    assert [r[sc.HOST_ENERGY_J][0] for r in readings] == pytest.approx([4, 14])
    assert [r[sc.HOST_POWER_W][0] for r in readings] == pytest.approx([2, 5])
    assert readings[0][sc.HOST_POWER_W][1] == {sc.SOURCE: sc.SOURCE_RAPL, sc.RAPL_ZONE: "package-0"}


def test_rapl_without_readable_zones_reads_nothing(tmp_path):
    rapl = Rapl(tmp_path)
    assert not rapl.available and rapl.read() == []


# -- the sampler --------------------------------------------------------------------------------------
def sampler_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("rankwatch-sample")]


def sample_times(batches, metric: str | None = None) -> list[int]:
    return sorted({t for batch in batches for name, t, _, _ in batch if metric in (None, name)})


def test_sampler_samples_at_its_rate_in_batches_and_stops_cleanly():
    batches = []
    utilization = [1.0]
    device = SimulatedDevice(4, utilization=lambda: utilization[0])
    sampler = Sampler([device], batches.append, period_s=0.02, flush_s=0.1).start()
    wait_until(lambda: len(sample_times(batches)) >= 5, "no samples")
    utilization[0] = 0.2
    wait_until(lambda: len(sample_times(batches)) >= 15 and len(batches) >= 3, "too few samples")
    assert not sampler.covers(time.time_ns() + 10**10)  # running: a future moment is not covered yet
    started = time.monotonic()
    sampler.stop()
    assert time.monotonic() - started < 3.0 and sampler_threads() == []
    points = [point for batch in batches for point in batch]
    times = sorted({t for _, t, _, _ in points})
    assert (times[-1] - times[0]) / (len(times) - 1) >= 0.02 * 1e9 * 0.9  # never faster than its 50 Hz
    assert 3 <= len(batches) < len(times)
    assert Counter(metric for metric, _, _, _ in points) == {metric: len(times) for metric, _, _ in device.read()}
    assert all(attributes[sc.GPU] == 4 for _, _, _, attributes in points)
    assert sampler.covers(times[-1])


def test_sampler_energy_between_is_the_counter_delta_interpolated_at_the_ends():
    batches = []
    utilization = [1.0]
    sampler = Sampler(
        [SimulatedDevice(0, utilization=lambda: utilization[0])], batches.append, period_s=0.02, flush_s=0.1
    ).start()
    wait_until(lambda: len(sample_times(batches, sc.ENERGY_J)) >= 5, "too few energy readings")
    utilization[0] = 0.1  # the power, and the counter's slope, change
    wait_until(lambda: len(sample_times(batches, sc.ENERGY_J)) >= 10, "too few energy readings")
    sampler.stop()
    counter = sorted((t, joules) for batch in batches for metric, t, joules, _ in batch if metric == sc.ENERGY_J)
    (t0, e0), (t1, e1), (tn, en) = counter[1], counter[2], counter[-1]
    assert sampler.energy_between(t0, tn) == pytest.approx(en - e0)
    middle = (t0 + t1) // 2
    assert sampler.energy_between(middle, tn) == pytest.approx(en - (e0 + e1) / 2, rel=1e-6)
    assert sampler.energy_between(counter[0][0] - 1, tn) is None  # before the first sample
    assert sampler.energy_between(t0, tn + 1) is None  # past the latest


def test_sampler_goes_on_when_a_reader_fails(caplog):
    class Broken:
        def read(self):
            raise OSError("gone")

    batches = []
    sampler = Sampler([Broken(), SimulatedDevice(0)], batches.append, period_s=0.01, flush_s=0.05)
    with caplog.at_level(logging.ERROR, logger="rankwatch.agent"):
        sampler.start()
        # three rounds past the failures, however loaded the machine
        wait_until(lambda: sum(len(batch) for batch in batches) >= 3 * 10, "the sampler stopped at a failing reader")
        sampler.stop()
    assert caplog.text.count("reading Broken failed") == 1


def test_sampler_drops_the_oldest_batches_while_export_is_stuck():
    release, received = threading.Event(), []

    def stuck(batch):
        release.wait()
        received.append(batch)
        return True

    sampler = Sampler([SimulatedDevice(0)], stuck, period_s=0.01, flush_s=0.02, max_batches=2).start()
    wait_until(lambda: sampler.dropped >= 10 * 10, "nothing dropped while export was stuck")
    stopped_ns = time.time_ns()
    sampler.stop(timeout_s=0.3)  # sampling ends; the export thread is still stuck on the first batch
    release.set()
    sampler.stop()
    assert sampler_threads() == []
    first, last = received  # the batch that was stuck, and the newest, with the last sample, taken at stop
    assert max(t for _, t, _, _ in first) < stopped_ns <= max(t for _, t, _, _ in last)
    assert sampler.dropped >= 10 * 10  # ten metrics a sample, ten samples or more in between


def test_samples_reach_the_collector_with_their_labels(collector, tmp_path):
    rapl_zone(tmp_path, "intel-rapl:0", "package-0", 1_000_000)
    exporter = Exporter(collector.url, collector.token, {sc.RUN_ID: "run-power", sc.RANK: 5})
    exported = []

    def export(batch):
        exported.append(batch)
        return exporter.samples(batch)

    sampler = Sampler([SimulatedDevice(1), Rapl(tmp_path)], export, period_s=0.05, flush_s=0.1).start()
    wait_until(lambda: len(sample_times(exported, sc.ENERGY_J)) >= 3, "too few samples exported")
    sampler.stop()
    exporter.shutdown()
    collector.stop()
    rows = query(
        collector.db,
        """SELECT metric, gpu, source, attrs->>'$."rankwatch.power.kind"',
                                         attrs->>'$."rankwatch.rapl.zone"', count(*)
                                  FROM device_samples WHERE run_id = 'run-power' AND rank = 5 GROUP BY ALL""",
    )
    by_name = {metric: labels for metric, *labels in rows}
    assert by_name[sc.POWER_INSTANT_W][:3] == [1, sc.SOURCE_SIMULATED, sc.POWER_KIND_INSTANT]
    assert by_name[sc.HOST_POWER_W][:4] == [None, sc.SOURCE_RAPL, None, "package-0"]
    assert set(by_name) == {
        sc.POWER_INSTANT_W,
        sc.ENERGY_J,
        sc.SM_CLOCK_MHZ,
        sc.MEM_CLOCK_MHZ,
        sc.GPU_TEMP_C,
        sc.GPU_UTIL_PCT,
        sc.POWER_LIMIT_W,
        sc.POWER_LIMIT_MIN_W,
        sc.POWER_LIMIT_MAX_W,
        sc.CLOCK_EVENT_REASONS,
        sc.FB_USED_MIB,
        sc.FB_TOTAL_MIB,
        sc.ECC_SBE_VOLATILE,
        sc.ECC_DBE_VOLATILE,
        sc.ECC_SBE_AGGREGATE,
        sc.ECC_DBE_AGGREGATE,
        sc.NVLINK_TX_BPS,
        sc.NVLINK_RX_BPS,
        sc.PCIE_TX_BPS,
        sc.PCIE_RX_BPS,
        sc.HOST_ENERGY_J,
        sc.HOST_POWER_W,
    }
    assert sampler.dropped == 0 and by_name[sc.ENERGY_J][-1] >= 3
