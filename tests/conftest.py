"""The suite's fixtures and hooks: real collectors started as subprocesses on loopback (tests/support/ holds
what the tests share besides fixtures)."""

import os
import sys
from pathlib import Path

import pytest
from hypothesis import settings

from tests.support.collectors import TEST_WORKERS, Collector, free_port


def pytest_collection_modifyitems(items) -> None:
    """Modules marked `long` (real jobs, real waits) run first, so that parallel workers (pytest-xdist,
    one module each at a time) end together rather than one of them starting a long module last; tests
    marked `cuda` run where torch sees a GPU and are skipped, saying so, elsewhere."""
    items.sort(key=lambda item: item.get_closest_marker("long") is None)  # stable: file order otherwise
    cuda = [item for item in items if item.get_closest_marker("cuda")]
    if cuda:
        import torch

        if not torch.cuda.is_available():
            for item in cuda:
                item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU: torch sees none here"))


def pytest_configure(config) -> None:
    Collector.workers = TEST_WORKERS
    # the property tests draw the same examples on every run, on every machine: a run that passes says
    # the same as the last (`HYPOTHESIS_PROFILE=explore` draws new ones, to look for failures)
    settings.register_profile("repeatable", derandomize=True, database=None)
    settings.register_profile("explore", derandomize=False)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "repeatable"))


@pytest.fixture(autouse=True)
def _main_module_restored():
    """Each test leaves `__main__` as it found it. Streamlit's script runner (AppTest) installs the app as
    `__main__` and leaves it there, and a process started by spawn (the store's writer) runs `__main__`'s
    file first: after a dashboard test, a worker's next writer would run the dashboard and die."""
    main = sys.modules["__main__"]
    yield
    sys.modules["__main__"] = main


@pytest.fixture
def collector_factory(tmp_path):
    """Start collectors on fresh ports; all are stopped at teardown."""
    started: list[Collector] = []

    def start(db: Path | None = None, *extra_args: str) -> Collector:
        port = free_port()
        log = open(tmp_path / f"collector-{port}.log", "w")  # noqa: SIM115 - the collector's output; closed at teardown
        c = Collector(db or tmp_path / "rankwatch.duckdb", port, "test-token-0123456", extra_args=extra_args, log=log)
        started.append(c.start())
        return c

    yield start
    for c in started:
        if c.process.poll() is None:
            c.stop()
        c.log.close()


@pytest.fixture
def collector(collector_factory) -> Collector:
    return collector_factory()


@pytest.fixture(scope="module")
def module_collector(tmp_path_factory) -> Collector:
    """One collector for a whole module, for tests that only need answers (fuzzing posts many requests,
    and a fresh collector each would be slow)."""
    directory = tmp_path_factory.mktemp("collector")
    with open(directory / "collector.log", "w") as log:
        c = Collector(directory / "rankwatch.duckdb", free_port(), "test-token-0123456", log=log).start()
        yield c
        if c.process.poll() is None:
            c.stop()


@pytest.fixture(scope="session")
def dashboard_store(tmp_path_factory) -> Path:
    """The dashboard tests' store (tests/support/dashboard_store.py), built once per session: under pytest-xdist by
    the first worker that asks, in the directory the workers share, while the others wait for it."""
    from filelock import FileLock

    from tests.support.dashboard_store import build

    shared = tmp_path_factory.getbasetemp()
    if "PYTEST_XDIST_WORKER" in os.environ:
        shared = shared.parent  # the run's directory, above each worker's own
    built = shared / "dashboard" / "built"
    with FileLock(shared / "dashboard.lock"):
        if not built.exists():
            (shared / "dashboard").mkdir(exist_ok=True)
            built.write_text(str(build(shared / "dashboard")))
    return Path(built.read_text())
