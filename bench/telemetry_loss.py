"""What counting lost telemetry costs: the live passes over one run of `--ranks` ranks, a quarter of
them silent from a third of the way in and one rank-step in a thousand lost at random, on a DuckDB
file. Prints each pass's time (a window of at most 2^18 rank-steps), the final pass at the run's end,
and `rankwatch analyze`'s whole-run count, with the counts checked against a count of every rank-step.

Usage: python bench/telemetry_loss.py [--ranks 16384] [--steps 64]
"""

import argparse
import sys
import tempfile
import time
from pathlib import Path

import duckdb

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from collector.analysis import losses
from collector.store.schema import DDL

FILL = """INSERT INTO steps (run_id, rank, step, start_ts, end_ts, duration_s)
          SELECT 'run', r.range, s.range, make_timestamp_ns(s.range * 1000000000),
                 make_timestamp_ns(s.range * 1000000000 + 900000000), 0.9 FROM range($ranks) r, range($steps) s
          WHERE NOT (r.range >= $ranks * 3 // 4 AND s.range >= $steps // 3) AND hash(r.range, s.range) % 1000 != 0"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=16384)
    parser.add_argument("--steps", type=int, default=64)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory, duckdb.connect(f"{directory}/store.duckdb") as con:
        con.execute(DDL)
        con.execute(
            "INSERT INTO ranks (run_id, rank, first_seen) SELECT 'run', range, now() FROM range(?)", [args.ranks]
        )
        con.execute(FILL, {"ranks": args.ranks, "steps": args.steps})
        present = con.execute("SELECT count(*) FROM steps").fetchall()[0][0]
        print(f"{args.ranks} ranks x {args.steps} steps, {present:,} rank-steps stored")
        settled = None
        while True:
            started = time.perf_counter()
            gaps = losses.record(con, "run").gaps
            print(f"pass: {time.perf_counter() - started:.2f} s, settled through step {gaps.settled_step}")
            if gaps.settled_step == settled:
                break
            settled = gaps.settled_step
        started = time.perf_counter()
        gaps = losses.record(con, "run", final=True).gaps
        print(f"final pass: {time.perf_counter() - started:.2f} s; {gaps.summary()}; {len(gaps.blocks)} blocks kept")
        started = time.perf_counter()
        whole = losses.measure(con, "run").gaps
        print(f"whole run (analyze): {time.perf_counter() - started:.2f} s")
        assert gaps.missing == whole.missing == args.ranks * args.steps - present


if __name__ == "__main__":
    main()
