"""Where the dashboard reads: a running collector's query API, or a store file opened
read-only. Both run the same checked, read-only SQL (collector/store/readonly.py) and answer in
the same shape, so every page works on either."""

import atexit
import json
import os
from pathlib import Path
from typing import Protocol

import pandas as pd

from collector.reports import queryapi
from collector.reports.queryapi import QueryFailed
from collector.store import readonly
from collector.store.db import StoreLocked, connect
from rankwatch.agent.apiclient import ApiClient

COLLECTOR_ENV = "RANKWATCH_DASHBOARD_COLLECTOR"  # set by `rankwatch dashboard --collector URL`
DB_ENV = "RANKWATCH_DASHBOARD_DB"  # set by `rankwatch dashboard --db PATH`


class Source(Protocol):
    label: str  # what the sidebar says the dashboard reads

    def query(self, sql: str, params: dict | list | None = None) -> dict:
        """readonly.run's answer; QueryFailed with a one-line reason."""


class CollectorSource:
    """A running collector, through its query API (the collector keeps the file open for writing)."""

    def __init__(self, url: str, token: str | None):
        self.label = f"collector {url}"
        self._api = ApiClient(url, token)

    def query(self, sql: str, params: dict | list | None = None) -> dict:
        return queryapi.remote_query(self._api, sql, params)


class FileSource:
    """A store file no collector holds, opened read-only and locked down like the collector's."""

    def __init__(self, path: Path):
        self.label = f"store {path}"
        if not path.exists():
            raise QueryFailed(f"no store at {path}")
        try:
            self._con = connect(path, read_only=True)
        except StoreLocked as e:
            raise QueryFailed(f"{e}, or read it through the collector (rankwatch dashboard --collector URL)") from None
        readonly.lock_down(self._con, path.parent)
        # closed before the interpreter's teardown: DuckDB's C++ aborted a process that exited with it open
        atexit.register(self._con.close)

    def query(self, sql: str, params: dict | list | None = None) -> dict:
        try:
            return readonly.run(self._con, sql, params)
        except (readonly.QueryRefused, readonly.QueryTimeout) as e:
            raise QueryFailed(str(e)) from None


def from_environment() -> Source:
    """The source `rankwatch dashboard` chose, passed on in the environment."""
    from rankwatch.agent.config import token
    from rankwatch.agent.paths import store_path

    if os.environ.get(COLLECTOR_ENV):
        return CollectorSource(os.environ[COLLECTOR_ENV], token())
    return FileSource(Path(os.environ.get(DB_ENV) or store_path()))


def to_frame(answer: dict) -> pd.DataFrame:
    """An answer as a DataFrame: timestamps parsed back from ISO 8601 (UTC), JSON columns decoded."""
    frame = pd.DataFrame(answer["rows"], columns=answer["columns"])
    for column, kind in zip(answer["columns"], answer["types"]):
        if kind.startswith("TIMESTAMP"):
            frame[column] = pd.to_datetime(frame[column], utc=True, format="ISO8601")
        elif kind == "JSON":
            frame[column] = frame[column].map(lambda v: None if v is None else json.loads(v))
    return frame
