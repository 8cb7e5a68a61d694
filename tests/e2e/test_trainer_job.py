"""The reference trainer end to end: a real 2-rank torchrun job (`rankwatch train`,
gloo on CPU, the `tiny` GPT) exporting through the agent to a real collector.

Covered, from one 12-step job with `--inject straggler:rank=1,slowdown=2,from=4`,
read from the DuckDB file after the collector stopped: one `step` row per
(rank, step), exactly once, with loss, grad norm (equal on both ranks after
DDP's all-reduce), tokens (batch x seq_len), the learning rate of the
trainer's schedule and MFU (inversely proportional to step time); the four
phase spans of every rank-step, children of its step span, adding up to the
step's duration within 5%; the DDP bucket all-reduces of every rank-step
summing to exactly the model's gradient bytes (unique parameters: the tied
embedding is reduced once), group size 2, sequence numbers contiguous and
equal across ranks, algbw = bytes / time and busbw = algbw x 2(n-1)/n;
`ranks` and `runs` rows; the `fault_injected` event; and the straggler
visible as rank 1's compute time and rank 0's exposed communication wait.

Also: collector.nccl's bus factors and op names against the nccl-tests
definitions (doc/PERFORMANCE.md) for every collective and several group
sizes, with NCCL kernel names and torch.distributed spellings.
"""

import itertools
import json
import math
import os
import signal
import statistics

import pytest

from collector.nccl import bus_factor, canonical_op
from tests.support.collectors import job_collector
from tests.support.commands import Interactive, rankwatch_cli
from tests.support.otlp_payloads import query
from trainer.job import SNAPSHOT_EVERY

pytestmark = pytest.mark.long

RUN = "run-trainer-job"
STEPS = 12
FAULT = "straggler:rank=1,slowdown=2,from=4"
PHASES = ["data", "forward", "backward", "optimizer"]
BATCH, LR, WARMUP = 8, 3e-3, 20  # the trainer's defaults (trainer/train.py)


def gradient_bytes() -> int:
    """What DDP all-reduces each step: every unique trainable parameter once."""
    from trainer.job import CONFIGS
    from trainer.model import GPT

    model = GPT(CONFIGS["tiny"])
    unique = {id(p): p for _, p in model.named_parameters(remove_duplicate=True) if p.requires_grad}
    naive = sum(p.numel() * p.element_size() for _, p in model.named_parameters(remove_duplicate=False))
    total = sum(p.numel() * p.element_size() for p in unique.values())
    c = CONFIGS["tiny"]
    assert naive - total == c.vocab * c.dim * 4  # the tied embedding / head weight, counted once
    return total


def expected_lr(step: int) -> float:
    """The rate the trainer records after `schedule.step()` at `step` (its LambdaLR at step + 1)."""
    s = step + 1
    return LR * min(1.0, (s + 1) / WARMUP) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s / STEPS, 1.0))))


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """Run the job through the CLI against a real collector, stop the collector, return the store."""
    with job_collector(tmp_path_factory.mktemp("trainer-job")) as collector:
        result = rankwatch_cli(
            "train",
            *("--nproc", "2", "--steps", str(STEPS), "--run", RUN, "--inject", FAULT, "--collector", collector.url),
            env={"RANKWATCH_TOKEN": "test-token-0123456"},
        )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "2 ranks, GPT tiny" in result.stdout
    return collector.db


def test_sigterm_to_the_command_stops_torchrun_and_every_rank(collector_factory):
    """A service manager stops `rankwatch train` with SIGTERM to it alone: no rank may go on, orphaned,
    and each rank, stopped by torchrun with SIGTERM in turn, first sends the steps it had not sent yet
    (the agent exports every second: killed outright, a rank loses its last ones)."""
    collector = collector_factory()
    train = Interactive(
        "train",
        "--nproc",
        "2",
        "--steps",
        "100000",
        "--run",
        "run-stopped",
        "--collector",
        collector.url,
        env={**os.environ, "RANKWATCH_TOKEN": collector.token, "RANKWATCH_DB": str(collector.db)},
    )  # its checkpoints, beside it
    try:
        train.read_until("step    20 ", 240)
        train.stop(signal.SIGTERM)
        assert train.process.returncode == 130  # as after Ctrl-C
        assert train.left_running() == ""
    finally:
        train.kill()
    collector.stop()
    stored = query(
        collector.db,
        "SELECT rank, count(DISTINCT step), min(step), max(step) FROM steps "
        "WHERE run_id = 'run-stopped' GROUP BY rank ORDER BY rank",
    )
    assert [rank for rank, *_ in stored] == [0, 1], stored
    for rank, count, first, last in stored:
        assert first == 0 and count == last + 1 and last >= 20, (rank, count, last)  # up to the printed step


