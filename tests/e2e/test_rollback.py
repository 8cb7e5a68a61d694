"""Automatic rollback end to end: a real torchrun job whose loss turns NaN (or spikes) is rolled
back by the collector's anomaly analyzer, exactly once, and trains on with a sane loss; past its
rollback budget it stops, its good state durable, and the collector says so, naming each rollback;
the anomalies of the steps a rollback abandoned spend none of the budget."""

import json
from dataclasses import dataclass
from pathlib import Path

import duckdb
import pytest

from collector.reports.postmortem import analyze_run
from rankwatch.launch import train
from tests.support.collectors import Collector, job_collector
from tests.support.otlp_payloads import query
from trainer.checkpoint import Checkpointer

# the paced jobs run in one fixture, within the time the two tests that ran one each had together
pytestmark = [pytest.mark.long, pytest.mark.timeout(2 * 300)]

# a 3x straggler paces the tiny CPU job so that the rollback (found by the pass its commit wakes, fetched
# by a held poll, looked at every 0.25 s) lands well within the steps the memory snapshots reach back (16 or more)
PACE = "straggler:rank=0,slowdown=3,from=0"
AT = 30  # the anomaly: past the anomaly analyzer's 20-step warmup and baseline
STEPS = 64  # 30 steps before the anomaly, and enough after it for the rollback and the trained-on steps
SECOND = AT + 40  # the budget job's second spike: past the 20-step baseline of the steps trained again
NAN_RUN, BUDGET_RUN = "run-rollback-2-nan", "run-rollback-budget"


@dataclass
class Paced:
    """The paced jobs' store, once their collector stopped, each job's exit status by run id, and the
    directory of their checkpoints (one per run)."""

    db: Path
    status: dict[str, int]
    checkpoints: Path


@pytest.fixture(scope="module")
def paced(tmp_path_factory) -> Paced:
    """The 2-rank jobs paced by PACE, one after the other through one collector that also looks every 0.5 s,
    stopped after the last: a NaN at AT; and spikes at AT and SECOND past a budget of one rollback."""
    directory = tmp_path_factory.mktemp("paced")
    with job_collector(directory, "--analyze-every", "0.5") as collector:
        status = {
            NAN_RUN: paced_job(collector, NAN_RUN, STEPS, [f"nan:at={AT}"], directory),
            BUDGET_RUN: paced_job(
                collector,
                BUDGET_RUN,
                200,  # it stops at the second spike
                [f"spike:at={AT},scale=50", f"spike:at={SECOND},scale=50"],
                directory,
                "--max-rollbacks",
                "1",
            ),
        }
    return Paced(collector.db, status, directory)


def paced_job(collector: Collector, run: str, steps: int, faults: list[str], checkpoints: Path, *args: str) -> int:
    """A 2-rank job paced by PACE keeping 16 snapshots in memory, its checkpoints in `checkpoints`/`run`."""
    return train(
        nproc=2,
        steps=steps,
        run_id=run,
        faults=[*faults, PACE],
        collector=collector.url,
        token=collector.token,
        trainer_args=["--ckpt-memory", "16", "--ckpt-dir", str(checkpoints / run), *args],
    )


def rolled_back_once(db: Path, run: str, nproc: int, at: int, steps: int) -> dict:
    """Exactly one rollback, for the anomaly at step `at`, served from memory on every rank, so none for the
    job's clean steps either; every step is kept once per rank and none after the anomaly is bad; the
    post-mortem tells it. The rollback's result."""
    commands = query(db, "SELECT kind, state, args, result FROM commands WHERE run_id = ?", [run])
    assert len(commands) == 1, commands
    kind, state, args, result = commands[0]
    args, result = json.loads(args), json.loads(result)
    assert (kind, state, args["before_step"]) == ("rollback", "applied", at - 5)  # the policy's margin of 5 steps
    assert result["restored_step"] <= at - 5 and result["from_step"] > at and result["skipped_batches"] == 20
    events = query(db, "SELECT rank, step FROM events WHERE run_id = ? AND event = 'rollback' ORDER BY rank", [run])
    assert [r for r, _ in events] == list(range(nproc)) and {s for _, s in events} == {result["restored_step"]}
    restored = query(
        db,
        "SELECT rank, step, attrs FROM events WHERE run_id = ? AND event = 'checkpoint_restored' ORDER BY rank",
        [run],
    )
    assert [(r, s, json.loads(a)["rankwatch.checkpoint.tier"]) for r, s, a in restored] == [
        (r, result["restored_step"], "memory") for r in range(nproc)
    ]
    rows, distinct, bad, last_loss = _kept(db, run)  # every step once per rank, none after the anomaly bad
    assert rows == distinct == nproc * steps and bad == 0 and last_loss < 10
    # the post-mortem tells it too, though the trajectory it replays no longer holds the anomaly's steps
    with duckdb.connect(str(db), read_only=True) as con:
        report = analyze_run(con, run)
    (told,) = [f for f in report.findings if f.analyzer == "anomalies"]
    assert told.step_start == at and f"restored step {result['restored_step']}" in told.summary, told.summary
    assert told.evidence["rollback"]["state"] == "applied"
    return result


def _kept(db, run: str) -> tuple[int, int, int, float]:
    """The trajectory the job kept: its rank-steps, distinct rank-steps, bad losses and last loss."""
    ((rows, distinct, bad, last_loss),) = query(
        db,
        """SELECT count(*), count(DISTINCT (rank, step)), count(*) FILTER (NOT isfinite(loss) OR loss > 20),
                  max_by(loss, step) FROM current_steps WHERE run_id = ?""",
        [run],
    )
    return rows, distinct, bad, last_loss


