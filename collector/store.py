"""The collector's DuckDB file, and the single writer process that fills it.

Requests are queued with their decoded Arrow batches; the writer takes
everything that piled up since its last commit and appends it in one
transaction (group commit), then acknowledges each request. A request is
answered only once acknowledged, so an acknowledged row is in DuckDB's
write-ahead log and survives a crash.

The writer is a process of its own because DuckDB's Python API takes the GIL
back many times per statement: next to a busy event loop every transaction
waited out the interpreter's switch interval again and again (9x slower,
measured). Alone in its process, the writer never waits for the GIL.
Read-only queries (the query API) run in that process too, the only one that
can read the file, but on threads of their own with a cursor each: they read
a snapshot and never hold up a commit.

A retried export is recognised by the digest of its decompressed body (the
OpenTelemetry exporters resend the same serialized bytes) and acknowledged
without writing again. Digests are kept, in the `exports` table and in
memory, for DIGEST_RETENTION, far longer than any exporter retries.
"""

import itertools
import multiprocessing
import queue
import re
import threading
import time
from collections import OrderedDict, defaultdict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from collector import commands, readonly
from collector.alerts.delivery import Delivery
from collector.analysis import Analysis
from collector.analyzers import health
from collector.children import die_with_parent
from collector.decode import Decoded
from collector.runmetrics import OPERATIONS as METRICS_OPERATIONS
from collector.schema import DDL, TELEMETRY_TABLES

DIGEST_RETENTION = timedelta(hours=1)
# How long the writer collects requests into one transaction. A commit costs
# milliseconds however small it is, so under load a group must be large;
# 10 ms of added latency is nothing to an exporter that batches for seconds.
GROUP_LINGER_S = 0.010
# Threads for read-only queries (the query API): they read snapshots beside the commit loop.
QUERY_THREADS = 2

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


@dataclass
class Call:
    """A request for the writer: an operation of collector/commands.py or runmetrics.py by name, "query",
    or "health" (the server's counters, for collector/analyzers/health.py)."""

    id: int
    operation: str
    kwargs: dict


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
            holder = re.search(r"PID (\d+)", str(e))
            raise StoreLocked(f"{path} is held open by a running collector"
                              f"{f' (pid {holder[1]})' if holder else ''}; stop it first") from None
        raise


