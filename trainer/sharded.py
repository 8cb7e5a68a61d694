"""The training state of a sharded model (FSDP2, tensor parallelism: DTensors) as this rank's shards.

The checkpointer (trainer/checkpoint.py) copies plain tensors. A rank of a sharded job holds its own
shard of each DTensor and restores into the same mesh and placements, so its share of the state is
the local tensors: `Local(obj).state_dict()` is `obj.state_dict()` with each DTensor replaced by its
local shard, and `load_state_dict` puts each back as a DTensor of the live state's mesh, placements,
shape and stride before handing it to `obj`. Restoring is exact: the same bytes go back to the same
shards.
"""

from typing import Any

from torch.distributed.tensor import DTensor


class Local:
    """`obj` (a module or an optimizer) with its DTensors' local shards as its state."""

    def __init__(self, obj: Any):
        self.obj = obj

    def state_dict(self) -> dict:
        return _local(self.obj.state_dict())

    def load_state_dict(self, state: dict) -> None:
        self.obj.load_state_dict(_distributed(state, self.obj.state_dict()))


def _local(value: Any) -> Any:
    if isinstance(value, DTensor):
        return value.to_local()
    if isinstance(value, dict):
        return {k: _local(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_local(v) for v in value]
    return value


def _distributed(saved: Any, live: Any) -> Any:
    """`saved` with each tensor that is a DTensor in `live` (at the same place) made one like it."""
    if isinstance(live, DTensor):
        return DTensor.from_local(
            saved.to(live.device), live.device_mesh, live.placements, shape=live.shape, stride=live.stride()
        )
    if isinstance(live, dict) and isinstance(saved, dict):
        return {k: _distributed(v, live[k]) if k in live else v for k, v in saved.items()}
    if isinstance(live, list) and isinstance(saved, list) and len(live) == len(saved):
        return [_distributed(s, v) for s, v in zip(saved, live)]
    return saved
