"""Ranks & nodes: every rank where it runs (host, stage, replica, TP rank, device) and how it does
against its peers (its own time over the step median; its input wait, compute, exposed communication
and step time; its GPU's power, said to be simulated where it is, absent where no GPU sent any), and
the same per node: a slow node is its ranks slow together. Filtered by host (a link may set it:
`?host=`), stage, replica and TP rank; the slowest node's ranks open on the Stragglers page. A
one-process run is its one rank, with nothing to compare it with."""

import pandas as pd
import streamlit as st

from collector import ranksets
from dashboard import ui

PLACEMENT = (("pp_stage", "stage"), ("dp_rank", "replica"), ("tp_rank", "TP rank"))

run = ui.current_run()
st.title("Ranks & nodes")
first, last = ui.step_window(run)
ranks = ui.frame("rank_table", run=run, first=first, last=last)
if ranks.empty:
    st.info("No rank of this run has reported yet.")
    st.stop()
gpus = ui.gpu_samples(run)
if ranks["watts"].isna().all():  # no GPU sent power: no power column, rather than a column of blanks
    ranks = ranks.drop(columns="watts")
simulated = ui.SIMULATED * gpus.simulated
rank_columns = {**ui.RANK_COLUMNS, "watts": st.column_config.NumberColumn(f"power, W{simulated}", format="%.0f")}

if ui.one_process(run):  # where it runs and its phases, no peer or node to compare it with
    st.info(ui.ONE_PROCESS)
    unknown = {c for c in ranks.columns if ranks[c].isna().all()}
    st.dataframe(
        ui.in_ms(ranks.drop(columns=sorted(unknown | {"time_ratio"}))),
        hide_index=True,
        width="stretch",
        column_config=rank_columns,
    )
    st.stop()

host = st.text_input(
    "Host",
    key="host_filter",
    on_change=ui.linked("host_filter", "host", "", str),
    placeholder="any; or part of a host name",
)
shown = ranks[ranks["host"].fillna("").str.contains(host, regex=False)] if host else ranks
columns = st.columns(len(PLACEMENT))
for (column, what), box in zip(PLACEMENT, columns, strict=True):
    values = sorted(int(v) for v in ranks[column].dropna().unique())
    if len(values) > 1:
        picked = box.multiselect(ui.capitalized(what), values, key=f"{column}_filter", placeholder="any")
        if picked:
            shown = shown[shown[column].isin(picked)]
if shown.empty:
    st.warning("No rank matches these filters.")
    st.stop()

per_node = {
    "members": ("rank", sorted),
    "worst_ratio": ("time_ratio", "max"),
    "time_ratio": ("time_ratio", "median"),
    "data_s": ("data_s", "median"),
    "step_s": ("step_s", "median"),
    "comm_wait_s": ("comm_wait_s", "median"),
    **({"watts": ("watts", lambda w: w.sum(min_count=1))} if "watts" in shown else {}),  # its GPUs' together
    "last_step": ("last_step", "min"),
}
nodes = (
    shown.assign(host=shown["host"].fillna("(host not reported)"))
    .groupby("host", sort=False)
    .agg(**per_node)
    .sort_values("worst_ratio", ascending=False)
    .reset_index()
)
nodes.insert(1, "ranks", nodes["members"].map(ranksets.compact))
st.subheader(f"{len(nodes)} node{'s' * (len(nodes) != 1)}, slowest first")
st.caption(
    "A node's worst rank against the step median, and its ranks' medians; a node whose ranks are all slow "
    "is a slow node (cooling, power, a bad host), one slow rank among fast ones is that rank's GPU."
)
st.dataframe(
    ui.in_ms(nodes.drop(columns="members")),
    hide_index=True,
    width="stretch",
    column_config={
        **rank_columns,
        "worst_ratio": st.column_config.NumberColumn("worst rank / median", format="%.3f"),
        "time_ratio": st.column_config.NumberColumn("median rank / median", format="%.3f"),
        "watts": st.column_config.NumberColumn(f"power, W (all GPUs){simulated}", format="%.0f"),
        "last_step": st.column_config.NumberColumn("newest step of all its ranks", format="%d"),
    },
)
slowest = nodes.iloc[0]
if pd.notna(slowest["worst_ratio"]) and slowest["worst_ratio"] > 1:
    st.page_link(
        ui.STRAGGLERS_PAGE,
        label=f"See the heatmap rows of {ui.literal(slowest['host'])}'s ranks",
        icon=":material/grid_on:",
        query_params={"run": run, "ranks": ranksets.typed(slowest["members"])},
    )

st.subheader(f"{len(shown)} rank{'s' * (len(shown) != 1)}" + (f" of {len(ranks)}" if len(shown) < len(ranks) else ""))
st.dataframe(
    ui.in_ms(shown.drop(columns=[c for c, _ in PLACEMENT if shown[c].isna().all()])),
    hide_index=True,
    width="stretch",
    column_config={
        **rank_columns,
        **{c: st.column_config.NumberColumn(what, format="%d") for c, what in PLACEMENT},
        "local_rank": st.column_config.NumberColumn("local rank", format="%d"),
        "last_step": st.column_config.NumberColumn("newest step", format="%d"),
    },
)
