"""Agent overhead: the same training run without the agent, with it (the loop's own calls), and with
it zero-code (`rankwatch run`: the loop unchanged, rankwatch/agent/auto.py's hooks), alternating; with
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
import importlib
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
MANY_BUCKETS = 16  # a second empty loop's buckets: the cost of one more bucket
AUTO = "auto"  # the zero-code variant's worker


def _nothing(name):
    return nullcontext()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def agent_of(agent_dir: str | None):
    """The agent package of this checkout, or of the checkout `agent_dir` (`rankwatch/agent/`, or `agent/` in
    one from before it moved there): imported from that checkout."""
    root = Path(agent_dir) if agent_dir not in (None, AUTO) else ROOT
    sys.path.insert(0, str(root))
    name = "rankwatch.agent" if (root / "rankwatch" / "agent").is_dir() else "agent"
    return importlib.import_module(name)


def timed(one_step, args, agent) -> tuple[list[float], float]:
    """`args.warmup` steps, then `args.steps` timed: their wall times, and the process's CPU per step
    (the agent's shutdown, which exports the last spans, included: its cost too)."""
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

    agent = agent_of(agent_dir)
    from trainer.data import TokenStream
    from trainer.model import CONFIGS, GPT

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)

    explicit = agent_dir not in (None, AUTO)  # the loop calls the agent itself
    step_of, phase_of = (agent.step, agent.phase) if explicit else (_nothing, _nothing)
    record = agent.record if explicit else (lambda **values: None)
    if agent_dir == AUTO:  # as `rankwatch run` does: the session starts at the model's first forward
        from rankwatch.agent import auto

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

    times, cpu = timed(one_step, args, agent)
    if agent_dir == AUTO:
        dist.destroy_process_group()
        return {"wall": statistics.median(times), "cpu": cpu, "empty": None}

    buckets = len(ddp._get_ddp_logging_data()["bucket_sizes"].split(","))  # the training run's gradient buckets
    empty = {n: empty_loop(agent, start, n, args) for n in (buckets, MANY_BUCKETS)}
    dist.destroy_process_group()
    per_bucket = (empty[MANY_BUCKETS][0] - empty[buckets][0]) / (MANY_BUCKETS - buckets)
    return {
        "wall": statistics.median(times),
        "cpu": cpu,
        "buckets": buckets,
        "empty": empty[buckets][0],
        "node_empty": empty[buckets][1],
        "per_bucket": per_bucket,
    }


