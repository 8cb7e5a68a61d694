"""Hostile files given to `rankwatch import` and to `--model`, and the modes of the store an import makes:
each file is refused in one line (exit 2) before it takes more memory than its size warrants or nests
past what its reader can follow, and the store is owner-only.

Covered: a 325-byte Flight Recorder pickle of shared references (a list of two references to a list of
two references ..., 28 deep: 2**28 values written out) is refused before anything expands it, and a
smaller one of the kind fails `rankwatch import` in one line; a 9-byte pickle storing at memo index 2**24
(a 256 MiB memo) is refused before it is loaded; nesting 200,000 deep in a dump (pickle or JSON) or a
Kineto trace is one line, never a RecursionError; a gzipped trace of spaces is refused once its
decompressed bytes pass the cap, having held about the cap; a `--model` .npz of zeros past its cap, or
one declaring an array larger than it holds, is refused before numpy allocates it; and the store and
directory `rankwatch import` creates are owner-only.
"""

import gzip
import pickle
import stat
import struct
import tracemalloc
import zipfile

import numpy as np
import pytest

from collector.predict import ncpp
from collector.predict.ncpp import Model
from collector.receive.imports import TraceError, kineto
from collector.receive.imports import flight_recorder as fr
from tests.support.commands import rankwatch_in_process
from tests.support.flight_dumps import HUNG, T0, job, write

pytestmark = pytest.mark.unit  # pure code on small inputs: `make check` runs these

DEEP = 200_000  # levels of nesting: past any recursion limit


class TracedPeak:
    """The most memory Python allocated while the block ran, above what it held at its start, in bytes
    (numpy's arrays and the unpickler's memo included)."""

    def __enter__(self) -> "TracedPeak":
        self._started = not tracemalloc.is_tracing()
        tracemalloc.start()
        self._base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        return self

    def __exit__(self, *exc) -> None:
        self.bytes = tracemalloc.get_traced_memory()[1] - self._base
        if self._started:
            tracemalloc.stop()


def shared(depth: int) -> list:
    """A list of two references to a list of two references ... `depth` deep: 2**depth values written out,
    a few bytes pickled."""
    value: list = [1]
    for _ in range(depth):
        value = [value, value]
    return value


def dump_of_sizes(sizes: object) -> dict:
    """A dump of one entry whose input sizes are `sizes`."""
    return {"entries": [{"profiling_name": "nccl:all_reduce", "time_created_ns": T0, "input_sizes": sizes}]}


def import_one_line(fmt: str, path, tmp_path) -> str:
    """What `rankwatch import FMT PATH` printed, having asserted it failed in one line with exit 2."""
    db = tmp_path / "s.duckdb"
    result = rankwatch_in_process("import", fmt, str(path), "--run", "bad", "--db", str(db))
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert not db.exists()  # refused before the store was made
    return result.stderr


def test_a_pickle_of_shared_references_is_refused_before_anything_expands_it(tmp_path):
    path = tmp_path / "nccl_trace_rank_0"
    path.write_bytes(pickle.dumps(dump_of_sizes(shared(28)), protocol=2))
    assert path.stat().st_size < 512
    with TracedPeak() as peak, pytest.raises(TraceError, match="refers to the same values over and over"):
        fr.load(path)
    assert peak.bytes < 4 << 20  # the file read a MiB at a time, then nothing it asks for


def test_a_dump_of_shared_references_fails_the_import_in_one_line(tmp_path):
    """Shallow enough that, were it read whole, it would be imported (2**20 values), not exhaust memory."""
    dumps = job(HUNG)
    dumps[0]["entries"][0]["input_sizes"] = shared(20)
    write(tmp_path / "dumps", dumps)
    line = import_one_line("flight-recorder", tmp_path / "dumps", tmp_path)
    assert "nccl_trace_rank_0: not a Flight Recorder dump: it refers to the same values over and over" in line


def test_a_memo_index_far_ahead_is_refused_before_the_unpickler_sizes_its_memo(tmp_path):
    path = tmp_path / "nccl_trace_rank_0"
    path.write_bytes(b"\x80\x02N" + b"r" + struct.pack("<I", 1 << 24) + b".")  # None, stored at 2**24
    with TracedPeak() as peak, pytest.raises(TraceError, match="memo index 16777216 with 0 values stored"):
        fr.load(path)
    assert peak.bytes < 4 << 20  # the file read a MiB at a time, then nothing it asks for


