"""Token counts read from an upstream's own answer: the `usage` object, in the OpenAI APIs and Messages.

Whole answers are decoded for `usage` alone (msgspec skips the rest). Streams are not parsed
chunk by chunk: `UsageTail` keeps the last bytes and reads the final usage (the chat chunk with
empty `choices`, the Responses `response.completed` event, Messages' `message_delta`) once, when
the stream has ended; `OpeningUsage` reads a Messages stream's input tokens from its first event.
"""

from __future__ import annotations

import re

import msgspec

from iop import wire

TAIL_BYTES = 64 * 1024
"""How much of a stream's end is kept: the usage chunk / event's usage sits in its last bytes."""


class _Details(msgspec.Struct):
    cached_tokens: int | None = None
    reasoning_tokens: int | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    input_tokens: int | None = None
    output_tokens: int | None = None
    prompt_tokens_details: _Details | None = None
    completion_tokens_details: _Details | None = None
    input_tokens_details: _Details | None = None
    output_tokens_details: _Details | None = None


class _Answer(msgspec.Struct):
    usage: _Usage | None = None


_answer = msgspec.json.Decoder(_Answer).decode
_usage = msgspec.json.Decoder(_Usage | None).decode
_KEY = re.compile(rb'"usage"\s*:\s*')


def _convert(u: _Usage | None) -> wire.Usage | None:
    if u is None:
        return None
    inp = u.prompt_tokens if u.prompt_tokens is not None else u.input_tokens
    out = u.completion_tokens if u.completion_tokens is not None else u.output_tokens
    if inp is None and out is None:
        return None
    in_d = u.prompt_tokens_details or u.input_tokens_details
    out_d = u.completion_tokens_details or u.output_tokens_details
    return wire.Usage(
        inp or 0,
        out or 0,
        in_d.cached_tokens if in_d is not None else None,
        out_d.reasoning_tokens if out_d is not None else None,
    )


def usage_of_body(body: bytes) -> wire.Usage | None:
    """The usage of a whole JSON answer (chat.completion or response); None when it has none."""
    try:
        return _convert(_answer(body).usage)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def usage_in_tail(tail: bytes) -> wire.Usage | None:
    """The last `"usage": {...}` object in the end of a stream."""
    last = None
    for last in _KEY.finditer(tail):  # noqa: B007 - the last match is the one wanted
        pass
    if last is None:
        return None
    return _usage_after(tail, last.end())


def usage_in_head(head: bytes) -> wire.Usage | None:
    """The first `"usage": {...}` object in the start of a stream."""
    first = _KEY.search(head)
    return _usage_after(head, first.end()) if first is not None else None


def _usage_after(tail: bytes, start: int) -> wire.Usage | None:
    if tail[start : start + 1] != b"{":
        return None  # "usage": null
    depth = 0
    # A usage object holds numbers and nested objects only, so braces can be counted plainly.
    for i in range(start, min(len(tail), start + 4096)):
        c = tail[i]
        if c == 0x7B:
            depth += 1
        elif c == 0x7D:
            depth -= 1
            if depth == 0:
                try:
                    return _convert(_usage(tail[start : i + 1]))
                except (msgspec.DecodeError, msgspec.ValidationError):
                    return None
    return None


class UsageTail:
    """Keeps the last TAIL_BYTES of a stream; amortised cost per chunk is one append."""

    __slots__ = ("parts", "size")

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.size = 0

    def feed(self, data: bytes) -> None:
        self.parts.append(data)
        self.size += len(data)
        if self.size > 4 * TAIL_BYTES:
            kept = b"".join(self.parts)[-TAIL_BYTES:]
            self.parts = [kept]
            self.size = len(kept)

    def usage(self) -> wire.Usage | None:
        return usage_in_tail(b"".join(self.parts)[-TAIL_BYTES:])


class OpeningUsage:
    """The usage of a stream's first event (Messages' `message_start` holds the input tokens; its
    last, `message_delta`, often only the output). Reads the first HEAD_BYTES, then nothing."""

    HEAD_BYTES = 16 * 1024
    __slots__ = ("head", "usage")

    def __init__(self) -> None:
        self.head = b""
        self.usage: wire.Usage | None = None

    def feed(self, data: bytes) -> None:
        if self.usage is not None or len(self.head) >= self.HEAD_BYTES:
            return
        self.head += data[: self.HEAD_BYTES - len(self.head)]
        self.usage = usage_in_head(self.head)

    def merge(self, closing: wire.Usage | None) -> wire.Usage | None:
        """The closing usage, its missing input tokens taken from the opening one."""
        if self.usage is None or closing is None:
            return closing or self.usage
        if closing.input_tokens:
            return closing
        return wire.Usage(
            self.usage.input_tokens, closing.output_tokens, closing.cached_tokens, closing.reasoning_tokens
        )
