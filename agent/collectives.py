"""Collective timings: DDP's gradient buckets through a comm hook, and the
torch.distributed collectives a user calls directly.

Bytes follow the nccl-tests convention (the collector computes algbw and
busbw from them): the full buffer of all_reduce, broadcast, send and recv;
the gathered output of all_gather; the input of reduce_scatter and
all_to_all.
"""

import functools
import time

from agent.session import Session


def _nbytes(tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _group(dist, group) -> tuple[str, int]:
    name = "world" if group is None else str(getattr(group, "group_name", None) or id(group))
    return name, dist.get_world_size(group)


def comm_hook(session: Session, inner=None):
    """A DDP comm hook that times each gradient bucket's all-reduce around `inner`
    (default: DDP's own allreduce_hook). Register it with
    `model.register_comm_hook(process_group, hook)`."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    inner = inner or default_hooks.allreduce_hook

    def hook(process_group, bucket):
        name, size = _group(dist, process_group)
        c = session.collective("all_reduce", name, size, _nbytes(bucket.buffer()))
        c.ready = c.start

        def done(fut):
            c.end = time.monotonic_ns()
            return fut.value()

        return inner(process_group, bucket).then(done)

    return hook


# name -> (bytes of the call, given its arguments and the group size)
_SIZES = {
    "all_reduce": lambda n, tensor, *a, **k: _nbytes(tensor),
    "broadcast": lambda n, tensor, *a, **k: _nbytes(tensor),
    "send": lambda n, tensor, *a, **k: _nbytes(tensor),
    "recv": lambda n, tensor, *a, **k: _nbytes(tensor),
    "all_gather": lambda n, tensor_list, tensor, *a, **k: _nbytes(tensor) * n,
    "all_gather_into_tensor": lambda n, output, input, *a, **k: _nbytes(output),
    "reduce_scatter": lambda n, output, input_list, *a, **k: sum(_nbytes(t) for t in input_list),
    "reduce_scatter_tensor": lambda n, output, input, *a, **k: _nbytes(input),
    "all_to_all_single": lambda n, output, input, *a, **k: _nbytes(input),
    "barrier": lambda n, *a, **k: 0,
}
_OPS = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
        "all_to_all_single": "all_to_all"}


def trace_collectives(session: Session) -> None:
    """Wrap torch.distributed's collectives so that each call is recorded in the current step."""
    import torch.distributed as dist

    for name, size_of in _SIZES.items():
        original = getattr(dist, name, None)
        if original is None or getattr(original, "__rankwatch__", False):
            continue
        setattr(dist, name, _traced(session, dist, name, original, size_of))


def _traced(session: Session, dist, name: str, original, size_of):
    @functools.wraps(original)
    def call(*args, **kwargs):
        group = kwargs.get("group")
        group_name, size = _group(dist, group)
        c = session.collective(_OPS.get(name, name), group_name, size, size_of(size, *args, **kwargs))
        work = original(*args, **kwargs)
        if kwargs.get("async_op") and work is not None:
            work.get_future().then(lambda fut: setattr(c, "end", time.monotonic_ns()))
        else:
            c.end = time.monotonic_ns()
        return work

    call.__rankwatch__ = True
    return call
