"""A batch that could not be sent waits, bounded, and goes out first once the collector is back: the
SDK's exporters drop a batch whose export failed."""

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

from rankwatch.agent.route import Route
from rankwatch.agent.senders import RETRY_LATER, Sent


class Backlog:
    """Wraps an exporter: batches that could not be sent wait (up to `max_items`, the oldest
    dropped beyond) and go out first, in order, when the collector is back. While it is away it
    is tried at most every `retry_s` (or after the Retry-After it answered), and only once it
    accepts connections again, so neither exports nor the end of a job wait out retries.
    `paced` (the fleet simulator): a collector that answers but cannot take the batch now (503,
    a timeout) is waited for, the batch tried again until it is taken or `patience_s` passes, so
    the queues before it fill and their producer waits rather than anything being dropped, unless
    `token_refused()` says the collector refused the token (then the batch is refused at once).
    Dropped batches go to `on_drop`, refused items to `on_refused`."""

    def __init__(
        self,
        exporter,
        max_items: int,
        route: Route,
        on_drop: Callable[[list], None],
        on_refused: Callable[[list, int], None],
        on_first_failure=None,
        retry_s: float = 5.0,
        paced: bool = False,
        patience_s: float = 120.0,
        token_refused: Callable[[], object] = lambda: None,
    ):
        self._exporter = exporter
        self._route = route
        self._max_items = max_items
        self._on_drop, self._on_refused = on_drop, on_refused
        self._on_first_failure = on_first_failure
        self._retry_s = retry_s
        self._paced, self._patience_s, self._token_refused = paced, patience_s, token_refused
        self._batches: deque[list] = deque()
        self._items = 0  # waiting
        self._late = 0  # waiting after a failed try (the oldest `_late` items)
        self._next_try = 0.0
        self._closed = False
        self._lock = threading.Lock()
        self.dropped = 0
        self.delivered_late = 0

    @property
    def waiting(self) -> int:
        """Items not yet delivered."""
        return self._items

    def items(self) -> list:
        """The items waiting, oldest first."""
        with self._lock:
            return [item for batch in self._batches for item in batch]

    def export(self, batch: Sequence) -> None:
        with self._lock:
            if batch:
                self._batches.append(list(batch))
                self._items += len(batch)
            if time.monotonic() >= self._next_try and not self._closed:
                self._send_waiting()
            while self._items > self._max_items and len(self._batches) > 1:
                self._drop(self._batches.popleft())

    def _drop(self, batch: list) -> None:
        self._items -= len(batch)
        self._late = max(self._late - len(batch), 0)
        self.dropped += len(batch)
        self._on_drop(batch)

    def _try(self, batch: list) -> Sent:
        """One export, or with `paced` as many as a collector that answers needs to take it."""
        give_up = time.monotonic() + self._patience_s
        while True:
            endpoint = self._route.reachable()  # (the next collector of several, when this one is gone)
            sent = self._exporter.export(batch, endpoint) if endpoint else RETRY_LATER
            if sent.answered or not self._paced or self._closed or time.monotonic() > give_up:
                return sent
            if self._token_refused():  # a refused token is no busy collector: no wait mends it
                return Sent(True, len(batch))
            if sent.retry_after_s is None and self._route.reachable() is None:
                return sent  # gone, not busy: the batch waits in the backlog
            time.sleep(min(sent.retry_after_s or 1.0, 5.0))

    def _send_waiting(self) -> None:
        while self._batches:
            sent = self._try(self._batches[0])
            if not sent.answered:
                self._late = self._items
                self._next_try = time.monotonic() + max(sent.retry_after_s or 0.0, self._retry_s)
                if self._on_first_failure:
                    self._on_first_failure()
                    self._on_first_failure = None
                return
            batch = self._batches.popleft()
            self._items -= len(batch)
            late = min(len(batch), self._late)
            self._late -= late
            self.delivered_late += late
            if sent.refused:
                self._on_refused(batch, min(sent.refused, len(batch)))

    def deliver(self) -> None:
        """Try now, whenever the last try was: a collector that is back gets what waits."""
        with self._lock:
            self._send_waiting()

    def close(self) -> None:
        """Stop sending: an export still retrying or a paced wait gives up now, later batches only wait."""
        self._closed = True
        self._exporter.shutdown()  # aborts the retry loop of an export in flight

    def shutdown(self) -> None:
        """After the last export: what waits now is dropped."""
        with self._lock:
            while self._batches:
                self._drop(self._batches.popleft())
