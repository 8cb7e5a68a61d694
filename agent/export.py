"""OTLP/HTTP export of one rank's telemetry through the OpenTelemetry SDK.

Spans and log records go through the SDK's batch processors (a background
thread, so training never waits on the network). A step's trace is handed to
the processor as one plain record and encoded to OTLP protobuf on the export
thread by `encode_spans` below: the SDK's ReadableSpan, processor and encoder
cost ~45 µs a span between the training thread and the export thread, whose
time is GIL time the training thread may wait for. The SDK drops a batch
whose export failed; here a failed batch is kept in a bounded backlog and
sent once the collector is back, oldest first, and only what overflows the
backlog is dropped (and counted). Device samples carry their own timestamps,
which the metrics API cannot express, so they are handed to the SDK's OTLP
metric exporter as ready-made gauge points.
"""

import functools
import gzip
import logging
import os
import random
import socket
import struct
import threading
import time
from collections import defaultdict, deque
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple
from urllib.error import URLError
from urllib.parse import urlsplit
from urllib.request import Request, urlopen

from opentelemetry._logs import SeverityNumber
from opentelemetry.exporter.otlp.proto.http import Compression
from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter
from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
from opentelemetry.sdk._logs import LoggerProvider
from opentelemetry.sdk._logs.export import BatchLogRecordProcessor, LogRecordExportResult
from opentelemetry.sdk.metrics.export import Gauge, Metric, MetricsData, NumberDataPoint, ResourceMetrics, ScopeMetrics
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExportResult
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, TraceFlags

from agent import semconv as sc

SCOPE = "rankwatch.agent"
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
AttributeValue = str | int | float | bool
Attributes = Mapping[str, AttributeValue]
log = logging.getLogger("rankwatch.agent")
# The SDK's exporters log every retry; the backlog reports an outage once instead.
for _name in ("opentelemetry.exporter.otlp.proto.http", "opentelemetry.sdk._shared_internal"):
    logging.getLogger(_name).setLevel(logging.CRITICAL)


_CONTEXT = SpanContext(0, 0, is_remote=False, trace_flags=_SAMPLED)
# How long a finished step waits for its export at most: the first stretch of a rollback's way
# (a spike's step must reach the collector for it to be judged), against one request a rank per
# stretch (docs/benchmarks.md, Rollback latency, for both sides of it).
SPANS_DELAY_MS = 250


class Span(NamedTuple):
    """A finished span, as `encode_spans` takes it."""

    trace_id: int
    span_id: int
    parent_id: int  # 0: a root
    name: str
    start_ns: int
    end_ns: int
    attributes: Attributes
    resource: Resource


class Trace(NamedTuple):
    """One finished trace (a step and its children) as the batch processor queues it: one item a
    step, since the processor's work per item is done on the training thread. Its `context` says
    sampled, which is all the processor reads of it."""

    trace_id: int
    root_id: int
    spans: tuple[tuple[str, int, int, Attributes], ...]  # (name, start ns, end ns, attributes), the root first
    resource: Resource

    @property
    def context(self) -> SpanContext:
        return _CONTEXT


class _Spans:
    """Between the batch processor and the span backlog, on the export thread: a batch of traces
    becomes their spans (the children's ids drawn here), so that the backlog counts spans."""

    def __init__(self, backlog: "Backlog"):
        self._backlog = backlog
        self._ids = random.Random(os.urandom(16))

    def export(self, traces: Sequence[Trace]):
        spans, ids = [], self._ids
        for t in traces:
            (name, start_ns, end_ns, attributes), *children = t.spans
            spans.append(Span(t.trace_id, t.root_id, 0, name, start_ns, end_ns, attributes, t.resource))
            spans += [Span(t.trace_id, ids.getrandbits(64), t.root_id, *child, t.resource) for child in children]
        return self._backlog.export(spans)

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._backlog.force_flush(timeout_millis)

    def shutdown(self) -> None:
        self._backlog.shutdown()


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


