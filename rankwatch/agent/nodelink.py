"""A rank's link to its node's sidecar (`rankwatch node`, rankwatch/agent/node.py), and the wire between them.

A rank that has a sidecar does not encode or export anything: it sends each finished step's marks
(rankwatch/agent/stepspans.py: plain tuples of wall-clock ns) as a frame on a Unix socket at once, where the
socket takes it without waiting, so that what the rank finished is the sidecar's whatever becomes of
the rank; its events and device samples, and a step the socket could not take, are queued, and a
thread of the link hands them over every SPANS_DELAY_MS. A frame is `marshal` of plain values
(microseconds for a step; OTLP protobuf would cost the rank ~25 µs a span). The sidecar makes
the spans, encodes and exports them, and keeps the backlog through a collector's outage, so what a
rank recorded outlives the rank. Where the sidecar goes away mid-job, the rank says so once and
exports on its own (rankwatch/agent/export.py) from then on, from the frame that could not be written.
The other way, the sidecar sends a rank stacks requests (rankwatch/agent/nodecontrol.py): the link's thread
reads them without waiting each time it wakes, and answers each with the rank's `rank_stacks` event
(rankwatch/agent/stacks.py), read on that thread while the training thread is wherever it is.

As it links, a rank may hand the sidecar what it would read for the node (`hand_over`, a READS frame): its
GPU, by NVML UUID, and, local rank 0, the host's own readers; the sidecar answers with what it reads for it
from then on (rankwatch/agent/nodesampler.py), and the rank reads the rest itself. Its CLOCK frames tell the
sidecar its time base (rankwatch/agent/clock.py) against the host's monotonic clock, which every process of
the host shares, so that what the sidecar samples lines up with the rank's spans.

A frame is a 4-byte little-endian length, then `marshal.dumps((kind, body))`. The socket lives in the
job's private (0700) directory and the sidecar takes frames from its own user alone (SO_PEERCRED): what
arrives is from the job's own processes, which `marshal` is fit for.
"""

import ctypes
import logging
import marshal
import os
import select
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from rankwatch.agent.config import NODE_ENV
from rankwatch.agent.export import SPANS_DELAY_MS, Exporter
from rankwatch.agent.lost import Lost
from rankwatch.agent.spanwire import Attributes
from rankwatch.agent.stacks import answer
from rankwatch.agent.stepspans import StepMarks

log = logging.getLogger("rankwatch.agent")

HELLO, STEPS, EVENT, SAMPLES, BYE = "hello", "steps", "event", "samples", "bye"
# rank -> sidecar: (GPU UUID or None, whether the host's readers too, clock) it hands over (None, False: none);
# sidecar -> rank: (GPU read, host's readers read, why the GPU is not: "" where it is), to a READS handing any
READS = "reads"
CLOCK = "clock"  # rank -> sidecar: its time base less the host's monotonic clock, ns, after each re-alignment
STACKS = "stacks"  # sidecar -> rank: a stacks request's id (rankwatch/agent/nodecontrol.py)
ANSWER_S = 5.0  # how long a rank waits for the sidecar to say what it reads for it (it opens the GPU meanwhile)
MAX_FRAME_BYTES = 64 << 20  # a frame is a quarter second of one rank's telemetry: far less
QUEUE_ITEMS = 8192  # steps, events and sample batches waiting for the link's thread
_LENGTH = struct.Struct("<I")


def frame(kind: str, body: Any) -> bytes:
    payload = marshal.dumps((kind, body))
    return _LENGTH.pack(len(payload)) + payload


def write_frame(sock: socket.socket, kind: str, body: Any) -> None:
    sock.sendall(frame(kind, body))


def take_frames(buffer: bytearray) -> list[tuple[str, Any]]:
    """The whole frames at the start of `buffer`, taken out of it (a frame cut short stays, for the next bytes).
    ValueError for a frame past MAX_FRAME_BYTES; marshal's errors for one that is not a frame."""
    frames, at = [], 0
    while len(buffer) - at >= _LENGTH.size:
        (size,) = _LENGTH.unpack_from(buffer, at)
        if size > MAX_FRAME_BYTES:
            raise ValueError(f"a frame of {size} bytes (at most {MAX_FRAME_BYTES})")
        if len(buffer) - at - _LENGTH.size < size:
            break
        kind, body = marshal.loads(bytes(buffer[at + _LENGTH.size : at + _LENGTH.size + size]))
        frames.append((kind, body))
        at += _LENGTH.size + size
    del buffer[:at]
    return frames


def plain(marks: StepMarks) -> tuple:
    """The marks as the wire carries them: tuples, not named ones (marshal takes exact types alone)."""
    return (*marks[:3], marks.phases, tuple(map(tuple, marks.comms)), tuple(map(tuple, marks.moves)), *marks[6:])


PEER = struct.Struct("3i")  # SO_PEERCRED: pid, uid, gid
_PR_SET_PTRACER = 0x59616D61  # prctl's option: this process may be traced by the pid given (Yama)


