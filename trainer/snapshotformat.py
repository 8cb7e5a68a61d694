"""A snapshot's format: the training state pickled with its tensors as placeholders, the tensors in one flat buffer.

Python-side state (step, schedule, data position, RNG) is pickled at once, since the next step
changes it first; the tensors are copied later, off the training thread, into one flat buffer whose
layout is worked out there too. A tensor that two names share (tied embeddings) is copied, stored
and restored once.

A checkpoint's pickles are loaded as data: the unpickler rebuilds what the checkpointer writes
(builtin containers and scalars, a module's OrderedDict, tensors' places and dtypes) and refuses any
other global a file names, without looking it up, as a damaged checkpoint. The names `_Ref` and
`_Tensor` are the files' as much as the code's: pickles name them, and a layout's digest holds
`_Ref`'s repr.
"""

import collections
import functools
import hashlib
import io
import pickle
import random
import sys
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple, Protocol

import torch

ALIGN = 64  # bytes: every tensor's offset in a buffer, so any dtype can view it


class Stateful(Protocol):
    """What is checkpointed: modules, optimizers, LR schedulers, the TokenStream."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> Any: ...


class _Ref(NamedTuple):
    """Where a tensor of the state lies in a flat buffer."""

    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    def view(self, buffer: torch.Tensor) -> torch.Tensor:
        size = self.dtype.itemsize * torch.Size(self.shape).numel()
        return buffer[self.offset : self.offset + size].view(self.dtype).view(self.shape)


class _Tensor:
    """Stands for a tensor in a pickled snapshot (torch.save's way): `_Tensor()` for the next of the
    layout, since they are unpickled in the order they were pickled, `_Tensor(index)` for one pickled
    before under another name."""


class _Pickler(pickle.Pickler):
    """Pickles a state with each tensor as a `_Tensor`: the rest is copied now, `tensors`, the live
    tensors, later. A tensor of the same values as one before it (the same address, dtype, shape,
    stride and device: a tied weight, which a state dict gives under two names) is that one's
    `_Tensor`, copied and restored once. reducer_override, unlike persistent_id, is not called for
    ints, strings, lists and dicts, and it only collects: the layout is worked out in the background."""

    def __init__(self, file: io.BytesIO):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors: list[torch.Tensor] = []
        self._at: dict[int, int] = {}  # data_ptr -> index of the first tensor there

    def reducer_override(self, obj: Any) -> tuple:
        if not isinstance(obj, torch.Tensor):
            return NotImplemented
        index = self._at.get(obj.data_ptr())
        if index is not None and _same(self.tensors[index], obj):
            return _Tensor, (index,)
        self._at.setdefault(obj.data_ptr(), len(self.tensors))
        self.tensors.append(obj)
        return _Tensor, ()  # the common case: no argument, nothing more for the pickler to memoize


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors at the same address are the same values."""
    return a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride() and a.device == b.device


def aligned(t: torch.Tensor) -> int:
    """The bytes a tensor takes in a flat buffer; their sum is the buffer's size."""
    return -(-t.nbytes // ALIGN) * ALIGN


def layout(tensors: list[torch.Tensor]) -> list[_Ref]:
    """Where each tensor goes in one flat buffer (worked out off the training thread)."""
    refs, offset = [], 0
    for t in tensors:
        refs.append(_Ref(offset, t.dtype, tuple(t.shape)))
        offset += aligned(t)
    return refs


def pickled(state: dict[str, Stateful]) -> tuple[bytes, list[torch.Tensor]]:
    """The state and the RNGs pickled now, the tensors left as placeholders, and those tensors."""
    meta = io.BytesIO()
    pickler = _Pickler(meta)
    pickler.dump({"state": {name: obj.state_dict() for name, obj in state.items()}, "rng": _rng_state()})
    return meta.getvalue(), pickler.tensors


def load_into(state: dict[str, Stateful], meta: bytes, refs: list[_Ref], buffer: torch.Tensor) -> None:
    """Load a snapshot into the state and the RNGs, each tensor a clone of its bytes (a loaded optimizer
    must not alias a ring slot), one clone for the names that shared one tensor when it was taken (tied
    weights stay tied)."""
    saved = _Unpickler(meta, lambda i: refs[i].view(buffer).clone()).load()
    for name, obj in state.items():
        obj.load_state_dict(saved["state"][name])
    _set_rng_state(saved["rng"])


def state_file(meta: bytes, refs: list[_Ref]) -> bytes:
    """What a checkpoint's state file holds: the pickled state and its layout."""
    return pickle.dumps((meta, refs))


def read_state_file(data: bytes | memoryview) -> tuple[bytes, list[_Ref]]:
    """The pickled state and its layout back from a state file, as data (UnpicklingError if it names code)."""
    return _Unpickler(data).load()


# Every global the checkpointer's pickles name, but `_Tensor`: a module's state dict, and the place and
# dtype of each tensor (the RNG states are kept as plain data for this)
_GLOBALS = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    (__name__, "_Ref"): _Ref,
    **{("torch", name): dtype for name, dtype in vars(torch).items() if isinstance(dtype, torch.dtype)},
}
# Checkpoints written before the format had a module of its own name its two classes in trainer.checkpoint
_MOVED = {("trainer.checkpoint", name): (__name__, name) for name in ("_Ref", "_Tensor")}


class _Unpickler(pickle.Unpickler):
    """A checkpoint's pickle back, as data: only `_GLOBALS` are rebuilt, and in a pickled snapshot each
    `_Tensor` is replaced by `tensor(index)` of its index in the layout, once per index (names that
    shared a tensor share one again). Any other global is refused (UnpicklingError) before it is looked
    up: a file on disk may name any code, which plain pickle.load would run."""

    def __init__(self, data: bytes | memoryview, tensor: Callable[[int], Any] | None = None):
        super().__init__(io.BytesIO(data))
        self.tensor, self.next = None if tensor is None else functools.cache(tensor), 0

    def find_class(self, module: str, name: str) -> Any:
        known = _MOVED.get((module, name), (module, name))
        if known == (__name__, "_Tensor") and self.tensor is not None:
            return self._placeholder
        if known in _GLOBALS:
            return _GLOBALS[known]
        raise pickle.UnpicklingError(f"it names {module}.{name}, which no checkpoint holds")

    def _placeholder(self, index: int | None = None) -> Any:
        assert self.tensor is not None  # find_class returns this only then
        if index is None:
            index, self.next = self.next, self.next + 1
        return self.tensor(index)


def _named(obj: Any, name: str = "") -> Iterator[str]:
    """'name dtype shape' of each tensor (or `_Ref`) in a state dict, by its path in it."""
    if isinstance(obj, (torch.Tensor, _Ref)):
        yield f"{name} {obj.dtype} {tuple(obj.shape)}"
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from _named(value, f"{name}.{key}")
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from _named(value, f"{name}.{i}")


def _digest(lines: Any) -> str:
    return hashlib.blake2b("\n".join(map(str, lines)).encode(), digest_size=16).hexdigest()


def objects(state: dict[str, Any]) -> dict[str, str | None]:
    """Per object of a state, a digest of its tensors' names, dtypes and shapes; None for one that holds
    none (an optimizer before its first step: what it will hold is not known yet)."""
    return {name: _digest(names) if (names := list(_named(obj))) else None for name, obj in state.items()}


def fingerprint(meta: bytes, refs: list[_Ref], replicas: int) -> dict:
    """A snapshot's layout, for its manifest: the replicas that share its tensors, a digest of where each
    lies in the flat buffer, and `objects` of its state."""
    skeleton = _Unpickler(meta, refs.__getitem__).load()  # the refs in place of the tensors
    return {"replicas": replicas, "tensors": _digest(refs), "objects": objects(skeleton["state"])}


def _rng_state() -> dict:
    """The RNG states, as bytes rather than tensors: they differ between replicas, whose tensors are shared."""
    state = {"python": random.getstate(), "torch": torch.get_rng_state().numpy().tobytes()}
    if torch.cuda.is_available():  # this rank's device only: the others are other ranks'
        state["cuda"] = torch.cuda.get_rng_state().numpy().tobytes()
    if "numpy" in sys.modules:  # (name, key, pos, has_gauss, gauss) with the key as a list, not an array
        name, key, *rest = sys.modules["numpy"].random.get_state()
        state["numpy"] = (name, key.tolist(), *rest)
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(torch.frombuffer(bytearray(state["torch"]), dtype=torch.uint8))
    if "cuda" in state:
        torch.cuda.set_rng_state(torch.frombuffer(bytearray(state["cuda"]), dtype=torch.uint8))
    if "numpy" in state:
        import numpy

        numpy.random.set_state(state["numpy"])
