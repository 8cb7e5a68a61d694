"""From request body to committed rows: decode in worker processes, write in the store.

Decoding protobuf into Arrow is CPU-bound Python, so it runs in a pool of
worker processes (one per core by default). A worker hands its Arrow batches
straight to the store's writer process and tells the server only the counts;
the server's event loop never touches the rows, and awaits the writer's
acknowledgement.
"""

import asyncio
import hashlib
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass

from collector import otlp
from collector.children import die_with_parent
from collector.decode import DECODERS, Decoded, arrow_schema
from collector.schema import TELEMETRY_TABLES
from collector.store import Store

_writer_queue = None  # in a decode worker: the store's request queue


@dataclass
class Outcome:
    """What the server needs to answer an export."""

    accepted: int
    rejected: int
    error: str
    duplicate: bool = False


def decode(signal: str, kind: str, encoding: str | None, body: bytes) -> tuple[bytes, Decoded]:
    """(digest, decoded rows) of one request body as received; raises OtlpError."""
    body = otlp.decompress(body, encoding)
    message, decoder = DECODERS[signal]
    digest = hashlib.blake2b(signal.encode() + b"\0" + body, digest_size=16).digest()
    if kind == otlp.JSON:
        body = otlp.parse(body, kind, message).SerializeToString()
    return digest, decoder(body)


def _decode_and_queue(request_id: int, signal: str, kind: str, encoding: str | None, body: bytes,
                      writer_queue=None) -> Outcome:
    digest, decoded = decode(signal, kind, encoding, body)
    if decoded.accepted:
        (writer_queue or _writer_queue).put((request_id, digest, decoded))
    return Outcome(decoded.accepted, decoded.rejected, decoded.error)


def _ready() -> None:
    """A task that returns once a worker has started."""


def _init_worker(writer_queue) -> None:
    global _writer_queue
    die_with_parent()
    _writer_queue = writer_queue
    for table in TELEMETRY_TABLES:
        arrow_schema(table)


class Ingestor:
    """Decodes export requests and waits for the store to commit them."""

    def __init__(self, store: Store, workers: int | None = None):
        self.store = store
        self._workers = (os.cpu_count() or 1) if workers is None else workers
        self._pool = self._new_pool()

    def _new_pool(self) -> ProcessPoolExecutor | None:
        if self._workers == 0:
            return None
        pool = ProcessPoolExecutor(self._workers, mp_context=multiprocessing.get_context("spawn"),
                                   initializer=_init_worker, initargs=(self.store.requests,))
        # Start every worker now (the pool would spawn them on the first requests, which would then
        # wait seconds for the imports) and only then open the port.
        for started in [pool.submit(_ready) for _ in range(self._workers)]:
            started.result()
        return pool

    async def export(self, signal: str, kind: str, encoding: str | None, body: bytes) -> Outcome:
        """Decompress, decode and commit one request; returns once its rows are durable."""
        loop = asyncio.get_running_loop()
        request_id, committed = self.store.expect(len(body))
        try:
            if self._pool is None:
                outcome = await loop.run_in_executor(None, _decode_and_queue, request_id, signal, kind, encoding,
                                                     body, self.store.requests)
            else:
                outcome = await loop.run_in_executor(self._pool, _decode_and_queue, request_id, signal, kind,
                                                     encoding, body)
        except BrokenProcessPool:
            self.store.forget(request_id)
            self._pool = self._new_pool()
            raise
        except BaseException:
            self.store.forget(request_id)
            raise
        if not outcome.accepted:
            self.store.forget(request_id)
            return outcome
        outcome.duplicate = not await asyncio.wrap_future(committed)
        return outcome

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None  # releases its queues' semaphores before uvicorn re-raises SIGTERM
