"""A rank-step's compute time predicted from the state it ran in (collector/predict/steptime.py,
collector/analysis/analyzers/predicted.py): the features drawn from device and host samples, the
host's own readings, how much of a straggler's slowdown its state explains, and the whole job computing
slower than predicted. The fleet simulator plays the runs here: it tests the plumbing and the
attribution, not the model's accuracy on hardware (bench/steptime.py measures that on real runs)."""

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
import streamlit as st
from streamlit.testing.v1 import AppTest

from collector.analysis.analyzers import predicted, stragglers
from collector.predict import stepmodel, steptime
from collector.predict.stepmodel import Fitted
from dashboard.source import COLLECTOR_ENV, DB_ENV
from rankwatch.agent import semconv as sc
from rankwatch.agent.host import HostState
from tests.support.collectors import simulated_store
from tests.support.commands import bench, rankwatch_in_process
from tests.support.otlp_payloads import query
from tests.support.paths import ROOT
from trainer import simulate
from trainer.faults import parse

TOPOLOGY = simulate.Topology(dp=8)
SETTINGS = predicted.Settings()
THERMAL_SLOWDOWN = simulate.GpuModel().clock_max_mhz / simulate.GpuModel().thermal_clock_mhz


def run(faults: list[str], seed: int, steps: int = 40):
    rank_steps, samples, ranks = simulate.tables(TOPOLOGY, steps, [parse(f) for f in faults], seed)
    return rank_steps.assign(run_id=f"sim-{seed}"), steptime.features(rank_steps, samples, ranks), ranks


def trusted(model) -> Fitted:
    """A model taken as trusted: as if it had beaten every baseline on held-out runs by far."""
    ok = {"mape": 1.0, "p90": 2.0, "within5": 1.0, "r2_log": 1.0}
    return Fitted(model, {"ncpp": ok, "median": {**ok, "mape": 50.0}}, "median")


@pytest.fixture(scope="module")
def fitted() -> Fitted:
    made = [
        run(["thermal:rank=1,from=10"], 100),
        run([f"straggler:rank=2,slowdown={THERMAL_SLOWDOWN:.3f},from=10"], 101),
        run(["power-cap:rank=3,watts=350,from=10"], 102),
        run([], 103),
    ]
    features = pd.concat([f.assign(**{stepmodel.RUN: s["run_id"]}) for s, f, _ in made], ignore_index=True)
    target = pd.concat([s for s, _, _ in made], ignore_index=True)["compute_s"].to_numpy()
    return trusted(stepmodel.ncpp(epochs=30, seed=0).fit(features, target).model)


def test_a_metrics_feature_is_its_mean_within_the_step_else_the_latest_before_it():
    s = 10**9
    steps = pd.DataFrame(
        {
            "rank": [0, 0, 0, 1],
            "step": [1, 2, 3, 1],
            "end_ts": [2 * s, 3 * s, 20 * s, 2 * s],
            "duration_s": [1.0, 1.0, 1.0, 1.0],
            "tokens": [512, 512, 512, 0],
            "flops": [1e9] * 4,
        }
    )
    samples = pd.DataFrame(
        {
            "rank": [0, 0, 0, 1, 0],
            "ts": [int(1.2 * s), int(1.8 * s), int(1.5 * s), int(1.5 * s), int(1.9 * s)],
            "metric": [sc.SM_CLOCK_MHZ, sc.SM_CLOCK_MHZ, sc.PRESSURE_CPU, sc.SM_CLOCK_MHZ, sc.CLOCK_EVENT_REASONS],
            "value": [1000.0, 2000.0, 0.25, 1500.0, 0x20 | 0x4],
        }
    )
    f = steptime.features(steps, samples, pd.DataFrame({"rank": [0, 1], "tp_rank": [0, 1]}))
    # step 1 of rank 0: the mean of its two clock samples; step 2: none within, the latest before
    # (1 s old); step 3: the latest is 18 s old, stale
    assert f[sc.SM_CLOCK_MHZ].tolist()[:3] == [1500.0, 2000.0, pytest.approx(np.nan, nan_ok=True)]
    assert f[sc.SM_CLOCK_MHZ].iat[3] == 1500.0  # rank 1 its own
    assert f[sc.PRESSURE_CPU].tolist()[:2] == [0.25, 0.25]
    assert f["throttle.thermal"].tolist()[:2] == [1.0, 1.0] and f["throttle.power"].iat[0] == 1.0
    assert f["throttle.hardware"].iat[0] == 0.0
    assert f["log_flops"].iat[0] == pytest.approx(np.log(1e9)) and np.isnan(f["log_tokens"].iat[3])
    assert f["tp_rank"].tolist() == [0, 0, 0, 1]


