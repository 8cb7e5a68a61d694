"""Lazy, asynchronous, multi-level checkpoints of the training state (after DataStates-LLM).

Parameters and optimizer state change only inside `optimizer.step()`, so a
snapshot taken right after one can be copied while the next forward and
backward run: a background thread copies the tensors into host buffers. The
loop waits only in `wait_until_safe()`, called right before the next
`optimizer.step()`, and only if the copy has not finished.

Two tiers. The last K snapshots stay in a ring of host buffers for an instant
rollback (trainer/hostring.py); every M steps one of them goes to disk through
a background writer (trainer/disktier.py). A snapshot is the state pickled with
its tensors as placeholders and the tensors in one flat buffer
(trainer/snapshotformat.py), and on disk a directory of files vouched for by a
manifest (trainer/checkpointfiles.py). The checkpointer wires them: it is the
training loop's side, and it alone counts what either tier skips.

`restore(step)` loads the newest snapshot at or before `step` that every
replica has, from memory unless only the disk has it; the snapshots after it
belong to a future that will not happen and are dropped from both tiers.
"""

import logging
import time
from collections.abc import Callable
from pathlib import Path

from rankwatch import agent
from rankwatch.agent import semconv as sc
from trainer.checkpointfiles import MANIFEST, META, TENSORS
from trainer.disktier import DiskTier
from trainer.hostring import HostRing, Slot
from trainer.snapshotformat import Stateful, load_into, objects, pickled

__all__ = ["MANIFEST", "META", "TENSORS", "Checkpointer", "NoCheckpoint", "Stateful"]

log = logging.getLogger(__name__)


