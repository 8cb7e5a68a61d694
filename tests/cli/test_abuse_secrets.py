"""Abuse: secrets and what a local user or a terminal sees.

Covered: an empty or short token (a crash between creating and writing the token file leaves one)
stops the collector at start in one line, and no client sends it; an empty presented token never
passes, whatever the collector was given; `--token-file` keeps the token out of `ps`; a password for
the lake's catalog is refused in every form of --lake, in one line that does not show it; a receiver
without a name, whose URL holds a secret, is labelled without it on /metrics and in the log; every
file and directory the collector creates is its owner's only; control characters in a stored run id
reach `rankwatch query`'s output escaped.
"""

import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from starlette.requests import Request

from collector.receive.auth import Tokens, load_or_create_token
from rankwatch.agent import semconv as sc
from rankwatch.agent.config import SCOPES
from rankwatch.agent.export import Exporter
from rankwatch.launch import wait_healthy
from tests.support import loopback
from tests.support.collectors import free_port
from tests.support.commands import rankwatch_in_process
from tests.support.straggler_steps import MS, alerts_pending, send_straggler_steps
from tests.support.waits import wait_until

SECRET_PATH = "T0SECRET/B0SECRET/xoxoSECRETSECRET"
EVIL_RUN = "run\x1b[2J\x1b]0;owned\x07\x9b31m-x"


def _start_collector(db: Path, *args: str, log) -> subprocess.Popen:
    """`rankwatch collector`, as a user starts it; stopped by the caller."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "rankwatch", "collector", "--db", str(db), "--port", str(port), *args],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    process.url = f"http://127.0.0.1:{port}"  # type: ignore[attr-defined]
    return process


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """One collector on a data directory it creates, its token given by --token-file, an alert receiver
    without a name whose URL (a port nobody listens on) holds a secret; a straggler run and a run whose id
    carries terminal escapes sent to it, the straggler's alert pending."""
    tmp = tmp_path_factory.mktemp("secrets")
    token_file = tmp / "token.txt"
    token_file.write_text("a-token-from-a-file-0123456789\n")
    alerts = tmp / "alerts.toml"
    alerts.write_text(
        f'backoff_initial_s = 0.2\nbackoff_max_s = 0.5\n[[receivers]]\nurl = "http://127.0.0.1:{free_port()}/{SECRET_PATH}"\n'
    )
    db = tmp / "data" / "rankwatch.duckdb"
    log_path = tmp / "collector.log"
    with open(log_path, "w") as log:
        process = _start_collector(
            db,
            "--token-file",
            str(token_file),
            "--alerts",
            str(alerts),
            "--analyze-every",
            "0.5",
            "--workers",
            "0",
            log=log,
        )
        try:
            wait_healthy(process.url, process)
            token = token_file.read_text().strip()
            exporters = {r: Exporter(process.url, token, {sc.RUN_ID: "run-secret", sc.RANK: r}) for r in range(6)}
            exporters[6] = Exporter(process.url, token, {sc.RUN_ID: EVIL_RUN, sc.RANK: 0})
            send_straggler_steps(exporters, range(30), time.time_ns() - 30_000 * MS, slow_rank=2)
            wait_until(lambda: alerts_pending(process) >= 1, "the straggler's alert was never queued")
            wait_until(lambda: "alert delivery to" in log_path.read_text(), "no failed delivery logged")
            yield process, token, db, log_path
        finally:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=60)


@pytest.mark.parametrize("how", ["empty-file", "short-option"])
def test_an_empty_or_short_token_stops_the_collector_in_one_line(tmp_path, how):
    """An empty token file is what a crash between creating and writing it leaves: today it lets
    `Authorization: Bearer ` in."""
    (tmp_path / "token").write_text("")
    with open(tmp_path / "collector.log", "w") as log:
        process = _start_collector(
            tmp_path / "rankwatch.duckdb", *(["--token", "x"] * (how == "short-option")), log=log
        )
        try:
            status = process.wait(timeout=60)  # today's collector serves on: the wait runs out
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
    output = (tmp_path / "collector.log").read_text()
    assert status == 2 and output.count("\n") == 1 and "token" in output and "at least 16" in output, output


@pytest.mark.parametrize("header", ["Bearer ", "Bearer", "bearer    "])
def test_an_empty_presented_token_never_passes_even_against_an_empty_token(header):
    request = Request({"type": "http", "headers": [(b"authorization", header.encode())]})
    for token in ("", "a-real-token-0123456789"):
        assert all(Tokens(token).refusal(request, scope) is not None for scope in SCOPES)


