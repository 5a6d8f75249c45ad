"""WebSocket mode of `/v1/responses`: `response.create` events in, the streamed events out as JSON text frames.

As OpenAI serves it and Codex CLI uses it first (`OpenAI-Beta: responses_websockets=…`): the
client opens `GET /v1/responses` as a WebSocket with its key, then sends one `response.create`
event per turn (the request's fields beside `"type"`); each runs through the same path as an HTTP
request with `stream: true` (front, endpoint, queue, ledger), and every server-sent event it
produces goes out as one text frame. Responses run one after another; a message that arrives
while one runs waits its turn (up to `MAX_WAITING` of them).

The socket keeps its last response's input and output, so the next turn may send
`previous_response_id` and only the new items, with `store: false` too; a socket forgets it
when it closes. An id the socket did not make goes on to the endpoint as it is (the store, where
there is one, answers it). A client that closes the socket cancels the running response.

Refusals before the handshake (a wrong key, a path without WebSocket mode, a key that holds
`edge.responses.max_sockets_per_key` sockets already: 429) are HTTP answers of the usual shape;
a refused event after it is an `error` event, and the socket stays open.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

import msgspec
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from iop import config
from iop.edge import ws_turn
from iop.edge.bodies import ReceivingBodies
from iop.edge.observe import new_request_id
from iop.edge.responses_front import ResponsesFront
from iop.edge.ws_protocol import TEXTS
from iop.errors import (
    BadRequest,
    MethodNotAllowed,
    NotFound,
    RequestError,
    Unavailable,
    error_response,
)
from iop.responses.expand import Responses

MAX_WAITING = 16
"""`response.create` events a socket may send ahead of the one running (more closes it: 1008)."""
_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode
# The handshake's headers that describe the socket, not a request body.
_NOT_FORWARDED = frozenset(
    {b"content-length", b"content-type", b"upgrade", b"connection", b"sec-websocket-key", b"sec-websocket-version"}
)


class SocketEdge(Protocol):
    @property
    def catalog(self) -> config.Catalog: ...

    @property
    def bodies(self) -> ReceivingBodies: ...

    @property
    def responses(self) -> Responses: ...

    def authorize(self, scope: Scope) -> str: ...

    def owner(self, scope: Scope) -> str: ...


class Sockets:
    """WebSocket handshakes: `/v1/responses` gets its socket, every other path an HTTP refusal."""

    def __init__(self, edge: SocketEdge, front: ResponsesFront, posts: frozenset[str], app: ASGIApp) -> None:
        self.edge = edge
        self.front = front
        self.posts = posts
        """Paths that answer POST only: a handshake there is a 405 with `Allow: POST`."""
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "websocket":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        if path == "/v1/responses":
            await ResponsesSocket(self.edge, self.front, scope, receive, send).run()
        elif path in self.posts:
            await refuse(send, MethodNotAllowed(f"{path} has no WebSocket mode; use POST", headers={"Allow": "POST"}))
        else:
            await refuse(send, NotFound(f"no WebSocket endpoint at {path}; WebSocket mode is on /v1/responses"))


async def refuse(send: Send, exc: RequestError) -> None:
    """Refuse a handshake with the HTTP answer (status, headers, OpenAI error JSON) any request gets."""
    response = error_response(exc)
    headers = [(b"content-type", b"application/json")]
    headers += [(k.lower().encode(), v.encode()) for k, v in response.headers.items()]
    await send({"type": "websocket.http.response.start", "status": response.status, "headers": headers})
    await send({"type": "websocket.http.response.body", "body": response.body})


def error_frame(exc: RequestError) -> str:
    """A refused event's answer: OpenAI's WebSocket `error` event, with the HTTP status it would have had."""
    body = _decode(error_response(exc).body)
    return _encode({"type": "error", "status": exc.status, "error": body["error"]}).decode()


class _Last(msgspec.Struct):
    """The socket's last response: what a `previous_response_id` naming it stands for."""

    id: str
    items: bytes
    """Its input and output items, comma-joined JSON, as they came."""


