"""A step's split and its collectives' durations, as the agent stores them, from its timer's marks.

Covered: a session whose timer plays back a DDP step as CUDA events record it
on a GPU (every mark, a bucket's end too, a GPU time) sends to a real
collector: on one GPU (no peer) an exposed wait of the last bucket's
all-reduce alone, and with slow links the time after backward's compute in
which the all-reduces still ran; each bucket's duration is its own time on
NCCL's stream, which runs the buckets one after another, not the time since
its launch; at shutdown, a step still on the GPU waits for its buckets' end
events, which are on streams of their own. On CPU, a real one-rank gloo DDP
model through the agent's comm hook: every bucket timed, the exposed wait
within the step and the phases adding up. A finished step reaches the collector
soon, without waiting for the next step to end.
"""

import itertools
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from rankwatch.agent.clock import Clock, CpuTimer, CudaTimer
from rankwatch.agent.collectives import comm_hook
from rankwatch.agent.session import Session
from rankwatch.agent.stepspans import BUCKET, bubble
from rankwatch.agent.timeline import length
from tests.support import loopback
from tests.support.otlp_payloads import query
from tests.support.waits import wait_until

MS = 1_000_000  # ns


class RecordedTimer(CpuTimer):
    """The CUDA timer's contract (rankwatch/agent/clock.py) over a recorded timeline: each mark taken is
    the next recorded GPU time in ns, in the order the host takes them; all are readable; all on
    one stream."""

    def __init__(self, gpu_ns: list[int]):
        self._times = iter(gpu_ns)
        self._anchor = time.monotonic_ns()

    def mark(self) -> int:
        return next(self._times)

    def current_stream(self) -> int:  # type: ignore[override]  # one stream, as on a GPU
        return 7

    def to_wall(self, clock: Clock, mark: int) -> int:
        return clock.wall(self._anchor + mark)


def ddp_step(session: Session, buckets: int, end_mark=None) -> None:
    """One step's calls in the order DDP's training loop makes them, each bucket's end marked as
    rankwatch/agent/collectives.py marks it (at once, in the callback of a future NCCL completed when enqueued)."""
    end_mark = end_mark or session.timer.mark
    with session.step(0):
        for name in ("data", "forward"):
            with session.phase(name):
                pass
        with session.phase("backward"):
            for _ in range(buckets):
                c = session.collective("all_reduce", "world", 1, 25 * 2**20, BUCKET)
                c.end = end_mark()
        with session.phase("optimizer"):
            pass


def timeline(ready_ms: list[float], allreduce_ms: float, backward_end_ms: float) -> list[int]:
    """The GPU times of ddp_step's marks: data 0-1 ms, forward 1-11, backward from 11, buckets
    ready at `ready_ms`, each end the launch's completion on NCCL's stream (one after another),
    optimizer from the end of backward for 4 ms."""
    marks, nccl_free = [0, 0, 1, 1, 11, 11], 0.0
    for ready in ready_ms:
        nccl_free = max(ready, nccl_free) + allreduce_ms
        marks += [ready, nccl_free]
    marks += [backward_end_ms, backward_end_ms, backward_end_ms + 4, backward_end_ms + 4]
    return [int(m * MS) for m in marks]


def stored_step(collector, gpu_ns: list[int], buckets: int) -> tuple:
    session = Session("run-gpu", 0, 1, collector.url, collector.token, timer=RecordedTimer(gpu_ns))
    ddp_step(session, buckets)
    session.shutdown()
    collector.stop()
    step = query(collector.db, "SELECT duration_s, data_s, compute_s, comm_wait_s FROM steps")
    ops = query(collector.db, "SELECT seq, duration_s, epoch_ns(start_ts) FROM ops WHERE kind = 'comm' ORDER BY seq")
    return step[0], ops


