"""Read-only SQL from people and the dashboard, made safe to run beside ingest.

Three layers, because a query is text from outside: DuckDB's own parser
admits one SELECT and nothing else (no INSERT, COPY, ATTACH, SET, PRAGMA,
CALL, LOAD, EXPORT...); in its parse tree (`_check_tree`), no function with a side effect is called
(checkpoint(), enable_logging(), nextval(), query()..., the list drawn from
`duckdb_functions()`), none that shows where the databases are or the settings (a lake's catalog
connection string), no file is named but by a literal `sql-files://NAME`, and no table of a lake's
catalog database but the keyed ones; the query runs in a READ ONLY transaction; and the database is
locked down (`lock_down`): no local file at all, only `sql-files://NAME`, the files under
`files_dir` (a directory of its own beside the store, so the token and the
receivers file, both secrets kept beside the store, are out of reach whatever
function, path, link or glob a query uses), opened and checked by
collector/store/sqlfiles.py,
no extension installs, DuckDB's memory capped at QUERY_MEMORY, configuration frozen. A watchdog interrupts a query
that runs too long, and at most ROW_CAP rows and BYTE_CAP bytes of JSON come
back, fetched a chunk at a time, so neither a cross join nor `SELECT * FROM
ops` can hold a thread or the memory for long.

Each query gets its own cursor (a DuckDB connection of its own), so it reads
a snapshot while the writer commits on the main connection. The query API hands
one to the store's writer as a `Query` request, answered on a query thread.
"""

import contextlib
import datetime as dt
import decimal
import functools
import json
import math
import re
import threading
import time
import uuid
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path

import duckdb

from collector.store import lake, sqlfiles
from collector.store.requests import Context, Request, handles
from collector.store.sqlfiles import SqlFiles
from rankwatch.agent.paths import SQL_FILES_DIR

ROW_CAP = 100_000  # rows a query returns at most; `truncated` says when there were more
# JSON bytes of rows a query returns at most (`truncated` too): 100,000 rows of a wide table fit, and the
# result crosses the writer's queue and the server's event loop in a fraction of a second.
BYTE_CAP = 32 * 2**20
# DuckDB's memory for the whole database (its buffer pool: sorts, joins, aggregates, string_agg's strings,
# cached blocks of the store), shared by the queries and the writer's commits. Past it, sorts and joins
# spill to the store's temporary directory and what cannot spill fails the query (Out of Memory, 400);
# a commit needs a few MiB of it, cached blocks are evicted for it. Measured: string_agg of 1 GB grew the
# writer to 1.7 GB and ran 2.9 s past the interrupt (its growing string is copied in calls no interrupt
# reaches); with the limit it is refused at the limit within a second.
MEMORY_LIMIT = 1 * 2**30
TIMEOUT_S = 10.0  # the longest a query may run; a request may ask for less
_CHUNK_ROWS = 4096  # the most rows fetched at once
_INTERRUPT_AGAIN_S = 0.05  # an interrupt between two DuckDB calls is lost: the watchdog repeats it
_GIVE_UP_S = 0.25  # how long past its limit a query has to stop by itself before the answer is 408 without it
# Queries running at once in a process, those still being interrupted after their 408 included: each holds
# DuckDB's memory until it returns. The collector's writer answers QUERY_THREADS (2) at a time.
RUNNING_AT_MOST = 4
_running = threading.BoundedSemaphore(RUNNING_AT_MOST)
_COMPACT = (",", ":")  # the separators of the JSON answer
# Table functions that only read (files under `files_dir`, the catalog, generated rows); any other is refused.
_READING_PREFIXES = ("read_", "parquet_", "duckdb_", "pragma_")
_READING_TABLE_FUNCTIONS = frozenset(
    {
        "range", "generate_series", "unnest", "repeat", "repeat_row", "glob", "sniff_csv", "json_each",
        "json_tree", "summary", "histogram", "histogram_values", "icu_calendar_names", "pg_timezone_names",
        "test_all_types", "test_vector_types", "which_secret",
    }
)  # fmt: skip
# Those of them that read files, whose first argument is the path: a literal `sql-files://` name, or a list of them.
_FILE_PREFIXES = ("read_", "parquet_")
_FILE_TABLE_FUNCTIONS = frozenset({"glob", "sniff_csv"})
# Scalars DuckDB flags as having side effects that only draw a value (a random number, an id, the time asleep).
_DRAWING_SCALARS = frozenset(
    {
        "random", "uuid", "uuidv4", "uuidv7", "gen_random_uuid", "current_query", "current_query_id",
        "current_connection_id", "current_transaction_id", "error", "sleep_ms", "stats", "vector_type",
    }
)  # fmt: skip


