"""The two trace decoders, the C one (collector/receive/_otlpwire.c) and its twin on the protobuf runtime
(collector/receive/otlpwire.py), give the same result for any body: random valid OTLP built with the proto
messages (every attribute value type, odd and missing fields, repeated keys), and the same made
corrupt (bit flips, truncation, concatenation, random bytes). Same columns from the wire, same
rows and rejections after decoding, and the same requests refused (400) or counted too large (413)."""

import math

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from collector.receive import _otlpwire, decode, otlpwire
from collector.receive.decode import MAX_ATTRIBUTES, MAX_ITEMS, MAX_NAME_BYTES, MAX_TEXT_BYTES
from rankwatch.agent import semconv as sc

T0 = 1_700_000_000_000_000_000
# Keys: the typed columns' own (so values of every type meet them), and a few others that repeat.
KEYS = st.sampled_from(
    [
        sc.RUN_ID,
        sc.RANK,
        sc.KIND,
        sc.STEP,
        sc.LOSS,
        sc.TOKENS,
        sc.COMM_GROUP,
        sc.COMM_GROUP_SIZE,
        sc.COMM_BYTES,
        sc.MFU,
        "a",
        "b",
        "",
        "é",
        'x\ny"z\\',
    ]
)
TEXT = st.text(max_size=8)
SCALARS = st.one_of(
    st.none(),
    TEXT,
    st.booleans(),
    st.integers(-(2**63), 2**63 - 1),
    st.floats(),
    st.binary(max_size=6),
    st.sampled_from([sc.KIND_STEP, sc.KIND_COMM, "7", "-3", "1.5"]),
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.lists(st.tuples(KEYS, inner), max_size=3)),
    max_leaves=8,
)
ATTRIBUTES = st.lists(st.tuples(KEYS, VALUES | st.just(...)), max_size=6)  # ...: a KeyValue without a value


def _set(any_value: AnyValue, v) -> None:
    """An AnyValue holding `v` (None: empty; a list of pairs: a kvlist)."""
    if type(v) is bool:
        any_value.bool_value = v
    elif type(v) is int:
        any_value.int_value = v
    elif type(v) is float:
        any_value.double_value = v
    elif type(v) is str:
        any_value.string_value = v
    elif type(v) is bytes:
        any_value.bytes_value = v
    elif type(v) is list and v and all(type(x) is tuple for x in v):
        any_value.kvlist_value.SetInParent()
        _attrs(any_value.kvlist_value.values, v)
    elif type(v) is list:
        any_value.array_value.SetInParent()
        for x in v:
            _set(any_value.array_value.values.add(), x)


def _attrs(repeated, pairs) -> None:
    for key, v in pairs:
        kv = repeated.add(key=key)
        if v is not ...:
            _set(kv.value, v)


@st.composite
def spans(draw):
    return {
        "name": draw(st.sampled_from(["step", "all_reduce", "forward", ""]) | TEXT),
        "trace_id": draw(st.binary(max_size=16)),
        "span_id": draw(st.binary(max_size=8)),
        "parent": draw(st.binary(max_size=8)),
        "start": draw(st.sampled_from([0, T0, T0 + 10**9, 2**63, 2**64 - 1])),
        "length": draw(st.sampled_from([0, 1000, 10**9])),
        "attributes": draw(ATTRIBUTES),
        "status": draw(st.none() | TEXT),
        "events": draw(st.lists(st.tuples(TEXT, ATTRIBUTES), max_size=2)),
    }


@st.composite
def requests(draw) -> bytes:
    request = ExportTraceServiceRequest()
    for _ in range(draw(st.integers(0, 3))):
        rs = request.resource_spans.add()
        if draw(st.booleans()):
            rs.resource.SetInParent()
            _attrs(
                rs.resource.attributes,
                draw(
                    st.lists(
                        st.tuples(
                            st.sampled_from([sc.RUN_ID, sc.RANK, sc.HOST_NAME, sc.LOCAL_RANK, "a"]),
                            st.sampled_from(["run", 0, 3, "5", -1, 2**40, None, 1.0]) | VALUES,
                        ),
                        max_size=5,
                    )
                ),
            )
        rs.schema_url = draw(TEXT)
        for _ in range(draw(st.integers(0, 2))):
            ss = rs.scope_spans.add()
            if draw(st.booleans()):
                ss.scope.name, ss.scope.version = draw(TEXT), draw(TEXT)
                _attrs(ss.scope.attributes, draw(ATTRIBUTES))
            for s in draw(st.lists(spans(), max_size=4)):
                span = ss.spans.add(
                    name=s["name"],
                    trace_id=s["trace_id"],
                    span_id=s["span_id"],
                    parent_span_id=s["parent"],
                    start_time_unix_nano=s["start"],
                    end_time_unix_nano=min(s["start"] + s["length"], 2**64 - 1),
                )
                _attrs(span.attributes, s["attributes"])
                if draw(st.integers(0, 20)) == 0:  # past MAX_ATTRIBUTES: refused alone
                    _attrs(span.attributes, [(f"k{i}", i) for i in range(MAX_ATTRIBUTES)])
                if s["status"] is not None:
                    span.status.message = s["status"]
                for name, attributes in s["events"]:
                    _attrs(span.events.add(name=name).attributes, attributes)
    return request.SerializeToString()


