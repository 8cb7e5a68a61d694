"""OTLP export requests (protobuf bytes) -> Arrow batches, one per telemetry table.

This is the hot path of ingest (it runs in worker processes, see
collector/ingest.py). Spans, by far the most numerous items, are read by the
C wire decoder collector/_otlpwire.c; metrics and logs by the protobuf
runtime. Each item becomes a row tuple of the values as sent; known
attributes fill typed columns and any others are kept as JSON in `attrs`,
so nothing valid is lost.

Rows are typed column by column by pyarrow against the store's schema. Only
when that fails (an attribute of the wrong type) is each row coerced on its
own ("5" -> 5) or rejected; rejected items are reported back through OTLP
partial_success with the first reason.
"""

import json
from dataclasses import dataclass, field
from functools import cache

import duckdb
import pyarrow as pa
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from agent import semconv as sc
from collector import _otlpwire
from collector.nccl import add_bandwidths
from collector.otlp import PROTOBUF, OtlpError, parse
from collector.schema import DDL


class Rejected(ValueError):
    """One telemetry item that cannot be stored; the message says why."""


@dataclass
class Decoded:
    """What one export request contributes to the store."""

    signal: str
    tables: dict[str, pa.Table] = field(default_factory=dict)
    ranks: list[dict] = field(default_factory=list)
    rejected: int = 0
    error: str = ""

    @property
    def accepted(self) -> int:
        return sum(t.num_rows for t in self.tables.values())

    def reject(self, why: str) -> None:
        self.rejected += 1
        self.error = self.error or why


@cache
def arrow_schema(table: str) -> pa.Schema:
    """The Arrow schema of a store table, read from the DDL itself."""
    con = duckdb.connect()
    con.execute(DDL)
    return con.sql(f"SELECT * FROM {table} LIMIT 0").arrow().schema


def value(v: AnyValue):
    """An OTLP AnyValue as a plain Python value (as the C decoder returns them)."""
    which = v.WhichOneof("value")
    if which == "array_value":
        return [value(x) for x in v.array_value.values]
    if which == "kvlist_value":
        return {kv.key: value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, which) if which else None


def _attributes(key_values) -> dict:
    return {kv.key: value(kv.value) for kv in key_values}


def _leftover(attrs: dict) -> str | None:
    return json.dumps(attrs, default=bytes.hex) if attrs else None


def _coerce(v, column: pa.Field):
    """One cell converted to its column's type, or Rejected."""
    if v is None:
        return None
    t = column.type
    if pa.types.is_integer(t) or pa.types.is_timestamp(t):
        if type(v) is float and v.is_integer():
            v = int(v)
        elif type(v) is str and v.lstrip("-").isdigit():
            v = int(v)
        if type(v) is not int:
            raise Rejected(f"{column.name} must be an integer, not {v!r}")
    elif pa.types.is_floating(t):
        try:
            v = float(v) if type(v) in (int, float, str) else None
        except ValueError:
            v = None
        if v is None:
            raise Rejected(f"{column.name} must be a number")
    elif pa.types.is_string(t):
        if type(v) is int:
            v = str(v)
        if type(v) is not str:
            raise Rejected(f"{column.name} must be a string, not {v!r}")
    try:
        pa.array([v], t)
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):
        raise Rejected(f"{column.name} out of range: {v!r}") from None
    return v


def _table(name: str, columns: tuple[str, ...], rows: list[tuple], out: Decoded, what: str) -> None:
    """Add rows to `out` as an Arrow table with every column of the store table, in order
    (columns the rows lack are null), so the store appends it by position."""
    if not rows:
        return
    full = arrow_schema(name)
    fields = [full.field(c) for c in columns]
    try:
        arrays = [pa.array(col, f.type) for col, f in zip(zip(*rows), fields)]
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError, TypeError):
        good = []
        for row in rows:
            try:
                good.append(tuple(_coerce(v, f) for v, f in zip(row, fields)))
            except Rejected as e:
                out.reject(f"{what}: {e}")
        if not good:
            return
        arrays = [pa.array(col, f.type) for col, f in zip(zip(*good), fields)]
    given = dict(zip(columns, arrays))
    n = len(arrays[0])
    out.tables[name] = pa.Table.from_arrays([given.get(f.name, pa.nulls(n, f.type)) for f in full], schema=full)


