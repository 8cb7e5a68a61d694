"""A webhook receiver for the alert tests: a real HTTP server on loopback that checks every
request's Standard Webhooks signature with its own implementation of the spec (not the
collector's) and keeps what arrived."""

import base64
import hashlib
import hmac
import json
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from tests.conftest import wait_until

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
    """Answers `status` to every POST; `deliveries` lists what came, in order."""

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
                self.send_response(receiver.status)
                self.end_headers()

            def log_message(self, *args):
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def wait_for(self, n: int, timeout_s: float = 30.0) -> list[Delivery]:
        """The deliveries once there are at least `n` (or AssertionError after `timeout_s`)."""
        wait_until(lambda: len(self.deliveries) >= n, f"fewer than {n} notifications arrived", timeout_s)
        return self.deliveries
