"""The generic op trace, rankwatch's own import format for any framework's timings: one row per op,
in Parquet or CSV (the fleet simulator writes it too).

Columns: rank, step, op, start, duration (seconds), and optionally kind
(compute|comm|data|other), dp_rank, pp_stage, tp_rank, microbatch, seq, bytes.
Without a kind, it is inferred from the op name, for Megatron-style timer
names (forward-compute, backward-recv, grads-reduce-scatter, optimizer ...)
and torch.distributed / NCCL names (all_reduce, nccl:all_gather ...). The file
is read in batches, so its size is bounded by the disk, not by memory.
"""

import re
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq

from collector.nccl import canonical_op
from collector.receive.imports import TraceError
from rankwatch.agent import semconv as sc

REQUIRED = ("rank", "step", "op", "start", "duration")
PLACEMENT = ("dp_rank", "pp_stage", "tp_rank")
_KINDS = (sc.KIND_COMPUTE, sc.KIND_COMM, sc.KIND_DATA, sc.KIND_OTHER)
_COMM = re.compile(r"send|recv|reduce|gather|scatter|all.?to.?all|broadcast|barrier|nccl|comm|p2p")
_DATA = re.compile(r"data|batch.?generator|loader|input")
_COMPUTE = re.compile(r"forward|backward|compute|optimizer|fwd|bwd|embedding|loss|kernel")


@cache
def infer_kind(name: str) -> str:
    """compute, comm, data or other, from an op's name."""
    lowered = name.lower()
    if canonical_op(name) or _COMM.search(lowered):
        return sc.KIND_COMM
    if _DATA.search(lowered):
        return sc.KIND_DATA
    if _COMPUTE.search(lowered):
        return sc.KIND_COMPUTE
    return sc.KIND_OTHER


class OpTrace:
    """An op trace file, opened and checked; iterate `batches()` once to read it."""

    def __init__(self, path: Path, batch_rows: int = 65_536):
        self.path = path
        self._batch_rows = batch_rows
        self.placement: dict[int, dict] = {}
        try:
            if path.suffix.lower() == ".parquet":
                self._parquet = pq.ParquetFile(path)
                self.rows: int | None = self._parquet.metadata.num_rows
                columns = self._parquet.schema_arrow.names
            elif path.suffix.lower() == ".csv":
                self._parquet, self.rows = None, None
                columns = pcsv.open_csv(path).schema.names
            else:
                raise TraceError(f"{path}: an op trace is .parquet or .csv")
        except (OSError, pa.ArrowInvalid) as e:
            raise TraceError(f"{path}: {str(e).splitlines()[0]}") from None
        missing = [c for c in REQUIRED if c not in columns]
        if missing:
            raise TraceError(
                f"{path}: missing column{'s' * (len(missing) > 1)} {', '.join(missing)} "
                f"(an op trace has {', '.join(REQUIRED)})"
            )

    def batches(self) -> Iterator[pa.Table]:
        """The ops in the shape of the `ops` table, a batch at a time; placement is collected on the way."""
        try:
            reader = (
                self._parquet.iter_batches(self._batch_rows)
                if self._parquet is not None
                else pcsv.open_csv(self.path, read_options=pcsv.ReadOptions(block_size=1 << 22))
            )
            first_row = 0
            for batch in reader:
                yield self._ops(pa.Table.from_batches([batch]), first_row)
                first_row += batch.num_rows
        except (OSError, pa.ArrowInvalid) as e:
            raise TraceError(f"{self.path}: {str(e).splitlines()[0]}") from None

    def _ops(self, table: pa.Table, first_row: int) -> pa.Table:
        frame = table.to_pandas()
        for column in REQUIRED:
            bad = frame[column].isna()
            if bad.any():
                raise TraceError(f"{self.path}: row {first_row + int(np.argmax(bad)) + 1} has no {column}")
        if (frame["duration"] < 0).any():
            raise TraceError(
                f"{self.path}: row {first_row + int(np.argmax(frame['duration'] < 0)) + 1} has a negative duration"
            )
        names = frame["op"].astype(str)
        if "kind" in frame:
            kinds = frame["kind"].fillna(names.map(infer_kind))
            unknown = ~kinds.isin(_KINDS)
            if unknown.any():
                raise TraceError(
                    f"{self.path}: row {first_row + int(np.argmax(unknown)) + 1} has kind "
                    f"{kinds[unknown].iloc[0]!r}; kinds are {', '.join(_KINDS)}"
                )
        else:
            kinds = names.map(infer_kind)
        for column in PLACEMENT:
            if column in frame:
                for rank, value in frame.groupby("rank")[column].first().dropna().items():
                    self.placement.setdefault(int(rank), {"rank": int(rank)})[column] = int(value)
        for rank in frame["rank"].unique():
            self.placement.setdefault(int(rank), {"rank": int(rank)})
        start_ns = (frame["start"].to_numpy(np.float64) * 1e9).astype(np.int64)
        end_ns = start_ns + (frame["duration"].to_numpy(np.float64) * 1e9).astype(np.int64)
        ops = {
            "rank": frame["rank"].astype(np.int64),
            "step": frame["step"].astype(np.int64),
            "kind": kinds,
            "name": names,
            "start_ts": pd.to_datetime(start_ns, unit="ns"),
            "end_ts": pd.to_datetime(end_ns, unit="ns"),
            "duration_s": frame["duration"].astype(float),
        }
        for column in ("microbatch", "seq", "bytes"):
            if column in frame:
                ops[column] = frame[column]
        return pa.Table.from_pandas(pd.DataFrame(ops), preserve_index=False)

    def placement_frame(self) -> pd.DataFrame:
        """One row per rank seen, with its dp_rank, pp_stage, tp_rank where the trace gave them."""
        return pd.DataFrame(sorted(self.placement.values(), key=lambda r: r["rank"]))
