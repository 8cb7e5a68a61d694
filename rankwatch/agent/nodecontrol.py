"""Who takes a run's stacks requests from the control API (rankwatch/agent/stacks.py has what a rank answers).

With a node sidecar (rankwatch/agent/node.py), the sidecar does: one held poll per run it has linked ranks
of, asking for `stacks` commands alone, and each request asked of the run's linked ranks it names, once, as
a frame on the rank's link (rankwatch/agent/nodelink.py); the rank's link thread answers with its
`rank_stacks` event, which the sidecar exports as any event of the rank's. The sidecar waits for no answer:
a rank that does not answer (its process stuck with the GIL held) is one the collector lists as unanswered.
Without a sidecar, a rank polls for its run's requests itself, on a daemon thread, and exports its answers.
"""

import logging
import socket
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager

from rankwatch.agent import semconv as sc
from rankwatch.agent.commands import Poll
from rankwatch.agent.export import Exporter
from rankwatch.agent.nodelink import STACKS, frame
from rankwatch.agent.stacks import KIND, answer, asks

log = logging.getLogger("rankwatch.agent")


class NodeControl:
    """The sidecar's stacks polls: one per run with a linked rank, made at its first rank's link and closed
    once its last rank's link is."""

    def __init__(self, collector: str, token: str | None):
        self._collector, self._token = collector, token
        self._lock = threading.Lock()
        self._links: dict[str, dict[int, socket.socket]] = {}  # run id -> rank -> its link
        self._polls: dict[str, Poll] = {}

    @contextmanager
    def linking(self, conn: socket.socket) -> Iterator[Callable[[Mapping], None]]:
        """For a rank's link `conn`: a function that takes the rank's resource once it says who it is (its
        run's poll starts then, where none runs); the rank is unlinked when the block ends."""
        linked: list[tuple[str, int]] = []

        def hello(resource: Mapping) -> None:
            run_id, rank = resource.get(sc.RUN_ID), resource.get(sc.RANK)
            if not isinstance(run_id, str) or not isinstance(rank, int):
                return
            with self._lock:
                self._links.setdefault(run_id, {})[rank] = conn
                if run_id not in self._polls:
                    self._polls[run_id] = Poll(
                        self._collector,
                        self._token,
                        run_id,
                        (KIND,),
                        lambda command: self._ask(run_id, command),
                        "rankwatch-node-control",
                        after_seen=True,
                    )
            linked.append((run_id, rank))

        try:
            yield hello
        finally:
            with self._lock:
                for run_id, rank in linked:
                    links = self._links.get(run_id, {})
                    if links.get(rank) is conn:
                        del links[rank]
                    if not links:
                        self._links.pop(run_id, None)
                        if (poll := self._polls.pop(run_id, None)) is not None:
                            poll.close()

    def _ask(self, run_id: str, command: dict) -> None:
        """Stacks request `command` sent to the run's linked ranks it asks, at once: a request frame is a few
        bytes, which a Unix socket takes whole or not at all (a rank whose link takes no more is not asked)."""
        with self._lock:
            links = [conn for rank, conn in self._links.get(run_id, {}).items() if asks(command, rank)]
        request = frame(STACKS, command["id"])
        unasked = 0
        for conn in links:
            try:
                conn.send(request, socket.MSG_DONTWAIT)
            except OSError:  # full (the rank reads no requests) or closed (the rank is going)
                unasked += 1
        if unasked:
            log.warning(
                "rankwatch node: %d ranks of run %s not asked for stacks request %s", unasked, run_id, command["id"]
            )

    def close(self) -> None:
        with self._lock:
            for poll in self._polls.values():
                poll.close()
            self._polls.clear()


def answering(exporter: Exporter, collector: str, token: str | None, run_id: str, rank: int) -> Poll:
    """A rank without a sidecar: its own held poll for its run's stacks requests, each asking it answered once
    (from the poll's thread) and exported through `exporter`. Close it at the rank's end."""

    def take(command: dict) -> None:
        if asks(command, rank):
            exporter.event(*answer(command["id"]))

    return Poll(collector, token, run_id, (KIND,), take, "rankwatch-stacks", after_seen=True)
