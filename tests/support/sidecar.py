"""A node's sidecar (`rankwatch node`) as a process, and a rank's script that hands it its telemetry."""

import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.support.waits import wait_until

TOKEN = "test-token-0123456"

# One rank: `steps` steps of four phases, a gloo all-reduce in the backward (a collective of its own group),
# a loss and tokens; then, after `then`: "exit" shuts the agent down, "kill" SIGKILLs the process a second
# after its last step (what was handed over by then is all the sidecar has), "wait" waits for a file first.
RANK = """
import os, signal, sys, time
import torch, torch.distributed as dist
from rankwatch import agent

collector, run_id, steps, then = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)  # a port of its own
agent.init(rank=0, world_size=1, collector=collector, token=os.environ["TOKEN"], run_id=run_id, cuda=False)
agent.watch_collectives()
t = torch.ones(256)
for i in range(steps):
    if then.startswith("wait:") and i == steps // 2:
        print("half", flush=True)
        while not os.path.exists(then[5:]):
            time.sleep(0.05)
    with agent.step(i):
        with agent.phase("data"):
            time.sleep(0.002)
        with agent.phase("forward"):
            time.sleep(0.005)
        with agent.phase("backward"):
            dist.all_reduce(t)
        with agent.phase("optimizer"):
            time.sleep(0.001)
        agent.record(loss=1.0 / (i + 1), tokens=100)
print("trained", flush=True)
if then == "kill":
    time.sleep(1.0)
    os.kill(os.getpid(), signal.SIGKILL)
agent.shutdown()
"""


class Node:
    """A `rankwatch node` process listening at `path`."""

    def __init__(self, path: Path, collector_url: str, env: dict | None = None):
        self.path = path
        self.process = subprocess.Popen(
            [sys.executable, "-m", "rankwatch", "node", "--socket", str(path), "--collector", collector_url],
            env={**os.environ, "RANKWATCH_TOKEN": TOKEN, **(env or {})},
            stderr=subprocess.PIPE,
            text=True,
        )
        wait_until(lambda: path.exists() or self.process.poll() is not None, "the sidecar did not listen", 60)
        assert path.exists(), self.process.stderr.read() if self.process.stderr else ""

    def stop(self, sig: int = signal.SIGTERM) -> tuple[int, str]:
        self.process.send_signal(sig)
        _, err = self.process.communicate(timeout=120)
        return self.process.returncode, err
