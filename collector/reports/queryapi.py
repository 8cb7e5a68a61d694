"""The query API, both ends: `POST /api/v1/query` on the collector, and the call that
`rankwatch query --collector` and the dashboard make to it (through rankwatch/agent/apiclient.py); and a
run's merged stacks, which `rankwatch stacks` reads.

  POST /api/v1/query  {"sql", "params"?, "timeout_s"?, "max_rows"?}
    200 {"columns", "types", "rows", "truncated"}
    400 {"error"}  not JSON, a field missing or of the wrong type, not one SELECT, or DuckDB refused it
                   (its message whole, with its LINE and caret where it points at the place)
    401 {"error"}  missing or wrong bearer token
    403 {"error"}  a token without the query scope (rankwatch/agent/config.py: the collector's own, a query
                   or a control token)
    408 {"error"}  ran past its time limit and was interrupted
    413 {"error"}  a body over MAX_BODY
    503 {"error"}  the store's writer is restarting (Retry-After)

  GET /v1/runs/{run}/stacks[?request=ID]
    200 where every rank is: the answers to the run's newest stacks request (or to request ID) merged
        (collector/analysis/stacks.py), the odd group out as the run's firing hang finding blames it, and
        what that finding found in the answers' Flight Recorders (`flight_recorder`), where they are its own
    400, 401, 403, 503 as above; 404 {"error"}  the run has no such stacks request

  GET /v1/runs/{run}/nodes[?unhealthy=1]
    200 {"run", "nodes"}  each host, its ranks and health, worst first (collector/reports/nodes.py); with
        unhealthy=1 the unhealthy ones alone: a scheduler's drain list
    400, 401, 403, 503 as above; 404 {"error"}  no such run

Every field is checked here, before the request reaches the store's writer process, which runs the
query (collector/store/readonly.py): the one process that can read the file while the collector holds it.
"""

import asyncio
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from collector.receive import bodies
from collector.receive.auth import Tokens
from collector.store import readonly
from collector.store.requests import Context, handles
from collector.store.requests import Request as StoreRequest
from rankwatch.agent.apiclient import ApiClient, ApiError
from rankwatch.agent.config import QUERY

if TYPE_CHECKING:
    from collector.store.handle import Store

PATH = "/api/v1/query"
MAX_BODY = 2**20  # a request carries SQL and a few parameters, never data
MAX_PARAM_DEPTH = 4  # lists in lists a parameter may nest: DuckDB's binding time grows with the depth cubed
_FIELDS = ("sql", "params", "timeout_s", "max_rows")
STACKS_PATH = "/v1/runs/{run_id:path}/stacks"
NODES_PATH = "/v1/runs/{run_id:path}/nodes"
_YES_NO = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}
MAX_RUN_ID = 256  # characters of a run id (collector/control/commands.py's bound)
_MAX_ID = 2**63  # command ids are BIGINTs
# the run's firing hang finding's culprits, and what it found in the Flight Recorders of the request's answers
_CULPRITS = """SELECT ranks, CASE WHEN TRY_CAST(evidence->>'$.stacks.request' AS BIGINT) = ?
                                  THEN evidence->'$.flight_recorder' END
               FROM findings WHERE run_id = ? AND analyzer = ? AND kind = 'hang' AND state = 'firing'
               ORDER BY id DESC LIMIT 1"""


class QueryFailed(Exception):
    """The API refused a query or could not be reached; a one-line reason."""


def routes(store: Callable[[], "Store"], tokens: Tokens) -> list[Route]:
    """The query route; `store` gives the open store (it opens after the routes exist)."""

    async def query(request: Request) -> JSONResponse:
        if (refusal := tokens.refused(request, QUERY)) is not None:
            return refusal
        try:
            return JSONResponse(await asyncio.wrap_future(store().call(parse(await bodies.read(request, MAX_BODY)))))
        except bodies.Refused as e:
            return JSONResponse({"error": str(e)}, e.status)
        except readonly.QueryRefused as e:
            return JSONResponse({"error": str(e)}, 400)
        except readonly.QueryTimeout as e:
            return JSONResponse({"error": str(e)}, 408)
        except RuntimeError as e:  # the store's writer is restarting, or the query failed unforeseen
            return JSONResponse({"error": str(e)}, 503, {"Retry-After": "2"})

    async def stacks(request: Request) -> JSONResponse:
        if (refusal := tokens.refused(request, QUERY)) is not None:
            return refusal
        run_id, asked = request.path_params["run_id"], request.query_params.get("request")
        if not 0 < len(run_id) <= MAX_RUN_ID:
            return JSONResponse({"error": f"a run id has 1 to {MAX_RUN_ID} characters"}, 400)
        if asked is not None and not (asked.isascii() and asked.isdigit() and int(asked) < _MAX_ID):
            return JSONResponse({"error": f"request takes a command id, an integer, not {asked[:30]!r}"}, 400)
        try:
            call = RunStacks(run_id, None if asked is None else int(asked))
            return JSONResponse(await asyncio.wrap_future(store().call(call)))
        except LookupError as e:
            return JSONResponse({"error": str(e).strip("'\"")}, 404)
        except RuntimeError as e:  # the store's writer is restarting, or the read failed unforeseen
            return JSONResponse({"error": str(e)}, 503, {"Retry-After": "2"})

    async def run_nodes(request: Request) -> JSONResponse:
        if (refusal := tokens.refused(request, QUERY)) is not None:
            return refusal
        run_id, unhealthy = request.path_params["run_id"], request.query_params.get("unhealthy", "0")
        if not 0 < len(run_id) <= MAX_RUN_ID:
            return JSONResponse({"error": f"a run id has 1 to {MAX_RUN_ID} characters"}, 400)
        if unhealthy.lower() not in _YES_NO:
            return JSONResponse({"error": f"unhealthy takes 1 or 0, not {unhealthy[:30]!r}"}, 400)
        from collector.reports import nodes  # (its request's module: the query API's other clients load none of it)

        try:
            return JSONResponse(
                await asyncio.wrap_future(store().call(nodes.RunNodes(run_id, _YES_NO[unhealthy.lower()])))
            )
        except LookupError as e:
            return JSONResponse({"error": str(e).strip("'\"")}, 404)
        except RuntimeError as e:  # the store's writer is restarting, or the read failed unforeseen
            return JSONResponse({"error": str(e)}, 503, {"Retry-After": "2"})

    return [
        Route(PATH, query, methods=["POST"]),
        Route(STACKS_PATH, stacks, methods=["GET"]),
        Route(NODES_PATH, run_nodes, methods=["GET"]),
    ]


