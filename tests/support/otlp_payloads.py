"""Helpers shared by the ingest tests: OTLP payloads built with the official
OpenTelemetry SDK and proto classes, raw POSTs, and reads of a stopped store."""

import gzip
from pathlib import Path

import duckdb
import httpx
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from rankwatch.agent import semconv as sc
from tests.support import loopback

T0 = 1_700_000_000_000_000_000  # ns; every payload's times are explicit offsets from here
PROTOBUF = {"Content-Type": "application/x-protobuf"}


def step_spans(run_id: str, rank: int, steps, spans_per_step: int = 0, step_s: float = 0.1):
    """Finished SDK spans: one `step` span per step (loss = step / 100) and
    `spans_per_step` comm children per step, all with explicit start/end times."""
    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({sc.RUN_ID: run_id, sc.RANK: rank}))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("rankwatch.tests")
    dur = int(step_s * 1e9)
    for step in steps:
        start = T0 + step * dur
        parent = tracer.start_span(
            "step", start_time=start, attributes={sc.KIND: sc.KIND_STEP, sc.STEP: step, sc.LOSS: step / 100}
        )
        ctx = trace.set_span_in_context(parent)
        for i in range(spans_per_step):
            child = tracer.start_span(
                "all_reduce",
                context=ctx,
                start_time=start + i,
                attributes={
                    sc.KIND: sc.KIND_COMM,
                    sc.STEP: step,
                    sc.COMM_SEQ: i,
                    sc.COMM_BYTES: 1024,
                    sc.COMM_GROUP_SIZE: 2,
                },
            )
            child.end(end_time=start + i + 1000)
        parent.end(end_time=start + dur)
    provider.shutdown()
    return memory.get_finished_spans()


def trace_body(spans) -> bytes:
    """The protobuf ExportTraceServiceRequest the official exporter sends for these spans."""
    return encode_spans(spans).SerializeToString()


def span_count(body: bytes) -> int:
    request = ExportTraceServiceRequest.FromString(body)
    return sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)


def post(
    collector,
    signal: str,
    body: bytes,
    headers: dict | None = None,
    gzip_body: bool = False,
    client: httpx.Client | None = None,
    timeout: float = 30,
) -> httpx.Response:
    """POST an OTLP body with the collector's token (unless headers override it)."""
    h = {**collector.headers, **PROTOBUF, **(headers or {})}
    if gzip_body:
        body = gzip.compress(body)
        h["Content-Encoding"] = "gzip"
    send = client.post if client is not None else loopback.post
    return send(f"{collector.url}/v1/{signal}", content=body, headers=h, timeout=timeout)


def query(db: Path, sql: str, params=None) -> list[tuple]:
    """Rows of a query on a store whose collector has stopped (read-only)."""
    con = duckdb.connect(str(db), read_only=True)
    try:
        return con.execute(sql, params or []).fetchall()
    finally:
        con.close()


def with_rank(body: bytes, rank: int) -> bytes:
    """The same trace request, re-encoded with another resource rank (a distinct export)."""
    request = ExportTraceServiceRequest.FromString(body)
    for rs in request.resource_spans:
        for kv in rs.resource.attributes:
            if kv.key == sc.RANK:
                kv.value.int_value = rank
    return request.SerializeToString()
