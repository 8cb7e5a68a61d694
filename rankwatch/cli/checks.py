"""What commands check the same way: the store of --db, the lake of --lake, the step-time model of --model,
the token a command sends and whether the collector takes it, and whether a run's job is running to take a
command. Each is one line (`UsageError`) where it fails, never a traceback from deeper in."""

import argparse
import time
from pathlib import Path

from rankwatch.agent.config import HEARTBEAT_S, INGEST
from rankwatch.cli.options import UsageError

DUCKDB_MAGIC = b"DUCK"  # bytes 8-11 of every DuckDB database file


def store(args: argparse.Namespace, existing: bool = False) -> Path:
    """The store of --db, $RANKWATCH_DB or the default, checked the same way for every command: a
    directory, an unreadable file or a file of another kind is one line here, not a DuckDB traceback
    later; with `existing`, so is no file at all (a command that only reads never creates a store)."""
    from rankwatch.agent.paths import store_path

    path = store_path(getattr(args, "db", None))
    if path.is_dir():
        raise UsageError(f"the store {path} is a directory: give the store file (--db PATH)")
    try:
        with open(path, "rb") as f:
            header = f.read(12)
    except FileNotFoundError:
        if existing:
            raise UsageError(f"no store at {path}") from None
        return path
    except OSError as e:
        raise UsageError(f"cannot read the store {path}: {e.strerror or e}") from None
    if header and header[8:12] != DUCKDB_MAGIC:  # an empty file is where a store is yet to be made
        raise UsageError(f"{path} is not a rankwatch store (a DuckDB file): check --db")
    return path


def lake(args: argparse.Namespace):
    """The lake named by --lake and --data-path (both or neither), or None: the store file."""
    if (args.lake is None) != (args.data_path is None):
        raise UsageError("--lake and --data-path go together: the lake's catalog database and its data directory")
    if args.lake is None:
        return None
    from collector.store.lake import Lake, LakeError

    try:
        return Lake(args.lake, Path(args.data_path).resolve())
    except LakeError as e:
        raise UsageError(str(e)) from None


def reader(args: argparse.Namespace):
    """A read-only connection to the store: the lake of --lake and --data-path, else the file of --db."""
    from collector.store.db import connect
    from collector.store.lake import LakeError, open_lake

    found = lake(args)
    if found is None:
        return connect(store(args, existing=True), read_only=True)
    try:
        return open_lake(found, read_only=True)
    except LakeError as e:
        raise UsageError(str(e)) from None


def step_model(path: str):
    """The step-time model saved at `path` by `rankwatch model fit`; a usage error where it is not one."""
    from collector.predict.stepmodel import Fitted

    try:
        return Fitted.load(Path(path))
    except (OSError, ValueError, KeyError) as e:
        raise UsageError(f"--model {path}: not a model saved by `rankwatch model fit` ({e})") from None


def sent_token(args: argparse.Namespace) -> str | None:
    """The token a client command sends: --token-file, then rankwatch/agent/config.py's order, ending with the token
    file beside the store of --db (or $RANKWATCH_DB, or the default); a file's token is checked there
    (TokenError, which main() reports in one line)."""
    from rankwatch.agent.config import token

    return token(file=args.token_file, store=getattr(args, "db", None))


def refused(error: Exception, token: str | None) -> UsageError:
    """A refused token, in one line that says where a command looks for the right one."""
    from rankwatch.agent.config import token_scope

    scope = token and token_scope(token)
    why = (
        "no token was found"
        if token is None
        else f"that token is scoped to {scope}, and this takes another scope"
        if scope
        else "that token is not its token"
    )
    return UsageError(
        f"{error}: {why}; give it with "
        "--token-file PATH, $RANKWATCH_TOKEN, or --db (the collector's store, the token file beside it)"
    )


def collector_takes(url: str, token: str | None, unreachable_ok: bool, scope: str = INGEST) -> None:
    """Before a command sends anything: the collector at `url` takes `token` for `scope` (ingest: one empty,
    authenticated export; query: one query of a constant), else one line naming where a token is looked
    for; an unreachable collector is one line too unless `unreachable_ok` (a job's telemetry waits for it)."""
    from rankwatch.agent.config import TokenRefused
    from rankwatch.agent.senders import check_token

    try:
        reached = check_token(url, token) if scope == INGEST else _answers_queries(url, token)
    except TokenRefused as e:
        raise refused(e, token) from None
    if not reached and not unreachable_ok:
        raise UsageError(f"cannot reach the collector at {url}: is it running? (rankwatch collector)")


def _answers_queries(url: str, token: str | None) -> bool:
    """agent.export.check_token's twin for the query API: True when the collector at `url` answers a query
    with `token`, False when it cannot be reached, TokenRefused when it answers 401 or 403."""
    from collector.reports.queryapi import PATH
    from rankwatch.agent.apiclient import ApiClient, ApiError
    from rankwatch.agent.config import TokenRefused

    try:
        ApiClient(url, token, timeout_s=5).post(PATH, {"sql": "SELECT 1"})
    except ApiError as e:
        if e.status in (401, 403):
            raise TokenRefused(f"the collector at {url} refused the token (HTTP {e.status}: {e})") from None
        return e.status is not None  # it answered, and not about the token
    return True


# A running job's agent sends a heartbeat every HEARTBEAT_S: this long without one or a step, none runs.
SILENT_S = 12 * HEARTBEAT_S


def check_running(
    run_id: str,
    ranks: list[int],
    ended: int,
    last_ns: int | None,
    undone: str = "a power cap would never be applied",
    doing: str = "apply a power cap",
) -> None:
    """A command only a running job applies: refused for a run whose every rank said it ended, or that
    sent no step or event for SILENT_S (an imported or finished run), since it would stay pending for ever;
    `undone` and `doing` say what in the refusal."""
    if ranks and ended >= len(ranks):
        raise UsageError(f"run {run_id} has ended (every rank said so): {undone}")
    silent_s = None if last_ns is None else (time.time_ns() - last_ns) / 1e9
    if silent_s is None or silent_s > SILENT_S:
        since = (
            "has sent no step or heartbeat"
            if silent_s is None
            else f"has sent nothing for {silent_s:.0f} s"
            if silent_s < 120
            else f"has sent nothing for {silent_s / 60:.0f} min"
        )
        raise UsageError(f"run {run_id} {since}: no job is running to {doing}")
