"""Where this rank is, when the collector asks (a `stacks` command, made when a hang is found or by
`rankwatch stacks`): every Python thread's stack but the agent's own, and torch's Flight Recorder entries.

Read from a thread of the agent (the node link's, or the rank's own stacks poll: rankwatch/agent/nodecontrol.py),
never the training thread: a training thread blocked in a collective or in its data loader has given up the
GIL, so its frames can be read while it waits. Nothing here runs per step. A capture reads the threads in
about 50 µs a thread 30 frames deep, and torch's dump of its Flight Recorder takes ~3 ms for 256 entries and
30 to 100 ms for the 2,000 torch keeps, holding the GIL (CPU, 2 cores, shared). The answer is one `rank_stacks`
event (docs/telemetry.md) whose body is bounded (BODY_BYTES): a thread's frames, the threads and the entries
are cut to their bounds, and the capture never raises.
"""

import json
import linecache
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

from rankwatch.agent import semconv as sc

KIND = "stacks"  # the command kind of a stacks request (collector/control/commands.py)
AGENT_THREADS = "rankwatch-"  # the start of the name of every thread the agent starts: not the job's own
MAX_THREADS = 32  # threads of an answer at most (the main thread first)
MAX_FRAMES = 64  # frames of a thread at most: the innermost, where it is
MAX_CODE = 200  # characters of a frame's source line
MAX_NAME = 500  # characters of a frame's file or function name
MAX_ENTRIES = 256  # the newest Flight Recorder entries at most
BODY_BYTES = 256 * 2**10  # the answer's body at most, UTF-8: entries dropped oldest first, then threads
SLACK_BYTES = 64  # what a body cut to its bound says of what it left out
# Dumps of torch's Flight Recorders: NCCL's (a CUDA build's, FlightRecorder<CUDAEvent>) and the one of every other
# backend, gloo's among them (FlightRecorder<c10::Event>); a job on NCCL reads NCCL's first
_NCCL_DUMP, _DUMP = "_dump_nccl_trace_json", "_dump_fr_trace_json"
T = TypeVar("T")


def capture() -> dict:
    """This process's threads (`threads`: the main thread first, each with its frames outermost first) and its
    Flight Recorder entries (`flight_recorder`, None with `flight_recorder_reason` saying why), within the
    bounds; `threads_left_out` and a thread's `frames_left_out` count what the bounds cut, where any."""
    threads, left_out = _threads()
    recorded, reason = flight_recorder()
    answer: dict[str, Any] = {"threads": threads, "flight_recorder": recorded}
    if reason is not None:
        answer["flight_recorder_reason"] = reason
    if left_out:
        answer["threads_left_out"] = left_out
    return fit(answer)


def answer(request_id: int, captured: dict | None = None) -> tuple[str, int, dict, str]:
    """The rank's answer to stacks request `request_id` as an event: its name, time, attributes and body (what is
    `captured` from outside the rank, rankwatch/agent/pyspy.py; else this process's capture, read now)."""
    return (
        sc.EVENT_RANK_STACKS,
        time.time_ns(),
        {sc.STACKS_REQUEST: request_id},
        body(capture() if captured is None else captured),
    )


def body(captured: object) -> str:
    return json.dumps(captured, ensure_ascii=False, separators=(",", ":"), default=str)


def asks(command: dict, rank: int) -> bool:
    """Whether stacks command `command` asks `rank` (its args' `ranks`, or every rank where it names none)."""
    ranks = (command.get("args") or {}).get("ranks")
    return ranks is None or (isinstance(ranks, list) and rank in ranks)


def _threads() -> tuple[list[dict], int]:
    """Every thread's stack but the agent's, within the bounds; how many the bound left out."""
    names = {t.ident: t.name for t in threading.enumerate()}
    main = threading.main_thread().ident
    frames = sys._current_frames()
    try:
        return bounded_threads(
            ((names.get(i, f"thread {i}"), i, i == main) for i in frames), lambda i: _stack(frames[i])
        )
    finally:
        frames.clear()  # frames hold their locals: none kept past the capture


def bounded_threads(threads: Iterable[tuple[str, int, bool]], stack: Callable[[int], dict]) -> tuple[list[dict], int]:
    """Threads (name, ident, whether the main one) as an answer holds them, the agent's left out: the main thread
    first, then by name, MAX_THREADS at most, each with `stack(ident)` (its frames: bounded_stack); how many the
    bound left out. (Also for a rank's stacks read from outside it: rankwatch/agent/pyspy.py.)"""
    kept = sorted((t for t in threads if not t[0].startswith(AGENT_THREADS)), key=lambda t: (not t[2], t[0], t[1]))
    answered = [
        {"name": name, "ident": ident, "main": main, **stack(ident)} for name, ident, main in kept[:MAX_THREADS]
    ]
    return answered, len(kept) - len(answered)


