"""The node's own sampling, in its sidecar (rankwatch/agent/node.py): the GPUs its linked ranks named and the
host's own readers, read once per node on one thread, so that a rank's process makes no NVML call and reads
nothing of the host but what is its own (its process: rankwatch/agent/host.py).

A rank on an NVML GPU names it by its UUID as it links (rankwatch/agent/nodelink.py's READS frame: the one name
its process and the sidecar agree on, whatever CUDA_VISIBLE_DEVICES each was given), and local rank 0 hands
over the host's readers (its disks and dirty pages, RAPL zones, InfiniBand ports). The sidecar answers what it
reads: a GPU it cannot open (no NVML here, a GPU this process does not see) stays its rank's to sample, as
without a sidecar; a simulated GPU never comes here (its model follows its own rank's activity). A power cap
stays the rank's: it applies an NVML limit on its own handle.

Each GPU is read every `period_s` through rankwatch/agent/nvml.py's NvmlDevice opened by UUID (its fault counters
at their slow rate there), once however many ranks named it, and its samples go out with the resource of every
rank that named it: ranks sharing a GPU each get them, as when each sampled it, since a rank's device samples
are its GPU's whichever analysis reads them. Samples are stamped in each rank's time base (its clock less the
host's monotonic clock, which the rank tells: rankwatch/agent/clock.py). A rank's finished steps wait here until
its GPU was sampled past their end and then carry its energy over the step; a step waits at most about a second
past its end (sampling stalled, the GPU gone: rankwatch/agent/sampler.py's `covers`) and then goes without.
"""

import logging
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterable

from opentelemetry.sdk.resources import Resource

from rankwatch.agent import semconv as sc
from rankwatch.agent.devices import Device
from rankwatch.agent.faults import InfinibandPorts
from rankwatch.agent.host import HostState
from rankwatch.agent.rapl import Rapl
from rankwatch.agent.sampler import GPU_SAMPLE_S, HOST_SAMPLE_S, Point, Reader, Sampler
from rankwatch.agent.stepspans import StepMarks

log = logging.getLogger("rankwatch.agent")
LEAVE_WAIT_S = 0.05  # how often a rank's link, at its end, looks whether its held steps went out


def host_readers() -> list[Reader]:
    """The host's own readers, read once per host (by its sidecar, else by local rank 0): its disks and dirty
    pages, and the RAPL zones and InfiniBand ports it has."""
    return [
        HostState(own=False, host_wide=True),
        *(reader for reader in (Rapl(), InfinibandPorts()) if reader.available),
    ]


class Feed:
    """What the node reads for one linked rank: its GPU (None: the rank reads its own, or has none) and the host's
    readers (`host_wide`); `clock_ns`: the rank's time base less the host's monotonic clock. Its finished steps
    wait in `held` for their energy where the node reads its GPU."""

    def __init__(
        self,
        resource: Resource,
        gpu: Device | None,
        host_wide: bool,
        clock_ns: int,
        emit: Callable[[StepMarks], object],  # a step, with its energy, to its spans
    ):
        self.resource, self.gpu, self.host_wide, self.clock_ns, self.emit = resource, gpu, host_wide, clock_ns, emit
        self.held: deque[StepMarks] = deque()
        self.lock = threading.Lock()


