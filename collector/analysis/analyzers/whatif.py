"""What-if analysis: how much faster the run would have been without its stragglers, and who
to blame for the difference.

After "Understanding Stragglers in Large Model Training Using What-if
Analysis" (OSDI'25) and its artifact: each step is replayed through a model of
synchronous training with its ops back to back, once at their real durations
(the simulated step) and once with every op at its typical duration (the
ideal). The slowdown S is simulated over ideal. What the real trace adds to
the simulated step (launch delays, idle GPUs, host gaps) is not straggling:
it is reported apart, as `idle_slowdown` (actual over simulated), as the
paper's launch-delay slowdown is. A worker, pipeline stage or op type
explains what its real durations alone add to the ideal.

The step model works from per rank-step times by op type, so it applies to
live runs and imported traces alike: the ranks meet in their collectives, so
a step lasts as long as the slowest rank's data loading, compute and host-side
work, plus each kind of communication's transfer, which is the communication
time of the rank that waited least (it waited for nobody). Op types, as the
paper splits them: data, forward-compute, backward-compute, compute (the rest:
optimizer, unnamed kernels), one `comm:<name>` per kind of communication (or
`comm`); and what an offloading job does outside its phases, which would
otherwise pass for idle: `host:<name>` per kind of host work (an offloaded
optimizer's step) and `transfer:<src>-><dst>` per direction of copies between
memory tiers, each counting for what the step's phases and communication left
of it (copies that compute hid are no part of the step's length).
Typical durations, as in the artifact: a compute or data type's mean over all
rank-steps, a communication kind's median transfer over the steps. Pipeline
bubbles scale ideal and simulated alike, so the ratios hold for pipelined jobs
too.

Since max over ranks of a sum is at most the sum of the maxima, the excesses
of the op types always add up to at least the excess of S: the report never
claims a slowdown its own attribution cannot explain.
"""

from dataclasses import dataclass, field
from typing import TypedDict

import numpy as np
import pandas as pd

from collector import ranksets

# rank, step, op type and seconds of a run's compute, communication, host work and transfer ops (see `parts`)
PARTS_SQL = """
SELECT rank, step, CASE
         WHEN kind IN ('comm', 'host', 'transfer') THEN kind || ':' || name
         WHEN regexp_matches(lower(name), 'backward|bwd') AND NOT regexp_matches(lower(name), 'forward|fwd')
           THEN 'backward-compute'
         WHEN regexp_matches(lower(name), 'forward|fwd') AND NOT regexp_matches(lower(name), 'backward|bwd')
           THEN 'forward-compute'
         ELSE 'compute' END AS op_type, sum(duration_s) AS seconds
FROM ops WHERE run_id = ? AND step IS NOT NULL AND kind IN ('compute', 'comm', 'host', 'transfer')
GROUP BY ALL
"""
FAMILIES = ("compute", "data", "comm", "host", "transfer")
OUTSIDE_PHASES = ("host", "transfer")  # families whose time is what the step's phases and communication left


class Worker(TypedDict):
    """One rank, and the run's slowdown were it alone at its real speed."""

    rank: int
    dp_rank: int | None
    pp_stage: int | None
    slowdown: float


@dataclass
class WhatIf:
    """The run's slowdown against its ideal, and what each worker, stage and op type explains."""

    steps: int
    ranks: int
    actual_step_s: float  # mean over steps of the median rank's step time, as measured
    simulated_step_s: float  # mean replayed step time, every op at its real duration, back to back
    ideal_step_s: float  # mean replayed step time, every op at its typical duration
    slowdown: float  # S: simulated / ideal
    idle_slowdown: float | None  # actual / simulated: launch delay and idle, kept out of S (None: nothing ran)
    workers: list[Worker] = field(default_factory=list)
    stages: list[dict] = field(default_factory=list)  # pp_stage, slowdown
    op_types: dict[str, float] = field(default_factory=dict)  # op type -> slowdown (only that type real)
    pattern: str = "none"  # none | worker | stage | widespread | communication
    culprits: list[int] = field(default_factory=list)  # ranks that alone explain most of the slowdown
    concentration: float = 0.0  # share of the excess that the worst worker alone explains


