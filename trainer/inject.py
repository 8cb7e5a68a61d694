"""Where the trainer's faults (trainer/faults.py) enter the job: a slow link in DDP's gradient
all-reduces or in tensor parallelism's all-reduces, and slow, hung or crashing compute in each
forward of a model or a pipeline stage's chunks. Each delay lands where the work runs
(trainer/delays.py), sized from the clean time of the work it stretches.
"""

import os
import threading
from collections.abc import Callable

from rankwatch import agent
from trainer.delays import Delay, WorkTime
from trainer.faults import Fault

StepOf = Callable[[], int]


def _factor(faults: list[Fault], rank: int, step: int, group: str | None) -> float:
    """The slow-link factor on this rank's links of `group` (None: DDP's) at `step` (1: none)."""
    return max(
        (
            f.get("factor")
            for f in faults
            if f.kind == "slow-link" and f.rank == rank and f.get("group") == group and f.active(step)
        ),
        default=1.0,
    )


def slow_link_hook(faults: list[Fault], rank: int, step_of: StepOf, cuda: bool):
    """A DDP comm hook that stretches this rank's all-reduces `factor` times while a slow-link fault is
    active: a delay after each, where it runs, sized from the all-reduces' typical time."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    delay, took = Delay(cuda), WorkTime(cuda)

    def hook(process_group, bucket):
        factor = _factor(faults, rank, step_of(), None)
        if factor <= 1:
            return default_hooks.allreduce_hook(process_group, bucket)
        started = took.start()

        def stretch(done):  # gloo: once the all-reduce is done; NCCL: at once, on a stream that waits for it
            took.stop(started)
            delay((factor - 1) * took.typical_s)
            return done.value()

        return default_hooks.allreduce_hook(process_group, bucket).then(stretch)

    return hook


def slow_tp_link(faults: list[Fault], rank: int, step_of: StepOf, tp_group, cuda: bool) -> None:
    """Stretch this rank's tensor-parallel all-reduces (DTensor's functional all_reduce over `tp_group`)
    `factor` times while a slow-link fault with group=tp is active: each waited for, then a delay of
    (factor - 1) times their typical time. Installed before the agent traces the functional collectives, so
    that the agent times the stretched collective, as it would a slow link's."""
    if not any(f.kind == "slow-link" and f.rank == rank and f.get("group") == "tp" for f in faults):
        return
    import torch.distributed._functional_collectives as funcol

    all_reduce, name = funcol.all_reduce, tp_group.group_name
    delay, took = Delay(cuda), WorkTime(cuda)

    def stretched(tensor, reduceOp, group, tag=""):
        factor = _factor(faults, rank, step_of(), "tp")
        if factor <= 1 or funcol._resolve_group_name(group, tag) != name:
            return all_reduce(tensor, reduceOp, group, tag)
        started = took.start()
        out = all_reduce(tensor, reduceOp, group, tag)
        out = out.wait() if hasattr(out, "wait") else out
        took.stop(started)
        delay((factor - 1) * took.typical_s)
        return out

    funcol.all_reduce = stretched


class ComputeFaults:
    """Forward hooks that apply this rank's compute faults to each forward of `module` (a model, or a
    pipeline stage's, whose schedule runs one forward per microbatch): a straggler's slowdown, a slow
    stage's, a hang and a crash. `active()` gives the faults of the current step on this rank."""

    def __init__(self, module, active: Callable[[], list[Fault]], stage: int, cuda: bool):
        self.active, self.stage = active, stage
        self.delay, self.took = Delay(cuda), WorkTime(cuda)
        self._started = None
        self._hung: set[str] = set()  # a hang stops the step once, not at each of its forwards
        module.register_forward_pre_hook(self._pre)
        module.register_forward_hook(self._post)

    def _pre(self, module, args) -> None:
        self._started = self.took.start()

    def _post(self, module, args, output) -> None:
        self.took.stop(self._started)
        for f in self.active():
            if f.kind == "straggler" or (f.kind == "slow-stage" and f.get("stage") == self.stage):
                # backward takes about twice the forward: the chunk's compute stretched `slowdown` times
                extra = 3 * (f.get("slowdown") - 1) * (self.took.last_s or 0.0)
                self.delay(extra)
            elif f.kind == "hang" and f.spec not in self._hung:
                self._hung.add(f.spec)
                threading.Event().wait(f.get("seconds"))  # None: for ever
            elif f.kind == "crash":
                agent.shutdown()  # the fault_injected event still reaches the collector
                os._exit(1)
