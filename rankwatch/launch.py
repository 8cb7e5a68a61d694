"""Starting the reference trainer under torchrun."""

import os
import subprocess
import sys
import time

from agent import config


def train_command(nproc: int, steps: int, faults: list[str], model: str = "tiny") -> list[str]:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", "trainer.train", "--steps", str(steps), "--model", model]
    for spec in faults:
        command += ["--inject", spec]
    return command


def train(nproc: int, steps: int, run_id: str | None = None, faults: list[str] = (), collector: str | None = None,
          model: str = "tiny", token: str | None = None) -> int:
    """Run the trainer to the end; returns torchrun's exit status."""
    env = {**os.environ, "RANKWATCH_RUN_ID": run_id or time.strftime("run-%Y%m%d-%H%M%S"),
           "RANKWATCH_COLLECTOR": config.collector_url(collector), "OMP_NUM_THREADS": "1"}
    if token := config.token(token):
        env["RANKWATCH_TOKEN"] = token
    return subprocess.run(train_command(nproc, steps, list(faults), model), env=env).returncode