# Functions no query may call whatever its arguments, and why: they show where the attached databases are (a
# lake's catalog connection string), the settings (among them the paths DuckDB allows, those strings again)
# or the secrets, or plan SQL that no check saw (folding into constants what a refused function answers).
# DuckDB's own views over them (`pragma_database_list`, `pg_settings`...) are refused with them.
_CLOSED = {
    "duckdb_databases": "it shows where the databases are",
    "duckdb_settings": "it shows the settings",
    "current_setting": "it shows the settings",
    "duckdb_secrets": "it shows the secrets",
    "which_secret": "it shows the secrets",
    "json_serialize_plan": "it plans SQL that no check saw",
}
_NO_FILE = "Permission Error"  # what a file refused says first, as DuckDB's own refusal of a path does
_PLAIN_NAME = re.compile(r"\w*")  # a table's name, its schema's or its database's; a file's has a dot or a slash


class QueryRefused(Exception):
    """SQL refused before or while running, with a one-line reason (HTTP 400)."""


class QueryTimeout(Exception):
    """A query that ran past its time limit and was interrupted (HTTP 408)."""


def files_dir(data_dir: Path) -> Path:
    """The directory whose files queries may read: one of its own, never the store's directory, which
    holds the token file and the receivers file."""
    return data_dir / SQL_FILES_DIR


def spill_dir(data_dir: Path) -> Path:
    """Where a lake's DuckDB spills what outgrows its memory: beside the store, as a store file's does
    (`rankwatch.duckdb.tmp`), owner-only like everything there (collector/private.py)."""
    return data_dir / "lake.tmp"


def lock_down(con: duckdb.DuckDBPyConnection, data_dir: Path, lake_data: Path | None = None) -> None:
    """Confine every connection of `con`'s database to `sql-files://` (the files of `files_dir(data_dir)`,
    opened by collector/store/sqlfiles.py), for good: no local path, since DuckDB checks one and then
    opens it again by name. Its own files (the store, its WAL and spill directory; a lake's Parquet
    files, under `lake_data`, and its spill directory) stay open to DuckDB, which follows links there:
    a query reaches none of them by name (`_check_tree`), only the lake's through its tables.

    These settings are global to the DuckDB instance: the collector's writer
    shares them, which costs it nothing (it reads Arrow batches it was
    handed, and writes only its own file). A file opened again in the same process shares its
    database, already locked down."""
    if con.execute("SELECT current_setting('lock_configuration')").fetchall()[0][0]:
        return
    if lake_data:  # an in-memory database spills to `.tmp` in whatever the working directory is
        con.execute("SET temp_directory = ?", [str(spill_dir(data_dir))])
    con.register_filesystem(SqlFiles(files_dir(data_dir)))
    allowed = [f"{sqlfiles.PROTOCOL}://"] + ([f"{lake_data}/"] if lake_data else [])
    con.execute("SET allowed_directories = ?", [allowed])
    con.execute("SET memory_limit = ?", [f"{MEMORY_LIMIT}B"])
    con.execute("SET autoinstall_known_extensions = false")
    con.execute("SET enable_external_access = false")
    con.execute("SET lock_configuration = true")


def one_statement(sql: str) -> duckdb.Statement:
    """The one statement `sql` holds, or QueryRefused: of several, only the last one's rows would be seen."""
    try:
        statements = duckdb.extract_statements(sql)
    except duckdb.Error as e:
        raise QueryRefused(_message(e)) from None
    if len(statements) != 1:
        raise QueryRefused(f"one statement per query, not {len(statements)}")
    return statements[0]


def check(sql: str) -> None:
    """Raise QueryRefused unless `sql` is exactly one SELECT statement."""
    kind = one_statement(sql).type
    if kind.name != "SELECT":  # (by name: DuckDB's type stubs have differed in how they spell the member)
        raise QueryRefused(f"only SELECT is allowed, not {kind.name}")


