"""Anthropic Messages over any adapter that answers chat: the request and the answer translated on the node.

An upstream that serves `/v1/messages` itself (its adapter lists `messages`) gets the client's body
untouched; every other adapter (a chat-only upstream, the mock, a CLI) answers a chat request made
from it (iop/anthropic/request.py), and its chat answer, whole or streamed, is turned back into
Messages (answer.py, stream.py). The wrapped adapter never knows: the same code path, slot, usage
and upstream errors as a chat request.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import msgspec

from iop import wire
from iop.anthropic.answer import chat_to_messages_answer
from iop.anthropic.count import estimate_input_tokens
from iop.anthropic.errors import error_type
from iop.anthropic.request import ChatRequest, chat_body_of, messages_to_chat_request
from iop.anthropic.stream import ChatToMessagesStream
from iop.errors import BadRequest, RequestError, UpstreamError
from iop.node.adapters.base import Adapter, Send
from iop.node.adapters.openai import OpenAIAdapter

log = logging.getLogger("iop.node")
_decode = msgspec.json.Decoder().decode
_encode = msgspec.json.Encoder().encode


class TranslatedStreamFailed(UpstreamError):
    """The chat answer failed after the Messages stream began; the client already has its `error` event."""

    ended_stream = True


class MessagesOverChat:
    """Wraps an adapter: Messages items it cannot pass through run as chat items, translated both ways."""

    def __init__(self, inner: Adapter, native: bool) -> None:
        self.inner = inner
        self.native = native

    async def run(self, item: wire.WorkItem, model: str | None, send: Send) -> wire.Usage | None:
        if item.api == "count_tokens":
            return await self._count(item, model, send)
        if item.api != "messages" or self.native:
            return await self.inner.run(item, model, send)
        body, dropped_tools = _chat_body_of(item.body)
        extra: dict[str, str] = {}
        if dropped_tools:
            dropped = ",".join(dropped_tools)
            log.debug("request %s: dropped tools a chat server cannot run: %s", item.id, dropped)
            extra["x-iop-dropped-tools"] = dropped
        name = model or item.alias
        chat_item = msgspec.structs.replace(item, api="chat", body=body, body_size=0)
        if item.stream:
            return await self._stream(chat_item, model, send, ChatToMessagesStream(name), extra)
        parts: list[bytes] = []
        first: dict[str, str] = {}

        async def keep(data: bytes, headers: Mapping[str, str] | None = None) -> None:
            if headers:
                first.update(headers)
            parts.append(data)

        usage = await self.inner.run(chat_item, model, keep)
        answer = chat_to_messages_answer(b"".join(parts), name)
        await send(_encode(answer), {**first, **extra})
        return usage

    async def _stream(
        self,
        chat_item: wire.WorkItem,
        model: str | None,
        send: Send,
        stream: ChatToMessagesStream,
        extra: dict[str, str],
    ) -> wire.Usage | None:
        sent = False

        async def translate(data: bytes, headers: Mapping[str, str] | None = None) -> None:
            nonlocal sent
            out = stream.feed(data)
            if out:
                await send(out, {**(headers or {}), **extra} if not sent else headers)
                sent = True

        try:
            usage = await self.inner.run(chat_item, model, translate)
            if tail := stream.close():
                await send(tail, None if sent else extra)
            return usage
        except RequestError as exc:
            if not sent:
                raise  # nothing reached the client: a clean HTTP error, and the pool may fail over
            if not stream.ended:
                await send(stream.fail(exc.message, error_type(exc.status)))
            raise TranslatedStreamFailed(exc.message, code=exc.code, status=exc.status) from exc

    async def _count(self, item: wire.WorkItem, model: str | None, send: Send) -> wire.Usage | None:
        """count_tokens: the upstream's tokenizer over the chat prompt (the edge sends only where there is one)."""
        chat = _chat_of(item.body, {"max_tokens": 1, "stream": False})
        chat.body["model"] = model or item.alias
        inner = self.inner
        if isinstance(inner, OpenAIAdapter) and inner.cfg.tokenize:
            count = await inner.count_tokens(chat.body)
        else:
            count = estimate_input_tokens(chat.body)
        await send(_encode({"input_tokens": count}))
        return None

    async def close(self) -> None:
        await self.inner.close()


def _chat_body_of(body: bytes) -> tuple[bytes, list[str]]:
    """The chat body for a Messages body, translated on its bytes (its texts are never decoded)."""
    try:
        return chat_body_of(body)
    except (TypeError, AttributeError, KeyError, ValueError) as exc:
        raise BadRequest(f"the request cannot be translated to chat: {type(exc).__name__}: {exc}") from exc


def _chat_of(body: bytes, override: Mapping[str, Any] | None = None) -> ChatRequest:
    try:
        request = _decode(body)
        if not isinstance(request, Mapping):
            raise BadRequest("the request body must be a JSON object")
        return messages_to_chat_request({**request, **override} if override else request)
    except (TypeError, AttributeError, KeyError, ValueError) as exc:
        raise BadRequest(f"the request cannot be translated to chat: {type(exc).__name__}: {exc}") from exc
