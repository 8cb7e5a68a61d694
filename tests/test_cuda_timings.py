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
from conftest import free_port
from otlp_payloads import query
from torch.nn.parallel import DistributedDataParallel

from agent.clock import CudaTimer
from agent.collectives import comm_hook, trace_collectives, untrace_collectives
from agent.session import Session

pytestmark = pytest.mark.cuda


@pytest.fixture
def nccl():
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    untrace_collectives()  # trace_collectives wraps torch.distributed's functions: put them back
    dist.destroy_process_group()


def cuda_session(collector) -> Session:
    return Session("run-cuda", 0, 1, collector.url, collector.token, timer=CudaTimer(torch.cuda.current_device()))


def test_one_gpu_ddp_exposes_almost_no_wait(collector, nccl):
    from trainer.data import TokenStream
    from trainer.model import CONFIGS, GPT

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
    session = cuda_session(collector)
    trace_collectives(session)
    x = torch.ones(64 * 2**20, device="cuda")  # 256 MiB
    before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with session.step(0), session.phase("optimizer"):
        x.mul_(2)  # work ahead of it on the stream
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
    from conftest import rankwatch_cli

    result = rankwatch_cli(
        "train",
        "--nproc",
        "2",
        "--steps",
        "6",
        "--run",
        "run-cpu-ranks",
        "--device",
        "cpu",
        "--collector",
        collector.url,
        env={"RANKWATCH_TOKEN": collector.token},
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    collector.stop()
    rows = query(collector.db, "SELECT rank, step, compute_s FROM steps WHERE run_id = 'run-cpu-ranks'")
    assert len(rows) == 12
    assert statistics.median(compute for _, _, compute in rows) > 1e-3, rows
    assert query(collector.db, "SELECT DISTINCT device FROM ranks") == [("cpu",)]
