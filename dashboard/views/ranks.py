"""Ranks & nodes: every rank where it runs (host, stage, replica, TP rank, device) and how it does
against its peers, and the same per node: a slow node is its ranks slow together. Filtered by
host (a link may set it: `?host=`), stage, replica and TP rank; the slowest node's ranks open on
the Stragglers page."""

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

nodes = (
    shown.assign(host=shown["host"].fillna("(host not reported)"))
    .groupby("host", sort=False)
    .agg(
        members=("rank", sorted),
        worst_ratio=("compute_ratio", "max"),
        compute_ratio=("compute_ratio", "median"),
        step_s=("step_s", "median"),
        comm_wait_s=("comm_wait_s", "median"),
        watts=("watts", lambda w: w.sum(min_count=1)),  # none where no GPU of the node sent power
        last_step=("last_step", "min"),
    )
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
    nodes.drop(columns="members"),
    hide_index=True,
    width="stretch",
    column_config={
        **ui.RANK_COLUMNS,
        "worst_ratio": st.column_config.NumberColumn("worst rank / median", format="%.3f"),
        "compute_ratio": st.column_config.NumberColumn("median rank / median", format="%.3f"),
        "watts": st.column_config.NumberColumn("power, W (all GPUs)", format="%.0f"),
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
    shown.drop(columns=[c for c, _ in PLACEMENT if shown[c].isna().all()]),
    hide_index=True,
    width="stretch",
    column_config={
        **ui.RANK_COLUMNS,
        **{c: st.column_config.NumberColumn(what, format="%d") for c, what in PLACEMENT},
        "local_rank": st.column_config.NumberColumn("local rank", format="%d"),
        "last_step": st.column_config.NumberColumn("newest step", format="%d"),
    },
)
