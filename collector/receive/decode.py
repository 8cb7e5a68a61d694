"""OTLP export requests (protobuf bytes) -> Arrow batches, one per telemetry table.

This is the hot path of ingest (it runs in worker processes, see
collector/receive/ingest.py). Requests are decoded in batches, as many as waited for
a worker, so that what costs per call in Python and Arrow is paid once per
batch; each request's share of the rows (its `Part`) is kept, so each gets
its own answer and a retried one can be left out.

Spans, by far the most numerous items, are read by the C wire decoder
collector/receive/_otlpwire.c straight into Arrow buffers (where it is not built, by its
twin on the protobuf runtime, collector/receive/otlpwire.py: WIRE says which); metrics
and logs by the protobuf runtime, as row tuples typed by pyarrow. Known attributes fill typed
columns and any others are kept as JSON in `attrs`, so nothing valid is lost.
A value of the wrong type is coerced ("5" -> 5) or its item rejected;
rejected items are reported back through OTLP partial_success with the first
reason.

Nothing one request holds may fail the others decoded with it, nor the
others committed with it: a request is refused whole (413) when it has more
entries than MAX_ITEMS, counted on the wire before anything is decoded; an
item with more than MAX_ATTRIBUTES attributes, a step, rank or token count
outside RANGES, or a string longer than its bound (MAX_NAME_BYTES for what
names or identifies, a key of the store among them; MAX_TEXT_BYTES for free
text) is refused alone, and so are the items of a resource whose run id,
host, device or source is too long; and should decoding a batch still raise,
each request is decoded alone and one that raises is refused alone (400).
docs/telemetry.md gives the reasons for each bound.
"""

import logging
import os
import re
from collections import defaultdict
from collections.abc import Callable, Mapping
from functools import cache

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from collector.nccl import bandwidths
from collector.receive import otlpwire
from collector.receive.otlp import PROTOBUF, OtlpError, parse
from collector.receive.otlpwire import json_text, value
from collector.store.batch import Decoded, Part
from collector.store.schema import DDL
from rankwatch.agent import semconv as sc

MAX_ITEMS = 100_000  # resources, scopes and items (and metrics' data points) per request
MAX_ATTRIBUTES = 128  # per item: the OpenTelemetry SDKs' default attribute count limit
# Numbers analysis computes with: [0, bound); far past any real job, far from int64's ends.
RANGES = {"step": 2**40, "rank": 2**24, "tokens": 2**40}
# Bytes a stored string may hold: one that names or identifies (a run id, a host, span, metric and event
# names, a comm group, a source, trace and span ids), and free text (a log body, an item's other attributes
# as JSON: a Python stack trace fits).
MAX_NAME_BYTES = 256
MAX_TEXT_BYTES = 64 * 2**10
MAX_STACKS_BYTES = 256 * 2**10  # a `rank_stacks` event's body: a rank's threads' stacks and Flight Recorder entries
_TEXT_COLUMNS = frozenset({"attrs", "body"})
# The resource attributes stored as they come (a resource's run id stands for its items' own)
_RESOURCE_STRINGS = (sc.RUN_ID, sc.HOST_NAME, sc.DEVICE, sc.SOURCE)
_INTEGER = re.compile(r"-?[0-9]{1,20}")  # what a string must be to be read as an integer: int() takes "٣" too
log = logging.getLogger(__name__)


def _wire():
    """The trace decoder: the C one where it is built (and RANKWATCH_DECODER is not "python"), else
    its twin on the protobuf runtime."""
    if os.environ.get("RANKWATCH_DECODER") != "python":
        try:
            from collector.receive import _otlpwire

            return _otlpwire
        except ImportError:
            pass
    return otlpwire


WIRE = _wire()


def describe_decoder() -> str:
    """Which trace decoder this process uses, for the collector's start-up line."""
    if WIRE is otlpwire:
        return (
            "OTLP trace decoder: the protobuf runtime's (collector/receive/otlpwire.py); the C decoder is not "
            "built, or RANKWATCH_DECODER=python; ingest is several times slower"
        )
    return "OTLP trace decoder: C (collector/receive/_otlpwire.c)"


class Rejected(ValueError):
    """One telemetry item that cannot be stored; the message says why."""