class NodeSampler:
    """The sidecar's sampling for its linked ranks; `emit(points, resource)` takes each rank's samples (the
    sidecar's export queue). It samples every HOST_SAMPLE_S, and every `gpu_period_s` from the first GPU on."""

    def __init__(self, emit: Callable[[list[Point], Resource], object], gpu_period_s: float = GPU_SAMPLE_S):
        self._emit, self._gpu_period_s = emit, gpu_period_s
        self.why_no_nvml = _load_nvml()  # "" where NVML answers: it stays loaded until `stop`, for every GPU opened
        if self.why_no_nvml:
            log.info("rankwatch node: no NVML (%s): the ranks sample their own GPUs", self.why_no_nvml)
        self._gpus: dict[str, Device] = {}  # UUID -> its GPU, while a linked rank names it
        self._host: list[Reader] = []  # while a linked rank hands them over
        self._feeds: list[Feed] = []
        self._lock = threading.Lock()
        self._sampler = Sampler(
            [],
            self._export,
            HOST_SAMPLE_S,
            now_ns=time.monotonic_ns,
            on_sample=self._release,
            name="rankwatch-node-sampler",
        )
        self._started = False

    def take(
        self,
        resource: Resource,
        gpu_uuid: str | None,
        host_wide: bool,
        clock_ns: int,
        emit: Callable[[StepMarks], object],
    ) -> tuple[Feed | None, str]:
        """A linked rank's hand-over: its feed (None where nothing is read for it) and why its GPU is not read
        here ("" where it is, or none was named). `emit` takes its steps once they carry their energy."""
        gpu, why = self._open(gpu_uuid) if gpu_uuid is not None else (None, "")
        if gpu is None and not host_wide:
            return None, why
        feed = Feed(resource, gpu, host_wide, clock_ns, emit)
        with self._lock:
            if host_wide and not self._host:
                self._host = host_readers()
                self._sampler.add(self._host)
            self._feeds.append(feed)
            if not self._started:
                self._started = True
                self._sampler.start()
        if gpu is not None:  # read once before the rank hears it is: a step it begins then finds its counter read
            self._sampler.flush()
        return feed, why

    def _open(self, uuid: str) -> tuple[Device | None, str]:
        """The GPU named `uuid`, opened at the first rank naming it; or None and why."""
        if self.why_no_nvml:
            return None, f"no NVML: {self.why_no_nvml}"
        import pynvml

        from rankwatch.agent.nvml import NvmlDevice

        with self._lock:
            if (gpu := self._gpus.get(uuid)) is not None:
                return gpu, ""
            try:
                gpu = self._gpus[uuid] = NvmlDevice(uuid)
            except pynvml.NVMLError as e:
                log.info("rankwatch node: GPU %s not opened (%s): its rank samples it", uuid, e)
                return None, f"GPU {uuid}: {type(e).__name__}: {e}"
            self._sampler.add([gpu], self._gpu_period_s)
        log.info("rankwatch node: GPU %d (%s) sampled here for its ranks", gpu.index, uuid)
        return gpu, ""

    def step(self, feed: Feed, marks: StepMarks) -> None:
        """A rank's finished step: to its spans once the node's samples of its GPU passed its end."""
        if feed.gpu is None:
            feed.emit(marks)
            return
        with feed.lock:
            feed.held.append(marks)
        self._release_held(feed)

    def leave(self, feed: Feed) -> None:
        """A rank's link ended: its held steps out (each waits about a second at most), its samples no more; a
        GPU no linked rank names any longer, and the host's readers where none hands them over, are let go."""
        while feed.held:
            self._release_held(feed)
            if feed.held:
                time.sleep(LEAVE_WAIT_S)
        self._sampler.flush()  # its samples until now exported, while it is still among the feeds
        with self._lock:
            self._feeds.remove(feed)
            gone = [uuid for uuid, gpu in self._gpus.items() if all(f.gpu is not gpu for f in self._feeds)]
            unused: list[Reader] = [self._gpus.pop(uuid) for uuid in gone]
            if self._host and not any(f.host_wide for f in self._feeds):
                unused += self._host
                self._host = []
            self._sampler.remove(unused)
        for reader in unused:
            if isinstance(reader, Device):
                reader.close()

    def stop(self) -> None:
        """The last sample, every step still held out, every GPU and NVML let go."""
        if self._started:
            self._sampler.stop()
        with self._lock:
            feeds, gpus = list(self._feeds), list(self._gpus.values())
            self._gpus.clear()
        for feed in feeds:
            if feed.gpu is not None:
                self._release_held(feed, wait=False)
        for gpu in gpus:
            gpu.close()
        if not self.why_no_nvml:
            import pynvml

            pynvml.nvmlShutdown()

    def _release(self) -> None:
        """After each sample: the held steps it covers, out."""
        with self._lock:
            feeds = [feed for feed in self._feeds if feed.held]
        for feed in feeds:
            self._release_held(feed)

    def _release_held(self, feed: Feed, wait: bool = True) -> None:
        """The held steps of a feed with a GPU that the samples cover (all, without `wait`), in order, with the
        GPU's energy over each where its samples reach both ends."""
        assert feed.gpu is not None
        with feed.lock:
            while feed.held and (not wait or self._sampler.covers(feed.held[0].end - feed.clock_ns)):
                marks = feed.held.popleft()
                t0, t1 = marks.start - feed.clock_ns, marks.end - feed.clock_ns
                feed.emit(marks._replace(energy_j=self._sampler.energy_between(t0, t1, feed.gpu.index)))

    def _export(self, batch: list[Point]) -> None:
        """A batch of samples to each linked rank they are of, stamped in its time base."""
        by_gpu: dict[object, list[Point]] = defaultdict(list)  # None: the host's
        for point in batch:
            by_gpu[point[3].get(sc.GPU)].append(point)
        with self._lock:
            feeds = list(self._feeds)
        for feed in feeds:
            points = _shifted(by_gpu.get(feed.gpu.index, []) if feed.gpu is not None else [], feed.clock_ns)
            if feed.host_wide:
                points += _shifted(by_gpu.get(None, []), feed.clock_ns)
            if points:
                self._emit(points, feed.resource)


def _shifted(points: Iterable[Point], by_ns: int) -> list[Point]:
    return [(metric, t + by_ns, value, attributes) for metric, t, value, attributes in points]


def _load_nvml() -> str:
    """Why this process cannot use NVML ("" where it can: then loaded, until `nvmlShutdown`)."""
    try:
        import pynvml
    except ImportError as e:
        return str(e)
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        return f"{type(e).__name__}: {e}"
    return ""
