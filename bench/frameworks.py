"""Zero-code instrumentation on the frameworks users train with: what it costs a step, and whether it
records everything. Each installed framework's job (tests/jobs/: a Hugging Face Trainer on a tiny GPT-2, a
Lightning module under DDP, both accumulating gradients over `--accum` micro-batches, and the plain
PyTorch DDP script) runs on 2 ranks (torchrun, gloo) alone and under `rankwatch run` against a real
collector on loopback, the two taking turns (the order swapped every round), with the same seeds,
`--rounds` times.

A run's step time is the median over its ranks' steps, past `--warmup`, of the time between one
optimizer step's end and the next's, by the job's own clock: the framework's own callbacks (the JSON
each rank of the framework jobs writes), and for the plain script, which keeps none, an optimizer step
hook of this file's around it (`--clock`, in both variants); its CPU per step likewise, from the
process's CPU time (all its threads: the agent's export too), which other load on a shared machine
disturbs far less than the wall clock, and the training thread's alone (`thread_cpu`: what the agent's
hooks add to the thread that trains). Beside the ranks, the instrumented runs' node sidecar (its CPU up
to 0.1 s before it exits, its start included) and the collector (its CPU over the run) are read from
/proc, per optimizer step of the job: what they take from a machine whose cores the ranks also use.
Once the collector has stopped, each instrumented run is checked
in its store: every optimizer step of each rank recorded once (`steps`), with the loss the framework
reported for it (`loss`: Lightning's per rank, the Trainer's the mean over the ranks; for the plain
script, a loss on every step), and its phases (`phases`: a forward and a backward per micro-batch, then
the optimizer, each lasting).

The last line printed is one JSON object: for each job, the median over rounds of each variant's step
time, CPU and training thread's CPU per step (ms), the medians over rounds of their ratios, the sidecar's
and the collector's CPU per step (ms), and whether every instrumented run was complete.

With --cuda the jobs run on this machine's GPUs, a rank each (NCCL; the Trainer's GPT-2 at 124M parameters,
bf16), as bench/gpu_checks.sh runs them.

Usage: python bench/frameworks.py [--rounds 3] [--steps 30] [--warmup 5] [--accum 4] [--cuda]
"""

import argparse
import importlib.util
import itertools
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from rankwatch.launch import wait_healthy  # noqa: E402
from tests.support.proc_cpu import cpu_s  # noqa: E402

JOBS = ROOT / "tests" / "jobs"
TORCHRUN = str(Path(sys.executable).parent / "torchrun")
TOKEN = "bench-token-0123456789"
RUN_TIMEOUT_S = 600  # one run of a job, plain or instrumented
RANKS = 2  # on CPUs (with --cuda: a rank per GPU)


@dataclass(frozen=True)
class Job:
    name: str
    script: Path
    needs: tuple[str, ...]  # the packages it imports
    accumulates: bool  # takes --accum
    loss: str | None  # what its JSON's loss is: "rank" (each rank's own), "mean" (the ranks'), None: none kept


