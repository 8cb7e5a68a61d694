"""The collector's own health, judged like a run's: the findings a team is paged on when
telemetry is being lost or delayed, or alerts are not getting through, whatever the jobs do.

A pure function of two snapshots of the collector's counters, the oldest and the newest
within the window, and its alert outbox. Findings (run "", analyzer "collector"):
- refused_exports: more than `refused_share` of the window's OTLP exports were refused
  (at least `min_requests` of them). Critical when any was refused for its token (401): that job
  loses all its telemetry (`WRONG_TOKEN`; a token check's empty export is not counted here);
  otherwise a warning (400/413/415: malformed, 503: the write queue was full; exporters retry a 503, so its
  data is late, and lost if it goes on).
- queue_filling: the write queue holds more than `queue_fill` of its limit: 503s come next.
- slow_commits: the window's p99 group commit (of at least `min_commits`) took longer than
  `slow_commit_s`: data and findings are late.
- alerts_undelivered: receivers with a notification waiting more than `outbox_wait_s`
  (the receivers that are up hear of it).
- analysis_failing: an analyzer, or a part of the analysis pass, raised within the window: which,
  and how often (the collector's log has why).
The collector being down is the one condition it cannot report itself: Prometheus' `up` does
(examples/prometheus/rankwatch-rules.yml).
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from collector.findings import COLLECTOR, COLLECTOR_RUN_ID, Finding

ANALYZER = COLLECTOR
RUN_ID = COLLECTOR_RUN_ID  # the collector's findings belong to no run
# What an export refused for its token (401) means: a job that runs with that token, whose telemetry is lost. (A
# launcher's token check, one empty export before its job starts, is counted apart: it stops the job, loses nothing.)
WRONG_TOKEN = "a job sends the wrong token and loses its telemetry"


@dataclass(frozen=True)
class Settings:
    window_s: float = 300.0  # rates are judged over this much of the past
    refused_share: float = 0.05
    min_requests: int = 20  # fewer exports in the window say nothing about a rate
    queue_fill: float = 0.8
    slow_commit_s: float = 1.0
    min_commits: int = 100  # fewer say nothing about a 99th percentile
    outbox_wait_s: float = 900.0


@dataclass(frozen=True)
class Snapshot:
    """The collector's counters at one moment (totals since it started)."""

    at: float  # seconds, monotonic
    requests: dict[int, int]  # HTTP status -> OTLP export requests answered with it
    queue_bytes: int
    max_queue_bytes: int
    commits: dict[float, int]  # bucket upper bound (s, inf last) -> commits that took at most that long
    analysis_failures: dict[str, int]  # what raised since the start (an analyzer, a part of the pass): how often


class Waiting(NamedTuple):
    """A receiver's notifications waiting in the alert outbox (rows, not a frame: judged once per analysis
    period on an idle collector too, where a frame's construction was most of the period's CPU)."""

    receiver: str
    pending: int  # notifications waiting
    waiting_s: float  # the oldest one's wait


def analyze(
    first: Snapshot, last: Snapshot, outbox: Sequence[Waiting], settings: Settings = Settings()
) -> list[Finding]:
    """The collector's health findings between `first` and `last`; `outbox`: each receiver's waiting notifications."""
    s = settings
    found = []
    codes = {code: last.requests.get(code, 0) - first.requests.get(code, 0) for code in last.requests}
    total, refused = sum(codes.values()), {code: n for code, n in codes.items() if code != 200 and n > 0}
    if total >= s.min_requests and sum(refused.values()) > s.refused_share * total:
        share = sum(refused.values()) / total
        found.append(
            _finding(
                "refused_exports",
                "critical" if 401 in refused else "warning",
                share,
                f"{100 * share:.0f}% of {total} OTLP exports refused in the last {_minutes(last.at - first.at)} ("
                + ", ".join(f"{n} x {code}" for code, n in sorted(refused.items()))
                + ")"
                + (f": {WRONG_TOKEN}" if 401 in refused else ""),
                {"requests": total, "refused": {str(code): n for code, n in sorted(refused.items())}},
            )
        )
    if last.queue_bytes > s.queue_fill * last.max_queue_bytes:
        fill = last.queue_bytes / last.max_queue_bytes
        found.append(
            _finding(
                "queue_filling",
                "warning",
                fill,
                f"the write queue is {100 * fill:.0f}% full ({last.queue_bytes / 2**20:.0f} of "
                f"{last.max_queue_bytes / 2**20:.0f} MiB): exports will be refused with 503 next",
                {"queue_bytes": last.queue_bytes, "max_queue_bytes": last.max_queue_bytes},
            )
        )
    p99 = _quantile({le: n - first.commits.get(le, 0) for le, n in last.commits.items()}, 0.99, s.min_commits)
    if p99 is not None and p99 > s.slow_commit_s:
        found.append(
            _finding(
                "slow_commits",
                "warning",
                p99,
                f"99% of group commits took up to {p99:g} s in the last {_minutes(last.at - first.at)}: "
                "telemetry and findings are late",
                {"commit_p99_s": p99},
            )
        )
    stuck = sorted((w for w in outbox if w.waiting_s > s.outbox_wait_s), key=lambda w: w.receiver)
    if stuck:
        found.append(
            _finding(
                "alerts_undelivered",
                "warning",
                float(max(w.waiting_s for w in stuck)),
                "alert notifications wait for "
                + ", ".join(
                    f"receiver {w.receiver} ({w.pending}, the oldest for {_minutes(w.waiting_s)})" for w in stuck
                ),
                {
                    "receivers": {
                        w.receiver: {"pending": int(w.pending), "waiting_s": float(w.waiting_s)} for w in stuck
                    }
                },
            )
        )
    failed = {
        what: n - first.analysis_failures.get(what, 0)
        for what, n in sorted(last.analysis_failures.items())
        if n > first.analysis_failures.get(what, 0)
    }
    if failed:
        parts = ", ".join(f"{what} {n} time(s)" for what, n in sorted(failed.items(), key=lambda kv: -kv[1]))
        found.append(
            _finding(
                "analysis_failing",
                "warning",
                float(sum(failed.values())),
                f"analysis failed in the last {_minutes(last.at - first.at)}: {parts}; findings may be missing "
                "(the collector's log says why)",
                {"failures": failed},
            )
        )
    return found


def _finding(kind: str, severity: str, score: float, summary: str, evidence: dict) -> Finding:
    return Finding(RUN_ID, kind, [], None, None, severity, score, summary, evidence, analyzer=ANALYZER)


def _quantile(buckets: dict[float, int], q: float, at_least: int) -> float | None:
    """The smallest bucket bound with at least `q` of the commits at or below it (None: fewer than
    `at_least` commits)."""
    total = buckets.get(math.inf, 0)
    if total < max(at_least, 1):
        return None
    return next(le for le, n in sorted(buckets.items()) if n >= q * total)


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.0f} min" if seconds >= 90 else f"{seconds:.0f} s"
