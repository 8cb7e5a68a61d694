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
import random
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import pytest
import torch
from conftest import rankwatch_cli
from otlp_payloads import query

from trainer import rollback
from trainer.checkpoint import MANIFEST, META, TENSORS, Checkpointer, NoCheckpoint
from trainer.data import TokenStream
from trainer.model import GPT, GPTConfig

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
        """One training step, snapshot after it; the loss (which draws on both RNGs, so a resume must restore them)."""
        inputs, targets = self.data.next()
        loss = self.model(inputs, targets) * (1 + 0.01 * torch.rand(()) * random.random())
        loss.backward()
        self.ckpt.wait_until_safe()
        self.optimizer.step()
        self.schedule.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.ckpt.snapshot(step + 1)
        return loss.item()


def job(directory: Path, seed: int = 0, **ckpt) -> Job:
    torch.manual_seed(seed)
    random.seed(seed)
    model = GPT(CONFIG)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 5))
    data = TokenStream(CONFIG.vocab, CONFIG.seq_len, 4, rank=0, seed=seed)
    state = {"model": model, "optimizer": optimizer, "schedule": schedule, "data": data}
    return Job(model, optimizer, schedule, data, Checkpointer(directory, state, **ckpt))


def parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    assert all(torch.equal(a[name], b[name]) for name in a), [name for name in a if not torch.equal(a[name], b[name])]


@pytest.fixture
def deterministic():
    torch.use_deterministic_algorithms(True)
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


def test_resume_from_disk_matches_the_uninterrupted_run(tmp_path, deterministic):
    steps = 12
    whole = job(tmp_path / "whole", disk_every=4)
    expected = [whole.step(s) for s in range(steps)]
    whole.ckpt.close()

    first = job(tmp_path / "crashed", disk_every=4)
    assert [first.step(s) for s in range(10)] == expected[:10]
    first.ckpt.close()  # on disk: steps 4 and 8; snapshots 9 and 10 were only in memory, lost with the process

    resumed = job(tmp_path / "crashed", seed=99, disk_every=4)  # another initialisation, RNG and data seed
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
    j.ckpt.wait_until_safe()
    with caplog.at_level(logging.WARNING, logger="trainer.checkpoint"):
        assert j.ckpt.restore(5) == 5  # in memory (steps 5 and 6): no word
        assert not caplog.records
        for step in range(5, 7):
            j.step(step)
        j.ckpt.wait_until_safe()
        assert j.ckpt.restore(5) == 4  # memory holds steps 6 and 7: from disk
    [warning] = [r.getMessage() for r in caplog.records]
    assert warning == ("checkpoint: all 2 snapshots in memory are newer than step 5: keep more (--ckpt-memory) "
                       "for an instant rollback")
    j.ckpt.close()


def test_a_rollback_that_finds_no_checkpoint_spends_none_of_the_budget(tmp_path):
    """Only a rollback done counts against the budget; past it the job stops, its good state durable."""
    j = job(tmp_path, memory=2, disk_every=1000)
    for step in range(4):
        j.step(step)  # the ring holds steps 3 and 4, the disk nothing
    budget = rollback.Budget(rollbacks=1, window=1000)

    def rollback_to(before_step: int) -> int:
        command = {"args": {"before_step": before_step}, "created_at": datetime.now(timezone.utc).isoformat()}
        return rollback.apply(command, 4, j.ckpt, j.data, j.schedule, budget, time.time_ns)

    assert rollback_to(1) == 4 and budget.applied_at == []  # nothing that far back: the job trains on
    assert rollback_to(3) == 3 and budget.applied_at == [4]  # the budget's one rollback
    with pytest.raises(rollback.Stop, match="1 rollbacks within 1000 steps"):
        rollback_to(3)
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
        "the manifest is of step 3"),
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


@pytest.mark.parametrize("argv, words", [
    (["--snapshot-every", "3", "--ckpt-every", "10"], "--ckpt-every 10 is not a multiple of --snapshot-every 3"),
    (["--ckpt-memory", "0"], "must be at least 1"),
])
def test_trainer_refuses_checkpoint_settings_it_cannot_keep(argv, words, capsys):
    from trainer.train import arguments

    with pytest.raises(SystemExit) as e:
        arguments(argv)
    assert e.value.code == 2 and words in capsys.readouterr().err


RUN = "run-checkpoint-restart"


def test_torchrun_restart_resumes_from_the_last_durable_step(collector, tmp_path):
    result = rankwatch_cli("train", "--nproc", "2", "--steps", "120", "--max-restarts", "1", "--run", RUN,
                           "--inject", "crash:rank=1,at=115", "--collector", collector.url,
                           env={"RANKWATCH_TOKEN": collector.token}, cwd=tmp_path)
    collector.stop()
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed at step 100" in result.stdout

    def events(name: str) -> list[tuple]:
        return query(collector.db, "SELECT rank, step, attrs FROM events WHERE run_id = ? AND event = ? "
                                   "ORDER BY rank, step", [RUN, name])

    # The first attempt's only durable checkpoint. Rank 0's event may not have left before torchrun
    # stopped it; rank 1, the one that crashed, sent everything first.
    disk = [(rank, step) for rank, step, attrs in events("checkpoint_saved")
            if json.loads(attrs)["rankwatch.checkpoint.tier"] == "disk"]
    assert (1, 100) in disk and {step for _, step in disk} == {100}, disk
    restored = [(rank, step, json.loads(attrs)["rankwatch.checkpoint.tier"]) for rank, step, attrs in events(
        "checkpoint_restored")]
    assert restored == [(0, 100, "disk"), (1, 100, "disk")]
    assert [(rank, step) for rank, step, _ in events("fault_injected")] == [(1, 115)]  # the restart does not crash
    for rank in (0, 1):
        assert (tmp_path / "rankwatch-data" / "runs" / RUN / "checkpoints" / f"rank-{rank}" / "step-00000100" /
                MANIFEST).exists()

    losses = query(collector.db, "SELECT step, list(loss ORDER BY start_ts) FROM steps WHERE run_id = ? AND rank = 1 "
                                 "GROUP BY step ORDER BY step", [RUN])
    assert [step for step, _ in losses] == list(range(120))
    for step, attempts in losses:  # steps 100..114 ran twice, and the resumed attempt repeated them exactly
        assert len(attempts) == (2 if 100 <= step < 115 else 1), (step, attempts)
        assert len(set(attempts)) == 1, (step, attempts)


if __name__ == "__main__":
    write_forever(Path(sys.argv[1]))
