"""Administrators' actions on one provider, passed to its node: `POST /admin/providers/{id}/restart`.

The node does the work (it runs the model server); the edge checks the admin key and the provider,
and publishes on the node's control subject, which only edges may publish to (iop/nats/auth.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import msgspec
import nats.errors
from nats.aio.client import Client as NATS
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from iop import config, wire
from iop.edge.keys import EdgeKeys
from iop.edge.registry import Registry
from iop.errors import BadRequest, NotFound, Unavailable

log = logging.getLogger("iop.edge")

CONTROL_TIMEOUT_S = 5.0


def provider_routes(keys: EdgeKeys, catalog: Callable[[], config.Catalog], registry: Registry, nc: NATS) -> list[Route]:
    """The admin routes on one provider (`catalog()` is read per request: a refresh changes it)."""

    async def restart(request: Request) -> Response:
        admin = keys.admin(request.scope)
        provider = request.path_params["provider"]
        ref = catalog().providers.get(provider)
        if ref is None:
            raise NotFound(f"no provider {provider!r} in the deployment", code="provider_not_found", param="provider")
        if ref.is_cli:
            raise BadRequest(f"{provider!r} is a CLI resource: it has no model server to restart", code="no_server")
        node = ref.node.id
        if not registry.connected(node):
            raise Unavailable(f"node {node!r} of {provider!r} is not connected", code="node_not_connected")
        ask = wire.encode(wire.Control(provider=provider, action="restart"))
        try:
            reply = await nc.request(wire.control_subject(node), ask, timeout=CONTROL_TIMEOUT_S)
            answer = wire.decode_control_reply(reply.data)
        except (nats.errors.Error, TimeoutError, msgspec.DecodeError) as exc:
            raise Unavailable(f"node {node!r} did not answer: {type(exc).__name__}", code="node_not_answering") from exc
        if not answer.ok:
            raise BadRequest(answer.message, code="no_server")
        log.warning("admin %s: restart of provider %s on node %s", admin, provider, node)
        body = {"provider": provider, "node": node, "restarting": True, "message": answer.message}
        return Response(msgspec.json.encode(body), media_type="application/json")

    return [Route("/admin/providers/{provider}/restart", restart, methods=["POST"])]
