"""Failures: a rank of the job ended other than cleanly, and the job with it.

A pure function of the run's `rank_failed` events (Frames.failures: each rank's end, its cause told by
the rank itself or, for a rank gone without a word, by its host's sidecar), its placement (each rank's
host), its steps (whether the job went on after) and, for a rank out of memory, its device samples.

When one rank fails, the launcher stops the others (torchrun sends them SIGTERM): every rank of the
job sends an event, and most say only that they were asked to stop. The rank that failed first is the
earliest whose cause is another; where every rank was asked to stop (a preemption, a time limit, a
person), the earliest of them. One critical `failure` finding per attempt of the job (torchrun's restart
count; events without one count as the first): that rank, when, in which step, its cause in words, its
host, the ranks that followed with the last step each stored, and what to do about that cause. A rank gone
without a word is told of by its host's sidecar once the others' ends are known, so it comes after the
ranks stopped with it: while every word of an attempt says "stopped" and some rank of the job has said
nothing, the finding waits for it (GRACE_S at most: that host may have failed, sidecar and all), lest it
name a rank that was only stopped.

A failure holds while the job is down: its span runs from the failed rank's step to the first step no
rank of the attempt finished, and the finding fires until a restart steps past that (it lingers none). A
failure nothing followed stays firing at the run's end: it is how the run ended.
"""

from typing import Any

import pandas as pd

from collector import ranksets
from collector.analysis.analyzers import Frames, Reads
from collector.findings import Finding
from collector.quantities import clock, data_size, percent
from rankwatch.agent import semconv as sc

ANALYZER = "failures"
KIND = "failure"
READS = Reads(history=0, linger=0, every_pass=True, ends_with_run=False, devices=True, failures=True)
RECENT = 3  # the failed rank's last steps whose device samples say how full its memory was
RECENT_S = 60.0  # how far back those samples are read where its steps are not at hand
STACK_LINES = 20  # the stack's last lines the evidence keeps (the innermost frames, the error)...
STACK_CHARS = 4000  # ...and its characters at most
TOLD_LINES = 3  # the stack's last lines what to do quotes
MESSAGE_CHARS = 160  # an exception's message in the summary, its first line cut to this
GROUPS_SHOWN = 3  # groups of followers (by last step, by cause) the summary spells out
GRACE_S = 30.0  # how long ranks that all say they were stopped wait for the word of the rank that failed first
MAX_RANKS = 1024  # ranks the evidence lists (followed, silent, last steps); the summary and counts say them all


def judge(frames: Frames, settings: None = None) -> list[Finding]:
    """One finding per attempt of the job in which a rank failed. An attempt whose ranks all say they were
    stopped waits for the rest of the job's word (the rank that failed first, gone without one, is told of by
    its host's sidecar after the others) or GRACE_S (that host may have failed too), unless the job moved on."""
    failed = frames.failures
    if failed is None or failed.empty:
        return []
    attempts = failed["attempt"].astype("Int64").fillna(0)
    job = {int(r) for r in frames.ranks["rank"]} | set(range(frames.world_size or 0))
    found = []
    for attempt, events in failed.groupby(attempts, sort=True):
        ended_ns = int(events["ts"].max())
        # the job went on after the attempt's last rank ended: a restart (a later attempt's events say so too)
        restarted = not failed[attempts > attempt].empty or bool((frames.steps["end_ts"] > ended_ns).any())
        silent = sorted(job - {int(r) for r in events["rank"]})
        stopped = (events["cause"] == sc.CAUSE_TERMINATED).all()
        if stopped and silent and not restarted and frames.now_ns - ended_ns < GRACE_S * 1e9:
            continue
        found.append(_finding(frames, events, int(attempt), restarted, silent))
    return found


