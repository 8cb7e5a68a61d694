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
steps of a real collector. The training loop never waits for the ring's
buffers to be made (a slow allocator) nor for a slow disk (a newer write
replaces a waiting one, counted); the ring is sized from the bytes its buffers
take and stays within its host limit; a tied weight is copied once and loaded
back tied; and replicas holding other tensors, or a checkpoint of another
model, are refused rather than spliced in.
"""

import hashlib
import json
import logging
import os
import pickle
import random
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import pytest
import torch

from rankwatch import agent
from rankwatch.agent import semconv as sc
from rankwatch.launch import train
from tests.support.checkpoint_writer import big_state
from tests.support.collectors import Collector, job_collector
from tests.support.commands import rankwatch_cli
from tests.support.otlp_payloads import query
from tests.support.paths import ROOT
from trainer import checkpointfiles, hostring, rollback
from trainer.checkpoint import MANIFEST, META, TENSORS, Checkpointer, NoCheckpoint
from trainer.data import TokenStream
from trainer.job import GPTConfig
from trainer.model import GPT
from trainer.train import grow_ring

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
        """One training step, snapshot after it; the loss (which draws on the RNGs, so a resume must restore them).
        The ring is allocated before the snapshot (else skipped while it is): these tests are of what is kept."""
        device = next(self.model.parameters()).device
        inputs, targets = (t.to(device) for t in self.data.next())
        rand = torch.rand(()) * torch.rand((), device=device).cpu()  # the CPU generator and the device's
        loss = self.model(inputs, targets) * (1 + 0.01 * rand.item() * random.random())
        loss.backward()
        self.ckpt.wait_until_safe()
        self.optimizer.step()
        self.schedule.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.ckpt.reserve(wait=True)
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
            buffers.append([(s.buffer.data_ptr(), s.buffer.numel()) for s in j.ckpt._ring.slots])
    assert len(buffers[0]) == 3 and all(b == buffers[0] for b in buffers)
    assert sorted(s.step for s in j.ckpt._ring.slots) == [4, 5, 6]

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


class Exploit:
    """Pickled, it runs a shell command when plain pickle.load reads it: one that leaves a file beside
    the checkpoints, which the test would find."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _forged(path: Path, state: object) -> None:
    """Replace a checkpoint's state file with `state` pickled, its manifest rewritten to vouch for it, as
    whoever can write the checkpoint directory can."""
    data = pickle.dumps(state)
    (path / META).write_bytes(data)
    manifest = json.loads((path / MANIFEST).read_text())
    manifest["files"][META] = {"bytes": len(data), "blake2b": hashlib.blake2b(data).hexdigest()}
    (path / MANIFEST).write_text(json.dumps(manifest))


def _code_in_the_pickled_state(path: Path) -> None:
    """The state file's outer pickle as written, the training state inside it code."""
    _, refs = pickle.loads((path / META).read_bytes())  # this test's own file: plain pickle is safe here
    _forged(path, (pickle.dumps({"state": Exploit(path.parent / "pwned"), "rng": {}}), refs))


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
    "code in the state file": (
        lambda p: _forged(p, Exploit(p.parent / "pwned")),
        "state.pkl is not a checkpoint's state (it names posix.system, which no checkpoint holds)",
    ),
    "code in the pickled state": (
        _code_in_the_pickled_state,
        "state.pkl is not a checkpoint's state (it names posix.system, which no checkpoint holds)",
    ),
}


@pytest.mark.parametrize("how", sorted(DAMAGE))
def test_damaged_checkpoint_is_reported_and_skipped(tmp_path, how, caplog):
    j = job(tmp_path, disk_every=2)
    for step in range(4):
        j.step(step)
        if step == 1:  # step 2's written before step 4's comes (a busy writer would take the newer one instead)
            j.ckpt.make_durable(2)
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


