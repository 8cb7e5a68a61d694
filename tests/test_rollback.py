"""Automatic rollback end to end: a real torchrun job whose loss turns NaN (or spikes) is rolled
back by the collector's anomaly analyzer, exactly once, and trains on with a sane loss."""

import json

import pytest

from rankwatch.launch import train
from tests.otlp_payloads import query

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