def _finding(frames: Frames, events: pd.DataFrame, attempt: int, restarted: bool, silent: list[int]) -> Finding:
    """The finding of one attempt's events (`restarted`: the job went on after; `silent`: the job's ranks
    that said nothing of how they ended)."""
    events = events.sort_values(["ts", "rank"], kind="stable")
    failing = events[events["cause"] != sc.CAUSE_TERMINATED]
    first = (failing if not failing.empty else events).iloc[0]
    rank, ended_ns = int(first["rank"]), int(events["ts"].max())
    followed = events[events["rank"] != rank].drop_duplicates("rank")
    steps = frames.steps
    step = _step(first)
    stored_before = steps.loc[steps["end_ts"] <= ended_ns, "step"]
    # the steps it cut: from the failed rank's to the first no rank of the attempt finished
    known = [*_ints(events["step"]), *(s + 1 for s in _ints(events["last_step"]))]
    known += [int(stored_before.max()) + 1] if not stored_before.empty else []
    start = step if step is not None else min(known, default=0)
    end = max([start, *known])
    host = _host(frames.ranks, rank)
    known_attempt = bool(events["attempt"].notna().any())
    last_steps = {int(r): _int(s) for r, s in zip(events["rank"], events["last_step"], strict=True)}
    memory = _memory(frames, first) if first["cause"] in (sc.CAUSE_OUT_OF_MEMORY, sc.CAUSE_KILLED_OUT_OF_MEMORY) else {}
    stack = _stack(first["body"]) if first["cause"] in (sc.CAUSE_EXCEPTION, sc.CAUSE_OUT_OF_MEMORY) else None
    summary = (
        f"{_words(first, events, long=True)} {_where(first, step)}"
        + (f" on host {host}" if host else "")
        + f" at {clock(pd.Timestamp(int(first['ts']), unit='ns', tz='UTC'))}"
        + _followers(followed)
        + (
            f"; {ranksets.phrase(silent)} said nothing of how {'it' if len(silent) == 1 else 'they'} ended"
            if silent
            else ""
        )
        + (
            f"; attempt {attempt}: {'a restart followed' if restarted else 'no restart has followed'}"
            if known_attempt
            else ""
        )
        + ("; a restart followed" if restarted and not known_attempt else "")
    )
    evidence = {
        "rank": rank,
        "step": step,
        "cause": str(first["cause"]) if pd.notna(first["cause"]) else None,
        "host": host,
        "attempt": attempt if known_attempt else None,
        "restarted": restarted,
        "failed_at_ns": int(first["ts"]),
        "followed": len(followed),
        "followed_ranks": sorted(int(r) for r in followed["rank"])[:MAX_RANKS],
        "followed_by_cause": {
            str(cause): sorted(int(r) for r in of["rank"])[:MAX_RANKS]
            for cause, of in followed.groupby(followed["cause"].fillna("unsaid"))
        },
        "last_steps": dict(sorted(last_steps.items())[:MAX_RANKS]),
        **({"silent": len(silent), "silent_ranks": silent[:MAX_RANKS]} if silent else {}),
        **{key: str(first[key]) for key in ("exception", "message", "signal") if pd.notna(first[key])},
        **({"exit_code": int(first["exit_code"])} if pd.notna(first["exit_code"]) else {}),
        **({"stack": stack} if stack else {}),
        **({"memory": memory} if memory else {}),
        "in_short": _words(first, events, long=False),
        "what_to_do": _what_to_do(first, host, memory, stack, attempt if known_attempt else None, restarted),
    }
    return Finding(
        frames.run_id,
        KIND,
        [rank],
        start,
        end,
        "critical",
        float(len(events["rank"].unique())),
        summary,
        evidence,
        analyzer=ANALYZER,
    )


def _words(e: pd.Series, events: pd.DataFrame, long: bool) -> str:
    """The failed rank's end in words: "rank 2 killed (out of memory?)", "rank 1 raised
    torch.OutOfMemoryError: CUDA out of memory ..." (`long`: with the exception's message)."""
    cause, who = e["cause"], f"rank {int(e['rank'])}"
    signal = f" by {e['signal']}" if pd.notna(e["signal"]) else ""
    if cause in (sc.CAUSE_EXCEPTION, sc.CAUSE_OUT_OF_MEMORY):
        kind = _type(e["exception"])
        if kind is None:
            return f"{who} ran out of memory" if cause == sc.CAUSE_OUT_OF_MEMORY else f"{who} raised an exception"
        message = _first_line(e["message"]) if long else ""
        return f"{who} raised {kind}" + (f": {message}" if message else "")
    if cause == sc.CAUSE_EXIT:
        return f"{who} exited with code {_int(e['exit_code'])}" if pd.notna(e["exit_code"]) else f"{who} exited"
    if cause == sc.CAUSE_KILLED:
        return f"{who} killed{signal}"
    if cause == sc.CAUSE_KILLED_OUT_OF_MEMORY:
        return f"{who} killed{signal} (out of memory?)"
    if cause == sc.CAUSE_TERMINATED:
        every = len(events["rank"].unique()) > 1 and (events["cause"] == sc.CAUSE_TERMINATED).all()
        if every and long:
            return f"every rank stopped{signal or ' by a signal'}, {who} first,"
        return f"{who} stopped{signal or ' by a signal'}"
    return f"{who} failed" + (f" ({cause})" if pd.notna(cause) else "")


