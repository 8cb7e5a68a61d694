"""The reference trainer: a GPT trained with DDP, instrumented with the agent.

Run by `rankwatch train` under torchrun (one process per rank); gloo on CPU,
nccl on CUDA. Faults from `--inject` are applied by trainer/faults.py's
grammar and logged as events, so analyzers can be scored against them.
"""

import argparse
import math
import os
import threading
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import agent
from agent import semconv as sc
from trainer.data import TokenStream
from trainer.faults import TRAINER_KINDS, Fault, parse
from trainer.mfu import mfu, peak_flops
from trainer.model import CONFIGS, GPT

def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--model", choices=sorted(CONFIGS), default="tiny")
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--inject", action="append", default=[], metavar="SPEC")
    p.add_argument("--log-every", type=int, default=20)
    args = p.parse_args(argv)
    try:
        args.faults = [parse(spec, TRAINER_KINDS) for spec in args.inject]
    except ValueError as e:
        p.error(str(e))
    return args


def slow_link_hook(faults: list[Fault], rank: int, step_of):
    """A DDP comm hook that stretches this rank's all-reduces while a slow-link fault is active."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    def hook(process_group, bucket):
        started = time.monotonic()
        fut = default_hooks.allreduce_hook(process_group, bucket)
        factor = max((f.get("factor") for f in faults if f.kind == "slow-link" and f.rank == rank
                      and f.active(step_of())), default=1.0)

        def stretch(done):
            time.sleep((factor - 1) * (time.monotonic() - started))
            return done.value()

        return fut.then(stretch) if factor > 1 else fut

    return hook


def main(argv: list[str] | None = None) -> None:
    args = arguments(argv)
    cuda = torch.cuda.is_available()
    dist.init_process_group(backend="nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(args.seed)
    model = GPT(CONFIGS[args.model]).to(device)
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / args.warmup) * (
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s / max(args.steps, 1), 1.0)))))
    c = model.config
    data = TokenStream(c.vocab, c.seq_len, args.batch, rank, args.seed)
    device_name = torch.cuda.get_device_name(device) if cuda else "cpu"
    agent.init(resource={sc.DP_RANK: rank, sc.DEVICE: device_name})
    current = {"step": 0}
    agent.watch_ddp(ddp, slow_link_hook(args.faults, rank, lambda: current["step"]))
    peak, params = peak_flops(device), model.num_params()
    announced: set[str] = set()
    if rank == 0:
        print(f"rankwatch train: {world} ranks, GPT {args.model} ({params / 1e6:.1f}M parameters), "
              f"{args.steps} steps on {device_name}", flush=True)

    for step in range(args.steps):
        current["step"] = step
        faults = [f for f in args.faults if f.active(step) and f.rank in (None, rank)]
        for f in faults:
            if f.spec not in announced:
                announced.add(f.spec)
                agent.event(sc.EVENT_FAULT, step, **{sc.FAULT_SPEC: f.spec})
        started = time.perf_counter()
        with agent.step(step):
            with agent.phase("data"):
                inputs, targets = (t.to(device, non_blocking=True) for t in data.next())
            with agent.phase("forward"):
                loss = ddp(inputs, targets)
                for f in faults:
                    if f.kind == "straggler":  # the rest of this rank's compute, `slowdown` times slower
                        time.sleep((f.get("slowdown") - 1) * 3 * (time.perf_counter() - started))
                    elif f.kind == "hang":
                        threading.Event().wait(f.get("seconds"))  # None: for ever
                    elif f.kind == "spike":
                        loss = loss * f.get("scale")
                    elif f.kind == "nan":
                        loss = loss * float("nan")
            with agent.phase("backward"):
                loss.backward()
            with agent.phase("optimizer"):
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                schedule.step()
                optimizer.zero_grad(set_to_none=True)
            tokens = inputs.numel()
            agent.record(loss=loss.detach(), grad_norm=grad_norm.detach(), tokens=tokens,
                         lr=schedule.get_last_lr()[0], mfu=mfu(params, tokens, time.perf_counter() - started, peak))
        if rank == 0 and (step % args.log_every == 0 or step == args.steps - 1):
            print(f"step {step:5d}  loss {loss.item():7.4f}  {(time.perf_counter() - started) * 1e3:7.1f} ms",
                  flush=True)
    agent.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
