"""A decoded batch of export requests: the rows one signal's requests bring the store, and each
request's share of them, as the decode workers hand them to the store's writer."""

from dataclasses import dataclass, field

import pyarrow as pa


@dataclass
class Part:
    """One request's share of a decoded batch. Its rows follow the previous request's in
    every table of the batch."""

    rows: dict[str, int] = field(default_factory=dict)
    rejected: int = 0
    error: str = ""
    malformed: str = ""  # why the whole request cannot be read (400)

    @property
    def accepted(self) -> int:
        return sum(self.rows.values())

    def reject(self, why: str, count: int = 1) -> None:
        self.rejected += count
        self.error = self.error or why


@dataclass
class Decoded:
    """What a batch of export requests of one signal contributes to the store."""

    signal: str
    parts: list[Part]
    tables: dict[str, pa.Table] = field(default_factory=dict)
    ranks: list[dict] = field(default_factory=list)

    @property
    def accepted(self) -> int:
        return sum(t.num_rows for t in self.tables.values())

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
