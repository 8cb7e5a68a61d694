"""Bad input as a new user types it: one line on stderr, exit 2, checked before anything starts.

The whole class: every numeric option of every subcommand (found from the parser itself, so a
new option is covered the day it is added) refuses what is not a number, NaN, infinity and
negatives; counts refuse zero; faults that name a rank, stage, node or step the job does not have,
or a slowdown below 1, are refused before torchrun or the simulator starts; an unknown model; a
dashboard port in use; and a reader that closes the pipe early gets silence, not a traceback.
"""

import argparse
import socket
import subprocess
import sys

import duckdb
import pytest

from rankwatch import cli
from rankwatch.cli.options import UsageError, output_file
from rankwatch.cli.simulation import fits_in_memory
from tests.support.collectors import free_port
from tests.support.commands import rankwatch_cli


def numeric_options() -> list[tuple[tuple[str, ...], str]]:
    """(subcommand path, option) for every option of every subcommand that takes a number."""
    found = []

    def walk(parser: argparse.ArgumentParser, path: tuple[str, ...]) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, (*path, name))
            elif (
                action.option_strings
                and action.type not in (None, str)
                and not isinstance(action.type, type)
                and getattr(action.type, "__qualname__", "").startswith(("_whole", "_quantity"))
            ):
                found.append((path, action.option_strings[0]))

    walk(cli.build_parser(), ())
    return found


NUMERIC = numeric_options()
REQUIRED = {
    ("simulate",): ["--ranks", "4", "--steps", "4", "--out", "x.parquet"],
    ("power", "apply"): ["r"],
    ("power", "recommend"): ["r"],
    ("stacks",): ["r"],
}


def refused(argv: list[str], capsys) -> str:
    """The one line `rankwatch ARGV` prints, in this process (argparse and the checks run before any
    command does its work), after asserting exit status 2."""
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 2, err
    assert err.count("\n") == 1 and "error:" in err and "Traceback" not in err, err
    return err


def test_every_numeric_option_is_found():
    options = {(path, option) for path, option in NUMERIC}
    assert {
        (("train",), "--nproc"),
        (("train",), "--steps"),
        (("simulate",), "--ranks"),
        (("simulate",), "--steps"),
        (("collector",), "--port"),
        (("dashboard",), "--port"),
        (("power", "apply"), "--watts"),
        (("collector",), "--hang-after"),
    } <= options
    assert len(options) >= 20


@pytest.mark.parametrize("path, option", NUMERIC, ids=[" ".join((*p, o)) for p, o in NUMERIC])
@pytest.mark.parametrize("value", ["abc", "nan", "inf", "-1", "1e999", ""])
def test_numeric_options_refuse_non_numbers_and_negatives(path, option, value, capsys):
    err = refused([*path, *REQUIRED.get(path, []), f"{option}={value}"], capsys)
    assert option in err


@pytest.mark.parametrize(
    "argv",
    [
        ["train", "--nproc", "0"],
        ["train", "--steps", "0"],
        ["simulate", "--ranks", "0", "--steps", "3"],
        ["simulate", "--ranks", "4", "--steps", "0"],
        ["simulate", "--ranks", "4", "--steps", "3", "--pp", "0"],
        ["simulate", "--ranks", "4", "--steps", "3", "--dp", "0"],
        ["simulate", "--ranks", "4", "--steps", "3", "--tp", "0"],
        ["demo", "--steps", "0"],
        ["demo", "--steps", "49"],  # too few to show the straggler and the spike
        ["collector", "--port", "0"],
        ["collector", "--port", "65536"],
        ["collector", "--analyze-every", "0"],
        ["collector", "--hang-after", "0"],
        ["collector", "--max-queue-bytes", "0"],
        ["dashboard", "--port", "70000"],
        ["power", "recommend", "r", "--facility-watts", "0"],
        ["power", "apply", "r", "--watts", "0"],
        ["demo", "--dashboard-port", "0"],
    ],
)
def test_counts_and_ports_refuse_zero_and_out_of_range(argv, capsys):
    refused(argv, capsys)


FAULTS = [
    ("straggler:rank=1,slowdown=0.8", "slowdown must be at least 1"),
    ("straggler:rank=4,slowdown=1.3", "rank=4 is not in the job, whose ranks are 0..3"),
    ("straggler:rank=-1,slowdown=1.3", "rank must be at least 0"),
    ("slow-link:rank=1,factor=0.5", "factor must be at least 1"),
    ("spike:at=99,scale=4", "at=99 is not in the job, whose steps are 0..9"),
    ("spike:at=3,scale=0", "scale must be more than 0"),
    ("straggler:rank=1,slowdown=1.3,from=5,to=2", "to must come after from"),
    ("straggler:rank=1,slowdown=inf", "slowdown must be at least 1"),
]


