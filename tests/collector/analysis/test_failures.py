"""A rank's failure: the `failures` analyzer on small frames for each cause, and a failed job's `rank_failed`
events sent through the agent's exporter to a real collector, read back as the live finding, its alert's
labels, `rankwatch analyze`, `rankwatch runs` and the dashboard's Overview."""

import json
import time
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pytest
from opentelemetry._logs import SeverityNumber

from collector.analysis.analyzers import Frames, failures
from rankwatch.agent import semconv as sc
from rankwatch.agent.export import Exporter
from tests.support.collectors import free_port, job_collector
from tests.support.commands import rankwatch_in_process
from tests.support.dashboard_pages import open_page, reading, texts
from tests.support.engine_jobs import live_findings, send_steps
from tests.support.waits import wait_until
from tests.support.webhook_receiver import Receiver

S = 1_000_000_000  # ns
T0 = 1_800_000_000 * S
COLUMNS = ["rank", "ts", "step", "body", "cause", "exception", "message", "signal", "exit_code", "attempt", "last_step"]
HOSTS = {0: "node-a", 1: "node-a", 2: "node-b", 3: "node-b"}
STACK = (
    "Traceback (most recent call last):\n"
    '  File "train.py", line 80, in <module>\n    main()\n'
    '  File "train.py", line 61, in main\n    loss = model(batch)\n'
    '  File "model.py", line 12, in forward\n    raise ValueError("bad batch: 3 tokens")\n'
    "ValueError: bad batch: 3 tokens\n"
)


def steps(last: dict[int, int], t0: int = T0, first: int = 0) -> pd.DataFrame:
    """Rank-steps 1 s long from `first` to each rank's `last`, the first ending 1 s after `t0`."""
    rows = [
        ("r", rank, step, t0 + (step - first + 1) * S, 1.0)
        for rank, newest in last.items()
        for step in range(first, newest + 1)
    ]
    frame = pd.DataFrame(rows, columns=["run_id", "rank", "step", "end_ts", "duration_s"])
    return frame.sort_values(["step", "rank"], ignore_index=True)


def failed(rank: int, cause: str, at_s: float, step: int | None = 12, last_step: int | None = 11, **told) -> dict:
    """A `rank_failed` event as Frames.failures holds it, `at_s` after T0."""
    return {
        **dict.fromkeys(COLUMNS),
        "rank": rank,
        "ts": T0 + int(at_s * S),
        "step": step,
        "cause": cause,
        "last_step": last_step,
        "attempt": 0,
        "body": told.pop("body", f"rank {rank}: {cause}"),
        **told,
    }


def stopped(ranks, at_s: float, **told) -> list[dict]:
    return [failed(r, sc.CAUSE_TERMINATED, at_s + r / 1000, signal="SIGTERM", **told) for r in ranks]


def judge(events: list[dict], rank_steps: pd.DataFrame | None = None, samples: pd.DataFrame | None = None):
    """The analyzer's findings on a 4-rank run whose ranks stored steps 0-11 (unless `rank_steps`)."""
    rank_steps = steps(dict.fromkeys(range(4), 11)) if rank_steps is None else rank_steps
    last = int(rank_steps.groupby("rank")["step"].max().min())
    placement = pd.DataFrame({"rank": list(HOSTS), "host": list(HOSTS.values())})
    devices = samples if samples is not None else pd.DataFrame(columns=["rank", "ts", "metric", "value"])
    frames = Frames(
        "r",
        rank_steps,
        last + 1,
        last,
        placement,
        int(rank_steps["end_ts"].max()) + 60 * S,
        failures=pd.DataFrame(events, columns=COLUMNS),
        devices=lambda since, until: devices[devices["ts"].between(since, until)],
    )
    return failures.judge(frames)