@functools.cache
def refused_functions() -> frozenset[str]:
    """The functions no query may call, drawn from `duckdb_functions()` (the same for every database of
    this DuckDB library): every table function but the readers (DuckDB flags none: `checkpoint()`
    writes the store, `enable_logging()` changes settings, `query()` runs SQL no check saw), and every
    scalar DuckDB flags as having side effects but those that only draw a value (`nextval()` writes a
    sequence, `write_log()` the log)."""
    with duckdb.connect() as con:
        rows = con.execute(
            "SELECT DISTINCT lower(function_name), function_type = 'scalar' FROM duckdb_functions() "
            "WHERE function_type IN ('table', 'table_macro') OR (function_type = 'scalar' AND has_side_effects)"
        ).fetchall()
    return frozenset(name for name, scalar in rows if not (name in _DRAWING_SCALARS if scalar else _reading(name)))


def _reading(table_function: str) -> bool:
    return table_function.startswith(_READING_PREFIXES) or table_function in _READING_TABLE_FUNCTIONS


@functools.cache
def _closed() -> dict[str, str]:
    """The _CLOSED functions and DuckDB's own views over them (`pragma_database_list`, `pg_settings`...),
    drawn from `duckdb_views()`, each with its reason."""
    with duckdb.connect() as con:
        views = con.execute("SELECT lower(view_name), lower(sql) FROM duckdb_views() WHERE internal").fetchall()
    over = {name: reason for name, sql in views for function, reason in _CLOSED.items() if f"{function}(" in sql}
    return _CLOSED | over


def _check_tree(cursor: duckdb.DuckDBPyConnection, sql: str) -> None:
    """Raise QueryRefused when `sql`, found in DuckDB's own parse tree of it (a name in a string is no call,
    a qualified `system.main.checkpoint()` is one), calls a function `refused_functions` lists or a
    _CLOSED one, or a table function not known to only read (an extension's, say); reads a view over a
    _CLOSED function; or names a file otherwise than by a literal `sql-files://` path."""
    (serialized,) = cursor.execute("SELECT json_serialize_sql(?)", [sql]).fetchall()[0]
    tree = json.loads(serialized)
    if tree.get("error"):
        message = str(tree.get("error_message") or "the query could not be parsed")
        if message.startswith("Only SELECT statements"):  # DuckDB 1.4 reads a PRAGMA as a SELECT until here
            raise QueryRefused(f"only SELECT is allowed, not {sql.split(maxsplit=1)[0].upper()}")
        raise QueryRefused(message.splitlines()[0])
    refused, closed = refused_functions(), _closed()
    stack: list = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            kind, called = node.get("type"), str(node.get("function_name", "")).lower()
            if kind == "TABLE_FUNCTION":
                _check_table_function(node["function"], closed)
            elif kind == "BASE_TABLE":
                _check_table(node, closed)
            elif called in closed:
                raise QueryRefused(f"{called}() is not allowed: {closed[called]}")
            elif called in refused:
                raise QueryRefused(f"{called}() is not allowed: it has side effects")
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)


def _check_table_function(function: dict, closed: dict[str, str]) -> None:
    """A table function in FROM: one that only reads, and one that reads files reads them by their
    literal `sql-files://` names. In a lake DuckDB may open the lake's data path and its spill directory,
    following any link a local user put there, and a name computed (`'/la' || 'ke/x'`) or passed as a
    parameter is seen by no check: only collector/store/sqlfiles.py resolves a name."""
    name = str(function.get("function_name", "")).lower()
    if name in closed:
        raise QueryRefused(f"{name}() is not allowed: {closed[name]}")
    if not _reading(name):
        raise QueryRefused(f"{name}() is not allowed: only table functions that read are")
    if not (name.startswith(_FILE_PREFIXES) or name in _FILE_TABLE_FUNCTIONS):
        return
    positional = [a for a in function.get("children", []) if not _named(a)]
    paths = (
        positional[0].get("children", [])
        if positional and positional[0].get("function_name") == "list_value"
        else positional[:1]
    )
    if not all(_sql_files_name(p) for p in paths):
        raise QueryRefused(f"{_NO_FILE}: {name}() reads files by their literal {sqlfiles.PROTOCOL}:// names only")


