"""A plain PyTorch script that knows nothing of rankwatch and hangs where a test knows (tests/agent/test_stacks_agent.py
runs it under `rankwatch run` on 4 gloo ranks): each rank trains one step of a small model, then in the second
rank 2 blocks in its data loader's `__next__` (reading the FIFO RELEASE) while the others enter the step's
all-reduce and wait there for it. Each rank writes a file into MARKS as it gets there; a byte written to the FIFO
lets rank 2 on, and the job ends after a third step."""

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

RELEASE, MARKS = sys.argv[1], Path(sys.argv[2])


class Loader:
    def __init__(self, rank: int):
        self.rank, self.batches = rank, 0

    def __iter__(self):
        return self

    def __next__(self) -> torch.Tensor:
        self.batches += 1
        if self.rank == 2 and self.batches == 2:
            fifo = os.open(RELEASE, os.O_RDWR)  # (read-write: the open waits for no writer)
            (MARKS / "2").touch()
            os.read(fifo, 1)
            os.close(fifo)
        return torch.randn(8, 16)


dist.init_process_group("gloo")
rank = dist.get_rank()
model = torch.nn.Linear(16, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
for step, x in zip(range(3), Loader(rank)):
    model(x).pow(2).mean().backward()
    total = torch.ones(4)
    if step == 1 and rank != 2:
        (MARKS / str(rank)).touch()
    dist.all_reduce(total)
    optimizer.step()
    optimizer.zero_grad()
dist.destroy_process_group()
