"""Chat Completions answers: the chat.completion body and the chat.completion.chunk SSE stream."""

from __future__ import annotations

import secrets
import time
from typing import Any

import msgspec

from iop.errors import RequestError, error_event
from iop.openai.usage import Usage, chat_usage

_encode = msgspec.json.Encoder().encode

DONE = b"data: [DONE]\n\n"
_CONTENT_TAIL = b'},"logprobs":null,"finish_reason":null}]}\n\n'


def completion_id() -> str:
    return "chatcmpl-" + secrets.token_hex(12)


def chat_completion(
    model: str,
    content: str | None,
    finish_reason: str,
    usage: Usage | None,
    *,
    tool_calls: list[dict[str, Any]] | None = None,
    reasoning: str | None = None,
    refusal: str | None = None,
    created: int | None = None,
) -> dict[str, Any]:
    """A whole chat.completion body with one choice."""
    message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": refusal}
    if tool_calls:
        message["tool_calls"] = tool_calls
    if reasoning:
        # vLLM / llama.cpp / DeepSeek convention; the OpenAI SDK keeps unknown fields.
        message["reasoning_content"] = reasoning
    body: dict[str, Any] = {
        "id": completion_id(),
        "object": "chat.completion",
        "created": int(time.time()) if created is None else created,
        "model": model,
        "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason}],
    }
    if usage is not None:
        body["usage"] = chat_usage(usage)
    return body


class ChatChunks:
    """The chat.completion.chunk SSE events of one answer, one choice (index 0).

    Every chunk shares id, created and model, so the envelope is encoded once and only
    the delta is encoded per call (this is the mock model's hot path).
    """

    def __init__(self, model: str, include_usage: bool) -> None:
        self.include_usage = include_usage
        self._envelope = (
            b'data: {"id":"'
            + completion_id().encode()
            + b'","object":"chat.completion.chunk","created":'
            + str(int(time.time())).encode()
            + b',"model":'
            + _encode(model)
        )
        self._choice = self._envelope + b',"choices":[{"index":0,"delta":'
        self._content_head = self._choice + b'{"content":'

    def _chunk(self, delta: bytes, finish_reason: str | None = None) -> bytes:
        reason = b"null" if finish_reason is None else _encode(finish_reason)
        return self._choice + delta + b',"logprobs":null,"finish_reason":' + reason + b"}]}\n\n"

    def role(self) -> bytes:
        """The opening chunk that names the speaker."""
        return self._chunk(b'{"role":"assistant","content":""}')

    def content(self, text: str) -> bytes:
        return self._content_head + _encode(text) + _CONTENT_TAIL

    def reasoning(self, text: str) -> bytes:
        return self._chunk(b'{"reasoning_content":' + _encode(text) + b"}")

    def refusal(self, text: str) -> bytes:
        return self._chunk(b'{"refusal":' + _encode(text) + b"}")

    def tool_call(self, index: int, call_id: str | None, name: str | None, arguments: str) -> bytes:
        """A tool_calls delta: the first one for an index carries id and name, later ones only arguments."""
        call: dict[str, Any] = {"index": index}
        if call_id is not None:
            call["id"] = call_id
            call["type"] = "function"
        function: dict[str, str] = {"arguments": arguments}
        if name is not None:
            function["name"] = name
        call["function"] = function
        return self._chunk(b'{"tool_calls":' + _encode([call]) + b"}")

    def finish(self, finish_reason: str, usage: Usage | None) -> bytes:
        """The closing chunk, the usage chunk when the client asked for it, then [DONE]."""
        out = self._chunk(b"{}", finish_reason)
        if self.include_usage:
            counted = usage if usage is not None else Usage()
            out += self._envelope + b',"choices":[],"usage":' + _encode(chat_usage(counted)) + b"}\n\n"
        return out + DONE

    def error(self, exc: RequestError) -> bytes:
        """A terminal error event; the OpenAI SDK raises it as an APIError."""
        return error_event("chat", exc)
