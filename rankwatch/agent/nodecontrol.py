"""Who takes a run's stacks requests from the control API (rankwatch/agent/stacks.py has what a rank answers).

With a node sidecar (rankwatch/agent/node.py), the sidecar does: one held poll per run it has linked ranks
of, asking for `stacks` commands alone, and each request asked of the run's linked ranks it names, once, as
a frame on the rank's link (rankwatch/agent/nodelink.py); the rank's link thread answers with its
`rank_stacks` event, which the sidecar exports as any event of the rank's. A rank that has not answered within
READ_OUTSIDE_AFTER_S is one whose process runs no Python (stuck in a C call that holds the GIL): the sidecar reads
its stacks from outside it (py-spy, on the pid its link's socket names: rankwatch/agent/pyspy.py), on a thread of
its own, and exports them as the rank's answer. A rank answers a request once: whichever answer comes second, the
rank's own late or the one read from outside, is dropped. Where py-spy cannot read (missing, ptrace refused), the
sidecar says why once and the rank stays unanswered, as the collector lists it.
Without a sidecar, a rank polls for its run's requests itself, on a daemon thread, and exports its answers (a
rank cannot read itself from outside).
"""

import logging
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from opentelemetry.sdk.resources import Resource

from rankwatch.agent import pyspy
from rankwatch.agent import semconv as sc
from rankwatch.agent.commands import Poll
from rankwatch.agent.export import Exporter
from rankwatch.agent.nodelink import STACKS, frame
from rankwatch.agent.stacks import KIND, answer, asks

log = logging.getLogger("rankwatch.agent")
# A rank's link thread answers at its next wake (SPANS_DELAY_MS, 0.25 s) after a capture of milliseconds (torch's
# Flight Recorder dump up to 0.1 s): one that has not in 3 s, on a loaded host too, runs no Python. Read from
# outside then, its answer still comes within seconds of the request, as those of the others do.
READ_OUTSIDE_AFTER_S = 3.0


@dataclass(eq=False)
class Link:
    """A rank's link as its stacks requests know it: its process (the pid its socket's peer credentials name),
    who it is once it says (its resource, run and rank), and the requests answered for it."""

    conn: socket.socket
    pid: int
    resource: Resource | None = None
    linked: tuple[str, int] | None = None  # (run id, rank)
    answered: set[int] = field(default_factory=set)
    closed: bool = False


