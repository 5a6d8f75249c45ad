"""The OpenAI endpoints (`/v1/chat/completions`, `/v1/responses`) as one lean ASGI handler."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any, Literal, NamedTuple, Protocol

import msgspec
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from iop import config, endpoints, wire
from iop.anthropic import errors as anthropic_errors
from iop.edge import heads
from iop.edge.bodies import ReceivingBodies
from iop.edge.dispatch import DirectDispatch, PoolDispatch
from iop.edge.observe import REQUEST_ID, Observer, Trace, new_request_id
from iop.edge.relay import Channel, Relay
from iop.edge.scheduler import Scheduler
from iop.errors import (
    BadRequest,
    ErrorResponse,
    MethodNotAllowed,
    NotFound,
    PayloadTooLarge,
    RequestError,
    UnsupportedMediaType,
    error_event,
    error_response,
)
from iop.openai.responses_request import responses_to_chat_request
from iop.responses import background
from iop.responses.expand import Responses, Turn
from iop.responses.tap import KeepingSend

_JSON = [(b"content-type", b"application/json")]
_SSE = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]


# The edge checks the types of the fields iop itself reads or translates (on the node: the
# translations, the mock's writer), so that a client's wrongly typed field is a 400 naming it here,
# never a crash on a node that would count against the provider. Everything else passes through
# unread; empty Structs check "an object" without decoding its contents.


class _Object(msgspec.Struct):
    """Any JSON object (its fields unread)."""


class _ToolCall(msgspec.Struct):
    function: _Object | None = None


class _Message(msgspec.Struct):
    """A chat message as far as the edge checks it: an object with a string `role`."""

    role: str
    tool_calls: list[_ToolCall] | None = None


class _Item(msgspec.Struct):
    """A Responses input item as far as the edge checks it: an object, its `type` a string."""

    type: str | None = None


class ChatHead(msgspec.Struct):
    """The few fields of a chat request the edge reads; the body itself passes through untouched."""

    model: str
    messages: list[_Message]
    stream: bool = False
    tools: list[_Object] | None = None
    prompt_cache_key: str | None = None
    user: str | None = None
    """Chat clients without a `prompt_cache_key` often name the session's user: a session key too."""


class ResponsesHead(msgspec.Struct):
    model: str
    input: str | list[_Item]
    stream: bool = False
    tools: list[_Object] | None = None
    include: list[str] | None = None
    prompt_cache_key: str | None = None
    store: bool | None = None
    previous_response_id: str | None = None

    def stateful(self) -> bool:
        """The request names or makes state the edge holds (iop/responses): it is expanded first."""
        if self.store is not False or self.previous_response_id is not None:
            return True
        return not isinstance(self.input, str) and any(i.type == "item_reference" for i in self.input)


_chat_head = msgspec.json.Decoder(ChatHead).decode
_responses_head = msgspec.json.Decoder(ResponsesHead).decode
_decode_json = msgspec.json.Decoder().decode
_encode_json = msgspec.json.Encoder().encode


class Head(NamedTuple):
    model: str
    stream: bool
    cache_key: str | None
    """`prompt_cache_key`: the client's session key (prefix-cache affinity)."""
    user: str | None
    """Chat's `user`: the session key of last resort (after the session-id headers)."""
    stateful: bool = False
    """A Responses request the edge expands and whose answer it may keep (iop/responses)."""


def parse_head(api: wire.Api, body: bytes) -> Head:
    """The model, stream flag and session key, after checking the body is a request of this API at all."""
    if not body.isascii():
        # The edge skips most of the body; make sure what it forwards is UTF-8 all through.
        try:
            body.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise BadRequest(f"request body is not valid UTF-8 (byte {exc.start})", code="invalid_json") from None
    try:
        if api == "chat":
            chat = _chat_head(body)
            if not chat.messages:
                raise BadRequest("'messages' must not be empty", param="messages")
            return Head(chat.model, chat.stream, chat.prompt_cache_key, chat.user)
        if api == "responses":
            resp = _responses_head(body)
            return Head(resp.model, resp.stream, resp.prompt_cache_key, None, resp.stateful())
        model, stream, user = heads.other_head(api, body)
        return Head(model, stream, None, user)
    except msgspec.ValidationError as exc:
        raise BadRequest(f"invalid request body: {_path_message(exc)}", param=_param(exc)) from None
    except msgspec.DecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}", code="invalid_json") from None
    except RecursionError:
        # msgspec recurses once per nesting level, even in the parts it skips.
        raise BadRequest("request body is nested too deeply", code="invalid_json") from None


