"""OTLP/HTTP export of one rank's telemetry through the OpenTelemetry SDK.

Spans and log records go through the SDK's batch processors (a background
thread, so training never waits on the network). The SDK drops a batch
whose export failed; here a failed batch is kept in a bounded backlog and
sent once the collector is back, oldest first, and only what overflows the
backlog is dropped (and counted). Device samples carry their own timestamps,
which the metrics API cannot express, so they are handed to the SDK's OTLP
metric exporter as ready-made gauge points.
"""

import logging
import os
import random
import socket
import threading
import time
from collections import defaultdict, deque
from collections.abc import Iterable, Mapping, Sequence
from urllib.parse import urlsplit

from opentelemetry._logs import SeverityNumber
from opentelemetry.exporter.otlp.proto.http import Compression
from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter
from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk._logs import LoggerProvider
from opentelemetry.sdk._logs.export import BatchLogRecordProcessor, LogRecordExportResult
from opentelemetry.sdk.metrics.export import (Gauge, Metric, MetricsData, NumberDataPoint, ResourceMetrics,
                                              ScopeMetrics)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExportResult
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, TraceFlags

from agent import semconv as sc

SCOPE = "rankwatch.agent"
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
Attributes = Mapping[str, str | int | float | bool]
log = logging.getLogger("rankwatch.agent")
# The SDK's exporters log every retry; the backlog reports an outage once instead.
for _name in ("opentelemetry.exporter.otlp.proto.http", "opentelemetry.sdk._shared_internal"):
    logging.getLogger(_name).setLevel(logging.CRITICAL)


def reachable(endpoint: str, timeout_s: float = 0.5) -> bool:
    """Whether something accepts TCP connections at the endpoint: a refused connection is
    known in microseconds, where the SDK's exporter would retry it for seconds."""
    url = urlsplit(endpoint)
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)),
                                 timeout_s).close()
        return True
    except OSError:
        return False


class Backlog:
    """Wraps an SDK exporter: batches that could not be sent wait (up to `max_items`, the
    oldest dropped beyond) and go out first, in order, when the collector is back. While it
    is away it is tried at most every `retry_s`, and only once it accepts connections again,
    so neither exports nor the end of a job wait out the SDK's retries."""

    def __init__(self, exporter, success, max_items: int, endpoint: str, on_first_failure=None,
                 retry_s: float = 5.0):
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

    def __init__(self, endpoint: str, token: str | None, resource: Attributes, timeout_s: float = 10.0,
                 backlog_items: int = 100_000):
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        endpoint = self._endpoint = endpoint.rstrip("/")
        common = dict(headers=headers, timeout=timeout_s, compression=Compression.Gzip)
        self.resource = Resource.create(dict(resource))
        self.spans_backlog = Backlog(OTLPSpanExporter(endpoint=f"{endpoint}/v1/traces", **common),
                                     SpanExportResult.SUCCESS, backlog_items, endpoint,
                                     on_first_failure=lambda: log.warning(
                                         "rankwatch: collector at %s unreachable; training goes on, telemetry "
                                         "waits (up to %d spans) and is sent when it is back", endpoint,
                                         backlog_items))
        self.logs_backlog = Backlog(OTLPLogExporter(endpoint=f"{endpoint}/v1/logs", **common),
                                    LogRecordExportResult.SUCCESS, backlog_items // 10, endpoint)
        self._processor = BatchSpanProcessor(self.spans_backlog, max_queue_size=65536, max_export_batch_size=2048,
                                             schedule_delay_millis=1000)
        self._scope = InstrumentationScope(SCOPE)
        self._ids = random.Random(os.urandom(16))
        self._logger_provider = LoggerProvider(resource=self.resource)
        # the queue holds a round of heartbeats from each of 16k ranks (the fleet simulator sends them at once)
        self._logger_provider.add_log_record_processor(BatchLogRecordProcessor(
            self.logs_backlog, schedule_delay_millis=1000, max_queue_size=65536, max_export_batch_size=2048))
        self._logger = self._logger_provider.get_logger(SCOPE)
        self._metric_exporter = OTLPMetricExporter(endpoint=f"{endpoint}/v1/metrics", **common)
        self.samples_refused = 0  # device samples the collector never took

    def trace(self, spans: Sequence[tuple[str, int, int, Attributes]], resource: Resource | None = None) -> SpanContext:
        """Record one finished trace, times given: the first span is the root (a step), the
        others its children; returns the root's context. `resource`: who it is from, when one
        process speaks for many ranks (the fleet simulator); default this exporter's.

        The spans are built as the SDK's ReadableSpan and handed to its batch processor
        directly: the tracer API's context and sampling machinery would cost ~80 µs a span
        on the training thread, for spans whose times are known after the fact."""
        trace_id = self._ids.getrandbits(128)
        root = None
        for name, start_ns, end_ns, attributes in spans:
            context = SpanContext(trace_id, self._ids.getrandbits(64), is_remote=False, trace_flags=_SAMPLED)
            self._processor.on_end(ReadableSpan(name, context, parent=root, resource=resource or self.resource,
                                                attributes=attributes, start_time=start_ns, end_time=end_ns,
                                                instrumentation_scope=self._scope))
            root = root or context
        return root

    def event(self, event: str, time_ns: int, attributes: Attributes, body: str | None = None,
              severity: SeverityNumber = SeverityNumber.INFO) -> None:
        """A log record naming something that happened (checkpoint saved, fault injected...)."""
        self._logger.emit(timestamp=time_ns, observed_timestamp=time_ns, body=body or event,
                          severity_number=severity, severity_text=severity.name,
                          attributes={sc.EVENT: event, **attributes})

    def samples(self, points: Iterable[tuple[str, int, float, Attributes]]) -> bool:
        """Export device samples (metric name, time ns, value, attributes) now; True when accepted.
        With the collector away, False at once: the SDK would retry for its whole timeout."""
        by_metric: dict[str, list[NumberDataPoint]] = defaultdict(list)
        for name, time_ns, value, attributes in points:
            by_metric[name].append(NumberDataPoint(attributes=dict(attributes), start_time_unix_nano=0,
                                                   time_unix_nano=time_ns, value=value))
        if not by_metric:
            return True
        metrics = [Metric(name=name, description="", unit="", data=Gauge(data_points=pts))
                   for name, pts in by_metric.items()]
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
        return (self.spans_backlog.dropped + self.spans_backlog.waiting + self.logs_backlog.dropped
                + self.logs_backlog.waiting + self.samples_refused)

    def shutdown(self) -> None:
        """Stop exporting, without waiting out retries: call flush() first to deliver."""
        self.spans_backlog.close()
        self.logs_backlog.close()
        self._processor.shutdown()
        self._logger_provider.shutdown()
        self._metric_exporter.shutdown()
