"""The ranks' Flight Recorder entries matched across ranks, wherever they came from.

Two ways bring them: dumps imported by hand (`rankwatch import flight-recorder`; collector/reports/postmortem.py
reads their `ops` rows back), and the answers to a stacks request, each rank's carrying its newest entries
(docs/telemetry.md, `rank_stacks`), which `read` turns into the same tables with the import's own reading of an
entry (collector/receive/imports/flight_recorder.py's `read_entry`: the op without its backend's prefix, a retired
gloo entry completed). Either way `match` hands them to the same pure matchers: the collectives some member never
entered or entered differently (analyzers/collectives.py), the sends and receives a peer never matched
(analyzers/p2p.py). `verdict` puts what they found in a hang finding's evidence, `words` in its summary.

A hang's answers are read once each: the engine keeps what it read of a request's answers and hands `read` only
those that came since (`before`: 16,384 ranks' 256 entries are read once, not at every pass), and the matching
runs once per set of answers read (`Recorded.found`).
"""

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import pandas as pd

from collector.analysis.analyzers.collectives import analyze as match_collectives
from collector.analysis.analyzers.p2p import analyze as match_p2p
from collector.findings import Finding
from collector.receive.imports.flight_recorder import process_groups, read_entry

# The matchers' entries (analyzers/collectives.py, p2p.py): sizes and dtypes as JSON text
COLUMNS = (
    *("rank", "group", "seq", "op", "state", "input_sizes", "output_sizes", "input_dtypes", "output_dtypes"),
    *("is_p2p", "peer", "record_id"),
)
GROUPS = ("rank", "group", "desc", "members")
SHOWN = 8  # verdicts a hang's evidence lists (a hang of thousands of tensor-parallel groups may draw thousands)
MAX_RECORDS = 16  # ranks' calls a verdict lists
NOTHING = "no rank missing from a collective or entering it otherwise, no send or receive unmatched"
_LISTS = ("input_sizes", "output_sizes", "input_dtypes", "output_dtypes")
_NOT_READ = (AttributeError, KeyError, TypeError, ValueError, OverflowError, RecursionError)
_INT64 = (-(2**63), 2**63)
_as_json = json.JSONEncoder(default=str).encode  # one encoder for all (json.dumps makes one a call given `default`)


@dataclass(frozen=True)
class Recorded:
    """Ranks' Flight Recorder entries in the tables the matchers take: `entries` (COLUMNS; the entries with a
    sequence number, each rank's in the order it recorded them), `groups` (GROUPS: the process groups each
    rank's Flight Recorder lists, with their member ranks), `dumped` (the ranks whose Flight Recorders these are),
    `unreadable` (ranks whose answer held something else than a Flight Recorder there) and `seen` (the ranks
    whose answers were read, with a Flight Recorder or without)."""

    run_id: str
    entries: pd.DataFrame
    groups: pd.DataFrame
    dumped: tuple[int, ...]
    unreadable: tuple[int, ...] = ()
    seen: tuple[int, ...] = ()

    @cached_property
    def found(self) -> list[Finding]:
        """What the matchers find in them, worked out once (a hang's every pass asks)."""
        return match(self.run_id, self.entries, self.groups, self.dumped)

    @cached_property
    def verdict(self) -> dict | None:
        """What the matchers found, as a hang's evidence (`flight_recorder`): `ranks`, how many ranks' answers
        held Flight Recorder entries; `verdicts`, the first SHOWN findings, each its `summary`, its culprit
        `ranks` and its evidence (the collective or send and receive, its sequence number, the ranks waiting in
        it, those missing or mismatched: analyzers/collectives.py, p2p.py; the calls of the first MAX_RECORDS
        mismatched ranks, `mismatched_count` where more did), none where every group's members
        entered its newest collective alike; `more`, how many findings past those; `unreadable`, ranks whose
        Flight Recorder could not be read, where any. None where no answer held one."""
        if not self.dumped:
            return None
        found = self.found
        told: dict[str, Any] = {
            "ranks": len(self.dumped),
            "verdicts": [{"summary": f.summary, "ranks": f.ranks, **_bounded(f.evidence)} for f in found[:SHOWN]],
            "more": max(len(found) - SHOWN, 0),
        }
        if self.unreadable:
            told["unreadable"] = sorted(self.unreadable)
        return told

    @property
    def words(self) -> str | None:
        """What a hang's summary says of the verdict: its first finding's summary, and how many more; None for none."""
        found = self.found if self.dumped else []
        more = len(found) - 1
        return found[0].summary + (f" (and {more} more)" if more else "") if found else None


def match(run_id: str, entries: pd.DataFrame, groups: pd.DataFrame, dumped: Iterable[int]) -> list[Finding]:
    """The `hang` findings of the ranks' entries (COLUMNS): per process group, the collective some member never
    entered or entered differently, then the sends and receives a peer never matched. `groups`: GROUPS;
    `dumped`: the ranks whose entries these are (a member without any is named). A rank whose first entry is
    not its first ever (a record id past 0: its ring buffer, or the newest entries an answer holds, lost the
    oldest) has its transfers aligned on its last completed ones."""
    dumped = list(dumped)
    p2p = entries["is_p2p"].astype(bool)
    first = entries.groupby("rank")["record_id"].min()
    wrapped = first.index[first > 0]
    found = match_collectives(run_id, entries[~p2p], groups, dumped) if (~p2p).any() else []
    return found + match_p2p(run_id, entries[p2p], groups, dumped, wrapped)


