"""Power-cap recommendations: the pure analyzer on small built frames (per-rank caps behind a
straggler, a job's limit picked from steps at several limits by each policy, headroom
arithmetic), the closed loop on the fleet simulator (caps recommended for a straggler run,
the run played again under them, the saving and slowdown measured within the predicted
range), `rankwatch power recommend` on a store filled through a real collector, and
`rankwatch power apply` sending caps through a collector's control API."""

import json
import re
import threading
import time

import numpy as np
import pandas as pd
import pytest
from PIL import Image

from collector import ranksets
from collector.analysis.analyzers import power
from collector.reports import queryapi
from rankwatch.agent import semconv as sc
from rankwatch.agent.apiclient import ApiClient
from rankwatch.agent.gpumodel import THERMAL, GpuModel, operating_points
from rankwatch.agent.simdevice import SimulatedDevice
from tests.support import loopback
from tests.support.collectors import free_port, simulated_store
from tests.support.commands import rankwatch_in_process
from tests.support.otlp_payloads import query
from tests.support.waits import wait_until
from tests.support.webhook_receiver import Receiver
from trainer import simulate
from trainer.faults import parse

pytestmark = pytest.mark.long

GPU = GpuModel()


def built(
    compute: np.ndarray, limits: np.ndarray | None = None, data_s: float = 0.02, transfer_s: float = 0.1
) -> pd.DataFrame:
    """Rank-steps of a synchronous job from its compute (steps x ranks, at full clock): each
    rank's compute stretched by its limit as the power model says, every rank waiting for the
    slowest, energy busy at full load and idle while waiting."""
    limits = np.full(compute.shape, GPU.limit_max_w) if limits is None else limits
    clock, busy_w, _ = operating_points(GPU, 1.0, limits)
    compute = compute * GPU.clock_max_mhz / clock
    step = (data_s + compute).max(axis=1, keepdims=True) + transfer_s
    rows = [
        {
            "run_id": "built",
            "rank": r,
            "step": t,
            "duration_s": step[t, 0],
            "data_s": data_s,
            "compute_s": compute[t, r],
            "comm_wait_s": step[t, 0] - data_s - compute[t, r],
            "energy_j": busy_w[t, r] * compute[t, r] + GPU.idle_w * (step[t, 0] - compute[t, r]),
            "power_limit_w": limits[t, r],
        }
        for t in range(compute.shape[0])
        for r in range(compute.shape[1])
    ]
    return pd.DataFrame(rows)


def straggler_compute(steps: int = 30, ranks: int = 6, slow: int = 2) -> np.ndarray:
    """0.6 s of compute with a little deterministic noise; rank `slow` 20% slower."""
    compute = 0.6 * (1 + 0.01 * np.sin(np.arange(steps * ranks).reshape(steps, ranks)))
    compute[:, slow] *= 1.2
    return compute


def test_ranks_waiting_for_a_straggler_get_lower_caps_and_the_straggler_none():
    report = power.analyze(built(straggler_compute()))
    per_rank = report.per_rank
    assert sorted(per_rank.caps) == [0, 1, 3, 4, 5]
    (kept,) = [c for c in per_rank.ranks if c.cap_w is None]
    assert kept.rank == 2 and kept.slack_s == pytest.approx(0.0, abs=1e-3)
    for c in per_rank.ranks:
        if c.cap_w is not None:  # clock = clock now * compute / (compute + safety * slack), cap = P(u, clock)
            clock = GPU.clock_max_mhz * c.compute_s / (c.compute_s + per_rank.safety * c.slack_s)
            assert c.cap_w == np.ceil(GPU.power(1.0, clock))
            assert GPU.limit_min_w <= c.cap_w < GPU.limit_max_w and c.saving_j_per_step > 0
    assert per_rank.saving_j_per_step > 0 and per_rank.saving_fraction > 0.1
    assert 1.0 <= per_rank.slowdown <= 1 + power.Settings().max_loss
    low, high = per_rank.saving_j_per_step_range
    assert low <= per_rank.saving_j_per_step <= high
    (finding,) = [f for f in report.findings if f.kind == "per_rank_caps"]
    assert (finding.analyzer, finding.ranks, finding.severity) == ("power", [0, 1, 3, 4, 5], "info")
    assert finding.evidence["kept"] == [2] and finding.evidence["caps"] == {str(r): w for r, w in per_rank.caps.items()}
    assert kept.kept_because == "slow"
    assert finding.summary.startswith("5 ranks wait for slower ones and can run under lower power limits (")
    assert "; rank 2 keeps its, the slow one the others wait for)" in finding.summary
    assert_readable(finding.summary)


