"""The agent's side of commands, against a real collector: rank 0 fetches a pending command in
the background, hands it out at a step boundary, marks it acked at that step, reports it applied;
a command is handed out once; a collector that is away loses nothing."""

import time

import httpx

from agent.commands import Commands
from tests.conftest import Collector, free_port

RUN = "run-agent-commands"


def create(collector, **args) -> dict:
    response = httpx.post(f"{collector.url}/v1/commands", json={"run_id": RUN, "kind": "rollback", "args": args},
                          headers={"Authorization": f"Bearer {collector.token}"})
    assert response.status_code == 201, response.text
    return response.json()


def first_command(commands: Commands, steps=range(0, 400, 1)) -> tuple[int, dict]:
    for step in steps:
        command = commands.at_step(step)
        if command:
            return step, command
        time.sleep(0.05)
    raise AssertionError("no command was handed out")


def test_rank_zero_takes_a_command_at_a_step_and_reports_it(collector):
    created = create(collector, before_step=7, skip_batches=3)
    commands = Commands(collector.url, collector.token, RUN, rank=0, poll_s=0.2, every=1)
    try:
        step, command = first_command(commands)
        assert command["id"] == created["id"] and command["args"] == {"before_step": 7, "skip_batches": 3}
        assert (command["state"], command["apply_step"]) == ("acked", step)
        assert all(commands.at_step(s) is None for s in range(step + 1, step + 20))  # handed out once
        applied = commands.report(command, "applied", result={"restored_step": 7, "resumed_ns": 123})
        assert applied["state"] == "applied" and applied["result"] == {"restored_step": 7, "resumed_ns": 123}
    finally:
        commands.close()


def test_looks_only_every_few_steps(collector):
    create(collector, before_step=1)
    commands = Commands(collector.url, collector.token, RUN, rank=0, poll_s=0.2, every=5)
    try:
        step, _ = first_command(commands)
        assert step % 5 == 0
    finally:
        commands.close()


def test_commands_wait_for_a_collector_that_was_away(tmp_path):
    db, port = tmp_path / "away.duckdb", free_port()
    with open(tmp_path / "collector.log", "w") as log:
        first = Collector(db, port, "test-token", log=log).start()
        created = create(first, before_step=3)
        first.stop()
        commands = Commands(first.url, first.token, RUN, rank=0, poll_s=0.2, every=1)
        try:
            assert all(commands.at_step(s) is None for s in range(5))  # the collector is down: nothing, no error
            again = Collector(db, port, "test-token", log=log).start()
            try:
                _, command = first_command(commands)
                assert command["id"] == created["id"]
            finally:
                again.stop()
        finally:
            commands.close()


def test_other_ranks_do_not_poll(collector):
    create(collector, before_step=2)
    commands = Commands(collector.url, collector.token, RUN, rank=3, poll_s=0.1, every=1)
    time.sleep(0.5)
    assert commands.at_step(0) is None  # without a process group, rank 3 learns of nothing by itself
    commands.close()
