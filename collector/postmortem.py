"""A whole run, after the fact (`rankwatch analyze`): what-if analysis and findings.

The what-if analysis (analyzers/whatif.py) says how much faster the run would
have been without its stragglers and who explains the difference. The live
pass (collector/analysis.py) judges the newest steps every few seconds; here
the same pure analyzers walk the run's history window by window, so a
straggler that came and went is reported with the steps it lasted, and a run
that ended stalled is reported as a hang. Consecutive windows with the same
conclusion (analyzer, kind, ranks) are one finding. A run imported from
Flight Recorder dumps has no steps, so no what-if analysis: its findings are
those of the collective matching (analyzers/collectives.py).
"""

import json
from dataclasses import dataclass, replace

import duckdb
import numpy as np
import pandas as pd

from collector.analyzers import Finding, anomalies, hangs, links, stragglers, whatif
from collector.analyzers.collectives import analyze as match_collectives
from collector.imports.flight_recorder import EVENT as DUMP_EVENT
from collector.runs import unknown_run

_STEPS = """SELECT run_id, rank, step, epoch_ns(end_ts) AS end_ts, duration_s, data_s, compute_s, comm_wait_s, loss,
                   grad_norm, coalesce(NOT isfinite(loss), false) OR coalesce(NOT isfinite(grad_norm), false)
                   AS non_finite
            FROM current_steps WHERE run_id = ? ORDER BY step, rank"""
_COLLECTIVES = """SELECT run_id, rank, step, name, comm_group, group_size, duration_s, busbw_gbps FROM ops
                  WHERE run_id = ? AND kind = 'comm' AND busbw_gbps IS NOT NULL"""
_DEVICES = """SELECT rank, metric, value FROM device_samples
              WHERE run_id = ? AND ts BETWEEN make_timestamp_ns(?) AND make_timestamp_ns(?)"""
_HEARTBEATS = """SELECT rank, epoch_ns(ts) AS ts, step, attrs->>'$."rankwatch.phase"' AS phase,
                        attrs->>'$."rankwatch.comm.op"' AS op, attrs->>'$."rankwatch.comm.group"' AS "group",
                        TRY_CAST(attrs->>'$."rankwatch.comm.seq"' AS BIGINT) AS seq,
                        TRY_CAST(attrs->>'$."rankwatch.comm.done"' AS BOOLEAN) AS done
                 FROM events WHERE run_id = ? AND event = 'heartbeat'"""
_RECORDED = """SELECT rank, comm_group AS "group", seq, name AS op, attrs->>'$.state' AS state,
                      attrs->'$.input_sizes' AS input_sizes, attrs->'$.output_sizes' AS output_sizes,
                      attrs->'$.input_dtypes' AS input_dtypes, attrs->'$.output_dtypes' AS output_dtypes
               FROM ops WHERE run_id = ? AND kind = 'comm' AND attrs->>'$.is_p2p' = 'false' AND seq IS NOT NULL
               ORDER BY rank, TRY_CAST(attrs->>'$.record_id' AS BIGINT), start_ts"""
_DUMPS = "SELECT rank, attrs->'$.pg_config' AS pg_config FROM events WHERE run_id = ? AND event = ?"


@dataclass
class Report:
    """What `rankwatch analyze` says of a run."""

    run_id: str
    whatif: whatif.WhatIf | None  # None for a run without steps (Flight Recorder dumps)
    findings: list[Finding]
    steps: pd.DataFrame  # the rank-steps it was drawn from


def analyze_run(con: duckdb.DuckDBPyConnection, run_id: str,
                straggler_settings: stragglers.Settings = stragglers.Settings(),
                hang_settings: hangs.Settings = hangs.Settings()) -> Report:
    """The what-if analysis of the run and every finding of its history, in step order; for a run
    without steps, the findings from its Flight Recorder dumps alone."""
    steps = con.execute(_STEPS, [run_id]).df()
    ranks = con.execute("SELECT rank, host, dp_rank, pp_stage FROM ranks WHERE run_id = ?", [run_id]).df()
    if steps.empty:
        recorded = con.execute(_RECORDED, [run_id]).df()
        if not recorded.empty:
            return Report(run_id, None, match_collectives(run_id, recorded, _process_groups(con, run_id),
                                                          ranks["rank"]), steps)
        raise unknown_run(con, run_id)
    parts = con.execute(whatif.PARTS_SQL, [run_id]).df()
    return Report(run_id, whatif.analyze(steps, ranks, parts), _findings(con, run_id, steps, ranks, straggler_settings,
                                                                   hang_settings), steps)


