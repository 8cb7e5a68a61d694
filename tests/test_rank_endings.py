"""A rank that dies is told, with its cause, and what it finished is kept.

Real parts: an unmodified two-rank gloo DDP script (tests/jobs/plain_ddp.py) under `rankwatch run` (so
with the node's sidecar) and a real collector. Rank 1 fails as it begins step 6: raising torch's
OutOfMemoryError, killed by SIGKILL, or exiting with code 3 through os._exit. Each time: the job exits
nonzero; rank 1's `rank_failed` event names the cause and step 6 (the exception's type, message and stack;
the exit code), said by the rank itself, or for the SIGKILL by the sidecar on its behalf; rank 0, which
torchrun stops once rank 1 is gone, is told as stopped with the job after rank 1 failed; neither rank says
it `ended` cleanly; and every step rank 1 finished (0 to 5) is stored. The kernel's OOM killer's count is
read through the cgroup files (a hardware boundary): a count that rose while a rank was gone makes its
cause `killed_out_of_memory`.
"""

import json
import os
import signal
import subprocess
import sys

import pytest

from rankwatch.agent import semconv as sc
from rankwatch.agent.node import MEMORY_EVENTS_ENV
from tests.conftest import rankwatch_cli
from tests.otlp_payloads import query
from tests.test_zero_code import SCRIPT, TORCHRUN, two_ranks

pytestmark = pytest.mark.long

AT = 6


def failures(collector, run_id: str) -> dict[int, tuple]:
    """rank -> (step, attributes, body) of its rank_failed event (one each)."""
    rows = query(
        collector.db,
        "SELECT rank, step, attrs, body FROM events WHERE run_id = ? AND event = ?",
        [run_id, sc.EVENT_RANK_FAILED],
    )
    assert len({rank for rank, *_ in rows}) == len(rows), rows
    return {rank: (step, json.loads(attrs), body) for rank, step, attrs, body in rows}


def died(collector, run_id: str, how: str) -> dict[int, tuple]:
    """The job with rank 1 failing at step AT: each rank's failure (rank 0's follows rank 1's: stopped by torchrun
    with the job, or its collective raising as its peer's connection closed)."""
    dying = ("--die-rank", "1", "--die-at", str(AT), "--die-how", how)
    job = two_ranks(collector, run_id, SCRIPT, "--steps", "40", *dying)
    assert job.returncode != 0, job.stderr[-2000:]
    told = failures(collector, run_id)
    assert set(told) == {0, 1}, told
    _, attributes, body = told[0]  # stopped: by torchrun's SIGTERM (told by the sidecar), or its collective raised
    assert attributes[sc.FAILURE_CAUSE] == sc.CAUSE_TERMINATED, told[0]
    assert "after rank 1 failed" in body or "by peer" in attributes.get(sc.FAILURE_MESSAGE, ""), told[0]
    assert told[1][0] == AT, told[1]
    finished = query(collector.db, "SELECT step FROM steps WHERE run_id = ? AND rank = 1 ORDER BY step", [run_id])
    assert [s for (s,) in finished] == list(range(AT)), finished
    ended = query(collector.db, "SELECT rank FROM events WHERE run_id = ? AND event = 'ended'", [run_id])
    assert ended == [], ended
    return told


def test_a_rank_raising_out_of_memory_tells_it_with_its_stack(collector):
    _, attributes, body = died(collector, "died-oom", "oom")[1]
    assert attributes[sc.FAILURE_CAUSE] == sc.CAUSE_OUT_OF_MEMORY
    assert attributes[sc.FAILURE_EXCEPTION] == "torch.OutOfMemoryError"
    assert attributes[sc.FAILURE_MESSAGE].startswith("CUDA out of memory. Tried to allocate 2.00 GiB")
    assert body.startswith("Traceback") and "in die" in body, body
    assert attributes[sc.ATTEMPT] == 0


