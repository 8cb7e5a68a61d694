"""GPU telemetry read once per node: the node's sidecar samples the GPUs its linked ranks name, and the host's own
readers, so that a rank's process makes no NVML reading (rankwatch/agent/nodesampler.py).

One hardware boundary is faked, nothing else: NVML, at the pynvml functions rankwatch/agent/nvml.py calls
(monkeypatched, as tests/agent/test_devices.py and tests/agent/test_fault_counters.py do: this machine has no GPU),
as two
GPUs drawing constant, different power, whose energy counters therefore rise linearly; each call is counted with
the GPU it asks about and the thread that made it. InfiniBand's sysfs tree is a directory of counter files. The
sidecar (`Node`, in this process), the ranks' sessions linked to it through its socket, their samplers,
exporters and a collector are real.
"""

import logging
import socket
import threading
import time
from collections import Counter

import pynvml
import pytest

from rankwatch.agent import sampler
from rankwatch.agent import semconv as sc
from rankwatch.agent.apiclient import ApiClient
from rankwatch.agent.config import NODE_ENV
from rankwatch.agent.faults import INFINIBAND_ENV, InfinibandPorts
from rankwatch.agent.node import Node
from rankwatch.agent.session import Session
from tests.support.infiniband_sysfs import ports
from tests.support.waits import wait_until

WATTS = {0: 100.0, 1: 300.0}  # each GPU's constant draw
UUIDS = {0: "GPU-00000000-aaaa", 1: "GPU-11111111-bbbb"}
RESOLVING = {  # what a rank's process asks NVML to name its GPU: no reading
    "nvmlInit",
    "nvmlShutdown",
    "nvmlDeviceGetHandleByIndex",
    "nvmlDeviceGetIndex",
    "nvmlDeviceGetUUID",
}
NODE_SAMPLER = "rankwatch-node-sampler"  # the sidecar's one sampling thread
RANK_SAMPLER = "rankwatch-sampler"
STEPS, STEP_S = 8, 0.1


class TwoGpus:
    """Two GPUs as pynvml answers for them: power (the driver's average), the energy counter (mJ, rising at each
    GPU's WATTS), temperature 40 + index; every other device call NotSupported. `unloadable`: NVML's library
    fails to load (nvmlInit raises). Each call is counted in `calls` as (function, GPU index or None, thread)."""

    def __init__(self):
        self.unloadable = False
        self.calls: Counter[tuple[str, int | None, str]] = Counter()
        self.started_ns = time.monotonic_ns()

    def install(self, monkeypatch) -> "TwoGpus":
        for name in dir(pynvml):
            if name.startswith(("nvmlDevice", "nvmlEventSet")) or name in ("nvmlInit", "nvmlShutdown"):
                monkeypatch.setattr(pynvml, name, self._counted(name, getattr(self, name, None)))
        return self

    def _counted(self, name, fn):
        def call(*args):
            gpu = args[0][1] if args and isinstance(args[0], tuple) else None
            self.calls[name, gpu, threading.current_thread().name] += 1
            if fn is None:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
            return fn(*args)

        return call

    def nvmlInit(self):
        if self.unloadable:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    def nvmlShutdown(self):
        pass

    def nvmlEventSetCreate(self):
        return "event set"

    def nvmlEventSetFree(self, events):
        pass

    def nvmlDeviceGetHandleByIndex(self, index):
        return ("handle", index)

    def nvmlDeviceGetHandleByUUID(self, uuid):
        return ("handle", {u: i for i, u in UUIDS.items()}[uuid])

    def nvmlDeviceGetIndex(self, handle):
        return handle[1]

    def nvmlDeviceGetUUID(self, handle):
        return UUIDS[handle[1]]

    def nvmlDeviceGetPowerUsage(self, handle):
        return int(WATTS[handle[1]] * 1e3)

    def nvmlDeviceGetTotalEnergyConsumption(self, handle):
        return int(WATTS[handle[1]] * (time.monotonic_ns() - self.started_ns) / 1e6)  # W x ns / 1e6 = mJ

    def nvmlDeviceGetTemperature(self, handle, sensor):
        return 40 + handle[1]

    def readings(self, thread: str | None = None) -> Counter[int | None]:
        """Reading calls (a GPU's, but those naming it) per GPU, made on `thread` (None: on any)."""
        return Counter(
            {
                gpu: count
                for (name, gpu, on), count in self.calls.items()
                if gpu is not None and name not in RESOLVING and thread in (None, on)
            }
        )


