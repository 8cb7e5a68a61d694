"""A pipeline-like job over gloo that knows nothing of rankwatch (tests/collector/analysis/test_p2p_match.py runs it
under torchrun): each step, every stage receives its input from the stage before and sends its output to the
stage after, as pipeline schedules do (the shape first, by send and recv, then the activations by
batch_isend_irecv), then all stages all-reduce a scalar (a global gradient norm). At step --skip-at,
stage --skip-rank sends nothing: the stage after it waits in its receive forever, the stages after that
behind it, and the stages before it in the all-reduce. With TORCH_FR_BUFFER_SIZE set, torch's Flight
Recorder records the job's communication; a thread in each rank writes the rank's record to
--dumps/nccl_trace_rank_<rank> (a pickle, as TORCH_NCCL_DUMP_ON_TIMEOUT would on a watchdog timeout)
once the rank has made no progress for --dump-after seconds at the step of the fault."""

import argparse
import os
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _dump_fr_trace

ACTIVATIONS = (8, 16)


class Progress:
    """The last step the rank finished, and when."""

    def __init__(self) -> None:
        self.step, self.at = -1, time.monotonic()

    def mark(self, step: int) -> None:
        self.step, self.at = step, time.monotonic()


def dump_when_stalled(progress: Progress, step: int, after_s: float, path: Path) -> None:
    """Write this rank's Flight Recorder to `path` (whole, by a rename) once it has stalled `after_s`
    seconds in `step`."""
    while not (progress.step >= step - 1 and time.monotonic() - progress.at >= after_s):
        time.sleep(0.1)
    partial = path.with_name(f".{path.name}.partial")  # a dot file: not read as a dump
    partial.write_bytes(_dump_fr_trace())
    os.replace(partial, path)


def exchange(rank: int, world: int, x: torch.Tensor, send: bool) -> torch.Tensor:
    """This stage's input, received from the stage before (stage 0's is `x`); its output sent to the stage
    after, unless `send` is false."""
    if rank > 0:
        shape = torch.empty(2, dtype=torch.int64)
        dist.recv(shape, rank - 1)
        x = torch.empty(shape.tolist())
        for work in dist.batch_isend_irecv([dist.P2POp(dist.irecv, x, rank - 1)]):
            work.wait()
    y = torch.tanh(x)
    if send and rank < world - 1:
        dist.send(torch.tensor(y.shape), rank + 1)
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, y, rank + 1)]):
            work.wait()
    return y


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dumps", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--skip-rank", type=int, default=1, help="the stage that leaves out one send")
    parser.add_argument("--skip-at", type=int, default=3, help="in this step")
    parser.add_argument("--dump-after", type=float, default=3.0)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    progress = Progress()
    path = args.dumps / f"nccl_trace_rank_{rank}"
    threading.Thread(
        target=dump_when_stalled, args=(progress, args.skip_at, args.dump_after, path), daemon=True
    ).start()
    torch.manual_seed(0)
    for step in range(args.steps):
        skip = rank == args.skip_rank and step == args.skip_at
        x = exchange(rank, world, torch.randn(ACTIVATIONS), not skip)
        norm = x.square().sum().reshape(1)
        dist.all_reduce(norm)
        progress.mark(step)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
