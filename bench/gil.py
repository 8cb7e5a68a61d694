"""How long the agent's export thread keeps the training thread from the GIL while it encodes spans.

A training thread that gives up the GIL (a CUDA launch that releases it, a DDP hook on autograd's
thread coming back to Python) must take it back before it goes on; while the export thread runs
Python bytecode, that waits for the holder's switch interval (5 ms by default) or its next
voluntary release. Here a stand-in training thread releases the GIL for 200 µs at a time and
measures how late it gets it back, while the export thread encodes batches of real step traces
(a DDP step of 14 buckets: 19 spans), A/B: encoded whole, then in the slices rankwatch/agent/spanwire.py uses.

Usage: python bench/gil.py [--steps 512] [--rounds 5]
"""

import argparse
import random
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from opentelemetry.sdk.resources import Resource

from rankwatch.agent import semconv as sc
from rankwatch.agent import spanwire

PAUSE_S = 200e-6


def step_spans(step: int, resource: Resource) -> list[spanwire.Span]:
    """One step's spans as the agent sends them: the step, 4 phases, 14 all-reduces."""
    t0 = 1_700_000_000_000_000_000 + step * 33_000_000
    ids = random.Random(step)
    root = ids.getrandbits(64)
    attributes = {sc.KIND: sc.KIND_STEP, sc.STEP: step, sc.DATA_S: 1e-4, sc.COMPUTE_S: 0.03, sc.COMM_WAIT_S: 1e-4}
    spans = [spanwire.Span(step + 1, root, 0, "step", t0, t0 + 33_000_000, attributes, resource)]
    for i, name in enumerate(("data", "forward", "backward", "optimizer")):
        phase = {sc.KIND: sc.KIND_PHASE, sc.STEP: step}
        spans.append(spanwire.Span(step + 1, ids.getrandbits(64), root, name, t0 + i, t0 + i + 1, phase, resource))
    for seq in range(14):
        comm = {
            sc.KIND: sc.KIND_COMM,
            sc.STEP: step,
            sc.COMM_GROUP: "world",
            sc.COMM_GROUP_SIZE: 8,
            sc.COMM_SEQ: seq,
            sc.COMM_BYTES: 26_214_400,
        }
        spans.append(
            spanwire.Span(step + 1, ids.getrandbits(64), root, "all_reduce", t0 + seq, t0 + seq + 9, comm, resource)
        )
    return spans


def lateness(encode, spans: list[spanwire.Span]) -> tuple[float, list[float]]:
    """(seconds the encoding took, how late each of the training thread's GIL returns came back)."""
    late: list[float] = []
    stop = threading.Event()

    def training() -> None:
        while not stop.is_set():
            started = time.perf_counter()
            time.sleep(PAUSE_S)  # gives up the GIL, as a releasing launch does
            late.append(time.perf_counter() - started - PAUSE_S)

    thread = threading.Thread(target=training)
    thread.start()
    time.sleep(0.05)
    late.clear()
    started = time.perf_counter()
    encode(spans)
    took = time.perf_counter() - started
    stop.set()
    thread.join()
    return took, late


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=512, help="steps in the batch encoded (the batcher's size)")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    resource = Resource.create({sc.RUN_ID: "bench-gil", sc.RANK: 0})
    spans = [s for step in range(args.steps) for s in step_spans(step, resource)]
    variants = {"whole": lambda s: spanwire.encode_spans(s, gil_slice=0), "sliced": spanwire.encode_spans}
    assert variants["whole"](spans) == variants["sliced"](spans)
    results: dict[str, list[tuple[float, list[float]]]] = {v: [] for v in variants}
    for _ in range(args.rounds):
        for name, encode in variants.items():
            results[name].append(lateness(encode, spans))
    print(
        f"{len(spans)} spans ({args.steps} steps) a batch, {args.rounds} rounds, switch interval "
        f"{sys.getswitchinterval() * 1e3:g} ms; the training thread's lateness taking the GIL back:"
    )
    print(f"{'encoding':<8} {'batch ms':>9} {'p50 µs':>8} {'p99 µs':>8} {'max µs':>8}")
    for name, runs in results.items():
        late = sorted(x for _, lates in runs for x in lates)
        took = statistics.median(t for t, _ in runs)
        print(
            f"{name:<8} {took * 1e3:9.1f} {late[len(late) // 2] * 1e6:8.0f} "
            f"{late[int(len(late) * 0.99)] * 1e6:8.0f} {late[-1] * 1e6:8.0f}"
        )


if __name__ == "__main__":
    main()