def test_one_gpu_exposes_only_the_last_buckets_all_reduce(collector):
    ready = [15, 19, 23, 27, 31]
    (duration, data, compute, wait), ops = stored_step(collector, timeline(ready, 0.03, 31.05), len(ready))
    assert wait == pytest.approx(30e-6, abs=1e-9)  # not the 135 ms of host time mixed with GPU time
    assert duration == pytest.approx(35.05e-3, abs=1e-9) and data == pytest.approx(1e-3, abs=1e-9)
    assert compute == pytest.approx(35.05e-3 - 1e-3 - 30e-6, abs=1e-9)
    assert [(seq, pytest.approx(30e-6, abs=1e-9)) for seq, _, _ in ops] == [(k, d) for k, d, _ in ops]
    assert len(ops) == 5


def test_slow_links_expose_the_all_reduces_after_backward_and_time_each_on_its_stream(collector):
    ready = [15, 19, 23, 27, 31]  # 6 ms each: they queue behind each other on NCCL's stream
    (_duration, _, compute, wait), ops = stored_step(collector, timeline(ready, 6, 45.02), len(ready))
    assert wait == pytest.approx(14e-3, abs=1e-9)  # from the last gradient (31 ms) to the last end (45 ms)
    assert compute == pytest.approx(45.02e-3 + 4e-3 - 1e-3 - 14e-3, abs=1e-9)
    assert [d for _, d, _ in ops] == [pytest.approx(6e-3, abs=1e-9)] * 5  # not 6, 8, 10, 12, 14 ms
    starts = [t for _, _, t in ops]
    assert [round((b - a) / MS, 3) for a, b in itertools.pairwise(starts)] == [6.0] * 4


@pytest.fixture
def gloo():
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_gloo_ddp_buckets_on_cpu(collector, gloo):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.5)
    session = Session("run-cpu", 0, 1, collector.url, collector.token)
    ddp.register_comm_hook(None, comm_hook(session))
    steps = 4
    for i in range(steps):
        with session.step(i):
            with session.phase("forward"):
                loss = ddp(torch.randn(64, 256)).square().mean()
            with session.phase("backward"):
                loss.backward()
            with session.phase("optimizer"):
                model.zero_grad()
    session.shutdown()
    collector.stop()
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    rows = query(
        collector.db,
        """
        SELECT s.step, s.duration_s, s.compute_s, s.comm_wait_s, count(*), sum(o.bytes), min(o.duration_s)
        FROM steps s JOIN ops o USING (run_id, rank, step) WHERE o.kind = 'comm' GROUP BY ALL ORDER BY s.step""",
    )
    assert [r[0] for r in rows] == list(range(steps))
    for step, duration, compute, wait, buckets, total, shortest in rows:
        assert buckets >= (3 if step else 1) and total == nbytes, (step, buckets, total)  # rebuilt after step 0
        assert shortest > 0
        assert 0 <= wait <= duration and compute + wait <= duration * (1 + 1e-9)


class PendingEvent:
    """A CUDA event's contract as the agent uses it: readable once the GPU passed it; synchronize()
    waits for it, and so for the marks before it on its stream; reading it before raises, as
    Event.elapsed_time does."""

    def __init__(self, gpu_ns: int, stream: str, timer: "PendingTimer"):
        self.gpu_ns, self.stream, self.timer, self.done = gpu_ns, stream, timer, False

    def synchronize(self) -> None:
        for e in self.timer.events:
            e.done |= e.stream == self.stream and e.gpu_ns <= self.gpu_ns


class PendingTimer(RecordedTimer):
    """Marks the GPU has not passed yet, on the stream `stream` names when they are taken."""

    def __init__(self, gpu_ns: list[int]):
        super().__init__(gpu_ns)
        self.events: list[PendingEvent] = []
        self.stream = "training"

    def mark(self) -> PendingEvent:
        self.events.append(PendingEvent(super().mark(), self.stream, self))
        return self.events[-1]

    def ready(self, mark: PendingEvent) -> bool:
        return mark.done

    def to_wall(self, clock: Clock, mark: PendingEvent) -> int:
        if not mark.done:
            raise RuntimeError("event not completed: elapsed_time would fail")
        return super().to_wall(clock, mark.gpu_ns)

    def between(self, a: PendingEvent, b: PendingEvent) -> int:
        if not (a.done and b.done):
            raise RuntimeError("event not completed: elapsed_time would fail")
        return b.gpu_ns - a.gpu_ns


