"""From request body to committed rows: decode in worker processes, write in the store.

Decoding is CPU-bound, so it runs in a pool of worker processes (one per core
by default). Requests that arrive while every worker is busy wait and go to
the next free worker together, as one batch: under load, batches grow and the
per-call costs of decoding and writing are shared by many requests. A worker
hands the batch's Arrow tables straight to the store's writer process and
tells the server only each request's counts; the server's event loop never
touches the rows, and awaits the writer's acknowledgement of each request.
"""

import asyncio
import functools
import hashlib
import multiprocessing
import os
from collections import defaultdict
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from multiprocessing.queues import Queue

from collector.children import die_with_parent
from collector.receive import otlp
from collector.receive.decode import DECODERS, MAX_ITEMS, admit, arrow_schema, decode
from collector.store.handle import Store
from collector.store.schema import TELEMETRY_TABLES

MAX_BATCH = 64  # requests decoded together at most
_writer_queue: Queue | None = None  # in a decode worker: the store's request queue


@dataclass
class Outcome:
    """What the server needs to answer an export."""

    accepted: int
    rejected: int
    error: str
    duplicate: bool = False


@dataclass
class Request:
    """One export request as received."""

    id: int
    signal: str
    kind: str
    encoding: str | None
    body: bytes


def decode_batch(
    requests: list[Request],
    writer_queue: Queue | None = None,
) -> list[Outcome | otlp.OtlpError]:
    """Decompress and decode requests of one signal, queue their rows for the writer as one
    message, and return each request's outcome (an OtlpError for one that cannot be read or is
    too large; it alone)."""
    answers: dict[int, Outcome | otlp.OtlpError] = {}
    bodies, readable = [], []
    for request in requests:
        try:
            body = otlp.decompress(request.body, request.encoding)
            digest = hashlib.blake2b(request.signal.encode() + b"\0" + body, digest_size=16).digest()
            if request.kind == otlp.JSON:
                body = otlp.parse(body, request.kind, DECODERS[request.signal][0], MAX_ITEMS).SerializeToString()
            admit(request.signal, body)
        except otlp.OtlpError as e:
            answers[request.id] = e
            continue
        bodies.append(body)
        readable.append((request.id, digest))
    if bodies:
        decoded = decode(requests[0].signal, bodies)
        for (request_id, _), part in zip(readable, decoded.parts):
            answers[request_id] = (
                otlp.OtlpError(400, part.malformed)
                if part.malformed
                else Outcome(part.accepted, part.rejected, part.error)
            )
        if decoded.accepted:
            stored = [
                (request_id, digest, part.rows)
                for (request_id, digest), part in zip(readable, decoded.parts)
                if part.accepted
            ]
            queue = writer_queue or _writer_queue
            assert queue is not None  # the store's, given in the server or set in a decode worker
            queue.put((stored, decoded))
    return [answers[request.id] for request in requests]


def _ready() -> None:
    """A task that returns once a worker has started."""


def _init_worker(writer_queue: Queue) -> None:
    global _writer_queue
    die_with_parent()
    # A worker exits only when the pool is replaced (its writer died: nobody reads the queue) or
    # shut down (every request it decoded has been acknowledged): never wait to flush at exit.
    writer_queue.cancel_join_thread()
    _writer_queue = writer_queue
    for table in TELEMETRY_TABLES:
        arrow_schema(table)


class Ingestor:
    """Decodes export requests in batches and waits for the store to commit them."""

    def __init__(self, store: Store, workers: int | None = None):
        self.store = store
        self._workers = (os.cpu_count() or 1) if workers is None else workers
        self._generation = store.generation  # the store's writer the pool's workers write to
        self._pool = self._new_pool()
        self._waiting: dict[str, list[tuple[Request, asyncio.Future]]] = defaultdict(list)
        self._busy = 0  # batches being decoded

    def _new_pool(self) -> ProcessPoolExecutor | None:
        if self._workers == 0:
            return None
        pool = ProcessPoolExecutor(
            self._workers,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_init_worker,
            initargs=(self.store.requests,),
        )
        # Start every worker now (the pool would spawn them on the first requests, which would then
        # wait seconds for the imports) and only then open the port.
        for started in [pool.submit(_ready) for _ in range(self._workers)]:
            started.result()
        return pool

    async def export(self, signal: str, kind: str, encoding: str | None, body: bytes) -> Outcome:
        """Decompress, decode and commit one request; returns once its rows are durable.
        Raises OtlpError for a request that cannot be read, Overloaded when the queue is full."""
        request_id, committed = self.store.expect(len(body))
        decoded = asyncio.get_running_loop().create_future()
        self._waiting[signal].append((Request(request_id, signal, kind, encoding, body), decoded))
        self._dispatch()
        try:
            outcome = await decoded
        except BaseException:
            self.store.forget(request_id)
            raise
        if not outcome.accepted:
            self.store.forget(request_id)
            return outcome
        outcome.duplicate = not await asyncio.wrap_future(committed)
        return outcome

    def _dispatch(self) -> None:
        """Give each idle worker the requests of one signal that wait, oldest signal first."""
        loop = asyncio.get_running_loop()
        if self._generation != self.store.generation and self._pool is not None:
            # a new writer, on new queues: workers hand rows to the queue they were started with
            self._pool.shutdown(wait=False)  # what it still decodes was failed with the dead writer
            self._generation, self._pool = self.store.generation, self._new_pool()
        while self._waiting and self._busy < max(self._workers, 1):
            signal = next(iter(self._waiting))
            batch, rest = self._waiting[signal][:MAX_BATCH], self._waiting[signal][MAX_BATCH:]
            if rest:
                self._waiting[signal] = rest
            else:
                del self._waiting[signal]
            requests = [request for request, _ in batch]
            if self._pool is None:
                task = loop.run_in_executor(None, decode_batch, requests, self.store.requests)
            else:
                task = loop.run_in_executor(self._pool, decode_batch, requests)
            self._busy += 1
            task.add_done_callback(functools.partial(self._decoded, batch=batch, pool=self._pool))

    def _decoded(
        self, task: asyncio.Future, batch: list[tuple[Request, asyncio.Future]], pool: ProcessPoolExecutor | None
    ) -> None:
        self._busy -= 1
        failed = task.exception()
        if isinstance(failed, BrokenProcessPool) and pool is not None and pool is self._pool:
            self._pool = self._new_pool()
        answers = [failed] * len(batch) if failed else task.result()
        for (_, waiter), answer in zip(batch, answers):
            if waiter.done():  # the client went away
                continue
            if isinstance(answer, BaseException):
                waiter.set_exception(answer)
            else:
                waiter.set_result(answer)
        self._dispatch()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None  # releases its queues' semaphores before uvicorn re-raises SIGTERM
