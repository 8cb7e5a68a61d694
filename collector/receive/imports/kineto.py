"""PyTorch profiler (Kineto) traces: one Chrome trace JSON per rank, its GPU work as ops.

A rank's file gives its rank and world size (`distributedInfo`, else `rank<N>`
in the file name, else rank 0, as HTA assumes, with a notice) and its steps
(the `ProfilerStep#N` annotations around each iteration; without any, the whole
trace is step 0, with a notice). Every GPU kernel, memcpy and memset becomes an
op of the step whose CPU window launched it: the launch is the CUDA runtime
call with the same correlation id (the flow Chrome draws from CPU to GPU); a
GPU op without one takes the step of the latest launched op before it on its
stream, else the step its start falls in. GPU ops outside every step are
dropped and counted. A trace without GPU ops (CPU-only, or an accelerator
other than CUDA) is refused, naming the file. NCCL kernels are `comm` ops named after their collective, with
nccl-tests bytes and bandwidths where the profiler recorded the collective's
sizes; other kernels are `compute`, copies and memsets `other`. Comm kernels
often run beside compute kernels on other streams, so a rank-step's
`comm_wait_s` is the comm time no compute kernel of the rank overlaps, not
the sum of its comm ops.

Times: Kineto writes `ts` and `dur` in microseconds, `ts` since
`baseTimeNanoseconds` where the file has it, else since the epoch. Each file
has its own host's clock, so ranks on different hosts line up only as well as
their clocks do.

A Chrome trace is one JSON object, so a file is loaded whole. Files are read
one at a time and a rank's ops are yielded before the next file is loaded:
memory holds one rank's trace, not the job's (fine up to a few hundred MB a
file). A file whose JSON text, decompressed, passes MAX_TRACE_BYTES is
refused as soon as the bytes read pass it (a gzip of 4 GB of spaces takes
4 MB), and so is JSON nested deeper than the parser's recursion limit (a
trace nests 4 deep).
"""

import gzip
import json
import re
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa

from collector.nccl import DTYPE_BYTES, bandwidths, canonical_op
from collector.receive.imports import TraceError, files_of, read_at_most
from rankwatch.agent import semconv as sc

_GPU_OPS = {"kernel": sc.KIND_COMPUTE, "gpu_memcpy": sc.KIND_OTHER, "gpu_memset": sc.KIND_OTHER}
_LAUNCHES = ("cuda_runtime", "cuda_driver")
_STEP_CATS = ("user_annotation", "cpu_op")
_STEP = re.compile(r"ProfilerStep#(\d+)$")
_NCCL_KERNEL = r"nccl(Dev)?Kernel"
_RANK_IN_NAME = re.compile(r"rank[-_]?(\d+)", re.IGNORECASE)
MAX_TRACE_BYTES = 1 << 30  # a file's JSON text, decompressed: parsed, it takes about 10 times that
# the collective metadata PyTorch attaches to NCCL kernels -> our names for it
_COLLECTIVE = {
    "Collective name": "collective",
    "In msg nelems": "in_nelems",
    "Out msg nelems": "out_nelems",
    "dtype": "dtype",
    "Group size": "group_size",
    "Process Group Name": "comm_group",
    "Process Group Description": "group_desc",
}


def trace_files(*paths: Path) -> list[Path]:
    """The trace files given, and each given directory's trace files (*.json, *.json.gz) in name order."""
    return files_of(paths, lambda p: p.name.endswith((".json", ".json.gz")), "*.json or *.json.gz trace")


