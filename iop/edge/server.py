"""The edge process: embedded NATS, JetStream setup, the HTTP app, and an orderly shutdown."""

from __future__ import annotations

import asyncio
import logging
import secrets
import signal
import time
from pathlib import Path
from typing import Any

import msgspec
import nats.errors
import uvicorn
from nats.aio.client import Client as NATS
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Scope

from iop import bus, config, validate
from iop.edge import http as edge_http
from iop.edge.api import ApiEndpoint, ApiRoutes, RequestIds
from iop.edge.dispatch import Finished
from iop.edge.keys import EdgeKeys
from iop.edge.ledger import LedgerWriter, ensure_ledger_stream
from iop.edge.memory import BurstTrim
from iop.edge.metrics import CONTENT_TYPE, Metrics
from iop.edge.observe import Observer
from iop.edge.qualify import QualifyDesk, qualify_routes
from iop.edge.refresh import Refresher, RefreshResult, publish_catalog
from iop.edge.registry import Registry
from iop.edge.relay import Relay
from iop.edge.responses_front import CompactEndpoint, ResponsesFront
from iop.edge.scheduler import Scheduler
from iop.edge.status import status_of
from iop.edge.status_schema import QualificationSummary, encode_status
from iop.edge.storage import WorkStream
from iop.edge.summary import SummaryCache
from iop.edge.ui import StatusFeed, ui_routes
from iop.edge.usage import usage_endpoint, usage_tail_endpoint
from iop.errors import (
    BadRequest,
    BusError,
    ConfigError,
    InvalidConfig,
    MethodNotAllowed,
    NotFound,
    RequestError,
    error_response,
)
from iop.openai.compaction import Sealer

log = logging.getLogger("iop.edge")
_json = msgspec.json.Encoder().encode


