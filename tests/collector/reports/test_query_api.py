"""The query API on a real collector: read-only SQL, checked by DuckDB's parser, confined to
the sql-files directory beside the store, interrupted past its time limit, capped in rows, and run beside ingest
without stalling it; `rankwatch query --collector` and `rankwatch runs --collector` go through it, and answer
as they do on the store file once its collector stopped."""

import json
import threading
import time

import httpx
import pytest

from collector.store import readonly
from tests.support import loopback
from tests.support.commands import rankwatch_in_process
from tests.support.otlp_payloads import post, query, step_spans, trace_body, with_rank
from tests.support.query_rows import JSON_ROWS, JSON_SQL

pytestmark = pytest.mark.long

RUN, RANKS, STEPS = "run-query", 4, 20
# A cross join that runs for minutes unless interrupted.
SLOW = "SELECT count(*) FROM range(100000000) a, range(100000) b WHERE a.range + b.range = -1"


def fill(collector) -> None:
    """RANKS x STEPS rank-steps of RUN (loss = step / 100)."""
    body = trace_body(step_spans(RUN, 0, range(STEPS)))
    for rank in range(RANKS):
        assert post(collector, "traces", with_rank(body, rank)).status_code == 200


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    """An HTTP client with the token, on one collector for the module, holding RUN."""
    from tests.support.collectors import Collector, free_port

    data = tmp_path_factory.mktemp("query")
    with open(data.parent / "query-collector.log", "w") as log:
        collector = Collector(data / "rankwatch.duckdb", free_port(), "test-token-0123456", log=log).start()
        fill(collector)
        try:
            with loopback.Client(base_url=collector.url, headers=collector.headers, timeout=30) as http:
                http.collector = collector
                yield http
        finally:
            collector.stop()


def ask(api: httpx.Client, sql: str, **fields) -> httpx.Response:
    return api.post("/api/v1/query", json={"sql": sql, **fields})


def test_results_are_correct(api):
    answer = ask(
        api,
        "SELECT rank, count(*) AS steps, round(max(loss), 2) AS last_loss FROM steps "
        "WHERE run_id = ? AND step >= ? GROUP BY rank ORDER BY rank",
        params=[RUN, 5],
    ).json()
    assert answer == {
        "columns": ["rank", "steps", "last_loss"],
        "types": ["INTEGER", "BIGINT", "DOUBLE"],
        "rows": [[r, STEPS - 5, 0.19] for r in range(RANKS)],
        "truncated": False,
    }
    named = ask(
        api, "SELECT count(DISTINCT rank) AS n FROM current_steps WHERE run_id = $run", params={"run": RUN}
    ).json()
    assert named["rows"] == [[RANKS]]


def test_values_are_json_ready(api):
    answer = ask(
        api,
        "SELECT 'nan'::DOUBLE AS x, TIMESTAMP '2024-01-02 03:04:05' AS t, "
        "INTERVAL 90 SECOND AS i, '\\xAB'::BLOB AS b, [1.5, 'inf'::DOUBLE] AS l",
    ).json()
    assert answer["rows"] == [[None, "2024-01-02T03:04:05", 90.0, "ab", [1.5, None]]]


def test_rows_are_capped(api):
    answer = ask(api, "SELECT * FROM range(200000)").json()
    assert len(answer["rows"]) == 100_000 and answer["truncated"] is True
    answer = ask(api, "SELECT * FROM range(10)", max_rows=4).json()
    assert answer["rows"] == [[0], [1], [2], [3]] and answer["truncated"] is True


@pytest.mark.parametrize(
    "sql, reason",
    [
        ("INSERT INTO runs VALUES ('x', 1, now())", "only SELECT is allowed, not INSERT"),
        ("UPDATE steps SET loss = 0", "not UPDATE"),
        ("DELETE FROM steps", "not DELETE"),
        ("CREATE TABLE t AS SELECT 1", "not CREATE"),
        ("DROP TABLE steps", "not DROP"),
        ("COPY steps TO '{data}/out.csv'", "not COPY"),
        ("ATTACH '{data}/other.duckdb' AS other", "not ATTACH"),
        ("DETACH rankwatch", "not DETACH"),
        ("SET threads = 8", "not SET"),
        ("PRAGMA version", "not PRAGMA"),
        ("CALL checkpoint()", "not CALL"),
        ("INSTALL httpfs", "not LOAD"),
        ("LOAD httpfs", "not LOAD"),
        ("EXPORT DATABASE '{data}/dump'", "not EXPORT"),
        ("SELECT 1; DELETE FROM steps", "one statement per query, not 2"),
        ("SELECT nextval('findings_id')", "nextval() is not allowed"),
        ("SELECT * FROM read_csv('/etc/passwd')", "Permission Error"),
        ("SELECT * FROM read_text('{data}/../../../etc/passwd')", "Permission Error"),
        ("SELECT * FROM glob('/*')", "Permission Error"),
        ("SELEC 1", "syntax error"),
    ],
)
def test_refused(api, sql, reason):
    data = api.collector.db.parent
    response = ask(api, sql.format(data=data))
    assert response.status_code == 400 and reason in response.json()["error"], response.text
    error = response.json()["error"]
    assert "\n" not in error or error.endswith("LINE 1: SELEC 1\n        ^"), error  # DuckDB's place, whole
    # nothing changed, nothing was written
    assert ask(api, "SELECT count(*) FROM steps WHERE run_id = ?", params=[RUN]).json()["rows"] == [[RANKS * STEPS]]
    assert not any((data / name).exists() for name in ("out.csv", "other.duckdb", "dump"))