def test_shutdown_waits_for_every_collectives_end_event(collector):
    """The last step is still on the GPU at shutdown: the one wait there covers the buckets' end
    events too, which are recorded on streams of their own, not only the training stream's."""
    ready = [15, 19, 23, 27, 31]
    timer = PendingTimer(timeline(ready, 0.03, 31.05))
    session = Session("run-pending", 0, 1, collector.url, collector.token, timer=timer)

    def on_its_stream() -> PendingEvent:
        timer.stream = "pool"  # the future callback's stream, which waited for NCCL's
        try:
            return timer.mark()
        finally:
            timer.stream = "training"

    ddp_step(session, len(ready), end_mark=on_its_stream)
    session.shutdown()
    collector.stop()
    assert query(collector.db, "SELECT count(*) FROM ops WHERE kind = 'comm'") == [(5,)]
    assert query(collector.db, "SELECT comm_wait_s FROM steps") == [(pytest.approx(30e-6, abs=1e-9),)]


def test_a_finished_step_reaches_the_collector_without_waiting_for_the_next(collector):
    """A step held for the sample past its end (for its energy) goes out once sampled, within the
    export's 250 ms, where it waited for the next step's end or the 5 s heartbeat and a 1 s batch:
    what a spike at a slow step rate waited before its rollback could start."""
    session = Session("run-one-step", 0, 1, collector.url, collector.token)
    with session.step(0), session.phase("forward"):
        time.sleep(0.01)
    ended = time.monotonic()

    def stored() -> bool:
        answer = loopback.post(
            f"{collector.url}/api/v1/query",
            headers=collector.headers,
            timeout=10,
            json={"sql": "SELECT count(*) FROM steps WHERE run_id = 'run-one-step'"},
        )
        return answer.json()["rows"] == [[1]]

    try:
        wait_until(stored, "the step never reached the collector", 30)
        assert time.monotonic() - ended < 3.5
    finally:
        session.shutdown()


class Float32Event:
    """torch.cuda.Event as the GPU keeps it (the hardware boundary, mocked): recorded at the fake
    GPU clock's time, its elapsed_time in float32 milliseconds, as CUDA's cudaEventElapsedTime."""

    gpu_ns = 0  # the GPU's clock, moved by the test

    def __init__(self, enable_timing: bool = True):
        self.t = 0

    def record(self, stream=None) -> None:
        self.t = Float32Event.gpu_ns

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: "Float32Event") -> float:
        return float(np.float32((end.t - self.t) / 1e6))