def decode(signal: str, bodies: list[bytes]) -> Decoded:
    """A batch of requests of one signal decoded. Should that raise, each request is decoded alone,
    and one that still raises is refused alone (400): the others are stored all the same."""
    try:
        return DECODERS[signal][1](bodies)
    except Exception as e:
        if len(bodies) > 1:
            return _merge(signal, [decode(signal, [body]) for body in bodies])
        log.exception("a %s request could not be decoded", signal)
        return Decoded(signal, [Part(malformed=f"request could not be decoded: {type(e).__name__}: {e}")])


def admit(signal: str, body: bytes) -> None:
    """413 for a request with more than MAX_ITEMS entries, counted on the wire before anything is
    allocated for them, so that refusing it costs less than decoding it would."""
    if WIRE.entries(body, signal == "metrics", MAX_ITEMS) > MAX_ITEMS:
        raise OtlpError(413, f"more than {MAX_ITEMS} resources, scopes and items in one request; send smaller batches")


def each(signal: str, bodies: list[bytes], decode_one) -> Decoded:
    """A batch decoded request by request, for signals whose decoders read one at a time."""
    batches = []
    for body in bodies:
        part = Part()
        try:
            one = decode_one(body, part)
        except OtlpError as e:
            part.malformed = str(e)
            one = Decoded(signal, [part])
        part.rows = {name: table.num_rows for name, table in one.tables.items()}
        batches.append(one)
    return _merge(signal, batches)


def _merge(signal: str, batches: list[Decoded]) -> Decoded:
    """Decoded batches as one, their requests in order."""
    tables: dict[str, list[pa.Table]] = defaultdict(list)
    for batch in batches:
        for name, table in batch.tables.items():
            tables[name].append(table)
    return Decoded(
        signal,
        [part for batch in batches for part in batch.parts],
        {name: pa.concat_tables(parts) for name, parts in tables.items()},
    )


@cache
def arrow_schema(table: str) -> pa.Schema:
    """The Arrow schema of a store table, read from the DDL itself."""
    con = duckdb.connect()
    con.execute(DDL)
    return con.sql(f"SELECT * FROM {table} LIMIT 0").arrow().schema


def _attributes(key_values) -> dict:
    return {kv.key: value(kv.value) for kv in key_values}


def _leftover(attrs: dict) -> str | None:
    return json_text(attrs) if attrs else None


def _bounded(column: str, v):
    """`v` when within its RANGES bound (or None), else Rejected."""
    if v is not None and not 0 <= v < RANGES[column]:
        raise Rejected(f"{column} {v} outside [0, {RANGES[column]})")
    return v


def _too_long(v) -> bool:
    """Whether `v` is a string past MAX_NAME_BYTES."""
    return type(v) is str and len(v.encode()) > MAX_NAME_BYTES


def _within_bounds(columns: Mapping[str, pa.Array]) -> list[tuple[np.ndarray, str]]:
    """For each string or binary column with a cell past its bound (MAX_TEXT_BYTES for free text but a
    `rank_stacks` event's body, MAX_STACKS_BYTES; MAX_NAME_BYTES for the others), the mask of the cells within
    it and why the others are refused."""
    checks = []
    for name, array in columns.items():
        if not (pa.types.is_string(array.type) or pa.types.is_binary(array.type)):
            continue
        bound = MAX_TEXT_BYTES if name in _TEXT_COLUMNS else MAX_NAME_BYTES
        lengths = pc.binary_length(array)
        if (pc.max(lengths).as_py() or 0) > bound:
            stacks = pc.equal(columns["event"], sc.EVENT_RANK_STACKS) if name == "body" and "event" in columns else None
            bounds = bound if stacks is None else pc.if_else(stacks, MAX_STACKS_BYTES, bound)
            within = pc.less_equal(lengths, bounds).fill_null(True).to_numpy(zero_copy_only=False)
            if not within.all():
                told = "" if stacks is None else f" ({MAX_STACKS_BYTES:,} for a {sc.EVENT_RANK_STACKS} event's)"
                checks.append((within, f"{name} longer than {bound:,} bytes{told}"))
    return checks


def _attributes_of(item, what: str) -> dict:
    """An item's attributes as a dict, or Rejected past MAX_ATTRIBUTES."""
    if len(item.attributes) > MAX_ATTRIBUTES:
        raise Rejected(f"{what} has more than {MAX_ATTRIBUTES} attributes")
    return _attributes(item.attributes)


