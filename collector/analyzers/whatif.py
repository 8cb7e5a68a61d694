"""What-if analysis: how much faster the run would have been without its stragglers, and who
to blame for the difference.

After "Understanding Stragglers in Large Model Training Using What-if
Analysis" (OSDI'25): each step is replayed through a model of synchronous
training with every op at its typical duration (the ideal), then with only
one worker, one pipeline stage or one op type at its real durations; what a
group's real durations add to the ideal is the slowdown it explains.

The step model works from per rank-step data, compute and communication
times, so it applies to live runs and imported traces alike: the ranks meet
in their collectives, so a step lasts as long as the slowest rank's data
loading and compute, plus the transfer itself, which is the communication
time of the rank that waited least (it waited for nobody). Typical durations
are, per step, the median over ranks of data and compute time, and over the
run, the transfer's 10th percentile (a link slow for half the run must not
set its own standard). Pipeline bubbles scale ideal and real alike, so the
ratios hold for pipelined jobs too.
"""

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

OP_TYPES = ("compute", "data", "comm")


@dataclass
class WhatIf:
    """The run's slowdown against its ideal, and what each worker, stage and op type explains."""

    steps: int
    ranks: int
    actual_step_s: float
    ideal_step_s: float
    slowdown: float  # actual mean step time / ideal mean step time
    workers: list[dict] = field(default_factory=list)  # rank, dp_rank, pp_stage, slowdown (theirs alone real)
    stages: list[dict] = field(default_factory=list)  # pp_stage, slowdown
    op_types: dict[str, float] = field(default_factory=dict)  # op type -> slowdown
    pattern: str = "none"  # none | worker | stage | widespread | communication
    culprits: list[int] = field(default_factory=list)  # ranks that alone explain most of the slowdown
    concentration: float = 0.0  # share of the excess that the worst worker alone explains


def analyze(steps: pd.DataFrame, placement: pd.DataFrame | None = None, worst: float = 0.5,
            negligible: float = 0.05) -> WhatIf:
    """The what-if report of one run.

    `steps`: rank, step, duration_s, data_s, compute_s, comm_wait_s (nulls count as 0).
    `placement`: rank and, where known, dp_rank and pp_stage.
    A group "explains" the slowdown when its excess over the ideal is at least `worst` of the
    run's; below `negligible` excess the pattern is none."""
    frame = steps.fillna({"data_s": 0.0, "compute_s": 0.0, "comm_wait_s": 0.0})
    grid = {c: frame.pivot_table(index="step", columns="rank", values=c, aggfunc="sum")
            for c in ("data_s", "compute_s", "comm_wait_s", "duration_s")}
    ranks = grid["compute_s"].columns.to_numpy()
    data, compute = grid["data_s"].to_numpy(), grid["compute_s"].to_numpy()
    comm = grid["comm_wait_s"].to_numpy()
    transfer = np.nanmin(comm, axis=1).clip(min=0.0)
    typical_data, typical_compute = np.nanmedian(data, axis=1), np.nanmedian(compute, axis=1)
    typical_transfer = float(np.quantile(transfer, 0.1))  # a link at its usual best, not at its median
    ideal = float((typical_data + typical_compute + typical_transfer).mean())

    def replay(real: np.ndarray, types: tuple[str, ...] = OP_TYPES) -> float:
        """Mean step time with the ranks in the `real` mask at their real durations of `types`."""
        d = np.where(real & ("data" in types), data, typical_data[:, None])
        c = np.where(real & ("compute" in types), compute, typical_compute[:, None])
        x = transfer if "comm" in types and real.any() else typical_transfer
        return float((np.nanmax(d + c, axis=1) + x).mean())

    everyone = np.ones(len(ranks), bool)
    place = _placement(ranks, placement)
    workers = [{"rank": int(r), "dp_rank": _int(p["dp_rank"]), "pp_stage": _int(p["pp_stage"]),
                "slowdown": replay(ranks == r, ("data", "compute")) / ideal}
               for r, p in zip(ranks, place.to_dict("records"))]
    workers.sort(key=lambda w: -w["slowdown"])
    stages = [{"pp_stage": int(s),
               "slowdown": replay((place["pp_stage"] == s).to_numpy(), ("data", "compute")) / ideal}
              for s in sorted(place["pp_stage"].dropna().unique())]
    op_types = {t: replay(everyone, (t,)) / ideal for t in OP_TYPES}
    actual = float(grid["duration_s"].median(axis=1).mean())
    report = WhatIf(len(grid["compute_s"]), len(ranks), actual, ideal, actual / ideal, workers,
                    sorted(stages, key=lambda s: -s["slowdown"]), op_types)
    excess = replay(everyone) / ideal - 1
    if excess < negligible:
        return report
    report.concentration = min((workers[0]["slowdown"] - 1) / excess, 1.0)
    # in synchronous training one slow rank alone holds everyone up: each rank that, alone at its
    # real speed, costs most of the excess is a culprit; a different rank at each step is none
    heavy = [w for w in workers if w["slowdown"] - 1 >= worst * excess]
    stage_of = {w["rank"]: w["pp_stage"] for w in workers}
    heavy_stages = {w["pp_stage"] for w in heavy}
    if op_types["comm"] - 1 >= worst * excess and op_types["comm"] >= max(op_types["compute"], op_types["data"]):
        report.pattern = "communication"
    elif heavy and len(stages) > 1 and len(heavy_stages) == 1 and None not in heavy_stages \
            and len(heavy) >= 0.75 * sum(1 for s in stage_of.values() if s in heavy_stages):
        report.pattern = "stage"
    elif heavy:
        report.pattern = "worker"
    else:
        report.pattern = "widespread"
    report.culprits = sorted(w["rank"] for w in heavy)
    return report


def _placement(ranks: np.ndarray, placement: pd.DataFrame | None) -> pd.DataFrame:
    """dp_rank and pp_stage per rank, in the order of `ranks` (null where unknown)."""
    known = pd.DataFrame({"rank": ranks})
    if placement is not None and not placement.empty:
        known = known.merge(placement, on="rank", how="left")
    for column in ("dp_rank", "pp_stage"):
        if column not in known:
            known[column] = np.nan
    return known[["dp_rank", "pp_stage"]].astype(float)


def _int(value: float) -> int | None:
    return None if pd.isna(value) else int(value)
