"""Property tests over random op traces: import then analyze never crashes, and the what-if report
never claims a slowdown its own attribution cannot explain.

Traces are drawn with gaps in the steps, ranks missing some steps, zero and equal durations,
duplicated ops, a single rank, and times as floats or integers; each goes through the generic
op-trace importer into a real DuckDB file and `analyze_run` reads it back.
"""

import math
import tempfile
from pathlib import Path

import pandas as pd
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from collector.receive.imports import store_run
from collector.receive.imports.ops import OpTrace
from collector.reports.postmortem import analyze_run
from collector.store.db import connect

OPS = ("batch-generator", "forward-compute", "backward-compute", "optimizer", "grads-all-reduce", "forward-recv")


@st.composite
def traces(draw) -> pd.DataFrame:
    ranks = draw(st.integers(1, 5))
    steps = sorted(draw(st.sets(st.integers(0, 10**6), min_size=1, max_size=8)))  # gaps of any size
    integer = draw(st.booleans())  # whole seconds, as some exporters write them
    duration = st.integers(0, 3) if integer else st.sampled_from([0.0, 0.25, 0.25, 1e-9, 0.1, 2.5])
    rows = []
    for step in steps:
        for rank in range(ranks):
            if rows and draw(st.integers(0, 4)) == 0:
                continue  # this rank did not report this step
            start = step * 100 + (draw(st.integers(0, 2)) if integer else draw(st.floats(0, 2)))
            for op in draw(st.lists(st.sampled_from(OPS), min_size=1, max_size=6)):  # repeats: duplicated ops
                d = draw(duration)
                rows.append((rank, step, op, start, d))
                if draw(st.booleans()):
                    start += d
    return pd.DataFrame(rows, columns=["rank", "step", "op", "start", "duration"])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trace=traces(), fmt=st.sampled_from(["csv", "parquet"]))
def test_import_then_analyze_explains_its_slowdown(trace, fmt):
    with tempfile.TemporaryDirectory() as tmp:
        path, db = Path(tmp) / f"trace.{fmt}", Path(tmp) / "s.duckdb"
        trace.to_csv(path, index=False) if fmt == "csv" else trace.to_parquet(path, index=False)
        op_trace = OpTrace(path)
        store_run(db, "p", op_trace.batches(), op_trace.placement_frame)
        con = connect(db, read_only=True)
        try:
            report = analyze_run(con, "p")
        finally:
            con.close()
    w = report.whatif
    assert w.ranks == trace["rank"].nunique() and w.steps == trace["step"].nunique()
    numbers = [
        w.slowdown,
        w.ideal_step_s,
        w.simulated_step_s,
        w.actual_step_s,
        *w.op_types.values(),
        *(x["slowdown"] for x in w.workers + w.stages),
    ]
    assert all(math.isfinite(x) for x in numbers)
    assert w.idle_slowdown is None or math.isfinite(w.idle_slowdown)
    # every op type's excess, added up, covers the run's: max over ranks of a sum <= sum of the maxima
    assert w.slowdown - 1 <= sum(s - 1 for s in w.op_types.values()) + 1e-9
    assert 0.0 <= w.concentration <= 1.0
    assert set(w.culprits) <= set(trace["rank"])
