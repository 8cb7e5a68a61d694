"""The dashboard's pages as Streamlit's AppTest runs them, and what they show."""

import functools
import json
import re
from pathlib import Path

import pandas as pd
import pyarrow as pa
import streamlit as st
from streamlit.testing.v1 import AppTest

from dashboard.source import COLLECTOR_ENV, DB_ENV
from tests.support.paths import DASHBOARD_APP

APP = DASHBOARD_APP

PAGES = ("overview", "stragglers", "ranks", "collectives", "checkpoints", "hangs", "tiers", "power", "compare", "sql")


def _scan_components_once() -> None:
    """Each AppTest scans every installed distribution's metadata for Streamlit components on its first
    run (a sixth of a second of CPU, for each of the hundreds of pages the tests open), where a served
    dashboard scans once as it starts: the distributions do not change while the tests run, so the
    scan's answer is kept."""
    try:
        from streamlit.components.v2 import manifest_scanner
    except ImportError:  # a Streamlit without components v2 scans nothing
        return
    manifest_scanner.scan_component_manifests = functools.cache(manifest_scanner.scan_component_manifests)


_scan_components_once()


def open_page(page: str, run: str) -> AppTest:
    """The page of `run` after one full script run (a link to it, `?run=ID`), with no exception."""
    at = AppTest.from_file(str(APP), default_timeout=60)
    at.query_params["run"] = run
    at.switch_page(f"views/{page}.py").run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def shown(markdown: str) -> str:
    """Markdown's text as a person reads it: each backslash-escaped character as itself (stored text is
    shown escaped, ui.literal)."""
    return re.sub(r"\\([!-/:-@\[-`{-~])", r"\1", markdown)


def texts(elements) -> list[str]:
    return [shown(e.value) for e in elements]


def chart(element) -> tuple[dict, pd.DataFrame]:
    """A chart's Vega-Lite spec and the one data set it draws (Arrow IPC beside the spec)."""
    (dataset,) = element.proto.datasets
    return json.loads(element.proto.spec), pa.ipc.open_stream(dataset.data.data).read_pandas()


def reading(monkeypatch, db: Path) -> None:
    """This process's dashboard reads the store file `db` (as `rankwatch dashboard --db`). Its source
    and its data are cached per process, and an earlier test of the same worker may have opened
    another store: both are dropped."""
    monkeypatch.setenv(DB_ENV, str(db))
    monkeypatch.delenv(COLLECTOR_ENV, raising=False)
    st.cache_resource.clear()
    st.cache_data.clear()


def drawn(at: AppTest, mark: str) -> list[pd.DataFrame]:
    """The data of each chart of `mark` (bar, rect, line) on the page."""
    found = [chart(c) for c in at.get("vega_lite_chart")]
    return [data for spec, data in found if (spec.get("mark") or spec["layer"][0]["mark"])["type"] == mark]
