"""Real collectors started as subprocesses on loopback, and stores filled through them."""

import contextlib
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from rankwatch.launch import wait_healthy
from tests.support.commands import rankwatch_in_process


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Decode processes of a test's collector, unless it asks for some (`--workers`): decoding in a thread is
# the collector's own `--workers 0`, and each decode process costs about 0.7 s of CPU to start, which
# over a hundred collectors was an eighth of the suite's CPU. The tests of decode processes and of what
# ends with them (floods, kill -9, the decoders) ask for them; the benches, which start collectors with
# this class too, keep the collector's default.
TEST_WORKERS = ("--workers", "0")


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
