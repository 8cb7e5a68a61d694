"""The collector's DuckDB file, and the single writer thread that fills it.

Requests are queued with their decoded Arrow batches; the writer takes
everything that piled up since its last commit and appends it in one
transaction (group commit), then resolves each request's future. A request
is acknowledged only once that future resolves, so an acknowledged row is
in DuckDB's write-ahead log and survives a crash.

A retried export is recognised by the digest of its decompressed body (the
OpenTelemetry exporters resend the same serialized bytes) and acknowledged
without writing again. Digests are kept, in the `exports` table and in
memory, for DIGEST_RETENTION, far longer than any exporter retries.
"""

import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import duckdb
import pyarrow as pa

from collector.decode import Decoded
from collector.schema import DDL, TELEMETRY_TABLES

DIGEST_RETENTION = timedelta(hours=1)
_STOP = object()

# Placement rows change rarely (a rank restarted elsewhere); they are written only when they do.
_UPSERT_RANKS = """
INSERT INTO ranks BY NAME SELECT * EXCLUDE (world_size), now() AS first_seen FROM new_ranks
ON CONFLICT (run_id, rank) DO UPDATE SET
    host = coalesce(excluded.host, host), local_rank = coalesce(excluded.local_rank, local_rank),
    dp_rank = coalesce(excluded.dp_rank, dp_rank), pp_stage = coalesce(excluded.pp_stage, pp_stage),
    tp_rank = coalesce(excluded.tp_rank, tp_rank), device = coalesce(excluded.device, device),
    pid = coalesce(excluded.pid, pid)
"""
_UPSERT_RUNS = """
INSERT INTO runs SELECT run_id, max(world_size), now() FROM new_ranks GROUP BY run_id
ON CONFLICT (run_id) DO UPDATE SET world_size = coalesce(excluded.world_size, world_size)
"""


class Overloaded(Exception):
    """The write queue is full; the client should retry later."""


class StoreLocked(Exception):
    """Another process holds the store open for writing."""


def connect(path: Path, read_only: bool = False) -> duckdb.DuckDBPyConnection:
    """Open a store file, with a one-line StoreLocked error when a collector holds it."""
    try:
        return duckdb.connect(str(path), read_only=read_only)
    except duckdb.IOException as e:
        if "lock" in str(e).lower():
            raise StoreLocked(f"{path} is held open by a running collector ({str(e).split('(')[-1].rstrip(')')}); "
                              "stop it first or query through the collector") from None
        raise


@dataclass
class _Pending:
    digest: bytes
    decoded: Decoded
    future: Future


class Store:
    """The only writer of one DuckDB file."""

    def __init__(self, path: Path, max_queue_items: int = 2_000_000,
                 on_commit: Callable[[float, int], None] | None = None):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.max_queue_items = max_queue_items
        self._on_commit = on_commit
        self._con = connect(path)
        self._con.execute(DDL)
        self._digests: OrderedDict[bytes, float] = OrderedDict(
            (d, t) for d, t in self._con.execute(
                "SELECT digest, epoch(received_at) FROM exports WHERE received_at > now() - ?::INTERVAL "
                "ORDER BY received_at", [DIGEST_RETENTION]).fetchall())
        cursor = self._con.execute("SELECT ranks.*, world_size FROM ranks JOIN runs USING (run_id)")
        columns = [d[0] for d in cursor.description]
        self._placements = {row[:2]: dict(zip(columns, row)) for row in cursor.fetchall()}
        self._queue: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._queued_items = 0
        self._writer = threading.Thread(target=self._run, name="rankwatch-writer", daemon=True)
        self._writer.start()

    @property
    def queued_items(self) -> int:
        return self._queued_items

    def submit(self, digest: bytes, decoded: Decoded) -> Future:
        """Queue a decoded request; the future resolves to True once committed,
        False when it was a duplicate. Raises Overloaded when the queue is full."""
        with self._lock:
            if self._queued_items and self._queued_items + decoded.accepted > self.max_queue_items:
                raise Overloaded(f"write queue full ({self._queued_items} items)")
            self._queued_items += decoded.accepted
        pending = _Pending(digest, decoded, Future())
        self._queue.put(pending)
        return pending.future

    def close(self) -> None:
        """Drain the queue, checkpoint the WAL into the file, and close."""
        self._queue.put(_STOP)
        self._writer.join()
        self._con.execute("CHECKPOINT")
        self._con.close()

    def _run(self) -> None:
        while True:
            group = [self._queue.get()]
            while not self._queue.empty():
                group.append(self._queue.get_nowait())
            stop = group[-1] is _STOP
            group = [p for p in group if p is not _STOP]
            if group:
                self._commit(group)
            if stop:
                return

    def _commit(self, group: list[_Pending]) -> None:
        started = time.perf_counter()
        fresh: dict[bytes, _Pending] = {}
        for p in group:
            if p.digest not in self._digests:
                fresh.setdefault(p.digest, p)
        rows = 0
        try:
            self._con.begin()
            for table in TELEMETRY_TABLES:
                parts = [p.decoded.tables[table] for p in fresh.values() if table in p.decoded.tables]
                if parts:
                    batch = pa.concat_tables(parts, promote_options="default")
                    rows += batch.num_rows
                    self._append(table, batch)
            ranks = self._changed_placements(r for p in fresh.values() for r in p.decoded.ranks)
            if ranks:
                self._con.register("new_ranks", pa.Table.from_pylist(ranks))
                self._con.execute(_UPSERT_RANKS)
                self._con.execute(_UPSERT_RUNS)
                self._con.unregister("new_ranks")
            if fresh:
                self._con.register("new_exports", pa.table({
                    "digest": list(fresh), "signal": [p.decoded.signal for p in fresh.values()],
                    "items": [p.decoded.accepted for p in fresh.values()]}))
                self._con.execute("INSERT INTO exports SELECT *, now() FROM new_exports")
                self._con.unregister("new_exports")
            self._con.commit()
        except Exception as e:  # the whole group fails; each client retries
            self._con.rollback()
            self._settle(group, error=e)
            return
        for r in ranks:
            self._placements[r["run_id"], r["rank"]] = r
        now = time.time()
        for digest in fresh:
            self._digests[digest] = now
        self._forget_old_digests(now)
        if self._on_commit:
            self._on_commit(time.perf_counter() - started, rows)
        self._settle(group, fresh=fresh)

    def _append(self, table: str, batch: pa.Table) -> None:
        self._con.from_arrow(batch).insert_into(table)  # decode built it column for column

    def _changed_placements(self, ranks) -> list[dict]:
        changed = {}
        for r in ranks:
            known = self._placements.get((r["run_id"], r["rank"]))
            if known is None or any(v is not None and known.get(k) != v for k, v in r.items()):
                changed[r["run_id"], r["rank"]] = r
        return list(changed.values())

    def _settle(self, group: list[_Pending], fresh: dict | None = None, error: Exception | None = None) -> None:
        with self._lock:
            self._queued_items -= sum(p.decoded.accepted for p in group)
        for p in group:
            if error is not None:
                p.future.set_exception(error)
            else:
                p.future.set_result(fresh.get(p.digest) is p)

    def _forget_old_digests(self, now: float) -> None:
        horizon = now - DIGEST_RETENTION.total_seconds()
        if self._digests and next(iter(self._digests.values())) < horizon:
            while self._digests and next(iter(self._digests.values())) < horizon:
                self._digests.popitem(last=False)
            self._con.execute("DELETE FROM exports WHERE received_at < now() - ?::INTERVAL", [DIGEST_RETENTION])
