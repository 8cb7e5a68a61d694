"""Collectors sharing one lake (collector/store/lake.py): what N collectors commit together, how soon a step
is judged after its commit, and what a collector killed mid-run costs.

For each count of collectors (`--shards`, default 0 1 2 4; 0 is the baseline, one collector storing into
its DuckDB file, no lake): a PostgreSQL server on loopback (the lake's
catalog; tests/support/postgres.py), N `rankwatch collector --lake` processes on one data directory, and a
simulated job of `--ranks` ranks x `--steps` steps sent to all of them (`--collector A,B,...`: each
node's ranks to one collector), rank 3 a straggler. The simulator sends as fast as the collectors take
it (simulated time runs ahead of the clock), so the rate is the most these collectors commit here.
With 2 collectors or more, the one leading the run's analysis is killed (-9) once a third of the
rank-steps are stored: its ranks move to another collector, which takes the run's analysis over.

Printed per count: committed spans/s (in all and per collector), the collectors' CPU per committed
span, the lag from a step's commit (every rank of it stored) to the step's judgement (the run's
analysis cursor past it), sampled every 0.2 s, median and p95; rank-steps lost and stored twice; the
lake's Parquet files before and after compaction (DuckLake's merge of adjacent files, its old
snapshots expired and files cleaned up). The last line is one JSON object for the last count run:
shards, ranks, steps, spans_per_s, spans_per_s_per_shard (the spans each collector stored over the
run's time), cpu_us_per_span, judge_lag_s (median), judge_lag_p95_s, lost_rows, duplicate_rows,
files_before, files_after, killed.

Usage: python bench/scaleout.py [--shards 0 1 2 4] [--ranks 16384] [--steps 20]
"""

import argparse
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from collector.store import lake  # noqa: E402
from rankwatch.agent.apiclient import ApiClient, ApiError  # noqa: E402
from rankwatch.launch import wait_healthy  # noqa: E402
from tests.support import postgres  # noqa: E402
from tests.support.collectors import free_port  # noqa: E402
from tests.support.proc_cpu import cpu_s  # noqa: E402

TOKEN = "bench-scaleout-token-0123"
RUN = "scaleout"
SPANS_PER_RANK_STEP = 2  # the simulator's step span and its data-parallel all-reduce (no TP)


def _cpu_s(pid: int) -> float:
    """CPU seconds of a process and its live children (a collector: its writer and decoders)."""
    children = Path(f"/proc/{pid}/task/{pid}/children")
    pids = [pid, *(int(p) for p in children.read_text().split())] if children.exists() else [pid]
    return sum(cpu_s(p) for p in pids)


