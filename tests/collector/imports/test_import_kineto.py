"""`rankwatch import kineto`: PyTorch profiler traces into a store, all or nothing.

Covered, on real traces (tests/data/kineto/): two ranks of a 128-rank job
imported from a directory keep their ranks, world size and steps, their NCCL
kernels become comm ops and each rank-step's compute and exposed comm match
the kernels of the file (recomputed here on a microsecond grid, apart from the
importer), and `rankwatch analyze` reads the run; a trace with collective
metadata gets nccl-tests bytes, group size and bus bandwidth, and wall-clock
times from its baseTimeNanoseconds. On a small made-up trace: the rank from
the file name, kernels tied to steps by their launch, by the launched kernel
before them on their stream, or by their start, and the ones outside every
step dropped; a trace without ProfilerStep is one step, one without a rank is
rank 0, each with a one-line notice. A rank file that is unreadable, has no
traceEvents or no GPU ops fails the whole import in one line, exit 2, naming
the file.
"""

import gzip
import json
import shutil

import numpy as np
import pytest

from collector.receive.imports import TraceError, store_run
from collector.receive.imports.kineto import KinetoTrace
from tests.support.commands import rankwatch_in_process
from tests.support.kineto import kernels_by_step
from tests.support.otlp_payloads import query
from tests.support.paths import DATA

DATA = DATA / "kineto"
SAMPLED = ("sampled_rank-0.json.gz", "sampled_rank-1.json.gz")


def trace(name: str) -> dict:
    with gzip.open(DATA / name) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def sampled(tmp_path_factory):
    """The two sampled ranks imported from a directory: (store, the import's stdout)."""
    root = tmp_path_factory.mktemp("kineto")
    (root / "traces").mkdir()
    for name in SAMPLED:
        shutil.copy(DATA / name, root / "traces" / name)
    result = rankwatch_in_process(
        "import", "kineto", str(root / "traces"), "--run", "sam", "--db", str(root / "s.duckdb")
    )
    assert result.returncode == 0, result.stderr
    return root / "s.duckdb", result.stdout, result.stderr


def test_ranks_world_size_and_steps(sampled):
    """The run is the ranks imported: two sampled ranks of a 128-rank job are a run of two, not one of
    128 with 126 ranks' telemetry lost; a notice says how many the job had."""
    db, stdout, stderr = sampled
    assert "0 GPU ops outside any ProfilerStep dropped" in stdout
    assert "the traces hold 2 of the job's 128 ranks" in stderr
    assert query(db, "SELECT world_size FROM runs WHERE run_id = 'sam'") == [(2,)]
    assert query(db, "SELECT rank, pid FROM ranks WHERE run_id = 'sam' ORDER BY rank") == [(0, 4037), (1, 4045)]
    assert query(db, "SELECT rank, step FROM steps WHERE run_id = 'sam' ORDER BY rank, step") == [
        (0, 551),
        (0, 552),
        (1, 551),
        (1, 552),
    ]
    report = rankwatch_in_process("analyze", "sam", "--db", str(db), "--json")
    assert report.returncode == 0, report.stderr
    assert json.loads(report.stdout)["telemetry_loss"]["rank_steps_missing"] == 0


def test_files_given_one_by_one_are_one_run_and_read_as_one(sampled, tmp_path):
    """Several files on the command line import as one run, as their directory does; the report
    names what the trace holds and no more: no placement it lacks, no empty findings table."""
    db, _, _ = sampled
    result = rankwatch_in_process(
        "import", "kineto", *(str(DATA / name) for name in SAMPLED), "--run", "sam", "--db", str(tmp_path / "s.duckdb")
    )
    assert result.returncode == 0, result.stderr
    one_by_one = "SELECT rank, step, duration_s, compute_s FROM steps ORDER BY ALL"
    assert query(tmp_path / "s.duckdb", one_by_one) == query(db, one_by_one)
    text = rankwatch_in_process("analyze", "sam", "--db", str(tmp_path / "s.duckdb"))
    assert text.returncode == 0, text.stderr
    assert "pattern worker (rank 1)" in " ".join(text.stdout.split())
    assert "None" not in text.stdout and "telemetry lost" not in text.stdout
    assert "0 findings" not in text.stdout and "No findings" in text.stdout


