"""Collectors sharing one lake (collector/store/lake.py): a real PostgreSQL server on loopback holds the
catalog, the Parquet files are in a directory, and real collector processes store into it.

A simulated job sent to two collectors at once (`--collector A,B`: each node's ranks to one of them)
is one run, stored once, judged once, and read whole from either. When the collector that leads a
run's analysis is killed (-9) mid-run, its ranks move to the other with what they had not had
acknowledged, nothing is lost or stored twice, and the other takes the run's analysis over within
10 s: the hang the job then makes is named by it.
"""

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from rankwatch.agent.apiclient import ApiClient, ApiError
from tests.support import postgres
from tests.support.collectors import free_port
from tests.support.commands import rankwatch_cli, rankwatch_in_process
from tests.support.otlp_payloads import post, step_spans, trace_body
from tests.support.waits import wait_until

pytestmark = pytest.mark.long
# how often a condition read through a lake's query API is asked again: each query costs the collector and the
# catalog database tens of milliseconds of CPU (the takeover, which is timed, is watched closer)
POLL_S = 0.5


@pytest.fixture(scope="module")
def catalog_server():
    server = postgres.start(free_port())
    yield server
    postgres.stop(server)


@dataclass
class Shards:
    """Collectors on one new lake: `start(n, *extra_args)` starts n of them."""

    catalog: str
    data_path: Path
    factory: Callable

    def start(self, n: int, *extra: str) -> list:
        lake = ("--lake", self.catalog, "--data-path", str(self.data_path))
        return [
            self.factory(self.data_path.parent / f"shard-{i}" / "rankwatch.duckdb", *lake, *extra) for i in range(n)
        ]


@pytest.fixture
def shards(catalog_server, collector_factory, tmp_path, request) -> Shards:
    name = request.node.name.replace("[", "_").replace("]", "")[:60].lower()
    return Shards(catalog_server.database(name), tmp_path / "lake", collector_factory)


