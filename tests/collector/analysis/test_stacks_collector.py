"""Where every rank is, on the collector's side: the merge of the ranks' stacks (collector/analysis/stacks.py) on
small inputs, the `stacks` command through the real control API, and a hung run in a real collector whose ranks
answer as the agent does (`rank_stacks` events through the agent's exporter, from a thread that polls the control
API as a node's sidecar does): the collector asks once when the hang fires, the answers end up merged in the hang
finding's evidence and summary, its alert, the query API's route, `rankwatch stacks`, `rankwatch analyze` and the
dashboard's Hangs page, and the requests settle once their time is up."""

import json
import threading
import time

import duckdb
import pandas as pd
import pytest

from collector.analysis import stacks
from collector.analysis.stacks import Answers
from collector.control import commands
from collector.store.db import connect, create_tables
from dashboard import evidence
from rankwatch.agent import semconv as sc
from tests.support import hung_job, loopback
from tests.support.collectors import Collector, free_port
from tests.support.commands import rankwatch_in_process
from tests.support.hung_job import AT_ALL_REDUCE, AT_FORWARD, BLOCKED, IN_FORWARD, LIB, OUTER, Hung, Job, ask, frame
from tests.support.waits import wait_until


def answers(stacks_by_rank: dict[int, object], asked=None, state: str = "pending") -> Answers:
    asked = sorted(stacks_by_rank) if asked is None else asked
    return Answers(41, state, 0, asked, [([rank], frames) for rank, frames in stacks_by_rank.items()])


# --- the merge, on small inputs


def test_ranks_at_one_place_are_one_group_whatever_their_library_frames():
    """The line names the call the user's code makes and the user's lines; torch's frames (its wrappers, its
    internals at another line, rankwatch's agent wrapping the collective) fold into that call."""
    agent = frame("/work/rankwatch/agent/collectives.py", 260, "call")
    other_internals = [*BLOCKED[:4], agent, frame(LIB + "distributed/distributed_c10d.py", 2811, "all_reduce")]
    by_rank = dict.fromkeys(range(16), BLOCKED) | {3: other_internals, 7: IN_FORWARD}
    merged = stacks.merge(answers(by_rank), culprits=[7])
    assert [(g["ranks"], g["where"]) for g in merged["groups"]] == [
        ([r for r in range(16) if r != 7], AT_ALL_REDUCE),
        ([7], AT_FORWARD),
    ]
    assert merged["groups"][0]["line"] == f"ranks 0-6,8-15: {AT_ALL_REDUCE}"
    assert merged["groups"][1]["calls"][0] == {"calls": None, "in": "forward", "file": "/job/model.py", "line": 50}
    assert (merged["odd"], merged["asked"], merged["answered"], merged["unanswered"]) == (1, 16, 16, [])
    assert stacks.odd_words(merged) == f"rank 7: {AT_FORWARD}; 15 other ranks, most at {AT_ALL_REDUCE}"


def test_the_odd_group_out_is_a_minority_preferring_the_culprits():
    four_four = {r: BLOCKED if r < 4 else IN_FORWARD for r in range(8)}
    assert stacks.merge(answers(four_four), culprits=[6])["odd"] == 1  # alike in size: the culprit's group
    assert stacks.merge(answers(four_four))["odd"] is None  # alike, and nobody blamed: none stands out
    three = dict.fromkeys(range(8), BLOCKED) | {2: IN_FORWARD, 5: OUTER}
    merged = stacks.merge(answers(three), culprits=[5])
    assert merged["groups"][merged["odd"]]["ranks"] == [5]  # of the two minorities, the culprit's
    assert stacks.merge(answers(dict.fromkeys(range(4), BLOCKED)))["odd"] is None
    assert stacks.odd_words(stacks.merge(answers(dict.fromkeys(range(4), BLOCKED)))) == (
        f"every rank that answered is at {AT_ALL_REDUCE}"
    )


def test_ranks_that_did_not_answer_are_told_and_the_request_settles():
    merged = stacks.merge(answers({0: BLOCKED, 1: BLOCKED}, asked=[0, 1, 2, 3]))
    assert (merged["unanswered"], merged["settled"], merged["answered"]) == ([2, 3], False, 2)
    assert stacks.lines(merged)[-1] == "not answered yet: ranks 2,3"
    failed = stacks.merge(answers({0: BLOCKED, 1: BLOCKED}, asked=[0, 1, 2, 3], state="failed"))
    assert failed["settled"] and stacks.lines(failed)[-1] == "not answered: ranks 2,3"
    assert stacks.merge(answers({0: BLOCKED}, asked=[0]))["settled"]  # all answered: nothing more to come


