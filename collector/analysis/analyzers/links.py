"""Slow communication links: which process group's collectives lost bandwidth, and whose link.

A pure function from recent collective ops (one row per rank and collective)
to findings. Every rank of a group waits out the same slow collective, so a
link is judged per group: its bus bandwidth (nccl-tests busbw, comparable
across group sizes; of each collective, the best its members saw, since the
others also waited for late entrants) against peer groups running the same collective on the
same number of ranks, such as the data-parallel groups of the other pipeline
stages: each step, a group's bandwidth over its peers' median in that step
(a loaded host or a busy network slows every group of a step alike, and this
ratio leaves that out), then over the window the median of those ratios,
compared across groups by robust statistics (median and MAD, the MAD floored
at a relative jitter, and at what the step-to-step jitter of the ratios leaves
in a median of the window's steps); with few peers, whose MAD a noisy one inflates, a group
at under half its peers' bandwidth is slow whatever the spread. Either way it
must run well below its peers. Collectives of a few bytes (a gradient norm's
all-reduce) take as long as the link's latency whatever its bandwidth, and a
send or receive lasts until its peer reaches it (a pipeline's bubble): both
are left out. A rank's link serves every group the rank is in, so when slow groups
share ranks (its data-parallel and its tensor-parallel group, say) those
ranks are named; otherwise each slow group is a finding of its own, naming
its members. Compute is untouched by a slow link, which is how this differs
from a straggler. The cost is the collective time beyond the peers', per step.
"""

import math
from dataclasses import dataclass, replace

import pandas as pd

from collector import ranksets
from collector.analysis.analyzers import Frames, Reads
from collector.analysis.analyzers.stragglers import MEDIAN_NOISE
from collector.findings import Finding

ANALYZER = "links"
_POINT_TO_POINT = ("send", "recv", "batch_isend_irecv")


@dataclass(frozen=True)
class Settings:
    window: int = 12  # recent steps a group is judged over
    z: float = 4.0  # robust z-score of a group's busbw below its peers'
    min_drop: float = 0.2  # and at least this much below the peers' median
    jitter_floor: float = 0.02  # the MAD is floored at this fraction of the median
    min_peers: int = 3  # groups of one shape needed to judge any of them
    severe_drop: float = 0.5  # or, whatever the spread, at under this share of its peers' bandwidth
    min_bytes: int = 4096  # smaller collectives are latency-bound: their bandwidth says nothing of the link


