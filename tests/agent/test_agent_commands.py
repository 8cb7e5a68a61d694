"""The agent's side of commands, against a real collector: rank 0 fetches a pending command in
the background, hands it out at a step boundary, marks it acked at that step, reports it applied;
a command is handed out once; a collector that is away loses nothing; a command queued while a
poll is held reaches the job at once. The looks are paced by time: never more than one step or
LOOK_S of training apart, and no more often than that needs, whatever the step time."""

import time

from hypothesis import given, settings
from hypothesis import strategies as st

from rankwatch.agent.commands import MAX_STEPS_APART, Commands, Looks, steps_apart
from tests.support import loopback
from tests.support.collectors import Collector, free_port

RUN = "run-agent-commands"


def create(collector, **args) -> dict:
    response = loopback.post(
        f"{collector.url}/v1/commands",
        json={"run_id": RUN, "kind": "rollback", "args": args},
        headers={"Authorization": f"Bearer {collector.token}"},
    )
    assert response.status_code == 201, response.text
    return response.json()


def first_command(commands: Commands, steps=range(0, 400, 1)) -> tuple[int, dict]:
    for step in steps:
        command = commands.at_step(step)
        if command:
            return step, command
        time.sleep(0.01 if len(steps) > 400 else 0.05)
    raise AssertionError("no command was handed out")


def test_rank_zero_takes_a_command_at_a_step_and_reports_it(collector):
    created = create(collector, before_step=7, skip_batches=3)
    commands = Commands(collector.url, collector.token, RUN, rank=0, poll_s=0.2, look_s=0)
    try:
        step, command = first_command(commands)
        assert command["id"] == created["id"] and command["args"] == {"before_step": 7, "skip_batches": 3}
        assert (command["state"], command["apply_step"]) == ("acked", step)
        assert all(commands.at_step(s) is None for s in range(step + 1, step + 20))  # handed out once
        applied = commands.report(command, "applied", result={"restored_step": 7, "resumed_ns": 123})
        assert applied["state"] == "applied" and applied["result"] == {"restored_step": 7, "resumed_ns": 123}
    finally:
        commands.close()


step_times = st.floats(1e-5, 10.0)
look_times = st.floats(0.01, 2.0)


@settings(max_examples=300, deadline=None)
@given(step_times, look_times)
def test_looks_are_at_most_a_step_or_the_interval_apart_and_no_closer(step_s, look_s):
    gap = steps_apart(step_s, look_s)
    assert 1 <= gap <= MAX_STEPS_APART
    assert gap * step_s <= max(step_s, look_s)  # a command waits at most one step or look_s
    assert gap == 1 or gap == MAX_STEPS_APART or (gap + 1) * step_s > look_s  # and no look comes sooner than that needs


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(step_times, st.integers(2, 30)), min_size=1, max_size=5), look_times)
def test_looks_follow_the_measured_step_time(stretches, look_s):
    """Stretches of steps of one time each: from the second look of a stretch on (the first measured
    it), looks are at most max(one step, look_s) apart, and one step more would pass look_s."""
    looks, now, until = Looks(look_s), 0.0, 1
    for step_s, count in stretches:
        seen = 0
        while seen < count:
            now += step_s
            until -= 1
            if until:
                continue
            until, seen = looks.gap(now), seen + 1
            if seen > 1:  # measured within this stretch (up to the rounding of `now`)
                assert until * step_s <= max(step_s, look_s) * (1 + 1e-9)
                assert until in (1, MAX_STEPS_APART) or (until + 1) * step_s > look_s * (1 - 1e-9)


def test_a_command_queued_while_the_poll_is_held_reaches_the_job_at_once(collector):
    """Polls 10 s apart, a look every step: the command created reaches the job in well under the
    poll interval, the held poll answering as soon as it is queued."""
    commands = Commands(collector.url, collector.token, RUN, rank=0, poll_s=10, look_s=0)
    try:
        assert commands.at_step(0) is None
        created = create(collector, before_step=1)
        started = time.monotonic()
        _step, command = first_command(commands, steps=range(1, 1000))
        assert command["id"] == created["id"] and time.monotonic() - started < 5
    finally:
        commands.close()


def test_commands_wait_for_a_collector_that_was_away(tmp_path):
    db, port = tmp_path / "away.duckdb", free_port()
    with open(tmp_path / "collector.log", "w") as log:
        first = Collector(db, port, "test-token-0123456", log=log).start()
        created = create(first, before_step=3)
        first.stop()
        commands = Commands(first.url, first.token, RUN, rank=0, poll_s=0.2, look_s=0)
        try:
            assert all(commands.at_step(s) is None for s in range(5))  # the collector is down: nothing, no error
            again = Collector(db, port, "test-token-0123456", log=log).start()
            try:
                _, command = first_command(commands)
                assert command["id"] == created["id"]
            finally:
                again.stop()
        finally:
            commands.close()


def test_other_ranks_do_not_poll(collector):
    create(collector, before_step=2)
    commands = Commands(collector.url, collector.token, RUN, rank=3, poll_s=0.1, look_s=0)
    time.sleep(0.5)
    assert commands.at_step(0) is None  # without a process group, rank 3 learns of nothing by itself
    commands.close()
