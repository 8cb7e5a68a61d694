"""The agent's timings on a real GPU (marker `cuda`: skipped, saying why, where torch sees none).

Covered, on one GPU with NCCL (world size 1) and a real collector: DDP's
gradient buckets timed by `comm_hook` leave an exposed wait near zero (an
all-reduce without a peer waits for nobody) and their durations within the
backward pass; a blocking all-reduce's stored duration is the CUDA-event
reading around the call, to the few µs between the events; ranks a job puts
on the CPU of a GPU machine time their steps with CPU readings.
"""

import statistics

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from rankwatch.agent.clock import CudaTimer
from rankwatch.agent.collectives import comm_hook, trace_collectives, untrace_collectives
from rankwatch.agent.session import Session
from tests.support.otlp_payloads import query

pytestmark = pytest.mark.cuda


@pytest.fixture
def nccl():
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    yield
    untrace_collectives()  # trace_collectives wraps torch.distributed's functions: put them back
    dist.destroy_process_group()


def train(collector, cwd, run: str, *args: str) -> None:
    """`rankwatch train` as a user runs it, sending to `collector`, which is stopped once the job is done."""
    from tests.support.commands import rankwatch_cli

    result = rankwatch_cli(
        "train", *args, "--run", run, "--collector", collector.url, env={"RANKWATCH_TOKEN": collector.token}, cwd=cwd
    )
    assert result.returncode == 0, result.stderr[-3000:]
    collector.stop()


def cuda_session(collector) -> Session:
    return Session("run-cuda", 0, 1, collector.url, collector.token, timer=CudaTimer(torch.cuda.current_device()))


