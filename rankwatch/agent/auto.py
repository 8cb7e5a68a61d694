"""Zero-code instrumentation: the agent in an unmodified training script (`rankwatch run`).

`rankwatch run -- torchrun ... train.py` puts rankwatch/agent/autostart/ on PYTHONPATH: its sitecustomize
calls `install()` in every Python process of the job, which waits for the script to import torch
(a light import hook: a process that never imports torch, such as a tool the script shells out to,
pays nothing) and then hooks what any PyTorch loop does:

- a step ends with the first optimizer step after a forward (torch's global optimizer hooks), and
  the next begins there, its data phase lasting until the model's forward;
- the forward phase is the model's forward (the first module with parameters called outside any
  other: the DDP or FSDP wrapper, or the model; found by hooks on every module's forward, which
  then give way to hooks on it alone), the backward phase from its end to the optimizer
  step (the loss, the backward, a DDP job's last gradient all-reduces), the optimizer phase the
  optimizer step; a step of several forwards (gradient accumulation) has several of each. An
  optimizer step given a closure (Lightning's automatic optimization, LBFGS) runs the forward and
  backward itself: the closure is wrapped, its forward and backward are timed as such, and the
  optimizer phase is what the step does after the closure returns;
- the loss is the sum of the scalars the step's backwards start from (`Tensor.backward`): the loss the
  step optimized, which under gradient accumulation is the micro-batches' losses each scaled by 1/N, as
  Lightning and Hugging Face's Trainer scale them (their mean, which they report); a closure's second
  and later calls in one step (LBFGS's line search) re-evaluate the same loss and add nothing. The
  gradient norm is what `clip_grad_norm_` returns, both read without a sync (summed as tensors,
  recorded once at the step's end: Session.record), the learning rate the optimizer's first parameter
  group's; a loss that mixed precision's grad scaler scaled (`GradScaler.scale`) counts as it was before;
- collectives as `agent.watch_collectives()` (torch.distributed's, the functional ones of tensor
  parallelism, a pipeline's sends and receives) and, for a DDP model, `agent.watch_ddp()` at its
  first forward, around the comm hook the script registered, if any;
- a pipeline schedule's step (torch.distributed.pipelining) as the `pipeline` phase, with its stages'
  forward and backward chunks inside it as `agent.watch_pipeline()` times them, from the schedule's
  second step (its first starts the session, at the stage's first forward): the data phase ends
  where the schedule starts, and the stage module's forwards then mark no phase of their own.

The session starts at the first forward of a rank (after `init_process_group`: its rank and world
size are torchrun's), so the launcher and the processes that never train start none. What needs
the script's own code stays out: a rollback (the script's checkpoints) and power caps are not
applied, steps are numbered from 0 in each process (a resumed script counts again), and a pipeline
stage's loss, which the schedule computes and back-propagates itself, is not recorded.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys
from typing import Any

from rankwatch import agent

ENV = "RANKWATCH_AUTO"  # set by `rankwatch run`: instrument this job
UNSCALED = "_rankwatch_unscaled"  # on a loss a grad scaler scaled: the loss before it


class _Driver:
    """Steps and phases from torch's hooks, on the training thread."""

    def __init__(self) -> None:
        self.step = 0
        self.root: Any = None  # the module whose forward is the step's forward phase
        self._step_cm: Any = None  # the open step and phase contexts (agent.step / agent.phase)
        self._phase_cm: Any = None
        self._forwarded = False  # a forward came since the last step ended
        self._pipelined = False  # in a pipeline schedule's step: its chunks are the phases
        self._loss: Any = None  # the sum of the scalars the step's backwards started from (a tensor: no sync)
        self._summing = True  # backwards add to the loss (not in a closure's second call: a re-evaluation)
        self.until_root: list = []  # the hooks on every module's forward, until the root is known

    def _enter_phase(self, name: str | None) -> None:
        if self._phase_cm is not None:
            self._phase_cm.__exit__(None, None, None)
            self._phase_cm = None
        if name is not None and self._step_cm is not None:
            self._phase_cm = agent.phase(name)
            self._phase_cm.__enter__()

    def forward_pre(self, module, args) -> None:
        if self.root is None:  # the first forward: the root of the loop's calls, and the session
            if not any(True for _ in module.parameters()):
                return
            self._adopt(module)
        elif module is not self.root:
            return
        self._open_step()
        self._forwarded = True
        if not self._pipelined:
            self._enter_phase("forward")

    def _open_step(self) -> None:
        """The step, where none is open (the first of the process, opened by its first forward)."""
        if self._step_cm is None:
            self._step_cm = agent.step(self.step)
            self._step_cm.__enter__()

    def _adopt(self, root) -> None:
        """`root`'s forward is the step's forward from now on (its alone calls a hook, not every module's
        of the model); the session starts."""
        self.root = root
        for hook in self.until_root:
            hook.remove()
        root.register_forward_pre_hook(self.forward_pre)
        root.register_forward_hook(self.forward_post)
        self._start(root)

    def forward_post(self, module, args, output) -> None:
        if module is self.root and not self._pipelined:
            self._enter_phase("backward")

    def pipeline_step(self, step, schedule, args, kwargs):
        """A pipeline schedule's `step`: the `pipeline` phase, its stages' chunks inside it."""
        from rankwatch.agent import pipeline

        try:
            if self.root is None:  # the session starts here, on every rank alike (its clock's alignment is a
                # collective, which a later stage, waiting for its first activations, would enter too late)
                self._adopt((getattr(schedule, "_stages", None) or [schedule._stage])[0].submod)
            session = agent.current_session()
            if session is None:
                raise RuntimeError("no session started")
            pipeline.watch_stages(session, schedule)
        except Exception as e:  # a schedule of a shape this does not know: its steps stay untimed
            print(f"rankwatch: this pipeline schedule is not timed: {e}", file=sys.stderr)
            return step(schedule, *args, **kwargs)
        self._open_step()
        self._enter_phase(None)
        self._pipelined = True
        try:
            with session.phase(pipeline.PIPELINE):
                return step(schedule, *args, **kwargs)
        finally:
            self._pipelined = False

    def backward(self, tensor) -> None:
        """A backward from `tensor`: a scalar's value counts in the step's loss (a loss that a mixed-precision
        grad scaler scaled, by the value it had before: agent.auto marks it)."""
        if self._step_cm is not None and self._summing and tensor.numel() == 1:
            value = getattr(tensor, UNSCALED, tensor).detach()
            if value.dtype.itemsize < 4:  # half precision would round the sum
                value = value.float()
            self._loss = value if self._loss is None else self._loss + value

    def optimizer_pre(self, optimizer, args, kwargs):
        """The optimizer phase begins here, or, for a step given a closure (which runs a forward and backward
        of its own), where the closure returns: the step gets the closure wrapped."""
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)  # (args[0] is the optimizer)
        if callable(closure):
            wrapped = functools.partial(self._closure, closure)
            if "closure" in kwargs:
                return args, {**kwargs, "closure": wrapped}
            return (args[0], wrapped, *args[2:]), kwargs
        if self._forwarded:
            self._enter_phase("optimizer")
        return None

    def _closure(self, closure):
        """A step's closure: what follows it is the optimizer phase."""
        loss = closure()
        if self._forwarded:  # (not a second optimizer's, in a step already ended)
            self._summing = False  # a later call in this step evaluates the same loss again
            self._enter_phase("optimizer")
        return loss

    def optimizer_post(self, optimizer, args, kwargs) -> None:
        """The step ends here (a second optimizer of the same step finds it ended: it is not timed)."""
        if not self._forwarded:
            return
        self._forwarded = False
        self._enter_phase(None)
        if (lr := optimizer.param_groups[0].get("lr")) is not None:
            agent.record(lr=lr)  # (a tensor learning rate is read as the loss is: later, without a sync)
        if self._loss is not None:
            agent.record(loss=self._loss)
        self._loss, self._summing = None, True
        self._step_cm.__exit__(None, None, None)
        self.step += 1
        self._step_cm = agent.step(self.step)  # the next, from here: its data phase until the forward
        self._step_cm.__enter__()
        self._enter_phase("data")

    def _start(self, root) -> None:
        """The session, at the root's first forward, timed where the model runs (CUDA events on its
        GPU, the host's clock for a model on the CPU, whatever GPUs the machine has); a DDP root's
        buckets timed from here on."""
        import torch
        from torch.nn.parallel import DistributedDataParallel

        device = next(root.parameters()).device
        if device.type == "cuda":
            with torch.cuda.device(device):
                agent.init(cuda=True)
        else:
            agent.init(cuda=False)
        if _distributed():
            agent.watch_collectives()
        if not isinstance(root, DistributedDataParallel):
            return
        registered = getattr(root, "_rankwatch_hook", None)  # the script's, held back (see install)
        state, inner = registered or (None, None)
        if state is None:  # a hook of its own state (PowerSGD's) is registered as it is, untimed
            agent.watch_ddp(root, inner)
        else:
            _register_comm_hook(root, state, inner)


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