def empty_loop(agent, start, buckets: int, args) -> tuple[float, float | None]:
    """The agent's calls around a tiny DDP step of `buckets` gradient buckets, EMPTY_STEPS times: the
    process's CPU per step (all its threads, the shutdown's export included), and the node's sidecar's
    CPU per step over the same steps (None without one), read once it has settled."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    tiny = torch.nn.Sequential(*[torch.nn.Linear(4, 4, bias=False) for _ in range(buckets)])
    tiny_ddp = DistributedDataParallel(tiny, bucket_cap_mb=1e-5)  # a bucket per layer
    x = torch.randn(2, 4)
    for _ in range(3):  # DDP rebuilds its buckets after the first step
        tiny_ddp(x).sum().backward()
    start(f"{args.run}-empty-{buckets}", tiny_ddp)
    node_started = node_cpu(args.node_pid)
    started = time.process_time()
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
    cpu = (time.process_time() - started) / EMPTY_STEPS
    if node_started is None:
        return cpu, None
    settled, give_up = node_started, time.monotonic() + 30
    while time.monotonic() < give_up:  # until its work on these steps is done: its CPU time stops rising
        time.sleep(0.5)
        now = node_cpu(args.node_pid)
        if now == settled != node_started:
            break
        settled = now
    return cpu, (settled - node_started) / EMPTY_STEPS


def node_cpu(pid: int | None) -> float | None:
    """The CPU seconds the process `pid` has used, all its threads (None without one)."""
    if not pid:
        return None
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def worker_3d(agent_dir: str | None, args) -> dict:
    """One rank of the 3D job (under torchrun): its median step time and CPU per step."""
    import torch
    import torch.distributed as dist

    agent = agent_of(agent_dir)
    from trainer.data import TokenStream
    from trainer.layout import Layout
    from trainer.model import CONFIGS, GPT
    from trainer.threed import ThreeD

    torch.set_num_threads(1)
    explicit = agent_dir not in (None, AUTO)
    if agent_dir == AUTO:
        from rankwatch.agent import auto

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

    times, cpu = timed(one_step, args, agent)
    dist.destroy_process_group()
    return {"wall": statistics.median(times), "cpu": cpu, "empty": None}


def run_3d(variant: str, url: str, run: str, args, out: Path, env: dict) -> dict:
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
    done = subprocess.run(command, capture_output=True, text=True, env=env)
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
    parser.add_argument("--node-pid", type=int, help=argparse.SUPPRESS)  # the sidecar the worker's agent uses
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

    if args.baseline and not any((args.baseline / d / "__init__.py").is_file() for d in ("rankwatch/agent", "agent")):
        parser.error(f"--baseline {args.baseline}: no agent package there (rankwatch/agent/, or agent/)")
    # each variant: the agent it runs (none, a checkout's, zero-code) and whether its ranks hand their telemetry
    # to the node's sidecar (as under `rankwatch run` and `rankwatch train`) or export it themselves
    variants = {
        "no agent": ("none", False),
        "agent, own export": (str(ROOT), False),
        "agent, sidecar": (str(ROOT), True),
        "agent, zero-code, sidecar": (AUTO, True),
    }
    if args.baseline:
        variants["baseline agent"] = (str(args.baseline.resolve()), False)
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
        socket_path = Path(tmp, "node.sock")
        node = subprocess.Popen(
            [sys.executable, "-m", "rankwatch", "node", "--socket", str(socket_path), "--collector", url],
            env={**os.environ, "RANKWATCH_TOKEN": TOKEN},
        )
        try:
            wait_healthy(url, collector)
            while not socket_path.exists():
                if node.poll() is not None:
                    sys.exit("the node's sidecar did not start")
                time.sleep(0.1)
            names = list(variants)
            for r in range(args.rounds):
                for name in names[r % len(names) :] + names[: r % len(names)]:
                    agent_dir, sidecar = variants[name]
                    env = {**os.environ, "OMP_NUM_THREADS": "1", "RANKWATCH_NODE": str(socket_path) if sidecar else ""}
                    run = f"overhead-{r}-{len(results[name])}-{name.replace(' ', '-').replace(',', '')}"
                    if args.job == "3d":
                        results[name].append(run_3d(agent_dir, url, run, args, Path(tmp), env))
                        continue
                    out = subprocess.run(
                        [
                            *(sys.executable, __file__, "--worker", agent_dir, "--url", url, "--run", run),
                            *("--steps", str(args.steps), "--warmup", str(args.warmup), "--model", args.model),
                            *("--batch", str(args.batch), *(["--node-pid", str(node.pid)] if sidecar else [])),
                        ],
                        capture_output=True,
                        text=True,
                        env=env,
                        cwd=tmp,
                    )
                    if out.returncode:
                        sys.exit(f"{name} run failed:\n{out.stderr}")
                    results[name].append(json.loads(out.stdout.splitlines()[-1]))
        finally:
            for process in (node, collector):
                process.terminate()
                process.wait()

    console = Console()
    if args.job == "3d":
        report_3d(console, results, args)
        return
    none = results["no agent"]
    figures: dict[str, dict] = {}
    table = Table(
        "variant", "wall ms/step", "wall ratio", "CPU ms/step", "CPU ratio", "own CPU µs/step", "µs/bucket", "sidecar"
    )
    for name, runs in results.items():

        def ratio(key: str) -> float:
            return statistics.median(run[key] / base[key] for run, base in zip(runs, none))

        def less_none(key: str) -> float | None:
            if name == "no agent" or runs[0].get(key) is None:
                return None
            return statistics.median(
                run[key] - (base[key] if key != "node_empty" else 0) for run, base in zip(runs, none)
            )

        own, bucket, node_cpu_s = less_none("empty"), less_none("per_bucket"), less_none("node_empty")
        figures[name] = {
            "wall_ms": statistics.median(r["wall"] for r in runs) * 1e3,
            "wall_ratio": ratio("wall"),
            "cpu_ratio": ratio("cpu"),
            "own_cpu_us_per_step": None if own is None else own * 1e6,
            "us_per_bucket": None if bucket is None else bucket * 1e6,
            "node_cpu_us_per_step": None if node_cpu_s is None else node_cpu_s * 1e6,
        }
        table.add_row(
            name,
            f"{figures[name]['wall_ms']:.2f}",
            f"{ratio('wall'):.4f}",
            f"{statistics.median(r['cpu'] for r in runs) * 1e3:.2f}",
            f"{ratio('cpu'):.4f}",
            *("" if v is None else f"{v * 1e6:.0f}" for v in (own, bucket, node_cpu_s)),
        )
    console.print(table)
    console.print(
        f"GPT {args.model}, batch {args.batch}, {args.steps} steps per run, {args.rounds} rounds; ratios and the "
        f"agent's own CPU per step (the rank's threads: a tiny DDP step with the training run's "
        f"{none[0]['buckets']} gradient bucket(s), 4 phases, a record, export included; less the same without the "
        f"agent), each bucket more, and the sidecar's CPU over the same steps, are medians over rounds"
    )
    chosen = figures["agent, sidecar"]
    print(json.dumps({"job": "ddp", **chosen, "variants": figures}))


def report_3d(console, results: dict[str, list[dict]], args) -> None:
    from rich.table import Table

    none = results["no agent"]
    table = Table("variant", "wall ms/step", "wall ratio", "CPU ms/step (a rank)", "agent CPU ms/step", "of step time")
    figures: dict[str, dict] = {}
    for name, runs in results.items():
        extra = [run["cpu"] - base["cpu"] for run, base in zip(runs, none)]
        share = statistics.median(e / run["wall"] for e, run in zip(extra, runs))
        wall = statistics.median(run["wall"] / base["wall"] for run, base in zip(runs, none))
        figures[name] = {
            "wall_ratio": wall,
            "own_cpu_share_of_step": share,
            "own_cpu_ms_per_step": statistics.median(extra) * 1e3,
        }
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
    print(json.dumps({"job": "3d", **figures["agent, sidecar"], "variants": figures}))


if __name__ == "__main__":
    main()
