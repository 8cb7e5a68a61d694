"""Pipeline parallelism (torch.distributed.pipelining): a schedule's step as the step's `pipeline`
phase, and inside it each forward and backward chunk of the rank's stages as `forward` and
`backward` phases. The time in the schedule that no chunk covers is the stage's bubble (waiting for
the stages before and after it; rankwatch/agent/session.py). The sends and receives between stages are traced
with the other collectives (rankwatch/agent/collectives.py).
"""

import functools

from rankwatch.agent.session import Session
from rankwatch.agent.stepspans import PIPELINE

_CHUNKS = {"forward_one_chunk": "forward", "backward_one_chunk": "backward", "backward_weight_one_chunk": "backward"}


def watch(session: Session, schedule) -> None:
    """Time `schedule`'s steps and its stages' chunks (its own methods wrapped, once)."""
    if watch_stages(session, schedule):
        schedule.step = _in_phase(session, PIPELINE, schedule.step)


def watch_stages(session: Session, schedule) -> bool:
    """Time the chunks of `schedule`'s stages (once: False when they already are)."""
    if getattr(schedule, "_rankwatch_", False):
        return False
    schedule._rankwatch_ = True
    stages = getattr(schedule, "_stages", None) or [schedule._stage]
    for stage in stages:
        for method, phase in _CHUNKS.items():
            if (original := getattr(stage, method, None)) is not None:
                setattr(stage, method, _in_phase(session, phase, original))
    return True


def _in_phase(session: Session, phase: str, method):
    @functools.wraps(method)
    def call(*args, **kwargs):
        with session.phase(phase):
            return method(*args, **kwargs)

    return call
