"""Commands from the collector (rollbacks, power caps), taken by every rank at the same step.

Rank 0 fetches the run's pending commands from the control API in a
background thread, so the training loop never waits on the network: a held
poll (`wait`), which the collector answers as soon as a command is queued,
or at the latest after WAIT_S with none. Every rank calls `at_step` at every
step boundary; at some of them, the looks, rank 0 hands out the oldest command
it has fetched, tells the collector it is taken (acked, with that step), and
the job's process group carries it to every rank, on a CPU (gloo) group so
the GPUs' streams are not touched. All ranks thus apply it at the same step.
Rank 0 asks for the kinds it carries out alone (JOB_KINDS): a stacks request is
answered by every rank, from threads of their own (rankwatch/agent/stacks.py),
through the same held poll (`Poll`).

A look is a broadcast, so looks are paced by time, not steps (`Looks`): rank 0
measures the step time and picks how many steps on the next look comes, about
LOOK_S of training away (every step when steps are that long), and carries
that count in the look's broadcast, so every rank knows it without another
collective.
"""

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from rankwatch.agent.apiclient import ApiClient, ApiError
from rankwatch.agent.route import Route

log = logging.getLogger("rankwatch.agent")
# Seconds of training between two looks at most (or one step, when steps are longer): a command
# waits at most this long for its look, and a fast job pays one small broadcast per LOOK_S.
LOOK_S = 0.25
MAX_STEPS_APART = 10_000  # steps between looks at most, however short the steps measured
# Seconds the collector holds a poll while it has no command (its bound: collector/control/api.py MAX_WAIT_S).
WAIT_S = 20.0
JOB_KINDS = ("rollback", "power_cap")  # the commands the job carries out at a step (a stacks request is not one)


def steps_apart(step_s: float, look_s: float = LOOK_S) -> int:
    """Steps from one look to the next at `step_s` a step: as many as fit in `look_s`, at least one,
    so looks are at most max(one step, look_s) apart and no more often than that needs."""
    if not step_s > 0:
        return MAX_STEPS_APART
    steps = math.floor(look_s / step_s)
    steps += ((steps + 1) * step_s <= look_s) - (steps * step_s > look_s)  # the quotient's rounding, undone
    return min(max(steps, 1), MAX_STEPS_APART)


class Looks:
    """Rank 0's pacing of the looks: the step time measured between two looks sets the next gap."""

    def __init__(self, look_s: float = LOOK_S):
        self._look_s = look_s
        self._last: float | None = None  # time.monotonic() at the last look
        self._gap = 1  # steps from the last look to this one

    def gap(self, now: float) -> int:
        """At a look at time `now`: the steps until the next one (the first look is followed by
        one at the next step, to measure a step)."""
        if self._last is not None:
            self._gap = steps_apart((now - self._last) / self._gap, self._look_s)
        self._last = now
        return self._gap


class Commands:
    """This rank's view of the commands for its run."""

    def __init__(
        self,
        collector: str,
        token: str | None,
        run_id: str,
        rank: int,
        poll_s: float = 2.0,
        look_s: float = LOOK_S,
        wait_s: float = WAIT_S,
    ):
        """`collector`: its URL, or several comma-separated (a lake's collectors, any of which has the
        run's commands: the one this node's route picks, rankwatch/agent/route.py, then the next that answers).
        `poll_s`: the least time between two polls' starts (a held poll's wait counts); `look_s`: the
        most training between two looks (each look is a broadcast over the job's ranks); `wait_s`: how
        long the collector may hold a poll."""
        self._rank = rank
        self._looks, self._until_look = Looks(look_s), 1  # at_step calls until the next look
        self._fetched: deque[dict] = deque()
        self._lock = threading.Lock()
        self._group: Any = None  # torch.distributed's gloo group, made on first use
        self._poll = (
            Poll(collector, token, run_id, JOB_KINDS, self._take, "rankwatch-commands", poll_s, wait_s)
            if rank == 0
            else None
        )

    def at_step(self, step: int) -> dict | None:
        """The command every rank applies at this step boundary, the same on all ranks; None
        most of the time. Every rank must call it at every step boundary (a look is a collective)."""
        self._until_look -= 1
        if self._until_look > 0:
            return None
        command, gap = None, 1  # the other ranks take rank 0's gap from the broadcast
        if self._rank == 0:
            gap = self._looks.gap(time.monotonic())
            with self._lock:
                command = self._fetched.popleft() if self._fetched else None
            if command is not None:
                command = self.report(command, "acked", apply_step=step) or command
        command, self._until_look = self._shared((command, gap))
        return command

    def report(
        self, command: dict, state: str, apply_step: int | None = None, result: dict | None = None
    ) -> dict | None:
        """Tell the collector how a command went (rank 0 speaks for the job); the updated command."""
        if self._poll is None:
            return None
        body = {
            "state": state,
            **({"apply_step": apply_step} if apply_step is not None else {}),
            **({"result": result} if result is not None else {}),
        }
        try:
            return self._poll.api.post(f"/v1/commands/{command['id']}", body)
        except ApiError as e:
            log.warning("rankwatch: could not report command %s as %s: %s", command["id"], state, e)
            return None

    def close(self) -> None:
        """Stop polling, without waiting for a held poll to end: the thread (a daemon) leaves when it does."""
        if self._poll is not None:
            self._poll.close()

    def _take(self, command: dict) -> None:
        with self._lock:
            self._fetched.append(command)

    def _shared(self, look: tuple[dict | None, int]) -> tuple[dict | None, int]:
        """Rank 0's look (its command, and the steps until the next look), on every rank."""
        try:
            import torch.distributed as dist
        except ImportError:
            return look
        if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
            return look
        if self._group is None:  # a CPU group, so the broadcast never waits on a GPU stream
            self._group = dist.group.WORLD if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        box = [look]
        dist.broadcast_object_list(box, src=0, group=self._group)
        return box[0]


