"""The trainer's checkpointer (trainer/checkpoint.py), with real torch on CPU and real files.

Covered: a snapshot is isolated from what training changes after it (Python
state at once, tensors after `wait_until_safe`); a run resumed from its disk
checkpoint in a fresh process state (other initialisation, other RNG, data
stream at 0) has bitwise the same per-step losses and final parameters as the
uninterrupted run, RNG and data position included; the memory tier restores
the newest snapshot at or before a step, drops the later ones, reuses its
buffers (same storage across snapshots) and can be rolled back to twice; a
damaged checkpoint (each way the manifest catches) is reported and skipped
for the previous one; a writer killed with SIGKILL at random moments, many
times, leaves only checkpoints that verify, and the loader takes the newest
complete one; and a real 2-rank `rankwatch train --max-restarts 1` whose
rank 1 crashes resumes from its last durable step, seen in the events and
steps of a real collector.

Run as a script (`python tests/test_checkpoint.py DIR`) this file is the
writer that the SIGKILL test kills.
"""

import json
import logging
import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import pytest
import torch
from conftest import rankwatch_cli
from otlp_payloads import query

from rankwatch.launch import train
from trainer import rollback
from trainer.checkpoint import MANIFEST, META, TENSORS, Checkpointer, NoCheckpoint
from trainer.data import TokenStream
from trainer.model import GPT, GPTConfig

pytestmark = pytest.mark.long

# deterministic cuBLAS (read when its handle is made, so before any test runs on CUDA)
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
CONFIG = GPTConfig(vocab=64, seq_len=16, layers=1, heads=2, dim=32)


@dataclass
class Job:
    """A tiny training job and its checkpointer."""

    model: GPT
    optimizer: torch.optim.Optimizer
    schedule: torch.optim.lr_scheduler.LRScheduler
    data: TokenStream
    ckpt: Checkpointer

    def step(self, step: int) -> float:
        """One training step, snapshot after it; the loss (which draws on the RNGs, so a resume must restore them)."""
        device = next(self.model.parameters()).device
        inputs, targets = (t.to(device) for t in self.data.next())
        rand = torch.rand(()) * torch.rand((), device=device).cpu()  # the CPU generator and the device's
        loss = self.model(inputs, targets) * (1 + 0.01 * rand.item() * random.random())
        loss.backward()
        self.ckpt.wait_until_safe()
        self.optimizer.step()
        self.schedule.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.ckpt.snapshot(step + 1)
        return loss.item()


def job(directory: Path, seed: int = 0, device: str = "cpu", rank: int = 0, **ckpt) -> Job:
    torch.manual_seed(seed)
    random.seed(seed)
    model = GPT(CONFIG).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 5))
    data = TokenStream(CONFIG.vocab, CONFIG.seq_len, 4, rank=rank, seed=seed)
    state = {"model": model, "optimizer": optimizer, "schedule": schedule, "data": data}
    return Job(model, optimizer, schedule, data, Checkpointer(directory, state, **ckpt))


def parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    assert all(torch.equal(a[name], b[name]) for name in a), [name for name in a if not torch.equal(a[name], b[name])]


@pytest.fixture
def deterministic():
    torch.use_deterministic_algorithms(True, warn_only=True)  # CUDA: an op without a deterministic kernel warns
    yield
    torch.use_deterministic_algorithms(False)


