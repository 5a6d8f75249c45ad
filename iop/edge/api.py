"""The OpenAI endpoints (`/v1/chat/completions`, `/v1/responses`) as one lean ASGI handler.

One request, top to bottom (`ApiEndpoint.__call__`): the key, the body within its bound, the few
fields the edge reads (heads.py), the dispatch (dispatch.py) and its tries, each relaying the
node's answer to the client (answer.py), and, whatever happened, one record (observe.py).
Pinned requests (qualification: one provider, an admin's) are a mode of the same endpoint.
"""

from __future__ import annotations

import asyncio
import functools
import time
from typing import Any, Protocol

import msgspec
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from iop import config, endpoints, wire
from iop.anthropic import errors as anthropic_errors
from iop.edge import spans
from iop.edge.answer import relay_stream, relay_whole
from iop.edge.asgi import (
    JSON,
    ClientLeft,
    TrackedSend,
    check_content_type,
    read_body,
    send_error,
    session_header,
    watch_disconnect,
)
from iop.edge.bodies import ReceivingBodies
from iop.edge.channel import Channel
from iop.edge.dispatch import Attempt, DirectDispatch, PoolDispatch
from iop.edge.heads import Head, check_mixed_pool, known_head, parse_head
from iop.edge.http import WATCH, ClientWatch
from iop.edge.keys import EdgeKeys
from iop.edge.limits import Admission, Limiter
from iop.edge.observe import REQUEST_ID, Observer, Trace, new_request_id
from iop.edge.relay import Relay
from iop.edge.routing import BYTES_PER_TOKEN, Ask
from iop.edge.scheduler import Scheduler
from iop.edge.tenants import Tenants
from iop.errors import BadRequest, ErrorResponse, MethodNotAllowed, NotFound, RequestError, error_response
from iop.responses import background
from iop.responses.expand import Responses, Turn
from iop.responses.takeover import Held
from iop.responses.tap import KeepingSend
from iop.tracing import Tracing

_decode_json = msgspec.json.Decoder().decode
_encode_json = msgspec.json.Encoder().encode


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
    def keys(self) -> EdgeKeys: ...
    @property
    def responses(self) -> Responses: ...
    @property
    def tenants(self) -> Tenants: ...
    @property
    def limits(self) -> Limiter: ...
    @property
    def tracing(self) -> Tracing: ...

    def authorize(self, scope: Scope) -> str:
        """The client key's name ("" without keys); raises Unauthorized."""
        ...

    def identify(self, scope: Scope) -> tuple[str, str]:
        """The client key's name and its tenant; raises Unauthorized."""
        ...

    def owner(self, scope: Scope) -> str:
        """The id stored responses of this request's client key are filed under (iop/responses/store.py)."""
        ...

    def accepts(self, owner: str, key_id: str) -> bool:
        """The key of `owner` (managed: `key_id`) is one this edge still accepts."""
        ...


