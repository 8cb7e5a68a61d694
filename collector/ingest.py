"""From request body to committed rows: decode in worker processes, write in the store.

Decoding protobuf into Arrow is CPU-bound Python, so it runs in a pool of
worker processes (one per core by default) while the event loop keeps
serving and the store's writer thread commits.
"""

import asyncio
import hashlib
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from collector import otlp
from collector.decode import DECODERS, Decoded, arrow_schema
from collector.schema import TELEMETRY_TABLES
from collector.store import Store


def decode_body(signal: str, kind: str, body: bytes) -> tuple[bytes, Decoded]:
    """(digest, decoded rows) of one decompressed request body; raises OtlpError."""
    message, decode = DECODERS[signal]
    digest = hashlib.blake2b(signal.encode() + b"\0" + body, digest_size=16).digest()
    if kind == otlp.JSON:
        body = otlp.parse(body, kind, message).SerializeToString()
    return digest, decode(body)


def _warm_up() -> None:
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
        return ProcessPoolExecutor(self._workers, mp_context=multiprocessing.get_context("spawn"),
                                   initializer=_warm_up)

    async def export(self, signal: str, kind: str, body: bytes) -> Decoded:
        """Decode and commit one request; returns once its rows are durable."""
        loop = asyncio.get_running_loop()
        try:
            digest, decoded = await loop.run_in_executor(self._pool, decode_body, signal, kind, body)
        except BrokenProcessPool:
            self._pool = self._new_pool()
            raise
        await asyncio.wrap_future(self.store.submit(digest, decoded))
        return decoded

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
