"""Where each run stands, in words: drawn from a row of the runs query (dashboard/queries.py RUNS) the same
way for the dashboard and for `rankwatch runs`, without Streamlit."""

from dataclasses import dataclass

import pandas as pd

from collector.quantities import clock

# No step or event for this long and a run that has not ended is silent: its agents send a heartbeat every 5 s,
# and the hang analyzer's shortest stall is as long
SILENT_S = 30.0


@dataclass(frozen=True)
class RunStatus:
    """Where a run stands: `state` running | failed | ended | hung | silent | imported | stored; `words` say it with
    since when (a failure: at which step, and how); `as_of`: when its figures were last current, for a run that is
    not running (they are stale)."""

    state: str
    words: str
    as_of: pd.Timestamp | None
    duration: str


def run_status(row: pd.Series, live: bool, at: pd.Timestamp) -> RunStatus:
    """A run's status at `at` from its row of the runs query: imported for a trace recorded elsewhere (it
    ends where the trace does), failed while a rank's failure holds (no restart went past it; its ranks may
    have said their loop ended as they went), ended once every rank said its loop ended (and no step came after),
    hung while a hang finding fires (silent too, once nothing comes: a hung job's silence is no
    recovery), silent once nothing came for SILENT_S, else running where a collector writes the store
    (`live`), or, read from a store no collector writes, stored (nobody can say it still runs). Its
    duration runs from its first step or event to its newest."""
    heard, ended_at = row["last_heard"], row["ended_at"]
    silent = pd.notna(heard) and (at - heard).total_seconds() > SILENT_S
    ended = (
        row["ended_ranks"] > 0
        and row["ended_ranks"] >= row["ranks"]
        and (pd.isna(row["last_step_end"]) or row["last_step_end"] <= ended_at)
    )
    duration = _duration(heard - row["first_heard"]) if pd.notna(heard) else "—"
    if row["imported"]:
        return RunStatus("imported", f"imported trace, recorded until {clock(heard)}", heard, duration)
    if pd.notna(row["failed_as"]):
        step = f" at step {int(row['failed_step'])}" if pd.notna(row["failed_step"]) else ""
        return RunStatus("failed", f"failed{step}: {row['failed_as']}", heard, duration)
    if ended:
        return RunStatus("ended", f"ended {clock(ended_at)}", ended_at, duration)
    if row["hung"]:
        return RunStatus("hung", "hung" + (f", silent since {clock(heard)}" if silent else ""), heard, duration)
    if silent:
        return RunStatus("silent", f"silent since {clock(heard)}", heard, duration)
    if not live:  # a store no collector writes tells of no "now"
        heard_at = f"last heard {clock(heard)}" if pd.notna(heard) else "never heard from"
        return RunStatus("stored", f"{heard_at}, in a store no collector writes", heard, duration)
    return RunStatus("running", "running", None, duration)


def failed(row: pd.Series, status: RunStatus) -> bool:
    """Whether the run ended in failure: it ended with findings still firing. When a run ends the collector
    ends every finding but those that say how it ended (the job stopping itself rather than roll back once
    more, collector/analysis/analyzers/rollbacks.py), so a finding firing after the end is one of those."""
    return status.state == "ended" and row["firing"] > 0


def _duration(span: pd.Timedelta) -> str:
    """A run's length as a person says it: to the hundredth of a second for a short trace, to the
    minute for a long run."""
    exact = max(span.total_seconds(), 0.0)
    if exact < 60:
        return f"{exact:.2f} s" if exact < 10 else f"{exact:.0f} s"
    hours, rest = divmod(int(exact), 3600)
    return f"{hours} h {rest // 60:02d} min" if hours else f"{rest // 60} min {rest % 60:02d} s"


def listing(runs: pd.DataFrame, live: bool, at: pd.Timestamp) -> pd.DataFrame:
    """`rankwatch runs`: a line per run of the runs query, newest first: its ranks, last step, when it was first
    and last heard from, its status in words (failed where it ended so) and the summary of its worst finding ever."""
    words = []
    for _, row in runs.iterrows():
        status = run_status(row, live, at)
        words.append(f"failed: {status.words}" if failed(row, status) else status.words)
    table = pd.DataFrame(
        {
            "run": runs["run_id"],
            "ranks": runs["ranks"].astype("Int64"),
            "last step": runs["last_step"].astype("Int64"),
            "first seen": runs["first_heard"].map(_when),
            "last seen": runs["last_heard"].map(_when),
            "status": words,
            "worst finding": runs["worst"],
        }
    ).astype(object)
    return table.where(table.notna(), None)  # what is missing as None: empty in a table, null in JSON


def _when(at: pd.Timestamp) -> str | None:
    return None if pd.isna(at) else clock(at)
