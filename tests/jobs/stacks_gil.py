"""A plain PyTorch script that knows nothing of rankwatch, one rank of which holds the GIL in a C call where a test
knows (tests/agent/test_stacks_native.py runs it under `rankwatch run` on 4 gloo ranks): each rank trains a step; in the
second, the other ranks enter the step's all-reduce and wait there, while rank 1, once they are there, runs a regex
that backtracks for ever (2^64 ways to split the a's) in one call into the regex engine, which never lets the GIL
go: no other thread of the process runs Python meanwhile. Each rank writes its pid into a file of MARKS as it gets
there. SIGUSR1 ends the regex (the engine checks for signals, whose handler raises), rank 1 enters the all-reduce,
and the job ends after a third step."""

import contextlib
import os
import re
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

MARKS = Path(sys.argv[1])
STUCK = 1
IN_ALL_REDUCE_S = 0.5  # how long a rank takes from its mark into the all-reduce, at most, on a loaded host too


class Released(Exception):
    """SIGUSR1 came: the regex is let go."""


def release(signum, frame):
    raise Released


signal.signal(signal.SIGUSR1, release)
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
model = torch.nn.Linear(16, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(3):
    model(torch.randn(8, 16)).pow(2).mean().backward()
    total = torch.ones(4)
    if step == 1 and rank == STUCK:
        while len(list(MARKS.iterdir())) < world - 1:
            time.sleep(0.01)
        time.sleep(IN_ALL_REDUCE_S)
        (MARKS / str(rank)).write_text(str(os.getpid()))
        with contextlib.suppress(Released):
            re.match(r"(a+)+$", "a" * 64 + "b")
    elif step == 1:
        (MARKS / str(rank)).write_text(str(os.getpid()))
    dist.all_reduce(total)
    optimizer.step()
    optimizer.zero_grad()
dist.destroy_process_group()