def _let_trace(sock: socket.socket) -> None:
    """Allow the sidecar at the other end of `sock` to read this process from outside (py-spy, for a rank whose
    agent cannot answer: rankwatch/agent/pyspy.py). Where Yama's ptrace_scope is 1, the default of many
    distributions, only a process's ancestors may trace it, and the sidecar is the ranks' sibling. A no-op
    without Yama; never raises."""
    try:
        pid = PEER.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, PEER.size))[0]
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PTRACER, ctypes.c_ulong(pid), 0, 0, 0)
    except (OSError, AttributeError, struct.error):
        pass


class NodeLink:
    """What a rank's session exports through (the surface of rankwatch/agent/export.py's Exporter that a session
    uses), handed to the sidecar at `path`. `fallback()` makes the exporter the rank uses if the
    sidecar goes away."""

    def __init__(self, sock: socket.socket, fallback: Callable[[], Exporter]):
        self._sock, self._make_fallback = sock, fallback
        self._writing = threading.Lock()  # one writer of the socket at a time
        self._rest = b""  # what a step's send left unsent: the link's thread sends it before anything else
        self._fallback: Exporter | None = None
        self._queue: deque = deque()
        self._lost = Lost()  # what did not fit in the queue
        self._requests = bytearray()  # what the sidecar sent: stacks requests, the answer to a hand-over
        self._reading = threading.Lock()  # one reader of the socket at a time (the link's thread, a hand-over)
        self._taken: tuple | None = None  # the sidecar's answer to the hand-over
        self._take_back: Callable[[], object] | None = None  # called where the sidecar goes away after a hand-over
        self._wake = threading.Event()
        self._idle = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="rankwatch-node-link", daemon=True)
        self._thread.start()

    @classmethod
    def connect(cls, path: str, resource: Attributes, fallback: Callable[[], Exporter]) -> "NodeLink | None":
        """A link to the sidecar listening at `path`, or None (said once) where none answers there."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(path)
            write_frame(sock, HELLO, dict(resource))
        except OSError as e:
            sock.close()
            log.warning("rankwatch: no node sidecar at %s (%s): this rank exports its own telemetry", path, e)
            return None
        _let_trace(sock)
        return cls(sock, fallback)

    def hand_over(
        self, gpu_uuid: str | None, host_wide: bool, clock_ns: int, take_back: Callable[[], object]
    ) -> tuple[bool, bool]:
        """Ask the sidecar to read the rank's GPU (NVML UUID) and, `host_wide`, the host's own readers, for the
        rank; `clock_ns`: the rank's time base less the host's monotonic clock. (GPU read there, host's readers
        read there); what it does not read, the rank reads itself (the GPU: said once, with why). Called once,
        as the session starts: it waits up to ANSWER_S, and takes back what was handed where no answer came.
        `take_back()` is called where the sidecar goes away later (the rank then reads it all itself)."""
        self._take_back = take_back
        try:
            with self._writing:
                write_frame(self._sock, READS, (gpu_uuid, host_wide, clock_ns))
        except OSError:  # gone: the link's thread finds out, and the rank exports and reads on its own
            return False, False
        give_up = time.monotonic() + ANSWER_S
        while self._taken is None and (left := give_up - time.monotonic()) > 0:
            select.select([self._sock], [], [], left)
            if not self._answer():
                break
        if self._taken is None:
            log.warning(
                "rankwatch: the node sidecar did not say within %.0f s what it reads: this rank reads its own", ANSWER_S
            )
            self._put((READS, (None, False, clock_ns)))  # none of it, whatever comes later
            return False, False
        if self._fallback is not None:  # gone meanwhile: `take_back` was called, or is
            return False, False
        gpu, host, why = self._taken
        if gpu_uuid is not None and not gpu:
            log.warning("rankwatch: the node sidecar reads no GPU (%s): this rank samples its own", why)
        return gpu, host

    def clock(self, clock_ns: int) -> None:
        """The rank's time base less the host's monotonic clock, anew (after a re-alignment)."""
        self._put((CLOCK, clock_ns))

    # -- the session's side: queue, never wait ------------------------------------------------------------
    def _put(self, item: tuple) -> bool:
        if len(self._queue) >= QUEUE_ITEMS:
            kind, body = item
            if kind == STEPS:
                marks: StepMarks = body
                self._lost.rank_steps += 1
                self._lost.spans += 1 + len(marks.phases) + len(marks.comms) + len(marks.moves) + len(marks.host)
            elif kind == EVENT:
                self._lost.records += 1
            return False
        self._queue.append(item)
        return True

    def step(self, marks: StepMarks) -> None:
        """Handed over at once, where the socket takes it without waiting (a few microseconds): what a rank
        finished is then the sidecar's, whatever becomes of the rank; else queued for the link's thread."""
        if self._fallback is None and not self._queue and self._writing.acquire(blocking=False):
            try:
                if not self._rest:
                    data = frame(STEPS, [plain(marks)])
                    self._rest = data[self._sock.send(data, socket.MSG_DONTWAIT) :]
                    return
            except OSError:  # full (BlockingIOError), or gone: the link's thread finds out which
                pass
            finally:
                self._writing.release()
        self._put((STEPS, marks))

    def event(self, event: str, time_ns: int, attributes: Attributes, body: str | None = None, severity=None) -> None:
        self._put((EVENT, (event, time_ns, dict(attributes), body, None if severity is None else severity.value)))

    def samples(self, points: Iterable[tuple[str, int, float, Attributes]]) -> bool:
        return self._put((SAMPLES, [(name, t, value, dict(attrs)) for name, t, value, attrs in points]))

    # -- the link's thread --------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopping:
            self._wake.wait(SPANS_DELAY_MS / 1000)
            self._wake.clear()
            self._answer()
            self._send()

    def _answer(self) -> bool:
        """What the sidecar sent, read without waiting: its stacks requests, each answered with the rank's
        `rank_stacks` event (read here, on the link's thread, whatever the training thread is blocked in),
        queued; and its answer to the hand-over. False where the sidecar closed its end, or the link broke
        (the next send finds out)."""
        with self._reading:
            try:
                while chunk := self._sock.recv(1 << 16, socket.MSG_DONTWAIT):
                    self._requests += chunk
                linked = False  # b"": the sidecar closed its end
            except BlockingIOError:  # all read
                linked = True
            except OSError:
                return False
            try:
                requests = take_frames(self._requests)
            except (ValueError, EOFError, TypeError) as e:  # nothing the sidecar sends: none of it is read
                log.warning("rankwatch: the node sidecar sent what is no request (%s): ignored", e)
                self._requests.clear()
                return linked
        for kind, body in requests:
            if kind == STACKS:
                self.event(*answer(body))
            elif kind == READS:
                self._taken = tuple(body)
        return linked

    def _send(self) -> None:
        """Everything queued, in order: the steps gathered in one frame, then each event or sample batch. Where
        a frame cannot be written, it and those after it go through the rank's own exporter from then on (what
        the sidecar had taken but not yet exported when it died is lost with it)."""
        items = [self._queue.popleft() for _ in range(len(self._queue))]
        if self._fallback is None:
            steps = [body for kind, body in items if kind == STEPS]
            frames = ([(STEPS, steps)] if steps else []) + [item for item in items if item[0] != STEPS]
            items = []
            with self._writing:
                for i, (kind, body) in enumerate([(None, None), *frames]):
                    try:
                        if kind is None:  # first, what a step's send left: the socket took its frame in part
                            self._sock.sendall(self._rest)
                            self._rest = b""
                        else:
                            write_frame(self._sock, kind, [plain(m) for m in body] if kind == STEPS else body)
                    except OSError as e:
                        log.warning(
                            "rankwatch: the node sidecar went away (%s): this rank exports its own telemetry", e
                        )
                        self._fallback = self._make_fallback()
                        if self._take_back is not None:  # what the sidecar read for the rank, the rank reads now
                            self._take_back()
                        left = frames[max(i - 1, 0) :]
                        items = [(STEPS, m) for k, b in left if k == STEPS for m in b]
                        items += [item for item in left if item[0] != STEPS]
                        break
        if items:
            self._export(items)
        with self._idle:
            self._idle.notify_all()

    def _export(self, items: list) -> None:
        fallback = self._fallback
        assert fallback is not None
        for kind, body in items:
            if kind == STEPS:
                fallback.step(body)
            elif kind == EVENT:
                event, time_ns, attributes, text, severity = body
                fallback.event(event, time_ns, attributes, text, *([severity] if severity is not None else []))
            elif kind == SAMPLES:
                fallback.samples(body)

    def flush(self) -> bool:
        """Hand over everything queued now; True when it went (to the sidecar, or delivered by the fallback)."""
        self._wake.set()
        with self._idle:
            self._idle.wait_for(lambda: not self._queue, timeout=30)
        return self._fallback.flush() if self._fallback else not self._queue

    def finish(self, now_ns: int) -> tuple[Lost, int]:
        """The rank's end: everything handed over, the link closed (the sidecar delivers, and reports what
        it could not, with what the rank dropped); what is left for the rank itself to report, and the
        device samples its own exporter never delivered."""
        self.flush()
        self._stopping = True
        self._wake.set()
        self._thread.join(30)
        self._send()
        if self._fallback is None:
            try:  # the sidecar reports what the rank dropped with what it could not deliver itself
                write_frame(self._sock, BYE, (self._lost.spans, self._lost.rank_steps, self._lost.records))
                lost = Lost()
            except OSError:
                lost = self._lost
            self._sock.close()
            return lost, 0
        self._sock.close()
        lost, samples = self._fallback.finish(now_ns)
        return lost + self._lost, samples


def node_socket() -> str | None:
    """The sidecar's socket a launcher named ($RANKWATCH_NODE), if any."""
    return os.environ.get(NODE_ENV) or None
