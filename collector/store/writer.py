"""The store's writer process: the one process with the DuckDB file open, and its group-commit loop.

Producers (decode workers, or the server itself) queue decoded Arrow batches; the writer takes
everything that piled up since its last commit and appends it in one transaction (group commit),
then acknowledges each request. A request is answered only once acknowledged, so an acknowledged
row is in DuckDB's write-ahead log and survives a crash. What one request holds cannot fail the
others of its group: a group whose transaction fails is halved, and its halves committed apart,
until the requests that fail alone are found; only they are refused (their clients send again),
in one line of the log for the group.

The writer is a process of its own because DuckDB's Python API takes the GIL
back many times per statement: next to a busy event loop every transaction
waited out the interpreter's switch interval again and again (9x slower,
measured). In its process it shares the GIL only with its tasks' threads (the
analysis passes, short bursts every few seconds, and the alert delivery, asleep
or on a socket).

Calls (collector/store/requests.py) are answered between commits: a write on the writer thread,
in order with the commits; a read (a query, the run metrics) on one of QUERY_THREADS query threads
with a cursor of its own, reading a snapshot, so it never holds up a commit.

The tasks the collector hands the writer (its analysis and alert delivery) start on the open store,
hear of each commit's tables, and stop once the queue is drained, before the checkpoint: the writer
knows them only by the `Task` protocol, so the store imports neither.

A retried export is recognised by the digest of its decompressed body (the
OpenTelemetry exporters resend the same serialized bytes) and acknowledged
without writing again. Digests are kept, in the `exports` table and in
memory, for DIGEST_RETENTION, far longer than any exporter retries.
"""

import logging
import queue
import threading
import time
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Protocol

import duckdb
import pyarrow as pa

from collector.children import bound_heap, cap_memory, die_with_parent
from collector.printable import escape_logs
from collector.store import lake, readonly, requests
from collector.store.batch import Decoded
from collector.store.db import StoreLocked, connect, create_tables
from collector.store.schema import TELEMETRY_TABLES

log = logging.getLogger("rankwatch.store")
DIGEST_RETENTION = timedelta(hours=1)
# In a lake, how long a collector's claim on an export (collector/store/lake.py) holds before another may
# take it over: far longer than a commit takes, so that only a collector that died loses its claims.
CLAIM_HELD = timedelta(seconds=30)
# How long the writer collects requests into one transaction. A commit costs
# milliseconds however small it is, so under load a group must be large;
# 10 ms of added latency is nothing to an exporter that batches for seconds.
GROUP_LINGER_S = 0.010
# Threads for read-only queries (the query API): they read snapshots beside the commit loop.
QUERY_THREADS = 2
# The writer's memory past what it maps once the store is open, by default (`rankwatch collector
# --writer-memory`): DuckDB's buffer pool (shared by the queries and the commits, which evict cached blocks
# for what they need) and 512 MiB for what DuckDB does not count: the batches queued for commit, the
# analysis's arrays (more for jobs of tens of thousands of ranks), the strings a query builds. Past it an
# allocation fails where it is made: the query gets Out of Memory (400), a commit rolls back and its
# clients send again (503), nothing acknowledged is lost, and the writer goes on.
MEMORY_HEADROOM = readonly.MEMORY_LIMIT + 512 * 2**20
MAX_REASON_CHARS = 300  # of a failed commit's reason, as logged and told the client: DuckDB's may quote a whole key

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


@dataclass(frozen=True)
class Call:
    """A request (collector/store/requests.py) for the writer, under the id its answer comes back with."""

    id: int
    request: requests.Request


# What the writer puts on its acknowledgement queue, for the server's handle (collector/store/handle.py).
@dataclass(frozen=True)
class Ready:
    """The writer has the store open (its write-ahead log recovered) and takes requests."""


@dataclass(frozen=True)
class StartFailed:
    """The writer could not open the store; `locked`: another process holds it."""

    reason: str
    locked: bool


@dataclass(frozen=True)
class Committed:
    """A group committed: each request's id and whether it was written (False: a retry already stored)."""

    acknowledged: list[tuple[int, bool]]
    seconds: float
    rows: int


@dataclass(frozen=True)
class CommitFailed:
    """Requests that could not be stored: none of their rows was, and each client sends again."""

    request_ids: list[int]
    reason: str


@dataclass(frozen=True)
class Answered:
    """A call's reply."""

    call_id: int
    value: object