class ApiEndpoint:
    """One OpenAI API endpoint. Plain ASGI: the request path is measured, so nothing runs twice.

    `pinned`: `/admin/qualify/providers/{provider}/v1/...`, the same endpoint served by that one
    provider for an administrator; a measurement, not usage, so it leaves no record.
    """

    def __init__(self, edge: Serving, api: wire.Api, *, pinned: bool = False) -> None:
        self.edge = edge
        self.api: wire.Api = api
        self.pinned = pinned

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # Every request leaves one record when it ends, whatever happens to it: requests refused
        # before any dispatch count too.
        trace = Trace(scope.get("iop.request_id") or new_request_id(), self.api)
        out = TrackedSend(send, trace)
        if self.edge.tracing.on:
            spans.request(self.edge.tracing, trace, scope)
        admitting = trace.span is not None
        try:
            # The key first: a caller without one learns nothing, and leaves no ledger record.
            if self.pinned:
                self.edge.keys.admin(scope)
            else:
                trace.key, trace.tenant = self.edge.identify(scope)
            if scope["method"] != "POST":
                raise MethodNotAllowed(f"{scope['method']} {scope['path']}: use POST", headers={"Allow": "POST"})
            check_content_type(scope)
            body = await read_body(scope, receive, self.edge.max_body_bytes, self.edge.bodies)
            trace.bytes_in = len(body)
            head = parse_head(self.api, body, known_head(scope, body))
            trace.stream = head.stream
            if admitting:
                spans.admitted(trace, head.model, body)
                admitting = False
            if head.stateful and not self.pinned:
                body, turn, owner = await self._expand(scope, body, head, out)
                # Another body: the node reads it whole, unless it went on as sent.
                head = head._replace(lead=turn.lead if turn.sent is not None else 0)
                if turn.background and not head.stream:
                    await self._background(body, head, scope, owner, turn, out)
                    return
                try:
                    await self._serve(body, head, scope, receive, out, scope.get(WATCH))
                finally:
                    self.edge.responses.settle(turn)
                return
            await self._serve(body, head, scope, receive, out, scope.get(WATCH))
        except RequestError as exc:
            trace.error = exc.code
            if admitting:
                spans.refused(trace, exc.code)  # refused before its model was read
                admitting = False
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
            if not self.pinned:
                self._finished(trace, out.started)
            elif trace.span is not None:
                trace.span.end()

    async def _expand(self, scope: Scope, body: bytes, head: Head, out: TrackedSend) -> tuple[bytes, Turn, str]:
        """The stateless request to dispatch; the answer's send then keeps and echoes the state."""
        responses = self.edge.responses
        owner = self.edge.owner(scope)
        if head.as_sent and self.api == "responses":
            turn = responses.as_sent(body, head.lead, head.as_sent == "rewrite", head.ids)
            out.send = KeepingSend(out.send, responses, owner, turn, head.stream)
            out.dispatched = functools.partial(responses.dispatched, owner, turn)
            return turn.encoded(), turn, owner
        stream = head.stream
        request = _decode_json(body)
        turn = await responses.expand(request, owner, self.edge.max_body_bytes)
        turn.request = request
        if self.api == "compact":
            turn.body.pop("store", None)  # not a field of /responses/compact: its answer is not a response
            turn.store = False
        out.send = KeepingSend(out.send, responses, owner, turn, stream)
        out.dispatched = functools.partial(responses.dispatched, owner, turn)
        return turn.encoded(), turn, owner

    async def _background(
        self, body: bytes, head: Head, scope: Scope, owner: str, turn: Turn, out: TrackedSend
    ) -> None:
        """Answer `queued` now; the request runs in a task with its own trace (iop/responses/background.py)."""
        edge, model = self.edge, head.model
        allowed = edge.tenants.get(out.trace.tenant).policy.allows(model)  # refused now, not after `queued`
        if not allowed or (model not in edge.catalog.pools and model not in edge.catalog.routes):
            raise NotFound(f"model '{model}' does not exist; GET /v1/models lists the models", param="model")
        key, tenant = out.trace.key, out.trace.tenant
        key_id = client.id if (client := edge.keys.client(scope)) is not None else ""
        queued = await background.queue(edge.responses, owner, turn, turn.request, model, key, tenant, key_id)
        await self._run_background(head, scope, owner, turn, queued, key, tenant)
        await out({"type": "http.response.start", "status": 200, "headers": JSON})
        await out({"type": "http.response.body", "body": _encode_json(queued)})

    async def resume(self, held: Held) -> None:
        """Run again a background response whose edge is gone (iop/responses/takeover.py), as its key."""
        resumed = await background.resumed(self.edge.responses, held, self.edge.accepts)
        if resumed is not None:
            turn, stored, work = resumed
            head = parse_head(self.api, turn.encoded())
            scope: Scope = {"type": "http", "method": "POST", "path": "/v1/responses", "headers": []}
            await self._run_background(head, scope, held.owner, turn, stored.response, work.key, work.tenant)

    async def _run_background(
        self, head: Head, scope: Scope, owner: str, turn: Turn, queued: dict[str, Any], key: str, tenant: str
    ) -> None:
        """Start the background response's work: streamed and recorded, so that a client on any edge
        can follow it live (iop/responses/live.py); it leaves its own record."""
        edge = self.edge
        trace = Trace(new_request_id(), self.api)
        trace.key, trace.tenant = key, tenant
        recording = background.recording(edge.responses, owner, turn)
        keeper = KeepingSend(background.nowhere, edge.responses, owner, turn, True, recording)
        inner = TrackedSend(keeper, trace)
        body, head = turn.encoded(stream=True), head._replace(stream=True, lead=0)
        never = asyncio.Event()

        async def no_client() -> Message:
            await never.wait()  # nobody waits on a background response: only a cancel ends it early
            return {"type": "http.disconnect"}

        async def work() -> None:
            try:
                await self._serve(body, head, scope, no_client, inner)
            except RequestError as exc:
                trace.error = exc.code
                await background.failed(edge.responses, owner, turn, queued, exc, recording)
            finally:
                if not recording.ended:
                    await recording.abort()  # cancelled (or stopped: another edge runs it): its followers end too
                await recording.stop()
                self._finished(trace, inner.started)

        await recording.start(background.run(edge.responses, owner, turn, work()))

    def _error_response(self, exc: RequestError, request_id: str) -> ErrorResponse:
        """The error in the shape of the API called: Anthropic's for Messages, OpenAI's for the rest."""
        if self.api == "messages" or self.api == "count_tokens":
            return anthropic_errors.error_response(exc, request_id)
        return error_response(exc)

    def _finished(self, trace: Trace, responded: bool) -> None:
        if trace.cancelled:
            if not responded:
                trace.status = 499  # the client closed the request before any answer (nginx's code)
            trace.error = trace.error or "client_cancelled"
        rec = self.edge.observer.finish(trace)
        if trace.span is not None:
            spans.finish(trace, rec)

    async def _serve(
        self,
        body: bytes,
        head: Head,
        scope: Scope,
        receive: Receive,
        out: TrackedSend,
        watch: ClientWatch | None = None,
    ) -> None:
        """Dispatch the request and relay its answer; each try of the dispatch is one `async with`.

        `watch`: the connection's, which cancels the task if the client leaves; without one a task
        waits on `receive` for the disconnect (another server, a background response's no client)."""
        edge, trace = self.edge, out.trace
        dispatch = self._dispatch(body, head, scope, trace)
        admission: Admission | None = None
        tenant = edge.tenants.get(trace.tenant)
        if tenant.policy.limited and not self.pinned:
            try:
                admission = await edge.limits.admit(tenant, dispatch.alias, body, self.api)
            except RequestError as exc:
                if trace.span is not None:
                    spans.limits(trace, exc.code)
                raise
            if trace.span is not None:
                spans.limits(trace, "")
            out.headers = admission.headers(self.api)
        task = asyncio.current_task()
        assert task is not None
        if watch is not None:
            watch.start(task)
            watcher = None
        else:
            watcher = asyncio.create_task(watch_disconnect(receive, task))
        try:
            async for attempt in dispatch:
                async with attempt:  # a retryable failure before the client saw anything: the next provider
                    trace.model = _upstream_model(edge, attempt.provider, dispatch.alias)
                    await attempt.send(self._item(attempt.channel, body, dispatch.alias, head, trace.id))
                    dispatched, out.dispatched = out.dispatched, None
                    if dispatched is not None:
                        dispatched()
                    failed = await self._answer(attempt, head.stream, out, dispatch.arrived)
                    if failed is not None:
                        trace.error = failed.code  # a stream that failed after it began
        except asyncio.CancelledError:
            # The client went away (the watcher cancelled us): the relay cancels the node's work.
            trace.cancelled = True
            if task.cancelling():
                task.uncancel()
        finally:
            if watcher is not None:
                watcher.cancel()
            elif watch is not None:
                watch.stop()
            if admission is not None:
                usage = trace.report.usage if trace.report is not None else None
                used = usage.input_tokens + usage.output_tokens if usage is not None else None
                edge.limits.settle(admission, used, reached_node=trace.queue_ms is not None)

    def _dispatch(self, body: bytes, head: Head, scope: Scope, trace: Trace) -> PoolDispatch | DirectDispatch:
        """The request's dispatch: a pool's (or, pinned, one provider's), or a direct route's."""
        edge = self.edge
        deadline = asyncio.get_running_loop().time() + edge.queue_timeout_s
        if self.pinned:
            provider = scope["path_params"]["provider"]
            return PoolDispatch(edge.scheduler, edge.relay, self._alias_of(provider), deadline, trace, pin=provider)
        model, catalog = head.model, edge.catalog
        tenant = edge.tenants.get(trace.tenant)
        if not tenant.policy.allows(model):
            # As OpenAI answers a model a key may not use: it does not exist for this key.
            raise NotFound(f"model '{model}' does not exist; GET /v1/models lists the models", param="model")
        if model in catalog.pools:
            trace.alias = model
            endpoints.check(catalog, model, self.api)
            if self.api == "responses":
                check_mixed_pool(catalog, model, body)
            return PoolDispatch(
                edge.scheduler,
                edge.relay,
                model,
                deadline,
                trace,
                sessions=edge.scheduler.sessions,
                session=head.cache_key or session_header(scope) or head.user,
                affinity_wait_s=catalog.affinity_wait_s.get(model, 0.0),
                size=len(body),
                tenant=tenant,
                ask=Ask(len(body) // BYTES_PER_TOKEN, head.max_tokens, _finish_by(scope, trace, edge.scheduler, model)),
            )
        if model in catalog.routes:
            trace.alias = model
            endpoints.check(catalog, model, self.api)
            node, resource = catalog.routes[model]
            return DirectDispatch(edge.relay, model, node, resource, trace)
        raise NotFound(f"model '{model}' does not exist; GET /v1/models lists the models", param="model")

    def _alias_of(self, provider: str) -> str:
        """The first pool alias of a pinned provider: what its node sees as the work item's alias."""
        if provider not in self.edge.scheduler.providers:
            raise NotFound(f"provider '{provider}' does not exist or has no capacity", code="unknown_provider")
        for alias, members in self.edge.catalog.pools.items():
            if provider in members:
                return alias
        return provider

    def _item(self, ch: Channel, body: bytes, alias: str, head: Head, request_id: str) -> wire.WorkItem:
        """`head`: this very body's (`lead` describes it)."""
        edge = self.edge
        return wire.WorkItem(
            request_id=request_id,
            id=ch.id,
            api=self.api,
            stream=head.stream,
            lead=head.lead,
            alias=alias,
            body=body,
            reply_to=edge.relay.reply_to(ch),
            deadline=time.time() + edge.queue_timeout_s,
            edge=edge.edge_id,
        )

    async def _answer(self, attempt: Attempt, stream: bool, out: TrackedSend, arrived: float) -> RequestError | None:
        """Relay the try's answer; the error a stream ended with once the client had its 200."""
        replies, provider, ch = attempt.replies(), attempt.provider, attempt.channel
        span = attempt.span
        if span is not None:
            spans.answer(span, stream)
        error = "cancelled"
        try:
            if stream:
                failed = await relay_stream(self.api, replies, out, provider, arrived, ch)
                error = failed.code if failed is not None else ""
                return failed
            await relay_whole(replies, out, provider, arrived, ch)
            error = ""
        except RequestError as exc:
            error = exc.code
            exc.headers.setdefault("x-iop-provider", provider)  # who failed or refused (e.g. a translation)
            raise
        finally:
            if span is not None:
                spans.answer_ended(span, out.trace, error)
        return None


def _finish_by(scope: Scope, trace: Trace, scheduler: Scheduler, alias: str) -> float | None:
    """When the request's answer should be complete (monotonic): `x-iop-deadline-ms` after its
    arrival, else its pool's `deadline_ms`; None: no deadline."""
    for name, value in scope["headers"]:
        if name == b"x-iop-deadline-ms":
            try:
                ms = float(value)
            except ValueError:
                ms = -1.0
            if not 0 < ms < 1e9:
                raise BadRequest(
                    "x-iop-deadline-ms must be a positive number of milliseconds", param="x-iop-deadline-ms"
                )
            return trace.arrived + ms / 1000
    pool = scheduler.pools.get(alias)
    default = pool.rules.deadline_s if pool is not None else None
    return trace.arrived + default if default is not None else None


def _upstream_model(edge: Serving, provider: str, alias: str) -> str:
    ref = edge.catalog.providers.get(provider)
    return (ref.provider.model if ref is not None else None) or alias


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
            answer = anthropic_errors.refusal(scope["path"], refused, refused.headers["x-request-id"])
            await send_error(send, answer)
            return
        scope["iop.request_id"] = rid
        header = (b"x-request-id", rid.encode())

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), header]
            await send(message)

        await self.app(scope, receive, send_with_id)
