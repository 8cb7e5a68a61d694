"""Hangs: the collective a stalled job is blocked in and the ranks it waits for, from the hang
analyzer's findings, with where every rank was when last heard from."""

import streamlit as st

from collector import ranksets
from dashboard import ui

run = ui.current_run()
st.title("Hangs")
findings = ui.frame("findings", run=run)
hangs = findings[findings["analyzer"] == "hangs"]
firing = hangs[hangs["state"] == "firing"]
if firing.empty:
    st.success("Not hung: steps keep finishing." if hangs.empty else "Not hung now; earlier stalls below.")
else:
    hang = firing.iloc[0]
    evidence = hang["evidence"] or {}
    collective = evidence.get("collective") or {}
    culprits = ranksets.phrase(hang["ranks"])
    st.error(f"**Hung for {evidence.get('stalled_s', 0):.0f} s.** Culprits: **{culprits}**.")
    if collective:
        waiting = collective.get("waiting_ranks", [])
        st.markdown(
            f"{len(waiting)} ranks ({ranksets.compact(waiting)}) are blocked in **{collective['op']} "
            f"#{collective['seq']}** of group **{collective['group']}**, which {culprits} never entered."
        )
    silent = evidence.get("silent_ranks") or []
    if silent:
        st.markdown(f"Silent (no heartbeat): {ranksets.phrase(silent)}.")
    ui.show_evidence(hang)
ui.show_findings(
    hangs,
    "The hang analyzer has never seen this run stall.",
    shown=() if firing.empty else (int(firing.iloc[0]["id"]),),
)

st.subheader("Where each rank was when last heard from")
beats = ui.frame("last_heartbeats", run=run)
if beats.empty:
    st.caption("No heartbeats from this run.")
else:
    beats["first_ranks"] = beats["first_ranks"].map(ranksets.compact)
    st.dataframe(
        beats,
        hide_index=True,
        width="stretch",
        column_config={
            "first_ranks": st.column_config.TextColumn("ranks (first 16)"),
            "done": st.column_config.CheckboxColumn("collective done"),
        },
    )
    st.caption(
        "Ranks grouped by their last heartbeat: the step and phase they were in and the last collective "
        "they entered. A hung job shows most ranks inside one collective and its culprits elsewhere."
    )
