"""OTLP export requests -> Arrow batches, one per telemetry table.

This is the hot path of ingest (it runs in worker processes, see
collector/ingest.py): one pass over the request, known attributes into typed
columns, anything else kept as JSON in `attrs` so nothing valid is lost.
Items that cannot be placed (no run or rank, bad attribute types) are counted
as rejected and reported back through OTLP partial_success.
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
from collector.nccl import bandwidths, canonical_op
from collector.schema import DDL


class Rejected(ValueError):
    """One telemetry item that cannot be stored; the message says why."""


@dataclass
class Decoded:
    """What one export request contributes to the store."""

    signal: str
    tables: dict[str, pa.Table] = field(default_factory=dict)
    ranks: list[dict] = field(default_factory=list)
    accepted: int = 0
    rejected: int = 0
    error: str = ""

    def reject(self, why: str) -> None:
        self.rejected += 1
        self.error = self.error or why


@cache
def arrow_schema(table: str) -> pa.Schema:
    """The Arrow schema of a store table, read from the DDL itself."""
    con = duckdb.connect()
    con.execute(DDL)
    return con.sql(f"SELECT * FROM {table} LIMIT 0").arrow().schema


def _batch(table: str, columns: dict[str, list]) -> pa.Table:
    full = arrow_schema(table)
    schema = pa.schema([full.field(name) for name in columns])
    return pa.Table.from_pydict(columns, schema=schema)


def value(v: AnyValue):
    """An OTLP AnyValue as a plain Python value."""
    which = v.WhichOneof("value")
    if which == "array_value":
        return [value(x) for x in v.array_value.values]
    if which == "kvlist_value":
        return {kv.key: value(kv.value) for kv in v.kvlist_value.values}
    if which == "bytes_value":
        return v.bytes_value.hex()
    return getattr(v, which) if which else None


def _int(v: AnyValue | None, key: str) -> int | None:
    if v is None:
        return None
    which = v.WhichOneof("value")
    if which == "int_value":
        return v.int_value
    if which == "double_value" and v.double_value.is_integer():
        return int(v.double_value)
    if which == "string_value" and v.string_value.lstrip("-").isdigit():
        return int(v.string_value)
    raise Rejected(f"{key} must be an integer")


def _float(v: AnyValue | None, key: str) -> float | None:
    if v is None:
        return None
    which = v.WhichOneof("value")
    if which == "double_value":
        return v.double_value
    if which == "int_value":
        return float(v.int_value)
    if which == "string_value":
        try:
            return float(v.string_value)
        except ValueError:
            pass
    raise Rejected(f"{key} must be a number")


def _str(v: AnyValue | None, key: str) -> str | None:
    if v is None:
        return None
    which = v.WhichOneof("value")
    if which == "string_value":
        return v.string_value
    if which == "int_value":
        return str(v.int_value)
    raise Rejected(f"{key} must be a string")


def _leftover(attrs: dict[str, AnyValue]) -> str | None:
    return json.dumps({k: value(v) for k, v in attrs.items()}) if attrs else None


class _Identity:
    """Run, rank and placement of one resource, with per-item overrides."""

    def __init__(self, resource_attrs, decoded: Decoded):
        attrs = {kv.key: kv.value for kv in resource_attrs}
        self.run_id = _str(attrs.get(sc.RUN_ID), sc.RUN_ID)
        self.rank = _int(attrs.get(sc.RANK), sc.RANK)
        self.source = _str(attrs.get(sc.SOURCE), sc.SOURCE)
        self.row = {
            "host": _str(attrs.get(sc.HOST_NAME), sc.HOST_NAME),
            "local_rank": _int(attrs.get(sc.LOCAL_RANK), sc.LOCAL_RANK),
            "world_size": _int(attrs.get(sc.WORLD_SIZE), sc.WORLD_SIZE),
            "dp_rank": _int(attrs.get(sc.DP_RANK), sc.DP_RANK),
            "pp_stage": _int(attrs.get(sc.PP_STAGE), sc.PP_STAGE),
            "tp_rank": _int(attrs.get(sc.TP_RANK), sc.TP_RANK),
            "device": _str(attrs.get(sc.DEVICE), sc.DEVICE),
            "pid": _int(attrs.get(sc.PROCESS_PID), sc.PROCESS_PID),
        }
        self._decoded = decoded
        self._seen: set[tuple[str, int]] = set()

    def resolve(self, attrs: dict[str, AnyValue]) -> tuple[str, int]:
        """(run_id, rank) of an item: its own attributes win over the resource's."""
        run_id = _str(attrs.pop(sc.RUN_ID, None), sc.RUN_ID) or self.run_id
        rank = _int(attrs.pop(sc.RANK, None), sc.RANK)
        rank = self.rank if rank is None else rank
        if not run_id or rank is None:
            raise Rejected(f"no {sc.RUN_ID} and {sc.RANK} on the resource or the item")
        if (run_id, rank) not in self._seen:
            self._seen.add((run_id, rank))
            self._decoded.ranks.append({"run_id": run_id, "rank": rank, **self.row})
        return run_id, rank