def _path_message(exc: msgspec.ValidationError) -> str:
    return str(exc).replace("`$.", "`").replace(" - at `$`", "")


def _param(exc: msgspec.ValidationError) -> str | None:
    msg = str(exc)
    if "`$." in msg:
        return msg.split("`$.", 1)[1].split("`", 1)[0]
    if "missing required field `" in msg:
        return msg.split("missing required field `", 1)[1].split("`", 1)[0]
    return None


class Serving(Protocol):
    """What a request needs from the edge; read on every request, so a refresh's switch applies."""

    @property
    def edge_id(self) -> str: ...
    @property
    def catalog(self) -> config.Catalog: ...
    @property
    def queue_timeout_s(self) -> float: ...
    @property
    def max_body_bytes(self) -> int: ...
    @property
    def bodies(self) -> ReceivingBodies: ...
    @property
    def scheduler(self) -> Scheduler: ...
    @property
    def relay(self) -> Relay: ...
    @property
    def observer(self) -> Observer: ...
    @property
    def responses(self) -> Responses: ...

    def authorize(self, scope: Scope) -> str:
        """The client key's name ("" without keys); raises Unauthorized."""
        ...

    def owner(self, scope: Scope) -> str:
        """The id stored responses of this request's client key are filed under (iop/responses/store.py)."""
        ...


