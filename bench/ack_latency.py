"""What analysis costs acknowledgements: export latency while the collector analyses many runs.

Two real collectors, one after the other, each with `--analyze-every 1`: the baseline with one
active run, the other with `--runs` more runs (one request naming them all, a dozen steps each,
as the adversarial request did). Against each, one small export every 50 ms for `--seconds`,
timed from POST to answer; the collector's analysis passes go on all the while.

Usage: python bench/ack_latency.py [--runs 1000] [--seconds 10]
"""

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.support import loopback
from tests.support.collectors import Collector, free_port
from tests.support.otlp_payloads import post, step_spans, trace_body


def many_runs(runs: int, steps: int = 12) -> bytes:
    """One trace request with `runs` resources, each a run of its own."""
    request = ExportTraceServiceRequest()
    for run in range(runs):
        one = ExportTraceServiceRequest.FromString(trace_body(step_spans(f"bench-{run:05d}", 0, range(steps))))
        request.resource_spans.extend(one.resource_spans)
    return request.SerializeToString()


def latencies(extra_runs: int, seconds: float, directory: Path) -> list[float]:
    with open(directory / f"collector-{extra_runs}.log", "w") as log:
        collector = Collector(
            directory / f"store-{extra_runs}.duckdb",
            free_port(),
            "bench-token-0123456789",
            extra_args=("--analyze-every", "1"),
            log=log,
        ).start()
        try:
            if extra_runs:
                assert post(collector, "traces", many_runs(extra_runs), timeout=300).status_code == 200
            taken, step = [], 0
            deadline = time.monotonic() + seconds
            with loopback.Client() as client:
                while time.monotonic() < deadline:
                    body = trace_body(step_spans("bench-live", 0, range(step, step + 5)))
                    started = time.perf_counter()
                    assert post(collector, "traces", body, client=client, timeout=120).status_code == 200
                    taken.append(time.perf_counter() - started)
                    step += 5
                    time.sleep(0.05)
            return taken
        finally:
            collector.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    table = Table("active runs", "exports", "p50", "p99", "max")
    with tempfile.TemporaryDirectory() as directory:
        for extra in (0, args.runs):
            taken = latencies(extra, args.seconds, Path(directory))
            q = statistics.quantiles(taken, n=100, method="inclusive")
            table.add_row(
                f"{1 + extra:,}", str(len(taken)), *(f"{1e3 * v:,.0f} ms" for v in (q[49], q[98], max(taken)))
            )
    Console().print(table)


if __name__ == "__main__":
    main()
