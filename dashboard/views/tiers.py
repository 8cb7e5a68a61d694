"""Memory & I/O: when steps wait on copies between GPU, host memory and disk. The tiers analyzer's
findings (swap-bound ranks and the tier that limits them, with the step predicted with the swaps
overlapped against back to back; slow disks; checkpoints that slowed the swaps), each direction's
bandwidth over the steps against the disk's probe, and the time each step waited on copies."""

import pandas as pd
import streamlit as st

from dashboard import charts, ui

run = ui.current_run()
st.title("Memory & I/O")
first, last = ui.step_window(run)
series = ui.frame("tier_series", run=run, points=ui.POINTS, first=first, last=last)
if series.empty:
    st.info(
        "No copies between memory tiers recorded for this run: a job that offloads (`rankwatch train --offload "
        "optimizer=disk`) or whose loop wraps its copies in `agent.transfer(...)` and its host optimizer in "
        "`agent.host_work(...)` shows here when its steps wait on them."
    )
    st.stop()
findings = ui.frame("findings", run=run)
tiers = findings[findings["analyzer"] == "tiers"]
bound = tiers[(tiers["kind"] == "swap_bound") & (tiers["state"] != "resolved")]  # firing, or held to the end
if not bound.empty:
    what = bound.iloc[0]["evidence"].get("whatif") or {}
    if what:
        measured, serial, overlap = (what[k] for k in ("measured_s", "serial_s", "overlap_s"))
        cols = st.columns(3)
        cols[0].metric("step now", f"{measured * 1e3:.0f} ms", help="the slowest rank's, median over recent steps")
        cols[1].metric(
            "swaps back to back",
            f"{serial * 1e3:.0f} ms",
            help="predicted: the rest of the step, the "
            "transfers and the host optimizer one after another (ZeRO-Infinity's order)",
        )
        cols[2].metric(
            "swaps overlapped",
            f"{overlap * 1e3:.0f} ms",
            delta=f"{(overlap - serial) * 1e3:+.0f} ms",
            delta_color="inverse",
            help="predicted: the longest of the three, each hidden under the others (Fuyou's)",
        )
ui.show_findings(tiers, "No step waits long on copies between memory tiers, and no disk is slow.")

st.subheader("Time each step waited on copies and host work")
per_step = series.set_index("step")
waits = {  # what the steps report, each a line (one alone is named on its axis)
    what: values
    for what, column in (
        ("exposed (no compute hid it)", "exposed_s"),
        ("copies in flight", "transfer_s"),
        ("host optimizer", "host_optimizer_s"),
    )
    if not (values := per_step[column].dropna()).empty
}
axis = "seconds (mean over ranks)" if len(waits) > 1 else f"{next(iter(waits))}, seconds (mean over ranks)"
st.altair_chart(charts.by_step(waits, axis), width="stretch")
shares = {  # each median over the steps shown; NaN where no step reports it
    "copies no compute hid": series["exposed_share"].median(),
    "the optimizer on the host's CPUs": (series["host_optimizer_s"] / series["step_s"]).median(),
}
said = [f"{what} for {share:.0%}" for what, share in shares.items() if pd.notna(share)]
if said:
    st.caption("Steps waited on " + " and on ".join(said) + " of their time (median over the steps shown).")

st.subheader("Bandwidth by direction")
bandwidth = ui.frame("tier_bandwidth", run=run, points=ui.POINTS, first=first, last=last).dropna(subset=["bytes_per_s"])
probe = ui.frame("disk_probe", run=run).iloc[0]
lines = {d: rows.set_index("step")["bytes_per_s"] / 1e6 for d, rows in bandwidth.groupby("direction")}
if pd.notna(probe["read_bps"]) and lines:
    steps = bandwidth["step"].drop_duplicates().sort_values()
    lines["disk probe, read"] = pd.Series(probe["read_bps"] / 1e6, index=steps)
    lines["disk probe, write"] = pd.Series(probe["write_bps"] / 1e6, index=steps)
if lines:
    st.altair_chart(charts.by_step(lines, "MB/s"), width="stretch")
    st.caption(
        "Bytes over the copies' own time, all ranks together. Near the disk's probe (large sequential I/O at "
        "the job's start) the disk is the limit; far below it, the access pattern is (small blocks, no prefetch)."
    )
else:
    st.caption(
        "No bandwidth to draw: no copy between tiers in these steps reported its size and a time above zero "
        "(`agent.transfer(src, dst, nbytes)`)."
    )
