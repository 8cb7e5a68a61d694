"""The collector's DuckDB file, and the single writer process that fills it.

Requests are queued with their decoded Arrow batches; the writer takes
everything that piled up since its last commit and appends it in one
transaction (group commit), then acknowledges each request. A request is
answered only once acknowledged, so an acknowledged row is in DuckDB's
write-ahead log and survives a crash.

The writer is a process of its own because DuckDB's Python API takes the GIL
back many times per statement: next to a busy event loop every transaction
waited out the interpreter's switch interval again and again (9x slower,
measured). In its process it shares the GIL only with the analysis thread,
whose passes are short bursts every few seconds.
Read-only queries (the query API) run in that process too, the only one that
can read the file, but on threads of their own with a cursor each: they read
a snapshot and never hold up a commit.

A retried export is recognised by the digest of its decompressed body (the
OpenTelemetry exporters resend the same serialized bytes) and acknowledged
without writing again. Digests are kept, in the `exports` table and in
memory, for DIGEST_RETENTION, far longer than any exporter retries.
"""

import itertools
import logging
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
from collector.children import die_with_parent
from collector.decode import Decoded
from collector.engine import ENDED
from collector.runmetrics import OPERATIONS as METRICS_OPERATIONS
from collector.schema import DDL, TELEMETRY_TABLES

log = logging.getLogger("rankwatch.collector")
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
                              f"{f' (pid {_collector_pid(int(holder[1]))})' if holder else ''}; stop it first"
                              ) from None
        raise


def _collector_pid(holder: int) -> int:
    """The process to stop: DuckDB names the collector's writer process, a child the user never
    started; its parent, where that is a `collector` command line, is the collector itself."""
    try:
        found = re.search(r"PPid:\s*(\d+)", Path(f"/proc/{holder}/status").read_text())
        if found is None:  # not the status file Linux writes
            return holder
        parent = int(found[1])
        arguments = Path(f"/proc/{parent}/cmdline").read_bytes().split(b"\0")
    except OSError:  # no /proc (not Linux), or the process is gone
        return holder
    return parent if b"collector" in arguments else holder


