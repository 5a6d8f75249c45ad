"""OpenAI answers built from plain text (mock model, CLI agents), in the API and mode the client called."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import msgspec

from iop.errors import RequestError, error_response
from iop.openai.chat_events import ChatChunks, chat_completion
from iop.openai.responses_events import (
    ResponseEvents,
    final_status,
    finish_response,
    message_item,
    new_id,
    response_object,
)
from iop.openai.usage import Usage

__all__ = ["AnswerWriter", "Usage", "answer_writer"]

_encode = msgspec.json.Encoder().encode

SSE = "text/event-stream"
JSON = "application/json"


class AnswerWriter:
    """Turns one answer's text into the bytes the client reads; one writer per request.

    Call `start()`, `delta()` per piece of text, then `finish()` or `fail()`. Streaming
    writers return SSE events from every call; body writers return b"" until `finish()` /
    `fail()`, which return the whole JSON body.
    """

    content_type: str = JSON

    def start(self) -> bytes:
        return b""

    def delta(self, text: str) -> bytes:
        raise NotImplementedError

    def finish(self, usage: Usage, finish_reason: str = "stop") -> bytes:
        raise NotImplementedError

    def fail(self, exc: RequestError) -> bytes:
        return error_response(exc).body


class _ChatStream(AnswerWriter):
    content_type = SSE

    def __init__(self, model: str, request: Mapping[str, Any]) -> None:
        options = request.get("stream_options")
        include_usage = isinstance(options, Mapping) and bool(options.get("include_usage"))
        self._chunks = ChatChunks(model, include_usage)

    def start(self) -> bytes:
        return self._chunks.role()

    def delta(self, text: str) -> bytes:
        return self._chunks.content(text) if text else b""

    def finish(self, usage: Usage, finish_reason: str = "stop") -> bytes:
        return self._chunks.finish(finish_reason, usage)

    def fail(self, exc: RequestError) -> bytes:
        return self._chunks.error(exc)


class _ChatBody(AnswerWriter):
    def __init__(self, model: str) -> None:
        self._model = model
        self._pieces: list[str] = []

    def delta(self, text: str) -> bytes:
        self._pieces.append(text)
        return b""

    def finish(self, usage: Usage, finish_reason: str = "stop") -> bytes:
        return _encode(chat_completion(self._model, "".join(self._pieces), finish_reason, usage))


class _ResponsesStream(AnswerWriter):
    content_type = SSE

    def __init__(self, model: str, request: Mapping[str, Any]) -> None:
        self._events = ResponseEvents(request, model)

    def start(self) -> bytes:
        return self._events.start() + self._events.open_text()

    def delta(self, text: str) -> bytes:
        return self._events.text(text)

    def finish(self, usage: Usage, finish_reason: str = "stop") -> bytes:
        return self._events.finish(usage, finish_reason)

    def fail(self, exc: RequestError) -> bytes:
        return self._events.fail(exc.message, exc.code)


class _ResponsesBody(AnswerWriter):
    def __init__(self, model: str, request: Mapping[str, Any]) -> None:
        self._response = response_object(request, model)
        self._pieces: list[str] = []

    def delta(self, text: str) -> bytes:
        self._pieces.append(text)
        return b""

    def finish(self, usage: Usage, finish_reason: str = "stop") -> bytes:
        status = "completed" if final_status(finish_reason)[0] == "completed" else "incomplete"
        item = message_item(new_id("msg_"), "".join(self._pieces), status)
        return _encode(finish_response(self._response, [item], usage, finish_reason))


def answer_writer(
    api: Literal["chat", "responses"], stream: bool, model: str, request: Mapping[str, Any] | None = None
) -> AnswerWriter:
    """The writer for one request: `api` is the endpoint the client called, `model` the name it sees,
    `request` its body (for `stream_options.include_usage` and the settings a response echoes)."""
    req: Mapping[str, Any] = request or {}
    if api == "chat":
        return _ChatStream(model, req) if stream else _ChatBody(model)
    return _ResponsesStream(model, req) if stream else _ResponsesBody(model, req)
