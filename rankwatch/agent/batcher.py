"""A bounded queue emptied in batches by a thread of its own: what the SDK's batch processors do, but
what does not fit is handed back (and counted) instead of dropped in silence."""

import threading
from collections import deque
from collections.abc import Callable


class Batcher:
    """A bounded queue that a thread of its own empties in batches into `sink`, the SDK batch
    processor's job but for what it drops: an item that does not fit goes to `on_drop` (counted),
    or with `block` the caller waits for room (the fleet simulator, which paces itself to the
    collector); what still waits when it stops goes to `on_drop` too. `after` runs on that thread
    after each round (the loss reports). The caller's side is a length check and an append."""

    def __init__(
        self,
        sink: Callable[[list], object],
        on_drop: Callable[[list], None],
        max_items: int,
        batch_items: int,
        delay_s: float,
        name: str,
        block: bool = False,
        after: Callable[[], None] = lambda: None,
    ):
        self._sink, self._on_drop, self._after = sink, on_drop, after
        self._max_items, self._batch_items, self._delay_s, self._block = max_items, batch_items, delay_s, block
        self._queue: deque = deque()
        self._wake = threading.Event()
        self._room = threading.Condition()
        self._exporting = threading.Lock()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, item) -> None:
        if len(self._queue) >= self._max_items:
            if not self._block or self._stopping:
                self._on_drop([item])
                return
            self._wake.set()
            with self._room:
                self._room.wait_for(lambda: len(self._queue) < self._max_items or self._stopping)
        self._queue.append(item)
        if len(self._queue) >= self._batch_items:
            self._wake.set()

    def _run(self) -> None:
        while not self._stopping:
            self._wake.wait(self._delay_s)
            self._wake.clear()
            self.flush()
            self._after()

    def flush(self) -> None:
        """Hand everything queued to the sink, now, on the caller's thread."""
        with self._exporting:
            while self._queue:
                batch = [self._queue.popleft() for _ in range(min(self._batch_items, len(self._queue)))]
                with self._room:
                    self._room.notify_all()
                self._sink(batch)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop the thread after its round; what still waits then is dropped."""
        self._stopping = True
        self._wake.set()
        with self._room:
            self._room.notify_all()
        self._thread.join(timeout_s)
        left = [self._queue.popleft() for _ in range(len(self._queue))]
        if left:
            self._on_drop(left)
