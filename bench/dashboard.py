"""The dashboard at scale: page render time and named-query time, against raw DuckDB.

A store is filled straight from the fleet simulator's model (trainer/simulate.py:
its rank-steps, the tensor- and data-parallel all-reduces of each rank-step as
`ops`, three device samples per rank-step, a straggler and a throttled rank)
with one bulk insert per table, then the run's findings are drawn by the
post-mortem analyzers. Then, on that store:

  baseline   each named query of dashboard/queries.py, straight on a read-only DuckDB
             connection (fetchall), nothing else
  file       the same query through the dashboard's file source: the read-only checks,
             a READ ONLY transaction on its own cursor, values made JSON-ready, a DataFrame
  api        the same through a running collector's query API (the collector holds the
             store: its writer process runs the query on a query thread, one DuckDB thread)
  page       each dashboard page rendered by Streamlit's AppTest on the file source, its
             query cache cleared first (what a person waits for on a first visit, less the
             browser's drawing)

Usage: python bench/dashboard.py [--ranks 1024] [--steps 2000] [--tp 8] [--no-api]
"""

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import duckdb
import numpy as np
import pandas as pd
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from collector.reports.postmortem import analyze_run  # noqa: E402
from collector.store.schema import DDL  # noqa: E402
from dashboard import queries, source, ui  # noqa: E402
from rankwatch.agent import semconv as sc  # noqa: E402
from trainer import simulate  # noqa: E402
from trainer.faults import parse  # noqa: E402

RUN = "bench-dashboard"
PAGES = tuple(sorted(page.stem for page in (ROOT / "dashboard" / "views").glob("*.py")))  # every page
REPEATS = 3


