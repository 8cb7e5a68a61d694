"""A decoded batch of export requests: the rows one signal's requests bring the store, and each
request's share of them, as the decode workers hand them to the store's writer."""

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

MAX_REASON_CHARS = 500  # of the reason a request's items were refused: it may quote what the client sent


@dataclass
class Part:
    """One request's share of a decoded batch. Its rows follow the previous request's in
    every table of the batch."""

    rows: dict[str, int] = field(default_factory=dict)
    ranks: list[dict] = field(default_factory=list)  # the `ranks` rows (placements) its items spoke for
    rejected: int = 0
    error: str = ""
    malformed: str = ""  # why the whole request cannot be read (400)
    request_id: int = -1  # what the writer acknowledges it as (collector/store/handle.py's request id)
    digest: bytes = b""  # of its decompressed body: a retried request is stored once

    @property
    def accepted(self) -> int:
        return sum(self.rows.values())

    def reject(self, why: str, count: int = 1) -> None:
        self.rejected += count
        if not self.error:
            self.error = why if len(why) <= MAX_REASON_CHARS else why[: MAX_REASON_CHARS - 1] + "…"


@dataclass
class Decoded:
    """What a batch of export requests of one signal contributes to the store."""

    signal: str
    parts: list[Part]
    tables: dict[str, pa.Table] = field(default_factory=dict)

    @property
    def accepted(self) -> int:
        return sum(t.num_rows for t in self.tables.values())

    @property
    def ranks(self) -> list[dict]:
        return [rank for part in self.parts for rank in part.ranks]

    def select(self, keep: Sequence[bool]) -> "Decoded":
        """The requests (parts) where `keep` is true, with their rows and placements."""
        if all(keep):
            return self
        tables = {
            name: table.filter(np.repeat(keep, [part.rows.get(name, 0) for part in self.parts]))
            for name, table in self.tables.items()
        }
        return Decoded(self.signal, [part for part, kept in zip(self.parts, keep) if kept], tables)

    # Decoded batches travel between processes (decode worker -> writer). Arrow's IPC
    # format moves a table as one buffer; pickling it array by array costs 10x more.
    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["tables"] = {name: _ipc(table) for name, table in self.tables.items()}
        return state

    def __setstate__(self, state: dict) -> None:
        state["tables"] = {name: pa.ipc.open_stream(data).read_all() for name, data in state["tables"].items()}
        self.__dict__.update(state)


def _ipc(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()