@dataclass(frozen=True)
class RunStacks(StoreRequest[dict]):
    """A run's merged stacks: those of its newest stacks request, or of `request`."""

    run_id: str
    request: int | None = None


@handles(RunStacks, beside=True, passes=(LookupError,))
def _run_stacks(context: Context, r: RunStacks) -> dict:
    """The merged answers (LookupError where the run has no such request), the odd group out as the run's firing
    hang finding blames it, with what it found in their Flight Recorders. (The analysis is imported here, in the
    writer process: the clients of this module, `rankwatch query` and the dashboard, load none of it.)"""
    from collector.analysis.analyzers import hangs
    from collector.analysis.engine import read_stacks
    from collector.analysis.stacks import merge

    answers = read_stacks(context.con, r.run_id, r.request)
    if answers is None:
        asked = "" if r.request is None else f" {r.request}"
        raise LookupError(f"run {r.run_id!r} has no stacks request{asked}")
    hung = [answers.request, r.run_id, hangs.ANALYZER]
    culprits, recorders = context.con.execute(_CULPRITS, hung).fetchone() or ([], None)
    told = {"flight_recorder": json.loads(recorders)} if recorders else {}
    return {"run_id": r.run_id, **merge(answers, culprits or []), **told}


def parse(body: bytes) -> readonly.Query:
    """The query of a request body, each field checked, the limits clamped to the server's;
    bodies.Refused says what is wrong in one line."""
    try:
        fields = json.loads(body)
    except (ValueError, RecursionError):  # not UTF-8, not JSON, or nested past the parser's depth
        fields = None
    if not isinstance(fields, dict):
        raise bodies.Refused(400, 'the body must be a JSON object {"sql": "...", "params"?: [...]}')
    if unknown := sorted(set(fields) - set(_FIELDS)):
        raise bodies.Refused(400, f"unknown field {unknown[0]!r}; the fields are {', '.join(_FIELDS)}")
    sql, params = fields.get("sql"), fields.get("params")
    timeout_s, max_rows = fields.get("timeout_s"), fields.get("max_rows")
    if not isinstance(sql, str) or not bodies.utf8(sql):
        raise bodies.Refused(400, "sql must be a string of UTF-8 text: one SELECT")
    if params is not None and not (
        isinstance(params, (list, dict)) and all(_parameter(v, MAX_PARAM_DEPTH) for v in _values(params))
    ):
        raise bodies.Refused(
            400,
            "params must be a list (or an object, for $name) of strings, numbers, booleans, "
            f"nulls or lists of them, nested at most {MAX_PARAM_DEPTH} deep",
        )
    if timeout_s is not None and not (_number(timeout_s) and timeout_s > 0):
        raise bodies.Refused(
            400, f"timeout_s must be a positive number of seconds (at most {readonly.TIMEOUT_S:g} apply)"
        )
    if max_rows is not None and not (_number(max_rows) and isinstance(max_rows, int) and max_rows >= 0):
        raise bodies.Refused(400, f"max_rows must be a whole number from 0 (at most {readonly.ROW_CAP} apply)")
    return readonly.Query(
        sql,
        params,
        readonly.TIMEOUT_S if timeout_s is None else float(min(timeout_s, readonly.TIMEOUT_S)),
        readonly.ROW_CAP if max_rows is None else min(max_rows, readonly.ROW_CAP),
    )


def _values(params: list | dict) -> list:
    return list(params.values()) if isinstance(params, dict) else params


def _number(value) -> bool:
    """A finite JSON number (an integer of any size, or a float that is neither NaN nor infinite)."""
    if isinstance(value, float):
        return math.isfinite(value)
    return isinstance(value, int) and not isinstance(value, bool)


def _parameter(value, depth: int) -> bool:
    """Whether `value` is a JSON scalar, or a list of parameters nested at most `depth` deep."""
    if isinstance(value, list):
        return depth > 0 and all(_parameter(v, depth - 1) for v in value)
    return value is None or isinstance(value, (int, float)) or (isinstance(value, str) and bodies.utf8(value))


def remote_query(client: ApiClient, sql: str, params: list | dict | None = None) -> dict:
    """The API's answer to one query through `client`; QueryFailed with the API's reason when it
    refuses, or why it could not be reached."""
    try:
        return client.post(PATH, {"sql": sql, "params": params}, timeout_s=readonly.TIMEOUT_S + 5)
    except ApiError as e:
        raise QueryFailed(str(e)) from None
