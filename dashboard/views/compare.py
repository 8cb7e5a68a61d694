"""Compare runs: the chosen run and up to MAX_OTHERS others overlaid, step by step (step time,
loss, tokens/s) and over time from their first sample (power, the runs whose GPUs are simulated
named): did a change make the job faster, learn differently, or draw less? Runs of different
lengths and sizes line up on normalised axes: steps as a share of each run, values relative to
the chosen run, power per GPU; steps as measured have whole-step ticks."""

import pandas as pd
import streamlit as st

from collector.printable import printable
from dashboard import charts, ui

MAX_OTHERS = 7  # runs beside the chosen one: more lines than a legend's colours tell apart
PER_STEP = (("step_s", "Step time", "s (median rank)"), ("loss", "Loss", ""), ("tokens_per_s", "Tokens/s", ""))

run = ui.current_run()
st.title("Compare runs")
others = [r for r in ui.frame("runs")["run_id"] if r != run]
if not others:
    st.info("One run in the store: nothing to compare it with yet.")
    st.stop()
chosen = st.multiselect(
    f"Compare {ui.literal(run)} with",
    others,
    default=others[:1],
    max_selections=MAX_OTHERS,
    format_func=printable,
    key="compare_with",
)
runs = [run, *chosen]
steps_as = st.radio("Steps", ["step", "share of the run"], horizontal=True, key="compare_steps")
values_as = st.radio("Values", ["as measured", f"relative to {ui.literal(run)}"], horizontal=True, key="compare_values")
relative = values_as != "as measured"


def stacked(name: str, **params) -> pd.DataFrame:
    """A named query of each run, stacked, with a `run` column."""
    return pd.concat([ui.frame(name, run=r, **params).assign(run=r) for r in runs], ignore_index=True)


def share(frame: pd.DataFrame, x: str) -> pd.Series:
    """`x` as a share of each run's own span, 0 at its first row, 1 at its last."""
    by_run = frame.groupby("run")[x]
    low, high = by_run.transform("min"), by_run.transform("max")
    return (frame[x] - low) / (high - low).where(high > low)


def against_base(frame: pd.DataFrame, value: str) -> pd.Series:
    """`value` over the chosen run's median of it: 1 is the same as the chosen run."""
    base = frame.loc[frame["run"] == run, value].median()
    return frame[value] / (base if pd.notna(base) and base != 0 else float("nan"))


series = stacked("step_series", points=ui.POINTS, first=ui.EVERY_STEP[0], last=ui.EVERY_STEP[1])  # whole runs
if steps_as != "step":
    series = series.assign(step=share(series, "step"))
x_title = "step" if steps_as == "step" else "share of the run's steps"
for value, title, unit in PER_STEP:
    st.subheader(title)
    if not series[value].notna().any():
        st.caption(f"None of these runs reports {title.lower()}.")
        continue
    shown = series.assign(**{value: against_base(series, value)}) if relative else series
    if relative and not shown[value].notna().any():
        st.caption(f"{ui.literal(run)} reports no {title.lower()} to compare the others with.")
        continue
    y_title = f"{title.lower()}, x {run}'s median" if relative else f"{title.lower()}{', ' + unit if unit else ''}"
    st.altair_chart(charts.compare(shown, "step", value, y_title, x_title, whole=steps_as == "step"), width="stretch")
    missing = sorted(set(runs) - set(series.loc[series[value].notna(), "run"]))
    if missing:
        st.caption(f"No {title.lower()} from {', '.join(map(ui.literal, missing))}.")

power = stacked("power_series", points=ui.POINTS)
st.subheader("Power")
if power.empty:
    st.caption("None of these runs has power samples.")
else:
    power = power.assign(w_per_gpu=power["watts"] / power["gpus"])
    if steps_as != "step":
        power = power.assign(elapsed_s=share(power, "elapsed_s"))
    shown = power.assign(w_per_gpu=against_base(power, "w_per_gpu")) if relative else power
    st.altair_chart(
        charts.compare(
            shown,
            "elapsed_s",
            "w_per_gpu",
            f"power per GPU, x {run}'s median" if relative else "power per GPU, W",
            "seconds since the run's first sample" if steps_as == "step" else "share of the run's time",
        ),
        width="stretch",
    )
    simulated = [r for r in power["run"].unique() if ui.gpu_samples(r).simulated]
    if simulated:
        st.caption(
            f"Simulated GPUs (rankwatch's GPU model), not measured hardware: {', '.join(map(ui.literal, simulated))}."
        )
st.caption("Drag to zoom along the x axis, double-click to zoom out.")
