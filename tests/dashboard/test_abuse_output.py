"""Abuse: what a client's strings do where rankwatch shows them.

A run id carrying a terminal escape, a line break with a forged log line after it, U+202E and Markdown
(a link, an image, a bare address), and a host name carrying a link, sent through a real collector:
`rankwatch query` prints the run id on one line, escaped, as a table and as CSV, and exactly as stored
as JSON; an error quoting it is one escaped line; `rankwatch analyze` heads its report with it escaped;
the dashboard's title, the error a link to an unknown run shows and the link to a slow node's ranks
show their text as written, making no link or image; a log record quoting it, and an exception's text
quoting it, cannot start a line of the log of its own.
"""

import csv
import html
import io
import json
import logging
import re
import time
from pathlib import Path

import pytest
import streamlit as st
from markdown_it import MarkdownIt
from streamlit.testing.v1 import AppTest

from collector.printable import TRACEBACK_INDENT, EscapedRecord, escape_logs, printable
from dashboard.source import COLLECTOR_ENV, DB_ENV
from rankwatch.agent import semconv as sc
from rankwatch.agent.export import Exporter
from tests.support.collectors import Collector, free_port
from tests.support.commands import rankwatch_in_process
from tests.support.engine_jobs import send_steps
from tests.support.paths import ROOT

pytestmark = pytest.mark.long  # a real collector, and the dashboard's pages

APP = ROOT / "dashboard" / "app.py"
EVIL_RUN = (
    "run\x1b[2J\n[rankwatch] forged line \u202eevil [a link](https://evil.example) "
    "![an image](https://evil.example/i.png) www.evil.example"
)
EVIL_HOST = "node [a link](https://evil.example)"
RANKS, SLOW_RANK = 4, 3  # the slow rank runs on EVIL_HOST
RAW = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")  # what no output may hold (but \n)
WIDE = {"COLUMNS": "400"}  # rich's tables as wide as the run id, so that it is not folded over lines


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    """A store holding EVIL_RUN's steps, sent by 4 ranks' agents (the slow one on EVIL_HOST) to a real
    collector, since stopped."""
    directory = tmp_path_factory.mktemp("output")
    db = directory / "rankwatch.duckdb"
    with open(directory / "collector.log", "w") as log:
        collector = Collector(db, free_port(), "test-token-0123456", ("--workers", "0"), log=log).start()
        try:
            sending = {
                rank: Exporter(
                    collector.url,
                    collector.token,
                    {
                        sc.RUN_ID: EVIL_RUN,
                        sc.RANK: rank,
                        sc.WORLD_SIZE: RANKS,
                        sc.HOST_NAME: EVIL_HOST if rank == SLOW_RANK else "node-0",
                    },
                )
                for rank in range(RANKS)
            }
            send_steps(
                sending,
                range(20),
                time.time_ns() - 10**10,
                compute=lambda rank, step: 0.12 if rank == SLOW_RANK else 0.08,
            )
            for exporter in sending.values():
                exporter.shutdown()
        finally:
            collector.stop()
    return db


def query(store: Path, sql: str, *args: str):
    return rankwatch_in_process("query", sql, "--db", str(store), *args, env=WIDE)


def test_query_prints_a_run_id_on_one_escaped_line_as_a_table_and_csv_and_as_stored_as_json(store):
    sql = "SELECT DISTINCT run_id FROM steps"
    table = query(store, sql)
    assert table.returncode == 0, table.stderr
    assert printable(EVIL_RUN) in table.stdout and not RAW.search(table.stdout), repr(table.stdout)
    as_csv = query(store, sql, "--format", "csv")
    assert list(csv.reader(io.StringIO(as_csv.stdout))) == [["run_id"], [printable(EVIL_RUN)]]
    assert as_csv.stdout.count("\n") == 2  # a header and a row
    as_json = query(store, sql, "--format", "json")
    assert json.loads(as_json.stdout) == [{"run_id": EVIL_RUN}] and as_json.stdout.isascii()


