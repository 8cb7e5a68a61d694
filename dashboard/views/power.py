"""Power: per-rank power, energy per step, clocks and temperature, and the ranks whose clocks
were held back and why (NVML clock-event reasons), from the device samples."""

import pandas as pd
import streamlit as st

from agent import semconv as sc
from dashboard import charts, ui

run = ui.current_run()
st.title("Power")
metrics = ui.frame("device_metrics", run=run)
if metrics.empty:
    st.info("No device samples for this run: its agent sends them where NVML is available (GPUs), and "
            "`rankwatch simulate` sends clocks and temperatures.")
    st.stop()

throttled = ui.frame("throttled", run=run, limit=50)
if throttled.empty:
    st.success("No rank's clocks were held back.")
else:
    throttled["reasons"] = throttled["reasons"].map(
        lambda bits: ", ".join(name for bit, name in sc.CLOCK_EVENT_REASON_BITS.items() if int(bits) & bit))
    st.warning(f"**Clocks held back on ranks {ui.ranks_text(throttled['rank'])}**: "
               f"{throttled['reasons'].iloc[0]}.")
    with st.expander("throttled ranks"):
        st.dataframe(throttled, hide_index=True, width="stretch")

findings = ui.frame("findings", run=run)
advice = findings[(findings["analyzer"] == "power") & (findings["state"] == "firing")]
for _, finding in advice.iterrows():  # the power analyzer's recommendations
    ui.show_finding(finding)
job_cap = advice[advice["kind"] == "job_cap"]
if not job_cap.empty:
    evidence = job_cap["evidence"].iloc[0]
    simulated = ", simulated GPUs" if evidence.get("simulated") else ""
    st.subheader(f"Time/energy trade-off, one limit for every GPU ({evidence['source']}{simulated})")
    st.altair_chart(charts.tradeoff(pd.DataFrame(evidence["curve"]), evidence["cap_w"]), width="stretch")

energy, power = ui.frame("energy_per_step", run=run), ui.frame("power_now", run=run)
cols = st.columns(3)
watts, joules = power["watts"].iloc[0], energy["joules"].iloc[0]
cols[0].metric("Power now", "—" if pd.isna(watts) else f"{watts / 1000:.2f} kW",
               help=f"{int(power['ranks'].iloc[0])} ranks, each one's mean over the newest minute")
cols[1].metric("Energy per step", "—" if pd.isna(joules) else f"{joules / 1000:.2f} kJ",
               help="the median step's, as the agent measured it" if energy["measured"].iloc[0] else
               "estimated: every rank's mean power times the median step time")
cols[2].metric("Ranks sampled", f"{int(metrics['ranks'].max())}")

by_rank = ui.frame("device_by_rank", run=run, rank_bins=ui.RANK_BINS)
for metric, heading, unit in ((sc.POWER_W, "Power", "W"), (sc.POWER_INSTANT_W, "Power (instantaneous)", "W"),
                              (sc.SM_CLOCK_MHZ, "SM clock", "MHz"), (sc.GPU_TEMP_C, "GPU temperature", "°C")):
    bins = by_rank[by_rank["metric"] == metric]
    if bins.empty:
        continue
    st.subheader(heading)
    st.altair_chart(charts.by_rank(bins, "mean", f"{heading}, {unit}", ("low", "high")), width="stretch")
if by_rank[by_rank["metric"].isin([sc.POWER_W, sc.POWER_INSTANT_W])].empty:
    st.caption("No power samples (clocks and temperatures only).")
with st.expander("device metrics of this run"):
    st.dataframe(metrics, hide_index=True, width="stretch")
