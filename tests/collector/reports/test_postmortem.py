"""`rankwatch analyze RUN`: the analyzers over a whole run, from a store file.

Covered: simulated runs go through a real collector into a store; afterwards
`rankwatch analyze` finds a straggler that came and went with the steps it
lasted, a persistent one up to the last step, nothing in a clean run, and
prints JSON or a table; an unknown run, a missing store and a store held by a
running collector are one-line errors with exit 2.
"""

import functools
import json
from collections.abc import Callable

import pytest

from tests.support.collectors import simulated_store
from tests.support.commands import rankwatch_in_process
from tests.support.otlp_payloads import query

pytestmark = pytest.mark.long

RUNS = {
    "pm-clean": [],
    "pm-transient": ["straggler:rank=6,slowdown=1.3,from=20,to=50"],
    "pm-persistent": ["straggler:rank=11,slowdown=1.15,from=30"],
}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return simulated_store(tmp_path_factory.mktemp("postmortem"), RUNS, ["--ranks", "16", "--steps", "80"])


@pytest.fixture(scope="module")
def analyze(store) -> Callable[..., list[dict]]:
    """A run's findings as `rankwatch analyze --json` gives them: what went wrong (or, `recommendations`,
    the power recommendations the collector draws beside it). The command only reads the store, so each
    run's report is made once for the module's tests."""

    @functools.cache
    def report(run: str) -> dict:
        result = rankwatch_in_process("analyze", run, "--db", str(store), "--json")
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)

    def findings(run: str, recommendations: bool = False) -> list[dict]:
        told = report(run)
        assert told["run"] == run
        return [f for f in told["findings"] if (f["analyzer"] == "power") == recommendations]

    return findings


def test_clean_run_has_no_finding(analyze):
    assert analyze("pm-clean") == []


def test_the_power_recommendations_the_collector_draws_are_told_too_and_say_they_are_simulated(analyze):
    told = analyze("pm-clean", recommendations=True)
    assert {f["kind"] for f in told} == {"job_cap", "per_rank_caps"}
    assert all(f["severity"] == "info" and f["summary"].startswith("simulated GPUs") for f in told)


def test_straggler_that_came_and_went_is_reported_with_its_steps(analyze):
    (finding,) = analyze("pm-transient")
    assert (finding["analyzer"], finding["kind"], finding["ranks"]) == ("stragglers", "rank", [6])
    assert 14 <= finding["step_start"] <= 26
    assert 47 <= finding["step_end"] <= 59  # until the judged window (12 steps) moved past step 50
    assert finding["score"] == pytest.approx(1.3, rel=0.05)
    assert finding["evidence"]["lost_s_per_step"] > 0


def test_persistent_straggler_lasts_to_the_last_step(analyze):
    (finding,) = analyze("pm-persistent")
    assert (finding["kind"], finding["ranks"]) == ("rank", [11])
    assert 24 <= finding["step_start"] <= 36
    assert finding["step_end"] >= 70


def test_table_output_names_the_rank(store):
    result = rankwatch_in_process("analyze", "pm-persistent", "--db", str(store))
    assert result.returncode == 0, result.stderr
    assert "1 finding, 2 recommendations" in result.stdout and "rank 11" in result.stdout


def test_unknown_run_is_a_one_line_error(store):
    result = rankwatch_in_process("analyze", "no-such-run", "--db", str(store))
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "no steps for run 'no-such-run'" in result.stderr
    assert "pm-clean" in result.stderr  # the runs it does have


def test_missing_store_is_a_one_line_error(tmp_path):
    result = rankwatch_in_process("analyze", "r", "--db", str(tmp_path / "none.duckdb"))
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and "no store at" in result.stderr


def test_store_held_by_a_collector_is_a_one_line_error(collector):
    result = rankwatch_in_process("analyze", "r", "--db", str(collector.db))
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and "running collector" in result.stderr


@pytest.mark.parametrize("run", ["pm-transient", "pm-persistent"])
def test_the_post_mortem_gives_the_onset_and_span_the_collector_recorded_live(store, analyze, run):
    """One fault, one story: `analyze` tells each episode with the onset the live finding (and so the dashboard,
    the alert and the demo) gave it, not a second estimate of its own."""
    (told,) = analyze(run)
    recorded = query(
        store,
        "SELECT step_start, summary FROM findings WHERE run_id = ? AND analyzer = 'stragglers' AND kind = 'rank'",
        [run],
    )
    assert recorded == [(told["step_start"], told["summary"])]
    assert f"since step {told['step_start']}" in told["summary"]
