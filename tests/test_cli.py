"""The `rankwatch` command line and the collector's first-start defaults.

Covered: `rankwatch query` on a store file after its collector stopped (table,
CSV and JSON output with exact values, blobs as hex, timestamps as ISO 8601,
TIMESTAMPTZ columns of `runs`); one-line errors with exit status 2 for bad SQL,
a store held by a running collector, a missing store and no arguments; the
token file created with mode 0600 on first start, authorizing exports, and
kept for the next start; the agent importing without duckdb, pyarrow, streamlit or
the collector package.
"""

import csv
import io
import json
import os
import signal
import stat
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import httpx
import pytest
from conftest import Collector, free_port, rankwatch_cli, rankwatch_in_process
from otlp_payloads import T0, post, query, step_spans, trace_body

from collector.receive.auth import load_or_create_token
from rankwatch.launch import wait_healthy

RUN = "run-cli"
KINETO = Path(__file__).parent / "data" / "kineto"
SQL = "SELECT rank, step, loss, duration_s FROM steps ORDER BY rank, step"
EXPECTED = [
    (0, 1, 0.01, 0.1),
    (0, 2, 0.02, 0.1),
    (0, 3, 0.03, 0.1),
    (1, 1, 0.01, 0.1),
    (1, 2, 0.02, 0.1),
    (1, 3, 0.03, 0.1),
]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A store file with 2 ranks x 3 steps (loss = step / 100, 0.1 s each), its collector stopped."""
    collector = Collector(
        tmp_path_factory.mktemp("cli") / "rankwatch.duckdb",
        free_port(),
        "test-token-0123456",
        extra_args=("--workers", "0"),
    ).start()  # decode in a thread: ingest is not under test here
    try:
        for rank in (0, 1):
            assert post(collector, "traces", trace_body(step_spans(RUN, rank, range(1, 4)))).status_code == 200
    finally:
        collector.stop()
    assert query(collector.db, SQL) == EXPECTED  # what the CLI must print
    return collector.db


def assert_one_line_error(result: subprocess.CompletedProcess, *words: str) -> str:
    assert result.returncode == 2, result
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("rankwatch")
    for word in words:
        assert word in lines[0]
    return lines[0]


def test_query_csv(store):
    r = rankwatch_cli("query", SQL, "--db", str(store), "--format", "csv")
    assert r.returncode == 0, r.stderr
    rows = list(csv.reader(io.StringIO(r.stdout)))
    assert rows == [["rank", "step", "loss", "duration_s"]] + [[str(v) for v in row] for row in EXPECTED]


def test_query_json(store):
    r = rankwatch_in_process("query", SQL, "--db", str(store), "--format", "json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == [dict(zip(("rank", "step", "loss", "duration_s"), row)) for row in EXPECTED]


def test_query_json_blobs_and_timestamps(store):
    span_ids = [bytes(s).hex() for (s,) in query(store, "SELECT span_id FROM steps WHERE rank = 0 ORDER BY step")]
    assert len(span_ids) == 3 and all(len(s) == 16 for s in span_ids)
    r = rankwatch_in_process(
        "query",
        "SELECT step, start_ts, span_id FROM steps WHERE rank = 0 ORDER BY step",
        "--db",
        str(store),
        "--format",
        "json",
    )
    assert r.returncode == 0, r.stderr
    assert T0 == 1_700_000_000 * 10**9  # 2023-11-14T22:13:20Z; step n starts n x 0.1 s later
    assert json.loads(r.stdout) == [
        {"step": 1, "start_ts": "2023-11-14T22:13:20.100000", "span_id": span_ids[0]},
        {"step": 2, "start_ts": "2023-11-14T22:13:20.200000", "span_id": span_ids[1]},
        {"step": 3, "start_ts": "2023-11-14T22:13:20.300000", "span_id": span_ids[2]},
    ]


def test_query_table(store):
    r = rankwatch_in_process("query", SQL, "--db", str(store))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    header = [c.strip() for c in lines[1].strip("┃").split("┃")]
    body = [[c.strip() for c in line.strip("│").split("│")] for line in lines if line.startswith("│")]
    assert header == ["rank", "step", "loss", "duration_s"]
    assert body == [[str(v) for v in row] for row in EXPECTED]


def test_query_runs_and_ranks_timestamps(store):
    """`runs` and `ranks` hold TIMESTAMPTZ columns; a post-mortem must be able to read them."""
    r = rankwatch_in_process("query", "SELECT * FROM runs", "--db", str(store), "--format", "json")
    assert r.returncode == 0, r.stderr
    (run,) = json.loads(r.stdout)
    assert (run["run_id"], run["world_size"]) == (RUN, None)
    assert datetime.fromisoformat(run["first_seen"]).tzinfo is not None
    r = rankwatch_in_process(
        "query", "SELECT rank, first_seen FROM ranks ORDER BY rank", "--db", str(store), "--format", "csv"
    )
    assert r.returncode == 0, r.stderr
    assert [row[0] for row in csv.reader(io.StringIO(r.stdout))] == ["rank", "0", "1"]


def test_bad_sql_one_line_exit_2(store):
    assert_one_line_error(rankwatch_in_process("query", "SELECT nope FRM steps", "--db", str(store)), "syntax error")


def test_query_while_collector_holds_store(collector):
    assert_one_line_error(
        rankwatch_in_process("query", "SELECT 1", "--db", str(collector.db)), "running collector", str(collector.db)
    )
    assert httpx.get(f"{collector.url}/healthz").status_code == 200  # the collector is unaffected


def test_missing_store_one_line_exit_2(tmp_path):
    missing = tmp_path / "nowhere" / "rankwatch.duckdb"
    assert_one_line_error(rankwatch_in_process("query", "SELECT 1", "--db", str(missing)), "no store", str(missing))
    assert not missing.parent.exists()  # a query never creates a store


def test_no_arguments_exit_2():
    assert_one_line_error(rankwatch_cli(), "required")
    assert_one_line_error(rankwatch_in_process("query"), "required")


def _start_without_token(db, port) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "RANKWATCH_TOKEN"}
    process = subprocess.Popen(
        [sys.executable, "-m", "rankwatch", "collector", "--db", str(db), "--port", str(port), "--workers", "0"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    wait_healthy(f"http://127.0.0.1:{port}", process)
    return process


def test_token_file_created_0600_and_authorizes(tmp_path):
    db = tmp_path / "data" / "rankwatch.duckdb"
    port = free_port()
    process = _start_without_token(db, port)
    try:
        token_file = db.parent / "token"
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        token = token_file.read_text().strip()
        assert len(token) >= 32
        me = Collector(db, port, token)
        assert post(me, "traces", trace_body(step_spans("run-token", 0, range(2)))).status_code == 200
        assert post(me, "traces", b"", headers={"Authorization": "Bearer wrong"}).status_code == 401
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)
    assert query(db, "SELECT run_id, count(*) FROM steps GROUP BY run_id") == [("run-token", 2)]
    # the next start reads the same file (the collector calls this at startup) and leaves it as it was
    assert load_or_create_token(db.parent) == token
    assert token_file.read_text().strip() == token and stat.S_IMODE(token_file.stat().st_mode) == 0o600


AGENT_ALONE = """
import sys
for name in ("duckdb", "pyarrow", "numpy", "pandas", "streamlit", "collector"):
    sys.modules[name] = None  # any import of these now raises ImportError