def assert_readable(text: str) -> None:
    """No figure shown as zero with decimals, in scientific notation, as a range of one value, or
    a count of one in the plural."""
    assert not re.search(r"(?<![\d.])-?0\.0+(?!\d)", text), text
    assert not re.search(r"\de[+-]\d", text), text
    assert not re.search(r"(?<![\d.])(\d[\d.,]*)[-–]\1\b", text), text
    assert not re.search(r"(?<![\d.,])1 (ranks|nodes|steps|moments)\b", text), text


def test_the_ranks_of_a_slow_node_keep_their_limits_as_the_ones_the_others_wait_for():
    """A node computing 40% slower: its ranks wait only for the slowest among them, which is no
    slack to spend (the whole job waits for them); the other nodes' ranks get the caps."""
    topology = simulate.Topology(dp=24)
    frames = list(simulate.steps(topology, 30, [parse("slow-node:node=1,slowdown=1.4")], seed=3, start_ns=0))
    steps = pd.concat(frames, ignore_index=True).assign(run_id="sim")
    devices = pd.concat([simulate.device_samples(f) for f in frames], ignore_index=True)
    placement = topology.placement()
    slow = sorted(placement.loc[placement["host"] == 1, "rank"])
    per_rank = power.analyze(steps, devices, placement).per_rank
    assert sorted(per_rank.caps) == [r for r in range(24) if r not in slow]
    assert {c.rank: c.kept_because for c in per_rank.ranks if c.cap_w is None} == dict.fromkeys(slow, "slow")
    (finding,) = [f for f in power.analyze(steps, devices, placement).findings if f.kind == "per_rank_caps"]
    assert finding.summary.startswith(f"{24 - len(slow)} ranks wait for slower ones")
    assert f"; {ranksets.phrase(slow)} keep theirs, slow ones the others wait for)" in finding.summary


def test_a_rank_throttled_by_heat_keeps_its_limit_whatever_its_slack():
    """Rank 4 throttles for heat in most samples: a cap at its throttled draw would bind once it
    cooled, so it keeps its limit, like the straggler, while the others get theirs."""
    devices = pd.DataFrame(
        {"rank": 4, "ts": np.arange(10) * 10**9, "metric": sc.CLOCK_EVENT_REASONS, "value": float(THERMAL)}
    )
    per_rank = power.analyze(built(straggler_compute()), devices).per_rank
    assert sorted(per_rank.caps) == [0, 1, 3, 5]
    assert {c.rank for c in per_rank.ranks if c.cap_w is None} == {2, 4}


def test_a_job_without_slack_gets_no_per_rank_caps():
    report = power.analyze(built(0.6 * np.ones((20, 4))))
    assert report.per_rank.caps == {} and not [f for f in report.findings if f.kind == "per_rank_caps"]


def sweep(caps=(700, 600, 500, 400), steps_each: int = 10, ranks: int = 4) -> pd.DataFrame:
    """A job that ran under each limit in turn, the first two steps after each change slow (a warm-up)."""
    compute = 0.6 * np.ones((steps_each * len(caps), ranks))
    compute[[i * steps_each + k for i in range(len(caps)) for k in range(2)]] *= 3
    limits = np.repeat(np.array(caps, float), steps_each)[:, None] * np.ones(ranks)
    return built(compute, limits)


