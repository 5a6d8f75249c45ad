"""Token counts of one answer (`iop.wire.Usage`, the type the node reports) in each OpenAI API's shape."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from iop.wire import Usage

__all__ = ["Usage", "chat_usage", "responses_usage", "usage_from_chat", "usage_from_responses"]


def _count(value: object) -> int:
    # Upstreams send null or omit counts they don't track; a count is never negative.
    return value if isinstance(value, int) and value > 0 else 0


def _detail(details: object, key: str) -> int | None:
    if not isinstance(details, Mapping):
        return None
    value = details.get(key)
    return _count(value) if isinstance(value, int) else None


def chat_usage(usage: Usage) -> dict[str, Any]:
    """The chat.completion `usage` object (details the upstream did not report read 0)."""
    return {
        "prompt_tokens": usage.input_tokens,
        "completion_tokens": usage.output_tokens,
        "total_tokens": usage.input_tokens + usage.output_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens or 0},
        "completion_tokens_details": {"reasoning_tokens": usage.reasoning_tokens or 0},
    }


def responses_usage(usage: Usage) -> dict[str, Any]:
    """The Responses API `usage` object (details the upstream did not report read 0)."""
    return {
        "input_tokens": usage.input_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens or 0, "cache_write_tokens": 0},
        "output_tokens": usage.output_tokens,
        "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens or 0},
        "total_tokens": usage.input_tokens + usage.output_tokens,
    }


def usage_from_chat(usage: Mapping[str, Any]) -> Usage:
    """The counts of a chat.completion `usage` object, read defensively."""
    return Usage(
        input_tokens=_count(usage.get("prompt_tokens")),
        output_tokens=_count(usage.get("completion_tokens")),
        cached_tokens=_detail(usage.get("prompt_tokens_details"), "cached_tokens"),
        reasoning_tokens=_detail(usage.get("completion_tokens_details"), "reasoning_tokens"),
    )


def usage_from_responses(usage: Mapping[str, Any]) -> Usage:
    """The counts of a Responses API `usage` object, read defensively."""
    return Usage(
        input_tokens=_count(usage.get("input_tokens")),
        output_tokens=_count(usage.get("output_tokens")),
        cached_tokens=_detail(usage.get("input_tokens_details"), "cached_tokens"),
        reasoning_tokens=_detail(usage.get("output_tokens_details"), "reasoning_tokens"),
    )
