"""Writes a node's answer to the HTTP client: whole (JSON) or streamed (SSE, ended by an error event)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Literal

from starlette.types import Send

from iop import wire
from iop.anthropic import errors as anthropic_errors
from iop.edge.asgi import JSON
from iop.edge.channel import Channel
from iop.errors import RequestError, error_event

SSE = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]


def _timing_headers(provider: str, arrived: float, started: float) -> list[tuple[bytes, bytes]]:
    # `arrived` is the loop's clock, `started` time.monotonic(): asyncio's loop clock is that one.
    queue_ms = max(0.0, (started - arrived) * 1000) if started else 0.0
    return [(b"x-iop-provider", provider.encode()), (b"x-iop-queue-ms", f"{queue_ms:.1f}".encode())]


def _node_headers(ch: Channel) -> list[tuple[bytes, bytes]]:
    """The headers the node asked for with its answer (e.g. x-iop-dropped-tools)."""
    return [(k.lower().encode(), v.encode()) for k, v in ch.headers.items()]


async def relay_whole(replies: AsyncIterator[bytes], send: Send, provider: str, arrived: float, ch: Channel) -> None:
    parts = [data async for data in replies]
    started = ch.started_mono
    body = parts[0] if len(parts) == 1 else b"".join(parts)
    headers = JSON + _timing_headers(provider, arrived, started) + _node_headers(ch)
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def relay_stream(
    api: wire.Api, replies: AsyncIterator[bytes], send: Send, provider: str, arrived: float, ch: Channel
) -> RequestError | None:
    """Relay an SSE answer; returns the error it ended with once the response had started."""
    # Wait for the first bytes before answering 200: a failure before them is a clean HTTP error.
    it = replies.__aiter__()
    try:
        first = await it.__anext__()
    except StopAsyncIteration:
        first = b""
    headers = SSE + _timing_headers(provider, arrived, ch.started_mono) + _node_headers(ch)
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
    return "responses" if api in ("responses", "compact") else "chat"
