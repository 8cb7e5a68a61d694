"""The analysis engine keeps the steps a pass read for the next (collector/analysis/engine.py
`_History`): a pass over one new step reads that step from the store, not the run's whole history
again; what it concludes is the same as when every pass reads everything; and what was kept is
read again once the steps under the cursor change (a rollback applied)."""

import json
import time

import duckdb
import pandas as pd

from collector.analysis import engine as engine_module
from collector.analysis.engine import Engine
from collector.store.schema import DDL
from trainer import simulate
from trainer.faults import parse

RANKS, STEPS = 32, 140
HISTORY = max(a.READS.history for a in Engine().analyzers)  # the most steps an analyzer reads back


class Reads:
    """A connection that notes the steps each of the engine's step reads asked for: (after, upto)."""

    def __init__(self, con: duckdb.DuckDBPyConnection):
        self.con, self.steps = con, []

    def execute(self, sql, *params):
        if sql is engine_module._STEPS:
            self.steps.append((params[0]["after"], params[0]["upto"]))
        return self.con.execute(sql, *params)


def _store(steps: int = STEPS, faults: tuple[str, ...] = ("straggler:rank=5,slowdown=1.3,from=60",)):
    """One simulated run: rank 5 computes 1.3x slow from step 60 (or the `faults` given), the loss spikes
    at step 100."""
    frames = pd.concat(
        simulate.steps(
            simulate.Topology(dp=RANKS // 2, pp=2),
            steps,
            [parse(f) for f in faults],
            seed=1,
            start_ns=time.time_ns() - steps * 10**9,
        ),
        ignore_index=True,
    )
    frames = frames.assign(
        run_id="r",
        start_ts=pd.to_datetime(frames["start_ns"], unit="ns"),
        end_ts=pd.to_datetime(frames["end_ns"], unit="ns"),
        loss=3.0 + 50.0 * (frames["step"] == 100),
        grad_norm=1.0,
    )
    con = duckdb.connect()
    con.execute(DDL)
    con.execute("""INSERT INTO steps BY NAME SELECT run_id, rank, step, start_ts, end_ts, duration_s, data_s,
                   compute_s, comm_wait_s, loss, grad_norm FROM frames""")
    con.execute(
        "INSERT INTO ranks SELECT 'r', r, 'node-' || (r // 8), r % 8, r // 2, r % 2, 0, 'sim', 0, now() "
        "FROM range(?) t(r)",
        [RANKS],
    )
    con.execute("INSERT INTO runs VALUES ('r', ?, now())", [RANKS])
    return con


def _passes(con, engine: Engine, forget: bool = False, now: int | None = None) -> list[tuple]:
    """The run judged a step a pass (as a collector does at a step a second), to its end, at `now`
    (default: now): what each pass found. `forget`: every pass reads the whole history (what the
    engine did before it kept any)."""
    found, now = [], now or time.time_ns()
    while True:
        if forget:
            engine._history.clear()
        judged = engine.judge(con, "r", now, final=True)
        found.append(
            sorted(
                (name, f.kind, tuple(f.ranks), f.step_start, f.step_end, f.severity, round(f.score, 9), f.summary)
                for name, drawn in judged.found.items()
                for f in drawn
            )
        )
        if not judged.more:
            return found


def test_a_pass_reads_the_new_steps_and_concludes_what_reading_everything_does():
    con = _store()
    reads = Reads(con)
    kept = _passes(reads, Engine(rank_steps=RANKS))  # one step a pass
    everything = _passes(con, Engine(rank_steps=RANKS), forget=True)
    assert kept == everything
    assert any(any(f[:3] == ("stragglers", "rank", (5,)) for f in found) for found in kept)  # it has a story
    assert any(any(f[1] == "loss_spike" for f in found) for found in kept)
    # past the first, each pass read its one new step: from the step the pass before ended at
    for (after, upto), (_, before) in zip(reads.steps[1:], reads.steps, strict=False):
        assert (after, upto) == (before, before + 1)


def test_what_is_kept_follows_ranks_that_fall_silent_stalls_and_widespread_slowness():
    """What each analyzer derives from the kept steps (the stragglers' matrices and the ranks of their
    window, the anomalies' medians, the hang analyzer's look at the newest steps alone) concludes
    what reading everything does, where the window's ranks change (rank 31 silent from step 30 on,
    so out of the window 96 steps later), a stall closes (every end from step 90 on 60 s later) and
    a different rank is slowest at each step from step 40 (uneven sequence lengths)."""
    con = _store(faults=("data-skew:cv=0.3,from=40",))
    con.execute("DELETE FROM steps WHERE rank = 31 AND step >= 30")
    con.execute("UPDATE steps SET end_ts = end_ts + INTERVAL 60 SECOND WHERE step >= 90")
    # through the stall the heartbeat of every rank but the silent one says where it is: the others in step 90,
    # rank 3 in step 89, which it had finished (so it is between steps, after it)
    con.execute(
        """INSERT INTO events (run_id, rank, ts, event, step, attrs)
           SELECT 'r', r, s.stalled + INTERVAL (t) SECOND, 'heartbeat', CASE WHEN r = 3 THEN 89 ELSE 90 END,
                  '{"rankwatch.phase": "forward"}'
           FROM range(31) ranks(r), range(5, 60, 5) beats(t),
                (SELECT max(end_ts) AS stalled FROM steps WHERE step = 89) s"""
    )
    now = time.time_ns()  # (the stall under way at the end, judged at one moment both times)
    kept = _passes(con, Engine(rank_steps=RANKS), now=now)
    assert kept == _passes(con, Engine(rank_steps=RANKS), forget=True, now=now)
    found = {f[:2] for drawn in kept for f in drawn}
    assert {("stragglers", "widespread"), ("anomalies", "loss_spike")} <= found, found
    # the pass that judged step 90 found the stall it closed (as it stood past its 30 s timeout), rank 3's
    assert [f[2:5] + f[7:] for f in kept[90] if f[0] == "hangs"] == [
        ((3,), 90, 90, "no step has finished for 31 s: rank 3 stopped (rank 3: between steps, after step 89)")
    ]


def test_what_was_kept_is_read_again_once_a_rollback_changes_the_steps_under_the_cursor():
    con = _store()
    # the first 100 steps in one pass (a backlog), then a step a pass up to step 120: what is kept there is dropped
    # once the rollback moves the cursor, so the passes before it need not be of a step each
    reads, engine, now = Reads(con), Engine(rank_steps=100 * RANKS), time.time_ns()
    assert engine.judge(reads, "r", now).last == 99
    engine.rank_steps = RANKS
    while engine.judge(reads, "r", now).last < 120:
        pass
    # the job went back to step 110 and trained it again (slower, so a straggler-free stretch is not assumed)
    resumed = time.time_ns()
    con.execute(
        "INSERT INTO commands (run_id, kind, state, created_by, result) VALUES ('r', 'rollback', 'applied', 'test', ?)",
        [json.dumps({"restored_step": 110, "resumed_ns": resumed})],
    )
    con.execute(
        """INSERT INTO steps BY NAME
           SELECT run_id, rank, step, make_timestamp_ns($t + (step - 110) * 1000000000) AS start_ts,
                  make_timestamp_ns($t + (step - 109) * 1000000000) AS end_ts, duration_s, data_s, compute_s,
                  comm_wait_s, 3.0 AS loss, grad_norm
           FROM steps WHERE run_id = 'r' AND step BETWEEN 110 AND 125""",
        {"t": resumed},
    )
    reads.steps.clear()
    judged = engine.judge(reads, "r", now)
    assert judged.rolled_back == 110 and judged.first_new == 110
    assert reads.steps[0][0] == 110 - 1 - HISTORY  # the history under the restored step, read again
    # and the run's findings from there are those of an engine that kept nothing
    fresh = Engine(rank_steps=RANKS)
    fresh.cursors["r"] = engine_module.Cursor(step=109, rollback=0, world=RANKS)
    again = fresh.judge(con, "r", now)
    assert {n: [(f.kind, f.ranks, f.step_start, f.summary) for f in v] for n, v in judged.found.items()} == {
        n: [(f.kind, f.ranks, f.step_start, f.summary) for f in v] for n, v in again.found.items()
    }
