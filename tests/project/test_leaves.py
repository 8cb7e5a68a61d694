"""What is shared lives in leaves: the wire names (rankwatch/agent/semconv.py), the GPU power model
(rankwatch/agent/gpumodel.py), the files' places (rankwatch/agent/paths.py) and the client of the collector's APIs
(rankwatch/agent/apiclient.py) each import alone, with the standard library only, so the collector, the
dashboard, the importers and a training host read them without the OpenTelemetry SDK, torch,
duckdb or numpy. The agent package imports lazily, and `import agent; agent.init()` still works. The
collector's server process imports no analysis: its writer builds it (collector/writertasks.py).

Covered too: the SQL JSON paths built from the names read the attributes DuckDB stores; the fleet
simulator plays the model's figures, not copies of an H100's; the store, its token and the
checkpoints are found where paths.py says, by every part."""

import json
import subprocess
import sys
from pathlib import Path

import duckdb
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rankwatch.agent import config, paths
from rankwatch.agent import semconv as sc
from rankwatch.agent.gpumodel import THERMAL, GpuModel
from trainer import simulate
from trainer.faults import parse

LEAVES = ("rankwatch.agent.semconv", "rankwatch.agent.gpumodel", "rankwatch.agent.paths", "rankwatch.agent.apiclient")

# what importing `module` loads beyond the interpreter's start-up: (module names, seconds)
_LOADS = """
import json, sys, time
before = set(sys.modules)
start = time.perf_counter()
import {module}
print(json.dumps([sorted(set(sys.modules) - before), time.perf_counter() - start]))
"""


def _loads(module: str) -> list[str]:
    r = subprocess.run(
        [sys.executable, "-c", _LOADS.format(module=module)], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)[0]


@pytest.mark.parametrize("module", LEAVES)
def test_a_leaf_imports_alone_with_the_standard_library(module):
    loaded = _loads(module)
    assert module in loaded
    outside = [
        m
        for m in loaded
        if m.partition(".")[0] not in sys.stdlib_module_names
        and m not in ("rankwatch", "rankwatch.agent")
        and not m.startswith("rankwatch.agent.")
    ]
    assert outside == []  # no opentelemetry, torch, duckdb, numpy, httpx, collector...
    assert {m for m in loaded if m.startswith("rankwatch")} <= {
        "rankwatch",
        "rankwatch.agent",
        "rankwatch.agent.config",
        "rankwatch.agent.paths",
        "rankwatch.agent.semconv",
        module,
    }


def test_the_agent_package_imports_lazily_and_init_still_works():
    script = """
import sys, agent
assert "opentelemetry.sdk" not in sys.modules and "rankwatch.agent.session" not in sys.modules, "eager import"
agent.init(run_id="r", collector="http://127.0.0.1:9", token="t", rank=0, world_size=1, cuda=False)
with agent.step(0):
    with agent.phase("forward"):
        pass
agent.shutdown()
print("opentelemetry.sdk" in sys.modules)
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "True"  # init() brought the session and its SDK in


def test_the_collectors_server_imports_no_analysis_and_its_writer_builds_the_tasks_the_config_sets():
    script = """
import pickle, sys
from pathlib import Path
import collector.server
from collector.config import Config
from collector.writertasks import WriterTasks
heavy = sorted(m for m in sys.modules if m == "pandas" or m.startswith(("collector.analysis.", "collector.predict")))
assert heavy == ["collector.analysis.healthcounters", "collector.analysis.stacks"], heavy  # requests, a pure merge
tasks = pickle.loads(pickle.dumps(WriterTasks(Config(db=Path("x.duckdb"), hang_after_s=7.0))))()  # as a writer
analysis = tasks[0]
print(sorted(type(t).__name__ for t in tasks), analysis.engine.settings["hangs"].floor_s, "pandas" in sys.modules)
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["['Analysis',", "'Delivery',", "'Upkeep']", "7.0", "True"]


ATTRIBUTES = sorted({v for k, v in vars(sc).items() if k.isupper() and isinstance(v, str) and "." in v})


