"""Reading a store costs only opening it: `rankwatch query --db` and the dashboard's modules load neither
the OpenTelemetry SDK nor the analysis (each run in a fresh interpreter, its sys.modules read after a real
query), and the store package is layered: its bottom module imports nothing of the collector but the
schema, and no module of it imports the analysis or the alert delivery that its writer runs."""

import json
import subprocess
import sys

from collector.store.db import connect, create_tables
from tests.support.import_graph import module_imports, project_modules

# What a reader of a store file must not pay for: the agent's exporter and the analysis.
HEAVY = ("opentelemetry.sdk", "collector.analysis")

_LOADED = """
import json, sys
heavy = sorted(m for m in sys.modules if any(m == h or m.startswith(h + ".") for h in {heavy!r}))
print(json.dumps(heavy))
"""


def _run(script: str, heavy: tuple[str, ...] = HEAVY) -> list[str]:
    """The lines the script printed, the last one the `heavy` modules it loaded; it must exit 0."""
    done = subprocess.run(
        [sys.executable, "-c", script + _LOADED.format(heavy=heavy)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()


def _store(tmp_path):
    db = tmp_path / "store.duckdb"
    con = connect(db)
    create_tables(con)
    con.execute("INSERT INTO runs VALUES ('run-a', 2, now())")
    con.close()
    return db


def test_rankwatch_query_db_loads_neither_the_sdk_nor_the_analysis(tmp_path):
    db = _store(tmp_path)
    *printed, loaded = _run(f"""
from rankwatch.cli import main
main(["query", "SELECT run_id, world_size FROM runs", "--db", {str(db)!r}, "--format", "json"])
""")
    assert json.loads(printed[0]) == [{"run_id": "run-a", "world_size": 2}]
    assert json.loads(loaded) == []


def test_the_dashboard_loads_neither_the_sdk_nor_the_analysis(tmp_path):
    """Every module a page reads the store through (the views and app.py are Streamlit scripts, run by
    `streamlit run` on these), with the file source `rankwatch dashboard --db` picks, queried."""
    db = _store(tmp_path)
    *printed, loaded = _run(f"""
import os
os.environ["RANKWATCH_DASHBOARD_DB"] = {str(db)!r}
import dashboard.charts, dashboard.queries, dashboard.ui
from dashboard import source
print(source.to_frame(source.from_environment().query("SELECT run_id FROM runs"))["run_id"].tolist())
""")
    assert printed[-1] == "['run-a']"
    assert json.loads(loaded) == []


def test_the_store_is_layered():
    modules = project_modules()
    store = {
        name: module_imports(name, path, modules)
        for name, path in modules.items()
        if name.startswith("collector.store")
    }
    assert {
        "collector.store.db",
        "collector.store.requests",
        "collector.store.writer",
        "collector.store.handle",
    } <= set(store)
    assert store["collector.store.db"] <= {"collector.store.schema"}
    assert store["collector.store.requests"] == set()
    for name, imported in store.items():
        assert not {m for m in imported if m.startswith(("collector.analysis", "collector.alerts"))}, name


def test_the_collector_loads_no_sdk():
    """The collector receives OTLP and exports none: the agent's SDK is the training side's, and a collector
    process (and each writer and decoder it spawns) would pay for it at every start."""
    (loaded,) = _run(
        "import collector.server, collector.store.writer, collector.receive.ingest", ("opentelemetry.sdk",)
    )
    assert json.loads(loaded) == []
