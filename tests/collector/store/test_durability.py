"""Durability of acknowledged exports: an OTLP 200 means the rows are committed.

Covered: (a) rows acknowledged to the official exporters survive kill -9 and a
restart on the same file; (b) a retried identical export, plain, concurrent,
gzip-compressed or after a collector restart, is stored once and counted in
rankwatch_collector_duplicate_requests_total, not in items received; (c) SIGTERM
drains in-flight requests: every request answered 200 is in the store, and
requests in flight when the signal came still complete; (d) under overload the
collector answers 503 with Retry-After, and retrying until 200 stores every row
exactly once.
"""

import os
import random
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from google.rpc.status_pb2 import Status
from opentelemetry._logs import SeverityNumber
from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk._logs import LoggerProvider
from opentelemetry.sdk._logs.export import InMemoryLogRecordExporter, LogRecordExportResult, SimpleLogRecordProcessor
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace.export import SpanExportResult
from prometheus_client.parser import text_string_to_metric_families

from rankwatch.agent import semconv as sc
from rankwatch.agent.export import Exporter
from tests.support import loopback
from tests.support.otlp_payloads import T0, post, query, span_count, step_spans, trace_body, with_rank

pytestmark = pytest.mark.long


def _log_records(run_id: str, rank: int, n: int):
    memory = InMemoryLogRecordExporter()
    provider = LoggerProvider(resource=Resource.create({sc.RUN_ID: run_id, sc.RANK: rank}))
    provider.add_log_record_processor(SimpleLogRecordProcessor(memory))
    logger = provider.get_logger("rankwatch.tests")
    for i in range(n):
        logger.emit(
            timestamp=T0 + i,
            body="checkpoint_saved",
            severity_number=SeverityNumber.INFO,
            attributes={sc.EVENT: "checkpoint_saved", sc.STEP: i},
        )
    provider.shutdown()
    return memory.get_finished_logs()


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in open(f"/proc/{pid}/task/{pid}/children").read().split()]
    except OSError:
        return []


def _alive(pids: list[int], wait_s: float = 10.0) -> list[int]:
    """The pids still running after up to `wait_s` seconds."""
    deadline = time.monotonic() + wait_s
    while True:
        alive = [
            pid
            for pid in pids
            if os.path.exists(f"/proc/{pid}") and Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
        ]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


def test_acknowledged_rows_survive_kill_9(collector_factory):
    collector = collector_factory(None, "--workers", "2")  # every child a collector has, decode processes too
    spans = OTLPSpanExporter(endpoint=f"{collector.url}/v1/traces", headers=collector.headers, timeout=10)
    for rank in range(4):
        assert spans.export(step_spans("run-crash", rank, range(25), spans_per_step=3)) is SpanExportResult.SUCCESS
    logs = OTLPLogExporter(endpoint=f"{collector.url}/v1/logs", headers=collector.headers, timeout=10)
    assert logs.export(_log_records("run-crash", 0, 5)) is LogRecordExportResult.SUCCESS
    agent = Exporter(collector.url, collector.token, {sc.RUN_ID: "run-crash", sc.RANK: 0})
    assert agent.samples([(sc.POWER_W, T0 + i, 300.0 + i, {sc.GPU: 0}) for i in range(7)])
    agent.shutdown()
    children = _children(collector.process.pid)  # the writer, decode workers, multiprocessing's tracker
    assert children
    assert collector.stop(signal.SIGKILL) == -signal.SIGKILL
    assert _alive(children) == []  # none outlives the collector to keep the store locked
    collector_factory(collector.db).stop()  # recovers the write-ahead log, then checkpoints
    assert query(
        collector.db, "SELECT rank, count(*), count(DISTINCT step) FROM steps GROUP BY rank ORDER BY rank"
    ) == [(r, 25, 25) for r in range(4)]
    assert query(collector.db, "SELECT count(*), sum(bytes) FROM ops") == [(4 * 25 * 3, 4 * 25 * 3 * 1024)]
    assert query(collector.db, "SELECT count(*), min(step), max(step) FROM events") == [(5, 0, 4)]
    assert query(collector.db, "SELECT count(*), sum(value) FROM device_samples") == [(7, 7 * 300.0 + 21)]
    assert query(collector.db, "SELECT run_id, rank FROM ranks ORDER BY rank") == [("run-crash", r) for r in range(4)]


def _counters(collector) -> dict[str, float]:
    """The collector's own count of duplicate trace exports and of spans it stored."""
    page = loopback.get(f"{collector.url}/metrics", timeout=30).text
    samples = {
        s.name: s.value
        for family in text_string_to_metric_families(page)
        for s in family.samples
        if s.labels.get("signal") == "traces"
    }
    return {
        "duplicates": samples.get("rankwatch_collector_duplicate_requests_total"),
        "received": samples.get("rankwatch_collector_items_received_total"),
    }


