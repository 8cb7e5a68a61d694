"""Telemetry lost on the way is counted and shown: simulated runs sent through the agent's real exporter
to a real collector, some ranks' step spans held back for a stretch of steps, and `telemetry_loss` events
sent as the agents send them. The collector records the rank-steps it never got; /metrics, `rankwatch
analyze` (text and JSON) and the dashboard's Overview say so; runs that lost nothing, or whose newest
steps are still on the way, show no loss."""

import json
import signal
import time
from pathlib import Path

import pytest
import requests
import streamlit as st
from streamlit.testing.v1 import AppTest

from rankwatch.agent import semconv as sc
from rankwatch.agent.export import Exporter
from tests.support.collectors import Collector, free_port
from tests.support.commands import rankwatch_in_process
from tests.support.paths import ROOT
from tests.support.waits import wait_until
from trainer import simulate

pytestmark = pytest.mark.long  # a real collector and its analysis passes

APP = ROOT / "dashboard" / "app.py"

LOSSY = {"run": "lossy", "ranks": 32, "steps": 40, "lost": range(24, 32), "from": 12, "also": (3, 5)}
ARRIVING = {"run": "arriving", "ranks": 16, "steps": 30}  # its newest steps half-arrived, the run going on
CLEAN = {"run": "clean", "ranks": 8, "steps": 20}
DROPPED = {24: (30, 40), 25: (7,)}  # rank -> cumulative rank-steps its agent reported dropped, in order


class Holding:
    """The agent's exporter with the step spans that `held(rank, step)` names never sent: what a rank
    whose agent dropped them leaves. Device samples are not sent (a request per step, not under test)."""

    def __init__(self, exporter: Exporter, held):
        self._exporter, self._held = exporter, held

    def trace(self, spans, resource):
        rank, step = resource.attributes[sc.RANK], spans[0][3][sc.STEP]
        if not self._held(rank, step):
            self._exporter.trace(spans, resource=resource)

    def samples(self, points) -> bool:
        return True

    def __getattr__(self, name):
        return getattr(self._exporter, name)


def send(collector: Collector, spec: dict, held=lambda rank, step: False, ended: bool = True) -> None:
    exporter = Exporter(collector.url, collector.token, {sc.RUN_ID: spec["run"]})
    topology = simulate.Topology(spec["ranks"])
    frames = list(simulate.steps(topology, spec["steps"], []))
    simulate.to_collector(Holding(exporter, held), spec["run"], topology, frames, [])
    if ended:  # after the last step (simulated time runs ahead of the wall clock)
        for rank in range(spec["ranks"]):
            exporter.event(sc.EVENT_ENDED, int(frames[-1]["end_ns"].max()) + 1, {sc.RANK: rank})
    assert exporter.flush()
    exporter.shutdown()


def report_drops(collector: Collector, run: str) -> None:
    """Each rank's agent reports its cumulative drops on its own resource, as they grow."""
    for rank, counts in DROPPED.items():
        exporter = Exporter(collector.url, collector.token, {sc.RUN_ID: run, sc.RANK: rank})
        for n in counts:
            exporter.event(sc.EVENT_TELEMETRY_LOSS, time.time_ns(), {sc.SPANS_DROPPED: 3 * n, sc.RANK_STEPS_DROPPED: n})
        assert exporter.flush()
        exporter.shutdown()


def lost(rank: int, step: int) -> bool:
    return (rank in LOSSY["lost"] and step >= LOSSY["from"]) or (rank, step) == LOSSY["also"]


MISSING = len(LOSSY["lost"]) * (LOSSY["steps"] - LOSSY["from"]) + 1
EXPECTED = LOSSY["ranks"] * LOSSY["steps"]
AGENT_STEPS = sum(max(c) for c in DROPPED.values())


