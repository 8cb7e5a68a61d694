"""The checkpoints' memory tier: the last snapshots' tensors in a ring of host buffers, copied off the training thread.

The last K snapshots stay in a ring of host buffers for an instant rollback; the buffers are made
in the background (the allocator thread), one at a time, and reused, and a snapshot that finds none
ready is skipped (and counted) rather than waited for. The copier thread copies a snapshot's tensors
into its slot while the next forward and backward run. On CUDA not even the host waits: the copies
are queued on a side stream into one pinned staging buffer, and the training stream waits for them
on the GPU; the copier thread then moves the bytes from the staging buffer into the ring's slot,
which is ordinary memory. Pinning (cudaHostRegister) takes about half a second a GB and stalls every
CUDA call of the process while it runs (an H200's GPT-2 job lost 10 s at its first snapshots pinning
a ring of 22), so only the staging buffer is pinned, once; the ring grows at no such cost.
"""

import logging
import mmap
import queue
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from rankwatch import agent
from rankwatch.agent import semconv as sc
from trainer.snapshotformat import _Ref, aligned, layout

log = logging.getLogger("trainer.checkpoint")  # the checkpointer's one logger, whichever of its parts speaks


@dataclass(eq=False)
class Slot:
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
    # The writer reads it, or is to: not to be reused until it is done. Set and cleared by the disk tier
    # alone (DiskTier says when), only read by the ring.
    flushing: bool = False

    def __post_init__(self) -> None:
        self.issued.set()  # no copy in flight
        self.landed.set()

    def copied(self) -> bool:
        """Whether the bytes are in `buffer` (or the copy failed), without waiting."""
        return self.landed.is_set()

    def wait_copied(self) -> None:
        self.landed.wait()


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


