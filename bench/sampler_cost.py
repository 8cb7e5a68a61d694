"""CPU cost of one device sample: the sampler reading the simulated GPU, with the metrics it
read before GPU memory, ECC, XID, NVLink and PCIe were added (A) and with all of them (B).

The two readers alternate in rounds on one thread; each figure is the median over rounds of
the thread's CPU time per `Sampler._read_all` (the sampling thread's whole job: read, stamp,
keep the energy counter). At 10 Hz, a sample's cost x 10 is the sampler's share of one core.

`--node`: where NVML is read, a rank's process or its node's sidecar. A fake NVML whose every
call spins `--call-us` µs (standing for the driver's round trip, which a real call spends in the
kernel) answers as an H100 does; each figure is the median over rounds of a sampling thread's CPU
per second over `--seconds`: a local rank 0 sampling its GPU and the host's readers itself (as a
rank without a sidecar does), a rank whose sidecar reads them (its process alone, once a second),
and the sidecar's one thread reading `--gpus` GPUs, per GPU.

Usage: python bench/sampler_cost.py [--rounds 9] [--samples 20000]
       python bench/sampler_cost.py --node [--rounds 3] [--seconds 5] [--gpus 8] [--call-us 20]
"""

import argparse
import statistics
import threading
import time

import pynvml
from opentelemetry.sdk.resources import Resource

from rankwatch.agent import semconv as sc
from rankwatch.agent.faults import InfinibandPorts
from rankwatch.agent.host import HostState
from rankwatch.agent.nodesampler import NodeSampler
from rankwatch.agent.nvml import NvmlDevice
from rankwatch.agent.rapl import Rapl
from rankwatch.agent.sampler import HOST_SAMPLE_S, Sampler
from rankwatch.agent.simdevice import SimulatedDevice

BEFORE = {
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
}


class Before(SimulatedDevice):
    """The simulated GPU as it read before: the same model, the ten earlier metrics."""

    def _read(self):
        return [reading for reading in super()._read() if reading[0] in BEFORE]


def per_sample_us(sampler: Sampler, samples: int) -> float:
    started = time.thread_time_ns()
    for _ in range(samples):
        sampler._read_all()
    return (time.thread_time_ns() - started) / samples / 1e3


def fake_nvml(call_us: float) -> None:
    """pynvml answering as an H100 with 18 active NVLinks, each device call spinning `call_us` µs first."""
    fields = {
        pynvml.NVML_FI_DEV_POWER_INSTANT: 612_000,
        pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX: 1 << 30,
        pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX: 1 << 30,
        pynvml.NVML_FI_DEV_MEMORY_TEMP: 70,
    }

    def field_values(handle, ids):
        values = (pynvml.c_nvmlFieldValue_t * len(ids))()
        for value, field_id in zip(values, ids, strict=True):
            field_id = field_id[0] if isinstance(field_id, tuple) else field_id
            value.fieldId, value.timestamp = field_id, time.monotonic_ns() // 1000
            value.nvmlReturn, value.valueType = pynvml.NVML_SUCCESS, pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
            value.value.ullVal = fields[field_id]
        return values

    def no_event(events, timeout_ms):
        raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)

    def link_state(handle, link):
        if link >= 18:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return pynvml.NVML_FEATURE_ENABLED

    answers = {
        "nvmlInit": lambda: None,
        "nvmlShutdown": lambda: None,
        "nvmlDeviceGetHandleByIndex": lambda index: ("gpu", index),
        "nvmlDeviceGetHandleByUUID": lambda uuid: ("gpu", int(uuid.rsplit("-", 1)[1])),
        "nvmlDeviceGetIndex": lambda handle: handle[1],
        "nvmlDeviceGetUUID": lambda handle: f"GPU-bench-{handle[1]}",
        "nvmlDeviceGetFieldValues": field_values,
        "nvmlDeviceGetTotalEnergyConsumption": lambda handle: time.monotonic_ns() // 1_000_000,
        "nvmlDeviceGetClockInfo": lambda handle, clock: 1755,
        "nvmlDeviceGetTemperature": lambda handle, sensor: 60,
        "nvmlDeviceGetUtilizationRates": lambda handle: pynvml.c_nvmlUtilization_t(gpu=97, memory=40),
        "nvmlDeviceGetEnforcedPowerLimit": lambda handle: 700_000,
        "nvmlDeviceGetPowerManagementLimitConstraints": lambda handle: [200_000, 700_000],
        "nvmlDeviceGetCurrentClocksEventReasons": lambda handle: 0,
        "nvmlDeviceGetMemoryInfo": lambda handle: pynvml.c_nvmlMemory_t(total=80 << 30, free=20 << 30, used=60 << 30),
        "nvmlDeviceGetTotalEccErrors": lambda handle, kind, counter: 0,
        "nvmlEventSetCreate": lambda: "events",
        "nvmlEventSetFree": lambda events: None,
        "nvmlDeviceRegisterEvents": lambda handle, kinds, events: None,
        "nvmlEventSetWait_v2": no_event,
        "nvmlDeviceGetPcieThroughput": lambda handle, counter: 1000,
        "nvmlDeviceGetPcieReplayCounter": lambda handle: 0,
        "nvmlDeviceGetCurrPcieLinkGeneration": lambda handle: 5,
        "nvmlDeviceGetCurrPcieLinkWidth": lambda handle: 16,
        "nvmlDeviceGetNvLinkState": link_state,
        "nvmlDeviceGetNvLinkErrorCounter": lambda handle, link, counter: 0,
        "nvmlDeviceGetRemappedRows": lambda handle: (0, 0, 0, 0),
    }

    def unsupported(*args):
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)

    def driver(fn):
        def call(*args):
            until = time.perf_counter_ns() + call_us * 1000
            while time.perf_counter_ns() < until:  # the driver's round trip, on this thread's CPU
                pass
            return fn(*args)

        return call

    for name in dir(pynvml):
        if name.startswith(("nvmlDevice", "nvmlEventSet")) or name in answers:
            setattr(pynvml, name, driver(answers.get(name, unsupported)))