@pytest.mark.parametrize("spec, message", FAULTS)
def test_train_refuses_faults_the_job_cannot_have(spec, message, capsys):
    assert message in refused(["train", "--nproc", "4", "--steps", "10", "--inject", spec], capsys)


@pytest.mark.parametrize(
    "spec, message",
    [
        *FAULTS,
        ("hang:rank=1,at=99", "at=99 is not in the job, whose steps are 0..9"),
        ("crash:rank=1,at=3", "crash is for `rankwatch train`"),
        ("slow-stage:stage=2,slowdown=1.2", "stage=2 is not in the job, whose stages are 0..1"),
        ("slow-node:node=1,slowdown=1.2", "node=1 is not in the job, whose nodes are 0..0"),
        ("data-skew:cv=-0.1", "cv must be at least 0"),
        ("power-cap:watts=0", "watts must be more than 0"),
    ],
)
def test_simulate_refuses_faults_the_job_cannot_have(spec, message, capsys, tmp_path):
    out = tmp_path / "t.parquet"
    assert message in refused(
        ["simulate", "--ranks", "4", "--pp", "2", "--steps", "10", "--out", str(out), "--inject", spec], capsys
    )
    assert not out.exists()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--offload", "optimizer=gpu"], "--offload 'optimizer=gpu': expected optimizer=host or optimizer=disk"),
        (["--offload", "optimizer=disk", "--offload-schedule", "later"], "--offload-schedule 'later': expected serial"),
        (["--inject", "slow-disk:rank=0,mbps=20"], "a slow disk slows the swaps of --offload optimizer=disk"),
        (
            ["--offload", "optimizer=host", "--inject", "slow-disk:rank=0,mbps=20"],
            "a slow disk slows the swaps of --offload optimizer=disk",
        ),
        (["--offload", "optimizer=disk", "--inject", "slow-disk:rank=0,mbps=0"], "mbps must be more than 0"),
        (["--tp", "2", "--offload", "optimizer=host"], "--offload steps a DDP job's optimizer on the host"),
    ],
)
def test_train_refuses_an_offload_it_cannot_run(argv, message, capsys):
    assert message in refused(["train", "--nproc", "2", "--steps", "10", *argv], capsys)


def test_unknown_model_is_refused_before_torchrun():
    result = rankwatch_cli("train", "--model", "gpt5", "--steps", "2")
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert "unknown --model 'gpt5'; models: tiny, small, gpt2, 1b" in result.stderr
    assert result.stdout == ""  # nothing was started


def test_a_checkpoint_interval_that_is_no_snapshot_is_refused_before_torchrun():
    result = rankwatch_cli("train", "--ckpt-every", "25", "--steps", "2")
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert "--ckpt-every 25 is not a multiple of 10: the job writes to disk one of its snapshots" in result.stderr
    assert result.stdout == ""  # nothing was started


