"""The query API, both ends: `POST /api/v1/query` on the collector, and the client that
`rankwatch query --collector` and the dashboard call it with.

  POST /api/v1/query  {"sql", "params"?, "timeout_s"?, "max_rows"?}
    200 {"columns", "types", "rows", "truncated"}
    400 {"error"}  not JSON, not one SELECT, or DuckDB refused it (its message's first line)
    401 {"error"}  missing or wrong bearer token
    408 {"error"}  ran past its time limit and was interrupted

The store's writer process runs the query (collector/readonly.py), the one
process that can read the file while the collector holds it.
"""

import asyncio
import json
from collections.abc import Callable

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from collector import readonly
from collector.auth import authorized
from collector.store import Store

PATH = "/api/v1/query"


class QueryFailed(Exception):
    """The API refused a query or could not be reached; a one-line reason."""


def routes(store: Callable[[], Store], token: str) -> list[Route]:
    """The query route; `store` gives the open store (it opens after the routes exist)."""

    async def query(request: Request) -> JSONResponse:
        if not authorized(request.headers.get("authorization"), token):
            return JSONResponse({"error": "missing or wrong bearer token"}, 401, {"WWW-Authenticate": "Bearer"})
        try:
            fields = json.loads(await request.body())
            if not isinstance(fields, dict) or not isinstance(fields.get("sql"), str):
                raise TypeError
            options = {"sql": fields["sql"], "params": fields.get("params") or None,
                       "timeout_s": float(fields.get("timeout_s", readonly.TIMEOUT_S)),
                       "max_rows": int(fields.get("max_rows", readonly.ROW_CAP))}
        except (ValueError, TypeError):
            return JSONResponse({"error": 'the body must be a JSON object {"sql": "...", "params"?: [...]}'}, 400)
        if not isinstance(options["params"], (list, dict, type(None))):
            return JSONResponse({"error": "params must be a list or an object"}, 400)
        try:
            return JSONResponse(await asyncio.wrap_future(store().call("query", **options)))
        except readonly.QueryRefused as e:
            return JSONResponse({"error": str(e)}, 400)
        except readonly.QueryTimeout as e:
            return JSONResponse({"error": str(e)}, 408)

    return [Route(PATH, query, methods=["POST"])]


def remote_query(client: httpx.Client, sql: str, params: list | dict | None = None) -> dict:
    """The API's answer to one query through `client` (base URL and token set); QueryFailed
    with the API's reason when it refuses."""
    try:
        response = client.post(PATH, json={"sql": sql, "params": params})
    except httpx.HTTPError as e:
        raise QueryFailed(f"cannot reach the collector at {client.base_url}: {e}") from None
    if response.status_code != 200:
        try:
            reason = response.json()["error"]
        except (ValueError, KeyError, TypeError):
            reason = f"HTTP {response.status_code}"
        raise QueryFailed(reason)
    return response.json()


def client(url: str, token: str | None, timeout_s: float = readonly.TIMEOUT_S + 5) -> httpx.Client:
    """An HTTP client for a collector's query API."""
    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token or ''}"}, timeout=timeout_s)