_register_comm_hook: Any = None  # DDP's own, once install() has wrapped it


def _watch_schedules(driver: _Driver) -> None:
    """Every pipeline schedule's `step` through the driver (the schedules' classes wrapped)."""
    from torch.distributed.pipelining import schedules

    for cls in (schedules.PipelineScheduleSingle, schedules.PipelineScheduleMulti):
        step = cls.step

        @functools.wraps(step)
        def stepped(self, *args, _step=step, **kwargs):
            return driver.pipeline_step(_step, self, args, kwargs)

        cls.step = stepped  # type: ignore[method-assign]


def _instrument() -> None:
    """Hook torch, once it is imported."""
    global _register_comm_hook
    import torch
    from torch.nn.parallel import DistributedDataParallel
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    from rankwatch.agent import meshes

    driver = _Driver()
    driver.until_root = [
        torch.nn.modules.module.register_module_forward_pre_hook(driver.forward_pre),
        torch.nn.modules.module.register_module_forward_hook(driver.forward_post),
    ]
    register_optimizer_step_pre_hook(driver.optimizer_pre)
    register_optimizer_step_post_hook(driver.optimizer_post)
    meshes.watch()  # before the script makes its DeviceMesh: the dimensions its groups stand for

    backward = torch.Tensor.backward

    def backward_recorded(self, *args, **kwargs):
        driver.backward(self)
        return backward(self, *args, **kwargs)

    torch.Tensor.backward = backward_recorded  # type: ignore[method-assign]

    scale = torch.amp.GradScaler.scale  # (torch.cuda.amp's and Lightning's and Accelerate's scalers are these)

    def scale_marked(self, outputs):
        scaled = scale(self, outputs)
        if isinstance(outputs, torch.Tensor) and outputs.numel() == 1:  # a loss: the step's, before scaling
            setattr(scaled, UNSCALED, outputs)
        return scaled

    torch.amp.GradScaler.scale = scale_marked  # type: ignore[method-assign]
    # pipelining costs an import most jobs never make: its schedules are wrapped if the script imports it
    _after("torch.distributed.pipelining.schedules", lambda: _watch_schedules(driver))

    clip = torch.nn.utils.clip_grad_norm_

    def clip_recorded(*args, **kwargs):
        norm = clip(*args, **kwargs)
        agent.record(grad_norm=norm.detach())
        return norm

    torch.nn.utils.clip_grad_norm_ = clip_recorded

    # the script's comm hook waits for the first forward, to be registered inside the agent's timing
    _register_comm_hook = DistributedDataParallel.register_comm_hook

    def held_back(self, state, hook):
        if driver.root is not None:  # the buckets' timing is in place (or this is not the root)
            return _register_comm_hook(self, state, hook)
        self._rankwatch_hook = (state, hook)

    DistributedDataParallel.register_comm_hook = held_back  # type: ignore[method-assign]


class _After(importlib.abc.MetaPathFinder):
    """Runs `then` once the module `name` has been imported (the import that finds it runs the module's
    own loader, then this)."""

    def __init__(self, name: str, then) -> None:
        self.name, self.then = name, then

    def find_spec(self, name, path=None, target=None):
        if name != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            try:
                self.then()
            except Exception as e:  # never the script's failure: it trains uninstrumented
                print(f"rankwatch: this job is not instrumented: {e}", file=sys.stderr)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def _after(name: str, then) -> None:
    """`then()` once `name` is imported (at once where it already is)."""
    if name in sys.modules:
        then()
    else:
        sys.meta_path.insert(0, _After(name, then))


def install() -> None:
    """Instrument this process once it imports torch (at once where it already has)."""
    _after("torch", _instrument)
