"""Group commit loses nothing it acknowledged: the writer is killed (SIGKILL) while concurrent exports are
being decoded, grouped and committed; every request answered 200 before or after the kill has all its
rows in the store, and requests the kill failed (503) are sent again, as exporters do, and stored once.
"""

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.support import loopback
from tests.support.otlp_payloads import post, query, step_spans, trace_body
from tests.support.waits import wait_until
from tests.support.writer_process import dead, writer_pid

pytestmark = pytest.mark.long

SENDERS = 8  # concurrent exporters, each a rank of its own: requests are always in flight
REQUESTS = 6  # per sender, each of STEPS steps with SPANS comm children
STEPS = 5
SPANS = 2
RUN = "group-commit-kill"


def test_a_writer_killed_mid_flood_loses_no_acknowledged_request(collector_factory):
    collector = collector_factory(None, "--workers", "2")  # decode processes hand whole batches to the writer
    bodies = {
        (rank, n): trace_body(step_spans(RUN, rank, range(n * STEPS, (n + 1) * STEPS), spans_per_step=SPANS))
        for rank in range(SENDERS)
        for n in range(REQUESTS)
    }
    acknowledged: list[tuple[int, int]] = []  # requests answered 200, in order
    refused: list[int] = []  # statuses of answers that were not 200 (sent again)
    lock = threading.Lock()

    def send(rank: int) -> None:
        with loopback.Client() as client:
            for n in range(REQUESTS):
                deadline = time.monotonic() + 120
                while (status := _status(collector, bodies[rank, n], client)) != 200:
                    with lock:
                        refused.append(status)
                    assert time.monotonic() < deadline, f"request {rank}/{n} never stored"
                    time.sleep(0.1)  # what an exporter's retry waits, shortened
                with lock:
                    acknowledged.append((rank, n))

    with ThreadPoolExecutor(SENDERS) as senders:
        sending = [senders.submit(send, rank) for rank in range(SENDERS)]
        wait_until(lambda: len(acknowledged) >= SENDERS, "the first groups to be acknowledged", 60)
        writer = writer_pid(collector)
        assert writer is not None
        os.kill(writer, signal.SIGKILL)
        with lock:
            before_kill = list(acknowledged)
        wait_until(lambda: dead(writer), "the killed writer to die")
        wait_until(lambda: writer_pid(collector) not in (None, writer) and _healthy(collector), "a new writer", 60)
        # what was acknowledged before the kill is in the new writer's store, before any retry lands
        stored = _stored_requests(collector)
        assert set(before_kill) <= stored, f"acknowledged, then lost: {sorted(set(before_kill) - stored)}"
        for done in sending:
            done.result()

    assert len(before_kill) < SENDERS * REQUESTS, "every request was acknowledged before the kill"
    assert 503 in refused, f"no export was refused while the writer was down: {sorted(set(refused))}"
    collector.stop()
    per_step = query(
        collector.db,
        "SELECT count(*), count(DISTINCT (rank, step)) FROM steps WHERE run_id = ?",
        [RUN],
    )
    assert per_step == [(SENDERS * REQUESTS * STEPS, SENDERS * REQUESTS * STEPS)]  # every row, once
    assert query(collector.db, "SELECT count(*) FROM ops WHERE run_id = ?", [RUN]) == [
        (SENDERS * REQUESTS * STEPS * SPANS,)
    ]


def _status(collector, body: bytes, client: httpx.Client) -> int:
    """The collector's answer to one export; a connection the dying writer's request lost counts as 503."""
    try:
        return post(collector, "traces", body, client=client).status_code
    except httpx.TransportError:
        return 503


def _healthy(collector) -> bool:
    return loopback.get(f"{collector.url}/healthz", timeout=30).status_code == 200


def _stored_requests(collector) -> set[tuple[int, int]]:
    """The requests whose every step is in the store, read through the query API of the running collector."""
    answer = loopback.post(
        f"{collector.url}/api/v1/query",
        json={"sql": f"SELECT rank, step // {STEPS}, count(*) FROM steps WHERE run_id = '{RUN}' GROUP BY ALL"},
        headers=collector.headers,
        timeout=60,
    )
    assert answer.status_code == 200, answer.text
    return {(rank, n) for rank, n, count in answer.json()["rows"] if count == STEPS}
