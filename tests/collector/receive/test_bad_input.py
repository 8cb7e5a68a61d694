"""Bad OTLP requests against one running collector: the spec's status codes, a
google.rpc.Status body, a collector that stays healthy, and no valid data lost.

Covered: random bytes, truncated protobuf, JSON that is not an object and
invalid gzip (400), text/plain (415), a 1 GiB gzip bomb and a 25 MiB body
(413), missing and wrong bearer token (401); /healthz after each; /metrics
request counters by code and the commit-latency histogram; every valid row
sent before and after the bad requests is in the store once the collector has
stopped.
"""

import random
import struct
import zlib

import httpx
import pytest
from google.protobuf.message import DecodeError
from google.rpc.status_pb2 import Status
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from prometheus_client.parser import text_string_to_metric_families

from tests.support import loopback
from tests.support.collectors import Collector, free_port
from tests.support.otlp_payloads import post, query, span_count, step_spans, trace_body

RUN = "run-bad-input"
MAX_BODY = 20 * 2**20  # the collector's limit after decompression


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """One collector for the whole module, with valid data sent before any bad request."""
    collector = Collector(
        tmp_path_factory.mktemp("bad") / "rankwatch.duckdb", free_port(), "test-token-0123456"
    ).start()
    r = post(collector, "traces", trace_body(step_spans(RUN, 0, range(10), spans_per_step=3)))
    assert r.status_code == 200
    yield collector
    if collector.process.poll() is None:
        collector.stop()


def gzip_bomb(inflated: int = 2**30) -> bytes:
    """A valid gzip member of `inflated` zero bytes (~1 MB), built without holding it in memory:
    a full flush resets the compressor, so every 1 MiB block compresses to the same bytes."""
    block = bytes(2**20)
    deflate = zlib.compressobj(9, zlib.DEFLATED, -15)
    chunk = deflate.compress(block) + deflate.flush(zlib.Z_FULL_FLUSH)
    crc = 0
    for _ in range(inflated // len(block)):
        crc = zlib.crc32(block, crc)
    header = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff"
    return header + chunk * (inflated // len(block)) + deflate.flush() + struct.pack("<II", crc, inflated % 2**32)


def assert_refused(r: httpx.Response, status: int, grpc_code: int, words: str, collector) -> Status:
    """The response has the status and a google.rpc.Status protobuf body; the collector stays healthy."""
    assert r.status_code == status, r.content
    assert r.headers["content-type"] == "application/x-protobuf"
    body = Status.FromString(r.content)
    assert body.code == grpc_code
    assert words in body.message
    health = loopback.get(f"{collector.url}/healthz", timeout=5)
    assert health.status_code == 200 and health.json()["status"] == "ok"
    return body


def test_random_bytes_400(live):
    garbage = random.Random(1234).randbytes(4096)
    with pytest.raises(DecodeError):  # precondition: they really are not a request
        ExportTraceServiceRequest.FromString(garbage)
    assert_refused(post(live, "traces", garbage), 400, 3, "malformed", live)


def test_truncated_protobuf_400(live):
    body = trace_body(step_spans(RUN, 1, range(3)))
    assert_refused(post(live, "traces", body[: len(body) // 2]), 400, 3, "malformed", live)


@pytest.mark.parametrize("body", [b"null", b"5", b"[]"])
def test_json_not_an_object_400(live, body):
    r = post(live, "traces", body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, (r.status_code, r.content)  # malformed: never 503, which exporters retry forever
    assert r.headers["content-type"] == "application/json"
    assert r.json()["code"] == 3 and r.json()["message"]
    assert loopback.get(f"{live.url}/healthz").status_code == 200


def test_text_plain_415(live):
    body = trace_body(step_spans(RUN, 1, range(3)))
    r = post(live, "traces", body, headers={"Content-Type": "text/plain"})
    assert_refused(r, 415, 3, "unsupported content type", live)


def test_invalid_gzip_400(live):
    r = post(live, "traces", b"\x1f\x8b\x08\x00not really deflate data", headers={"Content-Encoding": "gzip"})
    assert_refused(r, 400, 3, "invalid gzip", live)


def test_gzip_bomb_413(live):
    bomb = gzip_bomb()
    assert len(bomb) < 2 * 2**20
    assert len(zlib.decompressobj(31).decompress(bomb, MAX_BODY + 1)) == MAX_BODY + 1  # it does inflate past the limit
    r = post(live, "metrics", bomb, headers={"Content-Encoding": "gzip"})
    assert_refused(r, 413, 8, "larger than", live)


def test_25_mib_body_413(live):
    r = post(live, "logs", bytes(25 * 2**20))
    assert_refused(r, 413, 8, "larger than", live)


def test_missing_token_401(live):
    body = trace_body(step_spans(RUN, 2, range(3)))
    r = loopback.post(f"{live.url}/v1/traces", content=body, headers={"Content-Type": "application/x-protobuf"})
    assert_refused(r, 401, 16, "token", live)
    assert r.headers["www-authenticate"] == "Bearer"


def test_wrong_token_401(live):
    body = trace_body(step_spans(RUN, 2, range(3)))
    r = post(live, "traces", body, headers={"Authorization": "Bearer not-the-token"})
    assert_refused(r, 401, 16, "token", live)


def test_metrics_counts_refusals_and_commits(live):
    body = trace_body(step_spans(RUN, 3, range(2)))
    codes = {
        400: post(live, "traces", b"\xff\xff\xff"),
        401: post(live, "traces", body, headers={"Authorization": "Bearer nope"}),
        413: post(live, "traces", gzip_bomb(64 * 2**20), headers={"Content-Encoding": "gzip"}),
        415: post(live, "traces", body, headers={"Content-Type": "text/plain"}),
    }
    assert {code: r.status_code for code, r in codes.items()} == {c: c for c in codes}
    text = loopback.get(f"{live.url}/metrics", timeout=30).text
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    for code in ("200", "400", "401", "413", "415"):
        assert samples[("rankwatch_collector_requests_total", (("code", code), ("signal", "traces")))] >= 1
    assert samples[("rankwatch_collector_commit_seconds_count", ())] >= 1
    assert samples[("rankwatch_collector_commit_seconds_bucket", (("le", "+Inf"),))] >= 1
    assert ("rankwatch_collector_commit_seconds_bucket", (("le", "0.001"),)) in samples
    assert samples[("rankwatch_collector_items_received_total", (("signal", "traces"),))] >= 40


def test_valid_data_before_and_after_is_kept(live):
    after = trace_body(step_spans(RUN, 4, range(100, 105), spans_per_step=2))
    assert span_count(after) == 15
    assert post(live, "traces", after).status_code == 200
    live.stop()
    assert query(
        live.db,
        "SELECT rank, count(*), min(step), max(step) FROM steps WHERE run_id = ? GROUP BY rank ORDER BY rank",
        [RUN],
    ) == [(0, 10, 0, 9), (4, 5, 100, 104)]
    assert query(live.db, "SELECT rank, count(*) FROM ops WHERE run_id = ? GROUP BY rank ORDER BY rank", [RUN]) == [
        (0, 30),
        (4, 10),
    ]
    assert query(live.db, "SELECT count(*) FROM device_samples") == [(0,)]
    assert query(live.db, "SELECT count(*) FROM events") == [(0,)]