def _check_table(table: dict, closed: dict[str, str]) -> None:
    """A table or view by its name, or a file by its literal `sql-files://` name (DuckDB reads a name it
    finds no table for as a file, its parts joined: `FROM "/la"."ke/x".csv` reads /la.ke/x.csv)."""
    name = str(table.get("table_name", ""))
    parts = [str(table.get("catalog_name") or ""), str(table.get("schema_name") or ""), name]
    if name.lower() in closed:
        raise QueryRefused(f"{name} is not allowed: {closed[name.lower()]}")
    if lake.METADATA in (part.lower() for part in parts):  # (a database, or a schema of the default one)
        raise QueryRefused(f"{lake.METADATA} is not allowed: the lake is read through its tables")
    if not all(_PLAIN_NAME.fullmatch(part) for part in parts) and not (
        parts[:2] == ["", ""] and name.startswith(f"{sqlfiles.PROTOCOL}://")
    ):
        raise QueryRefused(
            f"{_NO_FILE}: {'.'.join(filter(None, parts))} is no table, and a file is read by its "
            f"{sqlfiles.PROTOCOL}:// name"
        )


def _named(argument: dict) -> bool:
    """Whether a table function's argument is a named parameter (`header = true`), as DuckDB's binder
    tells them: an equality whose left side is an unqualified column name."""
    left = argument.get("left") or {}
    return (
        argument.get("type") == "COMPARE_EQUAL"
        and left.get("class") == "COLUMN_REF"
        and len(left.get("column_names", [])) == 1
    )


def _sql_files_name(argument: dict) -> bool:
    """Whether an argument is a string literal naming a file of `sql-files://`."""
    value = argument.get("value") or {}
    return (
        argument.get("class") == "CONSTANT"
        and (value.get("type") or {}).get("id") == "VARCHAR"
        and str(value.get("value")).startswith(f"{sqlfiles.PROTOCOL}://")
    )


def run(
    con: duckdb.DuckDBPyConnection,
    sql: str,
    params: list | dict | None = None,
    timeout_s: float = TIMEOUT_S,
    max_rows: int = ROW_CAP,
) -> dict:
    """{"columns", "types", "rows", "truncated"} of one checked query, with JSON-ready values,
    on a fresh cursor of `con` (a database already under `lock_down`). A `timeout_s` outside
    (0, TIMEOUT_S] is TIMEOUT_S.

    The query runs on a thread of its own and the answer is QueryTimeout once its time is up, whether
    or not DuckDB has returned: one call of a single value (`len(range(30000000))` ran 12 s past a 3 s
    limit, `list_resize` 50 s) sees no interrupt until it is done. Such a call goes on, interrupted,
    until DuckDB returns, holding one of RUNNING_AT_MOST places meanwhile."""
    check(sql)
    timeout_s = timeout_s if 0 < timeout_s <= TIMEOUT_S else TIMEOUT_S
    max_rows = max(0, min(max_rows, ROW_CAP))
    deadline = time.monotonic() + timeout_s
    late = f"the query ran past {timeout_s:g} s and was interrupted"
    if not _running.acquire(timeout=timeout_s):  # every place held by a query that has not given up yet
        raise QueryTimeout(late)
    answer: Future[dict] = Future()
    threading.Thread(target=_answer, args=(answer, con, sql, params, max_rows, deadline, late), daemon=True).start()
    try:
        return answer.result(max(0.0, deadline - time.monotonic()) + _GIVE_UP_S)
    except FutureTimeout:
        raise QueryTimeout(late) from None


