"""A rank that dies is told, with its cause, and what it finished is kept.

Real parts: an unmodified two-rank gloo DDP script (tests/jobs/plain_ddp.py) under `rankwatch run` (so
with the node's sidecar) and a real collector. Rank 1 fails as it begins step 6: raising torch's
OutOfMemoryError, killed by SIGKILL, or exiting with code 3 through os._exit. Each time: the job exits
nonzero; rank 1's `rank_failed` event names the cause and step 6 (the exception's type, message and stack;
the exit code), said by the rank itself, or for the SIGKILL by the sidecar on its behalf; rank 0, which
torchrun stops once rank 1 is gone, is told as stopped with the job after rank 1 failed; neither rank says
it `ended` cleanly; and every step rank 1 finished (0 to 5) is stored. The kernel's OOM killer's count is
read through the cgroup files (a hardware boundary): a count that rose while a rank was gone makes its
cause `killed_out_of_memory`. The jobs share one collector, each a run of its own, whose store is read once
it has stopped after the last.
"""

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from rankwatch.agent import semconv as sc
from rankwatch.agent.node import MEMORY_EVENTS_ENV
from tests.support.collectors import Collector, job_collector
from tests.support.commands import rankwatch_cli, rankwatch_in_process
from tests.support.otlp_payloads import query
from tests.support.zero_code import SCRIPT, TORCHRUN

# the module's jobs run in one fixture, within the time the tests that ran one each had together
pytestmark = [pytest.mark.long, pytest.mark.timeout(5 * 300)]

AT = 6
DYING = ("--die-rank", "1", "--die-at", str(AT))
DIED = {"oom": "died-oom", "kill": "died-killed", "exit": "died-exit"}  # how rank 1 dies -> the run


@dataclass
class Endings:
    """The module's store, once its collector stopped, and each job's `rankwatch run` by its run id."""

    db: Path
    jobs: dict[str, subprocess.CompletedProcess]


@pytest.fixture(scope="module")
def endings(tmp_path_factory) -> Endings:
    """Rank 1 dying at step AT in each way, a failure torchrun restarts the job after, and a rank gone while
    the OOM killer's count rose: one after another through one collector, stopped after the last."""
    directory = tmp_path_factory.mktemp("endings")
    with job_collector(directory) as collector:
        jobs = {run: ddp_job(collector, run, "--steps", "40", *DYING, "--die-how", how) for how, run in DIED.items()}
        jobs["restarted"] = ddp_job(
            collector,
            "restarted",
            *("--steps", "20", *DYING, "--die-how", "oom", "--die-once"),
            torchrun_args=("--max-restarts", "2"),
            # a fresh store for each attempt: in the rendezvous' shared one, a restarted rank may read the address
            # its peer had before the restart and fail to connect (pytorch/pytorch#135712), as `rankwatch train`
            # sets it
            env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},
        )
        gone_while_the_oom_killer_killed(collector, directory)
    return Endings(collector.db, jobs)


def ddp_job(
    collector: Collector, run_id: str, *script_args: str, torchrun_args: tuple[str, ...] = (), env: dict | None = None
) -> subprocess.CompletedProcess:
    """`rankwatch run -- torchrun` of the plain DDP script on two ranks, sending to `collector`."""
    return rankwatch_cli(
        *("run", "--collector", collector.url, "--run", run_id, "--", TORCHRUN, "--standalone"),
        *("--nproc-per-node", "2", *torchrun_args, str(SCRIPT), *script_args),
        env={"RANKWATCH_TOKEN": collector.token, **(env or {})},
    )


def gone_while_the_oom_killer_killed(collector: Collector, directory: Path) -> None:
    """Run "oom-killed": a rank beside a sidecar that reads the OOM killer's count of its cgroup (the file
    stands in for the kernel's), SIGKILLed as the count rises."""
    from tests.support.sidecar import RANK, Node

    events = directory / "memory.events"
    events.write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n")
    node = Node(directory / "node.sock", collector.url, env={MEMORY_EVENTS_ENV: str(events)})
    script = directory / "rank.py"
    script.write_text(RANK)
    rank = subprocess.Popen(
        [sys.executable, str(script), collector.url, "oom-killed", "200", f"wait:{directory / 'never'}"],
        env={**os.environ, "TOKEN": collector.token, "RANKWATCH_NODE": str(node.path)},
        stdout=subprocess.PIPE,
        text=True,
    )
    assert rank.stdout and rank.stdout.readline().strip() == "half"
    events.write_text("low 0\nhigh 0\nmax 5\noom 2\noom_kill 2\n")
    rank.send_signal(signal.SIGKILL)
    rank.wait(timeout=60)
    node.stop()