@functools.lru_cache(maxsize=4096)
def _key(key: str) -> bytes:
    """KeyValue.key, encoded once per name."""
    return _field(1, key.encode())


def _any_value(value: object) -> bytes:
    """An AnyValue; a value of another type than str, bool, int (int64) or float goes as its str()."""
    if isinstance(value, bool):
        return b"\x10\x01" if value else b"\x10\x00"
    if isinstance(value, int) and -(2**63) <= value < 2**63:
        return b"\x18" + _varint(value & 0xFFFFFFFFFFFFFFFF)
    if isinstance(value, float):
        return b"\x21" + struct.pack("<d", value)
    return _field(1, (value if isinstance(value, str) else str(value)).encode())


def _key_values(number: int, attributes: Mapping[str, object]) -> bytes:
    """Repeated KeyValue field `number` (a resource's attributes may hold any AnyValue)."""
    return b"".join(_field(number, _key(k) + _field(2, _any_value(v))) for k, v in attributes.items())


_KIND_INTERNAL = b"\x30\x01"
_FLAGS = b"\x85\x01" + struct.pack("<I", 0x101)  # sampled; is_remote known (false)


def _span(span: Span) -> bytes:
    return b"".join(
        (
            _field(1, span.trace_id.to_bytes(16, "big")),
            _field(2, span.span_id.to_bytes(8, "big")),
            _field(4, span.parent_id.to_bytes(8, "big")) if span.parent_id else b"",
            _field(5, span.name.encode()),
            _KIND_INTERNAL,
            b"\x39" + struct.pack("<Q", span.start_ns),
            b"\x41" + struct.pack("<Q", span.end_ns),
            _key_values(9, span.attributes),
            _FLAGS,
        )
    )


def encode_spans(spans: Sequence[Span]) -> bytes:
    """An OTLP ExportTraceServiceRequest, serialized: one ResourceSpans per resource."""
    by_resource: dict[int, tuple[Resource, list[bytes]]] = {}
    for span in spans:
        by_resource.setdefault(id(span.resource), (span.resource, []))[1].append(_field(2, _span(span)))
    scope_field = _field(1, _field(1, SCOPE.encode()))
    return b"".join(
        _field(1, _field(1, _key_values(1, resource.attributes)) + _field(2, scope_field + b"".join(encoded)))
        for resource, encoded in by_resource.values()
    )


class SpanExporter:
    """OTLP/HTTP protobuf export of `Span` records: one gzipped POST a batch, no retries (the
    Backlog around it keeps and retries a batch that failed)."""

    def __init__(self, url: str, headers: dict, timeout_s: float):
        self._url, self._timeout_s = url, timeout_s
        self._headers = {**headers, "Content-Type": "application/x-protobuf", "Content-Encoding": "gzip"}

    def export(self, spans: Sequence[Span]) -> SpanExportResult:
        body = gzip.compress(encode_spans(spans), compresslevel=6)
        try:
            with urlopen(Request(self._url, body, self._headers), timeout=self._timeout_s):
                return SpanExportResult.SUCCESS  # 2xx: urlopen raises for the others
        except (URLError, OSError):
            return SpanExportResult.FAILURE

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True

    def shutdown(self) -> None:
        """Nothing to stop: an export in flight ends within its timeout."""


def reachable(endpoint: str, timeout_s: float = 0.5) -> bool:
    """Whether something accepts TCP connections at the endpoint: a refused connection is
    known in microseconds, where the SDK's exporter would retry it for seconds."""
    url = urlsplit(endpoint)
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout_s).close()
        return True
    except OSError:
        return False


