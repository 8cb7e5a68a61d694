"""Where rankwatch keeps its files: the store and what lives beside it, named once for the agent,
the trainer, the collector, the dashboard and the command line. A leaf (the standard library only).

    rankwatch-data/               the data directory: the store's, wherever the store is
      rankwatch.duckdb            the store: --db, else $RANKWATCH_DB, else this
      token                       the bearer token, mode 0600, made by the collector's first start
      alerts.toml                 the alert receivers, if any (collector/alerts/config.py)
      dashboard                   the address of the dashboard last started on this store or its collector
      sql-files/                  the only files SQL queries may read, as sql-files://NAME (collector/store/sqlfiles.py)
      runs/RUN/checkpoints/       `rankwatch train`'s checkpoints of run RUN, rank-R/ for rank R

The token and receivers files are secrets, which is why queries get a directory of their own.
"""

import os
from pathlib import Path

DB_ENV = "RANKWATCH_DB"
DEFAULT_DB = Path("rankwatch-data/rankwatch.duckdb")
TOKEN_FILE = "token"
ALERTS_FILE = "alerts.toml"
DASHBOARD_FILE = "dashboard"  # `train` and `simulate` print its link with the port it really serves on
SQL_FILES_DIR = "sql-files"


def store_path(explicit: str | Path | None = None) -> Path:
    """The store file: given, else $RANKWATCH_DB, else the default."""
    return Path(explicit or os.environ.get(DB_ENV) or DEFAULT_DB)


def checkpoint_dir(store: Path, run_id: str) -> Path:
    """Where `rankwatch train` keeps run `run_id`'s checkpoints: beside the store. ValueError for a run id
    that is not one directory's name (empty, `.`, `..`, or with a `/` or NUL in it): an absolute path or
    `../..` would put them outside the store's directory."""
    if run_id in ("", ".", "..") or "/" in run_id or "\0" in run_id:
        raise ValueError(
            f"run id {run_id!r} cannot name a directory of {store.parent / 'runs'}: "
            "give one without /, other than . and .."
        )
    return store.parent / "runs" / run_id / "checkpoints"
