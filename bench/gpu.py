"""The agent on a GPU, one command on any CUDA machine: its cost and its view of the step against
the PyTorch profiler's.

One process, one GPU, DDP over NCCL (world size 1), the reference GPT in bf16 autocast on batches
staged on the GPU, every step exported to a real collector on loopback. Printed, in one run:
- the GPU's name;
- the A/B step time of five variants, taking turns (the order rotated every round), each round's
  time per step against the same round's run without the agent, the median over rounds: no agent;
  DDP with a Python comm hook and no agent (DDP's own allreduce_hook: what any Python hook costs);
  the agent (steps, phases, values); the agent with DDP timing (`agent.watch_ddp` around DDP's
  allreduce_hook, as the trainer wraps its hook), exporting its own telemetry, and handing it to the
  node's sidecar (`rankwatch node`) as under `rankwatch run` and `rankwatch train`;
- the step split of the agent with DDP timing against a torch.profiler (Kineto) trace of the same
  steps: the step on the GPU (the agent: its step's CUDA events; the profiler: the first to the
  last of the step's kernels and copies), compute (the agent: the compute phases less the exposed
  wait, on the GPU's timeline; the profiler: the time some
  compute kernel runs), collective time (the agent's all-reduce spans; the profiler's NCCL kernels)
  and exposed wait (the agent's; the profiler's NCCL kernel time that no compute kernel covers,
  the same arithmetic, rankwatch/agent/timeline.py), medians over the profiled steps, with the % difference.
Without CUDA it exits 2, saying so in one line.

Usage: python bench/gpu.py [--model gpt2] [--batch 8] [--rounds 4] [--steps 40] [--profile-steps 10]
"""

import argparse
import copy
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rankwatch import agent
from rankwatch.agent.config import NODE_ENV
from rankwatch.agent.timeline import exposed, length

TOKEN = "bench-token-0123456789"
NO_AGENT, HOOK, AGENT, AGENT_DDP = "no agent", "Python comm hook, no agent", "agent", "agent + DDP timing"
SIDECAR = "agent + DDP timing, sidecar"  # the rank hands its telemetry to the node's sidecar, as under rankwatch run
WARMUP = 5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def profiler_split(trace: Path) -> dict[int, dict[str, float]]:
    """Per ProfilerStep of a Kineto trace (one rank), in seconds: `compute`, the time some compute
    kernel runs; `comm`, the NCCL kernels' durations summed; `exposed`, the NCCL kernel time no
    compute kernel covers, within the step's GPU ops. Kernels belong to the step that launched
    them (collector/receive/imports/kineto.py)."""
    from collector.receive.imports.kineto import KinetoTrace

    ops = next(iter(KinetoTrace(trace).batches())).to_pandas()
    for column in ("start_ts", "end_ts"):
        ops[column] = ops[column].astype("datetime64[ns]").astype("int64")
    split = {}
    for step, g in ops.groupby("step"):
        compute = list(zip(g.start_ts[g.kind == "compute"], g.end_ts[g.kind == "compute"]))
        comm = list(zip(g.start_ts[g.kind == "comm"], g.end_ts[g.kind == "comm"]))
        split[int(step)] = {
            "step": (g.end_ts.max() - g.start_ts.min()) / 1e9,
            "compute": length(compute) / 1e9,
            "comm": sum(e - s for s, e in comm) / 1e9,
            "exposed": exposed(comm, compute, (g.start_ts.min(), g.end_ts.max())) / 1e9,
        }
    return split


class Bench:
    """The model, optimizer state and batches every variant starts from, and the collector URL."""

    def __init__(self, args, url: str, node: str):
        from trainer.data import TokenStream
        from trainer.model import CONFIGS, GPT

        torch.manual_seed(0)
        self.model = GPT(CONFIGS[args.model]).cuda()
        data = TokenStream(self.model.config.vocab, self.model.config.seq_len, args.batch, 0)
        self.batches = [tuple(t.cuda() for t in data.next()) for _ in range(4)]
        self.url, self.node = url, node

    def run(self, variant: str, steps: int, run_id: str, profiler=None) -> float:
        """Seconds per step of `steps` steps (after WARMUP steps) of a fresh DDP copy of the model."""
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        from torch.nn.parallel import DistributedDataParallel

        model = copy.deepcopy(self.model)
        ddp = DistributedDataParallel(model, device_ids=[torch.cuda.current_device()])
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        if variant == HOOK:
            ddp.register_comm_hook(None, default_hooks.allreduce_hook)
        if variant in (AGENT, AGENT_DDP, SIDECAR):
            os.environ[NODE_ENV] = self.node if variant == SIDECAR else ""
            agent.init(run_id=run_id, collector=self.url, token=TOKEN, rank=0, world_size=1, cuda=True)
            if variant != AGENT:  # around DDP's own hook, as the trainer wraps its hook
                agent.watch_ddp(ddp, default_hooks.allreduce_hook)
        for i in range(WARMUP + steps):
            if i == WARMUP:
                torch.cuda.synchronize()  # the bench's own, outside the timed steps
                started = time.perf_counter()
            self.step(ddp, optimizer, i)
            if profiler is not None:
                profiler.step()  # so that ProfilerStep#i is step i
        torch.cuda.synchronize()
        elapsed = (time.perf_counter() - started) / steps
        agent.shutdown()
        return elapsed

    def step(self, ddp, optimizer, i: int) -> None:
        inputs, targets = self.batches[i % len(self.batches)]
        with agent.step(i):
            with agent.phase("forward"), torch.autocast("cuda", dtype=torch.bfloat16):
                loss = ddp(inputs, targets)
            with agent.phase("backward"):
                loss.backward()
            with agent.phase("optimizer"):
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            agent.record(loss=loss.detach(), tokens=inputs.numel())