def test_snapshot_is_isolated_from_later_changes(tmp_path):
    j = job(tmp_path)
    j.step(0)  # snapshot of step 1
    expected = parameters(j.model)
    expected_moments = [s["exp_avg"].clone() for s in j.optimizer.state.values()]
    j.data.next()  # the next step reads a batch before the copy is waited for
    j.ckpt.wait_until_safe()
    with torch.no_grad():
        for p in j.model.parameters():
            p.add_(1.0)
    j.optimizer.step()  # the moments change in place
    assert j.ckpt.restore(1) == 1
    assert_same(parameters(j.model), expected)
    assert all(torch.equal(s["exp_avg"], m) for s, m in zip(j.optimizer.state.values(), expected_moments, strict=True))
    assert j.data.position == 1
    j.ckpt.close()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_resume_from_disk_matches_the_uninterrupted_run(tmp_path, deterministic, device):
    """From disk and from memory, a restored run continues bitwise like the uninterrupted one: on
    CUDA too, where the copy is asynchronous, into pinned memory on a side stream."""
    steps = 12
    whole = job(tmp_path / "whole", device=device, disk_every=4)
    expected = [whole.step(s) for s in range(steps)]
    whole.ckpt.close()

    first = job(tmp_path / "crashed", device=device, memory=6, disk_every=4)  # 6: step 7 stays while 4 and 8 flush
    assert [first.step(s) for s in range(10)] == expected[:10]
    assert first.ckpt.restore(7) == 7  # from memory, the copies of steps 8 to 10 overtaken by training
    assert [first.step(s) for s in range(7, 10)] == expected[7:10]
    first.ckpt.close()  # on disk: steps 4 and 8; snapshots 9 and 10 were only in memory, lost with the process

    resumed = job(tmp_path / "crashed", seed=99, device=device, disk_every=4)  # another initialisation, RNG, data
    assert resumed.ckpt.restore(steps) == 8
    assert resumed.data.position == 8 and resumed.data.seed == 0
    assert [resumed.step(s) for s in range(8, steps)] == expected[8:]  # bitwise
    assert_same(parameters(resumed.model), parameters(whole.model))
    resumed.ckpt.close()


def test_memory_tier_restores_and_reuses_its_buffers(tmp_path, deterministic):
    j = job(tmp_path, memory=3, disk_every=1000)
    losses, saved, buffers = [], {}, []
    for step in range(6):
        losses.append(j.step(step))
        saved[step + 1] = parameters(j.model)
        if step + 1 >= 3:  # the ring is full from the third snapshot on
            j.ckpt.wait_until_safe()
            buffers.append([(s.buffer.data_ptr(), s.buffer.numel()) for s in j.ckpt._slots])
    assert len(buffers[0]) == 3 and all(b == buffers[0] for b in buffers)
    assert sorted(s.step for s in j.ckpt._slots) == [4, 5, 6]

    assert j.ckpt.restore(5) == 5  # from memory: nothing was ever written to disk
    assert not any(tmp_path.iterdir())
    assert_same(parameters(j.model), saved[5])
    assert j.data.position == 5 and j.schedule.last_epoch == 5
    assert j.step(5) == losses[5]  # a rollback replays the step exactly
    assert j.ckpt.restore(5) == 5  # twice: the first rollback's training left the snapshot alone
    assert j.step(5) == losses[5]
    with pytest.raises(NoCheckpoint):
        j.ckpt.restore(3)  # evicted from the ring of 3
    assert j.ckpt.restore(100) == 6  # the new snapshot of step 6; the old one was dropped by the rollback
    j.ckpt.close()


def test_rollback_past_the_memory_tier_loads_from_disk_and_says_so(tmp_path, deterministic, caplog):
    j = job(tmp_path, memory=2, disk_every=2)
    for step in range(6):
        j.step(step)
        j.ckpt.durable_steps()  # a disk that keeps up: a slot still being written is not reused, a newer one is
    j.ckpt.wait_until_safe()
    with caplog.at_level(logging.WARNING, logger="trainer.checkpoint"):
        assert j.ckpt.restore(5) == 5  # in memory (steps 5 and 6): no word
        assert not caplog.records
        for step in range(5, 7):
            j.step(step)
        j.ckpt.wait_until_safe()
        assert j.ckpt.restore(5) == 4  # memory holds steps 6 and 7: from disk
    [warning] = [r.getMessage() for r in caplog.records]
    assert warning == (
        "checkpoint: all 2 snapshots in memory are newer than step 5: keep more (--ckpt-memory) for an instant rollback"
    )
    j.ckpt.close()