def test_an_imported_run_keeps_its_story_as_findings(sampled):
    """No collector drew an imported run's findings as it went: the import draws them, the what-if's
    among them, each ended with the trace, so the dashboard and `/metrics` tell the run's story."""
    db, _, _ = sampled
    ((kind, ranks, state, severity, score, summary, evidence),) = query(
        db,
        "SELECT kind, ranks, state, severity, score, summary, evidence FROM findings "
        "WHERE run_id = 'sam' AND analyzer = 'whatif'",
    )
    assert (kind, list(ranks), state) == ("worker", [1], "ended")
    assert severity == "warning" and score == pytest.approx(1.06, abs=0.01)  # rank 1 costs the run 6%
    assert "slowdown 1.06x, pattern worker (rank 1)" in summary and "2.14x the ops back to back" in summary
    assert json.loads(evidence)["resolved"] == "trace ended"
    assert query(db, "SELECT count(*) FROM findings WHERE run_id = 'sam' AND state = 'firing'") == [(0,)]


def test_an_ops_trace_is_one_file(tmp_path):
    result = rankwatch_in_process("import", "ops", "a.csv", "b.csv", "--run", "r", "--db", str(tmp_path / "s.duckdb"))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "rankwatch: error: an ops trace is one file (Parquet or CSV) holding every rank"
    ]


def expected_steps(doc: dict) -> dict[int, dict[str, float]]:
    """Per step, from the trace alone: compute kernel time, NCCL kernel time and NCCL time with no
    compute kernel running (on a 1 µs grid: this trace's times are whole microseconds)."""
    windows, launched, kernels, origin, size = kernels_by_step(doc)
    busy = np.zeros(size, bool)
    for e in kernels:
        if not e["name"].startswith("ncclKernel"):
            busy[int(e["ts"]) - origin : int(e["ts"] + e["dur"]) - origin] = True
    sums = {step: {"compute": 0.0, "comm": 0.0, "exposed": 0.0} for step, _, _ in windows}
    for e in kernels:
        t = launched[e["args"]["correlation"]]
        (step,) = [s for s, start, end in windows if start <= t <= end]
        begin, end = int(e["ts"]) - origin, int(e["ts"] + e["dur"]) - origin
        if e["name"].startswith("ncclKernel"):
            sums[step]["comm"] += e["dur"] / 1e6
            sums[step]["exposed"] += (end - begin - busy[begin:end].sum()) / 1e6
        else:
            sums[step]["compute"] += e["dur"] / 1e6
    return sums


@pytest.mark.parametrize("rank", [0, 1])
def test_step_times_are_those_of_the_kernels(sampled, rank):
    db, _, _ = sampled
    doc = trace(SAMPLED[rank])
    nccl = sorted(
        e["dur"] for e in doc["traceEvents"] if e.get("cat") == "kernel" and e["name"].startswith("ncclKernel_SendRecv")
    )
    comm = query(
        db,
        "SELECT name, duration_s FROM ops WHERE run_id = 'sam' AND rank = ? AND kind = 'comm' ORDER BY duration_s",
        [rank],
    )
    assert len(nccl) == 10 and {name for name, _ in comm} == {"send"}  # NCCL's P2P kernel
    assert [d for _, d in comm] == pytest.approx([d / 1e6 for d in nccl])
    stored = {
        step: (compute, comm_ops, wait)
        for step, compute, comm_ops, wait in query(
            db,
            "SELECT s.step, s.compute_s, sum(o.duration_s) FILTER (o.kind = 'comm'), s.comm_wait_s "
            "FROM steps s JOIN ops o USING (run_id, rank, step) WHERE run_id = 'sam' AND rank = ? "
            "GROUP BY ALL",
            [rank],
        )
    }
    expected = expected_steps(doc)
    assert set(stored) == set(expected) == {551, 552}
    for step, e in expected.items():
        assert stored[step] == pytest.approx((e["compute"], e["comm"], e["exposed"]), abs=1e-9)
        assert 0 < e["exposed"] < e["comm"]  # some of the comm ran beside compute kernels


