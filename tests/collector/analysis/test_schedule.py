"""The live analysis's pass schedule (collector/analysis/schedule.py): a run judged to its end leaves the
runs under analysis, unless a commit brought it something while that pass judged it; a rank's failure
wakes a pass as its end does."""

import pyarrow as pa
import pytest

from collector.analysis.schedule import PassSchedule
from rankwatch.agent import semconv as sc

pytestmark = pytest.mark.unit  # pure code on small inputs: `make check` runs these


def test_a_run_heard_from_while_its_end_was_judged_is_judged_again():
    """A rank's last report (of the telemetry its agent dropped) committed between the pass taking the run
    and its end being judged: the run stays under analysis, and the next pass reads that report too."""
    schedule = PassSchedule(interval_s=3600)
    schedule.heard(["r"], steps=True, ended=["r"])
    assert schedule.due(every=False, last=False, judged=()).runs == ["r"]
    schedule.heard(["r"], steps=False)  # the report, committed while the pass judges the run
    schedule.ended("r")
    assert schedule.active() == {"r"}
    assert schedule.due(every=True, last=False, judged={"r"}).runs == ["r"]
    schedule.ended("r")  # judged to its end again, nothing heard meanwhile
    assert schedule.active() == set()


def test_a_run_judged_to_its_end_with_nothing_after_leaves_the_analysis():
    schedule = PassSchedule(interval_s=3600)
    schedule.heard(["r", "s"], steps=True, ended=["r"])
    assert schedule.due(every=False, last=False, judged=()).runs == ["r", "s"]
    schedule.ended("r")
    assert schedule.active() == {"s"}
    schedule.heard(["r"], steps=False)  # a heartbeat after the end: judged again, as any run heard from
    assert schedule.active() == {"r", "s"}


def test_a_ranks_failure_wakes_a_pass_as_its_end_does():
    schedule = PassSchedule(interval_s=3600)
    events = pa.table({"run_id": ["r", "s", "t"], "event": [sc.EVENT_RANK_FAILED, sc.EVENT_ENDED, "heartbeat"]})
    schedule.take({"events": [events]})
    due = schedule.due(every=False, last=False, judged={"r", "s", "t"})
    assert due.ended == {"r", "s"} and due.runs == ["r", "s"]
