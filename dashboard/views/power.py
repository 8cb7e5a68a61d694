"""Power & GPUs: the power analyzer's recommendation first, with the exact command that applies
it (for a live run: one that ended or hangs gets none, and says why); then power now (or the last,
and when), the GPUs whose clocks were held back and why, GPU errors, and per-rank power, clocks,
temperature, utilization, memory and links, in units that fit their size."""

import shlex

import pandas as pd
import streamlit as st

from collector import quantities, ranksets
from dashboard import charts, ui, units
from rankwatch.agent import semconv as sc

run = ui.current_run()
st.title("Power")
metrics = ui.frame("device_metrics", run=run)
gpus = ui.gpu_samples(run)
if not gpus.sent:  # no GPU figure at all, rather than 0 W
    st.info(
        "No GPU samples for this run: its agent sends them where NVML has a GPU for the rank (or, asked with "
        "`--simulate-gpu`, from a simulated one), and `rankwatch simulate` from its simulated GPUs."
    )
    if not metrics.empty:
        with st.expander("the host metrics this run sent"):
            st.dataframe(metrics, hide_index=True, width="stretch")
    st.stop()

findings = ui.frame("findings", run=run)
advice = findings[(findings["analyzer"] == "power") & (findings["state"] == "firing")]
job_cap, per_rank = (advice[advice["kind"] == kind] for kind in ("job_cap", "per_rank_caps"))
not_live = ui.not_live_because(run)
if not advice.empty and not_live is not None:
    st.info(f"**No power cap to apply:** {not_live}. What the power analyzer last found, for a re-run:")
    for _, row in advice.iterrows():
        ui.show_finding(row)
elif not job_cap.empty:
    finding = job_cap.iloc[0]
    evidence = finding["evidence"]
    st.success(
        f"**Recommendation: cap every GPU at {quantities.power(evidence['cap_w'])}.** "
        f"{quantities.percent(evidence['energy_saving'])} less energy per step for "
        f"{quantities.percent(evidence['slowdown'] - 1, signed=True)} step time ({evidence['policy']}, "
        f"{'measured' if evidence['source'] == 'measured' else 'predicted by the power model'})."
    )
    st.code(f"rankwatch power apply {shlex.quote(run)} --watts {evidence['cap_w']:.0f}", language="bash")
    st.caption(f"The power analyzer: {ui.literal(finding['summary'])}.")
    ui.show_evidence(finding)
if not per_rank.empty and not_live is None:
    finding = per_rank.iloc[0]
    st.success(
        f"**{'Or c' if not job_cap.empty else 'C'}ap {ranksets.phrase(finding['ranks'])}**: "
        f"{ui.literal(finding['summary'])}."
    )
    st.code(
        f"rankwatch power recommend {shlex.quote(run)} --json > caps.json\n"
        f"rankwatch power apply {shlex.quote(run)} --caps caps.json",
        language="bash",
    )
    st.caption("`power recommend` judges the whole run; the analyzer above its newest 100 steps.")
    ui.show_evidence(finding)
if advice.empty:
    st.caption(
        "No power-cap recommendation (yet): the collector's power analyzer draws one every `--power-every` "
        "seconds once steps report their energy; `rankwatch power recommend` judges a stopped run."
    )
if gpus.simulated:
    st.info(
        "**Simulated GPUs.** These samples come from rankwatch's GPU model (`rankwatch simulate`, or a rank "
        "without an NVML GPU), not from hardware: right for trying the analysis, not for sizing a facility.",
        icon=":material/science:",
    )

energy, power = ui.frame("energy_per_step", run=run), ui.power_figure(run, live=not_live is None)
joules = energy["joules"].iloc[0]
cols = st.columns(3)
cols[0].metric(power.label, power.value, help=power.help)
cols[1].metric(
    "Energy per step" + ui.SIMULATED * gpus.simulated,
    "—" if pd.isna(joules) else quantities.energy(joules),
    help="the median step's, as the agent measured it"
    if energy["measured"].iloc[0]
    else "estimated: every rank's mean power times the median step time",
)
cols[2].metric("Ranks sampled", f"{int(metrics['ranks'].max())}")
if power.as_of is not None and not_live is not None:
    st.caption(f"Last power as of {power.as_of:%Y-%m-%d %H:%M:%S} UTC: {not_live}.")
st.caption(
    "How many more such nodes a facility's power holds: `rankwatch power recommend` with `--facility-watts W` "
    "(the nodes' p99 draw against the budget, after POLCA)."
)
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
for metric, (heading, unit) in units.DEVICE_METRICS.items():
    bins = by_rank[by_rank["metric"] == metric]
    if bins.empty:
        continue
    if isinstance(unit, quantities.Scale):
        divisor, unit = unit.prefix(bins[["mean", "low", "high"]].abs().max().max())
        bins = bins.assign(**{c: bins[c] / divisor for c in ("mean", "low", "high")})
    st.subheader(heading + ui.SIMULATED * gpus.simulated)
    st.altair_chart(charts.by_rank(bins, "mean", f"{heading}, {unit}", ("low", "high")), width="stretch")
if by_rank[by_rank["metric"].isin([sc.POWER_W, sc.POWER_INSTANT_W])].empty:
    st.caption("No power samples (clocks and temperatures only).")
with st.expander("device metrics of this run"):
    st.dataframe(metrics, hide_index=True, width="stretch")