def _where(e: pd.Series, step: int | None) -> str:
    if pd.notna(e["step"]):
        return f"in step {step}"
    return "before any step it stored" if step is None else f"after step {step - 1}"


def _step(e: pd.Series) -> int | None:
    """The step the rank failed in: the last it began, else the one after the last it stored."""
    if pd.notna(e["step"]):
        return int(e["step"])
    return None if pd.isna(e["last_step"]) else int(e["last_step"]) + 1


def _followers(followed: pd.DataFrame) -> str:
    """ "; then ranks 0–1, 3 stopped (last step 11)": the ranks that ended after it, by how, with the last
    step each stored."""
    if followed.empty:
        return ""
    said = []
    stopped = followed[followed["cause"] == sc.CAUSE_TERMINATED]
    if not stopped.empty:
        said.append(f"{ranksets.phrase(stopped['rank'])} {_were(stopped)} stopped ({_last_steps(stopped)})")
    others = followed[followed["cause"] != sc.CAUSE_TERMINATED]
    for cause, of in list(others.groupby(others["cause"].fillna("")))[:GROUPS_SHOWN]:
        how = _CAUSE_WORDS.get(str(cause), f"failed too ({cause})" if cause else "failed too")
        said.append(f"{ranksets.phrase(of['rank'])} {how} ({_last_steps(of)})")
    return "; then " + ", ".join(said)


def _were(ranks: pd.DataFrame) -> str:
    return "was" if len(ranks) == 1 else "were"


_CAUSE_WORDS = {  # how the ranks that failed after the first did
    sc.CAUSE_EXCEPTION: "raised too",
    sc.CAUSE_OUT_OF_MEMORY: "ran out of memory too",
    sc.CAUSE_EXIT: "exited too",
    sc.CAUSE_KILLED: "died too",
    sc.CAUSE_KILLED_OUT_OF_MEMORY: "died too (out of memory?)",
}


def _last_steps(ranks: pd.DataFrame) -> str:
    """ "last step 11", "last steps 11 (ranks 0–2), 10 (rank 3)": the step each stored last, by step."""
    steps = ranks["last_step"].astype("Int64")
    groups = sorted(
        (
            (None if pd.isna(s) else int(s), sorted(int(r) for r in of["rank"]))
            for s, of in ranks.groupby(steps, dropna=False)
        ),
        key=lambda g: (g[0] is None, -(g[0] or 0)),
    )
    shown = ["none stored" if s is None else str(s) for s, _ in groups]
    if len(groups) == 1:
        return f"last step {shown[0]}" if groups[0][0] is not None else "no step stored"
    parts = [f"{s} ({ranksets.phrase(r)})" for s, (_, r) in zip(shown, groups, strict=True)][:GROUPS_SHOWN]
    rest = len(groups) - GROUPS_SHOWN
    return "last steps " + ", ".join(parts) + (f" and {rest} more" if rest > 0 else "")


def _host(placement: pd.DataFrame, rank: int) -> str | None:
    hosts = placement.loc[placement["rank"] == rank, "host"].dropna()
    return str(hosts.iloc[0]) if not hosts.empty else None


def _memory(frames: Frames, e: pd.Series) -> dict:
    """How full the failed rank's GPU and host memory were at its last steps (the most in use), where
    samples say: the last RECENT steps it stored, else the RECENT_S before it failed."""
    if frames.devices is None:
        return {}
    rank, until = int(e["rank"]), int(e["ts"])
    mine = frames.steps[frames.steps["rank"] == rank].tail(RECENT)
    since = until - int(RECENT_S * 1e9)
    if not mine.empty:
        since = min(since, int((mine["end_ts"] - mine["duration_s"] * 1e9).min()))
    samples = frames.devices(since, until)
    samples = samples[samples["rank"] == rank]
    peak = samples.groupby("metric")["value"].max()
    found = {}
    if sc.FB_USED_MIB in peak:
        found["gpu_used_bytes"] = float(peak[sc.FB_USED_MIB]) * 2**20
        if sc.FB_TOTAL_MIB in peak:
            found["gpu_total_bytes"] = float(peak[sc.FB_TOTAL_MIB]) * 2**20
    if sc.SYSTEM_MEMORY_UTIL in peak:
        found["host_in_use_fraction"] = float(peak[sc.SYSTEM_MEMORY_UTIL])
    return found


