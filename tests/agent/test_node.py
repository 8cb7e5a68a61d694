"""The node's sidecar (`rankwatch node`, rankwatch/agent/node.py): a rank hands it its telemetry and does no encoding
or export of its own.

Real parts: a `rankwatch node` process on a Unix socket, a real collector, rank processes running the
agent. Covered: what a rank sends through the sidecar is stored as what it would export itself (every
step once, its phases, collectives and values); what a rank handed over outlives the rank (killed) and
a collector that was away when it was handed over; a rank whose sidecar is not there, or goes away
mid-job, says so once and exports its own telemetry, losing no step recorded after; the sidecar refuses
a socket path that exists in one line, and its socket is its owner's alone. Each scenario is a run of its own,
all sent to one collector (away for one of them), which is then stopped so that its store can be read.
"""

import os
import signal
import stat
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from rankwatch.agent.apiclient import ApiClient
from tests.support.collectors import job_collector
from tests.support.commands import rankwatch_cli
from tests.support.otlp_payloads import query
from tests.support.sidecar import RANK, TOKEN, Node
from tests.support.waits import wait_until

pytestmark = [pytest.mark.long, pytest.mark.timeout(4 * 300)]  # 4 scenarios run before the store is read: 300 s each


def rank(tmp_path: Path, collector_url: str, run_id: str, steps: int, then: str = "exit", node: Path | None = None):
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    env = {**os.environ, "TOKEN": TOKEN, "RANKWATCH_NODE": str(node) if node else ""}
    return subprocess.Popen(
        [sys.executable, str(script), collector_url, run_id, str(steps), then],
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


@dataclass
class Ended:
    """How a scenario's rank processes ended, (exit status, stderr) each, and its sidecar, where it had one."""

    ranks: list[tuple[int, str]]
    node: tuple[int, str] | None = None


@dataclass
class SideBySide(Ended):
    """The ranks through the sidecar and on their own, and the sidecar; and, before the ranks started, its
    socket, the socket's permission bits and a second sidecar's try at the same path."""

    socket: Path = Path()
    socket_mode: int = 0
    again: subprocess.CompletedProcess | None = None


def ended(job: subprocess.Popen) -> tuple[int, str]:
    _, err = job.communicate(timeout=120)
    return job.returncode, err


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """The module's collector, stopped at the module's end (a collector costs seconds of CPU to start)."""
    with job_collector(tmp_path_factory.mktemp("collector")) as collector:
        yield collector


@pytest.fixture(scope="module")
def side_by_side(live, tmp_path_factory) -> SideBySide:
    """30 steps of a rank through the sidecar (run via-node) and of one exporting its own (run own), at once."""
    tmp = tmp_path_factory.mktemp("via-node")
    node = Node(tmp / "node.sock", live.url)
    try:
        mode = stat.S_IMODE(os.stat(node.path).st_mode)
        again = rankwatch_cli("node", "--socket", str(node.path), "--collector", live.url)
        jobs = [rank(tmp, live.url, "via-node", 30, node=node.path), rank(tmp, live.url, "own", 30)]
        ranks = [ended(job) for job in jobs]
    finally:
        stopped = node.stop()
    return SideBySide(ranks, stopped, node.path, mode, again)


@pytest.fixture(scope="module")
def without_a_sidecar(live, tmp_path_factory) -> Ended:
    """10 steps of a rank whose sidecar is not there (run no-node)."""
    tmp = tmp_path_factory.mktemp("no-node")
    return Ended([ended(rank(tmp, live.url, "no-node", 10, node=tmp / "nobody.sock"))])


@pytest.fixture(scope="module")
def sidecar_died(live, tmp_path_factory) -> Ended:
    """40 steps of a rank (run node-died) whose sidecar is killed once it has delivered the first 20."""
    tmp = tmp_path_factory.mktemp("node-died")
    node = Node(tmp / "node.sock", live.url)
    go_on = tmp / "go-on"
    job = rank(tmp, live.url, "node-died", 40, f"wait:{go_on}", node=node.path)
    try:
        assert job.stdout and job.stdout.readline().strip() == "half"
        wait_until(
            lambda: api_rows(live, "SELECT count(*) FROM steps WHERE run_id = 'node-died'") == [[20]],
            "the first half not delivered by the sidecar",
            60,
        )
    finally:
        node.stop(signal.SIGKILL)
        go_on.touch()
    return Ended([ended(job)])


@pytest.fixture(scope="module")
def handed_over_then_killed(live, tmp_path_factory) -> Ended:
    """40 steps of a rank (run killed) handed to its sidecar while the collector is away, the rank then killed,
    the collector started again on its store and the sidecar stopped, which delivers what waits."""
    tmp = tmp_path_factory.mktemp("killed")
    live.stop()
    node = Node(tmp / "node.sock", live.url)
    try:
        ranks = [ended(rank(tmp, live.url, "killed", 40, "kill", node=node.path))]
    finally:
        live.start()  # the same port and store
        stopped = node.stop()
    return Ended(ranks, stopped)


@pytest.fixture(scope="module")
def store(live, side_by_side, without_a_sidecar, sidecar_died, handed_over_then_killed) -> Path:
    """The store, once every scenario has run and the collector is stopped."""
    live.stop()
    return live.db


def test_a_ranks_telemetry_through_the_sidecar_is_stored_as_it_would_send_it_itself(store, side_by_side):
    for status, err in side_by_side.ranks:
        assert status == 0, err
        assert "sidecar" not in err, err
    assert side_by_side.node is not None
    status, err = side_by_side.node
    assert status == 0, err
    through, itself = stored(store, "via-node"), stored(store, "own")
    assert through["steps"] == [(i, 1.0 / (i + 1), 100) for i in range(30)]
    assert through == itself
    assert ("comm", "all_reduce", 30, 30) in through["ops"]
    assert {name for kind, name, *_ in through["ops"] if kind == "phase"} == {
        "data",
        "forward",
        "backward",
        "optimizer",
    }


def test_what_a_rank_handed_over_outlives_the_rank_and_the_collectors_outage(store, handed_over_then_killed):
    ((status, _),) = handed_over_then_killed.ranks
    assert status == -signal.SIGKILL
    assert handed_over_then_killed.node is not None
    status, err = handed_over_then_killed.node
    assert status == 0, err
    assert stored(store, "killed")["steps"] == [(i, 1.0 / (i + 1), 100) for i in range(40)]


def test_a_rank_without_its_sidecar_says_so_once_and_exports_its_own(store, without_a_sidecar):
    ((status, err),) = without_a_sidecar.ranks
    assert status == 0, err
    assert err.count("no node sidecar at") == 1, err
    assert len(stored(store, "no-node")["steps"]) == 10


def test_a_rank_whose_sidecar_dies_mid_job_exports_the_rest_itself(store, sidecar_died):
    ((status, err),) = sidecar_died.ranks
    assert status == 0, err
    assert err.count("the node sidecar went away") == 1, err
    steps = [step for step, *_ in stored(store, "node-died")["steps"]]
    assert steps == list(range(40))


def test_the_sidecars_socket_is_its_owners_and_an_existing_path_is_refused(side_by_side):
    assert side_by_side.socket_mode & 0o077 == 0
    again = side_by_side.again
    assert again is not None and again.returncode == 2
    assert again.stderr.strip().splitlines() == [
        f"rankwatch: error: {side_by_side.socket}: already exists (another node's socket?)"
    ]