@st.composite
def corrupted(draw) -> bytes:
    """A valid request made corrupt, or random bytes."""
    body = draw(requests())
    how = draw(st.sampled_from(["flip", "flips", "truncate", "concatenate", "random"]))
    if how == "random" or not body:
        return draw(st.binary(max_size=64))
    if how == "truncate":
        return body[: draw(st.integers(0, len(body) - 1))]
    if how == "concatenate":  # protobuf merges: a second copy of each field, or of another request's
        return body + draw(st.sampled_from([body, draw(requests())]))
    flipped = bytearray(body)
    for _ in range(1 if how == "flip" else draw(st.integers(2, 6))):
        at = draw(st.integers(0, len(body) - 1))
        flipped[at] ^= 1 << draw(st.integers(0, 7))
    return bytes(flipped)


def _plain(v):
    """A value with NaN made comparable."""
    if isinstance(v, float) and math.isnan(v):
        return "NaN"
    if isinstance(v, list | tuple):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    return v


def _wire_columns(result: dict) -> dict:
    """The wire decoder's columns as Python values, by name."""
    n = result["spans"]
    if not n:
        return dict.fromkeys(result["columns"], ())
    schema = {**decode._WIRE_COLUMNS, **{c: decode._span_field(c).type for c in decode._SPAN_KEYS.values()}}
    return {
        name: _plain(
            pa.Array.from_buffers(schema[name], n, [b if b is None else pa.py_buffer(b) for b in bufs]).to_pylist()
        )
        for name, bufs in result["columns"].items()
    }


def assert_same(bodies: list[bytes], monkeypatch) -> None:
    c, py = (wire.traces(bodies, decode._wanted(), MAX_ATTRIBUTES) for wire in (_otlpwire, otlpwire))
    assert [i for i, _ in c["errors"]] == [i for i, _ in py["errors"]], (c["errors"], py["errors"])
    for key in ("resources", "owners", "spans", "odd", "crowded"):
        assert _plain(c[key]) == _plain(py[key]), key
    assert _wire_columns(c) == _wire_columns(py)

    decoded = {}
    for name, wire in (("c", _otlpwire), ("python", otlpwire)):
        monkeypatch.setattr(decode, "WIRE", wire)
        decoded[name] = decode.decode("traces", bodies)
    a, b = decoded["c"], decoded["python"]
    assert [(bool(p.malformed), p.rows, p.rejected, p.error) for p in a.parts] == [
        (bool(p.malformed), p.rows, p.rejected, p.error) for p in b.parts
    ]
    assert {k: _plain(t.to_pylist()) for k, t in a.tables.items()} == {
        k: _plain(t.to_pylist()) for k, t in b.tables.items()
    }
    assert _plain(a.ranks) == _plain(b.ranks)

    for body in bodies:  # the 413 check before decoding, for traces and (counting points) metrics
        for points in (False, True):
            for limit in (3, MAX_ITEMS):
                assert _otlpwire.entries(body, points, limit) == otlpwire.entries(body, points, limit)


SETTINGS = settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)


@SETTINGS
@given(bodies=st.lists(requests(), min_size=1, max_size=3))
def test_valid_requests_decode_the_same(bodies, monkeypatch):
    assert_same(bodies, monkeypatch)


@SETTINGS
@given(bodies=st.lists(corrupted() | requests(), min_size=1, max_size=3))
def test_corrupt_requests_decode_or_fail_the_same(bodies, monkeypatch):
    assert_same(bodies, monkeypatch)


