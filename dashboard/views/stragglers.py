"""Stragglers: who is slow, in what pattern, in which phase (input wait or compute), what it costs; the
rank x step heatmap of own time against the step median (the MegaScale view); one step of the suspects
laid out in time. A rank filter (`?ranks=3-7,9`) and the timeline's step (`?step=`) can be set by a link:
a finding's evidence links here with its ranks and first step. A one-process run has no peers: the page
says so once and lays its steps out in time."""

import pandas as pd
import streamlit as st

from collector import quantities, ranksets
from dashboard import charts, evidence, ui


def headline(top: pd.Series) -> None:
    """The suspects of the firing (or held to the end) finding, the phase they lose time in, what it costs."""
    until = " until the run's end" if top["state"] == "ended" else ""
    st.markdown(f"### Suspects{until}: {ranksets.phrase(top['ranks'])}, pattern *{top['kind']}*")
    measured = top["evidence"] or {}
    if measured.get("phase") in evidence.PHASES and measured.get("phase_excess_s") is not None:
        lose = "lose" if len(top["ranks"]) > 1 else "loses"
        their = "their" if len(top["ranks"]) > 1 else "its"
        st.markdown(
            f"{ui.capitalized(ranksets.phrase(top['ranks']))} {lose} the time in "
            f"**{evidence.PHASES[measured['phase']]}**: {quantities.duration(measured['phase_excess_s'])} per step "
            f"more than {their} peers."
        )
    if cost := ui.finding_cost(top):
        st.markdown(cost)


def timeline(chosen: list[int], of_chosen: str) -> None:
    """One step laid out in time: the slowest ranks of `chosen` (all where empty) and typical ones."""
    st.subheader("One step, laid out in time")
    steps = ui.frame("step_range", run=run)
    if steps.empty or steps["last"].isna().any():
        st.caption("No steps.")
        return
    first, last = int(steps["first"].iloc[0]), int(steps["last"].iloc[0])
    if first < last:
        written = ui.linked("timeline_step", "step", last, lambda text: min(max(int(text), first), last))
        step = st.number_input("Step", first, last, key="timeline_step", on_change=written)
    else:
        step = first
    spans = ui.frame("timeline", run=run, step=int(step), slowest=8, typical=4, ranks=chosen)
    st.altair_chart(charts.timeline(spans), width="stretch")
    st.caption(
        f"The 8 slowest ranks{of_chosen} of the step and 4 typical ones: data, compute, then communication "
        "(exposed wait, or the collectives as the agent timed them)."
    )


run = ui.current_run()
st.title("Stragglers")
if ui.one_process(run):
    st.info(ui.ONE_PROCESS)
    timeline([], "")
    st.stop()
findings = ui.frame("findings", run=run)
suspects = findings[findings["analyzer"] == "stragglers"]
unjudged = suspects[suspects["kind"] == "not_judged"]  # the analyzer could not judge, and says why
suspects = suspects[suspects["kind"] != "not_judged"]
firing = suspects[suspects["state"].isin(["firing", "ended"])]  # slow now, or until the run ended
if not firing.empty:
    headline(firing.iloc[0])
elif not unjudged.empty:
    st.markdown(f"### Not judged: {ui.literal(unjudged.iloc[-1]['summary'].removeprefix('not judged: '))}")
else:
    st.markdown("### No straggler now")
if not unjudged.empty and suspects.empty:
    st.info(ui.literal(unjudged.iloc[-1]["summary"]))
else:
    ui.show_findings(suspects, "The straggler analyzer has found no slow rank in this run.")

typed = st.text_input(
    "Ranks",
    key="rank_filter",
    on_change=ui.linked("rank_filter", "ranks", "", str),
    placeholder="all; or 3, 3-7, 3,9",
    help="The ranks the table, heatmap and timeline below show: a rank, a range, or both separated by commas.",
)
try:
    chosen = ranksets.parse(typed)
except ValueError as e:
    st.error(f"Ranks: {ui.literal(e)}. Showing every rank.")
    chosen = []
of_chosen = f" of {ranksets.phrase(chosen)}" if chosen else ""

first, last = ui.step_window(run)
over = " over the run" if (first, last) == ui.EVERY_STEP else " in the chosen steps"
slowest = ui.frame("slowest_ranks", run=run, limit=10, ranks=chosen, first=first, last=last)
st.subheader("Slowest ranks" + over + of_chosen)
st.dataframe(ui.in_ms(slowest), hide_index=True, width="stretch", column_config=ui.RANK_COLUMNS)

st.subheader("Own time against the step median, rank x step" + of_chosen)
cells = ui.frame(
    "heatmap", run=run, rank_bins=ui.RANK_BINS, step_bins=ui.STEP_BINS, ranks=chosen, first=first, last=last
)
if cells.empty:
    st.caption(f"No steps{of_chosen}.")
else:
    st.altair_chart(charts.heatmap(cells), width="stretch")
    st.caption(
        "A rank-step's own time is its input wait and compute. Each cell shows its worst rank-step (hover for "
        "which), so a single slow rank stays visible when ranks and steps are binned."
    )

timeline(chosen, of_chosen)