def proc_tree(root: Path, cpu_us: int, read_sectors: int, io_ms: int, faults: int, read_bytes: int) -> None:
    """A /proc tree as the kernel writes it (its files are the hardware boundary), and /sys/block."""
    psi = "some avg10=0.00 avg60=0.00 avg300=0.00 total={}\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"
    (root / "pressure").mkdir(exist_ok=True)
    for name, total in (("cpu", cpu_us), ("io", 0)):
        (root / "pressure" / name).write_text(psi.format(total))
    (root / "meminfo").write_text(
        "MemTotal:  1000 kB\nMemFree:  100 kB\nMemAvailable:  250 kB\nDirty:  8 kB\nWriteback:  2 kB\n"
    )
    (root / "self").mkdir(exist_ok=True)
    (root / "self" / "io").write_text(f"rchar: 1\nwchar: 2\nread_bytes: {read_bytes}\nwrite_bytes: 4096\n")
    fields = " ".join(["S", *["0"] * 6, "1", "0", str(faults), *["0"] * 40])  # field 12 is majflt
    (root / "self" / "stat").write_text(f"42 (a (name)) {fields}\n")
    disk = f"   8  0 sda 5 0 {read_sectors} 7 3 0 16 9 0 {io_ms} 20 0 0 0 0\n"
    (root / "diskstats").write_text(
        disk + "   8  1 sda1 5 0 99999 7 3 0 99999 9 0 999 20 0 0 0 0\n"
        "   7  0 loop0 1 0 99999 0 0 0 0 0 0 999 0 0 0 0 0\n"
    )
    for name in ("sda", "loop0"):
        (root / "block" / name).mkdir(parents=True, exist_ok=True)


def test_the_host_is_read_from_proc_its_stalls_and_io_as_rates(tmp_path):
    """PSI's `some` totals are microseconds stalled since boot, /proc/diskstats counts 512-byte sectors
    and milliseconds of I/O, /proc/self/io bytes: a reading is their growth over the time between two.
    The disks (whole ones: no partition, no loop device) and dirty pages are one rank's per host."""
    proc_tree(tmp_path, cpu_us=1_000_000, read_sectors=0, io_ms=0, faults=3, read_bytes=0)
    clock = [0]
    host = HostState(tmp_path, every_s=1.0, clock_ns=lambda: clock[0], host_wide=True, disks=tmp_path / "block")
    rank = HostState(tmp_path, every_s=1.0, clock_ns=lambda: clock[0])
    clock[0] = 5 * 10**8
    assert host.read() == []  # within a second of the last reading: nothing
    proc_tree(tmp_path, cpu_us=1_500_000, read_sectors=4096, io_ms=500, faults=5, read_bytes=2 * 2**20)
    clock[0] = 2 * 10**9
    readings = {metric: value for metric, value, attrs in host.read()}
    assert readings[sc.PRESSURE_CPU] == pytest.approx(0.25) and readings[sc.PRESSURE_IO] == 0.0
    assert sc.PRESSURE_MEMORY not in readings  # no such file on this "kernel": left out
    assert readings[sc.SYSTEM_MEMORY_UTIL] == pytest.approx(0.75)
    assert 0 <= readings[sc.PROCESS_CPU_UTIL] <= 1
    assert readings[sc.PROCESS_READ_BPS] == 2**20 and readings[sc.PROCESS_MAJOR_FAULTS] == 1.0
    assert readings[sc.DISK_READ_BPS] == 4096 * 512 / 2 and readings[sc.DISK_BUSY] == pytest.approx(0.25)
    assert readings[sc.MEMORY_DIRTY_BYTES] == 8 * 1024 and readings[sc.MEMORY_WRITEBACK_BYTES] == 2 * 1024
    theirs = {metric for metric, _, _ in rank.read()}
    assert sc.PROCESS_READ_BPS in theirs and not theirs & sc.HOST_WIDE_METRICS  # one rank per host reads those