def _coerce(v, column: pa.Field):
    """One cell converted to its column's type, or Rejected."""
    if v is None:
        return None
    t = column.type
    if pa.types.is_integer(t) or pa.types.is_timestamp(t):
        if (type(v) is float and v.is_integer()) or (type(v) is str and _INTEGER.fullmatch(v)):
            v = int(v)
        if type(v) is not int:
            raise Rejected(f"{column.name} must be an integer, not {v!r}")
    elif pa.types.is_floating(t):
        try:
            v = float(v) if type(v) in (int, float, str) else None
        except (ValueError, OverflowError):
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


def _table(name: str, columns: tuple[str, ...], rows: list[tuple], out: Decoded, part: Part, what: str) -> None:
    """Add rows to `out` as an Arrow table with every column of the store table, in order
    (columns the rows lack are null), so the store appends it by position; a row that cannot be
    typed, or with a string past its bound, is refused."""
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
                part.reject(f"{what}: {e}")
        if not good:
            return
        arrays = [pa.array(col, f.type) for col, f in zip(zip(*good), fields)]
    table = pa.Table.from_arrays(arrays, names=list(columns))
    if checks := _within_bounds(dict(zip(columns, arrays))):
        within = np.logical_and.reduce([passed for passed, _ in checks])
        for refused in np.flatnonzero(~within).tolist():
            part.reject(f"{what}: {next(why for passed, why in checks if not passed[refused])}")
        table = table.filter(within)
    if table.num_rows:
        out.tables[name] = conform(table, full)


class _Identity:
    """Run, rank and placement of one resource, as the request `part` sent it; items may override run
    and rank. A resource with a string past MAX_NAME_BYTES is `refused`, and its items with it."""

    def __init__(self, attrs: dict, part: Part):
        self.run_id = attrs.get(sc.RUN_ID)
        self.rank = attrs.get(sc.RANK)
        self.source = attrs.get(sc.SOURCE)
        too_long = [key for key in _RESOURCE_STRINGS if _too_long(attrs.get(key))]
        self.refused = f"{too_long[0]} of the resource longer than {MAX_NAME_BYTES} bytes" if too_long else None
        self._row = {}
        columns = {**_RANK_ATTRIBUTES, "world_size": (sc.WORLD_SIZE, arrow_schema("runs").field("world_size"))}
        for column, (key, typed) in columns.items():
            try:  # a malformed placement attribute is dropped, the item itself is still good
                self._row[column] = _coerce(attrs.get(key), typed)
            except Rejected:
                self._row[column] = None
        self._part = part
        self._seen: set = set()

    def resolve(self, attrs: dict) -> tuple:
        """(run_id, rank) of an item: its own attributes win over the resource's."""
        if self.refused:
            raise Rejected(self.refused)
        run_id = attrs.pop(sc.RUN_ID, self.run_id)
        rank = attrs.pop(sc.RANK, self.rank)
        if run_id is None or rank is None or type(rank) is not int or type(run_id) is not str:
            raise Rejected(f"no valid {sc.RUN_ID} (string) and {sc.RANK} (integer) on the resource or the item")
        if _too_long(run_id):
            raise Rejected(f"{sc.RUN_ID} longer than {MAX_NAME_BYTES} bytes")
        _bounded("rank", rank)
        self.seen(run_id, rank)
        return run_id, rank

    def seen(self, run_id: str, rank: int) -> None:
        """Note that this resource spoke for (run_id, rank): it becomes a `ranks` row. The
        resource's placement is that rank's only when the resource names that rank; a process
        speaking for other ranks shares only its host with them."""
        if (run_id, rank) not in self._seen:
            self._seen.add((run_id, rank))
            own = (run_id, rank) == (self.run_id, self.rank)
            placement = self._row if own else {k: v if k == "host" else None for k, v in self._row.items()}
            self._part.ranks.append({"run_id": run_id, "rank": rank, **placement})