@pytest.mark.parametrize(
    ("policy", "cap"),
    [
        ("min-energy", 400),
        ("zeus:1", 400),
        ("zeus:0", 700),
        ("max-slowdown:0.02", 700),
        ("max-slowdown:0.15", 500),
        ("budget:2000", 500),
    ],
)
def test_policy_picks_from_the_measured_limits(policy, cap):
    report = power.analyze(sweep(), policy=power.Policy.parse(policy))
    assert [p.cap_w for p in report.curve] == [400, 500, 600, 700]
    assert {p.source for p in report.curve} == {"measured"} and {p.steps for p in report.curve} == {8}
    top = report.curve[-1]
    assert top.step_s == pytest.approx(0.72) and top.step_s_se == pytest.approx(0.0, abs=1e-12)  # warm-up left out
    assert report.job_cap.cap_w == cap
    assert [f.kind == "job_cap" for f in report.findings].count(True) == (cap < 700)


def test_zeus_cost_weighs_energy_against_time_at_full_power():
    report = power.analyze(sweep(), policy=power.Policy.parse("zeus:0.5"))
    costs = {p.cap_w: p.zeus_cost for p in report.curve}
    for p in report.curve:
        assert p.zeus_cost == pytest.approx(0.5 * p.energy_j + 0.5 * 4 * GPU.limit_max_w * p.step_s)
    assert report.job_cap.cap_w == min(costs, key=costs.get)


def test_a_budget_below_every_limit_picks_nothing():
    report = power.analyze(sweep(), policy=power.Policy.parse("budget:1000"))
    assert report.job_cap is None and not [f for f in report.findings if f.kind == "job_cap"]


def test_one_limit_only_gives_the_curve_the_power_model_predicts():
    report = power.analyze(built(straggler_compute()), policy=power.Policy.parse("min-energy"))
    assert {p.source for p in report.curve} == {"model"}
    assert [p.cap_w for p in report.curve] == list(np.arange(200.0, 701.0, 25.0))
    slowdowns = [p.slowdown for p in report.curve]
    assert slowdowns == sorted(slowdowns, reverse=True) and slowdowns[-1] == 1.0 and slowdowns[0] > 1.3
    assert report.job_cap.cap_w == 200


