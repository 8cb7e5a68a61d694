"""Where every rank is: the answers to a `stacks` request (one `rank_stacks` event a rank, docs/telemetry.md)
merged into groups of ranks whose training (main) thread stands at the same place, so that one line reads for
thousands of ranks ("ranks 0-6,8-15: `all_reduce` at train.py:120 <- `train_step` at train.py:98") and the
odd group out, where a hung rank is, stands apart.

A pure function of the answers: the engine reads them (collector/analysis/engine.py, `read_stacks`), the hang
analyzer puts them in its finding's evidence, the query API and `rankwatch stacks` show them.

A place is the innermost few calls the user's code makes: each of the user's frames names what it calls at
its line (`all_reduce` at train.py:120). Frames of libraries (torch, site-packages, the standard library,
rankwatch's agent) are collapsed into the call the user's line made into them, named by the first of them
that does more than pass the call on (a decorator's `wrapper`, nn.Module's `_call_impl`); a run of library
frames that only passes a call on between two of the user's frames is left out. Native frames (an answer read
from outside the rank's process by py-spy has them: libpython's, libgloo's, libnccl's) are a library's. Ranks
whose places agree there are one group, however their library internals or outer frames differ; a group says
which of its ranks were read from outside (`read_by`).
"""

import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from collector import ranksets

DEPTH = 3  # the innermost calls that make a place (and its line)
MAX_FRAMES = 64  # frames of a thread read at most, innermost first: what an answer holds at most
MAX_GROUPS = 16  # groups shown; the ranks of the rest are one group, "elsewhere"
MAX_NAME = 120  # characters of a function's or a file's name shown
MAX_RANGES = 8  # rank ranges a line spells out before it counts the rest
# Where a library's code lives: installed packages, the standard library, torch (installed or built in place),
# rankwatch's agent (its wrappers of collectives), frozen and generated modules ("<frozen runpy>", "<string>")
_LIBRARY = re.compile(r"/(site|dist)-packages/|/lib/python\d[\d.]*/|/torch/|/rankwatch/agent/|^<")
# Functions that only pass a call on: decorators' wrappers, nn.Module's call machinery (and any frame of the
# agent's: _AGENT)
_PASSING = frozenset(
    {"wrapper", "wrapped", "inner", "call", "__call__", "_fn", "decorate_context", "_call_impl", "_wrapped_call_impl"}
)
_AGENT = "/rankwatch/agent/"
NO_STACK = "no stack of its main thread in its answer"
ELSEWHERE = "elsewhere"


class Verdicts(Protocol):
    """What a hang reads of the answers' Flight Recorder entries matched across ranks (collector/analysis/recorded.py's
    Recorded, which reads the analyzers: named here by what it gives, so this module stays below them)."""

    @property
    def verdict(self) -> dict | None: ...

    @property
    def words(self) -> str | None: ...


@dataclass(frozen=True)
class Answers:
    """A stacks request and the answers to it so far, as the engine reads them. `asked`: the ranks asked
    (every rank of the run, where the request named none); `stacks`: (ranks, their main thread's frames as
    the answer gives them, outermost first; None where the answer holds none[, who read them from outside the
    ranks' processes: the answers' `read_by`, None for their own agents]), ranks with the same frames
    together; `state`: the request's (pending until it settles, STACKS_TTL_S after `created_ns`); `recorded`:
    the Flight Recorder entries the answers hold, where read (collector/analysis/recorded.py)."""

    request: int
    state: str
    created_ns: int
    asked: Sequence[int]
    stacks: Sequence[tuple[Sequence[int], object] | tuple[Sequence[int], object, str | None]]
    recorded: "Verdicts | None" = None


@dataclass(frozen=True)
class _Frame:
    file: str
    line: int | None
    function: str
    native: bool = False

    @property
    def library(self) -> bool:
        return self.native or bool(_LIBRARY.search(self.file))

    @property
    def passing(self) -> bool:
        return self.function in _PASSING or _AGENT in self.file  # the agent's frames wrap the user's calls


