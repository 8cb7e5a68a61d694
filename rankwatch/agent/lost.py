"""Telemetry dropped before the collector acknowledged it, counted per rank: spans, the rank-steps among
them, log records. Counted wherever it is dropped (a full queue, a backlog's overflow, a refusal, what
still waits at exit) and reported to the collector as `telemetry_loss` events (rankwatch/agent/export.py)."""

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from opentelemetry.sdk.resources import Resource

from rankwatch.agent import semconv as sc
from rankwatch.agent.spanwire import Attributes, Span, Trace


def _is_step(attributes: Attributes) -> bool:
    return attributes.get(sc.KIND) == sc.KIND_STEP


@dataclass
class Lost:
    """Telemetry dropped before the collector acknowledged it, cumulative since the process
    started: spans, the rank-steps among them (`step` spans), log records."""

    spans: int = 0
    rank_steps: int = 0
    records: int = 0

    def __bool__(self) -> bool:
        return bool(self.spans or self.rank_steps or self.records)

    def __add__(self, other: "Lost") -> "Lost":
        return Lost(self.spans + other.spans, self.rank_steps + other.rank_steps, self.records + other.records)


class Losses:
    """What was dropped, per resource (the rank it is from: the fleet simulator speaks for many).
    Counted where it is dropped: on the training thread only when its queue is full (a lock and a
    few additions), else on the export thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_resource: dict[int, tuple[Resource, Lost]] = {}

    def _of(self, resource: Resource) -> Lost:
        return self._by_resource.setdefault(id(resource), (resource, Lost()))[1]

    def spans(self, spans: Iterable[Span]) -> None:
        with self._lock:
            for span in spans:
                lost = self._of(span.resource)
                lost.spans += 1
                lost.rank_steps += _is_step(span.attributes)

    def traces(self, traces: Iterable[Trace]) -> None:
        with self._lock:
            for trace in traces:
                lost = self._of(trace.resource)
                lost.spans += len(trace.spans)
                lost.rank_steps += _is_step(trace.spans[0][3])

    def refused(self, spans: Sequence[Span], count: int) -> None:
        """`count` spans of a batch refused by the collector, which says how many, not which: the
        batch's step spans counted as refused up to `count`, all charged to its first rank."""
        with self._lock:
            lost = self._of(spans[0].resource)
            lost.spans += count
            lost.rank_steps += min(count, sum(_is_step(s.attributes) for s in spans))

    def records(self, resource: Resource, count: int) -> None:
        with self._lock:
            self._of(resource).records += count

    def add(self, resource: Resource, lost: Lost) -> None:
        """What was dropped before it reached this exporter (a rank's link to its node's sidecar)."""
        with self._lock:
            counts = self._of(resource)
            counts.spans, counts.rank_steps, counts.records = (
                counts.spans + lost.spans,
                counts.rank_steps + lost.rank_steps,
                counts.records + lost.records,
            )

    def by_resource(self) -> list[tuple[Resource, Lost]]:
        """A copy of each resource's counts."""
        with self._lock:
            return [(resource, Lost(**vars(lost))) for resource, lost in self._by_resource.values()]

    def total(self) -> Lost:
        return sum((lost for _, lost in self.by_resource()), Lost())