def metric(text: str, name: str, run: str) -> float | None:
    prefix = f'{name}{{run="{run}"}} '
    return next((float(line[len(prefix) :]) for line in text.splitlines() if line.startswith(prefix)), None)


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> dict:
    """The three runs sent to a collector that analyses every second; /metrics read while it runs."""
    directory = tmp_path_factory.mktemp("loss")
    with open(directory / "collector.log", "w") as log:
        collector = Collector(
            directory / "rankwatch.duckdb", free_port(), "test-token-0123456", ("--analyze-every", "1"), log=log
        ).start()
        try:
            send(collector, LOSSY, lost)
            report_drops(collector, LOSSY["run"])
            send(collector, CLEAN)
            newest = ARRIVING["steps"] - 3
            send(collector, ARRIVING, lambda rank, step: rank >= ARRIVING["ranks"] // 2 and step >= newest, ended=False)
            scraped = {}

            def counted() -> bool:
                text = requests.get(f"{collector.url}/metrics", timeout=10).text
                scraped.update(
                    (run, metric(text, "rankwatch_run_rank_steps_missing", run))
                    for run in (LOSSY["run"], CLEAN["run"], ARRIVING["run"])
                )
                scraped["agent_rank_steps"] = metric(text, "rankwatch_run_agent_rank_steps_dropped", LOSSY["run"])
                scraped["agent_spans"] = metric(text, "rankwatch_run_agent_spans_dropped", LOSSY["run"])
                return (
                    scraped[LOSSY["run"]] == MISSING
                    and scraped["agent_rank_steps"] == AGENT_STEPS  # both ranks' reports read, not the first alone
                    and scraped[ARRIVING["run"]] is not None
                )

            wait_until(counted, "/metrics counting the lost rank-steps", timeout_s=90)
        finally:
            collector.stop()
    return {"db": directory / "rankwatch.duckdb", "metrics": scraped}


def test_metrics_count_the_lost_rank_steps_and_no_others(store):
    scraped = store["metrics"]
    assert scraped[LOSSY["run"]] == MISSING
    assert scraped["agent_spans"] == 3 * AGENT_STEPS
    assert scraped[CLEAN["run"]] == 0, "a run that lost nothing shows no loss"
    assert scraped[ARRIVING["run"]] == 0, "steps still arriving from some ranks are not counted lost"


def test_the_store_records_where_rank_steps_went_missing(store):
    import duckdb

    with duckdb.connect(str(store["db"]), read_only=True) as con:
        rows = {
            run: (expected, missing, json.loads(gaps))
            for run, expected, missing, gaps in con.execute(
                "SELECT run_id, expected, missing, gaps FROM telemetry_loss"
            ).fetchall()
        }
        reported = con.execute(
            "SELECT agent_spans_dropped, agent_rank_steps_dropped FROM telemetry_loss WHERE run_id = ?", [LOSSY["run"]]
        ).fetchall()
    assert reported == [(3 * AGENT_STEPS, AGENT_STEPS)], "each rank's largest cumulative count, summed"
    expected, missing, gaps = rows[LOSSY["run"]]
    assert (expected, missing) == (EXPECTED, MISSING)
    last = LOSSY["steps"] - 1
    assert sorted(gaps) == sorted([[24, 31, LOSSY["from"], last, MISSING - 1], [3, 3, 5, 5, 1]]), gaps
    assert rows[CLEAN["run"]][1] == 0


def test_analyze_says_what_was_lost_and_that_it_judged_partial_data(store):
    text = rankwatch_in_process("analyze", LOSSY["run"], "--db", str(store["db"]))
    assert text.returncode == 0, text.stderr
    line = " ".join(text.stdout.split())
    share = 100 * MISSING / EXPECTED
    assert (
        f"telemetry lost: {MISSING:,} of {EXPECTED:,} rank-steps ({share:.1f}%) never arrived; "
        f"ranks 24–31 from step {LOSSY['from']}; rank 3 step 5" in line
    ), text.stdout
    assert f"agents dropped {3 * AGENT_STEPS:,} spans ({AGENT_STEPS:,} rank-steps)" in line
    assert "partial data" in line
    as_json = json.loads(rankwatch_in_process("analyze", LOSSY["run"], "--db", str(store["db"]), "--json").stdout)
    loss = as_json["telemetry_loss"]
    assert (loss["rank_steps_missing"], loss["rank_steps_expected"]) == (MISSING, EXPECTED)
    assert loss["partial_data"] and loss["agent_rank_steps_dropped"] == AGENT_STEPS
    block = {"first_rank": 24, "last_rank": 31, "first_step": LOSSY["from"], "rank_steps": MISSING - 1}
    assert any(block.items() <= gap.items() for gap in loss["gaps"]), loss["gaps"]
    assert not any(f["analyzer"] == "hangs" for f in as_json["findings"]), "lost telemetry is no hang"
    clean = json.loads(rankwatch_in_process("analyze", CLEAN["run"], "--db", str(store["db"]), "--json").stdout)
    assert clean["telemetry_loss"]["rank_steps_missing"] == 0 and not clean["telemetry_loss"]["partial_data"]
    text = rankwatch_in_process("analyze", CLEAN["run"], "--db", str(store["db"]))
    assert "telemetry lost" not in text.stdout and "partial data" not in text.stdout


def overview(db: Path, run: str, monkeypatch) -> list[str]:
    from dashboard.source import DB_ENV

    monkeypatch.setenv(DB_ENV, str(db))
    st.cache_resource.clear()  # the data source another module's pages left cached in this process
    st.cache_data.clear()
    at = AppTest.from_file(str(APP), default_timeout=60)
    at.run()
    at.selectbox(key="run").set_value(run)
    at.switch_page("views/overview.py").run()
    assert not at.exception, [e.value for e in at.exception]
    return [w.value for w in at.warning]


def test_the_overview_explains_the_heatmaps_holes(store, monkeypatch):
    warnings = " ".join(overview(store["db"], LOSSY["run"], monkeypatch))
    assert f"{MISSING:,} of {EXPECTED:,} rank-steps" in warnings and "ranks 24–31 from step" in warnings
    assert "partial data" in warnings and "heatmap" in warnings
    assert not any("lost" in w for w in overview(store["db"], CLEAN["run"], monkeypatch))


def test_gaps_stay_compact_and_exact_at_thousands_of_ranks(tmp_path):
    """4,096 ranks: a block of 1,024 silent from step 20 and one rank-step in a thousand lost at random.
    Each live pass settles a bounded window; the blocks kept stay at most MAX_BLOCKS, the largest first in
    the summary, and the counts equal a count of every rank-step."""
    import duckdb

    from collector.analysis import losses
    from collector.analysis.analyzers import gaps
    from collector.store.schema import DDL

    ranks, steps = 4096, 60
    with duckdb.connect(str(tmp_path / "store.duckdb")) as con:
        con.execute(DDL)
        con.execute("INSERT INTO ranks (run_id, rank, first_seen) SELECT 'big', range, now() FROM range(?)", [ranks])
        con.execute(
            """INSERT INTO steps (run_id, rank, step, start_ts, end_ts, duration_s)
               SELECT 'big', r.range, s.range, make_timestamp_ns(s.range * 1000000000),
                      make_timestamp_ns(s.range * 1000000000 + 900000000), 0.9 FROM range(?) r, range(?) s
               WHERE NOT (r.range >= 3072 AND s.range >= 20) AND hash(r.range, s.range) % 1000 != 0""",
            [ranks, steps],
        )
        settled = []
        while not settled or settled[-1] != losses.record(con, "big").gaps.settled_step:
            settled.append(losses.stored(con, "big")[0].settled_step)
        windows = [b - a for a, b in zip([-1, *settled], settled)]
        assert max(windows) * ranks <= losses.RANK_STEPS and settled[-1] < steps - losses.MARGIN_STEPS
        found = losses.record(con, "big", final=True).gaps
        present = con.execute("SELECT count(DISTINCT (rank, step)) FROM steps WHERE run_id = 'big'").fetchall()[0][0]
        assert (found.expected, found.missing) == (ranks * steps, ranks * steps - present)
        assert (
            len(found.blocks) <= gaps.MAX_BLOCKS and found.missing == sum(b[4] for b in found.blocks) + found.left_out
        )
        assert "ranks 3072–4095 from step" in found.summary()
        assert losses.measure(con, "big").gaps.missing == found.missing


def test_rank_steps_that_come_after_they_settled_are_not_lost(tmp_path):
    """Ranks 8-15 of 32 send steps 10-29 only after the run has moved well past them (a backlog sent once
    its collector is back, a simulated fleet whose clock runs ahead of its sending): the passes before
    count them missing, the pass after they come counts only what is still missing (rank 9's step 12,
    never sent), and agrees with a count of every rank-step after the fact."""
    import duckdb

    from collector.analysis import losses
    from collector.store.schema import DDL

    ranks, steps = 32, 80
    late = "r.range BETWEEN 8 AND 15 AND s.range BETWEEN 10 AND 29"
    insert = """INSERT INTO steps (run_id, rank, step, start_ts, end_ts, duration_s)
                SELECT 'late', r.range, s.range, make_timestamp_ns(s.range * 1000000000),
                       make_timestamp_ns(s.range * 1000000000 + 900000000), 0.9 FROM range(?) r, range(?) s
                WHERE ({}) AND NOT (r.range = 9 AND s.range = 12)"""
    with duckdb.connect(str(tmp_path / "store.duckdb")) as con:
        con.execute(DDL)
        con.execute("INSERT INTO ranks (run_id, rank, first_seen) SELECT 'late', range, now() FROM range(?)", [ranks])
        con.execute(insert.format(f"NOT ({late})"), [ranks, steps])
        while losses.record(con, "late").gaps.settled_step < 60:
            pass
        before = losses.stored(con, "late")[0]
        assert before.missing == 8 * 20 and "ranks 8–15 steps 10–29" in before.summary()
        con.execute(insert.format(late), [ranks, steps])
        after = losses.record(con, "late").gaps
        assert (after.missing, after.blocks) == (1, [[9, 9, 12, 12, 1]])
        assert after.expected == before.expected and after.settled_step >= before.settled_step
        assert losses.record(con, "late", final=True).gaps.missing == losses.measure(con, "late").gaps.missing == 1


def test_a_rank_never_heard_from_is_counted_by_the_jobs_world_size(tmp_path):
    """Ranks 0-7 of a job of 8 said so (world size 8); rank 5 never sent a step: each of its 40 rank-steps
    is missing, live and after the fact; a run whose ranks never said a world size expects the ranks seen."""
    import duckdb

    from collector.analysis import losses
    from collector.store.schema import DDL

    with duckdb.connect(str(tmp_path / "store.duckdb")) as con:
        con.execute(DDL)
        for run, world in (("sized", 8), ("unsized", None)):
            con.execute("INSERT INTO runs VALUES (?, ?, now())", [run, world])
            seen = "INSERT INTO ranks (run_id, rank, first_seen) SELECT ?, range, now() FROM range(8) WHERE range != 5"
            con.execute(seen, [run])
            con.execute(
                """INSERT INTO steps (run_id, rank, step, start_ts, end_ts, duration_s)
                   SELECT ?, r.range, s.range, make_timestamp_ns(s.range * 1000000000),
                          make_timestamp_ns(s.range * 1000000000 + 900000000), 0.9 FROM range(8) r, range(40) s
                   WHERE r.range != 5""",
                [run],
            )
        sized = losses.record(con, "sized", final=True).gaps
        assert (sized.ranks, sized.expected, sized.missing, sized.blocks) == (8, 320, 40, [[5, 5, 0, 39, 40]])
        assert losses.measure(con, "sized").gaps.missing == 40
        assert losses.record(con, "unsized", final=True).gaps.missing == 0


RESTARTED = {"run": "restarted", "ranks": 8, "steps": 40}


def test_rank_steps_a_restarted_collector_gets_late_are_taken_off_the_count(tmp_path):
    """Rank 5's steps 5-9 wait in its agent's backlog while the collector is killed (-9): the run ends
    and settles with them missing, then they come to the collector started again. Once they are stored
    /metrics counts none missing, though the pass that takes them off settles no new step."""
    from collector.reports.queryapi import remote_query
    from rankwatch.agent.apiclient import ApiClient

    def late(rank: int, step: int) -> bool:
        return rank == 5 and 5 <= step <= 9

    def loss_row(collector: Collector) -> list:
        answer = remote_query(
            ApiClient(collector.url, collector.token),
            "SELECT settled_step, missing FROM telemetry_loss WHERE run_id = ?",
            [RESTARTED["run"]],
        )
        return answer["rows"]

    def missing_on_metrics(collector: Collector) -> float | None:
        return metric(
            requests.get(f"{collector.url}/metrics", timeout=10).text,
            "rankwatch_run_rank_steps_missing",
            RESTARTED["run"],
        )

    with open(tmp_path / "collector.log", "w") as log:
        collector = Collector(
            tmp_path / "rankwatch.duckdb", free_port(), "test-token-0123456", ("--analyze-every", "1"), log=log
        )
        collector.start()
        try:
            send(collector, RESTARTED, late)
            last = RESTARTED["steps"] - 1
            wait_until(lambda: loss_row(collector) == [[last, 5]], "the ended run settled with 5 rank-steps missing")
            collector.stop(signal.SIGKILL)
            collector.start()
            send(collector, RESTARTED, lambda rank, step: not late(rank, step), ended=False)
            wait_until(
                lambda: missing_on_metrics(collector) == 0, "/metrics counting the late rank-steps", timeout_s=60
            )
            assert loss_row(collector) == [[last, 0]]
        finally:
            collector.stop()
