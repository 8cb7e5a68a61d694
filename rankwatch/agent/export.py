"""OTLP/HTTP export of one rank's telemetry.

Spans and log records are queued by a batcher of ours (a background thread, so
training never waits on the network) rather than the SDK's batch processors,
which drop the oldest item silently when their queue is full: here what does
not fit is counted. A step's trace is queued as one plain record and encoded to
OTLP protobuf on the export thread by `encode_spans` below: the SDK's
ReadableSpan, processor and encoder cost ~45 µs a span between the training
thread and the export thread, whose time is GIL time the training thread may
wait for. The SDK drops a batch whose export failed; here a failed batch is
kept in a bounded backlog and sent once the collector is back, oldest first.
Whatever is dropped before the collector acknowledged it (a full queue, the
backlog's overflow, a refusal, what still waits at exit) is counted per rank,
spans and rank-steps apart, and reported to the collector as `telemetry_loss`
events. A refused token (401, 403) is told apart from an unreachable collector:
`check_token` finds it before a job starts, and an exporter says it once and
stops a paced producer (the fleet simulator) rather than letting it run on.
Device samples carry their own timestamps, which the metrics API cannot
express, so they are handed to the SDK's OTLP metric exporter as ready-made
gauge points.
"""

import functools
import gzip
import itertools
import logging
import os
import random
import struct
import threading
import time
import zlib
from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple
from urllib.error import HTTPError, URLError
from urllib.request import Request, urlopen

from opentelemetry._logs import SeverityNumber
from opentelemetry.exporter.otlp.proto.http import Compression
from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter
from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse
from opentelemetry.sdk._logs import LoggerProvider, LogRecordProcessor, ReadableLogRecord, ReadWriteLogRecord
from opentelemetry.sdk._logs.export import LogRecordExportResult
from opentelemetry.sdk.metrics.export import Gauge, Metric, MetricsData, NumberDataPoint, ResourceMetrics, ScopeMetrics
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, TraceFlags

from rankwatch.agent import semconv as sc
from rankwatch.agent.config import TokenRefused
from rankwatch.agent.route import Route
from rankwatch.agent.stepspans import StepMarks, spans_of

SCOPE = "rankwatch.agent"
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
AttributeValue = str | int | float | bool
Attributes = Mapping[str, AttributeValue]
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
    """One finished trace (a step and its children) as the batcher queues it: one item a step,
    since queueing is done on the training thread."""

    trace_id: int
    root_id: int
    spans: tuple[tuple[str, int, int, Attributes], ...]  # (name, start ns, end ns, attributes), the root first
    resource: Resource


def _is_step(attributes: Attributes) -> bool:
    return attributes.get(sc.KIND) == sc.KIND_STEP


@dataclass
class Lost:
    """Telemetry dropped before the collector acknowledged it, cumulative since the process
    started: spans, the rank-steps among them (`step` spans), log records."""

    spans: int = 0
    rank_steps: int = 0
    records: int = 0

    def __bool__(self) -> bool:
        return bool(self.spans or self.rank_steps or self.records)

    def __add__(self, other: "Lost") -> "Lost":
        return Lost(self.spans + other.spans, self.rank_steps + other.rank_steps, self.records + other.records)


class Losses:
    """What was dropped, per resource (the rank it is from: the fleet simulator speaks for many).
    Counted where it is dropped: on the training thread only when its queue is full (a lock and a
    few additions), else on the export thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_resource: dict[int, tuple[Resource, Lost]] = {}

    def _of(self, resource: Resource) -> Lost:
        return self._by_resource.setdefault(id(resource), (resource, Lost()))[1]

    def spans(self, spans: Iterable[Span]) -> None:
        with self._lock:
            for span in spans:
                lost = self._of(span.resource)
                lost.spans += 1
                lost.rank_steps += _is_step(span.attributes)

    def traces(self, traces: Iterable[Trace]) -> None:
        with self._lock:
            for trace in traces:
                lost = self._of(trace.resource)
                lost.spans += len(trace.spans)
                lost.rank_steps += _is_step(trace.spans[0][3])

    def refused(self, spans: Sequence[Span], count: int) -> None:
        """`count` spans of a batch refused by the collector, which says how many, not which: the
        batch's step spans counted as refused up to `count`, all charged to its first rank."""
        with self._lock:
            lost = self._of(spans[0].resource)
            lost.spans += count
            lost.rank_steps += min(count, sum(_is_step(s.attributes) for s in spans))

    def records(self, resource: Resource, count: int) -> None:
        with self._lock:
            self._of(resource).records += count

    def add(self, resource: Resource, lost: Lost) -> None:
        """What was dropped before it reached this exporter (a rank's link to its node's sidecar)."""
        with self._lock:
            counts = self._of(resource)
            counts.spans, counts.rank_steps, counts.records = (
                counts.spans + lost.spans,
                counts.rank_steps + lost.rank_steps,
                counts.records + lost.records,
            )

    def by_resource(self) -> list[tuple[Resource, Lost]]:
        """A copy of each resource's counts."""
        with self._lock:
            return [(resource, Lost(**vars(lost))) for resource, lost in self._by_resource.values()]

    def total(self) -> Lost:
        return sum((lost for _, lost in self.by_resource()), Lost())


