"""Collective timings: DDP's gradient buckets through a comm hook, and the
torch.distributed collectives a user calls directly.

Bytes follow the nccl-tests convention (the collector computes algbw and
busbw from them): the full buffer of all_reduce, broadcast, reduce, send and
recv; the gathered output of all_gather and gather, the scattered input of
scatter; the input of reduce_scatter and all_to_all.

Timing: a collective's start and end are marks of the session's timer. On
CUDA the start is an event on the calling stream just before the launch, and
the end an event recorded in a callback of the work's future: PyTorch runs
such a callback with pool streams made current that wait for the work's
kernels (`torch.futures.Future.then`), so the event passes once the
collective is done on the GPU, and no host clock enters a GPU duration.
ProcessGroupNCCL completes its futures when the work is enqueued, so the
callback runs at once, on the launching thread. Groups whose backend is not
NCCL (gloo, even in a CUDA job) are marked with monotonic readings at the
call and in the callback, which runs when the work completes: a CUDA event
recorded in gloo's thread would land on the default stream of device 0.
A work that has no future (gloo's point to point) ends when it is waited for:
the caller gets it back wrapped, its `wait()` marking the end.

Point to point: `isend` and `irecv` are wrapped in torch.distributed and in
distributed_c10d both, so that a P2POp (which accepts only the function
distributed_c10d names) holds the traced one and pipeline schedules, which
call `P2POp.op` themselves, are traced; `batch_isend_irecv` is one operation
(NCCL coalesces it), a send or a receive where all its ops are one of them,
with its peer where it has one, and the ops it runs inside are not traced again.
"""

import functools
import inspect
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from rankwatch.agent import meshes
from rankwatch.agent.session import Session
from rankwatch.agent.stepspans import ASYNC, BUCKET, SYNC


def _nbytes(tensor) -> int:
    return tensor.numel() * tensor.element_size()


def group_info(dist, session: Session):
    """group -> (name, size, host, mark), worked out once per group. The default group is "world"
    whichever object stands for it (None, or dist.group.WORLD as DDP's allreduce_hook passes), so
    that its collectives form one sequence; `host`: its collectives are marked with the host clock
    (`mark`), not the timer's, as its backend is not NCCL."""
    known: dict = {}

    def info(group) -> tuple[str, int, bool, Callable[[], Any]]:
        found = known.get(group)  # (None included: the default group's, as the object standing for it)
        if found is None:
            given, group = group, group if group is not None else dist.group.WORLD
            host = "nccl" not in str(dist.get_backend(group))
            name = "world" if group is dist.group.WORLD else str(getattr(group, "group_name", None) or id(group))
            mark = time.monotonic_ns if host else session.timer.mark
            found = known[given] = known[group] = (name, dist.get_world_size(group), host, mark)
            if role := meshes.role(group):
                session.roles[name] = role
        return found

    return info


def comm_hook(session: Session, inner=None):
    """A DDP comm hook that times each gradient bucket's all-reduce around `inner` (default: the
    averaging all-reduce of DDP's allreduce_hook, launched here so that one future callback both
    unpacks the result and marks the end). Register it with `model.register_comm_hook(None, hook)`.
    With `inner`, the end follows the inner hook's own callbacks (a compression hook's
    decompression): it does not say when the group's stream was free for the next bucket; the
    collectives it launches are the bucket's, not traced again (trace_collectives)."""
    import torch.distributed as dist

    groups = group_info(dist, session)

    def hook(process_group, bucket):
        name, size, host, mark = groups(process_group)
        tensor = bucket.buffer()
        c = session.collective("all_reduce", name, size, _nbytes(tensor), BUCKET, host=host, ordered=inner is None)
        if inner is not None:

            def done(fut):
                c.end = mark()
                return fut.value()

            _inside.untraced = True  # the collectives it launches are this bucket's, timed once: as the bucket
            try:
                launched = inner(process_group, bucket)
            finally:
                _inside.untraced = False
            return launched.then(done)

        def averaged(fut):
            c.end = mark()
            return fut.value()[0]

        tensor.div_(size)  # as allreduce_hook: divided first, against overflow in low precision
        # the process group's own call, as DDP's C++ hook makes it: torch.distributed.all_reduce's checks cost
        # microseconds a bucket, for a tensor DDP made (and it is not timed twice: trace_collectives wraps that)
        group = process_group if process_group is not None else dist.group.WORLD
        assert group is not None  # (DDP passes its group; the default one exists once the job initialized)
        return group.allreduce([tensor]).get_future().then(averaged)

    return hook


def _one(tensor, n: int) -> int:
    return _nbytes(tensor)