def cpu_per_s(thread: threading.Thread, seconds: float) -> float:
    """The thread's CPU seconds per second over `seconds` (after one second to settle)."""
    clock = time.pthread_getcpuclockid(thread.ident)
    time.sleep(1.0)
    started = time.clock_gettime_ns(clock)
    time.sleep(seconds)
    return (time.clock_gettime_ns(clock) - started) / 1e9 / seconds


def node_round(seconds: float, gpus: int) -> dict[str, float]:
    """One round: each sampling thread alone for `seconds`; CPU seconds per second (the node's per GPU)."""
    rank_alone = Sampler(
        [NvmlDevice(0), HostState(host_wide=True), *(r for r in (Rapl(), InfinibandPorts()) if r.available)],
        lambda batch: True,
    ).start()  # local rank 0 without a sidecar, as a session builds it
    figures = {"rank, reading NVML itself": cpu_per_s(rank_alone._sampling, seconds)}
    rank_alone.stop()
    rank_linked = Sampler([HostState()], lambda batch: True, HOST_SAMPLE_S).start()  # its sidecar reads the rest
    figures["rank, its sidecar reading NVML"] = cpu_per_s(rank_linked._sampling, seconds)
    rank_linked.stop()
    node = NodeSampler(lambda points, resource: None)
    for gpu in range(gpus):
        resource = Resource.create({sc.RANK: gpu, sc.LOCAL_RANK: gpu})
        node.take(resource, f"GPU-bench-{gpu}", gpu == 0, 0, lambda marks: None)
    figures["sidecar, per GPU"] = cpu_per_s(node._sampler._sampling, seconds) / gpus
    node.stop()
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=None, help="default 9 (3 with --node)")
    parser.add_argument("--samples", type=int, default=20000)
    parser.add_argument("--node", action="store_true", help="NVML read by the rank or by its node's sidecar")
    parser.add_argument("--seconds", type=float, default=5.0, help="--node: each thread's measured run")
    parser.add_argument("--gpus", type=int, default=8, help="--node: the GPUs the sidecar reads")
    parser.add_argument("--call-us", type=float, default=20.0, help="--node: each fake NVML call's CPU")
    args = parser.parse_args()
    if args.node:
        fake_nvml(args.call_us)
        rounds = [node_round(args.seconds, args.gpus) for _ in range(args.rounds or 3)]
        for name in rounds[0]:
            median = statistics.median(r[name] for r in rounds)
            print(f"{name:32} {median * 1e3:7.3f} ms CPU/s  ({median * 100:.3f}% of a core)")
        return
    args.rounds = args.rounds or 9
    samplers = {
        name: Sampler([cls(0, utilization=lambda: 0.7)], lambda batch: True)
        for name, cls in (("A: before", Before), ("B: all metrics", SimulatedDevice))
    }
    times: dict[str, list[float]] = {name: [] for name in samplers}
    for i in range(args.rounds):
        for name in list(samplers) if i % 2 == 0 else list(samplers)[::-1]:
            times[name].append(per_sample_us(samplers[name], args.samples))
    for name, sampler in samplers.items():
        median = statistics.median(times[name])
        print(
            f"{name:16} {len(sampler._read_all()):3d} points/sample  {median:6.1f} us CPU/sample  "
            f"{median * 10 / 1e4:.4f}% of a core at 10 Hz"
        )
    a, b = (statistics.median(t) for t in times.values())
    print(f"B / A: {b / a:.2f}x CPU per sample")


if __name__ == "__main__":
    main()
