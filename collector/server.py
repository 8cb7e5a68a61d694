"""The collector's HTTP server: OTLP/HTTP receiver, the control and query APIs, /healthz and /metrics.

Checks run cheapest first (token, content type, size) so a refused request
costs almost nothing; a request is answered 200 only after its rows are
committed. What the server holds is bounded whatever clients send: bodies
being read (a budget across connections), bodies waiting for commit (the
write queue, in decompressed bytes), open connections (a cap, and a deadline
for request headers: collector/receive/connections.py). /healthz and /metrics carry no training data and need no token,
as Prometheus and load balancers expect.
"""

import asyncio
import logging
import socket
from contextlib import asynccontextmanager

import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from collector import private
from collector.analysis.healthcounters import HealthCounters
from collector.children import bound_heap
from collector.config import Config
from collector.control import api as control
from collector.metrics.collector import SelfMetrics
from collector.metrics.runs import RunMetrics
from collector.receive import bodies, connections, otlp
from collector.receive.auth import Tokens, load_or_create_token
from collector.receive.decode import describe_decoder
from collector.receive.ingest import Ingestor
from collector.reports import queryapi
from collector.store.db import StoreLocked, connect
from collector.store.handle import NotStored, Overloaded, Store
from collector.store.lake import LakeError, open_lake
from collector.writertasks import WriterTasks
from rankwatch.agent.config import (
    INGEST,
    TOKEN_ENV,
    checked_token,
)

log = logging.getLogger("rankwatch.collector")
RETRY_AFTER_S = 2


def create_app(config: Config, tokens: Tokens) -> Starlette:
    """The ASGI app, taking `tokens` (`preflight`'s); the store opens on startup and drains on shutdown."""
    metrics = SelfMetrics()
    metrics.registry.register(RunMetrics(lambda request: state["ingestor"].store.call(request), config.metrics_runs))
    state: dict = {}
    reading = bodies.Budget(config.max_reading_bytes)

    @asynccontextmanager
    async def lifespan(app):
        store = Store(
            config.db,
            config.max_queue_bytes,
            on_commit=metrics.observe_commit,
            tasks=WriterTasks(config),
            on_failure=stop_failed,
            memory_headroom=config.writer_memory,
            lake=config.lake,
        )
        metrics.queue_bytes.set_function(lambda: store.queued_bytes)
        state["ingestor"] = Ingestor(store, config.workers)
        reporting = asyncio.create_task(report_health(store))
        try:
            yield
        finally:
            reporting.cancel()
            state["ingestor"].close()
            store.close()

    def stop_failed() -> None:
        """The store gave up on its writer: stop as on SIGTERM, and exit non-zero (serve) so that a
        supervisor starts the collector again."""
        app.state.failed = True
        if app.state.server is not None:
            app.state.server.should_exit = True

    async def report_health(store: Store) -> None:
        """Hand the writer the counters the collector's health is judged on, once per analysis period."""
        while True:
            await asyncio.sleep(config.analyze_every_s)
            try:
                await asyncio.wrap_future(
                    store.call(
                        HealthCounters(
                            queue_bytes=store.queued_bytes, max_queue_bytes=store.max_queue_bytes, **metrics.health()
                        )
                    )
                )
            except Exception:
                log.exception("judging the collector's health failed")

    def receiver(signal: str):
        async def export(request: Request) -> Response:
            kind = otlp.PROTOBUF
            if (refusal := tokens.refusal(request, INGEST)) is not None:  # before anything of the request is read
                if request.headers.get("content-length") == "0":  # a token's check (agent.export.check_token):
                    metrics.token_checks.labels(refusal.status).inc()  # its refusal loses no telemetry
                else:
                    metrics.requests.labels(signal, refusal.status).inc()
                body = otlp.status(refusal.status, refusal.reason, kind)
                return Response(body, refusal.status, refusal.headers, media_type=kind)
            try:
                kind = otlp.media_type(request.headers.get("content-type"))
                outcome = await state["ingestor"].export(
                    signal, kind, await inflated(request, otlp.encoding(request.headers.get("content-encoding")), kind)
                )
            except otlp.OtlpError as e:
                if e.status == 503:
                    return _unavailable(signal, str(e), kind)
                metrics.requests.labels(signal, e.status).inc()
                return Response(otlp.status(e.status, str(e), kind), e.status, media_type=kind)
            except Overloaded as e:
                return _unavailable(signal, str(e), kind)
            except NotStored as e:  # the writer logged why, once for its group
                return _unavailable(signal, f"collector could not store the export: {e}", kind)
            except Exception as e:  # a dead worker: transient, the exporter retries
                log.exception("export failed")
                return _unavailable(signal, f"collector could not store the export: {e}", kind)
            metrics.requests.labels(signal, 200).inc()
            if outcome.duplicate:
                metrics.duplicates.labels(signal).inc()
            else:
                metrics.received.labels(signal).inc(outcome.accepted)
            metrics.rejected.labels(signal).inc(outcome.rejected)
            return Response(otlp.success(signal, outcome.rejected, outcome.error, kind), media_type=kind)

        return export

    async def inflated(request: Request, encoding: str | None, kind: str) -> bytes:
        """The body read and decompressed within its media type's cap; its wire bytes are held in the
        reading budget until it is decompressed, and the write queue admits it by that size."""
        cap = otlp.max_body(kind)
        try:
            body = await bodies.read(request, cap, reading, config.body_timeout_s)
        except bodies.Refused as e:
            raise otlp.OtlpError(e.status, str(e)) from None
        try:
            return await state["ingestor"].inflate(body, encoding, cap)
        finally:
            reading.give(len(body))

    def _unavailable(signal: str, message: str, kind: str) -> Response:
        metrics.requests.labels(signal, 503).inc()
        return Response(otlp.status(503, message, kind), 503, {"Retry-After": str(RETRY_AFTER_S)}, media_type=kind)

    async def healthz(request: Request) -> Response:
        store = state["ingestor"].store
        if not store.healthy:
            return JSONResponse({"status": store.failure or "writer restarting"}, 503)
        return JSONResponse({"status": "ok", "queue_bytes": store.queued_bytes})

    async def prometheus(request: Request) -> Response:
        # off the event loop: the run metrics wait for the writer process
        return Response(await asyncio.to_thread(generate_latest, metrics.registry), media_type=CONTENT_TYPE_LATEST)

    routes = [Route(f"/v1/{signal}", receiver(signal), methods=["POST"]) for signal in ("traces", "metrics", "logs")]
    routes += [Route("/healthz", healthz), Route("/metrics", prometheus)]
    routes += control.routes(
        lambda: state["ingestor"].store, tokens, lambda: app.state.server is not None and app.state.server.should_exit
    )
    routes += queryapi.routes(lambda: state["ingestor"].store, tokens)
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.failed, app.state.server = False, None  # serve() sets the server, which stop_failed stops
    return app