class _Writer:
    """The writer process's side: owns the connection, commits groups, and hosts the analysis
    thread, the query threads and the alert delivery (it alone can read the store while the
    collector runs)."""

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
        readonly.files_dir(path.parent).mkdir(exist_ok=True)  # where a user puts files for SQL to read
        readonly.lock_down(self._con, path.parent)
        self._queries = ThreadPoolExecutor(QUERY_THREADS, thread_name_prefix="rankwatch-query")
        self._delivery = Delivery(self._con, analysis.alerts)  # posts alert notifications from the outbox
        analysis.start(self._con)  # passes on a thread of their own: a commit never waits for one

    def run(self, requests, acks) -> None:
        """Commit what arrives within GROUP_LINGER_S of the first request, acknowledge it,
        repeat; on None, checkpoint and stop."""
        while True:
            group = [requests.get()]
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
                elif call.operation == "health":  # judged on the analysis thread
                    self._analysis.report_health(**call.kwargs)
                    acks.put(("result", call.id, None))
                else:
                    acks.put(self._call(call))
            if stop:
                self._queries.shutdown()  # queries end within their time limit
                self._analysis.close()  # its last pass covers every commit above
                self._delivery.close()
                self._con.execute("CHECKPOINT")
                self._con.close()
                acks.put(("closed",))
                return

    def _call(self, call: "Call") -> tuple:
        """("result", call id, value) or ("error", call id, exception) of a control API operation."""
        try:
            return ("result", call.id, commands.OPERATIONS[call.operation](self._con, **call.kwargs))
        except (commands.CommandError, LookupError) as e:
            return ("error", call.id, e)
        except Exception as e:  # a future must settle, whatever went wrong
            return ("error", call.id, RuntimeError(str(e)))

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
        appended = 0
        try:
            self._con.begin()
            for table in TELEMETRY_TABLES:
                if tables[table]:
                    batch = pa.concat_tables(tables[table], promote_options="default")
                    appended += batch.num_rows
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
            ended = {run_id for part in tables[table] if table == "events"
                     for run_id in pc.unique(part.filter(pc.equal(part["event"], ENDED))["run_id"]).to_pylist()}
            self._analysis.touched(run_ids, steps=table == "steps", ended=ended)
        now = time.time()
        for digest in fresh:
            self._digests[digest] = now
        self._forget_old_digests(now)
        written = {request_id for request_id, _, _ in fresh.values()}
        acknowledged = [(request_id, request_id in written) for stored, _ in group for request_id, _, _ in stored]
        return ("committed", acknowledged, time.perf_counter() - started, appended)

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

    A writer that dies (killed, out of memory) fails what was waiting for it (the
    clients retry) and is replaced by one that recovers the write-ahead log, on new
    queues: `generation` counts them, so producers holding the old queue know to take
    the new one. Past MAX_RESTARTS within RESTART_WINDOW_S the store gives up
    (`failure` says why) rather than crash-loop on what kills it.
    """

    MAX_RESTARTS = 3
    RESTART_WINDOW_S = 60.0

    def __init__(self, path: Path, max_queue_bytes: int = 256 * 2**20,
                 on_commit: Callable[[float, int], None] | None = None, analysis: Analysis | None = None,
                 on_failure: Callable[[], None] | None = None):
        """Start the writer; raises StoreLocked (or the open error) if it cannot open `path`.
        `on_failure`: called once the store has given up on its writer."""
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.max_queue_bytes = max_queue_bytes
        self._on_commit, self._on_failure = on_commit, on_failure
        self._analysis = analysis or Analysis()
        self._context = multiprocessing.get_context("spawn")
        self._lock = threading.Lock()
        self._pending: dict[int, tuple[Future, int]] = {}
        self._ids = itertools.count()
        self._queued_bytes = 0
        self._closing = False
        self._closed = threading.Event()
        self._restarts: list[float] = []  # when the writer was replaced, within the window
        self.generation = -1  # writers started before the one running
        self.failure: str | None = None
        self._start_writer()
        self._reader = threading.Thread(target=self._read_acks, name="rankwatch-acks", daemon=True)
        self._reader.start()

    def _start_writer(self) -> None:
        """A writer process on new queues, once it has the store open (recovering its write-ahead log).
        A dead writer's queues are let go without waiting to flush what nobody will read."""
        self._ready = False
        for dead in (getattr(self, "requests", None), getattr(self, "_acks", None)):
            if dead is not None:
                dead.cancel_join_thread()
                dead.close()
        self.requests = self._context.Queue()
        self._acks = self._context.Queue()
        self._process = self._context.Process(target=_writer_main, args=(self.path, self._analysis, self.requests,
                                                                         self._acks),
                                              name="rankwatch-writer", daemon=True)
        self._process.start()
        while True:
            try:
                first = self._acks.get(timeout=1.0)
                break
            except queue.Empty:
                if not self._process.is_alive():
                    first = ("error", f"the writer process exited with status {self._process.exitcode}")
                    break
        if first[0] == "error":
            self._process.join()
            raise StoreLocked(first[1]) if "held open" in first[1] else RuntimeError(first[1])
        self.generation += 1  # before requests are admitted: none may go to the old queue's producers
        self._ready = True

    @property
    def healthy(self) -> bool:
        """Whether a writer is up and taking requests (what /healthz reports)."""
        return self._ready and self._process.is_alive()

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
            self._check_writer()
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
            self._check_writer()
            call_id = next(self._ids)
            self._pending[call_id] = (future, 0)
        self.requests.put(Call(call_id, operation, kwargs))
        return future

    def _check_writer(self) -> None:
        if not self.healthy:
            raise RuntimeError(self.failure or "the store's writer process is restarting")

    def forget(self, request_id: int) -> None:
        """Drop a request that was never queued (it failed to decode or had no rows)."""
        with self._lock:
            _, nbytes = self._pending.pop(request_id, (None, 0))
            self._queued_bytes -= nbytes

    def close(self) -> None:
        """Drain the queue, checkpoint the WAL into the file, and stop the writer."""
        self._closing = True
        if self.healthy:
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
                self._fail_pending("the store's writer process exited")
                if self._closing or not self._restart():
                    self._closed.set()
                    return
                continue
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

    def _fail_pending(self, reason: str) -> None:
        """Fail every request and call still waiting: none was acknowledged, so each client retries."""
        with self._lock:
            failed, self._pending, self._queued_bytes = list(self._pending.values()), {}, 0
        for future, _ in failed:
            future.set_exception(RuntimeError(reason))

    def _restart(self) -> bool:
        """Replace a dead writer (one that dies starting counts as another death); False (and
        `failure` set, `on_failure` called) when it cannot be."""
        while True:
            status = self._process.exitcode
            now = time.monotonic()
            self._restarts = [t for t in self._restarts if now - t < self.RESTART_WINDOW_S] + [now]
            if len(self._restarts) > self.MAX_RESTARTS:
                self.failure = (f"the store's writer process died {len(self._restarts)} times in "
                                f"{self.RESTART_WINDOW_S:.0f} s (last status {status}); not restarted")
                break
            log.error("the store's writer process died (status %s); starting another", status)
            try:
                self._start_writer()
            except StoreLocked as e:  # another process took the store: starting again cannot help
                self.failure = f"the store's writer process died (status {status}) and could not be restarted: {e}"
                break
            except Exception:
                continue
            if self._closing:  # close() found no writer to stop: stop this one
                self.requests.put(None)
            return True
        log.error("%s", self.failure)
        if self._on_failure:
            self._on_failure()
        return False
