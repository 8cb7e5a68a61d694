"""Interval arithmetic over one step's timeline: the exposed communication wait.

Pure functions over (start, end) pairs of integer ns, so that the same
arithmetic serves GPU event timings, CPU monotonic readings and recorded
profiler timelines, and can be tested without a GPU. A step holds a few
dozen intervals: plain Python, no numpy.
"""

from collections.abc import Iterable, Sequence

Interval = tuple[int, int]


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """The intervals merged: sorted, disjoint, none empty."""
    merged: list[list[int]] = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def length(intervals: Iterable[Interval]) -> int:
    """Time covered by the intervals (overlaps counted once)."""
    return sum(e - s for s, e in union(intervals))


def subtract(intervals: Iterable[Interval], holes: Iterable[Interval]) -> list[Interval]:
    """The time of `intervals` that no interval of `holes` covers, merged."""
    out: list[Interval] = []
    cuts = union(holes)
    for start, end in union(intervals):
        for hole_start, hole_end in cuts:
            if hole_end <= start or hole_start >= end:
                continue
            if hole_start > start:
                out.append((start, hole_start))
            start = max(start, hole_end)
            if start >= end:
                break
        if start < end:
            out.append((start, end))
    return out


def clip(intervals: Iterable[Interval], window: Interval) -> list[Interval]:
    """The intervals cut to `window`, the empty ones dropped."""
    lo, hi = window
    return [(max(s, lo), min(e, hi)) for s, e in intervals if min(e, hi) > max(s, lo)]


def serialized(launches: Sequence[Interval]) -> list[Interval]:
    """Operations of one stream, in issue order, as (launch, end): each starts when it was
    launched or when the one before it ended, whichever is later (a stream runs one at a time)."""
    out: list[Interval] = []
    for launch, end in launches:
        start = max(launch, out[-1][1]) if out else launch
        out.append((min(start, end), end))
    return out


def exposed(comm: Iterable[Interval], compute: Iterable[Interval], window: Interval) -> int:
    """Exposed communication within `window` (a step): the time some communication is in flight
    and no compute covers it. 0 <= exposed <= the window's length and <= the union of `comm`."""
    return length(clip(subtract(comm, compute), window))