def test_a_rollback_that_finds_no_checkpoint_spends_none_of_the_budget(tmp_path):
    """Only a rollback done counts against the budget; past it the job stops, its good state durable."""
    j = job(tmp_path, memory=2, disk_every=1000)
    for step in range(4):
        j.step(step)  # the ring holds steps 3 and 4, the disk nothing
    budget = rollback.Budget(rollbacks=1, window=1000)

    def rollback_to(before_step: int, command_id: int) -> int:
        command = {
            "id": command_id,
            "args": {"before_step": before_step, "anomaly": "nan"},
            "created_at": datetime.now(UTC).isoformat(),
        }
        return rollback.apply(command, 4, j.ckpt, j.data, j.schedule, budget, time.time_ns)

    assert rollback_to(1, 7) == 4 and budget.applied == []  # nothing that far back: the job trains on
    assert rollback_to(3, 8) == 3 and budget.applied == [(4, "command 8, for nan, back to step 3")]  # the one
    with pytest.raises(rollback.Stop) as stop:
        rollback_to(3, 9)
    assert str(stop.value) == (
        f"1 rollbacks within 1000 steps: stopping instead of another, with step 3 durable in "
        f"{tmp_path} (the rollbacks: at step 4: command 8, for nan, back to step 3; this one "
        "command 9, for nan, back to step 3)"
    )
    assert j.ckpt.durable_steps() == [3]
    j.ckpt.close()


def _flip_a_byte(path: Path) -> None:
    data = bytearray((path / TENSORS).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (path / TENSORS).write_bytes(bytes(data))


DAMAGE = {  # how -> (damage, the reason reported)
    "flipped byte": (_flip_a_byte, "tensors.bin does not match its checksum"),
    "truncated": (lambda p: (p / TENSORS).write_bytes((p / TENSORS).read_bytes()[:-100]), "tensors.bin has"),
    "missing file": (lambda p: (p / META).unlink(), "state.pkl is missing"),
    "no manifest": (lambda p: (p / MANIFEST).unlink(), "no manifest"),
    "garbled manifest": (lambda p: (p / MANIFEST).write_text('{"step": 4, "fi'), "unreadable manifest"),
    "manifest of another step": (
        lambda p: (p / MANIFEST).write_text(json.dumps({**json.loads((p / MANIFEST).read_text()), "step": 3})),
        "the manifest is of step 3",
    ),
}


@pytest.mark.parametrize("how", sorted(DAMAGE))
def test_damaged_checkpoint_is_reported_and_skipped(tmp_path, how, caplog):
    j = job(tmp_path, disk_every=2)
    for step in range(4):
        j.step(step)
    j.ckpt.close()
    damage, why = DAMAGE[how]
    damage(tmp_path / "step-00000004")

    fresh = job(tmp_path, seed=5, disk_every=2)
    with caplog.at_level(logging.WARNING, logger="trainer.checkpoint"):
        assert fresh.ckpt.restore(100) == 2
    assert fresh.data.position == 2
    [report] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "step-00000004 skipped: " + why in report, report
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000002"]  # the damaged one, later, is gone
    fresh.ckpt.close()


BIG = 8 << 20  # floats: a 32 MiB state, so that the writer is busy most of the time


def big_state() -> torch.nn.ParameterList:
    """One large tensor and many small ones, all equal to the step they were saved at."""
    return torch.nn.ParameterList([torch.zeros(BIG), *(torch.zeros(7) for _ in range(50))])


def write_forever(directory: Path) -> None:
    """The process the SIGKILL test kills: resume, say where, then write a checkpoint every step."""
    state = big_state()
    ckpt = Checkpointer(directory, {"state": state}, memory=2, disk_every=1, keep=2)
    try:
        step = ckpt.restore(sys.maxsize)
    except NoCheckpoint:
        step = 0
    print(step, flush=True)
    while True:
        step += 1
        ckpt.wait_until_safe()
        with torch.no_grad():
            for p in state:
                p.fill_(step)
        ckpt.snapshot(step)


def test_sigkill_leaves_only_loadable_checkpoints(tmp_path):
    chance, restored, partial_seen = random.Random(11), 0, 0
    for _ in range(4):
        writer = subprocess.Popen([sys.executable, __file__, str(tmp_path)], stdout=subprocess.PIPE, text=True)
        assert int(writer.stdout.readline()) == restored  # it found what the loader found last time
        time.sleep(chance.uniform(0.5, 2.0))
        writer.kill()
        writer.wait()

        on_disk = {int(p.name[5:]): p for p in tmp_path.glob("step-*")}
        complete = sorted(step for step, p in on_disk.items() if (p / MANIFEST).exists())
        partial_seen += len(complete) < len(on_disk) or any(tmp_path.glob("step-*/*.tmp"))
        state = big_state()
        ckpt = Checkpointer(tmp_path, {"state": state}, memory=2, disk_every=1, keep=2)
        assert ckpt.durable_steps() == complete  # a complete checkpoint is a sound one
        if complete:
            restored = ckpt.restore(sys.maxsize)
            assert restored == complete[-1]
            assert all(torch.all(p == restored) for p in state)
        else:  # killed before its first checkpoint was complete (a loaded machine)
            with pytest.raises(NoCheckpoint):
                ckpt.restore(sys.maxsize)
        ckpt.close()
    assert restored > 0
    assert partial_seen  # some kills did land in the middle of a flush


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--snapshot-every", "3", "--ckpt-every", "10"], "--ckpt-every 10 is not a multiple of --snapshot-every 3"),
        (["--ckpt-memory", "0"], "must be at least 1"),
    ],
)
def test_trainer_refuses_checkpoint_settings_it_cannot_keep(argv, words, capsys):
    from trainer.train import arguments

    with pytest.raises(SystemExit) as e:
        arguments(argv)
    assert e.value.code == 2 and words in capsys.readouterr().err


