"""The agent's record of each collective, and what a step makes of it.

Covered, on real gloo process groups: every collective torch.distributed has
is traced, and called with all-positional or all-keyword arguments (in the
order torch's own signature gives) is recorded under its group's name and
size, with its nccl-tests bytes and whether the caller waits for it; the
default group has one name whatever object stands for it; point to point and
batches across a pair of processes. With a timer that plays CUDA's contract
on the CPU: a blocking collective called on a side stream (FSDP's) is no wait
of the training stream; collectives are queued behind each other only in one
lane (group, peer, calling stream, each end being when the queue was free); a
gloo group's collectives are marked with the host clock, which the CUDA
timer reads as such.
"""

import inspect
import json
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed as dist

from collector.nccl import canonical_op
from rankwatch.agent import semconv as sc
from rankwatch.agent.clock import Clock, CudaTimer
from rankwatch.agent.collectives import _SIZES, _argument, comm_hook, trace_collectives, untrace_collectives
from rankwatch.agent.session import Session
from rankwatch.agent.stepspans import ASYNC, SYNC, spans_of
from tests.support.collectors import free_port
from tests.support.paths import ROOT

MS = 1_000_000  # ns
MAIN, SIDE = 7, 8  # stream ids
POINT_TO_POINT = ("send", "recv", "isend", "irecv")


class Event:
    """A CUDA event as the session sees it: opaque, at a GPU time."""

    def __init__(self, ns: int):
        self.ns = ns


class GpuTimer:
    """CudaTimer's contract on the CPU: each mark is an event at the next of `gpu_ns`, on the stream
    `stream` names when it is taken; an int mark is monotonic ns."""

    def __init__(self, gpu_ns=()):
        self._times = iter(gpu_ns)
        self.stream = MAIN
        self.taken = 0
        self.clock = Clock()  # the session's, once it has one (session_with)

    def mark(self) -> Event:
        self.taken += 1
        return Event(next(self._times, 0))

    def current_stream(self) -> int:
        return self.stream

    def ready(self, mark) -> bool:
        return True

    def release(self, marks) -> None:
        pass

    def to_wall(self, clock: Clock, mark) -> int:
        return clock.wall(mark) if type(mark) is int else mark.ns

    def between(self, a, b) -> int:
        return self.to_wall(self.clock, b) - self.to_wall(self.clock, a)

    def retie(self) -> None:
        pass


class Spans:
    """An exporter that keeps the spans."""

    def __init__(self):
        self.spans: list = []

    def step(self, marks) -> None:
        self.spans += spans_of(marks)

    def event(self, *_) -> None:
        pass


def session_with(timer=None) -> Session:
    session = Session("run", 0, 1, None, None, timer=timer)
    session.exporter = Spans()  # type: ignore[assignment]
    if isinstance(timer, GpuTimer):
        timer.clock = session.clock
    return session


def close(session: Session) -> None:
    session.exporter = None
    session.shutdown()


@pytest.fixture
def gloo():
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    yield
    untrace_collectives()
    dist.destroy_process_group()


@pytest.fixture
def nccl_named(monkeypatch):
    """gloo groups that say they are NCCL's: their collectives are marked with the timer."""
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")


# -- arguments by torch's own signatures ------------------------------------------------------------
def arguments(name: str, group, n: int = 1) -> dict:
    """A valid argument for each parameter of `name` that the test sets (the rest keep defaults)."""
    out = [torch.empty(4) for _ in range(n)]
    return {
        "tensor": torch.ones(4),
        "tensor_list": out,
        "output_tensor": torch.empty(4 * n),
        "input_tensor": torch.ones(4),
        "output": torch.empty(4) if name.startswith("reduce_scatter") else torch.empty(4 * n),
        "input": torch.ones(4 * n),
        "input_list": [torch.ones(4) for _ in range(n)],
        "output_tensor_list": out,
        "input_tensor_list": [torch.ones(4) for _ in range(n)],
        "gather_list": out,
        "scatter_list": [torch.ones(4) for _ in range(n)],
        "op": dist.ReduceOp.SUM,
        "src": 0,
        "dst": 0,
        "group": group,
        "async_op": True,
    }


def call(name: str, form: str, values: dict):
    """dist.`name` called with `values` all positional (each parameter in its signature's order,
    defaults in between) or all by keyword."""
    parameters = inspect.signature(getattr(dist, name)).parameters
    given = [p for p in parameters if p in values]
    if form == "keyword":
        return getattr(dist, name)(**{p: values[p] for p in given})
    last = list(parameters).index(given[-1])
    args = [values.get(p, parameters[p].default) for p in list(parameters)[: last + 1]]
    return getattr(dist, name)(*args)


