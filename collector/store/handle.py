"""The server's handle on the store's writer process (collector/store/writer.py): admission of
requests within a budget of decompressed bytes, a future for each request and call, and a new writer when one dies."""

import itertools
import logging
import multiprocessing
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from multiprocessing.connection import wait
from pathlib import Path
from typing import TypeVar

from collector import children
from collector.store import writer
from collector.store.db import StoreLocked
from collector.store.lake import Lake
from collector.store.requests import Request

log = logging.getLogger("rankwatch.collector")
Reply = TypeVar("Reply")


class Overloaded(Exception):
    """The write queue is full; the client should retry later."""


class NotStored(RuntimeError):
    """A request's rows were not stored (the writer's commit of it failed): the client sends again.
    The writer has logged why, once for its group."""


class Store:
    """The server's handle on the writer process.

    Producers (decode workers, or the server itself) put a `Decoded` batch on
    `requests`, its parts naming their requests' ids and digests, one message per
    decoded batch; the server registers each request id with
    `expect()` first and gets a future that resolves when the writer has
    committed it (True) or found it a duplicate (False).

    A writer that dies (killed, out of memory) fails what was waiting for it (the
    clients retry) and is replaced by one that recovers the write-ahead log, on new
    queues: `generation` counts them, so producers holding the old queue know to take
    the new one. Past MAX_RESTARTS within RESTART_WINDOW_S the store gives up
    (`failure` says why) rather than crash-loop on what kills it.
    """

    MAX_RESTARTS = 3
    RESTART_WINDOW_S = 60.0

    def __init__(
        self,
        path: Path,
        max_queue_bytes: int = 128 * 2**20,
        on_commit: Callable[[float, int], None] | None = None,
        tasks: Callable[[], Sequence[writer.Task]] = tuple,
        on_failure: Callable[[], None] | None = None,
        memory_headroom: int = writer.MEMORY_HEADROOM,
        lake: Lake | None = None,
    ):
        """Start the writer; raises StoreLocked (or the open error) if it cannot open `path`.
        `tasks`: builds what the writer runs beside its commits (writer.Task), called in each writer process
        started (picklable: collector/writertasks.py's), so that this process need not import what they do.
        `on_failure`: called once the store has given up on its writer. `memory_headroom`: the
        writer's address space past what it maps once the store is open (writer.MEMORY_HEADROOM).
        `lake`: the writer stores into this lake (collector/store/lake.py), `path`'s directory holding
        this collector's own files (its token, the files its queries may read)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.max_queue_bytes = max_queue_bytes
        self._on_commit, self._on_failure = on_commit, on_failure
        self._tasks = tasks
        self._memory_headroom = memory_headroom
        self._lake = lake
        self._context = multiprocessing.get_context("spawn")
        for name, value in children.RETURN_ADDRESS_SPACE.items():  # for the writer's memory cap
            os.environ.setdefault(name, value)
        self._lock = threading.Lock()
        self._pending: dict[int, tuple[Future, int]] = {}
        self._ids = itertools.count()
        self._queued_bytes = 0
        self._closing = False
        self._closed = threading.Event()
        self._restarts: list[float] = []  # when the writer was replaced, within the window
        self.generation = -1  # writers started before the one running
        self.failure: str | None = None
        self._start_writer()
        self._reader = threading.Thread(target=self._read_acks, name="rankwatch-acks", daemon=True)
        self._reader.start()

    def _start_writer(self) -> None:
        """A writer process on new queues, once it has the store open (recovering its write-ahead log).
        A dead writer's queues are let go without waiting to flush what nobody will read."""
        self._ready = False
        for dead in (getattr(self, "requests", None), getattr(self, "_acks", None)):
            if dead is not None:
                dead.cancel_join_thread()
                dead.close()
        self.requests = self._context.Queue()
        self._acks = self._context.Queue()
        self._process = self._context.Process(
            target=writer.main,
            args=(self.path, self._tasks, self.requests, self._acks, self._memory_headroom, self._lake),
            name="rankwatch-writer",
            daemon=True,
        )
        self._process.start()
        while True:
            try:
                first = self._acks.get(timeout=1.0)
                break
            except queue.Empty:
                if not self._process.is_alive():
                    first = writer.StartFailed(
                        f"the writer process exited with status {self._process.exitcode}", locked=False
                    )
                    break
        if isinstance(first, writer.StartFailed):
            self._process.join()
            raise StoreLocked(first.reason) if first.locked else RuntimeError(first.reason)
        self.generation += 1  # before requests are admitted: none may go to the old queue's producers
        self._ready = True

    @property
    def healthy(self) -> bool:
        """Whether a writer is up and taking requests (what /healthz reports). Its exit is read off its sentinel,
        which does not reap it: the acknowledgements' thread reaps it, and of two threads reaping one process
        the one that loses is told it still runs (`is_alive()`)."""
        return self._ready and not wait([self._process.sentinel], timeout=0)

    @property
    def queued_bytes(self) -> int:
        """Request bytes (decompressed) admitted and not yet committed (or forgotten)."""
        return self._queued_bytes

    def expect(self, nbytes: int) -> tuple[int, Future]:
        """A request id to queue a request of `nbytes` under, and the future of its commit.
        Raises Overloaded when admitting it would pass max_queue_bytes."""
        future: Future = Future()
        with self._lock:
            if self._queued_bytes and self._queued_bytes + nbytes > self.max_queue_bytes:
                raise Overloaded(f"write queue full ({self._queued_bytes} bytes waiting)")
            self._check_writer()
            request_id = next(self._ids)
            self._pending[request_id] = (future, nbytes)
            self._queued_bytes += nbytes
        return request_id, future

    def call(self, request: Request[Reply]) -> "Future[Reply]":
        """Have the writer process answer `request` (collector/store/requests.py: the control and query
        APIs' way to the store); the future holds its reply or its exception."""
        future: Future = Future()
        with self._lock:
            self._check_writer()
            call_id = next(self._ids)
            self._pending[call_id] = (future, 0)
        self.requests.put(writer.Call(call_id, request))
        return future

    def _check_writer(self) -> None:
        if not self.healthy:
            raise RuntimeError(self.failure or "the store's writer process is restarting")

    def forget(self, request_id: int) -> None:
        """Drop a request that was never queued (it failed to decode or had no rows)."""
        with self._lock:
            _, nbytes = self._pending.pop(request_id, (None, 0))
            self._queued_bytes -= nbytes

    def close(self) -> None:
        """Drain the queue, checkpoint the WAL into the file, and stop the writer."""
        self._closing = True
        if self.healthy:
            self.requests.put(None)
        self._closed.wait()
        self._process.join()
        for q in (self.requests, self._acks):
            q.close()
            q.join_thread()
        # Dropping the queues releases their semaphores now: uvicorn ends the process by
        # re-raising SIGTERM, before the interpreter would have collected them.
        del self.requests, self._acks

    def _read_acks(self) -> None:
        while True:
            try:
                ack = self._acks.get(timeout=1.0)
            except queue.Empty:
                if self._process.is_alive():
                    continue
                self._fail_pending("the store's writer process exited")
                if self._closing or not self._restart():
                    self._closed.set()
                    return
                continue
            if isinstance(ack, writer.Closed):
                self._closed.set()
                return
            if isinstance(ack, (writer.Answered, writer.Raised)):
                with self._lock:
                    future, _ = self._pending.pop(ack.call_id, (None, 0))
                if future is not None:
                    if isinstance(ack, writer.Answered):
                        future.set_result(ack.value)
                    else:
                        future.set_exception(ack.error)
                continue
            committed = isinstance(ack, writer.Committed)
            results = ack.acknowledged if committed else [(request_id, None) for request_id in ack.request_ids]
            with self._lock:
                settled = [(self._pending.pop(request_id, (None, 0)), written) for request_id, written in results]
                self._queued_bytes -= sum(nbytes for (_, nbytes), _ in settled)
            for (future, _), written in settled:
                if future is None:
                    continue
                if committed:
                    future.set_result(written)
                else:
                    future.set_exception(NotStored(ack.reason))
            if committed and self._on_commit:
                self._on_commit(ack.seconds, ack.rows)

    def _fail_pending(self, reason: str) -> None:
        """Fail every request and call still waiting: none was acknowledged, so each client retries."""
        with self._lock:
            failed, self._pending, self._queued_bytes = list(self._pending.values()), {}, 0
        for future, _ in failed:
            future.set_exception(RuntimeError(reason))

    def _restart(self) -> bool:
        """Replace a dead writer (one that dies starting counts as another death); False (and
        `failure` set, `on_failure` called) when it cannot be."""
        while True:
            status = self._process.exitcode
            now = time.monotonic()
            self._restarts = [t for t in self._restarts if now - t < self.RESTART_WINDOW_S] + [now]
            if len(self._restarts) > self.MAX_RESTARTS:
                self.failure = (
                    f"the store's writer process died {len(self._restarts)} times in "
                    f"{self.RESTART_WINDOW_S:.0f} s (last status {status}); not restarted"
                )
                break
            log.error("the store's writer process died (status %s); starting another", status)
            try:
                self._start_writer()
            except StoreLocked as e:  # another process took the store: starting again cannot help
                self.failure = f"the store's writer process died (status {status}) and could not be restarted: {e}"
                break
            except Exception:
                continue
            if self._closing:  # close() found no writer to stop: stop this one
                self.requests.put(None)
            return True
        log.error("%s", self.failure)
        if self._on_failure:
            self._on_failure()
        return False
