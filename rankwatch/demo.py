"""`rankwatch demo`: a collector and a 4-rank training job with an injected straggler and a
loss spike, wired together on loopback: the collector finds the straggler and rolls the spike
back; then a per-rank summary, the collector's findings and the rollback, read through the collector.
The dashboard, reading the collector, shows the run as it happens and stays up afterwards until Ctrl-C
(`--no-dashboard`: the demo ends with the job, whose start says how to start a dashboard)."""

import os
import subprocess
import sys
import time
import webbrowser
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pandas as pd

from collector.receive.auth import load_or_create_token
from collector.reports.query import write
from dashboard.serve import HOST as DASHBOARD_HOST
from dashboard.source import CollectorSource, to_frame
from rankwatch.agent.config import DASHBOARD_PORT, QUERY, TOKEN_ENV, scoped_token
from rankwatch.launch import listening, train, wait_healthy

MIN_STEPS = 50  # the fewest steps that show both faults, each found and answered
DASHBOARD_START_S = 60.0  # the longest the job waits for the dashboard to serve


def faults(steps: int) -> tuple[int, int, list[str]]:
    """(the straggler's first step, the spike's step, the faults): the straggler from a fifth of the run,
    the loss spike at three quarters, so a demo of any length shows both and the rollback after."""
    slow_from, spike_at = steps // 5, steps * 3 // 4
    return slow_from, spike_at, [f"straggler:rank=2,slowdown=2,from={slow_from}", f"spike:at={spike_at},scale=50"]


def ckpt_every(steps: int) -> int:
    """Steps between the checkpoints the demo's job writes to disk: four or more over a short demo (the
    trainer's default, every 100 steps, would leave a demo of 50 steps none), every 100 steps at most."""
    return max(10, min(100, steps // 4 // 10 * 10))  # a multiple of the trainer's snapshots, every 10 steps


ROLLBACKS = """
SELECT args->>'$.anomaly' AS anomaly, state, json_extract(result, '$.from_step') AS at_step,
       json_extract(result, '$.restored_step') AS restored_step,
       json_extract(result, '$.skipped_batches') AS skipped_batches,
       round(CAST(json_extract(result, '$.latency_s') AS DOUBLE), 1) AS latency_s
FROM commands WHERE run_id = ? AND kind = 'rollback' ORDER BY id
"""
# The collector's own findings of the run, as it recorded them live (what could not be judged and the power
# recommendations left out): the demo reads its conclusions, it does not draw its own.
FINDINGS = """
SELECT severity, summary FROM findings
WHERE run_id = ? AND kind <> 'not_judged' AND severity <> 'info'
ORDER BY severity = 'critical' DESC, step_start, id
"""
SUMMARY = """
SELECT rank,
       count(*) AS steps,
       round(median(duration_s) * 1e3, 1) AS step_ms,
       round(median(compute_s) * 1e3, 1) AS compute_ms,
       round(median(comm_wait_s) * 1e3, 1) AS comm_wait_ms,
       round(sum(tokens) / sum(duration_s)) AS tokens_per_s
FROM current_steps WHERE run_id = ? AND step >= ? GROUP BY rank ORDER BY rank
"""


def run(db: Path, steps: int, port: int, dashboard_port: int | None = DASHBOARD_PORT) -> None:
    """The demo, end to end; `dashboard_port` None: without the dashboard."""
    token = load_or_create_token(db.parent)
    reader = scoped_token(token, QUERY)  # what the dashboard and the summary need: they only read
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, TOKEN_ENV: token}
    run_id = time.strftime("demo-%Y%m%d-%H%M%S")
    slow_from, spike_at, injected = faults(steps)
    try:
        with ExitStack() as processes:
            collector = processes.enter_context(
                _stopping(
                    subprocess.Popen(
                        [
                            sys.executable,
                            "-m",
                            "rankwatch",
                            "collector",
                            "--db",
                            str(db),
                            "--port",
                            str(port),
                            "--analyze-every",
                            "1",
                        ],
                        env=env,
                    )
                )
            )
            wait_healthy(url, collector)
            if dashboard_port is not None:
                dashboard = processes.enter_context(
                    _stopping(
                        subprocess.Popen(
                            [
                                sys.executable,
                                "-m",
                                "rankwatch",
                                "dashboard",
                                "--collector",
                                url,
                                "--db",
                                str(db),
                                "--port",
                                str(dashboard_port),
                            ],
                            env={**env, TOKEN_ENV: reader},
                        )
                    )
                )
                _open(f"http://{DASHBOARD_HOST}:{dashboard_port}", run_id, dashboard)
            print(
                f"rankwatch demo: run {run_id}, 4 ranks x {steps} steps, injecting {' and '.join(injected)}", flush=True
            )
            status = train(
                nproc=4,
                steps=steps,
                run_id=run_id,
                faults=injected,
                collector=url,
                token=token,
                store=db,
                trainer_args=["--ckpt-every", str(ckpt_every(steps))],
            )
            if status:
                sys.exit(f"rankwatch demo: the training job failed (exit status {status})")
            time.sleep(2)  # an analysis pass (every 1 s) over the final steps, before the summary reads them
            _summarize(CollectorSource(url, reader), run_id, slow_from, spike_at)
            if dashboard_port is not None:
                print(
                    f"\nThe dashboard stays up at http://{DASHBOARD_HOST}:{dashboard_port}/?run={run_id}, reading "
                    "the collector; Ctrl-C stops both.",
                    flush=True,
                )
                collector.wait()
    except KeyboardInterrupt:  # the collector and the dashboard are stopped on the way out
        print()
    print(f"The store is {db}; try: rankwatch query \"SELECT * FROM steps WHERE run_id = '{run_id}' LIMIT 5\"")


def _summarize(collector: CollectorSource, run_id: str, slow_from: int, spike_at: int) -> None:
    """The per-rank table, the collector's findings and the rollback, read through the collector."""

    def table(sql: str, *params) -> pd.DataFrame:
        return to_frame(collector.query(sql, [run_id, *params]))

    print(f"\nPer rank, steps {slow_from} onwards (the straggler is rank 2):")
    _write(table(SUMMARY, slow_from))
    print("\nWhat the collector found, worst first (as the dashboard's Overview lists it):")
    found = table(FINDINGS)
    for finding in found.itertuples():
        print(f"  [{finding.severity}] {finding.summary}")
    if found.empty:
        print("  nothing")
    rollbacks = table(ROLLBACKS)
    print(f"\nThe loss spike at step {spike_at}, rolled back by the collector ({len(rollbacks)} rollback):")
    _write(rollbacks)


def _write(frame: pd.DataFrame) -> None:
    write(list(frame.columns), list(frame.itertuples(index=False)), "table")


@contextmanager
def _stopping(process: subprocess.Popen):
    """`process`, stopped (SIGTERM, then waited for) however the block ends."""
    try:
        yield process
    finally:
        process.terminate()
        process.wait()


def _open(address: str, run_id: str, dashboard: subprocess.Popen) -> None:
    """Once the dashboard serves (the job's start names it then, too), say where it is, and open it in a
    browser where there is a screen to show it on."""
    deadline = time.monotonic() + DASHBOARD_START_S
    while not listening(address) and dashboard.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    url = f"{address}/?run={run_id}"
    print(f"rankwatch demo: the dashboard is at {url}", flush=True)
    if sys.platform == "darwin" or os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"):
        webbrowser.open(url)