def steps_by_rank(db, column: str) -> dict[int, dict[int, float]]:
    rows = query(db, f"SELECT rank, step, {column} FROM steps WHERE run_id = ?", [RUN])
    out: dict[int, dict[int, float]] = {0: {}, 1: {}}
    for rank, step, value in rows:
        out[rank][step] = value
    return out


def test_one_step_row_per_rank_step(job):
    rows = query(job, "SELECT rank, step, count(*) FROM steps WHERE run_id = ? GROUP BY ALL ORDER BY ALL", [RUN])
    assert rows == [(rank, step, 1) for rank in (0, 1) for step in range(STEPS)]
    assert query(job, "SELECT count(*) FROM steps") == [(2 * STEPS,)]  # nothing from any other run
    # start/end agree with the duration, and a rank's steps follow one another
    for rank in (0, 1):
        rows = query(
            job,
            "SELECT epoch_ns(start_ts), epoch_ns(end_ts), duration_s FROM steps "
            "WHERE run_id = ? AND rank = ? ORDER BY step",
            [RUN, rank],
        )
        for start, end, duration in rows:
            assert end - start == pytest.approx(duration * 1e9, abs=1)
            assert 0.005 < duration < 5
        for (_, end, _), (start, _, _) in itertools.pairwise(rows):
            assert start >= end
    # both ranks are inside step k at the same time (their gradients are all-reduced together)
    both = query(
        job,
        "SELECT a.step FROM steps a JOIN steps b ON a.step = b.step AND a.rank = 0 AND b.rank = 1 "
        "WHERE a.start_ts < b.end_ts AND b.start_ts < a.end_ts ORDER BY 1",
    )
    assert both == [(step,) for step in range(STEPS)]


def test_step_values(job):
    rows = query(
        job,
        "SELECT rank, step, loss, grad_norm, tokens, lr, mfu, duration_s FROM steps "
        "WHERE run_id = ? ORDER BY rank, step",
        [RUN],
    )
    assert len(rows) == 2 * STEPS
    for rank, step, loss, grad_norm, tokens, lr, mfu, _duration in rows:
        assert loss is not None and 0 < loss < 10, (rank, step, loss)
        assert grad_norm is not None and grad_norm > 0, (rank, step)
        assert tokens == BATCH * 64  # batch x seq_len of the tiny config
        assert lr == pytest.approx(expected_lr(step), rel=1e-6), (rank, step)
        # on CPU the peak is a matmul rate calibrated once at start (trainer/mfu.py), so on a loaded
        # machine MFU may even exceed 1; what it must be is positive and tied to the step time (below)
        assert mfu is not None and 0 < mfu < 100, (rank, step, mfu)
    first = [loss for _, step, loss, *_ in rows if step == 0]
    assert all(abs(loss - math.log(512)) < 0.5 for loss in first)  # untrained: about ln(vocab)
    grad = steps_by_rank(job, "grad_norm")
    for step in range(STEPS):  # DDP averaged the gradients: both ranks clip the same norm
        assert grad[0][step] == pytest.approx(grad[1][step], rel=1e-5)
    # mfu = 6 N tokens / step time / peak: mfu x step duration is the same on every step of a rank
    # (the trainer's step time and the span's differ only by a few statements around the span, where
    # a loaded 2-core machine may preempt the rank for a few ms, some per cent of a step)
    for rank in (0, 1):
        work = [mfu * duration for r, _, _, _, _, _, mfu, duration in rows if r == rank]
        typical = statistics.median(work)
        assert all(abs(w / typical - 1) < 0.25 for w in work), work
        assert sum(abs(w / typical - 1) < 0.02 for w in work) >= STEPS * 3 // 4, work