def _committed(url: str) -> float:
    """The spans a collector has stored (its Prometheus counter)."""
    request = urllib.request.Request(f"{url}/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(request, timeout=10) as response:
        text = response.read().decode()
    return sum(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith('rankwatch_collector_items_received_total{signal="traces"}')
    )


def _files(data_path: Path) -> int:
    return sum(1 for _ in data_path.rglob("*.parquet"))


def _rows(url: str, sql: str) -> list:
    return ApiClient(url, TOKEN, 30).post("/api/v1/query", {"sql": sql})["rows"]


def one(server, shards: int, ranks: int, steps: int, work: Path) -> dict:
    """One count of collectors; 0: the baseline, one collector and its DuckDB file, no lake."""
    catalog = server.database(f"scaleout_{shards}_{time.monotonic_ns() % 10**9}")
    data = work / f"lake-{shards}"
    store = ["--lake", catalog, "--data-path", str(data)] if shards else []
    collectors, cpu, rows = [], {}, {}
    for i in range(max(shards, 1)):
        port = free_port()
        log = open(work / f"collector-{shards}-{i}.log", "w")  # noqa: SIM115 - closed with the process
        process = subprocess.Popen(
            [sys.executable, "-m", "rankwatch", "collector", "--db", str(work / f"shard-{shards}-{i}" / "rw.duckdb"),
             "--port", str(port), f"--token={TOKEN}", "--analyze-every", "1", *store],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        wait_healthy(f"http://127.0.0.1:{port}", process)
        collectors.append((process, f"http://127.0.0.1:{port}", log))
    urls = ",".join(url for _, url, _ in collectors)
    started = time.monotonic()
    job = subprocess.Popen(
        [sys.executable, "-m", "rankwatch", "simulate", "--run", RUN, "--ranks", str(ranks), "--steps", str(steps),
         "--collector", urls, "--inject", "straggler:rank=3,slowdown=1.3", "--token-file", str(work / "token")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    committed_at: dict[int, float] = {}
    judged_at: dict[int, float] = {}
    killed = None
    alive = list(collectors)
    while job.poll() is None or (committed_at and max(judged_at, default=-1) < max(committed_at)):
        now = time.monotonic()
        if now - started > 1800:
            break
        url = alive[0][1]
        try:
            complete = _rows(
                url, f"SELECT step FROM steps WHERE run_id = '{RUN}' GROUP BY step HAVING count(*) = {ranks}"
            )
            cursor = _rows(url, f"SELECT step FROM analysis_cursors WHERE run_id = '{RUN}'")
        except ApiError:
            time.sleep(0.2)
            continue
        for (step,) in complete:
            committed_at.setdefault(step, now)
        for step in range((cursor[0][0] if cursor else -1) + 1):
            judged_at.setdefault(step, now)
        if shards > 1 and killed is None and len(committed_at) >= steps // 3:
            holder = _rows(url, f"SELECT holder FROM leases WHERE kind = 'run' AND name = '{RUN}'")
            pid = int(holder[0][0].rsplit(":", 1)[1]) if holder else None
            victim = next((c for c in alive if pid and _parent(pid) == c[0].pid), alive[-1])
            cpu[victim[1]], rows[victim[1]] = _cpu_s(victim[0].pid), _committed(victim[1])
            victim[0].send_signal(signal.SIGKILL)
            killed = {"collector": victim[1], "after_step": max(committed_at), "led_the_run": pid is not None}
            alive.remove(victim)
        if job.poll() is not None and now - started > 1800:
            break
        time.sleep(0.2)
    out, err = job.communicate()
    elapsed = time.monotonic() - started
    url = alive[0][1]
    stored, distinct = _rows(url, f"SELECT count(*), count(DISTINCT (rank, step)) FROM steps WHERE run_id = '{RUN}'")[0]
    for process, curl, _ in alive:
        cpu[curl], rows[curl] = _cpu_s(process.pid), _committed(curl)
    for process, _, log in alive:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=120)
        log.close()
    files_before = files_after = _files(data)
    if shards:
        con = lake.open_lake(lake.Lake(catalog, data))
        con.execute(f"CALL ducklake_merge_adjacent_files('{lake.LAKE}')")
        con.execute(f"CALL ducklake_expire_snapshots('{lake.LAKE}', older_than => now())")
        con.execute(f"CALL ducklake_cleanup_old_files('{lake.LAKE}', cleanup_all => true)")
        con.close()
        files_after = _files(data)
    lags = sorted(judged_at[s] - committed_at[s] for s in committed_at if s in judged_at)
    spans = stored * SPANS_PER_RANK_STEP
    return {
        "shards": shards,
        "ranks": ranks,
        "steps": steps,
        "job_exit": job.returncode,
        "job_said": (err.strip().splitlines() or out.strip().splitlines() or [""])[-1],
        "spans_per_s": spans / elapsed,
        "spans_per_s_per_shard": [round(rows[url] / elapsed) for _, url, _ in collectors],
        "cpu_us_per_span": sum(cpu.values()) / max(spans, 1) * 1e6,
        "judge_lag_s": statistics.median(lags) if lags else None,
        "judge_lag_p95_s": lags[int(0.95 * (len(lags) - 1))] if lags else None,
        "lost_rows": ranks * steps - distinct,
        "duplicate_rows": stored - distinct,
        "files_before": files_before,
        "files_after": files_after,
        "killed": killed,
        "seconds": elapsed,
    }


def _parent(pid: int) -> int | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    return int(next(line for line in status.splitlines() if line.startswith("PPid:")).split()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, nargs="+", default=[0, 1, 2, 4])
    parser.add_argument("--ranks", type=int, default=16384)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    if postgres.binaries() is None:
        sys.exit("bench/scaleout.py: PostgreSQL is not installed (Debian's postgresql package)")
    work = Path(tempfile.mkdtemp(prefix="rankwatch-scaleout-"))
    (work / "token").write_text(TOKEN)
    server = postgres.start(free_port())
    results = []
    try:
        for shards in args.shards:
            r = one(server, shards, args.ranks, args.steps, work)
            results.append(r)
            print(
                f"{shards or 'a file store, 1'} collector(s), {args.ranks:,} ranks x {args.steps} steps: "
                f"{r['spans_per_s']:,.0f} spans/s (by collector: {r['spans_per_s_per_shard']}), "
                f"{r['cpu_us_per_span']:.1f} µs of collector CPU per span, judged {r['judge_lag_s']} s "
                f"(p95 {r['judge_lag_p95_s']} s) after commit, lost {r['lost_rows']}, stored twice "
                f"{r['duplicate_rows']}, Parquet files {r['files_before']} -> {r['files_after']}"
                + (f", killed {r['killed']}" if r["killed"] else "")
                + (f"; the job exited {r['job_exit']}: {r['job_said']}" if r["job_exit"] else ""),
                flush=True,
            )
    finally:
        postgres.stop(server)
    print(json.dumps(results[-1], default=str))


if __name__ == "__main__":
    main()
