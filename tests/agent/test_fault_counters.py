"""Fault counters beyond the GPU core: the readers, their slow rate, their way to the collector, and the
hardware analyzer that blames a machine by them.

Two hardware boundaries are faked, nothing else: NVML at the pynvml functions rankwatch/agent/nvml.py calls
(monkeypatched, as tests/agent/test_devices.py does: this machine has no GPU), and /sys/class/infiniband as a
tree of counter files in a temporary directory. The session, sampler, exporter and collector are real.
"""

import threading
from collections import Counter

import pandas as pd
import pynvml
import pytest

from collector.analysis.analyzers import hardware
from collector.analysis.analyzers.stragglers import analyze
from dashboard import evidence
from rankwatch.agent import semconv as sc
from rankwatch.agent.faults import FAULTS_EVERY_S, INFINIBAND_ENV, InfinibandPorts
from rankwatch.agent.nvml import NvmlDevice
from rankwatch.agent.session import Session
from tests.support.infiniband_sysfs import ports
from tests.support.otlp_payloads import query

LINKS = 18  # an H100 SXM's NVLinks
GPU_FAULTS = {
    sc.PCIE_REPLAY_COUNTER,
    sc.PCIE_LINK_GEN,
    sc.PCIE_LINK_WIDTH,
    sc.NVLINK_CRC_FLIT_ERRORS,
    sc.NVLINK_REPLAY_ERRORS,
    sc.REMAPPED_ROWS_CORRECTABLE,
    sc.REMAPPED_ROWS_UNCORRECTABLE,
    sc.ROW_REMAP_FAILURE,
    sc.MEMORY_TEMP_C,
}  # no NVLink CRC data or recovery errors: counters these GPUs' links lack
IB = {sc.IB_SYMBOL_ERRORS, sc.IB_LINK_DOWNED, sc.IB_RCV_ERRORS, sc.IB_XMIT_DISCARDS}
FAULT_CALLS = {
    "nvmlDeviceGetPcieReplayCounter",
    "nvmlDeviceGetCurrPcieLinkGeneration",
    "nvmlDeviceGetCurrPcieLinkWidth",
    "nvmlDeviceGetNvLinkState",
    "nvmlDeviceGetNvLinkErrorCounter",
    "nvmlDeviceGetRemappedRows",
    "nvmlDeviceGetFieldValues",
}


class FaultyNvml:
    """GPUs as pynvml answers for their fault counters (`replays`, `generation`, `nvlink` errors per counter and
    link, of CRC flit and replay errors only, remapped rows, HBM temperature), by GPU index; every other NVML
    device call NotSupported (the GPU's core metrics are tests/agent/test_devices.py's). `errors`: function -> the
    NVML error it raises. Each call is counted, with the thread that made it."""

    def __init__(self):
        self.errors: dict[str, int] = {}
        self.replays = {0: 7, 1: 7}
        self.generation = {0: 5, 1: 4}
        self.nvlink = {
            pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT: [1] * LINKS,
            pynvml.NVML_NVLINK_ERROR_DL_REPLAY: [2] * LINKS,
        }
        self.remapped = (3, 1, 0, 1)  # corrected, uncorrected, pending, failed
        self.calls: Counter[str] = Counter()
        self.threads: set[str] = set()

    def install(self, monkeypatch) -> "FaultyNvml":
        for name in dir(pynvml):
            if name.startswith(("nvmlDevice", "nvmlEventSet")):
                monkeypatch.setattr(pynvml, name, self._counted(name, getattr(self, name, None)))
        for name in ("nvmlInit", "nvmlShutdown"):
            monkeypatch.setattr(pynvml, name, lambda: None)
        return self

    def _counted(self, name, fn):
        def call(*args):
            self.calls[name] += 1
            if name in FAULT_CALLS:
                self.threads.add(threading.current_thread().name)
            if name in self.errors or fn is None:
                raise pynvml.NVMLError(self.errors.get(name, pynvml.NVML_ERROR_NOT_SUPPORTED))
            return fn(*args)

        return call

    def nvmlDeviceGetHandleByIndex(self, index):
        return ("handle", index)

    def nvmlDeviceGetIndex(self, handle):
        return handle[1]

    def nvmlDeviceGetPcieReplayCounter(self, handle):
        return self.replays[handle[1]]

    def nvmlDeviceGetCurrPcieLinkGeneration(self, handle):
        return self.generation[handle[1]]

    def nvmlDeviceGetCurrPcieLinkWidth(self, handle):
        return 16

    def nvmlDeviceGetNvLinkState(self, handle, link):
        if link >= LINKS:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return pynvml.NVML_FEATURE_DISABLED if link == 3 else pynvml.NVML_FEATURE_ENABLED  # link 3 is down

    def nvmlDeviceGetNvLinkErrorCounter(self, handle, link, counter):
        if counter not in self.nvlink:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return self.nvlink[counter][link]

    def nvmlDeviceGetRemappedRows(self, handle):
        return self.remapped

    def nvmlDeviceGetFieldValues(self, handle, field_ids):
        values = (pynvml.c_nvmlFieldValue_t * len(field_ids))()
        for value, field_id in zip(values, field_ids, strict=True):
            field_id = field_id[0] if isinstance(field_id, tuple) else field_id  # (id, scope)
            value.fieldId, value.nvmlReturn = field_id, pynvml.NVML_ERROR_NOT_SUPPORTED
            if field_id == pynvml.NVML_FI_DEV_MEMORY_TEMP:
                value.nvmlReturn, value.valueType = pynvml.NVML_SUCCESS, pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
                value.value.uiVal = 71
        return values


