"""OTLP ingest end to end: what the official OpenTelemetry exporters send lands in DuckDB.

Covered: step spans -> `steps` (explicit times, loss, grad norm, tokens, lr,
comm wait, unknown attributes kept in `attrs`), phase and collective child
spans -> `ops` (parent ids, algbw/busbw by the nccl-tests formulas), gauge
points -> `device_samples`, log records -> `events`, resource attributes ->
`ranks` and `runs`, a span-level rank overriding the resource's; OTLP/JSON
with hex ids, gzip-compressed protobuf, and partial_success for spans that
name no run while the valid spans of the same request are stored; spans with
no name and spans whose times sit at the edges of fixed64.
"""

import json

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span

from rankwatch.agent import semconv as sc
from rankwatch.agent.export import Exporter
from tests.support import loopback
from tests.support.collectors import Collector, free_port
from tests.support.otlp_payloads import T0, post, query
from tests.support.waits import wait_until

RUN = "run-ingest"
MS = 1_000_000  # ns
RESOURCE = {
    sc.RUN_ID: RUN,
    sc.RANK: 1,
    sc.HOST_NAME: "node-a",
    sc.LOCAL_RANK: 1,
    sc.WORLD_SIZE: 4,
    sc.DP_RANK: 1,
    sc.PP_STAGE: 0,
    sc.TP_RANK: 0,
    sc.DEVICE: "cuda:1",
    sc.PROCESS_PID: 4242,
}
PHASES = [("data", 0, 20), ("forward", 20, 100), ("backward", 100, 200), ("optimizer", 200, 250)]  # ms from T0


@pytest.fixture(scope="module")
def ingested(tmp_path_factory):
    """A store filled by the agent's Exporter (official OTLP/HTTP exporters, gzip),
    then closed by SIGTERM; returns (db path, ids of the spans sent)."""
    db = tmp_path_factory.mktemp("ingest") / "rankwatch.duckdb"
    collector = Collector(db, free_port(), "test-token-0123456").start()
    try:
        exporter = Exporter(collector.url, collector.token, RESOURCE)
        root = exporter.trace(
            [
                (
                    "step",
                    T0,
                    T0 + 250 * MS,
                    {
                        sc.KIND: sc.KIND_STEP,
                        sc.STEP: 7,
                        sc.LOSS: 2.5,
                        sc.GRAD_NORM: 0.75,
                        sc.TOKENS: 8192,
                        sc.LR: 3e-4,
                        sc.COMM_WAIT_S: 0.012,
                        "rankwatch.custom": "warmup",
                        "user.tag": 3,
                    },
                ),
                *[
                    (name, T0 + start * MS, T0 + end * MS, {sc.KIND: sc.KIND_PHASE, sc.STEP: 7})
                    for name, start, end in PHASES
                ],
                (
                    "nccl:all_reduce",
                    T0 + 150 * MS,
                    T0 + 154 * MS,
                    {
                        sc.KIND: sc.KIND_COMM,
                        sc.STEP: 7,
                        sc.COMM_GROUP: "dp",
                        sc.COMM_GROUP_SIZE: 4,
                        sc.COMM_SEQ: 42,
                        sc.COMM_BYTES: 100_000_000,
                        "nccl.algo": "ring",
                    },
                ),
                (
                    "all_gather",
                    T0 + 160 * MS,
                    T0 + 168 * MS,
                    {
                        sc.KIND: sc.KIND_COMM,
                        sc.STEP: 7,
                        sc.COMM_GROUP: "tp",
                        sc.COMM_GROUP_SIZE: 4,
                        sc.COMM_SEQ: 43,
                        sc.COMM_BYTES: 64_000_000,
                    },
                ),
            ]
        )
        # This process also speaks for rank 3: the span's own rank wins over the resource's.
        exporter.trace(
            [("step", T0 + 1000 * MS, T0 + 1300 * MS, {sc.KIND: sc.KIND_STEP, sc.STEP: 8, sc.RANK: 3, sc.LOSS: 2.25})]
        )
        exporter.event("checkpoint_saved", T0 + 2000 * MS, {sc.STEP: 7, "path": "/ckpt/step-7"})
        assert exporter.samples(
            [
                (sc.POWER_W, T0, 312.5, {sc.GPU: 1, sc.SOURCE: sc.SOURCE_NVML, "pci.bus_id": "0000:3b:00.0"}),
                (sc.POWER_W, T0 + 1000 * MS, 298.0, {sc.GPU: 1, sc.SOURCE: sc.SOURCE_NVML}),
                (sc.ENERGY_J, T0, 1.5e6, {sc.GPU: 1, sc.SOURCE: sc.SOURCE_SIMULATED}),
            ]
        )
        wait_until(exporter.flush, "spans not delivered", 120)
        exporter.shutdown()
        ids = {"trace_id": root.trace_id.to_bytes(16, "big"), "step_span_id": root.span_id.to_bytes(8, "big")}
    finally:
        collector.stop()
    return db, ids


