"""Post-mortem at scale: import a simulated op trace and analyze it, against plain DuckDB.

The fleet simulator writes a 1,024-rank x 100-step op trace (Parquet, three ops per
rank-step); then, each as a process of its own, timed by wall clock and measured for
peak memory (the child's max RSS):

  import    `rankwatch import ops` (checks, kinds, placement, steps derived, one transaction)
  baseline  DuckDB loading the same Parquet file into a table, nothing else
  analyze   `rankwatch analyze RUN --json` (what-if analysis and the findings of the whole run)
  baseline  DuckDB reading the run's rank-steps into a pandas frame, nothing else

Usage: python bench/import_analyze.py [--ranks 1024] [--steps 100]
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
RUN = "bench-import"


def measured(*command: str) -> tuple[float, float]:
    """(wall seconds, peak RSS in MiB) of a command run as a child process."""
    started = time.perf_counter()
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(process.pid, 0)
    wall = time.perf_counter() - started
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"{' '.join(command)} failed: {process.stderr.read().decode()}")
    return wall, usage.ru_maxrss / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    python, console = sys.executable, Console()
    with tempfile.TemporaryDirectory() as tmp:
        trace, db, raw = Path(tmp) / "trace.parquet", Path(tmp) / "store.duckdb", Path(tmp) / "raw.duckdb"
        subprocess.run(
            [
                python,
                "-m",
                "rankwatch",
                "simulate",
                "--ranks",
                str(args.ranks),
                "--pp",
                "8",
                "--steps",
                str(args.steps),
                "--out",
                str(trace),
                "--inject",
                "straggler:rank=300,slowdown=1.2,from=30",
            ],
            cwd=ROOT,
            check=True,
            capture_output=True,
        )
        import pyarrow.parquet as pq

        rows = pq.ParquetFile(trace).metadata.num_rows
        console.print(
            f"{args.ranks} ranks x {args.steps} steps: {rows:,} ops, {trace.stat().st_size / 2**20:.1f} MiB "
            f"Parquet, {os.cpu_count()} cores"
        )
        results = {
            "import (rankwatch import ops)": measured(
                python, "-m", "rankwatch", "import", "ops", str(trace), "--run", RUN, "--db", str(db)
            ),
            "baseline: DuckDB loads the Parquet": measured(
                python,
                "-c",
                f"import duckdb; duckdb.connect({str(raw)!r}).execute("
                f"\"CREATE TABLE t AS SELECT * FROM read_parquet('{trace}')\")",
            ),
            "analyze (rankwatch analyze --json)": measured(
                python, "-m", "rankwatch", "analyze", RUN, "--db", str(db), "--json"
            ),
            "baseline: DuckDB reads the rank-steps": measured(
                python,
                "-c",
                f"import duckdb; duckdb.connect({str(db)!r}, read_only=True).execute("
                f"\"SELECT * FROM steps WHERE run_id = '{RUN}'\").df()",
            ),
        }
    table = Table("job", "seconds", "ops/s", "peak memory MiB")
    for name, (wall, rss) in results.items():
        table.add_row(
            name,
            f"{wall:.2f}",
            f"{rows / wall:,.0f}" if "analyze" not in name and "steps" not in name else "",
            f"{rss:.0f}",
        )
    console.print(table)
    (imp, _), (base, _) = results["import (rankwatch import ops)"], results["baseline: DuckDB loads the Parquet"]
    (ana, _) = results["analyze (rankwatch analyze --json)"]
    (read, _) = results["baseline: DuckDB reads the rank-steps"]
    console.print(
        f"import takes {imp / base:.1f}x the baseline load; analyze {ana / read:.1f}x reading its input "
        f"(both include starting Python)"
    )


if __name__ == "__main__":
    main()
