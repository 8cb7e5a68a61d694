"""Point-to-point matching of Flight Recorder entries (collector/analysis/analyzers/p2p.py): each send of a
pair of ranks meets the receive posted in the same place on the other side, with the same element count
and dtype; a rank waiting in one its peer never posted names the peer.

Covered on small entry tables: a skipped send and a skipped receive (with both ranks' own p2p sequence
numbers), a size and a dtype mismatch (a different shape of the same element count is none), all matched
(operations in flight on both sides, a send delivered before its receive was posted, batches whose own
entries stay `scheduled`): no finding; several pairs of a pipeline with a middle stage numbering its
receives and sends together, and of two groups; a dump whose ring buffer went round, aligned on the last
completed transfers; a peer that left no dump; and 40 hung pairs, of which the evidence lists MAX_PAIRS.

End to end: dumps in NCCL's form of the 4-stage pipeline below (stage 1 skips its sends at step 3), as
`rankwatch import flight-recorder` and `rankwatch analyze` read them: each send and receive keeps its peer
(a global rank), and the analysis names both the unmatched receives and the ranks missing from the
all-reduce. And that pipeline run for real (tests/jobs/pipeline_hang.py, 4 ranks under torchrun on gloo,
each rank dumping its Flight Recorder once hung, then killed): on torch 2.13 CPU gloo records its
collectives only, never a send or receive (send, recv, isend, irecv and batch_isend_irecv alike), and
leaves every entry `scheduled`, marking finished ones `retired`; what it records still names the ranks
missing from the all-reduce the stages before the fault wait in.
"""

import contextlib
import json
import os
import pickle
import signal
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from collector.analysis.analyzers.p2p import MAX_PAIRS, analyze
from tests.support.commands import rankwatch_in_process
from tests.support.flight_dumps import entry
from tests.support.otlp_payloads import query
from tests.support.paths import JOBS
from tests.support.waits import wait_until

ACT, SHAPE = [[8, 16]], [[2]]
COLUMNS = [
    "rank",
    "group",
    "seq",
    "op",
    "state",
    "peer",
    "input_sizes",
    "output_sizes",
    "input_dtypes",
    "output_dtypes",
]
WORLD4 = pd.DataFrame(
    [(r, "0", "default_pg", [0, 1, 2, 3]) for r in range(4)], columns=["rank", "group", "desc", "members"]
)
JOB = JOBS / "pipeline_hang.py"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"]
SKIP_RANK, SKIP_AT = 1, 3


def op(rank, op, peer, seq, state="completed", sizes=ACT, dtype="Float", group="0") -> tuple:
    """One point-to-point entry as the store gives it (sizes and dtypes as JSON text); NCCL records a
    transfer's tensor on both sides."""
    sizes, dtypes = json.dumps(sizes), json.dumps([dtype] * len(sizes))
    return (rank, group, seq, op, state, peer, sizes, sizes, dtypes, dtypes)


def transfers(sender, receiver, seqs, state="completed", **kw) -> list[tuple]:
    """`sender`'s sends to `receiver` and its receives, each side numbered `seqs`."""
    return [op(sender, "send", receiver, s, state, **kw) for s in seqs] + [
        op(receiver, "recv", sender, s, state, **kw) for s in seqs
    ]


def table(*rows) -> pd.DataFrame:
    return pd.DataFrame(rows, columns=COLUMNS)


def match(rows: pd.DataFrame, dumped=range(4), wrapped=(), groups=WORLD4):
    return analyze("r", rows, groups, dumped, wrapped)


def test_a_skipped_send_names_the_sender_with_both_sides_sequence_numbers():
    rows = table(*transfers(0, 1, range(1, 12)), op(1, "recv", 0, 12, "started"))
    (finding,) = match(rows)
    assert (finding.kind, finding.analyzer, finding.ranks, finding.severity) == ("hang", "hangs", [0], "critical")
    assert (finding.step_start, finding.step_end, finding.score) == (None, None, 0.25)
    assert finding.summary == (
        "rank 1 is blocked in point-to-point transfers of group 0 (default_pg): rank 1 waits in recv from rank 0 "
        "(p2p seq 12) that rank 0 never sent: rank 0's last send to rank 1 is seq 11"
    )
    evidence = finding.evidence
    assert evidence["collective"] == {"op": "recv", "group": "0", "seq": 12, "waiting_ranks": [1]}
    assert (evidence["missing_ranks"], evidence["no_dump_ranks"], evidence["group_size"]) == ([0], [], 4)
    assert evidence["waiting_pairs"] == [[1, 0, "recv", "0"]]
    assert evidence["p2p"] == [
        {
            "sender": 0,
            "receiver": 1,
            "unmatched": {
                "rank": 1,
                "op": "recv",
                "peer": 0,
                "seq": 12,
                "state": "started",
                "sizes": ACT,
                "dtypes": ["Float"],
                "behind": 0,
                "peer_last_seq": 11,
            },
        }
    ]