def test_step_row(ingested):
    db, ids = ingested
    rows = query(
        db,
        """SELECT step, epoch_ns(start_ts), epoch_ns(end_ts), duration_s, loss, grad_norm, tokens, lr,
                               comm_wait_s, data_s, trace_id, span_id, attrs
                        FROM steps WHERE run_id = ? AND rank = 1""",
        [RUN],
    )
    assert len(rows) == 1
    step, start, end, duration, loss, grad_norm, tokens, lr, comm_wait, data_s, trace_id, span_id, attrs = rows[0]
    assert (step, start, end) == (7, T0, T0 + 250 * MS)
    assert duration == pytest.approx(0.25, rel=1e-12)
    assert (loss, grad_norm, tokens, lr, comm_wait, data_s) == (2.5, 0.75, 8192, 3e-4, 0.012, None)
    assert (bytes(trace_id), bytes(span_id)) == (ids["trace_id"], ids["step_span_id"])
    assert json.loads(attrs) == {"rankwatch.custom": "warmup", "user.tag": 3}


def test_span_rank_overrides_resource_rank(ingested):
    db, _ = ingested
    assert query(db, "SELECT rank, step, duration_s, loss FROM steps WHERE run_id = ? ORDER BY step", [RUN]) == [
        (1, 7, pytest.approx(0.25), 2.5),
        (3, 8, pytest.approx(0.3), 2.25),
    ]
    assert query(db, "SELECT rank, host FROM ranks WHERE run_id = ? ORDER BY rank", [RUN]) == [
        (1, "node-a"),
        (3, "node-a"),
    ]


def test_phase_ops(ingested):
    db, ids = ingested
    rows = query(
        db,
        """SELECT name, step, epoch_ns(start_ts), epoch_ns(end_ts), duration_s, trace_id,
                               parent_span_id, attrs
                        FROM ops WHERE run_id = ? AND kind = 'phase' ORDER BY start_ts""",
        [RUN],
    )
    assert [(r[0], r[1], r[2], r[3]) for r in rows] == [
        (name, 7, T0 + start * MS, T0 + end * MS) for name, start, end in PHASES
    ]
    assert [r[4] for r in rows] == pytest.approx([0.02, 0.08, 0.1, 0.05], rel=1e-12)
    assert {(bytes(r[5]), bytes(r[6])) for r in rows} == {(ids["trace_id"], ids["step_span_id"])}
    assert [r[7] for r in rows] == [None] * 4


