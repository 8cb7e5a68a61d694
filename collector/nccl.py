"""Collective names and bandwidths, by the formulas of NVIDIA's nccl-tests.

algbw = bytes / time. busbw rescales algbw so that it is comparable with the
link's peak whatever the collective and the group size n (nccl-tests,
doc/PERFORMANCE.md): all_reduce moves 2(n-1)/n of the data over the
slowest link, all_gather / reduce_scatter / all_to_all (n-1)/n, and
broadcast, reduce and point-to-point exactly 1. `bytes` is the nccl-tests
size: the full buffer (all_gather: the gathered output; reduce_scatter: the
input before scattering).
"""

import re

_BUS_FACTORS = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
    "send": lambda n: 1.0,
    "recv": lambda n: 1.0,
}

_ALIASES = {
    "allreduce": "all_reduce",
    "allgather": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "_allgather_base": "all_gather",
    "reducescatter": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "_reduce_scatter_base": "reduce_scatter",
    "alltoall": "all_to_all",
    "all_to_all_single": "all_to_all",
    "alltoallv": "all_to_all",
    "bcast": "broadcast",
    "sendrecv": "send",
    "isend": "send",
    "irecv": "recv",
}


def canonical_op(name: str) -> str | None:
    """The collective a name denotes (`nccl:all_reduce`, `ncclDevKernel_AllReduce_Sum_f32_RING_LL`,
    `AllReduce`, `all_gather_into_tensor` ...), or None when it names none."""
    base = name.rsplit(":", 1)[-1]
    base = re.sub(r"^nccl(DevKernel|Kernel)?_?", "", base)
    base = re.split(r"[_ ]?(Sum|Prod|Max|Min|Avg|RING|TREE|LL|Simple|f32|f16|bf16)\b", base)[0]
    snake = re.sub(r"(?<=[a-z])(?=[A-Z])", "_", base).lower().strip("_")
    snake = _ALIASES.get(snake.replace("_", ""), _ALIASES.get(snake, snake))
    return snake if snake in _BUS_FACTORS else None


def bandwidths(op: str, nbytes: int | None, seconds: float, group_size: int | None) -> tuple[float | None, float | None]:
    """(algbw, busbw) in GB/s for one collective; None where they are undefined."""
    if not nbytes or seconds <= 0:
        return None, None
    algbw = nbytes / seconds / 1e9
    factor = _BUS_FACTORS.get(op)
    if factor is None or not group_size or group_size < 1:
        return algbw, None
    return algbw, algbw * factor(group_size)
