"""A straggler's onset, through a real collector: the step its finding says it began ("since step N", and
its `step_start`) is the first step the ranks were slow, to within the detection's resolution, while the
run goes on, at its end and in `rankwatch analyze`; it does not move to the start of a later pass's
history as the slowdown outlasts it (a slow rank from step 40 read "since step 97", later "247")."""

import json
import re
import time

import numpy as np
import pytest

from collector.reports.query import run_remote
from rankwatch.agent import semconv as sc
from tests.support.commands import rankwatch_in_process
from tests.support.engine_jobs import MS, exporters, send_steps
from tests.support.otlp_payloads import query
from tests.support.waits import wait_until

pytestmark = pytest.mark.long

# run: (ranks, the slow ones, their slowdown, the step they turn slow at); chosen so that the slowdown lasts
# past the straggler analyzer's longest history (96 steps), as a real one does
CASES = {
    "slow-from-0": (8, [3], 1.3, 0),
    "pair-from-30": (6, [1, 4], 2.0, 30),
    "of-two-from-60": (2, [1], 1.5, 60),
}
STEPS, CHUNK = 180, 10  # steps sent a chunk at a time, each chunk committed and judged by a pass of its own
TOLERANCE = 6  # half the analyzer's shortest window: a median crosses halfway to a slowdown that late or early
JITTER = 0.02


def _compute(ranks: int, slow: list[int], slowdown: float, onset: int):
    noise = 1 + JITTER * np.random.default_rng(ranks).standard_normal((STEPS, ranks))
    return lambda rank, step: 0.08 * noise[step, rank] * (slowdown if rank in slow and step >= onset else 1.0)


def _judged_to(collector, run: str) -> int:
    rows = run_remote(collector.url, collector.token, f"SELECT step FROM analysis_cursors WHERE run_id = '{run}'")[1]
    return rows[0][0] if rows else -1


def _straggler(collector, run: str) -> dict:
    """The run's one straggler finding, as the collector holds it now (its query API)."""
    columns, rows, _ = run_remote(
        collector.url,
        collector.token,
        f"SELECT ranks, step_start, summary, state FROM findings WHERE run_id = '{run}' AND analyzer = 'stragglers' "
        "AND kind <> 'widespread'",
    )
    (found,) = rows
    return dict(zip(columns, found))


def _assert_onset(finding: dict, slow: list[int], onset: int, where: str) -> None:
    assert list(finding["ranks"]) == slow, (where, finding)
    assert abs(finding["step_start"] - onset) <= TOLERANCE, (where, onset, finding)
    assert re.search(rf"since step {finding['step_start']}\b", finding["summary"]), (where, finding)


def test_onset_is_the_first_slow_step_live_at_the_end_and_after(collector_factory):
    collector = collector_factory(None, "--analyze-every", "1")
    t0 = time.time_ns() - STEPS * 100 * MS
    sending = {run: exporters(collector, run, ranks) for run, (ranks, *_) in CASES.items()}
    for start in range(0, STEPS, CHUNK):
        for run, (ranks, slow, slowdown, onset) in CASES.items():
            send_steps(sending[run], range(start, start + CHUNK), t0, compute=_compute(ranks, slow, slowdown, onset))
        if start + CHUNK in (STEPS // 2, STEPS):  # live: midway, and with the whole run judged before it ends
            for run, (_, slow, _, onset) in CASES.items():
                wait_until(lambda run=run: _judged_to(collector, run) >= start + CHUNK - 1, f"{run} not judged")
                _assert_onset(_straggler(collector, run), slow, onset, f"live, steps 0-{start + CHUNK - 1}")
    for run in CASES:
        for exporter in sending[run].values():
            exporter.event(sc.EVENT_ENDED, time.time_ns(), {})
            exporter.flush()
    for run in CASES:
        wait_until(lambda run=run: _straggler(collector, run)["state"] == "ended", f"{run} not ended")
    collector.stop()
    for run, (_, slow, _, onset) in CASES.items():
        (stored,) = query(
            collector.db,
            "SELECT ranks, step_start, summary FROM findings WHERE run_id = ? AND analyzer = 'stragglers'",
            [run],
        )
        _assert_onset(dict(zip(["ranks", "step_start", "summary"], stored)), slow, onset, "ended")
        result = rankwatch_in_process("analyze", run, "--db", str(collector.db), "--json")
        assert result.returncode == 0, result.stderr
        (replayed,) = [f for f in json.loads(result.stdout)["findings"] if f["analyzer"] == "stragglers"]
        _assert_onset(replayed, slow, onset, "rankwatch analyze")