def test_comm_ops_bandwidth(ingested):
    db, ids = ingested
    rows = query(
        db,
        """SELECT name, rank, step, comm_group, group_size, seq, bytes, duration_s, algbw_gbps,
                               busbw_gbps, parent_span_id, attrs
                        FROM ops WHERE run_id = ? AND kind = 'comm' ORDER BY seq""",
        [RUN],
    )
    assert len(rows) == 2
    ar, ag = rows
    assert ar[:7] == ("nccl:all_reduce", 1, 7, "dp", 4, 42, 100_000_000)
    assert ar[7] == pytest.approx(0.004, rel=1e-12)
    algbw = 100_000_000 / 0.004 / 1e9  # 25 GB/s
    assert ar[8] == pytest.approx(algbw, rel=1e-9)
    assert ar[9] == pytest.approx(algbw * 2 * (4 - 1) / 4, rel=1e-9)  # all_reduce: 2(n-1)/n -> 37.5
    assert ar[9] == pytest.approx(37.5, rel=1e-9)
    assert bytes(ar[10]) == ids["step_span_id"]
    assert json.loads(ar[11]) == {"nccl.algo": "ring"}
    assert ag[:7] == ("all_gather", 1, 7, "tp", 4, 43, 64_000_000)
    assert ag[8] == pytest.approx(8.0, rel=1e-9)  # 64 MB / 8 ms
    assert ag[9] == pytest.approx(6.0, rel=1e-9)  # all_gather: (n-1)/n
    assert ag[11] is None


def test_device_samples(ingested):
    db, _ = ingested
    rows = query(
        db,
        """SELECT rank, metric, epoch_ns(ts), value, gpu, source, attrs FROM device_samples
                        WHERE run_id = ? ORDER BY metric, ts""",
        [RUN],
    )
    assert [r[:6] for r in rows] == [
        (1, sc.POWER_W, T0, 312.5, 1, "nvml"),
        (1, sc.POWER_W, T0 + 1000 * MS, 298.0, 1, "nvml"),
        (1, sc.ENERGY_J, T0, 1.5e6, 1, "simulated"),
    ]
    assert json.loads(rows[0][6]) == {"pci.bus_id": "0000:3b:00.0"}
    assert rows[1][6] is None and rows[2][6] is None


def test_events(ingested):
    db, _ = ingested
    rows = query(
        db, "SELECT rank, epoch_ns(ts), event, step, severity, body, attrs FROM events WHERE run_id = ?", [RUN]
    )
    assert len(rows) == 1
    assert rows[0][:6] == (1, T0 + 2000 * MS, "checkpoint_saved", 7, "INFO", "checkpoint_saved")
    assert json.loads(rows[0][6]) == {"path": "/ckpt/step-7"}


def test_ranks_and_runs(ingested):
    db, _ = ingested
    assert query(
        db,
        """SELECT host, local_rank, dp_rank, pp_stage, tp_rank, device, pid FROM ranks
                        WHERE run_id = ? AND rank = 1""",
        [RUN],
    ) == [("node-a", 1, 1, 0, 0, "cuda:1", 4242)]
    assert query(db, "SELECT run_id, world_size, first_seen IS NOT NULL FROM runs") == [(RUN, 4, True)]


# --- encodings and partial success, through raw POSTs -------------------------------------------------------

TRACE_HEX = "5b8efff798038103d269b633813fc60c"
STEP_HEX, COMM_HEX = "eee19b7ec3c1b174", "0102030405060708"


