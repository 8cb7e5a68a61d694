"""Commands from the collector (rollbacks), taken by every rank at the same step.

Rank 0 fetches the run's pending commands from the control API in a
background thread, so the training loop never waits on the network. At a
step boundary every rank calls `at_step`: rank 0 hands out the oldest command
it has fetched, tells the collector it is taken (acked, with that step), and
the job's process group carries it to every rank, on a CPU (gloo) group so
the GPUs' streams are not touched. All ranks thus apply it at the same step.
"""

import logging
import threading
from collections import deque
from typing import Any

from agent.apiclient import ApiClient, ApiError

log = logging.getLogger("rankwatch.agent")


class Commands:
    """This rank's view of the commands for its run."""

    def __init__(self, collector: str, token: str | None, run_id: str, rank: int, poll_s: float = 2.0,
                 every: int = 5):
        """`every`: steps between two looks (each look is a broadcast over the job's ranks)."""
        self._api, self._run_id, self._rank, self._every = ApiClient(collector, token, 5), run_id, rank, every
        self._fetched: deque[dict] = deque()
        self._seen: set[int] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._group: Any = None  # torch.distributed's gloo group, made on first use
        self._thread = None
        if rank == 0:
            self._thread = threading.Thread(target=self._poll, args=(poll_s,), name="rankwatch-commands", daemon=True)
            self._thread.start()

    def at_step(self, step: int) -> dict | None:
        """The command every rank applies at this step boundary, the same on all ranks; None
        most of the time. Every rank must call it at the same steps (it is a collective)."""
        if step % self._every:
            return None
        command = None
        if self._rank == 0:
            with self._lock:
                command = self._fetched.popleft() if self._fetched else None
            if command is not None:
                command = self.report(command, "acked", apply_step=step) or command
        return self._shared(command)

    def report(self, command: dict, state: str, apply_step: int | None = None,
               result: dict | None = None) -> dict | None:
        """Tell the collector how a command went (rank 0 speaks for the job); the updated command."""
        if self._rank != 0:
            return None
        body = {"state": state, **({"apply_step": apply_step} if apply_step is not None else {}),
                **({"result": result} if result is not None else {})}
        try:
            return self._api.post(f"/v1/commands/{command['id']}", body)
        except ApiError as e:
            log.warning("rankwatch: could not report command %s as %s: %s", command["id"], state, e)
            return None

    def close(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=5)

    def _shared(self, command: dict | None) -> dict | None:
        """Rank 0's command, on every rank."""
        try:
            import torch.distributed as dist
        except ImportError:
            return command
        if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
            return command
        if self._group is None:  # a CPU group, so the broadcast never waits on a GPU stream
            self._group = dist.group.WORLD if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        box = [command]
        dist.broadcast_object_list(box, src=0, group=self._group)
        return box[0]

    def _poll(self, every_s: float) -> None:
        logged: set[str] = set()  # the kinds of failure logged: each once, not once a poll
        while not self._stop.wait(every_s):
            try:
                pending = self._api.get("/v1/commands", {"run_id": self._run_id, "state": "pending"})
            except ApiError as e:  # the command waits there until a poll gets it
                if e.kind not in logged:
                    logged.add(e.kind)
                    log.warning("rankwatch: polling %s for commands failed (%s); retrying every %g s, "
                                "not logging this failure again", self._api.url, _detail(e), every_s)
                continue
            with self._lock:
                for command in pending:
                    if command["id"] not in self._seen:
                        self._seen.add(command["id"])
                        self._fetched.append(command)


def _detail(error: ApiError) -> str:
    """What to log of a failed poll: the status with the API's reason, or why no answer came."""
    return f"HTTP {error.status}: {error}" if error.status is not None else str(error)
