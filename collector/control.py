"""The control API: commands for a running job (rollbacks), over HTTP, behind the bearer token.

  GET  /v1/commands?run_id=R[&state=S]   a run's commands, oldest first
  POST /v1/commands                      {"run_id", "kind", "args"}: a person's command (201)
  POST /v1/commands/{id}                 {"state", "apply_step"?, "result"?}: the job reports progress

Bodies and answers are JSON; a refused request gets {"error": "..."} with 400,
401, 404 or 413, and 503 while the store's writer is restarting. The token is
checked before anything of the body is read; a body is read up to MAX_BODY and
parsed strictly (collector/bodies.py); what each field may hold is checked by the
store's writer process, the one with the file open for writing, which carries the
operations out (collector/commands.py).
"""

import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from collector import bodies
from collector.auth import refused
from collector.commands import CommandError, CreateCommand, ListCommands, UpdateCommand

if TYPE_CHECKING:
    from collector.store.handle import Store

# Bytes of a body: a command or a job's report is a few hundred, per-rank power caps ~16 a rank (16,000
# ranks fit); the strict parse of the most a body this size can hold takes ~50 ms of the event loop.
MAX_BODY = 256 * 2**10
MAX_DEPTH = 16  # nesting of a body: commands use 3 levels (body, args, caps)
_MAX_ID = 2**63  # command ids are BIGINTs

# A request's operation: the writer's request, and the success status.
Operation = tuple[CreateCommand | ListCommands | UpdateCommand, int]


def routes(store: Callable[[], "Store"], token: str) -> list[Route]:
    """The control API's routes; `store` gives the open store (it opens after the routes exist)."""

    def guarded(operation: Callable[[Request], Awaitable[Operation]]) -> Callable:
        """An endpoint that checks the token, before anything else, then runs `operation`'s call."""

        async def endpoint(request: Request) -> JSONResponse:
            if (refusal := refused(request, token)) is not None:
                return refusal
            try:
                call, status = await operation(request)
                return JSONResponse(await asyncio.wrap_future(store().call(call)), status)
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
        run_id = request.query_params.get("run_id")
        if not run_id:
            raise CommandError("run_id is required")
        return ListCommands(run_id, request.query_params.get("state")), 200

    async def create(request: Request) -> Operation:
        fields = await body(request, ("run_id", "kind"), ("args",))
        return CreateCommand(fields["run_id"], fields["kind"], fields.get("args", {}), created_by="api"), 201

    async def update(request: Request) -> Operation:
        command_id = request.path_params["id"]
        if not (command_id.isascii() and command_id.isdigit() and int(command_id) < _MAX_ID):
            raise CommandError(f"command ids are integers in [0, 2^63), not {command_id[:30]!r}")
        fields = await body(request, ("state",), ("apply_step", "result"))
        return UpdateCommand(int(command_id), fields["state"], fields.get("apply_step"), fields.get("result")), 200

    return [Route("/v1/commands", guarded(listing), methods=["GET"]),
            Route("/v1/commands", guarded(create), methods=["POST"]),
            Route("/v1/commands/{id}", guarded(update), methods=["POST"])]


async def body(request: Request, required: tuple[str, ...], optional: tuple[str, ...]) -> dict:
    """The body's fields: a JSON object with every `required` field and no field but those and `optional`."""
    fields = bodies.parse_json(await bodies.read(request, MAX_BODY), MAX_DEPTH)
    if not isinstance(fields, dict) or any(k not in fields for k in required):
        raise CommandError(f"the body must be a JSON object with {', '.join(required)}")
    if unknown := sorted(set(fields) - {*required, *optional}):
        raise CommandError(f"unknown field {unknown[0][:30]!r}; fields: {', '.join(required + optional)}")
    return fields
