"""Every rank says where it is when the collector asks (a `stacks` command), while its training thread is blocked.

Real parts: two runs of an unmodified 4-rank gloo script (tests/jobs/stacks_hang.py) under `rankwatch run`, at
once, against a real collector: one through the node's sidecar, one without (`RANKWATCH_NODE=""`: each rank
polls for itself). In each, rank 2 blocks in its data loader's `__next__` while ranks 0, 1 and 3 wait in the
step's all-reduce; the test asks through the control API (POST /v1/commands, kind "stacks") for every rank's
stacks, and for ranks 1 and 2 alone. Covered: each rank asked answers once with one `rank_stacks` event carrying
the request's id, within 10 s of the request, and the ranks not asked do not; rank 2's main thread is at its
loader's line, the others' at the all-reduce's line; no thread of the agent's is in an answer; the Flight
Recorder entries say which all-reduce the others entered and rank 2 did not; the job then ends cleanly. And
the capture's bounds (threads, frames, source lines, body size, entries), read in this process and in a
one-rank gloo process. And without anyone asking: the collector (a 2 s hang floor) finds each run hung, asks
every rank for its stacks itself, and within 10 s of the finding its evidence shows rank 2 at its loader's line.
"""

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from rankwatch.agent import semconv as sc
from rankwatch.agent import stacks
from rankwatch.agent.apiclient import ApiClient
from tests.support.collectors import job_collector
from tests.support.otlp_payloads import query
from tests.support.paths import JOBS
from tests.support.waits import wait_until
from tests.support.zero_code import TORCHRUN

pytestmark = pytest.mark.long

JOB = JOBS / "stacks_hang.py"
SOURCE = JOB.read_text().splitlines()
LOADER_LINE = next(n for n, line in enumerate(SOURCE, 1) if "os.read(fifo, 1)" in line)
ALL_REDUCE_LINE = next(n for n, line in enumerate(SOURCE, 1) if "dist.all_reduce(total)" in line)
RANKS = 4
RUNS = {"stacks-sidecar": None, "stacks-own": ""}  # run id -> $RANKWATCH_NODE (None: the launcher's sidecar)
ANSWER_S = 10.0  # a request's answers are all stored within this
HANG_AFTER = ("--hang-after", "2", "--analyze-every", "0.5")  # the collector's: a stall of 2 s is a hang


@dataclass
class Found:
    """A run's hang finding, the stacks request the collector made for it, the merged stacks in its evidence,
    and how long after the finding was made they were there."""

    run_id: str
    finding: int
    requests: list[tuple[int, str, int | None]]  # (id, created_by, finding_id) of the run's stacks commands
    stacks: dict
    shown_s: float


@dataclass
class Asked:
    """A stacks request of a run, and how long its answers took to be all stored (as the query API reads them)."""

    run_id: str
    request: int
    ranks: list[int] | None
    answered_s: float


@pytest.fixture(scope="module")
def hung(tmp_path_factory) -> tuple[Path, list[Asked], dict[str, int], list[Found]]:
    """Both runs hung, the hang found and its stacks shown, each asked for every rank's stacks and then for
    ranks 1 and 2's, then let on to their end: the store, the requests, each job's exit status and the hangs."""
    directory = tmp_path_factory.mktemp("stacks")
    asked: list[Asked] = []
    found: list[Found] = []
    with job_collector(directory, *HANG_AFTER) as collector:
        api = ApiClient(collector.url, collector.token)
        jobs = {run_id: _start(collector, directory / run_id, run_id, node) for run_id, node in RUNS.items()}
        try:
            for run_id, job in jobs.items():
                marks = directory / run_id / "marks"
                wait_until(
                    lambda: len(list(marks.iterdir())) == RANKS or job.poll() is not None,
                    f"{run_id}: its ranks never all reached their places",
                    240,
                )
                assert job.poll() is None, (directory / run_id / "job.log").read_text()[-3000:]
            time.sleep(1.0)  # a rank's mark is written on the line before the call it then blocks in
            found = [_found_with_stacks(api, run_id) for run_id in jobs]
            for run_id in jobs:
                for ranks in (None, [1, 2]):
                    started = time.monotonic()
                    command = api.post("/v1/commands", {"run_id": run_id, "kind": "stacks", "args": {"ranks": ranks}})
                    expected = sorted(ranks or range(RANKS))
                    wait_until(
                        lambda: sorted(_answered(api, run_id, command["id"])) == expected,
                        f"{run_id}: the ranks asked by request {command['id']} did not all answer",
                        60,
                    )
                    asked.append(Asked(run_id, command["id"], ranks, time.monotonic() - started))
        finally:
            for run_id in jobs:
                _release(directory / run_id / "release")
            ended = {run_id: _ended(job) for run_id, job in jobs.items()}
    return collector.db, asked, ended, found


