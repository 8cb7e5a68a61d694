"""Automatic rollback end to end: a real torchrun job whose loss turns NaN (or spikes) is rolled
back by the collector's anomaly analyzer, exactly once, and trains on with a sane loss; past its
rollback budget it stops, its good state durable, and the collector says so."""

import json

import pytest

from rankwatch.launch import train
from tests.otlp_payloads import query
from trainer.checkpoint import Checkpointer

# a 3x straggler paces the tiny CPU job so that detection (analysis every 0.5 s, commands fetched
# every 2 s, looked at every 5 steps) lands well within the 160 steps the memory snapshots reach back
PACE = "straggler:rank=0,slowdown=3,from=0"


@pytest.mark.parametrize("fault", ["nan:at=50", "spike:at=50,scale=50"])
def test_anomaly_is_rolled_back_once_and_training_goes_on(collector_factory, tmp_path, fault):
    collector = collector_factory(None, "--analyze-every", "0.5")
    run = "run-rollback-" + fault.split(":")[0]
    status = train(nproc=2, steps=160, run_id=run, faults=[fault, PACE], collector=collector.url,
                   token=collector.token, trainer_args=["--ckpt-memory", "16", "--ckpt-dir", str(tmp_path / "ckpt")])
    assert status == 0
    collector.stop()
    commands = query(collector.db, "SELECT kind, state, args, result FROM commands WHERE run_id = ?", [run])
    assert len(commands) == 1, commands
    kind, state, args, result = commands[0]
    args, result = json.loads(args), json.loads(result)
    assert (kind, state, args["before_step"]) == ("rollback", "applied", 45)
    assert result["restored_step"] <= 45 and result["from_step"] > 50 and result["skipped_batches"] == 20
    events = query(collector.db, "SELECT rank, step FROM events WHERE run_id = ? AND event = 'rollback' ORDER BY rank",
                   [run])
    assert [r for r, _ in events] == [0, 1] and {s for _, s in events} == {result["restored_step"]}
    # the trajectory the job kept: every step once per rank, none after the anomaly bad
    ((rows, distinct, bad, last_loss),) = query(collector.db, """
        SELECT count(*), count(DISTINCT (rank, step)), count(*) FILTER (NOT isfinite(loss) OR loss > 20),
               max_by(loss, step) FROM current_steps WHERE run_id = ?""", [run])
    assert rows == distinct == 2 * 160 and bad == 0 and last_loss < 10


def test_past_its_budget_the_job_stops_with_its_good_state_durable(collector_factory, tmp_path):
    """--max-rollbacks 1: the first spike is rolled back, the second stops the job, back at its
    last good snapshot and with that snapshot on disk; the collector names the stop, critical."""
    collector = collector_factory(None, "--analyze-every", "0.5")
    run, ckpt = "run-rollback-budget", tmp_path / "ckpt"
    status = train(nproc=2, steps=200, run_id=run, faults=["spike:at=50,scale=50", "spike:at=120,scale=50", PACE],
                   collector=collector.url, token=collector.token,
                   trainer_args=["--ckpt-memory", "16", "--ckpt-dir", str(ckpt), "--max-rollbacks", "1"])
    assert status == 0  # a clean stop
    collector.stop()
    commands = query(collector.db, "SELECT state, args, result FROM commands WHERE run_id = ? ORDER BY id", [run])
    assert [state for state, _, _ in commands] == ["applied", "failed"], commands
    result = json.loads(commands[1][2])
    assert result["restored_step"] <= json.loads(commands[1][1])["before_step"] < 120 < result["from_step"]
    assert result["why"].startswith("1 rollbacks within 1000 steps: stopping instead of another, with step "
                                    f"{result['restored_step']} durable in ")
    for rank in (0, 1):  # the good state, on disk and verified, to resume from
        disk = Checkpointer(ckpt / f"rank-{rank}", {})
        assert result["restored_step"] in disk.durable_steps()
        disk.close()
    ((last_step,),) = query(collector.db, "SELECT max(step) FROM steps WHERE run_id = ?", [run])
    assert last_step < result["from_step"]  # no step after the stop
    ((kind, state, severity, summary),) = query(
        collector.db, "SELECT kind, state, severity, summary FROM findings WHERE run_id = ? AND analyzer = 'rollbacks'",
        [run])
    assert (kind, state, severity) == ("stopped", "firing", "critical")
    assert summary.startswith(f"the job stopped at step {result['from_step']} instead of another rollback: 1 rollbacks")
