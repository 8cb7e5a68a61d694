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
from functools import cache

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

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

# bytes per element of the dtypes PyTorch names in its traces and dumps (c10::ScalarType's names)
DTYPE_BYTES = {
    "Bool": 1,
    "Byte": 1,
    "Char": 1,
    "QInt8": 1,
    "QUInt8": 1,
    "Float8_e4m3fn": 1,
    "Float8_e5m2": 1,
    "Float8_e4m3fnuz": 1,
    "Float8_e5m2fnuz": 1,
    "Short": 2,
    "UInt16": 2,
    "Half": 2,
    "BFloat16": 2,
    "Int": 4,
    "UInt32": 4,
    "QInt32": 4,
    "Float": 4,
    "ComplexHalf": 4,
    "Long": 8,
    "UInt64": 8,
    "Double": 8,
    "ComplexFloat": 8,
    "ComplexDouble": 16,
}

_ALIASES = {
    "allreduce": "all_reduce",
    "allgather": "all_gather",
    "allgatherintotensor": "all_gather",
    "allgatherbase": "all_gather",
    "reducescatter": "reduce_scatter",
    "reducescattertensor": "reduce_scatter",
    "reducescatterbase": "reduce_scatter",
    "alltoall": "all_to_all",
    "alltoallsingle": "all_to_all",
    "alltoallv": "all_to_all",
    "broadcast": "broadcast",
    "bcast": "broadcast",
    "reduce": "reduce",
    "send": "send",
    "isend": "send",
    "sendrecv": "send",
    "recv": "recv",
    "irecv": "recv",
}
_DECORATION = re.compile(
    r"^(nccl|c10d|gloo)[:_]*|^(nccl)?(dev)?kernel_?|[_:](sum|prod|max|min|avg|premulsum|ring|"
    r"tree|ll|ll128|simple|collnet\w*|nvls\w*|[fiu](8|16|32|64)|u?int\d+(_t)?|half|float|"
    r"double|bf16|e4m3|e5m2)(?=[_:]|$).*$"
)


@cache
def canonical_op(name: str) -> str | None:
    """The collective a name denotes (`nccl:all_reduce`, `AllReduce`, `all_gather_into_tensor`,
    `ncclDevKernel_AllReduce_Sum_f32_RING_LL` ...), or None when it names none."""
    base = name.strip().lower()
    previous = None
    while previous != base:
        previous, base = base, _DECORATION.sub("", base)
    return _ALIASES.get(re.sub(r"[^a-z]", "", base))


@cache
def bus_factor(name: str, group_size: int) -> float | None:
    """busbw / algbw for a collective on `group_size` ranks; None when unknown."""
    op = canonical_op(name)
    return _BUS_FACTORS[op](group_size) if op and group_size >= 1 else None


def bandwidths(
    names: pa.Array, group_sizes: pa.Array, nbytes: pa.Array, seconds: np.ndarray
) -> tuple[pa.Array, pa.Array]:
    """(algbw, busbw) in GB/s per op; null where the op moves no known bytes or is no known collective."""
    if nbytes.null_count == len(nbytes):
        return pa.nulls(len(nbytes), pa.float64()), pa.nulls(len(nbytes), pa.float64())
    with np.errstate(divide="ignore", invalid="ignore"):
        algbw = np.where(seconds > 0, nbytes.to_numpy(zero_copy_only=False).astype(np.float64) / seconds / 1e9, np.nan)
    # The bus factor once per distinct (name, group size) of the batch, of which there are a handful, not
    # once per op in Python. NaN without a name or a size, or for no known collective (an op that moves
    # no known bytes has a NaN algbw already).
    named = pc.dictionary_encode(names)
    sizes, size_of = np.unique(group_sizes.cast(pa.int64()).fill_null(-1).to_numpy(), return_inverse=True)
    name_of = named.indices.fill_null(-1).to_numpy().astype(np.int64) + 1  # 0: no name
    pairs, pair_of = np.unique(name_of * len(sizes) + size_of, return_inverse=True)
    known = [None, *named.dictionary.to_pylist()]
    factors = np.array(
        [
            np.nan if name is None or n < 0 or (f := bus_factor(name, n)) is None else f
            for name, n in ((known[p // len(sizes)], int(sizes[p % len(sizes)])) for p in pairs.tolist())
        ]
    )[pair_of]
    # NaN (no bytes, no time, unknown collective) is stored as null
    return pa.array(algbw, from_pandas=True), pa.array(algbw * factors, from_pandas=True)