def test_collective_metadata_gives_bytes_and_bus_bandwidth(tmp_path):
    db = tmp_path / "s.duckdb"
    result = rankwatch_in_process("import", "kineto", str(DATA / "nccl_data.json.gz"), "--run", "nccl", "--db", str(db))
    assert result.returncode == 0, result.stderr
    assert query(db, "SELECT name, count(*) FROM ops WHERE kind = 'comm' GROUP BY name ORDER BY name") == [
        ("all_reduce", 15),
        ("broadcast", 6),
    ]
    # the first all_reduce kernel of ProfilerStep#6: "In msg nelems": 6637568, "dtype": "Float",
    # "Group size": 2, "Process Group Name": "0", "dur": 2636.669 µs
    ((nbytes, group_size, group, algbw, busbw),) = query(
        db,
        "SELECT bytes, group_size, comm_group, algbw_gbps, busbw_gbps FROM ops "
        "WHERE name = 'all_reduce' AND round(duration_s * 1e9) = 2636669",
    )
    assert (nbytes, group_size, group) == (6637568 * 4, 2, "0")
    assert algbw == pytest.approx(6637568 * 4 / 2636.669e-6 / 1e9)
    assert busbw == pytest.approx(algbw * 2 * (2 - 1) / 2)
    # a broadcast of 53120 floats: busbw = algbw
    assert query(
        db, "SELECT DISTINCT bytes, busbw_gbps = algbw_gbps FROM ops WHERE name = 'broadcast' AND bytes = 53120 * 4"
    ) == [(212480, True)]
    # ts counts microseconds from the file's baseTimeNanoseconds, 1711964646000000000
    first = min(
        e["ts"]
        for e in trace("nccl_data.json.gz")["traceEvents"]
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
    )
    ((start,),) = query(db, "SELECT epoch_ns(min(start_ts)) FROM ops")
    assert abs(start - (1711964646000000000 + first * 1000)) <= 1
    assert query(db, "SELECT world_size FROM runs") == [(1,)]  # rank 0 of a 2-rank job: the run is the rank imported
    assert query(db, "SELECT rank, device FROM ranks") == [(0, "NVIDIA A100-PG509-200")]


def kernel(name: str, ts: float, dur: float, correlation: int) -> dict:
    return {
        "ph": "X",
        "cat": "kernel",
        "name": name,
        "pid": 0,
        "tid": 7,
        "ts": ts,
        "dur": dur,
        "args": {"correlation": correlation, "device": 0},
    }


def launch(ts: float, correlation: int) -> dict:
    return {
        "ph": "X",
        "cat": "cuda_runtime",
        "name": "cudaLaunchKernel",
        "pid": 9,
        "tid": 9,
        "ts": ts,
        "dur": 2,
        "args": {"correlation": correlation},
    }


def test_steps_by_launch_or_start_and_rank_from_file_name(tmp_path):
    path = tmp_path / "worker_rank3.pt.trace.json"
    path.write_text(
        json.dumps(
            {
                "traceEvents": [
                    {
                        "ph": "X",
                        "cat": "user_annotation",
                        "name": "ProfilerStep#7",
                        "pid": 9,
                        "tid": 9,
                        "ts": 100,
                        "dur": 100,
                    },
                    launch(105, 1),
                    kernel("gemm", 110, 30, 1),
                    launch(120, 2),
                    kernel("ncclDevKernel_AllGather_RING_LL(ncclDevComm*)", 130, 40, 2),  # 10 µs beside gemm
                    kernel("relu", 190, 20, 3),  # no launch: its start is in step 7
                    launch(210, 4),
                    kernel("late", 215, 5, 4),  # launched after the step: dropped
                    kernel("stray", 300, 5, 5),  # no launch, starts outside: dropped
                ]
            }
        )
    )
    imported = KinetoTrace(path)
    store_run(
        tmp_path / "s.duckdb",
        "r",
        imported.batches(),
        imported.placement_frame,
        imported.world_size,
        imported.step_columns,
    )
    assert imported.dropped == 2
    db = tmp_path / "s.duckdb"
    assert query(db, "SELECT rank, step, kind, name FROM ops ORDER BY start_ts") == [
        (3, 7, "compute", "gemm"),
        (3, 7, "comm", "all_gather"),
        (3, 7, "compute", "relu"),
    ]
    assert query(db, "SELECT compute_s, comm_wait_s FROM steps") == [(pytest.approx(50e-6), pytest.approx(30e-6))]
    assert query(db, "SELECT world_size FROM runs") == [(1,)]