COLLECTIVES = sorted(n for n in _SIZES if n not in POINT_TO_POINT)


def test_every_collective_torch_has_is_traced():
    """Whatever torch adds with an async_op parameter (deprecated coalesced ones aside)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # dist.reduce_op's deprecation, read by dir()
        collectives = {
            name
            for name in dir(dist)
            if not name.startswith("_")
            and not name.endswith("_coalesced")
            and inspect.isfunction(getattr(dist, name))
            and "async_op" in inspect.signature(getattr(dist, name)).parameters
        }
    assert collectives <= set(_SIZES), collectives - set(_SIZES)
    assert set(POINT_TO_POINT) <= set(_SIZES)


@pytest.mark.parametrize("name", sorted(_SIZES))
def test_arguments_are_found_where_signature_bind_finds_them(name):
    """Each call form: the first k arguments positional, the rest by keyword, every other optional
    one left to its default."""
    signature = inspect.signature(getattr(dist, name))
    names = list(signature.parameters)
    for k in range(len(names) + 1):
        args = tuple(object() for _ in names[:k])
        kwargs = {
            p: object()
            for i, p in enumerate(names[k:])
            if i % 2 or signature.parameters[p].default is inspect.Parameter.empty
        }
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        assert [_argument(signature, p)(args, kwargs) for p in names] == [bound.arguments[p] for p in names], k


@pytest.mark.parametrize("form", ["positional", "keyword"])
@pytest.mark.parametrize("name", COLLECTIVES)
def test_a_collective_is_recorded_alike_whatever_the_argument_form(gloo, name, form):
    session = session_with()
    trace_collectives(session)
    group = dist.new_group([0])
    with session.step(0) as step, warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # reduce_scatter_tensor's deprecation
        work = call(name, form, arguments(name, group))
        work.wait()
    (c,) = step.collectives
    op = name.removesuffix("_into_tensor").removesuffix("_tensor").removesuffix("_single")  # all_gather ...
    assert canonical_op(op) == canonical_op(name) or canonical_op(name) is None  # the collector's name for it
    assert (c.op, c.group, c.group_size, c.nbytes) == (op, group.group_name, 1, 0 if name == "barrier" else 16)
    assert c.waits == ASYNC and c.end is not None
    close(session)


def test_the_default_group_has_one_name_whatever_stands_for_it(gloo):
    """None, dist.group.WORLD (what DDP's allreduce_hook passes) and the default group object: one
    group "world", one sequence, for the traced calls and the comm hook alike."""
    session = session_with()
    trace_collectives(session)
    hook = comm_hook(session)
    with session.step(0) as step:
        dist.all_reduce(torch.ones(4))
        dist.all_reduce(torch.ones(4), group=dist.group.WORLD)
        dist.all_reduce(torch.ones(4), dist.ReduceOp.SUM, dist.distributed_c10d._get_default_group())
        hook(dist.group.WORLD, Bucket()).wait()
    assert [(c.group, c.seq) for c in step.collectives] == [("world", 0), ("world", 1), ("world", 2), ("world", 3)]
    close(session)


def _pair(rank: int, port: int, out: str) -> None:
    """One of two ranks: point to point in both argument forms, a batch, an all_gather, on the
    default group (peers by global rank) and a group of both (by group rank); what was recorded,
    the lane's peer included (groups said to be NCCL's, so that they have lanes) -> `out`.json."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    dist.get_backend = lambda group=None: "nccl"
    session = Session("run", rank, 2, None, None, timer=GpuTimer())
    trace_collectives(session)
    both, peer = dist.new_group([1, 0]), 1 - rank
    with session.step(0) as step:
        for group in (None, both):
            ranks = {"src": peer, "dst": peer}
            if group is not None:
                group_peer = dist.get_group_rank(group, peer)
                ranks = {"src": None, "dst": None, "group_src": group_peer, "group_dst": group_peer}
            for form in ("positional", "keyword"):
                for name in ("send", "recv") if rank == 0 else ("recv", "send"):
                    call(name, form, {**arguments(name, group), **ranks})
                works = [call(name, form, {**arguments(name, group), **ranks}) for name in ("isend", "irecv")]
                for work in works:
                    work.wait()
                call("all_gather", form, {**arguments("all_gather", group, n=2), "async_op": False})
        batch = [dist.P2POp(dist.isend, torch.ones(4), peer), dist.P2POp(dist.irecv, torch.empty(4), peer)]
        for work in dist.batch_isend_irecv(batch):
            work.wait()
    records = [
        (c.op, c.group, c.group_size, c.nbytes, c.waits, c.end is not None, c.lane and c.lane[1])
        for c in step.collectives
    ]
    with open(f"{out}.{rank}.json", "w") as f:
        json.dump({"records": records, "both": both.group_name}, f)
    untrace_collectives()
    session.shutdown()
    dist.destroy_process_group()
    # what the test reads is written: leave without the interpreter's teardown, where gloo's threads, still
    # joinable on a loaded machine, can abort the process ("terminate called without an active exception")
    os._exit(0)