def test_sigkill_leaves_only_loadable_checkpoints(tmp_path):
    chance, restored, partial_seen = random.Random(11), 0, 0
    for _ in range(4):
        writer = subprocess.Popen(
            [sys.executable, "-m", "tests.support.checkpoint_writer", str(tmp_path)],
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
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


@dataclass
class Restarted:
    """The module's real jobs and the collector they sent to, stopped after them."""

    collector: Collector
    result: subprocess.CompletedProcess  # the 2-rank job's `rankwatch train`
    directory: Path  # where it ran: its checkpoints beside the store it made there
    alone_status: int  # the 1-rank job's exit status
    alone: Path  # its checkpoints


@pytest.fixture(scope="module")
def restarted(tmp_path_factory) -> Restarted:
    """`rankwatch train --max-restarts 1` of a 2-rank job of 40 steps, a checkpoint on disk every 20, whose
    rank 1 crashes at step 35, then a 1-rank job as long (the replicas test's measure), both sending to one
    real collector, stopped after them."""
    tmp_path = tmp_path_factory.mktemp("restart")
    with job_collector(tmp_path) as collector:
        result = rankwatch_cli(
            "train",
            *("--nproc", "2", "--steps", "40", "--ckpt-every", "20", "--max-restarts", "1", "--run", RUN),
            *("--inject", "crash:rank=1,at=35", "--collector", collector.url),
            env={"RANKWATCH_TOKEN": collector.token},
            cwd=tmp_path,
        )
        alone_status = train(
            nproc=1,
            steps=40,
            run_id="run-replicas-1",
            collector=collector.url,
            token=collector.token,
            trainer_args=["--ckpt-every", "20", "--ckpt-dir", str(tmp_path / "run-replicas-1")],
        )
    return Restarted(collector, result, tmp_path, alone_status, tmp_path / "run-replicas-1")


def test_torchrun_restart_resumes_from_the_last_durable_step(restarted):
    collector, result, tmp_path = restarted.collector, restarted.result, restarted.directory
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed at step 20" in result.stdout

    def events(name: str) -> list[tuple]:
        return query(
            collector.db,
            "SELECT rank, step, attrs FROM events WHERE run_id = ? AND event = ? ORDER BY rank, step",
            [RUN, name],
        )

    # The first attempt's only durable checkpoint, step 20 (rank 0's event may not have left before torchrun
    # stopped it; rank 1, the one that crashed, sent everything first), then the resumed attempt's at its end.
    disk = [
        (rank, step)
        for rank, step, attrs in events("checkpoint_saved")
        if json.loads(attrs)["rankwatch.checkpoint.tier"] == "disk"
    ]
    assert {(1, 20), (0, 40), (1, 40)} <= set(disk) and {step for _, step in disk} == {20, 40}, disk
    restored = [
        (rank, step, json.loads(attrs)["rankwatch.checkpoint.tier"])
        for rank, step, attrs in events("checkpoint_restored")
    ]
    assert restored == [(0, 20, "disk"), (1, 20, "disk")]
    assert [(rank, step) for rank, step, _ in events("fault_injected")] == [(1, 35)]  # the restart does not crash
    for rank in (0, 1):
        assert (
            tmp_path / "rankwatch-data" / "runs" / RUN / "checkpoints" / f"rank-{rank}" / "step-00000020" / MANIFEST
        ).exists()

    losses = query(
        collector.db,
        "SELECT step, list(loss ORDER BY start_ts) FROM steps WHERE run_id = ? AND rank = 1 "
        "GROUP BY step ORDER BY step",
        [RUN],
    )
    assert [step for step, _ in losses] == list(range(40))
    for step, attempts in losses:  # steps 20..34 ran twice, and the resumed attempt repeated them exactly
        assert len(attempts) == (2 if 20 <= step < 35 else 1), (step, attempts)
        assert len(set(attempts)) == 1, (step, attempts)


def test_listing_reads_manifests_only_and_loading_verifies(tmp_path, caplog):
    """What is durable is told by the manifests and file sizes alone: a damaged older checkpoint is
    listed (its data was not read), and only loading it finds the damage and falls back as before."""
    j = job(tmp_path, disk_every=2)
    for step in range(6):
        j.step(step)
        j.ckpt.durable_steps()  # each write done before the next is asked (a waiting one gives way to a newer)
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
        j.ckpt.reserve(wait=True)
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


def test_a_ddp_job_writes_its_replicated_state_once(restarted):
    """A 2-rank DDP job's checkpoints take under 1.3x the bytes of a 1-rank job's (each rank writes half
    the tensors), and a start under the same run id resumes on every rank from the shares of both: the
    2-rank job is the restart test's (its checkpoints of steps 20 and 40, the second attempt started
    under the same run id and loading step 20 on both ranks), the 1-rank one trains as long."""
    assert restarted.alone_status == 0

    def size(directory: Path) -> int:
        return sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())

    store, result, directory = restarted.collector, restarted.result, restarted.directory
    assert result.returncode == 0, result.stderr[-3000:]
    shares = directory / "rankwatch-data" / "runs" / RUN / "checkpoints"
    for rank_dir in (shares / "rank-0", shares / "rank-1", restarted.alone / "rank-0"):  # the same steps
        assert sorted(p.name for p in rank_dir.iterdir()) == ["step-00000020", "step-00000040"], rank_dir
    one, two = size(restarted.alone), size(shares)
    assert one < two < 1.3 * one, (one, two)

    assert "resumed at step 20" in result.stdout  # the second attempt: both ranks load step 20 from the two shares
    restored = query(
        store.db,
        "SELECT rank, step, attrs FROM events WHERE run_id = ? AND event = 'checkpoint_restored' ORDER BY rank",
        [RUN],
    )
    assert [(rank, step, json.loads(attrs)["rankwatch.checkpoint.tier"]) for rank, step, attrs in restored] == [
        (0, 20, "disk"),
        (1, 20, "disk"),
    ]