def _sql(api: ApiClient, sql: str, *params) -> list[list]:
    return api.post("/api/v1/query", {"sql": sql, "params": list(params)})["rows"]


def _found_with_stacks(api: ApiClient, run_id: str) -> Found:
    """The run's hang finding once its evidence shows the stacks of every rank (the collector asks for them when
    the hang fires), and how long after the finding was made that was."""
    shown: dict = {}

    def stacks_shown() -> bool:
        rows = _sql(
            api,
            "SELECT id, epoch_ms(created_at), epoch_ms(now()), evidence->'$.stacks' FROM findings "
            "WHERE run_id = ? AND analyzer = 'hangs' AND kind = 'hang' ORDER BY id LIMIT 1",
            run_id,
        )
        if rows and rows[0][3] is not None and json.loads(rows[0][3])["answered"] == RANKS:
            finding, made_ms, now_ms, merged = rows[0]
            shown.update(finding=finding, stacks=json.loads(merged), shown_s=(now_ms - made_ms) / 1e3)
        return bool(shown)

    wait_until(stacks_shown, f"{run_id}: no hang finding showed every rank's stacks", 90)
    requests = _sql(
        api, "SELECT id, created_by, finding_id FROM commands WHERE run_id = ? AND kind = 'stacks' ORDER BY id", run_id
    )
    return Found(run_id, shown["finding"], [tuple(r) for r in requests], shown["stacks"], shown["shown_s"])


def _start(collector, directory: Path, run_id: str, node: str | None) -> subprocess.Popen:
    (directory / "marks").mkdir(parents=True)
    os.mkfifo(directory / "release")
    with open(directory / "job.log", "w") as log:
        return subprocess.Popen(
            [
                *(sys.executable, "-m", "rankwatch", "run", "--collector", collector.url, "--run", run_id, "--"),
                *(TORCHRUN, "--standalone", "--nproc-per-node", str(RANKS)),
                *(str(JOB), str(directory / "release"), str(directory / "marks")),
            ],
            env={**os.environ, "RANKWATCH_TOKEN": collector.token}
            | ({"RANKWATCH_NODE": node} if node is not None else {}),
            stdout=log,
            stderr=subprocess.STDOUT,
        )


def _answered(api: ApiClient, run_id: str, request: int) -> list[int]:
    rows = api.post(
        "/api/v1/query",
        {
            "sql": f"SELECT rank FROM events WHERE run_id = ? AND event = ? "
            f"AND (attrs->>{sc.json_path(sc.STACKS_REQUEST)})::BIGINT = ?",
            "params": [run_id, sc.EVENT_RANK_STACKS, request],
        },
    )["rows"]
    return [rank for (rank,) in rows]


def _release(fifo: Path) -> None:
    """Let rank 2 on (where it holds the FIFO open: else it never got there, and nobody waits)."""
    try:
        writer = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:
        return
    os.write(writer, b"x")
    os.close(writer)


def _ended(job: subprocess.Popen) -> int:
    try:
        return job.wait(timeout=120)
    except subprocess.TimeoutExpired:
        job.terminate()
        return job.wait(timeout=60)


def answers(db: Path, asked: Asked) -> dict[int, dict]:
    """rank -> the body of its answer to `asked` (one each)."""
    rows = query(
        db,
        "SELECT rank, body, attrs FROM events WHERE run_id = ? AND event = ?",
        [asked.run_id, sc.EVENT_RANK_STACKS],
    )
    mine = [(rank, body) for rank, body, attrs in rows if json.loads(attrs)[sc.STACKS_REQUEST] == asked.request]
    assert len({rank for rank, _ in mine}) == len(mine), f"a rank answered request {asked.request} twice"
    return {rank: json.loads(body) for rank, body in mine}


def main_frames(answer: dict) -> list[dict]:
    (main,) = [t for t in answer["threads"] if t["main"]]
    assert answer["threads"][0] is main and main["name"] == "MainThread"
    return main["frames"]


def test_every_rank_asked_answers_once_with_the_request_within_seconds_and_the_job_goes_on(hung):
    db, asked, ended, _ = hung
    assert ended == dict.fromkeys(RUNS, 0), "a job did not end cleanly after its hang"
    assert len(asked) == 2 * len(RUNS)
    for request in asked:
        assert sorted(answers(db, request)) == sorted(request.ranks or range(RANKS)), request
        assert request.answered_s < ANSWER_S, request
        print(f"{request.run_id}: ranks {request.ranks or 'all'} answered in {request.answered_s:.2f} s")


