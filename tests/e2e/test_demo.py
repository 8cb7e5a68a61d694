"""`rankwatch demo`, what `make demo` runs: the collector, the dashboard reading it, a 4-rank job
with a straggler and a loss spike; the summary names the straggler and the rollback, the
dashboard stays up afterwards, and Ctrl-C stops everything; ports it cannot listen on are
refused before anything starts; SIGTERM stops it as Ctrl-C does."""

import os
import signal
import socket

import httpx
import pytest

from tests.support import loopback
from tests.support.collectors import free_port
from tests.support.commands import Interactive, rankwatch_in_process

pytestmark = pytest.mark.long


class Demo(Interactive):
    """`rankwatch demo` on ports of its own."""

    def __init__(self, tmp_path):
        self.port, self.dashboard_port = free_port(), free_port()
        env = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "WAYLAND_DISPLAY", "RANKWATCH_TOKEN")}
        super().__init__(
            "demo",
            "--steps",
            "60",  # the straggler from step 12, the spike at 45
            "--db",
            str(tmp_path / "rankwatch.duckdb"),
            "--port",
            str(self.port),
            "--dashboard-port",
            str(self.dashboard_port),
            env=env,
        )

    def assert_stops_cleanly_on(self, sig: signal.Signals) -> None:
        """Exit 0 with its closing line, nothing it started left running, both ports closed."""
        rest = self.stop(sig)
        assert self.process.returncode == 0, "".join(self.lines) + rest
        assert "The store is" in rest
        assert self.left_running() == ""
        for p in (self.port, self.dashboard_port):
            try:
                loopback.get(f"http://127.0.0.1:{p}/", timeout=2)
                raise AssertionError(f"port {p} still answers after the demo stopped")
            except httpx.TransportError:
                pass


@pytest.mark.timeout(600)  # the test's own bounds govern: 400 s for the job and its summary, 60 s for the stop
def test_demo_runs_the_job_serves_the_dashboard_and_stops_on_ctrl_c(tmp_path):
    demo = Demo(tmp_path)
    try:
        output = demo.read_until("The dashboard stays up", 400)
        run_id = output.split("rankwatch demo: run ")[1].split(",")[0]
        assert f"the dashboard is at http://127.0.0.1:{demo.dashboard_port}/?run={run_id}" in output
        # said once it serves, before the job starts, whose start names it too
        assert f"; watch it at http://127.0.0.1:{demo.dashboard_port}/?run={run_id} (rankwatch dashboard)" in output
        assert "] rank 2 computes" in output, output  # the straggler, named
        assert "rolled back by the collector (1 rollback)" in output and "loss_spike" in output, output
        assert loopback.get(f"http://127.0.0.1:{demo.dashboard_port}/_stcore/health", timeout=5).text == "ok"
        assert loopback.get(f"http://127.0.0.1:{demo.port}/healthz", timeout=5).status_code == 200  # what it reads
        for rank in range(4):  # the job's checkpoints, beside its store
            assert list((tmp_path / "runs" / run_id / "checkpoints" / f"rank-{rank}").glob("step-*")), rank
        demo.assert_stops_cleanly_on(signal.SIGINT)
    finally:
        demo.kill()


def test_sigterm_mid_job_stops_the_job_and_everything_the_demo_started(tmp_path):
    """As a service manager or `timeout` stops it: no rank, collector or dashboard is orphaned."""
    demo = Demo(tmp_path)
    try:
        demo.read_until("step     0 ", 300)  # the job under way
        demo.assert_stops_cleanly_on(signal.SIGTERM)
    finally:
        demo.kill()


def test_demo_refuses_ports_it_cannot_listen_on(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        db = ["--db", str(tmp_path / "rankwatch.duckdb")]
        # refused before anything starts, so checked in this process
        collector = rankwatch_in_process("demo", *db, "--port", str(port))
        dashboard = rankwatch_in_process("demo", *db, "--port", str(free_port()), "--dashboard-port", str(port))
    assert (collector.returncode, collector.stderr.strip()) == (
        2,
        f"rankwatch: error: cannot listen on 127.0.0.1:{port}: Address already in use",
    )
    assert (dashboard.returncode, dashboard.stderr.strip()) == (
        2,
        (
            f"rankwatch: error: cannot serve the dashboard on 127.0.0.1:{port}: Address already in use "
            "(--dashboard-port PORT, or --no-dashboard)"
        ),
    )
