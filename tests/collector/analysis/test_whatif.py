"""What-if analysis: on simulator traces with known causes it finds the right pattern and ranks,
and `rankwatch analyze --json` carries the documented report, `--heatmap` a PNG."""

import json

import pandas as pd
import pytest
from PIL import Image

from collector.analysis.analyzers import whatif
from tests.support.commands import rankwatch_in_process
from tests.support.op_traces import synchronous
from trainer import simulate
from trainer.faults import parse

pytestmark = pytest.mark.unit  # pure code on small inputs: `make check` runs these

WORK = {"batch-generator": 0.05, "forward-compute": 0.1, "backward-compute": 0.15}  # + 0.05 s all-reduce
TOPOLOGY = simulate.Topology(dp=16, pp=4)  # 64 ranks, stage s = ranks 16s..16s+15


def report(*specs: str, seed: int = 1) -> whatif.WhatIf:
    df = pd.concat(simulate.steps(TOPOLOGY, 40, [parse(s) for s in specs], seed=seed), ignore_index=True)
    return whatif.analyze(df, TOPOLOGY.placement())


@pytest.mark.parametrize("seed", range(3))
def test_clean_run_has_no_pattern(seed):
    r = report(seed=seed)
    assert r.pattern == "none" and r.culprits == []
    assert r.slowdown == pytest.approx(1.0, abs=0.06)


def test_single_slow_worker_is_the_cause():
    r = report("straggler:rank=37,slowdown=1.2")
    assert (r.pattern, r.culprits) == ("worker", [37])
    assert r.workers[0]["rank"] == 37 and r.workers[0]["pp_stage"] == 2 and r.workers[0]["dp_rank"] == 5
    assert r.workers[0]["slowdown"] - 1 > 0.6 * (r.slowdown - 1)  # it alone explains most of the slowdown
    assert r.workers[1]["slowdown"] < 1.02
    assert r.concentration > 0.9
    assert r.op_types["compute"] > r.op_types["comm"] and r.op_types["compute"] > r.op_types["data"]


def test_slow_stage_is_the_cause():
    r = report("slow-stage:stage=2,slowdown=1.2")
    assert (r.pattern, r.culprits) == ("stage", list(range(32, 48)))
    assert r.stages[0]["pp_stage"] == 2 and r.stages[0]["slowdown"] > 1.1 > r.stages[1]["slowdown"]


def test_data_skew_is_widespread():
    r = report("data-skew:cv=0.3")
    assert (r.pattern, r.culprits) == ("widespread", [])
    assert r.slowdown > 1.3 and r.concentration < 0.5


def test_slow_communication_is_the_cause():
    r = report("slow-link:rank=5,factor=3,from=30")  # a quarter of the run: the median transfer stays fast
    assert r.pattern == "communication"
    assert r.op_types["comm"] > 1.03 and r.op_types["compute"] < r.op_types["comm"]


def test_cli_json_report_and_heatmap(tmp_path):
    trace, db, png = tmp_path / "sim.parquet", tmp_path / "s.duckdb", tmp_path / "heat.png"
    assert (
        rankwatch_in_process(
            "simulate",
            "--ranks",
            "64",
            "--pp",
            "4",
            "--steps",
            "40",
            "--out",
            str(trace),
            "--inject",
            "straggler:rank=37,slowdown=1.2",
        ).returncode
        == 0
    )
    assert rankwatch_in_process("import", "ops", str(trace), "--run", "wi", "--db", str(db)).returncode == 0
    result = rankwatch_in_process("analyze", "wi", "--db", str(db), "--json", "--heatmap", str(png))
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert {"run", "steps", "ranks", "slowdown", "workers", "stages", "op_types", "pattern", "findings"} <= set(doc)
    assert (doc["run"], doc["steps"], doc["ranks"], doc["pattern"], doc["culprits"]) == ("wi", 40, 64, "worker", [37])
    assert {"rank", "dp_rank", "pp_stage", "slowdown"} <= set(doc["workers"][0])
    assert [(f["kind"], f["ranks"]) for f in doc["findings"]] == [("rank", [37])]
    with Image.open(png) as image:
        assert image.format == "PNG" and image.width >= 600