def _each(tensor, n: int) -> int:
    return _nbytes(tensor) * n


def _all(tensors, n: int) -> int:
    return sum(_nbytes(t) for t in tensors)


# name -> (the parameter that sizes the call, its bytes given the group size n); barrier moves none
_SIZES: dict[str, tuple[str | None, Callable[[Any, int], int] | None]] = {
    "all_reduce": ("tensor", _one),
    "broadcast": ("tensor", _one),
    "reduce": ("tensor", _one),
    "send": ("tensor", _one),
    "recv": ("tensor", _one),
    "isend": ("tensor", _one),
    "irecv": ("tensor", _one),
    "all_gather": ("tensor", _each),
    "all_gather_into_tensor": ("output_tensor", _one),
    "all_gather_single": ("output_tensor", _one),
    "gather": ("tensor", _each),
    "scatter": ("tensor", _each),
    "reduce_scatter": ("input_list", _all),
    "reduce_scatter_tensor": ("input", _one),
    "reduce_scatter_single": ("input", _one),
    "all_to_all_single": ("input", _one),
    "all_to_all": ("input_tensor_list", _all),
    "barrier": (None, None),
}
_OPS = {
    "all_gather_into_tensor": "all_gather",
    "all_gather_single": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_single": "reduce_scatter",
    "all_to_all_single": "all_to_all",
    "isend": "send",
    "irecv": "recv",
}
# point to point: the peer's global rank, or its rank in the group (NCCL gives each pair its own stream)
_PEERS = {"send": ("dst", "group_dst"), "isend": ("dst", "group_dst"), "recv": ("src", "group_src")}
_PEERS["irecv"] = _PEERS["recv"]
_TRACED = (*_SIZES, "batch_isend_irecv")
_P2P = ("isend", "irecv")
_NONE = object()  # a parameter the call leaves out that has no default
# `untraced`: what is called on this thread launches collectives already traced as one (a DDP bucket's inner
# hook, a batch of point-to-point ops)
_inside = threading.local()
_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _absent(args: tuple, kwargs: dict) -> None:
    return None


def _argument(signature: inspect.Signature, name: str | None) -> Callable[[tuple, dict], Any]:
    """A getter of the argument bound to parameter `name` in a call, from the signature read once:
    by position, by keyword or its default, as Signature.bind finds it (which costs ~2 µs a call,
    this ~0.1). None where the function has no such parameter."""
    parameter = signature.parameters.get(name) if name else None
    if parameter is None:
        return _absent
    parameters = list(signature.parameters.values())
    at = parameters.index(parameter)
    if any(p.kind not in _POSITIONAL for p in parameters[: at + 1]):
        at = sys.maxsize  # keyword only: never among the positional arguments
    default = _NONE if parameter.default is parameter.empty else parameter.default

    def get(args: tuple, kwargs: dict) -> Any:
        return args[at] if at < len(args) else kwargs.get(name, default)

    return get


def trace_collectives(session: Session) -> None:
    """Wrap torch.distributed's collectives so that each call is recorded in the current step.
    Functions torch.distributed calls internally (all_gather_object's all_gathers) stay untraced."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    from rankwatch.agent import functional

    groups = group_info(dist, session)
    for name in _TRACED:
        original = getattr(dist, name, None)
        if original is None or getattr(original, "__rankwatch__", False):
            continue
        if name == "batch_isend_irecv":
            setattr(dist, name, _traced_batch(session, groups, original))
        else:
            setattr(dist, name, _traced(session, dist, groups, name, original))
    for name in _P2P:  # what a P2POp accepts and a pipeline schedule calls
        setattr(distributed_c10d, name, getattr(dist, name))
    functional.trace(session, groups)
    meshes.watch()


def untrace_collectives() -> None:
    """Put back what trace_collectives wrapped."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    from rankwatch.agent import functional

    for name in _TRACED:
        wrapped = getattr(dist, name, None)
        if getattr(wrapped, "__rankwatch__", False):
            setattr(dist, name, wrapped.__wrapped__)  # type: ignore[union-attr]
    for name in _P2P:
        setattr(distributed_c10d, name, getattr(dist, name))
    functional.untrace()
    meshes.unwatch()