def test_a_skipped_receive_names_the_receiver():
    rows = table(*transfers(0, 1, range(1, 12)), op(0, "send", 1, 12, "scheduled"))
    (finding,) = match(rows)
    assert finding.ranks == [1]
    assert finding.summary.endswith(
        "rank 0 waits in send to rank 1 (p2p seq 12) that rank 1 never received: rank 1's last recv from rank 0 "
        "is seq 11"
    )
    assert finding.evidence["collective"]["waiting_ranks"] == [0]


def test_a_size_mismatch_names_both_ranks_but_not_another_shape_of_the_same_count():
    reshaped = table(*transfers(0, 1, range(1, 5)), op(0, "send", 1, 5, sizes=[[128]]), op(1, "recv", 0, 5))
    assert match(reshaped) == []
    rows = table(
        *transfers(0, 1, range(1, 5)), op(0, "send", 1, 5, "started"), op(1, "recv", 0, 5, "started", sizes=[[8, 8]])
    )
    (finding,) = match(rows)
    assert finding.ranks == [0, 1]
    assert finding.summary == (
        "ranks 0, 1 are blocked in point-to-point transfers of group 0 (default_pg): rank 0's send to rank 1 "
        "(p2p seq 5) of [[8, 16]] Float meets rank 1's recv (p2p seq 5) of [[8, 8]] Float"
    )
    (pair,) = finding.evidence["p2p"]
    assert (pair["mismatched"]["send"]["sizes"], pair["mismatched"]["recv"]["sizes"]) == (ACT, [[8, 8]])
    assert pair["mismatched"]["count"] == 1 and "unmatched" not in pair


def test_a_dtype_mismatch_names_both_ranks():
    rows = table(
        *transfers(2, 3, [1]), op(2, "send", 3, 2, "started"), op(3, "recv", 2, 2, "started", dtype="BFloat16")
    )
    (finding,) = match(rows)
    assert finding.ranks == [2, 3]
    assert (
        "rank 2's send to rank 3 (p2p seq 2) of [[8, 16]] Float meets rank 3's recv (p2p seq 2) of [[8, 16]] BFloat16"
        in (finding.summary)
    )


def test_matched_transfers_have_no_finding():
    in_flight = table(*transfers(0, 1, range(1, 4)), op(0, "send", 1, 4, "started"), op(1, "recv", 0, 4, "started"))
    assert match(in_flight) == []
    # a small send NCCL completed before its receive was posted: its sender waits for nothing
    eager = table(*transfers(0, 1, range(1, 4)), op(0, "send", 1, 4))
    assert match(eager) == []
    # batch_isend_irecv: each operation's own entry stays scheduled; the batch's closing entry completes
    batches = table(
        *transfers(0, 1, range(1, 4), "scheduled"),
        *[op(r, "coalesced", None, s, sizes=[]) for r in (0, 1) for s in range(1, 4)],
    )
    assert match(batches) == []
    assert match(table()) == []


def test_an_open_batch_waits_for_its_peer():
    batches = table(
        *transfers(0, 1, range(1, 4), "scheduled"),
        op(1, "recv", 0, 4, "scheduled"),
        *[op(r, "coalesced", None, s, sizes=[]) for r in (0, 1) for s in range(1, 4)],
        op(1, "coalesced", None, 4, "started", sizes=[]),
    )
    (finding,) = match(batches)
    assert "rank 1 waits in recv from rank 0 (p2p seq 4) that rank 0 never sent" in finding.summary