def test_the_rank_blocked_in_its_loader_and_the_ranks_in_the_all_reduce_are_seen_at_their_lines(hung):
    db, asked, _, _ = hung
    for request in asked:
        for rank, answer in answers(db, request).items():
            frames = main_frames(answer)
            assert [list(f) for f in frames] == [["file", "line", "function", "code"]] * len(frames)
            mine = [f for f in frames if f["file"] == str(JOB)]
            assert mine and mine[0]["function"] == "<module>", frames  # outermost first
            if rank == 2:  # blocked in `os.read`, which has no Python frame: its line is the innermost
                assert frames[-1] == {
                    "file": str(JOB),
                    "line": LOADER_LINE,
                    "function": "__next__",
                    "code": "os.read(fifo, 1)",
                }
            else:  # inside the call: the script's innermost frame is at it, torch's (and the agent's) below it
                assert (mine[-1]["line"], mine[-1]["code"]) == (ALL_REDUCE_LINE, "dist.all_reduce(total)"), frames
                assert frames[-1]["file"] != str(JOB) and "torch/distributed" in frames[-1]["file"], frames[-1]


def test_no_thread_of_the_agent_is_in_an_answer(hung):
    db, asked, _, _ = hung
    for request in asked:
        for answer in answers(db, request).values():
            names = [t["name"] for t in answer["threads"]]
            assert not [n for n in names if n.startswith(stacks.AGENT_THREADS)], names


def test_the_flight_recorder_says_which_all_reduce_rank_2_never_entered(hung):
    """torch 2.13's gloo records each collective of a group (`collective_seq_id`), retired once completed; a
    send or receive is not recorded. The others' newest entry is the all-reduce they wait in, one past rank 2's."""
    db, asked, _, _ = hung
    for request in (a for a in asked if a.ranks is None):
        newest = {}
        for rank, answer in answers(db, request).items():
            recorded = answer["flight_recorder"]
            assert recorded["backend"] == "gloo" and recorded["pg_config"], recorded
            entries = recorded["entries"]
            assert entries and all(e["profiling_name"].startswith("gloo:") for e in entries), entries
            newest[rank] = entries[-1]
        for rank in (0, 1, 3):
            assert newest[rank]["profiling_name"] == "gloo:all_reduce" and not newest[rank]["retired"], newest[rank]
            assert newest[rank]["collective_seq_id"] == newest[2]["collective_seq_id"] + 1, newest
        assert newest[2]["retired"], newest[2]


def test_a_hang_found_shows_every_ranks_stacks_within_seconds_with_the_loader_line_as_the_odd_one_out(hung):
    """Nobody asks: the collector makes one stacks request for the hang finding when it fires, every rank answers,
    and the finding's evidence merges them: rank 2 at its loader's line, the odd group out, the others together at
    the all-reduce's line, within 10 s of the finding."""
    *_, found = hung
    for hang in found:
        _, by, finding = hang.requests[0]
        assert (by, finding) == ("analysis", hang.finding), hang.requests  # the collector's own, for this finding
        assert hang.shown_s < ANSWER_S, hang
        groups = hang.stacks["groups"]
        assert sorted(tuple(g["ranks"]) for g in groups) == [(0, 1, 3), (2,)], groups
        odd = groups[hang.stacks["odd"]]
        assert odd["ranks"] == [2] and odd["line"].startswith("rank 2: "), odd
        assert (odd["calls"][0]["file"], odd["calls"][0]["line"]) == (str(JOB), LOADER_LINE), odd
        (others,) = [g for g in groups if g["ranks"] == [0, 1, 3]]
        assert any(c["line"] == ALL_REDUCE_LINE for c in others["calls"]), others
        print(f"{hang.run_id}: the hang's stacks shown {hang.shown_s:.2f} s after the finding: {odd['line']}")


# --- the capture's bounds, in this process

# Threads that wait deep in recursion, every line of it longer than a frame's code keeps: loaded from a file of
# its own, so that its source lines are read as a job's are
DEEP = f"""
def deep(depth, gate):
    if depth:
        return deep(depth - 1, gate)  # {"x" * 300}
    gate.wait()
"""


def _waiting(thread: threading.Thread) -> bool:
    """Whether `thread` waits for the gate at the bottom of its recursion."""
    frame, names = sys._current_frames().get(thread.ident), []
    while frame is not None and len(names) < 3:
        names.append(frame.f_code.co_name)
        frame = frame.f_back
    return names == ["wait", "wait", "deep"]


