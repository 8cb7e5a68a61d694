"""The collector's connections, held within a cap and a deadline for request headers.

uvicorn closes a keep-alive connection idle after a response, but has no
deadline for a connection that never finishes its request headers, and no cap
on open sockets (its limit_concurrency answers requests 503, after their
socket is open): idle or trickling connections used to pile up until the
process ran out of file descriptors, and every accept that failed logged.
Here a connection must complete its request headers within `header_timeout_s`
of opening, or of its last response, or is closed; and past `max_connections`
the connection that has waited longest for its headers is closed (else the new
one): a client that sends its request promptly is served however many idle
sockets others hold. The cap stays below the file-descriptor limit, whose soft
value is raised to the hard one; a closing over the cap logs once an interval.
"""

import asyncio
import logging
import os
import resource
import socket
import time
from collections import OrderedDict, deque

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("rankwatch.collector")
ACCEPT_BACKLOG = 128  # connections asyncio accepts in one turn of the event loop
# Connections the kernel queues before they are accepted: where the queue is full it drops a new
# connection's first packet, and the client sends it again a second later (a /healthz probe took 1.07 s
# beside a flood of connections). Linux caps it at net.core.somaxconn.
LISTEN_QUEUE = 4096
FD_RESERVE = 64  # descriptors kept for all but connections: the listening socket, pipes, logs
LOG_EVERY_S = 10.0
# Connections closed for their late headers in one turn of the event loop at most: thousands opened
# together are late together, and closing them in one turn held /healthz for a second.
CLOSE_PER_TURN = 256


def usable_connections(wanted: int) -> int:
    """`wanted`, or fewer where the file-descriptor limit (its soft value raised to the hard one)
    could not hold that many beside a full listen queue and the collector's own files."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY:
        return wanted
    return max(1, min(wanted, soft - LISTEN_QUEUE - FD_RESERVE))


class _Closings:
    """Connections closed over the cap, logged at most once every LOG_EVERY_S."""

    def __init__(self, cap: int):
        self.cap = cap
        self.unlogged = 0
        self.logged_at = -LOG_EVERY_S

    def note(self) -> None:
        self.unlogged += 1
        now = time.monotonic()
        if now - self.logged_at >= LOG_EVERY_S:
            log.warning("closed %d connection(s) over the cap of %d open connections", self.unlogged, self.cap)
            self.unlogged, self.logged_at = 0, now


def protocol(max_connections: int, header_timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol with the header deadline and the connection cap, for one server."""
    waiting: OrderedDict[H11Protocol, None] = OrderedDict()  # connections awaiting request headers, oldest first
    closings = _Closings(max_connections)
    late: deque[H11Protocol] = deque()  # past their header deadline, to be closed a turn's worth at a time

    def close_late() -> None:
        for _ in range(min(len(late), CLOSE_PER_TURN)):
            connection = late.popleft()
            if connection.conn.their_state is h11.IDLE and not connection.transport.is_closing():
                connection.transport.close()
        if late:
            asyncio.get_running_loop().call_soon(close_late)  # after what else is ready: a request, /healthz

    class Bounded(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._await_headers()
            if len(self.connections) > max_connections:
                oldest, _ = waiting.popitem(last=False)  # now, not when closed: the next one takes another
                oldest.transport.close()
                closings.note()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:
                self._headers_arrived()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
                self._await_headers()

        def connection_lost(self, exc: Exception | None) -> None:
            super().connection_lost(exc)
            self._headers_arrived()

        def _await_headers(self) -> None:
            self._headers_arrived()
            waiting[self] = None
            self._header_timer = self.loop.call_later(header_timeout_s, self._headers_late)

        def _headers_arrived(self) -> None:
            waiting.pop(self, None)
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_late(self) -> None:
            self._header_timer = None
            if self.conn.their_state is h11.IDLE:
                late.append(self)
                if len(late) == 1:
                    self.loop.call_soon(close_late)

    return Bounded


def lengthen_listen_queue(sockets) -> None:
    """Let the kernel queue LISTEN_QUEUE connections on each listening socket, while asyncio goes on
    accepting ACCEPT_BACKLOG a turn (it sets both from one number)."""
    for listening in sockets:
        with socket.socket(fileno=os.dup(listening.fileno())) as duplicate:
            duplicate.listen(LISTEN_QUEUE)
