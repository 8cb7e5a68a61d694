"""`rankwatch import ops`: the generic op trace into a store, all or nothing.

Covered: a simulator trace (Parquet) round-trips (every op, the rank-steps
derived from them, the placement) and `rankwatch analyze` finds its injected
straggler; a CSV with Megatron-style and NCCL names and no kind column gets
kinds inferred and step times summed by kind; a malformed file is a one-line
error naming the file; a trace that fails half-way leaves nothing in the
store; a run id already in the store is refused.
"""

import json

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from collector.receive.imports import TraceError, store_run
from collector.receive.imports.ops import OpTrace, infer_kind
from tests.support.commands import rankwatch_in_process
from tests.support.otlp_payloads import query

pytestmark = pytest.mark.unit  # pure code on small inputs: `make check` runs these


@pytest.fixture(scope="module")
def simulated(tmp_path_factory):
    path = tmp_path_factory.mktemp("ops") / "sim.parquet"
    result = rankwatch_in_process(
        "simulate",
        "--ranks",
        "32",
        "--pp",
        "2",
        "--steps",
        "60",
        "--out",
        str(path),
        "--inject",
        "straggler:rank=19,slowdown=1.25,from=20",
    )
    assert result.returncode == 0, result.stderr
    return path


def test_simulator_trace_round_trips_and_is_diagnosed(simulated, tmp_path):
    db = tmp_path / "s.duckdb"
    result = rankwatch_in_process("import", "ops", str(simulated), "--run", "imp", "--db", str(db))
    assert result.returncode == 0, result.stderr
    trace = pd.read_parquet(simulated)
    assert query(db, "SELECT count(*), count(DISTINCT rank), count(DISTINCT step) FROM ops WHERE run_id = 'imp'") == [
        (len(trace), 32, 60)
    ]
    assert query(db, "SELECT count(*) FROM steps WHERE run_id = 'imp'") == [(32 * 60,)]
    # a rank-step's compute is the sum of its compute ops, as written
    written = trace[trace["kind"] == "compute"].groupby(["rank", "step"])["duration"].sum()
    stored = {(r, s): c for r, s, c in query(db, "SELECT rank, step, compute_s FROM steps WHERE run_id = 'imp'")}
    assert max(abs(stored[k] - v) for k, v in written.items()) < 1e-6
    assert query(
        db, "SELECT rank, pp_stage, dp_rank FROM ranks WHERE run_id = 'imp' AND rank IN (0, 19) ORDER BY rank"
    ) == [(0, 0, 0), (19, 1, 3)]
    assert query(db, "SELECT world_size FROM runs WHERE run_id = 'imp'") == [(32,)]

    report = rankwatch_in_process("analyze", "imp", "--db", str(db), "--json")
    assert report.returncode == 0, report.stderr
    (finding,) = json.loads(report.stdout)["findings"]
    assert (finding["kind"], finding["ranks"]) == ("rank", [19])


@pytest.mark.parametrize(
    "name, kind",
    [
        ("forward-compute", "compute"),
        ("backward-compute", "compute"),
        ("optimizer", "compute"),
        ("forward-recv", "comm"),
        ("backward-send", "comm"),
        ("grads-reduce-scatter", "comm"),
        ("params-all-gather", "comm"),
        ("nccl:all_reduce", "comm"),
        ("all_gather_into_tensor", "comm"),
        ("batch-generator", "data"),
        ("checkpoint-save", "other"),
    ],
)
def test_kind_is_inferred_from_the_name(name, kind):
    assert infer_kind(name) == kind


def test_csv_without_kind(tmp_path):
    path = tmp_path / "megatron.csv"
    rows = []
    for rank in range(2):
        for step in range(3):
            t = step * 1.0
            for op, duration in (
                ("batch-generator", 0.01),
                ("forward-compute", 0.2),
                ("backward-compute", 0.4),
                ("grads-reduce-scatter", 0.05),
                ("optimizer", 0.03),
            ):
                rows.append((rank, step, op, t, duration))
                t += duration
    pd.DataFrame(rows, columns=["rank", "step", "op", "start", "duration"]).to_csv(path, index=False)
    db = tmp_path / "s.duckdb"
    result = rankwatch_in_process("import", "ops", str(path), "--run", "mega", "--db", str(db))
    assert result.returncode == 0, result.stderr
    assert query(db, "SELECT DISTINCT name, kind FROM ops ORDER BY name") == [
        ("backward-compute", "compute"),
        ("batch-generator", "data"),
        ("forward-compute", "compute"),
        ("grads-reduce-scatter", "comm"),
        ("optimizer", "compute"),
    ]
    ((data, compute, comm, duration),) = query(
        db, "SELECT data_s, compute_s, comm_wait_s, duration_s FROM steps WHERE rank = 1 AND step = 2"
    )
    assert (data, compute, comm) == pytest.approx((0.01, 0.63, 0.05))
    assert duration == pytest.approx(0.69)


@pytest.mark.parametrize(
    "content, why",
    [
        ("rank,step,op,start\n0,0,x,0.0\n", "missing column duration"),
        ("rank,step,op,start,duration,kind\n0,0,x,0.0,0.1,gpu\n", "row 1 has kind 'gpu'"),
        ("rank,step,op,start,duration\n0,0,x,0.0,0.1\n0,,x,0.1,0.1\n", "row 2 has no step"),
        ("rank,step,op,start,duration\n0,0,x,0.0,-0.1\n", "row 1 has a negative duration"),
    ],
)
def test_malformed_file_is_a_one_line_error(tmp_path, content, why):
    path = tmp_path / "bad.csv"
    path.write_text(content)
    result = rankwatch_in_process("import", "ops", str(path), "--run", "bad", "--db", str(tmp_path / "s.duckdb"))
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and str(path) in result.stderr and why in result.stderr, result.stderr


def test_unknown_format_is_a_one_line_error(tmp_path):
    path = tmp_path / "trace.txt"
    path.write_text("x")
    result = rankwatch_in_process("import", "ops", str(path), "--run", "r", "--db", str(tmp_path / "s.duckdb"))
    assert result.returncode == 2 and ".parquet or .csv" in result.stderr


def test_failure_half_way_leaves_nothing(tmp_path):
    path = tmp_path / "half.parquet"
    frame = pd.DataFrame(
        {
            "rank": [0] * 100,
            "step": range(100),
            "op": "forward-compute",
            "start": [float(i) for i in range(100)],
            "duration": [0.5] * 100,
        }
    )
    frame.loc[77, "duration"] = -1.0
    pq.write_table(pa.Table.from_pandas(frame, preserve_index=False), path)
    trace = OpTrace(path, batch_rows=10)  # seven good batches are written before the bad one
    db = tmp_path / "s.duckdb"
    with pytest.raises(TraceError, match="row 78 has a negative duration"):
        store_run(db, "half", trace.batches(), trace.placement_frame)
    assert query(
        db,
        "SELECT (SELECT count(*) FROM ops), (SELECT count(*) FROM steps), (SELECT count(*) FROM runs), "
        "(SELECT count(*) FROM ranks)",
    ) == [(0, 0, 0, 0)]


def test_run_already_in_the_store_is_refused(simulated, tmp_path):
    db = tmp_path / "s.duckdb"
    assert rankwatch_in_process("import", "ops", str(simulated), "--run", "twice", "--db", str(db)).returncode == 0
    again = rankwatch_in_process("import", "ops", str(simulated), "--run", "twice", "--db", str(db))
    assert again.returncode == 2 and "already in" in again.stderr
    assert query(db, "SELECT count(DISTINCT rank) FROM ranks") == [(32,)]