@dataclass(frozen=True)
class Raised:
    """A call's refusal or failure."""

    call_id: int
    error: Exception


@dataclass(frozen=True)
class Closed:
    """The queue is drained, the tasks stopped and the store checkpointed and closed."""


class Task(Protocol):
    """Work the writer process runs beside its commits (the collector's analysis, its alert delivery):
    it is handed over pickled, started on the open store, told of each commit, and closed, in the
    order handed, once the queue is drained and before the checkpoint."""

    def start(self, con: duckdb.DuckDBPyConnection) -> None:
        """Begin, on cursors of `con` (threads of its own: a commit never waits for a task)."""

    def committed(self, tables: Mapping[str, Sequence[pa.Table]]) -> None:
        """A commit appended `tables` (by table name); returns at once."""

    def close(self) -> None:
        """Finish (a last pass over what was committed, say) and stop."""


class PeriodicTask:
    """A Task that works beside the commits on a thread and a cursor of its own, every `every_s`, where
    `wanted` says the store needs it (the alert delivery, a lake's upkeep). Handed to the writer
    process pickled: the thread and the cursor are made there, in start()."""

    every_s: float = 1.0
    thread_name = "rankwatch-task"

    def wanted(self, con: duckdb.DuckDBPyConnection) -> bool:
        return True

    def tick(self, con: duckdb.DuckDBPyConnection) -> None:
        """One round of the work, on the task's cursor."""

    def start(self, con: duckdb.DuckDBPyConnection) -> None:
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if self.wanted(con):
            cursor = lake.cursor(con)
            self._thread = threading.Thread(target=self._run, args=(cursor,), name=self.thread_name, daemon=True)
            self._thread.start()

    def committed(self, tables: Mapping[str, Sequence[pa.Table]]) -> None:
        """Nothing: a periodic task keeps its own time."""

    def close(self) -> None:
        """Stop after the round in flight; the thread closes its cursor."""
        thread = getattr(self, "_thread", None)  # (None: never started, or not wanted)
        if thread is not None:
            self._stop.set()
            thread.join()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def _run(self, cursor: duckdb.DuckDBPyConnection) -> None:
        """Tick every `every_s` until stopped; a round that raises is logged in one line and the next one
        comes as usual: no round's failure ends the task (its work, an alert's delivery, would stop for good)."""
        try:
            while not self._stop.wait(self.every_s):
                try:
                    self.tick(cursor)
                except Exception as e:
                    log.error(
                        "%s: a round failed (%s: %s); the next one comes in %g s",
                        self.thread_name,
                        type(e).__name__,
                        e,
                        self.every_s,
                    )
        finally:
            cursor.close()


