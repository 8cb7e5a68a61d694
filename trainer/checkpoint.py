"""Lazy, asynchronous, multi-level checkpoints of the training state (after DataStates-LLM).

Parameters and optimizer state change only inside `optimizer.step()`, so a
snapshot taken right after one can be copied while the next forward and
backward run: a background thread copies the tensors into host buffers. The
loop waits only in `wait_until_safe()`, called right before the next
`optimizer.step()`, and only if the copy has not finished; on CUDA not even
the host waits: the copies are queued on a side stream into one pinned
staging buffer, and the training stream waits for them on the GPU; the
copier thread then moves the bytes from the staging buffer into the ring's
slot, which is ordinary memory. Pinning (cudaHostRegister) takes about half a
second a GB and stalls every CUDA call of the process while it runs (an
H200's GPT-2 job lost 10 s at its first snapshots pinning a ring of 22), so
only the staging buffer is pinned, once; the ring grows at no such cost.
Python-side state (step,
schedule, data position, RNG) is pickled at once, since the next step
changes it first. A tensor that two names share (tied embeddings) is copied,
stored and restored once.

Two tiers. The last K snapshots stay in a ring of host buffers for an instant
rollback; the buffers are made in the background, one at a time, and reused,
and a snapshot that finds none ready is skipped (and counted) rather than
waited for. Every M steps one of them goes to disk through a background
writer: each file is written under a temporary name, fsync'd and renamed,
then a manifest with the files' blake2b checksums and the state's layout is
written and renamed last; a snapshot that finds the writer busy replaces the
one still waiting for it. Data-parallel replicas hold the same tensors, so
each writes only its share of them. Listing checkpoints reads manifests only;
the one about to be loaded is read in full and checked: a checkpoint whose
manifest is missing or does not match its files, or whose layout is not the
live state's or its replicas', is partial, damaged or another's, and is
reported and never loaded. A checkpoint's pickles are loaded as data: the
unpickler rebuilds what the checkpointer writes (builtin containers and
scalars, a module's OrderedDict, tensors' places and dtypes) and refuses any
other global a file names, without looking it up, as a damaged checkpoint.

`restore(step)` loads the newest snapshot at or before `step` that every
replica has, from memory unless only the disk has it; the snapshots after it
belong to a future that will not happen and are dropped from both tiers.
"""

import collections
import ctypes
import functools
import hashlib
import io
import json
import logging
import mmap
import os
import pickle
import queue
import random
import shutil
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import torch

from rankwatch import agent
from rankwatch.agent import semconv as sc

log = logging.getLogger(__name__)

MANIFEST, TENSORS, META = "manifest.json", "tensors.bin", "state.pkl"
_ALIGN = 64  # bytes: every tensor's offset in a buffer, so any dtype can view it
_CHUNK = 64 << 20  # bytes per write, read and hash call


class Stateful(Protocol):
    """What is checkpointed: modules, optimizers, LR schedulers, the TokenStream."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> Any: ...


class NoCheckpoint(LookupError):
    """No snapshot at or before the step asked for, in memory or on disk."""


class _Corrupt(Exception):
    """A checkpoint on disk that must not be loaded; the message says why."""


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


def _aligned(t: torch.Tensor) -> int:
    """The bytes a tensor takes in a flat buffer; their sum is the buffer's size."""
    return -(-t.nbytes // _ALIGN) * _ALIGN


def _layout(tensors: list[torch.Tensor]) -> list[_Ref]:
    """Where each tensor goes in one flat buffer (worked out off the training thread)."""
    refs, offset = [], 0
    for t in tensors:
        refs.append(_Ref(offset, t.dtype, tuple(t.shape)))
        offset += _aligned(t)
    return refs


# Every global the checkpointer's pickles name, but `_Tensor`: a module's state dict, and the place and
# dtype of each tensor (the RNG states are kept as plain data for this)
_GLOBALS = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    (__name__, "_Ref"): _Ref,
    **{("torch", name): dtype for name, dtype in vars(torch).items() if isinstance(dtype, torch.dtype)},
}


class _Unpickler(pickle.Unpickler):
    """A checkpoint's pickle back, as data: only `_GLOBALS` are rebuilt, and in a pickled snapshot each
    `_Tensor` is replaced by `tensor(index)` of its index in the layout, once per index (names that
    shared a tensor share one again). Any other global is refused (UnpicklingError) before it is looked
    up: a file on disk may name any code, which plain pickle.load would run."""

    def __init__(self, data: bytes | memoryview, tensor: Callable[[int], Any] | None = None):
        super().__init__(io.BytesIO(data))
        self.tensor, self.next = None if tensor is None else functools.cache(tensor), 0

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == (__name__, "_Tensor") and self.tensor is not None:
            return self._placeholder
        if (module, name) in _GLOBALS:
            return _GLOBALS[module, name]
        raise pickle.UnpicklingError(f"it names {module}.{name}, which no checkpoint holds")

    def _placeholder(self, index: int | None = None) -> Any:
        assert self.tensor is not None  # find_class returns this only then
        if index is None:
            index, self.next = self.next, self.next + 1
        return self.tensor(index)