def test_what_the_merge_reads_is_bounded_and_garbage_is_no_stack():
    """A group per place up to MAX_GROUPS (the rest one group, the odd one kept), only a thread's innermost
    MAX_FRAMES frames read, names cut, and answers without a usable main thread one group of their own."""
    scattered = {r: [*OUTER, frame("/job/train.py", 1000 + r, "train_step")] for r in range(40)}
    scattered |= dict.fromkeys(range(40, 100), BLOCKED)
    merged = stacks.merge(answers(scattered), culprits=[39])
    assert len(merged["groups"]) == stacks.MAX_GROUPS
    assert merged["groups"][merged["odd"]]["ranks"] == [39]
    assert merged["groups"][-1]["where"] == f"{stacks.ELSEWHERE} (26 places)"
    assert sum(len(g["ranks"]) for g in merged["groups"]) == 100
    deep = [frame("/job/train.py", 5, "recurse")] * 10_000 + [frame("/job/model.py", 9, "x" * 10_000)]
    (group,) = stacks.merge(answers({0: deep}))["groups"]
    assert group["calls"][0]["in"] == "x" * stacks.MAX_NAME and len(group["calls"]) == stacks.DEPTH
    garbage = {0: None, 1: "frames", 2: [1, {"file": 3}], 3: [{"line": 4}]}
    (group,) = stacks.merge(answers(garbage))["groups"]
    assert (group["ranks"], group["where"]) == ([0, 1, 2, 3], stacks.NO_STACK)


def test_a_thread_in_library_code_alone_shows_its_innermost_frame():
    waiting = [frame("/usr/lib/python3.11/threading.py", 355, "wait"), frame("<frozen runpy>", 88, "_run_code")]
    (group,) = stacks.merge(answers({0: waiting[::-1]}))["groups"]
    assert group["where"] == "in `wait` at threading.py:355"


def test_the_dashboard_reads_the_stacks_as_a_table_of_places():
    merged = stacks.merge(answers(dict.fromkeys(range(6), BLOCKED) | {4: IN_FORWARD}, asked=range(8)), [4])
    read = evidence.read({"stacks": merged, "stalled_s": 40.0})
    ((key, table),) = read.tables
    assert key == "stacks" and table.to_dict("records") == [
        {"ranks": "0–3, 5", "where": AT_ALL_REDUCE},
        {"ranks": "4", "where": AT_FORWARD + "  (the odd one out)"},
    ]
    assert ("stacks: not answered", "6, 7 (so far)") in list(read.figures.itertuples(index=False, name=None))


def test_the_hang_analyzer_puts_the_stacks_of_a_request_made_during_the_stall_in_its_finding():
    """A stall under way asks for the request made since it began, a stall the steps closed for one made
    during it; its evidence gets the groups and its summary the odd group out once, however many passes."""
    from collector.analysis.analyzers import Frames
    from collector.analysis.analyzers.hangs import judge
    from tests.support.hang_frames import RANKS as FOUR
    from tests.support.hang_frames import S, beats, steps

    asked: list[tuple] = []
    answered = answers({0: BLOCKED, 1: IN_FORWARD, 2: BLOCKED, 3: BLOCKED})

    def made_during(since_ns: int, until_ns: int | None) -> Answers:
        asked.append((since_ns, until_ns))
        return answered

    hb = beats(
        [(r, t * S, 10, "backward", "all_reduce", "world", 10, False) for r in (0, 2, 3) for t in (45, 64)]
        + [(1, t * S, 10, "forward", "all_reduce", "world", 9, True) for t in (45, 64)]
    )
    placement, kept = pd.DataFrame({"rank": list(FOUR)}), {}
    for _ in range(2):  # two passes of the live engine over the stall under way
        frames = Frames("r", steps(), 10, 9, placement, 65 * S, heartbeats=hb, kept=kept, stacks=made_during)
        (hung,) = judge(frames)
    assert asked == [(20 * S, None)] * 2
    assert [g["ranks"] for g in hung.evidence["stacks"]["groups"]] == [[0, 2, 3], [1]]
    assert hung.summary.count("; stacks: ") == 1 and hung.summary.endswith(
        f"; stacks: rank 1: {AT_FORWARD}; 3 other ranks, most at {AT_ALL_REDUCE}"
    )
    resumed = pd.concat([steps(), steps(11).query("step == 10").assign(end_ts=80 * S)], ignore_index=True)
    frames = Frames("r", resumed, 10, 10, placement, 81 * S, heartbeats=hb, stacks=made_during)
    (closed,) = judge(frames)
    assert asked[-1] == (20 * S, 80 * S) and closed.evidence["stacks"]["odd"] == 1
    answered = answers({})  # a request nobody answered yet: the finding as the heartbeats alone say
    (unanswered,) = judge(Frames("r", steps(), 10, 9, placement, 65 * S, heartbeats=hb, stacks=made_during))
    assert "stacks" not in unanswered.evidence and "; stacks: " not in unanswered.summary


