"""Findings in the store (collector/analysis/findings.py): an episode that stopped of itself is not
drawn again when late steps make the engine judge its steps again; after a rollback that went back to
them, the new trajectory's steps are judged afresh."""

import duckdb
import pytest

from collector.analysis import findings
from collector.analysis.analyzers import Finding, anomalies
from collector.control import commands
from collector.store.schema import DDL

pytestmark = pytest.mark.unit  # pure code on small inputs: `make check` runs these

READS = {"anomalies": anomalies.READS}


def spike() -> Finding:
    return Finding("r", "loss_spike", [], 45, 45, "critical", 9.0, "loss spike at step 45", analyzer="anomalies")


def rows(con) -> list[tuple]:
    return con.execute("SELECT step_start, state FROM findings ORDER BY id").fetchall()


def test_steps_judged_again_after_late_steps_draw_no_second_episode():
    con = duckdb.connect()
    con.execute(DDL)
    findings.record_pass(con, "r", {"anomalies": [spike()]}, READS, last=46)
    findings.record_pass(con, "r", {"anomalies": []}, READS, last=80)  # the episode stopped of itself
    assert rows(con) == [(45, "resolved")]
    findings.record_pass(con, "r", {"anomalies": [spike()]}, READS, last=80)  # a rank's late batch: 40-50 again
    assert rows(con) == [(45, "resolved")]


def test_after_a_rollback_to_before_it_the_same_spike_is_a_new_episode():
    con = duckdb.connect()
    con.execute(DDL)
    findings.record_pass(con, "r", {"anomalies": [spike()]}, READS, last=80)
    (sent,) = commands.rollbacks_for_anomalies(con, "r", commands.RollbackPolicy())
    commands.update(con, sent["id"], "applied", result={"restored_step": 40})
    findings.record_pass(con, "r", {"anomalies": [spike()]}, READS, last=80)  # the trajectory trained again
    assert rows(con) == [(45, "resolved"), (45, "resolved")]
