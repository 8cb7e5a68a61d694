"""The agent while its collector is away: training goes on, telemetry waits and arrives late.

Covered: a real agent process (one rank, steady 0.25 s steps) whose collector
is stopped with SIGTERM until the first export has failed (at least 4 s) and
restarted on the same port and store: the job exits 0 on time, no step of it
was slowed down, every step row is in the store exactly once with its values,
and a `telemetry_backlog` event reports spans delivered late and none dropped.
The same when the collector is back only shortly before the job ends (the
backlog then goes out in the shutdown's last try): a second job, through the
same outage of the same collector, ended as soon as it is back. With no collector at all:
20 steps and the shutdown finish in bounded time, the 'unreachable' warning is
printed once although the export fails more than once, the lost spans are
counted, and the shutdown does not sit in the OTLP SDK's retry backoff.
"""

import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.collectors import free_port, job_collector
from tests.support.otlp_payloads import query

pytestmark = [pytest.mark.long, pytest.mark.timeout(2 * 300)]  # both jobs run in one fixture: 300 s each

PACE = 0.25  # s per step
STEPS = 160  # long enough that the job outlives a collector restart on a busy machine

# One rank: steady steps (the forward phase sleeps to the next tick), one line per step on stdout.
LOOP = """
import sys, time
from rankwatch import agent

collector, run_id, steps, pace = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
agent.init(rank=0, world_size=1, collector=collector, token="test-token-0123456", run_id=run_id)
start = time.monotonic()
for i in range(steps):
    with agent.step(i):
        with agent.phase("forward"):
            time.sleep(max(start + (i + 1) * pace - time.monotonic(), 0))
        agent.record(loss=1.0 / (i + 1), tokens=100)
    print(f"step {i}", flush=True)
loop_end = time.monotonic()
agent.shutdown()
print(f"loop {loop_end - start:.3f} shutdown {time.monotonic() - loop_end:.3f}", flush=True)
"""