@pytest.mark.parametrize(
    "write, why",
    [
        (lambda p: p.write_bytes((DATA / SAMPLED[1]).read_bytes()[:50_000]), "not readable as JSON"),
        (
            lambda p: p.write_text(json.dumps({"schemaVersion": 1, "distributedInfo": {"rank": 1, "world_size": 128}})),
            "no traceEvents",
        ),
        (
            lambda p: p.write_text(
                json.dumps(
                    {
                        "distributedInfo": {"rank": 1, "world_size": 128},
                        "traceEvents": [
                            {
                                "ph": "X",
                                "cat": "user_annotation",
                                "name": "ProfilerStep#7",
                                "pid": 9,
                                "tid": 9,
                                "ts": 1,
                                "dur": 9,
                            },
                            {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 9, "tid": 9, "ts": 2, "dur": 5},
                        ],
                    }
                )
            ),
            "no GPU kernels, copies or memsets: a CPU-only trace",
        ),
    ],
    ids=["truncated gzip", "no traceEvents", "CPU only"],
)
def test_bad_rank_file_fails_the_whole_import(tmp_path, write, why):
    traces = tmp_path / "traces"
    traces.mkdir()
    shutil.copy(DATA / SAMPLED[0], traces / SAMPLED[0])
    bad = traces / SAMPLED[1]  # read after rank 0's ops are in the transaction
    write(bad)
    db = tmp_path / "s.duckdb"
    result = rankwatch_in_process("import", "kineto", str(traces), "--run", "bad", "--db", str(db))
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and str(bad) in result.stderr and why in result.stderr, result.stderr
    assert query(
        db, "SELECT (SELECT count(*) FROM runs), (SELECT count(*) FROM ops), (SELECT count(*) FROM steps)"
    ) == [(0, 0, 0)]


def test_unreadable_single_file_is_a_trace_error(tmp_path):
    path = tmp_path / "trace.json"
    path.write_text("{")
    with pytest.raises(TraceError, match="not readable as JSON"):
        KinetoTrace(path)


def test_kernels_without_a_launch_follow_the_launched_kernel_before_them(tmp_path):
    """The GPU runs behind the CPU: a kernel whose launch the trace lacks starts in the next step's
    window, yet belongs to the step of the kernel queued before it on its stream."""
    path = tmp_path / "rank0.json"
    events = []
    for step in range(3):
        t = 100 * step
        events += [
            {
                "ph": "X",
                "cat": "user_annotation",
                "name": f"ProfilerStep#{step}",
                "pid": 9,
                "tid": 9,
                "ts": t,
                "dur": 100,
            },
            launch(t + 10, 10 * step + 1),
            kernel("gemm", t + 60, 30, 10 * step + 1),
            kernel("relu_no_launch", t + 100, 10, 10 * step + 2),
        ]  # at the next window's start
    path.write_text(json.dumps({"traceEvents": events}))
    imported = KinetoTrace(path)
    store_run(
        tmp_path / "s.duckdb",
        "r",
        imported.batches(),
        imported.placement_frame,
        imported.world_size,
        imported.step_columns,
    )
    assert query(
        tmp_path / "s.duckdb", "SELECT step, count(*), sum(duration_s) FROM ops GROUP BY step ORDER BY step"
    ) == [(s, 2, pytest.approx(40e-6)) for s in range(3)]
    assert imported.notices == []


def test_no_profiler_step_and_no_rank_are_assumed_with_a_notice(tmp_path):
    path = tmp_path / "trace.json"  # no rank in its name, no distributedInfo, no ProfilerStep
    path.write_text(
        json.dumps(
            {"traceEvents": [launch(5, 1), kernel("gemm", 10, 30, 1), launch(50, 2), kernel("softmax", 60, 20, 2)]}
        )
    )
    db = tmp_path / "s.duckdb"
    result = rankwatch_in_process("import", "kineto", str(path), "--run", "one", "--db", str(db))
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines() == [
        f"rankwatch import: {path}: no rank in distributedInfo or in the file name (rank<N>): taken as rank 0",
        (
            f"rankwatch import: {path}: no ProfilerStep#N annotations (prof.step() once per iteration makes them): "
            f"the whole trace is taken as one step, step 0"
        ),
    ]
    assert query(db, "SELECT rank, step, compute_s FROM steps") == [(0, 0, pytest.approx(50e-6))]
