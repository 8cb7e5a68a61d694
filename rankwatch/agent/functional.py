"""Functional collectives (`torch.distributed._functional_collectives`): what DTensor runs for tensor
parallelism, in forward and in backward, and what compiled code calls.

A functional collective is launched when it is called and returns a tensor that waits for it where
it is first used (an AsyncCollectiveTensor, whose wait is the module's `wait_tensor`). Each is
recorded as a blocking collective of its group: its start a mark at the call, its end a mark once
waited for (on CUDA an event on the calling stream after the wait: it passes once the collective and
the work queued between its launch and its use are done; tensor parallelism uses the result at once).
One that comes back already waited for (under tracing, or gathered along another dimension) ends at
its return. A functional collective that calls another is recorded once.
"""

import functools
import threading
import weakref
from collections.abc import Callable
from typing import Any

from rankwatch.agent.session import Session
from rankwatch.agent.stepspans import SYNC

# name -> (op on the wire, the position of its group argument, bytes of its input given the group size n)
_FUNCTIONS: dict[str, tuple[str, int, Callable[[int, int], int]]] = {
    "all_reduce": ("all_reduce", 2, lambda b, n: b),
    "broadcast": ("broadcast", 2, lambda b, n: b),
    "all_gather_single": ("all_gather", 2, lambda b, n: b * n),
    "all_gather_tensor": ("all_gather", 2, lambda b, n: b * n),
    "all_gather_tensor_autograd": ("all_gather", 2, lambda b, n: b * n),
    "reduce_scatter_single": ("reduce_scatter", 3, lambda b, n: b),
    "reduce_scatter_tensor": ("reduce_scatter", 3, lambda b, n: b),
    "reduce_scatter_tensor_autograd": ("reduce_scatter", 3, lambda b, n: b),
    "all_to_all_single": ("all_to_all", 3, lambda b, n: b),
    "all_to_all_single_autograd": ("all_to_all", 3, lambda b, n: b),
}
_MAX_PENDING = 4096  # collectives launched and not yet waited for, at most (those never waited for are dropped)
_inside = threading.local()  # `traced`: a functional collective is being called on this thread


def trace(session: Session, groups: Callable[[Any], tuple]) -> None:
    """Wrap the functional collectives so that each call is recorded in the current step; `groups`:
    a process group -> (name, size, host, mark), as agent.collectives works them out."""
    import torch.distributed._functional_collectives as funcol
    from torch.distributed import distributed_c10d

    if getattr(funcol.wait_tensor, "__rankwatch__", False):
        return
    pending: dict[int, tuple[weakref.ref, Any, Callable[[], Any]]] = {}  # by the result's storage
    for name, (op, at, size_of) in _FUNCTIONS.items():
        if (original := getattr(funcol, name, None)) is not None:
            setattr(
                funcol, name, _traced(session, funcol, distributed_c10d, groups, pending, op, at, size_of, original)
            )
    wait_tensor = funcol.wait_tensor

    @functools.wraps(wait_tensor)
    def waited(tensor):
        out = wait_tensor(tensor)
        found = pending.pop(tensor.untyped_storage().data_ptr(), None)
        if found is not None and found[0]() is not None:
            found[1].end = found[2]()
        return out

    waited.__rankwatch__ = True  # type: ignore[attr-defined]  # marks it wrapped (see untrace)
    funcol.wait_tensor = waited


def untrace() -> None:
    """Put back what trace wrapped."""
    import torch.distributed._functional_collectives as funcol

    for name in (*_FUNCTIONS, "wait_tensor"):
        wrapped = getattr(funcol, name, None)
        if getattr(wrapped, "__rankwatch__", False):
            setattr(funcol, name, wrapped.__wrapped__)  # type: ignore[union-attr]


def _traced(session: Session, funcol, c10d, groups, pending: dict, op: str, at: int, size_of, original):
    resolved: dict = {}  # (id of the group or mesh given, dimension, tag) -> (it, its group's (name, size, host, mark))

    def group_of(group, tag: str) -> tuple:
        """The group's (name, size, host, mark), resolved once per object given (DTensor passes a new
        (mesh, dimension) tuple each call, of the same mesh; ranks listed anew at each call are not kept)."""
        target, dim = group if isinstance(group, tuple) and len(group) == 2 else (group, None)
        key = (id(target), dim, tag)
        found = resolved.get(key)
        if found is None or found[0] is not target:  # new, or another object at a reused address
            found = (target, groups(c10d._resolve_process_group(funcol._resolve_group_name(group, tag))))
            if not isinstance(target, list):
                resolved[key] = found
        return found[1]

    def start(args: tuple, kwargs: dict):
        group = args[at] if at < len(args) else kwargs["group"]
        tag = args[at + 1] if at + 1 < len(args) else kwargs.get("tag", "")
        name, size, host, mark = group_of(group, tag)
        tensor = args[0] if args else kwargs["self"]
        nbytes = size_of(tensor.numel() * tensor.element_size(), size)
        return session.collective(op, name, size, nbytes, SYNC, host=host), mark

    @functools.wraps(original)
    def call(*args, **kwargs):
        if getattr(_inside, "traced", False):
            return original(*args, **kwargs)
        try:
            c, mark = start(args, kwargs)
        except Exception:  # arguments the original refuses: it says so
            return original(*args, **kwargs)
        _inside.traced = True
        try:
            out = original(*args, **kwargs)
        finally:
            _inside.traced = False
        elem = getattr(out, "elem", None)  # an AsyncCollectiveTensor: waited for later
        if elem is None or getattr(out, "completed", True):
            c.end = mark()
        else:
            if len(pending) >= _MAX_PENDING:
                pending.pop(next(iter(pending)))
            # waited for through the result or a view of it (a reshape in DTensor's redistribution): its storage
            pending[elem.untyped_storage().data_ptr()] = (weakref.ref(elem), c, mark)
        return out

    call.__rankwatch__ = True  # type: ignore[attr-defined]
    return call