class Backlog:
    """Wraps an SDK exporter: batches that could not be sent wait (up to `max_items`, the
    oldest dropped beyond) and go out first, in order, when the collector is back. While it
    is away it is tried at most every `retry_s`, and only once it accepts connections again,
    so neither exports nor the end of a job wait out the SDK's retries."""

    def __init__(self, exporter, success, max_items: int, endpoint: str, on_first_failure=None, retry_s: float = 5.0):
        self._exporter = exporter
        self._endpoint = endpoint
        self._success = success
        self._max_items = max_items
        self._on_first_failure = on_first_failure
        self._retry_s = retry_s
        self._batches: deque[list] = deque()
        self._items = 0  # waiting
        self._late = 0  # waiting after a failed try (the oldest `_late` items)
        self._next_try = 0.0
        self._closed = False
        self._lock = threading.Lock()
        self.dropped = 0
        self.delivered_late = 0

    @property
    def waiting(self) -> int:
        """Items not yet delivered."""
        return self._items

    def export(self, batch: Sequence):
        with self._lock:
            if batch:
                self._batches.append(list(batch))
                self._items += len(batch)
            if time.monotonic() >= self._next_try and not self._closed:
                self._send_waiting()
            while self._items > self._max_items and len(self._batches) > 1:
                oldest = self._batches.popleft()
                self._items -= len(oldest)
                self._late = max(self._late - len(oldest), 0)
                self.dropped += len(oldest)
            return self._success

    def _send_waiting(self) -> None:
        while self._batches:
            if not reachable(self._endpoint) or self._exporter.export(self._batches[0]) is not self._success:
                self._late = self._items
                self._next_try = time.monotonic() + self._retry_s
                if self._on_first_failure:
                    self._on_first_failure()
                    self._on_first_failure = None
                return
            sent = len(self._batches.popleft())
            self._items -= sent
            late = min(sent, self._late)
            self._late -= late
            self.delivered_late += late

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._exporter.force_flush(timeout_millis)

    def deliver(self) -> None:
        """Try now, whenever the last try was: a collector that is back gets what waits."""
        with self._lock:
            self._send_waiting()

    def close(self) -> None:
        """Stop sending: an export still retrying gives up now, later batches only wait."""
        self._closed = True
        self._exporter.shutdown()  # aborts the retry loop of an export in flight

    def shutdown(self) -> None:
        """Called by the SDK processor after its last export: what waits now is dropped."""
        with self._lock:
            self.dropped += self._items
            self._items = 0


