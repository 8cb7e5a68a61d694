"""A hang's Flight Recorder without hands: when the answers to a hang's stacks request carry torch's Flight
Recorder entries, the collector matches them across ranks as it matches dumps imported by hand (the import's own
reading of an entry, collector/analysis/recorded.py), and the hang finding names what they show.

On small inputs: answers with entries in NCCL's form (tests/support/flight_dumps.py, as
tests/collector/analysis/test_p2p_match.py builds
them) where a rank never entered an all-reduce, where one entered it with other sizes, where a receive was never
sent: the verdict in the hang finding's evidence and summary (the hang analyzer judging frames whose stacks are
those answers); answers without entries: no verdict, the stacks shown; a request some rank has yet to answer: no
verdict until it settles; the same dumps answered live and imported by hand: the same findings; on a real store,
each answer read once however many passes ask (the engine's read_stacks), and an answer whose Flight Recorder is
no such thing told apart.

End to end: a real collector, and a hung job's ranks answering through the agent's exporter (tests/support/hung_job.py)
with entries in the form torch 2.13's gloo gives on CPU (tests/agent/test_stacks_agent.py reads a real gloo job's):
rank 2 never entered all-reduce #17, which ranks 0, 1 and 3 wait in. The hang finding, its alert, the query API's
stacks route, `rankwatch analyze` (text and JSON) and the dashboard's evidence reader name it.
"""

import json
import time

import pandas as pd
import pytest

from collector.alerts import rules
from collector.analysis import recorded
from collector.analysis.analyzers import Frames
from collector.analysis.analyzers.hangs import judge
from collector.analysis.engine import read_stacks
from collector.analysis.stacks import Answers
from collector.control import commands
from collector.store.db import connect, create_tables
from dashboard import evidence
from rankwatch.agent import semconv as sc
from tests.support import flight_dumps, loopback
from tests.support.collectors import job_collector
from tests.support.commands import rankwatch_in_process
from tests.support.flight_dumps import entry
from tests.support.hung_job import AT_ALL_REDUCE, BLOCKED, OUTER, Hung, Job, ask, frame, hang_finding
from tests.support.waits import wait_until

S = 10**9
RANKS = range(4)
WORLD = {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1, 2, 3]"}}
MB4 = [[1024, 1024]]


def recorder(entries: list[dict], pg_config: dict = WORLD, backend: str = "nccl") -> dict:
    """A rank's Flight Recorder as its answer holds it (torch's JSON dump, rankwatch/agent/stacks.py)."""
    return {"backend": backend, "version": "2.10", "pg_config": pg_config, "pg_status": {}, "entries": entries}


def all_reduces(last: int, state: str = "started", **kw) -> list[dict]:
    """All-reduce #1 to #last of the world, the last in `state` (`kw`: its other arguments), the others completed."""
    return [entry(s - 1, s) for s in range(1, last)] + [entry(last - 1, last, state=state, **kw)]


def p2p(rank: int, op: str, peer: int, seqs, state: str = "completed") -> list[dict]:
    """`rank`'s sends to (or receives from) `peer`, numbered `seqs`, NCCL's entries of them."""
    name = f"send {rank}->{peer}" if op == "send" else f"recv {rank}<-{peer}"
    return [entry(100 + s, 6, name, state, p2p_seq=s) for s in seqs]


def stalled(answers: Answers) -> Frames:
    """A stall under way, 45 s after the last of 10 steps of 2 s: ranks 0, 1, 3 blocked in all-reduce #10 of the
    world, rank 2 past #9; the stacks the hang analyzer reads are `answers`."""
    steps = pd.DataFrame(
        [("r", rank, step, (step + 1) * 2 * S, 2.0) for step in range(10) for rank in RANKS],
        columns=["run_id", "rank", "step", "end_ts", "duration_s"],
    )
    beats = pd.DataFrame(
        [(r, 64 * S, 10, "backward", "all_reduce", "world", 10 - (r == 2), r == 2) for r in RANKS],
        columns=["rank", "ts", "step", "phase", "op", "group", "seq", "done"],
    )
    placement = pd.DataFrame({"rank": list(RANKS)})
    return Frames("r", steps, 10, 9, placement, 65 * S, heartbeats=beats, stacks=lambda since, until: answers)


