"""The live analysis in a lake shared by several collectors (collector/store/lake.py).

A run's ranks may send to any of the collectors, so each follows every collector's commits, not only its
own: every FOLLOW_S it reads the steps and events the lake's new snapshots inserted. Each run is judged by
one collector at a time, the holder of its lease in the lake's catalog database, taken at a pass and
renewed at every pass after (a timer pass comes every RENEW_S at least): when that collector dies, its
lease expires within LEASE_HELD and the next collector's pass takes it over, from the cursor the last
stored. A collector stopping gives its leases up at once.
"""

import logging
from collections.abc import Sequence
from datetime import timedelta

import duckdb
import pyarrow as pa

from collector.store import lake

log = logging.getLogger("rankwatch.analysis")
# How often every collector's new commits are read, how long a run's lease holds, and how often a collector
# judges (and so renews the leases of) every run it follows, new steps or not.
FOLLOW_S = 0.5
LEASE_HELD = timedelta(seconds=6)
RENEW_S = 2.0


class LakeFollower:
    """Where this collector stands in the lake: the newest snapshot whose commits it read, and the runs whose
    lease it holds."""

    def __init__(self) -> None:
        self.snapshot: int | None = None  # the newest snapshot whose commits were read (None: none yet)
        self.leased: set[str] = set()  # the runs whose lease this collector holds

    def inserted(self, con: duckdb.DuckDBPyConnection) -> dict[str, list[pa.Table]] | None:
        """What the commits of every collector inserted since the last call, as a commit's tables (steps:
        run_id, step; events: run_id, event); None where the lake has no new snapshot (the first call only
        notes where it stands)."""
        (newest,) = con.execute(f"SELECT id FROM {lake.LAKE}.current_snapshot()").fetchone() or (None,)
        if newest is None:
            return None
        seen, self.snapshot = self.snapshot, newest
        if seen is None or newest <= seen:
            return None
        return {
            table: [
                con.execute(
                    f"SELECT {columns} FROM ducklake_table_changes(?, 'main', ?, ?, ?) WHERE change_type = 'insert'",
                    [lake.LAKE, table, seen + 1, newest],
                ).fetch_arrow_table()
            ]
            for table, columns in (("steps", "run_id, step"), ("events", "run_id, event"))
        }

    def lead(self, con: duckdb.DuckDBPyConnection, runs: Sequence[str]) -> tuple[list[str], list[str]]:
        """The runs of `runs` this collector leads, their leases taken or renewed; and those whose lease it
        took or lost since the last pass (another collector may have judged them meanwhile)."""
        led, changed = [], []
        for run_id in runs:
            try:
                holds = lake.lease(con, "run", run_id, LEASE_HELD)
            except duckdb.Error:
                log.exception("the lease of run %s could not be taken", run_id)
                holds = False
            if holds != (run_id in self.leased):
                changed.append(run_id)
            if holds:
                self.leased.add(run_id)
                led.append(run_id)
            else:
                self.leased.discard(run_id)
        return led, changed

    def give_up(self, con: duckdb.DuckDBPyConnection) -> None:
        """The leases this collector holds, given up as it stops: the next collector's pass takes them over."""
        lake.give_up(con, "run", sorted(self.leased))