def test_retried_export_is_stored_once(collector_factory):
    collector = collector_factory()
    body = trace_body(step_spans("run-retry", 0, range(20), spans_per_step=2))
    assert span_count(body) == 60
    assert post(collector, "traces", body).status_code == 200
    assert post(collector, "traces", body).status_code == 200  # a retry of the same serialized request
    assert post(collector, "traces", body, gzip_body=True).status_code == 200  # same request, compressed
    with ThreadPoolExecutor(4) as pool:  # the same body racing itself
        assert [r.status_code for r in pool.map(lambda _: post(collector, "traces", body), range(4))] == [200] * 4
    assert _counters(collector) == {"duplicates": 6, "received": 60}
    collector.stop()
    restarted = collector_factory(collector.db)
    assert post(restarted, "traces", body).status_code == 200  # retried after a collector restart
    assert post(restarted, "traces", with_rank(body, 1)).status_code == 200  # a different export is stored
    assert _counters(restarted) == {"duplicates": 1, "received": 60}
    restarted.stop()
    assert query(
        collector.db, "SELECT rank, count(*), count(DISTINCT step) FROM steps GROUP BY rank ORDER BY rank"
    ) == [(0, 20, 20), (1, 20, 20)]
    assert query(collector.db, "SELECT rank, count(*) FROM ops GROUP BY rank ORDER BY rank") == [(0, 40), (1, 40)]


def _sender(collector, bodies, results):
    """Send bodies one after another on one connection; record (rank, status, sent, done)."""
    with loopback.Client(timeout=60) as client:
        for rank, body in bodies:
            sent = time.monotonic()
            try:
                status = post(collector, "traces", body, client=client).status_code
            except httpx.TransportError:
                status = None
            results.append((rank, status, sent, time.monotonic()))
            if status != 200:
                return


def test_sigterm_drains_in_flight_requests(collector_factory):
    collector = collector_factory()
    template = trace_body(step_spans("run-drain", 0, range(50), spans_per_step=9))  # 500 spans a request
    threads, results = [], []
    for t in range(6):
        bodies = [(t * 100 + j, with_rank(template, t * 100 + j)) for j in range(40)]
        threads.append(threading.Thread(target=_sender, args=(collector, bodies, results)))
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 30
    while sum(status == 200 for _, status, _, _ in results) < 12 and time.monotonic() < deadline:
        time.sleep(0.01)
    sigterm = time.monotonic()
    collector.process.send_signal(signal.SIGTERM)
    for thread in threads:
        thread.join(timeout=60)
    collector.stop()
    acked = sorted(rank for rank, status, _, _ in results if status == 200)
    drained = [rank for rank, status, sent, done in results if status == 200 and sent < sigterm < done]
    assert len(acked) >= 12
    assert drained, "no request in flight at SIGTERM was answered 200"
    assert len(acked) < 6 * 40, "SIGTERM came after every request had finished"
    stored = dict(query(collector.db, "SELECT rank, count(*) FROM steps GROUP BY rank"))
    ops = dict(query(collector.db, "SELECT rank, count(*) FROM ops GROUP BY rank"))
    assert {rank: stored.get(rank) for rank in acked} == dict.fromkeys(acked, 50)
    assert {rank: ops.get(rank) for rank in acked} == dict.fromkeys(acked, 450)
    assert set(stored.values()) == {50} and set(ops.values()) == {450}  # no request is half stored


def test_overload_503_retry_after_then_all_stored_once(collector_factory):
    """40 threads send distinct 200-span exports to a collector allowed 1 queued item, each retrying
    on 503 until accepted, and moving on to its next export until the collector has refused one."""
    collector = collector_factory(None, "--max-queue-bytes", "1")
    template = trace_body(step_spans("run-overload", 0, range(25), spans_per_step=7))  # 200 spans a request
    threads, per_thread = 40, 5
    refusals: list[httpx.Response] = []
    accepted: list[int] = []
    overloaded = threading.Event()
    lock = threading.Lock()
    start = threading.Barrier(threads)

    def send_until_accepted(client: httpx.Client, rank: int) -> None:
        body = with_rank(template, rank)
        for _ in range(300):
            r = post(collector, "traces", body, client=client)
            if r.status_code == 200:
                with lock:
                    accepted.append(rank)
                return
            assert r.status_code == 503, r.content
            with lock:
                refusals.append(r)
            overloaded.set()
            # Retry-After says 2 s; a shorter jittered pause keeps the test fast and still retries every request
            time.sleep(random.uniform(0.05, 0.15))
        raise AssertionError(f"rank {rank} never accepted")

    def worker(t: int) -> None:
        with loopback.Client(timeout=60) as client:
            start.wait()
            for j in range(per_thread):
                if j and overloaded.is_set():
                    return
                send_until_accepted(client, t * per_thread + j)

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(worker, range(threads)))
    collector.stop()
    print(f"503 answers: {len(refusals)}; exports accepted: {len(accepted)}")
    assert refusals, f"{len(accepted)} exports from {threads} threads never overloaded a queue of 1 item"
    assert all(r.headers.get("retry-after", "").isdigit() and int(r.headers["retry-after"]) >= 1 for r in refusals)
    assert {Status.FromString(r.content).code for r in refusals} == {14}  # UNAVAILABLE
    assert len(accepted) == len(set(accepted)) >= threads
    assert query(collector.db, "SELECT count(*), count(DISTINCT rank) FROM steps") == [
        (len(accepted) * 25, len(accepted))
    ]
    assert query(collector.db, "SELECT count(*) FROM ops") == [(len(accepted) * 25 * 7,)]
    assert query(
        collector.db, "SELECT count(*) FROM (SELECT rank, step FROM steps GROUP BY ALL HAVING count(*) > 1)"
    ) == [(0,)]
    assert sorted(r for (r,) in query(collector.db, "SELECT DISTINCT rank FROM steps")) == sorted(accepted)
