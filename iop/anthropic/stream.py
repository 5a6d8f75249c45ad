"""A chat completion stream as Anthropic's Messages event stream, fed bytes at any boundary.

The events, in Anthropic's order: `message_start` and a `ping`; per content block
`content_block_start`, its deltas (`thinking_delta`, `text_delta`, `input_json_delta` for a tool's
input), `content_block_stop`; then `message_delta` (stop reason, usage) and `message_stop`. A chat
server streams reasoning, text and tool calls interleaved only in that order in practice; a new kind
of delta closes the open block and opens the next. An upstream error, undecodable data, or a stream
that ends before `[DONE]` becomes an `error` event, the stream's last.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import msgspec

from iop.anthropic.answer import messages_usage, new_message_id, reasoning_of, stop_reason
from iop.openai.sse import SseDecoder
from iop.openai.usage import Usage, usage_from_chat

_decode = msgspec.json.Decoder().decode
_encode = msgspec.json.Encoder().encode


def sse(event: str, data: Mapping[str, Any]) -> bytes:
    """One Messages event as SSE bytes (the `event:` line names the `type` the data carries)."""
    return b"event: " + event.encode() + b"\ndata: " + _encode(data) + b"\n\n"


class ChatToMessagesStream:
    """Chat SSE bytes from the upstream in, Messages SSE bytes for the client out.

    `model` is the name the client sees. `start()` gives `message_start` (once; `feed` calls it
    if the caller did not); `feed` returns what each piece completes; `close()` ends a stream the
    upstream left unfinished with an `error` event. `usage` holds the upstream's counts once sent.
    """

    def __init__(self, model: str) -> None:
        self._model = model
        self._id = new_message_id()
        self._sse = SseDecoder()
        self._started = False
        self._index = -1
        self._open: str | None = None  # "thinking", "text", or "tool:<chat index>"
        self._finish: object = None
        self._matched: object = None
        self._saw_call = False
        self.usage: Usage | None = None
        self.ended = False

    def start(self) -> bytes:
        if self._started:
            return b""
        self._started = True
        message: dict[str, Any] = {
            "id": self._id,
            "type": "message",
            "role": "assistant",
            "model": self._model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": messages_usage(None),
        }
        return sse("message_start", {"type": "message_start", "message": message}) + sse("ping", {"type": "ping"})

    def feed(self, data: bytes) -> bytes:
        if self.ended:
            return b""
        out = [self.start()]
        for event in self._sse.feed(data):
            out.append(self._event(event.data))
            if self.ended:
                break
        return b"".join(out)

    def close(self) -> bytes:
        """What the upstream's end of body completes: the last event, or an error if [DONE] never came."""
        if self.ended:
            return b""
        out = [self.start()]
        for event in self._sse.finish():
            out.append(self._event(event.data))
        if not self.ended:
            out.append(self.fail("the upstream's stream ended before its final event: the answer was cut short"))
        return b"".join(out)

    def fail(self, message: str, kind: str = "api_error") -> bytes:
        """An `error` event ends the stream (Anthropic's way to fail a stream already under way)."""
        if self.ended:
            return b""
        self.ended = True
        return self.start() + sse("error", {"type": "error", "error": {"type": kind, "message": message}})

    def _event(self, data: bytes) -> bytes:
        if data.strip() == b"[DONE]":
            return self._finish_message()
        try:
            chunk = _decode(data)
        except msgspec.DecodeError:
            return self.fail("the upstream sent an event that is not JSON")
        if not isinstance(chunk, Mapping):
            return b""
        if (error := chunk.get("error")) is not None:
            message = error.get("message") if isinstance(error, Mapping) else error
            return self.fail(f"upstream: {message or 'error'}")
        if isinstance(usage := chunk.get("usage"), Mapping):
            self.usage = usage_from_chat(usage)
        choices = chunk.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], Mapping):
            return b""
        choice = choices[0]
        if choice.get("finish_reason") is not None:
            self._finish = choice.get("finish_reason")
            self._matched = choice.get("stop_reason")
        delta = choice.get("delta")
        if not isinstance(delta, Mapping):
            return b""
        out: list[bytes] = []
        if (thinking := reasoning_of(delta)) is not None:
            out.append(self._delta("thinking", {"type": "thinking_delta", "thinking": thinking}))
        text = delta.get("content")
        if isinstance(text, str) and text:
            out.append(self._delta("text", {"type": "text_delta", "text": text}))
        calls = delta.get("tool_calls")
        for call in calls if isinstance(calls, list) else []:
            if isinstance(call, Mapping):
                out.append(self._call(call))
        return b"".join(out)

    def _delta(self, kind: str, delta: dict[str, Any]) -> bytes:
        out = b""
        if self._open != kind:
            block: dict[str, Any] = (
                {"type": "thinking", "thinking": "", "signature": ""}
                if kind == "thinking"
                else {"type": "text", "text": ""}
            )
            out = self._open_block(kind, block)
        return out + sse("content_block_delta", {"type": "content_block_delta", "index": self._index, "delta": delta})

    def _call(self, call: Mapping[str, Any]) -> bytes:
        key = f"tool:{call.get('index', 0)}"
        fn = call.get("function")
        fn = fn if isinstance(fn, Mapping) else {}
        out = b""
        if self._open != key:
            self._saw_call = True
            block = {
                "type": "tool_use",
                "id": str(call.get("id") or "toolu_" + self._id[4:]),
                "name": str(fn.get("name") or ""),
                "input": {},
            }
            out = self._open_block(key, block)
        arguments = fn.get("arguments")
        if isinstance(arguments, Mapping):
            arguments = json.dumps(arguments)
        if isinstance(arguments, str) and arguments:
            out += sse(
                "content_block_delta",
                {
                    "type": "content_block_delta",
                    "index": self._index,
                    "delta": {"type": "input_json_delta", "partial_json": arguments},
                },
            )
        return out

    def _open_block(self, key: str, block: dict[str, Any]) -> bytes:
        out = self._close_block()
        self._index += 1
        self._open = key
        return out + sse(
            "content_block_start", {"type": "content_block_start", "index": self._index, "content_block": block}
        )

    def _close_block(self) -> bytes:
        if self._open is None:
            return b""
        self._open = None
        return sse("content_block_stop", {"type": "content_block_stop", "index": self._index})

    def _finish_message(self) -> bytes:
        out = self._close_block()
        self.ended = True
        reason = stop_reason(self._finish, self._matched)
        if reason == "end_turn" and self._saw_call:
            reason = "tool_use"
        delta = {"stop_reason": reason, "stop_sequence": self._matched if reason == "stop_sequence" else None}
        usage = messages_usage(self.usage)
        out += sse("message_delta", {"type": "message_delta", "delta": delta, "usage": usage})
        return out + sse("message_stop", {"type": "message_stop"})