def _json_request(run_id: str) -> dict:
    """An OTLP/JSON trace request as the spec writes it: lowerCamelCase, hex ids, int64 as strings."""

    def attr(key, value):
        kind = {str: "stringValue", int: "intValue", float: "doubleValue"}[type(value)]
        return {"key": key, "value": {kind: str(value) if kind == "intValue" else value}}

    return {
        "resourceSpans": [
            {
                "resource": {"attributes": [attr(sc.RUN_ID, run_id), attr(sc.RANK, 2), attr(sc.HOST_NAME, "node-j")]},
                "scopeSpans": [
                    {
                        "scope": {"name": "rankwatch.tests"},
                        "spans": [
                            {
                                "traceId": TRACE_HEX,
                                "spanId": STEP_HEX,
                                "name": "step",
                                "kind": 1,
                                "startTimeUnixNano": str(T0),
                                "endTimeUnixNano": str(T0 + 500 * MS),
                                "attributes": [
                                    attr(sc.KIND, "step"),
                                    attr(sc.STEP, 11),
                                    attr(sc.LOSS, 1.75),
                                    attr(sc.TOKENS, 4096),
                                    attr("extra.note", "json"),
                                ],
                            },
                            {
                                "traceId": TRACE_HEX,
                                "spanId": COMM_HEX,
                                "parentSpanId": STEP_HEX,
                                "name": "all_reduce",
                                "kind": 1,
                                "startTimeUnixNano": str(T0 + 100 * MS),
                                "endTimeUnixNano": str(T0 + 110 * MS),
                                "attributes": [
                                    attr(sc.KIND, "comm"),
                                    attr(sc.STEP, 11),
                                    attr(sc.COMM_BYTES, 50_000_000),
                                    attr(sc.COMM_GROUP_SIZE, 8),
                                ],
                            },
                        ],
                    }
                ],
            }
        ]
    }


def _kv(key, **value) -> KeyValue:
    return KeyValue(key=key, value=AnyValue(**value))


def _protobuf_request(run_id: str) -> ExportTraceServiceRequest:
    """The same request as _json_request, built with the protobuf classes."""
    step = Span(
        trace_id=bytes.fromhex(TRACE_HEX),
        span_id=bytes.fromhex(STEP_HEX),
        name="step",
        kind=1,
        start_time_unix_nano=T0,
        end_time_unix_nano=T0 + 500 * MS,
        attributes=[
            _kv(sc.KIND, string_value="step"),
            _kv(sc.STEP, int_value=11),
            _kv(sc.LOSS, double_value=1.75),
            _kv(sc.TOKENS, int_value=4096),
            _kv("extra.note", string_value="json"),
        ],
    )
    comm = Span(
        trace_id=bytes.fromhex(TRACE_HEX),
        span_id=bytes.fromhex(COMM_HEX),
        parent_span_id=bytes.fromhex(STEP_HEX),
        name="all_reduce",
        kind=1,
        start_time_unix_nano=T0 + 100 * MS,
        end_time_unix_nano=T0 + 110 * MS,
        attributes=[
            _kv(sc.KIND, string_value="comm"),
            _kv(sc.STEP, int_value=11),
            _kv(sc.COMM_BYTES, int_value=50_000_000),
            _kv(sc.COMM_GROUP_SIZE, int_value=8),
        ],
    )
    resource = [
        _kv(sc.RUN_ID, string_value=run_id),
        _kv(sc.RANK, int_value=2),
        _kv(sc.HOST_NAME, string_value="node-j"),
    ]
    return ExportTraceServiceRequest(
        resource_spans=[ResourceSpans(resource={"attributes": resource}, scope_spans=[ScopeSpans(spans=[step, comm])])]
    )


_STEP_SQL = """SELECT rank, step, epoch_ns(start_ts), duration_s, loss, tokens, trace_id, span_id, attrs
               FROM steps WHERE run_id = ?"""
_OP_SQL = """SELECT rank, step, name, duration_s, bytes, algbw_gbps, busbw_gbps, trace_id, span_id, parent_span_id
             FROM ops WHERE run_id = ?"""


def _partial_request() -> ExportTraceServiceRequest:
    """Two valid spans, plus two under a resource that names no run (the second is also a step span
    without a step that ends before it starts: still one rejected span)."""
    request = _protobuf_request("run-partial")
    orphan = request.resource_spans.add()
    orphan.resource.attributes.append(_kv(sc.RANK, int_value=0))
    orphan.scope_spans.add().spans.extend(
        [
            Span(
                trace_id=bytes(16),
                span_id=bytes(range(1, 9)),
                name="step",
                start_time_unix_nano=T0,
                end_time_unix_nano=T0 + MS,
                attributes=[_kv(sc.STEP, int_value=1)],
            ),
            Span(
                trace_id=bytes(16),
                span_id=bytes(range(2, 10)),
                name="step",
                start_time_unix_nano=T0 + MS,
                end_time_unix_nano=T0,
            ),
        ]
    )
    return request


