"""One rank's telemetry session: steps, phases, collectives and values -> spans.

A step is recorded as marks (monotonic readings on CPU, CUDA events on GPU);
when the step ends it waits in `pending` until its marks are readable, then
becomes one `step` span with `phase` and `comm` children. Nothing here
blocks the training loop: GPU marks are read when the GPU has passed them,
and export happens in the SDK's background thread. The step's exposed
communication wait is interval arithmetic over its marks (rankwatch/agent/timeline.py).
"""

import json
import os
import socket
import threading
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

from opentelemetry._logs import SeverityNumber

from rankwatch.agent import semconv as sc
from rankwatch.agent.clock import Clock, CpuTimer, Timer
from rankwatch.agent.config import HEARTBEAT_S, UNDELIVERED_ENV, simulate_gpu
from rankwatch.agent.export import Exporter, log
from rankwatch.agent.host import HostState
from rankwatch.agent.nodecontrol import answering
from rankwatch.agent.nodelink import NodeLink, node_socket
from rankwatch.agent.nodesampler import host_readers
from rankwatch.agent.opendevice import open_device
from rankwatch.agent.sampler import GPU_SAMPLE_S, HOST_SAMPLE_S, Sampler
from rankwatch.agent.spanwire import AttributeValue
from rankwatch.agent.stepspans import COMPUTE_PHASES, SYNC, Comm, Move, StepMarks

REALIGN_EVERY = 500  # steps between clock re-alignments


@dataclass(slots=True)
class Collective:
    """One collective as two marks of the session's timer: `start` at its launch (on CUDA an event
    on the launching stream: when that stream reached the call; for a DDP bucket, when its gradients
    were ready) and `end` once it completed (on CUDA an event on a stream that waited for it); or two
    monotonic readings (`stream` None) where its group is not NCCL's. `stream`: the calling stream
    where the marks are stream events. `lane`: the queue it runs in, one at a time in issue order,
    where the agent knows it (None: not ordered after any other). `peer`: the other rank (global) of a
    point-to-point operation. `waited`: where the calling stream (or thread) began to wait for an
    async_op=True call's work, if it has."""

    op: str
    group: str
    group_size: int
    seq: int
    nbytes: int
    start: object
    waits: str = SYNC
    end: object = None
    stream: int | None = None
    lane: tuple | None = None
    peer: int | None = None
    waited: object = None  # where the caller first waited for an async_op=True call (same clock as start)


@dataclass(slots=True)
class Transfer:
    """One copy between memory tiers (semconv.TIERS): two marks of the session's timer where a GPU is
    one end (CUDA events on the copying stream), else two monotonic readings (host and disk I/O, from
    any thread). `what`: what moved (optimizer state, parameters, gradients, activations)."""

    src: str
    dst: str
    nbytes: int
    what: str
    start: object
    end: object = None
    stream: int | None = None  # the copying stream, where a GPU is one end
    thread: int = 0  # the thread that copied
    cpu_ns: int = 0  # that thread's CPU time over the copy (a copy of page-cache data is the CPU's work)


@dataclass
class _Step:
    step: int
    start: object
    stream: int | None = None  # the stream its phases are marked on
    end: object = None
    phases: list = field(default_factory=list)  # (name, start mark, end mark)
    collectives: list[Collective] = field(default_factory=list)
    values: dict = field(default_factory=dict)
    transfers: list[Transfer] = field(default_factory=list)
    host_work: list = field(default_factory=list)  # (name, start, end) in monotonic ns, from any thread
    thread: int = 0  # the training loop's


