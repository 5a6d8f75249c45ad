"""`/v1/responses/{id}`, its `input_items` and `cancel`: a client reads and removes its own stored responses.

A client key reaches only the responses it stored (another key's are 404, exactly as unknown
ones); an admin key may read and delete any, by id, and list them (`GET /admin/responses`, ids
and owner ids only). With the store off every id is unknown.
"""

from __future__ import annotations

import hashlib
from typing import Any, Protocol

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Scope

from iop.errors import BadRequest, NotFound
from iop.responses import background, live
from iop.responses.expand import Responses
from iop.responses.records import Stored
from iop.responses.replay import sse
from iop.responses.store import ResponseStore

_SSE = {"cache-control": "no-cache", "x-accel-buffering": "no"}
STREAM_WAIT_S = 600.0
"""How long `GET …?stream=true` follows a background response before it ends the stream."""


class Stateful(Protocol):
    """What these endpoints need from the edge."""

    @property
    def responses(self) -> Responses: ...

    def authorize(self, scope: Scope) -> str: ...

    def owner(self, scope: Scope) -> str: ...

    def is_admin(self, scope: Scope) -> bool:
        """The request carries an admin key."""
        ...

    def admin(self, scope: Scope) -> str:
        """Who asks for an admin action; Forbidden/Unauthorized for anyone else (iop/edge/keys.py)."""
        ...


def _not_found(response_id: str) -> NotFound:
    return NotFound(f"Response with id '{response_id}' not found.", code="not_found", param="response_id")


async def _find(edge: Stateful, request: Request) -> tuple[ResponseStore, str, Stored]:
    """The store, the owner and the stored response the path names; 404 for any other owner's."""
    response_id = request.path_params["response_id"]
    store = edge.responses.store
    if edge.is_admin(request.scope):
        owners = await store.owners_of(response_id) if store is not None else []
        owner = owners[0] if owners else ""
    else:
        edge.authorize(request.scope)
        owner = edge.owner(request.scope)
    stored = await store.response(owner, response_id) if store is not None and owner else None
    if store is None or stored is None:
        raise _not_found(response_id)
    return store, owner, stored


def _int(request: Request, name: str, default: int, low: int, high: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise BadRequest(f"{name} must be an integer", param=name) from None
    if not low <= value <= high:
        raise BadRequest(f"{name} must be between {low} and {high}", param=name)
    return value


def _item_id(response_id: str, index: int, item: dict[str, Any]) -> str:
    """An input item's id: its own, else one derived from its place (the same on every read)."""
    own = item.get("id")
    if isinstance(own, str):
        return own
    digest = hashlib.sha256(f"{response_id}\0{index}".encode()).hexdigest()[:24]
    return ("msg_" if item.get("type", "message") == "message" else "item_") + digest


def response_routes(edge: Stateful) -> list[Route]:
    async def get(request: Request) -> Response:
        store, owner, stored = await _find(edge, request)
        if request.query_params.get("stream") not in ("true", "1"):
            return JSONResponse(stored.response)
        after = _int(request, "starting_after", -1, -1, 1 << 31)
        if stored.response.get("status") in background.UNFINISHED:
            # Followed live from whichever edge runs it, to its end (iop/responses/live.py).
            async def finished(now: Stored, timeout_s: float) -> Stored:
                return await background.until_finished(edge.responses, owner, now, timeout_s)

            events = live.follow(store, owner, stored, after, STREAM_WAIT_S, finished)
            return StreamingResponse(events, media_type="text/event-stream", headers=_SSE)
        kept = [e for e in await live.stored_events(store, owner, stored) if e.get("sequence_number", -1) > after]
        return Response(sse(kept), media_type="text/event-stream", headers=_SSE)

    async def delete(request: Request) -> Response:
        store, owner, stored = await _find(edge, request)
        await store.delete(owner, str(stored.response.get("id")))
        return JSONResponse({"id": stored.response.get("id"), "object": "response", "deleted": True})

    async def input_items(request: Request) -> Response:
        _, _, stored = await _find(edge, request)
        order = request.query_params.get("order", "desc")
        if order not in ("asc", "desc"):
            raise BadRequest("order must be 'asc' or 'desc'", param="order")
        limit = _int(request, "limit", 20, 1, 100)
        response_id = str(stored.response.get("id"))
        items = [{**item, "id": _item_id(response_id, n, item)} for n, item in enumerate(stored.input)]
        if order == "desc":
            items.reverse()
        after = request.query_params.get("after")
        if after is not None:
            ids = [i["id"] for i in items]
            items = items[ids.index(after) + 1 :] if after in ids else []
        page = items[:limit]
        return JSONResponse(
            {
                "object": "list",
                "data": page,
                "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None,
                "has_more": len(items) > limit,
            }
        )

    async def cancel(request: Request) -> Response:
        _, owner, stored = await _find(edge, request)
        return JSONResponse(await background.cancel(edge.responses, owner, stored))

    async def listing(request: Request) -> Response:
        edge.admin(request.scope)
        limit = _int(request, "limit", 100, 1, 10_000)
        store = edge.responses.store
        owner = request.query_params.get("owner")
        found, more = await store.listing(limit, owner) if store is not None else ([], False)
        data = [{"id": response_id, "object": "response", "owner": who} for who, response_id in found]
        return JSONResponse({"object": "list", "data": data, "has_more": more})

    return [
        Route("/admin/responses", listing, methods=["GET"]),
        Route("/v1/responses/{response_id}", get, methods=["GET"]),
        Route("/v1/responses/{response_id}", delete, methods=["DELETE"]),
        Route("/v1/responses/{response_id}/input_items", input_items, methods=["GET"]),
        Route("/v1/responses/{response_id}/cancel", cancel, methods=["POST"]),
    ]