def test_a_rank_killed_by_the_oom_killer_is_named_before_the_ranks_torchrun_stopped_after_it():
    """The sidecar tells of the killed rank after torchrun has stopped the others: the first to fail is still
    the killed rank, its host named, the others with the last step each stored, the host's memory said."""
    samples = pd.DataFrame(
        [(2, T0 + 11 * S, sc.SYSTEM_MEMORY_UTIL, 0.97), (1, T0 + 11 * S, sc.SYSTEM_MEMORY_UTIL, 0.5)],
        columns=["rank", "ts", "metric", "value"],
    )
    events = [*stopped((0, 1, 3), 12.2), failed(2, sc.CAUSE_KILLED_OUT_OF_MEMORY, 13.0, last_step=10)]
    (finding,) = judge(events, samples=samples)
    assert (finding.kind, finding.ranks, finding.severity, finding.step_start) == ("failure", [2], "critical", 12)
    assert finding.summary.startswith("rank 2 killed (out of memory?) in step 12 on host node-b at ")
    assert "; then ranks 0, 1, 3 were stopped (last step 11); attempt 0: no restart has followed" in finding.summary
    e = finding.evidence
    assert (e["rank"], e["step"], e["cause"], e["host"], e["attempt"]) == (2, 12, "killed_out_of_memory", "node-b", 0)
    assert e["followed_ranks"] == [0, 1, 3] and e["followed_by_cause"] == {"terminated": [0, 1, 3]}
    assert e["last_steps"] == {0: 11, 1: 11, 2: 10, 3: 11} and e["restarted"] is False
    assert e["failed_at_ns"] == T0 + 13 * S and e["in_short"] == "rank 2 killed (out of memory?)"
    assert e["memory"] == {"host_in_use_fraction": 0.97}
    assert "host memory up to 97% in use" in e["what_to_do"] and "check host node-b (`dmesg -T" in e["what_to_do"]


def test_out_of_memory_in_the_gpu_says_how_full_it_was_at_the_last_steps():
    samples = pd.DataFrame(
        [(1, T0 + t * S, metric, value) for t in (9, 10, 11) for metric, value in ((sc.FB_USED_MIB, 75_000 + t * 100),)]
        + [(1, T0 + 11 * S, sc.FB_TOTAL_MIB, 81_920), (1, T0 - 600 * S, sc.FB_USED_MIB, 81_000)],  # long before
        columns=["rank", "ts", "metric", "value"],
    )
    told = {
        "exception": "torch.OutOfMemoryError",
        "message": "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 1 has a total capacity of 80 GiB\nmore",
    }
    events = [failed(1, sc.CAUSE_OUT_OF_MEMORY, 12.5, body=STACK, **told), *stopped((0, 2, 3), 12.8)]
    (finding,) = judge(events, samples=samples)
    assert finding.summary.startswith(
        "rank 1 raised torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 1 has a total "
        "capacity of 80 GiB in step 12 on host node-a"
    )
    e = finding.evidence
    assert e["in_short"] == "rank 1 raised torch.OutOfMemoryError" and e["exception"] == "torch.OutOfMemoryError"
    assert e["memory"] == {"gpu_used_bytes": 76_100 * 2**20, "gpu_total_bytes": 81_920 * 2**20}
    assert e["what_to_do"].startswith("Its GPU memory at its last steps: up to 79.8 GB of 85.9 GB (93%) in use.")
    (finding,) = judge(events)  # no GPU sample stored
    assert finding.evidence["what_to_do"].startswith("No GPU memory samples were stored for it. Reduce the memory")
    assert "memory" not in finding.evidence


def test_an_exception_keeps_the_end_of_its_stack_and_quotes_its_last_lines():
    body = "".join(f'  File "deep.py", line {i}, in f{i}\n' for i in range(100)) + STACK
    told = {"exception": "builtins.ValueError", "message": "bad batch: 3 tokens"}
    (finding,) = judge([failed(3, sc.CAUSE_EXCEPTION, 12.5, body=body, **told), *stopped((0, 1, 2), 12.9)])
    assert finding.summary.startswith("rank 3 raised ValueError: bad batch: 3 tokens in step 12 on host node-b")
    stack = finding.evidence["stack"]
    assert len(stack.splitlines()) == failures.STACK_LINES and stack.endswith("ValueError: bad batch: 3 tokens")
    assert finding.evidence["what_to_do"].startswith(
        'Its stack ends:\n  File "model.py", line 12, in forward\n    raise ValueError("bad batch: 3 tokens")\n'
        "ValueError: bad batch: 3 tokens\nFix what raised it"
    )


