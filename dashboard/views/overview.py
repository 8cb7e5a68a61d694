"""Overview: the chosen run's story, live or finished. Its status (running, failed at step N, ended, hung,
silent since ...), then the verdict: the worst finding in words (a rank's failure first; its ranks, phase,
since when, what it costs) and what to do, then step time, throughput, MFU and power (as of when, for a
run that is not running; said to be simulated where the GPUs are, absent where there are none), the step
time over the run, the other findings that fire, what went wrong before (worst first, with onsets, costs
and how each ended), the rollbacks and how they went, lost telemetry, and the run list. A one-process run
says once that cross-rank analyses do not apply."""

import pandas as pd
import streamlit as st

from collector.findings import NOT_JUDGED
from collector.telemetryloss import Loss
from dashboard import charts, evidence, ui

RECENT = 10  # steps the "now" figures average over, against the RECENT before them
LEADS = {"failures": "Failed.", "hangs": "Hung."}  # the verdict's first findings, in this order, and its bold words

run = ui.current_run()
st.title(f"Run {ui.literal(run)}")
one_process = ui.one_process(run)


def _mean(frame: pd.DataFrame, column: str) -> float | None:
    value = frame[column].mean()
    return None if pd.isna(value) else float(value)


def _findings() -> pd.DataFrame:
    """The run's findings; a one-process run's without what the cross-rank analyses could not judge (no
    peers), which ONE_PROCESS says once."""
    findings = ui.frame("findings", run=run)
    return findings[findings["kind"] != NOT_JUDGED] if one_process else findings


def _problems(findings: pd.DataFrame) -> pd.DataFrame:
    """What went wrong: findings but recommendations (severity info) and what could not be judged."""
    return findings[(findings["severity"] != "info") & (findings["kind"] != NOT_JUDGED)]


def _firing(findings: pd.DataFrame) -> pd.DataFrame:
    """What is wrong now, the verdict's first (a rank's failure, which ended the job and explains the rest; else a
    hang; else the worst): firing findings but recommendations and what could not be judged."""
    firing = ui.worst_first(_problems(findings[findings["state"] == "firing"]))
    first = firing["analyzer"].map({analyzer: i for i, analyzer in enumerate(LEADS)}).fillna(len(LEADS))
    return firing.iloc[first.argsort(kind="stable")]


def _in_words(row: pd.Series, lead: str = "") -> str:
    """A finding as a person reads it first: its summary as a sentence (its ranks, the phase they lose
    time in, since when, what it costs, as the analyzer wrote them), then what to do; no analyzer's
    name, kind or finding id. `lead`: bold words before the sentence; without, the sentence is bold."""
    sentence = f"{ui.literal(ui.capitalized(row['summary']))}."
    said = f"**{lead}** {sentence}" if lead else f"**{sentence}**"
    todo = evidence.next_step(row)
    return said + (f"\n\n**What to do:** {todo}" if todo else "")


def _more(count: int, where: str) -> str:
    return f"\n\n{count} more finding{'s' * (count > 1)} {where}." if count else ""


