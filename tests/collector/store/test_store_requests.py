"""The writer's request registry (collector/store/requests.py) on a real DuckDB store: each request type
answered by the handler its module registered, with a typed reply; a handler's refusals reach the caller
as they are, anything else as a RuntimeError (a future must settle), and a request nobody handles is a
LookupError. The paths through a running collector are tests/collector/control/test_control.py, test_query_api.py and
test_prometheus.py."""

from dataclasses import dataclass

import pytest

from collector.analysis.healthcounters import HealthCounters
from collector.analysis.live import Analysis
from collector.control import commands
from collector.metrics import runs as runmetrics
from collector.store import readonly, requests
from collector.store.db import connect, create_tables

pytestmark = pytest.mark.unit  # pure code on small inputs: `make check` runs these


@pytest.fixture
def context(tmp_path):
    con = connect(tmp_path / "store.duckdb")
    create_tables(con)
    yield requests.Context(con)
    con.close()


def test_each_operation_is_answered_by_its_module(context):
    created = requests.answer(context, commands.CreateCommand("run-a", "rollback", {"before_step": 3}, "api"))
    assert (created["state"], created["args"]) == ("pending", {"before_step": 3})
    updated = requests.answer(context, commands.UpdateCommand(created["id"], "acked", apply_step=5))
    assert (updated["state"], updated["apply_step"]) == ("acked", 5)
    assert [c["id"] for c in requests.answer(context, commands.ListCommands("run-a"))] == [created["id"]]
    answer = requests.answer(context, readonly.Query("SELECT run_id, state FROM commands"))
    assert answer["rows"] == [["run-a", "acked"]]
    snapshot = requests.answer(context, runmetrics.SnapshotRequest())
    assert isinstance(snapshot, runmetrics.Snapshot) and snapshot.steps == []


def test_where_each_request_runs():
    assert requests.beside(readonly.Query("SELECT 1")) and requests.beside(runmetrics.SnapshotRequest())
    assert not requests.beside(commands.ListCommands("run-a"))  # writes go in order with the commits


def test_refusals_pass_and_other_failures_are_runtime_errors(context):
    with pytest.raises(commands.CommandError, match="unknown command kind"):
        requests.answer(context, commands.CreateCommand("run-a", "reboot", {}, "api"))
    with pytest.raises(LookupError, match="no command 7"):
        requests.answer(context, commands.UpdateCommand(7, "acked"))
    with pytest.raises(readonly.QueryRefused, match="only SELECT"):
        requests.answer(context, readonly.Query("DELETE FROM commands"))
    context.con.execute("DROP VIEW current_steps")  # the run metrics read it: DuckDB's error, not a refusal
    with pytest.raises(RuntimeError, match="current_steps"):
        requests.answer(context, runmetrics.SnapshotRequest())


def test_health_counters_go_to_the_writers_analysis(context):
    with pytest.raises(RuntimeError, match="runs no Analysis"):
        requests.answer(context, HealthCounters({200: 1}, {}, 0, 1))
    analysis = Analysis()
    requests.answer(requests.Context(context.con, (analysis,)), HealthCounters({200: 1}, {0.1: 1}, 5, 10))
    assert analysis.health.reported[0]["requests"] == {200: 1} and analysis.health.reported[0]["queue_bytes"] == 5


@dataclass(frozen=True)
class _Unhandled(requests.Request[None]):
    pass


def test_a_request_without_a_handler_and_a_second_handler():
    with pytest.raises(LookupError, match="no handler for _Unhandled"):
        requests.answer(requests.Context(None), _Unhandled())
    assert not requests.beside(_Unhandled())
    with pytest.raises(TypeError, match="already has a handler"):
        requests.handles(readonly.Query)(lambda context, query: None)
