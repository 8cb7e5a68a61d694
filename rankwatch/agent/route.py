"""Which collector a rank talks to when it is given several (`--collector URL1,URL2,...`: the collectors
of one lake, collector/store/lake.py, any of which stores what it is sent and answers for the whole
lake): the one the host's name picks, so that a node's ranks send to the same collector and the
load spreads by node; once that one cannot be reached, the next in the list that can, and the
telemetry waiting for it goes there (rankwatch/agent/export.py's backlogs). A collector the route moved away
from is tried again only when the others cannot be reached either.
"""

import logging
import socket
import threading
import zlib
from collections.abc import Sequence
from urllib.parse import urlsplit

log = logging.getLogger("rankwatch.agent")


class Route:
    """The collector this process talks to, of `urls`; shared by its senders (thread-safe)."""

    def __init__(self, urls: Sequence[str], host: str | None = None, offset: int = 0):
        """Starting at the collector `host` (default this machine's name) picks, `offset` places on (the
        senders of a process that speaks for many nodes, the fleet simulator, each start at another)."""
        if not urls:
            raise ValueError("a route needs a collector URL")
        self.urls = list(urls)
        # crc32, not hash(): the same choice in every process of the node, whatever its hash seed
        self._at = (zlib.crc32((host or socket.gethostname()).encode()) + offset) % len(self.urls)
        self._lock = threading.Lock()

    @classmethod
    def of(cls, urls: str) -> "Route":
        """The route over a comma-separated list of collector URLs (agent.config.collector_urls)."""
        return cls([u.strip().rstrip("/") for u in urls.split(",") if u.strip()])

    @property
    def url(self) -> str:
        return self.urls[self._at]

    def reachable(self) -> str | None:
        """The collector to send to now: this route's, or, where it accepts no connection, the next in
        the list that does (the route moves there); None when none does."""
        tried = self.url
        for _ in range(len(self.urls)):
            if reachable(tried):
                return tried
            tried = self.away(tried)
        return None

    def away(self, url: str) -> str:
        """`url` cannot be reached: the next collector, unless another sender of this process moved on
        from it already (then the one it moved to)."""
        with self._lock:
            if self.urls[self._at] == url and len(self.urls) > 1:
                self._at = (self._at + 1) % len(self.urls)
                log.warning("rankwatch: collector at %s unreachable; sending to %s", url, self.urls[self._at])
            return self.urls[self._at]


def reachable(endpoint: str, timeout_s: float = 0.5) -> bool:
    """Whether something accepts TCP connections at the endpoint: a refused connection is
    known in microseconds, where an HTTP client would retry it for seconds."""
    url = urlsplit(endpoint)
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout_s).close()
        return True
    except OSError:
        return False
