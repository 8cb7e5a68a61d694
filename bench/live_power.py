"""What the collector's live power analysis costs its writer: the writer blocked per pass that
draws a run's power report, and the writer's commits while one is being drawn.

A store holds a 1,024-rank simulated run of 100 steps with its GPUs' power samples, sent
through a real collector (`rankwatch simulate --collector`). In this process, on that store, as
the writer process runs them:

  inline   the report drawn on the writer's thread, between commits (what the writer did before
           the power thread: every commit waits for it)
  thread   `Analysis.run`, which starts the report on the power thread and returns, against
           the same pass without power (the other analyzers); the pass after the report is
           drawn, one analysis period (1 s here) apart, records its findings
  commits  small appends and commits, as the writer makes them between passes, timed while
           nothing else runs and while the power thread draws a report

Usage: python bench/live_power.py [--ranks 1024] [--steps 100] [--repeat 3]
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.progress import track
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from collector.alerts.config import AlertConfig
from collector.alerts.outbox import Outbox
from collector.analysis import findings
from collector.analysis import live as analysis
from collector.analysis.analyzers import power
from collector.reports import powercaps
from collector.store.db import connect
from rankwatch.launch import wait_healthy
from tests.support.collectors import free_port

RUN, TOKEN = "bench-live-power", "bench-token-0123456789"
PASS_S = 1.0  # the analysis period (`rankwatch collector --analyze-every`)


def fill(db: Path, ranks: int, steps: int) -> None:
    """The run, through a real collector that draws no power reports itself."""
    port = free_port()
    env = {**os.environ, "RANKWATCH_TOKEN": TOKEN}
    rankwatch = [sys.executable, "-m", "rankwatch"]
    collector = subprocess.Popen(
        [*rankwatch, "collector", "--db", str(db), "--port", str(port), "--power-every", "0"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_healthy(f"http://127.0.0.1:{port}", collector)
        subprocess.run(
            [
                *rankwatch,
                "simulate",
                "--ranks",
                str(ranks),
                "--steps",
                str(steps),
                "--run",
                RUN,
                "--collector",
                f"http://127.0.0.1:{port}",
            ],
            env=env,
            check=True,
            stdout=subprocess.DEVNULL,
        )
    finally:
        collector.terminate()
        collector.wait()


def commit(con) -> float:
    """Seconds to append one small event row and commit it, as the writer commits a group."""
    started = time.perf_counter()
    con.execute("BEGIN")
    con.execute(
        "INSERT INTO events (run_id, rank, ts, event, attrs) "
        "VALUES ('bench-commits', 0, now()::TIMESTAMP, 'tick', '{}')"
    )
    con.execute("COMMIT")
    return time.perf_counter() - started


def power_findings(con) -> int:
    return con.execute("SELECT count(*) FROM findings WHERE analyzer = 'power'").fetchone()[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    console = Console(width=150)
    others, inline, blocked, drawn, quiet, during = [], [], [], [], [], []
    with tempfile.TemporaryDirectory() as directory:
        db = Path(directory) / "rankwatch.duckdb"
        with console.status(f"sending {args.ranks} ranks x {args.steps} steps through a collector"):
            fill(db, args.ranks, args.steps)
        con = connect(db)
        con.execute("SET threads TO 1")  # as the writer
        warm = analysis.Analysis(power_every_s=None)  # first queries pay for loading the store
        warm.touched([RUN], steps=True)
        warm.run(con)
        for _ in track(range(args.repeat), description="drawing power reports", console=console):
            started = time.perf_counter()
            report = powercaps.live_report(con, RUN)  # what a pass did before the power thread
            findings.record(con, RUN, power.ANALYZER, report.findings, [Outbox(AlertConfig())])
            inline.append(time.perf_counter() - started)
            for _ in range(100):
                quiet.append(commit(con))
                time.sleep(0.005)

            bare = analysis.Analysis(power_every_s=None)  # the pass's other analyzers
            bare.touched([RUN], steps=True)
            started = time.perf_counter()
            bare.run(con)
            others.append(time.perf_counter() - started)

            con.execute("DELETE FROM findings WHERE analyzer = 'power'")
            live = analysis.Analysis(interval_s=PASS_S, power_report=powercaps.live_report, power_every_s=3600)
            live.touched([RUN], steps=True)
            started = time.perf_counter()
            live.run(con)
            blocked.append(time.perf_counter() - started)
            while not power_findings(con):  # the writer commits on while the power thread draws
                during.append(commit(con))
                time.sleep(0.005)
                if not live.due_in():
                    live.run(con)
            drawn.append(time.perf_counter() - started)
            live.close()
        con.close()

    def ms(values: list[float], q: float = 0.5) -> str:
        value = sorted(values)[round(q * (len(values) - 1))]
        return f"{1e3 * value:,.0f} ms" if abs(value) >= 0.01 else f"{1e3 * value:.2f} ms"

    console.print(f"{args.ranks} ranks x {args.steps} steps, {args.repeat} reports each way (medians)")
    table = Table(
        "the writer's analysis pass",
        "writer blocked",
        "findings recorded after",
        "commit p50",
        "commit p99",
        "commit max",
    )
    table.add_row("without power", ms(others), "", "", "", "")
    table.add_row("+ the power report inline (before the power thread)", f"+ {ms(inline)}", ms(inline), "", "", "")
    table.add_row(
        "+ the power report started on the power thread",
        f"+ {ms([b - o for b, o in zip(blocked, others)])}",
        ms(drawn),
        "",
        "",
        "",
    )
    table.add_row("commits, nothing drawing", "", "", ms(quiet), ms(quiet, 0.99), ms(quiet, 1.0))
    table.add_row("commits while the power thread draws", "", "", ms(during), ms(during, 0.99), ms(during, 1.0))
    console.print(table)


if __name__ == "__main__":
    main()