def test_a_hang_is_asked_once_and_its_request_answers_no_anomaly(tmp_path):
    """On a real store: one stacks request per firing hang finding, however often asked; and a stacks request,
    which names its hang finding, is no rollback: an anomaly drawn before it still gets one."""
    con = connect(tmp_path / "rankwatch.duckdb")
    create_tables(con)
    insert = """INSERT INTO findings (run_id, analyzer, kind, ranks, step_start, step_end, severity)
                VALUES (?, ?, ?, ?, ?, ?, ?)"""
    con.execute(insert, ["r", "anomalies", "loss_spike", [], 20, 20, "critical"])
    con.execute(insert, ["r", "hangs", "hang", [5], 10, 10, "critical"])
    (asked,) = commands.stacks_for_hangs(con, "r")
    assert commands.stacks_for_hangs(con, "r") == [] and commands.listing(con, "r") == [asked]
    (rollback,) = commands.rollbacks_for_anomalies(con, "r", commands.RollbackPolicy())
    assert rollback["kind"] == "rollback" and rollback["args"]["anomaly"] == "loss_spike"
    con.close()


# --- the control API: the `stacks` kind, the kind filter, held polls


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """One collector for the module: analysis every 0.5 s, a stall of 3 s is a hang."""
    directory = tmp_path_factory.mktemp("stacks")
    with open(directory / "collector.log", "w") as log:
        c = Collector(
            directory / "rankwatch.duckdb",
            free_port(),
            "test-token-0123456",
            extra_args=("--analyze-every", "0.5", "--hang-after", "3"),
            log=log,
        ).start()
        yield c
        if c.process.poll() is None:
            c.stop()


@pytest.fixture(scope="module")
def api(live):
    with loopback.Client(base_url=live.url, headers=live.headers, timeout=60) as client:
        yield client


def created(api, run_id: str, ranks) -> dict:
    """A person's stacks request, through `api` (a client of the collector, or httpx itself)."""
    body = {"run_id": run_id, "kind": "stacks", "args": {"ranks": ranks}}
    response = api.post("/v1/commands", json=body)
    assert response.status_code == 201, response.text
    return response.json()


def listed(api, **params) -> list[dict]:
    response = api.get("/v1/commands", params=params)
    assert response.status_code == 200, response.text
    return response.json()


def answered(api) -> int | None:
    """How many ranks' answers the hang finding's stacks hold (None before any came)."""
    return hang_finding(api)[2].get("stacks", {}).get("answered")


def stacks_cli(live, *args: str, run: str = "stacks-hang"):
    """`rankwatch stacks RUN --collector URL ARGS`, with the collector's token."""
    return rankwatch_in_process(
        "stacks", run, "--collector", live.url, *args, env={"RANKWATCH_TOKEN": live.token, "RANKWATCH_TOKEN_FILE": ""}
    )


def test_a_stacks_request_through_the_control_api(api):
    every = created(api, "api-stacks", None)
    some = created(api, "api-stacks", [5, 3, 3, 0])
    assert (every["kind"], every["args"], every["state"], every["created_by"]) == (
        "stacks",
        {"ranks": None},
        "pending",
        "api",
    )
    assert some["args"] == {"ranks": [0, 3, 5]}  # sorted, each once
    rollback = api.post("/v1/commands", json={"run_id": "api-stacks", "kind": "rollback", "args": {"before_step": 3}})
    assert rollback.status_code == 201
    ids = [every["id"], some["id"]]
    assert [c["id"] for c in listed(api, run_id="api-stacks", kind="stacks")] == ids
    assert [c["id"] for c in listed(api, run_id="api-stacks", kind="rollback,power_cap")] == [rollback.json()["id"]]
    assert [c["id"] for c in listed(api, run_id="api-stacks", kind="stacks", after=str(ids[0]))] == ids[1:]
    # the job never moves a stacks request (many ranks answer it); a person may cancel it
    refused = api.post(f"/v1/commands/{some['id']}", json={"state": "acked", "apply_step": 3})
    assert refused.status_code == 400 and "stacks request" in refused.json()["error"]
    assert api.post(f"/v1/commands/{some['id']}", json={"state": "cancelled"}).json()["state"] == "cancelled"