def test_a_nan_is_rolled_back_once_and_training_goes_on(paced):
    """A NaN on a 2-rank job: exactly one rollback, served from memory on every rank, and the job trains on
    (a 50x loss spike on a 1-rank job: below)."""
    assert paced.status[NAN_RUN] == 0
    rolled_back_once(paced.db, NAN_RUN, 2, AT, STEPS)


def test_at_about_a_second_a_step_a_spike_is_rolled_back_from_memory_within_two_steps(collector_factory, tmp_path):
    """A 1-rank job whose steps 14 to 24 take a second more (a 1 s pause in each, once) and whose loss
    spikes 50x at step 21: exactly one rollback, applied from memory within two steps of the spike's end
    (at step 24 at the latest; the step boundary right after the spike comes before its span is even
    sent); looks every 5 steps and polls every 2 s applied it at step 25 at the earliest. The job keeps
    each step once, none of them bad, and trains on."""
    collector = collector_factory(None, "--analyze-every", "3600")  # only commits drive passes
    run = "run-rollback-slow-steps"
    status = train(
        nproc=1,
        steps=26,
        run_id=run,
        faults=["spike:at=21,scale=50", *(f"hang:rank=0,at={s},seconds=1" for s in range(14, 25))],
        collector=collector.url,
        token=collector.token,
        trainer_args=["--snapshot-every", "5", "--ckpt-memory", "16", "--ckpt-dir", str(tmp_path / "ckpt")],
    )
    assert status == 0
    collector.stop()
    result = rolled_back_once(collector.db, run, 1, 21, 26)  # a 1-rank job's rollback, as the 2-rank one's above
    assert result["from_step"] <= 24, result


def test_past_its_budget_the_job_stops_with_its_good_state_durable(paced):
    """--max-rollbacks 1: the first spike is rolled back, the second stops the job, back at its
    last good snapshot and with that snapshot on disk; the collector names the stop, critical."""
    run, ckpt, db = BUDGET_RUN, paced.checkpoints / BUDGET_RUN, paced.db
    assert paced.status[run] == 0  # a clean stop
    commands = query(db, "SELECT id, state, args, result FROM commands WHERE run_id = ? ORDER BY id", [run])
    assert [state for _, state, _, _ in commands] == ["applied", "failed"], commands
    result = json.loads(commands[1][3])
    assert result["restored_step"] <= json.loads(commands[1][2])["before_step"] < SECOND < result["from_step"]
    assert result["why"].startswith(
        f"1 rollbacks within 1000 steps: stopping instead of another, with step {result['restored_step']} durable in "
    )
    for rank in (0, 1):  # the good state, on disk and verified, to resume from
        disk = Checkpointer(ckpt / f"rank-{rank}", {})
        assert result["restored_step"] in disk.durable_steps()
        disk.close()
    ((last_step,),) = query(db, "SELECT max(step) FROM steps WHERE run_id = ?", [run])
    assert last_step < result["from_step"]  # no step after the stop
    ((kind, state, severity, summary),) = query(
        db,
        "SELECT kind, state, severity, summary FROM findings WHERE run_id = ? AND analyzer = 'rollbacks'",
        [run],
    )
    assert (kind, state, severity) == ("stopped", "firing", "critical")
    assert summary.startswith(f"the job stopped at step {result['from_step']} instead of another rollback: 1 rollbacks")
    first = json.loads(commands[0][3])  # the stop names each rollback and what it answered
    assert (
        f"(the rollbacks: at step {first['from_step']}: command {commands[0][0]}, for loss_spike, back to step "
        f"{first['restored_step']}; this one command {commands[1][0]}, for loss_spike, back to step "
        f"{result['restored_step']})"
    ) in summary


def test_anomalies_of_the_abandoned_steps_send_no_second_rollback():
    """A NaN at step 158, in the steps the job ran on after a loss spike at 150 before its rollback
    landed, is on the trajectory that rollback abandoned: no rollback of its own (it would spend
    the budget on a healthy run); a NaN drawn after the rollback is a new anomaly, and gets one."""
    import duckdb

    from collector.analysis import findings
    from collector.analysis.analyzers import Finding
    from collector.control import commands
    from collector.store.schema import DDL

    con = duckdb.connect()
    con.execute(DDL)

    def anomaly(kind: str, step: int) -> Finding:
        return Finding("r", kind, [0], step, step, "critical", 9.0, f"{kind} at {step}", analyzer="anomalies")

    policy = commands.RollbackPolicy()
    findings.record(con, "r", "anomalies", [anomaly("loss_spike", 150)])
    (sent,) = commands.rollbacks_for_anomalies(con, "r", policy)
    commands.update(con, sent["id"], "acked", apply_step=160)
    findings.record(con, "r", "anomalies", [anomaly("loss_spike", 150), anomaly("nan", 158)])  # before it landed
    commands.update(con, sent["id"], "applied", result={"restored_step": 140})
    assert commands.rollbacks_for_anomalies(con, "r", policy) == []
    findings.record(con, "r", "anomalies", [])  # the replayed steps are sane
    findings.record(con, "r", "anomalies", [anomaly("nan", 158)])  # and later NaN for real
    (again,) = commands.rollbacks_for_anomalies(con, "r", policy)
    assert (again["args"]["anomaly"], again["args"]["before_step"]) == ("nan", 153)