def fill(db: Path, ranks: int, steps: int, tp: int) -> float:
    """The store of one simulated run; returns the seconds it took."""
    started = time.perf_counter()
    topology = simulate.Topology(ranks // tp, 1, tp)
    faults = [
        parse(spec, simulate.SIMULATOR_KINDS)
        for spec in (f"straggler:rank={ranks // 3},slowdown=1.3,from={steps // 4}", f"thermal:rank={ranks // 2},from=0")
    ]
    con = duckdb.connect(str(db))
    con.execute(DDL)
    place = topology.placement()
    con.execute("INSERT INTO runs VALUES (?, ?, now())", [RUN, ranks])
    _insert(
        con,
        "ranks",
        place.assign(
            run_id=RUN, host=place["host"].map("sim-node-{:04d}".format), first_seen=pd.Timestamp.now(tz="UTC")
        ),
    )
    dp_group, tp_group = topology.dp_groups(), topology.tp_groups()
    t = simulate.Timing()
    for frames in _chunks(simulate.steps(topology, steps, faults), max(1, 2_000_000 // ranks)):
        f = pd.concat(frames, ignore_index=True)
        start = pd.to_datetime(f["start_ns"], unit="ns")
        _insert(
            con,
            "steps",
            pd.DataFrame(
                {
                    "run_id": RUN,
                    "rank": f["rank"],
                    "step": f["step"],
                    "start_ts": start,
                    "end_ts": pd.to_datetime(f["end_ns"], unit="ns"),
                    "duration_s": f["duration_s"],
                    "data_s": f["data_s"],
                    "compute_s": f["compute_s"],
                    "comm_wait_s": f["comm_wait_s"],
                    "tokens": 4096,
                }
            ),
        )
        entered = f["start_ns"] + ((f["data_s"] + f["compute_s"]) * 1e9).astype("int64")
        tp_done = entered + (f["tp_allreduce_s"] * 1e9).astype("int64")
        dp_done = f["start_ns"] + (f["allreduce_done_s"] * 1e9).astype("int64")
        tp_names = "tp" + pd.Series(tp_group[f["rank"]]).astype(str)
        dp_names = "dp" + pd.Series(dp_group[f["rank"]]).astype(str)
        _insert(
            con,
            "ops",
            pd.concat(
                [
                    _collective(f, tp_names, tp, t.tp_allreduce_bytes, entered, tp_done),
                    _collective(f, dp_names, ranks // tp, t.allreduce_bytes, tp_done, dp_done),
                ]
            ),
        )
        end = pd.to_datetime(f["end_ns"], unit="ns")
        _insert(
            con,
            "device_samples",
            pd.concat(
                [
                    pd.DataFrame(
                        {
                            "run_id": RUN,
                            "rank": f["rank"],
                            "ts": end,
                            "metric": metric,
                            "value": f[column],
                            "source": "simulated",
                        }
                    )
                    for metric, column in (
                        (sc.SM_CLOCK_MHZ, "sm_clock_mhz"),
                        (sc.GPU_TEMP_C, "temp_c"),
                        (sc.CLOCK_EVENT_REASONS, "clock_event_reasons"),
                    )
                ]
            ),
        )
    found = analyze_run(con, RUN).findings
    for finding in found:
        con.execute(
            "INSERT INTO findings (run_id, analyzer, kind, ranks, step_start, step_end, severity, score, "
            "summary, evidence, state) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 'firing')",
            [
                RUN,
                finding.analyzer,
                finding.kind,
                finding.ranks,
                finding.step_start,
                finding.step_end,
                finding.severity,
                finding.score,
                finding.summary,
                _json(finding.evidence),
            ],
        )
    con.execute("CHECKPOINT")
    con.close()
    return time.perf_counter() - started


def _insert(con: duckdb.DuckDBPyConnection, table: str, frame: pd.DataFrame) -> None:
    con.register("batch", frame)
    con.execute(f"INSERT INTO {table} BY NAME SELECT * FROM batch")
    con.unregister("batch")


def _chunks(frames, size: int):
    batch = []
    for frame in frames:
        batch.append(frame)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def _collective(
    f: pd.DataFrame, groups: pd.Series, size: int, nbytes: int, start: pd.Series, end: pd.Series
) -> pd.DataFrame:
    duration = (end - start) / 1e9
    algbw = nbytes / duration.clip(lower=1e-9) / 1e9
    factor = 2 * (size - 1) / size
    return pd.DataFrame(
        {
            "run_id": RUN,
            "rank": f["rank"],
            "step": f["step"],
            "kind": "comm",
            "name": "all_reduce",
            "start_ts": pd.to_datetime(start, unit="ns"),
            "end_ts": pd.to_datetime(end, unit="ns"),
            "duration_s": duration,
            "comm_group": groups.to_numpy(),
            "group_size": size,
            "seq": f["step"],
            "bytes": nbytes,
            "algbw_gbps": algbw,
            "busbw_gbps": algbw * factor,
        }
    )


def _json(value) -> str:
    import json

    return json.dumps(value, default=lambda v: v.item() if isinstance(v, np.generic) else str(v))


def parameters(con: duckdb.DuckDBPyConnection) -> dict[str, dict]:
    """Each named query's parameters, as the pages pass them: every `$name` its SQL uses, from one table of
    the pages' values (a query's own where pages pass it another), so that a query added later needs no
    line here unless it takes a parameter no page passed before."""
    (last,) = con.execute("SELECT max(step) FROM steps WHERE run_id = ?", [RUN]).fetchone()
    values = {
        "run": RUN,
        "first": ui.EVERY_STEP[0],  # every step, as the pages ask by default
        "last": ui.EVERY_STEP[1],
        "points": ui.POINTS,
        "rank_bins": ui.RANK_BINS,
        "step_bins": ui.STEP_BINS,
        "ranks": [],
        "limit": 50,
        "window": 21,
        "step": last,
        "slowest": 8,
        "typical": 4,
    }
    own = {
        "slowest_ranks": {"limit": 10},
        "slowest_groups": {"limit": 8},
        "suspects_vs_peers": {"ranks": [0]},
    }
    named = {}
    for name, sql in queries.QUERIES.items():
        wanted = set(re.findall(r"\$([a-z_]+)", sql))
        unknown = wanted - values.keys()
        if unknown:
            raise SystemExit(f"bench/dashboard.py: no value for ${', $'.join(sorted(unknown))} of the {name} query")
        named[name] = {key: own.get(name, {}).get(key, values[key]) for key in wanted}
    return named


def timed(call) -> float:
    """Median seconds of REPEATS calls."""
    times = []
    for _ in range(REPEATS):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def page_times(db: Path) -> dict[str, float]:
    """Seconds each page takes to render in AppTest, its query cache cleared first (median of REPEATS)."""
    import streamlit as st
    from streamlit.testing.v1 import AppTest

    os.environ[source.DB_ENV] = str(db)
    at = AppTest.from_file(str(ROOT / "dashboard" / "app.py"), default_timeout=120)
    at.run()
    at.selectbox(key="run").set_value(RUN)
    results = {}
    for page in PAGES:
        at.switch_page(f"views/{page}.py")

        def render():
            st.cache_data.clear()
            at.run()
            assert not at.exception, [e.value for e in at.exception]

        results[page] = timed(render)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--no-api", action="store_true", help="leave out the query API column")
    args = parser.parse_args()
    console = Console()
    with tempfile.TemporaryDirectory(prefix="rankwatch-bench-") as tmp:
        db = Path(tmp) / "rankwatch.duckdb"
        seconds = fill(db, args.ranks, args.steps, args.tp)
        raw = duckdb.connect(str(db), read_only=True)
        rows = raw.execute(
            "SELECT (SELECT count(*) FROM steps), (SELECT count(*) FROM ops), (SELECT count(*) FROM device_samples)"
        ).fetchone()
        console.print(
            f"{args.ranks} ranks x {args.steps} steps: {rows[0]:,} rank-steps, {rows[1]:,} ops, "
            f"{rows[2]:,} device samples, filled in {seconds:.1f} s"
        )
        params = parameters(raw)
        baseline = {
            name: timed(lambda: raw.execute(sql, params[name]).fetchall()) for name, sql in queries.QUERIES.items()
        }
        raw.close()
        through_api = {} if args.no_api else api_times(db, params)  # first: the collector opens the file to write
        files = source.FileSource(db)
        through_file = {
            name: timed(lambda: source.to_frame(files.query(sql, params[name])))
            for name, sql in queries.QUERIES.items()
        }
        pages = page_times(db)
    table = Table(
        "named query",
        "baseline (DuckDB) ms",
        "file source ms",
        "query API ms",
        title=f"{args.ranks} ranks x {args.steps} steps: query time (median of {REPEATS})",
    )
    for name in queries.QUERIES:
        table.add_row(
            name,
            f"{1000 * baseline[name]:.1f}",
            f"{1000 * through_file[name]:.1f}",
            f"{1000 * through_api[name]:.1f}" if name in through_api else "-",
        )
    console.print(table)
    table = Table("page", "render s (AppTest, cold cache)", title="page render time")
    for page, s in pages.items():
        table.add_row(page, f"{s:.2f}")
    console.print(table)


def api_times(db: Path, params: dict[str, dict]) -> dict[str, float]:
    """Each named query's time through a collector's query API, the collector holding the store."""
    from collector.reports import queryapi
    from rankwatch.agent.apiclient import ApiClient
    from rankwatch.launch import wait_healthy

    port, token = 4400 + os.getpid() % 1000, "bench-token-0123456789"
    with open(db.parent / "collector.log", "w") as log:
        collector = subprocess.Popen(
            [sys.executable, "-m", "rankwatch", "collector", "--db", str(db), "--port", str(port), "--token", token],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            wait_healthy(f"http://127.0.0.1:{port}", collector)
            api = ApiClient(f"http://127.0.0.1:{port}", token)
            return {
                name: timed(lambda: source.to_frame(queryapi.remote_query(api, sql, params[name])))
                for name, sql in queries.QUERIES.items()
            }
        finally:
            collector.terminate()
            collector.wait(timeout=60)


if __name__ == "__main__":
    main()