@st.fragment(run_every=ui.live_every())
def live() -> None:
    runs = ui.frame("runs")
    status = ui.run_status(runs[runs["run_id"] == run].iloc[0])
    st.markdown(f"**{ui.capitalized(status.words)}** · {status.duration} long")
    if one_process:
        st.caption(ui.ONE_PROCESS)
    findings = _findings()
    unjudged = findings[findings["kind"] == NOT_JUDGED]  # what an analyzer could not judge, and why
    advice = findings[(findings["state"] == "firing") & (findings["severity"] == "info")]
    advice = advice[(advice["kind"] != NOT_JUDGED) & (advice["analyzer"] != "predicted")]  # power caps
    firing = _firing(findings)
    past = ui.worst_first(_problems(findings[findings["state"] != "firing"]))
    recent = ui.frame("recent_steps", run=run, window=2 * RECENT + 1)
    complete = recent[recent["ranks"] == recent["ranks"].max()]  # the newest step may still be arriving
    now, before = complete.tail(RECENT), complete.iloc[:-RECENT].tail(RECENT)
    if not firing.empty:  # a failure, a hang or the worst, in words; its evidence a click away, the others below
        worst = firing.iloc[0]
        hung = worst["analyzer"] == "hangs"
        alert = st.error if worst["severity"] == "critical" else st.warning
        alert(_in_words(worst, LEADS.get(worst["analyzer"], "")) + _more(len(firing) - 1, "fire (Also firing, below)"))
        if not hung:  # a hang's evidence is the Hangs page
            ui.show_evidence(worst, label="its evidence")
    elif not past.empty:  # a finding true while the run ran is part of its story, never "healthy"
        worst = past.iloc[0]
        if status.state == "running":
            said = _in_words(worst, f"Nothing fires now. Earlier ({ui.outcome(worst)}):")
            st.info(said + _more(len(past) - 1, "before (What went wrong, below)"))
        else:
            said = _in_words(worst, f"What went wrong ({ui.outcome(worst)}):")
            st.warning(said + _more(len(past) - 1, "(What went wrong, below)"))
    elif not unjudged.empty:
        reasons = " ".join(map(ui.literal, unjudged["summary"].unique()))
        st.info(f"**No finding, but not every analyzer could judge.** {reasons}")
    else:
        st.success("**Healthy.** No analyzer finds anything wrong with this run.")
    _telemetry_loss()
    if complete.empty:
        st.info(
            "This trace records no training steps (a Flight Recorder dump holds collectives alone): the Hangs page "
            "shows where each rank stands in them."
            if status.state == "imported"
            else "No complete step yet."
        )
        return
    last = ui.clock(now["end_ts"].iloc[-1])
    if status.state == "imported":
        st.caption(f"An imported trace: the figures are its last steps', up to {last}.")
    elif status.as_of is not None:  # figures of a run that is not running are its last ones, not now's
        st.caption(f"Stale ({status.words}): the figures are as of its last step, {last}.")
    step_s, earlier = _mean(now, "step_s"), _mean(before, "step_s")
    tokens, mfu = _mean(now, "tokens_per_s"), _mean(now, "mfu")
    not_live = ui.not_live_because(run)
    gpus = ui.gpu_samples(run)
    power = ui.power_figure(run, live=not_live is None)
    cols = st.columns(5 if power.as_of is not None else 4)  # no power figure where no GPU sent power
    cols[0].metric(
        "Last step",
        f"{int(complete['step'].iloc[-1])}",
        help=f"of {int(complete['ranks'].iloc[-1])} ranks, ended {complete['end_ts'].iloc[-1]:%Y-%m-%d %H:%M:%S} UTC",
    )
    change = 100 * (step_s / earlier - 1) if step_s is not None and earlier else None
    cols[1].metric(
        "Step time",
        f"{step_s:.3f} s",
        f"{change:+.1f}%" if change is not None and abs(change) >= 0.05 else None,  # no arrow for "+0.0%"
        delta_color="inverse",
        help=f"median rank, mean of the last {RECENT} steps",
    )
    cols[2].metric("Tokens/s", "—" if tokens is None else f"{tokens:,.0f}")
    cols[3].metric(
        "MFU" + ui.SIMULATED * gpus.simulated,
        "—" if mfu is None else f"{100 * mfu:.1f}%",
        help="step times played out at a simulated GPU's clocks" if gpus.simulated else None,
    )
    if power.as_of is not None:
        cols[4].metric(power.label, power.value, help=power.help)
    if not advice.empty and not_live is None:
        said = " · ".join(map(ui.literal, advice["summary"]))
        st.info(f"**Power recommendations** (the Power page has their evidence): {said}")
    elif not advice.empty:
        st.caption(f"No power recommendation: {not_live}, so no cap would reach the job.")


