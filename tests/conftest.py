"""Shared fixtures: real collectors started as subprocesses on loopback."""

import contextlib
import gc
import importlib
import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest
from hypothesis import settings

from rankwatch.launch import wait_healthy


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(condition: Callable[[], object], what: str, timeout_s: float = 30.0) -> None:
    """Poll `condition` until it holds: what a background thread or process does takes as long as a
    loaded machine makes it take, so a test waits for it rather than sleeping a fixed time."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} (after {timeout_s:.0f} s)"
        time.sleep(0.05)


# Decode processes of a test's collector, unless it asks for some (`--workers`): decoding in a thread is
# the collector's own `--workers 0`, and each decode process costs about 0.7 s of CPU to start, which
# over a hundred collectors was an eighth of the suite's CPU. The tests of decode processes and of what
# ends with them (floods, kill -9, the decoders) ask for them; the benches, which start collectors with
# this class too, keep the collector's default.
TEST_WORKERS = ("--workers", "0")


def pytest_configure(config) -> None:
    for module in ("conftest", "tests.conftest"):  # pytest loads this file as the first, tests import both
        importlib.import_module(module).Collector.workers = TEST_WORKERS
    # the property tests draw the same examples on every run, on every machine: a run that passes says
    # the same as the last (`HYPOTHESIS_PROFILE=explore` draws new ones, to look for failures)
    settings.register_profile("repeatable", derandomize=True, database=None)
    settings.register_profile("explore", derandomize=False)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "repeatable"))


@dataclass
class Collector:
    """A `rankwatch collector` process and how to reach it."""

    workers: ClassVar[tuple[str, ...]] = ()  # decode processes unless `extra_args` says: the collector's default

    db: Path
    port: int
    token: str
    process: subprocess.Popen | None = None
    extra_args: tuple[str, ...] = ()
    log: object = None  # the collector's output, kept for a failing test's report

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    def start(self) -> "Collector":
        """Start it and wait until it answers; where its port was taken meanwhile (free_port's port is
        free when chosen, and another test's connection may take it before the collector binds it),
        again on another port."""
        for attempts_left in (2, 1, 0):
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "rankwatch",
                    "collector",
                    "--db",
                    str(self.db),
                    "--port",
                    str(self.port),
                    f"--token={self.token}",  # a token of the user's own may start with "-"
                    *(() if "--workers" in self.extra_args else self.workers),
                    *self.extra_args,
                ],
                stdout=self.log,
                stderr=subprocess.STDOUT,
            )
            try:
                wait_healthy(self.url, self.process)
                break
            except RuntimeError:
                if not attempts_left or not self._port_was_taken():
                    raise
                self.port = free_port()
        return self

    def _port_was_taken(self) -> bool:
        """Whether the collector exited because something else listens on its port (its log says so)."""
        name = getattr(self.log, "name", None)
        return (
            self.process is not None
            and self.process.returncode == 2
            and isinstance(name, str)
            and "Address already in use" in Path(name).read_text()
        )

    def stop(self, sig: int = signal.SIGTERM) -> int:
        """Stop the process (SIGTERM drains; SIGKILL simulates a crash); returns its exit status."""
        self.process.send_signal(sig)
        return self.process.wait(timeout=60)


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


@contextlib.contextmanager
def job_collector(directory: Path, *extra_args: str):
    """A collector on a store in `directory` (its log beside it) for a module's job, stopped after it,
    so that the store can then be read."""
    with open(directory / "collector.log", "w") as log:
        collector = Collector(
            directory / "rankwatch.duckdb", free_port(), "test-token-0123456", extra_args=extra_args, log=log
        ).start()
        try:
            yield collector
        finally:
            collector.stop()


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


def rankwatch_cli(*args: str, env: dict | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run the installed console script, as a user would."""
    return subprocess.run(
        [sys.executable, "-m", "rankwatch", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        cwd=cwd,
        timeout=300,
    )


def bench(script: str, *args: str) -> tuple[dict, str]:
    """Run bench/`script` as a user would; its last line's JSON object, and all it printed."""
    run = subprocess.run(
        [sys.executable, f"bench/{script}", *args],
        cwd=Path(__file__).resolve().parent.parent,
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    return json.loads(run.stdout.strip().splitlines()[-1]), run.stdout


def rankwatch_in_process(*args: str, env: dict | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """The same command line run by `rankwatch`'s main in this process, its exit status, stdout and stderr
    as `rankwatch_cli` reports them: for commands that read or import a store, or answer a collector's
    API, or send a simulated run through an exporter object of their own, where a fresh interpreter proves
    nothing more and costs seconds of imports. Commands that start processes, serve, or instrument a job
    through the agent's process-wide session keep `rankwatch_cli`."""
    from rankwatch.cli import main

    out, err = io.StringIO(), io.StringIO()
    saved, umask = dict(os.environ), os.umask(0o077)  # reading the umask sets it: it is set back below
    os.umask(umask)
    os.environ.update(env or {})
    try:
        with contextlib.chdir(cwd or os.getcwd()), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main(list(args))
                code = 0
            except SystemExit as e:  # as the interpreter ends on it: a message goes to stderr, status 1
                code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
                if not isinstance(e.code, int | None):
                    print(e.code, file=sys.stderr)
    finally:
        os.environ.clear()
        os.environ.update(saved)
        os.umask(umask)  # a command that made its files owner-only (collector/private.py) did so for itself
        gc.collect()  # a store the command left open is closed, as its process's exit would close it
    return subprocess.CompletedProcess(["rankwatch", *args], code, out.getvalue(), err.getvalue())


class Interactive:
    """A `rankwatch` command as a terminal runs it: in a process group of its own, with Ctrl-C working
    (a suite started in the background hands its children SIGINT ignored), its output read line by line."""

    def __init__(self, *args: str, env: dict | None = None):
        self.process = subprocess.Popen(
            [sys.executable, "-m", "rankwatch", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            start_new_session=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        self.lines: list[str] = []

    def read_until(self, text: str, timeout_s: float) -> str:
        """The output up to the line holding `text`."""
        deadline = time.monotonic() + timeout_s
        while not any(text in line for line in self.lines):
            assert time.monotonic() < deadline, f"no {text!r} after {timeout_s:.0f} s:\n" + "".join(self.lines)
            line = self.process.stdout.readline()
            assert line, "it ended early:\n" + "".join(self.lines)
            self.lines.append(line)
        return "".join(self.lines)

    def stop(self, sig: signal.Signals) -> str:
        """The rest of the output, once the command has exited on `sig` (sent to it alone)."""
        self.process.send_signal(sig)
        try:
            return self.process.communicate(timeout=60)[0]
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running 60 s after {sig.name}:\n" + "".join(self.lines)) from None

    def left_running(self, timeout_s: float = 15) -> str:
        """The processes it started (collector, dashboard, torchrun, ranks) still running `timeout_s`
        after it exited, as `ps` lists them; "" when none."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                os.killpg(self.process.pid, 0)
            except ProcessLookupError:
                return ""
            time.sleep(0.5)
        return (
            subprocess.run(
                ["ps", "-o", "pid,args", "--no-headers", "-g", str(self.process.pid)], capture_output=True, text=True
            ).stdout
            or "(gone while listing)"
        )

    def kill(self) -> None:
        """Whatever is left of its process group, killed: a failed test leaves nothing behind."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()


def simulated_store(
    directory: Path,
    runs: dict[str, list[str]],
    simulate_args: list[str],
    collector_args: tuple[str, ...] = (),
    until: Callable[[], object] | None = None,
) -> Path:
    """A store filled by `rankwatch simulate` through a real collector, one run per entry of `runs`
    (run id -> fault specs), then stopped (its last analysis pass covers every step sent); `until`:
    what to wait for while it still runs (an alert's delivery)."""
    db = directory / "rankwatch.duckdb"
    with open(directory / "collector.log", "w") as log:
        collector = Collector(db, free_port(), "test-token-0123456", extra_args=collector_args, log=log).start()
        try:
            for run, faults in runs.items():
                args = ["simulate", *simulate_args, "--run", run, "--collector", collector.url]
                for spec in faults:
                    args += ["--inject", spec]
                result = rankwatch_in_process(*args, env={"RANKWATCH_TOKEN": collector.token})
                assert result.returncode == 0, result.stderr
            if until is not None:
                until()
        finally:
            collector.stop()
    return db


@pytest.fixture(scope="session")
def dashboard_store(tmp_path_factory) -> Path:
    """The dashboard tests' store (tests/dashboard_store.py), built once per session: under pytest-xdist by
    the first worker that asks, in the directory the workers share, while the others wait for it."""
    from filelock import FileLock

    from tests.dashboard_store import build

    shared = tmp_path_factory.getbasetemp()
    if "PYTEST_XDIST_WORKER" in os.environ:
        shared = shared.parent  # the run's directory, above each worker's own
    built = shared / "dashboard" / "built"
    with FileLock(shared / "dashboard.lock"):
        if not built.exists():
            (shared / "dashboard").mkdir(exist_ok=True)
            built.write_text(str(build(shared / "dashboard")))
    return Path(built.read_text())