RUN = "run-checkpoint-restart"


def test_torchrun_restart_resumes_from_the_last_durable_step(collector, tmp_path):
    result = rankwatch_cli(
        "train",
        "--nproc",
        "2",
        "--steps",
        "120",
        "--max-restarts",
        "1",
        "--run",
        RUN,
        "--inject",
        "crash:rank=1,at=115",
        "--collector",
        collector.url,
        env={"RANKWATCH_TOKEN": collector.token},
        cwd=tmp_path,
    )
    collector.stop()
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed at step 100" in result.stdout

    def events(name: str) -> list[tuple]:
        return query(
            collector.db,
            "SELECT rank, step, attrs FROM events WHERE run_id = ? AND event = ? ORDER BY rank, step",
            [RUN, name],
        )

    # The first attempt's only durable checkpoint. Rank 0's event may not have left before torchrun
    # stopped it; rank 1, the one that crashed, sent everything first.
    disk = [
        (rank, step)
        for rank, step, attrs in events("checkpoint_saved")
        if json.loads(attrs)["rankwatch.checkpoint.tier"] == "disk"
    ]
    assert (1, 100) in disk and {step for _, step in disk} == {100}, disk
    restored = [
        (rank, step, json.loads(attrs)["rankwatch.checkpoint.tier"])
        for rank, step, attrs in events("checkpoint_restored")
    ]
    assert restored == [(0, 100, "disk"), (1, 100, "disk")]
    assert [(rank, step) for rank, step, _ in events("fault_injected")] == [(1, 115)]  # the restart does not crash
    for rank in (0, 1):
        assert (
            tmp_path / "rankwatch-data" / "runs" / RUN / "checkpoints" / f"rank-{rank}" / "step-00000100" / MANIFEST
        ).exists()

    losses = query(
        collector.db,
        "SELECT step, list(loss ORDER BY start_ts) FROM steps WHERE run_id = ? AND rank = 1 "
        "GROUP BY step ORDER BY step",
        [RUN],
    )
    assert [step for step, _ in losses] == list(range(120))
    for step, attempts in losses:  # steps 100..114 ran twice, and the resumed attempt repeated them exactly
        assert len(attempts) == (2 if 100 <= step < 115 else 1), (step, attempts)
        assert len(set(attempts)) == 1, (step, attempts)


