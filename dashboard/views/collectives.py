"""Collectives: bus bandwidth per collective and size (as nccl-tests counts it, three significant
digits: a gloo job's 0.02 GB/s is not 0.0), the process groups that fall behind their peers, and how
much communication each rank waits for. A one-process run has none: the page says so once."""

import streamlit as st

from dashboard import charts, ui, units

run = ui.current_run()
st.title("Collectives")
if ui.one_process(run):
    st.info(ui.ONE_PROCESS)
    st.stop()
first, last = ui.step_window(run)
findings = ui.frame("findings", run=run)
ui.show_findings(
    findings[findings["analyzer"] == "links"], "No slow link: every process group moves at its peers' pace."
)

table = ui.frame("busbw", run=run)
st.subheader("Bus bandwidth by collective and size")
if table.empty:
    st.caption(
        "No collectives with a size: a job's agent times them with `agent.watch_ddp` or "
        "`agent.watch_collectives`; an imported profiler trace has them where its NCCL kernels carry their "
        "message sizes (`In msg nelems`, recorded by recent PyTorch profilers)."
    )
else:
    st.altair_chart(charts.busbw(table), width="stretch")
    with st.expander("the numbers"):
        st.dataframe(table, hide_index=True, width="stretch")
    groups = ui.frame("slowest_groups", run=run, limit=8)
    st.subheader("Slowest process groups")
    st.dataframe(
        groups.assign(busbw_gbps=groups["busbw_gbps"].map(lambda gbps: units.figure("busbw_gbps", gbps))),
        hide_index=True,
        width="stretch",
        column_config={
            "of_median": st.column_config.NumberColumn("of the op's median", format="%.2f"),
            "busbw_gbps": st.column_config.TextColumn("mean busbw"),
        },
    )

exposed = ui.frame("exposed_comm", run=run, rank_bins=ui.RANK_BINS, first=first, last=last)
st.subheader("Exposed communication per rank")
if exposed.empty:
    st.caption("No step reports its exposed communication wait.")
else:
    st.altair_chart(charts.by_rank(exposed, "comm_wait_s", "exposed comm wait, s (mean)"), width="stretch")
    st.caption(
        "Time a rank's step waited on communication not hidden behind compute. A straggler waits least: "
        "its peers wait for it."
    )