def pipeline_rows(world: int = 4, skip_rank: int = SKIP_RANK, skip_at: int = SKIP_AT) -> pd.DataFrame:
    """A pipeline's transfers as each rank numbers them: each step, every stage receives from the one
    before and sends to the one after; stage `skip_rank` sends nothing at step `skip_at`, and the stages
    after it wait in their receive."""
    rows, seq = [], dict.fromkeys(range(world), 0)
    for step in range(skip_at + 1):
        for rank in range(world):
            if rank > 0:
                seq[rank] += 1
                done = step < skip_at or rank <= skip_rank
                rows.append(op(rank, "recv", rank - 1, seq[rank], "completed" if done else "started"))
            if rank < world - 1 and (step < skip_at or rank < skip_rank):
                seq[rank] += 1
                rows.append(op(rank, "send", rank + 1, seq[rank]))
    return table(*rows)


def test_several_pairs_of_a_pipeline_each_name_their_sender():
    """Stage 1 skips its send at step 3: stage 2 waits for it, stage 3 for stage 2. A middle stage numbers
    its receives and sends together, so each side's sequence numbers are its own."""
    (finding,) = match(pipeline_rows())
    assert finding.ranks == [1, 2]
    assert finding.summary == (
        "ranks 2, 3 are blocked in point-to-point transfers of group 0 (default_pg): "
        "rank 2 waits in recv from rank 1 (p2p seq 7) that rank 1 never sent: rank 1's last send to rank 2 is seq 6; "
        "rank 3 waits in recv from rank 2 (p2p seq 4) that rank 2 never sent: rank 2's last send to rank 3 is seq 6"
    )
    assert finding.evidence["waiting_pairs"] == [[2, 1, "recv", "0"], [3, 2, "recv", "0"]]
    assert [(p["sender"], p["receiver"]) for p in finding.evidence["p2p"]] == [(1, 2), (2, 3)]


def test_each_process_group_is_judged_apart():
    groups = pd.DataFrame(
        [(r, g, "pp", m) for g, m in (("1", [0, 1]), ("2", [2, 3])) for r in m],
        columns=["rank", "group", "desc", "members"],
    )
    rows = table(
        *transfers(0, 1, [1], group="1"),
        op(1, "recv", 0, 2, "started", group="1"),
        *transfers(2, 3, [1, 2], group="2"),
        op(2, "send", 3, 3, "started", group="2"),
    )
    first, second = match(rows, groups=groups)
    assert (first.ranks, first.evidence["collective"]["group"], first.score) == ([0], "1", 0.5)
    assert (second.ranks, second.evidence["collective"]["group"]) == ([3], "2")
    assert first.summary.startswith("rank 1 is blocked in point-to-point transfers of group 1 (pp): ")


def test_a_wrapped_ring_is_aligned_on_the_last_completed_transfers():
    """Microbatches alternate two sizes. Rank 0's ring lost its oldest entries, so its first send in the
    dump is the pair's fourth: aligned from the first of each side, every pair would differ in size."""
    sizes = [[[4, 16]], [[8, 16]]]
    sends = [op(0, "send", 1, s, sizes=sizes[s % 2]) for s in range(4, 12)]
    recvs = [op(1, "recv", 0, s, sizes=sizes[s % 2]) for s in range(1, 12)]
    rows = table(*sends, *recvs, op(1, "recv", 0, 12, "started", sizes=sizes[0]))
    (finding,) = match(rows, wrapped=[0])
    assert finding.ranks == [0] and "mismatched" not in finding.evidence["p2p"][0]
    assert finding.summary.endswith(
        "rank 1 waits in recv from rank 0 (p2p seq 12) that rank 0 never sent: rank 0's last send to rank 1 is seq 11"
    )
    assert "meets" in match(rows)[0].summary  # taken as whole, the two sides meet out of step


def test_a_peer_without_a_dump_is_named():
    rows = table(op(1, "recv", 0, 1), op(1, "recv", 0, 2, "started"), op(1, "send", 2, 1, "started"))
    (finding,) = match(rows, dumped=[1, 2])
    assert finding.ranks == [0, 2]  # rank 2 has a dump that shows no receive from rank 1
    assert "rank 1 waits in recv from rank 0 (p2p seq 2); rank 0 left no dump" in finding.summary
    assert (finding.evidence["no_dump_ranks"], finding.evidence["missing_ranks"]) == ([0], [0, 2])


