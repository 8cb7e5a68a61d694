"""The dashboard's entry point (`rankwatch dashboard` runs it with `streamlit run`): the
pages, and the run they all look at, chosen in the sidebar (or by `?run=ID` in a link; an
alert's link also names its finding, `&finding=ID`, shown first)."""

import streamlit as st

from collector.findings import COLLECTOR_RUN_ID
from collector.printable import printable
from dashboard import ui

st.set_page_config(page_title="rankwatch", page_icon=":material/monitoring:", layout="wide")
PAGES = [
    st.Page("views/overview.py", title="Overview", icon=":material/health_metrics:", default=True),
    st.Page("views/stragglers.py", title="Stragglers", icon=":material/directions_walk:"),
    st.Page("views/ranks.py", title="Ranks & nodes", icon=":material/dns:"),
    st.Page("views/collectives.py", title="Collectives", icon=":material/hub:"),
    st.Page("views/checkpoints.py", title="Checkpoints & rollbacks", icon=":material/history:"),
    st.Page("views/hangs.py", title="Hangs", icon=":material/hourglass_disabled:"),
    st.Page("views/tiers.py", title="Memory & I/O", icon=":material/swap_vert:"),
    st.Page("views/power.py", title="Power", icon=":material/bolt:"),
    st.Page("views/compare.py", title="Compare runs", icon=":material/compare_arrows:"),
    st.Page("views/sql.py", title="SQL", icon=":material/database:"),
]
page = st.navigation(PAGES)
runs = ui.frame("runs")
st.sidebar.caption(f"reading {ui.literal(ui.data_source().label)}")
collector_health = ui.frame("findings", run=COLLECTOR_RUN_ID)  # the collector's own findings belong to no run
for summary in collector_health.loc[collector_health["state"] == "firing", "summary"]:
    st.sidebar.warning(f"Collector: {ui.literal(summary)}")
if runs.empty and page.title != "SQL":
    st.info("No runs in the store yet. Point a job's agent, or `rankwatch simulate`, at the collector.")
    st.stop()
if not runs.empty:
    labels = {
        row["run_id"]: "  ·  ".join(
            [
                printable(row["run_id"]),
                ui.run_status(row).state,
                *([f"{row['firing']} firing"] if row["firing"] else []),
            ]
        )
        for _, row in runs.iterrows()
    }
    linked = st.query_params.get("run")
    if "run" not in st.session_state and linked in labels:  # a link to a run's page
        st.session_state["run"] = linked
    picked = st.sidebar.selectbox(
        "Run",
        list(labels),
        format_func=lambda run: labels[run],
        key="run",
        on_change=ui.picked_run,
    )
    if linked is not None and linked not in labels:  # never another run's pages under this one's link
        source = ui.literal(ui.data_source().label)
        st.error(f"Run **{ui.literal(linked)}** is unknown: {source} has no such run. Pick one in the sidebar.")
        st.stop()
    assert picked is not None  # one of the runs, which are there
    st.query_params["run"] = picked
    ui.show_linked_finding()
page.run()
