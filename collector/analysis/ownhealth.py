"""The collector's own health, judged on the analysis thread as a run is (analyzers/health.py): once per
analysis period the server hands the writer its counters (collector/analysis/live.py's HealthCounters),
and each report is judged with the writer's own (what raised in the analysis, the alert outbox's oldest
waiting notification per receiver) against the oldest report within the window.
"""

import collections
import time
from collections.abc import Mapping

import duckdb

from collector.analysis.analyzers import health
from collector.findings import Finding

_OUTBOX = """SELECT receiver, count(*) AS pending, epoch(now() - min(created_at)) AS waiting_s FROM outbox
             WHERE state = 'pending' GROUP BY receiver"""


class CollectorHealth:
    """The server's counters as they are reported, and those within the window."""

    def __init__(self) -> None:
        self.run_id = health.RUN_ID  # the run its findings are recorded under (in a lake: each collector's own)
        self.started = time.monotonic()
        self.window: collections.deque[health.Snapshot] = collections.deque()  # within the window, oldest first
        # the server's counters not yet judged (HealthCounters' fields, and when they came): appended by the writer
        # thread, taken by the analysis thread
        self.reported: collections.deque[dict] = collections.deque()

    def report(self, counters: Mapping[str, object]) -> None:
        self.reported.append(dict(counters, at=time.monotonic()))

    def judge(
        self,
        con: duckdb.DuckDBPyConnection,
        counters: dict,
        failures: dict[str, int],
        settings: health.Settings = health.Settings(),
    ) -> list[Finding]:
        """The collector's health findings, from reported `counters` and the analysis's `failures` now and the
        oldest report within the window."""
        snapshot = health.Snapshot(analysis_failures=failures, **counters)
        if not self.window:  # the counters began at zero: what came before the first report counts too
            self.window.append(health.Snapshot(self.started, {}, 0, snapshot.max_queue_bytes, {}, {}))
        self.window.append(snapshot)
        while snapshot.at - self.window[0].at > settings.window_s:
            self.window.popleft()
        outbox = [health.Waiting(*row) for row in con.execute(_OUTBOX).fetchall()]
        return health.analyze(self.window[0], snapshot, outbox, settings)
