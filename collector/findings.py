"""A finding as the analysis publishes it and its consumers read it: the `Finding`, the names a consumer acts
on, and how a consumer subscribes (`Consumer`).

The analysis (collector/analysis/) draws findings and records them; it knows its consumers only through this
protocol, and collector/writertasks.py registers them: the alert outbox (collector/alerts/outbox.py), rollbacks
and stacks requests (collector/control/commands.py). A leaf: it imports nothing of the project, so that the
analyzers, the consumers and the dashboard all read it and none of them reads another for it.
"""

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import ClassVar

import duckdb

# A finding's severity: a recommendation or a note, something to look at, something to act on now
INFO, WARNING, CRITICAL = "info", "warning", "critical"
NOT_JUDGED = "not_judged"  # a finding's kind where an analyzer could not judge; its summary says why

# The analyzers whose findings a consumer acts on (each analyzer's ANALYZER), and the kinds it reads
ANOMALIES = "anomalies"  # rolled back
NAN, LOSS_SPIKE, GRAD_SPIKE = "nan", "loss_spike", "grad_spike"
HANGS = "hangs"  # every rank asked for its stacks
HANG = "hang"
POWER = "power"  # drawn on a timer of its own (a power report)
COLLECTOR = "collector"  # the collector's own findings: its health, and a run's analyzers that failed on it
COLLECTOR_RUN_ID = ""  # the run the collector's health findings are recorded under: none


@dataclass
class Finding:
    """One conclusion, in the shape of the `findings` table."""

    run_id: str  # a summary that states its onset says "since step N", N its step_start (`spanning`)
    kind: str  # stragglers: rank | node | stage | widespread | not_judged; hangs: hang
    ranks: list[int]
    step_start: int | None  # None where the data knows no steps (Flight Recorder dumps)
    step_end: int | None
    severity: str
    score: float  # how strong: the analyzer's own measure (docs/telemetry.md)
    summary: str
    evidence: dict = field(default_factory=dict)
    analyzer: str = field(kw_only=True)

    def spanning(self, step_start: int, step_end: int) -> "Finding":
        """This finding speaking for an episode spanning `step_start` to `step_end`: one pass sees a
        few history steps only, so the onset it states ("since step N" in its summary, N its
        `step_start`) becomes the episode's, the earliest any pass found."""
        summary = re.sub(rf"\bsince step {self.step_start}\b", f"since step {step_start}", self.summary)
        return replace(self, step_start=step_start, step_end=step_end, summary=summary)


@dataclass(frozen=True)
class Changes:
    """What one recording changed of a run's findings of one analyzer: the findings drawn (new ones, and firing
    ones drawn again, each with its row id) and the rows that stopped firing."""

    run_id: str
    analyzer: str
    drawn: list[tuple[int, Finding]]
    ended: list[int]


@dataclass(frozen=True)
class Pass:
    """One pass of the analysis over a run, its findings recorded: what each analyzer that judged found,
    whether the pass judged steps (`new_steps`; else only time had passed), and whether it was the last before
    the collector stops."""

    run_id: str
    found: Mapping[str, list[Finding]]
    new_steps: bool
    last: bool


class Consumer:
    """A subscriber to what the analysis publishes; each overrides what it reads, on the analysis's cursor of
    the store (the writer process's). `name`: what its failures are counted as (the collector's health)."""

    name: ClassVar[str] = "consumer"

    def on_changes(self, con: duckdb.DuckDBPyConnection, changes: Changes) -> None:
        """A change to a run's findings, inside the transaction that makes it: what this writes commits with
        the change or not at all, and what it raises rolls the change back."""

    def on_pass(self, con: duckdb.DuckDBPyConnection, judged: Pass) -> None:
        """A pass over a run, its findings committed; what this raises is logged and counted, and the pass
        goes on."""

    def on_timer(self, con: duckdb.DuckDBPyConnection, runs: Sequence[str] | None) -> None:
        """A pass of the timer's (what the passing of time alone moves); `runs`: those this collector leads
        in a lake (collector/store/lake.py), None: every run. What this raises is logged and counted."""
