"""Collective matching across the ranks' Flight Recorder entries: whom a blocked group waits for.

A pure function, after PyTorch's Flight Recorder analyzer
(tools/flight_recorder/fr_trace.py), from the collectives each rank recorded
(process group, sequence number, op, state, sizes) and the groups' members to
`hang` findings, in the shape the live hang analyzer gives them
(analyzers/hangs.py) so that one reader serves both.

Every member of a process group runs its collectives in sequence-number
order, so the collective a group is blocked in is its earliest one that some
member has not completed (later ones may already be enqueued behind it).
Members whose entries stop before it never entered it (missing); members
that entered it as another op, or with other sizes or dtypes, called a
different collective (mismatched), judged against what most members called
(on a tie, the lowest rank's call). Either way the ranks that entered it as
expected wait for them forever. A group whose members all entered its
earliest open collective alike (an on-demand dump of a healthy job, or a
network that stalls everyone) has no culprit and no finding.

A group is its name and its members: groups split off one parent may share a
name. Point-to-point ops are matched apart (analyzers/p2p.py): their sequence
numbers count a rank's transfers, not the group's collectives.
"""

import json
from collections import Counter
from collections.abc import Iterable, Iterator

import pandas as pd

from collector import ranksets
from collector.analysis.analyzers import hangs
from collector.findings import Finding

COMPLETED = "completed"
_CALL = ("input_sizes", "output_sizes", "input_dtypes", "output_dtypes")
# what the members of these ops must agree on besides the op (their other sizes differ by rank); others: all four
_COMPARED = {"all_to_all": (), "scatter": ("output_sizes", "output_dtypes"), "gather": ("input_sizes", "input_dtypes")}


def analyze(run_id: str, entries: pd.DataFrame, groups: pd.DataFrame, dumped: Iterable[int]) -> list[Finding]:
    """A finding per process group blocked in a collective that some member never entered or entered differently.

    `entries`: rank, group, seq, op, state, input_sizes, output_sizes, input_dtypes, output_dtypes (sizes and
    dtypes as JSON text, compared as text), each rank's in the order it recorded them; collectives only.
    `groups`: rank, group, desc, members (list of global ranks): the process groups each rank's dump lists.
    `dumped`: the ranks whose dumps were read; a member without one is missing all the same, and named."""
    dumped = set(dumped)
    by_entry, desc = membership(entries, groups)
    frame = entries.assign(members=by_entry, **{c: entries[c].fillna("null") for c in _CALL})  # JSON text, null too
    found = []
    for (group, members), rows in frame.groupby(["group", "members"], sort=True):
        open_ = rows[rows["state"] != COMPLETED]
        if open_.empty:
            continue
        seq = int(open_["seq"].min())
        finding = _judge(run_id, group, desc.get((group, members)), members, rows, seq, dumped)
        if finding:
            found.append(finding)
    return found


class Members:
    """A process group's member ranks, sorted (iterated, counted, compared as their tuple), hashed once: the
    entries are grouped by their group's members, a world group's are thousands of ranks, and pandas hashes a
    tuple anew, element by element, for every entry."""

    __slots__ = ("_hash", "ranks")

    def __init__(self, ranks: Iterable[int]):
        self.ranks = tuple(sorted(ranks))
        self._hash = hash(self.ranks)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return self is other or (isinstance(other, Members) and self.ranks == other.ranks)

    def __lt__(self, other: "Members") -> bool:  # (groups are sorted by their members)
        return self.ranks < other.ranks

    def __iter__(self) -> Iterator[int]:
        return iter(self.ranks)

    def __len__(self) -> int:
        return len(self.ranks)


