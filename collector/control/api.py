"""The control API: commands for a running job (rollbacks, power caps, stacks requests), over HTTP, behind the
bearer tokens, each request open to the scopes named (rankwatch/agent/config.py; the collector's own token has all):

  GET  /v1/commands?run_id=R[&state=S]   a run's commands, oldest first (ingest, query)
       [&kind=K[,K...]][&after=ID]        of those kinds only, with ids above ID only
       [&state=pending&wait=W]            held until the run has a pending command (of those), W seconds at most
  POST /v1/commands                      {"run_id", "kind", "args"}: a person's command, 201 (control)
  POST /v1/commands/{id}                 {"state", "apply_step"?, "result"?}: the job reports progress (ingest, control)

Bodies and answers are JSON; a refused request gets {"error": "..."} with 400,
401, 403, 404 or 413, and 503 while the store's writer is restarting. The token is
checked before anything of the body is read; a body is read up to MAX_BODY and
parsed strictly (collector/receive/bodies.py); what each field may hold is checked by the
store's writer process, the one with the file open for writing, which carries the
operations out (collector/control/commands.py).
"""

import asyncio
import math
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from collector.control.commands import (
    CommandError,
    CreateCommand,
    ListCommands,
    PendingPolls,
    Poll,
    UpdateCommand,
)
from collector.receive import bodies
from collector.receive.auth import Tokens
from rankwatch.agent.config import CONTROL, INGEST, QUERY

if TYPE_CHECKING:
    from collector.store.handle import Store

# Bytes of a body: a command or a job's report is a few hundred, per-rank power caps ~16 a rank (16,000
# ranks fit); the strict parse of the most a body this size can hold takes ~50 ms of the event loop.
MAX_BODY = 256 * 2**10
MAX_DEPTH = 16  # nesting of a body: commands use 3 levels (body, args, caps)
_MAX_ID = 2**63  # command ids are BIGINTs
# A held poll: at most MAX_WAIT_S (a job's agent asks for 20 s; idle connections are cut by proxies
# after about a minute), asked about every WAIT_TICK_S (what it adds to a command's way to the job,
# one writer call for all held polls), and at most MAX_WAITING held at once (one per running job;
# beyond, a poll is answered at once, as without `wait`, so no number of them holds more).
MAX_WAIT_S = 30.0
WAIT_TICK_S = 0.05
MAX_WAITING = 1024

# A request's operation: the writer's request, the success status, and how long a poll may be held.
Operation = tuple[CreateCommand | ListCommands | UpdateCommand, int, float]


class Waiting:
    """The held polls, by what they ask (run, kinds, after): one writer call every WAIT_TICK_S asks which of
    them have a pending command, and wakes theirs; none is made while none waits."""

    def __init__(self, store: Callable[[], "Store"], stopping: Callable[[], bool]):
        self._store, self._stopping = store, stopping
        self._polls: dict[Poll, set[asyncio.Event]] = {}
        self._held = 0
        self._ticking: asyncio.Task | None = None

    async def until_pending(self, poll: Poll, wait_s: float, gone: Callable[[], Awaitable[None]]) -> bool:
        """Return once `poll` has a pending command, after `wait_s` at the latest, at once when
        MAX_WAITING polls are held already, and when the server is stopping; or once `gone` returns
        (the client has closed its connection: its slot is freed for the polls of clients still
        there, not held to the end of a wait nobody is answered at). Whether the client is there."""
        if self._held >= MAX_WAITING:
            return True
        woken = asyncio.Event()
        self._polls.setdefault(poll, set()).add(woken)
        self._held += 1
        if self._ticking is None or self._ticking.done():
            self._ticking = asyncio.create_task(self._tick())
        waits = (asyncio.ensure_future(woken.wait()), asyncio.ensure_future(gone()))
        try:
            await asyncio.wait(waits, timeout=wait_s, return_when=asyncio.FIRST_COMPLETED)
            return not waits[1].done()
        finally:
            for task in waits:
                task.cancel()
            self._held -= 1
            self._polls[poll].discard(woken)
            if not self._polls[poll]:
                del self._polls[poll]

    async def _tick(self) -> None:
        while self._polls:
            await asyncio.sleep(WAIT_TICK_S)
            if self._stopping():
                pending = list(self._polls)
            else:
                try:
                    pending = await asyncio.wrap_future(self._store().call(PendingPolls(list(self._polls))))
                except RuntimeError:  # the writer is restarting: the polls are held on, to their wait
                    continue
            for poll in pending:
                for woken in self._polls.get(poll, ()):
                    woken.set()


