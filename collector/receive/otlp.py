"""OTLP/HTTP wire format: request bodies in, response bodies out.

Follows the OTLP specification (opentelemetry-proto, docs/specification.md):
binary protobuf or JSON (where trace and span ids are hex strings), optional
gzip, and the status codes an exporter acts on. Failures raise OtlpError with
the HTTP status the spec prescribes.
"""

import base64
import json
import zlib

from google.protobuf import json_format
from google.protobuf.message import DecodeError, Message
from google.rpc.status_pb2 import Status
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceResponse
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceResponse
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

MAX_BODY = 20 * 2**20  # bytes, after decompression
MAX_JSON_BODY = 4 * 2**20  # bytes of OTLP/JSON, after decompression: its decode costs ~60x protobuf's
MAX_GZIP_MEMBERS = 16
PROTOBUF = "application/x-protobuf"
JSON = "application/json"
_ID_FIELDS = {"traceId", "spanId", "parentSpanId"}


class OtlpError(Exception):
    """A request the collector refuses, with its HTTP status."""

    def __init__(self, status: int, message: str):
        super().__init__(status, message)  # both in args, so it pickles across processes
        self.status = status
        self.message = message

    def __str__(self) -> str:
        return self.message


def media_type(content_type: str | None) -> str:
    """The request's encoding, or 415 when it is neither protobuf nor JSON."""
    kind = (content_type or "").split(";")[0].strip().lower()
    if kind not in (PROTOBUF, JSON):
        raise OtlpError(415, f"unsupported content type {content_type!r}; use {PROTOBUF} or {JSON}")
    return kind


def encoding(content_encoding: str | None) -> str | None:
    """The body's encoding: None or "gzip"; 415 for any other."""
    value = (content_encoding or "identity").strip().lower()
    if value not in ("identity", "gzip"):
        raise OtlpError(415, f"unsupported content encoding {value!r}; use gzip")
    return None if value == "identity" else value


def max_body(kind: str) -> int:
    """The most bytes a body of this media type may hold, after decompression."""
    return MAX_JSON_BODY if kind == JSON else MAX_BODY


def decompress(body: bytes, encoding: str | None, cap: int = MAX_BODY) -> bytes:
    """The body with its encoding (None or "gzip") removed, never more than `cap` bytes.

    A gzip body whose trailer declares more than `cap` is refused before inflating, and inflation
    stops at the cap anyway (the trailer is the client's word), so a gzip bomb costs at most `cap`
    of memory. A gzip body of several members (as concatenated gzip files are) is read whole, up to
    MAX_GZIP_MEMBERS of them: each further member costs a copy of the rest of the body.
    """
    too_large = OtlpError(413, f"body larger than {cap} bytes after decompression")
    if encoding is None:
        if len(body) > cap:
            raise too_large
        return body
    declared = int.from_bytes(body[-4:], "little")  # ISIZE: the last member's size (mod 2^32), a lower bound
    out = bytearray()
    rest = body
    for _ in range(MAX_GZIP_MEMBERS):
        inflater = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
        try:
            out += inflater.decompress(rest, 64)  # the header and a first block: a body that is not gzip is 400
            if declared > cap:
                raise too_large
            out += inflater.decompress(inflater.unconsumed_tail, cap + 1 - len(out))
        except zlib.error as e:
            raise OtlpError(400, f"invalid gzip body: {e}") from None
        if len(out) > cap:
            raise too_large
        if not inflater.eof:
            raise OtlpError(400, "invalid gzip body: truncated")
        rest = inflater.unused_data
        if not rest:
            return bytes(out)
    raise OtlpError(400, f"invalid gzip body: more than {MAX_GZIP_MEMBERS} gzip members")


# The lists of OTLP/JSON whose elements are entries (resources, scopes, items, data points), both spellings.
_ENTRY_LISTS = frozenset(
    f
    for name in (
        "resource_spans",
        "scope_spans",
        "spans",
        "resource_metrics",
        "scope_metrics",
        "metrics",
        "data_points",
        "resource_logs",
        "scope_logs",
        "log_records",
    )
    for f in (name, name.split("_")[0] + "".join(w.title() for w in name.split("_")[1:]))
)


