"""Point-to-point matching across the ranks' Flight Recorder entries: the send or receive a rank waits
in that its peer never posted, or posted with another size or dtype.

A pure function, the companion of the collective matching (analyzers/collectives.py), after PyTorch's
Flight Recorder analyzer (tools/flight_recorder/fr_trace.py), giving `hang` findings in the same shape
so that one reader serves both. NCCL records each send and receive as an entry named `nccl:send 0->1`
or `nccl:recv 1<-0` (group ranks; the import turns the peer into a global rank, `peer`) with the
rank's `p2p_seq_id`, which numbers its point-to-point calls in the group with every peer (a
batch_isend_irecv one number for all its operations, closed by a `coalesced` entry that carries the
batch's state). Those numbers are the rank's own: a middle pipeline stage's count both its receives
and its sends, so a pair's two sides number the same transfer differently. They are reported, never
compared.

Between two ranks of a process group, a sender's sends to a receiver meet the receiver's receives from
it in the order each side posted them (NCCL's rule), each with the same count and dtype. So in each
such pair the k-th send meets the k-th receive, where both ranks' dumps hold their whole history (the
first entry's record id is 0). A dump whose ring buffer dropped its oldest entries does not say how
many of the pair's transfers came before them: there the two sides are aligned on their last
completed transfer (a receive completes only once its send was posted), earlier ones outside the other
dump's window are left out, and a send NCCL delivered eagerly (a small one completes without its
receive) to a peer that never received it is not seen.

A pair's extra operations at the end are unmatched: a receive the sender never sent, or a send the
receiver never received. One that has not completed is a rank waiting for its peer forever, and the
peer is the culprit (also where the peer left no dump); matched ones whose element counts or dtypes
differ are mismatched, both ranks named. A process group (its name and members, as for collectives)
with any of these is one finding, its summary naming the first few pairs and its evidence the first
MAX_PAIRS, with the count of all.
"""

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass

import pandas as pd

from collector import ranksets
from collector.analysis.analyzers.collectives import COMPLETED, Members, group_hang, membership
from collector.findings import Finding

SEND, RECV, BATCH = "send", "recv", "coalesced"
MAX_PAIRS = 16  # pairs a finding's evidence lists (a hung pipeline of thousands of stages has thousands)
SHOWN = 3  # pairs its summary names before counting the rest


@dataclass(frozen=True)
class _Op:
    """One send or receive of a rank, as evidence; its state a batch's where it is one's."""

    rank: int
    op: str
    peer: int
    seq: int
    state: str
    sizes: list
    dtypes: list

    @property
    def done(self) -> bool:
        return self.state == COMPLETED

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("rank", "op", "peer", "seq", "state", "sizes", "dtypes")}


def analyze(
    run_id: str, entries: pd.DataFrame, groups: pd.DataFrame, dumped: Iterable[int], wrapped: Iterable[int] = ()
) -> list[Finding]:
    """A finding per process group with a send or receive its peer never matched, or matched with
    another element count or dtype.

    `entries`: rank, group, seq (p2p_seq_id), op (send, recv, or coalesced: a batch's closing entry),
    state, peer (the other rank, global; null where unknown: such an entry is left out), input_sizes,
    output_sizes, input_dtypes, output_dtypes (JSON text), each rank's in the order it recorded them;
    point-to-point entries only. `groups`: as for collectives.analyze. `dumped`: the ranks whose dumps
    were read. `wrapped`: the ranks whose dumps lost their oldest entries (the ring buffer went round)."""
    if entries.empty:
        return []
    dumped, wrapped = set(dumped), set(wrapped)
    by_entry, desc = membership(entries, groups)
    frame = entries.assign(members=by_entry)
    found = []
    for (group, group_members), rows in frame.groupby(["group", "members"], sort=True):
        pairs = [p for p in _pairs(_ops(rows), dumped, wrapped) if p["waits"] or "mismatched" in p]
        if pairs:
            found.append(_finding(run_id, str(group), desc.get((group, group_members)), group_members, pairs, dumped))
    return found