class Job:
    """A script (LOOP, UNTIL) as a subprocess with `args`, its stdout and stderr lines collected as they come."""

    def __init__(self, tmp_path: Path, name: str, script: str, *args: str):
        path = tmp_path / f"{name}.py"
        path.write_text(script)
        self.started = time.monotonic()
        self.process = subprocess.Popen(
            [sys.executable, str(path), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=tmp_path,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.stdout: list[str] = []
        self.stderr: list[str] = []
        self._changed = threading.Condition()
        self._readers = [
            threading.Thread(target=self._read, args=(stream, lines), daemon=True)
            for stream, lines in ((self.process.stdout, self.stdout), (self.process.stderr, self.stderr))
        ]
        for reader in self._readers:
            reader.start()

    def _read(self, stream, lines: list[str]) -> None:
        for line in stream:
            with self._changed:
                lines.append(line.rstrip("\n"))
                self._changed.notify_all()

    def wait_for(self, lines: list[str], text: str, timeout_s: float) -> None:
        with self._changed:
            found = self._changed.wait_for(
                lambda: any(text in line for line in lines) or self.process.poll() is not None, timeout=timeout_s
            )
        assert found and any(text in line for line in lines), (
            f"no {text!r} after {timeout_s}s; stdout {self.stdout[-5:]}, stderr {self.stderr[-10:]}"
        )

    def finish(self, timeout_s: float) -> tuple[int, float]:
        """(exit status, wall seconds since start)."""
        status = self.process.wait(timeout=timeout_s)
        elapsed = time.monotonic() - self.started
        for reader in self._readers:
            reader.join(timeout=10)
        return status, elapsed

    def kill(self) -> None:
        """Where it still runs (a failed wait), killed: a failed test leaves nothing behind."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


# Steps until a file appears, so the test decides when the job ends.
UNTIL = """
import os, sys, time
from rankwatch import agent

collector, run_id, stop_file = sys.argv[1:4]
agent.init(rank=0, world_size=1, collector=collector, token="test-token-0123456", run_id=run_id)
i = 0
while not os.path.exists(stop_file):
    with agent.step(i):
        with agent.phase("forward"):
            time.sleep(0.1)
        agent.record(loss=1.0 / (i + 1))
    print(f"step {i}", flush=True)
    i += 1
agent.shutdown()
print(f"steps {i}", flush=True)
"""


@dataclass
class Outage:
    """One outage of a collector as two jobs lived it: the store; the stop's exit status; how long the collector
    was down; and each job (the steady LOOP, run-outage, and the one ended as soon as the collector was back,
    run-outage-late) as it ended, with the steps the steady one had made when the collector was back."""

    db: Path
    stop_status: int
    down_s: float
    steady: Job
    steady_ended: tuple[int, float]  # exit status, wall s
    steady_steps_at_restart: int
    late: Job
    late_ended: tuple[int, float]


@pytest.fixture(scope="module")
def outage(tmp_path_factory) -> Outage:
    """Both jobs sending to one collector, stopped with SIGTERM once both have stepped and started again on the same
    port and store once each job's first export has failed and it has been down 4 s or more (a collector costs
    seconds of CPU to start: the two jobs share its outage)."""
    tmp = tmp_path_factory.mktemp("outage")
    stop_file = tmp / "stop"
    with job_collector(tmp) as collector:
        jobs: list[Job] = []
        try:
            late = Job(tmp, "until", UNTIL, collector.url, "run-outage-late", str(stop_file))
            jobs.append(late)
            late.wait_for(late.stdout, "step 3", timeout_s=60)
            # started once the other one steps, so that its start-up on a loaded machine is its own
            steady = Job(tmp, "loop", LOOP, collector.url, "run-outage", str(STEPS), str(PACE))
            jobs.append(steady)
            steady.wait_for(steady.stdout, "step 3", timeout_s=60)
            stop_status = collector.stop()
            stopped_at = time.monotonic()
            # each agent noticed: its first failed export (the SDK retries ~3 s inside it) printed the warning;
            # the late job's next retry is >= 5 s after it
            for job in (steady, late):
                job.wait_for(job.stderr, "unreachable", timeout_s=20)
            time.sleep(max(0.0, 4.0 - (time.monotonic() - stopped_at)))  # down for at least 4 s
            collector.start()  # the same port and store
            restarted_at = time.monotonic()
            stop_file.touch()
            steps_at_restart = sum(line.startswith("step ") for line in steady.stdout)
            steady_ended = steady.finish(timeout_s=STEPS * PACE + 60)  # it ends last, on time: waited for first
            late_ended = late.finish(timeout_s=60)
        finally:
            for job in jobs:
                job.kill()
    return Outage(
        collector.db,
        stop_status,
        restarted_at - stopped_at,
        steady,
        steady_ended,
        steps_at_restart,
        late,
        late_ended,
    )


def test_collector_outage_and_restart(outage):
    run_id = "run-outage"
    job = outage.steady
    assert outage.stop_status in (0, -15)  # SIGTERM: drained and stopped (uvicorn re-raises the signal)
    steps_done = outage.steady_steps_at_restart
    assert steps_done < STEPS - 8, "the job ended too early for a periodic retry to deliver the backlog"

    status, _ = outage.steady_ended
    assert status == 0, job.stderr
    # no stall: the loop steps to a clock, so it ends on time unless a step waited for the network; its
    # own figure, not the process's wall time, whose start-up and last flush to a collector on a loaded
    # machine are not the steps' (the fixture's wait bounds those)
    loop_s = float(job.stdout[-1].split()[1])
    assert loop_s < STEPS * PACE + 5, job.stdout[-1]
    assert outage.down_s >= 4.0
    assert [line for line in job.stdout if line.startswith("step ")] == [f"step {i}" for i in range(STEPS)]
    assert sum("unreachable; training goes on" in line for line in job.stderr) == 1, job.stderr
    assert not any("never delivered" in line for line in job.stderr), job.stderr

    rows = query(
        outage.db,
        "SELECT step, count(*), any_value(loss), any_value(tokens), max(duration_s) "
        "FROM steps WHERE run_id = ? GROUP BY step ORDER BY step",
        [run_id],
    )
    assert [(step, count) for step, count, *_ in rows] == [(i, 1) for i in range(STEPS)]
    for step, _, loss, tokens, duration in rows:
        assert loss == 1.0 / (step + 1) and tokens == 100
        assert duration < PACE + 1.0, (step, duration)  # training never waited for the network (~3 s a try)
    phases = query(
        outage.db,
        "SELECT count(*), count(DISTINCT step) FROM ops WHERE run_id = ? AND kind = 'phase' AND name = 'forward'",
        [run_id],
    )
    assert phases == [(STEPS, STEPS)]

    backlog = query(
        outage.db, "SELECT rank, attrs FROM events WHERE run_id = ? AND event = 'telemetry_backlog'", [run_id]
    )
    assert len(backlog) == 1, backlog
    rank, attrs = backlog[0][0], json.loads(backlog[0][1])
    assert rank == 0
    assert attrs["rankwatch.spans_dropped"] == 0
    assert 0 < attrs["rankwatch.spans_delivered_late"] <= 2 * STEPS  # a step span and a phase span per step


def test_backlog_event_when_the_collector_returns_just_before_the_end(outage):
    """The collector is back, but the job ends before the backlog's next periodic retry (5 s after
    the failure): shutdown's last try delivers the outage's spans, so they were delivered late and
    the `telemetry_backlog` event must say so."""
    run_id = "run-outage-late"
    status, _ = outage.late_ended
    err = "\n".join(outage.late.stderr)
    assert status == 0, err
    steps = int(outage.late.stdout[-1].split()[1])
    # the data made it: every step, once (the collector was back before the job ended)
    stored = query(
        outage.db,
        "SELECT count(*), count(DISTINCT step), min(step), max(step) FROM steps WHERE run_id = ?",
        [run_id],
    )
    assert stored == [(steps, steps, 0, steps - 1)], (
        f"{steps} steps ran, stored (rows, distinct steps, first, last) = {stored}; the collector was back "
        f"before agent.shutdown(), which must try it once more. Agent stderr: {err.strip()}"
    )
    backlog = query(outage.db, "SELECT attrs FROM events WHERE run_id = ? AND event = 'telemetry_backlog'", [run_id])
    assert len(backlog) == 1, (
        "spans of the outage were delivered late by the shutdown's last try, but no telemetry_backlog event "
        "reports it (rankwatch/agent/session.py Session.shutdown reads the backlog counters before exporter.shutdown())"
    )
    attrs = json.loads(backlog[0][0])
    assert attrs["rankwatch.spans_dropped"] == 0 and attrs["rankwatch.spans_delivered_late"] > 0


@pytest.fixture(scope="module")
def nowhere(tmp_path_factory):
    """20 fast steps with nothing listening on the collector's port: (exit status, wall s, stdout, stderr)."""
    tmp = tmp_path_factory.mktemp("nowhere")
    job = Job(tmp, "loop", LOOP, f"http://127.0.0.1:{free_port()}", "run-nowhere", "20", "0.01")
    status, elapsed = job.finish(timeout_s=60)
    return status, elapsed, job.stdout, job.stderr


