"""A node's sidecar (`rankwatch node`): the telemetry of every rank on the host, exported by one process.

Ranks hand it their finished steps' marks, events and device samples through a Unix socket
(agent/nodelink.py). It makes the spans (agent/stepspans.py), encodes and exports them through one
Exporter that speaks for every rank (each trace, event and sample with its rank's resource, as the
fleet simulator's does), so the ranks' CPUs do none of that work, and it keeps the backlog through a
collector's outage: a rank that crashes loses nothing it had handed over. Started once per host by
`rankwatch run` and `rankwatch train` (or by a scheduler), it exports until told to stop (SIGTERM),
then delivers what waits, reports what it could not, and notes it per rank where the launcher asked
($RANKWATCH_UNDELIVERED).
"""

import json
import logging
import os
import socket
import struct
import threading
import time
from pathlib import Path
from typing import Any

from opentelemetry._logs import SeverityNumber
from opentelemetry.sdk.resources import Resource

from agent import semconv as sc
from agent.export import Exporter, Lost
from agent.nodelink import BYE, EVENT, HELLO, SAMPLES, STEPS, read_frame
from agent.stepspans import Comm, Move, StepMarks

log = logging.getLogger("rankwatch.agent")
_PEER = struct.Struct("3i")  # SO_PEERCRED: pid, uid, gid


def _marks(t: tuple) -> StepMarks:
    step, start, end, phases, comms, moves, *rest = t
    return StepMarks(step, start, end, phases, tuple(map(Comm._make, comms)), tuple(map(Move._make, moves)), *rest)


class Node:
    """Listens at `path` (made owner-only) and exports what the host's ranks hand over to `collector`."""

    def __init__(self, path: str, collector: str, token: str | None):
        self.exporter = Exporter(collector, token, {sc.HOST_NAME: socket.gethostname()})
        self.ranks: dict[int, Resource] = {}  # by connection
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            self._listener.bind(path)
        finally:
            os.umask(old)
        self._listener.listen(256)
        self._threads: list[threading.Thread] = []
        self._stopping = False
        threading.Thread(target=self._accept, name="rankwatch-node-accept", daemon=True).start()

    def _accept(self) -> None:
        while not self._stopping:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            _, uid, _ = _PEER.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEER.size))
            if uid != os.getuid():  # (the socket's mode lets no one else connect; this says so in code)
                conn.close()
                continue
            thread = threading.Thread(target=self._serve, args=(conn,), name="rankwatch-node-rank", daemon=True)
            self._threads.append(thread)
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        """One rank's frames until it closes its link (or dies)."""
        resource: Resource | None = None
        exporter = self.exporter
        with conn, conn.makefile("rb") as stream:
            while (frame := self._read(stream)) is not None:
                kind, body = frame
                if kind == HELLO:
                    resource = Resource.create(dict(body))
                    self.ranks[id(conn)] = resource
                elif resource is None:
                    log.warning("rankwatch node: a rank sent %r before saying who it is: closed", kind)
                    return
                elif kind == STEPS:
                    for marks in body:
                        exporter.step(_marks(marks), resource)
                elif kind == EVENT:
                    event, time_ns, attributes, text, severity = body
                    exporter.event(event, time_ns, attributes, text, SeverityNumber(severity or 9), resource=resource)
                elif kind == SAMPLES:
                    exporter.samples(body, resource)
                elif kind == BYE:
                    exporter.losses.add(resource, Lost(*body))

    @staticmethod
    def _read(stream) -> tuple[str, Any] | None:
        try:
            return read_frame(stream)
        except (OSError, ValueError, EOFError, TypeError) as e:
            log.warning("rankwatch node: a rank's link broke (%s)", e)
            return None

    def stop(self, notes: str | None = None, patience_s: float = 30.0) -> Lost:
        """Stop taking frames once the ranks' links are done (within `patience_s`), deliver what waits
        (trying until `patience_s` for a collector that is away), and report and note what was not."""
        give_up = time.monotonic() + patience_s
        for thread in self._threads:
            thread.join(max(give_up - time.monotonic(), 0.1))
        self._stopping = True
        self._listener.close()
        while not self.exporter.flush() and time.monotonic() < give_up:
            time.sleep(1.0)
        lost, _ = self.exporter.finish(time.time_ns())
        if notes:
            for resource, counts in self.exporter.losses.by_resource():
                if counts:
                    rank = resource.attributes.get(sc.RANK, "node")
                    Path(notes, f"node-rank-{rank}-{os.getpid()}").write_text(json.dumps(vars(counts)))
        return lost
