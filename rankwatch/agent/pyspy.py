"""A rank's stacks read from outside its process with py-spy, for a rank that does not answer a stacks request
itself (rankwatch/agent/nodecontrol.py): one stuck in a C call that holds the GIL (a C extension's deadlock, a
regex that never ends, a kernel launch wrapper spinning), where no thread of its agent runs again.

`py-spy dump --pid PID --json --native` stops the process's threads for the read (ptrace's seize and interrupt:
a py-spy killed at its timeout leaves them running), reads its Python threads' stacks from its memory with the
native (C, C++) frames between them, libpython's, torch's, libgloo's or libnccl's, and lets it go on. The answer
is the body of a `rank_stacks` event (docs/telemetry.md) within rankwatch/agent/stacks.py's bounds, marked
`read_by: "py-spy"`; its Flight Recorder is not read (torch dumps it from inside the process). Reading a torch
rank with its native frames took 0.4 to 0.5 s and ~100 MB of py-spy's memory (CPU, 2 cores, shared).

It needs ptrace of the rank: a process of the sidecar's own user, where Yama's ptrace_scope is 0 (at 1, many
distributions' default, only a process's ancestors may, and the sidecar is its ranks' sibling) or where the
sidecar has CAP_SYS_PTRACE. Where py-spy is missing or refused, `read` says why (`Unread.lasting`).
"""

import json
import os
import re
import shutil
import subprocess
import sysconfig
import time
import tokenize
from collections.abc import Sequence
from dataclasses import dataclass

from rankwatch.agent.stacks import bounded_frame, bounded_stack, bounded_threads, fit

READ_BY = "py-spy"  # an answer's `read_by`: who read it from outside the rank's process
# A read takes under a second (above); on a host loaded by its ranks, several at once, far longer may pass: 20 s,
# and the answer still comes well within the request's 60 s (collector/control/commands.py's STACKS_TTL_S)
TIMEOUT_S = 20.0
NO_FLIGHT_RECORDER = "read from outside the process (py-spy): torch's Flight Recorder is dumped from inside it"
# What py-spy says where ptrace of the process is refused (its own words; the kernel's for EPERM and EACCES)
_REFUSED = re.compile(r"permission denied|operation not permitted|elevated permissions", re.IGNORECASE)


@dataclass(frozen=True)
class Unread:
    """Why a process's stacks were not read; `lasting`: the same for every process of the node (py-spy missing,
    ptrace refused), said once."""

    why: str
    lasting: bool = False


def read(pids: Sequence[int], timeout_s: float = TIMEOUT_S) -> dict[int, dict | Unread]:
    """Each process's stacks as the body of its `rank_stacks` answer (stacks.answer), read at once (a py-spy each)
    within `timeout_s`; or why not."""
    command = shutil.which("py-spy", path=os.pathsep.join([sysconfig.get_path("scripts"), os.environ.get("PATH", "")]))
    if command is None:
        return dict.fromkeys(
            pids, Unread("py-spy is not installed (it comes with rankwatch: pip install py-spy)", True)
        )
    started = {pid: _start(command, pid) for pid in pids}
    give_up = time.monotonic() + timeout_s
    return {pid: _finish(pid, dump, give_up, timeout_s) for pid, dump in started.items()}


def _start(command: str, pid: int) -> subprocess.Popen | Unread:
    try:
        return subprocess.Popen(
            [command, "dump", "--pid", str(pid), "--json", "--native"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={**os.environ, "RUST_BACKTRACE": "0"},  # its error alone, not its own stack
        )
    except OSError as e:
        return Unread(f"py-spy could not be started ({e})", True)


def _finish(pid: int, dump: subprocess.Popen | Unread, give_up: float, timeout_s: float) -> dict | Unread:
    if isinstance(dump, Unread):
        return dump
    try:
        out, err = dump.communicate(timeout=max(give_up - time.monotonic(), 0.0))
    except subprocess.TimeoutExpired:
        dump.kill()
        dump.communicate()
        return Unread(f"py-spy did not read process {pid} within {timeout_s:g} s")
    if dump.returncode != 0:
        said = " ".join(err.decode(errors="replace").split())[:300]
        why = f"py-spy could not read process {pid} (exit status {dump.returncode}): {said}"
        return Unread(why, _REFUSED.search(said) is not None)
    try:
        return from_dump(pid, json.loads(out))
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        return Unread(f"py-spy's dump of process {pid} is not as expected ({type(e).__name__}: {e})")


def from_dump(pid: int, dumped: list[dict]) -> dict:
    """py-spy's JSON dump of process `pid` as the body of its answer: its Python threads (the agent's left out),
    the main one first, each with its frames outermost first, native ones marked `native`, and the thread that
    holds the GIL `owns_gil`; within rankwatch/agent/stacks.py's bounds."""
    by_ident = {thread["thread_id"]: thread for thread in dumped}
    sources: dict[str, list[str]] = {}

    def stack(ident: int) -> dict:
        thread = by_ident[ident]
        frames = bounded_stack(thread["frames"], lambda frame: _frame(frame, sources))  # py-spy's: innermost first
        return frames | ({"owns_gil": True} if thread.get("owns_gil") else {})

    threads, left_out = bounded_threads(
        (
            (t.get("thread_name") or f"thread {t['thread_id']}", t["thread_id"], t["os_thread_id"] == pid)
            for t in dumped
        ),
        stack,
    )
    body = {"threads": threads, "flight_recorder": None, "flight_recorder_reason": NO_FLIGHT_RECORDER}
    return fit(body | {"read_by": READ_BY} | ({"threads_left_out": left_out} if left_out else {}))


def _frame(frame: dict, sources: dict[str, list[str]]) -> dict:
    """A frame of py-spy's as an answer holds it. A native frame (py-spy names its shared object, `module`) has
    its function's symbol (an address where none is known), its line where debug information gives one, no code;
    a Python frame its source line, read from its file here, as the rank's agent reads it from there."""
    file, line, function = frame["filename"], frame.get("line") or None, frame["name"]
    if frame.get("module") is not None:
        return bounded_frame(file, line, function, None, native=True)
    return bounded_frame(file, line, function, _code(file, line, sources))


def _code(file: str, line: int | None, sources: dict[str, list[str]]) -> str | None:
    """The line of a Python source file, None where it cannot be read (a file read once an answer)."""
    if file not in sources:
        try:
            with tokenize.open(file) as text:
                sources[file] = text.readlines()
        except (OSError, SyntaxError, UnicodeDecodeError):
            sources[file] = []
    lines = sources[file]
    return lines[line - 1].strip() if line is not None and 0 < line <= len(lines) else None
