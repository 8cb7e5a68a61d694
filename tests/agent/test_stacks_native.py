"""A rank stuck in a C call that holds the GIL cannot answer a stacks request itself: its node's sidecar reads its
stacks from outside it with py-spy, and they are shown as any rank's.

Real parts: an unmodified 4-rank gloo script (tests/jobs/stacks_gil.py) under `rankwatch run`, through the node's
sidecar, against a real collector, and py-spy reading the real process. Ranks 0, 2 and 3 wait in the step's
all-reduce while rank 1 backtracks in a regex, in one call that never lets the GIL go; the test asks for every
rank's stacks (POST /v1/commands, kind "stacks"). Covered: every rank answers once; rank 1's answer is read by
py-spy, its main thread first with the script's innermost frame at the regex's line, native frames marked,
its main thread holding the GIL, no Flight Recorder and why; the others answer from their own agents at the
all-reduce's line; the merged stacks (GET /v1/runs/{run}/stacks) show rank 1 as the odd one out, read from
outside; and once let go (SIGUSR1 ends the regex), rank 1 goes on, its agent's own late answer to the request is
dropped (one answer a rank a request: it is the only one stored), and the job ends cleanly. And rank 0, read by
py-spy in the all-reduce (its native frames torch's C++), merges with the ranks there that answered themselves.
Skipped, saying why, where py-spy cannot read a process here (ptrace not permitted), as tried on a child process
first. Apart from the job: a reader refused ptrace by the kernel (CAP_SYS_PTRACE dropped) says why, marked as
the same for every rank.
"""

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from collector.analysis import stacks
from rankwatch.agent import pyspy
from rankwatch.agent import semconv as sc
from rankwatch.agent.apiclient import ApiClient
from tests.support.collectors import job_collector
from tests.support.otlp_payloads import query
from tests.support.paths import JOBS
from tests.support.waits import wait_until
from tests.support.zero_code import TORCHRUN

pytestmark = pytest.mark.long

JOB = JOBS / "stacks_gil.py"
SOURCE = JOB.read_text().splitlines()
REGEX_LINE = next(n for n, line in enumerate(SOURCE, 1) if "re.match(" in line)
ALL_REDUCE_LINE = next(n for n, line in enumerate(SOURCE, 1) if "dist.all_reduce(total)" in line)
RANKS, STUCK = 4, 1
RUN = "stacks-native"
ANSWER_S = 30.0  # every answer is stored within this of the request: the sidecar's 3 s wait and py-spy's read


@dataclass
class Stuck:
    """The run's store, its stacks request, the merged answers as the query API gave them while rank 1 was stuck,
    how long the answers took to be all stored, rank 0 read by py-spy as well (in the all-reduce, answering
    itself), and the job's exit status once rank 1 was let go."""

    db: Path
    request: int
    merged: dict
    answered_s: float
    in_all_reduce: dict | pyspy.Unread
    ended: int