class Edge:
    """Everything the HTTP app needs, built from a validated deployment and a NATS connection."""

    def __init__(
        self,
        deployment: config.Deployment,
        nc: NATS,
        *,
        edge_id: str | None = None,
        nats_url: str = "",
        keys: EdgeKeys | None = None,
    ) -> None:
        self.deployment = deployment
        self.nats_url = nats_url
        self.catalog = config.Catalog.of(deployment)
        self.edge_id = edge_id or secrets.token_hex(4)
        self.nc = nc
        self.js = nc.jetstream()
        self.queue_timeout_s = deployment.edge.queue.timeout_s
        self.max_body_bytes = int(deployment.edge.max_body_mb * 1024 * 1024)
        self.nats_down = ""
        """Why the edge's own (embedded) NATS is down right now; empty while it runs."""
        self.fatal = ""
        """Set when the edge must stop with an error (its embedded NATS cannot be kept alive)."""
        h = deployment.edge.http
        self.http_limits = edge_http.HttpLimits(
            max_head_bytes=h.max_head_kb * 1024,
            max_headers=h.max_headers,
            head_timeout_s=h.head_timeout_s,
            body_idle_timeout_s=h.body_idle_timeout_s,
            max_connections=h.max_connections,
        )
        self.started_at = time.time()
        # Every stream and bucket made in this edge's tasks (ledger, qualification) gets this many copies.
        bus.default_replicas.set(deployment.edge.nats.replicas)
        self.scheduler = Scheduler(
            deployment.edge.queue.max_waiting, int(deployment.edge.queue.max_waiting_mb * 1024 * 1024)
        )
        for pid, ref in self.catalog.providers.items():
            if ref.provider.capacity is not None:
                self.scheduler.add_provider(pid, ref.node.id, ref.provider.capacity)
        for alias, members in self.catalog.pools.items():
            self.scheduler.add_pool(alias, members)
        self.relay = Relay(nc, self.js, self.edge_id)
        self.work_stream = WorkStream(self.js, self._capacities)
        self.relay.work_stream = self.work_stream
        self.on_request_finished: Finished | None = None
        """Called once with every served request's `DispatchResult` (pool and direct routes alike)."""
        self.registry = Registry(deployment, self.scheduler, self.edge_id, self.relay.node_lost)
        self.registry.on_reconnected = self.relay.bus_reconnected
        self.registry.on_tick = self.relay.sweep
        self.refresher = Refresher(self, nc, self.js)
        self.refresher.tell_removed = self.registry.tell_removed
        self.keys = keys if keys is not None else EdgeKeys.from_settings(deployment.edge)
        ledger_cfg = deployment.edge.ledger
        self.ledger = (
            LedgerWriter(nc, self.js, self.edge_id, buffer_records=ledger_cfg.buffer_records)
            if ledger_cfg.enabled
            else None
        )
        self.metrics = Metrics(self)
        self.metrics_public = deployment.edge.metrics_public
        """Read once, like the keys: a refresh reports a change as needing a restart."""
        self.observer = Observer(self.edge_id, self.metrics, self.ledger)
        self.status_feed = StatusFeed(self)
        """`/status/events`: the live status the `/ui` page reads."""
        self.summary = SummaryCache(self)
        """`/status?view=summary`: built at most once per 0.25 s, whatever the number of readers."""
        self.burst_trim = BurstTrim(self.waiting_requests, self.scheduler.changed)
        """Hands the memory of a drained burst of waiting requests back to the OS (iop/edge/memory.py)."""
        self.closing = asyncio.Event()
        """Set when the edge starts to stop: open streams (status pages, usage tails) end at once."""
        self.qualify = QualifyDesk(self)
        self.sealer = Sealer.random()
        """Seals iop's compaction items; `run_edge` derives it from the deployment's secret (docs/security.md)."""

    @property
    def qualifications(self) -> dict[str, QualificationSummary]:
        return self.qualify.summaries

    async def refresh_to(self, new: config.Deployment) -> RefreshResult:
        return await self.refresher.apply(new)

    async def start(self) -> None:
        if self.ledger is not None:
            cfg = self.deployment.edge.ledger
            await ensure_ledger_stream(self.js, cfg.max_age, cfg.max_bytes)
            self.ledger.start()
        await bus.ensure_work_stream(self.js, replicas=self.deployment.edge.nats.replicas)
        for pid, ref in self.catalog.providers.items():
            if ref.provider.capacity is not None:
                await bus.ensure_provider_consumer(self.js, pid, ref.provider.capacity)
        await publish_catalog(self.nc, self.js, self.deployment)
        await self.relay.start()
        await self.registry.start(self.nc)
        # Serving starts once the server has the reply and presence subscriptions.
        await bus.flush(self.nc)
        await self.qualify.start()
        self.burst_trim.start()

    def waiting_requests(self) -> int:
        """Requests waiting in this edge's pool queues now."""
        return sum(len(pool.waiters) for pool in self.scheduler.pools.values())

    @property
    def drift(self) -> list[str]:
        return self.refresher.drift

    @property
    def nats_connected(self) -> bool:
        return bool(self.nc.is_connected)

    def switch(self, new: config.Deployment) -> list[str]:
        """Serve `new` from now on, in one synchronous step; returns the providers left draining."""
        catalog = config.Catalog.of(new)
        self.deployment = new
        self.catalog = catalog
        self.queue_timeout_s = new.edge.queue.timeout_s
        self.max_body_bytes = int(new.edge.max_body_mb * 1024 * 1024)
        self.scheduler.max_waiting = new.edge.queue.max_waiting
        self.scheduler.max_waiting_bytes = int(new.edge.queue.max_waiting_mb * 1024 * 1024)
        draining = self.scheduler.apply(
            {
                pid: (ref.node.id, ref.provider.capacity)
                for pid, ref in catalog.providers.items()
                if ref.provider.capacity is not None
            },
            catalog.pools,
        )
        self.registry.apply(new)
        return draining

    def authorize(self, scope: Scope) -> str:
        """Check the client key; returns its name for the ledger ("" when the edge has no keys)."""
        key = self.keys.client(scope)
        return key.name if key is not None else ""

    def _capacities(self) -> dict[str, int]:
        return {
            pid: ref.provider.capacity
            for pid, ref in self.catalog.providers.items()
            if ref.provider.capacity is not None
        }

    @property
    def storage_error(self) -> str | None:
        """Why the work stream cannot take pool requests now (None while it can)."""
        return self.work_stream.error

    def readiness(self) -> list[str]:
        """Why this edge should not get traffic now; empty when ready."""
        reasons = []
        if not self.nc.is_connected or self.nats_down:
            reasons.append(self.nats_down or "not connected to NATS")
        if self.storage_error:
            reasons.append(self.storage_error)
        mono = time.monotonic()
        for alias, pool in self.scheduler.pools.items():
            if not any(p.connected and p.breaker(mono) != "open" for p in pool.providers):
                reasons.append(f"pool '{alias}' has no usable provider")
        return reasons

    async def stop(self) -> None:
        self.burst_trim.stop()
        await self.qualify.stop()
        await self.registry.stop()
        if self.ledger is not None:
            await self.ledger.stop()


