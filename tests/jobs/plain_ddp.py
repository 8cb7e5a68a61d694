"""A plain PyTorch DDP training script that knows nothing of rankwatch (tests/agent/test_zero_code.py runs it
under `rankwatch run`): a small MLP on random data over gloo, SGD with gradient clipping, with
--fp16-comm DDP's own fp16 compression hook; with --cuda on its local rank's GPU over NCCL, and
--sync-check makes any host-device sync after its first steps an error (torch's sync debug mode), so
that whatever instruments it must never sync. Rank --slow-rank sleeps in its forward: the script's own
slowness, as a slow GPU's would be. Rank --slow-loader waits 50 ms for each batch from step --slow-from
on, as behind a slow data loader. Rank --die-rank fails as it begins step --die-at, as --die-how says: raising
CUDA's out-of-memory error, killed (SIGKILL, as the kernel's OOM killer or a failing node kills), or exiting
with code 3 (os._exit); with --die-once, in torchrun's first attempt only (a restart then trains on)."""

import argparse
import os
import signal
import time

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel


class Net(torch.nn.Module):
    def __init__(self, slow: bool):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
        self.slow = slow

    def forward(self, x):
        if self.slow:
            time.sleep(0.03)
        return self.body(x)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--slow-rank", type=int, default=-1)
    parser.add_argument("--slow-loader", type=int, default=-1, help="this rank waits 50 ms for each batch")
    parser.add_argument("--slow-from", type=int, default=0, help="from this step on")
    parser.add_argument("--fp16-comm", action="store_true", help="gradients all-reduced in fp16 (DDP's own hook)")
    parser.add_argument("--cuda", action="store_true", help="one GPU per rank, NCCL")
    parser.add_argument("--sync-check", action="store_true", help="a host-device sync after step 3 is an error")
    parser.add_argument("--die-rank", type=int, default=-1)
    parser.add_argument("--die-at", type=int, default=0)
    parser.add_argument("--die-how", choices=("oom", "kill", "exit"), default="oom")
    parser.add_argument("--die-once", action="store_true", help="in the first attempt only (torchrun's restarts)")
    args = parser.parse_args()
    device = torch.device("cpu")
    if args.cuda:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if args.cuda else "gloo")
    rank = dist.get_rank()
    torch.manual_seed(rank)
    model = DistributedDataParallel(Net(rank == args.slow_rank).to(device))
    if args.fp16_comm:
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = torch.nn.MSELoss()
    for step in range(args.steps):
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if rank == args.die_rank and step == args.die_at and (first_attempt or not args.die_once):
            die(args.die_how)
        if args.sync_check and step == 3:
            torch.cuda.set_sync_debug_mode("error")
        if rank == args.slow_loader and step >= args.slow_from:
            time.sleep(0.05)  # the batch is late
        x, y = torch.randn(32, 64, device=device), torch.randn(32, 1, device=device)
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    if args.sync_check:
        torch.cuda.set_sync_debug_mode("default")
    # every rank past its last collective before any tears its process group down: with DDP's fp16 hook
    # on gloo, a rank whose peer was still tearing down aborted at exit ("terminate called without an active
    # exception") in about one plain torchrun job in nine, rankwatch or not
    dist.barrier()
    dist.destroy_process_group()


def die(how: str) -> None:
    if how == "oom":
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.11 GiB total)")
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(3)


if __name__ == "__main__":
    main()
