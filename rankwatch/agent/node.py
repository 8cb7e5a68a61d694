"""A node's sidecar (`rankwatch node`): the telemetry of every rank on the host, exported by one process.

Ranks hand it their finished steps' marks, events and device samples through a Unix socket
(rankwatch/agent/nodelink.py). It makes the spans (rankwatch/agent/stepspans.py), encodes and exports them through one
Exporter that speaks for every rank (each trace, event and sample with its rank's resource, as the
fleet simulator's does), so the ranks' CPUs do none of that work, and it keeps the backlog through a
collector's outage: a rank that crashes loses nothing it had handed over. Started once per host by
`rankwatch run` and `rankwatch train` (or by a scheduler), it exports until told to stop (SIGTERM),
then delivers what waits, reports what it could not, and notes it per rank where the launcher asked
($RANKWATCH_UNDELIVERED). It also takes its ranks' runs' stacks requests from the control API and asks
its ranks (rankwatch/agent/nodecontrol.py), whose answers come back as their events (a rank that does not answer
is read from outside, rankwatch/agent/pyspy.py); and it samples the GPUs
its ranks hand over and the host's own readers, once per node, giving each rank's steps their GPU's energy
(rankwatch/agent/nodesampler.py).
"""

import json
import logging
import os
import queue
import socket
import threading
import time
from pathlib import Path
from typing import Any

from opentelemetry._logs import SeverityNumber
from opentelemetry.sdk.resources import Resource

from rankwatch.agent import semconv as sc
from rankwatch.agent.export import Exporter
from rankwatch.agent.lost import Lost
from rankwatch.agent.nodecontrol import NodeControl
from rankwatch.agent.nodelink import BYE, CLOCK, EVENT, HELLO, PEER, READS, SAMPLES, STEPS, frame, take_frames
from rankwatch.agent.nodesampler import Feed, NodeSampler
from rankwatch.agent.spanwire import AttributeValue
from rankwatch.agent.stepspans import Comm, Move, StepMarks

log = logging.getLogger("rankwatch.agent")
MEMORY_EVENTS_ENV = "RANKWATCH_MEMORY_EVENTS"  # where the OOM killer's count is read, where not the cgroup's own
READ_EVERY_S = 0.05  # how often a rank's link is read at most: what it sent waits in the socket, safe from its death
SETTLE_S = 1.0  # how long a rank gone without a word waits for its peers' ends to be known, to tell whose was first
SAMPLE_BATCHES = 1024  # device sample batches waiting for export (a batch a second from each rank)


def _memory_events() -> Path:
    """Where the OOM killer's kills in this process's memory cgroup are counted (an `oom_kill` line): cgroup
    v2's `memory.events`, v1's `memory.oom_control`; the first that exists, of the process's cgroup path or
    of the mount's root (a container's own cgroup); or the file $RANKWATCH_MEMORY_EVENTS names."""
    if given := os.environ.get(MEMORY_EVENTS_ENV):
        return Path(given)
    groups = {}
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            groups["memory" if "memory" in controllers.split(",") else controllers or "v2"] = path.lstrip("/")
    except (OSError, ValueError):
        pass
    root = Path("/sys/fs/cgroup")
    candidates = [
        root / groups.get("v2", "") / "memory.events",
        root / "memory.events",
        root / "memory" / groups.get("memory", "") / "memory.oom_control",
        root / "memory" / "memory.oom_control",
    ]
    return next((p for p in candidates if p.is_file()), candidates[0])


def _marks(t: tuple) -> StepMarks:
    step, start, end, phases, comms, moves, *rest = t
    return StepMarks(step, start, end, phases, tuple(map(Comm._make, comms)), tuple(map(Move._make, moves)), *rest)


