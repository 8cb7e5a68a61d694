"""Node health: the fleet analyzer names a node whose metrics drift away from its peers' for several windows, with
the metrics that set it apart, and not one spike, nor every node shifting together (that is the job's
regression, which it names instead), nor a job of too few nodes to compare; the simulator's wearing nodes;
`rankwatch nodes` and the query API's drain list of a store the simulator filled through a real collector; the
bench on a small size."""

import json

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from collector.analysis.analyzers import Frames, fleet
from rankwatch.agent import semconv as sc
from rankwatch.agent.export import Exporter
from tests.support import loopback
from tests.support.collectors import Collector, free_port
from tests.support.commands import bench, rankwatch_in_process
from tests.support.waits import wait_until
from trainer import simulate
from trainer.faults import parse

pytestmark = pytest.mark.long  # a real collector judging a simulated job, and the bench

WINDOW_NS = int(fleet.Settings().window_s * 1e9)
T0 = 1_000 * WINDOW_NS  # the first step starts a window
RANKS_PER_NODE = 2
STEPS = 200  # of the simulated job: 0.7 s each, five 30 s windows


def job(nodes: int, steps: int, compute=lambda node, step: 1.0) -> tuple[pd.DataFrame, pd.DataFrame]:
    """1 s steps of `nodes` nodes of 2 ranks: the rank-steps (compute: `compute(node, step)` x 0.8 s, with 1%
    jitter) and the placement."""
    noise = np.random.default_rng(7)
    rows = []
    for step in range(steps):
        for rank in range(nodes * RANKS_PER_NODE):
            work = 0.8 * compute(rank // RANKS_PER_NODE, step) * noise.lognormal(0, 0.01)
            rows.append((rank, step, T0 + (step + 1) * 10**9, 1.0, 0.01, work, 0.19, 3.0, 1.0, False))
    columns = ["rank", "step", "end_ts", "duration_s", "data_s", "compute_s", "comm_wait_s", "loss", "grad_norm"]
    steps_frame = pd.DataFrame(rows, columns=[*columns, "non_finite"])
    steps_frame["duration_s"] = steps_frame.groupby("step")["compute_s"].transform("max") + 0.2  # all wait for all
    ranks = pd.DataFrame({"rank": range(nodes * RANKS_PER_NODE)})
    return steps_frame, ranks.assign(host=[f"node-{r // RANKS_PER_NODE}" for r in ranks["rank"]], pp_stage=0)


def temperatures(ranks: int, steps: int, of=lambda rank, step: 0.0) -> list[tuple]:
    """A GPU temperature sample per rank and step: 60 C with 0.5 C of noise, plus `of(rank, step)`."""
    noise = np.random.default_rng(11)
    return [
        (rank, T0 + step * 10**9 + 5 * 10**8, sc.GPU_TEMP_C, 60.0 + noise.normal(0, 0.5) + of(rank, step))
        for step in range(steps)
        for rank in range(ranks)
    ]


def replays(ranks: int, steps: int, of=lambda rank, step: 0) -> list[tuple]:
    """Each GPU's PCIe replay counter every 10 steps (10 s, as the agent reads it), gaining `of(rank, step)`
    each step."""
    rows = []
    for rank in range(ranks):
        count = 0
        for step in range(steps):
            count += of(rank, step)
            if step % 10 == 0:
                rows.append((rank, T0 + step * 10**9, sc.PCIE_REPLAY_COUNTER, float(count)))
    return rows


def judged(steps: pd.DataFrame, ranks: pd.DataFrame, samples: list[tuple], every: int = 5) -> list:
    """The fleet analyzer's findings over a run, judged in passes of `every` steps as a live collector does,
    its device samples read by time as the engine reads them."""
    devices = pd.DataFrame(samples, columns=["rank", "ts", "metric", "value"])
    kept: dict = {}

    def node_samples(since: int, until: int, slice_ns: int, metrics: list[str]) -> pd.DataFrame:
        return devices[devices["ts"].between(since, until) & devices["metric"].isin(metrics)]

    found = []
    for last in range(every - 1, int(steps["step"].max()) + 1, every):
        frames = Frames(
            "fleet-test",
            steps[steps["step"] <= last],
            last - every + 1,
            last,
            ranks,
            0,
            node_samples=node_samples,
            kept=kept,
        )
        found += fleet.judge(frames)
    return found


def kinds(found: list) -> set:
    return {(f.kind, tuple(f.ranks)) for f in found}


def test_a_node_drifting_from_its_peers_is_named_with_the_metric_then_critical_once_it_straggles():
    """Node 3's first GPU warms up 0.3 C a step from step 40 (a failing fan), and from step 180 the node computes
    20% slower: it is named once it stood apart for three windows, hotter than the median node, before it
    slows; critical once it also straggles."""
    steps, ranks = job(5, 240, compute=lambda node, step: 1.2 if node == 3 and step >= 180 else 1.0)
    hot = temperatures(10, 240, of=lambda rank, step: 0.3 * max(step - 40, 0) if rank == 6 else 0.0)
    found = [f for f in judged(steps, ranks, hot) if f.kind == fleet.UNHEALTHY]
    assert {tuple(f.ranks) for f in found} == {(6, 7)}
    first = found[0]
    assert first.step_end < 180 and first.severity == "warning"
    assert first.evidence["host"] == "node-3" and first.evidence["peers"] == 4
    (driving, *_) = first.evidence["metrics"]
    assert driving["metric"] == sc.GPU_TEMP_C and driving["value"] > driving["peers"] + 9
    assert "GPU temperature" in first.summary and "drain it" in first.summary
    assert first.evidence["what_to_do"].startswith("drain node-3 and have its cooling")
    assert found[-1].severity == "critical" and found[-1].evidence["straggler"]
    assert "compute" in {m["metric"] for m in found[-1].evidence["metrics"]}


def test_errors_that_keep_rising_make_it_critical():
    """Node 1's first GPU replays 5% more PCIe transfers every step (a link wearing out, faster and faster)."""
    steps, ranks = job(4, 160)
    rising = replays(8, 160, of=lambda rank, step: int(1.05**step) if rank == 2 else 0)
    found = [f for f in judged(steps, ranks, temperatures(8, 160) + rising) if f.kind == fleet.UNHEALTHY]
    assert found and {tuple(f.ranks) for f in found} == {(2, 3)}
    (driving, *_) = found[-1].evidence["metrics"]
    assert (driving["metric"], driving["unit"], driving["peers"]) == (sc.PCIE_REPLAY_COUNTER, "per_min", 0.0)
    assert found[-1].severity == "critical" and found[-1].evidence["rising"] == [sc.PCIE_REPLAY_COUNTER]


def test_a_one_off_spike_names_no_node():
    """A burst of 5,000 PCIe replays on node 2's GPU once, and a GPU 40 C hotter for one sample: one window each."""
    steps, ranks = job(5, 200)
    hot = temperatures(10, 200, of=lambda rank, step: 40.0 if (rank, step) == (5, 90) else 0.0)
    burst = replays(10, 200, of=lambda rank, step: 5000 if (rank, step) == (4, 100) else 0)
    assert judged(steps, ranks, hot + burst) == []


def test_every_node_shifting_together_names_no_node_but_the_jobs_regression():
    """From step 120 every GPU runs 10 C hotter and every rank computes 25% slower: no node stands apart, the
    job's step time rose against its own history."""
    steps, ranks = job(5, 320, compute=lambda node, step: 1.25 if step >= 120 else 1.0)
    warmer = temperatures(10, 320, of=lambda rank, step: 10.0 if step >= 120 else 0.0)
    found = judged(steps, ranks, warmer)
    assert kinds(found) == {(fleet.JOB_SLOWDOWN, ())}
    regression = found[0]
    assert abs(regression.step_start - 120) <= 30 and regression.evidence["slowdown"] == pytest.approx(1.2, abs=0.05)
    assert regression.summary.startswith(f"every rank slowed together since step {regression.step_start}")


def test_one_slow_node_is_no_regression_of_the_job():
    """Node 0 computing 50% slower holds every rank up, but the rise is its alone: no job-wide regression (the
    straggler analyzer names the node), and no device metric sets it apart."""
    steps, ranks = job(5, 320, compute=lambda node, step: 1.5 if node == 0 and step >= 120 else 1.0)
    assert judged(steps, ranks, temperatures(10, 320)) == []


def test_too_few_nodes_to_compare_name_none():
    steps, ranks = job(3, 200)
    hot = temperatures(6, 200, of=lambda rank, step: 0.3 * max(step - 40, 0) if rank == 2 else 0.0)
    assert fleet.Settings().min_nodes == 4
    assert judged(steps, ranks, hot) == []


def test_a_wearing_node_drifts_then_slows_and_the_healthy_draws_stay_the_same():
    """The simulator's wear: a node's first GPU replays more and more PCIe transfers from `from`, its ranks
    compute 1.3x from `fail`; readings every 10 s of simulated time; the timing draws those of a clean run."""
    topology = simulate.Topology(dp=32)
    spec = "pcie-replays:node=2,from=20,fail=120"
    clean, _, _ = simulate.tables(topology, 150, [], seed=3)
    worn, samples, _ = simulate.tables(topology, 150, [parse(spec)], seed=3)
    before = worn["step"] < 120
    assert np.array_equal(worn.loc[before, "compute_s"], clean.loc[before, "compute_s"])
    node = worn["rank"].between(16, 23) & ~before
    assert np.allclose(worn.loc[node, "compute_s"], clean.loc[node, "compute_s"] * 1.3)
    counter = samples[samples["metric"] == sc.PCIE_REPLAY_COUNTER].groupby("rank")["value"].max()
    assert counter[16] > 100 and counter.drop(16).max() <= 3
    readings = samples[(samples["metric"] == sc.PCIE_REPLAY_COUNTER) & (samples["rank"] == 16)]["ts"]
    assert np.diff(readings.to_numpy()).min() >= 10 * 10**9
    ports = samples[samples["metric"] == sc.IB_LINK_DOWNED]
    assert set(ports["rank"]) == {0, 8, 16, 24} and set(ports["port"]) == {"mlx5_0/1", "mlx5_1/1"}


@pytest.mark.parametrize(
    ("spec", "error"),
    [
        ("hot-gpu:node=1,from=50,fail=20", "fail must come after from"),
        ("ib-flap:from=5", "ib-flap needs node"),
        ("pcie-width:node=1,slowdown=0.5", "slowdown must be at least 1"),
    ],
)
def test_the_wear_grammar_refuses_what_cannot_be(spec, error):
    with pytest.raises(ValueError, match=error):
        parse(spec, simulate.SIMULATOR_KINDS)


RUN, WORN, WORN_RANKS = "worn-node", "sim-node-0002", [4, 5]
KEYS = ["host", "ranks", "state", "since_step", "score", "metrics"]


@pytest.fixture(scope="module")
def drained(tmp_path_factory):
    """A store the fleet simulator filled through a real collector (its exporter, as `rankwatch simulate` sends):
    10 ranks on 5 nodes of 2, node 2's PCIe link trained down from step 5 (x8 at times), to x4 at step 60
    where its ranks slow down; what the query API and `rankwatch nodes` answer once the collector judged every
    step, and `rankwatch nodes` on the store once it stopped."""
    directory = tmp_path_factory.mktemp("fleet")
    db = directory / "rankwatch.duckdb"
    answers: dict = {}
    with open(directory / "collector.log", "w") as log:
        collector = Collector(db, free_port(), "test-token-0123456", extra_args=("--analyze-every", "1"), log=log)
        collector.start()
        try:
            topology = simulate.Topology(dp=10, ranks_per_host=2)
            faults = [parse("pcie-width:node=2,from=5,fail=60", simulate.SIMULATOR_KINDS)]
            exporter = Exporter(collector.url, collector.token, {sc.RUN_ID: RUN}, paced=True, senders=4)
            simulate.to_collector(exporter, RUN, topology, simulate.steps(topology, STEPS, faults), faults)
            assert exporter.flush()
            exporter.shutdown()
            with loopback.Client(base_url=collector.url, headers=collector.headers, timeout=30) as http:

                def judged_to() -> int:
                    sql = "SELECT max(step) FROM analysis_cursors WHERE run_id = ?"
                    return http.post("/api/v1/query", json={"sql": sql, "params": [RUN]}).json()["rows"][0][0] or 0

                wait_until(lambda: judged_to() >= STEPS - 1, "the collector did not judge every step", 120)
                answers["drain"] = http.get(f"/v1/runs/{RUN}/nodes", params={"unhealthy": "1"})
                answers["all"] = http.get(f"/v1/runs/{RUN}/nodes")
                answers["unknown"] = http.get("/v1/runs/no-such-run/nodes")
                answers["bad"] = http.get(f"/v1/runs/{RUN}/nodes", params={"unhealthy": "maybe"})
                answers["anonymous"] = loopback.get(f"{collector.url}/v1/runs/{RUN}/nodes")
            env = {"RANKWATCH_TOKEN": collector.token}
            answers["cli"] = rankwatch_in_process(
                "nodes", RUN, "--unhealthy", "--json", "--collector", collector.url, env=env
            )
        finally:
            collector.stop()
    answers["store"] = rankwatch_in_process("nodes", RUN, "--unhealthy", "--json", "--db", str(db))
    answers["table"] = rankwatch_in_process("nodes", RUN, "--db", str(db))
    answers["missing"] = rankwatch_in_process("nodes", "no-such-run", "--db", str(db))
    return answers


def test_the_drain_list_names_the_worn_node_with_what_sets_it_apart(drained):
    result = drained["store"]
    assert result.returncode == 0, result.stderr
    listed = json.loads(result.stdout)
    assert listed["run"] == RUN
    (node,) = listed["nodes"]
    assert list(node) == KEYS
    assert (node["host"], node["ranks"], node["state"]) == (WORN, WORN_RANKS, "critical")  # it straggles
    assert node["since_step"] < STEPS and node["score"] >= fleet.Settings().z
    width = next(m for m in node["metrics"] if m["metric"] == sc.PCIE_LINK_WIDTH)
    assert width["value"] < width["peers"] == 16 and width["family"] == "pcie_link"


def test_a_running_collector_answers_the_same_through_the_cli_and_its_query_api(drained):
    assert drained["cli"].returncode == 0, drained["cli"].stderr
    assert drained["drain"].status_code == 200
    told = [json.loads(drained["cli"].stdout), drained["drain"].json(), json.loads(drained["store"].stdout)]

    assert told[0] == told[1] == told[2]
    every = drained["all"].json()["nodes"]
    assert [n["host"] for n in every] == [WORN, *(f"sim-node-{h:04d}" for h in (0, 1, 3, 4))]
    assert [n["state"] for n in every[1:]] == ["healthy"] * 4 and all(n["metrics"] == [] for n in every[1:])


def test_the_query_api_refuses_what_it_cannot_answer(drained):
    assert drained["unknown"].status_code == 404 and "no-such-run" in drained["unknown"].json()["error"]
    assert drained["bad"].status_code == 400 and "unhealthy takes 1 or 0" in drained["bad"].json()["error"]
    assert drained["anonymous"].status_code == 401


def test_the_table_lists_every_node_and_an_unknown_run_is_a_usage_error(drained):
    table = drained["table"]
    assert table.returncode == 0, table.stderr
    assert WORN in table.stdout and "PCIe link width" in table.stdout and table.stdout.count("healthy") == 4
    assert drained["missing"].returncode == 2 and "no run 'no-such-run'" in drained["missing"].stderr


def test_the_bench_prints_its_figures():
    figures, printed = bench("fleet_health.py", "--runs", "2", "--clean", "1", "--job-wide", "1", "--ranks", "32")
    assert {"precision", "recall", "median_lead_steps", "false_per_10k", "job_recall"} <= set(figures)
    assert figures["runs"] == 2 and figures["nodes"] == 4 and "worn nodes" in printed
    assert 0 <= figures["recall"] <= 1 and figures["false_per_10k"] >= 0


@settings(max_examples=200, deadline=None)
@given(
    rows=st.lists(
        st.tuples(st.integers(0, 5), st.one_of(st.floats(-1e6, 1e6), st.just(float("nan")))), min_size=1, max_size=60
    )
)
def test_a_groups_median_is_pandas_median_with_nan_skipped(rows):
    """The fleet analyzer's grouped median (numpy, by sorting: it runs at every pass) is pandas' groupby median:
    NaN skipped, a group of NaN alone NaN, an even count the mean of its middle two."""
    groups, values = np.array([g for g, _ in rows]), np.array([v for _, v in rows])
    expected = pd.Series(values).groupby(groups).median().reindex(range(6))
    np.testing.assert_allclose(fleet._medians(groups, values, 6), expected.to_numpy(), rtol=1e-12, equal_nan=True)
