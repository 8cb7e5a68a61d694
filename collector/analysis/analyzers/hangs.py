"""Hang analysis: the job stopped making progress; which ranks are to blame.

A pure function of the run's rank-steps and heartbeats at a moment `now`. A
stall is no rank-step finishing for longer than a timeout derived from recent
step times (a multiple of the median, never below a floor). The culprits are
found as PyTorch's Flight Recorder analysis finds them: each rank's heartbeat
says the last collective it entered (group and sequence number) and whether
it completed; the ranks blocked in a collective are waiting for the ranks of
the same group that have not entered it (their last sequence number is
lower), and a rank blocked in a send or receive (a pipeline's) waits for its
peer. The culprits are where these waits lead: the ranks waited for that wait
for nobody (a rank hung in its compute). A group's members are every rank, or,
for a group of one DeviceMesh dimension (dp, tp or pp), the ranks that share
the rank's coordinates in the others (the ranks' placement). Ranks whose
heartbeats stopped are culprits too (a dead process), while the others still
send theirs: when every rank has gone quiet together with
the steps, the job has ended (or was killed), and nobody is waiting on anybody.
Silence that falls on a job already hung is no recovery: the hang stays, judged
as it stood when the ranks were last heard from, its finding saying since when
the job is silent, until steps finish again or the run ends. So has a run
whose ranks all said their training loop ended: what follows (a last
checkpoint written to a slow disk, the teardown) is no stall. Nor is a job whose
ranks' heartbeats say they are steps past the newest step judged: those steps'
telemetry is late or lost (analyzers/gaps.py counts it), the job is not stuck.
Nor is a job restoring a rollback's checkpoint: the steps it abandoned are no longer
the run's, but they were progress, and so is training resuming (`Frames.resumed`).
A heartbeat sent between two steps names none: its rank is past the last step it
finished, behind the ranks already in the next. So is a rank whose last heartbeat
names a step it has since finished (a job that ran its last steps between two
beats): that heartbeat says when the rank was alive, not where it is.

Each stall is judged once: the one under way at the moment judged (with the
culprits a pass first named for it, kept for the run's next passes: once the
hung rank is back, the ranks catching up with it are no culprits), and each
stall the new steps closed (a gap between one step's end and the next longer
than the timeout), judged as it stood when it first passed the timeout (with
the culprits a pass named, where one judged it while under way). A pass
whose ranks have not all been heard from since the stall began (heartbeats
delayed, a collector taking the run over) judges from where they stood before
it, and says so; where that names no culprit (every rank was in the same
collective then), it finds nothing, and the passes that follow judge again: a
stall nothing has been heard of since it began is as likely telemetry running
late (a collector or network falling behind) as a hang, and the ranks' next
heartbeats, or their silence, tell which.

A stall also says where every rank's training thread was, once ranks have
answered a stacks request made during it (the live collector makes one when the
stall first fires; `Frames.stacks`): the answers merged into groups of ranks by
place in its evidence, the odd group out in its summary.
"""

from dataclasses import dataclass, replace
from datetime import UTC, datetime

import numpy as np
import pandas as pd

from collector import ranksets
from collector.analysis import stacks
from collector.analysis.analyzers import Frames, Reads
from collector.findings import HANG, HANGS, Finding
from rankwatch.agent.config import HANG_FLOOR_S, HEARTBEAT_S

ANALYZER = HANGS
RECENT = 20  # steps whose typical duration sets the timeout
MAX_PAIRS = 64  # pairs of waiting rank and culprit a finding lists
READS = Reads(history=RECENT, linger=0, every_pass=True, heartbeats=True, stacks=True)


@dataclass(frozen=True)
class Settings:
    factor: float = 5.0  # a stall lasts this many typical steps...
    floor_s: float = HANG_FLOOR_S  # ...and at least this long
    heartbeat_s: float = HEARTBEAT_S  # the agent's heartbeat period
    silent_after: float = 3.0  # heartbeats missed before a rank counts as gone


