"""`rankwatch demo`: a collector and a 4-rank training job with an injected straggler and a
loss spike, wired together on loopback: the collector finds the straggler and rolls the spike
back; then a per-rank summary and the rollback from the store."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd

from collector.analyzers import stragglers
from collector.auth import load_or_create_token
from collector.query import run_sql, write
from rankwatch.launch import train, wait_healthy

STRAGGLER = "straggler:rank=2,slowdown=1.5,from=40"
SPIKE = "spike:at=150,scale=50"
# snapshots every 10 steps, 16 kept in memory: a rollback can reach 160 steps back, past the
# few seconds between the spike and the rollback command
TRAINER_ARGS = ["--ckpt-memory", "16"]
ROLLBACKS = """
SELECT args->>'$.anomaly' AS anomaly, state, json_extract(result, '$.from_step') AS at_step,
       json_extract(result, '$.restored_step') AS restored_step,
       json_extract(result, '$.skipped_batches') AS skipped_batches,
       round(CAST(json_extract(result, '$.latency_s') AS DOUBLE), 1) AS latency_s
FROM commands WHERE run_id = ? AND kind = 'rollback' ORDER BY id
"""
SUMMARY = """
SELECT rank,
       count(*) AS steps,
       round(median(duration_s) * 1e3, 1) AS step_ms,
       round(median(compute_s) * 1e3, 1) AS compute_ms,
       round(median(comm_wait_s) * 1e3, 1) AS comm_wait_ms,
       round(sum(tokens) / sum(duration_s)) AS tokens_per_s
FROM current_steps WHERE run_id = ? AND step >= 40 GROUP BY rank ORDER BY rank
"""


def frame(db: Path, sql: str, run_id: str) -> pd.DataFrame:
    columns, rows = run_sql(db, sql, [run_id])
    return pd.DataFrame(rows, columns=columns)


def run(db: Path, steps: int, port: int) -> None:
    token = load_or_create_token(db.parent)
    url = f"http://127.0.0.1:{port}"
    collector = subprocess.Popen([sys.executable, "-m", "rankwatch", "collector", "--db", str(db),
                                  "--port", str(port), "--analyze-every", "1"],
                                 env={**os.environ, "RANKWATCH_TOKEN": token})
    run_id = time.strftime("demo-%Y%m%d-%H%M%S")
    try:
        wait_healthy(url, collector)
        print(f"rankwatch demo: run {run_id}, 4 ranks x {steps} steps, injecting {STRAGGLER} and {SPIKE}",
              flush=True)
        status = train(nproc=4, steps=steps, run_id=run_id, faults=[STRAGGLER, SPIKE], collector=url, token=token,
                       trainer_args=TRAINER_ARGS)
    finally:
        collector.terminate()
        collector.wait()
    if status:
        sys.exit(f"rankwatch demo: the training job failed (exit status {status})")
    columns, rows = run_sql(db, SUMMARY, [run_id])
    print("\nPer rank, steps 40 onwards (the straggler is rank 2):")
    write(columns, rows, "table")
    print("\nWhat the straggler analyzer finds over the last 50 steps:")
    for finding in stragglers.analyze(frame(db, "SELECT * FROM current_steps WHERE run_id = ?", run_id),
                                      frame(db, "SELECT * FROM ranks WHERE run_id = ?", run_id),
                                      stragglers.Settings(window=50)) or ["nothing"]:
        print(f"  [{finding.severity}] {finding.summary}" if finding != "nothing" else "  nothing")
    columns, rows = run_sql(db, ROLLBACKS, [run_id])
    print(f"\nThe loss spike at step 150, rolled back by the collector ({len(rows)} rollback):")
    write(columns, rows, "table")
    print(f"The store is {db}; try: rankwatch query \"SELECT * FROM steps WHERE run_id = '{run_id}' LIMIT 5\"")