def deep_pickled_dump() -> bytes:
    """A dump whose entry's input sizes nest DEEP lists (the pickler itself would recurse, so the
    opcodes are written out: DEEP empty lists, each appended to the one before)."""
    pickled = pickle.dumps(dump_of_sizes("NEST"), protocol=2)
    return pickled.replace(b"X\x04\x00\x00\x00NEST", b"]" * DEEP + b"a" * (DEEP - 1), 1)


@pytest.mark.parametrize(
    "fmt, name, content",
    [
        ("flight-recorder", "nccl_trace_rank_0", deep_pickled_dump()),
        ("flight-recorder", "nccl_trace_rank_0", b'{"entries": [' + b"[" * DEEP + b"]" * DEEP + b"]}"),
        ("kineto", "rank0.json", b'{"traceEvents": [' + b"[" * DEEP + b"]" * DEEP + b"]}"),
    ],
    ids=["dump pickle", "dump JSON", "kineto JSON"],
)
def test_nesting_past_any_recursion_limit_is_one_line(tmp_path, fmt, name, content):
    (tmp_path / name).write_bytes(content)
    line = import_one_line(fmt, tmp_path / name, tmp_path)
    assert "nested deeper" in line or "recursion" in line, line


def gzipped_spaces(path, nbytes: int) -> None:
    """A gzipped file of `nbytes` spaces (1,000 times smaller)."""
    with gzip.open(path, "wb", compresslevel=1) as f:
        for _ in range(nbytes >> 20):
            f.write(b" " * (1 << 20))


def test_a_gzipped_trace_is_read_no_further_than_its_cap(tmp_path, monkeypatch):
    monkeypatch.setattr(kineto, "MAX_TRACE_BYTES", 2 << 20)
    bomb = tmp_path / "rank0.json.gz"
    gzipped_spaces(bomb, 64 << 20)
    with TracedPeak() as peak, pytest.raises(TraceError, match="more than 2 MiB of JSON once decompressed"):
        kineto.load(bomb)
    assert peak.bytes < 8 << 20  # the cap, a chunk and the bytearray's slack, not 64 MiB
    assert "rank0.json.gz: more than 2 MiB of JSON once decompressed" in import_one_line("kineto", bomb, tmp_path)


def test_a_model_file_of_zeros_past_its_cap_is_refused_before_it_is_inflated(tmp_path, monkeypatch):
    monkeypatch.setattr(ncpp, "MAX_MODEL_BYTES", 1 << 20)
    path = tmp_path / "model.npz"
    np.savez_compressed(path, __meta__=np.array("{}"), w=np.zeros(8 << 20, np.uint8))
    assert path.stat().st_size < 64 << 10
    with TracedPeak() as peak, pytest.raises(ValueError, match="its arrays take more than 1 MiB"):
        Model.load(path)
    assert peak.bytes < 1 << 20


def test_a_model_file_declaring_an_array_larger_than_it_holds_is_one_line(tmp_path):
    """Its header says 4 TiB of text; numpy would allocate that before reading the 64 bytes there are."""
    path = tmp_path / "model.npz"
    with zipfile.ZipFile(path, "w") as archive, archive.open("__meta__.npy", "w") as member:
        np.lib.format.write_array_header_1_0(member, {"descr": "<U1", "fortran_order": False, "shape": (1 << 40,)})
        member.write(b"\0" * 64)
    result = rankwatch_in_process("analyze", "r", "--model", str(path), "--db", str(tmp_path / "s.duckdb"))
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "__meta__.npy declares an array larger than the file holds" in result.stderr


def test_the_store_an_import_creates_is_owner_only(tmp_path):
    write(tmp_path / "dumps", job(HUNG))
    data = tmp_path / "data"
    result = rankwatch_in_process(
        "import", "flight-recorder", str(tmp_path / "dumps"), "--run", "r", "--db", str(data / "s.duckdb")
    )
    assert result.returncode == 0, result.stderr
    made = [data, *data.rglob("*")]
    assert data / "s.duckdb" in made
    assert {str(p): oct(stat.S_IMODE(p.stat().st_mode)) for p in made if p.stat().st_mode & 0o077} == {}
