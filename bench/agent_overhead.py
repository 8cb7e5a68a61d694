"""Agent overhead: the same training run with and without the agent, alternating.

One process trains the reference GPT under DistributedDataParallel (gloo, one
rank, so the DDP comm hook runs) for `--steps` steps per run. Runs with the
agent export everything (step, phase and bucket spans) to a real collector on
loopback. Runs alternate in pairs, the order flipped every pair. Two figures,
each the median over pairs of (with agent / without agent):
- wall: each run's median step time;
- CPU: the process's CPU time per step (all its threads, so the exporter's
  background work counts), which other load on a shared machine disturbs far
  less than wall time.

Usage: python bench/agent_overhead.py [--pairs 6] [--steps 60] [--model tiny] [--batch 8]
"""

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import agent  # noqa: E402
from rankwatch.launch import wait_healthy  # noqa: E402
from trainer.data import TokenStream  # noqa: E402
from trainer.model import CONFIGS, GPT  # noqa: E402

TOKEN = "bench-token"


def run(with_agent: bool, args, url: str, run_id: str) -> tuple[float, float]:
    """(median step wall time, CPU time per step) of one training run, in seconds."""
    torch.manual_seed(0)
    model = GPT(CONFIGS[args.model])
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    c = model.config
    data = TokenStream(c.vocab, c.seq_len, args.batch, 0)
    if with_agent:
        agent.init(run_id=run_id, collector=url, token=TOKEN, rank=0, world_size=1)
        agent.watch_ddp(ddp)
    times = []
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            cpu_started = time.process_time()
        started = time.perf_counter()
        with agent.step(step):
            with agent.phase("data"):
                inputs, targets = data.next()
            with agent.phase("forward"):
                loss = ddp(inputs, targets)
            with agent.phase("backward"):
                loss.backward()
            with agent.phase("optimizer"):
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            agent.record(loss=loss.detach(), grad_norm=grad_norm.detach(), tokens=inputs.numel())
        if step >= args.warmup:
            times.append(time.perf_counter() - started)
    agent.shutdown()  # the export of the last spans is the agent's cost too
    return statistics.median(times), (time.process_time() - cpu_started) / args.steps


def empty_steps(with_agent: bool, url: str, steps: int = 3000) -> float:
    """CPU seconds per step of a loop that does nothing but the agent's calls (4 phases, a record)."""
    if with_agent:
        agent.init(run_id="overhead-empty", collector=url, token=TOKEN, rank=0, world_size=1)
    started = time.process_time()
    for step in range(steps):
        with agent.step(step):
            for name in ("data", "forward", "backward", "optimizer"):
                with agent.phase(name):
                    pass
            agent.record(loss=1.0, tokens=512)
    agent.shutdown()
    return (time.process_time() - started) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=6)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--model", default="tiny", choices=sorted(CONFIGS))
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port + 1 if port < 65000 else port - 1))
    dist.init_process_group("gloo", rank=0, world_size=1)
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as tmp:
        collector = subprocess.Popen([sys.executable, "-m", "rankwatch", "collector", "--db", f"{tmp}/a.duckdb",
                                      "--port", str(port), "--token", TOKEN], stdout=subprocess.DEVNULL)
        try:
            wait_healthy(url, collector)
            per_step = empty_steps(True, url) - empty_steps(False, url)
            rows = []
            for pair in range(args.pairs):
                order = (False, True) if pair % 2 == 0 else (True, False)
                median = {mode: run(mode, args, url, f"overhead-{pair}") for mode in order}
                rows.append((median[False], median[True]))
        finally:
            collector.terminate()
            collector.wait()
    console = Console()
    table = Table("pair", "wall ms without", "wall ms with", "wall ratio", "CPU ms/step without",
                  "CPU ms/step with", "CPU ratio")
    for i, ((wall0, cpu0), (wall1, cpu1)) in enumerate(rows):
        table.add_row(str(i), f"{wall0 * 1e3:.2f}", f"{wall1 * 1e3:.2f}", f"{wall1 / wall0:.4f}",
                      f"{cpu0 * 1e3:.2f}", f"{cpu1 * 1e3:.2f}", f"{cpu1 / cpu0:.4f}")
    console.print(table)
    wall = statistics.median(w[0] / wo[0] for wo, w in rows)
    cpu = statistics.median(w[1] / wo[1] for wo, w in rows)
    console.print(f"GPT {args.model}, batch {args.batch}, {args.steps} steps per run, {args.pairs} pairs: "
                  f"with/without agent, median step time ratio [bold]{wall:.4f}[/bold], "
                  f"CPU per step ratio [bold]{cpu:.4f}[/bold]")
    console.print(f"The agent's own CPU cost: {per_step * 1e6:.0f} µs per step (step, 4 phases, a record, "
                  f"export included) = {per_step / statistics.median(r[0][0] for r in rows) * 100:.2f}% of the "
                  f"median step here")


if __name__ == "__main__":
    main()
