"""Synthetic op traces in the generic format (rank, step, op, start, duration, kind): a synchronous
job whose ranks meet in one gradient all-reduce per step, as published traces record them."""

import pandas as pd

OPS = (("batch-generator", "data"), ("forward-compute", "compute"), ("backward-compute", "compute"))


def synchronous(
    steps: list[int],
    ranks: int,
    work: dict[str, float],
    slow: dict[int, float] | None = None,
    transfer: float = 0.05,
    idle: float = 0.0,
) -> pd.DataFrame:
    """Each step: every rank's data, forward and backward (`work` seconds, times `slow[rank]`), then an
    all-reduce that ends `transfer` after the slowest rank arrives. `idle` seconds of nothing (a
    launch delay, a host that lags its GPU) come between data and forward. Float seconds from 0."""
    rows, t = [], 0.0
    for step in steps:
        arrivals = {}
        for rank in range(ranks):
            at = t
            for op, kind in OPS:
                duration = work[op] * (slow or {}).get(rank, 1.0)
                rows.append((rank, step, op, kind, at, duration))
                at += duration + (idle if kind == "data" else 0.0)
            arrivals[rank] = at
        end = max(arrivals.values()) + transfer
        rows += [(rank, step, "grads-all-reduce", "comm", at, end - at) for rank, at in arrivals.items()]
        t = end
    return pd.DataFrame(rows, columns=["rank", "step", "op", "kind", "start", "duration"])
