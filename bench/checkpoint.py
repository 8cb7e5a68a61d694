"""Checkpoint cost: torch.save, torch.distributed.checkpoint's save and async_save, and
trainer/checkpoint.py, side by side on the same training state and loop.

The state is a model of many small parameters and a few large ones with its
AdamW state (parameters and both moments: about `--sizes` MB). A simulated
training loop runs `--steps` steps (matrix products standing in for forward
and backward, then the real optimizer step) and checkpoints every `--every`
steps to disk; each method runs in its own process (gloo, world size 1, for
DCP), so that its peak RSS is its own. Forward and backward take
`--compute-ms-per-mb` per MB of state: 4 ms is what the reference GPT small
(25M parameters, 300 MB of state) takes per step on the 2-core machine of
docs/benchmarks.md, 1.2 s at batch 2. Per method:
- blocked: training-loop time each checkpoint costs (median over checkpoints,
  and the first one apart): the save call; for async_save also a wait for the
  previous save; for ours the snapshot call and the wait before the next
  optimizer step;
- ring: ours allocates its ring of host buffers before the loop (the trainer
  makes it in the background), timed apart;
- staging: the part of it spent making the copy the save works from: the
  async_save call itself (DCP's staging), our snapshot call;
- durable: from the checkpoint's start until its files are fsync'd (median);
- step p50 / p99: wall time of every training step, background work included;
- peak RSS during training, and above the state alone;
- restore: from host memory (ours), and from disk with the files evicted from
  the page cache first (posix_fadvise DONTNEED), into the live model and optimizer.

With `--device cuda` it measures what checkpoints cost a real GPU training
loop instead: GPT-2 (124M parameters, `--model`) with AdamW under bf16
autocast, its training time over `--steps` steps (after warm-up steps that
take one checkpoint, and for ours its ring allocated, so that every method's
buffers exist) with no
checkpoints, and with a snapshot every 10 steps and every step by torch.save,
DCP async_save, DCP async_save with pinned-memory staging (torchtitan's
"async_with_pinned_mem": a DefaultStager with pinned, shared memory and a
saving process), and trainer/checkpoint.py (every snapshot in memory, one in
10 to disk); each against no checkpoints, in one run.

Usage: python bench/checkpoint.py [--sizes 100 1000] [--steps 36] [--every 6] [--compute-ms-per-mb 4]
       python bench/checkpoint.py --device cuda [--model gpt2] [--batch 8] [--steps 60]
"""

import argparse
import json
import logging
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from trainer.checkpoint import Checkpointer

METHODS = ("torch.save", "dcp.save", "dcp.async_save", "rankwatch")
SMALL = (64, 256, 1024, 4096)  # floats: the sizes of the many small tensors, in turn


