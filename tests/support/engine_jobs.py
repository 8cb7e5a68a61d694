"""Jobs for the engine's tests and benches: rank-steps sent as real OTLP through the agent's
exporter to a real collector, with the compute, wait and loss a scenario asks for; and the
collector's findings read while it runs (its query API) or after (its store)."""

import time
from collections.abc import Callable

from collector.reports.query import run_remote
from rankwatch.agent import semconv as sc
from rankwatch.agent.export import Exporter

MS = 1_000_000


def exporters(collector, run: str, ranks: int, world_size: int | None = None) -> dict[int, Exporter]:
    """One exporter per rank, as each rank's agent has (its resource: run, rank, world size)."""
    size = {sc.WORLD_SIZE: world_size or ranks}
    return {r: Exporter(collector.url, collector.token, {sc.RUN_ID: run, sc.RANK: r, **size}) for r in range(ranks)}


def send_steps(
    sending: dict[int, Exporter],
    steps,
    t0_ns: int,
    step_s: float = 0.1,
    compute: Callable[[int, int], float] = lambda rank, step: 0.08,
    loss: Callable[[int], float] = lambda step: 3.0,
    flush: bool = True,
    data: Callable[[int, int], float] | None = None,
) -> float:
    """Each step's span from every rank: rank r computes `compute(r, step)` and waits out the slowest
    rank's compute (a synchronous all-reduce), the step's loss is `loss(step)`; the spans are timed
    from `t0_ns`, `step_s` apart (longer where the slowest rank computes longer). `data`: rank r waits
    `data(r, step)` for its input before it computes (its step's data time), which the others wait out
    too. Flushed (committed) at the end; returns when the last flush was acknowledged (time.monotonic())."""
    for step in steps:
        computes = {r: compute(r, step) for r in sending}
        inputs = {r: 0.0 if data is None else data(r, step) for r in sending}
        slowest = max(inputs[r] + computes[r] for r in sending)
        for rank, exporter in sending.items():
            start = t0_ns + int(step * step_s * 1e9)
            own = inputs[rank] + computes[rank]
            wait = slowest - own + 0.005
            exporter.trace(
                [
                    (
                        "step",
                        start,
                        start + int((own + wait) * 1e9),
                        {
                            sc.KIND: sc.KIND_STEP,
                            sc.STEP: step,
                            sc.LOSS: loss(step),
                            sc.GRAD_NORM: 1.0,
                            sc.TOKENS: 1024,
                            sc.COMPUTE_S: computes[rank],
                            sc.COMM_WAIT_S: wait,
                            **({} if data is None else {sc.DATA_S: inputs[rank]}),
                        },
                    )
                ]
            )
    if flush:
        for exporter in sending.values():
            assert exporter.flush(), "steps not delivered"
    return time.monotonic()


def live_findings(collector, run: str) -> list[dict]:
    """The findings the collector holds for `run` now, through its query API."""
    columns, rows, _ = run_remote(
        collector.url,
        collector.token,
        "SELECT id, analyzer, kind, ranks, state, step_start, step_end, severity, "
        f"epoch_ms(created_at) AS created_ms, evidence FROM findings WHERE run_id = '{run}' "
        "ORDER BY id",
    )
    return [dict(zip(columns, row)) for row in rows]