def _traced(session: Session, dist, groups, name: str, original):
    signature = inspect.signature(original)  # once: each call finds its arguments by position or name
    op = _OPS.get(name, name)
    sized, size_of = _SIZES[name]
    sizing = _argument(signature, sized)
    group_of = _argument(signature, "group")
    async_of = _argument(signature, "async_op")
    peer_of = [_argument(signature, p) for p in _PEERS.get(name, ())]
    always_async = name in ("isend", "irecv")  # they return a Work to wait on

    def start(args: tuple, kwargs: dict):
        group = group_of(args, kwargs)
        group_name, size, host, mark = groups(group)
        peer = None
        if peer_of:
            peer, group_peer = peer_of[0](args, kwargs), peer_of[1](args, kwargs)
            if peer is None and group_peer is not None:
                peer = group_peer if group is None else dist.get_global_rank(group, group_peer)
        launched = always_async or bool(async_of(args, kwargs))
        nbytes = size_of(sizing(args, kwargs), size) if size_of else 0
        c = session.collective(op, group_name, size, nbytes, ASYNC if launched else SYNC, host=host, peer=peer)
        return c, mark, launched

    @functools.wraps(original)
    def call(*args, **kwargs):
        if getattr(_inside, "untraced", False):
            return original(*args, **kwargs)
        try:
            c, mark, launched = start(args, kwargs)
        except Exception:  # arguments the original refuses, or a group this rank is not in: it says so
            return original(*args, **kwargs)
        _inside.untraced = True  # what it calls itself (send calls isend) is this call
        try:
            work = original(*args, **kwargs)
        finally:
            _inside.untraced = False
        if not launched or work is None:  # returned once the calling stream waits for it (CUDA) or it is done
            c.end = mark()
            return work
        return _mark_end(c, mark, [work])[0]

    call.__rankwatch__ = True  # type: ignore[attr-defined]  # marks it wrapped (see trace_collectives)
    return call


def _traced_batch(session: Session, groups, original):
    """batch_isend_irecv as one operation: NCCL runs the batch as one coalesced launch. Which
    communicator's stream runs it is not the agent's to know, so it is not ordered after others.
    A batch of sends alone (or receives alone) is a send (a receive); a batch with one peer has it."""

    @functools.wraps(original)
    def call(p2p_op_list):
        try:
            name, size, host, mark = groups(p2p_op_list[0].group)
            nbytes = sum(_nbytes(p.tensor) for p in p2p_op_list)
            kinds = {"send" if p.op.__name__ == "isend" else "recv" for p in p2p_op_list}
            peers = {p.peer for p in p2p_op_list}
            op = kinds.pop() if len(kinds) == 1 else "batch_isend_irecv"
            peer = peers.pop() if len(peers) == 1 else None
            c = session.collective(op, name, size, nbytes, ASYNC, host=host, peer=peer, ordered=False)
        except Exception:  # an empty or malformed list: the original says what is wrong
            return original(p2p_op_list)
        _inside.untraced = True
        try:
            works = original(p2p_op_list)
        finally:
            _inside.untraced = False
        return _mark_end(c, mark, works)  # one coalesced Work on NCCL; one an op on gloo

    call.__rankwatch__ = True  # type: ignore[attr-defined]
    return call


def _mark_end(c, mark, works: list) -> list:
    """`works`, with `c.end` marked in a callback once they are done (at once where there are none).
    The callback of one Work's future runs on streams that wait for it (CUDA), that of several's (gloo,
    on the host) once all are done. The works come back wrapped, so that the moment the caller first
    waits for them is marked (`c.waited`: from there its stream is blocked, not computing); where they
    have no future (gloo's point to point and reduce_scatter) the end is marked when the last of them
    has been waited for."""
    if not works:
        c.end = mark()
        return works
    try:
        futures = [w.get_future() for w in works]
    except RuntimeError:
        futures = []
    if len(futures) > 1:
        import torch

        futures = [torch.futures.collect_all(futures)]
    if futures:
        futures[0].then(lambda _: setattr(c, "end", mark()))
    waits = _Waits(c, mark, 0 if futures else len(works))
    return [_WaitedWork(w, waits) for w in works]


class _Waits:
    """The waits for a collective's works: the first marks `c.waited`; the last of `count` marks
    `c.end` (0: the end is marked elsewhere)."""

    def __init__(self, c, mark, count: int):
        self.c, self.mark, self.left = c, mark, count

    def started(self) -> None:
        if self.c.waited is None:
            self.c.waited = self.mark()

    def one_done(self) -> None:
        self.left -= 1
        if self.left == 0:
            self.c.end = self.mark()


class _WaitedWork:
    """A Work that says when it is waited for (everything else is the Work's own)."""

    def __init__(self, work, waits: _Waits):
        self._work, self._waits, self._done = work, waits, False

    def wait(self, *args, **kwargs):
        if self._done:
            return self._work.wait(*args, **kwargs)
        self._waits.started()
        result = self._work.wait(*args, **kwargs)
        self._done = True
        self._waits.one_done()
        return result

    def __getattr__(self, name: str):
        return getattr(self._work, name)