def test_a_hosts_disk_readings_are_every_rank_of_the_hosts():
    s = 10**9
    steps = pd.DataFrame({"rank": [0, 1, 2], "step": [1, 1, 1], "end_ts": [2 * s] * 3, "duration_s": [1.0] * 3})
    samples = pd.DataFrame(
        {"rank": [0, 2], "ts": [int(1.5 * s)] * 2, "metric": [sc.DISK_BUSY] * 2, "value": [0.9, 0.1]}
    )
    ranks = pd.DataFrame({"rank": [0, 1, 2], "host": ["a", "a", "b"]})
    assert steptime.features(steps, samples, ranks)[sc.DISK_BUSY].tolist() == [0.9, 0.9, 0.1]


@pytest.mark.parametrize("hardware", [True, False])
def test_a_stragglers_slowdown_is_explained_by_its_gpus_state_or_said_to_lie_outside_it(fitted, hardware):
    fault = "thermal:rank=5,from=10" if hardware else f"straggler:rank=5,slowdown={THERMAL_SLOWDOWN:.3f},from=10"
    rank_steps, features, ranks = run([fault], 7)
    (finding,) = [f for f in stragglers.analyze(rank_steps, ranks) if f.kind == "rank"]
    explained = predicted.explain(finding, rank_steps, features, fitted)
    said, points = explained.evidence["explained"], explained.evidence["explained_points"]
    slower = 100 * (THERMAL_SLOWDOWN - 1)
    assert said["slower_percent"] == pytest.approx(slower, rel=0.1)
    if hardware:
        assert said["cause"] == "hardware" and said["hardware_points"] > 0.7 * slower
        assert f"state explains {points['compute']:.1f} of its" in explained.summary or (
            "power/thermal state explains" in explained.summary
        )
    else:
        assert said["cause"] == "outside the GPU" and said["hardware_points"] < 0.3 * slower
        assert "outside" in explained.summary
    assert explained.summary.startswith(finding.summary)


def test_an_untrusted_model_explains_nothing_and_finds_nothing(fitted):
    rank_steps, features, ranks = run(["thermal:rank=5,from=10"], 7)
    (finding,) = [f for f in stragglers.analyze(rank_steps, ranks) if f.kind == "rank"]
    worse = Fitted(fitted.model, {**fitted.figures, "ncpp": {**fitted.figures["ncpp"], "mape": 80.0}}, "median")
    assert not worse.trusted and "no prediction is drawn" in worse.verdict
    assert predicted.explain(finding, rank_steps, features, worse) == finding
    slow, features, _ = run(["slow-node:node=0,slowdown=1.4,from=20"], 9)
    assert (
        predicted.slower("sim-9", predicted.per_step(slow, predicted.predict(worse, features)), worse, SETTINGS) == []
    )


