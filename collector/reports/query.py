"""SQL for post-mortems, on a store file or through a running collector's query API,
printed as a table, CSV or JSON."""

import csv
import datetime as dt
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

import duckdb
from rich.console import Console
from rich.table import Table
from rich.text import Text

from agent.apiclient import ApiClient
from collector import ranksets
from collector.printable import printable
from collector.reports import queryapi
from collector.reports.terminal import markup_safe
from collector.store import readonly
from collector.store.db import connect

FORMATS = ("table", "csv", "json")
LIST_ITEMS = 8  # items of a list a table cell shows; CSV and JSON keep every one


class QueryError(Exception):
    """SQL that DuckDB refused, with its one-line reason."""


def run_sql(db: Path, sql: str, parameters: list | None = None) -> tuple[list[str], list[tuple]]:
    """(column names, rows) of a query against a store opened read-only: one statement, as the query API
    takes (QueryError for several, whose results but the last would go unseen)."""
    if not db.exists():
        raise QueryError(f"no store at {db}")
    try:
        readonly.one_statement(sql)
    except readonly.QueryRefused as e:
        raise QueryError(f"{e}: run each on its own") from None
    con = connect(db, read_only=True)
    try:
        cursor = con.execute(sql, parameters)
        if cursor.description is None:
            return [], []
        return [d[0] for d in cursor.description], cursor.fetchall()
    except duckdb.Error as e:
        raise QueryError(str(e).splitlines()[0]) from None
    finally:
        con.close()


def run_remote(url: str, token: str | None, sql: str) -> tuple[list[str], list[list], bool]:
    """(column names, rows, truncated?) of a read-only query through a collector's query API."""
    try:
        answer = queryapi.remote_query(ApiClient(url, token), sql)
    except queryapi.QueryFailed as e:
        raise QueryError(str(e)) from None
    return answer["columns"], answer["rows"], answer["truncated"]


def _plain(value):
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, (dt.datetime, dt.date, dt.time, dt.timedelta)):
        return value.isoformat() if hasattr(value, "isoformat") else str(value)
    return value


def _printable(value):
    return printable(value) if isinstance(value, str) else value


def _cell(value) -> str:
    """A value as a table shows it: a long list shortened to one line, a sorted list of whole
    numbers (ranks, most often) as ranges ("0–511"), any other its first items and a count."""
    if isinstance(value, (list, tuple)) and len(value) > LIST_ITEMS:
        if all(isinstance(v, int) for v in value) and list(value) == sorted(set(value)):
            return f"[{ranksets.compact(value)}] ({len(value)})"
        return "[" + ", ".join(str(_plain(v)) for v in value[:LIST_ITEMS]) + f", … {len(value) - LIST_ITEMS} more]"
    return "" if value is None else str(_plain(value))


def write(columns: list[str], rows: Sequence[Sequence], fmt: str, out: TextIO | None = None) -> None:
    """Print a result in one of FORMATS (to stdout as it is when called); a table abbreviates long lists (_cell).
    A table and CSV are for people: control characters, line breaks and bidirectional controls in values are
    escaped (collector/printable.py). JSON keeps every value as stored, in its own escapes."""
    out = out or sys.stdout
    if fmt == "csv":
        writer = csv.writer(out)
        writer.writerow(map(printable, columns))
        writer.writerows([_printable(_plain(v)) for v in row] for row in rows)
    elif fmt == "json":
        json.dump([dict(zip(columns, map(_plain, row))) for row in rows], out, default=str)
        out.write("\n")
    else:
        table = Table(*map(markup_safe, columns))
        for row in rows:
            table.add_row(*(Text(printable(_cell(v))) for v in row))  # Text: no rich markup in the values
        Console(file=out).print(table)
