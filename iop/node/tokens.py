"""Token counts read from an upstream's own answer: the `usage` object, in either OpenAI API.

Whole answers are decoded for `usage` alone (msgspec skips the rest). Streams are not parsed
chunk by chunk: `UsageTail` keeps the last bytes and reads the final usage (the chat chunk with
empty `choices`, or the Responses `response.completed` event) once, when the stream has ended.
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
    start = last.end()
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
