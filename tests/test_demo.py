"""`rankwatch demo`, what `make demo` runs: the collector, the dashboard reading it, a 4-rank job
with a straggler and a loss spike; the summary names the straggler and the rollback, the
dashboard stays up afterwards, and Ctrl-C stops everything; ports it cannot listen on are
refused before anything starts."""

import os
import signal
import socket
import subprocess
import sys
import time

import httpx

from tests.conftest import free_port, rankwatch_cli


def test_demo_runs_the_job_serves_the_dashboard_and_stops_on_ctrl_c(tmp_path):
    port, dashboard_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "WAYLAND_DISPLAY", "RANKWATCH_TOKEN")}
    demo = subprocess.Popen([sys.executable, "-m", "rankwatch", "demo", "--steps", "200", "--db",
                             str(tmp_path / "rankwatch.duckdb"), "--port", str(port), "--dashboard-port",
                             str(dashboard_port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)
    lines = []
    try:
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline and not any("The dashboard stays up" in line for line in lines):
            line = demo.stdout.readline()
            assert line, "the demo ended early:\n" + "".join(lines)
            lines.append(line)
        output = "".join(lines)
        assert "The dashboard stays up" in output, output
        run_id = output.split("rankwatch demo: run ")[1].split(",")[0]
        assert f"the dashboard is at http://127.0.0.1:{dashboard_port}/?run={run_id}" in output
        assert "] rank 2 computes" in output, output  # the straggler, named
        assert "rolled back by the collector (1 rollback)" in output and "loss_spike" in output, output
        assert httpx.get(f"http://127.0.0.1:{dashboard_port}/_stcore/health", timeout=5).text == "ok"
        assert httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5).status_code == 200  # what it reads
    finally:
        demo.send_signal(signal.SIGINT)
        rest, _ = demo.communicate(timeout=60)
    assert demo.returncode == 0, "".join(lines) + rest
    assert "The store is" in rest
    for p in (port, dashboard_port):
        try:
            httpx.get(f"http://127.0.0.1:{p}/", timeout=2)
            raise AssertionError(f"port {p} still answers after Ctrl-C")
        except httpx.TransportError:
            pass


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
