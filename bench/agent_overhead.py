"""Agent overhead: the same training run without the agent, with it (the loop's own calls), and with
it zero-code (`rankwatch run`: the loop unchanged, agent/auto.py's hooks), alternating; with
`--baseline DIR`, also with the agent of another checkout (DIR/agent), so that a change to the
agent is measured against the version before it side by side, in one run.

Each run is a process of its own (the agent it imports is the variant's), training the reference
GPT under DistributedDataParallel (gloo, one rank, so the DDP comm hook runs) for `--steps` steps.
Runs with an agent export everything (step, phase and bucket spans) to a real collector on
loopback. The variants take turns, the order rotated every round. Figures, each the median over
rounds of (variant / no agent):
- wall: each run's median step time;
- CPU: the process's CPU time per step (all its threads, so the exporter's background work
  counts), which other load on a shared machine disturbs far less than wall time.
And the agent's own CPU per step: a loop that does nothing but a tiny DDP step (8 gradient buckets)
and the agent's calls around it (a step, 4 phases, a record; the shutdown's export included),
less the same loop without the agent (not for zero-code, whose hooks follow the training run's
model alone).

`--job 3d`: the run is an 8-rank torchrun job of the reference trainer's 3D code (FSDP2 over dp, tensor
parallelism over tp, a 1F1B pipeline over pp: 2 x 2 x 2, trainer/threed.py), each rank's figures
(median step time, CPU per step) the median over its ranks; with the agent every collective (FSDP's,
the functional ones of tensor parallelism, the stages' sends and receives) and the pipeline's chunks
are traced and exported. The agent's own CPU per step is then the run's CPU per step less the run
without the agent's, per rank, next to the step time: what the agent costs a rank, as a share of
its step.

Usage: python bench/agent_overhead.py [--rounds 6] [--steps 60] [--model tiny] [--batch 8] [--baseline DIR]
       [--job ddp|3d]
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "bench-token-0123456789"
EMPTY_STEPS = 2000
AUTO = "auto"  # the zero-code variant's worker


def _nothing(name):
    return nullcontext()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def timed(one_step, args) -> tuple[list[float], float]:
    """`args.warmup` steps, then `args.steps` timed: their wall times, and the process's CPU per step
    (the agent's shutdown, which exports the last spans, included: its cost too)."""
    import agent

    times = []
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            cpu_started = time.process_time()
        started = time.perf_counter()
        one_step(step)
        if step >= args.warmup:
            times.append(time.perf_counter() - started)
    agent.shutdown()
    return times, (time.process_time() - cpu_started) / args.steps


def worker(agent_dir: str | None, args) -> dict:
    """One run in this process: the training run's median step time and CPU per step, and the
    empty loop's CPU per step; `agent_dir` None: without the agent; AUTO: zero-code."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    sys.path.insert(0, agent_dir or str(ROOT))
    import agent
    from trainer.data import TokenStream
    from trainer.model import CONFIGS, GPT

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)

    explicit = agent_dir not in (None, AUTO)  # the loop calls the agent itself
    step_of, phase_of = (agent.step, agent.phase) if explicit else (_nothing, _nothing)
    record = agent.record if explicit else (lambda **values: None)
    if agent_dir == AUTO:  # as `rankwatch run` does: the session starts at the model's first forward
        from agent import auto

        os.environ.update(RANKWATCH_RUN_ID=args.run, RANKWATCH_COLLECTOR=args.url, RANKWATCH_TOKEN=TOKEN)
        auto.install()

    def start(run_id: str, ddp) -> None:
        if explicit:
            agent.init(run_id=run_id, collector=args.url, token=TOKEN, rank=0, world_size=1, cuda=False)
            agent.watch_ddp(ddp)

    torch.manual_seed(0)
    model = GPT(CONFIGS[args.model])
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = TokenStream(model.config.vocab, model.config.seq_len, args.batch, 0)
    start(args.run, ddp)

    def one_step(step: int) -> None:
        with step_of(step):
            with phase_of("data"):
                inputs, targets = data.next()
            with phase_of("forward"):
                loss = ddp(inputs, targets)
            with phase_of("backward"):
                loss.backward()
            with phase_of("optimizer"):
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            record(loss=loss.detach(), grad_norm=grad_norm.detach(), tokens=inputs.numel())

    times, cpu = timed(one_step, args)
    if agent_dir == AUTO:
        dist.destroy_process_group()
        return {"wall": statistics.median(times), "cpu": cpu, "empty": None}

    tiny = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(8)])
    tiny_ddp = DistributedDataParallel(tiny, bucket_cap_mb=1e-5)  # a bucket per layer
    x = torch.randn(2, 4)
    for _ in range(3):  # DDP rebuilds its buckets after the first step
        tiny_ddp(x).sum().backward()
    start(f"{args.run}-empty", tiny_ddp)
    empty_started = time.process_time()
    for step in range(EMPTY_STEPS):
        with agent.step(step):
            with agent.phase("data"):
                pass
            with agent.phase("forward"):
                out = tiny_ddp(x).sum()
            with agent.phase("backward"):
                out.backward()
            with agent.phase("optimizer"):
                pass
            agent.record(loss=1.0, tokens=512)
    agent.shutdown()
    empty = (time.process_time() - empty_started) / EMPTY_STEPS
    dist.destroy_process_group()
    return {"wall": statistics.median(times), "cpu": cpu, "empty": empty}


def worker_3d(agent_dir: str | None, args) -> dict:
    """One rank of the 3D job (under torchrun): its median step time and CPU per step."""
    import torch
    import torch.distributed as dist

    sys.path.insert(0, agent_dir or str(ROOT))
    import agent
    from trainer.data import TokenStream
    from trainer.layout import Layout
    from trainer.model import CONFIGS, GPT
    from trainer.threed import ThreeD

    torch.set_num_threads(1)
    explicit = agent_dir not in (None, AUTO)
    if agent_dir == AUTO:
        from agent import auto

        os.environ.update(RANKWATCH_RUN_ID=args.run, RANKWATCH_COLLECTOR=args.url, RANKWATCH_TOKEN=TOKEN)
        auto.install()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    job = ThreeD(GPT(CONFIGS[args.model]), Layout(dp=2, tp=2, pp=2), torch.device("cpu"), args.batch, list)
    optimizer = torch.optim.AdamW(job.module.parameters(), lr=1e-3)
    data = TokenStream(job.module.config.vocab, job.module.config.seq_len, args.batch, job.replica)
    step_of, phase_of = (agent.step, agent.phase) if explicit else (_nothing, _nothing)
    if explicit:
        agent.init(run_id=args.run, collector=args.url, token=TOKEN, cuda=False, resource=job.resource)
        job.watch()

    def one_step(step: int) -> None:
        with step_of(step):
            with phase_of("data"):
                inputs, targets = data.next()
            loss = job.forward_backward(inputs, targets, [])
            with phase_of("optimizer"):
                job.clip()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            if loss is not None and explicit:
                agent.record(loss=loss.detach(), tokens=inputs.numel())

    times, cpu = timed(one_step, args)
    dist.destroy_process_group()
    return {"wall": statistics.median(times), "cpu": cpu, "empty": None}


def run_3d(variant: str, url: str, run: str, args, out: Path) -> dict:
    """The 8-rank job of one variant: per figure, the median over its ranks."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=8",
        __file__,
        # (not --run: torchrun takes it for an abbreviation of its --run-path)
        *("--worker3d", variant, "--url", url, "--job-run", run, "--steps", str(args.steps)),
        *("--warmup", str(args.warmup), "--model", args.model, "--batch", str(args.batch), "--out", str(out)),
    ]
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode:
        sys.exit(f"{variant} run failed:\n{done.stderr[-3000:]}")
    ranks = [json.loads(p.read_text()) for p in sorted(out.glob("rank-*.json"))]
    for p in out.glob("rank-*.json"):
        p.unlink()
    return {key: statistics.median(r[key] for r in ranks) for key in ("wall", "cpu")} | {"empty": None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument(
        "--baseline",
        type=Path,
        metavar="DIR",
        help="a checkout whose agent/ is measured beside this one's (e.g. git archive of a commit)",
    )
    parser.add_argument("--job", choices=("ddp", "3d"), default="ddp", help="one DDP rank, or an 8-rank 3D job")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # "none" or the agent's directory
    parser.add_argument("--worker3d", help=argparse.SUPPRESS)  # the same, one rank of the 3D job
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--job-run", dest="run", help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--run", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(None if args.worker == "none" else args.worker, args)))
        return
    if args.worker3d:
        found = worker_3d(None if args.worker3d == "none" else args.worker3d, args)
        (args.out / f"rank-{os.environ['RANK']}.json").write_text(json.dumps(found))
        return

    from rich.console import Console
    from rich.table import Table

    sys.path.insert(0, str(ROOT))
    from rankwatch.launch import wait_healthy

    if args.baseline and not (args.baseline / "agent" / "__init__.py").is_file():
        parser.error(f"--baseline {args.baseline}: no agent/ package there")
    variants = {"no agent": "none", "agent": str(ROOT), "agent, zero-code": AUTO}
    if args.baseline:
        variants["baseline agent"] = str(args.baseline.resolve())
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    results: dict[str, list[dict]] = {name: [] for name in variants}
    with tempfile.TemporaryDirectory() as tmp:
        collector = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "rankwatch",
                "collector",
                "--db",
                f"{tmp}/a.duckdb",
                "--port",
                str(port),
                "--token",
                TOKEN,
            ],
            stdout=subprocess.DEVNULL,
        )
        try:
            wait_healthy(url, collector)
            names = list(variants)
            for r in range(args.rounds):
                for name in names[r % len(names) :] + names[: r % len(names)]:
                    run = f"overhead-{r}-{len(results[name])}-{name.replace(' ', '-').replace(',', '')}"
                    if args.job == "3d":
                        results[name].append(run_3d(variants[name], url, run, args, Path(tmp)))
                        continue
                    out = subprocess.run(
                        [
                            sys.executable,
                            __file__,
                            "--worker",
                            variants[name],
                            "--url",
                            url,
                            "--run",
                            f"overhead-{r}-{len(results[name])}-{name.replace(' ', '-')}",
                            "--steps",
                            str(args.steps),
                            "--warmup",
                            str(args.warmup),
                            "--model",
                            args.model,
                            "--batch",
                            str(args.batch),
                        ],
                        capture_output=True,
                        text=True,
                        env={**os.environ, "OMP_NUM_THREADS": "1"},
                        cwd=tmp,
                    )
                    if out.returncode:
                        sys.exit(f"{name} run failed:\n{out.stderr}")
                    results[name].append(json.loads(out.stdout.splitlines()[-1]))
        finally:
            collector.terminate()
            collector.wait()

    console = Console()
    none = results["no agent"]
    if args.job == "3d":
        report_3d(console, results, args)
        return
    table = Table("variant", "wall ms/step", "wall ratio", "CPU ms/step", "CPU ratio", "agent CPU µs/step")
    for name, runs in results.items():

        def ratio(key: str) -> float:
            return statistics.median(run[key] / base[key] for run, base in zip(runs, none))

        own = ""  # the agent's own CPU per step: of the loop's own calls
        if name != "no agent" and runs[0]["empty"] is not None:
            own = f"{statistics.median(run['empty'] - base['empty'] for run, base in zip(runs, none)) * 1e6:.0f}"
        table.add_row(
            name,
            f"{statistics.median(r['wall'] for r in runs) * 1e3:.2f}",
            f"{ratio('wall'):.4f}",
            f"{statistics.median(r['cpu'] for r in runs) * 1e3:.2f}",
            f"{ratio('cpu'):.4f}",
            own,
        )
    console.print(table)
    console.print(
        f"GPT {args.model}, batch {args.batch}, {args.steps} steps per run, {args.rounds} rounds; ratios "
        f"and the agent's CPU per step (a tiny DDP step with 8 buckets, 4 phases, a record, export "
        f"included; less the same without the agent) are medians over rounds"
    )