def analyze_trace(trace: pd.DataFrame, tmp_path) -> dict:
    """`rankwatch import ops` then `rankwatch analyze --json` of an op trace; the JSON report."""
    path, db = tmp_path / "trace.csv", tmp_path / "s.duckdb"
    trace.to_csv(path, index=False)
    imported = rankwatch_in_process("import", "ops", str(path), "--run", "t", "--db", str(db))
    assert imported.returncode == 0, imported.stderr
    result = rankwatch_in_process("analyze", "t", "--db", str(db), "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_sampled_steps_with_gaps(tmp_path):
    """Published traces sample steps (36 is followed by 259), in float seconds from 0: the whole run
    is analysed and its slow worker found."""
    trace = synchronous([*range(37), *range(259, 300)], 16, WORK, slow={3: 1.3})
    doc = analyze_trace(trace, tmp_path)
    assert (doc["steps"], doc["ranks"], doc["pattern"], doc["culprits"]) == (78, 16, "worker", [3])
    # the slow rank's step over the ideal, every op at its mean over rank-steps (the slow rank's among them)
    assert doc["slowdown"] == pytest.approx((1.3 * 0.3 + 0.05) / (0.3 + 0.3 * 0.3 / 16 + 0.05), rel=1e-3)
    assert {(f["kind"], tuple(f["ranks"])) for f in doc["findings"]} == {("rank", (3,))}  # an episode a sample


def test_idle_is_reported_apart_from_the_slowdown(tmp_path):
    """A rank whose GPU idles 75% of each step has no straggler: S is 1, the idle is its own figure."""
    doc = analyze_trace(synchronous(list(range(20)), 1, WORK, transfer=0.05, idle=1.0), tmp_path)
    assert doc["slowdown"] == pytest.approx(1.0, abs=1e-6)
    assert doc["simulated_step_s"] == pytest.approx(0.35, rel=1e-3)
    assert doc["actual_step_s"] == pytest.approx(1.35, rel=1e-3)
    assert doc["idle_slowdown"] == pytest.approx(1.35 / 0.35, rel=1e-3)
    assert doc["pattern"] == "none"


def test_attribution_splits_op_types_as_the_paper_does(tmp_path):
    """forward and backward compute, each kind of communication and data are attributed apart; the
    slow rank's extra backward time is what explains the slowdown."""
    trace = synchronous(list(range(30)), 8, WORK, slow={5: 1.5})
    trace.loc[(trace["rank"] == 5) & (trace["op"] != "backward-compute"), "duration"] /= 1.5
    doc = analyze_trace(trace, tmp_path)
    assert set(doc["op_types"]) == {"data", "forward-compute", "backward-compute", "comm:grads-all-reduce"}
    assert doc["op_types"]["backward-compute"] == pytest.approx(doc["slowdown"], rel=1e-3)
    assert doc["op_types"]["forward-compute"] < 1.01 and doc["op_types"]["comm:grads-all-reduce"] < 1.01


def offloaded(host_s: float, copies_s: float, hidden_s: float = 0.0, steps: int = 10):
    """One rank's steps of an offloaded optimizer: 250 ms of compute, then `copies_s` of copies between GPU
    and pinned memory and `host_s` of AdamW on the host's CPUs, back to back outside any phase; `hidden_s`
    more of copies run under the compute. The steps and their parts as `PARTS_SQL` gives them."""
    duration = 0.25 + copies_s + host_s
    frame = pd.DataFrame(
        {"rank": 0, "step": range(steps), "duration_s": duration, "data_s": 0.0, "compute_s": 0.25, "comm_wait_s": 0.0}
    )
    parts = pd.concat(
        [
            frame[["rank", "step"]].assign(op_type=op_type, seconds=seconds)
            for op_type, seconds in (
                ("forward-compute", 0.1),
                ("backward-compute", 0.15),
                ("host:optimizer", host_s),
                ("transfer:gpu->pinned", copies_s + hidden_s),
            )
        ],
        ignore_index=True,
    )
    return frame, parts


def test_host_work_and_transfers_are_op_types_not_idle():
    """A step that is mostly a host optimizer: its host work and copies are op types of their own, the ops
    back to back are the step, and nothing is left to launch delay and idle."""
    frame, parts = offloaded(host_s=0.712, copies_s=0.03)
    r = whatif.analyze(frame, None, parts)
    assert {"host:optimizer", "transfer:gpu->pinned"} <= set(r.op_types)
    assert r.simulated_step_s == pytest.approx(0.992) and r.idle_slowdown == pytest.approx(1.0)


def test_copies_compute_hid_count_for_what_the_steps_other_work_left():
    """Copies that ran under the compute count only for the time the step's phases and communication do
    not cover: the ops back to back never outlast the measured step."""
    frame, parts = offloaded(host_s=0.1, copies_s=0.03, hidden_s=0.2)
    r = whatif.analyze(frame, None, parts)
    assert r.simulated_step_s == pytest.approx(0.38) and r.idle_slowdown == pytest.approx(1.0)