class Batcher:
    """A bounded queue that a thread of its own empties in batches into `sink`, the SDK batch
    processor's job but for what it drops: an item that does not fit goes to `on_drop` (counted),
    or with `block` the caller waits for room (the fleet simulator, which paces itself to the
    collector); what still waits when it stops goes to `on_drop` too. `after` runs on that thread
    after each round (the loss reports). The caller's side is a length check and an append."""

    def __init__(
        self,
        sink: Callable[[list], object],
        on_drop: Callable[[list], None],
        max_items: int,
        batch_items: int,
        delay_s: float,
        name: str,
        block: bool = False,
        after: Callable[[], None] = lambda: None,
    ):
        self._sink, self._on_drop, self._after = sink, on_drop, after
        self._max_items, self._batch_items, self._delay_s, self._block = max_items, batch_items, delay_s, block
        self._queue: deque = deque()
        self._wake = threading.Event()
        self._room = threading.Condition()
        self._exporting = threading.Lock()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, item) -> None:
        if len(self._queue) >= self._max_items:
            if not self._block or self._stopping:
                self._on_drop([item])
                return
            self._wake.set()
            with self._room:
                self._room.wait_for(lambda: len(self._queue) < self._max_items or self._stopping)
        self._queue.append(item)
        if len(self._queue) >= self._batch_items:
            self._wake.set()

    def _run(self) -> None:
        while not self._stopping:
            self._wake.wait(self._delay_s)
            self._wake.clear()
            self.flush()
            self._after()

    def flush(self) -> None:
        """Hand everything queued to the sink, now, on the caller's thread."""
        with self._exporting:
            while self._queue:
                batch = [self._queue.popleft() for _ in range(min(self._batch_items, len(self._queue)))]
                with self._room:
                    self._room.notify_all()
                self._sink(batch)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop the thread after its round; what still waits then is dropped."""
        self._stopping = True
        self._wake.set()
        with self._room:
            self._room.notify_all()
        self._thread.join(timeout_s)
        left = [self._queue.popleft() for _ in range(len(self._queue))]
        if left:
            self._on_drop(left)


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


# spans encoded between two releases of the GIL: the encoding is Python bytecode, which keeps a training
# thread waiting to take the GIL back (after a launch or a DDP hook) up to the switch interval (5 ms);
# a release every 16 spans (~0.25 ms of encoding) shortens the usual wait to ~0.1 ms (bench/gil.py,
# docs/benchmarks.md)
GIL_SLICE = 16


def encode_spans(spans: Sequence[Span], gil_slice: int = GIL_SLICE) -> bytes:
    """An OTLP ExportTraceServiceRequest, serialized: one ResourceSpans per resource. The GIL is given
    up every `gil_slice` spans (0: never)."""
    by_resource: dict[int, tuple[Resource, list[bytes]]] = {}
    for i, span in enumerate(spans, 1):
        by_resource.setdefault(id(span.resource), (span.resource, []))[1].append(_field(2, _span(span)))
        if gil_slice and i % gil_slice == 0:
            time.sleep(0)  # lets a thread waiting for the GIL take it
    scope_field = _field(1, _field(1, SCOPE.encode()))
    return b"".join(
        _field(1, _field(1, _key_values(1, resource.attributes)) + _field(2, scope_field + b"".join(encoded)))
        for resource, encoded in by_resource.values()
    )


class Sent(NamedTuple):
    """How one export went. `answered`: the collector took the batch or refused it for good (a 4xx);
    else it may be tried again (unreachable, a timeout, a 5xx), after `retry_after_s` if it said so."""

    answered: bool
    refused: int = 0  # items the collector refused: all of them on a 4xx, those partial_success counts on a 2xx
    retry_after_s: float | None = None


_RETRY_LATER = Sent(False)
_RETRIED_STATUSES = {408, 429}  # 4xx that mean "not now" rather than "never"
_TOKEN_STATUSES = {401, 403}  # the token is missing or wrong: every later export would be refused too


def refusal(endpoint: str, status: int) -> str:
    """What a 401 or 403 means, in one line."""
    why = "a token of another scope: this takes an ingest token" if status == 403 else "missing or wrong bearer token"
    return f"the collector at {endpoint} refused the token (HTTP {status}: {why})"


def check_token(endpoints: str, token: str | None, timeout_s: float = 5.0) -> bool:
    """Whether the collector at `endpoints` (one URL, or several comma-separated: the one this rank's
    route picks) takes `token`, by an empty (and so free) authenticated OTLP export: True when it does,
    False when none can be reached (a job goes on; its telemetry waits), TokenRefused when it answers
    401 or 403, which no retry would change."""
    endpoint = Route.of(endpoints).reachable()
    if endpoint is None:
        return False
    headers = {"Content-Type": "application/x-protobuf"} | ({"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urlopen(Request(f"{endpoint.rstrip('/')}/v1/traces", b"", headers), timeout=timeout_s):
            return True
    except HTTPError as e:
        if e.code in _TOKEN_STATUSES:
            raise TokenRefused(refusal(endpoint.rstrip("/"), e.code)) from None
        return True  # it answered, and not about the token: the exports will say what else is wrong
    except (URLError, OSError):
        return False


def _retry_after(error: HTTPError) -> float | None:
    try:
        return max(float(error.headers.get("Retry-After", "")), 0.0)
    except ValueError:
        return None


class SpanExporter:
    """OTLP/HTTP protobuf export of `Span` records: one gzipped POST a batch, no retries (the
    Backlog around it keeps and retries a batch that failed)."""

    def __init__(self, headers: dict, timeout_s: float, on_token_refused: Callable[[int], None]):
        self._timeout_s, self._on_token_refused = timeout_s, on_token_refused
        self._headers = {**headers, "Content-Type": "application/x-protobuf", "Content-Encoding": "gzip"}

    def export(self, spans: Sequence[Span], endpoint: str) -> Sent:
        body = gzip.compress(encode_spans(spans), compresslevel=6)
        try:
            with urlopen(Request(f"{endpoint}/v1/traces", body, self._headers), timeout=self._timeout_s) as response:
                answer = ExportTraceServiceResponse.FromString(response.read())  # 2xx: urlopen raises for the others
                return Sent(True, answer.partial_success.rejected_spans)
        except HTTPError as e:
            if e.code in _TOKEN_STATUSES:
                self._on_token_refused(e.code)
                return Sent(True, len(spans))
            if 400 <= e.code < 500 and e.code not in _RETRIED_STATUSES:
                log.warning("rankwatch: the collector refused %d spans: HTTP %d", len(spans), e.code)
                return Sent(True, len(spans))
            return Sent(False, retry_after_s=_retry_after(e))
        except (URLError, OSError, ValueError):  # ValueError: a 2xx body that is no OTLP response (DecodeError)
            return _RETRY_LATER

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True

    def shutdown(self) -> None:
        """Nothing to stop: an export in flight ends within its timeout."""


class _PerCollector:
    """One of the SDK's OTLP/HTTP exporters (`kind`, at `path`) for each collector sent to, made when first
    sent to (a route moves to another collector when its own is gone)."""

    def __init__(self, kind: type, path: str, headers: dict, timeout_s: float):
        self._make = lambda endpoint: kind(
            endpoint=f"{endpoint}{path}", headers=headers, timeout=timeout_s, compression=Compression.Gzip
        )
        self._exporters: dict = {}

    def __call__(self, endpoint: str):
        if endpoint not in self._exporters:
            self._exporters[endpoint] = self._make(endpoint)
        return self._exporters[endpoint]

    def shutdown(self) -> None:
        for exporter in self._exporters.values():
            exporter.shutdown()


class _LogExporter:
    """The SDK's OTLP/HTTP log exporter (one per collector sent to), its result as a `Sent`: it retries
    5xx itself within its timeout."""

    def __init__(self, headers: dict, timeout_s: float):
        self._to = _PerCollector(OTLPLogExporter, "/v1/logs", headers, timeout_s)

    def export(self, records: Sequence[ReadableLogRecord], endpoint: str) -> Sent:
        return Sent(True) if self._to(endpoint).export(records) is LogRecordExportResult.SUCCESS else _RETRY_LATER

    def shutdown(self) -> None:
        self._to.shutdown()


class Backlog:
    """Wraps an exporter: batches that could not be sent wait (up to `max_items`, the oldest
    dropped beyond) and go out first, in order, when the collector is back. While it is away it
    is tried at most every `retry_s` (or after the Retry-After it answered), and only once it
    accepts connections again, so neither exports nor the end of a job wait out retries.
    `paced` (the fleet simulator): a collector that answers but cannot take the batch now (503,
    a timeout) is waited for, the batch tried again until it is taken or `patience_s` passes, so
    the queues before it fill and their producer waits rather than anything being dropped, unless
    `token_refused()` says the collector refused the token (then the batch is refused at once).
    Dropped batches go to `on_drop`, refused items to `on_refused`."""

    def __init__(
        self,
        exporter,
        max_items: int,
        route: Route,
        on_drop: Callable[[list], None],
        on_refused: Callable[[list, int], None],
        on_first_failure=None,
        retry_s: float = 5.0,
        paced: bool = False,
        patience_s: float = 120.0,
        token_refused: Callable[[], object] = lambda: None,
    ):
        self._exporter = exporter
        self._route = route
        self._max_items = max_items
        self._on_drop, self._on_refused = on_drop, on_refused
        self._on_first_failure = on_first_failure
        self._retry_s = retry_s
        self._paced, self._patience_s, self._token_refused = paced, patience_s, token_refused
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

    def items(self) -> list:
        """The items waiting, oldest first."""
        with self._lock:
            return [item for batch in self._batches for item in batch]

    def export(self, batch: Sequence) -> None:
        with self._lock:
            if batch:
                self._batches.append(list(batch))
                self._items += len(batch)
            if time.monotonic() >= self._next_try and not self._closed:
                self._send_waiting()
            while self._items > self._max_items and len(self._batches) > 1:
                self._drop(self._batches.popleft())

    def _drop(self, batch: list) -> None:
        self._items -= len(batch)
        self._late = max(self._late - len(batch), 0)
        self.dropped += len(batch)
        self._on_drop(batch)

    def _try(self, batch: list) -> Sent:
        """One export, or with `paced` as many as a collector that answers needs to take it."""
        give_up = time.monotonic() + self._patience_s
        while True:
            endpoint = self._route.reachable()  # (the next collector of several, when this one is gone)
            sent = self._exporter.export(batch, endpoint) if endpoint else _RETRY_LATER
            if sent.answered or not self._paced or self._closed or time.monotonic() > give_up:
                return sent
            if self._token_refused():  # a refused token is no busy collector: no wait mends it
                return Sent(True, len(batch))
            if sent.retry_after_s is None and self._route.reachable() is None:
                return sent  # gone, not busy: the batch waits in the backlog
            time.sleep(min(sent.retry_after_s or 1.0, 5.0))

    def _send_waiting(self) -> None:
        while self._batches:
            sent = self._try(self._batches[0])
            if not sent.answered:
                self._late = self._items
                self._next_try = time.monotonic() + max(sent.retry_after_s or 0.0, self._retry_s)
                if self._on_first_failure:
                    self._on_first_failure()
                    self._on_first_failure = None
                return
            batch = self._batches.popleft()
            self._items -= len(batch)
            late = min(len(batch), self._late)
            self._late -= late
            self.delivered_late += late
            if sent.refused:
                self._on_refused(batch, min(sent.refused, len(batch)))

    def deliver(self) -> None:
        """Try now, whenever the last try was: a collector that is back gets what waits."""
        with self._lock:
            self._send_waiting()

    def close(self) -> None:
        """Stop sending: an export still retrying or a paced wait gives up now, later batches only wait."""
        self._closed = True
        self._exporter.shutdown()  # aborts the retry loop of an export in flight

    def shutdown(self) -> None:
        """After the last export: what waits now is dropped."""
        with self._lock:
            while self._batches:
                self._drop(self._batches.popleft())


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
            _LogExporter(headers, timeout_s),
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
        self._metric_exporter = _PerCollector(OTLPMetricExporter, "/v1/metrics", headers, timeout_s)
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
