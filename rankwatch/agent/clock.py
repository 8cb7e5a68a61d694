"""Timestamps for spans: one time base across ranks, and GPU timings without a sync.

Every rank reports times in rank 0's wall clock: the offset between clocks
is estimated through the job's process group (all ranks read their clock
right after a barrier; the median difference over a few rounds) at start and
again every few hundred steps.

On CUDA a phase is timed by events recorded on the current stream and read
back once the GPU has passed them (`Event.query()`), never by synchronizing
the training stream. `Event.elapsed_time` is float32 milliseconds, whose
resolution decays with the interval (62 µs at 10 minutes, 8 ms at a day), so
every duration is read from its step's start event (`between`), never from
far away, and only the step's start is placed on the wall clock, through an
anchor event tied to the host clock at start and again at each re-alignment
(`retie`: the one sync, every few hundred steps). On CPU the marks are
monotonic-clock readings.
"""

import statistics
import time
from typing import Any, Protocol


class Clock:
    """Monotonic readings -> wall-clock ns in the job's common time base."""

    def __init__(self) -> None:
        self._wall_minus_mono = time.time_ns() - time.monotonic_ns()
        self.offset_ns = 0  # this rank's clock -> rank 0's clock

    def now_ns(self) -> int:
        return time.monotonic_ns() + self._wall_minus_mono + self.offset_ns

    def wall(self, monotonic_ns: int) -> int:
        return monotonic_ns + self._wall_minus_mono + self.offset_ns

    def align(self, rounds: int = 5) -> None:
        """Estimate the offset to rank 0 through the default process group (a collective:
        every rank must call it at the same point)."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return
        offsets = []
        for _ in range(rounds):
            dist.barrier()
            mine = time.monotonic_ns() + self._wall_minus_mono
            readings: list = [None] * dist.get_world_size()
            dist.all_gather_object(readings, mine)
            offsets.append(readings[0] - mine)
        self.offset_ns = int(statistics.median(offsets))


class Timer(Protocol):
    """What a session needs of a timer. Its marks are opaque to the session (ns on CPU, CUDA
    events on a GPU), hence Any; a timer also reads an int mark as monotonic ns (a collective of a
    group the GPU does not run, gloo's)."""

    def mark(self) -> Any: ...

    def current_stream(self) -> int | None:
        """The stream marks are taken on now, where they are stream events (else None)."""

    def ready(self, mark: Any) -> bool: ...

    def release(self, marks: list[Any]) -> None: ...

    def to_wall(self, clock: Clock, mark: Any) -> int: ...

    def between(self, a: Any, b: Any) -> int: ...

    def retie(self) -> None: ...


class CpuTimer:
    """Marks are monotonic-clock readings; they are ready at once."""

    def mark(self) -> int:
        return time.monotonic_ns()

    def current_stream(self) -> None:
        return None

    def ready(self, mark: int) -> bool:
        return True

    def release(self, marks) -> None:
        """Marks that were read (nothing to give back on CPU)."""

    def to_wall(self, clock: Clock, mark: int) -> int:
        return clock.wall(mark)

    def between(self, a: int, b: int) -> int:
        """ns from mark `a` to mark `b`."""
        return b - a

    def retie(self) -> None:
        """Nothing to tie: the marks are host readings."""


class CudaTimer:
    """Marks are CUDA events on the current stream, read once the GPU has passed them; int marks
    are monotonic ns (a gloo group's collectives)."""

    def __init__(self, device) -> None:
        import torch

        self._torch, self._device = torch, device
        self._free: list = []  # events already read, recorded again rather than made anew
        self._streams: dict[int, Any] = {}  # stream id -> its object, for Event.record
        self._tie: tuple = ()
        self.retie()

    def retie(self) -> None:
        """Tie GPU time to the host clock: an event recorded on an idle GPU runs as it is launched, so
        its host time is the midpoint of the launch and the sync that follows (a sync: at start and at
        re-alignments only)."""
        anchor = self._torch.cuda.Event(enable_timing=True)
        self._torch.cuda.synchronize(self._device)
        before = time.monotonic_ns()
        anchor.record()
        self._torch.cuda.synchronize(self._device)
        self._tie = (anchor, (before + time.monotonic_ns()) // 2)  # one assignment: readers see either tie

    def mark(self):
        try:
            event = self._free.pop()
        except IndexError:  # none free (pop is atomic: the autograd thread marks buckets too)
            event = self._torch.cuda.Event(enable_timing=True)
        stream_id, index, kind = self._torch._C._cuda_getCurrentStream(self._device)
        stream = self._streams.get(stream_id)
        if stream is None:
            stream = self._streams[stream_id] = self._torch.cuda.Stream(
                stream_id=stream_id, device_index=index, device_type=kind
            )
        event.record(stream)  # given: Event.record() alone asks torch.cuda.current_stream(), tens of µs
        return event

    def current_stream(self) -> int:
        """The current stream's id, from torch's C binding: torch.cuda.current_stream() resolves the
        device anew on every call, which cost a DDP bucket's hook tens of µs on an H200's host."""
        return self._torch._C._cuda_getCurrentStream(self._device)[0]

    def ready(self, mark) -> bool:
        return type(mark) is int or mark.query()

    def release(self, marks) -> None:
        """Events of a step that was read: they are recorded again for later marks."""
        self._free.extend(m for m in marks if type(m) is not int)

    def to_wall(self, clock: Clock, mark) -> int:
        """Where a mark lies on the wall clock, to float32's resolution of its distance from the last tie."""
        return clock.wall(self._monotonic(mark))

    def between(self, a, b) -> int:
        """ns from mark `a` to mark `b`: for two events exact to float32's resolution of that interval alone."""
        if type(a) is int or type(b) is int:
            return self._monotonic(b) - self._monotonic(a)
        return round(a.elapsed_time(b) * 1e6)

    def _monotonic(self, mark) -> int:
        if type(mark) is int:
            return mark
        anchor, anchor_mono = self._tie
        return anchor_mono + round(anchor.elapsed_time(mark) * 1e6)
