"""A chat completion as the Messages answer an Anthropic client expects, and the pieces the stream shares."""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from typing import Any

import msgspec

from iop.errors import UpstreamError
from iop.openai.usage import Usage, usage_from_chat

_decode = msgspec.json.Decoder().decode

_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "function_call": "tool_use"}


def new_message_id() -> str:
    return "msg_" + secrets.token_hex(12)


def stop_reason(finish_reason: object, matched: object = None) -> str:
    """Anthropic's `stop_reason` for a chat `finish_reason`; `matched` is the stop string some servers name."""
    if finish_reason == "stop" and isinstance(matched, str) and matched:
        return "stop_sequence"
    if finish_reason == "content_filter":
        return "refusal"
    return _STOP_REASONS.get(str(finish_reason), "end_turn")


def messages_usage(usage: Usage | None) -> dict[str, int]:
    """Anthropic's usage object: `input_tokens` excludes what the server read from its prefix cache."""
    if usage is None:
        return {"input_tokens": 0, "output_tokens": 0, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}
    cached = usage.cached_tokens or 0
    return {
        "input_tokens": max(usage.input_tokens - cached, 0),
        "output_tokens": usage.output_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
    }


def tool_input(arguments: object) -> dict[str, Any]:
    """A chat call's `arguments` (a JSON string) as a tool_use `input` object; what is not an object stays readable."""
    if isinstance(arguments, Mapping):
        return dict(arguments)
    if not isinstance(arguments, str) or not arguments.strip():
        return {}
    try:
        value = _decode(arguments)
    except msgspec.DecodeError:
        return {"input": arguments}
    return value if isinstance(value, dict) else {"input": value}


def reasoning_of(message: Mapping[str, Any]) -> str | None:
    """The reasoning text servers put beside the content (vLLM's `reasoning_content`, others' `reasoning`)."""
    for key in ("reasoning_content", "reasoning"):
        value = message.get(key)
        if isinstance(value, str) and value:
            return value
    return None


def chat_to_messages_answer(body: bytes, model: str) -> dict[str, Any]:
    """The Messages answer for a whole chat completion (`body`, bytes from the upstream)."""
    try:
        answer = _decode(body)
    except msgspec.DecodeError as exc:
        raise UpstreamError("upstream answered with a body that is not JSON", code="upstream_bad_answer") from exc
    if not isinstance(answer, Mapping):
        raise UpstreamError("upstream answered with JSON that is not an object", code="upstream_bad_answer")
    choices = answer.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], Mapping):
        raise UpstreamError("upstream answer has no choices", code="upstream_bad_answer")
    choice = choices[0]
    message = choice.get("message")
    message = message if isinstance(message, Mapping) else {}
    content: list[dict[str, Any]] = []
    if (thinking := reasoning_of(message)) is not None:
        content.append({"type": "thinking", "thinking": thinking, "signature": ""})
    text = message.get("content")
    if isinstance(text, str) and text:
        content.append({"type": "text", "text": text})
    calls = message.get("tool_calls")
    for call in calls if isinstance(calls, list) else []:
        if not isinstance(call, Mapping) or not isinstance(fn := call.get("function"), Mapping):
            continue
        content.append(
            {
                "type": "tool_use",
                "id": str(call.get("id") or "toolu_" + secrets.token_hex(12)),
                "name": str(fn.get("name") or ""),
                "input": tool_input(fn.get("arguments")),
            }
        )
    usage = answer.get("usage")
    reason = stop_reason(choice.get("finish_reason"), choice.get("stop_reason"))
    if reason == "end_turn" and any(block["type"] == "tool_use" for block in content):
        reason = "tool_use"  # some servers say "stop" after a call
    return {
        "id": new_message_id(),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": choice.get("stop_reason") if reason == "stop_sequence" else None,
        "usage": messages_usage(usage_from_chat(usage) if isinstance(usage, Mapping) else None),
    }