class Exporter:
    """Batched, retried OTLP/HTTP export to a rankwatch collector (or any OTLP receiver)."""

    def __init__(
        self,
        endpoint: str,
        token: str | None,
        resource: Attributes,
        timeout_s: float = 10.0,
        backlog_items: int = 100_000,
    ):
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        endpoint = self._endpoint = endpoint.rstrip("/")
        self.resource = Resource.create(dict(resource))
        self.spans_backlog = Backlog(
            SpanExporter(f"{endpoint}/v1/traces", headers, timeout_s),
            SpanExportResult.SUCCESS,
            backlog_items,
            endpoint,
            on_first_failure=lambda: log.warning(
                "rankwatch: collector at %s unreachable; training goes on, telemetry "
                "waits (up to %d spans) and is sent when it is back",
                endpoint,
                backlog_items,
            ),
        )
        self.logs_backlog = Backlog(
            OTLPLogExporter(
                endpoint=f"{endpoint}/v1/logs", headers=headers, timeout=timeout_s, compression=Compression.Gzip
            ),
            LogRecordExportResult.SUCCESS,
            backlog_items // 10,
            endpoint,
        )
        # traces (steps) queued: 8192, some 120k spans at the reference trainer's 15 a step; 256 traces a
        # request stay far below the collector's 20 MiB and 100k entries a request
        self._processor = BatchSpanProcessor(
            _Spans(self.spans_backlog),  # type: ignore[arg-type]  # takes Traces
            max_queue_size=8192,
            max_export_batch_size=256,
            schedule_delay_millis=SPANS_DELAY_MS,
        )
        self._scope = InstrumentationScope(SCOPE)
        self._ids = random.Random(os.urandom(16))
        self._logger_provider = LoggerProvider(resource=self.resource)
        # the queue holds a round of heartbeats from each of 16k ranks (the fleet simulator sends them at once)
        self._logger_provider.add_log_record_processor(
            BatchLogRecordProcessor(
                self.logs_backlog,  # type: ignore[arg-type]  # a LogRecordExporter by duck typing (export, shutdown)
                schedule_delay_millis=1000,
                max_queue_size=65536,
                max_export_batch_size=2048,
            )
        )
        self._logger = self._logger_provider.get_logger(SCOPE)
        self._metric_exporter = OTLPMetricExporter(
            endpoint=f"{endpoint}/v1/metrics", headers=headers, timeout=timeout_s, compression=Compression.Gzip
        )
        self.samples_refused = 0  # device samples the collector never took

    def trace(self, spans: Sequence[tuple[str, int, int, Attributes]], resource: Resource | None = None) -> SpanContext:
        """Record one finished trace, times given: the first span is the root (a step), the
        others its children; returns the root's context. `resource`: who it is from, when one
        process speaks for many ranks (the fleet simulator); default this exporter's.

        The trace is queued as one plain record: the tracer API's context and sampling machinery
        would cost ~80 µs a span on the training thread, for spans whose times are known after the
        fact, and the SDK's ReadableSpan and batch processor ~15 µs more a span."""
        trace_id, root_id = self._ids.getrandbits(128), self._ids.getrandbits(64)
        trace = Trace(trace_id, root_id, tuple(spans), resource or self.resource)
        self._processor.on_end(trace)  # type: ignore[arg-type]  # stands in for a ReadableSpan: see Trace
        return SpanContext(trace_id, root_id, is_remote=False, trace_flags=_SAMPLED)

    def event(
        self,
        event: str,
        time_ns: int,
        attributes: Attributes,
        body: str | None = None,
        severity: SeverityNumber = SeverityNumber.INFO,
    ) -> None:
        """A log record naming something that happened (checkpoint saved, fault injected...)."""
        self._logger.emit(
            timestamp=time_ns,
            observed_timestamp=time_ns,
            body=body or event,
            severity_number=severity,
            severity_text=severity.name,
            attributes={sc.EVENT: event, **attributes},
        )

    def samples(self, points: Iterable[tuple[str, int, float, Attributes]]) -> bool:
        """Export device samples (metric name, time ns, value, attributes) now; True when accepted.
        With the collector away, False at once: the SDK would retry for its whole timeout."""
        by_metric: dict[str, list[NumberDataPoint]] = defaultdict(list)
        for name, time_ns, value, attributes in points:
            by_metric[name].append(
                NumberDataPoint(
                    attributes=dict(attributes), start_time_unix_nano=0, time_unix_nano=time_ns, value=value
                )
            )
        if not by_metric:
            return True
        metrics = [
            Metric(name=name, description="", unit="", data=Gauge(data_points=pts)) for name, pts in by_metric.items()
        ]
        data = MetricsData([ResourceMetrics(self.resource, [ScopeMetrics(self._scope, metrics, "")], "")])
        if reachable(self._endpoint) and self._metric_exporter.export(data).name == "SUCCESS":
            return True
        self.samples_refused += sum(map(len, by_metric.values()))
        return False

    def flush(self, timeout_ms: int = 30_000) -> bool:
        """Push everything queued, backlog included; True when it all went out."""
        flushed = self._processor.force_flush(timeout_ms) and self._logger_provider.force_flush(timeout_ms)
        self.spans_backlog.deliver()
        self.logs_backlog.deliver()
        return flushed and not self.spans_backlog.waiting and not self.logs_backlog.waiting

    def undelivered(self) -> int:
        """What this exporter knows never reached the collector, or has not yet: spans and log
        records dropped or still waiting, device samples refused. After flush() and shutdown(),
        all of it is lost."""
        return (
            self.spans_backlog.dropped
            + self.spans_backlog.waiting
            + self.logs_backlog.dropped
            + self.logs_backlog.waiting
            + self.samples_refused
        )

    def shutdown(self) -> None:
        """Stop exporting, without waiting out retries: call flush() first to deliver."""
        self.spans_backlog.close()
        self.logs_backlog.close()
        self._processor.shutdown()
        self._logger_provider.shutdown()
        self._metric_exporter.shutdown()
