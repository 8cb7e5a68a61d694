"""Ingest throughput: spans/s committed by a real collector, against a parse-only baseline.

N simulated ranks each export step spans with ten children (four phases, six
collectives), OTLP/HTTP protobuf, gzip, as the agent sends them. Request bodies
are built before the clock starts so the sender costs little; both servers run
as separate processes on loopback and receive the same bodies, in rounds (each
round runs every server once, the order rotated), so that each collector's
ratio is taken to the baseline of its own round, and the medians are reported:
on a shared machine the rates swing from run to run with the other work.

  rankwatch  `rankwatch collector`: decode to Arrow, group commit to DuckDB, ack
             (twice: with the C trace decoder, and with its twin on the protobuf
             runtime that a collector without the C build uses; with --lake a third
             time, C decoder, committing into a lake as one of its collectors)
  baseline   the same HTTP stack that only gunzips and parses the protobuf

Where the collector's CPU goes (on Linux, from /proc): CPU time per span of its server process
(HTTP, token, inflating, handing out batches, awaiting acknowledgements), its decode
workers and its writer process (Arrow into DuckDB, the commits, and the analysis that
runs beside them on threads of its own), over the timed sends.

Usage: python bench/ingest.py [--ranks 1024] [--steps 40] [--steps-per-request 20] [--concurrency 256]
       [--rounds 3] [--lake]
"""

import argparse
import asyncio
import functools
import gzip
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from rich.console import Console
from rich.progress import track
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rankwatch.agent import semconv as sc
from rankwatch.launch import wait_healthy
from tests.support.proc_cpu import cpu_s

TOKEN = "bench-token-0123456789"
BASELINE = "baseline (protobuf parse only)"
STAGES = ("server", "decode", "writer")  # the collector's processes, as _stages names them
BASELINE_APP = """
import gzip, uvicorn
from starlette.applications import Starlette
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest, ExportTraceServiceResponse)

async def traces(request):
    body = gzip.decompress(await request.body())
    ExportTraceServiceRequest().ParseFromString(body)
    return Response(ExportTraceServiceResponse().SerializeToString(), media_type="application/x-protobuf")

async def healthz(request):  # JSON, as the collector's: the shared API client reads nothing else
    return JSONResponse({"status": "ok"})

app = Starlette(routes=[Route("/v1/traces", traces, methods=["POST"]), Route("/healthz", healthz)])
uvicorn.run(app, host="127.0.0.1", port=int(__import__("sys").argv[1]), log_level="warning")
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kv(attrs, key, value):
    a = attrs.add()
    a.key = key
    if isinstance(value, str):
        a.value.string_value = value
    elif isinstance(value, float):
        a.value.double_value = value
    else:
        a.value.int_value = value


def build_bodies(ranks: int, steps: int, per_request: int, seed: int = 0) -> tuple[list[bytes], int]:
    """gzip'd ExportTraceServiceRequest bodies, one per rank per `per_request` steps."""
    rng = random.Random(seed)
    bodies, spans = [], 0
    t0 = time.time_ns()
    for rank in track(range(ranks), description="building requests", transient=True):
        for first in range(0, steps, per_request):
            request = ExportTraceServiceRequest()
            rs = request.resource_spans.add()
            for key, value in (
                (sc.RUN_ID, "bench"),
                (sc.RANK, rank),
                (sc.WORLD_SIZE, ranks),
                (sc.HOST_NAME, f"node{rank // 8}"),
            ):
                _kv(rs.resource.attributes, key, value)
            scope = rs.scope_spans.add()
            for step in range(first, min(first + per_request, steps)):
                start = t0 + step * 200_000_000
                trace_id, step_id = rng.randbytes(16), rng.randbytes(8)
                s = scope.spans.add(
                    trace_id=trace_id,
                    span_id=step_id,
                    name="step",
                    start_time_unix_nano=start,
                    end_time_unix_nano=start + 190_000_000,
                )
                for key, value in (
                    (sc.KIND, sc.KIND_STEP),
                    (sc.STEP, step),
                    (sc.LOSS, 2.5),
                    (sc.GRAD_NORM, 1.1),
                    (sc.TOKENS, 8192),
                    (sc.LR, 3e-4),
                    (sc.COMM_WAIT_S, 0.012),
                ):
                    _kv(s.attributes, key, value)
                children = [
                    ("data", sc.KIND_PHASE),
                    ("forward", sc.KIND_PHASE),
                    ("backward", sc.KIND_PHASE),
                    ("optimizer", sc.KIND_PHASE),
                ] + [("all_reduce", sc.KIND_COMM)] * 6
                for i, (name, kind) in enumerate(children):
                    c = scope.spans.add(
                        trace_id=trace_id,
                        span_id=rng.randbytes(8),
                        parent_span_id=step_id,
                        name=name,
                        start_time_unix_nano=start + i * 15_000_000,
                        end_time_unix_nano=start + (i + 1) * 15_000_000,
                    )
                    _kv(c.attributes, sc.KIND, kind)
                    _kv(c.attributes, sc.STEP, step)
                    if kind == sc.KIND_COMM:
                        for key, value in (
                            (sc.COMM_GROUP, "dp"),
                            (sc.COMM_GROUP_SIZE, ranks),
                            (sc.COMM_SEQ, step * 6 + i),
                            (sc.COMM_BYTES, 25 << 20),
                        ):
                            _kv(c.attributes, key, value)
                spans += 1 + len(children)
            bodies.append(gzip.compress(request.SerializeToString(), compresslevel=1))
    return bodies, spans