class _Identity:
    """Run, rank and placement of one resource; items may override run and rank."""

    def __init__(self, attrs: dict, decoded: Decoded):
        self.run_id = attrs.get(sc.RUN_ID)
        self.rank = attrs.get(sc.RANK)
        self.source = attrs.get(sc.SOURCE)
        self._row = {}
        columns = {**_RANK_ATTRIBUTES, "world_size": (sc.WORLD_SIZE, arrow_schema("runs").field("world_size"))}
        for column, (key, typed) in columns.items():
            try:  # a malformed placement attribute is dropped, the item itself is still good
                self._row[column] = _coerce(attrs.get(key), typed)
            except Rejected:
                self._row[column] = None
        self._decoded = decoded
        self._seen: set = set()

    def resolve(self, attrs: dict) -> tuple:
        """(run_id, rank) of an item: its own attributes win over the resource's."""
        run_id = attrs.pop(sc.RUN_ID, self.run_id)
        rank = attrs.pop(sc.RANK, self.rank)
        if run_id is None or rank is None or type(rank) is not int or type(run_id) is not str:
            raise Rejected(f"no valid {sc.RUN_ID} (string) and {sc.RANK} (integer) on the resource or the item")
        if (run_id, rank) not in self._seen:
            self._seen.add((run_id, rank))
            self._decoded.ranks.append({"run_id": run_id, "rank": rank, **self._row})
        return run_id, rank


_RANK_ATTRIBUTES = {column: (key, arrow_schema("ranks").field(column)) for column, key in (
    ("host", sc.HOST_NAME), ("local_rank", sc.LOCAL_RANK), ("dp_rank", sc.DP_RANK), ("pp_stage", sc.PP_STAGE),
    ("tp_rank", sc.TP_RANK), ("device", sc.DEVICE), ("pid", sc.PROCESS_PID))}
_STEP_COLUMNS = ("run_id", "rank", "step", "start_ts", "end_ts", "duration_s", "data_s", "compute_s",
                 "comm_wait_s", "loss", "grad_norm", "tokens", "lr", "mfu", "trace_id", "span_id", "attrs")
_OP_COLUMNS = ("run_id", "rank", "step", "kind", "name", "start_ts", "end_ts", "duration_s", "microbatch",
               "comm_group", "group_size", "seq", "bytes", "trace_id", "span_id", "parent_span_id", "attrs")
_OP_KINDS = frozenset(sc.OP_KINDS)


def decode_traces(body: bytes) -> Decoded:
    """Spans -> `steps` (spans of kind step) and `ops` (every other span)."""
    try:
        resources = _otlpwire.traces(body)
    except ValueError as e:
        raise OtlpError(400, str(e)) from None
    out = Decoded("traces")
    steps, ops = [], []
    for resource_attrs, spans in resources:
        who = _Identity(resource_attrs, out)
        for trace_id, span_id, parent_span_id, name, start, end, attrs in spans:
            try:
                run_id, rank = who.resolve(attrs)
            except Rejected as e:
                out.reject(f"span {name!r}: {e}")
                continue
            if not start or end < start:
                out.reject(f"span {name!r}: start time missing or after end time")
                continue
            pop = attrs.pop
            kind = pop(sc.KIND, None) or (sc.KIND_STEP if name == "step" else sc.KIND_OTHER)
            step = pop(sc.STEP, None)
            if kind == sc.KIND_STEP:
                if step is None:
                    out.reject(f"span {name!r}: a step span needs {sc.STEP}")
                    continue
                steps.append((run_id, rank, step, start, end, (end - start) / 1e9, pop(sc.DATA_S, None),
                              pop(sc.COMPUTE_S, None), pop(sc.COMM_WAIT_S, None), pop(sc.LOSS, None),
                              pop(sc.GRAD_NORM, None), pop(sc.TOKENS, None), pop(sc.LR, None), pop(sc.MFU, None),
                              trace_id, span_id, _leftover(attrs)))
            elif kind in _OP_KINDS:
                ops.append((run_id, rank, step, kind, name, start, end, (end - start) / 1e9,
                            pop(sc.MICROBATCH, None), pop(sc.COMM_GROUP, None), pop(sc.COMM_GROUP_SIZE, None),
                            pop(sc.COMM_SEQ, None), pop(sc.COMM_BYTES, None), trace_id, span_id, parent_span_id,
                            _leftover(attrs)))
            else:
                out.reject(f"span {name!r}: {sc.KIND} must be one of step, {', '.join(sc.OP_KINDS)}")
    _table("steps", _STEP_COLUMNS, steps, out, "step span")
    _table("ops", _OP_COLUMNS, ops, out, "span")
    if "ops" in out.tables:
        out.tables["ops"] = add_bandwidths(out.tables["ops"])
    return out