class Unstartable(Exception):
    """What stops a collector from starting, found before it starts, in one line: its store held by another
    process, its lake refused, its address taken."""


def preflight(config: Config) -> Tokens:
    """What `serve` does before it starts, once: the data directory and what an earlier collector left in it made
    owner-only (collector/private.py); the tokens it takes, from its own (the given one checked, else the file
    beside the store read, or made: TokenError where it is short or a scoped one); `startable`'s checks."""
    private.restrict(config.db)
    own = (
        checked_token(config.token, f"--token or ${TOKEN_ENV}")
        if config.token is not None
        else load_or_create_token(config.db.parent)
    )
    tokens = Tokens(own)
    startable(config)
    return tokens


def startable(config: Config) -> None:
    """Unstartable where another process holds the store, the lake cannot be opened, or nothing can listen
    on the address."""
    try:
        config.db.parent.mkdir(parents=True, exist_ok=True)
        if config.lake:
            open_lake(config.lake).close()
        else:
            connect(config.db).close()
        check_address(config.host, config.port)
    except (StoreLocked, LakeError) as e:
        raise Unstartable(str(e)) from None
    except OSError as e:
        raise Unstartable(f"cannot listen on {config.host}:{config.port}: {e.strerror or e}") from None


def check_address(host: str, port: int) -> None:
    """OSError when nothing can listen on host:port (taken, or not this machine's)."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind((host, port))


class _Server(uvicorn.Server):
    """uvicorn's server, its listen queue lengthened once it listens (collector/receive/connections.py)."""

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        connections.lengthen_listen_queue(s for server in self.servers for s in server.sockets)


def serve(config: Config) -> None:
    """Run until SIGINT/SIGTERM, then drain the write queue and checkpoint; exit non-zero when the store gave
    up on its writer (Store.failure), for a supervisor to start it again. Its `preflight` first: Unstartable
    or TokenError before anything is served."""
    tokens = preflight(config)
    bound_heap()
    app = create_app(config, tokens)
    store = f"lake {config.lake.catalog!r}, data {config.lake.data_path}" if config.lake else f"store {config.db}"
    print(f"rankwatch collector on http://{config.host}:{config.port}  {store}", flush=True)
    print(describe_decoder(), flush=True)
    http = connections.protocol(connections.usable_connections(config.max_connections), config.header_timeout_s)
    app.state.server = _Server(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            log_level="warning",
            timeout_graceful_shutdown=30,
            http=http,
            backlog=connections.ACCEPT_BACKLOG,
        )
    )
    app.state.server.run()
    if app.state.failed:
        raise SystemExit(1)
