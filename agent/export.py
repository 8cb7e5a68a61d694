"""OTLP/HTTP export of one rank's telemetry through the OpenTelemetry SDK.

Spans and log records go through the SDK's batch processors (a background
thread, bounded queue, retries with backoff). Device samples carry their own
timestamps, which the metrics API cannot express, so they are handed to the
SDK's OTLP metric exporter as ready-made gauge points.
"""

from collections import defaultdict
from collections.abc import Iterable, Mapping

from opentelemetry import trace
from opentelemetry._logs import SeverityNumber
from opentelemetry.exporter.otlp.proto.http import Compression
from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter
from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk._logs import LoggerProvider
from opentelemetry.sdk._logs.export import BatchLogRecordProcessor
from opentelemetry.sdk.metrics.export import (Gauge, Metric, MetricsData, NumberDataPoint, ResourceMetrics,
                                              ScopeMetrics)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from agent import semconv as sc

SCOPE = "rankwatch.agent"
Attributes = Mapping[str, str | int | float | bool]


class Exporter:
    """Batched, retried OTLP/HTTP export to a rankwatch collector (or any OTLP receiver)."""

    def __init__(self, endpoint: str, token: str | None, resource: Attributes, timeout_s: float = 10.0):
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        endpoint = endpoint.rstrip("/")
        common = dict(headers=headers, timeout=timeout_s, compression=Compression.Gzip)
        self.resource = Resource.create(dict(resource))
        self._tracer_provider = TracerProvider(resource=self.resource)
        self._tracer_provider.add_span_processor(BatchSpanProcessor(
            OTLPSpanExporter(endpoint=f"{endpoint}/v1/traces", **common),
            max_queue_size=65536, max_export_batch_size=2048, schedule_delay_millis=1000))
        self.tracer = self._tracer_provider.get_tracer(SCOPE)
        self._logger_provider = LoggerProvider(resource=self.resource)
        self._logger_provider.add_log_record_processor(BatchLogRecordProcessor(
            OTLPLogExporter(endpoint=f"{endpoint}/v1/logs", **common), schedule_delay_millis=1000))
        self._logger = self._logger_provider.get_logger(SCOPE)
        self._metric_exporter = OTLPMetricExporter(endpoint=f"{endpoint}/v1/metrics", **common)

    def span(self, name: str, start_ns: int, end_ns: int, attributes: Attributes,
             parent: trace.Span | None = None) -> trace.Span:
        """Record a finished span with explicit times (timings are resolved after the fact)."""
        context = trace.set_span_in_context(parent) if parent is not None else None
        span = self.tracer.start_span(name, context=context, start_time=start_ns, attributes=attributes)
        span.end(end_time=end_ns)
        return span

    def start_span(self, name: str, start_ns: int, attributes: Attributes) -> trace.Span:
        """Open a parent span (a step) whose children are recorded before it ends."""
        return self.tracer.start_span(name, start_time=start_ns, attributes=attributes)

    def event(self, event: str, time_ns: int, attributes: Attributes, body: str | None = None,
              severity: SeverityNumber = SeverityNumber.INFO) -> None:
        """A log record naming something that happened (checkpoint saved, fault injected...)."""
        self._logger.emit(timestamp=time_ns, observed_timestamp=time_ns, body=body or event,
                          severity_number=severity, severity_text=severity.name,
                          attributes={sc.EVENT: event, **attributes})

    def samples(self, points: Iterable[tuple[str, int, float, Attributes]]) -> bool:
        """Export device samples (metric name, time ns, value, attributes) now; True when accepted."""
        by_metric: dict[str, list[NumberDataPoint]] = defaultdict(list)
        for name, time_ns, value, attributes in points:
            by_metric[name].append(NumberDataPoint(attributes=dict(attributes), start_time_unix_nano=0,
                                                   time_unix_nano=time_ns, value=value))
        if not by_metric:
            return True
        metrics = [Metric(name=name, description="", unit="", data=Gauge(data_points=pts))
                   for name, pts in by_metric.items()]
        data = MetricsData([ResourceMetrics(self.resource, [ScopeMetrics(InstrumentationScope(SCOPE), metrics, "")],
                                            "")])
        return self._metric_exporter.export(data).name == "SUCCESS"

    def flush(self, timeout_ms: int = 30_000) -> bool:
        """Push everything queued; True when it all went out."""
        return (self._tracer_provider.force_flush(timeout_ms)
                and self._logger_provider.force_flush(timeout_ms))

    def shutdown(self) -> None:
        self._tracer_provider.shutdown()
        self._logger_provider.shutdown()
        self._metric_exporter.shutdown()