def _window_ends(steps: pd.Series, first: int, last: int, window: int, stride: int):
    """Every `stride` steps from the first full window to the last step, skipping windows that hold
    no step: a run whose steps jump by 2**40 costs no 2**40 passes."""
    have = np.unique(steps.to_numpy())
    end = first + window - 1
    while end < last + stride:
        upcoming = int(have[np.searchsorted(have, end - window, side="right")])  # the window's first step
        if upcoming > end:
            end += -(-(upcoming - end) // stride) * stride
        yield min(end, last)
        end += stride


def _findings(con: duckdb.DuckDBPyConnection, run_id: str, steps: pd.DataFrame, ranks: pd.DataFrame,
              straggler_settings: stragglers.Settings, hang_settings: hangs.Settings) -> list[Finding]:
    """Every finding of the run's history, in step order."""
    collectives = con.execute(_COLLECTIVES, [run_id]).df()
    window = straggler_settings.window
    first, last = int(steps["step"].min()), int(steps["step"].max())
    found: list[Finding] = []
    stride = max(window // 2, 1)  # windows overlap by half: an episode's ends are placed to within half a window
    for end in _window_ends(steps["step"], first, last, window, stride):
        history = steps[(steps["step"] > end - 4 * window) & (steps["step"] <= end)]  # as the live pass reads
        judged = stragglers.analyze(history, ranks, straggler_settings)
        if judged:  # only then are the device samples of those steps worth reading
            span = history[history["step"] > end - window]["end_ts"]
            devices = con.execute(_DEVICES, [run_id, int(span.min()), int(span.max())]).df()
            judged = stragglers.analyze(history, ranks, straggler_settings, devices)
        found += judged
        found += links.analyze(collectives[(collectives["step"] > end - window) & (collectives["step"] <= end)],
                               float(history["duration_s"].median()))
    found += anomalies.analyze(steps)
    heartbeats = con.execute(_HEARTBEATS, [run_id]).df()
    # the run as it was last heard from: a stall that long is a hang
    heard = max(int(steps["end_ts"].max()), int(heartbeats["ts"].max()) if not heartbeats.empty else 0)
    found += hangs.analyze(steps, heartbeats, heard, hang_settings)
    return _merged(found, window)


def _process_groups(con: duckdb.DuckDBPyConnection, run_id: str) -> pd.DataFrame:
    """rank, group, desc, members: the process groups each rank's Flight Recorder dump lists."""
    dumps = con.execute(_DUMPS, [run_id, DUMP_EVENT]).fetchall()
    return pd.DataFrame([(rank, name, pg["desc"], pg["ranks"]) for rank, config in dumps
                         for name, pg in json.loads(config).items()], columns=["rank", "group", "desc", "members"])


def _merged(found: list[Finding], window: int) -> list[Finding]:
    """Findings with the same conclusion in windows next to each other as one, over the steps
    they span; the strongest window's summary and evidence speak for it."""
    merged: list[Finding] = []
    latest: dict[tuple, int] = {}  # (analyzer, kind, ranks) -> index in merged of its latest episode
    for f in found:
        key = (f.analyzer, f.kind, tuple(f.ranks))
        last = merged[latest[key]] if key in latest else None
        if last and f.step_start <= last.step_end + window:
            strongest = f if f.score > last.score else last
            merged[latest[key]] = replace(strongest, step_start=min(last.step_start, f.step_start),
                                          step_end=max(last.step_end, f.step_end))
        else:
            latest[key] = len(merged)
            merged.append(f)
    return merged