class _Writer:
    """The writer process's side: owns the connection, commits groups, answers calls, and runs the
    tasks and the query threads (it alone can read the store while the collector runs)."""

    def __init__(self, path: Path, tasks: Sequence[Task], into: lake.Lake | None = None):
        self._tasks = tasks
        self._lake = into
        self._con = lake.open_lake(into) if into else connect(path)
        # One DuckDB thread: the writer shares the machine with decoding, and a
        # parallel insert of a few thousand rows costs more than it gains.
        self._con.execute("SET threads TO 1")
        (lake.create_tables if into else create_tables)(self._con)
        self._digests: OrderedDict[bytes, float] = OrderedDict(
            (d, t)
            for d, t in self._con.execute(
                "SELECT digest, epoch(received_at) FROM exports WHERE received_at > now() - ?::INTERVAL "
                "ORDER BY received_at",
                [DIGEST_RETENTION],
            ).fetchall()
        )
        cursor = self._con.execute("SELECT ranks.*, world_size FROM ranks JOIN runs USING (run_id)")
        columns = [d[0] for d in cursor.description]
        self._placements = {row[:2]: dict(zip(columns, row)) for row in cursor.fetchall()}
        readonly.files_dir(path.parent).mkdir(exist_ok=True)  # where a user puts files for SQL to read
        readonly.lock_down(self._con, path.parent, into.data_path if into else None)
        self._queries = ThreadPoolExecutor(QUERY_THREADS, thread_name_prefix="rankwatch-query")
        for task in tasks:
            task.start(self._con)

    def run(self, queued, acks) -> None:
        """Commit what arrives within GROUP_LINGER_S of the first request, acknowledge it, answer
        the calls that came with it, repeat; on None, close the tasks, checkpoint and stop."""
        while True:
            group = [queued.get()]
            deadline = time.monotonic() + GROUP_LINGER_S
            while group[-1] is not None and (left := deadline - time.monotonic()) > 0:
                try:
                    group.append(queued.get(timeout=left))
                except queue.Empty:
                    break
            stop = group[-1] is None
            calls = [g for g in group if isinstance(g, Call)]
            group = [g for g in group if g is not None and not isinstance(g, Call)]
            if group:
                for done in self._commit(group):
                    acks.put(done)
            for call in calls:
                if requests.beside(call.request):  # on a query thread: a slow read never holds up commits
                    self._queries.submit(self._read, call, acks)
                else:
                    acks.put(self._answer(requests.Context(self._con, self._tasks), call))
            if stop:
                self._queries.shutdown()  # queries end within their time limit
                for task in self._tasks:  # the analysis's last pass covers every commit above
                    task.close()
                if not self._lake:  # (a lake's commits are its files: there is no log to fold in)
                    self._con.execute("CHECKPOINT")
                self._con.close()
                acks.put(Closed())
                return

    def _answer(self, context: requests.Context, call: Call) -> Answered | Raised:
        try:
            return Answered(call.id, requests.answer(context, call.request))
        except Exception as e:  # the handler's refusal, or a RuntimeError for anything else
            return Raised(call.id, e)

    def _read(self, call: Call, acks) -> None:
        """Answer a call on a cursor of its own (a snapshot beside the commits) and put its answer."""
        cursor = lake.cursor(self._con, in_lake=self._lake is not None)
        try:
            acks.put(self._answer(requests.Context(cursor, self._tasks), call))
        finally:
            cursor.close()

    def _commit(self, group: list[Decoded]) -> list:
        """Store a group of decoded batches, in one transaction where it can be, and tell the tasks
        what was appended: Committed for the requests stored, CommitFailed for those that could not
        be and for those another collector of the lake is storing (each client sends again). A group
        whose transaction fails is halved until the requests that fail alone are found; out of
        memory fails the whole group (memory is short, not a request at fault: halving it would
        multiply the work), and the clients send again later."""
        done: list = []
        failed: list[CommitFailed] = []
        self._commit_apart(group, done, failed)
        if failed:
            log.warning(
                "%d of %d export requests could not be stored (their clients send again): %s",
                sum(len(f.request_ids) for f in failed),
                sum(len(d.parts) for d in group),
                failed[0].reason,
            )
        return done + failed

    def _commit_apart(self, group: list[Decoded], done: list, failed: list[CommitFailed]) -> None:
        """Commit `group` in one transaction, else its halves apart, down to single requests."""
        try:
            done += self._commit_together(group)
        except _NotStored as e:
            request_ids = [part.request_id for decoded in group for part in decoded.parts]
            if len(request_ids) == 1 or isinstance(e.cause, (duckdb.OutOfMemoryException, MemoryError)):
                failed.append(CommitFailed(request_ids, e.reason))
                return
            for half in _halves(group):
                self._commit_apart(half, done, failed)

    def _commit_together(self, group: list[Decoded]) -> list:
        """Append a group of decoded batches in one transaction (_NotStored where it fails), leaving out
        requests already stored, and tell the tasks what was appended: Committed, and CommitFailed for
        requests that another collector of the lake is storing."""
        started = time.perf_counter()
        fresh: dict[bytes, tuple[int, str, int]] = {}  # digest -> (request id, signal, rows)
        for decoded in group:
            for part in decoded.parts:
                if part.digest not in self._digests and part.digest not in fresh:
                    fresh[part.digest] = (part.request_id, decoded.signal, part.accepted)
        busy: set[bytes] = set()
        try:
            if self._lake and fresh:
                busy, elsewhere = self._claim(list(fresh))
                fresh = {digest: v for digest, v in fresh.items() if digest not in busy | elsewhere}
            tables: dict[str, list[pa.Table]] = defaultdict(list)
            for decoded in group:  # a retried request's rows are left out
                kept = decoded.select([fresh.get(part.digest, (None,))[0] == part.request_id for part in decoded.parts])
                for name, table in kept.tables.items():
                    tables[name].append(table)
            ranks = self._changed_placements(r for decoded in group for r in decoded.ranks)
            if ranks and self._lake:  # the catalog database's rows, beside the lake's transaction
                lake.place(self._con, ranks)
            appended = self._append_group(tables, fresh, [] if self._lake else ranks)
        except Exception as e:
            raise _NotStored(e) from e
        for r in ranks:
            self._placements[r["run_id"], r["rank"]] = r
        for task in self._tasks:
            task.committed(tables)
        now = time.time()
        for digest in fresh:
            self._digests[digest] = now
        self._forget_old_digests(now)
        written = {request_id for request_id, _, _ in fresh.values()}
        parts = [part for decoded in group for part in decoded.parts]
        waiting = {part.request_id for part in parts if part.digest in busy}
        acknowledged = [
            (part.request_id, part.request_id in written) for part in parts if part.request_id not in waiting
        ]
        done: list = [Committed(acknowledged, time.perf_counter() - started, appended)]
        if waiting:
            done.append(CommitFailed(sorted(waiting), "another collector of the lake is storing it"))
        return done

    def _append_group(self, tables: Mapping[str, list[pa.Table]], fresh: Mapping, ranks: list[dict]) -> int:
        """The group's rows, its new placements and its exports' digests, in one transaction; the rows appended."""
        appended = 0
        try:
            self._con.begin()
            for table in TELEMETRY_TABLES:
                if tables.get(table):
                    batch = pa.concat_tables(tables[table], promote_options="default")
                    appended += batch.num_rows
                    if batch.num_rows:
                        self._append(table, batch)
            if ranks:
                self._upsert_placements(ranks)
            if fresh:
                self._con.execute(
                    "INSERT INTO exports VALUES " + ", ".join(["(?, ?, ?, now())"] * len(fresh)),
                    [v for digest, (_, signal, items) in fresh.items() for v in (digest, signal, items)],
                )
            self._con.commit()
        except Exception:
            self._con.rollback()
            raise
        return appended

    def _upsert_placements(self, ranks: list[dict]) -> None:
        self._con.register("new_ranks", pa.Table.from_pylist(ranks))
        try:
            self._con.execute(_UPSERT_RANKS)
            self._con.execute(_UPSERT_RUNS)
        finally:
            self._con.unregister("new_ranks")

    def _claim(self, digests: list[bytes]) -> tuple[set[bytes], set[bytes]]:
        """In a lake: claim each export for this collector, which alone may then store it. Returns the
        digests another live collector holds and has not stored yet (`busy`: it is storing them; their
        clients send again) and those already stored (by the collector that claimed them, perhaps one
        that died since: acknowledged without writing)."""
        mine, again = lake.claim(self._con, digests, CLAIM_HELD)
        held = set(digests) - mine
        stored = set()
        if again | held:  # (a claim taken for the first time cannot have been stored)
            stored = {
                digest
                for (digest,) in self._con.execute(
                    "SELECT digest FROM exports WHERE digest IN (SELECT unnest(?::BLOB[]))", [list(again | held)]
                ).fetchall()
            }
        return held - stored, stored

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
            if self._lake:
                self._con.execute("DELETE FROM claims WHERE claimed_at < now() - ?::INTERVAL", [DIGEST_RETENTION])