def _unpickle(meta: bytes, refs: list[_Ref], buffer: torch.Tensor) -> dict:
    """The state of a snapshot, each tensor a clone of its bytes (a loaded optimizer must not alias a ring
    slot), one clone for the names that shared one tensor when it was taken (tied weights stay tied)."""
    return _Unpickler(meta, lambda i: refs[i].view(buffer).clone()).load()


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


def _objects(state: dict[str, Any]) -> dict[str, str | None]:
    """Per object of a state, a digest of its tensors' names, dtypes and shapes; None for one that holds
    none (an optimizer before its first step: what it will hold is not known yet)."""
    return {name: _digest(names) if (names := list(_named(obj))) else None for name, obj in state.items()}


def _fingerprint(meta: bytes, refs: list[_Ref], replicas: int) -> dict:
    """A snapshot's layout, for its manifest: the replicas that share its tensors, a digest of where each
    lies in the flat buffer, and `_objects` of its state."""
    skeleton = _Unpickler(meta, refs.__getitem__).load()  # the refs in place of the tensors
    return {"replicas": replicas, "tensors": _digest(refs), "objects": _objects(skeleton["state"])}


def _memory(buffer: torch.Tensor) -> memoryview:
    """The bytes of a CPU uint8 tensor, not copied: files are written, hashed and read in place."""
    return memoryview((ctypes.c_ubyte * buffer.numel()).from_address(buffer.data_ptr())).cast("B")


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


