"""The analysis engine (collector/analysis/engine.py): every committed step judged exactly once, whatever
the order and pace the ranks' steps arrive in; passes driven by commits, so a fast job's anomaly
is found while it runs; the live collector and `rankwatch analyze` find the same things in the
same stores; a run's end is no stall, and resolves its findings."""

import json
import math
import time

import duckdb
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from collector.analysis.engine import Engine, add_steps
from collector.reports.query import run_remote
from collector.store.schema import DDL
from rankwatch.agent import semconv as sc
from tests.support.collectors import job_collector, simulated_store
from tests.support.commands import rankwatch_in_process
from tests.support.engine_jobs import MS, exporters, live_findings, send_steps
from tests.support.otlp_payloads import query
from tests.support.waits import wait_until

pytestmark = pytest.mark.long

WINDOW = 12  # the straggler analyzer's shortest window: onsets agree to within half of it


def _store() -> duckdb.DuckDBPyConnection:
    con = duckdb.connect()
    con.execute(DDL)
    return con


# the rows of a commit, made in SQL from its lists of ranks and steps rather than through a DataFrame: the
# property tests below commit hundreds of times
_APPENDED = """SELECT $run AS run_id, rank, step,
                      make_timestamp_ns(coalesce($start::BIGINT + (step - min(step) OVER ()) * 100000000,
                                                 1000000000000000000 + least(step, 1000000000) * 100000000))
                        AS start_ts,
                      start_ts + INTERVAL 100 MILLISECOND AS end_ts,
                      0.1 AS duration_s, 0.08 AS compute_s, 0.02 AS comm_wait_s, 3.0 AS loss
               FROM (SELECT unnest($ranks::INTEGER[]) AS rank, unnest($steps::BIGINT[]) AS step)"""


def _commit(con, run: str, rows: list[tuple[int, int]], start_ns: int | None = None) -> None:
    """Rank-steps as the writer appends them (with the ranks they come from), 100 ms each: step N at
    N/10 s (or from `start_ns` on, the first step of `rows` first)."""
    ranks, steps = [rank for rank, _ in rows], [step for _, step in rows]
    con.execute(
        "INSERT INTO ranks BY NAME SELECT DISTINCT $run AS run_id, unnest($ranks::INTEGER[]) AS rank, "
        "now() AS first_seen ON CONFLICT DO NOTHING",
        {"run": run, "ranks": ranks},
    )
    con.execute(
        f"INSERT INTO steps BY NAME {_APPENDED}", {"run": run, "ranks": ranks, "steps": steps, "start": start_ns}
    )


@settings(max_examples=20, deadline=None)
@given(ranks=st.integers(1, 5), steps=st.integers(1, 60), budget=st.integers(1, 200), data=st.data())
def test_every_committed_step_is_judged_exactly_once(ranks, steps, budget, data):
    """The ranks' steps arrive in commits of any size, each rank's in order but the ranks apart; a pass
    may come after any commit, and judges at most `budget` rank-steps: the steps judged, over all the
    passes and a last one, are each step once, and none before every rank had reported it, whether a
    pass is the timer's or one a commit woke (which judges nothing where no step became complete)."""
    con, engine = _store(), Engine(rank_steps=budget)
    con.execute("INSERT INTO runs VALUES ('r', ?, now())", [ranks])
    sent = dict.fromkeys(range(ranks), 0)
    judged: list[int] = []
    while any(n < steps for n in sent.values()):
        rank = data.draw(st.sampled_from([r for r, n in sent.items() if n < steps]))
        n = data.draw(st.integers(1, steps - sent[rank]))
        _commit(con, "r", [(rank, s) for s in range(sent[rank], sent[rank] + n)])
        sent[rank] += n
        while data.draw(st.booleans()):
            woken = data.draw(st.booleans())  # by a commit (nothing ended), or the timer's
            j = engine.judge(con, "r", 0, ended_came=not woken, timed=not woken)
            assert j.last < min(sent.values()) or j.last < j.first_new  # only steps every rank reported
            assert not j.idle or (j.last < j.first_new and not j.found)
            judged += range(j.first_new, j.last + 1)
            if not j.more:
                break
    while True:
        j = engine.judge(con, "r", 0, final=True)
        judged += range(j.first_new, j.last + 1)
        if not j.more:
            break
    assert sorted(judged) == list(range(steps))