def _nested(levels: int) -> AnyValue:
    v = AnyValue(int_value=1)
    for _ in range(levels):
        outer = AnyValue()
        outer.array_value.values.append(v)
        v = outer
    return v


def _kv(value: bytes, key: bytes = b"a") -> bytes:
    """A KeyValue's bytes: key, then the given value field bytes."""
    return b"\x0a" + bytes([len(key)]) + key + value


def _field(number: int, payload: bytes) -> bytes:
    return bytes([number << 3 | 2, len(payload)]) + payload


def _span_body(*attributes: bytes, name: bytes = b"op") -> bytes:
    resource = _field(1, _kv(_field(2, AnyValue(string_value="r").SerializeToString()), sc.RUN_ID.encode())) + _field(
        1, _kv(_field(2, AnyValue(int_value=0).SerializeToString()), sc.RANK.encode())
    )
    span = (
        _field(5, name)
        + b"\x39"
        + T0.to_bytes(8, "little")
        + b"\x41"
        + (T0 + 5).to_bytes(8, "little")
        + b"".join(_field(9, a) for a in attributes)
    )
    return _field(1, _field(1, resource) + _field(2, _field(2, span)))


@pytest.mark.parametrize(
    "body",
    [
        # values nested to the bound, and past it (refused by both, at any depth)
        _span_body(_kv(_field(2, _nested(16).SerializeToString()))),
        _span_body(_kv(_field(2, _nested(17).SerializeToString()))),
        # a value sent twice: protobuf merges the two (their arrays concatenate)
        _span_body(_kv(_field(2, _nested(1).SerializeToString()) + _field(2, _nested(1).SerializeToString()))),
        _span_body(_kv(_field(2, _nested(1).SerializeToString() + _nested(1).SerializeToString()))),
        # a kvlist repeating a key, a KeyValue without a key, one without a value
        _span_body(
            _kv(_field(2, _field(6, _field(1, _kv(b"\x12\x02\x18\x01")) + _field(1, _kv(b"\x12\x02\x18\x02")))))
        ),
        _span_body(_field(2, AnyValue(int_value=3).SerializeToString()), _kv(b"")),
        # not UTF-8 where the decoder does not look: a scope's name, an event's
        _field(1, _field(2, _field(1, _field(1, b"\xff")))),
        _span_body(name=b"\xc3"),
        # a tag past 32 bits, groups nested to the protobuf runtime's bound and past it
        b"\x80\x80\x80\x80\x10\x00",
        b"\x7b" * 100 + b"\x7c" * 100,
        b"\x7b" * 101 + b"\x7c" * 101,
    ],
)
def test_edge_cases_decode_the_same(body, monkeypatch):
    assert_same([body, _span_body()], monkeypatch)


@pytest.mark.parametrize("past", [0, 1], ids=["at-the-bounds", "past-them"])
def test_strings_at_and_past_their_bounds_decode_the_same(past, monkeypatch):
    """Both decoders keep a string at its bound and refuse its span one byte past it (in UTF-8 bytes, not
    characters): a span's name, its comm group, a resource's run id and host, the other attributes' JSON."""
    request = ExportTraceServiceRequest()
    for name, group, run, host, note in [
        ("n" * (MAX_NAME_BYTES + past), "g", "r", "h", "x"),
        ("step", "é" * (MAX_NAME_BYTES // 2) + "g" * past, "r", "h", "x"),
        ("step", "g", "ü" * (MAX_NAME_BYTES // 2) + "r" * past, "h", "x"),
        ("step", "g", "r", "h" * (MAX_NAME_BYTES + past), "x"),
        ("step", "g", "r", "h", "t" * (MAX_TEXT_BYTES - len('{"note": ""}') + past)),  # as JSON: the bound, or past it
    ]:
        rs = request.resource_spans.add()
        _attrs(rs.resource.attributes, [(sc.RUN_ID, run), (sc.RANK, 0), (sc.HOST_NAME, host)])
        span = rs.scope_spans.add().spans.add(
            name=name, trace_id=bytes(16), span_id=bytes(8), start_time_unix_nano=T0, end_time_unix_nano=T0 + 1
        )
        _attrs(span.attributes, [(sc.KIND, sc.KIND_COMM), (sc.COMM_GROUP, group), ("note", note)])
    body = request.SerializeToString()
    assert_same([body], monkeypatch)
    (part,) = decode.decode("traces", [body]).parts
    assert (part.accepted, part.rejected) == ((5, 0) if not past else (0, 5)), part
