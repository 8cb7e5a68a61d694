"""`rankwatch demo`: a collector and a job wired together on loopback."""

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from collector.auth import load_or_create_token
from collector.query import run_sql, write


def wait_healthy(url: str, process: subprocess.Popen, timeout_s: float = 60.0) -> None:
    """Block until the collector answers /healthz (or fail if it died)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"collector exited with status {process.returncode}")
        try:
            if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"collector not healthy at {url} after {timeout_s:.0f}s")


def run(db: Path, steps: int, port: int) -> None:
    from trainer import synthetic

    token = load_or_create_token(db.parent)
    url = f"http://127.0.0.1:{port}"
    collector = subprocess.Popen([sys.executable, "-m", "rankwatch", "collector", "--db", str(db),
                                  "--port", str(port)], env={**os.environ, "RANKWATCH_TOKEN": token})
    try:
        wait_healthy(url, collector)
        run_id = time.strftime("demo-%Y%m%d-%H%M%S")
        print(f"job {run_id}: 4 ranks x {steps} steps -> {url}", flush=True)
        synthetic.run(url, token, run_id, world=4, steps=steps)
    finally:
        collector.terminate()
        collector.wait()
    columns, rows = run_sql(db, f"""
        SELECT rank, count(*) AS steps, round(median(duration_s) * 1000, 1) AS median_step_ms,
               round(median(compute_s) * 1000, 1) AS median_compute_ms
        FROM steps WHERE run_id = '{run_id}' GROUP BY rank ORDER BY rank""")
    write(columns, rows, "table")
