"""From request body to committed rows: decode in worker processes, write in the store.

A gzip body is inflated first, on one of INFLATERS threads (zlib lets go of
the GIL), so that the write queue admits each request by its decompressed
size: what the collector holds is bounded in the bytes it works on, not in
the bytes that came over the wire (a 265 KiB gzip body can hold 20 MiB).

Decoding is CPU-bound, so it runs in a pool of worker processes (one per core
by default). Requests that arrive while every worker is busy wait and go to
the next free worker together, as one batch: under load, batches grow and the
per-call costs of decoding and writing are shared by many requests. A worker
hands the batch's Arrow tables straight to the store's writer process and
tells the server only each request's counts; the server's event loop never
touches the rows, and awaits the writer's acknowledgement of each request.
A batch holds at most MAX_BATCH_BYTES of bodies, the smallest waiting first
(a sender of small exports is not held up behind a flood of 20 MiB ones
already admitted), and OTLP/JSON (whose decode
costs tens of times protobuf's a byte) is decoded in at most one worker at a
time where there are several, so JSON senders cannot stall protobuf exports.
"""

import asyncio
import functools
import hashlib
import multiprocessing
import os
from collections import defaultdict
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from multiprocessing.queues import Queue

from collector.children import bound_heap, die_with_parent, return_memory
from collector.printable import escape_logs
from collector.receive import otlp
from collector.receive.decode import DECODERS, MAX_ATTRIBUTES, MAX_ITEMS, admit, arrow_schema, decode
from collector.store.handle import Store
from collector.store.schema import TELEMETRY_TABLES

MAX_BATCH = 64  # requests decoded together at most
MAX_BATCH_BYTES = 16 * 2**20  # decompressed body bytes decoded together at most (one body may be larger)
MAX_JSON_BATCH_BYTES = otlp.MAX_JSON_BODY  # OTLP/JSON decoded together at most: ~1 s of CPU
INFLATERS = 2  # threads inflating gzip bodies: each holds at most one body's cap at a time
_TRIM_BYTES = 2**20  # after work on this many bytes, freed heap goes back to the system
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
    body: bytes  # decompressed


def decode_batch(
    requests: list[Request],
    writer_queue: Queue | None = None,
) -> list[Outcome | otlp.OtlpError]:
    """Decode requests of one signal, queue their rows for the writer as one message, and return
    each request's outcome (an OtlpError for one that cannot be read or is too large; it alone)."""
    answers: dict[int, Outcome | otlp.OtlpError] = {}
    bodies, readable = [], []
    for request in requests:
        try:
            body = request.body
            digest = hashlib.blake2b(request.signal.encode() + b"\0" + body, digest_size=16).digest()
            if request.kind == otlp.JSON:
                message = DECODERS[request.signal][0]
                body = otlp.parse(body, request.kind, message, MAX_ITEMS, MAX_ATTRIBUTES).SerializeToString()
            admit(request.signal, body)
        except otlp.OtlpError as e:
            answers[request.id] = e
            continue
        bodies.append(body)
        readable.append((request.id, digest))
    if bodies:
        decoded = decode(requests[0].signal, bodies)
        for (request_id, digest), part in zip(readable, decoded.parts):
            part.request_id, part.digest = request_id, digest
            answers[request_id] = (
                otlp.OtlpError(400, part.malformed)
                if part.malformed
                else Outcome(part.accepted, part.rejected, part.error)
            )
        if decoded.accepted:
            queue = writer_queue or _writer_queue
            assert queue is not None  # the store's, given in the server or set in a decode worker
            queue.put(decoded.select([part.accepted > 0 for part in decoded.parts]))
    if sum(len(request.body) for request in requests) >= _TRIM_BYTES:
        return_memory()
    return [answers[request.id] for request in requests]


def _batch(waiting: list[tuple[Request, asyncio.Future]], max_bytes: int) -> list[tuple[Request, asyncio.Future]]:
    """The first waiting requests that fit in one batch: at most MAX_BATCH of them and `max_bytes`
    of bodies, and always at least one."""
    size = 0
    for n, (request, _) in enumerate(waiting[:MAX_BATCH]):
        size += len(request.body)
        if n and size > max_bytes:
            return waiting[:n]
    return waiting[:MAX_BATCH]


def _ready() -> None:
    """A task that returns once a worker has started."""


def _init_worker(writer_queue: Queue) -> None:
    global _writer_queue
    die_with_parent()
    bound_heap()
    escape_logs()
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
        self._inflaters = ThreadPoolExecutor(INFLATERS, thread_name_prefix="rankwatch-inflate")
        # requests waiting for a worker, by signal and media type (JSON is decoded in fewer workers)
        self._waiting: dict[tuple[str, str], list[tuple[Request, asyncio.Future]]] = defaultdict(list)
        self._busy = 0  # batches being decoded
        self._busy_json = 0  # of which OTLP/JSON
        self._max_json = max(self._workers - 1, 1)  # batches of JSON decoded at once: a worker stays for protobuf

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

    async def inflate(self, body: bytes, encoding: str | None, cap: int) -> bytes:
        """The body decompressed, within `cap` bytes (OtlpError 413 past it, 400 for bad gzip), on an
        inflater thread."""
        if encoding is None:
            return otlp.decompress(body, None, cap)
        return await asyncio.get_running_loop().run_in_executor(self._inflaters, otlp.decompress, body, encoding, cap)

    async def export(self, signal: str, kind: str, body: bytes) -> Outcome:
        """Decode and commit one request (its body decompressed); returns once its rows are durable.
        Raises OtlpError for a request that cannot be read, Overloaded when the queue is full."""
        request_id, committed = self.store.expect(len(body))
        decoded = asyncio.get_running_loop().create_future()
        self._waiting[signal, kind].append((Request(request_id, signal, kind, body), decoded))
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
        while self._busy < max(self._workers, 1):
            ready = [key for key in self._waiting if key[1] != otlp.JSON or self._busy_json < self._max_json]
            if not ready:
                return
            key = ready[0]
            self._waiting[key].sort(key=lambda waiting: len(waiting[0].body))  # stable: oldest first among equals
            batch = _batch(self._waiting[key], MAX_JSON_BATCH_BYTES if key[1] == otlp.JSON else MAX_BATCH_BYTES)
            if len(batch) < len(self._waiting[key]):
                self._waiting[key] = self._waiting[key][len(batch) :]
            else:
                del self._waiting[key]
            requests = [request for request, _ in batch]
            if self._pool is None:
                task = loop.run_in_executor(None, decode_batch, requests, self.store.requests)
            else:
                task = loop.run_in_executor(self._pool, decode_batch, requests)
            self._busy += 1
            self._busy_json += key[1] == otlp.JSON
            task.add_done_callback(functools.partial(self._decoded, batch=batch, pool=self._pool, kind=key[1]))

    def _decoded(
        self,
        task: asyncio.Future,
        batch: list[tuple[Request, asyncio.Future]],
        pool: ProcessPoolExecutor | None,
        kind: str,
    ) -> None:
        self._busy -= 1
        self._busy_json -= kind == otlp.JSON
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
        self._inflaters.shutdown()
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None  # releases its queues' semaphores before uvicorn re-raises SIGTERM
