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
    """Open a store file, with a one-line StoreLocked error naming the process that holds it."""
    try:
        return duckdb.connect(str(path), read_only=read_only)
    except duckdb.IOException as e:
        if "lock" in str(e).lower():
            holder = re.search(r"PID (\d+)", str(e))
            raise StoreLocked(
                f"{path} is held open by {_holder(int(holder[1])) if holder else 'another process'}; stop it first"
            ) from None
        raise


def create_tables(con: duckdb.DuckDBPyConnection) -> None:
    """Every table, sequence and view of the schema that the store lacks (a new file gets them all)."""
    con.execute(DDL)


def _holder(pid: int) -> str:
    """The process to stop, in words: DuckDB names the collector's writer process, a child the user
    never started, so a holder whose parent is a `collector` command line is that collector; any other
    holder (a dashboard reading the file, a script) is named by its own command line."""
    try:
        found = re.search(r"PPid:\s*(\d+)", Path(f"/proc/{pid}/status").read_text())
        parent = int(found[1]) if found else None
        if parent is not None and b"collector" in Path(f"/proc/{parent}/cmdline").read_bytes().split(b"\0"):
            return f"a running collector (pid {parent})"
        command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:  # no /proc (not Linux), or the process is gone
        return f"another process (pid {pid})"
    shown = " ".join(Path(word).name if i == 0 else word for i, word in enumerate(command.split()[:6]))
    return f"another process (pid {pid}: {''.join(c if c.isprintable() else '?' for c in shown)[:120]})"
