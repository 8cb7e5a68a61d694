"""The analyzers running inside a real collector while a real job trains: findings rows appear."""

import json

from rankwatch.launch import train
from tests.otlp_payloads import query


def test_straggler_of_a_live_job_becomes_a_firing_finding(collector_factory):
    collector = collector_factory(None, "--analyze-every", "1")
    status = train(nproc=4, steps=60, run_id="run-live", faults=["straggler:rank=2,slowdown=2.5,from=15"],
                   collector=collector.url, token=collector.token)
    assert status == 0
    collector.stop()
    rows = query(collector.db, """SELECT kind, ranks, state, score, step_start, evidence FROM findings
                                  WHERE run_id = 'run-live' AND analyzer = 'stragglers' AND kind = 'rank'""")
    assert rows, query(collector.db, "SELECT analyzer, kind, ranks, state, summary FROM findings")
    kind, ranks, state, score, step_start, evidence = rows[-1]
    assert (kind, list(ranks), state) == ("rank", [2], "firing")
    assert score > 1.3 and step_start >= 10
    assert json.loads(evidence)["lost_s_per_step"] > 0
    # no hang was reported for a job that kept stepping
    assert query(collector.db, "SELECT count(*) FROM findings WHERE run_id = 'run-live' AND analyzer = 'hangs'") \
        == [(0,)]
