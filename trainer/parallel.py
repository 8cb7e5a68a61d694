"""Data, tensor and pipeline parallelism for the GPT, as torchtitan applies them: a DeviceMesh of
(pp, dp, tp), tensor parallelism with DTensor over tp (each block's attention and MLP split by
columns then rows, so one all-reduce each in forward and in backward), FSDP2 (`fully_shard`) over
dp, and pipeline stages over pp run by a real schedule (1F1B) over microbatches.

The mesh's dimensions are named dp, tp and pp: the agent reads each collective's role from them
(rankwatch/agent/meshes.py). The same code runs on gloo (CPU) and NCCL (CUDA).
"""

import math

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from trainer.layout import Layout
from trainer.model import GPT, loss


def mesh(layout: Layout, device_type: str) -> DeviceMesh:
    """The job's mesh: stages outermost, tensor parallelism innermost (its ranks the closest: one host)."""
    return init_device_mesh(device_type, (layout.pp, layout.dp, layout.tp), mesh_dim_names=("pp", "dp", "tp"))


def coordinates(m: DeviceMesh) -> dict[str, int]:
    """This rank's place in the mesh: its pipeline stage, data-parallel replica and tensor-parallel rank."""
    return {name: m[name].get_local_rank() for name in ("pp", "dp", "tp")}


def parallelize(model: GPT, m: DeviceMesh) -> GPT:
    """`model` (one stage of it) split over tp and sharded over dp, in place."""
    tp = m["tp"]
    if tp.size() > 1:
        heads = model.config.heads
        if heads % tp.size():
            raise ValueError(f"--tp {tp.size()} does not divide the model's {heads} attention heads")
        plan = {
            "qkv": ColwiseParallel(),
            "proj": RowwiseParallel(),
            "mlp.0": ColwiseParallel(),
            "mlp.2": RowwiseParallel(),
        }
        for block in model.blocks:
            parallelize_module(block, tp, plan)
    for block in model.blocks:
        fully_shard(block, mesh=m["dp"])
    fully_shard(model, mesh=m["dp"])
    return model


def schedule(model: GPT, m: DeviceMesh, microbatches: int, device: torch.device, loss_fn=loss) -> Schedule1F1B:
    """A 1F1B schedule of this rank's stage over the pp group."""
    pp = m["pp"]
    stage = PipelineStage(model, pp.get_local_rank(), pp.size(), device, group=pp.get_group())
    return Schedule1F1B(stage, n_microbatches=microbatches, loss_fn=loss_fn)


def clip_grad_norm(parameters: list[torch.nn.Parameter], max_norm: float, m: DeviceMesh) -> torch.Tensor:
    """The gradients' global norm over every stage and shard, and the gradients scaled to at most
    `max_norm` (torch's clip_grad_norm_ cannot stack the norms of DTensors on different meshes: FSDP's
    over dp, FSDP with TP's over dp x tp). Squares are summed locally per mesh and sharding, then over
    the mesh dimensions they are sharded along (a replicated dimension holds the same values), then
    over the stages: a few all-reduces a step."""
    by_sharding: dict[tuple, list[torch.Tensor]] = {}
    for p in parameters:
        if p.grad is None:
            continue
        g = p.grad
        if isinstance(g, DTensor):
            sharded = tuple(i for i, place in enumerate(g.placements) if place.is_shard())
            key: tuple = (g.device_mesh, sharded)
            g = g.to_local()
        else:
            key = (None, ())
        by_sharding.setdefault(key, []).append(g)
    device = next(iter(parameters)).device if parameters else torch.device("cpu")
    total = torch.zeros((), device=device, dtype=torch.float32)
    for (group_mesh, sharded), grads in by_sharding.items():
        squares = torch.stack([g.float().pow(2).sum() for g in grads]).sum()
        for dim in sharded:
            dist.all_reduce(squares, group=group_mesh.get_group(dim))
        total += squares
    if m["pp"].size() > 1:
        dist.all_reduce(total, group=m["pp"].get_group())
    norm = total.sqrt()
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for grads in by_sharding.values():
        torch._foreach_mul_(grads, scale)
    return norm


def microbatches(batch: int, pp: int) -> int:
    """Microbatches a step: twice the stages (the 1F1B bubble is (pp - 1) / (microbatches + pp - 1)),
    as many as divide the batch."""
    return math.gcd(batch, 2 * pp)