def build(mb: float) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A model whose parameters and AdamW moments come to `mb` MB: 2,000 small tensors, 4 large ones."""
    floats = int(mb * 1e6 / 4 / 3)
    small = [SMALL[i % len(SMALL)] for i in range(2000)]
    large = [(floats - sum(small)) // 4] * 4
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(n) * 0.02) for n in small + large])
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)  # fixed gradients: the optimizer step's work, not its learning
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    optimizer.step()  # the moments exist from here on
    return model, optimizer


def product_s() -> float:
    """The time of one 256x256 matrix product on this machine, alone: the unit of simulated compute."""
    a = torch.randn(256, 256)
    started = time.perf_counter()
    for _ in range(200):
        a @ a
    return (time.perf_counter() - started) / 200


def evict(path: Path) -> None:
    """Drop a checkpoint's files from the page cache, so that a restore reads the disk."""
    for file in [path] if path.is_file() else [f for f in path.rglob("*") if f.is_file()]:
        fd = os.open(file, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def state_dict(model, optimizer) -> dict:
    return {"model": model.state_dict(), "optim": optimizer.state_dict()}


def load(model, optimizer, state: dict) -> None:
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optim"])


class TorchSave:
    """torch.save to one file, fsync'd: the training loop waits for all of it."""

    def __init__(self, directory: Path, model, optimizer):
        self.directory, self.model, self.optimizer = directory, model, optimizer
        self.durable: list[float] = []
        self.staging: list[float] = []  # the methods that copy the state before saving it

    def before_update(self) -> None:
        pass

    def save(self, step: int) -> None:
        started = time.perf_counter()
        with open(self.directory / f"step-{step}.pt", "wb") as f:
            torch.save(state_dict(self.model, self.optimizer), f)
            f.flush()
            os.fsync(f.fileno())
        self.durable.append(time.perf_counter() - started)

    def restore_from_disk(self, step: int) -> None:
        evict(self.directory / f"step-{step}.pt")
        load(self.model, self.optimizer, torch.load(self.directory / f"step-{step}.pt", weights_only=True))

    def close(self) -> None:
        pass


class DcpSave(TorchSave):
    """torch.distributed.checkpoint.save: one file per rank and a metadata file, fsync'd."""

    def save(self, step: int) -> None:
        import torch.distributed.checkpoint as dcp

        started = time.perf_counter()
        dcp.save(state_dict(self.model, self.optimizer), checkpoint_id=self.directory / f"step-{step}")
        self.durable.append(time.perf_counter() - started)

    def restore_from_disk(self, step: int) -> None:
        import torch.distributed.checkpoint as dcp

        evict(self.directory / f"step-{step}")
        state = state_dict(self.model, self.optimizer)
        dcp.load(state, checkpoint_id=self.directory / f"step-{step}")
        load(self.model, self.optimizer, state)


class DcpAsyncSave(DcpSave):
    """torch.distributed.checkpoint.async_save: staged to CPU memory in the call, written by a thread;
    one save in flight at a time (DCP's rule), so a checkpoint first waits for the previous one."""

    def __init__(self, *args):
        super().__init__(*args)
        self.pending = None

    def save(self, step: int) -> None:
        import torch.distributed.checkpoint as dcp

        if self.pending:
            self.pending.result()
        started = time.perf_counter()
        self.pending = dcp.async_save(
            state_dict(self.model, self.optimizer), checkpoint_id=self.directory / f"step-{step}"
        )
        self.staging.append(time.perf_counter() - started)
        self.pending.add_done_callback(lambda _: self.durable.append(time.perf_counter() - started))

    def close(self) -> None:
        if self.pending:
            self.pending.result()


class DurableTimes(logging.Handler):
    """trainer/checkpoint.py's log line for each checkpoint made durable: the seconds it took."""

    def __init__(self, durable: list[float]):
        super().__init__()
        self.durable = durable
        logging.getLogger("trainer.checkpoint").addHandler(self)
        logging.getLogger("trainer.checkpoint").setLevel(logging.INFO)

    def emit(self, record: logging.LogRecord) -> None:
        if record.msg.startswith("checkpoint: step %d durable"):
            self.durable.append(record.args[-1])


class Ours(TorchSave):
    """trainer/checkpoint.py: every checkpoint a snapshot flushed to disk."""

    def __init__(self, directory: Path, model, optimizer):
        super().__init__(directory, model, optimizer)
        DurableTimes(self.durable)
        self.ckpt = self.checkpointer()
        started = time.perf_counter()
        self.ckpt.reserve(wait=True)  # the state is complete: build() took an optimizer step
        self.ring_s = time.perf_counter() - started

    def checkpointer(self) -> Checkpointer:
        return Checkpointer(
            self.directory, {"model": self.model, "optimizer": self.optimizer}, memory=2, disk_every=1, keep=2
        )

    def before_update(self) -> None:
        self.ckpt.wait_until_safe()

    def save(self, step: int) -> None:
        started = time.perf_counter()
        self.ckpt.snapshot(step)
        self.staging.append(time.perf_counter() - started)

    def restore_from_memory(self, step: int) -> None:
        assert self.ckpt.restore(step) == step

    def restore_from_disk(self, step: int) -> None:
        evict(self.directory)
        fresh = self.checkpointer()
        assert fresh.restore(step) == step
        fresh.close()

    def close(self) -> None:
        self.ckpt.close()


def run(method: str, mb: float, steps: int, every: int, work: int, directory: Path) -> dict:
    """One method's figures, in its own process."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    torch.manual_seed(0)
    model, optimizer = build(mb)
    state_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    saver = dict(zip(METHODS, (TorchSave, DcpSave, DcpAsyncSave, Ours)))[method](directory, model, optimizer)
    a = torch.randn(256, 256)
    step_s, blocked = [], []
    for step in range(steps + 1):  # the last one only up to its wait: what the last checkpoint costs it
        started = time.perf_counter()
        for _ in range(work):
            a @ a
        waited = time.perf_counter()
        saver.before_update()
        if step % every == 0 and blocked:  # the wait before the update after a checkpoint is its cost too
            blocked[-1] += time.perf_counter() - waited
        if step == steps:
            break
        optimizer.step()
        if (step + 1) % every == 0:
            saving = time.perf_counter()
            saver.save(step + 1)
            blocked.append(time.perf_counter() - saving)
        step_s.append(time.perf_counter() - started)
    saver.close()
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    restores = {}
    if isinstance(saver, Ours):
        started = time.perf_counter()
        saver.restore_from_memory(steps)
        restores["memory"] = time.perf_counter() - started
    started = time.perf_counter()
    saver.restore_from_disk(steps)
    restores["disk"] = time.perf_counter() - started
    dist.destroy_process_group()
    q = statistics.quantiles(step_s, n=100)
    nbytes = sum(t.numel() * t.element_size() for t in model.parameters()) + sum(
        t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
    )
    return {
        "method": method,
        "state_mb": nbytes / 1e6,
        "blocked_s": statistics.median(blocked),
        "first_blocked_s": blocked[0],
        "ring_s": saver.ring_s if isinstance(saver, Ours) else None,
        "staging_s": statistics.median(saver.staging) if saver.staging else None,
        "durable_s": statistics.median(saver.durable),
        "checkpoints": len(blocked),
        "step_p50_s": q[49],
        "step_p99_s": q[98],
        "peak_rss_mb": peak_rss,
        "state_rss_mb": state_rss,
        "restore_memory_s": restores.get("memory"),
        "restore_disk_s": restores["disk"],
    }


GPU_METHODS = ("none", "rankwatch", "torch.save", "dcp.async_save", "dcp.async_save pinned")  # ours first


class GpuSaver:
    """One way to checkpoint, in the GPU loop: `save` after an optimizer step, `before_update` before the next."""

    def __init__(self, method: str, directory: Path, model, optimizer):
        self.method, self.directory, self.model, self.optimizer = method, directory, model, optimizer
        self.pending, self.staging, self.stager, self.ckpt = None, None, None, None
        if method == "dcp.async_save pinned":
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            self.stager = DefaultStager(
                StagingOptions(
                    use_pinned_memory=True, use_shared_memory=True, use_async_staging=True, use_non_blocking_copy=True
                )
            )
        if method == "rankwatch":
            self.ckpt = Checkpointer(
                directory, {"model": model, "optimizer": optimizer}, memory=4, disk_every=10, keep=2
            )  # the trainer's default ring

    def prepare(self) -> None:
        """Before the timed steps: our ring allocated (the trainer makes it in the background, skipping
        snapshots until it is)."""
        if self.ckpt:
            self.ckpt.reserve(wait=True)

    def before_update(self) -> None:
        if self.staging is not None:  # DCP's staging must be done before the tensors change
            self.staging.result()
            self.staging = None
        if self.ckpt:
            self.ckpt.wait_until_safe()

    def save(self, step: int) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        if self.method == "torch.save":
            with open(self.directory / "state.pt", "wb") as f:
                torch.save(state_dict(self.model, self.optimizer), f)
        elif self.method.startswith("dcp"):
            if self.pending is not None:  # one save in flight at a time (DCP's rule)
                self.pending.result()
            pinned = self.stager is not None
            response = dcp.async_save(
                state_dict(self.model, self.optimizer),
                checkpoint_id=self.directory / f"step-{step}",
                async_checkpointer_type=AsyncCheckpointerType.PROCESS if pinned else AsyncCheckpointerType.THREAD,
                async_stager=self.stager,
            )
            self.pending, self.staging = (
                (response.upload_completion, response.staging_completion) if pinned else (response, None)
            )
        elif self.ckpt:
            self.ckpt.snapshot(step)

    def close(self) -> None:
        self.before_update()
        if self.pending is not None:
            self.pending.result()
        if self.stager is not None:
            self.stager.close()
        if self.ckpt:
            self.ckpt.close()


def run_gpu(
    method: str, every: int, steps: int, warmup: int, model_name: str, batch: int, device: str, directory: Path
) -> dict:
    """One method's training time on the GPU (or any device), in its own process."""
    import torch.distributed as dist

    from trainer.model import CONFIGS, GPT

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    torch.manual_seed(0)
    model = GPT(CONFIGS[model_name]).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    c = model.config
    tokens = torch.randint(0, c.vocab, (batch, c.seq_len + 1), device=device)
    saver = GpuSaver(method, directory, model, optimizer)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    blocked, started = [], 0.0
    for step in range(warmup + steps):
        if step == warmup:
            saver.prepare()
            sync()
            started = time.perf_counter()
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        t = time.perf_counter()
        saver.before_update()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if method != "none" and ((step + 1) % every == 0 or step + 1 == warmup):
            saver.save(step + 1)
        if step >= warmup:
            blocked.append(time.perf_counter() - t)
    sync()
    train_s = time.perf_counter() - started
    saver.close()
    dist.destroy_process_group()
    nbytes = sum(t.nbytes for t in model.parameters()) + sum(
        t.nbytes for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)
    )
    return {
        "method": method,
        "every": every,
        "state_mb": nbytes / 1e6,
        "train_s": train_s,
        "step_ms": train_s / steps * 1e3,
        "host_ms_per_step": statistics.mean(blocked) * 1e3,
        "device": torch.cuda.get_device_name() if device == "cuda" else device,
    }