def simulate(shards, run_id: str, *args: str, background: bool = False):
    command = ("simulate", "--run", run_id, "--collector", ",".join(s.url for s in shards), *args)
    env = {"RANKWATCH_TOKEN": shards[0].token}
    if background:
        return subprocess.Popen(
            [sys.executable, "-m", "rankwatch", *command],
            env={**os.environ, **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    return rankwatch_in_process(*command, env=env)


def rows(collector, sql: str) -> list:
    """A query's rows, through a collector's query API (any collector of a lake reads all of it)."""
    return ApiClient(collector.url, collector.token).post("/api/v1/query", {"sql": sql})["rows"]


def test_a_job_sent_to_two_collectors_is_one_run_stored_once_and_judged_once(shards):
    a, b = shards.start(2, "--analyze-every", "1")
    ranks, steps = 128, 30  # 16 nodes of 8 ranks
    job = simulate(
        [a, b], "spread", "--ranks", str(ranks), "--steps", str(steps), "--inject", "straggler:rank=77,slowdown=1.5"
    )
    assert job.returncode == 0, job.stderr[-2000:]
    # both collectors took a share of the job's nodes
    for shard in (a, b):
        ((exports,),) = rows(shard, "SELECT count(*) FROM exports WHERE signal = 'traces'")
        assert exports > 0
    counts = "SELECT count(*), count(DISTINCT (rank, step)), count(DISTINCT rank) FROM steps WHERE run_id = 'spread'"
    assert rows(a, counts) == rows(b, counts) == [[ranks * steps, ranks * steps, ranks]]
    finding = """SELECT ranks, count(*) FROM findings WHERE run_id = 'spread' AND analyzer = 'stragglers'
                 AND severity <> 'info' GROUP BY ranks"""
    wait_until(lambda: rows(a, finding), "the straggler judged", every_s=POLL_S)
    assert rows(a, finding) == rows(b, finding) == [[[77], 1]]  # one finding, whichever collector drew it
    ((holder,),) = rows(a, "SELECT count(DISTINCT holder) FROM leases WHERE kind = 'run' AND name = 'spread'")
    assert holder == 1
    # a command made through one collector is the job's through the other (rank 0 polls the one it sends to)
    made = ApiClient(a.url, a.token).post(
        "/v1/commands", {"run_id": "spread", "kind": "power_cap", "args": {"watts": 500}}
    )
    pending = ApiClient(b.url, b.token).get("/v1/commands", {"run_id": "spread", "state": "pending"})
    assert [c["id"] for c in pending] == [made["id"]]
    # a query reads the lake, and cannot reach through to its catalog database's SQL
    for sql in ("SELECT * FROM postgres_query('pg', 'DROP SCHEMA rankwatch CASCADE')", "CALL pg_clear_cache()"):
        with pytest.raises(ApiError) as refused:
            rows(b, sql)
        assert refused.value.status == 400, refused.value
    # after the fact, the whole run read from the lake itself
    report = rankwatch_in_process(
        "analyze", "spread", "--json", "--lake", shards.catalog, "--data-path", str(shards.data_path)
    )
    assert report.returncode == 0, report.stderr[-2000:]
    found = json.loads(report.stdout)["findings"]
    assert [f["ranks"] for f in found if f["analyzer"] == "stragglers" and f["severity"] != "info"] == [[77]]


def _collector_of(holder: str, shards) -> object:
    """The shard whose writer process is `holder` (host:pid): the writer's parent is the collector."""
    pid = int(holder.rsplit(":", 1)[1])
    parent = int(
        next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("PPid:")).split()[
            1
        ]
    )
    return next(s for s in shards if s.process.pid == parent)


def test_a_killed_collector_loses_nothing_and_another_takes_its_runs_over(shards):
    a, b = shards.start(2, "--analyze-every", "1", "--hang-after", "4")
    ranks, steps, hang_at = 128, 12, 8
    job = simulate(
        [a, b],
        "failover",
        "--ranks",
        str(ranks),
        "--steps",
        str(steps),
        "--inject",
        f"hang:rank=9,at={hang_at}",
        "--hang-for",
        "12",
        background=True,
    )
    lease = "SELECT holder FROM leases WHERE kind = 'run' AND name = 'failover' AND expires_at > now()"
    wait_until(lambda: rows(a, lease), "a collector leading the run", timeout_s=60, every_s=POLL_S)
    ((holder,),) = rows(a, lease)
    leader = _collector_of(holder, (a, b))
    survivor = b if leader is a else a
    stored = "SELECT count(*) FROM steps WHERE run_id = 'failover'"
    wait_until(lambda: rows(survivor, stored)[0][0] > 0, "steps stored", every_s=POLL_S)
    leader.stop(signal.SIGKILL)
    killed = time.monotonic()

    def taken_over() -> bool:
        held = rows(survivor, lease)
        return bool(held) and held != [[holder]]

    wait_until(taken_over, "the lease taken over", timeout_s=15)
    taken_over_s = time.monotonic() - killed
    assert taken_over_s <= 10.0, taken_over_s
    _, err = job.communicate(timeout=120)
    assert job.returncode == 0, err[-2000:]  # every span delivered (the simulator exits 3 on any loss)
    counts = "SELECT count(*), count(DISTINCT (rank, step)) FROM steps WHERE run_id = 'failover'"
    assert rows(survivor, counts) == [[ranks * hang_at, ranks * hang_at]]  # none lost, none twice
    hangs = "SELECT ranks FROM findings WHERE run_id = 'failover' AND analyzer = 'hangs' AND severity <> 'info'"
    # (a pass before the stall's heartbeats reached the survivor says the stall without culprits, and keeps none)
    named = "rank 9 named by the collector that took over"
    wait_until(lambda: [9] in [r[0] for r in rows(survivor, hangs)], named, timeout_s=30, every_s=POLL_S)


def assert_refused_in_one_line(result, said: str) -> None:
    assert result.returncode == 2 and result.stderr.startswith(said) and result.stderr.count("\n") == 1, result.stderr


@pytest.mark.parametrize(
    "args, said",
    [
        (["--lake", "host=127.0.0.1 dbname=x"], "rankwatch: error: --lake and --data-path go together"),
        (["--data-path", "lake"], "rankwatch: error: --lake and --data-path go together"),
        (
            ["--lake", "host=db1 dbname=x user=u password=hunter2", "--data-path", "lake"],
            "rankwatch: error: keep the catalog's password out of --lake, where `ps` and the log show it",
        ),
    ],
)
def test_lake_options_the_collector_cannot_take_are_refused_in_one_line(tmp_path, args, said):
    """Checked before the collector opens anything, so run in this process (a collector that got past them would
    serve here, and the test time out)."""
    result = rankwatch_in_process(
        "collector", "--db", str(tmp_path / "rankwatch.duckdb"), "--port", str(free_port()), *args, cwd=tmp_path
    )
    assert_refused_in_one_line(result, said)


def test_a_lake_the_collector_cannot_open_is_refused_in_one_line(tmp_path):
    """A catalog nothing answers for, as a user meets it: a collector process of its own, its whole stderr one line."""
    catalog = f"host=127.0.0.1 port={free_port()} dbname=x user=nobody connect_timeout=2"
    result = rankwatch_cli(
        "collector", "--db", str(tmp_path / "rankwatch.duckdb"), "--port", str(free_port()),
        "--lake", catalog, "--data-path", "lake", cwd=tmp_path,
    )  # fmt: skip
    assert_refused_in_one_line(result, "rankwatch: error: cannot open the lake 'host=127.0.0.1 port=")


def test_upkeep_merges_the_small_files_of_many_commits_and_drops_what_is_past_retention(catalog_server, tmp_path):
    """What one collector's upkeep round does to a lake: many small commits become one file a table, and
    telemetry older than the retention goes, newer stays."""
    from collector.store import lake
    from collector.store.upkeep import Upkeep

    con = lake.open_lake(lake.Lake(catalog_server.database("upkeep"), tmp_path / "lake"))
    lake.create_tables(con)
    now_ns = time.time_ns()
    for i in range(12):  # twelve commits: twelve files
        at = now_ns - (i % 2) * 3 * 86_400 * 10**9  # every other one three days old
        con.execute(
            "INSERT INTO steps (run_id, rank, step, start_ts, end_ts, duration_s) "
            "VALUES ('r', ?, 0, make_timestamp_ns(?), make_timestamp_ns(?), 1.0)",
            [i, at, at],
        )
    live = (
        "SELECT count(*) FROM __ducklake_metadata_lake.public.ducklake_data_file f "
        "JOIN __ducklake_metadata_lake.public.ducklake_table t USING (table_id) "
        "WHERE t.table_name = 'steps' AND f.end_snapshot IS NULL AND t.end_snapshot IS NULL"
    )
    assert con.execute(live).fetchall() == [(12,)]
    Upkeep(retain_days=2).once(con)
    assert con.execute("SELECT count(*), min(rank % 2) FROM steps").fetchall() == [(6, 0)]
    assert con.execute(live).fetchall() == [(1,)]  # merged into one


def test_four_collectors_find_what_one_collector_finds(shards, collector_factory, tmp_path):
    """The same simulated job (same seed), once into one collector's file and once spread over four
    collectors of a lake: the same findings, each once."""
    job = ("--ranks", "128", "--steps", "24", "--seed", "3", "--inject", "slow-node:node=5,slowdown=1.4,from=4")
    alone = collector_factory(tmp_path / "alone" / "rankwatch.duckdb", "--analyze-every", "1")
    spread = shards.start(4, "--analyze-every", "1")
    for collectors in ([alone], spread):
        result = simulate(collectors, "same", *job)
        assert result.returncode == 0, result.stderr[-2000:]
    found = """SELECT analyzer, kind, ranks, count(*) FROM findings WHERE run_id = 'same' AND severity <> 'info'
               AND analyzer <> 'power' GROUP BY ALL ORDER BY ALL"""
    same = "the same findings"
    wait_until(lambda: rows(alone, found) and rows(alone, found) == rows(spread[0], found), same, every_s=POLL_S)
    assert [f[:2] for f in rows(alone, found)] == [["stragglers", "node"]]
    assert all(f[3] == 1 for f in rows(spread[0], found))


def test_an_export_sent_again_to_another_collector_is_stored_once(shards):
    """A client that got no answer from one collector sends the same export to another: the second
    acknowledges it without storing it again, whether the first is alive or killed since."""
    a, b, c = shards.start(3)
    body = trace_body(step_spans("again", 0, range(10), spans_per_step=2))
    assert post(a, "traces", body).status_code == 200
    assert post(b, "traces", body).status_code == 200  # the first is alive: its digest is in the lake
    a.stop(signal.SIGKILL)
    assert post(c, "traces", body).status_code == 200  # and after it died
    assert rows(b, "SELECT count(*), count(DISTINCT step) FROM steps WHERE run_id = 'again'") == [[10, 10]]
