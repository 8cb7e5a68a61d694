"""The control API: commands for a running job (rollbacks), over HTTP, behind the bearer token.

  GET  /v1/commands?run_id=R[&state=S]   a run's commands, oldest first
  POST /v1/commands                      {"run_id", "kind", "args"}: a person's command (201)
  POST /v1/commands/{id}                 {"state", "apply_step"?, "result"?}: the job reports progress

Bodies and answers are JSON; a refused request gets {"error": "..."} with 400,
401 or 404. The store's writer process, the one with the file open for writing,
carries the operations out (collector/commands.py).
"""

import asyncio
import json
from collections.abc import Callable

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from collector.auth import authorized
from collector.commands import CommandError
from collector.store import Store


def routes(store: Callable[[], Store], token: str) -> list[Route]:
    """The control API's routes; `store` gives the open store (it opens after the routes exist)."""

    async def call(request: Request, operation: str, status: int = 200, **kwargs) -> JSONResponse:
        if not authorized(request.headers.get("authorization"), token):
            return JSONResponse({"error": "missing or wrong bearer token"}, 401, {"WWW-Authenticate": "Bearer"})
        try:
            return JSONResponse(await asyncio.wrap_future(store().call(operation, **kwargs)), status)
        except CommandError as e:
            return JSONResponse({"error": str(e)}, 400)
        except LookupError as e:
            return JSONResponse({"error": str(e).strip("'")}, 404)

    async def body(request: Request, required: tuple[str, ...]) -> dict:
        try:
            fields = json.loads(await request.body())
        except ValueError:
            raise CommandError("the body is not JSON") from None
        if not isinstance(fields, dict) or any(k not in fields for k in required):
            raise CommandError(f"the body must be a JSON object with {', '.join(required)}")
        return fields

    async def listing(request: Request) -> JSONResponse:
        run_id = request.query_params.get("run_id")
        if not run_id:
            return JSONResponse({"error": "run_id is required"}, 400)
        return await call(request, "listing", run_id=run_id, state=request.query_params.get("state"))

    async def create(request: Request) -> JSONResponse:
        try:
            fields = await body(request, ("run_id", "kind"))
        except CommandError as e:
            return JSONResponse({"error": str(e)}, 400)
        return await call(request, "create", 201, run_id=str(fields["run_id"]), kind=str(fields["kind"]),
                          args=fields.get("args") or {}, created_by="api")

    async def update(request: Request) -> JSONResponse:
        try:
            fields = await body(request, ("state",))
            command_id = int(request.path_params["id"])
        except (CommandError, ValueError) as e:
            return JSONResponse({"error": str(e)}, 400)
        return await call(request, "update", command_id=command_id, state=str(fields["state"]),
                          apply_step=fields.get("apply_step"), result=fields.get("result"))

    return [Route("/v1/commands", listing, methods=["GET"]), Route("/v1/commands", create, methods=["POST"]),
            Route("/v1/commands/{id}", update, methods=["POST"])]