@pytest.fixture
def events(monkeypatch) -> list[tuple]:
    """The checkpointer's events, as (name, step, attributes)."""
    seen: list[tuple] = []
    monkeypatch.setattr(agent, "event", lambda name, step=None, **attrs: seen.append((name, step, attrs)))
    return seen


def timed_steps(j: Job, steps: range, pause_s: float = 0.0) -> list[float]:
    """Training steps with a snapshot after each and no reserve(): the seconds each snapshot cost the loop
    (the call and the wait before the next optimizer step)."""
    blocked = []
    for step in steps:
        inputs, targets = j.data.next()
        j.model(inputs, targets).backward()
        started = time.perf_counter()
        j.ckpt.wait_until_safe()
        waited = time.perf_counter() - started
        if blocked:
            blocked[-1] += waited
        j.optimizer.step()
        j.optimizer.zero_grad(set_to_none=True)
        started = time.perf_counter()
        j.ckpt.snapshot(step + 1)
        blocked.append(time.perf_counter() - started)
        time.sleep(pause_s)  # the forward and backward of a bigger model
    j.ckpt.wait_until_safe()
    return blocked


def test_a_snapshot_never_waits_for_its_ring_to_be_allocated(tmp_path, monkeypatch, events):
    """Pinning a GPU's ring takes seconds (GPT-2's 1.5 GB slot: about one), and the training loop once
    waited for all of it at the first snapshot. The buffers are made in the background, one at a time:
    a snapshot that finds none ready is skipped and counted, and the ring fills while training goes on."""
    make = hostring._host_buffer

    def slow(nbytes: int, pinned: bool) -> torch.Tensor:
        time.sleep(0.4)
        return make(nbytes, pinned)

    monkeypatch.setattr(hostring, "_host_buffer", slow)
    j = job(tmp_path, memory=3, disk_every=1000)
    blocked = timed_steps(j, range(24), pause_s=0.1)
    assert max(blocked) < 0.3, blocked  # 0.4 s a buffer, 1.2 s for the ring: never waited for
    skipped = [step for name, step, _ in events if name == sc.EVENT_CHECKPOINT_SKIPPED]
    assert skipped[0] == 1 and 1 <= len(skipped) < 10, skipped
    assert [attrs[sc.CKPT_SKIPPED] for name, _, attrs in events if name == sc.EVENT_CHECKPOINT_SKIPPED] == list(
        range(1, len(skipped) + 1)
    )
    assert len(j.ckpt._ring.slots) == 3 and sorted(s.step for s in j.ckpt._ring.slots) == [22, 23, 24]
    assert j.ckpt.restore(23) == 23
    j.ckpt.close()


def test_a_disk_backlog_never_blocks_a_snapshot(tmp_path, monkeypatch, events):
    """A disk slower than the snapshots: each write asked for while the writer is busy replaces the one
    waiting for it (skipped, counted) instead of the training loop waiting for the writer."""
    write = checkpointfiles._write_durably

    def slow(path: Path, data: memoryview) -> dict:
        time.sleep(0.15)
        return write(path, data)

    j = job(tmp_path, memory=3, disk_every=1)
    j.step(0)  # the ring allocated
    monkeypatch.setattr(checkpointfiles, "_write_durably", slow)
    blocked = timed_steps(j, range(1, 13))
    assert max(blocked) < 0.3, blocked  # a write takes 0.45 s, and came to be waited for every third step
    skipped = [(step, attrs[sc.CKPT_TIER]) for name, step, attrs in events if name == sc.EVENT_CHECKPOINT_SKIPPED]
    assert skipped and {tier for _, tier in skipped} == {sc.TIER_DISK}
    j.ckpt.close()
    saved = [(step, attrs[sc.CKPT_TIER]) for name, step, attrs in events if name == sc.EVENT_CHECKPOINT_SAVED]
    written = [step for step, tier in saved if tier == sc.TIER_DISK]
    assert sorted(written + [step for step, _ in skipped]) == list(range(1, 14))  # each step written or skipped
    assert written[-1] == 13  # the last one, at close