def child(what: str, *argv: str, env: dict | None = None, failed: dict | None = None) -> dict:
    """One method's figures, measured in a fresh process of this script (and echoed as they come). A
    run that fails ends the bench, or, given `failed`, is that row with its last error line."""
    out = subprocess.run([sys.executable, __file__, *argv], capture_output=True, text=True, env=env, check=False)
    if out.returncode and failed is None:
        sys.exit(f"{what} failed:\n{out.stderr[-3000:]}")
    if out.returncode:
        error = next((line for line in reversed(out.stderr.splitlines()) if line.strip()), "no output")
        print(f"{what} failed: {error}", flush=True)
        return {**failed, "failed": error.removeprefix("[rank0]: ")}
    row = json.loads(out.stdout.splitlines()[-1])
    print(json.dumps(row), flush=True)
    return row


def gpu_main(args: argparse.Namespace) -> None:
    """Every method at every cadence, each in its own process, side by side with no checkpoints."""
    base = args.dir or Path(tempfile.mkdtemp(prefix="bench-checkpoint-gpu-"))
    rows = []
    for method, every in [("none", 0)] + [(m, e) for e in (10, 1) for m in GPU_METHODS[1:]]:
        directory = base / f"{method.replace(' ', '-')}-{every}"
        directory.mkdir(parents=True)
        rows.append(
            child(
                f"{method} every {every}",
                "--device",
                args.device,
                "--gpu-child",
                method,
                str(every),
                "--steps",
                str(args.steps),
                "--model",
                args.model,
                "--batch",
                str(args.batch),
                "--dir",
                str(directory),
                failed={"method": method, "every": every} if every else None,  # a failed method: said; the rest go on
            )
        )
        shutil.rmtree(directory)
    if not args.dir:
        base.rmdir()
    none = rows[0]["train_s"]
    t = Table(
        title=f"Training time with checkpoints, {rows[0]['device']}, {rows[0]['state_mb']:.0f} MB of "
        f"state, {args.steps} steps"
    )
    for column in ("method", "snapshot every", "training time", "vs none", "step", "host time before/after update"):
        t.add_column(column, justify="left" if column == "method" else "right")
    for r in rows:
        if "failed" in r:
            t.add_row(r["method"], f"{r['every']} steps", f"failed: {r['failed']}")
            continue
        t.add_row(
            r["method"],
            f"{r['every']} steps" if r["every"] else "—",
            f"{r['train_s']:.2f} s",
            f"{r['train_s'] / none:.3f}x",
            f"{r['step_ms']:.1f} ms",
            f"{r['host_ms_per_step']:.1f} ms",
        )
    Console(width=200).print(t)