def build_app(edge: Edge) -> ASGIApp:
    def model_entry(alias: str) -> dict[str, Any]:
        return {"id": alias, "object": "model", "created": int(edge.started_at), "owned_by": "iop"}

    async def models(request: Request) -> Response:
        edge.authorize(request.scope)
        return JSONResponse({"object": "list", "data": [model_entry(m.alias) for m in edge.deployment.models]})

    async def model(request: Request) -> Response:
        edge.authorize(request.scope)
        alias = request.path_params["alias"]
        if not any(m.alias == alias for m in edge.deployment.models):
            raise NotFound(f"model '{alias}' does not exist; GET /v1/models lists the models", param="model")
        return JSONResponse(model_entry(alias))

    async def status(request: Request) -> Response:
        edge.authorize(request.scope)
        view = request.query_params.get("view", "full")
        if view == "summary":
            return Response(edge.summary.body(), media_type="application/json")
        if view != "full":
            raise BadRequest(f"GET /status: unknown view '{view}'; use view=summary or view=full", param="view")
        return Response(encode_status(status_of(edge)), media_type="application/json")

    async def refresh(request: Request) -> Response:
        admin = edge.keys.admin(request.scope)
        text = (await request.body()).decode("utf-8", errors="replace")
        try:
            new = config.parse(text, "refresh").deployment
        except ConfigError as exc:
            log.warning("admin refresh by %s: invalid deployment, nothing applied", admin)
            raise InvalidConfig(exc.problems) from exc
        dry_run = request.query_params.get("dry_run") in ("1", "true")
        result = await edge.refresher.apply(new, dry_run=dry_run)
        log.info(
            "admin refresh%s by %s: %d changes%s",
            " (dry run)" if dry_run else "",
            admin,
            len(result.changes),
            f", failed: {result.error}" if result.error else "",
        )
        return Response(_json(result), 500 if result.error else 200, media_type="application/json")

    async def healthz(request: Request) -> Response:
        # Liveness: an edge cut off from NATS can serve nothing; say so, so a supervisor can act.
        # Storage too: an edge whose work stream cannot take work fails every pool request.
        connected = edge.nc.is_connected and not edge.nats_down
        if connected:
            await edge.work_stream.recheck()
        storage = edge.storage_error
        ok = connected and storage is None
        body: dict[str, Any] = {"ok": ok, "nats": connected, "storage": storage is None}
        if not connected:
            body["reason"] = edge.nats_down or "not connected to NATS"
        elif storage is not None:
            body["reason"] = storage
        return JSONResponse(body, 200 if ok else 503)

    async def readyz(request: Request) -> Response:
        reasons = edge.readiness()
        return JSONResponse({"ready": not reasons, "reasons": reasons}, 503 if reasons else 200)

    async def metrics(request: Request) -> Response:
        if not edge.metrics_public:
            edge.authorize(request.scope)
        return Response(edge.metrics.render(), media_type=CONTENT_TYPE)

    async def request_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestError)
        response = error_response(exc)
        return Response(response.body, response.status, headers=response.headers, media_type="application/json")

    async def http_error(request: Request, exc: Exception) -> Response:
        # Starlette's own refusals (unknown path, wrong method) become ours, answered the same way.
        assert isinstance(exc, HTTPException)
        message = f"{request.method} {request.url.path}: {exc.detail}"
        err: RequestError
        if exc.status_code == 404:
            err = NotFound(message, code="not_found")
        elif exc.status_code == 405:
            err = MethodNotAllowed(message, headers=dict(exc.headers or {}))
        else:
            err = BadRequest(message, code="http_error", status=exc.status_code)
        return await request_error(request, err)

    routes = [
        Route("/v1/models", models, methods=["GET"]),
        # An alias may hold `/` (`org/model`), so the rest of the path is the id.
        Route("/v1/models/{alias:path}", model, methods=["GET"]),
        Route("/status", status, methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/readyz", readyz, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/usage", usage_endpoint(edge), methods=["GET"]),
        Route("/usage/tail", usage_tail_endpoint(edge), methods=["GET"]),
        Route("/admin/refresh", refresh, methods=["POST"]),
        *ui_routes(
            edge,
            edge.status_feed,
            keys_on=lambda: bool(edge.keys.clients),
            ledger_on=lambda: getattr(edge, "ledger", None) is not None,
        ),
        *qualify_routes(edge, lambda: edge.qualify, lambda: encode_status(status_of(edge))),
    ]
    app = Starlette(
        routes=routes,
        exception_handlers={RequestError: request_error, HTTPException: http_error},
    )
    # `/v1/models/` is not `/v1/models`: a 307 to another URL confuses clients more than a clear 404.
    app.router.redirect_slashes = False
    responses = ResponsesFront(edge, ApiEndpoint(edge, "responses"))
    api: dict[str, ASGIApp] = {
        "/v1/chat/completions": ApiEndpoint(edge, "chat"),
        "/v1/responses": responses,
        "/v1/responses/compact": CompactEndpoint(responses),
    }
    return RequestIds(edge_http.SameOrigin(ApiRoutes(api, app)))


