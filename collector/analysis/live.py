"""Running the analysis engine (collector/analysis/engine.py) as telemetry arrives, in the writer process
(the only one with the store open), on a thread of its own with a cursor of its own, so that
commits, and the acknowledgements that wait for them, never wait for a pass however many runs it
judges. The server hands an Analysis to the store's writer as one of its tasks
(collector/store/writer.py), and its health counters as a HealthCounters request.

Passes are driven by commits: the writer hands over each commit's tables, this takes from them
the runs the commit brought steps (or `ended` events) for and wakes the thread, and the pass judges
those runs' new steps at once, so a finding exists within a pass of the commit of the step that
shows it, whatever the step rate. A timer wakes it too (every `interval_s`), for what time alone
changes: a run that stopped sending steps (a stall), a job stopped by its rollback budget, a stacks
request whose time is up (settled on these passes). A hang finding that fires asks every rank of
its run for its stacks (one request per finding), which the hang analyzer's next passes read. A run
whose ranks all said their training loop ended has its firing findings resolved ("run ended") once
its last steps are judged.

The power analyzer, which costs seconds at a thousand ranks, runs on a second thread, so that a
pass does not wait for it either.

In a lake shared by several collectors (collector/store/lake.py) a run's ranks may send to any of them,
so each collector follows every collector's commits, not only its own: every FOLLOW_S it reads the
steps and events the lake's new snapshots inserted. Each run is judged by one collector at a time, the
holder of its lease in the lake's catalog database, taken at a pass and renewed at every pass after
(a timer pass comes every RENEW_S at least): when that collector dies, its lease expires within
LEASE_HELD and the next collector's pass takes it over, from the cursor the last stored. A collector
stopping gives its leases up at once.
"""

import collections
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from datetime import timedelta

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from collector.alerts.config import AlertConfig
from collector.analysis import findings, losses
from collector.analysis.analyzers import hangs, health, power, predicted, stragglers
from collector.analysis.engine import ENDED, Engine, add_steps, failing
from collector.control import commands
from collector.reports import powercaps
from collector.store import lake, schema
from collector.store.requests import Context, Request, handles

log = logging.getLogger("rankwatch.analysis")
ACTIVE_FOR_S = 3600  # a run silent this long is no longer analysed (a hang has fired long before)
# The collector's stop waits for its last pass: past this, the runs left are judged when it next
# hears from them, from their stored cursors (a backlog of a thousand runs must not hold a stop).
LAST_PASS_S = 20.0

# In a lake: how often every collector's new commits are read, how long a run's lease holds, and how often
# a collector judges (and so renews the leases of) every run it follows, new steps or not.
FOLLOW_S = 0.5
LEASE_HELD = timedelta(seconds=6)
RENEW_S = 2.0

_OUTBOX = """SELECT receiver, count(*) AS pending, epoch(now() - min(created_at)) AS waiting_s FROM outbox
             WHERE state = 'pending' GROUP BY receiver"""


