"""Streamed answers translated between the APIs: chat SSE ⇄ Responses SSE, fed bytes at any boundary."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from iop.errors import UpstreamError
from iop.openai.chat_events import ChatChunks
from iop.openai.responses_events import ResponseEvents, new_id
from iop.openai.sse import SseDecoder, SseEvent
from iop.openai.tool_names import ToolMap
from iop.openai.usage import Usage, usage_from_chat, usage_from_responses

_decode = msgspec.json.Decoder().decode
_encode = msgspec.json.Encoder().encode


def as_mapping(value: object) -> Mapping[str, Any]:
    """`value` if it is a JSON object, else an empty one: upstream JSON is read defensively."""
    return value if isinstance(value, Mapping) else {}


def _is_whole(data: bytes) -> bool:
    """Whether the last event of a stream that ended without its blank line is complete, not cut off."""
    if data.strip() == b"[DONE]":
        return True
    try:
        _decode(data)
    except msgspec.DecodeError:
        return False
    return True


def _error_of(error: object) -> tuple[str, str]:
    """Message and code of an upstream error object (codes that are not strings are not ours to keep)."""
    if isinstance(error, Mapping):
        code = error.get("code")
        return str(error.get("message") or "upstream error"), code if isinstance(code, str) else "upstream_error"
    return str(error), "upstream_error"


class _ChatCall:
    def __init__(self, key: int, call_id: str | None, name: str | None) -> None:
        self.key = key
        self.call_id = call_id
        self.name = name
        self.held: list[str] = []
        self.opened = False


class ChatToResponsesStream:
    """A chat completion stream (bytes from the upstream) as a Responses event stream (bytes for the client).

    `request` is the client's Responses request (echoed in the response object), `model` the
    name the client sees. `feed` returns the events each piece completes; the stream ends with
    response.completed / response.incomplete on `data: [DONE]`, or response.failed on an error
    event, undecodable data, `fail()`, or `close()` before [DONE]. `usage` holds the upstream's
    token counts once it sent them.
    """

    def __init__(self, request: Mapping[str, Any], model: str, tools: ToolMap | None = None) -> None:
        self._events = ResponseEvents(request, model)
        self._tools = tools if tools is not None else ToolMap.of(request)
        self._sse = SseDecoder()
        self._calls: dict[int, _ChatCall] = {}
        self._keys = 0
        self._finish_reason: str | None = None
        self.usage: Usage | None = None

    @property
    def ended(self) -> bool:
        return self._events.ended

    def start(self) -> bytes:
        """response.created and response.in_progress, before the upstream said anything (once)."""
        return self._events.start()

    def feed(self, data: bytes) -> bytes:
        out = self._events.start()
        for event in self._sse.feed(data):
            if self._events.ended:
                break
            out += self._on_data(event.data)
        return out

    def close(self) -> bytes:
        """The upstream's stream ended: anything but a finished answer fails it."""
        out = self._events.start()
        for event in self._sse.finish():
            if not self._events.ended and _is_whole(event.data):
                out += self._on_data(event.data)
        return out + self._events.fail("upstream stream ended before [DONE]", "upstream_error")

    def fail(self, message: str, code: str) -> bytes:
        return self._events.fail(message, code)

    def _on_data(self, data: bytes) -> bytes:
        if data.strip() == b"[DONE]":
            return self._finish()
        try:
            chunk = _decode(data)
        except msgspec.DecodeError:
            return self._events.fail("upstream sent a stream event that is not JSON", "upstream_error")
        if not isinstance(chunk, dict):
            return self._events.fail("upstream sent a stream event that is not an object", "upstream_error")
        if chunk.get("error") is not None:
            message, code = _error_of(chunk["error"])
            return self._events.fail(f"upstream: {message}", code)
        if isinstance(chunk.get("usage"), Mapping):
            self.usage = usage_from_chat(chunk["usage"])
        out = b""
        for choice in chunk.get("choices") or []:
            if not isinstance(choice, Mapping) or choice.get("index", 0) != 0:
                continue  # iop never asks for n > 1
            delta = choice.get("delta")
            if isinstance(delta, Mapping):
                out += self._on_delta(delta)
            if choice.get("finish_reason"):
                self._finish_reason = choice["finish_reason"]
        return out

    def _on_delta(self, delta: Mapping[str, Any]) -> bytes:
        out = b""
        # vLLM / llama.cpp / DeepSeek name it reasoning_content; newer vLLM and Ollama, reasoning.
        reasoning = delta.get("reasoning_content") or delta.get("reasoning")
        if isinstance(reasoning, str):
            out += self._events.reasoning(reasoning)
        for field in ("content", "refusal"):
            if isinstance(delta.get(field), str):
                out += self._events.text(delta[field])
        for call in delta.get("tool_calls") or []:
            if isinstance(call, Mapping):
                out += self._on_tool_call(call)
        return out

    def _on_tool_call(self, delta: Mapping[str, Any]) -> bytes:
        index = delta["index"] if isinstance(delta.get("index"), int) else 0
        function = as_mapping(delta.get("function"))
        call_id, name, arguments = delta.get("id"), function.get("name"), function.get("arguments")
        call = self._calls.get(index)
        # A new id at a known index is a new call: some servers send every call at index 0.
        if call is None or (call_id and call.call_id and call_id != call.call_id):
            call = self._calls[index] = _ChatCall(self._keys, call_id, name)
            self._keys += 1
        call.call_id = call.call_id or call_id
        call.name = call.name or name
        if arguments is not None and not isinstance(arguments, str):
            arguments = _encode(arguments).decode()  # some servers send an object
        if call.opened:
            return self._events.arguments(call.key, arguments) if arguments else b""
        if arguments:
            call.held.append(arguments)
        return self._open(call) if call.name else b""

    def _open(self, call: _ChatCall) -> bytes:
        # The item is announced once its name is known; arguments seen before go out as one delta.
        call.opened = True
        origin = self._tools.origin(call.name or "")
        out = self._events.open_call(call.key, call.call_id or new_id("call_"), origin)
        out += self._events.arguments(call.key, "".join(call.held))
        call.held.clear()
        return out

    def _finish(self) -> bytes:
        out = b"".join(self._open(call) for call in self._calls.values() if not call.opened)
        return out + self._events.finish(self.usage, self._finish_reason)