def _ops(rows: pd.DataFrame) -> dict[tuple[int, int], dict[str, list[_Op]]]:
    """Each (sender, receiver) pair's sends and receives, each side's in the order its rank posted them;
    an operation of a batch in the batch's state (its own entry stays `scheduled`)."""
    batches = rows[rows["op"] == BATCH]
    batch_state = {(int(r), int(s)): st for r, s, st in zip(batches["rank"], batches["seq"], batches["state"])}
    pairs: dict[tuple[int, int], dict[str, list[_Op]]] = {}
    transfers = rows[rows["op"].isin((SEND, RECV)) & rows["peer"].notna()]
    for row in transfers.itertuples(index=False):
        rank, peer, seq = int(row.rank), int(row.peer), int(row.seq)
        side = "input" if row.op == SEND else "output"
        op = _Op(
            rank,
            row.op,
            peer,
            seq,
            batch_state.get((rank, seq), row.state),
            _json(getattr(row, f"{side}_sizes")),
            _json(getattr(row, f"{side}_dtypes")),
        )
        key = (rank, peer) if row.op == SEND else (peer, rank)
        pairs.setdefault(key, {SEND: [], RECV: []})[row.op].append(op)
    return pairs


def _json(text: str | None) -> list:
    value = json.loads(text) if isinstance(text, str) else None
    return value if isinstance(value, list) else []


def _numel(sizes: list) -> int | None:
    """Elements of a side's tensors, summed (what NCCL counts); None where the sizes are not numbers."""
    if not all(isinstance(shape, list) and all(isinstance(n, int) for n in shape) for shape in sizes):
        return None
    return sum(math.prod(shape) for shape in sizes)


def _done_through(ops: list[_Op]) -> int:
    """How many of a side's operations lead up to, and include, its last completed one."""
    return next((i + 1 for i in range(len(ops) - 1, -1, -1) if ops[i].done), 0)


def _pairs(ops: dict[tuple[int, int], dict[str, list[_Op]]], dumped: set[int], wrapped: set[int]) -> list[dict]:
    """Each pair's verdict, in pair order: its `reasons` (sentences), `waits` ((waiting rank, the rank
    it waits for, its op, its seq) each), `culprits`, and as evidence what stands `unmatched` (the
    operation waiting) and `mismatched` (the first send and receive that disagree)."""
    judged = []
    for (sender, receiver), sides in sorted(ops.items()):
        pair: dict = {"sender": sender, "receiver": receiver, "reasons": [], "waits": [], "culprits": set()}
        sends, recvs = sides[SEND], sides[RECV]
        absent = next((r for r in (sender, receiver) if r not in dumped), None)
        if absent is not None:  # one side unknown: the other's operations all stand unmatched
            _unmatched(pair, sends or recvs, None, f"rank {absent} left no dump")
        else:
            # sends[i] meets recvs[i - offset]: from the first of each where both dumps are whole, else on
            # their last completed ones (the earlier ones of the longer side fell out of the other's window)
            offset = _done_through(sends) - _done_through(recvs) if {sender, receiver} & wrapped else 0
            start, end = max(0, offset), min(len(sends), len(recvs) + offset)
            _mismatched(pair, [(s, r) for s, r in zip(sends[start:end], recvs[start - offset : end - offset])])
            # what one side posted beyond the other's last (where aligned so, all after its last completed)
            if end < len(sends):
                _unmatched(pair, sends[end:], recvs)
            else:
                _unmatched(pair, recvs[end - offset :], sends)
        judged.append(pair)
    return judged