def report_3d(console, results: dict[str, list[dict]], args) -> None:
    from rich.table import Table

    none = results["no agent"]
    table = Table("variant", "wall ms/step", "wall ratio", "CPU ms/step (a rank)", "agent CPU ms/step", "of step time")
    for name, runs in results.items():
        extra = [run["cpu"] - base["cpu"] for run, base in zip(runs, none)]
        share = statistics.median(e / run["wall"] for e, run in zip(extra, runs))
        wall = statistics.median(run["wall"] / base["wall"] for run, base in zip(runs, none))
        table.add_row(
            name,
            f"{statistics.median(r['wall'] for r in runs) * 1e3:.1f}",
            f"{wall:.3f}",
            f"{statistics.median(r['cpu'] for r in runs) * 1e3:.2f}",
            "" if name == "no agent" else f"{statistics.median(extra) * 1e3:.2f}",
            "" if name == "no agent" else f"{100 * share:.2f}%",
        )
    console.print(table)
    console.print(
        f"8 ranks, dp 2 x tp 2 x pp 2, GPT {args.model}, batch {args.batch} (4 microbatches), {args.steps} steps "
        f"per run, {args.rounds} rounds; each figure the median over a run's ranks, then over rounds; the "
        f"agent's CPU: a rank's CPU per step less the same round's run without the agent"
    )


if __name__ == "__main__":
    main()
