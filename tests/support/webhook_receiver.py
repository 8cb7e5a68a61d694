"""Webhook receivers for the alert tests: a real HTTP server on loopback that checks every
request's Standard Webhooks signature with its own implementation of the spec (not the
collector's) and keeps what arrived; and hostile ones, whose answer is a gzip bomb or comes
a byte at a time."""

import base64
import contextlib
import functools
import hashlib
import hmac
import json
import struct
import threading
import time
import zlib
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from tests.support.waits import wait_until

TOLERANCE_S = 300  # the spec's suggested window for webhook-timestamp


def verify(secret: str, headers, body: bytes) -> bool:
    """The Standard Webhooks check: HMAC-SHA256 keyed with the base64 key after "whsec_", over
    "{webhook-id}.{webhook-timestamp}.{body}", one of the space-separated "v1,<base64>" signatures,
    and a timestamp within TOLERANCE_S of now."""
    key = base64.b64decode(secret[len("whsec_") :])
    msg_id, timestamp = headers["webhook-id"], headers["webhook-timestamp"]
    if abs(time.time() - int(timestamp)) > TOLERANCE_S:
        return False
    expected = base64.b64encode(
        hmac.new(key, msg_id.encode() + b"." + timestamp.encode() + b"." + body, hashlib.sha256).digest()
    )
    return any(
        version == "v1" and hmac.compare_digest(signature.encode(), expected)
        for version, _, signature in (s.partition(",") for s in headers["webhook-signature"].split(" "))
    )


@dataclass
class Delivery:
    webhook_id: str
    verified: bool | None  # None: the request carried no signature
    body: dict


class Receiver:
    """Answers `status` to every POST; `deliveries` lists what came, in order (before the answer)."""

    def __init__(self, port: int, secret: str | None = None, status: int = 200):
        self.port, self.secret, self.status = port, secret, status
        self.deliveries: list[Delivery] = []
        self._server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    def start(self) -> "Receiver":
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["content-length"]))
                signed = "webhook-signature" in self.headers
                receiver.deliveries.append(
                    Delivery(
                        self.headers["webhook-id"],
                        verify(receiver.secret, self.headers, body) if signed else None,
                        json.loads(body),
                    )
                )
                with contextlib.suppress(OSError):  # a hostile answer's client may hang up
                    receiver.answer(self)

            def log_message(self, *args):
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def answer(self, handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(self.status)
        handler.end_headers()

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def wait_for(self, n: int, timeout_s: float = 30.0) -> list[Delivery]:
        """The deliveries once there are at least `n` (or AssertionError after `timeout_s`)."""
        wait_until(lambda: len(self.deliveries) >= n, f"fewer than {n} notifications arrived", timeout_s)
        return self.deliveries


@functools.cache
def gzip_bomb(inflated: int, block: int = 2**20) -> bytes:
    """A gzip body (RFC 1952) of `inflated` zero bytes in about a thousandth of that: one deflated block of
    zeros, made byte-aligned and independent of what came before by a full flush, repeated."""
    zeros, blocks = bytes(block), inflated // block
    deflate = zlib.compressobj(9, zlib.DEFLATED, -zlib.MAX_WBITS)
    deflated = deflate.compress(zeros) + deflate.flush(zlib.Z_FULL_FLUSH)
    crc = 0
    for _ in range(blocks):
        crc = zlib.crc32(zeros, crc)
    header = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x02\xff"  # deflate, no name, no time
    return header + deflated * blocks + deflate.flush() + struct.pack("<II", crc, blocks * block % 2**32)


class GzipBomb(Receiver):
    """Answers 200 with a gzip-encoded body that inflates a thousandfold, to `inflated` bytes."""

    def __init__(self, port: int, inflated: int = 2**30):
        super().__init__(port)
        self.body = gzip_bomb(inflated)

    def answer(self, handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(200)
        handler.send_header("content-type", "application/json")
        handler.send_header("content-encoding", "gzip")
        handler.send_header("content-length", str(len(self.body)))
        handler.end_headers()
        handler.wfile.write(self.body)


class Trickler(Receiver):
    """Answers a byte every `every_s`, well within any read timeout, for a `length`-byte body after the
    status line and headers (or until the client hangs up): each read gets something, so only a
    deadline on the whole exchange ends it."""

    def __init__(self, port: int, every_s: float = 0.5, length: int = 600):
        super().__init__(port)
        self.every_s, self.length = every_s, length

    def answer(self, handler: BaseHTTPRequestHandler) -> None:
        for byte in f"HTTP/1.1 200 OK\r\ncontent-length: {self.length}\r\n\r\n".encode() + b" " * self.length:
            time.sleep(self.every_s)
            handler.wfile.write(bytes([byte]))