def summary(w: WhatIf) -> str:
    """The report in a sentence: the slowdown, its pattern and who explains it, and the launch delay
    and idle kept apart from it."""
    culprits = f" ({'rank' if len(w.culprits) == 1 else 'ranks'} {ranksets.compact(w.culprits)})" if w.culprits else ""
    idle = (
        ""
        if w.idle_slowdown is None
        else f"; launch delay and idle, apart: measured {w.actual_step_s:.3f} s, "
        f"{w.idle_slowdown:.2f}x the ops back to back"
    )
    return (
        f"{w.steps} steps of {w.ranks} ranks; mean step {w.simulated_step_s:.3f} s (ops back to back) against "
        f"{w.ideal_step_s:.3f} s with every op at its typical duration: slowdown {w.slowdown:.2f}x, pattern "
        f"{w.pattern}{culprits}; the worst rank alone explains {100 * w.concentration:.0f}% of it{idle}"
    )


def _family(op_type: str) -> str:
    family = op_type.partition(":")[0]
    return family if family in FAMILIES else "compute"


def _op_type_times(frame: pd.DataFrame, parts: pd.DataFrame | None) -> dict[str, pd.DataFrame]:
    """Seconds per op type as step x rank grids (NaN where the rank did not report the step). The
    steps' data_s, compute_s and comm_wait_s stay the totals; `parts` only splits compute_s and
    comm_wait_s in the proportions of their ops (a rank-step without such ops keeps `compute`, `comm`).
    Host work and transfers count for their ops' time up to what the step's data, compute and
    communication leave of it, in the proportions of their ops: a copy that compute hid, or host work
    on a thread of its own while the device computed, is no part of the step's length."""
    index = pd.MultiIndex.from_frame(frame[["step", "rank"]])
    columns = {"data": frame["data_s"].to_numpy(float)}
    split = (
        (
            parts.groupby(["step", "rank", "op_type"])["seconds"]
            .sum()
            .unstack("op_type")
            .reindex(index)
            .fillna(0.0)
            .clip(lower=0.0)
        )
        if parts is not None and not parts.empty
        else None
    )
    for family, total in (("compute", frame["compute_s"]), ("comm", frame["comm_wait_s"])):
        total = total.to_numpy(float)
        kinds = [c for c in split.columns if _family(c) == family] if split is not None else []
        shares = split[kinds].to_numpy() if split is not None and kinds else np.zeros((len(frame), 0))
        whole = shares.sum(axis=1)
        unsplit = whole <= 0
        for i, kind in enumerate(kinds):
            columns[kind] = np.where(unsplit, 0.0, total * shares[:, i] / np.where(unsplit, 1.0, whole))
        if unsplit.any() or not kinds:
            columns[family] = np.where(unsplit, total, 0.0)
    if split is not None:
        columns |= _outside_phases(frame, split[[c for c in split.columns if _family(c) in OUTSIDE_PHASES]])
    times = pd.DataFrame(columns, index=index)
    return {
        t: times[t].unstack("rank").sort_index()
        for t in times.columns
        if times[t].any() or t in ("data", "compute", "comm")
    }


def _outside_phases(frame: pd.DataFrame, ops: pd.DataFrame) -> dict[str, np.ndarray]:
    """Each of `ops`' op types (host work, transfers: seconds per rank-step of `frame`), scaled down where
    together they outlast what the rank-step's data, compute and communication leave of it."""
    inside = sum(frame[c].to_numpy(float) for c in ("data_s", "compute_s", "comm_wait_s"))
    left = np.clip(frame["duration_s"].to_numpy(float) - inside, 0.0, None)
    whole = ops.to_numpy().sum(axis=1)
    scale = np.minimum(1.0, left / np.where(whole > 0, whole, 1.0))
    return {kind: ops[kind].to_numpy() * scale for kind in ops.columns}


