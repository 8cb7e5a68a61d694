"""SQL for post-mortems, on a store file or through a running collector's query API,
printed as a table, CSV or JSON.

Both ways answer in the query API's shape, {"columns", "types", "rows", "truncated"}: the types are
DuckDB's names of the columns' types, which is how JSON output tells a JSON column (DuckDB hands its
values over as text) from a text one, and writes its values as nested JSON.

A query DuckDB refuses is one error: its reason on one line (collector/printable.py escapes what it
quotes, a line break of DuckDB's own included), and, where DuckDB points at the place in the SQL,
its two lines of context ("LINE 2: ..." and the caret under the place) kept as lines, each printable,
the caret moved under the same character once the line is escaped (an escape such as \\x1b takes more
columns than the character it stands for)."""

import csv
import datetime as dt
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

import duckdb
from rich.cells import cell_len, get_character_cell_size
from rich.console import Console
from rich.table import Table
from rich.text import Text

from collector import ranksets
from collector.printable import printable
from collector.reports import queryapi
from collector.reports.terminal import markup_safe
from collector.store.db import connect
from rankwatch.agent.apiclient import ApiClient

FORMATS = ("table", "csv", "json")
LIST_ITEMS = 8  # items of a list a table cell shows; CSV and JSON keep every one
JSON_TYPE = "JSON"  # DuckDB's name of the type; a list of them is "JSON[]"
# DuckDB's pointer to the place in the SQL, at the end of its message: the line quoted, the caret under the place
_CONTEXT = re.compile(r"\n\n(LINE \d+: )(.*)\n( *)\^\s*$")


class QueryError(Exception):
    """SQL that was refused: its reason (as DuckDB wrote it: printed, it is made printable), and `context`,
    where DuckDB gave one: the lines that show where in the SQL, already printable (collector/printable.py)."""

    def __init__(self, reason: str, context: str | None = None):
        super().__init__(reason)
        self.context = context

    @classmethod
    def of(cls, message: str) -> "QueryError":
        """DuckDB's message, its reason apart from the lines that point at the place in the SQL."""
        found = _CONTEXT.search(message)
        if found is None:
            return cls(message.strip())
        label, line, caret = found.groups()
        quoted, pointed = label + line, _pointed(label + line, len(caret))
        under = cell_len(printable(quoted[:pointed]))  # the caret's column once the line is escaped
        return cls(message[: found.start()].strip(), f"{printable(quoted)}\n{' ' * under}^")


def _pointed(line: str, column: int) -> int:
    """The index in `line` of the character a caret at `column` points at. DuckDB counts the terminal cells
    before it (a control character or a combining mark takes none, a wide character two), as rich does."""
    cells = 0
    for index, character in enumerate(line):
        width = get_character_cell_size(character)
        if width and cells >= column:
            return index
        cells += width
    return len(line)


def run_sql(db: Path, sql: str, parameters: list | None = None) -> dict:
    """The query API's answer to a query against a store opened read-only (never truncated): one statement,
    as the API takes (QueryError for several, whose results but the last would go unseen)."""
    if not db.exists():
        raise QueryError(f"no store at {db}")
    try:
        statements = len(duckdb.extract_statements(sql))
    except duckdb.Error as e:
        raise QueryError.of(str(e)) from None
    if statements != 1:
        raise QueryError(f"one statement per query, not {statements}" + (": run each on its own" if statements else ""))
    con = connect(db, read_only=True)
    try:
        cursor = con.execute(sql, parameters)
        description = cursor.description or []
        rows = cursor.fetchall() if description else []
    except duckdb.Error as e:
        raise QueryError.of(str(e)) from None
    finally:
        con.close()
    return {
        "columns": [d[0] for d in description],
        "types": [str(d[1]) for d in description],
        "rows": rows,
        "truncated": False,
    }


def ask(url: str, token: str | None, sql: str) -> dict:
    """The query API's answer to a read-only query through a running collector."""
    try:
        return queryapi.remote_query(ApiClient(url, token), sql)
    except queryapi.QueryFailed as e:
        raise QueryError.of(str(e)) from None


def run_remote(url: str, token: str | None, sql: str) -> tuple[list[str], list[list], bool]:
    """(column names, rows, truncated?) of a read-only query through a collector's query API."""
    answer = ask(url, token, sql)
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


def _decoder(kind: str):
    """How a value of DuckDB type `kind` is written in JSON output: a JSON column's (or a list of them, at any
    depth) as the JSON it holds, nested, rather than as a string of it; any other as `_plain` makes it."""
    depth = kind.count("[]")
    if kind.replace("[]", "") != JSON_TYPE:
        return _plain

    def decoded(value, depth: int = depth):
        if value is None:
            return None
        return [decoded(v, depth - 1) for v in value] if depth else json.loads(value)

    return decoded


def write(
    columns: list[str],
    rows: Sequence[Sequence],
    fmt: str,
    out: TextIO | None = None,
    types: Sequence[str] | None = None,
) -> None:
    """Print a result in one of FORMATS (to stdout as it is when called); a table abbreviates long lists (_cell).
    A table and CSV are for people: control characters, line breaks and bidirectional controls in values are
    escaped (collector/printable.py). JSON keeps every value as stored, in its own escapes, the values of JSON
    columns (by `types`, DuckDB's names of the columns' types) as nested JSON."""
    out = out or sys.stdout
    if fmt == "csv":
        writer = csv.writer(out)
        writer.writerow(map(printable, columns))
        writer.writerows([_printable(_plain(v)) for v in row] for row in rows)
    elif fmt == "json":
        decoders = [_decoder(kind) for kind in types] if types is not None else [_plain] * len(columns)
        json.dump([{c: decode(v) for c, decode, v in zip(columns, decoders, row)} for row in rows], out, default=str)
        out.write("\n")
    else:
        table = Table(*map(markup_safe, columns))
        for row in rows:
            table.add_row(*(Text(printable(_cell(v))) for v in row))  # Text: no rich markup in the values
        Console(file=out).print(table)