def power_samples(watts: np.ndarray, hosts: list[str]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Device samples, one per rank per second (watts: seconds x ranks), and the ranks' hosts."""
    seconds, ranks = watts.shape
    devices = pd.DataFrame(
        {
            "rank": np.tile(np.arange(ranks), seconds),
            "ts": np.repeat(np.arange(seconds) * 10**9 + 5 * 10**8, ranks),
            "metric": sc.POWER_INSTANT_W,
            "value": watts.ravel(),
        }
    )
    return devices, pd.DataFrame({"rank": range(ranks), "host": hosts})


def test_headroom_arithmetic():
    # 2 nodes of 2 GPUs drawing 250 W each, 350 W at the same 5 moments in 100: the job 1000 W, 1400 W at peak
    watts = np.full((100, 4), 250.0)
    watts[::20] = 350.0
    devices, ranks = power_samples(watts, ["a", "a", "b", "b"])
    steps = built(0.6 * np.ones((5, 4)))
    loose = power.analyze(steps, devices, ranks, facility_w=2800, settings=power.Settings(risk=0.1)).headroom
    assert (loose.nodes, loose.buckets, loose.job_p99_w, loose.job_peak_w) == (2, 100, 1000, 1400)
    assert (loose.node_p99_w, loose.node_peak_w, loose.node_nameplate_w) == (500, 700, 1400)
    # p90 1000 W: 3 more nodes, 2800 W at 5 moments of 100 -> 3500 W over 2800 W; peak 1400 W: 2 more
    assert (loose.extra_nodes, loose.risk, loose.extra_nodes_peak, loose.extra_nodes_nameplate) == (3, 0.05, 2, 0)
    assert loose.risk_by_extra_nodes == {0: 0.0, 1: 0.0, 2: 0.0, 3: 0.05, 4: 1.0}
    strict = power.analyze(steps, devices, ranks, facility_w=2800).headroom
    assert (strict.extra_nodes, strict.risk) == (2, 0.0)
    (finding,) = [f for f in power.analyze(steps, devices, ranks, facility_w=2800).findings if f.kind == "headroom"]
    assert finding.score == 2 and finding.evidence["node_p99_w"] == 700  # a node's own p99: its 5% at 350 W
    assert finding.summary == (
        "2 nodes draw 1.4 kW at p99 (peak 1.4 kW) against the facility's 2.8 kW: 2 more such nodes fit with 0% "
        "of moments over (by peak 2, by nameplate 0; 100 moments)"
    )
    unbudgeted = power.analyze(steps, devices, ranks)  # no budget given: no guess at one
    assert unbudgeted.headroom is None and not [f for f in unbudgeted.findings if f.kind == "headroom"]


def test_headroom_needs_power_samples():
    assert power.analyze(built(0.6 * np.ones((5, 4)))).headroom is None


TOPOLOGY = simulate.Topology(dp=64)
STRAGGLER = [parse("straggler:rank=9,slowdown=1.2")]


def simulated(seed: int, limits: np.ndarray | None = None) -> tuple[pd.DataFrame, pd.DataFrame]:
    frames = list(simulate.steps(TOPOLOGY, 50, STRAGGLER, seed=seed, start_ns=0, power_limits=limits))
    return (
        pd.concat(frames, ignore_index=True).assign(run_id="sim"),
        pd.concat([simulate.device_samples(f) for f in frames], ignore_index=True),
    )


def test_closed_loop_on_the_fleet_simulator():
    """Caps recommended on one run, the same scenario played again (other noise) under them: the
    energy saved and the slowdown measured fall within the predicted re-run ranges."""
    before, devices = simulated(seed=1)
    per_rank = power.analyze(before, devices, TOPOLOGY.placement()).per_rank
    assert 9 not in per_rank.caps and len(per_rank.caps) == 63
    limits = simulate.power_limits({str(r): w for r, w in per_rank.caps.items()}, TOPOLOGY.ranks)
    after, _ = simulated(seed=2, limits=limits)
    assert set(after.loc[after["rank"] != 9, "clock_event_reasons"]) == {0x4}  # sw_power_cap
    runs = {"before": before, "after": after}
    energy = {name: run.groupby("step")["energy_j"].sum().mean() for name, run in runs.items()}
    time_s = {name: run.groupby("step")["duration_s"].median().mean() for name, run in runs.items()}
    saving, slowdown = energy["before"] - energy["after"], time_s["after"] / time_s["before"]
    assert per_rank.saving_j_per_step_range[0] <= saving <= per_rank.saving_j_per_step_range[1]
    assert per_rank.slowdown_range[0] <= slowdown <= per_rank.slowdown_range[1]
    assert saving / energy["before"] > 0.05
    # the simulated GPU under a recommended cap runs compute as much slower as the analyzer planned
    rank = next(c for c in per_rank.ranks if c.cap_w is not None)
    device = SimulatedDevice(0)
    device.set_power_cap(rank.cap_w)
    assert device.compute_scale() == pytest.approx(rank.stretch)
    device.close()


def test_power_limit_faults_and_files():
    frame = next(
        simulate.steps(
            simulate.Topology(4),
            1,
            [parse("power-cap:watts=450,rank=1")],
            start_ns=0,
            power_limits=simulate.power_limits({"rank_caps": {"2": 100}}, 4),
        )
    )
    assert list(frame["power_limit_w"]) == [700, 450, 200, 700]  # 100 W clamped to the lowest limit, 200 W
    assert frame.loc[0, "compute_s"] * 1.2 < frame.loc[2, "compute_s"]
    for bad, message in (([1, 2], "JSON object"), ({"9": 300}, "ranks are 0..3"), ({"x": 300}, "not rank: watts")):
        with pytest.raises(ValueError, match=message):
            simulate.power_limits(bad, 4)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    sweep_specs = [f"power-cap:watts={w},from={10 * i},to={10 * (i + 1)}" for i, w in enumerate((700, 550, 400))]
    return simulated_store(
        tmp_path_factory.mktemp("power"),
        {
            "pw-straggler": ["straggler:rank=5,slowdown=1.2"],
            "pw-sweep": ["straggler:rank=5,slowdown=1.2", *sweep_specs],
        },
        ["--ranks", "16", "--steps", "30"],
    )


def recommend(db, run: str, *args: str) -> dict:
    result = rankwatch_in_process("power", "recommend", run, "--db", str(db), "--json", *args)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_recommend_json(store, tmp_path):
    plot = tmp_path / "curve.png"
    report = recommend(store, "pw-straggler", "--plot", str(plot), "--facility-watts", str(16 * 700))
    assert list(report) == [
        "run",
        "policy",
        "ranks",
        "steps",
        "curve",
        "job_cap",
        "per_rank",
        "headroom",
        "findings",
        "simulated",
        "rank_caps",
    ]
    assert report["simulated"] is True  # the fleet simulator's GPUs: every piece of advice says so
    assert all(
        f["summary"].startswith("simulated GPUs, not measured hardware: ") and f["evidence"]["simulated"]
        for f in report["findings"]
    )
    assert (report["run"], report["policy"], report["ranks"], report["steps"]) == (
        "pw-straggler",
        "max-slowdown:0.02",
        16,
        30,
    )
    assert set(report["curve"][0]) == {
        "cap_w",
        "source",
        "steps",
        "step_s",
        "step_s_se",
        "energy_j",
        "energy_j_se",
        "power_w",
        "slowdown",
        "energy_saving",
        "zeus_cost",
    }
    assert report["curve"][0]["source"] == "model"
    assert "5" not in report["rank_caps"] and len(report["rank_caps"]) == 15
    assert report["rank_caps"] == report["per_rank"]["caps"]
    assert report["per_rank"]["ranks"][0]["load"] == 1.0  # the busy samples' utilization
    assert report["headroom"]["nodes"] == 2 and report["headroom"]["facility_w"] == 16 * 700
    assert {f["kind"] for f in report["findings"]} == {"job_cap", "per_rank_caps", "headroom"}
    assert Image.open(plot).format == "PNG"
    # the document drives the simulator's caps directly
    caps = tmp_path / "caps.json"
    caps.write_text(json.dumps(report))
    result = rankwatch_in_process(
        "simulate", "--ranks", "16", "--steps", "2", "--out", str(tmp_path / "t.parquet"), "--power-caps", str(caps)
    )
    assert result.returncode == 0, result.stderr


def test_recommend_picks_from_a_sweep(store):
    report = recommend(store, "pw-sweep", "--policy", "budget:9000")
    assert [(p["cap_w"], p["source"], p["steps"]) for p in report["curve"]] == [
        (400, "measured", 8),
        (550, "measured", 8),
        (700, "measured", 8),
    ]
    assert report["job_cap"]["cap_w"] == 550  # 16 x 550 W within 9 kW, the fastest that is
    assert report["curve"][0]["slowdown"] > report["curve"][1]["slowdown"] > 1
    (finding,) = [f for f in report["findings"] if f["kind"] == "job_cap"]
    assert finding["evidence"]["throttle_reasons"]["sw_power_cap"] > 0


def test_recommend_table(store):
    # wide enough that no cell wraps
    result = rankwatch_in_process("power", "recommend", "pw-straggler", "--db", str(store), env={"COLUMNS": "500"})
    assert result.returncode == 0, result.stderr
    assert "time/energy trade-off" in result.stdout and "per-rank caps: 15 of 16 ranks" in result.stdout
    text = " ".join(result.stdout.split())
    assert "policy max-slowdown:0.02; simulated GPUs, not measured hardware" in text
    assert "15 ranks wait for slower ones" in text and "rank 5 keeps its, the slow one the others wait for" in text
    assert "more such node" not in text  # no facility budget given: no headroom
    for cell in re.findall(r"(?<![\w.])-?[\d.,]+ ?(?:k?W|k?J|Wh|kWh|m?s|%)(?![\w])", text):
        assert not re.fullmatch(r"-?0\.0+ ?\S+", cell), cell
    assert_readable(text)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["pw-straggler", "--policy", "fastest"], "unknown policy 'fastest'"),
        (["pw-straggler", "--policy", "zeus:2"], "eta is within 0..1"),
        (["pw-straggler", "--facility-watts", "0"], "--facility-watts: must be more than 0"),
        (["no-such-run"], "no steps for run 'no-such-run'"),
    ],
)
def test_recommend_errors_are_one_line(store, args, message):
    result = rankwatch_in_process("power", "recommend", *args, "--db", str(store))
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and message in result.stderr