_STEP_COLUMNS = ("run_id", "rank", "step", "start_ts", "end_ts", "duration_s", "data_s", "compute_s",
                 "comm_wait_s", "loss", "grad_norm", "tokens", "lr", "mfu", "trace_id", "span_id", "attrs")
_OP_COLUMNS = ("run_id", "rank", "step", "kind", "name", "start_ts", "end_ts", "duration_s", "microbatch",
               "comm_group", "group_size", "seq", "bytes", "algbw_gbps", "busbw_gbps", "trace_id", "span_id",
               "parent_span_id", "attrs")
_STEP_FLOATS = (("data_s", sc.DATA_S), ("compute_s", sc.COMPUTE_S), ("comm_wait_s", sc.COMM_WAIT_S),
                ("loss", sc.LOSS), ("grad_norm", sc.GRAD_NORM), ("lr", sc.LR), ("mfu", sc.MFU))


def decode_traces(request: ExportTraceServiceRequest) -> Decoded:
    """Spans -> `steps` (spans of kind step) and `ops` (every other span)."""
    out = Decoded("traces")
    steps = {c: [] for c in _STEP_COLUMNS}
    ops = {c: [] for c in _OP_COLUMNS}
    for rs in request.resource_spans:
        try:
            who = _Identity(rs.resource.attributes, out)
        except Rejected as e:
            for ss in rs.scope_spans:
                for _ in ss.spans:
                    out.reject(str(e))
            continue
        for ss in rs.scope_spans:
            for span in ss.spans:
                try:
                    _span_row(span, who, steps, ops)
                    out.accepted += 1
                except Rejected as e:
                    out.reject(f"span {span.name!r}: {e}")
    if steps["run_id"]:
        out.tables["steps"] = _batch("steps", steps)
    if ops["run_id"]:
        out.tables["ops"] = _batch("ops", ops)
    return out


def _span_row(span, who: _Identity, steps: dict[str, list], ops: dict[str, list]) -> None:
    attrs = {kv.key: kv.value for kv in span.attributes}
    run_id, rank = who.resolve(attrs)
    start, end = span.start_time_unix_nano, span.end_time_unix_nano
    if not start or end < start:
        raise Rejected("start time missing or after end time")
    seconds = (end - start) / 1e9
    kind = _str(attrs.pop(sc.KIND, None), sc.KIND) or (sc.KIND_STEP if span.name == "step" else sc.KIND_OTHER)
    step = _int(attrs.pop(sc.STEP, None), sc.STEP)
    if kind == sc.KIND_STEP:
        if step is None:
            raise Rejected(f"a step span needs {sc.STEP}")
        f = {column: _float(attrs.pop(key, None), key) for column, key in _STEP_FLOATS}
        tokens = _int(attrs.pop(sc.TOKENS, None), sc.TOKENS)
        row = (run_id, rank, step, start, end, seconds, f["data_s"], f["compute_s"], f["comm_wait_s"], f["loss"],
               f["grad_norm"], tokens, f["lr"], f["mfu"], span.trace_id, span.span_id, _leftover(attrs))
        for column, cell in zip(_STEP_COLUMNS, row):
            steps[column].append(cell)
        return
    if kind not in sc.OP_KINDS:
        raise Rejected(f"{sc.KIND} must be one of step, {', '.join(sc.OP_KINDS)}")
    microbatch = _int(attrs.pop(sc.MICROBATCH, None), sc.MICROBATCH)
    group = _str(attrs.pop(sc.COMM_GROUP, None), sc.COMM_GROUP)
    group_size = _int(attrs.pop(sc.COMM_GROUP_SIZE, None), sc.COMM_GROUP_SIZE)
    seq = _int(attrs.pop(sc.COMM_SEQ, None), sc.COMM_SEQ)
    nbytes = _int(attrs.pop(sc.COMM_BYTES, None), sc.COMM_BYTES)
    algbw = busbw = None
    if kind == sc.KIND_COMM:
        algbw, busbw = bandwidths(canonical_op(span.name) or span.name, nbytes, seconds, group_size)
    row = (run_id, rank, step, kind, span.name, start, end, seconds, microbatch, group, group_size, seq,
           nbytes, algbw, busbw, span.trace_id, span.span_id, span.parent_span_id or None, _leftover(attrs))
    for column, cell in zip(_OP_COLUMNS, row):
        ops[column].append(cell)


