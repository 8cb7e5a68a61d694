"""Lazy, asynchronous, multi-level checkpoints of the training state (after DataStates-LLM).

Parameters and optimizer state change only inside `optimizer.step()`, so a
snapshot taken right after one can be copied while the next forward and
backward run: a background thread copies the tensors into host buffers. The
loop waits only in `wait_until_safe()`, called right before the next
`optimizer.step()`, and only if the copy has not finished; on CUDA not even
the host waits: the copies are queued on a side stream into pinned buffers,
and the training stream waits for them on the GPU. Python-side state (step,
schedule, data position, RNG) is pickled at once, since the next step
changes it first.

Two tiers. The last K snapshots stay in a ring of host buffers, allocated once
and reused, for an instant rollback. Every M steps one of them goes to disk
through a background writer: each file is written under a temporary name,
fsync'd and renamed, then a manifest with the files' blake2b checksums is
written and renamed last. Data-parallel replicas hold the same tensors, so
each writes only its share of them. Listing checkpoints reads manifests only;
the one about to be loaded is read in full and checked: a checkpoint whose
manifest is missing or does not match its files is partial or damaged, and is
reported and never loaded.

`restore(step)` loads the newest snapshot at or before `step` that every
replica has, from memory unless only the disk has it; the snapshots after it
belong to a future that will not happen and are dropped from both tiers.
"""

import ctypes
import hashlib
import io
import json
import logging
import os
import pickle
import queue
import random
import shutil
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import torch

import agent
from agent import semconv as sc

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
    """Stands for a tensor in a pickled snapshot: the next of its tensors, since they are unpickled
    in the order they were pickled, that of the layout."""


class _Pickler(pickle.Pickler):
    """Pickles a state with each tensor as a `_Tensor` (torch.save's way): the rest is copied now,
    `tensors`, the live tensors, later. reducer_override, unlike persistent_id, is not called for
    ints, strings, lists and dicts, and it only collects: the layout is worked out in the background."""

    def __init__(self, file: io.BytesIO):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors: list[torch.Tensor] = []

    def reducer_override(self, obj: Any) -> tuple:
        if not isinstance(obj, torch.Tensor):
            return NotImplemented
        self.tensors.append(obj)
        return _Tensor, ()