class _Writer:
    """The writer process's side: owns the connection, commits groups, and runs the
    analyzers between commits (it alone can read the store while the collector runs)."""

    def __init__(self, path: Path, analysis: Analysis):
        self._analysis = analysis
        self._con = connect(path)
        # One DuckDB thread: the writer shares the machine with decoding, and a
        # parallel insert of a few thousand rows costs more than it gains.
        self._con.execute("SET threads TO 1")
        self._con.execute(DDL)
        self._digests: OrderedDict[bytes, float] = OrderedDict(
            (d, t) for d, t in self._con.execute(
                "SELECT digest, epoch(received_at) FROM exports WHERE received_at > now() - ?::INTERVAL "
                "ORDER BY received_at", [DIGEST_RETENTION]).fetchall())
        cursor = self._con.execute("SELECT ranks.*, world_size FROM ranks JOIN runs USING (run_id)")
        columns = [d[0] for d in cursor.description]
        self._placements = {row[:2]: dict(zip(columns, row)) for row in cursor.fetchall()}
        readonly.lock_down(self._con, path.parent)
        self._queries = ThreadPoolExecutor(QUERY_THREADS, thread_name_prefix="rankwatch-query")
        self._delivery = Delivery(self._con, analysis.alerts)  # posts alert notifications from the outbox

    def run(self, requests, acks) -> None:
        """Commit what arrives within GROUP_LINGER_S of the first request, acknowledge it,
        repeat; on None, checkpoint and stop."""
        while True:
            try:
                group = [requests.get(timeout=self._analysis.due_in())]
            except queue.Empty:
                self._analysis.run(self._con)
                continue
            deadline = time.monotonic() + GROUP_LINGER_S
            while group[-1] is not None and (left := deadline - time.monotonic()) > 0:
                try:
                    group.append(requests.get(timeout=left))
                except queue.Empty:
                    break
            stop = group[-1] is None
            calls = [g for g in group if isinstance(g, Call)]
            group = [g for g in group if g is not None and not isinstance(g, Call)]
            if group:
                acks.put(self._commit(group))
            for call in calls:
                if call.operation == "query":  # on a query thread: a slow query never holds up commits
                    self._queries.submit(self._query, call, acks)
                elif call.operation in METRICS_OPERATIONS:  # reads too: on a query thread
                    self._queries.submit(self._read, call, acks)
                elif call.operation == "health":
                    acks.put(self._judge_health(call))
                else:
                    acks.put(self._call(call))
            if not self._analysis.due_in() and not stop:
                self._analysis.run(self._con)
            if stop:
                self._queries.shutdown()  # queries end within their time limit
                self._analysis.close(self._con)
                self._delivery.close()
                self._con.execute("CHECKPOINT")
                self._con.close()
                acks.put(("closed",))
                return

    def _call(self, call: "Call") -> tuple:
        """("result", call id, value) or ("error", call id, exception) of a control API operation."""
        try:
            return ("result", call.id, commands.OPERATIONS[call.operation](self._con, **call.kwargs))
        except (commands.CommandError, LookupError, duckdb.Error) as e:
            return ("error", call.id, e if not isinstance(e, duckdb.Error) else RuntimeError(str(e)))

    def _judge_health(self, call: "Call") -> tuple:
        """Judge the collector's health on the server's counters (call.kwargs) and the writer's own."""
        snapshot = health.Snapshot(at=time.monotonic(), analysis_failures=self._analysis.failures, **call.kwargs)
        try:
            self._analysis.judge_health(self._con, snapshot)
        except Exception as e:  # a future must settle, whatever went wrong
            return ("error", call.id, RuntimeError(str(e)))
        return ("result", call.id, None)

    def _query(self, call: "Call", acks) -> None:
        """Run a read-only query (collector/readonly.py) and put its ("result" | "error", call id, value)."""
        try:
            acks.put(("result", call.id, readonly.run(self._con, **call.kwargs)))
        except (readonly.QueryRefused, readonly.QueryTimeout) as e:
            acks.put(("error", call.id, e))
        except Exception as e:  # a future must settle, whatever went wrong
            acks.put(("error", call.id, RuntimeError(str(e))))

    def _read(self, call: "Call", acks) -> None:
        """Run a read of collector/runmetrics.py on a cursor of its own and put its ("result" | "error", call id,
        value)."""
        cursor = self._con.cursor()
        try:
            acks.put(("result", call.id, METRICS_OPERATIONS[call.operation](cursor, **call.kwargs)))
        except Exception as e:  # a future must settle, whatever went wrong
            acks.put(("error", call.id, RuntimeError(str(e))))
        finally:
            cursor.close()

    def _commit(self, group: list[tuple[list[tuple[int, bytes, dict[str, int]]], Decoded]]) -> tuple:
        """Append a group of decoded batches in one transaction, leaving out requests already
        stored. ("committed", [(request id, written?)], seconds, rows) or ("failed", [request ids], reason)."""
        started = time.perf_counter()
        fresh: dict[bytes, tuple[int, str, int]] = {}  # digest -> (request id, signal, rows)
        tables: dict[str, list[pa.Table]] = defaultdict(list)
        for stored, decoded in group:
            keep = []
            for request_id, digest, rows in stored:
                keep.append(digest not in self._digests and digest not in fresh)
                if keep[-1]:
                    fresh[digest] = (request_id, decoded.signal, sum(rows.values()))
            for name, table in decoded.tables.items():
                if not all(keep):  # a retried request: its rows are left out
                    table = table.filter(np.repeat(keep, [rows.get(name, 0) for _, _, rows in stored]))
                tables[name].append(table)
        rows = 0
        try:
            self._con.begin()
            for table in TELEMETRY_TABLES:
                if tables[table]:
                    batch = pa.concat_tables(tables[table], promote_options="default")
                    rows += batch.num_rows
                    if batch.num_rows:
                        self._append(table, batch)
            ranks = self._changed_placements(r for _, d in group for r in d.ranks)
            if ranks:
                self._con.register("new_ranks", pa.Table.from_pylist(ranks))
                self._con.execute(_UPSERT_RANKS)
                self._con.execute(_UPSERT_RUNS)
                self._con.unregister("new_ranks")
            if fresh:
                self._con.execute("INSERT INTO exports VALUES " + ", ".join(["(?, ?, ?, now())"] * len(fresh)),
                                  [v for digest, (_, signal, items) in fresh.items() for v in (digest, signal, items)])
            self._con.commit()
        except Exception as e:  # the whole group fails; each client retries
            self._con.rollback()
            return ("failed", [request_id for stored, _ in group for request_id, _, _ in stored], str(e))
        for r in ranks:
            self._placements[r["run_id"], r["rank"]] = r
        for table in ("steps", "events"):
            run_ids = {run_id for part in tables[table] for run_id in pc.unique(part["run_id"]).to_pylist()}
            self._analysis.touched(run_ids, steps=table == "steps")
        now = time.time()
        for digest in fresh:
            self._digests[digest] = now
        self._forget_old_digests(now)
        written = {request_id for request_id, _, _ in fresh.values()}
        acknowledged = [(request_id, request_id in written) for stored, _ in group for request_id, _, _ in stored]
        return ("committed", acknowledged, time.perf_counter() - started, rows)

    def _append(self, table: str, batch: pa.Table) -> None:
        self._con.from_arrow(batch).insert_into(table)  # decode built it column for column

    def _changed_placements(self, ranks) -> list[dict]:
        changed = {}
        for r in ranks:
            known = self._placements.get((r["run_id"], r["rank"]))
            if known is None or any(v is not None and known.get(k) != v for k, v in r.items()):
                changed[r["run_id"], r["rank"]] = r
        return list(changed.values())

    def _forget_old_digests(self, now: float) -> None:
        horizon = now - DIGEST_RETENTION.total_seconds()
        if self._digests and next(iter(self._digests.values())) < horizon:
            while self._digests and next(iter(self._digests.values())) < horizon:
                self._digests.popitem(last=False)
            self._con.execute("DELETE FROM exports WHERE received_at < now() - ?::INTERVAL", [DIGEST_RETENTION])