class ResponsesSocket:
    """One WebSocket connection on `/v1/responses` (see the module's docstring)."""

    def __init__(self, edge: SocketEdge, front: ResponsesFront, scope: Scope, receive: Receive, send: Send) -> None:
        self.edge = edge
        self.front = front
        self.scope = scope
        self._receive = receive
        self.send = send
        self.waiting: deque[Message] = deque()
        self.held = 0
        """Bytes of the waiting events, counted in the edge's body budget (edge.queue.max_waiting_mb)."""
        self.closed = False
        self.last: _Last | None = None
        self.made: set[str] = set()
        """Every response id this socket made: an older one than the last is not found any more."""
        headers = [(k, v) for k, v in scope["headers"] if k not in _NOT_FORWARDED]
        self.headers = [*headers, (b"content-type", b"application/json")]

    async def run(self) -> None:
        connect = await self._receive()
        if connect["type"] != "websocket.connect":
            return
        sockets = self.edge.responses.caps.sockets
        try:
            self.edge.authorize(self.scope)
            owner = self.edge.owner(self.scope)
            sockets.take(owner)  # 429 past edge.responses.max_sockets_per_key
        except RequestError as exc:
            await refuse(self.send, exc)
            return
        try:
            await self.send({"type": "websocket.accept"})
            while not self.closed:
                message = self._next_waiting() if self.waiting else await self._receive()
                if message["type"] == "websocket.disconnect":
                    return
                if message["type"] == "websocket.receive":
                    await self.turn(message)
        finally:
            sockets.give(owner)
            self.edge.bodies.give(self.held)
            self.held = 0

    def _next_waiting(self) -> Message:
        message = self.waiting.popleft()
        size = _size(message)
        self.held -= size
        self.edge.bodies.give(size)
        return message

    async def turn(self, message: Message) -> None:
        """One client event: a response run to its end, or an `error` frame."""
        try:
            body, items = self.request_of(message)
        except RequestError as exc:
            await self.frame(error_frame(exc))
            return
        await self.respond(body, items)

    def request_of(self, message: Message) -> tuple[bytes, bytes]:
        """The event's request as the POST body to run, and its whole input's items (comma-joined JSON)."""
        text = message.get("text")
        fields = ws_turn.event_fields(text.encode() if isinstance(text, str) else message.get("bytes") or b"")
        previous = ws_turn.string_of(fields.get("previous_response_id"))
        items = ws_turn.items_of(fields.get("input"))
        if previous is None:
            return ws_turn.body_of(fields, None), items
        if self.last is not None and previous == self.last.id:
            # The socket's last response in front of the new input. OpenAI: the previous response's
            # instructions are not carried over; the new ones apply.
            items = ws_turn.joined(self.last.items, items)
            return ws_turn.body_of(fields, items), items
        if previous in self.made:
            raise BadRequest(
                f"previous response '{previous}' is not the last one on this socket; only the last is kept",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        return ws_turn.body_of(fields, None), items  # not this socket's: the endpoint (and the store) decide

    async def respond(self, body: bytes, items: bytes) -> None:
        """Run `body` through the Responses front, the texts of its events out as text frames."""
        scope = {**self.scope, "type": "http", "method": "POST", "headers": self.headers}
        scope["iop.request_id"] = new_request_id()
        events = ws_turn.SseFrames()
        status = 200
        refused: list[bytes] = []

        async def relay(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                return
            data = message.get("body", b"")
            if status != 200:
                refused.append(data)
                return
            texts = events.feed(data, message.get("more_body", False))
            if texts:
                await self.frames(texts)

        await self.front.serve(scope, body, self.receive_during, relay)
        if status != 200:
            await self.frame(_refused_frame(status, b"".join(refused)))
            return
        self.remember(items, ws_turn.ended_of(events.ended))

    def remember(self, items: bytes, ended: ws_turn.Ended | None) -> None:
        if ended is None:
            return
        self.made.add(ended.id)
        if ended.compaction:
            # A compaction answer replaces the window (and its trigger): what follows reads the summary.
            self.last = _Last(ended.id, ended.output)
        elif ended.status in ("completed", "incomplete"):
            self.last = _Last(ended.id, ws_turn.joined(items, ended.output))
        else:
            self.last = None

    async def receive_during(self) -> Message:
        """What the running response hears of the client: only that it left; its next events wait."""
        while True:
            message = await self._receive()
            if message["type"] == "websocket.disconnect":
                self.closed = True
                return {"type": "http.disconnect"}
            if len(self.waiting) >= MAX_WAITING:
                self.closed = True
                await self.send({"type": "websocket.close", "code": 1008, "reason": "too many events ahead"})
                return {"type": "http.disconnect"}
            # Waiting events hold memory as bodies being received do: the same budget bounds both.
            size = _size(message)
            try:
                self.edge.bodies.take(size)
            except Unavailable:
                self.closed = True
                reason = "too many bytes ahead (edge.queue.max_waiting_mb); try again later"
                await self.send({"type": "websocket.close", "code": 1013, "reason": reason})
                return {"type": "http.disconnect"}
            self.held += size
            self.waiting.append(message)

    async def frames(self, texts: list[bytes]) -> None:
        """Each text its own frame; together in one message where the connection takes a list."""
        if TEXTS in self.scope.get("extensions", {}):
            await self.frame(texts=texts)
            return
        for text in texts:
            await self.frame(text.decode())

    async def frame(self, text: str = "", texts: list[bytes] | None = None) -> None:
        if self.closed:
            return
        message = (
            {"type": "websocket.send", "text": text} if texts is None else {"type": "websocket.send", TEXTS: texts}
        )
        try:
            await self.send(message)
        except OSError:
            # The connection is gone (uvicorn's ClientDisconnected) before its disconnect was read:
            # the endpoint must not fail for it; the disconnect that follows cancels the response.
            self.closed = True


def _size(message: Message) -> int:
    text = message.get("text")
    if isinstance(text, str):
        return len(text)  # characters: close enough to bytes for a budget, and no copy
    data = message.get("bytes")
    return len(data) if isinstance(data, bytes) else 0


def _refused_frame(status: int, body: bytes) -> str:
    """The endpoint's error answer (OpenAI error JSON) as the socket's `error` event."""
    try:
        error = _decode(body).get("error")
    except (msgspec.DecodeError, AttributeError):
        error = None
    if not isinstance(error, dict):
        error = {"message": body.decode(errors="replace")[:500], "type": "server_error", "code": None}
    return _encode({"type": "error", "status": status, "error": error}).decode()