def judge(frames: Frames, settings: Settings = Settings()) -> list[Finding]:
    """The stalls the new steps closed, and the one under way at `frames.now_ns` (or, for a run
    that ended, at its end)."""
    now = frames.now_ns if frames.ended_ns is None else min(frames.now_ns, frames.ended_ns)
    if _no_stall(frames.steps_after(frames.first_new - 2), now, settings):
        return []
    steps = frames.steps_after(frames.first_new - 2 - RECENT)  # what a stall's timeout reads back, and a step more
    found = []
    resumed = frames.resumed[frames.resumed <= now]  # a rollback's: the steps it abandoned were progress
    ends = np.sort(np.concatenate([steps["end_ts"].to_numpy(), resumed]))
    gaps = np.flatnonzero(np.diff(ends) > settings.floor_s * 1e9)  # a stall lasts the floor at least
    for g in gaps:
        closing = steps.loc[steps["end_ts"] == ends[g + 1], "step"]
        if closing.empty or int(closing.max()) < frames.first_new:
            continue  # closed by a step judged before, or by a rollback's restore (judged while under way)
        before = steps[steps["end_ts"] <= ends[g]]
        timeout = _timeout(before, settings)
        if (ends[g + 1] - ends[g]) / 1e9 > timeout:  # judged as it stood just past its timeout
            at = int(min(ends[g] + (timeout + 1) * 1e9, ends[g + 1] - 1))
            stood = analyze(before, frames.heartbeats, at, settings, frames.ranks)
            first = frames.kept.get(ANALYZER, {}).get("stall")
            if stood and first is not None and first.evidence["last_step_end_ns"] == ends[g]:
                # a pass judged it while under way: the culprits it named (by then the hung rank may have
                # been back, and the ranks catching up with it are no culprits)
                stood = [_restated(first, stood[0])]
            found += [_with_stacks(f, frames, int(ends[g + 1])) for f in stood]
    progressed = int(resumed[-1]) if len(resumed) else None
    current = analyze(steps, frames.heartbeats, now, settings, frames.ranks, progressed)
    return found + [_with_stacks(f, frames) for f in _as_first_judged(current, frames.kept)]


def _with_stacks(finding: Finding, frames: Frames, until_ns: int | None = None) -> Finding:
    """A stall with where every rank was, once ranks have answered a stacks request made during it (the live
    collector makes one when it first fires; `until_ns`: when a stall the steps closed ended): the merged
    stacks in its evidence (`stacks`), and its summary naming the odd group out (collector/analysis/stacks.py);
    and, once every rank asked answered (or the request settled: a rank yet to answer would read as one that
    never entered), what their Flight Recorder entries say matched across ranks (`flight_recorder`,
    collector/analysis/recorded.py), where any answer holds them."""
    if frames.stacks is None:
        return finding
    answers = frames.stacks(finding.evidence["last_step_end_ns"], until_ns)
    if answers is None or not answers.stacks:
        return finding
    merged = stacks.merge(answers, finding.ranks)
    told = stacks.odd_words(merged)
    recorders = answers.recorded if merged["settled"] else None
    matched, found = (recorders.verdict, recorders.words) if recorders is not None else (None, None)
    return replace(
        finding,
        summary=finding.summary
        + (f"; stacks: {told}" if told else "")
        + (f"; flight recorder: {found}" if found else ""),
        evidence={**finding.evidence, "stacks": merged, **({"flight_recorder": matched} if matched else {})},
    )


def _as_first_judged(current: list[Finding], kept: dict) -> list[Finding]:
    """The stall under way, with the culprits it was first judged with (kept for the run's next passes):
    once the hung rank is back, the ranks still catching up with it would be named in its stead until
    the step ends. Its length and score are now's."""
    if not current:
        return current
    (finding,) = current
    first = kept.setdefault(ANALYZER, {}).get("stall")
    if "silent_since_ns" in finding.evidence:  # every rank gone quiet: judged as it stood when last heard from
        return current
    if first is None or first.evidence["last_step_end_ns"] != finding.evidence["last_step_end_ns"]:
        kept[ANALYZER]["stall"] = finding
        return current
    return [_restated(first, finding)]


def _restated(first: Finding, later: Finding) -> Finding:
    """A stall as first judged (its culprits, its waits), with its length and score as judged `later`."""
    stalled_s = later.evidence["stalled_s"]
    return replace(
        first,
        score=later.score,
        summary=_stalled(stalled_s) + first.summary.removeprefix(_stalled(first.evidence["stalled_s"])),
        evidence={**first.evidence, "stalled_s": stalled_s, "first_judged_stalled_s": first.evidence["stalled_s"]},
    )