def ms(seconds: float | None) -> str:
    return "—" if seconds is None else f"{seconds * 1e3:.0f} ms"


def table(rows: list[dict]) -> Table:
    t = Table(title="Checkpoints: time the training loop is blocked, time to durable, restore")
    for column in (
        "state",
        "method",
        "blocked / ckpt",
        "first ckpt",
        "ring",
        "staging",
        "durable",
        "step p50",
        "step p99",
        "peak RSS",
        "RSS over state",
        "restore memory",
        "restore disk",
    ):
        t.add_column(column, justify="left" if column == "method" else "right")
    for r in rows:
        t.add_row(
            f"{r['state_mb']:.0f} MB",
            r["method"],
            ms(r["blocked_s"]),
            ms(r["first_blocked_s"]),
            ms(r["ring_s"]),
            ms(r["staging_s"]),
            f"{r['durable_s']:.2f} s",
            f"{r['step_p50_s'] * 1e3:.0f} ms",
            f"{r['step_p99_s'] * 1e3:.0f} ms",
            f"{r['peak_rss_mb']:.0f} MB",
            f"{r['peak_rss_mb'] - r['state_rss_mb']:.0f} MB",
            ms(r["restore_memory_s"]),
            ms(r["restore_disk_s"]),
        )
    return t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=float, nargs="+", default=[100, 1000], metavar="MB")
    p.add_argument("--steps", type=int, default=36)
    p.add_argument("--every", type=int, default=6, help="steps between checkpoints")
    p.add_argument(
        "--compute-ms-per-mb", type=float, default=4.0, help="forward + backward stand-in per step, per MB of state"
    )
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    p.add_argument("--dir", type=Path, help="where checkpoints go (default: a temporary directory)")
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)  # METHOD MB WORK: one run, JSON out
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cuda: a real GPT training loop on the GPU instead of the simulated CPU one",
    )
    p.add_argument("--model", default="gpt2", help="with --device cuda: the trainer's model config")
    p.add_argument("--batch", type=int, default=8, help="with --device cuda: sequences per step")
    p.add_argument("--warmup", type=int, default=12, help="with --device cuda: untimed steps first")
    p.add_argument("--gpu-child", nargs=2, help=argparse.SUPPRESS)  # METHOD EVERY: one run, JSON out
    args = p.parse_args()
    if args.device == "cuda":
        if not torch.cuda.is_available():
            print("bench/checkpoint.py: --device cuda needs a CUDA GPU, and torch sees none", file=sys.stderr)
            sys.exit(2)
        if args.gpu_child:
            method, every = args.gpu_child
            print(
                json.dumps(
                    run_gpu(method, int(every), args.steps, args.warmup, args.model, args.batch, "cuda", args.dir)
                )
            )
        else:
            gpu_main(args)
        return
    torch.set_num_threads(1)  # as the children run (OMP_NUM_THREADS=1): one core computes, one is left over
    if args.child:
        method, mb, work = args.child
        print(json.dumps(run(method, float(mb), args.steps, args.every, int(work), args.dir)))
        return
    unit, rows = product_s(), []
    base = args.dir or Path(tempfile.mkdtemp(prefix="bench-checkpoint-"))
    for mb in args.sizes:
        work = max(1, round(args.compute_ms_per_mb * mb / 1e3 / unit))
        for method in args.methods:
            directory = base / f"{mb:g}MB-{method}"
            directory.mkdir(parents=True)
            rows.append(
                child(
                    f"{method} at {mb:g} MB",
                    "--child",
                    method,
                    str(mb),
                    str(work),
                    "--steps",
                    str(args.steps),
                    "--every",
                    str(args.every),
                    "--dir",
                    str(directory),
                    env={**os.environ, "OMP_NUM_THREADS": "1"},
                )
            )
            shutil.rmtree(directory)
    if not args.dir:
        base.rmdir()  # each run's directory went as soon as its figures came back
    Console(width=200).print(table(rows))


if __name__ == "__main__":
    main()