async def send_all(port: int, bodies: list[bytes], concurrency: int) -> tuple[float, list[float]]:
    """Wall time to get every body acknowledged, and each request's ack latency.

    Each of `concurrency` keep-alive connections writes prebuilt HTTP/1.1
    requests and reads the replies: a load generator this thin leaves the
    CPU to the server under test (an HTTP client library costs more per
    request than the baseline server does).
    """
    queue: asyncio.Queue = asyncio.Queue()
    for body in bodies:
        queue.put_nowait(
            b"POST /v1/traces HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/x-protobuf\r\nContent-Encoding: gzip\r\n"
            b"Authorization: Bearer " + TOKEN.encode() + b"\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
        )
    latencies: list[float] = []

    async def connection():
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        while not queue.empty():
            request = queue.get_nowait()
            while True:
                started = time.perf_counter()
                writer.write(request)
                head = await reader.readuntil(b"\r\n\r\n")
                status = int(head.split(b" ", 2)[1])
                length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                await reader.readexactly(length)
                if status == 200:
                    latencies.append(time.perf_counter() - started)
                    break
                if status != 503:
                    raise RuntimeError(f"server answered {status}")
                await asyncio.sleep(2)
        writer.close()

    started = time.perf_counter()
    await asyncio.gather(*(connection() for _ in range(concurrency)))
    return time.perf_counter() - started, latencies


