"""The `rankwatch` command line and the collector's first-start defaults.

Covered: `rankwatch query` on a store file after its collector stopped (table,
CSV and JSON output with exact values, blobs as hex, timestamps as ISO 8601,
TIMESTAMPTZ columns of `runs`); errors with exit status 2, one line for a store held by a running
collector, a missing store and no arguments, and for bad SQL DuckDB's reason with its LINE and caret
under it; `rankwatch runs`, each run's status and worst finding; the
token file created with mode 0600 on first start, authorizing exports, and
kept for the next start; the agent importing without duckdb, pyarrow, streamlit or
the collector package. Scoped tokens: `rankwatch token --scope` makes them from the
collector's; `rankwatch run` hands its job an ingest token in a private file, never the
collector's token, and takes the --db its refusal names; a job's start links the dashboard while it
serves, else says how to start one; the dashboard takes a query token and refuses an ingest one in one line.
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

import pytest

from collector.receive.auth import load_or_create_token
from rankwatch.launch import wait_healthy
from tests.support import loopback
from tests.support.collectors import Collector, free_port
from tests.support.commands import rankwatch_cli, rankwatch_in_process
from tests.support.otlp_payloads import T0, post, query, step_spans, trace_body
from tests.support.paths import DATA
from tests.support.waits import wait_until

RUN = "run-cli"
KINETO = DATA / "kineto"
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
    r = rankwatch_in_process("query", SQL, "--db", str(store), "--format", "csv")
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


def test_bad_sql_is_one_error_with_duckdbs_pointer_to_the_place_exit_2(store):
    """DuckDB's reason on the error's line, then its LINE and caret as lines of their own: each escaped, the
    caret still under the character DuckDB pointed at (here past an escape sequence and a tab)."""
    refused = rankwatch_in_process("query", "SELECT '\x1b[31m' AS red,\n\tnope FRM steps", "--db", str(store))
    assert (refused.returncode, refused.stdout) == (2, "")
    assert refused.stderr.splitlines() == [
        'rankwatch: error: Parser Error: syntax error at or near "steps"',
        "LINE 2: \\tnope FRM steps",
        "                   ^",
    ]
    unknown = rankwatch_in_process("query", "SELECT '\x1b[31m' || nope FROM steps", "--db", str(store))
    assert unknown.returncode == 2 and unknown.stderr.splitlines()[1:] == [
        "LINE 1: SELECT '\\x1b[31m' || nope FROM steps",
        "                             ^",
    ]
    several = rankwatch_in_process("query", "SELECT 1; SELECT 2", "--db", str(store))
    assert_one_line_error(several, "one statement per query, not 2: run each on its own")


def test_query_while_collector_holds_store(beside):
    assert_one_line_error(
        rankwatch_in_process("query", "SELECT 1", "--db", str(beside.db)), "running collector", str(beside.db)
    )
    assert loopback.get(f"{beside.url}/healthz").status_code == 200  # the collector is unaffected


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
from rankwatch.agent import semconv
from rankwatch.agent.export import Exporter
exporter = Exporter("http://127.0.0.1:9", "t", {semconv.RUN_ID: "r", semconv.RANK: 0})
exporter.shutdown()
from rankwatch.agent.simdevice import SimulatedDevice  # the GPU of a job without one
gpu = SimulatedDevice(0)
gpu.set_power_cap(300)
print(semconv.POWER_W,
      *[round(value) for metric, value, _ in gpu.read() if metric == semconv.POWER_INSTANT_W])
"""