try:
    import collector.store
except ImportError:
    pass
else:
    raise SystemExit("blocking did not work")
import agent, agent.export, agent.semconv
from agent.export import Exporter
exporter = Exporter("http://127.0.0.1:9", "t", {agent.semconv.RUN_ID: "r", agent.semconv.RANK: 0})
exporter.shutdown()
from agent.simdevice import SimulatedDevice  # the GPU of a job without one
gpu = SimulatedDevice(0)
gpu.set_power_cap(300)
print(agent.semconv.POWER_W,
      *[round(value) for metric, value, _ in gpu.read() if metric == agent.semconv.POWER_INSTANT_W])
"""


def test_agent_imports_without_collector_deps():
    """The agent, simulated GPU included, needs none of the collector's libraries (numpy neither)."""
    r = subprocess.run([sys.executable, "-c", AGENT_ALONE], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "DCGM_FI_DEV_POWER_USAGE 300"  # busy, at its cap


def test_collector_refuses_a_held_store_and_a_taken_port_in_one_line(collector, tmp_path):
    """A second collector on the same store, or on a port in use, ends at once with exit 2."""
    held = rankwatch_cli("collector", "--db", str(collector.db), "--port", str(free_port()), "--token", collector.token)
    assert held.returncode == 2
    assert held.stderr.count("\n") == 1 and "held open by a running collector" in held.stderr
    taken = rankwatch_cli(
        "collector", "--db", str(tmp_path / "other.duckdb"), "--port", str(collector.port), "--token", collector.token
    )
    assert taken.returncode == 2
    assert taken.stderr.count("\n") == 1 and f"cannot listen on 127.0.0.1:{collector.port}" in taken.stderr


@pytest.mark.parametrize("kinds", ["foo", "", "nan,grads"])
def test_collector_refuses_unknown_rollback_kinds_in_one_line(kinds):
    result = rankwatch_in_process("collector", "--rollback-on", kinds)
    assert result.returncode == 2
    assert result.stderr.strip() == (
        f"rankwatch collector: error: argument --rollback-on: {kinds!r}: a comma-separated list of nan, loss and grad"
    )


WRONG = "wrong-token-0123456789"


@pytest.fixture(scope="module")
def beside(module_collector) -> Collector:
    """The module's collector with its token in the token file beside its store, as a first start leaves it."""
    (module_collector.db.parent / "token").write_text(module_collector.token + "\n")
    return module_collector


def no_token_env(tmp_path) -> dict[str, str]:
    """An environment where no token is to be found: no variable, and a default store with no token file."""
    return {"RANKWATCH_TOKEN": "", "RANKWATCH_TOKEN_FILE": "", "RANKWATCH_DB": str(tmp_path / "none" / "s.duckdb")}


def test_a_refused_token_stops_dashboard_and_simulate_in_one_line(beside, tmp_path, monkeypatch):
    """A wrong token, or none found, is one line naming where a token is looked for, exit 2, before the
    dashboard serves a page, the simulator sends a step or train starts torchrun (minutes of 401s before)."""
    import dashboard.serve

    def served(*args) -> None:
        raise AssertionError("the dashboard started serving")

    monkeypatch.setattr(dashboard.serve, "serve", served)  # in this process: Streamlit would replace it
    port = free_port()
    for env in ({"RANKWATCH_TOKEN": WRONG}, no_token_env(tmp_path)):
        said = "that token is not its token" if env["RANKWATCH_TOKEN"] else "no token was found"
        dashboard = rankwatch_in_process("dashboard", "--collector", beside.url, "--port", str(port), env=env)
        line = assert_one_line_error(dashboard, f"the collector at {beside.url} refused the token (HTTP 401", said)
        assert "--token-file PATH, $RANKWATCH_TOKEN, or --db" in line
        simulate = rankwatch_in_process(
            "simulate", "--ranks", "2", "--steps", "2", "--run", "refused", "--collector", beside.url, env=env
        )
        assert_one_line_error(simulate, "refused the token (HTTP 401", said)
        train = rankwatch_in_process("train", "--steps", "2", "--collector", beside.url, env=env)
        assert_one_line_error(train, "refused the token (HTTP 401", said)  # before torchrun starts a rank
    rows = httpx.post(
        f"{beside.url}/api/v1/query",
        json={"sql": "SELECT count(*) FROM runs WHERE run_id = 'refused'"},
        headers=beside.headers,
        timeout=30,
    ).json()["rows"]
    assert rows == [[0]]


def test_db_finds_the_collectors_token_and_links_name_the_dashboards_real_port(beside, tmp_path):
    """`--db` (the collector's store) finds the token file beside it for the dashboard and the simulator;
    the dashboard notes the port it serves on there, and the simulator's link names that port."""
    from conftest import Interactive

    port = free_port()
    env = {**os.environ, **no_token_env(tmp_path)}
    dashboard = Interactive(
        "dashboard", "--collector", beside.url, "--db", str(beside.db), "--port", str(port), env=env
    )
    try:
        dashboard.read_until(f"rankwatch dashboard on http://127.0.0.1:{port}", timeout_s=60)
    finally:
        dashboard.kill()
    assert (beside.db.parent / "dashboard").read_text().strip() == f"http://127.0.0.1:{port}"
    sent = rankwatch_in_process(
        "simulate", "--ranks", "2", "--steps", "2", "--run", "found", "--collector", beside.url, "--db", str(beside.db),
        env=no_token_env(tmp_path),
    )  # fmt: skip
    assert sent.returncode == 0, sent.stderr
    assert f"watch it at http://127.0.0.1:{port}/?run=found " in sent.stdout.splitlines()[0]
    assert sent.stdout.splitlines()[-1].endswith(f"of 2 ranks sent to {beside.url}")


def test_the_exporter_tells_a_refused_token_from_an_unreachable_collector(beside, caplog):
    """check_token: True for the token, False where nothing listens, TokenRefused for a wrong or missing one;
    an exporter refused mid-run says so once (not "unreachable") and stops a paced producer."""
    import time

    import agent
    from agent import semconv as sc
    from agent.config import TokenRefused
    from agent.export import Exporter, check_token

    assert check_token(beside.url, beside.token) is True
    assert check_token(f"http://127.0.0.1:{free_port()}", beside.token) is False
    for token in (WRONG, None):
        with pytest.raises(TokenRefused, match=r"refused the token \(HTTP 401"):
            check_token(beside.url, token)
    with pytest.raises(TokenRefused):  # a rank learns it at init, not after a run of refused steps
        agent.init(run_id="refused-init", collector=beside.url, token=WRONG, rank=0, world_size=1, cuda=False)
    step = [("step", time.time_ns(), time.time_ns() + 1000, {sc.KIND: sc.KIND_STEP, sc.STEP: 1})]
    for paced in (False, True):
        exporter = Exporter(beside.url, WRONG, {sc.RUN_ID: "refused-mid-run", sc.RANK: 0}, paced=paced)
        with caplog.at_level("WARNING", logger="rankwatch.agent"):
            exporter.trace(step)
            exporter.flush()
        assert exporter.token_refused is not None and "refused the token (HTTP 401" in exporter.token_refused
        if paced:
            with pytest.raises(TokenRefused):
                exporter.trace(step)
        started = time.monotonic()
        exporter.shutdown()
        assert time.monotonic() - started < 10  # no paced retries of what the collector will never take
        assert exporter.undelivered()[0].rank_steps == 1
    warnings = [r.getMessage() for r in caplog.records if r.name == "rankwatch.agent"]
    assert warnings and all("refused the token" in w and "unreachable" not in w for w in warnings), warnings


def test_power_recommend_without_power_samples_is_one_line(store):
    for extra in ((), ("--json",)):
        result = rankwatch_in_process("power", "recommend", RUN, "--db", str(store), *extra)
        assert_one_line_error(result, f"run {RUN} has no power samples", "no caps to recommend")


def test_power_apply_refuses_a_run_no_job_is_running(beside):
    """A power cap is applied by the job at a step boundary: to a run whose ranks all ended, or that sent
    its last step and heartbeat long ago, or only steps long ago (an imported run), it would stay pending
    for ever."""
    import time

    from agent import semconv as sc
    from agent.export import Exporter

    ago = T0  # step_spans' time: 2023
    for run, event, ts in (("pa-ended", sc.EVENT_ENDED, time.time_ns()), ("pa-old", sc.EVENT_HEARTBEAT, ago)):
        for rank in (0, 1):
            assert post(beside, "traces", trace_body(step_spans(run, rank, range(3)))).status_code == 200
            exporter = Exporter(beside.url, beside.token, {sc.RUN_ID: run, sc.RANK: rank})
            exporter.event(event, ts, {sc.RANK: rank})
            assert exporter.flush()
            exporter.shutdown()
    assert post(beside, "traces", trace_body(step_spans("pa-silent", 0, range(3)))).status_code == 200
    env = {"RANKWATCH_TOKEN": beside.token}
    for run, said in (
        ("pa-ended", "has ended (every rank said so)"),
        ("pa-old", "has sent nothing for"),
        ("pa-silent", "has sent nothing for"),
    ):
        result = rankwatch_in_process("power", "apply", run, "--watts", "300", "--collector", beside.url, env=env)
        assert_one_line_error(result, f"run {run} {said}", "no job is running" if run != "pa-ended" else "never")
        commands = httpx.get(f"{beside.url}/v1/commands", params={"run_id": run}, headers=beside.headers, timeout=30)
        assert commands.json() == []


HOLD_READ_ONLY = (
    "import duckdb, sys, time; c = duckdb.connect(sys.argv[1], read_only=True); print(1, flush=True); time.sleep(60)"
)


def test_a_store_held_by_another_reader_names_that_process(tmp_path):
    """A store a dashboard (or any script) holds open is not said to be held by a collector: the
    one-line error names the process that holds it, by pid and command line."""
    db = tmp_path / "s.duckdb"
    rankwatch_in_process("import", "kineto", str(KINETO / "sampled_rank-0.json.gz"), "--run", "a", "--db", str(db))
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            HOLD_READ_ONLY,
            str(db),
        ],
        stdout=subprocess.PIPE,
    )
    try:
        assert holder.stdout.readline() == b"1\n"
        again = rankwatch_in_process(
            "import", "kineto", str(KINETO / "sampled_rank-1.json.gz"), "--run", "b", "--db", str(db)
        )
    finally:
        holder.kill()
        holder.wait()
    assert again.returncode == 2 and again.stderr.count("\n") == 1
    assert f"held open by another process (pid {holder.pid}: python" in again.stderr
    assert "collector" not in again.stderr
