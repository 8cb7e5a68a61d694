"""Carrying out a rollback command: back to a good checkpoint, past the data that led astray.

Every rank calls `apply` at the same step boundary with the same command
(agent.command() shares it). The state goes back to the newest snapshot at or
before the command's `before_step` (memory first, then disk), the data stream
skips the batches that followed (as PaLM skipped 200-500 batches around its
spikes), and the learning rate can be scaled. A budget caps how often this
may happen; past it the job goes back to the good snapshot once more, makes it durable, and
stops cleanly instead of looping: a person resumes from there. Only rollbacks spend the budget
(the collector sends them for real anomalies, never for warnings), and the stop names each one.

The ring of memory snapshots must reach back to where a rollback lands: `ring_size` sizes it
from the measured step time and the detection latency (docs/benchmarks.md, Checkpoints).
"""

import math
import time
from collections import deque
from dataclasses import dataclass, field
from datetime import datetime

import torch

from rankwatch import agent
from rankwatch.agent import semconv as sc
from rankwatch.agent.commands import steps_apart
from trainer.checkpoint import Checkpointer, NoCheckpoint
from trainer.data import TokenStream

MARGIN = 5  # steps a rollback lands before its anomaly (the collector's RollbackPolicy.margin)
# Before a rollback has measured it: the export's batching (0.25 s), the collector's analysis period
# (--analyze-every, 5 s; commits wake a pass at once, a timer pass is the worst case) and a command
# poll that finds the collector away (2 s), rounded up.
DETECTION_LATENCY_S = 10.0


def ring_size(step_s: float, latency_s: float, every: int) -> int:
    """Snapshots (one every `every` steps) to keep in memory so that a rollback `latency_s` after its
    anomaly still finds one MARGIN steps before it: the steps run in that time and until the agent
    next looks (one step or LOOK_S), and the margin, in snapshots, plus the newest, which is past
    the anomaly."""
    step_s = max(step_s, 1e-6)
    return math.ceil((latency_s / step_s + steps_apart(step_s) + MARGIN) / every) + 1


@dataclass
class Reach:
    """How far back rollbacks reach, measured: the recent steps' time, and the longest detection
    latency seen (from the anomaly step's start to the rollback), DETECTION_LATENCY_S until one is."""

    latency_s: float = DETECTION_LATENCY_S
    started: dict[int, float] = field(default_factory=dict)  # step -> time.monotonic() at its start
    durations: deque = field(default_factory=lambda: deque(maxlen=20))

    def step_started(self, step: int) -> None:
        now = time.monotonic()
        if step - 1 in self.started:
            self.durations.append(now - self.started[step - 1])
        self.started[step] = now
        self.started.pop(step - 10_000, None)

    def rolled_back(self, before_step: int) -> None:
        """A rollback to `before_step` is being applied: its anomaly was MARGIN steps after it."""
        if (anomaly := self.started.get(before_step + MARGIN)) is not None:
            self.latency_s = max(self.latency_s, time.monotonic() - anomaly)

    def ring(self, every: int) -> int:
        """ring_size at the fastest of the recent steps (0 before any step was timed): steps that speed up
        after a slow stretch must not outrun the ring."""
        return ring_size(min(self.durations), self.latency_s, every) if self.durations else 0


@dataclass
class Budget:
    """At most `rollbacks` within any `window` steps."""

    rollbacks: int = 3
    window: int = 1000
    applied: list[tuple[int, str]] = field(default_factory=list)  # (step applied at, what it answered)

    def spend(self, step: int, what: str) -> bool:
        """Count a rollback at `step`; False (and nothing counted) when the budget is spent."""
        recent = [(s, w) for s, w in self.applied if s > step - self.window]
        if len(recent) >= self.rollbacks:
            return False
        self.applied = [*recent, (step, what)]
        return True

    def spent_on(self) -> str:
        """The rollbacks in the window, for the stop's message."""
        return "; ".join(f"at step {s}: {w}" for s, w in self.applied)


class Stop(Exception):
    """The job must stop: the rollback budget is spent."""


def apply(
    command: dict,
    step: int,
    ckpt: Checkpointer,
    data: TokenStream,
    schedule: torch.optim.lr_scheduler.LRScheduler,
    budget: Budget,
    now_ns,
) -> int:
    """The step training goes on at after the rollback (`step` itself when no checkpoint is far
    enough back); raises Stop when the budget is spent, once the good state is durable. `now_ns`: the job's
    clock, the one its spans use."""
    args = command["args"] or {}
    try:
        restored = ckpt.restore(int(args["before_step"]))
    except NoCheckpoint as e:  # nothing was rolled back, so nothing is spent: the job trains on
        agent.report(command, "failed", why=str(e))
        return step
    what = f"command {command.get('id', '?')}, for {args.get('anomaly') or 'a request'}, back to step {restored}"
    if not budget.spend(step, what):
        ckpt.make_durable(restored)
        why = (
            f"{budget.rollbacks} rollbacks within {budget.window} steps: stopping instead of another, "
            f"with step {restored} durable in {ckpt.directory} (the rollbacks: {budget.spent_on()}; this one "
            f"{what})"
        )
        agent.report(command, "failed", why=why, restored_step=restored, from_step=step)
        agent.event(sc.EVENT_STOPPED, restored, **{sc.STOP_WHY: why})
        raise Stop(why)
    skipped, scale = int(args.get("skip_batches", 0)), float(args.get("lr_scale", 1.0))
    data.skip(skipped)
    if scale != 1.0:
        schedule.base_lrs = [lr * scale for lr in schedule.base_lrs]
    latency = time.time() - datetime.fromisoformat(command["created_at"]).timestamp()
    agent.event(
        sc.EVENT_ROLLBACK,
        restored,
        **{
            sc.ROLLBACK_RESTORED_STEP: restored,
            sc.ROLLBACK_SKIPPED_BATCHES: skipped,
            sc.ROLLBACK_LR_SCALE: scale,
            sc.ROLLBACK_ANOMALY: str(args.get("anomaly", "")),
            sc.ROLLBACK_LATENCY_S: latency,
        },
    )
    agent.report(
        command,
        "applied",
        restored_step=restored,
        resumed_ns=now_ns(),
        skipped_batches=skipped,
        lr_scale=scale,
        from_step=step,
        latency_s=latency,
    )
    return restored