JOB_LIST = (
    Job("hf_trainer", JOBS / "hf_trainer.py", ("transformers", "accelerate"), True, "mean"),
    Job("lightning", JOBS / "lightning_ddp.py", ("lightning",), True, "rank"),
    Job("plain_ddp", JOBS / "plain_ddp.py", (), False, None),
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clock(out: Path, script: str, argv: list[str]) -> None:
    """Run `script` as the main module, noting when each optimizer step ended (a script that keeps no clock
    of its own), written to OUT/rank-<rank>.json as the framework jobs write theirs."""
    import runpy

    from torch.optim.optimizer import register_optimizer_step_post_hook

    ends: list[tuple[float, float, float]] = []
    register_optimizer_step_post_hook(
        lambda *_: ends.append((time.perf_counter(), time.process_time(), time.thread_time()))
    )
    sys.argv = [script, *argv]
    runpy.run_path(script, run_name="__main__")
    out.mkdir(parents=True, exist_ok=True)
    steps = [{"step": i, "end_s": end, "cpu_s": cpu, "thread_cpu_s": own} for i, (end, cpu, own) in enumerate(ends)]
    (out / f"rank-{os.environ.get('RANK', 0)}.json").write_text(json.dumps({"steps": steps}))


def command(job: Job, out: Path, args) -> list[str]:
    """The job's torchrun command line, its JSON to `out`."""
    if job.accumulates:
        script = [str(job.script), "--steps", str(args.steps), "--accum", str(args.accum), "--out", str(out)]
    else:
        script = [__file__, "--clock", str(out), str(job.script), "--steps", str(args.steps)]
    if args.cuda:
        script.append("--cuda")
    return [TORCHRUN, "--standalone", "--nproc-per-node", str(args.ranks), *script]


def sidecar_of(pid: int) -> int | None:
    """The node sidecar (`rankwatch node`) that the `rankwatch run` process `pid` started, if it runs."""
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return None
    for child in map(int, children):
        try:
            if b"\0node\0" in Path(f"/proc/{child}/cmdline").read_bytes():
                return child
        except OSError:
            continue
    return None


def run(job: Job, instrumented: str | None, url: str, tmp: Path, args) -> tuple[dict[int, list[dict]], float]:
    """One run of the job, under `rankwatch run` as run `instrumented` (None: torchrun alone): what each rank saw at
    each step, and the CPU seconds its node sidecar used (to its last reading, 0.1 s before it exited)."""
    out = tmp / (instrumented or f"{job.name}-plain-{time.monotonic_ns()}")
    line = command(job, out, args)
    if instrumented:
        line = [sys.executable, "-m", "rankwatch", "run", "--collector", url, "--run", instrumented, "--", *line]
    env = {**os.environ, "RANKWATCH_TOKEN": TOKEN}
    with open(tmp / "job.log", "w+") as log:
        process = subprocess.Popen(line, stdout=log, stderr=subprocess.STDOUT, cwd=tmp, env=env)
        sidecar, sidecar_s, deadline = None, 0.0, time.monotonic() + RUN_TIMEOUT_S
        try:
            while process.poll() is None:  # (a plain run has no sidecar: this only waits)
                if time.monotonic() > deadline:
                    sys.exit(f"{job.name} ({'instrumented' if instrumented else 'plain'}) ran past {RUN_TIMEOUT_S} s")
                sidecar = sidecar or sidecar_of(process.pid)
                sidecar_s = max(sidecar_s, cpu_s(sidecar)) if sidecar else 0.0
                time.sleep(0.1)
        finally:
            process.kill()
        if process.returncode:
            log.seek(0)
            sys.exit(f"{job.name} ({'instrumented' if instrumented else 'plain'}) failed:\n{log.read()[-3000:]}")
    seen = {rank: json.loads((out / f"rank-{rank}.json").read_text())["steps"] for rank in range(args.ranks)}
    return seen, sidecar_s


def step_ms(seen: dict[int, list[dict]], warmup: int, clock: str = "end_s") -> float:
    """The median time between consecutive optimizer steps' ends, past the warmup, over the ranks (`cpu_s`:
    the process's CPU time between them, its every thread's)."""
    gaps = [
        (b[clock] - a[clock]) * 1e3
        for steps in seen.values()
        for a, b in itertools.pairwise(steps)
        if a["step"] >= warmup
    ]
    return statistics.median(gaps)


def complete(con, job: Job, run_id: str, seen: dict[int, list[dict]], args) -> dict[str, bool]:
    """Whether the store holds each optimizer step of each rank once, with its loss and its phases."""
    steps, ranks = args.steps, range(args.ranks)
    rows = con.execute("SELECT rank, step, loss FROM steps WHERE run_id = ? ORDER BY rank, step", [run_id]).fetchall()
    by_rank = {rank: [(step, loss) for r, step, loss in rows if r == rank] for rank in ranks}
    once = all([step for step, _ in by_rank[rank]] == list(range(steps)) for rank in ranks)
    stored = {rank: [loss for _, loss in by_rank[rank]] for rank in ranks}
    if not once or any(loss is None for losses in stored.values() for loss in losses):
        loss_right = False
    elif job.loss == "rank":
        loss_right = all(close(stored[rank], [s["loss"] for s in seen[rank]]) for rank in ranks)
    elif job.loss == "mean":
        means = [statistics.fmean(losses) for losses in zip(*stored.values())]
        loss_right = close(means, [s["loss"] for s in seen[0]])
    else:
        loss_right = True
    phases = con.execute(
        """SELECT rank, step, list(name ORDER BY start_ts), bool_and(duration_s > 0) FROM ops
           WHERE run_id = ? AND kind = 'phase' GROUP BY rank, step ORDER BY rank, step""",
        [run_id],
    ).fetchall()
    micro = ["forward", "backward"] * (args.accum if job.accumulates else 1)
    expected = [(r, s, ["data"] * (s > 0) + [*micro, "optimizer"], True) for r in ranks for s in range(steps)]
    return {"steps": once, "loss": loss_right, "phases": phases == expected}


def close(stored: list[float], seen: list[float]) -> bool:
    """Equal but for float32 sums and the Trainer's rounding of its logged loss to 4 decimals."""
    return len(stored) == len(seen) and all(abs(a - b) <= max(1e-4 * abs(b), 1e-4) for a, b in zip(stored, seen))


def medians(by_variant: dict[str, list[float]], prefix: str = "") -> dict[str, float]:
    """Each variant's median over rounds, and the median over rounds of their ratio."""
    plain, instrumented = by_variant["plain"], by_variant["instrumented"]
    return {
        f"plain_{prefix}ms": round(statistics.median(plain), 3),
        f"instrumented_{prefix}ms": round(statistics.median(instrumented), 3),
        f"{prefix}ratio": round(statistics.median(i / p for i, p in zip(instrumented, plain)), 4),
    }


def main() -> None:
    if sys.argv[1:2] == ["--clock"]:  # a rank of the plain job (torchrun runs this file so)
        clock(Path(sys.argv[2]), sys.argv[3], sys.argv[4:])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps a run")
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the step time")
    parser.add_argument("--accum", type=int, default=4, help="micro-batches a step (the framework jobs)")
    parser.add_argument("--cuda", action="store_true", help="the jobs on this machine's GPUs (a rank each), NCCL")
    args = parser.parse_args()
    args.ranks = RANKS
    if args.cuda:
        import torch

        args.ranks = torch.cuda.device_count()
        if not args.ranks:
            parser.exit(2, "bench/frameworks.py: --cuda: torch sees no GPU on this machine\n")
    if args.steps < args.warmup + 2:
        parser.error("--steps must exceed --warmup by 2 or more")

    import duckdb

    jobs = [job for job in JOB_LIST if all(importlib.util.find_spec(p) for p in job.needs)]
    skipped = {job.name: f"needs {', '.join(job.needs)}" for job in JOB_LIST if job not in jobs}
    times: dict[str, dict[str, list[float]]] = {job.name: {"plain": [], "instrumented": []} for job in jobs}
    cpu: dict[str, dict[str, list[float]]] = {job.name: {"plain": [], "instrumented": []} for job in jobs}
    thread: dict[str, dict[str, list[float]]] = {job.name: {"plain": [], "instrumented": []} for job in jobs}
    # the CPU per optimizer step of the processes beside the ranks: the node's sidecar and the collector
    beside: dict[str, dict[str, list[float]]] = {job.name: {"sidecar": [], "collector": []} for job in jobs}
    seen_by_run: dict[str, tuple[Job, dict]] = {}
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as tmp:
        db = Path(tmp) / "frameworks.duckdb"
        collector = subprocess.Popen(
            [sys.executable, "-m", "rankwatch", "collector", "--db", str(db), "--port", str(port), "--token", TOKEN],
            stdout=subprocess.DEVNULL,
        )
        try:
            wait_healthy(url, collector)
            for r in range(args.rounds):
                for job in jobs:
                    for variant in ("plain", "instrumented")[:: 1 if r % 2 == 0 else -1]:
                        run_id = f"{job.name}-{r}" if variant == "instrumented" else None
                        collector_before = cpu_s(collector.pid)
                        seen, sidecar_s = run(job, run_id, url, Path(tmp), args)
                        times[job.name][variant].append(step_ms(seen, args.warmup))
                        cpu[job.name][variant].append(step_ms(seen, args.warmup, "cpu_s"))
                        thread[job.name][variant].append(step_ms(seen, args.warmup, "thread_cpu_s"))
                        if run_id:
                            seen_by_run[run_id] = (job, seen)
                            beside[job.name]["sidecar"].append(sidecar_s * 1e3 / args.steps)
                            collector_s = cpu_s(collector.pid) - collector_before
                            beside[job.name]["collector"].append(collector_s * 1e3 / args.steps)
                        print(
                            f"round {r} {job.name} {variant}: {times[job.name][variant][-1]:.2f} ms/step, "
                            f"CPU {cpu[job.name][variant][-1]:.2f} ms/step",
                            flush=True,
                        )
        finally:
            collector.terminate()
            collector.wait()
        con = duckdb.connect(str(db), read_only=True)
        checks = {run_id: complete(con, job, run_id, seen, args) for run_id, (job, seen) in seen_by_run.items()}
        con.close()

    result: dict = {"rounds": args.rounds, "steps": args.steps, "warmup": args.warmup, "accum": args.accum, "jobs": {}}
    for job in jobs:
        ran = [checks[f"{job.name}-{r}"] for r in range(args.rounds)]
        result["jobs"][job.name] = {
            **medians(times[job.name]),
            **medians(cpu[job.name], "cpu_"),
            **medians(thread[job.name], "thread_cpu_"),
            **{f"{who}_cpu_ms": round(statistics.median(ms), 3) for who, ms in beside[job.name].items()},
            "complete": all(all(check.values()) for check in ran),
            **{what: all(check[what] for check in ran) for what in ("steps", "loss", "phases")},
        }
        print(f"{job.name}: {result['jobs'][job.name]}")
    result["skipped"] = skipped
    print(json.dumps(result))


if __name__ == "__main__":
    main()