def test_an_exit_says_its_code_and_a_kill_the_host_to_check():
    (finding,) = judge([failed(0, sc.CAUSE_EXIT, 12.5, exit_code=3), *stopped((1, 2, 3), 12.9)])
    assert finding.summary.startswith("rank 0 exited with code 3 in step 12 on host node-a")
    assert finding.evidence["exit_code"] == 3
    assert "exited with code 3 (sys.exit, os._exit)" in finding.evidence["what_to_do"]
    (finding,) = judge([failed(3, sc.CAUSE_KILLED, 12.5, step=None, last_step=11, signal="SIGKILL")])
    assert finding.summary.startswith("rank 3 killed by SIGKILL after step 11 on host node-b")  # no step told
    assert (finding.step_start, finding.evidence["step"], finding.evidence["followed_ranks"]) == (12, 12, [])
    assert finding.evidence["what_to_do"].startswith(
        "Rank 3 said nothing before it went (SIGKILL, a crash): check host"
    )
    (finding,) = judge([failed(1, sc.CAUSE_KILLED, 0.5, step=None, last_step=None), *stopped((0, 2, 3), 0.9, step=0)])
    assert finding.summary.startswith("rank 1 killed before any step it stored on host node-a")  # at its start
    assert (finding.ranks, finding.step_start, finding.evidence["step"]) == ([1], 0, None)


def test_the_ranks_that_followed_are_told_by_how_they_ended_and_the_last_step_each_stored():
    events = [
        failed(1, sc.CAUSE_OUT_OF_MEMORY, 12.5, exception="torch.OutOfMemoryError", message="CUDA out of memory"),
        failed(3, sc.CAUSE_OUT_OF_MEMORY, 12.6, exception="torch.OutOfMemoryError", message="CUDA out of memory"),
        *stopped((0,), 12.9),
        *stopped((2,), 12.9, last_step=10),
    ]
    (finding,) = judge(events)
    assert finding.ranks == [1]
    assert "; then ranks 0, 2 were stopped (last steps 11 (rank 0), 10 (rank 2)), rank 3 ran out of memory too " in (
        finding.summary
    )
    assert finding.evidence["followed_by_cause"] == {"out_of_memory": [3], "terminated": [0, 2]}


def test_a_large_jobs_evidence_lists_a_bounded_number_of_ranks_and_counts_them_all():
    ranks = 3000
    rank_steps = steps(dict.fromkeys(range(ranks), 1))
    events = [failed(7, sc.CAUSE_KILLED, 3.0, step=2, last_step=1)]
    events += [failed(r, sc.CAUSE_TERMINATED, 2.5, step=2, last_step=1) for r in range(ranks) if r != 7]
    (finding,) = judge(events, rank_steps)
    e = finding.evidence
    assert e["followed"] == ranks - 1 and len(e["followed_ranks"]) == len(e["last_steps"]) == failures.MAX_RANKS
    assert "; then ranks 0–6, 8–2999 were stopped (last step 1)" in finding.summary


def test_where_every_rank_was_stopped_the_earliest_is_named_and_nothing_inside_the_job_is_blamed():
    (finding,) = judge([*stopped((2, 3), 12.0), *stopped((0, 1), 12.3)])
    assert finding.ranks == [2] and finding.evidence["cause"] == "terminated"
    assert finding.summary.startswith("every rank stopped by SIGTERM, rank 2 first, in step 12 on host node-b")
    assert finding.evidence["in_short"] == "rank 2 stopped by SIGTERM"
    assert finding.evidence["what_to_do"].startswith("No rank failed first: something outside the job stopped it")


def test_ranks_that_were_only_stopped_wait_for_the_word_of_the_rank_gone_without_one():
    """Torchrun's stopped ranks tell at once; the killed rank's sidecar tells after them. Until it does (or
    GRACE_S passes: its host may have failed with it), no finding names a rank that was only stopped."""
    events = stopped((0, 1, 3), 12.2)
    rank_steps = steps(dict.fromkeys(range(4), 11))  # its last step ends 12 s after T0
    frames = Frames(
        "r",
        rank_steps,
        12,
        11,
        pd.DataFrame({"rank": list(HOSTS), "host": list(HOSTS.values())}),
        T0 + 13 * S,
        failures=pd.DataFrame(events, columns=COLUMNS),
    )
    assert failures.judge(frames) == []
    frames.failures = pd.DataFrame([*events, failed(2, sc.CAUSE_KILLED, 13.0)], columns=COLUMNS)
    (told,) = failures.judge(frames)
    assert told.ranks == [2] and told.evidence["cause"] == "killed"
    frames.failures, frames.now_ns = pd.DataFrame(events, columns=COLUMNS), T0 + int((12.3 + failures.GRACE_S) * S)
    (silent,) = failures.judge(frames)  # no word came: its host may be gone
    assert silent.ranks == [0] and silent.evidence["silent_ranks"] == [2]
    assert silent.summary.endswith("; rank 2 said nothing of how it ended; attempt 0: no restart has followed")