def test_agent_imports_without_collector_deps():
    """The agent, simulated GPU included, needs none of the collector's libraries (numpy neither)."""
    r = subprocess.run([sys.executable, "-c", AGENT_ALONE], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "DCGM_FI_DEV_POWER_USAGE 300"  # busy, at its cap


def test_collector_refuses_a_held_store_and_a_taken_port_in_one_line(beside, tmp_path):
    """A second collector on the same store, or on a port in use, ends at once with exit 2 (its checks before it
    serves, run in this process: a collector that got past them would serve here, and the test would time out)."""
    held = rankwatch_in_process(
        "collector", "--db", str(beside.db), "--port", str(free_port()), "--token", beside.token
    )
    assert held.returncode == 2
    assert held.stderr.count("\n") == 1 and "held open by a running collector" in held.stderr
    taken = rankwatch_in_process(
        "collector", "--db", str(tmp_path / "other.duckdb"), "--port", str(beside.port), "--token", beside.token
    )
    assert taken.returncode == 2
    assert taken.stderr.count("\n") == 1 and f"cannot listen on 127.0.0.1:{beside.port}" in taken.stderr


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
    rows = loopback.post(
        f"{beside.url}/api/v1/query",
        json={"sql": "SELECT count(*) FROM runs WHERE run_id = 'refused'"},
        headers=beside.headers,
        timeout=30,
    ).json()["rows"]
    assert rows == [[0]]


def test_db_finds_the_collectors_token_and_links_name_the_dashboards_real_port(beside, tmp_path):
    """`--db` (the collector's store) finds the token file beside it for the dashboard and the simulator;
    the dashboard notes the port it serves on there, and the simulator's link names that port while it
    serves; once it has stopped, the simulator says how to start one instead of an address nobody serves."""
    from rankwatch.launch import listening
    from tests.support.commands import Interactive

    port = free_port()
    env = {**os.environ, **no_token_env(tmp_path)}

    def simulate(run: str) -> str:
        sent = rankwatch_in_process(
            "simulate", "--ranks", "2", "--steps", "2", "--run", run, "--collector", beside.url, "--db",
            str(beside.db), env=no_token_env(tmp_path),
        )  # fmt: skip
        assert sent.returncode == 0, sent.stderr
        assert sent.stdout.splitlines()[-1].endswith(f"of 2 ranks sent to {beside.url}")
        return sent.stdout.splitlines()[0]

    dashboard = Interactive(
        "dashboard", "--collector", beside.url, "--db", str(beside.db), "--port", str(port), env=env
    )
    try:
        dashboard.read_until(f"rankwatch dashboard on http://127.0.0.1:{port}", timeout_s=60)
        wait_until(lambda: listening(f"http://127.0.0.1:{port}"), "the dashboard did not serve", timeout_s=60)
        assert f"; watch it at http://127.0.0.1:{port}/?run=found%201 (rankwatch dashboard)" in simulate("found 1")
    finally:
        dashboard.kill()
    assert (beside.db.parent / "dashboard").read_text().strip() == f"http://127.0.0.1:{port}"
    assert simulate("unwatched").endswith(
        f"; to watch it, start a dashboard: rankwatch dashboard --collector {beside.url} --db {beside.db}"
    )


def test_run_takes_the_db_that_its_refusal_names(beside, tmp_path):
    """A refused token's line names --db (the collector's store, its token file beside it): `run` takes it."""
    refused = rankwatch_in_process("run", "--collector", beside.url, "--", "true", env=no_token_env(tmp_path))
    assert_one_line_error(refused, "no token was found", "or --db (the collector's store")
    job = rankwatch_cli(
        "run", "--collector", beside.url, "--db", str(beside.db), "--run", "by-db", "--", sys.executable, "-c", "",
        env=no_token_env(tmp_path),
    )  # fmt: skip
    assert job.returncode == 0, job.stderr
    assert job.stdout.startswith(f"rankwatch run: run by-db, telemetry to {beside.url}; ")


def test_the_exporter_tells_a_refused_token_from_an_unreachable_collector(beside, caplog):
    """check_token: True for the token, False where nothing listens, TokenRefused for a wrong or missing one;
    an exporter refused mid-run says so once (not "unreachable") and stops a paced producer."""
    import time

    from rankwatch import agent
    from rankwatch.agent import semconv as sc
    from rankwatch.agent.config import TokenRefused
    from rankwatch.agent.export import Exporter
    from rankwatch.agent.senders import check_token

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


# a job's command that writes what it was given: its environment, and the token file it was pointed at
JOB_SEES = (
    "import json, os, stat, sys; f = os.environ.get('RANKWATCH_TOKEN_FILE'); json.dump({'env': dict(os.environ), "
    "'token': f and open(f).read(), 'mode': f and stat.S_IMODE(os.stat(f).st_mode)}, open(sys.argv[1], 'w'))"
)


def test_run_gives_the_job_an_ingest_token_in_a_file_of_its_own_never_the_collectors(beside, tmp_path):
    """`rankwatch run --token-file` with the collector's token (exported in the shell too): the job's processes
    see neither, only a private file, gone after the job, whose ingest token exports but cannot query."""
    token_file = tmp_path / "token"
    token_file.write_text(beside.token + "\n")
    seen_file = tmp_path / "seen.json"
    job = rankwatch_cli(
        "run", "--collector", beside.url, "--token-file", str(token_file), "--", sys.executable, "-c", JOB_SEES,
        str(seen_file), env={"RANKWATCH_TOKEN": beside.token},
    )  # fmt: skip
    assert job.returncode == 0, job.stderr
    seen = json.loads(seen_file.read_text())
    assert "RANKWATCH_TOKEN" not in seen["env"] and beside.token not in json.dumps(seen)
    assert seen["mode"] == 0o600 and not Path(seen["env"]["RANKWATCH_TOKEN_FILE"]).exists()
    ingest = seen["token"].strip()
    made = rankwatch_in_process("token", "--scope", "ingest", "--token-file", str(token_file))
    assert made.returncode == 0 and made.stdout == ingest + "\n", made
    headers = {"Authorization": f"Bearer {ingest}"}
    exported = loopback.post(
        f"{beside.url}/v1/traces", content=b"", headers=headers | {"Content-Type": "application/x-protobuf"}
    )
    assert exported.status_code == 200
    queried = loopback.post(f"{beside.url}/api/v1/query", json={"sql": "SELECT 1"}, headers=headers, timeout=30)
    assert queried.status_code == 403 and "the query scope" in queried.json()["error"]


def test_token_refuses_no_token_and_a_scoped_one_in_one_line(beside, tmp_path):
    nothing = rankwatch_in_process("token", "--scope", "query", env=no_token_env(tmp_path))
    assert_one_line_error(nothing, "no token was found", "--token-file PATH")
    ingest = rankwatch_in_process("token", "--scope", "ingest", env={"RANKWATCH_TOKEN": beside.token}).stdout.strip()
    again = rankwatch_in_process("token", "--scope", "query", env={"RANKWATCH_TOKEN": ingest})
    assert_one_line_error(again, "that token is scoped to ingest", "the collector's own token")


def test_the_dashboard_takes_a_query_token_and_refuses_an_ingest_one(beside, tmp_path, monkeypatch):
    """The dashboard only reads: a query token is all it needs; an ingest token cannot read, which it says at start."""
    import dashboard.serve

    served = []
    monkeypatch.setattr(dashboard.serve, "serve", lambda *args: served.append(args))
    port = str(free_port())
    tokens = {
        scope: rankwatch_in_process("token", "--scope", scope, env={"RANKWATCH_TOKEN": beside.token}).stdout.strip()
        for scope in ("query", "ingest")
    }
    shown = rankwatch_in_process(
        "dashboard", "--collector", beside.url, "--port", port, env={"RANKWATCH_TOKEN": tokens["query"]}
    )
    assert shown.returncode == 0 and len(served) == 1, shown
    refused = rankwatch_in_process(
        "dashboard", "--collector", beside.url, "--port", port, env={"RANKWATCH_TOKEN": tokens["ingest"]}
    )
    assert_one_line_error(refused, "refused the token (HTTP 403", "that token is scoped to ingest")
    assert len(served) == 1


def _store_of_runs(db: Path) -> None:
    """A store holding a run of each status: silent, ended, ended in failure (its job stopped itself, a finding
    still firing after the end), hung, and one heard from just now (in a store no collector writes: stored)."""
    from collector.store.db import connect, create_tables

    with connect(db) as con:
        create_tables(con)
        for n, (run, age_s, ended, finding) in enumerate(
            [
                ("quiet", 3600, False, None),
                ("done", 3000, True, None),
                ("stopped", 2400, True, ("rollbacks", "stopped", "the job stopped at step 4 instead of a rollback")),
                ("stuck", 1800, False, ("hangs", "hang", "ranks 0-1 wait in all_reduce since step 4")),
                ("fresh", 5, False, None),
            ]
        ):
            start = f"TIMESTAMP '2024-05-01 12:00:00' + INTERVAL {n} HOUR" if age_s > 5 else "now()::TIMESTAMP"
            con.execute(f"INSERT INTO runs VALUES ('{run}', 2, ({start})::TIMESTAMPTZ)")
            con.execute(f"INSERT INTO ranks (run_id, rank, first_seen) SELECT '{run}', r, now() FROM range(2) t(r)")
            con.execute(
                "INSERT INTO steps (run_id, rank, step, start_ts, end_ts, duration_s) SELECT ?, r, s, "
                f"{start} + INTERVAL (s) SECOND, {start} + INTERVAL (s + 1) SECOND, 1.0 "
                "FROM range(2) a(r), range(5) b(s)",
                [run],
            )
            if ended:
                con.execute(
                    f"INSERT INTO events (run_id, rank, ts, event, step) SELECT ?, r, {start} + INTERVAL 6 SECOND, "
                    "'ended', 4 FROM range(2) t(r)",
                    [run],
                )
            if finding:
                con.execute(
                    "INSERT INTO findings (run_id, analyzer, kind, ranks, step_start, step_end, severity, score, "
                    "summary, evidence) VALUES (?, ?, ?, [0, 1], 4, 4, 'critical', 1.0, ?, '{}')",
                    [run, *finding],
                )


def test_runs_lists_each_runs_status_and_worst_finding(tmp_path):
    """`rankwatch runs`: a line per run, newest first, its status as the dashboard derives it (failed where
    it ended with a finding firing), in each of the formats `query` has."""
    db = tmp_path / "rankwatch.duckdb"
    _store_of_runs(db)
    listed = rankwatch_in_process("runs", "--db", str(db), "--format", "json")
    assert listed.returncode == 0, listed.stderr
    fresh, *rest = json.loads(listed.stdout)
    assert (fresh["run"], fresh["ranks"], fresh["last step"]) == ("fresh", 2, 4)
    assert fresh["status"] == f"last heard {fresh['last seen']}, in a store no collector writes"
    assert rest == [
        {"run": "stuck", "ranks": 2, "last step": 4, "first seen": "2024-05-01 15:00:00 UTC",
         "last seen": "2024-05-01 15:00:05 UTC", "status": "hung, silent since 2024-05-01 15:00:05 UTC",
         "worst finding": "hangs / hang: ranks 0-1 wait in all_reduce since step 4"},
        {"run": "stopped", "ranks": 2, "last step": 4, "first seen": "2024-05-01 14:00:00 UTC",
         "last seen": "2024-05-01 14:00:06 UTC", "status": "failed: ended 2024-05-01 14:00:06 UTC",
         "worst finding": "rollbacks / stopped: the job stopped at step 4 instead of a rollback"},
        {"run": "done", "ranks": 2, "last step": 4, "first seen": "2024-05-01 13:00:00 UTC",
         "last seen": "2024-05-01 13:00:06 UTC", "status": "ended 2024-05-01 13:00:06 UTC", "worst finding": None},
        {"run": "quiet", "ranks": 2, "last step": 4, "first seen": "2024-05-01 12:00:00 UTC",
         "last seen": "2024-05-01 12:00:05 UTC", "status": "silent since 2024-05-01 12:00:05 UTC",
         "worst finding": None},
    ]  # fmt: skip
    table = rankwatch_in_process("runs", "--db", str(db))
    assert table.returncode == 0, table.stderr
    assert [line.split("│")[1].strip() for line in table.stdout.splitlines() if line.startswith("│ ") and
            line.split("│")[1].strip()] == ["fresh", "stuck", "stopped", "done", "quiet"]  # fmt: skip
    rows = list(csv.DictReader(io.StringIO(rankwatch_in_process("runs", "--db", str(db), "--format", "csv").stdout)))
    assert [(r["run"], r["status"]) for r in rows[1:]] == [(r["run"], r["status"]) for r in rest]


def test_power_recommend_without_power_samples_is_one_line(store):
    for extra in ((), ("--json",)):
        result = rankwatch_in_process("power", "recommend", RUN, "--db", str(store), *extra)
        assert_one_line_error(result, f"run {RUN} has no power samples", "no caps to recommend")


def test_power_apply_refuses_a_run_no_job_is_running(beside):
    """A power cap is applied by the job at a step boundary: to a run whose ranks all ended, or that sent
    its last step and heartbeat long ago, or only steps long ago (an imported run), it would stay pending
    for ever."""
    import time

    from rankwatch.agent import semconv as sc
    from rankwatch.agent.export import Exporter

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
        commands = loopback.get(f"{beside.url}/v1/commands", params={"run_id": run}, headers=beside.headers, timeout=30)
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