def membership(entries: pd.DataFrame, groups: pd.DataFrame) -> tuple[pd.Series, dict[tuple, str | None]]:
    """Each entry's group Members (from the `groups` its rank's dump lists; a group no dump lists: the ranks
    that recorded it), and each (group, members)'s description. Equal members are one object."""
    one: dict[Members, Members] = {}

    def interned(ranks: Iterable[int]) -> Members:
        members = Members(ranks)
        return one.setdefault(members, members)

    listed = groups[["rank", "group", "desc", "members"]].itertuples(index=False)
    known = {(r, g): (interned(m), d) for r, g, d, m in listed}  # (rank, group) -> (members, desc)
    members = pd.Series(
        [known.get(key, (None,))[0] for key in zip(entries["rank"], entries["group"])],
        index=entries.index,
        dtype=object,
    )
    unlisted = members.isna()
    seen = {g: interned(map(int, r)) for g, r in entries[unlisted].groupby("group")["rank"].unique().items()}
    members[unlisted] = [seen[g] for g in entries.loc[unlisted, "group"]]
    return members, {(g, m): d for (_, g), (m, d) in known.items()}


def _judge(
    run_id: str, group: str, desc: str | None, members: Members, rows: pd.DataFrame, seq: int, dumped: set[int]
) -> Finding | None:
    """The finding for collective `seq` of the group, if some member is missing from it or mismatched."""
    at = rows[rows["seq"] == seq]
    calls = {int(rank): call for rank, call in at.groupby("rank", sort=True)}
    signatures = {rank: _signature(call) for rank, call in calls.items()}
    counts = Counter(signatures.values())
    expected = max(signatures.values(), key=counts.__getitem__)  # the first maximum: the lowest rank's on a tie
    mismatched = [rank for rank, s in signatures.items() if s != expected]
    last = rows.groupby("rank")["seq"].max()
    missing = [rank for rank in members if rank not in calls and last.get(rank, -1) < seq]
    culprits = sorted(missing + mismatched)
    if not culprits:
        return None
    waiting = [rank for rank, s in signatures.items() if s == expected and (calls[rank]["state"] != COMPLETED).any()]
    reference = _call(calls[next(rank for rank, s in signatures.items() if s == expected)])
    no_dump = [rank for rank in missing if rank not in dumped]
    where = f"group {group}" + (f" ({desc})" if desc else "")
    reasons = (
        [
            f"{ranksets.phrase(missing)} never entered it"
            + (f" (no dump from {ranksets.phrase(no_dump)})" if no_dump else "")
        ]
        if missing
        else []
    )
    reasons += [
        f"rank {rank} entered it as {_describe(_call(calls[rank]))} instead of {_describe(reference)}"
        for rank in mismatched
    ]
    summary = (
        f"{ranksets.phrase(waiting)} {'is' if len(waiting) == 1 else 'are'} blocked in {reference['op']} #{seq} "
        f"of {where}: " + "; ".join(reasons)
    )
    return group_hang(
        run_id,
        culprits,
        len(waiting) / len(members),
        summary,
        {
            "collective": {"op": reference["op"], "group": group, "seq": seq, "waiting_ranks": waiting},
            "group_desc": desc,
            "group_size": len(members),
            "missing_ranks": missing,
            "no_dump_ranks": no_dump,
            "expected": reference,
            "mismatched": [{"rank": rank, **_call(calls[rank])} for rank in mismatched],
        },
    )


def group_hang(run_id: str, culprits: list[int], waiting_share: float, summary: str, evidence: dict) -> Finding:
    """A group blocked for its culprits, as the Flight Recorder's matchers (this one, p2p.py) tell it: a critical
    hang finding in the live hang analyzer's shape, scored by the share of the group's members left waiting."""
    return Finding(
        run_id, "hang", culprits, None, None, "critical", waiting_share, summary, evidence, analyzer=hangs.ANALYZER
    )


def _signature(call: pd.DataFrame) -> tuple:
    """What a rank called at one sequence number (a coalesced group records several entries under it)."""
    return tuple((row["op"], *(row[c] for c in _COMPARED.get(row["op"], _CALL))) for _, row in call.iterrows())


def _call(call: pd.DataFrame) -> dict:
    """A rank's call as evidence: its last entry at the sequence number (a coalesced group's closing one)."""
    row = call.iloc[-1]
    return {"op": row["op"], **{c: json.loads(row[c]) for c in _CALL}}


def _describe(call: dict) -> str:
    return f"{call['op']} of {call['input_sizes']} -> {call['output_sizes']}"