_RANK_ATTRIBUTES = {
    column: (key, arrow_schema("ranks").field(column))
    for column, key in (
        ("host", sc.HOST_NAME),
        ("local_rank", sc.LOCAL_RANK),
        ("dp_rank", sc.DP_RANK),
        ("pp_stage", sc.PP_STAGE),
        ("tp_rank", sc.TP_RANK),
        ("device", sc.DEVICE),
        ("pid", sc.PROCESS_PID),
    )
}
# Span attributes that become columns, and their column names.
_SPAN_KEYS = {
    sc.RUN_ID: "run_id",
    sc.RANK: "rank",
    sc.KIND: "kind",
    sc.STEP: "step",
    sc.DATA_S: "data_s",
    sc.COMPUTE_S: "compute_s",
    sc.COMM_WAIT_S: "comm_wait_s",
    sc.LOSS: "loss",
    sc.GRAD_NORM: "grad_norm",
    sc.TOKENS: "tokens",
    sc.LR: "lr",
    sc.MFU: "mfu",
    sc.STEP_ENERGY_J: "energy_j",
    sc.MICROBATCH: "microbatch",
    sc.COMM_GROUP: "comm_group",
    sc.COMM_GROUP_SIZE: "group_size",
    sc.COMM_SEQ: "seq",
    sc.COMM_BYTES: "bytes",
}
_KINDS = frozenset([sc.KIND_STEP, *sc.OP_KINDS])
_MAX_NS = 2**63 - 1  # TIMESTAMP_NS ends in the year 2262
# The columns the wire decoder returns besides the wanted attributes, and their Arrow types.
_WIRE_COLUMNS = {**otlpwire.SPAN_COLUMNS, "attrs": pa.string()}
_WIRE_TYPES = {pa.int64(): "q", pa.int32(): "i", pa.float64(): "d", pa.string(): "s"}


def _span_field(column: str) -> pa.Field:
    """A span column's field, from `ops` or else `steps`."""
    ops = arrow_schema("ops")
    return ops.field(column) if column in ops.names else arrow_schema("steps").field(column)


@cache
def _wanted() -> tuple[tuple[str, str, str], ...]:
    """The columns the wire decoder fills from attributes: column, attribute key and type."""
    return tuple((column, key, _WIRE_TYPES[_span_field(column).type]) for key, column in _SPAN_KEYS.items())


def _columns(n: int, buffers: dict[str, tuple]) -> dict[str, pa.Array]:
    """The wire decoder's buffers as Arrow arrays, by column name (zero-copy)."""

    def wrap(name: str, t: pa.DataType) -> pa.Array:
        return pa.Array.from_buffers(t, n, [b if b is None else pa.py_buffer(b) for b in buffers[name]])

    return {
        **{name: wrap(name, t) for name, t in _WIRE_COLUMNS.items()},
        **{column: wrap(column, _span_field(column).type) for column in _SPAN_KEYS.values()},
    }


def _coerce_odd(columns: dict[str, pa.Array], odd: list[tuple], bad: dict[int, str]) -> None:
    """Cells sent with another type than their column's: coerced ("5" -> 5) in place, or their
    span marked bad."""
    by_column = defaultdict(list)
    for row, column, sent in odd:
        by_column[column].append((row, sent))
    for column, cells in by_column.items():
        field = _span_field(column)
        values = columns[column].to_pylist()
        for row, sent in cells:
            try:
                values[row] = _coerce(sent, field)
            except Rejected as e:
                bad.setdefault(row, str(e))
        columns[column] = pa.array(values, field.type)


def _refuse_resources(resource: pa.Array, identities: list["_Identity"], bad: dict[int, str]) -> None:
    """Mark bad the spans of refused resources."""
    refused = {i: identity.refused for i, identity in enumerate(identities) if identity.refused}
    if refused:
        of = resource.to_numpy()
        for span in np.flatnonzero(np.isin(of, list(refused))).tolist():
            bad.setdefault(span, refused[int(of[span])])


def _from_resources(columns: dict[str, pa.Array], identities: list["_Identity"]) -> None:
    """run_id and rank of spans that do not name their own: their resource's."""
    resource = columns["resource"]
    for column in ("run_id", "rank"):
        own = columns[column]
        if not own.null_count:
            continue
        field = _span_field(column)
        values = []
        for identity in identities:
            try:
                values.append(_coerce(getattr(identity, column), field))
            except Rejected:
                values.append(None)
        inherited = pa.array(values, field.type).take(resource)
        columns[column] = inherited if own.null_count == len(own) else pc.coalesce(own, inherited)