def test_a_client_refuses_an_empty_token_file_rather_than_send_it(live, tmp_path):
    process, *_ = live
    (tmp_path / "token").write_text("")
    env = {"RANKWATCH_DB": str(tmp_path / "rankwatch.duckdb"), "RANKWATCH_TOKEN": ""}
    for args in (
        ("query", "SELECT 1", "--collector", process.url),
        ("query", "SELECT 1", "--collector", process.url, "--token-file", str(tmp_path / "token")),
        ("power", "apply", "run-secret", "--watts", "300", "--collector", process.url),
    ):
        result = rankwatch_in_process(*args, env=env)
        assert result.returncode == 2 and result.stderr.count("\n") == 1, (args, result.stderr)
        assert f"the token in {tmp_path / 'token'} is empty" in result.stderr, (args, result.stderr)


def test_the_token_is_written_whole_and_owner_only(tmp_path):
    data = tmp_path / "data"
    token = load_or_create_token(data)
    assert len(token) >= 16 and load_or_create_token(data) == token
    assert sorted(os.listdir(data)) == ["token"]  # no temporary file left behind
    assert stat.S_IMODE((data / "token").stat().st_mode) == 0o600
    assert stat.S_IMODE(data.stat().st_mode) == 0o700


def test_a_made_token_is_named_and_never_read_as_an_option(tmp_path):
    """A token the collector makes starts with its prefix, for secret scanners, and so never with "-",
    which `--token -x...` on a command line would take for an option (1 start in 64 failed so)."""
    tokens = [load_or_create_token(tmp_path / str(n)) for n in range(200)]
    assert all(t.startswith("rw_") and len(t) > 40 for t in tokens) and len(set(tokens)) == 200


def test_a_token_file_keeps_the_token_out_of_ps_and_works(live, tmp_path):
    process, token, *_ = live
    assert token.encode() not in Path(f"/proc/{process.pid}/cmdline").read_bytes()
    headers = {"Authorization": f"Bearer {token}"}
    assert loopback.post(
        f"{process.url}/api/v1/query", json={"sql": "SELECT 1"}, headers=headers, timeout=30
    ).is_success
    (tmp_path / "t").write_text(token)
    result = rankwatch_in_process(
        "query", "SELECT 41 + 1 AS x", "--collector", process.url, "--token-file", str(tmp_path / "t")
    )
    assert result.returncode == 0 and "42" in result.stdout, result.stderr


@pytest.mark.parametrize(
    "catalog",
    [
        "postgresql://rankwatch:{password}@127.0.0.1:{port}/rankwatch",
        "postgres://rankwatch@127.0.0.1:{port}/rankwatch?connect_timeout=2&password={password}",
        "postgresql://127.0.0.1:{port}/rankwatch?user=rankwatch&pass%77ord={password}",
        "host=127.0.0.1 port={port} dbname=rankwatch user=rankwatch sslpassword={password}",
    ],
)
def test_a_catalog_password_in_any_form_of_lake_is_refused_unseen(tmp_path, catalog):
    """A password in --lake shows in `ps`, in the collector's log and in every error naming the catalog:
    refused before anything connects, in one line that names it without showing it (the URI form
    passed the check, then its password was in the message saying the lake could not be opened)."""
    password = "hunter2-0f3c9a"
    given = catalog.format(password=password, port=free_port())
    result = subprocess.run(
        [sys.executable, "-m", "rankwatch", "collector", "--db", str(tmp_path / "rankwatch.duckdb"), "--port",
         str(free_port()), "--lake", given, "--data-path", str(tmp_path / "lake")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    said = result.stdout + result.stderr
    assert result.returncode == 2 and said.count("\n") == 1, said
    assert said.startswith("rankwatch: error: keep the catalog's") and password not in said, said


def test_a_receiver_url_appears_neither_on_metrics_nor_in_the_log(live):
    process, _, _, log_path = live
    page = loopback.get(f"{process.url}/metrics", timeout=30).text
    assert 'rankwatch_collector_alerts_pending{receiver="webhook-' in page
    for text in (page, log_path.read_text()):
        assert "SECRET" not in text


def test_everything_the_collector_creates_is_owner_only(live):
    _, _, db, _ = live
    found = [db.parent, *db.parent.rglob("*")]
    assert {p.name for p in found} >= {"data", "rankwatch.duckdb", "sql-files"}
    wide = {str(p): oct(stat.S_IMODE(p.lstat().st_mode)) for p in found if p.lstat().st_mode & 0o077}
    assert not wide


@pytest.mark.parametrize("fmt", ["table", "csv"])  # JSON escapes them itself
def test_control_characters_in_a_run_id_reach_the_terminal_escaped(live, tmp_path, fmt):
    process, token, *_ = live
    (tmp_path / "t").write_text(token)
    result = rankwatch_in_process(
        "query",
        "SELECT DISTINCT run_id FROM steps WHERE run_id LIKE 'run_%-x' ORDER BY ALL",
        "--collector",
        process.url,
        "--token-file",
        str(tmp_path / "t"),
        "--format",
        fmt,
    )
    assert result.returncode == 0, result.stderr
    assert "owned" in result.stdout  # the row is there, its escapes written out
    assert not any(c in result.stdout for c in "\x1b\x07\x9b"), repr(result.stdout)
