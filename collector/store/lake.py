"""The store as a lake shared by several collectors (`rankwatch collector --lake`): DuckLake, DuckDB's own
lakehouse format, whose catalog lives in a PostgreSQL database and whose data are Parquet files under
a path every collector reaches (a parallel file system or an object store mount in production).

What is appended (the telemetry tables and the digests of the exports they came in) is in the lake:
each commit of a collector is one DuckLake snapshot, atomic, and any DuckDB (or Spark, Trino,
Polars) reads it. What is keyed and updated in place (runs, ranks, findings, commands, alerts, the
outbox, the analysis cursors, telemetry loss) is in ordinary tables of the same PostgreSQL database,
which DuckLake's tables cannot be (no primary keys, no sequences): every collector sees one row per
key, updated under PostgreSQL's own locks. Two tables exist only here (schema.LAKE_ONLY_DDL): the
claims by which one collector at a time may store an export, so that a retry sent to another
collector is never stored twice, and the leases by which one collector at a time leads a run's
analysis.

Both databases are attached to one in-memory DuckDB (`lake` and `pg`), with the search path set so
that the collector's SQL names its tables as it does in a store file. A DuckDB transaction may
write one attached database only: the writer writes a group's telemetry in one lake transaction and
its keyed rows in PostgreSQL beside it (collector/store/writer.py).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import socket
import time
import urllib.parse
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import duckdb

from collector.store.schema import DDL, LAKE_ONLY_DDL, LAKE_TABLES

LAKE, KEYED = "lake", "pg"  # the names the two databases are attached under
METADATA = f"__ducklake_metadata_{LAKE}"  # DuckLake's own attachment of the catalog database, for its tables
SCHEMA = "rankwatch"  # the catalog database's schema of the keyed tables
_DUCKLAKE_SCHEMA = "public"  # the catalog database's schema of DuckLake's own tables
# libpq's connection parameters that hold a secret: never in --lake, where `ps`, the log and error messages
# would show them (libpq reads them from ~/.pgpass, $PGPASSFILE, $PGPASSWORD or a service file instead).
_SECRET_PARAMETERS = frozenset({"password", "sslpassword", "oauth_client_secret"})
_URI = re.compile(r"\s*(postgres(?:ql)?://.*)", re.IGNORECASE | re.DOTALL)  # libpq's URI form, else key=value
# DuckDB types the PostgreSQL tables spell otherwise: JSON is kept as text (DuckDB's JSON operators
# read text alike, and the postgres extension cannot write a value into a PostgreSQL json column).
_PG_TYPES = {"BLOB": "BYTEA", "JSON": "TEXT", "VARCHAR": "TEXT", "DOUBLE": "DOUBLE PRECISION"}
# Claims taken in PostgreSQL in one statement (claim()): a row inserted, or updated where this collector
# held it or its holder let it go stale; `again`: it had been claimed before.
_CLAIM = f"""
CREATE OR REPLACE FUNCTION {SCHEMA}.claim(digests bytea[], claimant text, held interval)
RETURNS TABLE (digest bytea, again boolean) LANGUAGE sql AS $$
    INSERT INTO {SCHEMA}.claims AS c SELECT d, claimant, now() FROM unnest(digests) AS d
    ON CONFLICT (digest) DO UPDATE SET holder = excluded.holder, claimed_at = excluded.claimed_at
    WHERE c.holder = excluded.holder OR c.claimed_at < now() - held
    RETURNING c.digest, c.xmax <> 0