def test_the_ring_is_sized_from_the_bytes_its_buffers_take(tmp_path, monkeypatch):
    """A buffer may take more than the state's bytes (pin_memory=True rounds to a power of two: 1.5 GB
    took 2 GB, and a ring sized for 55 GB pinned 74). The ring grows by the bytes its slots take."""
    make = hostring._host_buffer

    def rounded(nbytes: int, pinned: bool) -> torch.Tensor:
        return make(1 << (nbytes - 1).bit_length(), pinned)

    monkeypatch.setattr(hostring, "_host_buffer", rounded)
    j = job(tmp_path, memory=1, disk_every=1000)
    j.step(0)
    [slot] = j.ckpt._ring.slots
    assert j.ckpt.snapshot_bytes == slot.buffer.numel() > 1.2 * slot.nbytes
    free = 2 * 3 * slot.buffer.numel() + slot.buffer.numel() // 2  # half of it: 3.5 slots
    page = os.sysconf("SC_PAGE_SIZE")
    real = os.sysconf
    monkeypatch.setattr(os, "sysconf", lambda name: free // page if name == "SC_AVPHYS_PAGES" else real(name))
    reach = rollback.Reach(latency_s=100.0)
    reach.step_started(0)
    reach.step_started(1)
    grow_ring(j.ckpt, reach, every=1)
    assert j.ckpt.memory == 4  # the slot it has, and 3 more
    j.step(1)
    assert sum(s.buffer.numel() for s in j.ckpt._ring.slots) <= slot.buffer.numel() + free // 2
    j.ckpt.close()


def test_the_ring_takes_its_exact_bytes_within_its_host_limit(tmp_path, caplog):
    """A slot takes the state's bytes in whole pages, no more; the ring stops short of its host limit
    (pinned memory cannot be swapped out), says so, and grows no further."""
    probe = job(tmp_path / "probe", memory=1)
    probe.step(0)
    slot = probe.ckpt.snapshot_bytes
    assert 0 <= slot - probe.ckpt._ring.slots[0].nbytes < os.sysconf("SC_PAGE_SIZE")
    probe.ckpt.close()
    with caplog.at_level(logging.WARNING, logger="trainer.checkpoint"):
        j = job(tmp_path, memory=4, host_limit=2 * slot + slot // 2)
        j.step(0)  # reserve() returns with the ring as big as it can be
    assert j.ckpt.memory == 2 and len(j.ckpt._ring.slots) == 2
    assert "the ring holds 2 snapshots, not 4: it would take the ring past its host limit" in caplog.text
    j.ckpt.grow(10)
    assert j.ckpt.memory == 2
    j.ckpt.close()


class Loaded:
    """A Stateful wrapper that keeps the state dict it was last loaded with."""

    def __init__(self, inner: torch.nn.Module):
        self.inner = inner
        self.loaded: dict = {}

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.loaded = state
        self.inner.load_state_dict(state)


def test_tied_weights_are_copied_once_and_restored_tied(tmp_path):
    """GPT's embedding and output head are one tensor under two names: one copy in a snapshot, on disk,
    and one tensor again when loaded, from memory and from disk."""
    j = job(tmp_path, memory=2, disk_every=1)
    model = j.model
    assert model.head.weight is model.embed.weight
    j.step(0)
    j.ckpt.wait_until_safe()
    [slot] = [s for s in j.ckpt._ring.slots if s.step == 1]
    state = [*model.state_dict().values(), *(t for s in j.optimizer.state.values() for t in s.values())]
    aligned = [-(-t.nbytes // 64) * 64 for t in state]
    tied = -(-model.embed.weight.nbytes // 64) * 64
    assert slot.nbytes == sum(aligned) - tied
    expected = parameters(model)
    for loaded in (j, job(tmp_path, seed=3, disk_every=1)):  # from memory, then in a new process from disk
        spy = Loaded(loaded.model)
        loaded.ckpt.state["model"] = spy
        with torch.no_grad():
            loaded.model.embed.weight.add_(1.0)
        assert loaded.ckpt.restore(1) == 1
        assert spy.loaded["embed.weight"] is spy.loaded["head.weight"]
        assert loaded.model.head.weight is loaded.model.embed.weight
        assert_same(parameters(loaded.model), expected)
        loaded.ckpt.close()


def test_replicas_of_other_layouts_are_refused_not_spliced(tmp_path, caplog):
    """Ranks passed as replicas that hold other tensors (another rank's shard under FSDP or TP, here
    of the same bytes): a load refuses their shares rather than splice them in, each of which passes
    its checksum; and a checkpoint of another model than the live one is refused before it is read."""
    replicas = [tmp_path / "rank-0", tmp_path / "rank-1"]

    def shard(rank: int, value: float) -> dict:
        return {"model": torch.nn.ParameterList([torch.full((4, 8) if rank == 0 else (8, 4), value)])}

    for rank in (0, 1):
        ckpt = Checkpointer(replicas[rank], shard(rank, rank + 1.0), memory=1, disk_every=1, replicas=replicas)
        ckpt.reserve(wait=True)
        ckpt.snapshot(1)
        ckpt.close()
    with caplog.at_level(logging.WARNING, logger="trainer.checkpoint"):
        for rank in (0, 1):
            state = shard(rank, 0.0)
            ckpt = Checkpointer(replicas[rank], state, replicas=replicas)
            with pytest.raises(NoCheckpoint):
                ckpt.restore(100)
            assert torch.all(state["model"][0] == 0.0)
            ckpt.close()
        other = {"model": torch.nn.ParameterList([torch.zeros(2, 16)])}
        ckpt = Checkpointer(replicas[0], other, replicas=replicas)
        with pytest.raises(NoCheckpoint):
            ckpt.restore(100)
        ckpt.close()
    reports = [r.getMessage() for r in caplog.records]
    assert [why.split(" skipped: ")[1] for why in reports] == [
        "replica rank-1: its layout is not this replica's (a shard of other tensors?)",
        "replica rank-0: its layout is not this replica's (a shard of other tensors?)",
        "its model is not the live one's layout (other tensor names, dtypes or shapes)",
    ]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the GPU bench would run")
def test_the_gpu_bench_without_a_gpu_says_so_in_one_line():
    bench = ROOT / "bench" / "checkpoint.py"
    out = subprocess.run([sys.executable, str(bench), "--device", "cuda"], capture_output=True, text=True, timeout=120)
    assert (out.returncode, out.stdout, len(out.stderr.splitlines())) == (2, "", 1), out.stderr
    assert "needs a CUDA GPU" in out.stderr


def test_a_rollback_does_not_wait_for_the_disk_to_take_a_step_it_drops(tmp_path, monkeypatch, events):
    """The writer is putting a step after the rollback's target on disk (slowly: 1.5 GB took an H200's job 4 s,
    and its rollback waited for it): the restore from memory does not wait for that write, and the step
    written, a future that will not happen, is removed once done and never listed."""
    write = checkpointfiles._write_durably
    writing = threading.Event()

    def slow(path: Path, data: memoryview) -> dict:
        if path.parent.name == "step-00000006":
            writing.set()
            time.sleep(0.5)
        return write(path, data)

    j = job(tmp_path, memory=4, disk_every=3)
    monkeypatch.setattr(checkpointfiles, "_write_durably", slow)
    for step in range(6):
        j.step(step)  # snapshots of steps 1-6; steps 3 and 6 to disk
    j.ckpt.wait_until_safe()  # the loop acts on the copy of step 6: its write
    assert writing.wait(10)
    started = time.perf_counter()
    assert j.ckpt.restore(4) == 4
    assert time.perf_counter() - started < 0.4  # not the 1.5 s of the write of step 6
    assert j.ckpt._disk._writing_step == 6  # still being written
    assert j.ckpt.durable_steps() == [3]  # never step 6, though still being written
    j.ckpt.close()  # the writer done
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000003"]
    assert [s for name, s, a in events if name == sc.EVENT_CHECKPOINT_RESTORED] == [4]