def _unreadable_here() -> str | None:
    """Why py-spy cannot read a process here (missing, or ptrace refused), tried on a child of this process, as the
    sidecar reads its ranks (a process py-spy is no ancestor of); None where it can."""
    child = subprocess.Popen(
        [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"], stdout=subprocess.PIPE
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == b"up\n"
        read = pyspy.read([child.pid], timeout_s=60)[child.pid]
    finally:
        child.kill()
        child.wait()
    if isinstance(read, pyspy.Unread):
        assert read.lasting, f"py-spy failed on a plain Python process: {read.why}"
        return read.why
    return None


@pytest.fixture(scope="module")
def stuck(tmp_path_factory) -> Stuck:
    """The job with rank 1 stuck, asked for every rank's stacks, then rank 1 let go and the job run to its end."""
    if (why := _unreadable_here()) is not None:
        pytest.skip(f"py-spy cannot read a process here, as the sidecar would: {why}")
    directory = tmp_path_factory.mktemp("native")
    marks = directory / "marks"
    marks.mkdir()
    with job_collector(directory) as collector:
        api = ApiClient(collector.url, collector.token)
        with open(directory / "job.log", "w") as log:
            job = subprocess.Popen(
                [
                    *(sys.executable, "-m", "rankwatch", "run", "--collector", collector.url, "--run", RUN, "--"),
                    *(TORCHRUN, "--standalone", "--nproc-per-node", str(RANKS), str(JOB), str(marks)),
                ],
                env={**os.environ, "RANKWATCH_TOKEN": collector.token},
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        try:
            wait_until(
                lambda: len(_pids(marks)) == RANKS or job.poll() is not None,
                "the ranks never all reached their places",
                240,
            )
            assert job.poll() is None, (directory / "job.log").read_text()[-3000:]
            # rank 1 spins a core from its mark until let go: what follows reads the ranks at once, and rank 0 while
            # the answers come in, so that it spins no longer than the checks need
            pids = _pids(marks)
            lines = {pid: REGEX_LINE if rank == STUCK else ALL_REDUCE_LINE for rank, pid in pids.items()}
            # a mark is written on the line before the call: until each rank is in it
            wait_until(lambda: _at(lines), "the ranks never all reached their lines (rank 1 the regex's)", 120)
            started = time.monotonic()
            command = api.post("/v1/commands", {"run_id": RUN, "kind": "stacks", "args": {"ranks": None}})
            with ThreadPoolExecutor(1) as reader:
                reading = reader.submit(pyspy.read, [pids[0]])
                wait_until(lambda: len(_answered(api, command["id"])) == RANKS, "not every rank answered", 120)
                answered_s = time.monotonic() - started
                merged = api.get(f"/v1/runs/{RUN}/stacks", {"request": str(command["id"])})
                in_all_reduce = reading.result()[pids[0]]
            os.kill(pids[STUCK], signal.SIGUSR1)  # the regex raises: rank 1 goes on, and answers itself too
            ended = job.wait(timeout=120)
        finally:
            _stop(job, marks)
    return Stuck(collector.db, command["id"], merged, answered_s, in_all_reduce, ended)


def _at(lines: dict[int, int]) -> bool:
    """Whether each process of `lines` (pid -> a line of the job) is inside the call at its line, as py-spy reads
    them from outside, all at once."""
    reads = pyspy.read(list(lines))
    return all(_inside(reads[pid], line) for pid, line in lines.items())


def _inside(read: dict | pyspy.Unread, line: int) -> bool:
    """Whether a process read is inside the call at `line` of the job (its main thread's innermost line there, with
    frames below it)."""
    if isinstance(read, pyspy.Unread):
        return False
    frames = _main(read)["frames"]
    mine = [i for i, f in enumerate(frames) if f["file"] == str(JOB)]
    return bool(mine) and frames[mine[-1]]["line"] == line and mine[-1] < len(frames) - 1


def _pids(marks: Path) -> dict[int, int]:
    """rank -> its process, of the ranks at their places (each writes its pid into its mark)."""
    return {int(mark.name): int(pid) for mark in marks.iterdir() if (pid := mark.read_text())}


def _answered(api: ApiClient, request: int) -> list[int]:
    rows = api.post(
        "/api/v1/query",
        {
            "sql": f"SELECT rank FROM events WHERE run_id = ? AND event = ? "
            f"AND (attrs->>{sc.json_path(sc.STACKS_REQUEST)})::BIGINT = ?",
            "params": [RUN, sc.EVENT_RANK_STACKS, request],
        },
    )["rows"]
    return [rank for (rank,) in rows]


def _stop(job: subprocess.Popen, marks: Path) -> None:
    """The ranks killed by pid where any is left (each runs in a session of its own, out of reach of a signal to
    torchrun's group; one holding the GIL takes SIGKILL alone), then the launcher stopped."""
    for pid in _pids(marks).values():
        with contextlib.suppress(OSError):
            if JOB.name.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.kill(pid, signal.SIGKILL)
    if job.poll() is None:
        job.terminate()
        job.wait(timeout=60)


def _answers(stuck: Stuck) -> dict[int, list[dict]]:
    """rank -> the bodies of its answers to the request."""
    rows = query(
        stuck.db, "SELECT rank, body, attrs FROM events WHERE run_id = ? AND event = ?", [RUN, sc.EVENT_RANK_STACKS]
    )
    answers: dict[int, list[dict]] = {}
    for rank, body, attrs in rows:
        if json.loads(attrs)[sc.STACKS_REQUEST] == stuck.request:
            answers.setdefault(rank, []).append(json.loads(body))
    return answers


def _main(answer: dict) -> dict:
    (main,) = [t for t in answer["threads"] if t["main"]]
    assert answer["threads"][0] is main and main["name"] == "MainThread"
    return main


def test_every_rank_answers_once_and_the_job_goes_on_once_the_stuck_rank_is_let_go(stuck):
    """Rank 1's own agent answered too, once let go (its later steps came through its link, after the request it
    had not read): the sidecar dropped that answer, the second."""
    assert stuck.ended == 0, "the job did not end cleanly once rank 1 was let go"
    assert {rank: len(bodies) for rank, bodies in _answers(stuck).items()} == dict.fromkeys(range(RANKS), 1)
    steps = query(stuck.db, "SELECT rank, count(*) FROM steps WHERE run_id = ? GROUP BY rank ORDER BY rank", [RUN])
    assert steps == [(rank, 3) for rank in range(RANKS)], steps
    assert stuck.answered_s < ANSWER_S, stuck.answered_s
    print(f"every rank's answer stored {stuck.answered_s:.2f} s after the request (rank 1's read from outside)")


def test_the_stuck_rank_is_read_by_py_spy_at_the_regex_line_with_its_native_frames(stuck):
    (answer,) = _answers(stuck)[STUCK]
    assert answer["read_by"] == pyspy.READ_BY
    assert answer["flight_recorder"] is None and answer["flight_recorder_reason"] == pyspy.NO_FLIGHT_RECORDER
    main = _main(answer)
    assert main["owns_gil"] is True
    frames = main["frames"]
    mine = [f for f in frames if f["file"] == str(JOB)]
    assert mine and mine[0]["function"] == "<module>", frames  # outermost first
    assert mine[-1] == {
        "file": str(JOB),
        "line": REGEX_LINE,
        "function": "<module>",
        "code": 're.match(r"(a+)+$", "a" * 64 + "b")',
    }
    below = frames[frames.index(mine[-1]) + 1 :]  # the regex module's Python frame, then the engine's C frames
    assert below and below[0]["function"] == "match" and below[0]["file"].endswith("re/__init__.py"), below
    native = [f for f in below if f.get("native")]
    assert native and frames[-1] is native[-1], frames  # the innermost: inside the regex engine's C code
    assert all(f["code"] is None for f in native) and all(
        set(f) == {"file", "line", "function", "code", "native"} for f in native
    )


def test_the_ranks_in_the_all_reduce_answer_from_their_own_agents_at_its_line(stuck):
    for rank, (answer,) in _answers(stuck).items():
        if rank == STUCK:
            continue
        assert "read_by" not in answer and answer["flight_recorder"]["backend"] == "gloo", rank
        frames = _main(answer)["frames"]
        mine = [f for f in frames if f["file"] == str(JOB)]
        assert (mine[-1]["line"], mine[-1]["code"]) == (ALL_REDUCE_LINE, "dist.all_reduce(total)"), frames
        assert not [f for f in frames if "native" in f]


def test_the_merged_stacks_show_the_stuck_rank_as_the_odd_one_out_read_from_outside(stuck):
    """Its native frames (libpython's regex engine) fold into the call its line made, as library frames do."""
    merged = stuck.merged
    assert (merged["asked"], merged["answered"], merged["unanswered"]) == (RANKS, RANKS, [])
    groups = merged["groups"]
    assert sorted(tuple(g["ranks"]) for g in groups) == [(0, 2, 3), (STUCK,)], groups
    odd = groups[merged["odd"]]
    assert odd["ranks"] == [STUCK] and odd["read_by"] == {pyspy.READ_BY: [STUCK]}, odd
    assert odd["calls"][0] == {"calls": "match", "in": "<module>", "file": str(JOB), "line": REGEX_LINE}, odd
    assert odd["line"] == f"rank 1: `match` at {JOB.name}:{REGEX_LINE} (read from outside by py-spy)", odd
    (others,) = [g for g in groups if g["ranks"] == [0, 2, 3]]
    assert "read_by" not in others and others["calls"][0]["line"] == ALL_REDUCE_LINE, others
    print(f"merged: {odd['line']}; {others['line']}")


READ = """
import json, sys
from rankwatch.agent import pyspy
(read,) = pyspy.read([int(sys.argv[1])], timeout_s=60).values()
print(json.dumps(vars(read) if isinstance(read, pyspy.Unread) else "read"))
"""


def test_a_read_that_ptrace_refuses_says_why_marked_the_same_for_every_rank(tmp_path):
    """A reader without CAP_SYS_PTRACE (`setpriv` drops it), which a process holding capabilities the reader lacks
    takes to ptrace: py-spy is refused by the kernel, and the read says why, marked lasting (the same for every
    rank of the node: the sidecar says it once)."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv, to drop a reader's CAP_SYS_PTRACE")
    target = subprocess.Popen(
        [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"], stdout=subprocess.PIPE
    )
    try:
        assert target.stdout is not None and target.stdout.readline() == b"up\n"
        drop = ("setpriv", "--bounding-set=-sys_ptrace", "--inh-caps=-sys_ptrace")
        done = subprocess.run(
            [*drop, sys.executable, "-c", READ, str(target.pid)], capture_output=True, text=True, timeout=120
        )
    finally:
        target.kill()
        target.wait()
    if done.returncode != 0 and "setpriv" in done.stderr:
        pytest.skip(f"setpriv cannot drop CAP_SYS_PTRACE here: {done.stderr.strip()[:200]}")
    assert done.returncode == 0, done.stderr[-3000:]
    read = json.loads(done.stdout)
    assert read["lasting"] is True and "ermission denied" in read["why"], read
    print(f"refused: {read['why']}")


def test_a_rank_in_the_all_reduce_read_by_py_spy_stands_with_those_that_answered_there_themselves(stuck):
    """Rank 0 read from outside as it waits in the all-reduce: below the script's line, torch's Python frames and
    the native ones of its C++ (c10d's `Work::wait`, in libtorch; gloo's own threads, which run the all-reduce,
    are no Python threads), which fold into the call the line made, as library frames do, so that it is merged
    with the ranks whose own agents answered from there."""
    body = stuck.in_all_reduce
    assert isinstance(body, dict), body
    frames = _main(body)["frames"]
    native = [f["function"] for f in frames if f.get("native")]
    assert "c10d::Work::wait" in native, native
    (own,) = [answers[0] for rank, answers in _answers(stuck).items() if rank == 2]
    merged = stacks.merge(
        stacks.Answers(0, "pending", 0, [0, 2], [([0], frames, pyspy.READ_BY), ([2], _main(own)["frames"], None)])
    )
    assert len(merged["groups"]) == 1, merged["groups"]
    (group,) = merged["groups"]
    assert group["ranks"] == [0, 2] and group["read_by"] == {pyspy.READ_BY: [0]}, group
    assert group["line"] == (
        f"ranks 0,2: `all_reduce` at {JOB.name}:{ALL_REDUCE_LINE} (rank 0 read from outside by py-spy)"
    ), group
    print(f"rank 0 by py-spy: {len(frames)} frames, {len(native)} native, innermost {native[-3:]}")