$$"""
# Placements (`ranks`, and `runs`' world size) upserted in PostgreSQL in one statement (place()): as the
# writer's _UPSERT_RANKS and _UPSERT_RUNS do in a store file, a value given replacing the one kept.
_PLACE = f"""
CREATE OR REPLACE FUNCTION {SCHEMA}.place(placements jsonb) RETURNS int LANGUAGE sql AS $$
    INSERT INTO {SCHEMA}.ranks AS r (run_id, rank, host, local_rank, dp_rank, pp_stage, tp_rank, device, pid,
                                     first_seen)
    SELECT run_id, rank, host, local_rank, dp_rank, pp_stage, tp_rank, device, pid, now()
    FROM jsonb_to_recordset(placements) AS p(run_id text, rank int, host text, local_rank int, dp_rank int,
                                             pp_stage int, tp_rank int, device text, pid bigint)
    ON CONFLICT (run_id, rank) DO UPDATE SET
        host = coalesce(excluded.host, r.host), local_rank = coalesce(excluded.local_rank, r.local_rank),
        dp_rank = coalesce(excluded.dp_rank, r.dp_rank), pp_stage = coalesce(excluded.pp_stage, r.pp_stage),
        tp_rank = coalesce(excluded.tp_rank, r.tp_rank), device = coalesce(excluded.device, r.device),
        pid = coalesce(excluded.pid, r.pid);
    INSERT INTO {SCHEMA}.runs AS u (run_id, world_size, first_seen)
    SELECT run_id, max(world_size), now() FROM jsonb_to_recordset(placements) AS p(run_id text, world_size int)
    GROUP BY run_id
    ON CONFLICT (run_id) DO UPDATE SET world_size = coalesce(excluded.world_size, u.world_size);
    SELECT 1;
$$"""
# What a statement that lost a race with another collector's says (it is tried again).
_RACED = re.compile(r"conflict|already exists|duplicate key", re.IGNORECASE)
_STATEMENT = re.compile(r"CREATE (?:OR REPLACE )?(TABLE|SEQUENCE|VIEW)(?: IF NOT EXISTS)? (\w+)", re.IGNORECASE)


class LakeError(Exception):
    """The lake cannot be opened: its catalog database refuses or its extensions are missing (one line)."""


@dataclass(frozen=True)
class Lake:
    """Where a lake is: `catalog`, a PostgreSQL connection string without a password (libpq's
    `key=value` form, as `host=db1 port=5432 dbname=rankwatch user=rankwatch`, or its URI form,
    `postgresql://rankwatch@db1:5432/rankwatch`), and `data_path`, the directory of its Parquet files."""

    catalog: str
    data_path: Path

    def __post_init__(self) -> None:
        if "'" in self.catalog or "'" in str(self.data_path):
            raise LakeError("a lake's catalog and data path may not contain a quote")
        if given := _secrets_in(self.catalog):  # (named, never shown: no message may hold the value)
            raise LakeError(
                f"keep the catalog's {' and '.join(sorted(set(given)))} out of --lake, where `ps` and the log "
                "show it: libpq reads a password from ~/.pgpass or $PGPASSWORD, any parameter from a service file"
            )


def _secrets_in(catalog: str) -> list[str]:
    """The secret parameters (_SECRET_PARAMETERS) a libpq connection string gives, in either form: in
    `key=value` pairs, each key after a space; in a URI, a password after the user name
    (`user:secret@`) and the query's parameters, their names percent-decoded as libpq decodes them."""
    if uri_form := _URI.match(catalog):
        uri = urllib.parse.urlsplit(uri_form[1])
        given = [key for key, _ in urllib.parse.parse_qsl(uri.query, keep_blank_values=True)]
        given += ["password"] if uri.password is not None else []
    else:
        given = re.findall(r"(?:^|\s)(\w+)\s*=", catalog)
    return [key.lower() for key in given if key.lower() in _SECRET_PARAMETERS]


