"""The fields the edge reads of a Messages, embeddings or completions request (chat and Responses: api.py).

As for chat and Responses, the edge checks the types of what iop reads or translates, so a wrongly
typed field is a 400 naming it here, never a failure on a node that would count against the provider;
everything else passes through unread.
"""

from __future__ import annotations

import msgspec

from iop import wire
from iop.errors import BadRequest


class _Object(msgspec.Struct):
    """Any JSON object (its fields unread)."""


class _Turn(msgspec.Struct):
    """A Messages turn as far as the edge checks it: a string `role`, content a string or blocks."""

    role: str
    content: str | list[_Object]


class _Metadata(msgspec.Struct):
    user_id: str | None = None


class MessagesHead(msgspec.Struct):
    model: str
    messages: list[_Turn]
    max_tokens: int
    stream: bool = False
    system: str | list[_Object] | None = None
    tools: list[_Object] | None = None
    stop_sequences: list[str] | None = None
    metadata: _Metadata | None = None
    """Claude Code's `user_id` names its session (a JSON string holding session_id): a session key."""


class CountTokensHead(msgspec.Struct):
    """`/v1/messages/count_tokens` takes a Messages request without `max_tokens`."""

    model: str
    messages: list[_Turn]
    system: str | list[_Object] | None = None
    tools: list[_Object] | None = None


class EmbeddingsHead(msgspec.Struct):
    model: str
    input: str | list[str | int | list[int]]
    """A text, or a batch: texts, one input's token ids, or several inputs' token ids."""
    encoding_format: str | None = None
    user: str | None = None


class CompletionsHead(msgspec.Struct):
    model: str
    prompt: str | list[str | int | list[int]]
    stream: bool = False
    suffix: str | None = None
    user: str | None = None


messages_head = msgspec.json.Decoder(MessagesHead).decode
count_tokens_head = msgspec.json.Decoder(CountTokensHead).decode
embeddings_head = msgspec.json.Decoder(EmbeddingsHead).decode
completions_head = msgspec.json.Decoder(CompletionsHead).decode


def other_head(api: wire.Api, body: bytes) -> tuple[str, bool, str | None]:
    """The model, stream flag and session key of a Messages, embeddings or completions body.

    Raises msgspec's errors for the caller (api.parse_head) to turn into the 400 naming the field.
    """
    if api == "messages":
        msg = messages_head(body)
        if not msg.messages:
            raise BadRequest("'messages' must not be empty", param="messages")
        if msg.max_tokens < 1:
            raise BadRequest("'max_tokens' must be a positive integer", param="max_tokens")
        return msg.model, msg.stream, msg.metadata.user_id if msg.metadata is not None else None
    if api == "embeddings":
        emb = embeddings_head(body)
        if not emb.input:
            raise BadRequest("'input' must not be empty", param="input")
        return emb.model, False, emb.user
    comp = completions_head(body)
    return comp.model, comp.stream, comp.user
