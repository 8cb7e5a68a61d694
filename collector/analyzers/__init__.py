"""Analyzers: pure functions from telemetry tables to findings."""

from dataclasses import dataclass, field


@dataclass
class Finding:
    """One conclusion, in the shape of the `findings` table."""

    run_id: str
    kind: str  # stragglers: rank | node | stage | widespread; hangs: hang
    ranks: list[int]
    step_start: int | None  # None where the data knows no steps (Flight Recorder dumps)
    step_end: int | None
    severity: str
    score: float  # how strong: the analyzer's own measure (docs/telemetry.md)
    summary: str
    evidence: dict = field(default_factory=dict)
    analyzer: str = field(kw_only=True)
