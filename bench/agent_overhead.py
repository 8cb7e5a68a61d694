"""Agent overhead: the same training run with and without the agent, alternating.

One process trains the reference GPT under DistributedDataParallel (gloo, one
rank, so the DDP comm hook runs) for `--steps` steps per run. Runs with the
agent export everything (step, phase and bucket spans) to a real collector on
loopback. Runs alternate in pairs, the order flipped every pair, and each
run's median step time is taken; the figure is the median over pairs of
(with agent / without agent).

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
from rankwatch.demo import wait_healthy  # noqa: E402
from trainer.data import TokenStream  # noqa: E402
from trainer.model import CONFIGS, GPT  # noqa: E402

TOKEN = "bench-token"


def run(with_agent: bool, args, url: str, run_id: str) -> float:
    """Median step time (s) of one training run."""
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
    agent.shutdown()
    return statistics.median(times)


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
            rows = []
            for pair in range(args.pairs):
                order = (False, True) if pair % 2 == 0 else (True, False)
                median = {mode: run(mode, args, url, f"overhead-{pair}") for mode in order}
                rows.append((median[False], median[True]))
        finally:
            collector.terminate()
            collector.wait()
    console = Console()
    table = Table("pair", "without agent ms", "with agent ms", "ratio")
    for i, (without, with_) in enumerate(rows):
        table.add_row(str(i), f"{without * 1e3:.2f}", f"{with_ * 1e3:.2f}", f"{with_ / without:.4f}")
    console.print(table)
    ratio = statistics.median(w / wo for wo, w in rows)
    console.print(f"GPT {args.model}, batch {args.batch}, {args.steps} steps per run, {args.pairs} pairs: "
                  f"median step-time ratio with/without agent = [bold]{ratio:.4f}[/bold]")


if __name__ == "__main__":
    main()