def test_phases_add_up_to_the_step(job):
    phases = query(
        job,
        """
        SELECT o.rank, o.step, list(o.name ORDER BY o.start_ts), sum(o.duration_s), s.duration_s, s.data_s,
               bool_and(o.parent_span_id = s.span_id AND o.trace_id = s.trace_id),
               bool_and(o.start_ts >= s.start_ts AND o.end_ts <= s.end_ts),
               sum(o.duration_s) FILTER (WHERE o.name = 'data'),
               sum(o.duration_s) FILTER (WHERE o.name IN ('forward', 'backward', 'optimizer')),
               s.compute_s + s.comm_wait_s
        FROM ops o JOIN steps s USING (run_id, rank, step)
        WHERE o.run_id = ? AND o.kind = 'phase' GROUP BY ALL ORDER BY o.rank, o.step""",
        [RUN],
    )
    assert [(rank, step) for rank, step, *_ in phases] == [(r, s) for r in (0, 1) for s in range(STEPS)]
    outside_5pct = []
    for rank, step, names, total, duration, data_s, children, inside, data, compute, compute_and_wait in phases:
        assert names == PHASES, (rank, step)
        assert children and inside, (rank, step)
        assert total <= duration * (1 + 1e-9)  # phases never overlap and stay inside their step
        if (step + 1) % SNAPSHOT_EVERY:  # (a snapshot's copy of the state, between phases, is the trainer's own)
            assert total == pytest.approx(duration, rel=0.25), (rank, step, total, duration)
        if total < 0.95 * duration:
            outside_5pct.append((rank, step, total, duration))
        assert data_s == pytest.approx(data, rel=1e-6, abs=1e-9)
        assert compute_and_wait == pytest.approx(compute, rel=1e-6, abs=1e-9)  # compute + exposed wait = phases
    # Within 5% on nearly every rank-step: on a loaded 2-core machine the main thread may wait for
    # the GIL (the exporter's thread encoding) or be preempted between two marks.
    assert len(outside_5pct) <= len(phases) // 8, outside_5pct
    assert sum(p[3] for p in phases) == pytest.approx(sum(p[4] for p in phases), rel=0.05)


def test_ddp_all_reduces(job):
    expected = gradient_bytes()
    assert expected == 1_882_112  # 470,528 float32 parameters
    rows = query(
        job,
        """
        SELECT o.rank, o.step, sum(o.bytes), count(*), list(o.seq ORDER BY o.start_ts),
               bool_and(o.parent_span_id = s.span_id), bool_and(o.start_ts >= s.start_ts AND o.end_ts <= s.end_ts)
        FROM ops o JOIN steps s USING (run_id, rank, step)
        WHERE o.run_id = ? AND o.kind = 'comm' GROUP BY ALL ORDER BY o.rank, o.step""",
        [RUN],
    )
    assert [(rank, step) for rank, step, *_ in rows] == [(r, s) for r in (0, 1) for s in range(STEPS)]
    for rank, step, nbytes, count, _, children, inside in rows:
        assert nbytes == expected, (rank, step, nbytes)
        assert count >= 1 and children and inside, (rank, step)
    for rank in (0, 1):
        seqs = [seq for r, _, _, _, step_seqs, _, _ in rows if r == rank for seq in step_seqs]
        assert seqs == list(range(len(seqs)))  # strictly increasing, none missing
    # the ranks agree on which collective is which (what hang detection matches on)
    per_step = {(r, step): step_seqs for r, step, _, _, step_seqs, _, _ in rows}
    assert all(per_step[0, step] == per_step[1, step] for step in range(STEPS))

    ops = query(
        job,
        "SELECT name, comm_group, group_size, bytes, duration_s, algbw_gbps, busbw_gbps FROM ops "
        "WHERE run_id = ? AND kind = 'comm'",
        [RUN],
    )
    assert len(ops) >= 2 * STEPS
    for name, group, size, nbytes, duration, algbw, busbw in ops:
        assert (name, group, size) == ("all_reduce", "world", 2)
        assert duration > 0
        assert algbw == pytest.approx(nbytes / duration / 1e9, rel=1e-9)
        assert busbw == pytest.approx(algbw * 2 * (2 - 1) / 2, rel=1e-12)  # = algbw for n = 2