def agent_split(db: Path, run_id: str) -> dict[int, dict[str, float]]:
    """Per step, what the agent stored: compute_s, its all-reduces' durations summed, comm_wait_s."""
    import duckdb

    with duckdb.connect(str(db), read_only=True) as con:
        rows = con.execute(
            """SELECT s.step, s.duration_s, s.compute_s, coalesce(sum(o.duration_s), 0), s.comm_wait_s
                              FROM steps s LEFT JOIN ops o ON o.run_id = s.run_id AND o.rank = s.rank
                                   AND o.step = s.step AND o.kind = 'comm'
                              WHERE s.run_id = ? GROUP BY ALL""",
            [run_id],
        ).fetchall()
    return {
        step: {"step": duration, "compute": compute, "comm": comm, "exposed": wait}
        for step, duration, compute, comm, wait in rows
    }


def percent(ours: float, theirs: float) -> str:
    return f"{(ours / theirs - 1) * 100:+.1f}%" if theirs else "n/a"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--profile-steps", type=int, default=10)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench/gpu.py: CUDA is required: torch sees no GPU on this machine", file=sys.stderr)
        sys.exit(2)

    import torch.distributed as dist
    from rich.console import Console
    from rich.table import Table
    from torch.profiler import ProfilerActivity, profile, schedule

    from rankwatch.launch import wait_healthy

    console = Console()
    nccl = torch.cuda.nccl.version()  # a tuple; an int in older releases
    console.print(
        f"GPU: [bold]{torch.cuda.get_device_name(0)}[/bold], torch {torch.__version__}, "
        f"NCCL {'.'.join(map(str, nccl)) if isinstance(nccl, tuple) else nccl}"
    )
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as tmp:
        db, trace = Path(tmp) / "bench.duckdb", Path(tmp) / "trace_rank0.json"
        collector = subprocess.Popen(
            [sys.executable, "-m", "rankwatch", "collector", "--db", str(db), "--port", str(port), "--token", TOKEN],
            stdout=subprocess.DEVNULL,
        )
        node_socket = Path(tmp) / "node.sock"
        node = subprocess.Popen(
            [sys.executable, "-m", "rankwatch", "node", "--socket", str(node_socket), "--collector", url],
            env={**os.environ, "RANKWATCH_TOKEN": TOKEN},
        )
        try:
            wait_healthy(url, collector)
            while not node_socket.exists() and node.poll() is None:
                time.sleep(0.1)
            bench = Bench(args, url, str(node_socket))
            variants = [NO_AGENT, HOOK, AGENT, AGENT_DDP, SIDECAR]
            times: dict[str, list[float]] = {v: [] for v in variants}
            for r in range(args.rounds):
                for v in variants[r % len(variants) :] + variants[: r % len(variants)]:
                    times[v].append(bench.run(v, args.steps, f"gpu-{r}-{variants.index(v)}"))
            with profile(
                activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                schedule=schedule(wait=WARMUP, warmup=2, active=args.profile_steps),
                on_trace_ready=lambda p: p.export_chrome_trace(str(trace)),
            ) as prof:
                bench.run(AGENT_DDP, args.profile_steps + 2, "gpu-profiled", profiler=prof)
        finally:
            for process in (node, collector):
                process.terminate()
                process.wait()
        ours, theirs = agent_split(db, "gpu-profiled"), profiler_split(trace)
    dist.destroy_process_group()

    table = Table("variant", "ms/step (median)", "ratio to no agent (median of rounds)")
    for v in variants:
        ratio = statistics.median(t / base for t, base in zip(times[v], times[NO_AGENT]))
        table.add_row(v, f"{statistics.median(times[v]) * 1e3:.2f}", f"{ratio:.4f}")
    console.print(table)
    steps = sorted(set(ours) & set(theirs))
    split = Table("per step (median)", "agent", "profiler", "difference")
    for key, what in (
        ("step", "step on the GPU"),
        ("compute", "compute"),
        ("comm", "collective time"),
        ("exposed", "exposed wait"),
    ):
        a, p = (statistics.median(d[s][key] for s in steps) for d in (ours, theirs))
        split.add_row(what, f"{a * 1e3:.3f} ms", f"{p * 1e3:.3f} ms", percent(a, p))
    console.print(split)
    console.print(
        "step on the GPU: the agent's step span (its CUDA events); the profiler's, from the step's first kernel's "
        "start to its last one's end. compute: the agent's compute phases less the exposed wait, on the GPU's "
        "timeline (gaps in which the GPU waits for the host's launches included: under the profiler the host is "
        "slower); the profiler's, the time some compute kernel runs. One GPU runs no NCCL kernel: collective time "
        "is compared on two GPUs or more."
    )
    console.print(
        f"GPT {args.model}, batch {args.batch}, bf16 autocast, DDP over NCCL on 1 GPU; {args.rounds} "
        f"rounds of {args.steps} steps; the split over {len(steps)} profiled steps (agent + DDP timing)"
    )


if __name__ == "__main__":
    main()
