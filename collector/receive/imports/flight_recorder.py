"""PyTorch NCCL Flight Recorder dumps: a file per rank, each collective it recorded as an op.

When a job times out (TORCH_NCCL_DUMP_ON_TIMEOUT=1) or on demand, each rank
writes its Flight Recorder ring buffer: the last collectives and
point-to-point ops it enqueued, each with its process group, sequence number,
sizes and state (scheduled, started, completed), a send's or receive's peer
in its name. Those say which rank never entered the collective the others
are blocked in, or never sent what another waits to receive, even for a job
that sent no telemetry (collector/analysis/analyzers/collectives.py and
p2p.py read them).

A dump is named `<prefix><rank>` (by default /tmp/nccl_trace_rank_<rank>):
the rank is the number that ends the file name, as for PyTorch's fr_trace.
PATH is one dump or a directory of them. A dump is a pickle, or JSON where the
job set TORCH_FR_DUMP_JSON. Versions differ in their keys; the ones an entry
cannot do without are profiling_name and time_created_ns.

Security: loading a pickle can run any code its author chose. A dump holds
only plain data (dicts, lists, tuples, strings, numbers, booleans, None), so
it is read by an Unpickler whose find_class refuses every global: a file that
names one (os.system, any class) is rejected before anything runs, never
passed to plain pickle.load. Nor may a dump take more memory than its size
warrants: a file past MAX_DUMP_BYTES is refused unread; a pickle's memo
indices are checked before it is loaded (the unpickler sizes its memo by the
largest, so 9 bytes could ask for 4 GiB); and what was loaded is refused when
it nests deeper than MAX_DEPTH or, each value counted as often as it is
referred to, holds more than AMPLIFICATION times the file's bytes (a pickle
refers to a value already loaded in 2 bytes, so a few hundred bytes can hold a
list of two references to a list of two references ... 30 deep, which JSON
and the rows would write out 2**30 times).

Every entry becomes one `comm` op without a step (a dump knows no training
steps, so the run has no `steps` rows); each dump's header (version, the
process groups the rank knows with their member ranks, pg_status) becomes a
`flight_recorder_dump` event, from which the analysis learns who belongs to a
group. docs/telemetry.md has the mapping. Dumps are read one at a time.
"""

import io
import json
import math
import pickle
import pickletools
import re
from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path
from typing import Any, NamedTuple

import pandas as pd
import pyarrow as pa

from collector.nccl import DTYPE_BYTES, canonical_op
from collector.receive.imports import TraceError, files_of, read_at_most
from rankwatch.agent import semconv as sc

EVENT = "flight_recorder_dump"
_RANK_AT_END = re.compile(r"(\d+)(\.(json|pkl|pickle))?$")
_P2P = ("send", "recv")
_LISTS = ("input_sizes", "output_sizes", "input_dtypes", "output_dtypes")  # an entry's tensors, as it gives them
# the peer in a send's or receive's name, both group ranks: "nccl:send 0->1", "nccl:recv 1<-0"
_PEER = re.compile(r":(?:send|recv) \d+(?:->|<-)(\d+)$")
_DEFAULT_GROUP = "default_pg"  # the description PyTorch gives the world's process group
MAX_DUMP_BYTES = 64 << 20  # a dump's file: PyTorch's ring of 2,000 entries, stacks included, takes a few MB
AMPLIFICATION = 16  # values and characters a dump may hold per byte of its file (a plain one holds 1 to 2)
MAX_DEPTH = 32  # a dump nests 6 deep: dump, entries, entry, input_sizes, a tensor's sizes, a size
_MEMO_PUTS = ("PUT", "BINPUT", "LONG_BINPUT")  # the opcodes that store at an index of their own


class _PlainData(pickle.Unpickler):
    """Rebuilds builtin containers and scalars only: no global is ever looked up, so no code runs."""

    def find_class(self, module: str, name: str):
        raise pickle.UnpicklingError(
            f"it refers to {module}.{name}, and a dump holds plain data only: refused without running anything"
        )


def _check_memo(data: bytes | bytearray) -> None:
    """Refuse (UnpicklingError) a pickle that stores at a memo index beyond the values stored so far,
    before it is loaded: the C unpickler grows its memo to twice the largest index at once, and a
    pickler numbers them from 0 without gaps. pickletools reads the opcodes without building anything,
    and refuses any that declares more bytes than the file holds."""
    stored = 0
    for opcode, index, _ in pickletools.genops(data):
        if opcode.name == "MEMOIZE":
            stored += 1
        elif opcode.name in _MEMO_PUTS:
            assert isinstance(index, int)  # the argument of each of these opcodes
            if index > stored:
                raise pickle.UnpicklingError(f"it stores at memo index {index} with {stored} values stored")
            stored = max(stored, index + 1)