def test_point_to_point_and_batches_between_two_ranks(tmp_path):
    # two fresh interpreters rather than torch.multiprocessing.spawn, which re-runs `__main__` in each:
    # under a worker that ran a Streamlit AppTest, that is the dashboard's script
    port, out = free_port(), str(tmp_path / "rank")
    code = (
        "import sys; from tests.agent.test_trace_collectives import _pair; "
        "_pair(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    ranks = [subprocess.Popen([sys.executable, "-c", code, str(r), str(port), out], env=env) for r in (0, 1)]
    assert [p.wait(timeout=120) for p in ranks] == [0, 0]
    for rank in (0, 1):
        found = json.loads((tmp_path / f"rank.{rank}.json").read_text())
        peer = 1 - rank
        p2p = [("send", SYNC), ("recv", SYNC)] if rank == 0 else [("recv", SYNC), ("send", SYNC)]
        one_form = [
            *[(op, waits, 16, peer) for op, waits in p2p],
            ("send", ASYNC, 16, peer),
            ("recv", ASYNC, 16, peer),
            ("all_gather", SYNC, 32, None),
        ]
        expected = [
            [op, group, 2, nbytes, waits, True, lane_peer]
            for group in ("world", found["both"])
            for _ in ("positional", "keyword")
            for op, waits, nbytes, lane_peer in one_form
        ]
        expected.append(["batch_isend_irecv", "world", 2, 32, ASYNC, True, None])  # in no lane
        assert found["records"] == expected


# -- the step's timeline -----------------------------------------------------------------------------
def comm_wait(session: Session) -> float:
    (step,) = [a for _, _, _, a in session.exporter.spans if a.get(sc.KIND) == sc.KIND_STEP]  # type: ignore[union-attr]
    return step[sc.COMM_WAIT_S]


def comm_spans(session: Session) -> list[tuple[str, int, int]]:
    spans = session.exporter.spans  # type: ignore[union-attr]
    return [(name, a, b) for name, a, b, attrs in spans if attrs.get(sc.KIND) == sc.KIND_COMM]


def test_a_blocking_collective_on_a_side_stream_does_not_stall_compute():
    """FSDP's all-gathers run blocking on its own stream: the optimizer phase's compute on the
    training stream (0-100 ms) hides them; the same call on the training stream stalls it."""
    for stream, wait in ((SIDE, 0.0), (MAIN, 0.05)):
        timer = GpuTimer([0, 0, 10 * MS, 60 * MS, 100 * MS, 100 * MS])
        session = session_with(timer)
        with session.step(0), session.phase("optimizer"):
            timer.stream = stream
            c = session.collective("all_gather", "world", 2, 1 << 20, SYNC)
            c.end = timer.mark()
            timer.stream = MAIN
        assert comm_wait(session) == pytest.approx(wait, abs=1e-9), stream
        close(session)


def lane_step(timer: GpuTimer, calls: list[dict]) -> list[tuple[str, int, int]]:
    """One step, a collective for each of `calls` (session.collective's keywords, `stream`: the
    calling stream), each ended before the next starts on the host: the comm spans in ms."""
    session = session_with(timer)
    with session.step(0):
        for kwargs in calls:
            timer.stream = kwargs.pop("stream", MAIN)
            c = session.collective(kwargs.pop("op", "all_reduce"), kwargs.pop("group", "world"), 4, 1024, **kwargs)
            c.end = timer.mark()
    spans = [(name, a // MS, b // MS) for name, a, b in comm_spans(session)]
    close(session)
    return spans


def gpu_times(*launch_end_ms: tuple[int, int]) -> list[int]:
    """Step start at 0, each collective's (launch, end), step end at 200 ms."""
    return [0, *(t * MS for pair in launch_end_ms for t in pair), 200 * MS]


def test_one_groups_collectives_queue_behind_each_other_on_its_stream():
    times = gpu_times((10, 50), (20, 60))
    assert lane_step(GpuTimer(times), [{}, {}]) == [("all_reduce", 10, 50), ("all_reduce", 50, 60)]


def test_point_to_point_with_two_peers_does_not_queue():
    """NCCL gives each pair of ranks its own communicator and stream."""
    times = gpu_times((10, 50), (20, 60), (30, 70))
    calls = [{"op": "send", "peer": 1, "waits": ASYNC}, {"op": "send", "peer": 2, "waits": ASYNC}]
    calls.append({"op": "recv", "peer": 1, "waits": ASYNC})
    assert lane_step(GpuTimer(times), calls) == [("send", 10, 50), ("send", 20, 60), ("recv", 50, 70)]


def test_collectives_called_from_two_streams_or_groups_are_not_assumed_queued():
    times = gpu_times((10, 50), (20, 60), (30, 70))
    calls = [{"stream": MAIN}, {"stream": SIDE}, {"group": "3"}]
    assert lane_step(GpuTimer(times), calls) == [("all_reduce", 10, 50), ("all_reduce", 20, 60), ("all_reduce", 30, 70)]


def test_an_end_that_is_not_the_queues_own_does_not_delay_the_next():
    """A batch, or a bucket whose inner hook adds its own work after the all-reduce (decompression),
    ends later than its queue was free: what follows is not started after it."""
    times = gpu_times((10, 50), (20, 60), (30, 70))
    calls = [{"ordered": False}, {"ordered": False}, {}]
    assert lane_step(GpuTimer(times), calls) == [("all_reduce", 10, 50), ("all_reduce", 20, 60), ("all_reduce", 30, 70)]


class Bucket:
    def buffer(self) -> torch.Tensor:
        return torch.ones(4)


def test_ddp_buckets_around_an_inner_hook_are_not_queued_on_its_end(gloo, nccl_named):
    spans = []
    for inner in (lambda process_group, bucket: completed(bucket.buffer()), None):
        session = session_with(GpuTimer(gpu_times((10, 50), (20, 60))))
        hook = comm_hook(session, inner)
        with session.step(0):
            for _ in range(2):
                hook(None, Bucket()).wait()
        spans.append([(a // MS, b // MS) for _, a, b in comm_spans(session)])
        close(session)
    assert spans == [[(10, 50), (20, 60)], [(10, 50), (50, 60)]]


def completed(value) -> torch.futures.Future:
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(value)
    return future


# -- gloo groups in a CUDA job ----------------------------------------------------------------------
def test_gloo_collectives_are_marked_with_the_host_clock_in_a_cuda_job(gloo):
    """A CUDA event recorded in gloo's thread would land on device 0's default stream."""
    timer = GpuTimer([0, 100 * MS])
    session = session_with(timer)
    trace_collectives(session)
    with session.step(0) as step:
        dist.all_reduce(torch.ones(4), async_op=True).wait()
        dist.barrier()
    assert timer.taken == 2  # the step's own marks only
    assert all(type(m) is int for c in step.collectives for m in (c.start, c.end))
    assert [(c.stream, c.lane) for c in step.collectives] == [(None, None)] * 2
    wall = session.clock.wall
    assert [(a, b) for _, a, b in comm_spans(session)] == [(wall(c.start), wall(c.end)) for c in step.collectives]
    close(session)


def test_the_cuda_timer_reads_int_marks_as_monotonic_ns():
    class Anchor:
        def elapsed_time(self, event) -> float:
            return event.ms

    class Recorded:
        ms = 2.5

    timer = CudaTimer.__new__(CudaTimer)  # no GPU: the reading side only
    timer._tie, timer._free = (Anchor(), 1_000_000_000), []
    clock, event = Clock(), Recorded()
    assert timer.ready(123_456_789) and timer.to_wall(clock, 123_456_789) == clock.wall(123_456_789)
    assert timer.to_wall(clock, event) == clock.wall(1_000_000_000 + 2_500_000)
    assert timer.between(1_000_000_000, event) == 2_500_000  # an event and a host reading, on one base
    timer.release([123_456_789, event])
    assert timer._free == [event]  # an int is no event to record again
