"""Running the analysis engine (collector/analysis/engine.py) as telemetry arrives, in the writer process
(the only one with the store open), on a thread of its own with a cursor of its own, so that
commits, and the acknowledgements that wait for them, never wait for a pass however many runs it
judges. The writer builds an Analysis as one of its tasks (collector/writertasks.py), and the server hands it
its health counters as a HealthCounters request (healthcounters.py).

A pass judges the runs its schedule says are due (schedule.py: at once those a commit brought steps or
ends for, and every active run every `interval_s`), and records each run's findings (findings.py),
published to the consumers collector/writertasks.py registers (collector/findings.py's `Consumer`): the alert
outbox, in the transaction of the findings' change; rollbacks and stacks requests, once the pass's findings
are committed (a hang finding that fires asks every rank of its run for its stacks, which the hang
analyzer's next passes read). A run whose ranks all said their training loop ended has its firing findings
resolved ("run ended") once its last steps are judged. Beside the passes: the power recommendations,
redrawn on a thread of their own (powerredraws.py); the collector's own health (ownhealth.py); and in a
lake shared by several collectors, every collector's commits followed and the leases of the runs this one
judges (lakefollow.py).
"""

import collections
import logging
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import asdict

import duckdb
import pyarrow as pa

from collector.analysis import findings, losses
from collector.analysis.analyzers import hangs, predicted, stragglers
from collector.analysis.engine import Engine, failing
from collector.analysis.healthcounters import HealthCounters
from collector.analysis.lakefollow import FOLLOW_S, RENEW_S, LakeFollower
from collector.analysis.ownhealth import CollectorHealth
from collector.analysis.powerredraws import DrawReport, PowerRedraws
from collector.analysis.schedule import PassSchedule
from collector.findings import COLLECTOR, POWER, Consumer, Pass
from collector.store import lake, schema
from collector.store.requests import Context, handles
from rankwatch.agent.config import ANALYZE_EVERY_S

log = logging.getLogger("rankwatch.analysis")
# The collector's stop waits for its last pass: past this, the runs left are judged when it next
# hears from them, from their stored cursors (a backlog of a thousand runs must not hold a stop).
LAST_PASS_S = 20.0