LAUNCHER_WITHOUT_TORCH = """
import sys
sys.modules["torch"] = None  # any import of torch now raises ImportError
from rankwatch import cli
cli.main(sys.argv[1:])
"""


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "gpt5"], "unknown --model 'gpt5'"),
        (["--ckpt-every", "25"], "--ckpt-every 25 is not a multiple of 10"),
        (["--offload", "optimizer=gpu"], "expected optimizer=host or optimizer=disk"),
        (["--tp", "2", "--offload", "optimizer=host"], "--offload steps a DDP job's optimizer on the host"),
        (["--inject", "slow-link:rank=1,factor=2,group=tp"], "a DDP job slows its gradient all-reduces"),
    ],
)
def test_the_launcher_checks_a_jobs_arguments_without_loading_torch(argv, message):
    """Every check `rankwatch train` makes of the job it is asked for runs on torch-free modules
    (trainer/job.py): only torchrun and the ranks load torch, two seconds of CPU each."""
    result = subprocess.run(
        [sys.executable, "-c", LAUNCHER_WITHOUT_TORCH, "train", "--nproc", "2", "--steps", "10", *argv],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert message in result.stderr


@pytest.mark.parametrize("run", ["/abs", "../../elsewhere", "..", "a/b", ""])
def test_train_refuses_a_run_id_that_would_put_its_checkpoints_outside_the_store(run, tmp_path, capsys):
    run = run.replace("/abs", str(tmp_path / "elsewhere"))
    store = tmp_path / "data" / "s.duckdb"
    err = refused(["train", "--run", run, "--db", str(store), "--steps", "2"], capsys)
    assert f"run id {run!r} cannot name a directory of {store.parent / 'runs'}" in err
    assert list(tmp_path.iterdir()) == []  # refused before anything started


def test_dashboard_port_in_use(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = rankwatch_cli("dashboard", "--port", str(port), "--db", str(tmp_path / "none.duckdb"))
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert f"cannot serve the dashboard on 127.0.0.1:{port}" in result.stderr and "--port PORT" in result.stderr


def test_a_reader_that_stops_early_gets_silence(tmp_path):
    """`rankwatch query ... | head -1`: the pipe closes while rows are still being written."""
    db = tmp_path / "s.duckdb"
    duckdb.connect(str(db)).close()
    writer = subprocess.Popen(
        [sys.executable, "-m", "rankwatch", "query", "SELECT * FROM range(200000)", "--format", "csv", "--db", str(db)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    writer.stdout.readline()
    writer.stdout.close()  # as `head -1` does once it has its line
    stderr = writer.stderr.read().decode()
    assert stderr == ""
    assert writer.wait(timeout=120) in (0, 1)  # 1 where the pipe broke under a write


def options_of(kind: str) -> set[tuple[str, ...]]:
    """The subcommands (as paths) with an option named `kind`, found from the parser itself."""
    found = set()

    def walk(parser: argparse.ArgumentParser, path: tuple[str, ...]) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, (*path, name))
            elif kind in action.option_strings:
                found.add(path)

    walk(cli.build_parser(), ())
    return found


def store_commands(tmp_path) -> dict[tuple[str, ...], list[str]]:
    """A command line of each subcommand that reads or makes a store, up to where its --db is checked."""
    trace = tmp_path / "ops.csv"
    trace.write_text("rank,step\n")
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    return {
        ("query",): ["query", "SELECT 1"],
        ("analyze",): ["analyze", "r"],
        ("power", "recommend"): ["power", "recommend", "r"],
        ("model", "fit"): ["model", "fit", "--run", "r", "--out", str(tmp_path / "model.npz")],
        ("import",): ["import", "ops", str(trace), "--run", "r"],
        ("collector",): ["collector", "--port", str(free_port())],
        ("demo",): ["demo", "--port", str(free_port()), "--no-dashboard"],
        ("dashboard",): ["dashboard", "--port", str(free_port())],
        ("alerts", "test"): ["alerts", "test"],
        ("token",): ["token", "--scope", "ingest"],
        ("runs",): ["runs"],
        ("nodes",): ["nodes", "r"],
        ("run",): ["run", "--collector", url, "--", "true"],
        ("train",): ["train", "--collector", url],
        ("simulate",): ["simulate", "--ranks", "2", "--steps", "2", "--collector", url],
    }


def bad_stores(tmp_path) -> list[tuple[str, str]]:
    """(path, what the one line says) of stores no command can use."""
    text = tmp_path / "README.md"
    text.write_text("# not a store\n" * 20)
    noise = tmp_path / "noise.duckdb"
    noise.write_bytes(bytes(range(256)))
    return [
        (str(text), "is not a rankwatch store"),
        (str(noise), "is not a rankwatch store"),
        (str(tmp_path), "is a directory"),
        (str(text / "rankwatch.duckdb"), "Not a directory"),
    ]


def test_every_store_option_refuses_what_is_no_store(tmp_path, capsys):
    """Every --db goes through one check: a text file, random bytes, a directory or a path through a
    file are one line and exit 2 for every subcommand (a DuckDB traceback before); nothing is written."""
    commands = store_commands(tmp_path)
    assert set(commands) == options_of("--db")  # a new command with --db must be listed here
    for store, message in bad_stores(tmp_path):
        for argv in commands.values():
            options = argv.index("--") if "--" in argv else len(argv)  # (run's job command comes after --)
            err = refused([*argv[:options], "--db", store, *argv[options:]], capsys)
            assert message in err and store in err, (argv, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["README.md", "noise.duckdb", "ops.csv"]


def test_reading_commands_refuse_a_missing_store(tmp_path, capsys):
    missing = tmp_path / "none" / "rankwatch.duckdb"
    model = ["model", "fit", "--run", "r", "--out", str(tmp_path / "model.npz")]
    for argv in (["query", "SELECT 1"], ["analyze", "r"], ["power", "recommend", "r"], model):
        assert f"no store at {missing}" in refused([*argv, "--db", str(missing)], capsys)
    assert not missing.parent.exists()


def test_every_output_file_is_checked_before_any_work(tmp_path, capsys):
    """--heatmap, --plot and --out (whichever options write a file, found from the parser): a missing
    directory or a directory in the file's place is one line, exit 2, before the store is even read."""
    writers = {
        ("analyze",): (["analyze", "r", "--db", str(tmp_path / "none.duckdb")], "--heatmap"),
        ("power", "recommend"): (["power", "recommend", "r", "--db", str(tmp_path / "none.duckdb")], "--plot"),
        ("simulate",): (["simulate", "--ranks", "2", "--steps", "2"], "--out"),
        ("model", "fit"): (["model", "fit", "--run", "r", "--db", str(tmp_path / "none.duckdb")], "--out"),
    }
    found = set()

    def walk(parser: argparse.ArgumentParser, path: tuple[str, ...]) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, (*path, name))
            elif action.type is output_file:
                found.add((path, action.option_strings[0]))

    walk(cli.build_parser(), ())
    assert found == {(path, option) for path, (_, option) in writers.items()}
    for argv, option in writers.values():
        for target, message in (
            (tmp_path / "missing" / "dir" / "x.png", f"there is no directory {tmp_path / 'missing' / 'dir'}"),
            (tmp_path, "is a directory"),
            (tmp_path / "file" / "x.png", "there is no directory"),
        ):
            (tmp_path / "file").write_text("")
            err = refused([*argv, option, str(target)], capsys)
            assert f"argument {option}" in err and message in err, err
    assert not (tmp_path / "missing").exists()


BAD_URLS = [
    ("127.0.0.1:4318", "is not a collector URL such as http://127.0.0.1:4318"),
    ("localhost", "is not a collector URL"),
    ("ftp://127.0.0.1:4318", "is not a collector URL"),
    ("http://", "is not a collector URL"),
    ("http://127.0.0.1:99999", "is not a collector URL"),
    ("http://127.0.0.1:port", "is not a collector URL"),
    ("http://127.0.0.1:4318/?run=x", "has no ?query"),
]


@pytest.mark.parametrize("url, message", BAD_URLS)
def test_every_collector_url_goes_through_one_parser(url, message, tmp_path, capsys):
    """Every command that takes --collector (found from the parser), and $RANKWATCH_COLLECTOR where it
    stands in: a URL that is no http(s) address is one line, exit 2, not a URLError from a client."""
    commands = {
        ("query",): ["query", "SELECT 1"],
        ("power", "apply"): ["power", "apply", "r", "--watts", "300"],
        ("stacks",): ["stacks", "r"],
        ("dashboard",): ["dashboard", "--port", str(free_port())],
        ("train",): ["train"],
        ("run",): ["run"],  # (its job's command would follow --collector, after --)
        ("node",): ["node", "--socket", str(tmp_path / "node.sock")],
        ("runs",): ["runs"],
        ("nodes",): ["nodes", "r"],
        ("simulate",): ["simulate", "--ranks", "2", "--steps", "2"],
    }
    assert set(commands) == options_of("--collector")
    for argv in commands.values():
        assert message in refused([*argv, "--collector", url], capsys)
    for argv in (commands[("power", "apply")], commands[("train",)]):  # the environment's default
        with pytest.MonkeyPatch.context() as env:
            env.setenv("RANKWATCH_COLLECTOR", url)
            assert "$RANKWATCH_COLLECTOR" in refused(argv, capsys)


@pytest.mark.parametrize("available_gib", [1, 16, 1024])
def test_simulate_refuses_a_fleet_larger_than_memory_holds(available_gib, monkeypatch, capsys, tmp_path):
    """The bound comes from the memory available here and what a rank costs: just past it, one line
    saying the largest fleet that fits, at once; just under it, the simulator would start."""
    from trainer import simulate

    monkeypatch.setattr(simulate, "available_memory", lambda: available_gib * 2**30)
    url = f"http://127.0.0.1:{free_port()}"
    for where, to_collector in ((["--out", str(tmp_path / "t.parquet")], False), (["--collector", url], True)):
        most = available_gib * 2**30 // simulate.bytes_per_rank(to_collector)
        err = refused(["simulate", "--ranks", str(most + 1), "--steps", "2", *where], capsys)
        assert f"hold at most {most:,} simulated ranks" in err and f"{available_gib} GiB available" in err
        fits_in_memory(most, to_collector)  # no error


def test_simulate_bound_is_about_this_machine():
    """A hundred million ranks do not fit here (nor on any machine this runs on); a thousand do."""
    with pytest.raises(UsageError, match="GiB available here hold at most"):
        fits_in_memory(100_000_000, to_collector=False)
    fits_in_memory(1024, to_collector=True)


@pytest.mark.parametrize("sql", ["SELECT 1; SELECT 2", "SELECT 1;SELECT 2;", "CREATE TABLE t (x INT); SELECT * FROM t"])
def test_query_refuses_several_statements(sql, tmp_path, capsys):
    """Of several statements only the last one's rows would show: refused, as the query API refuses them."""
    db = tmp_path / "s.duckdb"
    duckdb.connect(str(db)).close()
    assert "one statement per query, not 2" in refused(["query", sql, "--db", str(db)], capsys)
    assert duckdb.connect(str(db), read_only=True).execute("SELECT count(*) FROM duckdb_tables()").fetchone() == (0,)
