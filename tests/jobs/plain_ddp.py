"""A plain PyTorch DDP training script that knows nothing of rankwatch (tests/test_zero_code.py runs it
under `rankwatch run`): a small MLP on random data over gloo, SGD with gradient clipping, with
--fp16-comm DDP's own fp16 compression hook. Rank --slow-rank sleeps in its forward: the script's own
slowness, as a slow GPU's would be."""

import argparse
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
    parser.add_argument("--fp16-comm", action="store_true", help="gradients all-reduced in fp16 (DDP's own hook)")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(rank)
    model = DistributedDataParallel(Net(rank == args.slow_rank))
    if args.fp16_comm:
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = torch.nn.MSELoss()
    for _ in range(args.steps):
        x, y = torch.randn(32, 64), torch.randn(32, 1)
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