def _share(nbytes: int, index: int, count: int) -> tuple[int, int]:
    """The bytes [lo, hi) of a flat buffer of `nbytes` that replica `index` of `count` writes."""
    per = -(-nbytes // (count * _ALIGN)) * _ALIGN
    return min(index * per, nbytes), min((index + 1) * per, nbytes)


def _slot_bytes(nbytes: int) -> int:
    """The bytes of a ring slot for `nbytes` of tensors: whole pages, what pinning takes."""
    return max(-(-nbytes // mmap.PAGESIZE), 1) * mmap.PAGESIZE


def _host_buffer(nbytes: int, pinned: bool) -> torch.Tensor:
    """A buffer of exactly `nbytes`, made on the allocator thread. Ordinary memory for a ring slot, its
    pages touched now rather than by the first copy into it (which took 0.83 s for GPT-2's 1.5 GB on an
    H200's host, where a snapshot came every 0.35 s). Pinned for the staging buffer, so that a
    device-to-host copy into it is asynchronous: ordinary memory registered with the driver
    (cudaHostRegister; measured on an H200) and unregistered once freed, rather than pin_memory=True,
    whose caching host allocator rounds every buffer up to a power of two (1.5 GB takes 2 GB)."""
    storage = torch.UntypedStorage(nbytes)
    buffer = torch.empty(0, dtype=torch.uint8).set_(storage)
    if not pinned:
        buffer.zero_()
    else:
        cudart = torch.cuda.cudart()
        if error := int(cudart.cudaHostRegister(storage.data_ptr(), nbytes, 0)):
            raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed: cudaError {error}")
        weakref.finalize(storage, cudart.cudaHostUnregister, storage.data_ptr())  # with the last view
    return buffer


def _fsync_dir(path: Path) -> None:
    """Make the names created or renamed in a directory durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durably(path: Path, data: memoryview) -> dict:
    """Write under a temporary name, fsync, rename: `path` is absent or complete. Returns its manifest entry."""
    digest, tmp = hashlib.blake2b(), path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        for i in range(0, len(data), _CHUNK):
            digest.update(data[i : i + _CHUNK])
            f.write(data[i : i + _CHUNK])
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return {"bytes": len(data), "blake2b": digest.hexdigest()}


def _manifest(path: Path, step: int) -> dict:
    """A checkpoint directory's manifest, checked against the sizes of its files: metadata only, no data read."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        files = {
            name: (int(manifest["files"][name]["bytes"]), str(manifest["files"][name]["blake2b"]))
            for name in (META, TENSORS)
        }
        share, nbytes = (int(manifest["share"][0]), int(manifest["share"][1])), int(manifest["tensor_bytes"])
        layout = manifest["layout"]
        layout = {
            "replicas": int(layout["replicas"]),
            "tensors": str(layout["tensors"]),
            "objects": dict(layout["objects"]),
        }
        if manifest["step"] != step:
            raise _Corrupt(f"the manifest is of step {manifest['step']}")
    except FileNotFoundError:
        raise _Corrupt("no manifest (a partial checkpoint)") from None
    except (ValueError, KeyError, TypeError, IndexError) as e:
        raise _Corrupt(f"unreadable manifest ({e!r})") from None
    for name, (size, _) in files.items():
        if not (path / name).is_file():
            raise _Corrupt(f"{name} is missing")
        if (path / name).stat().st_size != size:
            raise _Corrupt(f"{name} has {(path / name).stat().st_size} bytes, the manifest says {size}")
    return {"files": files, "share": share, "tensor_bytes": nbytes, "layout": layout}


def _read_verified(path: Path, into: memoryview, expected_digest: str) -> None:
    """Read a file whose size its manifest vouched for into `into`, checked against its checksum."""
    digest = hashlib.blake2b()
    with open(path, "rb") as f:
        for i in range(0, len(into), _CHUNK):
            chunk = into[i : i + _CHUNK]
            if f.readinto(chunk) != len(chunk):
                raise _Corrupt(f"{path.name} ended early")
            digest.update(chunk)
    if digest.hexdigest() != expected_digest:
        raise _Corrupt(f"{path.name} does not match its checksum")


def _read_checkpoint(
    paths: list[Path], own: int, step: int, live: dict[str, str | None]
) -> tuple[bytes, list[_Ref], torch.Tensor]:
    """(pickled state, layout, tensor buffer) of a checkpoint: this replica's state from `paths[own]`,
    the tensors from the shares of every replica's directory, each verified against its manifest.
    Before any data is read, its layout must be that of the live state (`live`, its `_objects`) and
    of every replica: a shard of other tensors (FSDP, TP, ZeRO) passes its checksums, and must not be
    spliced in."""
    manifests = []
    for i, path in enumerate(paths):
        try:
            manifests.append(_manifest(path, step))
        except _Corrupt as e:
            raise _Corrupt(str(e) if i == own else f"replica {path.parent.name}: {e}") from None
    layout = manifests[own]["layout"]
    if layout["replicas"] != len(paths):
        raise _Corrupt(f"written by a group of {layout['replicas']} replicas, loaded by one of {len(paths)}")
    for name, digest in live.items():
        if digest is not None and layout["objects"].get(name) != digest:
            raise _Corrupt(f"its {name} is not the live one's layout (other tensor names, dtypes or shapes)")
    for path, manifest in zip(paths, manifests, strict=True):
        if manifest["layout"] != layout:
            raise _Corrupt(f"replica {path.parent.name}: its layout is not this replica's (a shard of other tensors?)")
    size, digest = manifests[own]["files"][META]
    state = torch.empty(max(size, 1), dtype=torch.uint8)  # held while its memory is read
    _read_verified(paths[own] / META, _memory(state)[:size], digest)
    try:
        meta, refs = _Unpickler(_memory(state)[:size]).load()
        written = _fingerprint(meta, refs, len(paths))
    except Exception as e:  # bytes that match their checksum yet are no checkpoint's state: any of a dozen types
        raise _Corrupt(f"{META} is not a checkpoint's state ({e})") from None
    if written != layout:
        raise _Corrupt(f"{META} is not the state its manifest describes")
    nbytes = manifests[own]["tensor_bytes"]
    buffer = torch.empty(max(nbytes, _ALIGN), dtype=torch.uint8)
    for i, (path, manifest) in enumerate(zip(paths, manifests, strict=True)):
        where = "" if i == own else f"replica {path.parent.name}: "
        lo, hi = _share(nbytes, i, len(paths))
        if manifest["tensor_bytes"] != nbytes or manifest["share"] != (lo, hi):
            raise _Corrupt(f"{where}its share is not bytes {lo} to {hi} of {nbytes}")
        try:
            _read_verified(path / TENSORS, _memory(buffer)[lo:hi], manifest["files"][TENSORS][1])
        except _Corrupt as e:
            raise _Corrupt(f"{where}{e}") from None
    return meta, refs, buffer


def _remove(path: Path) -> None:
    """Remove a checkpoint directory, its manifest first: no longer a checkpoint even if this stops half-way."""
    (path / MANIFEST).unlink(missing_ok=True)
    shutil.rmtree(path)


@dataclass(eq=False)
class _Snapshot:
    """A ring slot: a host buffer, reused, and the snapshot it holds (`step` -1: none)."""

    buffer: torch.Tensor  # made by the allocator thread, off the training thread
    step: int = -1
    meta: bytes = b""  # the state pickled, tensors as `_Tensor`s
    refs: list[_Ref] = field(default_factory=list)  # where they lie in `buffer` (the copier sets them)
    nbytes: int = 0
    views: list[torch.Tensor] = field(default_factory=list)  # of `buffer`, one per ref
    started: float = 0.0  # perf_counter at snapshot()
    blocked_s: float = 0.0
    issued: threading.Event = field(default_factory=threading.Event)  # CPU: copied; CUDA: queued on the side stream
    done: Any = None  # CUDA: the event the side stream records after the copy into the staging buffer
    landed: threading.Event = field(default_factory=threading.Event)  # the bytes are in `buffer`
    error: BaseException | None = None
    flushing: bool = False  # the writer reads it, or is to: not to be reused until it is done

    def __post_init__(self) -> None:
        self.issued.set()  # no copy in flight
        self.landed.set()

    def copied(self) -> bool:
        """Whether the bytes are in `buffer` (or the copy failed), without waiting."""
        return self.landed.is_set()

    def wait_copied(self) -> None:
        self.landed.wait()


def _alone(step: int) -> int:
    """`agree` for a replica alone: its own value."""
    return step


class Checkpointer:
    """Snapshots of `state` (named objects with state_dict/load_state_dict; RNG states are added):
    the last `memory` in host memory, every `disk_every` steps one on disk in `directory`, the
    newest `keep` of them kept. Call `snapshot(step)` after an optimizer step (`step`: steps
    done) and `wait_until_safe()` right before the next one; `close()` at the end.

    `replicas` is the replicate group: the checkpoint directories of the ranks that hold the same
    tensors as this one, `directory` among them, in the same order on each (a DDP job: every rank;
    under FSDP, TP or ZeRO only the ranks holding this rank's shards, never the others). Each
    replica writes its share of the tensors (and its own Python and RNG state), and a load reads all
    the shares. `agree` is a collective over the ranks returning the lowest of the values passed (a
    replica alone: itself), so that every rank restores the same step.

    The ring's buffers take at most `host_limit` bytes (None: no bound); on CUDA one more buffer of a
    snapshot's size is pinned, for staging."""

    def __init__(
        self,
        directory: Path,
        state: dict[str, Stateful],
        memory: int = 4,
        disk_every: int = 100,
        keep: int = 2,
        replicas: list[Path] | None = None,
        agree: Callable[[int], int] = _alone,
        host_limit: int | None = None,
    ):
        if min(memory, disk_every, keep) < 1:
            raise ValueError("memory, disk_every and keep must be at least 1")
        self.directory, self.state = Path(directory), state
        self.memory, self.disk_every, self.keep, self._agree = memory, disk_every, keep, agree
        self.host_limit = host_limit
        self._replicas = [Path(p) for p in replicas] if replicas else [self.directory]
        self._own = self._replicas.index(self.directory)
        self._device = torch.cuda.current_device() if torch.cuda.is_available() else None
        # Shared with the threads, under `_changed`. `_slots` holds the slots whose buffer is ready, replaced
        # (never changed in place) so that it can be read without the lock.
        self._changed = threading.Condition()
        self._slots: list[_Snapshot] = []
        self._nbytes: int | None = None  # the tensor bytes of the newest snapshot: the allocator's size
        self._retired: list[_Snapshot] = []  # slots too small for the state, to be freed by the allocator
        self._staging: torch.Tensor | None = None  # CUDA: pinned, what the side stream copies into
        self._staging_views: tuple[list[_Ref], list[torch.Tensor]] = ([], [])
        self._staging_free = threading.Event()  # no snapshot on its way through the staging buffer
        self._staging_free.set()
        self._staging_refused = 0  # the size a staging buffer could not be made for
        self._to_write: _Snapshot | None = None  # waiting for the writer; a newer one replaces it
        self._writing: _Snapshot | None = None
        self._writing_step = -1  # the step being written (its slot's may change meanwhile: a restore)
        self._doomed = False  # the write in progress is of a future a restore dropped: removed once done
        self._closing = False
        self._in_flight: _Snapshot | None = None
        self._unreported: list[_Snapshot] = []  # copies started whose end the loop has not acted on yet
        self._skipped = 0  # snapshots and disk writes skipped so far
        self._copies: queue.Queue = queue.Queue()
        self._threads = [
            threading.Thread(target=self._copy_loop, name="checkpoint-copier", daemon=True),
            threading.Thread(target=self._write_loop, name="checkpoint-writer", daemon=True),
            threading.Thread(target=self._allocate_loop, name="checkpoint-allocator", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    # -- the training loop's side ------------------------------------------------------------------
    def snapshot(self, step: int) -> None:
        """Start a snapshot of the state as it is now; the tensors are copied in the background. Skipped
        (a `checkpoint_skipped` event) when no slot of the ring is ready: never a wait for its buffers."""
        self.wait_until_safe()
        started = time.perf_counter()
        meta, tensors = self._pickled()
        nbytes = sum(map(_aligned, tensors))
        slot = self._free_slot(nbytes)
        if slot is None or not self._staged(nbytes):
            if slot is not None:
                busy = "its staging buffer is being allocated or still holds the last snapshot"
            elif self._ready(nbytes):
                busy = "the ring's buffers are being copied into or written"
            else:
                busy = "the ring's buffers are being allocated"
            self._skip(step, sc.TIER_MEMORY, busy)
            return
        slot.step, slot.meta, slot.nbytes, slot.started, slot.error = step, meta, nbytes, started, None
        slot.issued.clear()
        slot.landed.clear()
        if self._device is not None:
            self._staging_free.clear()
        updated = None
        if self._device is not None:  # the side stream starts copying once the optimizer step is done
            updated = torch.cuda.Event()
            updated.record()
        self._in_flight = slot
        self._unreported.append(slot)
        slot.blocked_s = time.perf_counter() - started
        self._copies.put((slot, tensors, updated))

    def wait_until_safe(self) -> None:
        """Return once the snapshot in flight no longer needs the live tensors: before optimizer.step().
        On CUDA the training stream is made to wait for the copy, on the GPU: this thread does not."""
        slot, self._in_flight = self._in_flight, None
        if slot is not None:
            started = time.perf_counter()
            slot.issued.wait()  # a copy into a buffer that is ready: never an allocation
            if slot.done is not None and slot.error is None:
                torch.cuda.current_stream().wait_event(slot.done)
            slot.blocked_s += time.perf_counter() - started
        self._report_copied()

    def reserve(self, wait: bool = False) -> None:
        """Have the ring allocated for the state as it is now, in the background; with `wait`, before
        returning: for a caller that would rather wait once, before it trains or times (a benchmark, a
        test), than have the first snapshots skipped while the buffers are made."""
        nbytes = sum(map(_aligned, self._pickled()[1]))
        self._free_slot(nbytes)  # tells the allocator the size
        if wait:
            with self._changed:
                self._changed.wait_for(lambda: self._ready(nbytes) >= self.memory)

    @property
    def snapshot_bytes(self) -> int:
        """The host memory a slot of the ring takes, as allocated (0 before the first is)."""
        return max((s.buffer.numel() for s in self._slots), default=0)

    def grow(self, memory: int) -> None:
        """Keep at least `memory` snapshots in host memory from now on, as many as `host_limit` holds
        (the ring only grows); the new slots are allocated in the background, one at a time."""
        if self.host_limit is not None and self.snapshot_bytes:
            memory = min(memory, self.host_limit // self.snapshot_bytes)
        with self._changed:
            self.memory = max(self.memory, memory)
            self._changed.notify_all()

    def restore(self, step_at_most: int) -> int:
        """Load the newest snapshot with step <= `step_at_most` that every replica has into the state,
        from memory unless only the disk has it; returns its step. Raises NoCheckpoint when there is none."""
        self._settle(keep_through=step_at_most)
        target = self._agree(step_at_most)  # a barrier too: no replica is writing what it may load
        while True:
            step = self._agree(self._newest(target))
            if step < 0:
                raise NoCheckpoint(f"no snapshot of step {step_at_most} or before in memory or in {self.directory}")
            tier = self._load(step)
            if self._agree(int(tier is not None)):
                break
            target = step - 1  # one replica's copy of it does not verify: every replica goes further back
        if min((s.step for s in self._slots), default=-1) > step_at_most:
            log.warning(
                "checkpoint: all %d snapshots in memory are newer than step %d: keep more (--ckpt-memory) "
                "for an instant rollback",
                len(self._slots),
                step_at_most,
            )
        for s in self._slots:
            if s.step > step:
                s.step = -1
        for later, path in self._on_disk().items():
            if later > step:
                _remove(path)
        log.info("checkpoint: restored step %d from %s", step, tier)
        agent.event(sc.EVENT_CHECKPOINT_RESTORED, step, **{sc.CKPT_TIER: tier})
        return step

    def make_durable(self, step: int) -> None:
        """Have the snapshot of `step` on disk before returning: written now from memory unless the
        disk has it already (a job about to stop leaves a checkpoint to resume from)."""
        if step in self.durable_steps():
            return
        slot = next((s for s in self._slots if s.step == step), None)
        if slot is None:
            raise NoCheckpoint(f"no snapshot of step {step} in memory")
        self._flush(slot)
        self._wait_for_writer()

    def durable_steps(self) -> list[int]:
        """The steps of the checkpoints on disk whose manifests (every replica's) vouch for them, oldest
        first; the others are reported. Only manifests and file sizes are read: the data is verified
        when it is loaded."""
        self._settle()
        steps = []
        for step in sorted(self._on_disk()):
            try:
                self._manifests(step)
                steps.append(step)
            except _Corrupt as e:
                self._report(self.directory / f"step-{step:08d}", step, str(e))
        return steps

    def close(self) -> None:
        """Finish the snapshot in flight and the disk writes it asks for, then stop the threads."""
        self._settle()
        with self._changed:
            self._closing = True
            self._changed.notify_all()
        self._copies.put(None)
        for thread in self._threads:
            thread.join()

    # -- memory tier ---------------------------------------------------------------------------------
    def _pickled(self) -> tuple[bytes, list[torch.Tensor]]:
        """The state pickled now, its tensors left as placeholders, and those tensors."""
        meta = io.BytesIO()
        pickler = _Pickler(meta)
        pickler.dump({"state": {name: obj.state_dict() for name, obj in self.state.items()}, "rng": _rng_state()})
        return meta.getvalue(), pickler.tensors

    def _settle(self, keep_through: int | None = None) -> None:
        """Wait for every copy started and every disk write asked for (restore, listing and close need still
        tiers). With `keep_through` (a restore to that step or before), a write of a later step is not waited
        for: one not started is dropped, and one under way is removed once done. A rollback waited seconds
        for the disk to take the 1.5 GB of the very step it rolled back (an H200's GPT-2 job)."""
        self.wait_until_safe()
        self._report_copied(wait=True)
        with self._changed:
            if keep_through is not None:
                queued = self._to_write
                if queued is not None and queued.step > keep_through:
                    queued.flushing, self._to_write = False, None
                self._doomed = self._writing is not None and self._writing_step > keep_through
            self._changed.wait_for(lambda: self._to_write is None and (self._writing is None or self._doomed))

    def _report_copied(self, wait: bool = False) -> None:
        """For each copy that has ended (or every one, waiting, with `wait`), in order: its event, and
        the disk write every `disk_every` steps; a copy that failed raises here, on the training thread."""
        while self._unreported and (wait or self._unreported[0].copied()):
            slot = self._unreported.pop(0)
            slot.wait_copied()
            if slot.error:
                step, slot.step = slot.step, -1
                raise RuntimeError(f"snapshot of step {step} failed") from slot.error
            agent.event(
                sc.EVENT_CHECKPOINT_SAVED,
                slot.step,
                **{
                    sc.CKPT_TIER: sc.TIER_MEMORY,
                    sc.CKPT_BYTES: slot.nbytes + len(slot.meta),
                    sc.CKPT_BLOCKED_S: slot.blocked_s,
                    sc.CKPT_DURABLE_S: time.perf_counter() - slot.started,  # when the loop saw it done
                },
            )
            if slot.step % self.disk_every == 0:
                self._flush(slot)

    def _free_slot(self, nbytes: int) -> _Snapshot | None:
        """The oldest ready slot of at least `nbytes` that no copy and no disk write is using, without
        waiting: None if there is none. The allocator is told the size; a free slot too small for it
        (the state grew) is retired, its snapshot with it, and replaced in the background."""
        self._report_copied()
        with self._changed:
            free = [s for s in self._slots if not s.flushing and s not in self._unreported]
            small = [s for s in free if s.buffer.numel() < nbytes]
            if small:
                self._slots = [s for s in self._slots if s not in small]
                self._retired += small
            self._nbytes = nbytes
            self._changed.notify_all()
        return min((s for s in free if s not in small), key=lambda s: s.step, default=None)

    def _ready(self, nbytes: int) -> int:
        """How many slots of the ring hold `nbytes`."""
        return sum(s.buffer.numel() >= nbytes for s in self._slots)

    def _staged(self, nbytes: int) -> bool:
        """Whether a snapshot of `nbytes` can go through the staging buffer now (CPU: it needs none)."""
        staging = self._staging
        return self._device is None or (
            staging is not None and staging.numel() >= nbytes and self._staging_free.is_set()
        )

    def _skip(self, step: int, tier: str, why: str) -> None:
        self._skipped += 1
        log.info("checkpoint: step %d not kept in %s: %s", step, tier, why)
        agent.event(
            sc.EVENT_CHECKPOINT_SKIPPED, step, **{sc.CKPT_TIER: tier, sc.CKPT_WHY: why, sc.CKPT_SKIPPED: self._skipped}
        )

    def _allocate_loop(self) -> None:
        """Makes the staging buffer (CUDA), then the ring's buffers, one at a time, off the training
        thread: a slot joins the ring when its buffer is ready. Frees the retired ones."""
        if self._device is not None:
            torch.cuda.set_device(self._device)  # per thread
        while True:
            with self._changed:
                self._changed.wait_for(
                    lambda: self._closing or bool(self._retired) or self._short() or self._unstaged()
                )
                if self._closing:
                    return
                retired, self._retired = self._retired, []
                nbytes, staging = self._nbytes, self._unstaged()
                if not (staging or self._short()):
                    nbytes = None
            retired.clear()  # their buffers freed here: off the training thread, and the lock
            if nbytes is not None and staging:
                self._add_staging(nbytes)
            elif nbytes is not None:
                self._add_slot(nbytes)

    def _short(self) -> bool:
        return self._nbytes is not None and self._ready(self._nbytes) < self.memory

    def _unstaged(self) -> bool:
        """On CUDA, whether the staging buffer is missing or too small for the state (and free to replace)."""
        staging = self._staging
        return (
            self._device is not None
            and self._nbytes is not None
            and (staging is None or staging.numel() < self._nbytes)
            and self._staging_free.is_set()
            and self._staging_refused != self._nbytes
        )

    def _add_staging(self, nbytes: int) -> None:
        """The pinned staging buffer for `nbytes`: the one pinning of the checkpointer's."""
        try:
            staging = _host_buffer(_slot_bytes(nbytes), pinned=True)
        except (RuntimeError, MemoryError) as e:  # not asked again for this size: every snapshot is skipped, counted
            log.warning("checkpoint: no snapshot kept in memory: its pinned staging buffer could not be made (%s)", e)
            with self._changed:
                self._staging_refused = nbytes
            return
        with self._changed:
            self._staging, self._staging_views = staging, ([], [])
            self._changed.notify_all()

    def _add_slot(self, nbytes: int) -> None:
        """A slot for `nbytes` into the ring, unless its buffer cannot be made or would pass `host_limit`."""
        try:
            buffer = _host_buffer(_slot_bytes(nbytes), pinned=False)
        except (RuntimeError, MemoryError) as e:
            self._stop_growing(nbytes, f"its buffer could not be allocated ({e})")
            return
        with self._changed:
            held = sum(s.buffer.numel() for s in self._slots)
            if self.host_limit is None or held + buffer.numel() <= self.host_limit:
                self._slots = [*self._slots, _Snapshot(buffer)]
                self._changed.notify_all()
                return
        self._stop_growing(nbytes, f"it would take the ring past its host limit of {self.host_limit} bytes")
        # the buffer is freed on return, outside the lock

    def _stop_growing(self, nbytes: int, why: str) -> None:
        """The ring holds what it has (and says so) until grow() asks for more."""
        with self._changed:
            log.warning("checkpoint: the ring holds %d snapshots, not %d: %s", self._ready(nbytes), self.memory, why)
            self.memory = self._ready(nbytes)
            self._changed.notify_all()

    def _copy_loop(self) -> None:
        """Copies each snapshot's tensors into its slot. On CUDA it queues them on a side stream into the
        staging buffer (the training loop goes on once they are queued), then waits for that copy here and
        moves the bytes into the slot."""
        stream = None
        if self._device is not None:
            torch.cuda.set_device(self._device)  # per thread
            stream = torch.cuda.Stream()
        while (job := self._copies.get()) is not None:
            slot, tensors, updated = job
            try:
                if stream is None:
                    self._copy(slot, tensors)
                else:
                    self._stage(slot, tensors, updated, stream)
            except Exception as e:  # reported to the training loop by _report_copied
                slot.error = e
            slot.issued.set()
            try:
                if stream is not None and slot.error is None:
                    slot.done.synchronize()
                    slot.buffer[: slot.nbytes].copy_(self._staging_slice(slot.nbytes))  # lets go of the GIL
            except Exception as e:
                slot.error = e
            finally:
                slot.landed.set()
                self._staging_free.set()

    @staticmethod
    def _copy(slot: _Snapshot, tensors: list[torch.Tensor]) -> None:
        refs = _layout(tensors)
        if slot.refs != refs:  # views made once per slot and layout
            slot.refs, slot.views = refs, [ref.view(slot.buffer) for ref in refs]
        with torch.no_grad():
            torch._foreach_copy_(slot.views, tensors)  # one call

    def _stage(self, slot: _Snapshot, tensors: list[torch.Tensor], updated, stream) -> None:
        """Queue the copy of `tensors` into the staging buffer on `stream`, after `updated`; `slot.done`
        marks its end."""
        refs = _layout(tensors)
        staging = self._staging
        assert staging is not None  # a snapshot goes through it once it is there (_staged)
        if self._staging_views[0] != refs:  # views made once per layout
            self._staging_views = (refs, [ref.view(staging) for ref in refs])
        slot.refs = refs
        with torch.no_grad(), torch.cuda.stream(stream):
            stream.wait_event(updated)  # after the optimizer step that made this state
            torch._foreach_copy_(self._staging_views[1], tensors, non_blocking=True)  # pinned: asynchronous
            for t in tensors:
                if t.is_cuda:  # a tensor the state dict made afresh must outlive the copy
                    t.record_stream(stream)
            if slot.done is None:
                slot.done = torch.cuda.Event(blocking=True)  # waited for by the copier without spinning
            slot.done.record(stream)

    def _staging_slice(self, nbytes: int) -> torch.Tensor:
        staging = self._staging
        assert staging is not None
        return staging[:nbytes]

    # -- disk tier -----------------------------------------------------------------------------------
    def _flush(self, slot: _Snapshot) -> None:
        """Have the writer put `slot` on disk next. It replaces a snapshot still waiting for the writer
        (skipped, and counted): a disk slower than the snapshots holds two slots at most, and never the
        training loop."""
        with self._changed:
            superseded, self._to_write = self._to_write, slot
            if superseded is not None and superseded is not slot:
                superseded.flushing = False
            slot.flushing = True
            self._changed.notify_all()
        if superseded is not None and superseded is not slot:
            self._skip(superseded.step, sc.TIER_DISK, f"the writer was busy: step {slot.step} is written instead")

    def _wait_for_writer(self) -> None:
        with self._changed:
            self._changed.wait_for(lambda: self._to_write is None and self._writing is None)

    def _write_loop(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._to_write is not None or self._closing)
                slot, self._to_write, self._writing = self._to_write, None, self._to_write
                if slot is not None:
                    self._writing_step, self._doomed = slot.step, False
            if slot is None:
                return
            step = self._writing_step
            try:
                self._write(slot, step)
            except Exception:
                log.exception("checkpoint: step %d not written to %s", step, self.directory)
            finally:
                path = self.directory / f"step-{step:08d}"
                with self._changed:
                    if self._doomed and path.exists():
                        _remove(path)  # under the lock: no listing sees it half gone
                    slot.flushing, self._writing, self._writing_step, self._doomed = False, None, -1, False
                    self._changed.notify_all()

    def _write(self, slot: _Snapshot, step: int) -> None:
        """Files first, each complete under its name, then the manifest that vouches for them; then prune.
        The tensors file holds this replica's share of the tensors."""
        path, started = self.directory / f"step-{step:08d}", time.perf_counter()
        path.mkdir(parents=True, exist_ok=True)
        _fsync_dir(path.parent)
        (path / MANIFEST).unlink(missing_ok=True)  # a rewrite: the old manifest must not vouch for new files
        lo, hi = _share(slot.nbytes, self._own, len(self._replicas))
        files = {
            META: _write_durably(path / META, memoryview(pickle.dumps((slot.meta, slot.refs)))),
            TENSORS: _write_durably(path / TENSORS, _memory(slot.buffer)[lo:hi]),
        }
        _fsync_dir(path)
        _write_durably(
            path / MANIFEST,
            memoryview(
                json.dumps(
                    {
                        "step": step,
                        "files": files,
                        "share": [lo, hi],
                        "tensor_bytes": slot.nbytes,
                        "layout": _fingerprint(slot.meta, slot.refs, len(self._replicas)),
                    }
                ).encode()
            ),
        )
        _fsync_dir(path)
        durable_s = time.perf_counter() - slot.started
        log.info("checkpoint: step %d durable in %s, %.3f s after its snapshot", step, path, durable_s)
        agent.event(
            sc.EVENT_CHECKPOINT_SAVED,
            step,
            **{
                sc.CKPT_TIER: sc.TIER_DISK,
                sc.CKPT_BYTES: hi - lo + files[META]["bytes"],
                sc.CKPT_BLOCKED_S: slot.blocked_s,
                sc.CKPT_DURABLE_S: durable_s,
                sc.CKPT_WRITE_S: time.perf_counter() - started,
            },
        )
        complete = [p for _, p in sorted(self._on_disk().items()) if (p / MANIFEST).exists()]
        for old in set(self._on_disk().values()) - set(complete[-self.keep :]):
            _remove(old)

    def _on_disk(self) -> dict[int, Path]:
        """step -> directory of every checkpoint of this replica on disk, complete or not, but for one being
        written that a restore dropped."""
        if not self.directory.is_dir():
            return {}
        doomed = self._writing_step if self._doomed else None
        return {
            int(p.name[5:]): p
            for p in self.directory.glob("step-*")
            if p.name[5:].isdigit() and int(p.name[5:]) != doomed
        }

    def _manifests(self, step: int) -> None:
        """Raise _Corrupt unless every replica's manifest of `step` vouches for its files (metadata only)."""
        for i, replica in enumerate(self._replicas):
            try:
                _manifest(replica / f"step-{step:08d}", step)
            except _Corrupt as e:
                raise _Corrupt(str(e) if i == self._own else f"replica {replica.name}: {e}") from None

    def _newest(self, step_at_most: int) -> int:
        """The newest step <= `step_at_most` in memory or on disk (by its manifests), -1 if none."""
        newest = max((s.step for s in self._slots if 0 <= s.step <= step_at_most), default=-1)
        for step, path in sorted(self._on_disk().items(), reverse=True):
            if newest < step <= step_at_most:
                try:
                    self._manifests(step)
                    return step
                except _Corrupt as e:
                    self._report(path, step, str(e))
        return newest

    def _load(self, step: int) -> str | None:
        """Load the snapshot of `step` into the state, from memory if it is there, else from disk, verified
        there; its tier, or None (reported) when the disk's copy does not verify."""
        slot = next((s for s in self._slots if s.step == step), None)
        if slot:
            tier, meta, refs, buffer = sc.TIER_MEMORY, slot.meta, slot.refs, slot.buffer
        else:
            path = self.directory / f"step-{step:08d}"
            live = _objects({name: obj.state_dict() for name, obj in self.state.items()})
            try:
                tier, (meta, refs, buffer) = (
                    sc.TIER_DISK,
                    _read_checkpoint([r / path.name for r in self._replicas], self._own, step, live),
                )
            except _Corrupt as e:
                self._report(path, step, str(e))
                return None
        saved = _unpickle(meta, refs, buffer)
        for name, obj in self.state.items():
            obj.load_state_dict(saved["state"][name])
        _set_rng_state(saved["rng"])
        return tier

    @staticmethod
    def _report(path: Path, step: int, why: str) -> None:
        log.warning("checkpoint: %s skipped: %s", path, why)
        agent.event(sc.EVENT_CHECKPOINT_CORRUPT, step, **{sc.CKPT_PATH: str(path), sc.CKPT_WHY: why})
