"""What the edge answers itself on `/v1/responses`: warm-ups, compaction, and compaction items in input.

Everything else passes through to the endpoint untouched, with the head read here (heads.KNOWN).
A request this module cannot read, or that the endpoint would refuse (no key, wrong content type,
unknown model), also passes through, so it is refused in one place and the same way as any other.

- `generate: false` (Codex's warm-up at the start of a session): a completed response with no
  output, at once, with no upstream call and no slot; stored like any response (its input is
  what a next turn's `previous_response_id` continues).
- A request whose input ends with `compaction_trigger` (Codex's remote compaction) and
  `POST /v1/responses/compact`: the model summarises the window (iop/openai/compaction.py) through
  the endpoint, like any request (queue, capacity, ledger), and the answer holds one sealed
  `compaction` item, sealed for the client key that asked. A trigger's answer is stored as a
  conversation of its own: continuing it gives the model the summary alone.
- `compaction` items in a request's input are opened and given to the model as the summary.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any, Protocol

import msgspec
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from iop import config, endpoints
from iop.edge import heads
from iop.edge.asgi import check_content_type
from iop.edge.bodies import ReceivingBodies
from iop.errors import (
    BadRequest,
    ErrorResponse,
    MethodNotAllowed,
    NotFound,
    RequestError,
    Unavailable,
    UpstreamError,
    error_response,
)
from iop.openai import compaction
from iop.openai.responses_events import ResponseEvents, new_id
from iop.openai.usage import Usage, responses_usage, usage_from_responses
from iop.responses.expand import Responses, Turn

_JSON = [(b"content-type", b"application/json")]
_SSE = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]
_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode
_NO_USAGE = Usage(input_tokens=0, output_tokens=0)


class FrontEdge(Protocol):
    """What the front reads of the edge (on every request, so a refresh applies)."""

    @property
    def catalog(self) -> config.Catalog: ...
    @property
    def max_body_bytes(self) -> int: ...
    @property
    def sealer(self) -> compaction.Sealer: ...
    @property
    def bodies(self) -> ReceivingBodies: ...
    @property
    def responses(self) -> Responses: ...

    def authorize(self, scope: Scope) -> str: ...

    def owner(self, scope: Scope) -> str: ...


class Relayed(Exception):
    """The endpoint refused an inner request: its answer goes to the client as it is."""

    def __init__(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        super().__init__(status)
        self.status = status
        self.headers = headers
        self.body = body


class ResponsesFront:
    """`POST /v1/responses` before the endpoint (see the module's docstring)."""

    def __init__(self, edge: FrontEdge, endpoint: ASGIApp) -> None:
        self.edge = edge
        self.endpoint = endpoint

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.endpoint(scope, receive, send)
            return
        body, seen = await buffer_body(scope, receive, self.edge.max_body_bytes, self.edge.bodies)
        if body is None:
            # Over the limit (or the client left): the endpoint's own check says which.
            await self.endpoint(scope, replaying(seen, receive), send)
            return
        del seen
        await self.serve(scope, body, receive, send)

    async def serve(self, scope: Scope, body: bytes, receive: Receive, send: Send) -> None:
        """Answer the POST whose whole body is `body` (read already: `receive` gives what the client
        says next). iop/edge/websocket.py runs each of its turns here."""
        request = self._owned(scope, body)
        if request is None:
            # A whole body goes on as the one message it is: the endpoint need not join pieces again.
            await self.endpoint(scope, replaying([_whole(body)], receive), send)
            return
        owner = self.edge.owner(scope)
        try:
            if request.get("generate") is False:
                # Kept as its request's turn: the next one may continue it with previous_response_id.
                turn = await self.edge.responses.expand(request, owner, self.edge.max_body_bytes)
                await send_response(send, request, [], _NO_USAGE, self.edge.responses, owner, turn)
                return
            if compaction.has_compaction(request):
                native = endpoints.compacts_natively(self.edge.catalog, str(request.get("model")))
                request = compaction.expand(request, self.edge.sealer, owner, foreign=native)
            if compaction.ends_with_trigger(request):
                items = (compaction.input_items(request) or [])[:-1]
                sealed, usage = await self.summarise(scope, receive, request, items)
                # Kept as the start of a conversation: what follows it reads the summary, not the
                # window it replaces (nor the trigger).
                kept = request.get("store", True) is True and self.edge.responses.store is not None
                turn = Turn({}, [], None, kept)
                item = compaction.compaction_item(sealed)
                await send_response(send, request, [item], usage, self.edge.responses, owner, turn)
                return
            await call_endpoint(self.endpoint, scope, receive, _encode(request), send)
        except Relayed as answer:
            await send({"type": "http.response.start", "status": answer.status, "headers": answer.headers})
            await send({"type": "http.response.body", "body": answer.body})
        except RequestError as exc:
            await send_error(send, error_response(exc))

    def _owned(self, scope: Scope, body: bytes) -> dict[str, Any] | None:
        """The request, when it is one for this module; None sends it to the endpoint as it came.

        The body's head is read once, here: one it passes on goes with it for the endpoint
        (heads.KNOWN). Two substring searches of the body cost twice that read (0.7 ms at 800 KB)."""
        try:
            known = heads.responses_head(body)
        except RequestError:
            return None  # refused by the endpoint, the way it refuses any other
        if not known[0].for_front():
            scope[heads.KNOWN] = (body, known)
            return None
        try:
            request = _decode(body)
        except msgspec.DecodeError:
            return None
        if not isinstance(request, dict) or not self.acceptable(scope, request):
            return None
        return request

    def acceptable(self, scope: Scope, request: dict[str, Any]) -> bool:
        """Whether the endpoint would take this request (key, content type, a model it serves)."""
        try:
            self.edge.authorize(scope)
            check_content_type(scope)
        except RequestError:
            return False
        model = request.get("model")
        catalog = self.edge.catalog
        return isinstance(model, str) and (model in catalog.pools or model in catalog.routes)

    async def summarise(
        self, scope: Scope, receive: Receive, request: dict[str, Any], items: list[Any]
    ) -> tuple[str, Usage]:
        """Have the model summarise `items` through the endpoint; the sealed summary and its usage."""
        status, headers, body = await collect(
            self.endpoint, scope, receive, _encode(compaction.summary_request(request, items))
        )
        if status != 200:
            raise Relayed(status, headers, body)
        response = _decode(body)
        text = compaction.summary_text(response) if isinstance(response, dict) else ""
        if not text:
            raise UpstreamError("the model answered the compaction request with no summary", code="empty_summary")
        usage = response.get("usage") if isinstance(response, dict) else None
        return self.edge.sealer.seal(text, self.edge.owner(scope)), usage_from_responses(usage) if isinstance(
            usage, dict
        ) else _NO_USAGE


class CompactEndpoint:
    """`POST /v1/responses/compact`: the window's user messages and one sealed compaction item."""

    def __init__(self, front: ResponsesFront, native: ASGIApp) -> None:
        self.front = front
        self.native = native
        """The endpoint that passes the request to the upstream (a pool whose every upstream compacts)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        edge = self.front.edge
        try:
            edge.authorize(scope)
            if scope["method"] != "POST":
                raise MethodNotAllowed("use POST", headers={"Allow": "POST"})
            check_content_type(scope)
            body, seen = await buffer_body(scope, receive, edge.max_body_bytes, edge.bodies)
            if body is None:
                # Over the limit (or the client left): the endpoint's own check says which.
                await self.front.endpoint(scope, replaying(seen, receive), send)
                return
            request = _decode(body)
            if not isinstance(request, dict):
                raise BadRequest("the request body must be a JSON object")
            if not isinstance(request.get("model"), str):
                raise BadRequest("'model' is required and must be a string", param="model")
            if not self.front.acceptable(scope, request):
                raise NotFound(
                    f"model '{request['model']}' does not exist; GET /v1/models lists the models", param="model"
                )
            if endpoints.compacts_natively(edge.catalog, request["model"]):
                # Each upstream compacts itself: the request goes as it came, its state expanded by the endpoint.
                opened = compaction.expand(request, edge.sealer, edge.owner(scope), foreign=True)
                await call_endpoint(self.native, scope, replaying([], receive), _encode(opened), send, scope["path"])
                return
            original = _window(request)
            expanded = compaction.opened(original, edge.sealer, edge.owner(scope))
            sealed, usage = await self.front.summarise(scope, replaying([], receive), request, expanded)
            answer = {
                "id": new_id("resp_"),
                "object": "response.compaction",
                "created_at": int(time.time()),
                "output": [*compaction.kept_user_messages(original), compaction.compaction_item(sealed)],
                "usage": responses_usage(usage),
            }
            await send({"type": "http.response.start", "status": 200, "headers": _JSON})
            await send({"type": "http.response.body", "body": _encode(answer)})
        except msgspec.DecodeError as exc:
            await send_error(
                send, error_response(BadRequest(f"request body is not valid JSON: {exc}", code="invalid_json"))
            )
        except Relayed as answer:
            await send({"type": "http.response.start", "status": answer.status, "headers": answer.headers})
            await send({"type": "http.response.body", "body": answer.body})
        except RequestError as exc:
            await send_error(send, error_response(exc))


def _window(request: dict[str, Any]) -> list[Any]:
    items = request.get("input")
    if isinstance(items, str):
        return [compaction.user_message(items)]
    if items is None and isinstance(request.get("previous_response_id"), str):
        return []  # the window is the stored chain alone
    if not isinstance(items, list) or not items:
        raise BadRequest("'input' must be a string or a non-empty list of items", param="input")
    return items


async def send_response(
    send: Send,
    request: dict[str, Any],
    items: list[dict[str, Any]],
    usage: Usage,
    responses: Responses,
    owner: str,
    turn: Turn,
) -> None:
    """A whole response the edge made itself, streamed or not as the request asked, and kept as
    `turn` (when it is to be kept) before the client hears of it."""
    events = ResponseEvents(request, str(request.get("model")))
    previous = request.get("previous_response_id")
    events.response.update(store=turn.store, previous_response_id=previous if isinstance(previous, str) else None)
    stream = events.finish_items(items, usage)
    await responses.keep(owner, turn, events.response)
    if request.get("stream") is True:
        await send({"type": "http.response.start", "status": 200, "headers": _SSE})
        await send({"type": "http.response.body", "body": stream})
        return
    await send({"type": "http.response.start", "status": 200, "headers": _JSON})
    await send({"type": "http.response.body", "body": _encode(events.response)})


async def send_error(send: Send, response: ErrorResponse) -> None:
    extra = [(k.lower().encode(), v.encode()) for k, v in response.headers.items()]
    await send({"type": "http.response.start", "status": response.status, "headers": _JSON + extra})
    await send({"type": "http.response.body", "body": response.body})


async def buffer_body(
    scope: Scope, receive: Receive, limit: int, bodies: ReceivingBodies | None = None
) -> tuple[bytes | None, list[Message]]:
    """The request body and the messages it came in; None when it is over `limit`, over the edge's
    budget for bodies (`bodies`, edge.queue.max_waiting_mb) or the client left.

    Nothing past either is read: the messages go back to the endpoint, which refuses the body the
    way it refuses every other (its own count of them meets the same budget). While it arrives the
    body is counted in `bodies`, and given back once read: the endpoint counts it again.
    """
    for name, value in scope["headers"]:
        if name == b"content-length" and value.isdigit() and int(value) > limit:
            return None, []
    seen: list[Message] = []
    size = 0
    try:
        while True:
            message = await receive()
            seen.append(message)
            if message["type"] != "http.request":
                return None, seen
            chunk = len(message.get("body", b""))
            if size + chunk > limit:
                return None, seen
            if bodies is not None:
                try:
                    bodies.take(chunk)
                except Unavailable:
                    return None, seen
            size += chunk
            if not message.get("more_body", False):
                return b"".join(m.get("body", b"") for m in seen), seen
    finally:
        if bodies is not None:
            bodies.give(size)


def _whole(body: bytes) -> Message:
    return {"type": "http.request", "body": body, "more_body": False}


def replaying(messages: list[Message], receive: Receive) -> Receive:
    """A receive that gives `messages` first, then the client's own (its disconnect, above all)."""
    pending = deque(messages)

    async def replay() -> Message:
        if pending:
            return pending.popleft()
        return await receive()

    return replay


async def call_endpoint(
    app: ASGIApp, scope: Scope, receive: Receive, body: bytes, send: Send, path: str = "/v1/responses"
) -> None:
    """Run `body` through the endpoint as a POST of this connection (its key, its request id).

    `receive` must already have given the client's body: what it gives next (a disconnect) is the
    client's, so a client that leaves cancels the inner request too.
    """
    headers = [(k, v) for k, v in scope["headers"] if k != b"content-length"]
    inner = {**scope, "method": "POST", "path": path, "headers": headers}
    given = False

    async def inner_receive() -> Message:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    await app(inner, inner_receive, send)


async def collect(
    app: ASGIApp, scope: Scope, receive: Receive, body: bytes
) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """The whole answer of an inner request: status, headers, body."""
    status = 500
    headers: list[tuple[bytes, bytes]] = []
    parts: list[bytes] = []

    async def keep(message: Message) -> None:
        nonlocal status, headers
        if message["type"] == "http.response.start":
            status = message["status"]
            headers = list(message.get("headers", []))
        elif message["type"] == "http.response.body":
            parts.append(message.get("body", b""))

    await call_endpoint(app, scope, receive, body, keep)
    return status, headers, b"".join(parts)
