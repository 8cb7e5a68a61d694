"""How `rankwatch dashboard` starts Streamlit: on loopback only (the dashboard shows a
training job's telemetry and has no login), with the chosen source in the environment."""

import os
import sys
from pathlib import Path

from dashboard.source import COLLECTOR_ENV, DB_ENV

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


def serve(port: int, db: Path | None = None, collector: str | None = None) -> None:
    """Become the Streamlit server (exec: signals reach it directly), reading `db` or `collector`."""
    env = {**os.environ, DB_ENV: str(db.resolve()) if db else "", COLLECTOR_ENV: collector or ""}
    print(f"rankwatch dashboard on http://{HOST}:{port}  reading {collector or db}", flush=True)
    os.execve(sys.executable, command(port), env)