def _unnamed_request() -> ExportTraceServiceRequest:
    """Two valid spans, plus two without a name: OTLP says an empty name "is equivalent to an unknown
    span name", so they are valid spans too."""
    request = _protobuf_request("run-unnamed")
    spans = request.resource_spans[0].scope_spans[0].spans
    spans.append(
        Span(
            trace_id=bytes.fromhex(TRACE_HEX),
            span_id=bytes(range(1, 9)),
            name="",
            start_time_unix_nano=T0,
            end_time_unix_nano=T0 + 2 * MS,
        )
    )
    spans.append(
        Span(
            trace_id=bytes.fromhex(TRACE_HEX),
            span_id=bytes(range(2, 10)),
            name="",
            start_time_unix_nano=T0,
            end_time_unix_nano=T0 + 4 * MS,
            attributes=[
                _kv(sc.KIND, string_value="comm"),
                _kv(sc.COMM_BYTES, int_value=4_000_000),
                _kv(sc.COMM_GROUP_SIZE, int_value=2),
            ],
        )
    )
    return request


TIMES = {
    "ok": (T0, T0 + MS),
    "from-1970": (1, T0),
    "long-104-days": (T0, T0 + 2**53 + 1),
    "end-past-int64": (T0, 2**64 - 1),
}  # fixed64 start/end: every value here is a valid OTLP span


def _times_request() -> ExportTraceServiceRequest:
    request = _protobuf_request("run-times")
    spans = request.resource_spans[0].scope_spans[0].spans
    del spans[:]
    for i, (name, (start, end)) in enumerate(TIMES.items()):
        spans.append(
            Span(
                trace_id=bytes.fromhex(TRACE_HEX),
                span_id=bytes([i + 1] * 8),
                name=name,
                start_time_unix_nano=start,
                end_time_unix_nano=end,
            )
        )
    return request


@pytest.fixture(scope="module")
def posted(tmp_path_factory):
    """Raw POSTs of hand-built requests to one collector, then SIGTERM; returns (responses, db)."""
    db = tmp_path_factory.mktemp("raw") / "rankwatch.duckdb"
    collector = Collector(db, free_port(), "test-token-0123456").start()
    try:
        responses = {
            "json": loopback.post(
                f"{collector.url}/v1/traces",
                content=json.dumps(_json_request("run-json")),
                headers={**collector.headers, "Content-Type": "application/json"},
            ),
            "protobuf": post(collector, "traces", _protobuf_request("run-pb").SerializeToString()),
            "gzip": post(collector, "traces", _protobuf_request("run-gzip").SerializeToString(), gzip_body=True),
            "partial": post(collector, "traces", _partial_request().SerializeToString()),
            "unnamed": post(collector, "traces", _unnamed_request().SerializeToString()),
            "times": post(collector, "traces", _times_request().SerializeToString()),
        }
    finally:
        collector.stop()
    return responses, db