def _mismatched(pair: dict, met: list[tuple[_Op, _Op]]) -> None:
    """The first of the sends and receives that met while disagreeing, both ranks to blame."""
    differ = [(s, r) for s, r in met if (_numel(s.sizes), s.dtypes) != (_numel(r.sizes), r.dtypes)]
    if not differ:
        return
    send, recv = differ[0]
    pair["mismatched"] = {SEND: send.as_dict(), RECV: recv.as_dict(), "count": len(differ)}
    pair["reasons"].append(
        f"rank {send.rank}'s send to rank {recv.rank} (p2p seq {send.seq}) of {_payload(send)} meets rank "
        f"{recv.rank}'s recv (p2p seq {recv.seq}) of {_payload(recv)}"
        + (f" ({len(differ) - 1} more mismatched after it)" if len(differ) > 1 else "")
    )
    pair["waits"] += [(o.rank, o.peer, o.op, o.seq) for o in (send, recv) if not o.done]
    pair["culprits"] |= {send.rank, recv.rank}


def _unmatched(pair: dict, extra: list[_Op], theirs: list[_Op] | None, why: str | None = None) -> None:
    """The first of one side's unmatched operations that has not completed: its rank waits for the peer
    (`theirs`: the peer's side of the pair; None where unknown, `why`)."""
    op = next((o for o in extra if not o.done), None)
    if op is None:
        return
    last = theirs[-1].seq if theirs else None
    behind = len(extra) - extra.index(op) - 1
    pair["unmatched"] = {**op.as_dict(), "behind": behind, "peer_last_seq": last}
    if why is None:
        never, other = ("sent", SEND) if op.op == RECV else ("received", RECV)
        toward = f"{'to' if other == SEND else 'from'} rank {op.rank}"
        said = f"'s last {other} {toward} is seq {last}" if theirs else f" recorded no {other} {toward}"
        detail = f" that rank {op.peer} never {never}: rank {op.peer}{said}"
    else:
        detail = f"; {why}"
    where = "to" if op.op == SEND else "from"
    pair["reasons"].append(
        f"rank {op.rank} waits in {op.op} {where} rank {op.peer} (p2p seq {op.seq}){detail}"
        + (f" ({behind} more posted behind it)" if behind else "")
    )
    pair["waits"].append((op.rank, op.peer, op.op, op.seq))
    pair["culprits"].add(op.peer)


def _payload(op: _Op) -> str:
    return f"{op.sizes} {'/'.join(dict.fromkeys(op.dtypes))}"


def _finding(
    run_id: str, group: str, desc: str | None, members: Members, pairs: list[dict], dumped: set[int]
) -> Finding:
    """The group's finding: its pairs' reasons, the first MAX_PAIRS as evidence."""
    waits = [w for p in pairs for w in p["waits"]]
    waiting = sorted({w for w, *_ in waits})
    culprits = sorted(set().union(*(p["culprits"] for p in pairs)))
    where = f"group {group}" + (f" ({desc})" if desc else "")
    head = (
        f"{ranksets.phrase(waiting)} {'is' if len(waiting) == 1 else 'are'} blocked in point-to-point transfers "
        f"of {where}"
        if waiting
        else f"point-to-point transfers of {where} do not match"
    )
    reasons = [r for p in pairs[:SHOWN] for r in p["reasons"]]
    more = f"; and {len(pairs) - SHOWN} more pairs" if len(pairs) > SHOWN else ""
    return group_hang(
        run_id,
        culprits,
        len(waiting) / len(members),
        f"{head}: " + "; ".join(reasons) + more,
        {
            # the transfer the first waiting rank is blocked in, as collectives name theirs
            "collective": {"op": waits[0][2], "group": group, "seq": waits[0][3], "waiting_ranks": waiting}
            if waits
            else None,
            "group_desc": desc,
            "group_size": len(members),
            "missing_ranks": sorted({p["unmatched"]["peer"] for p in pairs if "unmatched" in p}),
            "no_dump_ranks": [r for r in culprits if r not in dumped],
            "waiting_pairs": [[w, c, op, group] for p in pairs[:MAX_PAIRS] for w, c, op, _ in p["waits"]],
            "p2p_pairs": len(pairs),
            "p2p": [
                {k: p[k] for k in ("sender", "receiver", "unmatched", "mismatched") if k in p}
                for p in pairs[:MAX_PAIRS]
            ],
        },
    )