class ApiEndpoint:
    """One OpenAI API endpoint. Plain ASGI: the request path is measured, so nothing runs twice."""

    def __init__(self, edge: Serving, api: wire.Api) -> None:
        self.edge = edge
        self.api: wire.Api = api

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # Every request leaves one record when it ends, whatever happens to it (the dispatch, when
        # there is one, hands its result to the trace): requests refused before any dispatch count too.
        trace = Trace(scope.get("iop.request_id") or new_request_id(), self.api)
        out = _TrackedSend(send, trace)
        try:
            # The key first: a caller without one learns nothing, and leaves no ledger record.
            trace.key = self.edge.authorize(scope)
            if scope["method"] != "POST":
                raise MethodNotAllowed(f"{scope['method']} {scope['path']}: use POST", headers={"Allow": "POST"})
            check_content_type(scope)
            body = await read_body(scope, receive, self.edge.max_body_bytes, self.edge.bodies)
            trace.bytes_in = len(body)
            model, stream, cache_key, user, stateful = parse_head(self.api, body)
            trace.stream = stream
            session = cache_key or _session_header(scope) or user
            if stateful:
                body, turn, owner = await self._expand(scope, body, stream, out)
                if turn.background and not stream:
                    await self._background(body, model, session, owner, turn, out)
                    return
            await self._serve(body, model, stream, receive, out, session)
        except RequestError as exc:
            trace.error = exc.code
            if not trace.alias:
                trace.refused_at(scope["method"], scope.get("raw_path") or scope["path"].encode())
            if not out.started:
                await send_error(out, self._error_response(exc, trace.id))
        except ClientLeft:
            trace.cancelled = True  # its access line (499) is the one line this leaves in the log
        except asyncio.CancelledError:
            trace.cancelled = True
            raise
        finally:
            self._finished(trace, out.started)

    async def _expand(self, scope: Scope, body: bytes, stream: bool, out: _TrackedSend) -> tuple[bytes, Turn, str]:
        """The stateless request to dispatch; the answer's send then keeps and echoes the state."""
        responses = self.edge.responses
        owner = self.edge.owner(scope)
        request = _decode_json(body)
        turn = await responses.expand(request, owner)
        turn.request = request
        out.send = KeepingSend(out.send, responses, owner, turn, stream)
        return _encode_json(turn.body), turn, owner

    async def _background(
        self, body: bytes, model: str, session: str | None, owner: str, turn: Turn, out: _TrackedSend
    ) -> None:
        """Answer `queued` now; the request runs in a task with its own trace (iop/responses/background.py)."""
        edge = self.edge
        if model not in edge.catalog.pools and model not in edge.catalog.routes:
            raise NotFound(f"model '{model}' does not exist; GET /v1/models lists the models", param="model")
        queued = await background.queue(edge.responses, owner, turn, turn.request, model)
        trace = Trace(new_request_id(), self.api)
        trace.key = out.trace.key
        keeper = KeepingSend(_discard, edge.responses, owner, turn, False)
        inner = _TrackedSend(keeper, trace)
        never = asyncio.Event()

        async def no_client() -> Message:
            await never.wait()  # nobody waits on a background response: only a cancel ends it early
            return {"type": "http.disconnect"}

        async def work() -> None:
            try:
                await self._serve(body, model, False, no_client, inner, session)
                if edge.responses.stopping and not keeper.kept:
                    await background.abandoned(edge.responses, owner, turn, queued)
            except RequestError as exc:
                trace.error = exc.code
                await background.failed(edge.responses, owner, turn, queued, exc)
            finally:
                self._finished(trace, inner.started)

        background.run(edge.responses, queued["id"], work())
        await out({"type": "http.response.start", "status": 200, "headers": _JSON})
        await out({"type": "http.response.body", "body": _encode_json(queued)})

    def _error_response(self, exc: RequestError, request_id: str) -> ErrorResponse:
        """The error in the shape of the API called: Anthropic's for Messages, OpenAI's for the rest."""
        if self.api == "messages":
            return anthropic_errors.error_response(exc, request_id)
        return error_response(exc)

    def _finished(self, trace: Trace, responded: bool) -> None:
        res = trace.result
        if res is not None:
            if res.error is not None and not trace.error:
                trace.error = res.error.code  # a stream that failed after it began
            trace.cancelled |= res.outcome == "cancelled"
        if trace.cancelled:
            if not responded:
                trace.status = 499  # the client closed the request before any answer (nginx's code)
            trace.error = trace.error or "client_cancelled"
        self.edge.observer.finish(trace)

    async def _serve(
        self, body: bytes, model: str, stream: bool, receive: Receive, out: _TrackedSend, session: str | None
    ) -> None:
        edge = self.edge
        if model not in edge.catalog.pools and model not in edge.catalog.routes:
            raise NotFound(f"model '{model}' does not exist; GET /v1/models lists the models", param="model")
        out.trace.alias = model
        endpoints.check(edge.catalog, model, self.api)
        if self.api == "responses" and model in edge.catalog.pools:
            check_mixed_pool(edge.catalog, model, body)
        task = asyncio.current_task()
        assert task is not None
        watcher = asyncio.create_task(_watch_disconnect(receive, task))
        try:
            if model in edge.catalog.pools:
                await self._serve_pool(body, model, stream, out, session)
            else:
                await self._serve_direct(body, model, stream, out)
        except asyncio.CancelledError:
            # The client went away (the watcher cancelled us): the relay cancels the node's work.
            out.trace.cancelled = True
            if task.cancelling():
                task.uncancel()
        finally:
            watcher.cancel()

    def _item(self, ch: Channel, body: bytes, model: str, stream: bool, request_id: str) -> wire.WorkItem:
        edge = self.edge
        return wire.WorkItem(
            request_id=request_id,
            id=ch.id,
            api=self.api,
            stream=stream,
            alias=model,
            body=body,
            reply_to=edge.relay.reply_to(ch),
            deadline=time.time() + edge.queue_timeout_s,
            edge=edge.edge_id,
        )

    async def _serve_pool(self, body: bytes, model: str, stream: bool, out: _TrackedSend, session: str | None) -> None:
        """Queue for a slot, dispatch, relay; the dispatch owns the slot and fails over."""
        edge = self.edge
        arrived = asyncio.get_running_loop().time()
        deadline = arrived + edge.queue_timeout_s
        trace = out.trace
        dispatch = PoolDispatch(
            edge.scheduler,
            edge.relay,
            model,
            deadline,
            on_finished=trace.dispatched,
            sessions=edge.scheduler.sessions,
            session=session,
            affinity_wait_s=edge.catalog.affinity_wait_s.get(model, 0.0),
            size=len(body),
        )

        async def answer(ch: Channel, provider: str) -> RequestError | None:
            trace.model = _upstream_model(edge, provider, model)
            return await self._answer(ch, provider, stream, out, arrived, deadline)

        await dispatch.run(lambda ch: self._item(ch, body, model, stream, trace.id), answer, lambda: out.started)

    async def _serve_direct(self, body: bytes, model: str, stream: bool, out: _TrackedSend) -> None:
        edge = self.edge
        node, resource = edge.catalog.routes[model]
        arrived = asyncio.get_running_loop().time()
        trace = out.trace
        trace.model = _upstream_model(edge, resource, model)
        dispatch = DirectDispatch(edge.relay, model, node, resource, on_finished=trace.dispatched)

        async def answer(ch: Channel, provider: str) -> RequestError | None:
            return await self._answer(ch, provider, stream, out, arrived, None)

        await dispatch.run(lambda ch: self._item(ch, body, model, stream, trace.id), answer)

    async def _answer(
        self, ch: Channel, provider: str, stream: bool, out: _TrackedSend, arrived: float, start_deadline: float | None
    ) -> RequestError | None:
        replies = self.edge.relay.replies(ch, start_deadline)
        try:
            if stream:
                return await _relay_stream(self.api, replies, out, provider, arrived, ch)
            await _relay_whole(replies, out, provider, arrived, ch)
        except RequestError as exc:
            exc.headers.setdefault("x-iop-provider", provider)  # who failed or refused (e.g. a translation)
            raise
        return None


