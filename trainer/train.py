"""The reference trainer: a GPT trained with DDP, or with FSDP2, tensor and
pipeline parallelism (`--dp/--tp/--pp`: trainer/parallel.py), instrumented with the agent.

Run by `rankwatch train` under torchrun (one process per rank); gloo on CPU,
nccl on CUDA. Faults from `--inject` are applied by trainer/faults.py's
grammar and logged as events, so analyzers can be scored against them.
The training state is checkpointed by trainer/checkpoint.py, and a start
(a torchrun restart too) resumes from the newest checkpoint on disk.
"""

import argparse
import contextlib
import math
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from rankwatch import agent
from rankwatch.agent import paths
from rankwatch.agent import semconv as sc
from trainer import offload, rollback
from trainer.checkpoint import Checkpointer, NoCheckpoint
from trainer.data import TokenStream
from trainer.delays import Delay, WorkTime
from trainer.device import DEVICES, DeviceError, choose
from trainer.faults import TRAINER_KINDS, parse
from trainer.inject import slow_link_hook, slow_tp_link
from trainer.job import CONFIGS, SCHEDULES, SNAPSHOT_EVERY, Spec, unfit
from trainer.layout import Layout
from trainer.mfu import mfu, peak_flops
from trainer.model import GPT
from trainer.progress import Progress


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--model", choices=sorted(CONFIGS), default="tiny")
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--inject", action="append", default=[], metavar="SPEC")
    p.add_argument("--dp", type=int, help="data-parallel degree, FSDP2 (default: what --tp and --pp leave)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (DTensor)")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (a 1F1B schedule)")
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument(
        "--ckpt-dir",
        type=Path,
        metavar="DIR",
        help=f"checkpoints, DIR/rank-R for rank R (default: "
        f"{paths.checkpoint_dir(paths.DEFAULT_DB, 'RUN')}, "
        f"beside ${paths.DB_ENV}'s store when it is set)",
    )
    p.add_argument(
        "--snapshot-every",
        type=int,
        default=SNAPSHOT_EVERY,
        metavar="STEPS",
        help="copy the training state to host memory every STEPS steps",
    )
    p.add_argument(
        "--ckpt-every",
        type=int,
        default=100,
        metavar="STEPS",
        help="write one of those snapshots to disk every STEPS steps (a multiple of --snapshot-every)",
    )
    # the least kept: the ring grows to the measured step time x detection latency (trainer/rollback.py
    # ring_size; docs/benchmarks.md, Checkpoints)
    p.add_argument(
        "--ckpt-memory",
        type=int,
        default=4,
        metavar="K",
        help="snapshots kept in host memory at least; more as the measured step time and detection "
        "latency ask, within half the free memory",
    )
    p.add_argument(
        "--ckpt-host-memory",
        type=float,
        default=0.25,
        metavar="FRACTION",
        help="the most of the machine's physical memory the snapshots in memory take, shared by its ranks "
        "(on CUDA it is pinned: never swapped out, so kept well below all of it)",
    )
    p.add_argument("--ckpt-keep", type=int, default=2, metavar="D", help="checkpoints kept on disk")
    p.add_argument(
        "--max-rollbacks",
        type=int,
        default=3,
        metavar="N",
        help="rollbacks allowed within --rollback-window steps; the next one stops the job, its last "
        "good state on disk",
    )
    p.add_argument("--rollback-window", type=int, default=1000, metavar="STEPS")
    p.add_argument(
        "--offload", metavar="optimizer=host|disk[,activations=disk]", help="the optimizer's state off the device"
    )
    p.add_argument("--offload-schedule", default="serial", choices=SCHEDULES)
    p.add_argument(
        "--device",
        choices=DEVICES,
        default="auto",
        help="auto: a GPU per rank where the machine has enough, else the CPU",
    )
    args = p.parse_args(argv)
    try:
        args.device, _ = choose(args.device, int(os.environ.get("LOCAL_WORLD_SIZE", 1)), torch.cuda.device_count())
    except DeviceError as e:
        p.error(str(e))
    if min(args.snapshot_every, args.ckpt_every, args.ckpt_memory, args.ckpt_keep, args.rollback_window) < 1:
        p.error("--snapshot-every, --ckpt-every, --ckpt-memory, --ckpt-keep and --rollback-window must be at least 1")
    if args.max_rollbacks < 0:
        p.error("--max-rollbacks must be 0 or more")
    if not 0 < args.ckpt_host_memory < 1:
        p.error("--ckpt-host-memory must be a fraction between 0 and 1")
    if args.ckpt_every % args.snapshot_every:
        p.error(f"--ckpt-every {args.ckpt_every} is not a multiple of --snapshot-every {args.snapshot_every}")
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    try:
        faults = [parse(spec, TRAINER_KINDS) for spec in args.inject]
    except ValueError as e:
        p.error(str(e))
    args.faults = [f for f in faults if not (f.kind == "crash" and restarted)]  # a crash happens once
    args.layout = None  # DDP
    if args.dp is not None or args.tp > 1 or args.pp > 1:
        try:
            args.layout = Layout.of(int(os.environ.get("WORLD_SIZE", 1)), args.dp, args.tp, args.pp)
        except ValueError as e:
            p.error(str(e))
    try:
        args.offload = Spec.parse(args.offload, args.offload_schedule) if args.offload else None
    except ValueError as e:
        p.error(str(e))
    if args.offload and (problem := args.offload.refuses(args.layout is not None)):
        p.error(problem)
    for f in faults:
        if problem := unfit(f, args.layout, args.offload):
            p.error(f"{f.spec!r}: {problem}")
    return args