def extensions() -> Path:
    """The directory DuckDB loads the ducklake and postgres extensions from: the one the
    `duckdb-ext-ducklake` and `duckdb-ext-postgres` wheels install (no download at run time)."""
    spec = importlib.util.find_spec("duckdb_ext")
    if spec is None or not spec.submodule_search_locations:
        raise LakeError(
            "the lake needs the duckdb-ext-ducklake and duckdb-ext-postgres packages: pip install 'rankwatch[lake]'"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "extensions"


def open_lake(lake: Lake, read_only: bool = False, tries: int = 5) -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB with the lake (`lake`, its default) and its catalog database (`pg`) attached,
    the collector's tables found by their bare names (`read_only`: both attached read-only, for a
    reader after the fact; the lake must exist). Collectors opening a new lake at once race to make
    its catalog: a loser tries again."""
    only = ", READ_ONLY" if read_only else ""
    for attempt in range(tries):
        con = duckdb.connect(config={"extension_directory": str(extensions()), "autoinstall_known_extensions": False})
        try:
            con.execute("LOAD ducklake; LOAD postgres")
            if not read_only:
                lake.data_path.mkdir(parents=True, exist_ok=True)
            # each database attached with its own schema alone: the catalog database's other schemas
            # (PostgreSQL's pg_catalog: its roles, password hashes and settings) are no table of the lake's
            con.execute(
                f"ATTACH 'ducklake:postgres:{lake.catalog}' AS {LAKE} (DATA_PATH '{lake.data_path}/', "
                f"METADATA_PARAMETERS MAP {{'SCHEMA': '{_DUCKLAKE_SCHEMA}'}}{only})"
            )
            con.execute(f"ATTACH '{lake.catalog}' AS {KEYED} (TYPE postgres, SCHEMA '{SCHEMA}'{only})")
            if not read_only:
                _retried(con, "CALL postgres_execute(?, ?)", [KEYED, f"CREATE SCHEMA IF NOT EXISTS {SCHEMA}"])
            con.execute("CALL pg_clear_cache()")
        except duckdb.Error as e:
            con.close()
            if attempt < tries - 1 and _RACED.search(str(e)):
                time.sleep(0.1 * (attempt + 1) + (os.getpid() % 7) / 50)
                continue
            raise LakeError(f"cannot open the lake {lake.catalog!r}: {str(e).splitlines()[0]}") from None
        try:
            _name_tables(con)
        except duckdb.Error:  # read-only, a catalog no collector has stored into
            con.close()
            raise LakeError(f"the lake {lake.catalog!r} holds no rankwatch store yet") from None
        return con
    raise AssertionError("unreachable")


def cursor(con: duckdb.DuckDBPyConnection, in_lake: bool | None = None) -> duckdb.DuckDBPyConnection:
    """A cursor of `con` (a connection of its own to the same database) that finds the tables by their
    bare names as `con` does: in a lake, a connection's search path is its own. `in_lake`: whether `con`
    is a lake's, where the caller knows (asking, `attached`, is a query of about a millisecond: the writer
    makes a cursor for every read, the control API's held polls alone twenty a second)."""
    made = con.cursor()
    if attached(made) if in_lake is None else in_lake:
        _name_tables(made)
    return made


def _name_tables(con: duckdb.DuckDBPyConnection) -> None:
    con.execute(f"USE {LAKE}")
    con.execute(f"SET search_path = '{LAKE}.main,{KEYED}.{SCHEMA}'")


def attached(con: duckdb.DuckDBPyConnection) -> bool:
    """Whether `con` is a lake's (else a store file's)."""
    return bool(
        con.execute("SELECT count(*) FROM duckdb_databases() WHERE database_name = ?", [KEYED]).fetchall()[0][0]
    )


def create_tables(con: duckdb.DuckDBPyConnection) -> None:
    """The schema's tables each where it belongs and its views in the lake, those missing created
    (several collectors starting at once may race: a loser's DDL conflicts and is tried again)."""
    for kind, name, sql in _statements(DDL + LAKE_ONLY_DDL):
        if kind == "VIEW":  # in the lake, its tables named in full: a connection reading it may name them otherwise
            _retried(con, _qualified(sql))
        elif name in LAKE_TABLES:
            _retried(con, sql.replace(" PRIMARY KEY", ""))
        else:
            _retried(con, "CALL postgres_execute(?, ?)", [KEYED, f"SET search_path TO {SCHEMA}; {_postgres(sql)}"])
    for function in (_CLAIM, _PLACE):
        _retried(con, "CALL postgres_execute(?, ?)", [KEYED, function])
    con.execute("CALL pg_clear_cache()")  # tables another collector made are seen


def claim(con: duckdb.DuckDBPyConnection, digests: list[bytes], held: timedelta) -> tuple[set[bytes], set[bytes]]:
    """Claim exports (by digest) for this collector, in one statement run by PostgreSQL itself (through
    DuckDB, an upsert read the whole claims table first: 130 ms at 300,000 claims, against 3 ms here).
    Returns the digests this collector now holds, and those of them that had been claimed before
    (by a collector that died, or by this one): only those may be stored already."""
    digest_array = "ARRAY[" + ",".join(f"decode('{d.hex()}','hex')" for d in digests) + "]::bytea[]"
    claimant = holder().replace("'", "''")
    held_s = f"{held.total_seconds()} seconds"
    query = f"SELECT * FROM {SCHEMA}.claim({digest_array}, '{claimant}', interval '{held_s}')"
    rows = con.execute("SELECT * FROM postgres_query(?, ?)", [KEYED, query]).fetchall()
    return {bytes(d) for d, _ in rows}, {bytes(d) for d, again in rows if again}