def test_recommend_without_a_store_and_bad_caps_files(tmp_path):
    result = rankwatch_in_process("power", "recommend", "r", "--db", str(tmp_path / "none.duckdb"))
    assert result.returncode == 2 and "no store at" in result.stderr
    caps = tmp_path / "caps.json"
    for text, message in (("{", "--power-caps"), ('{"99": 300}', "ranks are 0..15")):
        caps.write_text(text)
        result = rankwatch_in_process(
            "simulate", "--ranks", "16", "--steps", "2", "--out", str(tmp_path / "t.parquet"), "--power-caps", str(caps)
        )
        assert result.returncode == 2 and result.stderr.count("\n") == 1 and message in result.stderr


def test_power_apply_sends_a_pending_power_cap(collector, tmp_path):
    caps = tmp_path / "caps.json"
    caps.write_text(json.dumps({"run": "pw-live", "rank_caps": {"1": 512.0, "2": 498.0}}))  # a recommend document
    env = {"RANKWATCH_TOKEN": collector.token}

    def apply(*args: str, run: str = "pw-live"):
        return rankwatch_in_process("power", "apply", run, *args, "--collector", collector.url, env=env)

    sent = rankwatch_in_process(
        "simulate", "--ranks", "4", "--steps", "3", "--run", "pw-live", "--collector", collector.url, env=env
    )
    assert sent.returncode == 0, sent.stderr
    api = ApiClient(collector.url, collector.token)
    wait_until(
        lambda: (
            queryapi.remote_query(
                api,
                "SELECT count(DISTINCT rank) FROM device_samples WHERE run_id = 'pw-live' AND metric = ?",
                [sc.POWER_LIMIT_MAX_W],
            )["rows"]
            == [[4]]
        ),
        "the run's power-limit range in the store",
    )

    result = apply("--caps", str(caps), "--watts", "650")
    assert result.returncode == 0, result.stderr
    assert "2 ranks capped, the others at 650 W" in result.stdout
    (command,) = loopback.get(
        f"{collector.url}/v1/commands", params={"run_id": "pw-live"}, headers=collector.headers, timeout=10
    ).json()
    assert (command["kind"], command["state"], command["created_by"]) == ("power_cap", "pending", "api")
    assert command["args"] == {"caps": {"1": 512.0, "2": 498.0}, "watts": 650.0}
    caps.write_text('{"x": 300}')
    for args, message in (
        (("--caps", str(caps)), "a power_cap takes caps"),
        ((), "give --caps FILE.json, --watts W"),
        (("--watts", "-5"), "--watts: must be more than 0"),
        (("--watts", "5000"), "5000 W for every other rank is outside the 200-700 W"),
        (("--watts", "100"), "100 W for every other rank is outside"),
    ):
        result = apply(*args)
        assert result.returncode == 2 and result.stderr.count("\n") == 1 and message in result.stderr
    caps.write_text('{"7": 300}')
    result = apply("--caps", str(caps))
    assert result.returncode == 2 and "run pw-live has no rank 7 (its ranks: 0–3)" in result.stderr
    caps.write_text('{"1": 900}')
    assert "900 W for rank 1 is outside the 200-700 W" in apply("--caps", str(caps)).stderr
    result = apply("--watts", "300", run="no-such-run")
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and "knows no run 'no-such-run'" in result.stderr