@settings(max_examples=40, deadline=None)
@given(name=st.sampled_from(ATTRIBUTES), value=st.text(max_size=20))
def test_a_json_path_reads_the_attribute_duckdb_stores(name, value):
    """Attribute names have dots, which a bare path would read as nesting; the path quotes them."""
    nested = "nested"  # what a path that read the dots as nesting would find
    for part in reversed(name.split(".")):
        nested = {part: nested}
    attrs = json.dumps({**nested, name: value})
    con = duckdb.connect()
    assert con.execute(f"SELECT ?::JSON->>{sc.json_path(name)}", [attrs]).fetchone() == (value,)


def test_a_json_path_is_refused_for_a_name_it_cannot_quote():
    for name in ("a'b", 'a"b', "a\\b"):
        with pytest.raises(ValueError):
            sc.json_path(name)


def _compute(gpu: GpuModel, faults: list[str] = ()) -> np.ndarray:
    frames = simulate.steps(simulate.Topology(dp=4), 3, [parse(f) for f in faults], seed=5, start_ns=0, gpu=gpu)
    return np.concatenate(
        [f[["compute_s", "sm_clock_mhz", "temp_c", "clock_event_reasons"]].to_numpy() for f in frames]
    )


def test_the_simulator_plays_the_gpu_models_figures():
    """An A100-like GPU (1410 MHz at most, throttled to 1100 MHz at 92 C): compute is not stretched
    by an H100's clock, and a thermal fault shows the model's throttled clock and temperature."""
    h100, a100 = GpuModel(), GpuModel(clock_max_mhz=1410.0, thermal_clock_mhz=1100.0, thermal_c=92.0)
    assert np.allclose(_compute(a100)[:, 0], _compute(h100)[:, 0])  # the same draws at full clock
    throttled = _compute(a100, ["thermal:rank=1"]).reshape(3, 4, 4)[:, 1]
    assert np.allclose(throttled[:, 1:], [[1100.0, 92.0, THERMAL]] * 3)
    assert np.allclose(throttled[:, 0] / _compute(a100).reshape(3, 4, 4)[:, 1, 0], 1410.0 / 1100.0)


def test_the_simulators_samples_carry_the_gpu_models_limits():
    gpu = GpuModel(limit_min_w=100.0, limit_max_w=400.0, max_w=400.0)
    (frame,) = simulate.steps(simulate.Topology(dp=2), 1, [], start_ns=0, gpu=gpu)
    samples = simulate.device_samples(frame, gpu=gpu)
    limits = samples[samples["metric"].isin([sc.POWER_LIMIT_MIN_W, sc.POWER_LIMIT_MAX_W, sc.POWER_LIMIT_W])]
    assert sorted(limits.groupby("metric")["value"].unique().map(list).items()) == [
        (sc.POWER_LIMIT_W, [400.0]),
        (sc.POWER_LIMIT_MAX_W, [400.0]),
        (sc.POWER_LIMIT_MIN_W, [100.0]),
    ]


def test_the_store_and_what_lives_beside_it(tmp_path, monkeypatch):
    from collector.alerts.config import default_path
    from collector.config import Config
    from collector.store.readonly import files_dir

    monkeypatch.delenv(paths.DB_ENV, raising=False)
    monkeypatch.delenv("RANKWATCH_TOKEN", raising=False)
    assert paths.store_path() == paths.DEFAULT_DB == Config().db
    store = tmp_path / "data" / "store.duckdb"
    monkeypatch.setenv(paths.DB_ENV, str(store))
    assert paths.store_path() == store and paths.store_path("x.duckdb") == Path("x.duckdb")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / paths.TOKEN_FILE).write_text("secret-0123456789\n")
    assert config.token() == "secret-0123456789"  # a rank finds the token beside $RANKWATCH_DB's store
    assert default_path(store) == store.parent / "alerts.toml"
    assert files_dir(store.parent) == store.parent / "sql-files"
    assert paths.checkpoint_dir(store, "r1") == store.parent / "runs" / "r1" / "checkpoints"
