"""`rankwatch demo`, what `make demo` runs: the collector, the dashboard reading it, a 4-rank job
with a straggler and a loss spike; the summary names the straggler and the rollback, the
dashboard stays up afterwards, and Ctrl-C stops everything."""

import os
import signal
import subprocess
import sys
import time

import httpx

from tests.conftest import free_port


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