def test_the_collector_draws_power_recommendations_live_and_alerts_on_them(tmp_path):
    """A straggling fleet sent to a collector that redraws power findings every 0.5 s: the per-rank caps
    leave the straggler alone, and the receiver that wants power alerts gets one linking to the Power page."""
    receiver = Receiver(free_port()).start()
    alerts = tmp_path / "alerts.toml"
    alerts.write_text(f'[[receivers]]\nurl = "{receiver.url}"\nanalyzers = ["power"]\n')
    deliveries = []
    try:
        db = simulated_store(
            tmp_path,
            {"pw-live": ["straggler:rank=5,slowdown=1.2"]},
            ["--ranks", "16", "--steps", "30"],  # the store's straggler run: its 15 caps (test_recommend_json)
            ("--analyze-every", "0.5", "--power-every", "0.5", "--alerts", str(alerts)),
            until=lambda: deliveries.extend(receiver.wait_for(1, 60)),
        )
        (delivery, *_) = deliveries
    finally:
        receiver.stop()
    firing = dict(
        query(
            db,
            """SELECT kind, ranks FROM findings
                               WHERE run_id = 'pw-live' AND analyzer = 'power' AND state = 'firing'""",
        )
    )
    assert sorted(firing["per_rank_caps"]) == [r for r in range(16) if r != 5]
    assert "headroom" not in firing  # the collector is given no facility budget
    alert = delivery.body["alerts"][0]
    assert alert["labels"]["alertname"] == "RankwatchPowerRecommendation" and alert["labels"]["run"] == "pw-live"
    assert alert["annotations"]["summary"].startswith("simulated GPUs, not measured hardware: ")
    assert alert["annotations"]["dashboard"].startswith("http://127.0.0.1:8501/power?run=pw-live&finding=")


