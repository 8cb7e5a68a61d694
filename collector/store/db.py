"""Opening a store file: the one way every reader and writer opens it, and the lock that says who holds it.

The bottom of the collector: it imports nothing of the collector but the schema, so that the query
command, the dashboard and the importers open a store without loading the server, the analyzers or
the OpenTelemetry SDK.
"""

import re
from pathlib import Path

import duckdb

from collector.store.schema import DDL


class StoreLocked(Exception):
    """Another process holds the store open for writing; the message names the process to stop."""


def connect(path: Path, read_only: bool = False) -> duckdb.DuckDBPyConnection:
    """Open a store file, with a one-line StoreLocked error when a collector holds it."""
    try:
        return duckdb.connect(str(path), read_only=read_only)
    except duckdb.IOException as e:
        if "lock" in str(e).lower():
            holder = re.search(r"PID (\d+)", str(e))
            raise StoreLocked(
                f"{path} is held open by a running collector"
                f"{f' (pid {_collector_pid(int(holder[1]))})' if holder else ''}; stop it first"
            ) from None
        raise


def create_tables(con: duckdb.DuckDBPyConnection) -> None:
    """Every table, sequence and view of the schema that the store lacks (a new file gets them all)."""
    con.execute(DDL)


def _collector_pid(holder: int) -> int:
    """The process to stop: DuckDB names the collector's writer process, a child the user never
    started; its parent, where that is a `collector` command line, is the collector itself."""
    try:
        found = re.search(r"PPid:\s*(\d+)", Path(f"/proc/{holder}/status").read_text())
        if found is None:  # not the status file Linux writes
            return holder
        parent = int(found[1])
        arguments = Path(f"/proc/{parent}/cmdline").read_bytes().split(b"\0")
    except OSError:  # no /proc (not Linux), or the process is gone
        return holder
    return parent if b"collector" in arguments else holder
