"""A whole run, after the fact (`rankwatch analyze`): what-if analysis and findings.

The what-if analysis (analyzers/whatif.py) says how much faster the run would
have been without its stragglers and who explains the difference. The
findings are the live collector's: the same engine (collector/analysis/engine.py)
walks the run's history from its first step to its last, each step judged
once by every analyzer with the history it needs, and the episodes it draws
(a straggler that came and went, with the steps it lasted; a stall, whether
the run moved on or ended in it) are the findings. A run imported from
Flight Recorder dumps has no steps, so no what-if analysis: its findings are
those of the collective and point-to-point matching (analyzers/collectives.py,
analyzers/p2p.py). What the replay cannot draw is read from the store: an
anomaly a rollback abandoned the steps of (the live collector saw them; the
run's trajectory no longer holds them), with what its rollback did, and the
power recommendations the collector draws over the run's newest steps.
Telemetry lost on the way
(collector/analysis/losses.py) is measured over the whole run: conclusions drawn where rank-steps
are missing are drawn on partial data, and the report says so.
"""

import json
from collections import defaultdict
from dataclasses import asdict, dataclass, replace

import duckdb
import pandas as pd

from collector.analysis import findings, losses
from collector.analysis.analyzers import Finding, failures, hangs, predicted, stragglers, whatif
from collector.analysis.engine import replay
from collector.analysis.recorded import match as match_recorded
from collector.predict import steptime
from collector.predict.stepmodel import Fitted
from collector.receive.imports.flight_recorder import EVENT as DUMP_EVENT
from collector.reports import powercaps
from collector.store import schema
from collector.store.runs import unknown_run

_STEPS = """SELECT run_id, rank, step, epoch_ns(end_ts) AS end_ts, duration_s, data_s, compute_s, comm_wait_s, loss,
                   grad_norm FROM current_steps WHERE run_id = ? ORDER BY step, rank"""
_RECORDED = """SELECT rank, comm_group AS "group", seq, name AS op, attrs->>'$.state' AS state,
                      attrs->'$.input_sizes' AS input_sizes, attrs->'$.output_sizes' AS output_sizes,
                      attrs->'$.input_dtypes' AS input_dtypes, attrs->'$.output_dtypes' AS output_dtypes,
                      (attrs->>'$.is_p2p') = 'true' AS is_p2p, TRY_CAST(attrs->>'$.peer' AS INTEGER) AS peer,
                      TRY_CAST(attrs->>'$.record_id' AS BIGINT) AS record_id
               FROM ops WHERE run_id = ? AND kind = 'comm' AND seq IS NOT NULL
               ORDER BY rank, record_id, start_ts"""
# The findings rollbacks were sent for, and what each rollback did: their steps are abandoned, so no replay
# of the run's trajectory draws them again.
_ROLLED_BACK = """SELECT f.analyzer, f.kind, f.ranks, f.step_start, f.step_end, f.severity, f.score, f.summary,
                         f.evidence, c.state, c.result
                  FROM commands c JOIN findings f ON f.id = c.finding_id
                  WHERE c.run_id = ? AND c.kind = 'rollback' ORDER BY c.id"""
# The live collector's record of an episode: the finding of the same analyzer, kind and ranks over steps that
# overlap the given ones (the earliest, where an episode was recorded twice).
_EPISODE = """SELECT step_start, step_end, summary FROM findings
              WHERE run_id = ? AND analyzer = ? AND kind = ? AND ranks = ?::INTEGER[]
                AND step_start <= ? AND step_end >= ?
              ORDER BY step_start LIMIT 1"""
_DUMPS = "SELECT rank, attrs->'$.pg_config' AS pg_config FROM events WHERE run_id = ? AND event = ?"
SEVERITIES = ("critical", "warning", "info")  # worst first, as the dashboard's Overview lists findings
WHATIF = "whatif"  # the analyzer an imported run's what-if finding is recorded under
WHATIF_WARNS = 1.05  # a what-if slowdown from which its finding is a warning: 5% of the run lost


@dataclass
class Report:
    """What `rankwatch analyze` says of a run."""

    run_id: str
    whatif: whatif.WhatIf | None  # None for a run without steps (Flight Recorder dumps)
    findings: list[Finding]
    steps: pd.DataFrame  # the rank-steps it was drawn from
    loss: losses.Loss | None = None  # the telemetry that never arrived (None: a run without steps)
    prediction: "Prediction | None" = None  # with a step-time model: each rank's measured and predicted compute


@dataclass
class Prediction:
    """The step-time model's view of a run: what it is worth, and each rank's median compute time,
    measured and predicted (`ranks`: rank, measured_s, predicted_s)."""

    verdict: str
    trusted: bool
    ranks: pd.DataFrame

    def as_dict(self) -> dict:
        return {"verdict": self.verdict, "trusted": self.trusted, "ranks": self.ranks.to_dict("records")}


