"""`rankwatch demo`, what `make demo` runs: the collector, the dashboard reading it, a 4-rank job
with a straggler and a loss spike; the summary names the straggler and the rollback, the
dashboard stays up afterwards, and Ctrl-C stops everything; ports it cannot listen on are
refused before anything starts; SIGTERM stops it as Ctrl-C does."""

import os
import signal
import socket
import subprocess
import sys
import time

import httpx

from tests.conftest import free_port, rankwatch_cli


class Demo:
    """`rankwatch demo` in a process group of its own, with Ctrl-C working in it (a suite started in
    the background hands its children SIGINT ignored)."""

    def __init__(self, tmp_path):
        self.port, self.dashboard_port = free_port(), free_port()
        env = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "WAYLAND_DISPLAY", "RANKWATCH_TOKEN")}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "rankwatch", "demo", "--steps", "200", "--db", str(tmp_path / "rankwatch.duckdb"),
             "--port", str(self.port), "--dashboard-port", str(self.dashboard_port)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        self.lines: list[str] = []

    def read_until(self, text: str, timeout_s: float) -> str:
        """The output up to the line holding `text`."""
        deadline = time.monotonic() + timeout_s
        while not any(text in line for line in self.lines):
            assert time.monotonic() < deadline, f"no {text!r} after {timeout_s:.0f} s:\n" + "".join(self.lines)
            line = self.process.stdout.readline()
            assert line, "the demo ended early:\n" + "".join(self.lines)
            self.lines.append(line)
        return "".join(self.lines)

    def stop(self, sig: signal.Signals) -> str:
        """The rest of the output, once the demo has exited on `sig`."""
        self.process.send_signal(sig)
        try:
            return self.process.communicate(timeout=60)[0]
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the demo still runs 60 s after {sig.name}:\n" + "".join(self.lines)) from None

    def left_running(self, timeout_s: float = 15) -> bool:
        """Whether any process the demo started (the collector, the dashboard, torchrun, its ranks)
        still runs `timeout_s` after the demo exited."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                os.killpg(self.process.pid, 0)
            except ProcessLookupError:
                return False
            time.sleep(0.5)
        return True

    def kill(self) -> None:
        """Whatever is left of the demo's process group, killed (a failed test leaves nothing behind)."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()

    def assert_ports_closed(self) -> None:
        for p in (self.port, self.dashboard_port):
            try:
                httpx.get(f"http://127.0.0.1:{p}/", timeout=2)
                raise AssertionError(f"port {p} still answers after the demo stopped")
            except httpx.TransportError:
                pass


def test_demo_runs_the_job_serves_the_dashboard_and_stops_on_ctrl_c(tmp_path):
    demo = Demo(tmp_path)
    try:
        output = demo.read_until("The dashboard stays up", 400)
        run_id = output.split("rankwatch demo: run ")[1].split(",")[0]
        assert f"the dashboard is at http://127.0.0.1:{demo.dashboard_port}/?run={run_id}" in output
        assert "] rank 2 computes" in output, output  # the straggler, named
        assert "rolled back by the collector (1 rollback)" in output and "loss_spike" in output, output
        assert httpx.get(f"http://127.0.0.1:{demo.dashboard_port}/_stcore/health", timeout=5).text == "ok"
        assert httpx.get(f"http://127.0.0.1:{demo.port}/healthz", timeout=5).status_code == 200  # what it reads
        rest = demo.stop(signal.SIGINT)
        assert demo.process.returncode == 0, output + rest
        assert "The store is" in rest
        assert not demo.left_running()
        demo.assert_ports_closed()
    finally:
        demo.kill()


def test_sigterm_mid_job_stops_the_job_and_everything_the_demo_started(tmp_path):
    """As a service manager or `timeout` stops it: no rank, collector or dashboard is orphaned."""
    demo = Demo(tmp_path)
    try:
        demo.read_until("step    20 ", 300)
        rest = demo.stop(signal.SIGTERM)
        assert demo.process.returncode == 0, "".join(demo.lines) + rest
        assert "The store is" in rest
        assert not demo.left_running(), subprocess.run(["ps", "-o", "pid,args", "-g", str(demo.process.pid)],
                                                       capture_output=True, text=True).stdout
        demo.assert_ports_closed()
    finally:
        demo.kill()


def test_demo_refuses_ports_it_cannot_listen_on(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        db = ["--db", str(tmp_path / "rankwatch.duckdb")]
        collector = rankwatch_cli("demo", *db, "--port", str(port))
        dashboard = rankwatch_cli("demo", *db, "--port", str(free_port()), "--dashboard-port", str(port))
    assert (collector.returncode, collector.stderr.strip()) == (
        2, f"rankwatch: error: cannot listen on 127.0.0.1:{port}: Address already in use")
    assert (dashboard.returncode, dashboard.stderr.strip()) == (
        2, f"rankwatch: error: cannot serve the dashboard on 127.0.0.1:{port}: Address already in use "
           "(--dashboard-port PORT, or --no-dashboard)")