class Analysis:
    """The writer's analysis task: the passes its schedule says are due, on a thread of its own, and what
    each publishes."""

    def __init__(
        self,
        interval_s: float = ANALYZE_EVERY_S,
        straggler_settings=stragglers.Settings(),
        hang_settings=hangs.Settings(),
        consumers: Sequence[Consumer] = (),
        power_report: DrawReport | None = None,
        power_every_s: float | None = 60.0,
        predicted_settings: predicted.Settings = predicted.Settings(),
    ):
        """`interval_s`: how often every active run is judged, new steps or not (a stall shows so).
        `consumers`: what the findings are published to, in order (collector/server.py's: the alert outbox,
        rollbacks, stacks requests). `power_report`: how a run's power report is drawn from the store
        (collector/reports/powercaps.py's `live_report`); `power_every_s`: how often at most; either None:
        never (`rankwatch power recommend` still draws them). `predicted_settings`: the step-time model, where
        one was given."""
        self.engine = Engine(
            {
                stragglers.ANALYZER: straggler_settings,
                hangs.ANALYZER: hang_settings,
                predicted.ANALYZER: predicted_settings,
            },
            stored=True,
        )
        self.consumers = tuple(consumers)
        self.schedule = PassSchedule(interval_s)
        self.power = PowerRedraws(power_report, power_every_s)
        self.health = CollectorHealth()
        self.lake: LakeFollower | None = None  # in a lake shared with other collectors (known once started)
        # what raised since the start: an analyzer, a part of the pass, a consumer
        self.failures: collections.Counter[str] = collections.Counter()
        self.analyzers_failed: dict[str, dict[str, list[int]]] = {}  # run -> the analyzers that raised on it
        self._stopping = False
        self._thread: threading.Thread | None = None  # made in the writer process, at start()

    def start(self, con: duckdb.DuckDBPyConnection) -> None:
        """Run the passes on a thread of their own, on a cursor of `con` (a snapshot reader and a
        writer of findings beside the commit loop), until close()."""
        if lake.attached(con):
            self.lake = LakeFollower()
            self.schedule.interval_s = min(self.schedule.interval_s, RENEW_S)
            self.health.run_id = f"collector {lake.holder()}"  # each collector's own health, apart
        self._thread = threading.Thread(
            target=self._loop, args=(lake.cursor(con),), name="rankwatch-analysis", daemon=True
        )
        self._thread.start()

    def touched(self, run_ids: Collection[str], steps: bool, ended: Iterable[str] = ()) -> None:
        """Runs a commit brought something for (`steps`: rank-steps, else only events such as
        heartbeats; `ended`: runs among them with `ended` events); new steps or ends wake a pass."""
        self.schedule.heard(run_ids, steps, ended)

    def committed(self, tables: Mapping[str, Sequence[pa.Table]]) -> None:
        """The writer's word of a commit (a store task's): the runs it brought steps or events for, and
        the steps it brought each. In a lake every commit is read from the lake's snapshots instead
        (_follow_lake), this one's too."""
        if self.lake is None:
            self.schedule.take(tables)

    def report_health(self, counters: HealthCounters) -> None:
        """The server's counters, judged on the analysis thread with the writer's, right away."""
        self.health.report(asdict(counters))
        self.schedule.wake()

    def due_in(self) -> float:
        return self.schedule.due_in()

    def run(self, con: duckdb.DuckDBPyConnection, last: bool = False, every: bool = True) -> None:
        """One pass; an analyzer's failure is logged, never raised. `every`: every active run (else
        only those with new steps or ends). `last`: the runs with steps not yet judged, to their newest
        step even where not every rank has reported it, so the findings left behind are drawn on all
        the data committed. A run with more new steps than one pass judges is judged again at once."""
        due = self.schedule.due(every, last, judged=self.engine.cursors)
        for run_id in due.quiet:
            self.engine.release(run_id)  # gone quiet: its cursor stays, the steps kept for it go
        self.power.note_stepped(due.stepped)
        runs = due.runs if self.lake is None else self._lead(con, due.runs)
        self.power.keep_only(self.schedule.active())
        self._record_power(con)
        if every and not last:
            leased = None if self.lake is None else sorted(self.lake.leased)
            self._publish(lambda consumer: consumer.on_timer(con, leased))
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
                while self._judge_run(con, run_id, every and not last, run_id in due.ended, last) and last:
                    pass
            except Exception:
                log.exception("analysis of run %s failed", run_id)
                self.failures["the pass"] += 1
        if last:  # the runs judged before: nothing more comes, so their telemetry loss settles too
            judged_before = self.schedule.active() - set(runs)
            for run_id in sorted(judged_before if self.lake is None else judged_before & self.lake.leased):
                if time.monotonic() > until:
                    break
                try:
                    losses.record(con, run_id, final=True)
                except Exception:
                    log.exception("telemetry loss of run %s not settled", run_id)
                    self.failures["telemetry loss"] += 1

    def _lead(self, con: duckdb.DuckDBPyConnection, runs: list[str]) -> list[str]:
        """In a lake: the runs of `runs` this collector leads (lakefollow.py). A run whose lease it
        took or lost is judged from its stored cursor, since another collector may have judged it
        meanwhile; one it does not lead is not kept in memory."""
        assert self.lake is not None
        led, changed = self.lake.lead(con, runs)
        for run_id in changed:
            self.engine.forget(run_id)
        for run_id in set(runs) - set(led):
            self.schedule.drop_steps(run_id)
        return led

    def close(self) -> None:
        """Stop the thread after a last pass over what came since the one before, so that the store
        left behind has findings for all it holds (a job's last steps often come in its final flush,
        just before the collector stops); the power report being drawn finishes first and is
        recorded, and no new one is started. The writer calls it once its queue is drained.
        Passes run by hand (no start()) only have the power thread stopped."""
        if self._thread is None:
            self.power.stop()
            return
        self._stopping = True
        self.schedule.wake()
        self._thread.join()

    def _loop(self, con: duckdb.DuckDBPyConnection) -> None:
        try:
            while not self._stopping:
                self.schedule.wait(at_most=None if self.lake is None else FOLLOW_S)
                if self.lake is not None:
                    self._follow_lake(con)
                self._judge_health(con)
                if not self._stopping:
                    self.run(con, every=not self.schedule.due_in())
            self.power.stop()
            self._judge_health(con)
            if self.lake is not None:
                self._follow_lake(con)
            self.run(con, last=True)
            if self.lake is not None:
                self.lake.give_up(con)
        finally:
            con.close()

    def _follow_lake(self, con: duckdb.DuckDBPyConnection) -> None:
        """In a lake: what every collector's commits inserted since the last call, taken as the writer's
        word of a commit."""
        assert self.lake is not None
        try:
            if (inserted := self.lake.inserted(con)) is not None:
                self.schedule.take(inserted)
        except Exception:  # (snapshots expired under a collector that fell an hour behind, say)
            log.exception("the lake's new commits could not be read; following it from its newest snapshot")
            self.lake.snapshot = None
            self.failures["the lake"] += 1

    def _judge_health(self, con: duckdb.DuckDBPyConnection) -> None:
        """The server's counters reported since the last call, judged (ownhealth.py) and recorded."""
        while self.health.reported:
            counters = self.health.reported.popleft()
            try:
                found = self.health.judge(con, counters, dict(self.failures))
                findings.record(con, self.health.run_id, COLLECTOR, found, self.consumers)
            except Exception:
                log.exception("judging the collector's health failed")
                self.failures["health"] += 1

    def _judge_run(self, con: duckdb.DuckDBPyConnection, run_id: str, timed: bool, ended: bool, last: bool) -> bool:
        """One pass of the engine over a run: its findings recorded and published, its telemetry loss
        settled, its power report started on a timer pass (`timed`) where due; whether steps are left for
        another pass (the run is then judged again at once)."""
        committed = self.schedule.steps_of(run_id)
        try:
            judged = self.engine.judge(
                con, run_id, time.time_ns(), final=last, ended_came=ended, arrived=committed, timed=timed
            )
        except Exception:
            self.schedule.add_steps(run_id, committed)  # the next pass is told of them still
            raise
        if judged.idle:  # a commit brought some ranks' steps alone: nothing to judge or record until the rest come
            self.schedule.awaits_ranks(run_id, judged.behind)
            return False
        self.failures.update(judged.failed)
        if judged.failed:  # the run says so itself: its findings over those steps are missing
            found = failing(self.analyzers_failed.setdefault(run_id, {}), judged)
            findings.record(con, run_id, COLLECTOR, found, self.consumers)
        cursor = self.engine.cursors[run_id]
        try:
            if judged.rolled_back is not None:  # what was found on the steps it abandoned is gone with them
                findings.end_run(con, run_id, schema.ROLLED_BACK, self.consumers, since_step=judged.rolled_back)
            findings.record_pass(
                con,
                run_id,
                judged.found,
                self.engine.reads,
                judged.last,
                self.consumers,
                (cursor.step, cursor.rollback, cursor.world),
            )
        except Exception:
            self.engine.forget(run_id)  # the next pass judges these steps again, from the stored cursor
            self.schedule.add_steps(run_id, committed)
            raise
        recorded = Pass(run_id, judged.found, new_steps=judged.last >= judged.first_new, last=last)
        self._publish(lambda consumer: consumer.on_pass(con, recorded))
        losses.record(con, run_id, final=last or judged.ended)  # nothing more comes: every step settles
        if timed:
            self.power.redraw_if_due(con, run_id)
        self.schedule.awaits_ranks(run_id, judged.behind)
        if judged.ended:
            findings.end_run(
                con,
                run_id,
                schema.RUN_ENDED,
                self.consumers,
                keep=tuple(name for name, reads in self.engine.reads.items() if not reads.ends_with_run),
                state=schema.ENDED,
            )
            self.analyzers_failed.pop(run_id, None)
            self.schedule.ended(run_id)
        if judged.more:
            self.schedule.again(run_id)
        return judged.more

    def _publish(self, deliver: Callable[[Consumer], None]) -> None:
        """What a pass publishes once its findings are committed, to each consumer in turn: one's failure
        is logged and counted, never the others' or the rest of the pass's."""
        for consumer in self.consumers:
            try:
                deliver(consumer)
            except Exception:
                log.exception("the %s consumer failed", consumer.name)
                self.failures[consumer.name] += 1

    def _record_power(self, con: duckdb.DuckDBPyConnection) -> None:
        """The findings of the power reports drawn since the last pass."""
        for run_id, drawing in self.power.finished():
            try:
                report = drawing.result()
                if report is not None:
                    findings.record(con, run_id, POWER, report.findings, self.consumers)
            except Exception:
                log.exception("power analysis of run %s failed", run_id)
                self.failures["power"] += 1


@handles(HealthCounters)
def _report_health(context: Context, counters: HealthCounters) -> None:
    context.task(Analysis).report_health(counters)