def _no_stall(recent: pd.DataFrame, now_ns: int, s: Settings) -> bool:
    """Whether no stall can be found, from the rank-steps of the newest step judged before and the new
    ones alone (at 65,536 ranks, those of every history step are millions): no two of their ends, nor
    the newest and `now_ns`, are the floor apart. (Ends of earlier steps can only narrow the gaps.)"""
    if recent.empty:
        return True
    ends = np.sort(recent["end_ts"].to_numpy())
    return bool((np.diff(ends) <= s.floor_s * 1e9).all()) and (now_ns - int(ends[-1])) / 1e9 <= s.floor_s


def _timeout(steps: pd.DataFrame, s: Settings) -> float:
    """A multiple of the recent steps' typical duration, never below the floor."""
    recent = steps[steps["step"] >= steps["step"].max() - RECENT]
    return max(s.floor_s, s.factor * float(recent.groupby("step")["duration_s"].max().median()))


def analyze(
    steps: pd.DataFrame,
    heartbeats: pd.DataFrame,
    now_ns: int,
    settings: Settings = Settings(),
    placement: pd.DataFrame | None = None,
    progressed_ns: int | None = None,
) -> list[Finding]:
    """At most one finding: the stall, and the ranks the others wait for.

    `steps`: run_id, rank, step, end_ts (ns), duration_s.
    `heartbeats`: rank, ts (ns), step, phase, op, group, seq, done, and optionally peer (of a send or
    receive) and role (the group's DeviceMesh dimension); all but rank, ts and step may be null.
    `placement`: rank, dp_rank, pp_stage, tp_rank: whom a group of one mesh dimension holds.
    `progressed_ns`: a later moment the job is known to have progressed at than its steps' ends (a
    rollback's restore: the steps it abandoned are not in `steps`).
    """
    if steps.empty:
        return []
    s = settings
    last_end = max(int(steps["end_ts"].max()), progressed_ns or 0)
    if (now_ns - last_end) / 1e9 <= s.floor_s:  # under the floor no stall is one, whatever the steps' pace
        return []
    recent = steps[steps["step"] >= steps["step"].max() - RECENT]
    typical = float(recent.groupby("step")["duration_s"].max().median())
    timeout = _timeout(steps, s)
    stalled_s = (now_ns - last_end) / 1e9
    if stalled_s <= timeout:
        return []
    run_id = str(steps["run_id"].iloc[0])
    ranks = sorted(int(r) for r in steps["rank"].unique())
    beats = heartbeats[heartbeats["ts"] <= now_ns].sort_values("ts").groupby("rank").tail(1).set_index("rank")
    finished = steps.groupby("rank")["step"].max()
    # a heartbeat naming a step its rank has since finished says when the rank was alive, not where it is
    # (a job that recovered from a hang and ran its last steps between two beats: the hang's last lingers)
    stale = beats["step"].astype("Float64").le(finished.reindex(beats.index)).fillna(False).to_numpy(bool)
    if stale.any():
        beats = beats.assign(**{c: beats[c].mask(stale) for c in beats.columns.drop("ts")})
    silent = sorted(
        r for r in ranks if r not in beats.index or (now_ns - beats.at[r, "ts"]) / 1e9 > s.silent_after * s.heartbeat_s
    )
    if len(silent) == len(ranks):  # every rank went quiet: the job ended or was killed; nobody waits...
        heard = beats["ts"].max() if not beats.empty else None
        if heard is None or pd.isna(heard) or (heard - last_end) / 1e9 <= timeout:
            return []
        # ...unless it was hung while they still spoke: still hung, as it stood then, silent since
        found = analyze(steps, heartbeats[heartbeats["ts"] <= heard], int(heard), settings, placement, progressed_ns)
        for f in found:
            f.score = stalled_s / timeout
            f.summary = f"{_stalled(stalled_s)}{f.summary.removeprefix(_stalled(f.evidence['stalled_s']))}; "
            f.summary += f"every rank silent since {_clock(int(heard))}"
            f.evidence.update(stalled_s=stalled_s, silent_since_ns=int(heard), silent_ranks=ranks)
        return found
    alive = beats.drop(index=[r for r in silent if r in beats.index])
    # whether every rank still heard from was heard since the stall began: until then (their heartbeats
    # delayed, a collector taking the run over) the culprits are judged from where the ranks were before it
    heard_in_stall = bool((alive["ts"] > last_end).all())
    # where each rank is: a rank between steps (its heartbeat names none) is past the last it finished
    position = alive["step"].astype("Float64").fillna(finished.reindex(alive.index).fillna(-1) + 0.5)
    if position.max() > int(steps["step"].max()) + 1:  # the job moved on: the steps between are lost or late
        return []
    blocked = alive[(alive["done"] == False) & alive["seq"].notna()]  # noqa: E712 (nullable column)
    culprits, collective = list(silent), None
    pairs: list[tuple[int, int, str, str]] = []  # the blocked ranks that wait for a culprit itself, in what
    if not blocked.empty:
        waits = _waits(alive, blocked, placement)
        culprits = sorted(set(culprits) | _waited_for(waits, set(blocked.index)))
        named = frozenset(culprits)
        for r in sorted(waits):  # the first MAX_PAIRS: at scale, tens of thousands of ranks may wait for one
            pairs += [(r, c, str(blocked.at[r, "op"]), str(blocked.at[r, "group"])) for c in sorted(waits[r] & named)]
            if len(pairs) >= MAX_PAIRS:
                del pairs[MAX_PAIRS:]
                break
        # the collective shown: where ranks wait for a culprit itself, the most of them; else the newest
        direct = blocked.loc[[w for w, *_ in pairs]] if pairs else blocked.sort_values("seq").tail(1)
        group, seq = direct.groupby(["group", "seq"]).size().sort_values().index[-1]
        op = blocked[(blocked["group"] == group) & (blocked["seq"] == seq)]["op"].iloc[0]
        waiting = sorted(int(r) for r in blocked.index[(blocked["group"] == group) & (blocked["seq"] == seq)])
        collective = {"op": op, "group": group, "seq": int(seq), "waiting_ranks": waiting}
    elif not culprits and not alive.empty:  # no collective information: the ranks at the lowest step
        culprits = sorted(int(r) for r in alive.index[position == position.min()]) if position.nunique() > 1 else []
    if not culprits and not heard_in_stall:  # nothing said since it began: telemetry late, not yet a hang
        return []
    stalled_step = int(steps["step"].max()) + 1
    where = {
        int(r): {"step": _int(beats.at[r, "step"]), "phase": _text(beats.at[r, "phase"])}
        | ({"finished": _int(finished.get(r))} if pd.isna(beats.at[r, "step"]) else {})
        for r in culprits
        if r in beats.index
    }
    p2p = "peer" in blocked and any(pd.notna(blocked.at[w, "peer"]) for w, *_ in pairs)
    if pairs and (p2p or len({(g, int(blocked.at[w, "seq"])) for w, _, _, g in pairs}) > 1):
        shown = ", ".join(f"rank {w} is blocked in {op} of group {g} with rank {p}" for w, p, op, g in pairs[:3])
        summary = (
            f"{_stalled(stalled_s)}: {shown}"
            + (f" and {len(pairs) - 3} more" if len(pairs) > 3 else "")
            + f"; {ranksets.phrase(culprits)} never reached {'it' if len(pairs) == 1 else 'them'}"
            + f" ({_describe(where, silent)})"
        )
    elif collective and culprits:
        summary = (
            f"{_stalled(stalled_s)}: {ranksets.phrase(collective['waiting_ranks'])} "
            f"{'is' if len(collective['waiting_ranks']) == 1 else 'are'} blocked in {collective['op']} "
            f"#{collective['seq']} of group {collective['group']}, which {ranksets.phrase(culprits)} never "
            f"entered"
        )
    elif culprits:
        summary = f"{_stalled(stalled_s)}: {ranksets.phrase(culprits)} stopped ({_describe(where, silent)})"
    else:
        summary = f"{_stalled(stalled_s)}; no rank stands out (all blocked alike)"
    if not heard_in_stall:
        summary += "; not every rank has been heard from since the stall began"
    return [
        Finding(
            run_id,
            HANG,
            culprits,
            stalled_step,
            stalled_step,
            "critical",
            stalled_s / timeout,
            summary,
            {
                "stalled_s": stalled_s,
                "timeout_s": timeout,
                "typical_step_s": typical,
                "last_step_end_ns": last_end,
                "collective": collective,
                "waiting_pairs": [list(p) for p in pairs],
                "silent_ranks": silent,
                "culprit_last_seen": where,
                "heard_in_stall": heard_in_stall,
            },
            analyzer=ANALYZER,
        )
    ]


