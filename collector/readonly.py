"""Read-only SQL from people and the dashboard, made safe to run beside ingest.

Three layers, because a query is text from outside: DuckDB's own parser
admits one SELECT and nothing else (no INSERT, COPY, ATTACH, SET, PRAGMA,
CALL, LOAD, EXPORT...); the query runs in a READ ONLY transaction, so a
function that writes (nextval) fails too; and the database is locked down
(`lock_down`): no file outside the data directory, no extension installs,
configuration frozen. A timer interrupts a query that runs too long and at
most ROW_CAP rows come back, so neither a cross join nor `SELECT * FROM ops`
can hold a thread or the memory for long.

Each query gets its own cursor (a DuckDB connection of its own), so it reads
a snapshot while the writer commits on the main connection.
"""

import datetime as dt
import decimal
import math
import threading
import uuid
from pathlib import Path

import duckdb

ROW_CAP = 100_000  # rows a query returns at most; `truncated` says when there were more
TIMEOUT_S = 10.0  # the longest a query may run; a request may ask for less


class QueryRefused(Exception):
    """SQL refused before or while running, with a one-line reason (HTTP 400)."""


class QueryTimeout(Exception):
    """A query that ran past its time limit and was interrupted (HTTP 408)."""


def lock_down(con: duckdb.DuckDBPyConnection, data_dir: Path) -> None:
    """Confine every connection of `con`'s database to `data_dir`, for good.

    These settings are global to the DuckDB instance: the collector's writer
    shares them, which costs it nothing (it reads Arrow batches it was
    handed, and writes only its own file). A file opened again in the same process shares its
    database, already locked down."""
    if con.execute("SELECT current_setting('lock_configuration')").fetchone()[0]:
        return
    con.execute("SET allowed_directories = ?", [[str(data_dir.resolve())]])
    con.execute("SET autoinstall_known_extensions = false")
    con.execute("SET enable_external_access = false")
    con.execute("SET lock_configuration = true")


def check(sql: str) -> None:
    """Raise QueryRefused unless `sql` is exactly one SELECT statement."""
    try:
        statements = duckdb.extract_statements(sql)
    except duckdb.Error as e:
        raise QueryRefused(_first_line(e)) from None
    if len(statements) != 1:
        raise QueryRefused(f"one statement per query, not {len(statements)}")
    kind = statements[0].type
    if kind != duckdb.StatementType.SELECT:
        raise QueryRefused(f"only SELECT is allowed, not {kind.name}")


def run(con: duckdb.DuckDBPyConnection, sql: str, params: list | dict | None = None,
        timeout_s: float = TIMEOUT_S, max_rows: int = ROW_CAP) -> dict:
    """{"columns", "types", "rows", "truncated"} of one checked query, with JSON-ready values,
    on a fresh cursor of `con` (a database already under `lock_down`)."""
    check(sql)
    timeout_s, max_rows = min(timeout_s, TIMEOUT_S), max(0, min(max_rows, ROW_CAP))
    cursor = con.cursor()
    timer = threading.Timer(timeout_s, _interrupt, [cursor])
    try:
        cursor.execute("BEGIN TRANSACTION READ ONLY")
        timer.start()
        result = cursor.execute(sql, params)
        rows = result.fetchmany(max_rows + 1)
        description = result.description
    except duckdb.InterruptException:
        raise QueryTimeout(f"the query ran past {timeout_s:g} s and was interrupted") from None
    except duckdb.Error as e:
        raise QueryRefused(_first_line(e)) from None
    finally:
        timer.cancel()
        cursor.close()  # ends the read-only transaction with it
    return {"columns": [d[0] for d in description], "types": [str(d[1]) for d in description],
            "rows": [[_plain(v) for v in row] for row in rows[:max_rows]], "truncated": len(rows) > max_rows}


def _interrupt(cursor: duckdb.DuckDBPyConnection) -> None:
    try:
        cursor.interrupt()
    except duckdb.Error:  # closed meanwhile: the query finished in time after all
        pass


def _first_line(error: Exception) -> str:
    return str(error).strip().splitlines()[0]


def _plain(value):
    """A DuckDB value as JSON can carry it: times in ISO 8601, intervals in seconds, blobs in hex,
    non-finite floats as null (JSON has no NaN)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, (dt.datetime, dt.date, dt.time)):
        return value.isoformat()
    if isinstance(value, dt.timedelta):
        return value.total_seconds()
    if isinstance(value, decimal.Decimal):
        return float(value)
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return value