# judged every half window (windows overlap by half, so each step is in one): a link's bandwidth moves slowly
READS = Reads(history=Settings().window, linger=Settings().window // 2, collectives=True)


def judge(frames: Frames, settings: Settings = Settings()) -> list[Finding]:
    """The window ending at each new step on a multiple of half a window (and at the newest step of
    a run that ended), over the collectives of its steps; one finding per run of windows alike."""
    if frames.collectives is None or frames.collectives.empty:
        return []
    stride = max(settings.window // 2, 1)
    # a window is judged once full: the first steps (process groups set up, caches warmed) are no baseline
    ends = [e for e in frames.new_steps["step"].unique() if e % stride == 0 and e + 1 >= settings.window]
    if frames.ended_ns is not None and frames.last >= frames.first_new:
        ends.append(frames.last)
    found: list[Finding] = []
    for end in sorted(set(ends)):
        steps = frames.steps_after(end - settings.window)
        steps = steps[steps["step"] <= end]
        ops = frames.collectives[
            (frames.collectives["step"] > end - settings.window) & (frames.collectives["step"] <= end)
        ]
        for f in analyze(ops, float(steps["duration_s"].median()), settings):
            assert f.step_start is not None, "the collectives analyzer judges steps"
            same = next(
                (
                    g
                    for g in found
                    if (g.kind, g.ranks) == (f.kind, f.ranks)
                    and g.step_end is not None
                    and g.step_end >= f.step_start - stride
                ),
                None,
            )
            if same:
                found[found.index(same)] = replace(f, step_start=same.step_start)
            else:
                found.append(f)
    return found


def analyze(ops: pd.DataFrame, step_s: float | None = None, settings: Settings = Settings()) -> list[Finding]:
    """Findings for one run from its collectives over the last `settings.window` steps.

    `ops`: run_id, rank, step, name, comm_group, group_size, duration_s, busbw_gbps, and optionally
    seq (the collective's in its group), bytes and role (the group's DeviceMesh dimension: peers are
    groups of one dimension); rows without a group or a bandwidth are ignored. `step_s`: the typical
    step time, for the cost as a share of it."""
    ops = ops.dropna(subset=["comm_group", "group_size", "busbw_gbps"])
    if "bytes" in ops:
        ops = ops[ops["bytes"] >= settings.min_bytes]
    ops = ops[~ops["name"].isin(_POINT_TO_POINT)]
    if ops.empty:
        return []
    ops = ops.assign(role=ops["role"].fillna("") if "role" in ops else "")
    s = settings
    last_steps = sorted(ops["step"].unique())[-s.window :]
    recent = ops[ops["step"].isin(last_steps)]
    # A rank's collective lasts from its entry to the end: the ranks that came early also waited
    # for the last one. The rank that entered last saw the transfer alone, so each collective's
    # bandwidth is its members' best, and its time their shortest (a collective: one sequence number
    # of its group, where the rows carry it); a step's, the median of its collectives' bandwidths
    # (tensor parallelism runs dozens a step) and the sum of their times.
    one = ["comm_group", "step", "name", *(["seq"] if "seq" in recent else [])]
    each = (
        recent.groupby(one)
        .agg(
            size=("group_size", "first"),
            role=("role", "first"),
            busbw=("busbw_gbps", "max"),
            seconds=("duration_s", "min"),
        )
        .groupby(["comm_group", "step", "name"])
        .agg(size=("size", "first"), role=("role", "first"), busbw=("busbw", "median"), seconds=("seconds", "sum"))
        .reset_index()
    )
    each["ratio"] = each["busbw"] / each.groupby(["step", "name", "size", "role"])["busbw"].transform("median")
    groups = each.groupby("comm_group").agg(
        name=("name", "first"),
        size=("size", "first"),
        role=("role", "first"),
        busbw=("busbw", "median"),
        ratio=("ratio", "median"),
        seconds=("seconds", "sum"),
    )
    groups["per_step_s"] = groups["seconds"] / len(last_steps)
    groups["members"] = recent.groupby("comm_group")["rank"].agg(lambda r: frozenset(int(x) for x in r))
    slow = []
    for (name, _, _), peers in groups.groupby(["name", "size", "role"]):
        if len(peers) < s.min_peers:
            continue
        center = peers["ratio"].median()
        rows = each[(each["name"] == name) & each["comm_group"].isin(peers.index)]
        deviation = (rows["ratio"] - rows.groupby("step")["ratio"].transform("median")).abs()
        jitter = 1.4826 * float(deviation.groupby(rows["step"]).median().median())  # of one step's ratios
        spread = max(
            1.4826 * (peers["ratio"] - center).abs().median(),
            MEDIAN_NOISE * jitter / math.sqrt(len(last_steps)),
            s.jitter_floor * center,
        )
        unlike = ((center - peers["ratio"]) / spread > s.z) | (peers["ratio"] < s.severe_drop * center)
        low = peers[unlike & (peers["ratio"] < (1 - s.min_drop) * center)]
        busbw = peers["busbw"].median()
        slow += [(group, row, busbw, peers["per_step_s"].median()) for group, row in low.iterrows()]
    if not slow:
        return []
    run_id, first, end = str(ops["run_id"].iloc[0]), int(last_steps[0]), int(last_steps[-1])
    shared = frozenset.intersection(*(row["members"] for _, row, _, _ in slow))
    if len(slow) > 1 and shared:
        return [_finding(run_id, first, end, sorted(shared), slow, step_s)]
    return [_finding(run_id, first, end, sorted(entry[1]["members"]), [entry], step_s) for entry in slow]


def _finding(run_id: str, first: int, end: int, ranks: list[int], slow: list, step_s: float | None) -> Finding:
    lost = sum(max(row["per_step_s"] - peer_s, 0.0) for _, row, _, peer_s in slow)
    factor = max(center / row["busbw"] for _, row, center, _ in slow)
    where = f"rank {ranks[0]}'s link" if len(ranks) == 1 else f"a link among {ranksets.phrase(ranks)}"
    groups = "; ".join(
        f"{row['name']} in group {group} runs at {row['busbw']:.3g} GB/s busbw against {center:.3g} for its peers"
        for group, row, center, _ in slow
    )
    cost = f"{lost * 1e3:.1f} ms of collective time per step"
    if step_s:
        cost += f" ({100 * lost / step_s:.1f}% of step time)"
    return Finding(
        run_id,
        "link",
        ranks,
        first,
        end,
        "critical" if factor >= 2 else "warning",
        float(factor),
        f"{where} is slow: {groups}; {cost}",
        {
            "groups": {
                str(group): {
                    "op": row["name"],
                    "busbw_gbps": float(row["busbw"]),
                    "peer_busbw_gbps": float(center),
                    "members": sorted(row["members"]),
                }
                for group, row, center, _ in slow
            },
            "lost_s_per_step": float(lost),
            **({"lost_percent": float(100 * lost / step_s)} if step_s else {}),
        },
        analyzer=ANALYZER,
    )