def apply_power_cap(command: dict, device, rank: int) -> None:
    """This rank's cap from a power_cap command, set on its GPU (clamped to the GPU's range); refused where the
    rank has none (`device` None)."""
    watts = (command["args"].get("caps") or {}).get(str(rank), command["args"].get("watts"))
    if device is None:
        agent.report(command, "failed", error="this rank has no GPU to cap (--simulate-gpu simulates one)")
        return
    try:
        applied = device.set_power_cap(watts) if watts is not None else None
        agent.report(command, "applied", power_limit_w=applied)
    except PermissionError as e:  # NVML without root
        agent.report(command, "failed", error=str(e))


def resume(ckpt: Checkpointer) -> int:
    """The step to start at: that of the newest checkpoint every rank can load, restored (0: none)."""
    try:
        return ckpt.restore(sys.maxsize)
    except NoCheckpoint:
        return 0


def local_share(fraction: float, pages: str) -> int:
    """`fraction` of the machine's memory (`pages`: SC_PHYS_PAGES, all of it, or SC_AVPHYS_PAGES, what is
    free), in bytes, shared by its ranks."""
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    return int(fraction * os.sysconf(pages) * os.sysconf("SC_PAGE_SIZE")) // local_ranks


def grow_ring(ckpt: Checkpointer, reach: rollback.Reach, every: int) -> None:
    """The ring grown to reach as far back as rollbacks land, within half the machine's free memory,
    shared by its ranks, and the checkpointer's host limit, in slots as allocated; a ring held short
    is said once per growth."""
    wanted, slot, memory = reach.ring(every), ckpt.snapshot_bytes, ckpt.memory
    if wanted <= memory or not slot:
        return
    ckpt.grow(min(wanted, memory + local_share(0.5, "SC_AVPHYS_PAGES") // slot))
    if memory < ckpt.memory < wanted:
        print(
            f"rankwatch train: {ckpt.memory} snapshots in memory where {wanted} would reach back "
            f"{reach.latency_s:.0f} s: an older rollback target loads from disk",
            file=sys.stderr,
            flush=True,
        )


def lowest(value: int) -> int:
    """The lowest of the values every rank passes: how the ranks agree on the step they restore."""
    values: list[int] = [0] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return min(values)


def offloaded(spec: Spec, model: torch.nn.Module, directory: Path, lr: float, current: dict) -> offload.OffloadedAdamW:
    """The offloaded AdamW, its swaps paced by this rank's `slow-disk` fault while it is active; where
    the state goes to disk, the disk probed first and the probe said (what its swaps are compared with)."""
    if spec.optimizer == "disk":
        read, write = offload.probe(directory)
        agent.event(
            sc.EVENT_DISK_PROBE,
            None,
            **{sc.DISK_PROBE_READ_BPS: read, sc.DISK_PROBE_WRITE_BPS: write, sc.DISK_PROBE_PATH: str(directory)},
        )
    return offload.OffloadedAdamW(
        offload.groups_of(model),
        spec,
        directory,
        lr,
        weight_decay=0.1,
        rate_mbps=lambda: disk_rate(current),
    )


def disk_rate(current: dict) -> float | None:
    """The MB/s this rank's active `slow-disk` fault leaves its swaps (None: the disk's own)."""
    return next((f.get("mbps") for f in current["faults"] if f.kind == "slow-disk"), None)


def main(argv: list[str] | None = None) -> None:
    args = arguments(argv)
    cuda = args.device == "cuda"
    dist.init_process_group(backend="nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(args.seed)
    model = GPT(CONFIGS[args.model])
    c, params = model.config, model.num_params()
    total = params  # the whole model's: a 3D rank computes its stage's share (params below, for MFU)
    current: dict = {"step": 0, "faults": []}
    # The replicate group: the ranks holding the same tensors, each writing its share of them. Under DDP
    # that is every rank; sharded (FSDP, TP, stages), the rank alone, its state its shards (Local).
    if args.layout is None:  # DDP: every rank a replica of the model
        trained: torch.nn.Module = DistributedDataParallel(model.to(device))
        threed, shards = None, lambda obj: obj
        replica, replicate, where = rank, list(range(world)), {sc.DP_RANK: rank}
    else:  # the 3D stack (FSDP2, DTensor, pipelining) imported by 3D jobs alone
        from trainer.sharded import Local
        from trainer.threed import ThreeD

        threed, shards = ThreeD(model, args.layout, device, args.batch, lambda: current["faults"]), Local
        trained, params = threed.module, threed.params_per_rank
        # each rank holds shards no other rank holds: it alone writes and reads them
        replica, replicate, where = threed.replica, [rank], threed.resource
        slow_tp_link(args.faults, rank, lambda: current["step"], threed.mesh["tp"].get_group(), cuda)
    device_name = torch.cuda.get_device_name(device) if cuda else "cpu"
    session = agent.init(cuda=cuda, resource={**where, sc.DEVICE: device_name})  # CPU ranks: CPU marks
    ckpt_dir = args.ckpt_dir or paths.checkpoint_dir(paths.store_path(), session.run_id)
    swapped = (
        offloaded(args.offload, model, ckpt_dir / "offload" / f"rank-{rank}", args.lr, current)
        if args.offload
        else None
    )
    optimizer = swapped or torch.optim.AdamW(trained.parameters(), lr=args.lr, weight_decay=0.1)
    activations = (
        offload.ActivationsToDisk(
            offload.Disk(ckpt_dir / "offload" / f"rank-{rank}" / "activations", lambda: disk_rate(current))
        )
        if args.offload and args.offload.activations
        else None
    )
    saving = activations.saving if activations else contextlib.nullcontext
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: (
            min(1.0, (s + 1) / args.warmup)
            * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s / max(args.steps, 1), 1.0))))
        ),
    )
    # a data-parallel replica's ranks (its stages, its tensor-parallel ranks) read the same batches
    data = TokenStream(c.vocab, c.seq_len, args.batch, replica, args.seed)
    ckpt = Checkpointer(
        ckpt_dir / f"rank-{rank}",
        {
            "model": shards(trained if threed else model),
            "optimizer": shards(optimizer),
            "schedule": schedule,
            "data": data,
        },
        memory=args.ckpt_memory,
        disk_every=args.ckpt_every,
        keep=args.ckpt_keep,
        replicas=[ckpt_dir / f"rank-{r}" for r in replicate],
        agree=lowest,
        host_limit=local_share(args.ckpt_host_memory, "SC_PHYS_PAGES"),
    )
    start = resume(ckpt)
    if threed:
        threed.watch()
    else:
        agent.watch_ddp(trained, slow_link_hook(args.faults, rank, lambda: current["step"], cuda))
    # DDP: a straggler's delay is sized from its clean compute, timed only where one is injected (2 events
    # a step); 3D: from each forward of the stage (trainer/inject.py)
    delay = Delay(cuda)
    compute = WorkTime(cuda) if not threed and any(f.kind == "straggler" for f in args.faults) else None
    peak = peak_flops(device)
    announced: set[str] = set()
    layout = f", dp {threed.layout.dp} x tp {threed.layout.tp} x pp {threed.layout.pp}" if threed else ""
    if rank == 0:
        print(
            f"rankwatch train: {world} ranks{layout}, GPT {args.model} ({total / 1e6:.1f}M parameters), "
            f"{args.steps} steps on {device_name}" + (f", resumed at step {start}" if start else ""),
            flush=True,
        )

    budget, reach, step = rollback.Budget(args.max_rollbacks, args.rollback_window), rollback.Reach(), start

    def settle(step: int, compute_started: float) -> None:
        """The step's optimizer step done: the schedule on, gradients off, the state snapshotted when due."""
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        if step == start:  # the state complete (AdamW's moments exist): its ring made in the background
            ckpt.reserve()
        if (step + 1) % args.snapshot_every == 0:
            grow_ring(ckpt, reach, args.snapshot_every)
            ckpt.snapshot(step + 1)
        if session.device is not None:  # a capped or throttled simulated GPU computes slower (a real one: scale 1)
            time.sleep((session.device.compute_scale() - 1) * (time.perf_counter() - compute_started))

    # the loss is the last stage's: its last rank reports progress
    progress = Progress(args.log_every, args.steps - 1) if rank == (world - 1 if threed else 0) else None
    while step < args.steps:
        command = agent.command(step)  # the same on every rank, at the same step
        if command is not None and command["kind"] == "rollback":
            reach.rolled_back(int(command["args"]["before_step"]))
            try:
                step = rollback.apply(command, step, ckpt, data, schedule, budget, session.clock.now_ns)
            except rollback.Stop as e:
                if rank == 0:
                    print(f"rankwatch train: stopped at step {step}: {e}", flush=True)
                break
            continue
        if command is not None and command["kind"] == "power_cap":
            apply_power_cap(command, session.device, rank)
        current["step"] = step
        # a fault at one step fires once: the step replayed after a rollback runs clean
        faults = [
            f
            for f in args.faults
            if f.active(step) and f.rank in (None, rank) and not ("at" in dict(f.params) and f.spec in announced)
        ]
        for f in faults:
            if f.spec not in announced:
                announced.add(f.spec)
                agent.event(sc.EVENT_FAULT, step, **{sc.FAULT_SPEC: f.spec})
        current["faults"] = faults
        started = time.perf_counter()
        reach.step_started(step)
        injected = 0.0
        with agent.step(step):
            if swapped:
                swapped.prefetch()  # with overlap, the state is read back while the step computes
            if activations:
                activations.start()
            with agent.phase("data"):
                inputs, targets = (t.to(device, non_blocking=True) for t in data.next())
            compute_started, computing = time.perf_counter(), compute.start() if compute else None
            if threed:
                loss = threed.forward_backward(inputs, targets, faults)
            else:
                with agent.phase("forward"):
                    with torch.autocast(device.type, torch.bfloat16, enabled=cuda), saving():
                        loss = trained(inputs, targets)
                    for f in faults:
                        if f.kind == "straggler":  # this rank's compute `slowdown` times its clean length
                            extra = (f.get("slowdown") - 1) * ((compute and compute.last_s) or 0.0)
                            delay(extra)
                            injected += extra
                        elif f.kind == "hang":
                            threading.Event().wait(f.get("seconds"))  # None: for ever
                        elif f.kind == "spike":
                            loss = loss * f.get("scale")
                        elif f.kind == "nan":
                            loss = loss * float("nan")
                        elif f.kind == "crash":
                            agent.shutdown()  # the fault_injected event still reaches the collector
                            os._exit(1)
                with agent.phase("backward"):
                    loss.backward()
            with agent.phase("optimizer"):
                grad_norm = threed.clip() if threed else torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                ckpt.wait_until_safe()
                if swapped is None:
                    optimizer.step()
                    settle(step, compute_started)
            if swapped:  # on the host: its swaps are transfers and its step host work, no device's compute
                optimizer.step()
                with agent.phase("optimizer"):
                    settle(step, compute_started)
            if compute:
                compute.stop(computing, injected)
            tokens = inputs.numel()
            agent.record(
                loss=None if loss is None else loss.detach(),
                grad_norm=grad_norm.detach(),
                tokens=tokens,
                lr=schedule.get_last_lr()[0],
                mfu=mfu(params, tokens, time.perf_counter() - started, peak),
                flops=6 * params * tokens,  # the rank's work, whatever the time it took
            )
        if progress and loss is not None:
            progress.step(step, loss, (time.perf_counter() - started) * 1e3)
        step += 1
    if progress:
        progress.flush(wait=True)
    agent.end()  # before the last checkpoint's write, which may outlast the collector's stall timeout
    ckpt.close()
    if swapped:
        swapped.close()
    if activations:
        activations.close()
    agent.shutdown()
    # every rank past its last collective before any tears its process group down: on gloo, a rank whose
    # peer was still tearing down may abort at exit ("terminate called without an active exception")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    # torchrun stops its workers with SIGTERM (on Ctrl-C, a failed peer, a cancelled job): exit as on
    # Ctrl-C, through the agent's exit hook, which sends the telemetry still buffered and puts the
    # GPU's power limit back; killed outright, a worker would leave a cap set and lose its last steps
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        main()
    except KeyboardInterrupt:
        sys.exit(130)