def test_files_in_the_sql_files_directory_are_readable(api):
    files = readonly.files_dir(api.collector.db.parent)
    files.mkdir(exist_ok=True)
    (files / "extra.csv").write_text("a,b\n1,2\n")
    answer = ask(api, "SELECT a + b FROM read_csv('sql-files://extra.csv')").json()
    assert answer["rows"] == [[3]]
    (api.collector.db.parent / "beside.csv").write_text("a,b\n1,2\n")  # beside the store, with its secrets
    response = ask(api, f"SELECT a + b FROM read_csv('{api.collector.db.parent}/beside.csv')")
    assert response.status_code == 400 and "Permission Error" in response.json()["error"]


def test_token_is_required(api):
    url = f"{api.collector.url}/api/v1/query"
    assert loopback.post(url, json={"sql": "SELECT 1"}).status_code == 401
    wrong = loopback.post(url, json={"sql": "SELECT 1"}, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json() == {"error": "missing or wrong bearer token"}


@pytest.mark.parametrize("body", [b"not json", b'["SELECT 1"]', b'{"sql": 1}', b'{"sql": "SELECT 1", "params": 3}'])
def test_bad_bodies(api, body):
    response = api.post("/api/v1/query", content=body)
    assert response.status_code == 400 and response.json()["error"]


def test_a_long_query_times_out(api):
    started = time.monotonic()
    response = ask(api, SLOW, timeout_s=1)
    assert response.status_code == 408, response.text
    assert response.json() == {"error": "the query ran past 1 s and was interrupted"}
    assert time.monotonic() - started < 20  # interrupted: the query alone would run for minutes
    assert ask(api, "SELECT 42").json()["rows"] == [[42]]  # the query thread is free again


def test_ingest_goes_on_during_a_slow_query(api):
    collector = api.collector
    answer: dict = {}

    def slow():
        # Long enough that ten commits on a loaded machine still land while it runs.
        answer["response"] = ask(api, SLOW, timeout_s=30)
        answer["done"] = time.monotonic()

    worker = threading.Thread(target=slow)
    worker.start()
    time.sleep(1.0)  # the query is running
    body = trace_body(step_spans("run-during", 0, range(50)))
    latencies = []
    for rank in range(10):
        sent = time.monotonic()
        assert post(collector, "traces", with_rank(body, rank)).status_code == 200
        latencies.append(time.monotonic() - sent)
    committed = time.monotonic()
    worker.join()
    assert answer["response"].status_code == 408
    assert committed < answer["done"], "ingest finished only after the slow query ended"
    assert max(latencies) < 10.0, latencies  # blocked, one would wait ~29 s
    assert ask(api, "SELECT count(*) FROM steps WHERE run_id = 'run-during'").json()["rows"] == [[500]]


def test_cli_queries_through_the_collector(api):
    collector = api.collector
    env = {"RANKWATCH_TOKEN": collector.token}
    result = rankwatch_in_process(
        "query",
        f"SELECT count(*) AS n FROM steps WHERE run_id = '{RUN}'",
        "--collector",
        collector.url,
        "--format",
        "csv",
        env=env,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["n", str(RANKS * STEPS)]
    refused = rankwatch_in_process("query", "DELETE FROM steps", "--collector", collector.url, env=env)
    assert refused.returncode == 2
    assert refused.stderr.strip() == "rankwatch: error: only SELECT is allowed, not DELETE"
    denied = rankwatch_in_process("query", "SELECT 1", "--collector", collector.url, env={"RANKWATCH_TOKEN": "wrong"})
    assert denied.returncode == 2 and "missing or wrong bearer token" in denied.stderr


def test_json_columns_and_runs_read_the_same_through_the_collector_as_from_its_stopped_store(collector):
    """`query` and `runs` give the same answer through the query API as from the store file, once its
    collector stopped: JSON columns nested in JSON output, each run's status (silent since its last step)."""
    fill(collector)
    env = {"RANKWATCH_TOKEN": collector.token}

    def read(*source: str) -> list:
        said = [rankwatch_in_process(*command, *source, "--format", "json", env=env) for command in (
            ("query", JSON_SQL), ("runs",))]  # fmt: skip
        assert all(r.returncode == 0 for r in said), said
        return [json.loads(r.stdout) for r in said]

    live = read("--collector", collector.url)
    collector.stop()
    assert live == read("--db", str(collector.db))
    assert live[0] == JSON_ROWS
    assert live[1] == [
        {"run": RUN, "ranks": RANKS, "last step": STEPS - 1, "first seen": "2023-11-14 22:13:20 UTC",
         "last seen": "2023-11-14 22:13:22 UTC", "status": "silent since 2023-11-14 22:13:22 UTC",
         "worst finding": None}
    ]  # fmt: skip


def test_a_stopped_store_opens_as_before(collector):
    """The lock-down is a setting of the running database, not of the file."""
    fill(collector)
    collector.stop()
    assert query(collector.db, "SELECT count(*) FROM steps") == [(RANKS * STEPS,)]
    (collector.db.parent / "extra.csv").write_text("a\n1\n")
    assert query(collector.db, f"SELECT a FROM read_csv('{collector.db.parent}/extra.csv')") == [(1,)]