def test_json_encoding_with_hex_ids(posted):
    responses, db = posted
    r = responses["json"]
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("application/json")
    assert "partialSuccess" not in r.json()
    assert responses["protobuf"].status_code == 200
    steps = query(db, _STEP_SQL, ["run-json"])
    assert [s[:6] for s in steps] == [(2, 11, T0, pytest.approx(0.5), 1.75, 4096)]
    assert (bytes(steps[0][6]), bytes(steps[0][7])) == (bytes.fromhex(TRACE_HEX), bytes.fromhex(STEP_HEX))
    assert json.loads(steps[0][8]) == {"extra.note": "json"}
    ops = query(db, _OP_SQL, ["run-json"])
    assert [o[:5] for o in ops] == [(2, 11, "all_reduce", pytest.approx(0.01), 50_000_000)]
    assert ops[0][5] == pytest.approx(5.0) and ops[0][6] == pytest.approx(5.0 * 2 * 7 / 8)
    assert [bytes(x) for x in ops[0][7:]] == [bytes.fromhex(h) for h in (TRACE_HEX, COMM_HEX, STEP_HEX)]
    # the same request in protobuf lands the very same rows
    assert query(db, _STEP_SQL, ["run-pb"]) == steps
    assert query(db, _OP_SQL, ["run-pb"]) == ops
    assert query(db, "SELECT host FROM ranks WHERE run_id IN ('run-json', 'run-pb') AND rank = 2") == [("node-j",)] * 2


def test_gzip_protobuf(posted):
    responses, db = posted
    r = responses["gzip"]
    assert r.status_code == 200, r.content
    assert not ExportTraceServiceResponse.FromString(r.content).HasField("partial_success")
    assert query(db, "SELECT rank, step, loss FROM steps WHERE run_id = 'run-gzip'") == [(2, 11, 1.75)]
    assert query(db, "SELECT name, bytes FROM ops WHERE run_id = 'run-gzip'") == [("all_reduce", 50_000_000)]


def test_partial_success_keeps_valid_spans(posted):
    responses, db = posted
    r = responses["partial"]
    assert r.status_code == 200
    assert r.headers["content-type"] == "application/x-protobuf"
    partial = ExportTraceServiceResponse.FromString(r.content).partial_success
    assert partial.rejected_spans == 2  # spans, each counted once however many faults it has
    assert sc.RUN_ID in partial.error_message
    assert query(db, "SELECT rank, step FROM steps WHERE run_id = 'run-partial'") == [(2, 11)]
    assert query(db, "SELECT name FROM ops WHERE run_id = 'run-partial'") == [("all_reduce",)]
    assert query(db, "SELECT count(*) FROM steps WHERE rank = 0 OR step = 1") == [(0,)]  # the orphan is nowhere
    assert query(db, "SELECT rank FROM ranks WHERE run_id = 'run-partial'") == [(2,)]


def test_unnamed_span_is_stored(posted):
    responses, db = posted
    r = responses["unnamed"]
    assert r.status_code == 200, r.content
    assert not ExportTraceServiceResponse.FromString(r.content).HasField("partial_success")
    assert query(db, "SELECT step FROM steps WHERE run_id = 'run-unnamed'") == [(11,)]
    assert query(
        db,
        """SELECT name, kind, duration_s, algbw_gbps FROM ops WHERE run_id = 'run-unnamed'
                        ORDER BY duration_s""",
    ) == [
        ("", "other", pytest.approx(0.002), None),
        ("", "comm", pytest.approx(0.004), pytest.approx(1.0)),
        ("all_reduce", "comm", pytest.approx(0.01), pytest.approx(5.0)),
    ]


def test_extreme_span_times_stored_or_rejected(posted):
    """Span times at the edges of fixed64 are stored exactly or reported in partial_success;
    never a 503 (which exporters retry forever) that also loses the valid span beside them."""
    responses, db = posted
    r = responses["times"]
    assert r.status_code == 200, r.content
    rejected = ExportTraceServiceResponse.FromString(r.content).partial_success.rejected_spans
    stored = dict(query(db, "SELECT name, duration_s FROM ops WHERE run_id = 'run-times'"))
    assert stored["ok"] == pytest.approx(0.001)
    assert "end-past-int64" not in stored  # TIMESTAMP_NS cannot hold it: it must be rejected
    assert len(stored) + rejected == len(TIMES)
    for name in ("from-1970", "long-104-days"):
        if name in stored:
            start, end = TIMES[name]
            assert stored[name] == pytest.approx((end - start) / 1e9, rel=1e-12)