def load(path: Path) -> dict:
    """A trace's JSON object (gzipped or not), checked to hold a list of traceEvents."""
    text = _text(path)
    try:
        doc = json.loads(text)
    except RecursionError:
        raise TraceError(f"{path}: not readable as JSON: nested deeper than the parser goes") from None
    except ValueError as e:
        raise TraceError(f"{path}: not readable as JSON: {(str(e) or type(e).__name__).splitlines()[0]}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        raise TraceError(f"{path}: no traceEvents list; not a PyTorch profiler trace")
    return doc


def _text(path: Path) -> bytearray:
    """A trace file's bytes, decompressed where gzipped: TraceError as soon as they pass MAX_TRACE_BYTES."""
    try:
        with open(path, "rb") as f:
            gzipped = f.read(2) == b"\x1f\x8b"
        with gzip.open(path, "rb") if gzipped else open(path, "rb") as f:
            text = read_at_most(f, MAX_TRACE_BYTES)
    except (OSError, EOFError, zlib.error) as e:
        raise TraceError(f"{path}: not readable as JSON: {(str(e) or type(e).__name__).splitlines()[0]}") from None
    if text is None:
        raise TraceError(f"{path}: more than {MAX_TRACE_BYTES >> 20} MiB of JSON{' once decompressed' * gzipped}")
    return text


def _rank(path: Path, doc: dict) -> tuple[int, int | None, str | None]:
    """(rank, world size or None, notice or None) from distributedInfo, else the rank in the file
    name, else rank 0, as HTA assumes, with a notice saying so."""
    info = doc.get("distributedInfo")
    if isinstance(info, dict) and isinstance(info.get("rank"), int):
        size = info.get("world_size")
        return info["rank"], size if isinstance(size, int) else None, None
    if m := _RANK_IN_NAME.search(path.name):
        return int(m.group(1)), None, None
    return 0, None, f"{path}: no rank in distributedInfo or in the file name (rank<N>): taken as rank 0"


def _ns(us: pd.Series, base_ns: int) -> np.ndarray:
    """Kineto's microseconds as int64 ns; whole µs and fraction apart, so epoch times keep their precision."""
    whole = np.floor(us.to_numpy(np.float64))
    fraction = np.rint((us.to_numpy(np.float64) - whole) * 1000).astype(np.int64)
    return base_ns + whole.astype(np.int64) * 1000 + fraction


def _spans(path: Path, doc: dict) -> pd.DataFrame:
    """The complete events the import needs (step annotations, launches, GPU ops):
    name, cat, pid, args, start and end in ns."""
    base = doc.get("baseTimeNanoseconds")
    events = [
        e
        for e in doc["traceEvents"]
        if isinstance(e, dict)
        and e.get("ph") == "X"
        and (
            e.get("cat") in _GPU_OPS
            or e.get("cat") in _LAUNCHES
            or (e.get("cat") in _STEP_CATS and str(e.get("name")).startswith("ProfilerStep#"))
        )
    ]
    spans = pd.DataFrame(
        {
            "name": pd.Series([str(e.get("name")) for e in events], dtype=object),
            "cat": pd.Series([e["cat"] for e in events], dtype=object),
            "pid": pd.Series([e.get("pid") for e in events], dtype=object),
            "args": pd.Series([e.get("args") if isinstance(e.get("args"), dict) else {} for e in events], dtype=object),
            "ts": pd.to_numeric(pd.Series([e.get("ts") for e in events], dtype=object), errors="coerce"),
            "dur": pd.to_numeric(pd.Series([e.get("dur") for e in events], dtype=object), errors="coerce"),
        }
    )
    bad = spans["ts"].isna() | spans["dur"].isna() | (spans["dur"] < 0)
    if bad.any():
        raise TraceError(
            f"{path}: the {spans['cat'][bad].iloc[0]} event {spans['name'][bad].iloc[0]!r} has no valid ts and dur"
        )
    spans["start"] = _ns(spans["ts"], base if isinstance(base, int) else 0)
    spans["end"] = spans["start"] + np.rint(spans["dur"].to_numpy() * 1000).astype(np.int64)
    return spans


def _step_windows(path: Path, spans: pd.DataFrame) -> tuple[pd.DataFrame, str | None]:
    """step, start, end (ns) of each ProfilerStep#N annotation, in time order, and None; without
    any, the whole trace as step 0 and a notice saying so."""
    marks = spans[spans["cat"].isin(_STEP_CATS)]
    steps = marks["name"].str.extract(_STEP, expand=False).dropna()
    if steps.empty:
        whole = pd.DataFrame(
            {"step": [0], "start": [spans["start"].min()], "end": [spans["end"].max()], "pid": [spans["pid"].iloc[0]]}
        )
        return whole, (
            f"{path}: no ProfilerStep#N annotations (prof.step() once per iteration makes them): "
            f"the whole trace is taken as one step, step 0"
        )
    marks = marks.loc[steps.index].assign(step=steps.astype(np.int64))
    return marks.groupby("step").agg(
        start=("start", "min"), end=("end", "max"), pid=("pid", "first")
    ).reset_index().sort_values("start", ignore_index=True), None


def _launch_times(spans: pd.DataFrame, gpu: pd.DataFrame) -> pd.arrays.IntegerArray:
    """When the CPU launched each GPU op (the runtime call with its correlation id); NA where no
    launch event is in the trace."""
    launches = spans[spans["cat"].isin(_LAUNCHES)]
    launched_at = {a["correlation"]: t for a, t in zip(launches["args"], launches["start"]) if "correlation" in a}
    return pd.array([launched_at.get(a.get("correlation")) for a in gpu["args"]], dtype="Int64")


def _step_of(when: np.ndarray, windows: pd.DataFrame) -> np.ndarray:
    """The step whose window holds each time, -1 where none does."""
    i = np.maximum(np.searchsorted(windows["start"].to_numpy(), when, side="right") - 1, 0)
    inside = (when >= windows["start"].to_numpy()[i]) & (when <= windows["end"].to_numpy()[i])
    return np.where(inside, windows["step"].to_numpy()[i], -1)


def _steps(spans: pd.DataFrame, gpu: pd.DataFrame, windows: pd.DataFrame) -> np.ndarray:
    """Each GPU op's step: that of the CPU window its launch falls in. An op without a launch event
    runs after the ops queued before it on its stream, so it takes the step of the latest launched
    op before it there (its own start lags its launch by the queue, often into the next step's
    window); an op with none before it, the step its start falls in."""
    launched = _launch_times(spans, gpu)
    step = pd.Series(
        np.where(launched.isna(), -2, _step_of(launched.to_numpy(np.int64, na_value=0), windows)), index=gpu.index
    )
    stream = gpu["args"].map(lambda a: (a.get("device"), a.get("stream")))
    order = gpu["start"].sort_values(kind="stable").index
    inherited = step[order].where(step[order] != -2).groupby(stream[order]).ffill()
    own = pd.Series(_step_of(gpu["start"].to_numpy(), windows), index=gpu.index)
    return inherited.reindex(gpu.index).fillna(own).astype(np.int64).to_numpy()


def _covered_ns(start: np.ndarray, end: np.ndarray, busy_start: np.ndarray, busy_end: np.ndarray) -> np.ndarray:
    """For each [start, end], how long the union of the busy intervals covers of it."""
    if not len(busy_start):
        return np.zeros(len(start), np.int64)
    order = np.argsort(busy_start, kind="stable")
    s, e = busy_start[order], np.maximum.accumulate(busy_end[order])
    opens = np.r_[True, s[1:] > e[:-1]]  # an interval opens a block when it starts after all before it end
    block_start, block_end = s[opens], e[np.r_[opens[1:], True]]
    before = np.r_[0, np.cumsum(block_end - block_start)]  # busy time in the blocks before block k

    def busy_until(t: np.ndarray) -> np.ndarray:
        k = np.searchsorted(block_start, t, side="right") - 1
        j = np.maximum(k, 0)
        return np.where(k >= 0, before[j] + np.clip(t - block_start[j], 0, block_end[j] - block_start[j]), 0)

    return busy_until(end) - busy_until(start)


def _collectives(kernels: pd.DataFrame) -> pd.DataFrame:
    """NCCL kernels -> name (the collective), comm_group, group_size, bytes, algbw_gbps, busbw_gbps, attrs.
    bytes is the nccl-tests size, the full buffer: the larger of input and output (all_gather: the
    output, reduce_scatter: the input, the others: both alike)."""
    meta = pd.DataFrame(list(kernels["args"]), columns=list(_COLLECTIVE), index=kernels.index, dtype=object).rename(
        columns=_COLLECTIVE
    )
    name = (
        meta["collective"]
        .fillna("")
        .astype(str)
        .map(canonical_op)
        .fillna(kernels["name"].map(canonical_op))
        .fillna(meta["collective"])
        .fillna(kernels["name"])
    )
    nelems = np.fmax(
        pd.to_numeric(meta["in_nelems"], errors="coerce"), pd.to_numeric(meta["out_nelems"], errors="coerce")
    )
    nbytes = (nelems * meta["dtype"].map(DTYPE_BYTES)).astype("Int64")
    group_size = pd.to_numeric(meta["group_size"], errors="coerce").astype("Int64")
    algbw, busbw = bandwidths(
        pa.array(name, pa.string()),
        pa.array(group_size, pa.int64()),
        pa.array(nbytes, pa.int64()),
        (kernels["end"] - kernels["start"]).to_numpy() / 1e9,
    )
    attrs = [
        json.dumps({"kernel": k} | ({"group_desc": d} if isinstance(d, str) else {}))
        for k, d in zip(kernels["name"], meta["group_desc"])
    ]
    return pd.DataFrame(
        {
            "name": name,
            "comm_group": meta["comm_group"].astype("string"),
            "group_size": group_size,
            "bytes": nbytes,
            "algbw_gbps": algbw.to_numpy(zero_copy_only=False),
            "busbw_gbps": busbw.to_numpy(zero_copy_only=False),
            "attrs": attrs,
        },
        index=kernels.index,
    )


class KinetoTrace:
    """Per-rank Kineto traces (a file or a directory), the first opened and checked up front (so
    the world size is known before anything is written); iterate `batches()` once to read them all."""

    rows = None  # not known before the files are read

    def __init__(self, *paths: Path):
        self.files = trace_files(*paths)
        self._first: dict | None = load(self.files[0])
        self.world_size = _rank(self.files[0], self._first)[1]
        self.placement: dict[int, dict] = {}
        self.dropped = 0  # GPU ops outside every ProfilerStep
        self.notices: list[str] = []  # one line each: what was assumed where the trace did not say
        self._comm_wait: list[pd.DataFrame] = []
        self._seen: dict[int, Path] = {}

    def batches(self) -> Iterator[pa.Table]:
        """Each rank's ops in the shape of the `ops` table, a file at a time."""
        for path in self.files:
            doc = self._first if self._first is not None else load(path)
            self._first = None
            table = self._ops(path, doc)
            del doc  # this rank's events go before the next file is loaded
            yield table

    def _ops(self, path: Path, doc: dict) -> pa.Table:
        rank, world_size, notice = _rank(path, doc)
        if rank in self._seen:
            raise TraceError(f"{path}: rank {rank} again (also in {self._seen[rank]}): one run is one file per rank")
        if world_size != self.world_size:
            raise TraceError(f"{path}: world size {world_size}, but {self.files[0]} says {self.world_size}")
        self._seen[rank] = path
        spans = _spans(path, doc)
        gpu = spans[spans["cat"].isin(_GPU_OPS)].reset_index(drop=True)
        if gpu.empty:
            raise TraceError(
                f"{path}: no GPU kernels, copies or memsets: a CPU-only trace, or one of an "
                f"accelerator other than CUDA, which this import does not read"
            )
        windows, windowless = _step_windows(path, spans)
        self.notices += [n for n in (notice, windowless) if n]
        gpu["step"] = _steps(spans, gpu, windows)
        gpu["kind"] = gpu["cat"].map(_GPU_OPS)
        nccl = (gpu["cat"] == "kernel") & (gpu["name"].str.match(_NCCL_KERNEL) | gpu["name"].map(canonical_op).notna())
        gpu.loc[nccl, "kind"] = sc.KIND_COMM
        busy = gpu[gpu["kind"] == sc.KIND_COMPUTE]
        covered = _covered_ns(
            gpu["start"].to_numpy(), gpu["end"].to_numpy(), busy["start"].to_numpy(), busy["end"].to_numpy()
        )
        gpu["exposed"] = np.where(nccl, gpu["end"] - gpu["start"] - covered, 0)
        comm = _collectives(gpu[nccl])

        kept = gpu["step"] >= 0
        self.dropped += int((~kept).sum())
        gpu = gpu[kept]
        waits = gpu.groupby("step")["exposed"].sum()
        self._comm_wait.append(pd.DataFrame({"rank": rank, "step": waits.index, "comm_wait_s": waits.to_numpy() / 1e9}))
        self.placement[rank] = {"rank": rank, "pid": windows["pid"].iloc[0], "device": _device(doc, gpu)}
        ops = pd.DataFrame(
            {
                "rank": rank,
                "step": gpu["step"],
                "kind": gpu["kind"],
                "name": comm["name"].reindex(gpu.index).fillna(gpu["name"]),
                "start_ts": pd.to_datetime(gpu["start"], unit="ns"),
                "end_ts": pd.to_datetime(gpu["end"], unit="ns"),
                "duration_s": (gpu["end"] - gpu["start"]) / 1e9,
            }
        )
        return pa.Table.from_pandas(ops.join(comm.drop(columns="name")), preserve_index=False)

    def placement_frame(self) -> pd.DataFrame:
        """One row per rank: rank, pid of its process, its GPU's name where the trace has it."""
        return pd.DataFrame(sorted(self.placement.values(), key=lambda r: r["rank"]))

    def step_columns(self) -> pd.DataFrame:
        """rank, step, comm_wait_s: the exposed communication of each rank-step (see store_run)."""
        return pd.concat(self._comm_wait, ignore_index=True)


def _device(doc: dict, gpu: pd.DataFrame) -> str | None:
    """The name of the GPU most of the rank's GPU ops ran on, from deviceProperties."""
    devices = gpu["args"].map(lambda a: a.get("device")).dropna()
    props = doc.get("deviceProperties")
    if devices.empty or not isinstance(props, list):
        return None
    device = devices.mode().iloc[0]
    return next((p.get("name") for p in props if isinstance(p, dict) and p.get("id") == device), None)