def test_one_gpu_ddp_exposes_almost_no_wait(collector, nccl):
    from trainer.data import TokenStream
    from trainer.job import CONFIGS
    from trainer.model import GPT

    torch.manual_seed(0)
    model = GPT(CONFIGS["small"]).cuda()
    ddp = DistributedDataParallel(model, device_ids=[0], bucket_cap_mb=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = TokenStream(model.config.vocab, model.config.seq_len, 8, 0)
    session = cuda_session(collector)
    ddp.register_comm_hook(None, comm_hook(session))
    for i in range(30):
        inputs, targets = (t.cuda() for t in data.next())
        with session.step(i):
            with session.phase("forward"):
                loss = ddp(inputs, targets)
            with session.phase("backward"):
                loss.backward()
            with session.phase("optimizer"):
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
    session.shutdown()
    collector.stop()
    rows = query(
        collector.db,
        """
        SELECT s.step, s.duration_s, s.comm_wait_s, b.duration_s, sum(o.duration_s), count(*)
        FROM steps s JOIN ops o USING (run_id, rank, step) JOIN ops b USING (run_id, rank, step)
        WHERE o.kind = 'comm' AND b.kind = 'phase' AND b.name = 'backward' AND s.step >= 5
        GROUP BY ALL ORDER BY s.step""",
    )
    assert len(rows) == 25
    durations = [duration for _, duration, *_ in rows]
    waits = [wait for _, _, wait, *_ in rows]
    assert statistics.median(waits) < min(0.02 * statistics.median(durations), 1e-3), (waits, durations)
    for step, _duration, _wait, backward, comm, buckets in rows:
        assert buckets >= 2 and 0 < comm <= backward, (step, comm, backward)


def test_a_blocking_all_reduce_lasts_what_cuda_events_around_it_read(collector, nccl):
    """The GPU is kept busy ahead of the call, as in training, so that the events read the GPU's time,
    not the host's (on an idle GPU an event reads when the host recorded it, and the first call's
    NCCL set-up and the wrapper's own Python would show)."""
    x = torch.ones(64 * 2**20, device="cuda")  # 256 MiB
    dist.all_reduce(x)  # NCCL's communicator made, untraced
    session = cuda_session(collector)
    trace_collectives(session)
    before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with session.step(0), session.phase("optimizer"):
        for _ in range(50):  # milliseconds of work ahead of it on the stream
            x.mul_(1.0)
        before.record()
        dist.all_reduce(x)
        after.record()
    after.synchronize()
    session.shutdown()
    collector.stop()
    ((duration,),) = query(collector.db, "SELECT duration_s FROM ops WHERE kind = 'comm'")
    around = before.elapsed_time(after) / 1e3
    assert around - 50e-6 <= duration <= around + 2e-6, (duration, around)


def test_cpu_ranks_on_a_gpu_machine_time_their_steps_on_the_cpu(collector, tmp_path):
    """`--device cpu` (as `auto` picks for more ranks than GPUs): the ranks train on the CPU, so their
    marks are CPU readings; CUDA events on an idle GPU would time every phase at a few µs."""
    train(collector, tmp_path, "run-cpu-ranks", "--nproc", "2", "--steps", "6", "--device", "cpu")
    rows = query(collector.db, "SELECT rank, step, compute_s FROM steps WHERE run_id = 'run-cpu-ranks'")
    assert len(rows) == 12
    assert statistics.median(compute for _, _, compute in rows) > 1e-3, rows
    assert query(collector.db, "SELECT DISTINCT device FROM ranks") == [("cpu",)]


def test_a_step_with_the_agent_never_syncs(collector, nccl):
    """The agent's hot path on a GPU waits for nothing: steps, phases, DDP's buckets and a loss and grad
    norm recorded as GPU tensors, under torch's sync debug mode set to raise on any synchronizing call
    (a `.item()` on the loss would be one)."""
    from trainer.data import TokenStream
    from trainer.job import CONFIGS
    from trainer.model import GPT

    model = GPT(CONFIGS["small"]).cuda()
    ddp = DistributedDataParallel(model, device_ids=[0])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = TokenStream(model.config.vocab, model.config.seq_len, 8, 0)
    batches = [tuple(t.cuda() for t in data.next()) for _ in range(2)]
    session = cuda_session(collector)
    ddp.register_comm_hook(None, comm_hook(session))

    def step(i: int) -> None:
        inputs, targets = batches[i % 2]
        with session.step(i):
            with session.phase("forward"), torch.autocast("cuda", dtype=torch.bfloat16):
                loss = ddp(inputs, targets)
            with session.phase("backward"):
                loss.backward()
            with session.phase("optimizer"):
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            session.record(loss=loss.detach(), grad_norm=norm.detach())

    for i in range(3):  # allocations and DDP's bucket rebuild first
        step(i)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for i in range(3, 23):
            step(i)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    session.shutdown()
    collector.stop()
    rows = query(collector.db, "SELECT step, loss, grad_norm FROM steps WHERE step >= 3 ORDER BY step")
    assert [r[0] for r in rows] == list(range(3, 23))
    assert all(loss > 0 and norm > 0 for _, loss, norm in rows), rows


def test_snapshots_of_a_gpu_job_never_stall_its_steps(collector, tmp_path):
    """A GPU job taking a snapshot every 10 steps, its ring growing with the measured step time: no step
    waits for host memory to be pinned (on an H200 a GPT-2 job's snapshot steps took 10 s and 65 s
    while its ring of 37 snapshots was pinned on the training thread's path, and 10 s once pinned on a
    thread of its own, which still held every CUDA call)."""
    train(collector, tmp_path, "run-gpu-ckpt", "--nproc", "1", "--steps", "60", "--model", "small", "--device", "cuda")
    rows = query(collector.db, "SELECT step, duration_s FROM steps WHERE run_id = 'run-gpu-ckpt' AND step >= 5")
    assert len(rows) == 55
    durations = sorted(d for _, d in rows)
    median = durations[len(durations) // 2]
    assert durations[-1] < max(20 * median, 1.0), rows  # a snapshot step is a step, not an allocation