def _layout(tensors: list[torch.Tensor]) -> tuple[list[_Ref], int]:
    """Where each tensor goes in one flat buffer, and the buffer's size."""
    refs, nbytes = [], 0
    for t in tensors:
        refs.append(_Ref(nbytes, t.dtype, tuple(t.shape)))
        nbytes += -(-t.nbytes // _ALIGN) * _ALIGN
    return refs, nbytes


class _Unpickler(pickle.Unpickler):
    """The state back, each `_Tensor` a clone of the bytes of the next `_Ref`: a loaded optimizer
    must not alias a ring slot."""

    def __init__(self, meta: bytes, refs: list[_Ref], buffer: torch.Tensor):
        super().__init__(io.BytesIO(meta))
        self.refs, self.buffer = iter(refs), buffer

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == (__name__, "_Tensor"):
            return lambda: next(self.refs).view(self.buffer).clone()
        return super().find_class(module, name)


def _memory(buffer: torch.Tensor) -> memoryview:
    """The bytes of a CPU uint8 tensor, not copied: files are written, hashed and read in place."""
    return memoryview((ctypes.c_ubyte * buffer.numel()).from_address(buffer.data_ptr())).cast("B")


def _rng_state() -> dict:
    """The RNG states, as bytes rather than tensors: they differ between replicas, whose tensors are shared."""
    state = {"python": random.getstate(), "torch": torch.get_rng_state().numpy().tobytes()}
    if torch.cuda.is_available():  # this rank's device only: the others are other ranks'
        state["cuda"] = torch.cuda.get_rng_state().numpy().tobytes()
    if "numpy" in sys.modules:
        state["numpy"] = sys.modules["numpy"].random.get_state()
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


def _host_buffer(nbytes: int, pinned: bool) -> torch.Tensor:
    """A ring slot's buffer; pinned on CUDA, so that a device-to-host copy into it is asynchronous."""
    return torch.empty(max(nbytes, _ALIGN), dtype=torch.uint8, pin_memory=pinned)


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
    return {"files": files, "share": share, "tensor_bytes": nbytes}


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


def _read_checkpoint(paths: list[Path], own: int, step: int) -> tuple[bytes, list[_Ref], torch.Tensor]:
    """(pickled state, layout, tensor buffer) of a checkpoint: this replica's state from `paths[own]`,
    the tensors from the shares of every replica's directory, each verified against its manifest."""
    manifests = []
    for i, path in enumerate(paths):
        try:
            manifests.append(_manifest(path, step))
        except _Corrupt as e:
            raise _Corrupt(str(e) if i == own else f"replica {path.parent.name}: {e}") from None
    size, digest = manifests[own]["files"][META]
    state = torch.empty(max(size, 1), dtype=torch.uint8)  # held while its memory is read
    _read_verified(paths[own] / META, _memory(state)[:size], digest)
    meta, refs = pickle.loads(_memory(state)[:size])
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

    buffer: torch.Tensor | None = None  # allocated by the copier, off the training thread
    step: int = -1
    meta: bytes = b""  # the state pickled, tensors as `_Tensor`s
    refs: list[_Ref] = field(default_factory=list)  # where they lie in `buffer` (the copier sets them)
    nbytes: int = 0
    views: list[torch.Tensor] = field(default_factory=list)  # of `buffer`, one per ref
    started: float = 0.0  # perf_counter at snapshot()
    blocked_s: float = 0.0
    issued: threading.Event = field(default_factory=threading.Event)  # CPU: copied; CUDA: queued on the side stream
    done: Any = None  # CUDA: the event the side stream records after the copy
    copied: threading.Event = field(default_factory=threading.Event)  # the bytes are in `buffer`
    copied_at: float = 0.0
    error: BaseException | None = None
    flushing: bool = False  # the writer reads it: not to be reused until it is done


def _alone(step: int) -> int:
    """`agree` for a replica alone: its own value."""
    return step


class Checkpointer:
    """Snapshots of `state` (named objects with state_dict/load_state_dict; RNG states are added):
    the last `memory` in host memory, every `disk_every` steps one on disk in `directory`, the
    newest `keep` of them kept. Call `snapshot(step)` after an optimizer step (`step`: steps
    done) and `wait_until_safe()` right before the next one; `close()` at the end.

    Data-parallel replicas hold the same tensors: `replicas` lists the checkpoint directories of
    those of this one's group, `directory` among them, in the same order on each; every replica
    writes its share of the tensors (and its own Python and RNG state), and a load reads all the
    shares. `agree` is a collective over the group returning the lowest of the values passed (a
    replica alone: itself), so that every replica restores the same step."""

    def __init__(
        self,
        directory: Path,
        state: dict[str, Stateful],
        memory: int = 4,
        disk_every: int = 100,
        keep: int = 2,
        replicas: list[Path] | None = None,
        agree: Callable[[int], int] = _alone,
    ):
        if min(memory, disk_every, keep) < 1:
            raise ValueError("memory, disk_every and keep must be at least 1")
        self.directory, self.state = Path(directory), state
        self.memory, self.disk_every, self.keep, self._agree = memory, disk_every, keep, agree
        self._replicas = [Path(p) for p in replicas] if replicas else [self.directory]
        self._own = self._replicas.index(self.directory)
        self._device = torch.cuda.current_device() if torch.cuda.is_available() else None
        self._slots = [_Snapshot() for _ in range(memory)]  # buffers allocated all at once, at the first copy
        self._in_flight: _Snapshot | None = None
        self._unreported: list[_Snapshot] = []  # copies started whose end the loop has not acted on yet
        self._copies: queue.Queue = queue.Queue()
        self._writes: queue.Queue = queue.Queue()
        self._threads = [
            threading.Thread(target=self._copy_loop, name="checkpoint-copier", daemon=True),
            threading.Thread(target=self._write_loop, name="checkpoint-writer", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    # -- the training loop's side ------------------------------------------------------------------
    def snapshot(self, step: int) -> None:
        """Start a snapshot of the state as it is now; the tensors are copied in the background."""
        self.wait_until_safe()
        started = time.perf_counter()
        meta = io.BytesIO()
        layout = _Pickler(meta)
        layout.dump({"state": {name: obj.state_dict() for name, obj in self.state.items()}, "rng": _rng_state()})
        slot = self._free_slot()
        slot.step, slot.meta, slot.started, slot.error = step, meta.getvalue(), started, None
        slot.issued.clear()
        slot.copied.clear()
        updated = None
        if self._device is not None:  # the side stream starts copying once the optimizer step is done
            updated = torch.cuda.Event()
            updated.record()
        self._in_flight = slot
        self._unreported.append(slot)
        slot.blocked_s = time.perf_counter() - started
        self._copies.put((slot, layout.tensors, updated))

    def wait_until_safe(self) -> None:
        """Return once the snapshot in flight no longer needs the live tensors: before optimizer.step().
        On CUDA the training stream is made to wait for the copy, on the GPU: this thread does not."""
        slot, self._in_flight = self._in_flight, None
        if slot is not None:
            started = time.perf_counter()
            slot.issued.wait()
            if slot.done is not None and slot.error is None:
                torch.cuda.current_stream().wait_event(slot.done)
            slot.blocked_s += time.perf_counter() - started
        self._report_copied()

    @property
    def snapshot_bytes(self) -> int:
        """The host memory one snapshot's tensors take (0 before the first snapshot)."""
        return max(s.nbytes for s in self._slots)

    def grow(self, memory: int) -> None:
        """Keep at least `memory` snapshots in host memory from now on (the ring only grows)."""
        self._slots += [_Snapshot() for _ in range(memory - self.memory)]
        self.memory = max(self.memory, memory)

    def restore(self, step_at_most: int) -> int:
        """Load the newest snapshot with step <= `step_at_most` that every replica has into the state,
        from memory unless only the disk has it; returns its step. Raises NoCheckpoint when there is none."""
        self._settle()
        target = self._agree(step_at_most)  # a barrier too: no replica is writing any more
        while True:
            step = self._agree(self._newest(target))
            if step < 0:
                raise NoCheckpoint(f"no snapshot of step {step_at_most} or before in memory or in {self.directory}")
            tier = self._load(step)
            if self._agree(int(tier is not None)):
                break
            target = step - 1  # one replica's copy of it does not verify: every replica goes further back
        if all(s.step > step_at_most for s in self._slots):
            log.warning(
                "checkpoint: all %d snapshots in memory are newer than step %d: keep more (--ckpt-memory) "
                "for an instant rollback",
                self.memory,
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
        slot.flushing = True
        self._writes.put(slot)
        self._writes.join()

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
        self._copies.put(None)
        self._writes.put(None)
        for thread in self._threads:
            thread.join()

    # -- memory tier ---------------------------------------------------------------------------------
    def _settle(self) -> None:
        """Wait for every copy started and every disk write asked for (restore, listing and close need still tiers)."""
        self.wait_until_safe()
        self._report_copied(wait=True)
        self._writes.join()

    def _report_copied(self, wait: bool = False) -> None:
        """For each copy that has ended (or every one, waiting, with `wait`), in order: its event, and
        the disk write every `disk_every` steps; a copy that failed raises here, on the training thread."""
        while self._unreported and (wait or self._unreported[0].copied.is_set()):
            slot = self._unreported.pop(0)
            slot.copied.wait()
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
                    sc.CKPT_DURABLE_S: slot.copied_at - slot.started,
                },
            )
            if slot.step % self.disk_every == 0:
                slot.flushing = True
                self._writes.put(slot)

    def _free_slot(self) -> _Snapshot:
        """The oldest slot that no copy and no disk write is using (waiting for them when all are)."""
        self._report_copied()
        free = [s for s in self._slots if not s.flushing and s not in self._unreported]
        if not free:
            self._report_copied(wait=True)
            free = [s for s in self._slots if not s.flushing]
        if not free:
            self._writes.join()
            free = self._slots
        return min(free, key=lambda s: s.step)

    def _copy_loop(self) -> None:
        """Copies each snapshot's tensors into its slot: on CUDA queued on a side stream, then waited for here."""
        stream = None
        if self._device is not None:
            torch.cuda.set_device(self._device)  # per thread
            stream = torch.cuda.Stream()
        while (job := self._copies.get()) is not None:
            slot, tensors, updated = job
            try:
                self._copy(slot, tensors, updated, stream)
            except Exception as e:  # reported to the training loop by _report_copied
                slot.error = e
            if slot.error is None and slot.done is not None:  # CUDA: the loop goes on once the copy is queued
                slot.issued.set()
                try:
                    slot.done.synchronize()
                except Exception as e:
                    slot.error = e
            slot.copied_at = time.perf_counter()
            slot.copied.set()
            slot.issued.set()

    def _copy(self, slot: _Snapshot, tensors: list[torch.Tensor], updated, stream) -> None:
        refs, slot.nbytes = _layout(tensors)
        for s in list(self._slots):  # the whole ring on the first snapshot; again only if the state grows
            if s.buffer is None or (s is slot and s.buffer.numel() < slot.nbytes):
                s.buffer, s.refs = _host_buffer(slot.nbytes, pinned=stream is not None), []
        buffer = slot.buffer
        assert buffer is not None  # allocated just above
        if slot.refs != refs:  # views made once per slot and layout
            slot.refs, slot.views = refs, [ref.view(buffer) for ref in refs]
        if stream is None:
            with torch.no_grad():
                torch._foreach_copy_(slot.views, tensors)  # one call
            return
        with torch.no_grad(), torch.cuda.stream(stream):
            stream.wait_event(updated)  # after the optimizer step that made this state
            torch._foreach_copy_(slot.views, tensors, non_blocking=True)  # into pinned memory: asynchronous
            for t in tensors:
                if t.is_cuda:  # a tensor the state dict made afresh must outlive the copy
                    t.record_stream(stream)
            if slot.done is None:
                slot.done = torch.cuda.Event(blocking=True)  # waited for by this thread without spinning
            slot.done.record(stream)

    # -- disk tier -----------------------------------------------------------------------------------
    def _write_loop(self) -> None:
        while (slot := self._writes.get()) is not None:
            try:
                self._write(slot)
            except OSError:
                log.exception("checkpoint: step %d not written to %s", slot.step, self.directory)
            finally:
                slot.flushing = False
                self._writes.task_done()
        self._writes.task_done()  # the stop sentinel: a join() after close() returns

    def _write(self, slot: _Snapshot) -> None:
        """Files first, each complete under its name, then the manifest that vouches for them; then prune.
        The tensors file holds this replica's share of the tensors."""
        path = self.directory / f"step-{slot.step:08d}"
        path.mkdir(parents=True, exist_ok=True)
        _fsync_dir(path.parent)
        (path / MANIFEST).unlink(missing_ok=True)  # a rewrite: the old manifest must not vouch for new files
        lo, hi = _share(slot.nbytes, self._own, len(self._replicas))
        assert slot.buffer is not None  # a snapshot is written once copied into its buffer
        files = {
            META: _write_durably(path / META, memoryview(pickle.dumps((slot.meta, slot.refs)))),
            TENSORS: _write_durably(path / TENSORS, _memory(slot.buffer)[lo:hi]),
        }
        _fsync_dir(path)
        _write_durably(
            path / MANIFEST,
            memoryview(
                json.dumps({"step": slot.step, "files": files, "share": [lo, hi], "tensor_bytes": slot.nbytes}).encode()
            ),
        )
        _fsync_dir(path)
        durable_s = time.perf_counter() - slot.started
        log.info("checkpoint: step %d durable in %s, %.3f s after its snapshot", slot.step, path, durable_s)
        agent.event(
            sc.EVENT_CHECKPOINT_SAVED,
            slot.step,
            **{
                sc.CKPT_TIER: sc.TIER_DISK,
                sc.CKPT_BYTES: hi - lo + files[META]["bytes"],
                sc.CKPT_BLOCKED_S: slot.blocked_s,
                sc.CKPT_DURABLE_S: durable_s,
            },
        )
        complete = [p for _, p in sorted(self._on_disk().items()) if (p / MANIFEST).exists()]
        for old in set(self._on_disk().values()) - set(complete[-self.keep :]):
            _remove(old)

    def _on_disk(self) -> dict[int, Path]:
        """step -> directory of every checkpoint of this replica on disk, complete or not."""
        if not self.directory.is_dir():
            return {}
        return {int(p.name[5:]): p for p in self.directory.glob("step-*") if p.name[5:].isdigit()}

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
            assert slot.buffer is not None  # a slot holds a step once copied into its buffer
            tier, meta, refs, buffer = sc.TIER_MEMORY, slot.meta, slot.refs, slot.buffer
        else:
            path = self.directory / f"step-{step:08d}"
            try:
                tier, (meta, refs, buffer) = (
                    sc.TIER_DISK,
                    _read_checkpoint([r / path.name for r in self._replicas], self._own, step),
                )
            except _Corrupt as e:
                self._report(path, step, str(e))
                return None
        saved = _Unpickler(meta, refs, buffer).load()
        for name, obj in self.state.items():
            obj.load_state_dict(saved["state"][name])
        _set_rng_state(saved["rng"])
        return tier

    @staticmethod
    def _report(path: Path, step: int, why: str) -> None:
        log.warning("checkpoint: %s skipped: %s", path, why)
        agent.event(sc.EVENT_CHECKPOINT_CORRUPT, step, **{sc.CKPT_PATH: str(path), sc.CKPT_WHY: why})