def test_a_failure_holds_until_a_restart_steps_past_it():
    """Attempt 0 fails at step 12; attempt 1 resumes from step 10 and trains on cleanly: the finding names
    attempt 0 and says a restart followed, and stops holding once the restart is past step 12."""
    events = [failed(1, sc.CAUSE_EXCEPTION, 12.5, exception="RuntimeError", message="x"), *stopped((0, 2, 3), 12.9)]
    (down,) = judge(events)
    assert failures.READS.holds(down.step_end, 11, redrawn=True) and down.evidence["restarted"] is False
    restart = steps(dict.fromkeys(range(4), 11)), steps(dict.fromkeys(range(4), 30), t0=T0 + 20 * S, first=10)
    (restarted,) = judge(events, pd.concat(restart).drop_duplicates(["rank", "step"], keep="last"))
    assert (restarted.ranks, restarted.step_start, restarted.evidence["attempt"]) == ([1], 12, 0)
    assert restarted.evidence["restarted"] is True and restarted.summary.endswith("; attempt 0: a restart followed")
    assert restarted.evidence["what_to_do"].endswith("A restart followed attempt 0.")
    assert not failures.READS.holds(restarted.step_end, 30, redrawn=True)


def test_each_attempt_that_failed_is_a_finding_of_its_own():
    attempt_1 = [
        failed(3, sc.CAUSE_KILLED, 40.0, step=25, last_step=24, attempt=1),
        *stopped((0, 1, 2), 39.0, attempt=1, step=25, last_step=24),
    ]
    events = [failed(1, sc.CAUSE_EXCEPTION, 12.5), *stopped((0, 2, 3), 12.9), *attempt_1]
    first, second = judge(events, steps(dict.fromkeys(range(4), 24)))
    assert (first.ranks, first.evidence["attempt"], first.evidence["restarted"]) == ([1], 0, True)
    assert (second.ranks, second.evidence["attempt"], second.evidence["restarted"]) == ([3], 1, False)
    assert second.summary.startswith("rank 3 killed in step 25")
    assert "; attempt 1: no restart has followed" in second.summary


def test_a_run_without_failures_has_no_finding():
    assert judge([]) == []


# A failed job and one restarted after its failure, through a real collector

RUN, RESTARTED = "job-failed", "job-restarted"
STEP_S = 0.1


@dataclass
class Stored:
    db: Path
    live: dict[str, list[dict]]  # the collector's findings of each run, as it drew them
    alerts: list[dict]  # the alerts it posted to a webhook receiver


def _exporters(collector, run: str) -> dict[int, Exporter]:
    """Each rank's exporter, its resource naming the run, the rank and its host."""
    return {
        r: Exporter(collector.url, collector.token, {sc.RUN_ID: run, sc.RANK: r, sc.WORLD_SIZE: 4, sc.HOST_NAME: h})
        for r, h in HOSTS.items()
    }


