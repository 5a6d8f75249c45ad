"""One pinned request as the qualifier sees it: sent through the edge's admin path, timed, its stream checked."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import msgspec

from iop.client import EdgeClient
from iop.errors import IopError
from iop.openai.sse import SseDecoder

_encode = msgspec.json.encode
_decode = msgspec.json.decode


@dataclass
class Whole:
    """A non-streamed answer: its status and JSON (None if the body was not JSON)."""

    status: int
    body: Any
    text: str
    elapsed_ms: float


@dataclass
class Streamed:
    """A streamed answer, read to its end, with what the checks and the sweep need from it."""

    status: int
    sent: float
    """Monotonic time the request was sent."""
    first_token: float | None = None
    """Monotonic time of the first event carrying answer text."""
    end: float = 0.0
    content: str = ""
    content_events: int = 0
    usage: dict[str, Any] | None = None
    finish_reason: str | None = None
    done: bool = False
    """The stream ended as its API says it must: `data: [DONE]` (chat) or `response.completed` (Responses)."""
    malformed: str = ""
    """Why the stream is not well-formed SSE of its API (empty: it is)."""
    error: str = ""
    """An HTTP error, an error event, or a transport failure."""
    events: int = 0
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    @property
    def completion_tokens(self) -> int | None:
        if self.usage is None:
            return None
        for name in ("completion_tokens", "output_tokens"):
            value = self.usage.get(name)
            if isinstance(value, int):
                return value
        return None


async def whole(client: EdgeClient, provider: str, api: str, body: dict[str, Any], timeout_s: float) -> Whole:
    t0 = time.monotonic()
    r = await client.pinned(provider, api, _encode(body), timeout_s)
    elapsed = (time.monotonic() - t0) * 1000
    try:
        parsed: Any = _decode(r.content)
    except msgspec.DecodeError:
        parsed = None
    return Whole(r.status_code, parsed, r.text[:300], elapsed)


async def stream(client: EdgeClient, provider: str, api: str, body: dict[str, Any], timeout_s: float) -> Streamed:
    """Send `body` (with stream: true) and read the whole answer, never raising for what the provider did."""
    out = Streamed(status=0, sent=time.monotonic())
    try:
        async with client.pinned_stream(provider, api, _encode({**body, "stream": True}), timeout_s) as r:
            out.status = r.status_code
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                out.error = f"HTTP {r.status_code}: {_error_message(text)}"
                return out
            decoder = SseDecoder()
            async for piece in r.aiter_raw():
                for ev in decoder.feed(piece):
                    _event(out, api, ev.event, ev.data)
            if decoder.finish():
                out.malformed = out.malformed or "the stream ended in the middle of an event (no blank line after it)"
    except (httpx.HTTPError, IopError) as exc:
        out.error = out.error or f"{type(exc).__name__}: {exc}"
    finally:
        out.end = time.monotonic()
    if not out.done and not out.error:
        out.malformed = out.malformed or (
            "the stream ended without data: [DONE]" if api == "chat" else "the stream ended without response.completed"
        )
    return out


def _event(out: Streamed, api: str, name: str | None, data: bytes) -> None:
    out.events += 1
    if out.done and api == "chat":
        out.malformed = out.malformed or "an event came after data: [DONE]"
        return
    if data == b"[DONE]":
        if api == "chat":
            out.done = True
        return
    try:
        obj = _decode(data)
    except msgspec.DecodeError:
        out.malformed = out.malformed or f"event {out.events} is not JSON: {data[:80]!r}"
        return
    if not isinstance(obj, dict):
        out.malformed = out.malformed or f"event {out.events} is not a JSON object"
        return
    if "error" in obj and api == "chat":
        out.error = out.error or f"error event: {_error_message(data.decode(errors='replace'))}"
        return
    if api == "chat":
        _chat_chunk(out, obj)
    else:
        _responses_event(out, name, obj)


def _chat_chunk(out: Streamed, obj: dict[str, Any]) -> None:
    if obj.get("usage"):
        out.usage = obj["usage"]
    for choice in obj.get("choices") or []:
        delta = choice.get("delta") or {}
        text = delta.get("content")
        if isinstance(text, str) and text:
            if out.first_token is None:
                out.first_token = time.monotonic()
            out.content += text
            out.content_events += 1
        for call in delta.get("tool_calls") or []:
            _merge_tool_call(out.tool_calls, call)
        if choice.get("finish_reason"):
            out.finish_reason = choice["finish_reason"]


def _merge_tool_call(calls: list[dict[str, Any]], delta: dict[str, Any]) -> None:
    index = delta.get("index", len(calls))
    while len(calls) <= index:
        calls.append({"name": "", "arguments": ""})
    fn = delta.get("function") or {}
    calls[index]["name"] += fn.get("name") or ""
    calls[index]["arguments"] += fn.get("arguments") or ""


def _responses_event(out: Streamed, name: str | None, obj: dict[str, Any]) -> None:
    kind = obj.get("type")
    if name is not None and kind is not None and name != kind:
        out.malformed = out.malformed or f"event name {name!r} differs from its type {kind!r}"
    if kind == "response.output_text.delta":
        text = obj.get("delta")
        if isinstance(text, str) and text:
            if out.first_token is None:
                out.first_token = time.monotonic()
            out.content += text
            out.content_events += 1
    elif kind in ("response.completed", "response.incomplete"):
        out.done = True
        response = obj.get("response") or {}
        if response.get("usage"):
            out.usage = response["usage"]
        out.finish_reason = "length" if kind == "response.incomplete" else "stop"
    elif kind in ("error", "response.failed"):
        out.error = out.error or f"{kind} event"


def _error_message(text: str) -> str:
    try:
        body = _decode(text)
        if isinstance(body, dict) and isinstance(body.get("error"), dict):
            return str(body["error"].get("message", ""))[:200]
    except msgspec.DecodeError:
        pass
    return text[:200]
