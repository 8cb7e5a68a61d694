"""One OTLP/HTTP export attempt of a batch, and what came of it (`Sent`): the agent's own span exporter,
the SDK's log exporter per collector, and the token check a launcher makes before a job starts. No
retries here: a Backlog (rankwatch/agent/backlog.py) keeps and retries what failed."""

import gzip
import logging
from collections.abc import Callable, Sequence
from typing import NamedTuple
from urllib.error import HTTPError, URLError
from urllib.request import Request, urlopen

from opentelemetry.exporter.otlp.proto.http import Compression
from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse
from opentelemetry.sdk._logs import ReadableLogRecord
from opentelemetry.sdk._logs.export import LogRecordExportResult

from rankwatch.agent.config import TokenRefused
from rankwatch.agent.route import Route
from rankwatch.agent.spanwire import Span, encode_spans

log = logging.getLogger("rankwatch.agent")


class Sent(NamedTuple):
    """How one export went. `answered`: the collector took the batch or refused it for good (a 4xx);
    else it may be tried again (unreachable, a timeout, a 5xx), after `retry_after_s` if it said so."""

    answered: bool
    refused: int = 0  # items the collector refused: all of them on a 4xx, those partial_success counts on a 2xx
    retry_after_s: float | None = None


RETRY_LATER = Sent(False)
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
            return RETRY_LATER

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True

    def shutdown(self) -> None:
        """Nothing to stop: an export in flight ends within its timeout."""


class PerCollector:
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


class LogExporter:
    """The SDK's OTLP/HTTP log exporter (one per collector sent to), its result as a `Sent`: it retries
    5xx itself within its timeout."""

    def __init__(self, headers: dict, timeout_s: float):
        self._to = PerCollector(OTLPLogExporter, "/v1/logs", headers, timeout_s)

    def export(self, records: Sequence[ReadableLogRecord], endpoint: str) -> Sent:
        return Sent(True) if self._to(endpoint).export(records) is LogRecordExportResult.SUCCESS else RETRY_LATER

    def shutdown(self) -> None:
        self._to.shutdown()
