"""A lake's upkeep over weeks (collector/store/lake.py): every commit of every collector is a DuckLake
snapshot with Parquet files of its own, a few thousand rows each, so a weeks-long run would leave
millions of small files that every scan must open. One collector at a time, the holder of the lake's
`upkeep` lease, every `every_s`:

- merges adjacent small files into large ones (DuckLake's `ducklake_merge_adjacent_files`);
- with `retain_days`, deletes the telemetry older than that (by each row's own time);
- expires the snapshots older than SNAPSHOTS_KEPT (the collectors follow the newest ones, a reader's
  transaction holds its own) and deletes the files no snapshot left reads, once FILES_KEPT old.

A task of the writer process (collector/store/writer.py), on a thread and a cursor of its own; in a
store file it does nothing (DuckDB's own checkpoints keep one file).
"""

import logging
from datetime import timedelta

import duckdb

from collector.store import lake
from collector.store.schema import TELEMETRY_TABLES
from collector.store.writer import PeriodicTask

log = logging.getLogger("rankwatch.upkeep")
SNAPSHOTS_KEPT = timedelta(hours=1)
FILES_KEPT = timedelta(hours=1)
# Each telemetry table's time column: what `retain_days` is judged by.
_TIME = {"steps": "end_ts", "ops": "end_ts", "device_samples": "ts", "events": "ts"}
assert set(_TIME) == set(TELEMETRY_TABLES)


class Upkeep(PeriodicTask):
    """The writer's upkeep task; idle unless its store is a lake."""

    thread_name = "rankwatch-upkeep"

    def __init__(self, every_s: float = 600.0, retain_days: float | None = None):
        self.every_s, self.retain_days = every_s, retain_days

    def wanted(self, con: duckdb.DuckDBPyConnection) -> bool:
        return lake.attached(con)

    def tick(self, con: duckdb.DuckDBPyConnection) -> None:
        try:
            if lake.lease(con, "upkeep", "", timedelta(seconds=self.every_s * 2)):
                self.once(con)
        except duckdb.Error:
            log.exception("the lake's upkeep failed; it is tried again in %g s", self.every_s)

    def once(self, con: duckdb.DuckDBPyConnection) -> None:
        """One round of upkeep, on `con` (a lake's connection)."""
        if self.retain_days:
            for table, column in _TIME.items():
                con.execute(
                    f"DELETE FROM {table} WHERE {column} < make_timestamp(epoch_us(now())) - ?::INTERVAL",
                    [timedelta(days=self.retain_days)],
                )
        con.execute("CALL ducklake_merge_adjacent_files(?)", [lake.LAKE])
        con.execute("CALL ducklake_expire_snapshots(?, older_than => now() - ?::INTERVAL)", [lake.LAKE, SNAPSHOTS_KEPT])
        con.execute("CALL ducklake_cleanup_old_files(?, older_than => now() - ?::INTERVAL)", [lake.LAKE, FILES_KEPT])
