"""What a hostile token holder costs the collector: memory, a well-behaved sender's acks, /healthz.

For each flood, a fresh collector (default settings) is started and flooded for `--seconds`
while one well-behaved sender exports a small trace every 100 ms (on 503 it waits Retry-After
and sends again, as the OpenTelemetry exporters do: its latency runs to the 200) and a prober,
a process of its own, GETs /healthz every 100 ms. Reported: the peak RSS of the collector's
process tree (server, decode workers, writer), the sender's export p99 and count, and
/healthz's slowest answer, and what the flood itself measures (its last column).

Floods:
- bombs: `--senders` threads posting valid 19 MiB trace requests gzipped ~200-fold, back to back;
- partial: `--uploads` connections each declaring a 20 MiB export and sending all but 1 MiB of it;
- idle: `--idle` connections each sending part of a request's headers, then nothing;
- json: 4 threads posting valid OTLP/JSON trace requests of 4 MiB (10,000 spans) back to back;
- poison: one connection posting, back to back, requests past the bounds on strings (a run id of
  130,000 bytes, past DuckDB's 122,880-byte index key, and in turn a span with a 1 MiB attribute,
  gzipped) among `--honest` threads posting small distinct trace requests back to back: the honest
  exports acknowledged, of those sent;
- scrape: a store holding `--runs` active runs with ids of `--id-bytes` bytes (by default the longest
  ingest takes; written into the store file before the collector starts, as one kept from before ids
  were bounded would be), and `--scrapers` threads GETting /metrics (no token) back to back: the
  pages served and the largest.

`--code DIR` runs the collector from another checkout (its PYTHONPATH), to compare.

Usage: python bench/flood.py [--seconds 20] [--floods bombs,partial,idle,json,poison,scrape] [--code DIR]
"""

import argparse
import gzip
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import duckdb
import httpx
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from collector.receive.decode import MAX_NAME_BYTES
from collector.store.schema import DDL
from tests.support.collectors import Collector, free_port
from tests.support.floods import PeakRss, idle_connection, padded_trace, partial_upload
from tests.support.otlp_payloads import post, step_spans, trace_body

MiB = 2**20


def json_trace(spans: int, seed: int) -> bytes:
    """A valid OTLP/JSON trace request of `spans` step spans with a few attributes each."""

    def attr(key, value):
        return {"key": key, "value": {"intValue" if isinstance(value, int) else "stringValue": str(value)}}

    items = [
        {
            "traceId": f"{seed:032x}",
            "spanId": f"{i + 1:016x}",
            "name": "step",
            "startTimeUnixNano": str(1_700_000_000_000_000_000 + i * 10**9),
            "endTimeUnixNano": str(1_700_000_000_000_000_000 + i * 10**9 + 10**8),
            "attributes": [attr("rankwatch.kind", "step"), attr("rankwatch.step", i)]
            + [attr(f"extra.{k}", "x" * 40) for k in range(6)],
        }
        for i in range(spans)
    ]
    resource = {"attributes": [attr("rankwatch.run_id", f"json-{seed}"), attr("rankwatch.rank", 0)]}
    return json.dumps({"resourceSpans": [{"resource": resource, "scopeSpans": [{"spans": items}]}]}).encode()


def _posting(collector: Collector, bodies: list[bytes], headers: dict, stop: threading.Event) -> None:
    with httpx.Client(timeout=60) as client:
        n = 0
        while not stop.is_set():
            try:
                post(collector, "traces", bodies[n % len(bodies)], headers=headers, client=client, timeout=60)
            except httpx.HTTPError:
                time.sleep(0.1)
            n += 1


def _poisoning(collector: Collector, stop: threading.Event) -> None:
    """One connection posting, in turn, a run id past DuckDB's index key and a 1 MiB attribute."""
    long_id = padded_trace("p" * 130_000, 0, 256)
    huge_attribute = gzip.compress(padded_trace("poison", 0, MiB, pad=MiB), 6)
    with httpx.Client(timeout=60) as client:
        while not stop.is_set():
            for body, headers in ((long_id, {}), (huge_attribute, {"Content-Encoding": "gzip"})):
                try:
                    post(collector, "traces", body, headers=headers, client=client, timeout=60)
                except httpx.HTTPError:
                    time.sleep(0.1)