def _fail(sending: dict[int, Exporter], first: int, at_ns: int, told: dict, body: str, attempt: int = 0) -> None:
    """Rank `first` fails in step 12 at `at_ns` as `told`; torchrun stops the others 0.2 s before its word
    arrives (a sidecar tells of a killed rank once it has waited for the others)."""
    for rank, exporter in sending.items():
        attributes = {sc.STEP: 12, sc.ATTEMPT: attempt}
        if rank == first:
            exporter.event(sc.EVENT_RANK_FAILED, at_ns, {**attributes, **told}, body, SeverityNumber.ERROR)
        else:
            stop = {sc.FAILURE_CAUSE: sc.CAUSE_TERMINATED, sc.FAILURE_SIGNAL: "SIGTERM"}
            exporter.event(sc.EVENT_RANK_FAILED, at_ns - S // 5, {**attributes, **stop}, "stopped by SIGTERM")
    for exporter in sending.values():
        assert exporter.flush(), "events not delivered"


def _failure(collector, run: str, state: str) -> list[dict]:
    """The run's findings once its failure is in `state`, drawn from every rank's word."""
    found: list[dict] = []

    def drawn() -> bool:
        found[:] = live_findings(collector, run)
        return any(
            f["analyzer"] == failures.ANALYZER and f["state"] == state and len(_evidence(f)["followed_ranks"]) == 3
            for f in found
        )

    wait_until(drawn, f"no {state} failure finding for {run} with every rank's word", 60)
    return found


def _evidence(finding: dict) -> dict:
    """A finding's evidence as the query API gives it (JSON text)."""
    evidence = finding["evidence"]
    return json.loads(evidence) if isinstance(evidence, str) else evidence


@pytest.fixture(scope="module")
def stored(tmp_path_factory) -> Stored:
    """Two 4-rank jobs, both failing in step 12 after 12 steps: in the first, rank 2 is killed as the OOM killer
    kills (its host's memory nearly full); in the second, rank 1 raises, and the job is restarted from step 10
    and trains to its end. The collector's live findings and alerts are read as it runs; then it stops."""
    directory = tmp_path_factory.mktemp("failures")
    receiver = Receiver(free_port()).start()
    (directory / "alerts.toml").write_text(f'[[receivers]]\nname = "oncall"\nurl = "{receiver.url}"\n')
    live = {}
    try:
        with job_collector(directory, "--analyze-every", "0.5", "--alerts", str(directory / "alerts.toml")) as c:
            t0 = time.time_ns() - 8 * S  # the restart's last step ends a second before now
            failed_job, restarted_job = _exporters(c, RUN), _exporters(c, RESTARTED)
            for sending in (failed_job, restarted_job):
                send_steps(sending, range(12), t0, STEP_S)
            fail_ns = t0 + 2 * S  # 0.8 s after the last step ended
            failed_job[2].samples([(sc.SYSTEM_MEMORY_UTIL, fail_ns - S // 2, 0.97, {})])
            killed = {sc.FAILURE_CAUSE: sc.CAUSE_KILLED_OUT_OF_MEMORY}
            _fail(failed_job, 2, fail_ns, killed, "process 4242 killed: the kernel's OOM killer killed in this job")
            raised = {
                sc.FAILURE_CAUSE: sc.CAUSE_EXCEPTION,
                sc.FAILURE_EXCEPTION: "builtins.ValueError",
                sc.FAILURE_MESSAGE: "bad batch: 3 tokens",
            }
            _fail(restarted_job, 1, fail_ns, raised, STACK)
            live[RUN] = _failure(c, RUN, "firing")
            live[f"{RESTARTED} down"] = _failure(c, RESTARTED, "firing")
            restart = _exporters(c, RESTARTED)  # attempt 1: new processes, from the checkpoint of step 10
            send_steps(restart, range(10, 30), fail_ns + 2 * S, STEP_S)
            for exporter in restart.values():
                exporter.event(sc.EVENT_ENDED, fail_ns + 5 * S, {sc.STEP: 29})
                assert exporter.flush(), "events not delivered"
            live[RESTARTED] = _failure(c, RESTARTED, "resolved")
            receiver.wait_for(1)
            wait_until(lambda: _alert(receiver.deliveries, RUN) is not None, "no alert of the failed job", 30)
    finally:
        receiver.stop()
    alerts = [a for d in receiver.deliveries for a in d.body["alerts"]]
    return Stored(directory / "rankwatch.duckdb", live, alerts)


def _alert(deliveries, run: str) -> dict | None:
    return next((a for d in deliveries for a in d.body["alerts"] if a["labels"].get("run") == run), None)


def test_the_live_collector_names_the_rank_that_failed_first_its_step_cause_host_and_followers(stored):
    (finding,) = [f for f in stored.live[RUN] if f["analyzer"] == failures.ANALYZER]
    e = _evidence(finding)
    assert (finding["kind"], finding["ranks"], finding["severity"], finding["state"]) == (
        "failure",
        [2],
        "critical",
        "firing",
    )
    assert (finding["step_start"], e["step"], e["cause"], e["host"], e["attempt"]) == (
        12,
        12,
        "killed_out_of_memory",
        "node-b",
        0,
    )
    assert e["followed_ranks"] == [0, 1, 3] and e["last_steps"] == {"0": 11, "1": 11, "2": 11, "3": 11}
    assert e["memory"] == {"host_in_use_fraction": 0.97} and "check host node-b" in e["what_to_do"]


def test_a_restart_that_steps_past_the_failure_resolves_it_and_says_it_followed(stored):
    (down,) = [f for f in stored.live[f"{RESTARTED} down"] if f["analyzer"] == failures.ANALYZER]
    (up,) = [f for f in stored.live[RESTARTED] if f["analyzer"] == failures.ANALYZER]
    assert down["id"] == up["id"] and up["state"] == "resolved" and up["ranks"] == [1]
    evidence = _evidence(up)
    assert (evidence["attempt"], evidence["restarted"], evidence["exception"]) == (0, True, "builtins.ValueError")
    assert evidence["stack"] == STACK.rstrip()


def test_the_alert_carries_run_rank_host_and_cause(stored):
    (alert,) = [a for a in stored.alerts if a["labels"]["run"] == RUN]
    assert alert["status"] == "firing"
    assert alert["labels"] == {
        "alertname": "RankwatchRankFailed",
        "run": RUN,
        "analyzer": "failures",
        "kind": "failure",
        "severity": "critical",
        "ranks": "2",
        "rank": "2",
        "host": "node-b",
        "cause": "killed_out_of_memory",
    }
    assert alert["annotations"]["summary"].startswith("rank 2 killed (out of memory?) in step 12 on host node-b")


def test_analyze_leads_with_the_failure_in_json_and_text(stored):
    result = rankwatch_in_process("analyze", RUN, "--db", str(stored.db), "--json")
    assert result.returncode == 0, result.stderr
    first = json.loads(result.stdout)["findings"][0]
    assert (first["analyzer"], first["kind"], first["ranks"], first["step_start"]) == ("failures", "failure", [2], 12)
    e = first["evidence"]
    assert (e["cause"], e["host"], e["followed_ranks"]) == ("killed_out_of_memory", "node-b", [0, 1, 3])
    assert e["last_steps"] == {"0": 11, "1": 11, "2": 11, "3": 11}
    text = rankwatch_in_process("analyze", RESTARTED, "--db", str(stored.db), env={"COLUMNS": "250"})
    assert text.returncode == 0, text.stderr
    assert "rank 1 raised ValueError: bad batch: 3 tokens in step 12 on host node-a" in text.stdout
    assert "failures / failure, what to do: Its stack ends:\n" in text.stdout
    assert 'raise ValueError("bad batch: 3 tokens")\nValueError: bad batch: 3 tokens\nFix what raised it' in text.stdout


def test_runs_says_the_run_failed_at_its_step_and_how(stored):
    result = rankwatch_in_process("runs", "--db", str(stored.db), "--format", "json")
    assert result.returncode == 0, result.stderr
    runs = {r["run"]: r for r in json.loads(result.stdout)}
    assert runs[RUN]["status"] == "failed at step 12: rank 2 killed (out of memory?)"
    assert runs[RUN]["worst finding"].startswith("failures / failure: rank 2 killed (out of memory?) in step 12")
    assert runs[RESTARTED]["status"].startswith("ended ")  # restarted, it trained to its end
    assert runs[RESTARTED]["worst finding"].startswith("failures / failure: rank 1 raised ValueError")


def test_the_overview_says_first_that_the_run_failed_and_what_to_do(stored, monkeypatch):
    reading(monkeypatch, stored.db)
    at = open_page("overview", RUN)
    assert texts(at.main.markdown)[0].startswith("**Failed at step 12: rank 2 killed (out of memory?)** · ")
    verdict = texts(at.main.error)[0]
    assert verdict.startswith("**Failed.** Rank 2 killed (out of memory?) in step 12 on host node-b at ")
    assert "\n\n**What to do:** The kernel's OOM killer killed in the job's cgroup as rank 2 went" in verdict
    assert at.main.expander[0].label == "its evidence"
    at = open_page("overview", RESTARTED)  # restarted past it, trained to its end: what went wrong, not healthy
    assert texts(at.main.markdown)[0].startswith("**Ended ")
    (story,) = texts(at.main.warning)
    assert story.startswith("**What went wrong (resolved after step 12):** Rank 1 raised ValueError: bad batch")
    assert 'Its stack ends:  \n  File "model.py", line 12, in forward  \n    raise ValueError("bad batch' in story