def place(con: duckdb.DuckDBPyConnection, placements: list[dict]) -> None:
    """Upsert ranks' placements (and their runs' world sizes) in one statement run by PostgreSQL
    (through DuckDB's postgres extension an upsert reads the whole table first: every rank of every
    run the lake holds)."""
    document = json.dumps(placements, default=str).replace("'", "''")
    con.execute(
        "SELECT * FROM postgres_query(?, ?)", [KEYED, f"SELECT {SCHEMA}.place('{document}'::jsonb) AS placed"]
    ).fetchall()


def next_id(con: duckdb.DuckDBPyConnection, sequence: str) -> int:
    """The next value of one of the schema's sequences, in a store file or a lake's catalog alike."""
    if attached(con):
        query = f"SELECT nextval('{SCHEMA}.{sequence}')"
        return con.execute("SELECT * FROM postgres_query(?, ?)", [KEYED, query]).fetchall()[0][0]
    return con.execute("SELECT nextval(?)", [sequence]).fetchall()[0][0]


def holder() -> str:
    """This collector, as its claims and leases name it: its writer process (a writer started again is
    another holder, and waits for the leases of the one that died to expire)."""
    return f"{socket.gethostname()}:{os.getpid()}"


def lease(con: duckdb.DuckDBPyConnection, kind: str, name: str, held: timedelta) -> bool:
    """Take or renew the lease (`kind`, `name`) for `held` from now: True where this collector holds it
    (it did, or nobody did, or its holder let it expire), False where another holds it."""
    (changed,) = con.execute(
        "INSERT INTO leases VALUES (?, ?, ?, now() + ?::INTERVAL) ON CONFLICT (kind, name) DO UPDATE"
        " SET holder = excluded.holder, expires_at = excluded.expires_at"
        " WHERE leases.holder = excluded.holder OR leases.expires_at < now()",
        [kind, name, holder(), held],
    ).fetchall()[0]
    return changed > 0


def give_up(con: duckdb.DuckDBPyConnection, kind: str, names: list[str]) -> None:
    """Let these leases go now, for another collector to take at once (a collector stopping)."""
    if names:
        con.execute(
            "DELETE FROM leases WHERE kind = ? AND holder = ? AND name IN (SELECT unnest(?::VARCHAR[]))",
            [kind, holder(), names],
        )


def _statements(ddl: str) -> list[tuple[str, str, str]]:
    """(kind, name, statement) of each statement of `ddl`, comments left out."""
    text = "\n".join(line for line in ddl.splitlines() if not line.lstrip().startswith("--"))
    matches = [(_STATEMENT.match(statement), statement) for statement in (s.strip() for s in text.split(";"))]
    return [(match[1].upper(), match[2], statement) for match, statement in matches if match]


def _qualified(view: str) -> str:
    """A view's DDL with each table it reads named with its database and schema."""
    return re.sub(
        r"\b(FROM|JOIN) (\w+)\b",
        lambda m: f"{m[1]} {LAKE if m[2] in LAKE_TABLES else KEYED}.{'main' if m[2] in LAKE_TABLES else SCHEMA}.{m[2]}",
        view,
    )


def _postgres(sql: str) -> str:
    """A table's DuckDB DDL as PostgreSQL's (the few types spelled otherwise)."""
    return re.sub(r"\b(BLOB|JSON|VARCHAR|DOUBLE)\b", lambda m: _PG_TYPES[m[1]], sql)


def _retried(con: duckdb.DuckDBPyConnection, sql: str, params: list | None = None, tries: int = 5) -> None:
    for attempt in range(tries):
        try:
            con.execute(sql, params)
            return
        except duckdb.Error as e:
            if attempt == tries - 1 or not _RACED.search(str(e)):
                raise
            time.sleep(0.05 * (attempt + 1) + (os.getpid() % 7) / 100)
