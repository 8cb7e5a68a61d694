"""The OTLP trace decoder on the protobuf runtime: the twin of collector/receive/_otlpwire.c.

The C decoder is an optional build (it needs a compiler); where it is not built,
the collector decodes with this one, about ten times slower (docs/benchmarks.md).
Both take and return the same things, described in collector/receive/_otlpwire.c, and
tests/collector/receive/test_decode_differential.py holds them to the same result for any body,
valid or not. Here the protobuf runtime parses (and refuses what it cannot
parse); the rest follows the C decoder's rules: the last of a repeated
attribute key wins, attribute values nested past MAX_DEPTH make the request
malformed, and a span past max_attributes keeps no attributes.
"""

import contextlib
import json
import math

import pyarrow as pa
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

MAX_DEPTH = 16  # attribute values nested in one another, as in the C decoder
MAX_NESTING = 100  # messages and groups: the protobuf runtime's recursion limit
# The columns of every decoded span besides the wanted attributes (and `attrs`, the rest as JSON),
# the C decoder's too, and their Arrow types.
SPAN_COLUMNS = {
    "resource": pa.int32(),
    "trace_id": pa.binary(),
    "span_id": pa.binary(),
    "parent_span_id": pa.binary(),
    "name": pa.string(),
    "start": pa.uint64(),
    "end": pa.uint64(),
}
_TYPES = {"q": pa.int64(), "i": pa.int32(), "d": pa.float64(), "s": pa.string()}
_INT32 = range(-(2**31), 2**31)


class Malformed(ValueError):
    """A request that cannot be read; the message says why."""

    def __init__(self, why: str):
        super().__init__(f"malformed OTLP protobuf: {why}")


def value(v: AnyValue, room: float = math.inf):
    """An OTLP AnyValue as a plain Python value; Malformed when arrays and kvlists nest more than
    `room` levels deep."""
    if room < 0:
        raise Malformed("attribute values nested too deep")
    which = v.WhichOneof("value")
    if which == "array_value":
        return [value(x, room - 1) for x in v.array_value.values]
    if which == "kvlist_value":
        last = {kv.key: kv for kv in v.kvlist_value.values}  # read only the value that counts, as the C decoder
        return {key: value(kv.value, room - 1) if kv.HasField("value") else None for key, kv in last.items()}
    return getattr(v, which) if which else None


def json_text(v) -> str:
    """A value as JSON, as the C decoder writes it: UTF-8 unescaped, bytes as hex and non-finite
    doubles as null (NaN is no JSON, and the store's JSON columns refuse it)."""
    try:
        return json.dumps(v, default=bytes.hex, allow_nan=False, ensure_ascii=False)
    except ValueError:
        return json.dumps(_finite(v), default=bytes.hex, ensure_ascii=False)


def _finite(v):
    if type(v) is float:
        return v if math.isfinite(v) else None
    if type(v) is list:
        return [_finite(x) for x in v]
    if type(v) is dict:
        return {k: _finite(x) for k, x in v.items()}
    return v


def traces(bodies: list[bytes], wanted: tuple[tuple[str, str, str], ...], max_attributes: int) -> dict:
    """Export requests as spans in Arrow's columnar layout, as collector/receive/_otlpwire.c's traces()."""
    names = [*SPAN_COLUMNS, *(column for column, _, _ in wanted), "attrs"]
    out: dict = {"resources": [], "owners": [], "spans": 0, "odd": [], "crowded": [], "errors": []}
    cells: list[list] = [[] for _ in names]
    for i, body in enumerate(bodies):
        try:
            resources, rows, odd, crowded = _request(body, wanted, max_attributes, len(out["resources"]), out["spans"])
        except DecodeError as e:
            out["errors"].append((i, str(Malformed(str(e)))))
            continue
        except Malformed as e:
            out["errors"].append((i, str(e)))
            continue
        out["resources"] += resources
        out["owners"] += [i] * len(resources)
        out["odd"] += odd
        out["crowded"] += crowded
        out["spans"] += len(rows)
        for column, row_cells in zip(cells, zip(*rows)):
            column += row_cells
    types = [*SPAN_COLUMNS.values(), *(_TYPES[t] for _, _, t in wanted), pa.string()]
    out["columns"] = {
        name: tuple(pa.array(column, t).buffers()) if out["spans"] else ()
        for name, column, t in zip(names, cells, types)
    }
    return out


