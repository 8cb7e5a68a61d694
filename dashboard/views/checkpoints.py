"""Checkpoints & rollbacks: loss and gradient norm over the run, marked where anomalies fired,
rollbacks were sent and applied, and checkpoints were saved or restored."""

import streamlit as st

from dashboard import charts, ui

run = ui.current_run()
st.title("Checkpoints & rollbacks")
first, last = ui.step_window(run)
series = ui.frame("step_series", run=run, points=ui.POINTS, first=first, last=last)
markers = ui.frame("markers", run=run)
rolled_back = ui.frame("rolled_back", run=run)
commands = ui.frame("commands", run=run)
rollbacks = commands[commands["kind"] == "rollback"]
if rollbacks.empty:
    st.success("No rollback: no anomaly has sent this run back to a checkpoint.")
else:
    last = rollbacks.iloc[-1]
    result = last["result"] if isinstance(last["result"], dict) else {}
    restored = result.get("restored_step")
    headline = (
        f"**{len(rollbacks)} rollback{'s' * (len(rollbacks) > 1)}.** "
        f"The latest ({ui.literal(last['args']['anomaly'])}) is {last['state']}"
    )
    if last["state"] == "failed":
        st.error(f"{headline}: {ui.literal(result.get('why', 'the job did not say why'))}.")
    else:
        st.warning(headline + (f": the job restored step {ui.literal(restored)}." if restored is not None else "."))
nonfinite = int(series["non_finite"].sum()) if not series.empty else 0
if nonfinite:
    st.error(f"{nonfinite} rank-steps reported a NaN or infinite loss or gradient norm (left out of the curves).")

if not rolled_back.empty:
    st.caption(
        f"Red points: the {len(rolled_back)} steps rollbacks abandoned (the line is the trajectory kept), "
        f"steps {rolled_back['step'].min()}–{rolled_back['step'].max()}."
    )
for value, title in (("loss", "Loss"), ("grad_norm", "Gradient norm")):
    st.subheader(title)
    if series[value].notna().any():
        st.altair_chart(charts.with_markers(series, value, markers, rolled_back), width="stretch")
    else:
        st.caption(f"The job reports no {title.lower()} (`agent.record({value}=...)`).")

st.subheader("Markers")
if markers.empty:
    st.caption("No anomaly, rollback, checkpoint or injected fault recorded.")
else:
    st.dataframe(markers, hide_index=True, width="stretch")
with st.expander("rollback commands"):
    st.dataframe(rollbacks, hide_index=True, width="stretch")