class Analysis:
    """Which runs are active, when the analyzers are next due, and one pass over them."""

    def __init__(
        self,
        interval_s: float = 5.0,
        straggler_settings=stragglers.Settings(),
        hang_settings=hangs.Settings(),
        rollback: commands.RollbackPolicy | None = commands.RollbackPolicy(),
        alerts: AlertConfig = AlertConfig(),
        power_every_s: float | None = 60.0,
        predicted_settings: predicted.Settings = predicted.Settings(),
    ):
        """`interval_s`: how often every active run is judged, new steps or not (a stall shows so).
        `rollback`: how anomalies are rolled back; None: they are reported, not rolled back.
        `alerts`: where the alerts that findings raise are sent (the writer's delivery thread reads it too).
        `power_every_s`: how often a run's power recommendations are redrawn; None: never (`rankwatch power
        recommend` still draws them). `predicted_settings`: the step-time model, where one was given."""
        self.interval_s = interval_s
        self.alerts = alerts
        self.engine = Engine(
            {
                stragglers.ANALYZER: straggler_settings,
                hangs.ANALYZER: hang_settings,
                predicted.ANALYZER: predicted_settings,
            },
            stored=True,
        )
        self._rollback = rollback
        self._power_every_s = power_every_s
        self._power_due: dict[str, float] = {}  # run -> when its power recommendations are next drawn
        self._power_drawing: dict[str, Future] = {}  # run -> its power report, being drawn
        self._power_thread: ThreadPoolExecutor | None = None  # made in the writer process, on first use
        self._unpowered: set[str] = set()  # runs that stepped since their power report was last drawn
        self._active: dict[str, float] = {}
        self._health: collections.deque[health.Snapshot] = collections.deque()
        self._started = time.monotonic()
        self.failures: collections.Counter[str] = (
            collections.Counter()
        )  # what raised since the start: an analyzer, or a part of the pass
        self._stepped: set[str] = set()  # runs with new steps since the last pass
        self._ended: set[str] = set()  # runs with new `ended` events since the last pass
        self._behind: set[str] = set()  # runs with steps reported that not every rank has reported yet
        self._arrived: dict[str, list[tuple[int, int]]] = {}  # run -> the steps committed since its pass (ranges)
        self._failed: dict[str, dict[str, list[int]]] = {}  # run -> the analyzers that raised on it (engine.failing)
        self._next = time.monotonic() + interval_s
        self._counters: list[dict] = []  # the server's health counters, not yet judged
        self._lake = False  # the store is a lake shared with other collectors
        self._snapshot: int | None = None  # in a lake: the newest snapshot whose commits were read
        self._led: set[str] = set()  # in a lake: the runs whose lease this collector holds
        self._health_run = health.RUN_ID  # the run the collector's own findings are recorded under
        self._threading()

    def _threading(self) -> None:
        """The writer thread hands over what it saw under the lock; the analysis thread does the rest.
        Made anew in the writer process (an Analysis is handed to it pickled, without them)."""
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in ("_lock", "_wake", "_thread")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._threading()

    def start(self, con: duckdb.DuckDBPyConnection) -> None:
        """Run the passes on a thread of their own, on a cursor of `con` (a snapshot reader and a
        writer of findings beside the commit loop), until close()."""
        if lake.attached(con):
            self._lake = True
            self.interval_s = min(self.interval_s, RENEW_S)
            self._health_run = f"collector {lake.holder()}"  # each collector's own health, apart
        self._thread = threading.Thread(
            target=self._loop, args=(lake.cursor(con),), name="rankwatch-analysis", daemon=True
        )
        self._thread.start()

    def touched(self, run_ids, steps: bool, ended=()) -> None:
        """Runs a commit brought something for (`steps`: rank-steps, else only events such as
        heartbeats; `ended`: runs among them with `ended` events); new steps or ends wake a pass."""
        now = time.monotonic()
        with self._lock:
            self._active.update((run_id, now) for run_id in run_ids)
            if steps:
                self._stepped.update(run_ids)
            self._ended.update(ended)
        if steps or ended:
            self._wake.set()

    def committed(self, tables: Mapping[str, Sequence[pa.Table]]) -> None:
        """The writer's word of a commit (a store task's): the runs it brought steps or events for, and
        the steps it brought each (the engine judges those that came below steps already judged). In a
        lake every commit is read from the lake's snapshots instead (_follow), this one's too."""
        if not self._lake:
            self._take(tables)

    def _follow(self, con: duckdb.DuckDBPyConnection) -> None:
        """In a lake: what the commits of every collector since the last call inserted, taken as the
        writer's word of a commit (the first call only notes where the lake stands)."""
        (newest,) = con.execute(f"SELECT id FROM {lake.LAKE}.current_snapshot()").fetchone() or (None,)
        if newest is None:
            return
        if self._snapshot is not None and newest > self._snapshot:
            inserted = {
                table: con.execute(
                    f"SELECT {columns} FROM ducklake_table_changes(?, 'main', ?, ?, ?) WHERE change_type = 'insert'",
                    [lake.LAKE, table, self._snapshot + 1, newest],
                ).fetch_arrow_table()
                for table, columns in (("steps", "run_id, step"), ("events", "run_id, event"))
            }
            self._take({table: [rows] for table, rows in inserted.items()})
        self._snapshot = newest

    def _take(self, tables: Mapping[str, Sequence[pa.Table]]) -> None:
        for part in tables.get("steps", ()):
            for run_id, ranges in _step_ranges(part).items():
                self._arrive(run_id, ranges)
        for table in ("steps", "events"):
            run_ids = {run_id for part in tables.get(table, ()) for run_id in pc.unique(part["run_id"]).to_pylist()}
            ended = {
                run_id
                for part in tables.get(table, ())
                if table == "events"
                for run_id in pc.unique(part.filter(pc.equal(part["event"], ENDED))["run_id"]).to_pylist()
            }
            self.touched(run_ids, steps=table == "steps", ended=ended)

    def _arrive(self, run_id: str, ranges: list[tuple[int, int]]) -> None:
        """A commit brought a run these ranges of steps: its next pass is told."""
        if ranges:
            with self._lock:
                self._arrived[run_id] = add_steps(self._arrived.get(run_id, ()), ranges)

    def report_health(self, counters: "HealthCounters") -> None:
        """The server's counters, judged on the analysis thread with the writer's, right away."""
        with self._lock:
            self._counters.append(dict(asdict(counters), at=time.monotonic()))
        self._wake.set()

    def run(self, con: duckdb.DuckDBPyConnection, last: bool = False, every: bool = True) -> None:
        """One pass; an analyzer's failure is logged, never raised. `every`: every active run (else
        only those with new steps or ends). `last`: the runs with steps not yet judged, to their newest
        step even where not every rank has reported it, so the findings left behind are drawn on all
        the data committed. A run with more new steps than one pass judges is judged again at once."""
        if every or last:
            self._next = time.monotonic() + self.interval_s
        cutoff = time.monotonic() - ACTIVE_FOR_S
        with self._lock:
            for run in [run for run, t in self._active.items() if t <= cutoff]:
                self.engine.release(run)  # gone quiet: its cursor stays, the steps kept for it go
            self._active = {run: t for run, t in self._active.items() if t > cutoff}
            stepped, self._stepped = self._stepped, set()
            self._unpowered |= stepped
            ended, self._ended = self._ended, set()
            if every and not last:
                runs = sorted(self._active, key=lambda run: run not in stepped)
            else:  # the last pass: only runs with steps not yet judged (the timer pass judged the others' stalls)
                waiting = stepped | ended | self._behind | (set(self._active) - set(self.engine.cursors))
                runs = sorted(waiting & set(self._active))
        if self._lake:
            runs = self._lead(con, runs)
        self._power_due = {run: t for run, t in self._power_due.items() if run in self._active}
        self._record_power(con)
        if every and not last:
            self._settle_stacks(con)
        until = time.monotonic() + LAST_PASS_S
        for run_id in runs:
            if self._stopping and not last:  # the last pass comes at once; it judges what this one would
                break
            if last and time.monotonic() > until:
                log.warning(
                    "the last analysis pass left %d runs for the next start (their cursors are stored)",
                    len(runs) - runs.index(run_id),
                )
                break
            try:
                while self._analyze(con, run_id, every and not last, run_id in ended, last) and last:
                    pass
            except Exception:
                log.exception("analysis of run %s failed", run_id)
                self.failures["the pass"] += 1
        if last:  # the runs judged before: nothing more comes, so their telemetry loss settles too
            judged_before = set(self._active) - set(runs)
            for run_id in sorted(judged_before & self._led if self._lake else judged_before):
                if time.monotonic() > until:
                    break
                try:
                    losses.record(con, run_id, final=True)
                except Exception:
                    log.exception("telemetry loss of run %s not settled", run_id)
                    self.failures["telemetry loss"] += 1

    def _lead(self, con: duckdb.DuckDBPyConnection, runs: list[str]) -> list[str]:
        """In a lake: the runs of `runs` this collector leads, their leases taken or renewed. A run
        whose lease it takes (again) is judged from its stored cursor, since another collector may
        have judged it meanwhile; one it does not lead is not kept in memory."""
        led = []
        for run_id in runs:
            try:
                holds = lake.lease(con, "run", run_id, LEASE_HELD)
            except duckdb.Error:
                log.exception("the lease of run %s could not be taken", run_id)
                holds = False
            if holds != (run_id in self._led):
                self.engine.forget(run_id)
            if holds:
                self._led.add(run_id)
                led.append(run_id)
            else:
                self._led.discard(run_id)
                with self._lock:
                    self._arrived.pop(run_id, None)
        return led

    def due_in(self) -> float:
        return max(self._next - time.monotonic(), 0.0)

    def close(self) -> None:
        """Stop the thread after a last pass over what came since the one before, so that the store
        left behind has findings for all it holds (a job's last steps often come in its final flush,
        just before the collector stops); the power report being drawn finishes first and is
        recorded, and no new one is started. The writer calls it once its queue is drained.
        Passes run by hand (no start()) only have the power thread stopped."""
        if self._thread is None:
            if self._power_thread is not None:
                self._power_thread.shutdown(cancel_futures=True)
            return
        self._stopping = True
        self._wake.set()
        self._thread.join()

    def _loop(self, con: duckdb.DuckDBPyConnection) -> None:
        try:
            while not self._stopping:
                self._wake.wait(min(self.due_in(), FOLLOW_S) if self._lake else self.due_in())
                self._wake.clear()
                if self._lake:
                    self._following(con)
                self._judge_reported_health(con)
                if not self._stopping:
                    self.run(con, every=not self.due_in())
            self._power_every_s = None
            if self._power_thread is not None:
                self._power_thread.shutdown(cancel_futures=True)
            self._judge_reported_health(con)
            if self._lake:
                self._following(con)
            self.run(con, last=True)
            if self._lake:
                lake.give_up(con, "run", sorted(self._led))
        finally:
            con.close()

    def _following(self, con: duckdb.DuckDBPyConnection) -> None:
        try:
            self._follow(con)
        except Exception:  # (snapshots expired under a collector that fell an hour behind, say)
            log.exception("the lake's new commits could not be read; following it from its newest snapshot")
            self._snapshot = None
            self.failures["the lake"] += 1

    def _judge_reported_health(self, con: duckdb.DuckDBPyConnection) -> None:
        with self._lock:
            reported, self._counters = self._counters, []
        for counters in reported:
            try:
                self.judge_health(con, health.Snapshot(analysis_failures=dict(self.failures), **counters))
            except Exception:
                log.exception("judging the collector's health failed")
                self.failures["health"] += 1

    def judge_health(
        self, con: duckdb.DuckDBPyConnection, snapshot: health.Snapshot, settings: health.Settings = health.Settings()
    ) -> None:
        """The collector's health findings, from its counters now and the oldest within the window."""
        if not self._health:  # the counters began at zero: what came before the first report counts too
            self._health.append(health.Snapshot(self._started, {}, 0, snapshot.max_queue_bytes, {}, {}))
        self._health.append(snapshot)
        while snapshot.at - self._health[0].at > settings.window_s:
            self._health.popleft()
        found = health.analyze(self._health[0], snapshot, con.execute(_OUTBOX).df(), settings)
        findings.record(con, self._health_run, health.ANALYZER, found, self.alerts)

    def _analyze(self, con: duckdb.DuckDBPyConnection, run_id: str, timed: bool, ended: bool, last: bool) -> bool:
        """One pass of the engine over a run, its findings recorded, rollbacks sent for its anomalies,
        its power report started on a timer pass (`timed`) where it stepped since the last (power
        moves slowly, and commit-driven passes stay light); whether steps are left for another pass
        (the run is then judged again at once)."""
        with self._lock:
            arrived = self._arrived.pop(run_id, [])
        try:
            judged = self.engine.judge(con, run_id, time.time_ns(), final=last, ended_came=ended, arrived=arrived)
        except Exception:
            self._arrive(run_id, arrived)  # the next pass is told of them still
            raise
        self.failures.update(judged.failed)
        if judged.failed:  # the run says so itself: its findings over those steps are missing
            found = failing(self._failed.setdefault(run_id, {}), judged)
            findings.record(con, run_id, "collector", found, self.alerts)
        cursor = self.engine.cursors[run_id]
        try:
            if judged.rolled_back is not None:  # what was found on the steps it abandoned is gone with them
                findings.end_run(con, run_id, schema.ROLLED_BACK, self.alerts, since_step=judged.rolled_back)
            findings.record_pass(
                con,
                run_id,
                judged.found,
                self.engine.reads,
                judged.last,
                self.alerts,
                (cursor.step, cursor.rollback, cursor.world),
            )
        except Exception:
            self.engine.forget(run_id)  # the next pass judges these steps again, from the stored cursor
            self._arrive(run_id, arrived)
            raise
        if self._rollback is not None and judged.last >= judged.first_new:
            commands.rollbacks_for_anomalies(con, run_id, self._rollback)
        if judged.found.get(hangs.ANALYZER) and not last:  # where every rank is: asked once a hang fires
            self._stacks_requests(commands.stacks_for_hangs, con, run_id)
        losses.record(con, run_id, final=last or judged.ended)  # nothing more comes: every step settles
        if (
            timed
            and run_id in self._unpowered
            and self._power_every_s is not None
            and time.monotonic() >= self._power_due.get(run_id, 0.0)
        ):
            self._power_due[run_id] = time.monotonic() + self._power_every_s
            self._unpowered.discard(run_id)
            self._draw_power(con, run_id)
        with self._lock:
            (self._behind.add if judged.behind else self._behind.discard)(run_id)
        if judged.ended:
            findings.end_run(
                con,
                run_id,
                schema.RUN_ENDED,
                self.alerts,
                keep=tuple(name for name, reads in self.engine.reads.items() if not reads.ends_with_run),
                state=schema.ENDED,
            )
            self._failed.pop(run_id, None)
            with self._lock:
                self._active.pop(run_id, None)
        if judged.more:
            with self._lock:
                self._stepped.add(run_id)
            self._wake.set()
        return judged.more

    def _settle_stacks(self, con: duckdb.DuckDBPyConnection) -> None:
        """The stacks requests whose time is up, settled (collector/control/commands.py), on the timer's passes."""
        self._stacks_requests(commands.settle_stacks, con, run_ids=sorted(self._led) if self._lake else None)

    def _stacks_requests(self, work: Callable[..., object], *args, **kwargs) -> None:
        """Stacks requests made or settled: a failure is logged and counted, never the rest of the pass's."""
        try:
            work(*args, **kwargs)
        except Exception:
            log.exception("%s failed", work.__name__)
            self.failures["stacks requests"] += 1

    def _draw_power(self, con: duckdb.DuckDBPyConnection, run_id: str) -> None:
        """Start drawing a run's power report on the power thread, on a cursor of its own; the next
        pass records its findings."""
        if run_id in self._power_drawing:
            return
        if self._power_thread is None:
            self._power_thread = ThreadPoolExecutor(1, thread_name_prefix="rankwatch-power")
        self._power_drawing[run_id] = self._power_thread.submit(_power_report, lake.cursor(con), run_id)

    def _record_power(self, con: duckdb.DuckDBPyConnection) -> None:
        """The findings of the power reports drawn since the last pass."""
        for run_id, drawing in list(self._power_drawing.items()):
            if not drawing.done():
                continue
            del self._power_drawing[run_id]
            try:
                report = drawing.result()
                if report is not None:
                    findings.record(con, run_id, power.ANALYZER, report.findings, self.alerts)
            except Exception:
                log.exception("power analysis of run %s failed", run_id)
                self.failures["power"] += 1