def test_no_collector_at_all(nowhere):
    """The loop and its shutdown finish in bounded time and the warning comes once (the spans
    exporter fails twice: at the flush and at shutdown's last try)."""
    status, elapsed, stdout, stderr = nowhere
    assert status == 0, stderr
    assert [line for line in stdout if line.startswith("step ")] == [f"step {i}" for i in range(20)]
    loop_s = float(stdout[-1].split()[1])  # the loop itself: start-up, on a loaded machine, is not its doing
    assert loop_s < 5 and elapsed < 60, (elapsed, stdout[-1])
    unreachable = [line for line in stderr if "unreachable; training goes on" in line]
    assert len(unreachable) == 1, stderr
    assert "http://127.0.0.1:" in unreachable[0] and "training goes on" in unreachable[0]
    # all that was recorded is reported lost, once: 20 steps, their 20 step spans and 20 phase spans
    assert [line for line in stderr if "never delivered" in line] == [
        "rankwatch: 20 rank-steps (40 spans) of rank 0 were never delivered to the collector"
    ]


def test_shutdown_without_collector_does_not_wait_out_retries(nowhere):
    """rankwatch/agent/export.py's Backlog promises that the shutdown at the end of a job does not wait out a
    connection timeout while the collector is away. A refused connection fails in milliseconds, yet
    each try goes through the OTLP SDK's own retry loop (backoff 1 s then 2 s within the 5 s timeout)."""
    status, _, stdout, stderr = nowhere
    assert status == 0, stderr
    shutdown_s = float(stdout[-1].split()[3])
    assert shutdown_s < 3.0, f"agent.shutdown() took {shutdown_s:.1f} s with the collector unreachable"