def _honest(collector: Collector, sender: int, stop: threading.Event, sent: list[str]) -> None:
    """Post small distinct trace requests back to back, noting each one's answer (its status, or the error)
    that came before the flood stopped (the collector is killed then)."""
    with httpx.Client(timeout=60) as client:
        n = 0
        while not stop.is_set():
            body = padded_trace(f"honest-{sender}", n, 5 * 256, pad=256)
            try:
                answer = str(post(collector, "traces", body, client=client, timeout=60).status_code)
            except httpx.HTTPError as e:
                answer = type(e).__name__
            if not stop.is_set():
                sent.append(answer)
            n += 1


def fill_runs(db: Path, runs: int, id_bytes: int) -> None:
    """A store holding `runs` runs active now, with ids of `id_bytes` bytes, a rank-step and a firing
    finding each (the page's series are as many whatever the steps)."""
    con = duckdb.connect(str(db))
    con.execute(DDL)
    con.execute(
        "CREATE TEMP TABLE ids AS SELECT i, printf('%05d', i) || repeat('r', $n - 5) AS run_id FROM range($runs) r(i)",
        {"runs": runs, "n": id_bytes},
    )
    con.execute(
        "INSERT INTO steps (run_id, rank, step, start_ts, end_ts, duration_s, tokens) "
        "SELECT run_id, 0, 1, make_timestamp_ns($t - 1000000000), make_timestamp_ns($t), 1.0, 4096 FROM ids",
        {"t": time.time_ns()},
    )
    con.execute(
        "INSERT INTO findings (run_id, analyzer, kind, ranks, severity) SELECT run_id, 'stragglers', 'rank', [3], "
        "'warning' FROM ids"
    )
    con.close()


def _scraping(collector: Collector, stop: threading.Event, pages: list[int]) -> None:
    with httpx.Client(timeout=60) as client:
        while not stop.is_set():
            try:
                pages.append(len(client.get(f"{collector.url}/metrics").content))
            except httpx.HTTPError:
                time.sleep(0.1)


def flood(name: str, collector: Collector, args, stop: threading.Event, figures: list) -> list:
    """Start the flood `name`, its figures gathered in `figures`; returns what it holds open (closed by
    the caller)."""
    if name == "poison":
        threading.Thread(target=_poisoning, args=(collector, stop), daemon=True).start()
        for sender in range(args.honest):
            threading.Thread(target=_honest, args=(collector, sender, stop, figures), daemon=True).start()
        return []
    if name == "scrape":
        for _ in range(args.scrapers):
            threading.Thread(target=_scraping, args=(collector, stop, figures), daemon=True).start()
        return []
    if name == "bombs":
        bodies = [gzip.compress(padded_trace("bomb", rank, 19 * MiB), 6) for rank in range(4)]
        for _ in range(args.senders):
            threading.Thread(
                target=_posting, args=(collector, bodies, {"Content-Encoding": "gzip"}, stop), daemon=True
            ).start()
        return []
    if name == "json":
        bodies = [json_trace(10_000, seed) for seed in range(4)]
        for _ in range(4):
            threading.Thread(
                target=_posting, args=(collector, bodies, {"Content-Type": "application/json"}, stop), daemon=True
            ).start()
        return []
    held: list[socket.socket] = []
    failed = 0
    deadline = time.monotonic() + args.seconds  # a collector out of descriptors leaves connects hanging
    for _ in range(args.uploads if name == "partial" else args.idle):
        if time.monotonic() > deadline:
            break
        try:
            if name == "partial":
                held.append(partial_upload(collector.url, collector.token, 20 * MiB, 19 * MiB))
            else:
                held.append(idle_connection(collector.url))
        except OSError:  # refused and closed while sending, or not accepted
            failed += 1
    print(f"{name}: {len(held)} connections opened, {failed} refused or closed while sending", file=sys.stderr)
    return held


def well_behaved(collector: Collector, stop: threading.Event, taken: list[float]) -> None:
    with httpx.Client(timeout=60) as client:
        step = 0
        while not stop.is_set():
            body = trace_body(step_spans("bench-good", 0, range(step, step + 5)))
            started = time.perf_counter()
            while not stop.is_set():
                try:
                    r = post(collector, "traces", body, client=client, timeout=60)
                except httpx.HTTPError:
                    time.sleep(1)
                    continue
                if r.status_code == 200:
                    taken.append(time.perf_counter() - started)
                    break
                time.sleep(float(r.headers.get("Retry-After", 1)))
            step += 5
            time.sleep(0.1)