@dataclass(frozen=True)
class HealthCounters(Request[None]):
    """The server's counters for the collector's health (health.Snapshot's fields but the writer's own),
    handed to the writer's analysis once per analysis period."""

    requests: dict[int, int]
    commits: dict[float, int]
    queue_bytes: int
    max_queue_bytes: int


@handles(HealthCounters)
def _report_health(context: Context, counters: HealthCounters) -> None:
    context.task(Analysis).report_health(counters)


def _step_ranges(steps: pa.Table) -> dict[str, list[tuple[int, int]]]:
    """The steps of a commit's rows, by run, as ranges of consecutive steps (one a rank's batch)."""
    if steps.num_rows == 0:  # a commit of spans without steps (a batch of collectives alone)
        return {}
    pairs = steps.group_by(["run_id", "step"]).aggregate([]).sort_by([("run_id", "ascending"), ("step", "ascending")])
    runs, numbers = pairs["run_id"].to_numpy(zero_copy_only=False), pairs["step"].to_numpy()
    starts = np.flatnonzero(np.r_[True, (runs[1:] != runs[:-1]) | (numbers[1:] != numbers[:-1] + 1)])
    ranges: dict[str, list[tuple[int, int]]] = {}
    for start, end in zip(starts, np.r_[starts[1:], len(numbers)] - 1, strict=True):
        ranges.setdefault(runs[start], []).append((int(numbers[start]), int(numbers[end])))
    return ranges


def _power_report(cursor: duckdb.DuckDBPyConnection, run_id: str) -> power.PowerReport | None:
    """A run's live power report; None where its GPUs report no power."""
    try:
        return powercaps.live_report(cursor, run_id)
    finally:
        cursor.close()