@st.fragment(run_every=ui.live_every())
def firing_now() -> None:
    """The findings that fire besides the verdict's (the worst, said first: not repeated), and the step-time
    model's view of the run, where the collector has a model."""
    findings = _findings()
    firing = _firing(findings)
    if len(firing) > 1:
        st.subheader("Also firing")
        ui.show_findings(firing, "No finding fires.", shown=(int(firing.iloc[0]["id"]),))
    prediction = findings[
        (findings["state"] == "firing") & (findings["severity"] == "info") & (findings["analyzer"] == "predicted")
    ]
    if not prediction.empty:  # measured against predicted, over time and per rank (its evidence's charts)
        st.caption("Compute time against what the devices' and hosts' state predicts (the collector's --model):")
        ui.show_findings(prediction, "")


def _telemetry_loss() -> None:
    """Telemetry that never arrived, said next to the verdict: it was drawn without it."""
    recorded = ui.frame("telemetry_loss", run=run)
    if recorded.empty:
        return
    loss = Loss.stored(recorded.iloc[0])
    if loss.any:
        said = loss.summary()
        st.warning(
            f"**{ui.capitalized(said)}.** What this page and the analyzers conclude is drawn on partial "
            "data; the heatmap's blank cells are these rank-steps."
        )


live()
first, last = ui.step_window(run)
st.subheader("Step time over the run" if (first, last) == ui.EVERY_STEP else "Step time in the chosen steps")
series = ui.frame("step_series", run=run, points=ui.POINTS, first=first, last=last)
axis = st.radio("x axis", ["step", "wall clock"], horizontal=True, key="overview_axis", label_visibility="collapsed")
st.altair_chart(charts.step_times(series, wall_clock=axis == "wall clock"), width="stretch")
st.caption("Drag to zoom in on a stretch of the run, double-click to zoom out. The Compare page overlays two runs.")
firing_now()

findings = _findings()
earlier = findings[findings["state"] != "firing"]
past = ui.worst_first(_problems(earlier))
commands = ui.frame("commands", run=run)
rollbacks = commands[commands["kind"] == "rollback"]
if not past.empty or not rollbacks.empty:
    st.subheader("What went wrong")
    for _, row in past.iterrows():
        steps = "" if pd.isna(row["step_start"]) else f" Steps {int(row['step_start'])}–{int(row['step_end'])}."
        st.markdown(
            f"- **{row['analyzer']} / {row['kind']}** ({row['severity']}, {ui.outcome(row)}): "
            f"{ui.literal(row['summary'])}.{steps}"
        )  # its cost, where measured, is in its summary: said once
    for _, command in rollbacks.iterrows():
        result = command["result"] or {}
        said = {
            "applied": f"applied at step {command['apply_step']}: the job went back to step "
            f"{ui.literal(result.get('restored_step'))}",
            "failed": f"failed: {ui.literal(result.get('why', 'no reason given'))}",
        }.get(command["state"], command["state"])
        st.markdown(f"- **Rollback {command['id']}** (for finding {command['finding_id']}) {said}.")
    with st.expander("their evidence"):
        ui.show_findings(past, "None.")
st.subheader("Commands sent to the job")
if commands.empty:
    st.caption("None: no rollback or other command for this run.")
else:
    st.dataframe(commands, hide_index=True, width="stretch")
notes = earlier[~earlier["id"].isin(past["id"])]  # recommendations that no longer stand, what was not judged
if len(notes):  # (none: no empty box to open)
    with st.expander(f"{len(notes)} earlier recommendation{'s' * (len(notes) != 1)} and note{'s' * (len(notes) != 1)}"):
        ui.show_findings(notes, "None.")
with st.expander("All runs"):
    st.dataframe(ui.runs_table(ui.frame("runs")), hide_index=True, width="stretch")
