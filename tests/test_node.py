"""The node's sidecar (`rankwatch node`, rankwatch/agent/node.py): a rank hands it its telemetry and does no encoding
or export of its own.

Real parts: a `rankwatch node` process on a Unix socket, a real collector, rank processes running the
agent. Covered: what a rank sends through the sidecar is stored as what it would export itself (every
step once, its phases, collectives and values); what a rank handed over outlives the rank (killed) and
a collector that was away when it was handed over; a rank whose sidecar is not there, or goes away
mid-job, says so once and exports its own telemetry, losing no step recorded after; the sidecar refuses
a socket path that exists in one line, and its socket is its owner's alone.
"""

import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from rankwatch.agent.apiclient import ApiClient
from tests.conftest import rankwatch_cli, wait_until
from tests.otlp_payloads import query

pytestmark = pytest.mark.long

TOKEN = "test-token-0123456"

# One rank: `steps` steps of four phases, a gloo all-reduce in the backward (a collective of its own group),
# a loss and tokens; then, after `then`: "exit" shuts the agent down, "kill" SIGKILLs the process a second
# after its last step (what was handed over by then is all the sidecar has), "wait" waits for a file first.
RANK = """
import os, signal, sys, time
import torch, torch.distributed as dist
from rankwatch import agent

collector, run_id, steps, then = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[5], rank=0, world_size=1)
agent.init(rank=0, world_size=1, collector=collector, token=os.environ["TOKEN"], run_id=run_id, cuda=False)
agent.watch_collectives()
t = torch.ones(256)
for i in range(steps):
    if then.startswith("wait:") and i == steps // 2:
        print("half", flush=True)
        while not os.path.exists(then[5:]):
            time.sleep(0.05)
    with agent.step(i):
        with agent.phase("data"):
            time.sleep(0.002)
        with agent.phase("forward"):
            time.sleep(0.005)
        with agent.phase("backward"):
            dist.all_reduce(t)
        with agent.phase("optimizer"):
            time.sleep(0.001)
        agent.record(loss=1.0 / (i + 1), tokens=100)
print("trained", flush=True)
if then == "kill":
    time.sleep(1.0)
    os.kill(os.getpid(), signal.SIGKILL)
agent.shutdown()
"""


def free_port() -> str:
    from tests.conftest import free_port as port

    return str(port())


class Node:
    """A `rankwatch node` process listening at `path`."""

    def __init__(self, path: Path, collector_url: str, env: dict | None = None):
        self.path = path
        self.process = subprocess.Popen(
            [sys.executable, "-m", "rankwatch", "node", "--socket", str(path), "--collector", collector_url],
            env={**os.environ, "RANKWATCH_TOKEN": TOKEN, **(env or {})},
            stderr=subprocess.PIPE,
            text=True,
        )
        wait_until(lambda: path.exists() or self.process.poll() is not None, "the sidecar did not listen", 60)
        assert path.exists(), self.process.stderr.read() if self.process.stderr else ""

    def stop(self, sig: int = signal.SIGTERM) -> tuple[int, str]:
        self.process.send_signal(sig)
        _, err = self.process.communicate(timeout=120)
        return self.process.returncode, err


