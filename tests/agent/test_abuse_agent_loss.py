"""Telemetry loss on the sending side: nothing the agent or the fleet simulator drops goes uncounted.

(a) A rank whose queue overflows (the OpenTelemetry SDK's batch processor dropped the oldest trace
    silently) counts what it dropped, spans and rank-steps apart, and sends the counts to the collector
    as `telemetry_loss` events: while it runs, from the export thread, and at exit; the counts are what
    the store lacks. (b) A batch the collector refuses (a 4xx, or items refused in a partial success) is
    counted, not retried forever. (c) `rankwatch simulate` against a collector whose write queue holds one
    request paces itself to the acknowledgements: every rank-step is stored, exit 0. (d) Against a
    collector stopped for good mid-run, it exits 3 and says how many rank-steps were lost: exactly those
    the store lacks.
"""

import os
import signal
import subprocess
import sys
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from rankwatch.agent import semconv as sc
from rankwatch.agent.apiclient import ApiClient
from rankwatch.agent.export import Exporter
from rankwatch.agent.lost import Lost
from tests.support import loopback
from tests.support.commands import rankwatch_in_process
from tests.support.otlp_payloads import query
from tests.support.waits import wait_until

pytestmark = pytest.mark.long

T0 = 1_700_000_000 * 10**9


def _rows(collector, sql: str, *params) -> list:
    return ApiClient(collector.url, collector.token).post("/api/v1/query", {"sql": sql, "params": list(params)})["rows"]


def _step(step: int, children: int = 1, **values) -> list[tuple]:
    """A step's trace: its step span and `children` phase spans."""
    start = T0 + step % 10**6 * 10**9
    spans = [("step", start, start + 10**9, {sc.KIND: sc.KIND_STEP, sc.STEP: step, **values})]
    return spans + [("forward", start, start + 10**8, {sc.KIND: sc.KIND_PHASE, sc.STEP: step})] * children


def _loss_events(collector, run_id: str) -> list[tuple[int, int, int]]:
    """(rank, spans dropped, rank-steps dropped) of the run's telemetry_loss events, in arrival order."""
    return [
        tuple(row)
        for row in _rows(
            collector,
            f"SELECT rank, (attrs->>{sc.json_path(sc.SPANS_DROPPED)})::BIGINT, "
            f"(attrs->>{sc.json_path(sc.RANK_STEPS_DROPPED)})::BIGINT FROM events "
            "WHERE run_id = ? AND event = ? ORDER BY ts",
            run_id,
            sc.EVENT_TELEMETRY_LOSS,
        )
    ]


def test_a_full_queue_is_counted_and_reported_while_running_and_at_exit(module_collector):
    collector, run_id, steps = module_collector, "run-queue-full", 300
    exporter = Exporter(collector.url, collector.token, {sc.RUN_ID: run_id, sc.RANK: 3}, queue_traces=8)
    for step in range(steps):  # far faster than a batch every 250 ms empties a queue of 8
        exporter.trace(_step(step, children=2))
    wait_until(lambda: _loss_events(collector, run_id), "no telemetry_loss event while the rank runs", 30)
    rank, spans, rank_steps = _loss_events(collector, run_id)[0]
    assert rank == 3 and rank_steps > 0 and spans == 3 * rank_steps  # a step and its two phases, each lost
    exporter.trace(_step(steps, children=2))
    exporter.flush()
    exporter.shutdown()
    lost, samples = exporter.undelivered()
    stored = _rows(collector, "SELECT count(*) FROM steps WHERE run_id = ?", run_id)[0][0]
    assert lost.rank_steps == steps + 1 - stored and lost.rank_steps >= steps - 16, (lost, stored)
    assert lost == Lost(spans=3 * lost.rank_steps, rank_steps=lost.rank_steps) and samples == 0
    assert _rows(collector, "SELECT count(*) FROM ops WHERE run_id = ?", run_id)[0][0] == 2 * stored
    # the last event has the final, cumulative counts: the collector can tell what the rank lost
    assert _loss_events(collector, run_id)[-1] == (3, lost.spans, lost.rank_steps)


