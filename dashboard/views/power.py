"""Power & GPUs: the power analyzer's recommendation first, with the exact command that applies
it; then the facility headroom, power now against its p99, the GPUs whose clocks were held back
and why, GPU errors, and per-rank power, clocks, temperature, utilization, memory and links."""

import pandas as pd
import streamlit as st

from agent import semconv as sc
from collector import ranksets
from dashboard import charts, ui

run = ui.current_run()
st.title("Power")
metrics = ui.frame("device_metrics", run=run)
if metrics.empty:
    st.info(
        "No device samples for this run: its agent sends them where NVML is available (GPUs), and "
        "`rankwatch simulate` sends clocks and temperatures."
    )
    st.stop()

findings = ui.frame("findings", run=run)
advice = findings[(findings["analyzer"] == "power") & (findings["state"] == "firing")]
job_cap, per_rank, headroom = (advice[advice["kind"] == kind] for kind in ("job_cap", "per_rank_caps", "headroom"))
if not job_cap.empty:
    finding = job_cap.iloc[0]
    evidence = finding["evidence"]
    st.success(
        f"**Recommendation: cap every GPU at {evidence['cap_w']:.0f} W.** "
        f"{100 * evidence['energy_saving']:.1f}% less energy per step for "
        f"{100 * (evidence['slowdown'] - 1):+.1f}% step time ({evidence['policy']}, "
        f"{'measured' if evidence['source'] == 'measured' else 'predicted by the power model'})."
    )
    st.code(f"rankwatch power apply {run} --watts {evidence['cap_w']:.0f}", language="bash")
    st.caption(f"The power analyzer: {finding['summary']}.")
    ui.show_evidence(finding)
if not per_rank.empty:
    finding = per_rank.iloc[0]
    st.success(
        f"**{'Or c' if not job_cap.empty else 'C'}ap {ranksets.phrase(finding['ranks'])}**: {finding['summary']}."
    )
    st.code(
        f"rankwatch power recommend {run} --json > caps.json\nrankwatch power apply {run} --caps caps.json",
        language="bash",
    )
    st.caption("`power recommend` judges the whole run; the analyzer above its newest 100 steps.")
    ui.show_evidence(finding)
if job_cap.empty and per_rank.empty:
    st.caption(
        "No power-cap recommendation (yet): the collector's power analyzer draws one every `--power-every` "
        "seconds once steps report their energy; `rankwatch power recommend` judges a stopped run."
    )
if metrics["sources"].str.contains(sc.SOURCE_SIMULATED).any():
    st.info(
        "**Simulated GPUs.** These samples come from rankwatch's GPU model (`rankwatch simulate`, or a rank "
        "without an NVML GPU), not from hardware: right for trying the analysis, not for sizing a facility.",
        icon=":material/science:",
    )

energy, power = ui.frame("energy_per_step", run=run), ui.frame("power_now", run=run)
watts, joules = power["watts"].iloc[0], energy["joules"].iloc[0]
cols = st.columns(3)
cols[0].metric(
    "Power now",
    "—" if pd.isna(watts) else f"{watts / 1000:.2f} kW",
    help=f"{int(power['ranks'].iloc[0])} ranks, each one's mean over the newest minute, summed",
)
cols[1].metric(
    "Energy per step",
    "—" if pd.isna(joules) else f"{joules / 1000:.2f} kJ",
    help="the median step's, as the agent measured it"
    if energy["measured"].iloc[0]
    else "estimated: every rank's mean power times the median step time",
)
cols[2].metric("Ranks sampled", f"{int(metrics['ranks'].max())}")
if not headroom.empty:
    st.subheader("Facility headroom")
    st.markdown(headroom.iloc[0]["summary"] + ".")
    st.caption(
        "**p99 against now:** the p99 is the job's draw at its busiest moments over the analyzed steps (99 "
        "moments in 100 draw less), summed per node: a facility's budget has to hold at those moments. "
        "*Power now* is a minute's average, which takes in data loading, collectives and other waits, so "
        "it sits below the p99."
    )
    ui.show_evidence(headroom.iloc[0])
if not job_cap.empty:
    evidence = job_cap.iloc[0]["evidence"]
    simulated = ", simulated GPUs" if evidence.get("simulated") else ""
    st.subheader(f"Time/energy trade-off, one limit for every GPU ({evidence['source']}{simulated})")
    st.altair_chart(charts.tradeoff(pd.DataFrame(evidence["curve"]), evidence["cap_w"]), width="stretch")

st.subheader("Clocks held back")
throttled = ui.frame("throttled", run=run, limit=50)
if throttled.empty:
    st.caption("No GPU's clocks were held back (NVML's clock-event reasons).")
else:
    throttled["reasons"] = throttled["reasons"].map(lambda bits: ", ".join(sc.clock_event_words(bits)))
    st.warning(f"**Clocks held back on {ranksets.phrase(throttled['rank'])}**: {throttled['reasons'].iloc[0]}.")
    with st.expander("throttled ranks"):
        st.dataframe(throttled, hide_index=True, width="stretch")

errors = ui.frame("gpu_errors", run=run, limit=50)
if not errors.empty:
    st.subheader("GPU errors")
    st.error(
        f"**GPU errors on {ranksets.phrase(errors['rank'])}**: ECC errors or XIDs during the run; a GPU "
        "with uncorrected errors or XID 48, 63, 64, 74, 79, 94 or 95 needs draining and a reset."
    )
    errors["xids"] = errors["xids"].map(lambda xids: ", ".join(map(str, xids)) if xids is not None else "")
    st.dataframe(
        errors,
        hide_index=True,
        width="stretch",
        column_config={
            "ecc_corrected": st.column_config.NumberColumn("ECC corrected", format="%d"),
            "ecc_uncorrected": st.column_config.NumberColumn("ECC uncorrected", format="%d"),
            "xids": st.column_config.TextColumn("XIDs"),
        },
    )

by_rank = ui.frame("device_by_rank", run=run, rank_bins=ui.RANK_BINS)
PANELS = (
    (sc.POWER_W, "Power", "W"),
    (sc.POWER_INSTANT_W, "Power (instantaneous)", "W"),
    (sc.SM_CLOCK_MHZ, "SM clock", "MHz"),
    (sc.GPU_TEMP_C, "GPU temperature", "°C"),
    (sc.GPU_UTIL_PCT, "GPU utilization", "%"),
    ("memory_used_pct", "GPU memory used", "% of the GPU's"),
    (sc.NVLINK_TX_BPS, "NVLink sent", "bytes/s"),
    (sc.PCIE_RX_BPS, "PCIe received", "bytes/s"),
)
for metric, heading, unit in PANELS:
    bins = by_rank[by_rank["metric"] == metric]
    if bins.empty:
        continue
    st.subheader(heading)
    st.altair_chart(charts.by_rank(bins, "mean", f"{heading}, {unit}", ("low", "high")), width="stretch")
if by_rank[by_rank["metric"].isin([sc.POWER_W, sc.POWER_INSTANT_W])].empty:
    st.caption("No power samples (clocks and temperatures only).")
with st.expander("device metrics of this run"):
    st.dataframe(metrics, hide_index=True, width="stretch")