def test_live_power_reports_are_drawn_off_the_writer_thread(store, tmp_path, monkeypatch):
    """The writer's analysis pass only starts the power report (a bootstrap over the ranks, seconds
    at a thousand ranks) on the power thread; a later pass records its findings."""
    from collector.analysis import live as analysis
    from collector.reports import powercaps
    from collector.store.db import connect

    db = tmp_path / "copy.duckdb"
    db.write_bytes(store.read_bytes())
    drawn_on, draw = [], powercaps.recommend

    def recommend(*args, **kwargs):
        drawn_on.append(threading.current_thread().name)
        return draw(*args, **kwargs)

    monkeypatch.setattr(powercaps, "recommend", recommend)
    con = connect(db)
    con.execute("DELETE FROM findings WHERE analyzer = 'power'")  # those its collector drew
    live = analysis.Analysis(power_report=powercaps.live_report, power_every_s=60)
    try:
        live.touched(["pw-straggler"], steps=True)
        live.run(con)
        deadline = time.monotonic() + 60
        while not drawn_on and time.monotonic() < deadline:
            time.sleep(0.05)
        live.run(con)  # records it, once drawn
        while not con.execute("SELECT count(*) FROM findings WHERE analyzer = 'power'").fetchone()[0]:
            assert time.monotonic() < deadline, "no power findings were recorded"
            time.sleep(0.1)
            live.run(con)
    finally:
        live.close()
    assert drawn_on == ["rankwatch-power_0"]  # once: a report is not redrawn before power_every_s
    kinds = {
        k
        for (k,) in con.execute(
            "SELECT kind FROM findings WHERE analyzer = 'power' AND run_id = 'pw-straggler' AND state = 'firing'"
        ).fetchall()
    }
    assert kinds == {"job_cap", "per_rank_caps"}
    assert not live.failures, live.failures
    con.close()


def test_the_collector_refuses_a_negative_power_period():
    result = rankwatch_in_process("collector", "--power-every", "-1")
    assert (result.returncode, result.stderr.strip()) == (
        2,
        ("rankwatch collector: error: argument --power-every: must be 0 or more, got -1"),
    )