def http_server(edge: Edge, *, host: str = "127.0.0.1", port: int = 0, grace_s: float = 30.0) -> uvicorn.Server:
    """The edge's uvicorn server: its app on iop's connection limits (iop/edge/http.py)."""
    return uvicorn.Server(
        uvicorn.Config(
            build_app(edge),
            host=host,
            port=port,
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=int(grace_s),
            http=edge_http.protocol_class(edge.http_limits),
            timeout_keep_alive=edge.deployment.edge.http.keepalive_s,
        )
    )


async def run_edge(
    loaded: config.Loaded,
    *,
    listen: str | None = None,
    nats_url: str | None = None,
    ready: asyncio.Event | None = None,
    grace_s: float = 30.0,
) -> None:
    """Run an edge until SIGINT/SIGTERM: start NATS if embedded, serve HTTP, then shut down in order."""
    dep = loaded.deployment
    settings = dep.edge
    embedded: bus.EmbeddedNats | None = None
    url = nats_url or settings.nats.url
    # Before anything starts: a missing secret is fatal. The embedded server has its own users.
    access = bus.NatsAccess.from_settings(settings.nats) if url != "embedded" else bus.NatsAccess()
    keys = EdgeKeys.from_settings(settings)  # so is a keys variable that holds no key
    bind = listen or settings.listen
    if not keys.clients and not validate.is_loopback(bind.rpartition(":")[0]):
        if not settings.allow_anonymous:
            raise ConfigError(
                [
                    f"edge.listen: {bind} is not a loopback address and api_keys_env is not set: set it, "
                    "or edge.allow_anonymous: true if anyone there may use every model"
                ]
            )
        log.warning("edge.allow_anonymous: anyone who reaches %s can use every model (no client keys)", bind)
    edge_http.raise_fd_limit()
    # Bind the HTTP socket before anything starts: a busy port is one line, with nothing to undo.
    sock = edge_http.bind(bind)
    try:
        if url == "embedded":
            # A relative store_dir is relative to the working directory, like any path on a command line.
            embedded = bus.EmbeddedNats(
                settings.nats.listen, Path(settings.nats.store_dir), nodes=dep.nodes, cluster=settings.nats.cluster
            )
            await embedded.start()
            url = embedded.address
            access = embedded.access
        nc = await bus.connect(url, "iop-edge", access=access, wait_s=15.0)
        try:
            # A cluster (embedded member or external) needs its members and a JetStream leader
            # before any stream can be made: a bounded wait, then one line saying why not.
            cluster = settings.nats.cluster
            waited = await bus.wait_jetstream(nc, cluster.start_wait_s if cluster else bus.CLUSTER_WAIT_S, embedded)
        except BusError:
            await nc.close()
            raise
        if waited > 0.5:
            log.info("NATS JetStream ready after %.1fs", waited)
        edge = Edge(dep, nc, nats_url=url, keys=keys)
        edge.sealer = _sealer(embedded, access)
        if embedded is not None:
            edge.refresher.authorize_nodes = embedded.authorize  # users follow the deployment's nodes
        await edge.start()
        server = http_server(edge, grace_s=grace_s)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        if loaded.path is not None:
            edge.refresher.started_from(loaded.path, dep)
            loop.add_signal_handler(signal.SIGHUP, edge.refresher.reload, loaded.path)
        supervisor = None
        if embedded is not None:
            supervisor = asyncio.create_task(_supervise_nats(embedded, edge, stop))
        serve = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started:
            if serve.done():
                await serve
                return
            await asyncio.sleep(0.01)
        bound = _bound_address(server)
        log.info("iop edge %s serving http://%s (nats %s)", edge.edge_id, bound, url)
        print(f"iop edge listening on http://{bound} nats={url}", flush=True)
        if ready is not None:
            ready.set()
        await stop.wait()
        if supervisor is not None:
            supervisor.cancel()
        log.info("iop edge stopping: finishing in-flight requests (up to %gs)", grace_s)
        # Open streams would otherwise hold the graceful shutdown until grace_s is over.
        edge.closing.set()
        edge.status_feed.close()
        server.should_exit = True
        await serve
        await edge.stop()
        try:
            await bus.flush(nc, 2)
        except (nats.errors.Error, TimeoutError, OSError) as exc:
            log.info("iop edge stopping: NATS did not flush (%s)", exc)
        await bus.close(nc)
        if edge.fatal:
            raise BusError(edge.fatal)
    finally:
        sock.close()
        if embedded is not None:
            await embedded.stop()


