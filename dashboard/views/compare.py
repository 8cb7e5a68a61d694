"""Compare runs: the chosen run and another overlaid, step by step (step time, loss, tokens/s)
and over time from their first sample (power): did a change make the job faster, learn
differently, or draw less?"""

import pandas as pd
import streamlit as st

from dashboard import charts, ui

run = ui.current_run()
st.title("Compare runs")
others = [r for r in ui.frame("runs")["run_id"] if r != run]
if not others:
    st.info("One run in the store: nothing to compare it with yet.")
    st.stop()
other = st.selectbox(f"Compare {run} with", others, key="compare_with")


def both(name: str, **params) -> pd.DataFrame:
    """A named query of each run, stacked, with a `run` column."""
    return pd.concat([ui.frame(name, run=r, **params).assign(run=r) for r in (run, other)], ignore_index=True)


series = both("step_series", points=ui.POINTS)
for value, title in (("step_s", "step time, s (median rank)"), ("loss", "loss"), ("tokens_per_s", "tokens/s")):
    st.subheader(title.split(",")[0].capitalize())
    if series[value].notna().any():
        st.altair_chart(charts.compare(series, "step", value, title, "step"), width="stretch")
    else:
        st.caption(f"Neither run reports {title.split(',')[0]}.")
power = both("power_series", points=ui.POINTS)
st.subheader("Power")
if power.empty:
    st.caption("Neither run has power samples.")
else:
    st.altair_chart(
        charts.compare(
            power.assign(kw=power["watts"] / 1000),
            "elapsed_s",
            "kw",
            "power, kW (all GPUs)",
            "seconds since the run's first sample",
        ),
        width="stretch",
    )
st.caption("Drag to zoom along the x axis, double-click to zoom out.")
