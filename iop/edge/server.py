"""The edge process: embedded NATS, JetStream setup, the HTTP app, and an orderly shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import signal
import time
from pathlib import Path

import uvicorn
from nats.aio.client import Client as NATS
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Scope

from iop import bus, config
from iop.edge.api import ApiEndpoint, check_bearer
from iop.edge.registry import Registry
from iop.edge.relay import Relay
from iop.edge.scheduler import Scheduler
from iop.edge.status import status_of
from iop.errors import RequestError, error_body

log = logging.getLogger("iop.edge")

MAX_BODY_BYTES = 8 * 1024 * 1024 - 64 * 1024
"""Default request body limit: what fits one NATS message with the work item around it."""


class Edge:
    """Everything the HTTP app needs, built from a validated deployment and a NATS connection."""

    def __init__(
        self, deployment: config.Deployment, nc: NATS, *, edge_id: str | None = None, nats_url: str = ""
    ) -> None:
        self.deployment = deployment
        self.nats_url = nats_url
        self.catalog = config.Catalog.of(deployment)
        self.edge_id = edge_id or secrets.token_hex(4)
        self.nc = nc
        self.js = nc.jetstream()
        self.queue_timeout_s = deployment.edge.queue.timeout_s
        self.max_body_bytes = MAX_BODY_BYTES
        self.started_at = time.time()
        self.scheduler = Scheduler(deployment.edge.queue.max_waiting)
        for pid, ref in self.catalog.providers.items():
            if ref.provider.capacity is not None:
                self.scheduler.add_provider(pid, ref.node.id, ref.provider.capacity)
        for alias, members in self.catalog.pools.items():
            self.scheduler.add_pool(alias, members)
        self.relay = Relay(nc, self.js, self.edge_id)
        self.registry = Registry(deployment, self.scheduler, self.edge_id, self.relay.node_lost)
        keys_env = deployment.edge.api_keys_env
        raw_keys = os.environ.get(keys_env, "") if keys_env else ""
        self.api_keys = [k.strip().encode() for k in raw_keys.split(",") if k.strip()]

    async def start(self) -> None:
        await bus.ensure_work_stream(self.js)
        for pid, ref in self.catalog.providers.items():
            if ref.provider.capacity is not None:
                await bus.ensure_provider_consumer(self.js, pid, ref.provider.capacity)
        await self.relay.start()
        await self.registry.start(self.nc)

    def authorize(self, scope: Scope) -> None:
        if self.api_keys:
            check_bearer(scope, self.api_keys)

    async def stop(self) -> None:
        await self.registry.stop()


def build_app(edge: Edge) -> Starlette:
    async def models(request: Request) -> Response:
        edge.authorize(request.scope)
        data = [
            {"id": m.alias, "object": "model", "created": int(edge.started_at), "owned_by": "iop"}
            for m in edge.deployment.models
        ]
        return JSONResponse({"object": "list", "data": data})

    async def status(request: Request) -> Response:
        edge.authorize(request.scope)
        return JSONResponse(status_of(edge))

    async def healthz(request: Request) -> Response:
        return JSONResponse({"ok": True, "nats": edge.nc.is_connected})

    async def request_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestError)
        return Response(exc.body(), exc.status, headers=exc.headers, media_type="application/json")

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return Response(
            error_body(message, "invalid_request_error", code), exc.status_code, media_type="application/json"
        )

    routes = [
        Route("/v1/chat/completions", ApiEndpoint(edge, "chat")),
        Route("/v1/responses", ApiEndpoint(edge, "responses")),
        Route("/v1/models", models, methods=["GET"]),
        Route("/status", status, methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
    ]
    return Starlette(
        routes=routes,
        exception_handlers={RequestError: request_error, HTTPException: http_error},
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
    access = bus.NatsAccess.from_settings(settings.nats)  # before anything starts: a missing secret is fatal
    if url == "embedded":
        # A relative store_dir is relative to the working directory, like any path on a command line.
        embedded = bus.EmbeddedNats(settings.nats.listen, Path(settings.nats.store_dir), access=access)
        await embedded.start()
        url = embedded.url
    try:
        nc = await bus.connect(url, "iop-edge", access=access, wait_s=15.0)
        edge = Edge(dep, nc, nats_url=url)
        await edge.start()
        host, _, port = (listen or settings.listen).rpartition(":")
        server = uvicorn.Server(
            uvicorn.Config(
                build_app(edge),
                host=host,
                port=int(port),
                log_level="warning",
                access_log=False,
                lifespan="off",
                timeout_graceful_shutdown=int(grace_s),
            )
        )
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        serve = asyncio.create_task(server.serve(sockets=None))
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
        log.info("iop edge stopping: finishing in-flight requests (up to %gs)", grace_s)
        server.should_exit = True
        await serve
        await edge.stop()
        with contextlib.suppress(Exception):
            await nc.flush(timeout=2)
        await nc.close()
    finally:
        if embedded is not None:
            await embedded.stop()


def _bound_address(server: uvicorn.Server) -> str:
    for s in server.servers:
        for sock in s.sockets:
            host, port = sock.getsockname()[:2]
            return f"{host}:{port}"
    return "?"