@pytest.fixture
def gpus(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    # a step waits for its GPU's samples however late they come: the sidecar's sampling thread shares this
    # process with the test, and on a loaded machine ran over a second late, which lets steps go without
    # their energy (rankwatch/agent/sampler.py, as a sidecar of its own would seldom be)
    monkeypatch.setattr(sampler, "STUCK_NS", 60 * 10**9)
    return TwoGpus().install(monkeypatch)


def train(sessions: list[Session], steps: range = range(STEPS), end: bool = True) -> None:
    """`steps` on each rank, taking turns, then (`end`) each session's end."""
    for i in steps:
        for session in sessions:
            with session.step(i), session.phase("forward"):
                time.sleep(STEP_S)
    for session in sessions if end else ():
        session.shutdown()


def sessions(collector, run_id: str) -> list[Session]:
    """Two ranks of one host, local ranks 0 and 1: GPUs 0 and 1."""
    return [Session(run_id, rank, 2, collector.url, collector.token, resource={sc.LOCAL_RANK: rank}) for rank in (0, 1)]


def rows(collector, sql: str) -> list:
    return ApiClient(collector.url, collector.token).post("/api/v1/query", {"sql": sql})["rows"]


def stored(collector, run_id: str, ranks: int = 2) -> tuple[dict, dict]:
    """(rank -> [(duration s, energy J)] of its steps, rank -> {metric: {(gpu, source, value)}}) of the run, from
    the live collector's store once every rank's steps and GPU samples are in."""
    where = f"run_id = '{run_id}'"
    wait_until(
        lambda: (
            rows(collector, f"SELECT count(*) FROM steps WHERE {where}") == [[ranks * STEPS]]
            and rows(collector, f"SELECT count(DISTINCT rank) FROM device_samples WHERE {where} AND gpu IS NOT NULL")
            == [[ranks]]
        ),
        f"the steps and GPU samples of {run_id} not stored",
    )
    steps = rows(collector, f"SELECT rank, duration_s, energy_j FROM steps WHERE {where} ORDER BY step")
    samples = rows(collector, f"SELECT DISTINCT rank, metric, gpu, source, value FROM device_samples WHERE {where}")
    by_rank: dict = {}
    for rank, duration, energy in steps:
        by_rank.setdefault(rank, []).append((duration, energy))
    metrics: dict = {}
    for rank, metric, gpu, source, value in samples:
        metrics.setdefault(rank, {}).setdefault(metric, set()).add((gpu, source, value))
    return by_rank, metrics


def assert_own_gpus(steps: dict, metrics: dict) -> None:
    """Each rank's samples are its own GPU's, and each step carries that GPU's energy over it: its draw times the
    step's length, within 20 ms of draw (a sample is stamped just before its GPU is read: on a loaded machine,
    another thread may run in between)."""
    for rank in steps:
        assert metrics[rank][sc.GPU_TEMP_C] == {(rank, sc.SOURCE_NVML, 40 + rank)}
        assert metrics[rank][sc.POWER_W] == {(rank, sc.SOURCE_NVML, WATTS[rank])}
        assert len(steps[rank]) == STEPS
        for duration, energy in steps[rank]:
            assert energy == pytest.approx(WATTS[rank] * duration, abs=WATTS[rank] * 0.02)


def test_the_sidecar_reads_each_ranks_gpu_and_gives_each_step_its_energy(gpus, module_collector, tmp_path, monkeypatch):
    """Two ranks linked to a real sidecar, each on its own GPU: every NVML reading is made on the sidecar's sampling
    thread, each GPU read there; the ranks only name their GPU (its UUID, once). Each rank's samples in the store
    are its own GPU's, each step span carries that GPU's energy over the step, and the host's InfiniBand ports are
    read by the sidecar and stored as local rank 0's."""
    monkeypatch.setenv(INFINIBAND_ENV, str(ports(tmp_path / "ib", {"mlx5_0/1": {"symbol_error": 3}})))
    port_reads: list[str] = []
    read_ports = InfinibandPorts.read
    monkeypatch.setattr(
        InfinibandPorts, "read", lambda self: port_reads.append(threading.current_thread().name) or read_ports(self)
    )
    node = Node(str(tmp_path / "node.sock"), module_collector.url, module_collector.token)
    monkeypatch.setenv(NODE_ENV, str(tmp_path / "node.sock"))
    ranks = sessions(module_collector, "node-gpus")
    assert [session._gpu_here for session in ranks] == [False, False]  # the sidecar reads both
    train(ranks)
    node.stop()

    assert gpus.readings() == gpus.readings(NODE_SAMPLER)  # no reading anywhere else
    assert set(gpus.readings(NODE_SAMPLER)) == {0, 1}
    made_by_ranks = {(name, gpu) for name, gpu, thread in gpus.calls if not thread.startswith("rankwatch-node")}
    assert {name for name, _ in made_by_ranks} <= RESOLVING
    assert [gpus.calls["nvmlDeviceGetUUID", gpu, "MainThread"] for gpu in (0, 1)] == [1, 1]
    assert set(port_reads) == {NODE_SAMPLER}

    steps, metrics = stored(module_collector, "node-gpus")
    assert_own_gpus(steps, metrics)
    assert metrics[0][sc.IB_SYMBOL_ERRORS] == {(None, sc.SOURCE_HOST, 3)}
    assert sc.IB_SYMBOL_ERRORS not in metrics[1]


def test_a_rank_without_a_sidecar_samples_its_own_gpu(gpus, module_collector, monkeypatch):
    """No sidecar: the rank reads its GPU on its own sampler thread, as before, and its steps carry its energy."""
    monkeypatch.delenv(NODE_ENV, raising=False)
    ranks = sessions(module_collector, "own-gpus")
    train(ranks)
    assert set(gpus.readings(RANK_SAMPLER)) == {0, 1}
    assert not any(name == "nvmlDeviceGetUUID" for name, _, _ in gpus.calls)  # nobody to name it to
    assert_own_gpus(*stored(module_collector, "own-gpus"))


def test_a_sidecar_without_nvml_leaves_the_ranks_sampling_their_own(
    gpus, module_collector, tmp_path, monkeypatch, caplog
):
    """A sidecar where NVML does not load: each rank says so once and samples its own GPU; its telemetry still goes
    through the sidecar, with its energy."""
    gpus.unloadable = True
    node = Node(str(tmp_path / "node.sock"), module_collector.url, module_collector.token)
    gpus.unloadable = False
    monkeypatch.setenv(NODE_ENV, str(tmp_path / "node.sock"))
    with caplog.at_level(logging.INFO, logger="rankwatch.agent"):
        ranks = sessions(module_collector, "no-nvml-node")
    said = [r.getMessage() for r in caplog.records if "the node sidecar reads no GPU" in r.getMessage()]
    assert len(said) == 2 and all("no NVML" in line for line in said), said
    train(ranks)
    node.stop()
    assert gpus.readings(NODE_SAMPLER) == Counter()
    assert set(gpus.readings(RANK_SAMPLER)) == {0, 1}
    assert_own_gpus(*stored(module_collector, "no-nvml-node"))


def test_a_rank_whose_sidecar_goes_away_reads_its_gpu_itself(gpus, module_collector, tmp_path, monkeypatch):
    """The rank's link breaks mid-job (as where its sidecar dies): the rank reads its GPU itself from then on, and
    exports on its own; every step carries its GPU's energy, measured by the sidecar before and by the rank after."""
    node = Node(str(tmp_path / "node.sock"), module_collector.url, module_collector.token)
    monkeypatch.setenv(NODE_ENV, str(tmp_path / "node.sock"))
    (rank,) = ranks = [Session("node-gone", 0, 1, module_collector.url, module_collector.token)]
    train(ranks, range(STEPS // 2), end=False)
    assert gpus.readings(RANK_SAMPLER) == Counter()
    rank.exporter._sock.shutdown(socket.SHUT_RDWR)
    rank.event("link_broken")  # the next write finds it broken
    wait_until(lambda: gpus.readings(RANK_SAMPLER)[0] > 0, "the rank did not read its GPU itself")
    train(ranks, range(STEPS // 2, STEPS))
    node.stop()
    assert_own_gpus(*stored(module_collector, "node-gone", ranks=1))
