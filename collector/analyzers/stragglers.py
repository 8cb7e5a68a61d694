"""Straggler analysis: which ranks are slow, in what pattern, and what it costs.

A pure function from a frame of rank-steps (and the ranks' placement) to
findings. Each rank-step's compute time is taken relative to that step's
median over ranks; each rank's typical ratio over a window of recent steps
(its median there, so one noisy step never counts) is then compared across
ranks by robust statistics: median and MAD, the MAD floored at a relative
jitter so a perfectly quiet job does not divide by zero. In synchronous
training the culprit computes long and waits little while its victims wait
long, so a suspect must also wait less than its peers.

Suspects are grouped into a pattern: a single rank, a node (all ranks of a
host), a pipeline stage (all ranks of a stage), or widespread (time lost to
a different slow rank at each step, as uneven sequence lengths make it). The
cost is the step time lost to the slow ranks: per step, the slowest rank's
compute minus the median compute, which every other rank waits out.
"""

from dataclasses import dataclass

import numpy as np
import pandas as pd

from agent import semconv as sc
from collector import ranksets
from collector.analyzers import Finding, hardware

ANALYZER = "stragglers"


@dataclass(frozen=True)
class Settings:
    window: int = 12  # recent steps a rank is judged over (8 let 2%-jitter noise through, bench/detection.py)
    z: float = 4.0  # robust z-score, across ranks, of a rank's typical compute ratio
    min_slowdown: float = 0.03  # and at least this much slower than the median rank
    jitter_floor: float = 0.01  # the MAD is floored at this fraction (1%)
    widespread_cv: float = 0.10  # cross-rank spread of compute (robust CV) that makes random slowness a finding


def analyze(steps: pd.DataFrame, ranks: pd.DataFrame | None = None, settings: Settings = Settings(),
            devices: pd.DataFrame | None = None) -> list[Finding]:
    """Findings for one run from its rank-steps, judged over the last `settings.window` steps.

    `steps`: run_id, rank, step, duration_s, compute_s, comm_wait_s (data_s optional); where
    compute_s is null it is taken as duration_s less comm_wait_s and data_s.
    `ranks`: rank, and host and pp_stage where known: placement, for node and stage patterns.
    `devices`: rank, metric, value: recent device samples, attached as evidence (clocks,
    temperature, throttle reasons of the suspects against their peers).
    """
    if steps.empty or steps["rank"].nunique() < 3:
        return []  # robust statistics need peers
    s = settings
    wait = steps["comm_wait_s"].fillna(0.0)
    # a loop that times no phases reports no compute: its step time less what it waited for
    data = steps["data_s"].fillna(0.0) if "data_s" in steps else 0.0
    compute = steps["compute_s"].fillna(steps["duration_s"] - wait - data)
    steps = steps.assign(comm_wait_s=wait, compute_s=compute).sort_values(["step", "rank"])
    steps["ratio"] = steps["compute_s"] / steps.groupby("step")["compute_s"].transform("median")
    run_id = str(steps["run_id"].iloc[0])
    last_steps = np.sort(steps["step"].unique())[-s.window:]
    recent = steps[steps["step"].isin(last_steps)]
    typical = recent.groupby("rank").agg(ratio=("ratio", "median"), wait=("comm_wait_s", "median"))
    center = typical["ratio"].median()
    spread = max(1.4826 * (typical["ratio"] - center).abs().median(), s.jitter_floor * center)
    slow = typical[((typical["ratio"] - center) / spread > s.z) & (typical["ratio"] > center * (1 + s.min_slowdown))
                   & (typical["wait"] <= typical["wait"].median())]
    if not slow.empty:
        elevated = typical.index[typical["ratio"] > center * (1 + s.min_slowdown / 2)]
        finding = _suspect_finding(run_id, steps, recent, sorted(int(r) for r in slow.index), ranks, s,
                                   {int(r) for r in elevated})
        finding.evidence.update(_device_evidence(devices, finding.ranks))
        if found := hardware.causes(devices, finding.ranks):  # what the GPUs say of why
            finding.evidence["hardware"] = found
            finding.summary += "; " + hardware.describe(found)
        if "data_s" in recent:
            finding.evidence["data_s"] = float(recent.loc[recent["rank"].isin(finding.ranks), "data_s"].median())
            finding.evidence["peer_data_s"] = float(recent.loc[~recent["rank"].isin(finding.ranks), "data_s"].median())
        return [finding]
    lost = _lost_seconds(recent)
    slowest = recent.loc[recent.groupby("step")["compute_s"].idxmax(), "rank"]
    cv = 1.4826 * (recent["ratio"] - 1).abs().median()
    if cv >= s.widespread_cv and slowest.nunique() >= min(3, len(last_steps)):
        return [Finding(
            run_id, "widespread", sorted(int(r) for r in slowest.unique()), int(last_steps[0]), int(last_steps[-1]),
            "warning", float(recent.groupby("step")["ratio"].max().median()),
            f"compute varies {100 * cv:.0f}% across ranks and a different rank is slowest at each step "
            f"({slowest.nunique()} ranks in {len(last_steps)} steps), none persistently, as with uneven "
            f"sequence lengths: {lost.mean() * 1e3:.1f} ms lost per step",
            {"cross_rank_cv": float(cv), "slowest_rank_by_step": {int(k): int(v) for k, v in zip(recent.loc[slowest.index, "step"], slowest)},
             **_cost(recent, lost)}, analyzer=ANALYZER)]
    return []