def test_evidence_is_bounded():
    ranks = range(80)
    groups = pd.DataFrame(
        [(r, "0", "default_pg", list(ranks)) for r in ranks], columns=["rank", "group", "desc", "members"]
    )
    rows = table(*[op(r + 1, "recv", r, 1, "started") for r in range(0, 80, 2)])
    (finding,) = match(rows, dumped=ranks, groups=groups)
    evidence = finding.evidence
    assert finding.ranks == list(range(0, 80, 2))
    assert (evidence["p2p_pairs"], len(evidence["p2p"]), len(evidence["waiting_pairs"])) == (40, MAX_PAIRS, MAX_PAIRS)
    assert finding.summary.count("waits in recv") == 3 and finding.summary.endswith("; and 37 more pairs")
    assert len(finding.summary) < 1000


# What NCCL records for the pipeline job below: each send and receive named with its group ranks, the
# activations' batch closed by a `coalesced` entry, numbered by the rank's own point-to-point count.


def nccl_dumps(world: int = 4) -> dict[int, dict]:
    """Each rank's dump (PyTorch 2.5's keys) of tests/jobs/pipeline_hang.py run on NCCL: ranks 0 and 1 wait
    in all-reduce #4, ranks 2 and 3 in the shape's receive of step 3."""
    dumps = {}
    for rank in range(world):
        entries: list[dict] = []
        p2p = coll = 0

        def add(name, state, sizes=ACT, dtype="Float", is_p2p=True):
            e = entry(len(entries), coll, name, state, input_sizes=sizes, dtype=dtype, p2p_seq=p2p)
            e["is_p2p"] = is_p2p
            entries.append(e)

        for step in range(SKIP_AT + 1):
            hung = step == SKIP_AT
            if rank > 0:
                p2p += 1
                waits = hung and rank > SKIP_RANK
                add(f"recv {rank}<-{rank - 1}", "started" if waits else "completed", SHAPE, "Long")
                if waits:
                    break
                p2p += 1
                add(f"recv {rank}<-{rank - 1}", "scheduled")
                add("coalesced", "completed", [])
            if rank < world - 1 and not (hung and rank == SKIP_RANK):
                p2p += 1
                add(f"send {rank}->{rank + 1}", "completed", SHAPE, "Long")
                p2p += 1
                add(f"send {rank}->{rank + 1}", "scheduled")
                add("coalesced", "completed", [])
            coll += 1
            add("all_reduce", "started" if hung else "completed", [[1]], is_p2p=False)
        config = {"0": {"name": "0", "desc": "default_pg", "ranks": json.dumps(list(range(world)))}}
        dumps[rank] = {"version": "2.5", "pg_config": config, "entries": entries, "pg_status": {}}
    return dumps


def import_and_analyze(dumps: Path, db: Path, run: str) -> dict:
    imported = rankwatch_in_process("import", "flight-recorder", str(dumps), "--run", run, "--db", str(db))
    assert imported.returncode == 0, imported.stderr
    analyzed = rankwatch_in_process("analyze", run, "--db", str(db), "--json")
    assert analyzed.returncode == 0, analyzed.stderr
    return json.loads(analyzed.stdout)


def test_nccl_dumps_of_the_pipeline_name_the_unmatched_receives(tmp_path):
    (tmp_path / "dumps").mkdir()
    for rank, dump in nccl_dumps().items():
        (tmp_path / "dumps" / f"nccl_trace_rank_{rank}").write_bytes(pickle.dumps(dump, protocol=2))
    db = tmp_path / "s.duckdb"
    report = import_and_analyze(tmp_path / "dumps", db, "nccl-pp")
    # each send and receive keeps its peer, a global rank; other entries have none
    assert query(
        db,
        "SELECT DISTINCT rank, name, (attrs->>'$.peer')::INT FROM ops WHERE name IN ('send', 'recv') ORDER BY ALL",
    ) == [(0, "send", 1), (1, "recv", 0), (1, "send", 2), (2, "recv", 1), (2, "send", 3), (3, "recv", 2)]
    assert query(db, "SELECT DISTINCT attrs->>'$.peer' FROM ops WHERE name NOT IN ('send', 'recv')") == [(None,)]
    collective, p2p = report["findings"]
    assert (
        collective["summary"]
        == "ranks 0, 1 are blocked in all_reduce #4 of group 0 (default_pg): ranks 2, 3 never entered it"
    )
    assert (p2p["analyzer"], p2p["kind"], p2p["ranks"]) == ("hangs", "hang", [1, 2])
    assert p2p["summary"] == (
        "ranks 2, 3 are blocked in point-to-point transfers of group 0 (default_pg): "
        "rank 2 waits in recv from rank 1 (p2p seq 13) that rank 1 never sent: rank 1's last send to rank 2 is seq 12; "
        "rank 3 waits in recv from rank 2 (p2p seq 7) that rank 2 never sent: rank 2's last send to rank 3 is seq 12"
    )
    assert p2p["evidence"]["collective"] == {"op": "recv", "group": "0", "seq": 13, "waiting_ranks": [2, 3]}


