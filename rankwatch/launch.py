"""Starting rankwatch's processes: the reference trainer under torchrun, and waiting for a collector."""

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from agent import config


def train_command(nproc: int, steps: int, faults: list[str], model: str = "tiny", max_restarts: int = 0,
                  trainer_args: list[str] = ()) -> list[str]:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               f"--max-restarts={max_restarts}", "-m", "trainer.train", "--steps", str(steps), "--model", model,
               *trainer_args]
    for spec in faults:
        command += ["--inject", spec]
    return command


def train(nproc: int, steps: int, run_id: str | None = None, faults: list[str] = (), collector: str | None = None,
          model: str = "tiny", token: str | None = None, max_restarts: int = 0, trainer_args: list[str] = (),
          store: Path | None = None, device: str = "auto") -> int:
    """Run the trainer to the end; returns torchrun's exit status. After a failure torchrun starts the
    job again, up to `max_restarts` times, and the trainer resumes from its last checkpoint. Interrupted,
    it stops the job before it returns. `store`: the store the job's checkpoints are kept beside
    (`runs/RUN/checkpoints`; default: $RANKWATCH_DB's, else ./rankwatch-data's). `device`: auto, cpu or
    cuda (trainer/device.py; DeviceError for cuda without a GPU per rank, before anything starts)."""
    import torch

    from trainer.device import choose

    device, notice = choose(device, nproc, torch.cuda.device_count())
    if notice:
        print(f"rankwatch: {notice}", file=sys.stderr, flush=True)
    env = {**os.environ, "RANKWATCH_RUN_ID": run_id or time.strftime("run-%Y%m%d-%H%M%S"),
           "RANKWATCH_COLLECTOR": config.collector_url(collector), "OMP_NUM_THREADS": "1",
           # a fresh store for each attempt: in the rendezvous' shared one, a restarted rank may read the
           # address its peer had before the restart and fail to connect (pytorch/pytorch#135712)
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    if token := config.token(token):
        env["RANKWATCH_TOKEN"] = token
    if store is not None:
        env["RANKWATCH_DB"] = str(store)
    with subprocess.Popen(train_command(nproc, steps, list(faults), model, max_restarts,
                                        ["--device", device, *trainer_args]),
                          env=env) as job:
        try:
            return job.wait()
        except BaseException:  # interrupted: torchrun stops its workers on SIGTERM (a SIGKILL would orphan them)
            job.terminate()
            job.wait()
            raise


def wait_healthy(url: str, process: subprocess.Popen, timeout_s: float = 60.0) -> None:
    """Block until the collector answers /healthz (or fail if it died)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"collector exited with status {process.returncode}")
        try:
            if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"collector not healthy at {url} after {timeout_s:.0f}s")
