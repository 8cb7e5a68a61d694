"""Running the analyzers as telemetry arrives: every few seconds, over each run that
sent anything recently, in the writer process (the only one with the store open), on
a thread of its own with a cursor of its own, so that commits, and the
acknowledgements that wait for them, never wait for a pass however many runs it
judges; the power analyzer, which costs seconds at a thousand ranks, on a second
thread, so that a pass does not wait for it either.

The analyzers are pure functions; this module reads what they need from the store
(the last steps of a run, its placement, its recent heartbeats), calls them, and
records their findings.
"""

import collections
import json
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import duckdb

from collector import commands, findings, powercaps
from collector.alerts.config import AlertConfig
from collector.analyzers import anomalies, hangs, health, links, power, rollbacks, stragglers

log = logging.getLogger("rankwatch.analysis")
ACTIVE_FOR_S = 3600  # a run silent this long is no longer analysed (a hang has fired long before)
# Power recommendations move slowly and cost more to draw (a bootstrap over the ranks): they are
# redrawn over a run's newest POWER_STEPS steps at most every power_every_s, by the live policy.
POWER_STEPS = 100
POWER_POLICY = power.Policy("max-slowdown", 0.02)

_STEPS = """SELECT run_id, rank, step, epoch_ns(end_ts) AS end_ts, duration_s, data_s, compute_s, comm_wait_s, loss,
                   grad_norm, coalesce(NOT isfinite(loss), false) OR coalesce(NOT isfinite(grad_norm), false)
                   AS non_finite
            FROM current_steps
            WHERE run_id = $run AND step >= (SELECT max(step) FROM current_steps WHERE run_id = $run) - $steps"""
_COLLECTIVES = """SELECT run_id, rank, step, name, comm_group, group_size, duration_s, busbw_gbps FROM ops
                  WHERE run_id = $run AND kind = 'comm' AND busbw_gbps IS NOT NULL
                    AND step > (SELECT max(step) FROM current_steps WHERE run_id = $run) - $steps"""
_DEVICES = """SELECT rank, metric, value FROM device_samples
              WHERE run_id = $run AND ts >= make_timestamp_ns($since)"""
_HAS_POWER = """SELECT count(*) > 0 FROM (SELECT 1 FROM device_samples
                                         WHERE run_id = $run AND metric IN $metrics LIMIT 1)"""
_FAILED_ROLLBACKS = """SELECT run_id, id, finding_id, result FROM commands
                       WHERE run_id = $run AND kind = 'rollback' AND state = 'failed'"""
_OUTBOX = """SELECT receiver, count(*) AS pending, epoch(now() - min(created_at)) AS waiting_s FROM outbox
             WHERE state = 'pending' GROUP BY receiver"""
_HEARTBEATS = """SELECT rank, epoch_ns(ts) AS ts, step, attrs->>'$."rankwatch.phase"' AS phase,
                        attrs->>'$."rankwatch.comm.op"' AS op, attrs->>'$."rankwatch.comm.group"' AS "group",
                        TRY_CAST(attrs->>'$."rankwatch.comm.seq"' AS BIGINT) AS seq,
                        TRY_CAST(attrs->>'$."rankwatch.comm.done"' AS BOOLEAN) AS done
                 FROM events WHERE run_id = $run AND event = 'heartbeat' AND ts > make_timestamp_ns($since)"""


