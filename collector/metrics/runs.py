"""Per-run fleet aggregates at /metrics, for Prometheus and Grafana.

Computed on scrape: the server asks the writer process (a `RunMetrics`
request, collector/store/requests.py; the one process that can read the store),
which reads on a query thread with a cursor of its own, beside the commit loop, and the server
keeps the answer CACHE_S. On scrape rather than after each analysis pass
because then the cost is paid only when someone scrapes, at most once per
CACHE_S however many Prometheus servers do, the values are as fresh as the
scrape, and the answer travels on the path the control and query APIs already
use instead of a second channel from the writer. Each query reads a bounded
slice: steps that ended in the last ACTIVE_S (DuckDB's zone maps skip older
row groups, so a scrape costs about the same at step 100 and at step 10
million), aggregated over each run's last WINDOW_S of them. Measured: 0.3 to
0.7 s for two runs of 1024 ranks at a step a second (7M rank-steps in the
last hour, 15M in all) on a shared 2-core machine.

Cardinality is bounded: every series is labelled by run alone (the MAX_RUNS
runs, by default, whose newest step ended last, of those that finished a step
in the last ACTIVE_S), plus one bounded label where noted:
quantile (3 values), kind (the analyzers' kinds), and rank on one gauge only,
for at most SUSPECTS ranks per run. The collector's own health is in
selfmetrics.py; the alert outbox's is here, since it too lives in the store.

Label values are bounded too, so the page is (MAX_RUNS runs of about 25 series, each under 400 bytes:
under 2 MiB): a run id is its own label up to MAX_LABEL_BYTES, the bound ingest holds run ids to; a
longer one, stored before ids were bounded, is cut and a digest of it added (200 runs with 120 KB ids
made a 229 MB page, and 8 scrapers took the collector from 1.25 to 4.19 GB).

Active runs past MAX_RUNS have no series of their own: `rankwatch_runs_left_out`
counts them, and the metrics that add up (findings, rollbacks, power, energy)
count them together under run="_other". 60,000 active runs made a 26 MiB page
of 420,000 series that took 4.6 s a scrape; bounded, the page and its queries
grow with MAX_RUNS, not with the runs. Each per-run query reads the runs it
reports through `run_labels` (an active run's id, and the label its series
carry: itself, or OTHER), so a new per-run metric joins it and either adds the
left-out runs under OTHER or keeps to the runs shown.
"""

import hashlib
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

import duckdb
import pyarrow as pa
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from collector.alerts import outbox
from collector.receive.decode import MAX_NAME_BYTES
from collector.store.requests import Context, Request, handles
from rankwatch.agent import semconv as sc

log = logging.getLogger("rankwatch.metrics")
ACTIVE_S = 3600  # a run that finished no step for this long has no series
WINDOW_S = 300  # step aggregates are over each run's last five minutes of steps
QUANTILES = (0.5, 0.9, 0.99)
SUSPECTS = 5  # ranks named by firing findings, per run, at most
CACHE_S = 5.0
CALL_TIMEOUT_S = 5.0  # a scrape waits this long for the writer, then gets the previous answer
MAX_RUNS = 200  # active runs with series of their own (the newest); Config.metrics_runs sets it
OTHER = "_other"  # the run label of the active runs past the bound, counted together
MAX_LABEL_BYTES = MAX_NAME_BYTES  # a run id ingest takes is its own label

# the runs that finished a step in the last ACTIVE_S, and when their newest step ended, newest first
_RUNS = """SELECT run_id, max(epoch_ns(end_ts)) AS newest FROM current_steps WHERE end_ts > make_timestamp_ns($since)
           GROUP BY run_id ORDER BY newest DESC, run_id"""
# each of those runs' last WINDOW_S of steps (a join on a per-run bound, not a window function:
# DuckDB then reads only the row groups of the last WINDOW_S before the oldest bound)
_STEPS = """
SELECT s.run_id, quantile_cont(duration_s, $quantiles),
       sum(tokens) / nullif((max(epoch_ns(end_ts)) - min(epoch_ns(start_ts))) / 1e9, 0), avg(mfu),
       sum(comm_wait_s) / nullif(sum(duration_s), 0), max(step), max(epoch_ns(end_ts)) / 1e9, count(DISTINCT rank)
FROM current_steps s JOIN (SELECT unnest($runs) AS run_id, unnest($ends) - $window AS since) r ON s.run_id = r.run_id
WHERE s.end_ts > make_timestamp_ns($oldest) AND epoch_ns(s.end_ts) > r.since
GROUP BY s.run_id ORDER BY s.run_id"""
_FINDINGS = """SELECT label, kind, count(*) FILTER (WHERE state = 'firing') FROM findings JOIN run_labels USING (run_id)
               WHERE severity != 'info' GROUP BY ALL ORDER BY ALL"""
