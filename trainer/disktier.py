"""The disk tier of the checkpoints: snapshots of the ring written to disk by a background writer, listed and loaded.

Every M steps one snapshot of the ring goes to disk through a background writer, as the files of
trainer/checkpointfiles.py; a snapshot that finds the writer busy replaces the one still waiting for
it, so a disk slower than the snapshots holds two slots of the ring at most, and never the training
loop. The newest `keep` complete checkpoints are kept. What is on disk is listed from the manifests
alone; only the one about to be loaded is read and verified, and a checkpoint that does not verify
is reported (a log line and a `checkpoint_corrupt` event) and skipped. A restore drops the
checkpoints after its step, and a write of such a step under way is removed once done rather than
waited for.
"""

import logging
import threading
import time
from pathlib import Path

import torch

from rankwatch import agent
from rankwatch.agent import semconv as sc
from trainer.checkpointfiles import (
    MANIFEST,
    Corrupt,
    checkpoints_in,
    manifests,
    read_checkpoint,
    remove,
    step_directory,
    write_checkpoint,
)
from trainer.hostring import Slot
from trainer.snapshotformat import _Ref

log = logging.getLogger("trainer.checkpoint")  # the checkpointer's one logger, whichever of its parts speaks


class DiskTier:
    """This replica's checkpoints in `directory`, one of `replicas` (the directories of the ranks that hold the
    same tensors, in the same order on each), the newest `keep` of them kept.

    A slot handed to `flush` stays the ring's: it is marked `flushing` from then until the writer no longer
    reads its buffer, or until a newer slot or a restore takes its place in the queue, and the ring does not
    reuse a slot so marked. The flag is set and cleared here only, under this tier's lock; it is set on the
    training thread, the one that looks for free slots, before the writer can see the slot, and cleared only
    once the writer is done with the buffer: the ring never sees it clear too early, and a flag cleared a
    moment ago only makes it take another slot, as if it had looked a moment earlier."""

    def __init__(self, directory: Path, replicas: list[Path], keep: int):
        self.directory, self.keep = directory, keep
        self._replicas, self._own = replicas, replicas.index(directory)
        # Shared with the writer thread, under `_changed`.
        self._changed = threading.Condition()
        self._to_write: Slot | None = None  # waiting for the writer; a newer one replaces it
        self._writing: Slot | None = None
        self._writing_step = -1  # the step being written (its slot's may change meanwhile: a restore)
        self._doomed = False  # the write in progress is of a future a restore dropped: removed once done
        self._closing = False
        self._thread = threading.Thread(target=self._write_loop, name="checkpoint-writer", daemon=True)
        self._thread.start()

    def flush(self, slot: Slot) -> Slot | None:
        """Have the writer put `slot` on disk next. It replaces a snapshot still waiting for the writer,
        returned (to be counted as skipped)."""
        with self._changed:
            superseded, self._to_write = self._to_write, slot
            if superseded is slot:
                superseded = None
            if superseded is not None:
                superseded.flushing = False
            slot.flushing = True
            self._changed.notify_all()
        return superseded

    def wait_for_writer(self) -> None:
        with self._changed:
            self._changed.wait_for(lambda: self._to_write is None and self._writing is None)

    def settle(self, keep_through: int | None = None) -> None:
        """Wait for every write asked for. With `keep_through` (a restore to that step or before), a write
        of a later step is not waited for: one not started is dropped, and one under way is removed once
        done. A rollback waited seconds for the disk to take the 1.5 GB of the very step it rolled back
        (an H200's GPT-2 job)."""
        with self._changed:
            if keep_through is not None:
                queued = self._to_write
                if queued is not None and queued.step > keep_through:
                    queued.flushing, self._to_write = False, None
                self._doomed = self._writing is not None and self._writing_step > keep_through
            self._changed.wait_for(lambda: self._to_write is None and (self._writing is None or self._doomed))

    def durable_steps(self) -> list[int]:
        """The steps of the checkpoints on disk whose manifests (every replica's) vouch for them, oldest
        first; the others are reported."""
        steps = []
        for step in sorted(self._on_disk()):
            try:
                self._manifests(step)
                steps.append(step)
            except Corrupt as e:
                self._report(step_directory(self.directory, step), step, str(e))
        return steps

    def newest(self, step_at_most: int, above: int) -> int:
        """The newest step in (`above`, `step_at_most`] on disk whose manifests vouch for it (the newer ones
        that do not are reported), else `above`."""
        for step, path in sorted(self._on_disk().items(), reverse=True):
            if above < step <= step_at_most:
                try:
                    self._manifests(step)
                    return step
                except Corrupt as e:
                    self._report(path, step, str(e))
        return above

    def load(self, step: int, live: dict[str, str | None]) -> tuple[bytes, list[_Ref], torch.Tensor] | None:
        """The checkpoint of `step` read and verified from every replica's share, of the live state's layout
        (`live`); None (reported) when it does not verify."""
        path = step_directory(self.directory, step)
        try:
            return read_checkpoint([r / path.name for r in self._replicas], self._own, step, live)
        except Corrupt as e:
            self._report(path, step, str(e))
            return None

    def drop_after(self, step: int) -> None:
        """Remove the checkpoints after `step` (a restore's future that will not happen)."""
        for later, path in self._on_disk().items():
            if later > step:
                remove(path)

    def close(self) -> None:
        """Stop the writer (the writes asked for are done: the caller waited for them)."""
        with self._changed:
            self._closing = True
            self._changed.notify_all()
        self._thread.join()

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
                path = step_directory(self.directory, step)
                with self._changed:
                    if self._doomed and path.exists():
                        remove(path)  # under the lock: no listing sees it half gone
                    slot.flushing, self._writing, self._writing_step, self._doomed = False, None, -1, False
                    self._changed.notify_all()

    def _write(self, slot: Slot, step: int) -> None:
        """Write `slot` as the checkpoint of `step` (this replica's share of its tensors), then prune."""
        path, started = step_directory(self.directory, step), time.perf_counter()
        nbytes = write_checkpoint(
            path, step, slot.meta, slot.refs, slot.buffer, slot.nbytes, self._own, len(self._replicas)
        )
        durable_s = time.perf_counter() - slot.started
        log.info("checkpoint: step %d durable in %s, %.3f s after its snapshot", step, path, durable_s)
        agent.event(
            sc.EVENT_CHECKPOINT_SAVED,
            step,
            **{
                sc.CKPT_TIER: sc.TIER_DISK,
                sc.CKPT_BYTES: nbytes,
                sc.CKPT_BLOCKED_S: slot.blocked_s,
                sc.CKPT_DURABLE_S: durable_s,
                sc.CKPT_WRITE_S: time.perf_counter() - started,
            },
        )
        complete = [p for _, p in sorted(self._on_disk().items()) if (p / MANIFEST).exists()]
        for old in set(self._on_disk().values()) - set(complete[-self.keep :]):
            remove(old)

    def _on_disk(self) -> dict[int, Path]:
        """step -> directory of every checkpoint of this replica on disk, complete or not, but for one being
        written that a restore dropped."""
        doomed = self._writing_step if self._doomed else None
        return {step: path for step, path in checkpoints_in(self.directory).items() if step != doomed}

    def _manifests(self, step: int) -> None:
        """Raise Corrupt unless every replica's manifest of `step` vouches for its files (metadata only)."""
        manifests([step_directory(r, step) for r in self._replicas], self._own, step)

    @staticmethod
    def _report(path: Path, step: int, why: str) -> None:
        log.warning("checkpoint: %s skipped: %s", path, why)
        agent.event(sc.EVENT_CHECKPOINT_CORRUPT, step, **{sc.CKPT_PATH: str(path), sc.CKPT_WHY: why})