def analyze(
    steps: pd.DataFrame,
    placement: pd.DataFrame | None = None,
    parts: pd.DataFrame | None = None,
    worst: float = 0.5,
    negligible: float = 0.05,
) -> WhatIf:
    """The what-if report of one run.

    `steps`: rank, step, duration_s, data_s, compute_s, comm_wait_s (nulls count as 0).
    `placement`: rank and, where known, dp_rank and pp_stage.
    `parts`: rank, step, op_type, seconds (PARTS_SQL): how compute and communication split by op type,
    and the host work and transfers outside them.
    A group "explains" the slowdown when its excess over the ideal is at least `worst` of the
    run's; below `negligible` excess the pattern is none."""
    frame = (
        steps.fillna({"data_s": 0.0, "compute_s": 0.0, "comm_wait_s": 0.0, "duration_s": 0.0})
        .groupby(["step", "rank"], as_index=False)[["duration_s", "data_s", "compute_s", "comm_wait_s"]]
        .sum()
    )
    grids = _op_type_times(frame, parts)
    duration = frame.set_index(["step", "rank"])["duration_s"].unstack("rank").sort_index()
    ranks = duration.columns.to_numpy()
    present = duration.notna().to_numpy()
    local = {t: g.reindex(columns=ranks).to_numpy() for t, g in grids.items() if _family(t) != "comm"}
    # a communication kind's transfer: the time of the rank that waited least, per step
    transfer = {
        t: np.nanmin(np.where(present, g.reindex(columns=ranks).to_numpy(), np.nan), axis=1).clip(min=0)
        for t, g in grids.items()
        if _family(t) == "comm"
    }
    typical = {t: float(np.nanmean(x)) for t, x in local.items()} | {
        t: float(np.median(x)) for t, x in transfer.items()
    }
    ideal = sum(typical.values())

    def replay(real: np.ndarray, types: tuple[str, ...] | list[str]) -> float:
        """Mean step time with the ranks in the `real` mask at their real durations of `types`."""
        busy = sum(np.where(real & (t in types), x, typical[t]) for t, x in local.items())
        busy = np.where(present, busy, np.nan)
        comm = sum(x if t in types and real.any() else typical[t] for t, x in transfer.items())
        return float(np.mean(np.nanmax(busy, axis=1) + comm))

    def ratio(replayed: float) -> float:
        return replayed / ideal if ideal > 0 else 1.0

    everyone, every_type = np.ones(len(ranks), bool), list(typical)
    simulated = replay(everyone, every_type)
    place = _placement(ranks, placement)
    local_types = [t for t in every_type if t not in transfer]
    workers: list[Worker] = [
        {
            "rank": int(r),
            "dp_rank": _int(p["dp_rank"]),
            "pp_stage": _int(p["pp_stage"]),
            "slowdown": ratio(replay(ranks == r, local_types)),
        }
        for r, p in zip(ranks, place.to_dict("records"))
    ]
    workers.sort(key=lambda w: -w["slowdown"])
    stages = [
        {"pp_stage": int(s), "slowdown": ratio(replay((place["pp_stage"] == s).to_numpy(), local_types))}
        for s in sorted(place["pp_stage"].dropna().unique())
    ]
    op_types = {t: ratio(replay(everyone, (t,))) for t in every_type}
    actual = float(duration.median(axis=1).mean())
    report = WhatIf(
        len(duration),
        len(ranks),
        actual,
        simulated,
        ideal,
        ratio(simulated),
        actual / simulated if simulated > 0 else None,
        workers,
        sorted(stages, key=lambda s: -s["slowdown"]),
        op_types,
    )
    excess = report.slowdown - 1
    if excess < negligible:
        return report
    report.concentration = min(max((workers[0]["slowdown"] - 1) / excess, 0.0), 1.0)  # rounding stays in [0, 1]
    # in synchronous training one slow rank alone holds everyone up: each rank that, alone at its
    # real speed, costs most of the excess is a culprit; a different rank at each step is none
    heavy = [w for w in workers if w["slowdown"] - 1 >= worst * excess]
    stage_of = {w["rank"]: w["pp_stage"] for w in workers}
    heavy_stages = {w["pp_stage"] for w in heavy}
    family = {f: ratio(replay(everyone, [t for t in every_type if _family(t) == f])) for f in FAMILIES}
    if family["comm"] - 1 >= worst * excess and family["comm"] >= max(family["compute"], family["data"]):
        report.pattern = "communication"
    elif (
        heavy
        and len(stages) > 1
        and len(heavy_stages) == 1
        and None not in heavy_stages
        and len(heavy) >= 0.75 * sum(1 for s in stage_of.values() if s in heavy_stages)
    ):
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
        known = known.merge(placement.drop_duplicates("rank"), on="rank", how="left")
    for column in ("dp_rank", "pp_stage"):
        if column not in known:
            known[column] = np.nan
    return known[["dp_rank", "pp_stage"]].astype(float)


def _int(value: float) -> int | None:
    return None if pd.isna(value) else int(value)
