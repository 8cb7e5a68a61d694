"""Straggler analysis: which ranks are slow, in what pattern, and what it costs.

A pure function from a frame of rank-steps (and the ranks' placement) to
findings, judging each step as if it were the newest. Each rank-step's
own time (its compute, and its wait for input where every rank of the step
reports one: a slow data loader holds the others up as a slow GPU does) is
taken relative to that step's median over ranks; each rank's
typical ratio over a window of steps up to the one judged (its median there,
so one noisy step never counts) is then compared across ranks by robust
statistics: median and MAD. In synchronous training the culprit computes long
and waits little while its victims wait long, so a suspect must also wait
less than its peers, and cost them time over the steps judged (the window's
medians lag a change: a rank slow before a far slower peer took over is
not that peer's straggler).

The threshold follows the run's own noise. The noise is measured on the
steps before (the median over steps of the cross-rank spread of one step's
ratios; with two ranks, the spread of one rank's ratio from step to step,
which neither a persistent slowdown nor its onset inflates), and the spread a rank's typical ratio
is compared with is at least what that noise leaves in a median of `w`
steps. The z-score to pass grows with the number of ranks (a Bonferroni
bound: a clean window flags any rank with a chance of `false_rate`), and the
window grows, up to `max_window`, until a slowdown of `resolution` stands out
of the noise: a noisy run is judged more slowly, never more loosely.

With two ranks there is no majority to compare with: the rank that computes
longer is the straggler when its peer waits for it (its exposed
communication wait exceeds the suspect's by a good part of the compute gap)
and the gap passes both the noise and a floor. One rank has no peers: the
finding says so (kind `not_judged`, severity info), so nobody reads "no
straggler" into silence.

Suspects are grouped into a pattern: a single rank, a node (all ranks of a
host), a pipeline stage (all ranks of a stage), or widespread (time lost to
a different slow rank at each step, as uneven sequence lengths make it, and
only where no rank is the slowest at most steps). The cost is the step time
lost to the slow ranks: per step, the slowest rank's own time minus the
median's, which every other rank waits out. A finding names the phase its
ranks lose the time in (input or compute: whichever holds most of their
excess over their peers), since what to do differs.

In a pipeline-parallel job the stages do different work (the first embeds,
the last computes the loss), so a rank is compared with the ranks of its own
stage (its data- and tensor-parallel peers: the median of its stage is its
step's median), and the stages with each other as if each were one rank (the
compute of its faster ranks, the median wait): a slow stage is found by the
same rules, two stages by the rule of two ranks (the other stage waits for it).
"""

import math
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any

import numpy as np
import pandas as pd

from collector import ranksets
from collector.analysis.analyzers import Frames, Reads, hardware
from collector.analysis.analyzers.changepoint import change_point
from collector.findings import NOT_JUDGED, Finding
from rankwatch.agent import semconv as sc

ANALYZER = "stragglers"
# the phases a finding blames (evidence `phase`): input (the data wait), or the work itself
DATA, COMPUTE = sc.KIND_DATA, sc.KIND_COMPUTE
MEDIAN_NOISE = 1.2533  # the standard error of a median of Gaussian samples, in standard errors of their mean


@dataclass(frozen=True)
class Settings:
    window: int = 12  # fewest steps a rank is judged over (8 let 2%-jitter noise through, bench/detection.py)
    max_window: int = 96  # most: a noisier run is judged over more steps, up to this many
    resolution: float = 0.04  # the window grows until a slowdown this large stands out of the run's noise
    false_rate: float = 1e-5  # chance that a window of a clean run flags any of its ranks
    z: float = 4.0  # the least robust z-score across ranks of a slow rank's typical compute ratio
    min_slowdown: float = 0.03  # and at least this much slower than the median rank
    # with two ranks and no majority, a few percent between them is as often the host (rank 0's logging, a
    # shared core) as a fault: the gap must be this large
    pair_min_slowdown: float = 0.10
    pair_wait_share: float = 0.25  # the peer waits at least this share of the compute gap longer
    jitter_floor: float = 0.005  # the spread is floored at this fraction (0.5%): a quiet job divides by no zero
    widespread_cv: float = 0.10  # cross-rank spread of compute (robust CV) that makes random slowness a finding
    # widespread only while no rank is the slowest at more than this share of the window's steps: one slow
    # rank among few, not yet past the z-score, is a rank finding to come, not uneven work
    widespread_persist: float = 0.5
    # nor while a rank stands out over this many newest steps: a straggler whose window has yet to show it
    widespread_run: int = 3