# The /healthz prober, a process of its own as a health checker is: in the bench's process it waited for
# the interpreter behind a hundred sender threads, and measured that. It GETs /healthz every 100 ms until
# its standard input closes, then prints each answer's seconds (10 or more: none came in 10 s).
PROBE = """
import json, sys, threading, time, urllib.request
taken, stop = [], threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
while not stop.is_set():
    started = time.perf_counter()
    try:
        urllib.request.urlopen(sys.argv[1] + "/healthz", timeout=10).read()
        taken.append(time.perf_counter() - started)
    except OSError:
        taken.append(max(10.0, time.perf_counter() - started))
    stop.wait(0.1)
print(json.dumps(taken))
"""


def run(name: str, args, directory: Path) -> list[str]:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(args.collector_nofile, hard), hard))  # the collector's
    db = directory / f"{name}.duckdb"
    if name == "scrape":
        fill_runs(db, args.runs, args.id_bytes)
    try:
        with open(directory / f"collector-{name}.log", "w") as log:
            collector = Collector(db, free_port(), "bench-token-0123456789", log=log).start()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # the flood's
    stop = threading.Event()
    exports: list[float] = []
    probes: list[float] = []
    held: list[socket.socket] = []
    figures: list = []  # the flood's own: honest exports' outcomes (poison), pages' sizes (scrape)
    try:
        with PeakRss(collector.process.pid) as rss:
            prober = subprocess.Popen(
                [sys.executable, "-c", PROBE, collector.url], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
            )
            watcher = threading.Thread(target=well_behaved, args=(collector, stop, exports), daemon=True)
            watcher.start()
            held = flood(name, collector, args, stop, figures)
            time.sleep(args.seconds)
            stop.set()
            probes += json.loads(prober.communicate(timeout=60)[0])
            watcher.join(timeout=60)
        log_bytes = Path(log.name).stat().st_size
    finally:
        stop.set()
        for sock in held:
            sock.close()
        collector.process.kill()
        collector.process.wait()
    p99 = statistics.quantiles(exports, n=100, method="inclusive")[98] if len(exports) > 1 else float("nan")
    return [
        name,
        f"{rss.peak / MiB:,.0f} MiB",
        f"{len(exports)}",
        f"{p99:,.2f} s",
        f"{max(probes, default=float('nan')):,.2f} s",
        f"{log_bytes:,} B",
        _summary(name, figures),
    ]


def _summary(name: str, figures: list) -> str:
    if name == "poison":
        acknowledged, sent = figures.count("200"), len(figures)
        others = ", ".join(f"{n} {answer}" for answer, n in sorted(Counter(figures).items()) if answer != "200")
        return f"honest exports acknowledged: {acknowledged:,} of {sent:,} ({acknowledged / max(sent, 1):.1%})" + (
            f"; the others: {others}" if others else ""
        )
    if name == "scrape":
        return f"{len(figures):,} pages, the largest {max(figures, default=0) / MiB:,.2f} MiB"
    return ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--floods", default="bombs,partial,idle,json,poison,scrape")
    parser.add_argument("--senders", type=int, default=40, help="bombs: threads posting")
    parser.add_argument("--uploads", type=int, default=60, help="partial: connections")
    parser.add_argument("--idle", type=int, default=15_000, help="idle: connections")
    parser.add_argument("--honest", type=int, default=8, help="poison: honest senders")
    parser.add_argument("--scrapers", type=int, default=8, help="scrape: threads GETting /metrics")
    parser.add_argument("--runs", type=int, default=200, help="scrape: active runs in the store")
    parser.add_argument("--id-bytes", type=int, default=MAX_NAME_BYTES, help="scrape: bytes of each run id")
    parser.add_argument(
        "--collector-nofile",
        type=int,
        default=4096,
        help="the collector's soft file-descriptor limit at start (a service manager's default is lower)",
    )
    parser.add_argument("--code", help="the checkout the collector runs from (default: this one)")
    args = parser.parse_args()
    if args.code:  # `python -m rankwatch` imports from its working directory first
        os.environ["PYTHONPATH"] = str(Path(args.code).resolve())
        os.chdir(args.code)
    table = Table("flood", "peak RSS", "good exports", "export p99", "/healthz max", "log", "the flood's own")
    with tempfile.TemporaryDirectory() as directory:
        for name in args.floods.split(","):
            row = run(name, args, Path(directory))
            print(" | ".join(row), file=sys.stderr, flush=True)
            table.add_row(*row)
    Console(width=200).print(table)


if __name__ == "__main__":
    main()