class Session:
    """Telemetry of one rank; see rankwatch/agent/__init__.py for the public functions."""

    def __init__(
        self,
        run_id: str,
        rank: int,
        world_size: int,
        collector: str | None,
        token: str | None,
        resource: dict | None = None,
        timer: Timer | None = None,
        heartbeat_s: float = HEARTBEAT_S,
        sample_s: float = GPU_SAMPLE_S,
    ):
        self.run_id, self.rank, self.world_size = run_id, rank, world_size
        self.clock = Clock()
        self.timer: Timer = timer or CpuTimer()
        self.roles: dict[
            str, str
        ] = {}  # process group name -> its DeviceMesh dimension (rankwatch/agent/collectives.py)
        attributes = {
            sc.RUN_ID: run_id,
            sc.RANK: rank,
            sc.WORLD_SIZE: world_size,
            sc.HOST_NAME: socket.gethostname(),
            sc.PROCESS_PID: os.getpid(),
            **(resource or {}),
        }
        self.exporter = _sink(collector, token, attributes) if collector else None
        # a rank without a node sidecar takes its run's stacks requests itself (a sidecar asks its ranks)
        self._stacks = (
            answering(self.exporter, collector, token, run_id, rank)
            if collector and isinstance(self.exporter, Exporter)
            else None
        )
        self._current: _Step | None = None
        self._phase: str | None = None
        local_rank = int((resource or {}).get(sc.LOCAL_RANK, 0))
        # a simulated GPU (where asked for) is busy while the rank computes; None: no GPU
        self.device = open_device(
            local_rank, utilization=lambda: float(self._phase in COMPUTE_PHASES), simulate=simulate_gpu()
        )
        self._lock = threading.Lock()
        # the sampler reads the rank's process (and its view of the host) once a second, and its GPU and the host's
        # own readers (one rank per host) where no node sidecar reads them for it (rankwatch/agent/nodesampler.py)
        self._sample_s, self._gpu_here, self._host_here = sample_s, False, False
        self._node_reads = False  # whether the node's sidecar reads any of them: it is told the rank's clock then
        self.sampler = (
            Sampler(
                [HostState()],
                self.exporter.samples,
                max(sample_s, HOST_SAMPLE_S),
                now_ns=self.clock.now_ns,
                on_sample=self._emit_ready,
            )
            if self.exporter
            else None
        )
        if self.sampler:
            gpu, host = self.device is not None, local_rank == 0
            there = (False, False)  # what the node's sidecar reads for the rank: its GPU, the host's readers
            if isinstance(self.exporter, NodeLink):
                uuid = self.device.uuid() if self.device is not None else None  # a simulated GPU's stays here
                if uuid is not None or host:
                    # where the sidecar goes away later, the rank reads them all itself from then on
                    there = self.exporter.hand_over(uuid, host, self.clock.wall(0), lambda: self._read_here(gpu, host))
            self._node_reads = any(there)
            self._read_here(gpu and not there[0], host and not there[1])
        self._pending: deque[_Step] = deque()
        self._between: tuple[list[Transfer], list] = ([], [])  # transfers and host work done between steps
        self._seq: dict[str, int] = {}
        self._last_collective: Collective | None = None
        self._emitting = threading.Lock()
        self._stop = threading.Event()
        self._ended = False
        self._last_step: int | None = None  # the step last begun: the one the `ended` event names
        self._heartbeat = threading.Thread(
            target=self._beat, args=(heartbeat_s,), name="rankwatch-heartbeat", daemon=True
        )
        self._align()
        if self.exporter:
            self._heartbeat.start()
        if self.sampler:  # there is one where there is an exporter
            self.sampler.start()

    def _read_here(self, gpu: bool, host: bool) -> None:
        """The sampler reads the rank's GPU (every `sample_s`: a step's energy waits for the sample after its
        end) and the host's own readers, those of them it does not read yet: where no node sidecar reads them
        for the rank, or no longer does."""
        with self._lock:
            gpu, host = gpu and not self._gpu_here, host and not self._host_here
            self._gpu_here, self._host_here = self._gpu_here or gpu, self._host_here or host
        if (gpu or host) and self.sampler is not None:
            readers = ([self.device] if gpu and self.device is not None else []) + (host_readers() if host else [])
            self.sampler.add(readers, self._sample_s if gpu else None)

    def _align(self) -> None:
        """The clock aligned to rank 0's (a collective), and the node's sidecar told where it samples for the rank."""
        self.clock.align()
        if self._node_reads and isinstance(self.exporter, NodeLink):
            self.exporter.clock(self.clock.wall(0))

    # -- the training loop's side -------------------------------------------------------------------
    @contextmanager
    def step(self, step: int):
        current = _Step(step, self.timer.mark(), self.timer.current_stream(), thread=threading.get_ident())
        self._last_step = step
        if self._between[0] or self._between[1]:  # what another thread did between steps counts in this one
            with self._lock:
                (current.transfers, current.host_work), self._between = self._between, ([], [])
        self._current = current  # (one done from here on goes in it; one done just before, in the next)
        try:
            yield current
        finally:
            with self._lock:
                self._current = None
            current.end = self.timer.mark()
            self._pending.append(current)
            self._emit_ready()
        if step and step % REALIGN_EVERY == 0:  # a collective: only when every rank ends its step normally
            self._align()
            self.timer.retie()

    @contextmanager
    def phase(self, name: str):
        """A phase of the step; phases may nest (a pipeline schedule's forward and backward chunks)."""
        start, outer = self.timer.mark(), self._phase
        self._phase = name
        try:
            yield
        finally:
            self._phase = outer
            if self._current is not None:
                self._current.phases.append((name, start, self.timer.mark()))

    @contextmanager
    def transfer(self, src: str, dst: str, nbytes: int, what: str = ""):
        """A copy of `nbytes` from tier `src` to tier `dst` (semconv.TIERS), timed around the block: on the
        current stream's events where a GPU is one end (enter it on the copying stream), else on the host's
        monotonic clock (disk and host copies, from any thread: a swap worker's too)."""
        on_gpu = sc.TIER_GPU in (src, dst)
        t = Transfer(src, dst, nbytes, what, self.timer.mark() if on_gpu else time.monotonic_ns())
        t.stream, t.thread = self.timer.current_stream() if on_gpu else None, threading.get_ident()
        cpu = time.thread_time_ns()
        try:
            yield t
        finally:
            t.end = self.timer.mark() if on_gpu else time.monotonic_ns()
            t.cpu_ns = time.thread_time_ns() - cpu
            with self._lock:
                (self._current.transfers if self._current else self._between[0]).append(t)

    @contextmanager
    def host_work(self, name: str):
        """Work on the host's CPUs that training waits for (an offloaded optimizer's step), from any thread."""
        start = time.monotonic_ns()
        try:
            yield
        finally:
            work = (name, start, time.monotonic_ns())
            with self._lock:
                (self._current.host_work if self._current else self._between[1]).append(work)

    def record(self, **values) -> None:
        """Values of the step; a tensor on the GPU is copied to the host on its stream without waiting
        (read once the step's end has passed, which the copy precedes on the stream: no sync)."""
        if self._current is not None:
            self._current.values.update({k: _on_host(v) for k, v in values.items()})

    def collective(
        self,
        op: str,
        group: str,
        group_size: int,
        nbytes: int,
        waits: str = SYNC,
        *,
        host: bool = False,
        peer: int | None = None,
        ordered: bool = True,
    ) -> Collective:
        """Start recording a collective (call it just before launching it); the caller sets
        `.end = session.timer.mark()` once it completed (`time.monotonic_ns()` with `host`: a group
        the GPU's streams do not run, gloo's). Its lane (see _comm_intervals): the group's NCCL
        communicator, a pair's for point to point (`peer`), and the calling stream; none unless
        `ordered` (the caller knows that its end is when that queue was free)."""
        with self._lock:
            seq = self._seq[group] = self._seq.get(group, -1) + 1
        if host:
            start, stream = time.monotonic_ns(), None
        else:
            start, stream = self.timer.mark(), self.timer.current_stream()
        lane = (group, peer, stream) if ordered and stream is not None else None
        c = Collective(op, group, group_size, seq, nbytes, start, waits, None, stream, lane, peer)
        self._last_collective = c
        if self._current is not None:
            self._current.collectives.append(c)
        return c

    def event(self, name: str, step: int | None = None, **attributes) -> None:
        if self.exporter:
            attrs = {**attributes, **({sc.STEP: step} if step is not None else {})}
            self.exporter.event(name, self.clock.now_ns(), attrs)

    def fail(self, cause: str, body: str, attributes: dict) -> None:
        """The rank ends on a failure (failures.py): said, with the step it was in, instead of `ended`."""
        self._ended = True
        if self.exporter:
            attrs = {**attributes, **({sc.STEP: self._last_step} if self._last_step is not None else {})}
            self.exporter.event(sc.EVENT_RANK_FAILED, self.clock.now_ns(), attrs, body, SeverityNumber.ERROR)

    def end(self) -> None:
        """The training loop has ended: say so once (what follows, a last checkpoint written or the
        teardown, is then no stall to the collector)."""
        if not self._ended:
            self._ended = True
            # the last step begun: its spans may go out after this event, and the collector waits for them
            self.event(sc.EVENT_ENDED, step=self._last_step)

    def shutdown(self) -> None:
        self.end()
        self._stop.set()
        if self._stacks is not None:
            self._stacks.close()
        if self.sampler:
            self.sampler.stop()  # its last sample covers every step still pending
        self._emit_ready(wait=True)
        if self.device is not None:
            self.device.close()  # puts back the power limit of before any cap
        if not self.exporter:
            return
        lost, samples = self.exporter.finish(self.clock.now_ns())
        if (lost or samples) and (notes := os.environ.get(UNDELIVERED_ENV)):  # for `rankwatch train`'s status
            Path(notes, f"rank-{self.rank}-{os.getpid()}").write_text(json.dumps({**asdict(lost), "samples": samples}))
        if lost:
            log.warning(
                "rankwatch: %d rank-steps (%d spans) of rank %d were never delivered to the collector",
                lost.rank_steps,
                lost.spans,
                self.rank,
            )

    # -- turning marks into spans --------------------------------------------------------------------
    def _emit_ready(self, wait: bool = False) -> None:
        """Emit the finished steps whose marks are readable; `wait` (at shutdown) waits for them.
        Called at each step's end, and by the heartbeat thread: a step that became readable just
        after it ended still goes out while the next one hangs."""
        with self._emitting:
            while self._pending and (wait or self._readable(self._pending[0])):
                step = self._pending.popleft()
                # CUDA events: the one wait, at the end of the job; a collective's end is on a stream of its own
                for mark in (
                    (step.end, *(c.end for c in step.collectives), *(t.end for t in step.transfers)) if wait else ()
                ):
                    if hasattr(mark, "synchronize"):
                        mark.synchronize()
                self._emit(step)

    def _readable(self, s: _Step) -> bool:
        """Its marks are readable, and the sampler has sampled past its end (for its energy)."""
        return (
            self.timer.ready(s.end)
            and all(self.timer.ready(end) for _, _, end in s.phases)
            and all(c.end is None or self.timer.ready(c.end) for c in s.collectives)
            and all(self.timer.ready(t.end) for t in s.transfers)
            and (
                self.sampler is None
                or not self._gpu_here  # (the node's sidecar holds the step for its energy where it reads the GPU)
                or self.sampler.covers(self.timer.to_wall(self.clock, s.end))
            )
        )

    def _emit(self, s: _Step) -> None:
        """The step's marks placed on the wall clock and released, then its spans sent (rankwatch/agent/stepspans.py:
        made here, or by the node's sidecar where the rank hands its marks to one)."""
        start = self.timer.to_wall(self.clock, s.start)
        between = self.timer.between
        wall = lambda mark: start + between(s.start, mark)  # noqa: E731  # durations from the step's start
        end = wall(s.end)
        roles = self.roles
        comms = tuple(
            Comm(
                c.op,
                c.group,
                c.group_size,
                c.seq,
                c.nbytes,
                c.waits,
                roles.get(c.group),
                c.peer,
                c.stream == s.stream,
                c.lane,
                wall(c.start),
                wall(c.end),
                None if c.waited is None else wall(c.waited),
            )
            for c in s.collectives
            if c.end is not None
        )
        moves = tuple(
            Move(
                t.src,
                t.dst,
                t.nbytes,
                t.what,
                wall(t.start),
                wall(t.end),
                t.cpu_ns,
                t.thread == s.thread and t.stream in (None, s.stream),
            )
            for t in s.transfers
        )
        self.timer.release(
            [
                s.start,
                s.end,
                *(m for _, a, b in s.phases for m in (a, b)),
                *(m for c in s.collectives if c.end is not None for m in (c.start, c.end)),
                *(c.waited for c in s.collectives if c.end is not None and c.waited is not None),
                *(m for t in s.transfers for m in (t.start, t.end)),
            ]
        )
        if not self.exporter:
            return
        # tensors are on the host (record): their copies from the GPU are done, since the step's end is
        values = {
            _VALUE_KEYS.get(k, f"rankwatch.{k}"): v.item() if hasattr(v, "item") else v
            for k, v in s.values.items()
            if v is not None
        }
        self.exporter.step(
            StepMarks(
                s.step,
                start,
                end,
                tuple((name, wall(a), wall(b)) for name, a, b in s.phases),
                comms,
                moves,
                tuple((name, self.clock.wall(a), self.clock.wall(b)) for name, a, b in s.host_work),
                values,
                self.sampler.energy_between(start, end) if self.sampler and self._gpu_here else None,
            )
        )

    def _beat(self, every_s: float) -> None:
        """Progress, even when no step finishes: the step and phase this rank is in, and the
        last collective it entered (a hang's culprits are the ranks that did not enter the
        collective the others are blocked in)."""
        while not self._stop.wait(every_s):
            self._emit_ready()
            current, last = self._current, self._last_collective
            attributes: dict[str, AttributeValue] = {sc.PHASE: self._phase or ""}
            if last is not None:
                attributes.update(
                    {
                        sc.COMM_OP: last.op,
                        sc.COMM_GROUP: last.group,
                        sc.COMM_SEQ: last.seq,
                        sc.COMM_DONE: last.end is not None,
                        **({sc.COMM_ROLE: self.roles[last.group]} if last.group in self.roles else {}),
                        **({sc.COMM_PEER: last.peer} if last.peer is not None else {}),
                    }
                )
            self.event(sc.EVENT_HEARTBEAT, step=current.step if current else None, **attributes)


def _sink(collector: str, token: str | None, attributes: dict) -> Exporter | NodeLink:
    """Where the rank's telemetry goes: its node's sidecar where the launcher started one, else an exporter
    of the rank's own (also where the sidecar goes away later)."""
    own = lambda: Exporter(collector, token, attributes)  # noqa: E731
    if (path := node_socket()) and (link := NodeLink.connect(path, attributes, own)):
        return link
    return own()


def _on_host(value):
    """A GPU tensor as a host tensor its stream will fill (pinned: `non_blocking` makes it so); else as is."""
    return value.detach().to("cpu", non_blocking=True) if getattr(value, "is_cuda", False) else value


_VALUE_KEYS = {
    "loss": sc.LOSS,
    "grad_norm": sc.GRAD_NORM,
    "tokens": sc.TOKENS,
    "lr": sc.LR,
    "mfu": sc.MFU,
    "flops": sc.STEP_FLOPS,
}