# The objects whose attributes a whole request shares: no item can be refused alone for them.
_SHARED = frozenset(("resource", "scope"))


def _prepare(node, entries: list[int], max_attributes: int | None) -> None:
    """OTLP/JSON ids from hex to the base64 protobuf's JSON mapping wants, the tree's entries
    counted into entries[0] on the way (one walk of the tree), and 413 for a resource or scope
    with more than `max_attributes` attributes."""
    if isinstance(node, dict):
        for key, val in node.items():
            if key in _ID_FIELDS and isinstance(val, str):
                try:
                    node[key] = base64.b64encode(bytes.fromhex(val)).decode()
                except ValueError:
                    raise OtlpError(400, f"{key} {val!r} is not hex") from None
            else:
                if key in _ENTRY_LISTS and isinstance(val, list):
                    entries[0] += len(val)
                elif key in _SHARED and max_attributes is not None and isinstance(val, dict):
                    attributes = val.get("attributes")
                    if isinstance(attributes, list) and len(attributes) > max_attributes:
                        raise OtlpError(413, f"a {key} has more than {max_attributes} attributes")
                _prepare(val, entries, max_attributes)
    elif isinstance(node, list):
        for item in node:
            _prepare(item, entries, max_attributes)


def parse(
    body: bytes,
    kind: str,
    message: type[Message],
    max_entries: int | None = None,
    max_attributes: int | None = None,
) -> Message:
    """The request message, or 400 when the body does not decode; for JSON, 413 past `max_entries`
    resources, scopes, items and data points, or a resource or scope past `max_attributes`
    attributes, counted before the costly conversion to protobuf (2M empty spans, 6 MiB of JSON,
    took 9 s of CPU to convert)."""
    request = message()
    try:
        if kind == PROTOBUF:
            request.ParseFromString(body)
        else:
            tree = json.loads(body)
            if not isinstance(tree, dict):
                raise OtlpError(400, f"malformed {message.DESCRIPTOR.name}: JSON body is not an object")
            entries = [0]
            _prepare(tree, entries, max_attributes)
            if max_entries is not None and entries[0] > max_entries:
                raise OtlpError(
                    413, f"more than {max_entries} resources, scopes and items in one request; send smaller batches"
                )
            json_format.ParseDict(tree, request, ignore_unknown_fields=True)
    except (DecodeError, ValueError, TypeError, json_format.ParseError, RecursionError) as e:
        raise OtlpError(400, f"malformed {message.DESCRIPTOR.name}: {e}") from None
    return request


_Response = ExportTraceServiceResponse | ExportMetricsServiceResponse | ExportLogsServiceResponse
_RESPONSES: dict[str, tuple[type[_Response], str]] = {
    "traces": (ExportTraceServiceResponse, "rejected_spans"),
    "metrics": (ExportMetricsServiceResponse, "rejected_data_points"),
    "logs": (ExportLogsServiceResponse, "rejected_log_records"),
}


def success(signal: str, rejected: int, error: str, kind: str) -> bytes:
    """An Export*ServiceResponse, with partial_success when items were rejected."""
    response_type, counter = _RESPONSES[signal]
    response = response_type()
    if rejected or error:
        setattr(response.partial_success, counter, rejected)
        response.partial_success.error_message = error
    return encode(response, kind)


def status(code: int, message: str, kind: str) -> bytes:
    """A google.rpc.Status body for a failed request."""
    grpc_code = {400: 3, 401: 16, 403: 7, 408: 4, 413: 8, 415: 3, 503: 14}.get(code, 13)
    return encode(Status(code=grpc_code, message=message), kind)


def encode(message: Message, kind: str) -> bytes:
    if kind == JSON:
        return json_format.MessageToJson(message, indent=None).encode()
    return message.SerializeToString()