def check_mixed_pool(catalog: config.Catalog, alias: str, body: bytes) -> None:
    """Refuse here what a chat-only provider of a mixed pool would refuse (e.g. previous_response_id).

    A pool of chat-only and Responses providers must give a request the same answer whichever
    provider it lands on; the edge decides before it picks one. Pools that are all one kind decide
    on the node, the same way on every provider, and cost the edge nothing.
    """
    members = catalog.pools[alias]
    translating = [p for p in members if _translates_responses(catalog.providers[p].adapter)]
    if not translating or len(translating) == len(members):
        return
    try:
        responses_to_chat_request(_decode_json(body), alias)
    except RequestError as exc:
        exc.headers.setdefault("x-iop-provider", translating[0])
        raise


def _translates_responses(adapter: config.Adapter) -> bool:
    own = endpoints.native(adapter)
    return isinstance(adapter, config.OpenAIAdapter) and "responses" not in own and "chat" in own


def _upstream_model(edge: Serving, provider: str, alias: str) -> str:
    ref = edge.catalog.providers.get(provider)
    return (ref.provider.model if ref is not None else None) or alias


class _TrackedSend:
    """The ASGI send, remembering whether the response has started (then nothing can be retried),
    and noting status, first byte and bytes out in the request's trace."""

    def __init__(self, send: Send, trace: Trace) -> None:
        self.send = send
        self.started = False
        self.trace = trace

    async def __call__(self, message: Message) -> None:
        trace = self.trace
        if message["type"] == "http.response.start":
            self.started = True
            trace.status = message["status"]
        else:
            size = len(message.get("body", b""))
            if size:
                if not trace.first_byte:
                    trace.first_byte = time.monotonic()
                trace.bytes_out += size
        await self.send(message)


class ApiRoutes:
    """The OpenAI endpoints straight from the server; every other path through the Starlette app.

    They are the only paths a burst of clients waits on. Starlette's router, its exception and
    server-error middlewares and their coroutines cost each waiting request about 3 KB and every
    request some CPU, for nothing these endpoints use: each checks its own method and turns its own
    errors into OpenAI error JSON (docs/performance.md, issue 19).
    """

    def __init__(self, endpoints: dict[str, ASGIApp], app: ASGIApp) -> None:
        self.endpoints = endpoints
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            endpoint = self.endpoints.get(scope["path"])
            if endpoint is not None:
                await endpoint(scope, receive, send)
                return
        await self.app(scope, receive, send)