class NoCheckpoint(LookupError):
    """No snapshot at or before the step asked for, in memory or on disk."""


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
        self.disk_every, self._agree = disk_every, agree
        self._disk = DiskTier(self.directory, [Path(p) for p in replicas] if replicas else [self.directory], keep)
        self._ring = HostRing(memory, host_limit)
        self._skipped = 0  # snapshots and disk writes skipped so far (the training thread's alone)

    @property
    def memory(self) -> int:
        """How many snapshots the ring keeps (grown by grow(), short of it where the host cannot hold more)."""
        return self._ring.memory

    def snapshot(self, step: int) -> None:
        """Start a snapshot of the state as it is now; the tensors are copied in the background. Skipped
        (a `checkpoint_skipped` event) when no slot of the ring is ready: never a wait for its buffers."""
        self.wait_until_safe()
        started = time.perf_counter()
        meta, tensors = pickled(self.state)
        self._report_copied()  # the slots whose copies have landed since are free again
        why = self._ring.start(step, meta, tensors, started)
        if why is not None:
            self._skip(step, sc.TIER_MEMORY, why)

    def wait_until_safe(self) -> None:
        """Return once the snapshot in flight no longer needs the live tensors: before optimizer.step().
        On CUDA the training stream is made to wait for the copy, on the GPU: this thread does not."""
        self._ring.wait_until_safe()
        self._report_copied()

    def reserve(self, wait: bool = False) -> None:
        """Have the ring allocated for the state as it is now, in the background; with `wait`, before
        returning: for a caller that would rather wait once, before it trains or times (a benchmark, a
        test), than have the first snapshots skipped while the buffers are made."""
        tensors = pickled(self.state)[1]
        self._report_copied()
        self._ring.reserve(tensors, wait)

    @property
    def snapshot_bytes(self) -> int:
        """The host memory a slot of the ring takes, as allocated (0 before the first is)."""
        return self._ring.snapshot_bytes

    def grow(self, memory: int) -> None:
        """Keep at least `memory` snapshots in host memory from now on, as many as `host_limit` holds
        (the ring only grows); the new slots are allocated in the background, one at a time."""
        self._ring.grow(memory)

    def restore(self, step_at_most: int) -> int:
        """Load the newest snapshot with step <= `step_at_most` that every replica has into the state,
        from memory unless only the disk has it; returns its step. Raises NoCheckpoint when there is none."""
        self._settle(keep_through=step_at_most)
        target = self._agree(step_at_most)  # a barrier too: no replica is writing what it may load
        while True:
            step = self._agree(self._disk.newest(target, above=self._ring.newest(target)))
            if step < 0:
                raise NoCheckpoint(f"no snapshot of step {step_at_most} or before in memory or in {self.directory}")
            tier = self._load(step)
            if self._agree(int(tier is not None)):
                break
            target = step - 1  # one replica's copy of it does not verify: every replica goes further back
        slots = self._ring.slots
        if min((s.step for s in slots), default=-1) > step_at_most:
            log.warning(
                "checkpoint: all %d snapshots in memory are newer than step %d: keep more (--ckpt-memory) "
                "for an instant rollback",
                len(slots),
                step_at_most,
            )
        self._ring.drop_after(step)
        self._disk.drop_after(step)
        log.info("checkpoint: restored step %d from %s", step, tier)
        agent.event(sc.EVENT_CHECKPOINT_RESTORED, step, **{sc.CKPT_TIER: tier})
        return step

    def make_durable(self, step: int) -> None:
        """Have the snapshot of `step` on disk before returning: written now from memory unless the
        disk has it already (a job about to stop leaves a checkpoint to resume from)."""
        if step in self.durable_steps():
            return
        slot = self._ring.holding(step)
        if slot is None:
            raise NoCheckpoint(f"no snapshot of step {step} in memory")
        self._flush(slot)
        self._disk.wait_for_writer()

    def durable_steps(self) -> list[int]:
        """The steps of the checkpoints on disk whose manifests (every replica's) vouch for them, oldest
        first; the others are reported. Only manifests and file sizes are read: the data is verified
        when it is loaded."""
        self._settle()
        return self._disk.durable_steps()

    def close(self) -> None:
        """Finish the snapshot in flight and the disk writes it asks for, then stop the threads."""
        self._settle()
        self._ring.close()
        self._disk.close()

    def _settle(self, keep_through: int | None = None) -> None:
        """Wait for every copy started and every disk write asked for (restore, listing and close need still
        tiers); with `keep_through`, not for a write of a later step (DiskTier.settle)."""
        self.wait_until_safe()
        self._report_copied(wait=True)
        self._disk.settle(keep_through)

    def _report_copied(self, wait: bool = False) -> None:
        """For each copy that has ended (or every one, waiting, with `wait`), in order: the disk write every
        `disk_every` steps; a copy that failed raises here, on the training thread."""
        for slot in self._ring.landed(wait):
            if slot.step % self.disk_every == 0:
                self._flush(slot)

    def _flush(self, slot: Slot) -> None:
        """Have the writer put `slot` on disk next; the snapshot it replaces, still waiting for the writer, is
        skipped (and counted): a disk slower than the snapshots holds two slots at most, and never the
        training loop."""
        superseded = self._disk.flush(slot)
        if superseded is not None:
            self._skip(superseded.step, sc.TIER_DISK, f"the writer was busy: step {slot.step} is written instead")

    def _skip(self, step: int, tier: str, why: str) -> None:
        self._skipped += 1
        log.info("checkpoint: step %d not kept in %s: %s", step, tier, why)
        agent.event(
            sc.EVENT_CHECKPOINT_SKIPPED, step, **{sc.CKPT_TIER: tier, sc.CKPT_WHY: why, sc.CKPT_SKIPPED: self._skipped}
        )

    def _load(self, step: int) -> str | None:
        """Load the snapshot of `step` into the state, from memory if it is there, else from disk, verified
        there; its tier, or None (reported) when the disk's copy does not verify."""
        slot = self._ring.holding(step)
        if slot:
            tier, meta, refs, buffer = sc.TIER_MEMORY, slot.meta, slot.refs, slot.buffer
        else:
            read = self._disk.load(step, objects({name: obj.state_dict() for name, obj in self.state.items()}))
            if read is None:
                return None
            tier, (meta, refs, buffer) = sc.TIER_DISK, read
        load_into(self.state, meta, refs, buffer)
        return tier
