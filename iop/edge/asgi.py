"""The ASGI pieces every endpoint of the edge uses: the body read within its bound, the error answer,
the client's disconnect, and the send that notes what the client got."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

from starlette.types import Message, Receive, Scope, Send

from iop.edge.bodies import ReceivingBodies
from iop.edge.observe import Trace
from iop.errors import ErrorResponse, PayloadTooLarge, UnsupportedMediaType

JSON = [(b"content-type", b"application/json")]


class TrackedSend:
    """The ASGI send, remembering whether the response has started (then nothing can be retried),
    and noting status, first byte and bytes out in the request's trace."""

    def __init__(self, send: Send, trace: Trace) -> None:
        self.send = send
        self.started = False
        self.trace = trace
        self.headers: list[tuple[bytes, bytes]] = []
        """Added to the answer's head, whatever it is (a limited tenant's x-ratelimit-* headers)."""
        self.dispatched: Callable[[], None] | None = None
        """Called once, when the request's work item is first sent (a kept Responses turn's input
        is written then: iop/responses/expand.py)."""

    async def __call__(self, message: Message) -> None:
        trace = self.trace
        if message["type"] == "http.response.start":
            self.started = True
            trace.status = message["status"]
            if self.headers:
                message["headers"] = [*message.get("headers", ()), *self.headers]
        else:
            size = len(message.get("body", b""))
            if size:
                if not trace.first_byte:
                    trace.first_byte = time.monotonic()
                trace.bytes_out += size
        await self.send(message)


async def watch_disconnect(receive: Receive, task: asyncio.Task[Any]) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            task.cancel()
            return


def session_header(scope: Scope) -> str | None:
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
    await send({"type": "http.response.start", "status": response.status, "headers": JSON + extra})
    await send({"type": "http.response.body", "body": response.body})