def test_an_error_quoting_a_stored_value_is_one_escaped_line_and_duckdbs_pointer(store):
    """DuckDB's reason quotes the value it could not convert: the run id, escapes and all, on the error's one
    line; what follows is DuckDB's pointer to the place in the query (LINE and a caret), nothing a value wrote."""
    refused = query(store, "SELECT CAST(run_id AS INTEGER) FROM steps")
    assert refused.returncode == 2 and refused.stderr.startswith("rankwatch: error: ")
    reason, *pointer = refused.stderr.splitlines()
    assert not RAW.search(refused.stderr), repr(refused.stderr)
    assert printable(EVIL_RUN) in reason
    assert pointer == ["LINE 1: SELECT CAST(run_id AS INTEGER) FROM steps", " " * 15 + "^"], pointer


def test_analyze_heads_its_report_with_the_run_id_escaped(store):
    report = rankwatch_in_process("analyze", EVIL_RUN, "--db", str(store), env=WIDE)
    assert report.returncode == 0, report.stderr
    assert report.stdout.startswith(f"run {printable(EVIL_RUN)}: ") and not RAW.search(report.stdout)


def read_as_markdown(source: str) -> str:
    """The text `source` shows as Markdown, asserting it makes no link or image: no address in it is left
    for GitHub-flavoured Markdown to link by itself either."""
    rendered = MarkdownIt("commonmark").render(source)
    assert "<a " not in rendered and "<img " not in rendered, rendered
    assert "://" not in source and "www." not in source, source
    return html.unescape(re.sub(r"<[^>]+>", "", rendered)).strip()


@pytest.fixture
def dashboard(store, monkeypatch) -> AppTest:
    """The dashboard reading the store (as `rankwatch dashboard --db`), its caches of other stores dropped."""
    monkeypatch.setenv(DB_ENV, str(store))
    monkeypatch.delenv(COLLECTOR_ENV, raising=False)
    st.cache_resource.clear()
    st.cache_data.clear()
    return AppTest.from_file(str(APP), default_timeout=60)


def test_the_dashboards_title_shows_a_run_id_as_written(dashboard):
    dashboard.run()
    dashboard.selectbox(key="run").set_value(EVIL_RUN).run()
    assert not dashboard.exception, [e.value for e in dashboard.exception]
    (title,) = dashboard.title
    assert read_as_markdown(title.value) == f"Run {printable(EVIL_RUN)}"


def test_a_link_to_an_unknown_run_shows_its_id_as_written(dashboard):
    linked = "no [such](https://evil.example) run\u202e"
    dashboard.query_params["run"] = linked
    dashboard.run()
    (error,) = dashboard.main.error
    assert read_as_markdown(error.value).startswith(f"Run {printable(linked)} is unknown: ")


def test_the_link_to_a_slow_nodes_ranks_shows_its_host_name_as_written(dashboard):
    dashboard.run()
    dashboard.selectbox(key="run").set_value(EVIL_RUN)
    dashboard.switch_page("views/ranks.py").run()
    assert not dashboard.exception, [e.value for e in dashboard.exception]
    (link,) = [p for p in dashboard.page_link if p.proto.page == "stragglers"]
    assert read_as_markdown(link.value) == f"See the heatmap rows of {EVIL_HOST}'s ranks"


def test_a_log_record_quoting_a_client_value_cannot_pass_for_a_record_of_its_own():
    """The record and the exception it logs both quote the run id: the record is one line at the margin,
    every line of its traceback (the exception's text too) indented under it, none holding a control
    character."""
    escape_logs()  # as each of the collector's processes and the `rankwatch` command do first
    written = io.StringIO()
    handler = logging.StreamHandler(written)
    log = logging.getLogger("rankwatch.analysis")
    log.addHandler(handler)
    try:
        try:
            raise ValueError(f"no such run: {EVIL_RUN}")
        except ValueError:
            log.exception("analysis of run %s failed", EVIL_RUN)
    finally:
        log.removeHandler(handler)
    first, *traceback = written.getvalue().splitlines()
    assert first == f"analysis of run {printable(EVIL_RUN)} failed"
    assert traceback and all(line.startswith(TRACEBACK_INDENT) for line in traceback), traceback
    said = f"ValueError: no such run: {EVIL_RUN}".split("\n")  # the exception's own line break stays, indented
    assert traceback[-len(said) :] == [TRACEBACK_INDENT + printable(line) for line in said]
    assert not RAW.search(written.getvalue()) and logging.getLogRecordFactory() is EscapedRecord