@pytest.mark.parametrize(
    "args, why",
    [
        ({"ranks": []}, "a list of 1 to"),
        ({"ranks": [-1]}, "a rank must be an integer in [0, 16777216)"),
        ({"ranks": [16777216]}, "a rank must be an integer"),
        ({"ranks": [True]}, "a rank must be an integer"),
        ({"ranks": ["3"]}, "a rank must be an integer"),
        ({"ranks": list(range(commands.MAX_ASKED + 1))}, "a list of 1 to 16,384 ranks"),
        ({"ranks": 3}, "ranks: null (every rank)"),
        ({"rank": None}, "ranks: null (every rank)"),
    ],
)
def test_a_stacks_request_the_ranks_could_not_answer_is_refused(api, args, why):
    response = api.post("/v1/commands", json={"run_id": "api-stacks", "kind": "stacks", "args": args})
    assert response.status_code == 400 and why in response.json()["error"], response.text


@pytest.mark.parametrize(
    "params, why",
    [
        ({"kind": "reboot"}, "unknown command kind 'reboot'"),
        ({"kind": "stacks,"}, "unknown command kind ''"),
        ({"after": "-1"}, "after takes a command id"),
        ({"after": "9" * 20}, "after takes a command id"),
    ],
)
def test_a_poll_with_a_bad_kind_or_after_is_refused(api, params, why):
    response = api.get("/v1/commands", params={"run_id": "api-stacks", **params})
    assert response.status_code == 400 and why in response.json()["error"], response.text


def test_held_polls_wait_for_their_own_kinds(api):
    """Rank 0's poll (its kinds) is not woken by a pending stacks request; an answerer's (stacks, after the one
    it answered) is woken by the next."""
    first = created(api, "api-held", None)
    started = time.monotonic()
    held = listed(api, run_id="api-held", state="pending", kind="power_cap,rollback", wait="1.5")
    assert held == [] and time.monotonic() - started >= 1.4
    other = loopback.Client(base_url=str(api.base_url), headers=api.headers, timeout=60)
    later = threading.Timer(0.5, created, (other, "api-held", [1]))
    later.start()
    started = time.monotonic()
    woken = listed(api, run_id="api-held", state="pending", kind="stacks", after=str(first["id"]), wait="25")
    later.join()
    other.close()
    assert [c["args"] for c in woken] == [{"ranks": [1]}] and time.monotonic() - started < 20


@pytest.mark.parametrize(
    "args, why",
    [
        (["--ranks", "3-1"], "runs backwards"),
        (["--ranks", ","], "names no rank"),
        (["--wait", "0"], "--wait"),
        (["--collector", "ftp://x"], "is not a collector URL"),
    ],
)
def test_rankwatch_stacks_refuses_bad_input_in_one_line(live, args, why):
    refused = stacks_cli(live, *args)
    assert refused.returncode == 2 and why in refused.stderr and refused.stderr.count("\n") == 1, refused


# --- a hung run whose ranks answer, end to end

RUN, RANKS, HUNG, SILENT, STEPS = "stacks-hang", 8, 5, 7, 6


def stack_body(rank: int) -> str:
    """A rank's answer as the agent sends it: every thread, the main one marked; the hung rank's with its Flight
    Recorder's last 256 entries, past the 64 KiB other log bodies may hold."""
    main = IN_FORWARD if rank == HUNG else BLOCKED
    threads = [
        {"name": "MainThread", "ident": 1, "main": True, "frames": main},
        {"name": "pin_memory", "ident": 2, "main": False, "frames": [frame(LIB + "utils/data/pin.py", 9, "loop")]},
    ]
    entries = [
        {"record_id": i, "profiling_name": "gloo:all_reduce", "state": "completed", "note": "x" * 400}
        for i in range(256)
    ]
    recorder = {"backend": "gloo", "version": "2.4", "pg_config": {}, "entries": entries} if rank == HUNG else None
    return json.dumps({"threads": threads, "flight_recorder": recorder})