class NodeControl:
    """The sidecar's stacks polls: one per run with a linked rank, made at its first rank's link and closed
    once its last rank's link is; and the reads from outside of the ranks that do not answer."""

    def __init__(self, collector: str, token: str | None, exporter: Exporter):
        """`exporter`: the sidecar's, through which the answers read from outside the ranks go, as theirs."""
        self._collector, self._token, self._exporter = collector, token, exporter
        self._lock = threading.Lock()
        self._links: dict[str, dict[int, Link]] = {}  # run id -> rank -> its link
        self._polls: dict[str, Poll] = {}
        self._reads: list[threading.Timer] = []  # each request's read from outside of the ranks that did not answer
        self._said_unreadable = False  # why ranks cannot be read from outside (py-spy missing, refused): said once
        self._closed = False

    @contextmanager
    def linking(self, conn: socket.socket, pid: int) -> Iterator[Link]:
        """A rank's link `conn`, from process `pid`, while the block runs: `hello` it once the rank says who it is,
        ask `first_answer` of each answer it sends; the rank is unlinked when the block ends."""
        link = Link(conn, pid)
        try:
            yield link
        finally:
            with self._lock:
                link.closed = True
                if link.linked is not None:
                    run_id, rank = link.linked
                    links = self._links.get(run_id, {})
                    if links.get(rank) is link:
                        del links[rank]
                    if not links:
                        self._links.pop(run_id, None)
                        if (poll := self._polls.pop(run_id, None)) is not None:
                            poll.close()

    def hello(self, link: Link, resource: Resource) -> None:
        """The rank of `link` says who it is: its run's poll starts, where none runs."""
        run_id, rank = resource.attributes.get(sc.RUN_ID), resource.attributes.get(sc.RANK)
        if not isinstance(run_id, str) or not isinstance(rank, int):
            return
        with self._lock:
            link.resource, link.linked = resource, (run_id, rank)
            self._links.setdefault(run_id, {})[rank] = link
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

    def first_answer(self, link: Link, request: object) -> bool:
        """Whether an answer to stacks request `request` for the rank of `link` is its first (to be exported): an
        answer the rank makes after its stacks were read from outside it is not, nor the other way round."""
        if not isinstance(request, int):
            return True  # (none names a request: nothing to answer once)
        with self._lock:
            first = request not in link.answered
            link.answered.add(request)
            return first

    def _ask(self, run_id: str, command: dict) -> None:
        """Stacks request `command` sent to the run's linked ranks it asks, at once: a request frame is a few
        bytes, which a Unix socket takes whole or not at all (a rank whose link takes no more is not asked, and
        read from outside it with those that do not answer)."""
        with self._lock:
            links = [link for rank, link in self._links.get(run_id, {}).items() if asks(command, rank)]
        request = frame(STACKS, command["id"])
        unasked = 0
        for link in links:
            try:
                link.conn.send(request, socket.MSG_DONTWAIT)
            except OSError:  # full (the rank reads no requests) or closed (the rank is going)
                unasked += 1
        if unasked:
            log.warning(
                "rankwatch node: %d ranks of run %s not asked for stacks request %s", unasked, run_id, command["id"]
            )
        if links:
            reading = threading.Timer(READ_OUTSIDE_AFTER_S, self._read_unanswered, (command["id"], links))
            reading.name, reading.daemon = "rankwatch-node-stacks", True
            with self._lock:
                if self._closed:
                    return
                self._reads = [r for r in self._reads if r.is_alive()] + [reading]
            reading.start()

    def _read_unanswered(self, request: int, links: list[Link]) -> None:
        """The stacks of the ranks of `links` that have not answered stacks request `request`, read from outside
        them (at once), each exported as the rank's answer unless the rank answered meanwhile."""
        with self._lock:
            waiting = [link for link in links if request not in link.answered and not link.closed]
        if not waiting:
            return
        read = pyspy.read([link.pid for link in waiting])
        for link in waiting:
            stacks = read[link.pid]
            if isinstance(stacks, pyspy.Unread):
                self._unread(link, request, stacks)
            elif not self._closed and self.first_answer(link, request):
                self._exporter.event(*answer(request, stacks), resource=link.resource)

    def _unread(self, link: Link, request: int, unread: pyspy.Unread) -> None:
        """Why a rank's stacks were not read from outside it: said once where it holds for every rank."""
        with self._lock:
            said, self._said_unreadable = self._said_unreadable, self._said_unreadable or unread.lasting
        if not unread.lasting:
            run_id, rank = link.linked or ("?", "?")
            log.warning(
                "rankwatch node: rank %s of run %s, not answering stacks request %s: %s",
                rank,
                run_id,
                request,
                unread.why,
            )
        elif not said:
            log.warning(
                "rankwatch node: the stacks of a rank that does not answer are not read from outside it: %s "
                "(not said again)",
                unread.why,
            )

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for poll in self._polls.values():
                poll.close()
            self._polls.clear()
            for reading in self._reads:
                reading.cancel()


def answering(exporter: Exporter, collector: str, token: str | None, run_id: str, rank: int) -> Poll:
    """A rank without a sidecar: its own held poll for its run's stacks requests, each asking it answered once
    (from the poll's thread) and exported through `exporter`. Close it at the rank's end."""

    def take(command: dict) -> None:
        if asks(command, rank):
            exporter.event(*answer(command["id"]))

    return Poll(collector, token, run_id, (KIND,), take, "rankwatch-stacks", after_seen=True)