def _writer_main(path: Path, analysis: Analysis, requests, acks) -> None:
    die_with_parent()
    try:
        writer = _Writer(path, analysis)
    except Exception as e:
        acks.put(("error", str(e)))
        return
    acks.put(("ready",))
    writer.run(requests, acks)


class Store:
    """The server's handle on the writer process.

    Producers (decode workers, or the server itself) put `([(request_id, digest,
    rows by table)], Decoded)` on `requests`, one message per decoded batch; the
    server registers each request id with
    `expect()` first and gets a future that resolves when the writer has
    committed it (True) or found it a duplicate (False).
    """

    def __init__(self, path: Path, max_queue_bytes: int = 256 * 2**20,
                 on_commit: Callable[[float, int], None] | None = None, analysis: Analysis | None = None):
        """Start the writer; raises StoreLocked (or the open error) if it cannot open `path`."""
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.max_queue_bytes = max_queue_bytes
        self._on_commit = on_commit
        context = multiprocessing.get_context("spawn")
        self.requests = context.Queue()
        self._acks = context.Queue()
        self._process = context.Process(target=_writer_main, args=(path, analysis or Analysis(), self.requests,
                                                                   self._acks),
                                        name="rankwatch-writer", daemon=True)
        self._process.start()
        first = self._acks.get()
        if first[0] == "error":
            self._process.join()
            raise StoreLocked(first[1]) if "held open" in first[1] else RuntimeError(first[1])
        self._lock = threading.Lock()
        self._pending: dict[int, tuple[Future, int]] = {}
        self._ids = itertools.count()
        self._queued_bytes = 0
        self._closed = threading.Event()
        self._reader = threading.Thread(target=self._read_acks, name="rankwatch-acks", daemon=True)
        self._reader.start()

    @property
    def queued_bytes(self) -> int:
        """Request bytes admitted and not yet committed (or forgotten)."""
        return self._queued_bytes

    def expect(self, nbytes: int) -> tuple[int, Future]:
        """A request id to queue a request of `nbytes` under, and the future of its commit.
        Raises Overloaded when admitting it would pass max_queue_bytes."""
        future: Future = Future()
        with self._lock:
            if self._queued_bytes and self._queued_bytes + nbytes > self.max_queue_bytes:
                raise Overloaded(f"write queue full ({self._queued_bytes} bytes waiting)")
            if not self._process.is_alive():
                raise RuntimeError("the store's writer process has exited")
            request_id = next(self._ids)
            self._pending[request_id] = (future, nbytes)
            self._queued_bytes += nbytes
        return request_id, future

    def call(self, operation: str, **kwargs) -> Future:
        """Run an operation of collector/commands.py in the writer process (the control API's way
        to the store), or "query" with readonly.run's arguments (the query API's); the future holds
        its result or its exception."""
        future: Future = Future()
        with self._lock:
            if not self._process.is_alive():
                raise RuntimeError("the store's writer process has exited")
            call_id = next(self._ids)
            self._pending[call_id] = (future, 0)
        self.requests.put(Call(call_id, operation, kwargs))
        return future

    def forget(self, request_id: int) -> None:
        """Drop a request that was never queued (it failed to decode or had no rows)."""
        with self._lock:
            _, nbytes = self._pending.pop(request_id, (None, 0))
            self._queued_bytes -= nbytes

    def close(self) -> None:
        """Drain the queue, checkpoint the WAL into the file, and stop the writer."""
        self.requests.put(None)
        self._closed.wait()
        self._process.join()
        for q in (self.requests, self._acks):
            q.close()
            q.join_thread()
        # Dropping the queues releases their semaphores now: uvicorn ends the process by
        # re-raising SIGTERM, before the interpreter would have collected them.
        del self.requests, self._acks

    def _read_acks(self) -> None:
        while True:
            try:
                ack = self._acks.get(timeout=1.0)
            except queue.Empty:
                if self._process.is_alive():
                    continue
                ack = ("failed", list(self._pending), "the store's writer process exited")
            if ack[0] == "closed":
                self._closed.set()
                return
            if ack[0] in ("result", "error"):
                with self._lock:
                    future, _ = self._pending.pop(ack[1], (None, 0))
                if future is not None:
                    (future.set_result if ack[0] == "result" else future.set_exception)(ack[2])
                continue
            results = ack[1] if ack[0] == "committed" else [(request_id, None) for request_id in ack[1]]
            with self._lock:
                settled = [(self._pending.pop(request_id, (None, 0)), written) for request_id, written in results]
                self._queued_bytes -= sum(nbytes for (_, nbytes), _ in settled)
            for (future, _), written in settled:
                if future is None:
                    continue
                if ack[0] == "committed":
                    future.set_result(written)
                else:
                    future.set_exception(RuntimeError(ack[2]))
            if ack[0] == "committed" and self._on_commit:
                self._on_commit(ack[2], ack[3])
            if not self._process.is_alive() and not self._pending:
                self._closed.set()
                return
