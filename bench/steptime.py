"""The step-time model on real runs: NCPP against its baselines, each run held out in turn.

Runs the reference trainer (`rankwatch train`, gloo on this machine's CPU) under configurations that
change what a step costs for real: model size, batch, ranks, and CPU stressors beside the job (busy
processes: what a data loader or another job on the host does to it). All of them go to one real
collector; then NCPP is fitted on the rank-steps' grouped features (collector/predict/steptime.py)
and judged, with the per-workload median, ridge, boosted trees and the analytic model (work / clock),
on each run held out in turn (`rankwatch model fit`'s judgement). A held-out run's configuration is
one the fit never saw: the stressed runs' share of the host is what tells them apart.

Prints MAPE, P90, share within 5% and R² (log) per predictor; the last line is one JSON object.
`--save FILE` keeps the fitted model (for `rankwatch analyze --model`); `--db` keeps the store.

Usage: python bench/steptime.py [--steps 30] [--epochs 60] [--save FILE] [--db FILE]
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
TOKEN = "bench-token-0123456789"
# (model, batch, ranks, stressors): each a run; the stressors are busy processes on the host
CONFIGS = [
    ("tiny", 8, 2, 0),
    ("tiny", 16, 2, 0),
    ("tiny", 4, 2, 0),
    ("tiny", 8, 1, 0),
    ("tiny", 8, 2, 1),
    ("tiny", 16, 2, 2),
    ("small", 4, 2, 0),
    ("small", 8, 2, 0),
    ("small", 4, 2, 2),
    ("tiny", 4, 2, 2),
]


def collect(db: Path, steps: int) -> list[str]:
    """Every configuration's run, through one collector into `db`; their run ids."""
    from rankwatch.launch import train, wait_healthy

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    collector = subprocess.Popen(
        [sys.executable, "-m", "rankwatch", "collector", "--db", str(db), "--port", str(port), "--token", TOKEN],
        stdout=subprocess.DEVNULL,
    )
    runs = []
    try:
        wait_healthy(url, collector)
        for model, batch, ranks, stressors in CONFIGS:
            run = f"steptime-{model}-b{batch}-n{ranks}-s{stressors}"
            busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(stressors)]
            try:
                status = train(
                    nproc=ranks,
                    steps=steps,
                    run_id=run,
                    collector=url,
                    token=TOKEN,
                    store=db,
                    model=model,
                    trainer_args=["--batch", str(batch)],
                )
            finally:
                for p in busy:
                    p.kill()
                    p.wait()
            if status == 0:
                runs.append(run)
            else:
                print(f"{run}: the job ended with status {status}; left out", file=sys.stderr)
    finally:
        collector.terminate()
        collector.wait()
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--epochs", type=int, default=60)
    parser.add_argument("--save", type=Path)
    parser.add_argument("--db", type=Path, help="keep the store here (an existing one is read, not run again)")
    args = parser.parse_args()

    import duckdb
    from rich.console import Console
    from rich.table import Table

    from collector.predict import stepmodel

    with tempfile.TemporaryDirectory() as tmp:
        db = args.db or Path(tmp) / "rankwatch.duckdb"
        if db.exists():
            with duckdb.connect(str(db), read_only=True) as con:
                runs = [r for (r,) in con.execute("SELECT run_id FROM runs WHERE run_id LIKE 'steptime-%'").fetchall()]
        else:
            runs = collect(db, args.steps)
        with duckdb.connect(str(db), read_only=True) as con:
            features, target = stepmodel.table(con, runs)
            figures, best = stepmodel.judge(features, target, args.epochs)
            if args.save:
                stepmodel.fit(con, runs, args.epochs).save(args.save)
    console = Console(width=110)
    console.print(f"{len(runs)} runs, {len(target)} rank-steps on {os.cpu_count()} CPUs; each run held out in turn")
    table = Table("predictor", "MAPE %", "P90 %", "within 5%", "R² (log)")
    for name, m in figures.items():
        table.add_row(name, f"{m['mape']:.1f}", f"{m['p90']:.1f}", f"{m['within5']:.0%}", f"{m['r2_log']:.3f}")
    console.print(table)
    print(
        json.dumps(
            {
                "ncpp_mape": figures["ncpp"]["mape"],
                "best_baseline": best,
                "best_baseline_mape": figures[best]["mape"],
                "runs": len(runs),
                "rank_steps": len(target),
                "figures": figures,
            }
        )
    )


if __name__ == "__main__":
    main()