def test_listing_reads_manifests_only_and_loading_verifies(tmp_path, caplog):
    """What is durable is told by the manifests and file sizes alone: a damaged older checkpoint is
    listed (its data was not read), and only loading it finds the damage and falls back as before."""
    j = job(tmp_path, disk_every=2)
    for step in range(6):
        j.step(step)
    j.ckpt.close()  # on disk: steps 4 and 6
    _flip_a_byte(tmp_path / "step-00000004")

    fresh = job(tmp_path, seed=5, disk_every=2)
    with caplog.at_level(logging.WARNING, logger="trainer.checkpoint"):
        assert fresh.ckpt.durable_steps() == [4, 6]
        assert not caplog.records  # nothing hashed, so nothing found
        assert fresh.ckpt.restore(6) == 6  # the newest verifies
        with pytest.raises(NoCheckpoint):
            fresh.ckpt.restore(5)  # step 4 is hashed now, found damaged, and nothing older is left
    [report] = [r.getMessage() for r in caplog.records]
    assert "step-00000004 skipped: tensors.bin does not match its checksum" in report
    fresh.ckpt.close()


def replica_jobs(tmp_path: Path, count: int, **ckpt) -> list[Job]:
    """`count` data-parallel replicas: the same initialisation, each its own data and checkpoint directory."""
    replicas = [tmp_path / f"rank-{r}" for r in range(count)]
    return [job(replicas[r], rank=r, replicas=replicas, **ckpt) for r in range(count)]


def replica_step(jobs: list[Job], step: int) -> None:
    """One DDP step without the process group: every replica applies the mean of their gradients."""
    for j in jobs:
        inputs, targets = j.data.next()
        j.model(inputs, targets).backward()
    for params in zip(*(j.model.parameters() for j in jobs)):
        mean = sum(p.grad for p in params) / len(params)
        for p in params:
            p.grad = mean.clone()
    for j in jobs:
        j.ckpt.wait_until_safe()
        j.optimizer.step()
        j.schedule.step()
        j.optimizer.zero_grad(set_to_none=True)
        j.ckpt.snapshot(step + 1)


def test_replicas_write_their_tensors_once_and_each_restores_them_all(tmp_path):
    alone = replica_jobs(tmp_path / "one", 1, disk_every=2)
    pair = replica_jobs(tmp_path / "two", 2, disk_every=2)
    for step in range(4):
        replica_step(alone, step)
        replica_step(pair, step)
    expected = [parameters(j.model) for j in pair]
    assert_same(expected[0], expected[1])
    for j in alone + pair:
        j.ckpt.close()

    def size(directory: Path) -> int:
        return sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())

    one, two = size(tmp_path / "one"), size(tmp_path / "two")
    assert one < two < 1.3 * one, (one, two)
    shares = [(tmp_path / "two" / f"rank-{r}" / "step-00000004" / TENSORS).stat().st_size for r in range(2)]
    assert (
        abs(shares[0] - shares[1]) <= 64
        and sum(shares) < 1.01 * (tmp_path / "one" / "rank-0" / "step-00000004" / TENSORS).stat().st_size
    )

    fresh = [
        job(tmp_path / "two" / f"rank-{r}", seed=7, rank=r, replicas=[tmp_path / "two" / f"rank-{i}" for i in range(2)])
        for r in range(2)
    ]
    for r, j in enumerate(fresh):
        assert j.ckpt.restore(100) == 4
        assert_same(parameters(j.model), expected[r])
        assert (j.data.rank, j.data.position) == (r, 4)
    _flip_a_byte(tmp_path / "two" / "rank-1" / "step-00000004")  # one share damaged: neither replica loads step 4
    for j in fresh:
        assert j.ckpt.restore(100) == 2
        j.ckpt.close()