def routes(store: Callable[[], "Store"], tokens: Tokens, stopping: Callable[[], bool] = lambda: False) -> list[Route]:
    """The control API's routes; `store` gives the open store (it opens after the routes exist);
    `stopping`: whether the server is stopping (held polls are then answered at once)."""
    waiting = Waiting(store, stopping)

    def guarded(operation: Callable[[Request], Awaitable[Operation]], *needs: str) -> Callable:
        """An endpoint that checks the token has one of the scopes `needs`, before anything else, then
        runs `operation`'s call."""

        async def endpoint(request: Request) -> JSONResponse:
            if (refusal := tokens.refused(request, *needs)) is not None:
                return refusal
            try:
                call, status, wait_s = await operation(request)
                answer = await asyncio.wrap_future(store().call(call))
                if (
                    not answer
                    and wait_s > 0
                    and isinstance(call, ListCommands)
                    and await waiting.until_pending(
                        (call.run_id, call.kinds, call.after), wait_s, lambda: _disconnected(request)
                    )
                ):
                    answer = await asyncio.wrap_future(store().call(call))
                return JSONResponse(answer, status)
            except bodies.Refused as e:
                return JSONResponse({"error": str(e)}, e.status)
            except CommandError as e:
                return JSONResponse({"error": str(e)}, 400)
            except LookupError as e:
                return JSONResponse({"error": str(e).strip("'")}, 404)
            except RuntimeError as e:  # the store's writer is restarting, or failed the call
                return JSONResponse({"error": str(e)}, 503, {"Retry-After": "2"})

        return endpoint

    async def listing(request: Request) -> Operation:
        params = request.query_params
        run_id, state = params.get("run_id"), params.get("state")
        if not run_id:
            raise CommandError("run_id is required")
        kinds = _kinds(params.get("kind"))
        return ListCommands(run_id, state, kinds, _after(params.get("after"))), 200, _wait(params.get("wait"), state)

    async def create(request: Request) -> Operation:
        fields = await body(request, ("run_id", "kind"), ("args",))
        return CreateCommand(fields["run_id"], fields["kind"], fields.get("args", {}), created_by="api"), 201, 0.0

    async def update(request: Request) -> Operation:
        command_id = request.path_params["id"]
        if not (command_id.isascii() and command_id.isdigit() and int(command_id) < _MAX_ID):
            raise CommandError(f"command ids are integers in [0, 2^63), not {command_id[:30]!r}")
        fields = await body(request, ("state",), ("apply_step", "result"))
        return UpdateCommand(int(command_id), fields["state"], fields.get("apply_step"), fields.get("result")), 200, 0.0

    return [
        Route("/v1/commands", guarded(listing, INGEST, QUERY), methods=["GET"]),  # a job's poll, or a read
        Route("/v1/commands", guarded(create, CONTROL), methods=["POST"]),
        Route("/v1/commands/{id}", guarded(update, INGEST, CONTROL), methods=["POST"]),  # a job's report
    ]


async def _disconnected(request: Request) -> None:
    """Return once the client has closed its connection (the ASGI server's `http.disconnect`; a
    poll's body, which it does not have, is read past)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _kinds(text: str | None) -> tuple[str, ...] | None:
    """A poll's `kind`: one kind or a comma-separated list (each checked by the writer), in a form
    of its own whatever the order and repeats; None: every kind."""
    if text is None:
        return None
    return tuple(sorted({kind.strip() for kind in text.split(",")}))


def _after(text: str | None) -> int | None:
    """A poll's `after`: a command id, the commands after it alone."""
    if text is None:
        return None
    if not (text.isascii() and text.isdigit() and int(text) < _MAX_ID):
        raise CommandError(f"after takes a command id, an integer in [0, 2^63), not {text[:30]!r}")
    return int(text)


def _wait(text: str | None, state: str | None) -> float:
    """A poll's `wait`, checked: seconds in [0, MAX_WAIT_S], for pending commands only (0: not held)."""
    if text is None:
        return 0.0
    try:
        wait_s = float(text)
    except ValueError:
        wait_s = math.nan
    if not 0 <= wait_s <= MAX_WAIT_S:  # NaN fails it too
        raise CommandError(f"wait must be a number of seconds in [0, {MAX_WAIT_S:g}], not {text[:30]!r}")
    if state != "pending":
        raise CommandError("wait holds a poll for pending commands: it takes state=pending")
    return wait_s


async def body(request: Request, required: tuple[str, ...], optional: tuple[str, ...]) -> dict:
    """The body's fields: a JSON object with every `required` field and no field but those and `optional`."""
    fields = bodies.parse_json(await bodies.read(request, MAX_BODY), MAX_DEPTH)
    if not isinstance(fields, dict) or any(k not in fields for k in required):
        raise CommandError(f"the body must be a JSON object with {', '.join(required)}")
    if unknown := sorted(set(fields) - {*required, *optional}):
        raise CommandError(f"unknown field {unknown[0][:30]!r}; fields: {', '.join(required + optional)}")
    return fields
