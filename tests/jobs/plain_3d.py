"""A plain PyTorch tensor- and pipeline-parallel training script that knows nothing of rankwatch
(tests/agent/test_zero_code.py runs it under `rankwatch run`): 4 ranks as a DeviceMesh of ("pp", "tp") =
2 x 2; each pipeline stage an MLP whose layers are split over tp with DTensor (columns, then rows: one
all-reduce in forward and one in backward per stage and microbatch), the stages run by a GPipe schedule
over 4 microbatches (torch.distributed.pipelining), gloo on CPU."""

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    stage_index = mesh["pp"].get_local_rank()
    torch.manual_seed(stage_index)
    stage = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32))
    parallelize_module(stage, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    pipeline = PipelineStage(stage, stage_index, 2, torch.device("cpu"), group=mesh["pp"].get_group())
    schedule = ScheduleGPipe(pipeline, n_microbatches=4, loss_fn=lambda out, target: F.mse_loss(out, target))
    optimizer = torch.optim.SGD(stage.parameters(), lr=0.01)
    torch.manual_seed(0)
    for _ in range(args.steps):
        x, y = torch.randn(8, 32), torch.randn(8, 32)
        if stage_index == 0:
            schedule.step(x)
        else:
            schedule.step(target=y)
        optimizer.step()
        optimizer.zero_grad()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
