"""Lazy, asynchronous, multi-level checkpoints of the training state (after DataStates-LLM).

Parameters and optimizer state change only inside `optimizer.step()`, so a
snapshot taken right after one can be copied while the next forward and
backward run: a background thread copies the tensors into host buffers (on
CUDA pinned ones, on a side stream). The loop waits only in
`wait_until_safe()`, called right before the next `optimizer.step()`, and only
if the copy has not finished. Python-side state (step, schedule, data
position, RNG) is pickled at once, since the next step changes it first.

Two tiers. The last K snapshots stay in a ring of host buffers, allocated once
and reused, for an instant rollback. Every M steps one of them goes to disk
through a background writer: each file is written under a temporary name,
fsync'd and renamed, then a manifest with the files' blake2b checksums is
written and renamed last. A checkpoint whose manifest is missing or does not
match its files is partial or damaged: it is reported and never loaded.

`restore(step)` loads the newest snapshot at or before `step`, from memory
unless only the disk has it; the snapshots after it belong to a future that
will not happen and are dropped from both tiers.
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
        return buffer[self.offset:self.offset + size].view(self.dtype).view(self.shape)


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
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()  # this rank's device only: the others are other ranks'
    if "numpy" in sys.modules:
        state["numpy"] = sys.modules["numpy"].random.get_state()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])
    if "numpy" in state:
        import numpy

        numpy.random.set_state(state["numpy"])


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
            digest.update(data[i:i + _CHUNK])
            f.write(data[i:i + _CHUNK])
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return {"bytes": len(data), "blake2b": digest.hexdigest()}


def _read_verified(path: Path, expected_size: int, expected_digest: str) -> torch.Tensor:
    """A file's bytes in a new uint8 tensor, checked against its manifest entry."""
    if not path.is_file():
        raise _Corrupt(f"{path.name} is missing")
    size = path.stat().st_size
    if size != expected_size:
        raise _Corrupt(f"{path.name} has {size} bytes, the manifest says {expected_size}")
    data = torch.empty(max(size, _ALIGN), dtype=torch.uint8)
    view, digest = _memory(data), hashlib.blake2b()
    with open(path, "rb") as f:
        for i in range(0, size, _CHUNK):
            chunk = view[i:min(i + _CHUNK, size)]
            if f.readinto(chunk) != len(chunk):
                raise _Corrupt(f"{path.name} ended early")
            digest.update(chunk)
    if digest.hexdigest() != expected_digest:
        raise _Corrupt(f"{path.name} does not match its checksum")
    return data


