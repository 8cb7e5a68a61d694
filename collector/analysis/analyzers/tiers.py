"""Memory-tier analysis: when training waits on copies between GPU, host memory and disk, which tier
limits them, and what overlapping them with compute would give (after Fuyou, which overlaps SSD-CPU
swaps with the GPU's compute, and ZeRO-Infinity, which runs them after backward).

A pure function of the run's newest `window` steps (and the steps before them, a rank's own baseline),
judged once a pass at its newest step:

- `swap_bound`: ranks whose steps wait on transfers (time a copy was in flight and no compute phase
  covered it, the agent's interval arithmetic) for a large share of the step. Its summary says which
  tier limits the copies: the bandwidth each direction achieved against the disk's own, probed with large
  sequential I/O at the job's start; near the probe the disk is the limit, far below it the access
  pattern is (small blocks, no prefetch). And what overlap would give: the step predicted with its
  swaps, the host optimizer and the rest of the step overlapped (the longest of the three; on ranks that
  compute on the host's CPUs, the copies' CPU time and the host optimizer stay on the compute's side)
  against run back to back (their sum), the slowest rank setting each step.
- `slow_disk`: ranks whose swaps to and from disk run at a fraction of their peers' bandwidth, or of
  their own before (a disk that slowed, or another job on it); alone and slow from the start, a
  fraction of the disk's probe. Judged over a whole window only: over the first steps, a noisy step
  or two of a busy disk would be the window's median.
- `checkpoint_contention`: a checkpoint written to disk while ranks swapped there (the ranks of its
  host) cut the swaps' bandwidth: the bandwidth lost is the checkpoint's, not the disk's.
- `host_bound`: ranks whose host work (`agent.host_work`: an offloaded optimizer's step) takes most of the
  step. And what would help: the step with the host work overlapped with the rest (the longest part, as
  for swaps) and with a host twice as fast, back to back and overlapped.
"""

from dataclasses import dataclass

import numpy as np
import pandas as pd

from collector import ranksets
from collector.analysis.analyzers import Frames, Reads, Tiers
from collector.analysis.analyzers.changepoint import change_point
from collector.findings import Finding
from collector.quantities import bandwidth, data_size, duration, percent
from rankwatch.agent import semconv as sc

ANALYZER = "tiers"
SWAP_BOUND, SLOW_DISK, CONTENTION, HOST_BOUND = "swap_bound", "slow_disk", "checkpoint_contention", "host_bound"
MAX_RANKS = 64  # ranks whose figures a finding's evidence lists
MAX_JUDGED = 64  # steps of one pass judged as the newest, at most


@dataclass(frozen=True)
class Settings:
    window: int = 8  # steps a verdict reads: one noisy step is no episode
    swap_share: float = 0.3  # a step waits on transfers for at least this share of it
    slow_ratio: float = 1 / 3  # a slow disk gives at most this share of the bandwidth its peers' (its own) did
    probe_floor: float = 0.1  # alone and slow from the start: at most this share of the probe's bandwidth
    pattern_share: float = 0.5  # below this share of the probe, the access pattern limits the copies
    contention_loss: float = 0.2  # a checkpoint cut the swaps' bandwidth by at least this share
    # host work takes at least this share of the step: the step's longest part, which no overlap of the
    # device's work with it shortens, and the device idles at least as long as it works
    host_share: float = 0.5
    host_speedup: float = 2.0  # the what-if's faster host (more cores for it, or a fused optimizer)


