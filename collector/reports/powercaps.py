"""`rankwatch power recommend`: a run's power telemetry read from a store, through the power
analyzer (analyzers/power.py), and the report as one JSON document.

Each rank-step gets the power limit in force at its end: the rank's latest
`DCGM_FI_DEV_POWER_MGMT_LIMIT` sample at or before it (an as-of join). The
power model is the simulated GPU's (an H100 SXM); where the GPUs sampled their
limit constraints, those set the model's limits and its full power (the
highest limit), so an A100's 400 W is its own.
"""

from dataclasses import asdict, replace

import duckdb

from collector.analysis.analyzers import power
from collector.store.runs import unknown_run
from rankwatch.agent import semconv as sc
from rankwatch.agent.gpumodel import GpuModel

_STEPS = """WITH limits AS (SELECT rank, ts, value FROM device_samples WHERE run_id = $run AND metric = $limit)
            SELECT s.run_id, s.rank, s.step, s.duration_s, s.data_s, s.compute_s, s.comm_wait_s, s.energy_j,
                   l.value AS power_limit_w
            FROM current_steps s ASOF LEFT JOIN limits l ON s.rank = l.rank AND s.end_ts >= l.ts
            WHERE s.run_id = $run AND s.step >= $first ORDER BY s.step, s.rank"""
_WINDOW = """WITH w AS (SELECT max(step) - $steps + 1 AS first FROM current_steps WHERE run_id = $run)
             SELECT first, epoch_ns(min(start_ts)) FROM current_steps, w WHERE run_id = $run AND step >= first
             GROUP BY first"""
_DEVICES = """SELECT rank, epoch_ns(ts) AS ts, metric, value FROM device_samples
              WHERE run_id = $run AND list_contains($metrics, metric) AND ts >= make_timestamp_ns($since)"""
_SIMULATED = """SELECT coalesce(bool_and(source = $simulated), false) FROM device_samples
                WHERE run_id = $run AND list_contains($metrics, metric)"""
_HAS_POWER = """SELECT count(*) > 0 FROM (SELECT 1 FROM device_samples
                                         WHERE run_id = $run AND list_contains($metrics, metric) LIMIT 1)"""
_CONSTRAINTS = """SELECT median(value) FILTER (metric = $low), median(value) FILTER (metric = $high)
                  FROM device_samples WHERE run_id = $run AND metric IN ($low, $high)"""


# Power recommendations move slowly and cost more to draw (a bootstrap over the ranks): the collector redraws
# them over a run's newest LIVE_STEPS steps, by the LIVE_POLICY; a post-mortem draws the run's last the same way.
LIVE_STEPS = 100
LIVE_POLICY = power.Policy("max-slowdown", 0.02)


def live_report(con: duckdb.DuckDBPyConnection, run_id: str) -> power.PowerReport | None:
    """The power report the collector draws of a run as it goes (over its newest LIVE_STEPS steps, by the
    LIVE_POLICY); None where its GPUs report no power."""
    if con.execute(_HAS_POWER, {"run": run_id, "metrics": list(power.POWER_METRICS)}).fetchall()[0][0]:
        return recommend(con, run_id, LIVE_POLICY, last_steps=LIVE_STEPS)
    return None


def recommend(
    con: duckdb.DuckDBPyConnection,
    run_id: str,
    policy: power.Policy,
    facility_w: float | None = None,
    last_steps: int | None = None,
) -> power.PowerReport:
    """The power report of a run in the store, over its newest `last_steps` steps (None: all of them);
    UnknownRun for a run without steps."""
    window = None if last_steps is None else con.execute(_WINDOW, {"run": run_id, "steps": last_steps}).fetchone()
    first, since = window or (0, 0)
    steps = con.execute(_STEPS, {"run": run_id, "limit": sc.POWER_LIMIT_W, "first": first}).df()
    if steps.empty:
        raise unknown_run(con, run_id)
    devices = con.execute(
        _DEVICES,
        {"run": run_id, "since": since, "metrics": [*power.POWER_METRICS, sc.GPU_UTIL_PCT, sc.CLOCK_EVENT_REASONS]},
    ).df()
    ranks = con.execute("SELECT rank, host FROM ranks WHERE run_id = ?", [run_id]).df()
    low, high = con.execute(
        _CONSTRAINTS, {"run": run_id, "low": sc.POWER_LIMIT_MIN_W, "high": sc.POWER_LIMIT_MAX_W}
    ).fetchall()[0]
    model = GpuModel()
    if low is not None and high is not None:
        model = replace(model, limit_min_w=low, limit_max_w=high, max_w=high)
    simulated = con.execute(
        _SIMULATED, {"run": run_id, "simulated": sc.SOURCE_SIMULATED, "metrics": list(power.POWER_METRICS)}
    ).fetchall()[0][0]
    return power.analyze(steps, devices, ranks, policy, facility_w, model, simulated=simulated)


def document(report: power.PowerReport) -> dict:
    """The report as `rankwatch power recommend --json` prints it (docs/telemetry.md)."""
    body = asdict(report)
    body.pop("run_id")
    return {
        "run": report.run_id,
        **body,
        "rank_caps": {str(r): w for r, w in (report.per_rank.caps.items() if report.per_rank else ())},
    }