def decode_metrics(body: bytes) -> Decoded:
    """Gauge and sum data points -> `device_samples`, one row per point."""
    request = parse(body, PROTOBUF, ExportMetricsServiceRequest)
    out = Decoded("metrics")
    rows = []
    for rm in request.resource_metrics:
        who = _Identity(_attributes(rm.resource.attributes), out)
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                kind = metric.WhichOneof("data")
                points = getattr(metric, kind).data_points if kind else ()
                for point in points:
                    try:
                        if kind not in ("gauge", "sum"):
                            raise Rejected("only gauge and sum metrics are stored")
                        attrs = _attributes(point.attributes)
                        run_id, rank = who.resolve(attrs)
                        number = point.WhichOneof("value")
                        if number is None or not point.time_unix_nano:
                            raise Rejected("data point without a value or a time")
                    except Rejected as e:
                        out.reject(f"metric {metric.name!r}: {e}")
                        continue
                    rows.append((run_id, rank, point.time_unix_nano, metric.name, float(getattr(point, number)),
                                 attrs.pop(sc.GPU, None), attrs.pop(sc.SOURCE, who.source), _leftover(attrs)))
    _table("device_samples", ("run_id", "rank", "ts", "metric", "value", "gpu", "source", "attrs"), rows, out,
           "data point")
    return out


def decode_logs(body: bytes) -> Decoded:
    """Log records -> `events`; the event name is rankwatch.event, else the body."""
    request = parse(body, PROTOBUF, ExportLogsServiceRequest)
    out = Decoded("logs")
    rows = []
    for rl in request.resource_logs:
        who = _Identity(_attributes(rl.resource.attributes), out)
        for sl in rl.scope_logs:
            for record in sl.log_records:
                try:
                    attrs = _attributes(record.attributes)
                    run_id, rank = who.resolve(attrs)
                    ts = record.time_unix_nano or record.observed_time_unix_nano
                    if not ts:
                        raise Rejected("no time")
                except Rejected as e:
                    out.reject(f"log record: {e}")
                    continue
                body_value = value(record.body) if record.HasField("body") else None
                if body_value is not None and not isinstance(body_value, str):
                    body_value = json.dumps(body_value, default=bytes.hex)
                event = attrs.pop(sc.EVENT, None) or body_value or "log"
                rows.append((run_id, rank, ts, event, attrs.pop(sc.STEP, None), record.severity_text or None,
                             body_value, _leftover(attrs)))
    _table("events", ("run_id", "rank", "ts", "event", "step", "severity", "body", "attrs"), rows, out,
           "log record")
    return out


DECODERS = {
    "traces": (ExportTraceServiceRequest, decode_traces),
    "metrics": (ExportMetricsServiceRequest, decode_metrics),
    "logs": (ExportLogsServiceRequest, decode_logs),
}