def chat_finish_reason(response: Mapping[str, Any], called: bool) -> str:
    """The chat finish_reason for a finished response object."""
    if response.get("status") == "incomplete":
        details = response.get("incomplete_details")
        reason = details.get("reason") if isinstance(details, Mapping) else None
        return "content_filter" if reason == "content_filter" else "length"
    return "tool_calls" if called else "stop"


class _ResponsesCall:
    def __init__(self, index: int) -> None:
        self.index = index
        self.sent = ""


class ResponsesToChatStream:
    """A Responses event stream (bytes from the upstream) as chat.completion.chunk SSE (bytes for the client).

    `request` is the client's chat request (for `stream_options.include_usage`), `model` the
    name the client sees. Ends with the finish chunk, the usage chunk when asked for, and
    `data: [DONE]` on response.completed / response.incomplete; with an error event on
    response.failed, an `error` event, `fail()`, or `close()` before the response finished.
    """

    def __init__(self, request: Mapping[str, Any], model: str) -> None:
        options = request.get("stream_options")
        self._chunks = ChatChunks(model, isinstance(options, Mapping) and bool(options.get("include_usage")))
        self._sse = SseDecoder()
        self._calls: dict[str, _ResponsesCall] = {}
        self._streamed_text: set[str] = set()
        self.started = False
        self.ended = False
        self.usage: Usage | None = None

    def start(self) -> bytes:
        """The chunk that opens the assistant's message (once)."""
        if self.started:
            return b""
        self.started = True
        return self._chunks.role()

    def feed(self, data: bytes) -> bytes:
        if self.ended:
            return b""
        out = self.start()
        for event in self._sse.feed(data):
            out += self._on_event(event)
            if self.ended:
                break
        return out

    def close(self) -> bytes:
        """The upstream's stream ended: anything but a finished response fails it."""
        if self.ended:
            return b""
        out = self.start()
        for event in self._sse.finish():
            if not self.ended and _is_whole(event.data):
                out += self._on_event(event)
        return out + self.fail("upstream stream ended before the response finished", "upstream_error")

    def fail(self, message: str, code: str) -> bytes:
        if self.ended:
            return b""
        self.ended = True
        return self.start() + self._chunks.error(UpstreamError(message, code=code))

    def _on_event(self, sse: SseEvent) -> bytes:
        try:
            event = _decode(sse.data)
        except msgspec.DecodeError:
            return self.fail("upstream sent a stream event that is not JSON", "upstream_error")
        if not isinstance(event, dict):
            return self.fail("upstream sent a stream event that is not an object", "upstream_error")
        kind = event.get("type") or sse.event
        delta = event.get("delta")
        if kind == "response.output_text.delta" and isinstance(delta, str):
            self._streamed_text.add(str(event.get("item_id")))
            return self._chunks.content(delta) if delta else b""
        if kind == "response.refusal.delta" and isinstance(delta, str):
            self._streamed_text.add(str(event.get("item_id")))
            return self._chunks.refusal(delta)
        if kind in ("response.reasoning_text.delta", "response.reasoning_summary_text.delta"):
            return self._chunks.reasoning(delta) if isinstance(delta, str) and delta else b""
        if kind == "response.function_call_arguments.delta" and isinstance(delta, str):
            call = self._calls.get(str(event.get("item_id")))
            if call is None or not delta:
                return b""
            call.sent += delta
            return self._chunks.tool_call(call.index, None, None, delta)
        item = event.get("item")
        if kind == "response.output_item.added" and isinstance(item, Mapping):
            return self._on_item(item, done=False)
        if kind == "response.output_item.done" and isinstance(item, Mapping):
            return self._on_item(item, done=True)
        if kind in ("response.completed", "response.incomplete"):
            response = as_mapping(event.get("response"))
            if isinstance(response.get("usage"), Mapping):
                self.usage = usage_from_responses(response["usage"])
            status = "incomplete" if kind == "response.incomplete" else "completed"
            self.ended = True
            reason = chat_finish_reason({"status": status, **response}, bool(self._calls))
            return self._chunks.finish(reason, self.usage)
        if kind == "response.failed":
            message, code = _error_of(as_mapping(event.get("response")).get("error") or "the response failed")
            return self.fail(f"upstream: {message}", code)
        if kind == "error":
            message, code = _error_of(event)
            return self.fail(f"upstream: {message}", code)
        return b""

    def _on_item(self, item: Mapping[str, Any], done: bool) -> bytes:
        item_id = str(item.get("id"))
        if item.get("type") == "function_call":
            out = b""
            call = self._calls.get(item_id)
            if call is None:
                call = self._calls[item_id] = _ResponsesCall(len(self._calls))
                call_id = item.get("call_id") or new_id("call_")
                out = self._chunks.tool_call(call.index, call_id, str(item.get("name", "")), "")
            arguments = item.get("arguments")
            # Arguments the deltas did not carry (some servers only send them whole) go out now.
            if done and isinstance(arguments, str) and arguments.startswith(call.sent) and arguments != call.sent:
                out += self._chunks.tool_call(call.index, None, None, arguments[len(call.sent) :])
                call.sent = arguments
            return out
        if done and item.get("type") == "message" and item_id not in self._streamed_text:
            text = "".join(str(part.get("text", "")) for part in item.get("content") or [] if isinstance(part, Mapping))
            return self._chunks.content(text) if text else b""
        return b""