class _NotStored(Exception):
    """A group's transaction failed: none of its requests was stored."""

    def __init__(self, cause: Exception):
        super().__init__(cause)
        self.cause = cause
        first_line = (str(cause).strip().splitlines() or [""])[0]
        self.reason = f"{type(cause).__name__}: {first_line}"[:MAX_REASON_CHARS]


def _halves(group: list[Decoded]) -> tuple[list[Decoded], list[Decoded]]:
    """A group of two or more requests as two with half of them each (a batch of several split)."""
    if len(group) > 1:
        return group[: len(group) // 2], group[len(group) // 2 :]
    (decoded,) = group
    first = [i < len(decoded.parts) // 2 for i in range(len(decoded.parts))]
    return [decoded.select(first)], [decoded.select([not kept for kept in first])]


def main(
    path: Path,
    tasks: Callable[[], Sequence[Task]],
    queued,
    acks,
    memory_headroom: int = MEMORY_HEADROOM,
    into: lake.Lake | None = None,
) -> None:
    """The writer process: build its `tasks`, open the store (the file at `path`, or the lake `into`), say Ready
    (or StartFailed), then run until told to stop, its address space capped at what it maps once the store
    is open plus `memory_headroom`."""
    die_with_parent()
    bound_heap()
    escape_logs()
    try:
        writer = _Writer(path, tasks(), into)
    except Exception as e:
        acks.put(StartFailed(str(e), isinstance(e, StoreLocked)))
        return
    cap_memory(memory_headroom)
    acks.put(Ready())
    writer.run(queued, acks)