def _what_to_do(
    e: pd.Series, host: str | None, memory: dict, stack: str | None, attempt: int | None, restarted: bool
) -> str:
    """What to do about the failure, by its cause, in the figures it left (the host, the memory, the stack)."""
    cause, rank = e["cause"], int(e["rank"])
    on = f"host {host}" if host else f"rank {rank}'s host"
    if cause == sc.CAUSE_OUT_OF_MEMORY:
        if "gpu_used_bytes" in memory:
            used = data_size(memory["gpu_used_bytes"])
            total = memory.get("gpu_total_bytes")
            full = f"{used} of {data_size(total)} ({percent(memory['gpu_used_bytes'] / total)})" if total else used
            said = f"Its GPU memory at its last steps: up to {full} in use. "
        else:
            said = "No GPU memory samples were stored for it. "
        todo = (
            said + "Reduce the memory a step needs: a smaller micro-batch or sequence length, activation "
            "checkpointing, or sharding the optimizer state and gradients (ZeRO, FSDP)."
        )
    elif cause == sc.CAUSE_KILLED_OUT_OF_MEMORY:
        host_memory = memory.get("host_in_use_fraction")
        said = (
            f" (host memory up to {percent(host_memory)} in use at its last steps)" if host_memory is not None else ""
        )
        todo = (
            f"The kernel's OOM killer killed in the job's cgroup as rank {rank} went{said}: check {on} "
            "(`dmesg -T | grep -i oom`), then reduce the host memory the job takes (DataLoader workers, pinned "
            "buffers, a host-offloaded optimizer) or raise the cgroup's limit."
        )
    elif cause == sc.CAUSE_KILLED:
        todo = (
            f"Rank {rank} said nothing before it went (SIGKILL, a crash): check {on}: `dmesg -T` for the OOM "
            "killer, segfaults and GPU XID errors, the scheduler's log, and the node's health (`nvidia-smi -q`) "
            "before restarting on it."
        )
    elif cause == sc.CAUSE_EXCEPTION:
        told = "\n".join((stack or "").splitlines()[-TOLD_LINES:])
        todo = (
            f"Its stack ends:\n{told}\nFix what raised it, then restart from the last checkpoint."
            if told
            else "Read its output for the traceback, fix what raised it, then restart from the last checkpoint."
        )
    elif cause == sc.CAUSE_EXIT:
        code = f"code {_int(e['exit_code'])}" if pd.notna(e["exit_code"]) else "an error code"
        todo = (
            f"Rank {rank} exited with {code} (sys.exit, os._exit): find what exits so in its output and the code "
            "it runs, then restart from the last checkpoint."
        )
    elif cause == sc.CAUSE_TERMINATED:
        todo = (
            "No rank failed first: something outside the job stopped it (the scheduler preempting it or enforcing "
            "a time limit, a person): check the scheduler's log, then restart from the last checkpoint."
        )
    else:
        todo = f"Read rank {rank}'s output on {on} for why it ended."
    if attempt is not None:
        todo += (
            f" A restart followed attempt {attempt}."
            if restarted
            else f" Attempt {attempt} was not restarted: restart the job once the cause is dealt with."
        )
    return todo


def _stack(body: object) -> str | None:
    """The stack's end (the innermost frames and the error), bounded."""
    if not isinstance(body, str) or not body.strip():
        return None
    return "\n".join(body.rstrip().splitlines()[-STACK_LINES:])[-STACK_CHARS:]


def _type(exception: object) -> str | None:
    """An exception's type as Python names it (a builtin's without "builtins.")."""
    return None if pd.isna(exception) else str(exception).removeprefix("builtins.")


def _first_line(message: object) -> str:
    if pd.isna(message):
        return ""
    line = next((line.strip() for line in str(message).splitlines() if line.strip()), "")
    return line if len(line) <= MESSAGE_CHARS else line[: MESSAGE_CHARS - 1].rstrip() + "…"


def _int(value: Any) -> int | None:
    return None if pd.isna(value) else int(value)


def _ints(values: pd.Series) -> list[int]:
    return [int(v) for v in values.dropna()]
