"""Hostile loads on a collector, shared by the memory tests and bench/flood.py: valid requests
that inflate far past their gzip size, uploads and request headers that stop part way, and the
memory the collector's process tree holds meanwhile."""

import os
import select
import socket
import threading
import time
from pathlib import Path

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from rankwatch.agent import semconv as sc
from tests.support.otlp_payloads import T0

_PAGE = os.sysconf("SC_PAGE_SIZE")


def tree_rss(pid: int) -> int:
    """Bytes resident in process `pid` and all its descendants (read from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parent = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(parent, []).append(int(entry.name))
    total, todo = 0, [pid]
    while todo:
        one = todo.pop()
        try:
            total += int((Path("/proc") / str(one) / "statm").read_text().split()[1]) * _PAGE
        except OSError:
            continue
        todo += children.get(one, [])
    return total


class PeakRss:
    """The most a process tree held while the block ran, sampled every 20 ms."""

    def __init__(self, pid: int):
        self.pid = pid
        self.start = self.peak = tree_rss(pid)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._done.wait(0.02):
            self.peak = max(self.peak, tree_rss(self.pid))

    def __enter__(self) -> "PeakRss":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()


def padded_trace(run_id: str, rank: int, nbytes: int, pad: int = 16 * 2**10) -> bytes:
    """A valid trace request of about `nbytes`: step spans each with a `pad`-byte attribute (zeros
    as text, so gzip shrinks it ~500 times)."""
    request = ExportTraceServiceRequest()
    rs = request.resource_spans.add()
    rs.resource.attributes.add(key=sc.RUN_ID).value.string_value = run_id
    rs.resource.attributes.add(key=sc.RANK).value.int_value = rank
    scope = rs.scope_spans.add()
    for step in range(max(1, nbytes // pad)):
        span = scope.spans.add(
            trace_id=bytes(16),
            span_id=(step + 1).to_bytes(8, "big"),
            name="step",
            start_time_unix_nano=T0 + step * 10**9,
            end_time_unix_nano=T0 + step * 10**9 + 10**8,
        )
        for key, value in ((sc.KIND, sc.KIND_STEP), (sc.STEP, step), ("padding", "0" * pad)):
            kv = span.attributes.add(key=key)
            if isinstance(value, int):
                kv.value.int_value = value
            else:
                kv.value.string_value = value
    return request.SerializeToString()


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=2)


def partial_upload(url: str, token: str, declared: int, sent: int) -> socket.socket:
    """A connection that declares a `declared`-byte trace export and sends `sent` bytes of it."""
    sock = _connect(url)
    head = (
        f"POST /v1/traces HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n"
        f"Content-Type: application/x-protobuf\r\nContent-Length: {declared}\r\n\r\n"
    )
    sock.sendall(head.encode() + bytes(sent))
    return sock


def idle_connection(url: str) -> socket.socket:
    """A connection that sends part of a request's headers and then nothing."""
    sock = _connect(url)
    sock.sendall(b"POST /v1/traces HTTP/1.1\r\nHost: x\r\n")
    return sock


def statuses(socks: list[socket.socket], enough: int, timeout_s: float) -> list[int | None]:
    """What the server sent on each connection: its response's status, 0 when it closed the
    connection without one, None when nothing came; waits for `enough` of them (at most
    `timeout_s`), then a little longer for any others."""
    found: dict[socket.socket, int] = {}
    deadline = time.monotonic() + timeout_s
    while len(found) < len(socks):
        left = deadline - time.monotonic()
        ready, _, _ = select.select([s for s in socks if s not in found], [], [], max(0.0, left))
        for sock in ready:
            try:
                head = sock.recv(64)
            except ConnectionResetError:
                head = b""
            found[sock] = int(head.split()[1]) if head else 0
        if not ready and left <= 0:
            break
        if len(found) >= enough:
            deadline = min(deadline, time.monotonic() + 0.5)
    return [found.get(sock) for sock in socks]