def test_durations_keep_their_precision_hours_into_a_run(collector, monkeypatch):
    """elapsed_time's float32 milliseconds resolve 250 µs an hour from an anchor: a 20 µs all-reduce
    and a 1.234567 ms phase an hour into the run are stored to the µs, and the step is placed on the
    wall clock to float32's resolution of the hour (a tie refreshed at re-alignments keeps that short)."""
    monkeypatch.setattr(torch.cuda, "Event", Float32Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentStream", lambda device: (7, 0, 1), raising=False)
    monkeypatch.setattr(torch.cuda, "Stream", lambda **stream: SimpleNamespace(**stream))
    Float32Event.gpu_ns = 0
    session = Session("run-f32", 0, 1, collector.url, collector.token, timer=CudaTimer(0))
    hour = 3600 * 10**9

    def at(ns: int) -> None:
        Float32Event.gpu_ns = hour + ns

    at(0)
    with session.step(7):
        with session.phase("forward"):
            at(1_234_567)
        c = session.collective("all_reduce", "world", 1, 4096)
        at(1_254_567)
        c.end = session.timer.mark()
    session.shutdown()
    collector.stop()
    (forward,) = query(collector.db, "SELECT duration_s FROM ops WHERE kind = 'phase'")
    (comm,) = query(collector.db, "SELECT duration_s FROM ops WHERE kind = 'comm'")
    assert forward[0] == pytest.approx(1.234567e-3, abs=1e-9)
    assert comm[0] == pytest.approx(20e-6, abs=1e-9)


class GpuScalar:
    """A CUDA tensor as the agent may touch it (the hardware boundary, mocked): reading it on the host
    (`.item()`, `float()`) would sync the stream, so it raises; `.to("cpu", non_blocking=True)` is
    the copy its stream makes without waiting."""

    is_cuda = True

    def __init__(self, value: float):
        self.value, self.copies = value, []

    def detach(self) -> "GpuScalar":
        return self

    def to(self, device: str, non_blocking: bool = False) -> torch.Tensor:
        self.copies.append((device, non_blocking))
        return torch.tensor(self.value)

    def item(self) -> float:
        raise AssertionError("a GPU tensor read on the host: a sync")

    __float__ = item


def test_gpu_values_reach_the_collector_without_being_read_on_the_gpu(collector):
    """A loss and grad norm still on the GPU are copied without waiting when recorded and read from
    the host copy once the step is done: `.item()` on them would sync the stream, on the hot path."""
    session = Session("run-values", 0, 1, collector.url, collector.token)
    loss, norm = GpuScalar(2.5), GpuScalar(0.75)
    with session.step(0), session.phase("forward"):
        session.record(loss=loss, grad_norm=norm, tokens=64)
    session.shutdown()
    collector.stop()
    assert query(collector.db, "SELECT loss, grad_norm, tokens FROM steps") == [(2.5, 0.75, 64)]
    assert loss.copies == norm.copies == [("cpu", True)]


def test_the_exposed_wait_is_split_by_the_mesh_dimension_of_each_collectives_group():
    """A tensor-parallel all-reduce hidden under compute exposes nothing; a data-parallel one that runs
    past the compute exposes its tail: the step's exposed wait is the tail, all of it `dp`'s, none `tp`'s;
    a group of no mesh counts in the whole alone."""
    from rankwatch.agent.stepspans import ASYNC, Comm, compute_and_wait

    roles = {"tp-group": "tp", "dp-group": "dp"}

    def comm(group: str, a: int, b: int):
        return (Comm("all_reduce", group, 2, 0, 0, ASYNC, roles.get(group), None, False, None, a, b), a, b)

    phases = [("forward", 0, 100), ("backward", 100, 200)]
    collectives = [comm("tp-group", 50, 150), comm("dp-group", 180, 260), comm("other", 250, 270)]
    compute, total, by_role = compute_and_wait((0, 300), phases, collectives, [])
    assert (round(total * 1e9), {role: round(s * 1e9) for role, s in by_role.items()}) == (70, {"tp": 0, "dp": 60})
    assert length(compute) == 200


def test_an_async_collective_waited_for_on_the_training_stream_is_not_compute():
    """FSDP's all-gather launched with async_op=True and waited for inside the forward: from the wait to
    its end the stream computes nothing, so that stretch is exposed, and not compute; before the wait it
    is hidden under compute."""
    from rankwatch.agent.stepspans import ASYNC, Comm, compute_and_wait

    gather = Comm("all_gather", "dp-group", 2, 0, 0, ASYNC, "dp", None, True, None, 10, 70, waited=40)
    phases = [("forward", 0, 100)]
    compute, total, by_role = compute_and_wait((0, 100), phases, [(gather, 10, 70)], [(40, 70)])
    assert (length(compute), round(total * 1e9), round(by_role["dp"] * 1e9)) == (70, 30, 30)


def test_the_pipeline_bubble_is_the_schedule_less_the_stages_chunks():
    phases = [("pipeline", 0, 100), ("forward", 10, 30), ("forward", 40, 50), ("backward", 60, 90)]
    assert round(bubble(phases) * 1e9) == 40