def bounded_stack(frames: Iterable[T], entry: Callable[[T], dict]) -> dict:
    """A thread's frames, given innermost first, as an answer holds them: outermost first, its innermost
    MAX_FRAMES at most (`entry` makes each of those: bounded_frame), and how many deeper ones the bound cut."""
    stack: list[dict] = []
    deeper = 0
    for frame in frames:
        if len(stack) < MAX_FRAMES:
            stack.append(entry(frame))
        else:
            deeper += 1
    stack.reverse()
    return {"frames": stack, **({"frames_left_out": deeper} if deeper else {})}


def bounded_frame(file: str, line: int | None, function: str, code: str | None, **marks: object) -> dict:
    """A frame as an answer holds it: its file's and function's names and its source line cut to their bounds."""
    return {
        "file": file[-MAX_NAME:],
        "line": line,
        "function": function[:MAX_NAME],
        "code": (code or "")[:MAX_CODE] or None,
        **marks,
    }


def _stack(frame) -> dict:
    return bounded_stack(_outwards(frame), _frame)


def _outwards(frame) -> Iterator:
    while frame is not None:
        yield frame
        frame = frame.f_back


def _frame(frame) -> dict:
    code, line = frame.f_code, frame.f_lineno
    return bounded_frame(
        code.co_filename, line, code.co_name, linecache.getline(code.co_filename, line).strip() if line else None
    )


def flight_recorder(max_entries: int = MAX_ENTRIES) -> tuple[dict | None, str | None]:
    """torch's Flight Recorder of this process as its own JSON dump gives it, the newest `max_entries` entries;
    else None and why. Never imports torch, never raises."""
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        return None, "torch.distributed is not imported"
    try:
        if not dist.is_available() or not dist.is_initialized():
            return None, "torch.distributed is not initialized"
        backend = str(dist.get_backend())
        import torch._C._distributed_c10d as c10d

        dumps = [d for d in ((_NCCL_DUMP,) if "nccl" in backend else ()) + (_DUMP,) if hasattr(c10d, d)]
        if not dumps:
            return None, "this torch build has no Flight Recorder dump"
        dumped: dict = {}
        for name in dumps:
            dumped = json.loads(getattr(c10d, name)(True, False))  # includeCollectives, onlyActive
            if dumped.get("entries"):
                break
        if "entries" not in dumped:
            return None, "the Flight Recorder records nothing (TORCH_FR_BUFFER_SIZE=0)"
        return {
            "backend": backend,
            "version": dumped.get("version"),
            "pg_config": dumped.get("pg_config") or {},
            "pg_status": dumped.get("pg_status") or {},
            "entries": dumped["entries"][-max_entries:] if max_entries else [],
        }, None
    except Exception as e:  # a capture answers whatever torch does
        return None, f"the Flight Recorder's dump failed: {type(e).__name__}: {str(e)[:200]}"


def _size(value: object) -> int:
    return len(body(value).encode())


def fit(answer: dict, limit: int = BODY_BYTES) -> dict:
    """`answer` within `limit` bytes of body: the oldest Flight Recorder entries dropped first, then the threads
    after the main one, last first (a thread is at most MAX_FRAMES frames of bounded text: the main one fits).
    Each item dropped takes its bytes and a comma; SLACK_BYTES pays for the count of those left out."""
    recorded = answer["flight_recorder"]
    over = _size(answer) - limit
    if over > 0 and recorded is not None:
        dropped = _enough(recorded["entries"], over + SLACK_BYTES)
        recorded["entries"], recorded["entries_left_out"] = recorded["entries"][dropped:], dropped
        over = _size(answer) - limit
    threads = answer["threads"]
    if over > 0 and (dropped := _enough(threads[:0:-1], over + SLACK_BYTES)):
        del threads[len(threads) - dropped :]
        answer["threads_left_out"] = answer.get("threads_left_out", 0) + dropped
    return answer


def _enough(items: list, nbytes: int) -> int:
    """How many of `items`, from the first, make up `nbytes` of body (all of them where they do not)."""
    total = 0
    for count, item in enumerate(items, 1):
        total += _size(item) + 1
        if total >= nbytes:
            return count
    return len(items)