def _others() -> int:
    """The threads with Python frames now (those a capture reads) that are not the agent's."""
    names = {t.ident: t.name for t in threading.enumerate()}
    return sum(not names.get(i, "").startswith(stacks.AGENT_THREADS) for i in sys._current_frames())


def test_a_capture_keeps_the_main_thread_first_and_cuts_threads_frames_lines_and_its_body_to_their_bounds(tmp_path):
    (tmp_path / "deep_threads.py").write_text(DEEP)
    spec = importlib.util.spec_from_file_location("deep_threads", tmp_path / "deep_threads.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    gate, workers, depth = threading.Event(), 40, stacks.MAX_FRAMES + 36
    threads = [
        threading.Thread(target=module.deep, args=(depth, gate), name=f"worker-{i:02}", daemon=True)
        for i in range(workers)
    ] + [threading.Thread(target=module.deep, args=(3, gate), name=f"rankwatch-{i}", daemon=True) for i in (1, 2)]
    for t in threads:
        t.start()
    try:
        wait_until(lambda: all(_waiting(t) for t in threads), "the threads never all waited")
        before = _others()
        started = time.perf_counter()
        captured = stacks.capture()
        took_s = time.perf_counter() - started
        after = _others()
    finally:
        gate.set()
    # 32 threads of 64 frames of 200-character lines are over 256 KiB: threads go, the main one first stays
    assert len(stacks.body(captured).encode()) <= stacks.BODY_BYTES
    kept = captured["threads"]
    # every thread counted, kept or left out (threads of the process's other work may come or go meanwhile)
    counted = len(kept) + captured["threads_left_out"]
    assert 1 < len(kept) < stacks.MAX_THREADS and min(before, after) <= counted <= max(before, after)
    assert kept[0]["main"] and kept[0]["frames"][-1]["function"] == "_threads"  # where the capture read it
    assert not [t for t in kept if t["name"].startswith(stacks.AGENT_THREADS)]
    for worker in (t for t in kept if t["name"].startswith("worker-")):
        frames = worker["frames"]
        assert len(frames) == stacks.MAX_FRAMES and worker["frames_left_out"] > depth - stacks.MAX_FRAMES
        assert [f["function"] for f in frames[-3:]] == ["deep", "wait", "wait"]  # the innermost: the event's wait
        assert frames[0]["function"] == "deep"  # the outermost (the thread's start, the first calls) are cut
        assert {len(f["code"]) for f in frames[:-3]} == {stacks.MAX_CODE}
    print(f"capture of {counted} threads ({len(kept)} kept, {stacks.MAX_FRAMES} frames each): {took_s * 1e3:.1f} ms")


FR = """
import json, os, sys, time
import torch, torch.distributed as dist
from rankwatch.agent import stacks
print(json.dumps(stacks.flight_recorder()), flush=True)
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
t = torch.ones(4)
for _ in range(300):
    dist.all_reduce(t)
started = time.perf_counter()
recorded, reason = stacks.flight_recorder()
took_s = time.perf_counter() - started
print(json.dumps([recorded, reason, took_s]))
"""


@pytest.mark.parametrize("ring", [None, "0"])
def test_the_flight_recorder_is_read_to_its_newest_entries_or_said_why_not(tmp_path, ring):
    """One gloo rank: before torch.distributed starts, none, and why; after 300 all-reduces, the newest
    MAX_ENTRIES (torch 2.13 keeps 2,000 by default); with the ring off (TORCH_FR_BUFFER_SIZE=0), none, and why."""
    env = {k: v for k, v in os.environ.items() if k != "TORCH_FR_BUFFER_SIZE"}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(FR)],
        env={**env, **({"TORCH_FR_BUFFER_SIZE": ring} if ring is not None else {})},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    before, after = map(json.loads, done.stdout.splitlines())
    assert before == [None, "torch.distributed is not initialized"]
    recorded, reason, took_s = after
    if ring == "0":
        assert recorded is None and "records nothing" in reason
        return
    assert reason is None and recorded["backend"] == "gloo" and recorded["version"]
    entries = recorded["entries"]
    assert len(entries) == stacks.MAX_ENTRIES
    assert [e["collective_seq_id"] for e in entries] == list(range(300 - stacks.MAX_ENTRIES + 1, 301))
    assert set(entries[-1]) >= {"profiling_name", "collective_seq_id", "p2p_seq_id", "is_p2p", "state", "retired"}
    print(f"Flight Recorder read (300 entries recorded): {took_s * 1e3:.1f} ms")
