"""Step spans of a job with a straggler, sent through the agent's real exporters."""

from prometheus_client.parser import text_string_to_metric_families

from rankwatch.agent import semconv as sc
from tests.support import loopback
from tests.support.waits import wait_until

MS = 1_000_000


def send_straggler_steps(exporters: dict, steps, t0: int, slow_rank: int | None) -> None:
    """Step spans of every rank; `slow_rank` computes 50% longer and waits less, a straggler."""
    for step in steps:
        for rank, exporter in exporters.items():
            slow = rank == slow_rank
            start = t0 + step * 150 * MS
            exporter.trace(
                [
                    (
                        "step",
                        start,
                        start + 150 * MS,
                        {
                            sc.KIND: sc.KIND_STEP,
                            sc.STEP: step,
                            sc.LOSS: 3.0,
                            sc.GRAD_NORM: 1.0,
                            sc.TOKENS: 1024,
                            sc.COMPUTE_S: 0.12 if slow else 0.08,
                            sc.COMM_WAIT_S: 0.01 if slow else 0.05,
                        },
                    )
                ]
            )
    for exporter in exporters.values():
        wait_until(exporter.flush, "steps not delivered", 120)  # a loaded machine may time an export out: retry


def alerts_pending(collector) -> float:
    page = loopback.get(f"{collector.url}/metrics", timeout=10).text
    return sum(
        s.value
        for f in text_string_to_metric_families(page)
        for s in f.samples
        if s.name == "rankwatch_collector_alerts_pending"
    )