def _stat(pid: int) -> list[str]:
    """/proc/PID/stat's fields from the process state on (field 3)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def _stages(server: int) -> dict[int, str]:
    """The collector's processes by stage: its server; the writer, the first child it starts (before the
    decode workers, whose pool is made on the open store); the decode workers. The baseline's one
    process is its server."""
    children = [
        child
        for task in Path(f"/proc/{server}/task").iterdir()
        for child in map(int, (task / "children").read_text().split())
        if b"resource_tracker" not in Path(f"/proc/{child}/cmdline").read_bytes()
    ]
    children.sort(key=lambda pid: int(_stat(pid)[19]))  # by start time
    return {server: "server", **{pid: "writer" if i == 0 else "decode" for i, pid in enumerate(children)}}


def measure(
    name: str,
    command: list[str],
    port: int,
    warm_up: list[bytes],
    bodies: list[bytes],
    spans: int,
    concurrency: int,
    env: dict | None = None,
) -> dict:
    """Steady-state figures: every rank has announced itself before the clock starts. With /proc,
    the CPU each stage of the server spent per span over the timed sends (µs)."""
    server = subprocess.Popen(command, env={**os.environ, "RANKWATCH_TOKEN": TOKEN, **(env or {})})
    try:
        wait_healthy(f"http://127.0.0.1:{port}", server)
        asyncio.run(send_all(port, warm_up, concurrency))
        stages = _stages(server.pid) if Path("/proc/thread-self/children").exists() else {}
        before = {pid: cpu_s(pid) for pid in stages}
        wall, latencies = asyncio.run(send_all(port, bodies, concurrency))
        cpu: Counter = Counter()
        for pid, stage in stages.items():
            cpu[stage] += (cpu_s(pid) - before[pid]) / spans * 1e6
    finally:
        server.terminate()
        server.wait()
    q = statistics.quantiles(latencies, n=100)
    return {
        "name": name,
        "spans_s": spans / wall,
        "p50_ms": q[49] * 1e3,
        "p99_ms": q[98] * 1e3,
        "wall_s": wall,
        "cpu_us": dict(cpu),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--steps-per-request", type=int, default=20)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every server, medians reported")
    parser.add_argument("--workers", type=int, help="collector decode processes (default: one per core)")
    parser.add_argument(
        "--lake",
        action="store_true",
        help="also a collector storing into a lake (a PostgreSQL catalog on loopback, Parquet files): one shard",
    )
    args = parser.parse_args()

    warm_up, _ = build_bodies(args.ranks, 1, 1, seed=1)
    bodies, spans = build_bodies(args.ranks, args.steps, args.steps_per_request)
    console = Console()
    console.print(
        f"{args.ranks} ranks x {args.steps} steps x 11 spans = {spans:,} spans in {len(bodies):,} "
        f"requests, concurrency {args.concurrency}, {os.cpu_count()} cores, {args.rounds} rounds"
    )
    variants = [("C decoder", {}, None), ("Python decoder", {"RANKWATCH_DECODER": "python"}, None)]
    catalog_server = None
    if args.lake:
        from tests.support import postgres

        catalog_server = postgres.start(free_port())
        variants.append(("C decoder, a lake shard", {}, catalog_server.database("ingest")))
    runs = [functools.partial(run_collector, args, variant) for variant in variants]
    runs.append(functools.partial(run_baseline, args))
    rounds: list[dict[str, dict]] = []
    for n in range(args.rounds):
        turn = runs[n % len(runs) :] + runs[: n % len(runs)]
        rounds.append({result["name"]: result for result in (run(warm_up, bodies, spans) for run in turn)})
    if catalog_server:
        postgres.stop(catalog_server)
    console.print(table_of(rounds))


def run_collector(args, variant: tuple[str, dict, object], warm_up: list[bytes], bodies: list[bytes], spans: int):
    decoder, env, catalog = variant
    with tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        collector = [sys.executable, "-m", "rankwatch", "collector", "--db", f"{tmp}/bench.duckdb", "--port", str(port)]
        if catalog:
            collector += ["--lake", str(catalog), "--data-path", f"{tmp}/lake"]
        if args.workers is not None:
            collector += ["--workers", str(args.workers)]
        name = f"rankwatch, {decoder} (decode + {'DuckLake' if catalog else 'DuckDB'} commit)"
        return measure(name, collector, port, warm_up, bodies, spans, args.concurrency, env)


def run_baseline(args, warm_up: list[bytes], bodies: list[bytes], spans: int) -> dict:
    port = free_port()
    command = [sys.executable, "-c", BASELINE_APP, str(port)]
    return measure(BASELINE, command, port, warm_up, bodies, spans, args.concurrency)


def table_of(rounds: list[dict[str, dict]]) -> Table:
    """Medians over the rounds; each server's ratio is the median of its ratios to its round's baseline."""

    def median(name: str, key: str) -> float:
        return statistics.median(r[name][key] for r in rounds)

    table = Table("server", "spans/s", "p50 ack ms", "p99 ack ms", "vs baseline (each round)", "CPU µs/span by stage")
    for name in rounds[0]:
        ratios = [r[name]["spans_s"] / r[BASELINE]["spans_s"] for r in rounds]
        stages = [stage for stage in STAGES if stage in rounds[0][name]["cpu_us"]]
        cpu = {stage: statistics.median(r[name]["cpu_us"][stage] for r in rounds) for stage in stages}
        table.add_row(
            name,
            f"{median(name, 'spans_s'):,.0f}",
            f"{median(name, 'p50_ms'):.1f}",
            f"{median(name, 'p99_ms'):.1f}",
            f"{statistics.median(ratios):.2f}x ({', '.join(f'{x:.2f}' for x in ratios)})",
            ", ".join(f"{stage} {x:.2f}" for stage, x in cpu.items()),
        )
    return table


if __name__ == "__main__":
    main()
