"""Carrying out a rollback command: back to a good checkpoint, past the data that led astray.

Every rank calls `apply` at the same step boundary with the same command
(agent.command() shares it). The state goes back to the newest snapshot at or
before the command's `before_step` (memory first, then disk), the data stream
skips the batches that followed (as PaLM skipped 200-500 batches around its
spikes), and the learning rate can be scaled. A budget caps how often this
may happen; past it the job goes back to the good snapshot once more, makes it durable, and
stops cleanly instead of looping: a person resumes from there.
"""

import time
from dataclasses import dataclass, field
from datetime import datetime

import torch

import agent
from agent import semconv as sc
from trainer.checkpoint import Checkpointer, NoCheckpoint
from trainer.data import TokenStream


@dataclass
class Budget:
    """At most `rollbacks` within any `window` steps."""

    rollbacks: int = 3
    window: int = 1000
    applied_at: list[int] = field(default_factory=list)

    def spend(self, step: int) -> bool:
        """Count a rollback at `step`; False (and nothing counted) when the budget is spent."""
        recent = [s for s in self.applied_at if s > step - self.window]
        if len(recent) >= self.rollbacks:
            return False
        self.applied_at = recent + [step]
        return True


class Stop(Exception):
    """The job must stop: the rollback budget is spent."""


def apply(command: dict, step: int, ckpt: Checkpointer, data: TokenStream,
          schedule: torch.optim.lr_scheduler.LRScheduler, budget: Budget, now_ns) -> int:
    """The step training goes on at after the rollback (`step` itself when no checkpoint is far
    enough back); raises Stop when the budget is spent, once the good state is durable. `now_ns`: the job's
    clock, the one its spans use."""
    args = command["args"] or {}
    try:
        restored = ckpt.restore(int(args["before_step"]))
    except NoCheckpoint as e:  # nothing was rolled back, so nothing is spent: the job trains on
        agent.report(command, "failed", why=str(e))
        return step
    if not budget.spend(step):
        ckpt.make_durable(restored)
        why = (f"{budget.rollbacks} rollbacks within {budget.window} steps: stopping instead of another, "
               f"with step {restored} durable in {ckpt.directory}")
        agent.report(command, "failed", why=why, restored_step=restored, from_step=step)
        agent.event(sc.EVENT_STOPPED, restored, **{sc.STOP_WHY: why})
        raise Stop(why)
    skipped, scale = int(args.get("skip_batches", 0)), float(args.get("lr_scale", 1.0))
    data.skip(skipped)
    if scale != 1.0:
        schedule.base_lrs = [lr * scale for lr in schedule.base_lrs]
    latency = time.time() - datetime.fromisoformat(command["created_at"]).timestamp()
    agent.event(sc.EVENT_ROLLBACK, restored, **{
        sc.ROLLBACK_RESTORED_STEP: restored, sc.ROLLBACK_SKIPPED_BATCHES: skipped, sc.ROLLBACK_LR_SCALE: scale,
        sc.ROLLBACK_ANOMALY: str(args.get("anomaly", "")), sc.ROLLBACK_LATENCY_S: latency})
    agent.report(command, "applied", restored_step=restored, resumed_ns=now_ns(), skipped_batches=skipped,
                 lr_scale=scale, from_step=step, latency_s=latency)
    return restored