def rank(tmp_path: Path, collector_url: str, run_id: str, steps: int, then: str = "exit", node: Path | None = None):
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    env = {**os.environ, "TOKEN": TOKEN, "RANKWATCH_NODE": str(node) if node else ""}
    return subprocess.Popen(
        [sys.executable, str(script), collector_url, run_id, str(steps), then, free_port()],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def api_rows(collector, sql: str) -> list:
    return ApiClient(collector.url, collector.token).post("/api/v1/query", {"sql": sql})["rows"]


def stored(db: Path, run_id: str) -> dict:
    """What the store holds of a run, in the terms a rank's telemetry promises, times aside."""
    steps = query(db, "SELECT step, loss, tokens FROM steps WHERE run_id = ? ORDER BY step", [run_id])
    ops = query(
        db,
        "SELECT kind, name, count(*), count(DISTINCT step) FROM ops WHERE run_id = ? GROUP BY ALL ORDER BY ALL",
        [run_id],
    )
    return {"steps": steps, "ops": ops}


def test_a_ranks_telemetry_through_the_sidecar_is_stored_as_it_would_send_it_itself(collector, tmp_path):
    node = Node(tmp_path / "node.sock", collector.url)
    jobs = [rank(tmp_path, collector.url, "via-node", 30, node=node.path), rank(tmp_path, collector.url, "own", 30)]
    for job in jobs:
        _, err = job.communicate(timeout=120)
        assert job.returncode == 0, err
        assert "sidecar" not in err, err
    status, err = node.stop()
    assert status == 0, err
    collector.stop()
    through, itself = stored(collector.db, "via-node"), stored(collector.db, "own")
    assert through["steps"] == [(i, 1.0 / (i + 1), 100) for i in range(30)]
    assert through == itself
    assert ("comm", "all_reduce", 30, 30) in through["ops"]
    assert {name for kind, name, *_ in through["ops"] if kind == "phase"} == {
        "data",
        "forward",
        "backward",
        "optimizer",
    }


def test_what_a_rank_handed_over_outlives_the_rank_and_the_collectors_outage(collector, tmp_path):
    collector.stop()  # away while the rank trains, and after it died
    node = Node(tmp_path / "node.sock", collector.url)
    job = rank(tmp_path, collector.url, "killed", 40, "kill", node=node.path)
    job.communicate(timeout=120)
    assert job.returncode == -signal.SIGKILL
    collector.start()  # the same port and store
    status, err = node.stop()  # delivers what waits before it exits
    assert status == 0, err
    collector.stop()
    assert stored(collector.db, "killed")["steps"] == [(i, 1.0 / (i + 1), 100) for i in range(40)]


def test_a_rank_without_its_sidecar_says_so_once_and_exports_its_own(collector, tmp_path):
    job = rank(tmp_path, collector.url, "no-node", 10, node=tmp_path / "nobody.sock")
    _, err = job.communicate(timeout=120)
    assert job.returncode == 0, err
    assert err.count("no node sidecar at") == 1, err
    collector.stop()
    assert len(stored(collector.db, "no-node")["steps"]) == 10


def test_a_rank_whose_sidecar_dies_mid_job_exports_the_rest_itself(collector, tmp_path):
    node = Node(tmp_path / "node.sock", collector.url)
    go_on = tmp_path / "go-on"
    job = rank(tmp_path, collector.url, "node-died", 40, f"wait:{go_on}", node=node.path)
    assert job.stdout and job.stdout.readline().strip() == "half"
    wait_until(
        lambda: api_rows(collector, "SELECT count(*) FROM steps WHERE run_id = 'node-died'") == [[20]],
        "the first half not delivered by the sidecar",
        60,
    )
    node.stop(signal.SIGKILL)
    go_on.touch()
    _, err = job.communicate(timeout=120)
    assert job.returncode == 0, err
    assert err.count("the node sidecar went away") == 1, err
    collector.stop()
    steps = [step for step, *_ in stored(collector.db, "node-died")["steps"]]
    assert steps == list(range(40))


def test_the_sidecars_socket_is_its_owners_and_an_existing_path_is_refused(collector, tmp_path):
    node = Node(tmp_path / "node.sock", collector.url)
    try:
        assert stat.S_IMODE(os.stat(node.path).st_mode) & 0o077 == 0
        again = rankwatch_cli("node", "--socket", str(node.path), "--collector", collector.url)
        assert again.returncode == 2
        assert again.stderr.strip().splitlines() == [
            f"rankwatch: error: {node.path}: already exists (another node's socket?)"
        ]
    finally:
        node.stop()
