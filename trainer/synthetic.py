"""A synthetic multi-rank job: plausible step, phase and collective spans,
device samples and events, sent through the agent's exporter. It exercises
the whole ingest path without torch; rank 2 is a straggler from step 20."""

import random
import threading
import time

from agent import semconv as sc
from agent.export import Exporter

PHASES = (("data", 0.004), ("forward", 0.030), ("backward", 0.060), ("optimizer", 0.010))


def _rank(endpoint: str, token: str, run_id: str, rank: int, world: int, steps: int) -> None:
    exporter = Exporter(endpoint, token, {sc.RUN_ID: run_id, sc.RANK: rank, sc.WORLD_SIZE: world,
                                          sc.LOCAL_RANK: rank, sc.HOST_NAME: "demo-host", sc.DEVICE: "cpu"})
    rng = random.Random(rank)
    now = time.time_ns()
    for step in range(steps):
        slow = 1.3 if rank == 2 and step >= 20 else 1.0
        start = now
        spans = []
        for phase, seconds in PHASES:
            dur = int(seconds * slow * rng.lognormvariate(0, 0.05) * 1e9)
            spans.append((phase, now, now + dur, {sc.KIND: sc.KIND_PHASE, sc.STEP: step}))
            now += dur
        wait = int(0.01e9 if rank != 2 or step < 20 else 0.001e9)
        spans.append(("all_reduce", now, now + wait, {sc.KIND: sc.KIND_COMM, sc.STEP: step, sc.COMM_GROUP: "0",
                                                      sc.COMM_GROUP_SIZE: world, sc.COMM_SEQ: step,
                                                      sc.COMM_BYTES: 4 << 20}))
        now += wait
        parent = exporter.start_span("step", start, {sc.KIND: sc.KIND_STEP, sc.STEP: step,
                                                      sc.LOSS: 4.0 / (1 + step * 0.05), sc.TOKENS: 4096,
                                                      sc.COMM_WAIT_S: wait / 1e9})
        for name, s, e, attrs in spans:
            exporter.span(name, s, e, attrs, parent=parent)
        parent.end(end_time=now)
        exporter.samples([(sc.POWER_W, now, 250.0 * slow, {sc.GPU: rank, sc.SOURCE: sc.SOURCE_SIMULATED})])
    exporter.event("run_finished", now, {sc.STEP: steps})
    exporter.shutdown()


def run(endpoint: str, token: str, run_id: str, world: int = 4, steps: int = 60) -> None:
    """Send `steps` steps from `world` ranks, one thread per rank; returns when all is flushed."""
    threads = [threading.Thread(target=_rank, args=(endpoint, token, run_id, r, world, steps)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