def merge(answers: Answers, culprits: Iterable[int] = ()) -> dict:
    """The answers as one document: `groups` of ranks by place, the largest first, each with `ranks`,
    `where` (its calls in words, innermost first), `line` ("ranks 0-6,8-15: " and where) and `calls`
    ({calls, in, file, line}: the function called, or None for the innermost frame's own code; the user's
    function, file and line), and `read_by` where some of its ranks were read from outside their processes
    ({reader: ranks}; the line says so); `asked` and `answered`, how many ranks were asked and answered of them;
    `odd`, the index of the odd group out (the minority group, where `culprits` are where one holds them;
    None for one group); the ranks asked that did not answer (`unanswered`); `settled`: whether no more
    can come (every rank asked answered, or the request is no longer pending)."""
    asked = sorted({int(r) for r in answers.asked})
    places: dict[tuple, tuple[list[dict], set[int]]] = {}
    answered: set[int] = set()
    read_by: dict[int, str] = {}  # rank -> who read its answer from outside its process
    for ranks, frames, *by in answers.stacks:
        calls = _calls(frames)
        key = tuple((c["calls"], c["in"], c["file"], c["line"]) for c in calls)
        places.setdefault(key, (calls, set()))[1].update(int(r) for r in ranks)
        answered.update(int(r) for r in ranks)
        if by and by[0]:
            read_by.update(dict.fromkeys((int(r) for r in ranks), by[0]))
    groups: list[dict[str, Any]] = sorted(
        ({"ranks": sorted(ranks), "calls": calls} for calls, ranks in places.values()),
        key=lambda g: (-len(g["ranks"]), g["ranks"][0]),
    )
    odd = _odd(groups, set(culprits))
    if len(groups) > MAX_GROUPS:  # the odd group stays shown; the others past the cut are one
        shown = list(range(MAX_GROUPS - 1))
        if odd is not None and odd not in shown:
            shown[-1] = odd
        rest = sorted(r for i, g in enumerate(groups) if i not in shown for r in g["ranks"])
        odd = None if odd is None else shown.index(odd)
        groups = [groups[i] for i in shown] + [{"ranks": rest, "calls": [], "elsewhere": len(groups) - len(shown)}]
    for g in groups:
        g["where"] = (
            f"{ELSEWHERE} ({g.pop('elsewhere')} places)" if "elsewhere" in g else _where(g["calls"]) or NO_STACK
        )
        g["line"] = f"{_ranks(g['ranks'])}: {g['where']}"
        for who in sorted({read_by[r] for r in g["ranks"] if r in read_by}):
            outside = g.setdefault("read_by", {})[who] = [r for r in g["ranks"] if read_by.get(r) == who]
            g["line"] += f" ({'' if outside == g['ranks'] else _ranks(outside) + ' '}read from outside by {who})"
    unanswered = [r for r in asked if r not in answered]
    asked_answered = len(asked) - len(unanswered) if asked else len(answered)
    return {
        "request": answers.request,
        "state": answers.state,
        "settled": answers.state != "pending" or not unanswered,
        "asked": len(asked),
        "answered": asked_answered,
        "groups": [{k: g[k] for k in ("ranks", "where", "line", "calls", "read_by") if k in g} for g in groups],
        "odd": odd,
        "unanswered": unanswered,
    }


def lines(merged: Mapping) -> list[str]:
    """The merged stacks as lines of text, the odd group out marked, then the ranks that did not answer."""
    shown = [
        g["line"] + ("  (the odd one out)" if i == merged.get("odd") else "") for i, g in enumerate(merged["groups"])
    ]
    if merged["unanswered"]:
        shown.append(f"not answered{'' if merged['settled'] else ' yet'}: {_ranks(merged['unanswered'])}")
    return shown


def odd_words(merged: Mapping) -> str | None:
    """What a hang's summary says of the stacks: where the odd group out is, and where the others are;
    where every rank that answered is, when all are at one place; None before any answered."""
    groups = merged["groups"]
    if not groups:
        return None
    if merged.get("odd") is None:
        return f"every rank that answered is at {groups[0]['where']}" if len(groups) == 1 else None
    odd = groups[merged["odd"]]
    others = [g for i, g in enumerate(groups) if i != merged["odd"]]
    most = max(others, key=lambda g: len(g["ranks"]))
    count = sum(len(g["ranks"]) for g in others)
    return f"{odd['line']}; {count} other rank{'s' * (count != 1)}, most at {most['where']}"