_SUSPECTS = """SELECT run_id, rank, count(*) AS n
               FROM (SELECT run_id, unnest(ranks) AS rank FROM findings
                     WHERE state = 'firing' AND severity != 'info' AND list_contains($runs, run_id))
               GROUP BY run_id, rank QUALIFY row_number() OVER (PARTITION BY run_id ORDER BY n DESC, rank) <= $k
               ORDER BY ALL"""
_ROLLBACKS = """SELECT label, count(*) FROM commands JOIN run_labels USING (run_id) WHERE kind = 'rollback'
                GROUP BY ALL"""
# the telemetry each run lost (collector/analysis/losses.py keeps one row a run), the runs past the bound summed
_LOSSES = """SELECT label, sum(missing), sum(agent_spans_dropped), sum(agent_rank_steps_dropped)
               FROM telemetry_loss JOIN run_labels USING (run_id) GROUP BY label ORDER BY label"""
# the newest checkpoint of each run: the longest any rank's training loop was blocked by it
_CHECKPOINTS = f"""
WITH saved AS (
    SELECT run_id, step, TRY_CAST(attrs->>{sc.json_path(sc.CKPT_BLOCKED_S)} AS DOUBLE) AS blocked_s,
           max(step) OVER (PARTITION BY run_id) AS last_step
    FROM events WHERE event = 'checkpoint_saved' AND ts > make_timestamp_ns($since) AND list_contains($runs, run_id))
SELECT run_id, max(blocked_s) FROM saved WHERE step = last_step GROUP BY run_id HAVING max(blocked_s) IS NOT NULL"""
# each GPU's latest power and energy counter reading, summed over the run's GPUs
_DEVICES = """
SELECT label, metric, sum(latest) FROM (
    SELECT label, run_id, rank, gpu, metric, arg_max(value, ts) AS latest
    FROM device_samples JOIN run_labels USING (run_id)
    WHERE ts > make_timestamp_ns($since) AND metric IN ($power, $energy)
    GROUP BY ALL)
GROUP BY ALL ORDER BY ALL"""


@dataclass(frozen=True)
class Snapshot:
    """The aggregates of the runs active now, as the queries below give them (rows of tuples), each
    run named by its label; the findings, rollbacks and devices of the runs past the bound under OTHER."""

    steps: list[tuple]  # run, duration quantiles, tokens/s, MFU, exposed share, last step, its end, ranks
    findings: list[tuple]  # run, kind, firing
    suspects: list[tuple]  # run, rank, firing findings naming it
    rollbacks: dict[str, int]  # run -> rollback commands
    checkpoints: list[tuple]  # run, the newest checkpoint's longest stall
    devices: list[tuple]  # run, metric (power or energy), sum of each GPU's latest
    outbox: list[tuple]  # receiver, state, notifications
    losses: list[tuple]  # run, rank-steps never received, spans and rank-steps its agents dropped
    left_out: int = 0  # active runs past the bound, without series of their own


@dataclass(frozen=True)
class SnapshotRequest(Request[Snapshot]):
    """The run metrics, for /metrics: read in the writer process on a query thread."""

    max_runs: int = MAX_RUNS


@handles(SnapshotRequest, beside=True)
def _snapshot(context: Context, request: SnapshotRequest) -> Snapshot:
    return snapshot(context.con, request.max_runs)