def test_refused_exports_are_counted_not_retried(module_collector):
    """A wrong token (401) loses every span; a step the collector cannot store (2^40 and past) is
    refused alone in a partial success, the other step stored."""
    collector = module_collector
    refused = Exporter(collector.url, "not-the-token", {sc.RUN_ID: "run-refused", sc.RANK: 0})
    for step in range(5):
        refused.trace(_step(step))
    started = time.monotonic()
    refused.flush()
    refused.shutdown()
    # and the loss report, refused too
    assert refused.undelivered() == (Lost(spans=10, rank_steps=5, records=1), 0)
    assert time.monotonic() - started < 5  # refused for good: no backlog, no retries

    partial = Exporter(collector.url, collector.token, {sc.RUN_ID: "run-partial", sc.RANK: 0})
    partial.trace(_step(2**40, children=0))
    partial.trace(_step(1))
    partial.flush()
    partial.shutdown()
    assert partial.undelivered() == (Lost(spans=1, rank_steps=1), 0)
    assert _rows(collector, "SELECT step FROM steps WHERE run_id = 'run-partial'") == [[1]]
    assert _rows(collector, "SELECT step FROM ops WHERE run_id = 'run-partial'") == [[1]]
    assert _loss_events(collector, "run-partial") == [(0, 1, 1)]


def _requests(collector, code: str) -> float:
    page = loopback.get(f"{collector.url}/metrics", timeout=30).text
    return sum(
        s.value
        for family in text_string_to_metric_families(page)
        for s in family.samples
        if s.name == "rankwatch_collector_requests_total" and s.labels.get("code") == code
    )


def test_simulate_paces_itself_to_a_collector_that_takes_one_request_at_a_time(collector_factory):
    collector = collector_factory(
        None, "--max-queue-bytes", "1", "--workers", "2"
    )  # a request waits alone; the others get 503
    ranks, steps = 32, 30  # enough requests from its 4 senders that some overlap, even on a loaded machine
    result = rankwatch_in_process(
        *("simulate", "--ranks", str(ranks), "--tp", "2", "--steps", str(steps), "--run", "paced"),
        *("--collector", collector.url),
        env={"RANKWATCH_TOKEN": collector.token},
    )
    assert result.returncode == 0, result.stderr
    assert f"{ranks * steps} rank-steps ({3 * ranks * steps} spans: steps and their collectives)" in result.stdout
    assert _requests(collector, "503") > 0, "the collector never pushed back: the test proves nothing"
    assert _rows(collector, "SELECT count(*), count(DISTINCT (rank, step)) FROM steps WHERE run_id = 'paced'") == [
        [ranks * steps, ranks * steps]
    ]
    assert _loss_events(collector, "paced") == []


def test_simulate_against_a_collector_gone_for_good_counts_what_the_store_lacks(collector_factory):
    collector = collector_factory()
    ranks, steps = 32, 250
    command = ("simulate", "--ranks", str(ranks), "--steps", str(steps), "--run", "gone", "--collector", collector.url)
    simulator = subprocess.Popen(
        [sys.executable, "-m", "rankwatch", *command],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "RANKWATCH_TOKEN": collector.token},
    )
    wait_until(lambda: _rows(collector, "SELECT count(*) FROM steps")[0][0] > 0, "no step arrived", 60)
    assert collector.stop(signal.SIGTERM) in (0, -signal.SIGTERM)  # drained: what it acknowledged is stored
    out, err = simulator.communicate(timeout=240)
    assert simulator.returncode == 3, (out, err)
    stored = query(collector.db, "SELECT count(*) FROM steps WHERE run_id = 'gone'")[0][0]
    lost = ranks * steps - stored
    assert 0 < stored < ranks * steps
    assert f"rankwatch simulate: error: run gone: {lost} rank-steps ({2 * lost} spans)" in err, err
    assert f"never reached {collector.url}" in err and "sent to" not in out


def test_a_round_of_samples_larger_than_a_request_may_carry_is_sent_whole(module_collector):
    """A collector refuses a request of more than 100,000 entries whole: the exporter sends a larger
    round of device samples (16,384 simulated GPUs' ten readings) in slices, every one stored. (Each
    slice is answered once committed: the time a loaded machine's collector takes is no part of it.)"""
    run_id = "many-samples"
    attributes = {sc.RUN_ID: run_id, sc.RANK: 0}
    exporter = Exporter(module_collector.url, module_collector.token, attributes, timeout_s=60)
    points = [("DCGM_FI_DEV_POWER_USAGE", T0 + i, 300.0, {sc.RANK: i % 16384}) for i in range(120_001)]
    assert exporter.samples(points)
    exporter.shutdown()
    assert exporter.samples_refused == 0
    assert _rows(module_collector, "SELECT count(*) FROM device_samples WHERE run_id = ?", run_id) == [[120_001]]