def failures(db: Path, run_id: str) -> dict[int, tuple]:
    """rank -> (step, attributes, body) of its rank_failed event (one each)."""
    rows = query(
        db,
        "SELECT rank, step, attrs, body FROM events WHERE run_id = ? AND event = ?",
        [run_id, sc.EVENT_RANK_FAILED],
    )
    assert len({rank for rank, *_ in rows}) == len(rows), rows
    return {rank: (step, json.loads(attrs), body) for rank, step, attrs, body in rows}


def died(endings: Endings, how: str) -> dict[int, tuple]:
    """The job with rank 1 failing at step AT: each rank's failure (rank 0's follows rank 1's: stopped by torchrun
    with the job, or its collective raising as its peer's connection closed)."""
    run_id = DIED[how]
    job = endings.jobs[run_id]
    assert job.returncode != 0, job.stderr[-2000:]
    told = failures(endings.db, run_id)
    assert set(told) == {0, 1}, told
    _, attributes, body = told[0]  # stopped: by torchrun's SIGTERM (told by the sidecar), or its collective raised
    assert attributes[sc.FAILURE_CAUSE] == sc.CAUSE_TERMINATED, told[0]
    assert "after rank 1 failed" in body or "by peer" in attributes.get(sc.FAILURE_MESSAGE, ""), told[0]
    assert told[1][0] == AT, told[1]
    finished = query(endings.db, "SELECT step FROM steps WHERE run_id = ? AND rank = 1 ORDER BY step", [run_id])
    assert [s for (s,) in finished] == list(range(AT)), finished
    ended = query(endings.db, "SELECT rank FROM events WHERE run_id = ? AND event = 'ended'", [run_id])
    assert ended == [], ended
    return told


def test_a_rank_raising_out_of_memory_tells_it_with_its_stack(endings):
    _, attributes, body = died(endings, "oom")[1]
    assert attributes[sc.FAILURE_CAUSE] == sc.CAUSE_OUT_OF_MEMORY
    assert attributes[sc.FAILURE_EXCEPTION] == "torch.OutOfMemoryError"
    assert attributes[sc.FAILURE_MESSAGE].startswith("CUDA out of memory. Tried to allocate 2.00 GiB")
    assert body.startswith("Traceback") and "in die" in body, body
    assert attributes[sc.ATTEMPT] == 0


def test_a_rank_killed_without_a_word_is_told_by_its_sidecar(endings):
    _, attributes, body = died(endings, "kill")[1]
    assert attributes[sc.FAILURE_CAUSE] in (sc.CAUSE_KILLED, sc.CAUSE_KILLED_OUT_OF_MEMORY)
    assert "without a word" in body or "OOM killer" in body, body


def test_a_rank_exiting_with_a_code_tells_it(endings):
    _, attributes, _ = died(endings, "exit")[1]
    assert (attributes[sc.FAILURE_CAUSE], attributes[sc.FAILURE_EXIT_CODE]) == (sc.CAUSE_EXIT, 3)


def test_a_failed_attempt_that_torchrun_restarts_is_told_as_such(endings):
    """torchrun restarts the job after rank 1's failure (the script trains from its start again): the failure is
    the first attempt's, and the run's analysis says a restart followed. (Up to two restarts: on a loaded machine
    a restarted gloo group may fail to connect once, which is then a later attempt's failure of its own.)"""
    job = endings.jobs["restarted"]
    assert job.returncode == 0, job.stderr[-3000:]
    first = query(
        endings.db,
        "SELECT attrs FROM events WHERE run_id = 'restarted' AND event = ? AND rank = 1 ORDER BY ts LIMIT 1",
        [sc.EVENT_RANK_FAILED],
    )
    told = json.loads(first[0][0])
    assert (told[sc.FAILURE_CAUSE], told[sc.ATTEMPT]) == (sc.CAUSE_OUT_OF_MEMORY, 0), told
    analyzed = rankwatch_in_process("analyze", "restarted", "--db", str(endings.db), "--json")
    assert analyzed.returncode == 0, analyzed.stderr
    found = [f for f in json.loads(analyzed.stdout)["findings"] if f["kind"] == "failure"]
    (attempt_0,) = [f for f in found if f["evidence"]["attempt"] == 0]
    assert (attempt_0["ranks"], attempt_0["evidence"]["restarted"]) == ([1], True)


def test_a_rank_gone_while_the_oom_killer_killed_is_told_out_of_memory(endings):
    """The sidecar reads the OOM killer's count of its cgroup (the file stands in for the kernel's)."""
    _, attributes, body = failures(endings.db, "oom-killed")[0]
    assert attributes[sc.FAILURE_CAUSE] == sc.CAUSE_KILLED_OUT_OF_MEMORY, body