READS = Reads(history=Settings().max_window, linger=Settings().window // 2, devices=True)


def judge(frames: Frames, settings: Settings = Settings()) -> list[Finding]:
    """The findings of the steps from `frames.first_new` on, each judged on the steps before it."""
    if frames.new_steps.empty:
        return []
    m = _matrices(frames, frames.kept.setdefault(ANALYZER, {}))
    if len(m.ranks) < 2:  # a run of one rank says so; one whose peers have yet to report waits
        alone = frames.world_size == 1 and frames.last >= frames.first_new
        return [_alone(frames.run_id, frames.new_steps)] if alone else []
    return _judge(frames.run_id, m, frames.first_new, frames.ranks, settings, frames.devices)


def _stages(placement: pd.DataFrame | None, ranks: np.ndarray) -> np.ndarray | None:
    """The pipeline stage of each of `ranks`, where the job has two stages or more and every rank's is known."""
    if placement is None or placement.empty or "pp_stage" not in placement:
        return None
    stage = placement.drop_duplicates("rank").set_index("rank")["pp_stage"].reindex(ranks)
    if stage.isna().any() or stage.nunique() < 2:
        return None
    return stage.to_numpy(dtype=np.int64)


def analyze(
    steps: pd.DataFrame,
    ranks: pd.DataFrame | None = None,
    settings: Settings = Settings(),
    devices: pd.DataFrame | None = None,
) -> list[Finding]:
    """The findings at the newest step of `steps` (the verdict a pass ending there draws).

    `steps`: run_id, rank, step, duration_s, compute_s, comm_wait_s (data_s optional); where
    compute_s is null it is taken as duration_s less comm_wait_s and data_s.
    `ranks`: rank, and host and pp_stage where known: placement, for node and stage patterns.
    `devices`: rank, metric, value: recent device samples, attached as evidence (clocks,
    temperature, throttle reasons of the suspects against their peers).
    """
    ranks_seen = np.sort(pd.unique(steps["rank"].to_numpy()))
    if len(ranks_seen) < 2:
        return []
    return _judge(
        str(steps["run_id"].iloc[0]),
        _rows(steps, ranks_seen, _stages(ranks, ranks_seen)),
        int(steps["step"].max()),
        ranks,
        settings,
        None if devices is None else lambda since, until: devices,
    )


@dataclass
class _Matrices:
    """Complete steps as step x rank matrices: own time (compute, and the data wait where every rank of the
    step reports one), exposed wait, own time over the step median, data time (NaN where a rank reports
    none; None where the steps carry none); and per step: the spread of its ratios, its median step time,
    the time the others wait out (the slowest own time less the median), its rank-steps' first and last
    end (None where the steps carry no times)."""

    steps: np.ndarray
    ranks: np.ndarray
    busy: np.ndarray
    wait: np.ndarray
    ratio: np.ndarray
    noise: np.ndarray  # per step: the spread of one step's ratios (with two ranks: rank 0's deviation)
    step_s: np.ndarray
    lost: np.ndarray
    data: np.ndarray | None = None
    ends: np.ndarray | None = None  # per step: [first end, last end] (ns)
    stages: np.ndarray | None = None  # the pipeline stage of each rank, where ranks are compared within stages

    def taken(self, rows) -> "_Matrices":
        """These rows (steps) alone."""
        taken: dict[str, Any] = {f: None if (v := getattr(self, f)) is None else v[rows] for f in _PER_STEP}
        return _Matrices(self.steps[rows], self.ranks, **taken, stages=self.stages)

    def by_stage(self) -> "_Matrices":
        """The stages as if each were one rank: per step, the own time of its faster ranks (the lower
        quartile: a stage is slow when its ranks are slow alike, not when some of them are, a node or a
        straggler among them) and the median wait of its ranks."""
        assert self.stages is not None
        ids = np.unique(self.stages)
        busy = np.stack([np.quantile(self.busy[:, self.stages == k], 0.25, axis=1) for k in ids], axis=1)
        wait = np.stack([np.median(self.wait[:, self.stages == k], axis=1) for k in ids], axis=1)
        median = np.median(busy, axis=1)
        ratio = busy / median[:, None]
        return _Matrices(self.steps, ids, busy, wait, ratio, _spread(ratio), self.step_s, busy.max(axis=1) - median)

    def counted_data(self) -> np.ndarray:
        """The data wait each rank-step's own time counts: its own where every rank of the step reports
        one, else 0."""
        if self.data is None:
            return np.zeros_like(self.busy)
        return np.where(np.isnan(self.data).any(axis=1, keepdims=True), 0.0, self.data)


_PER_STEP = ("busy", "wait", "ratio", "noise", "step_s", "lost", "data", "ends")  # _Matrices' fields by step


def _filled(steps: pd.DataFrame) -> pd.DataFrame:
    """compute_s where null as duration less wait and data (a loop that times no phases); wait null as 0."""
    wait = steps["comm_wait_s"].fillna(0.0)
    data = steps["data_s"].fillna(0.0) if "data_s" in steps else 0.0
    return steps.assign(comm_wait_s=wait, compute_s=steps["compute_s"].fillna(steps["duration_s"] - wait - data))


def _matrices(frames: Frames, kept: dict) -> _Matrices:
    """The complete steps of `frames.steps` as matrices. `kept` (Frames.kept, this analyzer's): the
    last pass's rows, reused for the steps they hold (a step's row is drawn from that step's
    rank-steps alone, which the engine keeps unchanged while it keeps them), and when each rank was
    last seen (the window's ranks are those seen in it); so a pass lays out its new steps alone, and
    writes them after the kept rows (`_appended`). This pass's are left there for the next."""
    last: _Matrices | None = kept.get("buffer")
    steps = frames.steps if last is None else frames.steps_after(kept["upto"])
    if steps.empty:  # nothing after the kept steps: the window is theirs
        assert last is not None
        return _appended(kept, frames.first_step, None)
    seen = steps.groupby("rank", sort=False)["step"].max()  # (a Series by rank, step values)
    if last is not None:
        seen = pd.concat([kept["seen"], seen]).groupby(level=0).max()
    seen = seen[seen >= frames.first_step]  # the ranks of the window
    ranks = np.sort(seen.index.to_numpy())
    stages = _stages(frames.ranks, ranks)
    kept.update(upto=int(steps["step"].max()), seen=seen)
    if last is not None and np.array_equal(last.ranks, ranks) and _same(last.stages, stages):
        new = _rows(steps, ranks, stages)
        if (new.data is None, new.ends is None) == (last.data is None, last.ends is None):
            return _appended(kept, frames.first_step, new)
    m = _rows(frames.steps, ranks, stages)
    kept.update(buffer=m, rows=(0, len(m.steps)))
    return m


def _same(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    if a is None or b is None:
        return a is b
    return bool(np.array_equal(a, b))


def _appended(kept: dict, first_step: int, new: _Matrices | None) -> _Matrices:
    """The kept rows from `first_step` on, then `new`'s, as one view of the buffer kept: new rows are
    written once, after the others, into room left for them (a buffer of half again the window's
    rows, made again when full: at 96 steps, once in 48 passes), not the window copied with them at
    every pass."""
    buffer: _Matrices = kept["buffer"]
    start, stop = kept["rows"]
    start += int(np.searchsorted(buffer.steps[start:stop], first_step))
    n = 0 if new is None else len(new.steps)
    if stop + n > len(buffer.steps):
        window, room = buffer.taken(slice(start, stop)), (stop - start + n) * 3 // 2 + 1
        rows: dict[str, Any] = {
            f: None if (v := getattr(window, f)) is None else np.resize(v, (room, *v.shape[1:])) for f in _PER_STEP
        }
        buffer = _Matrices(np.resize(window.steps, room), window.ranks, **rows, stages=window.stages)
        start, stop = 0, stop - start
    if new is not None:
        for f in ("steps", *_PER_STEP):
            if (into := getattr(buffer, f)) is not None:
                into[stop : stop + n] = getattr(new, f)
    kept.update(buffer=buffer, rows=(start, stop + n))
    return buffer.taken(slice(start, stop + n))


def _spread(ratio: np.ndarray) -> np.ndarray:
    """Per step, the spread of its ratios (with two ranks: rank 0's deviation)."""
    if ratio.shape[1] == 2:
        return ratio[:, 0] - 1.0
    return 1.4826 * np.median(np.abs(ratio - np.median(ratio, axis=1, keepdims=True)), axis=1)


def _rows(steps: pd.DataFrame, ranks: np.ndarray, stages: np.ndarray | None = None) -> _Matrices:
    """The complete steps among `steps`, as rows over `ranks` (those of the whole window: a step some
    rank of the window did not report is incomplete); each rank's ratio is to the median of its step,
    or of its stage's ranks in its step (`stages`: each rank's)."""
    steps = _filled(steps)
    step_ids = np.unique(steps["step"].to_numpy())
    at = (np.searchsorted(step_ids, steps["step"].to_numpy()), np.searchsorted(ranks, steps["rank"].to_numpy()))

    def laid_out(values: np.ndarray, fill: float | int = np.nan) -> np.ndarray:
        matrix = np.full((len(step_ids), len(ranks)), fill)
        matrix[at] = values
        return matrix

    busy, wait = laid_out(steps["compute_s"].to_numpy()), laid_out(steps["comm_wait_s"].to_numpy())
    data = laid_out(steps["data_s"].to_numpy(dtype=float, na_value=np.nan)) if "data_s" in steps else None
    if data is not None:  # a step's data waits count where each of its ranks reports one
        busy = busy + np.where(np.isnan(data).any(axis=1, keepdims=True), 0.0, data)
    with np.errstate(invalid="ignore"):
        if stages is None:
            median = np.median(busy, axis=1, keepdims=True)
        else:
            median = np.empty_like(busy)
            for k in np.unique(stages):
                median[:, stages == k] = np.median(busy[:, stages == k], axis=1, keepdims=True)
        keep = ~np.isnan(busy).any(axis=1) & ~np.isnan(wait).any(axis=1) & (median > 0).all(axis=1)  # complete
    busy, wait, median = busy[keep], wait[keep], median[keep]
    ratio = busy / median
    noise = _spread(ratio)
    step_s = np.median(laid_out(steps["duration_s"].to_numpy())[keep], axis=1)
    lost = (busy - median).max(axis=1)
    data = None if data is None else data[keep]
    ends = None
    if "end_ts" in steps:  # nanoseconds (the engine's), or timestamps (a caller's frame)
        end_ts = steps["end_ts"]
        if not pd.api.types.is_integer_dtype(end_ts):
            end_ts = pd.to_datetime(end_ts, utc=True).astype("int64")
        end = laid_out(end_ts.to_numpy(), fill=0)[keep]  # int64 nanoseconds, exact
        ends = np.stack([end.min(axis=1), end.max(axis=1)], axis=1)
    return _Matrices(step_ids[keep], ranks, busy, wait, ratio, noise, step_s, lost, data, ends, stages)


def _noise(m: _Matrices, i: int, s: Settings) -> float:
    """The run's jitter of one rank-step's ratio, measured on the steps up to row i."""
    recent = m.noise[max(i + 1 - s.max_window, 0) : i + 1]
    if len(m.ranks) == 2:  # from one rank's deviation step to step: neither a steady gap nor its onset widens it
        return float(1.4826 * np.median(np.abs(np.diff(recent))) / math.sqrt(2)) if len(recent) > 1 else 0.0
    return float(np.median(recent))


def _z(n: int, s: Settings) -> float:
    return max(s.z, NormalDist().inv_cdf(1 - s.false_rate / n))


def _window(noise: float, z: float, s: Settings) -> int:
    """Steps over which a slowdown of `resolution` stands out of `noise` at `z`."""
    needed = math.ceil((z * MEDIAN_NOISE * noise / s.resolution) ** 2)
    return min(max(needed, s.window), s.max_window)


def _verdict(m: _Matrices, i: int, s: Settings, placement: list) -> tuple | None:
    """At row i: (kind, ranks, where, window, strength) of the slow ranks, ("widespread", (), "", window,
    cv) or None; strength: the suspects' typical own-time ratio."""
    n, z = len(m.ranks), _z(len(m.ranks), s)
    noise = _noise(m, i, s)
    w = min(_window(noise, z, s), i + 1)
    rows = slice(i + 1 - w, i + 1)
    typical, wait = np.median(m.ratio[rows], axis=0), np.median(m.wait[rows], axis=0)
    center = float(np.median(typical))
    noise_of_typical = MEDIAN_NOISE * noise / math.sqrt(w)
    if n == 2:
        a, b = (1, 0) if typical[1] > typical[0] else (0, 1)
        busy = np.median(m.busy[rows], axis=0)
        if (
            (typical[a] - center) / max(noise_of_typical, s.jitter_floor * center) > z
            and typical[a] > typical[b] * (1 + s.pair_min_slowdown)
            and wait[b] - wait[a] >= s.pair_wait_share * (busy[a] - busy[b])
            and _holds_up(m, rows, [int(m.ranks[a])])
        ):
            return ("rank", (int(m.ranks[a]),), f"rank {int(m.ranks[a])}", w, float(typical[a] / center))
        return None
    spread = max(1.4826 * float(np.median(np.abs(typical - center))), noise_of_typical, s.jitter_floor * center)
    slow = ((typical - center) / spread > z) & (typical > center * (1 + s.min_slowdown)) & (wait <= np.median(wait))
    if slow.any() and _holds_up(m, rows, m.ranks[slow].tolist()):
        elevated = frozenset(int(r) for r in m.ranks[typical > center * (1 + s.min_slowdown / 2)])
        return (
            *_pattern(tuple(int(r) for r in m.ranks[slow]), elevated, placement),
            w,
            float(np.median(typical[slow]) / center),
        )
    last = slice(max(i + 1 - s.window, 0), i + 1)
    cv = 1.4826 * float(np.median(np.abs(m.ratio[last] - 1)))
    slowest = np.argmax(m.busy[last], axis=1)
    most = np.bincount(slowest).max() / len(slowest)  # the share of steps the most often slowest rank is
    if (
        cv >= s.widespread_cv
        and len(np.unique(slowest)) >= min(3, len(slowest))
        and most <= s.widespread_persist
        and not _emerging(m.ratio[max(i + 1 - s.widespread_run, 0) : i + 1], s)
    ):
        return ("widespread", (), "", s.window, cv)
    return None


def _holds_up(m: _Matrices, rows: slice, columns: list[int]) -> bool:
    """Whether the others wait for the suspects (`columns`) over the steps judged (`rows`), on average: the
    window's medians lag a change, so a rank slow before its peer's slowdown began (whose cost the newest
    steps already reverse) is no straggler of the steps judged, whatever its typical ratio still says."""
    return bool(_waited_for(m.taken(rows), columns).mean() > 0)


def _emerging(newest: np.ndarray, s: Settings) -> bool:
    """Whether some rank's median ratio over the `newest` steps stands out of the others' by the least z-score
    a straggler must reach (`z`: it only holds back a widespread verdict): one whose slowdown began too few
    steps ago for its window's median to show it."""
    typical = np.median(newest, axis=0)
    center = float(np.median(typical))
    spread = max(1.4826 * float(np.median(np.abs(typical - center))), s.jitter_floor * center)
    return bool(((typical - center) / spread > s.z).any())


def _stage_verdict(stages: _Matrices, m: _Matrices, i: int, s: Settings) -> tuple | None:
    """At row i, a slow stage: the stages judged as ranks are (one stage's ranks, ..., `stages`, its column)."""
    verdict = _verdict(stages, i, s, [])
    if verdict is None or verdict[0] != "rank":
        return None
    (stage,) = verdict[1]
    assert m.stages is not None
    members = tuple(int(r) for r in m.ranks[m.stages == stage])
    return ("stage", members, f"stage {stage} ({ranksets.phrase(members)})", *verdict[3:], stages, (stage,))


def _judge(
    run_id: str, m: _Matrices, first_new: int, ranks: pd.DataFrame | None, s: Settings, devices
) -> list[Finding]:
    """Each complete step from `first_new` on (rows of `m`) judged on the steps before it: its ranks, and
    apart its stages (a job may have a straggler and a slow stage at once); consecutive steps with the
    same verdict are one finding, drawn at the strongest of them, its onset estimated at the first."""
    placement = _placement(ranks)
    devices = hardware.with_hosts(devices, ranks)  # a host's InfiniBand ports speak for all its ranks
    start = int(np.searchsorted(m.steps, first_new))

    def of_ranks(i: int) -> tuple | None:
        verdict = _verdict(m, i, s, placement)
        return verdict and (*verdict, m, verdict[1])

    found = _episodes(run_id, m, start, of_ranks, s, devices)
    if m.stages is not None:
        stages = m.by_stage()
        found += _episodes(run_id, m, start, lambda i: _stage_verdict(stages, m, i, s), s, devices)
    return found


def _episodes(run_id: str, m: _Matrices, start: int, judged, s: Settings, devices) -> list[Finding]:
    """The findings of the verdicts `judged(row)` draws from row `start` on (each with the matrices and
    columns it was drawn from)."""
    found: list[Finding] = []
    verdicts: dict[int, tuple] = {}  # by row, those drawn
    episode: list | None = None  # [(kind, ranks), first row, last row, strongest row, its strength]
    for i in range(start, len(m.steps)):
        verdict = judged(i) if i + 1 >= s.window else None
        if verdict:
            verdicts[i] = verdict
        if episode and (verdict is None or verdict[:2] != episode[0]):
            found.append(_finding(run_id, m, episode[1], episode[2], episode[3], s, verdicts, devices))
            episode = None
        if verdict and episode:
            episode[2] = i
            if verdict[4] > episode[4]:
                episode[3:] = [i, verdict[4]]
        elif verdict:
            episode = [verdict[:2], i, i, i, verdict[4]]
    if episode:
        found.append(_finding(run_id, m, episode[1], episode[2], episode[3], s, verdicts, devices))
    return found


def _alone(run_id: str, new: pd.DataFrame) -> Finding:
    rank = int(new["rank"].iloc[0])
    return Finding(
        run_id,
        NOT_JUDGED,
        [],
        int(new["step"].min()),
        int(new["step"].max()),
        "info",
        0.0,
        f"not judged: rank {rank} is the run's only rank, with no peers to compare its compute with",
        {"ranks": [rank], "why": "no peers"},
        analyzer=ANALYZER,
    )


def _finding(
    run_id: str,
    m: _Matrices,
    first: int,
    end: int,
    last: int,
    s: Settings,
    verdicts: dict[int, tuple],
    devices,
) -> Finding:
    """The finding of an episode from row `first` to row `end`: drawn at row `last` (its strongest),
    since its onset at `first`."""
    finding = _drawn(run_id, m, first, last, s, verdicts, devices)
    finding.step_end = int(m.steps[end])
    return finding


def _drawn(run_id: str, m: _Matrices, first: int, last: int, s: Settings, verdicts: dict, devices) -> Finding:
    # rows of the episode: each has a verdict, drawn from `source`'s columns (ranks; stages for a stage's)
    kind, suspects, where, w, _, source, columns = verdicts[last]
    history = source.taken(slice(max(last + 1 - s.max_window, 0), last + 1))  # the complete steps of the window
    if kind == "widespread":
        return _widespread(run_id, m.taken(slice(last + 1 - w, last + 1)))
    onset = _onset(source, first, verdicts[first][6], s)
    recent = source.taken(slice(last + 1 - w, last + 1))
    finding = _suspect_finding(
        run_id, history, recent, kind, list(columns), where, min(onset, int(m.steps[first])), list(suspects)
    )
    if devices is not None:  # the samples of the judged steps' time (rank-steps without times: all given)
        ends = recent.ends
        samples = devices(None, None) if ends is None else devices(int(ends[:, 0].min()), int(ends[:, 1].max()))
        finding.evidence.update(_device_evidence(samples, finding.ranks))
        if found := hardware.causes(samples, finding.ranks):  # what the GPUs say of why
            finding.evidence["hardware"] = found
            finding.summary += "; " + hardware.describe(found)
    if recent.data is not None:
        theirs = np.isin(recent.ranks, finding.ranks)
        finding.evidence["data_s"] = _median(recent.data[:, theirs])
        finding.evidence["peer_data_s"] = _median(recent.data[:, ~theirs])
    return finding


def _median(values: np.ndarray) -> float:
    """The median of the values given (NaN left out, as pandas does); NaN for none."""
    values = values[~np.isnan(values)]
    return float(np.median(values)) if values.size else math.nan


def _onset(m: _Matrices, i: int, suspects: tuple, s: Settings) -> int:
    """Since when the suspects found at row i are slow, looked for over the `max_window` steps up to i: where
    the time the others wait out for them (their own time less the others' median, per step) changes
    level, a change point on that series (a threshold on a ratio would move with the noise of the steps
    before: a rank of a small job on a busy host is often slower by chance); the window's first step where
    it was already slow, the level before no less than half the level after."""
    rows = slice(max(i + 1 - s.max_window, 0), i + 1)
    window = m.taken(rows)
    excess = _waited_for(window, list(suspects))
    split = change_point(excess)
    if not split or excess[:split].mean() >= excess[split:].mean() / 2:
        return int(window.steps[0])
    return int(window.steps[split])


def _widespread(run_id: str, recent: _Matrices) -> Finding:
    """The finding for time lost to a different slow rank at each step of `recent`."""
    lost = recent.lost
    slowest = recent.ranks[np.argmax(recent.busy, axis=1)]  # per step
    cv = 1.4826 * float(np.median(np.abs(recent.ratio - 1)))
    return Finding(
        run_id,
        "widespread",
        [],
        int(recent.steps[0]),
        int(recent.steps[-1]),  # the job's pattern, no rank's
        "warning",
        float(np.median(recent.ratio.max(axis=1))),
        f"compute varies {100 * cv:.0f}% across ranks and a different rank is slowest at each step "
        f"({len(np.unique(slowest))} ranks in {len(recent.steps)} steps), none persistently, as with uneven "
        f"sequence lengths: {lost.mean() * 1e3:.1f} ms lost per step",
        {
            "cross_rank_cv": cv,
            "slowest_ranks": sorted(int(r) for r in np.unique(slowest)),
            "slowest_rank_by_step": {int(k): int(v) for k, v in zip(recent.steps, slowest, strict=True)},
            **_cost(lost, recent.step_s, len(recent.ranks)),
        },
        analyzer=ANALYZER,
    )


def _placement(ranks: pd.DataFrame | None) -> list[tuple[str, pd.Series]]:
    """(pattern, group of each rank) for the placements that split the ranks: node by host, stage."""
    if ranks is None or ranks.empty:
        return []
    placed = ranks.set_index("rank")
    return [
        (label, placed[column])
        for column, label in (("host", "node"), ("pp_stage", "stage"))
        if column in placed and placed[column].notna().all() and placed[column].nunique() > 1
    ]


def _pattern(suspects: tuple[int, ...], elevated: frozenset[int], placement: list) -> tuple[str, tuple, str]:
    """(kind, ranks, where): the suspects are a node (or a stage) when they all share one host (stage)
    and that group's ranks are nearly all slow too (`elevated`: above the median by half the
    threshold): a slightly slow node shows first as a few of its ranks crossing the threshold."""
    for label, group in placement:
        groups = group[group.index.isin(suspects)].unique()
        members = tuple(sorted(int(r) for r in group.index[group.isin(groups)]))
        if len(groups) == 1 and len(members) > 1 and len(elevated & set(members)) >= 0.75 * len(members):
            return label, members, f"{label} {groups[0]} ({ranksets.phrase(members)})"
    return "rank", suspects, ranksets.phrase(suspects)


def _suspect_finding(
    run_id: str,
    history: _Matrices,
    recent: _Matrices,
    kind: str,
    columns: list[int],
    where: str,
    first: int,
    suspects: list[int],
) -> Finding:
    """The finding for persistently slow ranks (`suspects`), slow since step `first`: the phase they lose
    the time in, their evidence and cost, from the complete steps of the window (`history`) and of the
    verdict's (`recent`), whose `columns` they are (their ranks; a stage's, the stage)."""
    theirs = np.isin(recent.ranks, columns)
    slowdown = _median(recent.ratio[:, theirs])
    episode = history.taken(slice(int(np.searchsorted(history.steps, first)), None))  # (a view: no copy)
    cost = _cost(_waited_for(episode, columns), episode.step_s, len(episode.ranks))
    data = recent.counted_data()
    compute = recent.busy - data
    excess = {
        phase: _median(values[:, theirs]) - _median(values[:, ~theirs])
        for phase, values in ((DATA, data), (COMPUTE, compute))
    }
    phase = max(excess, key=excess.__getitem__)
    severity = "critical" if slowdown >= 1.2 else "warning"
    plural = kind == "rank" and len(suspects) > 1
    its, it = ("their", "them") if plural else ("its", "it")
    if phase == DATA:
        waits = "wait" if plural else "waits"
        slow = f"{where} {waits} {excess[DATA] * 1e3:.1f} ms per step longer than {its} peers for input (data loading)"
    else:
        computes = "compute" if plural else "computes"
        slower = _median(compute[:, theirs]) / _median(compute[:, ~theirs]) - 1
        slow = f"{where} {computes} {100 * slower:.0f}% slower than {its} peers"
    return Finding(
        run_id,
        kind,
        suspects,
        first,
        int(history.steps[-1]),
        severity,
        slowdown,
        f"{slow} since step {first}; the others wait for {it}: {cost['lost_s_per_step'] * 1e3:.1f} ms per step "
        f"({cost['lost_percent']:.1f}% of step time, {cost['gpu_hours_lost']:.3f} GPU-hours so far)",
        {
            "phase": phase,
            "phase_excess_s": excess[phase],
            "compute_s": _median(compute[:, theirs]),
            "peer_compute_s": _median(compute[:, ~theirs]),
            "comm_wait_s": _median(recent.wait[:, theirs]),
            "peer_comm_wait_s": _median(recent.wait[:, ~theirs]),
            f"time_ratio_by_{'stage' if columns != suspects else 'rank'}": dict(
                zip(recent.ranks.tolist(), np.median(recent.ratio, axis=0).tolist(), strict=True)
            ),
            **cost,
        },
        analyzer=ANALYZER,
    )


def _waited_for(m: _Matrices, columns: list[int]) -> np.ndarray:
    """Per step, what the others wait out for the suspects (`columns` of `m`): the slowest suspect's own time
    less the median of the others' (with two ranks, the whole gap between them)."""
    theirs = np.isin(m.ranks, columns)
    return m.busy[:, theirs].max(axis=1) - np.median(m.busy[:, ~theirs], axis=1)


def _device_evidence(devices: pd.DataFrame | None, suspects: list[int]) -> dict:
    """Median of each device metric for the suspects and for their peers, e.g. a throttled GPU's
    lower SM clock and higher temperature; clock-event reasons by name, those set in at least
    half of the samples."""
    if devices is None or devices.empty:
        return {}
    mine = devices["rank"].isin(suspects)
    evidence: dict[str, dict[str, list[str] | float]] = {}
    for metric, group in devices.groupby("metric"):
        who = {"suspects": group.loc[mine[group.index], "value"], "peers": group.loc[~mine[group.index], "value"]}
        if metric == sc.CLOCK_EVENT_REASONS:
            evidence[metric] = {
                k: [
                    name
                    for bit, name in sc.CLOCK_EVENT_REASON_BITS.items()
                    if len(v) and ((v.astype("int64") & bit) > 0).mean() >= 0.5
                ]
                for k, v in who.items()
            }
        else:
            evidence[metric] = {k: float(v.median()) for k, v in who.items()}
    return {"devices": evidence}


def _cost(lost: np.ndarray, step_time: np.ndarray, world: int) -> dict:
    """What the others' wait (`lost`, per step) costs: per step, as a share of the steps' (median) time,
    in GPU-hours over the `world` ranks."""
    return {
        "lost_s_per_step": float(lost.mean()),
        "lost_percent": float(100 * lost.sum() / step_time.sum()) if step_time.sum() else 0.0,
        "gpu_hours_lost": float(lost.sum() * world / 3600),
        "steps": len(lost),
    }