def answered(recorders: dict[int, dict | None], asked=RANKS, state: str = "pending") -> Answers:
    """The answers of the ranks of `recorders` (each rank's Flight Recorder, or None), their main threads blocked
    in an all-reduce, read as the engine reads them."""
    texts = [(rank, json.dumps(r)) for rank, r in recorders.items()]
    return Answers(41, state, 0, list(asked), [([rank], BLOCKED) for rank in recorders], recorded.read("r", texts))


def hang(answers: Answers):
    (finding,) = judge(stalled(answers))
    return finding


MISSING = "ranks 0, 1, 3 are blocked in all_reduce #7 of group 0 (default_pg): rank 2 never entered it"
CASES = {
    "a rank never entered the all-reduce": (
        {r: recorder(all_reduces(7) if r != 2 else all_reduces(6, "completed")) for r in RANKS},
        MISSING,
        [2],
        {"collective": {"op": "all_reduce", "group": "0", "seq": 7, "waiting_ranks": [0, 1, 3]}, "missing_ranks": [2]},
    ),
    "a rank entered it with other sizes": (
        {r: recorder(all_reduces(7, input_sizes=[[512]] if r == 3 else MB4)) for r in RANKS},
        (
            "ranks 0–2 are blocked in all_reduce #7 of group 0 (default_pg): rank 3 entered it as all_reduce of "
            "[[512]] -> [[512]] instead of all_reduce of [[1024, 1024]] -> [[1024, 1024]]"
        ),
        [3],
        {"collective": {"op": "all_reduce", "group": "0", "seq": 7, "waiting_ranks": [0, 1, 2]}, "missing_ranks": []},
    ),
    "a receive was never sent": (
        {
            0: recorder(all_reduces(6, "completed") + p2p(0, "send", 1, range(1, 12))),
            1: recorder(
                all_reduces(6, "completed") + p2p(1, "recv", 0, range(1, 12)) + p2p(1, "recv", 0, [12], "started")
            ),
            2: recorder(all_reduces(6, "completed")),
            3: recorder(all_reduces(6, "completed")),
        },
        (
            "rank 1 is blocked in point-to-point transfers of group 0 (default_pg): rank 1 waits in recv from rank 0 "
            "(p2p seq 12) that rank 0 never sent: rank 0's last send to rank 1 is seq 11"
        ),
        [0],
        {"collective": {"op": "recv", "group": "0", "seq": 12, "waiting_ranks": [1]}, "missing_ranks": [0]},
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_the_hang_finding_names_what_the_answers_flight_recorders_show(case):
    recorders, summary, culprits, shown = CASES[case]
    finding = hang(answered(recorders))
    told = finding.evidence["flight_recorder"]
    (verdict,) = told["verdicts"]
    assert (told["ranks"], told["more"], verdict["summary"], verdict["ranks"]) == (4, 0, summary, culprits)
    assert {key: verdict[key] for key in shown} == shown
    assert finding.summary.endswith(f"; flight recorder: {summary}"), finding.summary
    assert "; stacks: every rank that answered is at " in finding.summary  # the stacks stay, before it
    assert [g["ranks"] for g in finding.evidence["stacks"]["groups"]] == [[0, 1, 2, 3]]
    assert "which rank 2 never entered" in finding.summary  # the hang analyzer's own verdict, from heartbeats
    assert recorded.lines(told) == [summary]


def test_answers_without_entries_show_the_stacks_and_no_verdict():
    finding = hang(answered(dict.fromkeys(RANKS)))  # flight_recorder null: torch.distributed not started
    assert "flight_recorder" not in finding.evidence and "flight recorder" not in finding.summary
    assert finding.evidence["stacks"]["groups"][0]["where"] == AT_ALL_REDUCE and "; stacks: " in finding.summary
    # an empty ring (TORCH_FR_BUFFER_SIZE=0 keeps none): every rank's entries match, and the summary is the stacks'
    empty = hang(answered({r: recorder([]) for r in RANKS}))
    assert empty.evidence["flight_recorder"] == {"ranks": 4, "verdicts": [], "more": 0}
    assert "flight recorder" not in empty.summary
    assert recorded.lines(empty.evidence["flight_recorder"]) == [f"4 ranks' entries match: {recorded.NOTHING}"]
    assert evidence.recorders(empty.evidence["flight_recorder"])[1].endswith(
        "4 ranks matched across ranks: all matched"
    )


def test_the_verdict_waits_for_every_rank_asked_or_the_request_to_settle():
    """A rank yet to answer would read as one that never entered: no verdict while it may still answer; once the
    request settled without it, it is named, as a rank whose Flight Recorder nobody read."""
    some = {r: recorder(all_reduces(7) if r != 2 else all_reduces(6, "completed")) for r in (0, 1, 2)}
    pending = hang(answered(some, asked=RANKS))
    assert "flight_recorder" not in pending.evidence and pending.evidence["stacks"]["unanswered"] == [3]
    settled = hang(answered(some, asked=RANKS, state="failed"))
    (verdict,) = settled.evidence["flight_recorder"]["verdicts"]
    assert verdict["summary"] == (
        "ranks 0, 1 are blocked in all_reduce #7 of group 0 (default_pg): ranks 2, 3 never entered it "
        "(no dump from rank 3)"
    )
    assert (verdict["missing_ranks"], verdict["no_dump_ranks"]) == ([2, 3], [3])


def test_a_verdict_is_bounded():
    """Thousands of groups may hang, thousands of ranks call otherwise: the evidence lists the first SHOWN findings
    and each the first MAX_RECORDS calls, counting the rest."""
    world = {"0": {"name": "0", "desc": "default_pg", "ranks": json.dumps(list(range(40)))}}
    pairs = {f"{g}": {"name": f"{g}", "desc": "tp", "ranks": json.dumps([2 * g - 2, 2 * g - 1])} for g in range(1, 21)}
    answers = []
    for rank in range(40):
        group = str(rank // 2 + 1)
        entries = all_reduces(7, input_sizes=[[512]] if rank >= 20 else MB4)
        entries += [entry(10, 1, pg=(group, "tp"), state="completed")]
        if rank % 2 == 0:  # the pair's first rank entered the pair's next all-reduce, its second never did
            entries += [entry(11, 2, pg=(group, "tp"), state="started")]
        answers.append((rank, json.dumps(recorder(entries, {**world, group: pairs[group]}))))
    told = recorded.read("r", answers).verdict
    assert told is not None and (len(told["verdicts"]), told["more"]) == (recorded.SHOWN, 21 - recorded.SHOWN)
    world_verdict = told["verdicts"][0]
    assert world_verdict["collective"]["seq"] == 7 and world_verdict["ranks"] == list(range(20, 40))
    assert (len(world_verdict["mismatched"]), world_verdict["mismatched_count"]) == (recorded.MAX_RECORDS, 20)
    assert recorded.lines(told)[-1] == f"and {21 - recorded.SHOWN} more"


def test_answered_live_or_imported_by_hand_the_same_dumps_give_the_same_findings(tmp_path):
    """A 4-rank job's dumps (an all-gather and a send in tensor-parallel groups, rank 2 missing from all-reduce #7),
    imported by `rankwatch import flight-recorder` and analyzed, and answered as JSON dumps: the same findings."""
    dumps = flight_dumps.job(flight_dumps.HUNG)
    flight_dumps.write(tmp_path / "dumps", dumps)
    db = str(tmp_path / "s.duckdb")
    imported = rankwatch_in_process("import", "flight-recorder", str(tmp_path / "dumps"), "--run", "fr", "--db", db)
    assert imported.returncode == 0, imported.stderr
    report = rankwatch_in_process("analyze", "fr", "--db", db, "--json")
    assert report.returncode == 0, report.stderr
    by_hand = [(f["summary"], f["ranks"], f["evidence"]) for f in json.loads(report.stdout)["findings"]]
    live = recorded.read("fr", [(rank, json.dumps(flight_dumps.json_dump(d))) for rank, d in dumps.items()])
    assert [(f.summary, f.ranks, f.evidence) for f in live.found] == by_hand
    assert by_hand[0][0] == MISSING


def test_each_answer_is_read_once_however_many_passes_ask(tmp_path):
    """On a real store, as the engine's passes read a hang's answers: those that came since the last read are
    read, added to those read before; with nothing new, what was read (and matched) is the same object. An
    answer whose Flight Recorder is no such thing is unreadable, its rank named; one that is no JSON is no
    Flight Recorder at all."""
    con = connect(tmp_path / "rankwatch.duckdb")
    create_tables(con)
    request = commands.create(con, "r", "stacks", {"ranks": None}, "analysis")["id"]
    bodies = {r: recorder(all_reduces(7) if r != 2 else all_reduces(6, "completed")) for r in RANKS}

    def answer(rank: int, body: str) -> None:
        attrs = json.dumps({sc.STACKS_REQUEST: request})
        con.execute(
            "INSERT INTO events (run_id, rank, ts, event, body, attrs) VALUES ('r', ?, make_timestamp_ns(?), ?, ?, ?)",
            [rank, time.time_ns(), sc.EVENT_RANK_STACKS, body, attrs],
        )

    def read() -> Answers:
        answers = read_stacks(con, "r", every_rank=True, known=known, recorded=True)
        assert answers is not None and answers.recorded is not None
        return answers

    known: dict = {}
    for rank in (0, 1):
        answer(rank, json.dumps({"threads": [], "flight_recorder": bodies[rank]}))
    first = read().recorded
    assert (first.seen, first.dumped) == ((0, 1), (0, 1))
    for rank in (2, 3):
        answer(rank, json.dumps({"threads": [], "flight_recorder": bodies[rank]}))
    answer(4, "not JSON")
    answer(5, json.dumps({"threads": [], "flight_recorder": {"entries": "none", "pg_config": {}}}))
    second = read().recorded
    assert (sorted(second.seen), second.dumped, second.unreadable) == ([0, 1, 2, 3, 4, 5], (0, 1, 2, 3), (5,))
    assert second.entries.iloc[: len(first.entries)].equals(first.entries)  # rank 0's and 1's, as read first
    assert read().recorded is second and second.verdict is second.verdict  # nothing new: nothing read nor matched
    (verdict,) = second.verdict["verdicts"]
    assert verdict["summary"] == MISSING and second.verdict["unreadable"] == [5]
    assert evidence.recorders(second.verdict)[1].endswith("; what rank 5 gave is no Flight Recorder")
    con.close()


# --- end to end: a live collector, a hung job's ranks answering with gloo's entries

RUN, STEPS, HUNG = "fr-live", 17, 2
# Rank 2 blocked in its data loader (as tests/jobs/stacks_hang.py's), the others in the all-reduce
LOADER = [*OUTER, frame("/job/train.py", 90, "__next__", "os.read(fifo, 1)")]
GLOO_WORLD = {"": {"desc": "", "name": "", "ranks": "[0, 1, 2, 3]"}}  # what torch 2.13's gloo lists, as it lists it
VERDICT = "ranks 0, 1, 3 are blocked in all_reduce #17 of group 0: rank 2 never entered it"


def gloo_all_reduce(seq: int, retired: bool) -> dict:
    """An all-reduce as torch 2.13's gloo records it on CPU, with the keys it gives (docs/telemetry.md): every entry
    `scheduled`, `retired` once its work ran."""
    created = flight_dumps.T0 + seq * 10**7
    return {
        "collective_seq_id": seq,
        "input_dtypes": ["Float"],
        "input_sizes": [[4]],
        "is_p2p": False,
        "op_id": seq,
        "output_dtypes": ["Float"],
        "output_sizes": [[4]],
        "p2p_seq_id": 0,
        "pg_id": 0,
        "process_group": ["0", "default_pg"],
        "profiling_name": "gloo:all_reduce",
        "record_id": seq - 1,
        "retired": retired,
        "state": "scheduled",
        "thread_id": "139632482036608",
        "thread_name": "python",
        "time_created_ns": created,
        "time_discovered_completed_ns": 0,
        "time_discovered_started_ns": 0,
        "timeout_ms": 1800000,
    }


def gloo_body(rank: int) -> str:
    """A rank's answer: its main thread, and its gloo Flight Recorder: all-reduce #1 to #16 retired, and #17
    entered, not retired, by every rank but rank 2."""
    last = STEPS - 1 if rank == HUNG else STEPS
    kept = recorder([gloo_all_reduce(seq, seq < STEPS) for seq in range(1, last + 1)], GLOO_WORLD, backend="gloo")
    main = LOADER if rank == HUNG else BLOCKED
    return json.dumps(
        {"threads": [{"name": "MainThread", "ident": 1, "main": True, "frames": main}], "flight_recorder": kept}
    )


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """The hung job's run on a live collector (analysis every 0.5 s, a stall of 3 s is a hang), from its steps
    to the collector's stop: the hang finding once its Flight Recorder verdict came, its alert, the stacks route;
    then the store."""
    directory = tmp_path_factory.mktemp("fr-live")
    seen: dict = {}
    with job_collector(directory, "--analyze-every", "0.5", "--hang-after", "3") as collector:
        job = Job(collector, Hung(RUN, len(RANKS), HUNG, STEPS, gloo_body))
        with loopback.Client(base_url=collector.url, headers=collector.headers, timeout=60) as api:
            try:
                job.steps()
                job.start()
                wait_until(
                    lambda: "flight_recorder" in hang_finding(api, RUN)[2],
                    "the hang finding never told what the ranks' Flight Recorders say",
                    90,
                )
                seen["finding"] = hang_finding(api, RUN)
                alert = f"SELECT annotations FROM alerts WHERE run_id = '{RUN}' AND analyzer = 'hangs'"
                told = lambda: json.loads((ask(api, alert) or [["{}"]])[0][0])  # noqa: E731
                wait_until(lambda: "flight_recorder" in told(), "the alert never told the Flight Recorders", 90)
                seen["alert"] = told()
                seen["route"] = api.get(f"/v1/runs/{RUN}/stacks")
            finally:
                job.finish()
    seen["db"] = collector.db
    return seen


def test_the_live_hang_finding_names_the_rank_that_never_entered_the_all_reduce(live):
    _, summary, found = live["finding"]
    (verdict,) = found["flight_recorder"]["verdicts"]
    assert (verdict["summary"], verdict["ranks"], verdict["missing_ranks"]) == (VERDICT, [2], [2])
    assert verdict["collective"] == {"op": "all_reduce", "group": "0", "seq": 17, "waiting_ranks": [0, 1, 3]}
    assert summary.endswith(f"; flight recorder: {VERDICT}"), summary
    assert "which rank 2 never entered" in summary and "; stacks: rank 2: " in summary
    assert [g["ranks"] for g in found["stacks"]["groups"]] == [[0, 1, 3], [2]]
    # as the dashboard shows it (the Hangs page and a finding's evidence read it so)
    shown = dict(evidence.read(found).tables)["flight_recorder"]
    assert shown.to_dict("records") == [{"culprits": "2", "verdict": VERDICT}]
    assert evidence.recorders(found["flight_recorder"])[1] == "the entries of 4 ranks matched across ranks"


def test_the_alert_and_the_stacks_route_tell_the_verdict(live):
    assert live["alert"]["flight_recorder"] == VERDICT
    assert live["alert"]["flight_recorder"] == rules.annotations("", "", live["finding"][2])["flight_recorder"]
    assert live["alert"]["summary"].endswith(f"; flight recorder: {VERDICT}")
    route = live["route"]
    assert route.status_code == 200, route.text
    assert route.json()["flight_recorder"] == live["finding"][2]["flight_recorder"]


def test_rankwatch_analyze_names_it_after_the_fact(live):
    text = rankwatch_in_process("analyze", RUN, "--db", str(live["db"]), "--hang-after", "3")
    assert text.returncode == 0, text.stderr
    assert "hangs / hang, what the Flight Recorders say:" in text.stdout
    assert f"  {VERDICT}" in text.stdout.splitlines()
    document = rankwatch_in_process("analyze", RUN, "--db", str(live["db"]), "--hang-after", "3", "--json")
    (hang_,) = [f for f in json.loads(document.stdout)["findings"] if f["analyzer"] == "hangs"]
    assert hang_["evidence"]["flight_recorder"]["verdicts"][0]["summary"] == VERDICT
    assert hang_["summary"].endswith(f"; flight recorder: {VERDICT}")
