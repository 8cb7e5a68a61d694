"""The server's counters for the collector's health, as it hands them to the writer's analysis: a store request
of its own module, light enough for the server's process, which imports no analysis (collector/writertasks.py).
The analysis answers it (collector/analysis/live.py: the writer builds its analysis, and with it the answer's
registration, before its first request)."""

from dataclasses import dataclass

from collector.store.requests import Request


@dataclass(frozen=True)
class HealthCounters(Request[None]):
    """health.Snapshot's fields but the writer's own, handed over once per analysis period."""

    requests: dict[int, int]
    commits: dict[float, int]
    queue_bytes: int
    max_queue_bytes: int
