"""The agent's own OTLP span encoding (rankwatch/agent/spanwire.py: encode_spans) against the official protobuf classes.

Covered: any trace of spans with str, bool, int64 and float attributes, from
one or several resources, encodes to the ExportTraceServiceRequest the
OpenTelemetry SDK's encoder makes of the same spans (ids, parent, name, kind,
times, attributes, resource, scope), read back with the official protobuf
classes (hypothesis); values of other types go as their str().
"""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans as sdk_encode
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, TraceFlags

from rankwatch.agent.spanwire import SCOPE, Span, encode_spans

pytestmark = pytest.mark.unit  # pure code on small inputs: `make check` runs these

value = st.one_of(
    st.text(max_size=20), st.booleans(), st.integers(-(2**63), 2**63 - 1), st.floats(allow_nan=False), st.just(math.nan)
)
attributes = st.dictionaries(st.text(min_size=1, max_size=12), value, max_size=6)
u64 = st.integers(1, 2**64 - 1)
span = st.builds(
    lambda tid, sid, parent, name, start, dur, attrs, res: Span(tid, sid, parent, name, start, start + dur, attrs, res),
    st.integers(1, 2**128 - 1),
    u64,
    st.one_of(st.just(0), u64),
    st.text(max_size=16),
    st.integers(0, 2**63),
    st.integers(0, 2**40),
    attributes,
    st.sampled_from(
        [
            Resource.create({"rankwatch.rank": 0, "rankwatch.run_id": "r"}),
            Resource.create({"rankwatch.rank": 1, "rankwatch.run_id": "r", "host.name": "h"}),
        ]
    ),
)


def sdk_span(s: Span) -> ReadableSpan:
    flags = TraceFlags(TraceFlags.SAMPLED)
    context = SpanContext(s.trace_id, s.span_id, is_remote=False, trace_flags=flags)
    parent = SpanContext(s.trace_id, s.parent_id, is_remote=False, trace_flags=flags) if s.parent_id else None
    return ReadableSpan(
        s.name,
        context,
        parent=parent,
        resource=s.resource,
        attributes=s.attributes,
        start_time=s.start_ns,
        end_time=s.end_ns,
        instrumentation_scope=InstrumentationScope(SCOPE),
    )


def normalized(request: ExportTraceServiceRequest) -> list:
    """What the collector reads of a request, in a comparable form (NaN as a string)."""

    def kv(pairs):
        return sorted(
            (p.key, p.value.WhichOneof("value"), repr(getattr(p.value, p.value.WhichOneof("value")))) for p in pairs
        )

    return sorted(
        (
            kv(rs.resource.attributes),
            ss.scope.name,
            sp.trace_id,
            sp.span_id,
            sp.parent_span_id,
            sp.name,
            sp.kind,
            sp.start_time_unix_nano,
            sp.end_time_unix_nano,
            kv(sp.attributes),
        )
        for rs in request.resource_spans
        for ss in rs.scope_spans
        for sp in ss.spans
    )


@settings(max_examples=150, deadline=None)
@given(st.lists(span, min_size=1, max_size=8))
def test_encoding_matches_the_sdk(spans):
    ours = ExportTraceServiceRequest.FromString(encode_spans(spans))
    assert normalized(ours) == normalized(sdk_encode([sdk_span(s) for s in spans]))
    assert len(ours.resource_spans) == len({id(s.resource) for s in spans})


def test_values_of_other_types_go_as_text():
    resource = Resource.create({"rankwatch.rank": 0})
    request = ExportTraceServiceRequest.FromString(
        encode_spans([Span(1, 2, 0, "step", 10, 20, {"big": 2**70, "list": [1, 2], "none": None}, resource)])
    )
    (sp,) = request.resource_spans[0].scope_spans[0].spans
    assert {p.key: p.value.string_value for p in sp.attributes} == {"big": str(2**70), "list": "[1, 2]", "none": "None"}


def test_encoding_gives_up_the_gil_every_slice_and_encodes_the_same(monkeypatch):
    """The export thread's encoding releases the GIL every GIL_SLICE spans (so a training thread waiting
    for it is not held for the 5 ms switch interval), and the bytes are those of an encoding in one go."""
    import rankwatch.agent.spanwire as spanwire

    resource = Resource.create({"rankwatch.rank": 0})
    spans = [Span(1, i + 1, 0, "step", i, i + 1, {"rankwatch.step": i}, resource) for i in range(100)]
    whole = encode_spans(spans, gil_slice=0)
    releases: list[float] = []
    monkeypatch.setattr(spanwire.time, "sleep", releases.append)
    assert encode_spans(spans) == whole
    assert releases == [0] * (100 // spanwire.GIL_SLICE)