def analyze_run(
    con: duckdb.DuckDBPyConnection,
    run_id: str,
    straggler_settings: stragglers.Settings = stragglers.Settings(),
    hang_settings: hangs.Settings = hangs.Settings(),
    model: Fitted | None = None,
) -> Report:
    """The what-if analysis of the run and every finding of its history, in step order; for a run
    without steps, the findings from its Flight Recorder dumps alone. With a step-time `model`, the
    straggler findings say how much of their slowdown the ranks' state explains, and a slowdown of the
    whole job against its predicted step time is a finding too."""
    steps = con.execute(_STEPS, [run_id]).df()
    ranks = con.execute("SELECT rank, host, dp_rank, pp_stage FROM ranks WHERE run_id = ?", [run_id]).df()
    if steps.empty:  # Flight Recorder dumps: their collectives matched, and their sends with their receives
        recorded = con.execute(_RECORDED, [run_id]).df()
        if recorded.empty and not con.execute("SELECT count(*) FROM ops WHERE run_id = ?", [run_id]).fetchall()[0][0]:
            raise unknown_run(con, run_id)
        return Report(
            run_id, None, match_recorded(run_id, recorded, _process_groups(con, run_id), ranks["rank"]), steps
        )
    settings = {stragglers.ANALYZER: straggler_settings, hangs.ANALYZER: hang_settings}
    if model is not None:
        settings[predicted.ANALYZER] = predicted.Settings(model=model)
    found = [_as_recorded(con, f) for f in replay(con, run_id, settings)]
    found += _rolled_back(con, run_id, found)
    if (power := powercaps.live_report(con, run_id)) is not None:
        found += power.findings
    # worst first, as the dashboard's Overview lists them: a rank's failure (it ended the job), then by severity
    found.sort(
        key=lambda f: (
            f.analyzer != failures.ANALYZER,
            SEVERITIES.index(f.severity),
            f.step_start is None,
            f.step_start or 0,
        )
    )
    parts = con.execute(whatif.PARTS_SQL, [run_id]).df()
    prediction = None if model is None else _prediction(con, run_id, model)
    return Report(run_id, whatif.analyze(steps, ranks, parts), found, steps, losses.measure(con, run_id), prediction)


def _as_recorded(con: duckdb.DuckDBPyConnection, finding: Finding) -> Finding:
    """`finding` as the live collector recorded the same episode (its analyzer, kind and ranks, over steps it
    overlaps), where it did: the onset the dashboard, the alert and the demo told, not a second estimate
    drawn from passes cut elsewhere; else as the replay drew it."""
    if finding.step_start is None:
        return finding
    row = con.execute(
        _EPISODE, [finding.run_id, finding.analyzer, finding.kind, finding.ranks, finding.step_end, finding.step_start]
    ).fetchone()
    if row is None:
        return finding
    start, end, summary = row
    return replace(finding, step_start=start, step_end=max(end, finding.step_end), summary=summary)


def _rolled_back(con: duckdb.DuckDBPyConnection, run_id: str, drawn: list[Finding]) -> list[Finding]:
    """The findings rollbacks were sent for that the replay did not draw again (their steps abandoned), each
    with what its rollback did."""
    again = {(f.analyzer, f.kind, f.step_start) for f in drawn}
    found = []
    for *row, state, result in con.execute(_ROLLED_BACK, [run_id]).fetchall():
        analyzer, kind, ranks, start, end, severity, score, summary, evidence = row
        if (analyzer, kind, start) in again:
            continue
        done = json.loads(result) if result else {}
        restored = done.get("restored_step")
        summary += (
            f"; rolled back: every rank restored step {restored} and skipped {done.get('skipped_batches', 0)} batches"
            if state == "applied" and restored is not None
            else f"; its rollback was {state}"
        )
        evidence = {**json.loads(evidence or "{}"), "rollback": {"state": state, **done}}
        found.append(Finding(run_id, kind, ranks, start, end, severity, score, summary, evidence, analyzer=analyzer))
    return found


def _prediction(con: duckdb.DuckDBPyConnection, run_id: str, model: Fitted) -> Prediction:
    """The model's view of each rank of the run: its median compute time, measured and predicted."""
    steps, features = steptime.read(con, run_id)
    ranks = (
        pd.DataFrame({"rank": steps["rank"], "measured_s": steps["compute_s"]})
        .assign(predicted_s=predicted.predict(model, features))
        .groupby("rank", as_index=False)
        .median()
    )
    return Prediction(model.verdict, model.trusted, ranks)


def record(con: duckdb.DuckDBPyConnection, report: Report) -> None:
    """Keep an imported run's report as its findings, each ended with the trace (state `ended`,
    "trace ended"), the what-if's among them (analyzer WHATIF; a warning from WHATIF_WARNS): the
    dashboard, the alerts and `/metrics` read a run's story from `findings`, and no collector drew
    an imported run's as it went."""
    drawn: dict[str, list[Finding]] = defaultdict(list)
    for finding in report.findings:
        drawn[finding.analyzer].append(finding)
    if report.whatif is not None:
        drawn[WHATIF].append(_whatif_finding(report.run_id, report.whatif))
    for analyzer, of_analyzer in drawn.items():
        findings.record(con, report.run_id, analyzer, of_analyzer)
    findings.end_run(con, report.run_id, schema.TRACE_ENDED, state=schema.ENDED)


def _whatif_finding(run_id: str, w: whatif.WhatIf) -> Finding:
    return Finding(
        run_id,
        w.pattern,
        w.culprits,
        None,
        None,
        "warning" if w.slowdown >= WHATIF_WARNS else "info",
        w.slowdown,
        whatif.summary(w),
        asdict(w),
        analyzer=WHATIF,
    )


def _process_groups(con: duckdb.DuckDBPyConnection, run_id: str) -> pd.DataFrame:
    """rank, group, desc, members: the process groups each rank's Flight Recorder dump lists."""
    dumps = con.execute(_DUMPS, [run_id, DUMP_EVENT]).fetchall()
    return pd.DataFrame(
        [(rank, name, pg["desc"], pg["ranks"]) for rank, config in dumps for name, pg in json.loads(config).items()],
        columns=["rank", "group", "desc", "members"],
    )