def _check_expansion(path: Path, dump: Any, nbytes: int) -> None:
    """Refuse a dump that nests deeper than MAX_DEPTH, or that holds more than AMPLIFICATION times its
    `nbytes` of values and string characters, each counted as often as it is referred to: what reads
    the dump (the rows, their JSON) writes out every reference, and a reference to itself, forever."""
    budget, stack = AMPLIFICATION * nbytes, [(dump, 0)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise TraceError(f"{path}: not a Flight Recorder dump: nested deeper than {MAX_DEPTH} levels")
        budget -= 1 + (len(value) if isinstance(value, (str, bytes, bytearray)) else 0)
        if budget < 0:
            raise TraceError(
                f"{path}: not a Flight Recorder dump: it refers to the same values over and over, to more than "
                f"{AMPLIFICATION} times its {nbytes} bytes"
            )
        if isinstance(value, dict):
            stack += ((item, depth + 1) for pair in value.items() for item in pair)
        elif isinstance(value, (list, tuple, set, frozenset)):
            stack += ((item, depth + 1) for item in value)


def dump_files(*paths: Path) -> list[tuple[int, Path]]:
    """(rank, file) of the dumps given and of every file in each directory given (dot files aside), in
    rank order."""
    ranked: dict[int, Path] = {}
    for file in files_of(paths, lambda p: not p.name.startswith("."), "dump"):
        m = _RANK_AT_END.search(file.name)
        if not m:
            raise TraceError(
                f"{file}: no rank at the end of the file name (dumps are <prefix><rank>, e.g. nccl_trace_rank_3)"
            )
        if int(m.group(1)) in ranked:
            raise TraceError(
                f"{file}: rank {int(m.group(1))} again (also {ranked[int(m.group(1))]}): one run is one dump per rank"
            )
        ranked[int(m.group(1))] = file
    return sorted(ranked.items())


def load(path: Path) -> dict:
    """A dump (JSON, else pickle of plain data) as a dict, checked to hold a list of entries and to
    be no larger than its file warrants (see the module's docstring)."""
    try:
        with open(path, "rb") as f:
            data = read_at_most(f, MAX_DUMP_BYTES)
    except OSError as e:
        raise TraceError(f"{path}: {e.strerror or e}") from None
    if data is None:
        raise TraceError(f"{path}: more than {MAX_DUMP_BYTES >> 20} MiB; not a Flight Recorder dump")
    try:
        if data.lstrip()[:1] == b"{":
            dump = json.loads(data)
        else:
            _check_memo(data)
            dump = _PlainData(io.BytesIO(data)).load()
    except Exception as e:  # malformed bytes raise any of a dozen types (deep JSON a RecursionError): not a dump
        raise TraceError(
            f"{path}: not a Flight Recorder dump: {(str(e) or type(e).__name__).splitlines()[0]}"
        ) from None
    _check_expansion(path, dump, len(data))
    if isinstance(dump, dict) and "entries" not in dump and "pg_config" in dump:
        dump["entries"] = []  # a JSON dump leaves the key out when the rank recorded nothing
    if not isinstance(dump, dict) or not isinstance(dump.get("entries"), list):
        raise TraceError(f"{path}: not a Flight Recorder dump: no dict with a list of entries")
    return dump


def _groups(path: Path, dump: dict) -> dict[str, dict]:
    """The process groups a dump lists (see process_groups)."""
    try:
        return process_groups(dump.get("pg_config") or {})
    except ValueError as e:
        raise TraceError(f"{path}: {e}") from None


def process_groups(config: Any) -> dict[str, dict]:
    """The process groups a Flight Recorder lists (its pg_config): name -> {"desc", "ranks": member global
    ranks}; ValueError where it is not a map of groups with their ranks."""
    groups = {}
    try:
        for name, pg in config.items():
            ranks = json.loads(pg["ranks"]) if isinstance(pg["ranks"], str) else pg["ranks"]
            groups[str(name)] = {"desc": pg.get("desc"), "ranks": [int(r) for r in ranks]}
    except (AttributeError, KeyError, TypeError, ValueError, RecursionError):  # ranks: JSON in a string, any depth
        raise ValueError("pg_config is not a map of process groups with their ranks") from None
    return groups


def _status(path: Path, dump: dict) -> dict[str, dict[str, int]]:
    """pg_status as numbers (JSON dumps write them as strings): pg id -> last enqueued, started, completed seq."""
    try:
        return {str(pg): {k: int(v) for k, v in status.items()} for pg, status in (dump.get("pg_status") or {}).items()}
    except (AttributeError, TypeError, ValueError):
        raise TraceError(f"{path}: pg_status is not a map of sequence numbers") from None


def _world_size(groups: dict[str, dict]) -> int | None:
    """The size of the default process group, where the dump lists it."""
    return next((len(g["ranks"]) for g in groups.values() if g["desc"] == _DEFAULT_GROUP), None)


def _nbytes(sizes: list | None, dtypes: list | None) -> int | None:
    """Bytes of one side's tensors (elements times dtype size, summed); None without tensors, a known
    dtype or whole numbers for sizes (math.prod of ["x", 10**9] is a string of 1 GB)."""
    if not sizes or dtypes is None or not all(_whole_numbers(s) for s in sizes):
        return None
    try:
        return sum(math.prod(s) * DTYPE_BYTES[d] for s, d in zip(sizes, dtypes, strict=True))
    except (KeyError, TypeError, ValueError):
        return None


def _whole_numbers(sizes: Any) -> bool:
    """Whether one tensor's sizes are a list of whole numbers."""
    return isinstance(sizes, (list, tuple)) and all(isinstance(n, int) for n in sizes)


class Entry(NamedTuple):
    """One Flight Recorder entry as rankwatch reads it, wherever it came from (a dump imported here, a rank's
    answer to a stacks request: collector/analysis/recorded.py): what the collective and point-to-point
    matching read of it."""

    name: str  # the op: the collective canonical_op reads in its profiling name, else the name without its prefix
    group: str | None  # the process group's name
    group_size: int | None  # its members, where the Flight Recorder lists the group
    seq: int | None  # the op's number in its group: collective_seq_id, or p2p_seq_id for a send or receive
    attrs: dict  # state, group_desc, profiling_name, record_id, is_p2p, peer and the four lists (docs/telemetry.md)


def read_entry(entry: dict, groups: dict[str, dict]) -> Entry:
    """One entry, its group's members and description read in `groups` (process_groups); raises (KeyError,
    TypeError, ValueError, AttributeError) where it is not a Flight Recorder entry."""
    profiling = entry["profiling_name"]
    name = _name(profiling)
    pg = entry.get("process_group")  # (name, desc): a tuple in pickles, a list in JSON
    group, desc = (
        (str(pg[0]), pg[1])
        if isinstance(pg, (list, tuple)) and len(pg) == 2
        else (str(entry["pg_id"]) if "pg_id" in entry else None, None)
    )
    known = groups.get(group, {}) if group is not None else {}
    p2p = bool(entry.get("is_p2p", name in _P2P))
    seq = entry.get("p2p_seq_id") if p2p else entry.get("collective_seq_id", entry.get("seq_id"))
    attrs = {
        "state": _state(entry),
        "group_desc": desc if desc is not None else known.get("desc"),
        "profiling_name": profiling,
        "record_id": entry.get("record_id"),
        "is_p2p": p2p,
        "peer": _peer(profiling, known),
        **{k: entry.get(k) for k in _LISTS},
    }
    return Entry(name, group, len(known["ranks"]) if known else None, None if seq is None else int(seq), attrs)


@lru_cache(maxsize=4096)
def _name(profiling: str) -> str:
    """The op a profiling name denotes, without "nccl:", "gloo:" (a rank's few names, read for every entry)."""
    return canonical_op(profiling) or profiling.partition(":")[2] or profiling


def _op(entry: dict, groups: dict[str, dict]) -> tuple:
    """One entry as (name, comm_group, group_size, seq, bytes, start_ns, end_ns, attrs JSON): read_entry's,
    with its times and bytes."""
    read = read_entry(entry, groups)
    # JSON dumps write 0 for a time not (yet) seen, pickles None
    start = int(entry.get("time_discovered_started_ns") or entry["time_created_ns"])
    duration_ms = entry.get("duration_ms")
    end = int(entry.get("time_discovered_completed_ns") or (start + round(duration_ms * 1e6) if duration_ms else start))
    sides = [_nbytes(entry.get(f"{side}_sizes"), entry.get(f"{side}_dtypes")) for side in ("input", "output")]
    # nccl-tests bytes: the full buffer, the larger side (all_gather's output, reduce_scatter's input)
    nbytes = max((b for b in sides if b is not None), default=None)
    return (read.name, read.group, read.group_size, read.seq, nbytes, start, end, json.dumps(read.attrs, default=str))


def _state(entry: dict) -> Any:
    """The entry's state; `completed` for gloo's once retired: gloo leaves every entry `scheduled` and
    retires it once its work has run."""
    state = entry.get("state")
    if state == "scheduled" and entry.get("retired") is True and str(entry["profiling_name"]).startswith("gloo:"):
        return "completed"
    return state


def _peer(profiling: str, group: dict) -> int | None:
    """The global rank a send goes to or a receive comes from, where its group's members are known."""
    m = _PEER.search(profiling)
    if not m:
        return None
    ranks = sorted(group.get("ranks", []))
    return ranks[int(m.group(1))] if int(m.group(1)) < len(ranks) else None


class FlightRecorderDumps:
    """Per-rank Flight Recorder dumps (a file or a directory), the first opened and checked up front
    (so the world size is known before anything is written); iterate `batches()` once to read them all."""

    rows = None  # not known before the files are read

    def __init__(self, *paths: Path):
        self.files = dump_files(*paths)
        self._first: dict | None = load(self.files[0][1])
        self.world_size = _world_size(_groups(self.files[0][1], self._first))
        self._events: list[dict] = []

    def batches(self) -> Iterator[pa.Table]:
        """Each rank's entries in the shape of the `ops` table, a dump at a time."""
        for rank, path in self.files:
            dump = self._first if self._first is not None else load(path)
            self._first = None
            groups = _groups(path, dump)
            world_size = _world_size(groups)
            if None not in (world_size, self.world_size) and world_size != self.world_size:
                raise TraceError(f"{path}: world size {world_size}, but {self.files[0][1]} says {self.world_size}")
            rows = []
            for i, entry in enumerate(dump["entries"]):
                try:
                    rows.append(_op(entry, groups))
                except (AttributeError, KeyError, TypeError, ValueError, OverflowError) as e:
                    raise TraceError(
                        f"{path}: entry {i} is not a Flight Recorder entry ({type(e).__name__}: {e})"
                    ) from None
            self._events.append(
                {
                    "rank": rank,
                    "ts": pd.Timestamp(path.stat().st_mtime_ns, unit="ns"),
                    "event": EVENT,
                    "body": path.name,
                    "attrs": json.dumps(
                        {"version": dump.get("version"), "pg_config": groups, "pg_status": _status(path, dump)},
                        default=str,
                    ),
                }
            )
            try:
                table = _table(rank, rows)
            except (OverflowError, pa.ArrowException) as e:  # a time or number past 64 bits
                raise TraceError(f"{path}: a value out of its column's range ({e})") from None
            yield table

    def placement_frame(self) -> pd.DataFrame:
        """One row per dump: its rank (a dump names no host or process)."""
        return pd.DataFrame({"rank": [rank for rank, _ in self.files]})

    def events(self) -> pd.DataFrame:
        """One `flight_recorder_dump` event per dump read (see store_run)."""
        return pd.DataFrame(self._events)


def _table(rank: int, rows: list[tuple]) -> pa.Table:
    names, groups, sizes, seqs, nbytes, starts, ends, attrs = zip(*rows) if rows else ([],) * 8
    return pa.table(
        {
            "rank": pa.array([rank] * len(rows), pa.int32()),
            "kind": pa.array([sc.KIND_COMM] * len(rows), pa.string()),
            "name": pa.array(names, pa.string()),
            "comm_group": pa.array(groups, pa.string()),
            "group_size": pa.array(sizes, pa.int32()),
            "seq": pa.array(seqs, pa.int64()),
            "bytes": pa.array(nbytes, pa.int64()),
            "start_ts": pa.array(starts, pa.timestamp("ns")),
            "end_ts": pa.array(ends, pa.timestamp("ns")),
            "duration_s": pa.array([(e - s) / 1e9 for s, e in zip(starts, ends)], pa.float64()),
            "attrs": pa.array(attrs, pa.string()),
        }
    )
