"""A process that writes checkpoints (trainer/checkpoint.py) for ever, for a test to kill with SIGKILL:
`python -m tests.support.checkpoint_writer DIR` resumes from DIR, prints the step it resumed at, then
writes a checkpoint every step. It imports torch and the checkpointer alone, so that each start costs
little more than torch's import."""

import sys
from pathlib import Path

import torch

from trainer.checkpoint import Checkpointer, NoCheckpoint

BIG = 8 << 20  # floats: a 32 MiB state, so that the writer is busy most of the time


def big_state() -> torch.nn.ParameterList:
    """One large tensor and many small ones, all equal to the step they were saved at."""
    return torch.nn.ParameterList([torch.zeros(BIG), *(torch.zeros(7) for _ in range(50))])


def write_forever(directory: Path) -> None:
    """Resume, say where, then write a checkpoint every step."""
    state = big_state()
    ckpt = Checkpointer(directory, {"state": state}, memory=2, disk_every=1, keep=2)
    try:
        step = ckpt.restore(sys.maxsize)
    except NoCheckpoint:
        step = 0
    print(step, flush=True)
    while True:
        step += 1
        ckpt.wait_until_safe()
        with torch.no_grad():
            for p in state:
                p.fill_(step)
        ckpt.snapshot(step)


if __name__ == "__main__":
    write_forever(Path(sys.argv[1]))