class Poll:
    """A held poll of the control API for a run's pending commands of `kinds`, on a daemon thread named
    `name`, until close(): each command is handed to `take` once (on that thread). A poll starts at most
    every `every_s`: a held poll that ended empty is followed at once by the next, while a collector that
    answers at once (one that holds no poll, or one that answers with a command still pending) is asked
    every `every_s`, as are failing polls. `after_seen`: ask for the commands after the newest taken alone,
    for commands that stay pending once taken (a stacks request, which many answer): the poll is then held
    again at once."""

    def __init__(
        self,
        collector: str,
        token: str | None,
        run_id: str,
        kinds: tuple[str, ...],
        take: Callable[[dict], None],
        name: str,
        every_s: float = 2.0,
        wait_s: float = WAIT_S,
        after_seen: bool = False,
    ):
        """`collector`: its URL, or several comma-separated (a lake's collectors, any of which has the
        run's commands: the one this node's route picks, rankwatch/agent/route.py, then the next that
        answers); `wait_s`: how long the collector may hold a poll."""
        self._route = Route.of(collector)
        self.api = ApiClient(self._route.url, token, 5)  # its url follows the route: the reports go there too
        self._run_id, self._kinds, self._take, self._after_seen = run_id, kinds, take, after_seen
        self._stop = threading.Event()
        threading.Thread(target=self._run, args=(every_s, wait_s), name=name, daemon=True).start()

    def close(self) -> None:
        """Stop polling, without waiting for a held poll to end: the thread (a daemon) leaves when it does."""
        self._stop.set()

    def _run(self, every_s: float, wait_s: float) -> None:
        query = {"run_id": self._run_id, "state": "pending", "kind": ",".join(self._kinds), "wait": str(wait_s)}
        seen: set[int] = set()
        logged: set[str] = set()  # the kinds of failure logged: each once, not once a poll
        started = -math.inf
        while not self._stop.wait(max(started + every_s - time.monotonic(), 0.0)):
            started = time.monotonic()
            self.api.url = self._route.reachable() or self._route.url
            if self._after_seen and seen:
                query["after"] = str(max(seen))
            try:
                pending = self.api.get("/v1/commands", query, timeout_s=wait_s + 5)
            except ApiError as e:  # the command waits there until a poll gets it
                if self._stop.is_set():
                    return
                if e.kind not in logged:
                    logged.add(e.kind)
                    log.warning(
                        "rankwatch: polling %s for commands failed (%s); retrying every %g s, "
                        "not logging this failure again",
                        self.api.url,
                        _detail(e),
                        every_s,
                    )
                continue
            for command in pending:  # (a collector that does not filter by kind sends every kind)
                if command["id"] not in seen and command.get("kind") in self._kinds and not self._stop.is_set():
                    seen.add(command["id"])
                    self._take(command)


def _detail(error: ApiError) -> str:
    """What to log of a failed poll: the status with the API's reason, or why no answer came."""
    return f"HTTP {error.status}: {error}" if error.status is not None else str(error)