def snapshot(con: duckdb.DuckDBPyConnection, max_runs: int = MAX_RUNS) -> Snapshot:
    """The aggregates of the runs active now, series of their own for the `max_runs` newest (run in
    the writer process, on a cursor of its own: a SnapshotRequest)."""
    now = time.time_ns()
    since = now - ACTIVE_S * 10**9
    active = con.execute(_RUNS, {"since": since}).fetchall()
    ends = dict(active[:max_runs])
    runs = {"runs": list(ends)}
    shown = {run: label(run) for run in ends}
    labels = list(shown.values()) + [OTHER] * (len(active) - len(ends))
    con.register("run_labels", pa.table({"run_id": [run for run, _ in active], "label": labels}))

    def labelled(rows: list[tuple]) -> list[tuple]:  # rows of the runs shown, their run ids as labels
        return [(shown[run], *rest) for run, *rest in rows]

    try:
        return Snapshot(
            steps=labelled(
                con.execute(
                    _STEPS,
                    {
                        **runs,
                        "ends": list(ends.values()),
                        "window": WINDOW_S * 10**9,
                        "oldest": min(ends.values(), default=now) - WINDOW_S * 10**9,
                        "quantiles": list(QUANTILES),
                    },
                ).fetchall()
            ),
            findings=con.execute(_FINDINGS).fetchall(),
            suspects=labelled(con.execute(_SUSPECTS, {**runs, "k": SUSPECTS}).fetchall()),
            rollbacks=dict(con.execute(_ROLLBACKS).fetchall()),
            checkpoints=labelled(con.execute(_CHECKPOINTS, {**runs, "since": since}).fetchall()),
            devices=con.execute(
                _DEVICES, {"since": now - WINDOW_S * 10**9, "power": sc.POWER_W, "energy": sc.ENERGY_J}
            ).fetchall(),
            outbox=[(label(receiver), state, n) for receiver, state, n in outbox.counts(con)],
            losses=con.execute(_LOSSES).fetchall(),
            left_out=len(active) - len(ends),
        )
    finally:
        con.unregister("run_labels")


def label(value: str) -> str:
    """`value` as a label value of at most MAX_LABEL_BYTES: itself where it fits, else cut and a digest
    of it added (two long values cut alike stay two series)."""
    raw = value.encode()
    if len(raw) <= MAX_LABEL_BYTES:
        return value
    digest = hashlib.blake2b(raw, digest_size=8).hexdigest()
    return raw[: MAX_LABEL_BYTES - len(digest) - 1].decode(errors="ignore") + "~" + digest


class RunMetrics(Collector):
    """A prometheus_client collector of the run aggregates; `call` is Store.call of the open store.
    collect() waits for the writer, so /metrics must render off the event loop."""

    def __init__(self, call: Callable[[SnapshotRequest], "Future[Snapshot]"], max_runs: int = MAX_RUNS):
        self._call = call
        self._max_runs = max_runs
        self._lock = threading.Lock()
        self._snapshot: Snapshot | None = None
        self._taken = float("-inf")
        self._asked: Future[Snapshot] | None = None  # the call in flight
        self._late: Future[Snapshot] | None = None  # the last call said to be late

    def collect(self):
        snap = self._fresh()
        if snap is not None:
            yield from families(snap)

    def _fresh(self) -> Snapshot | None:
        """The snapshot taken within CACHE_S, else a new one, waited for CALL_TIMEOUT_S at most (then the
        previous one is served). Concurrent scrapes share one call, and a call still in flight is not made
        again: scrapes of a store slow to answer do not pile calls up in the writer."""
        with self._lock:
            if self._asked is None and time.monotonic() - self._taken >= CACHE_S:
                self._asked = self._call(SnapshotRequest(self._max_runs))
            asked = self._asked
        if asked is None:
            return self._snapshot
        answer: Snapshot | Exception
        try:
            answer = asked.result(CALL_TIMEOUT_S)
        except FutureTimeout:
            with self._lock:
                if self._late is not asked:
                    self._late = asked
                    log.warning("run metrics late (over %g s), serving the previous ones", CALL_TIMEOUT_S)
            return self._snapshot
        except Exception as e:  # the writer could not answer
            answer = e
        with self._lock:
            if self._asked is asked:  # (the first scrape back from the call)
                self._asked = None
                if isinstance(answer, Exception):
                    log.warning("run metrics unavailable, serving the previous ones: %s", answer)
                else:
                    self._snapshot, self._taken = answer, time.monotonic()
            return self._snapshot