def test_a_rank_killed_without_a_word_is_told_by_its_sidecar(collector):
    _, attributes, body = died(collector, "died-killed", "kill")[1]
    assert attributes[sc.FAILURE_CAUSE] in (sc.CAUSE_KILLED, sc.CAUSE_KILLED_OUT_OF_MEMORY)
    assert "without a word" in body or "OOM killer" in body, body


def test_a_rank_exiting_with_a_code_tells_it(collector):
    _, attributes, _ = died(collector, "died-exit", "exit")[1]
    assert (attributes[sc.FAILURE_CAUSE], attributes[sc.FAILURE_EXIT_CODE]) == (sc.CAUSE_EXIT, 3)


def test_a_failed_attempt_that_torchrun_restarts_is_told_as_such(collector, tmp_path):
    """torchrun restarts the job after rank 1's failure (the script trains from its start again): the failure is
    the first attempt's, and the run's analysis says a restart followed. (Up to two restarts: on a loaded machine
    a restarted gloo group may fail to connect once, which is then a later attempt's failure of its own.)"""
    dying = ("--die-rank", "1", "--die-at", str(AT), "--die-how", "oom", "--die-once")
    job = rankwatch_cli(
        *("run", "--collector", collector.url, "--run", "restarted", "--", TORCHRUN, "--standalone"),
        *("--nproc-per-node", "2", "--max-restarts", "2", str(SCRIPT), "--steps", "20", *dying),
        # a fresh store for each attempt: in the rendezvous' shared one, a restarted rank may read the address its
        # peer had before the restart and fail to connect (pytorch/pytorch#135712), as `rankwatch train` sets it
        env={"RANKWATCH_TOKEN": collector.token, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},
    )
    collector.stop()
    assert job.returncode == 0, job.stderr[-3000:]
    first = query(
        collector.db,
        "SELECT attrs FROM events WHERE run_id = 'restarted' AND event = ? AND rank = 1 ORDER BY ts LIMIT 1",
        [sc.EVENT_RANK_FAILED],
    )
    told = json.loads(first[0][0])
    assert (told[sc.FAILURE_CAUSE], told[sc.ATTEMPT]) == (sc.CAUSE_OUT_OF_MEMORY, 0), told
    analyzed = rankwatch_cli("analyze", "restarted", "--db", str(collector.db), "--json")
    assert analyzed.returncode == 0, analyzed.stderr
    found = [f for f in json.loads(analyzed.stdout)["findings"] if f["kind"] == "failure"]
    (attempt_0,) = [f for f in found if f["evidence"]["attempt"] == 0]
    assert (attempt_0["ranks"], attempt_0["evidence"]["restarted"]) == ([1], True)


def test_a_rank_gone_while_the_oom_killer_killed_is_told_out_of_memory(collector, tmp_path):
    """The sidecar reads the OOM killer's count of its cgroup (the file stands in for the kernel's)."""
    from tests.test_node import RANK, Node, free_port

    events = tmp_path / "memory.events"
    events.write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n")
    node = Node(tmp_path / "node.sock", collector.url, env={MEMORY_EVENTS_ENV: str(events)})
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    rank = subprocess.Popen(
        [sys.executable, str(script), collector.url, "oom-killed", "200", f"wait:{tmp_path / 'never'}", free_port()],
        env={**os.environ, "TOKEN": collector.token, "RANKWATCH_NODE": str(node.path)},
        stdout=subprocess.PIPE,
        text=True,
    )
    assert rank.stdout and rank.stdout.readline().strip() == "half"
    events.write_text("low 0\nhigh 0\nmax 5\noom 2\noom_kill 2\n")
    rank.send_signal(signal.SIGKILL)
    rank.wait(timeout=60)
    node.stop()
    collector.stop()
    _, attributes, body = failures(collector, "oom-killed")[0]
    assert attributes[sc.FAILURE_CAUSE] == sc.CAUSE_KILLED_OUT_OF_MEMORY, body