class HostRing:
    """The last `memory` snapshots' tensors in host buffers of at most `host_limit` bytes in all (None: no
    bound), on CUDA through one more, pinned, for staging. `start` a copy after an optimizer step,
    `wait_until_safe` before the next; `landed` hands over the snapshots whose bytes are in their slots."""

    def __init__(self, memory: int, host_limit: int | None):
        self.memory, self.host_limit = memory, host_limit
        self._device = torch.cuda.current_device() if torch.cuda.is_available() else None
        # Shared with the threads, under `_changed`. `slots` holds the slots whose buffer is ready, replaced
        # (never changed in place) so that it can be read without the lock.
        self._changed = threading.Condition()
        self.slots: list[Slot] = []
        self._nbytes: int | None = None  # the tensor bytes of the newest snapshot: the allocator's size
        self._retired: list[Slot] = []  # slots too small for the state, to be freed by the allocator
        self._staging: torch.Tensor | None = None  # CUDA: pinned, what the side stream copies into
        self._staging_views: tuple[list[_Ref], list[torch.Tensor]] = ([], [])
        self._staging_free = threading.Event()  # no snapshot on its way through the staging buffer
        self._staging_free.set()
        self._staging_refused = 0  # the size a staging buffer could not be made for
        self._closing = False
        # The training thread's alone.
        self._in_flight: Slot | None = None
        self._unreported: list[Slot] = []  # copies started whose end the loop has not acted on yet
        self._copies: queue.Queue = queue.Queue()
        self._threads = [
            threading.Thread(target=self._copy_loop, name="checkpoint-copier", daemon=True),
            threading.Thread(target=self._allocate_loop, name="checkpoint-allocator", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    # -- the training loop's side ------------------------------------------------------------------
    def start(self, step: int, meta: bytes, tensors: list[torch.Tensor], started: float) -> str | None:
        """Start the copy of the snapshot of `step` (`meta` its pickled state, `tensors` the live tensors,
        `started` at its perf_counter) into a free slot; None, or why no slot could take it: a snapshot
        never waits for the ring's buffers."""
        nbytes = sum(map(aligned, tensors))
        slot = self._free_slot(nbytes)
        if slot is None or not self._staged(nbytes):
            if slot is not None:
                return "its staging buffer is being allocated or still holds the last snapshot"
            if self._ready(nbytes):
                return "the ring's buffers are being copied into or written"
            return "the ring's buffers are being allocated"
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
        return None

    def wait_until_safe(self) -> None:
        """Return once the copy in flight no longer needs the live tensors. On CUDA the training stream is
        made to wait for it, on the GPU: this thread does not."""
        slot, self._in_flight = self._in_flight, None
        if slot is not None:
            started = time.perf_counter()
            slot.issued.wait()  # a copy into a buffer that is ready: never an allocation
            if slot.done is not None and slot.error is None:
                torch.cuda.current_stream().wait_event(slot.done)
            slot.blocked_s += time.perf_counter() - started

    def landed(self, wait: bool = False) -> Iterator[Slot]:
        """Each snapshot whose copy has ended (or every one, waiting, with `wait`), in order, after its
        `checkpoint_saved` event; a copy that failed raises here, on the training thread."""
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
            yield slot

    def reserve(self, tensors: list[torch.Tensor], wait: bool) -> None:
        """Have the ring allocated for `tensors` in the background; with `wait`, before returning."""
        nbytes = sum(map(aligned, tensors))
        self._free_slot(nbytes)  # tells the allocator the size
        if wait:
            with self._changed:
                self._changed.wait_for(lambda: self._ready(nbytes) >= self.memory)

    @property
    def snapshot_bytes(self) -> int:
        """The host memory a slot takes, as allocated (0 before the first is)."""
        return max((s.buffer.numel() for s in self.slots), default=0)

    def grow(self, memory: int) -> None:
        """Keep at least `memory` snapshots from now on, as many as `host_limit` holds (the ring only grows);
        the new slots are allocated in the background, one at a time."""
        if self.host_limit is not None and self.snapshot_bytes:
            memory = min(memory, self.host_limit // self.snapshot_bytes)
        with self._changed:
            self.memory = max(self.memory, memory)
            self._changed.notify_all()

    def newest(self, step_at_most: int) -> int:
        """The newest step <= `step_at_most` the ring holds, -1 if none."""
        return max((s.step for s in self.slots if 0 <= s.step <= step_at_most), default=-1)

    def holding(self, step: int) -> Slot | None:
        """The slot that holds the snapshot of `step`, if one does."""
        return next((s for s in self.slots if s.step == step), None)

    def drop_after(self, step: int) -> None:
        """Forget the snapshots after `step` (a restore's future that will not happen)."""
        for s in self.slots:
            if s.step > step:
                s.step = -1

    def close(self) -> None:
        """Stop the threads (the copies started are done: the caller waited for them)."""
        with self._changed:
            self._closing = True
            self._changed.notify_all()
        self._copies.put(None)
        for thread in self._threads:
            thread.join()

    def _free_slot(self, nbytes: int) -> Slot | None:
        """The oldest ready slot of at least `nbytes` that no copy and no disk write is using, without
        waiting: None if there is none. The allocator is told the size; a free slot too small for it
        (the state grew) is retired, its snapshot with it, and replaced in the background."""
        with self._changed:
            free = [s for s in self.slots if not s.flushing and s not in self._unreported]
            small = [s for s in free if s.buffer.numel() < nbytes]
            if small:
                self.slots = [s for s in self.slots if s not in small]
                self._retired += small
            self._nbytes = nbytes
            self._changed.notify_all()
        return min((s for s in free if s not in small), key=lambda s: s.step, default=None)

    def _ready(self, nbytes: int) -> int:
        """How many slots of the ring hold `nbytes`."""
        return sum(s.buffer.numel() >= nbytes for s in self.slots)

    def _staged(self, nbytes: int) -> bool:
        """Whether a snapshot of `nbytes` can go through the staging buffer now (CPU: it needs none)."""
        staging = self._staging
        return self._device is None or (
            staging is not None and staging.numel() >= nbytes and self._staging_free.is_set()
        )

    # -- the allocator thread ------------------------------------------------------------------------
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
            held = sum(s.buffer.numel() for s in self.slots)
            if self.host_limit is None or held + buffer.numel() <= self.host_limit:
                self.slots = [*self.slots, Slot(buffer)]
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

    # -- the copier thread ---------------------------------------------------------------------------
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
            except Exception as e:  # reported to the training loop by landed()
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
                with self._changed:  # the allocator may replace the staging buffer now (_unstaged)
                    self._staging_free.set()
                    self._changed.notify_all()

    @staticmethod
    def _copy(slot: Slot, tensors: list[torch.Tensor]) -> None:
        refs = layout(tensors)
        if slot.refs != refs:  # views made once per slot and layout
            slot.refs, slot.views = refs, [ref.view(slot.buffer) for ref in refs]
        with torch.no_grad():
            torch._foreach_copy_(slot.views, tensors)  # one call

    def _stage(self, slot: Slot, tensors: list[torch.Tensor], updated, stream) -> None:
        """Queue the copy of `tensors` into the staging buffer on `stream`, after `updated`; `slot.done`
        marks its end."""
        refs = layout(tensors)
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