def families(snap: Snapshot) -> list:
    """The metric families of a snapshot."""

    def gauge(name: str, doc: str, labels: tuple[str, ...] = ("run",)) -> GaugeMetricFamily:
        return GaugeMetricFamily(name, doc, labels=list(labels))

    # A summary of quantiles alone: over a sliding window, as a client library's summary's are; its
    # cumulative _sum and _count would need every step of the run.
    step = Metric(
        "rankwatch_run_step_duration_seconds",
        f"Rank-step duration quantiles over the run's last {WINDOW_S} s of steps",
        "summary",
    )
    tokens = gauge("rankwatch_run_tokens_per_second", "Tokens processed per second by all ranks together")
    mfu = gauge("rankwatch_run_mfu_ratio", "Mean model FLOP utilisation (0..1) reported by the ranks")
    exposed = gauge(
        "rankwatch_run_exposed_communication_ratio",
        "Share of step time spent waiting on communication not overlapped with compute",
    )
    last_step = gauge("rankwatch_run_last_step", "The newest step any rank finished")
    last_end = gauge("rankwatch_run_last_step_timestamp_seconds", "When the newest step ended (Unix time)")
    ranks = gauge("rankwatch_run_ranks", f"Ranks that finished a step in the run's last {WINDOW_S} s of steps")
    for run, quantiles, tps, mfu_mean, exposed_share, newest, end_s, n_ranks in snap.steps:
        for q, value in zip(QUANTILES, quantiles):
            step.add_sample(step.name, {"run": run, "quantile": str(q)}, value)
        for family, value in (
            (tokens, tps),
            (mfu, mfu_mean),
            (exposed, exposed_share),
            (last_step, newest),
            (last_end, end_s),
            (ranks, n_ranks),
        ):
            if value is not None:
                family.add_metric([run], value)
    firing = gauge("rankwatch_run_findings_firing", "Firing findings, by kind", ("run", "kind"))
    for run, kind, n in snap.findings:
        firing.add_metric([run, kind], n)
    suspects = gauge(
        "rankwatch_run_suspect_rank_findings_firing",
        f"Firing findings naming a rank, for the {SUSPECTS} ranks named most",
        ("run", "rank"),
    )
    for run, rank, n in snap.suspects:
        suspects.add_metric([run, str(rank)], n)
    rollbacks = CounterMetricFamily("rankwatch_run_rollbacks", "Rollback commands created for the run", labels=["run"])
    for run in [run for run, *_ in snap.steps] + ([OTHER] if snap.left_out else []):
        rollbacks.add_metric([run], snap.rollbacks.get(run, 0))
    stall = gauge(
        "rankwatch_run_checkpoint_stall_seconds", "Training-loop time the newest checkpoint cost, on its slowest rank"
    )
    for run, seconds in snap.checkpoints:
        stall.add_metric([run], seconds)
    power = gauge("rankwatch_run_power_watts", "Power drawn by the run's GPUs, latest sample of each, summed")
    energy = CounterMetricFamily(
        "rankwatch_run_energy_joules",
        "The run's GPUs' energy counters (since driver load), summed; use increase()",
        labels=["run"],
    )
    for run, metric, value in snap.devices:
        (power if metric == sc.POWER_W else energy).add_metric([run], value)
    missing = gauge(
        "rankwatch_run_rank_steps_missing",
        "Rank-steps the collector expected (a rank silent at a step its peers reported) but never received",
    )
    spans_dropped = gauge("rankwatch_run_agent_spans_dropped", "Spans the run's agents reported dropped before export")
    steps_dropped = gauge(
        "rankwatch_run_agent_rank_steps_dropped", "Rank-steps the run's agents reported dropped before export"
    )
    for run, n, spans, rank_steps in snap.losses:
        missing.add_metric([run], n)
        spans_dropped.add_metric([run], spans)
        steps_dropped.add_metric([run], rank_steps)
    pending = gauge("rankwatch_collector_alerts_pending", "Alert notifications waiting for delivery", ("receiver",))
    delivered = CounterMetricFamily(
        "rankwatch_collector_alerts_delivered", "Alert notifications delivered", labels=["receiver"]
    )
    abandoned = CounterMetricFamily(
        "rankwatch_collector_alerts_abandoned",
        "Alert notifications given up (expired, or their receiver removed)",
        labels=["receiver"],
    )
    by_state: dict[tuple[str, str], int] = {}
    for receiver, state, n in snap.outbox:
        key = (receiver, "abandoned" if state in ("expired", "dropped") else state)
        by_state[key] = by_state.get(key, 0) + n
    for receiver in sorted({r for r, _ in by_state}):
        outbox: tuple[tuple[GaugeMetricFamily | CounterMetricFamily, str], ...] = (
            (pending, "pending"),
            (delivered, "delivered"),
            (abandoned, "abandoned"),
        )
        for counted, state in outbox:
            counted.add_metric([receiver], by_state.get((receiver, state), 0))
    left_out = gauge(
        "rankwatch_runs_left_out",
        f"Active runs past the bound, without series of their own: their findings, rollbacks, power and "
        f'energy are counted together under run="{OTHER}"',
        (),
    )
    left_out.add_metric([], snap.left_out)
    return [
        left_out,
        step,
        tokens,
        mfu,
        exposed,
        last_step,
        last_end,
        ranks,
        firing,
        suspects,
        rollbacks,
        stall,
        power,
        energy,
        missing,
        spans_dropped,
        steps_dropped,
        pending,
        delivered,
        abandoned,
    ]