def _answer(
    answer: "Future[dict]",
    con: duckdb.DuckDBPyConnection,
    sql: str,
    params,
    max_rows: int,
    deadline: float,
    late: str,
) -> None:
    """Run the query on a cursor of its own, interrupted at `deadline` and again until it gives up,
    and settle `answer` once DuckDB is done with the cursor: a process that exits on the answer must
    not find this thread inside DuckDB (its C++ aborts when Python ends a daemon thread there)."""
    cursor = lake.cursor(con)
    finished = threading.Event()
    watchdog = threading.Thread(target=_watch, args=(cursor, finished, deadline), daemon=True)
    watchdog.start()
    outcome: dict | Exception
    try:
        _check_tree(cursor, sql)
        cursor.execute("BEGIN TRANSACTION READ ONLY")
        result = cursor.execute(sql, params)
        description = result.description
        rows, truncated = _fetch(result, max_rows, deadline)
        outcome = {
            "columns": [d[0] for d in description],
            "types": [str(d[1]) for d in description],
            "rows": rows,
            "truncated": truncated,
        }
    except duckdb.InterruptException:
        outcome = QueryTimeout(late)
    except duckdb.Error as e:
        outcome = QueryRefused(_message(e))
    except MemoryError:  # a value too large to convert, under the writer's cap (collector/children.py)
        outcome = QueryRefused("Out of Memory Error: the result needs more memory than a query may use")
    except Exception as e:  # the future must settle whatever went wrong
        outcome = e
    finally:
        finished.set()
        watchdog.join()
        with contextlib.suppress(duckdb.Error):
            cursor.close()  # ends the read-only transaction with it
        _running.release()
    if isinstance(outcome, Exception):
        answer.set_exception(outcome)
    else:
        answer.set_result(outcome)


@dataclass(frozen=True)
class Query(Request[dict]):
    """One query for the store's writer: run's arguments, checked by the query API."""

    sql: str
    params: list | dict | None = None
    timeout_s: float = TIMEOUT_S
    max_rows: int = ROW_CAP


@handles(Query, beside=True, passes=(QueryRefused, QueryTimeout))
def _query(context: Context, q: Query) -> dict:
    return run(context.con, q.sql, q.params, q.timeout_s, q.max_rows)


def _fetch(result: duckdb.DuckDBPyConnection, max_rows: int, deadline: float) -> tuple[list[list], bool]:
    """The first rows of `result` as JSON-ready values, at most `max_rows` of them in BYTE_CAP bytes of
    JSON, and whether any were left out. Rows come a chunk at a time, a chunk at most as many rows as
    came so far and as fit in the bytes left at their size so far, so the thread stops near the cap
    instead of building an oversized result first."""
    rows: list[list] = []
    size, chunk = 0, 1
    while True:
        batch = [[_plain(v) for v in row] for row in result.fetchmany(chunk)]
        if time.monotonic() > deadline:  # converting rows, outside DuckDB, where no interrupt reaches
            raise duckdb.InterruptException()
        batch_size = len(json.dumps(batch, separators=_COMPACT)) - 1  # each row with its comma
        if len(rows) + len(batch) > max_rows or size + batch_size > BYTE_CAP:
            return rows + _prefix(batch, max_rows - len(rows), BYTE_CAP - size), True
        rows += batch
        size += batch_size
        if len(batch) < chunk:
            return rows, False
        chunk = max(1, min(_CHUNK_ROWS, len(rows), (BYTE_CAP - size) * len(rows) // size, max_rows + 1 - len(rows)))


def _prefix(rows: list[list], max_rows: int, max_bytes: int) -> list[list]:
    """The longest first part of `rows`, at most `max_rows` of them in `max_bytes` of JSON."""
    size = 0
    for n, row in enumerate(rows[:max_rows]):
        size += len(json.dumps(row, separators=_COMPACT)) + 1
        if size > max_bytes:
            return rows[:n]
    return rows[:max_rows]


def _watch(cursor: duckdb.DuckDBPyConnection, finished: threading.Event, deadline: float) -> None:
    """Interrupt `cursor` once `deadline` has passed, and again until the query gives up: an interrupt
    that lands between two DuckDB calls (before the query starts, between two fetches) is lost."""
    wait = max(0.0, deadline - time.monotonic())
    while not finished.wait(wait):
        with contextlib.suppress(duckdb.Error):  # closing meanwhile: the query finished in time after all
            cursor.interrupt()
        wait = _INTERRUPT_AGAIN_S


def _message(error: Exception) -> str:
    """DuckDB's message whole: where it points at the place in the SQL (LINE n: and a caret under it), that
    is the most useful part of it."""
    return str(error).strip()


def _plain(value):
    """A DuckDB value as JSON can carry it: times in ISO 8601, intervals in seconds, blobs in hex,
    non-finite floats as null (JSON has no NaN), any other type as its text."""
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
    return value if value is None or isinstance(value, (str, int)) else str(value)
