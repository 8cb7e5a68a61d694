"""Hangs: the collective a stalled job is blocked in and the ranks it waits for, from the hang
analyzer's findings, where every rank's training thread is (the stacks its ranks gave when the hang
fired) and what their Flight Recorders say, and where every rank was when last heard from."""

import pandas as pd
import streamlit as st

from collector import ranksets
from dashboard import evidence as told
from dashboard import ui
from dashboard.markdown import literal_table

run = ui.current_run()
st.title("Hangs")
runs = ui.frame("runs")
status = ui.run_status(runs[runs["run_id"] == run].iloc[0])
st.markdown(f"Run status: **{status.words}**")
findings = ui.frame("findings", run=run)
hangs = findings[findings["analyzer"] == "hangs"]
# a hang stays firing while its job is silent (no recovery); one that held to the run's end is how it ended
firing = hangs[hangs["state"].isin(["firing", "ended"])]
if firing.empty:
    if not hangs.empty:
        st.success("Not hung now; earlier stalls below.")
    elif status.state == "running":
        st.success("Not hung: steps keep finishing.")
    elif status.state == "imported":
        st.success(f"No stall in this trace ({status.words}).")
    else:
        st.success(f"Never hung while it sent telemetry; the run is {status.words}.")
else:
    hang = firing.iloc[0]
    evidence = hang["evidence"] or {}
    collective = evidence.get("collective") or {}
    culprits = ranksets.phrase(hang["ranks"])
    head = {"imported": "Hung when the trace was taken", "ended": "Hung at the run's end"}.get(
        status.state if status.state == "imported" else hang["state"], "Hung"
    )
    if pd.notna(hang["step_start"]):
        head += f" in step {int(hang['step_start'])}"
    if "stalled_s" in evidence:  # a live job's stall; a dump knows no clock of the job's
        head += f" for {evidence['stalled_s']:.0f} s"
    silent_since = evidence.get("silent_since_ns")
    quiet = f" Every rank silent since {ui.clock(pd.Timestamp(silent_since, tz='UTC'))}." if silent_since else ""
    st.error(f"**{head}.** Culprits: **{culprits}**.{quiet}")
    if collective:
        waiting = collective.get("waiting_ranks", [])
        st.markdown(
            f"{len(waiting)} ranks ({ranksets.compact(waiting)}) are blocked in **{ui.literal(collective['op'])} "
            f"#{ui.literal(collective['seq'])}** of group **{ui.literal(collective['group'])}**, which {culprits} "
            "never entered."
        )
    silent = evidence.get("silent_ranks") or []
    if silent:
        st.markdown(f"Silent (no heartbeat): {ranksets.phrase(silent)}.")
    st.subheader("Where every rank's training thread is")
    places, unanswered = told.stacks(evidence["stacks"] if isinstance(evidence.get("stacks"), dict) else {})
    if not places.empty:
        st.table(literal_table(places.set_index("ranks")))
        st.caption(
            "The ranks' answers to the newest request for every rank's stacks (the collector makes one when the hang "
            "fires), grouped by the innermost calls of their main thread (library frames folded into the call the "
            "training code made)." + (f" Ranks that did not answer: {ui.literal(unanswered)}." if unanswered else "")
        )
    else:
        st.caption(
            "No rank has answered a stacks request since the stall began (the collector asks when a hang fires; "
            "`rankwatch stacks RUN` asks again)."
        )
    if isinstance(recorders := evidence.get("flight_recorder"), dict):
        st.subheader("What the ranks' Flight Recorders say")
        verdicts, said = told.recorders(recorders)
        if not verdicts.empty:
            st.table(literal_table(verdicts.set_index("culprits")))
        st.caption(
            f"From the torch Flight Recorder entries in the ranks' answers ({ui.literal(said)}): in each process "
            "group, the collective some member never entered or entered otherwise, and the sends and receives a "
            "peer never matched, with their sequence numbers."
        )
    ui.show_evidence(hang)
ui.show_findings(
    hangs,
    "The hang analyzer has never seen this run stall.",
    shown=() if firing.empty else (int(firing.iloc[0]["id"]),),
)


def grouped(ranks: pd.DataFrame, columns: dict, caption: str) -> None:
    """Ranks grouped by where they stand, each group's ranks as ranges."""
    st.dataframe(
        ranks.assign(which=ranks["which"].map(ranksets.compact)),
        hide_index=True,
        width="stretch",
        column_config={"which": st.column_config.TextColumn("which ranks"), **columns},
    )
    st.caption(caption)


st.subheader("Where each rank was when last heard from")
beats = ui.frame("last_heartbeats", run=run)
progress = ui.frame("collective_progress", run=run) if beats.empty else beats
if not beats.empty:
    grouped(
        beats.assign(phase=beats["phase"].fillna("—")),  # between phases, or a job that names none
        {"done": st.column_config.CheckboxColumn("collective done")},
        "Ranks grouped by their last heartbeat: the step and phase they were in and the last collective "
        "they entered. A hung job shows most ranks inside one collective and its culprits elsewhere.",
    )
elif not progress.empty:  # a Flight Recorder dump: each group's collectives, rank by rank
    grouped(
        progress,
        {
            "op": st.column_config.TextColumn("last collective entered"),
            "seq": st.column_config.NumberColumn("its #"),
            "completed": st.column_config.NumberColumn("last # completed"),
        },
        "From the ranks' collective records (Flight Recorder dumps): in each process group, the ranks grouped by "
        "the newest collective they entered and its state. A blocked group shows most members inside one "
        "collective and its culprits at an earlier one.",
    )
else:
    st.caption("No heartbeats from this run, and no collective records.")