# The keys torch 2.13's gloo Flight Recorder gives an entry, all of which the import reads or passes by.
GLOO_KEYS = {
    "collective_seq_id",
    "frames",
    "input_dtypes",
    "input_sizes",
    "is_p2p",
    "op_id",
    "output_dtypes",
    "output_sizes",
    "p2p_seq_id",
    "pg_id",
    "process_group",
    "profiling_name",
    "record_id",
    "retired",
    "state",
    "thread_id",
    "thread_name",
    "time_created_ns",
    "time_discovered_completed_ns",
    "time_discovered_started_ns",
    "timeout_ms",
}


@pytest.fixture(scope="module")
def gloo_dumps(tmp_path_factory) -> Path:
    """tests/jobs/pipeline_hang.py on 4 gloo ranks until each has dumped its Flight Recorder, then stopped."""
    dumps = tmp_path_factory.mktemp("gloo-pipeline")
    job = subprocess.Popen(
        [*TORCHRUN, str(JOB), "--dumps", str(dumps), "--skip-rank", str(SKIP_RANK), "--skip-at", str(SKIP_AT)],
        env={**os.environ, "TORCH_FR_BUFFER_SIZE": "2000"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        wait_until(lambda: len(list(dumps.glob("nccl_trace_rank_*"))) == 4 or job.poll() is not None, "4 dumps", 180)
        assert job.poll() is None, f"the job ended before it hung:\n{job.communicate()[1].decode()[-3000:]}"
    finally:
        stop(job)
    return dumps


def stop(job: subprocess.Popen) -> None:
    """torchrun stopped, and with it its ranks (each in a session of its own, out of reach of a signal to
    torchrun's group): SIGTERM, which torchrun passes on to them; any rank left then is killed."""
    ranks = Path(f"/proc/{job.pid}/task/{job.pid}/children").read_text().split() if job.poll() is None else []
    job.terminate()
    try:
        job.communicate(timeout=60)
    finally:
        for pid in map(int, ranks):
            with contextlib.suppress(OSError):
                if JOB.name.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                    os.kill(pid, signal.SIGKILL)


def test_gloo_records_collectives_only(gloo_dumps):
    for rank in range(4):
        dump = pickle.loads((gloo_dumps / f"nccl_trace_rank_{rank}").read_bytes())
        assert dump["entries"] and all(set(e) == GLOO_KEYS for e in dump["entries"])
        names = {e["profiling_name"] for e in dump["entries"]}
        assert names == {"gloo:all_reduce"}, f"gloo now records {names}: match its sends and receives here too"
        assert {e["state"] for e in dump["entries"]} == {"scheduled"}
        # all-reduce #4: entered (not retired) by the stages before the fault, never by those after
        retired = [(e["collective_seq_id"], e["retired"]) for e in dump["entries"]]
        assert retired == [(1, True), (2, True), (3, True)] + ([(4, False)] if rank <= SKIP_RANK else [])


def test_what_gloo_records_names_the_ranks_missing_from_the_all_reduce(gloo_dumps, tmp_path):
    db = tmp_path / "s.duckdb"
    report = import_and_analyze(gloo_dumps, db, "gloo-pp")
    assert query(db, "SELECT count(*) FROM ops WHERE (attrs->>'$.is_p2p')::BOOLEAN") == [(0,)]
    assert query(db, "SELECT DISTINCT rank, seq, attrs->>'$.state' FROM ops WHERE seq >= 3 ORDER BY ALL") == [
        (0, 3, "completed"),
        (0, 4, "scheduled"),
        (1, 3, "completed"),
        (1, 4, "scheduled"),
        (2, 3, "completed"),
        (3, 3, "completed"),
    ]
    (finding,) = report["findings"]  # no send or receive to match
    assert finding["ranks"] == [2, 3]
    assert finding["summary"] == "ranks 0, 1 are blocked in all_reduce #4 of group 0: ranks 2, 3 never entered it"
