"""Traces recorded elsewhere, into a store: one run at a time, all or nothing.

Each importer (one module per format) turns its files into batches of rows in
the shape of the `ops` table, the ranks' placement and, where the format has
more to say, `events` rows; `store_run` writes them in one transaction and
derives the `steps` rows from the ops that belong to a step: a rank-step
lasts from its first op's start to its last op's end, and its compute,
communication and data times are the sums of its ops of those kinds, unless
the importer measured some of them better (a GPU trace knows which
communication no compute overlapped). Ops without a step (Flight Recorder
dumps know none) make no steps. A trace that fails half-way leaves nothing
behind.
"""

from collections.abc import Callable, Iterable
from io import BufferedIOBase
from pathlib import Path

import pandas as pd
import pyarrow as pa

from collector.receive.decode import arrow_schema, conform
from collector.store.db import connect, create_tables
from rankwatch.agent import semconv as sc

_CHUNK = 1 << 20  # bytes read at a time by read_at_most


class TraceError(ValueError):
    """A trace that cannot be imported; the message names the file and what is wrong."""


def read_at_most(f: BufferedIOBase, limit: int) -> bytearray | None:
    """What `f` holds (a file, a decompressing reader), read a chunk at a time; None as soon as it
    passes `limit` bytes, so a file past it never takes more memory than that."""
    data = bytearray()
    while chunk := f.read(_CHUNK):
        data += chunk
        if len(data) > limit:
            return None
    return data


def files_of(paths: Iterable[Path], kept: Callable[[Path], bool], what: str) -> list[Path]:
    """The files given, and in each directory given the files `kept` takes, in name order: one run's
    traces, named on a command line file by file, by directory, or both. TraceError for a path that
    is not there and a directory with none of `what` in it."""
    files = []
    for path in paths:
        if path.is_dir():
            found = sorted(p for p in path.iterdir() if p.is_file() and kept(p))
            if not found:
                raise TraceError(f"{path}: no {what} in this directory")
            files += found
        elif path.is_file():
            files.append(path)
        else:
            raise TraceError(f"{path}: no such file or directory")
    return files


_STEPS_FROM_OPS = """
INSERT INTO steps (run_id, rank, step, start_ts, end_ts, duration_s, data_s, compute_s, comm_wait_s)
SELECT run_id, rank, step, min(start_ts), max(end_ts),
       (epoch_ns(max(end_ts)) - epoch_ns(min(start_ts))) / 1e9,
       coalesce(sum(duration_s) FILTER (kind = 'data'), 0),
       coalesce(sum(duration_s) FILTER (kind = 'compute'), 0),
       coalesce(sum(duration_s) FILTER (kind = 'comm'), 0)
FROM ops WHERE run_id = ? AND step IS NOT NULL
GROUP BY run_id, rank, step
"""

# What tells an imported run from a live one's (a trace, recorded over a stretch of time, not a run
# gone silent): one event at the trace's start (its first op's), naming its format and when it was imported.
_IMPORTED = f"""
INSERT INTO events (run_id, ts, event, body, attrs)
SELECT run_id, min(start_ts), '{sc.EVENT_IMPORTED}', ?,
       json_object('{sc.IMPORT_FORMAT}', ?, '{sc.IMPORTED_AT}', strftime(now(), '%Y-%m-%dT%H:%M:%SZ'))
FROM ops WHERE run_id = ? GROUP BY run_id
"""


def store_run(
    db: Path,
    run_id: str,
    batches: Iterable[pa.Table],
    placement: Callable[[], pd.DataFrame] | None = None,
    world_size: int | None = None,
    step_columns: Callable[[], pd.DataFrame] | None = None,
    events: Callable[[], pd.DataFrame] | None = None,
    trace_format: str = "ops",
) -> dict[str, int]:
    """Write a run's ops (tables with `ops` columns, run_id left out) and derive its steps;
    returns rows written per table. `trace_format` names what was read (kineto, flight-recorder,
    ops), in the run's `trace_imported` event. `placement`, called once the batches are read: rank and
    any of host, local_rank, dp_rank, pp_stage, tp_rank, device, pid. `step_columns`, called
    then too: rank, step and `steps` columns whose values replace the derived ones. `events`,
    called then too: rows of `events` (run_id left out). Raises TraceError (from the batches
    too) with nothing written, StoreLocked when a collector holds the store."""
    db.parent.mkdir(parents=True, exist_ok=True)
    con = connect(db)
    try:
        create_tables(con)
        if con.execute("SELECT 1 FROM runs WHERE run_id = ?", [run_id]).fetchone():
            raise TraceError(f"run {run_id!r} is already in {db}; import under another --run")
        con.begin()
        try:
            ops = 0
            for table in batches:
                table = table.append_column("run_id", pa.array([run_id] * table.num_rows, pa.string()))
                con.from_arrow(conform(table, arrow_schema("ops"))).insert_into("ops")
                ops += table.num_rows
            if not ops:
                raise TraceError("the trace holds no ops")
            steps = con.execute(_STEPS_FROM_OPS, [run_id]).fetchall()[0][0]
            con.execute(_IMPORTED, [f"{trace_format} trace imported", trace_format, run_id])
            if step_columns is not None:
                measured = step_columns()
                con.register("measured", measured)
                columns = ", ".join(f"{c} = measured.{c}" for c in measured.columns.drop(["rank", "step"]))
                con.execute(
                    f"UPDATE steps SET {columns} FROM measured WHERE run_id = ? "
                    "AND steps.rank = measured.rank AND steps.step = measured.step",
                    [run_id],
                )
                con.unregister("measured")
            if events is not None:
                con.register("imported_events", events().assign(run_id=run_id))
                con.execute("INSERT INTO events BY NAME SELECT * FROM imported_events")
                con.unregister("imported_events")
            ranks = (
                placement()
                if placement is not None
                else pd.DataFrame(
                    {
                        "rank": [
                            r
                            for (r,) in con.execute(
                                "SELECT DISTINCT rank FROM ops WHERE run_id = ?", [run_id]
                            ).fetchall()
                        ]
                    }
                )
            )
            ranks = ranks.assign(run_id=run_id)
            con.register("placement", ranks)
            con.execute("INSERT INTO ranks BY NAME SELECT *, now() AS first_seen FROM placement")
            con.unregister("placement")
            con.execute("INSERT INTO runs VALUES (?, ?, now())", [run_id, world_size or len(ranks)])
            con.commit()
        except BaseException:
            con.rollback()
            raise
        return {"ops": ops, "steps": steps, "ranks": len(ranks)}
    finally:
        con.close()
