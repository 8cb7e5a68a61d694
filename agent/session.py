"""One rank's telemetry session: steps, phases, collectives and values -> spans.

A step is recorded as marks (monotonic readings on CPU, CUDA events on GPU);
when the step ends it waits in `pending` until its marks are readable, then
becomes one `step` span with `phase` and `comm` children. Nothing here
blocks the training loop: GPU marks are read when the GPU has passed them,
and export happens in the SDK's background thread. The step's exposed
communication wait is interval arithmetic over its marks (agent/timeline.py).
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

from agent import semconv as sc
from agent.clock import Clock, CpuTimer, Timer
from agent.config import UNDELIVERED_ENV, simulate_gpu
from agent.export import Attributes, AttributeValue, Exporter, log
from agent.host import HostState
from agent.opendevice import open_device
from agent.rapl import Rapl
from agent.sampler import Sampler
from agent.timeline import clip, exposed, length, serialized, subtract

REALIGN_EVERY = 500  # steps between clock re-alignments
COMPUTE_PHASES = ("forward", "backward", "optimizer")
# the phase a pipeline schedule's step runs in; the forward and backward chunks of the stage inside it
PIPELINE = "pipeline"
# how the training stream waits for a collective: DDP waits for its buckets at the end of backward,
# a blocking call at once, an async_op=True call where the code waits (unknown here)
BUCKET, SYNC, ASYNC = "bucket", "sync", "async"


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
    """Telemetry of one rank; see agent/__init__.py for the public functions."""

    def __init__(
        self,
        run_id: str,
        rank: int,
        world_size: int,
        collector: str | None,
        token: str | None,
        resource: dict | None = None,
        timer: Timer | None = None,
        heartbeat_s: float = 5.0,
        sample_s: float = 0.1,
    ):
        self.run_id, self.rank, self.world_size = run_id, rank, world_size
        self.clock = Clock()
        self.timer: Timer = timer or CpuTimer()
        self.roles: dict[str, str] = {}  # process group name -> its DeviceMesh dimension (agent/collectives.py)
        attributes = {
            sc.RUN_ID: run_id,
            sc.RANK: rank,
            sc.WORLD_SIZE: world_size,
            sc.HOST_NAME: socket.gethostname(),
            sc.PROCESS_PID: os.getpid(),
            **(resource or {}),
        }
        self.exporter = Exporter(collector, token, attributes) if collector else None
        self._current: _Step | None = None
        self._phase: str | None = None
        local_rank = int((resource or {}).get(sc.LOCAL_RANK, 0))
        # a simulated GPU (where asked for) is busy while the rank computes; None: no GPU
        self.device = open_device(
            local_rank, utilization=lambda: float(self._phase in COMPUTE_PHASES), simulate=simulate_gpu()
        )
        readers: list = [HostState(host_wide=local_rank == 0)]  # the host's disks: one rank per host
        if self.device is not None:
            readers.insert(0, self.device)
        if local_rank == 0 and (rapl := Rapl()).available:  # host power: one rank per host
            readers.append(rapl)
        # a step held for its energy goes out once sampled past, not only at the next step's end
        self.sampler = (
            Sampler(readers, self.exporter.samples, sample_s, now_ns=self.clock.now_ns, on_sample=self._emit_ready)
            if self.exporter
            else None
        )
        self._pending: deque[_Step] = deque()
        self._between: tuple[list[Transfer], list] = ([], [])  # transfers and host work done between steps
        self._seq: dict[str, int] = {}
        self._last_collective: Collective | None = None
        self._lock = threading.Lock()
        self._emitting = threading.Lock()
        self._stop = threading.Event()
        self._ended = False
        self._last_step: int | None = None  # the step last begun: the one the `ended` event names
        self._heartbeat = threading.Thread(
            target=self._beat, args=(heartbeat_s,), name="rankwatch-heartbeat", daemon=True
        )
        self.clock.align()
        if self.exporter:
            self._heartbeat.start()
        if self.sampler:  # there is one where there is an exporter
            self.sampler.start()

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
            self.clock.align()
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
        if self.sampler:
            self.sampler.stop()  # its last sample covers every step still pending
        self._emit_ready(wait=True)
        if self.device is not None:
            self.device.close()  # puts back the power limit of before any cap
        if not self.exporter:
            return
        self.exporter.flush()
        backlog = self.exporter.spans_backlog
        late_dropped = backlog.dropped + backlog.waiting  # what is still waiting now will not be delivered
        if late_dropped or backlog.delivered_late:
            self.event(
                sc.EVENT_TELEMETRY_BACKLOG,
                **{sc.SPANS_DROPPED: late_dropped, sc.SPANS_DELIVERED_LATE: backlog.delivered_late},
            )
            self.exporter.flush()
        self.exporter.shutdown()
        lost, samples = self.exporter.undelivered()
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
            and (self.sampler is None or self.sampler.covers(self.timer.to_wall(self.clock, s.end)))
        )

    def _emit(self, s: _Step) -> None:
        start = self.timer.to_wall(self.clock, s.start)
        wall = lambda mark: start + self.timer.between(s.start, mark)  # noqa: E731  # durations from the step's start
        end = wall(s.end)
        phases = [(name, wall(a), wall(b)) for name, a, b in s.phases]
        comm = self._comm_intervals(s, wall)
        blocked = [(wall(c.waited), b) for c, _, _, b in comm if c.waited is not None and c.stream == s.stream]
        computing, comm_wait, by_role = self._compute_and_wait(
            (start, end), phases, comm, blocked, s.stream, self.roles
        )
        transfers = [(t, wall(t.start), wall(t.end)) for t in s.transfers]
        host = [(name, self.clock.wall(a), self.clock.wall(b)) for name, a, b in s.host_work]
        stalled = [(a, b) for t, a, b in transfers if t.thread == s.thread and t.stream in (None, s.stream)]
        if stalled:  # a copy the training loop itself made (on its stream, or on the host): no compute then
            computing = subtract(computing, stalled)
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
        attributes: dict[str, AttributeValue] = {
            sc.KIND: sc.KIND_STEP,
            sc.STEP: s.step,
            sc.DATA_S: sum(b - a for name, a, b in phases if name == "data") / 1e9,
            sc.COMPUTE_S: length(computing) / 1e9,
            sc.COMM_WAIT_S: comm_wait,
            **{sc.COMM_WAIT_S_OF + role: wait for role, wait in by_role.items()},
        }
        if transfers:  # what compute hid of the copies between tiers, and what it did not
            moving = [(a, b) for _, a, b in transfers]
            attributes[sc.TRANSFER_S] = length(clip(moving, (start, end))) / 1e9
            attributes[sc.TRANSFER_EXPOSED_S] = exposed(moving, computing, (start, end)) / 1e9
            attributes[sc.TRANSFER_CPU_S] = sum(t.cpu_ns for t, _, _ in transfers) / 1e9
        if host:
            attributes[sc.HOST_OPTIMIZER_S] = length(clip([(a, b) for _, a, b in host], (start, end))) / 1e9
        if any(name == PIPELINE for name, _, _ in phases):
            attributes[sc.PIPELINE_BUBBLE_S] = self._bubble(phases)
        energy = self.sampler.energy_between(start, end) if self.sampler else None
        if energy is not None:
            attributes[sc.STEP_ENERGY_J] = energy
        # tensors are on the host (record): their copies from the GPU are done, since the step's end is
        attributes.update(
            {
                _VALUE_KEYS.get(k, f"rankwatch.{k}"): v.item() if hasattr(v, "item") else v
                for k, v in s.values.items()
                if v is not None
            }
        )
        spans: list[tuple[str, int, int, Attributes]] = [("step", start, end, attributes)]
        spans += [(name, a, b, {sc.KIND: sc.KIND_PHASE, sc.STEP: s.step}) for name, a, b in phases]
        spans += [
            (
                c.op,
                a,
                b,
                {
                    sc.KIND: sc.KIND_COMM,
                    sc.STEP: s.step,
                    sc.COMM_GROUP: c.group,
                    sc.COMM_GROUP_SIZE: c.group_size,
                    sc.COMM_SEQ: c.seq,
                    sc.COMM_BYTES: c.nbytes,
                    **({sc.COMM_ROLE: self.roles[c.group]} if c.group in self.roles else {}),
                    **({sc.COMM_PEER: c.peer} if c.peer is not None else {}),
                },
            )
            for c, _, a, b in comm
        ]
        spans += [
            (
                f"{t.src}->{t.dst}",
                a,
                b,
                {
                    sc.KIND: sc.KIND_TRANSFER,
                    sc.STEP: s.step,
                    sc.TRANSFER_SRC: t.src,
                    sc.TRANSFER_DST: t.dst,
                    sc.TRANSFER_BYTES: t.nbytes,
                    **({sc.TRANSFER_FOR: t.what} if t.what else {}),
                },
            )
            for t, a, b in transfers
        ]
        spans += [(name, a, b, {sc.KIND: sc.KIND_HOST, sc.STEP: s.step, sc.HOST_WORK: name}) for name, a, b in host]
        self.exporter.trace(spans)

    @staticmethod
    def _comm_intervals(s: _Step, wall) -> list[tuple[Collective, int, int, int]]:
        """(collective, launch, start, end) in wall ns for each completed collective of the step.
        The collectives of one lane (stream events of one group's NCCL communicator, a pair's for
        point to point, called from one stream, each ending when that queue was free) run one after
        another: each starts at its launch or at the end of the one before it, a bound that ops the
        agent does not see (functional collectives, coalesced ops, all_gather_object's) only push
        later. Nothing else is assumed ordered: the rest start at their launch."""
        done = [(c, wall(c.start), wall(c.end)) for c in s.collectives if c.end is not None]
        lanes: dict[tuple, list[int]] = {}
        for i, (c, _, _) in enumerate(done):
            if c.lane is not None:
                lanes.setdefault(c.lane, []).append(i)
        starts = [a for _, a, _ in done]
        for ops in lanes.values():
            for i, (a, _) in zip(ops, serialized([(done[i][1], done[i][2]) for i in ops])):
                starts[i] = a
        return [(c, a, starts[i], b) for i, (c, a, b) in enumerate(done)]

    @staticmethod
    def _compute_and_wait(
        window: tuple[int, int], phases: list, comm: list, blocked: list, stream: int | None, roles: dict[str, str]
    ) -> tuple[list, float, dict[str, float]]:
        """(compute as intervals, exposed wait and the exposed wait of each DeviceMesh dimension (`roles`:
        group -> dimension) in seconds). The exposed wait is the time communication was in flight and nothing
        computed (docs/telemetry.md): outside the compute phases, or inside them where the training
        stream (`stream`, the phases') waited for it: a blocking collective called on it from its launch
        to its end (one called on a side stream stalls that stream only), an async_op=True one from
        where it was waited for on it (`blocked`) to its end, DDP's wait at the end of backward from the
        last bucket's launch on. Compute is the compute phases less the exposed wait within them, so
        that data, compute and the wait tile the step (a pipeline's bubble, outside its chunks, takes
        nothing from compute)."""
        waits = [(a, b) for c, a, _, b in comm if c.waits == SYNC and c.stream == stream] + blocked
        buckets = [a for c, a, _, _ in comm if c.waits == BUCKET]
        backward = [b for name, _, b in phases if name == "backward"]
        if buckets and backward:
            waits.append((max(buckets), backward[-1]))
        computing = [(a, b) for name, a, b in phases if name in COMPUTE_PHASES]
        compute = subtract(computing, waits)
        of_role: dict[str, list] = {}
        for c, _, a, b in comm:
            if c.group in roles:
                of_role.setdefault(roles[c.group], []).append((a, b))
        by_role = {role: exposed(spans, compute, window) / 1e9 for role, spans in of_role.items()}
        exposed_spans = clip(subtract([(a, b) for _, _, a, b in comm], compute), window)
        return subtract(computing, exposed_spans), length(exposed_spans) / 1e9, by_role

    @staticmethod
    def _bubble(phases: list) -> float:
        """Seconds of the step's pipeline schedule in which the stage computed nothing (no forward or
        backward chunk ran): waiting for the stages before and after it, the pipeline's bubble."""
        windows = [(a, b) for name, a, b in phases if name == PIPELINE]
        chunks = [(a, b) for name, a, b in phases if name in COMPUTE_PHASES]
        return length(subtract(windows, chunks)) / 1e9

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
