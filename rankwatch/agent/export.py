"""OTLP/HTTP export of a rank's telemetry (or, in a node's sidecar or the fleet simulator, of many).

Spans and log records are queued by our batcher (rankwatch/agent/batcher.py, a background thread,
so training never waits on the network), a step's trace as one plain record encoded on the export
thread (rankwatch/agent/spanwire.py). A batch whose export failed waits in a bounded backlog
(rankwatch/agent/backlog.py) and goes out once the collector is back, oldest first. Whatever is
dropped before the collector acknowledged it is counted per rank (rankwatch/agent/lost.py) and
reported to the collector as `telemetry_loss` events. A refused token (401, 403) is told apart from
an unreachable collector: `check_token` (rankwatch/agent/senders.py) finds it before a job starts,
and an exporter says it once and stops a paced producer (the fleet simulator) rather than letting
it run on. Device samples carry their own timestamps, which the metrics API cannot express, so they
are handed to the SDK's OTLP metric exporter as ready-made gauge points.
"""

import functools
import itertools
import logging
import os
import random
import threading
import time
import zlib
from collections import defaultdict
from collections.abc import Iterable, Sequence

from opentelemetry._logs import SeverityNumber
from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
from opentelemetry.sdk._logs import LoggerProvider, LogRecordProcessor, ReadableLogRecord, ReadWriteLogRecord
from opentelemetry.sdk.metrics.export import Gauge, Metric, MetricsData, NumberDataPoint, ResourceMetrics, ScopeMetrics
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, TraceFlags

from rankwatch.agent import semconv as sc
from rankwatch.agent.backlog import Backlog
from rankwatch.agent.batcher import Batcher
from rankwatch.agent.config import TokenRefused
from rankwatch.agent.lost import Losses, Lost
from rankwatch.agent.route import Route
from rankwatch.agent.senders import LogExporter, PerCollector, SpanExporter, refusal
from rankwatch.agent.spanwire import SCOPE, Attributes, Span, Trace
from rankwatch.agent.stepspans import StepMarks, spans_of

_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
log = logging.getLogger("rankwatch.agent")
# The SDK's exporters log every retry; the backlog reports an outage once instead.
for _name in ("opentelemetry.exporter.otlp.proto.http", "opentelemetry.sdk._shared_internal"):
    logging.getLogger(_name).setLevel(logging.CRITICAL)


# How long a finished step waits for its export at most: the first stretch of a rollback's way
# (a spike's step must reach the collector for it to be judged), against one request a rank per
# stretch (docs/benchmarks.md, Rollback latency, for both sides of it).
SPANS_DELAY_MS = 250
LOSS_REPORT_S = 5.0  # the shortest time between two telemetry_loss reports of a rank
# A paced exporter (the fleet simulator, whose time runs ahead of the clock) has no step waiting on its
# latency: its senders gather a second of traces a request, so the collector commits fewer, larger ones
PACED_DELAY_S = 1.0
# Device samples a request carries at most, well inside a collector's 100,000 entries a request.
SAMPLES_PER_REQUEST = 32_768


class _LogRecords(LogRecordProcessor):
    """The logger provider's records into a Batcher, as the SDK's batch processor hands them to its exporter."""

    def __init__(self, batcher: Batcher, resource: Resource):
        self._batcher, self._resource = batcher, resource

    def on_emit(self, log_record: ReadWriteLogRecord) -> None:
        self._batcher.put(
            ReadableLogRecord(
                log_record=log_record.log_record,
                resource=log_record.resource or self._resource,
                instrumentation_scope=log_record.instrumentation_scope,
                limits=log_record.limits,
            )
        )

    def shutdown(self) -> None:
        """The exporter stops the batcher."""

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        self._batcher.flush()
        return True