def hang_finding(api) -> tuple[int, str, dict]:
    return hung_job.hang_finding(api, RUN)


@pytest.fixture(scope="module")
def hung(live, api):
    """The hung job, from its steps to the collector's stop: what the collector said along the way (the hang
    finding once its stacks came, the route, the alert, `rankwatch stacks` three times), then the store."""
    job = Job(live, Hung(RUN, RANKS, HUNG, STEPS, stack_body, SILENT))
    seen: dict = {}
    try:
        job.steps()
        job.start()
        wait_until(lambda: answered(api) == RANKS - 1, "the hang finding never had every answer but rank 7's", 90)
        seen["finding"] = hang_finding(api)
        seen["route"] = api.get(f"/v1/runs/{RUN}/stacks")
        (auto,) = listed(api, run_id=RUN, kind="stacks")
        seen["auto"] = auto
        job.late.add(auto["id"])  # rank SILENT answers now: every rank asked has, the request is settled
        alert = f"SELECT annotations FROM alerts WHERE run_id = '{RUN}' AND analyzer = 'hangs'"
        wait_until(lambda: "stacks" in json.loads(ask(api, alert)[0][0]), "the alert never told the stacks", 90)
        seen["alert"] = json.loads(ask(api, alert)[0][0])
        seen["finding settled"] = hang_finding(api)
        seen["cli"] = stacks_cli(live, "--ranks", f"0-{SILENT - 1}", "--wait", "60")
        seen["cli some"] = stacks_cli(live, "--ranks", "0,5", "--json", "--wait", "60")
        seen["cli silent"] = stacks_cli(live, "--ranks", str(SILENT), "--wait", "1")
        seen["cli refused"] = [stacks_cli(live, "--ranks", "99"), stacks_cli(live, run="no-such-run")]
        seen["requests"] = listed(api, run_id=RUN, kind="stacks")
    finally:
        job.finish()
        live.stop()
    return seen


def test_a_hang_asks_every_rank_once(hung):
    finding_id, _, _ = hung["finding"]
    auto = hung["auto"]
    assert (auto["created_by"], auto["finding_id"], auto["args"], auto["state"]) == (
        "analysis",
        finding_id,
        {"ranks": None},
        "pending",
    )
    # one for the finding, however many passes judged it (the others are `rankwatch stacks`')
    assert [(r["created_by"], r["args"]["ranks"]) for r in hung["requests"]] == [
        ("analysis", None),
        ("api", list(range(SILENT))),
        ("api", [0, 5]),
        ("api", [SILENT]),
    ]


def test_the_hang_finding_shows_where_every_rank_is_and_names_the_odd_group(hung):
    _, summary, found = hung["finding"]
    merged = found["stacks"]
    assert [(g["ranks"], g["where"]) for g in merged["groups"]] == [
        ([0, 1, 2, 3, 4, 6], AT_ALL_REDUCE),
        ([5], AT_FORWARD),
    ]
    assert (merged["odd"], merged["unanswered"], merged["settled"]) == (1, [SILENT], False)
    assert summary.endswith(f"; stacks: rank 5: {AT_FORWARD}; 6 other ranks, most at {AT_ALL_REDUCE}"), summary
    assert "which rank 5 never entered" in summary  # the hang analyzer's own verdict stays
    _, _, settled = hung["finding settled"]
    assert settled["stacks"]["unanswered"] == [] and settled["stacks"]["groups"][0]["ranks"] == [0, 1, 2, 3, 4, 6, 7]


def test_the_alert_tells_the_stacks_once_every_rank_answered(hung):
    alert = hung["alert"]
    assert alert["stacks"].splitlines() == [
        f"ranks 0-4,6,7: {AT_ALL_REDUCE}",
        f"rank 5: {AT_FORWARD}  (the odd one out)",
    ]
    assert "; stacks: rank 5:" in alert["summary"]


def test_the_query_api_gives_a_runs_merged_stacks(hung, live):
    route = hung["route"]
    assert route.status_code == 200, route.text
    merged = route.json()
    assert merged["run_id"] == RUN and merged["request"] == hung["auto"]["id"]
    assert [g["line"] for g in merged["groups"]] == [f"ranks 0-4,6: {AT_ALL_REDUCE}", f"rank 5: {AT_FORWARD}"]
    assert merged["odd"] == 1 and merged["unanswered"] == [SILENT]