class Node:
    """Listens at `path` (made owner-only) and exports what the host's ranks hand over to `collector`."""

    def __init__(self, path: str, collector: str, token: str | None, memory_events: Path | None = None):
        self._memory_events = memory_events or _memory_events()
        self.exporter = Exporter(collector, token, {sc.HOST_NAME: socket.gethostname()})
        self.control = NodeControl(collector, token, self.exporter)  # the ranks' runs' stacks requests, asked of them
        self._failed: dict[object, list[tuple[int, object]]] = {}  # run id -> (when, rank) of its ranks' failures
        self._lock = threading.Lock()
        self._samples: queue.Queue = queue.Queue(SAMPLE_BATCHES)
        self.sampler = NodeSampler(self._hand_samples)  # NVML loaded before a rank can link and name its GPU
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            self._listener.bind(path)
        finally:
            os.umask(old)
        self._listener.listen(256)
        self._threads: list[threading.Thread] = []
        self._exporting_samples = threading.Thread(
            target=self._export_samples, name="rankwatch-node-samples", daemon=True
        )
        self._exporting_samples.start()
        self._stopping = False
        threading.Thread(target=self._accept, name="rankwatch-node-accept", daemon=True).start()

    def _accept(self) -> None:
        while not self._stopping:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            pid, uid, _ = PEER.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, PEER.size))
            if uid != os.getuid():  # (the socket's mode lets no one else connect; this says so in code)
                conn.close()
                continue
            thread = threading.Thread(target=self._serve, args=(conn, pid), name="rankwatch-node-rank", daemon=True)
            self._threads.append(thread)
            thread.start()

    def _serve(self, conn: socket.socket, pid: int) -> None:
        """One rank's frames until it closes its link (from process `pid`, whose stacks the sidecar reads where it
        does not answer a request for them); a rank gone without its goodbye (killed, crashed) and without telling
        its failure itself is told here, on its behalf."""
        resource: Resource | None = None
        exporter = self.exporter
        finished, step, told, oom_kills = None, None, False, self._oom_kills()  # step: the one it is in, last said
        buffer = bytearray()
        feed: Feed | None = None  # what the node samples for the rank
        with conn, self.control.linking(conn, pid) as link:
            try:
                while frames := self._read(conn, buffer):
                    for kind, body in frames:
                        if kind == HELLO:
                            resource = Resource.create(dict(body))
                            self.control.hello(link, resource)
                        elif resource is None:
                            log.warning("rankwatch node: a rank sent %r before saying who it is: closed", kind)
                            return
                        elif kind == READS:
                            feed = self._take(conn, resource, feed, *body)
                        elif kind == CLOCK and feed is not None:
                            feed.clock_ns = body
                        elif kind == STEPS:
                            for marks in body:
                                if feed is not None:
                                    self.sampler.step(feed, _marks(marks))
                                else:
                                    exporter.step(_marks(marks), resource)
                            last = max(marks[0] for marks in body)
                            finished = last if finished is None else max(finished, last)
                        elif kind == EVENT:
                            event, time_ns, attributes, text, severity = body
                            request = attributes.get(sc.STACKS_REQUEST)
                            if event == sc.EVENT_RANK_STACKS and not self.control.first_answer(link, request):
                                continue  # its stacks were read from outside it already: one answer a request
                            if event == sc.EVENT_RANK_FAILED:
                                told = True
                                if attributes.get(sc.FAILURE_CAUSE) != sc.CAUSE_TERMINATED:  # a failure of its own
                                    self._ended(resource, time_ns)
                            if isinstance(at := attributes.get(sc.STEP), int):
                                step = max(step or 0, at)
                            exporter.event(
                                event, time_ns, attributes, text, SeverityNumber(severity or 9), resource=resource
                            )
                        elif kind == SAMPLES:
                            self._hand_samples(body, resource)
                        elif kind == BYE:
                            exporter.losses.add(resource, Lost(*body))
                            return
                    # frames gather meanwhile: a rank's send wakes no one, and waits in the socket
                    time.sleep(READ_EVERY_S)
            finally:
                if feed is not None:  # its held steps out, before any word of its end
                    self.sampler.leave(feed)
        if resource is not None and not told:
            self._ended(resource, time.time_ns())
            time.sleep(SETTLE_S)  # the other ranks' frames and ends, from their links, come in meanwhile
            if finished is not None and (step is None or step <= finished):
                step = finished + 1  # (it finished one, so it was in the next)
            self._gone(resource, step, finished, oom_kills)

    def _take(
        self,
        conn: socket.socket,
        resource: Resource,
        feed: Feed | None,
        gpu_uuid: str | None,
        host_wide: bool,
        clock_ns: int,
    ) -> Feed | None:
        """A rank's hand-over (rankwatch/agent/nodelink.py's READS), answered where it handed anything: what the
        node samples for it from now on, in place of what it did (nothing, where it takes all back)."""
        if feed is not None:
            self.sampler.leave(feed)
        emit = lambda marks: self.exporter.step(marks, resource)  # noqa: E731
        feed, why = self.sampler.take(resource, gpu_uuid, host_wide, clock_ns, emit)
        if gpu_uuid is not None or host_wide:
            try:  # a few bytes, taken whole or not at all: the rank waits for them (and reads all back if none come)
                taken = (feed is not None and feed.gpu is not None, feed is not None and feed.host_wide, why)
                conn.send(frame(READS, taken), socket.MSG_DONTWAIT)
            except OSError as e:
                log.warning("rankwatch node: a rank's hand-over not answered (%s)", e)
        return feed

    def _hand_samples(self, points: list, resource: Resource) -> None:
        """Device samples to the export thread: a slow collector stalls no link, nor the node's sampling."""
        try:
            self._samples.put_nowait((points, resource))
        except queue.Full:
            self.exporter.samples_refused += len(points)

    def _ended(self, resource: Resource, time_ns: int) -> None:
        """A rank of the run failed of its own (not stopped with the job), or went silent, at `time_ns`."""
        with self._lock:
            self._failed.setdefault(resource.attributes.get(sc.RUN_ID), []).append(
                (time_ns, resource.attributes.get(sc.RANK))
            )

    def _gone(self, resource: Resource, step: int | None, finished: int | None, oom_kills: int | None) -> None:
        """A rank's `rank_failed` for it: stopped with its job where a rank of the run failed of its own, or went
        silent, before it on this node (torchrun ends the others' processes then); else killed, by the kernel's
        OOM killer where its count rose meanwhile. (A rank stopped with the job does not count: a collective
        raising as its peer's connection closed may be told before the peer's silence is seen.)"""
        run_id, pid = resource.attributes.get(sc.RUN_ID), resource.attributes.get(sc.PROCESS_PID)
        with self._lock:
            _, first = min(self._failed[run_id], key=lambda ended: ended[0])
        after = self._oom_kills()
        if first != resource.attributes.get(sc.RANK):
            cause, why = sc.CAUSE_TERMINATED, f"stopped with its job after rank {first} failed"
        elif oom_kills is not None and after is not None and after > oom_kills:
            cause, why = sc.CAUSE_KILLED_OUT_OF_MEMORY, "killed: the kernel's OOM killer killed in this job's cgroup"
        else:
            cause, why = sc.CAUSE_KILLED, "gone without a word (SIGKILL, a crash, or its node failing)"
        said = f"process {pid} {why}" + (f"; the last step it finished: {finished}" if finished is not None else "")
        attributes: dict[str, AttributeValue] = {
            sc.FAILURE_CAUSE: cause,
            **({sc.STEP: step} if step is not None else {}),
            **({sc.ATTEMPT: a} if isinstance(a := resource.attributes.get(sc.ATTEMPT), int) else {}),
        }
        self.exporter.event(sc.EVENT_RANK_FAILED, time.time_ns(), attributes, said, SeverityNumber.ERROR, resource)

    def _oom_kills(self) -> int | None:
        """The OOM killer's kills in this process's memory cgroup so far, where readable."""
        try:
            for line in self._memory_events.read_text().splitlines():
                name, _, count = line.partition(" ")
                if name == "oom_kill":
                    return int(count)
        except (OSError, ValueError):
            pass
        return None

    def _export_samples(self) -> None:
        while (item := self._samples.get()) is not None:
            points, resource = item
            self.exporter.samples(points, resource)

    @staticmethod
    def _read(conn: socket.socket, buffer: bytearray) -> list[tuple[str, Any]]:
        """The next whole frames from a rank's link (waiting for some), none at its end: closed, or broken."""
        try:
            while not (frames := take_frames(buffer)):
                if not (chunk := conn.recv(1 << 20)):
                    return []
                buffer += chunk
            return frames
        except (OSError, ValueError, EOFError, TypeError) as e:
            log.warning("rankwatch node: a rank's link broke (%s)", e)
            return []

    def stop(self, notes: str | None = None, patience_s: float = 30.0) -> Lost:
        """Stop taking frames once the ranks' links are done (within `patience_s`), deliver what waits
        (trying until `patience_s` for a collector that is away), and report and note what was not."""
        give_up = time.monotonic() + patience_s
        for thread in self._threads:
            thread.join(max(give_up - time.monotonic(), 0.1))
        self._stopping = True
        self._listener.close()
        self.control.close()
        self.sampler.stop()  # its last samples, and the steps it still held
        self._samples.put(None)
        self._exporting_samples.join(max(give_up - time.monotonic(), 0.1))
        while not self.exporter.flush() and time.monotonic() < give_up:
            time.sleep(1.0)
        lost, _ = self.exporter.finish(time.time_ns())
        if notes:
            for resource, counts in self.exporter.losses.by_resource():
                if counts:
                    rank = resource.attributes.get(sc.RANK, "node")
                    Path(notes, f"node-rank-{rank}-{os.getpid()}").write_text(json.dumps(vars(counts)))
        return lost