def read(run_id: str, answers: Iterable[tuple[int, str | None]], before: Recorded | None = None) -> Recorded:
    """`before` with the Flight Recorders of `answers` added: (rank, its answer's `flight_recorder` as JSON text:
    torch's dump as the agent gives it; None, or JSON null, where it has none), each entry read as the import
    reads it, those with a process group and a sequence number kept (what the matchers can place). A rank whose
    Flight Recorder or an entry of it is no such thing is `unreadable`, its entries left out."""
    rows: dict[str, list] = {c: [] for c in COLUMNS}
    listed: list[tuple] = []
    dumped, unreadable = list(before.dumped if before else ()), list(before.unreadable if before else ())
    seen = list(before.seen if before else ())
    alike: dict[tuple[str, str], dict] = {}  # a group as a rank lists it -> as read, once for every rank listing it
    texts: dict = {}  # one object for each group, state and JSON text of sizes and dtypes: most entries repeat a few
    for rank, text in answers:
        seen.append(int(rank))
        recorder = _json(text)
        if recorder is None:
            continue
        try:
            groups = _groups(recorder.get("pg_config") or {}, alike)
            read_entries = [read_entry(entry, groups) for entry in recorder["entries"]]
        except _NOT_READ:
            unreadable.append(int(rank))
            continue
        dumped.append(int(rank))
        listed += [(int(rank), name, group["desc"], group["ranks"]) for name, group in groups.items()]
        for entry in read_entries:
            if entry.seq is None or entry.group is None or not _INT64[0] <= entry.seq < _INT64[1]:
                continue  # nothing to match it with
            attrs = entry.attrs
            state = attrs["state"] if isinstance(attrs["state"], str) else None  # (what is no text: no state)
            state = texts.setdefault(state, state)
            group = texts.setdefault(entry.group, entry.group)
            for column, value in zip(COLUMNS, (int(rank), group, entry.seq, entry.name, state)):
                rows[column].append(value)
            for column in _LISTS:
                shown = _as_json(attrs[column])
                rows[column].append(texts.setdefault(shown, shown))
            rows["is_p2p"].append(attrs["is_p2p"])
            rows["peer"].append(attrs["peer"])
            rows["record_id"].append(attrs["record_id"])
    entries = _entries(rows)
    members = pd.DataFrame(listed, columns=list(GROUPS))
    if before is not None:
        entries = pd.concat([before.entries, entries], ignore_index=True) if len(entries) else before.entries
        members = pd.concat([before.groups, members], ignore_index=True) if len(members) else before.groups
    return Recorded(run_id, entries, members, tuple(dumped), tuple(unreadable), tuple(seen))


def lines(told: Mapping) -> list[str]:
    """A verdict (Recorded.verdict, as a finding's evidence keeps it) as lines of text: each finding's summary,
    then how many more; where it has none, that the entries match."""
    shown = [str(v.get("summary")) for v in told.get("verdicts") or [] if isinstance(v, Mapping)]
    if not shown:
        return [f"{told.get('ranks')} ranks' entries match: {NOTHING}"]
    return shown + ([f"and {told['more']} more"] if told.get("more") else [])


def _bounded(evidence: dict) -> dict:
    """A finding's evidence with its `mismatched` calls cut to the first MAX_RECORDS (thousands of ranks may have
    called otherwise, and a hang's evidence is written again at every pass), `mismatched_count` counting all."""
    calls = evidence.get("mismatched") or []
    if len(calls) <= MAX_RECORDS:
        return evidence
    return {**evidence, "mismatched": calls[:MAX_RECORDS], "mismatched_count": len(calls)}


def _json(text: str | None) -> dict | None:
    """An answer's Flight Recorder as read: a JSON object, else None (null, or what does not parse)."""
    try:
        value = json.loads(text) if text is not None else None
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def _groups(config: Any, alike: dict[tuple[str, str], dict]) -> dict[str, dict]:
    """A rank's pg_config as process_groups reads it, each group read once for all the ranks that list it alike
    (a world group's members, thousands of ranks, are one list for every rank)."""
    if not isinstance(config, dict):
        return process_groups(config)  # raises: no map of groups
    groups = {}
    for name, pg in config.items():
        key = (str(name), repr(pg))
        if key not in alike:
            alike[key] = process_groups({name: pg})[str(name)]
        groups[str(name)] = alike[key]
    return groups


def _entries(rows: dict[str, list]) -> pd.DataFrame:
    """The entries read as the matchers' table: peers and record ids as numbers (null where unknown)."""
    frame = pd.DataFrame(rows, columns=list(COLUMNS))
    frame["rank"] = frame["rank"].astype("int64")
    frame["seq"] = frame["seq"].astype("int64")
    frame["is_p2p"] = frame["is_p2p"].astype(bool)
    for column in ("peer", "record_id"):
        frame[column] = pd.to_numeric(frame[column], errors="coerce")
    return frame
