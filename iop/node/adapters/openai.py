"""The openai adapter: forwards to an OpenAI-compatible server (vLLM, MLX, llama.cpp, Ollama)."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import re
import uuid
from collections.abc import Mapping
from typing import Any

import msgspec

from iop import config, wire
from iop.endpoints import native
from iop.errors import BadRequest, NotFound, RequestError, UpstreamError, error_for_status
from iop.node.adapters.base import Send, note_upstream_status, outcome
from iop.node.http1 import ConnectFailed, HttpError, HttpPool, HttpResponse, Timeout
from iop.node.tokens import OpeningUsage, UsageTail, usage_of_body
from iop.openai.passthrough import Piece, native_parts
from iop.openai.raw_strings import Placeholders
from iop.openai.tool_names import ToolMap
from iop.openai.translate import (
    ChatToResponsesStream,
    ResponsesToChatStream,
    chat_to_responses_answer,
    chat_to_responses_request,
    responses_to_chat_answer,
    responses_to_chat_request,
)
from iop.openai.usage import usage_from_chat, usage_from_responses
from iop.openai.usage_chunk import UsageChunkFilter

log = logging.getLogger("iop.node")
_decode = msgspec.json.Decoder().decode
_encode = msgspec.json.Encoder().encode
_PATHS = {
    "chat": "/chat/completions",
    "responses": "/responses",
    "compact": "/responses/compact",
    "messages": "/messages",
    "embeddings": "/embeddings",
    "completions": "/completions",
}
_SAFE_ID = re.compile(wire.REQUEST_ID_PATTERN)


class StreamFailed(UpstreamError):
    """The upstream failed after a translated stream began; the client already got the terminal event."""

    ended_stream = True


class OpenAIAdapter:
    """Forwards each API natively when the upstream serves it, and translates when it does not.

    Native: the client's body goes upstream with only `model` replaced, and the upstream's bytes
    come back untouched (SSE passed through as it arrives). Translated (docs/openai-compat.md):
    a Responses request to a chat-only upstream, or a chat request to a Responses-only upstream.
    """

    def __init__(self, cfg: config.OpenAIAdapter) -> None:
        self.cfg = cfg
        headers = {"content-type": "application/json"}
        if cfg.api_key_env and (key := os.environ.get(cfg.api_key_env)):
            headers["authorization"] = f"Bearer {key}"
        self.native = native(cfg)
        self.pool_headers = headers
        self.root: HttpPool | None = None
        """The server's root (base_url without /v1), for its tokenizer; made on first use."""
        self.pool = HttpPool(cfg.base_url, headers=headers, read_timeout_s=min(cfg.idle_timeout_s, cfg.timeout_s))

    def serves(self, api: str) -> bool:
        # The edge sends /responses/compact only to upstreams that serve Responses (iop/endpoints.py).
        return api in self.native or (api == "compact" and "responses" in self.native)

    async def run(self, item: wire.WorkItem, model: str | None, send: Send) -> wire.Usage | None:
        # `timeout_s` bounds the whole request; the pool's read timeout (`idle_timeout_s`) bounds
        # each silence within it. The bound is one timer that cancels the task, asyncio.timeout's
        # rule without its Timeout and reschedule for every request (3-4 us, in process).
        task = asyncio.current_task()
        assert task is not None
        expired = _Expiry(task)
        timer = asyncio.get_running_loop().call_later(self.cfg.timeout_s, expired.fire)
        taken_back = False
        try:
            return await self._run(item, model, send)
        except asyncio.CancelledError:
            if expired.fired:
                taken_back = True
                if task.uncancel() == 0:
                    raise self._too_long() from None  # the timer's cancel, and nobody else's
            raise
        except TimeoutError as exc:
            raise self._too_long() from exc
        finally:
            timer.cancel()
            if expired.fired and not taken_back:
                task.uncancel()  # the timer's cancel was swallowed below: take it back, as asyncio.timeout does

    def _too_long(self) -> UpstreamError:
        return UpstreamError(
            f"upstream request took longer than timeout_s ({self.cfg.timeout_s:g} s)", code="upstream_timeout"
        )

    async def _run(self, item: wire.WorkItem, model: str | None, send: Send) -> wire.Usage | None:
        if self.serves(item.api):
            # completions streams carry their usage the same way (stream_options.include_usage).
            chat_stream = item.stream and item.api in ("chat", "completions")
            # A chat stream always asks for its usage (iop counts tokens); the client sees the
            # usage chunk only if it asked for it too.
            body, asked = native_parts(item.body, model, chat_stream, item.lead)
            strip = UsageChunkFilter() if asked else None
            response = await self._post(item.api, body, item.request_id)
            try:
                if item.stream:
                    tail = UsageTail()  # the usage is in the stream's last event: no per-chunk parsing
                    end = _StreamEnd()
                    # A Messages stream says its input tokens in its first event (message_start).
                    opening = OpeningUsage() if item.api == "messages" else None
                    async for data in response.iter_body():
                        if not end.started:
                            end.check_start(data)  # raises before the client got anything: retryable
                        if opening is not None:
                            opening.feed(data)
                        end.feed(data)
                        tail.feed(data)  # what the upstream sent, before the usage chunk is taken out
                        if strip is not None:
                            data = strip.feed(data)
                        if data:
                            await send(data)
                    if strip is not None and (rest := strip.close()):
                        await send(rest)
                    if not end.seen:
                        # Until-close framing makes a cut connection look like a normal end.
                        raise UpstreamError(
                            "upstream stream ended before its final event ([DONE]): the answer was cut short",
                            code="upstream_truncated",
                        )
                    return opening.merge(tail.usage()) if opening is not None else tail.usage()
                answer = await response.read()
                usage = usage_of_body(answer)
                if usage is None and not _is_json_object(answer):
                    raise UpstreamError(
                        "upstream answered 200 with a body that is not JSON", code="upstream_bad_answer"
                    )
                await send(answer)
                return usage
            except HttpError as exc:
                raise _mid_answer(exc) from exc
            finally:
                await response.aclose()
        return await self._translated(item, model, send)

    async def _translated(self, item: wire.WorkItem, model: str | None, send: Send) -> wire.Usage | None:
        upstream_api: wire.Api = "chat" if item.api == "responses" else "responses"
        if item.api not in ("chat", "responses") or upstream_api not in self.native:
            # The edge refuses these before they queue (iop/endpoints.py); an older edge may not.
            raise NotFound(
                f"this provider's upstream does not serve the {item.api} endpoint", code="endpoint_not_served"
            )
        # Long texts stay the client's bytes through the translation (iop/openai/raw_strings.py).
        held = Placeholders() if item.api == "responses" else None
        request: dict[str, Any] = held.decode(item.body) if held is not None else _decode(item.body)
        name = model or str(request.get("model") or item.alias)
        upstream, tools, headers = self._translate(item, request, name)
        body: bytes | list[Piece] | None = held.encode(upstream) if held is not None else None
        if body is None:
            if held is not None:
                # A placeholder did not come through the translation intact: translate it all decoded.
                request = _decode(item.body)
                upstream, tools, headers = self._translate(item, request, name)
            body = _encode(upstream)
        response = await self._post(upstream_api, body, item.request_id)
        try:
            if not item.stream:
                answer = _decode(await response.read())
                if item.api == "responses":
                    out = chat_to_responses_answer(answer, request, name, tools)
                else:
                    out = responses_to_chat_answer(answer, name)
                await send(_encode(out), headers)
                return _usage_of(out)
            stream: ChatToResponsesStream | ResponsesToChatStream
            if item.api == "responses":
                stream = ChatToResponsesStream(request, name, tools)
            else:
                stream = ResponsesToChatStream(request, name)
            await send(stream.start(), headers)
            try:
                async for data in response.iter_body():
                    if out_bytes := stream.feed(data):
                        await send(out_bytes)
                if tail := stream.close():
                    await send(tail)
            except (HttpError, RequestError) as exc:
                err = _mid_answer(exc) if isinstance(exc, HttpError) else exc
                if not stream.ended:
                    # End the stream in the client's own API (e.g. response.failed for Codex).
                    await send(stream.fail(err.message, err.code))
                raise StreamFailed(err.message, code=err.code, status=err.status) from exc
            return stream.usage
        except msgspec.DecodeError as exc:
            raise UpstreamError("upstream answered with invalid JSON", code="upstream_error") from exc
        except HttpError as exc:
            raise _mid_answer(exc) from exc
        finally:
            await response.aclose()

    def _translate(
        self, item: wire.WorkItem, request: dict[str, Any], name: str
    ) -> tuple[dict[str, Any], ToolMap | None, dict[str, str]]:
        """The upstream's request for `request`, the request's ToolMap (Responses) and headers for the answer."""
        tools: ToolMap | None = None
        headers: dict[str, str] = {}
        try:
            if item.api == "responses":
                # One map for both directions: the answer's calls are decoded by the request's names.
                tools = ToolMap.of(request)
                upstream = responses_to_chat_request(
                    request, name, tools=tools, vision=self.cfg.vision, replay_reasoning=self.cfg.replay_reasoning
                )
                if tools.dropped:
                    dropped = dropped_tools_header(tools.dropped)
                    log.debug("request %s: dropped tools a chat server cannot run: %s", item.id, dropped)
                    headers["x-iop-dropped-tools"] = dropped
            else:
                upstream = chat_to_responses_request(request, name)
        except (TypeError, AttributeError, KeyError, ValueError) as exc:
            # A field of a shape the translation did not expect (the edge checks the ones it knows):
            # the request's fault, never the provider's, so no breaker counts it and no failover.
            raise BadRequest(
                f"the request cannot be translated for this provider: {type(exc).__name__}: {exc}"
            ) from exc
        return upstream, tools, headers

    async def _post(self, api: wire.Api, body: bytes | list[Piece], request_id: str = "") -> HttpResponse:
        # The request id goes upstream too (as a UUID), so the upstream's own logs can be joined with iop's.
        safe = request_id and _SAFE_ID.match(request_id)
        headers = {"x-request-id": upstream_request_id(request_id)} if safe else None
        traced = outcome.get(None)
        if traced is not None and traced.traceparent:
            # A model server that traces (vLLM with OTLP) continues the request's trace.
            headers = {**(headers or {}), "traceparent": traced.traceparent}
        try:
            response = await self.pool.post(_PATHS[api], body, headers)
        except Timeout as exc:
            raise UpstreamError(f"upstream timed out: {self.cfg.base_url}", code="upstream_timeout") from exc
        except ConnectFailed as exc:
            raise UpstreamError(
                f"upstream unreachable: {self.cfg.base_url}: {exc}", code="upstream_unavailable"
            ) from exc
        except HttpError as exc:
            raise UpstreamError(f"upstream failed: {self.cfg.base_url}: {exc}", code="upstream_error") from exc
        note_upstream_status(response.status)
        if response.status >= 400:
            try:
                raw = await response.read()
            except HttpError:
                raw = b""
            finally:
                await response.aclose()
            raise upstream_error(response.status, raw)
        return response

    async def count_tokens(self, chat: Mapping[str, Any]) -> int:
        """The prompt tokens of a chat request by the upstream's own tokenizer and chat template."""
        if self.root is None:
            # /tokenize lives at the server's root, beside /v1.
            self.root = HttpPool(_root_of(self.cfg.base_url), headers=self.pool_headers, read_timeout_s=30.0)
        body: dict[str, Any] = {"model": chat.get("model"), "messages": chat["messages"]}
        try:
            if self.cfg.tokenize == "vllm":
                if chat.get("tools"):
                    body["tools"] = chat["tools"]
                answer = await self._root_post("/tokenize", {**body, "add_generation_prompt": True})
                count = answer.get("count")
                return count if isinstance(count, int) else len(answer.get("tokens") or [])
            prompt = (await self._root_post("/apply-template", body)).get("prompt")
            if not isinstance(prompt, str):
                raise UpstreamError("upstream /apply-template answered without a prompt", code="upstream_bad_answer")
            tokens = (await self._root_post("/tokenize", {"content": prompt})).get("tokens")
            return len(tokens) if isinstance(tokens, list) else 0
        except (msgspec.DecodeError, AttributeError) as exc:
            raise UpstreamError("upstream's tokenizer answered with invalid JSON", code="upstream_bad_answer") from exc

    async def _root_post(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        assert self.root is not None
        try:
            response = await self.root.post(path, _encode(body))
        except ConnectFailed as exc:
            raise UpstreamError(
                f"upstream unreachable: {self.cfg.base_url}: {exc}", code="upstream_unavailable"
            ) from exc
        except HttpError as exc:
            raise UpstreamError(f"upstream failed: {self.cfg.base_url}: {exc}", code="upstream_error") from exc
        try:
            raw = await response.read()
        except HttpError as exc:
            raise _mid_answer(exc) from exc
        finally:
            await response.aclose()
        if response.status >= 400:
            raise upstream_error(response.status, raw)
        answer = _decode(raw)
        if not isinstance(answer, dict):
            raise UpstreamError(f"upstream {path} answered JSON that is not an object", code="upstream_bad_answer")
        return answer

    async def close(self) -> None:
        await self.pool.close()
        if self.root is not None:
            await self.root.close()


_SSE_FIELDS = (b"data:", b"event:", b"id:", b"retry:", b":")
_STREAM_ENDS = (b"[DONE]", b"response.completed", b"response.incomplete", b"response.failed", b"message_stop")
"""What the last event of a stream carries: chat's and completions' [DONE], a Responses stream's end,
or Messages' message_stop."""


class _AnyObject(msgspec.Struct):
    pass


_object = msgspec.json.Decoder(_AnyObject).decode


def _is_json_object(body: bytes) -> bool:
    try:
        _object(body)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return False
    return True


class _StreamEnd:
    """Watches an upstream's stream as it passes: it must start as server-sent events and carry
    its final event before it ends. Costs a few substring searches per piece, no parsing."""

    __slots__ = ("carry", "seen", "started")

    def __init__(self) -> None:
        self.started = False
        self.seen = False
        self.carry = b""

    def check_start(self, first: bytes) -> None:
        head = first.lstrip()[:7]
        if not head:
            return  # only blank lines so far: the next piece decides
        self.started = True
        if any(head.startswith(f) or f.startswith(head) for f in _SSE_FIELDS):
            return
        if head.startswith(b"{"):
            raise UpstreamError(
                f"upstream answered a stream request with a JSON body: {first[:300].decode(errors='replace')}",
                code="upstream_bad_answer",
            )
        raise UpstreamError(
            "upstream answered a stream request with bytes that are not server-sent events",
            code="upstream_bad_answer",
        )

    def feed(self, data: bytes) -> None:
        if self.seen:
            return
        # The piece itself, then the seam with the previous one (a marker may straddle it).
        joint = self.carry + data[:24]
        self.seen = any(end in data or end in joint for end in _STREAM_ENDS)
        self.carry = data[-24:] if len(data) >= 24 else joint[-24:]


def _root_of(base_url: str) -> str:
    """The server's root URL: base_url without a trailing /v1."""
    base = base_url.rstrip("/")
    return base[: -len("/v1")] if base.endswith("/v1") else base


def _mid_answer(exc: HttpError) -> UpstreamError:
    if isinstance(exc, Timeout):
        return UpstreamError("upstream timed out mid-answer", code="upstream_timeout")
    return UpstreamError(f"upstream failed mid-answer: {exc}", code="upstream_error")


def _usage_of(answer: Mapping[str, Any]) -> wire.Usage | None:
    u = answer.get("usage")
    if not isinstance(u, Mapping):
        return None
    return usage_from_responses(u) if "input_tokens" in u else usage_from_chat(u)


DROPPED_HEADER_BYTES = 512
"""The most `x-iop-dropped-tools` holds; the types past it are counted (`,+N more`)."""
_NOT_TOKEN = re.compile(r"[^A-Za-z0-9_.:-]")


def dropped_tools_header(types: list[str]) -> str:
    """`x-iop-dropped-tools`: the dropped hosted tools' types, as the client sent them only where safe.

    The types are the client's strings: a CR/LF copied into a header made the server drop the
    connection (after the request had run), and 3,000 types made a 192 KB header. Each character
    outside `A-Z a-z 0-9 _ . : -` becomes `?`, and the list stops at DROPPED_HEADER_BYTES.
    """
    out = ""
    for i, kind in enumerate(types):
        piece = ("," if out else "") + _NOT_TOKEN.sub("?", kind[:64])
        if len(out) + len(piece) > DROPPED_HEADER_BYTES:
            return f"{out},+{len(types) - i} more"
        out += piece
    return out


class _Expiry:
    """The timer of one request's `timeout_s`: cancels its task, and says it did."""

    __slots__ = ("fired", "task")

    def __init__(self, task: asyncio.Task[Any]) -> None:
        self.task = task
        self.fired = False

    def fire(self) -> None:
        self.fired = True
        self.task.cancel()


def upstream_request_id(request_id: str) -> str:
    """The `x-request-id` sent upstream: the request id itself when it is a UUID, else a UUID made from it.

    llama-cpp-python's server answers an empty 400 to any `x-request-id` that is not a UUID, and
    every server takes one. Derived, not random: the same request id always gives the same UUID
    (the first 16 bytes of its SHA-256, version 4), so an upstream's log still joins iop's.
    """
    # uuid.UUID's own reading of a string, without its exception for the usual id (iop's `req_...`):
    # 4.6 -> 1.2 us a request (timeit).
    digits = request_id.replace("urn:", "").replace("uuid:", "").strip("{}").replace("-", "")
    if len(digits) == 32 and not digits.strip(_HEX):  # nothing left once hex digits are stripped
        return str(uuid.UUID(request_id))
    b = bytearray(hashlib.sha256(request_id.encode()).digest()[:16])
    b[6] = b[6] & 0x0F | 0x40  # version 4
    b[8] = b[8] & 0x3F | 0x80  # the RFC 4122 variant
    h = b.hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


_HEX = "0123456789abcdefABCDEF"


def upstream_error(status: int, raw: bytes) -> RequestError:
    """Map an upstream HTTP error: client mistakes pass through, the rest is the gateway's 502.

    An empty body is said to be one, with the status: `upstream: ` alone told a client nothing.
    """
    if not raw.strip():
        text = f"upstream answered {status} with an empty body"
        if status in (400, 413, 422):
            return error_for_status(400 if status == 422 else status, text, "upstream_bad_request")
        if status == 429:
            return error_for_status(429, text, "upstream_rate_limited")
        return UpstreamError(text, code="upstream_error")
    message = raw[:2000].decode(errors="replace")
    try:
        err = _decode(raw).get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            message = err["message"]
        elif isinstance(err, str):
            message = err
    except (msgspec.DecodeError, AttributeError):
        pass
    if status in (400, 413, 422):
        return error_for_status(400 if status == 422 else status, f"upstream: {message}", "upstream_bad_request")
    if status == 429:
        return error_for_status(429, f"upstream: {message}", "upstream_rate_limited")
    return UpstreamError(f"upstream answered {status}: {message}", code="upstream_error")
