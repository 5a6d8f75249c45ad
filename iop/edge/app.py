"""The edge's HTTP app: the one route table, the qualification routes included, and its error answers."""

from __future__ import annotations

import logging
from typing import Any

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Scope

from iop import config, endpoints
from iop.contracts.status import encode_status
from iop.edge.api import ApiEndpoint, ApiRoutes, RequestIds
from iop.edge.count_tokens import CountTokensEndpoint
from iop.edge.lifecycle import lifecycle_routes
from iop.edge.managed import key_routes
from iop.edge.metrics import CONTENT_TYPE, OPENMETRICS
from iop.edge.origin import HostAllowList, SameOrigin
from iop.edge.provider_admin import provider_routes
from iop.edge.qualification import qualify_routes
from iop.edge.responses_front import CompactEndpoint, ResponsesFront
from iop.edge.root import Edge
from iop.edge.status import status_of
from iop.edge.ui import ui_routes
from iop.edge.usage import usage_endpoint, usage_tail_endpoint
from iop.edge.websocket import Sockets
from iop.errors import (
    BadRequest,
    ConfigError,
    InvalidConfig,
    MethodNotAllowed,
    NotFound,
    RequestError,
    error_response,
)
from iop.responses.endpoints import response_routes

log = logging.getLogger("iop.edge")
_json = msgspec.json.Encoder().encode


def build_app(edge: Edge) -> ASGIApp:
    """The edge's ASGI app: the one route table (the OpenAI endpoints, status, admin, qualification)."""

    def model_entry(alias: str) -> dict[str, Any]:
        # `endpoints` is iop's: what every provider behind the alias answers (iop/endpoints.py).
        served = endpoints.ordered(endpoints.of_alias(edge.catalog, alias))
        return {"id": alias, "object": "model", "created": int(edge.started_at), "owned_by": "iop", "endpoints": served}

    def visible(scope: Scope) -> list[str]:
        # A tenant sees only the models it may use: the others do not exist for its key, as they answer 404.
        policy = edge.tenants.of_key(edge.authorize(scope)).policy
        return [m.alias for m in edge.deployment.models if policy.allows(m.alias)]

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [model_entry(alias) for alias in visible(request.scope)]})

    async def model(request: Request) -> Response:
        alias = request.path_params["alias"]
        if alias not in visible(request.scope):
            raise NotFound(f"model '{alias}' does not exist; GET /v1/models lists the models", param="model")
        return JSONResponse(model_entry(alias))

    async def status(request: Request) -> Response:
        edge.authorize(request.scope)
        view = request.query_params.get("view", "full")
        if view == "summary":
            return Response(edge.summary.body(), media_type="application/json")
        if view != "full":
            raise BadRequest(f"GET /status: unknown view '{view}'; use view=summary or view=full", param="view")
        return Response(encode_status(status_of(edge.status_sources)), media_type="application/json")

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
        storage = edge.work_stream.error
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
        if "application/openmetrics-text" in request.headers.get("accept", ""):
            return Response(edge.metrics.render(openmetrics=True), media_type=OPENMETRICS)
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

    ledger_on = edge.ledger is not None
    usage = usage_endpoint(edge.keys, edge.js, ledger_on=ledger_on)
    usage_tail = usage_tail_endpoint(edge.keys, edge.js, edge.closing, ledger_on=ledger_on)
    routes = [
        Route("/v1/models", models, methods=["GET"]),
        # An alias may hold `/` (`org/model`), so the rest of the path is the id.
        Route("/v1/models/{alias:path}", model, methods=["GET"]),
        Route("/status", status, methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/readyz", readyz, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/usage", usage, methods=["GET"]),
        Route("/usage/tail", usage_tail, methods=["GET"]),
        Route("/admin/refresh", refresh, methods=["POST"]),
        *provider_routes(edge.keys, lambda: edge.catalog, edge.registry, edge.nc),
        *key_routes(edge.keys, edge.managed_keys),
        *response_routes(edge),
        *ui_routes(edge.keys, edge.status_feed, ledger_on=ledger_on),
        *qualify_routes(edge, lambda: edge.qualify, lambda: encode_status(status_of(edge.status_sources))),
        *lifecycle_routes(edge.keys, lambda: edge.lifecycle),
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
        "/v1/responses/compact": CompactEndpoint(responses, ApiEndpoint(edge, "compact")),
        "/v1/messages": ApiEndpoint(edge, "messages"),
        "/v1/messages/count_tokens": CountTokensEndpoint(edge),
        "/v1/embeddings": ApiEndpoint(edge, "embeddings"),
        "/v1/completions": ApiEndpoint(edge, "completions"),
    }
    posts = frozenset(
        {
            "/v1/chat/completions",
            "/v1/responses/compact",
            "/v1/messages",
            "/v1/messages/count_tokens",
            "/v1/embeddings",
            "/v1/completions",
        }
    )
    hosts = HostAllowList.of(edge.current.deployment.edge)  # read once, like the keys
    return RequestIds(SameOrigin(Sockets(edge, responses, posts, ApiRoutes(api, app)), hosts))
