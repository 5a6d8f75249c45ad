"""Token counts of one answer, and their shape in each OpenAI API."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec


def _count(value: object) -> int:
    # Upstreams send null or omit details they don't track; a count is never negative.
    return value if isinstance(value, int) and value > 0 else 0


def _detail(details: object, key: str) -> int:
    return _count(details.get(key)) if isinstance(details, Mapping) else 0


class Usage(msgspec.Struct):
    """Tokens read and written by one answer; details default to 0 when unknown."""

    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    """Of `input_tokens`, how many came from the upstream's prompt cache."""
    reasoning_tokens: int = 0
    """Of `output_tokens`, how many were reasoning."""

    def chat(self) -> dict[str, Any]:
        """The chat.completion `usage` object."""
        return {
            "prompt_tokens": self.input_tokens,
            "completion_tokens": self.output_tokens,
            "total_tokens": self.input_tokens + self.output_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
            "completion_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
        }

    def responses(self) -> dict[str, Any]:
        """The Responses API `usage` object."""
        return {
            "input_tokens": self.input_tokens,
            "input_tokens_details": {"cached_tokens": self.cached_tokens, "cache_write_tokens": 0},
            "output_tokens": self.output_tokens,
            "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
            "total_tokens": self.input_tokens + self.output_tokens,
        }

    @classmethod
    def from_chat(cls, usage: Mapping[str, Any]) -> Usage:
        return cls(
            input_tokens=_count(usage.get("prompt_tokens")),
            output_tokens=_count(usage.get("completion_tokens")),
            cached_tokens=_detail(usage.get("prompt_tokens_details"), "cached_tokens"),
            reasoning_tokens=_detail(usage.get("completion_tokens_details"), "reasoning_tokens"),
        )

    @classmethod
    def from_responses(cls, usage: Mapping[str, Any]) -> Usage:
        return cls(
            input_tokens=_count(usage.get("input_tokens")),
            output_tokens=_count(usage.get("output_tokens")),
            cached_tokens=_detail(usage.get("input_tokens_details"), "cached_tokens"),
            reasoning_tokens=_detail(usage.get("output_tokens_details"), "reasoning_tokens"),
        )