_COORDINATES = {"dp": ("pp_stage", "tp_rank"), "tp": ("pp_stage", "dp_rank"), "pp": ("dp_rank", "tp_rank")}


def _mesh_groups(placement: pd.DataFrame | None) -> dict[str, pd.Series]:
    """For each DeviceMesh dimension the placement tells, each rank's group of it: its coordinates in the
    other dimensions (a group of one dimension holds the ranks that share them)."""
    if placement is None or placement.empty:
        return {}
    placed = placement.drop_duplicates("rank").set_index("rank")
    return {
        role: pd.Series(list(zip(*(placed[c] for c in others), strict=True)), index=placed.index)
        for role, others in _COORDINATES.items()
        if all(c in placed for c in others) and placed[list(others)].notna().all().all()
    }


def _waits(alive: pd.DataFrame, blocked: pd.DataFrame, placement: pd.DataFrame | None) -> dict[int, frozenset[int]]:
    """Whom each blocked rank waits for: the peer of its send or receive, or the members of its group
    that have not entered its collective (their last is of another group, or an earlier one of it;
    the group's members by its mesh dimension and the placement, else every rank). Worked out once per
    collective and group, whatever the ranks blocked in it (at 65,536 ranks, most of them)."""
    mesh = _mesh_groups(placement)
    members = {role: groups.groupby(groups).groups for role, groups in mesh.items()}  # group -> its ranks
    missing: dict[tuple, frozenset[int]] = {}  # (group, seq, role, mesh group) -> who has not entered
    peers = blocked["peer"] if "peer" in blocked else pd.Series(None, index=blocked.index, dtype=object)
    roles = blocked["role"] if "role" in blocked else pd.Series(None, index=blocked.index, dtype=object)
    waits: dict[int, frozenset[int]] = {}
    for r, group, seq, peer, role in zip(blocked.index, blocked["group"], blocked["seq"], peers, roles, strict=True):
        if peer is not None and pd.notna(peer):
            waits[int(r)] = frozenset({int(peer)})
            continue
        of = mesh[role].get(r) if role in mesh else None
        key = (group, seq, role if of is not None else None, of)
        if key not in missing:
            sub = alive.reindex(members[role][of] if of is not None else alive.index)
            behind = sub["group"].ne(group) | sub["seq"].isna() | (sub["seq"] < seq)
            missing[key] = frozenset(int(m) for m in sub.index[behind.to_numpy()])
        waits[int(r)] = missing[key]
    return waits


