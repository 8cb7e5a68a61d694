"""rankwatch agent: per-rank telemetry for a training loop, in a few lines.

    from rankwatch import agent

    agent.init()                       # rank, run and collector from torchrun and RANKWATCH_* variables
    for i, batch in enumerate(loader):
        with agent.step(i):
            with agent.phase("forward"):
                loss = model(batch)
            ...
            agent.record(loss=loss.item(), tokens=batch.numel())
    agent.end()                        # the loop is over (shutdown says so too, if not yet said)
    agent.shutdown()

Nothing here blocks training on the network: spans are exported by the
OpenTelemetry SDK's background thread, and wait in a bounded backlog while
the collector is away. The agent imports no collector code, duckdb or
streamlit, and torch only where torch is used.

Importing the package loads none of its machinery: the session, and with it the
OpenTelemetry SDK, is imported by `init()`, so the collector, the dashboard and
the importers read the package's leaves (semconv, gpumodel, paths, apiclient)
without paying for it.
"""

from __future__ import annotations

import atexit
import os
from contextlib import nullcontext
from typing import TYPE_CHECKING

from rankwatch.agent import config

if TYPE_CHECKING:  # the session (and the OpenTelemetry SDK) load at init(): `agent.config` and
    from rankwatch.agent.commands import Commands  # `agent.semconv` are read by the collector, which exports nothing
    from rankwatch.agent.failures import Watch
    from rankwatch.agent.session import Session

_session: Session | None = None
_commands: Commands | None = None  # made on the first command() call
_watch: Watch | None = None  # how the process ends, told (rankwatch/agent/failures.py)
_control: tuple[str, str | None] = (config.DEFAULT_COLLECTOR, None)  # the collector and token of init()


def init(
    run_id: str | None = None,
    collector: str | None = None,
    token: str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    cuda: bool | None = None,
    resource: dict | None = None,
) -> Session:
    """Start this rank's session. Everything defaults from the environment: RANK and
    WORLD_SIZE (torchrun), RANKWATCH_RUN_ID, RANKWATCH_COLLECTOR, RANKWATCH_TOKEN (or
    RANKWATCH_TOKEN_FILE; a token file that is empty or short is agent.config.TokenError, a token the
    collector refuses agent.config.TokenRefused, found by one empty export here rather than after a
    run's worth of refused telemetry; a collector that cannot be reached is waited for as it runs).
    `cuda`: time phases with CUDA events (default: when torch sees a GPU)."""
    global _session, _commands, _control, _watch
    from rankwatch.agent.clock import CpuTimer, Timer
    from rankwatch.agent.failures import Watch, attempted
    from rankwatch.agent.senders import check_token
    from rankwatch.agent.session import Session

    timer: Timer = CpuTimer()
    if cuda or cuda is None:
        try:
            import torch

            if torch.cuda.is_available():
                from rankwatch.agent.clock import CudaTimer

                timer = CudaTimer(torch.cuda.current_device())
        except ImportError:
            pass
    _commands, _control = None, (config.collector_urls(collector), config.token(token))
    check_token(*_control)
    _session = Session(
        run_id=config.run_id(run_id),
        rank=int(os.environ.get("RANK", 0)) if rank is None else rank,
        world_size=int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size,
        collector=_control[0],
        token=_control[1],
        resource={"rankwatch.local_rank": int(os.environ.get("LOCAL_RANK", 0)), **attempted(), **(resource or {})},
        timer=timer,
    )
    atexit.register(shutdown)
    _watch = Watch(_session.fail, shutdown)
    return _session


def step(i: int):
    """Context for one training step (all ranks use the same step numbers)."""
    return _session.step(i) if _session else nullcontext()


def phase(name: str):
    """Context for a phase of the step: "data", "forward", "backward", "optimizer" (or your own)."""
    return _session.phase(name) if _session else nullcontext()


def transfer(src: str, dst: str, nbytes: int, what: str = ""):
    """Context for a copy of `nbytes` between memory tiers, "gpu", "host", "pinned" or "disk" (a swap,
    an offloaded optimizer's state read back, a parameter copied to the GPU), from any thread; `what`
    moved: "optimizer_state", "parameters", "gradients", "activations". Enter it on the copying stream."""
    return _session.transfer(src, dst, nbytes, what) if _session else nullcontext()


def host_work(name: str):
    """Context for work on the host's CPUs that training waits for ("optimizer": an offloaded
    optimizer's step), from any thread."""
    return _session.host_work(name) if _session else nullcontext()


def record(**values) -> None:
    """Values of the current step: loss, grad_norm, tokens, lr, mfu (others kept as attributes)."""
    if _session:
        _session.record(**values)


def event(name: str, step: int | None = None, **attributes) -> None:
    """Something that happened (checkpoint saved, fault injected, ...)."""
    if _session:
        _session.event(name, step, **attributes)


def command(step: int) -> dict | None:
    """At a step boundary, on every rank: the command to apply now (a rollback: restore the
    newest checkpoint at or before `args["before_step"]`, skip `args["skip_batches"]` batches,
    scale the learning rate by `args["lr_scale"]`), the same on every rank; else None. Every rank
    must call it at every step: it looks for a command every step or every ~0.25 s of training,
    whichever is longer (a look is a collective). Then report()."""
    global _commands
    if not _session or not _session.exporter:
        return None
    if _commands is None:
        from rankwatch.agent.commands import Commands

        _commands = Commands(*_control, _session.run_id, _session.rank)
    return _commands.at_step(step)


def report(command_: dict, state: str, **result) -> None:
    """How a command went ("applied" or "failed", with what happened), from rank 0."""
    if _commands:
        _commands.report(command_, state, result=result or None)


def watch_ddp(model, inner_hook=None) -> None:
    """Time a DistributedDataParallel model's gradient all-reduces (wrapping `inner_hook`, if any)."""
    from rankwatch.agent.collectives import comm_hook

    model.register_comm_hook(None, comm_hook(_started(), inner_hook))


def watch_collectives() -> None:
    """Time the torch.distributed collectives the training code calls itself."""
    from rankwatch.agent.collectives import trace_collectives

    trace_collectives(_started())


def watch_pipeline(schedule) -> None:
    """Time a torch.distributed.pipelining schedule's steps, its stages' forward and backward chunks and
    so its bubble (call watch_collectives too, for the sends and receives between stages)."""
    from rankwatch.agent import pipeline

    pipeline.watch(_started(), schedule)


def current_session() -> Session | None:
    """The session `init` started (None before, and after `shutdown`)."""
    return _session


def _started() -> Session:
    """The session `init` started: without one, a watched collective would fail inside training."""
    if _session is None:
        raise RuntimeError("rankwatch: call agent.init() before watching collectives")
    return _session


def end() -> None:
    """The training loop has ended: a last checkpoint written after it is no stall."""
    if _session:
        _session.end()


def shutdown() -> None:
    """Send what is left (called at exit too)."""
    global _session, _commands, _watch
    if _watch:
        _watch.close()
        _watch = None
    if _commands:
        _commands.close()
        _commands = None
    if _session:
        session, _session = _session, None
        session.shutdown()