READS = Reads(history=4 * Settings().window, linger=Settings().window // 2, tiers=True)


def judge(frames: Frames, settings: Settings = Settings()) -> list[Finding]:
    """The new steps' verdicts, each step judged as if it were the newest (at most `MAX_JUDGED` of them,
    evenly, where a pass brings more: a run judged after the fact), a finding per episode of the pass."""
    if frames.tiers is None or frames.new_steps.empty:
        return []
    tiers = frames.tiers()
    if tiers.steps.empty:
        return []
    first = max(frames.first_new, int(tiers.steps["step"].min()))
    ends = range(frames.last, first - 1, -max(1, -(-(frames.last - first + 1) // MAX_JUDGED)))
    episodes: dict[tuple, Finding] = {}
    for end in sorted(ends):
        for f in analyze(frames.run_id, tiers, frames.ranks, end, settings, contention=end == frames.last):
            key = (f.kind, tuple(f.ranks))
            earlier = episodes.get(key)
            assert f.step_start is not None and f.step_end is not None  # over steps, all of them
            episodes[key] = f if earlier is None else f.spanning(min(earlier.step_start or 0, f.step_start), f.step_end)
    return list(episodes.values())


def analyze(
    run_id: str, tiers: Tiers, placement: pd.DataFrame, last: int, s: Settings = Settings(), contention: bool = True
) -> list[Finding]:
    """The findings of the window of steps ending at `last` (see the module's docstring); `contention`: with
    the checkpoints' cost to the swaps (a pass draws it once, at its newest step)."""
    steps = tiers.steps[tiers.steps["step"].between(last - s.window + 1, last)]
    if steps.empty:
        return []
    first = int(steps["step"].min())
    transfers = tiers.transfers[tiers.transfers["step"] <= last] if not tiers.transfers.empty else tiers.transfers
    tiers = Tiers(steps, transfers, tiers.probes, tiers.checkpoints)
    disk = _disk(transfers)
    recent, before = disk[disk["step"] >= first], disk[disk["step"] < first]
    # a disk is judged slow over a whole window: over the first steps' few, a noisy step or two would be its median
    slow = _slow(recent, before, tiers.probes, s) if steps["step"].nunique() >= s.window else {}
    found = []
    if slow:
        found.append(_slow_finding(run_id, slow, steps, first, last))
    bound, shares, onset = _bound(steps, "exposed_s", s.swap_share)
    if bound:
        found.append(_swap_finding(run_id, bound, shares, steps, tiers, recent, slow, onset, last, s))
    busy, host_shares, since = _bound(steps, "host_s", s.host_share)
    if busy:
        found.append(_host_finding(run_id, busy, host_shares, steps, since, last, s))
    if contention:
        found += _contention(run_id, recent, tiers.checkpoints, placement, first, last, s)
    return found


def whatif(steps: pd.DataFrame, host_speedup: float = 1.0) -> dict[str, float]:
    """The step time predicted with swaps, host optimizer and the rest of the step run back to back
    (`serial_s`: their sum) and overlapped (`overlap_s`), the slowest rank setting each step, medians over
    steps; the parts are the slowest rank's. The rest is what is neither an exposed transfer nor the host
    optimizer: compute, data, communication. Overlapped, a rank whose device computes takes the longest of
    the three; a rank that computes on the host's CPUs (`on_cpu`) cannot hide the CPU work of its copies
    (`transfer_cpu_s`: page-cache copies) nor its host optimizer under its compute, which needs the same
    CPUs: it takes the longer of the rest with them and the copies. `host_speedup`: the host optimizer
    that many times faster."""
    measured_host = steps["host_s"].fillna(0.0).to_numpy()
    host = measured_host / host_speedup
    moving = steps["transfer_s"].fillna(0.0).to_numpy()
    rest = np.clip(
        steps["duration_s"].to_numpy() - steps["exposed_s"].fillna(0.0).to_numpy() - measured_host, 0.0, None
    )
    copying = steps["transfer_cpu_s"].fillna(0.0).to_numpy() if "transfer_cpu_s" in steps else np.zeros(len(steps))
    on_cpu = steps["on_cpu"].to_numpy(dtype=bool) if "on_cpu" in steps else np.zeros(len(steps), dtype=bool)
    overlap = np.where(on_cpu, np.maximum(rest + np.minimum(copying, moving) + host, moving), np.maximum(rest, moving))
    parts = pd.DataFrame(
        {
            "step": steps["step"].to_numpy(),
            "serial": rest + moving + host,
            "overlap": np.maximum(overlap, host),
            "rest": rest,
            "transfer": moving,
            "host": host,
            "measured": steps["duration_s"].to_numpy(),
        }
    )
    slowest = parts.loc[parts.groupby("step")["serial"].idxmax()]
    return {
        "serial_s": float(slowest["serial"].median()),
        "overlap_s": float(parts.groupby("step")["overlap"].max().median()),
        "rest_s": float(slowest["rest"].median()),
        "transfer_s": float(slowest["transfer"].median()),
        "host_optimizer_s": float(slowest["host"].median()),
        "transfer_cpu_s": float(np.median(copying)),
        "measured_s": float(parts.groupby("step")["measured"].max().median()),
    }


def _bound(steps: pd.DataFrame, part: str, least: float) -> tuple[list[int], pd.Series, int]:
    """The ranks whose median share of the step that `part` (a column of seconds) takes is at least `least`
    over `steps`, every rank's median share, and the first step a bound rank's share reached it (its
    onset within the window)."""
    share = steps[part].fillna(0.0) / steps["duration_s"]
    shares = share.groupby(steps["rank"]).median()
    bound = sorted(int(r) for r in shares.index[shares >= least])
    onset = int(steps.loc[steps["rank"].isin(bound) & (share >= least), "step"].min()) if bound else -1
    return bound, shares, onset


def bandwidths(transfers: pd.DataFrame) -> pd.DataFrame:
    """Bytes/s each rank achieved in each direction ("src->dst") over `transfers` (index rank, columns directions)."""
    if transfers.empty:
        return pd.DataFrame()
    moved = transfers.assign(direction=transfers["src"] + "->" + transfers["dst"])
    sums = moved.groupby(["rank", "direction"])[["bytes", "seconds"]].sum()
    return (sums["bytes"] / sums["seconds"]).unstack("direction")


def _disk(transfers: pd.DataFrame) -> pd.DataFrame:
    if transfers.empty:
        return transfers
    return transfers[
        ((transfers["src"] == sc.TIER_DISK) | (transfers["dst"] == sc.TIER_DISK)) & (transfers["seconds"] > 0)
    ]


def _slow(recent: pd.DataFrame, before: pd.DataFrame, probes: pd.DataFrame, s: Settings) -> dict[int, dict]:
    """The ranks whose disk swaps are slow over the window (the median of its steps' bandwidths): rank ->
    its bandwidth, the reference it fell below (its peers' or its own before, the higher; a rank alone, also
    a fraction of the probe's, which it falls below when slow from the start) and the first step of its slow
    stretch."""
    if recent.empty:
        return {}
    rates = _per_step(pd.concat([before, recent]))
    first = int(recent["step"].min())
    now = rates[rates.index.get_level_values("step") >= first].groupby("rank").median()
    earlier = rates[rates.index.get_level_values("step") < first].groupby("rank").median()
    probed = probes.groupby("rank")["read_bps"].max() if not probes.empty else pd.Series(dtype=float)
    references = pd.DataFrame(
        {"peers": _others_median(now.to_numpy()), "before": earlier.reindex(now.index).to_numpy()}, index=now.index
    )
    limits = references * s.slow_ratio
    if len(now) == 1:  # alone: its past may be slow too
        limits["probe"] = probed.reindex(now.index) * s.probe_floor
    limits = limits.dropna(axis=1, how="all")
    if limits.empty or limits.columns.empty:
        return {}
    worst = limits.fillna(-1.0).idxmax(axis=1)
    limit = limits.max(axis=1)
    slow = {}
    slower = now.index[(now < limit).to_numpy()]
    behind_peers = now < limits["peers"] if "peers" in limits else pd.Series(False, index=now.index)
    against_peers = _against_peers(rates) if behind_peers[slower].any() else pd.DataFrame()
    for rank in slower:
        of, bound = worst[rank], float(limit[rank])
        mine = rates.loc[rank]
        # its slow stretch ends at its newest slow step (the window's median is slow, so some step is; the newest
        # may be fast again: a fault that ended) and begins where its series changes level: its bandwidth over
        # its peers' at each step where it fell behind its peers (a disk the whole machine shares, slowed for all,
        # moves no onset), else its own bandwidth
        newest_slow = mine.index[(mine < bound).to_numpy()].max()
        relative = against_peers[rank].dropna() if behind_peers[rank] else mine.iloc[:0]
        series = relative if (relative.index <= newest_slow).any() else mine
        onset = _onset(series[series.index <= newest_slow])
        reference = float(references.at[rank, of]) if of in references else float(probed[rank])
        slow[int(rank)] = {"bps": float(now[rank]), "reference_bps": reference, "reference": of, "since_step": onset}
    return slow


def _onset(rates: pd.Series) -> int:
    """The step a rank's series of bandwidths (or of bandwidths over its peers', by step) drops at: where its
    log changes level (a change point, judged on the rank's series, not on a threshold, which a loaded machine
    moves); its first step where it never rose."""
    logs = np.log(rates.to_numpy(dtype=float))
    split = change_point(logs)
    if not split or logs[split:].mean() >= logs[:split].mean():
        return int(rates.index[0])
    return int(rates.index[split])


def _against_peers(rates: pd.Series) -> pd.DataFrame:
    """Each rank-step's bandwidth over the median of its peers' at the same step (index step, a column per rank;
    NaN where the rank or all its peers moved no data at that step)."""
    by_step = rates.unstack("rank")
    ratios = np.full(by_step.shape, np.nan)
    for i, row in enumerate(by_step.to_numpy(dtype=float)):
        present = ~np.isnan(row)
        ratios[i, present] = row[present] / _others_median(row[present])
    return pd.DataFrame(ratios, index=by_step.index, columns=by_step.columns)


def _others_median(values: np.ndarray) -> np.ndarray:
    """For each value, the median of the others (NaN where there are none): from the sorted values, each
    one's removal shifting the middle by one place at most, so thousands of ranks cost one sort."""
    n = len(values)
    if n < 2:
        return np.full(n, np.nan)
    order = np.argsort(values, kind="stable")
    ranked = values[order]
    position = np.empty(n, dtype=np.int64)
    position[order] = np.arange(n)
    m = n - 1  # the others

    def others_at(k: int) -> np.ndarray:  # the k-th of the others, for each value removed
        return np.where(k < position, ranked[k], ranked[min(k + 1, n - 1)])

    if m % 2:
        return others_at((m - 1) // 2)
    return (others_at(m // 2 - 1) + others_at(m // 2)) / 2


def _per_step(transfers: pd.DataFrame) -> pd.Series:
    """Each rank-step's bytes/s over `transfers` (index rank, step)."""
    sums = transfers.groupby(["rank", "step"])[["bytes", "seconds"]].sum()
    return sums["bytes"] / sums["seconds"]


_AGAINST = {"peers": "its peers'", "before": "its own before", "probe": "the disk's probe at start"}


def _slow_finding(run_id: str, slow: dict[int, dict], steps: pd.DataFrame, first: int, last: int) -> Finding:
    ranks = sorted(slow)
    worst = min(ranks, key=lambda r: slow[r]["bps"] / slow[r]["reference_bps"])
    w = slow[worst]
    since = min(v["since_step"] for v in slow.values())
    step_s = steps.groupby("rank")["duration_s"].median()
    others = step_s.drop(index=ranks, errors="ignore")
    took = f"; its steps take {duration(step_s.get(worst, float('nan')))}" + (
        f" where the others' take {duration(others.median())}" if len(others) else ""
    )
    return Finding(
        run_id,
        SLOW_DISK,
        ranks,
        since,
        last,
        "warning",
        float(w["reference_bps"] / max(w["bps"], 1.0)),
        f"{ranksets.phrase(ranks)} swap{'s' if len(ranks) == 1 else ''} to disk at {bandwidth(w['bps'])} since step "
        f"{since}, against {bandwidth(w['reference_bps'])} {_AGAINST[w['reference']]}: the disk slowed, or another "
        f"job uses it{took}",
        {
            "by_rank": {str(r): slow[r] for r in ranks[:MAX_RANKS]},
            "window": [first, last],
        },
        analyzer=ANALYZER,
    )


def _swap_finding(
    run_id: str,
    bound: list[int],
    shares: pd.Series,
    steps: pd.DataFrame,
    tiers: Tiers,
    disk: pd.DataFrame,
    slow: dict[int, dict],
    first: int,
    last: int,
    s: Settings,
) -> Finding:
    mine = tiers.transfers[tiers.transfers["rank"].isin(bound) & (tiers.transfers["step"] >= first)]
    achieved = bandwidths(mine).median()  # each direction's, over the bound ranks
    limit = _limit(disk[disk["rank"].isin(bound)], tiers.probes, slow, s)
    what = whatif(steps)
    share = float(shares[bound].median())
    directions = ", ".join(f"{d} {bandwidth(v)}" for d, v in achieved.items() if pd.notna(v))
    gain = what["serial_s"] - what["overlap_s"]
    summary = (
        f"{ranksets.phrase(bound)} wait{'s' if len(bound) == 1 else ''} on copies between memory tiers for "
        f"{percent(share)} of each step since step {first} ({directions}){limit['said']}; with the swaps overlapped "
        f"with compute a step would take {duration(what['overlap_s'])} against {duration(what['serial_s'])} "
        f"run back to back (predicted from the rest of the step {duration(what['rest_s'])}, the transfers "
        f"{duration(what['transfer_s'])} and the host optimizer {duration(what['host_optimizer_s'])}"
        + (
            f"; on CPUs that also compute the step, the copies' {duration(what['transfer_cpu_s'])} of CPU and the "
            "host optimizer do not hide under it)"
            if "on_cpu" in steps and bool(steps["on_cpu"].all())
            else ": the longest of them)"
        )
    )
    return Finding(
        run_id,
        SWAP_BOUND,
        bound,
        first,
        last,
        "warning",
        share,
        summary,
        {
            "exposed_share": share,
            "exposed_share_by_rank": {str(r): float(shares[r]) for r in bound[:MAX_RANKS]},
            "bandwidth_bps": {d: float(v) for d, v in achieved.items() if pd.notna(v)},
            "limit": limit,
            "whatif": what,
            "saved_s": gain,
        },
        analyzer=ANALYZER,
    )


def _host_finding(
    run_id: str, bound: list[int], shares: pd.Series, steps: pd.DataFrame, first: int, last: int, s: Settings
) -> Finding:
    what, faster = whatif(steps), whatif(steps, s.host_speedup)
    share = float(shares[bound].median())
    host_s = float(steps.loc[steps["rank"].isin(bound), "host_s"].median())
    faster_host = "twice as fast" if s.host_speedup == 2 else f"{s.host_speedup:g} times as fast"
    summary = (
        f"{ranksets.phrase(bound)} spend{'s' if len(bound) == 1 else ''} {percent(share)} of each step on host "
        f"work ({duration(host_s)} per step) since step {first}; overlapped with the rest of the step a step would "
        f"take {duration(what['overlap_s'])} against {duration(what['serial_s'])} back to back, and with a host "
        f"{faster_host} {duration(faster['overlap_s'])} ({duration(faster['serial_s'])} back to back)"
        + (
            ": on CPUs that also compute the step, overlap hides none of it; a faster host step (a fused optimizer, "
            "more threads for it) is what shortens the step"
            if "on_cpu" in steps and bool(steps["on_cpu"].all())
            else ": the device idles while the host works; a faster host step (a fused optimizer, more threads "
            "for it) and overlapping it with the device's compute both shorten the step"
        )
    )
    return Finding(
        run_id,
        HOST_BOUND,
        bound,
        first,
        last,
        "warning",
        share,
        summary,
        {
            "host_share": share,
            "host_share_by_rank": {str(r): float(shares[r]) for r in bound[:MAX_RANKS]},
            "host_s": host_s,
            "whatif": what,
            "host_speedup": s.host_speedup,
            "faster_host": {k: faster[k] for k in ("serial_s", "overlap_s")},
        },
        analyzer=ANALYZER,
    )


def _limit(disk: pd.DataFrame, probes: pd.DataFrame, slow: dict[int, dict], s: Settings) -> dict:
    """Which tier limits the disk copies: the disk (near its probe), a disk that slowed, or the access
    pattern (far below the probe: small blocks, no prefetch)."""
    if disk.empty or probes.empty:
        return {"tier": None, "said": ""}
    reads, writes = disk[disk["src"] == sc.TIER_DISK], disk[disk["dst"] == sc.TIER_DISK]
    probe_read, probe_write = float(probes["read_bps"].median()), float(probes["write_bps"].median())
    efficiency = {}
    if not reads.empty:
        efficiency["read"] = float(reads["bytes"].sum() / reads["seconds"].sum()) / probe_read
    if not writes.empty:
        efficiency["write"] = float(writes["bytes"].sum() / writes["seconds"].sum()) / probe_write
    block = float(disk["bytes"].mean())
    probed = f"the disk probed {bandwidth(probe_read)} read, {bandwidth(probe_write)} write at start"
    if set(disk["rank"].unique()) <= set(slow):
        said, tier = f"; {probed}, and slowed since (slow_disk)", "slow_disk"
    elif min(efficiency.values()) >= s.pattern_share:
        said, tier = f"; the disk is the limit ({probed})", "disk"
    else:
        said = (
            f"; the access pattern is the limit, not the disk ({probed}; "
            f"the swaps move {data_size(block)} at a time: larger blocks or prefetch would help)"
        )
        tier = "access_pattern"
    return {"tier": tier, "efficiency": efficiency, "block_bytes": block, "said": said}


def _contention(
    run_id: str,
    disk: pd.DataFrame,
    checkpoints: pd.DataFrame,
    placement: pd.DataFrame,
    first: int,
    last: int,
    s: Settings,
) -> list[Finding]:
    """A checkpoint written to disk while its host's ranks swapped there, and the bandwidth it cost them."""
    if disk.empty or checkpoints.empty:
        return []
    hosts = placement.drop_duplicates("rank").set_index("rank")["host"] if "host" in placement else pd.Series()

    def host_of(ranks: pd.Series) -> pd.Series:  # a rank of no known host is a host of its own
        return ranks.map(hosts).fillna(ranks.map(lambda r: f"rank {r}"))

    swaps = dict(tuple(disk.groupby(host_of(disk["rank"]))))
    # the ranks of a host write their checkpoint of a step together: one write of the host's disk
    written = checkpoints.groupby([host_of(checkpoints["rank"]), "step"]).agg(
        rank=("rank", "min"), start_ns=("start_ns", "min"), end_ns=("end_ns", "max")
    )
    found = []
    for ckpt in written.itertuples():
        host, step = ckpt.Index
        theirs = swaps.get(host)
        if theirs is None:
            continue
        during = (theirs["start_ns"] < ckpt.end_ns) & (theirs["end_ns"] > ckpt.start_ns)
        if not during.any() or during.all():
            continue
        inside = float(theirs.loc[during, "bytes"].sum() / theirs.loc[during, "seconds"].sum())
        outside = float(theirs.loc[~during, "bytes"].sum() / theirs.loc[~during, "seconds"].sum())
        if inside >= (1 - s.contention_loss) * outside:
            continue
        affected = sorted(int(r) for r in theirs.loc[during, "rank"].unique())
        lost_s = float((theirs.loc[during, "bytes"] / inside - theirs.loc[during, "bytes"] / outside).sum())
        found.append(
            Finding(
                run_id,
                CONTENTION,
                affected,
                max(first, int(theirs.loc[during, "step"].min())),
                last,
                "info",
                1 - inside / outside,
                f"the checkpoint of step {step}, written to the disk {ranksets.phrase(affected)} swap"
                f"{'s' if len(affected) == 1 else ''} to, cut the swaps to {bandwidth(inside)} from "
                f"{bandwidth(outside)} while it wrote ({duration((ckpt.end_ns - ckpt.start_ns) / 1e9)}): "
                f"{duration(lost_s)} of swapping lost to it",
                {
                    "checkpoint_step": int(step),
                    "checkpoint_rank": int(ckpt.rank),
                    "during_bps": inside,
                    "outside_bps": outside,
                    "lost_s": lost_s,
                },
                analyzer=ANALYZER,
            )
        )
    return found
