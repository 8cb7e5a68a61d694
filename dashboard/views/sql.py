"""SQL: any read-only query on the store, through the same checks as the query API; results
download as CSV."""

import streamlit as st

from dashboard import source, ui
from dashboard.source import QueryFailed

st.title("SQL")
st.caption(
    "One SELECT, read-only, at most 100,000 rows, 32 MiB and 10 s. Tables: runs, ranks, steps, current_steps, "
    "ops, device_samples, events, findings, commands (docs/telemetry.md)."
)
sql = st.text_area(
    "Query", "SELECT run_id, count(*) AS rank_steps FROM steps GROUP BY run_id ORDER BY 2 DESC", height=140, key="sql"
)
st.button("Run", type="primary", key="run_sql")  # a rerun: the query in the box runs on every run of the page
if sql.strip():
    try:
        answer = ui.data_source().query(sql)
    except QueryFailed as e:
        st.error(ui.literal(e))
        st.stop()
    result = source.to_frame(answer)
    if answer["truncated"]:
        st.warning(f"Only the first {len(result):,} rows.")
    st.dataframe(result, hide_index=True, width="stretch")
    st.download_button("Download CSV", result.to_csv(index=False), "rankwatch-query.csv", "text/csv", key="csv")
