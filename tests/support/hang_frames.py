"""Heartbeat and step frames of a few ranks, for the hang analyzer's tests."""

import pandas as pd

S = 1_000_000_000  # ns

RANKS = range(4)


def steps(n=10, step_s=2.0):
    return pd.DataFrame(
        [("r", rank, step, (step + 1) * step_s * S, step_s) for step in range(n) for rank in RANKS],
        columns=["run_id", "rank", "step", "end_ts", "duration_s"],
    )


def beats(rows):
    return pd.DataFrame(rows, columns=["rank", "ts", "step", "phase", "op", "group", "seq", "done"])