def _sealer(embedded: bus.EmbeddedNats | None, access: bus.NatsAccess) -> Sealer:
    """The compaction sealer from what every edge of the deployment holds and no node does.

    The embedded server's root secret, else the edges' own NATS password or token. With neither
    (an open NATS server), a key of this process: its compaction items end with it.
    """
    if embedded is not None and embedded.credentials is not None:
        return Sealer.derived(embedded.credentials.password("iop-compaction-seal").encode())
    secret = access.password or access.token
    if secret:
        return Sealer.derived(secret.encode())
    log.warning("NATS has no credentials: compaction items this edge makes are readable only until it stops")
    return Sealer.random()


NATS_RESTARTS = 3
"""Restarts of a dead embedded nats-server within `NATS_RESTART_WINDOW_S` before the edge gives up."""
NATS_RESTART_WINDOW_S = 60.0


async def _supervise_nats(embedded: bus.EmbeddedNats, edge: Edge, stop: asyncio.Event) -> None:
    """Restart the embedded nats-server when it dies; past the budget, stop the edge with an error.

    Exiting non-zero is what lets a supervisor (systemd, a container runtime) act: an edge that
    keeps answering HTTP without its NATS only turns every request into a 503.
    """
    restarts: list[float] = []
    while True:
        status = await embedded.wait()
        now = time.monotonic()
        restarts = [t for t in restarts if now - t < NATS_RESTART_WINDOW_S]
        if len(restarts) >= NATS_RESTARTS:
            edge.fatal = (
                f"the embedded nats-server exited {NATS_RESTARTS + 1} times within {NATS_RESTART_WINDOW_S:g}s "
                f"(last status {status}); stopping the edge"
            )
            log.error("%s", edge.fatal)
            stop.set()
            return
        restarts.append(now)
        log.error("the embedded nats-server exited (status %s); restarting it on %s", status, embedded.address)
        edge.nats_down = f"embedded nats-server exited (status {status})"
        try:
            await embedded.restart()
        except BusError as exc:
            edge.fatal = f"the embedded nats-server exited and could not be restarted: {exc}"
            log.error("%s", edge.fatal)
            stop.set()
            return
        edge.nats_down = ""


def _bound_address(server: uvicorn.Server) -> str:
    for s in server.servers:
        for sock in s.sockets:
            host, port = sock.getsockname()[:2]
            return f"{host}:{port}"
    return "?"
