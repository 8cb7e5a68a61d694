"""Collective timings: DDP's gradient buckets through a comm hook, and the
torch.distributed collectives a user calls directly.

Bytes follow the nccl-tests convention (the collector computes algbw and
busbw from them): the full buffer of all_reduce, broadcast, send and recv;
the gathered output of all_gather; the input of reduce_scatter and
all_to_all.

Timing: a collective's start and end are marks of the session's timer. On
CUDA the start is an event on the calling stream just before the launch, and
the end an event recorded in a callback of the work's future: PyTorch runs
such a callback with pool streams made current that wait for the work's
kernels (`torch.futures.Future.then`), so the event passes once the
collective is done on the GPU, and no host clock enters a GPU duration.
ProcessGroupNCCL completes its futures when the work is enqueued, so the
callback runs at once, on the launching thread. On CPU (gloo) the marks are
monotonic readings at the call and in the callback, which runs when the
work completes.
"""

import functools

from agent.session import ASYNC, BUCKET, SYNC, Session


def _nbytes(tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _group(dist, group) -> tuple[str, int]:
    name = "world" if group is None else str(getattr(group, "group_name", None) or id(group))
    return name, dist.get_world_size(group)


def comm_hook(session: Session, inner=None):
    """A DDP comm hook that times each gradient bucket's all-reduce around `inner` (default: the
    averaging all-reduce of DDP's allreduce_hook, launched here so that one future callback both
    unpacks the result and marks the end). Register it with `model.register_comm_hook(None, hook)`."""
    import torch.distributed as dist

    groups: dict = {}  # DDP passes the same process group on every call: its name once
    mark = session.timer.mark

    def hook(process_group, bucket):
        key = id(process_group)
        if key not in groups:
            groups[key] = _group(dist, process_group)
        name, size = groups[key]
        tensor = bucket.buffer()
        c = session.collective("all_reduce", name, size, _nbytes(tensor), BUCKET)
        if inner is not None:

            def done(fut):
                c.end = mark()
                return fut.value()

            return inner(process_group, bucket).then(done)

        def averaged(fut):
            c.end = mark()
            return fut.value()[0]

        tensor.div_(size)  # as allreduce_hook: divided first, against overflow in low precision
        all_reduce = getattr(dist.all_reduce, "__wrapped__", dist.all_reduce)  # not timed twice (trace_collectives)
        return all_reduce(tensor, group=process_group, async_op=True).get_future().then(averaged)

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
_OPS = {
    "all_gather_into_tensor": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "all_to_all_single": "all_to_all",
}


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
        launched = kwargs.get("async_op")
        c = session.collective(
            _OPS.get(name, name), group_name, size, size_of(size, *args, **kwargs), ASYNC if launched else SYNC
        )
        work = original(*args, **kwargs)
        if launched and work is not None:
            work.get_future().then(lambda fut: setattr(c, "end", session.timer.mark()))
        else:  # a blocking call returns once the calling stream waits for it (on CUDA) or it is done
            c.end = session.timer.mark()
        return work

    call.__rankwatch__ = True  # type: ignore[attr-defined]  # marks it wrapped (see trace_collectives)
    return call