def _read_checkpoint(path: Path, step: int) -> tuple[bytes, list[_Ref], torch.Tensor]:
    """(pickled state, layout, tensor buffer) of a checkpoint directory whose manifest vouches for it."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        files = {name: (int(manifest["files"][name]["bytes"]), str(manifest["files"][name]["blake2b"]))
                 for name in (META, TENSORS)}
        if manifest["step"] != step:
            raise _Corrupt(f"the manifest is of step {manifest['step']}")
    except FileNotFoundError:
        raise _Corrupt("no manifest (a partial checkpoint)") from None
    except (ValueError, KeyError, TypeError) as e:
        raise _Corrupt(f"unreadable manifest ({e!r})") from None
    state = _read_verified(path / META, *files[META])  # held while its memory is read
    meta, refs = pickle.loads(_memory(state)[:files[META][0]])
    return meta, refs, _read_verified(path / TENSORS, *files[TENSORS])


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
    copied: threading.Event = field(default_factory=threading.Event)
    copied_at: float = 0.0
    error: BaseException | None = None
    flushing: bool = False  # the writer reads it: not to be reused until it is done


class Checkpointer:
    """Snapshots of `state` (named objects with state_dict/load_state_dict; RNG states are added):
    the last `memory` in host memory, every `disk_every` steps one on disk in `directory`, the
    newest `keep` of them kept. Call `snapshot(step)` after an optimizer step (`step`: steps
    done) and `wait_until_safe()` right before the next one; `close()` at the end."""

    def __init__(self, directory: Path, state: dict[str, Stateful], memory: int = 4, disk_every: int = 100,
                 keep: int = 2):
        if min(memory, disk_every, keep) < 1:
            raise ValueError("memory, disk_every and keep must be at least 1")
        self.directory, self.state = Path(directory), state
        self.memory, self.disk_every, self.keep = memory, disk_every, keep
        self._device = torch.cuda.current_device() if torch.cuda.is_available() else None
        self._slots: list[_Snapshot] = []
        self._in_flight: _Snapshot | None = None
        self._copies: queue.Queue = queue.Queue()
        self._writes: queue.Queue = queue.Queue()
        self._threads = [threading.Thread(target=self._copy_loop, name="checkpoint-copier", daemon=True),
                         threading.Thread(target=self._write_loop, name="checkpoint-writer", daemon=True)]
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
        slot.copied.clear()
        updated = None
        if self._device is not None:  # the side stream starts copying once the optimizer step is done
            updated = torch.cuda.Event()
            updated.record()
        self._in_flight = slot
        slot.blocked_s = time.perf_counter() - started
        self._copies.put((slot, layout.tensors, updated))

    def wait_until_safe(self) -> None:
        """Return once the snapshot in flight no longer needs the live tensors: before optimizer.step()."""
        slot, self._in_flight = self._in_flight, None
        if slot is None:
            return
        started = time.perf_counter()
        slot.copied.wait()
        slot.blocked_s += time.perf_counter() - started
        if slot.error:
            step, slot.step = slot.step, -1
            raise RuntimeError(f"snapshot of step {step} failed") from slot.error
        agent.event(sc.EVENT_CHECKPOINT_SAVED, slot.step, **{
            sc.CKPT_TIER: sc.TIER_MEMORY, sc.CKPT_BYTES: slot.nbytes + len(slot.meta),
            sc.CKPT_BLOCKED_S: slot.blocked_s, sc.CKPT_DURABLE_S: slot.copied_at - slot.started})
        if slot.step % self.disk_every == 0:
            slot.flushing = True
            self._writes.put(slot)

    def restore(self, step_at_most: int) -> int:
        """Load the newest snapshot with step <= `step_at_most` into the state, from memory unless only
        the disk has it; returns its step. Raises NoCheckpoint when there is none."""
        self.wait_until_safe()
        self._writes.join()  # the disk tier holds still
        slot = max((s for s in self._slots if 0 <= s.step <= step_at_most), key=lambda s: s.step, default=None)
        if found := self._newest_on_disk(step_at_most, newer_than=slot.step if slot else -1):
            tier, (step, meta, refs, buffer) = sc.TIER_DISK, found
        elif slot:
            tier, step, meta, refs, buffer = sc.TIER_MEMORY, slot.step, slot.meta, slot.refs, slot.buffer
        else:
            raise NoCheckpoint(f"no snapshot of step {step_at_most} or before in memory or in {self.directory}")
        if len(self._slots) == self.memory and all(s.step > step_at_most for s in self._slots):
            log.warning("checkpoint: all %d snapshots in memory are newer than step %d: keep more (--ckpt-memory) "
                        "for an instant rollback", self.memory, step_at_most)
        saved = _Unpickler(meta, refs, buffer).load()
        for name, obj in self.state.items():
            obj.load_state_dict(saved["state"][name])
        _set_rng_state(saved["rng"])
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
        """Have the snapshot of `step` on disk, verified, before returning: written now from memory
        unless the disk has it already (a job about to stop leaves a checkpoint to resume from)."""
        self.wait_until_safe()
        self._writes.join()
        if step in self.durable_steps():
            return
        slot = next((s for s in self._slots if s.step == step), None)
        if slot is None:
            raise NoCheckpoint(f"no snapshot of step {step} in memory")
        slot.flushing = True
        self._writes.put(slot)
        self._writes.join()

    def durable_steps(self) -> list[int]:
        """The steps of the checkpoints on disk that verify (read in full), oldest first; the others are reported."""
        self._writes.join()
        steps = []
        for step, path in sorted(self._on_disk().items()):
            try:
                _read_checkpoint(path, step)
                steps.append(step)
            except _Corrupt as e:
                self._report(path, step, str(e))
        return steps

    def close(self) -> None:
        """Finish the snapshot in flight and the disk writes it asks for, then stop the threads."""
        self.wait_until_safe()
        self._copies.put(None)
        self._writes.put(None)
        for thread in self._threads:
            thread.join()

    # -- memory tier ---------------------------------------------------------------------------------
    def _free_slot(self) -> _Snapshot:
        """A new slot while the ring is not full, else the oldest one the writer is not reading (waiting
        for the writer when it reads them all)."""
        if len(self._slots) < self.memory:
            self._slots.append(_Snapshot())
            return self._slots[-1]
        if all(s.flushing for s in self._slots):
            self._writes.join()
        return min((s for s in self._slots if not s.flushing), key=lambda s: s.step)

    def _copy_loop(self) -> None:
        """Copies each snapshot's tensors into its slot: on CUDA on a side stream, waiting for its end."""
        stream = None
        if self._device is not None:
            torch.cuda.set_device(self._device)  # per thread
            stream = torch.cuda.Stream()
        while (job := self._copies.get()) is not None:
            slot, tensors, updated = job
            try:
                refs, slot.nbytes = _layout(tensors)
                if slot.buffer is None or slot.buffer.numel() < slot.nbytes:  # once, unless the state grows
                    slot.buffer = torch.empty(max(slot.nbytes, _ALIGN), dtype=torch.uint8,
                                              pin_memory=self._device is not None)
                    slot.refs = []
                if slot.refs != refs:  # views made once per slot and layout
                    slot.refs, slot.views = refs, [ref.view(slot.buffer) for ref in refs]
                with torch.no_grad(), torch.cuda.stream(stream):  # stream None: a no-op on CPU
                    if stream is not None:
                        stream.wait_event(updated)
                    torch._foreach_copy_(slot.views, tensors, non_blocking=stream is not None)  # one call
                if stream is not None:
                    stream.synchronize()
            except Exception as e:  # reported to the training loop by wait_until_safe
                slot.error = e
            slot.copied_at = time.perf_counter()
            slot.copied.set()

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
        """Files first, each complete under its name, then the manifest that vouches for them; then prune."""
        path = self.directory / f"step-{slot.step:08d}"
        path.mkdir(parents=True, exist_ok=True)
        _fsync_dir(path.parent)
        (path / MANIFEST).unlink(missing_ok=True)  # a rewrite: the old manifest must not vouch for new files
        files = {META: _write_durably(path / META, memoryview(pickle.dumps((slot.meta, slot.refs)))),
                 TENSORS: _write_durably(path / TENSORS, _memory(slot.buffer)[:slot.nbytes])}
        _fsync_dir(path)
        _write_durably(path / MANIFEST, memoryview(json.dumps({"step": slot.step, "files": files}).encode()))
        _fsync_dir(path)
        durable_s = time.perf_counter() - slot.started
        log.info("checkpoint: step %d durable in %s, %.3f s after its snapshot", slot.step, path, durable_s)
        agent.event(sc.EVENT_CHECKPOINT_SAVED, slot.step, **{
            sc.CKPT_TIER: sc.TIER_DISK, sc.CKPT_BYTES: slot.nbytes + len(slot.meta),
            sc.CKPT_BLOCKED_S: slot.blocked_s, sc.CKPT_DURABLE_S: durable_s})
        complete = [p for _, p in sorted(self._on_disk().items()) if (p / MANIFEST).exists()]
        for old in set(self._on_disk().values()) - set(complete[-self.keep:]):
            _remove(old)

    def _on_disk(self) -> dict[int, Path]:
        """step -> directory of every checkpoint on disk, complete or not."""
        if not self.directory.is_dir():
            return {}
        return {int(p.name[5:]): p for p in self.directory.glob("step-*") if p.name[5:].isdigit()}

    def _newest_on_disk(self, step_at_most: int,
                        newer_than: int) -> tuple[int, bytes, list[_Ref], torch.Tensor] | None:
        """(step, pickled state, layout, buffer) of the newest sound checkpoint in (newer_than, step_at_most]."""
        for step, path in sorted(self._on_disk().items(), reverse=True):
            if newer_than < step <= step_at_most:
                try:
                    return step, *_read_checkpoint(path, step)
                except _Corrupt as e:
                    self._report(path, step, str(e))
        return None

    @staticmethod
    def _report(path: Path, step: int, why: str) -> None:
        log.warning("checkpoint: %s skipped: %s", path, why)
        agent.event(sc.EVENT_CHECKPOINT_CORRUPT, step, **{sc.CKPT_PATH: str(path), sc.CKPT_WHY: why})
