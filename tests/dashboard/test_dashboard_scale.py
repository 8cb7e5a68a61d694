"""Every dashboard page at job scale: one simulated run of 1,024 ranks (bench/dashboard.py's store,
bulk-filled from the fleet simulator's model: a straggler and a GPU throttled from the start, two
all-reduces and three device readings per rank-step, findings drawn by the post-mortem analyzers).
Each page renders in Streamlit's AppTest with no exception and every query answering, draws no
chart empty, and bounds what it sends the browser however many ranks there are: the heatmap's
cells and the per-rank charts' bars are binned (dashboard/ui.py RANK_BINS, STEP_BINS)."""

import functools
import sys
from pathlib import Path

import pytest
import streamlit as st
from streamlit.testing.v1 import AppTest

from bench.dashboard import RUN, fill
from dashboard import ui
from dashboard.source import DB_ENV
from tests.support.dashboard_pages import APP, PAGES, chart, drawn, reading, texts

RANKS, STEPS, TP = 1024, 40, 8
STRAGGLER = RANKS // 3  # bench/dashboard.py's straggler, 1.3x slow from a quarter of the run


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    db = tmp_path_factory.mktemp("scale") / "rankwatch.duckdb"
    fill(db, RANKS, STEPS, TP)
    return db


@pytest.fixture(scope="module")
def page(store):
    """Each page of the run, rendered once for the module: the tests only read what it shows."""
    with pytest.MonkeyPatch.context() as monkeypatch:

        @functools.cache
        def rendered(name: str) -> AppTest:
            reading(monkeypatch, store)  # the source cached in this process may be another store's by now
            at = AppTest.from_file(str(APP), default_timeout=120)
            at.query_params["run"] = RUN
            at.switch_page(f"views/{name}.py").run()
            assert not at.exception, [e.value for e in at.exception]
            assert not [e for e in texts(at.error) if e.startswith("Query ")]
            return at

        yield rendered


@pytest.mark.parametrize("name", PAGES)
def test_every_page_renders_at_1024_ranks_with_no_empty_chart(page, name):
    at = page(name)
    assert len(at.title) == 1
    for element in at.get("vega_lite_chart"):
        spec, data = chart(element)
        assert len(data) > 0, spec.get("title")
        assert len(data) <= ui.RANK_BINS * ui.STEP_BINS * 4  # binned, not a row per rank-step


def test_stragglers_at_1024_ranks_bins_the_heatmap_and_keeps_the_straggler_visible(page):
    at = page("stragglers")
    (cells,) = drawn(at, "rect")
    assert len(cells) <= ui.RANK_BINS * ui.STEP_BINS and cells["rank_hi"].max() >= RANKS - 1
    assert STRAGGLER in set(cells["worst_rank"])  # a bin shows its worst rank: one slow rank stays visible
    assert STRAGGLER in set(at.dataframe[0].value["rank"].head(3))
    assert any(f"rank {STRAGGLER}" in t or f"ranks {STRAGGLER}" in t for t in texts(at.markdown))


def test_ranks_and_nodes_at_1024_ranks_lists_every_rank_and_node(page):
    at = page("ranks")
    nodes, ranks = (frame.value for frame in at.dataframe)
    assert len(ranks) == RANKS and len(nodes) == RANKS // TP


def test_the_dashboard_bench_runs_every_named_query_and_page(monkeypatch, capsys):
    """bench/dashboard.py, small, each query and page timed once, in this process (its imports are this
    process's): each named query gets the parameters its SQL names and every page renders (a bench that no
    longer runs is a defect: a page or a query parameter added later is caught here)."""
    import bench.dashboard as bench
    from dashboard import queries

    monkeypatch.setattr(bench, "REPEATS", 1)
    monkeypatch.setattr(sys, "argv", ["bench/dashboard.py", "--ranks", "8", "--steps", "20", "--tp", "2", "--no-api"])
    monkeypatch.setenv(DB_ENV, "")  # the bench points the dashboard at its own store; this environment comes back
    st.cache_resource.clear()  # the dashboard's source is then the bench's store, not one a test opened before
    st.cache_data.clear()
    bench.main()
    assert set(bench.PAGES) == set(PAGES)
    rows = {line.split("│")[1].strip() for line in capsys.readouterr().out.splitlines() if line.count("│") >= 3}
    assert set(queries.QUERIES) | set(PAGES) <= rows