class Analysis:
    """Which runs are active, when the analyzers are next due, and one pass over them."""

    def __init__(self, interval_s: float = 5.0, straggler_settings=stragglers.Settings(),
                 hang_settings=hangs.Settings(), rollback: commands.RollbackPolicy | None = commands.RollbackPolicy(),
                 alerts: AlertConfig = AlertConfig(), power_every_s: float | None = 60.0):
        """`rollback`: how anomalies are rolled back; None: they are reported, not rolled back.
        `alerts`: where the alerts that findings raise are sent (the writer's delivery thread reads it too).
        `power_every_s`: how often a run's power recommendations are redrawn; None: never (`rankwatch power
        recommend` still draws them)."""
        self.interval_s = interval_s
        self.alerts = alerts
        self._stragglers, self._hangs, self._rollback = straggler_settings, hang_settings, rollback
        self._power_every_s = power_every_s
        self._power_due: dict[str, float] = {}  # run -> when its power recommendations are next drawn
        self._power_drawing: dict[str, Future] = {}  # run -> its power report, being drawn
        self._power_thread: ThreadPoolExecutor | None = None  # made in the writer process, on first use
        self._active: dict[str, float] = {}
        self._health: collections.deque[health.Snapshot] = collections.deque()
        self._started = time.monotonic()
        self.failures = 0  # analyses that raised, since the start
        self._stepped: set[str] = set()  # runs with new steps since the last pass
        self._next = time.monotonic() + interval_s
        self._counters: list[dict] = []  # the server's health counters, not yet judged
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
        self._thread = threading.Thread(target=self._loop, args=(con.cursor(),), name="rankwatch-analysis",
                                        daemon=True)
        self._thread.start()

    def touched(self, run_ids, steps: bool) -> None:
        """Runs that sent something (`steps`: rank-steps, else only events such as heartbeats)."""
        now = time.monotonic()
        with self._lock:
            self._active.update((run_id, now) for run_id in run_ids)
            if steps:
                self._stepped.update(run_ids)

    def report_health(self, **counters) -> None:
        """The server's counters (health.Snapshot's fields but the writer's own), judged on the
        analysis thread with the writer's, right away."""
        with self._lock:
            self._counters.append(dict(counters, at=time.monotonic()))
        self._wake.set()

    def run(self, con: duckdb.DuckDBPyConnection, last: bool = False) -> None:
        """One pass over the active runs; an analyzer's failure is logged, never raised. `last`: every
        analyzer on every run, so the findings left behind are drawn on all the data committed."""
        self._next = time.monotonic() + self.interval_s
        cutoff = time.monotonic() - ACTIVE_FOR_S
        with self._lock:
            self._active = {run: t for run, t in self._active.items() if t > cutoff}
            stepped, self._stepped = self._stepped, set()
            active = sorted(self._active, key=lambda run: run not in stepped)  # runs that stepped first
        self._power_due = {run: t for run, t in self._power_due.items() if run in active}
        self._record_power(con)
        for run_id in active:
            try:
                self._analyze(con, run_id, last or run_id in stepped)
            except Exception:
                log.exception("analysis of run %s failed", run_id)
                self.failures += 1

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
                self._wake.wait(self.due_in())
                self._wake.clear()
                self._judge_reported_health(con)
                if not self.due_in() and not self._stopping:
                    self.run(con)
            self._power_every_s = None
            if self._power_thread is not None:
                self._power_thread.shutdown(cancel_futures=True)
            self._judge_reported_health(con)
            self.run(con, last=True)
        finally:
            con.close()

    def _judge_reported_health(self, con: duckdb.DuckDBPyConnection) -> None:
        with self._lock:
            reported, self._counters = self._counters, []
        for counters in reported:
            try:
                self.judge_health(con, health.Snapshot(analysis_failures=self.failures, **counters))
            except Exception:
                log.exception("judging the collector's health failed")
                self.failures += 1

    def judge_health(self, con: duckdb.DuckDBPyConnection, snapshot: health.Snapshot,
                     settings: health.Settings = health.Settings()) -> None:
        """The collector's health findings, from its counters now and the oldest within the window."""
        if not self._health:  # the counters began at zero: what came before the first report counts too
            self._health.append(health.Snapshot(self._started, {}, 0, snapshot.max_queue_bytes, {}, 0))
        self._health.append(snapshot)
        while snapshot.at - self._health[0].at > settings.window_s:
            self._health.popleft()
        found = health.analyze(self._health[0], snapshot, con.execute(_OUTBOX).df(), settings)
        findings.record(con, health.RUN_ID, health.ANALYZER, found, self.alerts)

    def _analyze(self, con: duckdb.DuckDBPyConnection, run_id: str, new_steps: bool) -> None:
        """The hang and stopped-job analyzers on every active run (a run that stopped sending steps);
        the others only where new steps came since the last pass."""
        steps = con.execute(_STEPS, {"run": run_id, "steps": 4 * self._stragglers.window}).df()
        if steps.empty:
            return
        # only steps every rank has reported: the ranks' exports arrive apart, and a pass may come between
        # them; judging a step half-arrived compares a rank with some of its peers only
        complete = steps[steps.groupby("step")["rank"].transform("nunique") == steps["rank"].nunique()]
        if new_steps and not complete.empty:
            ranks = con.execute("SELECT rank, host, pp_stage FROM ranks WHERE run_id = ?", [run_id]).df()
            devices = con.execute(_DEVICES, {"run": run_id, "since": int(complete["end_ts"].min())}).df()
            findings.record(con, run_id, stragglers.ANALYZER,
                            stragglers.analyze(complete, ranks, self._stragglers, devices), self.alerts)
            collectives = con.execute(_COLLECTIVES, {"run": run_id, "steps": links.Settings().window + 1}).df()
            collectives = collectives[collectives["step"] < steps["step"].max()]
            findings.record(con, run_id, links.ANALYZER,
                            links.analyze(collectives, float(complete["duration_s"].median())), self.alerts)
            findings.record(con, run_id, anomalies.ANALYZER, anomalies.analyze(complete), self.alerts)
            if self._rollback is not None:
                commands.rollbacks_for_anomalies(con, run_id, self._rollback)
            if self._power_every_s is not None and time.monotonic() >= self._power_due.get(run_id, 0.0):
                self._power_due[run_id] = time.monotonic() + self._power_every_s
                self._draw_power(con, run_id)
        failed = con.execute(_FAILED_ROLLBACKS, {"run": run_id}).df()
        failed["result"] = failed["result"].map(lambda r: json.loads(r) if r else None)
        findings.record(con, run_id, rollbacks.ANALYZER, rollbacks.analyze(failed, int(steps["step"].max())),
                        self.alerts)
        now = time.time_ns()  # telemetry times are UTC epoch ns, whatever DuckDB's time zone
        heartbeats = con.execute(_HEARTBEATS, {"run": run_id, "since": now - 120 * 10**9}).df()
        findings.record(con, run_id, hangs.ANALYZER, hangs.analyze(steps, heartbeats, now, self._hangs), self.alerts)

    def _draw_power(self, con: duckdb.DuckDBPyConnection, run_id: str) -> None:
        """Start drawing a run's power report on the power thread, on a cursor of its own; the next
        pass records its findings."""
        if run_id in self._power_drawing:
            return
        if self._power_thread is None:
            self._power_thread = ThreadPoolExecutor(1, thread_name_prefix="rankwatch-power")
        self._power_drawing[run_id] = self._power_thread.submit(_power_report, con.cursor(), run_id)

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
                self.failures += 1


def _power_report(cursor: duckdb.DuckDBPyConnection, run_id: str) -> power.PowerReport | None:
    """A run's live power report; None where its GPUs report no power."""
    try:
        if cursor.execute(_HAS_POWER, {"run": run_id, "metrics": list(power.POWER_METRICS)}).fetchone()[0]:
            return powercaps.recommend(cursor, run_id, POWER_POLICY, last_steps=POWER_STEPS)
        return None
    finally:
        cursor.close()
