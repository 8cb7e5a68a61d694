"""Saying what happened and where things are: lost telemetry is a failure, not "sent"; train and
simulate name the run and its dashboard link before they start; checkpoints go beside the store;
a held store names the collector to stop, not its writer process."""

from tests.support.collectors import free_port
from tests.support.commands import rankwatch_cli, rankwatch_in_process


def test_simulate_to_an_unreachable_collector_fails(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    result = rankwatch_in_process("simulate", "--ranks", "4", "--steps", "5", "--run", "lost", "--collector", url)
    assert result.returncode == 3, result.stdout
    assert "sent to" not in result.stdout
    assert "rankwatch simulate: error: run lost: 20 rank-steps (40 spans), " in result.stderr
    assert f"never reached {url}" in result.stderr
    assert result.stdout.splitlines()[0] == (  # no dashboard serves: how to start one, not an address nobody serves
        f"rankwatch simulate: run lost, telemetry to {url}; to watch it, start a dashboard: "
        f"rankwatch dashboard --collector {url}"
    )


def test_simulate_names_the_run_and_its_dashboard_link_first(module_collector):
    result = rankwatch_in_process(
        "simulate",
        "--ranks",
        "4",
        "--steps",
        "3",
        "--run",
        "a b",
        "--collector",
        module_collector.url,
        env={"RANKWATCH_TOKEN": module_collector.token},
    )
    assert result.returncode == 0, result.stderr
    first, *_, last = result.stdout.splitlines()
    assert first == (  # the link, its run id quoted, where a dashboard serves: tests/cli/test_cli.py
        f"rankwatch simulate: run a b, telemetry to {module_collector.url}; to watch it, start a dashboard: "
        f"rankwatch dashboard --collector {module_collector.url}"
    )
    assert last == (
        f"rankwatch simulate: run a b, 12 rank-steps (24 spans: steps and their collectives) of 4 ranks sent to "
        f"{module_collector.url}"
    )


def test_train_with_lost_telemetry_fails_and_keeps_checkpoints_beside_the_store(tmp_path):
    work, store = tmp_path / "work", tmp_path / "data" / "rw.duckdb"
    work.mkdir()
    url = f"http://127.0.0.1:{free_port()}"
    result = rankwatch_cli(
        "train",
        "--nproc",
        "1",
        "--steps",
        "10",
        "--ckpt-every",
        "10",  # the checkpoint of step 10 written to disk
        "--run",
        "lost-train",
        "--collector",
        url,
        "--db",
        str(store),
        cwd=work,
    )
    assert result.returncode == 3, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    assert lines[0] == (
        f"rankwatch train: run lost-train, telemetry to {url}; to watch it, start a dashboard: "
        f"rankwatch dashboard --collector {url} --db {store}"
    )
    checkpoints = store.parent / "runs" / "lost-train" / "checkpoints"
    assert lines[1] == f"rankwatch train: checkpoints in {checkpoints}"
    assert "rankwatch train: error: run lost-train: 10 rank-steps (" in result.stderr
    assert f"never reached {url}" in result.stderr
    assert list(work.iterdir()) == []  # nothing in the working directory
    assert (checkpoints / "rank-0").is_dir()


def test_a_held_store_names_the_collector_to_stop(module_collector):
    result = rankwatch_in_process("analyze", "r", "--db", str(module_collector.db))
    assert result.returncode == 2
    assert f"held open by a running collector (pid {module_collector.process.pid}); stop it first" in result.stderr