def test_the_whole_job_slower_than_predicted_is_a_finding_with_both_times(fitted):
    """Every rank (one host) computes 40% slower from step 20, its GPUs' state unchanged: no rank stands
    out from the others, but the model's prediction does."""
    rank_steps, features, _ = run(["slow-node:node=0,slowdown=1.4,from=20"], 9)
    (found,) = predicted.slower(
        "sim-9", predicted.per_step(rank_steps, predicted.predict(fitted, features)), fitted, SETTINGS
    )
    assert found.kind == predicted.SLOWER and found.step_start == 20 and found.step_end == 39
    ratio = found.evidence["measured_s"] / found.evidence["predicted_s"]
    assert ratio == pytest.approx(1.4, rel=0.1)
    assert f"{100 * (ratio - 1):.0f}% slower than its predicted step time since step 20" in found.summary
    clean, features, _ = run([], 9)
    assert (
        predicted.slower("sim-9", predicted.per_step(clean, predicted.predict(fitted, features)), fitted, SETTINGS)
        == []
    )


def test_attribution_on_seeded_runs_and_its_cost_at_a_thousand_ranks():
    """bench/attribution.py, small: half thermal throttling, half software stragglers, labelled."""
    result, _ = bench("attribution.py", "--runs", "6", "--ranks", "8", "--epochs", "20", "--cost-ranks", "1024")
    assert result["runs"] == 6 and result["accuracy"] >= 0.9
    # the bench's own figure is the claim (tens of ms); this, a bound on gross regressions that a machine running
    # twice as much as it has cores for still meets (0.77 s seen there against 0.5)
    assert result["features_s"] + result["predict_s"] < 2.0


@pytest.fixture(scope="module")
def live(tmp_path_factory, fitted) -> Path:
    """A store filled through `rankwatch collector --model FILE`: the conclusions drawn live."""
    directory = tmp_path_factory.mktemp("live")
    fitted.save(directory / "model.npz")
    return simulated_store(
        directory,
        {
            "live-thermal": ["thermal:rank=5,from=8"],
            "live-slow": ["slow-node:node=0,slowdown=1.4,from=10"],
            "live-capped": ["power-cap:rank=2,watts=300,from=8"],
        },
        ["--ranks", "8", "--steps", "30"],
        ("--model", str(directory / "model.npz"), "--analyze-every", "1"),
    )


def test_model_fit_and_analyze_model_through_the_cli(live, tmp_path):
    """`rankwatch model fit` judges NCPP on each stored run held out and saves it with its figures;
    `rankwatch analyze --model` says what the model is worth and, trusted or not, what it draws."""
    db, out = live, tmp_path / "model.npz"
    runs = ["--run", "live-thermal", "--run", "live-slow", "--run", "live-capped"]
    fitted = rankwatch_in_process("model", "fit", "--db", str(db), *runs, "--out", str(out), "--epochs", "5")
    assert fitted.returncode == 0, fitted.stderr
    assert "each run held out in turn" in fitted.stdout and f"saved {out}" in fitted.stdout
    model = Fitted.load(out)
    assert set(model.figures) == {"ncpp", "median", "ridge", "boosted trees", "analytic"}
    report = rankwatch_in_process("analyze", "live-thermal", "--db", str(db), "--model", str(out), "--json")
    assert report.returncode == 0, report.stderr
    prediction = json.loads(report.stdout)["prediction"]
    assert prediction["verdict"] == model.verdict and prediction["trusted"] == model.trusted
    assert sorted(r["rank"] for r in prediction["ranks"]) == list(range(8))

    too_few = rankwatch_in_process("model", "fit", "--db", str(db), "--run", "live-slow", "--out", str(out))
    assert too_few.returncode == 2 and "at least 3 runs" in too_few.stderr and too_few.stderr.count("\n") == 1
    (tmp_path / "not-a-model.npz").write_text("no")
    bad = rankwatch_in_process("analyze", "live-slow", "--db", str(db), "--model", str(tmp_path / "not-a-model.npz"))
    assert bad.returncode == 2 and "not a model saved by `rankwatch model fit`" in bad.stderr


