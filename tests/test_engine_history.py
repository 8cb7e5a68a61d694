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


def _store(steps: int = STEPS) -> duckdb.DuckDBPyConnection:
    """One simulated run: rank 5 computes 1.3x slow from step 60, the loss spikes at step 100."""
    frames = pd.concat(
        simulate.steps(
            simulate.Topology(dp=RANKS // 2, pp=2),
            steps,
            [parse("straggler:rank=5,slowdown=1.3,from=60")],
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


def _passes(con, engine: Engine, forget: bool = False) -> list[tuple]:
    """The run judged a step a pass (as a collector does at a step a second), to its end: what each
    pass found. `forget`: every pass reads the whole history (what the engine did before it kept any)."""
    found, now = [], time.time_ns()
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


def test_what_was_kept_is_read_again_once_a_rollback_changes_the_steps_under_the_cursor():
    con = _store()
    reads, engine, now = Reads(con), Engine(rank_steps=RANKS), time.time_ns()
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