def _request(body: bytes, wanted, max_attributes: int, first_resource: int, first_row: int):
    """One request's resources, span rows, odd cells and crowded spans."""
    request = ExportTraceServiceRequest.FromString(body)
    resources: list[dict] = []
    rows: list[tuple] = []
    odd: list[tuple] = []
    crowded: list[int] = []
    for resource, rs in enumerate(request.resource_spans, first_resource):
        resources.append(
            {kv.key: value(kv.value, MAX_DEPTH) if kv.HasField("value") else None for kv in rs.resource.attributes}
        )
        for ss in rs.scope_spans:
            for span in ss.spans:
                row = first_row + len(rows)
                attributes = {kv.key: kv for kv in span.attributes}
                if len(span.attributes) > max_attributes:
                    crowded.append(row)
                    attributes = {}
                cells = [
                    resource,
                    span.trace_id,
                    span.span_id,
                    span.parent_span_id or None,
                    span.name,
                    span.start_time_unix_nano,
                    span.end_time_unix_nano,
                ]
                cells += [_cell(attributes.pop(key, None), column, t, row, odd) for column, key, t in wanted]
                others = {
                    key: value(kv.value, MAX_DEPTH) if kv.HasField("value") else None for key, kv in attributes.items()
                }
                rows.append((*cells, json_text(others) if others else None))
    return resources, rows, odd, crowded


def _cell(kv, column: str, t: str, row: int, odd: list):
    """A wanted attribute's cell, typed; a value of another type is None plus an `odd` entry."""
    if kv is None or not kv.HasField("value") or kv.value.WhichOneof("value") is None:
        return None
    v, which = kv.value, kv.value.WhichOneof("value")
    if (t == "s" and which == "string_value") or (t == "q" and which == "int_value"):
        return getattr(v, which)
    if t == "i" and which == "int_value" and v.int_value in _INT32:
        return v.int_value
    if t == "d" and which in ("int_value", "double_value"):
        return float(getattr(v, which))
    odd.append((row, column, value(v, MAX_DEPTH)))
    return None


def entries(body: bytes, points: bool, limit: int) -> int:
    """Resources, scopes and items (with `points`, metrics' data points too) of an export request,
    counted on the wire up to just past `limit`, as collector/receive/_otlpwire.c's entries(); a malformed
    body counts as far as it reads."""
    n = [0]
    with contextlib.suppress(Malformed):
        _count(memoryview(body), 0, len(body), 0, points, limit, n)
    return n[0]


def _count(buf: memoryview, at: int, end: int, level: int, points: bool, limit: int, n: list[int]) -> None:
    while at < end and n[0] <= limit:
        at, field, wire = _tag(buf, at, end)
        child = (
            field == 1
            if level == 0
            else field == 2
            if level < 3
            else field in (5, 7, 9, 10, 11)
            if level == 3
            else field == 1
        )
        if not child or wire != 2:
            at = _skip(buf, at, end, field, wire, 0)
            continue
        size, at = _varint(buf, at, end)
        if size > end - at:
            raise Malformed("length past end of message")
        if level != 3:
            n[0] += 1
        if level < 2 or (points and level < 4):
            _count(buf, at, at + size, level + 1, points, limit, n)
        at += size


def _varint(buf: memoryview, at: int, end: int) -> tuple[int, int]:
    v = 0
    for shift in range(0, 64, 7):
        if at >= end:
            raise Malformed("truncated varint")
        b = buf[at]
        at += 1
        v |= (b & 0x7F) << shift
        if not b & 0x80:
            return v & 0xFFFF_FFFF_FFFF_FFFF, at
    raise Malformed("varint too long")


def _tag(buf: memoryview, at: int, end: int) -> tuple[int, int, int]:
    tag, at = _varint(buf, at, end)
    if tag > 0xFFFF_FFFF:
        raise Malformed("tag past 32 bits")
    if tag >> 3 == 0:
        raise Malformed("field number 0")
    return at, tag >> 3, tag & 7


def _skip(buf: memoryview, at: int, end: int, field: int, wire: int, depth: int) -> int:
    """Where the field's value ends; groups are skipped to their end tag."""
    if wire == 0:
        return _varint(buf, at, end)[1]
    if wire in (1, 5):
        if end - at < (8 if wire == 1 else 4):
            raise Malformed("truncated fixed")
        return at + (8 if wire == 1 else 4)
    if wire == 2:
        size, at = _varint(buf, at, end)
        if size > end - at:
            raise Malformed("length past end of message")
        return at + size
    if wire == 3:
        if depth + 1 > MAX_NESTING:
            raise Malformed("groups nested too deep")
        while True:
            at, f, w = _tag(buf, at, end)
            if w == 4:
                if f != field:
                    raise Malformed("mismatched end of group")
                return at
            at = _skip(buf, at, end, f, w, depth + 1)
    raise Malformed("unexpected wire type")
