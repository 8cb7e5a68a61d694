"""What a token holder sends cannot make the collector hold unbounded memory or sockets: the write
queue admits requests by their decompressed size, bodies being read share one budget, a
connection that does not finish its request headers is closed, open connections are capped, and
OTLP/JSON is bounded before its costly conversion. One real collector with small bounds."""

import gzip
import json
import shutil
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest

from collector.receive import connections, otlp
from collector.receive.decode import MAX_ATTRIBUTES
from tests.support import loopback
from tests.support.collectors import Collector, free_port
from tests.support.floods import PeakRss, idle_connection, padded_trace, partial_upload, statuses
from tests.support.otlp_payloads import post, query, step_spans, trace_body
from tests.support.waits import wait_until

pytestmark = pytest.mark.long

MiB = 2**20
QUEUE = 8 * MiB
READING = 4 * MiB
HEADER_TIMEOUT_S = 1.0
CONNECTIONS = 32
ACKNOWLEDGED: set[int] = set()  # the ranks of the bomb requests answered 200


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A collector with one decode worker and small bounds, so that floods reach them in seconds."""
    directory = tmp_path_factory.mktemp("memory")
    with open(directory / "collector.log", "w") as log:
        c = Collector(
            directory / "rankwatch.duckdb",
            free_port(),
            "test-token-0123456",
            extra_args=(
                "--workers",
                "1",
                "--max-queue-bytes",
                str(QUEUE),
                "--max-reading-bytes",
                str(READING),
                "--header-timeout",
                str(HEADER_TIMEOUT_S),
                "--max-connections",
                str(CONNECTIONS),
            ),
            log=log,
        ).start()
        yield c
        if c.process.poll() is None:
            c.stop()


def healthz_s(collector: Collector) -> float:
    started = time.perf_counter()
    assert loopback.get(f"{collector.url}/healthz", timeout=10).status_code == 200
    return time.perf_counter() - started


def test_gzip_bodies_are_admitted_by_their_decompressed_size(small):
    """12 senders at once of valid requests that inflate 500-fold, to 16 MiB each (192 MiB in all):
    the write queue takes what fits in its bytes decompressed and answers the rest 503 +
    Retry-After, so the collector holds what a few such requests cost, and every acknowledged row
    is stored."""
    senders = 12
    bodies = [gzip.compress(padded_trace("bomb", rank, 16 * MiB), 1) for rank in range(senders)]
    assert max(map(len, bodies)) < 16 * MiB / 100
    answers: dict[int, httpx.Response] = {}
    start = threading.Barrier(senders)

    def send(rank: int) -> None:
        start.wait()
        answers[rank] = post(small, "traces", bodies[rank], headers={"Content-Encoding": "gzip"}, timeout=120)

    with PeakRss(small.process.pid) as rss:
        threads = [threading.Thread(target=send, args=(rank,)) for rank in range(senders)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    codes = sorted(r.status_code for r in answers.values())
    assert set(codes) <= {200, 503} and 200 in codes and 503 in codes, codes
    assert all(r.headers["Retry-After"] for r in answers.values() if r.status_code == 503)
    grown = rss.peak - rss.start
    # one such request costs ~250 MiB across the processes (its copies decoded, pickled, stored); all 12: gigabytes
    assert grown < 512 * MiB, f"the collector grew {grown / MiB:.0f} MiB"
    ACKNOWLEDGED.update(rank for rank, r in answers.items() if r.status_code == 200)


def test_a_gzip_body_declaring_more_than_the_cap_is_refused_before_inflating():
    """The gzip trailer declares the size: past the cap, 413 without inflating (a body that
    would inflate to 1 GiB costs microseconds, not the 20 MiB and the CPU of inflating it)."""
    bomb = gzip.compress(bytes(64 * MiB), 1)
    started = time.process_time()
    for _ in range(20):
        with pytest.raises(otlp.OtlpError) as refused:
            otlp.decompress(bomb, "gzip", otlp.MAX_BODY)
        assert refused.value.status == 413
    assert time.process_time() - started < 0.1, "the body was inflated to its cap before it was refused"


def test_partial_uploads_share_one_budget_and_get_503_past_it(small):
    """Uploads that stop part way hold only the collector's reading budget between them: past it
    they are answered 503 + Retry-After, and once they go away an export is read again."""
    uploads = [partial_upload(small.url, small.token, 3 * MiB, MiB) for _ in range(3 * READING // MiB)]
    try:
        fit = READING // MiB  # uploads a MiB each that the budget holds
        answers = statuses(uploads, len(uploads) - fit, 20)
        assert answers.count(503) >= len(uploads) - fit, answers
        assert set(answers) <= {503, None}, answers
        assert healthz_s(small) < 1
    finally:
        for sock in uploads:
            sock.close()
    body = trace_body(step_spans("after-uploads", 0, range(3)))
    wait_until(lambda: post(small, "traces", body).status_code == 200, "an export read once the uploads went away")


def test_connections_that_stall_in_their_headers_are_closed_and_healthz_stays_fast(small):
    """More idle connections than the cap, each stopped part way through its request headers: the
    oldest are closed to make room, /healthz answers within a second all the while, and each is
    closed by the header deadline at the latest."""
    held = [idle_connection(small.url) for _ in range(3 * CONNECTIONS)]
    try:
        slowest = max(healthz_s(small) for _ in range(5))
        assert slowest < 1, f"/healthz took {slowest:.2f} s beside {len(held)} idle connections"
        answers = statuses(held, len(held), HEADER_TIMEOUT_S + 5)
        assert answers == [0] * len(held), "idle connections were left open past the header deadline"
    finally:
        for sock in held:
            sock.close()
    log = small.log.name
    with open(log) as f:
        assert sum("over the cap of" in line for line in f) <= 2, "closing over the cap flooded the log"


@pytest.mark.skipif(not shutil.which("ss"), reason="needs iproute2's ss to read the listen queue")
def test_the_kernel_queues_a_flood_of_connections_for_the_collector_to_accept(small):
    """The listening socket queues LISTEN_QUEUE connections (or what the kernel allows), not the 128
    asyncio accepts in one turn: beside a flood of connects, a full queue drops a new connection's first
    packet and its client waits a second to send it again (a /healthz probe took 1.07 s)."""
    listening = subprocess.run(
        ["ss", "-ltnH", f"sport = :{small.port}"], capture_output=True, text=True, check=True
    ).stdout.split()
    allowed = int(Path("/proc/sys/net/core/somaxconn").read_text())
    assert int(listening[2]) == min(connections.LISTEN_QUEUE, allowed)  # Send-Q: the queue's length


def test_json_is_refused_past_its_cap_and_for_crowded_resources_and_scopes(small):
    """OTLP/JSON costs tens of times protobuf's CPU a byte to convert: its bodies are capped
    tighter, and a resource's or scope's attributes are bounded like an item's, before the
    conversion."""
    attrs = [{"key": f"k{i}", "value": {"stringValue": "v"}} for i in range(MAX_ATTRIBUTES + 1)]
    span = {"traceId": "00" * 16, "spanId": "00" * 8, "name": "x", "startTimeUnixNano": "1", "endTimeUnixNano": "2"}
    crowded = [
        {"resourceSpans": [{"resource": {"attributes": attrs}, "scopeSpans": [{"spans": [span]}]}]},
        {"resourceSpans": [{"scopeSpans": [{"scope": {"attributes": attrs}, "spans": [span]}]}]},
    ]
    for tree in crowded:
        response = post(small, "traces", json.dumps(tree).encode(), headers={"Content-Type": otlp.JSON})
        assert response.status_code == 413 and f"more than {MAX_ATTRIBUTES} attributes" in response.text
    padding = "0" * (otlp.MAX_JSON_BODY + 1)
    large = json.dumps({"resourceSpans": [], "padding": padding}).encode()
    response = post(small, "traces", large, headers={"Content-Type": otlp.JSON}, gzip_body=True)
    assert response.status_code == 413, response.text


def test_rows_acknowledged_under_the_floods_are_stored(small):
    """After the floods above, a clean stop keeps every acknowledged request's rows."""
    small.stop()
    ranks = {rank for (rank,) in query(small.db, "SELECT DISTINCT rank FROM steps WHERE run_id = 'bomb'")}
    assert ACKNOWLEDGED and ranks == ACKNOWLEDGED
    assert query(small.db, "SELECT count(*) FROM steps WHERE run_id = 'after-uploads'")[0][0] == 3