def decode_traces(bodies: list[bytes]) -> Decoded:
    """Spans of a batch of requests -> `steps` (spans of kind step) and `ops` (every other span)."""
    wire = WIRE.traces(bodies, _wanted(), MAX_ATTRIBUTES)
    out = Decoded("traces", [Part() for _ in bodies])
    for i, why in wire["errors"]:
        out.parts[i].malformed = why
    n = wire["spans"]
    if not n:
        return out
    cols = _columns(n, wire["columns"])
    bad = dict.fromkeys(wire["crowded"], f"more than {MAX_ATTRIBUTES} attributes")
    if wire["odd"]:
        _coerce_odd(cols, wire["odd"], bad)
    identities = [_Identity(attrs, out.parts[i]) for attrs, i in zip(wire["resources"], wire["owners"])]
    _refuse_resources(cols["resource"], identities, bad)
    _from_resources(cols, identities)
    if cols["kind"].null_count:  # a span without a kind is a step if so named
        cols["kind"] = pc.coalesce(
            cols["kind"], pc.if_else(pc.equal(cols["name"], "step"), sc.KIND_STEP, sc.KIND_OTHER)
        )
    start, end = cols.pop("start").to_numpy(), cols.pop("end").to_numpy()
    times_ok = (start > 0) & (start <= end) & (end <= _MAX_NS)
    start, end = np.where(times_ok, start, 0).astype(np.int64), np.where(times_ok, end, 0).astype(np.int64)
    seconds = (end - start) / 1e9
    algbw, busbw = bandwidths(cols["name"], cols["group_size"], cols["bytes"], seconds)
    cols.update(
        start_ts=pa.array(start, pa.timestamp("ns")),
        end_ts=pa.array(end, pa.timestamp("ns")),
        duration_s=pa.array(seconds),
        algbw_gbps=algbw,
        busbw_gbps=busbw,
    )
    is_step = pc.equal(cols["kind"], sc.KIND_STEP).to_numpy(zero_copy_only=False)
    owner = np.asarray(wire["owners"], np.int64)[cols["resource"].to_numpy()]  # each span's request
    valid = _valid_spans(out, cols, times_ok, is_step, bad, owner)
    _note_ranks(identities, cols, valid)
    del cols["resource"]
    table = pa.table(cols)
    if not valid.all():
        table, is_step, owner = table.filter(valid), is_step[valid], owner[valid]
    for table_name, mine in (("steps", is_step), ("ops", ~is_step)):
        if mine.any():
            out.tables[table_name] = conform(table.filter(mine), arrow_schema(table_name))
            for i, rows in enumerate(np.bincount(owner[mine], minlength=len(bodies)).tolist()):
                if rows:
                    out.parts[i].rows[table_name] = rows
    return out


def _note_ranks(identities: list["_Identity"], cols: dict[str, pa.Array], valid: np.ndarray) -> None:
    """Every (resource, run, rank) that a stored span spoke for becomes a `ranks` row."""
    spoken = pa.table({"resource": cols["resource"], "run_id": cols["run_id"], "rank": cols["rank"]})
    if not valid.all():
        spoken = spoken.filter(valid)
    distinct = spoken.group_by(spoken.column_names).aggregate([])
    for i, run_id, rank in zip(*(distinct[c].to_pylist() for c in spoken.column_names)):
        identities[i].seen(run_id, rank)


def _valid_spans(
    out: Decoded,
    cols: dict[str, pa.Array],
    times_ok: np.ndarray,
    is_step: np.ndarray,
    bad: dict[int, str],
    owner: np.ndarray,
) -> np.ndarray:
    """The mask of spans that can be stored; each rejected span is counted against its request,
    with the first reason."""

    def present(column: str) -> np.ndarray:
        return cols[column].is_valid().to_numpy(zero_copy_only=False)

    checks = [
        (
            present("run_id") & present("rank"),
            f"no valid {sc.RUN_ID} (string) and {sc.RANK} (integer) on the resource or the span",
        ),
        (times_ok, "start time missing, after the end time, or past the year 2262"),
        (~is_step | present("step"), f"a step span needs {sc.STEP}"),
        *_within_bounds(cols),
    ]
    for column, bound in RANGES.items():
        within = pc.and_(pc.greater_equal(cols[column], 0), pc.less(cols[column], bound))
        checks.append((within.fill_null(True).to_numpy(zero_copy_only=False), f"{column} outside [0, {bound})"))
    if not set(pc.unique(cols["kind"]).to_pylist()) <= _KINDS:
        checks.append(
            (
                pc.is_in(cols["kind"], pa.array(sorted(_KINDS))).to_numpy(zero_copy_only=False),
                f"{sc.KIND} must be one of {', '.join(sorted(_KINDS))}",
            )
        )
    valid = np.logical_and.reduce([passed for passed, _ in checks])
    if bad:
        valid[list(bad)] = False
    for span in np.flatnonzero(~valid).tolist():  # the rare path: say why, per request
        why = bad.get(span) or next(why for passed, why in checks if not passed[span])
        out.parts[owner[span]].reject(f"span {cols['name'][span].as_py()!r}: {why}")
    return valid


def conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """`table` with exactly the columns of a store table, in order and of its types (nulls where
    it has none), so the store appends it by position."""
    have = dict(zip(table.column_names, table.columns))
    return pa.Table.from_arrays(
        [
            (have[f.name] if have[f.name].type == f.type else have[f.name].cast(f.type))
            if f.name in have
            else pa.nulls(table.num_rows, f.type)
            for f in schema
        ],
        schema=schema,
    )


def decode_metrics(bodies: list[bytes]) -> Decoded:
    """Gauge and sum data points -> `device_samples`, one row per point."""
    return each("metrics", bodies, _decode_metrics)


def _decode_metrics(body: bytes, part: Part) -> Decoded:
    request = parse(body, PROTOBUF, ExportMetricsServiceRequest)
    out = Decoded("metrics", [part])
    rows = []
    for rm in request.resource_metrics:
        who = _Identity(_attributes(rm.resource.attributes), part)
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                kind = metric.WhichOneof("data")
                points = getattr(metric, kind).data_points if kind else ()
                for point in points:
                    try:
                        if kind not in ("gauge", "sum"):
                            raise Rejected("only gauge and sum metrics are stored")
                        attrs = _attributes_of(point, "data point")
                        run_id, rank = who.resolve(attrs)
                        number = point.WhichOneof("value")
                        if number is None or not point.time_unix_nano:
                            raise Rejected("data point without a value or a time")
                    except Rejected as e:
                        part.reject(f"metric {metric.name!r}: {e}")
                        continue
                    rows.append(
                        (
                            run_id,
                            rank,
                            point.time_unix_nano,
                            metric.name,
                            float(getattr(point, number)),
                            attrs.pop(sc.GPU, None),
                            attrs.pop(sc.SOURCE, who.source),
                            _leftover(attrs),
                        )
                    )
    _table(
        "device_samples",
        ("run_id", "rank", "ts", "metric", "value", "gpu", "source", "attrs"),
        rows,
        out,
        part,
        "data point",
    )
    return out


_EVENT_STEP = arrow_schema("events").field("step")


def decode_logs(bodies: list[bytes]) -> Decoded:
    """Log records -> `events`; the event name is rankwatch.event, else the body."""
    return each("logs", bodies, _decode_logs)


def _decode_logs(body: bytes, part: Part) -> Decoded:
    request = parse(body, PROTOBUF, ExportLogsServiceRequest)
    out = Decoded("logs", [part])
    rows = []
    for rl in request.resource_logs:
        who = _Identity(_attributes(rl.resource.attributes), part)
        for sl in rl.scope_logs:
            for record in sl.log_records:
                try:
                    attrs = _attributes_of(record, "log record")
                    run_id, rank = who.resolve(attrs)
                    ts = record.time_unix_nano or record.observed_time_unix_nano
                    if not ts:
                        raise Rejected("no time")
                    step = _bounded("step", _coerce(attrs.pop(sc.STEP, None), _EVENT_STEP))
                except Rejected as e:
                    part.reject(f"log record: {e}")
                    continue
                body_value = value(record.body) if record.HasField("body") else None
                if body_value is not None and not isinstance(body_value, str):
                    body_value = json_text(body_value)
                # a body names the event only where it is short enough for a name (a message, not a trace)
                named = body_value if body_value is not None and not _too_long(body_value) else None
                event = attrs.pop(sc.EVENT, None) or named or "log"
                rows.append((run_id, rank, ts, event, step, record.severity_text or None, body_value, _leftover(attrs)))
    _table(
        "events", ("run_id", "rank", "ts", "event", "step", "severity", "body", "attrs"), rows, out, part, "log record"
    )
    return out


_Request = ExportTraceServiceRequest | ExportMetricsServiceRequest | ExportLogsServiceRequest
DECODERS: dict[str, tuple[type[_Request], Callable[[list[bytes]], Decoded]]] = {
    "traces": (ExportTraceServiceRequest, decode_traces),
    "metrics": (ExportMetricsServiceRequest, decode_metrics),
    "logs": (ExportLogsServiceRequest, decode_logs),
}