def test_ranks_and_run(job):
    rows = query(
        job, "SELECT rank, device, dp_rank, local_rank, host, pid FROM ranks WHERE run_id = ? ORDER BY rank", [RUN]
    )
    assert [(r, device, dp, local) for r, device, dp, local, _, _ in rows] == [(0, "cpu", 0, 0), (1, "cpu", 1, 1)]
    assert all(host for *_, host, _ in rows)
    assert rows[0][5] != rows[1][5] and all(pid > 0 for *_, pid in rows)  # one process per rank
    assert query(job, "SELECT run_id, world_size FROM runs") == [(RUN, 2)]


def test_fault_event_and_straggler(job):
    events = query(job, "SELECT rank, step, attrs FROM events WHERE run_id = ? AND event = 'fault_injected'", [RUN])
    assert [(rank, step, json.loads(attrs)) for rank, step, attrs in events] == [(1, 4, {"rankwatch.fault": FAULT})]

    compute, wait = steps_by_rank(job, "compute_s"), steps_by_rank(job, "comm_wait_s")
    after = range(4, STEPS)
    compute_0, compute_1 = (statistics.median(compute[r][s] for s in after) for r in (0, 1))
    wait_0, wait_1 = (statistics.median(wait[r][s] for s in after) for r in (0, 1))
    # rank 1 computes ~2x longer; rank 0 waits for it at the end of backward
    assert compute_1 > 1.4 * compute_0, (compute_0, compute_1)
    assert wait_0 > 1.5 * wait_1 and wait_0 - wait_1 > 0.01, (wait_0, wait_1)


# -- collector.nccl against nccl-tests' doc/PERFORMANCE.md -------------------------------------------------------
NCCL_TESTS = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
    "send": lambda n: 1.0,
    "recv": lambda n: 1.0,
}


@pytest.mark.parametrize("op", sorted(NCCL_TESTS))
@pytest.mark.parametrize("n", [1, 2, 3, 4, 8, 16, 1024])
def test_bus_factor_matches_nccl_tests(op, n):
    assert bus_factor(op, n) == pytest.approx(NCCL_TESTS[op](n), rel=1e-12)


def test_bus_factor_examples():
    assert bus_factor("all_reduce", 2) == 1.0
    assert bus_factor("all_reduce", 8) == 1.75
    assert bus_factor("all_gather", 8) == 0.875
    assert bus_factor("reduce_scatter", 4) == 0.75
    assert bus_factor("broadcast", 64) == 1.0
    assert bus_factor("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 4) == 1.5
    assert bus_factor("nccl:all_gather", 4) == 0.75
    assert bus_factor("not_a_collective", 4) is None
    assert bus_factor("all_reduce", 0) is None


@pytest.mark.parametrize(
    "name, op",
    [
        ("all_reduce", "all_reduce"),
        ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "all_reduce"),
        ("ncclKernel_AllReduce_RING_LL_Sum_float", "all_reduce"),
        ("ncclDevKernel_AllReduce_Sum_bf16_TREE_LL128", "all_reduce"),
        ("nccl:all_reduce", "all_reduce"),
        ("c10d::allreduce_", "all_reduce"),
        ("AllReduce", "all_reduce"),
        ("nccl:all_gather", "all_gather"),
        ("all_gather_into_tensor", "all_gather"),
        ("_allgather_base", "all_gather"),
        ("ncclDevKernel_AllGather_RING_LL", "all_gather"),
        ("reduce_scatter_tensor", "reduce_scatter"),
        ("nccl:reduce_scatter", "reduce_scatter"),
        ("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", "reduce_scatter"),
        ("all_to_all_single", "all_to_all"),
        ("nccl:all_to_all", "all_to_all"),
        ("ncclDevKernel_Broadcast_RING_LL", "broadcast"),
        ("nccl:broadcast", "broadcast"),
        ("ncclDevKernel_Reduce_Sum_f32_RING_LL", "reduce"),
        ("nccl:send", "send"),
        ("isend", "send"),
        ("ncclDevKernel_SendRecv", "send"),
        ("nccl:recv", "recv"),
        ("irecv", "recv"),
        ("forward", None),
        ("aten::mm", None),
        ("optimizer", None),
    ],
)
def test_canonical_op(name, op):
    assert canonical_op(name) == op
