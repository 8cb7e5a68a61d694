"""How `rankwatch dashboard` starts Streamlit: on loopback only (the dashboard shows a
training job's telemetry and has no login), with the chosen source in the environment."""

import contextlib
import os
import sys
from pathlib import Path

from dashboard.source import COLLECTOR_ENV, DB_ENV
from rankwatch.agent import paths

APP = Path(__file__).with_name("app.py")
HOST = "127.0.0.1"


def command(port: int) -> list[str]:
    """The `streamlit run` command line of the app."""
    return [
        sys.executable,
        "-m",
        "streamlit",
        "run",
        str(APP),
        "--server.address",
        HOST,
        "--server.port",
        str(port),
        "--server.headless",
        "true",
        "--browser.gatherUsageStats",
        "false",
        "--server.fileWatcherType",
        "none",
        "--client.toolbarMode",
        "viewer",
    ]


def url(port: int) -> str:
    return f"http://{HOST}:{port}"


def serve(port: int, db: Path | None = None, collector: str | None = None, data_dir: Path | None = None) -> None:
    """Become the Streamlit server (exec: signals reach it directly), reading `db` or `collector`; its
    address is noted in `data_dir` (the store's directory, if there is one), where `train` and
    `simulate` read the link they print."""
    env = {**os.environ, DB_ENV: str(db.resolve()) if db else "", COLLECTOR_ENV: collector or ""}
    if data_dir is not None and data_dir.is_dir():
        with contextlib.suppress(OSError):  # a read-only data directory: the links fall back to the default
            (data_dir / paths.DASHBOARD_FILE).write_text(url(port) + chr(10))
    print(f"rankwatch dashboard on {url(port)}  reading {collector or db}", flush=True)
    os.execve(sys.executable, command(port), env)