def test_rankwatch_stacks_asks_waits_and_prints_the_groups(hung):
    text = hung["cli"]
    assert text.returncode == 0, text.stderr
    request = hung["requests"][1]["id"]
    assert text.stdout.splitlines() == [
        f"run {RUN}: stacks request {request}, 7 of 7 ranks answered",
        f"  ranks 0-4,6: {AT_ALL_REDUCE}",
        f"  rank 5: {AT_FORWARD}  (the odd one out)",
    ]
    some = hung["cli some"]
    assert some.returncode == 0, some.stderr
    merged = json.loads(some.stdout)
    assert (merged["asked"], merged["answered"], merged["unanswered"]) == (2, 2, [])
    assert [g["ranks"] for g in merged["groups"]] == [[0], [5]]
    silent = hung["cli silent"]
    assert silent.returncode == 1 and "no rank answered within 1 s" in silent.stderr, silent
    assert silent.stdout.splitlines()[1:] == ["  not answered yet: rank 7"]
    no_rank, no_run = hung["cli refused"]
    for refused, why in ((no_rank, f"run {RUN} has no rank 99 (its ranks: 0–7)"), (no_run, "knows no run")):
        assert refused.returncode == 2 and why in refused.stderr and refused.stderr.count("\n") == 1, refused


def test_rankwatch_analyze_shows_the_stacks(hung, live):
    text = rankwatch_in_process("analyze", RUN, "--db", str(live.db), "--hang-after", "3")
    assert text.returncode == 0, text.stderr
    assert "hangs / hang, where every rank was:" in text.stdout
    assert f"rank 5: {AT_FORWARD}" in text.stdout
    document = json.loads(
        rankwatch_in_process("analyze", RUN, "--db", str(live.db), "--hang-after", "3", "--json").stdout
    )
    (hang,) = [f for f in document["findings"] if f["analyzer"] == "hangs"]
    assert hang["evidence"]["stacks"]["groups"][1]["ranks"] == [5]


def test_stacks_requests_settle_once_their_time_is_up(hung, live):
    """On the stopped collector's store: none settles before its time is up; then each is applied where every
    rank asked answered (the hang's, rank 7 late; those for ranks 0-6 and 0,5), else failed, saying which did not."""
    con = connect(live.db)
    try:
        assert commands.settle_stacks(con, ttl_s=3600) == []  # none is that old
        commands.settle_stacks(con, ttl_s=0)
        settled = {c["id"]: (c["state"], c["result"]) for c in commands.listing(con, RUN, kinds=("stacks",))}
    finally:
        con.close()
    auto, seven, some, silent = (r["id"] for r in hung["requests"])
    assert settled == {
        auto: ("applied", {"answered": RANKS}),
        seven: ("applied", {"answered": RANKS - 1}),
        some: ("applied", {"answered": 2}),
        silent: ("failed", {"answered": 0, "unanswered": [SILENT]}),
    }


def test_the_dashboards_hangs_page_shows_where_every_rank_is(hung, live, monkeypatch):
    from tests.support.dashboard_pages import open_page, reading, shown, texts

    reading(monkeypatch, live.db)
    page = open_page("hangs", RUN)
    (places, *_) = [t.value for t in page.table if "where" in t.value.columns]
    assert [shown(where) for where in places["where"]] == [AT_ALL_REDUCE, AT_FORWARD + "  (the odd one out)"]
    assert [shown(ranks) for ranks in places.index] == ["0–4, 6, 7", "5"]  # the hang's request: every rank answered
    assert not any("did not answer" in caption for caption in texts(page.caption))


def test_the_store_keeps_each_ranks_answer_whole(hung, live):
    """An answer is stored as it was sent (the body up to 256 KiB, where other log bodies stop at 64 KiB)."""
    con = duckdb.connect(str(live.db), read_only=True)
    try:
        bodies = con.execute(
            "SELECT DISTINCT body FROM events WHERE run_id = ? AND event = ? AND rank = ?",
            [RUN, sc.EVENT_RANK_STACKS, HUNG],
        ).fetchall()
    finally:
        con.close()
    assert bodies == [(stack_body(HUNG),)] and len(stack_body(HUNG)) > 64 * 2**10