def test_a_collector_given_a_model_explains_stragglers_and_finds_the_whole_job_slower_live(live):
    """The engine's passes explain the straggler and find the whole job slower than predicted; the
    collector said at its start what the model is worth."""
    db = live
    assert "step-time model" in (db.parent / "collector.log").read_text()
    assert "NCPP predicts held-out runs within 1.0% (MAPE" in (db.parent / "collector.log").read_text()
    rows = query(
        db,
        "SELECT run_id, analyzer, kind, ranks, step_start, summary, evidence FROM findings "
        "WHERE analyzer IN ('stragglers', 'predicted') AND severity != 'info' ORDER BY id",
    )
    thermal = [r for r in rows if r[0] == "live-thermal"]
    assert [(a, k, list(ranks)) for _, a, k, ranks, *_ in thermal] == [("stragglers", "rank", [5])], thermal
    evidence = json.loads(thermal[0][6])
    assert evidence["explained"]["cause"] == "hardware" and "(the hardware's)" in thermal[0][5]
    # per rank, measured and predicted: the slow rank's prediction is the highest, as its time is
    measured, expected = evidence["measured_s_by_rank"], evidence["predicted_s_by_rank"]
    assert sorted(measured, key=int) == [str(r) for r in range(8)]
    assert max(expected, key=expected.get) == max(measured, key=measured.get) == "5"
    slow = [r for r in rows if r[0] == "live-slow"]
    assert [(a, k) for _, a, k, *_ in slow] == [("predicted", predicted.SLOWER)], slow
    assert 10 <= slow[0][4] <= 16 and "slower than its predicted step time" in slow[0][5]
    # the model's view of each run, as advice: the median rank over time and every rank, measured
    # against predicted (what the dashboard draws)
    views = query(
        db,
        "SELECT run_id, evidence FROM findings WHERE analyzer = 'predicted' AND kind = ? ORDER BY run_id",
        [predicted.TRACKING],
    )
    assert [run for run, _ in views] == ["live-capped", "live-slow", "live-thermal"]
    for _, evidence in views:
        view = json.loads(evidence)
        assert len(view["measured_s_by_step"]) >= 20 and sorted(view["predicted_s_by_rank"], key=int) == [
            str(r) for r in range(8)
        ]
    over_time = json.loads(slow[0][6])
    ratios = [
        over_time["measured_s_by_step"][k] / over_time["predicted_s_by_step"][k]
        for k in over_time["measured_s_by_step"]
    ]
    assert len(ratios) >= 5 and all(r > 1.2 for r in ratios)


def test_the_dashboards_overview_shows_measured_against_predicted(live, monkeypatch):
    monkeypatch.setenv(DB_ENV, str(live))
    monkeypatch.delenv(COLLECTOR_ENV, raising=False)
    st.cache_resource.clear()
    st.cache_data.clear()
    at = AppTest.from_file(str(ROOT / "dashboard" / "app.py"), default_timeout=60)
    at.run()
    at.selectbox(key="run").set_value("live-slow")
    at.switch_page("views/overview.py").run()
    assert not at.exception, [e.value for e in at.exception]
    assert any("state predicts" in c.value for c in at.caption)
    said = [i.value for i in at.info]
    assert any("predicted / prediction" in t and "ms predicted from its state" in t for t in said), said
    assert not any("Power recommendations" in t for t in said)  # the model's view is no power advice
    # the median rank's compute over time, measured and predicted, in one chart
    drawn = [pa.ipc.open_stream(c.proto.datasets[0].data.data).read_pandas() for c in at.get("vega_lite_chart")]
    together = [d for d in drawn if "what" in d and d["what"].nunique() == 2]
    assert together, [list(d.columns) for d in drawn]
    named = sorted(together[0]["what"].unique())
    assert [n.lower().split()[0] for n in named] == ["measured", "predicted"], named
