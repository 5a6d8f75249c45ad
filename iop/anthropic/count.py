"""`POST /v1/messages/count_tokens` without the upstream's tokenizer: a documented estimate.

The estimate is what the translated chat request carries — every message's text, every tool call's
arguments, the tools' names, descriptions and schemas — at 4 UTF-8 bytes a token (the usual ratio for
English and code with BPE tokenizers), plus 4 tokens per message for the chat template's framing,
rounded up. It is meant for a client's context bookkeeping (Claude Code's compaction threshold), not
for billing; an upstream that serves `/tokenize` gives the exact figure instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

_encode = msgspec.json.Encoder().encode
BYTES_PER_TOKEN = 4
TOKENS_PER_MESSAGE = 4


def estimate_input_tokens(chat_body: Mapping[str, Any]) -> int:
    """The estimated prompt tokens of a chat request (`messages_to_chat_request(...).body`)."""
    size = 0
    messages = chat_body.get("messages") or []
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            size += len(content.encode())
        elif isinstance(content, list):
            size += sum(len(part.get("text", "").encode()) for part in content if isinstance(part, Mapping))
        for call in message.get("tool_calls") or []:
            size += len(_encode(call))
    for tool in chat_body.get("tools") or []:
        size += len(_encode(tool))
    return -(-size // BYTES_PER_TOKEN) + TOKENS_PER_MESSAGE * len(messages)