class Exporter:
    """Batched, retried OTLP/HTTP export to a rankwatch collector (or any OTLP receiver), which
    counts and reports what it drops. `paced` (the fleet simulator, which has no training to keep
    going): rather than dropping, a full queue makes the caller wait, and a busy collector (503,
    Retry-After) is waited for. `senders`: trace requests in flight at most, each sender with its
    queue and backlog, traces dealt to them in turn (a loaded collector commits requests that
    arrive together in one transaction, so one request at a time would pay a commit each)."""

    def __init__(
        self,
        endpoint: str,
        token: str | None,
        resource: Attributes,
        timeout_s: float = 10.0,
        backlog_items: int = 100_000,
        paced: bool = False,
        queue_traces: int = 8192,
        senders: int = 1,
    ):
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.route = Route.of(endpoint)  # one collector, or one of several (rankwatch/agent/route.py)
        self.resource = Resource.create(dict(resource))
        self._paced = paced
        self.losses = Losses()
        self._reported: dict[int, Lost] = {}  # what each resource's last telemetry_loss said
        self._next_report = 0.0
        self.token_refused: str | None = None  # why the collector refused the token, once it has
        warned = threading.Event()  # once, whichever sender fails first

        def unreachable() -> None:
            if not warned.is_set():
                warned.set()
                log.warning(
                    "rankwatch: collector at %s unreachable; training goes on, telemetry "
                    "waits (up to %d spans) and is sent when it is back",
                    ", ".join(self.route.urls),
                    backlog_items,
                )

        self._span_backlogs = [
            Backlog(
                SpanExporter(headers, timeout_s, self._refused_token),
                backlog_items // senders,
                Route(self.route.urls, offset=i) if i else self.route,
                on_drop=self.losses.spans,
                on_refused=self.losses.refused,
                on_first_failure=unreachable,
                paced=paced,
                token_refused=lambda: self.token_refused,
            )
            for i in range(senders)
        ]
        self.spans_backlog = self._span_backlogs[0]  # a rank's one (its telemetry_backlog event reads it)
        self.logs_backlog = Backlog(
            LogExporter(headers, timeout_s),
            backlog_items // 10,
            self.route,
            on_drop=self._records_dropped,
            on_refused=lambda batch, count: self._records_dropped(batch[:count]),
            paced=paced,
            token_refused=lambda: self.token_refused,
        )
        self._ids = random.Random(os.urandom(16))
        # traces (steps) queued: 8192, some 120k spans at the reference trainer's 15 a step; 256 traces a
        # request stay far below the collector's 20 MiB and 100k entries a request
        self._trace_queues = [
            Batcher(
                functools.partial(self._export_traces, backlog),
                self.losses.traces,
                max_items=queue_traces // senders,
                batch_items=256,
                delay_s=PACED_DELAY_S if paced else SPANS_DELAY_MS / 1000,
                name=f"rankwatch-spans-{i}",
                block=paced,
                after=self._report_loss if i == 0 else lambda: None,
            )
            for i, backlog in enumerate(self._span_backlogs)
        ]
        puts = [queue.put for queue in self._trace_queues]
        self._next_queue = itertools.cycle(puts).__next__
        # several collectors (a lake's): a node's traces go through one sender, and so to one collector
        self._node_queue = (
            (lambda host: puts[zlib.crc32(host.encode()) % senders])
            if senders > 1 and len(self.route.urls) > 1
            else None
        )
        # the queue holds a round of heartbeats from each of 16k ranks (the fleet simulator sends them at once)
        self._records = Batcher(
            self.logs_backlog.export,
            self._records_dropped,
            max_items=65536,
            batch_items=2048,
            delay_s=1.0,
            name="rankwatch-logs",
            block=paced,
        )
        self._scope = InstrumentationScope(SCOPE)
        self._logger_provider = LoggerProvider(resource=self.resource)
        self._logger_provider.add_log_record_processor(_LogRecords(self._records, self.resource))
        self._logger = self._logger_provider.get_logger(SCOPE)
        self._loggers: dict[int, object] = {}  # other resources' (a sidecar's ranks), by id
        self._metric_exporter = PerCollector(OTLPMetricExporter, "/v1/metrics", headers, timeout_s)
        self.samples_refused = 0  # device samples the collector never took

    def _refused_token(self, status: int) -> None:
        """A 401 or 403: said once, apart from an unreachable collector, since waiting will not mend it."""
        if self.token_refused is None:
            self.token_refused = refusal(self.route.url, status)
            log.warning("rankwatch: %s; the spans it refuses are counted as lost", self.token_refused)

    def _export_traces(self, backlog: Backlog, traces: Sequence[Trace]) -> None:
        """A batch of traces becomes their spans (the children's ids drawn here, on the export
        thread), so that the backlog counts spans."""
        spans, ids = [], self._ids
        for t in traces:
            (name, start_ns, end_ns, attributes), *children = t.spans
            spans.append(Span(t.trace_id, t.root_id, 0, name, start_ns, end_ns, attributes, t.resource))
            spans += [Span(t.trace_id, ids.getrandbits(64), t.root_id, *child, t.resource) for child in children]
        backlog.export(spans)

    def _records_dropped(self, records: Sequence) -> None:
        self.losses.records(self.resource, len(records))

    def trace(self, spans: Sequence[tuple[str, int, int, Attributes]], resource: Resource | None = None) -> SpanContext:
        """Record one finished trace, times given: the first span is the root (a step), the
        others its children; returns the root's context. `resource`: who it is from, when one
        process speaks for many ranks (the fleet simulator); default this exporter's.

        The trace is queued as one plain record: the tracer API's context and sampling machinery
        would cost ~80 µs a span on the training thread, for spans whose times are known after the
        fact, and the SDK's ReadableSpan and batch processor ~15 µs more a span."""
        if self._paced and self.token_refused:  # a simulator has no training to keep going: it stops here
            raise TokenRefused(self.token_refused)
        trace_id, root_id = self._ids.getrandbits(128), self._ids.getrandbits(64)
        resource = resource or self.resource
        put = (
            self._node_queue(str(resource.attributes.get(sc.HOST_NAME, ""))) if self._node_queue else self._next_queue()
        )
        put(Trace(trace_id, root_id, tuple(spans), resource))
        return SpanContext(trace_id, root_id, is_remote=False, trace_flags=_SAMPLED)

    def step(self, marks: StepMarks, resource: Resource | None = None) -> None:
        """Record one finished step from its marks (rankwatch/agent/stepspans.py), on the caller's thread."""
        self.trace(spans_of(marks), resource)

    def event(
        self,
        event: str,
        time_ns: int,
        attributes: Attributes,
        body: str | None = None,
        severity: SeverityNumber = SeverityNumber.INFO,
        resource: Resource | None = None,
    ) -> None:
        """A log record naming something that happened (checkpoint saved, fault injected...); `resource`:
        who it is from, when one process speaks for several (a node's sidecar); default this exporter's."""
        self._logger_of(resource).emit(
            timestamp=time_ns,
            observed_timestamp=time_ns,
            body=body or event,
            severity_number=severity,
            severity_text=severity.name,
            attributes={sc.EVENT: event, **attributes},
        )

    def _logger_of(self, resource: Resource | None):
        """The logger whose records carry `resource` (a provider each, made once)."""
        if resource is None or resource is self.resource:
            return self._logger
        if (logger := self._loggers.get(id(resource))) is None:
            provider = LoggerProvider(resource=resource)
            provider.add_log_record_processor(_LogRecords(self._records, resource))
            logger = self._loggers[id(resource)] = provider.get_logger(SCOPE)
        return logger

    def samples(self, points: Iterable[tuple[str, int, float, Attributes]], resource: Resource | None = None) -> bool:
        """Export device samples (metric name, time ns, value, attributes) now, in requests of at most
        SAMPLES_PER_REQUEST (a collector refuses one of more than 100,000 entries whole: a round of
        16,384 simulated GPUs' readings is 163,840); True when all were accepted. With the collector
        away, False at once: the SDK would retry for its whole timeout. Paced, a collector that answers
        is tried again until it takes them (the SDK retries a 503 within its timeout)."""
        points = list(points)
        taken = [
            self._send_samples(points[at : at + SAMPLES_PER_REQUEST], resource or self.resource)
            for at in range(0, len(points), SAMPLES_PER_REQUEST)
        ]
        return all(taken)

    def _send_samples(self, points: Sequence[tuple[str, int, float, Attributes]], resource: Resource) -> bool:
        by_metric: dict[str, list[NumberDataPoint]] = defaultdict(list)
        for name, time_ns, value, attributes in points:
            by_metric[name].append(
                NumberDataPoint(
                    attributes=dict(attributes), start_time_unix_nano=0, time_unix_nano=time_ns, value=value
                )
            )
        metrics = [
            Metric(name=name, description="", unit="", data=Gauge(data_points=pts)) for name, pts in by_metric.items()
        ]
        data = MetricsData([ResourceMetrics(resource, [ScopeMetrics(self._scope, metrics, "")], "")])
        for _ in range(12 if self._paced else 1):  # paced: a minute or two of a collector's 503s
            endpoint = self.route.reachable()
            if endpoint is None or self.token_refused:
                break
            if self._metric_exporter(endpoint).export(data).name == "SUCCESS":
                return True
        self.samples_refused += len(points)
        return False

    def _report_loss(self, final: bool = False) -> None:
        """A `telemetry_loss` event for each rank whose counts grew since its last one, at most every
        LOSS_REPORT_S (on the export thread), and at exit (`final`: what still waits then counted
        as dropped, since it will be). Cumulative counts, so a report lost is made good by the next."""
        now = time.monotonic()
        if not final and now < self._next_report:
            return
        self._next_report = now + LOSS_REPORT_S
        totals = {id(resource): (resource, lost) for resource, lost in self.losses.by_resource()}
        if final:
            waiting = Losses()
            for backlog in self._span_backlogs:
                waiting.spans(backlog.items())
            for resource, lost in waiting.by_resource():
                totals[id(resource)] = (resource, totals.get(id(resource), (resource, Lost()))[1] + lost)
        for resource, lost in totals.values():
            self._send_loss(resource, lost)

    def _send_loss(self, resource: Resource, lost: Lost) -> None:
        said = self._reported.get(id(resource), Lost())
        if (lost.spans, lost.rank_steps) == (said.spans, said.rank_steps):
            return
        self._reported[id(resource)] = lost
        rank = resource.attributes.get(sc.RANK)
        self.event(
            sc.EVENT_TELEMETRY_LOSS,
            time.time_ns(),
            {
                **({sc.RANK: rank} if isinstance(rank, int) else {}),
                sc.SPANS_DROPPED: lost.spans,
                sc.RANK_STEPS_DROPPED: lost.rank_steps,
            },
            severity=SeverityNumber.WARN,
        )

    def flush(self, timeout_ms: int = 30_000) -> bool:
        """Push everything queued, backlog included; True when it all went out."""
        for queue, backlog in zip(self._trace_queues, self._span_backlogs, strict=True):
            queue.flush()
            backlog.deliver()
        self._records.flush()
        self.logs_backlog.deliver()
        return not any(backlog.waiting for backlog in (*self._span_backlogs, self.logs_backlog))

    def finish(self, now_ns: int) -> tuple[Lost, int]:
        """A rank's end: deliver what waits, report what its backlog dropped or delivered late (a
        `telemetry_backlog` event), shut down; what never reached the collector (see `undelivered`)."""
        self.flush()
        backlog = self.spans_backlog
        late_dropped = backlog.dropped + backlog.waiting  # what is still waiting now will not be delivered
        if late_dropped or backlog.delivered_late:
            self.event(
                sc.EVENT_TELEMETRY_BACKLOG,
                now_ns,
                {sc.SPANS_DROPPED: late_dropped, sc.SPANS_DELIVERED_LATE: backlog.delivered_late},
            )
            self.flush()
        self.shutdown()
        return self.undelivered()

    def undelivered(self) -> tuple[Lost, int]:
        """After shutdown(): what never reached the collector (spans, rank-steps, log records; all
        ranks this exporter spoke for), and the device samples it refused."""
        return self.losses.total(), self.samples_refused

    def shutdown(self) -> None:
        """Stop exporting, without waiting out retries: call flush() first to deliver. What still
        waits is dropped, and counted; a last `telemetry_loss` report goes out if the counts grew."""
        for backlog in self._span_backlogs:
            backlog.close()
        for queue in self._trace_queues:
            queue.stop()
        self._report_loss(final=True)
        self._records.flush()
        self.logs_backlog.deliver()
        self.logs_backlog.close()
        self._records.stop()
        for backlog in (*self._span_backlogs, self.logs_backlog):
            backlog.shutdown()
        self._logger_provider.shutdown()
        self._metric_exporter.shutdown()