def _suspect_finding(run_id: str, steps: pd.DataFrame, recent: pd.DataFrame, suspects: list[int],
                     ranks: pd.DataFrame | None, s: Settings, elevated: set[int]) -> Finding:
    """The finding for persistently slow ranks: their pattern, evidence and cost.

    The suspects are a node (or a stage) when they all share one host (stage) and that group's
    ranks are nearly all slow too (`elevated`: above the median by half the threshold): a
    slightly slow node shows first as a few of its ranks crossing the threshold."""
    kind, where = "rank", ranksets.phrase(suspects)
    if ranks is not None and not ranks.empty:
        placed = ranks.set_index("rank")
        for column, label in (("host", "node"), ("pp_stage", "stage")):
            if column in placed and placed[column].notna().all() and placed[column].nunique() > 1:
                groups = placed.loc[placed.index.isin(suspects), column].unique()
                members = sorted(int(r) for r in placed.index[placed[column].isin(groups)])
                if len(groups) == 1 and len(members) > 1 and len(elevated & set(members)) >= 0.75 * len(members):
                    suspects = members
                    kind, where = label, f"{label} {groups[0]} ({ranksets.phrase(members)})"
                    break
    peers = recent[~recent["rank"].isin(suspects)]
    slowdown = float(recent.loc[recent["rank"].isin(suspects), "ratio"].median())
    # since when: the last time their typical ratio was under halfway to today's, plus half a window of lag
    mine = steps[steps["rank"].isin(suspects)].groupby("step")["ratio"].median()
    rolling = mine.rolling(s.window, min_periods=1).median()
    under = rolling.index[rolling <= 1 + (slowdown - 1) / 2]
    first = int(under[-1]) + 1 - s.window // 2 if len(under) else int(mine.index[0])
    first = min(max(first, int(mine.index[0])), int(recent["step"].min()))
    lost = _lost_seconds(steps[steps["step"] >= first])
    cost = _cost(steps[steps["step"] >= first], lost)
    severity = "critical" if slowdown >= 1.2 else "warning"
    plural = kind == "rank" and len(suspects) > 1
    computes, its, it = ("compute", "their", "them") if plural else ("computes", "its", "it")
    return Finding(
        run_id, kind, suspects, first, int(steps["step"].max()), severity, slowdown,
        f"{where} {computes} {100 * (slowdown - 1):.0f}% slower than {its} peers since step {first}; "
        f"the others wait for {it}: {cost['lost_s_per_step'] * 1e3:.1f} ms per step "
        f"({cost['lost_percent']:.1f}% of step time, {cost['gpu_hours_lost']:.3f} GPU-hours so far)",
        {"compute_s": float(recent.loc[recent["rank"].isin(suspects), "compute_s"].median()),
         "peer_compute_s": float(peers["compute_s"].median()),
         "comm_wait_s": float(recent.loc[recent["rank"].isin(suspects), "comm_wait_s"].median()),
         "peer_comm_wait_s": float(peers["comm_wait_s"].median()),
         "compute_ratio_by_rank": {int(r): float(v) for r, v in recent.groupby("rank")["ratio"].median().items()},
         **cost}, analyzer=ANALYZER)


def _device_evidence(devices: pd.DataFrame | None, suspects: list[int]) -> dict:
    """Median of each device metric for the suspects and for their peers, e.g. a throttled GPU's
    lower SM clock and higher temperature; clock-event reasons by name, those set in at least
    half of the samples."""
    if devices is None or devices.empty:
        return {}
    mine = devices["rank"].isin(suspects)
    evidence = {}
    for metric, group in devices.groupby("metric"):
        who = {"suspects": group.loc[mine[group.index], "value"], "peers": group.loc[~mine[group.index], "value"]}
        if metric == sc.CLOCK_EVENT_REASONS:
            evidence[metric] = {k: [name for bit, name in sc.CLOCK_EVENT_REASON_BITS.items()
                                    if len(v) and ((v.astype("int64") & bit) > 0).mean() >= 0.5]
                                for k, v in who.items()}
        else:
            evidence[metric] = {k: float(v.median()) for k, v in who.items()}
    return {"devices": evidence}


def _lost_seconds(steps: pd.DataFrame) -> pd.Series:
    """Per step: the slowest rank's compute minus the median compute (what the others wait out)."""
    grouped = steps.groupby("step")["compute_s"]
    return grouped.max() - grouped.median()


def _cost(steps: pd.DataFrame, lost: pd.Series) -> dict:
    step_time = steps.groupby("step")["duration_s"].median()
    world = steps["rank"].nunique()
    return {"lost_s_per_step": float(lost.mean()),
            "lost_percent": float(100 * lost.sum() / step_time.sum()) if step_time.sum() else 0.0,
            "gpu_hours_lost": float(lost.sum() * world / 3600),
            "steps": int(len(lost))}