def test_ring_sized_from_step_time_and_detection_latency_serves_a_rollback_from_memory(tmp_path):
    """The ring grown to the measured step time x the detection latency holds the snapshot that a
    rollback a detection latency after its anomaly asks for; the ring of 2 it started with does not."""
    reach = rollback.Reach(latency_s=0.5)
    j = job(tmp_path, memory=2, disk_every=1000)
    step, started = 0, time.monotonic()
    while step < 10 or time.monotonic() - started < 3 * reach.latency_s:
        reach.step_started(step)
        j.ckpt.grow(reach.ring(every=1))
        j.step(step)  # a snapshot every step
        step += 1
    anomaly = max(s for s, at in reach.started.items() if at <= time.monotonic() - reach.latency_s)
    target = anomaly - rollback.MARGIN
    assert j.ckpt.memory > 2 and step - target > 2
    assert j.ckpt.restore(target) == target  # from memory: nothing was written to disk
    assert not any(tmp_path.iterdir())
    j.ckpt.close()


def test_measured_detection_latency_grows_the_reach():
    reach = rollback.Reach(latency_s=0.0)
    for step in range(20):
        reach.step_started(step)
    reach.started[12] -= 3.0  # step 12 started 3 s ago (as if the machine had paused)
    reach.rolled_back(12 - rollback.MARGIN)
    assert 3.0 <= reach.latency_s < 10.0
    step_s = min(reach.durations)
    assert reach.ring(every=10) == rollback.ring_size(step_s, reach.latency_s, 10) > rollback.ring_size(step_s, 0, 10)


def test_a_ddp_job_writes_its_replicated_state_once(collector, tmp_path, capfd):
    """A 2-rank DDP job's checkpoints take under 1.3x the bytes of a 1-rank job's (each rank writes half
    the tensors), and a start under the same run id resumes on every rank from the shares of both."""

    def run(nproc: int, name: str, steps: int) -> int:
        return train(
            nproc=nproc,
            steps=steps,
            run_id=name,
            collector=collector.url,
            token=collector.token,
            trainer_args=["--ckpt-every", "10", "--ckpt-dir", str(tmp_path / name)],
        )

    def size(directory: Path) -> int:
        return sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())

    for nproc in (1, 2):
        assert run(nproc, f"run-replicas-{nproc}", 20) == 0
    one, two = size(tmp_path / "run-replicas-1"), size(tmp_path / "run-replicas-2")
    assert one < two < 1.3 * one, (one, two)

    capfd.readouterr()
    assert run(2, "run-replicas-2", 30) == 0  # started again: both ranks load step 20 from the two shares
    assert "resumed at step 20" in capfd.readouterr().out
    collector.stop()
    restored = query(
        collector.db,
        "SELECT rank, step, attrs FROM events WHERE run_id = 'run-replicas-2' "
        "AND event = 'checkpoint_restored' ORDER BY rank",
        [],
    )
    assert [(rank, step, json.loads(attrs)["rankwatch.checkpoint.tier"]) for rank, step, attrs in restored] == [
        (0, 20, "disk"),
        (1, 20, "disk"),
    ]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the GPU bench would run")
def test_the_gpu_bench_without_a_gpu_says_so_in_one_line():
    bench = Path(__file__).parents[1] / "bench" / "checkpoint.py"
    out = subprocess.run([sys.executable, str(bench), "--device", "cuda"], capture_output=True, text=True, timeout=120)
    assert (out.returncode, out.stdout, len(out.stderr.splitlines())) == (2, "", 1), out.stderr
    assert "needs a CUDA GPU" in out.stderr


if __name__ == "__main__":
    write_forever(Path(sys.argv[1]))