def decode_metrics(request: ExportMetricsServiceRequest) -> Decoded:
    """Gauge and sum data points -> `device_samples`, one row per point."""
    out = Decoded("metrics")
    rows = {c: [] for c in ("run_id", "rank", "ts", "metric", "value", "gpu", "source", "attrs")}
    for rm in request.resource_metrics:
        try:
            who = _Identity(rm.resource.attributes, out)
        except Rejected as e:
            who, why = None, str(e)
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                kind = metric.WhichOneof("data")
                if kind not in ("gauge", "sum"):
                    points = getattr(metric, kind).data_points if kind else ()
                    for _ in points:
                        out.reject(f"metric {metric.name!r}: only gauge and sum metrics are stored")
                    continue
                for point in getattr(metric, kind).data_points:
                    try:
                        if who is None:
                            raise Rejected(why)
                        attrs = {kv.key: kv.value for kv in point.attributes}
                        run_id, rank = who.resolve(attrs)
                        number = point.WhichOneof("value")
                        if number is None or not point.time_unix_nano:
                            raise Rejected("data point without a value or a time")
                        row = (run_id, rank, point.time_unix_nano, metric.name, float(getattr(point, number)),
                               _int(attrs.pop(sc.GPU, None), sc.GPU),
                               _str(attrs.pop(sc.SOURCE, None), sc.SOURCE) or who.source, _leftover(attrs))
                        for column, cell in zip(rows, row):
                            rows[column].append(cell)
                        out.accepted += 1
                    except Rejected as e:
                        out.reject(f"metric {metric.name!r}: {e}")
    if rows["run_id"]:
        out.tables["device_samples"] = _batch("device_samples", rows)
    return out


def decode_logs(request: ExportLogsServiceRequest) -> Decoded:
    """Log records -> `events`; the event name is rankwatch.event, else the body."""
    out = Decoded("logs")
    rows = {c: [] for c in ("run_id", "rank", "ts", "event", "step", "severity", "body", "attrs")}
    for rl in request.resource_logs:
        try:
            who = _Identity(rl.resource.attributes, out)
        except Rejected as e:
            who, why = None, str(e)
        for sl in rl.scope_logs:
            for record in sl.log_records:
                try:
                    if who is None:
                        raise Rejected(why)
                    attrs = {kv.key: kv.value for kv in record.attributes}
                    run_id, rank = who.resolve(attrs)
                    ts = record.time_unix_nano or record.observed_time_unix_nano
                    if not ts:
                        raise Rejected("log record without a time")
                    body = value(record.body) if record.HasField("body") else None
                    body = body if body is None or isinstance(body, str) else json.dumps(body)
                    event = _str(attrs.pop(sc.EVENT, None), sc.EVENT) or body or "log"
                    row = (run_id, rank, ts, event, _int(attrs.pop(sc.STEP, None), sc.STEP),
                           record.severity_text or None, body, _leftover(attrs))
                    for column, cell in zip(rows, row):
                        rows[column].append(cell)
                    out.accepted += 1
                except Rejected as e:
                    out.reject(f"log record: {e}")
    if rows["run_id"]:
        out.tables["events"] = _batch("events", rows)
    return out


REQUESTS = {
    "traces": (ExportTraceServiceRequest, decode_traces),
    "metrics": (ExportMetricsServiceRequest, decode_metrics),
    "logs": (ExportLogsServiceRequest, decode_logs),
}