def _calls(frames: object) -> list[dict]:
    """The place of one main thread: its innermost DEPTH calls from the user's frames (all its frames are
    a library's: its innermost frame, as its own); [] for frames that are not a list of frames."""
    if not isinstance(frames, list):
        return []
    read = [f for f in (_frame(f) for f in reversed(frames[-MAX_FRAMES:])) if f is not None]  # innermost first
    if not read:
        return []
    entries: list[tuple[_Frame, bool]] = []  # (frame, the user's); a library run by the frame named for it
    at = 0
    while at < len(read):
        if not read[at].library:
            entries.append((read[at], True))
            at += 1
            continue
        end = at
        while end < len(read) and read[end].library:
            end += 1
        run = read[at:end]  # innermost first
        named = next((f for f in reversed(run) if not f.passing), None)
        if named is not None or at == 0:  # a run that only passes a call on between user frames is left out
            entries.append((named or run[0], False))
        at = end
    calls = []
    for i, (frame, users) in enumerate(entries):
        if users:
            called = entries[i - 1][0].function if i > 0 else None
            calls.append({"calls": called, "in": frame.function, "file": frame.file, "line": frame.line})
            if len(calls) == DEPTH:
                break
    if not calls:  # a thread in library code alone (a launcher's): its innermost frame
        first = read[0]
        calls.append({"calls": None, "in": first.function, "file": first.file, "line": first.line})
    return calls


def _frame(frame: object) -> _Frame | None:
    """A frame of an answer as read: file and function names cut to MAX_NAME; None for what is not a frame. A Python
    function by its own name, as the rank's agent reads it (`call`), where py-spy gives its qualified one
    (`_traced.<locals>.call`, from 0.4.3 on): ranks in the same place group together however they were read."""
    if not isinstance(frame, dict):
        return None
    file, line, function = frame.get("file"), frame.get("line"), frame.get("function")
    if not isinstance(file, str) or not isinstance(function, str):
        return None
    native = frame.get("native") is True
    if not native:
        function = function.rsplit(".", 1)[-1]
    return _Frame(file[-4 * MAX_NAME :], line if type(line) is int else None, function[:MAX_NAME], native)


def _where(calls: list[dict]) -> str:
    """ "`all_reduce` at train.py:120 <- `train_step` at train.py:98"; the innermost frame's own code as
    "in `compute` at model.py:50"."""
    return " <- ".join(
        f"{'in ' if c['calls'] is None else ''}`{c['in'] if c['calls'] is None else c['calls']}` at {_at(c)}"
        for c in calls
    )


def _at(call: dict) -> str:
    name = os.path.basename(call["file"]) or call["file"]
    name = name if len(name) <= MAX_NAME else name[: MAX_NAME - 3] + "..."
    return name if call["line"] is None else f"{name}:{call['line']}"


def _ranks(ranks: Sequence[int]) -> str:
    """ "ranks 0-6,8-15", "rank 7": ranges as people type them, the rest counted past MAX_RANGES."""
    return f"{'rank' if len(ranks) == 1 else 'ranks'} {ranksets.compact(ranks, MAX_RANGES, dash='-', sep=',')}"


def _odd(groups: list[dict], culprits: set[int]) -> int | None:
    """The odd group out: of the groups smaller than the largest, one holding a culprit, else the smallest;
    where the groups are alike in size, the one group holding culprits; else none."""
    if len(groups) < 2:
        return None
    largest = len(groups[0]["ranks"])
    minority = [i for i, g in enumerate(groups) if len(g["ranks"]) < largest]
    blamed = [i for i, g in enumerate(groups) if culprits & set(g["ranks"])]
    candidates = [i for i in minority if i in blamed] or minority or (blamed if len(blamed) == 1 else [])
    return min(candidates, key=lambda i: (len(groups[i]["ranks"]), i)) if candidates else None
