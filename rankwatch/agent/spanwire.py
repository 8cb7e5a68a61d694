"""Finished spans as the agent queues them, and their OTLP protobuf encoding.

A step's trace is queued as one plain record (`Trace`) and encoded on the export thread by
`encode_spans`, a few hand-written protobuf fields a span: the SDK's ReadableSpan, processor and
encoder cost ~45 µs a span between the training thread and the export thread, whose time is GIL
time the training thread may wait for (tests/agent/test_span_encoding.py holds it to the official classes).
"""

import functools
import struct
import time
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from opentelemetry.sdk.resources import Resource

SCOPE = "rankwatch.agent"
AttributeValue = str | int | float | bool
Attributes = Mapping[str, AttributeValue]


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