def test_a_commit_that_completes_no_step_has_its_pass_call_no_analyzer():
    """Rank 0's next steps alone: the pass that commit wakes calls no analyzer (idle, the run behind);
    the timer's pass calls those that judge the passing of time (a stall); rank 1's report of the steps
    completes them, and the pass its commit wakes judges them."""
    con, engine = _store(), Engine()
    con.execute("INSERT INTO runs VALUES ('r', 2, now())")
    _commit(con, "r", [(0, 0), (1, 0)])
    assert engine.judge(con, "r", 0, timed=False).last == 0  # a run's first pass judges what came
    _commit(con, "r", [(0, 1), (0, 2)])
    woken = engine.judge(con, "r", 0, ended_came=False, timed=False)
    assert woken.idle and woken.behind and woken.found == {} and woken.last < woken.first_new
    timer = engine.judge(con, "r", 0)
    assert not timer.idle and "hangs" in timer.found and "stragglers" not in timer.found
    _commit(con, "r", [(1, 1), (1, 2)])
    woken = engine.judge(con, "r", 0, ended_came=False, timed=False)
    assert not woken.idle and (woken.first_new, woken.last) == (1, 2) and "stragglers" in woken.found


@settings(max_examples=10, deadline=None)
@given(
    ranks=st.integers(1, 3),
    steps=st.integers(1, 25),
    budget=st.integers(1, 60),
    far=st.lists(st.integers(26, 2**40 - 1), min_size=1, max_size=2, unique=True),
    data=st.data(),
)
def test_steps_far_ahead_starve_no_step_below_them(ranks, steps, budget, far, data):
    """Steps far ahead of the run (a bad step counter, a hostile client: any step ingest takes) come
    first or between the run's own, whole or from some ranks; the run's steps come in commits of any
    size, each rank's in order but the ranks apart, and a pass may come after any commit, told of
    the steps committed since the one before, as the live collector tells it: each of the run's
    steps is judged once every rank has reported it, and judged again only where a rank's far step
    had made it look reported before; a far step is judged at most once a rank that sent it; and no
    pass walks the empty steps between (a pass judges at most `budget` rank-steps)."""
    con, engine = _store(), Engine(rank_steps=budget)
    con.execute("INSERT INTO runs VALUES ('r', ?, now())", [ranks])
    sent = dict.fromkeys(range(ranks), 0)
    present: set[int] = set()
    judged: list[int] = []
    arrived: list[tuple[int, int]] = []
    pending = [(rank, [step]) for step in far for rank in data.draw(st.sets(st.sampled_from(range(ranks)), min_size=1))]
    sent_far = list(pending)
    whole: list[int] = []  # the run's steps judged once every rank had reported them
    went_far: set[int] = set()  # the ranks that have sent a far step

    def commit(rank: int, rows: list[int]) -> None:
        nonlocal arrived
        _commit(con, "r", [(rank, s) for s in rows])
        present.update(rows)
        arrived = add_steps(arrived, [(min(rows), max(rows))])

    def judge(final: bool = False) -> bool:
        nonlocal arrived
        j = engine.judge(con, "r", 0, final=final, arrived=arrived)
        arrived = []
        new = sorted(s for s in present if j.first_new <= s <= j.last)
        assert len(new) <= max(budget // ranks, 1)
        judged.extend(new)
        whole.extend(s for s in new if s < steps and (s < min(sent.values()) or final))
        early = [s for s in new if s < steps and not (s < min(sent.values()) or final)]
        assert all(any(r in went_far for r, n in sent.items() if n <= s) for s in early)
        return j.more

    while pending or any(n < steps for n in sent.values()):
        live = [r for r, n in sent.items() if n < steps]
        if pending and (not live or data.draw(st.booleans())):
            went_far.add(pending[0][0])
            commit(*pending.pop(0))
        else:
            rank = data.draw(st.sampled_from(live))
            n = data.draw(st.integers(1, steps - sent[rank]))
            commit(rank, list(range(sent[rank], sent[rank] + n)))
            sent[rank] += n
        while data.draw(st.booleans()) and judge():
            pass
    while judge(final=True):
        pass
    assert sorted(whole) == list(range(steps))
    assert all(judged.count(s) <= sum(step == s for _, (step,) in sent_far) for s in far)


def test_steps_sent_again_below_the_cursor_are_judged_again_alone():
    """A client sends a run's first step again, and a step far ahead, beside its newest: the passes
    after judge those steps, not the hundred already judged between them."""
    con, engine = _store(), Engine()
    con.execute("INSERT INTO runs VALUES ('r', 2, now())")
    _commit(con, "r", [(rank, step) for step in range(100) for rank in (0, 1)])
    assert engine.judge(con, "r", 0, arrived=[(0, 99)]).last == 99
    _commit(con, "r", [(0, 0), (1, 0), (0, 2**40 - 1), (1, 2**40 - 1), (0, 100), (1, 100)])
    arrived, judged = add_steps([], [(0, 0), (100, 100), (2**40 - 1, 2**40 - 1)]), []
    while True:
        j = engine.judge(con, "r", 0, arrived=arrived)
        arrived = []
        judged += [s for s in (0, *range(1, 101), 2**40 - 1) if j.first_new <= s <= j.last]
        if not j.more:
            break
    assert sorted(judged) == [0, 100, 2**40 - 1]


@pytest.fixture(scope="module")
def woken_collector(tmp_path_factory):
    """A collector whose timer pass is an hour away: its passes are those its commits wake. The tests that
    send it runs of their own, and read only those, share it."""
    with job_collector(tmp_path_factory.mktemp("woken"), "--analyze-every", "3600") as collector:
        yield collector


def test_a_step_far_ahead_leaves_the_runs_own_steps_judged_live(woken_collector):
    """Every rank of a live run sends one step at 2^40 - 1, the largest ingest takes, and the
    collector judges it; the run's own steps then come, a NaN loss among them: it is found, on its
    step, and the rollback the policy asks for is queued for the job."""
    collector = woken_collector
    run, nan_at = "far-ahead", 45
    sending = exporters(collector, run, 2)
    t0 = time.time_ns() - 100 * 100 * MS
    for exporter in sending.values():
        exporter.trace([("step", t0, t0 + 100 * MS, {sc.KIND: sc.KIND_STEP, sc.STEP: 2**40 - 1, sc.LOSS: 3.0})])
        assert exporter.flush()

    def cursor() -> list:
        sql = f"SELECT step FROM analysis_cursors WHERE run_id = '{run}'"
        return run_remote(collector.url, collector.token, sql)[1]

    wait_until(lambda: cursor() == [[2**40 - 1]], "the far step was not judged")
    for start in range(0, nan_at + 15, 10):
        send_steps(sending, range(start, start + 10), t0, loss=lambda s: math.nan if s == nan_at else 3.0 - s / 100)

    def rollback() -> list:
        return run_remote(
            collector.url, collector.token, f"SELECT args FROM commands WHERE run_id = '{run}' AND kind = 'rollback'"
        )[1]

    wait_until(rollback, "no rollback was queued for the NaN")
    nan = [f for f in live_findings(collector, run) if f["kind"] == "nan"]
    assert [f["step_start"] for f in nan] == [nan_at]
    assert json.loads(rollback()[0][0])["before_step"] < nan_at
    assert cursor()[0][0] < 2**40 - 1  # the cursor is on the run's own steps


@pytest.mark.parametrize("rate", [10, 100])
def test_a_fast_jobs_spike_is_found_while_it_runs_by_the_commit_that_shows_it(woken_collector, rate):
    """A job of `rate` steps a second, its loss spiking once: the timer pass is an hour away, so the
    finding can only come from the pass its commit woke; it is there within seconds of that commit
    (bench/detection.py measures how long: the goal is 1 s), and the old pass over the newest 48
    steps every few seconds never saw spikes of a job this fast."""
    collector = woken_collector
    ranks, spike_at, run = 2, 60, f"fast-{rate}"  # past the analyzer's warm-up and first baseline (20 + 20 steps)
    sending = exporters(collector, run, ranks)
    t0 = time.time_ns()
    step_s = 1 / rate
    for start in range(0, spike_at + 30, 10):  # a commit every 10 steps, in real time
        acked = send_steps(
            sending,
            range(start, start + 10),
            t0,
            step_s,
            compute=lambda r, s: 0.6 * step_s,
            loss=lambda s: 50.0 if s == spike_at else 3.0 - s / 1000,
        )
        if start <= spike_at < start + 10:
            spike_acked = acked
            wait_until(
                lambda: any(f["kind"] == "loss_spike" for f in live_findings(collector, run)), "the spike was not found"
            )
            found_after = time.monotonic() - spike_acked
        time.sleep(max(0.0, t0 / 1e9 + (start + 10) * step_s - time.time()))
    (spike,) = [f for f in live_findings(collector, run) if f["kind"] == "loss_spike"]
    assert spike["step_start"] == spike_at
    assert found_after < 10  # a loaded machine: the goal, 1 s, is measured in bench/detection.py


SCENARIOS = {  # run -> how it is made; every analyzer's findings but info (power advice, verdicts not drawn)
    "eq-straggler": ("simulate", ["--ranks", "16", "--steps", "70"], ["straggler:rank=5,slowdown=1.15,from=25"]),
    "eq-stage": (
        "simulate",
        ["--ranks", "32", "--pp", "4", "--steps", "60"],
        ["slow-stage:stage=2,slowdown=1.2,from=20"],
    ),
    "eq-hang": ("simulate", ["--ranks", "8", "--steps", "40", "--hang-for", "8"], ["hang:rank=3,at=18"]),
    "eq-spike": ("exporter", None, None),
}


def _spiky_run(collector) -> None:
    """4 ranks, a loss that falls with noise, spiking at step 45, and rank 2 computing 30% longer from 30."""
    import random

    noise = random.Random(3)
    send_steps(
        exporters(collector, "eq-spike", 4),
        range(90),
        time.time_ns() - 90 * 100 * MS,
        compute=lambda r, s: 0.08 * (1.3 if r == 2 and s >= 30 else 1.0) * noise.lognormvariate(0, 0.02),
        loss=lambda s: 20.0 if s == 45 else 4.0 - s / 100 + noise.gauss(0, 0.02),
    )


@pytest.fixture(scope="module")
def equal_stores(tmp_path_factory):
    stores = {}
    for run, (how, args, faults) in SCENARIOS.items():
        directory = tmp_path_factory.mktemp(run)
        if how == "simulate":
            stores[run] = simulated_store(directory, {run: faults}, args, ("--analyze-every", "1", "--hang-after", "3"))
        else:
            from tests.support.collectors import Collector, free_port

            db = directory / "rankwatch.duckdb"
            with open(directory / "collector.log", "w") as log:
                collector = Collector(
                    db, free_port(), "test-token-0123456", extra_args=("--analyze-every", "1"), log=log
                )
                collector.start()
                try:
                    _spiky_run(collector)
                finally:
                    collector.stop()
            stores[run] = db
    return stores


@pytest.mark.parametrize("run", SCENARIOS)
def test_live_and_after_the_fact_find_the_same(equal_stores, run):
    """The collector's findings, drawn pass by pass as the steps came, and `rankwatch analyze`'s over
    the store it left: the same analyzers, kinds and ranks, onsets within half a window."""
    db = equal_stores[run]
    live = query(
        db,
        "SELECT analyzer, kind, ranks, step_start FROM findings WHERE run_id = ? AND severity <> 'info' "
        "ORDER BY step_start",
        [run],
    )
    result = rankwatch_in_process("analyze", run, "--db", str(db), "--json", "--hang-after", "3")
    assert result.returncode == 0, result.stderr
    after = [
        (f["analyzer"], f["kind"], f["ranks"], f["step_start"])
        for f in json.loads(result.stdout)["findings"]
        if f["severity"] != "info"
    ]
    assert live, "the scenario drew no finding"
    assert sorted((a, k, list(r)) for a, k, r, _ in live) == sorted((a, k, r) for a, k, r, _ in after), (live, after)
    for a, k, r, start in live:
        (onset,) = [s for a2, k2, r2, s in after if (a2, k2, r2) == (a, k, list(r))]
        assert abs(start - onset) <= WINDOW // 2, (a, k, r, start, onset)


def test_a_run_that_ended_is_no_hang_and_its_findings_resolve(collector_factory):
    """Two runs stop sending steps for longer than the stall timeout while their heartbeats go on (a
    last checkpoint written to a slow disk): the one whose ranks all said their loop ended draws no
    hang, and its straggler finding ends with it (state `ended`, "run ended"), its alert resolved; the other
    hangs."""
    from rankwatch.agent import semconv as sc

    # a stall timeout above the time the stragglers take to be found on a loaded machine: "ends" is told to end
    # only after both are, and must not hang before that
    collector = collector_factory(None, "--analyze-every", "0.5", "--hang-after", "8")
    runs = {"ends": exporters(collector, "ends", 3), "stalls": exporters(collector, "stalls", 3)}
    for run, sending in runs.items():
        send_steps(sending, range(40), time.time_ns() - 40 * 100 * MS, compute=lambda r, s: 0.12 if r == 1 else 0.08)
        wait_until(
            lambda: any(f["kind"] == "rank" and f["state"] == "firing" for f in live_findings(collector, run)),
            f"run {run}: no straggler",
        )
    for exporter in runs["ends"].values():
        exporter.event(sc.EVENT_ENDED, time.time_ns(), {})
    stalled_until = time.monotonic() + 5
    while time.monotonic() < stalled_until:  # heartbeats go on, steps do not
        for sending in runs.values():
            for exporter in sending.values():
                exporter.event(sc.EVENT_HEARTBEAT, time.time_ns(), {sc.STEP: 40, sc.PHASE: "checkpoint"})
                exporter.flush()
        time.sleep(0.5)
    wait_until(lambda: any(f["analyzer"] == "hangs" for f in live_findings(collector, "stalls")), "no hang")
    ended = live_findings(collector, "ends")
    assert not [f for f in ended if f["analyzer"] == "hangs"], ended
    # held to the end: what went wrong with the run, not a recovery
    assert all(f["state"] == "ended" and json.loads(f["evidence"])["resolved"] == "run ended" for f in ended), ended
    collector.stop()
    assert query(collector.db, "SELECT count(*) FROM alerts WHERE run_id = 'ends' AND ends_at IS NULL") == [(0,)]
    assert query(collector.db, "SELECT count(*) FROM alerts WHERE run_id = 'ends'") != [(0,)]


def test_jobs_of_two_ranks_are_judged_and_one_rank_says_why_not(collector_factory, monkeypatch):
    """A real 2-rank job: the rank that computes longer is named (on a loaded machine a CPU rank's
    compute varies ~20% step to step, and more beside other jobs, so the slowdown is large enough to
    stand out of that from its onset; tests/collector/analysis/test_stragglers.py judges 20% ones, and clean pairs,
    at 1-5%
    jitter: on a loaded 2-core host a clean pair's rank 0 can measure 20-30% slower for tens of steps,
    which is what it finds); a
    1-rank run is not judged, and the collector, `rankwatch analyze` and the dashboard say why rather
    than call it healthy."""
    from rankwatch.launch import train

    collector = collector_factory(None, "--analyze-every", "1")
    assert (
        train(
            nproc=2,
            steps=60,
            run_id="pair-slow",
            faults=["straggler:rank=1,slowdown=3,from=20"],
            collector=collector.url,
            token=collector.token,
            store=collector.db,
        )
        == 0
    )
    send_steps(exporters(collector, "alone", 1), range(30), time.time_ns() - 30 * 100 * MS)
    wait_until(lambda: any(f["kind"] == "not_judged" for f in live_findings(collector, "alone")), "no verdict")
    collector.stop()
    # what it finds from the slowdown on (before it, a loaded machine's noise may draw findings of its own)
    stragglers = """SELECT kind, ranks, step_start FROM findings WHERE run_id = ? AND analyzer = 'stragglers'
                    AND severity <> 'info' AND step_end >= 20"""
    ((kind, ranks, start),) = query(collector.db, stragglers, ["pair-slow"])
    assert (kind, list(ranks)) == ("rank", [1]) and abs(start - 20) <= WINDOW
    report = rankwatch_in_process("analyze", "alone", "--db", str(collector.db))
    assert report.returncode == 0, report.stderr
    assert "not judged" in report.stdout and "no peers" in report.stdout.replace("\n", " ")

    from dashboard.ui import ONE_PROCESS
    from tests.support.dashboard_pages import open_page, reading, texts

    reading(monkeypatch, collector.db)
    overview = open_page("overview", "alone")  # one line says what is not judged, and why, where it would be
    assert ONE_PROCESS in texts(overview.main.caption)
    page = open_page("stragglers", "alone")
    assert texts(page.main.info).count(ONE_PROCESS) == 1


def test_an_analyzer_that_raises_loses_its_own_findings_and_no_more(monkeypatch, caplog):
    """An analyzer raising on a run's steps (a defect, data it cannot read) costs its own findings of
    the pass, which the log and the report then name, not the other analyzers' nor the next passes:
    the cursor moves on, where the failed pass would judge the same steps, and fail, again and again."""
    from collector.analysis.analyzers import hangs
    from collector.analysis.engine import replay

    def broken(frames, settings):
        raise ValueError("cannot read this")

    con, engine = _store(), Engine()
    con.execute("INSERT INTO runs VALUES ('r', 2, now())")
    _commit(con, "r", [(rank, step) for step in range(40) for rank in (0, 1)])
    con.execute("UPDATE steps SET loss = 'nan' WHERE step = 30")
    monkeypatch.setattr(hangs, "judge", broken)
    judged = engine.judge(con, "r", 10**18 + 41 * 10**8)
    assert (judged.first_new, judged.last, judged.failed) == (0, 39, ["hangs"])
    assert "hangs" not in judged.found and [f.step_start for f in judged.found["anomalies"]] == [30]
    assert "the hangs analyzer failed on steps 0-39 of run r" in caplog.text
    _commit(con, "r", [(rank, step) for step in range(40, 45) for rank in (0, 1)])
    assert engine.judge(con, "r", 10**18 + 46 * 10**8).first_new == 40  # the next pass judges the next steps
    (failure,) = [f for f in replay(con, "r") if f.kind == "analysis_failing"]
    assert (failure.analyzer, failure.step_start, failure.step_end) == ("collector", 0, 44)
    assert failure.summary.startswith("the hangs analyzer failed on steps 0–44: its findings there are missing")
    # live, the run says so itself, beside the collector's count (its health finding)
    from collector.analysis.live import Analysis

    live = Analysis()
    try:
        live.touched(["r"], steps=True)
        live.run(con)
    finally:
        live.close()
    assert live.failures == {"hangs": 1}
    rows = con.execute("SELECT analyzer, kind, step_start, step_end, state FROM findings ORDER BY id").fetchall()
    assert ("anomalies", "nan", 30, 30, "firing") in rows and ("collector", "analysis_failing", 0, 44, "firing") in rows


def test_a_rollbacks_restore_is_no_stall_and_its_heartbeats_between_steps_are_read():
    """A rollback abandons steps 16-23 (no longer the run's steps) and the job restores step 16 while
    its ranks' heartbeats name no step: measured from step 15's end, the ranks would look stalled for
    longer than the timeout, and stalled again until the new step 16 ended. The steps abandoned and
    the resume were progress: no stall, then or after."""
    from collector.analysis.analyzers.hangs import Settings as HangSettings

    con, engine = _store(), Engine({"hangs": HangSettings(floor_s=1.0)})
    t0, ms = 10**18, 10**6

    con.execute("INSERT INTO runs VALUES ('r', 2, now())")
    _commit(con, "r", [(r, s) for s in range(24) for r in (0, 1)])  # step 15 ends at 1.6 s, step 23 at 2.4 s
    assert engine.judge(con, "r", t0 + 2400 * ms).last == 23
    resumed = t0 + 3000 * ms
    con.execute(
        "INSERT INTO commands (run_id, kind, state, created_by, result) VALUES ('r', 'rollback', 'applied', 'test', ?)",
        [json.dumps({"restored_step": 16, "resumed_ns": resumed})],
    )
    beats = [("r", r, pd.Timestamp(resumed + 400 * ms), "heartbeat", None, json.dumps({sc.PHASE: ""})) for r in (0, 1)]
    con.executemany("INSERT INTO events (run_id, rank, ts, event, step, attrs) VALUES (?, ?, ?, ?, ?, ?)", beats)
    restoring = engine.judge(con, "r", resumed + 500 * ms)
    assert restoring.rolled_back == 16 and restoring.found.get("hangs") == [] and not restoring.failed
    _commit(con, "r", [(r, s) for s in range(16, 24) for r in (0, 1)], resumed)
    after = engine.judge(con, "r", resumed + 900 * ms)
    assert (after.first_new, after.last, after.found["hangs"], after.failed) == (16, 23, [], [])


def test_a_run_ends_once_the_last_step_each_rank_named_is_stored():
    """A rank's `ended` event names its last step, whose spans its agent may send after the event (the
    step waits to be readable): the run ends once every rank's last step is stored, so the slowest rank's
    last step is judged with the others'; a step lost for good holds the end ENDING_WAIT_S at most."""
    from collector.analysis.engine import ENDING_WAIT_S

    con, engine = _store(), Engine()
    con.execute("INSERT INTO runs VALUES ('r', 2, now())")
    _commit(con, "r", [(r, s) for s in range(10) for r in (0, 1) if (r, s) != (1, 9)])
    at = 10**18 + 11 * 10**8
    ended = [("r", r, pd.Timestamp(at, unit="ns"), "ended", 9) for r in (0, 1)]
    con.executemany("INSERT INTO events (run_id, rank, ts, event, step) VALUES (?, ?, ?, ?, ?)", ended)
    waiting = engine.judge(con, "r", at + 10**9)
    assert (waiting.last, waiting.ended) == (8, False)  # rank 1's step 9 is on its way
    _commit(con, "r", [(1, 9)])
    came = engine.judge(con, "r", at + 2 * 10**9, ended_came=False)  # a commit of steps alone
    assert (came.first_new, came.last, came.ended) == (9, 9, True)

    lost = Engine()
    con.execute("DELETE FROM steps WHERE rank = 1 AND step = 9")
    assert not lost.judge(con, "r", at + 10**9).ended
    assert lost.judge(con, "r", at + int((ENDING_WAIT_S + 1) * 10**9)).ended
