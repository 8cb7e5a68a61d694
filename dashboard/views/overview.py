"""Overview: is the chosen run healthy? The verdict first, then step time, throughput, MFU and
power now, what fires and what the job was told to do."""

import pandas as pd
import streamlit as st

from collector.analysis.analyzers.gaps import Gaps
from collector.analysis.losses import Loss
from dashboard import charts, ui

RECENT = 10  # steps the "now" figures average over, against the RECENT before them

run = ui.current_run()
st.title(f"Run {run}")


def _mean(frame: pd.DataFrame, column: str) -> float | None:
    value = frame[column].mean()
    return None if pd.isna(value) else float(value)


@st.fragment(run_every=ui.live_every())
def live() -> None:
    findings = ui.frame("findings", run=run)
    unjudged = findings[findings["kind"] == "not_judged"]  # what an analyzer could not judge, and why
    firing = findings[(findings["state"] == "firing") & (findings["kind"] != "not_judged")]
    advice = firing[firing["severity"] == "info"]  # recommendations (power caps), not trouble
    firing = firing[firing["severity"] != "info"]
    recent = ui.frame("recent_steps", run=run, window=2 * RECENT + 1)
    complete = recent[recent["ranks"] == recent["ranks"].max()]  # the newest step may still be arriving
    now, before = complete.tail(RECENT), complete.iloc[:-RECENT].tail(RECENT)
    hangs = firing[firing["analyzer"] == "hangs"]
    shown: tuple[int, ...] = ()  # findings the verdict already says, not repeated below it
    if not hangs.empty:
        st.error(f"**Hung.** {hangs.iloc[0]['summary']}")
        shown = (int(hangs.iloc[0]["id"]),)
    elif not firing.empty:
        kinds = ", ".join(sorted(set(firing["analyzer"] + " / " + firing["kind"])))
        st.warning(f"**{len(firing)} finding{'s' * (len(firing) > 1)} firing** ({kinds}), below.")
    elif not unjudged.empty:
        st.info("**No finding, but not every analyzer could judge.** " + " ".join(unjudged["summary"].unique()))
    else:
        st.success("**Healthy.** No analyzer finds anything wrong with this run.")
    _telemetry_loss()
    if complete.empty:
        st.info("No complete step yet.")
        return
    step_s, earlier = _mean(now, "step_s"), _mean(before, "step_s")
    tokens, mfu = _mean(now, "tokens_per_s"), _mean(now, "mfu")
    not_live = ui.not_live_because(run)
    power = ui.power_figure(run, live=not_live is None)
    cols = st.columns(5)
    cols[0].metric(
        "Last step",
        f"{int(complete['step'].iloc[-1])}",
        help=f"of {int(complete['ranks'].iloc[-1])} ranks, ended {complete['end_ts'].iloc[-1]:%Y-%m-%d %H:%M:%S} UTC",
    )
    cols[1].metric(
        "Step time",
        f"{step_s:.3f} s",
        f"{100 * (step_s / earlier - 1):+.1f}%" if step_s is not None and earlier else None,
        delta_color="inverse",
        help=f"median rank, mean of the last {RECENT} steps",
    )
    cols[2].metric("Tokens/s", "—" if tokens is None else f"{tokens:,.0f}")
    cols[3].metric(
        "MFU" + ui.SIMULATED * power.simulated,
        "—" if mfu is None else f"{100 * mfu:.1f}%",
        help="step times played out at a simulated GPU's clocks" if power.simulated else None,
    )
    cols[4].metric(power.label, power.value, help=power.help)
    if len(firing) > len(shown):
        ui.show_findings(firing, "No finding fires.", shown)
    if not advice.empty and not_live is None:
        st.info("**Power recommendations** (the Power page has their evidence): " + " · ".join(advice["summary"]))
    elif not advice.empty:
        st.caption(f"No power recommendation: {not_live}, so no cap would reach the job.")


def _telemetry_loss() -> None:
    """Telemetry that never arrived, said next to the verdict: it was drawn without it."""
    recorded = ui.frame("telemetry_loss", run=run)
    if recorded.empty:
        return
    row = recorded.iloc[0]
    loss = Loss(Gaps(*(row[c] for c in row.index[:6])), *(int(row[c]) for c in row.index[6:]))
    if loss.any:
        said = loss.summary()
        st.warning(
            f"**{said[0].upper()}{said[1:]}.** What this page and the analyzers conclude is drawn on partial "
            "data; the heatmap's blank cells are these rank-steps."
        )


live()
st.subheader("Step time over the run")
series = ui.frame("step_series", run=run, points=ui.POINTS)
axis = st.radio("x axis", ["step", "wall clock"], horizontal=True, key="overview_axis", label_visibility="collapsed")
st.altair_chart(charts.step_times(series, wall_clock=axis == "wall clock"), width="stretch")
st.caption("Drag to zoom in on a stretch of the run, double-click to zoom out. The Compare page overlays two runs.")

commands = ui.frame("commands", run=run)
st.subheader("Commands sent to the job")
if commands.empty:
    st.caption("None: no rollback or other command for this run.")
else:
    st.dataframe(commands, hide_index=True, width="stretch")
resolved = ui.frame("findings", run=run).query("state != 'firing'")
with st.expander(f"{len(resolved)} resolved finding{'s' * (len(resolved) != 1)}"):
    ui.show_findings(resolved, "None.")