def _waited_for(waits: dict[int, frozenset[int]], blocked: set) -> set[int]:
    """The ranks the waits lead to that wait for nobody; where they only go round (a deadlock), the
    ranks of the round. (Ranks share their sets: each set is walked once.)"""
    seen: set[int] = set()
    walked: set[int] = set()
    todo = list({id(peers): peers for peers in waits.values()}.values())
    while todo:
        peers = todo.pop()
        for r in peers - seen:
            seen.add(r)
            if (next_ := waits.get(r)) is not None and id(next_) not in walked:
                walked.add(id(next_))
                todo.append(next_)
    ends = {r for r in seen if r not in blocked}
    return ends or seen


def _stalled(seconds: float) -> str:
    return f"no step has finished for {seconds:.0f} s"


def _clock(ns: int) -> str:
    return f"{datetime.fromtimestamp(ns / 1e9, UTC):%Y-%m-%d %H:%M:%S} UTC"


def _int(v) -> int | None:
    return None if pd.isna(v) else int(v)


def _text(v) -> str | None:
    return None if pd.isna(v) or not v else str(v)


def _after(finished: int | None) -> str:
    return "before its first" if finished is None else f"after step {finished}"


def _describe(where: dict, silent: list[int]) -> str:
    parts = [
        f"rank {r}: no heartbeat"
        if r in silent
        else f"rank {r}: in {w['phase'] or 'no phase'} of step {w['step']}"
        if w["step"] is not None
        else f"rank {r}: between steps, {_after(w['finished'])}"
        for r, w in where.items()
    ]
    parts += [f"rank {r}: never seen" for r in silent if r not in where]
    return "; ".join(parts)