class RequestIds:
    """Every answer carries `x-request-id`: the client's when it is safe to log and forward, else 400."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = None
        for name, value in scope["headers"]:
            if name == b"x-request-id":
                rid = value.decode("latin-1")
                break
        if rid is None:
            rid = new_request_id()
        elif not REQUEST_ID.match(rid):
            refused = BadRequest(
                "x-request-id must be 1 to 128 characters of A-Z a-z 0-9 . _ : @ / + = -",
                code="invalid_request_id",
                param="x-request-id",
                headers={"x-request-id": new_request_id()},
            )
            await send_error(send, error_response(refused))
            return
        scope["iop.request_id"] = rid
        header = (b"x-request-id", rid.encode())

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), header]
            await send(message)

        await self.app(scope, receive, send_with_id)


async def _discard(message: Message) -> None:
    """The send of a request nobody waits on (a background response: its answer goes to the store)."""


def _timing_headers(provider: str, arrived: float, started: float) -> list[tuple[bytes, bytes]]:
    # `arrived` is the loop's clock, `started` time.monotonic(): asyncio's loop clock is that one.
    queue_ms = max(0.0, (started - arrived) * 1000) if started else 0.0
    return [(b"x-iop-provider", provider.encode()), (b"x-iop-queue-ms", f"{queue_ms:.1f}".encode())]


def _node_headers(ch: Channel) -> list[tuple[bytes, bytes]]:
    """The headers the node asked for with its answer (e.g. x-iop-dropped-tools)."""
    return [(k.lower().encode(), v.encode()) for k, v in ch.headers.items()]


async def _relay_whole(replies: AsyncIterator[bytes], send: Send, provider: str, arrived: float, ch: Channel) -> None:
    parts = [data async for data in replies]
    started = ch.started_mono
    body = parts[0] if len(parts) == 1 else b"".join(parts)
    headers = _JSON + _timing_headers(provider, arrived, started) + _node_headers(ch)
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _relay_stream(
    api: wire.Api, replies: AsyncIterator[bytes], send: Send, provider: str, arrived: float, ch: Channel
) -> RequestError | None:
    """Relay an SSE answer; returns the error it ended with once the response had started."""
    # Wait for the first bytes before answering 200: a failure before them is a clean HTTP error.
    it = replies.__aiter__()
    try:
        first = await it.__anext__()
    except StopAsyncIteration:
        first = b""
    headers = _SSE + _timing_headers(provider, arrived, ch.started_mono) + _node_headers(ch)
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": first, "more_body": True})
    failed: RequestError | None = None
    try:
        async for data in it:
            await send({"type": "http.response.body", "body": data, "more_body": True})
    except RequestError as exc:
        # Started streams end with an error event the client sees, never a silent cut.
        failed = exc
        if not exc.ended_stream:
            event = anthropic_errors.error_event(exc) if api == "messages" else error_event(_openai(api), exc)
            await send({"type": "http.response.body", "body": event, "more_body": True})
    await send({"type": "http.response.body", "body": b""})
    return failed


def _openai(api: wire.Api) -> Literal["chat", "responses"]:
    """The OpenAI error event shape for a stream of `api` (completions streams are chat-like)."""
    return "responses" if api == "responses" else "chat"


async def _watch_disconnect(receive: Receive, task: asyncio.Task[Any]) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            task.cancel()
            return


def _session_header(scope: Scope) -> str | None:
    """The `session-id` / `x-session-id` header (Codex sends one per session; Claude Code
    `x-claude-code-session-id`), if any."""
    for name, value in scope["headers"]:
        if name == b"session-id" or name == b"x-session-id" or name == b"x-claude-code-session-id":
            return value.decode("latin-1") or None
    return None


def check_content_type(scope: Scope) -> None:
    # Required, not only checked when present: a body of no declared type is what a page on another
    # site can make a browser send without asking first (see edge/origin.py's SameOrigin).
    for name, value in scope["headers"]:
        if name == b"content-type":
            kind = value.split(b";", 1)[0].strip().lower()
            if kind != b"application/json" and not kind.endswith(b"+json"):
                raise UnsupportedMediaType(
                    f"content type {kind.decode(errors='replace')!r} is not supported; send application/json"
                )
            return
    raise UnsupportedMediaType("the request has no content type; send application/json")


class ClientLeft(Exception):
    """The client hung up before its request body was whole: nothing to answer, nothing went wrong.

    Not CancelledError: raised out of an ASGI app, that made uvicorn log an ERROR with a traceback
    for every client that gave up mid-upload.
    """


async def read_body(scope: Scope, receive: Receive, limit: int, bodies: ReceivingBodies | None = None) -> bytes:
    """The whole body; each chunk counted in `bodies` while it is received (503 past its budget)."""
    for name, value in scope["headers"]:
        if name == b"content-length":
            with contextlib.suppress(ValueError):
                if int(value) > limit:
                    raise PayloadTooLarge(f"request body is larger than the limit of {limit} bytes")
    chunks: list[bytes] = []
    size = 0
    more = True
    try:
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ClientLeft
            chunk = message.get("body", b"")
            if size + len(chunk) > limit:
                raise PayloadTooLarge(f"request body is larger than the limit of {limit} bytes")
            if bodies is not None:
                bodies.take(len(chunk))
            size += len(chunk)
            chunks.append(chunk)
            more = message.get("more_body", False)
    finally:
        if bodies is not None:
            bodies.give(size)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def send_error(send: Send, response: ErrorResponse) -> None:
    extra = [(k.lower().encode(), v.encode()) for k, v in response.headers.items()]
    await send({"type": "http.response.start", "status": response.status, "headers": _JSON + extra})
    await send({"type": "http.response.body", "body": response.body})