@pytest.fixture
def nvml(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return FaultyNvml().install(monkeypatch)


def by_metric(readings) -> dict:
    return {metric: (value, attributes) for metric, value, attributes in readings}


# -- the readers -----------------------------------------------------------------------------------------------
def test_gpu_fault_counters_are_read_with_dcgm_names_nvlink_summed_over_the_active_links(nvml):
    readings = by_metric(NvmlDevice(1, faults_every_s=0).read())
    assert {metric: value for metric, (value, _) in readings.items()} == {
        sc.PCIE_REPLAY_COUNTER: 7,
        sc.PCIE_LINK_GEN: 4,
        sc.PCIE_LINK_WIDTH: 16,
        sc.NVLINK_CRC_FLIT_ERRORS: LINKS - 1,  # link 3 is down: not read
        sc.NVLINK_REPLAY_ERRORS: 2 * (LINKS - 1),
        sc.REMAPPED_ROWS_CORRECTABLE: 3,
        sc.REMAPPED_ROWS_UNCORRECTABLE: 1,
        sc.ROW_REMAP_FAILURE: 1.0,
        sc.MEMORY_TEMP_C: 71,
    }
    assert all(attributes == {sc.GPU: 1, sc.SOURCE: sc.SOURCE_NVML} for _, attributes in readings.values())


def test_fault_calls_a_gpu_lacks_are_made_once_and_a_passing_error_skips_one_reading(nvml):
    nvml.errors = {
        "nvmlDeviceGetPcieReplayCounter": pynvml.NVML_ERROR_NOT_SUPPORTED,
        "nvmlDeviceGetRemappedRows": pynvml.NVML_ERROR_FUNCTION_NOT_FOUND,  # an older driver
        "nvmlDeviceGetCurrPcieLinkWidth": pynvml.NVML_ERROR_UNKNOWN,
    }
    device = NvmlDevice(0, faults_every_s=0)
    first = by_metric(device.read())
    assert sc.PCIE_REPLAY_COUNTER not in first and sc.ROW_REMAP_FAILURE not in first
    assert sc.PCIE_LINK_WIDTH not in first and first[sc.PCIE_LINK_GEN][0] == 5
    del nvml.errors["nvmlDeviceGetCurrPcieLinkWidth"]
    for _ in range(2):
        later = by_metric(device.read())
    assert later[sc.PCIE_LINK_WIDTH][0] == 16  # asked again after a passing error
    assert nvml.calls["nvmlDeviceGetPcieReplayCounter"] == nvml.calls["nvmlDeviceGetRemappedRows"] == 1
    assert nvml.calls["nvmlDeviceGetCurrPcieLinkWidth"] == 3
    assert nvml.calls["nvmlDeviceGetNvLinkState"] == pynvml.NVML_NVLINK_MAX_LINKS  # the links are found once
    # a counter the links lack is asked of the first link once; those they have, of each active link each time
    counters = nvml.calls["nvmlDeviceGetNvLinkErrorCounter"]
    assert counters == 3 * 2 * (LINKS - 1) + 2  # CRC data and recovery: one call each


def test_a_gpu_without_nvlink_is_not_asked_for_its_errors_again(nvml):
    nvml.errors = {"nvmlDeviceGetNvLinkState": pynvml.NVML_ERROR_NOT_SUPPORTED}  # a PCIe card
    device = NvmlDevice(0, faults_every_s=0)
    for _ in range(3):
        assert sc.NVLINK_REPLAY_ERRORS not in by_metric(device.read())
    assert nvml.calls["nvmlDeviceGetNvLinkState"] == pynvml.NVML_NVLINK_MAX_LINKS
    assert nvml.calls["nvmlDeviceGetNvLinkErrorCounter"] == 0


def test_gpu_fault_counters_are_read_at_their_slow_rate(nvml):
    """At the first sample, then not for FAULTS_EVERY_S (the core metrics, which this GPU lacks, at every sample)."""
    assert FAULTS_EVERY_S >= 5
    device = NvmlDevice(0)
    assert set(by_metric(device.read())) == GPU_FAULTS
    assert device.read() == []
    assert nvml.calls["nvmlDeviceGetPcieReplayCounter"] == 1


def test_infiniband_ports_are_one_series_each_from_a_tree_its_variable_names(tmp_path, monkeypatch):
    root = ports(
        tmp_path / "infiniband",
        {
            "mlx5_0/1": {"symbol_error": 12, "link_downed": 1, "port_rcv_errors": 0, "port_xmit_discards": 4},
            "mlx5_1/1": {"symbol_error": 0, "link_downed": 0},  # a driver with fewer counters
        },
    )
    (root / "mlx5_2" / "ports" / "1").mkdir(parents=True)  # a port without counters
    monkeypatch.setenv(INFINIBAND_ENV, str(root))
    now = [0]
    reader = InfinibandPorts(clock_ns=lambda: now[0])
    assert reader.available
    assert {(a[sc.IB_PORT], metric): value for metric, value, a in reader.read()} == {
        ("mlx5_0/1", sc.IB_SYMBOL_ERRORS): 12,
        ("mlx5_0/1", sc.IB_LINK_DOWNED): 1,
        ("mlx5_0/1", sc.IB_RCV_ERRORS): 0,
        ("mlx5_0/1", sc.IB_XMIT_DISCARDS): 4,
        ("mlx5_1/1", sc.IB_SYMBOL_ERRORS): 0,
        ("mlx5_1/1", sc.IB_LINK_DOWNED): 0,
    }
    now[0] = int((FAULTS_EVERY_S - 1) * 1e9)
    assert reader.read() == []  # not yet
    (root / "mlx5_0/ports/1/counters/symbol_error").write_text("15\n")
    (root / "mlx5_1/ports/1/counters/link_downed").unlink()  # unreadable: left out from then on
    now[0] = int(FAULTS_EVERY_S * 1e9)
    second = {(a[sc.IB_PORT], metric): (value, a) for metric, value, a in reader.read()}
    assert second["mlx5_0/1", sc.IB_SYMBOL_ERRORS] == (15, {sc.SOURCE: sc.SOURCE_HOST, sc.IB_PORT: "mlx5_0/1"})
    assert ("mlx5_1/1", sc.IB_LINK_DOWNED) not in second and len(second) == 5
    ports(root, {"mlx5_1/1": {"link_downed": 0}})
    now[0] = int(2 * FAULTS_EVERY_S * 1e9)
    assert len(reader.read()) == 5  # a port counted in one reading and not the next would jump the host's total


def test_a_host_without_infiniband_has_no_reader(tmp_path):
    assert not InfinibandPorts(tmp_path / "absent").available
    assert InfinibandPorts(tmp_path).read() == []


# -- to the collector --------------------------------------------------------------------------------------------
def test_two_ranks_of_a_host_send_their_own_gpus_counters_and_one_of_them_the_hosts_ports(
    nvml, collector, tmp_path, monkeypatch
):
    """Real sessions, sampler, exporter and collector: each rank's GPU counters come from its own GPU, the
    host's InfiniBand ports from local rank 0 alone, read on the sampler's thread, never the training loop's."""
    monkeypatch.setenv(INFINIBAND_ENV, str(ports(tmp_path / "ib", {"mlx5_0/1": {"symbol_error": 3, "link_downed": 0}})))
    sessions = [
        Session("run-faults", rank, 2, collector.url, collector.token, resource={sc.LOCAL_RANK: rank})
        for rank in (0, 1)
    ]
    for session in sessions:
        with session.step(0):
            pass
    for session in sessions:
        session.shutdown()
    collector.stop()
    rows = query(
        collector.db,
        f"""SELECT rank, metric, gpu, source, attrs->>{sc.json_path(sc.IB_PORT)}, max(value)
            FROM device_samples WHERE run_id = 'run-faults' GROUP BY ALL""",
    )
    of_gpus = {(rank, metric): (index, source, value) for rank, metric, index, source, _, value in rows}
    assert of_gpus[0, sc.PCIE_LINK_GEN] == (0, sc.SOURCE_NVML, 5)
    assert of_gpus[1, sc.PCIE_LINK_GEN] == (1, sc.SOURCE_NVML, 4)  # each rank its own GPU
    assert all((rank, metric) in of_gpus for rank in (0, 1) for metric in GPU_FAULTS)
    infiniband = sorted(row for row in rows if row[1] in IB)
    assert infiniband == [
        (0, sc.IB_LINK_DOWNED, None, sc.SOURCE_HOST, "mlx5_0/1", 0),
        (0, sc.IB_SYMBOL_ERRORS, None, sc.SOURCE_HOST, "mlx5_0/1", 3),
    ]
    assert nvml.threads == {"rankwatch-sampler"}


# -- the hardware analyzer ----------------------------------------------------------------------------------------
RANKS, PER_HOST = 16, 8


def samples(metric: str, by_rank, readings: int = 3) -> list[tuple]:
    """Device samples (rank, ts, metric, value): `by_rank(rank, reading)` at each of `readings` readings."""
    return [(rank, t, metric, float(by_rank(rank, t))) for rank in range(RANKS) for t in range(readings)]


def devices(*groups) -> pd.DataFrame:
    frame = pd.DataFrame([row for group in groups for row in group], columns=["rank", "ts", "metric", "value"])
    return frame.dropna()


def healthy() -> list[list[tuple]]:
    """Every GPU's fault counters as a clean run has them: still, at Gen 5 x16, its HBM at 70 °C."""
    return [
        samples(sc.PCIE_REPLAY_COUNTER, lambda r, t: 2),
        samples(sc.PCIE_LINK_GEN, lambda r, t: 5),
        samples(sc.PCIE_LINK_WIDTH, lambda r, t: 16),
        samples(sc.NVLINK_REPLAY_ERRORS, lambda r, t: 0),
        samples(sc.REMAPPED_ROWS_UNCORRECTABLE, lambda r, t: 0),
        samples(sc.ROW_REMAP_FAILURE, lambda r, t: 0),
        samples(sc.MEMORY_TEMP_C, lambda r, t: 70 + r % 3),
    ]


@pytest.mark.parametrize(
    "cause, metric, fault, detail",
    [
        ("pcie_replays", sc.PCIE_REPLAY_COUNTER, lambda r, t: 2 + 5 * t * (r == 3), "10 PCIe replays"),
        ("pcie_link_degraded", sc.PCIE_LINK_GEN, lambda r, t: 3 if r == 3 else 5, "Gen 3, peers' Gen 5"),
        ("pcie_link_degraded", sc.PCIE_LINK_WIDTH, lambda r, t: 8 if r == 3 else 16, "x8, peers' x16"),
        ("nvlink_errors", sc.NVLINK_REPLAY_ERRORS, lambda r, t: t * (r == 3), "2 replay"),
        ("row_remapping", sc.REMAPPED_ROWS_UNCORRECTABLE, lambda r, t: t * (r == 3), "2 uncorrectable rows remapped"),
        ("row_remapping", sc.ROW_REMAP_FAILURE, lambda r, t: r == 3, "a row remap failed"),
        ("memory_hot", sc.MEMORY_TEMP_C, lambda r, t: 88 if r == 3 else 70 + r % 3, "88 °C, peers' 71 °C"),
    ],
)
def test_a_fault_on_a_slow_ranks_gpu_is_named_with_its_metric_and_not_when_every_gpu_shares_it(
    cause, metric, fault, detail
):
    frame = devices(*healthy(), samples(metric, fault))
    frame = frame.drop_duplicates(["rank", "ts", "metric"], keep="last")  # the fault's samples replace the clean
    assert hardware.causes(devices(*healthy()), [3]) == []
    assert hardware.causes(frame, [3]) == [{"cause": cause, "ranks": [3], "detail": detail, "metric": metric}]
    assert hardware.causes(frame, [5]) == []  # the fault is rank 3's: it explains no other rank
    shared = devices(*healthy(), samples(metric, lambda r, t: fault(3, t)))
    assert hardware.causes(shared.drop_duplicates(["rank", "ts", "metric"], keep="last"), [3]) == []


def test_a_counter_that_drops_when_the_driver_reloads_gained_nothing():
    frame = devices(samples(sc.PCIE_REPLAY_COUNTER, lambda r, t: 9 if (r, t) == (3, 0) else 0))
    assert hardware.causes(frame, [3]) == []


def ib(erring: set[int]) -> list[tuple]:
    """Symbol errors of every host's two ports, read by its local rank 0 (a series per port), rising on the
    second port of the `erring` hosts."""
    return [
        (host * PER_HOST, t, sc.IB_SYMBOL_ERRORS, float(100 * port + 4 * t * (host in erring and port == 1)))
        for host in range(RANKS // PER_HOST)
        for port in range(2)
        for t in range(3)
    ]


def test_infiniband_errors_on_a_host_blame_its_slow_ranks_not_the_ranks_of_clean_hosts():
    placement = pd.DataFrame({"rank": range(RANKS), "host": [f"node{r // PER_HOST}" for r in range(RANKS)]})
    frame = devices(*healthy(), ib(erring={1}))
    placed = hardware.with_hosts(lambda since, until: frame, placement)(None, None)
    assert hardware.causes(placed, [11]) == [
        {"cause": "infiniband_errors", "ranks": [11], "detail": "node1: 8 symbol errors", "metric": sc.IB_SYMBOL_ERRORS}
    ]
    assert hardware.causes(placed, [3]) == []  # node0's ports are clean
    every_host = devices(*healthy(), ib(erring={0, 1}))
    assert hardware.causes(hardware.with_hosts(lambda since, until: every_host, placement)(None, None), [11]) == []
    # without placement the ports speak for the rank that read them
    assert [c["ranks"] for c in hardware.causes(frame, [8, 11])] == [[8]]


def straggling(ranks: int = RANKS, steps: int = 30, slow: int = 11) -> pd.DataFrame:
    """Rank-steps of a synchronous job where `slow` computes 30% longer and the others wait for it."""
    rows = []
    for step in range(steps):
        for rank in range(ranks):
            compute = 0.1 * (1.3 if rank == slow else 1 + 0.002 * (rank % 5))
            rows.append(("r", rank, step, 0.15, compute, 0.15 - compute))
    return pd.DataFrame(rows, columns=["run_id", "rank", "step", "duration_s", "compute_s", "comm_wait_s"])


def test_a_straggler_finding_blames_its_hosts_infiniband_and_the_dashboard_names_the_metric():
    """The straggler analyzer gives the hardware analyzer each sample's host, so a port read by rank 8 speaks
    for rank 11; the dashboard shows the cause with its metric's heading."""
    placement = pd.DataFrame({"rank": range(RANKS), "host": [f"node{r // PER_HOST}" for r in range(RANKS)]})
    (finding,) = analyze(straggling(), placement, devices=devices(*healthy(), ib(erring={1})))
    assert finding.ranks == [11]
    assert finding.evidence["hardware"] == [
        {"cause": "infiniband_errors", "ranks": [11], "detail": "node1: 8 symbol errors", "metric": sc.IB_SYMBOL_ERRORS}
    ]
    assert finding.summary.endswith("; InfiniBand errors on the host (node1: 8 symbol errors) on rank 11")
    shown = dict(evidence.read(finding.evidence).tables)["hardware"].to_dict("records")
    assert shown == [
        {
            "cause": "infiniband_errors",
            "ranks": "11",
            "detail": "node1: 8 symbol errors",
            "metric": "InfiniBand symbol errors",
        }
    ]
